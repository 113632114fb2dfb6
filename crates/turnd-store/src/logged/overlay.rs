//! The overlay: every key committed to the log whose newest value sled does not
//! have yet, with the lsn that wrote it. The committer puts each group in after the
//! log made it durable and before it answers ([`Overlay::put_group`]); reads look
//! here before sled; the applier takes what it writes to sled from here and drops
//! it once written ([`super::runs`]). Its room bounds what commits may run ahead of
//! sled ([`Overlay::full`]).

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::model::keys;

/// A value as the overlay holds it (`None`: deleted).
pub(super) type Value = Option<Arc<[u8]>>;

/// A key as the overlay holds it: its bytes inline when they fit (every key of
/// the layout with a session id of up to 45 bytes), so that a search compares
/// bytes within the map's nodes rather than following a pointer per key to a
/// separate allocation (a cache miss each, in a map of tens of thousands of keys;
/// the overlay's inserts were most of the log writer's own CPU).
pub(super) type OKey = smallvec::SmallVec<[u8; 56]>;

/// One write of a committed batch: its key, its value and whether it creates the key
/// ([`crate::Batch::put_new_turn`]).
pub(super) type Write = (OKey, Value, bool);

/// The newest value of a key that sled does not have yet.
pub(super) struct Pending {
    pub(super) lsn: u64,
    pub(super) value: Value,
    /// No store holds the key but the overlay: it was created by a put the overlay
    /// still holds ([`crate::Batch::put_new_turn`]), and the applier has written no
    /// value of it to sled since. A delete of such a key is dropped instead of written.
    pub(super) fresh: bool,
    /// The value is the one the put that created the key wrote, and nothing wrote
    /// the key since (see [`super::runs`]).
    pub(super) pristine: bool,
    /// How often the applier had this value appended to the log again instead of
    /// writing it to sled ([`carries`]).
    pub(super) carried: u8,
}

/// What an overlay entry counts toward [`super::LoggedOptions::overlay_bytes`]: its
/// key and value.
pub(super) fn weight(key: &[u8], value: &Value) -> usize {
    key.len() + value.as_ref().map_or(0, |v| v.len())
}

pub(super) struct Overlay {
    pub(super) map: BTreeMap<OKey, Pending>,
    /// The [`weight`] of everything in `map`.
    pub(super) bytes: usize,
    /// [`super::LoggedOptions::overlay_bytes`].
    max_bytes: usize,
    /// [`super::LoggedOptions::overlay_keys`].
    max_keys: usize,
    /// The last lsn whose writes are in `map` (or in sled).
    pub(super) committed: u64,
    /// When each group not yet settled was put in `map`, with its last lsn (oldest
    /// first): see [`Overlay::settle`].
    groups: VecDeque<(Instant, u64)>,
    /// The last lsn of the newest group put in `map` at least `apply_delay` ago.
    settled: u64,
}

impl Overlay {
    /// An empty overlay over a store that holds everything up to `committed`.
    pub(super) fn new(max_bytes: usize, max_keys: usize, committed: u64) -> Overlay {
        Overlay {
            map: BTreeMap::new(),
            bytes: 0,
            max_bytes,
            max_keys,
            committed,
            groups: VecDeque::new(),
            settled: committed,
        }
    }

    /// Past the room: commits wait for the applier.
    pub(super) fn full(&self) -> bool {
        self.map.len() > self.max_keys || self.bytes > self.max_bytes
    }

    /// Past half the room in keys, or a quarter of it in bytes: the applier takes
    /// everything at once, without waiting out the delay, and rounds follow each
    /// other without a pause, so that commits do not come to wait for room.
    pub(super) fn eager(&self) -> bool {
        self.map.len() > self.max_keys / 2 || self.bytes > self.max_bytes / 4
    }

    /// Past a quarter of the room in keys or in bytes: the store counts as busy, and
    /// retention's sweep holds back, well before the applier turns eager. At full
    /// load the delay keeps 45 – 55k keys waiting (of the 256k default room), under
    /// it: a sweep held back whenever 16k waited deleted a third of what the load
    /// made (`docs/benchmarks.md`).
    pub(super) fn busy(&self) -> bool {
        self.map.len() > self.max_keys / 4 || self.bytes > self.max_bytes / 4
    }

    /// The last lsn of the groups put in the overlay at least `delay` before `now`
    /// (all of them when `delay` is zero: the newest group's lsn is `committed`).
    pub(super) fn settle(&mut self, now: Instant, delay: Duration) -> u64 {
        while let Some(&(at, lsn)) = self.groups.front() {
            if now.saturating_duration_since(at) < delay {
                break;
            }
            self.settled = lsn;
            self.groups.pop_front();
        }
        self.settled
    }

