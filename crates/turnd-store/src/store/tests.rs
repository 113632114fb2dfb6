//! Reads of the typed store on the in-memory store: events read back one by one,
//! where reads remember a session's visible events to start, turns found while
//! they finish, inputs stored apart, folded turns and unfinished ones.

use std::sync::Arc;

use serde_json::json;
use turnd_proto::{Event, EventKind};

use super::*;
use crate::check::check_store;
use crate::kv::mem;
use crate::model::records::{
    FunctionSettings, InvState, InvWait, Phase, TurnInput, INPUT_APART_BYTES,
};

#[tokio::test]
async fn paged_scans_visit_every_meta_once_in_key_order() {
    let store = Store::new(Arc::new(mem::MemKv::new()));
    let mut b = Batch::new();
    let ids: Vec<String> = (0..10).map(|i| format!("s{i:02}")).collect();
    for id in &ids {
        b.put_session_meta(&SessionMeta::new(id));
    }
    store.commit(b).await.expect("commit");

    for limit in [1, 3, 10, 50] {
        let mut seen = Vec::new();
        let mut from = Store::FIRST.to_vec();
        for round in 0.. {
            assert!(round <= 60, "metas: pages of {limit} do not end");
            let (page, next) = store.session_metas_page(&from, limit).expect("page");
            assert!(page.len() <= limit);
            seen.extend(page.into_iter().map(|m| m.session_id));
            match next {
                Some(n) => from = n,
                None => break,
            }
        }
        assert_eq!(seen, ids, "metas with pages of {limit}");
    }
}

fn ev(seq: u64) -> Event {
    Event {
        seq,
        session_id: "s".into(),
        turn_id: format!("t{seq}"),
        at_ms: seq,
        kind: EventKind::Admitted,
        detail: json!({"n": seq}),
    }
}

#[tokio::test]
async fn events_stored_by_transition_read_back_one_by_one() {
    let kv = Arc::new(mem::MemKv::new());
    let store = Store::new(kv.clone());
    // Transitions of 1, 3, 1 and 150 events: seqs 1 | 2 3 4 | 5 | 6 ..= 155, the
    // last stored as values of 64, 64 and 22 events.
    let last: u64 = 155;
    for group in [vec![1], vec![2, 3, 4], vec![5], (6..=last).collect()] {
        let mut b = Batch::new();
        b.put_events(&group.into_iter().map(ev).collect::<Vec<_>>());
        store.commit(b).await.expect("commit");
    }
    let (s, e) = (keys::event("s", 0), keys::event_end("s"));
    let stored = kv.scan(&s, &e, false, usize::MAX).expect("scan");
    let keyed: Vec<u64> = stored
        .iter()
        .map(|(k, _)| keys::seq_suffix(k).expect("seq"))
        .collect();
    assert_eq!(keyed, vec![1, 4, 5, 69, 133, 155]);
    let at = SessionKeys {
        id: "s",
        from_ms: None,
    };
    let seqs = |after, limit| -> Vec<u64> {
        store
            .stored_events(at, after, limit)
            .expect("events")
            .iter()
            .map(|e| e.seq)
            .collect()
    };
    assert_eq!(seqs(0, usize::MAX), (1..=last).collect::<Vec<_>>());
    for after in 0..=last {
        for limit in [1, 2, 3, 15, 16, 17, 63, 64, 65, 200, usize::MAX] {
            let want: Vec<u64> = (after + 1..=last).take(limit).collect();
            assert_eq!(seqs(after, limit), want, "after {after}, limit {limit}");
        }
    }
    assert!(seqs(3, 0).is_empty());
    let all = store.stored_events(at, 0, usize::MAX).expect("events");
    assert_eq!(all[2], ev(3), "an event inside a group reads back whole");
}

