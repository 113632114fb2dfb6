//! The normal path: FIFO per session, parallel sessions, multi-step turns, retries, idempotency, protocol errors, restart.
//!
//! Every test talks to the real daemon (in-process on `127.0.0.1:0`, or the built
//! binary where process death matters) through the SDK or raw JSON frames, and checks
//! what the protocol (docs/protocol.md, docs/semantics.md) promises, not how the engine happens
//! to be built. Nothing waits on a fixed sleep: progress is observed through
//! `turn.wait`, watches, notifications and `eventually`.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;
use turnd_client::{Caller, FunctionSpec, InvocationCtx, Worker, WorkerHandle};
use turnd_proto::{
    Delivery, ErrorCause, ErrorCode, Event, EventKind, Failure, ListArgs, OnDeadline, Outcome,
    Role, SubmitArgs, Turn, TurnStatus, WaitState, WatchArgs,
};
use turnd_server::config::TokenConfig;
use turnd_tests::{
    all_events, echo_worker, event_kinds, eventually, wait_done, worker_options, BinDaemon, Raw,
    TestDaemon,
};

// ------------------------------------------------------------------------ helpers

/// Start a worker serving the given functions and wait until it is registered.
async fn start_worker(worker: Worker) -> WorkerHandle {
    let h = worker.spawn(CancellationToken::new());
    h.connected().await;
    h
}

/// `turn.submit` with an optional idempotency key.
fn submit_args(session: &str, function: &str, input: Value, key: Option<&str>) -> SubmitArgs {
    SubmitArgs {
        session_id: session.to_string(),
        function_id: function.to_string(),
        input,
        idempotency_key: key.map(str::to_string),
        turn_timeout_ms: None,
        on_busy: None,
    }
}

/// `turn.list` arguments.
fn list_args(
    session: &str,
    status: Option<TurnStatus>,
    limit: Option<u64>,
    before: Option<u64>,
) -> ListArgs {
    ListArgs {
        session_id: session.to_string(),
        status,
        limit,
        before_seq: before,
    }
}

/// Turn ids in the order their events of `kind` appear in the session.
fn turns_by_event(events: &[Event], kind: EventKind) -> Vec<String> {
    events
        .iter()
        .filter(|e| e.kind == kind)
        .map(|e| e.turn_id.clone())
        .collect()
}

/// Assert that `store.check` (operator) finds no violation.
async fn assert_store_healthy(url: &str) -> Result<()> {
    let op = Caller::connect_as(url, Role::Operator, None).await?;
    let violations = op.store_check().await?;
    ensure!(violations.is_empty(), "store.check: {violations:?}");
    Ok(())
}

/// The next response frame (pushes are kept aside), at most 5 s.
async fn next_response(raw: &mut Raw) -> Result<Value> {
    loop {
        let f = raw.recv().await?;
        if f.get("push").is_some() {
            raw.pushes.push(f);
            continue;
        }
        return Ok(f);
    }
}

/// Check an error response frame: the id, the code, `retryable: false` (true for no
/// code this file provokes) and a message.
fn check_error(frame: &Value, id: &Value, code: &str) -> Result<()> {
    ensure!(frame.get("id") == Some(id), "want id {id}, got {frame}");
    ensure!(frame.get("ok").is_none(), "want error {code}, got {frame}");
    ensure!(
        frame.pointer("/error/code") == Some(&json!(code)),
        "want error {code}, got {frame}"
    );
    ensure!(
        frame.pointer("/error/retryable") == Some(&json!(false)),
        "{code} must not be retryable: {frame}"
    );
    ensure!(
        frame
            .pointer("/error/message")
            .and_then(Value::as_str)
            .is_some_and(|m| !m.is_empty()),
        "error without a message: {frame}"
    );
    Ok(())
}

/// `ping` answers `{}`: the connection is still usable.
async fn ping_ok(raw: &mut Raw) -> Result<()> {
    let f = raw.request("ping", json!({})).await?;
    ensure!(f.get("ok") == Some(&json!({})), "ping: {f}");
    Ok(())
}

/// Send a request, expect error `code`, then prove the connection still serves a ping.
async fn expect_code(raw: &mut Raw, op: &str, args: Value, code: &str) -> Result<()> {
    let f = raw.request(op, args.clone()).await?;
    let id = f.get("id").cloned().unwrap_or(Value::Null);
    check_error(&f, &id, code).with_context(|| format!("{op} {args}"))?;
    ping_ok(raw)
        .await
        .with_context(|| format!("connection unusable after {op} {args}"))
}

/// Send one raw frame, expect `bad_frame` answered with `id`.
async fn expect_bad_frame(raw: &mut Raw, msg: Message, id: Value) -> Result<()> {
    let shown = format!("{msg:?}");
    raw.ws.send(msg).await?;
    let f = next_response(raw).await?;
    check_error(&f, &id, "bad_frame").with_context(|| format!("frame {shown}"))
}

/// Read frames until the server closes; return the error codes seen and the close code.
async fn read_until_close(raw: &mut Raw) -> Result<(Vec<String>, Option<u16>)> {
    let mut codes = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), raw.ws.next())
            .await
            .context("no close within 5 s")?;
        match m {
            Some(Ok(Message::Text(t))) => {
                let v: Value = serde_json::from_str(t.as_str())?;
                if let Some(c) = v.pointer("/error/code").and_then(Value::as_str) {
                    codes.push(c.to_string());
                }
            }
            Some(Ok(Message::Close(c))) => return Ok((codes, c.map(|c| u16::from(c.code)))),
            Some(Ok(_)) => {}
            Some(Err(e)) => bail!("socket error before close: {e}"),
            None => return Ok((codes, None)),
        }
    }
}

// -------------------------------------------------------------- 1. FIFO per session

#[derive(Debug, Clone, PartialEq)]
enum Mark {
    Start(String, u64),
    End(String, u64),
}

/// Turns of one session run strictly in admission order and never two at once, even
/// on a worker with concurrency 8 that is busy with another session at the same time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_session_runs_turns_in_admission_order_one_at_a_time() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let log: Arc<Mutex<Vec<Mark>>> = Arc::default();
    let l = log.clone();
    let worker = start_worker(Worker::new(worker_options(&d.url, "w-fifo")).function(
        FunctionSpec::new("record").concurrency(8),
        move |ctx: InvocationCtx| {
            let log = l.clone();
            async move {
                let s = ctx.invoke.session_id.clone();
                let n = ctx.invoke.input["n"].as_u64().unwrap_or(u64::MAX);
                log.lock().expect("log").push(Mark::Start(s.clone(), n));
                tokio::time::sleep(Duration::from_millis(3)).await;
                log.lock().expect("log").push(Mark::End(s, n));
                Outcome::Complete(json!({ "n": n }))
            }
        },
    ))
    .await;
    let c = d.caller().await?;
    const N: u64 = 20;

    // Session A: submitted one after another (submission order = admission order).
    // Session B: all 20 submitted at once on one connection (admission order = the
    // `seq` the daemon gave each). Both run at the same time on the same worker.
    let a = async {
        let mut turns = Vec::new();
        for n in 0..N {
            turns.push(
                c.submit_simple("s-fifo-a", "record", json!({ "n": n }))
                    .await?,
            );
        }
        anyhow::Ok(turns)
    };
    let b = futures_util::future::join_all(
        (0..N).map(|n| c.submit_simple("s-fifo-b", "record", json!({ "n": n }))),
    );
    let (a, b) = tokio::join!(a, b);
    let a = a?;
    let b = b.into_iter().collect::<Result<Vec<_>, _>>()?;
    let seqs: Vec<u64> = a.iter().map(|t| t.seq).collect();
    assert_eq!(
        seqs,
        (1..=N).collect::<Vec<_>>(),
        "sequential submits get seq 1..N"
    );

    for (session, turns) in [("s-fifo-a", &a), ("s-fifo-b", &b)] {
        let mut admitted: Vec<&Turn> = turns.iter().collect();
        admitted.sort_by_key(|t| t.seq);
        let mut seen: Vec<u64> = admitted.iter().map(|t| t.seq).collect();
        seen.dedup();
        assert_eq!(seen, (1..=N).collect::<Vec<_>>(), "{session}: seqs");
        for t in &admitted {
            let done = wait_done(&c, &t.turn_id, 20).await?;
            assert_eq!(done.status, TurnStatus::Completed, "{session}: {done:?}");
            assert_eq!(done.output, Some(t.input.clone()), "{session}: output");
        }
        let want: Vec<u64> = admitted
            .iter()
            .map(|t| t.input["n"].as_u64().unwrap_or(u64::MAX))
            .collect();

        // What the handler saw: Start(x), End(x), Start(y), End(y), ... in seq order.
        let marks: Vec<Mark> = log
            .lock()
            .expect("log")
            .iter()
            .filter(|m| matches!(m, Mark::Start(s, _) | Mark::End(s, _) if s == session))
            .cloned()
            .collect();
        let expected: Vec<Mark> = want
            .iter()
            .flat_map(|n| {
                [
                    Mark::Start(session.to_string(), *n),
                    Mark::End(session.to_string(), *n),
                ]
            })
            .collect();
        assert_eq!(
            marks, expected,
            "{session}: invocations must start in admission order and never overlap"
        );

        // What the daemon recorded: dispatches in seq order, and turn k+1 is
        // dispatched only after turn k completed.
        let events = all_events(&c, session).await?;
        let order: Vec<String> = admitted.iter().map(|t| t.turn_id.clone()).collect();
        assert_eq!(turns_by_event(&events, EventKind::Dispatched), order);
        assert_eq!(turns_by_event(&events, EventKind::Completed), order);
        let pos = |kind: EventKind, turn: &str| {
            events
                .iter()
                .position(|e| e.kind == kind && e.turn_id == turn)
                .expect("event present")
        };
        for w in order.windows(2) {
            assert!(
                pos(EventKind::Completed, &w[0]) < pos(EventKind::Dispatched, &w[1]),
                "{session}: {} dispatched before {} completed",
                w[1],
                w[0]
            );
        }
    }
    assert_store_healthy(&d.url).await?;
    worker.shutdown();
    d.shutdown().await
}

// ------------------------------------------------------- 2. sessions run in parallel

