//! The transitions from outside a session's turns: recovery at start-up and
//! retention's deletes, at the machine level.

use serde_json::json;
use turnd_proto::{Delivery, ErrorCause, Outcome, TurnStatus};
use turnd_store::{InvWait, SessionMeta};

use super::sim::Sim;
use super::*;
use crate::session::Pending;

#[test]
fn recovery_gives_an_invocation_in_flight_a_fresh_reconnect_grace() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = sim.live();
    sim.advance(300);
    sim.run(recovered);
    let rec = sim.inv(&inv);
    assert_eq!(rec.wait, InvWait::AwaitingReconnect);
    assert_eq!(rec.wait_since_ms, sim.now);
    assert_eq!(rec.deadline_ms, sim.now + sim.cfg.turns.reconnect_grace_ms);
    assert_eq!(next_due(&sim.st, &sim.cfg), Some(rec.deadline_ms));
    // Its worker never comes back: the outcome is unknown at the end of the grace.
    sim.connected = false;
    sim.advance(499);
    assert!(!sim.turn(&a).status.is_terminal());
    sim.advance(1);
    assert_eq!(sim.turn(&a).status, TurnStatus::Failed);
    let error = sim.turn(&a).error.as_ref().expect("an error");
    assert_eq!(error.cause, ErrorCause::OutcomeUnknown);
}

#[test]
fn recovery_leaves_a_cancel_in_progress_its_own_deadline() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    let a = sim.submit();
    let inv = sim.live();
    let seq = sim.turn(&a).seq;
    sim.run(|cx, tx| stop_turn(cx, tx, seq, String::new()));
    let cancelling = sim.inv(&inv).clone();
    assert_eq!(cancelling.wait, InvWait::Cancelling);
    sim.advance(50);
    let events = sim.events.len();
    sim.run(recovered);
    assert_eq!(sim.inv(&inv), &cancelling);
    assert_eq!(sim.events.len(), events);
}

#[test]
fn recovery_without_an_invocation_in_flight_changes_nothing() {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.free = false;
    let a = sim.submit();
    let before = sim.turn(&a).clone();
    sim.run(recovered);
    assert!(sim.st.inv.is_none());
    assert_eq!(sim.turn(&a), &before);
}

/// A session with one turn completed and `more` turns submitted after it.
fn with_a_finished_turn(more: usize) -> Sim {
    let mut sim = Sim::new(Delivery::AtMostOnce, 1);
    sim.submit();
    let inv = sim.live();
    assert!(sim.result(&inv, Outcome::Complete(json!(1))));
    for _ in 0..more {
        sim.submit();
    }
    // (The counts are kept by the write, which the simulator does not make.)
    sim.st.meta.counts.completed = 1;
    sim.st.meta.counts.running = more.min(1) as u64;
    sim.st.meta.counts.queued = more.saturating_sub(1) as u64;
    sim
}

fn expire(sim: &mut Sim, statuses: &[TurnStatus], watched: bool) -> ExpiryVerdict {
    let gone = Expiry {
        statuses,
        pruned: true,
        watched,
    };
    sim.step(|cx, tx| expired(cx, tx, gone)).0
}

#[test]
fn expiry_takes_its_turns_out_of_the_counts_of_a_session_it_keeps() {
    let mut sim = with_a_finished_turn(2);
    let last_turn_seq = sim.st.meta.last_turn_seq;
    assert_eq!(
        expire(&mut sim, &[TurnStatus::Completed], false),
        ExpiryVerdict::Kept
    );
    let meta = &sim.st.meta;
    assert_eq!(
        (
            meta.counts.completed,
            meta.counts.running,
            meta.counts.queued
        ),
        (0, 1, 1)
    );
    assert!(meta.events_pruned);
    assert_eq!(meta.last_turn_seq, last_turn_seq);
}

