//! A commit log in memory, for simulators and tests: a [`CommitLog`] that keeps the
//! contract of [`crate::log`] without a disk, and can crash.
//!
//! A [`MemLog`] holds its records in order, the oldest first, and knows how many of
//! them are durable: every record of a group appended with `sync`, and those before
//! it; appends without `sync` are durable only once a later one with `sync` or a
//! [`CommitLog::flush`] comes. [`MemLog::crash`] is what a crash of the machine
//! leaves: a new log of the durable records alone, while the crashed one refuses
//! everything from then on. [`MemLog::tear_next_append`] crashes in the middle of a
//! group's write: the group's first records reach the log, and the append never
//! returns before the crash.
//!
//! Handles are cheap clones of one log: the store holds one, and a test keeps
//! another to crash it.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::{CommitLog, Opened, Record};
use crate::error::StoreError;

/// An in-memory commit log. See the module documentation.
#[derive(Clone)]
pub struct MemLog {
    shared: Arc<Shared>,
}

impl Default for MemLog {
    fn default() -> MemLog {
        MemLog::new()
    }
}

struct Shared {
    state: Mutex<State>,
    /// Notified when the log crashes, for an append held by a tear.
    crashed: Condvar,
}

#[derive(Default)]
struct State {
    /// The lsn of the first record held (records before it are trimmed); the
    /// records' lsns follow it without a gap.
    base: u64,
    /// The payloads of the records held, oldest first.
    records: Vec<Vec<u8>>,
    /// How many of `records`, from the first, survive a crash.
    durable: usize,
    /// Set by a crash: every call fails from then on.
    crashed: bool,
    /// The next append writes this many of its records, then waits for the crash.
    tear: Option<usize>,
}

impl State {
    fn next_lsn(&self) -> u64 {
        self.base + self.records.len() as u64
    }
}

fn crashed() -> StoreError {
    StoreError::Write("the in-memory commit log has crashed".into())
}

impl MemLog {
    /// An empty log, whose first record will have lsn 1.
    pub fn new() -> MemLog {
        MemLog {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    base: 1,
                    ..State::default()
                }),
                crashed: Condvar::new(),
            }),
        }
    }

    fn state(&self) -> Result<MutexGuard<'_, State>, StoreError> {
        let s = self
            .shared
            .state
            .lock()
            .map_err(|_| StoreError::Write("in-memory commit log lock poisoned".into()))?;
        if s.crashed {
            return Err(crashed());
        }
        Ok(s)
    }

    /// Open the log at `applied`, the last lsn its store holds: every record after
    /// it, and a handle to append after both. Records at or before it are let go.
    /// Fails, as a log that lost acknowledged records does, when the first record
    /// held comes after `applied + 1`.
    pub fn open(&self, applied: u64) -> Result<Opened<MemLog>, StoreError> {
        let mut s = self.state()?;
        let held = applied.saturating_add(1).saturating_sub(s.base) as usize;
        trim_front(&mut s, held);
        if s.base > applied + 1 {
            return Err(StoreError::Corrupt(format!(
                "in-memory commit log: its first record is {} but the store holds records only up to {applied}",
                s.base
            )));
        }
        if s.records.is_empty() {
            s.base = s.base.max(applied + 1);
        }
        let records: Vec<Record> = (s.base..)
            .zip(&s.records)
            .map(|(lsn, payload)| Record {
                lsn,
                payload: payload.clone(),
            })
            .collect();
        let bytes = records.iter().map(|r| r.payload.len() as u64).sum();
        Ok(Opened {
            log: self.clone(),
            records,
            bytes,
        })
    }

    /// What a crash of the machine leaves: a log of the durable records alone. This
    /// log (every handle of it) fails every call from now on, and an append a tear
    /// holds returns.
    pub fn crash(&self) -> MemLog {
        let survivor = MemLog::new();
        if let Ok(mut s) = self.shared.state.lock() {
            s.crashed = true;
            if let Ok(mut after) = survivor.shared.state.lock() {
                after.base = s.base;
                after.records = s.records[..s.durable].to_vec();
                after.durable = s.durable;
            }
        }
        self.shared.crashed.notify_all();
        survivor
    }

    /// Have the next append write its first `keep` records (durable, as a write that
    /// reached the disk, when every record before them is) and then wait for
    /// [`MemLog::crash`], never acknowledging the group: a crash in the middle of a
    /// group's write.
    pub fn tear_next_append(&self, keep: usize) {
        if let Ok(mut s) = self.shared.state.lock() {
            s.tear = Some(keep);
        }
    }

    /// The lsns of the records held, durable or not.
    pub fn lsns(&self) -> Vec<u64> {
        self.shared
            .state
            .lock()
            .map(|s| (s.base..s.next_lsn()).collect())
            .unwrap_or_default()
    }

    /// An append that a tear holds: write `keep` records, then wait for the crash.
    /// They are durable when every record before them is (what reaches the disk is a
    /// prefix of what was written).
    fn torn(&self, mut s: MutexGuard<'_, State>, group: &[&[u8]], keep: usize) -> StoreError {
        let behind_durable = s.durable == s.records.len();
        s.records
            .extend(group.iter().take(keep).map(|p| p.to_vec()));
        if behind_durable {
            s.durable = s.records.len();
        }
        while !s.crashed {
            s = match self.shared.crashed.wait(s) {
                Ok(s) => s,
                Err(_) => break,
            };
        }
        crashed()
    }
}

