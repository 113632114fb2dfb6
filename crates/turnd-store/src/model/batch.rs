//! What one transition writes: a [`Batch`] of key-value operations, applied
//! atomically by every store, built by the engine through typed puts (a turn's
//! record, its admission, its folded record once finished, events, idempotency
//! keys, a session's meta) so that every key takes its form from [`super::keys`].

use turnd_proto::Event;

use super::events::EVENTS_PER_VALUE;
use super::keys;
use super::records::{FoldedTurn, IdempotencyRecord, InvocationRecord, SessionMeta, TurnRecord};

/// One key-value operation of a batch.
#[derive(Debug, Clone)]
pub enum KvOp {
    Put(Vec<u8>, Vec<u8>),
    Delete(Vec<u8>),
}

/// An atomic set of key-value operations: all of it becomes durable, or none.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    pub ops: Vec<KvOp>,
    /// The earliest time of a turn that a routed key put by this batch was written
    /// for ([`Batch::routed_from`]).
    routed_from: Option<u64>,
    /// Indices in `ops` of the puts that create their key: a record under an id
    /// minted for it, which no store holds yet ([`Batch::put_new_turn`]).
    created: Vec<usize>,
}

impl Batch {
    pub fn new() -> Self {
        Batch::default()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The operations, and the indices among them of the puts that create their key
    /// ([`Batch::put_new_turn`]).
    pub(crate) fn into_parts(self) -> (Vec<KvOp>, Vec<usize>) {
        (self.ops, self.created)
    }

    pub fn put_raw(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.ops.push(KvOp::Put(key, value));
    }

    pub fn delete(&mut self, key: Vec<u8>) {
        self.ops.push(KvOp::Delete(key));
    }

    /// Mark the op just added as creating its key. A store may use the marks to
    /// skip deleting, later, a key whose every write it still holds itself;
    /// treating every put as not creating is always correct.
    pub(crate) fn created_last(&mut self) {
        if let Some(i) = self.ops.len().checked_sub(1) {
            self.created.push(i);
        }
    }

    /// Drop the time window starting at `start_ms` (see [`crate::windows`]): its finished
    /// turns' records are gone from reads once this batch is committed, and its
    /// directory is deleted once the drop is durable in the main database.
    pub fn drop_window(&mut self, start_ms: u64) {
        self.put_raw(keys::dropped_key(start_ms), Vec::new());
    }

    fn put_json<T: serde::Serialize>(&mut self, key: Vec<u8>, value: &T) {
        // Serializing our own record types cannot fail: they hold no maps with
        // non-string keys and no foreign Serialize impls.
        // Sized for a typical record up front: growing from empty took several
        // reallocations per record.
        let mut bytes = Vec::with_capacity(RECORD_CAPACITY);
        serde_json::to_writer(&mut bytes, value).expect("records serialize to JSON");
        self.put_raw(key, bytes);
    }

    /// Write a turn record. (Where recovery starts in the session's turn list is the
    /// session meta's [`SessionMeta::active_from`], written with every transition.)
    pub fn put_turn(&mut self, t: &TurnRecord) {
        self.put_json(keys::turn(&t.turn_id), t);
    }

    /// [`Batch::put_turn`] of a turn being admitted: its id was minted for it, so no
    /// store holds its key yet.
    pub fn put_new_turn(&mut self, t: &TurnRecord) {
        self.put_turn(t);
        self.created_last();
    }

    /// The keys written once, when a turn is admitted: its place in its session's
    /// list and, when stored apart, its input. (Its record is written by `put_turn`,
    /// at admission and at every later transition.)
    pub fn put_admission(&mut self, t: &TurnRecord) {
        self.put_list_entry(t);
        if t.input.is_apart() {
            self.put_raw(
                keys::turn_input(&t.turn_id),
                t.input.as_str().as_bytes().to_vec(),
            );
        }
    }

    /// A turn's place in its session's turn list, routed by the turn.
    pub fn put_list_entry(&mut self, t: &TurnRecord) {
        self.note_routed(keys::route_of(&t.turn_id));
        self.put_raw(
            keys::session_turn_of(&t.session_id, t.seq, &t.turn_id),
            t.turn_id.as_bytes().to_vec(),
        );
    }

    fn note_routed(&mut self, ms: Option<u64>) {
        if let Some(ms) = ms {
            self.routed_from = Some(self.routed_from.map_or(ms, |m| m.min(ms)));
        }
    }

    /// The earliest time of a turn a routed key of this batch was written for: every
    /// turn of its routed event values counts, not only the newest that routes each,
    /// so that a value written again without some of its events (by retention) is
    /// routed at or after it too. The session's meta records it
    /// ([`SessionMeta::routed_at`]) in the same batch.
    pub fn routed_from(&self) -> Option<u64> {
        self.routed_from
    }

    /// Write a finished turn's folded record in place of its separate keys: its
    /// record, its input stored apart (when it was) and the records of the invocations
    /// folded in are deleted in the same batch.
    pub fn put_finished(&mut self, f: &FoldedTurn, input_apart: bool) {
        let id = &f.turn.turn_id;
        self.put_json(keys::finished(id), f);
        self.delete(keys::turn(id));
        if input_apart {
            self.delete(keys::turn_input(id));
        }
        for i in &f.invocations {
            self.delete(keys::invocation(&i.invocation_id));
        }
    }

    pub fn put_invocation(&mut self, inv: &InvocationRecord) {
        self.put_json(keys::invocation(&inv.invocation_id), inv);
    }

    /// [`Batch::put_invocation`] of an invocation being dispatched: its id was
    /// minted for it, so no store holds its key yet.
    pub fn put_new_invocation(&mut self, inv: &InvocationRecord) {
        self.put_invocation(inv);
        self.created_last();
    }

    /// Write the events of one transition: consecutive events of one session, stored
    /// as values of up to [`EVENTS_PER_VALUE`] events, each under the key of its last
    /// event (a single event as itself, several as an array). sled's cost is per key,
    /// and a transition often writes three; the cap keeps a read of one event from
    /// decoding thousands (a `session.stop` of a long queue writes two per turn).
    ///
    /// A value is routed by the newest turn among its events (see [`keys`]), when
    /// every one of them is a minted turn id; otherwise it has no route.
    pub fn put_events<D: serde::Serialize>(&mut self, events: &[Event<D>]) {
        let from = self.ops.len();
        self.put_events_in(events, true);
        // A transition's events have `seq`s the session never had: their keys are new.
        self.created.extend(from..self.ops.len());
    }

    /// [`Batch::put_events`], with no route when `routed` is false: retention writes a
    /// value that had no route (one holding an event of a turn id that is not minted)
    /// again in the same form, so that it stays where reads of the session look.
    pub fn put_events_in<D: serde::Serialize>(&mut self, events: &[Event<D>], routed: bool) {
        for group in events.chunks(EVENTS_PER_VALUE) {
            let Some(last) = group.last() else { continue };
            let route = if routed {
                self.events_route(group)
            } else {
                None
            };
            let key = keys::event_routed(&last.session_id, last.seq, route);
            match group {
                [e] => self.put_json(key, e),
                _ => self.put_json(key, &group),
            }
        }
    }

    /// The route of an event value: its newest turn's time, noting every turn's.
    fn events_route<D>(&mut self, group: &[Event<D>]) -> Option<u64> {
        let (mut oldest, mut newest) = (u64::MAX, 0);
        for e in group {
            let ms = keys::route_of(&e.turn_id)?;
            oldest = oldest.min(ms);
            newest = newest.max(ms);
        }
        self.note_routed(Some(oldest));
        Some(newest)
    }

    /// An idempotency key, routed by the turn it names.
    pub fn put_idempotency(&mut self, session_id: &str, key: &str, rec: &IdempotencyRecord) {
        self.note_routed(keys::route_of(&rec.turn_id));
        self.put_json(keys::idempotency_of(session_id, key, &rec.turn_id), rec);
    }

    pub fn put_session_meta(&mut self, m: &SessionMeta) {
        self.put_json(keys::session_meta(&m.session_id), m);
    }
}

/// Bytes reserved for one record's JSON before it is written (most are smaller).
const RECORD_CAPACITY: usize = 512;
