//! Stop always terminalizes (semantics: Stop, Truthful terminal state; protocol:
//! `turn.stop`, `session.stop`, the `cancel` push, `Turn.stop`, events).
//!
//! Every test drives the real daemon (in process on `127.0.0.1:0`, or the built binary
//! where process death matters) through the SDK or raw frames, and checks three things
//! about each stopped turn: its terminal state is the true one and carries `stop`; its
//! events say `stop_requested`, `cancel_sent` (only when a cancel could be pushed to a
//! live invocation) and exactly one terminal event, in that order; and the session's
//! next turn runs and completes afterwards.
//!
//! One test worker ([`Lab`]) serves function `f`. The turn's input chooses what the
//! handler does (`mode`, see [`Lab::handle`]), and the lab records every invocation it
//! started and what each handler returned, so a test can compare the daemon's account
//! with what really happened on the worker.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{ensure, Context};
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use turnd_client::{Caller, FunctionSpec, InvocationCtx, Worker, WorkerHandle};
use turnd_proto::{
    Cancelled, Event, EventKind, Failure, OnDeadline, Outcome, Role, Turn, TurnStatus, WaitState,
};
use turnd_tests::{eventually, wait_done, worker_options, BinDaemon, Raw, TestDaemon};

/// The function every test turn runs.
const F: &str = "f";

// ---------------------------------------------------------------------------- lab

#[derive(Default)]
struct Record {
    /// turn_id → invocation ids whose handler started, in order.
    started: HashMap<String, Vec<String>>,
    /// invocation_id → kind of the outcome its handler returned.
    returned: HashMap<String, &'static str>,
    /// invocation_id → whether its cancel token had fired when the handler returned.
    cancel_seen: HashMap<String, bool>,
}

/// A worker's handler that does what the turn's input says and records the truth.
#[derive(Clone)]
struct Lab {
    rec: Arc<Mutex<Record>>,
    /// Keys released so far; handlers in `hold` / `ignore` mode wait for their key.
    released: Arc<watch::Sender<Vec<String>>>,
}

impl Lab {
    fn new() -> Lab {
        Lab {
            rec: Arc::new(Mutex::new(Record::default())),
            released: Arc::new(watch::channel(Vec::new()).0),
        }
    }

    fn rec(&self) -> MutexGuard<'_, Record> {
        self.rec.lock().expect("lab record lock is never poisoned")
    }

    /// Let the handler waiting for `key` return `complete`.
    fn release(&self, key: &str) {
        self.released.send_modify(|v| v.push(key.to_string()));
    }

    fn started(&self, turn_id: &str) -> Vec<String> {
        self.rec().started.get(turn_id).cloned().unwrap_or_default()
    }

    fn total_started(&self) -> usize {
        self.rec().started.values().map(Vec::len).sum()
    }

    fn returned(&self, invocation_id: &str) -> Option<&'static str> {
        self.rec().returned.get(invocation_id).copied()
    }

    fn cancel_seen(&self, invocation_id: &str) -> Option<bool> {
        self.rec().cancel_seen.get(invocation_id).copied()
    }

    /// The invocation id of the first handler started for `turn_id`.
    async fn wait_started(&self, turn_id: &str) -> anyhow::Result<String> {
        eventually(5, &format!("a handler for {turn_id} to start"), || {
            let first = self.started(turn_id).first().cloned();
            async move { first }
        })
        .await
    }

    /// Run one invocation. Modes (input `mode`, default `echo`):
    /// - `echo`: complete with the input;
    /// - `hold`: cancelled when the cancel token fires, complete when `key` is released;
    /// - `ignore`: ignores the cancel token; complete when `key` is released;
    /// - `finish_on_cancel`: completes the moment the cancel arrives (the step had
    ///   already finished when the stop came); `fail_on_cancel` / `continue_on_cancel`
    ///   likewise with a retryable failure / a `continue`;
    /// - `fail` / `fatal`: a retryable / non-retryable failure;
    /// - `race`: complete after `us` microseconds unless the cancel comes first.
    async fn handle(self, ctx: InvocationCtx) -> Outcome {
        let input = ctx.invoke.input.clone();
        let inv = ctx.invoke.invocation_id.clone();
        self.rec()
            .started
            .entry(ctx.invoke.turn_id.clone())
            .or_default()
            .push(inv.clone());
        let mode = input["mode"].as_str().unwrap_or("echo").to_string();
        let key = input["key"].as_str().unwrap_or_default().to_string();
        let mut released = self.released.subscribe();
        let honoured = || {
            Outcome::Cancelled(Cancelled {
                message: "handler honoured the cancel".into(),
            })
        };
        let outcome = match mode.as_str() {
            "hold" => tokio::select! {
                _ = ctx.cancel.cancelled() => honoured(),
                _ = released.wait_for(|v| v.contains(&key)) => Outcome::Complete(input.clone()),
            },
            "ignore" => {
                if released.wait_for(|v| v.contains(&key)).await.is_err() {
                    panic!("the lab's release channel closed while it is alive");
                }
                Outcome::Complete(input.clone())
            }
            "finish_on_cancel" => {
                ctx.cancel.cancelled().await;
                Outcome::Complete(input.clone())
            }
            "fail_on_cancel" => {
                ctx.cancel.cancelled().await;
                Outcome::Fail(Failure {
                    code: "flaky".into(),
                    message: "failed as the stop came".into(),
                    retryable: true,
                })
            }
            "continue_on_cancel" => {
                ctx.cancel.cancelled().await;
                Outcome::Continue(json!({"mode": "echo"}))
            }
            "fail" => Outcome::Fail(Failure {
                code: "flaky".into(),
                message: "try again".into(),
                retryable: true,
            }),
            "fatal" => Outcome::Fail(Failure {
                code: "broken".into(),
                message: "never works".into(),
                retryable: false,
            }),
            "race" => {
                let us = input["us"].as_u64().unwrap_or(0);
                tokio::select! {
                    _ = ctx.cancel.cancelled() => honoured(),
                    _ = tokio::time::sleep(Duration::from_micros(us)) => Outcome::Complete(input.clone()),
                }
            }
            _ => Outcome::Complete(input.clone()),
        };
        {
            let mut rec = self.rec();
            rec.returned.insert(inv.clone(), outcome.kind());
            rec.cancel_seen.insert(inv, ctx.cancel.is_cancelled());
        }
        outcome
    }

    /// A worker serving `f` through this lab (concurrency 8, up to 3 attempts).
    async fn worker(&self, url: &str, worker_id: &str) -> WorkerHandle {
        let lab = self.clone();
        let h = Worker::new(worker_options(url, worker_id))
            .function(
                FunctionSpec::new(F).concurrency(8).max_attempts(3),
                move |ctx| lab.clone().handle(ctx),
            )
            .spawn(CancellationToken::new());
        h.connected().await;
        h
    }
}

fn input(mode: &str, key: &str) -> Value {
    json!({"mode": mode, "key": key})
}

// ------------------------------------------------------------------------- checks

/// Every event of a session, in order (and checked to be in order).
async fn all_events(c: &Caller, session_id: &str) -> anyhow::Result<Vec<Event>> {
    let out = turnd_tests::all_events(c, session_id).await?;
    for w in out.windows(2) {
        ensure!(
            w[0].seq < w[1].seq,
            "session events out of order: {} then {}",
            w[0].seq,
            w[1].seq
        );
    }
    Ok(out)
}

/// The events of one turn, in session order.
async fn turn_events(c: &Caller, session_id: &str, turn_id: &str) -> anyhow::Result<Vec<Event>> {
    Ok(all_events(c, session_id)
        .await?
        .into_iter()
        .filter(|e| e.turn_id == turn_id)
        .collect())
}

fn kinds(evs: &[Event]) -> Vec<EventKind> {
    evs.iter().map(|e| e.kind).collect()
}

fn count(evs: &[Event], kind: EventKind) -> usize {
    evs.iter().filter(|e| e.kind == kind).count()
}

fn pos(evs: &[Event], kind: EventKind) -> Option<usize> {
    evs.iter().position(|e| e.kind == kind)
}

