//! Time windows of finished turns.
//!
//! A finished turn's folded record (`F` key) is stored in the sled database of the
//! time window its turn id falls in: the window with the largest start at or before
//! the turn id's UUIDv7 timestamp, under `DATA_DIR/windows/<start_ms>/`. So are the
//! keys of sessions that carry a route ([`keys`]: turn list entries, event values and
//! idempotency keys, each routed by the time of the turn it belongs to, an event value
//! by the newest turn among its events). Everything else (sessions' metas, unfinished
//! turns, invocations) stays in the main database. Retention returns a window's space
//! by deleting its directory whole, which sled's files never do for deleted keys.
//!
//! **What a window holds belongs to its turns.** A turn's list entry and idempotency
//! key are routed by the turn itself, an event value by its newest turn. Retention
//! deletes a turn's record and idempotency key and leaves its list entry and event
//! values to the window's drop (reads pass over those of turns that are gone); before
//! the drop it writes every event value of the window that holds events of an older
//! turn still stored again with those events only (routed by the newest of them, in
//! an older window). So once every turn minted in a window is deleted, and none is
//! unfinished, nothing of a remaining turn is left in it ([`leftovers`] covers a turn
//! that ended meanwhile).
//!
//! **Routing never changes after the fact.** A new window starts when the newest is
//! older than `window_ms` or larger than `window_bytes`, at a start later than the
//! wall clock when it is made, so later than every turn id minted so far: no turn
//! already routed to an older window falls into it. Turn ids minted before the first
//! window (while windows were off, `window_ms = 0`) route to no window: their records
//! stay in the main database.
//!
//! **Dropping a window** is an ordinary commit of the key [`keys::dropped_key`] (prefix `W`
//! and the window's start), so it is in the commit log in order with every other
//! write. Retention commits it once the window holds no record and no unfinished turn
//! was minted in it. The applier, when it takes the drop, first copies what the window
//! still holds of stored turns to the main database ([`leftovers`]: nothing, unless a
//! turn finished between retention's check and the drop), then routes the window's keys to the main
//! database from then on, records the drop in the main database (with the lsn of the
//! record that dropped it), makes that durable, and only then deletes the directory.
//! A start after a crash reads the drops from the main database and the log: a
//! dropped window is never re-created (its records in the log go to the main
//! database, where later records of the log delete them again as they did before; a
//! list entry or event value retention left to the drop is not deleted again, and
//! stays there, passed over by reads, until its session is forgotten),
//! and a directory of a dropped window still present is deleted. So a drop never
//! throws away anything committed.

pub(crate) mod store;

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::StoreError;
use crate::model::keys::{self, routed_ms, Entry};
use crate::model::records::{FoldedTurn, TurnRecord};

/// A turn id's time, which routes its keys (public here too: windows are where
/// that time takes them).
pub use crate::model::keys::turn_ms;

/// Defaults of `storage.window_ms` and `storage.window_mb`. `window_ms` left unset
/// follows the retention instead ([`window_ms_for_retention`]); this is its longest.
pub const DEFAULT_WINDOW_MS: u64 = 3_600_000;
pub const DEFAULT_WINDOW_MB: u64 = 256;

/// The shortest window [`window_ms_for_retention`] chooses.
pub const MIN_DERIVED_WINDOW_MS: u64 = 10_000;

/// How many windows a retention period spans when the window length follows it.
pub const WINDOWS_PER_RETENTION: u64 = 24;

/// The window length used when `storage.window_ms` is not set: a 24th of the time
/// finished turns are kept (`retention.terminal_ms`), at least 10 s and at most 1 h
/// (1 h when turns are kept for good). The windows on disk hold up to
/// `terminal_ms + window_ms + sweep_interval_ms` of finished turns (a window is
/// dropped once its last turn expired), so a window as long as the retention could
/// double the disk a retention period needs; a 24th of it adds about 4 %.
pub fn window_ms_for_retention(terminal_ms: u64) -> u64 {
    if terminal_ms == 0 {
        return DEFAULT_WINDOW_MS;
    }
    (terminal_ms / WINDOWS_PER_RETENTION).clamp(MIN_DERIVED_WINDOW_MS, DEFAULT_WINDOW_MS)
}

