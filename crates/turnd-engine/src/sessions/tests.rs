use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use serde_json::json;
use turnd_store::mem::MemKv;
use turnd_store::{Batch, RawJson, SessionMeta, Store, TurnRecord};

use super::{shrink_after_burst, Sessions};

fn sessions() -> (Store, Arc<Sessions>) {
    let store = Store::new(Arc::new(MemKv::new()));
    (store.clone(), Arc::new(Sessions::new(store)))
}

#[tokio::test]
async fn an_idle_session_leaves_memory_with_its_last_user() {
    let (_, s) = sessions();
    s.set_stored(HashSet::new());
    let a = s.cell("a");
    let again = s.cell("a");
    assert!(Arc::ptr_eq(&a, &again), "one cell per session");
    s.lock(&a).await.expect("lock").meta.last_turn_seq = 1;
    drop(a);
    assert_eq!(s.ids(), ["a"], "still in use");
    drop(again);
    assert_eq!(s.len(), 0);
    // It had a meta: its next use reads it back.
    assert!(s.was_evicted("a"));
    assert!(!s.was_evicted("never-used"));
}

#[tokio::test]
async fn a_session_with_an_unfinished_turn_stays_in_memory() {
    let (_, s) = sessions();
    let b = s.cell("b");
    let input = RawJson::from_value(&json!(1));
    let t = TurnRecord::admitted("t_1".into(), "b", 1, "f", input, 0);
    s.lock(&b).await.expect("lock").active.insert(t);
    drop(b);
    assert_eq!(s.ids(), ["b"]);
    let b = s.existing("b").expect("kept");
    // Forgetting it while someone else holds it leaves it too.
    let other = s.cell("b");
    s.forget("b", &b);
    assert_eq!(s.len(), 1);
    drop(other);
    s.forget("b", &b);
    assert_eq!(s.len(), 0);
}

#[tokio::test]
async fn a_session_is_read_from_the_store_only_when_it_may_be_there() {
    let (store, s) = sessions();
    for id in ["stored", "unlisted"] {
        let mut meta = SessionMeta::new(id);
        meta.last_turn_seq = 7;
        let mut b = Batch::new();
        b.put_session_meta(&meta);
        store.commit(b).await.expect("commit");
    }
    s.set_stored(HashSet::from([super::session_hash("stored")]));
    let c = s.cell("stored");
    assert_eq!(s.lock(&c).await.expect("lock").meta.last_turn_seq, 7);
    // Not among the metas recovery read, and not evicted since: no read.
    let c = s.cell("unlisted");
    assert_eq!(s.lock(&c).await.expect("lock").meta.last_turn_seq, 0);
}

#[test]
fn a_map_gives_back_its_burst_capacity() {
    let mut m: HashMap<u64, u64> = (0..100_000).map(|i| (i, i)).collect();
    let burst = m.capacity();
    let mut shrinks = 0;
    for i in 0..99_990 {
        m.remove(&i);
        let before = m.capacity();
        shrink_after_burst(&mut m);
        // (`capacity` also drops by one for a removal that leaves a tombstone.)
        if m.capacity() < before * 3 / 4 {
            shrinks += 1;
        }
        // Never more than four slots per entry once past the small size.
        assert!(
            m.capacity() <= 4 * m.len() + 2 * 1024 + 1,
            "{} for {}",
            m.capacity(),
            m.len()
        );
    }
    assert!(
        m.capacity() < burst / 50,
        "{} of {burst} kept",
        m.capacity()
    );
    // Shrinking is rare: a handful of rehashes for 100,000 removals.
    assert!((1..=8).contains(&shrinks), "{shrinks} shrinks");
    // Nothing is shrunk below 1,024 slots.
    assert!(m.capacity() >= 1024 - 16, "{}", m.capacity());
}
