//! The iii endpoint through raw iii frames against the real daemon: who may connect,
//! reattach tokens (forged, valid, after a restart), tolerance of every other
//! message, and an iii worker's deadline going straight to outcome unknown. The
//! real SDKs' tests are in tests/iii (Node and Python).

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
        c.turns.probe_timeout_ms = 2_000;
        c.iii.timeout_ms = Some(300);
    })
    .await?;
    let url = iii_url(&d);
    let (mut ws, _) = open_with(&url, json!({"type": "registerfunction", "id": "f::x"})).await?;
    let caller = d.caller().await?;
    let t0 = Instant::now();
    let ok = caller
        .submit(turnd_proto::SubmitArgs {
            session_id: "s1".into(),
            function_id: "f::x".into(),
            input: json!({"k": 1}),
            idempotency_key: None,
            turn_timeout_ms: None,
        })
        .await?;
    let inv = recv_type(&mut ws, "invokefunction").await?;
    assert_eq!(inv["function_id"], "f::x");
    assert_eq!(inv["data"], json!({"k": 1}));
    assert_eq!(
        inv["metadata"]["turnd"]["turn_id"],
        ok.turn.turn_id.as_str()
    );
    let turn = caller.wait(&ok.turn.turn_id, Some(5_000)).await?;
    assert_eq!(turn.status, TurnStatus::Failed);
    let err = turn.error.context("error")?;
    assert_eq!(err.cause, turnd_proto::ErrorCause::OutcomeUnknown);
    // The deadline (300 ms), not the deadline plus the probe timeout (2 s).
    assert!(
        t0.elapsed() < Duration::from_millis(1_500),
        "{:?}",
        t0.elapsed()
    );
    let events = caller.events("s1", None, Some(1000)).await?.events;
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
    let d = start(|_| {}).await?;
    let url = iii_url(&d);
    let (mut ws, _) = open_with(&url, json!({"type": "registertriggertype", "id": "t"})).await?;
    // No worker serves the function: every sync call stays running, holding its place.
    for n in 1..=1030 {
        send(
            &mut ws,
            json!({"type": "invokefunction", "invocation_id": format!("c{n}"), "function_id": "nobody::serves", "data": {}}),
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
