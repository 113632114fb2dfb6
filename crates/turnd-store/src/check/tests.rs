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
