//! A warm standby's store: the records a leader's commit log holds, applied to a
//! store of sled and time windows in a directory of its own, so that a takeover
//! opens it with [`super::LoggedKv::open_with_log`] and replays only the rest.
//!
//! A [`Follower`] applies records handed to it (read from any log, in order) with the
//! code a start uses ([`super::replay`]): coalesced by key, written where they belong,
//! the windows synced, the window drops among them taken, the applied mark recorded
//! and sled synced. So after every [`Follower::apply`] its applied mark is durable,
//! and what the directory holds is exactly what a [`super::LoggedKv`] that replayed
//! the same records would hold. It makes no time windows of its own: routing follows
//! the windows the directory already has, so it never changes after the fact on this
//! node, whatever the leader's clock. Records at or before the applied mark are
//! passed over, so the same records handed twice leave the same state.

use std::path::Path;
use std::sync::Arc;

use super::replay::{coalesce, open_databases, replay_into};
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
    /// The last lsn applied, durable in sled.
    applied: u64,
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
        })
    }

    /// The last lsn applied (and durable): a log opened on this directory reads from
    /// the record after it.
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// Apply `records` (in lsn order), those past the applied mark; on return they
    /// are durable and the applied mark is the last one's. On an error nothing past
    /// the old mark counts as applied (a start replays it again).
    pub fn apply(&mut self, records: &[Record]) -> Result<(), StoreError> {
        let from = records.partition_point(|r| r.lsn <= self.applied);
        let fresh = &records[from..];
        let Some(last) = fresh.last().map(|r| r.lsn) else {
            return Ok(());
        };
        let map = coalesce(fresh)?;
        replay_into(&self.sled, &self.windows, &map, last)?;
        self.applied = last;
        Ok(())
    }

    /// Close sled and the windows, so that the directory can be opened again (by a
    /// [`super::LoggedKv`] that takes over, or another follower).
    pub fn close(self) {
        for (_, w) in self.windows.all_open() {
            w.close();
        }
        self.sled.close();
    }
}
