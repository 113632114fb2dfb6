//! When sled is checkpointed: closed and opened again, so that it writes its
//! snapshot.
//!
//! sled 0.34 writes its snapshot (the page table it would otherwise rebuild from the
//! log) only while it opens a store, so the next open replays everything written since
//! the last one: about a second per GB of log here, and a run that wrote millions of
//! turns would start slowly after a crash or a restart. The applier therefore
//! *checkpoints* once `checkpoint_mb` of keys and values were written since the last
//! open: between two rounds it syncs, closes sled and opens it again, which writes a
//! new snapshot. Applies and reads wait meanwhile (commits do not: they go to the
//! commit log); the pause grows with the store's size and the log since the last open
//! (measured in `docs/benchmarks.md`). A due checkpoint gives way to reads in progress
//! for up to `checkpoint_patience`. Once writes pause, sled is checkpointed as well.

use std::sync::Mutex;

use super::{Shared, SledOptions};
use crate::stats::CommitStats;

/// When the applier checkpoints: what it wrote since sled was last opened, and since
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

    /// After a round: checkpoint if enough was written since the last open.
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
