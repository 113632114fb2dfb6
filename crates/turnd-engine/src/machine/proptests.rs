//! Random event sequences through the machine, checking after every transition the
//! invariants `store.check` checks: one invocation in flight per session, FIFO,
//! terminal states carry their cause, and more.

use std::collections::HashMap;

use proptest::prelude::*;
use serde_json::json;
use turnd_proto::{Cancelled, Delivery, EventKind, Failure, InvocationState, Outcome, TurnStatus};
use turnd_store::{InvState, Phase};

use super::sim::{raw, Sim};
use super::*;
use crate::view::{wait_of, wait_shape};

#[derive(Debug, Clone, Copy)]
enum Kind {
    Complete,
    Continue,
    Retryable,
    Fatal,
    Cancelled,
}

#[derive(Debug, Clone)]
enum Op {
    Submit(Option<u64>),
    Result(Kind),
    /// A result for an earlier invocation (by index), as a worker may send late.
    OldResult(usize, Kind),
    Advance(u64),
    Disconnect,
    /// Reconnect (a new instance?) listing the live invocation as in flight (0),
    /// finished (1) or neither (2).
    Reconnect(bool, u8),
    Probe(u8),
    Heartbeat,
    Stop(usize),
    StopSession,
    Capacity(bool),
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        Just(Kind::Complete),
        Just(Kind::Continue),
        Just(Kind::Retryable),
        Just(Kind::Fatal),
        Just(Kind::Cancelled),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => proptest::option::of(1u64..3_000).prop_map(Op::Submit),
        4 => kind().prop_map(Op::Result),
        1 => (0usize..16, kind()).prop_map(|(i, k)| Op::OldResult(i, k)),
        4 => prop_oneof![Just(0u64), 1u64..300, 300u64..2_000].prop_map(Op::Advance),
        1 => Just(Op::Disconnect),
        1 => (any::<bool>(), 0u8..3).prop_map(|(n, l)| Op::Reconnect(n, l)),
        1 => (0u8..3).prop_map(Op::Probe),
        1 => Just(Op::Heartbeat),
        1 => (0usize..8).prop_map(Op::Stop),
        1 => Just(Op::StopSession),
        1 => any::<bool>().prop_map(Op::Capacity),
    ]
}

fn outcome(k: Kind) -> Outcome {
    match k {
        Kind::Complete => Outcome::Complete(json!({"done": true})),
        Kind::Continue => Outcome::Continue(json!({"more": 1})),
        Kind::Retryable => Outcome::Fail(Failure {
            code: "busy".into(),
            message: String::new(),
            retryable: true,
        }),
        Kind::Fatal => Outcome::Fail(Failure {
            code: "bad".into(),
            message: String::new(),
            retryable: false,
        }),
        Kind::Cancelled => Outcome::Cancelled(Cancelled {
            message: String::new(),
        }),
    }
}

fn live(sim: &Sim) -> Option<String> {
    sim.st.inv.as_ref().map(|i| i.invocation_id.clone())
}

fn apply(sim: &mut Sim, op: &Op, minted: &mut Vec<String>) {
    match op {
        Op::Submit(t) => {
            if (sim.st.active.len() as u64) < sim.cfg.turns.max_queued_per_session {
                sim.submit_with(*t);
            }
        }
        Op::Result(k) => {
            if let Some(inv) = live(sim) {
                assert!(
                    sim.result(&inv, outcome(*k)),
                    "the live invocation's result applies"
                );
            }
        }
        Op::OldResult(i, k) => {
            let Some(inv) = minted.get(*i).cloned() else {
                return;
            };
            if live(sim).as_deref() == Some(inv.as_str()) {
                sim.result(&inv, outcome(*k));
                return;
            }
            // As the shell does: not current, so its stored record decides.
            let rec = sim.inv(&inv).clone();
            let turn = sim.turns.get(&rec.turn_id).cloned();
            let o = raw(outcome(*k));
            let mut v = LateVerdict::Duplicate;
            sim.run(|cx, tx| v = late_result(cx, tx, &rec, &o, turn.as_ref()));
            assert_ne!(
                v,
                LateVerdict::ActiveNotCurrent,
                "an ended invocation's record is active"
            );
        }
        Op::Advance(ms) => {
            sim.advance(*ms);
        }
        Op::Disconnect => {
            sim.connected = false;
            sim.run(due);
        }
        Op::Reconnect(new_instance, list) => {
            sim.connected = true;
            if *new_instance {
                sim.instance = format!("i{}", sim.events.len());
            }
            let instance = sim.instance.clone();
            match live(sim) {
                Some(inv) => {
                    let listed = vec![inv.clone()];
                    let (inflight, finished) = match list {
                        0 => (listed, Vec::new()),
                        1 => (Vec::new(), listed),
                        _ => (Vec::new(), Vec::new()),
                    };
                    let mut v = None;
                    sim.run(|cx, tx| v = reconcile(cx, tx, &inv, &instance, &inflight, &finished));
                    assert!(v.is_some(), "the live invocation is reconciled");
                }
                None => {
                    sim.run(due);
                }
            }
        }
        Op::Probe(s) => {
            if let Some(inv) = live(sim) {
                let state = match s {
                    0 => InvocationState::Running,
                    1 => InvocationState::Finished,
                    _ => InvocationState::Unknown,
                };
                sim.run(|cx, tx| probe_answer(cx, tx, &inv, state));
            }
        }
        Op::Heartbeat => {
            if let Some(inv) = live(sim) {
                let mut hb = Heartbeat::NotCurrent;
                sim.run(|cx, tx| hb = heartbeat(cx, tx, &inv));
                assert_ne!(hb, Heartbeat::NotCurrent);
            }
        }
        Op::Stop(i) => {
            let Some(seq) = sim.st.active.seqs().nth(*i) else {
                return;
            };
            sim.run(|cx, tx| stop_turn(cx, tx, seq, String::new()));
        }
        Op::StopSession => {
            sim.run(|cx, tx| stop_session(cx, tx, ""));
        }
        Op::Capacity(free) => {
            sim.free = *free;
            sim.run(due);
        }
    }
    for id in sim.invs.keys() {
        if !minted.contains(id) {
            minted.push(id.clone());
        }
    }
    minted.sort_by_key(|id| id.trim_start_matches("inv_").parse::<u64>().unwrap_or(0));
}

