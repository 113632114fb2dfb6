//! What a sweep reads and deletes for one session's expired turns: gathering them
//! (oldest first), the deletes of their own keys, and the events taken out of the
//! session's stored values when a turn is not left to its window (see the parent
//! module's doc).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use serde_json::Value;
use turnd_proto::{Event, EventKind, TurnCounts, TurnStatus};
use turnd_store::{keys, Batch, SessionKeys, Store, StoreError};

use super::drops::Open;
use super::invocations::Early;
use crate::machine::total;

/// Turn records read per page of a sweep.
pub(super) const TURN_PAGE: usize = 512;

/// Most turns a sweep gathers before it deletes them (and reads on). Each batch reads
/// every session it touches from the session's first stored event value, so a
/// smaller batch reads the same values again: with 4096, a sweep at 10,000 turns/s
/// (100 sessions) deleted about half as many turns per second as this one and fell
/// behind (`docs/benchmarks.md`). A batch holds about 200 bytes per turn while it is
/// deleted.
pub(super) const SWEEP_BATCH: usize = 16384;

/// Event values read per page of a session's event scan.
pub(super) const EVENT_PAGE: usize = 64;

/// A terminal turn to delete, as the sweep read it.
pub(super) struct Expired {
    pub(super) turn_id: String,
    pub(super) seq: u64,
    pub(super) status: TurnStatus,
    pub(super) idempotency_key: Option<String>,
    pub(super) invocation_id: Option<String>,
    /// Read from its folded record: the invocations folded into it. Folding deleted
    /// the turn's own record, its input stored apart and these invocations' keys in
    /// the same batch, so none of them is deleted again (a delete of a key that is not
    /// there still takes a place in the commit log, the overlay and the applier's
    /// sled work).
    pub(super) folded: Vec<String>,
}

/// What deleting one session's expired turns writes, read without its lock.
pub(super) struct Plan {
    pub(super) batch: Batch,
    pub(super) gone: HashSet<String>,
    pub(super) statuses: Vec<TurnStatus>,
    pub(super) pruned: bool,
    /// Keys of every event value of the session (read only when the session was
    /// expected to be left with no turn, to forget it).
    pub(super) all_values: Option<Vec<Vec<u8>>>,
    /// Keys of every entry of its turn list (read with `all_values`).
    pub(super) all_entries: Option<Vec<Vec<u8>>>,
}

/// What a sweep read of a session under its lock before planning its deletes.
pub(super) struct Planned {
    pub(super) counts: TurnCounts,
    pub(super) active_from: Option<u64>,
    pub(super) open: Arc<Open>,
    pub(super) early: Arc<Early>,
}

/// From `from` on ([`Store::FIRST`]: the first), the expired turns of up to
/// [`SWEEP_BATCH`] (a page more at most), by session, and where the next gathering
/// starts (None: past the cutoff or at the end). They are read from finished turns'
/// folded records (`F` keys), oldest first: every finished turn is folded, and a
/// turn cannot have finished before it was created.
#[allow(clippy::type_complexity)]
pub(super) fn gather(
    store: &Store,
    mut from: Vec<u8>,
    cutoff: u64,
) -> Result<(BTreeMap<String, Vec<Expired>>, Option<Vec<u8>>), StoreError> {
    let mut by_session: BTreeMap<String, Vec<Expired>> = BTreeMap::new();
    let mut n = 0;
    loop {
        let (page, next) = store.finished_page(&from, TURN_PAGE)?;
        let mut past_cutoff = false;
        for f in page {
            let t = f.turn;
            if t.created_at_ms > cutoff {
                past_cutoff = true;
                break;
            }
            if t.status.is_terminal() && t.finished_at_ms.is_some_and(|f| f <= cutoff) {
                n += 1;
                by_session.entry(t.session_id).or_default().push(Expired {
                    turn_id: t.turn_id,
                    seq: t.seq,
                    status: t.status,
                    idempotency_key: t.idempotency_key,
                    invocation_id: t.invocation_id,
                    folded: f.invocations.into_iter().map(|i| i.invocation_id).collect(),
                });
            }
        }
        match next.filter(|_| !past_cutoff) {
            Some(next) if n < SWEEP_BATCH => from = next,
            next => return Ok((by_session, next)),
        }
    }
}

/// What [`delete_turns`] found: the turns deleted, their statuses, and the
/// invocations folded into their records (whose own keys are gone already).
pub(super) struct Deleted {
    pub(super) gone: HashSet<String>,
    pub(super) statuses: Vec<TurnStatus>,
    pub(super) folded: HashSet<String>,
    /// Every one's list entry and event values are left to its window's drop.
    pub(super) all_left: bool,
    /// Some one's are.
    pub(super) any_left: bool,
}