/// A read that meets only events of turns that are gone before the first visible
/// one remembers where they end; later reads start there, and still see every
/// visible event. A forgotten session's mark goes with it.
#[tokio::test]
async fn reads_remember_where_a_sessions_visible_events_start() {
    let kv = Arc::new(mem::MemKv::new());
    let store = Store::new(kv.clone());
    let kept = turn("s", 1, turnd_proto::TurnStatus::Completed);
    let of = |seq: u64, turn_id: String| Event { turn_id, ..ev(seq) };
    // Events 1 ..= 40 of turns that are gone, 41 ..= 50 of the kept turn, 51 of a
    // gone turn again, 52 of the kept one.
    let mut b = Batch::new();
    b.put_turn(&kept);
    let events: Vec<Event> = (1..=52)
        .map(|seq| match seq {
            41..=50 | 52 => of(seq, kept.turn_id.clone()),
            _ => of(seq, format!("gone-{seq}")),
        })
        .collect();
    b.put_events(&events);
    store.commit(b).await.expect("commit");
    let at = SessionKeys {
        id: "s",
        from_ms: None,
    };
    let seqs = |after, limit| -> Vec<u64> {
        store
            .events(at, after, limit)
            .expect("events")
            .iter()
            .map(|e| e.seq)
            .collect()
    };
    let visible: Vec<u64> = (41..=50).chain([52]).collect();
    assert_eq!(store.marks.start("s").mark, 0);
    assert_eq!(seqs(0, usize::MAX), visible);
    assert_eq!(store.marks.start("s").mark, 40, "the hidden run before 41");
    // From the mark on, with every limit and from before, at and after it.
    for after in [0, 39, 40, 41, 45, 50, 51] {
        for limit in [1, 2, 10, 11, usize::MAX] {
            let want: Vec<u64> = visible
                .iter()
                .copied()
                .filter(|s| *s > after)
                .take(limit)
                .collect();
            assert_eq!(seqs(after, limit), want, "after {after}, limit {limit}");
        }
    }
    assert_eq!(
        store.marks.start("s").mark,
        40,
        "51 is after a visible event"
    );
    // The mark is where reads start: an event at or before it is not read again.
    let mut b = Batch::new();
    b.put_turn(&turn("s", 2, turnd_proto::TurnStatus::Completed));
    b.put_events(&[of(3, "t-s-2".into())]);
    store.commit(b).await.expect("commit");
    assert_eq!(seqs(0, 1), [41]);
    // Forgotten: the session's events may start again from 1.
    store.forgot_session("s");
    assert_eq!(seqs(0, 1), [3]);
}

fn turn(sid: &str, seq: u64, status: turnd_proto::TurnStatus) -> TurnRecord {
    let input = RawJson::from_value(&json!(null));
    let mut t = TurnRecord::admitted(format!("t-{sid}-{seq}"), sid, seq, "f", input, 0);
    t.status = status;
    t
}

/// A turn that finishes while it is being read is found, live or folded, by
/// every lookup: its own keys and its folded record change in one batch, so the
/// lookups must read its own keys first.
#[tokio::test]
async fn a_turn_that_finishes_between_two_reads_is_still_found() {
    for apart in [false, true] {
        let input = if apart {
            RawJson::from_value(&json!({"prompt": "q".repeat(INPUT_APART_BYTES)}))
        } else {
            RawJson::from_value(&json!({"prompt": "short"}))
        };
        let live = TurnRecord::admitted("t-race".into(), "s", 1, "f", input.clone(), 0);
        let mut done = live.clone();
        done.status = turnd_proto::TurnStatus::Completed;
        done.phase = Phase::Done;
        done.finished_at_ms = Some(5);
        let mut finish = Batch::new();
        finish.put_finished(&FoldedTurn::new(&done, Vec::new()), apart);
        for read in 0..3 {
            // The turn's end committed between the two reads of a lookup.
            let kv = Arc::new(mem::CommitsAfterRead::new());
            let store = Store::new(kv.clone());
            let mut b = Batch::new();
            b.put_admission(&live);
            b.put_turn(&live);
            store.commit(b).await.expect("commit");
            kv.arm(finish.clone());
            let found = match read {
                0 => store
                    .turn("t-race")
                    .expect("turn")
                    .map(|t| *t.input == input),
                1 => store.turn_record("t-race").expect("record").map(|_| true),
                _ => store.turn_exists("t-race").expect("exists").then_some(true),
            };
            assert_eq!(found, Some(true), "lookup {read}, input apart: {apart}");
        }
    }
}

