//! sled 0.34 behind [`Kv`], with group commit.
//!
//! sled's own `flush` on Linux ends in `sync_file_range`, which does not flush the
//! disk's write cache, so it does not make a write survive power loss. The writer
//! thread takes every queued batch, applies them merged into few sled `apply_batch`
//! calls (each atomic), then calls `flush` and `fdatasync` on sled's log file once for
//! the whole group, and only then answers every waiting committer. Batches that arrive
//! while a sync runs wait for the next one, so no acknowledgement waits for more than
//! one sync after its write.
//!
//! The writer runs on an OS thread of its own, outside any tokio runtime, and times
//! real disk work (group commits, checkpoints, waiting for sled's file lock), so it
//! uses `std::time`; no tokio timer depends on it.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, RwLock, TryLockError};
use std::time::{Duration, Instant};

use tokio::runtime::RuntimeFlavor;

use crate::values::ValueFile;
use crate::{Batch, CommitReply, CommitStats, CommitTicket, Entry, IoOp, Kv, KvOp, StoreError};

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

/// A batch queued for a group commit, and where its result goes.
pub(crate) struct Job {
    pub(crate) batch: Batch,
    pub(crate) reply: CommitReply,
}

/// Queue `batch` for the thread behind `tx`; a closed store answers `Closed` at once.
pub(crate) fn queue(tx: &Mutex<Option<mpsc::Sender<Job>>>, batch: Batch) -> CommitTicket {
    let (reply, rx) = CommitTicket::new();
    let sent = match tx.lock() {
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

/// Largest number of batches one group commit takes.
const MAX_GROUP: usize = 4096;
/// Most jobs merged into one sled `apply_batch` (see `writer_loop`).
pub(crate) const APPLY_CHUNK: usize = 128;

/// Default of `storage.checkpoint_mb`.
pub const DEFAULT_CHECKPOINT_MB: u64 = 256;

/// How the store is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SledOptions {
    pub sync: SyncMode,
    /// MiB of decoded pages sled keeps in memory.
    pub cache_mb: u64,
    /// MiB of keys and values written since the store was last opened after which
    /// the writer checkpoints (see [`SledKv`]); 0 never checkpoints.
    pub checkpoint_mb: u64,
    /// How long a due checkpoint gives way to reads in progress (it is tried again
    /// after each later group) before it waits for them, new reads queueing behind it.
    pub checkpoint_patience: std::time::Duration,
    /// Whether sled runs its own flusher thread: every [`FLUSH_EVERY_MS`] it writes
    /// sled's buffer out, cleans segments (sled's only reclaiming of the space of
    /// rewritten pages) and `fsync`s sled's file. A database that takes writes needs
    /// the cleaning; one that takes almost none (a time window past its turns) does
    /// without the thread, its wake-ups and its `fsync`s, which with hundreds of
    /// windows open add up. Its rare writes are flushed and synced by whoever needs
    /// them durable ([`Shared::sync_files`]), as every database's are.
    pub background: bool,
    /// Whether large values go to a value file beside sled's
    /// ([`crate::values`]): a time window's database.
    pub values: bool,
}

/// sled's own default period of its flusher thread.
pub const FLUSH_EVERY_MS: u64 = 500;

impl Default for SledOptions {
    fn default() -> Self {
        SledOptions {
            sync: SyncMode::Always,
            cache_mb: DEFAULT_CACHE_MB,
            checkpoint_mb: DEFAULT_CHECKPOINT_MB,
            checkpoint_patience: std::time::Duration::from_secs(1),
            background: true,
            values: false,
        }
    }
}

/// The sled-backed store.
///
/// sled 0.34 writes its snapshot (the page table it would otherwise rebuild from the
/// log) only while it opens a store, so the next open replays everything written since
/// the last one: about a second per GB of log here, and a run that wrote millions of
/// turns would start slowly after a crash or a restart. The writer therefore
/// *checkpoints* once `checkpoint_mb` of keys and values were written since the last
/// open: between two group commits it syncs, closes sled and opens it again, which
/// writes a new snapshot. Commits queue meanwhile and reads wait; the pause grows with
/// the store's size and the log since the last open (measured in `docs/benchmarks.md`).
/// A due checkpoint gives way to reads in progress for up to `checkpoint_patience`.
pub struct SledKv {
    shared: Arc<Shared>,
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    stats: Arc<Mutex<CommitStats>>,
}

/// sled's handle and the log file the syncer fdatasyncs; a checkpoint replaces both.
pub(crate) struct Handle {
    pub(crate) db: sled::Db,
    log: File,
}

impl Handle {
    fn open(dir: &Path, opts: &SledOptions) -> Result<Handle, StoreError> {
        remove_unfinished_snapshots(dir)?;
        let db = sled::Config::new()
            .path(dir)
            .cache_capacity(opts.cache_mb.saturating_mul(1024 * 1024))
            .flush_every_ms(opts.background.then_some(FLUSH_EVERY_MS))
            .open()
            .map_err(|e| StoreError::Write(format!("open sled at {dir:?}: {e}")))?;
        let log = File::open(dir.join("db"))
            .map_err(|e| StoreError::Write(format!("open sled log file: {e}")))?;
        Ok(Handle { db, log })
    }
}

/// What the writer thread, the readers and `sync` share.
pub(crate) struct Shared {
    /// `None` only after a checkpoint failed to open the store again.
    handle: RwLock<Option<Handle>>,
    dir: PathBuf,
    opts: SledOptions,
    /// The cache and flusher the next open of sled takes ([`Shared::open_next_as`]).
    next: Mutex<SledOptions>,
    /// Set after a failed sync, apply or checkpoint. Linux may drop dirty pages whose
    /// write-back failed, so after an fsync error nothing tells what reached the disk;
    /// a failed `apply_batch` may leave part of its group in sled's memory. Every later
    /// commit is refused until the daemon restarts and recovers from the disk.
    poisoned: Mutex<Option<String>>,
    /// Blob files synced so far, with their length then (see `sync_blobs`).
    synced_blobs: Mutex<HashMap<OsString, u64>>,
    /// The value file of a time window's database ([`SledOptions::values`]).
    values: Option<ValueFile>,
    /// Set while sled is closed by [`Shared::park`]: the next [`Shared::with`]
    /// opens it again.
    parked: AtomicBool,
    /// When [`Shared::with`] last ran: ms since `born`.
    used_ms: AtomicU64,
    born: Instant,
    /// Times [`Shared::with`] opened sled again after a park.
    unparks: AtomicU64,
    /// Set by a failed sync or value file append ([`Shared::sync_files`]).
    failed: AtomicBool,
}

impl Shared {
    /// Run `f` on the open sled handle. While a checkpoint holds the handle, a caller
    /// on a worker thread of a multi-threaded tokio runtime waits in `block_in_place`,
    /// so that the runtime's other tasks (heartbeats, timers, requests that read
    /// nothing) move to other threads and go on. (`block_in_place` panics inside a
    /// `LocalSet`; the daemon runs none.)
    ///
    /// A database [`Shared::park`] closed is opened again first.
    pub(crate) fn with<T>(
        &self,
        f: impl FnOnce(&Handle) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        if self.parkable() {
            let now = u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX);
            // A plain store, once per millisecond at most: a window read by callers
            // on every core would bounce this line on each.
            if self.used_ms.load(Ordering::Relaxed) < now {
                self.used_ms.store(now, Ordering::Relaxed);
            }
            if self.is_parked() {
                self.unpark()?;
            }
        }
        let guard = match self.handle.try_read() {
            Ok(g) => Ok(g),
            Err(TryLockError::WouldBlock) => blocking(|| self.handle.read()),
            Err(TryLockError::Poisoned(p)) => Err(p),
        }
        .map_err(|_| StoreError::Read("store lock poisoned".into()))?;
        match guard.as_ref() {
            Some(h) => f(h),
            // Parked between the check above and the lock (it was unused for long
            // before this call began): a reader's wait is not worth a retry loop.
            None if self.is_parked() => {
                drop(guard);
                self.unpark()?;
                self.with(f)
            }
            None => Err(StoreError::Read(format!(
                "the store is closed: {}",
                self.poison_reason().unwrap_or_else(|| "shut down".into())
            ))),
        }
    }

    /// Open (or create) sled in `dir`.
    pub(crate) fn open(dir: &Path, opts: SledOptions) -> Result<Shared, StoreError> {
        std::fs::create_dir_all(dir).map_err(|e| {
            StoreError::io(IoOp::Write, format_args!("create data dir {dir:?}"), &e)
        })?;
        let handle = Handle::open(dir, &opts)?;
        // sled writes `conf` (in two writes) when it makes a store, or finds it empty,
        // and never syncs it; one torn by a power loss fails every later open.
        File::open(dir.join("conf"))
            .and_then(|f| f.sync_all())
            .map_err(|e| StoreError::io(IoOp::Sync, format_args!("fsync {dir:?}/conf"), &e))?;
        sync_dir(dir)?;
        Shared::opened(dir, opts, Some(handle))
    }

    /// The sled database in `dir` (which must hold one), parked ([`Shared::park`])
    /// without being opened: its first use opens it. A start leaves the windows no
    /// one uses yet this way.
    pub(crate) fn open_parked(dir: &Path, opts: SledOptions) -> Result<Shared, StoreError> {
        for file in ["conf", "db"] {
            if !dir.join(file).is_file() {
                return Err(StoreError::Corrupt(format!(
                    "{dir:?} holds no sled database: its {file} file is missing"
                )));
            }
        }
        Shared::opened(dir, opts, None)
    }

    /// A handle on `dir` with `handle` open, or parked when None.
    fn opened(dir: &Path, opts: SledOptions, handle: Option<Handle>) -> Result<Shared, StoreError> {
        let values = if opts.values {
            Some(ValueFile::open(dir)?)
        } else {
            None
        };
        Ok(Shared {
            parked: AtomicBool::new(handle.is_none()),
            handle: RwLock::new(handle),
            dir: dir.to_path_buf(),
            opts,
            next: Mutex::new(opts),
            poisoned: Mutex::new(None),
            synced_blobs: Mutex::new(HashMap::new()),
            values,
            used_ms: AtomicU64::new(0),
            born: Instant::now(),
            unparks: AtomicU64::new(0),
            failed: AtomicBool::new(false),
        })
    }

    /// Whether [`Shared::park`] may close this database: only a time window's (the
    /// databases with a value file). The main database is never parked, so its
    /// reads, on every core, keep no clock of their use.
    fn parkable(&self) -> bool {
        self.values.is_some()
    }

    /// How long since [`Shared::with`] last ran on this database.
    pub(crate) fn unused_for(&self) -> Duration {
        let used = Duration::from_millis(self.used_ms.load(Ordering::Relaxed));
        self.born.elapsed().saturating_sub(used)
    }

    /// Times a use opened sled again after [`Shared::park`].
    pub(crate) fn unparks(&self) -> u64 {
        self.unparks.load(Ordering::Relaxed)
    }

    /// Whether sled is closed by [`Shared::park`] now.
    pub(crate) fn is_parked(&self) -> bool {
        self.parked.load(Ordering::Acquire)
    }

    /// Close sled until it is needed again (a time window no read or write touched
    /// for a while): what its page table and cache hold goes back, and the next
    /// [`Shared::with`] opens it again. Its writes are synced first, so nothing is
    /// left for the close to do. Gives way (`Ok(false)`) to a read or write in
    /// progress.
    pub(crate) fn park(&self) -> Result<bool, StoreError> {
        if !self.parkable() {
            return Ok(false);
        }
        self.check()?;
        let mut slot = match self.handle.try_write() {
            Ok(slot) => slot,
            Err(TryLockError::WouldBlock) => return Ok(false),
            Err(TryLockError::Poisoned(_)) => {
                return Err(StoreError::Write("store lock poisoned".into()))
            }
        };
        let Some(h) = slot.as_ref() else {
            return Ok(false);
        };
        self.sync_files(h)?;
        let old = slot.take();
        self.parked.store(true, Ordering::Release);
        // sled's drop flushes and syncs once more and panics if that fails; the next
        // use opens it again, and meets the failure there if the disk still fails.
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(old))).is_err() {
            tracing::warn!("closing sled at {:?} to park it panicked", self.dir);
        }
        Ok(true)
    }

    /// Open sled again after [`Shared::park`] (if no other caller did meanwhile):
    /// the wait for the lock and sled's open both in [`blocking`], so that a tokio
    /// worker hands its other tasks on meanwhile.
    fn unpark(&self) -> Result<(), StoreError> {
        blocking(|| {
            let mut slot = self
                .handle
                .write()
                .map_err(|_| StoreError::Read("store lock poisoned".into()))?;
            if slot.is_none() && self.is_parked() {
                let h = self.reopen()?;
                *slot = Some(h);
                self.parked.store(false, Ordering::Release);
                self.unparks.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut synced) = self.synced_blobs.lock() {
                    synced.clear();
                }
                tracing::debug!("opened the parked sled at {:?} again", self.dir);
            }
            Ok(())
        })
    }

    /// A value as sled holds it, with a pointer into the value file replaced by
    /// the value it names: the form [`crate::logged`] unpacks.
    pub(crate) fn stored<'v>(&self, v: &'v [u8]) -> Result<Cow<'v, [u8]>, StoreError> {
        if !crate::values::is_pointer(v) {
            return Ok(Cow::Borrowed(v));
        }
        match &self.values {
            Some(f) => f.read(v).map(Cow::Owned),
            None => Err(StoreError::Corrupt(format!(
                "sled at {:?} holds a pointer to a value file, and has none",
                self.dir
            ))),
        }
    }

    /// [`Shared::stored`] of a value sled returned.
    pub(crate) fn resolved(&self, v: sled::IVec) -> Result<sled::IVec, StoreError> {
        match self.stored(&v)? {
            Cow::Borrowed(_) => Ok(v),
            Cow::Owned(read) => Ok(sled::IVec::from(read)),
        }
    }

    /// The value file, for a database that has one.
    pub(crate) fn values(&self) -> Option<&ValueFile> {
        self.values.as_ref()
    }

    /// Make a new database at `dir`, which must not exist, so that a crash at any
    /// moment leaves either no directory there or a whole database: sled's open of a
    /// new directory writes its `conf` in two writes and syncs none of it, and a
    /// directory left half made would fail the next start's open. The database is
    /// made under the name [`making_path`] gives, closed, its files and directory
    /// synced, renamed into place (the parent synced), and opened there. A directory
    /// left under the making name (by a crash, or a make that failed) is the caller's
    /// to remove; while it is there, a make is refused rather than reusing it.
    pub(crate) fn make(dir: &Path, opts: SledOptions) -> Result<Shared, StoreError> {
        let making = making_path(dir);
        std::fs::create_dir(&making)
            .map_err(|e| StoreError::io(IoOp::Write, format_args!("create {making:?}"), &e))?;
        let handle = Handle::open(
            &making,
            &SledOptions {
                cache_mb: 1,
                background: false,
                ..opts
            },
        )?;
        handle
            .db
            .flush()
            .map_err(|e| StoreError::Sync(format!("flush sled at {making:?}: {e}")))?;
        drop(handle);
        sync_tree(&making)?;
        std::fs::rename(&making, dir).map_err(|e| {
            StoreError::io(
                IoOp::Write,
                format_args!("rename {making:?} to {dir:?}"),
                &e,
            )
        })?;
        if let Some(parent) = dir.parent() {
            sync_dir(parent)?;
        }
        let handle = open_when_unlocked(|| Handle::open(dir, &opts))?;
        Shared::opened(dir, opts, Some(handle))
    }

    /// The cache and flusher sled gets when it is next opened again (a checkpoint, a
    /// repair): those of `opts`.
    pub(crate) fn open_next_as(&self, opts: &SledOptions) {
        if let Ok(mut next) = self.next.lock() {
            *next = *opts;
        }
    }

    /// The directory sled lives in.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    fn poison_reason(&self) -> Option<String> {
        self.poisoned.lock().ok().and_then(|p| p.clone())
    }

    /// Err once the store is poisoned (see `poisoned`).
    fn check(&self) -> Result<(), StoreError> {
        match self.poison_reason() {
            Some(p) => Err(StoreError::Sync(format!(
                "an earlier write or sync failed ({p}); restart the daemon to recover from disk"
            ))),
            None => Ok(()),
        }
    }

    fn sync(&self) -> Result<(), StoreError> {
        self.check()?;
        let r = self.with(|h| self.sync_files(h));
        if let Err(e) = &r {
            self.poison(e);
        }
        r
    }

    /// Make sled's files durable: flush, then fdatasync of the log and blob files,
    /// and of the value file.
    ///
    /// A failure is sticky until [`Shared::reopen_after_failure`]: Linux reports a
    /// failed write-back once, on one `fsync`, and may drop the pages, so a later
    /// `fsync` that succeeds does not make them durable; only writing them again does
    /// (the commit log's owner refills what it applied since its last durable mark
    /// before it reopens). Likewise after a failed append to the value file
    /// ([`Shared::note_failure`]).
    pub(crate) fn sync_files(&self, h: &Handle) -> Result<(), StoreError> {
        if self.failed.load(Ordering::Acquire) {
            return Err(StoreError::Sync(format!(
                "an earlier write or sync of {:?} failed; its writes since the last durable mark are made again first",
                self.dir
            )));
        }
        let r = self.sync_files_once(h);
        if r.is_err() {
            self.note_failure();
        }
        r
    }

    /// Make [`Shared::sync_files`] fail until [`Shared::reopen_after_failure`].
    pub(crate) fn note_failure(&self) {
        self.failed.store(true, Ordering::Release);
    }

    fn sync_files_once(&self, h: &Handle) -> Result<(), StoreError> {
        if let Some(v) = &self.values {
            v.sync()?;
        }
        h.db.flush()
            .map_err(|e| StoreError::Sync(format!("flush: {e}")))?;
        h.log
            .sync_data()
            .map_err(|e| StoreError::io(IoOp::Sync, "fdatasync db", &e))?;
        let mut synced = self
            .synced_blobs
            .lock()
            .map_err(|_| StoreError::Sync("blob list lock poisoned".into()))?;
        sync_blobs(&self.dir.join("blobs"), &mut synced).map(|_| ())
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

    /// Sync, close sled and open it again, so that sled writes a snapshot and the
    /// next open replays only what was written after this one. Runs on the writer
    /// thread between group commits; readers wait for it. Unless `wait`, a read in
    /// progress (a long scan such as `store.check`) makes it give way, `Ok(false)`,
    /// rather than stall every commit and read behind that read.
    pub(crate) fn checkpoint(&self, wait: bool) -> Result<bool, StoreError> {
        self.check()?;
        let locked = if wait {
            self.handle.write().map_err(|_| ())
        } else {
            match self.handle.try_write() {
                Ok(slot) => Ok(slot),
                Err(TryLockError::WouldBlock) => return Ok(false),
                Err(TryLockError::Poisoned(_)) => Err(()),
            }
        };
        let mut slot = locked.map_err(|_| StoreError::Write("store lock poisoned".into()))?;
        let r = match slot.as_ref() {
            // A failed sync leaves sled open (and the store poisoned), as after a
            // group: dropping sled then would run its own `sync_all().unwrap()`.
            Some(h) => self.sync_files(h).and_then(|()| {
                let old = slot.take();
                // sled's drop flushes and syncs once more and panics if that fails.
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(old)))
                    .map_err(|_| StoreError::Sync("closing sled failed".into()))?;
                let h = self.reopen()?;
                sync_dir(&self.dir)?;
                // sled's open may remove blobs past what it recovered, whose names
                // (log positions) it may then use again: sync every blob once more.
                if let Ok(mut synced) = self.synced_blobs.lock() {
                    synced.clear();
                }
                Ok(h)
            }),
            // Parked: its next open takes the options `open_next_as` set.
            None if self.is_parked() => return Ok(true),
            None => Err(StoreError::Closed),
        };
        match r {
            Ok(h) => {
                *slot = Some(h);
                Ok(true)
            }
            Err(e) => {
                let e = StoreError::Write(format!("checkpoint: {e}"));
                self.poison(&e);
                Err(e)
            }
        }
    }

    /// Close sled without syncing it and open it again: after an I/O error sled
    /// refuses every later write until it is opened again. What the closed handle
    /// held in memory and had not made durable is lost; its owner writes it again
    /// (the commit log in front of sled keeps it). Readers wait meanwhile.
    pub(crate) fn reopen_after_failure(&self) -> Result<(), StoreError> {
        let mut slot = self
            .handle
            .write()
            .map_err(|_| StoreError::Write("store lock poisoned".into()))?;
        // Its owner writes again what it wrote since its last durable mark.
        self.failed.store(false, Ordering::Release);
        if slot.is_none() && self.is_parked() {
            // Closed after a sync: nothing of it is lost, and the next use opens it.
            return Ok(());
        }
        let old = slot.take();
        // sled's drop flushes once more and may panic when the disk still fails.
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(old))).is_err() {
            tracing::warn!("closing the failed sled handle panicked; opening it again anyway");
        }
        let h = self.reopen()?;
        if let Ok(mut synced) = self.synced_blobs.lock() {
            synced.clear();
        }
        *slot = Some(h);
        Ok(())
    }

    /// Whether the handle is gone: closed for good ([`Shared::close`]), or not opened
    /// again after a checkpoint.
    pub(crate) fn is_closed(&self) -> bool {
        // Under the lock: `park` sets `parked` while it holds it for writing.
        self.handle
            .read()
            .is_ok_and(|h| h.is_none() && !self.is_parked())
    }

    /// Close sled for good (a dropped time window, whose directory is deleted next).
    /// Readers that come later get an error, never a stale read.
    pub(crate) fn close(&self) {
        let Ok(mut slot) = self.handle.write() else {
            return;
        };
        self.parked.store(false, Ordering::Release);
        let old = slot.take();
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(old))).is_err() {
            tracing::warn!("closing sled at {:?} panicked", self.dir);
        }
    }

    /// Open the store after a checkpoint closed it.
    fn reopen(&self) -> Result<Handle, StoreError> {
        let next = self.next.lock().map_or(self.opts, |n| *n);
        open_when_unlocked(|| Handle::open(&self.dir, &next))
    }
}

