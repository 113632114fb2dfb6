//! turnd's durable model.
//!
//! Everything turnd promises survives a crash lives here: turns, per-session turn
//! indexes, invocations, events and idempotency keys, in one sled 0.34 keyspace with
//! kind-prefixed keys. Every state transition of the engine is one [`Batch`], applied
//! atomically, and acknowledged only after the group commit that made it durable
//! (sled flush followed by `fdatasync` of sled's files; see [`sled_kv`]).
//!
//! The raw key-value surface is the small [`Kv`] trait so tests can wrap it with
//! faults ([`faulty::FaultyKv`]); [`Store`] is the typed layer the engine uses.

pub mod check;
pub mod faulty;
mod hidden;
pub mod keys;
pub mod logged;
pub mod mem;
mod merged;
pub mod records;
#[cfg(test)]
mod route_tests;
pub mod sled_kv;
mod values;
pub mod wal;
pub mod windows;
mod winstore;

use std::collections::HashMap;
use std::sync::Arc;

pub use check::check_store;
pub use logged::{
    LoggedKv, LoggedOptions, Replayed, DEFAULT_IDLE_REOPEN, DEFAULT_MARK_INTERVAL,
    DEFAULT_OVERLAY_BYTES,
};
pub use records::*;
pub use sled_kv::{SledKv, SledOptions, SyncMode, DEFAULT_CACHE_MB, DEFAULT_CHECKPOINT_MB};
pub use windows::{WindowInfo, WindowOptions};

use turnd_proto::Event;

/// A storage failure. The engine answers requests whose write failed with
/// `unavailable` and retries internal transitions.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("storage write failed: {0}")]
    Write(String),
    #[error("storage sync failed: {0}")]
    Sync(String),
    #[error("storage read failed: {0}")]
    Read(String),
    /// A failure the operating system reported, with its kind, so that a full disk
    /// can be told from other failures ([`StoreError::io_kind`]).
    #[error("storage {op} failed: {detail}")]
    Io {
        op: IoOp,
        kind: std::io::ErrorKind,
        detail: String,
    },
    #[error("stored record is corrupt: {0}")]
    Corrupt(String),
    #[error("storage is closed")]
    Closed,
}

/// What a storage operation that failed with an I/O error was doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoOp {
    Write,
    Sync,
    Read,
}

impl std::fmt::Display for IoOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IoOp::Write => "write",
            IoOp::Sync => "sync",
            IoOp::Read => "read",
        })
    }
}

impl StoreError {
    /// An I/O error of `op`, described by `what` and the error, keeping its kind.
    pub fn io(op: IoOp, what: impl std::fmt::Display, e: &std::io::Error) -> StoreError {
        StoreError::Io {
            op,
            kind: e.kind(),
            detail: format!("{what}: {e}"),
        }
    }

