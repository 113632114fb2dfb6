//! Worker: result resend, reconnect reconciliation, probe, cancel, heartbeat, stop.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use turnd_proto::{Cancelled, Outcome, Role};

use super::fake::{invoke, FakePeer, FakeServer, STEP};
use crate::{ConnectionState, FunctionSpec, InvocationCtx, Worker, WorkerHandle, WorkerOptions};

fn options(url: &str, ack_ms: u64) -> WorkerOptions {
    let mut opts = WorkerOptions::new(url, "w-test");
    opts.token = Some("wtok".into());
    opts.result_ack_timeout = Duration::from_millis(ack_ms);
    opts.reconnect_delay = Duration::from_millis(10);
    opts
}

/// A worker serving `fast` (completes at once with its input) and `slow` (runs until
/// `gate` is notified, then completes; returns `cancelled` when its token is).
fn worker(opts: WorkerOptions, gate: Arc<Notify>) -> WorkerHandle {
    Worker::new(opts)
        .function(FunctionSpec::new("fast"), |ctx: InvocationCtx| async move {
            Outcome::Complete(ctx.invoke.input.clone())
        })
        .function(
            FunctionSpec::new("slow").concurrency(2).timeout_ms(1000),
            move |ctx: InvocationCtx| {
                let gate = gate.clone();
                async move {
                    tokio::select! {
                        _ = gate.notified() => Outcome::Complete(json!("slow done")),
                        _ = ctx.cancel.cancelled() => Outcome::Cancelled(Cancelled { message: "stopped".into() }),
                    }
                }
            },
        )
        .spawn(CancellationToken::new())
}

/// Accept the worker and answer its hello and its two registrations.
async fn accept_worker(
    server: &FakeServer,
    reconciled: Value,
) -> (FakePeer, turnd_proto::HelloArgs) {
    let mut peer = server.accept().await;
    let hello = peer.worker_hello(2, reconciled).await;
    (peer, hello)
}

/// Shut the worker down while the fake server keeps reading, as a real one would, so
/// the close handshake completes at once.
async fn stop(handle: WorkerHandle, mut peer: FakePeer) {
    handle.shutdown();
    let (joined, rest) = tokio::join!(
        tokio::time::timeout(STEP, handle.join()),
        peer.try_recv(STEP)
    );
    joined.expect("stops in time").expect("clean stop");
    assert!(rest.is_none(), "no request after shutdown: {rest:?}");
}

async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + STEP;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn hello_and_registration() {
    let server = FakeServer::start().await;
    let handle = worker(options(&server.url, 1000), Arc::new(Notify::new()));
    let mut peer = server.accept().await;
    let req = peer.expect("hello").await;
    let hello: turnd_proto::HelloArgs = serde_json::from_value(req.args).expect("hello args");
    assert_eq!(hello.role, Role::Worker);
    assert_eq!(hello.worker_id.as_deref(), Some("w-test"));
    assert_eq!(hello.instance_id.as_deref(), Some(handle.instance_id()));
    assert_eq!(hello.token.as_deref(), Some("wtok"));
    assert!(hello.inflight.is_empty() && hello.finished.is_empty());
    peer.ok(
        req.id,
        super::fake::hello_ok(json!({"kept": [], "redispatched": [], "unknown": []})),
    )
    .await;
    let fast = peer.expect("function.register").await;
    assert_eq!(fast.args["function_id"], "fast");
    assert_eq!(fast.args["delivery"], "at_most_once");
    assert!(
        !handle.is_connected(),
        "not connected before every registration succeeded"
    );
    peer.ok(fast.id, json!({"function_id": "fast", "workers": 1}))
        .await;
    let slow = peer.expect("function.register").await;
    assert_eq!(slow.args["concurrency"], 2);
    assert_eq!(slow.args["timeout_ms"], 1000);
    peer.ok(slow.id, json!({"function_id": "slow", "workers": 1}))
        .await;
    tokio::time::timeout(STEP, handle.connected())
        .await
        .expect("connected");
    assert_eq!(handle.last_reconciled(), Some(Default::default()));

    // Shutdown closes the socket (the fake sees the end of the stream).
    stop(handle, peer).await;
}

