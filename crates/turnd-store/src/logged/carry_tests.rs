//! Carries (`overlay::carries`): a settled live record that only the overlay holds is
//! appended to the commit log again instead of written to sled, the applied mark
//! passes its first write, a crash keeps it, a newer write of its key always wins,
//! and a record is carried a bounded number of times.

use std::time::{Duration, Instant};

use super::apply::applied_mark;
use super::overlay::MAX_CARRIES;
use super::tests::{commit, commit_during_next_slice, copy_dir, in_sled, opts, put, put_new};
use super::*;
use crate::keys;

/// How long a write waits before a round carries it, in these tests.
const DELAY: Duration = Duration::from_millis(20);

/// Rounds only when a test asks for one, each recording its mark.
fn asked() -> LoggedOptions {
    LoggedOptions {
        apply_interval: Duration::from_secs(3600),
        apply_delay: DELAY,
        mark_interval: Duration::ZERO,
        ..opts()
    }
}

/// Let every write settle, then run a round that waits out [`DELAY`].
async fn settled_round(kv: &LoggedKv) {
    tokio::time::sleep(DELAY * 2).await;
    kv.round_with(DELAY);
}

/// Wait until the committer appended `n` carried records in all (bounded).
async fn carried(kv: &LoggedKv, n: u64) {
    let until = Instant::now() + Duration::from_secs(10);
    while kv.commit_stats().carried_records < n {
        assert!(
            Instant::now() < until,
            "{} records carried, not {n}",
            kv.commit_stats().carried_records
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A start on a copy of `dir` as a crash now would leave it (sled's files synced,
/// as they may be at any time): the records it replayed, and the store.
fn crash_copy(kv: &LoggedKv, dir: &std::path::Path) -> (tempfile::TempDir, usize, LoggedKv) {
    let sled = &kv.inner.sled;
    sled.with(|h| sled.sync_files(h)).expect("sync sled");
    let copy = tempfile::tempdir().expect("tempdir");
    copy_dir(dir, copy.path());
    let (crashed, replayed) = LoggedKv::open(copy.path(), opts()).expect("open copy");
    (copy, replayed.records, crashed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settled_live_record_is_carried_in_the_log_and_never_reaches_sled() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, _) = LoggedKv::open(dir.path(), asked()).expect("open");
    let queued = keys::turn("t1");
    commit(&kv, put_new(&queued, "queued")).await;
    settled_round(&kv).await;
    carried(&kv, 1).await;
    assert!(!in_sled(&kv.inner.sled, &queued), "carried, not written");
    assert_eq!(kv.get(&queued).expect("get"), Some(b"queued".to_vec()));
    // The next round finds it at its new lsn, not yet settled, and its mark passes
    // the first write: a start replays the carried record alone.
    kv.round_with(DELAY);
    assert!(applied_mark(&kv.inner.sled).expect("mark") >= 1);
    let (_copy, replayed, crashed) = crash_copy(&kv, dir.path());
    assert_eq!(
        replayed, 1,
        "the start replays the carry, not the first write"
    );
    assert_eq!(crashed.get(&queued).expect("get"), Some(b"queued".to_vec()));
    drop(crashed);
    // The turn ends: its delete is dropped, and sled never held the key.
    let mut end = Batch::new();
    end.delete(queued.clone());
    commit(&kv, end).await;
    kv.sync().expect("sync");
    let s = kv.commit_stats();
    assert_eq!((s.dropped_deletes, s.applied_keys), (1, 0), "{s:?}");
    assert!(!in_sled(&kv.inner.sled, &queued));
    assert_eq!(kv.get(&queued).expect("get"), None);
}

/// The round takes a record to carry and, before the carry reaches the committer,
/// the record is written again: the carry appends nothing, and the newer value
/// stays, in memory and after a crash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_carry_never_brings_back_a_value_written_after_the_round_took_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, _) = LoggedKv::open(dir.path(), asked()).expect("open");
    let turn = keys::turn("t1");
    commit(&kv, put_new(&turn, "queued")).await;
    let rewritten = commit_during_next_slice(&kv, put(&turn, "running"));
    settled_round(&kv).await;
    assert_eq!(*rewritten.lock().expect("lock"), Some(true));
    // The carry was answered without an append (the next round may carry again).
    let until = Instant::now() + Duration::from_secs(10);
    while kv.inner.overlay.read().expect("overlay").committed < 2 {
        assert!(Instant::now() < until, "the rewrite is in the overlay");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(kv.commit_stats().carried_records, 0);
    assert_eq!(kv.inner.overlay.read().expect("overlay").committed, 2);
    assert_eq!(kv.get(&turn).expect("get"), Some(b"running".to_vec()));
    let (_copy, _, crashed) = crash_copy(&kv, dir.path());
    assert_eq!(crashed.get(&turn).expect("get"), Some(b"running".to_vec()));
}

/// A record is carried at most `MAX_CARRIES` times; the next settled round writes
/// it to sled, as a long wait always was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_is_carried_a_bounded_number_of_times_then_written_to_sled() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, _) = LoggedKv::open(dir.path(), asked()).expect("open");
    let waiting = keys::turn("t1");
    commit(&kv, put_new(&waiting, "queued")).await;
    for n in 1..=u64::from(MAX_CARRIES) {
        settled_round(&kv).await;
        carried(&kv, n).await;
        assert!(!in_sled(&kv.inner.sled, &waiting), "carry {n}");
    }
    settled_round(&kv).await;
    assert!(in_sled(&kv.inner.sled, &waiting));
    assert_eq!(
        kv.commit_stats().carried_records,
        u64::from(MAX_CARRIES),
        "no more carries"
    );
    assert_eq!(kv.get(&waiting).expect("get"), Some(b"queued".to_vec()));
}

/// A round records its mark before a record it carries, however the carry fares: a
/// carry that never reached the log (here: the store closing, its queue gone) leaves
/// the record to the log's first write, which a start then replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_carry_that_was_not_appended_keeps_the_mark_before_its_record() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, _) = LoggedKv::open(dir.path(), asked()).expect("open");
    let queued = keys::turn("t1");
    commit(&kv, put_new(&queued, "queued")).await;
    let queue = kv.inner.tx.lock().expect("lock").take();
    settled_round(&kv).await;
    assert_eq!(applied_mark(&kv.inner.sled).expect("mark"), 0);
    assert!(!in_sled(&kv.inner.sled, &queued));
    let (_copy, replayed, crashed) = crash_copy(&kv, dir.path());
    assert_eq!(replayed, 1);
    assert_eq!(crashed.get(&queued).expect("get"), Some(b"queued".to_vec()));
    drop(crashed);
    *kv.inner.tx.lock().expect("lock") = queue;
    assert_eq!(kv.commit_stats().carried_records, 0);
}
