//! A fault-injecting [`Kv`] wrapper for tests: fail the Nth write, fail every write
//! for a while, fail the sync, fail reads. The daemon can be started on it, so tests
//! drive the real engine into storage faults at chosen cuts.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crate::{Entry, Batch, CommitStats, CommitTicket, Kv, StoreError};

/// Switches shared between a test and the [`FaultyKv`] it wrapped.
#[derive(Debug, Default)]
pub struct Faults {
    /// Fail every write while set.
    pub fail_writes: AtomicBool,
    /// Fail every read while set.
    pub fail_reads: AtomicBool,
    /// Fail the commit numbered this (1-based, counted from the last `fail_nth`), once.
    fail_at: AtomicU64,
    commits: AtomicU64,
    /// Commits refused so far.
    pub refused: AtomicU64,
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

    fn refuse_commit(&self) -> bool {
        let n = self.faults.commits.fetch_add(1, Ordering::SeqCst) + 1;
        let nth = self.faults.fail_at.load(Ordering::SeqCst) == n;
        let refuse = nth || self.faults.fail_writes.load(Ordering::SeqCst);
        if refuse {
            self.faults.refused.fetch_add(1, Ordering::SeqCst);
        }
        refuse
    }
}

impl Kv for FaultyKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        if self.faults.fail_reads.load(Ordering::SeqCst) {
            return Err(StoreError::Read("injected read fault".into()));
        }
        self.inner.get(key)
    }

    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        if self.faults.fail_reads.load(Ordering::SeqCst) {
            return Err(StoreError::Read("injected read fault".into()));
        }
        self.inner.scan(start, end, reverse, limit)
    }

    fn commit(&self, batch: Batch) -> CommitTicket {
        if self.refuse_commit() {
            let (tx, rx) = tokio::sync::oneshot::channel();
            if tx
                .send(Err(StoreError::Write("injected write fault".into())))
                .is_err()
            {
                tracing::debug!("receiver of an injected fault is gone");
            }
            return rx;
        }
        self.inner.commit(batch)
    }

    fn sync(&self) -> Result<(), StoreError> {
        if self.faults.fail_writes.load(Ordering::SeqCst) {
            return Err(StoreError::Sync("injected sync fault".into()));
        }
        self.inner.sync()
    }

    fn commit_stats(&self) -> CommitStats {
        self.inner.commit_stats()
    }
}