#[tokio::test]
async fn result_is_resent_until_acknowledged() {
    let server = FakeServer::start().await;
    let handle = worker(options(&server.url, 100), Arc::new(Notify::new()));
    let (mut peer, _) = accept_worker(&server, json!(null)).await;

    peer.send(invoke("inv_a", "fast", json!({"x": 1}))).await;
    let first = peer.expect("invocation.result").await;
    let sent_at = tokio::time::Instant::now();
    assert_eq!(
        first.args,
        json!({"invocation_id": "inv_a", "outcome": {"complete": {"x": 1}}})
    );
    // No answer: the same result comes again after the ack timeout.
    let second = peer.expect("invocation.result").await;
    assert!(
        sent_at.elapsed() >= Duration::from_millis(80),
        "resent too early"
    );
    assert_eq!(second.args, first.args);
    assert_ne!(second.id, first.id);
    peer.ok(second.id, json!({"accepted": "applied"})).await;

    eventually("ack counted", || handle.stats().results_acked == 1).await;
    assert!(
        peer.try_recv(Duration::from_millis(300)).await.is_none(),
        "no resend after the ack"
    );
    let stats = handle.stats();
    assert_eq!(stats.invocations_started, 1);
    assert_eq!(stats.results_sent, 1);
    assert!(stats.results_resent >= 1);
    stop(handle, peer).await;
}

#[tokio::test]
async fn retryable_errors_are_retried_and_refused_results_dropped() {
    let server = FakeServer::start().await;
    let handle = worker(options(&server.url, 100), Arc::new(Notify::new()));
    let (mut peer, _) = accept_worker(&server, json!(null)).await;

    peer.send(invoke("inv_a", "fast", json!(1))).await;
    let req = peer.expect("invocation.result").await;
    peer.error(req.id, "unavailable").await;
    let again = peer.expect("invocation.result").await;
    assert_eq!(again.args["invocation_id"], "inv_a");
    peer.ok(again.id, json!({"accepted": "applied"})).await;

    peer.send(invoke("inv_b", "fast", json!(2))).await;
    let req = peer.expect("invocation.result").await;
    assert_eq!(req.args["invocation_id"], "inv_b");
    peer.error(req.id, "forbidden").await;
    assert!(
        peer.try_recv(Duration::from_millis(400)).await.is_none(),
        "a refused result is not resent"
    );
    let stats = handle.stats();
    assert_eq!(stats.results_acked, 1);
    assert_eq!(stats.results_dropped, 1);
    stop(handle, peer).await;
}

#[tokio::test]
async fn reconnect_keeps_instance_and_reports_inflight_and_finished() {
    let server = FakeServer::start().await;
    let gate = Arc::new(Notify::new());
    // A long ack timeout: on the first connection the result is sent once only.
    let handle = worker(options(&server.url, 10_000), gate.clone());
    let (mut peer, hello1) = accept_worker(&server, json!(null)).await;

    peer.send(invoke("inv_fast", "fast", json!("f"))).await;
    peer.send(invoke("inv_slow", "slow", json!("s"))).await;
    let lost = peer.expect("invocation.result").await;
    assert_eq!(lost.args["invocation_id"], "inv_fast");
    // The connection dies before the result is acknowledged.
    drop(peer);

    let mut peer = server.accept().await;
    let hello2 = peer
        .hello(json!({"kept": ["inv_fast", "inv_slow"], "redispatched": [], "unknown": []}))
        .await;
    assert_eq!(
        hello2.instance_id, hello1.instance_id,
        "same instance across reconnects"
    );
    assert_eq!(hello2.worker_id, hello1.worker_id);
    assert_eq!(hello2.inflight, ["inv_slow"]);
    assert_eq!(hello2.finished, ["inv_fast"]);
    for _ in 0..2 {
        let req = peer.expect("function.register").await;
        peer.ok(
            req.id,
            json!({"function_id": req.args["function_id"], "workers": 1}),
        )
        .await;
    }
    // Right after registration, the unacknowledged result comes again.
    let resent = peer.expect("invocation.result").await;
    assert_eq!(resent.args, lost.args);
    peer.ok(resent.id, json!({"accepted": "applied"})).await;

    // The handler kept running across the reconnect; its result uses the new link.
    gate.notify_one();
    let slow = peer.expect("invocation.result").await;
    assert_eq!(
        slow.args,
        json!({"invocation_id": "inv_slow", "outcome": {"complete": "slow done"}})
    );
    peer.ok(slow.id, json!({"accepted": "applied"})).await;

    eventually("both acked", || handle.stats().results_acked == 2).await;
    let reconciled = handle.last_reconciled().expect("reconciled");
    assert_eq!(reconciled.kept, ["inv_fast", "inv_slow"]);
    assert_eq!(handle.stats().connections, 2);
    stop(handle, peer).await;
}

