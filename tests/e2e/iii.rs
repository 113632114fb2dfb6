//! The iii endpoint through raw iii frames against the real daemon: who may connect,
//! reattach tokens (forged, valid, after a restart), tolerance of every other
//! message, an iii worker's deadline going straight to outcome unknown, calls of
//! functions nobody serves, the session held while a stopped invocation may still
//! run, and queues' settings. The real SDKs' tests are in tests/iii (Node and
//! Python).

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use turnd_proto::{Role, TurnStatus};
use turnd_server::config::TokenConfig;
use turnd_tests::TestDaemon;

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

fn iii_url(d: &TestDaemon) -> String {
    d.daemon
        .as_ref()
        .and_then(|d| d.iii_url())
        .expect("the iii endpoint is on")
}

async fn start(f: impl FnOnce(&mut turnd_server::Config)) -> anyhow::Result<TestDaemon> {
    TestDaemon::start(|c| {
        c.iii.listen = Some("127.0.0.1:0".into());
        f(c)
    })
    .await
}

async fn connect(url: &str, bearer: Option<&str>) -> Result<Ws, WsError> {
    let mut req = url.into_client_request()?;
    if let Some(t) = bearer {
        let v = format!("Bearer {t}")
            .parse()
            .expect("the tests' tokens are ASCII");
        req.headers_mut().insert("authorization", v);
    }
    tokio_tungstenite::connect_async(req)
        .await
        .map(|(ws, _)| ws)
}

async fn send(ws: &mut Ws, v: Value) -> anyhow::Result<()> {
    ws.send(Message::text(v.to_string())).await?;
    Ok(())
}

/// The next JSON frame (pings skipped), or an error after 5 s.
async fn recv(ws: &mut Ws) -> anyhow::Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, ws.next()).await {
            Err(_) => bail!("no frame within 5 s"),
            Ok(None) => bail!("connection closed"),
            Ok(Some(m)) => match m? {
                Message::Text(t) => return Ok(serde_json::from_str(t.as_str())?),
                Message::Close(c) => bail!("closed: {c:?}"),
                _ => {}
            },
        }
    }
}

/// The next frame of `type`, skipping others.
async fn recv_type(ws: &mut Ws, ty: &str) -> anyhow::Result<Value> {
    loop {
        let f = recv(ws).await?;
        if f["type"] == ty {
            return Ok(f);
        }
    }
}

fn status_of(e: &WsError) -> Option<u16> {
    match e {
        WsError::Http(r) => Some(r.status().as_u16()),
        _ => None,
    }
}

#[tokio::test]
async fn only_known_paths_and_accepted_tokens_open_a_socket() -> anyhow::Result<()> {
    let tok = |role, token: &str| TokenConfig {
        role,
        token: token.into(),
    };
    let d = start(|c| {
        c.auth.tokens = vec![
            tok(Role::Worker, "both-roles-token"),
            tok(Role::Client, "both-roles-token"),
            tok(Role::Worker, "worker-only-token"),
        ];
    })
    .await?;
    let url = iii_url(&d);
    let refused = |r: Result<Ws, WsError>| match r {
        Ok(_) => None,
        Err(e) => status_of(&e),
    };
    assert_eq!(
        refused(connect(&url, Some("wrong-token-1")).await),
        Some(401)
    );
    assert_eq!(
        refused(connect(&url, Some("worker-only-token")).await),
        Some(401)
    );
    assert_eq!(refused(connect(&url, None).await), Some(401));
    assert_eq!(
        refused(connect(&format!("{url}/?token=nope"), None).await),
        Some(401)
    );
    assert_eq!(
        refused(connect(&format!("{url}/elsewhere"), Some("both-roles-token")).await),
        Some(404)
    );
    let mut ws = connect(&url, Some("both-roles-token")).await?;
    send(&mut ws, json!({"type": "registerfunction", "id": "a::b"})).await?;
    assert_eq!(recv(&mut ws).await?["type"], "workerregistered");
    let mut ws = connect(&format!("{url}/?token=both-roles-token"), None).await?;
    send(&mut ws, json!({"type": "registerfunction", "id": "a::c"})).await?;
    assert_eq!(recv(&mut ws).await?["type"], "workerregistered");
    // The telemetry socket takes binary frames and answers nothing.
    let mut otel = connect(&format!("{url}/otel"), Some("both-roles-token")).await?;
    otel.send(Message::Binary(b"OTLP{}".to_vec().into()))
        .await?;
    assert!(
        tokio::time::timeout(Duration::from_millis(300), otel.next())
            .await
            .map(|m| matches!(m, Some(Ok(Message::Ping(_)))))
            .unwrap_or(true),
        "the telemetry socket answers nothing but pings"
    );
    d.shutdown().await
}

/// Open a connection whose first frame is `first`; return the `workerregistered`.
async fn open_with(url: &str, first: Value) -> anyhow::Result<(Ws, Value)> {
    let mut ws = connect(url, None).await.context("connect")?;
    send(&mut ws, first).await?;
    let reg = recv_type(&mut ws, "workerregistered").await?;
    Ok((ws, reg))
}

