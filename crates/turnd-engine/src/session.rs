//! One session's in-memory state, the transaction overlay every transition is built
//! in, and the `Wait` each non-terminal turn shows.
//!
//! A session's state is only changed by its single writer (the holder of its async
//! mutex), and only after the transition's batch is durable: a [`Tx`] collects the
//! changed records, events and side effects on top of the unchanged state; the engine
//! commits the batch, then [`Tx::apply`]s it. A failed write leaves the state as it was.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde_json::{json, Value};
use turnd_proto::{Delivery, Event, EventKind, OnDeadline, Turn, TurnStatus, Wait, WaitState};
use turnd_store::{
    Batch, FoldedTurn, Held, IdempotencyRecord, InvWait, InvocationRecord, Phase, RawJson,
    SessionMeta, TurnRecord,
};

use crate::machine::{Effect, Slot, Want};
use crate::registry::Supply;

/// A session's non-terminal turns in `seq` order; the first is the lock holder.
///
/// A sorted vector of boxed records: most sessions hold one or two live turns, and
/// this costs a pointer per turn where a `BTreeMap` node reserves eleven slots.
/// Turns are admitted in `seq` order and usually leave from the front.
#[derive(Debug, Default)]
// Boxed on purpose: a vector of records reserves room for four records on its first
// push (about 1.7 KB), a vector of boxes 32 bytes, and 8 with the first turn's exact
// reservation in `insert` (most sessions never hold a second).
#[allow(clippy::vec_box)]
pub struct ActiveTurns(Vec<Box<TurnRecord>>);

