//! Memory follows live work: per-connection limits (requests in flight, a writer
//! that cannot flush), the default request rate, sessions leaving memory when idle
//! and read back on their next use, watches replayed in pages, and the registry
//! forgetting what nothing refers to.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::time::Duration;

use anyhow::Context;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;
use turnd_tests::{eventually, http_get, metric, BinDaemon, Raw, TestDaemon};

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
    let mut r = turnd_tests::small_buffer_peer(&td.url).await?;
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

/// `turnd_sessions_in_memory` from /metrics.
async fn in_memory(admin: &str) -> Option<f64> {
    let (_, body) = http_get(admin, "/metrics").await.ok()?;
    metric(&body, "turnd_sessions_in_memory")
}

async fn wait_in_memory(admin: &str, n: f64) -> anyhow::Result<()> {
    eventually(T, &format!("{n} sessions in memory"), || async move {
        (in_memory(admin).await? == n).then_some(())
    })
    .await
}

/// The `seq`s of a list of events.
fn seqs(events: &[Value]) -> Vec<u64> {
    events.iter().filter_map(|e| e["seq"].as_u64()).collect()
}

/// Watch a session from `after: 0` and collect pushed events until `n` arrived.
async fn replay_all(r: &mut Raw, session_id: &str, n: usize) -> anyhow::Result<Vec<Value>> {
    let w = r
        .ok("watch", json!({"session_id": session_id, "after": 0}))
        .await?;
    let watch_id = w["watch_id"].clone();
    let mut got = Vec::new();
    while got.len() < n {
        let p = r.next_push().await?;
        anyhow::ensure!(p["watch_id"] == watch_id, "push of another watch: {p}");
        got.push(p["event"].clone());
    }
    Ok(got)
}

/// A session leaves memory once its last turn ended, and is read back from the store
/// on its next inspect, submit, stop and watch: counts, `seq`s and events go on where
/// they were, before and after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_session_leaves_memory_and_is_read_back_on_next_use() -> anyhow::Result<()> {
    let td = TestDaemon::start(|_| {}).await?;
    let w = turnd_tests::echo_worker(&td.url, "w-back", 4).await;
    let (mut r, _) = Raw::hello(&td.url, "client", json!({})).await?;
    let t1 = r
        .ok(
            "turn.submit",
            json!({"session_id": "back", "function_id": "echo", "input": 1}),
        )
        .await?;
    let t1 = t1["turn"]["turn_id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let done = r
        .ok("turn.wait", json!({"turn_id": t1, "timeout_ms": 10_000}))
        .await?;
    assert_eq!(done["turn"]["status"], "completed");
    wait_in_memory(&td.admin, 0.0).await?;
    assert_eq!(td.engine().sessions_in_memory(), 0);

    // inspect: read back.
    let s = r
        .ok("session.inspect", json!({"session_id": "back"}))
        .await?;
    assert_eq!(s["session"]["turns"]["completed"], 1, "{s}");
    let last = s["session"]["last_event"].as_u64().unwrap_or_default();
    assert!(last >= 3, "{s}");
    assert_eq!(td.engine().sessions_in_memory(), 0, "a read leaves nothing");

    // submit: the next turn takes the next seq, its events follow the stored ones.
    let t2 = r
        .ok(
            "turn.submit",
            json!({"session_id": "back", "function_id": "nobody", "input": 2}),
        )
        .await?;
    assert_eq!(t2["turn"]["seq"], 2, "{t2}");
    let t2 = t2["turn"]["turn_id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(
        in_memory(&td.admin).await,
        Some(1.0),
        "a queued turn is live work"
    );

    // stop: the session's only unfinished turn is cancelled; it leaves memory again.
    let stopped = r.ok("session.stop", json!({"session_id": "back"})).await?;
    assert_eq!(stopped["turns"][0]["turn_id"], json!(t2));
    assert_eq!(stopped["turns"][0]["status"], "cancelled");
    wait_in_memory(&td.admin, 0.0).await?;
    let again = r.ok("session.stop", json!({"session_id": "back"})).await?;
    assert_eq!(again["turns"], json!([]), "an idle session stops nothing");

    // watch: every stored event, in order, then live ones.
    let s = r
        .ok("session.inspect", json!({"session_id": "back"}))
        .await?;
    let last = s["session"]["last_event"].as_u64().unwrap_or_default();
    let events = replay_all(&mut r, "back", last as usize).await?;
    assert_eq!(seqs(&events), (1..=last).collect::<Vec<_>>());
    assert_eq!(
        in_memory(&td.admin).await,
        Some(0.0),
        "a watch holds no session state"
    );
    let t3 = r
        .ok(
            "turn.submit",
            json!({"session_id": "back", "function_id": "echo", "input": 3}),
        )
        .await?;
    assert_eq!(t3["turn"]["seq"], 3, "{t3}");
    let mut live = Vec::new();
    while live.last().and_then(|e: &Value| e["kind"].as_str()) != Some("completed") {
        live.push(r.next_push().await?["event"].clone());
    }
    assert_eq!(
        seqs(&live),
        (last + 1..=last + live.len() as u64).collect::<Vec<_>>()
    );
    wait_in_memory(&td.admin, 0.0).await?;

    // Across a restart: the stored session goes on where it was.
    drop(r);
    w.shutdown();
    w.join().await?;
    let dir = td.dir.clone();
    td.shutdown().await?;
    let td = TestDaemon::start_in(dir, |_| {}, false).await?;
    assert_eq!(td.engine().sessions_in_memory(), 0);
    let (mut r, _) = Raw::hello(&td.url, "client", json!({})).await?;
    let s = r
        .ok("session.inspect", json!({"session_id": "back"}))
        .await?;
    assert_eq!(s["session"]["turns"]["completed"], 2, "{s}");
    assert_eq!(s["session"]["turns"]["cancelled"], 1, "{s}");
    let t4 = r
        .ok(
            "turn.submit",
            json!({"session_id": "back", "function_id": "nobody", "input": 4}),
        )
        .await?;
    assert_eq!(t4["turn"]["seq"], 4, "{t4}");
    let stopped = r.ok("session.stop", json!({"session_id": "back"})).await?;
    assert_eq!(stopped["turns"][0]["status"], "cancelled");
    wait_in_memory(&td.admin, 0.0).await?;
    let s = r
        .ok("session.inspect", json!({"session_id": "back"}))
        .await?;
    let last = s["session"]["last_event"].as_u64().unwrap_or_default();
    let events = replay_all(&mut r, "back", last as usize).await?;
    assert_eq!(seqs(&events), (1..=last).collect::<Vec<_>>());
    td.shutdown().await
}

