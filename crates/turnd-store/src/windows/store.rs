//! The time windows of [`crate::LoggedKv`]: one sled database per window under
//! `DATA_DIR/windows/<start_ms>/`, routed by [`super::Table`]. See [`super`] for the
//! rules; this is how the sled store keeps them: made whole or not at all, opened
//! at a start (several at once), their caches sized by whether they take writes,
//! parked while unused, and deleted once their drop is durable.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use super::{Route, Slot, Table, WindowInfo, WindowOptions};
use crate::error::StoreError;
use crate::sled::{making_path, Shared, SledOptions, MAKING_SUFFIX};

/// MiB of sled cache of a window that takes no writes: with `retention.terminal_ms`
/// of 72 h and hourly windows about 73 are open at once, so a cache each of 4 MiB
/// could hold close to 300 MiB after reads of old turns; a miss is served by the
/// operating system's page cache. A window that takes the writes of live sessions
/// (the newest, and one made or opened while it does) has half of `storage.cache_mb`
/// instead ([`split_cache`]): it takes their turn list entries, events and
/// idempotency keys, spread over the keyspace by session, and with 1 MiB sled read
/// most of the leaves it changed back from its files (the applier's time per key
/// went from about 20 to 30 – 40 µs in a retention soak). It goes back to this once
/// idle ([`Windows::snapshot_idle`] opens it again).
const WINDOW_CACHE_MB: u64 = 1;

/// `storage.cache_mb` shared out: MiB of sled cache of the main database, and of a
/// window that takes writes. With windows the two take the writes of live sessions
/// between them (a session's meta and unfinished turns in the main database, its list
/// entries, events and idempotency keys in the window), so each has half, at least
/// [`WINDOW_CACHE_MB`]: with the whole budget each, 100,000 sessions with a queued
/// turn held 10 – 20 MB more than with one database. Without windows the main
/// database has all of it.
pub(crate) fn split_cache(cache_mb: u64, opts: &WindowOptions) -> (u64, u64) {
    if opts.window_ms == 0 {
        return (cache_mb, WINDOW_CACHE_MB);
    }
    let hot = (cache_mb / 2).max(WINDOW_CACHE_MB);
    (cache_mb.saturating_sub(hot).max(WINDOW_CACHE_MB), hot)
}

/// Keys written to a window with the small cache after which it is opened again with
/// the large one: retention deleting an old window's turns writes to it for about
/// `window_ms`, and a turn that ends late in it writes a handful of keys.
const WARM_KEYS: u64 = 4096;

/// Windows [`Windows::park_unused`] parks in one round at most: each syncs and
/// closes a sled database on the applier's thread, and a minute after a start every
/// window but the newest is due at once.
const PARKS_PER_ROUND: usize = 8;

pub(crate) struct Windows {
    dir: PathBuf,
    pub(crate) opts: WindowOptions,
    /// Options of an idle window's sled.
    sled: SledOptions,
    /// MiB of cache of a window that takes writes ([`split_cache`]).
    hot_cache_mb: u64,
    state: RwLock<State>,
    /// Reopens of parked windows since deleted ([`Windows::counts`]).
    unparked_before: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct State {
    table: Table,
    open: BTreeMap<u64, Arc<Shared>>,
    /// Dropped windows whose directories are still to delete (once their drops are
    /// durable): their files are expected on disk meanwhile.
    deleting: HashSet<u64>,
    /// Open windows whose sled has the small cache ([`WINDOW_CACHE_MB`]).
    small: HashSet<u64>,
    /// A window that could not be made and whose directory could not be removed yet
    /// (see [`Windows::switch_if_due`]).
    unmade: Option<u64>,
}

/// What [`Windows::switch_if_due`] did.
#[derive(Debug)]
pub(crate) enum Switch {
    /// Made the window of this start.
    Made(u64),
    NotDue,
    /// Could not make it, and nothing of it is left: tried again later.
    Failed(StoreError),
}

/// What the applier keeps about windows between rounds.
#[derive(Default)]
pub(crate) struct Upkeep {
    last_write: HashMap<u64, Instant>,
    snapshotted: HashSet<u64>,
    /// Keys written to each window with the small cache since it got it.
    small_writes: HashMap<u64, u64>,
}

/// Open the window of each start, on as many threads as there are cores: a start
/// opens every window, and sled's open of each reads its snapshot and the log
/// written after it, on one thread (with a few dozen windows of 256 MiB this was
/// most of the time from start to ready).
fn open_all<T: Send>(
    starts: &[u64],
    open: impl Fn(u64) -> Result<T, StoreError> + Sync,
) -> Result<Vec<(u64, T)>, StoreError> {
    let threads = std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .min(starts.len())
        .max(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let parts: Vec<Result<Vec<(u64, T)>, StoreError>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&start) = starts.get(i) else {
                            return Ok(out);
                        };
                        out.push((start, open(start)?));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(StoreError::Read("opening a window panicked".into())))
            })
            .collect()
    });
    let mut all = Vec::with_capacity(starts.len());
    for part in parts {
        all.extend(part?);
    }
    Ok(all)
}