#[tokio::test]
async fn reattach_keeps_the_identity_only_with_its_token_and_across_a_restart() -> anyhow::Result<()>
{
    let dir = Arc::new(tempfile::tempdir()?);
    let cfg = |c: &mut turnd_server::Config| c.iii.listen = Some("127.0.0.1:0".into());
    let d = TestDaemon::start_in(dir.clone(), cfg, false).await?;
    let url = iii_url(&d);
    let (_ws, reg) = open_with(&url, json!({"type": "registerfunction", "id": "r::f"})).await?;
    let id = reg["worker_id"].as_str().context("worker_id")?.to_string();
    let token = reg["reattach_token"].as_str().context("token")?.to_string();
    let worker = format!("iii/{id}");
    assert!(d.engine().workers().iter().any(|w| w.worker_id == worker));

    // A forged token: a new identity.
    let (_ws2, forged) = open_with(
        &url,
        json!({"type": "reattach", "previous_worker_id": id, "reattach_token": "00ff"}),
    )
    .await?;
    assert_ne!(forged["worker_id"], id.as_str());
    // No token at all: a new identity too.
    let (_ws3, bare) =
        open_with(&url, json!({"type": "reattach", "previous_worker_id": id})).await?;
    assert_ne!(bare["worker_id"], id.as_str());
    // Another lineage's token does not fit this one.
    let other = forged["reattach_token"].as_str().context("token")?;
    let (_ws4, wrong) = open_with(
        &url,
        json!({"type": "reattach", "previous_worker_id": id, "reattach_token": other}),
    )
    .await?;
    assert_ne!(wrong["worker_id"], id.as_str());
    // The right token: the same identity, and the worker is attached at once.
    let (_ws5, same) = open_with(
        &url,
        json!({"type": "reattach", "previous_worker_id": id, "reattach_token": token}),
    )
    .await?;
    assert_eq!(same["worker_id"], id.as_str());
    assert_eq!(same["reattach_token"], token.as_str());
    drop((_ws, _ws2, _ws3, _ws4, _ws5));
    d.shutdown().await?;

    // After a restart on the same store the token still verifies.
    let d = TestDaemon::start_in(dir, cfg, false).await?;
    let url = iii_url(&d);
    let (_ws, again) = open_with(
        &url,
        json!({"type": "reattach", "previous_worker_id": id, "reattach_token": token}),
    )
    .await?;
    assert_eq!(again["worker_id"], id.as_str());
    assert!(d
        .engine()
        .workers()
        .iter()
        .any(|w| w.worker_id == worker && w.connected));
    drop(_ws);
    d.shutdown().await
}

#[tokio::test]
async fn unknown_messages_and_garbage_are_tolerated() -> anyhow::Result<()> {
    let d = start(|_| {}).await?;
    let url = iii_url(&d);
    let (mut ws, _) = open_with(&url, json!({"type": "registertriggertype", "id": "t"})).await?;
    ws.send(Message::text("not json")).await?;
    ws.send(Message::Binary(vec![1, 2, 3].into())).await?;
    send(&mut ws, json!({"type": "observe", "anything": [1]})).await?;
    send(&mut ws, json!({"type": "registerfunction"})).await?;
    send(
        &mut ws,
        json!({"type": "registertrigger", "id": "tr1", "trigger_type": "cron", "function_id": "f", "config": {}}),
    )
    .await?;
    let r = recv_type(&mut ws, "triggerregistrationresult").await?;
    assert_eq!(r["id"], "tr1");
    assert_eq!(r["error"]["code"], "trigger_type_not_found");
    // Still serving: a call to a built-in function is answered.
    send(
        &mut ws,
        json!({"type": "invokefunction", "invocation_id": "c1", "function_id": "queue::define", "data": {"queue": "q1", "config": {"type": "standard"}}}),
    )
    .await?;
    let r = recv_type(&mut ws, "invocationresult").await?;
    assert_eq!(r["invocation_id"], "c1");
    assert_eq!(r["result"], json!({"queue": "q1", "changed": true}));
    send(
        &mut ws,
        json!({"type": "invokefunction", "invocation_id": "c2", "function_id": "queue::define", "data": {"queue": "bad:name"}}),
    )
    .await?;
    let r = recv_type(&mut ws, "invocationresult").await?;
    assert_eq!(r["error"]["code"], "invalid_queue");
    d.shutdown().await
}

