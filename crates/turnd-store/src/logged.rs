//! The store's commit path: a commit log ([`crate::log::CommitLog`]) in front of sled.
//!
//! **Commit.** A committing task encodes its batch (its log record and its writes
//! in the overlay's form) and queues it. The committer thread (`turnd-log-writer`)
//! takes every queued batch (after a large group, it first sleeps briefly so that
//! more arrive: see `gather`), appends each as one record to the commit log,
//! makes the group durable with one `fdatasync`, puts the group's writes into the
//! *overlay* (key → newest value not yet in sled, with the lsn that wrote it) and
//! only then answers the committers. sled is not on this path.
//!
//! **Apply.** The applier thread (`turnd-store-applier`) writes the overlay to sled
//! every `apply_interval`: one value per key, however often the key was written in
//! between (a turn's record, rewritten at each transition, reaches sled once), in
//! `apply_batch` calls of bounded size, the last of which also records the lsn
//! applied under [`APPLIED_KEY`]. It then drops from the overlay every entry that
//! has not been written again since. Live records wait `apply_delay` first, and a
//! delete of a key sled never got is dropped (see `Applier::apply`), so most
//! turns' live records never reach sled. sled is not synced per apply: when a log
//! segment is wholly applied, the applier flushes sled, `fdatasync`s its files and
//! only then deletes the segment (and syncs the log's directory). Checkpoints (see
//! [`crate::sled::Checkpoints`]) run here too, so they pause applies and store reads, never
//! commits.
//!
//! **Reads** look in the overlay first and then in sled. An entry leaves the
//! overlay only after sled has it, so a read that misses the overlay finds the
//! newest value in sled; scans merge the two.
//!
//! **Start.** sled is opened, the commit log is read from the record after the lsn
//! sled last recorded as applied, and those records are written to sled (coalesced
//! by key, as the applier does), flushed and synced before the daemon serves. A
//! clean close applies and flushes everything, so the next start reads nothing.
//!
//! **Failures.** A failed append or `fdatasync` of the log fails its group
//! (`unavailable` for the requests, nothing of it in memory); the log then refuses
//! groups until it has written zeros over what the failed group may have left,
//! which it tries again every `heal_interval`, and appends go on once that worked.
//! A full disk fails the group that needed a new segment, and the next group tries
//! again. A failed apply or flush of sled loses nothing (the log still holds it) and
//! is tried again at the next interval; the log is not trimmed meanwhile. sled
//! refuses every write after a failed one until it is opened again, so the applier,
//! at most every `heal_interval` and once a probe write and sync in the data
//! directory work, closes sled and opens it again and writes to it what the log
//! holds past the applied mark sled recovered ([`CommitLog::read_range`]); what the old
//! handle held only in memory is written again that way. A committer or applier
//! thread that ended unexpectedly makes [`Kv::health`] fail, and so does sled
//! failing for 10 × `heal_interval` while the disk takes writes.
//!
//! Both threads run outside any tokio runtime and time real disk work with
//! `std::time`; no tokio timer depends on them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Bound;
use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::log::{CommitLog, LocalLog, Opened, Record};
use crate::sled::{values, Checkpoints, Handle, Shared, SledOptions, SyncMode};
use crate::windows::store::{Switch, Upkeep, Windows};
use crate::windows::{self, Route, WindowOptions};
use crate::{Batch, CommitReply, CommitStats, CommitTicket, Entry, IoOp, Kv, KvOp, StoreError};

mod runs;
#[cfg(test)]
mod runs_tests;
#[cfg(test)]
mod sled_tests;

use runs::{drop_applied, event_runs, forget_fresh, sled_writes, Taken};

/// sled key holding the last lsn the applier wrote to sled (u64, big-endian). It
/// sorts before every key of the layout (`crate::keys`), whose scans never reach it.
pub const APPLIED_KEY: &[u8] = b"\x00applied";

/// A value stored in sled compressed starts with these two bytes (no value of the
/// layout does: they are JSON text, turn ids, or the applied mark, which is never
/// compressed), followed by LZ4 block data with its length prepended.
const PACKED: [u8; 2] = [0, b'4'];
/// Values shorter than this are stored as they are.
const PACK_FROM: usize = 96;

/// The form a value takes in sled: LZ4-compressed when that saves space (turn and
/// invocation records and events are JSON with many repeated field names).
fn pack(v: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if v.len() >= PACK_FROM {
        let c = lz4_flex::block::compress_prepend_size(v);
        if c.len() + PACKED.len() < v.len() {
            let mut out = Vec::with_capacity(c.len() + PACKED.len());
            out.extend_from_slice(&PACKED);
            out.extend_from_slice(&c);
            return std::borrow::Cow::Owned(out);
        }
    }
    std::borrow::Cow::Borrowed(v)
}

/// A value read from sled (with a value file pointer resolved:
/// [`Shared::stored`]), decompressed when [`pack`] compressed it.
fn unpack(v: &[u8]) -> Result<Vec<u8>, StoreError> {
    if values::is_pointer(v) {
        return Err(StoreError::Corrupt(
            "a value file pointer read as a value".into(),
        ));
    }
    match v.strip_prefix(&PACKED[..]) {
        Some(c) => lz4_flex::block::decompress_size_prepended(c)
            .map_err(|e| StoreError::Corrupt(format!("compressed value: {e}"))),
        None => Ok(v.to_vec()),
    }
}

/// Longest time between two applied marks written to the main database while
/// rounds apply: a start after a crash replays the log from the last one on disk.
/// Each mark first syncs the windows written since the one before, so rounds in
/// between sync nothing (at full load a round takes a few hundred milliseconds: in
/// a traced 60 s soak the store's other threads made 583 `fdatasync`s with a sync
/// per round and 494 with this, `docs/benchmarks.md`).
pub const DEFAULT_MARK_INTERVAL: Duration = Duration::from_secs(1);

/// Most keys in one sled `apply_batch` of the applier.
const APPLY_KEYS: usize = 1024;

/// Keys the overlay may hold before commits wait for the applier: a burst of
/// commits faster than sled takes them is held back here rather than in memory.
/// At full load with retention deleting, an apply round now and then takes 0.2 –
/// 0.3 s (sled, or a window reopened on the applier's thread); with 32k keys of
/// room commits waited for such rounds 1 – 23 times in 45 s, with 64k none
/// (`docs/benchmarks.md`).
const MAX_OVERLAY_KEYS: usize = 64 * 1024;

/// Keys the overlay may hold before the applier takes every entry at once (no
/// [`LoggedOptions::apply_delay`]) and rounds follow each other without a pause:
/// under steady load the delay keeps about 10 – 13k keys waiting here. Past it the
/// store is behind ([`Kv::busy`]): retention's sweep holds back.
const EAGER_OVERLAY_KEYS: usize = 16 * 1024;
const _: () = assert!(EAGER_OVERLAY_KEYS < MAX_OVERLAY_KEYS);

/// Default of [`LoggedOptions::overlay_bytes`].
pub const DEFAULT_OVERLAY_BYTES: usize = 256 * 1024 * 1024;

/// A group commit whose write and `fdatasync` of the commit log take this long is
/// logged as a warning: no commit completes meanwhile (each is one `sync_duration`
/// histogram sample as well). Syncs from [`NOTED_SYNC`] on are logged at debug
/// level, so that a trace can set each beside an interval with no completed turn.
const SLOW_SYNC: Duration = Duration::from_millis(100);
/// See [`SLOW_SYNC`].
const NOTED_SYNC: Duration = Duration::from_millis(10);

/// Largest number of batches one group commit takes.
const MAX_GROUP: usize = 4096;

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
    /// needed again ([`crate::sled::Shared::park`]): sled keeps a record of every
    /// page of an open database in memory, about 60 bytes per finished turn kept.
    /// `None`: windows stay open.
    pub window_close_after: Option<Duration>,
    /// Bytes of keys and values the overlay may hold before commits wait for the
    /// applier, whatever the number of keys ([`MAX_OVERLAY_KEYS`]): large values
    /// (inputs and outputs near the frame limit) would fill memory long before the
    /// room in keys. A quarter of it counts as behind, as [`EAGER_OVERLAY_KEYS`].
    pub overlay_bytes: usize,
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
            mark_interval: DEFAULT_MARK_INTERVAL,
        }
    }
}

/// A value as the overlay holds it (`None`: deleted).
type Value = Option<Arc<[u8]>>;

/// A key as the overlay holds it: its bytes inline when they fit (every key of
/// the layout with a session id of up to 45 bytes), so that a search compares
/// bytes within the map's nodes rather than following a pointer per key to a
/// separate allocation (a cache miss each, in a map of tens of thousands of keys;
/// the overlay's inserts were most of the log writer's own CPU).
type OKey = smallvec::SmallVec<[u8; 56]>;

/// The newest value of a key that sled does not have yet.
struct Pending {
    lsn: u64,
    value: Value,
    /// No store holds the key but the overlay: it was created by a put the overlay
    /// still holds ([`Batch::put_new_turn`]), and the applier has written no value of
    /// it to sled since. A delete of such a key is dropped instead of written.
    fresh: bool,
    /// The value is the one the put that created the key wrote, and nothing wrote
    /// the key since (see [`runs`]).
    pristine: bool,
}

/// What an overlay entry counts toward [`LoggedOptions::overlay_bytes`]: its key
/// and value.
fn weight(key: &[u8], value: &Value) -> usize {
    key.len() + value.as_ref().map_or(0, |v| v.len())
}

struct Overlay {
    map: BTreeMap<OKey, Pending>,
    /// The [`weight`] of everything in `map`.
    bytes: usize,
    /// [`LoggedOptions::overlay_bytes`].
    max_bytes: usize,
    /// The last lsn whose writes are in `map` (or in sled).
    committed: u64,
    /// When each group not yet settled was put in `map`, with its last lsn (oldest
    /// first): see [`Overlay::settle`].
    groups: std::collections::VecDeque<(Instant, u64)>,
    /// The last lsn of the newest group put in `map` at least `apply_delay` ago.
    settled: u64,
}

impl Overlay {
    /// Past the room: commits wait for the applier.
    fn full(&self) -> bool {
        self.map.len() > MAX_OVERLAY_KEYS || self.bytes > self.max_bytes
    }

    /// Past the eager share of the room: the applier takes everything at once, and
    /// the store counts as behind.
    fn behind(&self) -> bool {
        self.map.len() > EAGER_OVERLAY_KEYS || self.bytes > self.max_bytes / 4
    }

    /// The last lsn of the groups put in the overlay at least `delay` before `now`
    /// (all of them when `delay` is zero: the newest group's lsn is `committed`).
    fn settle(&mut self, now: Instant, delay: Duration) -> u64 {
        while let Some(&(at, lsn)) = self.groups.front() {
            if now.saturating_duration_since(at) < delay {
                break;
            }
            self.settled = lsn;
            self.groups.pop_front();
        }
        self.settled
    }
}

/// Whether the applier lets a write of `key` wait [`LoggedOptions::apply_delay`]
/// before it takes it to sled: the records of live turns, invocations and sessions,
/// rewritten at every transition and (a turn's and an invocation's) deleted when
/// the turn ends, so that most of them never reach sled at all; and event values,
/// so that a round takes a session's values together and writes them as one
/// ([`runs::event_runs`]), all of them at or before the mark the round records. The
/// keys written once otherwise (folded records, list entries, idempotency keys) and
/// window drops are taken at the next round.
fn delays(key: &[u8]) -> bool {
    matches!(key.first(), Some(b'T' | b'I' | b'N' | b'M' | b'E'))
}

enum Ctl {
    /// Apply everything, flush sled and trim the log, then answer.
    Flush(mpsc::Sender<Result<(), StoreError>>),
    /// The overlay is full: apply now.
    Nudge,
    /// End the applier thread, as a panic in it would (tests only).
    #[cfg(test)]
    Exit,
    /// Run one round with this delay now, then answer (tests only).
    #[cfg(test)]
    Round(Duration, mpsc::Sender<()>),
}

