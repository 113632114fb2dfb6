//! One test per transition of docs/semantics.md, at the machine level: no runtime,
//! no store, no registry.

use serde_json::json;
use turnd_proto::{
    Cancelled, Delivery, ErrorCause, EventKind, Failure, InvocationState, Outcome, TurnStatus,
};
use turnd_store::{InvState, InvWait, Phase, RawJson};

use super::sim::{cancels, invokes, probes, raw, Sim};
use super::*;

fn complete() -> Outcome {
    Outcome::Complete(json!({"ok": true}))
}

fn retryable() -> Outcome {
    Outcome::Fail(Failure {
        code: "busy".into(),
        message: "try again".into(),
        retryable: true,
    })
}

fn cause(sim: &Sim, turn: &str) -> ErrorCause {
    sim.turn(turn).error.as_ref().expect("an error").cause
}

#[test]
fn submit_dispatches_the_first_turn_and_queues_the_next_behind_it() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = sim.live();
    assert_eq!(sim.turn(&a).status, TurnStatus::Running);
    assert_eq!(sim.inv(&inv).attempt, 1);
    assert_eq!(sim.kinds(&a), [EventKind::Admitted, EventKind::Dispatched]);
    let b = sim.submit();
    assert_eq!(sim.turn(&b).phase, Phase::Queued);
    assert_eq!(sim.kinds(&b), [EventKind::Admitted]);
    // FIFO: b is dispatched only once a has finished.
    assert!(sim.result(&inv, complete()));
    assert_eq!(sim.turn(&a).status, TurnStatus::Completed);
    assert_eq!(sim.inv(&inv).state, InvState::Finished);
    assert_eq!(sim.turn(&b).status, TurnStatus::Running);
    assert_eq!(sim.st.inv.as_ref().map(|i| i.turn_id.clone()), Some(b));
}

#[test]
fn the_invoke_effect_carries_the_step_and_goes_to_the_granted_connection() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.submit();
    let inv = sim.live();
    let mut applied = false;
    let e =
        sim.run(|cx, tx| applied = result(cx, tx, &inv, raw(Outcome::Continue(json!({"k": 2})))));
    assert!(applied);
    let next = sim.live();
    assert_eq!(sim.inv(&next).step, 1);
    // The next step's invocation carries the new state as its input.
    assert_eq!(invokes(&e)[0].input, json!({"k": 2}));
    assert_eq!(invokes(&e)[0].step, 1);
    let mut sim2 = Sim::new(Delivery::AtMostOnce, 1);
    let e = sim2.run(|cx, tx| {
        submit(
            cx,
            tx,
            Submission {
                turn_id: "t_x".into(),
                function_id: "f".into(),
                input: RawJson::from_value(&json!({"a": 1})),
                idempotency_key: None,
                turn_timeout_ms: None,
                dispatch: None,
                retry_backoff_ms: None,
                on_busy: turnd_proto::OnBusy::Enqueue,
            },
        )
    });
    assert!(matches!(&e[..], [Effect::Invoke { conn_id, .. }] if conn_id == "c1"));
    assert_eq!(invokes(&e)[0].input, json!({"a": 1}));
    assert_eq!(invokes(&e)[0].attempt, 1);
}

#[test]
fn no_free_worker_leaves_the_turn_awaiting_one_until_capacity_frees() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.free = false;
    let a = sim.submit();
    assert_eq!(sim.turn(&a).phase, Phase::AwaitingWorker);
    assert!(sim.st.inv.is_none());
    sim.free = true;
    let e = sim.advance(1);
    assert_eq!(invokes(&e).len(), 1);
    assert_eq!(sim.turn(&a).phase, Phase::Invoked);
}

#[test]
fn dispatch_timeout_fails_with_no_worker() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.cfg.turns.dispatch_timeout_ms = Some(300);
    sim.free = false;
    let a = sim.submit();
    assert_eq!(next_due(&sim.st, &sim.cfg), Some(sim.now + 300));
    sim.advance(299);
    assert!(!sim.turn(&a).status.is_terminal());
    sim.advance(1);
    assert_eq!(sim.turn(&a).status, TurnStatus::Failed);
    assert_eq!(cause(&sim, &a), ErrorCause::NoWorker);
}