#[tokio::test]
async fn an_unanswered_invocation_is_an_unknown_outcome_at_its_deadline_without_a_probe(
) -> anyhow::Result<()> {
    let d = start(|c| {
        c.iii.timeout_ms = Some(300);
        // A probe would end the turn a minute after its deadline at the earliest,
        // and its own deadline no sooner: far from the deadline on any machine.
        c.turns.probe_timeout_ms = 60_000;
        c.turns.default_timeout_ms = 120_000;
        // The iii worker below sends nothing until the late result.
        turnd_tests::quiet_raw_peers(c);
    })
    .await?;
    let url = iii_url(&d);
    let (mut ws, _) = open_with(&url, json!({"type": "registerfunction", "id": "f::x"})).await?;
    let caller = d.caller().await?;
    let ok = caller
        .submit(turnd_proto::SubmitArgs {
            session_id: "s1".into(),
            function_id: "f::x".into(),
            input: json!({"k": 1}),
            idempotency_key: None,
            turn_timeout_ms: None,
            on_busy: None,
        })
        .await?;
    let inv = recv_type(&mut ws, "invokefunction").await?;
    assert_eq!(inv["function_id"], "f::x");
    assert_eq!(inv["data"], json!({"k": 1}));
    assert_eq!(
        inv["metadata"]["turnd"]["turn_id"],
        ok.turn.turn_id.as_str()
    );
    let turn = turnd_tests::wait_done(&caller, &ok.turn.turn_id, 30)
        .await
        .context("the turn did not end near its 300 ms deadline")?;
    assert_eq!(turn.status, TurnStatus::Failed);
    let err = turn.error.clone().context("error")?;
    assert_eq!(err.cause, turnd_proto::ErrorCause::OutcomeUnknown);
    let events = caller.events("s1", None, Some(1000)).await?.events;
    // At the deadline (300 ms after the dispatch), not the deadline plus the probe
    // timeout (a minute), by the daemon's own clock.
    let dispatched = events
        .iter()
        .find(|e| e.kind == turnd_proto::EventKind::Dispatched)
        .context("a dispatched event")?;
    let deadline = dispatched.detail["deadline_ms"]
        .as_u64()
        .context("the dispatch's deadline")?;
    assert_eq!(deadline, dispatched.at_ms + 300, "{dispatched:?}");
    let finished = turn.finished_at_ms.context("finished_at_ms")?;
    assert!(
        (deadline..deadline + 15_000).contains(&finished),
        "failed at {finished}, the deadline being {deadline}"
    );
    assert!(
        events
            .iter()
            .all(|e| e.kind != turnd_proto::EventKind::ProbeSent),
        "an iii worker is never probed"
    );
    // The result comes after all: late, and it amends the unknown outcome.
    let id = inv["invocation_id"].as_str().context("invocation_id")?;
    send(
        &mut ws,
        json!({"type": "invocationresult", "invocation_id": id, "function_id": "f::x", "result": {"done": true}}),
    )
    .await?;
    let amended = turnd_tests::eventually(5, "the late result amends the turn", || async {
        let t = caller.get(&ok.turn.turn_id).await.ok()?;
        (t.status == TurnStatus::Completed).then_some(t)
    })
    .await?;
    assert!(amended.recovered);
    assert_eq!(amended.output, Some(json!({"done": true})));
    d.shutdown().await
}

#[tokio::test]
async fn triggers_in_flight_per_connection_are_bounded() -> anyhow::Result<()> {
    let d = start(|c| {
        c.iii.concurrency = 1;
        c.iii.call_dispatch_timeout_ms = 60_000;
    })
    .await?;
    let url = iii_url(&d);
    // A worker that takes one call and never answers: every other call waits for it,
    // holding its place.
    let (_worker, _) =
        open_with(&url, json!({"type": "registerfunction", "id": "busy::f"})).await?;
    let (mut ws, _) = open_with(&url, json!({"type": "registertriggertype", "id": "t"})).await?;
    for n in 1..=1030 {
        send(
            &mut ws,
            json!({"type": "invokefunction", "invocation_id": format!("c{n}"), "function_id": "busy::f", "data": {}}),
        )
        .await?;
    }
    let mut refused = Vec::new();
    for _ in 0..6 {
        let r = recv_type(&mut ws, "invocationresult").await?;
        assert_eq!(r["error"]["code"], "rate_limited", "{r}");
        refused.push(r["invocation_id"].as_str().unwrap_or_default().to_string());
    }
    let want: Vec<String> = (1025..=1030).map(|n| format!("c{n}")).collect();
    assert_eq!(refused, want);
    d.shutdown().await
}

#[tokio::test]
async fn a_daemon_shutdown_closes_iii_connections_with_1001() -> anyhow::Result<()> {
    let d = start(|_| {}).await?;
    let url = iii_url(&d);
    let (mut ws, _) = open_with(&url, json!({"type": "registertriggertype", "id": "t"})).await?;
    let stopping = tokio::spawn(d.shutdown());
    let code = loop {
        match tokio::time::timeout(Duration::from_secs(5), ws.next()).await {
            Err(_) => bail!("no close frame within 5 s"),
            Ok(None) => bail!("the connection ended without a close frame"),
            Ok(Some(Err(e))) => bail!("connection error before a close frame: {e}"),
            Ok(Some(Ok(Message::Close(Some(c))))) => break u16::from(c.code),
            Ok(Some(Ok(_))) => {}
        }
    };
    assert_eq!(code, 1001, "server closing");
    stopping.await??;
    Ok(())
}

