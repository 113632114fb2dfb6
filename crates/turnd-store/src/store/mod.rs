//! The typed store the engine reads and writes through: [`Store`] over any [`Kv`].
//! It knows the model's keys and records, and nothing of how a store keeps them:
//! lookups of turns (live or folded), invocations, idempotency keys and sessions'
//! metas, a session's turn list and events (passing over those of turns retention
//! deleted, with [`hidden`] remembering where they end), and paged scans.

mod hidden;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::Arc;

use turnd_proto::Event;

use crate::error::StoreError;
use crate::kv::Kv;
use crate::model::events::{event_heads, event_value};
use crate::model::keys::{self, next_page};
use crate::model::records::{
    decode, FoldedHead, FoldedTurn, IdempotencyRecord, InvocationRecord, RawJson, SessionKeys,
    SessionMeta, TurnHead, TurnRecord,
};
use crate::model::Batch;

/// The turn id a session's turn-list entry holds.
fn turn_index_id(v: Vec<u8>) -> Result<String, StoreError> {
    String::from_utf8(v).map_err(|e| StoreError::Corrupt(format!("turn index: {e}")))
}

/// The typed store the engine uses.
#[derive(Clone)]
pub struct Store {
    kv: Arc<dyn Kv>,
    /// Where reads found each session's visible events to start ([`hidden`]).
    marks: Arc<hidden::Marks>,
}

impl Store {
    pub fn new(kv: Arc<dyn Kv>) -> Self {
        Store {
            kv,
            marks: Arc::default(),
        }
    }

    pub fn kv(&self) -> &Arc<dyn Kv> {
        &self.kv
    }