/// The invariants, after every transition.
fn check(sim: &Sim, terminal_seen: &mut HashMap<String, TurnStatus>) {
    // One invocation in flight: the live one holds the only slot, and no other
    // invocation record is active.
    let live = live(sim);
    let held: Vec<&String> = sim.slots.iter().collect();
    assert_eq!(
        held,
        live.iter().collect::<Vec<_>>(),
        "slots held vs the live invocation"
    );
    let active: Vec<&String> = sim
        .invs
        .values()
        .filter(|i| i.state == InvState::Active)
        .map(|i| &i.invocation_id)
        .collect();
    assert_eq!(
        active,
        live.iter().collect::<Vec<_>>(),
        "active invocation records"
    );
    // FIFO: only the holder has left the queue; the live invocation is the holder's.
    let mut turns = sim.st.active.iter();
    if let Some(h) = turns.next() {
        assert_eq!(
            h.phase == Phase::Invoked,
            live.is_some(),
            "holder invoked iff an invocation is live"
        );
        if let Some(inv) = &sim.st.inv {
            assert_eq!(inv.turn_id, h.turn_id);
            assert_eq!(h.invocation_id.as_ref(), Some(&inv.invocation_id));
        }
        if h.status == TurnStatus::Running {
            let path = match h.phase {
                Phase::AwaitingWorker => true,
                Phase::BackingOff => h.retry_at_ms.is_some(),
                Phase::Invoked => live.is_some(),
                Phase::AwaitingInput => h.input_request.is_some() && live.is_none(),
                Phase::Queued | Phase::Done => false,
            };
            assert!(path, "running turn without a path: {:?}", h.phase);
        }
        if matches!(h.phase, Phase::Invoked | Phase::BackingOff) {
            assert!(
                next_due(&sim.st, &sim.cfg).is_some(),
                "a timer for {:?}",
                h.phase
            );
        }
    } else {
        assert!(live.is_none(), "an invocation without a turn");
    }
    for t in turns {
        assert_eq!(
            (t.status, t.phase),
            (TurnStatus::Queued, Phase::Queued),
            "a turn behind the holder left the queue"
        );
    }
    // Dispatches go in seq order.
    let mut last_dispatched = 0;
    for e in &sim.events {
        if matches!(e.kind, EventKind::Dispatched | EventKind::Redispatched) {
            let seq = sim.turns[&e.turn_id].seq;
            assert!(
                seq >= last_dispatched,
                "dispatch of seq {seq} after seq {last_dispatched}"
            );
            last_dispatched = seq;
        }
    }
    // Terminal states carry their cause and never change, but for an amendment.
    for t in sim.turns.values() {
        match t.status {
            TurnStatus::Failed => assert!(t.error.is_some(), "failed without a cause"),
            TurnStatus::Cancelled => assert!(t.stop.is_some(), "cancelled without a stop"),
            TurnStatus::Completed => assert!(t.error.is_none()),
            _ => {}
        }
        if let Some(before) = terminal_seen.get(&t.turn_id) {
            let amended =
                *before == TurnStatus::Failed && t.status == TurnStatus::Completed && t.recovered;
            assert!(
                t.status == *before || amended,
                "terminal {before:?} became {:?}",
                t.status
            );
        }
        if t.status.is_terminal() {
            terminal_seen.insert(t.turn_id.clone(), t.status);
            assert!(
                sim.st.active.get(t.seq).is_none(),
                "a terminal turn is still active"
            );
        }
    }
    // The wait the index keeps (no words) is the wait a view shows, words aside.
    for t in sim.st.active.iter() {
        let dispatch_timeout = Some(5_000);
        let shown = wait_of(&sim.st, t, dispatch_timeout, &|ms| ms.to_string(), None);
        let kept = wait_shape(&sim.st, t, dispatch_timeout);
        assert!(!shown.reason.is_empty() && kept.reason.is_empty());
        assert_eq!(
            (
                kept.state,
                kept.since_ms,
                kept.deadline_ms,
                kept.on_deadline
            ),
            (
                shown.state,
                shown.since_ms,
                shown.deadline_ms,
                shown.on_deadline
            ),
            "the index's wait of {} against the shown one ({})",
            t.turn_id,
            shown.reason
        );
        assert_eq!(
            (kept.ahead, &kept.last_error),
            (shown.ahead, &shown.last_error)
        );
    }
    // Events are numbered without gaps.
    for (i, e) in sim.events.iter().enumerate() {
        assert_eq!(e.seq, i as u64 + 1);
    }
    assert_eq!(sim.st.meta.last_event_seq, sim.events.len() as u64);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_events_keep_the_invariants(
        at_least_once in any::<bool>(),
        max_attempts in 1u32..4,
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let delivery = if at_least_once { Delivery::AtLeastOnce } else { Delivery::AtMostOnce };
        let mut sim = Sim::new(delivery, max_attempts);
        sim.cfg.turns.max_steps = 3;
        sim.cfg.turns.max_queued_per_session = 6;
        let mut minted = Vec::new();
        let mut terminal_seen = HashMap::new();
        for op in &ops {
            apply(&mut sim, op, &mut minted);
            check(&sim, &mut terminal_seen);
        }
    }
}