/// A sync call's `invokefunction`.
fn call(id: &str, function_id: &str, data: Value) -> Value {
    json!({"type": "invokefunction", "invocation_id": id, "function_id": function_id, "data": data})
}

/// An enqueue's `invokefunction`.
fn enqueue(id: &str, function_id: &str, queue: &str, data: Value) -> Value {
    json!({"type": "invokefunction", "invocation_id": id, "function_id": function_id, "data": data, "action": {"type": "enqueue", "queue": queue}})
}

/// The `invocationresult` answering `id` (other frames skipped).
async fn answer(ws: &mut Ws, id: &str) -> anyhow::Result<Value> {
    loop {
        let f = recv_type(ws, "invocationresult").await?;
        if f["invocation_id"] == id {
            return Ok(f);
        }
    }
}

/// Call a function the endpoint serves itself and return its `result`.
async fn builtin(ws: &mut Ws, id: &str, function_id: &str, data: Value) -> anyhow::Result<Value> {
    send(ws, call(id, function_id, data)).await?;
    let r = answer(ws, id).await?;
    if !r["error"].is_null() {
        bail!("{function_id}: {}", r["error"]);
    }
    Ok(r["result"].clone())
}

/// Fail when a frame of type `ty` arrives within `ms`.
async fn quiet(ws: &mut Ws, ty: &str, ms: u64) -> anyhow::Result<()> {
    match tokio::time::timeout(Duration::from_millis(ms), recv_type(ws, ty)).await {
        Ok(Ok(f)) => bail!("a {ty} arrived: {f}"),
        Ok(Err(e)) => bail!("the connection failed: {e}"),
        Err(_) => Ok(()),
    }
}

/// Send the worker's result for an `invokefunction`.
async fn reply(ws: &mut Ws, inv: &Value, result: Value) -> anyhow::Result<()> {
    send(
        ws,
        json!({"type": "invocationresult", "invocation_id": inv["invocation_id"], "function_id": inv["function_id"], "result": result}),
    )
    .await
}

/// Wait until a connected worker serves `function_id` (or, `false`, none does).
async fn served(d: &TestDaemon, function_id: &str, yes: bool) -> anyhow::Result<()> {
    turnd_tests::eventually(5, "the registry to follow the worker", || async {
        let s = d.engine().supply(function_id);
        ((s.connected > 0) == yes).then_some(())
    })
    .await
}

/// A caller's connection and a worker's that serves `function_id`, on `d`.
async fn with_worker(d: &TestDaemon, function_id: &str) -> anyhow::Result<(Ws, Ws, Value)> {
    let url = iii_url(d);
    let (caller, _) = open_with(&url, json!({"type": "registertriggertype", "id": "t"})).await?;
    let (w, reg) = open_with(&url, json!({"type": "registerfunction", "id": function_id})).await?;
    served(d, function_id, true).await?;
    Ok((caller, w, reg))
}

/// Define the fifo queue `orders` (group field `g`) with `extra` in its config.
async fn define_orders(caller: &mut Ws, extra: Value) -> anyhow::Result<()> {
    let mut config = json!({"type": "fifo", "message_group_field": "g"});
    if let (Some(c), Some(extra)) = (config.as_object_mut(), extra.as_object()) {
        c.extend(extra.clone());
    }
    builtin(
        caller,
        "define",
        "queue::define",
        json!({"queue": "orders", "config": config}),
    )
    .await?;
    Ok(())
}

/// Every session with unfinished work, as `sessions.list` answers.
async fn waiting_sessions(d: &TestDaemon) -> anyhow::Result<Vec<turnd_proto::SessionRow>> {
    let c = d.caller().await?;
    Ok(c.sessions(&turnd_proto::SessionsListArgs::default())
        .await?
        .sessions)
}