struct Inner {
    sled: Arc<Shared>,
    /// The time windows of finished turns' records.
    windows: Windows,
    overlay: RwLock<Overlay>,
    stats: Mutex<CommitStats>,
    /// The commit log: appended to by the committer, read and trimmed by the applier.
    log: Arc<dyn CommitLog>,
    /// The last applier error and since when it has been failing, until an apply
    /// and flush succeed again.
    apply_error: Mutex<Option<(String, Instant)>>,
    /// How long the applier may keep failing before [`Kv::health`] fails.
    apply_patience: Duration,
    /// Notified whenever the applier has dropped entries from the overlay (a full
    /// overlay makes the committer wait on it).
    applied_cv: std::sync::Condvar,
    applied_mx: Mutex<()>,
    /// Sessions whose event values are not written as one by the applier for now,
    /// with how many holds each has ([`Kv::hold_event_merges`]).
    held: Mutex<HashMap<String, u32>>,
    /// Run once by the applier right after it wrote its next slice to sled, before
    /// it drops the slice from the overlay (a test's commit between the two).
    #[cfg(test)]
    after_slice: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

/// The store: commit log in front, sled behind. See the module documentation.
pub struct LoggedKv {
    inner: Arc<Inner>,
    tx: Mutex<Option<mpsc::Sender<LogJob>>>,
    ctl: Mutex<Option<mpsc::Sender<Ctl>>>,
    committer: Mutex<Option<std::thread::JoinHandle<()>>>,
    applier: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Run once by the next read right after it took its sources (a test's drop of a
    /// window between the two).
    #[cfg(test)]
    after_sources: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

/// What [`LoggedKv::open`] did before serving.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Replayed {
    pub records: usize,
    pub bytes: u64,
    pub millis: u64,
}

/// A batch on its way to the committer thread, already in the two forms the thread
/// needs: its log record ([`encode`]) and its writes as the overlay holds them. The
/// committing task prepares both (see [`LogJob::new`]), so the one thread every
/// commit passes through only frames, writes, syncs and publishes.
struct LogJob {
    /// Boxed by the committing task, so that the box goes back to be freed there
    /// with the buffers it holds (see [`Spent`]).
    spent: Box<Spent>,
    reply: CommitReply,
}

/// A job's buffers, sent back with its answer once the committer is done with them
/// (see [`CommitReply::send_spent`]): its log record, and its writes' slots, which
/// then hold the overlay values the group replaced (every write replaces at most
/// one).
struct Spent {
    record: Vec<u8>,
    /// Each write's key, value and whether it creates the key.
    writes: Vec<(OKey, Value, bool)>,
}

impl LogJob {
    fn new(batch: Batch, reply: CommitReply) -> LogJob {
        let record = encode(&batch);
        let (ops, created) = batch.into_parts();
        let writes = ops
            .into_iter()
            .enumerate()
            .map(|(i, op)| match op {
                KvOp::Put(k, v) => (OKey::from_vec(k), Some(Arc::from(v)), created.contains(&i)),
                KvOp::Delete(k) => (OKey::from_vec(k), None, false),
            })
            .collect();
        LogJob {
            spent: Box::new(Spent { record, writes }),
            reply,
        }
    }
}

fn lock_err(what: &str) -> StoreError {
    StoreError::Write(format!("{what} lock poisoned"))
}

/// A commit log record [`encode`] compressed starts with these two bytes (one that
/// is not starts with its first operation's tag length, `1, 0`), followed by LZ4
/// block data with its length prepended.
const LOG_PACKED: [u8; 2] = [0xFF, b'4'];
/// Records shorter than this are written as they are.
const LOG_PACK_FROM: usize = 512;
/// Longest record a compressed one may expand to: a batch is bounded by the
/// protocol's frame limit many times over, and a length past this is corruption
/// (the record's CRC passed, so not a torn write), never an allocation to make.
const LOG_UNPACKED_MAX: usize = 1 << 30;

/// A batch as one log record: per operation a tag (1 put, 2 delete), the key's
/// length and bytes and, for a put, the value's; LZ4-compressed when that saves
/// space. A one-step turn's two records hold its turn and invocation records,
/// events and session meta as JSON, then all of them again folded (about 4 KB):
/// compressed they took the device's writes per turn from 6.8 to
/// about 4.6 KB (`docs/benchmarks.md`). It runs on the committing caller's
/// thread, not the log writer's.
pub fn encode(batch: &Batch) -> Vec<u8> {
    let plain = encode_plain(batch);
    if plain.len() < LOG_PACK_FROM {
        return plain;
    }
    let Ok(size) = u32::try_from(plain.len()) else {
        return plain;
    };
    // The marker, the plain size (u32 LE) and the block, compressed in place: the
    // layout `compress_prepend_size` gives after the marker, without its copy.
    let head = LOG_PACKED.len() + 4;
    let mut out = vec![0u8; head + lz4_flex::block::get_maximum_output_size(plain.len())];
    out[..LOG_PACKED.len()].copy_from_slice(&LOG_PACKED);
    out[LOG_PACKED.len()..head].copy_from_slice(&size.to_le_bytes());
    match lz4_flex::block::compress_into(&plain, &mut out[head..]) {
        Ok(n) if head + n < plain.len() => {
            out.truncate(head + n);
            out
        }
        _ => plain,
    }
}

/// [`encode`] without compression.
fn encode_plain(batch: &Batch) -> Vec<u8> {
    let size: usize = batch
        .ops
        .iter()
        .map(|op| match op {
            KvOp::Put(k, v) => 9 + k.len() + v.len(),
            KvOp::Delete(k) => 5 + k.len(),
        })
        .sum();
    let mut out = Vec::with_capacity(size);
    let mut bytes = |b: &[u8]| {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    };
    for op in &batch.ops {
        match op {
            KvOp::Put(k, v) => {
                bytes(&[1]);
                bytes(k);
                bytes(v);
            }
            KvOp::Delete(k) => {
                bytes(&[2]);
                bytes(k);
            }
        }
    }
    out
}

/// The operations of a record written by [`encode`].
pub fn decode(p: &[u8]) -> Result<Vec<KvOp>, StoreError> {
    let Some(c) = p.strip_prefix(&LOG_PACKED[..]) else {
        return decode_plain(p);
    };
    let corrupt = |what: String| StoreError::Corrupt(format!("commit log record: {what}"));
    let size = c
        .get(..4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_le_bytes)
        .ok_or_else(|| corrupt("compressed, and cut short".into()))?;
    if size as usize > LOG_UNPACKED_MAX {
        return Err(corrupt(format!("compressed, claims {size} bytes")));
    }
    let plain = lz4_flex::block::decompress_size_prepended(c)
        .map_err(|e| corrupt(format!("compressed: {e}")))?;
    decode_plain(&plain)
}

/// The operations of a record [`encode_plain`] wrote.
fn decode_plain(mut p: &[u8]) -> Result<Vec<KvOp>, StoreError> {
    fn take<'a>(p: &mut &'a [u8]) -> Result<&'a [u8], StoreError> {
        let corrupt = || StoreError::Corrupt("commit log record is cut short".into());
        let len_bytes = p.get(..4).ok_or_else(corrupt)?;
        let len =
            u32::from_le_bytes([len_bytes[0], len_bytes[1], len_bytes[2], len_bytes[3]]) as usize;
        let b = p.get(4..4 + len).ok_or_else(corrupt)?;
        *p = &p[4 + len..];
        Ok(b)
    }
    let mut ops = Vec::new();
    while !p.is_empty() {
        let tag = take(&mut p)?;
        match tag {
            [1] => {
                let k = take(&mut p)?.to_vec();
                ops.push(KvOp::Put(k, take(&mut p)?.to_vec()));
            }
            [2] => ops.push(KvOp::Delete(take(&mut p)?.to_vec())),
            _ => {
                return Err(StoreError::Corrupt(format!(
                    "commit log record has an unknown operation {tag:?}"
                )))
            }
        }
    }
    Ok(ops)
}

/// The newest value of each key in `records`, with the lsn that wrote it, in key
/// order.
fn coalesce(records: &[Record]) -> Result<BTreeMap<Vec<u8>, (u64, Value)>, StoreError> {
    let mut map = BTreeMap::new();
    for r in records {
        for op in decode(&r.payload)? {
            match op {
                KvOp::Put(k, v) => map.insert(k, (r.lsn, Some(Arc::from(v)))),
                KvOp::Delete(k) => map.insert(k, (r.lsn, None)),
            };
        }
    }
    Ok(map)
}

/// Window drops committed in `entries` (keys of [`crate::keys::dropped_key`] put), with
/// the lsn of each.
fn drops<'a>(entries: impl Iterator<Item = (&'a [u8], u64, bool)>) -> Vec<(u64, u64)> {
    entries
        .filter(|(_, _, put)| *put)
        .filter_map(|(k, lsn, _)| crate::keys::dropped_start(k).map(|s| (s, lsn)))
        .collect()
}

/// The drops the main database records: window start → lsn of the drop.
fn recorded_drops(sled: &Shared) -> Result<BTreeMap<u64, u64>, StoreError> {
    let (s, e) = crate::keys::dropped_range();
    sled.with(|h| {
        let mut out = BTreeMap::new();
        for kv in h.db.range(s..e) {
            let (k, v) = kv.map_err(|e| StoreError::Read(e.to_string()))?;
            if let Some(start) = crate::keys::dropped_start(&k) {
                let lsn = <[u8; 8]>::try_from(v.as_ref()).map_or(0, u64::from_be_bytes);
                out.insert(start, lsn);
            }
        }
        Ok(out)
    })
}

/// Write `entries` (key order, each with the lsn that wrote it) where they belong:
/// folded records to their time window, the rest to the main database (a window
/// drop with the lsn that made it as its value), in bounded batches. Returns the
/// bytes written and the windows written to (not yet synced), with how many keys each.
fn apply_routed<'a>(
    sled: &Shared,
    wins: &Windows,
    entries: impl Iterator<Item = (&'a [u8], u64, Option<&'a [u8]>)>,
) -> Result<(u64, Vec<(u64, u64)>), StoreError> {
    type Op<'b> = (&'b [u8], Option<&'b [u8]>);
    let mut main: Vec<Op<'a>> = Vec::new();
    let mut to_windows: BTreeMap<u64, Vec<Op<'a>>> = BTreeMap::new();
    let mut dropped: Vec<(&'a [u8], u64)> = Vec::new();
    for (k, lsn, v) in entries {
        if k.first() == Some(&b'W') && v.is_some() {
            dropped.push((k, lsn));
            continue;
        }
        match wins.route(k) {
            Route::Main => main.push((k, v)),
            Route::Window(start) => to_windows.entry(start).or_default().push((k, v)),
        }
    }
    let mut bytes = 0;
    let mut written = Vec::new();
    for (start, entries) in to_windows {
        let Some(w) = wins.get(start) else {
            return Err(StoreError::Write(format!("window {start} is not open")));
        };
        let n = entries.len() as u64;
        bytes += apply_to_sled(&w, entries.into_iter(), None)?;
        written.push((start, n));
    }
    bytes += apply_to_sled(sled, main.into_iter(), None)?;
    if !dropped.is_empty() {
        let values: Vec<[u8; 8]> = dropped.iter().map(|(_, l)| l.to_be_bytes()).collect();
        bytes += apply_to_sled(
            sled,
            dropped
                .iter()
                .zip(&values)
                .map(|((k, _), v)| (*k, Some(&v[..]))),
            None,
        )?;
    }
    Ok((bytes, written))
}

/// Flush and `fdatasync` the windows in `written`: done before the main database
/// records an applied mark past their writes, so that a mark never claims what a
/// window may not have.
fn sync_windows(wins: &Windows, written: &[u64]) -> Result<(), StoreError> {
    for start in written {
        match wins.get(*start) {
            // Parked after its writes: `park` synced them, and a write since would
            // have opened it again.
            Some(w) if w.is_parked() => {}
            Some(w) => w.with(|h| w.sync_files(h))?,
            None => {}
        }
    }
    Ok(())
}

/// Reads a range of a sled database's keys, values as stored (a value file pointer
/// resolved: [`Shared::stored`]), without its applied mark ([`windows::ReadRange`]).
fn read_range<'h>(
    src: &'h Shared,
    h: &'h Handle,
) -> impl FnMut(&[u8], &[u8]) -> Result<Vec<Entry>, StoreError> + 'h {
    move |s: &[u8], e: &[u8]| {
        h.db.range(s.to_vec()..e.to_vec())
            .filter(|kv| kv.as_ref().map_or(true, |(k, _)| k.as_ref() != APPLIED_KEY))
            .map(|kv| {
                let (k, v) = kv.map_err(|e| StoreError::Read(e.to_string()))?;
                Ok((k.to_vec(), src.stored(&v)?.into_owned()))
            })
            .collect()
    }
}

/// Take a committed drop of the window starting at `start` (by the record `lsn`):
/// copy what it still holds of stored turns ([`windows::leftovers`]) to the main
/// database, as stored, then route its keys there. Returns the window's database, to
/// close and delete once the drop is durable, and how many keys it passed on.
#[allow(clippy::type_complexity)]
fn take_drop(
    sled: &Shared,
    wins: &Windows,
    start: u64,
    lsn: u64,
) -> Result<(Option<(u64, Arc<Shared>)>, u64), StoreError> {
    let mut leftovers = 0;
    if let Some(w) = wins.get(start) {
        // Unfinished turns minted in the window: their records are in the main
        // database, written by now (this round wrote everything up to the drop).
        let unfinished = sled.with(|h| {
            windows::unfinished_turns(&mut read_range(sled, h), &unpack, start, wins.end_of(start))
        })?;
        // Only what belongs to turns still stored (see `windows::leftovers`): the
        // rest is of turns retention deleted, left for this drop to take.
        let held = w.with(|h| windows::leftovers(&mut read_range(&w, h), &unpack, &unfinished))?;
        leftovers = held.len() as u64;
        if !held.is_empty() {
            tracing::warn!(
                "the time window {start} still held {} keys of stored turns when it was dropped (turns that ended while retention judged it empty): moved to the main database",
                held.len()
            );
            sled.with(|h| {
                for chunk in held.chunks(APPLY_KEYS) {
                    let mut b = sled::Batch::default();
                    for (k, v) in chunk {
                        b.insert(k.as_slice(), v.as_slice());
                    }
                    h.db.apply_batch(b)
                        .map_err(|e| StoreError::Write(format!("apply to sled: {e}")))?;
                }
                Ok(())
            })?;
        }
    }
    Ok((
        wins.mark_dropped(start, lsn)?.map(|w| (start, w)),
        leftovers,
    ))
}

/// Write records read back from the log (coalesced) where they belong, record
/// `mark` as applied, make all of it durable, and finish the drops among them.
fn replay_into(
    sled: &Shared,
    wins: &Windows,
    map: &BTreeMap<Vec<u8>, (u64, Value)>,
    mark: u64,
) -> Result<(), StoreError> {
    let (_, written) = apply_routed(
        sled,
        wins,
        map.iter()
            .map(|(k, (l, v))| (k.as_slice(), *l, v.as_deref())),
    )?;
    let written: Vec<u64> = written.into_iter().map(|(w, _)| w).collect();
    sync_windows(wins, &written)?;
    let mut closing = Vec::new();
    for (start, lsn) in drops(
        map.iter()
            .map(|(k, (l, v))| (k.as_slice(), *l, v.is_some())),
    ) {
        closing.extend(take_drop(sled, wins, start, lsn)?.0);
    }
    apply_to_sled(sled, std::iter::empty(), Some(mark))?;
    sled.with(|h| sled.sync_files(h))?;
    for (start, w) in closing {
        wins.delete(start, w)?;
    }
    Ok(())
}

impl Inner {
    /// Whether the overlay is past the eager share of its room ([`Overlay::behind`]).
    fn behind(&self) -> bool {
        self.overlay.read().map(|o| o.behind()).unwrap_or(false)
    }

    /// The sessions held now ([`Kv::hold_event_merges`]).
    fn held_sessions(&self) -> HashSet<String> {
        self.held
            .lock()
            .map(|h| h.keys().cloned().collect())
            .unwrap_or_default()
    }
}

impl LoggedKv {
    /// Open (or create) the store in `dir`: sled in `dir`, the commit log in
    /// `dir/log`. Writes what the log holds past sled's applied mark to sled first.
    pub fn open(dir: &Path, opts: LoggedOptions) -> Result<(LoggedKv, Replayed), StoreError> {
        let log_dir = dir.join("log");
        LoggedKv::open_with_log(dir, opts, |applied| {
            LocalLog::open(&log_dir, opts.segment_bytes, applied).map(Opened::boxed)
        })
    }

