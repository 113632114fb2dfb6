//! Lost results, dispatches and workers, reconciled in bounded time (semantics: Loss,
//! Late results, Identity and fencing).
//!
//! Every case runs the real daemon with short timers (probe 300 ms, reconnect grace
//! 600 ms, cancel grace 300 ms), workers connected through the fault-injecting proxy of
//! `turnd-testkit` and callers connected directly. Each case checks that the turn ends
//! where the semantics say, within the timer that bounds it (the measured time is
//! printed as `reconciliation [case]: N ms (bounded by …)`), that the session's next
//! turn runs afterwards, that the handler ran as often as the delivery mode allows
//! (counted by the kit's workers), and that `store.check` finds nothing.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use serde_json::{json, Value};
use turnd_client::turnd_proto::{
    Delivery, ErrorCause, Event, EventKind, ListArgs, Turn, TurnStatus, WaitState,
};
use turnd_client::{Caller, FunctionSpec};
use turnd_server::Config;
use turnd_testkit::{
    Act, Dir, Gate, Instance, KitWorker, Match, Proxy, Rule, Runs, Script, SplitMix64,
};
use turnd_tests::{all_events, event_kinds, eventually, wait_done, BinDaemon, Raw, TestDaemon};

/// Timers of the test config (tests/support `test_config`), named for the reports.
const PROBE_TIMEOUT_MS: u64 = 300;
const RECONNECT_GRACE_MS: u64 = 600;
const CANCEL_GRACE_MS: u64 = 300;
/// The kit workers' `result_ack_timeout`.
const RESULT_ACK_TIMEOUT_MS: u64 = 300;
/// What a measured reconciliation may exceed its bounding timer by: scheduling, a
/// debug build and two fsyncs on a shared 2-core machine, never another timer's worth.
const SLACK_MS: u64 = 1_000;
/// How long a single turn may take to end in these tests.
const TURN_SECS: u64 = 15;

/// A daemon, a proxy in front of it for the workers, and direct callers.
struct Rig {
    td: TestDaemon,
    proxy: Proxy,
    caller: Caller,
    operator: Caller,
}

impl Rig {
    async fn start(f: impl FnOnce(&mut Config)) -> anyhow::Result<Rig> {
        let td = TestDaemon::start(f).await?;
        let proxy = Proxy::start(td.url.clone()).await?;
        let caller = td.caller().await?;
        let operator = td.operator().await?;
        Ok(Rig {
            td,
            proxy,
            caller,
            operator,
        })
    }

    /// A kit worker connected through the proxy, serving one scripted function.
    async fn worker(&self, worker_id: &str, spec: FunctionSpec, script: Script) -> KitWorker {
        KitWorker::builder(&self.proxy.url(), worker_id)
            .function(spec, script)
            .start()
            .await
    }

    /// The daemon's clock (the one event `at_ms` values come from).
    fn now_ms(&self) -> u64 {
        self.td.engine().now_ms()
    }

    async fn submit(&self, session: &str, function: &str, input: Value) -> anyhow::Result<Turn> {
        Ok(self.caller.submit_simple(session, function, input).await?)
    }

    async fn done(&self, turn_id: &str) -> anyhow::Result<Turn> {
        Ok(self
            .caller
            .wait_terminal(turn_id, Duration::from_secs(TURN_SECS))
            .await?)
    }

    async fn events(&self, session: &str) -> anyhow::Result<Vec<Event>> {
        all_events(&self.caller, session).await
    }

    /// Submit the session's next turn and see it complete, run exactly once.
    async fn next_turn_completes(
        &self,
        session: &str,
        function: &str,
        runs: &Runs,
    ) -> anyhow::Result<Turn> {
        let input = json!({"next": session});
        let t = self.submit(session, function, input.clone()).await?;
        let done = self.done(&t.turn_id).await?;
        ensure!(
            done.status == TurnStatus::Completed,
            "the session's next turn did not complete: {done:?}"
        );
        ensure!(done.output == Some(input), "next turn output: {done:?}");
        ensure!(
            runs.for_turn(&t.turn_id) == 1,
            "the next turn ran {} times",
            runs.for_turn(&t.turn_id)
        );
        Ok(done)
    }

    async fn assert_store_clean(&self) -> anyhow::Result<()> {
        store_clean(&self.operator).await
    }
}

async fn store_clean(operator: &Caller) -> anyhow::Result<()> {
    let violations = operator.store_check().await?;
    ensure!(violations.is_empty(), "store.check: {violations:?}");
    Ok(())
}

fn count(events: &[Event], turn_id: &str, kind: EventKind) -> usize {
    events
        .iter()
        .filter(|e| e.turn_id == turn_id && e.kind == kind)
        .count()
}

fn first<'a>(events: &'a [Event], turn_id: &str, kind: EventKind) -> anyhow::Result<&'a Event> {
    events
        .iter()
        .find(|e| e.turn_id == turn_id && e.kind == kind)
        .with_context(|| {
            format!(
                "no {kind:?} event for {turn_id}; events: {:?}",
                event_kinds(events, turn_id)
            )
        })
}

fn inv_of(e: &Event) -> &str {
    e.detail
        .get("invocation_id")
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// Print a measured reconciliation and check it stayed within its bound.
fn report(case: &str, from_ms: u64, to_ms: u64, bound: &str, bound_ms: u64) -> anyhow::Result<u64> {
    let took = to_ms.saturating_sub(from_ms);
    eprintln!("reconciliation [{case}]: {took} ms (bounded by {bound} = {bound_ms} ms)");
    ensure!(
        took <= bound_ms + SLACK_MS,
        "[{case}] took {took} ms, more than {bound} ({bound_ms} ms) + {SLACK_MS} ms"
    );
    Ok(took)
}

/// Wall-clock Unix ms, for daemons in another process.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------- a

/// a. The first `invocation.result` is lost on the wire; the SDK resends it after
/// `result_ack_timeout`, the daemon takes it once, the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_result_is_resent_and_applied_once() -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let w = rig
        .worker("w-a", FunctionSpec::new("fa"), Script::new(Act::Echo))
        .await;
    let runs = w.runs("fa");
    let rule = rig
        .proxy
        .drop_next(Dir::ToServer, Match::op("invocation.result"), 1);

    let input = json!({"case": "a"});
    let t = rig.submit("s-a", "fa", input.clone()).await?;
    let done = rig.done(&t.turn_id).await?;
    ensure!(done.status == TurnStatus::Completed, "{done:?}");
    ensure!(done.output == Some(input) && !done.recovered, "{done:?}");
    ensure!(
        rig.proxy.hits(rule) == 1,
        "the result frame was not dropped"
    );
    ensure!(
        runs.for_turn(&t.turn_id) == 1,
        "handler ran {} times",
        runs.count()
    );
    ensure!(
        w.handle().stats().results_resent >= 1,
        "no resend: {:?}",
        w.handle().stats()
    );

    // Two result frames went out (one lost), one was applied.
    let results = rig
        .proxy
        .frames_matching(Dir::ToServer, &Match::op("invocation.result"));
    ensure!(results.len() >= 2, "result frames: {}", results.len());
    // The answer may reach the proxy after the turn's end reached the direct caller.
    let applied = Match::field("/ok/accepted", json!("applied"));
    ensure!(
        rig.proxy
            .wait_frames(Dir::ToClient, &applied, 1, Duration::from_secs(5))
            .await
    );
    ensure!(rig.proxy.count(Dir::ToClient, &applied) == 1);

    let ev = rig.events("s-a").await?;
    ensure!(count(&ev, &t.turn_id, EventKind::Result) == 1);
    for k in [
        EventKind::ProbeSent,
        EventKind::Redispatched,
        EventKind::OutcomeUnknown,
    ] {
        ensure!(
            count(&ev, &t.turn_id, k) == 0,
            "unexpected {k:?}: {:?}",
            event_kinds(&ev, &t.turn_id)
        );
    }
    let dispatched = first(&ev, &t.turn_id, EventKind::Dispatched)?;
    let completed = first(&ev, &t.turn_id, EventKind::Completed)?;
    report(
        "a: result frame lost, resent",
        dispatched.at_ms,
        completed.at_ms,
        "result_ack_timeout_ms",
        RESULT_ACK_TIMEOUT_MS,
    )?;

    rig.next_turn_completes("s-a", "fa", &runs).await?;
    rig.assert_store_clean().await
}

// ---------------------------------------------------------------------------- b

/// b. The `invoke` push is lost: at the attempt's deadline the daemon probes, the
/// worker answers `unknown`, and the step is dispatched again (same attempt, new
/// invocation id); the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_invoke_is_probed_and_redispatched() -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let timeout_ms = 300;
    let w = rig
        .worker(
            "w-b",
            FunctionSpec::new("fb").timeout_ms(timeout_ms),
            Script::new(Act::Echo),
        )
        .await;
    let runs = w.runs("fb");
    let rule = rig.proxy.drop_next(Dir::ToClient, Match::push("invoke"), 1);

    let input = json!({"case": "b"});
    let t = rig.submit("s-b", "fb", input.clone()).await?;
    let done = rig.done(&t.turn_id).await?;
    ensure!(
        done.status == TurnStatus::Completed && done.output == Some(input),
        "{done:?}"
    );
    ensure!(
        done.attempt == 1,
        "a lost dispatch keeps its attempt: {done:?}"
    );
    ensure!(rig.proxy.hits(rule) == 1);

    let ev = rig.events("s-b").await?;
    let dispatched = first(&ev, &t.turn_id, EventKind::Dispatched)?;
    let probe = first(&ev, &t.turn_id, EventKind::ProbeSent)?;
    let redispatched = first(&ev, &t.turn_id, EventKind::Redispatched)?;
    let completed = first(&ev, &t.turn_id, EventKind::Completed)?;
    let lost = inv_of(dispatched);
    ensure!(inv_of(probe) == lost);
    ensure!(
        redispatched.detail["previous_invocation_id"] == json!(lost)
            && inv_of(redispatched) != lost
            && redispatched.detail["attempt"] == json!(1),
        "{redispatched:?}"
    );
    ensure!(count(&ev, &t.turn_id, EventKind::OutcomeUnknown) == 0);
    // The worker said it never got it, and ran only the second invocation.
    let unknown = Match::op("invocation.status")
        .and(Match::field("/args/state", json!("unknown")))
        .and(Match::invocation(lost));
    ensure!(
        rig.proxy.count(Dir::ToServer, &unknown) == 1,
        "no `unknown` status"
    );
    ensure!(
        runs.for_turn(&t.turn_id) == 1,
        "handler ran {} times",
        runs.count()
    );
    ensure!(runs.invocations()[0].invocation_id == inv_of(redispatched));

    report(
        "b: invoke lost -> redispatched",
        dispatched.at_ms,
        redispatched.at_ms,
        "timeout_ms + probe_timeout_ms",
        timeout_ms + PROBE_TIMEOUT_MS,
    )?;
    report(
        "b: invoke lost -> completed",
        dispatched.at_ms,
        completed.at_ms,
        "timeout_ms + probe_timeout_ms",
        timeout_ms + PROBE_TIMEOUT_MS,
    )?;

    rig.next_turn_completes("s-b", "fb", &runs).await?;
    rig.assert_store_clean().await
}

