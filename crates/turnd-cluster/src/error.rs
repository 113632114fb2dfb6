//! The cluster's log layer's one error type, and how it reaches the store: as a
//! [`StoreError`] whose text names what happened, since the store's commit path
//! takes nothing else.

use turnd_store::StoreError;

/// What went wrong in the log layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogError {
    /// Another writer's message took the place this node's append needed: this
    /// node no longer leads the partition and must stop serving it.
    #[error("deposed: {0}")]
    Deposed(String),
    /// This node's claim to lead did not land where it had to: another leads.
    #[error("not the leader: {0}")]
    NotLeader(String),
    /// The stream refused the append for good (full, too large); nothing of it was
    /// written.
    #[error("refused by the stream (nothing written): {0}")]
    Refused(String),
    /// The stream is full (`max_bytes`, `discard: new`): nothing of the append was
    /// written. Reaches the store as a full disk does.
    #[error("the partition's stream is full (nothing written): {0}")]
    Full(String),
    /// The append was still in doubt when the node asked the log to stop.
    #[error("stopped with an append in doubt: {0}")]
    Stopped(String),
    /// The store's applied mark is before the stream's first message: the
    /// records in between were trimmed, and the store must be copied from a peer.
    #[error(
        "the store's applied mark {applied} is behind the stream's first message {first_seq}: copy a peer's checkpoint"
    )]
    Behind { applied: u64, first_seq: u64 },
    /// A message that does not decode.
    #[error("corrupt message: {0}")]
    Corrupt(String),
    /// NATS failed (a request, a connection), or answered what was not expected.
    #[error("nats: {0}")]
    Nats(String),
    /// A setting or a server the cluster cannot run with.
    #[error("{0}")]
    Config(String),
}

impl LogError {
    pub(crate) fn nats(what: &str, e: impl std::fmt::Display) -> LogError {
        LogError::Nats(format!("{what}: {e}"))
    }
}

impl From<LogError> for StoreError {
    fn from(e: LogError) -> StoreError {
        match e {
            LogError::Corrupt(s) => StoreError::Corrupt(s),
            LogError::Full(_) => StoreError::Io {
                op: turnd_store::IoOp::Write,
                kind: std::io::ErrorKind::StorageFull,
                detail: e.to_string(),
            },
            LogError::Behind { .. } | LogError::Nats(_) | LogError::Config(_) => {
                StoreError::Read(e.to_string())
            }
            // Not a refusal: the group may count, and must not be answered as one.
            LogError::Stopped(_) => StoreError::InDoubt(e.to_string()),
            _ => StoreError::Write(e.to_string()),
        }
    }
}