#[test]
fn continue_runs_the_next_step_and_the_step_limit_fails_the_turn() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.cfg.turns.max_steps = 2;
    let a = sim.submit();
    let first = sim.live();
    sim.result(&first, Outcome::Continue(json!({"s": 1})));
    let second = sim.live();
    assert_ne!(first, second);
    assert_eq!(sim.turn(&a).step, 1);
    assert_eq!(sim.turn(&a).attempt, 1);
    sim.result(&second, Outcome::Continue(json!({"s": 2})));
    assert_eq!(sim.turn(&a).status, TurnStatus::Failed);
    assert_eq!(cause(&sim, &a), ErrorCause::StepLimit);
    assert!(sim.st.inv.is_none());
}

#[test]
fn a_too_large_result_fails_the_turn_invalid_result() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.cfg.turns.max_value_bytes = 8;
    let a = sim.submit();
    let inv = sim.live();
    sim.result(&inv, Outcome::Complete(json!("a long string")));
    assert_eq!(cause(&sim, &a), ErrorCause::InvalidResult);
}

#[test]
fn retries_back_off_doubling_up_to_the_cap_then_exhaust() {
    let mut sim = Sim::new(Delivery::AtLeastOnce, 4);
    let a = sim.submit();
    let mut delays = Vec::new();
    for attempt in 1..=3 {
        let inv = sim.live();
        assert_eq!(sim.inv(&inv).attempt, attempt);
        sim.result(&inv, retryable());
        let t = sim.turn(&a).clone();
        assert_eq!(t.phase, Phase::BackingOff);
        let delay = t.retry_at_ms.expect("a retry time") - sim.now;
        delays.push(delay);
        // Nothing before the retry time, the next attempt at it.
        assert!(invokes(&sim.advance(delay - 1)).is_empty());
        assert_eq!(invokes(&sim.advance(1)).len(), 1);
    }
    assert_eq!(delays, [50, 100, 150]);
    let inv = sim.live();
    sim.result(&inv, retryable());
    assert_eq!(sim.turn(&a).status, TurnStatus::Failed);
    assert_eq!(cause(&sim, &a), ErrorCause::AttemptsExhausted);
}

#[test]
fn a_non_retryable_failure_fails_handler_failed() {
    let mut sim = Sim::new(Delivery::AtLeastOnce, 3);
    let a = sim.submit();
    let inv = sim.live();
    sim.result(
        &inv,
        Outcome::Fail(Failure {
            code: "bad".into(),
            message: "no".into(),
            retryable: false,
        }),
    );
    assert_eq!(cause(&sim, &a), ErrorCause::HandlerFailed);
}

#[test]
fn a_result_is_fenced_by_its_invocation() {
    let mut sim = Sim::new(Delivery::AtLeastOnce, 3);
    let a = sim.submit();
    let before = sim.events.len();
    assert!(!sim.result("inv_other", complete()));
    assert_eq!(sim.events.len(), before);
    assert_eq!(sim.turn(&a).status, TurnStatus::Running);
    // A heartbeat for another invocation is refused and changes nothing.
    let mut hb = Heartbeat::Deadline(0);
    sim.run(|cx, tx| hb = heartbeat(cx, tx, "inv_other"));
    assert_eq!(hb, Heartbeat::NotCurrent);
    // A status for an invocation not being probed changes nothing.
    let inv = sim.live();
    sim.run(|cx, tx| probe_answer(cx, tx, &inv, InvocationState::Unknown));
    assert_eq!(sim.live(), inv);
}

#[test]
fn a_heartbeat_moves_the_deadline() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.submit();
    let inv = sim.live();
    sim.now += 600;
    let mut hb = Heartbeat::NotCurrent;
    sim.run(|cx, tx| hb = heartbeat(cx, tx, &inv));
    assert_eq!(hb, Heartbeat::Deadline(sim.now + 1_000));
    assert_eq!(sim.inv(&inv).deadline_ms, sim.now + 1_000);
    // The old deadline passes without a probe.
    assert!(probes(&sim.advance(500)).is_empty());
}

/// Drive the live invocation past its deadline: the probe goes out.
fn to_probing(sim: &mut Sim) -> String {
    let inv = sim.live();
    let e = sim.advance(1_000);
    assert_eq!(probes(&e), [inv.as_str()]);
    assert_eq!(sim.inv(&inv).wait, InvWait::Probing);
    inv
}