/// Reads of ids that do not exist leave nothing in memory: no session, no function.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_of_unknown_ids_leave_nothing_behind() -> anyhow::Result<()> {
    let td = TestDaemon::start(|_| {}).await?;
    let (mut r, _) = Raw::hello(&td.url, "client", json!({})).await?;
    for i in 0..50 {
        let sid = format!("ghost-{i}");
        assert_eq!(
            r.error_code("session.inspect", json!({"session_id": sid}))
                .await?,
            "not_found"
        );
        assert_eq!(
            r.error_code("session.events", json!({"session_id": sid}))
                .await?,
            "not_found"
        );
        assert_eq!(
            r.error_code("session.stop", json!({"session_id": sid}))
                .await?,
            "not_found"
        );
        let l = r.ok("turn.list", json!({"session_id": sid})).await?;
        assert_eq!(l["turns"], json!([]));
        let tid = format!("t_{i:032}");
        assert_eq!(
            r.error_code("turn.get", json!({"turn_id": tid})).await?,
            "not_found"
        );
        assert_eq!(
            r.error_code("watch", json!({"turn_id": tid})).await?,
            "not_found"
        );
        let w = r
            .ok("watch", json!({"session_id": sid, "after": 0}))
            .await?;
        r.ok("unwatch", json!({"watch_id": w["watch_id"]})).await?;
    }
    assert_eq!(td.engine().sessions_in_memory(), 0);
    let m = metrics(&td).await?;
    assert_eq!(metric(&m, "turnd_sessions_in_memory"), Some(0.0));
    assert_eq!(metric(&m, "turnd_watches"), Some(0.0));
    // A submit to a function nobody serves lists it while the turn waits for it; once
    // the turn ends, the function is forgotten.
    let t = r
        .ok(
            "turn.submit",
            json!({"session_id": "s", "function_id": "no-such-fn", "input": 1}),
        )
        .await?;
    let f = r.ok("functions.list", json!({})).await?;
    assert_eq!(f["functions"][0]["function_id"], "no-such-fn", "{f}");
    r.ok("turn.stop", json!({"turn_id": t["turn"]["turn_id"]}))
        .await?;
    let f = r.ok("functions.list", json!({})).await?;
    assert_eq!(f["functions"], json!([]), "{f}");
    assert_eq!(td.engine().registry_sizes(), (0, 0));
    wait_in_memory(&td.admin, 0.0).await?;
    td.shutdown().await
}

