//! sled 0.34 behind [`Kv`], with group commit.
//!
//! sled's own `flush` on Linux ends in `sync_file_range`, which does not flush the
//! disk's write cache, so it does not make a write survive power loss. The writer
//! thread takes every queued batch, applies them merged into few sled `apply_batch`
//! calls (each atomic), then calls `flush` and `fdatasync` on sled's log file once for
//! the whole group, and only then answers every waiting committer. Batches that arrive
//! while a sync runs wait for the next one, so no acknowledgement waits for more than
//! one sync after its write.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use crate::{Batch, CommitStats, CommitTicket, Entry, Kv, KvOp, StoreError};

/// Whether commits are made durable with an fsync before they are acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SyncMode {
    /// fsync before every acknowledgement (group commit). The default.
    #[default]
    Always,
    /// No fsync: acknowledgements survive a crash of the process only as far as
    /// sled's background flush got. For tests and benchmarks only.
    Never,
}

impl SyncMode {
    pub fn parse(s: &str) -> Option<SyncMode> {
        match s {
            "always" => Some(SyncMode::Always),
            "never" => Some(SyncMode::Never),
            _ => None,
        }
    }
}

struct Job {
    batch: Batch,
    reply: tokio::sync::oneshot::Sender<Result<(), StoreError>>,
}

/// Largest number of batches one group commit takes.
const MAX_GROUP: usize = 4096;
/// Most jobs merged into one sled `apply_batch` (see `writer_loop`).
const APPLY_CHUNK: usize = 128;

/// The sled-backed store.
pub struct SledKv {
    db: sled::Db,
    syncer: Arc<Syncer>,
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    stats: Arc<Mutex<CommitStats>>,
}

/// Makes sled's files durable: flush, then fdatasync of the log and blob files.
struct Syncer {
    db: sled::Db,
    log: File,
    dir: PathBuf,
    mode: SyncMode,
    /// Set after a failed sync or apply. Linux may drop dirty pages whose write-back
    /// failed, so after an fsync error nothing tells what reached the disk; a failed
    /// `apply_batch` may leave part of its group in sled's memory. Every later commit
    /// is refused until the daemon restarts and recovers from the disk.
    poisoned: std::sync::Mutex<Option<String>>,
}

impl Syncer {
    /// Err once the store is poisoned (see `poisoned`).
    fn check(&self) -> Result<(), StoreError> {
        match self.poisoned.lock().ok().and_then(|p| p.clone()) {
            Some(p) => Err(StoreError::Sync(format!(
                "an earlier write or sync failed ({p}); restart the daemon to recover from disk"
            ))),
            None => Ok(()),
        }
    }

    fn sync(&self) -> Result<(), StoreError> {
        self.check()?;
        let r = self.sync_files();
        if let Err(e) = &r {
            self.poison(e);
        }
        r
    }

    /// Refuse every later commit: after a failed sync nothing tells what reached the
    /// disk, and after a failed apply sled may hold part of the group, so nothing more
    /// is built on top of it before a restart.
    fn poison(&self, e: &StoreError) {
        if let Ok(mut p) = self.poisoned.lock() {
            if p.is_none() {
                *p = Some(e.to_string());
            }
        }
    }

    fn sync_files(&self) -> Result<(), StoreError> {
        self.db
            .flush()
            .map_err(|e| StoreError::Sync(format!("flush: {e}")))?;
        self.log
            .sync_data()
            .map_err(|e| StoreError::Sync(format!("fdatasync db: {e}")))?;
        sync_blobs(&self.dir.join("blobs"))
    }
}

/// Values too large for sled's log pages live as files under `blobs/`; a blob is
/// written before the log entry that points at it, so syncing the directory and any
/// blob files written since the last look keeps them durable too. The directory is
/// empty unless a value was very large, so this is one `readdir` in the common case.
fn sync_blobs(dir: &Path) -> Result<(), StoreError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(StoreError::Sync(format!("read blobs dir: {e}"))),
    };
    let mut any = false;
    for entry in entries {
        let entry = entry.map_err(|e| StoreError::Sync(format!("read blobs dir: {e}")))?;
        let f = match File::open(entry.path()) {
            Ok(f) => f,
            // sled removed the blob after the listing (its value was replaced and the
            // old one collected): nothing of it needs to be durable.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(StoreError::Sync(format!(
                    "open blob {:?}: {e}",
                    entry.path()
                )))
            }
        };
        f.sync_data()
            .map_err(|e| StoreError::Sync(format!("fdatasync blob: {e}")))?;
        any = true;
    }
    if any {
        sync_dir(dir)?;
    }
    Ok(())
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::Sync(format!("fsync dir {dir:?}: {e}")))
}