fn is_terminal_kind(k: EventKind) -> bool {
    matches!(
        k,
        EventKind::Completed | EventKind::Failed | EventKind::Cancelled
    )
}

fn terminal_kind(s: TurnStatus) -> EventKind {
    match s {
        TurnStatus::Completed => EventKind::Completed,
        TurnStatus::Failed => EventKind::Failed,
        _ => EventKind::Cancelled,
    }
}

/// Exactly one terminal event, of kind `terminal`; nothing but late evidence after it.
fn assert_one_terminal(evs: &[Event], terminal: EventKind) -> anyhow::Result<usize> {
    let terminals: Vec<EventKind> = evs
        .iter()
        .map(|e| e.kind)
        .filter(|k| is_terminal_kind(*k))
        .collect();
    ensure!(
        terminals == vec![terminal],
        "expected exactly one terminal event {terminal:?}, got {terminals:?} in {:?}",
        kinds(evs)
    );
    let at = pos(evs, terminal).expect("just checked");
    for e in &evs[at + 1..] {
        ensure!(
            e.kind == EventKind::LateResult,
            "{:?} after the terminal event: {:?}",
            e.kind,
            kinds(evs)
        );
    }
    Ok(at)
}

/// The stop's story in one turn's events: exactly one `stop_requested`, then exactly
/// one `cancel_sent` when a cancel was pushed (none otherwise), then exactly one
/// terminal event `terminal`, in that order.
fn assert_stop_story(evs: &[Event], cancel_sent: bool, terminal: EventKind) -> anyhow::Result<()> {
    ensure!(
        count(evs, EventKind::StopRequested) == 1,
        "expected one stop_requested, got {:?}",
        kinds(evs)
    );
    let stop = pos(evs, EventKind::StopRequested).expect("counted");
    let end = assert_one_terminal(evs, terminal)?;
    if cancel_sent {
        ensure!(
            count(evs, EventKind::CancelSent) == 1,
            "expected one cancel_sent, got {:?}",
            kinds(evs)
        );
        let cancel = pos(evs, EventKind::CancelSent).expect("counted");
        ensure!(
            stop < cancel && cancel < end,
            "expected stop_requested < cancel_sent < {terminal:?}, got {:?}",
            kinds(evs)
        );
    } else {
        ensure!(
            count(evs, EventKind::CancelSent) == 0,
            "no cancel could be pushed, yet the events say cancel_sent: {:?}",
            kinds(evs)
        );
        ensure!(
            stop < end,
            "expected stop_requested < {terminal:?}, got {:?}",
            kinds(evs)
        );
    }
    Ok(())
}

/// A terminal `cancelled` turn that says why: `stop` with this reason.
fn assert_cancelled(t: &Turn, reason: &str) -> anyhow::Result<()> {
    ensure!(
        t.status == TurnStatus::Cancelled,
        "turn {} is {:?}, expected cancelled: {t:?}",
        t.turn_id,
        t.status
    );
    let stop = t.stop.as_ref().context("a cancelled turn without `stop`")?;
    ensure!(
        stop.reason == reason,
        "stop reason {:?}, expected {reason:?}",
        stop.reason
    );
    ensure!(stop.requested_at_ms > 0, "stop.requested_at_ms unset");
    let fin = t
        .finished_at_ms
        .context("terminal turn without finished_at_ms")?;
    ensure!(
        fin >= stop.requested_at_ms,
        "finished before the stop was requested"
    );
    ensure!(
        t.wait.is_none(),
        "a terminal turn shows a wait: {:?}",
        t.wait
    );
    ensure!(
        t.output.is_none() && t.error.is_none(),
        "cancelled turn with output/error: {t:?}"
    );
    Ok(())
}

/// A turn with a live invocation just stopped: still running, `stop` set, waiting in
/// `cancelling` with the cancel grace as its deadline.
fn assert_cancelling(t: &Turn, reason: &str, grace_ms: u64) -> anyhow::Result<()> {
    ensure!(
        t.status == TurnStatus::Running,
        "expected running, got {t:?}"
    );
    let stop = t
        .stop
        .as_ref()
        .context("stop not set on the returned turn")?;
    ensure!(stop.reason == reason, "stop reason {:?}", stop.reason);
    let w = t.wait.as_ref().context("a running turn without wait")?;
    ensure!(
        w.state == WaitState::Cancelling,
        "wait.state {:?}, expected cancelling",
        w.state
    );
    ensure!(
        w.deadline_ms == Some(stop.requested_at_ms + grace_ms),
        "cancelling deadline {:?}, expected requested_at + cancel_grace_ms = {}",
        w.deadline_ms,
        stop.requested_at_ms + grace_ms
    );
    ensure!(
        w.on_deadline == Some(OnDeadline::Cancel),
        "on_deadline {:?}",
        w.on_deadline
    );
    Ok(())
}

/// `store.check` as operator finds nothing.
async fn assert_store_clean(url: &str) -> anyhow::Result<()> {
    let op = Caller::connect_as(url, Role::Operator, None).await?;
    let v = op.store_check().await?;
    ensure!(v.is_empty(), "store.check violations: {v:#?}");
    Ok(())
}

/// Wait for a completed turn whose output is its input.
async fn assert_completes(c: &Caller, t: &Turn) -> anyhow::Result<Turn> {
    let done = wait_done(c, &t.turn_id, 5).await?;
    ensure!(
        done.status == TurnStatus::Completed,
        "turn {} ended {:?}, expected completed: {done:?}",
        t.turn_id,
        done.status
    );
    ensure!(
        done.output.as_ref() == Some(&t.input),
        "output {:?}",
        done.output
    );
    Ok(done)
}

// -------------------------------------------------------------------------- tests

/// 1. A queued turn behind a running one is cancelled at once and never dispatched;
///    the turn behind it runs once the lock passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_turn_is_cancelled_at_once_and_never_dispatched() -> anyhow::Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let lab = Lab::new();
    let w = lab.worker(&d.url, "w1").await;
    let c = d.caller().await?;
    let a = c.submit_simple("s", F, input("hold", "a")).await?;
    let b = c.submit_simple("s", F, input("echo", "b")).await?;
    let next = c.submit_simple("s", F, input("echo", "next")).await?;
    lab.wait_started(&a.turn_id).await?;
    ensure!(
        c.get(&b.turn_id).await?.wait.map(|w| w.state) == Some(WaitState::QueuedBehind),
        "b should be queued behind a"
    );

    let stopped = c.stop(&b.turn_id, "not needed").await?;
    assert_cancelled(&stopped, "not needed")?;
    ensure!(stopped.step == 0 && stopped.attempt == 0, "{stopped:?}");

    lab.release("a");
    assert_completes(&c, &a).await?;
    assert_completes(&c, &next).await?;
    let b_final = c.get(&b.turn_id).await?;
    ensure!(b_final == stopped, "b changed after its stop: {b_final:?}");
    ensure!(lab.started(&b.turn_id).is_empty(), "b's handler ran");
    ensure!(
        lab.total_started() == 2,
        "handlers: {}",
        lab.total_started()
    );

    let evs = turn_events(&c, "s", &b.turn_id).await?;
    ensure!(
        count(&evs, EventKind::Dispatched) == 0,
        "b dispatched: {:?}",
        kinds(&evs)
    );
    assert_stop_story(&evs, false, EventKind::Cancelled)?;
    let a_evs = turn_events(&c, "s", &a.turn_id).await?;
    ensure!(
        count(&a_evs, EventKind::StopRequested) == 0,
        "a was touched"
    );
    assert_store_clean(&d.url).await?;
    w.shutdown();
    d.shutdown().await
}