/// Run `f`, which may block for a while: on a worker thread of a multi-threaded tokio
/// runtime inside `block_in_place`, so that the runtime's other tasks move to other
/// threads; elsewhere (a plain thread, a current-thread runtime) as it is.
pub(crate) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    let in_multi_thread_runtime = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread);
    if in_multi_thread_runtime {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

/// Remove the snapshot files sled left unfinished in `dir` (`snap.<lsn>.generating`).
///
/// sled 0.34 writes its snapshot while it opens a store: into `snap.<lsn>.generating`,
/// synced, then renamed to `snap.<lsn>`, and only then does it remove the older
/// snapshots. A process killed before the rename leaves the `.generating` file behind,
/// and sled's next open takes it for the newest snapshot (its file filter skips only
/// `.in___motion`): a partly written one fails the open with "Read corrupted data at
/// file offset None". Nothing was written to sled's log between the snapshot it
/// started from and the one it was generating (both are taken at open, before any
/// write), so without the file sled opens from the previous snapshot, still on disk,
/// or from its log alone, and finds the same data; it then writes the snapshot again.
///
/// Only while sled's lock on its `db` file can be taken: a process that holds it (a
/// running daemon, while `turnd check --data-dir` looks at its directory) may be
/// writing its snapshot right now, and sled writes one only while it holds the lock.
/// A held lock refuses the open as sled would. The lock is let go before sled opens
/// the store (sled takes it again then).
fn remove_unfinished_snapshots(dir: &Path) -> Result<(), StoreError> {
    let db = match File::open(dir.join("db")) {
        Ok(f) => f,
        // A new store: sled has written no snapshot in it.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(StoreError::io(
                IoOp::Read,
                format_args!("open sled's file in {dir:?}"),
                &e,
            ))
        }
    };
    match db.try_lock() {
        Ok(()) => {}
        // In use: refused in the words of sled's own refusal, which the callers know
        // (`open_when_unlocked` tries again; `turnd check --data-dir` names the holder).
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err(StoreError::Write(format!(
            "open sled at {dir:?}: could not acquire lock on its db file: held by another handle"
        )))
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(StoreError::io(
                IoOp::Read,
                format_args!("lock sled's file in {dir:?}"),
                &e,
            ))
        }
    }
    let listing_failed =
        |e: std::io::Error| StoreError::io(IoOp::Read, format_args!("list store dir {dir:?}"), &e);
    for entry in std::fs::read_dir(dir).map_err(listing_failed)? {
        let entry = entry.map_err(listing_failed)?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("snap.") && name.ends_with(".generating") {
            tracing::warn!("removing {name} in {dir:?}: a snapshot sled did not finish writing");
            std::fs::remove_file(entry.path()).map_err(|e| {
                StoreError::io(
                    IoOp::Write,
                    format_args!("remove unfinished snapshot {:?}", entry.path()),
                    &e,
                )
            })?;
        }
    }
    Ok(())
}