#[tokio::test]
async fn a_call_nobody_serves_is_answered_at_once_and_never_runs_later() -> anyhow::Result<()> {
    // A call held for the grace would be answered a minute late, past `recv`'s 5 s
    // and the bound below: far from an answer at once, even on a busy machine.
    let d = start(|c| c.iii.call_grace_ms = 60_000).await?;
    let url = iii_url(&d);
    let (mut caller, _) =
        open_with(&url, json!({"type": "registertriggertype", "id": "t"})).await?;
    let t0 = Instant::now();
    send(&mut caller, call("c1", "nobody::home", json!({"stale": 1}))).await?;
    let r = answer(&mut caller, "c1").await?;
    assert_eq!(r["error"]["code"], "function_not_found", "{r}");
    assert_eq!(r["error"]["message"], "Function nobody::home not found");
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    send(
        &mut caller,
        json!({"type": "invokefunction", "function_id": "nobody::home", "data": {"stale": 2}, "action": {"type": "void"}}),
    )
    .await?;
    // iii's own functions and a function registered over HTTP: named in the answer.
    let (mut web, _) = open_with(
        &url,
        json!({"type": "registerfunction", "id": "web::hook", "invocation": {"url": "http://127.0.0.1:9/"}}),
    )
    .await?;
    // Frames of one connection are taken in order: once this is answered, the
    // registration was read.
    builtin(&mut web, "w1", "engine::workers::register", json!({})).await?;
    for (id, f, says) in [
        ("c2", "state::set", "state functions"),
        ("c3", "stream::set", "stream functions"),
        ("c4", "publish", "pub/sub"),
        ("c5", "web::hook", "HTTP-invoked"),
    ] {
        send(&mut caller, call(id, f, json!({}))).await?;
        let r = answer(&mut caller, id).await?;
        assert_eq!(r["error"]["code"], "function_not_found", "{r}");
        let message = r["error"]["message"].as_str().unwrap_or("");
        assert!(message.contains(says), "{message}");
    }
    // Nothing was admitted: no session waits for a worker.
    assert_eq!(waiting_sessions(&d).await?, vec![]);
    // A worker that registers the function afterwards never gets the abandoned calls.
    let (mut w, _) = open_with(
        &url,
        json!({"type": "registerfunction", "id": "nobody::home"}),
    )
    .await?;
    quiet(&mut w, "invokefunction", 500).await?;
    // A call now runs, in a session no queue's can be.
    send(&mut caller, call("c6", "nobody::home", json!({"n": 6}))).await?;
    let inv = recv_type(&mut w, "invokefunction").await?;
    assert_eq!(inv["data"], json!({"n": 6}));
    let session = inv["metadata"]["turnd"]["session_id"]
        .as_str()
        .unwrap_or("");
    assert_eq!(session, "call/c6");
    reply(&mut w, &inv, json!({"ok": 6})).await?;
    assert_eq!(answer(&mut caller, "c6").await?["result"], json!({"ok": 6}));
    d.shutdown().await
}

#[tokio::test]
async fn a_call_waits_the_grace_for_a_worker_that_may_be_reattaching() -> anyhow::Result<()> {
    let d = start(|c| {
        c.turns.reconnect_grace_ms = 5_000;
        // Room for the reattach below on a busy machine, and under `recv`'s 5 s
        // for the call that waits it out at the end.
        c.iii.call_grace_ms = 3_000;
    })
    .await?;
    let url = iii_url(&d);
    let (mut caller, w, reg) = with_worker(&d, "back::f").await?;
    drop(w);
    served(&d, "back::f", false).await?;
    // The worker left a moment ago: the call waits for it instead of failing.
    send(&mut caller, call("c1", "back::f", json!({"n": 1}))).await?;
    quiet(&mut caller, "invocationresult", 300).await?;
    let (mut w, again) = open_with(
        &url,
        json!({"type": "reattach", "previous_worker_id": reg["worker_id"], "reattach_token": reg["reattach_token"]}),
    )
    .await?;
    assert_eq!(again["worker_id"], reg["worker_id"]);
    send(&mut w, json!({"type": "registerfunction", "id": "back::f"})).await?;
    let inv = recv_type(&mut w, "invokefunction").await?;
    reply(&mut w, &inv, json!({"back": true})).await?;
    assert_eq!(
        answer(&mut caller, "c1").await?["result"],
        json!({"back": true})
    );
    // It does not come back within the grace: function_not_found, nothing left waiting.
    drop(w);
    served(&d, "back::f", false).await?;
    let t0 = Instant::now();
    send(&mut caller, call("c2", "back::f", json!({"n": 2}))).await?;
    let r = answer(&mut caller, "c2").await?;
    let waited = t0.elapsed();
    assert_eq!(r["error"]["code"], "function_not_found", "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("call_grace_ms")),
        "{r}"
    );
    assert!(
        waited >= Duration::from_millis(2_900) && waited < Duration::from_secs(15),
        "{waited:?}"
    );
    assert_eq!(waiting_sessions(&d).await?, vec![]);
    // A worker that registers it later never gets that call.
    let (mut w, _) = open_with(&url, json!({"type": "registerfunction", "id": "back::f"})).await?;
    quiet(&mut w, "invokefunction", 500).await?;
    d.shutdown().await
}

#[tokio::test]
async fn a_call_is_never_dispatched_after_its_dispatch_bound() -> anyhow::Result<()> {
    let d = start(|c| {
        c.iii.concurrency = 1;
        c.iii.call_dispatch_timeout_ms = 400;
    })
    .await?;
    let (mut caller, mut w, _) = with_worker(&d, "one::f").await?;
    send(&mut caller, call("c1", "one::f", json!({"n": 1}))).await?;
    let first = recv_type(&mut w, "invokefunction").await?;
    // The worker's one slot is taken: the second call waits, then gives up.
    let t0 = Instant::now();
    send(&mut caller, call("c2", "one::f", json!({"n": 2}))).await?;
    let r = answer(&mut caller, "c2").await?;
    assert_eq!(r["error"]["code"], "no_worker", "{r}");
    assert!(
        t0.elapsed() >= Duration::from_millis(350),
        "{:?}",
        t0.elapsed()
    );
    // The slot frees up: the second call is not run after its caller was answered.
    reply(&mut w, &first, json!({"n": 1})).await?;
    assert_eq!(answer(&mut caller, "c1").await?["result"], json!({"n": 1}));
    quiet(&mut w, "invokefunction", 500).await?;
    assert_eq!(waiting_sessions(&d).await?, vec![]);
    d.shutdown().await
}