/// 2. A turn waiting for a worker (nobody serves its function) is cancelled at once;
///    the session's next turn then runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_awaiting_a_worker_is_cancelled_at_once() -> anyhow::Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let lab = Lab::new();
    let w = lab.worker(&d.url, "w1").await;
    let c = d.caller().await?;
    let a = c.submit_simple("s", "nobody", json!({})).await?;
    let next = c.submit_simple("s", F, input("echo", "next")).await?;
    let before = c.get(&a.turn_id).await?;
    ensure!(
        before.wait.as_ref().map(|w| w.state) == Some(WaitState::AwaitingWorker),
        "{before:?}"
    );

    let stopped = c.stop(&a.turn_id, "nobody serves it").await?;
    assert_cancelled(&stopped, "nobody serves it")?;
    assert_completes(&c, &next).await?;

    let evs = turn_events(&c, "s", &a.turn_id).await?;
    ensure!(count(&evs, EventKind::Dispatched) == 0, "{:?}", kinds(&evs));
    assert_stop_story(&evs, false, EventKind::Cancelled)?;
    assert_store_clean(&d.url).await?;
    w.shutdown();
    d.shutdown().await
}

/// 3. A turn backing off after a retryable failure is cancelled at once, and the retry
///    never happens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_in_backoff_is_cancelled_at_once_without_a_retry() -> anyhow::Result<()> {
    let d = TestDaemon::start(|c| c.turns.retry_backoff_ms = 10_000).await?;
    let lab = Lab::new();
    let w = lab.worker(&d.url, "w1").await;
    let c = d.caller().await?;
    let a = c.submit_simple("s", F, input("fail", "")).await?;
    let next = c.submit_simple("s", F, input("echo", "next")).await?;
    eventually(5, "a backing off", || async {
        let t = c.get(&a.turn_id).await.ok()?;
        (t.wait?.state == WaitState::BackingOff).then_some(())
    })
    .await?;

    let stopped = c.stop(&a.turn_id, "give up").await?;
    assert_cancelled(&stopped, "give up")?;
    // The successor runs now, not after the 10 s backoff.
    assert_completes(&c, &next).await?;
    ensure!(lab.started(&a.turn_id).len() == 1, "a was retried");

    let evs = turn_events(&c, "s", &a.turn_id).await?;
    ensure!(
        pos(&evs, EventKind::RetryScheduled) < pos(&evs, EventKind::StopRequested),
        "{:?}",
        kinds(&evs)
    );
    ensure!(count(&evs, EventKind::Dispatched) == 1, "{:?}", kinds(&evs));
    assert_stop_story(&evs, false, EventKind::Cancelled)?;
    assert_store_clean(&d.url).await?;
    w.shutdown();
    d.shutdown().await
}

/// 4. A live invocation whose handler honours the cancel token: `cancel` is pushed,
///    the worker answers `cancelled`, the turn is cancelled with the caller's reason.
///    Also the SDK path: `Caller::stop` returns the turn with `stop` set, in
///    `cancelling` with the grace as deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_invocation_is_cancelled_when_the_worker_answers_cancelled() -> anyhow::Result<()> {
    const GRACE: u64 = 5_000;
    let d = TestDaemon::start(|c| c.turns.cancel_grace_ms = GRACE).await?;
    let lab = Lab::new();
    let w = lab.worker(&d.url, "w1").await;
    let c = d.caller().await?;
    let a = c.submit_simple("s", F, input("hold", "a")).await?;
    let next = c.submit_simple("s", F, input("echo", "next")).await?;
    let inv = lab.wait_started(&a.turn_id).await?;

    let stopped = c.stop(&a.turn_id, "user pressed stop").await?;
    assert_cancelling(&stopped, "user pressed stop", GRACE)?;
    ensure!(
        stopped
            .wait
            .as_ref()
            .and_then(|w| w.invocation_id.as_deref())
            == Some(inv.as_str()),
        "cancelling names another invocation: {:?}",
        stopped.wait
    );

    let done = wait_done(&c, &a.turn_id, 4).await?;
    assert_cancelled(&done, "user pressed stop")?;
    ensure!(
        done.stop == stopped.stop,
        "stop record changed: {:?}",
        done.stop
    );
    // Ended by the worker's answer, long before the grace.
    ensure!(
        done.finished_at_ms.unwrap_or(u64::MAX)
            < stopped.stop.as_ref().expect("set").requested_at_ms + GRACE,
        "cancelled only by the grace: {done:?}"
    );
    ensure!(lab.returned(&inv) == Some("cancelled") && lab.cancel_seen(&inv) == Some(true));
    assert_completes(&c, &next).await?;

    let evs = turn_events(&c, "s", &a.turn_id).await?;
    assert_stop_story(&evs, true, EventKind::Cancelled)?;
    let result = evs
        .iter()
        .find(|e| e.kind == EventKind::Result)
        .context("no result event")?;
    ensure!(
        result.detail["outcome"] == "cancelled",
        "{:?}",
        result.detail
    );
    ensure!(
        pos(&evs, EventKind::CancelSent) < pos(&evs, EventKind::Result),
        "{:?}",
        kinds(&evs)
    );
    assert_store_clean(&d.url).await?;
    w.shutdown();
    d.shutdown().await
}

/// 5. A live invocation whose worker ignores the cancel: the `cancel` push reaches the
///    worker, the turn is cancelled when `cancel_grace_ms` passes, and the result that
///    comes afterwards is `late` and changes nothing. A raw worker sees the exact frames.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignored_cancel_ends_at_the_grace_and_the_later_result_is_late() -> anyhow::Result<()> {
    // Long enough for the stop's answer, the cancel push and the heartbeat below to
    // land inside it on a busy machine; the raw worker answers no pings meanwhile.
    const GRACE: u64 = 5_000;
    let d = TestDaemon::start(|c| {
        c.turns.cancel_grace_ms = GRACE;
        turnd_tests::quiet_raw_peers(c);
    })
    .await?;
    let (mut raw, _) = Raw::hello(
        &d.url,
        "worker",
        json!({"worker_id": "raw", "instance_id": "raw-1"}),
    )
    .await?;
    raw.ok(
        "function.register",
        json!({"function_id": F, "concurrency": 2}),
    )
    .await?;
    let c = d.caller().await?;
    let a = c.submit_simple("s", F, json!({"a": 1})).await?;
    let next = c.submit_simple("s", F, json!({"next": 1})).await?;
    let invoke = raw.next_push().await?;
    ensure!(
        invoke["push"] == "invoke" && invoke["turn_id"] == a.turn_id.as_str(),
        "{invoke}"
    );
    let inv = invoke["invocation_id"]
        .as_str()
        .context("invocation_id")?
        .to_string();

    let stopped = c.stop(&a.turn_id, "too slow").await?;
    assert_cancelling(&stopped, "too slow", GRACE)?;
    let cancel = raw.next_push().await?;
    ensure!(
        cancel["push"] == "cancel"
            && cancel["invocation_id"] == inv.as_str()
            && cancel["reason"] == "too slow",
        "{cancel}"
    );

    // A heartbeat does not buy time: the deadline stays the grace.
    let hb = raw
        .ok("invocation.heartbeat", json!({"invocation_id": inv}))
        .await?;
    ensure!(
        Some(hb["deadline_ms"].as_u64().context("deadline_ms")?)
            == stopped.wait.as_ref().and_then(|w| w.deadline_ms),
        "a heartbeat moved the cancel deadline: {hb}"
    );
    // The worker says nothing else; the grace decides.
    let done = wait_done(&c, &a.turn_id, 30).await?;
    assert_cancelled(&done, "too slow")?;
    let requested = done.stop.as_ref().expect("checked").requested_at_ms;
    ensure!(
        done.finished_at_ms.expect("checked") >= requested + GRACE,
        "cancelled before the grace passed: {done:?}"
    );

    let late = raw
        .ok(
            "invocation.result",
            json!({"invocation_id": inv, "outcome": {"complete": {"too": "late"}}}),
        )
        .await?;
    ensure!(late["accepted"] == "late", "{late}");
    ensure!(
        c.get(&a.turn_id).await? == done,
        "the late result changed a"
    );
    let code = raw
        .error_code("invocation.heartbeat", json!({"invocation_id": inv}))
        .await?;
    ensure!(
        code == "not_found",
        "heartbeat of a given-up invocation: {code}"
    );

    // The successor reaches the worker and completes.
    let invoke2 = raw.next_push().await?;
    ensure!(
        invoke2["push"] == "invoke" && invoke2["turn_id"] == next.turn_id.as_str(),
        "{invoke2}"
    );
    let ok = raw
        .ok(
            "invocation.result",
            json!({"invocation_id": invoke2["invocation_id"], "outcome": {"complete": {"next": 1}}}),
        )
        .await?;
    ensure!(ok["accepted"] == "applied", "{ok}");
    assert_completes(&c, &next).await?;

    let evs = turn_events(&c, "s", &a.turn_id).await?;
    assert_stop_story(&evs, true, EventKind::Cancelled)?;
    ensure!(count(&evs, EventKind::Result) == 0, "{:?}", kinds(&evs));
    ensure!(
        evs.last().map(|e| e.kind) == Some(EventKind::LateResult),
        "{:?}",
        kinds(&evs)
    );
    assert_store_clean(&d.url).await?;
    d.shutdown().await
}