/// How long an open waits for sled's file lock to be released.
const REOPEN_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// Run `open` until sled's file lock is no longer refused, for up to
/// `REOPEN_PATIENCE`. The lock goes with the last reference to sled's file, which a
/// thread of sled's may hold for a moment after a handle on the same directory is
/// dropped (a checkpoint's close, or a store closed and opened again in one process).
pub(crate) fn open_when_unlocked<T>(
    mut open: impl FnMut() -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let give_up = std::time::Instant::now() + REOPEN_PATIENCE;
    loop {
        match open() {
            Err(e)
                if std::time::Instant::now() < give_up
                    && e.to_string().contains("could not acquire lock") =>
            {
                tracing::debug!("store still locked by a closed handle: {e}");
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            r => return r,
        }
    }
}

/// Log messages larger than a quarter of sled's 512 KiB segment (a large value, or a
/// leaf node whose values add up to that) live as files under `blobs/`; a blob is
/// written before the log entry that points at it, so syncing the directory and the
/// new blob files keeps them durable too. sled writes a blob file once (created new,
/// then written in three `write_all`s) and never changes it, so a file already synced at
/// its current length needs nothing: only new files, and files that grew since their
/// last sync (one caught while sled was writing it), are synced; the list starts
/// empty at each open and after each checkpoint. A blob's removal becomes durable
/// with the next directory fsync, so after a power loss a collected blob may come
/// back as an unreferenced file (disk space only). With small values the directory
/// stays empty and this is one `readdir`; otherwise a `readdir` and a `stat` per
/// live blob. Returns how many files it synced.
fn sync_blobs(dir: &Path, synced: &mut HashMap<OsString, u64>) -> Result<usize, StoreError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(StoreError::io(IoOp::Sync, "read blobs dir", &e)),
    };
    let mut live = HashMap::with_capacity(synced.len());
    let mut fresh = 0;
    for entry in entries {
        let entry = entry.map_err(|e| StoreError::io(IoOp::Sync, "read blobs dir", &e))?;
        let name = entry.file_name();
        // sled removes a blob once its value was replaced and the old one collected,
        // possibly after the listing: a blob that is gone needs nothing made durable.
        let len = match entry.metadata() {
            Ok(m) => m.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(StoreError::io(
                    IoOp::Sync,
                    format_args!("stat blob {name:?}"),
                    &e,
                ))
            }
        };
        if synced.get(&name) != Some(&len) {
            let f = match File::open(entry.path()) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => {
                    return Err(StoreError::io(
                        IoOp::Sync,
                        format_args!("open blob {:?}", entry.path()),
                        &e,
                    ))
                }
            };
            f.sync_data()
                .map_err(|e| StoreError::io(IoOp::Sync, "fdatasync blob", &e))?;
            fresh += 1;
        }
        live.insert(name, len);
    }
    if fresh > 0 {
        sync_dir(dir)?;
    }
    *synced = live;
    Ok(fresh)
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io(IoOp::Sync, format_args!("fsync dir {dir:?}"), &e))
}

