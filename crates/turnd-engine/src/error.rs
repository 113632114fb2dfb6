//! What can go wrong in a request to the engine, and the protocol error code each
//! failure is answered with.
//!
//! Each variant says what happened; its text is the message a caller reads.
//! [`EngineError::code`] is the one table from a variant to its protocol error code
//! (`docs/protocol.md`, "Error codes"), and so to whether it is retryable: protocol
//! v1 and the iii endpoint both answer with it, so a refusal reads the same over
//! either.

use turnd_proto::{ErrorBody, ErrorCode};
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
    /// A worker `hello` on a connection opened before the one the worker attached
    /// last: the worker gave this connection up, and its lists are out of date.
    #[error("worker {0} attached a newer connection; this hello is stale")]
    StaleHello(String),
    /// The session already holds `turns.max_queued_per_session` unfinished turns.
    #[error("session {session_id} already holds {held} unfinished turns (max_queued_per_session)")]
    QueueFull { session_id: String, held: usize },
    /// The connection already holds `server.max_watches_per_connection` watches.
    #[error("at most {max} watches per connection")]
    TooManyWatches { max: usize },
    /// A submit with `on_busy: "reject"` found unfinished turns in its session.
    #[error("session {session_id} has {unfinished} unfinished turn(s) (lock holder {holder}); on_busy is reject")]
    Busy {
        session_id: String,
        unfinished: usize,
        holder: String,
    },
    /// A `turn.resume` of a turn that is not awaiting input.
    #[error("turn {turn_id} is not awaiting input: {doing}")]
    NotAwaitingInput { turn_id: String, doing: String },
    /// A resume's idempotency key given again with another input.
    #[error("idempotency key {key:?} resumed turn {turn_id} with a different input")]
    ResumeKeyConflict { key: String, turn_id: String },
    /// Progress `data` over `turns.max_progress_bytes`.
    #[error("progress `data` is larger than max_progress_bytes ({max})")]
    ProgressTooLarge { max: u64 },
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

    /// The protocol error code this error is answered with; whether a caller may
    /// retry follows from it ([`ErrorCode::retryable`]).
    pub fn code(&self) -> ErrorCode {
        match self {
            EngineError::BadId { .. }
            | EngineError::OutOfRange { .. }
            | EngineError::NoWorkerId
            | EngineError::WatchTarget
            | EngineError::BadCursor => ErrorCode::BadRequest,
            EngineError::InputTooLarge { .. } | EngineError::ProgressTooLarge { .. } => {
                ErrorCode::TooLarge
            }
            EngineError::Busy { .. } => ErrorCode::Busy,
            EngineError::NoTurn(_)
            | EngineError::NoSession(_)
            | EngineError::NoInvocation(_)
            | EngineError::NoWatch(_)
            | EngineError::NotRegistered { .. }
            | EngineError::NotCurrent { .. } => ErrorCode::NotFound,
            EngineError::NotYourInvocation { .. } => ErrorCode::Forbidden,
            EngineError::IdempotencyConflict { .. }
            | EngineError::StaleHello(_)
            | EngineError::NotAwaitingInput { .. }
            | EngineError::ResumeKeyConflict { .. } => ErrorCode::Conflict,
            EngineError::QueueFull { .. } | EngineError::TooManyWatches { .. } => {
                ErrorCode::RateLimited
            }
            EngineError::NotWritten(_) | EngineError::ReadFailed(_) => ErrorCode::Unavailable,
            EngineError::Invariant(_) => ErrorCode::Internal,
        }
    }
}

/// An engine error as the `error` of a protocol answer: its code, its text as the
/// message, and the code's retryable flag.
impl From<EngineError> for ErrorBody {
    fn from(e: EngineError) -> ErrorBody {
        match &e {
            // Not `unavailable`, which says nothing changed: the write may count.
            EngineError::NotWritten(StoreError::InDoubt(_)) => ErrorBody::in_doubt(e.to_string()),
            _ => ErrorBody::new(e.code(), e.to_string()),
        }
    }
}

