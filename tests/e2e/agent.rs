//! Turns of agents through the real daemon and raw protocol frames: progress pushed
//! to the watchers that asked for it (and refused from an invocation that is not
//! current), a slow watcher losing progress but no event, a step that suspends for
//! input and `turn.resume` (races, deadlines, a `kill -9` between), and `on_busy`
//! (`reject` stores nothing, `interrupt` and `rollback` stop the session's turns and
//! hand the new one `previous`, one step in flight).

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};
use tokio::io::AsyncBufReadExt;
use turnd_tests::{BinDaemon, Raw, TestDaemon};

const F: &str = "agent";

/// A raw worker `worker_id` serving [`F`].
async fn worker(url: &str, worker_id: &str) -> Result<Raw> {
    let (mut w, _) = Raw::hello(
        url,
        "worker",
        json!({"worker_id": worker_id, "instance_id": format!("{worker_id}-1")}),
    )
    .await?;
    w.ok(
        "function.register",
        json!({"function_id": F, "concurrency": 4}),
    )
    .await?;
    Ok(w)
}

async fn client(url: &str) -> Result<Raw> {
    Ok(Raw::hello(url, "client", json!({})).await?.0)
}

/// `store.check` as operator finds nothing.
async fn store_clean(url: &str) -> Result<()> {
    let (mut op, _) = Raw::hello(url, "operator", json!({})).await?;
    let v = op.ok("store.check", json!({})).await?;
    ensure!(v["violations"] == json!([]), "store.check: {v}");
    Ok(())
}

/// The next push of `kind` (others before it are skipped).
async fn next_of(r: &mut Raw, kind: &str) -> Result<Value> {
    loop {
        let p = r.next_push().await?;
        if p["push"] == kind {
            return Ok(p);
        }
    }
}

async fn submit(c: &mut Raw, session: &str, input: Value, extra: Value) -> Result<Value> {
    let mut args = json!({"session_id": session, "function_id": F, "input": input});
    if let (Some(a), Some(e)) = (args.as_object_mut(), extra.as_object()) {
        a.extend(e.clone());
    }
    c.ok("turn.submit", args).await
}

async fn turn(c: &mut Raw, turn_id: &Value) -> Result<Value> {
    Ok(c.ok("turn.get", json!({"turn_id": turn_id})).await?["turn"].clone())
}

async fn progress(w: &mut Raw, inv: &Value, data: Value) -> Result<Value> {
    w.request(
        "invocation.progress",
        json!({"invocation_id": inv, "data": data}),
    )
    .await
}

/// A turn of `session` running on worker `w1`, and a watcher that asked for its
/// progress: the worker, the caller, the watcher, the turn's id and its invocation's.
async fn streaming(url: &str, session: &str) -> Result<(Raw, Raw, Raw, Value, Value)> {
    let mut w = worker(url, "w1").await?;
    let mut c = client(url).await?;
    let mut asked = client(url).await?;
    asked
        .ok("watch", json!({"session_id": session, "progress": true}))
        .await?;
    let t = submit(&mut c, session, json!(1), json!({})).await?["turn"]["turn_id"].clone();
    let inv = next_of(&mut w, "invoke").await?["invocation_id"].clone();
    Ok((w, c, asked, t, inv))
}

async fn result(w: &mut Raw, inv: &Value, outcome: Value) -> Result<Value> {
    w.ok(
        "invocation.result",
        json!({"invocation_id": inv, "outcome": outcome}),
    )
    .await
}

