//! The overlay a transition is built in, on top of the session's unchanged state:
//! the changed turns, the invocation writes, the new events, the next live
//! invocation, and what the transition leaves to the shell (its effects, the slots
//! it ended, the dispatch it wants). [`Tx::batch`] is its durable write and
//! [`Tx::apply`], run once that write is durable, the one way a session's records
//! change in memory.

use std::collections::{BTreeMap, HashMap};

use serde_json::Value;
use turnd_proto::{Event, EventKind, TurnStatus};
use turnd_store::{
    Batch, FoldedTurn, IdempotencyRecord, InvocationRecord, RawJson, SessionMeta, TurnRecord,
};

use super::{Effect, Slot, Want};
use crate::session::SessionState;

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
    /// The transition's events, each detail as the JSON text it is stored and
    /// pushed as.
    pub events: Vec<Event<RawJson>>,
    /// What to do once the transaction is durable.
    pub effects: Vec<Effect>,
    /// The slots of the invocations this transaction ended, for the engine to free.
    pub frees: Vec<Slot>,
    /// The step this transaction wants dispatched; the engine answers with
    /// [`super::grant`].
    pub dispatch: Option<Want>,
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

    /// Add an event to the transition, its detail written as JSON text
    /// (`machine/details.rs` writes the details of the events every turn has).
    pub fn event(&mut self, session_id: &str, turn_id: &str, kind: EventKind, detail: RawJson) {
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

    /// [`Tx::event`] of a detail built as a [`Value`]: the rarer events'.
    pub fn event_value(&mut self, session_id: &str, turn_id: &str, kind: EventKind, detail: Value) {
        self.event(session_id, turn_id, kind, RawJson::from_value(&detail));
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

    /// Apply a committed transaction to the state: the one way a session's records
    /// change. Returns the status changes (from, to) for global counters and the
    /// turns that became terminal.
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
        Applied {
            shifts,
            terminal,
            admitted,
            events: self.events,
            effects: self.effects,
        }
    }
}

/// What applying a transaction changed, for the shell to carry on with.
pub struct Applied {
    pub shifts: Vec<(Option<TurnStatus>, TurnStatus)>,
    /// Turns that are terminal after the transaction, as written.
    pub terminal: Vec<TurnRecord>,
    /// Id bits ([`turnd_proto::turn_id_bits`]) of the turns the transaction admitted
    /// and left unfinished.
    pub admitted: Vec<u128>,
    pub events: Vec<Event<RawJson>>,
    pub effects: Vec<Effect>,
}
