//! An in-memory [`Kv`] over a `BTreeMap`: every commit is applied at once and
//! atomically, and its ticket is resolved when returned. Nothing is durable. For
//! engine tests on paused time, fuzzing and benchmarks of everything but the disk.

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::{Batch, CommitStats, CommitTicket, Entry, Kv, KvOp, StoreError};

#[derive(Default)]
pub struct MemKv {
    map: Mutex<BTreeMap<Vec<u8>, Vec<u8>>>,
    stats: Mutex<CommitStats>,
}

impl MemKv {
    pub fn new() -> MemKv {
        MemKv::default()
    }

    fn poisoned() -> StoreError {
        StoreError::Read("in-memory store lock poisoned".into())
    }
}

impl Kv for MemKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let m = self.map.lock().map_err(|_| Self::poisoned())?;
        Ok(m.get(key).cloned())
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
        let m = self.map.lock().map_err(|_| Self::poisoned())?;
        let range = m.range(start.to_vec()..end.to_vec());
        let entry = |(k, v): (&Vec<u8>, &Vec<u8>)| (k.clone(), v.clone());
        Ok(if reverse {
            range.rev().take(limit).map(entry).collect()
        } else {
            range.take(limit).map(entry).collect()
        })
    }

    fn commit(&self, batch: Batch) -> CommitTicket {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let result = match self.map.lock() {
            Ok(mut m) => {
                for op in batch.ops {
                    match op {
                        KvOp::Put(k, v) => {
                            m.insert(k, v);
                        }
                        KvOp::Delete(k) => {
                            m.remove(&k);
                        }
                    }
                }
                if let Ok(mut s) = self.stats.lock() {
                    s.syncs += 1;
                    s.batches += 1;
                    s.max_group = s.max_group.max(1);
                }
                Ok(())
            }
            Err(_) => Err(StoreError::Write("in-memory store lock poisoned".into())),
        };
        if tx.send(result).is_err() {
            tracing::trace!("committer went away");
        }
        rx
    }

    fn sync(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn commit_stats(&self) -> CommitStats {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }
}