// ---------------------------------------------------------------------------- c

/// c (at_most_once). A handler hangs past its deadline and ignores `cancel`: probe →
/// `running` → `cancel` → after `cancel_grace_ms` the turn fails `timed_out`, never
/// run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_handler_ignoring_cancel_times_out_at_most_once() -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let timeout_ms = 300;
    let w = rig
        .worker(
            "w-c1",
            FunctionSpec::new("fc1").timeout_ms(timeout_ms),
            Script::new(Act::Echo).then(Act::Hang),
        )
        .await;
    let runs = w.runs("fc1");

    let t = rig.submit("s-c1", "fc1", json!({"case": "c1"})).await?;
    let done = rig.done(&t.turn_id).await?;
    ensure!(done.status == TurnStatus::Failed, "{done:?}");
    let error = done.error.clone().context("failed without error")?;
    ensure!(error.cause == ErrorCause::TimedOut, "{error:?}");

    let ev = rig.events("s-c1").await?;
    let dispatched = first(&ev, &t.turn_id, EventKind::Dispatched)?;
    let inv = inv_of(dispatched).to_string();
    ensure!(
        error.invocation_id.as_deref() == Some(inv.as_str()),
        "{error:?}"
    );
    let failed = first(&ev, &t.turn_id, EventKind::Failed)?;
    ensure!(
        event_kinds(&ev, &t.turn_id)
            == vec![
                EventKind::Admitted,
                EventKind::Dispatched,
                EventKind::ProbeSent,
                EventKind::CancelSent,
                EventKind::Failed
            ],
        "{:?}",
        event_kinds(&ev, &t.turn_id)
    );
    let running = Match::op("invocation.status").and(Match::field("/args/state", json!("running")));
    ensure!(rig.proxy.count(Dir::ToServer, &running) == 1);
    ensure!(
        rig.proxy.count(
            Dir::ToClient,
            &Match::push("cancel").and(Match::invocation(&inv))
        ) == 1
    );
    ensure!(
        runs.for_turn(&t.turn_id) == 1,
        "at_most_once ran {} times",
        runs.count()
    );

    report(
        "c: hung handler (at_most_once) -> failed timed_out",
        dispatched.at_ms,
        failed.at_ms,
        "timeout_ms + probe_timeout_ms + cancel_grace_ms",
        timeout_ms + PROBE_TIMEOUT_MS + CANCEL_GRACE_MS,
    )?;

    rig.next_turn_completes("s-c1", "fc1", &runs).await?;
    ensure!(
        runs.for_turn(&t.turn_id) == 1,
        "the timed-out step ran again"
    );
    rig.assert_store_clean().await
}

/// c (at_least_once, max_attempts 2). The hung attempt times out the same way, and
/// attempt 2 is dispatched and completes: two executions, as allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_handler_ignoring_cancel_is_retried_at_least_once() -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let timeout_ms = 300;
    let w = rig
        .worker(
            "w-c2",
            FunctionSpec::new("fc2")
                .timeout_ms(timeout_ms)
                .delivery(Delivery::AtLeastOnce)
                .max_attempts(2),
            Script::new(Act::Echo).then(Act::Hang),
        )
        .await;
    let runs = w.runs("fc2");

    let input = json!({"case": "c2"});
    let t = rig.submit("s-c2", "fc2", input.clone()).await?;
    let done = rig.done(&t.turn_id).await?;
    ensure!(
        done.status == TurnStatus::Completed && done.output == Some(input),
        "{done:?}"
    );
    ensure!(done.attempt == 2, "{done:?}");
    ensure!(
        runs.for_turn(&t.turn_id) == 2,
        "ran {} times",
        runs.for_turn(&t.turn_id)
    );

    let ev = rig.events("s-c2").await?;
    let k = event_kinds(&ev, &t.turn_id);
    ensure!(
        k == vec![
            EventKind::Admitted,
            EventKind::Dispatched,
            EventKind::ProbeSent,
            EventKind::CancelSent,
            EventKind::RetryScheduled,
            EventKind::Dispatched,
            EventKind::Result,
            EventKind::Completed
        ],
        "{k:?}"
    );
    let dispatches: Vec<&Event> = ev
        .iter()
        .filter(|e| e.turn_id == t.turn_id && e.kind == EventKind::Dispatched)
        .collect();
    ensure!(dispatches[1].detail["attempt"] == json!(2));
    report(
        "c: hung handler (at_least_once) -> attempt 2 dispatched",
        dispatches[0].at_ms,
        dispatches[1].at_ms,
        "timeout_ms + probe_timeout_ms + cancel_grace_ms + retry_backoff_ms",
        timeout_ms + PROBE_TIMEOUT_MS + CANCEL_GRACE_MS + 20,
    )?;

    rig.next_turn_completes("s-c2", "fc2", &runs).await?;
    rig.assert_store_clean().await
}

/// c (the cancel honoured). A handler runs past its deadline and honours the
/// `cancel` that follows the probe's `running`: the deadline ended the attempt, so
/// the turn fails `timed_out` naming the invocation, with no stop record, never
/// "cancelled by the worker" (nobody asked it to stop). Under `at_least_once` with
/// attempts left, the next attempt runs instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_cancel_honoured_by_the_handler_fails_timed_out_not_cancelled(
) -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let timeout_ms = 300;
    let w = rig
        .worker(
            "w-c3",
            FunctionSpec::new("fc3").timeout_ms(timeout_ms),
            Script::new(Act::Echo).then(Act::HangUntilCancelled),
        )
        .await;
    let runs = w.runs("fc3");
    let t = rig.submit("s-c3", "fc3", json!({"case": "c3"})).await?;
    let done = rig.done(&t.turn_id).await?;
    ensure!(done.status == TurnStatus::Failed, "{done:?}");
    ensure!(done.stop.is_none(), "{done:?}");
    let error = done.error.clone().context("failed without error")?;
    ensure!(error.cause == ErrorCause::TimedOut, "{error:?}");
    ensure!(error.code == "timed_out", "{error:?}");
    ensure!(error.message.contains("ran past its deadline"), "{error:?}");
    let ev = rig.events("s-c3").await?;
    let inv = inv_of(first(&ev, &t.turn_id, EventKind::Dispatched)?).to_string();
    ensure!(
        error.invocation_id.as_deref() == Some(inv.as_str()),
        "{error:?}"
    );
    ensure!(
        event_kinds(&ev, &t.turn_id)
            == vec![
                EventKind::Admitted,
                EventKind::Dispatched,
                EventKind::ProbeSent,
                EventKind::CancelSent,
                EventKind::Result,
                EventKind::Failed
            ],
        "{:?}",
        event_kinds(&ev, &t.turn_id)
    );
    ensure!(runs.for_turn(&t.turn_id) == 1);

    // at_least_once, two attempts: the honoured cancel schedules attempt 2.
    let w2 = rig
        .worker(
            "w-c4",
            FunctionSpec::new("fc4")
                .timeout_ms(timeout_ms)
                .delivery(Delivery::AtLeastOnce)
                .max_attempts(2),
            Script::new(Act::Echo).then(Act::HangUntilCancelled),
        )
        .await;
    let runs2 = w2.runs("fc4");
    let input = json!({"case": "c4"});
    let t2 = rig.submit("s-c4", "fc4", input.clone()).await?;
    let done = rig.done(&t2.turn_id).await?;
    ensure!(
        done.status == TurnStatus::Completed && done.output == Some(input) && done.attempt == 2,
        "{done:?}"
    );
    ensure!(runs2.for_turn(&t2.turn_id) == 2);
    let ev = rig.events("s-c4").await?;
    ensure!(
        event_kinds(&ev, &t2.turn_id)
            == vec![
                EventKind::Admitted,
                EventKind::Dispatched,
                EventKind::ProbeSent,
                EventKind::CancelSent,
                EventKind::Result,
                EventKind::RetryScheduled,
                EventKind::Dispatched,
                EventKind::Result,
                EventKind::Completed
            ],
        "{:?}",
        event_kinds(&ev, &t2.turn_id)
    );
    rig.assert_store_clean().await
}

// ---------------------------------------------------------------------------- d

/// d (at_most_once). The worker dies mid-step and never returns: after
/// `reconnect_grace_ms` the turn fails `outcome_unknown` naming the invocation, the
/// step is never run again, and the session moves on (on another worker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_dies_mid_step_at_most_once_fails_outcome_unknown() -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let spec = FunctionSpec::new("fd1");
    let script = Script::new(Act::Echo).then(Act::Hang);
    let w = rig.worker("w-d1", spec.clone(), script.clone()).await;
    let runs = w.runs("fd1");

    let t = rig.submit("s-d1", "fd1", json!({"case": "d1"})).await?;
    let invoke = runs
        .wait_for(1, Duration::from_secs(5))
        .await
        .context("the step never started")?;
    let lost_at = rig.now_ms();
    w.die();
    rig.proxy.cut_worker("w-d1");

    let done = rig.done(&t.turn_id).await?;
    ensure!(done.status == TurnStatus::Failed, "{done:?}");
    let error = done.error.clone().context("no error")?;
    ensure!(error.cause == ErrorCause::OutcomeUnknown, "{error:?}");
    ensure!(
        error.invocation_id.as_deref() == Some(invoke.invocation_id.as_str()),
        "{error:?}"
    );

    let ev = rig.events("s-d1").await?;
    let unknown = first(&ev, &t.turn_id, EventKind::OutcomeUnknown)?;
    ensure!(inv_of(unknown) == invoke.invocation_id);
    ensure!(count(&ev, &t.turn_id, EventKind::Redispatched) == 0);
    ensure!(count(&ev, &t.turn_id, EventKind::Dispatched) == 1);
    let failed = first(&ev, &t.turn_id, EventKind::Failed)?;
    report(
        "d: worker died (at_most_once) -> failed outcome_unknown",
        lost_at,
        failed.at_ms,
        "reconnect_grace_ms",
        RECONNECT_GRACE_MS,
    )?;

    // Another worker takes the session's next turn; the lost step never runs again.
    let w2 = KitWorker::builder(&rig.proxy.url(), "w-d1-other")
        .function_with(spec, script, runs.clone())
        .start()
        .await;
    rig.next_turn_completes("s-d1", "fd1", &runs).await?;
    ensure!(
        runs.for_turn(&t.turn_id) == 1,
        "at_most_once step ran again"
    );
    drop(w2);
    rig.assert_store_clean().await
}