    /// [`LoggedKv::open`] with the commit log `open_log` opens at the last lsn sled
    /// holds (any [`CommitLog`]; `dir` holds sled and the windows).
    pub fn open_with_log(
        dir: &Path,
        opts: LoggedOptions,
        open_log: impl FnOnce(u64) -> Result<Opened<Box<dyn CommitLog>>, StoreError>,
    ) -> Result<(LoggedKv, Replayed), StoreError> {
        let started = Instant::now();
        let (main_mb, hot_mb) =
            crate::windows::store::split_cache(opts.sled.cache_mb, &opts.windows);
        let sled = Arc::new(Shared::open(
            dir,
            SledOptions {
                cache_mb: main_mb,
                ..opts.sled
            },
        )?);
        let applied = applied_mark(&sled)?;
        let wins = Windows::open(
            dir,
            opts.windows,
            SledOptions {
                cache_mb: hot_mb,
                ..opts.sled
            },
            &recorded_drops(&sled)?,
            opts.window_close_after.is_some(),
        )?;
        let opened = open_log(applied)?;
        let log: Arc<dyn CommitLog> = Arc::from(opened.log);
        let mut replayed = Replayed {
            records: opened.records.len(),
            bytes: opened.bytes,
            millis: 0,
        };
        if let Some(last) = opened.records.last().map(|r| r.lsn) {
            let map = coalesce(&opened.records)?;
            replay_into(&sled, &wins, &map, last)?;
            log.trim(last)?;
        }
        let committed = log.next_lsn() - 1;
        replayed.millis = started.elapsed().as_millis() as u64;
        let inner = Arc::new(Inner {
            sled,
            windows: wins,
            overlay: RwLock::new(Overlay {
                map: BTreeMap::new(),
                bytes: 0,
                max_bytes: opts.overlay_bytes,
                committed,
                groups: Default::default(),
                settled: committed,
            }),
            stats: Mutex::new(CommitStats::default()),
            log,
            apply_error: Mutex::new(None),
            apply_patience: opts.heal_interval.saturating_mul(10),
            applied_cv: std::sync::Condvar::new(),
            applied_mx: Mutex::new(()),
            held: Mutex::new(HashMap::new()),
            #[cfg(test)]
            after_slice: Mutex::new(None),
        });
        let (tx, rx) = mpsc::channel::<LogJob>();
        let (ctl_tx, ctl_rx) = mpsc::channel::<Ctl>();
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .map_err(|e| StoreError::Write(format!("spawn {name}: {e}")))
        };
        let committer = {
            let inner = inner.clone();
            let nudge = ctl_tx.clone();
            spawn(
                "turnd-log-writer",
                Box::new(move || committer_loop(&inner, rx, &nudge, &opts)),
            )?
        };
        let applier = {
            let inner = inner.clone();
            spawn(
                "turnd-store-applier",
                Box::new(move || applier_loop(&inner, ctl_rx, &opts, committed)),
            )?
        };
        Ok((
            LoggedKv {
                inner,
                tx: Mutex::new(Some(tx)),
                ctl: Mutex::new(Some(ctl_tx)),
                committer: Mutex::new(Some(committer)),
                applier: Mutex::new(Some(applier)),
                #[cfg(test)]
                after_sources: Mutex::new(None),
            },
            replayed,
        ))
    }

    /// Commit everything queued, apply it to sled, flush and sync sled, trim the
    /// log, and stop both threads. The next open then reads no log.
    pub fn close(&self) -> Result<(), StoreError> {
        drop(self.tx.lock().map_err(|_| StoreError::Closed)?.take());
        if let Some(c) = self
            .committer
            .lock()
            .map_err(|_| StoreError::Closed)?
            .take()
        {
            c.join()
                .map_err(|_| StoreError::Write("log writer thread panicked".into()))?;
        }
        let flushed = self.flush_now();
        drop(self.ctl.lock().map_err(|_| StoreError::Closed)?.take());
        if let Some(a) = self.applier.lock().map_err(|_| StoreError::Closed)?.take() {
            a.join()
                .map_err(|_| StoreError::Write("applier thread panicked".into()))?;
        }
        flushed
    }

    /// Ask the applier to apply, flush and trim now, and wait for it.
    fn flush_now(&self) -> Result<(), StoreError> {
        let (reply, rx) = mpsc::channel();
        {
            let ctl = self.ctl.lock().map_err(|_| StoreError::Closed)?;
            let ctl = ctl.as_ref().ok_or(StoreError::Closed)?;
            ctl.send(Ctl::Flush(reply))
                .map_err(|_| StoreError::Closed)?;
        }
        crate::sled::blocking(|| rx.recv().map_err(|_| StoreError::Closed)?)
    }

    /// Keys written but not yet in sled.
    pub fn overlay_len(&self) -> usize {
        self.inner.overlay.read().map(|o| o.map.len()).unwrap_or(0)
    }

    /// Bytes of keys and values written but not yet in sled, as counted; checked
    /// against the overlay's entries.
    #[cfg(test)]
    fn overlay_bytes(&self) -> usize {
        let o = self.inner.overlay.read().expect("overlay");
        let counted: usize = o.map.iter().map(|(k, p)| weight(k, &p.value)).sum();
        assert_eq!(o.bytes, counted, "the overlay's bytes as counted");
        o.bytes
    }
}

impl Drop for LoggedKv {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            if !matches!(e, StoreError::Closed) {
                tracing::error!("failed to close store: {e}");
            }
        }
    }
}

/// Bytes [`probe_disk`] writes.
const PROBE_BYTES: usize = 64 * 1024;

/// Write, sync and remove a small file in `dir`: Err while the disk refuses writes
/// (full, or failing).
fn probe_disk(dir: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::FileExt;
    let path = dir.join("write-probe");
    let r = std::fs::File::create(&path)
        .and_then(|f| {
            f.write_all_at(&[0u8; PROBE_BYTES], 0)?;
            f.sync_data()
        })
        .map_err(|e| StoreError::io(IoOp::Write, "the disk still refuses writes", &e));
    if let Err(e) = std::fs::remove_file(&path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::debug!("remove {path:?}: {e}");
        }
    }
    r
}

/// The last lsn sled holds (its [`APPLIED_KEY`]; 0 for a new store).
fn applied_mark(sled: &Shared) -> Result<u64, StoreError> {
    let v = sled.with(|h| {
        h.db.get(APPLIED_KEY)
            .map_err(|e| StoreError::Read(e.to_string()))
    })?;
    match v {
        Some(v) => {
            let b: [u8; 8] = v
                .as_ref()
                .try_into()
                .map_err(|_| StoreError::Corrupt(format!("applied mark of {} bytes", v.len())))?;
            Ok(u64::from_be_bytes(b))
        }
        None => Ok(0),
    }
}

/// A key with its value packed for sled ([`pack`]), or None for a delete.
type Packed<'a> = (&'a [u8], Option<std::borrow::Cow<'a, [u8]>>);

/// Write `entries` (key order) to sled in bounded batches, the last recording
/// `lsn`, when given, under [`APPLIED_KEY`]. A database with a value file (a time
/// window) has the large values of each batch appended to it in one write first,
/// and holds pointers to them ([`crate::sled::values`]). Returns the bytes written.
fn apply_to_sled<'a>(
    sled: &Shared,
    entries: impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)>,
    lsn: Option<u64>,
) -> Result<u64, StoreError> {
    let mut bytes = 0u64;
    let mut entries = entries.peekable();
    sled.with(|h| loop {
        let chunk: Vec<Packed<'_>> = entries
            .by_ref()
            .take(APPLY_KEYS)
            .map(|(k, v)| (k, v.map(pack)))
            .collect();
        let last = entries.peek().is_none();
        if chunk.is_empty() && !(last && lsn.is_some()) {
            return Ok(());
        }
        let file = sled.values();
        let outside = |v: &[u8]| file.is_some() && v.len() >= values::OUT_FROM;
        let large: Vec<&[u8]> = chunk
            .iter()
            .filter_map(|(_, v)| v.as_deref())
            .filter(|v| outside(v))
            .collect();
        let pointers = match file {
            Some(f) if !large.is_empty() => {
                f.append(&large).inspect_err(|_| sled.note_failure())?
            }
            _ => Vec::new(),
        };
        let mut pointers = pointers.iter();
        let mut batch = sled::Batch::default();
        for (k, v) in &chunk {
            match v {
                Some(v) if outside(v) => {
                    let p = pointers.next().ok_or_else(|| {
                        StoreError::Write("a value file append returned too few pointers".into())
                    })?;
                    bytes += (k.len() + v.len() + p.len()) as u64;
                    batch.insert(*k, &p[..]);
                }
                Some(v) => {
                    bytes += (k.len() + v.len()) as u64;
                    batch.insert(*k, &**v);
                }
                None => {
                    bytes += k.len() as u64;
                    batch.remove(*k);
                }
            }
        }
        if last {
            if let Some(lsn) = lsn {
                batch.insert(APPLIED_KEY, &lsn.to_be_bytes());
            }
        }
        h.db.apply_batch(batch)
            .map_err(|e| StoreError::Write(format!("apply to sled: {e}")))?;
        if last {
            return Ok(());
        }
    })?;
    Ok(bytes)
}

/// Wait while the overlay holds more than [`MAX_OVERLAY_KEYS`], asking the applier
/// to run now, and count the wait in the commit stats. Err when no room came within
/// `patience`: the applier is stuck or failing, and the group is refused rather than
/// left waiting for good.
fn wait_for_room(
    inner: &Inner,
    nudge: &mpsc::Sender<Ctl>,
    patience: Duration,
) -> Result<(), StoreError> {
    let full = || inner.overlay.read().map(|o| o.full()).unwrap_or(false);
    if !full() {
        return Ok(());
    }
    let start = Instant::now();
    let give_up = start + patience;
    while full() {
        if Instant::now() >= give_up {
            return Err(StoreError::Write(format!(
                "sled behind the commit log has taken nothing for {} ms; {MAX_OVERLAY_KEYS} keys wait for it",
                patience.as_millis()
            )));
        }
        if nudge.send(Ctl::Nudge).is_err() {
            // Nothing will take the overlay's keys to sled any more: refuse rather
            // than let it grow with every commit.
            return Err(StoreError::Write(format!(
                "the store's applier thread has ended; {MAX_OVERLAY_KEYS} keys wait for sled"
            )));
        }
        let Ok(g) = inner.applied_mx.lock() else {
            break;
        };
        // A timeout, so that a notification between the check and the wait is not
        // missed for long.
        if inner
            .applied_cv
            .wait_timeout(g, Duration::from_millis(10))
            .is_err()
        {
            break;
        }
    }
    if let Ok(mut s) = inner.stats.lock() {
        s.room_waits += 1;
        s.room_wait_micros += start.elapsed().as_micros() as u64;
    }
    Ok(())
}

/// Groups of at least this many batches make the next group wait for more.
const GATHER_FROM: usize = 4;
/// The longest a group waits for more batches.
const GATHER_MAX: Duration = Duration::from_millis(1);
/// How long a group waits for more batches while the process keeps the machine's
/// cores busy, in writes and syncs of the previous group (otherwise once).
const GATHER_BUSY_SYNCS: u32 = 2;
/// The share of all cores the process used over the last [`CPU_SAMPLE`] from which
/// it counts as keeping them busy.
const GATHER_BUSY_SHARE: f64 = 0.85;
/// How often the committer samples the process's CPU time.
const CPU_SAMPLE: Duration = Duration::from_millis(20);

/// A sleep that grew the group by less than this share on average (batches it
/// brought, against those taken before it) is not worth its wait.
const GATHER_GAIN_MIN: f64 = 0.5;
/// While sleeping does not pay, every this many large groups sleeps once anyway, to
/// notice when it pays again.
const GATHER_PROBE_EVERY: u32 = 16;

/// What the committer knows of its earlier gathers.
struct Gather {
    /// How much a sleep grew the group (batches it brought over those taken before
    /// it), as a running mean (each sleep weighs half).
    gain: f64,
    /// Large groups since the last sleep, while sleeping does not pay.
    skipped: u32,
    /// Whether the process kept the cores busy when last sampled.
    busy: bool,
    /// The process's CPU time and the time it was sampled at, and the cores.
    sampled: Option<(Instant, Duration)>,
    cores: f64,
}

impl Gather {
    fn new() -> Gather {
        Gather {
            gain: GATHER_GAIN_MIN,
            skipped: 0,
            busy: false,
            sampled: None,
            cores: std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64),
        }
    }

    /// Sample the process's CPU time, at most every [`CPU_SAMPLE`], and note whether
    /// it used [`GATHER_BUSY_SHARE`] of the cores since the last sample.
    fn sample_cpu(&mut self, now: Instant) {
        if self
            .sampled
            .is_some_and(|(at, _)| now.saturating_duration_since(at) < CPU_SAMPLE)
        {
            return;
        }
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
        let cpu = Duration::new(
            u64::try_from(t.tv_sec).unwrap_or(0),
            u32::try_from(t.tv_nsec).unwrap_or(0),
        );
        if let Some((at, before)) = self.sampled {
            self.busy = busy_share(
                now.saturating_duration_since(at),
                cpu.saturating_sub(before),
                self.cores,
            ) >= GATHER_BUSY_SHARE;
        }
        self.sampled = Some((now, cpu));
    }

    /// How long the next sleep is, after a group that took `last_sync`.
    fn sleep_for(&self, last_sync: Duration) -> Duration {
        let syncs = if self.busy { GATHER_BUSY_SYNCS } else { 1 };
        last_sync.saturating_mul(syncs).min(GATHER_MAX)
    }
}

/// The share of `cores` that `cpu` of CPU time over `wall` is.
fn busy_share(wall: Duration, cpu: Duration, cores: f64) -> f64 {
    if wall.is_zero() || cores <= 0.0 {
        return 0.0;
    }
    cpu.as_secs_f64() / (wall.as_secs_f64() * cores)
}

/// When the previous group had [`GATHER_FROM`] batches or more (many committers at
/// once), sleep for as long as the previous group's write and sync took (at most
/// [`GATHER_MAX`]) and then take every batch queued meanwhile. Under load this makes
/// fewer, larger groups, each one `fdatasync`. The thread sleeps rather than waits
/// on the queue: a wait would be woken by every batch that arrives (a futex wake for
/// the committing task and a context switch for this thread, each time), a sleep
/// costs one wake-up however many arrive.
///
/// A sleep pays only while committers outside the group are about to commit. When a
/// handful of committers are all in the group (a few sessions in a closed loop),
/// none arrives during it and it only delays them; so once sleeps grow groups by
/// less than [`GATHER_GAIN_MIN`] on average, only every [`GATHER_PROBE_EVERY`]th
/// large group sleeps. A lone committer (groups of one, as in a sequential client)
/// never waits.
///
/// While the process keeps the machine's cores busy ([`GATHER_BUSY_SHARE`]), the
/// sleep is [`GATHER_BUSY_SYNCS`] times as long: the commits are then held up by the
/// CPU more than by the log, and fewer, larger groups leave more of it to the work
/// that makes them (under `turnd-bench sessions`, groups of 16 – 19 batches instead
/// of 9 and a fifth less CPU per turn for the whole process). Otherwise a longer
/// sleep only delays the committers: a closed loop of 16 sessions, which does not
/// fill the cores, lost a sixth of its throughput to it. Returns whether it slept.
fn gather(
    rx: &mpsc::Receiver<LogJob>,
    jobs: &mut Vec<LogJob>,
    last_group: usize,
    last_sync: Duration,
    g: &mut Gather,
) -> bool {
    if last_group < GATHER_FROM || jobs.len() >= MAX_GROUP {
        return false;
    }
    if g.gain < GATHER_GAIN_MIN && g.skipped + 1 < GATHER_PROBE_EVERY {
        g.skipped += 1;
        return false;
    }
    g.skipped = 0;
    let before = jobs.len();
    std::thread::sleep(g.sleep_for(last_sync));
    take_queued(rx, jobs);
    g.gain = (g.gain + (jobs.len() - before) as f64 / before.max(1) as f64) / 2.0;
    true
}

