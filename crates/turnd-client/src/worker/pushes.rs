//! What a worker does with each push of the server: an `invoke` starts the handler
//! in its own task, a `cancel` reaches the handler's token (or resends a finished
//! result), a `probe` is answered from what this worker really knows.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures_util::FutureExt;
use serde_json::Value;
use tracing::{debug, error, info, warn};
use turnd_proto::{Cancelled, Failure, InvocationState, Invoke, Outcome, StatusArgs};

use super::shared::{bump, WorkerShared};
use super::{InvocationCtx, Registered};
use crate::connection::{lock, Connection};

pub(super) fn on_invoke(
    shared: &Arc<WorkerShared>,
    functions: &Arc<HashMap<String, Registered>>,
    invoke: Invoke,
) {
    let invocation_id = invoke.invocation_id.clone();
    let cancel = shared.shutdown.child_token();
    {
        let mut tables = lock(&shared.tables);
        if tables.running.contains_key(&invocation_id) {
            debug!(%invocation_id, "invoke for an invocation already running; ignored");
            return;
        }
        if let Some(held) = tables.unacked.get(&invocation_id) {
            debug!(%invocation_id, "invoke for an invocation already finished; resending its result");
            held.resend_now.notify_one();
            return;
        }
        tables.running.insert(invocation_id.clone(), cancel.clone());
    }
    bump(&shared.counters.invocations_started);
    let handler = functions
        .get(&invoke.function_id)
        .map(|r| r.handler.clone());
    debug!(%invocation_id, function_id = %invoke.function_id, step = invoke.step, attempt = invoke.attempt, "invocation started");
    let function_id = invoke.function_id.clone();
    let ctx = InvocationCtx {
        invoke,
        cancel,
        shared: shared.clone(),
    };
    let task_shared = shared.clone();
    shared.handlers.spawn(async move {
        let outcome = match handler {
            Some(handler) => {
                let run = AssertUnwindSafe(async move { handler(ctx).await }).catch_unwind();
                match run.await {
                    Ok(outcome) => outcome,
                    Err(_) => {
                        error!(%invocation_id, %function_id, "handler panicked; reporting failure");
                        Outcome::Fail(Failure {
                            code: "handler_panicked".into(),
                            message: format!("the handler of {function_id} panicked"),
                            retryable: false,
                        })
                    }
                }
            }
            None => {
                error!(%invocation_id, %function_id, "invoke for a function this worker does not serve");
                Outcome::Fail(Failure {
                    code: "unknown_function".into(),
                    message: format!("this worker does not serve {function_id}"),
                    retryable: false,
                })
            }
        };
        debug!(%invocation_id, outcome = outcome.kind(), "invocation finished");
        task_shared.hold_result(invocation_id, outcome);
    });
}

pub(super) fn on_cancel(shared: &Arc<WorkerShared>, invocation_id: String, reason: &str) {
    let known = {
        let tables = lock(&shared.tables);
        if let Some(token) = tables.running.get(&invocation_id) {
            info!(%invocation_id, reason, "cancel: stopping the handler");
            token.cancel();
            true
        } else if let Some(held) = tables.unacked.get(&invocation_id) {
            info!(%invocation_id, reason, "cancel: already finished; resending the result");
            held.resend_now.notify_one();
            true
        } else {
            false
        }
    };
    if !known {
        info!(%invocation_id, reason, "cancel for an invocation this worker is not running");
        shared.hold_result(
            invocation_id,
            Outcome::Cancelled(Cancelled {
                message: "not running".into(),
            }),
        );
    }
}

pub(super) fn on_probe(shared: &Arc<WorkerShared>, conn: &Connection, invocation_id: String) {
    let (state, resend) = {
        let tables = lock(&shared.tables);
        if tables.running.contains_key(&invocation_id) {
            (InvocationState::Running, None)
        } else if let Some(held) = tables.unacked.get(&invocation_id) {
            (InvocationState::Finished, Some(held.resend_now.clone()))
        } else {
            (InvocationState::Unknown, None)
        }
    };
    debug!(%invocation_id, ?state, "answering probe");
    let conn = conn.clone();
    let shutdown = shared.shutdown.clone();
    shared.pumps.spawn(async move {
        let args = StatusArgs {
            invocation_id: invocation_id.clone(),
            state,
        };
        let answer = tokio::select! {
            _ = shutdown.cancelled() => return,
            answer = conn.call::<_, Value>("invocation.status", &args) => answer,
        };
        if let Err(e) = answer {
            warn!(%invocation_id, "failed to answer probe: {e}");
        }
        // Status first, then the result the status promised.
        if let Some(resend) = resend {
            resend.notify_one();
        }
    });
}