/// A `turn.wait` holds a place in the daemon only while it waits: one of a turn
/// that already ended, or of an unknown turn id, answers at once and leaves nothing
/// behind; one of an unfinished turn is counted until the turn ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_waits_leave_nothing_behind_once_answered() -> anyhow::Result<()> {
    let td = TestDaemon::start(|_| {}).await?;
    let c = td.caller().await?;
    let ended = c.submit_simple("w", "no-such-fn", json!(1)).await?;
    c.stop(&ended.turn_id, "done").await?;
    for i in 0..20 {
        let t = c.wait(&ended.turn_id, Some(5_000)).await?;
        assert_eq!(t.status, turnd_proto::TurnStatus::Cancelled);
        let unknown = format!("t_{i:032}");
        assert!(c.wait(&unknown, Some(5_000)).await.is_err());
    }
    let m = metrics(&td).await?;
    assert_eq!(metric(&m, "turnd_turn_waits"), Some(0.0));
    // A wait of an unfinished turn is counted while it waits.
    let open = c.submit_simple("w", "no-such-fn", json!(2)).await?;
    let waiter = td.caller().await?;
    let open_id = open.turn_id.clone();
    let waiting = tokio::spawn(async move { waiter.wait(&open_id, Some(30_000)).await });
    let admin = td.admin.clone();
    eventually(T, "the wait to be counted", || {
        let admin = admin.clone();
        async move {
            let (_, m) = http_get(&admin, "/metrics").await.ok()?;
            (metric(&m, "turnd_turn_waits") == Some(1.0)).then_some(())
        }
    })
    .await?;
    c.stop(&open.turn_id, "done").await?;
    let t = waiting.await??;
    assert_eq!(t.status, turnd_proto::TurnStatus::Cancelled);
    let m = metrics(&td).await?;
    assert_eq!(metric(&m, "turnd_turn_waits"), Some(0.0));
    td.shutdown().await
}

/// A worker's functions stay listed while it is connected and `worker_linger_ms`
/// after; then the worker and its functions are forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn departed_workers_and_their_functions_are_forgotten_after_the_linger() -> anyhow::Result<()>
{
    // Long enough for the lists right after the worker leaves to be read within it
    // on a busy machine.
    const LINGER_MS: u64 = 2_000;
    let td = TestDaemon::start(|c| c.turns.worker_linger_ms = LINGER_MS).await?;
    let (mut r, _) = Raw::hello(&td.url, "client", json!({})).await?;
    let w = turnd_tests::echo_worker(&td.url, "w-gone", 1).await;
    tokio::time::sleep(Duration::from_millis(LINGER_MS + 200)).await;
    let f = r.ok("functions.list", json!({})).await?;
    assert_eq!(
        f["functions"][0]["function_id"], "echo",
        "kept while connected: {f}"
    );
    w.shutdown();
    w.join().await?;
    let ws = r.ok("workers.list", json!({})).await?;
    assert_eq!(
        ws["workers"][0]["worker_id"], "w-gone",
        "listed right after: {ws}"
    );
    assert_eq!(ws["workers"][0]["connected"], false, "{ws}");
    let f = r.ok("functions.list", json!({})).await?;
    assert_eq!(
        f["functions"][0]["function_id"], "echo",
        "listed right after: {f}"
    );
    eventually(T, "the worker and its function to be forgotten", || {
        let td = &td;
        async move { (td.engine().registry_sizes() == (0, 0)).then_some(()) }
    })
    .await?;
    let ws = r.ok("workers.list", json!({})).await?;
    assert_eq!(ws["workers"], json!([]));
    let f = r.ok("functions.list", json!({})).await?;
    assert_eq!(f["functions"], json!([]));
    td.shutdown().await
}

/// Admit `n` turns to a function nobody serves and stop them: 3 events per turn.
async fn fill_session(r: &mut Raw, session_id: &str, n: usize, reason: &str) -> anyhow::Result<()> {
    for i in 0..n {
        let t = r
            .ok(
                "turn.submit",
                json!({"session_id": session_id, "function_id": "nobody", "input": i}),
            )
            .await?;
        r.ok(
            "turn.stop",
            json!({"turn_id": t["turn"]["turn_id"], "reason": reason}),
        )
        .await?;
    }
    Ok(())
}

/// A client with a tiny receive buffer, on a plain TCP socket.
async fn small_buffer_client(td: &TestDaemon) -> anyhow::Result<turnd_tests::RawTcp> {
    let mut r = turnd_tests::small_buffer_peer(&td.url).await?;
    r.ok(
        "hello",
        json!({"protocol": 1, "role": "client", "token": "t"}),
    )
    .await?;
    Ok(r)
}