/// An input of `INPUT_APART_BYTES` or more is written once under its own key, the
/// record never holds it, and reading the turn puts it back; a smaller one stays in
/// the record. `store.check` reports a turn whose input stored apart is missing.
#[tokio::test]
async fn a_large_input_is_stored_once_apart_from_its_record() {
    let kv = Arc::new(mem::MemKv::new());
    let store = Store::new(kv.clone());
    let big = RawJson::from_value(&json!({"prompt": "q".repeat(INPUT_APART_BYTES)}));
    let small = RawJson::from_value(&json!({"prompt": "short"}));
    let mut b = Batch::new();
    let mut t1 = TurnRecord::admitted("t-big".into(), "s", 1, "f", big.clone(), 0);
    let t2 = TurnRecord::admitted("t-small".into(), "s", 2, "f", small.clone(), 0);
    for t in [&t1, &t2] {
        b.put_admission(t);
        b.put_turn(t);
    }
    store.commit(b).await.expect("commit");
    // A later transition rewrites the record only.
    t1.status = turnd_proto::TurnStatus::Completed;
    t1.phase = Phase::Done;
    t1.output = Some(small.clone());
    let mut b = Batch::new();
    b.put_turn(&t1);
    store.commit(b).await.expect("commit");

    let record = kv.get(&keys::turn("t-big")).expect("get").expect("record");
    assert!(record.len() < 1024, "{}", String::from_utf8_lossy(&record));
    let apart = kv.get(&keys::turn_input("t-big")).expect("get");
    assert_eq!(apart.as_deref(), Some(big.as_str().as_bytes()));
    assert_eq!(kv.get(&keys::turn_input("t-small")).expect("get"), None);
    let read = store.turn("t-big").expect("read").expect("turn");
    assert_eq!(*read.input, big);
    assert_eq!(read.state(), &big);
    assert_eq!(read.output, Some(small.clone()));
    // A record read back (as recovery does) and written again still leaves it out.
    let mut b = Batch::new();
    b.put_turn(&read);
    store.commit(b).await.expect("commit");
    let record = kv.get(&keys::turn("t-big")).expect("get").expect("record");
    assert!(record.len() < 1024, "{}", String::from_utf8_lossy(&record));
    // The bound: JSON text of INPUT_APART_BYTES goes apart, one byte less stays.
    let text = |n: usize| RawJson::from_value(&json!("x".repeat(n - 2)));
    assert!(TurnInput::new(text(INPUT_APART_BYTES)).is_apart());
    assert!(!TurnInput::new(text(INPUT_APART_BYTES - 1)).is_apart());
    assert_eq!(
        *store.turn("t-small").expect("read").expect("turn").input,
        small
    );

    let mut b = Batch::new();
    b.delete(keys::turn_input("t-big"));
    store.commit(b).await.expect("commit");
    assert!(matches!(store.turn("t-big"), Err(StoreError::Corrupt(_))));
    let found = check_store(&store).expect("check");
    assert!(
        found
            .iter()
            .any(|v| v.invariant == "turn_input_missing" && v.turn_id.as_deref() == Some("t-big")),
        "{found:?}"
    );
}

fn invocation(inv_id: &str, turn_id: &str, state: InvState) -> InvocationRecord {
    InvocationRecord {
        invocation_id: inv_id.into(),
        turn_id: turn_id.into(),
        session_id: "s".into(),
        function_id: "f".into(),
        step: 0,
        attempt: 1,
        worker_id: "w".into(),
        instance_id: "i".into(),
        settings: FunctionSettings {
            timeout_ms: 1000,
            delivery: turnd_proto::Delivery::AtLeastOnce,
            max_attempts: 1,
        },
        state,
        wait: InvWait::AwaitingResult,
        wait_since_ms: 0,
        deadline_ms: 0,
        attempt_deadline_ms: 0,
        dispatched_at_ms: 0,
        ended_at_ms: None,
        outcome: None,
        late: false,
    }
}

