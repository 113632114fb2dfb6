//! Runs of a session's event values written to sled as one value: which values make
//! a run, and that reads never meet an event twice or miss one, whatever is committed
//! while a run is written.

use std::sync::Arc;

use serde_json::json;
use turnd_proto::{Event, EventKind};

use super::runs::{event_runs, Taken, MERGE_BYTES};
use super::{LoggedKv, LoggedOptions, OKey};
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
        .events(keys_s(session), 0, usize::MAX)
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
        crate::sled_kv::open_when_unlocked(|| LoggedKv::open(dir, manual())).expect("reopen");
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
    }
}

fn routed(session: &str, seq: u64, ms: u64) -> Vec<u8> {
    keys::event_routed(session, seq, Some(ms))
}

/// Consecutive fresh puts of one session's routed event values make a run, ending
/// at a value that need not be fresh and is routed by the newest turn of the run; a
/// run stops at another session, a delete, an unrouted value, a value that is not fresh, `seq`s that
/// span [`crate::EVENTS_PER_VALUE`], [`MERGE_BYTES`], and values committed at or
/// before the mark sled holds or after the one the round records. Its value is the
/// arrays and single events joined into one array.
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
    let runs = event_runs(&slice, 0, 1);
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
    let runs = event_runs(&slice, 0, 1);
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
    let bounds: Vec<(usize, usize)> = event_runs(&slice, 0, 1)
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
    let bounds: Vec<(usize, usize)> = event_runs(&slice, 5, 7)
        .iter()
        .map(|r| (r.first, r.last))
        .collect();
    assert_eq!(bounds, vec![(1, 2)]);
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
        .events(keys_s("s"), 2, 2)
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
    assert_eq!(super::applied_mark(sled).expect("mark"), 1);
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