/// d (at_least_once). The worker dies mid-step and restarts at once (same
/// `worker_id`, new `instance_id`): its `hello` makes the outcome unknown without
/// waiting for the grace, and attempt 2 runs on the restarted worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_dies_and_restarts_at_least_once_redispatches() -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let w = rig
        .worker(
            "w-d2",
            FunctionSpec::new("fd2")
                .delivery(Delivery::AtLeastOnce)
                .max_attempts(3),
            Script::new(Act::Echo).then(Act::Hang),
        )
        .await;
    let runs = w.runs("fd2");

    let input = json!({"case": "d2"});
    let t = rig.submit("s-d2", "fd2", input.clone()).await?;
    let invoke = runs
        .wait_for(1, Duration::from_secs(5))
        .await
        .context("the step never started")?;
    let lost_at = rig.now_ms();
    w.die();
    rig.proxy.cut_worker("w-d2");
    let restarted = w.respawn(Instance::New);
    ensure!(restarted.instance_id() != w.instance_id());

    let done = rig.done(&t.turn_id).await?;
    ensure!(
        done.status == TurnStatus::Completed && done.output == Some(input),
        "{done:?}"
    );
    ensure!(done.attempt == 2, "{done:?}");
    let rec = restarted
        .handle()
        .last_reconciled()
        .context("no hello answer")?;
    ensure!(rec.unknown.contains(&invoke.invocation_id), "{rec:?}");
    ensure!(
        runs.for_turn(&t.turn_id) == 2,
        "ran {} times",
        runs.for_turn(&t.turn_id)
    );

    let ev = rig.events("s-d2").await?;
    let unknown = first(&ev, &t.turn_id, EventKind::OutcomeUnknown)?;
    ensure!(inv_of(unknown) == invoke.invocation_id);
    // Attempt 2: `redispatched` when a worker was free at once, else `dispatched` once
    // the restarted worker registered (its hello comes before its registrations).
    let redispatched = ev
        .iter()
        .find(|e| {
            e.turn_id == t.turn_id
                && matches!(e.kind, EventKind::Dispatched | EventKind::Redispatched)
                && e.detail["attempt"] == json!(2)
        })
        .context("attempt 2 never dispatched")?;
    ensure!(redispatched.seq > unknown.seq);
    let completed = first(&ev, &t.turn_id, EventKind::Completed)?;
    report(
        "d: worker died, restarted as new instance (at_least_once) -> redispatched",
        lost_at,
        redispatched.at_ms,
        "the restarted worker's hello (reconnect_grace_ms at most)",
        RECONNECT_GRACE_MS,
    )?;
    report(
        "d: worker died, restarted as new instance (at_least_once) -> completed",
        lost_at,
        completed.at_ms,
        "reconnect_grace_ms",
        RECONNECT_GRACE_MS,
    )?;

    rig.next_turn_completes("s-d2", "fd2", &runs).await?;
    rig.assert_store_clean().await
}

/// d (at_least_once). The worker dies mid-step and never returns: after
/// `reconnect_grace_ms` attempt 2 is dispatched to another worker and completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_dies_for_good_at_least_once_moves_to_another_worker() -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let spec = FunctionSpec::new("fd3")
        .delivery(Delivery::AtLeastOnce)
        .max_attempts(2);
    let script = Script::new(Act::Echo).then(Act::Hang);
    let w = rig.worker("w-d3", spec.clone(), script.clone()).await;
    let runs = w.runs("fd3");

    let input = json!({"case": "d3"});
    let t = rig.submit("s-d3", "fd3", input.clone()).await?;
    runs.wait_for(1, Duration::from_secs(5))
        .await
        .context("the step never started")?;
    let lost_at = rig.now_ms();
    w.die();
    rig.proxy.cut_worker("w-d3");
    let other = KitWorker::builder(&rig.proxy.url(), "w-d3-other")
        .function_with(spec, script, runs.clone())
        .start()
        .await;

    let done = rig.done(&t.turn_id).await?;
    ensure!(
        done.status == TurnStatus::Completed && done.output == Some(input),
        "{done:?}"
    );
    ensure!(done.attempt == 2, "{done:?}");
    ensure!(runs.for_turn(&t.turn_id) == 2);

    let ev = rig.events("s-d3").await?;
    let unknown = first(&ev, &t.turn_id, EventKind::OutcomeUnknown)?;
    let redispatched = first(&ev, &t.turn_id, EventKind::Redispatched)?;
    ensure!(
        redispatched.detail["worker_id"] == json!("w-d3-other"),
        "{redispatched:?}"
    );
    report(
        "d: worker died for good (at_least_once) -> redispatched elsewhere",
        lost_at,
        unknown.at_ms,
        "reconnect_grace_ms",
        RECONNECT_GRACE_MS,
    )?;

    rig.next_turn_completes("s-d3", "fd3", &runs).await?;
    drop(other);
    rig.assert_store_clean().await
}

// ---------------------------------------------------------------------------- e

/// Submit a turn and wait until its step runs on a kit worker.
async fn start_step(
    rig: &Rig,
    w: &KitWorker,
    session: &str,
    function: &str,
) -> anyhow::Result<(Turn, turnd_client::turnd_proto::Invoke)> {
    let runs = w.runs(function);
    let before = runs.count();
    let t = rig
        .submit(session, function, json!({"case": session}))
        .await?;
    let invoke = runs
        .wait_for(before + 1, Duration::from_secs(5))
        .await
        .context("the step never started")?;
    Ok((t, invoke))
}

/// Cut `w`'s connection while its step runs, and let it reconnect (same instance, the
/// step in its `inflight`) once the daemon shows the invocation awaiting reconnect.
/// Returns the daemon time of the cut.
async fn cut_and_reconnect(
    rig: &Rig,
    w: &KitWorker,
    turn_id: &str,
    invocation_id: &str,
) -> anyhow::Result<u64> {
    rig.proxy.hold(true);
    let cut_at = rig.now_ms();
    ensure!(
        rig.proxy.cut_worker(w.worker_id()) == 1,
        "no connection to cut"
    );
    // The daemon noticed the loss: the invocation waits for its worker, with a deadline.
    let caller = &rig.caller;
    let wait = eventually(5, "awaiting_reconnect", || async {
        let turn = caller.get(turn_id).await.ok()?;
        turn.wait
            .filter(|w| w.state == WaitState::AwaitingReconnect)
    })
    .await?;
    ensure!(
        wait.deadline_ms.is_some(),
        "waiting without a deadline: {wait:?}"
    );
    let session = caller.get(turn_id).await?.session_id;
    let lock = caller
        .inspect(&session)
        .await?
        .lock
        .context("no lock holder")?;
    ensure!(
        lock.turn_id == turn_id && lock.wait.deadline_ms.is_some(),
        "session lock without a deadline: {lock:?}"
    );
    rig.proxy.hold(false);
    let handle = w.handle();
    eventually(5, "reconnect as the same instance", || async {
        handle
            .last_reconciled()
            .filter(|r| r.kept.iter().any(|k| k == invocation_id))
    })
    .await?;
    Ok(cut_at)
}

/// Wait until the daemon's clock passes `ms`.
async fn until_daemon_time(rig: &Rig, ms: u64) -> anyhow::Result<()> {
    let td = &rig.td;
    eventually(10, "daemon time", || async {
        (td.engine().now_ms() > ms).then_some(())
    })
    .await
}

/// e. The connection drops while the step runs; the SDK reconnects as the same
/// instance listing the step in `inflight`: the daemon keeps it (`reconciled.kept`),
/// and its result completes the turn. Nothing is re-run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_instance_reconnect_keeps_running_step() -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let gate = Gate::new();
    let w = rig
        .worker(
            "w-e",
            FunctionSpec::new("fe"),
            Script::new(Act::Echo).then(Act::Gate(gate.clone())),
        )
        .await;
    let runs = w.runs("fe");
    let (t, invoke) = start_step(&rig, &w, "s-e", "fe").await?;
    let inv = invoke.invocation_id;
    let cut_at = cut_and_reconnect(&rig, &w, &t.turn_id, &inv).await?;
    let kept_at = rig.now_ms();
    gate.open();

    let done = rig.done(&t.turn_id).await?;
    ensure!(
        done.status == TurnStatus::Completed && !done.recovered,
        "{done:?}"
    );
    ensure!(runs.for_turn(&t.turn_id) == 1);
    let ev = rig.events("s-e").await?;
    let k = event_kinds(&ev, &t.turn_id);
    ensure!(
        k == vec![
            EventKind::Admitted,
            EventKind::Dispatched,
            EventKind::Result,
            EventKind::Completed
        ],
        "{k:?}"
    );
    ensure!(inv_of(first(&ev, &t.turn_id, EventKind::Result)?) == inv);
    report(
        "e: connection cut, same instance back with the step inflight -> kept",
        cut_at,
        kept_at,
        "reconnect_grace_ms (the SDK reconnects within reconnect_delay)",
        RECONNECT_GRACE_MS,
    )?;

    rig.next_turn_completes("s-e", "fe", &runs).await?;
    rig.assert_store_clean().await
}