/// What [`making_path`] appends to a directory's name.
pub(crate) const MAKING_SUFFIX: &str = ".new";

/// Where [`Shared::make`] makes the database of `dir` before renaming it into place:
/// `dir`'s name with [`MAKING_SUFFIX`] appended.
pub(crate) fn making_path(dir: &Path) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(MAKING_SUFFIX);
    dir.with_file_name(name)
}

/// `fsync` every file under `dir`, then the directories, deepest first.
fn sync_tree(dir: &Path) -> Result<(), StoreError> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| StoreError::io(IoOp::Sync, format_args!("list {dir:?}"), &e))?;
    for entry in entries {
        let entry =
            entry.map_err(|e| StoreError::io(IoOp::Sync, format_args!("list {dir:?}"), &e))?;
        let path = entry.path();
        let kind = entry
            .file_type()
            .map_err(|e| StoreError::io(IoOp::Sync, format_args!("stat {path:?}"), &e))?;
        if kind.is_dir() {
            sync_tree(&path)?;
        } else {
            File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(|e| StoreError::io(IoOp::Sync, format_args!("fsync {path:?}"), &e))?;
        }
    }
    sync_dir(dir)
}

/// Default size of sled's page cache (`storage.cache_mb`). The engine holds every
/// live turn itself and the commit log's overlay serves what sled has not applied,
/// so the cache serves only reads of finished work; at 8 MiB the benchmarks run as
/// fast as at 64 MiB, and a burst of finished sessions leaves 56 MiB less behind
/// (docs/benchmarks.md).
pub const DEFAULT_CACHE_MB: u64 = 8;

