//! A caller's `invokefunction` (iii's `trigger`): the functions the endpoint serves
//! itself, and every other one as a turn. A sync call is answered with its turn's
//! outcome, a void call with nothing, an enqueued message with its receipt.
//!
//! A sync or void call becomes a turn only when a worker can take it: a connected
//! worker serves its function, or one that served it left less than
//! `turns.reconnect_grace_ms` ago and may be reattaching. Any other call is answered
//! `function_not_found` at once, as iii's engine answers it, and leaves nothing
//! behind. An admitted call's turn carries a dispatch bound (`[iii]
//! call_dispatch_timeout_ms`, or `call_grace_ms` for a reattaching worker): it is
//! never dispatched after it, since its caller may have given up by then.

use super::*;
use turnd_engine::SubmitOptions;
use turnd_proto::{ErrorCause, TurnOk, WaitArgs};
use turnd_store::TurnDispatch;

/// Sync and void calls run in sessions of their own, `call/<id>`: no queue's
/// sessions (`<queue>:…`, the name free of `/`) can have that prefix.
const CALL_SESSION: &str = "call/";

/// How a sync or void call is admitted, or why it is not.
enum Route {
    /// Admit it, to be dispatched by `dispatch_by_ms` or fail. `grace`: no worker
    /// serves the function now, one that served it may be reattaching.
    Admit {
        dispatch_by_ms: u64,
        grace: bool,
    },
    NotFound(IiiError),
}

/// iii's own function families, served by iii's workers, which turnd does not run.
fn iii_family(function_id: &str) -> Option<&'static str> {
    const FAMILIES: [(&str, &str); 6] = [
        ("state::", "state functions (state::*)"),
        ("stream::", "stream functions (stream::*)"),
        (
            "configuration::",
            "configuration functions (configuration::*)",
        ),
        ("iii::", "built-in workers (iii::*)"),
        ("iii-", "built-in workers (iii-*::*)"),
        (
            "engine::",
            "engine functions beyond engine::queue::topic_stats",
        ),
    ];
    if function_id == "publish" {
        return Some("pub/sub (publish)");
    }
    FAMILIES
        .iter()
        .find(|(prefix, _)| function_id.starts_with(prefix))
        .map(|(_, what)| *what)
}

impl Iii {
    /// Whether a sync or void call of `function_id` is admitted, and with which
    /// dispatch bound.
    fn route_call(&self, function_id: &str) -> Route {
        let supply = self.daemon.supply(function_id);
        let now = self.daemon.now_ms();
        if supply.connected > 0 {
            return Route::Admit {
                dispatch_by_ms: now + self.cfg.call_dispatch_timeout_ms,
                grace: false,
            };
        }
        let grace = self.daemon.reconnect_grace_ms();
        let reattaching = supply.registered
            && supply.served_ms > 0
            && now.saturating_sub(supply.served_ms) < grace;
        if reattaching && self.cfg.call_grace_ms > 0 {
            let wait = self
                .cfg
                .call_grace_ms
                .min(self.cfg.call_dispatch_timeout_ms);
            return Route::Admit {
                dispatch_by_ms: now + wait,
                grace: true,
            };
        }
        Route::NotFound(self.not_found(function_id, None))
    }

    /// iii's answer for a function it does not know, naming what turnd does not
    /// serve when the function is one of iii's own or was registered over HTTP.
    pub(crate) fn not_found(&self, function_id: &str, more: Option<&str>) -> IiiError {
        let http = self
            .http_functions
            .lock()
            .is_ok_and(|h| h.contains(function_id));
        let why = if http {
            Some("it was registered as HTTP-invoked (`invocation`), and turnd invokes no function over HTTP".to_string())
        } else {
            iii_family(function_id).map(|what| format!("turnd does not serve iii's {what}"))
        };
        let message = match (why, more) {
            (Some(w), _) => format!("Function {function_id} not found: {w}"),
            (None, Some(m)) => format!("Function {function_id} not found: {m}"),
            (None, None) => format!("Function {function_id} not found"),
        };
        IiiError::new("function_not_found", message)
    }
}

/// The iii answer to a finished turn.
fn turn_answer(t: &Turn) -> (Option<Value>, Option<IiiError>) {
    match t.status {
        TurnStatus::Completed => (t.output.clone(), None),
        TurnStatus::Cancelled => (
            None,
            Some(IiiError::new(
                "cancelled",
                t.stop
                    .as_ref()
                    .map(|s| s.reason.clone())
                    .unwrap_or_else(|| "cancelled".into()),
            )),
        ),
        _ => {
            let (code, message) = match &t.error {
                Some(e) if !e.code.is_empty() => (e.code.clone(), e.message.clone()),
                Some(e) => (
                    serde_json::to_value(e.cause)
                        .ok()
                        .and_then(|v| v.as_str().map(String::from))
                        .unwrap_or_else(|| "failed".into()),
                    e.message.clone(),
                ),
                None => ("failed".into(), "the turn failed".into()),
            };
            (None, Some(IiiError::new(&code, message)))
        }
    }
}