#[tokio::test]
async fn a_call_runs_past_the_turns_default_deadline() -> anyhow::Result<()> {
    // turns.default_timeout_ms scaled down to 200 ms stands for its 30 s default.
    let d = start(|c| c.turns.default_timeout_ms = 200).await?;
    let (mut caller, mut w, _) = with_worker(&d, "long::f").await?;
    send(&mut caller, call("c1", "long::f", json!({}))).await?;
    let inv = recv_type(&mut w, "invokefunction").await?;
    let deadline = inv["metadata"]["turnd"]["deadline_ms"]
        .as_u64()
        .unwrap_or(0);
    let now = d.engine().now_ms();
    assert!(
        deadline >= now + 29 * 60_000,
        "the deadline is iii's 30 minutes, not turns.default_timeout_ms: {}",
        deadline.saturating_sub(now)
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    reply(&mut w, &inv, json!({"long": true})).await?;
    let r = answer(&mut caller, "c1").await?;
    assert_eq!(r["result"], json!({"long": true}), "{r}");
    d.shutdown().await
}

/// A daemon (a short cancel grace, then `f`) with a worker serving `fifo::f`, a
/// caller, a protocol-v1 client, and the fifo queue `orders` with `extra` in its
/// config.
async fn fifo_setup(
    f: impl FnOnce(&mut turnd_server::Config),
    extra: Value,
) -> anyhow::Result<(TestDaemon, Ws, Ws, turnd_client::Caller)> {
    let d = start(|c| {
        c.turns.cancel_grace_ms = 200;
        f(c)
    })
    .await?;
    let (mut caller, w, _) = with_worker(&d, "fifo::f").await?;
    define_orders(&mut caller, extra).await?;
    let v1 = d.caller().await?;
    Ok((d, caller, w, v1))
}

/// Enqueue two messages of group `a` of `orders`, stop the first once its handler
/// started, and wait until the second is held: the two turns and the first's
/// `invokefunction`.
async fn hold_group_a(
    caller: &mut Ws,
    w: &mut Ws,
    v1: &turnd_client::Caller,
) -> anyhow::Result<(String, String, Value)> {
    let t1 = receipt(caller, "a1", json!({"g": "a", "n": 1})).await?;
    let t2 = receipt(caller, "a2", json!({"g": "a", "n": 2})).await?;
    let first = recv_type(w, "invokefunction").await?;
    v1.stop(&t1, "enough").await?;
    turnd_tests::wait_done(v1, &t1, 5).await?;
    turnd_tests::eventually(5, "the second message held", || async {
        let t = v1.get(&t2).await.ok()?;
        (t.wait?.state == turnd_proto::WaitState::Held).then_some(())
    })
    .await?;
    Ok((t1, t2, first))
}

async fn receipt(caller: &mut Ws, id: &str, data: Value) -> anyhow::Result<String> {
    send(caller, enqueue(id, "fifo::f", "orders", data)).await?;
    let r = answer(caller, id).await?;
    Ok(r["result"]["messageReceiptId"]
        .as_str()
        .context("a receipt")?
        .to_string())
}

#[tokio::test]
async fn a_stopped_fifo_message_holds_its_group_until_its_result() -> anyhow::Result<()> {
    let (d, mut caller, mut w, v1) = fifo_setup(|_| {}, json!({"timeout_ms": 60_000})).await?;
    let t1 = receipt(&mut caller, "m1", json!({"g": "a", "n": 1})).await?;
    let t2 = receipt(&mut caller, "m2", json!({"g": "a", "n": 2})).await?;
    let first = recv_type(&mut w, "invokefunction").await?;
    assert_eq!(first["data"]["n"], 1);
    // The queue's timeout_ms is the delivery's deadline.
    let deadline = first["metadata"]["turnd"]["deadline_ms"]
        .as_u64()
        .unwrap_or(0);
    let left = deadline.saturating_sub(d.engine().now_ms());
    assert!((50_000..=60_000).contains(&left), "{left}");
    v1.stop(&t1, "enough").await?;
    let stopped = turnd_tests::wait_done(&v1, &t1, 5).await?;
    assert_eq!(stopped.status, TurnStatus::Cancelled);
    assert_eq!(stopped.stop.map(|s| s.reason), Some("enough".into()));
    // The handler may still run: the next message waits, visibly, for its result.
    let next = v1.get(&t2).await?;
    let wait = next.wait.context("a wait")?;
    assert_eq!(wait.state, turnd_proto::WaitState::Held, "{wait:?}");
    assert_eq!(
        wait.invocation_id.as_ref(),
        first["invocation_id"].as_str().map(String::from).as_ref()
    );
    assert_eq!(wait.deadline_ms, Some(deadline));
    assert_eq!(wait.on_deadline, Some(turnd_proto::OnDeadline::Dispatch));
    let rows = waiting_sessions(&d).await?;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].session_id, "orders:a");
    assert_eq!(rows[0].wait.state, turnd_proto::WaitState::Held);
    quiet(&mut w, "invokefunction", 500).await?;
    // The stopped handler's result: the group moves on at once.
    reply(&mut w, &first, json!({"n": 1})).await?;
    let second = recv_type(&mut w, "invokefunction").await?;
    assert_eq!(second["data"]["n"], 2);
    assert_eq!(v1.get(&t1).await?.status, TurnStatus::Cancelled);
    reply(&mut w, &second, json!({"n": 2})).await?;
    assert_eq!(
        turnd_tests::wait_done(&v1, &t2, 5).await?.status,
        TurnStatus::Completed
    );
    d.shutdown().await
}