impl SledKv {
    /// Open (or create) the store in `dir` with the default options and `mode`.
    pub fn open(dir: &Path, mode: SyncMode) -> Result<SledKv, StoreError> {
        SledKv::open_with(
            dir,
            SledOptions {
                sync: mode,
                ..SledOptions::default()
            },
        )
    }

    /// Open (or create) the store in `dir`. sled keeps up to `opts.cache_mb` MiB of
    /// decoded pages in memory (the engine keeps every live turn itself, so the cache
    /// serves reads of finished turns and events).
    pub fn open_with(dir: &Path, opts: SledOptions) -> Result<SledKv, StoreError> {
        let shared = Arc::new(Shared::open(dir, opts)?);
        let stats = Arc::new(Mutex::new(CommitStats::default()));
        let (tx, rx) = mpsc::channel::<Job>();
        let writer = {
            let shared = shared.clone();
            let stats = stats.clone();
            std::thread::Builder::new()
                .name("turnd-store-writer".into())
                .spawn(move || writer_loop(&shared, rx, &stats))
                .map_err(|e| StoreError::Write(format!("spawn writer thread: {e}")))?
        };
        Ok(SledKv {
            shared,
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
        self.shared.sync()
    }
}

impl Drop for SledKv {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::error!("failed to close store: {e}");
        }
    }
}