/// The start of the window a directory named `name` was being made for
/// ([`Shared::make`]), if it is such a directory.
fn making_start(name: &str) -> Option<u64> {
    name.strip_suffix(MAKING_SUFFIX)?.parse().ok()
}

fn lock_err() -> StoreError {
    StoreError::Write("windows lock poisoned".into())
}

/// Bytes of the files under `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            _ => e.metadata().map(|m| m.len()).unwrap_or(0),
        })
        .sum()
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::Sync(format!("sync directory {dir:?}: {e}")))
}

impl Windows {
    /// Open every window directory under `data/windows`: those the main database
    /// records as dropped (`dropped`: start → lsn of the drop) are deleted, the others
    /// opened; when `lazy`, all but the newest are left parked ([`Shared::park`]),
    /// to be opened by their first use.
    pub(crate) fn open(
        data: &Path,
        opts: WindowOptions,
        sled: SledOptions,
        dropped: &BTreeMap<u64, u64>,
        lazy: bool,
    ) -> Result<Windows, StoreError> {
        let w = Windows {
            dir: data.join("windows"),
            opts,
            sled: SledOptions {
                cache_mb: WINDOW_CACHE_MB,
                checkpoint_mb: 0,
                values: true,
                ..sled
            },
            hot_cache_mb: sled.cache_mb.max(WINDOW_CACHE_MB),
            state: RwLock::new(State::default()),
            unparked_before: std::sync::atomic::AtomicU64::new(0),
        };
        let mut state = State::default();
        for (start, lsn) in dropped {
            state.table.slots.insert(*start, Slot::Dropped(*lsn));
        }
        if w.dir.exists() {
            let starts = w.window_dirs()?;
            let newest = starts
                .iter()
                .rev()
                .find(|s| !dropped.contains_key(s))
                .copied();
            let kept = w.remove_dropped(starts, dropped)?;
            w.open_kept(&mut state, &kept, newest, lazy)?;
        }
        tracing::debug!(
            "windows: open {:?}, dropped {:?}",
            state.open.keys().collect::<Vec<_>>(),
            dropped
        );
        *w.state.write().map_err(|_| lock_err())? = state;
        Ok(w)
    }

    /// The starts of the window directories, in order (a directory a crash left half
    /// made is removed).
    fn window_dirs(&self) -> Result<Vec<u64>, StoreError> {
        let entries = std::fs::read_dir(&self.dir)
            .map_err(|e| StoreError::Read(format!("list {:?}: {e}", self.dir)))?;
        let mut starts = Vec::new();
        for e in entries {
            let e = e.map_err(|e| StoreError::Read(format!("list {:?}: {e}", self.dir)))?;
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            if let Ok(start) = name.parse::<u64>() {
                starts.push(start);
            } else if let Some(start) = making_start(name) {
                // A window whose making a crash cut: it never took a key.
                tracing::info!("removing the time window {start} a crash left half made");
                self.remove_dir(start)?;
            }
        }
        starts.sort_unstable();
        Ok(starts)
    }

    /// Delete the directories of windows whose drop is durable in the main database
    /// (a crash cut their deletion); returns the others.
    fn remove_dropped(
        &self,
        starts: Vec<u64>,
        dropped: &BTreeMap<u64, u64>,
    ) -> Result<Vec<u64>, StoreError> {
        let mut kept = Vec::new();
        for start in starts {
            if dropped.contains_key(&start) {
                self.remove_dir(start)?;
            } else {
                kept.push(start);
            }
        }
        Ok(kept)
    }