#[test]
fn silence_past_the_probe_is_outcome_unknown_at_most_once() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = to_probing(&mut sim);
    sim.advance(100);
    assert_eq!(sim.turn(&a).status, TurnStatus::Failed);
    let err = sim.turn(&a).error.clone().expect("an error");
    assert_eq!(err.cause, ErrorCause::OutcomeUnknown);
    assert_eq!(err.invocation_id.as_deref(), Some(inv.as_str()));
    assert_eq!(sim.inv(&inv).state, InvState::Unknown);
}

#[test]
fn a_worker_that_cannot_be_probed_is_outcome_unknown_at_its_deadline() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.probes = false;
    let a = sim.submit();
    let inv = sim.live();
    let e = sim.advance(1_000);
    assert!(probes(&e).is_empty());
    assert_eq!(cause(&sim, &a), ErrorCause::OutcomeUnknown);
    assert_eq!(sim.inv(&inv).state, InvState::Unknown);
}

#[test]
fn silence_past_the_probe_redispatches_at_least_once_then_exhausts() {
    let mut sim = Sim::new(Delivery::AtLeastOnce, 2);
    let a = sim.submit();
    let first = to_probing(&mut sim);
    let e = sim.advance(100);
    let second = sim.live();
    assert_ne!(first, second);
    assert_eq!(invokes(&e)[0].attempt, 2);
    let ev = sim.last_event(EventKind::Redispatched);
    assert_eq!(ev.detail.to_value()["previous_invocation_id"], json!(first));
    to_probing(&mut sim);
    sim.advance(100);
    assert_eq!(cause(&sim, &a), ErrorCause::AttemptsExhausted);
}

#[test]
fn probe_answered_running_cancels_and_the_ignored_cancel_times_out() {
    // at_least_once: the attempt is retried after a backoff.
    let mut sim = Sim::new(Delivery::AtLeastOnce, 2);
    let a = sim.submit();
    let inv = to_probing(&mut sim);
    let e = sim.run(|cx, tx| probe_answer(cx, tx, &inv, InvocationState::Running));
    assert_eq!(cancels(&e), [inv.as_str()]);
    assert_eq!(sim.inv(&inv).wait, InvWait::Cancelling);
    sim.advance(200);
    assert_eq!(sim.inv(&inv).state, InvState::TimedOut);
    assert_eq!(sim.turn(&a).phase, Phase::BackingOff);
    // at_most_once: failed timed_out.
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = to_probing(&mut sim);
    sim.run(|cx, tx| probe_answer(cx, tx, &inv, InvocationState::Running));
    sim.advance(200);
    assert_eq!(cause(&sim, &a), ErrorCause::TimedOut);
}

#[test]
fn probe_answered_finished_awaits_the_resent_result() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = to_probing(&mut sim);
    sim.run(|cx, tx| probe_answer(cx, tx, &inv, InvocationState::Finished));
    assert_eq!(sim.inv(&inv).wait, InvWait::AwaitingResend);
    assert!(sim.result(&inv, complete()));
    assert_eq!(sim.turn(&a).status, TurnStatus::Completed);
    // Without the resend: outcome unknown.
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = to_probing(&mut sim);
    sim.run(|cx, tx| probe_answer(cx, tx, &inv, InvocationState::Finished));
    sim.advance(100);
    assert_eq!(cause(&sim, &a), ErrorCause::OutcomeUnknown);
}

#[test]
fn probe_answered_unknown_is_lost_and_redispatched_with_the_same_attempt() {
    // Even at_most_once: the worker never ran it.
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.submit();
    let inv = to_probing(&mut sim);
    let e = sim.run(|cx, tx| probe_answer(cx, tx, &inv, InvocationState::Unknown));
    assert_eq!(sim.inv(&inv).state, InvState::Lost);
    assert_eq!(invokes(&e)[0].attempt, 1);
    assert_ne!(sim.live(), inv);
}

#[test]
fn a_disconnect_waits_the_reconnect_grace_then_the_outcome_is_unknown() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = sim.live();
    sim.connected = false;
    sim.advance(0);
    assert_eq!(sim.inv(&inv).wait, InvWait::AwaitingReconnect);
    assert_eq!(next_due(&sim.st, &sim.cfg), Some(sim.now + 500));
    sim.advance(499);
    assert!(!sim.turn(&a).status.is_terminal());
    sim.advance(1);
    assert_eq!(cause(&sim, &a), ErrorCause::OutcomeUnknown);
}