/// Default size of sled's page cache (`storage.cache_mb`).
pub const DEFAULT_CACHE_MB: u64 = 64;

impl SledKv {
    /// Open (or create) the store in `dir` with the default page cache size.
    pub fn open(dir: &Path, mode: SyncMode) -> Result<SledKv, StoreError> {
        SledKv::open_with_cache(dir, mode, DEFAULT_CACHE_MB)
    }

    /// Open (or create) the store in `dir`; sled keeps up to `cache_mb` MiB of
    /// decoded pages in memory (the engine keeps every live turn itself, so the cache
    /// serves reads of finished turns and events).
    pub fn open_with_cache(
        dir: &Path,
        mode: SyncMode,
        cache_mb: u64,
    ) -> Result<SledKv, StoreError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| StoreError::Write(format!("create data dir {dir:?}: {e}")))?;
        let db = sled::Config::new()
            .path(dir)
            .cache_capacity(cache_mb.saturating_mul(1024 * 1024))
            .open()
            .map_err(|e| StoreError::Write(format!("open sled at {dir:?}: {e}")))?;
        let log = File::open(dir.join("db"))
            .map_err(|e| StoreError::Write(format!("open sled log file: {e}")))?;
        sync_dir(dir)?;
        let syncer = Arc::new(Syncer {
            db: db.clone(),
            log,
            dir: dir.to_path_buf(),
            mode,
            poisoned: std::sync::Mutex::new(None),
        });
        let stats = Arc::new(Mutex::new(CommitStats::default()));
        let (tx, rx) = mpsc::channel::<Job>();
        let writer = {
            let db = db.clone();
            let syncer = syncer.clone();
            let stats = stats.clone();
            std::thread::Builder::new()
                .name("turnd-store-writer".into())
                .spawn(move || writer_loop(db, syncer, rx, stats))
                .map_err(|e| StoreError::Write(format!("spawn writer thread: {e}")))?
        };
        Ok(SledKv {
            db,
            syncer,
            tx: Mutex::new(Some(tx)),
            writer: Mutex::new(Some(writer)),
            stats,
        })
    }

    /// Stop the writer thread after it has committed everything queued, then sync.
    pub fn close(&self) -> Result<(), StoreError> {
        let tx = self.tx.lock().map_err(|_| StoreError::Closed)?.take();
        drop(tx);
        let writer = self.writer.lock().map_err(|_| StoreError::Closed)?.take();
        if let Some(w) = writer {
            if w.join().is_err() {
                return Err(StoreError::Write("writer thread panicked".into()));
            }
        }
        self.syncer.sync()
    }
}

impl Drop for SledKv {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::error!("failed to close store: {e}");
        }
    }
}

fn add_to_sled_batch(b: &mut sled::Batch, batch: Batch) {
    for op in batch.ops {
        match op {
            KvOp::Put(k, v) => b.insert(k, v),
            KvOp::Delete(k) => b.remove(k),
        }
    }
}