/// 6. The invocation had already finished when the stop came: the handler completes as
///    the cancel arrives, and the truth wins — `completed` with its output, `stop` kept
///    on the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_invocation_completes_with_the_stop_on_record() -> anyhow::Result<()> {
    const GRACE: u64 = 5_000;
    let d = TestDaemon::start(|c| c.turns.cancel_grace_ms = GRACE).await?;
    let lab = Lab::new();
    let w = lab.worker(&d.url, "w1").await;
    let c = d.caller().await?;
    let a = c
        .submit_simple("s", F, input("finish_on_cancel", "a"))
        .await?;
    let next = c.submit_simple("s", F, input("echo", "next")).await?;
    let inv = lab.wait_started(&a.turn_id).await?;

    let stopped = c.stop(&a.turn_id, "late stop").await?;
    assert_cancelling(&stopped, "late stop", GRACE)?;
    let done = wait_done(&c, &a.turn_id, 4).await?;
    ensure!(
        done.status == TurnStatus::Completed,
        "the real outcome lost: {done:?}"
    );
    ensure!(done.output.as_ref() == Some(&a.input), "{done:?}");
    ensure!(
        done.stop == stopped.stop && done.stop.is_some(),
        "stop not kept on the record: {done:?}"
    );
    ensure!(done.error.is_none() && !done.recovered, "{done:?}");
    ensure!(lab.returned(&inv) == Some("complete"));
    assert_completes(&c, &next).await?;

    let evs = turn_events(&c, "s", &a.turn_id).await?;
    assert_stop_story(&evs, true, EventKind::Completed)?;
    ensure!(
        evs.iter()
            .any(|e| e.kind == EventKind::Result && e.detail["outcome"] == "complete"),
        "{:?}",
        kinds(&evs)
    );
    assert_store_clean(&d.url).await?;
    w.shutdown();
    d.shutdown().await
}

/// 6b. The other outcomes a step can report as the cancel arrives: a retryable
///     failure is the truth (failed, `handler_failed`, `stop` on record, no retry); a
///     `continue` ends the turn cancelled without dispatching the next step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_or_continue_after_a_stop_never_runs_more() -> anyhow::Result<()> {
    const GRACE: u64 = 5_000;
    let d = TestDaemon::start(|c| c.turns.cancel_grace_ms = GRACE).await?;
    let lab = Lab::new();
    let w = lab.worker(&d.url, "w1").await;
    let c = d.caller().await?;
    let failing = c
        .submit_simple("s1", F, input("fail_on_cancel", ""))
        .await?;
    let next1 = c.submit_simple("s1", F, input("echo", "n1")).await?;
    let stepping = c
        .submit_simple("s2", F, input("continue_on_cancel", ""))
        .await?;
    let next2 = c.submit_simple("s2", F, input("echo", "n2")).await?;
    lab.wait_started(&failing.turn_id).await?;
    lab.wait_started(&stepping.turn_id).await?;
    let f_stop = c.stop(&failing.turn_id, "stop f").await?;
    let s_stop = c.stop(&stepping.turn_id, "stop s").await?;
    assert_cancelling(&f_stop, "stop f", GRACE)?;
    assert_cancelling(&s_stop, "stop s", GRACE)?;

    let f = wait_done(&c, &failing.turn_id, 4).await?;
    ensure!(f.status == TurnStatus::Failed, "{f:?}");
    let e = f.error.as_ref().context("failed without error")?;
    ensure!(
        e.cause == turnd_proto::ErrorCause::HandlerFailed && e.code == "flaky",
        "{e:?}"
    );
    ensure!(f.stop == f_stop.stop, "stop not on the record: {f:?}");
    ensure!(
        lab.started(&failing.turn_id).len() == 1,
        "retried after a stop"
    );
    let f_evs = turn_events(&c, "s1", &failing.turn_id).await?;
    assert_stop_story(&f_evs, true, EventKind::Failed)?;
    ensure!(
        count(&f_evs, EventKind::RetryScheduled) == 0,
        "{:?}",
        kinds(&f_evs)
    );

    let t = wait_done(&c, &stepping.turn_id, 4).await?;
    assert_cancelled(&t, "stop s")?;
    ensure!(t.step == 0, "advanced to step {} after a stop", t.step);
    ensure!(
        lab.started(&stepping.turn_id).len() == 1,
        "next step dispatched"
    );
    let s_evs = turn_events(&c, "s2", &stepping.turn_id).await?;
    assert_stop_story(&s_evs, true, EventKind::Cancelled)?;
    ensure!(
        count(&s_evs, EventKind::Dispatched) == 1,
        "{:?}",
        kinds(&s_evs)
    );

    assert_completes(&c, &next1).await?;
    assert_completes(&c, &next2).await?;
    assert_store_clean(&d.url).await?;
    w.shutdown();
    d.shutdown().await
}

/// 7. Stop twice (here: two concurrent stops with different reasons, then a third once
///    it is terminal): one stop is recorded, every answer shows that same stop, one
///    `stop_requested` and one `cancel_sent`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_twice_records_one_stop() -> anyhow::Result<()> {
    const GRACE: u64 = 400;
    let d = TestDaemon::start(|c| c.turns.cancel_grace_ms = GRACE).await?;
    let lab = Lab::new();
    let w = lab.worker(&d.url, "w1").await;
    let c = d.caller().await?;
    let c2 = d.caller().await?;
    let a = c.submit_simple("s", F, input("ignore", "a")).await?;
    let next = c.submit_simple("s", F, input("echo", "next")).await?;
    lab.wait_started(&a.turn_id).await?;

    let (s1, s2) = tokio::join!(c.stop(&a.turn_id, "first"), c2.stop(&a.turn_id, "second"));
    let (s1, s2) = (s1?, s2?);
    ensure!(
        s1.stop.is_some() && s1.stop == s2.stop,
        "two stops recorded: {:?} vs {:?}",
        s1.stop,
        s2.stop
    );
    let reason = s1.stop.as_ref().expect("checked").reason.clone();
    assert_cancelling(&s1, &reason, GRACE)?;
    assert_cancelling(&s2, &reason, GRACE)?;
    ensure!(
        s1.wait.as_ref().map(|w| w.deadline_ms) == s2.wait.as_ref().map(|w| w.deadline_ms),
        "the second stop moved the deadline"
    );
    // Sequentially once more while still cancelling: same turn, nothing new.
    let s3 = c.stop(&a.turn_id, "third").await?;
    ensure!(s3.stop == s1.stop, "{:?}", s3.stop);

    let done = wait_done(&c, &a.turn_id, 3).await?;
    assert_cancelled(&done, &reason)?;
    let s4 = c.stop(&a.turn_id, "fourth").await?;
    ensure!(s4 == done, "stop of the cancelled turn changed it: {s4:?}");
    lab.release("a");
    assert_completes(&c, &next).await?;

    let evs = turn_events(&c, "s", &a.turn_id).await?;
    assert_stop_story(&evs, true, EventKind::Cancelled)?;
    let recorded = evs
        .iter()
        .find(|e| e.kind == EventKind::StopRequested)
        .expect("checked");
    ensure!(recorded.detail["reason"] == reason.as_str(), "{recorded:?}");
    assert_store_clean(&d.url).await?;
    w.shutdown();
    d.shutdown().await
}