fn reconcile_with(
    sim: &mut Sim,
    instance: &str,
    inflight: &[String],
    finished: &[String],
) -> Option<Verdict> {
    let inv = sim.live();
    let mut v = None;
    sim.connected = true;
    sim.instance = instance.to_string();
    sim.run(|cx, tx| v = reconcile(cx, tx, &inv, instance, inflight, finished));
    v
}

#[test]
fn reconcile_keeps_redispatches_or_gives_up_by_the_hello_lists() {
    // Still running: kept, its own deadline applies again.
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.submit();
    let inv = sim.live();
    sim.connected = false;
    sim.advance(10);
    assert_eq!(
        reconcile_with(&mut sim, "i1", std::slice::from_ref(&inv), &[]),
        Some(Verdict::Kept)
    );
    assert_eq!(sim.inv(&inv).wait, InvWait::AwaitingResult);
    assert_eq!(sim.inv(&inv).deadline_ms, sim.inv(&inv).attempt_deadline_ms);
    // Finished: awaiting the resent result.
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.submit();
    let inv = sim.live();
    assert_eq!(
        reconcile_with(&mut sim, "i1", &[], std::slice::from_ref(&inv)),
        Some(Verdict::Kept)
    );
    assert_eq!(sim.inv(&inv).wait, InvWait::AwaitingResend);
    // Neither: never received, dispatched again with the same attempt.
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.submit();
    let inv = sim.live();
    assert_eq!(
        reconcile_with(&mut sim, "i1", &[], &[]),
        Some(Verdict::Redispatched)
    );
    assert_eq!(sim.inv(&inv).state, InvState::Lost);
    assert_eq!(sim.inv(&sim.live()).attempt, 1);
    // A new instance: the worker restarted, the outcome is unknown.
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = sim.live();
    assert_eq!(
        reconcile_with(&mut sim, "i2", std::slice::from_ref(&inv), &[]),
        Some(Verdict::Unknown)
    );
    assert_eq!(cause(&sim, &a), ErrorCause::OutcomeUnknown);
    // Not the live invocation: nothing.
    let mut v = Some(Verdict::Kept);
    sim.run(|cx, tx| v = reconcile(cx, tx, &inv, "i2", &[], &[]));
    assert_eq!(v, None);
}

#[test]
fn stopping_a_queued_turn_cancels_it_at_once_and_never_dispatches_it() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let b = sim.submit();
    let seq = sim.turn(&b).seq;
    let e = sim.run(|cx, tx| stop_turn(cx, tx, seq, String::new()));
    assert!(e.is_empty());
    assert_eq!(sim.turn(&b).status, TurnStatus::Cancelled);
    assert_eq!(
        sim.turn(&b).stop.as_ref().map(|s| s.reason.as_str()),
        Some("stop requested")
    );
    let inv = sim.live();
    sim.result(&inv, complete());
    assert_eq!(sim.turn(&a).status, TurnStatus::Completed);
    assert!(!sim.kinds(&b).contains(&EventKind::Dispatched));
}

#[test]
fn stopping_a_running_turn_cancels_its_invocation_and_ends_it_cancelled() {
    // The worker answers cancelled.
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = sim.live();
    let seq = sim.turn(&a).seq;
    let e = sim.run(|cx, tx| stop_turn(cx, tx, seq, "enough".into()));
    assert_eq!(cancels(&e), [inv.as_str()]);
    assert_eq!(sim.inv(&inv).wait, InvWait::Cancelling);
    sim.result(
        &inv,
        Outcome::Cancelled(Cancelled {
            message: "ok".into(),
        }),
    );
    assert_eq!(sim.turn(&a).status, TurnStatus::Cancelled);
    assert_eq!(
        sim.turn(&a).stop.as_ref().map(|s| s.reason.as_str()),
        Some("enough")
    );
    // The worker ignores the cancel: cancelled at the grace, the invocation abandoned.
    let mut sim = Sim::new(Delivery::AtLeastOnce, 3);
    let a = sim.submit();
    let inv = sim.live();
    let seq = sim.turn(&a).seq;
    sim.run(|cx, tx| stop_turn(cx, tx, seq, String::new()));
    sim.advance(200);
    assert_eq!(sim.turn(&a).status, TurnStatus::Cancelled);
    assert_eq!(sim.inv(&inv).state, InvState::Abandoned);
    // A continue after a stop never runs more.
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = sim.live();
    let seq = sim.turn(&a).seq;
    sim.run(|cx, tx| stop_turn(cx, tx, seq, String::new()));
    sim.result(&inv, Outcome::Continue(json!(1)));
    assert_eq!(sim.turn(&a).status, TurnStatus::Cancelled);
    assert!(sim.st.inv.is_none());
}

