use serde_json::{json, Value};
use tokio::sync::mpsc::Receiver;
use turnd_proto::{Event, EventKind};
use turnd_store::RawJson;

use super::{PageEnd, Replay, Watches};
use crate::error::EngineError;
use crate::registry::Outbox;

fn event(seq: u64, turn_id: &str) -> Event<RawJson> {
    Event {
        seq,
        session_id: "s".into(),
        turn_id: turn_id.into(),
        at_ms: 0,
        kind: EventKind::Admitted,
        detail: RawJson::from_value(&json!({})),
    }
}

/// The `seq`s of the events pushed to a connection so far.
fn pushed(rx: &mut Receiver<String>) -> Vec<u64> {
    let mut seqs = Vec::new();
    while let Ok(frame) = rx.try_recv() {
        let v: Value = serde_json::from_str(&frame).expect("JSON");
        seqs.extend(v["event"]["seq"].as_u64());
    }
    seqs
}

#[test]
fn a_live_watch_gets_each_new_event_once() {
    let w = Watches::default();
    let (outbox, mut rx) = Outbox::new("c1".into(), 16);
    let id = w
        .add("s", &outbox, (None, false), (0, 0), 8)
        .expect("added");
    assert_eq!(w.after_page("s", &id, 0, PageEnd::Empty), Replay::Live);
    w.publish("s", &[event(1, "t_a"), event(2, "t_a")]);
    w.publish("s", &[event(2, "t_a"), event(3, "t_a")]);
    w.publish("other", &[event(9, "t_b")]);
    assert_eq!(pushed(&mut rx), [1, 2, 3]);
}

#[test]
fn a_replaying_watch_notes_what_is_published_and_goes_live_once_it_read_it() {
    let w = Watches::default();
    let (outbox, mut rx) = Outbox::new("c1".into(), 16);
    let id = w
        .add("s", &outbox, (None, false), (5, 5), 8)
        .expect("added");
    w.publish("s", &[event(6, "t_a"), event(7, "t_a")]);
    assert!(pushed(&mut rx).is_empty(), "the replay reads them");
    assert_eq!(w.after_page("s", &id, 5, PageEnd::Full), Replay::More);
    assert_eq!(w.after_page("s", &id, 5, PageEnd::Short), Replay::More);
    assert_eq!(w.after_page("s", &id, 7, PageEnd::Short), Replay::Live);
    w.publish("s", &[event(7, "t_a"), event(8, "t_a")]);
    assert_eq!(pushed(&mut rx), [8]);
    w.remove("s", &id);
    assert_eq!(w.after_page("s", &id, 8, PageEnd::Short), Replay::Gone);
}

#[test]
fn a_watch_of_a_turn_gets_only_that_turns_events() {
    let w = Watches::default();
    let (outbox, mut rx) = Outbox::new("c1".into(), 16);
    let id = w.add("s", &outbox, (Some("t_a".into()), false), (0, 0), 8);
    let id = id.expect("added");
    w.after_page("s", &id, 0, PageEnd::Empty);
    w.publish("s", &[event(1, "t_a"), event(2, "t_b"), event(3, "t_a")]);
    assert_eq!(pushed(&mut rx), [1, 3]);
}

#[test]
fn watches_are_bounded_per_connection_and_dropped_only_by_their_own() {
    let w = Watches::default();
    let (one, _rx1) = Outbox::new("c1".into(), 4);
    let (two, _rx2) = Outbox::new("c2".into(), 4);
    let a = w.add("s", &one, (None, false), (0, 0), 1).expect("added");
    let refused = w.add("t", &one, (None, false), (0, 0), 1);
    assert!(matches!(
        refused,
        Err(EngineError::TooManyWatches { max: 1 })
    ));
    w.add("s", &two, (None, false), (0, 0), 1)
        .expect("another connection's");
    assert_eq!(w.count(), 2);
    assert!(!w.unwatch("c2", &a), "not its watch");
    assert!(w.unwatch("c1", &a));
    assert!(w.watched("s"));
    w.connection_closed("c2");
    assert!(!w.watched("s"));
    assert_eq!(w.count(), 0);
}
