//! The simulated disk: a [`Kv`] whose group commit the simulation drives, over the
//! store's real in-memory commit log ([`MemLog`]) and the real record codec.
//!
//! Why not `LoggedKv` itself: its committer and applier are std threads timed by
//! `std::time`, and sled runs threads of its own, so a run on it is not decided by
//! the seed. [`SimKv`] keeps what the engine can observe of the commit path and the
//! log's crash contract, on one thread:
//!
//! - a commit is queued; the *syncer* task ([`SimKv::sync_group`], on the daemon's
//!   paused-time runtime) takes every queued batch as one group, appends their records
//!   (`turnd_store::logged::encode`) to the log with `sync`, and only then makes them
//!   readable and answers the committers: durable before acknowledged, reads never
//!   ahead of the log;
//! - a failing disk fails every group (each committer gets the error; nothing of it
//!   is kept), until it heals;
//! - a planned crash happens inside a group: all of its records, or a prefix of them
//!   (a torn group), reach the log and are durable, and none is acknowledged; from
//!   then on every call fails, and the simulation crashes the daemon;
//! - a crash ([`SimKv::crash`]) keeps the log's durable records alone
//!   ([`MemLog::crash`]), and a start replays them, decoded by the store's codec, into
//!   a fresh store ([`SimKv::recover`]), as `LoggedKv`'s start replays its log into
//!   sled.
//!
//! [`MemLog::tear_next_append`] is not used for the torn group: it holds the appending
//! thread until the crash, which needs a second thread. Appending the group's prefix
//! and crashing before the answer leaves the same log.

use std::sync::Arc;

use futures_util::FutureExt;
use parking_lot::Mutex;
use turnd_store::logged::{decode, encode};
use turnd_store::{
    Batch, CommitLog, CommitReply, CommitTicket, Kv, KvOp, MemKv, MemLog, StoreError, WindowInfo,
    WindowOptions,
};

/// How the next group ends, when not as usual.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupCrash {
    /// The first `keep` records of the group reach the log, then the machine stops.
    Torn(usize),
    /// The whole group is durable, then the machine stops before any answer.
    AfterAppend,
}

struct Queued {
    record: Vec<u8>,
    batch: Option<Batch>,
    reply: Option<CommitReply>,
}

#[derive(Default)]
struct State {
    queued: Vec<Queued>,
    failing: bool,
    crash: Option<GroupCrash>,
    /// Set when a planned crash happened: every call fails until the simulation
    /// crashes the daemon.
    stopped: bool,
    groups: u64,
}

/// The simulated store. See the module documentation.
pub struct SimKv {
    mem: MemKv,
    log: MemLog,
    state: Mutex<State>,
}

fn no_windows() -> WindowOptions {
    WindowOptions {
        window_ms: 0,
        window_bytes: u64::MAX,
    }
}

fn stopped() -> StoreError {
    StoreError::Write("the simulated machine has stopped".into())
}

impl SimKv {
    /// An empty store on an empty log.
    pub fn new() -> SimKv {
        SimKv {
            mem: MemKv::with_windows(no_windows()),
            log: MemLog::new(),
            state: Mutex::new(State::default()),
        }
    }

    /// A store started on `log`, what a crash left: every record it holds replayed.
    pub fn recover(log: MemLog) -> Result<SimKv, StoreError> {
        let opened = log.open(0)?;
        let mem = MemKv::with_windows(no_windows());
        for r in &opened.records {
            let mut batch = Batch::new();
            for op in decode(&r.payload)? {
                match op {
                    KvOp::Put(k, v) => batch.put_raw(k, v),
                    KvOp::Delete(k) => batch.delete(k),
                }
            }
            apply(&mem, batch)?;
        }
        Ok(SimKv {
            mem,
            log: opened.log,
            state: Mutex::new(State::default()),
        })
    }

    /// The log's durable records alone, as a crash of the machine leaves them; this
    /// store fails every call from now on, and its queued committers are never
    /// answered.
    pub fn crash(&self) -> MemLog {
        let mut s = self.state.lock();
        s.stopped = true;
        s.queued.clear();
        self.log.crash()
    }