/// Wait (at most 5 s) until turn `t` has `status`.
async fn until_status(c: &mut Raw, t: &Value, status: &str) -> Result<Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let got = turn(c, t).await?;
        if got["status"] == status {
            return Ok(got);
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "turn never {status}: {got}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The pushes a watcher gets up to the event of `kind`, that one included.
async fn pushes_until(r: &mut Raw, kind: &str) -> Result<Vec<Value>> {
    let mut seen = Vec::new();
    loop {
        let p = r.next_push().await?;
        let done = p["event"]["kind"] == kind;
        seen.push(p);
        if done {
            return Ok(seen);
        }
    }
}

fn code(frame: &Value) -> &str {
    frame
        .pointer("/error/code")
        .and_then(Value::as_str)
        .unwrap_or("ok")
}

/// Progress `data` reaches a watcher as the compact text the worker sent (members in
/// its order, an integer past 64 bits with its digits); text with whitespace outside
/// its strings is written again compact, and measured so against
/// `turns.max_progress_bytes`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_data_keeps_the_text_the_worker_sent() -> Result<()> {
    let d = TestDaemon::start(|c| c.turns.max_progress_bytes = 40).await?;
    let (mut w, _c, mut asked, _, inv) = streaming(&d.url, "pt").await?;
    let data = r#"{"z":1,"a":12345678901234567890123}"#;
    w.send_text(&format!(
        r#"{{"id":90,"op":"invocation.progress","args":{{"invocation_id":{inv},"data":{data}}}}}"#
    ))
    .await?;
    ensure!(w.text_with(r#""id":90"#).await?.contains(r#""seq":1"#));
    let pushed = asked.text_with(r#""push":"progress""#).await?;
    ensure!(pushed.contains(&format!(r#""data":{data}"#)), "{pushed}");
    // 62 bytes as sent, 13 compact: within the limit of 40, and sent compact.
    let spaced = format!("{{ \"b\" : [ 1 , 2 ] ,{} \"a\" : 3 }}", " ".repeat(40));
    w.send_text(&format!(
        r#"{{"id":91,"op":"invocation.progress","args":{{"invocation_id":{inv},"data":{spaced}}}}}"#
    ))
    .await?;
    ensure!(w.text_with(r#""id":91"#).await?.contains(r#""seq":2"#));
    let pushed = asked.text_with(r#""push":"progress""#).await?;
    ensure!(pushed.contains(r#""data":{"a":3,"b":[1,2]}"#), "{pushed}");
    d.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_reaches_the_watchers_that_asked_in_order_and_only_while_current() -> Result<()> {
    let d = TestDaemon::start(|c| c.turns.max_progress_bytes = 1000).await?;
    let mut w = worker(&d.url, "w1").await?;
    let mut c = client(&d.url).await?;
    let mut asked = client(&d.url).await?;
    let mut plain = client(&d.url).await?;
    asked
        .ok("watch", json!({"session_id": "p", "progress": true}))
        .await?;
    plain.ok("watch", json!({"session_id": "p"})).await?;
    let t = submit(&mut c, "p", json!("hi"), json!({})).await?["turn"]["turn_id"].clone();
    let inv = next_of(&mut w, "invoke").await?["invocation_id"].clone();
    for (i, tok) in ["a", "b", "c"].iter().enumerate() {
        let r = progress(&mut w, &inv, json!({"token": tok})).await?;
        assert_eq!(r["ok"], json!({"seq": i + 1}), "{r}");
    }
    for (i, tok) in ["a", "b", "c"].iter().enumerate() {
        let p = next_of(&mut asked, "progress").await?;
        assert_eq!(p["seq"], json!(i + 1), "{p}");
        assert_eq!(p["data"], json!({"token": tok}));
        assert_eq!(
            (&p["turn_id"], &p["invocation_id"], &p["step"]),
            (&t, &inv, &json!(0))
        );
    }
    // A late caller reads where the step is.
    let got = turn(&mut c, &t).await?;
    assert_eq!(got["progress"]["seq"], 3, "{got}");
    assert_eq!(got["progress"]["data"], json!({"token": "c"}));
    let (status, page) = turnd_tests::http_get(
        &d.admin,
        &format!("/ui/turn?id={}", got["turn_id"].as_str().unwrap_or("")),
    )
    .await?;
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("#3 of step 0"),
        "the page shows the progress: {page}"
    );
    // Too large, another worker's: refused, reaching no one.
    let big = progress(&mut w, &inv, json!("x".repeat(1000))).await?;
    assert_eq!(code(&big), "too_large", "{big}");
    let mut w2 = worker(&d.url, "w2").await?;
    let other = progress(&mut w2, &inv, json!(1)).await?;
    assert_eq!(code(&other), "forbidden", "{other}");
    // The next step is a new invocation: the last one's progress is refused, the new
    // one counts from 1 again.
    result(&mut w, &inv, json!({"continue": {"n": 1}})).await?;
    let stale = progress(&mut w, &inv, json!("late")).await?;
    assert_eq!(code(&stale), "not_found", "{stale}");
    let inv1 = next_of(&mut w, "invoke").await?["invocation_id"].clone();
    let got = turn(&mut c, &t).await?;
    assert!(
        got.get("progress").is_none(),
        "gone with its invocation: {got}"
    );
    let r = progress(&mut w, &inv1, json!("d")).await?;
    assert_eq!(r["ok"], json!({"seq": 1}), "{r}");
    let p = next_of(&mut asked, "progress").await?;
    assert_eq!(
        (&p["invocation_id"], &p["seq"], &p["data"]),
        (&inv1, &json!(1), &json!("d"))
    );
    // A stop: the invocation is being cancelled, its progress refused.
    c.ok("turn.stop", json!({"turn_id": t})).await?;
    let stopped = progress(&mut w, &inv1, json!("after stop")).await?;
    assert_eq!(code(&stopped), "not_found", "{stopped}");
    result(&mut w, &inv1, json!({"cancelled": {}})).await?;
    until_status(&mut c, &t, "cancelled").await?;
    // Every event reached both watchers; progress only the one that asked; nothing
    // refused reached anyone.
    let seen = pushes_until(&mut plain, "cancelled").await?;
    assert!(seen.iter().all(|p| p["push"] == "event"), "{seen:?}");
    let rest = pushes_until(&mut asked, "cancelled").await?;
    assert!(rest.iter().all(|p| p["push"] != "progress"), "{rest:?}");
    let (_, m) = turnd_tests::http_get(&d.admin, "/metrics").await?;
    for (outcome, n) in [("accepted", 4.0), ("refused", 4.0), ("pushed", 4.0)] {
        let sample = format!("turnd_progress_frames_total{{outcome=\"{outcome}\"}}");
        assert_eq!(turnd_tests::metric(&m, &sample), Some(n), "{sample}");
    }
    store_clean(&d.url).await?;
    d.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_of_an_invocation_reconciled_as_lost_is_refused() -> Result<()> {
    let d = TestDaemon::start(|c| c.turns.reconnect_grace_ms = 60_000).await?;
    let (mut w, mut c, mut asked, t, inv) = streaming(&d.url, "r").await?;
    assert_eq!(progress(&mut w, &inv, json!("one")).await?["ok"]["seq"], 1);
    // The worker comes back as a new instance that runs nothing: the invocation is
    // reconciled as lost (an at_most_once turn fails).
    drop(w);
    let (mut w, hello) = Raw::hello(
        &d.url,
        "worker",
        json!({"worker_id": "w1", "instance_id": "w1-2", "inflight": []}),
    )
    .await?;
    assert!(hello.get("ok").is_some(), "{hello}");
    let r = progress(&mut w, &inv, json!("after")).await?;
    assert_eq!(code(&r), "not_found", "{r}");
    until_status(&mut c, &t, "failed").await?;
    let p = next_of(&mut asked, "progress").await?;
    assert_eq!(p["data"], "one");
    let rest = pushes_until(&mut asked, "failed").await?;
    assert!(
        rest.iter().all(|p| p["push"] != "progress"),
        "a refused frame was pushed: {rest:?}"
    );
    store_clean(&d.url).await?;
    d.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_watcher_loses_progress_with_a_marker_but_never_an_event() -> Result<()> {
    let d = TestDaemon::start(|c| {
        c.server.outbox_frames = 16;
        c.server.max_frame_bytes = 2 * 1024 * 1024;
        // The watcher and the client read nothing while the frames are sent: on a
        // busy machine that may take longer than the 3 heartbeats of silence after
        // which the daemon closes a connection.
        turnd_tests::quiet_raw_peers(c);
    })
    .await?;
    let mut w = worker(&d.url, "w1").await?;
    let mut c = client(&d.url).await?;
    // A watcher that does not read, with a tiny receive buffer.
    let mut slow = turnd_tests::small_buffer_peer(&d.url).await?;
    slow.ok(
        "hello",
        json!({"protocol": 1, "role": "client", "token": "t"}),
    )
    .await?;
    slow.ok("watch", json!({"session_id": "slow", "progress": true}))
        .await?;
    let t = submit(&mut c, "slow", json!(1), json!({})).await?["turn"]["turn_id"].clone();
    let inv = next_of(&mut w, "invoke").await?["invocation_id"].clone();
    let chunk = "z".repeat(60_000);
    const SENT: u64 = 200;
    for i in 0..SENT {
        let r = progress(&mut w, &inv, json!({"i": i, "text": chunk})).await?;
        assert_eq!(r["ok"]["seq"], i + 1, "{r}");
    }
    result(&mut w, &inv, json!({"complete": "done"})).await?;
    until_status(&mut c, &t, "completed").await?;
    // Now it reads: some progress in order, a marker for what it lost, and every
    // event of the turn.
    let (mut got, mut dropped, mut last_seq, mut events) = (0u64, 0u64, 0u64, Vec::new());
    loop {
        let f = turnd_tests::next_json(&mut slow.ws).await?;
        match f["push"].as_str() {
            Some("progress") => {
                let seq = f["seq"].as_u64().context("seq")?;
                ensure!(
                    seq > last_seq,
                    "progress out of order: {seq} after {last_seq}"
                );
                last_seq = seq;
                got += 1;
            }
            Some("progress_dropped") => {
                assert_eq!(f["invocation_id"], inv, "{f}");
                dropped += f["count"].as_u64().context("count")?;
            }
            Some("event") => {
                let kind = f["event"]["kind"].as_str().unwrap_or("").to_string();
                events.push(kind.clone());
                if kind == "completed" {
                    break;
                }
            }
            _ => {}
        }
    }
    assert!(dropped > 0, "nothing was dropped (got {got})");
    assert_eq!(got + dropped, SENT, "got {got}, dropped {dropped}");
    assert_eq!(events, ["admitted", "dispatched", "result", "completed"]);
    d.shutdown().await
}

/// A worker's step suspends turn `t` (invocation `inv`) for input.
async fn suspend(w: &mut Raw, inv: &Value, extra: Value) -> Result<()> {
    let mut s = json!({"state": {"draft": "rm -rf"}, "prompt": "run it?"});
    if let (Some(a), Some(e)) = (s.as_object_mut(), extra.as_object()) {
        a.extend(e.clone());
    }
    let r = result(w, inv, json!({"suspend": s})).await?;
    ensure!(r["accepted"] == "applied", "{r}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspended_turn_waits_for_input_in_every_view_and_resumes_with_it() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let mut w = worker(&d.url, "w1").await?;
    let mut c = client(&d.url).await?;
    let t = submit(&mut c, "s", json!("go"), json!({})).await?["turn"]["turn_id"].clone();
    let inv = next_of(&mut w, "invoke").await?["invocation_id"].clone();
    suspend(&mut w, &inv, json!({})).await?;
    let got = turn(&mut c, &t).await?;
    assert_eq!(got["status"], "running", "{got}");
    assert_eq!(got["wait"]["state"], "awaiting_input", "{got}");
    assert_eq!(got["input_request"]["prompt"], "run it?", "{got}");
    assert_eq!(got["input_request"]["deadline_ms"], Value::Null);
    let s = c.ok("session.inspect", json!({"session_id": "s"})).await?;
    assert_eq!(
        s["session"]["lock"]["wait"]["state"], "awaiting_input",
        "{s}"
    );
    let l = c
        .ok("sessions.list", json!({"state": "awaiting_input"}))
        .await?;
    assert_eq!(l["sessions"][0]["session_id"], "s", "{l}");
    let stats = c.ok("stats", json!({})).await?;
    assert_eq!(
        stats["stats"]["sessions"]["blocked"]["awaiting_input"], 1,
        "{stats}"
    );
    let (status, page) = turnd_tests::http_get(
        &d.admin,
        &format!("/ui/turn?id={}", t.as_str().unwrap_or("")),
    )
    .await?;
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("awaiting_input") && page.contains("run it?"),
        "{page}"
    );
    // The worker's slot is free: the invocation ended.
    let workers = c.ok("workers.list", json!({})).await?;
    assert_eq!(workers["workers"][0]["inflight"], 0, "{workers}");
    store_clean(&d.url).await?;

    let r = c
        .ok(
            "turn.resume",
            json!({"turn_id": t, "input": "yes", "idempotency_key": "r1"}),
        )
        .await?;
    assert_eq!(r["deduplicated"], false, "{r}");
    let next = next_of(&mut w, "invoke").await?;
    assert_eq!(
        next["input"],
        json!({"state": {"draft": "rm -rf"}, "input": "yes"}),
        "{next}"
    );
    assert_eq!((&next["step"], &next["attempt"]), (&json!(1), &json!(1)));
    // Resumed already: the same key and input is answered again, anything else is
    // a conflict, and nothing changes.
    let again = c
        .ok(
            "turn.resume",
            json!({"turn_id": t, "input": "yes", "idempotency_key": "r1"}),
        )
        .await?;
    assert_eq!(again["deduplicated"], true, "{again}");
    let e = c
        .request("turn.resume", json!({"turn_id": t, "input": "no"}))
        .await?;
    assert_eq!(code(&e), "conflict", "{e}");
    result(&mut w, &next["invocation_id"], json!({"complete": "ran"})).await?;
    let done = until_status(&mut c, &t, "completed").await?;
    assert_eq!(done["output"], "ran");
    let e = c
        .request("turn.resume", json!({"turn_id": t, "input": "no"}))
        .await?;
    assert_eq!(code(&e), "conflict", "{e}");
    store_clean(&d.url).await?;
    d.shutdown().await
}

/// A session `session` whose turn is suspended; its id.
async fn suspended_turn(c: &mut Raw, w: &mut Raw, session: &str, extra: Value) -> Result<Value> {
    let t = submit(c, session, json!("go"), json!({})).await?["turn"]["turn_id"].clone();
    let inv = next_of(w, "invoke").await?["invocation_id"].clone();
    suspend(w, &inv, extra).await?;
    Ok(t)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumes_race_to_one_winner_and_a_stop_ends_a_suspended_turn() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let mut w = worker(&d.url, "w1").await?;
    let mut c = client(&d.url).await?;
    for round in 0..5 {
        let t = suspended_turn(&mut c, &mut w, &format!("race-{round}"), json!({})).await?;
        let (mut a, mut b) = (client(&d.url).await?, client(&d.url).await?);
        let args = |v: &str| json!({"turn_id": t, "input": v});
        let (ra, rb) = tokio::join!(
            a.request("turn.resume", args("a")),
            b.request("turn.resume", args("b"))
        );
        let (ra, rb) = (ra?, rb?);
        let mut codes = [code(&ra), code(&rb)];
        codes.sort_unstable();
        assert_eq!(codes, ["conflict", "ok"], "{ra} {rb}");
        let next = next_of(&mut w, "invoke").await?;
        let winner = if code(&ra) == "ok" { "a" } else { "b" };
        assert_eq!(next["input"]["input"], winner, "{next}");
        result(&mut w, &next["invocation_id"], json!({"complete": 1})).await?;
        until_status(&mut c, &t, "completed").await?;
    }
    // A resume racing a stop: the turn ends cancelled either way.
    for round in 0..5 {
        let t = suspended_turn(&mut c, &mut w, &format!("stop-{round}"), json!({})).await?;
        let (mut a, mut b) = (client(&d.url).await?, client(&d.url).await?);
        let (r, s) = tokio::join!(
            a.request("turn.resume", json!({"turn_id": t, "input": 1})),
            b.request("turn.stop", json!({"turn_id": t}))
        );
        let (r, s) = (r?, s?);
        assert_eq!(code(&s), "ok", "{s}");
        if code(&r) == "ok" {
            // The resume came first: its step is dispatched and then cancelled.
            let next = next_of(&mut w, "invoke").await?;
            let cancel = next_of(&mut w, "cancel").await?;
            assert_eq!(cancel["invocation_id"], next["invocation_id"]);
            result(&mut w, &next["invocation_id"], json!({"cancelled": {}})).await?;
        } else {
            assert_eq!(code(&r), "conflict", "{r}");
            assert_eq!(
                s["ok"]["turn"]["status"], "cancelled",
                "stopped at once: {s}"
            );
        }
        until_status(&mut c, &t, "cancelled").await?;
    }
    store_clean(&d.url).await?;
    d.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_input_deadline_fails_the_turn_or_continues_without_input() -> Result<()> {
    // The raw worker reads nothing while the first deadline runs out.
    let d = TestDaemon::start(turnd_tests::quiet_raw_peers).await?;
    let mut w = worker(&d.url, "w1").await?;
    let mut c = client(&d.url).await?;
    // Long enough for the wait to be read before the deadline ends it, however
    // slowly this machine runs.
    let t = suspended_turn(&mut c, &mut w, "late", json!({"timeout_ms": 2_000})).await?;
    let got = turn(&mut c, &t).await?;
    assert_eq!(got["wait"]["on_deadline"], "fail", "{got}");
    let failed = until_status(&mut c, &t, "failed").await?;
    assert_eq!(failed["error"]["cause"], "input_timeout", "{failed}");
    let e = c
        .request("turn.resume", json!({"turn_id": t, "input": 1}))
        .await?;
    assert_eq!(code(&e), "conflict", "{e}");

    let t = suspended_turn(
        &mut c,
        &mut w,
        "late2",
        json!({"timeout_ms": 200, "on_timeout": "continue"}),
    )
    .await?;
    let next = next_of(&mut w, "invoke").await?;
    assert_eq!(next["turn_id"], t);
    assert_eq!(
        next["input"],
        json!({"state": {"draft": "rm -rf"}, "input": null}),
        "{next}"
    );
    result(&mut w, &next["invocation_id"], json!({"complete": 1})).await?;
    until_status(&mut c, &t, "completed").await?;
    store_clean(&d.url).await?;
    d.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspended_turn_survives_kill_9_and_is_resumed_after_it() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let d = BinDaemon::start(&data, &[]).await?;
    let mut w = worker(&d.url, "w1").await?;
    let mut c = client(&d.url).await?;
    let t = suspended_turn(&mut c, &mut w, "crash", json!({})).await?;
    drop((w, c));
    d.kill().await?;
    let d = BinDaemon::start(&data, &[]).await?;
    let mut c = client(&d.url).await?;
    let got = turn(&mut c, &t).await?;
    assert_eq!(got["wait"]["state"], "awaiting_input", "{got}");
    assert_eq!(got["input_request"]["prompt"], "run it?", "{got}");
    store_clean(&d.url).await?;
    let mut w = worker(&d.url, "w1").await?;
    c.ok("turn.resume", json!({"turn_id": t, "input": "after"}))
        .await?;
    let next = next_of(&mut w, "invoke").await?;
    assert_eq!(next["input"]["input"], "after", "{next}");
    result(&mut w, &next["invocation_id"], json!({"complete": 1})).await?;
    until_status(&mut c, &t, "completed").await?;
    store_clean(&d.url).await?;
    d.kill().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_refuses_busy_and_stores_nothing_not_even_its_key() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let mut w = worker(&d.url, "w1").await?;
    let mut c = client(&d.url).await?;
    let first = submit(&mut c, "b", json!(1), json!({"on_busy": "reject"})).await?;
    let t = first["turn"]["turn_id"].clone();
    next_of(&mut w, "invoke").await?;
    let events = |v: &Value| v["events"].as_array().map_or(0, Vec::len);
    let before = c.ok("session.events", json!({"session_id": "b"})).await?;
    let args = json!({"session_id": "b", "function_id": F, "input": 2, "on_busy": "reject", "idempotency_key": "k"});
    let busy = c.request("turn.submit", args).await?;
    assert_eq!(code(&busy), "busy", "{busy}");
    assert_eq!(busy["error"]["retryable"], false, "{busy}");
    let after = c.ok("session.events", json!({"session_id": "b"})).await?;
    assert_eq!(events(&after), events(&before), "no event: {after}");
    let list = c.ok("turn.list", json!({"session_id": "b"})).await?;
    assert_eq!(list["turns"].as_array().map(Vec::len), Some(1), "{list}");
    // The key was not kept: an enqueue with it is admitted as a new turn.
    let queued = submit(&mut c, "b", json!(2), json!({"idempotency_key": "k"})).await?;
    assert_eq!(queued["deduplicated"], false, "{queued}");
    assert_ne!(queued["turn"]["turn_id"], t);
    assert_eq!(queued["turn"]["status"], "queued");
    let (_, m) = turnd_tests::http_get(&d.admin, "/metrics").await?;
    assert_eq!(
        turnd_tests::metric(&m, "turnd_busy_rejected_total"),
        Some(1.0)
    );
    store_clean(&d.url).await?;
    d.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupt_stops_the_session_and_holds_until_the_result_in_flight() -> Result<()> {
    let d = TestDaemon::start(|c| c.turns.cancel_grace_ms = 30_000).await?;
    let mut w = worker(&d.url, "w1").await?;
    let mut c = client(&d.url).await?;
    let a = submit(&mut c, "i", json!("first"), json!({})).await?["turn"]["turn_id"].clone();
    let inv0 = next_of(&mut w, "invoke").await?["invocation_id"].clone();
    result(&mut w, &inv0, json!({"continue": {"said": "first"}})).await?;
    let inv1 = next_of(&mut w, "invoke").await?["invocation_id"].clone();
    let queued = submit(&mut c, "i", json!("second"), json!({})).await?["turn"]["turn_id"].clone();
    let args = json!({"on_busy": "interrupt", "idempotency_key": "third"});
    let third = submit(&mut c, "i", json!("third"), args.clone()).await?;
    let b = third["turn"]["turn_id"].clone();
    for id in [&a, &queued] {
        let t = turn(&mut c, id).await?;
        assert_eq!(t["status"], "cancelled", "stopped at once: {t}");
        assert_eq!(t["stop"]["reason"], "interrupted", "{t}");
        assert!(t.get("superseded").is_none(), "{t}");
    }
    // The running step is cancelled; the new turn waits for it to answer.
    let cancel = next_of(&mut w, "cancel").await?;
    assert_eq!(cancel["invocation_id"], inv1);
    let held = turn(&mut c, &b).await?;
    assert_eq!(held["wait"]["state"], "held", "{held}");
    assert_eq!(held["wait"]["invocation_id"], inv1, "{held}");
    // A repeat of the submit interrupts nothing more.
    let again = submit(&mut c, "i", json!("third"), args).await?;
    assert_eq!(
        (&again["deduplicated"], &again["turn"]["turn_id"]),
        (&json!(true), &b)
    );
    assert_eq!(turn(&mut c, &b).await?["status"], "queued");
    // The step's result was in flight: it is kept as late, the turn stays stopped,
    // and only now is the new turn dispatched, with what the stopped one had.
    let late = result(&mut w, &inv1, json!({"complete": "too late"})).await?;
    assert_eq!(late["accepted"], "late", "{late}");
    let next = next_of(&mut w, "invoke").await?;
    assert_eq!(next["turn_id"], b);
    assert_eq!(
        next["previous"],
        json!({"turn_id": a, "status": "cancelled", "state": {"said": "first"}}),
        "{next}"
    );
    let stopped = turn(&mut c, &a).await?;
    assert_eq!(stopped["status"], "cancelled", "{stopped}");
    let ev = c
        .ok("session.events", json!({"session_id": "i", "limit": 1000}))
        .await?;
    let late_results = ev["events"]
        .as_array()
        .context("events")?
        .iter()
        .filter(|e| e["kind"] == "late_result" && e["turn_id"] == a)
        .count();
    assert_eq!(late_results, 1, "{ev}");
    result(&mut w, &next["invocation_id"], json!({"complete": 3})).await?;
    until_status(&mut c, &b, "completed").await?;
    store_clean(&d.url).await?;
    d.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_marks_the_stopped_turns_superseded() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let mut w = worker(&d.url, "w1").await?;
    let mut c = client(&d.url).await?;
    let a = suspended_turn(&mut c, &mut w, "rb", json!({})).await?;
    let b = submit(&mut c, "rb", json!("new"), json!({"on_busy": "rollback"})).await?;
    let b = b["turn"]["turn_id"].clone();
    // Nothing ran for the suspended turn: the new one is dispatched at once.
    let next = next_of(&mut w, "invoke").await?;
    assert_eq!(next["turn_id"], b);
    assert_eq!(
        next["previous"]["state"],
        json!({"draft": "rm -rf"}),
        "{next}"
    );
    let list = c.ok("turn.list", json!({"session_id": "rb"})).await?;
    let rolled = list["turns"]
        .as_array()
        .context("turns")?
        .iter()
        .find(|t| t["turn_id"] == a)
        .cloned()
        .context("the stopped turn")?;
    assert_eq!(rolled["superseded"], true, "{rolled}");
    assert_eq!(rolled["status"], "cancelled", "{rolled}");
    result(&mut w, &next["invocation_id"], json!({"complete": 1})).await?;
    until_status(&mut c, &b, "completed").await?;
    store_clean(&d.url).await?;
    d.shutdown().await
}

/// The Rust SDK's calls for agent turns against the real daemon: `ctx.progress` and
/// a returned suspend in a worker; a watch of a turn's progress and events,
/// `resume` and `on_busy` in a caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_sdk_streams_progress_suspends_and_resumes() -> Result<()> {
    use turnd_client::turnd_proto::{ErrorCode, EventKind, OnBusy, Outcome, Suspend};
    use turnd_client::{FunctionSpec, WatchItem, Worker};
    let d = TestDaemon::start(|_| {}).await?;
    let (go_tx, go_rx) = tokio::sync::watch::channel(false);
    let shutdown = tokio_util::sync::CancellationToken::new();
    let worker = Worker::new(turnd_tests::worker_options(&d.url, "w-sdk"))
        .function(FunctionSpec::new(F), move |ctx| {
            let mut go = go_rx.clone();
            async move {
                if ctx.invoke.step == 1 {
                    return Outcome::Complete(ctx.invoke.input.clone());
                }
                // Streams once the caller watches.
                if go.wait_for(|g| *g).await.is_err() {
                    return Outcome::Cancelled(Default::default());
                }
                for tok in ["a", "b"] {
                    if ctx.progress(json!(tok)).await.is_err() {
                        return Outcome::Cancelled(Default::default());
                    }
                }
                Suspend::new(json!("kept")).prompt("ok?").into()
            }
        })
        .spawn(shutdown.clone());
    worker.connected().await;
    let c = d.caller().await?;
    let t = c.submit_simple("sdk", F, json!(1)).await?;
    let mut watch = c.watch_turn(&t.turn_id).await?;
    go_tx.send(true)?;
    let mut items = Vec::new();
    while let Some(item) = tokio::time::timeout(Duration::from_secs(5), watch.next_item()).await? {
        let done = matches!(&item, WatchItem::Event(e) if e.kind == EventKind::Suspended);
        items.push(item);
        if done {
            break;
        }
    }
    let progress: Vec<(u64, Value)> = items
        .iter()
        .filter_map(|i| match i {
            WatchItem::Progress(p) => Some((p.seq, p.data.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(progress, [(1, json!("a")), (2, json!("b"))], "{items:?}");
    let busy = c.submit_on_busy("sdk", F, json!(2), OnBusy::Reject).await;
    assert_eq!(busy.err().and_then(|e| e.code()), Some(ErrorCode::Busy));
    let waiting = c.get(&t.turn_id).await?;
    assert_eq!(
        waiting.input_request.and_then(|r| r.prompt),
        Some(json!("ok?"))
    );
    let r = c.resume(&t.turn_id, json!("yes"), Some("k")).await?;
    assert!(!r.deduplicated);
    let done = c.wait_terminal(&t.turn_id, Duration::from_secs(10)).await?;
    assert_eq!(done.output, Some(json!({"state": "kept", "input": "yes"})));
    let again = c.resume(&t.turn_id, json!("yes"), Some("k")).await?;
    assert!(again.deduplicated);
    let e = c.resume(&t.turn_id, json!("no"), None).await;
    assert_eq!(e.err().and_then(|e| e.code()), Some(ErrorCode::Conflict));
    shutdown.cancel();
    worker.join().await?;
    store_clean(&d.url).await?;
    d.shutdown().await
}

/// The `agent` example (a streaming echo model, an approval step, a chat that
/// interrupts) runs its conversation against the daemon.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_example_runs_its_conversation() -> Result<()> {
    let bin = tokio::task::spawn_blocking(|| turnd_tests::client_example("agent")).await??;
    let d = TestDaemon::start(|_| {}).await?;
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(bin)
            .arg(&d.url)
            .env_remove("TURND_TOKEN")
            .kill_on_drop(true)
            .output(),
    )
    .await??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "token 1: \"hello\"",
        "token 3: \"agent\"",
        "second: cancelled",
    ] {
        ensure!(stdout.contains(line), "no {line:?} in {stdout}");
    }
    ensure!(
        stdout.contains("(after t_"),
        "the third turn saw previous: {stdout}"
    );
    store_clean(&d.url).await?;
    d.shutdown().await
}

/// `turnd ARGS` against `url`, with a clean environment.
fn turnd_cmd(bin: &std::path::Path, url: &str, args: &[&str]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args(args)
        .args(["--url", url])
        .env_remove("TURND_URL")
        .env_remove("TURND_TOKEN")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    cmd
}

/// The CLI: `turnd watch --progress` prints a turn's tokens and events until it is
/// finished, `turnd resume` gives a suspended turn its input, `turnd submit
/// --on-busy reject` is refused `busy`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_watches_progress_and_resumes() -> Result<()> {
    let bin = tokio::task::spawn_blocking(turnd_tests::turnd_bin).await??;
    let d = TestDaemon::start(|_| {}).await?;
    let mut w = worker(&d.url, "w1").await?;
    let mut c = client(&d.url).await?;
    let t = submit(&mut c, "cli", json!("go"), json!({})).await?["turn"]["turn_id"].clone();
    let tid = t.as_str().context("turn id")?.to_string();
    let inv = next_of(&mut w, "invoke").await?["invocation_id"].clone();
    let mut watcher = turnd_cmd(&bin, &d.url, &["watch", &tid, "--progress"])
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut lines = tokio::io::BufReader::new(watcher.stdout.take().context("CLI stdout")?).lines();
    let mut text = String::new();
    // The watch replays the turn's two events (progress meanwhile would count as lost
    // for it) and goes live as it sends the last: progress goes out once the CLI
    // printed that one.
    tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(line) = lines.next_line().await? {
            text.push_str(&line);
            text.push('\n');
            if line.contains("dispatched") {
                return Ok(());
            }
        }
        anyhow::bail!("the CLI ended before it printed the dispatch: {text}")
    })
    .await??;
    for tok in ["tok1", "tok2"] {
        assert_eq!(code(&progress(&mut w, &inv, json!(tok)).await?), "ok");
    }
    suspend(&mut w, &inv, json!({})).await?;
    let busy = turnd_cmd(
        &bin,
        &d.url,
        &[
            "submit",
            "--session",
            "cli",
            "--function",
            F,
            "--on-busy",
            "reject",
        ],
    )
    .output()
    .await?;
    let err = String::from_utf8_lossy(&busy.stderr);
    ensure!(!busy.status.success() && err.contains("busy"), "{err}");
    let resumed = turnd_cmd(&bin, &d.url, &["resume", &tid, "--input", "\"yes\""])
        .output()
        .await?;
    ensure!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    let next = next_of(&mut w, "invoke").await?;
    assert_eq!(next["input"]["input"], "yes");
    result(&mut w, &next["invocation_id"], json!({"complete": 1})).await?;
    let status = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(line) = lines.next_line().await? {
            text.push_str(&line);
            text.push('\n');
        }
        anyhow::Ok(watcher.wait().await?)
    })
    .await??;
    ensure!(status.success(), "{text}");
    for line in [
        "progress step 0 #1: tok1",
        "progress step 0 #2: tok2",
        "suspended",
        "resumed",
        "completed",
    ] {
        ensure!(text.contains(line), "no {line:?} in {text}");
    }
    d.shutdown().await
}
