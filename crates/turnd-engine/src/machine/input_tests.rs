//! Turns of agents at the machine level: a step that suspends, `resume`, the input
//! deadline, and a submit that interrupts the session's unfinished turns.

use serde_json::json;
use turnd_proto::{
    Delivery, ErrorCause, EventKind, OnBusy, OnDeadline, OnTimeout, Outcome, Suspend, TurnStatus,
    WaitState,
};
use turnd_store::{InvState, Phase, RawJson};

use super::sim::{cancels, invokes, raw, Sim};
use super::*;
use crate::view::wait_of;

fn suspend(timeout_ms: Option<u64>, on_timeout: OnTimeout) -> Outcome {
    Outcome::Suspend(Suspend {
        state: json!({"draft": 1}),
        prompt: Some(json!("approve?")),
        timeout_ms,
        on_timeout,
    })
}

/// A session whose turn's first step suspended it; the turn and the ended invocation.
fn suspended(timeout_ms: Option<u64>, on_timeout: OnTimeout) -> (Sim, String, String) {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = sim.live();
    assert!(sim.result(&inv, suspend(timeout_ms, on_timeout)));
    (sim, a, inv)
}

fn resume_with(
    sim: &mut Sim,
    turn: &str,
    input: serde_json::Value,
    key: Option<&str>,
) -> (ResumeVerdict, Vec<Effect>) {
    let seq = sim.turn(turn).seq;
    let input = RawJson::from_value(&input);
    sim.step(|cx, tx| resume(cx, tx, seq, input, key.map(str::to_string)))
}

#[test]
fn a_suspend_ends_the_invocation_and_keeps_the_lock_until_resumed() {
    let (mut sim, a, inv) = suspended(None, OnTimeout::Fail);
    let t = sim.turn(&a);
    assert_eq!(
        (t.status, t.phase),
        (TurnStatus::Running, Phase::AwaitingInput)
    );
    assert_eq!(sim.inv(&inv).state, InvState::Finished);
    assert!(
        sim.st.inv.is_none() && sim.slots.is_empty(),
        "the slot is free"
    );
    let w = wait_of(
        &sim.st,
        sim.st.find(&a).expect("unfinished"),
        None,
        &|m| m.to_string(),
        None,
    );
    assert_eq!(w.state, WaitState::AwaitingInput);
    assert!(w.reason.ends_with("approve?"), "{}", w.reason);
    assert_eq!((w.deadline_ms, w.on_deadline), (None, None));
    // A turn behind it stays queued: the suspended turn holds the lock.
    let b = sim.submit();
    assert_eq!(sim.turn(&b).phase, Phase::Queued);
    assert!(
        next_due(&sim.st, &sim.cfg).is_none(),
        "no deadline, no timer"
    );

    let (v, e) = resume_with(&mut sim, &a, json!("yes"), Some("k1"));
    assert_eq!(v, ResumeVerdict::Resumed);
    let inv2 = invokes(&e);
    assert_eq!(inv2.len(), 1);
    assert_eq!(
        inv2[0].input,
        json!({"state": {"draft": 1}, "input": "yes"})
    );
    assert_eq!((inv2[0].step, inv2[0].attempt), (1, 1));
    assert_eq!(
        sim.kinds(&a)[3..],
        [
            EventKind::Suspended,
            EventKind::Resumed,
            EventKind::Dispatched
        ]
    );
    // Again: the same key and input is a repeat, another input a conflict, no key
    // a turn that no longer waits.
    assert_eq!(
        resume_with(&mut sim, &a, json!("yes"), Some("k1")).0,
        ResumeVerdict::Duplicate
    );
    assert_eq!(
        resume_with(&mut sim, &a, json!("no"), Some("k1")).0,
        ResumeVerdict::KeyConflict
    );
    let (v, e) = resume_with(&mut sim, &a, json!("yes"), None);
    assert!(matches!(v, ResumeVerdict::NotWaiting(_)), "{v:?}");
    assert!(e.is_empty());
    assert_eq!(sim.turn(&a).step, 1, "nothing changed");
}

