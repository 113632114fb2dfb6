//! The commit path of [`super::LoggedKv`] end to end: rounds of the applier, room in
//! the overlay, reads of the overlay and sled merged, starts that replay what sled
//! did not get, trims of the log, marks, deletes dropped or written, writes that
//! wait their delay; and the helpers the other tests of the store share.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::apply::{applied_mark, APPLIED_KEY, APPLY_KEYS};
use super::*;
use crate::keys;
use crate::sled::Shared;

pub(crate) fn opts() -> LoggedOptions {
    LoggedOptions {
        segment_bytes: 4096,
        apply_interval: Duration::from_millis(5),
        apply_delay: Duration::ZERO,
        ..LoggedOptions::default()
    }
}

/// Options whose applier runs only when asked (`sync`) or nudged.
pub(crate) fn slow() -> LoggedOptions {
    LoggedOptions {
        apply_interval: Duration::from_secs(3600),
        ..opts()
    }
}

pub(crate) fn put(k: &[u8], v: &str) -> Batch {
    let mut b = Batch::new();
    b.put_raw(k.to_vec(), v.as_bytes().to_vec());
    b
}

pub(crate) async fn commit(kv: &LoggedKv, b: Batch) {
    kv.commit(b).await.expect("answered").expect("committed");
}

/// A round whose overlay ends exactly at a slice boundary (a multiple of
/// `APPLY_KEYS` keys) ends there: the walk once went on with a range starting past
/// its end, which panicked and ended the applier thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_ending_at_a_slice_boundary_applies_everything() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, _) = LoggedKv::open(dir.path(), slow()).expect("open");
    for slices in [1u64, 2] {
        let mut b = Batch::new();
        for i in 0..APPLY_KEYS as u64 * slices {
            b.put_raw(keys::event(&format!("s{slices}"), i), b"v".to_vec());
        }
        commit(&kv, b).await;
        assert_eq!(kv.overlay_len(), APPLY_KEYS * slices as usize);
        kv.sync().expect("the round applies every slice");
        assert_eq!(kv.overlay_len(), 0);
        kv.health().expect("the applier thread is alive");
    }
}

/// The store is busy while more than a quarter of the overlay's room waits for sled
/// (retention holds back long before commits would wait, and before the applier
/// turns eager), and not once the applier took it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_is_busy_while_a_quarter_of_the_room_waits_for_sled() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Not 64k: a quarter of it is the 16k an earlier build held back from whatever
    // the room, which starved retention at full load.
    let room = 128 * 1024;
    let held = LoggedOptions {
        overlay_keys: room,
        ..slow()
    };
    let (kv, _) = LoggedKv::open(dir.path(), held).expect("open");
    assert!(!kv.busy());
    let mut b = Batch::new();
    for i in 0..(room / 4) as u64 {
        b.put_raw(keys::event("s", i), b"v".to_vec());
    }
    commit(&kv, b).await;
    assert!(!kv.busy(), "a quarter of the room waiting is not yet busy");
    commit(&kv, put(&keys::event("t", 0), "v")).await;
    assert!(kv.busy(), "more than a quarter of the room waits for sled");
    kv.sync().expect("apply");
    assert!(!kv.busy());
}