/// e'. A kept step keeps its own deadline: the reconnect grace only bounds the wait
/// for the worker. Here the step runs on for longer than the grace after the
/// reconnect, well within its 5 s `timeout_ms`; the daemon must not probe or cancel it.
/// (Regression: the reconnect-grace deadline used to replace the attempt's deadline.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_instance_reconnect_keeps_attempt_deadline() -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let gate = Gate::new();
    let w = rig
        .worker(
            "w-e2",
            FunctionSpec::new("fe2").timeout_ms(5_000),
            Script::new(Act::Echo).then(Act::Gate(gate.clone())),
        )
        .await;
    let runs = w.runs("fe2");
    let (t, invoke) = start_step(&rig, &w, "s-e2", "fe2").await?;
    let cut_at = cut_and_reconnect(&rig, &w, &t.turn_id, &invoke.invocation_id).await?;
    // Run on past the reconnect grace (counted from the cut) and a cancel grace.
    until_daemon_time(&rig, cut_at + RECONNECT_GRACE_MS + CANCEL_GRACE_MS + 200).await?;
    gate.open();
    let done = rig.done(&t.turn_id).await?;
    let ev = rig.events("s-e2").await?;
    ensure!(
        done.status == TurnStatus::Completed,
        "the kept step was cut short: {done:?}; events {:?}",
        event_kinds(&ev, &t.turn_id)
    );
    ensure!(count(&ev, &t.turn_id, EventKind::ProbeSent) == 0);
    ensure!(runs.for_turn(&t.turn_id) == 1);
    rig.next_turn_completes("s-e2", "fe2", &runs).await?;
    rig.assert_store_clean().await
}

/// e''. A heartbeat renews the attempt's deadline (`timeout_ms` after the last
/// heartbeat), and a same-instance reconnect must restore that renewed deadline, not
/// the one computed at dispatch: a step that heartbeats past its first deadline and
/// then loses its connection for a moment keeps running. (Regression: the heartbeat
/// once renewed only the wait deadline, and the reconnect restored the dispatch-time one.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_instance_reconnect_keeps_heartbeat_renewed_deadline() -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let gate = Gate::new();
    let timeout_ms = 600;
    let w = rig
        .worker(
            "w-e3",
            FunctionSpec::new("fe3").timeout_ms(timeout_ms),
            Script::new(Act::Echo).then(Act::Heartbeat {
                every: Duration::from_millis(150),
                until: gate.clone(),
            }),
        )
        .await;
    let runs = w.runs("fe3");
    let (t, invoke) = start_step(&rig, &w, "s-e3", "fe3").await?;
    // Heartbeats carry the step past the deadline it was dispatched with.
    until_daemon_time(&rig, invoke.deadline_ms + 300).await?;
    let ev = rig.events("s-e3").await?;
    ensure!(
        count(&ev, &t.turn_id, EventKind::ProbeSent) == 0,
        "heartbeats did not renew the deadline: {:?}",
        event_kinds(&ev, &t.turn_id)
    );
    let cut_at = cut_and_reconnect(&rig, &w, &t.turn_id, &invoke.invocation_id).await?;
    // Keep heartbeating a while after the reconnect, then finish.
    until_daemon_time(&rig, cut_at + CANCEL_GRACE_MS + 200).await?;
    gate.open();
    let done = rig.done(&t.turn_id).await?;
    let ev = rig.events("s-e3").await?;
    ensure!(
        done.status == TurnStatus::Completed,
        "the kept, heartbeating step was cut short: {done:?}; events {:?}",
        event_kinds(&ev, &t.turn_id)
    );
    ensure!(count(&ev, &t.turn_id, EventKind::ProbeSent) == 0);
    ensure!(runs.for_turn(&t.turn_id) == 1);
    rig.next_turn_completes("s-e3", "fe3", &runs).await?;
    rig.assert_store_clean().await
}

/// e'''. Supersede: the worker's side of the connection vanishes but the daemon's
/// side stays open (half-open), so the daemon still thinks the worker connected when
/// the SDK reconnects as the same instance. The new `hello` supersedes the old
/// connection, which fails nothing by itself: the step is kept and completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn supersede_by_same_instance_fails_nothing() -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let gate = Gate::new();
    let w = rig
        .worker(
            "w-l",
            FunctionSpec::new("fl"),
            Script::new(Act::Echo).then(Act::Gate(gate.clone())),
        )
        .await;
    let runs = w.runs("fl");
    let (t, invoke) = start_step(&rig, &w, "s-l", "fl").await?;
    let severed_at = rig.now_ms();
    ensure!(rig.proxy.half_open_worker("w-l") == 1);
    let handle = w.handle();
    let inv = invoke.invocation_id.clone();
    eventually(5, "the superseding hello", || async {
        handle.last_reconciled().filter(|r| r.kept.contains(&inv))
    })
    .await?;
    let kept_at = rig.now_ms();
    // The daemon never saw the worker gone: the step simply kept waiting for its result.
    let now = rig.caller.get(&t.turn_id).await?;
    let wait = now.wait.context("running without wait")?;
    ensure!(wait.state == WaitState::AwaitingResult, "{wait:?}");
    let workers = rig.caller.workers().await?;
    let me = workers
        .iter()
        .find(|x| x.worker_id == "w-l")
        .context("worker not listed")?;
    ensure!(me.connected && me.instance_id == w.instance_id(), "{me:?}");

    gate.open();
    let done = rig.done(&t.turn_id).await?;
    ensure!(
        done.status == TurnStatus::Completed && !done.recovered,
        "{done:?}"
    );
    let ev = rig.events("s-l").await?;
    let k = event_kinds(&ev, &t.turn_id);
    ensure!(
        k == vec![
            EventKind::Admitted,
            EventKind::Dispatched,
            EventKind::Result,
            EventKind::Completed
        ],
        "{k:?}"
    );
    ensure!(runs.for_turn(&t.turn_id) == 1);
    report(
        "e: half-open connection superseded by the same instance -> kept",
        severed_at,
        kept_at,
        "the SDK's reconnect (no daemon timer involved)",
        RECONNECT_GRACE_MS,
    )?;
    rig.next_turn_completes("s-l", "fl", &runs).await?;
    rig.assert_store_clean().await
}

/// k. The worker answers the probe `finished` but its result never arrives (every
/// `invocation.result` is lost): after `probe_timeout_ms` the outcome is unknown and
/// the at_most_once turn fails; once results get through again, the held result
/// amends the turn to `completed`, `recovered`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_but_result_lost_is_unknown_then_amended() -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let timeout_ms = 300;
    let w = rig
        .worker(
            "w-k",
            FunctionSpec::new("fk").timeout_ms(timeout_ms),
            Script::new(Act::Echo),
        )
        .await;
    let runs = w.runs("fk");
    let rule = rig
        .proxy
        .drop_all(Dir::ToServer, Match::op("invocation.result"));

    let input = json!({"case": "k"});
    let t = rig.submit("s-k", "fk", input.clone()).await?;
    let failed = rig.done(&t.turn_id).await?;
    ensure!(failed.status == TurnStatus::Failed, "{failed:?}");
    let error = failed.error.clone().context("no error")?;
    ensure!(error.cause == ErrorCause::OutcomeUnknown, "{error:?}");
    let finished =
        Match::op("invocation.status").and(Match::field("/args/state", json!("finished")));
    ensure!(
        rig.proxy.count(Dir::ToServer, &finished) == 1,
        "no `finished` answer"
    );

    rig.proxy.remove(rule);
    let caller = &rig.caller;
    let id = t.turn_id.clone();
    let amended = eventually(TURN_SECS, "the amendment", || async {
        caller
            .get(&id)
            .await
            .ok()
            .filter(|t| t.status == TurnStatus::Completed)
    })
    .await?;
    ensure!(
        amended.recovered && amended.output == Some(input),
        "{amended:?}"
    );
    ensure!(runs.for_turn(&t.turn_id) == 1);

    let ev = rig.events("s-k").await?;
    let k = event_kinds(&ev, &t.turn_id);
    ensure!(
        k == vec![
            EventKind::Admitted,
            EventKind::Dispatched,
            EventKind::ProbeSent,
            EventKind::OutcomeUnknown,
            EventKind::Failed,
            EventKind::LateResult,
            EventKind::Amended
        ],
        "{k:?}"
    );
    let unknown = first(&ev, &t.turn_id, EventKind::OutcomeUnknown)?;
    ensure!(
        unknown.detail["reason"]
            .as_str()
            .map(|r| r.contains("finished"))
            .unwrap_or(false),
        "{unknown:?}"
    );
    let dispatched = first(&ev, &t.turn_id, EventKind::Dispatched)?;
    let failed_ev = first(&ev, &t.turn_id, EventKind::Failed)?;
    report(
        "k: probe answered finished, result lost -> failed outcome_unknown",
        dispatched.at_ms,
        failed_ev.at_ms,
        "timeout_ms + probe answer (< probe_timeout_ms) + probe_timeout_ms",
        timeout_ms + 2 * PROBE_TIMEOUT_MS,
    )?;
    rig.next_turn_completes("s-k", "fk", &runs).await?;
    rig.assert_store_clean().await
}

// ---------------------------------------------------------------------------- f

