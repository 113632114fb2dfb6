//! What can go wrong in a request to the engine.
//!
//! Each variant says what happened; its text is the message a caller reads. Which
//! protocol error code a variant is answered with is decided by the network faces
//! (`turnd-server`'s `error` module for protocol v1, `turnd-iii` for iii), not here.

use turnd_store::StoreError;

/// A request the engine refused or could not carry out. A refused request changed
/// nothing.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    /// A caller-chosen id (session, function, worker, idempotency key) is empty, too
    /// long or holds control characters.
    #[error("`{what}` must be 1 to {max} bytes with no control characters")]
    BadId { what: &'static str, max: usize },
    /// A numeric argument outside what the op accepts; `allowed` says what is.
    #[error("`{field}` must be {allowed}")]
    OutOfRange {
        field: &'static str,
        allowed: String,
    },
    /// A worker `hello` without `worker_id`.
    #[error("a worker `hello` needs `worker_id`")]
    NoWorkerId,
    /// A `watch` that names neither or both of a session and a turn.
    #[error("give exactly one of `session_id` and `turn_id`")]
    WatchTarget,
    /// A page cursor that is not the `next` of an earlier page in this order.
    #[error("`after` must be the `next` of a previous page in the same order")]
    BadCursor,
    /// A turn's `input` over `turns.max_value_bytes`.
    #[error("`input` is larger than max_value_bytes ({max})")]
    InputTooLarge { max: u64 },
    #[error("no turn {0} exists")]
    NoTurn(String),
    #[error("no session {0} exists")]
    NoSession(String),
    #[error("no invocation {0} exists")]
    NoInvocation(String),
    #[error("no watch {0} on this connection")]
    NoWatch(String),
    #[error("function {function_id} is not registered on this connection")]
    NotRegistered { function_id: String },
    /// A worker reported on an invocation that is no longer its session's current
    /// one (it was stopped, timed out or replaced).
    #[error("invocation {invocation_id} is not current; stop it")]
    NotCurrent { invocation_id: String },
    /// A worker acted on an invocation dispatched to another worker.
    #[error("invocation {invocation_id} was not dispatched to worker {worker_id}")]
    NotYourInvocation {
        invocation_id: String,
        worker_id: String,
    },
    /// An idempotency key given again with another function or input.
    #[error(
        "idempotency key {key:?} was used for turn {turn_id} with a different function_id or input"
    )]
    IdempotencyConflict { key: String, turn_id: String },
    /// The session already holds `turns.max_queued_per_session` unfinished turns.
    #[error("session {session_id} already holds {held} unfinished turns (max_queued_per_session)")]
    QueueFull { session_id: String, held: usize },
    /// The connection already holds `server.max_watches_per_connection` watches.
    #[error("at most {max} watches per connection")]
    TooManyWatches { max: usize },
    /// The request's write failed: nothing was changed and it may be sent again.
    #[error("{0}; nothing was changed, retry later")]
    NotWritten(StoreError),
    /// A read of the store failed.
    #[error("{0}")]
    ReadFailed(StoreError),
    /// An invariant of the engine broke (a bug).
    #[error("{0}")]
    Invariant(String),
}

impl EngineError {
    pub(crate) fn out_of_range(field: &'static str, allowed: impl Into<String>) -> Self {
        EngineError::OutOfRange {
            field,
            allowed: allowed.into(),
        }
    }

    pub(crate) fn invariant(what: impl Into<String>) -> Self {
        EngineError::Invariant(what.into())
    }

    /// The storage failure behind this error, if it is one.
    pub fn store_error(&self) -> Option<&StoreError> {
        match self {
            EngineError::NotWritten(e) | EngineError::ReadFailed(e) => Some(e),
            _ => None,
        }
    }

    /// Whether the disk was full: the request failed because nothing more could be
    /// written, not because of a fault of the disk or of the engine.
    pub fn is_disk_full(&self) -> bool {
        self.store_error().is_some_and(StoreError::is_disk_full)
    }
}

/// What a request to the engine returns.
pub type EngineResult<T> = Result<T, EngineError>;
