//! Auth, limits, hostile input, graceful shutdown, and CI use of the built binary.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;
use turnd_client::{Caller, FunctionSpec, Worker};
use turnd_proto::{Outcome, Role, TurnStatus, WaitState};
use turnd_server::config::TokenConfig;
use turnd_tests::{eventually, wait_done, worker_options, BinDaemon, Raw, TestDaemon};

const T: u64 = 15;

fn tokens() -> Vec<TokenConfig> {
    vec![
        TokenConfig {
            role: Role::Worker,
            token: "worker-secret-1".into(),
        },
        TokenConfig {
            role: Role::Client,
            token: "client-secret-1".into(),
        },
        TokenConfig {
            role: Role::Operator,
            token: "operator-secret-1".into(),
        },
    ]
}

async fn hello_code(url: &str, role: &str, token: &str) -> anyhow::Result<Option<String>> {
    let mut r = Raw::connect(url).await?;
    let f = r
        .request("hello", json!({"protocol": 1, "role": role, "token": token, "worker_id": "w", "instance_id": "i"}))
        .await?;
    Ok(f.pointer("/error/code")
        .and_then(Value::as_str)
        .map(str::to_string))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_checked_per_role() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| c.auth.tokens = tokens()).await?;
    assert_eq!(
        hello_code(&td.url, "client", "wrong").await?.as_deref(),
        Some("not_authenticated")
    );
    assert_eq!(
        hello_code(&td.url, "client", "").await?.as_deref(),
        Some("not_authenticated")
    );
    assert_eq!(
        hello_code(&td.url, "client", "worker-secret-1")
            .await?
            .as_deref(),
        Some("not_authenticated")
    );
    assert_eq!(
        hello_code(&td.url, "client", "client-secret-1").await?,
        None
    );
    assert_eq!(
        hello_code(&td.url, "worker", "worker-secret-1").await?,
        None
    );
    // An operator token opens every role.
    assert_eq!(
        hello_code(&td.url, "client", "operator-secret-1").await?,
        None
    );
    assert_eq!(
        hello_code(&td.url, "operator", "client-secret-1")
            .await?
            .as_deref(),
        Some("not_authenticated")
    );
    // After a refused hello the connection is still unauthenticated.
    let mut r = Raw::connect(&td.url).await?;
    let f = r
        .request(
            "hello",
            json!({"protocol": 1, "role": "client", "token": "nope"}),
        )
        .await?;
    assert_eq!(f["error"]["code"], "not_authenticated");
    assert_eq!(r.error_code("stats", json!({})).await?, "not_authenticated");
    r.ok(
        "hello",
        json!({"protocol": 1, "role": "client", "token": "client-secret-1"}),
    )
    .await?;
    r.ok("stats", json!({})).await?;
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cannot_touch_another_workers_invocation() -> anyhow::Result<()> {
    let td = TestDaemon::start(|_| {}).await?;
    let c = td.caller().await?;
    let (mut owner, _) = Raw::hello(
        &td.url,
        "worker",
        json!({"worker_id": "owner", "instance_id": "i1"}),
    )
    .await?;
    owner
        .ok("function.register", json!({"function_id": "f"}))
        .await?;
    let (mut thief, _) = Raw::hello(
        &td.url,
        "worker",
        json!({"worker_id": "thief", "instance_id": "i2"}),
    )
    .await?;
    let t = c.submit_simple("own", "f", json!(1)).await?;
    let invoke = owner.next_push().await?;
    let inv = invoke["invocation_id"].clone();
    let args = json!({"invocation_id": inv, "outcome": {"complete": "stolen"}});
    assert_eq!(
        thief.error_code("invocation.result", args).await?,
        "forbidden"
    );
    assert_eq!(
        thief
            .error_code("invocation.heartbeat", json!({"invocation_id": inv}))
            .await?,
        "forbidden"
    );
    assert_eq!(
        thief
            .error_code(
                "invocation.status",
                json!({"invocation_id": inv, "state": "unknown"})
            )
            .await?,
        "forbidden"
    );
    let now = c.get(&t.turn_id).await?;
    assert_eq!(now.status, TurnStatus::Running, "nothing changed");
    assert_eq!(now.wait.map(|w| w.state), Some(WaitState::AwaitingResult));
    let ok = owner
        .ok(
            "invocation.result",
            json!({"invocation_id": inv, "outcome": {"complete": "mine"}}),
        )
        .await?;
    assert_eq!(ok["accepted"], "applied");
    assert_eq!(
        wait_done(&c, &t.turn_id, T).await?.output,
        Some(json!("mine"))
    );
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frame_depth_and_value_limits() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| {
        c.server.max_frame_bytes = 4096;
        c.server.max_json_depth = 8;
        c.turns.max_value_bytes = 1024;
    })
    .await?;
    let (mut r, _) = Raw::hello(&td.url, "client", json!({})).await?;
    // JSON nested deeper than the limit: too_large, and the connection survives.
    let deep = format!(
        "{{\"id\":5,\"op\":\"ping\",\"args\":{{\"x\":{}1{}}}}}",
        "[".repeat(20),
        "]".repeat(20)
    );
    r.send_text(&deep).await?;
    let f = r.recv().await?;
    assert_eq!(f["error"]["code"], "too_large", "{f}");
    r.ok("ping", json!({})).await?;
    // An input over max_value_bytes: too_large, no turn created.
    let code = r
        .error_code(
            "turn.submit",
            json!({"session_id": "lim", "function_id": "f", "input": "x".repeat(2000)}),
        )
        .await?;
    assert_eq!(code, "too_large");
    assert_eq!(
        r.error_code("session.inspect", json!({"session_id": "lim"}))
            .await?,
        "not_found"
    );
    // A frame over max_frame_bytes: too_large where possible, then close 1009.
    r.send_text(&format!(
        "{{\"id\":9,\"op\":\"ping\",\"args\":{{\"pad\":\"{}\"}}}}",
        "y".repeat(8000)
    ))
    .await?;
    assert_eq!(close_after_too_large(&mut r.ws).await?, Some(1009));
    td.shutdown().await
}

