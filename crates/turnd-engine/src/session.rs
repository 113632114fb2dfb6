//! One session's state in memory: its meta, its unfinished turns in `seq` order and
//! the lock holder's live invocation, as the last committed transition left them.
//!
//! A session's state has one writer, the holder of its async mutex (`sessions.rs`),
//! and its records change only by a committed transition of the machine
//! ([`crate::machine::Tx::apply`]); loading from the store fills it in. Two fields
//! are the shell's own bookkeeping about the session, which the machine only reads:
//! the time its timer entry fires at and the retry of a write that failed.

use std::sync::Arc;

use turnd_store::{InvocationRecord, SessionMeta, TurnRecord};

/// A session's non-terminal turns in `seq` order; the first is the lock holder.
///
/// A sorted vector of boxed records, each beside its `seq`: most sessions hold one
/// or two live turns, and this costs a pointer and a `seq` per turn where a
/// `BTreeMap` node reserves eleven slots. Turns are admitted in `seq` order and
/// usually leave from the front. The `seq` is kept beside the box so that finding a
/// turn reads the vector alone: read through the boxes, each step of the search was
/// a cache miss, and with 20 turns queued per session the search took 1.6 % of the
/// daemon's CPU (`docs/benchmarks.md`).
#[derive(Debug, Default)]
// Boxed on purpose: a vector of records reserves room for four records on its first
// push (about 1.7 KB), a vector of boxes 64 bytes, and 16 with the first turn's exact
// reservation in `insert` (most sessions never hold a second).
pub struct ActiveTurns(Vec<(u64, Box<TurnRecord>)>);

impl ActiveTurns {
    fn position(&self, seq: u64) -> Result<usize, usize> {
        self.0.binary_search_by_key(&seq, |(s, _)| *s)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn get(&self, seq: u64) -> Option<&TurnRecord> {
        self.position(seq).ok().map(|i| &*self.0[i].1)
    }

    /// Insert or replace the turn with `t.seq`.
    pub fn insert(&mut self, t: TurnRecord) {
        match self.position(t.seq) {
            Ok(i) => *self.0[i].1 = t,
            Err(i) => {
                if self.0.capacity() == 0 {
                    self.0.reserve_exact(1);
                }
                self.0.insert(i, (t.seq, Box::new(t)))
            }
        }
    }

    pub fn remove(&mut self, seq: u64) {
        if let Ok(i) = self.position(seq) {
            self.0.remove(i);
        }
    }

    /// The turn with the highest `seq`: the newest admitted.
    pub fn last(&self) -> Option<&TurnRecord> {
        self.0.last().map(|(_, t)| &**t)
    }

    /// The turns in `seq` order.
    pub fn iter(&self) -> impl Iterator<Item = &TurnRecord> {
        self.0.iter().map(|(_, t)| &**t)
    }

    pub fn seqs(&self) -> impl Iterator<Item = u64> + '_ {
        self.0.iter().map(|(s, _)| *s)
    }

    /// How many turns come before `seq`.
    pub fn count_before(&self, seq: u64) -> usize {
        match self.position(seq) {
            Ok(i) | Err(i) => i,
        }
    }
}

#[derive(Debug)]
pub struct SessionState {
    /// Shared with the map of sessions in memory, the wait index and the registry's
    /// note of what it waits for: one allocation per session.
    pub id: Arc<str>,
    /// Whether the meta was read from the store (a cell is made before it is).
    pub loaded: bool,
    pub meta: SessionMeta,
    /// Non-terminal turns by `seq`; the first is the lock holder.
    pub active: ActiveTurns,
    /// The lock holder's live invocation.
    pub inv: Option<Box<InvocationRecord>>,
    /// The Unix ms the session's entry in the engine's timer queue fires at (the
    /// shell's: it moves the entry).
    pub timer: Option<u64>,
    /// A transition whose write failed and is being retried (the shell's: set when
    /// an internal write fails, cleared when a write of the session succeeds).
    pub pending: Option<Box<Pending>>,
}

/// A transition whose write failed: the error, since when the session has been
/// retrying, and when and after what delay it retries next.
#[derive(Debug, Clone)]
pub struct Pending {
    pub error: String,
    pub since_ms: u64,
    pub retry_at_ms: u64,
    pub delay_ms: u64,
}

impl SessionState {
    pub fn new(id: impl Into<Arc<str>>) -> Self {
        let id = id.into();
        SessionState {
            loaded: false,
            meta: SessionMeta::new(&id),
            id,
            active: ActiveTurns::default(),
            inv: None,
            timer: None,
            pending: None,
        }
    }

    pub fn holder(&self) -> Option<&TurnRecord> {
        self.active.iter().next()
    }

    pub fn find(&self, turn_id: &str) -> Option<&TurnRecord> {
        self.active.iter().find(|t| t.turn_id == turn_id)
    }

    /// The live invocation, if it is `invocation_id`.
    pub fn current_inv(&self, invocation_id: &str) -> Option<&InvocationRecord> {
        self.inv
            .as_deref()
            .filter(|i| i.invocation_id == invocation_id)
    }
}