    /// Whether a planned crash happened inside a group.
    pub fn stopped(&self) -> bool {
        self.state.lock().stopped
    }

    /// Fail every group from now on (`true`) or no longer.
    pub fn set_failing(&self, failing: bool) {
        self.state.lock().failing = failing;
    }

    /// End the next non-empty group with `how`.
    pub fn crash_in_next_group(&self, how: GroupCrash) {
        self.state.lock().crash = Some(how);
    }

    /// Records the log holds, durable or not.
    pub fn log_records(&self) -> usize {
        self.log.lsns().len()
    }

    /// Groups committed so far by this store.
    pub fn groups(&self) -> u64 {
        self.state.lock().groups
    }

    /// One group commit: every batch queued since the last. See the module
    /// documentation.
    pub fn sync_group(&self) {
        let mut s = self.state.lock();
        if s.stopped || s.queued.is_empty() {
            return;
        }
        let group = std::mem::take(&mut s.queued);
        if s.failing {
            for q in group {
                answer(
                    q.reply,
                    Err(StoreError::Write("simulated disk: write failed".into())),
                );
            }
            return;
        }
        let records: Vec<&[u8]> = group.iter().map(|q| q.record.as_slice()).collect();
        if let Some(how) = s.crash.take() {
            let keep = match how {
                GroupCrash::Torn(keep) => keep.min(records.len()),
                GroupCrash::AfterAppend => records.len(),
            };
            // The machine stops here whether or not the write got through: a log
            // that refused it holds less, which a crash may leave too.
            self.log.append(&records[..keep], true).ok();
            s.stopped = true;
            return;
        }
        if let Err(e) = self.log.append(&records, true) {
            for q in group {
                answer(q.reply, Err(e.clone()));
            }
            return;
        }
        s.groups += 1;
        for q in group {
            let r = match q.batch {
                Some(b) => apply(&self.mem, b),
                None => Ok(()),
            };
            answer(q.reply, r);
        }
    }
}

impl Default for SimKv {
    fn default() -> SimKv {
        SimKv::new()
    }
}

fn answer(reply: Option<CommitReply>, r: Result<(), StoreError>) {
    if let Some(reply) = reply {
        // A committer that went away (its task dropped with a crashed runtime) has
        // nothing to be told.
        reply.send(r).ok();
    }
}

/// Apply a batch to the in-memory store: its ticket is answered before it returns.
fn apply(mem: &MemKv, batch: Batch) -> Result<(), StoreError> {
    match mem.commit(batch).now_or_never() {
        Some(Ok(r)) => r,
        _ => Err(StoreError::Write(
            "in-memory store left a commit unanswered".into(),
        )),
    }
}

impl Kv for SimKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        if self.state.lock().stopped {
            return Err(stopped());
        }
        self.mem.get(key)
    }

    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
    ) -> Result<Vec<turnd_store::Entry>, StoreError> {
        if self.state.lock().stopped {
            return Err(stopped());
        }
        self.mem.scan(start, end, reverse, limit)
    }

    fn commit(&self, batch: Batch) -> CommitTicket {
        let (reply, ticket) = CommitTicket::new();
        let mut s = self.state.lock();
        if s.stopped {
            answer(Some(reply), Err(stopped()));
            return ticket;
        }
        let record = encode(&batch);
        if cfg!(feature = "planted-ack-before-commit") {
            // The planted bug: readable and answered now, durable only with the
            // next group (or never, if the machine stops first).
            let r = apply(&self.mem, batch);
            answer(Some(reply), r);
            s.queued.push(Queued {
                record,
                batch: None,
                reply: None,
            });
            return ticket;
        }
        s.queued.push(Queued {
            record,
            batch: Some(batch),
            reply: Some(reply),
        });
        ticket
    }

    fn sync(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn windows(&self) -> Result<Vec<WindowInfo>, StoreError> {
        self.mem.windows()
    }
}

/// A handle the daemon's store and the simulation share.
pub type SharedKv = Arc<SimKv>;