/// The frames up to the close, after a frame over `max_frame_bytes`: its close code
/// (None when the connection ended without a close frame), with every text frame
/// before it a `too_large` error.
async fn close_after_too_large<S>(
    ws: &mut tokio_tungstenite::WebSocketStream<S>,
) -> anyhow::Result<Option<u16>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    loop {
        match tokio::time::timeout(Duration::from_secs(5), ws.next()).await? {
            Some(Ok(Message::Close(Some(c)))) => return Ok(Some(u16::from(c.code))),
            Some(Ok(Message::Text(t))) => {
                let f: Value = serde_json::from_str(t.as_str())?;
                anyhow::ensure!(f["error"]["code"] == "too_large", "{f}");
            }
            Some(Ok(_)) => continue,
            Some(Err(e)) => anyhow::bail!("socket error instead of a close frame: {e}"),
            None => return Ok(None),
        }
    }
}

/// A frame far over `max_frame_bytes` (megabytes more than the socket buffers hold
/// while the daemon has read only its header) ends in close code 1009 and the peer's
/// write of it completes, with no reset: the daemon reads and drops the rest of the
/// frame after its close frame instead of closing the socket with it unread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_far_over_the_limit_ends_in_close_1009_not_a_reset() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| c.server.max_frame_bytes = 4096).await?;
    for round in 0..3 {
        let (mut r, _) = Raw::hello(&td.url, "client", json!({})).await?;
        far_over_the_limit(&mut r.ws)
            .await
            .with_context(|| format!("round {round}"))?;
    }
    td.shutdown().await
}

