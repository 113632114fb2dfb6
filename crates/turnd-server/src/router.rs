//! The one router of protocol v1's ops: the caller, an op's name and its JSON
//! arguments in; the op's answer as JSON text, or an error with its protocol code,
//! out. Which role may use which op, the decoding of `args` and the answer to bad
//! arguments are decided here and nowhere else.
//!
//! Every edge calls it: the WebSocket connection ([`crate::ws`]) for each request
//! after `hello`, the iii endpoint for the iii frames that are a protocol v1 op
//! (through [`turnd_iii::Router`]), and the `requests` fuzz target. Its input is
//! plain data, so that a request can be carried to another process before it is
//! routed; only `watch` and `unwatch` also need the connection they came on
//! ([`Origin`]), since a watch's events are pushed to it.

use serde::de::DeserializeOwned;
use serde_json::Value;
use turnd_engine::{Caller, Engine, SubmitOptions};
use turnd_proto::frame::{encode_ok, to_json_text, FRAME_CAPACITY};
use turnd_proto::*;
use turnd_store::RawJson;

/// An op's answer as JSON text, written into the `ok` frame as it is.
pub type Reply = String;

/// What a request's op answered.
#[derive(Debug, PartialEq)]
pub enum Answer {
    /// The answer, to be sent as the request's `ok`.
    Reply(Reply),
    /// A `watch`: its answer is already queued on the [`Origin`]'s outbox, ahead of
    /// the events it pushes there.
    Queued,
}

/// The connection a request came on, for the ops that need it: a `watch` answers and
/// pushes its events to its outbox, `unwatch` names the connection's watches.
pub struct Origin<'a> {
    pub outbox: &'a turnd_engine::Outbox,
    /// Watches one connection may hold (`server.max_watches_per_connection`).
    pub max_watches: usize,
    /// The request's id: a watch's answer and events carry it.
    pub request_id: u64,
}

/// The answer to `{}`-answered ops.
const EMPTY: &str = "{}";

/// Route and run one request.
pub async fn dispatch(
    engine: &Engine,
    caller: &Caller,
    op: &str,
    args: &str,
    origin: Option<&Origin<'_>>,
) -> Result<Answer, ErrorBody> {
    let op = admit(caller, op)?;
    run(engine, caller, op, args, origin).await
}

/// The op a request names, if the caller's role may use it. The WebSocket reader
/// calls this first, in line, and [`run`] in the request's own task.
pub fn admit(caller: &Caller, op: &str) -> Result<Op, ErrorBody> {
    let Some(op) = Op::parse(op) else {
        return Err(ErrorBody::new(
            ErrorCode::UnknownOp,
            format!("no op {op:?} in protocol v1"),
        ));
    };
    if !op.allowed_for(caller.role) {
        return Err(ErrorBody::new(
            ErrorCode::Forbidden,
            format!("role {} may not use {}", caller.role.as_str(), op.name()),
        ));
    }
    Ok(op)
}

/// Run an admitted op.
pub async fn run(
    engine: &Engine,
    caller: &Caller,
    op: Op,
    args: &str,
    origin: Option<&Origin<'_>>,
) -> Result<Answer, ErrorBody> {
    let reply = match op {
        Op::Hello => Err(ErrorBody::new(
            ErrorCode::Conflict,
            "this connection already said hello",
        )),
        Op::Ping => Ok(EMPTY.to_string()),
        Op::FunctionRegister
        | Op::FunctionUnregister
        | Op::InvocationResult
        | Op::InvocationHeartbeat
        | Op::InvocationStatus
        | Op::InvocationProgress => worker_op(engine, caller, op, args).await,
        Op::Watch => return own_size(watch(engine, decode(args)?, origin)).await,
        Op::Unwatch => {
            let a: WatchIdArgs = decode(args)?;
            let origin = connection(origin)?;
            engine.unwatch(&origin.outbox.conn_id, &a.watch_id)?;
            Ok(EMPTY.to_string())
        }
        Op::StoreCheck => {
            let engine = engine.clone();
            match tokio::task::spawn_blocking(move || engine.check()).await {
                Ok(r) => encode(&CheckOk { violations: r? }),
                Err(j) => Err(ErrorBody::new(
                    ErrorCode::Internal,
                    format!("store check task failed: {j}"),
                )),
            }
        }
        // The turns, sessions and lists of a caller.
        _ => caller_op(engine, op, args).await,
    };
    reply.map(Answer::Reply)
}

