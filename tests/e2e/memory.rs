//! Memory follows live work: per-connection limits (requests in flight, a writer
//! that cannot flush), the default request rate, sessions leaving memory when idle
//! and read back on their next use, watches replayed in pages, and the registry
//! forgetting what nothing refers to.

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;
use turnd_tests::{eventually, http_get, metric, Raw, TestDaemon};

const T: u64 = 15;

async fn metrics(td: &TestDaemon) -> anyhow::Result<String> {
    let (code, body) = http_get(&td.admin, "/metrics").await?;
    anyhow::ensure!(code == 200, "/metrics answered {code}");
    Ok(body)
}

/// A client that keeps 100 requests outstanding on one connection (a gateway
/// multiplexing sessions) is never refused with the default settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_busy_connection_is_not_rate_limited_by_default() -> anyhow::Result<()> {
    let td = TestDaemon::start(|_| {}).await?;
    let (r, _) = Raw::hello(&td.url, "client", json!({})).await?;
    let (mut tx, mut rx) = r.ws.split();
    const TOTAL: u64 = 6_000;
    const WINDOW: u64 = 100;
    let started = std::time::Instant::now();
    let mut sent = 0;
    let mut answered = 0;
    let mut refused = 0;
    while answered < TOTAL {
        while sent < TOTAL && sent - answered < WINDOW {
            sent += 1;
            let f = json!({"id": sent, "op": "ping", "args": {}}).to_string();
            tx.send(Message::text(f)).await?;
        }
        let m = tokio::time::timeout(Duration::from_secs(5), rx.next()).await?;
        let t = match m {
            Some(Ok(Message::Text(t))) => t,
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            other => anyhow::bail!("connection ended: {other:?}"),
        };
        let f: Value = serde_json::from_str(t.as_str())?;
        if f.get("error").is_some() {
            refused += 1;
        }
        answered += 1;
    }
    let took = started.elapsed();
    assert_eq!(refused, 0, "{refused} of {TOTAL} requests refused");
    eprintln!("{TOTAL} pings over one connection in {took:?}");
    td.shutdown().await
}

/// Requests in flight on one connection are bounded; the one over the bound gets
/// `rate_limited` and is not run, and the connection works again once answers go
/// out. `/metrics` shows the requests in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_in_flight_per_connection_are_bounded() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| c.server.max_inflight_per_connection = 4).await?;
    let (mut r, _) = Raw::hello(&td.url, "client", json!({})).await?;
    let t = r
        .ok(
            "turn.submit",
            json!({"session_id": "inflight", "function_id": "nobody", "input": 1}),
        )
        .await?;
    let turn_id = t["turn"]["turn_id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    // Four long waits fill the connection's bound.
    for id in 100..104 {
        let f = json!({"id": id, "op": "turn.wait", "args": {"turn_id": turn_id, "timeout_ms": 60_000}});
        r.send_text(&f.to_string()).await?;
    }
    eventually(T, "four requests in flight", || async {
        let m = metrics(&td).await.ok()?;
        (metric(&m, "turnd_requests_inflight") == Some(4.0)).then_some(())
    })
    .await?;
    let f = r.request("ping", json!({})).await?;
    assert_eq!(f["error"]["code"], "rate_limited", "{f}");
    assert_eq!(f["error"]["retryable"], true, "{f}");
    // A submit over the bound is not run: the session still holds one turn.
    let f = r
        .request(
            "turn.submit",
            json!({"session_id": "inflight", "function_id": "nobody", "input": 2}),
        )
        .await?;
    assert_eq!(f["error"]["code"], "rate_limited", "{f}");
    // Another connection is not affected, and sees one queued turn.
    let (mut other, _) = Raw::hello(&td.url, "client", json!({})).await?;
    let s = other
        .ok("session.inspect", json!({"session_id": "inflight"}))
        .await?;
    assert_eq!(s["session"]["turns"]["queued"], 1, "{s}");
    // Stopping the turn answers the waits; the connection is usable again.
    other.ok("turn.stop", json!({"turn_id": turn_id})).await?;
    for _ in 0..4 {
        let f = r.recv().await?;
        assert_eq!(f["ok"]["turn"]["status"], "cancelled", "{f}");
    }
    r.ok("ping", json!({})).await?;
    eventually(T, "no request in flight", || async {
        let m = metrics(&td).await.ok()?;
        (metric(&m, "turnd_requests_inflight") == Some(0.0)).then_some(())
    })
    .await?;
    td.shutdown().await
}

/// A client that sends requests and never reads their answers is closed once the
/// daemon cannot write to it for `server.write_stall_ms`, without holding up any
/// other connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_reads_is_closed() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| {
        c.server.write_stall_ms = 300;
        // The peer's silence alone would close it only after 30 s.
        c.server.heartbeat_ms = 10_000;
        c.turns.max_value_bytes = 600_000;
        c.server.max_frame_bytes = 2 * 1024 * 1024;
    })
    .await?;
    // A tiny receive buffer, so the daemon's writes stall soon.
    let sock = tokio::net::TcpSocket::new_v4()?;
    sock.set_recv_buffer_size(4096)?;
    let addr = td
        .url
        .trim_start_matches("ws://")
        .trim_end_matches("/v1")
        .parse()?;
    let stream = sock.connect(addr).await?;
    let (ws, _) = tokio_tungstenite::client_async(td.url.as_str(), stream).await?;
    let mut r = Raw::from_stream(ws);
    r.ok(
        "hello",
        json!({"protocol": 1, "role": "client", "token": "t"}),
    )
    .await?;
    let t = r
        .ok(
            "turn.submit",
            json!({"session_id": "deaf", "function_id": "nobody", "input": "x".repeat(400_000)}),
        )
        .await?;
    let turn_id = t["turn"]["turn_id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let m = metrics(&td).await?;
    assert_eq!(metric(&m, "turnd_connections{role=\"client\"}"), Some(1.0));
    // Forty answers of 400 KB each: far more than the sockets hold, far fewer than
    // the connection's queue of 4096 frames.
    for id in 100..140 {
        let f = json!({"id": id, "op": "turn.get", "args": {"turn_id": turn_id}});
        r.ws.send(Message::text(f.to_string())).await?;
    }
    eventually(5, "the deaf connection to be closed", || async {
        let m = metrics(&td).await.ok()?;
        (metric(&m, "turnd_connections{role=\"client\"}") == Some(0.0)).then_some(())
    })
    .await?;
    // Everyone else is served as before.
    let (mut other, _) = Raw::hello(&td.url, "client", json!({})).await?;
    let g = other.ok("turn.get", json!({"turn_id": turn_id})).await?;
    assert_eq!(g["turn"]["status"], "queued");
    drop(r);
    td.shutdown().await
}