/// 8. Stopping a turn that is already terminal (completed, failed, cancelled) changes
///    nothing and returns it as it is; no event is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_of_a_terminal_turn_changes_nothing() -> anyhow::Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let lab = Lab::new();
    let w = lab.worker(&d.url, "w1").await;
    let c = d.caller().await?;
    let done = assert_completes(&c, &c.submit_simple("s", F, input("echo", "1")).await?).await?;
    let failed = c.submit_simple("s", F, input("fatal", "")).await?;
    let failed = wait_done(&c, &failed.turn_id, 5).await?;
    ensure!(failed.status == TurnStatus::Failed, "{failed:?}");
    let waiting = c.submit_simple("s", "nobody", json!({})).await?;
    let cancelled = c.stop(&waiting.turn_id, "first stop").await?;
    assert_cancelled(&cancelled, "first stop")?;
    // A stop without a reason still says why.
    let (mut raw, _) = Raw::hello(&d.url, "client", json!({})).await?;
    let waiting2 = c.submit_simple("s", "nobody", json!({"n": 2})).await?;
    let no_reason = raw
        .ok("turn.stop", json!({"turn_id": waiting2.turn_id}))
        .await?;
    let reason = no_reason["turn"]["stop"]["reason"].as_str().unwrap_or("");
    ensure!(
        no_reason["turn"]["status"] == "cancelled" && !reason.is_empty(),
        "{no_reason}"
    );
    let last_event = c.inspect("s").await?.last_event;

    for t in [&done, &failed, &cancelled] {
        let again = c.stop(&t.turn_id, "too late").await?;
        ensure!(
            again == *t,
            "stop changed a terminal turn: {again:?} vs {t:?}"
        );
        ensure!(c.get(&t.turn_id).await? == *t, "stored turn changed");
    }
    ensure!(done.stop.is_none() && failed.stop.is_none());
    let err = c
        .stop("t_does_not_exist", "x")
        .await
        .expect_err("stop of an unknown turn");
    ensure!(
        err.code() == Some(turnd_proto::ErrorCode::NotFound),
        "{err}"
    );
    ensure!(
        c.inspect("s").await?.last_event == last_event,
        "stopping terminal turns wrote events: {:?}",
        kinds(&all_events(&c, "s").await?)
    );
    let next = c.submit_simple("s", F, input("echo", "next")).await?;
    assert_completes(&c, &next).await?;
    assert_store_clean(&d.url).await?;
    w.shutdown();
    d.shutdown().await
}

/// 9. The worker running the invocation is gone (`awaiting_reconnect`): the stop
///    cancels at once, the invocation is abandoned (its result, when the same instance
///    comes back with it, is `late`), and the successor runs on another worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_with_the_worker_disconnected_cancels_at_once() -> anyhow::Result<()> {
    let d = TestDaemon::start(|c| c.turns.reconnect_grace_ms = 10_000).await?;
    let lab = Lab::new();
    let w1 = lab.worker(&d.url, "w1").await;
    let c = d.caller().await?;
    let a = c.submit_simple("s", F, input("ignore", "a")).await?;
    let next = c.submit_simple("s", F, input("echo", "next")).await?;
    let inv = lab.wait_started(&a.turn_id).await?;
    let instance = w1.instance_id().to_string();
    w1.shutdown();
    w1.join().await?;
    eventually(5, "a awaiting_reconnect", || async {
        let t = c.get(&a.turn_id).await.ok()?;
        (t.wait?.state == WaitState::AwaitingReconnect).then_some(())
    })
    .await?;

    let stopped = c.stop(&a.turn_id, "worker gone").await?;
    assert_cancelled(&stopped, "worker gone")?;

    // The same instance comes back holding the result: it is late evidence, nothing
    // more.
    let (mut raw, hello) = Raw::hello(
        &d.url,
        "worker",
        json!({"worker_id": "w1", "instance_id": instance, "finished": [inv]}),
    )
    .await?;
    ensure!(hello.get("ok").is_some(), "{hello}");
    let late = raw
        .ok(
            "invocation.result",
            json!({"invocation_id": inv, "outcome": {"complete": {"mode": "ignore"}}}),
        )
        .await?;
    ensure!(late["accepted"] == "late", "{late}");
    ensure!(c.get(&a.turn_id).await? == stopped, "late result changed a");

    let w2 = lab.worker(&d.url, "w2").await;
    assert_completes(&c, &next).await?;

    let evs = turn_events(&c, "s", &a.turn_id).await?;
    assert_stop_story(&evs, false, EventKind::Cancelled)?;
    assert_store_clean(&d.url).await?;
    w2.shutdown();
    d.shutdown().await
}

/// A small seeded generator (xorshift64*) so the race test can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// 10. Stop racing a result, 30 times: the handler completes after a tiny random delay
///     (or returns cancelled if the cancel reaches it first) while the caller stops
///     after another. Every turn ends exactly once, in the state the worker really
///     reported, with events that agree; the store is clean at the end.
///     Replay with `STOP_RACE_SEED=<seed>`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_racing_a_result_ends_each_turn_once_truthfully() -> anyhow::Result<()> {
    let seed = match std::env::var("STOP_RACE_SEED") {
        Ok(s) => s.parse().context("STOP_RACE_SEED")?,
        Err(_) => {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_nanos() as u64
                | 1
        }
    };
    println!("stop race seed: STOP_RACE_SEED={seed}");
    let mut rng = Rng(seed);
    // A generous grace: every handler answers long before it, so the answer decides.
    let d = TestDaemon::start(|c| c.turns.cancel_grace_ms = 5_000).await?;
    let lab = Lab::new();
    let w = lab.worker(&d.url, "w1").await;
    let c = d.caller().await?;
    let stopper = d.caller().await?;
    let mut tally: HashMap<&'static str, u32> = HashMap::new();
    for i in 0..30 {
        let us = 500 + rng.below(3_500);
        let stop_after = rng.below(4);
        let t = c
            .submit_simple("race", F, json!({"mode": "race", "us": us, "i": i}))
            .await?;
        if stop_after > 0 {
            tokio::time::sleep(Duration::from_millis(stop_after)).await;
        }
        let answer = stopper.stop(&t.turn_id, "race").await?;
        let done = wait_done(&c, &t.turn_id, 8)
            .await
            .with_context(|| format!("iteration {i} (seed {seed})"))?;
        let ctx = || format!("iteration {i} (seed {seed}): {done:?}");
        let evs = turn_events(&c, "race", &t.turn_id).await?;
        assert_one_terminal(&evs, terminal_kind(done.status)).with_context(ctx)?;

        // The stop's answer is the final turn (stop on a terminal turn, or cancelled at
        // once), or a cancelling turn with the stop recorded.
        if answer.status.is_terminal() {
            ensure!(answer == done, "stop answered {answer:?}; {}", ctx());
        } else {
            assert_cancelling(&answer, "race", 5_000).with_context(ctx)?;
        }
        let stops = count(&evs, EventKind::StopRequested);
        ensure!(stops <= 1, "{:?}; {}", kinds(&evs), ctx());
        ensure!(
            (stops == 1) == done.stop.is_some(),
            "stop record and events disagree: {:?}; {}",
            kinds(&evs),
            ctx()
        );

        // The truth: what the handler returned, if it ran.
        let started = lab.started(&t.turn_id);
        ensure!(started.len() <= 1, "redispatched: {started:?}; {}", ctx());
        let truth = match started.first() {
            Some(inv) => lab.returned(inv).with_context(ctx)?,
            None => "never ran",
        };
        match truth {
            "complete" => {
                ensure!(done.status == TurnStatus::Completed, "{}", ctx());
                ensure!(done.output.as_ref() == Some(&t.input), "{}", ctx());
                *tally
                    .entry(if done.stop.is_some() {
                        "completed with stop"
                    } else {
                        "completed before stop"
                    })
                    .or_default() += 1;
            }
            "cancelled" => {
                assert_cancelled(&done, "race").with_context(ctx)?;
                assert_stop_story(&evs, true, EventKind::Cancelled).with_context(ctx)?;
                *tally.entry("cancelled by the worker").or_default() += 1;
            }
            _ => {
                assert_cancelled(&done, "race").with_context(ctx)?;
                ensure!(count(&evs, EventKind::Dispatched) == 0, "{}", ctx());
                *tally.entry("cancelled before dispatch").or_default() += 1;
            }
        }
        if done.stop.is_some() {
            ensure!(
                pos(&evs, EventKind::StopRequested) < pos(&evs, terminal_kind(done.status)),
                "{:?}; {}",
                kinds(&evs),
                ctx()
            );
        }
        let results = count(&evs, EventKind::Result);
        ensure!(
            results == usize::from(truth != "never ran"),
            "{results} result events; {}",
            ctx()
        );
    }
    println!("stop race outcomes: {tally:?}");
    let next = c.submit_simple("race", F, input("echo", "next")).await?;
    assert_completes(&c, &next).await?;
    let s = c.inspect("race").await?;
    ensure!(
        s.lock.is_none() && s.queued.is_empty(),
        "session not idle: {s:?}"
    );
    ensure!(
        s.turns.completed + s.turns.cancelled == 31 && s.turns.failed == 0,
        "{:?}",
        s.turns
    );
    let stats = c.stats().await?;
    ensure!(
        stats.turns == s.turns && stats.invocations_inflight == 0 && stats.sessions.active == 0,
        "stats disagree with the session: {stats:?} vs {:?}",
        s.turns
    );
    assert_store_clean(&d.url).await?;
    w.shutdown();
    d.shutdown().await
}