/// The keys of the expired turns' places in the session's turn list, as stored (with
/// a route, or without one when the turn's id is not a minted one), read in one scan.
pub(super) fn list_keys(
    store: &Store,
    s: SessionKeys<'_>,
    expired: &[Expired],
) -> Result<HashMap<u64, Vec<u8>>, StoreError> {
    let (Some(first), Some(last)) = (
        expired.iter().map(|t| t.seq).min(),
        expired.iter().map(|t| t.seq).max(),
    ) else {
        return Ok(HashMap::new());
    };
    let wanted: HashMap<u64, &str> = expired
        .iter()
        .map(|t| (t.seq, t.turn_id.as_str()))
        .collect();
    Ok(store
        .list_entries(s, first, last.saturating_add(1), false, usize::MAX)?
        .into_iter()
        .filter(|(_, seq, id)| wanted.get(seq) == Some(&id.as_str()))
        .map(|(k, seq, _)| (seq, k))
        .collect())
}

/// Whether an expired turn's list entry and event values are left for its window's
/// drop: its keys are in an open window, and it comes before the session's first
/// unfinished turn (`active_from`), where recovery reads the turn list from (an entry
/// of a deleted turn there would name no turn).
pub(super) fn left_to_window(t: &Expired, open: &Open, active_from: Option<u64>) -> bool {
    open.holds(keys::route_of(&t.turn_id)) && active_from.is_none_or(|a| t.seq < a)
}

/// The deletes of the expired turns' own keys: their records, their idempotency keys
/// (while these still name them), their last invocations (unless folded into their
/// records) and their places in the session's turn list, unless left to their
/// window's drop ([`left_to_window`]).
pub(super) fn delete_turns(
    store: &Store,
    s: SessionKeys<'_>,
    expired: Vec<Expired>,
    at: &Planned,
    b: &mut Batch,
) -> Result<Deleted, StoreError> {
    let (open, active_from) = (&*at.open, at.active_from);
    let mut gone: HashSet<String> = HashSet::new();
    let mut statuses = Vec::new();
    let mut folded_invs: HashSet<String> = HashSet::new();
    let (left, deleted): (Vec<Expired>, Vec<Expired>) = expired
        .into_iter()
        .partition(|t| left_to_window(t, open, active_from));
    let mut listed = list_keys(store, s, &deleted)?;
    let all_left = deleted.is_empty();
    let any_left = !left.is_empty();
    for t in deleted.into_iter().chain(left) {
        b.delete(keys::finished(&t.turn_id));
        if let Some(k) = listed.remove(&t.seq) {
            b.delete(k);
        }
        if let Some(k) = &t.idempotency_key {
            if let Some((key, r)) = store.idempotency_entry(s, k)? {
                if r.turn_id == t.turn_id {
                    b.delete(key);
                }
            }
        }
        folded_invs.extend(t.folded);
        // Its earlier steps' and attempts' invocations (its last one is below).
        for k in at.early.get(&t.turn_id).into_iter().flatten() {
            if k.get(1..) != t.invocation_id.as_deref().map(str::as_bytes) {
                b.delete(k.clone());
            }
        }
        if let Some(inv) = &t.invocation_id {
            if !folded_invs.contains(inv) {
                b.delete(keys::invocation(inv));
            }
        }
        statuses.push(t.status);
        gone.insert(t.turn_id);
    }
    Ok(Deleted {
        gone,
        statuses,
        folded: folded_invs,
        all_left,
        any_left,
    })
}

/// Read what deleting `expired` of session `sid` writes (see the module doc).
/// `counts` are the session's counts when the reads began: when the deleted turns
/// are all of them, every event value is read, to forget the session.
pub(super) fn plan(
    store: &Store,
    s: SessionKeys<'_>,
    expired: Vec<Expired>,
    cutoff: u64,
    at: &Planned,
) -> Result<Plan, StoreError> {
    let mut b = Batch::new();
    let Deleted {
        gone,
        statuses,
        folded,
        all_left,
        any_left,
    } = delete_turns(store, s, expired, at, &mut b)?;
    let read_all = total(&at.counts) <= gone.len() as u64;
    let mut all_values = read_all.then(Vec::new);
    // The turns' events are read out of stored values only when one of them is not
    // left to its window (or to forget the session); a turn that is has its events
    // passed over by reads once its record is gone (`Store::events`).
    // The session's stored entries and events may name turns that are gone from now
    // on (`store.check` reads it).
    let mut pruned = any_left;
    if all_left && !read_all {
        return Ok(Plan {
            batch: b,
            gone,
            statuses,
            pruned,
            all_values: None,
            all_entries: None,
        });
    }

    pruned |= prune_events(
        store,
        s,
        cutoff,
        &gone,
        &folded,
        all_values.as_mut(),
        &mut b,
    )?;
    let all_entries = if read_all {
        Some(all_list_keys(store, s)?)
    } else {
        None
    };
    Ok(Plan {
        batch: b,
        gone,
        statuses,
        pruned,
        all_values,
        all_entries,
    })
}

