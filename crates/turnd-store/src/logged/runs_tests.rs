//! Runs of a session's event values written to sled as one value: which values make
//! a run, and that reads never meet an event twice or miss one, whatever is committed
//! while a run is written.

use std::collections::HashSet;
use std::sync::Arc;

use serde_json::json;
use turnd_proto::{Event, EventKind};

use super::apply::applied_mark;
use super::overlay::OKey;
use super::runs::{drop_applied, event_runs, forget_fresh, Taken, MERGE_BYTES};
use super::{LoggedKv, LoggedOptions};
use crate::{keys, Batch, Kv, SessionKeys, Store};

fn turn_at(ms: u64, n: u8) -> String {
    format!("t_{ms:012x}7000800000000000{n:04x}")
}

fn event(session: &str, seq: u64, turn_id: &str) -> Event {
    Event {
        seq,
        session_id: session.into(),
        turn_id: turn_id.into(),
        at_ms: seq,
        kind: EventKind::Admitted,
        detail: json!({}),
    }
}

/// A transition's events, as the engine writes them.
fn events(session: &str, seqs: std::ops::RangeInclusive<u64>, turn_id: &str) -> Batch {
    let mut b = Batch::new();
    let evs: Vec<Event> = seqs.map(|s| event(session, s, turn_id)).collect();
    b.put_events(&evs);
    b
}

fn keys_s(session: &str) -> SessionKeys<'_> {
    SessionKeys {
        id: session,
        from_ms: Some(0),
    }
}

fn seqs(store: &Store, session: &str) -> Vec<u64> {
    store
        .stored_events(keys_s(session), 0, usize::MAX)
        .expect("events")
        .into_iter()
        .map(|e| e.seq)
        .collect()
}

/// The event keys of `session` in the main database's sled, as `seq`s.
fn sled_event_keys(kv: &LoggedKv, session: &str) -> Vec<u64> {
    let start = keys::event(session, 0);
    let end = keys::event_end(session);
    kv.inner
        .sled
        .with(|h| {
            Ok(h.db
                .range(start..end)
                .keys()
                .map(|k| keys::seq_suffix(&k.expect("key")).expect("seq"))
                .collect())
        })
        .expect("sled")
}

/// Options whose applier runs only when asked (`sync`).
fn manual() -> LoggedOptions {
    LoggedOptions {
        segment_bytes: 4096,
        apply_interval: std::time::Duration::from_secs(3600),
        apply_delay: std::time::Duration::ZERO,
        // Every round writes its mark: what these tests' crashes start from.
        mark_interval: std::time::Duration::ZERO,
        ..LoggedOptions::default()
    }
}

/// A store in `dir` ([`manual`]), and the typed store over it.
fn open(dir: &std::path::Path) -> (Arc<LoggedKv>, Store) {
    let (kv, _) = LoggedKv::open(dir, manual()).expect("open");
    let kv = Arc::new(kv);
    let store = Store::new(kv.clone());
    (kv, store)
}

/// Close the store in `dir` and open it again.
fn reopen(dir: &std::path::Path, kv: Arc<LoggedKv>, store: Store) -> Store {
    drop(store);
    kv.close().expect("close");
    drop(kv);
    let (kv, _) =
        crate::sled::open_when_unlocked(|| LoggedKv::open(dir, manual())).expect("reopen");
    Store::new(Arc::new(kv))
}

fn taken(key: Vec<u8>, value: Option<&str>, fresh: bool) -> Taken {
    taken_at(key, value, fresh, 1)
}

fn taken_at(key: Vec<u8>, value: Option<&str>, fresh: bool, lsn: u64) -> Taken {
    Taken {
        key: OKey::from_vec(key),
        lsn,
        value: value.map(|v| Arc::from(v.as_bytes())),
        fresh,
        pristine: true,
        gap_before: false,
    }
}

/// No session held.
fn none_held() -> HashSet<String> {
    HashSet::new()
}

fn routed(session: &str, seq: u64, ms: u64) -> Vec<u8> {
    keys::event_routed(session, seq, Some(ms))
}