/// The next text frame of a raw TCP client, at most 5 s.
async fn next_frame(r: &mut turnd_tests::RawTcp) -> anyhow::Result<Value> {
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), r.ws.next()).await?;
        match m {
            Some(Ok(Message::Text(t))) => return Ok(serde_json::from_str(t.as_str())?),
            Some(Ok(Message::Close(c))) => anyhow::bail!("closed: {c:?}"),
            Some(Ok(_)) => continue,
            other => anyhow::bail!("connection ended: {other:?}"),
        }
    }
}

/// A reading client replays a session many times larger than its connection's
/// queue and socket buffers from `after: 0`, while other turns are admitted, and
/// gets every event once, in order, then the live ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reading_client_replays_a_session_larger_than_its_queue() -> anyhow::Result<()> {
    // The watcher reads nothing for seconds: a long heartbeat keeps the daemon
    // from closing it as silent meanwhile.
    let td = TestDaemon::start(|c| {
        c.server.outbox_frames = 16;
        turnd_tests::quiet_raw_peers(c);
    })
    .await?;
    let (mut r, _) = Raw::hello(&td.url, "client", json!({})).await?;
    // About 6 MB of events (two of each turn's three carry the reason).
    fill_session(&mut r, "long", 150, &"r".repeat(20_000)).await?;
    let s = r
        .ok("session.inspect", json!({"session_id": "long"}))
        .await?;
    assert_eq!(s["session"]["last_event"], 450, "{s}");
    let mut watcher = small_buffer_client(&td).await?;
    let f = json!({"id": 7, "op": "watch", "args": {"session_id": "long", "after": 0}});
    watcher.ws.send(Message::text(f.to_string())).await?;
    // More turns arrive while the watcher replays, and it reads late.
    for i in 0..100 {
        r.ok(
            "turn.submit",
            json!({"session_id": "long", "function_id": "nobody", "input": i}),
        )
        .await?;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let resp = next_frame(&mut watcher).await?;
    assert_eq!(resp["id"], 7, "the response comes first: {resp}");
    let watch_id = resp["ok"]["watch_id"].clone();
    let mut got = Vec::new();
    while got.len() < 550 {
        let p = next_frame(&mut watcher).await?;
        assert_eq!(p["watch_id"], watch_id, "{p}");
        got.push(p["event"]["seq"].as_u64().unwrap_or_default());
    }
    assert_eq!(got, (1..=550).collect::<Vec<_>>());
    // Nothing more, and the watch is live: the next event follows at once.
    r.ok(
        "turn.submit",
        json!({"session_id": "long", "function_id": "nobody", "input": "last"}),
    )
    .await?;
    let p = next_frame(&mut watcher).await?;
    assert_eq!(p["event"]["seq"], 551, "{p}");
    td.shutdown().await
}

/// A watcher that does not read holds up nothing but itself: its replay waits for
/// room in its own queue, and the session it watches goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_never_reads_does_not_delay_its_session() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| {
        c.server.outbox_frames = 16;
        c.server.write_stall_ms = 60_000;
        turnd_tests::quiet_raw_peers(c);
    })
    .await?;
    let (mut r, _) = Raw::hello(&td.url, "client", json!({})).await?;
    // About 14 MB of events: more than the sockets and the queue hold.
    fill_session(&mut r, "watched", 60, &"r".repeat(120_000)).await?;
    let mut deaf = small_buffer_client(&td).await?;
    let f = json!({"id": 99, "op": "watch", "args": {"session_id": "watched", "after": 0}});
    deaf.ws.send(Message::text(f.to_string())).await?;
    eventually(T, "the replay to be under way", || async {
        let m = metrics(&td).await.ok()?;
        (metric(&m, "turnd_watches") == Some(1.0)).then_some(())
    })
    .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _w = turnd_tests::echo_worker(&td.url, "w-watched", 1).await;
    let t = r
        .ok(
            "turn.submit",
            json!({"session_id": "watched", "function_id": "echo", "input": 1}),
        )
        .await?;
    // A session held up by the watcher would go on only once the daemon gave up on
    // it: after write_stall_ms (a minute). By the daemon's clock, the turn ran from
    // its admission to its end in a fraction of that.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let done = loop {
        let done = r
            .ok(
                "turn.wait",
                json!({"turn_id": t["turn"]["turn_id"], "timeout_ms": 4_000}),
            )
            .await?;
        let waiting = matches!(done["turn"]["status"].as_str(), Some("queued" | "running"));
        if !waiting || tokio::time::Instant::now() > deadline {
            break done;
        }
    };
    assert_eq!(done["turn"]["status"], "completed", "{done}");
    let took = done["turn"]["finished_at_ms"]
        .as_u64()
        .zip(done["turn"]["created_at_ms"].as_u64())
        .map(|(end, start)| end.saturating_sub(start))
        .with_context(|| format!("the turn's times: {done}"))?;
    assert!(took < 15_000, "took {took} ms: {done}");
    let m = metrics(&td).await?;
    assert_eq!(
        metric(&m, "turnd_watches"),
        Some(1.0),
        "the watcher is still there"
    );
    drop(deaf);
    td.shutdown().await
}