/// The writes that take the events of the turns in `gone` out of the session's stored
/// event values, up to the first value written after the cutoff (every value when
/// `all_values` is given, whose keys it collects: the session is expected to be
/// forgotten), with the invocations their `dispatched` events name (unless folded
/// into their records). Whether it took any event out.
pub(super) fn prune_events(
    store: &Store,
    s: SessionKeys<'_>,
    cutoff: u64,
    gone: &HashSet<String>,
    folded: &HashSet<String>,
    mut all_values: Option<&mut Vec<Vec<u8>>>,
    b: &mut Batch,
) -> Result<bool, StoreError> {
    // Events: up to the first value written after the cutoff (all of them when the
    // session is expected to be forgotten).
    let mut exists: HashMap<String, bool> = HashMap::new();
    // A turn that still has its record remains (unfinished turns have theirs from
    // admission on); one without is gone since an earlier sweep.
    let mut is_gone = |e: &Event| -> Result<bool, StoreError> {
        Ok(gone.contains(&e.turn_id)
            || e.turn_id.is_empty()
            || !store.turn_stored(&e.turn_id, &mut exists)?)
    };
    let mut pruned = false;
    let mut from: Option<Vec<u8>> = None;
    'scan: loop {
        let (values, next) = store.event_values_page(s, from.as_deref(), EVENT_PAGE)?;
        for (key, events) in values {
            if events.first().is_some_and(|e| e.at_ms > cutoff) {
                match all_values.as_deref_mut() {
                    Some(all) => {
                        all.push(key);
                        continue;
                    }
                    None => break 'scan,
                }
            }
            if let Some(all) = all_values.as_deref_mut() {
                all.push(key.clone());
            }
            let mut dead = Vec::new();
            let mut kept = Vec::new();
            for e in events {
                if is_gone(&e)? {
                    dead.push(e);
                } else {
                    kept.push(e);
                }
            }
            if dead.is_empty() {
                continue;
            }
            for e in &dead {
                if e.kind == EventKind::Dispatched {
                    if let Some(inv) = e.detail.get("invocation_id").and_then(Value::as_str) {
                        if !folded.contains(inv) {
                            b.delete(keys::invocation(inv));
                        }
                    }
                }
            }
            pruned = true;
            // Keyed by the last kept event and routed by the newest turn kept (a value
            // without a route, one with an event of a turn id that is not minted, is
            // written again without one); written after the
            // delete, so it wins when that is the same key.
            let routed = keys::session_route(&key).is_some();
            b.delete(key);
            b.put_events_in(&kept, routed);
        }
        match next {
            Some(n) => from = Some(n),
            None => break,
        }
    }
    Ok(pruned)
}

/// Keys of every entry of a session's turn list (a session being forgotten: entries
/// of turns deleted earlier may be left to their windows' drops).
pub(super) fn all_list_keys(store: &Store, s: SessionKeys<'_>) -> Result<Vec<Vec<u8>>, StoreError> {
    Ok(store
        .list_entries(s, 0, u64::MAX, false, usize::MAX)?
        .into_iter()
        .map(|(k, _, _)| k)
        .collect())
}

/// Deletes of every stored event value of `sid` (a session being forgotten).
pub(super) fn delete_all_events(
    store: &Store,
    s: SessionKeys<'_>,
    b: &mut Batch,
) -> Result<(), StoreError> {
    let mut from: Option<Vec<u8>> = None;
    loop {
        let (values, next) = store.event_values_page(s, from.as_deref(), EVENT_PAGE)?;
        for (key, _) in values {
            b.delete(key);
        }
        match next {
            Some(n) => from = Some(n),
            None => return Ok(()),
        }
    }
}

/// Whether an event of `sid` after `after` is about one of the turns in `gone`.
pub(super) fn touched(
    store: &Store,
    s: SessionKeys<'_>,
    after: u64,
    gone: &HashSet<String>,
) -> Result<bool, StoreError> {
    // The events as stored: the turns in `gone` are still stored, and only they
    // matter here.
    Ok(store
        .stored_event_turns(s, after)?
        .iter()
        .any(|turn_id| gone.contains(turn_id)))
}