    /// Open the windows of `kept` into `state`: the newest (and, unless `lazy`, every
    /// one) now, on several threads, the others parked.
    fn open_kept(
        &self,
        state: &mut State,
        kept: &[u64],
        newest: Option<u64>,
        lazy: bool,
    ) -> Result<(), StoreError> {
        let (now, later): (Vec<u64>, Vec<u64>) =
            kept.iter().partition(|s| !lazy || Some(**s) == newest);
        let mut opened = open_all(&now, |start| {
            let hot = Some(start) == newest;
            Shared::open(&self.dir.join(start.to_string()), self.opened(hot))
        })?;
        for start in later {
            let dir = self.dir.join(start.to_string());
            opened.push((start, Shared::open_parked(&dir, self.opened(false))?));
        }
        for (start, shared) in opened {
            if Some(start) != newest {
                state.small.insert(start);
            }
            state.table.slots.insert(start, Slot::Open);
            state.open.insert(start, Arc::new(shared));
        }
        Ok(())
    }

    /// A window's sled options: the newest (which takes writes) with the main
    /// database's cache and sled's flusher thread, any other with [`WINDOW_CACHE_MB`]
    /// and no flusher ([`SledOptions::background`]).
    fn opened(&self, newest: bool) -> SledOptions {
        SledOptions {
            cache_mb: if newest {
                self.hot_cache_mb
            } else {
                WINDOW_CACHE_MB
            },
            background: newest,
            ..self.sled
        }
    }

    /// Remove a window's directory, and the one it was made in if a make was cut.
    fn remove_dir(&self, start: u64) -> Result<(), StoreError> {
        let path = self.dir.join(start.to_string());
        for path in [making_path(&path), path] {
            match std::fs::remove_dir_all(&path) {
                Ok(()) => sync_dir(&self.dir)?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(StoreError::Write(format!("remove {path:?}: {e}"))),
            }
        }
        Ok(())
    }

    /// Where a key goes.
    pub(crate) fn route(&self, key: &[u8]) -> Route {
        match self.state.read() {
            Ok(s) => s.table.route(key),
            Err(_) => Route::Main,
        }
    }

    /// The open window a read of `key` goes to (None: the main database).
    pub(crate) fn reader(&self, key: &[u8]) -> Option<Arc<Shared>> {
        let s = self.state.read().ok()?;
        let Route::Window(start) = s.table.route(key) else {
            return None;
        };
        s.open.get(&start).cloned()
    }

    /// The open windows that can hold keys of `[start, end)`: for folded records,
    /// those whose turn ids meet the range; for a session's routed keys, those that
    /// end after `session_from` (its meta's `routed_from_ms`; None: no window).
    pub(crate) fn readers_in(
        &self,
        start: &[u8],
        end: &[u8],
        session_from: Option<u64>,
    ) -> Vec<Arc<Shared>> {
        let Ok(s) = self.state.read() else {
            return Vec::new();
        };
        let folded = start < &b"G"[..] && &b"F"[..] < end;
        let from = session_from.filter(|_| crate::model::keys::meets_routed(start, end));
        let list = s.table.list(|_| 0);
        list.iter()
            .filter(|w| !w.dropped)
            .filter(|w| {
                let (ws, we) = super::finished_key_range(w.start_ms, w.end_ms);
                let ids = folded && ws.as_slice() < end && start < we.as_slice();
                let session = from.is_some_and(|f| w.end_ms.is_none_or(|e| e > f));
                ids || session
            })
            .filter_map(|w| s.open.get(&w.start_ms).cloned())
            .collect()
    }

    /// The open window starting at `start`.
    pub(crate) fn get(&self, start: u64) -> Option<Arc<Shared>> {
        self.state.read().ok()?.open.get(&start).cloned()
    }

    /// Every open window.
    pub(crate) fn all_open(&self) -> Vec<(u64, Arc<Shared>)> {
        match self.state.read() {
            Ok(s) => s.open.iter().map(|(k, v)| (*k, v.clone())).collect(),
            Err(_) => Vec::new(),
        }
    }