/// The same over TLS, where the daemon's shut of its write side is TLS's
/// `close_notify` first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_a_frame_far_over_the_limit_ends_in_close_1009_not_a_reset() -> anyhow::Result<()>
{
    let certs = tempfile::tempdir()?;
    let (cert, key, client) = self_signed(certs.path())?;
    let td = TestDaemon::start(|c| {
        c.server.max_frame_bytes = 4096;
        c.server.tls_cert = Some(cert.clone());
        c.server.tls_key = Some(key.clone());
    })
    .await?;
    let addr = td
        .url
        .trim_start_matches("wss://")
        .split('/')
        .next()
        .context("address in the url")?
        .to_string();
    for round in 0..3 {
        let tcp = tokio::net::TcpStream::connect(&addr).await?;
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?.to_owned();
        let tls = tokio_rustls::TlsConnector::from(client.clone())
            .connect(name, tcp)
            .await?;
        let (mut ws, _) = tokio_tungstenite::client_async(td.url.as_str(), tls).await?;
        far_over_the_limit(&mut ws)
            .await
            .with_context(|| format!("round {round}"))?;
    }
    td.shutdown().await
}

/// Send a 16 MiB frame (the daemon's limit being 4 KiB) and read up to the close:
/// it must be 1009, and the write must have completed (not been cut off by a reset:
/// a client that fails its connection on a failed write, as Python's `websockets`
/// does, would otherwise lose the close frame it had not read yet).
async fn far_over_the_limit<S>(ws: &mut tokio_tungstenite::WebSocketStream<S>) -> anyhow::Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let big = format!(
        "{{\"id\":9,\"op\":\"ping\",\"args\":{{\"pad\":\"{}\"}}}}",
        "z".repeat(16 * 1024 * 1024)
    );
    let sent = tokio::time::timeout(Duration::from_secs(10), ws.send(Message::text(big)))
        .await
        .context("the write of the frame did not end in 10 s")?;
    let code = close_after_too_large(ws)
        .await
        .with_context(|| format!("send: {sent:?}"))?;
    anyhow::ensure!(code == Some(1009), "close code {code:?} (send: {sent:?})");
    anyhow::ensure!(sent.is_ok(), "send failed: {sent:?}");
    Ok(())
}

/// Send `n` requests `op` with `args` at once on `r`, a connection held to `rate`
/// requests per second, and check the rate held: of the burst, at most `exempt`
/// uncounted requests, the bucket's `rate` tokens and what refilled while the daemon
/// read the burst were let through, and the others were refused as `rate_limited`,
/// retryable. A burst so slow (a busy machine) that the bound leaves none refused
/// proves nothing and is sent again, a few times at most. Returns the answers of the
/// requests let through.
async fn limited_burst(
    r: &mut Raw,
    rate: u64,
    op: &str,
    args: Value,
    n: usize,
    exempt: usize,
) -> anyhow::Result<Vec<Value>> {
    for _ in 0..5 {
        let (answers, took) = r.burst(op, &args, n).await?;
        let (refused, passed): (Vec<Value>, Vec<Value>) = answers
            .into_iter()
            .partition(|f| f.pointer("/error/code") == Some(&json!("rate_limited")));
        for f in &refused {
            anyhow::ensure!(f["error"]["retryable"] == true, "not retryable: {f}");
        }
        // The bucket holds at most `rate` tokens and gains `rate` a second.
        let refilled = (rate as f64 * took.as_secs_f64()).floor() as usize;
        let most = exempt + rate as usize + refilled;
        anyhow::ensure!(
            passed.len() <= most,
            "{} of {n} {op} let through in {took:?}: at most {most} may be",
            passed.len()
        );
        if most < n {
            return Ok(passed);
        }
    }
    anyhow::bail!("every burst of {n} {op} took too long to show the rate limit");
}