/// Live records wait their delay while up to half the overlay's room in keys waits,
/// however many they are (a burst of queued turns holds many, and writing them to
/// sled only to delete them again is most of what such a burst costs); past half
/// of it the applier takes everything at once, so that commits do not come to wait
/// for room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_records_wait_their_delay_up_to_half_the_room_and_go_at_once_past_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let room = 64 * 1024;
    let held = LoggedOptions {
        apply_delay: Duration::from_secs(3600),
        overlay_keys: room,
        ..opts()
    };
    let (kv, _) = LoggedKv::open(dir.path(), held).expect("open");
    let live = |i: u64| keys::turn(&format!("t{i:08}"));
    let mut b = Batch::new();
    for i in 0..(room / 2) as u64 {
        b.put_raw(live(i), b"queued".to_vec());
    }
    commit(&kv, b).await;
    assert!(kv.busy(), "the store counts as busy for retention");
    // Rounds run every 5 ms: none of them takes a waiting write.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let s = kv.commit_stats();
    assert_eq!(
        (kv.overlay_len(), s.applied_keys),
        (room / 2, 0),
        "live records within half the room went to sled before their delay"
    );
    assert!(!in_sled(&kv.inner.sled, &live(0)));
    commit(&kv, put(&live(room as u64), "queued")).await;
    let until = Instant::now() + Duration::from_secs(20);
    while kv.overlay_len() > 0 {
        assert!(
            Instant::now() < until,
            "past half the room the applier did not take everything ({} keys left)",
            kv.overlay_len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(in_sled(&kv.inner.sled, &live(0)));
    assert_eq!(kv.get(&live(1)).expect("get"), Some(b"queued".to_vec()));
}

/// Once writes pause for `idle_reopen`, sled is checkpointed (closed and opened
/// again: its snapshot written, its cache given back) once, not again while
/// nothing is written, and once more after the next writes pause; what was
/// written reads the same throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_in_writes_reopens_sled_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let idle = Duration::from_millis(100);
    let (kv, _) = LoggedKv::open(
        dir.path(),
        LoggedOptions {
            idle_reopen: idle,
            ..opts()
        },
    )
    .expect("open");
    let kv = &kv;
    let checkpoints = || kv.commit_stats().checkpoints;
    let until = |n: u64| async move {
        let t = Instant::now();
        while kv.commit_stats().checkpoints < n {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "no checkpoint {n} after the writes paused"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::sleep(idle * 3).await;
    assert_eq!(checkpoints(), 0, "nothing written: nothing to reopen");
    for i in 0..50u64 {
        commit(kv, put(&keys::event("s", i), &format!("v{i}"))).await;
    }
    until(1).await;
    tokio::time::sleep(idle * 10).await;
    assert_eq!(checkpoints(), 1, "reopened again with nothing written");
    let v7 = kv.get(&keys::event("s", 7)).expect("get");
    assert_eq!(v7.as_deref(), Some(&b"v7"[..]));
    commit(kv, put(&keys::event("s", 50), "v50")).await;
    until(2).await;
    let v50 = kv.get(&keys::event("s", 50)).expect("get");
    assert_eq!(v50.as_deref(), Some(&b"v50"[..]));
    kv.health().expect("healthy");
}

/// Reads see every acknowledged write whether it is still in the overlay or
/// already in sled, scans merge both (deletes hide sled's value), and sled gets
/// each key once per round however often it was written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_see_the_overlay_and_sled_merged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, _) = LoggedKv::open(dir.path(), slow()).expect("open");
    for i in 0..10u64 {
        commit(&kv, put(&keys::event("s", i), &format!("a{i}"))).await;
    }
    kv.sync().expect("apply");
    assert_eq!(kv.overlay_len(), 0);
    // Now in the overlay only: a new value for 3, 5 deleted, 10 new.
    commit(&kv, put(&keys::event("s", 3), "b3")).await;
    let mut b = Batch::new();
    b.delete(keys::event("s", 5));
    commit(&kv, b).await;
    commit(&kv, put(&keys::event("s", 10), "b10")).await;
    assert_eq!(kv.overlay_len(), 3);
    let read = |reverse, limit| -> Vec<String> {
        kv.scan(&keys::event("s", 0), &keys::event_end("s"), reverse, limit)
            .expect("scan")
            .into_iter()
            .map(|(_, v)| String::from_utf8(v).expect("utf8"))
            .collect()
    };
    let want = ["a0", "a1", "a2", "b3", "a4", "a6", "a7", "a8", "a9", "b10"];
    assert_eq!(read(false, usize::MAX), want);
    assert_eq!(read(false, 5), want[..5]);
    let mut rev: Vec<&str> = want.to_vec();
    rev.reverse();
    assert_eq!(read(true, usize::MAX), rev);
    assert_eq!(read(true, 2), rev[..2]);
    assert_eq!(kv.get(&keys::event("s", 5)).expect("get"), None);
    assert_eq!(
        kv.get(&keys::event("s", 3)).expect("get"),
        Some(b"b3".to_vec())
    );
    kv.sync().expect("apply");
    assert_eq!(kv.overlay_len(), 0);
    assert_eq!(read(false, usize::MAX), want);
    assert_eq!(kv.get(APPLIED_KEY).expect("get").map(|v| v.len()), Some(8));
}

/// What was acknowledged but never reached sled (the process died between) is
/// read from the log at the next open; a clean close leaves no log to read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_replays_what_sled_did_not_get() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let (kv, _) = LoggedKv::open(dir.path(), slow()).expect("open");
        for i in 0..300u64 {
            commit(&kv, put(&keys::event("s", i), &format!("v{i}"))).await;
        }
        let mut b = Batch::new();
        b.delete(keys::event("s", 7));
        commit(&kv, b).await;
        // As if the process died: the threads are left, nothing is applied.
        std::mem::forget(kv);
    }
    let sled_dir = dir.path().to_path_buf();
    // The forgotten handle still holds sled's lock: copy the files instead.
    let copy = tempfile::tempdir().expect("tempdir");
    copy_dir(&sled_dir, copy.path());
    let (kv, replayed) = LoggedKv::open(copy.path(), opts()).expect("reopen");
    assert_eq!(replayed.records, 301);
    let all = kv
        .scan(
            &keys::event("s", 0),
            &keys::event_end("s"),
            false,
            usize::MAX,
        )
        .expect("scan");
    assert_eq!(all.len(), 299);
    assert_eq!(
        kv.get(&keys::event("s", 299)).expect("get"),
        Some(b"v299".to_vec())
    );
    commit(&kv, put(b"Mx", "after")).await;
    kv.close().expect("close");
    drop(kv);
    // A thread of sled's may hold its file lock a moment after the close.
    let (kv, replayed) =
        crate::sled::open_when_unlocked(|| LoggedKv::open(copy.path(), opts())).expect("reopen");
    assert_eq!(
        replayed.records, 0,
        "a clean close leaves nothing to replay"
    );
    assert_eq!(kv.get(b"Mx").expect("get"), Some(b"after".to_vec()));
    assert_eq!(kv.get(&keys::event("s", 7)).expect("get"), None);
}