/// 11. `session.stop` stops every non-terminal turn of its session (the running one
///     and the queued ones) and nothing of another session; a turn submitted to the
///     stopped session afterwards runs normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_stop_stops_every_turn_of_that_session_only() -> anyhow::Result<()> {
    let d = TestDaemon::start(|c| c.turns.cancel_grace_ms = 5_000).await?;
    let lab = Lab::new();
    let w = lab.worker(&d.url, "w1").await;
    let c = d.caller().await?;
    let a = c.submit_simple("s", F, input("hold", "a")).await?;
    let b = c.submit_simple("s", F, input("echo", "b")).await?;
    let bb = c.submit_simple("s", F, input("echo", "bb")).await?;
    let other = c.submit_simple("t", F, input("hold", "t")).await?;
    let other_next = c.submit_simple("t", F, input("echo", "t2")).await?;
    lab.wait_started(&a.turn_id).await?;
    lab.wait_started(&other.turn_id).await?;

    let turns = c.stop_session("s", "session closed").await?;
    let mut ids: Vec<&str> = turns.iter().map(|t| t.turn_id.as_str()).collect();
    ids.sort_unstable();
    let mut want = vec![a.turn_id.as_str(), b.turn_id.as_str(), bb.turn_id.as_str()];
    want.sort_unstable();
    ensure!(
        ids == want,
        "session.stop returned {ids:?}, expected {want:?}"
    );
    for t in &turns {
        ensure!(
            t.stop.as_ref().map(|s| s.reason.as_str()) == Some("session closed"),
            "{t:?}"
        );
        if t.turn_id != a.turn_id {
            assert_cancelled(t, "session closed")?;
        }
    }
    let a_done = wait_done(&c, &a.turn_id, 4).await?;
    assert_cancelled(&a_done, "session closed")?;
    let last_event = c.inspect("s").await?.last_event;
    let again = c.stop_session("s", "again").await?;
    ensure!(again.is_empty(), "nothing left to stop, got {again:?}");
    ensure!(
        c.inspect("s").await?.last_event == last_event,
        "events written"
    );
    let err = c
        .stop_session("no-such-session", "x")
        .await
        .expect_err("unknown session");
    ensure!(
        err.code() == Some(turnd_proto::ErrorCode::NotFound),
        "{err}"
    );
    let later = c.submit_simple("s", F, input("echo", "later")).await?;
    assert_completes(&c, &later).await?;

    // The other session is untouched: its holder still runs, its queued turn waits.
    let o = c.get(&other.turn_id).await?;
    let on = c.get(&other_next.turn_id).await?;
    ensure!(o.status == TurnStatus::Running && o.stop.is_none(), "{o:?}");
    ensure!(
        on.status == TurnStatus::Queued && on.stop.is_none(),
        "{on:?}"
    );
    let t_evs = all_events(&c, "t").await?;
    ensure!(
        count(&t_evs, EventKind::StopRequested) + count(&t_evs, EventKind::CancelSent) == 0,
        "{:?}",
        kinds(&t_evs)
    );
    lab.release("t");
    assert_completes(&c, &other).await?;
    assert_completes(&c, &other_next).await?;

    assert_stop_story(
        &turn_events(&c, "s", &a.turn_id).await?,
        true,
        EventKind::Cancelled,
    )?;
    for q in [&b, &bb] {
        let evs = turn_events(&c, "s", &q.turn_id).await?;
        assert_stop_story(&evs, false, EventKind::Cancelled)?;
        ensure!(count(&evs, EventKind::Dispatched) == 0, "{:?}", kinds(&evs));
        ensure!(lab.started(&q.turn_id).is_empty());
    }
    assert_store_clean(&d.url).await?;
    w.shutdown();
    d.shutdown().await
}

/// 12. Stop, then `kill -9` the daemon before the cancel grace ends, then restart it on
///     the same data: the acknowledged stop survived, and the turn is `cancelled` no
///     later than its original grace deadline (or at once on boot when that passed);
///     the successor runs on a worker of the new daemon; the store is clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_survives_a_kill_before_the_grace_ends() -> anyhow::Result<()> {
    const GRACE: u64 = 1_500;
    let tmp = tempfile::tempdir()?;
    let data = tmp.path().join("data");
    let env = [("TURND_TURNS__CANCEL_GRACE_MS", "1500")];
    let first = BinDaemon::start(&data, &env).await?;
    let lab = Lab::new();
    let w1 = lab.worker(&first.url, "w1").await;
    let c = Caller::connect(&first.url, None).await?;
    let a = c.submit_simple("s", F, input("ignore", "a")).await?;
    let next = c.submit_simple("s", F, input("echo", "next")).await?;
    lab.wait_started(&a.turn_id).await?;
    let stopped = c.stop(&a.turn_id, "stop then crash").await?;
    assert_cancelling(&stopped, "stop then crash", GRACE)?;
    let deadline = stopped
        .wait
        .as_ref()
        .and_then(|w| w.deadline_ms)
        .expect("checked");
    first.kill().await?;
    w1.shutdown();
    drop(c);

    let second = BinDaemon::start(&data, &env).await?;
    let c = Caller::connect(&second.url, None).await?;
    let now_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    };
    let booted_at = now_ms();
    let seen = c.get(&a.turn_id).await?;
    ensure!(
        seen.stop == stopped.stop,
        "the acknowledged stop did not survive: {seen:?}"
    );
    println!(
        "after restart: {:?} (deadline in {} ms)",
        seen.status,
        deadline as i64 - booted_at as i64
    );
    if !seen.status.is_terminal() {
        let w = seen.wait.as_ref().context("wait")?;
        ensure!(
            w.state == WaitState::Cancelling && w.deadline_ms == Some(deadline),
            "after restart the stop waits {w:?}, expected cancelling until {deadline}"
        );
    }
    // Terminal by the original deadline (or at once if the restart came after it),
    // with slack for a busy machine (a lost stop would leave it running for good).
    let bound = (deadline.max(booted_at) + 5_000).saturating_sub(now_ms());
    let done = c
        .wait_terminal(&a.turn_id, Duration::from_millis(bound.max(100)))
        .await
        .context("still not terminal after the grace")?;
    assert_cancelled(&done, "stop then crash")?;
    ensure!(done.stop == stopped.stop, "{done:?}");
    let fin = done.finished_at_ms.expect("checked");
    ensure!(
        fin <= deadline.max(booted_at) + 1_000,
        "cancelled at {fin}, after its grace deadline {deadline} (boot at {booted_at})"
    );

    let w2 = lab.worker(&second.url, "w2").await;
    assert_completes(&c, &next).await?;
    let evs = turn_events(&c, "s", &a.turn_id).await?;
    assert_stop_story(&evs, true, EventKind::Cancelled)?;
    assert_store_clean(&second.url).await?;
    w2.shutdown();
    second.kill().await
}