#[tokio::test]
async fn a_stopped_fifo_message_without_a_result_holds_its_group_until_its_deadline(
) -> anyhow::Result<()> {
    let (d, mut caller, mut w, v1) = fifo_setup(|_| {}, json!({"timeout_ms": 1_500})).await?;
    let t1 = receipt(&mut caller, "m1", json!({"g": "a", "n": 1})).await?;
    receipt(&mut caller, "m2", json!({"g": "a", "n": 2})).await?;
    let first = recv_type(&mut w, "invokefunction").await?;
    let deadline = first["metadata"]["turnd"]["deadline_ms"]
        .as_u64()
        .context("the first message's deadline")?;
    v1.stop(&t1, "enough").await?;
    let second = recv_type(&mut w, "invokefunction").await?;
    // By the daemon's clock, which stamped the deadline (the test's would start once
    // the first message arrived, after the dispatch's commit).
    let now = d.engine().now_ms();
    assert_eq!(second["data"]["n"], 2);
    assert!(
        now >= deadline,
        "the next message started at {now}, before the first one's deadline {deadline}"
    );
    // The first one's result comes after all: late, it changes nothing.
    reply(&mut w, &first, json!({"n": 1})).await?;
    let late = turnd_tests::eventually(5, "the late result", || async {
        let ev = v1.events("orders:a", None, Some(1000)).await.ok()?.events;
        ev.iter()
            .any(|e| e.kind == turnd_proto::EventKind::LateResult)
            .then_some(())
    })
    .await;
    late?;
    assert_eq!(v1.get(&t1).await?.status, TurnStatus::Cancelled);
    d.shutdown().await
}

#[tokio::test]
async fn a_queues_retries_come_from_its_definition_and_the_rest_is_refused() -> anyhow::Result<()> {
    let (d, mut caller, mut w, v1) =
        fifo_setup(|_| {}, json!({"max_retries": 2, "backoff_ms": 100})).await?;
    for (n, refused) in [
        (1, json!({"concurrency": 10})),
        (2, json!({"poll_interval_ms": 100})),
        (3, json!({"redeliver_on_engine_restart": true})),
        (4, json!({"max_priority": 3, "priority_field": "p"})),
    ] {
        let field = refused
            .as_object()
            .and_then(|o| o.keys().next().cloned())
            .unwrap_or_default();
        let id = format!("d{n}");
        send(
            &mut caller,
            call(
                &id,
                "queue::define",
                json!({"queue": "other", "config": refused}),
            ),
        )
        .await?;
        let r = answer(&mut caller, &id).await?;
        assert_eq!(r["error"]["code"], "invalid_queue_config", "{r}");
        let message = r["error"]["message"].as_str().unwrap_or("");
        assert!(message.contains(&format!("`{field}`")), "{message}");
    }
    // max_retries 2: three attempts of a failing handler, the retries backed off.
    let t = receipt(&mut caller, "m1", json!({"g": "a"})).await?;
    let mut at = Vec::new();
    for attempt in 1..=3 {
        let inv = recv_type(&mut w, "invokefunction").await?;
        at.push(Instant::now());
        assert_eq!(inv["metadata"]["turnd"]["attempt"], attempt);
        send(
            &mut w,
            json!({"type": "invocationresult", "invocation_id": inv["invocation_id"], "function_id": "fifo::f", "error": {"code": "invocation_failed", "message": "boom"}}),
        )
        .await?;
    }
    quiet(&mut w, "invokefunction", 400).await?;
    assert!(
        at[1] - at[0] >= Duration::from_millis(90),
        "{:?}",
        at[1] - at[0]
    );
    assert!(
        at[2] - at[1] >= Duration::from_millis(190),
        "{:?}",
        at[2] - at[1]
    );
    let done = turnd_tests::wait_done(&v1, &t, 5).await?;
    let err = done.error.context("an error")?;
    assert_eq!(err.cause, turnd_proto::ErrorCause::AttemptsExhausted);
    assert_eq!(err.code, "invocation_failed");
    d.shutdown().await
}