    /// The kind of the I/O error behind this failure, when it came from one.
    pub fn io_kind(&self) -> Option<std::io::ErrorKind> {
        match self {
            StoreError::Io { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// Whether the disk (or the user's quota on it) is full.
    pub fn is_disk_full(&self) -> bool {
        matches!(
            self.io_kind(),
            Some(std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded)
        )
    }
}

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

    pub fn put_raw(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.ops.push(KvOp::Put(key, value));
    }

    pub fn delete(&mut self, key: Vec<u8>) {
        self.ops.push(KvOp::Delete(key));
    }

    /// Mark the op just added as creating its key. A store may use the marks to
    /// skip deleting, later, a key whose every write it still holds itself;
    /// treating every put as not creating is always correct.
    fn created_last(&mut self) {
        if let Some(i) = self.ops.len().checked_sub(1) {
            self.created.push(i);
        }
    }

    /// Drop the time window starting at `start_ms` (see [`windows`]): its finished
    /// turns' records are gone from reads once this batch is committed, and its
    /// directory is deleted once the drop is durable in the main database.
    pub fn drop_window(&mut self, start_ms: u64) {
        self.put_raw(windows::dropped_key(start_ms), Vec::new());
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
    pub fn put_events(&mut self, events: &[Event]) {
        let from = self.ops.len();
        self.put_events_in(events, true);
        // A transition's events have `seq`s the session never had: their keys are new.
        self.created.extend(from..self.ops.len());
    }

    /// [`Batch::put_events`], with no route when `routed` is false: retention writes a
    /// value of the earlier layout again in the same form, so that it stays where
    /// reads of a session with no routed keys look.
    pub fn put_events_in(&mut self, events: &[Event], routed: bool) {
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
    fn events_route(&mut self, group: &[Event]) -> Option<u64> {
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

/// Most events stored in one value (see [`Batch::put_events`]).
pub const EVENTS_PER_VALUE: usize = 64;

/// A key and its value.
pub type Entry = (Vec<u8>, Vec<u8>);

/// The turn id a session's turn-list entry holds.
fn turn_index_id(v: Vec<u8>) -> Result<String, StoreError> {
    String::from_utf8(v).map_err(|e| StoreError::Corrupt(format!("turn index: {e}")))
}

/// The first key after a full page of a scan (the last key with a zero byte appended),
/// or None when the page was the last.
pub fn next_page(page: &[Entry], limit: usize) -> Option<Vec<u8>> {
    if page.len() < limit {
        return None;
    }
    page.last().map(|(k, _)| {
        let mut next = k.clone();
        next.push(0);
        next
    })
}

/// What a store's committer sends back for one batch: its result and, from the
/// commit log, the buffers the batch came in. Those are allocated by the committing
/// task; freed there (when the ticket resolves) rather than on the one thread every
/// commit passes through, they cost that thread nothing (a thread that only frees
/// what others allocated returns every block to its owner's arena, a lock each time).
pub(crate) struct Answer {
    result: Result<(), StoreError>,
    /// Held only to be dropped by the ticket's task.
    _spent: Option<logged::Spent>,
}

/// A pending group commit: resolves once the batch is durable (or failed); an error
/// when the store went away without answering.
pub struct CommitTicket(tokio::sync::oneshot::Receiver<Answer>);

/// Where a batch's result goes: the other end of its [`CommitTicket`].
pub struct CommitReply(tokio::sync::oneshot::Sender<Answer>);

impl CommitTicket {
    /// A ticket and where its result is to be sent (a store of its own, or one
    /// wrapping another).
    pub fn new() -> (CommitReply, CommitTicket) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        (CommitReply(tx), CommitTicket(rx))
    }

    /// A ticket answered already (a commit refused before it was queued).
    pub(crate) fn answered(result: Result<(), StoreError>) -> CommitTicket {
        let (reply, ticket) = CommitTicket::new();
        if reply.send(result).is_err() {
            // The ticket is held right here; a send to it does not fail.
            tracing::debug!("a ticket answered at once was gone");
        }
        ticket
    }
}

impl std::future::Future for CommitTicket {
    type Output = Result<Result<(), StoreError>, tokio::sync::oneshot::error::RecvError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0)
            .poll(cx)
            .map(|answer| answer.map(|a| a.result))
    }
}

impl CommitReply {
    /// Send `result`; when the ticket was dropped, Err with the result undelivered.
    pub fn send(self, result: Result<(), StoreError>) -> Result<(), Result<(), StoreError>> {
        self.send_spent(result, None)
    }

    /// Send `result` with the buffers of its batch, to be freed by the ticket's task.
    pub(crate) fn send_spent(
        self,
        result: Result<(), StoreError>,
        spent: Option<logged::Spent>,
    ) -> Result<(), Result<(), StoreError>> {
        self.0
            .send(Answer {
                result,
                _spent: spent,
            })
            .map_err(|a| a.result)
    }
}

/// The raw key-value surface of the store.
pub trait Kv: Send + Sync + 'static {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;
    /// Entries with keys in `[start, end)`, ascending (or descending when `reverse`),
    /// at most `limit`.
    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError>;
    /// [`Kv::scan`] of a range of one session's keys (its turn list, events or
    /// idempotency keys), all of whose routes ([`keys`]) are at or after `from_ms`
    /// (None: the session has no routed key; its meta's
    /// [`SessionMeta::routed_from_ms`]): a store with time windows reads only the
    /// windows that can hold them, where a plain scan reads them all.
    fn scan_session(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
        _from_ms: Option<u64>,
    ) -> Result<Vec<Entry>, StoreError> {
        self.scan(start, end, reverse, limit)
    }
    /// The key of a range of one session's keys that holds at most one (its turn list
    /// entry at one seq, or one idempotency key: a reader does not know their routes),
    /// as [`Kv::scan_session`] reads it. A store with time windows looks in them
    /// newest first and stops at the first it finds, where a scan reads every one.
    fn scan_one(
        &self,
        start: &[u8],
        end: &[u8],
        from_ms: Option<u64>,
    ) -> Result<Option<Entry>, StoreError> {
        Ok(self
            .scan_session(start, end, false, 1, from_ms)?
            .into_iter()
            .next())
    }
    /// Up to `limit` entries with keys in `[start, end)` that are stored in the open
    /// time window starting at `window_start` (the keys routed to it: see
    /// [`windows`]), ascending. Retention reads a window's event values with it before
    /// it drops the window. This default scans the range and keeps the keys routed
    /// there; a store with windows reads only the window.
    fn scan_window(
        &self,
        window_start: u64,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        let wins = self.windows()?;
        let Some(w) = wins.iter().find(|w| w.start_ms == window_start) else {
            return Ok(Vec::new());
        };
        let page_size = limit.max(64);
        let mut out = Vec::new();
        let mut from = start.to_vec();
        while out.len() < limit {
            let page = self.scan(&from, end, false, page_size)?;
            let next = next_page(&page, page_size);
            out.extend(
                page.into_iter()
                    .filter(|(k, _)| windows::routed_ms(k).is_some_and(|ms| w.holds(ms))),
            );
            match next {
                Some(n) => from = n,
                None => break,
            }
        }
        out.truncate(limit);
        Ok(out)
    }
    /// Queue an atomic batch for the next group commit.
    fn commit(&self, batch: Batch) -> CommitTicket;
    /// Make everything committed so far durable (used at shutdown).
    fn sync(&self) -> Result<(), StoreError>;
    /// Commit statistics, for metrics.
    fn commit_stats(&self) -> CommitStats {
        CommitStats::default()
    }
    /// Whether the store is behind: commits may come to wait for it (the commit
    /// log's keys not yet in sled fill over a quarter of their room). Background writers
    /// (retention) hold back while it is, so that they do not push the commits of
    /// live work into that wait.
    fn busy(&self) -> bool {
        false
    }
    /// Err when the store can no longer work without a restart (a thread of its own
    /// has ended); `/healthz` fails with it.
    fn health(&self) -> Result<(), String> {
        Ok(())
    }
    /// The time windows of finished turns, oldest first (see [`windows`]).
    fn windows(&self) -> Result<Vec<WindowInfo>, StoreError> {
        Ok(Vec::new())
    }
    /// Until the matching [`Kv::release_event_merges`], keep the session's event
    /// values each under the key it was written with: retention reads them and writes
    /// them again under those keys, and a store that writes several values as one
    /// (`LoggedKv`, see `logged/runs.rs`) would move events to another key meanwhile.
    /// Holds of one session add up. A wrapper must pass both calls on.
    fn hold_event_merges(&self, _session_id: &str) {}
    /// End a [`Kv::hold_event_merges`].
    fn release_event_merges(&self, _session_id: &str) {}
}

/// Upper bounds, in seconds, of the buckets of [`CommitStats::sync_buckets`]: from
/// the quarter millisecond a sync of a few pages takes on an idle SSD to the half
/// second of a disk that stalls every writer.
pub const SYNC_BUCKET_BOUNDS: [f64; 11] = [
    0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5,
];
/// Buckets of [`CommitStats::sync_buckets`]: one per bound and one past the last.
pub const SYNC_BUCKETS: usize = SYNC_BUCKET_BOUNDS.len() + 1;

/// The bucket of [`CommitStats::sync_buckets`] a sync of `took` belongs to.
fn sync_bucket(took: std::time::Duration) -> usize {
    let secs = took.as_secs_f64();
    SYNC_BUCKET_BOUNDS
        .iter()
        .position(|bound| secs <= *bound)
        .unwrap_or(SYNC_BUCKET_BOUNDS.len())
}

/// Counters of the group-commit writer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommitStats {
    /// Group commits (syncs) performed.
    pub syncs: u64,
    /// Batches written.
    pub batches: u64,
    /// Total microseconds spent in apply + sync.
    pub commit_micros: u64,
    /// Of `commit_micros`, the microseconds spent making the writes durable (sled
    /// flush and fdatasync); the rest is applying the batches.
    pub sync_micros: u64,
    /// Largest number of batches that shared one sync.
    pub max_group: u64,
    /// Group commits by the time their write and `fdatasync` of the commit log took
    /// (the time `sync_micros` adds up):
    /// `sync_buckets[i]` counts those that took at most [`SYNC_BUCKET_BOUNDS`]`[i]`
    /// seconds and more than the bound before; the last counts the longer ones.
    pub sync_buckets: [u64; SYNC_BUCKETS],
    /// Checkpoints performed (sled closed and opened again to bound the log a
    /// restart replays; see `SledKv`).
    pub checkpoints: u64,
    /// Total microseconds spent in checkpoints, during which commits wait.
    pub checkpoint_micros: u64,
    /// Longest single checkpoint, in microseconds.
    pub max_checkpoint_micros: u64,
    /// Bytes of batches appended to the commit log.
    pub log_bytes: u64,
    /// Rounds in which the applier wrote the commit log's records to sled.
    pub applies: u64,
    /// Keys those rounds wrote (each key once per round, however often committed).
    pub applied_keys: u64,
    /// Microseconds those rounds took.
    pub apply_micros: u64,
    /// Deletes those rounds dropped instead of writing: of keys that no store but
    /// the overlay ever held (a turn's or invocation's record created and deleted
    /// before the applier took it).
    pub dropped_deletes: u64,
    /// Event values those rounds wrote as part of a later value of the same session
    /// instead of under their own key.
    pub merged_event_values: u64,
    /// Group commits that waited before their write because the overlay was full
    /// (more keys committed but not yet in sled than it may hold): sled was behind.
    pub room_waits: u64,
    /// Microseconds those groups waited.
    pub room_wait_micros: u64,
    /// Keys committed but not yet in sled (a gauge).
    pub overlay_keys: u64,
    /// Bytes of those keys and their values (a gauge).
    pub overlay_bytes: u64,
    /// Files of the commit log (a gauge).
    pub log_segments: u64,
    /// Commit log segments deleted once sled held their records.
    pub log_trims: u64,
    /// Of those, the ones kept as the log's next segment instead of deleted.
    pub log_recycled: u64,
    /// Spare segments written with zeros because no trimmed one was at hand.
    pub log_zeroed: u64,
    /// Segments begun with blocks only reserved because no spare was ready at the
    /// roll (each `fdatasync` into one also writes the file's extent map).
    pub log_reserved: u64,
    /// Keys a time window still held when its drop was taken, moved to the main
    /// database (turns that ended, or events written, between retention's judging
    /// the window empty and the drop; see [`windows`]).
    pub window_leftovers: u64,
    /// Time windows closed until needed (a gauge; see
    /// [`LoggedOptions::window_close_after`]).
    pub windows_closed: u64,
    /// Closed windows opened again by a read or write that needed them.
    pub window_reopens: u64,
}

impl CommitStats {
    /// Count a group commit's write and sync of `took` (its time in `sync_micros`,
    /// and its bucket in `sync_buckets`).
    pub fn record_sync(&mut self, took: std::time::Duration) {
        self.sync_micros += took.as_micros() as u64;
        self.sync_buckets[sync_bucket(took)] += 1;
    }
}

/// A session's id and where its routed keys can be ([`SessionMeta::routed_from_ms`]):
/// what a read of its turn list, events or idempotency keys needs.
#[derive(Debug, Clone, Copy)]
pub struct SessionKeys<'a> {
    pub id: &'a str,
    pub from_ms: Option<u64>,
}

