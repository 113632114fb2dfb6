//! How a [`super::LoggedKv`] is opened ([`LoggedOptions`]), and the defaults of the
//! `[storage]` settings of the commit path.

use std::time::Duration;

use crate::sled::SledOptions;
use crate::windows::WindowOptions;

/// Longest time between two applied marks written to the main database while
/// rounds apply: a start after a crash replays the log from the last one on disk.
/// Each mark first syncs the windows written since the one before, so rounds in
/// between sync nothing (at full load a round takes a few hundred milliseconds: in
/// a traced 60 s soak the store's other threads made 583 `fdatasync`s with a sync
/// per round and 494 with this, `docs/benchmarks.md`).
pub const DEFAULT_MARK_INTERVAL: Duration = Duration::from_secs(1);

/// Default of [`LoggedOptions::overlay_bytes`].
pub const DEFAULT_OVERLAY_BYTES: usize = 256 * 1024 * 1024;

/// Default of [`LoggedOptions::overlay_keys`]: keys the overlay may hold
/// before commits wait for the applier, so that a burst of commits faster than sled
/// takes them is held back here rather than in memory. At full load with retention
/// deleting, an apply round now and then takes 0.2 – 0.3 s (sled, or a window
/// reopened on the applier's thread); with 32k keys of room commits waited for such
/// rounds 1 – 23 times in 45 s, with 64k none. A burst of queued turns holds far
/// more live keys than that while they wait their delay (1,000 sessions with 20
/// turns each: over 64k), and the applier must not write those to sled only to
/// delete them again, so the room is 256k keys, of which half may wait their
/// delay (`docs/benchmarks.md`). Memory stays bounded by
/// [`LoggedOptions::overlay_bytes`] as well.
pub const DEFAULT_OVERLAY_KEYS: usize = 256 * 1024;

/// Defaults of the `[storage]` settings of the commit path.
pub const DEFAULT_SEGMENT_KB: u64 = 32 * 1024;
pub const DEFAULT_APPLY_INTERVAL_MS: u64 = 200;
pub const DEFAULT_APPLY_DELAY_MS: u64 = 500;
pub const DEFAULT_HEAL_INTERVAL_MS: u64 = 1_000;

/// How the store is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoggedOptions {
    /// sled's options; `sync` applies to the commit log (sled is synced only before
    /// the log is trimmed).
    pub sled: SledOptions,
    /// Size of one commit log segment.
    pub segment_bytes: u64,
    /// How often the applier writes the overlay to sled.
    pub apply_interval: Duration,
    /// How long a write of a live record (a turn's or an invocation's record, a
    /// turn's input kept apart, a session's meta) waits in the overlay before the
    /// applier takes it to sled: one rewritten or deleted meanwhile reaches sled once
    /// or never (the keys `delays` names).
    pub apply_delay: Duration,
    /// How often a failed log tries to repair itself.
    pub heal_interval: Duration,
    /// When a new time window of finished turns starts.
    pub windows: WindowOptions,
    /// After this long with nothing written to it, a sled database (the main one, or
    /// a time window) that took writes since it was last opened is closed and opened
    /// again: sled writes its snapshot then (so a later start opens it fast), and the
    /// memory its cache and tables grew to in a burst goes back.
    pub idle_reopen: Duration,
    /// A time window no read or write used for this long is closed until it is
    /// needed again: sled keeps a record of every page of an open database in
    /// memory, about 60 bytes per finished turn kept.
    /// `None`: windows stay open.
    pub window_close_after: Option<Duration>,
    /// Bytes of keys and values the overlay may hold before commits wait for the
    /// applier, whatever the number of keys ([`LoggedOptions::overlay_keys`]):
    /// large values (inputs and outputs near the frame limit) would fill memory long
    /// before the room in keys. From a quarter of it the applier takes everything
    /// at once and retention holds back.
    pub overlay_bytes: usize,
    /// Keys the overlay may hold before commits wait for the applier
    /// ([`DEFAULT_OVERLAY_KEYS`]). From half of it the applier takes everything at
    /// once, without waiting out `apply_delay`; from a quarter of it retention holds
    /// back.
    pub overlay_keys: usize,
    /// Longest time between two applied marks written to the main database while
    /// rounds apply ([`DEFAULT_MARK_INTERVAL`]).
    pub mark_interval: Duration,
}

/// Default of [`LoggedOptions::idle_reopen`].
pub const DEFAULT_IDLE_REOPEN: Duration = Duration::from_secs(5);

/// Default of `storage.window_close_ms` ([`LoggedOptions::window_close_after`]).
pub const DEFAULT_WINDOW_CLOSE_MS: u64 = 60_000;

impl Default for LoggedOptions {
    fn default() -> Self {
        LoggedOptions {
            sled: SledOptions::default(),
            segment_bytes: DEFAULT_SEGMENT_KB * 1024,
            apply_interval: Duration::from_millis(DEFAULT_APPLY_INTERVAL_MS),
            apply_delay: Duration::from_millis(DEFAULT_APPLY_DELAY_MS),
            heal_interval: Duration::from_millis(DEFAULT_HEAL_INTERVAL_MS),
            windows: WindowOptions::default(),
            idle_reopen: DEFAULT_IDLE_REOPEN,
            window_close_after: Some(Duration::from_millis(DEFAULT_WINDOW_CLOSE_MS)),
            overlay_bytes: DEFAULT_OVERLAY_BYTES,
            overlay_keys: DEFAULT_OVERLAY_KEYS,
            mark_interval: DEFAULT_MARK_INTERVAL,
        }
    }
}
