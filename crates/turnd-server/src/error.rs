//! The engine's errors as protocol v1 answers: the one place that decides which
//! error code each [`EngineError`] is answered with (`docs/protocol.md`, "Error
//! codes"). The message is the error's own text.

use turnd_engine::EngineError;
use turnd_proto::{ErrorBody, ErrorCode};

/// The protocol error code of an engine error.
pub fn code(e: &EngineError) -> ErrorCode {
    match e {
        EngineError::BadId { .. }
        | EngineError::OutOfRange { .. }
        | EngineError::NoWorkerId
        | EngineError::WatchTarget
        | EngineError::BadCursor => ErrorCode::BadRequest,
        EngineError::InputTooLarge { .. } => ErrorCode::TooLarge,
        EngineError::NoTurn(_)
        | EngineError::NoSession(_)
        | EngineError::NoInvocation(_)
        | EngineError::NoWatch(_)
        | EngineError::NotRegistered { .. }
        | EngineError::NotCurrent { .. } => ErrorCode::NotFound,
        EngineError::NotYourInvocation { .. } => ErrorCode::Forbidden,
        EngineError::IdempotencyConflict { .. } => ErrorCode::Conflict,
        EngineError::QueueFull { .. } | EngineError::TooManyWatches { .. } => {
            ErrorCode::RateLimited
        }
        EngineError::NotWritten(_) | EngineError::ReadFailed(_) => ErrorCode::Unavailable,
        EngineError::Invariant(_) => ErrorCode::Internal,
    }
}

/// An engine error as the `error` of a protocol v1 response.
pub fn to_wire(e: EngineError) -> ErrorBody {
    ErrorBody::new(code(&e), e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnd_store::StoreError;

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
        }
    }

    #[test]
    fn every_engine_error_has_its_protocol_code_and_message() {
        let mut seen: Vec<usize> = every_error().iter().map(|(e, _, _)| variant(e)).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..=18).collect::<Vec<_>>(), "one case per variant");
        for (e, want, message) in every_error() {
            let body = to_wire(e.clone());
            assert_eq!(body.code, want, "{e:?}");
            assert_eq!(body.message, message, "{e:?}");
            assert_eq!(body.retryable, want.retryable(), "{e:?}");
        }
    }

    /// The iii endpoint answers a refused trigger with the same code.
    #[test]
    fn the_iii_endpoint_uses_the_same_codes() {
        for (e, want, message) in every_error() {
            let iii = turnd_iii::wire::IiiError::from(e.clone());
            assert_eq!(iii.code, want.as_str(), "{e:?}");
            assert_eq!(iii.message, message, "{e:?}");
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