fn add_to_sled_batch(b: &mut sled::Batch, batch: Batch) -> u64 {
    let mut bytes = 0;
    for op in batch.ops {
        match op {
            KvOp::Put(k, v) => {
                bytes += (k.len() + v.len()) as u64;
                b.insert(k, v)
            }
            KvOp::Delete(k) => {
                bytes += k.len() as u64;
                b.remove(k)
            }
        }
    }
    bytes
}

/// When the writer checkpoints: what it wrote since sled was last opened, and since
/// when a due checkpoint has been giving way to reads.
pub(crate) struct Checkpoints {
    /// `checkpoint_mb` in bytes; 0: never.
    every: u64,
    /// Bytes of keys and values written since sled was last opened.
    written: u64,
    /// When sled was last written.
    last_write: Option<std::time::Instant>,
    deferred_since: Option<std::time::Instant>,
}

impl Checkpoints {
    pub(crate) fn new(opts: &SledOptions) -> Checkpoints {
        Checkpoints {
            every: opts.checkpoint_mb.saturating_mul(1024 * 1024),
            written: 0,
            last_write: None,
            deferred_since: None,
        }
    }

    /// Note `bytes` of keys and values written to sled.
    pub(crate) fn wrote(&mut self, bytes: u64) {
        if bytes > 0 {
            self.written += bytes;
            self.last_write = Some(std::time::Instant::now());
        }
    }