/// 13. A stop never affects a newer turn of the same session: A is stopped while its
///     invocation is live and ignores the cancel; after A ends, B (submitted after A)
///     runs — even A's late result arriving while B's invocation is live changes
///     nothing of B, and B's handler never sees a cancel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_never_affects_a_newer_turn_of_the_session() -> anyhow::Result<()> {
    let d = TestDaemon::start(|c| c.turns.cancel_grace_ms = 300).await?;
    let lab = Lab::new();
    let w = lab.worker(&d.url, "w1").await;
    let c = d.caller().await?;
    let a = c.submit_simple("s", F, input("ignore", "a")).await?;
    let b = c.submit_simple("s", F, input("hold", "b")).await?;
    let a_inv = lab.wait_started(&a.turn_id).await?;

    c.stop(&a.turn_id, "stop a only").await?;
    let a_done = wait_done(&c, &a.turn_id, 3).await?;
    assert_cancelled(&a_done, "stop a only")?;
    let b_inv = lab.wait_started(&b.turn_id).await?;
    // A's handler finishes now: its result is late, while B's invocation is live.
    lab.release("a");
    eventually(5, "a's late result", || async {
        let evs = turn_events(&c, "s", &a.turn_id).await.ok()?;
        (count(&evs, EventKind::LateResult) == 1).then_some(())
    })
    .await?;
    ensure!(
        lab.cancel_seen(&a_inv) == Some(true),
        "a never saw its cancel"
    );
    let b_now = c.get(&b.turn_id).await?;
    ensure!(
        b_now.status == TurnStatus::Running
            && b_now.stop.is_none()
            && b_now.wait.as_ref().map(|w| w.state) == Some(WaitState::AwaitingResult),
        "b was touched: {b_now:?}"
    );
    lab.release("b");
    let b_done = assert_completes(&c, &b).await?;
    ensure!(b_done.stop.is_none(), "{b_done:?}");
    ensure!(
        lab.cancel_seen(&b_inv) == Some(false) && lab.returned(&b_inv) == Some("complete"),
        "b's handler was cancelled"
    );
    ensure!(
        c.get(&a.turn_id).await? == a_done,
        "a changed after its end"
    );

    let a_evs = turn_events(&c, "s", &a.turn_id).await?;
    assert_stop_story(&a_evs, true, EventKind::Cancelled)?;
    let b_evs = turn_events(&c, "s", &b.turn_id).await?;
    for k in [
        EventKind::StopRequested,
        EventKind::CancelSent,
        EventKind::LateResult,
        EventKind::Cancelled,
    ] {
        ensure!(count(&b_evs, k) == 0, "b has {k:?}: {:?}", kinds(&b_evs));
    }
    assert_one_terminal(&b_evs, EventKind::Completed)?;
    assert_store_clean(&d.url).await?;
    w.shutdown();
    d.shutdown().await
}

/// 14. A stop is durable before it is acknowledged and terminalizes through storage
///     faults: a stop whose write is refused answers `unavailable` and changes nothing
///     (no `stop` on the turn, no event, the turn still awaits its result); the grace
///     expiry whose write is refused is retried — the turn shows `finalizing` — until
///     the turn is cancelled, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_is_durable_before_its_ack_and_ends_through_write_faults() -> anyhow::Result<()> {
    const GRACE: u64 = 300;
    let d = TestDaemon::start_faulty(|c| c.turns.cancel_grace_ms = GRACE).await?;
    let faults = d.faults.clone().context("a faulty store")?;
    let lab = Lab::new();
    let w = lab.worker(&d.url, "w1").await;
    let c = d.caller().await?;
    let a = c.submit_simple("s", F, input("ignore", "a")).await?;
    let next = c.submit_simple("s", F, input("echo", "next")).await?;
    lab.wait_started(&a.turn_id).await?;
    let events_before = all_events(&c, "s").await?.len();

    faults.fail_matching(br#""kind":"stop_requested""#, 1);
    let err = c
        .stop(&a.turn_id, "refused")
        .await
        .expect_err("a stop whose write failed was acknowledged");
    ensure!(
        err.code() == Some(turnd_proto::ErrorCode::Unavailable),
        "{err}"
    );
    ensure!(faults.matching_left() == 0, "the stop never tried to write");
    let t = c.get(&a.turn_id).await?;
    ensure!(
        t.stop.is_none()
            && t.status == TurnStatus::Running
            && t.wait.as_ref().map(|w| w.state) == Some(WaitState::AwaitingResult),
        "a refused stop changed the turn: {t:?}"
    );
    ensure!(
        all_events(&c, "s").await?.len() == events_before,
        "a refused stop wrote events"
    );

    faults.fail_matching(br#""kind":"cancelled""#, 3);
    let stopped = c.stop(&a.turn_id, "second try").await?;
    assert_cancelling(&stopped, "second try", GRACE)?;
    eventually(5, "the cancel to show finalizing", || async {
        let t = c.get(&a.turn_id).await.ok()?;
        (t.wait?.state == WaitState::Finalizing).then_some(())
    })
    .await?;
    let done = wait_done(&c, &a.turn_id, 5).await?;
    assert_cancelled(&done, "second try")?;
    ensure!(faults.matching_left() == 0, "not every fault was hit");
    assert_completes(&c, &next).await?;

    let evs = turn_events(&c, "s", &a.turn_id).await?;
    assert_stop_story(&evs, true, EventKind::Cancelled)?;
    lab.release("a");
    assert_store_clean(&d.url).await?;
    w.shutdown();
    d.shutdown().await
}

/// A raw worker `raw` (instance `raw-1`) serving `f` with the given extra settings.
async fn raw_worker(url: &str, settings: Value) -> anyhow::Result<Raw> {
    let (mut raw, _) = Raw::hello(
        url,
        "worker",
        json!({"worker_id": "raw", "instance_id": "raw-1"}),
    )
    .await?;
    let mut args = json!({"function_id": F, "concurrency": 2});
    if let (Some(a), Some(extra)) = (args.as_object_mut(), settings.as_object()) {
        a.extend(extra.clone());
    }
    raw.ok("function.register", args).await?;
    Ok(raw)
}

/// The next push of `kind` (other pushes in between are an error).
async fn expect_push(raw: &mut Raw, kind: &str) -> anyhow::Result<Value> {
    let p = raw.next_push().await?;
    ensure!(p["push"] == kind, "expected a {kind} push, got {p}");
    Ok(p)
}

/// 15. Stop racing a redispatch: the worker says it never got the first invocation,
///     the daemon dispatches again, and the stop that follows is keyed to the new
///     invocation — the `cancel` names it, the first invocation's result is only late
///     evidence, and the worker's `cancelled` for the new one ends the turn once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_after_a_redispatch_targets_the_current_invocation() -> anyhow::Result<()> {
    let d = TestDaemon::start(|c| c.turns.cancel_grace_ms = 5_000).await?;
    let mut raw = raw_worker(&d.url, json!({"timeout_ms": 200})).await?;
    let c = d.caller().await?;
    let a = c.submit_simple("s", F, json!({"a": 1})).await?;
    let next = c.submit_simple("s", F, json!({"next": 1})).await?;
    let inv1 = expect_push(&mut raw, "invoke").await?["invocation_id"].clone();
    let probe = expect_push(&mut raw, "probe").await?;
    ensure!(probe["invocation_id"] == inv1, "{probe}");
    // The next dispatch gets a minute: the stop below must find its invocation
    // still live, not probed, however slowly this machine runs.
    raw.ok(
        "function.register",
        json!({"function_id": F, "concurrency": 2, "timeout_ms": 60_000}),
    )
    .await?;
    raw.ok(
        "invocation.status",
        json!({"invocation_id": inv1, "state": "unknown"}),
    )
    .await?;
    let invoke2 = expect_push(&mut raw, "invoke").await?;
    let inv2 = invoke2["invocation_id"].clone();
    ensure!(
        inv2 != inv1 && invoke2["turn_id"] == a.turn_id.as_str(),
        "{invoke2}"
    );

    let stopped = c.stop(&a.turn_id, "after redispatch").await?;
    assert_cancelling(&stopped, "after redispatch", 5_000)?;
    ensure!(
        stopped
            .wait
            .as_ref()
            .and_then(|w| w.invocation_id.as_deref())
            == inv2.as_str(),
        "{:?}",
        stopped.wait
    );
    let cancel = expect_push(&mut raw, "cancel").await?;
    ensure!(cancel["invocation_id"] == inv2, "cancel names {cancel}");

    let r1 = raw
        .ok(
            "invocation.result",
            json!({"invocation_id": inv1, "outcome": {"complete": {"first": true}}}),
        )
        .await?;
    ensure!(r1["accepted"] == "late", "{r1}");
    ensure!(
        !c.get(&a.turn_id).await?.status.is_terminal(),
        "the old invocation's result ended the turn"
    );
    let r2 = raw
        .ok(
            "invocation.result",
            json!({"invocation_id": inv2, "outcome": {"cancelled": {"message": "ok"}}}),
        )
        .await?;
    ensure!(r2["accepted"] == "applied", "{r2}");
    let done = wait_done(&c, &a.turn_id, 3).await?;
    assert_cancelled(&done, "after redispatch")?;

    let invoke3 = expect_push(&mut raw, "invoke").await?;
    ensure!(invoke3["turn_id"] == next.turn_id.as_str(), "{invoke3}");
    raw.ok(
        "invocation.result",
        json!({"invocation_id": invoke3["invocation_id"], "outcome": {"complete": {"next": 1}}}),
    )
    .await?;
    assert_completes(&c, &next).await?;

    let evs = turn_events(&c, "s", &a.turn_id).await?;
    assert_stop_story(&evs, true, EventKind::Cancelled)?;
    ensure!(
        pos(&evs, EventKind::Redispatched) < pos(&evs, EventKind::StopRequested)
            && count(&evs, EventKind::LateResult) == 1,
        "{:?}",
        kinds(&evs)
    );
    assert_store_clean(&d.url).await?;
    d.shutdown().await
}