#[test]
fn stopping_with_the_worker_away_cancels_at_once() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = sim.live();
    sim.connected = false;
    sim.advance(0);
    let seq = sim.turn(&a).seq;
    sim.run(|cx, tx| stop_turn(cx, tx, seq, String::new()));
    assert_eq!(sim.turn(&a).status, TurnStatus::Cancelled);
    assert_eq!(sim.inv(&inv).state, InvState::Abandoned);
    // A result that still arrives is late.
    let rec = sim.inv(&inv).clone();
    let mut v = LateVerdict::Duplicate;
    sim.run(|cx, tx| v = late_result(cx, tx, &rec, &raw(complete()), None));
    assert_eq!(v, LateVerdict::Recorded);
    assert!(sim.inv(&inv).late);
}

#[test]
fn stopping_a_turn_awaiting_a_worker_or_backing_off_cancels_at_once() {
    let mut sim = Sim::new(Delivery::AtLeastOnce, 3);
    let a = sim.submit();
    let inv = sim.live();
    sim.result(&inv, retryable());
    assert_eq!(sim.turn(&a).phase, Phase::BackingOff);
    let seq = sim.turn(&a).seq;
    sim.run(|cx, tx| stop_turn(cx, tx, seq, String::new()));
    assert_eq!(sim.turn(&a).status, TurnStatus::Cancelled);
    assert!(invokes(&sim.advance(1_000)).is_empty());
}

#[test]
fn a_stop_wins_over_the_turns_own_deadline() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit_with(Some(100));
    let seq = sim.turn(&a).seq;
    sim.run(|cx, tx| stop_turn(cx, tx, seq, String::new()));
    sim.advance(100);
    assert_eq!(sim.turn(&a).status, TurnStatus::Cancelled);
}

#[test]
fn the_turns_own_deadline_fails_it_timed_out_and_cancels_its_invocation() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit_with(Some(100));
    let inv = sim.live();
    assert_eq!(next_due(&sim.st, &sim.cfg), Some(sim.now + 100));
    let e = sim.advance(100);
    assert_eq!(cancels(&e), [inv.as_str()]);
    assert_eq!(cause(&sim, &a), ErrorCause::TimedOut);
    assert_eq!(sim.inv(&inv).state, InvState::TimedOut);
}

#[test]
fn a_queued_turn_whose_deadline_passed_fails_when_promoted() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let b = sim.submit_with(Some(10));
    let c = sim.submit();
    sim.now += 50;
    let inv = sim.live();
    sim.result(&inv, complete());
    assert_eq!(sim.turn(&a).status, TurnStatus::Completed);
    assert_eq!(cause(&sim, &b), ErrorCause::TimedOut);
    assert_eq!(sim.turn(&c).status, TurnStatus::Running);
}

#[test]
fn session_stop_stops_every_turn_and_promotes_nothing() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.free = false;
    let ids: Vec<String> = (0..3).map(|_| sim.submit()).collect();
    sim.free = true;
    sim.run(|cx, tx| stop_session(cx, tx, "closing"));
    for id in &ids {
        assert_eq!(sim.turn(id).status, TurnStatus::Cancelled);
        assert!(!sim.kinds(id).contains(&EventKind::Dispatched));
    }
    assert!(sim.slots.is_empty());
}