impl SessionMeta {
    /// Where this session's keys are.
    pub fn keys(&self) -> SessionKeys<'_> {
        SessionKeys {
            id: &self.session_id,
            from_ms: self.routed_from_ms,
        }
    }
}

/// The typed store the engine uses.
#[derive(Clone)]
pub struct Store {
    kv: Arc<dyn Kv>,
    /// Where reads found each session's visible events to start ([`hidden`]).
    marks: Arc<hidden::Marks>,
}

fn decode<'a, T: serde::Deserialize<'a>>(what: &str, bytes: &'a [u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

/// The events of a stored event value: one event, or an array of them.
pub fn event_value(v: &[u8]) -> Result<Vec<Event>, StoreError> {
    value_items(v)
}

/// The items of a stored event value as `T`: one, or an array of them.
fn value_items<'a, T: serde::Deserialize<'a>>(v: &'a [u8]) -> Result<Vec<T>, StoreError> {
    if v.first() == Some(&b'[') {
        decode("events", v)
    } else {
        Ok(vec![decode("event", v)?])
    }
}

/// What retention reads of a stored event: its `seq` and its turn. The rest of the
/// event (its kind and detail) is passed over without being built.
#[derive(Debug, serde::Deserialize)]
pub struct EventHead<'a> {
    pub seq: u64,
    #[serde(borrow)]
    pub turn_id: std::borrow::Cow<'a, str>,
}

