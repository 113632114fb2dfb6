//! The applier's rounds: what a round takes from the overlay ([`Taken`]), the runs
//! of a session's event values it writes to sled as one value ([`event_runs`]),
//! what it writes ([`sled_writes`]) and what it then drops from the overlay
//! ([`drop_applied`]).

use std::collections::BTreeMap;

use super::{OKey, Pending, Value};

/// An overlay entry a round of the applier took, as it was when taken.
pub(super) struct Taken {
    pub(super) key: OKey,
    pub(super) lsn: u64,
    pub(super) value: Value,
    pub(super) fresh: bool,
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

/// The runs of event values in `slice` written to sled as one value each.
///
/// sled's cost is per key, and a session's event values (one per transition, keyed by
/// its last event's `seq`) are spread over the keyspace by session: two per one-step
/// turn, and about half of the applier's time. So consecutive values of one session
/// taken in the same round are written as one array under the key of the last one,
/// which is what a transition with all their events would have written: a read of
/// the events after a `seq` starts at the first value that can hold the next one,
/// whatever the values' sizes. A run holds only puts of routed values and ends at a
/// value routed by the newest turn of all of them (as a value must be routed; the
/// routes may go down before it, as when queued turns are admitted while earlier
/// ones end and dispatch the next), spans fewer than [`crate::EVENTS_PER_VALUE`] `seq`s between its first and
/// last key and [`MERGE_BYTES`] of values; and every value but the last must be
/// *fresh* (sled never had its key), since its own key is never written. Until the
/// round drops a run from the overlay, the overlay still holds each of its values
/// under its own key, the last one included, so a read never meets an event twice
/// ([`drop_applied`]).
///
/// **Only values committed after the mark sled holds (`applied`) and at or before
/// the one this round records (`mark`) go into a run.** A start after a crash
/// replays, key by key, every record after the mark sled then holds; were that mark
/// between two values of a run, the replay would write the later one's own value
/// again over the run and the earlier one's events would be gone. With every value
/// of a run after the mark already in sled, a crash before this round's mark is
/// durable replays all of them (each under its own key, as if never merged), and
/// with all of them at or before this round's mark, none of them is replayed once it
/// is. Event values wait for their group to be settled before a round takes them
/// (`delays`), so a round's values are in that range.
pub(super) fn event_runs(slice: &[Taken], applied: u64, mark: u64) -> Vec<Run> {
    let mergeable = |t: &Taken| -> Option<(u64, u64)> {
        if t.key.first() != Some(&b'E') || t.lsn <= applied || t.lsn > mark {
            return None;
        }
        t.value.as_ref()?;
        let (_, seq, route) = crate::keys::split_session_seq(&t.key)?;
        Some((seq, route?))
    };
    /// The session of an event value's key.
    fn session(t: &Taken) -> Option<&str> {
        crate::keys::split_session_seq(&t.key).map(|(sid, _, _)| sid)
    }
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
        while slice[k].fresh && k + 1 < slice.len() {
            let Some((seq, route)) = mergeable(&slice[k + 1]) else {
                break;
            };
            let len = slice[k + 1].value.as_ref().map_or(0, |v| v.len());
            if session(&slice[k + 1]) != sid
                || seq - first_seq >= crate::EVENTS_PER_VALUE as u64
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
        let bytes: usize = slice[i..=j]
            .iter()
            .map(|t| t.value.as_ref().map_or(0, |v| v.len()))
            .sum();
        if j > i {
            let mut value = Vec::with_capacity(bytes + 2);
            value.push(b'[');
            for t in &slice[i..=j] {
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
            runs.push(Run {
                first: i,
                last: j,
                value,
            });
        }
        i = j + 1;
    }
    runs
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
/// when the round wrote a value of it. A run of event values goes as a whole or not
/// at all: sled holds its values together under the last key, so while any of them
/// was committed again, all stay (the last no longer fresh) and a later round writes
/// them again.
pub(super) fn drop_applied(map: &mut BTreeMap<OKey, Pending>, slice: &[Taken], runs: &[Run]) {
    let mut in_run = vec![false; slice.len()];
    for r in runs {
        in_run[r.first..=r.last].fill(true);
        let unchanged = slice[r.first..=r.last]
            .iter()
            .all(|t| map.get(t.key.as_slice()).is_some_and(|p| p.lsn == t.lsn));
        if unchanged {
            for t in &slice[r.first..=r.last] {
                map.remove(t.key.as_slice());
            }
        } else if let Some(p) = map.get_mut(slice[r.last].key.as_slice()) {
            p.fresh = false;
        }
    }
    for (t, _) in slice.iter().zip(&in_run).filter(|(_, run)| !**run) {
        let Some(p) = map.get_mut(t.key.as_slice()) else {
            continue;
        };
        if p.lsn == t.lsn {
            map.remove(t.key.as_slice());
        } else if t.value.is_some() {
            // Written again meanwhile: sled has a value of it now.
            p.fresh = false;
        }
    }
}