    /// Put a durable group in: the writes of its batches, the first batch's record
    /// at `first_lsn` and each next one's at the next lsn (`carry`: a group of the
    /// applier's carries, [`carries`]). Each write's slot takes the value it replaces
    /// here (its key is moved in), so that the committing task frees that with the
    /// rest of its batch.
    pub(super) fn put_group<'a>(
        &mut self,
        first_lsn: u64,
        carry: bool,
        batches: impl ExactSizeIterator<Item = &'a mut Vec<Write>>,
    ) {
        let count = batches.len() as u64;
        for (i, writes) in batches.enumerate() {
            let lsn = first_lsn + i as u64;
            for (k, value, created) in writes {
                let pending = Pending {
                    lsn,
                    value: value.take(),
                    fresh: *created,
                    pristine: *created,
                    carried: 0,
                };
                *value = self.put(std::mem::take(k), pending, carry);
            }
        }
        self.committed = first_lsn + count - 1;
        self.groups.push_back((Instant::now(), self.committed));
    }

    /// Put `pending` in as `key`'s newest value (`carry`: the same value again, from
    /// the applier's carry); returns the value it replaced.
    fn put(&mut self, key: OKey, mut pending: Pending, carry: bool) -> Value {
        let added = weight(&key, &pending.value);
        let (removed, replaced) = match self.map.entry(key) {
            Entry::Vacant(e) => {
                e.insert(pending);
                (0, None)
            }
            Entry::Occupied(mut e) => {
                // Still only in the overlay if it was before (a put that says it
                // creates the key cannot, when the overlay holds a write of it
                // already).
                pending.fresh = e.get().fresh;
                pending.pristine = false;
                if carry {
                    pending.carried = e.get().carried.saturating_add(1);
                }
                let replaced = std::mem::replace(e.get_mut(), pending).value;
                (weight(e.key(), &replaced), replaced)
            }
        };
        self.bytes = (self.bytes + added).saturating_sub(removed);
        replaced
    }

    /// Put back records read again from the log (coalesced: the newest value of each
    /// key, with its lsn) where the overlay holds no newer write of their keys.
    pub(super) fn refill(&mut self, records: BTreeMap<Vec<u8>, (u64, Value)>) {
        for (k, (lsn, value)) in records {
            // A key in the overlay already holds its newest value.
            if let Entry::Vacant(e) = self.map.entry(OKey::from_vec(k)) {
                let w = weight(e.key(), &value);
                e.insert(Pending {
                    lsn,
                    value,
                    // sled may hold it: its delete is written, and it is in no run.
                    fresh: false,
                    pristine: false,
                    carried: 0,
                });
                self.bytes += w;
            }
        }
    }

    /// Whether the overlay holds a committed drop of the window starting at `start`.
    pub(super) fn drop_pending(&self, start: u64) -> bool {
        self.map
            .get(keys::dropped_key(start).as_slice())
            .is_some_and(|p| p.value.is_some())
    }
}

/// Whether the applier lets a write of `key` wait [`super::LoggedOptions::apply_delay`]
/// before it takes it to sled: the records of live turns, invocations and sessions,
/// rewritten at every transition and (a turn's and an invocation's) deleted when
/// the turn ends, so that most of them never reach sled at all; and event values,
/// so that a round takes a session's values together and writes them as one
/// ([`super::runs::event_runs`]), all of them at or before the mark the round
/// records. The keys written once otherwise (folded records, list entries,
/// idempotency keys) and window drops are taken at the next round.
pub(super) fn delays(key: &[u8]) -> bool {
    matches!(key.first(), Some(b'T' | b'I' | b'N' | b'M' | b'E'))
}

/// Most times one value is carried ([`carries`]): a record that outlives them (a step
/// or a queue wait of more than a few seconds) is written to sled as before, so that
/// a long wait costs a bounded number of appends.
pub(super) const MAX_CARRIES: u8 = 3;

/// The key prefixes of the records [`carries`] may carry: invocations', turns'
/// inputs kept apart, and turns'.
pub(super) const CARRIED_KINDS: [u8; 3] = [b'I', b'N', b'T'];

/// Whether the applier may carry `pending`, a settled write of `key`, instead of
/// writing it to sled: the value of a live turn's record, an invocation's record or
/// a turn's input kept apart that no store but the overlay holds ([`Pending::fresh`]),
/// carried fewer than [`MAX_CARRIES`] times.
///
/// **Carry.** Such a record is deleted when its turn ends; written to sled while it
/// lives (a turn queued behind others, a step that runs longer than
/// `apply_delay_ms`), it costs a put and later a delete there (a tenth of the daemon's
/// CPU under a queue of 20 turns per session, `docs/benchmarks.md`). Carried, the
/// committer appends the same value to the commit log again (only if the overlay
/// still holds it at the lsn the applier saw: a newer write wins) and the overlay
/// entry takes the new lsn, so the applied mark can pass the old one while sled never
/// sees the key; when the turn ends within the carries, its delete is dropped.
pub(super) fn carries(key: &[u8], pending: &Pending) -> bool {
    key.first().is_some_and(|k| CARRIED_KINDS.contains(k))
        && pending.fresh
        && pending.value.is_some()
        && pending.carried < MAX_CARRIES
}