/// The operator page's live feed replays a session longer than the feed's queue
/// (1024 events) from the start, every event once and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_feed_replays_a_long_session() -> anyhow::Result<()> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let td = TestDaemon::start(|_| {}).await?;
    let (mut r, _) = Raw::hello(&td.url, "client", json!({})).await?;
    fill_session(&mut r, "feed-long", 400, "filler").await?;
    let addr = td.admin.trim_start_matches("http://").to_string();
    let mut s = tokio::net::TcpStream::connect(&addr).await?;
    s.write_all(
        format!("GET /ui/session/feed?id=feed-long&after=0 HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n")
            .as_bytes(),
    )
    .await?;
    let mut lines = BufReader::new(s).lines();
    let got = tokio::time::timeout(Duration::from_secs(T), async {
        let mut got = Vec::new();
        // The screen's fragments share the stream as named `refresh` events: only
        // unnamed events are the session's.
        let mut named = false;
        while got.len() < 1200 {
            let line = lines.next_line().await?;
            let Some(line) = line else {
                anyhow::bail!("the feed ended after {} events", got.len());
            };
            if line.starts_with("event: ") {
                named = true;
            } else if line.is_empty() {
                named = false;
            } else if let Some(data) = line.strip_prefix("data: ").filter(|_| !named) {
                let e: Value = serde_json::from_str(data)?;
                got.push(e["seq"].as_u64().unwrap_or_default());
            }
        }
        anyhow::Ok(got)
    })
    .await
    .map_err(|_| anyhow::anyhow!("the feed did not deliver 1200 events in time"))??;
    assert_eq!(got, (1..=1200).collect::<Vec<_>>());
    td.shutdown().await
}

/// VmRSS of a process, in kB.
fn rss_kb(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("no VmRSS")
}

/// Pipeline `n` reads of unknown session ids over one connection (`window` in
/// flight), each answered `not_found`.
async fn unknown_reads(url: &str, from: usize, n: usize, window: usize) -> anyhow::Result<()> {
    let (r, _) = Raw::hello(url, "client", json!({})).await?;
    let (mut tx, mut rx) = r.ws.split();
    let (mut sent, mut answered) = (0, 0);
    while answered < n {
        while sent < n && sent - answered < window {
            let sid = format!("ghost-{}", from + sent);
            let op = if sent % 2 == 0 {
                "session.inspect"
            } else {
                "session.stop"
            };
            let args = json!({"session_id": sid});
            sent += 1;
            let f = json!({"id": sent, "op": op, "args": args}).to_string();
            tx.send(Message::text(f)).await?;
        }
        let m = tokio::time::timeout(Duration::from_secs(10), rx.next()).await?;
        let f: Value = match m {
            Some(Ok(Message::Text(t))) => serde_json::from_str(t.as_str())?,
            Some(Ok(_)) => continue,
            other => anyhow::bail!("connection ended: {other:?}"),
        };
        let code = f.pointer("/error/code");
        anyhow::ensure!(code == Some(&json!("not_found")), "unexpected answer {f}");
        answered += 1;
    }
    Ok(())
}

/// The real binary's resident size does not grow with reads of ids that do not
/// exist (each used to leave a session in memory for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_of_unknown_ids_do_not_grow_the_daemon() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = BinDaemon::start(&dir.path().join("data"), &[]).await?;
    let pid = d.child.id().context("pid")?;
    // Warm up: connections, buffers and the allocator's pools.
    unknown_reads(&d.url, 0, 2_000, 256).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = rss_kb(pid)?;
    unknown_reads(&d.url, 2_000, 24_000, 256).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = rss_kb(pid)?;
    let (_, body) = http_get(&d.admin, "/metrics").await?;
    eprintln!("VmRSS {before} kB before 24000 unknown-id reads, {after} kB after");
    assert_eq!(metric(&body, "turnd_sessions_in_memory"), Some(0.0));
    assert!(
        after < before + 4 * 1024,
        "VmRSS grew from {before} to {after} kB"
    );
    d.kill().await
}