/// f. The worker is cut off and kept away past the grace: the at_most_once turn fails
/// `outcome_unknown` and the session moves on. When the same instance comes back, the
/// SDK resends the result it held: `late`, and the failed turn is amended to
/// `completed` with `recovered: true`; the session's next turn is not re-run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_result_amends_outcome_unknown_failure() -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let gate = Gate::new();
    let w = rig
        .worker(
            "w-f",
            FunctionSpec::new("ff"),
            Script::new(Act::Echo).then(Act::Gate(gate.clone())),
        )
        .await;
    let runs = w.runs("ff");

    let input = json!({"case": "f"});
    let t1 = rig.submit("s-f", "ff", input.clone()).await?;
    let invoke = runs
        .wait_for(1, Duration::from_secs(5))
        .await
        .context("the step never started")?;
    let next_input = json!({"case": "f", "turn": 2});
    let t2 = rig.submit("s-f", "ff", next_input.clone()).await?;

    rig.proxy.refuse(true);
    let lost_at = rig.now_ms();
    ensure!(rig.proxy.cut_worker("w-f") == 1);
    let failed = rig.done(&t1.turn_id).await?;
    ensure!(failed.status == TurnStatus::Failed, "{failed:?}");
    let error = failed.error.clone().context("no error")?;
    ensure!(error.cause == ErrorCause::OutcomeUnknown, "{error:?}");
    ensure!(error.invocation_id.as_deref() == Some(invoke.invocation_id.as_str()));
    // The session moved on: t2 holds the lock, waiting for a worker.
    let t2_now = rig.caller.get(&t2.turn_id).await?;
    ensure!(
        !t2_now.status.is_terminal() && t2_now.wait.is_some(),
        "{t2_now:?}"
    );

    // The step finishes while the worker is away; then the worker comes back.
    gate.open();
    let released_at = rig.now_ms();
    rig.proxy.refuse(false);

    let caller = &rig.caller;
    let t1_id = t1.turn_id.clone();
    let amended = eventually(TURN_SECS, "the amendment", || async {
        caller
            .get(&t1_id)
            .await
            .ok()
            .filter(|t| t.status == TurnStatus::Completed)
    })
    .await?;
    ensure!(
        amended.recovered && amended.output == Some(input),
        "{amended:?}"
    );
    ensure!(amended.error.is_none(), "{amended:?}");
    let t2_done = rig.done(&t2.turn_id).await?;
    ensure!(t2_done.status == TurnStatus::Completed && t2_done.output == Some(next_input));

    let ev = rig.events("s-f").await?;
    let k = event_kinds(&ev, &t1.turn_id);
    ensure!(
        k == vec![
            EventKind::Admitted,
            EventKind::Dispatched,
            EventKind::OutcomeUnknown,
            EventKind::Failed,
            EventKind::LateResult,
            EventKind::Amended
        ],
        "{k:?}"
    );
    let amended_ev = first(&ev, &t1.turn_id, EventKind::Amended)?;
    ensure!(
        amended_ev.detail["before"]["status"] == json!("failed"),
        "{amended_ev:?}"
    );
    let late = Match::field("/ok/accepted", json!("late"));
    ensure!(rig.proxy.count(Dir::ToClient, &late) == 1);
    // Never re-run: one execution each, and the late result did not touch t2.
    ensure!(runs.for_turn(&t1.turn_id) == 1 && runs.for_turn(&t2.turn_id) == 1);
    ensure!(count(&ev, &t2.turn_id, EventKind::Dispatched) == 1);
    ensure!(count(&ev, &t2.turn_id, EventKind::LateResult) == 0);

    let failed_ev = first(&ev, &t1.turn_id, EventKind::Failed)?;
    report(
        "f: worker kept away -> failed outcome_unknown",
        lost_at,
        failed_ev.at_ms,
        "reconnect_grace_ms",
        RECONNECT_GRACE_MS,
    )?;
    let worker_back = 5_000; // the SDK's reconnect backoff cap
    report(
        "f: worker allowed back -> turn amended (recovered)",
        released_at,
        amended_ev.at_ms,
        "the SDK's reconnect backoff (capped at 5000 ms)",
        worker_back,
    )?;

    rig.next_turn_completes("s-f", "ff", &runs).await?;
    rig.assert_store_clean().await
}

/// f'. Like f, but the step is still running when the same instance comes back and
/// lists it in `inflight`: the daemon answers it was given up (`reconciled.unknown`)
/// and pushes a `cancel`; the handler ignores it and completes, and its late result
/// still amends the failed turn. The session's next turn ran once, meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_up_step_still_running_at_reconnect_is_void_but_its_result_amends(
) -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let gate = Gate::new();
    let w = rig
        .worker(
            "w-f2",
            FunctionSpec::new("ff2"),
            Script::new(Act::Echo).then(Act::Gate(gate.clone())),
        )
        .await;
    let runs = w.runs("ff2");
    let (t1, invoke) = start_step(&rig, &w, "s-f2", "ff2").await?;
    let t2 = rig.submit("s-f2", "ff2", json!({"turn": 2})).await?;

    rig.proxy.refuse(true);
    ensure!(rig.proxy.cut_worker("w-f2") == 1);
    let failed = rig.done(&t1.turn_id).await?;
    ensure!(
        failed.error.as_ref().map(|e| e.cause) == Some(ErrorCause::OutcomeUnknown),
        "{failed:?}"
    );
    rig.proxy.refuse(false);

    let handle = w.handle();
    let inv = invoke.invocation_id.clone();
    let rec = eventually(TURN_SECS, "the worker back", || async {
        handle
            .last_reconciled()
            .filter(|r| r.unknown.contains(&inv))
    })
    .await?;
    ensure!(
        rec.kept.is_empty() && rec.redispatched.is_empty(),
        "{rec:?}"
    );
    let cancel = Match::push("cancel").and(Match::invocation(&inv));
    ensure!(
        rig.proxy
            .wait_frames(Dir::ToClient, &cancel, 1, Duration::from_secs(5))
            .await,
        "no cancel for the given-up step"
    );
    let t2_done = rig.done(&t2.turn_id).await?;
    ensure!(t2_done.status == TurnStatus::Completed, "{t2_done:?}");

    gate.open();
    let caller = &rig.caller;
    let id = t1.turn_id.clone();
    let amended = eventually(TURN_SECS, "the amendment", || async {
        caller
            .get(&id)
            .await
            .ok()
            .filter(|t| t.status == TurnStatus::Completed)
    })
    .await?;
    ensure!(amended.recovered, "{amended:?}");
    ensure!(runs.for_turn(&t1.turn_id) == 1 && runs.for_turn(&t2.turn_id) == 1);
    rig.next_turn_completes("s-f2", "ff2", &runs).await?;
    rig.assert_store_clean().await
}

// ---------------------------------------------------------------------------- g

/// g. The result frame arrives twice: one `applied`, one `duplicate`; the turn moves
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_result_is_taken_once() -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let w = rig
        .worker("w-g", FunctionSpec::new("fg"), Script::new(Act::Echo))
        .await;
    let runs = w.runs("fg");
    let rule = rig
        .proxy
        .duplicate_next(Dir::ToServer, Match::op("invocation.result"), 1);

    let input = json!({"case": "g"});
    let t = rig.submit("s-g", "fg", input.clone()).await?;
    let done = rig.done(&t.turn_id).await?;
    ensure!(
        done.status == TurnStatus::Completed && done.output == Some(input),
        "{done:?}"
    );
    ensure!(rig.proxy.hits(rule) == 1);
    let dup = Match::field("/ok/accepted", json!("duplicate"));
    ensure!(
        rig.proxy
            .wait_frames(Dir::ToClient, &dup, 1, Duration::from_secs(5))
            .await,
        "no `duplicate` answer"
    );
    let applied = Match::field("/ok/accepted", json!("applied"));
    ensure!(rig.proxy.count(Dir::ToClient, &applied) == 1);
    ensure!(rig.proxy.count(Dir::ToClient, &dup) == 1);

    let ev = rig.events("s-g").await?;
    ensure!(count(&ev, &t.turn_id, EventKind::Result) == 1);
    ensure!(count(&ev, &t.turn_id, EventKind::Completed) == 1);
    ensure!(count(&ev, &t.turn_id, EventKind::LateResult) == 0);
    ensure!(runs.for_turn(&t.turn_id) == 1);

    let next = rig.next_turn_completes("s-g", "fg", &runs).await?;
    let ev = rig.events("s-g").await?;
    ensure!(count(&ev, &next.turn_id, EventKind::Result) == 1);
    rig.assert_store_clean().await
}

// ---------------------------------------------------------------------------- h

/// A raw worker's next push of `kind`, answering nothing else.
async fn next_push_of(raw: &mut Raw, kind: &str) -> anyhow::Result<Value> {
    for _ in 0..20 {
        let p = raw.next_push().await?;
        if p["push"] == json!(kind) {
            return Ok(p);
        }
    }
    bail!("no {kind} push")
}

fn str_of(v: &Value, key: &str) -> anyhow::Result<String> {
    v.get(key)
        .and_then(Value::as_str)
        .map(str::to_string)
        .with_context(|| format!("no {key} in {v}"))
}

/// h. A result for an invocation whose dispatch was found lost and replaced: `late`,
/// recorded, and the turn stays on the new invocation until its own result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_result_of_a_lost_dispatch_never_advances_the_turn() -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let (mut raw, _) = Raw::hello(
        &rig.proxy.url(),
        "worker",
        json!({"worker_id": "w-h1", "instance_id": "i-h1"}),
    )
    .await?;
    raw.ok(
        "function.register",
        json!({"function_id": "fh1", "timeout_ms": 300}),
    )
    .await?;

    let t = rig.submit("s-h1", "fh1", json!({"case": "h1"})).await?;
    let first_invoke = next_push_of(&mut raw, "invoke").await?;
    let old = str_of(&first_invoke, "invocation_id")?;
    let probe = next_push_of(&mut raw, "probe").await?;
    ensure!(str_of(&probe, "invocation_id")? == old);
    raw.ok(
        "invocation.status",
        json!({"invocation_id": old, "state": "unknown"}),
    )
    .await?;
    let second_invoke = next_push_of(&mut raw, "invoke").await?;
    let new = str_of(&second_invoke, "invocation_id")?;
    ensure!(new != old && second_invoke["attempt"] == json!(1));

    // Heartbeats and statuses for the superseded invocation change nothing.
    let code = raw
        .error_code("invocation.heartbeat", json!({"invocation_id": old}))
        .await?;
    ensure!(
        code == "not_found",
        "heartbeat of a superseded invocation: {code}"
    );
    raw.ok(
        "invocation.status",
        json!({"invocation_id": old, "state": "unknown"}),
    )
    .await?;

    // The superseded invocation reports a result: late, and nothing moves.
    let ack = raw
        .ok(
            "invocation.result",
            json!({"invocation_id": old, "outcome": {"complete": {"stale": true}}}),
        )
        .await?;
    ensure!(ack["accepted"] == json!("late"), "{ack}");
    let now = rig.caller.get(&t.turn_id).await?;
    ensure!(now.status == TurnStatus::Running, "{now:?}");
    let wait = now.wait.clone().context("running without wait")?;
    ensure!(
        wait.invocation_id.as_deref() == Some(new.as_str()),
        "{wait:?}"
    );
    let ev = rig.events("s-h1").await?;
    let late = first(&ev, &t.turn_id, EventKind::LateResult)?;
    ensure!(
        inv_of(late) == old && late.detail["invocation_state"] == json!("lost"),
        "{late:?}"
    );
    ensure!(count(&ev, &t.turn_id, EventKind::Result) == 0);
    ensure!(
        count(&ev, &t.turn_id, EventKind::Redispatched) == 1,
        "a stale status redispatched"
    );
    // Said twice, it is a duplicate, still changing nothing.
    let again = raw
        .ok(
            "invocation.result",
            json!({"invocation_id": old, "outcome": {"complete": {"stale": true}}}),
        )
        .await?;
    ensure!(again["accepted"] == json!("duplicate"), "{again}");

    let ack = raw
        .ok(
            "invocation.result",
            json!({"invocation_id": new, "outcome": {"complete": {"fresh": true}}}),
        )
        .await?;
    ensure!(ack["accepted"] == json!("applied"), "{ack}");
    let done = rig.done(&t.turn_id).await?;
    ensure!(
        done.status == TurnStatus::Completed && done.output == Some(json!({"fresh": true})),
        "{done:?}"
    );
    ensure!(!done.recovered);

    // The next turn runs.
    let t2 = rig
        .submit("s-h1", "fh1", json!({"case": "h1", "turn": 2}))
        .await?;
    let inv3 = str_of(&next_push_of(&mut raw, "invoke").await?, "invocation_id")?;
    let ack = raw
        .ok(
            "invocation.result",
            json!({"invocation_id": inv3, "outcome": {"complete": 2}}),
        )
        .await?;
    ensure!(ack["accepted"] == json!("applied"));
    let done2 = rig.done(&t2.turn_id).await?;
    ensure!(done2.status == TurnStatus::Completed && done2.output == Some(json!(2)));
    rig.assert_store_clean().await
}