/// A copy of a directory as a crash would leave it (the files as they are).
pub(crate) fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("list") {
        let e = e.expect("entry");
        let target = to.join(e.file_name());
        if e.file_type().expect("type").is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), &target).expect("copy");
        }
    }
}

/// Commits faster than the applier's interval do not pile up in memory: past
/// `overlay_keys` the committer makes the applier run at once and waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_overlay_makes_commits_wait_for_the_applier() {
    let dir = tempfile::tempdir().expect("tempdir");
    let room = 64 * 1024;
    let slow = LoggedOptions {
        segment_bytes: 64 << 20,
        overlay_keys: room,
        ..slow()
    };
    let (kv, _) = LoggedKv::open(dir.path(), slow).expect("open");
    let per_batch = 100u64;
    let batches = (room as u64 * 3 / 2) / per_batch;
    let mut most = 0;
    for i in 0..batches {
        let mut b = Batch::new();
        for j in 0..per_batch {
            b.put_raw(keys::event("s", i * per_batch + j), b"v".to_vec());
        }
        commit(&kv, b).await;
        most = most.max(kv.overlay_len());
    }
    assert!(
        most <= room + 2 * per_batch as usize,
        "the overlay held {most} keys"
    );
    let s = kv.commit_stats();
    assert!(s.room_waits > 0, "no group waited for room: {s:?}");
    assert!(s.room_wait_micros > 0, "{s:?}");
    let n = kv
        .scan(
            &keys::event("s", 0),
            &keys::event_end("s"),
            false,
            usize::MAX,
        )
        .expect("scan")
        .len() as u64;
    assert_eq!(n, batches * per_batch);
}

/// Large values fill the overlay's room in bytes long before its room in keys:
/// past `overlay_bytes` commits wait for the applier too. The count follows
/// puts, rewrites, deletes and rounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_values_make_commits_wait_for_the_applier() {
    let dir = tempfile::tempdir().expect("tempdir");
    const VALUE: usize = 64 * 1024;
    let slow = LoggedOptions {
        overlay_bytes: 16 * VALUE,
        ..slow()
    };
    let (kv, _) = LoggedKv::open(dir.path(), slow).expect("open");
    let value = vec![b'x'; VALUE];
    let mut most = 0;
    for i in 0..48u64 {
        let mut b = Batch::new();
        b.put_raw(keys::event("s", i), value.clone());
        // A rewrite and a delete of small keys, counted too.
        b.put_raw(keys::event("t", i % 3), format!("v{i}").into_bytes());
        if i % 5 == 0 {
            b.delete(keys::event("t", (i + 1) % 3));
        }
        commit(&kv, b).await;
        most = most.max(kv.overlay_bytes());
    }
    assert!(kv.overlay_len() < 100, "far from the room in keys");
    assert!(most <= 18 * VALUE, "the overlay held {most} bytes");
    let s = kv.commit_stats();
    assert!(s.room_waits > 0, "no group waited for room: {s:?}");
    kv.sync().expect("apply");
    assert_eq!(kv.overlay_bytes(), 0);
    for i in 0..48u64 {
        assert_eq!(
            kv.get(&keys::event("s", i)).expect("get"),
            Some(value.clone())
        );
    }
}