/// `f` in an allocation of its own, to await. A request's task is as large as the
/// largest future it may await, whichever op it runs, and the tasks of `turn.wait`
/// live until their turns end: with every op's future boxed at its own size, a
/// request's task holds only the op it runs (a `turn.wait` about a third of what it
/// held), for one small allocation more per request.
pub(crate) fn own_size<F: std::future::Future>(f: F) -> std::pin::Pin<Box<F>> {
    Box::pin(f)
}

/// The ops of a worker (or of an operator acting for one).
async fn worker_op(
    engine: &Engine,
    caller: &Caller,
    op: Op,
    args: &str,
) -> Result<Reply, ErrorBody> {
    match op {
        Op::FunctionRegister => {
            let worker = worker_id(caller)?;
            encode(&engine.register(&worker, &decode::<RegisterArgs>(args)?)?)
        }
        Op::FunctionUnregister => {
            let worker = worker_id(caller)?;
            let a: FunctionIdArgs = decode(args)?;
            engine.unregister(&worker, &a.function_id)?;
            Ok(EMPTY.to_string())
        }
        // The value is taken as the JSON text the frame carried (never built into a
        // tree: `RawJson::compacted`), as is a submit's input.
        Op::InvocationResult => {
            let a: ResultArgs<RawJson> = decode(args)?;
            encode(&own_size(engine.result_raw(caller, a)).await?)
        }
        Op::InvocationHeartbeat => {
            let a: InvocationIdArgs = decode(args)?;
            encode(&own_size(engine.heartbeat(caller, &a.invocation_id)).await?)
        }
        Op::InvocationStatus => {
            own_size(engine.status(caller, &decode(args)?)).await?;
            Ok(EMPTY.to_string())
        }
        Op::InvocationProgress => {
            let a: ProgressArgs<RawJson> = decode(args)?;
            encode(&engine.progress(caller, a)?)
        }
        other => Err(not_routed(other)),
    }
}

/// The ops of a caller: turns, sessions and the daemon's lists.
async fn caller_op(engine: &Engine, op: Op, args: &str) -> Result<Reply, ErrorBody> {
    match op {
        Op::TurnSubmit => {
            let a: SubmitArgs<RawJson> = decode(args)?;
            encode(&own_size(engine.submit_raw(a, SubmitOptions::default())).await?)
        }
        Op::TurnResume => encode(&own_size(engine.resume(decode(args)?)).await?),
        Op::TurnGet => {
            let a: TurnIdArgs = decode(args)?;
            encode(&TurnOk {
                turn: own_size(engine.get_turn(&a.turn_id)).await?,
            })
        }
        Op::TurnWait => {
            let a: WaitArgs = decode(args)?;
            encode(&TurnOk {
                turn: own_size(engine.wait_turn(&a.turn_id, a.timeout_ms)).await?,
            })
        }
        Op::TurnStop => {
            let a: StopArgs = decode(args)?;
            encode(&TurnOk {
                turn: own_size(engine.stop_turn(&a.turn_id, a.reason)).await?,
            })
        }
        Op::TurnList => encode(&own_size(engine.list_turns(decode(args)?)).await?),
        Op::SessionInspect => {
            let a: SessionIdArgs = decode(args)?;
            encode(&SessionOk {
                session: own_size(engine.inspect(&a.session_id)).await?,
            })
        }
        Op::SessionStop => {
            let a: SessionStopArgs = decode(args)?;
            encode(&TurnsOk {
                turns: own_size(engine.stop_session(&a.session_id, a.reason)).await?,
            })
        }
        Op::SessionEvents => encode(&own_size(engine.events(decode(args)?)).await?),
        Op::SessionsList => encode(&own_size(engine.list_sessions(decode(args)?)).await?),
        Op::Stats => encode(&StatsOk {
            stats: engine.stats(),
        }),
        Op::WorkersList => encode(&WorkersOk {
            workers: engine.workers(),
        }),
        Op::FunctionsList => encode(&FunctionsOk {
            functions: engine.functions(),
        }),
        other => Err(not_routed(other)),
    }
}

/// A `watch`: answered on the connection's outbox, then its events follow there.
async fn watch(
    engine: &Engine,
    args: WatchArgs,
    origin: Option<&Origin<'_>>,
) -> Result<Answer, ErrorBody> {
    let origin = connection(origin)?;
    let id = origin.request_id;
    engine
        .watch(args, origin.outbox, origin.max_watches, |w| {
            encode_ok(id, &serde_json::to_value(w).unwrap_or(Value::Null))
        })
        .await?;
    Ok(Answer::Queued)
}