/// Four sessions run at the same time: every handler blocks until all four have
/// started, which can only happen if the daemon dispatches them concurrently (no
/// timing involved). While they are held, the daemon itself reports four invocations
/// in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_run_in_parallel() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let (arrived, _) = tokio::sync::watch::channel(0usize);
    let arrived = Arc::new(arrived);
    let release = CancellationToken::new();
    let (a2, r2) = (arrived.clone(), release.clone());
    let worker = start_worker(Worker::new(worker_options(&d.url, "w-par")).function(
        FunctionSpec::new("rendezvous").concurrency(4),
        move |ctx: InvocationCtx| {
            let (arrived, release) = (a2.clone(), r2.clone());
            async move {
                arrived.send_modify(|n| *n += 1);
                release.cancelled().await;
                Outcome::Complete(json!({ "session": ctx.invoke.session_id }))
            }
        },
    ))
    .await;
    let c = d.caller().await?;
    let sessions = ["s-par-1", "s-par-2", "s-par-3", "s-par-4"];
    let mut turns = Vec::new();
    for s in sessions {
        turns.push(c.submit_simple(s, "rendezvous", json!({})).await?);
    }
    let mut rx = arrived.subscribe();
    tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|n| *n >= 4))
        .await
        .context("the four sessions never ran at the same time")??;

    let stats = c.stats().await?;
    assert_eq!(stats.invocations_inflight, 4, "{stats:?}");
    assert_eq!(stats.sessions.blocked.get("awaiting_result"), Some(&4));
    for s in sessions {
        let session = c.inspect(s).await?;
        let lock = session.lock.context("a running session holds its lock")?;
        assert_eq!(lock.wait.state, WaitState::AwaitingResult, "{s}");
    }
    release.cancel();
    for t in &turns {
        let done = wait_done(&c, &t.turn_id, 10).await?;
        assert_eq!(done.status, TurnStatus::Completed);
        assert_eq!(done.output, Some(json!({ "session": t.session_id })));
    }
    worker.shutdown();
    d.shutdown().await
}

/// A session's head turn blocks the turns behind it even when they could run: with a
/// worker idle for the second turn's function, it stays `queued_behind` and is never
/// dispatched until the head (whose function nobody serves yet) has finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_head_holds_back_its_session_but_not_others() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let echo = echo_worker(&d.url, "w-hol-echo", 4).await;
    let c = d.caller().await?;
    let head = c.submit_simple("s-hol", "later", json!({"h": 1})).await?;
    let behind = c.submit_simple("s-hol", "echo", json!({"b": 2})).await?;
    let other = c
        .submit_simple("s-hol-other", "echo", json!({"o": 3}))
        .await?;
    assert_eq!(
        wait_done(&c, &other.turn_id, 10).await?.status,
        TurnStatus::Completed,
        "another session is not held back"
    );
    // Give a wrong dispatch every chance to happen (the echo worker is idle).
    let still = c.wait(&behind.turn_id, Some(300)).await?;
    assert_eq!(still.status, TurnStatus::Queued, "{still:?}");
    let wait = still.wait.context("wait")?;
    assert_eq!((wait.state, wait.ahead), (WaitState::QueuedBehind, Some(1)));
    let head_now = c.get(&head.turn_id).await?;
    assert_eq!(
        head_now.wait.map(|w| w.state),
        Some(WaitState::AwaitingWorker)
    );
    let events = all_events(&c, "s-hol").await?;
    assert!(
        turns_by_event(&events, EventKind::Dispatched).is_empty(),
        "{events:?}"
    );

    let later = start_worker(Worker::new(worker_options(&d.url, "w-hol-later")).function(
        FunctionSpec::new("later"),
        |ctx: InvocationCtx| async move { Outcome::Complete(ctx.invoke.input.clone()) },
    ))
    .await;
    let done = wait_done(&c, &behind.turn_id, 10).await?;
    assert_eq!(done.output, Some(json!({"b": 2})));
    let events = all_events(&c, "s-hol").await?;
    let order = vec![head.turn_id.clone(), behind.turn_id.clone()];
    assert_eq!(turns_by_event(&events, EventKind::Dispatched), order);
    assert_eq!(turns_by_event(&events, EventKind::Completed), order);
    later.shutdown();
    echo.shutdown();
    d.shutdown().await
}

/// A worker's `concurrency` bounds its invocations in flight: with six sessions
/// waiting on a worker of concurrency 2, exactly two are dispatched, the daemon shows
/// the other four waiting for a worker, and the function's settings are visible.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_concurrency_bounds_invocations_in_flight() -> Result<()> {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    let d = TestDaemon::start(|_| {}).await?;
    let (arrived, _) = tokio::sync::watch::channel(0usize);
    let arrived = Arc::new(arrived);
    let inflight = Arc::new(AtomicUsize::new(0));
    let max_seen = Arc::new(AtomicUsize::new(0));
    let release = CancellationToken::new();
    let (a2, i2, m2, r2) = (
        arrived.clone(),
        inflight.clone(),
        max_seen.clone(),
        release.clone(),
    );
    let worker = start_worker(
        Worker::new(worker_options(&d.url, "w-conc")).function(
            FunctionSpec::new("gate")
                .concurrency(2)
                .timeout_ms(7000)
                .delivery(Delivery::AtLeastOnce)
                .max_attempts(4),
            move |_ctx: InvocationCtx| {
                let (arrived, inflight, max_seen, release) =
                    (a2.clone(), i2.clone(), m2.clone(), r2.clone());
                async move {
                    let now = inflight.fetch_add(1, SeqCst) + 1;
                    max_seen.fetch_max(now, SeqCst);
                    arrived.send_modify(|n| *n += 1);
                    release.cancelled().await;
                    inflight.fetch_sub(1, SeqCst);
                    Outcome::Complete(json!(null))
                }
            },
        ),
    )
    .await;
    let c = d.caller().await?;
    let mut turns = Vec::new();
    for k in 0..6 {
        turns.push(
            c.submit_simple(&format!("s-conc-{k}"), "gate", json!({}))
                .await?,
        );
    }
    let mut rx = arrived.subscribe();
    tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|n| *n >= 2))
        .await
        .context("two invocations never started")??;
    let stats = c.stats().await?;
    assert_eq!(stats.invocations_inflight, 2, "{stats:?}");
    assert_eq!(
        stats.sessions.blocked.get("awaiting_result"),
        Some(&2),
        "{stats:?}"
    );
    assert_eq!(
        stats.sessions.blocked.get("awaiting_worker"),
        Some(&4),
        "{stats:?}"
    );
    assert_eq!(
        (stats.turns.running, stats.turns.queued),
        (2, 4),
        "{stats:?}"
    );
    let functions = c.functions().await?;
    let f = functions
        .iter()
        .find(|f| f.function_id == "gate")
        .context("gate listed")?;
    assert_eq!(
        (
            f.concurrency,
            f.timeout_ms,
            f.delivery,
            f.max_attempts,
            f.workers
        ),
        (2, 7000, Delivery::AtLeastOnce, 4, 1),
        "{f:?}"
    );
    assert_eq!(f.queued, 4, "{f:?}");
    let workers = c.workers().await?;
    let w = workers
        .iter()
        .find(|w| w.worker_id == "w-conc")
        .context("worker listed")?;
    assert!(w.connected, "{w:?}");
    assert_eq!(
        (w.inflight, w.functions.clone()),
        (2, vec!["gate".to_string()])
    );
    assert_eq!(*rx.borrow(), 2, "no third invocation was pushed");

    release.cancel();
    for t in &turns {
        assert_eq!(
            wait_done(&c, &t.turn_id, 10).await?.status,
            TurnStatus::Completed
        );
    }
    assert_eq!(
        max_seen.load(SeqCst),
        2,
        "never more than `concurrency` at once"
    );
    worker.shutdown();
    d.shutdown().await
}

// ------------------------------------------------------------- 3. multi-step turns

/// `continue` outcome: count from `count` up to `to`, one step per increment.
fn count_step(input: &Value) -> Outcome {
    let count = input["count"].as_u64().unwrap_or(0);
    let to = input["to"].as_u64().unwrap_or(0);
    if count >= to {
        Outcome::Complete(json!({ "count": count }))
    } else {
        Outcome::Continue(json!({ "count": count + 1, "to": to }))
    }
}

/// Inputs large enough to be stored apart from their turn's record (checked in the
/// store) reach the worker whole, come back in `turn.get`, and survive a restart: a
/// finished turn reads its input back, and a turn still waiting for a worker at the
/// restart is recovered with it and runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_inputs_reach_workers_and_survive_a_restart() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let echo = echo_worker(&d.url, "w-big", 4).await;
    let c = d.caller().await?;
    let big = |tag: &str| json!({"tag": tag, "prompt": "z".repeat(20_000)});
    let mut done = Vec::new();
    for tag in ["a", "b"] {
        let t = c.submit_simple("s-big", "echo", big(tag)).await?;
        done.push(t.turn_id);
    }
    let waiting = c
        .submit_simple("s-big-later", "later", big("later"))
        .await?;
    for id in &done {
        let t = wait_done(&c, id, 10).await?;
        assert_eq!(t.status, TurnStatus::Completed, "{t:?}");
        assert_eq!(t.output.as_ref(), Some(&t.input));
    }
    let kv = d.engine().store().kv();
    // The waiting turn: its input apart from its record.
    let id = &waiting.turn_id;
    let apart = kv.get(&turnd_store::keys::turn_input(id))?;
    ensure!(apart.is_some(), "the input of {id} is stored apart");
    let record: Value =
        serde_json::from_slice(&kv.get(&turnd_store::keys::turn(id))?.context("record")?)?;
    ensure!(
        record.get("input").is_none(),
        "the record of {id} leaves its input out"
    );
    // The finished ones: one folded record with the input inline, nothing apart.
    for id in &done {
        ensure!(kv.get(&turnd_store::keys::turn_input(id))?.is_none());
        ensure!(kv.get(&turnd_store::keys::turn(id))?.is_none());
        let folded: Value = serde_json::from_slice(
            &kv.get(&turnd_store::keys::finished(id))?
                .context("folded record")?,
        )?;
        ensure!(
            folded["turn"]["input"]["prompt"].as_str().map(str::len) == Some(20_000),
            "the folded record of {id} holds its input"
        );
        ensure!(folded["invocations"].as_array().map(Vec::len) == Some(1));
    }
    echo.shutdown();
    let dir = d.dir.clone();
    d.shutdown().await?;

    // sled's threads can hold the store's lock a moment after the shutdown.
    let d = eventually(10, "the daemon to start again on its store", || {
        let dir = dir.clone();
        async move { TestDaemon::start_in(dir, |_| {}, false).await.ok() }
    })
    .await?;
    let c = d.caller().await?;
    for (id, tag) in done.iter().zip(["a", "b"]) {
        let t = c.get(id).await?;
        assert_eq!(t.input, big(tag));
        assert_eq!(t.output, Some(big(tag)));
    }
    let w = start_worker(Worker::new(worker_options(&d.url, "w-later")).function(
        FunctionSpec::new("later"),
        |ctx: InvocationCtx| async move { Outcome::Complete(ctx.invoke.input.clone()) },
    ))
    .await;
    let t = wait_done(&c, &waiting.turn_id, 10).await?;
    assert_eq!(t.status, TurnStatus::Completed, "{t:?}");
    assert_eq!(
        t.output,
        Some(big("later")),
        "the recovered turn ran with its input"
    );
    assert_store_healthy(&d.url).await?;
    w.shutdown();
    d.shutdown().await
}