/// With the applier thread gone, a full overlay refuses commits instead of
/// growing with each one, and the store reports itself unhealthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_overlay_with_no_applier_refuses_commits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let room = 64 * 1024;
    let slow = LoggedOptions {
        segment_bytes: 64 << 20,
        heal_interval: Duration::from_millis(20),
        overlay_keys: room,
        ..slow()
    };
    let (kv, _) = LoggedKv::open(dir.path(), slow).expect("open");
    kv.ctl
        .lock()
        .expect("ctl")
        .as_ref()
        .expect("open")
        .send(Ctl::Exit)
        .expect("send");
    for _ in 0..500 {
        if kv.health().is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(kv.health().is_err(), "the applier's end is reported");
    let mut b = Batch::new();
    for j in 0..=room as u64 {
        b.put_raw(keys::event("s", j), b"v".to_vec());
    }
    commit(&kv, b).await;
    let refused = kv
        .commit(put(&keys::event("t", 0), "v"))
        .await
        .expect("answered");
    assert!(refused.is_err(), "a commit past a full overlay was taken");
    assert_eq!(kv.overlay_len(), room + 1);
}

pub(crate) fn turn_at(ms: u64, n: u8) -> String {
    format!("t_{ms:012x}7000800000000000{n:04x}")
}

pub(crate) fn in_sled(sled: &Shared, key: &[u8]) -> bool {
    sled.with(|h| h.db.get(key).map_err(|e| StoreError::Read(e.to_string())))
        .expect("read")
        .is_some()
}

/// Segments are deleted once sled holds their records, so the log stays small
/// under a steady load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_is_trimmed_behind_the_applier() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, _) = LoggedKv::open(dir.path(), opts()).expect("open");
    for i in 0..2000u64 {
        commit(&kv, put(&keys::session_meta("s"), &format!("{i:0>100}"))).await;
    }
    kv.sync().expect("flush");
    // Segments only: the spare made ahead of need is not one yet.
    let segments = std::fs::read_dir(dir.path().join("log"))
        .expect("list")
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".seg"))
        })
        .count();
    assert!(segments <= 2, "{segments} segments left");
    let s = kv.commit_stats();
    assert!(
        s.applied_keys < 2000,
        "rewrites of one key reach sled coalesced: {s:?}"
    );
    assert_eq!(
        kv.get(&keys::session_meta("s")).expect("get"),
        Some(format!("{:0>100}", 1999).into_bytes())
    );
}

/// Rounds between two marks write to sled but record no mark, so they sync no
/// window: a crash then replays the log from the last mark and loses nothing. A
/// flush (as before a trim) records the mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rounds_between_marks_record_none_and_a_crash_replays_from_the_last() {
    let dir = tempfile::tempdir().expect("tempdir");
    let o = LoggedOptions {
        mark_interval: Duration::from_secs(3600),
        ..slow()
    };
    let (kv, _) = LoggedKv::open(dir.path(), o).expect("open");
    let entries: Vec<Vec<u8>> = (1..=5).map(|i| keys::session_turn("s", i)).collect();
    for k in &entries {
        commit(&kv, put(k, "t")).await;
    }
    kv.round_with(Duration::ZERO);
    assert_eq!(kv.overlay_len(), 0, "the round applied everything");
    let sled = &kv.inner.sled;
    assert_eq!(applied_mark(sled).expect("mark"), 0, "and recorded no mark");
    // sled's files as a crash now would leave them (synced, to be sure the
    // missing mark is not a matter of what reached the disk).
    sled.with(|h| sled.sync_files(h)).expect("sync sled");
    let copy = tempfile::tempdir().expect("tempdir");
    copy_dir(dir.path(), copy.path());
    let (crashed, replayed) = LoggedKv::open(copy.path(), opts()).expect("open copy");
    assert_eq!(replayed.records, 5);
    for k in &entries {
        assert_eq!(crashed.get(k).expect("get"), Some(b"t".to_vec()));
    }
    kv.sync().expect("flush");
    assert_eq!(applied_mark(sled).expect("mark"), 5);
}