/// h'. at_least_once: attempt 1 goes silent (no answer to the probe), its outcome is
/// unknown and attempt 2 is dispatched; attempt 1's result arrives afterwards: `late`,
/// and the turn waits for attempt 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_result_of_an_unknown_attempt_never_advances_the_turn() -> anyhow::Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let (mut raw, _) = Raw::hello(
        &rig.proxy.url(),
        "worker",
        json!({"worker_id": "w-h2", "instance_id": "i-h2"}),
    )
    .await?;
    raw.ok(
        "function.register",
        json!({"function_id": "fh2", "timeout_ms": 300, "delivery": "at_least_once", "max_attempts": 3}),
    )
    .await?;

    let t = rig.submit("s-h2", "fh2", json!({"case": "h2"})).await?;
    let old = str_of(&next_push_of(&mut raw, "invoke").await?, "invocation_id")?;
    // Probe unanswered → outcome unknown → attempt 2.
    let second = next_push_of(&mut raw, "invoke").await?;
    let new = str_of(&second, "invocation_id")?;
    ensure!(second["attempt"] == json!(2), "{second}");

    let ack = raw
        .ok(
            "invocation.result",
            json!({"invocation_id": old, "outcome": {"complete": {"stale": true}}}),
        )
        .await?;
    ensure!(ack["accepted"] == json!("late"), "{ack}");
    let now = rig.caller.get(&t.turn_id).await?;
    ensure!(
        now.status == TurnStatus::Running && now.attempt == 2,
        "{now:?}"
    );
    let ev = rig.events("s-h2").await?;
    let late = first(&ev, &t.turn_id, EventKind::LateResult)?;
    ensure!(
        late.detail["invocation_state"] == json!("unknown"),
        "{late:?}"
    );
    ensure!(count(&ev, &t.turn_id, EventKind::Amended) == 0);

    let ack = raw
        .ok(
            "invocation.result",
            json!({"invocation_id": new, "outcome": {"complete": {"fresh": true}}}),
        )
        .await?;
    ensure!(ack["accepted"] == json!("applied"), "{ack}");
    let done = rig.done(&t.turn_id).await?;
    ensure!(
        done.output == Some(json!({"fresh": true})) && !done.recovered,
        "{done:?}"
    );

    let t2 = rig.submit("s-h2", "fh2", json!({"turn": 2})).await?;
    let inv3 = str_of(&next_push_of(&mut raw, "invoke").await?, "invocation_id")?;
    raw.ok(
        "invocation.result",
        json!({"invocation_id": inv3, "outcome": {"complete": 2}}),
    )
    .await?;
    let done2 = rig.done(&t2.turn_id).await?;
    ensure!(done2.status == TurnStatus::Completed);
    rig.assert_store_clean().await
}

// ---------------------------------------------------------------------------- i

/// i. `kill -9` of the real daemon with three sessions in flight, restart on the same
/// data directory (on a new port; the workers' proxies are pointed at it):
/// - worker A comes back as the same instance with its step in `inflight` (held at
///   its proxy until the new daemon is up): kept, and its result completes the turn;
/// - worker B never comes back: after the fresh `reconnect_grace_ms` its at_most_once
///   step fails `outcome_unknown` and its at_least_once step moves to worker A;
/// - every turn ends terminal and every session's next turn completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_killed_and_restarted_with_invocations_in_flight() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let env = [
        ("TURND_SERVER__HEARTBEAT_MS", "1000"),
        ("TURND_TURNS__PROBE_TIMEOUT_MS", "300"),
        ("TURND_TURNS__RECONNECT_GRACE_MS", "600"),
        ("TURND_TURNS__CANCEL_GRACE_MS", "300"),
        ("TURND_TURNS__DEFAULT_TIMEOUT_MS", "5000"),
        ("TURND_TURNS__RETRY_BACKOFF_MS", "20"),
    ];
    let first_daemon = BinDaemon::start(&data, &env).await?;
    let pa = Proxy::start(first_daemon.url.clone()).await?;
    let pb = Proxy::start(first_daemon.url.clone()).await?;
    let caller = Caller::connect(&first_daemon.url, None).await?;

    // Worker B: hangs in fi-amo and fi-alo.
    let amo = FunctionSpec::new("fi-amo");
    let alo = FunctionSpec::new("fi-alo")
        .delivery(Delivery::AtLeastOnce)
        .max_attempts(2);
    let (runs_amo, runs_alo, runs_a) = (Runs::new(), Runs::new(), Runs::new());
    let b = KitWorker::builder(&pb.url(), "w-i-b")
        .function_with(amo.clone(), Script::new(Act::Hang), runs_amo.clone())
        .function_with(alo.clone(), Script::new(Act::Hang), runs_alo.clone())
        .start()
        .await;
    let u1 = caller
        .submit_simple("s-i-amo", "fi-amo", json!({"u": 1}))
        .await?;
    let v1 = caller
        .submit_simple("s-i-alo", "fi-alo", json!({"v": 1}))
        .await?;
    runs_amo
        .wait_for(1, Duration::from_secs(5))
        .await
        .context("u1 not started")?;
    runs_alo
        .wait_for(1, Duration::from_secs(5))
        .await
        .context("v1 not started")?;

    // Worker A: its first fi step waits for a gate; it also serves the other two.
    let gate = Gate::new();
    let a = KitWorker::builder(&pa.url(), "w-i-a")
        .function_with(
            FunctionSpec::new("fi"),
            Script::new(Act::Echo).then(Act::Gate(gate.clone())),
            runs_a.clone(),
        )
        .function_with(amo, Script::new(Act::Echo), runs_amo.clone())
        .function_with(alo, Script::new(Act::Echo), runs_alo.clone())
        .start()
        .await;
    let t1 = caller.submit_simple("s-i", "fi", json!({"t": 1})).await?;
    let running = runs_a
        .wait_for(1, Duration::from_secs(5))
        .await
        .context("t1 not started")?;
    let t2 = caller.submit_simple("s-i", "fi", json!({"t": 2})).await?;
    let u2 = caller
        .submit_simple("s-i-amo", "fi-amo", json!({"u": 2}))
        .await?;
    let v2 = caller
        .submit_simple("s-i-alo", "fi-alo", json!({"v": 2}))
        .await?;

    // kill -9; A's reconnect waits at its proxy, B is refused for good.
    pa.hold(true);
    pb.refuse(true);
    drop(caller);
    first_daemon.kill().await?;
    let second = BinDaemon::start(&data, &env).await?;
    let restarted_at = unix_ms();
    pa.set_upstream(second.url.clone());
    pa.hold(false);
    let caller = Caller::connect(&second.url, None).await?;
    let operator =
        Caller::connect_as(&second.url, turnd_client::turnd_proto::Role::Operator, None).await?;

    let handle = a.handle();
    let kept = eventually(10, "A reconciled as the same instance", || async {
        handle
            .last_reconciled()
            .filter(|r| r.kept.contains(&running.invocation_id))
    })
    .await?;
    let kept_at = unix_ms();
    ensure!(
        kept.unknown.is_empty() && kept.redispatched.is_empty(),
        "{kept:?}"
    );
    gate.open();

    let wait = |id: String| {
        let caller = &caller;
        async move {
            Ok::<Turn, anyhow::Error>(
                caller
                    .wait_terminal(&id, Duration::from_secs(TURN_SECS))
                    .await?,
            )
        }
    };
    let t1d = wait(t1.turn_id.clone()).await?;
    ensure!(
        t1d.status == TurnStatus::Completed && t1d.output == Some(json!({"t": 1})),
        "{t1d:?}"
    );
    ensure!(runs_a.for_turn(&t1.turn_id) == 1, "t1 ran again");
    let u1d = wait(u1.turn_id.clone()).await?;
    ensure!(u1d.status == TurnStatus::Failed, "{u1d:?}");
    ensure!(
        u1d.error.as_ref().map(|e| e.cause) == Some(ErrorCause::OutcomeUnknown),
        "{u1d:?}"
    );
    ensure!(
        runs_amo.for_turn(&u1.turn_id) == 1,
        "at_most_once ran again"
    );
    let v1d = wait(v1.turn_id.clone()).await?;
    ensure!(
        v1d.status == TurnStatus::Completed && v1d.attempt == 2,
        "{v1d:?}"
    );
    ensure!(runs_alo.for_turn(&v1.turn_id) == 2);
    for (turn, runs) in [(&t2, &runs_a), (&u2, &runs_amo), (&v2, &runs_alo)] {
        let d = wait(turn.turn_id.clone()).await?;
        ensure!(d.status == TurnStatus::Completed, "{d:?}");
        ensure!(runs.for_turn(&turn.turn_id) == 1);
    }

    let ev_amo = all_events(&caller, "s-i-amo").await?;
    let unknown = first(&ev_amo, &u1.turn_id, EventKind::OutcomeUnknown)?;
    ensure!(
        unknown.detail["reason"]
            .as_str()
            .map(|r| r.contains("reconnect_grace_ms"))
            .unwrap_or(false),
        "{unknown:?}"
    );
    let ev_alo = all_events(&caller, "s-i-alo").await?;
    let redispatched = first(&ev_alo, &v1.turn_id, EventKind::Redispatched)?;
    ensure!(redispatched.detail["worker_id"] == json!("w-i-a"));
    report(
        "i: daemon restarted -> same instance reconnected, step kept",
        restarted_at,
        kept_at,
        "reconnect_grace_ms (fresh after boot)",
        RECONNECT_GRACE_MS,
    )?;
    report(
        "i: daemon restarted -> absent worker's at_most_once step failed outcome_unknown",
        restarted_at,
        unknown.at_ms,
        "reconnect_grace_ms (fresh after boot)",
        RECONNECT_GRACE_MS,
    )?;
    report(
        "i: daemon restarted -> absent worker's at_least_once step redispatched",
        restarted_at,
        redispatched.at_ms,
        "reconnect_grace_ms (fresh after boot)",
        RECONNECT_GRACE_MS,
    )?;

    // Every session's next turn runs on the restarted daemon.
    for (session, function, runs) in [
        ("s-i", "fi", &runs_a),
        ("s-i-amo", "fi-amo", &runs_amo),
        ("s-i-alo", "fi-alo", &runs_alo),
    ] {
        let t = caller
            .submit_simple(session, function, json!({"after": session}))
            .await?;
        let d = wait(t.turn_id.clone()).await?;
        ensure!(
            d.status == TurnStatus::Completed && runs.for_turn(&t.turn_id) == 1,
            "{d:?}"
        );
    }
    store_clean(&operator).await?;
    drop(b);
    second.terminate().await?;
    Ok(())
}

