//! One sled database's handle ([`Shared`]): opened, parked (closed until its next
//! use), made whole or not at all, checkpointed, reopened after a failure and closed
//! for good, with the durability of its files and, for a time window's, the value
//! file its large values live in.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, RwLock, TryLockError};
use std::time::{Duration, Instant};

use super::files::{making_path, remove_unfinished_snapshots, sync_blobs, sync_dir, sync_tree};
use super::values::ValueFile;
use super::{blocking, open_when_unlocked, SledOptions, FLUSH_EVERY_MS};
use crate::error::{IoOp, StoreError};

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

/// One sled database, shared by its writer (the applier), its readers and its upkeep.
pub(crate) struct Shared {
    /// `None` only after a checkpoint failed to open the store again.
    handle: RwLock<Option<Handle>>,
    dir: PathBuf,
    pub(super) opts: SledOptions,
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

    /// The lock over the handle, to hold it as a checkpoint or a long read would
    /// (tests only).
    #[cfg(test)]
    pub(crate) fn handle_lock(&self) -> &RwLock<Option<Handle>> {
        &self.handle
    }

    /// Open (or create) sled in `dir`.
    pub(crate) fn open(dir: &Path, opts: SledOptions) -> Result<Shared, StoreError> {
        std::fs::create_dir_all(dir).map_err(|e| {
            StoreError::io(IoOp::Write, format_args!("create data dir {dir:?}"), &e)
        })?;
        let handle = Handle::open(dir, &opts)?;
        // sled writes `conf` (in two writes) when it makes a store, or finds it empty,
        // and never syncs it; one torn by a power loss fails every later open.
        std::fs::File::open(dir.join("conf"))
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
    /// the value it names: the form the commit path unpacks.
    pub(crate) fn stored<'v>(&self, v: &'v [u8]) -> Result<Cow<'v, [u8]>, StoreError> {
        if !super::values::is_pointer(v) {
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
    /// next open replays only what was written after this one. Runs on the applier
    /// thread between rounds; readers wait for it. Unless `wait`, a read in progress
    /// (a long scan such as `store.check`) makes it give way, `Ok(false)`, rather
    /// than stall every read and apply behind that read.
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