#[test]
fn a_late_complete_amends_the_outcome_unknown_failure_naming_it() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = to_probing(&mut sim);
    sim.advance(100);
    assert_eq!(cause(&sim, &a), ErrorCause::OutcomeUnknown);
    let rec = sim.inv(&inv).clone();
    let turn = sim.turn(&a).clone();
    let mut v = LateVerdict::Duplicate;
    sim.run(|cx, tx| v = late_result(cx, tx, &rec, &raw(complete()), Some(&turn)));
    assert_eq!(v, LateVerdict::Recorded);
    let t = sim.turn(&a);
    assert_eq!(t.status, TurnStatus::Completed);
    assert!(t.recovered);
    assert!(t.error.is_none());
    assert_eq!(
        sim.last_event(EventKind::Amended).detail.to_value()["invocation_id"],
        json!(inv)
    );
    // The same result again is a duplicate and changes nothing.
    let rec = sim.inv(&inv).clone();
    let before = sim.events.len();
    sim.run(|cx, tx| v = late_result(cx, tx, &rec, &raw(complete()), Some(&turn)));
    assert_eq!(v, LateVerdict::Duplicate);
    assert_eq!(sim.events.len(), before);
}

#[test]
fn a_late_failure_or_a_late_result_of_another_invocation_amends_nothing() {
    let mut sim = Sim::new(Delivery::AtLeastOnce, 2);
    let a = sim.submit();
    let first = to_probing(&mut sim);
    sim.advance(100);
    // The first attempt's outcome is unknown; the second runs. Its late result is
    // evidence only: the turn goes on with the second attempt.
    let second = sim.live();
    let rec = sim.inv(&first).clone();
    let turn = sim.turn(&a).clone();
    let mut v = LateVerdict::Duplicate;
    sim.run(|cx, tx| v = late_result(cx, tx, &rec, &raw(complete()), Some(&turn)));
    assert_eq!(v, LateVerdict::Recorded);
    assert_eq!(sim.turn(&a).status, TurnStatus::Running);
    assert_eq!(sim.live(), second);
    assert_eq!(sim.kinds(&a).last(), Some(&EventKind::LateResult));
    // A late failure never amends.
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = to_probing(&mut sim);
    sim.advance(100);
    let rec = sim.inv(&inv).clone();
    let turn = sim.turn(&a).clone();
    sim.run(|cx, tx| {
        late_result(
            cx,
            tx,
            &rec,
            &Outcome::Fail(Failure {
                code: "x".into(),
                message: String::new(),
                retryable: false,
            }),
            Some(&turn),
        );
    });
    assert_eq!(sim.turn(&a).status, TurnStatus::Failed);
}

#[test]
fn a_late_complete_never_amends_a_failure_of_another_cause() {
    // Failed timed_out, naming the invocation: its late complete is evidence only.
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = to_probing(&mut sim);
    sim.run(|cx, tx| probe_answer(cx, tx, &inv, InvocationState::Running));
    sim.advance(200);
    assert_eq!(cause(&sim, &a), ErrorCause::TimedOut);
    let rec = sim.inv(&inv).clone();
    let turn = sim.turn(&a).clone();
    let mut v = LateVerdict::Duplicate;
    sim.run(|cx, tx| v = late_result(cx, tx, &rec, &raw(complete()), Some(&turn)));
    assert_eq!(v, LateVerdict::Recorded);
    assert_eq!(sim.turn(&a).status, TurnStatus::Failed);
    assert!(!sim.kinds(&a).contains(&EventKind::Amended));
}

#[test]
fn a_cancel_in_progress_survives_a_reconnect() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = sim.live();
    let seq = sim.turn(&a).seq;
    sim.run(|cx, tx| stop_turn(cx, tx, seq, String::new()));
    let mut v = None;
    let inflight = [inv.clone()];
    let e = sim.run(|cx, tx| v = reconcile(cx, tx, &inv, "i1", &inflight, &[]));
    assert_eq!(v, Some(Verdict::Kept));
    assert_eq!(cancels(&e), [inv.as_str()]);
    assert_eq!(sim.inv(&inv).wait, InvWait::Cancelling);
}

#[test]
fn next_due_is_the_earliest_of_the_phase_and_the_turn_deadline() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    assert_eq!(next_due(&sim.st, &sim.cfg), None);
    sim.submit_with(Some(5_000));
    assert_eq!(next_due(&sim.st, &sim.cfg), Some(sim.now + 1_000));
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.submit_with(Some(300));
    assert_eq!(next_due(&sim.st, &sim.cfg), Some(sim.now + 300));
}