/// A round that cannot trim the closed segment yet (its records wait their
/// delay) writes no spare of zeros: the closed segment becomes the spare when it is
/// trimmed, and the log rolls over into it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trimmed_segment_is_the_next_spare_and_no_zeros_are_written_meanwhile() {
    let dir = tempfile::tempdir().expect("tempdir");
    let held = LoggedOptions {
        apply_delay: Duration::from_secs(3600),
        ..slow()
    };
    let (kv, _) = LoggedKv::open(dir.path(), held).expect("open");
    let meta = keys::session_meta("s");
    let mut i = 0u64;
    async fn fill_until(kv: &LoggedKv, key: &[u8], i: &mut u64, segments: u64) {
        while kv.commit_stats().log_segments < segments {
            commit(kv, put(key, &format!("{i:0>200}"))).await;
            *i += 1;
            assert!(*i < 10_000, "the log never rolled over");
        }
    }
    fill_until(&kv, &meta, &mut i, 2).await;
    // The session's meta is a live record: nothing is applied, nothing trimmed.
    kv.round_with(Duration::from_secs(3600));
    let s = kv.commit_stats();
    assert_eq!((s.log_trims, s.log_zeroed), (0, 0), "{s:?}");
    // Everything applied: the closed segment is trimmed into the spare.
    kv.round_with(Duration::ZERO);
    let s = kv.commit_stats();
    assert_eq!(
        (s.log_trims, s.log_recycled, s.log_zeroed),
        (1, 1, 0),
        "{s:?}"
    );
    assert!(dir.path().join("log").join("spare").exists());
    // The next roll takes it: no segment is reserved for it.
    let reserved = s.log_reserved;
    fill_until(&kv, &meta, &mut i, 2).await;
    assert_eq!(kv.commit_stats().log_reserved, reserved);
    assert_eq!(
        kv.get(&meta).expect("get"),
        Some(format!("{:0>200}", i - 1).into_bytes())
    );
}

/// A put that creates its key (a minted id's record), in a batch of its own.
/// Commit `batch` from the applier's next round, right after it wrote its next
/// slice to sled and before it drops the slice from the overlay. The answer says
/// whether the commit was made there (once the round ran).
pub(crate) fn commit_during_next_slice(kv: &LoggedKv, batch: Batch) -> Arc<Mutex<Option<bool>>> {
    let (hook, committed) = commit_hook(kv, batch);
    *kv.inner.after_slice.lock().expect("lock") = Some(hook);
    committed
}

/// Commit `batch` from the applier's next round, right after it read where the
/// round begins. The answer says whether the commit was made there.
pub(crate) fn commit_as_next_round_begins(kv: &LoggedKv, batch: Batch) -> Arc<Mutex<Option<bool>>> {
    let (hook, committed) = commit_hook(kv, batch);
    *kv.inner.after_settle.lock().expect("lock") = Some(hook);
    committed
}

/// A hook of the applier's thread that commits `batch` and waits for its answer.
#[allow(clippy::type_complexity)]
fn commit_hook(
    kv: &LoggedKv,
    batch: Batch,
) -> (Box<dyn FnOnce() + Send>, Arc<Mutex<Option<bool>>>) {
    let tx = kv
        .inner
        .tx
        .lock()
        .expect("lock")
        .clone()
        .expect("committer running");
    let rt = tokio::runtime::Handle::current();
    let committed = Arc::new(Mutex::new(None));
    let seen = committed.clone();
    let hook = Box::new(move || {
        let (reply, ticket) = CommitTicket::new();
        let sent = tx.send(LogJob::new(batch, reply)).is_ok();
        let answer = rt.block_on(ticket);
        *seen.lock().expect("lock") = Some(sent && matches!(answer, Ok(Ok(()))));
    });
    (hook, committed)
}

pub(crate) fn put_new(k: &[u8], v: &str) -> Batch {
    let mut b = put(k, v);
    b.created_last();
    b
}

fn delete(k: &[u8]) -> Batch {
    let mut b = Batch::new();
    b.delete(k.to_vec());
    b
}

fn dropped_deletes(kv: &LoggedKv) -> u64 {
    kv.commit_stats().dropped_deletes
}

/// Delete `k`, which sled holds, and see the delete written, not dropped.
async fn delete_is_written(kv: &LoggedKv, k: &[u8]) {
    let before = dropped_deletes(kv);
    commit(kv, delete(k)).await;
    kv.sync().expect("sync");
    assert_eq!(
        dropped_deletes(kv),
        before,
        "sled had {k:?}: its delete is written"
    );
    assert!(!in_sled(&kv.inner.sled, k));
}