#[tokio::test]
async fn probe_answers_running_finished_unknown() {
    let server = FakeServer::start().await;
    let gate = Arc::new(Notify::new());
    let handle = worker(options(&server.url, 10_000), gate.clone());
    let (mut peer, _) = accept_worker(&server, json!(null)).await;

    peer.send(invoke("inv_run", "slow", json!(null))).await;
    peer.send(invoke("inv_done", "fast", json!("r"))).await;
    let unanswered = peer.expect("invocation.result").await;
    assert_eq!(unanswered.args["invocation_id"], "inv_done");

    peer.send(json!({"push": "probe", "invocation_id": "inv_run"}))
        .await;
    let status = peer.expect("invocation.status").await;
    assert_eq!(
        status.args,
        json!({"invocation_id": "inv_run", "state": "running"})
    );
    peer.ok(status.id, json!({})).await;

    peer.send(json!({"push": "probe", "invocation_id": "inv_done"}))
        .await;
    let status = peer.expect("invocation.status").await;
    assert_eq!(
        status.args,
        json!({"invocation_id": "inv_done", "state": "finished"})
    );
    peer.ok(status.id, json!({})).await;
    // "finished" promises the result: it is resent at once, not after the 10 s timeout.
    let resent = peer.expect("invocation.result").await;
    assert_eq!(resent.args, unanswered.args);
    peer.ok(resent.id, json!({"accepted": "duplicate"})).await;

    peer.send(json!({"push": "probe", "invocation_id": "inv_never"}))
        .await;
    let status = peer.expect("invocation.status").await;
    assert_eq!(
        status.args,
        json!({"invocation_id": "inv_never", "state": "unknown"})
    );
    peer.ok(status.id, json!({})).await;

    // Once acknowledged, a finished invocation is unknown to the worker.
    eventually("ack counted", || handle.stats().results_acked == 1).await;
    peer.send(json!({"push": "probe", "invocation_id": "inv_done"}))
        .await;
    let status = peer.expect("invocation.status").await;
    assert_eq!(status.args["state"], "unknown");
    peer.ok(status.id, json!({})).await;

    stop(handle, peer).await;
}

#[tokio::test]
async fn cancel_reaches_the_handler_token() {
    let server = FakeServer::start().await;
    let handle = worker(options(&server.url, 10_000), Arc::new(Notify::new()));
    let (mut peer, _) = accept_worker(&server, json!(null)).await;

    peer.send(invoke("inv_run", "slow", json!(null))).await;
    peer.send(json!({"push": "cancel", "invocation_id": "inv_run", "reason": "stop asked"}))
        .await;
    let result = peer.expect("invocation.result").await;
    assert_eq!(
        result.args,
        json!({"invocation_id": "inv_run", "outcome": {"cancelled": {"message": "stopped"}}})
    );
    peer.ok(result.id, json!({"accepted": "applied"})).await;

    // Unknown invocation: the worker says it is not running.
    peer.send(json!({"push": "cancel", "invocation_id": "inv_ghost", "reason": "x"}))
        .await;
    let result = peer.expect("invocation.result").await;
    assert_eq!(
        result.args,
        json!({"invocation_id": "inv_ghost", "outcome": {"cancelled": {"message": "not running"}}})
    );
    peer.ok(result.id, json!({"accepted": "unknown"})).await;

    // Already finished, result not acknowledged: the real result is sent again.
    peer.send(invoke("inv_done", "fast", json!("real"))).await;
    let first = peer.expect("invocation.result").await;
    peer.send(json!({"push": "cancel", "invocation_id": "inv_done", "reason": "late stop"}))
        .await;
    let again = peer.expect("invocation.result").await;
    assert_eq!(again.args, first.args);
    assert_eq!(again.args["outcome"], json!({"complete": "real"}));
    peer.ok(again.id, json!({"accepted": "applied"})).await;

    stop(handle, peer).await;
}