/// Take every queued batch, up to [`MAX_GROUP`] in the group.
fn take_queued(rx: &mpsc::Receiver<LogJob>, jobs: &mut Vec<LogJob>) {
    while jobs.len() < MAX_GROUP {
        match rx.try_recv() {
            Ok(j) => jobs.push(j),
            Err(_) => break,
        }
    }
}

fn committer_loop(
    inner: &Inner,
    rx: mpsc::Receiver<LogJob>,
    nudge: &mpsc::Sender<Ctl>,
    opts: &LoggedOptions,
) {
    let mut last_heal: Option<Instant> = None;
    // Size of the previous group and how long its write and sync took.
    let mut last_group = 0usize;
    let mut last_sync = Duration::ZERO;
    let mut gathered = Gather::new();
    while let Ok(first) = rx.recv() {
        let room = wait_for_room(inner, nudge, opts.heal_interval.saturating_mul(5));
        let mut jobs = vec![first];
        take_queued(&rx, &mut jobs);
        gathered.sample_cpu(Instant::now());
        gather(&rx, &mut jobs, last_group, last_sync, &mut gathered);
        last_group = jobs.len();
        if let Err(e) = room {
            tracing::error!("refused a group of {} batches: {e}", jobs.len());
            for job in jobs {
                if job.reply.send(Err(e.clone())).is_err() {
                    tracing::debug!("committer went away before its commit was refused");
                }
            }
            continue;
        }
        let started = Instant::now();
        let log = &inner.log;
        if log.is_failed() && last_heal.is_none_or(|t| t.elapsed() >= opts.heal_interval) {
            last_heal = Some(started);
            match log.heal() {
                Ok(()) => tracing::info!("the commit log is writable again"),
                Err(e) => tracing::warn!("the commit log is still not writable: {e}"),
            }
        }
        let bytes: u64 = jobs.iter().map(|j| j.spent.record.len() as u64).sum();
        // The write and sync alone, without a repair of the log before them.
        let writing = Instant::now();
        let records: Vec<&[u8]> = jobs.iter().map(|j| j.spent.record.as_slice()).collect();
        let result = log.append(&records, opts.sled.sync == SyncMode::Always);
        drop(records);
        let synced = writing.elapsed();
        last_sync = synced;
        if synced >= NOTED_SYNC {
            let (took_ms, batches) = (synced.as_millis() as u64, jobs.len());
            if synced >= SLOW_SYNC {
                tracing::warn!(took_ms, batches, bytes, "the commit log's write and fdatasync took {took_ms} ms; every commit waited for the disk");
            } else {
                tracing::debug!(took_ms, batches, bytes, "the commit log's write and fdatasync took {took_ms} ms; every commit waited for the disk");
            }
        }
        // Each write's slot takes the value it replaces in the overlay, so that the
        // committing task frees it with the rest of its batch.
        let result = result.and_then(|first_lsn| {
            let mut o = inner.overlay.write().map_err(|_| lock_err("overlay"))?;
            for (i, job) in jobs.iter_mut().enumerate() {
                let lsn = first_lsn + i as u64;
                for (k, value, created) in &mut job.spent.writes {
                    let mut pending = Pending {
                        lsn,
                        value: value.take(),
                        fresh: *created,
                        pristine: *created,
                    };
                    let added = weight(k, &pending.value);
                    let removed = match o.map.entry(std::mem::take(k)) {
                        std::collections::btree_map::Entry::Vacant(e) => {
                            e.insert(pending);
                            0
                        }
                        std::collections::btree_map::Entry::Occupied(mut e) => {
                            // Still only in the overlay if it was before (a put
                            // that says it creates the key cannot, when the overlay
                            // holds a write of it already).
                            pending.fresh = e.get().fresh;
                            pending.pristine = false;
                            *value = std::mem::replace(e.get_mut(), pending).value;
                            weight(e.key(), value)
                        }
                    };
                    o.bytes = (o.bytes + added).saturating_sub(removed);
                }
            }
            o.committed = first_lsn + jobs.len() as u64 - 1;
            let committed = o.committed;
            o.groups.push_back((Instant::now(), committed));
            Ok(())
        });
        if let Err(e) = &result {
            tracing::error!("failed to commit a group of {} batches: {e}", jobs.len());
        }
        let micros = started.elapsed().as_micros() as u64;
        if let Ok(mut s) = inner.stats.lock() {
            s.syncs += 1;
            s.batches += jobs.len() as u64;
            s.commit_micros += micros;
            s.record_sync(synced);
            s.max_group = s.max_group.max(jobs.len() as u64);
            s.log_bytes += bytes;
        }
        for job in jobs {
            if job
                .reply
                .send_spent(result.clone(), Some(job.spent))
                .is_err()
            {
                tracing::debug!("committer went away before its commit finished");
            }
        }
    }
    if let Err(e) = inner.log.flush() {
        tracing::error!("failed to sync the commit log at close: {e}");
    }
}

/// The applier's state between rounds.
struct Applier<'a> {
    inner: &'a Inner,
    checkpoints: Checkpoints,
    /// Everything up to this lsn is in sled (not necessarily on disk).
    applied: u64,
    /// The applied mark last written to the main database ([`Applier::write_mark`]).
    marked: u64,
    /// When it was written.
    marked_at: Instant,
    /// Windows written since they were last synced: synced before the next mark.
    unsynced: Vec<u64>,
    /// [`LoggedOptions::mark_interval`].
    mark_interval: Duration,
    /// The applied mark when sled's files were last synced: sled holds at least
    /// this much whatever happens to its handle.
    synced: u64,
    /// When sled was last opened again after failing (see [`Applier::repair`]).
    last_repair: Option<Instant>,
    heal_interval: Duration,
    /// Dropped windows whose directories are still to delete, once their drops are
    /// durable in the main database.
    closing: Vec<(u64, Arc<Shared>)>,
    upkeep: Upkeep,
    /// [`LoggedOptions::idle_reopen`].
    idle_reopen: Duration,
    /// [`LoggedOptions::window_close_after`].
    window_close_after: Option<Duration>,
    /// When the log's upkeep last failed (tried again after `heal_interval`).
    upkeep_failed: Option<Instant>,
}

impl Applier<'_> {
    /// Write the overlay to sled and drop what sled now has from it.
    ///
    /// The overlay is walked in key order in slices of [`APPLY_KEYS`], each copied
    /// under the read lock, written to sled, and dropped from the overlay where not
    /// written again since, so the copy never holds more than a slice. Entries
    /// committed meanwhile may be written too (their newer values: harmless). Only
    /// after every slice does sled get the applied mark: everything up to the lsn
    /// committed when the round began is then in sled. The walk ends at the last
    /// key the overlay held when the round began, so that a round ends however fast
    /// new keys arrive (new turns and events have ever larger keys).
    ///
    /// A write of a live record ([`delays`]) is taken only once its group is
    /// `delay` old (*settled*), and the mark is then the last settled lsn: what a
    /// start replays past it holds every write left waiting. A round that takes a
    /// window drop takes everything (a drop's window is deleted after the round, and
    /// a replay from before the drop would route keys to it). A delete of a key only
    /// the overlay held ([`Pending::fresh`]) is dropped, not written.
    fn apply(&mut self, delay: Duration) -> Result<(), StoreError> {
        let started = Instant::now();
        let (committed, settled, end) = {
            let mut o = self
                .inner
                .overlay
                .write()
                .map_err(|_| lock_err("overlay"))?;
            let settled = o.settle(started, delay);
            (o.committed, settled, o.map.keys().next_back().cloned())
        };
        // A new window is made only when turns were admitted or finished (their list
        // entries or folded records are to be written): an idle daemon makes none.
        let turns_pending = {
            let o = self.inner.overlay.read().map_err(|_| lock_err("overlay"))?;
            [
                crate::keys::finished_range(),
                crate::keys::session_turn_range(),
            ]
            .iter()
            .any(|(s, e)| {
                o.map
                    .range::<[u8], _>((Bound::Included(&s[..]), Bound::Excluded(&e[..])))
                    .next()
                    .is_some()
            })
        };
        if turns_pending {
            // An error: a window that could not be made left its directory, which
            // would take keys written now at the next start; nothing is written
            // until it is removed.
            match self.inner.windows.switch_if_due()? {
                // Not idle before it took its first writes.
                Switch::Made(start) => self.inner.windows.written(&mut self.upkeep, start, 0),
                Switch::NotDue => {}
                Switch::Failed(e) => {
                    tracing::warn!(
                        "a new time window could not be made (nothing of it is left; tried again next round): {e}"
                    );
                }
            }
        }
        if committed == self.applied {
            return self.mark_if_due(false);
        }
        // Drops committed since the last round, taken once this round's writes are in
        // the windows (retention's deletes of their records among them): what they
        // still hold then moves to the main database, where their keys go from now on.
        let pending: Vec<(u64, u64)> = {
            let o = self.inner.overlay.read().map_err(|_| lock_err("overlay"))?;
            let (s, e) = crate::keys::dropped_range();
            drops(
                o.map
                    .range::<[u8], _>((Bound::Included(&s[..]), Bound::Excluded(&e[..])))
                    .map(|(k, p)| (k.as_slice(), p.lsn, p.value.is_some())),
            )
        };
        let mark = if pending.is_empty() {
            settled.max(self.applied)
        } else {
            committed
        };
        let Some(end) = end else {
            self.applied = committed;
            return self.mark_if_due(false);
        };
        // After the first slice, the walk goes on past the last key taken (an
        // exclusive start: past `end` the range is empty, never reversed).
        let mut from: Bound<OKey> = Bound::Unbounded;
        let mut keys = 0u64;
        let mut skipped = 0u64;
        let mut merged = 0u64;
        // The lowest lsn of the runs that stayed in the overlay: the mark stays
        // before it (see `runs`).
        let mut kept: Option<u64> = None;
        loop {
            // A slice of up to APPLY_KEYS entries to take (the waiting ones passed
            // over), each with whether it is a delete only the overlay knew of.
            let mut last = None;
            let slice: Vec<Taken> = {
                let o = self.inner.overlay.read().map_err(|_| lock_err("overlay"))?;
                let mut walked = 0usize;
                let mut slice = Vec::new();
                let mut gap = false;
                for (k, p) in o.map.range::<[u8], _>((
                    from.as_ref().map(|k| k.as_slice()),
                    Bound::Included(end.as_slice()),
                )) {
                    walked += 1;
                    if p.lsn <= mark || !delays(k) {
                        slice.push(Taken {
                            key: k.clone(),
                            lsn: p.lsn,
                            value: p.value.clone(),
                            fresh: p.fresh,
                            pristine: p.pristine,
                            gap_before: std::mem::take(&mut gap),
                        });
                    } else {
                        gap = true;
                    }
                    if slice.len() == APPLY_KEYS || walked == 4 * APPLY_KEYS {
                        last = Some(k.clone());
                        break;
                    }
                }
                slice
            };
            // No runs in a round that takes a window drop: its mark must be
            // everything committed, and a run that had to stay would hold it back.
            let runs = if pending.is_empty() {
                event_runs(&slice, self.applied, mark, &self.inner.held_sessions())
            } else {
                Vec::new()
            };
            let applied = apply_routed(
                &self.inner.sled,
                &self.inner.windows,
                sled_writes(&slice, &runs),
            );
            let (bytes, wins) = match applied {
                Ok(done) => done,
                Err(e) => {
                    let mut o = self
                        .inner
                        .overlay
                        .write()
                        .map_err(|_| lock_err("overlay"))?;
                    forget_fresh(&mut o.map, &slice);
                    return Err(e);
                }
            };
            self.checkpoints.wrote(bytes);
            for (w, keys) in wins {
                self.inner.windows.written(&mut self.upkeep, w, keys);
                if !self.unsynced.contains(&w) {
                    self.unsynced.push(w);
                }
            }
            #[cfg(test)]
            if let Some(hook) = self
                .inner
                .after_slice
                .lock()
                .ok()
                .and_then(|mut h| h.take())
            {
                hook();
            }
            {
                let mut o = self
                    .inner
                    .overlay
                    .write()
                    .map_err(|_| lock_err("overlay"))?;
                let held = self.inner.held_sessions();
                let (stayed, freed) = drop_applied(&mut o.map, &slice, &runs, &held);
                o.bytes = o.bytes.saturating_sub(freed);
                if let Some(lsn) = stayed {
                    kept = Some(kept.map_or(lsn, |k: u64| k.min(lsn)));
                }
            }
            self.inner.applied_cv.notify_all();
            let dropped = slice.iter().filter(|e| e.dropped()).count() as u64;
            let into_others: u64 = runs.iter().map(|r| (r.last - r.first) as u64).sum();
            skipped += dropped;
            merged += into_others;
            keys += slice.len() as u64 - dropped - into_others;
            // The walk ends at `end`, or when a slice stopped short of it.
            let Some(last) = last else {
                break;
            };
            from = Bound::Excluded(last);
        }
        let dropping = !pending.is_empty();
        if dropping {
            // A drop reads what its window still holds: from sled, synced first.
            sync_windows(&self.inner.windows, &self.unsynced)?;
            self.unsynced.clear();
        }
        let mut leftovers = 0;
        for (start, lsn) in pending {
            let (taken, held) = take_drop(&self.inner.sled, &self.inner.windows, start, lsn)?;
            self.closing.extend(taken);
            leftovers += held;
        }
        // A run that stayed has every value after `applied` (see `event_runs`).
        let mark = kept.map_or(mark, |lsn| {
            mark.min(lsn.saturating_sub(1)).max(self.applied)
        });
        self.applied = mark;
        self.mark_if_due(dropping)?;
        if let Ok(mut s) = self.inner.stats.lock() {
            s.dropped_deletes += skipped;
            s.merged_event_values += merged;
            s.window_leftovers += leftovers;
            s.applies += 1;
            s.applied_keys += keys;
            s.apply_micros += started.elapsed().as_micros() as u64;
        }
        Ok(())
    }

    /// Record the applied mark in the main database when it is `forced` (a round
    /// that took a window drop) or [`LoggedOptions::mark_interval`] has passed since
    /// the last one.
    fn mark_if_due(&mut self, forced: bool) -> Result<(), StoreError> {
        if forced || self.marked_at.elapsed() >= self.mark_interval {
            self.write_mark()?;
        }
        Ok(())
    }

    /// Flush and `fdatasync` the windows written since their last sync, then record
    /// the applied mark in the main database, so that a mark never claims what a
    /// window may not have on disk. Between marks, rounds write to sled without
    /// syncing anything: a start after a crash replays the log from the last mark
    /// that reached the disk, and its records are absolute values, so writing again
    /// what sled already held leaves the same state.
    fn write_mark(&mut self) -> Result<(), StoreError> {
        self.marked_at = Instant::now();
        if self.marked == self.applied {
            return Ok(());
        }
        sync_windows(&self.inner.windows, &self.unsynced)?;
        self.unsynced.clear();
        apply_to_sled(&self.inner.sled, std::iter::empty(), Some(self.applied))?;
        self.marked = self.applied;
        Ok(())
    }

    /// Once a log segment is wholly applied: make sled durable, then delete it.
    fn trim(&mut self, force_flush: bool) -> Result<(), StoreError> {
        if !self.closing.is_empty() {
            // The drops are in the main database (this round wrote them): make them
            // durable, then delete the windows' directories.
            let sled = &self.inner.sled;
            sled.with(|h| sled.sync_files(h))?;
            self.synced = self.marked;
            // A deletion that fails is tried again after the next round.
            let mut failed = None;
            for (start, w) in std::mem::take(&mut self.closing) {
                if let Err(e) = self.inner.windows.delete(start, w.clone()) {
                    self.closing.push((start, w));
                    failed.get_or_insert(e);
                }
            }
            if let Some(e) = failed {
                return Err(e);
            }
        }
        self.inner.windows.warm_written(&mut self.upkeep);
        self.inner
            .windows
            .snapshot_idle(&mut self.upkeep, self.idle_reopen);
        if let Some(after) = self.window_close_after {
            self.inner.windows.park_unused(&self.upkeep, after);
        }
        if !force_flush && !self.inner.log.wants_trim() {
            return Ok(());
        }
        self.write_mark()?;
        let sled = &self.inner.sled;
        sled.with(|h| sled.sync_files(h))?;
        self.synced = self.marked;
        let n = self.inner.log.trim(self.marked)?;
        if let Ok(mut s) = self.inner.stats.lock() {
            s.log_trims += n as u64;
        }
        Ok(())
    }

    /// The commit log's upkeep ([`CommitLog::upkeep`]); after a failure (a full
    /// disk), not again for `heal_interval`.
    fn log_upkeep(&mut self) {
        if self
            .upkeep_failed
            .is_some_and(|t| t.elapsed() < self.heal_interval)
        {
            return;
        }
        match self.inner.log.upkeep() {
            Ok(()) => self.upkeep_failed = None,
            Err(e) => {
                if self.upkeep_failed.is_none() {
                    tracing::warn!(
                        "the commit log's upkeep failed (tried again after heal_interval): {e}"
                    );
                }
                self.upkeep_failed = Some(Instant::now());
            }
        }
    }

    /// One round: apply (taking live records once `delay` old), then trim.
    fn round(&mut self, force_flush: bool, delay: Duration) -> Result<(), StoreError> {
        let r = self.apply(delay).and_then(|()| self.trim(force_flush));
        let mut err = self
            .inner
            .apply_error
            .lock()
            .map_err(|_| lock_err("applier error"))?;
        match &r {
            Ok(()) => {
                if err.take().is_some() {
                    tracing::info!("writing to sled works again");
                }
                self.checkpoints
                    .after_group(&self.inner.sled, &self.inner.stats);
                self.checkpoints
                    .when_idle(&self.inner.sled, &self.inner.stats, self.idle_reopen);
                self.log_upkeep();
            }
            Err(e) => {
                let since = match err.as_ref() {
                    Some((_, since)) => *since,
                    None => {
                        tracing::error!("failed to write the commit log's records to sled (the log keeps them; tried again): {e}");
                        Instant::now()
                    }
                };
                *err = Some((e.to_string(), since));
                drop(err);
                if self
                    .last_repair
                    .is_none_or(|t| t.elapsed() >= self.heal_interval)
                {
                    self.last_repair = Some(Instant::now());
                    match self.repair() {
                        Ok(Some(n)) => tracing::info!(
                            "opened sled again after a failed write and wrote {n} records of the commit log to it again"
                        ),
                        Ok(None) => {
                            // The disk itself refuses writes: a restart would not
                            // help, so `/healthz` is not failed for it.
                            if let Ok(mut err) = self.inner.apply_error.lock() {
                                if let Some((_, since)) = err.as_mut() {
                                    *since = Instant::now();
                                }
                            }
                        }
                        Err(e) => tracing::warn!("sled could not be opened again yet: {e}"),
                    }
                }
            }
        }
        r
    }

    /// After a failed write sled refuses every later one until it is opened again,
    /// and what its handle held only in memory is gone with it (the same for the
    /// windows, written in the same rounds). So first the commit log's records past
    /// what sled surely has (the mark at its last sync: the log is trimmed only past
    /// that) go back into the overlay, where they were not written again since:
    /// reads find them there while sled is opened again, and the next round writes
    /// them to sled again. Then sled and every window are opened again. Returns the
    /// records read back (None: the disk still refuses a write, and sled was left as
    /// it is).
    fn repair(&mut self) -> Result<Option<usize>, StoreError> {
        let sled = &self.inner.sled;
        // Closing sled while the disk still fails would leave reads without a store
        // until it works again: first see that a write and a sync work.
        if let Err(e) = probe_disk(sled.dir()) {
            tracing::debug!("sled not opened again: {e}");
            return Ok(None);
        }
        let upto = self
            .inner
            .overlay
            .read()
            .map_err(|_| lock_err("overlay"))?
            .committed;
        let records = self.inner.log.read_range(self.synced, upto)?;
        let map = coalesce(&records)?;
        {
            let mut o = self
                .inner
                .overlay
                .write()
                .map_err(|_| lock_err("overlay"))?;
            for (k, (lsn, value)) in map {
                // A key in the overlay already holds its newest value.
                if let std::collections::btree_map::Entry::Vacant(e) =
                    o.map.entry(OKey::from_vec(k))
                {
                    let w = weight(e.key(), &value);
                    e.insert(Pending {
                        lsn,
                        value,
                        // sled may hold it: its delete is written, and it is in no run.
                        fresh: false,
                        pristine: false,
                    });
                    o.bytes += w;
                }
            }
        }
        sled.reopen_after_failure()?;
        for (_, w) in self.inner.windows.all_open() {
            w.reopen_after_failure()?;
        }
        // The next round writes the overlay, and the mark after it.
        self.applied = self.synced.min(applied_mark(sled)?);
        self.marked = self.applied;
        self.unsynced.clear();
        Ok(Some(records.len()))
    }
}