/// The connection a `watch` or `unwatch` needs; a request carried without one (the
/// iii endpoint's) is refused.
pub(crate) fn connection<'o, 'a>(
    origin: Option<&'o Origin<'a>>,
) -> Result<&'o Origin<'a>, ErrorBody> {
    origin.ok_or_else(|| {
        ErrorBody::new(
            ErrorCode::BadRequest,
            "`watch` and `unwatch` need a protocol v1 connection",
        )
    })
}

/// The worker a worker op acts for.
pub(crate) fn worker_id(caller: &Caller) -> Result<String, ErrorBody> {
    caller.worker_id.clone().ok_or_else(|| {
        ErrorBody::new(
            ErrorCode::Forbidden,
            "this op needs a worker connection (hello with role worker, or operator with a worker_id)",
        )
    })
}

/// An op handed to the wrong family of ops: a bug of [`run`].
pub(crate) fn not_routed(op: Op) -> ErrorBody {
    ErrorBody::new(
        ErrorCode::Internal,
        format!("op {} reached no handler", op.name()),
    )
}

/// Decode a request's `args` (its JSON text) into the op's typed arguments.
pub fn decode<T: DeserializeOwned>(args: &str) -> Result<T, ErrorBody> {
    serde_json::from_str(args)
        .map_err(|e| ErrorBody::new(ErrorCode::BadRequest, format!("bad `args`: {e}")))
}