/// When a new window starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowOptions {
    /// A window older than this (by its start) is followed by a new one; 0 keeps
    /// finished turns in the main database (no windows).
    pub window_ms: u64,
    /// A window larger than this on disk is followed by a new one.
    pub window_bytes: u64,
}

impl Default for WindowOptions {
    fn default() -> Self {
        WindowOptions {
            window_ms: DEFAULT_WINDOW_MS,
            window_bytes: DEFAULT_WINDOW_MB * 1024 * 1024,
        }
    }
}

/// A window as [`crate::Kv::windows`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowInfo {
    pub start_ms: u64,
    /// The next window's start (None: the newest window, which takes new turns).
    pub end_ms: Option<u64>,
    /// Bytes of its files (0 once dropped and deleted).
    pub bytes: u64,
    /// Its drop is committed.
    pub dropped: bool,
}

impl WindowInfo {
    /// Whether the time `ms` falls in this window (keys routed at `ms` are stored in
    /// it while it is open).
    pub fn holds(&self, ms: u64) -> bool {
        self.start_ms <= ms && self.end_ms.is_none_or(|e| ms < e)
    }
}

/// Wall clock, Unix milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Reads a range of a window's keys ([`leftovers`]).
pub type ReadRange<'a> = dyn FnMut(&[u8], &[u8]) -> Result<Vec<Entry>, StoreError> + 'a;
/// Turns a stored value into its bytes ([`leftovers`]).
pub type Decode<'a> = dyn Fn(&[u8]) -> Result<Vec<u8>, StoreError> + 'a;

/// What a window being dropped passes on to the main database: the folded records it
/// still holds (turns that ended between retention's judging it empty and the drop)
/// and, for each of them and for each of `unfinished` (turns minted in the window
/// whose own records, in the main database, were written after retention read that
/// none was there: an admission committed late), its turn list entry, its
/// idempotency key and every event value of its session the window holds.
/// Everything else in it belongs to turns retention deleted (their list entries and
/// event values are left for the drop to take, see the module doc) and goes with it.
///
/// `read(start, end)` reads the window's keys in `[start, end)`, values as stored;
/// `decode` turns a stored value into its bytes. A folded record that cannot be
/// decoded keeps everything the window holds, as a drop did before it could tell.
pub fn leftovers(
    read: &mut ReadRange<'_>,
    decode: &Decode<'_>,
    unfinished: &[TurnRecord],
) -> Result<Vec<Entry>, StoreError> {
    let (fs, fe) = keys::finished_range();
    let records = read(&fs, &fe)?;
    if records.is_empty() && unfinished.is_empty() {
        return Ok(Vec::new());
    }
    let mut kept: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    let mut turns = Vec::with_capacity(records.len() + unfinished.len());
    for (k, v) in records {
        match decode(&v).and_then(|b| {
            serde_json::from_slice::<FoldedTurn>(&b).map_err(|e| StoreError::Corrupt(e.to_string()))
        }) {
            Ok(f) => turns.push(f.turn),
            Err(e) => {
                tracing::warn!("a folded record of a window being dropped cannot be read ({e}): everything the window holds is kept");
                return read(&[], &[u8::MAX]);
            }
        }
        kept.insert(k, v);
    }
    let mut sessions = std::collections::BTreeSet::new();
    for turn in turns.iter().chain(unfinished) {
        let sid = turn.session_id.as_str();
        let mut ranges = vec![(
            keys::session_turn(sid, turn.seq),
            keys::session_turn(sid, turn.seq.saturating_add(1)),
        )];
        if let Some(key) = &turn.idempotency_key {
            ranges.push(keys::idempotency_range(sid, key));
        }
        if sessions.insert(sid) {
            ranges.push((keys::event(sid, 0), keys::event_end(sid)));
        }
        for (s, e) in ranges {
            kept.extend(read(&s, &e)?);
        }
    }
    Ok(kept.into_iter().collect())
}