fn applier_loop(inner: &Inner, ctl: mpsc::Receiver<Ctl>, opts: &LoggedOptions, applied: u64) {
    let mut a = Applier {
        inner,
        checkpoints: Checkpoints::new(&opts.sled),
        applied,
        marked: applied,
        marked_at: Instant::now(),
        unsynced: Vec::new(),
        mark_interval: opts.mark_interval,
        synced: applied,
        last_repair: None,
        heal_interval: opts.heal_interval,
        closing: Vec::new(),
        upkeep: Upkeep::default(),
        idle_reopen: opts.idle_reopen,
        window_close_after: opts.window_close_after,
        upkeep_failed: None,
    };
    loop {
        // Behind (a quarter of the overlay's room used): no pause between rounds,
        // and no write waits for its delay.
        let behind = inner.behind();
        let (pause, delay) = if behind {
            (Duration::ZERO, Duration::ZERO)
        } else {
            (opts.apply_interval, opts.apply_delay)
        };
        match ctl.recv_timeout(pause) {
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Err(e) = a.round(false, delay) {
                    tracing::debug!("apply round failed: {e}");
                }
            }
            Ok(Ctl::Nudge) => {
                if let Err(e) = a.round(false, Duration::ZERO) {
                    tracing::debug!("apply round failed: {e}");
                }
            }
            Ok(Ctl::Flush(reply)) => {
                let r = a.round(true, Duration::ZERO);
                if reply.send(r).is_err() {
                    tracing::debug!("flush requester went away");
                }
            }
            #[cfg(test)]
            Ok(Ctl::Exit) => break,
            #[cfg(test)]
            Ok(Ctl::Round(delay, done)) => {
                if let Err(e) = a.round(false, delay) {
                    tracing::debug!("apply round failed: {e}");
                }
                if done.send(()).is_err() {
                    tracing::debug!("round requester went away");
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
}

/// Whether the overlay holds a committed drop of the window starting at `start`.
fn drop_pending(o: &Overlay, start: u64) -> bool {
    o.map
        .get(crate::keys::dropped_key(start).as_slice())
        .is_some_and(|p| p.value.is_some())
}

/// Merge a snapshot of the overlay's range (in scan order) with sled's range.
fn merge(
    overlay: Vec<(Vec<u8>, Value)>,
    sled: impl Iterator<Item = Result<(sled::IVec, sled::IVec), StoreError>>,
    reverse: bool,
    limit: usize,
) -> Result<Vec<Entry>, StoreError> {
    let mut out = Vec::new();
    let mut o = overlay.into_iter().peekable();
    let mut s = sled.peekable();
    while out.len() < limit {
        let sled_key = match s.peek() {
            Some(Ok((k, _))) => Some(k.clone()),
            Some(Err(_)) => match s.next() {
                Some(Err(e)) => return Err(e),
                _ => None,
            },
            None => None,
        };
        let take_overlay = match (o.peek(), &sled_key) {
            (None, None) => break,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (Some((ok, _)), Some(sk)) => {
                let ord = ok.as_slice().cmp(sk.as_ref());
                if ord == std::cmp::Ordering::Equal {
                    s.next();
                    true
                } else {
                    (ord == std::cmp::Ordering::Less) != reverse
                }
            }
        };
        if take_overlay {
            if let Some((k, Some(v))) = o.next() {
                out.push((k, v.to_vec()));
            }
        } else if let Some(Ok((k, v))) = s.next() {
            out.push((k.to_vec(), unpack(&v)?));
        }
    }
    Ok(out)
}

/// What the overlay holds of a range, in scan order.
type Pendings = Vec<(Vec<u8>, Value)>;

/// How many times a read is made again because a window it read was dropped
/// meanwhile (see [`LoggedKv::read_sources`]).
const DROPPED_RETRIES: usize = 4;

impl LoggedKv {
    /// Where a read of `[start, end)` looks: a snapshot of the overlay's range (in scan
    /// order) and the windows that can hold its keys (those of a session from
    /// `from_ms` on), taken under the overlay's lock so that the applier cannot move
    /// a key between them meanwhile.
    fn session_sources(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        from_ms: Option<u64>,
    ) -> Result<(Pendings, Vec<Arc<Shared>>), StoreError> {
        let o = self
            .inner
            .overlay
            .read()
            .map_err(|_| StoreError::Read("overlay lock poisoned".into()))?;
        let range = o
            .map
            .range::<[u8], _>((Bound::Included(start), Bound::Excluded(end)));
        let entry = |(k, p): (&OKey, &Pending)| (k.to_vec(), p.value.clone());
        let pending = if reverse {
            range.rev().map(entry).collect()
        } else {
            range.map(entry).collect()
        };
        Ok((pending, self.inner.windows.readers_in(start, end, from_ms)))
    }

    /// Read `[start, end)` with `read` from its sources ([`LoggedKv::session_sources`]).
    /// A window among them may be dropped while it is read: retention's drop moves
    /// what the window still holds to the main database, then closes it, and a read
    /// of a closed window fails. The read is then made again from the sources as they
    /// are now, which no longer name it; a window is dropped once, so this ends.
    fn read_sources<T>(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        from_ms: Option<u64>,
        read: impl Fn(Pendings, &[Arc<Shared>]) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut tries = 0;
        loop {
            let (pending, wins) = self.session_sources(start, end, reverse, from_ms)?;
            #[cfg(test)]
            if let Some(hook) = self.after_sources.lock().ok().and_then(|mut h| h.take()) {
                hook();
            }
            match read(pending, &wins) {
                Err(e) if tries < DROPPED_RETRIES && wins.iter().any(|w| w.is_closed()) => {
                    tracing::debug!("a window was dropped while it was read; reading again: {e}");
                    tries += 1;
                }
                r => return r,
            }
        }
    }

    /// Run one round of the applier now, with `delay` (tests only).
    #[cfg(test)]
    pub(crate) fn round_with(&self, delay: Duration) {
        let (done, wait) = mpsc::channel();
        let sent = self
            .ctl
            .lock()
            .ok()
            .and_then(|c| c.as_ref().map(|c| c.send(Ctl::Round(delay, done)).is_ok()));
        assert_eq!(sent, Some(true), "applier running");
        wait.recv().expect("round done");
    }

    /// The sled database of the open window starting at `start` (tests only).
    #[cfg(test)]
    pub(crate) fn inner_window(&self, start: u64) -> Option<Arc<Shared>> {
        self.inner.windows.get(start)
    }

    /// Every key of the main database's sled (tests only).
    #[cfg(test)]
    pub(crate) fn main_keys(&self) -> Vec<Vec<u8>> {
        self.inner
            .sled
            .with(|h| {
                h.db.iter()
                    .keys()
                    .map(|k| {
                        k.map(|k| k.to_vec())
                            .map_err(|e| StoreError::Read(e.to_string()))
                    })
                    .collect()
            })
            .expect("main database")
    }

    /// Have the next read run `hook` right after it took its sources.
    #[cfg(test)]
    pub(crate) fn after_sources(&self, hook: impl FnOnce() + Send + 'static) {
        if let Ok(mut h) = self.after_sources.lock() {
            *h = Some(Box::new(hook));
        }
    }
}

impl Kv for LoggedKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let window = {
            let o = self
                .inner
                .overlay
                .read()
                .map_err(|_| StoreError::Read("overlay lock poisoned".into()))?;
            if let Some(p) = o.map.get(key) {
                return Ok(p.value.as_ref().map(|v| v.to_vec()));
            }
            if crate::keys::routed_ms(key).is_some() {
                self.inner.windows.reader(key)
            } else {
                None
            }
        };
        let read = |sled: &Shared| {
            sled.with(
                |h| match h.db.get(key).map_err(|e| StoreError::Read(e.to_string()))? {
                    Some(v) => unpack(&sled.stored(&v)?).map(Some),
                    None => Ok(None),
                },
            )
        };
        match window {
            Some(w) => match read(&w) {
                Ok(v) => Ok(v),
                // Closed by a drop meanwhile: the key is read where it goes now.
                Err(_) if !matches!(self.inner.windows.route(key), Route::Window(_)) => {
                    read(&self.inner.sled)
                }
                Err(e) => Err(e),
            },
            None => read(&self.inner.sled),
        }
    }

    /// A scan reads every window that can hold keys of the range.
    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        self.scan_session(start, end, reverse, limit, Some(0))
    }

    fn scan_session(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
        from_ms: Option<u64>,
    ) -> Result<Vec<Entry>, StoreError> {
        if start >= end {
            return Ok(Vec::new());
        }
        self.read_sources(start, end, reverse, from_ms, |pending, wins| {
            let read = |r: sled::Result<(sled::IVec, sled::IVec)>| {
                r.map_err(|e| StoreError::Read(e.to_string()))
            };
            if !wins.is_empty() {
                // Keys in windows: the sources merged, each read only as far as needed.
                // A source's first read is `limit` entries more than the overlay can
                // hide (deletes), at most a chunk.
                let first = limit.saturating_add(pending.len());
                let sources = std::iter::once(&*self.inner.sled).chain(wins.iter().map(|w| &**w));
                let merged = crate::sled::merged::Merged::new(sources, start, end, reverse, first);
                return merge(pending, merged, reverse, limit);
            }
            self.inner.sled.with(|h| {
                let range = h.db.range(start.to_vec()..end.to_vec());
                if reverse {
                    merge(pending, range.rev().map(read), true, limit)
                } else {
                    merge(pending, range.map(read), false, limit)
                }
            })
        })
    }

    fn scan_one(
        &self,
        start: &[u8],
        end: &[u8],
        from_ms: Option<u64>,
    ) -> Result<Option<Entry>, StoreError> {
        if start >= end {
            return Ok(None);
        }
        self.read_sources(start, end, false, from_ms, |pending, wins| {
            // The overlay holds the newest value of what it holds.
            if let Some((k, Some(v))) = pending.iter().find(|(_, v)| v.is_some()) {
                return Ok(Some((k.clone(), v.to_vec())));
            }
            let deleted = |k: &[u8]| pending.iter().any(|(p, _)| p.as_slice() == k);
            // Newest window first: a session's recent turns are there; the main
            // database (keys of no route, or moved out of a dropped window) last.
            let sources = wins
                .iter()
                .rev()
                .map(|w| &**w)
                .chain(std::iter::once(&*self.inner.sled));
            for src in sources {
                let hit = src.with(|h| {
                    for r in h.db.range(start.to_vec()..end.to_vec()) {
                        let (k, v) = r.map_err(|e| StoreError::Read(e.to_string()))?;
                        if !deleted(&k) {
                            return Ok(Some((k.to_vec(), unpack(&src.stored(&v)?)?)));
                        }
                    }
                    Ok(None)
                })?;
                if hit.is_some() {
                    return Ok(hit);
                }
            }
            Ok(None)
        })
    }

    fn scan_window(
        &self,
        window_start: u64,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        if start >= end {
            return Ok(Vec::new());
        }
        // The overlay's keys routed to the window, and the window's sled, taken under
        // the overlay's lock (as `session_sources`).
        let (pending, win) = {
            let o = self
                .inner
                .overlay
                .read()
                .map_err(|_| StoreError::Read("overlay lock poisoned".into()))?;
            let wins = &self.inner.windows;
            let pending: Pendings = o
                .map
                .range::<[u8], _>((Bound::Included(start), Bound::Excluded(end)))
                .filter(|(k, _)| wins.route(k) == Route::Window(window_start))
                .map(|(k, p)| (k.to_vec(), p.value.clone()))
                .collect();
            (pending, wins.get(window_start))
        };
        let Some(win) = win else {
            return merge(pending, std::iter::empty(), false, limit);
        };
        win.with(|h| {
            let range = h.db.range(start.to_vec()..end.to_vec()).map(|r| {
                let (k, v) = r.map_err(|e| StoreError::Read(e.to_string()))?;
                Ok((k, win.resolved(v)?))
            });
            merge(pending, range, false, limit)
        })
    }

    fn commit(&self, batch: Batch) -> CommitTicket {
        let (reply, rx) = CommitTicket::new();
        let job = LogJob::new(batch, reply);
        let sent = match self.tx.lock() {
            Ok(tx) => match tx.as_ref() {
                Some(tx) => tx.send(job).map_err(|e| e.0.reply),
                None => Err(job.reply),
            },
            Err(_) => Err(job.reply),
        };
        if let Err(reply) = sent {
            if reply.send(Err(StoreError::Closed)).is_err() {
                tracing::debug!("committer went away before it learned the store is closed");
            }
        }
        rx
    }

    /// Committed batches are durable in the log already; this also writes them to
    /// sled and flushes it, so that the next start has no log to read.
    fn sync(&self) -> Result<(), StoreError> {
        self.flush_now()
    }

    fn busy(&self) -> bool {
        self.inner.behind()
    }

    fn commit_stats(&self) -> CommitStats {
        let mut s = self
            .inner
            .stats
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default();
        if let Ok(o) = self.inner.overlay.read() {
            s.overlay_keys = o.map.len() as u64;
            s.overlay_bytes = o.bytes as u64;
        }
        self.inner.log.report(&mut s);
        let (parked, reopens) = self.inner.windows.counts();
        s.windows_closed = parked;
        s.window_reopens = reopens;
        s
    }

    fn windows(&self) -> Result<Vec<crate::WindowInfo>, StoreError> {
        let mut list = self.inner.windows.list();
        let o = self
            .inner
            .overlay
            .read()
            .map_err(|_| StoreError::Read("overlay lock poisoned".into()))?;
        for w in &mut list {
            // Committed, not yet taken by the applier: its directory is still there.
            if drop_pending(&o, w.start_ms) && !w.dropped {
                w.dropped = true;
                w.bytes = 0;
            }
        }
        Ok(list)
    }

    fn hold_event_merges(&self, session_id: &str) {
        if let Ok(mut h) = self.inner.held.lock() {
            *h.entry(session_id.to_string()).or_insert(0) += 1;
        }
    }

    fn release_event_merges(&self, session_id: &str) {
        if let Ok(mut h) = self.inner.held.lock() {
            if let Some(n) = h.get_mut(session_id) {
                *n -= 1;
                if *n == 0 {
                    h.remove(session_id);
                }
            }
        }
    }

    fn health(&self) -> Result<(), String> {
        let dead = |h: &Mutex<Option<std::thread::JoinHandle<()>>>, what: &str| match h.lock() {
            Ok(g) => match g.as_ref() {
                Some(t) if t.is_finished() => Err(format!("the store's {what} thread has ended")),
                _ => Ok(()),
            },
            Err(_) => Err(format!("the store's {what} thread lock is poisoned")),
        };
        dead(&self.committer, "log writer")?;
        dead(&self.applier, "applier")?;
        // sled refuses every operation after some write errors until it is opened
        // again: an applier that keeps failing needs a restart, which replays the log.
        match self.inner.apply_error.lock() {
            Ok(g) => match g.as_ref() {
                Some((e, since)) if since.elapsed() >= self.inner.apply_patience => Err(format!(
                    "writing to sled has failed for {} s (the commit log keeps every change; a restart writes it to sled): {e}",
                    since.elapsed().as_secs()
                )),
                _ => Ok(()),
            },
            Err(_) => Err("the store's applier error lock is poisoned".into()),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::keys;

    /// Queue `n` jobs (their answers are dropped).
    fn send_jobs(tx: &mpsc::Sender<LogJob>, n: usize) {
        for i in 0..n {
            let mut b = Batch::new();
            b.put_raw(format!("k{i}").into_bytes(), b"v".to_vec());
            let (reply, _) = CommitTicket::new();
            tx.send(LogJob::new(b, reply)).expect("queue");
        }
    }

    /// `n` jobs queued on a fresh channel.
    fn queued(n: usize) -> (mpsc::Sender<LogJob>, mpsc::Receiver<LogJob>) {
        let (tx, rx) = mpsc::channel();
        send_jobs(&tx, n);
        (tx, rx)
    }

    #[test]
    fn a_group_waits_for_more_only_after_a_large_one() {
        let sync = Duration::from_millis(10);
        // After a small group nothing more is taken, however much is queued.
        let (_tx, rx) = queued(6);
        let mut jobs = vec![rx.recv().expect("first")];
        assert!(!gather(
            &rx,
            &mut jobs,
            GATHER_FROM - 1,
            sync,
            &mut Gather::new()
        ));
        assert_eq!(jobs.len(), 1);
        // After a large one, the group sleeps first and then takes everything
        // queued.
        let (_tx, rx) = queued(3);
        let mut jobs = vec![rx.recv().expect("first")];
        let t = Instant::now();
        assert!(gather(&rx, &mut jobs, 8, sync, &mut Gather::new()));
        assert_eq!(jobs.len(), 3);
        assert!(t.elapsed() >= GATHER_MAX, "waited {:?}", t.elapsed());
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "waited {:?}",
            t.elapsed()
        );
    }

    /// A group waits twice as long while the process keeps the cores busy, and the
    /// share is CPU time over wall time over cores.
    #[test]
    fn a_group_waits_longer_while_the_cores_are_busy() {
        let ms = Duration::from_millis;
        let mut g = Gather::new();
        assert_eq!(
            g.sleep_for(ms(0) + Duration::from_micros(200)),
            Duration::from_micros(200)
        );
        g.busy = true;
        assert_eq!(
            g.sleep_for(Duration::from_micros(200)),
            Duration::from_micros(400)
        );
        assert_eq!(g.sleep_for(ms(3)), GATHER_MAX);
        assert!((busy_share(ms(100), ms(180), 2.0) - 0.9).abs() < 1e-9);
        assert!(busy_share(ms(100), ms(180), 2.0) >= GATHER_BUSY_SHARE);
        assert!(busy_share(ms(100), ms(120), 2.0) < GATHER_BUSY_SHARE);
        assert_eq!(busy_share(Duration::ZERO, ms(1), 2.0), 0.0);
        // The first sample only notes where the process is; a second one, at least
        // CPU_SAMPLE later, judges the time between (this test's thread idles).
        let mut g = Gather::new();
        let t0 = Instant::now();
        g.sample_cpu(t0);
        assert!(g.sampled.is_some() && !g.busy);
        std::thread::sleep(CPU_SAMPLE);
        g.sample_cpu(Instant::now());
        assert!(!g.busy, "an idle process does not keep the cores busy");
    }

    /// Sleeps that bring nothing (every committer already in the group) stop, but
    /// for one in `GATHER_PROBE_EVERY` large groups; one that brings batches again
    /// makes the next group sleep too.
    #[test]
    fn a_group_stops_sleeping_when_sleeps_bring_nothing() {
        let sync = Duration::from_micros(50);
        let mut g = Gather::new();
        let (tx, rx) = queued(0);
        let mut slept = Vec::new();
        for _ in 0..GATHER_PROBE_EVERY * 2 + 1 {
            let mut jobs = Vec::new();
            slept.push(gather(&rx, &mut jobs, 8, sync, &mut g));
            assert!(jobs.is_empty());
        }
        let probe = GATHER_PROBE_EVERY as usize;
        let sleeps: Vec<usize> = (0..slept.len()).filter(|i| slept[*i]).collect();
        assert_eq!(sleeps, vec![0, probe, probe * 2], "{slept:?}");
        // A probe that doubles its group: the next large group sleeps again.
        for _ in 0..probe - 1 {
            assert!(!gather(&rx, &mut Vec::new(), 8, sync, &mut g));
        }
        send_jobs(&tx, 2);
        let mut jobs = vec![rx.recv().expect("first"), rx.recv().expect("second")];
        send_jobs(&tx, 4);
        assert!(gather(&rx, &mut jobs, 8, sync, &mut g), "the probe");
        assert_eq!(jobs.len(), 6);
        assert!(
            gather(&rx, &mut Vec::new(), 8, sync, &mut g),
            "after a paying probe"
        );
    }

    fn opts() -> LoggedOptions {
        LoggedOptions {
            segment_bytes: 4096,
            apply_interval: Duration::from_millis(5),
            apply_delay: Duration::ZERO,
            ..LoggedOptions::default()
        }
    }

    /// Options whose applier runs only when asked (`sync`) or nudged.
    fn slow() -> LoggedOptions {
        LoggedOptions {
            apply_interval: Duration::from_secs(3600),
            ..opts()
        }
    }

    fn put(k: &[u8], v: &str) -> Batch {
        let mut b = Batch::new();
        b.put_raw(k.to_vec(), v.as_bytes().to_vec());
        b
    }

    async fn commit(kv: &LoggedKv, b: Batch) {
        kv.commit(b).await.expect("answered").expect("committed");
    }

    /// A round whose overlay ends exactly at a slice boundary (a multiple of
    /// `APPLY_KEYS` keys) ends there: the walk once went on with a range starting past
    /// its end, which panicked and ended the applier thread.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_round_ending_at_a_slice_boundary_applies_everything() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (kv, _) = LoggedKv::open(dir.path(), slow()).expect("open");
        for slices in [1u64, 2] {
            let mut b = Batch::new();
            for i in 0..APPLY_KEYS as u64 * slices {
                b.put_raw(keys::event(&format!("s{slices}"), i), b"v".to_vec());
            }
            commit(&kv, b).await;
            assert_eq!(kv.overlay_len(), APPLY_KEYS * slices as usize);
            kv.sync().expect("the round applies every slice");
            assert_eq!(kv.overlay_len(), 0);
            kv.health().expect("the applier thread is alive");
        }
    }

    /// The store is busy while more than the eager share of the overlay's room waits
    /// for sled (a quarter: retention holds back long before commits would wait),
    /// and not once the applier took it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_store_is_busy_while_a_quarter_of_the_overlay_waits_for_sled() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (kv, _) = LoggedKv::open(dir.path(), slow()).expect("open");
        assert!(!kv.busy());
        let mut b = Batch::new();
        for i in 0..EAGER_OVERLAY_KEYS as u64 {
            b.put_raw(keys::event("s", i), b"v".to_vec());
        }
        commit(&kv, b).await;
        assert!(!kv.busy(), "a quarter of the room is not yet behind");
        commit(&kv, put(&keys::event("t", 0), "v")).await;
        assert!(kv.busy(), "more than a quarter of the room waits for sled");
        kv.sync().expect("apply");
        assert!(!kv.busy());
    }

    /// Once writes pause for `idle_reopen`, sled is checkpointed (closed and opened
    /// again: its snapshot written, its cache given back) once, not again while
    /// nothing is written, and once more after the next writes pause; what was
    /// written reads the same throughout.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pause_in_writes_reopens_sled_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let idle = Duration::from_millis(100);
        let (kv, _) = LoggedKv::open(
            dir.path(),
            LoggedOptions {
                idle_reopen: idle,
                ..opts()
            },
        )
        .expect("open");
        let kv = &kv;
        let checkpoints = || kv.commit_stats().checkpoints;
        let until = |n: u64| async move {
            let t = Instant::now();
            while kv.commit_stats().checkpoints < n {
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "no checkpoint {n} after the writes paused"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::sleep(idle * 3).await;
        assert_eq!(checkpoints(), 0, "nothing written: nothing to reopen");
        for i in 0..50u64 {
            commit(kv, put(&keys::event("s", i), &format!("v{i}"))).await;
        }
        until(1).await;
        tokio::time::sleep(idle * 10).await;
        assert_eq!(checkpoints(), 1, "reopened again with nothing written");
        let v7 = kv.get(&keys::event("s", 7)).expect("get");
        assert_eq!(v7.as_deref(), Some(&b"v7"[..]));
        commit(kv, put(&keys::event("s", 50), "v50")).await;
        until(2).await;
        let v50 = kv.get(&keys::event("s", 50)).expect("get");
        assert_eq!(v50.as_deref(), Some(&b"v50"[..]));
        kv.health().expect("healthy");
    }

    #[test]
    fn values_are_stored_compressed_when_that_saves_space() {
        let record = br#"{"turn_id":"t_0192","session_id":"s","status":"completed","function_id":"f","settings":{"timeout_ms":30000,"delivery":"at_least_once","max_attempts":3,"concurrency":8},"created_at_ms":1,"updated_at_ms":2,"phase":"done"}"#;
        let packed = pack(record);
        assert!(packed.starts_with(&PACKED) && packed.len() < record.len());
        assert_eq!(unpack(&packed).expect("unpack"), record.to_vec());
        for plain in [&b"t_0192"[..], &b"{}"[..], &[7u8; 200][..0]] {
            assert_eq!(&*pack(plain), plain, "short values stay as they are");
            assert_eq!(unpack(plain).expect("unpack"), plain.to_vec());
        }
        assert!(unpack(&[0, b'4', 9, 9]).is_err());
    }

    #[test]
    fn records_encode_and_decode() {
        let mut b = put(b"k1", "v1");
        b.delete(b"gone".to_vec());
        b.put_raw(Vec::new(), Vec::new());
        let ops = decode(&encode(&b)).expect("decode");
        assert_eq!(format!("{ops:?}"), format!("{:?}", b.ops));
        assert!(decode(&encode(&b)[..7]).is_err());
    }

    /// A record of repetitive JSON past [`LOG_PACK_FROM`] is written compressed and
    /// reads back the same; one that does not shrink, or a short one, as it is; a
    /// compressed record cut short or claiming a huge size is corrupt. Records
    /// written before compression (plain) still read.
    #[test]
    fn long_records_are_compressed_and_read_back() {
        let json = r#"{"turn_id":"t_0001","session_id":"s","status":"completed"}"#.repeat(20);
        let b = put(b"T1", &json);
        let rec = encode(&b);
        assert!(rec.starts_with(&LOG_PACKED), "compressed");
        assert!(
            rec.len() * 3 < json.len(),
            "{} of {}",
            rec.len(),
            json.len()
        );
        assert_eq!(
            format!("{:?}", decode(&rec).expect("decode")),
            format!("{:?}", b.ops)
        );
        assert_eq!(
            format!("{:?}", decode(&encode_plain(&b)).expect("plain")),
            format!("{:?}", b.ops)
        );
        let short = put(b"k", "v");
        assert_eq!(encode(&short), encode_plain(&short));
        let noise: String = (0..2000u32)
            .map(|i| char::from(b'!' + (i.wrapping_mul(2_654_435_761).rotate_left(13) % 90) as u8))
            .collect();
        let random = put(b"k", &noise);
        let r = encode(&random);
        assert!(r.starts_with(&LOG_PACKED) == (r.len() < encode_plain(&random).len()));
        assert!(decode(&rec[..rec.len() - 3]).is_err());
        let mut huge = LOG_PACKED.to_vec();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        huge.extend_from_slice(&[0; 8]);
        assert!(matches!(decode(&huge), Err(StoreError::Corrupt(_))));
    }

    /// Reads see every acknowledged write whether it is still in the overlay or
    /// already in sled, scans merge both (deletes hide sled's value), and sled gets
    /// each key once per round however often it was written.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_see_the_overlay_and_sled_merged() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (kv, _) = LoggedKv::open(dir.path(), slow()).expect("open");
        for i in 0..10u64 {
            commit(&kv, put(&keys::event("s", i), &format!("a{i}"))).await;
        }
        kv.sync().expect("apply");
        assert_eq!(kv.overlay_len(), 0);
        // Now in the overlay only: a new value for 3, 5 deleted, 10 new.
        commit(&kv, put(&keys::event("s", 3), "b3")).await;
        let mut b = Batch::new();
        b.delete(keys::event("s", 5));
        commit(&kv, b).await;
        commit(&kv, put(&keys::event("s", 10), "b10")).await;
        assert_eq!(kv.overlay_len(), 3);
        let read = |reverse, limit| -> Vec<String> {
            kv.scan(&keys::event("s", 0), &keys::event_end("s"), reverse, limit)
                .expect("scan")
                .into_iter()
                .map(|(_, v)| String::from_utf8(v).expect("utf8"))
                .collect()
        };
        let want = ["a0", "a1", "a2", "b3", "a4", "a6", "a7", "a8", "a9", "b10"];
        assert_eq!(read(false, usize::MAX), want);
        assert_eq!(read(false, 5), want[..5]);
        let mut rev: Vec<&str> = want.to_vec();
        rev.reverse();
        assert_eq!(read(true, usize::MAX), rev);
        assert_eq!(read(true, 2), rev[..2]);
        assert_eq!(kv.get(&keys::event("s", 5)).expect("get"), None);
        assert_eq!(
            kv.get(&keys::event("s", 3)).expect("get"),
            Some(b"b3".to_vec())
        );
        kv.sync().expect("apply");
        assert_eq!(kv.overlay_len(), 0);
        assert_eq!(read(false, usize::MAX), want);
        assert_eq!(kv.get(APPLIED_KEY).expect("get").map(|v| v.len()), Some(8));
    }

    /// What was acknowledged but never reached sled (the process died between) is
    /// read from the log at the next open; a clean close leaves no log to read.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_start_replays_what_sled_did_not_get() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let (kv, _) = LoggedKv::open(dir.path(), slow()).expect("open");
            for i in 0..300u64 {
                commit(&kv, put(&keys::event("s", i), &format!("v{i}"))).await;
            }
            let mut b = Batch::new();
            b.delete(keys::event("s", 7));
            commit(&kv, b).await;
            // As if the process died: the threads are left, nothing is applied.
            std::mem::forget(kv);
        }
        let sled_dir = dir.path().to_path_buf();
        // The forgotten handle still holds sled's lock: copy the files instead.
        let copy = tempfile::tempdir().expect("tempdir");
        copy_dir(&sled_dir, copy.path());
        let (kv, replayed) = LoggedKv::open(copy.path(), opts()).expect("reopen");
        assert_eq!(replayed.records, 301);
        let all = kv
            .scan(
                &keys::event("s", 0),
                &keys::event_end("s"),
                false,
                usize::MAX,
            )
            .expect("scan");
        assert_eq!(all.len(), 299);
        assert_eq!(
            kv.get(&keys::event("s", 299)).expect("get"),
            Some(b"v299".to_vec())
        );
        commit(&kv, put(b"Mx", "after")).await;
        kv.close().expect("close");
        drop(kv);
        // A thread of sled's may hold its file lock a moment after the close.
        let (kv, replayed) =
            crate::sled::open_when_unlocked(|| LoggedKv::open(copy.path(), opts()))
                .expect("reopen");
        assert_eq!(
            replayed.records, 0,
            "a clean close leaves nothing to replay"
        );
        assert_eq!(kv.get(b"Mx").expect("get"), Some(b"after".to_vec()));
        assert_eq!(kv.get(&keys::event("s", 7)).expect("get"), None);
    }

    /// A copy of a directory as a crash would leave it (the files as they are).
    pub(crate) fn copy_dir(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).expect("mkdir");
        for e in std::fs::read_dir(from).expect("list") {
            let e = e.expect("entry");
            let target = to.join(e.file_name());
            if e.file_type().expect("type").is_dir() {
                copy_dir(&e.path(), &target);
            } else {
                std::fs::copy(e.path(), &target).expect("copy");
            }
        }
    }

    /// Commits faster than the applier's interval do not pile up in memory: past
    /// MAX_OVERLAY_KEYS the committer makes the applier run at once and waits for it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_overlay_makes_commits_wait_for_the_applier() {
        let dir = tempfile::tempdir().expect("tempdir");
        let slow = LoggedOptions {
            segment_bytes: 64 << 20,
            ..slow()
        };
        let (kv, _) = LoggedKv::open(dir.path(), slow).expect("open");
        let per_batch = 100u64;
        let batches = (MAX_OVERLAY_KEYS as u64 * 3 / 2) / per_batch;
        let mut most = 0;
        for i in 0..batches {
            let mut b = Batch::new();
            for j in 0..per_batch {
                b.put_raw(keys::event("s", i * per_batch + j), b"v".to_vec());
            }
            commit(&kv, b).await;
            most = most.max(kv.overlay_len());
        }
        assert!(
            most <= MAX_OVERLAY_KEYS + 2 * per_batch as usize,
            "the overlay held {most} keys"
        );
        let s = kv.commit_stats();
        assert!(s.room_waits > 0, "no group waited for room: {s:?}");
        assert!(s.room_wait_micros > 0, "{s:?}");
        let n = kv
            .scan(
                &keys::event("s", 0),
                &keys::event_end("s"),
                false,
                usize::MAX,
            )
            .expect("scan")
            .len() as u64;
        assert_eq!(n, batches * per_batch);
    }

    /// Large values fill the overlay's room in bytes long before its room in keys:
    /// past `overlay_bytes` commits wait for the applier too. The count follows
    /// puts, rewrites, deletes and rounds.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_values_make_commits_wait_for_the_applier() {
        let dir = tempfile::tempdir().expect("tempdir");
        const VALUE: usize = 64 * 1024;
        let slow = LoggedOptions {
            overlay_bytes: 16 * VALUE,
            ..slow()
        };
        let (kv, _) = LoggedKv::open(dir.path(), slow).expect("open");
        let value = vec![b'x'; VALUE];
        let mut most = 0;
        for i in 0..48u64 {
            let mut b = Batch::new();
            b.put_raw(keys::event("s", i), value.clone());
            // A rewrite and a delete of small keys, counted too.
            b.put_raw(keys::event("t", i % 3), format!("v{i}").into_bytes());
            if i % 5 == 0 {
                b.delete(keys::event("t", (i + 1) % 3));
            }
            commit(&kv, b).await;
            most = most.max(kv.overlay_bytes());
        }
        assert!(kv.overlay_len() < 100, "far from the room in keys");
        assert!(most <= 18 * VALUE, "the overlay held {most} bytes");
        let s = kv.commit_stats();
        assert!(s.room_waits > 0, "no group waited for room: {s:?}");
        kv.sync().expect("apply");
        assert_eq!(kv.overlay_bytes(), 0);
        for i in 0..48u64 {
            assert_eq!(
                kv.get(&keys::event("s", i)).expect("get"),
                Some(value.clone())
            );
        }
    }

    /// With the applier thread gone, a full overlay refuses commits instead of
    /// growing with each one, and the store reports itself unhealthy.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_overlay_with_no_applier_refuses_commits() {
        let dir = tempfile::tempdir().expect("tempdir");
        let slow = LoggedOptions {
            segment_bytes: 64 << 20,
            heal_interval: Duration::from_millis(20),
            ..slow()
        };
        let (kv, _) = LoggedKv::open(dir.path(), slow).expect("open");
        kv.ctl
            .lock()
            .expect("ctl")
            .as_ref()
            .expect("open")
            .send(Ctl::Exit)
            .expect("send");
        for _ in 0..500 {
            if kv.health().is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(kv.health().is_err(), "the applier's end is reported");
        let mut b = Batch::new();
        for j in 0..=MAX_OVERLAY_KEYS as u64 {
            b.put_raw(keys::event("s", j), b"v".to_vec());
        }
        commit(&kv, b).await;
        let refused = kv
            .commit(put(&keys::event("t", 0), "v"))
            .await
            .expect("answered");
        assert!(refused.is_err(), "a commit past a full overlay was taken");
        assert_eq!(kv.overlay_len(), MAX_OVERLAY_KEYS + 1);
    }

    fn turn_at(ms: u64, n: u8) -> String {
        format!("t_{ms:012x}7000800000000000{n:04x}")
    }

    fn in_sled(sled: &Shared, key: &[u8]) -> bool {
        sled.with(|h| h.db.get(key).map_err(|e| StoreError::Read(e.to_string())))
            .expect("read")
            .is_some()
    }

    /// Folded records go to the window of their turn id's time, everything else (and
    /// turns minted before the first window) to the main database. A drop moves what
    /// the window still holds to the main database, and its directory goes once the
    /// drop is durable; a start after a crash does not re-create it from the log and
    /// loses nothing committed, before the drop or after it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn windows_route_by_turn_time_and_a_drop_survives_a_replay() {
        let dir = tempfile::tempdir().expect("tempdir");
        let manual = LoggedOptions {
            apply_interval: Duration::from_secs(3600),
            windows: WindowOptions {
                window_ms: 1,
                window_bytes: u64::MAX,
            },
            ..opts()
        };
        let (kv, _) = LoggedKv::open(dir.path(), manual).expect("open");
        // Windows are made when finished turns are to be written.
        let put_f = |id: &str| put(&keys::finished(id), id);
        let far = turn_at(u64::from(u32::MAX) << 8, 9);
        commit(&kv, put_f(&far)).await;
        kv.sync().expect("round: first window");
        std::thread::sleep(Duration::from_millis(5));
        commit(&kv, put_f(&far)).await;
        kv.sync().expect("round: second window");
        let list = kv.windows().expect("windows");
        assert!(list.len() >= 2, "{list:?}");
        let (a, b) = (list[0].start_ms, list[0].end_ms.expect("end"));
        assert!(dir.path().join("windows").join(a.to_string()).is_dir());

        let (old, early, late, after) = (
            turn_at(a - 1, 0),
            turn_at(a, 1),
            turn_at(b - 1, 2),
            turn_at(a, 3),
        );
        commit(&kv, put_f(&old)).await;
        commit(&kv, put_f(&early)).await;
        commit(&kv, put(&keys::session_meta("s"), "m")).await;
        kv.sync().expect("apply");
        let wa = kv.inner.windows.get(a).expect("window a");
        assert!(in_sled(&wa, &keys::finished(&early)));
        assert!(!in_sled(&kv.inner.sled, &keys::finished(&early)));
        assert!(
            in_sled(&kv.inner.sled, &keys::finished(&old)),
            "minted before any window"
        );
        assert!(in_sled(&kv.inner.sled, &keys::session_meta("s")));
        assert!(!in_sled(&wa, &keys::session_meta("s")));
        let (fs, fe) = keys::finished_range();
        assert_eq!(kv.scan(&fs, &fe, false, usize::MAX).expect("scan").len(), 3);
        assert_eq!(
            kv.get(&keys::finished(&early)).expect("get"),
            Some(early.clone().into_bytes())
        );
        // A scan of few entries whose first ones the overlay deletes still finds the
        // window's next record.
        let (ws, we) = windows::finished_key_range(a, Some(b));
        let mut del = Batch::new();
        del.delete(keys::finished(&early));
        commit(&kv, del).await;
        let second = turn_at(a, 5);
        commit(&kv, put_f(&second)).await;
        kv.sync().expect("apply");
        commit(&kv, {
            let mut d = Batch::new();
            d.delete(keys::finished(&second));
            d
        })
        .await;
        commit(&kv, put_f(&early)).await;
        kv.sync().expect("apply");
        let mut d = Batch::new();
        d.delete(keys::finished(&early));
        commit(&kv, d).await;
        assert!(kv.scan(&ws, &we, false, 1).expect("scan").is_empty());
        commit(&kv, put_f(&second)).await;
        kv.sync().expect("apply");
        let mut d = Batch::new();
        d.delete(keys::finished(&early));
        d.put_raw(keys::finished(&early), early.clone().into_bytes());
        commit(&kv, d).await;
        kv.sync().expect("apply");
        let mut d = Batch::new();
        d.delete(keys::finished(&early));
        commit(&kv, d).await;
        let found = kv.scan(&ws, &we, false, 1).expect("scan");
        assert_eq!(found.len(), 1, "the record after a deleted one");
        assert_eq!(found[0].0, keys::finished(&second));
        commit(&kv, put_f(&early)).await;
        let mut d = Batch::new();
        d.delete(keys::finished(&second));
        commit(&kv, d).await;
        kv.sync().expect("apply");
        drop(wa);

        // Not applied before the "crash": a record of the window, its drop, and a
        // record of the window written after the drop.
        commit(&kv, put_f(&late)).await;
        let mut b2 = Batch::new();
        b2.drop_window(a);
        commit(&kv, b2).await;
        assert!(kv.windows().expect("windows")[0].dropped);
        commit(&kv, put_f(&after)).await;
        std::mem::forget(kv);
        let copy = tempfile::tempdir().expect("tempdir");
        copy_dir(dir.path(), copy.path());
        let (kv, replayed) = LoggedKv::open(copy.path(), manual).expect("reopen");
        assert_eq!(replayed.records, 3);
        let window_a = copy.path().join("windows").join(a.to_string());
        assert!(
            !window_a.exists(),
            "the dropped window's directory is deleted"
        );
        for id in [&old, &early, &late, &after] {
            assert_eq!(
                kv.get(&keys::finished(id)).expect("get"),
                Some(id.clone().into_bytes()),
                "{id}"
            );
            assert!(in_sled(&kv.inner.sled, &keys::finished(id)), "{id} in main");
        }
        let listed = kv.windows().expect("windows");
        assert!(listed[0].dropped && listed[0].start_ms == a, "{listed:?}");
        // Deleting a record of the dropped window deletes it where it is now.
        let mut del = Batch::new();
        del.delete(keys::finished(&early));
        commit(&kv, del).await;
        kv.close().expect("close");
        drop(kv);
        let (kv, replayed) =
            crate::sled::open_when_unlocked(|| LoggedKv::open(copy.path(), manual))
                .expect("reopen");
        assert_eq!(replayed.records, 0);
        assert!(!window_a.exists());
        assert!(kv.windows().expect("windows")[0].dropped);
        assert_eq!(
            kv.get(&keys::finished(&after)).expect("get"),
            Some(after.into_bytes())
        );
        assert_eq!(kv.get(&keys::finished(&early)).expect("get"), None);
        assert_eq!(kv.scan(&fs, &fe, false, usize::MAX).expect("scan").len(), 4);
        // `store.check` reports a dropped window whose files are still there. (The
        // records above are not JSON: deleted first.)
        let mut d = Batch::new();
        for (k, _) in kv.scan(&fs, &fe, false, usize::MAX).expect("scan") {
            d.delete(k);
        }
        d.delete(keys::session_meta("s"));
        commit(&kv, d).await;
        let store = crate::Store::new(Arc::new(kv));
        let dropped_on_disk = |store: &crate::Store| {
            crate::check_store(store)
                .expect("check")
                .iter()
                .any(|v| v.invariant == "dropped_window_on_disk")
        };
        assert!(!dropped_on_disk(&store));
        std::fs::create_dir_all(&window_a).expect("mkdir");
        std::fs::write(window_a.join("db"), b"left over").expect("write");
        assert!(dropped_on_disk(&store));
    }

    /// Segments are deleted once sled holds their records, so the log stays small
    /// under a steady load.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_log_is_trimmed_behind_the_applier() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (kv, _) = LoggedKv::open(dir.path(), opts()).expect("open");
        for i in 0..2000u64 {
            commit(&kv, put(&keys::session_meta("s"), &format!("{i:0>100}"))).await;
        }
        kv.sync().expect("flush");
        // Segments only: the spare made ahead of need is not one yet.
        let segments = std::fs::read_dir(dir.path().join("log"))
            .expect("list")
            .filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".seg"))
            })
            .count();
        assert!(segments <= 2, "{segments} segments left");
        let s = kv.commit_stats();
        assert!(
            s.applied_keys < 2000,
            "rewrites of one key reach sled coalesced: {s:?}"
        );
        assert_eq!(
            kv.get(&keys::session_meta("s")).expect("get"),
            Some(format!("{:0>100}", 1999).into_bytes())
        );
    }

    /// Rounds between two marks write to sled but record no mark, so they sync no
    /// window: a crash then replays the log from the last mark and loses nothing. A
    /// flush (as before a trim) records the mark.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rounds_between_marks_record_none_and_a_crash_replays_from_the_last() {
        let dir = tempfile::tempdir().expect("tempdir");
        let o = LoggedOptions {
            mark_interval: Duration::from_secs(3600),
            ..slow()
        };
        let (kv, _) = LoggedKv::open(dir.path(), o).expect("open");
        let entries: Vec<Vec<u8>> = (1..=5).map(|i| keys::session_turn("s", i)).collect();
        for k in &entries {
            commit(&kv, put(k, "t")).await;
        }
        kv.round_with(Duration::ZERO);
        assert_eq!(kv.overlay_len(), 0, "the round applied everything");
        let sled = &kv.inner.sled;
        assert_eq!(applied_mark(sled).expect("mark"), 0, "and recorded no mark");
        // sled's files as a crash now would leave them (synced, to be sure the
        // missing mark is not a matter of what reached the disk).
        sled.with(|h| sled.sync_files(h)).expect("sync sled");
        let copy = tempfile::tempdir().expect("tempdir");
        copy_dir(dir.path(), copy.path());
        let (crashed, replayed) = LoggedKv::open(copy.path(), opts()).expect("open copy");
        assert_eq!(replayed.records, 5);
        for k in &entries {
            assert_eq!(crashed.get(k).expect("get"), Some(b"t".to_vec()));
        }
        kv.sync().expect("flush");
        assert_eq!(applied_mark(sled).expect("mark"), 5);
    }

    /// A round that cannot trim the closed segment yet (its records wait their
    /// delay) writes no spare of zeros: the closed segment becomes the spare when it is
    /// trimmed, and the log rolls over into it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_trimmed_segment_is_the_next_spare_and_no_zeros_are_written_meanwhile() {
        let dir = tempfile::tempdir().expect("tempdir");
        let held = LoggedOptions {
            apply_delay: Duration::from_secs(3600),
            ..slow()
        };
        let (kv, _) = LoggedKv::open(dir.path(), held).expect("open");
        let meta = keys::session_meta("s");
        let mut i = 0u64;
        async fn fill_until(kv: &LoggedKv, key: &[u8], i: &mut u64, segments: u64) {
            while kv.commit_stats().log_segments < segments {
                commit(kv, put(key, &format!("{i:0>200}"))).await;
                *i += 1;
                assert!(*i < 10_000, "the log never rolled over");
            }
        }
        fill_until(&kv, &meta, &mut i, 2).await;
        // The session's meta is a live record: nothing is applied, nothing trimmed.
        kv.round_with(Duration::from_secs(3600));
        let s = kv.commit_stats();
        assert_eq!((s.log_trims, s.log_zeroed), (0, 0), "{s:?}");
        // Everything applied: the closed segment is trimmed into the spare.
        kv.round_with(Duration::ZERO);
        let s = kv.commit_stats();
        assert_eq!(
            (s.log_trims, s.log_recycled, s.log_zeroed),
            (1, 1, 0),
            "{s:?}"
        );
        assert!(dir.path().join("log").join("spare").exists());
        // The next roll takes it: no segment is reserved for it.
        let reserved = s.log_reserved;
        fill_until(&kv, &meta, &mut i, 2).await;
        assert_eq!(kv.commit_stats().log_reserved, reserved);
        assert_eq!(
            kv.get(&meta).expect("get"),
            Some(format!("{:0>200}", i - 1).into_bytes())
        );
    }

    /// A put that creates its key (a minted id's record), in a batch of its own.
    /// Commit `batch` from the applier's next round, right after it wrote its next
    /// slice to sled and before it drops the slice from the overlay. The answer says
    /// whether the commit was made there (once the round ran).
    pub(crate) fn commit_during_next_slice(
        kv: &LoggedKv,
        batch: Batch,
    ) -> Arc<Mutex<Option<bool>>> {
        let tx = kv
            .tx
            .lock()
            .expect("lock")
            .clone()
            .expect("committer running");
        let rt = tokio::runtime::Handle::current();
        let committed = Arc::new(Mutex::new(None));
        let seen = committed.clone();
        *kv.inner.after_slice.lock().expect("lock") = Some(Box::new(move || {
            let (reply, ticket) = CommitTicket::new();
            let sent = tx.send(LogJob::new(batch, reply)).is_ok();
            let answer = rt.block_on(ticket);
            *seen.lock().expect("lock") = Some(sent && matches!(answer, Ok(Ok(()))));
        }));
        committed
    }

    fn put_new(k: &[u8], v: &str) -> Batch {
        let mut b = put(k, v);
        b.created_last();
        b
    }

    fn delete(k: &[u8]) -> Batch {
        let mut b = Batch::new();
        b.delete(k.to_vec());
        b
    }

    fn dropped_deletes(kv: &LoggedKv) -> u64 {
        kv.commit_stats().dropped_deletes
    }

    /// Delete `k`, which sled holds, and see the delete written, not dropped.
    async fn delete_is_written(kv: &LoggedKv, k: &[u8]) {
        let before = dropped_deletes(kv);
        commit(kv, delete(k)).await;
        kv.sync().expect("sync");
        assert_eq!(
            dropped_deletes(kv),
            before,
            "sled had {k:?}: its delete is written"
        );
        assert!(!in_sled(&kv.inner.sled, k));
    }

    /// A delete of a key that only the overlay ever held (created and deleted between
    /// two applies) is dropped, not written; a delete of a key sled got is written,
    /// also when the key was written again while the applier was writing it to sled
    /// (the race: the overlay's entry then no longer counts as held only there).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_delete_is_dropped_only_for_a_key_sled_never_got() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (kv, _) = LoggedKv::open(dir.path(), slow()).expect("open");
        // Created and deleted before any apply.
        commit(&kv, put_new(b"Tone", "v1")).await;
        commit(&kv, delete(b"Tone")).await;
        kv.sync().expect("sync");
        assert_eq!(dropped_deletes(&kv), 1);
        assert!(!in_sled(&kv.inner.sled, b"Tone"));
        assert_eq!(kv.get(b"Tone").expect("get"), None);
        // Created, applied, then deleted.
        commit(&kv, put_new(b"Ttwo", "v1")).await;
        kv.sync().expect("sync");
        assert!(in_sled(&kv.inner.sled, b"Ttwo"));
        delete_is_written(&kv, b"Ttwo").await;
        // Created, then written again while the applier writes the first value.
        commit(&kv, put_new(b"Tthree", "v1")).await;
        let rewritten = commit_during_next_slice(&kv, put(b"Tthree", "v2"));
        kv.sync().expect("sync");
        assert_eq!(
            *rewritten.lock().expect("lock"),
            Some(true),
            "the rewrite was committed while the applier wrote the first value"
        );
        assert!(in_sled(&kv.inner.sled, b"Tthree"));
        delete_is_written(&kv, b"Tthree").await;
        kv.close().expect("close");
        drop(kv);
        let (kv, _) =
            crate::sled::open_when_unlocked(|| LoggedKv::open(dir.path(), opts())).expect("reopen");
        for k in [&b"Tone"[..], b"Ttwo", b"Tthree"] {
            assert_eq!(kv.get(k).expect("get"), None, "{k:?} stays deleted");
        }
    }

    /// A live record's write waits `apply_delay` in the overlay while a key written
    /// once (a turn list entry) in the same batch goes to sled at the next round, and the
    /// applied mark stays before the waiting write: a start after a crash meanwhile
    /// replays it from the log.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_live_record_waits_its_delay_and_a_crash_meanwhile_keeps_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let delayed = LoggedOptions {
            apply_delay: Duration::from_secs(3600),
            ..opts()
        };
        let (kv, _) = LoggedKv::open(dir.path(), delayed).expect("open");
        // A key written once: a session's turn list entry.
        let entry = keys::session_turn("s", 1);
        let mut b = put(&entry, "t1");
        b.put_raw(b"Tlive".to_vec(), b"running".to_vec());
        commit(&kv, b).await;
        let until = Instant::now() + Duration::from_secs(10);
        while kv.overlay_len() != 1 {
            assert!(
                Instant::now() < until,
                "the list entry alone leaves the overlay ({} keys left)",
                kv.overlay_len()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let sled = &kv.inner.sled;
        assert!(in_sled(sled, &entry));
        assert!(!in_sled(sled, b"Tlive"));
        // Further rounds leave it waiting.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(kv.overlay_len(), 1);
        assert_eq!(kv.get(b"Tlive").expect("get"), Some(b"running".to_vec()));
        // sled's files as a crash now would leave them, mark included.
        sled.with(|h| sled.sync_files(h)).expect("sync sled");
        let copy = tempfile::tempdir().expect("tempdir");
        copy_dir(dir.path(), copy.path());
        {
            let (crashed, replayed) = LoggedKv::open(copy.path(), opts()).expect("open copy");
            assert_eq!(
                replayed.records, 1,
                "the waiting write's record is replayed"
            );
            assert_eq!(
                crashed.get(b"Tlive").expect("get"),
                Some(b"running".to_vec())
            );
            assert_eq!(crashed.get(&entry).expect("get"), Some(b"t1".to_vec()));
        }
        // A close takes everything, waiting or not.
        kv.close().expect("close");
        drop(kv);
        let (kv, replayed) =
            crate::sled::open_when_unlocked(|| LoggedKv::open(dir.path(), opts())).expect("reopen");
        assert_eq!(replayed.records, 0);
        assert!(in_sled(&kv.inner.sled, b"Tlive"));
    }
}