/// 16. Stop racing a disconnect: the `cancel` was pushed, then the worker's connection
///     drops before it answers. Nobody can answer any more, so the turn is cancelled at
///     once instead of waiting out a long grace; the successor runs on another worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_lost_during_the_cancel_grace_cancels_at_once() -> anyhow::Result<()> {
    const GRACE: u64 = 10_000;
    let d = TestDaemon::start(|c| {
        c.turns.cancel_grace_ms = GRACE;
        c.turns.reconnect_grace_ms = 10_000;
    })
    .await?;
    let mut raw = raw_worker(&d.url, json!({})).await?;
    let c = d.caller().await?;
    let a = c.submit_simple("s", F, json!({"a": 1})).await?;
    let next = c.submit_simple("s", F, input("echo", "next")).await?;
    let inv = expect_push(&mut raw, "invoke").await?["invocation_id"].clone();
    let stopped = c.stop(&a.turn_id, "then the worker died").await?;
    assert_cancelling(&stopped, "then the worker died", GRACE)?;
    let cancel = expect_push(&mut raw, "cancel").await?;
    ensure!(cancel["invocation_id"] == inv, "{cancel}");
    drop(raw);

    let done = wait_done(&c, &a.turn_id, 3).await?;
    assert_cancelled(&done, "then the worker died")?;
    let lab = Lab::new();
    let w = lab.worker(&d.url, "w2").await;
    assert_completes(&c, &next).await?;
    let evs = turn_events(&c, "s", &a.turn_id).await?;
    assert_stop_story(&evs, true, EventKind::Cancelled)?;
    assert_store_clean(&d.url).await?;
    w.shutdown();
    d.shutdown().await
}

/// 17. After a stop abandoned the invocation of a disconnected worker, the same
///     instance comes back still running it (`inflight`). The turn stays cancelled
///     (tested above); the worker must also learn that its work is void — a `cancel`
///     push for the invocation, or the invocation in `reconciled` — otherwise the
///     stopped work runs on unaware (PROTOCOL: `reconciled` "tells the worker what the
///     server concluded about every invocation it had assigned to this worker_id").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnecting_worker_learns_its_stopped_invocation_is_void() -> anyhow::Result<()> {
    let d = TestDaemon::start(|c| c.turns.reconnect_grace_ms = 10_000).await?;
    let mut raw = raw_worker(&d.url, json!({})).await?;
    let c = d.caller().await?;
    let a = c.submit_simple("s", F, json!({"a": 1})).await?;
    let inv = expect_push(&mut raw, "invoke").await?["invocation_id"].clone();
    drop(raw);
    eventually(5, "a awaiting_reconnect", || async {
        let t = c.get(&a.turn_id).await.ok()?;
        (t.wait?.state == WaitState::AwaitingReconnect).then_some(())
    })
    .await?;
    let stopped = c.stop(&a.turn_id, "worker gone").await?;
    assert_cancelled(&stopped, "worker gone")?;

    let (mut raw, hello) = Raw::hello(
        &d.url,
        "worker",
        json!({"worker_id": "raw", "instance_id": "raw-1", "inflight": [inv]}),
    )
    .await?;
    let reconciled = &hello["ok"]["reconciled"];
    let listed = ["kept", "redispatched", "unknown"]
        .iter()
        .any(|k| reconciled[k].as_array().is_some_and(|v| v.contains(&inv)));
    ensure!(
        !reconciled["kept"]
            .as_array()
            .is_some_and(|v| v.contains(&inv)),
        "a stopped invocation reported as kept: {hello}"
    );
    let cancelled = match tokio::time::timeout(Duration::from_millis(1_500), raw.next_push()).await
    {
        Ok(p) => {
            let p = p?;
            p["push"] == "cancel" && p["invocation_id"] == inv
        }
        Err(_) => false,
    };
    ensure!(
        listed || cancelled,
        "the worker was never told that {inv} is void: hello {hello}, no cancel push"
    );
    ensure!(
        c.get(&a.turn_id).await? == stopped,
        "the reconnect changed a"
    );
    d.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_wins_over_the_turns_own_deadline_during_the_grace() -> anyhow::Result<()> {
    // Stopped first, then its turn_timeout_ms passes while the worker ignores the
    // cancel: the turn ends cancelled (the stop is what ended it), not timed out.
    // The deadline leaves the stop 3 s to land first, however slowly this machine
    // runs, and passes long before the grace would end the turn.
    let td = TestDaemon::start(|c| {
        c.turns.cancel_grace_ms = 60_000;
        turnd_tests::quiet_raw_peers(c);
    })
    .await?;
    let c = td.caller().await?;
    let (mut w, _) = Raw::hello(
        &td.url,
        "worker",
        json!({"worker_id": "w-dl", "instance_id": "i"}),
    )
    .await?;
    w.ok("function.register", json!({"function_id": "hang"}))
        .await?;
    let t = c
        .submit(turnd_proto::SubmitArgs {
            session_id: "dl".into(),
            function_id: "hang".into(),
            input: json!(null),
            idempotency_key: None,
            turn_timeout_ms: Some(3_000),
            on_busy: None,
        })
        .await?
        .turn;
    let _invoke = w.next_push().await?;
    let stopped = c.stop(&t.turn_id, "user pressed stop").await?;
    assert_eq!(stopped.status, TurnStatus::Running);
    let done = wait_done(&c, &t.turn_id, 30).await?;
    assert_eq!(done.status, TurnStatus::Cancelled, "{done:?}");
    assert_eq!(
        done.stop.map(|s| s.reason),
        Some("user pressed stop".to_string())
    );
    assert!(done.error.is_none());
    td.shutdown().await
}