/// Consecutive fresh puts of one session's routed event values make a run, ending
/// at a value that need not be fresh and is routed by the newest turn of the run; a
/// run stops at another session, a delete, an unrouted value, a value that is not
/// fresh, `seq`s that span [`crate::EVENTS_PER_VALUE`], [`MERGE_BYTES`], values
/// committed at or before the mark sled holds or after the one the round records, a
/// value written again since its key was created, an entry the round passed over,
/// and a session held by retention. Its value is the arrays and single events joined
/// into one array.
#[test]
fn which_event_values_make_a_run() {
    let one = r#"{"seq":1}"#;
    let slice = vec![
        taken(routed("a", 1, 10), Some(one), true),
        taken(routed("a", 3, 10), Some(r#"[{"seq":2},{"seq":3}]"#), true),
        taken(routed("a", 4, 11), Some(r#"{"seq":4}"#), false),
        // Not fresh before it: a run of its own is one value, no run.
        taken(routed("a", 5, 11), Some(r#"{"seq":5}"#), true),
        // The route goes down.
        taken(routed("a", 6, 9), Some(r#"{"seq":6}"#), true),
        taken(routed("a", 7, 9), Some(r#"{"seq":7}"#), true),
        // Another session.
        taken(routed("b", 1, 9), Some(one), true),
        // A delete.
        taken(routed("b", 2, 9), None, true),
        taken(routed("b", 3, 9), Some(r#"{"seq":3}"#), true),
        // Unrouted.
        taken(keys::event("b", 4), Some(r#"{"seq":4}"#), true),
        taken(routed("b", 5, 9), Some(r#"{"seq":5}"#), true),
        taken(
            routed("b", 5 + crate::EVENTS_PER_VALUE as u64, 9),
            Some(one),
            true,
        ),
        taken(keys::session_turn("b", 70), Some("t"), true),
    ];
    let runs = event_runs(&slice, 0, 1, &none_held());
    let found: Vec<(usize, usize, String)> = runs
        .iter()
        .map(|r| {
            (
                r.first,
                r.last,
                String::from_utf8(r.value.clone()).expect("utf8"),
            )
        })
        .collect();
    assert_eq!(
        found,
        vec![
            (
                0,
                2,
                r#"[{"seq":1},{"seq":2},{"seq":3},{"seq":4}]"#.to_string()
            ),
            (4, 5, r#"[{"seq":6},{"seq":7}]"#.to_string()),
        ]
    );

    let big = format!(r#"{{"seq":1,"pad":"{}"}}"#, "x".repeat(MERGE_BYTES / 2));
    let slice = vec![
        taken(routed("a", 1, 10), Some(&big), true),
        taken(routed("a", 2, 10), Some(&big), true),
        taken(routed("a", 3, 10), Some(one), true),
    ];
    let runs = event_runs(&slice, 0, 1, &none_held());
    assert_eq!(runs.len(), 1);
    assert_eq!((runs[0].first, runs[0].last), (1, 2), "the bytes bound it");

    // Routes that go down within a run, as when queued turns are admitted while
    // earlier ones end: the run ends at the last value of the newest route.
    let slice = vec![
        taken(routed("a", 1, 10), Some(one), true),
        taken(routed("a", 2, 12), Some(one), true),
        taken(routed("a", 5, 11), Some(one), true),
        taken(routed("a", 6, 12), Some(one), true),
        taken(routed("a", 7, 11), Some(one), true),
        taken(routed("a", 8, 10), Some(one), true),
        taken(routed("a", 9, 11), Some(one), true),
        taken(routed("a", 10, 10), Some(one), true),
    ];
    let bounds: Vec<(usize, usize)> = event_runs(&slice, 0, 1, &none_held())
        .iter()
        .map(|r| (r.first, r.last))
        .collect();
    assert_eq!(bounds, vec![(0, 3), (4, 6)]);

    // Only values committed after the mark sled holds and at or before the one the
    // round records.
    let slice = vec![
        taken_at(routed("a", 1, 10), Some(one), true, 5),
        taken_at(routed("a", 2, 10), Some(one), true, 6),
        taken_at(routed("a", 3, 10), Some(one), true, 7),
        taken_at(routed("a", 4, 10), Some(one), true, 8),
    ];
    let bounds: Vec<(usize, usize)> = event_runs(&slice, 5, 7, &none_held())
        .iter()
        .map(|r| (r.first, r.last))
        .collect();
    assert_eq!(bounds, vec![(1, 2)]);

    // Written again since created (not pristine), and an entry passed over between
    // two values: neither is crossed.
    let mut slice = vec![
        taken(routed("a", 1, 10), Some(one), true),
        taken(routed("a", 2, 10), Some(one), true),
        taken(routed("a", 3, 10), Some(one), true),
        taken(routed("a", 4, 10), Some(one), true),
        taken(routed("a", 5, 10), Some(one), true),
        taken(routed("a", 6, 10), Some(one), true),
    ];
    slice[2].pristine = false;
    slice[5].gap_before = true;
    let bounds: Vec<(usize, usize)> = event_runs(&slice, 0, 1, &none_held())
        .iter()
        .map(|r| (r.first, r.last))
        .collect();
    assert_eq!(bounds, vec![(0, 1), (3, 4)]);
    // A session held by retention: none of its values.
    let held: HashSet<String> = ["a".to_string()].into();
    assert!(event_runs(&slice, 0, 1, &held).is_empty());
}

/// A run leaves the overlay whole, unless one of its values was committed again or
/// its session is held now: then all of it stays, its last value no longer fresh,
/// and the lowest lsn among them is returned (the round's mark stays before it). A
/// failed write leaves nothing fresh or pristine.
#[test]
fn a_run_leaves_the_overlay_whole_or_not_at_all() {
    use super::overlay::{OKey, Pending};
    use std::collections::BTreeMap;
    let one = r#"{"seq":1}"#;
    let slice = vec![
        taken_at(routed("a", 1, 10), Some(one), true, 4),
        taken_at(routed("a", 2, 10), Some(one), true, 5),
        taken_at(keys::session_turn("a", 3), Some("t"), true, 6),
    ];
    let overlay = |changed: Option<usize>| -> BTreeMap<OKey, Pending> {
        slice
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let p = Pending {
                    lsn: if changed == Some(i) { 99 } else { t.lsn },
                    value: t.value.clone(),
                    fresh: true,
                    pristine: true,
                    carried: 0,
                };
                (t.key.clone(), p)
            })
            .collect()
    };
    let runs = event_runs(&slice, 0, 10, &none_held());
    assert_eq!(runs.len(), 1);
    let mut map = overlay(None);
    assert_eq!(drop_applied(&mut map, &slice, &runs, &none_held()).0, None);
    assert!(map.is_empty());
    // The first value committed again: the run stays, the other entry goes.
    let mut map = overlay(Some(0));
    assert_eq!(
        drop_applied(&mut map, &slice, &runs, &none_held()).0,
        Some(4)
    );
    assert_eq!(map.len(), 2);
    assert!(
        map[slice[0].key.as_slice()].fresh,
        "its own key was never written"
    );
    assert!(
        !map[slice[1].key.as_slice()].fresh,
        "sled has the run under it"
    );
    // The session held since the run was formed.
    let held: HashSet<String> = ["a".to_string()].into();
    let mut map = overlay(None);
    assert_eq!(drop_applied(&mut map, &slice, &runs, &held).0, Some(4));
    assert_eq!(map.len(), 2);
    // A failed write.
    let mut map = overlay(None);
    forget_fresh(&mut map, &slice);
    assert!(map.values().all(|p| !p.fresh && !p.pristine));
}

/// A session's event values committed between two rounds reach sled as one value
/// under the last one's key; the events read back the same, in order, before and
/// after, and after a reopen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_event_values_of_one_round_reach_sled_as_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, store) = open(dir.path());
    let (t1, t2) = (turn_at(1000, 1), turn_at(1001, 2));
    store.commit(events("s", 1..=1, &t1)).await.expect("commit");
    store
        .commit(events("other", 1..=2, &t1))
        .await
        .expect("commit");
    store.commit(events("s", 2..=4, &t1)).await.expect("commit");
    store.commit(events("s", 5..=5, &t2)).await.expect("commit");
    assert_eq!(seqs(&store, "s"), vec![1, 2, 3, 4, 5]);
    kv.sync().expect("sync");
    assert_eq!(kv.overlay_len(), 0);
    assert_eq!(sled_event_keys(&kv, "s"), vec![5]);
    assert_eq!(sled_event_keys(&kv, "other"), vec![2]);
    assert_eq!(kv.commit_stats().merged_event_values, 2);
    assert_eq!(seqs(&store, "s"), vec![1, 2, 3, 4, 5]);
    // A read from the middle of the value drops its earlier events.
    let after: Vec<u64> = store
        .stored_events(keys_s("s"), 2, 2)
        .expect("events")
        .into_iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(after, vec![3, 4]);
    let store = reopen(dir.path(), kv, store);
    assert_eq!(seqs(&store, "s"), vec![1, 2, 3, 4, 5]);
    assert_eq!(seqs(&store, "other"), vec![1, 2]);
}

/// A value of a run committed again while the round writes the run (retention
/// writing it again without a deleted turn's events) keeps the whole run in the
/// overlay: sled's merged value still holds the old events, and a read must not see
/// them. The next round writes what the overlay holds then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_committed_again_while_it_is_written_stays_in_the_overlay() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, store) = open(dir.path());
    let (t1, t2, t3) = (turn_at(1000, 1), turn_at(1001, 2), turn_at(1002, 3));
    store.commit(events("s", 1..=1, &t1)).await.expect("commit");
    store.commit(events("s", 2..=2, &t2)).await.expect("commit");
    store.commit(events("s", 3..=3, &t3)).await.expect("commit");
    // The second value's turn deleted: its value goes (it held no other event).
    let mut gone = Batch::new();
    gone.delete(keys::event_routed("s", 2, keys::route_of(&t2)));
    let committed = super::tests::commit_during_next_slice(&kv, gone);
    kv.sync().expect("sync");
    assert_eq!(
        *committed.lock().expect("lock"),
        Some(true),
        "the delete was committed while the applier wrote the run"
    );
    assert_eq!(
        sled_event_keys(&kv, "s"),
        vec![3],
        "sled has the run's value"
    );
    assert_eq!(seqs(&store, "s"), vec![1, 3]);
    kv.sync().expect("sync");
    assert_eq!(kv.overlay_len(), 0);
    assert_eq!(seqs(&store, "s"), vec![1, 3]);
    let store = reopen(dir.path(), kv, store);
    assert_eq!(seqs(&store, "s"), vec![1, 3]);
}

/// A start after a crash replays every record after the mark sled holds. Event
/// values committed on both sides of a mark must not be written as one: the replay
/// would write the later one's own value over them, and the earlier one's events
/// would be gone. Here a round records a mark between two event values (the first
/// one's group is settled, the second one's not yet), and a crash follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_a_mark_between_two_event_values_loses_no_event() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, store) = open(dir.path());
    let t = turn_at(1000, 1);
    store.commit(events("s", 1..=1, &t)).await.expect("commit");
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    store.commit(events("s", 2..=2, &t)).await.expect("commit");
    // The first value's group is settled, the second one's not: the round records
    // lsn 1.
    kv.round_with(std::time::Duration::from_millis(100));
    let sled = &kv.inner.sled;
    assert_eq!(applied_mark(sled).expect("mark"), 1);
    // sled's files as a crash now would leave them, mark included.
    sled.with(|h| sled.sync_files(h)).expect("sync sled");
    let copy = tempfile::tempdir().expect("tempdir");
    super::tests::copy_dir(dir.path(), copy.path());
    let (crashed, replayed) = LoggedKv::open(copy.path(), manual()).expect("open copy");
    assert_eq!(replayed.records, 1);
    let crashed = Store::new(Arc::new(crashed));
    assert_eq!(seqs(&crashed, "s"), vec![1, 2]);
    assert_eq!(seqs(&store, "s"), vec![1, 2]);
}

/// A round that carries a live record (`overlay::carries`) committed between two
/// event values of a session records its mark before that record: its runs must end
/// at that mark too, or a crash would replay the later value's own events over a run
/// that held the earlier one's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_carry_between_two_event_values_keeps_them_apart_and_a_crash_loses_no_event() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, store) = open(dir.path());
    let t = turn_at(1000, 1);
    store.commit(events("s", 1..=1, &t)).await.expect("commit");
    let mut queued = Batch::new();
    queued.put_raw(keys::turn(&t), b"queued".to_vec());
    queued.created_last();
    kv.commit(queued)
        .await
        .expect("answered")
        .expect("committed");
    store.commit(events("s", 2..=2, &t)).await.expect("commit");
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    // Everything is settled; the turn's record is carried, so the round records lsn
    // 1, and writes the first event value alone.
    kv.round_with(std::time::Duration::from_millis(100));
    let sled = &kv.inner.sled;
    assert_eq!(applied_mark(sled).expect("mark"), 1);
    assert_eq!(sled_event_keys(&kv, "s"), vec![1]);
    sled.with(|h| sled.sync_files(h)).expect("sync sled");
    let copy = tempfile::tempdir().expect("tempdir");
    super::tests::copy_dir(dir.path(), copy.path());
    let (crashed, _) = LoggedKv::open(copy.path(), manual()).expect("open copy");
    let crashed = Store::new(Arc::new(crashed));
    assert_eq!(seqs(&crashed, "s"), vec![1, 2]);
    assert_eq!(seqs(&store, "s"), vec![1, 2]);
}

/// A crash after a round that kept a run in the overlay (one of its values was
/// committed again while the run was written): the round's mark stays before the
/// run, so the replay writes every value of it again under its own key, with the
/// write that came after. Once with the run's last value deleted, once its first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_a_run_that_stayed_in_the_overlay_loses_and_revives_nothing() {
    for (gone_seq, want) in [(3u64, vec![1u64, 2]), (1, vec![2, 3])] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (kv, store) = open(dir.path());
        let turns = [turn_at(1000, 1), turn_at(1001, 2), turn_at(1002, 3)];
        for (i, t) in turns.iter().enumerate() {
            let seq = i as u64 + 1;
            store
                .commit(events("s", seq..=seq, t))
                .await
                .expect("commit");
        }
        let mut gone = Batch::new();
        let turn = &turns[gone_seq as usize - 1];
        gone.delete(keys::event_routed("s", gone_seq, keys::route_of(turn)));
        let committed = super::tests::commit_during_next_slice(&kv, gone);
        kv.sync().expect("sync");
        assert_eq!(*committed.lock().expect("lock"), Some(true));
        assert_eq!(seqs(&store, "s"), want);
        let sled = &kv.inner.sled;
        assert!(
            applied_mark(sled).expect("mark") < 1,
            "the mark stays before the run"
        );
        sled.with(|h| sled.sync_files(h)).expect("sync sled");
        let copy = tempfile::tempdir().expect("tempdir");
        super::tests::copy_dir(dir.path(), copy.path());
        let (crashed, _) = LoggedKv::open(copy.path(), manual()).expect("open copy");
        let crashed = Store::new(Arc::new(crashed));
        assert_eq!(
            seqs(&crashed, "s"),
            want,
            "after a crash, {gone_seq} deleted"
        );
        kv.sync().expect("sync");
        assert_eq!(seqs(&store, "s"), want);
    }
}

/// A read of a session's events in several pages, with a round between two pages
/// that writes values read in the first as one with later ones: each event is
/// returned once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_read_in_pages_across_a_round_are_each_read_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, store) = open(dir.path());
    let t = turn_at(1000, 1);
    for seq in 1..=40u64 {
        store
            .commit(events("s", seq..=seq, &t))
            .await
            .expect("commit");
    }
    // The first page takes its sources (the overlay's values one by one), then the
    // round writes them to sled as one value under a later key.
    let applier = kv.clone();
    kv.after_sources(move || applier.sync().expect("apply"));
    assert_eq!(seqs(&store, "s"), (1..=40).collect::<Vec<u64>>());
    assert!(kv.commit_stats().merged_event_values > 0);
}

/// While retention holds a session, its event values are written each under its own
/// key; once it lets go, a later round writes them as one again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_sessions_event_values_are_not_written_as_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, store) = open(dir.path());
    let t = turn_at(1000, 1);
    kv.hold_event_merges("s");
    kv.hold_event_merges("s");
    for seq in 1..=3u64 {
        store
            .commit(events("s", seq..=seq, &t))
            .await
            .expect("commit");
    }
    kv.sync().expect("sync");
    assert_eq!(sled_event_keys(&kv, "s"), vec![1, 2, 3]);
    kv.release_event_merges("s");
    for seq in 4..=6u64 {
        store
            .commit(events("s", seq..=seq, &t))
            .await
            .expect("commit");
    }
    kv.sync().expect("sync");
    assert_eq!(
        sled_event_keys(&kv, "s"),
        vec![1, 2, 3, 4, 5, 6],
        "still held once"
    );
    kv.release_event_merges("s");
    for seq in 7..=9u64 {
        store
            .commit(events("s", seq..=seq, &t))
            .await
            .expect("commit");
    }
    kv.sync().expect("sync");
    assert_eq!(sled_event_keys(&kv, "s"), vec![1, 2, 3, 4, 5, 6, 9]);
    assert_eq!(seqs(&store, "s"), (1..=9).collect::<Vec<u64>>());
}

/// A put that says it creates its key, of a key the overlay holds a write of
/// already, is neither fresh nor pristine: sled may hold the key (its delete waits in
/// the overlay), so a later delete of it is written, and it is in no run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_creating_put_over_a_pending_write_is_not_fresh() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, store) = open(dir.path());
    let t = turn_at(1000, 1);
    store.commit(events("s", 1..=1, &t)).await.expect("commit");
    kv.sync().expect("sync");
    assert_eq!(sled_event_keys(&kv, "s"), vec![1]);
    let key = keys::event_routed("s", 1, keys::route_of(&t));
    let mut b = Batch::new();
    b.delete(key.clone());
    store.commit(b).await.expect("commit");
    store.commit(events("s", 1..=1, &t)).await.expect("commit");
    {
        let o = kv.inner.overlay.read().expect("overlay");
        let p = &o.map[key.as_slice()];
        assert!(!p.fresh && !p.pristine);
    }
    let mut b = Batch::new();
    b.delete(key);
    store.commit(b).await.expect("commit");
    kv.sync().expect("sync");
    assert_eq!(
        sled_event_keys(&kv, "s"),
        Vec::<u64>::new(),
        "the delete was written"
    );
}