// ---------------------------------------------------------------------------- j

/// One function of the randomized test.
struct RandFn {
    id: &'static str,
    delivery: Delivery,
    max_attempts: u32,
}

const RAND_FNS: [RandFn; 2] = [
    RandFn {
        id: "rj-amo",
        delivery: Delivery::AtMostOnce,
        max_attempts: 1,
    },
    RandFn {
        id: "rj-alo",
        delivery: Delivery::AtLeastOnce,
        max_attempts: 3,
    },
];

/// Check the semantics' invariants over one session's events.
fn check_session_events(
    session: &str,
    turns: &[Turn],
    ev: &[Event],
    amo: &HashSet<String>,
) -> anyhow::Result<()> {
    let seq_of: HashMap<&str, u64> = turns.iter().map(|t| (t.turn_id.as_str(), t.seq)).collect();
    let mut holder: Option<&str> = None;
    let mut terminal: HashSet<&str> = HashSet::new();
    let mut unknown: HashSet<&str> = HashSet::new();
    let mut finished_order: Vec<u64> = Vec::new();
    for e in ev {
        let turn = e.turn_id.as_str();
        match e.kind {
            EventKind::Dispatched | EventKind::Redispatched => {
                ensure!(
                    !terminal.contains(turn),
                    "{session}: {turn} dispatched after it ended (event {})",
                    e.seq
                );
                if let Some(h) = holder {
                    ensure!(
                        h == turn,
                        "{session}: {turn} dispatched while {h} was still in flight (event {})",
                        e.seq
                    );
                }
                ensure!(
                    !(amo.contains(turn) && unknown.contains(turn)),
                    "{session}: at_most_once {turn} dispatched again after an unknown outcome (event {})",
                    e.seq
                );
                holder = Some(turn);
            }
            EventKind::OutcomeUnknown => {
                unknown.insert(turn);
            }
            EventKind::Completed | EventKind::Failed | EventKind::Cancelled => {
                ensure!(terminal.insert(turn), "{session}: {turn} ended twice");
                finished_order.push(seq_of.get(turn).copied().unwrap_or(u64::MAX));
                if holder == Some(turn) {
                    holder = None;
                }
            }
            _ => {}
        }
    }
    let mut sorted = finished_order.clone();
    sorted.sort_unstable();
    ensure!(
        finished_order == sorted,
        "{session}: turns ended out of admission order: {finished_order:?}"
    );
    Ok(())
}

/// The event-log checker of the randomized test catches each violation it looks for
/// (a checker that cannot fail proves nothing).
#[test]
fn event_checker_catches_violations() {
    let ev = |seq: u64, turn: &str, kind: EventKind| Event {
        seq,
        session_id: "s".into(),
        turn_id: turn.into(),
        at_ms: seq,
        kind,
        detail: json!({}),
    };
    let turn = |id: &str, seq: u64| Turn {
        turn_id: id.into(),
        session_id: "s".into(),
        seq,
        function_id: "f".into(),
        status: TurnStatus::Completed,
        step: 0,
        attempt: 1,
        input: json!(null),
        output: None,
        error: None,
        stop: None,
        superseded: false,
        recovered: false,
        created_at_ms: 0,
        updated_at_ms: 0,
        finished_at_ms: None,
        input_request: None,
        progress: None,
        wait: None,
    };
    let turns = [turn("t1", 1), turn("t2", 2)];
    let none = HashSet::new();
    use EventKind::*;
    let good = [
        ev(1, "t1", Dispatched),
        ev(2, "t1", OutcomeUnknown),
        ev(3, "t1", Redispatched),
        ev(4, "t1", Completed),
        ev(5, "t2", Dispatched),
        ev(6, "t2", Completed),
        ev(7, "t1", LateResult),
    ];
    assert!(check_session_events("s", &turns, &good, &none).is_ok());
    let two_in_flight = [
        ev(1, "t1", Dispatched),
        ev(2, "t2", Dispatched),
        ev(3, "t1", Completed),
        ev(4, "t2", Completed),
    ];
    assert!(check_session_events("s", &turns, &two_in_flight, &none).is_err());
    let out_of_order = [
        ev(1, "t2", Dispatched),
        ev(2, "t2", Completed),
        ev(3, "t1", Dispatched),
        ev(4, "t1", Completed),
    ];
    assert!(check_session_events("s", &turns, &out_of_order, &none).is_err());
    let amo: HashSet<String> = ["t1".to_string()].into_iter().collect();
    assert!(check_session_events("s", &turns, &good, &amo).is_err());
    let after_end = [
        ev(1, "t1", Dispatched),
        ev(2, "t1", Failed),
        ev(3, "t1", Dispatched),
    ];
    assert!(check_session_events("s", &turns, &after_end, &none).is_err());
}

/// Restart the in-process daemon on its store (graceful stop, then start on the same
/// data directory, on a new port) while workers reconnect to the proxy: their new
/// connections wait at the proxy until the new daemon is up.
async fn restart_in_process(td: TestDaemon, proxy: &Proxy) -> anyhow::Result<TestDaemon> {
    let dir = td.dir.clone();
    proxy.hold(true);
    td.shutdown().await?;
    let td = eventually(10, "the daemon to start again on its store", || {
        let dir = dir.clone();
        async move { TestDaemon::start_in(dir, |_| {}, false).await.ok() }
    })
    .await?;
    proxy.set_upstream(td.url.clone());
    proxy.cut_all();
    proxy.hold(false);
    Ok(td)
}