#[tokio::test]
async fn topic_stats_of_a_queue_named_call_counts_no_calls() -> anyhow::Result<()> {
    let d = start(|_| {}).await?;
    let (mut caller, mut w, _) = with_worker(&d, "slow::f").await?;
    builtin(
        &mut caller,
        "d",
        "queue::define",
        json!({"queue": "call", "config": {"type": "standard"}}),
    )
    .await?;
    // A sync and a void call in flight.
    send(&mut caller, call("c1", "slow::f", json!({}))).await?;
    send(
        &mut caller,
        json!({"type": "invokefunction", "function_id": "slow::f", "data": {}, "action": {"type": "void"}}),
    )
    .await?;
    let calls = [
        recv_type(&mut w, "invokefunction").await?,
        recv_type(&mut w, "invokefunction").await?,
    ];
    let stats = builtin(
        &mut caller,
        "s1",
        "engine::queue::topic_stats",
        json!({"queue": "call"}),
    )
    .await?;
    assert_eq!(
        (stats["depth"].as_u64(), stats["in_flight"].as_u64()),
        (Some(0), Some(0)),
        "{stats}"
    );
    // A message of the queue is counted.
    send(&mut caller, enqueue("m1", "slow::f", "call", json!({}))).await?;
    answer(&mut caller, "m1").await?;
    let message = recv_type(&mut w, "invokefunction").await?;
    let stats = builtin(
        &mut caller,
        "s2",
        "engine::queue::topic_stats",
        json!({"queue": "call"}),
    )
    .await?;
    assert_eq!(
        (stats["depth"].as_u64(), stats["in_flight"].as_u64()),
        (Some(1), Some(1)),
        "{stats}"
    );
    for inv in calls.iter().chain([&message]) {
        reply(&mut w, inv, json!({})).await?;
    }
    d.shutdown().await
}

#[tokio::test]
async fn a_held_session_leaves_freed_capacity_to_sessions_that_can_take_it() -> anyhow::Result<()> {
    let (d, mut caller, mut w, v1) =
        fifo_setup(|c| c.iii.concurrency = 1, json!({"timeout_ms": 60_000})).await?;
    // Group a: its first message stopped while its handler runs on; the second held.
    hold_group_a(&mut caller, &mut w, &v1).await?;
    // The worker's one slot: group b takes it, group c waits for it.
    receipt(&mut caller, "b1", json!({"g": "b"})).await?;
    let b = recv_type(&mut w, "invokefunction").await?;
    assert_eq!(b["data"]["g"], "b");
    receipt(&mut caller, "c1", json!({"g": "c"})).await?;
    quiet(&mut w, "invokefunction", 300).await?;
    // The slot frees: it goes to group c, not to the held group.
    reply(&mut w, &b, json!({})).await?;
    let c = recv_type(&mut w, "invokefunction").await?;
    assert_eq!(c["data"]["g"], "c");
    d.shutdown().await
}

#[tokio::test]
async fn a_hold_lasts_across_a_restart_and_the_reattached_workers_result_ends_it(
) -> anyhow::Result<()> {
    let dir = Arc::new(tempfile::tempdir()?);
    let cfg = |c: &mut turnd_server::Config| {
        c.iii.listen = Some("127.0.0.1:0".into());
        c.turns.cancel_grace_ms = 200;
        c.turns.reconnect_grace_ms = 5_000;
    };
    let d = TestDaemon::start_in(dir.clone(), cfg, false).await?;
    let (mut caller, mut w, reg) = with_worker(&d, "fifo::f").await?;
    define_orders(&mut caller, json!({"timeout_ms": 60_000})).await?;
    let v1 = d.caller().await?;
    let (t1, t2, first) = hold_group_a(&mut caller, &mut w, &v1).await?;
    let before = v1.get(&t2).await?.wait.context("a wait")?;
    drop((caller, w, v1));
    d.shutdown().await?;

    // After the restart the next message is still held, to the same deadline.
    let d = TestDaemon::start_in(dir, cfg, false).await?;
    let url = iii_url(&d);
    let v1 = d.caller().await?;
    let after = v1.get(&t2).await?.wait.context("a wait")?;
    assert_eq!(after.state, turnd_proto::WaitState::Held, "{after:?}");
    assert_eq!(after.deadline_ms, before.deadline_ms);
    // The worker reattaches and sends the stopped handler's result: the hold ends.
    let (mut w, _) = open_with(
        &url,
        json!({"type": "reattach", "previous_worker_id": reg["worker_id"], "reattach_token": reg["reattach_token"]}),
    )
    .await?;
    send(&mut w, json!({"type": "registerfunction", "id": "fifo::f"})).await?;
    served(&d, "fifo::f", true).await?;
    quiet(&mut w, "invokefunction", 300).await?;
    reply(&mut w, &first, json!({"n": 1})).await?;
    let second = recv_type(&mut w, "invokefunction").await?;
    assert_eq!(second["data"]["n"], 2);
    assert_eq!(v1.get(&t1).await?.status, TurnStatus::Cancelled);
    d.shutdown().await
}