/// A worker's first `invocation.result` for a live invocation dispatched to it is not
/// counted against the connection's request rate: the daemon bounds those by the
/// concurrency the worker registered, and refusing one would hold a finished step
/// back. Later results for the same invocation and its other requests still are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_results_for_its_own_invocations_are_not_rate_limited() -> anyhow::Result<()> {
    const TURNS: usize = 12;
    let td = TestDaemon::start(|c| c.server.max_requests_per_second = 5).await?;
    let hello = json!({"worker_id": "w-rate", "instance_id": "i-1"});
    let (mut w, _) = Raw::hello(&td.url, "worker", hello).await?;
    w.ok(
        "function.register",
        json!({"function_id": "f", "concurrency": TURNS}),
    )
    .await?;
    // Callers have their own buckets: three connections of four submits each.
    let mut turn_ids = Vec::new();
    for k in 0..3 {
        let (mut c, _) = Raw::hello(&td.url, "client", json!({})).await?;
        for j in 0..TURNS / 3 {
            let t = c
                .ok(
                    "turn.submit",
                    json!({"session_id": format!("r{k}-{j}"), "function_id": "f", "input": j}),
                )
                .await?;
            turn_ids.push(
                t["turn"]["turn_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            );
        }
    }
    let mut invs = Vec::new();
    while invs.len() < TURNS {
        let p = w.next_push().await?;
        if p["push"] == "invoke" {
            invs.push(p["invocation_id"].as_str().unwrap_or_default().to_string());
        }
    }
    // Eleven results at once, far over the 5 per second this connection may send.
    for inv in &invs[1..] {
        let ok = w
            .ok(
                "invocation.result",
                json!({"invocation_id": inv, "outcome": {"complete": "done"}}),
            )
            .await?;
        assert_eq!(ok["accepted"], "applied", "{inv}: {ok}");
    }
    // Only the first result for an invocation is exempt, even a malformed one, so a
    // worker cannot flood the daemon with results for an invocation it keeps live:
    // of a burst of 15, at most one and what the bucket lets through are answered.
    let passed = limited_burst(
        &mut w,
        5,
        "invocation.result",
        json!({"invocation_id": invs[0], "outcome": "garbage"}),
        15,
        1,
    )
    .await?;
    for f in &passed {
        assert_eq!(
            f.pointer("/error/code"),
            Some(&json!("bad_request")),
            "a malformed result was accepted: {f}"
        );
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let ok = w
        .ok(
            "invocation.result",
            json!({"invocation_id": invs[0], "outcome": {"complete": "done"}}),
        )
        .await?;
    assert_eq!(ok["accepted"], "applied", "{ok}");
    for ids in turn_ids.chunks(4) {
        let c = td.caller().await?;
        for id in ids {
            assert_eq!(c.get(id).await?.status, TurnStatus::Completed, "{id}");
        }
    }
    // Resending a result that was exempt and applied is counted.
    let passed = limited_burst(
        &mut w,
        5,
        "invocation.result",
        json!({"invocation_id": invs[1], "outcome": {"complete": "done"}}),
        14,
        0,
    )
    .await?;
    for f in &passed {
        assert_eq!(f["ok"]["accepted"], "duplicate", "{f}");
    }
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_request_watch_and_queue_limits() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| {
        c.server.max_connections_per_ip = 3;
        c.server.max_requests_per_second = 5;
        c.server.max_watches_per_connection = 2;
        c.turns.max_queued_per_session = 3;
    })
    .await?;
    // Requests per second: a burst over the bucket is refused, retryable.
    let (mut r, _) = Raw::hello(&td.url, "client", json!({})).await?;
    for f in limited_burst(&mut r, 5, "ping", json!({}), 10, 0).await? {
        assert!(f.get("ok").is_some(), "{f}");
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    r.ok("ping", json!({})).await?;
    // Turns queued per session.
    for i in 0..3 {
        r.ok(
            "turn.submit",
            json!({"session_id": "q", "function_id": "none", "input": i}),
        )
        .await?;
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        r.error_code(
            "turn.submit",
            json!({"session_id": "q", "function_id": "none", "input": 9})
        )
        .await?,
        "rate_limited"
    );
    // Watches per connection.
    r.ok("watch", json!({"session_id": "q"})).await?;
    r.ok("watch", json!({"session_id": "q"})).await?;
    assert_eq!(
        r.error_code("watch", json!({"session_id": "q"})).await?,
        "rate_limited"
    );
    // Connections per address: this one plus two more are allowed, the fourth is refused.
    let _b = Raw::connect(&td.url).await?;
    let _c = Raw::connect(&td.url).await?;
    let mut d = Raw::connect(&td.url).await?;
    let f = d.recv().await?;
    assert_eq!(f["error"]["code"], "rate_limited", "{f}");
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_bad_frames_close_the_connection() -> anyhow::Result<()> {
    let td = TestDaemon::start(|_| {}).await?;
    let (mut r, _) = Raw::hello(&td.url, "client", json!({})).await?;
    for i in 0..15 {
        r.send_text("not json").await?;
        let f = r.recv().await?;
        assert_eq!(f["error"]["code"], "bad_frame", "frame {i}: {f}");
    }
    // A good frame resets the count.
    r.ok("ping", json!({})).await?;
    for _ in 0..16 {
        r.send_text("{}").await?;
    }
    let mut close = None;
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(5), r.ws.next()).await {
        match m {
            Ok(Message::Close(c)) => {
                close = c.map(|c| u16::from(c.code));
                break;
            }
            Ok(_) => continue,
            Err(_) => break,
        }
    }
    assert_eq!(close, Some(1008));
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_worker_is_disconnected_and_its_work_awaits_the_reconnect() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| {
        c.server.outbox_frames = 4;
        c.turns.reconnect_grace_ms = 60_000;
        c.turns.max_value_bytes = 600_000;
        c.server.max_frame_bytes = 2 * 1024 * 1024;
    })
    .await?;
    let c = td.caller().await?;
    // A worker that never reads after registering, with a tiny receive buffer: its
    // socket fills up and the daemon's outgoing queue with it.
    let mut w = turnd_tests::small_buffer_peer(&td.url).await?;
    w.ok("hello", json!({"protocol": 1, "role": "worker", "token": "t", "worker_id": "slow", "instance_id": "i1"})).await?;
    w.ok(
        "function.register",
        json!({"function_id": "big", "concurrency": 1000}),
    )
    .await?;
    let big = "z".repeat(100_000);
    let mut ids = Vec::new();
    for i in 0..40 {
        ids.push(
            c.submit_simple(&format!("slow-{i}"), "big", json!(big))
                .await?
                .turn_id,
        );
    }
    // The daemon cut it off instead of buffering without bound…
    eventually(T, "the slow worker to be disconnected", || {
        let c = &c;
        async move {
            let ws = c.workers().await.ok()?;
            ws.iter()
                .find(|x| x.worker_id == "slow")
                .filter(|x| !x.connected)
                .map(|_| ())
        }
    })
    .await?;
    // …and its dispatched invocations wait for its reconnect: nothing failed.
    let t = c.get(&ids[0]).await?;
    assert_eq!(t.status, TurnStatus::Running);
    assert_eq!(t.wait.map(|w| w.state), Some(WaitState::AwaitingReconnect));
    let stats = c.stats().await?;
    assert_eq!(stats.turns.failed, 0);
    drop(w);
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_waits_and_refuses_new_work() -> anyhow::Result<()> {
    // A shutdown that waited for the turn.wait would take the whole drain time
    // (shutdown_timeout_ms) or the wait's timeout: two minutes, far from the few
    // seconds a shutdown takes even on a busy machine.
    let td = TestDaemon::start(|c| c.server.shutdown_timeout_ms = 120_000).await?;
    let c = td.caller().await?;
    let t = c.submit_simple("sd", "none", json!(null)).await?;
    let waiter = {
        let c = Caller::connect(&td.url, None).await?;
        let id = t.turn_id.clone();
        tokio::spawn(async move { c.wait(&id, Some(120_000)).await })
    };
    eventually(T, "the turn.wait to be waiting", || async {
        let (_, body) = turnd_tests::http_get(&td.admin, "/metrics").await.ok()?;
        (turnd_tests::metric(&body, "turnd_turn_waits")? >= 1.0).then_some(())
    })
    .await?;
    let started = tokio::time::Instant::now();
    td.shutdown().await?;
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "shutdown did not wait out the turn.wait: {:?}",
        started.elapsed()
    );
    // The wait was answered with the turn as it is, or its connection closed.
    match waiter.await? {
        Ok(turn) => assert_eq!(turn.status, TurnStatus::Queued),
        Err(e) => assert!(e.code().is_none() || e.is_retryable(), "{e}"),
    }
    Ok(())
}

/// A free loopback port (the daemon is restarted on the same one so SDK workers
/// reconnect by themselves).
fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_exits_zero_and_loses_nothing_acknowledged() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let port = free_port()?.to_string();
    let listen = format!("127.0.0.1:{port}");
    let env = [
        ("TURND_TURNS__RECONNECT_GRACE_MS", "30000"),
        ("TURND_TURNS__DEFAULT_TIMEOUT_MS", "10000"),
    ];
    let d = BinDaemon::start_on(&data, &listen, &env).await?;
    let url = d.url.clone();
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = {
        let runs = runs.clone();
        Worker::new(worker_options(&url, "w-term"))
            .function(FunctionSpec::new("slowecho").concurrency(16), move |ctx| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    Outcome::Complete(ctx.invoke.input.clone())
                }
            })
            .spawn(tokio_util::sync::CancellationToken::new())
    };
    worker.connected().await;
    // Load: submitters keep going until the daemon stops answering.
    let acked = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let mut load = Vec::new();
    for s in 0..4 {
        let url = url.clone();
        let acked = acked.clone();
        load.push(tokio::spawn(async move {
            let Ok(c) = Caller::connect(&url, None).await else {
                return;
            };
            for i in 0..1000 {
                match c
                    .submit_simple(&format!("term-{s}"), "slowecho", json!(i))
                    .await
                {
                    Ok(t) => acked.lock().map(|mut a| a.push(t.turn_id)).unwrap_or(()),
                    Err(_) => return,
                }
            }
        }));
    }
    eventually(T, "some acknowledged work", || {
        let acked = acked.clone();
        async move { (acked.lock().map(|a| a.len()).unwrap_or(0) >= 20).then_some(()) }
    })
    .await?;
    let status = d.terminate().await?;
    assert!(status.success(), "SIGTERM exit status: {status:?}");
    for l in load {
        l.await?;
    }
    let acked: Vec<String> = acked.lock().map(|a| a.clone()).unwrap_or_default();
    // Restart on the same port and data; the worker reconnects by itself and its
    // in-flight work is reconciled.
    let d2 = BinDaemon::start_on(&data, &listen, &env).await?;
    let c = Caller::connect(&d2.url, None).await?;
    for id in &acked {
        let t = c.wait_terminal(id, Duration::from_secs(60)).await?;
        assert_eq!(t.status, TurnStatus::Completed, "{id}: {t:?}");
    }
    let op = Caller::connect_as(&d2.url, Role::Operator, None).await?;
    let v = op.store_check().await?;
    assert!(v.is_empty(), "{v:?}");
    eprintln!(
        "acknowledged {} turns, handler runs {}",
        acked.len(),
        runs.load(Ordering::SeqCst)
    );
    worker.shutdown();
    d2.terminate().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ci_use_ready_file_and_check_config() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = BinDaemon::start(&dir.path().join("data"), &[]).await?;
    let c = Caller::connect(&d.url, None).await?;
    c.ping().await?;
    assert!(d.admin.starts_with("http://127.0.0.1:"));
    let status = d.terminate().await?;
    assert!(status.success());
    let bin = turnd_tests::turnd_bin()?;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::process::Command::new(&bin)
        .args(["check-config", "--config"])
        .arg(root.join("config/turnd.toml"))
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[storage]\nsync = \"maybe\"\n[server]\nlisten = \"nope\"\n",
    )?;
    let out = std::process::Command::new(&bin)
        .args(["check-config", "--config"])
        .arg(&bad)
        .output()?;
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("storage.sync") && err.contains("server.listen"),
        "{err}"
    );
    Ok(())
}

