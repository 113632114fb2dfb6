//! `store.check` on the in-memory store: what a torn or half-done deletion leaves is
//! reported, and a whole store has no violation.

use super::*;
use crate::kv::mem::MemKv;
use crate::model::keys;
use crate::model::records::{Phase, RawJson, SessionMeta, TurnRecord};
use crate::model::Batch;
use serde_json::json;
use std::sync::Arc;
use turnd_proto::{Event, EventKind, TurnStatus};

fn invariants(store: &Store) -> Vec<String> {
    let mut v: Vec<String> = check_store(store)
        .expect("check")
        .into_iter()
        .map(|v| v.invariant)
        .collect();
    v.sort();
    v
}

/// What a torn or half-done deletion would leave: a turn-list entry naming no
/// turn, an event about a turn that is not stored, counts that are not those of
/// the stored turns. A whole store has none of them.
#[tokio::test]
async fn leftovers_of_deleted_turns_are_reported() {
    let store = Store::new(Arc::new(MemKv::new()));
    let input = RawJson::from_value(&json!(null));
    let mut t = TurnRecord::admitted("t1".into(), "s", 1, "f", input, 0);
    t.status = TurnStatus::Completed;
    t.phase = Phase::Done;
    let mut meta = SessionMeta::new("s");
    meta.last_turn_seq = 1;
    meta.last_event_seq = 1;
    meta.counts.completed = 1;
    let ev = |seq: u64, turn: &str| Event {
        seq,
        session_id: "s".into(),
        turn_id: turn.into(),
        at_ms: 0,
        kind: EventKind::Admitted,
        detail: json!({}),
    };
    let mut b = Batch::new();
    b.put_admission(&t);
    b.put_turn(&t);
    b.put_session_meta(&meta);
    b.put_events(&[ev(1, "t1")]);
    store.commit(b).await.expect("commit");
    assert!(invariants(&store).is_empty(), "{:?}", invariants(&store));

    let mut b = Batch::new();
    b.put_raw(keys::session_turn("s", 2), b"t-gone".to_vec());
    meta.last_turn_seq = 2;
    meta.last_event_seq = 2;
    meta.counts.completed = 2;
    b.put_session_meta(&meta);
    b.put_events(&[ev(2, "t-gone")]);
    store.commit(b).await.expect("commit");
    assert_eq!(
        invariants(&store),
        vec![
            "counts_mismatch",
            "event_of_missing_turn",
            "list_entry_dangling"
        ]
    );
}

/// A turn suspended for input holds its session's lock with no live invocation: a
/// session with one is clean; a live invocation beside it, or an unfinished turn
/// before it, is reported.
#[tokio::test]
async fn a_suspended_turn_is_the_lock_holder_without_an_invocation() {
    use crate::model::records::{FunctionSettings, InputWait, InvState, InvWait, InvocationRecord};
    use turnd_proto::{Delivery, OnTimeout};
    let store = Store::new(Arc::new(MemKv::new()));
    let input = RawJson::from_value(&json!("hi"));
    let suspended = |id: &str, seq: u64| {
        let mut t = TurnRecord::admitted(id.into(), "s", seq, "f", input.clone(), 0);
        t.status = TurnStatus::Running;
        t.phase = Phase::AwaitingInput;
        t.invocation_id = Some(format!("inv-{id}"));
        t.input_request = Some(Box::new(InputWait {
            prompt: Some(RawJson::from_value(&json!("approve?"))),
            since_ms: 1,
            deadline_ms: None,
            on_timeout: OnTimeout::Fail,
        }));
        t
    };
    let t1 = suspended("t1", 1);
    let mut meta = SessionMeta::new("s");
    meta.last_turn_seq = 1;
    meta.counts.running = 1;
    meta.active_from = Some(1);
    let mut b = Batch::new();
    b.put_admission(&t1);
    b.put_new_turn(&t1);
    b.put_session_meta(&meta);
    store.commit(b).await.expect("commit");
    assert!(invariants(&store).is_empty(), "{:?}", invariants(&store));

    // A live invocation of the suspended turn.
    let inv = InvocationRecord {
        invocation_id: "inv-t1".into(),
        turn_id: "t1".into(),
        session_id: "s".into(),
        function_id: "f".into(),
        step: 0,
        attempt: 1,
        worker_id: "w".into(),
        instance_id: "i".into(),
        settings: FunctionSettings {
            timeout_ms: 1000,
            delivery: Delivery::AtMostOnce,
            max_attempts: 1,
        },
        state: InvState::Active,
        wait: InvWait::AwaitingResult,
        wait_since_ms: 0,
        deadline_ms: 1000,
        attempt_deadline_ms: 1000,
        dispatched_at_ms: 0,
        ended_at_ms: None,
        outcome: None,
        late: false,
    };
    let mut b = Batch::new();
    b.put_new_invocation(&inv);
    store.commit(b).await.expect("commit");
    assert!(
        invariants(&store).contains(&"suspended_with_invocation".to_string()),
        "{:?}",
        invariants(&store)
    );

    // A suspended turn behind an unfinished one, in another session.
    let mut q = TurnRecord::admitted("u1".into(), "s2", 1, "f", input.clone(), 0);
    q.phase = Phase::AwaitingWorker;
    let mut u2 = suspended("u2", 2);
    u2.session_id = "s2".into();
    let mut meta2 = SessionMeta::new("s2");
    meta2.last_turn_seq = 2;
    meta2.counts.queued = 1;
    meta2.counts.running = 1;
    meta2.active_from = Some(1);
    let mut b = Batch::new();
    for t in [&q, &u2] {
        b.put_admission(t);
        b.put_new_turn(t);
    }
    b.put_session_meta(&meta2);
    store.commit(b).await.expect("commit");
    let found = invariants(&store);
    assert!(
        found.contains(&"suspended_not_holder".to_string()),
        "{found:?}"
    );
}

/// Retention deletes turns and lowers the session's counts without an event: a sweep
/// committed between a session's reads of its counts and of its turns is read again,
/// not reported as counts that disagree.
#[tokio::test]
async fn counts_read_across_a_retention_sweep_are_read_again() {
    let kv = Arc::new(crate::kv::mem::CommitsAfterRead::new());
    let store = Store::new(kv.clone());
    let mut meta = SessionMeta::new("s");
    let mut b = Batch::new();
    for seq in 1..=3 {
        let input = RawJson::from_value(&json!(null));
        let mut t = TurnRecord::admitted(format!("t{seq}"), "s", seq, "f", input, 0);
        t.status = TurnStatus::Completed;
        t.phase = Phase::Done;
        b.put_admission(&t);
        b.put_turn(&t);
    }
    meta.last_turn_seq = 3;
    meta.counts.completed = 3;
    b.put_session_meta(&meta);
    store.commit(b).await.expect("commit");
    assert!(sessions::counts_agree_now(&store, "s").expect("check"));
    // The sweep: t1's record and list entry gone, the counts one lower, the last
    // event the same.
    let mut sweep = Batch::new();
    sweep.delete(keys::turn("t1"));
    sweep.delete(keys::session_turn("s", 1));
    meta.counts.completed = 2;
    sweep.put_session_meta(&meta);
    kv.arm(sweep);
    assert!(sessions::counts_agree_now(&store, "s").expect("check"));
    assert!(invariants(&store).is_empty(), "{:?}", invariants(&store));
}