/// The unfinished turns minted in the window `[start_ms, end_ms)` whose records are
/// stored (in the main database: `read` reads it, values as stored), for
/// [`leftovers`].
pub fn unfinished_turns(
    read: &mut ReadRange<'_>,
    decode: &Decode<'_>,
    start_ms: u64,
    end_ms: Option<u64>,
) -> Result<Vec<TurnRecord>, StoreError> {
    let (ts, te) = turn_key_range(start_ms, end_ms);
    read(&ts, &te)?
        .into_iter()
        .map(|(_, v)| {
            serde_json::from_slice(&decode(&v)?)
                .map_err(|e| StoreError::Corrupt(format!("turn: {e}")))
        })
        .collect()
}

/// The `F` keys of turns minted in `[start_ms, end_ms)` (end None: to the end).
pub fn finished_key_range(start_ms: u64, end_ms: Option<u64>) -> (Vec<u8>, Vec<u8>) {
    id_range(b'F', start_ms, end_ms)
}

/// The `T` keys (unfinished turns) of turns minted in `[start_ms, end_ms)`.
pub fn turn_key_range(start_ms: u64, end_ms: Option<u64>) -> (Vec<u8>, Vec<u8>) {
    id_range(b'T', start_ms, end_ms)
}

fn id_range(prefix: u8, start_ms: u64, end_ms: Option<u64>) -> (Vec<u8>, Vec<u8>) {
    let bound = |ms: u64| {
        let mut k = vec![prefix];
        k.extend_from_slice(format!("t_{ms:012x}").as_bytes());
        k
    };
    let end = match end_ms {
        Some(e) => bound(e),
        None => vec![prefix + 1],
    };
    (bound(start_ms), end)
}

/// Where a window stands in a store's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    Open,
    /// Dropped by the record with this lsn (0 when not known: the in-memory store).
    Dropped(u64),
}

/// Where a key is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Main,
    Window(u64),
}

/// The windows by start: routing and the switch policy, shared by the sled store and
/// the in-memory one.
#[derive(Debug, Default, Clone)]
pub struct Table {
    pub slots: BTreeMap<u64, Slot>,
}

impl Table {
    /// Where a key goes (see the module documentation): a folded record to the open
    /// window its turn id's time falls in, anything else (and a record of a dropped
    /// window, or of a turn minted before the first window) to the main database.
    pub fn route(&self, key: &[u8]) -> Route {
        let Some(ms) = routed_ms(key) else {
            return Route::Main;
        };
        match self.slots.range(..=ms).next_back() {
            Some((start, Slot::Open)) => Route::Window(*start),
            None | Some((_, Slot::Dropped(_))) => Route::Main,
        }
    }

    /// The window start a key falls in, whatever its state.
    pub fn start_of(&self, key: &[u8]) -> Option<u64> {
        let ms = routed_ms(key)?;
        self.slots.range(..=ms).next_back().map(|(s, _)| *s)
    }

    /// The end of the window starting at `start`: the next one's start (None: the
    /// newest, or not a window).
    pub fn end_of(&self, start: u64) -> Option<u64> {
        self.slots
            .range(start.saturating_add(1)..)
            .next()
            .map(|(k, _)| *k)
    }

    /// The newest window's start.
    pub fn newest(&self) -> Option<u64> {
        self.slots.keys().next_back().copied()
    }

    /// Whether a new window should start now, given the newest one's size.
    pub fn due(&self, opts: &WindowOptions, now: u64, newest_bytes: u64) -> bool {
        if opts.window_ms == 0 {
            return false;
        }
        match self.slots.iter().next_back() {
            None => true,
            Some((start, Slot::Dropped(_))) => now >= *start,
            Some((start, Slot::Open)) => {
                now.saturating_sub(*start) >= opts.window_ms || newest_bytes >= opts.window_bytes
            }
        }
    }

