//! The sled databases behind the commit log, through [`LoggedKv`]: committed
//! batches survive a reopen, a large group keeps queue order, checkpoints write
//! snapshots and lose nothing, reads that wait for a checkpoint leave the runtime
//! running, a long read defers a checkpoint, and a snapshot a kill left unfinished.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::{LoggedKv, LoggedOptions};
use crate::kv::Kv;
use crate::model::{keys, Batch};
use crate::sled::{open_when_unlocked, remove_unfinished_snapshots, SledOptions, SyncMode};
use crate::Store;

/// Options whose applier runs every few milliseconds and takes every write at
/// once, with segments of 1 MiB and `sync` for the commit log.
fn options(sync: SyncMode) -> LoggedOptions {
    LoggedOptions {
        sled: SledOptions {
            sync,
            ..SledOptions::default()
        },
        segment_bytes: 1 << 20,
        apply_interval: Duration::from_millis(5),
        apply_delay: Duration::ZERO,
        idle_reopen: Duration::from_secs(3600),
        ..LoggedOptions::default()
    }
}

fn open(dir: &Path, opts: LoggedOptions) -> LoggedKv {
    LoggedKv::open(dir, opts).expect("open").0
}

/// Open the store in `dir` again after a `LoggedKv` on it was dropped (see
/// `open_when_unlocked`).
fn reopen_when_unlocked(dir: &Path, mode: SyncMode) -> LoggedKv {
    open_when_unlocked(|| LoggedKv::open(dir, options(mode)))
        .expect("reopen")
        .0
}

/// `len` bytes that LZ4 cannot shrink, different for each `seed`: the store
/// compresses values, and these reach sled at their size.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[tokio::test]
async fn committed_batches_survive_reopen() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let kv = Arc::new(open(dir.path(), options(SyncMode::Always)));
        let store = Store::new(kv.clone());
        let mut tickets = Vec::new();
        for i in 0..50u64 {
            let mut b = Batch::new();
            b.put_raw(keys::event("s", i + 1), format!("{i}").into_bytes());
            tickets.push(kv.commit(b));
        }
        for t in tickets {
            t.await.expect("answered").expect("committed");
        }
        let mut b = Batch::new();
        b.delete(keys::event("s", 1));
        store.commit(b).await.expect("delete");
        let s = kv.commit_stats();
        assert_eq!(s.batches, 51);
        assert!(s.syncs <= 51);
    }
    let kv = reopen_when_unlocked(dir.path(), SyncMode::Always);
    assert_eq!(kv.get(&keys::event("s", 1)).expect("get"), None);
    assert_eq!(
        kv.get(&keys::event("s", 50)).expect("get"),
        Some(b"49".to_vec())
    );
    let all = kv
        .scan(&keys::event("s", 0), &keys::event_end("s"), true, 3)
        .expect("scan");
    assert_eq!(all.len(), 3);
    assert_eq!(keys::seq_suffix(&all[0].0).expect("seq"), 50);
}

/// Jobs in a group past which it counts as a large one.
const APPLY_CHUNK: usize = 128;

/// A large group keeps queue order: every job's keys are there, and of several
/// writes of one key the last queued wins.
#[tokio::test]
async fn large_groups_apply_in_queue_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    let kv = open(dir.path(), options(SyncMode::Always));
    let jobs = 10 * APPLY_CHUNK as u64;
    let tickets: Vec<_> = (0..jobs)
        .map(|i| {
            let mut b = Batch::new();
            b.put_raw(keys::event("own", i + 1), format!("{i}").into_bytes());
            b.put_raw(keys::session_meta("shared"), format!("{i}").into_bytes());
            kv.commit(b)
        })
        .collect();
    for t in tickets {
        t.await.expect("answered").expect("committed");
    }
    let s = kv.commit_stats();
    assert!(
        s.max_group > APPLY_CHUNK as u64,
        "the jobs queued faster than one chunk: {s:?}"
    );
    let own = kv
        .scan(
            &keys::event("own", 0),
            &keys::event_end("own"),
            false,
            usize::MAX,
        )
        .expect("scan");
    assert_eq!(own.len() as u64, jobs);
    assert_eq!(
        kv.get(&keys::session_meta("shared")).expect("get"),
        Some(format!("{}", jobs - 1).into_bytes())
    );
}