/// A self-signed certificate for 127.0.0.1, its PEM files, and a client config
/// that trusts it.
fn self_signed(
    dir: &std::path::Path,
) -> anyhow::Result<(
    std::path::PathBuf,
    std::path::PathBuf,
    Arc<rustls::ClientConfig>,
)> {
    let ck =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string(), "localhost".to_string()])?;
    let cert_path = dir.join("cert.pem");
    let key_path = dir.join("key.pem");
    std::fs::write(&cert_path, ck.cert.pem())?;
    std::fs::write(&key_path, ck.signing_key.serialize_pem())?;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ck.cert.der().clone())?;
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok((cert_path, key_path, Arc::new(config)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_on_both_listeners_with_a_self_signed_certificate() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let certs = tempfile::tempdir()?;
    let (cert, key, client) = self_signed(certs.path())?;
    let td = TestDaemon::start(|c| {
        c.server.tls_cert = Some(cert.clone());
        c.server.tls_key = Some(key.clone());
    })
    .await?;
    assert!(td.url.starts_with("wss://"), "{}", td.url);
    assert!(td.admin.starts_with("https://"), "{}", td.admin);
    let hello = turnd_proto::HelloArgs {
        protocol: 1,
        role: Role::Client,
        token: None,
        name: None,
        worker_id: None,
        instance_id: None,
        inflight: vec![],
        finished: vec![],
    };
    let (conn, ok) = turnd_client::Connection::connect_tls(&td.url, hello, client.clone()).await?;
    assert_eq!(ok.server, "turnd");
    let c = Caller::from_connection(conn);
    let t = c.submit_simple("tls", "none", json!("over tls")).await?;
    assert_eq!(c.get(&t.turn_id).await?.input, json!("over tls"));
    // Plain WebSocket to the TLS port does not get through.
    let plain = td.url.replacen("wss://", "ws://", 1);
    assert!(Caller::connect(&plain, None).await.is_err());
    // The admin port answers over TLS.
    let addr = td.admin.trim_start_matches("https://").to_string();
    let tcp = tokio::net::TcpStream::connect(&addr).await?;
    let connector = tokio_rustls::TlsConnector::from(client);
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?.to_owned();
    let mut s = connector.connect(name, tcp).await?;
    s.write_all(
        format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut body = Vec::new();
    s.read_to_end(&mut body).await.or_else(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Ok(0)
        } else {
            Err(e)
        }
    })?;
    let text = String::from_utf8_lossy(&body);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_with_a_worker_id_may_serve_functions() -> anyhow::Result<()> {
    let td = TestDaemon::start(|_| {}).await?;
    let (mut plain, _) = Raw::hello(&td.url, "operator", json!({})).await?;
    assert_eq!(
        plain
            .error_code("function.register", json!({"function_id": "f"}))
            .await?,
        "forbidden"
    );
    let (mut op, ok) = Raw::hello(
        &td.url,
        "operator",
        json!({"worker_id": "ops-1", "instance_id": "i"}),
    )
    .await?;
    assert!(ok["ok"]["reconciled"].is_object(), "{ok}");
    op.ok("function.register", json!({"function_id": "f"}))
        .await?;
    let t = op
        .ok(
            "turn.submit",
            json!({"session_id": "ops", "function_id": "f", "input": 5}),
        )
        .await?;
    let invoke = op.next_push().await?;
    op.ok(
        "invocation.result",
        json!({"invocation_id": invoke["invocation_id"], "outcome": {"complete": 6}}),
    )
    .await?;
    let c = td.caller().await?;
    let id = t["turn"]["turn_id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(wait_done(&c, &id, T).await?.output, Some(json!(6)));
    td.shutdown().await
}
