//! Carries (`overlay::carries`): a settled live record that only the overlay holds is
//! appended to the commit log again instead of written to sled, the applied mark
//! passes its first write, a crash keeps it, a newer write of its key always wins,
//! a record is carried a bounded number of times, a carry the log refuses fails no
//! commit and stops the carries for a while, and a record a round wrote to sled
//! while its carry was on its way is put back as sled's.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::apply::applied_mark;
use super::overlay::MAX_CARRIES;
use super::tests::{commit, commit_during_next_slice, copy_dir, in_sled, opts, put, put_new};
use super::*;
use crate::keys;
use crate::log::{CommitLog, Record};

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
    // The next round finds it at its new lsn, not settled (nothing settles with an
    // hour's delay), and its mark passes the first write: a start replays the
    // carried record alone.
    kv.round_with(Duration::from_secs(3600));
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

/// What [`Gated`] lets through: while closed, appends wait (but for `permits` of
/// them); a group holding a record longer than `max_record` is refused, as a
/// JetStream log refuses a message past its `max_payload`.
#[derive(Default)]
struct GateState {
    closed: bool,
    permits: u64,
    waiting: u64,
    max_record: Option<usize>,
}

#[derive(Default)]
struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

impl Gate {
    fn set(&self, f: impl FnOnce(&mut GateState)) {
        f(&mut self.state.lock().expect("gate"));
        self.changed.notify_all();
    }

    /// Wait until an append waits at the gate (bounded).
    fn wait_for_waiter(&self) {
        let until = Instant::now() + Duration::from_secs(10);
        while self.state.lock().expect("gate").waiting == 0 {
            assert!(Instant::now() < until, "no append waits at the gate");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// A commit log behind a [`Gate`].
struct Gated {
    inner: Box<dyn CommitLog>,
    gate: Arc<Gate>,
}

impl CommitLog for Gated {
    fn next_lsn(&self) -> u64 {
        self.inner.next_lsn()
    }
    fn append(&self, group: &[&[u8]], sync: bool) -> Result<u64, StoreError> {
        {
            let mut s = self.gate.state.lock().expect("gate");
            if s.max_record
                .is_some_and(|max| group.iter().any(|r| r.len() > max))
            {
                return Err(StoreError::Write("a record past the log's largest".into()));
            }
            while s.closed && s.permits == 0 {
                s.waiting += 1;
                s = self.gate.changed.wait(s).expect("gate");
                s.waiting -= 1;
            }
            if s.closed {
                s.permits -= 1;
            }
        }
        self.inner.append(group, sync)
    }
    fn is_failed(&self) -> bool {
        self.inner.is_failed()
    }
    fn heal(&self) -> Result<(), StoreError> {
        self.inner.heal()
    }
    fn flush(&self) -> Result<(), StoreError> {
        self.inner.flush()
    }
    fn read_range(&self, after: u64, upto: u64) -> Result<Vec<Record>, StoreError> {
        self.inner.read_range(after, upto)
    }
    fn wants_trim(&self) -> bool {
        self.inner.wants_trim()
    }
    fn trim(&self, applied: u64) -> Result<usize, StoreError> {
        self.inner.trim(applied)
    }
}

/// A store in `dir` ([`asked`]) on a local log behind `gate`.
fn open_gated(dir: &std::path::Path, gate: Arc<Gate>) -> LoggedKv {
    let log_dir = dir.join("log");
    let o = asked();
    LoggedKv::open_with_log(dir, o, |applied| {
        let opened = crate::log::LocalLog::open(&log_dir, o.segment_bytes, applied)?;
        Ok(crate::log::Opened {
            log: Box::new(Gated {
                inner: Box::new(opened.log),
                gate,
            }) as Box<dyn CommitLog>,
            records: opened.records,
            bytes: opened.bytes,
        })
    })
    .expect("open")
    .0
}

/// A carry the log refuses (its record past what the log takes) is appended as a
/// group of its own, so the commit queued with it is made; no round carries for a
/// while after, so the next one writes the records to sled and its mark moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_carry_the_log_refuses_fails_no_commit_and_the_next_rounds_write_to_sled() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = Arc::new(Gate::default());
    let kv = open_gated(dir.path(), gate.clone());
    // Three queued turns whose records do not compress: each commit fits under the
    // log's largest record, the three carried together do not.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let queued: Vec<Vec<u8>> = (0..3).map(|i| keys::turn(&format!("t{i}"))).collect();
    for k in &queued {
        commit(&kv, put_new(k, &noise(&mut seed, 900))).await;
    }
    gate.set(|s| s.max_record = Some(1000));
    tokio::time::sleep(DELAY * 2).await;
    // Hold the committer in an append; queue the carry, then a commit: the committer
    // takes both at once.
    gate.set(|s| s.closed = true);
    let held = kv.commit(put(b"Kheld", "v"));
    gate.wait_for_waiter();
    kv.round_with(DELAY);
    let queued_with_carry = kv.commit(put(b"Kuser", "v"));
    gate.set(|s| s.closed = false);
    held.await.expect("answered").expect("the held commit");
    queued_with_carry
        .await
        .expect("answered")
        .expect("the commit queued with the refused carry is made");
    assert_eq!(kv.commit_stats().carried_records, 0);
    // The carry was answered before that commit (its group went first). The next
    // round carries nothing: it writes the records to sled, and its mark passes them.
    settled_round(&kv).await;
    for k in &queued {
        assert!(
            in_sled(&kv.inner.sled, k),
            "written to sled after the refusal"
        );
    }
    assert!(applied_mark(&kv.inner.sled).expect("mark") >= 3);
    assert_eq!(kv.commit_stats().carried_records, 0);
}

/// `len` hexadecimal digits that LZ4 does not shrink (xorshift from `seed`).
fn noise(seed: &mut u64, len: usize) -> String {
    (0..len)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            char::from(b"0123456789abcdef"[(*seed % 16) as usize])
        })
        .collect()
}

