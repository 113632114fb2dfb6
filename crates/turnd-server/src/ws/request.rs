//! A request after `hello`: what the connection checks before the router runs it
//! (the connection said `hello`, the router admits the op for its role, the daemon is
//! not draining, the connection has room in flight), and the request's own task,
//! which runs it through the [`router`] and queues its answer.

use std::sync::Arc;

use turnd_engine::{Caller, CloseReason};
use turnd_proto::{ErrorBody, ErrorCode, Op, RawRequest};

use super::limits::InFlight;
use super::Conn;
use crate::router::{self, Answer, Origin};

/// Who sent a request and which op it is, once the connection said `hello`, the
/// router admits the op for its role and the daemon is not draining.
fn admit<'c>(conn: &'c Conn, req: &RawRequest<'_>) -> Result<(&'c Caller, Op), ErrorBody> {
    let Some(caller) = conn.auth.get() else {
        return Err(ErrorBody::new(
            ErrorCode::NotAuthenticated,
            "send `hello` first",
        ));
    };
    let op = router::admit(caller, &req.op)?;
    if conn.shared.draining.is_cancelled() && op != Op::Ping {
        return Err(ErrorBody::new(
            ErrorCode::ShuttingDown,
            "the server is shutting down; nothing was changed",
        ));
    }
    Ok((caller, op))
}

/// Whether a request is run in line by the reader rather than as a task of its own:
/// `invocation.progress`, which waits for nothing (no session lock, no write), so
/// that a worker's frames are taken in the order it sent them.
pub(super) fn in_line(req: &RawRequest<'_>) -> bool {
    req.op == Op::InvocationProgress.name()
}

/// Run a request in line ([`in_line`]) and queue its answer; false when the
/// connection is closed.
pub(super) async fn run_in_line(conn: &Arc<Conn>, req: &RawRequest<'_>) -> bool {
    let answer = match admit(conn, req) {
        Ok((caller, op)) => {
            match conn
                .shared
                .backend
                .run(caller, op, req.args_text(), None)
                .await
            {
                Ok(Answer::Reply(r)) => Ok(r),
                Ok(Answer::Queued) => Err(ErrorBody::new(
                    ErrorCode::Internal,
                    "an op run in line queued its answer",
                )),
                Err(e) => Err(e),
            }
        }
        Err(e) => Err(e),
    };
    conn.respond(req.id, answer).await
}

/// Start a request as a task of its own, or say why it is refused (answered by the
/// reader at once).
pub(super) fn start(conn: &Arc<Conn>, req: &RawRequest<'_>) -> Result<(), ErrorBody> {
    let (caller, op) = admit(conn, req)?;
    let shared = &conn.shared;
    let max_inflight = shared.config.server.max_inflight_per_connection;
    let Some(counted) = InFlight::take(conn, max_inflight) else {
        return Err(ErrorBody::new(
            ErrorCode::RateLimited,
            format!(
                "this connection already has {max_inflight} requests in progress \
                 (server.max_inflight_per_connection); wait for their answers"
            ),
        ));
    };
    let caller = caller.clone();
    let id = req.id;
    let args = req.args_text().to_owned();
    shared.requests.spawn(async move {
        let conn = &counted.0;
        let origin = Origin {
            outbox: &conn.outbox,
            max_watches: conn.shared.config.server.max_watches_per_connection as usize,
            request_id: id,
        };
        let backend = &conn.shared.backend;
        let answer = match backend.run(&caller, op, &args, Some(&origin)).await {
            Ok(Answer::Reply(r)) => Some(Ok(r)),
            Ok(Answer::Queued) => None,
            // No answer may say what happened: the connection ends instead.
            Err(e) if e.in_doubt => {
                tracing::warn!(op = op.name(), "closing a connection: {}", e.message);
                conn.outbox.close_with(CloseReason::InDoubt);
                None
            }
            Err(e) => Some(Err(e)),
        };
        if let Some(r) = answer {
            conn.respond(id, r).await;
        }
        drop(counted);
    });
    Ok(())
}