    /// After a group was answered (so that a checkpoint delays only later ones):
    /// checkpoint if enough was written since the last open.
    pub(crate) fn after_group(&mut self, shared: &Shared, stats: &Mutex<CommitStats>) {
        if self.every == 0 || self.written < self.every {
            return;
        }
        self.run(shared, stats);
    }

    /// Checkpoint once sled took no write for `idle` after taking some since it was
    /// last opened: the snapshot is then written while nothing waits, and what sled's
    /// cache and tables grew to in a burst of writes is given back (sled keeps far
    /// more than `cache_mb` of recently written pages). Never with `checkpoint_mb = 0`.
    pub(crate) fn when_idle(
        &mut self,
        shared: &Shared,
        stats: &Mutex<CommitStats>,
        idle: std::time::Duration,
    ) {
        let quiet = self.last_write.is_some_and(|t| t.elapsed() >= idle);
        if self.every == 0 || self.written == 0 || !quiet {
            return;
        }
        self.run(shared, stats);
    }

    fn run(&mut self, shared: &Shared, stats: &Mutex<CommitStats>) {
        let started = std::time::Instant::now();
        let wait = self
            .deferred_since
            .is_some_and(|since| since.elapsed() >= shared.opts.checkpoint_patience);
        let r = shared.checkpoint(wait);
        let micros = started.elapsed().as_micros() as u64;
        match r {
            Ok(true) => {
                tracing::info!(
                    "checkpointed the store (closed and opened sled) in {} ms",
                    micros / 1000
                );
                self.written = 0;
                self.deferred_since = None;
                if let Ok(mut s) = stats.lock() {
                    s.checkpoints += 1;
                    s.checkpoint_micros += micros;
                    s.max_checkpoint_micros = s.max_checkpoint_micros.max(micros);
                }
            }
            Ok(false) => {
                self.deferred_since.get_or_insert(started);
                tracing::debug!("checkpoint deferred: a read holds the store");
            }
            Err(e) => tracing::error!("failed to checkpoint the store: {e}"),
        }
    }
}

fn writer_loop(shared: &Shared, rx: mpsc::Receiver<Job>, stats: &Mutex<CommitStats>) {
    let mut checkpoints = Checkpoints::new(&shared.opts);
    while let Ok(first) = rx.recv() {
        let mut jobs = vec![first];
        while jobs.len() < MAX_GROUP {
            match rx.try_recv() {
                Ok(j) => jobs.push(j),
                Err(_) => break,
            }
        }
        let started = std::time::Instant::now();
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
                checkpoints.wrote(add_to_sled_batch(&mut merged, job.batch));
                replies.push(job.reply);
            }
            chunks.push(merged);
        }
        let mut applied = started.elapsed();
        let result = shared.check().and_then(|()| {
            shared.with(|h| {
                chunks.into_iter().try_for_each(|chunk| {
                    h.db.apply_batch(chunk).map_err(|e| {
                        let e = StoreError::Write(e.to_string());
                        tracing::error!("failed to apply a group commit: {e}");
                        shared.poison(&e);
                        e
                    })
                })?;
                applied = started.elapsed();
                if shared.opts.sync == SyncMode::Always {
                    shared.sync_files(h).inspect_err(|e| {
                        tracing::error!("failed to sync store: {e}");
                        shared.poison(e);
                    })?;
                }
                Ok(())
            })
        });
        let took = started.elapsed();
        if let Ok(mut s) = stats.lock() {
            s.syncs += 1;
            s.batches += replies.len() as u64;
            s.commit_micros += took.as_micros() as u64;
            s.record_sync(took.saturating_sub(applied));
            s.max_group = s.max_group.max(replies.len() as u64);
        }
        for reply in replies {
            // A committer that stopped waiting (its request was dropped) needs no
            // answer; the write itself is done either way.
            if reply.send(result.clone()).is_err() {
                tracing::debug!("committer went away before its commit finished");
            }
        }
        if result.is_ok() {
            checkpoints.after_group(shared, stats);
        }
    }
}