/// j. Seeded randomized run: 20 sessions × 5 turns through the proxy while results,
/// invokes, probes and status answers are dropped, results duplicated and delayed,
/// connections cut, workers kept away past the grace, and the daemon restarted once,
/// all at random. Checks the invariants of the semantics page: every turn terminal or
/// visibly waiting with a deadline, per-session FIFO, one invocation in flight per
/// session, at_most_once never dispatched again after an unknown outcome nor run
/// twice, at_least_once within max_attempts, a clean store, every session usable
/// afterwards. The seed is printed; `TURND_SEED=<seed>` replays the same decisions
/// (the timing of a real network and scheduler is not replayed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_losses_keep_the_invariants() -> anyhow::Result<()> {
    const SESSIONS: usize = 20;
    const TURNS: usize = 5;
    let seed = SplitMix64::seed_from_env();
    eprintln!("seed = {seed}");
    let mut rng = SplitMix64::new(seed);

    let mut td = TestDaemon::start(|_| {}).await?;
    let proxy = Proxy::start(td.url.clone()).await?;
    proxy.seed(rng.next_u64());
    let mut caller = td.caller().await?;
    let runs: Vec<Runs> = RAND_FNS.iter().map(|_| Runs::new()).collect();
    let mut workers = Vec::new();
    // Steps take a while, so cuts and restarts find them running.
    for (i, ms) in [60u64, 150].into_iter().enumerate() {
        let mut b = KitWorker::builder(&proxy.url(), &format!("w-j-{i}"));
        for (f, r) in RAND_FNS.iter().zip(&runs) {
            let spec = FunctionSpec::new(f.id)
                .concurrency(4)
                .timeout_ms(400)
                .delivery(f.delivery)
                .max_attempts(f.max_attempts);
            let act = Act::Sleep(Duration::from_millis(ms));
            b = b.function_with(spec, Script::new(act), r.clone());
        }
        workers.push(b.start().await);
    }

    // Frame faults, each frame drawn from the proxy's seeded generator.
    let result = || Match::op("invocation.result");
    proxy.add(Rule::drop(Dir::ToServer, result()).chance(0.10));
    proxy.add(Rule::duplicate(Dir::ToServer, result()).chance(0.05));
    proxy.add(Rule::delay(Dir::ToServer, result(), Duration::from_millis(150)).chance(0.05));
    proxy.add(Rule::drop(Dir::ToClient, Match::push("invoke")).chance(0.08));
    proxy.add(Rule::drop(Dir::ToClient, Match::push("probe")).chance(0.10));
    proxy.add(Rule::drop(Dir::ToServer, Match::op("invocation.status")).chance(0.05));
    proxy.add(Rule::duplicate(Dir::ToClient, Match::push("invoke")).chance(0.05));

    let restart_round = rng.below(TURNS as u64) as usize;
    let mut turns: Vec<Turn> = Vec::new();
    let mut amo: HashSet<String> = HashSet::new();
    let mut fn_of: HashMap<String, usize> = HashMap::new();
    let mut faults: Vec<String> = Vec::new();
    for n in 0..TURNS {
        // Admission: every session gets its turns in order, sessions interleaved.
        for s in 0..SESSIONS {
            let f = rng.below(RAND_FNS.len() as u64) as usize;
            let t = caller
                .submit_simple(&format!("s-j-{s}"), RAND_FNS[f].id, json!({"s": s, "n": n}))
                .await?;
            if RAND_FNS[f].delivery == Delivery::AtMostOnce {
                amo.insert(t.turn_id.clone());
            }
            fn_of.insert(t.turn_id.clone(), f);
            turns.push(t);
        }
        tokio::time::sleep(Duration::from_millis(rng.range(50, 300))).await;
        let w = workers[rng.below(workers.len() as u64) as usize]
            .worker_id()
            .to_string();
        match rng.below(5) {
            3 => {
                proxy.half_open_worker(&w);
                faults.push(format!("{w} half-open"));
            }
            0 => {
                proxy.cut_all();
                faults.push("cut all".into());
            }
            1 => {
                proxy.cut_worker(&w);
                faults.push(format!("cut {w}"));
            }
            2 => {
                // Sometimes shorter, sometimes longer than the reconnect grace.
                let away = rng.range(100, 1_000);
                proxy.refuse_for(Duration::from_millis(away));
                proxy.cut_worker(&w);
                faults.push(format!("{w} away {away} ms"));
            }
            _ => faults.push("none".into()),
        }
        if n == restart_round {
            tokio::time::sleep(Duration::from_millis(rng.range(0, 200))).await;
            drop(caller);
            td = restart_in_process(td, &proxy).await?;
            caller = td.caller().await?;
            faults.push("restart".into());
        }
        visibly_waiting(&caller, SESSIONS).await?;
    }
    tokio::time::sleep(Duration::from_millis(rng.range(100, 400))).await;
    visibly_waiting(&caller, SESSIONS).await?;
    eprintln!("seed = {seed}: faults per round {faults:?}");

    // Faults off; everything must settle.
    proxy.clear_rules();
    proxy.refuse(false);
    let mut outcomes: HashMap<String, usize> = HashMap::new();
    let mut longest = 0u64;
    for t in &turns {
        let d = caller
            .wait_terminal(&t.turn_id, Duration::from_secs(TURN_SECS))
            .await
            .with_context(|| format!("seed = {seed}: {} never ended", t.turn_id))?;
        let label = match (&d.status, &d.error) {
            (TurnStatus::Failed, Some(e)) => format!("failed:{:?}", e.cause),
            (s, _) if d.recovered => format!("{s:?} (recovered)"),
            (s, _) => format!("{s:?}"),
        };
        *outcomes.entry(label).or_insert(0) += 1;
        match d.status {
            TurnStatus::Completed => {
                ensure!(
                    d.output == Some(t.input.clone()),
                    "seed = {seed}: wrong output: {d:?}"
                )
            }
            TurnStatus::Failed => {
                let e = d.error.as_ref().context("failed without a cause")?;
                ensure!(
                    matches!(
                        e.cause,
                        ErrorCause::OutcomeUnknown
                            | ErrorCause::AttemptsExhausted
                            | ErrorCause::TimedOut
                    ),
                    "seed = {seed}: unexpected failure: {d:?}"
                );
            }
            _ => bail!("seed = {seed}: nobody stopped it, yet: {d:?}"),
        }
        let f = fn_of.get(&t.turn_id).copied().unwrap_or(0);
        let ran = runs[f].for_turn(&t.turn_id);
        ensure!(
            ran <= RAND_FNS[f].max_attempts as usize,
            "seed = {seed}: {} ({}) ran {ran} times",
            t.turn_id,
            RAND_FNS[f].id
        );
        if let Some(done_at) = d.finished_at_ms {
            longest = longest.max(done_at.saturating_sub(t.created_at_ms));
        }
    }

    // Late results are never dropped: every execution's result is on record, as a
    // `result` or a `late_result`, once the faults stop.
    let executed: Vec<String> = runs
        .iter()
        .flat_map(|r| r.invocations())
        .map(|i| i.invocation_id)
        .collect();
    let mut missing: Vec<String> = Vec::new();
    for _ in 0..100 {
        let mut seen: HashSet<String> = HashSet::new();
        for s in 0..SESSIONS {
            for e in all_events(&caller, &format!("s-j-{s}")).await? {
                if matches!(e.kind, EventKind::Result | EventKind::LateResult) {
                    seen.insert(inv_of(&e).to_string());
                }
            }
        }
        missing = executed
            .iter()
            .filter(|i| !seen.contains(*i))
            .cloned()
            .collect();
        if missing.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ensure!(
        missing.is_empty(),
        "seed = {seed}: results of executed invocations never recorded: {missing:?}"
    );
    // ... and an at_most_once turn that failed `outcome_unknown` for an invocation that
    // did run to completion has been amended by its late result.
    let mut recovered = 0;
    for t in turns.iter().filter(|t| amo.contains(&t.turn_id)) {
        let now = caller.get(&t.turn_id).await?;
        let f = fn_of.get(&t.turn_id).copied().unwrap_or(0);
        let ran: Vec<String> = runs[f]
            .invocations()
            .into_iter()
            .filter(|i| i.turn_id == t.turn_id)
            .map(|i| i.invocation_id)
            .collect();
        if let Some(e) = &now.error {
            let named_ran = e
                .invocation_id
                .as_ref()
                .map(|i| ran.contains(i))
                .unwrap_or(false);
            ensure!(
                !(e.cause == ErrorCause::OutcomeUnknown && named_ran),
                "seed = {seed}: {} failed for an invocation whose result exists: {now:?}",
                t.turn_id
            );
        }
        if now.recovered {
            recovered += 1;
        }
    }
    eprintln!("seed = {seed}: {recovered} at_most_once turns recovered by late results");

    // Invariants over every session's event log.
    for s in 0..SESSIONS {
        let session = format!("s-j-{s}");
        let mine: Vec<Turn> = turns
            .iter()
            .filter(|t| t.session_id == session)
            .cloned()
            .collect();
        let ev = all_events(&caller, &session).await?;
        check_session_events(&session, &mine, &ev, &amo)
            .with_context(|| format!("seed = {seed}"))?;
    }
    let operator = td.operator().await?;
    store_clean(&operator)
        .await
        .with_context(|| format!("seed = {seed}"))?;
    // Every session still works.
    for s in 0..SESSIONS {
        let t = caller
            .submit_simple(&format!("s-j-{s}"), "rj-alo", json!({"after": s}))
            .await?;
        let d = caller
            .wait_terminal(&t.turn_id, Duration::from_secs(TURN_SECS))
            .await?;
        ensure!(d.status == TurnStatus::Completed, "seed = {seed}: {d:?}");
    }

    let mut outcomes: Vec<_> = outcomes.into_iter().collect();
    outcomes.sort();
    eprintln!(
        "seed = {seed}: outcomes {outcomes:?}; proxy {:?}; longest admission-to-end {longest} ms",
        proxy.stats()
    );
    Ok(())
}

/// Every non-terminal turn says why it waits, and the lock holder's wait has a
/// deadline unless it waits for a worker (no `dispatch_timeout_ms` configured).
async fn visibly_waiting(c: &Caller, sessions: usize) -> anyhow::Result<()> {
    for s in 0..sessions {
        let session = format!("s-j-{s}");
        let list = c
            .list(ListArgs {
                session_id: session.clone(),
                status: None,
                limit: Some(100),
                before_seq: None,
            })
            .await?;
        for t in list.turns.iter().filter(|t| !t.status.is_terminal()) {
            let wait = t
                .wait
                .as_ref()
                .with_context(|| format!("{session}: {} has no wait: {t:?}", t.turn_id))?;
            let needs_deadline = !matches!(
                wait.state,
                WaitState::QueuedBehind | WaitState::AwaitingWorker
            );
            ensure!(
                !needs_deadline || wait.deadline_ms.is_some(),
                "{session}: {} waits ({:?}) without a deadline: {wait:?}",
                t.turn_id,
                wait.state
            );
            ensure!(
                wait.state != WaitState::Finalizing,
                "storage trouble: {wait:?}"
            );
        }
    }
    Ok(())
}

/// A worker opened a connection, gave it up before its `hello` arrived and attached a
/// second one; the first connection's `hello` reaches the daemon last. It is refused
/// (`conflict`) and changes nothing: the second connection keeps its invocation and
/// its result is applied. Taken, that `hello` would supersede the second connection
/// and, listing nothing in flight, have the running invocation dispatched again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_hello_is_refused_and_the_newer_connection_keeps_its_work() -> anyhow::Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let mut stale = Raw::connect(&d.url).await?;
    // Answered (refused: no hello yet) once the daemon holds the connection, so it
    // was opened before the next one.
    stale.request("ping", json!({})).await?;
    let me = json!({"worker_id": "w-stale", "instance_id": "i-1"});
    let (mut fresh, _) = Raw::hello(&d.url, "worker", me.clone()).await?;
    fresh
        .ok(
            "function.register",
            json!({"function_id": "f-stale", "delivery": "at_most_once"}),
        )
        .await?;
    let caller = d.caller().await?;
    let t = caller.submit_simple("s-stale", "f-stale", json!(1)).await?;
    let invoke = fresh.next_push().await?;
    let inv = invoke["invocation_id"]
        .as_str()
        .context("invoke")?
        .to_string();

    let hello = json!({"protocol": 1, "role": "worker", "token": "t",
        "worker_id": "w-stale", "instance_id": "i-1", "inflight": [], "finished": []});
    ensure!(stale.error_code("hello", hello).await? == "conflict");

    let r = fresh
        .ok(
            "invocation.result",
            json!({"invocation_id": inv, "outcome": {"complete": 2}}),
        )
        .await?;
    ensure!(r["accepted"] == json!("applied"), "{r}");
    let done = wait_done(&caller, &t.turn_id, 5).await?;
    ensure!(
        done.status == TurnStatus::Completed && done.attempt == 1,
        "{done:?}"
    );
    Ok(())
}
