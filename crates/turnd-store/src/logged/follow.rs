//! A warm standby's store: the records a leader's commit log holds, applied to a
//! store of sled and time windows in a directory of its own, so that a takeover
//! opens it with [`super::LoggedKv::open_with_log`] and replays only the rest.
//!
//! A [`Follower`] applies records handed to it (read from any log, in order) with the
//! code a start uses ([`super::replay`]): coalesced by key and written where they
//! belong. It makes them durable (the windows written synced, the applied mark
//! recorded and sled synced) at most [`LoggedOptions::mark_interval`] after the first
//! write since the last time, when asked ([`Follower::sync`]: a standby with nothing
//! to read) and as it closes, as the daemon's own applier does: sled may hold writes
//! past its durable mark, and a start replays from the mark, writing the same
//! absolute values again. Not syncing each batch spares a partition's standbys a
//! sync of sled for every append of a session run one turn at a time, on the cores
//! and disk the next append needs. A batch with a window drop is made durable at once (the drop is
//! finished only after sled holds it). What the directory holds at its durable mark
//! is exactly what a [`super::LoggedKv`] that replayed the same records would hold.
//! It makes no time windows of its own: routing follows the windows the directory
//! already has, so it never changes after the fact on this node, whatever the
//! leader's clock. Records at or before the applied mark are passed over, so the
//! same records handed twice leave the same state.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::apply::sync_windows;
use super::replay::{
    coalesce, map_drops, open_databases, record_mark, replay_into, write_coalesced,
};
use super::LoggedOptions;
use crate::error::StoreError;
use crate::log::Record;
use crate::sled::open_when_unlocked;
use crate::sled::Shared;
use crate::windows::store::Windows;

/// A store that applies a leader's records. See the module documentation.
pub struct Follower {
    sled: Arc<Shared>,
    windows: Windows,
    /// The last lsn written to sled and the windows.
    applied: u64,
    /// The last lsn recorded as applied, with everything before it synced.
    durable: u64,
    /// Windows written since the last sync.
    unsynced: Vec<u64>,
    /// When a write first went past `durable`, if one did.
    dirty_since: Option<Instant>,
    sync_every: Duration,
}

impl Follower {
    /// Open (or create) the store in `dir`, as [`super::LoggedKv::open`] would, with
    /// no commit log: it takes records from [`Follower::apply`].
    pub fn open(dir: &Path, opts: LoggedOptions) -> Result<Follower, StoreError> {
        // A follower closed a moment ago in this process (a standby stopped and
        // started again) may hold sled's lock a moment longer. Only here: another
        // process's store, which closes and reopens sled at each checkpoint, must
        // be refused at once, never waited for and entered.
        let (sled, windows, applied) = open_when_unlocked(|| open_databases(dir, &opts))?;
        Ok(Follower {
            sled,
            windows,
            applied,
            durable: applied,
            unsynced: Vec::new(),
            dirty_since: None,
            sync_every: opts.mark_interval,
        })
    }

    /// The last lsn applied, durable or not yet: the records to hand next start
    /// after it.
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// The last lsn applied and durable: a log opened on this directory reads from
    /// the record after it, and a trim may count on it.
    pub fn durable(&self) -> u64 {
        self.durable
    }

    /// Apply `records` (in lsn order), those past the applied mark; the applied mark
    /// is then the last one's, and durable within [`LoggedOptions::mark_interval`]
    /// (at once for a batch with a window drop). On an error nothing past the
    /// durable mark counts (a start replays it again).
    pub fn apply(&mut self, records: &[Record]) -> Result<(), StoreError> {
        let from = records.partition_point(|r| r.lsn <= self.applied);
        let fresh = &records[from..];
        let Some(last) = fresh.last().map(|r| r.lsn) else {
            return Ok(());
        };
        let map = coalesce(fresh)?;
        if map_drops(&map).is_empty() {
            self.unsynced
                .extend(write_coalesced(&self.sled, &self.windows, &map)?);
            self.applied = last;
            let since = *self.dirty_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= self.sync_every {
                self.sync()?;
            }
        } else {
            // What came before is made durable under its own mark first; the drop
            // is then written, synced and finished as a start does.
            self.sync()?;
            replay_into(&self.sled, &self.windows, &map, last)?;
            self.applied = last;
            self.durable = last;
        }
        Ok(())
    }

    /// Make everything applied durable: sync the windows written since the last
    /// time, record the applied mark, sync sled.
    pub fn sync(&mut self) -> Result<(), StoreError> {
        if self.durable == self.applied {
            return Ok(());
        }
        self.unsynced.sort_unstable();
        self.unsynced.dedup();
        sync_windows(&self.windows, &self.unsynced)?;
        record_mark(&self.sled, self.applied)?;
        self.unsynced.clear();
        self.dirty_since = None;
        self.durable = self.applied;
        Ok(())
    }

    /// Make what was applied durable ([`Follower::sync`]), then close sled and the
    /// windows, so that the directory can be opened again (by a
    /// [`super::LoggedKv`] that takes over, or another follower). A failed sync
    /// leaves the directory at its last durable mark: the next open replays from
    /// there.
    pub fn close(mut self) {
        if let Err(e) = self.sync() {
            tracing::warn!("a standby's store closes at its last durable mark: {e}");
        }
        for (_, w) in self.windows.all_open() {
            w.close();
        }
        self.sled.close();
    }
}
