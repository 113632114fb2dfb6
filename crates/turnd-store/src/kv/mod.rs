//! The raw key-value surface every store offers ([`Kv`]): point reads, range scans
//! (of one session's keys, of one time window's), an atomic batch queued for group
//! commit and answered through a [`CommitTicket`], a sync, statistics and health.
//! The typed [`crate::Store`] reads and writes through it; [`mem::MemKv`] keeps it in
//! memory, [`faulty::FaultyKv`] wraps another to fail on demand, and
//! [`crate::LoggedKv`] is the durable one the daemon runs on.

pub mod faulty;
pub mod mem;
mod ticket;

pub use ticket::{CommitReply, CommitTicket};

use crate::error::StoreError;
use crate::model::keys::{next_page, routed_ms, Entry};
use crate::model::Batch;
use crate::stats::CommitStats;
use crate::windows::WindowInfo;

/// The raw key-value surface of the store.
pub trait Kv: Send + Sync + 'static {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;
    /// Entries with keys in `[start, end)`, ascending (or descending when `reverse`),
    /// at most `limit`.
    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError>;
    /// [`Kv::scan`] of a range of one session's keys (its turn list, events or
    /// idempotency keys), all of whose routes ([`crate::keys`]) are at or after `from_ms`
    /// (None: the session has no routed key; its meta's
    /// [`crate::SessionMeta::routed_from_ms`]): a store with time windows reads only the
    /// windows that can hold them, where a plain scan reads them all.
    fn scan_session(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
        _from_ms: Option<u64>,
    ) -> Result<Vec<Entry>, StoreError> {
        self.scan(start, end, reverse, limit)
    }
    /// The key of a range of one session's keys that holds at most one (its turn list
    /// entry at one seq, or one idempotency key: a reader does not know their routes),
    /// as [`Kv::scan_session`] reads it. A store with time windows looks in them
    /// newest first and stops at the first it finds, where a scan reads every one.
    fn scan_one(
        &self,
        start: &[u8],
        end: &[u8],
        from_ms: Option<u64>,
    ) -> Result<Option<Entry>, StoreError> {
        Ok(self
            .scan_session(start, end, false, 1, from_ms)?
            .into_iter()
            .next())
    }
    /// Up to `limit` entries with keys in `[start, end)` that are stored in the open
    /// time window starting at `window_start` (the keys routed to it: see
    /// [`crate::windows`]), ascending. Retention reads a window's event values with it
    /// before it drops the window. This default scans the range and keeps the keys
    /// routed there; a store with windows reads only the window.
    fn scan_window(
        &self,
        window_start: u64,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        let wins = self.windows()?;
        let Some(w) = wins.iter().find(|w| w.start_ms == window_start) else {
            return Ok(Vec::new());
        };
        let page_size = limit.max(64);
        let mut out = Vec::new();
        let mut from = start.to_vec();
        while out.len() < limit {
            let page = self.scan(&from, end, false, page_size)?;
            let next = next_page(&page, page_size);
            out.extend(
                page.into_iter()
                    .filter(|(k, _)| routed_ms(k).is_some_and(|ms| w.holds(ms))),
            );
            match next {
                Some(n) => from = n,
                None => break,
            }
        }
        out.truncate(limit);
        Ok(out)
    }
    /// Queue an atomic batch for the next group commit.
    fn commit(&self, batch: Batch) -> CommitTicket;
    /// Make everything committed so far durable (used at shutdown).
    fn sync(&self) -> Result<(), StoreError>;
    /// Commit statistics, for metrics.
    fn commit_stats(&self) -> CommitStats {
        CommitStats::default()
    }
    /// Whether the store is behind: commits may come to wait for it (`LoggedKv`: a
    /// quarter of the overlay's room not yet in sled). Background writers
    /// (retention) hold back while it is, so that they do not push the commits of
    /// live work into that wait.
    fn busy(&self) -> bool {
        false
    }
    /// Err when the store can no longer work without a restart (a thread of its own
    /// has ended); `/healthz` fails with it.
    fn health(&self) -> Result<(), String> {
        Ok(())
    }
    /// The time windows of finished turns, oldest first (see [`crate::windows`]).
    fn windows(&self) -> Result<Vec<WindowInfo>, StoreError> {
        Ok(Vec::new())
    }
    /// Until the matching [`Kv::release_event_merges`], keep the session's event
    /// values each under the key it was written with: retention reads them and writes
    /// them again under those keys, and a store that writes several values as one
    /// (`LoggedKv`, see `logged/runs.rs`) would move events to another key meanwhile.
    /// Holds of one session add up. A wrapper must pass both calls on.
    fn hold_event_merges(&self, _session_id: &str) {}
    /// End a [`Kv::hold_event_merges`].
    fn release_event_merges(&self, _session_id: &str) {}
}
