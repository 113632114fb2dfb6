//! The session's hold after an invocation its worker cannot cancel was given up
//! without its result, and a turn's own dispatch settings, at the machine level.

use serde_json::json;
use turnd_proto::{Delivery, ErrorCause, Failure, OnDeadline, Outcome, TurnStatus, WaitState};
use turnd_store::{InvState, TurnDispatch};

use super::sim::{invokes, raw, Sim};
use super::*;
use crate::view::wait_of;

fn complete() -> Outcome {
    Outcome::Complete(json!({"ok": true}))
}

/// A session on a worker that can be neither probed nor cancelled (an iii
/// worker), running turn `a` with `b` queued behind it.
fn uncancellable() -> (Sim, String, String, String) {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.probes = false;
    let a = sim.submit();
    let inv = sim.live();
    let b = sim.submit();
    (sim, a, b, inv)
}

fn wait(sim: &Sim, turn: &str) -> turnd_proto::Wait {
    let t = sim.st.find(turn).expect("an unfinished turn");
    wait_of(&sim.st, t, None, &|ms| ms.to_string(), None)
}

fn stop(sim: &mut Sim, turn: &str) {
    let seq = sim.turn(turn).seq;
    sim.run(|cx, tx| stop_turn(cx, tx, seq, "enough".into()));
}

#[test]
fn a_stopped_invocation_that_cannot_be_cancelled_holds_the_session_until_its_result() {
    let (mut sim, a, b, inv) = uncancellable();
    let dispatched_at = sim.now;
    stop(&mut sim, &a);
    // The cancel grace passes: the stopped turn ends cancelled, as a stop does.
    let e = sim.advance(200);
    assert_eq!(sim.turn(&a).status, TurnStatus::Cancelled);
    assert_eq!(sim.inv(&inv).state, InvState::Abandoned);
    // The next turn is not dispatched: the handler may still run.
    assert!(invokes(&e).is_empty());
    let w = wait(&sim, &b);
    assert_eq!(w.state, WaitState::Held);
    assert_eq!(w.invocation_id.as_deref(), Some(inv.as_str()));
    assert_eq!(w.deadline_ms, Some(dispatched_at + 1_000));
    assert_eq!(w.on_deadline, Some(OnDeadline::Dispatch));
    assert_eq!(next_due(&sim.st, &sim.cfg), Some(dispatched_at + 1_000));
    // Nothing frees it early: a due timer, another due, capacity.
    assert!(invokes(&sim.advance(100)).is_empty());
    // Its result arrives (late): the next turn is dispatched in the same write.
    let rec = sim.inv(&inv).clone();
    let mut v = LateVerdict::Duplicate;
    let e = sim.run(|cx, tx| v = late_result(cx, tx, &rec, &raw(complete()), None));
    assert_eq!(v, LateVerdict::Recorded);
    assert_eq!(invokes(&e).len(), 1, "{e:?}");
    assert_eq!(invokes(&e)[0].turn_id, b);
    assert!(sim.st.meta.held.is_none());
    assert_eq!(sim.turn(&a).status, TurnStatus::Cancelled);
}

#[test]
fn the_hold_ends_at_the_invocations_own_deadline() {
    let (mut sim, a, b, _inv) = uncancellable();
    stop(&mut sim, &a);
    sim.advance(200);
    assert!(
        invokes(&sim.advance(799)).is_empty(),
        "one ms before the deadline"
    );
    let e = sim.advance(1);
    assert_eq!(invokes(&e).len(), 1);
    assert_eq!(invokes(&e)[0].turn_id, b);
    assert!(sim.st.meta.held.is_none());
    assert_eq!(wait(&sim, &b).state, WaitState::AwaitingResult);
}

#[test]
fn a_turn_submitted_while_held_waits_too_and_one_after_the_hold_does_not() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.probes = false;
    let a = sim.submit();
    stop(&mut sim, &a);
    sim.advance(200);
    assert_eq!(sim.turn(&a).status, TurnStatus::Cancelled);
    let b = sim.submit();
    assert_eq!(sim.turn(&b).status, TurnStatus::Queued);
    assert_eq!(wait(&sim, &b).state, WaitState::Held);
    let e = sim.advance(800);
    assert_eq!(invokes(&e).len(), 1);
    // Long after: a stale hold record keeps nothing.
    sim.result(&sim.live(), complete());
    let c = sim.submit();
    assert_eq!(sim.turn(&c).status, TurnStatus::Running);
}