/// A turn advances through `continue` steps, each step's input being the previous
/// step's state, and completes with the final output and `step`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_step_turn_counts_to_n_through_continue() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let seen: Arc<Mutex<Vec<(u32, u32, Value)>>> = Arc::default();
    let s2 = seen.clone();
    let worker = start_worker(Worker::new(worker_options(&d.url, "w-count")).function(
        FunctionSpec::new("count"),
        move |ctx: InvocationCtx| {
            let seen = s2.clone();
            async move {
                let i = &ctx.invoke;
                seen.lock()
                    .expect("seen")
                    .push((i.step, i.attempt, i.input.clone()));
                count_step(&i.input)
            }
        },
    ))
    .await;
    let c = d.caller().await?;
    let input = json!({"count": 0, "to": 5});
    let t = c.submit_simple("s-count", "count", input.clone()).await?;
    let done = wait_done(&c, &t.turn_id, 10).await?;
    assert_eq!(done.status, TurnStatus::Completed, "{done:?}");
    assert_eq!(done.output, Some(json!({"count": 5})));
    assert_eq!(done.step, 5, "six steps: 0..=5");
    assert_eq!(done.input, input, "the turn keeps its submitted input");
    assert!(done.error.is_none() && done.wait.is_none());

    let want: Vec<(u32, u32, Value)> = (0..=5u32)
        .map(|k| (k, 1, json!({"count": k, "to": 5})))
        .collect();
    assert_eq!(*seen.lock().expect("seen"), want, "step k sees state k");

    let events = all_events(&c, "s-count").await?;
    let steps: Vec<u64> = events
        .iter()
        .filter(|e| e.kind == EventKind::Dispatched)
        .map(|e| e.detail["step"].as_u64().unwrap_or(u64::MAX))
        .collect();
    assert_eq!(steps, vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(
        event_kinds(&events, &t.turn_id).last(),
        Some(&EventKind::Completed)
    );
    worker.shutdown();
    d.shutdown().await
}

/// With `turns.max_steps = 3` a turn may run exactly three steps: one that completes
/// on step 2 succeeds, one that continues past it fails with `step_limit`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_steps_reached_fails_with_step_limit() -> Result<()> {
    let d = TestDaemon::start(|c| c.turns.max_steps = 3).await?;
    let invocations: Arc<Mutex<Vec<String>>> = Arc::default();
    let i2 = invocations.clone();
    let worker = start_worker(
        Worker::new(worker_options(&d.url, "w-steps"))
            .function(
                FunctionSpec::new("count"),
                |ctx: InvocationCtx| async move { count_step(&ctx.invoke.input) },
            )
            .function(FunctionSpec::new("forever"), move |ctx: InvocationCtx| {
                let invocations = i2.clone();
                async move {
                    invocations
                        .lock()
                        .expect("invocations")
                        .push(ctx.invoke.invocation_id.clone());
                    Outcome::Continue(json!({ "step": ctx.invoke.step + 1 }))
                }
            }),
    )
    .await;
    let c = d.caller().await?;

    let fits = c
        .submit_simple("s-steps-fit", "count", json!({"count": 0, "to": 2}))
        .await?;
    let fits = wait_done(&c, &fits.turn_id, 10).await?;
    assert_eq!(fits.status, TurnStatus::Completed, "{fits:?}");
    assert_eq!((fits.step, fits.output), (2, Some(json!({"count": 2}))));

    let over = c
        .submit_simple("s-steps-over", "count", json!({"count": 0, "to": 3}))
        .await?;
    let over = wait_done(&c, &over.turn_id, 10).await?;
    assert_eq!(over.status, TurnStatus::Failed, "{over:?}");
    assert_eq!(
        over.error.as_ref().map(|e| e.cause),
        Some(ErrorCause::StepLimit)
    );

    let t = c.submit_simple("s-steps", "forever", json!({})).await?;
    let done = wait_done(&c, &t.turn_id, 10).await?;
    assert_eq!(done.status, TurnStatus::Failed, "{done:?}");
    let e = done.error.context("a failed turn has an error")?;
    assert_eq!(e.cause, ErrorCause::StepLimit);
    assert_eq!(e.step, 2, "steps 0, 1 and 2 ran");
    let ran = invocations.lock().expect("invocations").clone();
    assert_eq!(ran.len(), 3, "exactly max_steps invocations: {ran:?}");
    assert_eq!(e.invocation_id.as_ref(), ran.last(), "names the last step");
    assert!(done.output.is_none());
    assert!(done.finished_at_ms.is_some());
    assert_store_healthy(&d.url).await?;
    worker.shutdown();
    d.shutdown().await
}