fn writer_loop(
    db: sled::Db,
    syncer: Arc<Syncer>,
    rx: mpsc::Receiver<Job>,
    stats: Arc<Mutex<CommitStats>>,
) {
    while let Ok(first) = rx.recv() {
        let mut jobs = vec![first];
        while jobs.len() < MAX_GROUP {
            match rx.try_recv() {
                Ok(j) => jobs.push(j),
                Err(_) => break,
            }
        }
        let started = tokio::time::Instant::now();
        let count = jobs.len();
        // The group goes to sled as few batches as possible. sled seals and writes
        // its log buffer around every `apply_batch`, so a batch per job would cost two
        // synchronous device writes per job; a merged batch costs two per chunk of
        // up to APPLY_CHUNK jobs. Chunks, rather than one batch for any size: sled
        // keeps every node version an `apply_batch` replaces until it returns, so one
        // batch of many hundred jobs held tens of MB at once. Every job of the group
        // is acknowledged after the same sync either way. Operations are inserted in
        // queue order, so a later job's write of a key wins, as it would applied one
        // by one. The first failed chunk poisons the store and fails the group.
        let mut replies = Vec::with_capacity(count);
        let mut chunks = Vec::with_capacity(count.div_ceil(APPLY_CHUNK));
        let mut jobs = jobs.into_iter().peekable();
        while jobs.peek().is_some() {
            let mut merged = sled::Batch::default();
            for job in jobs.by_ref().take(APPLY_CHUNK) {
                add_to_sled_batch(&mut merged, job.batch);
                replies.push(job.reply);
            }
            chunks.push(merged);
        }
        let mut result = syncer.check().and_then(|()| {
            chunks.into_iter().try_for_each(|chunk| {
                db.apply_batch(chunk).map_err(|e| {
                    let e = StoreError::Write(e.to_string());
                    tracing::error!("failed to apply a group commit: {e}");
                    syncer.poison(&e);
                    e
                })
            })
        });
        let applied = started.elapsed();
        if syncer.mode == SyncMode::Always && result.is_ok() {
            if let Err(e) = syncer.sync() {
                tracing::error!("failed to sync store: {e}");
                result = Err(e);
            }
        }
        let micros = started.elapsed().as_micros() as u64;
        if let Ok(mut s) = stats.lock() {
            s.syncs += 1;
            s.batches += replies.len() as u64;
            s.commit_micros += micros;
            s.sync_micros += micros.saturating_sub(applied.as_micros() as u64);
            s.max_group = s.max_group.max(replies.len() as u64);
        }
        for reply in replies {
            // A committer that stopped waiting (its request was dropped) needs no
            // answer; the write itself is done either way.
            if reply.send(result.clone()).is_err() {
                tracing::debug!("committer went away before its commit finished");
            }
        }
    }
}

impl Kv for SledKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.db
            .get(key)
            .map(|o| o.map(|v| v.to_vec()))
            .map_err(|e| StoreError::Read(e.to_string()))
    }

    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        let range = self.db.range(start.to_vec()..end.to_vec());
        let map = |r: sled::Result<(sled::IVec, sled::IVec)>| {
            r.map(|(k, v)| (k.to_vec(), v.to_vec()))
                .map_err(|e| StoreError::Read(e.to_string()))
        };
        if reverse {
            range.rev().take(limit).map(map).collect()
        } else {
            range.take(limit).map(map).collect()
        }
    }

    fn commit(&self, batch: Batch) -> CommitTicket {
        let (reply, rx) = tokio::sync::oneshot::channel();
        let sent = match self.tx.lock() {
            Ok(tx) => match tx.as_ref() {
                Some(tx) => tx.send(Job { batch, reply }).map_err(|e| e.0.reply),
                None => Err(reply),
            },
            Err(_) => Err(reply),
        };
        if let Err(reply) = sent {
            if reply.send(Err(StoreError::Closed)).is_err() {
                tracing::debug!("committer went away before it learned the store is closed");
            }
        }
        rx
    }

    fn sync(&self) -> Result<(), StoreError> {
        self.syncer.sync()
    }

    fn commit_stats(&self) -> CommitStats {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{keys, Store};

    #[tokio::test]
    async fn committed_batches_survive_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let kv = Arc::new(SledKv::open(dir.path(), SyncMode::Always).expect("open"));
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
        let kv = SledKv::open(dir.path(), SyncMode::Always).expect("reopen");
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

    /// A group larger than one `apply_batch` chunk keeps queue order: every job's
    /// keys are there, and of several writes of one key the last queued wins.
    #[tokio::test]
    async fn large_groups_apply_in_queue_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let kv = SledKv::open(dir.path(), SyncMode::Never).expect("open");
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

    /// Values large enough to be blob files, replaced over and over: sled deletes the
    /// old blobs while the syncer lists and syncs the directory, which must not fail.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn syncing_blobs_sled_removes_meanwhile_succeeds() {
        let dir = tempfile::tempdir().expect("tempdir");
        let kv = Arc::new(SledKv::open(dir.path(), SyncMode::Always).expect("open"));
        let mut tasks = Vec::new();
        for t in 0..4u64 {
            let kv = kv.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..400u64 {
                    let mut b = Batch::new();
                    b.put_raw(keys::event("blob", t), vec![i as u8; 64 * 1024]);
                    kv.commit(b).await.expect("answered")?;
                }
                Ok::<(), StoreError>(())
            }));
        }
        for t in tasks {
            t.await.expect("task").expect("every commit is durable");
        }
        assert_eq!(
            kv.get(&keys::event("blob", 3)).expect("get"),
            Some(vec![(399 % 256) as u8; 64 * 1024])
        );
    }
}