/// An answer as JSON text.
pub(crate) fn encode<T: serde::Serialize>(v: &T) -> Result<Reply, ErrorBody> {
    to_json_text(v, FRAME_CAPACITY)
        .map_err(|e| ErrorBody::new(ErrorCode::Internal, format!("encode response: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use turnd_engine::{EngineConfig, Outbox};
    use turnd_proto::frame::{decode_server_frame, ServerFrame};
    use turnd_store::mem::MemKv;
    use turnd_store::Store;

    async fn engine() -> Engine {
        Engine::open(Store::new(Arc::new(MemKv::new())), EngineConfig::default())
            .await
            .expect("an engine on an in-memory store")
    }

    fn caller(role: Role, worker_id: Option<&str>) -> Caller {
        Caller {
            role,
            worker_id: worker_id.map(String::from),
        }
    }

    async fn refused(engine: &Engine, who: &Caller, op: &str, args: &str) -> ErrorBody {
        match dispatch(engine, who, op, args, None).await {
            Err(e) => e,
            Ok(a) => panic!("{op} {args} was answered {a:?}"),
        }
    }

    fn reply<T: DeserializeOwned>(a: Result<Answer, ErrorBody>) -> T {
        match a {
            Ok(Answer::Reply(text)) => serde_json::from_str(&text).expect("the answer decodes"),
            other => panic!("not a reply: {other:?}"),
        }
    }

    const SUBMIT: &str = r#"{"session_id":"s","function_id":"f","input":1}"#;

    #[tokio::test]
    async fn an_op_runs_only_for_the_roles_that_may_use_it() {
        let e = engine().await;
        let client = caller(Role::Client, None);
        let worker = caller(Role::Worker, Some("w"));
        let err = refused(&e, &client, "turn.submitt", SUBMIT).await;
        assert_eq!(err.code, ErrorCode::UnknownOp);
        assert_eq!(err.message, "no op \"turn.submitt\" in protocol v1");
        let err = refused(&e, &worker, "turn.submit", SUBMIT).await;
        assert_eq!(err.code, ErrorCode::Forbidden);
        assert_eq!(err.message, "role worker may not use turn.submit");
        let err = refused(&e, &client, "function.register", r#"{"function_id":"f"}"#).await;
        assert_eq!(err.code, ErrorCode::Forbidden);
        let err = refused(&e, &client, "store.check", "{}").await;
        assert_eq!(err.code, ErrorCode::Forbidden);
        // Nothing refused was run: no session, no function.
        assert!(e.session_ids_in_memory().is_empty());
        assert!(e.functions().is_empty());
        let operator = caller(Role::Operator, None);
        let check: CheckOk = reply(dispatch(&e, &operator, "store.check", "{}", None).await);
        assert!(check.violations.is_empty());
        let r: RegisterOk = reply(
            dispatch(
                &e,
                &worker,
                "function.register",
                r#"{"function_id":"f"}"#,
                None,
            )
            .await,
        );
        assert_eq!(r.function_id, "f");
        let s: SubmitOk = reply(dispatch(&e, &client, "turn.submit", SUBMIT, None).await);
        let get = format!(r#"{{"turn_id":"{}"}}"#, s.turn.turn_id);
        let t: TurnOk = reply(dispatch(&e, &client, "turn.get", &get, None).await);
        assert_eq!(t.turn.turn_id, s.turn.turn_id);
    }

    #[tokio::test]
    async fn bad_args_are_refused_before_the_engine_sees_them() {
        let e = engine().await;
        let client = caller(Role::Client, None);
        let err = refused(&e, &client, "turn.submit", r#"{"session_id":5}"#).await;
        assert_eq!(err.code, ErrorCode::BadRequest);
        assert!(err.message.starts_with("bad `args`: "), "{err}");
        assert!(!err.retryable);
        // A worker op from an operator that named no worker_id.
        let operator = caller(Role::Operator, None);
        let err = refused(&e, &operator, "function.register", r#"{"function_id":"f"}"#).await;
        assert_eq!(err.code, ErrorCode::Forbidden);
        // An engine refusal carries the engine's code.
        let err = refused(&e, &client, "turn.get", r#"{"turn_id":"t_nope"}"#).await;
        assert_eq!(err.code, ErrorCode::NotFound);
        assert!(e.session_ids_in_memory().is_empty());
        assert!(e.functions().is_empty());
    }

    #[tokio::test]
    async fn a_watch_is_answered_on_the_connection_it_came_on() {
        let e = engine().await;
        let client = caller(Role::Client, None);
        let watch = r#"{"session_id":"s"}"#;
        // Carried without a connection (as the iii endpoint's requests are): refused.
        let err = refused(&e, &client, "watch", watch).await;
        assert_eq!(err.code, ErrorCode::BadRequest);
        assert_eq!(e.watch_count(), 0);
        let (outbox, mut rx) = Outbox::new("c1".into(), 8);
        let origin = Origin {
            outbox: &outbox,
            max_watches: 1,
            request_id: 7,
        };
        let a = dispatch(&e, &client, "watch", watch, Some(&origin)).await;
        assert_eq!(a, Ok(Answer::Queued));
        let w: WatchOk = match rx.try_recv().map(|f| decode_server_frame(&f)) {
            Ok(Ok(ServerFrame::Ok { id: 7, ok })) => serde_json::from_value(ok).expect("WatchOk"),
            other => panic!("the watch's answer is not on its outbox: {other:?}"),
        };
        assert_eq!(e.watch_count(), 1);
        // The connection's limit of watches is the origin's.
        let over = Origin {
            request_id: 8,
            ..origin
        };
        let err = dispatch(&e, &client, "watch", watch, Some(&over)).await;
        assert_eq!(err.map_err(|e| e.code), Err(ErrorCode::RateLimited));
        let unwatch = format!(r#"{{"watch_id":"{}"}}"#, w.watch_id);
        let a = dispatch(&e, &client, "unwatch", &unwatch, Some(&over)).await;
        assert_eq!(a, Ok(Answer::Reply("{}".into())));
        assert_eq!(e.watch_count(), 0);
    }

    /// A request's task holds the future of the op it runs, whichever op that is:
    /// each op's future is boxed at its own size (`own_size`), and the futures
    /// that wait long (a submit for its session's lock, a `turn.wait` for its
    /// turn) hold no room for a commit or a read. Before, every request's task
    /// was about 6 KB, and a daemon holds one per waiting caller.
    #[tokio::test]
    async fn a_request_holds_the_room_of_its_own_op_only() {
        let e = engine().await;
        let who = caller(Role::Client, None);
        let run = run(&e, &who, Op::TurnWait, "{}", None);
        assert!(
            std::mem::size_of_val(&run) <= 512,
            "router::run: {}",
            std::mem::size_of_val(&run)
        );
        let backend = crate::backend::Backend::Single(e.clone());
        let routed = backend.run(&who, Op::TurnWait, "{}", None);
        assert!(
            std::mem::size_of_val(&routed) <= 512,
            "Backend::run: {}",
            std::mem::size_of_val(&routed)
        );
        let args = serde_json::from_str(SUBMIT).expect("submit args");
        let submit = e.submit(args);
        assert!(
            std::mem::size_of_val(&submit) <= 1024,
            "submit: {}",
            std::mem::size_of_val(&submit)
        );
        let wait = e.wait_turn("t", None);
        assert!(
            std::mem::size_of_val(&wait) <= 1024,
            "wait_turn: {}",
            std::mem::size_of_val(&wait)
        );
    }
}