/// Payloads travel as the compact JSON text a peer sent: a submit's input and a
/// step's output reach the worker and the callers member for member and digit for
/// digit (members out of order, an integer no 64-bit type holds, `1.50`, `1e2`).
/// Text with whitespace outside its strings is kept compact, and it is the compact
/// text that `turns.max_value_bytes` measures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_keep_the_text_a_peer_sent() -> Result<()> {
    let d = TestDaemon::start(|c| c.turns.max_value_bytes = 60).await?;
    let (mut w, _) = Raw::hello(&d.url, "worker", json!({"worker_id": "w-text"})).await?;
    w.ok("function.register", json!({"function_id": "raw.keep"}))
        .await?;
    let (mut c, _) = Raw::hello(&d.url, "client", json!({})).await?;
    let input = r#"{"z":1,"a":[12345678901234567890123,1.50],"m":"x y"}"#;
    c.send_text(&format!(
        r#"{{"id":7,"op":"turn.submit","args":{{"session_id":"s-text","function_id":"raw.keep","input":{input}}}}}"#
    ))
    .await?;
    let answer = c.text_with(r#""id":7"#).await?;
    ensure!(answer.contains(&format!(r#""input":{input}"#)), "{answer}");
    let invoke = w.text_with(r#""push":"invoke""#).await?;
    ensure!(invoke.contains(&format!(r#""input":{input}"#)), "{invoke}");
    let pushed: Value = serde_json::from_str(&invoke)?;
    let inv_id = pushed["invocation_id"].as_str().context("invocation_id")?;
    let turn_id = pushed["turn_id"].as_str().context("turn_id")?;
    let output = r#"{"y":[2,1e2],"b":"done"}"#;
    w.send_text(&format!(
        r#"{{"id":8,"op":"invocation.result","args":{{"invocation_id":"{inv_id}","outcome":{{"complete":{output}}}}}}}"#
    ))
    .await?;
    ensure!(w.text_with(r#""id":8"#).await?.contains("applied"));
    c.send_text(&format!(
        r#"{{"id":9,"op":"turn.wait","args":{{"turn_id":"{turn_id}"}}}}"#
    ))
    .await?;
    let done = c.text_with(r#""id":9"#).await?;
    ensure!(done.contains(&format!(r#""output":{output}"#)), "{done}");
    ensure!(done.contains(r#""status":"completed""#), "{done}");

    // 80 bytes as sent, 21 compact: within the limit of 60, and kept compact.
    let spaced = format!(
        "{{ \"b\" : [ 1 , 2 ] ,{} \"a\" : \"p q\" }}",
        " ".repeat(50)
    );
    c.send_text(&format!(
        r#"{{"id":10,"op":"turn.submit","args":{{"session_id":"s-text-2","function_id":"raw.keep","input":{spaced}}}}}"#
    ))
    .await?;
    let answer = c.text_with(r#""id":10"#).await?;
    ensure!(
        answer.contains(r#""input":{"a":"p q","b":[1,2]}"#),
        "{answer}"
    );
    // Compact and over the limit: too_large, as before.
    let long = format!(r#"{{"a":"{}"}}"#, "x".repeat(60));
    c.send_text(&format!(
        r#"{{"id":11,"op":"turn.submit","args":{{"session_id":"s-text-3","function_id":"raw.keep","input":{long}}}}}"#
    ))
    .await?;
    let refused = c.text_with(r#""id":11"#).await?;
    ensure!(refused.contains("too_large"), "{refused}");
    d.shutdown().await
}

/// A worker written from the protocol page alone (raw frames): it gets `invoke`
/// pushes, answers `continue` then `complete`, sees the state as the next step's
/// input, and a resent result is a `duplicate`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_worker_drives_a_multi_step_turn() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let (mut w, hello) = Raw::hello(
        &d.url,
        "worker",
        json!({"worker_id": "w-raw", "instance_id": "i-raw-1", "name": "raw"}),
    )
    .await?;
    assert_eq!(
        hello.pointer("/ok/server"),
        Some(&json!("turnd")),
        "{hello}"
    );
    assert!(hello.pointer("/ok/reconciled").is_some(), "{hello}");
    let reg = w
        .ok("function.register", json!({"function_id": "raw.step"}))
        .await?;
    assert_eq!(reg, json!({"function_id": "raw.step", "workers": 1}));

    let c = d.caller().await?;
    let t = c
        .submit_simple("s-raw", "raw.step", json!({"x": 1}))
        .await?;
    let inv0 = w.next_push().await?;
    assert_eq!(inv0["push"], "invoke", "{inv0}");
    assert_eq!(inv0["turn_id"], json!(t.turn_id));
    assert_eq!(inv0["session_id"], "s-raw");
    assert_eq!(
        (inv0["step"].clone(), inv0["attempt"].clone()),
        (json!(0), json!(1))
    );
    assert_eq!(inv0["input"], json!({"x": 1}));
    assert!(inv0["deadline_ms"]
        .as_u64()
        .is_some_and(|d| d > t.created_at_ms));
    // Another worker may not answer, heartbeat or report status for this invocation.
    let (mut intruder, _) =
        Raw::hello(&d.url, "worker", json!({"worker_id": "w-intruder"})).await?;
    let inv_id = inv0["invocation_id"].clone();
    for (op, args) in [
        (
            "invocation.result",
            json!({"invocation_id": inv_id, "outcome": {"complete": "stolen"}}),
        ),
        ("invocation.heartbeat", json!({ "invocation_id": inv_id })),
        (
            "invocation.status",
            json!({"invocation_id": inv_id, "state": "unknown"}),
        ),
    ] {
        expect_code(&mut intruder, op, args, "forbidden").await?;
    }
    let still = c.get(&t.turn_id).await?;
    assert_eq!(
        (still.status, still.step),
        (TurnStatus::Running, 0),
        "{still:?}"
    );
    let hb = w
        .ok("invocation.heartbeat", json!({ "invocation_id": inv_id }))
        .await?;
    assert!(hb["deadline_ms"].as_u64().is_some(), "{hb}");
    let res0 = json!({"invocation_id": inv0["invocation_id"], "outcome": {"continue": {"x": 2}}});
    let ack = w.ok("invocation.result", res0.clone()).await?;
    assert_eq!(ack, json!({"accepted": "applied"}));

    let inv1 = w.next_push().await?;
    assert_eq!(inv1["push"], "invoke", "{inv1}");
    assert_eq!(
        (inv1["step"].clone(), inv1["attempt"].clone()),
        (json!(1), json!(1))
    );
    assert_eq!(inv1["input"], json!({"x": 2}), "step 1 gets step 0's state");
    assert_ne!(inv1["invocation_id"], inv0["invocation_id"]);
    // Resending step 0's result changes nothing.
    let dup = w.ok("invocation.result", res0).await?;
    assert_eq!(dup, json!({"accepted": "duplicate"}));
    let res1 = json!({"invocation_id": inv1["invocation_id"], "outcome": {"complete": {"x": 3}}});
    let ack = w.ok("invocation.result", res1.clone()).await?;
    assert_eq!(ack, json!({"accepted": "applied"}));
    let dup = w.ok("invocation.result", res1).await?;
    assert_eq!(dup, json!({"accepted": "duplicate"}));

    let done = wait_done(&c, &t.turn_id, 5).await?;
    assert_eq!(done.status, TurnStatus::Completed);
    assert_eq!((done.step, done.output), (1, Some(json!({"x": 3}))));
    let unknown = w
        .ok(
            "invocation.result",
            json!({"invocation_id": "inv_never", "outcome": {"complete": 1}}),
        )
        .await?;
    assert_eq!(unknown, json!({"accepted": "unknown"}));
    d.shutdown().await
}

// ----------------------------------------------------------------------- 4. retries

/// Retryable failure, then success under at_least_once (with a visible `backing_off`
/// wait); retryable failures until attempts run out → `attempts_exhausted`; a
/// non-retryable failure → `handler_failed` at once, naming code, message, step and
/// invocation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retryable_failures_retry_and_exhaust_non_retryable_fail_at_once() -> Result<()> {
    // A backoff long enough that `turn.get` right after `retry_scheduled` sees it.
    let d = TestDaemon::start(|c| c.turns.retry_backoff_ms = 600).await?;
    type Calls = Arc<Mutex<HashMap<String, Vec<(String, u32, u32)>>>>;
    let calls: Calls = Arc::default();
    let record = |calls: &Calls, ctx: &InvocationCtx| {
        calls
            .lock()
            .expect("calls")
            .entry(ctx.invoke.function_id.clone())
            .or_default()
            .push((
                ctx.invoke.invocation_id.clone(),
                ctx.invoke.step,
                ctx.invoke.attempt,
            ));
    };
    let fail = |code: &str, message: &str, retryable: bool| {
        Outcome::Fail(Failure {
            code: code.into(),
            message: message.into(),
            retryable,
        })
    };
    let (c1, c2, c3, c4, c5) = (
        calls.clone(),
        calls.clone(),
        calls.clone(),
        calls.clone(),
        calls.clone(),
    );
    let worker = start_worker(
        Worker::new(worker_options(&d.url, "w-retry"))
            .function(
                FunctionSpec::new("flaky")
                    .delivery(Delivery::AtLeastOnce)
                    .max_attempts(3),
                move |ctx: InvocationCtx| {
                    record(&c1, &ctx);
                    async move {
                        if ctx.invoke.attempt == 1 {
                            fail("busy", "try again", true)
                        } else {
                            Outcome::Complete(json!({ "attempt": ctx.invoke.attempt }))
                        }
                    }
                },
            )
            .function(
                FunctionSpec::new("always-busy")
                    .delivery(Delivery::AtLeastOnce)
                    .max_attempts(2),
                move |ctx: InvocationCtx| {
                    record(&c2, &ctx);
                    async move { fail("busy", "still busy", true) }
                },
            )
            .function(
                FunctionSpec::new("broken")
                    .delivery(Delivery::AtLeastOnce)
                    .max_attempts(3),
                move |ctx: InvocationCtx| {
                    record(&c3, &ctx);
                    async move { fail("bad_input", "nope", false) }
                },
            )
            // at_most_once: max_attempts defaults to 1, which also bounds retries.
            .function(FunctionSpec::new("once-busy"), move |ctx: InvocationCtx| {
                record(&c4, &ctx);
                async move { fail("busy", "once", true) }
            })
            .function(FunctionSpec::new("ok"), |_ctx: InvocationCtx| async move {
                Outcome::Complete(json!("ok"))
            })
            // A retry in the middle of a multi-step turn re-runs that step, with that
            // step's input.
            .function(
                FunctionSpec::new("step-flaky").delivery(Delivery::AtLeastOnce),
                move |ctx: InvocationCtx| {
                    record(&c5, &ctx);
                    async move {
                        match (ctx.invoke.step, ctx.invoke.attempt) {
                            (0, _) => Outcome::Continue(json!({"s": 1})),
                            (1, 1) => fail("busy", "step 1 busy", true),
                            _ => Outcome::Complete(ctx.invoke.input.clone()),
                        }
                    }
                },
            ),
    )
    .await;
    let c = d.caller().await?;
    let mut watch = c
        .watch(WatchArgs {
            session_id: Some("s-flaky".into()),
            turn_id: None,
            after: None,
            progress: false,
        })
        .await?;
    let flaky = c.submit_simple("s-flaky", "flaky", json!({})).await?;
    // Queued behind a turn that is backing off: the lock is held through the backoff.
    let behind = c.submit_simple("s-flaky", "ok", json!({})).await?;
    let busy = c.submit_simple("s-busy", "always-busy", json!({})).await?;
    let broken = c.submit_simple("s-broken", "broken", json!({})).await?;
    let once = c.submit_simple("s-once", "once-busy", json!({})).await?;
    let stepped = c
        .submit_simple("s-step-flaky", "step-flaky", json!({"s": 0}))
        .await?;

    // The backoff is visible while it lasts.
    let scheduled = loop {
        let e = tokio::time::timeout(Duration::from_secs(5), watch.next())
            .await
            .context("no retry_scheduled event")?
            .context("watch ended")?;
        if e.kind == EventKind::RetryScheduled {
            break e;
        }
    };
    let backing = c.get(&flaky.turn_id).await?;
    assert_eq!(backing.status, TurnStatus::Running, "{backing:?}");
    let wait = backing.wait.context("a non-terminal turn has a wait")?;
    assert_eq!(wait.state, WaitState::BackingOff, "{wait:?}");
    assert_eq!(wait.on_deadline, Some(OnDeadline::Retry));
    assert_eq!(wait.deadline_ms, scheduled.detail["retry_at_ms"].as_u64());
    assert!(wait.last_error.is_some_and(|e| e.contains("try again")));
    let held = c.get(&behind.turn_id).await?;
    assert_eq!(held.status, TurnStatus::Queued, "{held:?}");
    assert_eq!(held.wait.map(|w| w.state), Some(WaitState::QueuedBehind));

    let done = wait_done(&c, &flaky.turn_id, 10).await?;
    assert_eq!(done.status, TurnStatus::Completed, "{done:?}");
    assert_eq!(done.attempt, 2);
    assert_eq!(done.output, Some(json!({"attempt": 2})));
    let events = all_events(&c, "s-flaky").await?;
    use EventKind::*;
    assert_eq!(
        event_kinds(&events, &flaky.turn_id),
        vec![
            Admitted,
            Dispatched,
            Result,
            RetryScheduled,
            Dispatched,
            Result,
            Completed
        ]
    );
    assert_eq!(
        wait_done(&c, &behind.turn_id, 10).await?.status,
        TurnStatus::Completed
    );
    let events = all_events(&c, "s-flaky").await?;
    let order = vec![flaky.turn_id.clone(), behind.turn_id.clone()];
    assert_eq!(turns_by_event(&events, Completed), order);
    let first_of = |kind: EventKind, turn: &str| {
        events
            .iter()
            .position(|e| e.kind == kind && e.turn_id == turn)
    };
    assert!(
        first_of(Completed, &flaky.turn_id) < first_of(Dispatched, &behind.turn_id),
        "the turn behind ran during the backoff: {events:?}"
    );

    let calls_of = |f: &str| {
        calls
            .lock()
            .expect("calls")
            .get(f)
            .cloned()
            .unwrap_or_default()
    };

    let done = wait_done(&c, &busy.turn_id, 10).await?;
    assert_eq!(done.status, TurnStatus::Failed, "{done:?}");
    let e = done.error.context("error")?;
    assert_eq!(e.cause, ErrorCause::AttemptsExhausted);
    assert_eq!(e.code, "busy");
    assert!(e.message.contains("still busy"), "{e:?}");
    let ran = calls_of("always-busy");
    assert_eq!(ran.iter().map(|r| r.2).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(e.invocation_id.as_ref(), ran.last().map(|r| &r.0));

    let done = wait_done(&c, &broken.turn_id, 10).await?;
    assert_eq!(done.status, TurnStatus::Failed, "{done:?}");
    let e = done.error.context("error")?;
    assert_eq!(e.cause, ErrorCause::HandlerFailed);
    assert_eq!(
        (e.code.as_str(), e.message.as_str(), e.step),
        ("bad_input", "nope", 0)
    );
    let ran = calls_of("broken");
    assert_eq!(
        ran.len(),
        1,
        "a non-retryable failure is not retried: {ran:?}"
    );
    assert_eq!(e.invocation_id.as_ref(), Some(&ran[0].0));
    assert_eq!(done.attempt, 1);

    let done = wait_done(&c, &once.turn_id, 10).await?;
    assert_eq!(done.status, TurnStatus::Failed, "{done:?}");
    let e = done.error.context("error")?;
    assert_eq!(e.cause, ErrorCause::AttemptsExhausted);
    assert_eq!(calls_of("once-busy").len(), 1);
    let once_events = all_events(&c, "s-once").await?;
    assert!(!event_kinds(&once_events, &once.turn_id).contains(&RetryScheduled));

    let done = wait_done(&c, &stepped.turn_id, 10).await?;
    assert_eq!(done.status, TurnStatus::Completed, "{done:?}");
    assert_eq!((done.step, done.attempt), (1, 2));
    assert_eq!(
        done.output,
        Some(json!({"s": 1})),
        "the retry got step 1's input"
    );
    let steps: Vec<(u32, u32)> = calls_of("step-flaky").iter().map(|r| (r.1, r.2)).collect();
    assert_eq!(steps, vec![(0, 1), (1, 1), (1, 2)]);

    // The wire shape of terminal turns: `error` (with every member) only on the
    // failed one, `output` only on the completed one, no `wait` on either.
    let (mut raw, _) = Raw::hello(&d.url, "client", json!({})).await?;
    let failed = raw
        .ok("turn.get", json!({"turn_id": broken.turn_id}))
        .await?;
    let failed = &failed["turn"];
    assert_eq!(failed["status"], "failed", "{failed}");
    assert_eq!(failed["error"]["cause"], "handler_failed", "{failed}");
    assert_eq!(failed["error"]["code"], "bad_input");
    assert_eq!(failed["error"]["message"], "nope");
    assert_eq!(failed["error"]["step"], 0);
    assert_eq!(
        failed["error"]["invocation_id"],
        json!(calls_of("broken")[0].0)
    );
    assert!(failed["finished_at_ms"].as_u64().is_some(), "{failed}");
    assert!(
        failed.get("output").is_none() && failed.get("wait").is_none(),
        "{failed}"
    );
    let completed = raw
        .ok("turn.get", json!({"turn_id": flaky.turn_id}))
        .await?;
    let completed = &completed["turn"];
    assert_eq!(completed["output"], json!({"attempt": 2}), "{completed}");
    assert!(completed.get("error").is_none() && completed.get("wait").is_none());
    assert_eq!(completed["recovered"], json!(false));

    assert_store_healthy(&d.url).await?;
    worker.shutdown();
    d.shutdown().await
}

// ------------------------------------------------------------------- 5. idempotency

/// Resubmitting with the same key returns the same turn (`deduplicated: true`), also
/// after it completed; the same key with another input or function is a `conflict`;
/// the same key in another session is independent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_resubmission_dedups_conflicts_and_is_per_session() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let c = d.caller().await?;
    let first = c
        .submit(submit_args(
            "s-idem",
            "echo",
            json!({"m": 1}),
            Some("msg-1"),
        ))
        .await?;
    assert!(!first.deduplicated);
    let again = c
        .submit(submit_args(
            "s-idem",
            "echo",
            json!({"m": 1}),
            Some("msg-1"),
        ))
        .await?;
    assert!(again.deduplicated);
    assert_eq!(again.turn.turn_id, first.turn.turn_id);
    assert_eq!(again.turn.seq, first.turn.seq);

    for (function, input) in [("echo", json!({"m": 2})), ("other", json!({"m": 1}))] {
        let e = c
            .submit(submit_args("s-idem", function, input, Some("msg-1")))
            .await
            .expect_err("same key, different request");
        assert_eq!(e.code(), Some(ErrorCode::Conflict), "{e}");
    }

    let elsewhere = c
        .submit(submit_args(
            "s-idem-2",
            "echo",
            json!({"m": 9}),
            Some("msg-1"),
        ))
        .await?;
    assert!(!elsewhere.deduplicated);
    assert_ne!(elsewhere.turn.turn_id, first.turn.turn_id);
    assert_eq!(elsewhere.turn.input, json!({"m": 9}));

    // Only one turn was admitted to s-idem, and it runs once.
    let listed = c.list(list_args("s-idem", None, None, None)).await?;
    assert_eq!(listed.turns.len(), 1, "{listed:?}");
    let worker = echo_worker(&d.url, "w-idem", 1).await;
    let done = wait_done(&c, &first.turn.turn_id, 10).await?;
    assert_eq!(done.output, Some(json!({"m": 1})));
    let after = c
        .submit(submit_args(
            "s-idem",
            "echo",
            json!({"m": 1}),
            Some("msg-1"),
        ))
        .await?;
    assert!(after.deduplicated);
    assert_eq!(
        after.turn.status,
        TurnStatus::Completed,
        "returns the turn as it is now"
    );
    assert_eq!(after.turn.turn_id, first.turn.turn_id);
    let events = all_events(&c, "s-idem").await?;
    assert_eq!(turns_by_event(&events, EventKind::Admitted).len(), 1);
    assert_eq!(turns_by_event(&events, EventKind::Dispatched).len(), 1);

    // A different key is a different turn.
    let other = c
        .submit(submit_args(
            "s-idem",
            "echo",
            json!({"m": 1}),
            Some("msg-2"),
        ))
        .await?;
    assert!(!other.deduplicated);
    assert_eq!(other.turn.seq, 2);
    worker.shutdown();
    d.shutdown().await
}

// ------------------------------------------------------------ 6. protocol errors

/// Frames that are not requests get `bad_frame` (id null, or echoed when readable),
/// before and after `hello`, and the connection stays usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_get_bad_frame_with_null_or_echoed_id() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let cases = || {
        let null = Value::Null;
        vec![
            (Message::text("{not json"), null.clone()),
            (Message::text("[1, 2, 3]"), null.clone()),
            (Message::text("\"ping\""), null.clone()),
            (Message::text(r#"{"op": "ping"}"#), null.clone()),
            (Message::text(r#"{"id": "7", "op": "ping"}"#), null.clone()),
            (Message::text(r#"{"id": -1, "op": "ping"}"#), null.clone()),
            (Message::text(r#"{"id": 7}"#), json!(7)),
            (Message::text(r#"{"id": 8, "op": 5}"#), json!(8)),
            (
                Message::text(r#"{"id": 9, "op": "ping", "args": [1]}"#),
                json!(9),
            ),
            (
                Message::binary(br#"{"id":10,"op":"ping"}"#.to_vec()),
                null.clone(),
            ),
            // A member given twice is ambiguous; text after the object is not JSON.
            (
                Message::text(r#"{"id": 11, "id": 12, "op": "ping"}"#),
                null.clone(),
            ),
            (Message::text(r#"{"id": 13, "op": "ping"} x"#), null.clone()),
            (
                Message::text(r#"{"id": 14, "op": "ping", "op": "ping"}"#),
                null.clone(),
            ),
            // JSON a parser refuses is refused wherever it is, even where nothing reads it.
            (
                Message::text(r#"{"id": 15, "op": "ping", "args": {"x": "\ud800"}}"#),
                null.clone(),
            ),
        ]
    };
    // Before hello: each is a bad frame; hello still works afterwards.
    let mut raw = Raw::connect(&d.url).await?;
    for (m, id) in cases() {
        expect_bad_frame(&mut raw, m, id).await?;
    }
    let hello = raw
        .request("hello", json!({"protocol": 1, "role": "client"}))
        .await?;
    assert!(hello.get("ok").is_some(), "{hello}");
    // After hello: the same, each followed by a working ping.
    for (m, id) in cases() {
        expect_bad_frame(&mut raw, m, id).await?;
        ping_ok(&mut raw).await?;
    }
    // The edges of a valid id are echoed; absent or null `args` mean `{}` and unknown
    // members of `args` or of the envelope are ignored.
    for (frame, id) in [
        (r#"{"id": 0, "op": "ping"}"#, json!(0)),
        (
            r#"{"id": 18446744073709551615, "op": "ping"}"#,
            json!(u64::MAX),
        ),
        (r#"{"id": 5, "op": "stats", "args": null}"#, json!(5)),
        (
            r#"{"id": 6, "op": "ping", "args": {"bogus": 1}, "extra": true}"#,
            json!(6),
        ),
        (r#"{"id": 7, "op": "p\u0069ng", "args": {}}"#, json!(7)),
    ] {
        raw.send_text(frame).await?;
        let f = next_response(&mut raw).await?;
        assert_eq!(f.get("id"), Some(&id), "{frame} -> {f}");
        assert!(f.get("ok").is_some(), "{frame} -> {f}");
    }
    let ok = raw
        .ok(
            "turn.submit",
            json!({"session_id": "s-extra", "function_id": "f", "input": 1, "colour": "red"}),
        )
        .await?;
    assert_eq!(ok.pointer("/turn/seq"), Some(&json!(1)), "{ok}");
    // A member of `args` given twice is `bad_request`, and nothing is submitted.
    raw.send_text(
        r#"{"id": 20, "op": "turn.submit", "args": {"session_id": "s-dup", "session_id": "s-other", "function_id": "f"}}"#,
    )
    .await?;
    let f = next_response(&mut raw).await?;
    check_error(&f, &json!(20), "bad_request")?;
    assert!(
        f.pointer("/error/message")
            .and_then(Value::as_str)
            .is_some_and(|m| m.contains("duplicate")),
        "{f}"
    );
    for s in ["s-dup", "s-other"] {
        assert_eq!(
            raw.error_code("session.inspect", json!({"session_id": s}))
                .await?,
            "not_found"
        );
    }
    d.shutdown().await
}

/// 16 bad frames in a row close the connection with 1008; a good frame in between
/// resets the count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_bad_frames_in_a_row_close_with_1008() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let (mut raw, _) = Raw::hello(&d.url, "client", json!({})).await?;
    for _ in 0..15 {
        expect_bad_frame(&mut raw, Message::text("nope"), Value::Null).await?;
    }
    ping_ok(&mut raw).await?;
    for _ in 0..15 {
        expect_bad_frame(&mut raw, Message::text("nope"), Value::Null).await?;
    }
    ping_ok(&mut raw).await?;
    for _ in 0..16 {
        raw.send_text("nope").await?;
    }
    let (codes, close) = read_until_close(&mut raw).await?;
    assert_eq!(codes, vec!["bad_frame"; 16]);
    assert_eq!(close, Some(1008));
    d.shutdown().await
}

/// `hello` errors: ops before hello are `not_authenticated` and not executed;
/// protocol 2 is `unsupported_protocol`; a malformed hello is `bad_request`; a second
/// hello is a `conflict`. After each the connection still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_errors_leave_the_connection_usable() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let mut raw = Raw::connect(&d.url).await?;
    let before = [
        ("ping", json!({})),
        (
            "turn.submit",
            json!({"session_id": "s-pre", "function_id": "echo", "input": 1}),
        ),
        ("no.such.op", json!({})),
        ("store.check", json!({})),
    ];
    for (op, args) in before {
        let f = raw.request(op, args).await?;
        let id = f["id"].clone();
        check_error(&f, &id, "not_authenticated").with_context(|| op.to_string())?;
    }
    for (args, code) in [
        (
            json!({"protocol": 2, "role": "client"}),
            "unsupported_protocol",
        ),
        (
            json!({"protocol": 0, "role": "client"}),
            "unsupported_protocol",
        ),
        (json!({"role": "client"}), "bad_request"),
        (json!({"protocol": 1}), "bad_request"),
        (json!({"protocol": 1, "role": "superuser"}), "bad_request"),
        (json!({"protocol": "1", "role": "client"}), "bad_request"),
        (json!({"protocol": 1, "role": "worker"}), "bad_request"),
    ] {
        let f = raw.request("hello", args.clone()).await?;
        let id = f["id"].clone();
        check_error(&f, &id, code).with_context(|| args.to_string())?;
    }
    let ok = raw
        .ok(
            "hello",
            json!({"protocol": 1, "role": "client", "token": "any"}),
        )
        .await?;
    for k in [
        "server",
        "version",
        "boot_id",
        "connection_id",
        "heartbeat_ms",
        "max_frame_bytes",
    ] {
        assert!(ok.get(k).is_some(), "hello ok lacks {k}: {ok}");
    }
    assert!(
        ok.get("reconciled").is_none(),
        "reconciled is for workers: {ok}"
    );
    assert_eq!(
        ok["heartbeat_ms"],
        json!(1000),
        "the configured heartbeat: {ok}"
    );
    assert_eq!(ok["max_frame_bytes"], json!(1024 * 1024), "{ok}");
    expect_code(
        &mut raw,
        "hello",
        json!({"protocol": 1, "role": "client"}),
        "conflict",
    )
    .await?;
    expect_code(
        &mut raw,
        "hello",
        json!({"protocol": 1, "role": "operator"}),
        "conflict",
    )
    .await?;
    // Still a client: the second hello did not make it an operator.
    expect_code(&mut raw, "store.check", json!({}), "forbidden").await?;
    // The submit before hello was not executed.
    expect_code(
        &mut raw,
        "session.inspect",
        json!({"session_id": "s-pre"}),
        "not_found",
    )
    .await?;
    d.shutdown().await
}

/// With tokens configured, a wrong or missing token, or a token of another role, is
/// `not_authenticated`; the same connection can then say hello with the right token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_token_is_not_authenticated() -> Result<()> {
    let d = TestDaemon::start(|c| {
        c.auth.tokens = vec![TokenConfig {
            role: Role::Client,
            token: "client-secret-1".into(),
        }]
    })
    .await?;
    let mut raw = Raw::connect(&d.url).await?;
    for args in [
        json!({"protocol": 1, "role": "client", "token": "client-secret-2"}),
        json!({"protocol": 1, "role": "client"}),
        json!({"protocol": 1, "role": "client", "token": ""}),
        json!({"protocol": 1, "role": "operator", "token": "client-secret-1"}),
        json!({"protocol": 1, "role": "worker", "token": "client-secret-1", "worker_id": "w-tok"}),
    ] {
        let f = raw.request("hello", args.clone()).await?;
        let id = f["id"].clone();
        check_error(&f, &id, "not_authenticated").with_context(|| args.to_string())?;
        let f = raw.request("ping", json!({})).await?;
        let id = f["id"].clone();
        check_error(&f, &id, "not_authenticated").context("still unauthenticated")?;
    }
    raw.ok(
        "hello",
        json!({"protocol": 1, "role": "client", "token": "client-secret-1"}),
    )
    .await?;
    ping_ok(&mut raw).await?;
    expect_code(
        &mut raw,
        "turn.get",
        json!({"turn_id": "t_none"}),
        "not_found",
    )
    .await?;

    // The SDK sees the same.
    let e = Caller::connect(&d.url, Some("nope-nope-nope"))
        .await
        .expect_err("wrong token");
    assert_eq!(e.code(), Some(ErrorCode::NotAuthenticated), "{e}");
    let c = Caller::connect(&d.url, Some("client-secret-1")).await?;
    c.ping().await?;
    assert!(
        c.workers().await?.is_empty(),
        "the refused worker never attached"
    );
    d.shutdown().await
}

/// Each role may only use its ops: `forbidden` otherwise, and nothing happens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ops_outside_the_role_are_forbidden() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let (mut w, _) = Raw::hello(&d.url, "worker", json!({"worker_id": "w-forbid"})).await?;
    for (op, args) in [
        (
            "turn.submit",
            json!({"session_id": "s-forbid", "function_id": "f", "input": 1}),
        ),
        ("turn.get", json!({"turn_id": "t_x"})),
        ("session.inspect", json!({"session_id": "s-forbid"})),
        ("watch", json!({"session_id": "s-forbid"})),
        ("stats", json!({})),
        ("store.check", json!({})),
    ] {
        expect_code(&mut w, op, args, "forbidden").await?;
    }
    let (mut c, _) = Raw::hello(&d.url, "client", json!({})).await?;
    for (op, args) in [
        ("function.register", json!({"function_id": "f"})),
        ("function.unregister", json!({"function_id": "f"})),
        (
            "invocation.result",
            json!({"invocation_id": "inv_x", "outcome": {"complete": 1}}),
        ),
        ("invocation.heartbeat", json!({"invocation_id": "inv_x"})),
        (
            "invocation.status",
            json!({"invocation_id": "inv_x", "state": "running"}),
        ),
        ("store.check", json!({})),
    ] {
        expect_code(&mut c, op, args, "forbidden").await?;
    }
    // The worker's submit did not happen, and the client registered nothing.
    expect_code(
        &mut c,
        "session.inspect",
        json!({"session_id": "s-forbid"}),
        "not_found",
    )
    .await?;
    let functions = c.ok("functions.list", json!({})).await?;
    assert_eq!(functions["functions"], json!([]), "{functions}");
    let (mut op, _) = Raw::hello(&d.url, "operator", json!({})).await?;
    let check = op.ok("store.check", json!({})).await?;
    assert_eq!(check, json!({"violations": []}));
    d.shutdown().await
}

/// `bad_request`, `unknown_op` and `not_found` for each op that can produce them, on
/// one connection that keeps working throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_request_unknown_op_and_not_found() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let (mut c, _) = Raw::hello(&d.url, "client", json!({})).await?;
    let t = c
        .ok(
            "turn.submit",
            json!({"session_id": "s-err", "function_id": "nobody", "input": {}}),
        )
        .await?;
    let tid = t["turn"]["turn_id"].clone();
    let long = "s".repeat(300);
    for (op, args) in [
        ("turn.submit", json!({})),
        ("turn.submit", json!({"function_id": "f", "input": 1})),
        ("turn.submit", json!({"session_id": "s-err", "input": 1})),
        ("turn.submit", json!({"session_id": 5, "function_id": "f"})),
        ("turn.submit", json!({"session_id": "", "function_id": "f"})),
        (
            "turn.submit",
            json!({"session_id": long, "function_id": "f"}),
        ),
        (
            "turn.submit",
            json!({"session_id": "s-err", "function_id": "f", "idempotency_key": 3}),
        ),
        (
            "turn.submit",
            json!({"session_id": "s-err", "function_id": "f", "turn_timeout_ms": 0}),
        ),
        (
            "turn.submit",
            json!({"session_id": "s-err", "function_id": "f", "turn_timeout_ms": -5}),
        ),
        ("turn.get", json!({})),
        ("turn.get", json!({"turn_id": 17})),
        ("turn.wait", json!({"turn_id": tid, "timeout_ms": 400000})),
        ("turn.wait", json!({"turn_id": tid, "timeout_ms": 300001})),
        ("turn.wait", json!({"turn_id": tid, "timeout_ms": "soon"})),
        ("turn.stop", json!({"reason": "x"})),
        ("turn.list", json!({})),
        ("turn.list", json!({"session_id": "s-err", "limit": 0})),
        ("turn.list", json!({"session_id": "s-err", "limit": 1001})),
        (
            "turn.list",
            json!({"session_id": "s-err", "status": "sleeping"}),
        ),
        (
            "turn.list",
            json!({"session_id": "s-err", "before_seq": "x"}),
        ),
        ("session.inspect", json!({})),
        ("session.events", json!({"session_id": "s-err", "limit": 0})),
        (
            "session.events",
            json!({"session_id": "s-err", "limit": 1001}),
        ),
        (
            "session.events",
            json!({"session_id": "s-err", "after": -1}),
        ),
        ("session.stop", json!({})),
        ("watch", json!({})),
        ("watch", json!({"session_id": "s-err", "turn_id": tid})),
        ("unwatch", json!({})),
    ] {
        expect_code(&mut c, op, args, "bad_request").await?;
    }
    for op in ["turn.explode", "", "TURN.GET", "hello.again"] {
        expect_code(&mut c, op, json!({}), "unknown_op").await?;
    }
    for (op, args) in [
        ("turn.get", json!({"turn_id": "t_missing"})),
        (
            "turn.wait",
            json!({"turn_id": "t_missing", "timeout_ms": 10}),
        ),
        ("turn.stop", json!({"turn_id": "t_missing", "reason": "x"})),
        ("session.inspect", json!({"session_id": "s-missing"})),
        ("session.events", json!({"session_id": "s-missing"})),
        (
            "session.stop",
            json!({"session_id": "s-missing", "reason": "x"}),
        ),
        ("watch", json!({"turn_id": "t_missing"})),
        ("unwatch", json!({"watch_id": "w_missing"})),
    ] {
        expect_code(&mut c, op, args, "not_found").await?;
    }
    // A watch belongs to its connection: another connection cannot remove it.
    let watch = c.ok("watch", json!({"session_id": "s-err"})).await?;
    let (mut other, _) = Raw::hello(&d.url, "client", json!({})).await?;
    let wid = watch["watch_id"].clone();
    expect_code(&mut other, "unwatch", json!({"watch_id": wid}), "not_found").await?;
    assert_eq!(c.ok("unwatch", json!({"watch_id": wid})).await?, json!({}));
    expect_code(&mut c, "unwatch", json!({"watch_id": wid}), "not_found").await?;

    // Worker-side errors.
    let (mut w, _) = Raw::hello(&d.url, "worker", json!({"worker_id": "w-err"})).await?;
    for args in [
        json!({}),
        json!({"function_id": "f", "concurrency": 0}),
        json!({"function_id": "f", "concurrency": "many"}),
        json!({"function_id": "f", "timeout_ms": 0}),
        json!({"function_id": "f", "delivery": "sometimes"}),
        json!({"function_id": "f", "max_attempts": 0}),
    ] {
        expect_code(&mut w, "function.register", args, "bad_request").await?;
    }
    expect_code(
        &mut w,
        "invocation.result",
        json!({"invocation_id": "inv_x"}),
        "bad_request",
    )
    .await?;
    expect_code(
        &mut w,
        "invocation.result",
        json!({"invocation_id": "inv_x", "outcome": {"exploded": 1}}),
        "bad_request",
    )
    .await?;
    expect_code(
        &mut w,
        "invocation.status",
        json!({"invocation_id": "inv_x", "state": "dreaming"}),
        "bad_request",
    )
    .await?;
    expect_code(
        &mut w,
        "function.unregister",
        json!({"function_id": "f"}),
        "not_found",
    )
    .await?;
    expect_code(
        &mut w,
        "invocation.heartbeat",
        json!({"invocation_id": "inv_x"}),
        "not_found",
    )
    .await?;
    expect_code(
        &mut w,
        "invocation.status",
        json!({"invocation_id": "inv_x", "state": "running"}),
        "not_found",
    )
    .await?;
    // None of the refused requests changed anything: one turn, still waiting.
    let caller = d.caller().await?;
    let s = caller.inspect("s-err").await?;
    assert_eq!(s.turns.queued, 1, "{s:?}");
    let functions = caller.functions().await?;
    assert!(functions.iter().all(|f| f.workers == 0), "{functions:?}");
    assert_store_healthy(&d.url).await?;
    d.shutdown().await
}

/// An `input` over `turns.max_value_bytes` is `too_large` and creates nothing (no
/// turn, no seq, no idempotency record); one under the limit is admitted. A step
/// result over the limit fails the turn with `invalid_result`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_large_input_is_refused_and_creates_no_turn() -> Result<()> {
    let d = TestDaemon::start(|c| c.turns.max_value_bytes = 1024).await?;
    let (mut raw, _) = Raw::hello(&d.url, "client", json!({})).await?;
    let big = "x".repeat(2000);
    expect_code(
        &mut raw,
        "turn.submit",
        json!({"session_id": "s-big", "function_id": "echo", "input": {"blob": big},
               "idempotency_key": "k-big"}),
        "too_large",
    )
    .await?;
    expect_code(
        &mut raw,
        "session.inspect",
        json!({"session_id": "s-big"}),
        "not_found",
    )
    .await?;
    let listed = raw.ok("turn.list", json!({"session_id": "s-big"})).await?;
    assert_eq!(listed["turns"], json!([]), "{listed}");

    // The limit is inclusive: a JSON string of 1023 characters (1025 bytes with its
    // quotes) is refused, one of 1022 (exactly 1024 bytes) is admitted as seq 1, and
    // the key the refused submits named was never recorded.
    expect_code(
        &mut raw,
        "turn.submit",
        json!({"session_id": "s-big", "function_id": "echo", "input": "y".repeat(1023),
               "idempotency_key": "k-big"}),
        "too_large",
    )
    .await?;
    let fits = "y".repeat(1022);
    let ok = raw
        .ok(
            "turn.submit",
            json!({"session_id": "s-big", "function_id": "echo", "input": fits,
                   "idempotency_key": "k-big"}),
        )
        .await?;
    assert_eq!(ok["deduplicated"], json!(false), "{ok}");
    assert_eq!(ok["turn"]["seq"], json!(1), "{ok}");

    let worker = start_worker(Worker::new(worker_options(&d.url, "w-big")).function(
        FunctionSpec::new("inflate"),
        |_ctx: InvocationCtx| async move { Outcome::Complete(json!("z".repeat(4000))) },
    ))
    .await;
    let c = d.caller().await?;
    let t = c.submit_simple("s-inflate", "inflate", json!({})).await?;
    let done = wait_done(&c, &t.turn_id, 10).await?;
    assert_eq!(done.status, TurnStatus::Failed, "{done:?}");
    assert_eq!(done.error.map(|e| e.cause), Some(ErrorCause::InvalidResult));
    assert!(done.output.is_none());
    worker.shutdown();
    d.shutdown().await
}

/// Limits answer `rate_limited` (retryable) and change nothing: a session holding
/// `max_queued_per_session` unfinished turns refuses more (other sessions and
/// deduplicated resubmits are unaffected, and it accepts again once turns finish); a
/// connection holding `max_watches_per_connection` watches refuses another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_answer_rate_limited_and_change_nothing() -> Result<()> {
    let d = TestDaemon::start(|c| {
        c.turns.max_queued_per_session = 3;
        c.server.max_watches_per_connection = 2;
    })
    .await?;
    let (mut raw, _) = Raw::hello(&d.url, "client", json!({})).await?;
    let submit = |s: &str, k: u64| {
        json!({"session_id": s, "function_id": "echo", "input": {"k": k},
               "idempotency_key": format!("key-{k}")})
    };
    let mut ids = Vec::new();
    for k in 1..=3 {
        let ok = raw.ok("turn.submit", submit("s-full", k)).await?;
        ids.push(ok["turn"]["turn_id"].clone());
    }
    let f = raw.request("turn.submit", submit("s-full", 4)).await?;
    assert_eq!(
        f.pointer("/error/code"),
        Some(&json!("rate_limited")),
        "{f}"
    );
    assert_eq!(f.pointer("/error/retryable"), Some(&json!(true)), "{f}");
    ping_ok(&mut raw).await?;
    // A resubmit of an admitted turn is still answered; another session is free.
    let again = raw.ok("turn.submit", submit("s-full", 2)).await?;
    assert_eq!(again["deduplicated"], json!(true));
    assert_eq!(again["turn"]["turn_id"], ids[1]);
    raw.ok("turn.submit", submit("s-not-full", 4)).await?;
    let listed = raw.ok("turn.list", json!({"session_id": "s-full"})).await?;
    assert_eq!(
        listed["turns"].as_array().map(Vec::len),
        Some(3),
        "{listed}"
    );

    for s in ["s-full", "s-not-full"] {
        raw.ok("watch", json!({ "session_id": s })).await?;
    }
    let f = raw
        .request("watch", json!({"session_id": "s-other"}))
        .await?;
    assert_eq!(
        f.pointer("/error/code"),
        Some(&json!("rate_limited")),
        "{f}"
    );
    assert_eq!(f.pointer("/error/retryable"), Some(&json!(true)), "{f}");
    ping_ok(&mut raw).await?;

    let worker = echo_worker(&d.url, "w-full", 1).await;
    let c = d.caller().await?;
    for id in &ids {
        wait_done(&c, id.as_str().context("turn id")?, 10).await?;
    }
    // The refused key-4 was never recorded for s-full: it is a new turn now.
    let ok = raw.ok("turn.submit", submit("s-full", 4)).await?;
    assert_eq!(ok["deduplicated"], json!(false), "{ok}");
    assert_eq!(ok.pointer("/turn/seq"), Some(&json!(4)), "{ok}");
    worker.shutdown();
    d.shutdown().await
}

/// The same idempotency key submitted many times at once admits exactly one turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_resubmissions_admit_one_turn() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let callers = [d.caller().await?, d.caller().await?];
    let answers = futures_util::future::join_all((0..16).map(|i| {
        callers[i % 2].submit(submit_args("s-race", "echo", json!({"m": 1}), Some("once")))
    }))
    .await;
    let answers = answers.into_iter().collect::<Result<Vec<_>, _>>()?;
    let fresh = answers.iter().filter(|a| !a.deduplicated).count();
    assert_eq!(fresh, 1, "exactly one submit admits the turn");
    let first = &answers[0].turn.turn_id;
    assert!(answers.iter().all(|a| &a.turn.turn_id == first));
    let listed = callers[0]
        .list(list_args("s-race", None, None, None))
        .await?;
    assert_eq!(listed.turns.len(), 1);
    d.shutdown().await
}

// ------------------------------------------------------------------ 7. restart

/// Submit 10 turns across two sessions with no worker, stop the real binary (SIGTERM
/// or SIGKILL), start it again on the same data dir: every acknowledged turn is there,
/// still queued in order; a worker then finishes them in admission order and
/// `store.check` is clean.
async fn restart_keeps_queued_turns_and_runs_them_in_order(kill: bool) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let env = [("TURND_LOG", "warn")];
    let d = BinDaemon::start(&data, &env).await?;
    let c = Caller::connect(&d.url, None).await?;
    // Sessions with only finished turns, whose ids sort between and after the
    // sessions with queued turns: recovery walks the session metas alongside the
    // active index and must count these too.
    let finished_sessions = ["s-restart-1a-done", "s-restart-9-done"];
    let early = echo_worker(&d.url, "w-before-restart", 1).await;
    for s in finished_sessions {
        let t = c
            .submit(submit_args(s, "echo", json!({ "s": s }), None))
            .await?
            .turn;
        assert_eq!(
            wait_done(&c, &t.turn_id, 20).await?.status,
            TurnStatus::Completed
        );
    }
    early.shutdown();
    early.join().await?;
    let sessions = ["s-restart-1", "s-restart-2"];
    let mut admitted: HashMap<&str, Vec<Turn>> = HashMap::new();
    for i in 0..10u64 {
        let s = sessions[(i % 2) as usize];
        let key = format!("k-{i}");
        let t = c
            .submit(submit_args(s, "echo", json!({ "i": i }), Some(&key)))
            .await?
            .turn;
        admitted.entry(s).or_default().push(t);
    }
    drop(c);
    if kill {
        d.kill().await?;
    } else {
        let status = d.terminate().await?;
        assert!(status.success(), "graceful shutdown exits 0: {status:?}");
    }

    let d = BinDaemon::start(&data, &env).await?;
    let c = Caller::connect(&d.url, None).await?;
    for s in sessions {
        let turns = &admitted[s];
        for (k, t) in turns.iter().enumerate() {
            let now = c.get(&t.turn_id).await?;
            assert_eq!(now.status, TurnStatus::Queued, "{now:?}");
            assert_eq!((now.seq, &now.input), (k as u64 + 1, &t.input));
            let wait = now.wait.context("a queued turn has a wait")?;
            let want = if k == 0 {
                WaitState::AwaitingWorker
            } else {
                WaitState::QueuedBehind
            };
            assert_eq!(wait.state, want, "{s} turn {k}: {wait:?}");
            if k > 0 {
                assert_eq!(wait.ahead, Some(k as u64), "{s} turn {k}: {wait:?}");
            }
        }
        let session = c.inspect(s).await?;
        assert_eq!(
            session.lock.map(|l| l.turn_id),
            Some(turns[0].turn_id.clone())
        );
        let queued: Vec<String> = session.queued.iter().map(|q| q.turn_id.clone()).collect();
        let want: Vec<String> = turns[1..].iter().map(|t| t.turn_id.clone()).collect();
        assert_eq!(queued, want, "{s}: queue order survives the restart");
        assert_eq!(session.turns.queued, 5);
    }
    let stats = c.stats().await?;
    assert_eq!(stats.turns.queued, 10, "{stats:?}");
    assert_eq!(stats.turns.completed, 2, "{stats:?}");
    assert_eq!(stats.sessions.active, 2, "{stats:?}");
    assert_eq!(
        stats.sessions.blocked.get("awaiting_worker"),
        Some(&2),
        "{stats:?}"
    );

    let worker = echo_worker(&d.url, "w-restart", 2).await;
    for s in sessions {
        let turns = &admitted[s];
        for t in turns {
            let done = wait_done(&c, &t.turn_id, 20).await?;
            assert_eq!(done.status, TurnStatus::Completed, "{done:?}");
            assert_eq!(done.output, Some(t.input.clone()));
        }
        let order: Vec<String> = turns.iter().map(|t| t.turn_id.clone()).collect();
        let events = all_events(&c, s).await?;
        assert_eq!(turns_by_event(&events, EventKind::Admitted), order);
        assert_eq!(turns_by_event(&events, EventKind::Dispatched), order);
        assert_eq!(turns_by_event(&events, EventKind::Completed), order);
        let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
        let mut finished = Vec::new();
        for t in turns {
            finished.push(c.get(&t.turn_id).await?.finished_at_ms.unwrap_or(0));
        }
        assert!(
            finished.windows(2).all(|w| w[0] <= w[1]),
            "{s}: {finished:?}"
        );
        let session = c.inspect(s).await?;
        assert_eq!((session.turns.completed, session.turns.queued), (5, 0));
        assert!(
            session.lock.is_none() && session.queued.is_empty(),
            "{session:?}"
        );
    }
    let stats = c.stats().await?;
    assert_eq!(
        (stats.turns.completed, stats.turns.queued),
        (10 + finished_sessions.len() as u64, 0),
        "{stats:?}"
    );
    // Idempotency records and seq numbering survive too.
    let again = c
        .submit(submit_args(
            sessions[1],
            "echo",
            json!({"i": 3}),
            Some("k-3"),
        ))
        .await?;
    assert!(again.deduplicated, "{again:?}");
    assert_eq!(again.turn.turn_id, admitted[sessions[1]][1].turn_id);
    assert_eq!(again.turn.status, TurnStatus::Completed);
    let next = c.submit_simple(sessions[0], "echo", json!("after")).await?;
    assert_eq!(next.seq, 6);
    assert_eq!(
        wait_done(&c, &next.turn_id, 10).await?.output,
        Some(json!("after"))
    );
    assert_store_healthy(&d.url).await?;
    worker.shutdown();
    let status = d.terminate().await?;
    assert!(status.success(), "{status:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_after_sigterm_keeps_and_finishes_queued_turns_in_order() -> Result<()> {
    restart_keeps_queued_turns_and_runs_them_in_order(false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_after_sigkill_keeps_and_finishes_queued_turns_in_order() -> Result<()> {
    restart_keeps_queued_turns_and_runs_them_in_order(true).await
}

// -------------------------------------------------- 8. turn.wait does not block

/// A `turn.wait` that waits does not hold up other requests on the same connection:
/// the `ping`, `turn.get` and `stats` sent after it are answered first; the wait
/// answers at its timeout with the turn as it is, and a wait returns as soon as the
/// turn becomes terminal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_wait_does_not_hold_up_the_connection() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let (mut raw, _) = Raw::hello(&d.url, "client", json!({})).await?;
    let t = raw
        .ok(
            "turn.submit",
            json!({"session_id": "s-wait", "function_id": "echo", "input": {"w": 1}}),
        )
        .await?;
    let tid = t["turn"]["turn_id"].clone();
    let sent = Instant::now();
    let frames = [
        json!({"id": 100, "op": "turn.wait", "args": {"turn_id": tid, "timeout_ms": 3000}}),
        json!({"id": 101, "op": "ping"}),
        json!({"id": 102, "op": "turn.get", "args": {"turn_id": tid}}),
        json!({"id": 103, "op": "stats", "args": {}}),
    ];
    for f in &frames {
        raw.send_text(&f.to_string()).await?;
    }
    let mut ids = Vec::new();
    for _ in 0..3 {
        let f = next_response(&mut raw).await?;
        assert!(f.get("ok").is_some(), "{f}");
        ids.push(f["id"].as_u64().unwrap_or(0));
    }
    ids.sort_unstable();
    assert_eq!(
        ids,
        vec![101, 102, 103],
        "answered while the wait is pending"
    );
    let waited = next_response(&mut raw).await?;
    let elapsed = sent.elapsed();
    assert_eq!(waited["id"], json!(100), "{waited}");
    assert_eq!(waited.pointer("/ok/turn/status"), Some(&json!("queued")));
    assert_eq!(
        waited.pointer("/ok/turn/wait/state"),
        Some(&json!("awaiting_worker")),
        "{waited}"
    );
    assert!(
        elapsed >= Duration::from_millis(2900),
        "answered after {elapsed:?}"
    );

    // A long wait returns as soon as the turn is terminal.
    raw.send_text(
        &json!({"id": 200, "op": "turn.wait", "args": {"turn_id": tid, "timeout_ms": 60000}})
            .to_string(),
    )
    .await?;
    ping_ok(&mut raw).await?;
    let worker = echo_worker(&d.url, "w-wait", 1).await;
    let done = next_response(&mut raw).await?;
    assert_eq!(done["id"], json!(200), "{done}");
    assert_eq!(
        done.pointer("/ok/turn/status"),
        Some(&json!("completed")),
        "{done}"
    );
    assert_eq!(done.pointer("/ok/turn/output"), Some(&json!({"w": 1})));
    worker.shutdown();
    d.shutdown().await
}

// -------------------------------------------------- 9. listing and event paging

/// `turn.list` is newest first and pages through `next_before_seq` without gaps or
/// repeats, for every page size and status filter; `session.events` pages with
/// `after`/`next`, seq from 1 without gaps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_list_and_session_events_page_without_gaps() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let worker = start_worker(
        Worker::new(worker_options(&d.url, "w-list"))
            .function(FunctionSpec::new("echo"), |ctx: InvocationCtx| async move {
                Outcome::Complete(ctx.invoke.input.clone())
            })
            .function(
                FunctionSpec::new("fail"),
                |_ctx: InvocationCtx| async move {
                    Outcome::Fail(Failure {
                        code: "no".into(),
                        message: "no".into(),
                        retryable: false,
                    })
                },
            ),
    )
    .await;
    let c = d.caller().await?;
    let s = "s-list";
    // seq 1-3 echo, 4 fail, 5-6 echo: all terminal; 7-9 for a function nobody serves.
    let mut ids = vec![String::new()];
    for (k, f) in ["echo", "echo", "echo", "fail", "echo", "echo"]
        .iter()
        .enumerate()
    {
        let t = c.submit_simple(s, f, json!({ "k": k + 1 })).await?;
        ids.push(t.turn_id);
    }
    assert_eq!(
        wait_done(&c, &ids[6], 10).await?.status,
        TurnStatus::Completed
    );
    for k in 7..=9 {
        let t = c.submit_simple(s, "nobody", json!({ "k": k })).await?;
        ids.push(t.turn_id);
    }
    let mut expect: HashMap<Option<TurnStatus>, Vec<u64>> = HashMap::new();
    expect.insert(None, (1..=9).rev().collect());
    expect.insert(Some(TurnStatus::Completed), vec![6, 5, 3, 2, 1]);
    expect.insert(Some(TurnStatus::Failed), vec![4]);
    expect.insert(Some(TurnStatus::Queued), vec![9, 8, 7]);
    expect.insert(Some(TurnStatus::Running), vec![]);
    expect.insert(Some(TurnStatus::Cancelled), vec![]);

    for (status, want) in &expect {
        let all = c.list(list_args(s, *status, None, None)).await?;
        let seqs: Vec<u64> = all.turns.iter().map(|t| t.seq).collect();
        assert_eq!(&seqs, want, "{status:?}, one page");
        assert_eq!(all.next_before_seq, None, "{status:?}: nothing more");
        for limit in 1..=10u64 {
            let mut got = Vec::new();
            let mut before = None;
            for page_no in 0.. {
                ensure!(
                    page_no <= 10,
                    "{status:?} limit {limit}: paging does not end"
                );
                let page = c.list(list_args(s, *status, Some(limit), before)).await?;
                assert!(page.turns.len() as u64 <= limit);
                for t in &page.turns {
                    if let Some(st) = status {
                        assert_eq!(t.status, *st, "{t:?}");
                    }
                    assert_eq!(t.turn_id, ids[t.seq as usize]);
                }
                got.extend(page.turns.iter().map(|t| t.seq));
                match page.next_before_seq {
                    Some(n) => {
                        assert!(!page.turns.is_empty(), "an empty page has no next");
                        assert_eq!(Some(n), page.turns.last().map(|t| t.seq));
                        before = Some(n);
                    }
                    None => break,
                }
            }
            assert_eq!(&got, want, "{status:?} limit {limit}");
        }
    }
    let tail = c.list(list_args(s, None, None, Some(5))).await?;
    assert_eq!(
        tail.turns.iter().map(|t| t.seq).collect::<Vec<_>>(),
        vec![4, 3, 2, 1]
    );
    let none = c.list(list_args(s, None, None, Some(1))).await?;
    assert!(none.turns.is_empty() && none.next_before_seq.is_none());
    let other = c.list(list_args("s-list-none", None, None, None)).await?;
    assert!(other.turns.is_empty() && other.next_before_seq.is_none());

    // Events: one read, then pages of every size give the same sequence.
    let full = c.events(s, None, Some(1000)).await?;
    let n = full.events.len() as u64;
    let seqs: Vec<u64> = full.events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=n).collect::<Vec<_>>(), "seq from 1, no gaps");
    assert_eq!(full.next, n);
    assert!(n >= 9 + 6 * 3, "admitted + dispatched/result/terminal: {n}");
    assert_eq!(full.events[0].kind, EventKind::Admitted);
    assert_eq!(full.events[0].turn_id, ids[1]);
    assert!(full.events.iter().all(|e| e.session_id == s));
    assert!(full.events.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
    assert_eq!(c.inspect(s).await?.last_event, n);
    for limit in [1u64, 2, 3, 7, 100] {
        let mut got = Vec::new();
        let mut after = 0;
        loop {
            let page = c.events(s, Some(after), Some(limit)).await?;
            assert!(page.events.len() as u64 <= limit);
            if page.events.is_empty() {
                assert_eq!(page.next, after, "an empty page keeps the cursor");
                break;
            }
            assert_eq!(
                page.events[0].seq,
                after + 1,
                "limit {limit}: gap after {after}"
            );
            assert_eq!(Some(page.next), page.events.last().map(|e| e.seq));
            after = page.next;
            got.extend(page.events);
        }
        assert_eq!(got, full.events, "limit {limit}");
    }
    let past = c.events(s, Some(n + 50), None).await?;
    assert!(past.events.is_empty());
    worker.shutdown();
    d.shutdown().await
}

/// A turn that completes with a JSON `null` output reads the same from a `turn.wait`
/// woken by the completion as from `turn.get` (which reads the stored record): the
/// `output` member is left out of both.
#[tokio::test]
async fn null_output_reads_the_same_from_wait_and_get() -> Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let (mut raw, _) = Raw::hello(&d.url, "client", json!({})).await?;
    let submitted = raw
        .ok(
            "turn.submit",
            json!({"session_id": "s-null", "function_id": "echo", "input": null}),
        )
        .await?;
    let turn_id = submitted
        .pointer("/turn/turn_id")
        .and_then(Value::as_str)
        .context("turn_id")?
        .to_string();
    // The wait is in place before any worker exists, so the completion wakes it.
    raw.send_text(
        &json!({"id": 900, "op": "turn.wait", "args": {"turn_id": turn_id, "timeout_ms": 10_000}})
            .to_string(),
    )
    .await?;
    let _worker = echo_worker(&d.url, "w-null", 1).await;
    let waited = loop {
        let f = raw.recv().await?;
        if f.get("id") == Some(&json!(900)) {
            break f;
        }
    };
    let waited = waited.pointer("/ok/turn").context("wait answer")?.clone();
    ensure!(waited["status"] == json!("completed"), "{waited}");
    let got = raw.ok("turn.get", json!({"turn_id": turn_id})).await?;
    let got = got.get("turn").context("get answer")?;
    assert_eq!(
        waited.get("output"),
        got.get("output"),
        "wait {waited} / get {got}"
    );
    assert_eq!(waited.get("output"), None, "{waited}");
    Ok(())
}