#[test]
fn the_input_deadline_fails_the_turn_or_runs_the_next_step_without_input() {
    let (mut sim, a, _) = suspended(Some(300), OnTimeout::Fail);
    assert_eq!(next_due(&sim.st, &sim.cfg), Some(sim.now + 300));
    assert!(sim.advance(299).is_empty());
    sim.advance(1);
    let t = sim.turn(&a);
    assert_eq!(t.status, TurnStatus::Failed);
    assert_eq!(
        t.error.as_ref().map(|e| e.cause),
        Some(ErrorCause::InputTimeout)
    );
    assert!(t.input_request.is_none());

    let (mut sim, a, _) = suspended(Some(300), OnTimeout::Continue);
    let w = wait_of(
        &sim.st,
        sim.st.find(&a).expect("unfinished"),
        None,
        &|m| m.to_string(),
        None,
    );
    assert_eq!(
        (w.deadline_ms, w.on_deadline),
        (Some(sim.now + 300), Some(OnDeadline::Continue))
    );
    let e = sim.advance(300);
    assert_eq!(
        invokes(&e)[0].input,
        json!({"state": {"draft": 1}, "input": null})
    );
    assert_eq!(
        sim.last_event(EventKind::Resumed).detail.to_value()["timed_out"],
        json!(true)
    );
}

#[test]
fn a_bad_suspend_fails_the_turn_and_a_stopped_one_is_cancelled() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = sim.live();
    sim.result(&inv, suspend(Some(0), OnTimeout::Fail));
    let t = sim.turn(&a);
    assert_eq!(
        t.error.as_ref().map(|e| (e.cause, e.code.as_str())),
        Some((ErrorCause::InvalidResult, "bad_request"))
    );

    let (mut sim, a, _) = suspended(None, OnTimeout::Fail);
    let seq = sim.turn(&a).seq;
    let e = sim.run(|cx, tx| stop_turn(cx, tx, seq, "no".into()));
    assert!(cancels(&e).is_empty(), "no invocation to cancel");
    assert_eq!(sim.turn(&a).status, TurnStatus::Cancelled);
}

#[test]
fn an_interrupt_stops_every_unfinished_turn_and_holds_for_the_running_step() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = sim.live();
    let b = sim.submit();
    let c = sim.submit_on_busy(OnBusy::Rollback);
    for t in [&a, &b] {
        let t = sim.turn(t);
        assert_eq!(t.status, TurnStatus::Cancelled);
        assert_eq!(
            t.stop.as_ref().map(|s| s.reason.as_str()),
            Some("interrupted")
        );
        assert!(t.superseded);
    }
    assert_eq!(sim.inv(&inv).state, InvState::Abandoned);
    // The new turn waits out the abandoned invocation: one step in flight.
    assert!(sim.st.inv.is_none());
    assert_eq!(sim.turn(&c).phase, Phase::AwaitingWorker);
    assert!(held_until(&sim.st.meta, sim.turn(&c)).is_some());
    let prev = sim.turn(&c).previous.clone().expect("previous");
    assert_eq!(
        (prev.turn_id.as_str(), prev.status),
        (a.as_str(), TurnStatus::Cancelled)
    );
    assert_eq!(prev.state.to_value(), json!({"n": 1}));
    // Its late result is recorded, the stopped turn stays cancelled, and the new
    // turn is dispatched (with `previous`) in the same write.
    let rec = sim.inv(&inv).clone();
    let mut v = LateVerdict::Duplicate;
    let e =
        sim.run(|cx, tx| v = late_result(cx, tx, &rec, &raw(Outcome::Complete(json!(1))), None));
    assert_eq!(v, LateVerdict::Recorded);
    assert_eq!(sim.turn(&a).status, TurnStatus::Cancelled);
    let invoke = invokes(&e);
    assert_eq!(invoke.len(), 1, "{e:?}");
    assert_eq!(invoke[0].turn_id, c);
    assert_eq!(
        invoke[0].previous.as_ref().map(|p| p.state.to_value()),
        Some(json!({"n": 1}))
    );
}

#[test]
fn an_interrupt_without_a_running_step_dispatches_at_once() {
    let (mut sim, a, _) = suspended(None, OnTimeout::Fail);
    let c = sim.submit_on_busy(OnBusy::Interrupt);
    assert_eq!(sim.turn(&a).status, TurnStatus::Cancelled);
    assert!(!sim.turn(&a).superseded);
    let t = sim.turn(&c);
    assert_eq!(t.phase, Phase::Invoked, "no hold: nothing was running");
    // The suspended holder's last durable state is its suspend's.
    assert_eq!(
        t.previous.as_ref().map(|p| p.state.to_value()),
        Some(json!({"draft": 1}))
    );
    assert_eq!(
        sim.last_event(EventKind::Admitted).detail.to_value()["interrupted"],
        json!([a])
    );
}