/// A carry of more than one record's worth of values goes as several records, each
/// under what the log takes: five queued turns of 100 KiB each, on a log whose
/// largest record is 300 KiB, are all carried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_carry_is_split_into_records_the_log_takes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = Arc::new(Gate::default());
    let kv = open_gated(dir.path(), gate.clone());
    gate.set(|s| s.max_record = Some(300 * 1024));
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let queued: Vec<Vec<u8>> = (0..5).map(|i| keys::turn(&format!("t{i}"))).collect();
    for k in &queued {
        commit(&kv, put_new(k, &noise(&mut seed, 100 * 1024))).await;
    }
    settled_round(&kv).await;
    carried(&kv, 5).await;
    for k in &queued {
        assert!(!in_sled(&kv.inner.sled, k), "carried, not written");
    }
}

/// A round without the delay (a flush, a nudge) may write a record to sled and drop
/// it from the overlay after the committer checked its carry: the carry then puts
/// the same value back as not fresh, so the turn's delete still reaches sled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_carry_that_lands_after_a_round_wrote_its_record_leaves_the_delete_to_sled() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = Arc::new(Gate::default());
    let kv = open_gated(dir.path(), gate.clone());
    let turn = keys::turn("t1");
    commit(&kv, put_new(&turn, "queued")).await;
    tokio::time::sleep(DELAY * 2).await;
    gate.set(|s| s.closed = true);
    let held = kv.commit(put(b"Kheld", "v"));
    gate.wait_for_waiter();
    // The carry is queued behind the held append.
    kv.round_with(DELAY);
    assert_eq!(applied_mark(&kv.inner.sled).expect("mark"), 0);
    // The held append goes; the carry is checked and waits at the gate.
    gate.set(|s| s.permits = 1);
    held.await.expect("answered").expect("the held commit");
    gate.wait_for_waiter();
    // A round without the delay writes the record to sled and drops it.
    kv.round_with(Duration::ZERO);
    assert!(in_sled(&kv.inner.sled, &turn));
    gate.set(|s| s.closed = false);
    carried(&kv, 1).await;
    let fresh = kv
        .inner
        .overlay
        .read()
        .expect("overlay")
        .map
        .get(turn.as_slice())
        .map(|p| p.fresh);
    assert_eq!(fresh, Some(false), "put back as sled's");
    // The turn ends: its delete reaches sled.
    let mut end = Batch::new();
    end.delete(turn.clone());
    commit(&kv, end).await;
    kv.sync().expect("sync");
    assert!(!in_sled(&kv.inner.sled, &turn), "the delete was written");
    let (_copy, _, crashed) = crash_copy(&kv, dir.path());
    assert_eq!(crashed.get(&turn).expect("get"), None);
}