#[test]
fn the_turns_own_deadline_and_a_stop_while_disconnected_hold_too() {
    // The turn's deadline ends it while the invocation may run on.
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.probes = false;
    let a = sim.submit_with(Some(100));
    let inv = sim.live();
    let b = sim.submit();
    let e = sim.advance(100);
    assert_eq!(
        sim.turn(&a).error.as_ref().map(|e| e.cause),
        Some(ErrorCause::TimedOut)
    );
    assert!(invokes(&e).is_empty());
    assert_eq!(wait(&sim, &b).state, WaitState::Held);
    assert_eq!(
        sim.st.meta.held.as_ref().map(|h| h.invocation_id.clone()),
        Some(inv)
    );
    // A stop while the worker is away: the worker may come back with it running.
    let (mut sim, a, b, _) = uncancellable();
    sim.connected = false;
    sim.advance(0);
    stop(&mut sim, &a);
    assert_eq!(sim.turn(&a).status, TurnStatus::Cancelled);
    assert_eq!(wait(&sim, &b).state, WaitState::Held);
}

#[test]
fn a_worker_that_can_cancel_or_an_own_result_holds_nothing() {
    // A protocol-v1 worker: the next turn goes at the grace, as before.
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let b = sim.submit();
    stop(&mut sim, &a);
    let e = sim.advance(200);
    assert_eq!(invokes(&e)[0].turn_id, b);
    assert!(sim.st.meta.held.is_none());
    // An iii worker whose result ends the turn: nothing runs on.
    let (mut sim, _a, b, inv) = uncancellable();
    let e = {
        sim.result(&inv, complete());
        sim.advance(0)
    };
    assert!(sim.st.meta.held.is_none(), "{e:?}");
    assert_eq!(sim.turn(&b).status, TurnStatus::Running);
    // Nor does a deadline that passed: the outcome is unknown at the deadline itself.
    let (mut sim, a, b, _inv) = uncancellable();
    sim.advance(1_000);
    assert_eq!(
        sim.turn(&a).error.as_ref().map(|e| e.cause),
        Some(ErrorCause::OutcomeUnknown)
    );
    assert_eq!(sim.turn(&b).status, TurnStatus::Running);
}

#[test]
fn a_turns_own_dispatch_settings_replace_the_functions() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit_opts(
        None,
        Some(TurnDispatch {
            timeout_ms: Some(5_000),
            delivery: Some(Delivery::AtLeastOnce),
            max_attempts: Some(2),
            retryable: Some(true),
            dispatch_by_ms: None,
        }),
    );
    let inv = sim.live();
    assert_eq!(sim.inv(&inv).settings.timeout_ms, 5_000);
    assert_eq!(sim.inv(&inv).attempt_deadline_ms, sim.now + 5_000);
    // A failure the worker calls not retryable is retried all the same.
    sim.result(
        &inv,
        Outcome::Fail(Failure {
            code: "invocation_failed".into(),
            message: "boom".into(),
            retryable: false,
        }),
    );
    assert_eq!(sim.turn(&a).phase, Phase::BackingOff);
    sim.advance(50);
    let second = sim.live();
    assert_eq!(sim.inv(&second).attempt, 2);
}

#[test]
fn a_turn_never_leaves_its_wait_for_a_worker_after_its_dispatch_bound() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.free = false;
    let by = sim.now + 300;
    let a = sim.submit_opts(
        None,
        Some(TurnDispatch {
            dispatch_by_ms: Some(by),
            ..TurnDispatch::default()
        }),
    );
    assert_eq!(next_due(&sim.st, &sim.cfg), Some(by));
    let w = wait(&sim, &a);
    assert_eq!(
        (w.deadline_ms, w.on_deadline),
        (Some(by), Some(OnDeadline::Fail))
    );
    sim.advance(299);
    assert_eq!(sim.turn(&a).status, TurnStatus::Queued);
    // A worker frees up exactly at the bound: too late.
    sim.free = true;
    let e = sim.advance(1);
    assert!(invokes(&e).is_empty());
    assert_eq!(sim.turn(&a).status, TurnStatus::Failed);
    let err = sim.turn(&a).error.clone().expect("an error");
    assert_eq!(
        (err.cause, err.code.as_str()),
        (ErrorCause::NoWorker, "no_worker")
    );
    // Within its bound it is dispatched as any turn.
    let b = sim.submit_opts(
        None,
        Some(TurnDispatch {
            dispatch_by_ms: Some(sim.now + 300),
            ..TurnDispatch::default()
        }),
    );
    assert_eq!(sim.turn(&b).status, TurnStatus::Running);
}