#[test]
fn expiry_forgets_a_session_left_with_nothing() {
    let mut sim = with_a_finished_turn(0);
    assert!(sim.st.meta.last_turn_seq > 0);
    assert_eq!(
        expire(&mut sim, &[TurnStatus::Completed], false),
        ExpiryVerdict::Forgotten
    );
    let fresh = SessionMeta::new("s1");
    assert_eq!(sim.st.meta.last_turn_seq, fresh.last_turn_seq);
    assert_eq!(sim.st.meta.last_event_seq, fresh.last_event_seq);
    assert_eq!(sim.st.meta.counts, fresh.counts);
    assert!(!sim.st.meta.events_pruned);
}

#[test]
fn a_session_watched_waiting_or_retrying_is_kept_when_its_last_turn_expires() {
    let mut sim = with_a_finished_turn(0);
    assert_eq!(
        expire(&mut sim, &[TurnStatus::Completed], true),
        ExpiryVerdict::Kept
    );
    assert_eq!(sim.st.meta.counts.completed, 0);
    assert!(sim.st.meta.last_turn_seq > 0);

    let mut sim = with_a_finished_turn(0);
    sim.st.timer = Some(sim.now + 10);
    let verdict = expire(&mut sim, &[TurnStatus::Completed], false);
    assert_eq!(verdict, ExpiryVerdict::Kept);

    let mut sim = with_a_finished_turn(0);
    sim.st.pending = Some(Box::new(Pending {
        error: "disk".into(),
        since_ms: sim.now,
        retry_at_ms: sim.now + 50,
        delay_ms: 50,
    }));
    let verdict = expire(&mut sim, &[TurnStatus::Completed], false);
    assert_eq!(verdict, ExpiryVerdict::Kept);

    // Turns left that this sweep did not delete keep it too.
    let mut sim = with_a_finished_turn(0);
    sim.st.meta.counts.failed = 1;
    let verdict = expire(&mut sim, &[TurnStatus::Completed], false);
    assert_eq!(verdict, ExpiryVerdict::Kept);
}

/// A cluster's new leader recovers an invocation whose worker is attached to its node
/// already (it said hello before the node led the partition): no hello will reconcile
/// it, so the worker is probed at once, and its answer settles it as after a passed
/// deadline. One daemon on its own waits for the worker's hello as before.
#[test]
fn a_new_leader_probes_the_attached_worker_of_a_recovered_invocation() {
    for (partition, probes, probed) in [
        (
            Some(crate::config::Partition { index: 0, count: 1 }),
            true,
            true,
        ),
        (
            Some(crate::config::Partition { index: 0, count: 1 }),
            false,
            false,
        ),
        (None, true, false),
    ] {
        let mut sim = Sim::new(Delivery::AtMostOnce, 1);
        sim.cfg.partition = partition;
        sim.probes = probes;
        let a = sim.submit();
        let inv = sim.live();
        sim.advance(300);
        sim.run(recovered);
        assert_eq!(sim.inv(&inv).wait, InvWait::AwaitingReconnect);
        let effects = sim.run(due);
        let rec = sim.inv(&inv);
        if probed {
            assert_eq!(rec.wait, InvWait::Probing, "{partition:?}");
            assert!(
                effects.iter().any(|e| matches!(e, Effect::Probe { .. })),
                "{effects:?}"
            );
            assert_eq!(
                sim.kinds(&a).last(),
                Some(&turnd_proto::EventKind::ProbeSent)
            );
        } else if partition.is_some() {
            // An iii worker keeps its handlers: it still runs it, under its deadline.
            assert_eq!(rec.wait, InvWait::AwaitingResult);
            assert_eq!(rec.deadline_ms, rec.attempt_deadline_ms.max(sim.now));
            assert!(effects.is_empty(), "{effects:?}");
        } else {
            assert_eq!(rec.wait, InvWait::AwaitingReconnect);
            assert!(effects.is_empty(), "{effects:?}");
        }
    }
}
