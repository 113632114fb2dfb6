//! An in-memory [`Kv`] over a `BTreeMap`: every commit is applied at once and
//! atomically, and its ticket is resolved when returned. Nothing is durable. For
//! engine tests on paused time, fuzzing and benchmarks of everything but the disk.
//!
//! It keeps the time windows of finished turns as the sled store does (see
//! [`crate::windows`]): the same table, the same switch policy (by the wall clock
//! and the bytes of the keys routed to it, checked when turns are admitted or
//! finished), and a committed drop marks the window dropped.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use super::{CommitTicket, Kv};
use crate::error::StoreError;
use crate::model::keys::{self, Entry};
use crate::model::{Batch, KvOp};
use crate::stats::CommitStats;
use crate::windows::{self, Route, Slot, Table, WindowInfo, WindowOptions};

#[derive(Default)]
struct State {
    map: BTreeMap<Vec<u8>, Vec<u8>>,
    table: Table,
    /// Bytes of records written to each open window.
    bytes: HashMap<u64, u64>,
    /// Keys a window still held when it was dropped.
    leftovers: u64,
}

#[derive(Default)]
pub struct MemKv {
    state: Mutex<State>,
    opts: WindowOptions,
    stats: Mutex<CommitStats>,
}

impl MemKv {
    pub fn new() -> MemKv {
        MemKv::default()
    }

    /// With windows made by `opts`.
    pub fn with_windows(opts: WindowOptions) -> MemKv {
        MemKv {
            opts,
            ..MemKv::default()
        }
    }

    fn poisoned() -> StoreError {
        StoreError::Read("in-memory store lock poisoned".into())
    }
}

impl State {
    fn apply(&mut self, batch: Batch, opts: &WindowOptions) {
        let now = windows::now_ms();
        let newest = self
            .table
            .newest()
            .map_or(0, |s| self.bytes.get(&s).copied().unwrap_or(0));
        // As in the sled store: when turns are admitted or finished.
        let turns = batch
            .ops
            .iter()
            .any(|op| matches!(op, KvOp::Put(k, _) if matches!(k.first(), Some(b'F' | b'L'))));
        if turns && self.table.due(opts, now, newest) {
            let start = self.table.next_start(now);
            self.table.slots.insert(start, Slot::Open);
        }
        for op in batch.ops {
            match op {
                KvOp::Put(k, v) => {
                    if let Some(start) = keys::dropped_start(&k) {
                        self.drop_window(start);
                    } else if let Route::Window(s) = self.table.route(&k) {
                        *self.bytes.entry(s).or_default() += (k.len() + v.len()) as u64;
                    }
                    self.map.insert(k, v);
                }
                KvOp::Delete(k) => {
                    self.map.remove(&k);
                }
            }
        }
    }

    /// A committed drop: the window is gone with what it holds, but for what belongs
    /// to turns still stored ([`windows::leftovers`]), which stays readable (the sled
    /// store moves it to its main database) and is counted.
    fn drop_window(&mut self, start: u64) {
        if !matches!(self.table.slots.get(&start), Some(Slot::Open)) {
            return;
        }
        let table = &self.table;
        let held: Vec<Vec<u8>> = self
            .map
            .keys()
            .filter(|k| table.route(k) == Route::Window(start))
            .cloned()
            .collect();
        let map = &self.map;
        let mut read = |s: &[u8], e: &[u8]| -> Result<Vec<Entry>, StoreError> {
            Ok(map
                .range(s.to_vec()..e.to_vec())
                .filter(|(k, _)| table.route(k) == Route::Window(start))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect())
        };
        let decode = |v: &[u8]| Ok(v.to_vec());
        let mut read_main = |s: &[u8], e: &[u8]| -> Result<Vec<Entry>, StoreError> {
            Ok(map
                .range(s.to_vec()..e.to_vec())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect())
        };
        // The in-memory store holds only records it was given whole, and decodes
        // nothing, so this cannot fail.
        let kept: std::collections::HashSet<Vec<u8>> =
            windows::unfinished_turns(&mut read_main, &decode, start, table.end_of(start))
                .and_then(|unfinished| windows::leftovers(&mut read, &decode, &unfinished))
                .map(|l| l.into_iter().map(|(k, _)| k).collect())
                .unwrap_or_default();
        for k in held {
            if !kept.contains(&k) {
                self.map.remove(&k);
            }
        }
        self.leftovers += kept.len() as u64;
        self.table.slots.insert(start, Slot::Dropped(0));
        self.bytes.remove(&start);
    }
}

impl Kv for MemKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let s = self.state.lock().map_err(|_| Self::poisoned())?;
        Ok(s.map.get(key).cloned())
    }

    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        // An empty or inverted range yields nothing (BTreeMap::range would panic).
        if start >= end {
            return Ok(Vec::new());
        }
        let s = self.state.lock().map_err(|_| Self::poisoned())?;
        let range = s.map.range(start.to_vec()..end.to_vec());
        let entry = |(k, v): (&Vec<u8>, &Vec<u8>)| (k.clone(), v.clone());
        Ok(if reverse {
            range.rev().take(limit).map(entry).collect()
        } else {
            range.take(limit).map(entry).collect()
        })
    }

    fn commit(&self, batch: Batch) -> CommitTicket {
        let result = match self.state.lock() {
            Ok(mut s) => {
                s.apply(batch, &self.opts);
                if let Ok(mut s) = self.stats.lock() {
                    s.syncs += 1;
                    s.batches += 1;
                    s.record_sync(std::time::Duration::ZERO);
                    s.max_group = s.max_group.max(1);
                }
                Ok(())
            }
            Err(_) => Err(StoreError::Write("in-memory store lock poisoned".into())),
        };
        CommitTicket::answered(result)
    }

    fn sync(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn commit_stats(&self) -> CommitStats {
        let mut s = self.stats.lock().map(|s| s.clone()).unwrap_or_default();
        if let Ok(st) = self.state.lock() {
            s.window_leftovers = st.leftovers;
        }
        s
    }

    fn windows(&self) -> Result<Vec<WindowInfo>, StoreError> {
        let s = self.state.lock().map_err(|_| Self::poisoned())?;
        Ok(s.table
            .list(|start| s.bytes.get(&start).copied().unwrap_or(0)))
    }
}

/// For tests: a [`MemKv`] that commits a batch given to [`CommitsAfterRead::arm`]
/// right after the next read it answers, as a writer whose commit falls between two
/// reads of a reader.
#[cfg(test)]
pub(crate) struct CommitsAfterRead {
    inner: MemKv,
    armed: Mutex<Option<Batch>>,
}

#[cfg(test)]
impl CommitsAfterRead {
    pub(crate) fn new() -> CommitsAfterRead {
        CommitsAfterRead {
            inner: MemKv::new(),
            armed: Mutex::new(None),
        }
    }

    /// Commit `batch` right after the next `get` has read.
    pub(crate) fn arm(&self, batch: Batch) {
        *self.armed.lock().expect("lock") = Some(batch);
    }
}

#[cfg(test)]
impl Kv for CommitsAfterRead {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let got = self.inner.get(key)?;
        let armed = self.armed.lock().expect("lock").take();
        if let Some(b) = armed {
            // MemKv applies a batch as it is queued.
            drop(self.inner.commit(b));
        }
        Ok(got)
    }
    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        self.inner.scan(start, end, reverse, limit)
    }
    fn commit(&self, batch: Batch) -> CommitTicket {
        self.inner.commit(batch)
    }
    fn sync(&self) -> Result<(), StoreError> {
        self.inner.sync()
    }
}