#[tokio::test]
async fn heartbeat_renews_and_not_found_cancels() {
    let server = FakeServer::start().await;
    let handle = Worker::new(options(&server.url, 10_000))
        .function(FunctionSpec::new("hb"), |ctx: InvocationCtx| async move {
            let deadline = match ctx.heartbeat().await {
                Ok(deadline) => deadline,
                Err(e) => return Outcome::Complete(json!(format!("first heartbeat failed: {e}"))),
            };
            let second = ctx.heartbeat().await;
            if second.is_err() && ctx.is_cancelled() {
                Outcome::Cancelled(Cancelled {
                    message: format!("gone after deadline {deadline}"),
                })
            } else {
                Outcome::Complete(json!("kept running"))
            }
        })
        .spawn(CancellationToken::new());
    let mut peer = server.accept().await;
    peer.worker_hello(1, json!(null)).await;

    peer.send(invoke("inv_hb", "hb", json!(null))).await;
    let hb = peer.expect("invocation.heartbeat").await;
    assert_eq!(hb.args, json!({"invocation_id": "inv_hb"}));
    peer.ok(hb.id, json!({"deadline_ms": 42})).await;
    let hb = peer.expect("invocation.heartbeat").await;
    peer.error(hb.id, "not_found").await;
    let result = peer.expect("invocation.result").await;
    assert_eq!(
        result.args["outcome"],
        json!({"cancelled": {"message": "gone after deadline 42"}})
    );
    peer.ok(result.id, json!({"accepted": "applied"})).await;

    stop(handle, peer).await;
}

#[tokio::test]
async fn handler_panic_is_reported_as_failure() {
    let server = FakeServer::start().await;
    let handle = Worker::new(options(&server.url, 10_000))
        .function(
            FunctionSpec::new("boom"),
            |_ctx: InvocationCtx| async move {
                panic!("handler bug");
            },
        )
        .spawn(CancellationToken::new());
    let mut peer = server.accept().await;
    peer.worker_hello(1, json!(null)).await;
    peer.send(invoke("inv_boom", "boom", json!(null))).await;
    let result = peer.expect("invocation.result").await;
    assert_eq!(result.args["outcome"]["fail"]["code"], "handler_panicked");
    assert_eq!(result.args["outcome"]["fail"]["retryable"], false);
    peer.ok(result.id, json!({"accepted": "applied"})).await;
    stop(handle, peer).await;
}

#[tokio::test]
async fn reconnects_after_refused_hello_and_stops_when_superseded() {
    let server = FakeServer::start().await;
    let handle = worker(options(&server.url, 10_000), Arc::new(Notify::new()));
    // First attempt refused (e.g. the daemon is draining): the worker tries again.
    let mut peer = server.accept().await;
    let req = peer.expect("hello").await;
    peer.error(req.id, "shutting_down").await;
    let (mut peer, _) = accept_worker(&server, json!(null)).await;
    tokio::time::timeout(STEP, handle.connected())
        .await
        .expect("connected");

    // Another process took this worker_id: fighting back would flip-flop forever.
    peer.close(turnd_proto::CLOSE_SUPERSEDED).await;
    let result = tokio::time::timeout(STEP, handle.join())
        .await
        .expect("stops");
    assert!(result.is_err(), "superseded is reported: {result:?}");
}

#[tokio::test]
async fn an_unreachable_url_is_reported_not_waited_on_silently() {
    // A port nobody listens on (bound, then released).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let url = format!("ws://127.0.0.1:{port}/v1");
    let handle = worker(options(&url, 1000), Arc::new(Notify::new()));
    eventually("two failed attempts", || {
        matches!(handle.state(), ConnectionState::Connecting { failed_attempts, .. } if failed_attempts >= 2)
    })
    .await;
    match handle.state() {
        ConnectionState::Connecting { last_error, .. } => {
            let e = last_error.expect("the last error is kept");
            assert!(e.contains(&url), "{e}");
        }
        other => panic!("not connecting: {other:?}"),
    }
    let err = handle
        .connected_within(Duration::from_millis(50))
        .await
        .expect_err("cannot connect");
    let msg = err.to_string();
    assert!(
        msg.contains("not connected within") && msg.contains(&url),
        "{msg}"
    );
    assert!(msg.contains("failed attempt(s)"), "{msg}");
    handle.shutdown();
    eventually("stopped", || handle.state() == ConnectionState::Stopped).await;
    handle.join().await.expect("a clean stop");
}