/// Let go of the first `n` records held (at most all of them).
fn trim_front(s: &mut State, n: usize) -> usize {
    let n = n.min(s.records.len());
    s.records.drain(..n);
    s.base += n as u64;
    s.durable = s.durable.saturating_sub(n);
    n
}

impl CommitLog for MemLog {
    fn next_lsn(&self) -> u64 {
        self.state().map_or(0, |s| s.next_lsn())
    }

    fn append(&self, group: &[&[u8]], sync: bool) -> Result<u64, StoreError> {
        let mut s = self.state()?;
        if let Some(keep) = s.tear.take() {
            return Err(self.torn(s, group, keep));
        }
        let first = s.next_lsn();
        s.records.extend(group.iter().map(|p| p.to_vec()));
        if sync {
            s.durable = s.records.len();
        }
        Ok(first)
    }

    /// Appends fail only by a crash, after which nothing heals.
    fn is_failed(&self) -> bool {
        self.state().is_err()
    }

    fn heal(&self) -> Result<(), StoreError> {
        self.state().map(|_| ())
    }

    fn flush(&self) -> Result<(), StoreError> {
        let mut s = self.state()?;
        s.durable = s.records.len();
        Ok(())
    }

    fn read_range(&self, after: u64, upto: u64) -> Result<Vec<Record>, StoreError> {
        let s = self.state()?;
        if upto <= after {
            return Ok(Vec::new());
        }
        if after + 1 < s.base || upto >= s.next_lsn() {
            return Err(StoreError::Corrupt(format!(
                "in-memory commit log: records {} to {upto} are not all held ({} to {})",
                after + 1,
                s.base,
                s.next_lsn() - 1
            )));
        }
        let from = (after + 1 - s.base) as usize;
        let to = (upto + 1 - s.base) as usize;
        Ok((after + 1..)
            .zip(&s.records[from..to])
            .map(|(lsn, payload)| Record {
                lsn,
                payload: payload.clone(),
            })
            .collect())
    }

    fn wants_trim(&self) -> bool {
        self.state().is_ok_and(|s| !s.records.is_empty())
    }

    fn trim(&self, applied: u64) -> Result<usize, StoreError> {
        let mut s = self.state()?;
        let n = applied.saturating_add(1).saturating_sub(s.base) as usize;
        Ok(trim_front(&mut s, n))
    }

    fn health(&self) -> Result<(), String> {
        self.state().map(|_| ()).map_err(|e| e.to_string())
    }
}
