//! The time windows of [`crate::LoggedKv`]: one sled database per window under
//! `DATA_DIR/windows/<start_ms>/`, routed by [`crate::windows::Table`]. See
//! [`crate::windows`] for the rules; this is how the sled store keeps them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::sled_kv::{Shared, SledOptions};
use crate::windows::{self, Route, Slot, Table, WindowInfo, WindowOptions};
use crate::StoreError;

/// MiB of sled cache per window: windows are written once per finished turn and read
/// for finished turns only, and with `retention.terminal_ms` of 72 h and hourly
/// windows about 73 are open at once, so a cache each of 4 MiB (the earlier size)
/// could hold close to 300 MiB after reads of old turns; a miss is served by the
/// operating system's page cache.
const WINDOW_CACHE_MB: u64 = 1;

pub(crate) struct Windows {
    dir: PathBuf,
    pub(crate) opts: WindowOptions,
    sled: SledOptions,
    state: RwLock<State>,
}

#[derive(Default)]
struct State {
    table: Table,
    open: BTreeMap<u64, Arc<Shared>>,
    /// Dropped windows whose directories are still to delete (once their drops are
    /// durable): their files are expected on disk meanwhile.
    deleting: HashSet<u64>,
}

/// What the applier keeps about windows between rounds.
#[derive(Default)]
pub(crate) struct Upkeep {
    last_write: HashMap<u64, Instant>,
    snapshotted: HashSet<u64>,
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
    /// opened.
    pub(crate) fn open(
        data: &Path,
        opts: WindowOptions,
        sled: SledOptions,
        dropped: &BTreeMap<u64, u64>,
    ) -> Result<Windows, StoreError> {
        let dir = data.join("windows");
        let mut state = State::default();
        for (start, lsn) in dropped {
            state.table.slots.insert(*start, Slot::Dropped(*lsn));
        }
        let w = Windows {
            dir,
            opts,
            sled: SledOptions {
                cache_mb: WINDOW_CACHE_MB,
                checkpoint_mb: 0,
                ..sled
            },
            state: RwLock::new(State::default()),
        };
        if w.dir.exists() {
            let entries = std::fs::read_dir(&w.dir)
                .map_err(|e| StoreError::Read(format!("list {:?}: {e}", w.dir)))?;
            for e in entries {
                let e = e.map_err(|e| StoreError::Read(format!("list {:?}: {e}", w.dir)))?;
                let Some(start) = e.file_name().to_str().and_then(|n| n.parse::<u64>().ok()) else {
                    continue;
                };
                if dropped.contains_key(&start) {
                    // A drop durable in the main database whose deletion a crash cut.
                    w.remove_dir(start)?;
                    continue;
                }
                let shared = Shared::open(&e.path(), w.sled)?;
                state.table.slots.insert(start, Slot::Open);
                state.open.insert(start, Arc::new(shared));
            }
        }
        tracing::debug!(
            "windows: open {:?}, dropped {:?}",
            state.open.keys().collect::<Vec<_>>(),
            dropped
        );
        *w.state.write().map_err(|_| lock_err())? = state;
        Ok(w)
    }

    fn remove_dir(&self, start: u64) -> Result<(), StoreError> {
        let path = self.dir.join(start.to_string());
        match std::fs::remove_dir_all(&path) {
            Ok(()) => sync_dir(&self.dir),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::Write(format!("remove {path:?}: {e}"))),
        }
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

    /// The open windows whose keys meet `[start, end)`.
    pub(crate) fn readers_in(&self, start: &[u8], end: &[u8]) -> Vec<Arc<Shared>> {
        let Ok(s) = self.state.read() else {
            return Vec::new();
        };
        let list = s.table.list(|_| 0);
        list.iter()
            .filter(|w| !w.dropped)
            .filter(|w| {
                let (ws, we) = windows::finished_key_range(w.start_ms, w.end_ms);
                ws.as_slice() < end && start < we.as_slice()
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
    /// [`Table::due`]). Returns its start.
    pub(crate) fn switch_if_due(&self) -> Result<Option<u64>, StoreError> {
        let now = windows::now_ms();
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
                return Ok(None);
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
        // `Shared::open` creates the directory and syncs it; its entry in `windows/`
        // is synced here, before any record is routed to it.
        let shared = Shared::open(&self.dir.join(start.to_string()), self.sled)?;
        sync_dir(&self.dir)?;
        let mut s = self.state.write().map_err(|_| lock_err())?;
        s.table.slots.insert(start, Slot::Open);
        s.open.insert(start, Arc::new(shared));
        tracing::debug!("made the time window {start}");
        Ok(Some(start))
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
        Ok(s.open.remove(&start))
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

    /// Note a write to a window.
    pub(crate) fn written(&self, upkeep: &mut Upkeep, start: u64) {
        upkeep.last_write.insert(start, Instant::now());
        upkeep.snapshotted.remove(&start);
    }

    /// Reopen each window that took no write for `idle` since it was last written
    /// (or opened), once: sled writes its snapshot only when it opens a store, so a
    /// later start opens it fast, and the memory its cache and tables grew to while
    /// it took writes goes back. The newest window too, once writes pause.
    pub(crate) fn snapshot_idle(&self, upkeep: &mut Upkeep, idle: Duration) {
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
            match shared.checkpoint(false) {
                Ok(true) => {
                    upkeep.snapshotted.insert(start);
                    upkeep.last_write.remove(&start);
                }
                Ok(false) => {}
                Err(e) => tracing::warn!("reopening window {start} failed: {e}"),
            }
        }
    }
}
