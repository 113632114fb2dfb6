//! The applier's rounds: what a round takes from the overlay ([`Taken`]), the runs
//! of a session's event values it writes to sled as one value ([`event_runs`]),
//! what it writes ([`sled_writes`]) and what it then drops from the overlay
//! ([`drop_applied`]).
//!
//! **Why runs.** sled's cost is per key, and a session's event values (one per
//! transition, keyed by its last event's `seq`) are spread over the keyspace by
//! session: two of a one-step turn's four keys, and about half of the applier's
//! time. So consecutive values of one session taken in the same round are written
//! as one array under the key of the last one, which is what one transition with
//! all their events would have written: a read of the events after a `seq` starts
//! at the first value that can hold the next one, whatever the values' sizes.
//!
//! **What may go into a run** ([`event_runs`]), and why each rule:
//!
//! - Only puts of routed event values that are *pristine*: the value a transition
//!   wrote when it created the key, never written again since (by retention). A
//!   transition's values are written once, in `seq` order, so between two pristine
//!   values of a session taken in one round there is no other value of it, in the
//!   overlay or in sled; a value written again (with a later lsn) could sit between
//!   them, and is not in the run's place.
//! - No value the round passed over between two of them (a write waiting for its
//!   delay): the run would jump over it.
//! - Every value but the last *fresh* (sled never had its key): their keys are never
//!   written, so sled must not hold an older value under them.
//! - Only values committed after the mark sled holds (`applied`) and at or before the
//!   one the round records (`mark`). A start after a crash replays, key by key,
//!   every record after the mark sled then holds; were that mark between two values
//!   of a run, the replay would write the later one's own value over the run, and
//!   the earlier one's events would be gone. Values after the mark are all replayed
//!   (each under its own key, as if never merged) and values before it none. Event
//!   values wait for their group to be settled (`delays`), so a round's values are in
//!   that range.
//! - No run of a session whose event values retention is reading and writing again
//!   ([`crate::Kv::hold_event_merges`]): retention writes a value again under the
//!   keys it read, and a run formed meanwhile would move its events to another key.
//! - The last value is routed by the newest turn of all of them (as any value must
//!   be; routes may go down before it, as when queued turns are admitted while
//!   earlier ones end and dispatch the next); the keys span fewer than
//!   [`EVENTS_PER_VALUE`] `seq`s, and the values [`MERGE_BYTES`].
//!
//! **While a run is written** the overlay still holds each of its values under its
//! own key, the last one included, so a read never meets an event twice. A run leaves
//! the overlay whole or not at all ([`drop_applied`]): if any of its values was
//! committed again meanwhile, or retention began to read the session, all of them
//! stay, sled's value under the last key is stale, and the round records a mark
//! before the run's values so that a crash replays them; a later round writes what
//! the overlay holds then. A read of many pages may still meet a run written between
//! two of its pages (its earlier events again, under a later key): readers page by
//! `seq` and skip what they already read (`Store::events`).

use std::collections::{BTreeMap, HashSet};

use super::overlay::{weight, OKey, Pending, Value};
use crate::model::{keys, EVENTS_PER_VALUE};

/// An overlay entry a round of the applier took, as it was when taken.
pub(super) struct Taken {
    pub(super) key: OKey,
    pub(super) lsn: u64,
    pub(super) value: Value,
    pub(super) fresh: bool,
    pub(super) pristine: bool,
    /// The round passed over an entry of the overlay (a write waiting for its delay)
    /// between the one taken before this and this one.
    pub(super) gap_before: bool,
}

impl Taken {
    /// A delete of a key only the overlay ever held: dropped, not written.
    pub(super) fn dropped(&self) -> bool {
        self.fresh && self.value.is_none()
    }
}

/// Consecutive event values of one session that a round writes to sled as one value,
/// under the last one's key: `slice[first..=last]`.
pub(super) struct Run {
    pub(super) first: usize,
    pub(super) last: usize,
    pub(super) value: Vec<u8>,
}

/// Most bytes of event values merged into one.
pub(super) const MERGE_BYTES: usize = 16 * 1024;

/// The session of an event value's key.
fn session(t: &Taken) -> Option<&str> {
    keys::split_session_seq(&t.key).map(|(sid, _, _)| sid)
}

/// The runs of event values in `slice` written to sled as one value each (see the
/// module documentation for the rules): `applied` is the mark sled holds, `mark` the
/// one the round records, `held` the sessions retention is reading.
pub(super) fn event_runs(
    slice: &[Taken],
    applied: u64,
    mark: u64,
    held: &HashSet<String>,
) -> Vec<Run> {
    // The `seq` and route of a value that may be in a run.
    let mergeable = |t: &Taken| -> Option<(u64, u64)> {
        if t.key.first() != Some(&b'E') || !t.pristine || t.lsn <= applied || t.lsn > mark {
            return None;
        }
        t.value.as_ref()?;
        let (sid, seq, route) = keys::split_session_seq(&t.key)?;
        if held.contains(sid) {
            return None;
        }
        Some((seq, route?))
    };
    let mut runs = Vec::new();
    let mut i = 0;
    while i < slice.len() {
        let Some((first_seq, first_route)) = mergeable(&slice[i]) else {
            i += 1;
            continue;
        };
        let sid = session(&slice[i]);
        let mut bytes = slice[i].value.as_ref().map_or(0, |v| v.len());
        // The newest route so far, and the last value that has it (where the run may
        // end: its key is routed by the newest turn of every value before it).
        let (mut newest, mut j) = (first_route, i);
        let mut k = i;
        while slice[k].fresh && k + 1 < slice.len() && !slice[k + 1].gap_before {
            let Some((seq, route)) = mergeable(&slice[k + 1]) else {
                break;
            };
            let len = slice[k + 1].value.as_ref().map_or(0, |v| v.len());
            if session(&slice[k + 1]) != sid
                || seq - first_seq >= EVENTS_PER_VALUE as u64
                || bytes + len > MERGE_BYTES
            {
                break;
            }
            bytes += len;
            k += 1;
            if route >= newest {
                (newest, j) = (route, k);
            }
        }
        if j > i {
            runs.push(Run {
                first: i,
                last: j,
                value: joined(&slice[i..=j]),
            });
        }
        i = j + 1;
    }
    runs
}

