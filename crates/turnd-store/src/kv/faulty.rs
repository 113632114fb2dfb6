//! A fault-injecting [`Kv`] wrapper for tests: fail the Nth write, fail every write
//! for a while, fail the sync, fail reads. The daemon can be started on it, so tests
//! drive the real engine into storage faults at chosen cuts.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use super::{CommitTicket, Kv};
use crate::error::StoreError;
use crate::model::keys::Entry;
use crate::model::{Batch, KvOp};
use crate::stats::CommitStats;
use crate::windows::WindowInfo;

/// Switches shared between a test and the [`FaultyKv`] it wrapped.
#[derive(Debug, Default)]
pub struct Faults {
    /// Fail every write while set.
    pub fail_writes: AtomicBool,
    /// Fail every read while set.
    pub fail_reads: AtomicBool,
    /// Report the store as behind ([`Kv::busy`]) while set.
    pub busy: AtomicBool,
    /// Fail the commit numbered this (1-based, counted from the last `fail_nth`), once.
    fail_at: AtomicU64,
    commits: AtomicU64,
    /// Commits refused so far.
    pub refused: AtomicU64,
    /// Fail commits whose batch contains this byte string (in any key or value),
    /// while `matching_left` is positive: a chosen cut such as the batch that holds a
    /// `"kind":"dispatched"` event.
    matching: std::sync::Mutex<Option<Vec<u8>>>,
    matching_left: AtomicU64,
}

impl Faults {
    /// Fail the `n`th commit from now (1 = the next one).
    pub fn fail_nth(&self, n: u64) {
        self.fail_at
            .store(self.commits.load(Ordering::SeqCst) + n, Ordering::SeqCst);
    }

    pub fn set_fail_writes(&self, on: bool) {
        self.fail_writes.store(on, Ordering::SeqCst);
    }

    pub fn set_fail_reads(&self, on: bool) {
        self.fail_reads.store(on, Ordering::SeqCst);
    }

    /// Fail the next `times` commits whose batch contains `needle`.
    pub fn fail_matching(&self, needle: &[u8], times: u64) {
        if let Ok(mut m) = self.matching.lock() {
            *m = Some(needle.to_vec());
        }
        self.matching_left.store(times, Ordering::SeqCst);
    }

    /// Commits whose batch matched and that are still to be failed.
    pub fn matching_left(&self) -> u64 {
        self.matching_left.load(Ordering::SeqCst)
    }

    /// Commits attempted so far.
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::SeqCst)
    }
}

/// Wraps any [`Kv`] and fails operations as the shared [`Faults`] say.
pub struct FaultyKv {
    inner: Arc<dyn Kv>,
    faults: Arc<Faults>,
}

impl FaultyKv {
    pub fn new(inner: Arc<dyn Kv>) -> (FaultyKv, Arc<Faults>) {
        let faults = Arc::new(Faults::default());
        (
            FaultyKv {
                inner,
                faults: faults.clone(),
            },
            faults,
        )
    }

    fn matches(&self, batch: &Batch) -> bool {
        if self.faults.matching_left.load(Ordering::SeqCst) == 0 {
            return false;
        }
        let Ok(m) = self.faults.matching.lock() else {
            return false;
        };
        let Some(needle) = m.as_ref() else {
            return false;
        };
        let hit = batch.ops.iter().any(|op| match op {
            KvOp::Put(k, v) => contains(k, needle) || contains(v, needle),
            KvOp::Delete(k) => contains(k, needle),
        });
        hit && self
            .faults
            .matching_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    /// An injected read fault, while reads are set to fail.
    fn read_fault(&self) -> Result<(), StoreError> {
        if self.faults.fail_reads.load(Ordering::SeqCst) {
            return Err(StoreError::Read("injected read fault".into()));
        }
        Ok(())
    }

    fn refuse_commit(&self, batch: &Batch) -> bool {
        let n = self.faults.commits.fetch_add(1, Ordering::SeqCst) + 1;
        let nth = self.faults.fail_at.load(Ordering::SeqCst) == n;
        let refuse = nth || self.faults.fail_writes.load(Ordering::SeqCst) || self.matches(batch);
        if refuse {
            self.faults.refused.fetch_add(1, Ordering::SeqCst);
        }
        refuse
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

impl Kv for FaultyKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.read_fault()?;
        self.inner.get(key)
    }

    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        self.read_fault()?;
        self.inner.scan(start, end, reverse, limit)
    }

    fn scan_session(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
        from_ms: Option<u64>,
    ) -> Result<Vec<Entry>, StoreError> {
        self.read_fault()?;
        self.inner.scan_session(start, end, reverse, limit, from_ms)
    }

    fn scan_one(
        &self,
        start: &[u8],
        end: &[u8],
        from_ms: Option<u64>,
    ) -> Result<Option<Entry>, StoreError> {
        self.read_fault()?;
        self.inner.scan_one(start, end, from_ms)
    }

    fn commit(&self, batch: Batch) -> CommitTicket {
        if self.refuse_commit(&batch) {
            return CommitTicket::answered(Err(StoreError::Write("injected write fault".into())));
        }
        self.inner.commit(batch)
    }

    fn sync(&self) -> Result<(), StoreError> {
        if self.faults.fail_writes.load(Ordering::SeqCst) {
            return Err(StoreError::Sync("injected sync fault".into()));
        }
        self.inner.sync()
    }

    fn busy(&self) -> bool {
        self.faults.busy.load(Ordering::SeqCst) || self.inner.busy()
    }

    fn commit_stats(&self) -> CommitStats {
        self.inner.commit_stats()
    }

    fn health(&self) -> Result<(), String> {
        self.inner.health()
    }

    fn windows(&self) -> Result<Vec<WindowInfo>, StoreError> {
        self.inner.windows()
    }

    fn hold_event_merges(&self, session_id: &str) {
        self.inner.hold_event_merges(session_id);
    }

    fn release_event_merges(&self, session_id: &str) {
        self.inner.release_event_merges(session_id);
    }
}