/// What a request to the engine returns.
pub type EngineResult<T> = Result<T, EngineError>;

const MAX_ID_BYTES: usize = 256;

/// Validate a caller-chosen id (session, function, worker, idempotency key).
pub(crate) fn check_id(what: &'static str, s: &str) -> EngineResult<()> {
    if s.is_empty() || s.len() > MAX_ID_BYTES || s.chars().any(|c| c.is_control()) {
        return Err(EngineError::BadId {
            what,
            max: MAX_ID_BYTES,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One of every engine error, with the code and message protocol v1 answers it
    /// with (the messages are those the daemon has always sent).
    fn every_error() -> Vec<(EngineError, ErrorCode, &'static str)> {
        let disk = StoreError::Write("commit log: write: No space left on device".into());
        vec![
            (
                EngineError::BadId {
                    what: "session_id",
                    max: 256,
                },
                ErrorCode::BadRequest,
                "`session_id` must be 1 to 256 bytes with no control characters",
            ),
            (
                EngineError::OutOfRange {
                    field: "limit",
                    allowed: "1 to 1000".into(),
                },
                ErrorCode::BadRequest,
                "`limit` must be 1 to 1000",
            ),
            (
                EngineError::NoWorkerId,
                ErrorCode::BadRequest,
                "a worker `hello` needs `worker_id`",
            ),
            (
                EngineError::WatchTarget,
                ErrorCode::BadRequest,
                "give exactly one of `session_id` and `turn_id`",
            ),
            (
                EngineError::BadCursor,
                ErrorCode::BadRequest,
                "`after` must be the `next` of a previous page in the same order",
            ),
            (
                EngineError::InputTooLarge { max: 10 },
                ErrorCode::TooLarge,
                "`input` is larger than max_value_bytes (10)",
            ),
            (
                EngineError::NoTurn("t1".into()),
                ErrorCode::NotFound,
                "no turn t1 exists",
            ),
            (
                EngineError::NoSession("s1".into()),
                ErrorCode::NotFound,
                "no session s1 exists",
            ),
            (
                EngineError::NoInvocation("i1".into()),
                ErrorCode::NotFound,
                "no invocation i1 exists",
            ),
            (
                EngineError::NoWatch("w1".into()),
                ErrorCode::NotFound,
                "no watch w1 on this connection",
            ),
            (
                EngineError::NotRegistered {
                    function_id: "f".into(),
                },
                ErrorCode::NotFound,
                "function f is not registered on this connection",
            ),
            (
                EngineError::NotCurrent {
                    invocation_id: "i1".into(),
                },
                ErrorCode::NotFound,
                "invocation i1 is not current; stop it",
            ),
            (
                EngineError::NotYourInvocation {
                    invocation_id: "i1".into(),
                    worker_id: "w".into(),
                },
                ErrorCode::Forbidden,
                "invocation i1 was not dispatched to worker w",
            ),
            (
                EngineError::IdempotencyConflict {
                    key: "k".into(),
                    turn_id: "t1".into(),
                },
                ErrorCode::Conflict,
                "idempotency key \"k\" was used for turn t1 with a different function_id or input",
            ),
            (
                EngineError::StaleHello("w".into()),
                ErrorCode::Conflict,
                "worker w attached a newer connection; this hello is stale",
            ),
            (
                EngineError::QueueFull {
                    session_id: "s1".into(),
                    held: 3,
                },
                ErrorCode::RateLimited,
                "session s1 already holds 3 unfinished turns (max_queued_per_session)",
            ),
            (
                EngineError::TooManyWatches { max: 64 },
                ErrorCode::RateLimited,
                "at most 64 watches per connection",
            ),
            (
                EngineError::Busy {
                    session_id: "s1".into(),
                    unfinished: 2,
                    holder: "t1".into(),
                },
                ErrorCode::Busy,
                "session s1 has 2 unfinished turn(s) (lock holder t1); on_busy is reject",
            ),
            (
                EngineError::NotAwaitingInput {
                    turn_id: "t1".into(),
                    doing: "it is completed".into(),
                },
                ErrorCode::Conflict,
                "turn t1 is not awaiting input: it is completed",
            ),
            (
                EngineError::ResumeKeyConflict {
                    key: "k".into(),
                    turn_id: "t1".into(),
                },
                ErrorCode::Conflict,
                "idempotency key \"k\" resumed turn t1 with a different input",
            ),
            (
                EngineError::ProgressTooLarge { max: 10 },
                ErrorCode::TooLarge,
                "progress `data` is larger than max_progress_bytes (10)",
            ),
            (
                EngineError::NotWritten(disk.clone()),
                ErrorCode::Unavailable,
                "storage write failed: commit log: write: No space left on device; \
                 nothing was changed, retry later",
            ),
            (
                EngineError::ReadFailed(StoreError::Read("gone".into())),
                ErrorCode::Unavailable,
                "storage read failed: gone",
            ),
            (
                EngineError::Invariant("admitted turn vanished".into()),
                ErrorCode::Internal,
                "admitted turn vanished",
            ),
        ]
    }

    /// Which variant an error is: written as a match without a wildcard, so a new
    /// variant does not compile until it is added here and to `every_error`.
    fn variant(e: &EngineError) -> usize {
        match e {
            EngineError::BadId { .. } => 0,
            EngineError::OutOfRange { .. } => 1,
            EngineError::NoWorkerId => 2,
            EngineError::WatchTarget => 3,
            EngineError::BadCursor => 4,
            EngineError::InputTooLarge { .. } => 5,
            EngineError::NoTurn(_) => 6,
            EngineError::NoSession(_) => 7,
            EngineError::NoInvocation(_) => 8,
            EngineError::NoWatch(_) => 9,
            EngineError::NotRegistered { .. } => 10,
            EngineError::NotCurrent { .. } => 11,
            EngineError::NotYourInvocation { .. } => 12,
            EngineError::IdempotencyConflict { .. } => 13,
            EngineError::QueueFull { .. } => 14,
            EngineError::TooManyWatches { .. } => 15,
            EngineError::NotWritten(_) => 16,
            EngineError::ReadFailed(_) => 17,
            EngineError::Invariant(_) => 18,
            EngineError::StaleHello(_) => 19,
            EngineError::Busy { .. } => 20,
            EngineError::NotAwaitingInput { .. } => 21,
            EngineError::ResumeKeyConflict { .. } => 22,
            EngineError::ProgressTooLarge { .. } => 23,
        }
    }

    #[test]
    fn every_engine_error_has_its_protocol_code_and_message() {
        let mut seen: Vec<usize> = every_error().iter().map(|(e, _, _)| variant(e)).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..=23).collect::<Vec<_>>(), "one case per variant");
        for (e, want, message) in every_error() {
            let body = ErrorBody::from(e.clone());
            assert_eq!(e.code(), want, "{e:?}");
            assert_eq!(body.code, want, "{e:?}");
            assert_eq!(body.message, message, "{e:?}");
            assert_eq!(body.retryable, want.retryable(), "{e:?}");
        }
    }

    /// A full disk is told apart from other storage failures.
    #[test]
    fn a_full_disk_is_recognised() {
        let full = std::io::Error::from(std::io::ErrorKind::StorageFull);
        let e = StoreError::io(turnd_store::IoOp::Sync, "commit log: fdatasync", &full);
        assert!(EngineError::NotWritten(e.clone()).is_disk_full());
        assert_eq!(e.io_kind(), Some(std::io::ErrorKind::StorageFull));
        assert!(e
            .to_string()
            .starts_with("storage sync failed: commit log: fdatasync: "));
        let eio = std::io::Error::other("EIO");
        let e = StoreError::io(turnd_store::IoOp::Write, "commit log: write", &eio);
        assert!(!EngineError::NotWritten(e).is_disk_full());
        assert!(!EngineError::NotWritten(StoreError::Closed).is_disk_full());
    }
}