/// The events of `values` (each a single event or an array of them) as one array.
fn joined(values: &[Taken]) -> Vec<u8> {
    let bytes: usize = values
        .iter()
        .map(|t| t.value.as_ref().map_or(0, |v| v.len()))
        .sum();
    let mut value = Vec::with_capacity(bytes + 2);
    value.push(b'[');
    for t in values {
        let v = t.value.as_deref().unwrap_or_default();
        let inner = match v.strip_prefix(b"[") {
            Some(array) => array.strip_suffix(b"]").unwrap_or(array),
            None => v,
        };
        if inner.is_empty() {
            continue;
        }
        if value.len() > 1 {
            value.push(b',');
        }
        value.extend_from_slice(inner);
    }
    value.push(b']');
    value
}

/// What a round writes to sled for `slice`: each entry as it is, but for the deletes
/// it drops and the runs of event values, written once each under their last key.
pub(super) fn sled_writes<'a>(
    slice: &'a [Taken],
    runs: &'a [Run],
) -> impl Iterator<Item = (&'a [u8], u64, Option<&'a [u8]>)> {
    let mut next_run = runs.iter().peekable();
    slice.iter().enumerate().filter_map(move |(i, t)| {
        while next_run.peek().is_some_and(|r| r.last < i) {
            next_run.next();
        }
        match next_run.peek() {
            Some(r) if r.first <= i && i < r.last => None,
            Some(r) if r.last == i => Some((t.key.as_slice(), t.lsn, Some(&r.value[..]))),
            _ if t.dropped() => None,
            _ => Some((t.key.as_slice(), t.lsn, t.value.as_deref())),
        }
    })
}

/// Drop from the overlay what a round wrote to sled (or dropped), where it was not
/// committed again meanwhile. A key written again meanwhile stays, no longer fresh
/// when the round wrote a value of it. A run goes as a whole or not at all: while any
/// of its values was committed again, or its session is `held` now, all of them stay
/// (the last no longer fresh: sled has a value under its key). Returns the lowest lsn
/// of the runs that stayed (the round's mark must stay before it, so that a start
/// after a crash replays them) and the [`super::weight`] of what left the overlay.
pub(super) fn drop_applied(
    map: &mut BTreeMap<OKey, Pending>,
    slice: &[Taken],
    runs: &[Run],
    held: &HashSet<String>,
) -> (Option<u64>, usize) {
    let mut freed = 0;
    let mut remove = |map: &mut BTreeMap<OKey, Pending>, key: &[u8]| {
        if let Some((k, p)) = map.remove_entry(key) {
            freed += weight(&k, &p.value);
        }
    };
    let mut in_run = vec![false; slice.len()];
    let mut kept: Option<u64> = None;
    for r in runs {
        let members = &slice[r.first..=r.last];
        in_run[r.first..=r.last].fill(true);
        let unchanged = members
            .iter()
            .all(|t| map.get(t.key.as_slice()).is_some_and(|p| p.lsn == t.lsn));
        let released = session(&slice[r.first]).is_some_and(|s| !held.contains(s));
        if unchanged && released {
            for t in members {
                remove(map, t.key.as_slice());
            }
            continue;
        }
        if let Some(p) = map.get_mut(slice[r.last].key.as_slice()) {
            p.fresh = false;
        }
        let lowest = members.iter().map(|t| t.lsn).min().unwrap_or(u64::MAX);
        kept = Some(kept.map_or(lowest, |k| k.min(lowest)));
    }
    for (t, _) in slice.iter().zip(&in_run).filter(|(_, run)| !**run) {
        let Some(p) = map.get_mut(t.key.as_slice()) else {
            continue;
        };
        if p.lsn == t.lsn {
            remove(map, t.key.as_slice());
        } else if t.value.is_some() {
            // Written again meanwhile: sled has a value of it now.
            p.fresh = false;
        }
    }
    (kept, freed)
}

/// After a failed write of `slice` to sled: sled may hold any of its writes, whole
/// or in part, so none of its keys counts as fresh or pristine any more (a later
/// round writes each under its own key, and a delete of it is written).
pub(super) fn forget_fresh(map: &mut BTreeMap<OKey, Pending>, slice: &[Taken]) {
    for t in slice {
        if let Some(p) = map.get_mut(t.key.as_slice()) {
            p.fresh = false;
            p.pristine = false;
        }
    }
}