/// The [`EventHead`]s of a stored event value.
pub fn event_heads(v: &[u8]) -> Result<Vec<EventHead<'_>>, StoreError> {
    value_items(v)
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

    /// A turn's record under its own key (an unfinished turn's, or a finished one of
    /// the earlier layout).
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

    /// A session's idempotency key as stored (with its route, or without one when
    /// written before routes), and its record.
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
    /// [`TurnHead`]s, and where the next page starts: unfinished turns, and finished
    /// ones of the earlier layout.
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use turnd_proto::EventKind;

    #[test]
    fn a_sync_falls_in_the_first_bucket_whose_bound_it_does_not_pass() {
        let ms = |m: f64| std::time::Duration::from_secs_f64(m / 1000.0);
        assert_eq!(sync_bucket(ms(0.1)), 0);
        assert_eq!(sync_bucket(ms(0.25)), 0);
        assert_eq!(sync_bucket(ms(0.3)), 1);
        assert_eq!(sync_bucket(ms(40.0)), 7);
        assert_eq!(sync_bucket(ms(100.0)), 8);
        assert_eq!(sync_bucket(ms(500.0)), 10);
        assert_eq!(sync_bucket(ms(900.0)), SYNC_BUCKETS - 1);
    }

    #[tokio::test]
    async fn paged_scans_visit_every_meta_once_in_key_order() {
        let store = Store::new(Arc::new(mem::MemKv::new()));
        let mut b = Batch::new();
        let ids: Vec<String> = (0..10).map(|i| format!("s{i:02}")).collect();
        for id in &ids {
            b.put_session_meta(&SessionMeta::new(id));
        }
        store.commit(b).await.expect("commit");

        for limit in [1, 3, 10, 50] {
            let mut seen = Vec::new();
            let mut from = Store::FIRST.to_vec();
            for round in 0.. {
                assert!(round <= 60, "metas: pages of {limit} do not end");
                let (page, next) = store.session_metas_page(&from, limit).expect("page");
                assert!(page.len() <= limit);
                seen.extend(page.into_iter().map(|m| m.session_id));
                match next {
                    Some(n) => from = n,
                    None => break,
                }
            }
            assert_eq!(seen, ids, "metas with pages of {limit}");
        }
    }

    fn ev(seq: u64) -> Event {
        Event {
            seq,
            session_id: "s".into(),
            turn_id: format!("t{seq}"),
            at_ms: seq,
            kind: EventKind::Admitted,
            detail: json!({"n": seq}),
        }
    }

    #[tokio::test]
    async fn events_stored_by_transition_read_back_one_by_one() {
        let kv = Arc::new(mem::MemKv::new());
        let store = Store::new(kv.clone());
        // Transitions of 1, 3, 1 and 150 events: seqs 1 | 2 3 4 | 5 | 6 ..= 155, the
        // last stored as values of 64, 64 and 22 events.
        let last: u64 = 155;
        for group in [vec![1], vec![2, 3, 4], vec![5], (6..=last).collect()] {
            let mut b = Batch::new();
            b.put_events(&group.into_iter().map(ev).collect::<Vec<_>>());
            store.commit(b).await.expect("commit");
        }
        let (s, e) = (keys::event("s", 0), keys::event_end("s"));
        let stored = kv.scan(&s, &e, false, usize::MAX).expect("scan");
        let keyed: Vec<u64> = stored
            .iter()
            .map(|(k, _)| keys::seq_suffix(k).expect("seq"))
            .collect();
        assert_eq!(keyed, vec![1, 4, 5, 69, 133, 155]);
        let at = SessionKeys {
            id: "s",
            from_ms: None,
        };
        let seqs = |after, limit| -> Vec<u64> {
            store
                .stored_events(at, after, limit)
                .expect("events")
                .iter()
                .map(|e| e.seq)
                .collect()
        };
        assert_eq!(seqs(0, usize::MAX), (1..=last).collect::<Vec<_>>());
        for after in 0..=last {
            for limit in [1, 2, 3, 15, 16, 17, 63, 64, 65, 200, usize::MAX] {
                let want: Vec<u64> = (after + 1..=last).take(limit).collect();
                assert_eq!(seqs(after, limit), want, "after {after}, limit {limit}");
            }
        }
        assert!(seqs(3, 0).is_empty());
        let all = store.stored_events(at, 0, usize::MAX).expect("events");
        assert_eq!(all[2], ev(3), "an event inside a group reads back whole");
    }

    /// A read that meets only events of turns that are gone before the first visible
    /// one remembers where they end; later reads start there, and still see every
    /// visible event. A forgotten session's mark goes with it.
    #[tokio::test]
    async fn reads_remember_where_a_sessions_visible_events_start() {
        let kv = Arc::new(mem::MemKv::new());
        let store = Store::new(kv.clone());
        let kept = turn("s", 1, turnd_proto::TurnStatus::Completed);
        let of = |seq: u64, turn_id: String| Event { turn_id, ..ev(seq) };
        // Events 1 ..= 40 of turns that are gone, 41 ..= 50 of the kept turn, 51 of a
        // gone turn again, 52 of the kept one.
        let mut b = Batch::new();
        b.put_turn(&kept);
        let events: Vec<Event> = (1..=52)
            .map(|seq| match seq {
                41..=50 | 52 => of(seq, kept.turn_id.clone()),
                _ => of(seq, format!("gone-{seq}")),
            })
            .collect();
        b.put_events(&events);
        store.commit(b).await.expect("commit");
        let at = SessionKeys {
            id: "s",
            from_ms: None,
        };
        let seqs = |after, limit| -> Vec<u64> {
            store
                .events(at, after, limit)
                .expect("events")
                .iter()
                .map(|e| e.seq)
                .collect()
        };
        let visible: Vec<u64> = (41..=50).chain([52]).collect();
        assert_eq!(store.marks.start("s").mark, 0);
        assert_eq!(seqs(0, usize::MAX), visible);
        assert_eq!(store.marks.start("s").mark, 40, "the hidden run before 41");
        // From the mark on, with every limit and from before, at and after it.
        for after in [0, 39, 40, 41, 45, 50, 51] {
            for limit in [1, 2, 10, 11, usize::MAX] {
                let want: Vec<u64> = visible
                    .iter()
                    .copied()
                    .filter(|s| *s > after)
                    .take(limit)
                    .collect();
                assert_eq!(seqs(after, limit), want, "after {after}, limit {limit}");
            }
        }
        assert_eq!(
            store.marks.start("s").mark,
            40,
            "51 is after a visible event"
        );
        // The mark is where reads start: an event at or before it is not read again.
        let mut b = Batch::new();
        b.put_turn(&turn("s", 2, turnd_proto::TurnStatus::Completed));
        b.put_events(&[of(3, "t-s-2".into())]);
        store.commit(b).await.expect("commit");
        assert_eq!(seqs(0, 1), [41]);
        // Forgotten: the session's events may start again from 1.
        store.forgot_session("s");
        assert_eq!(seqs(0, 1), [3]);
    }

    fn turn(sid: &str, seq: u64, status: turnd_proto::TurnStatus) -> TurnRecord {
        let input = RawJson::from_value(&json!(null));
        let mut t = TurnRecord::admitted(format!("t-{sid}-{seq}"), sid, seq, "f", input, 0);
        t.status = status;
        t
    }

    /// A store whose first read of a key runs `finish` right after it answered: the
    /// turn's end committed between the two reads of a lookup.
    struct EndsBetweenReads {
        inner: mem::MemKv,
        finish: std::sync::Mutex<Option<Batch>>,
    }

    impl Kv for EndsBetweenReads {
        fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
            let got = self.inner.get(key)?;
            let finish = self.finish.lock().expect("lock").take();
            if let Some(b) = finish {
                // MemKv applies a batch as it is queued.
                drop(self.inner.commit(b));
            }
            Ok(got)
        }
        fn scan(
            &self,
            start: &[u8],
            end: &[u8],
            reverse: bool,
            limit: usize,
        ) -> Result<Vec<Entry>, StoreError> {
            self.inner.scan(start, end, reverse, limit)
        }
        fn commit(&self, batch: Batch) -> CommitTicket {
            self.inner.commit(batch)
        }
        fn sync(&self) -> Result<(), StoreError> {
            self.inner.sync()
        }
    }

    /// A turn that finishes while it is being read is found, live or folded, by
    /// every lookup: its own keys and its folded record change in one batch, so the
    /// lookups must read its own keys first.
    #[tokio::test]
    async fn a_turn_that_finishes_between_two_reads_is_still_found() {
        for apart in [false, true] {
            let input = if apart {
                RawJson::from_value(&json!({"prompt": "q".repeat(INPUT_APART_BYTES)}))
            } else {
                RawJson::from_value(&json!({"prompt": "short"}))
            };
            let live = TurnRecord::admitted("t-race".into(), "s", 1, "f", input.clone(), 0);
            let mut done = live.clone();
            done.status = turnd_proto::TurnStatus::Completed;
            done.phase = Phase::Done;
            done.finished_at_ms = Some(5);
            let mut finish = Batch::new();
            finish.put_finished(&FoldedTurn::new(&done, Vec::new()), apart);
            for read in 0..3 {
                let kv = Arc::new(EndsBetweenReads {
                    inner: mem::MemKv::new(),
                    finish: std::sync::Mutex::new(None),
                });
                let store = Store::new(kv.clone());
                let mut b = Batch::new();
                b.put_admission(&live);
                b.put_turn(&live);
                store.commit(b).await.expect("commit");
                *kv.finish.lock().expect("lock") = Some(finish.clone());
                let found = match read {
                    0 => store
                        .turn("t-race")
                        .expect("turn")
                        .map(|t| *t.input == input),
                    1 => store.turn_record("t-race").expect("record").map(|_| true),
                    _ => store.turn_exists("t-race").expect("exists").then_some(true),
                };
                assert_eq!(found, Some(true), "lookup {read}, input apart: {apart}");
            }
        }
    }

    /// An input of `INPUT_APART_BYTES` or more is written once under its own key, the
    /// record never holds it, and reading the turn puts it back; a smaller one stays in
    /// the record. `store.check` reports a turn whose input stored apart is missing.
    #[tokio::test]
    async fn a_large_input_is_stored_once_apart_from_its_record() {
        let kv = Arc::new(mem::MemKv::new());
        let store = Store::new(kv.clone());
        let big = RawJson::from_value(&json!({"prompt": "q".repeat(INPUT_APART_BYTES)}));
        let small = RawJson::from_value(&json!({"prompt": "short"}));
        let mut b = Batch::new();
        let mut t1 = TurnRecord::admitted("t-big".into(), "s", 1, "f", big.clone(), 0);
        let t2 = TurnRecord::admitted("t-small".into(), "s", 2, "f", small.clone(), 0);
        for t in [&t1, &t2] {
            b.put_admission(t);
            b.put_turn(t);
        }
        store.commit(b).await.expect("commit");
        // A later transition rewrites the record only.
        t1.status = turnd_proto::TurnStatus::Completed;
        t1.phase = Phase::Done;
        t1.output = Some(small.clone());
        let mut b = Batch::new();
        b.put_turn(&t1);
        store.commit(b).await.expect("commit");

        let record = kv.get(&keys::turn("t-big")).expect("get").expect("record");
        assert!(record.len() < 1024, "{}", String::from_utf8_lossy(&record));
        let apart = kv.get(&keys::turn_input("t-big")).expect("get");
        assert_eq!(apart.as_deref(), Some(big.as_str().as_bytes()));
        assert_eq!(kv.get(&keys::turn_input("t-small")).expect("get"), None);
        let read = store.turn("t-big").expect("read").expect("turn");
        assert_eq!(*read.input, big);
        assert_eq!(read.state(), &big);
        assert_eq!(read.output, Some(small.clone()));
        // A record read back (as recovery does) and written again still leaves it out.
        let mut b = Batch::new();
        b.put_turn(&read);
        store.commit(b).await.expect("commit");
        let record = kv.get(&keys::turn("t-big")).expect("get").expect("record");
        assert!(record.len() < 1024, "{}", String::from_utf8_lossy(&record));
        // The bound: JSON text of INPUT_APART_BYTES goes apart, one byte less stays.
        let text = |n: usize| RawJson::from_value(&json!("x".repeat(n - 2)));
        assert!(TurnInput::new(text(INPUT_APART_BYTES)).is_apart());
        assert!(!TurnInput::new(text(INPUT_APART_BYTES - 1)).is_apart());
        assert_eq!(
            *store.turn("t-small").expect("read").expect("turn").input,
            small
        );

        let mut b = Batch::new();
        b.delete(keys::turn_input("t-big"));
        store.commit(b).await.expect("commit");
        assert!(matches!(store.turn("t-big"), Err(StoreError::Corrupt(_))));
        let found = check_store(&store).expect("check");
        assert!(
            found
                .iter()
                .any(|v| v.invariant == "turn_input_missing"
                    && v.turn_id.as_deref() == Some("t-big")),
            "{found:?}"
        );
    }

    fn invocation(inv_id: &str, turn_id: &str, state: InvState) -> InvocationRecord {
        InvocationRecord {
            invocation_id: inv_id.into(),
            turn_id: turn_id.into(),
            session_id: "s".into(),
            function_id: "f".into(),
            step: 0,
            attempt: 1,
            worker_id: "w".into(),
            instance_id: "i".into(),
            settings: FunctionSettings {
                timeout_ms: 1000,
                delivery: turnd_proto::Delivery::AtLeastOnce,
                max_attempts: 1,
            },
            state,
            wait: InvWait::AwaitingResult,
            wait_since_ms: 0,
            deadline_ms: 0,
            attempt_deadline_ms: 0,
            dispatched_at_ms: 0,
            ended_at_ms: None,
            outcome: None,
            late: false,
        }
    }

    /// A finished turn is one folded record: the turn (its input inline, even one
    /// stored apart while it ran) and its ended invocations, which are found by their
    /// id alone; its separate keys are gone. A turn of the earlier layout (record,
    /// input apart, invocation under their own keys) reads the same.
    #[tokio::test]
    async fn a_finished_turn_reads_the_same_folded_or_in_the_earlier_layout() {
        let kv = Arc::new(mem::MemKv::new());
        let store = Store::new(kv.clone());
        let big = RawJson::from_value(&json!({"prompt": "q".repeat(INPUT_APART_BYTES)}));
        let ids = [turnd_proto::new_turn_id(), turnd_proto::new_turn_id()];
        let mut meta = SessionMeta::new("s");
        let mut expected = Vec::new();
        for (n, id) in ids.iter().enumerate() {
            let inv_id = turnd_proto::new_invocation_id_of(id);
            let mut t = TurnRecord::admitted(id.clone(), "s", n as u64 + 1, "f", big.clone(), 0);
            t.invocation_id = Some(inv_id.clone());
            let mut b = Batch::new();
            b.put_admission(&t);
            b.put_turn(&t);
            b.put_invocation(&invocation(&inv_id, id, InvState::Active));
            // The session's meta, as every transition writes it: with where its
            // routed keys are, and counting the turns once they are completed.
            meta.last_turn_seq = n as u64 + 1;
            meta.counts.completed = n as u64 + 1;
            meta.routed_at(b.routed_from());
            b.put_session_meta(&meta);
            store.commit(b).await.expect("commit");
            t.status = turnd_proto::TurnStatus::Completed;
            t.phase = Phase::Done;
            t.finished_at_ms = Some(5);
            let inv = invocation(&inv_id, id, InvState::Finished);
            let mut b = Batch::new();
            if n == 0 {
                b.put_finished(&FoldedTurn::new(&t, vec![inv.clone()]), true);
            } else {
                // The earlier layout: a terminal turn under its own keys.
                b.put_turn(&t);
                b.put_invocation(&inv);
            }
            store.commit(b).await.expect("commit");
            expected.push((t, inv));
        }
        let (folded, _) = &expected[0];
        for k in [
            keys::turn(&folded.turn_id),
            keys::turn_input(&folded.turn_id),
            keys::invocation(folded.invocation_id.as_deref().expect("inv")),
        ] {
            assert_eq!(kv.get(&k).expect("get"), None, "{k:?} is deleted");
        }
        for (t, inv) in &expected {
            let read = store.turn(&t.turn_id).expect("read").expect("turn");
            assert_eq!(*read.input, big);
            assert_eq!(read.status, turnd_proto::TurnStatus::Completed);
            assert_eq!(
                store
                    .turn_record(&t.turn_id)
                    .expect("read")
                    .map(|r| r.status),
                Some(turnd_proto::TurnStatus::Completed)
            );
            assert!(store.turn_exists(&t.turn_id).expect("read"));
            let got = store.invocation(&inv.invocation_id).expect("read");
            assert_eq!(got.as_ref(), Some(inv));
        }
        assert!(store.finished(&ids[0]).expect("read").is_some());
        assert!(store.finished(&ids[1]).expect("read").is_none());
        let unknown = turnd_proto::new_invocation_id_of(&ids[0]);
        assert_eq!(store.invocation(&unknown).expect("read"), None);
        assert!(check_store(&store).expect("check").is_empty());

        // A record under its own key beside the folded one is reported.
        let mut b = Batch::new();
        b.put_turn(folded);
        store.commit(b).await.expect("commit");
        let found = check_store(&store).expect("check");
        assert!(
            found.iter().any(|v| v.invariant == "turn_stored_twice"),
            "{found:?}"
        );
    }

    #[tokio::test]
    async fn unfinished_turns_start_at_the_metas_mark_and_skip_ended_ones() {
        use turnd_proto::TurnStatus::*;
        let store = Store::new(Arc::new(mem::MemKv::new()));
        let mut b = Batch::new();
        let statuses = [Completed, Running, Cancelled, Queued, Failed];
        for (i, status) in statuses.into_iter().enumerate() {
            let t = turn("s", i as u64 + 1, status);
            b.put_admission(&t);
            b.put_turn(&t);
        }
        store.commit(b).await.expect("commit");
        let mut meta = SessionMeta::new("s");
        meta.last_turn_seq = 5;
        assert!(store.unfinished_turns(&meta).expect("read").is_empty());
        meta.active_from = Some(2);
        let seqs: Vec<u64> = store
            .unfinished_turns(&meta)
            .expect("read")
            .iter()
            .map(|t| t.seq)
            .collect();
        assert_eq!(seqs, vec![2, 4]);
        // One unfinished turn and nothing after it: read by a point lookup.
        meta.active_from = Some(4);
        meta.last_turn_seq = 4;
        let one = store.unfinished_turns(&meta).expect("read");
        assert_eq!(one.iter().map(|t| t.seq).collect::<Vec<_>>(), vec![4]);
        meta.active_from = Some(5);
        meta.last_turn_seq = 5;
        assert!(store.unfinished_turns(&meta).expect("read").is_empty());
    }
}