    /// Start a new window when the newest is too old or too large (see
    /// [`Table::due`]).
    ///
    /// A window whose sled cannot be opened (a full or failing disk) must leave
    /// nothing behind: at the next start every directory under `windows/` is a
    /// window, and one left by a failed try would take the keys of its time from the
    /// window they are written to meanwhile, so that they would read as missing. Its
    /// directory is removed; while it cannot be, this returns an error and nothing is
    /// to be written to the windows.
    pub(crate) fn switch_if_due(&self) -> Result<Switch, StoreError> {
        self.remove_unmade()?;
        let now = super::now_ms();
        let newest = {
            let s = self.state.read().map_err(|_| lock_err())?;
            s.table.newest()
        };
        let bytes = match newest {
            Some(start) => dir_bytes(&self.dir.join(start.to_string())),
            None => 0,
        };
        let start = {
            let s = self.state.read().map_err(|_| lock_err())?;
            if !s.table.due(&self.opts, now, bytes) {
                return Ok(Switch::NotDue);
            }
            s.table.next_start(now)
        };
        let fresh = !self.dir.exists();
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| StoreError::Write(format!("create {:?}: {e}", self.dir)))?;
        if fresh {
            if let Some(parent) = self.dir.parent() {
                sync_dir(parent)?;
            }
        }
        // Made whole or not at all (a crash leaves at most the making directory),
        // its entry in `windows/` synced before any record is routed to it.
        let made = Shared::make(&self.dir.join(start.to_string()), self.opened(true));
        let shared = match made {
            Ok(shared) => shared,
            Err(e) => {
                self.state.write().map_err(|_| lock_err())?.unmade = Some(start);
                self.remove_unmade()?;
                return Ok(Switch::Failed(e));
            }
        };
        let mut s = self.state.write().map_err(|_| lock_err())?;
        s.table.slots.insert(start, Slot::Open);
        s.open.insert(start, Arc::new(shared));
        tracing::debug!("made the time window {start}");
        Ok(Switch::Made(start))
    }

    /// Remove the directory of a window that could not be made, if there is one.
    fn remove_unmade(&self) -> Result<(), StoreError> {
        let Some(start) = self.state.read().map_err(|_| lock_err())?.unmade else {
            return Ok(());
        };
        self.remove_dir(start).map_err(|e| {
            StoreError::Write(format!(
                "the time window {start} could not be made and its directory is still there: {e}"
            ))
        })?;
        self.state.write().map_err(|_| lock_err())?.unmade = None;
        Ok(())
    }

    /// Record a committed drop (by the record `lsn`), once what the window held is in
    /// the main database: from now on its keys are read and written there. Returns
    /// the window's database to close once the drop is durable.
    pub(crate) fn mark_dropped(
        &self,
        start: u64,
        lsn: u64,
    ) -> Result<Option<Arc<Shared>>, StoreError> {
        let mut s = self.state.write().map_err(|_| lock_err())?;
        if let Some(Slot::Dropped(_)) = s.table.slots.get(&start) {
            return Ok(None);
        }
        if !s.table.slots.contains_key(&start) {
            // Not a window of this store: routing stays what it was.
            return Ok(None);
        }
        s.table.slots.insert(start, Slot::Dropped(lsn));
        s.deleting.insert(start);
        tracing::debug!("took the drop of the time window {start} (record {lsn})");
        let w = s.open.remove(&start);
        if let Some(w) = &w {
            self.unparked_before
                .fetch_add(w.unparks(), std::sync::atomic::Ordering::Relaxed);
        }
        Ok(w)
    }

    /// Close a dropped window's database and delete its directory (after its drop is
    /// durable in the main database).
    pub(crate) fn delete(&self, start: u64, shared: Arc<Shared>) -> Result<(), StoreError> {
        shared.close();
        drop(shared);
        self.remove_dir(start)?;
        if let Ok(mut s) = self.state.write() {
            s.deleting.remove(&start);
        }
        Ok(())
    }

    /// The end of the window starting at `start` (the next one's start; None: the
    /// newest, or not a window).
    pub(crate) fn end_of(&self, start: u64) -> Option<u64> {
        self.state.read().ok()?.table.end_of(start)
    }

    /// The windows, with the bytes of their files (none counted for a dropped window
    /// whose deletion is under way).
    pub(crate) fn list(&self) -> Vec<WindowInfo> {
        match self.state.read() {
            Ok(s) => s.table.list(|start| {
                if s.deleting.contains(&start) {
                    0
                } else {
                    dir_bytes(&self.dir.join(start.to_string()))
                }
            }),
            Err(_) => Vec::new(),
        }
    }

    /// Note a write of `keys` keys to a window.
    pub(crate) fn written(&self, upkeep: &mut Upkeep, start: u64, keys: u64) {
        upkeep.last_write.insert(start, Instant::now());
        upkeep.snapshotted.remove(&start);
        if self.state.read().is_ok_and(|s| s.small.contains(&start)) {
            *upkeep.small_writes.entry(start).or_default() += keys;
        }
    }

    /// Open again with the large cache each window with the small one that took
    /// [`WARM_KEYS`] keys since (an old window whose turns retention deletes).
    pub(crate) fn warm_written(&self, upkeep: &mut Upkeep) {
        let due: Vec<u64> = upkeep
            .small_writes
            .iter()
            .filter(|(_, n)| **n >= WARM_KEYS)
            .map(|(s, _)| *s)
            .collect();
        for start in due {
            match self.get(start) {
                Some(shared) => {
                    self.reopen(upkeep, start, &shared, true);
                }
                None => {
                    upkeep.small_writes.remove(&start);
                }
            }
        }
    }

    /// Close and open a window's sled again, with the large cache (`hot`) or the small
    /// one. Returns whether it was (false: it could not be closed now, or failed).
    fn reopen(&self, upkeep: &mut Upkeep, start: u64, shared: &Shared, hot: bool) -> bool {
        shared.open_next_as(&self.opened(hot));
        match shared.checkpoint(false) {
            Ok(true) => {
                upkeep.small_writes.remove(&start);
                if let Ok(mut s) = self.state.write() {
                    if hot {
                        s.small.remove(&start);
                    } else {
                        s.small.insert(start);
                    }
                }
                true
            }
            Ok(false) => false,
            Err(e) => {
                tracing::warn!("reopening window {start} failed: {e}");
                false
            }
        }
    }

    /// Park ([`Shared::park`]) each window that no read or write used for `after`,
    /// once it was opened again since its last write (so that it has its snapshot and
    /// opens fast when next needed), but for the newest, which takes the writes of
    /// live sessions.
    pub(crate) fn park_unused(&self, upkeep: &Upkeep, after: Duration) {
        let newest = self.state.read().ok().and_then(|s| s.table.newest());
        let mut parked = 0;
        for (start, shared) in self.all_open() {
            if parked == PARKS_PER_ROUND {
                break;
            }
            if Some(start) == newest
                || !upkeep.snapshotted.contains(&start)
                || shared.is_parked()
                || shared.unused_for() < after
            {
                continue;
            }
            match shared.park() {
                Ok(true) => {
                    parked += 1;
                    tracing::debug!("parked the time window {start}");
                }
                Ok(false) => {}
                Err(e) => tracing::warn!("parking the time window {start} failed: {e}"),
            }
        }
    }

    /// How many windows are parked now, and how many times a parked window was
    /// opened again by a read or write.
    pub(crate) fn counts(&self) -> (u64, u64) {
        // Under the lock [`Windows::mark_dropped`] moves a window's count with, so
        // that no window is counted twice or not at all.
        let Ok(s) = self.state.read() else {
            return (0, 0);
        };
        let parked = s.open.values().filter(|w| w.is_parked()).count() as u64;
        let reopens = self
            .unparked_before
            .load(std::sync::atomic::Ordering::Relaxed)
            + s.open.values().map(|w| w.unparks()).sum::<u64>();
        (parked, reopens)
    }

    /// Reopen each window that took no write for `idle` since it was last written
    /// (or opened), once: sled writes its snapshot only when it opens a store, so a
    /// later start opens it fast, and the memory its cache and tables grew to while
    /// it took writes goes back. The newest window too, once writes pause.
    pub(crate) fn snapshot_idle(&self, upkeep: &mut Upkeep, idle: Duration) {
        let newest = self.state.read().ok().and_then(|s| s.table.newest());
        for (start, shared) in self.all_open() {
            if upkeep.snapshotted.contains(&start) {
                continue;
            }
            let idle = upkeep
                .last_write
                .get(&start)
                .is_none_or(|t| t.elapsed() >= idle);
            if !idle {
                continue;
            }
            // Opened again with the cache of a window that takes no writes, but for
            // the newest, which takes them again once writes resume.
            if self.reopen(upkeep, start, &shared, Some(start) == newest) {
                upkeep.snapshotted.insert(start);
                upkeep.last_write.remove(&start);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every window is opened once, whatever thread opens it, and a failed open fails
    /// the whole start.
    #[test]
    fn windows_open_on_several_threads_each_once_and_a_failure_fails_all() {
        let starts: Vec<u64> = (1..=9).collect();
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let mut opened = open_all(&starts, |s| {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(s * 10)
        })
        .expect("opened");
        opened.sort_unstable();
        let want: Vec<(u64, u64)> = starts.iter().map(|s| (*s, s * 10)).collect();
        assert_eq!(opened, want);
        assert_eq!(
            calls.load(std::sync::atomic::Ordering::Relaxed),
            starts.len()
        );
        let failed = open_all(&starts, |s| {
            if s == 7 {
                Err(StoreError::Read("window 7".into()))
            } else {
                Ok(s)
            }
        });
        assert!(matches!(failed, Err(StoreError::Read(m)) if m == "window 7"));
        assert!(open_all(&[], Ok::<u64, StoreError>)
            .expect("none")
            .is_empty());
    }

    /// A window is made whole or not at all. What a crash can leave of a make is its
    /// making directory (`<start>.new`), which the next start removes; the same
    /// half-made directory under a window's own name would fail that start, since
    /// sled refuses a `conf` cut short.
    #[test]
    fn a_window_cut_while_being_made_is_removed_at_start() {
        let data = tempfile::tempdir().expect("tempdir");
        let opts = WindowOptions {
            window_ms: 1,
            ..WindowOptions::default()
        };
        let open = || {
            Windows::open(
                data.path(),
                opts,
                SledOptions::default(),
                &BTreeMap::new(),
                false,
            )
        };
        let w = open().expect("open");
        let Switch::Made(start) = w.switch_if_due().expect("switch") else {
            panic!("no window made");
        };
        let dir = data.path().join("windows");
        let made = dir.join(start.to_string());
        assert!(made.join("conf").is_file() && made.join("db").is_file());
        assert!(
            !making_path(&made).exists(),
            "the making directory was renamed"
        );
        drop(w);

        // sled's open of a new directory writes `conf` in two writes (text, then its
        // CRC); a crash between them leaves this.
        let cut = start + 10;
        let half_made = |path: &Path| {
            std::fs::create_dir_all(path).expect("mkdir");
            std::fs::write(path.join("conf"), "segment_size: 524288\n").expect("conf");
        };
        let named = dir.join("refused");
        half_made(&named);
        assert!(
            Shared::open(&named, SledOptions::default()).is_err(),
            "sled opens a cut conf"
        );
        std::fs::remove_dir_all(&named).expect("rm");
        half_made(&making_path(&dir.join(cut.to_string())));

        let w = open().expect("a start after a cut make");
        let starts: Vec<u64> = w.list().iter().map(|i| i.start_ms).collect();
        assert_eq!(starts, vec![start]);
        let left: Vec<String> = std::fs::read_dir(&dir)
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            left,
            vec![start.to_string()],
            "only the whole window is left"
        );
    }

    /// `storage.cache_mb` is shared by the main database and the window that takes
    /// writes, each at least 1 MiB; without windows the main database has it all.
    #[test]
    fn the_cache_budget_is_halved_between_the_main_database_and_the_newest_window() {
        let on = WindowOptions::default();
        let off = WindowOptions {
            window_ms: 0,
            ..WindowOptions::default()
        };
        assert_eq!(split_cache(8, &on), (4, 4));
        assert_eq!(split_cache(9, &on), (5, 4));
        assert_eq!(split_cache(1, &on), (1, 1));
        assert_eq!(split_cache(8, &off), (8, WINDOW_CACHE_MB));
    }
}