    /// The start of a new window made now: later than the wall clock (and so than
    /// every turn id minted so far) and than every window's start.
    pub fn next_start(&self, now: u64) -> u64 {
        let after = self.newest().map_or(0, |s| s + 1);
        (now + 1).max(after)
    }

    /// The windows, with their ends.
    pub fn list(&self, bytes: impl Fn(u64) -> u64) -> Vec<WindowInfo> {
        let starts: Vec<(u64, Slot)> = self.slots.iter().map(|(s, v)| (*s, *v)).collect();
        starts
            .iter()
            .enumerate()
            .map(|(i, (start, slot))| WindowInfo {
                start_ms: *start,
                end_ms: starts.get(i + 1).map(|(s, _)| *s),
                bytes: bytes(*start),
                dropped: matches!(slot, Slot::Dropped(_)),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::keys::{dropped_key, dropped_start};

    fn fkey(ms: u64) -> Vec<u8> {
        keys::finished(&format!("t_{ms:012x}7000800000000000000a"))
    }

    /// A folded record goes to the window with the largest start at or before its
    /// turn id's timestamp; before the first window, and after its window's drop, to
    /// the main database.
    #[test]
    fn keys_route_by_their_turn_ids_time() {
        assert_eq!(
            turn_ms("t_0192d3f2a1b27000800000000000000a"),
            Some(0x0192d3f2a1b2)
        );
        assert_eq!(turn_ms("t_x"), None);
        let mut t = Table::default();
        assert_eq!(t.route(&fkey(5)), Route::Main);
        t.slots.insert(100, Slot::Open);
        t.slots.insert(200, Slot::Open);
        assert_eq!(t.route(&fkey(99)), Route::Main);
        assert_eq!(t.route(&fkey(100)), Route::Window(100));
        assert_eq!(t.route(&fkey(199)), Route::Window(100));
        assert_eq!(t.route(&fkey(200)), Route::Window(200));
        assert_eq!(t.route(&fkey(u64::from(u32::MAX))), Route::Window(200));
        assert_eq!(
            t.route(&keys::turn("t_00000000012c7000800000000000000a")),
            Route::Main
        );
        assert_eq!(t.route(&keys::session_meta("s")), Route::Main);
        t.slots.insert(100, Slot::Dropped(50));
        assert_eq!(t.route(&fkey(150)), Route::Main);
        assert_eq!(t.start_of(&fkey(150)), Some(100));

        let (s, e) = finished_key_range(100, Some(200));
        assert!(s <= fkey(100) && fkey(199) < e && fkey(200) >= e && fkey(99) < s);
        let (_, e) = finished_key_range(200, None);
        assert!(fkey(u64::MAX >> 16) < e);
        assert_eq!(dropped_start(&dropped_key(1234)), Some(1234));
    }

    #[test]
    fn a_new_window_starts_after_every_minted_id_when_due() {
        let opts = WindowOptions {
            window_ms: 1000,
            window_bytes: 10,
        };
        let mut t = Table::default();
        assert!(t.due(&opts, 5, 0));
        assert_eq!(t.next_start(5), 6);
        t.slots.insert(6, Slot::Open);
        assert!(!t.due(&opts, 500, 0));
        assert!(t.due(&opts, 500, 10), "too large");
        assert!(t.due(&opts, 1006, 0), "too old");
        // A clock that went back never makes a start at or before an existing one.
        assert_eq!(t.next_start(3), 7);
        assert!(!t.due(
            &WindowOptions {
                window_ms: 0,
                ..opts
            },
            5000,
            99
        ));
        let listed = t.list(|_| 42);
        assert_eq!(listed[0].end_ms, None);
        assert_eq!(listed[0].bytes, 42);
    }
}