/// Options that checkpoint after every MiB written to sled, with `sync = always`.
fn checkpoint_every_mib(patience: Duration) -> LoggedOptions {
    LoggedOptions {
        sled: SledOptions {
            sync: SyncMode::Always,
            cache_mb: 8,
            checkpoint_mb: 1,
            checkpoint_patience: patience,
            background: true,
            values: false,
        },
        ..options(SyncMode::Always)
    }
}

/// The stable LSN of sled's newest snapshot file (`snap.<hex lsn>`).
fn snapshot_lsn(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .expect("read data dir")
        .filter_map(|e| {
            let name = e.expect("dir entry").file_name().into_string().ok()?;
            u64::from_str_radix(name.strip_prefix("snap.")?, 16).ok()
        })
        .max()
        .unwrap_or(0)
}

/// Past `checkpoint_mb` of writes to sled the applier closes and opens it, which
/// writes a newer snapshot; commits and reads from other threads go on working
/// across it, and everything written is there after a reopen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_write_snapshots_and_lose_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    // The reader below reads without a pause: only a checkpoint that waits for
    // reads gets the handle.
    let opts = checkpoint_every_mib(Duration::ZERO);
    let kv = Arc::new(open(dir.path(), opts));
    let first_snapshot = snapshot_lsn(dir.path());
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (kv, done) = (kv.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                kv.get(&keys::session_meta("probe"))
                    .expect("read during checkpoints");
            }
        })
    };
    let value = noise(7, 4000);
    let n = 1000u64; // about 3.8 MiB, committed in waves so that groups stay small
    for wave in (0..n).collect::<Vec<_>>().chunks(50) {
        let tickets: Vec<_> = wave
            .iter()
            .map(|i| {
                let mut b = Batch::new();
                b.put_raw(keys::event("cp", i + 1), value.clone());
                kv.commit(b)
            })
            .collect();
        for t in tickets {
            t.await.expect("answered").expect("committed");
        }
        // Each wave reaches sled in a round of its own, whatever the machine's load.
        kv.sync().expect("apply");
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    reader.join().expect("reader thread");
    let s = kv.commit_stats();
    assert!(s.checkpoints >= 2, "{s:?}");
    assert!(
        snapshot_lsn(dir.path()) > first_snapshot,
        "a checkpoint writes a newer snapshot"
    );
    assert_eq!(
        kv.get(&keys::event("cp", n)).expect("get"),
        Some(value.clone())
    );
    drop(kv);
    let kv = reopen_when_unlocked(dir.path(), SyncMode::Never);
    let all = kv
        .scan(
            &keys::event("cp", 0),
            &keys::event_end("cp"),
            false,
            usize::MAX,
        )
        .expect("scan");
    assert_eq!(all.len() as u64, n);
    assert!(all.iter().all(|(_, v)| *v == value));
}

/// Reads that wait for a checkpoint do not hold the runtime's worker threads: with
/// both workers of a two-thread runtime waiting to read, a timer task still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_waiting_for_a_checkpoint_leave_the_runtime_running() {
    let dir = tempfile::tempdir().expect("tempdir");
    let kv = Arc::new(open(dir.path(), options(SyncMode::Never)));
    // Stands for a checkpoint: the applier's exclusive hold of the handle.
    let held = kv.inner.sled.handle_lock().write().expect("handle lock");
    let waiting = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (kv, waiting) = (kv.clone(), waiting.clone());
            tokio::spawn(async move {
                waiting.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                kv.get(b"k").map(|_| ())
            })
        })
        .collect();
    while waiting.load(std::sync::atomic::Ordering::SeqCst) < 2 {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(50));
    let (tx, rx) = std::sync::mpsc::channel();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(10)).await;
        tx.send(()).expect("test waits");
    });
    // Blocking on purpose: this test's own task must not be what keeps things going.
    let ran = rx.recv_timeout(Duration::from_secs(5));
    drop(held);
    for r in readers {
        r.await
            .expect("reader task")
            .expect("read after the checkpoint");
    }
    assert!(
        ran.is_ok(),
        "the timer task ran while both workers waited to read"
    );
}