/// A delete of a key that only the overlay ever held (created and deleted between
/// two applies) is dropped, not written; a delete of a key sled got is written,
/// also when the key was written again while the applier was writing it to sled
/// (the race: the overlay's entry then no longer counts as held only there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_is_dropped_only_for_a_key_sled_never_got() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, _) = LoggedKv::open(dir.path(), slow()).expect("open");
    // Created and deleted before any apply.
    commit(&kv, put_new(b"Tone", "v1")).await;
    commit(&kv, delete(b"Tone")).await;
    kv.sync().expect("sync");
    assert_eq!(dropped_deletes(&kv), 1);
    assert!(!in_sled(&kv.inner.sled, b"Tone"));
    assert_eq!(kv.get(b"Tone").expect("get"), None);
    // Created, applied, then deleted.
    commit(&kv, put_new(b"Ttwo", "v1")).await;
    kv.sync().expect("sync");
    assert!(in_sled(&kv.inner.sled, b"Ttwo"));
    delete_is_written(&kv, b"Ttwo").await;
    // Created, then written again while the applier writes the first value.
    commit(&kv, put_new(b"Tthree", "v1")).await;
    let rewritten = commit_during_next_slice(&kv, put(b"Tthree", "v2"));
    kv.sync().expect("sync");
    assert_eq!(
        *rewritten.lock().expect("lock"),
        Some(true),
        "the rewrite was committed while the applier wrote the first value"
    );
    assert!(in_sled(&kv.inner.sled, b"Tthree"));
    delete_is_written(&kv, b"Tthree").await;
    kv.close().expect("close");
    drop(kv);
    let (kv, _) =
        crate::sled::open_when_unlocked(|| LoggedKv::open(dir.path(), opts())).expect("reopen");
    for k in [&b"Tone"[..], b"Ttwo", b"Tthree"] {
        assert_eq!(kv.get(k).expect("get"), None, "{k:?} stays deleted");
    }
}

/// A live record's write waits `apply_delay` in the overlay while a key written
/// once (a turn list entry) in the same batch goes to sled at the next round, and the
/// applied mark stays before the waiting write: a start after a crash meanwhile
/// replays it from the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_record_waits_its_delay_and_a_crash_meanwhile_keeps_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let delayed = LoggedOptions {
        apply_delay: Duration::from_secs(3600),
        ..opts()
    };
    let (kv, _) = LoggedKv::open(dir.path(), delayed).expect("open");
    // A key written once: a session's turn list entry.
    let entry = keys::session_turn("s", 1);
    let mut b = put(&entry, "t1");
    b.put_raw(b"Tlive".to_vec(), b"running".to_vec());
    commit(&kv, b).await;
    let until = Instant::now() + Duration::from_secs(10);
    while kv.overlay_len() != 1 {
        assert!(
            Instant::now() < until,
            "the list entry alone leaves the overlay ({} keys left)",
            kv.overlay_len()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let sled = &kv.inner.sled;
    assert!(in_sled(sled, &entry));
    assert!(!in_sled(sled, b"Tlive"));
    // Further rounds leave it waiting.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(kv.overlay_len(), 1);
    assert_eq!(kv.get(b"Tlive").expect("get"), Some(b"running".to_vec()));
    // sled's files as a crash now would leave them, mark included.
    sled.with(|h| sled.sync_files(h)).expect("sync sled");
    let copy = tempfile::tempdir().expect("tempdir");
    copy_dir(dir.path(), copy.path());
    {
        let (crashed, replayed) = LoggedKv::open(copy.path(), opts()).expect("open copy");
        assert_eq!(
            replayed.records, 1,
            "the waiting write's record is replayed"
        );
        assert_eq!(
            crashed.get(b"Tlive").expect("get"),
            Some(b"running".to_vec())
        );
        assert_eq!(crashed.get(&entry).expect("get"), Some(b"t1".to_vec()));
    }
    // A close takes everything, waiting or not.
    kv.close().expect("close");
    drop(kv);
    let (kv, replayed) =
        crate::sled::open_when_unlocked(|| LoggedKv::open(dir.path(), opts())).expect("reopen");
    assert_eq!(replayed.records, 0);
    assert!(in_sled(&kv.inner.sled, b"Tlive"));
}