impl Kv for SledKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.shared.with(|h| {
            h.db.get(key)
                .map(|o| o.map(|v| v.to_vec()))
                .map_err(|e| StoreError::Read(e.to_string()))
        })
    }

    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        self.shared.with(|h| {
            let range = h.db.range(start.to_vec()..end.to_vec());
            let map = |r: sled::Result<(sled::IVec, sled::IVec)>| {
                r.map(|(k, v)| (k.to_vec(), v.to_vec()))
                    .map_err(|e| StoreError::Read(e.to_string()))
            };
            if reverse {
                range.rev().take(limit).map(map).collect()
            } else {
                range.take(limit).map(map).collect()
            }
        })
    }

    fn commit(&self, batch: Batch) -> CommitTicket {
        queue(&self.tx, batch)
    }

    fn sync(&self) -> Result<(), StoreError> {
        self.shared.sync()
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

    /// Open the store in `dir` again after a `SledKv` on it was dropped (see
    /// `open_when_unlocked`).
    fn reopen_when_unlocked(dir: &Path, mode: SyncMode) -> SledKv {
        open_when_unlocked(|| SledKv::open(dir, mode)).expect("reopen")
    }

    /// Options that checkpoint after every MiB written, with `sync = always`.
    fn checkpoint_every_mib(patience: std::time::Duration) -> SledOptions {
        SledOptions {
            sync: SyncMode::Always,
            cache_mb: 8,
            checkpoint_mb: 1,
            checkpoint_patience: patience,
            background: true,
            values: false,
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

    /// Past `checkpoint_mb` of writes the writer closes and opens sled, which writes a
    /// newer snapshot; commits and reads from other threads go on working across it,
    /// and everything written is there after a reopen.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn checkpoints_write_snapshots_and_lose_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        // The reader below reads without a pause: only a checkpoint that waits for
        // reads gets the handle.
        let opts = checkpoint_every_mib(std::time::Duration::ZERO);
        let kv = Arc::new(SledKv::open_with(dir.path(), opts).expect("open"));
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
        let value = vec![7u8; 4000];
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
        let kv = Arc::new(SledKv::open(dir.path(), SyncMode::Never).expect("open"));
        // Stands for a checkpoint: the writer's exclusive hold of the handle.
        let held = kv.shared.handle.write().expect("handle lock");
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
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        let (tx, rx) = std::sync::mpsc::channel();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            tx.send(()).expect("test waits");
        });
        // Blocking on purpose: this test's own task must not be what keeps things going.
        let ran = rx.recv_timeout(std::time::Duration::from_secs(5));
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

    /// A checkpoint does not wait behind a long read (such as `store.check`'s scans):
    /// while a read holds the handle, commits go on and the checkpoint is deferred to
    /// after a later group.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_in_progress_defers_the_checkpoint_without_stalling_commits() {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = checkpoint_every_mib(std::time::Duration::from_secs(3600));
        let kv = Arc::new(SledKv::open_with(dir.path(), opts).expect("open"));
        let put = |i: u64| {
            let mut b = Batch::new();
            b.put_raw(keys::event("long", i), vec![1u8; 64 * 1024]);
            kv.commit(b)
        };
        let within = std::time::Duration::from_secs(10);
        // A long read, on its own thread: it holds the handle until told to stop.
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let reading = {
            let kv = kv.clone();
            std::thread::spawn(move || {
                let guard = kv.shared.handle.read().expect("handle lock");
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
        assert_eq!(kv.commit_stats().checkpoints, 0);
        release_tx.send(()).expect("reader waits");
        reading.join().expect("reader thread");
        tokio::time::timeout(within, put(40))
            .await
            .expect("commit")
            .expect("answered")
            .expect("committed");
        // The checkpoint runs after the group that follows the read.
        tokio::time::timeout(within, put(41))
            .await
            .expect("commit")
            .expect("answered")
            .expect("committed");
        assert_eq!(kv.commit_stats().checkpoints, 1);
    }

    /// A snapshot sled did not finish writing (the process was killed between
    /// creating `snap.<lsn>.generating` and renaming it) does not stop the store from
    /// opening, and every committed key is still there.
    #[tokio::test]
    async fn an_unfinished_snapshot_left_by_a_kill_does_not_stop_the_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let kv = SledKv::open(dir.path(), SyncMode::Always).expect("open");
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

    /// Blob files are synced when new or grown since their last sync, not again.
    #[test]
    fn blobs_are_synced_once_unless_they_grow() {
        use std::io::Write;
        let dir = tempfile::tempdir().expect("tempdir");
        let mut synced = HashMap::new();
        let blobs = dir.path().join("blobs");
        assert_eq!(sync_blobs(&blobs, &mut synced).expect("no dir yet"), 0);
        std::fs::create_dir(&blobs).expect("mkdir");
        let write = |name: &str, bytes: &[u8]| {
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(blobs.join(name))
                .expect("open");
            f.write_all(bytes).expect("write");
        };
        write("100", b"abc");
        write("200", b"defg");
        assert_eq!(sync_blobs(&blobs, &mut synced).expect("sync"), 2);
        assert_eq!(sync_blobs(&blobs, &mut synced).expect("sync"), 0);
        write("200", b"more"); // caught while being written: grows after its sync
        write("300", b"h");
        assert_eq!(sync_blobs(&blobs, &mut synced).expect("sync"), 2);
        std::fs::remove_file(blobs.join("100")).expect("rm");
        assert_eq!(sync_blobs(&blobs, &mut synced).expect("sync"), 0);
        assert_eq!(synced.len(), 2, "{synced:?}");
        assert_eq!(synced.get(std::ffi::OsStr::new("200")), Some(&8));
    }

    /// A failed sync or value file append makes every later sync of the database
    /// fail, also one that would succeed (Linux reports a failed write-back once
    /// and may have dropped the pages), until its owner has written its writes
    /// again and reopened it; a parked database is reopened by a later use after
    /// that, and syncs again.
    #[test]
    fn a_failed_sync_fails_every_sync_until_the_database_is_reopened() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = Shared::open(
            dir.path(),
            SledOptions {
                values: true,
                background: false,
                ..SledOptions::default()
            },
        )
        .expect("open");
        let sync = |s: &Shared| s.with(|h| s.sync_files(h));
        sync(&s).expect("a sync");
        s.note_failure();
        assert!(sync(&s).is_err(), "the failure is reported");
        assert!(sync(&s).is_err(), "and again, though the disk works");
        assert!(s.park().is_err(), "not parked while failed");
        s.reopen_after_failure().expect("reopen");
        sync(&s).expect("a sync after the reopen");
        assert!(s.park().expect("park"));
        s.note_failure();
        s.reopen_after_failure().expect("a parked database");
        sync(&s).expect("opened by its use, and syncs");
        assert_eq!(s.unparks(), 1);
    }
}