/// A finished turn is one folded record: the turn (its input inline, even one
/// stored apart while it ran) and its ended invocations, which are found by their
/// id alone; its separate keys are gone. A finished turn whose keys were written
/// unfolded (record, input apart, invocation under their own keys) reads the same.
#[tokio::test]
async fn a_finished_turn_reads_the_same_folded_or_under_its_own_keys() {
    let kv = Arc::new(mem::MemKv::new());
    let store = Store::new(kv.clone());
    let big = RawJson::from_value(&json!({"prompt": "q".repeat(INPUT_APART_BYTES)}));
    let ids = [turnd_proto::new_turn_id(), turnd_proto::new_turn_id()];
    let mut meta = SessionMeta::new("s");
    let mut expected = Vec::new();
    for (n, id) in ids.iter().enumerate() {
        let inv_id = turnd_proto::new_invocation_id_of(id);
        let mut t = TurnRecord::admitted(id.clone(), "s", n as u64 + 1, "f", big.clone(), 0);
        t.invocation_id = Some(inv_id.clone());
        let mut b = Batch::new();
        b.put_admission(&t);
        b.put_turn(&t);
        b.put_invocation(&invocation(&inv_id, id, InvState::Active));
        // The session's meta, as every transition writes it: with where its
        // routed keys are, and counting the turns once they are completed.
        meta.last_turn_seq = n as u64 + 1;
        meta.counts.completed = n as u64 + 1;
        meta.routed_at(b.routed_from());
        b.put_session_meta(&meta);
        store.commit(b).await.expect("commit");
        t.status = turnd_proto::TurnStatus::Completed;
        t.phase = Phase::Done;
        t.finished_at_ms = Some(5);
        let inv = invocation(&inv_id, id, InvState::Finished);
        let mut b = Batch::new();
        if n == 0 {
            b.put_finished(&FoldedTurn::new(&t, vec![inv.clone()]), true);
        } else {
            // Unfolded: a terminal turn under its own keys.
            b.put_turn(&t);
            b.put_invocation(&inv);
        }
        store.commit(b).await.expect("commit");
        expected.push((t, inv));
    }
    let (folded, _) = &expected[0];
    for k in [
        keys::turn(&folded.turn_id),
        keys::turn_input(&folded.turn_id),
        keys::invocation(folded.invocation_id.as_deref().expect("inv")),
    ] {
        assert_eq!(kv.get(&k).expect("get"), None, "{k:?} is deleted");
    }
    for (t, inv) in &expected {
        let read = store.turn(&t.turn_id).expect("read").expect("turn");
        assert_eq!(*read.input, big);
        assert_eq!(read.status, turnd_proto::TurnStatus::Completed);
        assert_eq!(
            store
                .turn_record(&t.turn_id)
                .expect("read")
                .map(|r| r.status),
            Some(turnd_proto::TurnStatus::Completed)
        );
        assert!(store.turn_exists(&t.turn_id).expect("read"));
        let got = store.invocation(&inv.invocation_id).expect("read");
        assert_eq!(got.as_ref(), Some(inv));
    }
    assert!(store.finished(&ids[0]).expect("read").is_some());
    assert!(store.finished(&ids[1]).expect("read").is_none());
    let unknown = turnd_proto::new_invocation_id_of(&ids[0]);
    assert_eq!(store.invocation(&unknown).expect("read"), None);
    assert!(check_store(&store).expect("check").is_empty());

    // A record under its own key beside the folded one is reported.
    let mut b = Batch::new();
    b.put_turn(folded);
    store.commit(b).await.expect("commit");
    let found = check_store(&store).expect("check");
    assert!(
        found.iter().any(|v| v.invariant == "turn_stored_twice"),
        "{found:?}"
    );
}

#[tokio::test]
async fn unfinished_turns_start_at_the_metas_mark_and_skip_ended_ones() {
    use turnd_proto::TurnStatus::*;
    let store = Store::new(Arc::new(mem::MemKv::new()));
    let mut b = Batch::new();
    let statuses = [Completed, Running, Cancelled, Queued, Failed];
    for (i, status) in statuses.into_iter().enumerate() {
        let t = turn("s", i as u64 + 1, status);
        b.put_admission(&t);
        b.put_turn(&t);
    }
    store.commit(b).await.expect("commit");
    let mut meta = SessionMeta::new("s");
    meta.last_turn_seq = 5;
    assert!(store.unfinished_turns(&meta).expect("read").is_empty());
    meta.active_from = Some(2);
    let seqs: Vec<u64> = store
        .unfinished_turns(&meta)
        .expect("read")
        .iter()
        .map(|t| t.seq)
        .collect();
    assert_eq!(seqs, vec![2, 4]);
    // One unfinished turn and nothing after it: read by a point lookup.
    meta.active_from = Some(4);
    meta.last_turn_seq = 4;
    let one = store.unfinished_turns(&meta).expect("read");
    assert_eq!(one.iter().map(|t| t.seq).collect::<Vec<_>>(), vec![4]);
    meta.active_from = Some(5);
    meta.last_turn_seq = 5;
    assert!(store.unfinished_turns(&meta).expect("read").is_empty());
}
