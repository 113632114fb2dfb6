//! The commit log: the first place a committed batch goes, behind the [`CommitLog`]
//! trait, so that the store's commit path (`crate::logged`) works on any log that
//! keeps its contract.
//!
//! Every batch the engine commits is appended as one record, a group of them at a
//! time, and none is acknowledged before its group is durable. sled is written
//! behind the log, and the log is trimmed only once sled holds, flushed and synced,
//! everything the trimmed part held. A start reads back what the log holds past
//! sled's applied mark. Positions are log sequence numbers (lsn, `u64`), the same
//! numbers the store records as its applied mark.
//!
//! Two implementations: [`LocalLog`], segment files on the local disk (the daemon's),
//! and [`MemLog`], in memory, whose crash drops what was never made durable (for
//! simulators and tests).
//!
//! # The contract
//!
//! - **Durable before acknowledged.** [`CommitLog::append`] with `sync` returns
//!   `Ok(first)` only once every record of the group survives a crash of the process
//!   and of the machine; without `sync` (`storage.sync = "never"`, tests and
//!   benchmarks only) only once the log has taken the group, which a crash may then
//!   drop. `first` is the group's first position.
//! - **Ordered.** A group's records take consecutive positions, in the order given;
//!   every later group's are higher than every earlier one's. Positions need not be
//!   gap-free across groups (a replicated log may leave one where a publish in doubt
//!   was cancelled): the store only compares them.
//! - **A failed append is in doubt until healed.** An append that returns `Err` may
//!   have left records of its group behind (a write that reached the disk before its
//!   sync failed, a publish whose acknowledgement was lost). The log is then
//!   *failed*: [`CommitLog::is_failed`] says so, and it refuses every append until
//!   [`CommitLog::heal`] has made them unreadable for good (written zeros over them,
//!   or read the stream back and removed what landed); the next group then takes
//!   positions after the last acknowledged one.
//! - **What a crash may drop, and keep.** A crash may drop only records never
//!   acknowledged as durable: the group in flight, a failed group, and with `sync`
//!   off whatever was not yet flushed. It may also keep some of them, as a healed log
//!   never does. Either way a record is never torn (it reads back whole or not at
//!   all), and what reads back is a prefix of what was appended: no record after one
//!   that is missing.
//! - **Reads.** Opening at the position the store holds reads back every record after
//!   it, in order (what [`Opened`] carries). While open, [`CommitLog::read_range`]
//!   reads any acknowledged range not trimmed yet, and fails rather than return part
//!   of it.
//! - **Trimming.** [`CommitLog::trim`] lets go of records at or before the position
//!   given, which the store holds durably elsewhere; it may keep some longer. Records
//!   after it stay.
//!
//! # Threads
//!
//! The store calls [`CommitLog::append`], [`CommitLog::heal`] and
//! [`CommitLog::flush`] from its committer thread alone, one call at a time, and
//! [`CommitLog::read_range`], [`CommitLog::trim`], [`CommitLog::wants_trim`],
//! [`CommitLog::upkeep`] and [`CommitLog::report`] from its applier thread, at the
//! same time as appends. Both threads are outside any tokio runtime, and a call may
//! block: an append blocks until its group is durable. A log that talks to servers
//! (a replicated stream) runs its own runtime and waits on it there.

mod local;
mod mem;
#[cfg(test)]
mod tests;

pub use local::LocalLog;
pub use mem::MemLog;

use crate::error::StoreError;
use crate::stats::CommitStats;

/// One record read back from a log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub lsn: u64,
    pub payload: Vec<u8>,
}

/// A log opened at the position its store holds: the log, and what it holds past
/// that position.
pub struct Opened<L> {
    pub log: L,
    /// Every record after the position, in order.
    pub records: Vec<Record>,
    /// Bytes of the records the open read.
    pub bytes: u64,
}

impl<L: CommitLog> Opened<L> {
    /// The same, with the log behind the trait.
    pub fn boxed(self) -> Opened<Box<dyn CommitLog>> {
        Opened {
            log: Box::new(self.log),
            records: self.records,
            bytes: self.bytes,
        }
    }
}

/// A commit log. See the module documentation for the contract every implementation
/// keeps.
pub trait CommitLog: Send + Sync + 'static {
    /// The position the next appended record takes (read once, at open).
    fn next_lsn(&self) -> u64;

    /// Append `group` as consecutive records and, with `sync`, make them durable
    /// before returning. Returns the first one's position. On an error none of the
    /// group counts as written, and the log may be failed until healed.
    fn append(&self, group: &[&[u8]], sync: bool) -> Result<u64, StoreError>;

    /// Whether a failed append waits for [`CommitLog::heal`].
    fn is_failed(&self) -> bool;

    /// After a failed append: make whatever the failed group may have left unreadable,
    /// so that appends can go on. Ok at once when nothing failed.
    fn heal(&self) -> Result<(), StoreError>;

    /// Make everything appended durable (at close, and after appends without `sync`).
    fn flush(&self) -> Result<(), StoreError>;

    /// The records with `after < lsn <= upto`, every one of them acknowledged and not
    /// trimmed; an error when any is missing.
    fn read_range(&self, after: u64, upto: u64) -> Result<Vec<Record>, StoreError>;

    /// Whether a [`CommitLog::trim`] could let go of something now. The store makes
    /// sled durable before every trim, so it asks first.
    fn wants_trim(&self) -> bool;

    /// Let go of records at or before `applied`, which the store holds durably.
    /// Returns how many units (segments, or records) went.
    fn trim(&self, applied: u64) -> Result<usize, StoreError>;

    /// Work the log does off the commit path, called by the store's applier between
    /// its rounds (a local log makes its next segment ahead of need). After an error
    /// the store waits its `heal_interval` before it calls this again.
    fn upkeep(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Put the log's own counters into the store's (`log_*`).
    fn report(&self, _stats: &mut CommitStats) {}

    /// Err when the log can no longer take appends without a restart; `/healthz`
    /// fails with it. A failed append that [`CommitLog::heal`] may still repair is
    /// not such a failure.
    fn health(&self) -> Result<(), String> {
        Ok(())
    }
}