/// A checkpoint does not wait behind a long read (such as `store.check`'s scans):
/// while a read holds the handle, commits go on and the checkpoint is deferred to
/// after a later round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_in_progress_defers_the_checkpoint_without_stalling_commits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = checkpoint_every_mib(Duration::from_secs(3600));
    let kv = Arc::new(open(dir.path(), opts));
    let put = |i: u64| {
        let mut b = Batch::new();
        b.put_raw(keys::event("long", i), noise(i, 64 * 1024));
        kv.commit(b)
    };
    let within = Duration::from_secs(10);
    // A long read, on its own thread: it holds the handle until told to stop.
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let reading = {
        let kv = kv.clone();
        std::thread::spawn(move || {
            let guard = kv.inner.sled.handle_lock().read().expect("handle lock");
            held_tx.send(()).expect("test waits");
            release_rx.recv().expect("test releases");
            drop(guard);
        })
    };
    held_rx.recv().expect("the read holds the handle");
    for i in 0..40u64 {
        tokio::time::timeout(within, put(i))
            .await
            .expect("a commit goes on while a read holds the store")
            .expect("answered")
            .expect("committed");
    }
    // A round takes them all to sled and finds a checkpoint due, which gives way.
    let syncing = {
        let kv = kv.clone();
        std::thread::spawn(move || kv.sync())
    };
    let until = std::time::Instant::now() + within;
    while !syncing.is_finished() {
        assert!(
            std::time::Instant::now() < until,
            "a round waited behind the read"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    syncing.join().expect("round thread").expect("apply");
    assert_eq!(kv.commit_stats().checkpoints, 0);
    release_tx.send(()).expect("reader waits");
    reading.join().expect("reader thread");
    tokio::time::timeout(within, put(40))
        .await
        .expect("commit")
        .expect("answered")
        .expect("committed");
    // The checkpoint runs after the round that follows the read.
    tokio::time::timeout(within, put(41))
        .await
        .expect("commit")
        .expect("answered")
        .expect("committed");
    kv.sync().expect("apply");
    assert_eq!(kv.commit_stats().checkpoints, 1);
}

/// A snapshot sled did not finish writing (the process was killed between
/// creating `snap.<lsn>.generating` and renaming it) does not stop the store from
/// opening, and every committed key is still there.
#[tokio::test]
async fn an_unfinished_snapshot_left_by_a_kill_does_not_stop_the_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let kv = open(dir.path(), options(SyncMode::Always));
        for i in 0..20u64 {
            let mut b = Batch::new();
            b.put_raw(keys::event("s", i + 1), format!("{i}").into_bytes());
            kv.commit(b).await.expect("answered").expect("committed");
        }
    }
    // The newest name sorts last, as the snapshot of a later open would; its
    // content stops part-way, without the length and checksum sled ends it with.
    let unfinished = dir.path().join("snap.7FFFFFFFFFFFFFFF.generating");
    // Not while another handle holds the store: it may be writing that file.
    {
        let held = reopen_when_unlocked(dir.path(), SyncMode::Always);
        std::fs::write(&unfinished, [0x5au8; 40]).expect("write");
        let refused = remove_unfinished_snapshots(dir.path()).expect_err("in use");
        assert!(
            refused.to_string().contains("could not acquire lock"),
            "{refused}"
        );
        assert!(unfinished.exists());
        drop(held);
    }
    let kv = reopen_when_unlocked(dir.path(), SyncMode::Always);
    assert!(!unfinished.exists());
    for i in 0..20u64 {
        assert_eq!(
            kv.get(&keys::event("s", i + 1)).expect("get"),
            Some(format!("{i}").into_bytes())
        );
    }
}
