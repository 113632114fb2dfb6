//! The store's one error type: what failed (a write, a sync, a read, a record that
//! does not decode, a store that is closed) and, for a failure the operating system
//! reported, its kind, so that callers can tell a full disk from other failures.
//! Every layer of the store returns it, so it sits below all of them.

/// A storage failure. The engine answers requests whose write failed with
/// `unavailable` and retries internal transitions.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("storage write failed: {0}")]
    Write(String),
    #[error("storage sync failed: {0}")]
    Sync(String),
    #[error("storage read failed: {0}")]
    Read(String),
    /// A failure the operating system reported, with its kind, so that a full disk
    /// can be told from other failures ([`StoreError::io_kind`]).
    #[error("storage {op} failed: {detail}")]
    Io {
        op: IoOp,
        kind: std::io::ErrorKind,
        detail: String,
    },
    #[error("stored record is corrupt: {0}")]
    Corrupt(String),
    #[error("storage is closed")]
    Closed,
    /// A write whose fate is unknown: the log stopped (its node gave up leading)
    /// while the write was neither known to count nor known not to. Unlike every
    /// other error, it does not say that nothing was written.
    #[error("storage write in doubt: {0}")]
    InDoubt(String),
}

/// What a storage operation that failed with an I/O error was doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoOp {
    Write,
    Sync,
    Read,
}

impl std::fmt::Display for IoOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IoOp::Write => "write",
            IoOp::Sync => "sync",
            IoOp::Read => "read",
        })
    }
}

impl StoreError {
    /// An I/O error of `op`, described by `what` and the error, keeping its kind.
    pub fn io(op: IoOp, what: impl std::fmt::Display, e: &std::io::Error) -> StoreError {
        StoreError::Io {
            op,
            kind: e.kind(),
            detail: format!("{what}: {e}"),
        }
    }

    /// The kind of the I/O error behind this failure, when it came from one.
    pub fn io_kind(&self) -> Option<std::io::ErrorKind> {
        match self {
            StoreError::Io { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// Whether the disk (or the user's quota on it) is full.
    pub fn is_disk_full(&self) -> bool {
        matches!(
            self.io_kind(),
            Some(std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded)
        )
    }
}