    /// Queue a batch for group commit and wait until it is durable.
    pub async fn commit(&self, batch: Batch) -> Result<(), StoreError> {
        match self.kv.commit(batch).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Closed),
        }
    }

    pub fn sync(&self) -> Result<(), StoreError> {
        self.kv.sync()
    }

    /// A finished turn's folded record.
    pub fn finished(&self, turn_id: &str) -> Result<Option<FoldedTurn>, StoreError> {
        self.kv
            .get(&keys::finished(turn_id))?
            .map(|b| decode("finished turn", &b))
            .transpose()
    }

    /// A turn's record as stored: a finished turn's from its folded record, else its
    /// own (where an input stored apart is not read back: `input` is empty then).
    /// [`Store::turn`] reads the whole turn.
    ///
    /// The turn's own key is read before its folded record: a turn that finishes
    /// moves from the one to the other in one atomic batch, and a folded record is
    /// deleted only by retention, so in this order a read racing the turn's end
    /// finds it in one place or the other (the other order can miss it in both).
    pub fn turn_record(&self, turn_id: &str) -> Result<Option<TurnRecord>, StoreError> {
        if let Some(t) = self.separate_turn_record(turn_id)? {
            return Ok(Some(t));
        }
        Ok(self.finished(turn_id)?.map(|f| f.turn))
    }

    /// A turn's record under its own key, where an unfinished turn's is (a finished
    /// turn's is folded: [`Store::finished`]).
    pub fn separate_turn_record(&self, turn_id: &str) -> Result<Option<TurnRecord>, StoreError> {
        self.kv
            .get(&keys::turn(turn_id))?
            .map(|b| decode("turn", &b))
            .transpose()
    }

    /// Whether a turn is stored, in either form.
    pub fn turn_exists(&self, turn_id: &str) -> Result<bool, StoreError> {
        // Its own key first, as in [`Store::turn_record`].
        Ok(self.kv.get(&keys::turn(turn_id))?.is_some()
            || self.kv.get(&keys::finished(turn_id))?.is_some())
    }

    /// [`Store::turn_exists`], remembered in `known` for the turns already asked
    /// about (reads that meet a turn's events many times ask once). An empty turn id
    /// (an event of no turn) counts as stored.
    pub fn turn_stored(
        &self,
        turn_id: &str,
        known: &mut HashMap<String, bool>,
    ) -> Result<bool, StoreError> {
        if turn_id.is_empty() {
            return Ok(true);
        }
        if let Some(k) = known.get(turn_id) {
            return Ok(*k);
        }
        let k = self.turn_exists(turn_id)?;
        known.insert(turn_id.to_string(), k);
        Ok(k)
    }

    /// A whole turn, finished (folded) or not. Its own keys are read first, as in
    /// [`Store::turn_record`]; an input stored apart that is gone by the time it is
    /// read means the turn finished meanwhile, and its folded record has it.
    pub fn turn(&self, turn_id: &str) -> Result<Option<TurnRecord>, StoreError> {
        let Some(mut t) = self.separate_turn_record(turn_id)? else {
            return Ok(self.finished(turn_id)?.map(|f| f.turn));
        };
        if !t.input.is_apart() {
            return Ok(Some(t));
        }
        if let Some(raw) = self
            .kv
            .get(&keys::turn_input(turn_id))?
            .and_then(|b| RawJson::from_stored(&b))
        {
            t.input.fill(raw);
            return Ok(Some(t));
        }
        match self.finished(turn_id)? {
            Some(f) => Ok(Some(f.turn)),
            None => Err(StoreError::Corrupt(format!(
                "turn {turn_id}: its input, stored apart, is missing or not JSON"
            ))),
        }
    }

    /// An invocation: under its own key, or folded into its finished turn (found by
    /// the turn id its invocation id names, [`turnd_proto::invocation_turn_id`]).
    pub fn invocation(&self, invocation_id: &str) -> Result<Option<InvocationRecord>, StoreError> {
        if let Some(b) = self.kv.get(&keys::invocation(invocation_id))? {
            return decode("invocation", &b).map(Some);
        }
        let Some(turn_id) = turnd_proto::invocation_turn_id(invocation_id) else {
            return Ok(None);
        };
        Ok(self.finished(&turn_id)?.and_then(|f| {
            f.invocations
                .into_iter()
                .find(|i| i.invocation_id == invocation_id)
        }))
    }

    /// The record of a session's idempotency key.
    pub fn idempotency(
        &self,
        s: SessionKeys<'_>,
        key: &str,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        Ok(self.idempotency_entry(s, key)?.map(|(_, r)| r))
    }

    /// A session's idempotency key as stored (with its route, or without one when its
    /// turn id is not minted), and its record.
    pub fn idempotency_entry(
        &self,
        s: SessionKeys<'_>,
        key: &str,
    ) -> Result<Option<(Vec<u8>, IdempotencyRecord)>, StoreError> {
        let (start, end) = keys::idempotency_range(s.id, key);
        match self.kv.scan_one(&start, &end, s.from_ms)? {
            Some((k, v)) => Ok(Some((k, decode("idempotency key", &v)?))),
            None => Ok(None),
        }
    }

    pub fn session_meta(&self, session_id: &str) -> Result<Option<SessionMeta>, StoreError> {
        self.kv
            .get(&keys::session_meta(session_id))?
            .map(|b| decode("session meta", &b))
            .transpose()
    }

    /// Events of a session with `seq > after`, ascending, at most `limit`: those of
    /// its stored turns (and of no turn). Retention deletes an expired turn's record
    /// and leaves the event values in time windows to the window's drop
    /// (`engine/retention/plan.rs`), so the events of a turn that is gone are passed over
    /// here.
    pub fn events(
        &self,
        s: SessionKeys<'_>,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        // Events up to the session's mark are all hidden ([`hidden`]); a read that
        // starts at or before it goes on the mark from there while it meets only
        // hidden events.
        let start = self.marks.start(s.id);
        // The end of the run of hidden events from the mark on, while it lasts.
        let mut hidden_to = start.mark;
        let mut in_run = after <= start.mark;
        let mut after = after.max(start.mark);
        let mut out = Vec::new();
        let mut stored: HashMap<String, bool> = HashMap::new();
        while out.len() < limit {
            let want = limit - out.len();
            let page = self.stored_events(s, after, want)?;
            let Some(last) = page.last().map(|e| e.seq) else {
                break;
            };
            let full = page.len() == want;
            for e in page {
                if self.turn_stored(&e.turn_id, &mut stored)? {
                    in_run = false;
                    out.push(e);
                } else if in_run {
                    hidden_to = e.seq;
                }
            }
            if !full {
                break;
            }
            after = last;
        }
        if hidden_to > start.mark {
            self.marks.record(s.id, start, hidden_to);
        }
        Ok(out)
    }

    /// The session was forgotten, and the batch that forgot it is committed: it may
    /// be used again from `seq` 1, so what reads remembered of its events goes.
    pub fn forgot_session(&self, session_id: &str) {
        self.marks.forgot(session_id);
    }

    /// Events of a session with `seq > after` as stored, ascending, at most `limit`:
    /// with those of turns retention deleted whose values are still stored
    /// ([`Store::events`] passes over them).
    pub fn stored_events(
        &self,
        s: SessionKeys<'_>,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        self.stored_items(s, after, limit, |v, out| {
            out.extend(event_value(v)?.into_iter().map(|e| (e.seq, e)));
            Ok(())
        })
    }

    /// The turn id of every event of a session with `seq > after` as stored, in
    /// `seq` order: [`Store::stored_events`] without building the rest of each event.
    pub fn stored_event_turns(
        &self,
        s: SessionKeys<'_>,
        after: u64,
    ) -> Result<Vec<String>, StoreError> {
        self.stored_items(s, after, usize::MAX, |v, out| {
            let heads = event_heads(v)?;
            out.extend(heads.into_iter().map(|h| (h.seq, h.turn_id.into_owned())));
            Ok(())
        })
    }

    /// The items `items_of` makes of the stored events of a session with
    /// `seq > after`, ascending by the `seq` each is paired with, at most `limit`.
    fn stored_items<T>(
        &self,
        s: SessionKeys<'_>,
        after: u64,
        limit: usize,
        items_of: impl Fn(&[u8], &mut Vec<(u64, T)>) -> Result<(), StoreError>,
    ) -> Result<Vec<T>, StoreError> {
        let session_id = s.id;
        // A stored value holds one or more events and is keyed by its last one, so
        // the scan starts at the first value that may hold `after + 1`. Values are
        // read in small pages: each holds at least one wanted event, and the first
        // may already fill `limit`.
        const PAGE: usize = 16;
        let mut from = keys::event(session_id, after.saturating_add(1));
        let end = keys::event_end(session_id);
        let mut out = Vec::new();
        let mut items = Vec::new();
        // Events are read in `seq` order, and each once: a page may meet events of an
        // earlier page again, when the store wrote several values as one between the
        // two (see `logged/runs.rs`).
        let mut last = after;
        while out.len() < limit {
            let n = PAGE.min(limit - out.len());
            let page = self.kv.scan_session(&from, &end, false, n, s.from_ms)?;
            for (_, v) in &page {
                items_of(v, &mut items)?;
                for (seq, item) in items.drain(..) {
                    if seq > last {
                        last = seq;
                        out.push(item);
                    }
                }
            }
            match next_page(&page, n) {
                Some(next) => from = next,
                None => break,
            }
        }
        out.truncate(limit);
        Ok(out)
    }

    /// Up to `limit` finished turns' folded records in key order (turn ids are
    /// UUIDv7, so oldest first) from `from` on ([`Store::FIRST`]: the first), as
    /// [`FoldedHead`]s, and where the next page starts.
    pub fn finished_page(
        &self,
        from: &[u8],
        limit: usize,
    ) -> Result<(Vec<FoldedHead>, Option<Vec<u8>>), StoreError> {
        self.decoded_page("finished turn", keys::finished_range(), from, limit)
    }

    /// Up to `limit` turn records under their own keys in key order (turn ids are
    /// UUIDv7, so oldest first) from `from` on ([`Store::FIRST`]: the first), as
    /// [`TurnHead`]s, and where the next page starts: the turns stored under their own
    /// keys (unfinished ones; a finished turn is folded).
    pub fn turns_page(
        &self,
        from: &[u8],
        limit: usize,
    ) -> Result<(Vec<TurnHead>, Option<Vec<u8>>), StoreError> {
        self.decoded_page("turn", keys::turn_range(), from, limit)
    }

    /// Up to `limit` stored event values of a session from key `from` on (None: its
    /// first), each with its key, and where the next page starts.
    #[allow(clippy::type_complexity)]
    pub fn event_values_page(
        &self,
        s: SessionKeys<'_>,
        from: Option<&[u8]>,
        limit: usize,
    ) -> Result<(Vec<(Vec<u8>, Vec<Event>)>, Option<Vec<u8>>), StoreError> {
        let start = keys::event(s.id, 0);
        let end = keys::event_end(s.id);
        let page = self
            .kv
            .scan_session(from.unwrap_or(&start), &end, false, limit, s.from_ms)?;
        let next = next_page(&page, limit);
        let values = page
            .into_iter()
            .map(|(k, v)| event_value(&v).map(|g| (k, g)))
            .collect::<Result<_, StoreError>>()?;
        Ok((values, next))
    }

    /// Turn ids of a session with `seq < before`, newest first, at most `limit`.
    pub fn session_turn_ids(
        &self,
        s: SessionKeys<'_>,
        before: u64,
        limit: usize,
    ) -> Result<Vec<(u64, String)>, StoreError> {
        Ok(self
            .list_entries(s, 0, before, true, limit)?
            .into_iter()
            .map(|(_, seq, id)| (seq, id))
            .collect())
    }

    /// Entries of a session's turn list with `from <= seq < to`, as `(key as stored,
    /// seq, turn id)`, ascending (descending when `reverse`), at most `limit`.
    pub fn list_entries(
        &self,
        s: SessionKeys<'_>,
        from: u64,
        to: u64,
        reverse: bool,
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, u64, String)>, StoreError> {
        let start = keys::session_turn(s.id, from);
        let end = keys::session_turn(s.id, to);
        self.kv
            .scan_session(&start, &end, reverse, limit, s.from_ms)?
            .into_iter()
            .map(|(k, v)| {
                let seq = keys::seq_suffix(&k)?;
                Ok((k, seq, turn_index_id(v)?))
            })
            .collect()
    }

    /// The turn id a session's turn list holds at `seq`.
    pub fn list_entry(&self, s: SessionKeys<'_>, seq: u64) -> Result<Option<String>, StoreError> {
        let start = keys::session_turn(s.id, seq);
        let end = keys::session_turn(s.id, seq.saturating_add(1));
        self.kv
            .scan_one(&start, &end, s.from_ms)?
            .map(|(_, v)| turn_index_id(v))
            .transpose()
    }

    /// Up to `limit` session metas with keys from `from` on (start with
    /// [`Store::FIRST`]), and where the next page starts (None: no more).
    pub fn session_metas_page(
        &self,
        from: &[u8],
        limit: usize,
    ) -> Result<(Vec<SessionMeta>, Option<Vec<u8>>), StoreError> {
        self.decoded_page("session meta", keys::session_meta_range(), from, limit)
    }

    /// The unfinished turns of a session, read from its turn list from the meta's
    /// [`SessionMeta::active_from`] on (turns stopped out of order in that range are
    /// skipped).
    pub fn unfinished_turns(&self, meta: &SessionMeta) -> Result<Vec<TurnRecord>, StoreError> {
        let Some(from) = meta.active_from else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        let ids = if from >= meta.last_turn_seq {
            // The common case, one unfinished turn and nothing after it: a lookup that
            // stops at the window holding it (a scan reads every window of the
            // session's time).
            self.list_entry(meta.keys(), from)?
                .map(|id| vec![(from, id)])
                .unwrap_or_default()
        } else {
            let to = meta.last_turn_seq.saturating_add(1);
            self.list_entries(meta.keys(), from, to, false, usize::MAX)?
                .into_iter()
                .map(|(_, seq, id)| (seq, id))
                .collect()
        };
        for (seq, id) in ids {
            let t = self.turn(&id)?.ok_or_else(|| {
                StoreError::Corrupt(format!(
                    "session {} lists missing turn {id} at seq {seq}",
                    meta.session_id
                ))
            })?;
            if !t.status.is_terminal() {
                out.push(t);
            }
        }
        Ok(out)
    }

    /// Where a paged scan starts.
    pub const FIRST: &'static [u8] = &[];

    /// Up to `limit` records of `range` with keys from `from` on ([`Store::FIRST`]:
    /// the range's start), decoded as `what`, and where the next page starts (None:
    /// no more).
    fn decoded_page<T: serde::de::DeserializeOwned>(
        &self,
        what: &str,
        (start, end): (Vec<u8>, Vec<u8>),
        from: &[u8],
        limit: usize,
    ) -> Result<(Vec<T>, Option<Vec<u8>>), StoreError> {
        let from = if from.is_empty() { &start[..] } else { from };
        let page = self.kv.scan(from, &end, false, limit)?;
        let next = next_page(&page, limit);
        let records = page
            .iter()
            .map(|(_, v)| decode(what, v))
            .collect::<Result<_, _>>()?;
        Ok((records, next))
    }

    /// All session metas (used by the checker and for listing).
    pub fn session_metas(&self) -> Result<Vec<SessionMeta>, StoreError> {
        let (start, end) = keys::session_meta_range();
        self.kv
            .scan(&start, &end, false, usize::MAX)?
            .iter()
            .map(|(_, v)| decode("session meta", v))
            .collect()
    }
}