impl Conn {
    /// Answer a caller's `invokefunction` (when it carries an `invocation_id`).
    pub(super) fn answer(&self, i: &InvokeFunction, r: Result<Option<Value>, IiiError>) {
        let Some(id) = &i.invocation_id else {
            if let Err(e) = r {
                tracing::warn!(
                    function_id = i.function_id,
                    "iii void trigger not run: {}: {}",
                    e.code,
                    e.message
                );
            }
            return;
        };
        let (result, error) = match r {
            Ok(v) => (v, None),
            Err(e) => (None, Some(e)),
        };
        self.send(Outbound::InvocationResult(InvocationResult {
            invocation_id: id.clone(),
            function_id: i.function_id.clone(),
            result,
            error,
        }));
    }

    /// A caller's `invokefunction`: a built-in function, or a turn.
    pub(super) async fn trigger(self: Arc<Self>, i: InvokeFunction) {
        let iii = &self.iii;
        let r = match i.function_id.as_str() {
            "engine::workers::register" => {
                tracing::debug!(peer = %self.peer, worker_id = ?self.worker_id(), info = %i.data, "iii worker metadata");
                Ok(Some(json!({})))
            }
            "queue::define" => iii.define_queue(i.data.clone()).await.map(Some),
            "engine::queue::topic_stats" => iii.topic_stats(i.data.clone()).await.map(Some),
            f if f.starts_with("engine::") => Err(iii.not_found(f, None)),
            _ => match &i.action {
                None if i.invocation_id.is_some() => return self.call(i).await,
                None | Some(Action::Void) => match iii.route_call(&i.function_id) {
                    Route::NotFound(e) => Err(e),
                    Route::Admit { dispatch_by_ms, .. } => {
                        let session = format!("{CALL_SESSION}{}", uuid::Uuid::new_v4());
                        let opts = call_options(dispatch_by_ms);
                        self.submit(&i, session, opts).await.map(|_| None)
                    }
                },
                Some(Action::Enqueue { queue }) => {
                    let message_id = i
                        .invocation_id
                        .clone()
                        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
                    match iii.queue_session(queue, &i.data, &message_id).await {
                        Ok((session, opts)) => self
                            .submit(&i, session, opts)
                            .await
                            .map(|t| Some(json!({"messageReceiptId": t.turn_id}))),
                        Err(e) => Err(e),
                    }
                }
            },
        };
        self.answer(&i, r);
    }

    /// Admit the trigger as a one-step turn (idempotent on its `invocation_id`).
    async fn submit(
        &self,
        i: &InvokeFunction,
        session_id: String,
        opts: SubmitOptions,
    ) -> Result<Turn, IiiError> {
        let args = SubmitArgs {
            session_id,
            function_id: i.function_id.clone(),
            input: i.data.clone(),
            idempotency_key: i.invocation_id.clone(),
            turn_timeout_ms: None,
            on_busy: None,
        };
        self.iii
            .daemon
            .submit(args, opts)
            .await
            .map(|ok| ok.turn)
            .map_err(IiiError::from)
    }

    /// A sync trigger: the turn runs in a session of its own; its outcome is the
    /// answer. Stops waiting (the turn goes on) when the caller's connection ends.
    async fn call(&self, i: InvokeFunction) {
        let Some(id) = i.invocation_id.clone() else {
            return;
        };
        let (dispatch_by_ms, grace) = match self.iii.route_call(&i.function_id) {
            Route::NotFound(e) => return self.answer(&i, Err(e)),
            Route::Admit {
                dispatch_by_ms,
                grace,
            } => (dispatch_by_ms, grace),
        };
        let session = format!("{CALL_SESSION}{id}");
        let mut t = match self.submit(&i, session, call_options(dispatch_by_ms)).await {
            Ok(t) => t,
            Err(e) => return self.answer(&i, Err(e)),
        };
        let client = as_client();
        while !t.status.is_terminal() {
            let wait = WaitArgs {
                turn_id: t.turn_id.clone(),
                timeout_ms: Some(CALL_WAIT_MS),
            };
            let waited: Result<TurnOk, _> = tokio::select! {
                w = self.request(&client, Op::TurnWait, &wait) => w,
                _ = self.done.cancelled() => return,
            };
            match waited {
                Ok(next) => t = next.turn,
                Err(e) => {
                    return self.answer(&i, Err(IiiError::from(e)));
                }
            }
        }
        let no_worker = t
            .error
            .as_ref()
            .is_some_and(|e| e.cause == ErrorCause::NoWorker && t.status == TurnStatus::Failed);
        if grace && no_worker {
            let more = format!(
                "no worker served it again within call_grace_ms ({} ms)",
                self.iii.cfg.call_grace_ms
            );
            return self.answer(&i, Err(self.iii.not_found(&i.function_id, Some(&more))));
        }
        let (result, error) = turn_answer(&t);
        self.answer(&i, error.map_or(Ok(result), Err));
    }
}

/// A call's own dispatch settings: its bound, nothing else (the function's
/// registration applies).
fn call_options(dispatch_by_ms: u64) -> SubmitOptions {
    SubmitOptions {
        dispatch: Some(TurnDispatch {
            dispatch_by_ms: Some(dispatch_by_ms),
            ..TurnDispatch::default()
        }),
        retry_backoff_ms: None,
    }
}