impl ActiveTurns {
    fn position(&self, seq: u64) -> Result<usize, usize> {
        self.0.binary_search_by_key(&seq, |t| t.seq)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn get(&self, seq: u64) -> Option<&TurnRecord> {
        self.position(seq).ok().map(|i| &*self.0[i])
    }

    /// Insert or replace the turn with `t.seq`.
    pub fn insert(&mut self, t: TurnRecord) {
        match self.position(t.seq) {
            Ok(i) => *self.0[i] = t,
            Err(i) => {
                if self.0.capacity() == 0 {
                    self.0.reserve_exact(1);
                }
                self.0.insert(i, Box::new(t))
            }
        }
    }

    pub fn remove(&mut self, seq: u64) {
        if let Ok(i) = self.position(seq) {
            self.0.remove(i);
        }
    }

    /// The turns in `seq` order.
    pub fn iter(&self) -> impl Iterator<Item = &TurnRecord> {
        self.0.iter().map(|t| &**t)
    }

    pub fn seqs(&self) -> impl Iterator<Item = u64> + '_ {
        self.0.iter().map(|t| t.seq)
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
    /// Shared with the engine's map of sessions in memory, its `sessions.list` index
    /// and the registry's note of what it waits for: one allocation per session.
    pub id: Arc<str>,
    pub loaded: bool,
    pub meta: SessionMeta,
    /// Non-terminal turns by `seq`; the first is the lock holder.
    pub active: ActiveTurns,
    /// The lock holder's live invocation.
    pub inv: Option<Box<InvocationRecord>>,
    /// The Unix ms the session's entry in the engine's timer queue fires at.
    pub timer: Option<u64>,
    /// A transition whose write failed and is being retried: (error, since, retry delay).
    pub pending: Option<Box<Pending>>,
}

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

/// The overlay a transition is built in.
pub struct Tx {
    pub now: u64,
    pub meta: SessionMeta,
    /// Changed turns by seq, with the status each had before the transaction (None for
    /// a new turn).
    pub turns: BTreeMap<u64, TurnRecord>,
    pub orig_status: HashMap<u64, Option<TurnStatus>>,
    /// The live invocation after the transaction, if changed (Some(None): none live).
    pub live: Option<Option<Box<InvocationRecord>>>,
    /// Invocation records to write.
    pub inv_writes: Vec<InvocationRecord>,
    /// Ids of the invocations this transaction dispatches (minted for them: no
    /// store holds their records yet).
    pub new_invocations: Vec<String>,
    /// Folded records of finished turns this transaction changes (a late result),
    /// as read before it, by turn id: what it writes goes into them.
    pub folded: HashMap<String, FoldedTurn>,
    pub idempotency: Option<(String, IdempotencyRecord)>,
    pub events: Vec<Event>,
    /// What to do once the transaction is durable.
    pub effects: Vec<Effect>,
    /// The slots of the invocations this transaction ended, for the engine to free.
    pub frees: Vec<Slot>,
    /// The step this transaction wants dispatched; the engine answers with
    /// [`crate::machine::grant`].
    pub dispatch: Option<Want>,
    /// Dispatch slots the engine reserved for this transaction: (worker_id,
    /// invocation_id), freed again if the write fails.
    pub reserved: Vec<(String, String)>,
    /// Slots the engine freed for this transaction before its write, to restore if
    /// it fails.
    pub released: Vec<Slot>,
}

impl Tx {
    pub fn new(st: &SessionState, now: u64) -> Tx {
        Tx {
            now,
            meta: st.meta.clone(),
            turns: BTreeMap::new(),
            orig_status: HashMap::new(),
            live: None,
            inv_writes: Vec::new(),
            new_invocations: Vec::new(),
            folded: HashMap::new(),
            idempotency: None,
            events: Vec::new(),
            effects: Vec::new(),
            frees: Vec::new(),
            dispatch: None,
            reserved: Vec::new(),
            released: Vec::new(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.turns.is_empty() && self.inv_writes.is_empty() && self.events.is_empty()
    }

    /// The turn with `seq` as of this transaction.
    pub fn turn<'a>(&'a self, st: &'a SessionState, seq: u64) -> Option<&'a TurnRecord> {
        self.turns.get(&seq).or_else(|| st.active.get(seq))
    }

    /// A copy of the turn with `seq` to modify and [`Tx::put_turn`] back.
    pub fn take(&self, st: &SessionState, seq: u64) -> Option<TurnRecord> {
        self.turn(st, seq).cloned()
    }

    pub fn put_turn(&mut self, st: &SessionState, t: TurnRecord) {
        let orig = st.active.get(t.seq).map(|o| o.status);
        self.put_turn_from(t, orig);
    }

    /// Put a turn whose status before this transaction was `orig` (None: a new turn).
    pub fn put_turn_from(&mut self, mut t: TurnRecord, orig: Option<TurnStatus>) {
        t.updated_at_ms = self.now;
        self.orig_status.entry(t.seq).or_insert(orig);
        self.turns.insert(t.seq, t);
    }

    /// The lock holder as of this transaction: the first non-terminal turn.
    pub fn holder_seq(&self, st: &SessionState) -> Option<u64> {
        let from_state = st.active.seqs().find(|seq| match self.turns.get(seq) {
            Some(t) => !t.status.is_terminal(),
            None => true,
        });
        let from_tx = self
            .turns
            .values()
            .filter(|t| !t.status.is_terminal())
            .map(|t| t.seq)
            .next();
        match (from_state, from_tx) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    pub fn live<'a>(&'a self, st: &'a SessionState) -> Option<&'a InvocationRecord> {
        match &self.live {
            Some(l) => l.as_deref(),
            None => st.inv.as_deref(),
        }
    }

    /// Write an invocation record; it is the live one when it is active.
    pub fn put_invocation(&mut self, st: &SessionState, inv: InvocationRecord) {
        if inv.is_active() {
            self.live = Some(Some(Box::new(inv.clone())));
        } else if self.live(st).map(|l| l.invocation_id == inv.invocation_id) == Some(true) {
            self.live = Some(None);
        }
        self.inv_writes
            .retain(|i| i.invocation_id != inv.invocation_id);
        self.inv_writes.push(inv);
    }

    /// [`Tx::put_invocation`] of an invocation being dispatched, under an id minted
    /// for it.
    pub fn put_new_invocation(&mut self, st: &SessionState, inv: InvocationRecord) {
        self.new_invocations.push(inv.invocation_id.clone());
        self.put_invocation(st, inv);
    }

    pub fn event(&mut self, session_id: &str, turn_id: &str, kind: EventKind, detail: Value) {
        self.meta.last_event_seq += 1;
        self.events.push(Event {
            seq: self.meta.last_event_seq,
            session_id: session_id.to_string(),
            turn_id: turn_id.to_string(),
            at_ms: self.now,
            kind,
            detail,
        });
    }

    /// Build on the stored folded record of a finished turn (read before a late
    /// result changes it).
    pub fn fold_onto(&mut self, f: FoldedTurn) {
        self.folded.insert(f.turn.turn_id.clone(), f);
    }

    /// The durable batch of this transaction.
    ///
    /// A turn that is terminal after it is written as one folded record
    /// ([`FoldedTurn`]): the record with its input inline and the invocations of it
    /// that ended, in place of its separate keys. An invocation still active (a
    /// cancel awaiting its answer) stays under its own key until it ends.
    pub fn batch(&mut self, st: &SessionState) -> Batch {
        let mut b = Batch::new();
        // turn id -> (folded record, whether its input was stored apart)
        let mut finished: BTreeMap<String, (FoldedTurn, bool)> = BTreeMap::new();
        for (seq, t) in &self.turns {
            let orig = self.orig_status.get(seq).copied().flatten();
            if orig != Some(t.status) {
                self.meta.counts.shift(orig, t.status);
            }
            if t.status.is_terminal() {
                if orig.is_none() {
                    b.put_list_entry(t);
                }
                let mut f = match self.folded.get(&t.turn_id) {
                    Some(base) => {
                        let mut f = base.clone();
                        f.turn = FoldedTurn::new(t, Vec::new()).turn;
                        f
                    }
                    None => FoldedTurn::new(t, Vec::new()),
                };
                if let Some(inv) = st
                    .inv
                    .as_deref()
                    .filter(|i| i.turn_id == t.turn_id && !i.is_active())
                {
                    f.put_invocation(inv.clone());
                }
                finished.insert(t.turn_id.clone(), (f, t.input.is_apart()));
                continue;
            }
            if orig.is_none() {
                b.put_admission(t);
                b.put_new_turn(t);
            } else {
                b.put_turn(t);
            }
        }
        // Where recovery starts reading the session's turn list.
        self.meta.active_from = self.holder_seq(st);
        for i in &self.inv_writes {
            if !i.is_active() {
                if let Some((f, _)) = finished.get_mut(&i.turn_id) {
                    f.put_invocation(i.clone());
                    continue;
                }
                if let Some(base) = self.folded.get(&i.turn_id) {
                    let mut f = base.clone();
                    f.put_invocation(i.clone());
                    finished.insert(i.turn_id.clone(), (f, false));
                    continue;
                }
            }
            if self.new_invocations.contains(&i.invocation_id) {
                b.put_new_invocation(i);
            } else {
                b.put_invocation(i);
            }
        }
        for (f, apart) in finished.values() {
            b.put_finished(f, *apart);
        }
        b.put_events(&self.events);
        if let Some((key, rec)) = &self.idempotency {
            b.put_idempotency(&self.meta.session_id, key, rec);
        }
        // Reads of the session look for its routed keys from here on.
        self.meta.routed_at(b.routed_from());
        b.put_session_meta(&self.meta);
        b
    }

    /// Apply a committed transaction to the state. Returns the status changes
    /// (from, to) for global counters and the turns that became terminal.
    pub fn apply(self, st: &mut SessionState) -> Applied {
        let mut shifts = Vec::new();
        let mut terminal = Vec::new();
        let mut admitted = Vec::new();
        for (seq, t) in self.turns {
            let orig = self.orig_status.get(&seq).copied().flatten();
            if orig != Some(t.status) {
                shifts.push((orig, t.status));
            }
            if t.status.is_terminal() {
                st.active.remove(seq);
                terminal.push(t);
            } else {
                if orig.is_none() {
                    admitted.extend(turnd_proto::turn_id_bits(&t.turn_id));
                }
                st.active.insert(t);
            }
        }
        if let Some(l) = self.live {
            st.inv = l;
        }
        st.meta = self.meta;
        st.pending = None;
        Applied {
            shifts,
            terminal,
            admitted,
            events: self.events,
            effects: self.effects,
        }
    }
}

pub struct Applied {
    pub shifts: Vec<(Option<TurnStatus>, TurnStatus)>,
    /// Turns that are terminal after the transaction, as written.
    pub terminal: Vec<TurnRecord>,
    /// Id bits ([`turnd_proto::turn_id_bits`]) of the turns the transaction admitted
    /// and left unfinished.
    pub admitted: Vec<u128>,
    pub events: Vec<Event>,
    pub effects: Vec<Effect>,
}

/// The protocol view of a stored turn.
pub fn to_turn(t: &TurnRecord, wait: Option<Wait>) -> Turn {
    Turn {
        turn_id: t.turn_id.clone(),
        session_id: t.session_id.clone(),
        seq: t.seq,
        function_id: t.function_id.clone(),
        status: t.status,
        step: t.step,
        attempt: t.attempt,
        input: t.input.to_value(),
        output: t.output.as_ref().map(RawJson::to_value),
        error: t.error.as_deref().cloned(),
        stop: t.stop.as_deref().cloned(),
        recovered: t.recovered,
        created_at_ms: t.created_at_ms,
        updated_at_ms: t.updated_at_ms,
        finished_at_ms: t.finished_at_ms,
        wait: if t.status.is_terminal() { None } else { wait },
    }
}

fn base_wait(state: WaitState, reason: String, since_ms: u64) -> Wait {
    Wait {
        state,
        reason,
        since_ms,
        deadline_ms: None,
        on_deadline: None,
        invocation_id: None,
        worker_id: None,
        ahead: None,
        last_error: None,
    }
}

/// What happens to an invocation whose outcome becomes unknown.
fn on_unknown(inv: &InvocationRecord) -> OnDeadline {
    if inv.settings.delivery == Delivery::AtLeastOnce && inv.attempt < inv.settings.max_attempts {
        OnDeadline::Redispatch
    } else {
        OnDeadline::Fail
    }
}

/// The wait of a lock holder that has no worker slot, with why (from `supply`).
fn awaiting_worker(
    t: &TurnRecord,
    dispatch_timeout_ms: Option<u64>,
    fmt_ms: &dyn Fn(u64) -> String,
    supply: Option<Supply>,
) -> Wait {
    let f = &t.function_id;
    let why = match supply {
        Some(Supply {
            registered: false, ..
        }) => format!("no worker has registered {f}"),
        Some(Supply { connected: 0, .. }) => {
            format!("no connected worker serves {f} (the workers that registered it are gone)")
        }
        Some(Supply { connected, .. }) => {
            format!("all {connected} connected worker(s) serving {f} are busy")
        }
        None => format!("no connected worker serving {f} has free capacity"),
    };
    let mut w = base_wait(
        WaitState::AwaitingWorker,
        format!("{why} (waiting since {})", fmt_ms(t.phase_since_ms)),
        t.phase_since_ms,
    );
    let by = t.dispatch.as_deref().and_then(|d| d.dispatch_by_ms);
    let timeout = dispatch_timeout_ms.map(|d| t.phase_since_ms + d);
    if let Some(d) = [by, timeout].into_iter().flatten().min() {
        w.deadline_ms = Some(d);
        w.on_deadline = Some(OnDeadline::Fail);
    }
    w
}

/// The wait of a lock holder the session's hold keeps back: an earlier turn's
/// invocation, given up on a worker that cannot cancel it, may still be running.
fn held_wait(t: &TurnRecord, held: &Held, fmt_ms: &dyn Fn(u64) -> String) -> Wait {
    let mut w = base_wait(
        WaitState::Held,
        format!(
            "invocation {} of turn {} was given up on worker {}, which cannot cancel it, and may still be running; held until its result or its deadline at {}",
            held.invocation_id,
            held.turn_id,
            held.worker_id,
            fmt_ms(held.until_ms)
        ),
        held.since_ms.max(t.phase_since_ms),
    );
    w.deadline_ms = Some(held.until_ms);
    w.on_deadline = Some(OnDeadline::Dispatch);
    w.invocation_id = Some(held.invocation_id.clone());
    w.worker_id = Some(held.worker_id.clone());
    w
}

/// Why a non-terminal turn is not moving, and what happens next.
///
/// `supply` says who could run the holder's function (None: not needed, the reason
/// is not shown).
pub fn wait_of(
    st: &SessionState,
    t: &TurnRecord,
    dispatch_timeout_ms: Option<u64>,
    fmt_ms: &dyn Fn(u64) -> String,
    supply: Option<Supply>,
) -> Wait {
    let holder = st.holder().map(|h| h.seq);
    if holder != Some(t.seq) {
        let ahead = st.active.count_before(t.seq) as u64;
        let h = st.holder().map(|h| h.turn_id.clone()).unwrap_or_default();
        let mut w = base_wait(
            WaitState::QueuedBehind,
            format!(
                "queued behind turn {h} ({ahead} ahead in session {})",
                st.id
            ),
            t.created_at_ms,
        );
        w.ahead = Some(ahead);
        return w;
    }
    if let Some(p) = &st.pending {
        let mut w = base_wait(
            WaitState::Finalizing,
            format!(
                "a state change could not be written; retrying since {}: {}",
                fmt_ms(p.since_ms),
                p.error
            ),
            p.since_ms,
        );
        w.deadline_ms = Some(p.retry_at_ms);
        w.on_deadline = Some(OnDeadline::Retry);
        w.last_error = Some(p.error.clone());
        return with_turn_deadline(w, t);
    }
    let held = st
        .meta
        .held
        .as_deref()
        .filter(|_| crate::machine::held_until(&st.meta, t).is_some());
    let w = match (held, t.phase) {
        (Some(held), _) => held_wait(t, held, fmt_ms),
        (None, Phase::Queued | Phase::AwaitingWorker | Phase::Done) => {
            awaiting_worker(t, dispatch_timeout_ms, fmt_ms, supply)
        }
        (None, Phase::BackingOff) => {
            let mut w = base_wait(
                WaitState::BackingOff,
                format!(
                    "attempt {} of step {} failed ({}); retrying at {}",
                    t.attempt,
                    t.step,
                    t.last_error.as_deref().unwrap_or("retryable failure"),
                    fmt_ms(t.retry_at_ms.unwrap_or(0))
                ),
                t.phase_since_ms,
            );
            w.deadline_ms = t.retry_at_ms;
            w.on_deadline = Some(OnDeadline::Retry);
            w.last_error = t.last_error.clone();
            w
        }
        (None, Phase::Invoked) => match &st.inv {
            Some(inv) => inv_wait(t, inv, fmt_ms),
            None => base_wait(
                WaitState::AwaitingWorker,
                "invocation record missing; waiting to dispatch again".into(),
                t.phase_since_ms,
            ),
        },
    };
    with_turn_deadline(w, t)
}

fn with_turn_deadline(mut w: Wait, t: &TurnRecord) -> Wait {
    if let Some(d) = t.deadline_ms {
        if w.deadline_ms.map(|x| d < x).unwrap_or(true) {
            w.deadline_ms = Some(d);
            w.on_deadline = Some(OnDeadline::Fail);
            w.reason.push_str(" (the turn's own deadline comes first)");
        }
    }
    w
}

fn inv_wait(t: &TurnRecord, inv: &InvocationRecord, fmt_ms: &dyn Fn(u64) -> String) -> Wait {
    let id = &inv.invocation_id;
    let (state, reason, on) = match inv.wait {
        InvWait::AwaitingResult => (
            WaitState::AwaitingResult,
            format!(
                "awaiting result of {id} ({}) from worker {} since {}",
                t.function_id,
                inv.worker_id,
                fmt_ms(inv.wait_since_ms)
            ),
            OnDeadline::Probe,
        ),
        InvWait::Probing => (
            WaitState::AwaitingResult,
            format!(
                "deadline of {id} passed; probe sent to worker {} at {}, awaiting its status",
                inv.worker_id,
                fmt_ms(inv.wait_since_ms)
            ),
            on_unknown(inv),
        ),
        InvWait::AwaitingResend => (
            WaitState::AwaitingResult,
            format!(
                "worker {} reported {id} finished at {}; awaiting the resent result",
                inv.worker_id,
                fmt_ms(inv.wait_since_ms)
            ),
            on_unknown(inv),
        ),
        InvWait::Cancelling => (
            WaitState::Cancelling,
            if t.stop.is_some() {
                format!(
                    "stop requested; cancel of {id} sent to worker {} at {}",
                    inv.worker_id,
                    fmt_ms(inv.wait_since_ms)
                )
            } else {
                format!(
                    "{id} ran past its deadline; cancel sent to worker {} at {}",
                    inv.worker_id,
                    fmt_ms(inv.wait_since_ms)
                )
            },
            if t.stop.is_some() {
                OnDeadline::Cancel
            } else if inv.settings.delivery == Delivery::AtLeastOnce
                && inv.attempt < inv.settings.max_attempts
            {
                OnDeadline::Retry
            } else {
                OnDeadline::Fail
            },
        ),
        InvWait::AwaitingReconnect => (
            WaitState::AwaitingReconnect,
            format!(
                "worker {} running {id} is disconnected since {}; awaiting its reconnect",
                inv.worker_id,
                fmt_ms(inv.wait_since_ms)
            ),
            on_unknown(inv),
        ),
    };
    let mut w = base_wait(state, reason, inv.wait_since_ms);
    w.deadline_ms = Some(inv.deadline_ms);
    w.on_deadline = Some(on);
    w.invocation_id = Some(id.clone());
    w.worker_id = Some(inv.worker_id.clone());
    w
}

/// Detail of a dispatch event.
pub fn dispatch_detail(
    inv: &InvocationRecord,
    previous: Option<&str>,
    reason: Option<&str>,
) -> Value {
    let mut d = json!({
        "invocation_id": inv.invocation_id,
        "worker_id": inv.worker_id,
        "step": inv.step,
        "attempt": inv.attempt,
        "deadline_ms": inv.deadline_ms,
    });
    if let Some(p) = previous {
        d["previous_invocation_id"] = json!(p);
    }
    if let Some(r) = reason {
        d["reason"] = json!(r);
    }
    d
}
