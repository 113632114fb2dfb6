//! The turn state machine.
//!
//! Every session has one writer: its async mutex. A transition locks the session,
//! builds a [`Tx`] on top of the unchanged state, commits the batch through the
//! store's group commit, and only then applies it to memory and runs its side effects
//! (pushes to workers and watchers, waking `turn.wait`ers, re-arming the session's
//! timer). A request whose write fails is answered `unavailable` and changes
//! nothing; an internal transition whose write fails leaves the session `finalizing`
//! and is retried with backoff until written.
//!
//! All internal progress goes through [`Engine::drive`]: it looks at a session and
//! does whatever is due (dispatch, probe, give up, retry, fail on a deadline). Timers,
//! worker disconnects, freed capacity and write retries all just call it.

use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use turnd_proto::*;
use turnd_store::{
    check_store, FunctionSettings, InvState, InvocationRecord, Phase, RawJson, SessionMeta, Store,
    StoreError, TurnDispatch, TurnRecord,
};

mod admission;
mod cells;
mod commit;
mod dispatch;
mod operator;
mod queries;
mod recovery;
mod registry_gc;
mod results;
mod retention;
mod stop;
mod timers;
mod watch;
mod workers;

use crate::clock::Clock;
use crate::config::EngineConfig;
use crate::error::{EngineError, EngineResult};
use crate::machine::{self, Effect, Tx};
use crate::metrics::Counters;
use crate::registry::{Assignment, CloseReason, Outbox, Registry};
use crate::session::{Pending, SessionState};
use crate::view::{to_turn, wait_of};

#[path = "sessions_list.rs"]
mod sessions_list;
pub use admission::SubmitOptions;
pub(crate) use cells::shrink_after_burst;
pub use operator::{BlockedOn, LiveInvocation, TurnRun, TurnRuns};
pub use sessions_list::{RowDetail, SessionsPage, StuckRule};

type ApiResult<T> = EngineResult<T>;

/// A request's write failed: nothing was changed.
fn unavailable(e: StoreError) -> EngineError {
    EngineError::NotWritten(e)
}

fn read_failed(e: StoreError) -> EngineError {
    EngineError::ReadFailed(e)
}

const MAX_ID_BYTES: usize = 256;

/// A page size asked for (`limit`), or the default: 1 to `PAGE_MAX`.
fn page_limit(limit: Option<u64>) -> ApiResult<u64> {
    match limit.unwrap_or(PAGE_DEFAULT) {
        l @ 1..=PAGE_MAX => Ok(l),
        _ => Err(EngineError::out_of_range(
            "limit",
            format!("1 to {PAGE_MAX}"),
        )),
    }
}

/// Validate a caller-chosen id (session, function, worker, idempotency key).
fn check_id(what: &'static str, s: &str) -> ApiResult<()> {
    if s.is_empty() || s.len() > MAX_ID_BYTES || s.chars().any(|c| c.is_control()) {
        return Err(EngineError::BadId {
            what,
            max: MAX_ID_BYTES,
        });
    }
    Ok(())
}

/// Delay before retrying a failed internal write: starts small, doubles, capped.
const RETRY_FIRST_MS: u64 = 50;
const RETRY_MAX_MS: u64 = 2_000;

struct SessionCell {
    state: tokio::sync::Mutex<SessionState>,
}

struct Watch {
    watch_id: String,
    conn_id: String,
    outbox: Outbox,
    turn_id: Option<String>,
    /// Events up to this `seq` were replayed (or were before the watch began); live
    /// pushes are of later events only.
    sent: u64,
    /// While the watch replays stored events: the last `seq` published meanwhile,
    /// which the replay reads back from the store. `None` once the watch is live.
    replaying: Option<u64>,
}

struct Inner {
    cfg: EngineConfig,
    store: Store,
    clock: Clock,
    boot_id: String,
    /// The sessions in use: a cell leaves when its last user lets it go and the
    /// session has no unfinished turn, no timer and no pending write (`cells.rs`), or
    /// when retention forgets its session. Its next use reads its meta back.
    sessions: Mutex<HashMap<Arc<str>, Arc<SessionCell>>>,
    /// The session of every unfinished turn, by the 128 bits of its id, so
    /// `turn.get` and `turn.wait` find a live turn without a store read (a sled read
    /// waits for any group commit being applied). A hint only: a turn missing here,
    /// or no longer in its session, is read from the store.
    live_turns: Mutex<HashMap<u128, Arc<SessionCell>>>,
    /// Hashes of the ids of every session with a meta in the store at start-up, set
    /// once recovery has read them all. A session missing here, from `evicted` and
    /// from memory has no meta, so its first use reads nothing (a sled read waits
    /// for any group commit being applied). A collision only costs a read.
    stored_sessions: OnceLock<HashSet<u64>>,
    /// Hashes of the ids of sessions with a meta that left memory since start-up
    /// (8 bytes each, the only trace an idle session leaves in memory).
    evicted: Mutex<HashSet<u64>>,
    registry: Mutex<Registry>,
    /// `turn.wait` callers by turn id; sent the turn once it is terminal.
    waiters: Mutex<HashMap<String, Vec<oneshot::Sender<Turn>>>>,
    watches: Mutex<HashMap<String, Vec<Watch>>>,
    counts: Mutex<TurnCounts>,
    counters: Counters,
    storage_error: Mutex<Option<String>>,
    /// What every session's lock holder waits for, ordered for `sessions.list`.
    waits: Mutex<sessions_list::WaitIndex>,
    recovered: AtomicBool,
    shutdown: CancellationToken,
    /// Every session's next deadline.
    timers: Arc<timers::TimerQueue>,
    /// Retention's store reads running at a time (`retention.rs`).
    retention_reads: tokio::sync::Semaphore,
}

/// The engine: owns every session, the worker registry and the timers.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

/// How a caller is identified to the engine.
#[derive(Debug, Clone)]
pub struct Caller {
    pub role: Role,
    /// For workers: their `worker_id`. A worker may only act on invocations
    /// dispatched to it.
    pub worker_id: Option<String>,
}

impl Engine {
    /// Open the engine on a store and recover every non-terminal turn.
    pub async fn open(store: Store, cfg: EngineConfig) -> Result<Engine, StoreError> {
        let engine = Engine {
            inner: Arc::new(Inner {
                cfg,
                store,
                clock: Clock::new(),
                boot_id: uuid::Uuid::new_v4().simple().to_string(),
                sessions: Mutex::new(HashMap::new()),
                live_turns: Mutex::new(HashMap::new()),
                stored_sessions: OnceLock::new(),
                evicted: Mutex::new(HashSet::new()),
                registry: Mutex::new(Registry::default()),
                waiters: Mutex::new(HashMap::new()),
                watches: Mutex::new(HashMap::new()),
                counts: Mutex::new(TurnCounts::default()),
                counters: Counters::default(),
                storage_error: Mutex::new(None),
                waits: Mutex::new(sessions_list::WaitIndex::default()),
                recovered: AtomicBool::new(false),
                shutdown: CancellationToken::new(),
                timers: Arc::default(),
                retention_reads: tokio::sync::Semaphore::new(retention::READS_AT_ONCE),
            }),
        };
        engine.spawn_timers();
        engine.recover().await?;
        engine.spawn_retention();
        engine.spawn_registry_gc();
        Ok(engine)
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.cfg
    }

    pub fn boot_id(&self) -> &str {
        &self.inner.boot_id
    }

    pub fn now_ms(&self) -> u64 {
        self.inner.clock.now_ms()
    }

    pub fn counters(&self) -> &Counters {
        &self.inner.counters
    }

    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    /// True once recovery finished and the last write succeeded.
    pub fn ready(&self) -> bool {
        self.inner.recovered.load(Ordering::SeqCst) && self.storage_health().writable
    }

    pub fn storage_health(&self) -> StorageHealth {
        let last_error = self.inner.storage_error.lock().clone();
        StorageHealth {
            writable: last_error.is_none(),
            last_error,
        }
    }

    /// Stop all timers; the store is synced by its owner.
    pub fn shutdown(&self) {
        self.inner.shutdown.cancel();
        let cells: Vec<_> = self.cells();
        for c in cells {
            if let Ok(mut st) = c.state.try_lock() {
                let old = st.timer.take();
                self.inner.timers.set(&st.id, old, None);
            }
        }
    }

    /// Run `f` every `every` until shutdown (or until the engine is dropped), each run
    /// after the previous one has finished.
    fn every<F, Fut>(&self, every: Duration, f: F)
    where
        F: Fn(Engine) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let weak = Arc::downgrade(&self.inner);
        let shutdown = self.inner.shutdown.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = shutdown.cancelled() => return,
                }
                let Some(inner) = weak.upgrade() else { return };
                f(Engine { inner }).await;
            }
        });
    }

    fn cells(&self) -> Vec<Arc<SessionCell>> {
        self.inner.sessions.lock().values().cloned().collect()
    }

    fn registry(&self) -> parking_lot::MutexGuard<'_, Registry> {
        self.inner.registry.lock()
    }

    /// The session's cell, made (not yet loaded) when it is not in memory. It leaves
    /// memory again when the returned reference is the last one dropped and the
    /// session is idle (`cells.rs`).
    fn cell(&self, session_id: &str) -> cells::CellRef {
        let mut m = self.inner.sessions.lock();
        let cell = match m.get(session_id) {
            Some(cell) => cell.clone(),
            None => {
                let id: Arc<str> = Arc::from(session_id);
                let cell = Arc::new(SessionCell {
                    state: tokio::sync::Mutex::new(SessionState::new(id.clone())),
                });
                m.insert(id, cell.clone());
                cell
            }
        };
        cells::CellRef::new(self, cell)
    }

    fn wait_index(&self) -> parking_lot::MutexGuard<'_, sessions_list::WaitIndex> {
        self.inner.waits.lock()
    }

    fn live_turns(&self) -> parking_lot::MutexGuard<'_, HashMap<u128, Arc<SessionCell>>> {
        self.inner.live_turns.lock()
    }

    /// Keep `live_turns` in step: admitted turns in, ended turns out.
    fn track_live(&self, cell: &Arc<SessionCell>, admitted: &[u128], ended: &[TurnRecord]) {
        if admitted.is_empty() && ended.is_empty() {
            return;
        }
        let mut live = self.live_turns();
        for k in admitted {
            live.insert(*k, cell.clone());
        }
        for t in ended {
            if let Some(k) = turn_id_bits(&t.turn_id) {
                live.remove(&k);
            }
        }
        if !ended.is_empty() {
            shrink_after_burst(&mut live);
        }
    }

    /// Entries in the in-memory index of unfinished turns: as many as there are
    /// unfinished turns (for diagnostics and tests).
    pub fn live_turn_index_len(&self) -> usize {
        self.live_turns().len()
    }

    /// The session cell of an unfinished turn, if `live_turns` knows it.
    fn live_cell(&self, turn_id: &str) -> Option<cells::CellRef> {
        let k = turn_id_bits(turn_id)?;
        let cell = self.live_turns().get(&k).cloned()?;
        Some(cells::CellRef::new(self, cell))
    }

    fn existing_cell(&self, session_id: &str) -> Option<cells::CellRef> {
        let cell = self.inner.sessions.lock().get(session_id).cloned()?;
        Some(cells::CellRef::new(self, cell))
    }

    /// Lock a session, loading its meta from the store on first use.
    async fn lock<'a>(
        &self,
        cell: &'a Arc<SessionCell>,
    ) -> Result<tokio::sync::MutexGuard<'a, SessionState>, StoreError> {
        // The guard borrows the cell, which the caller keeps alive.
        let mut st = cell.state.lock().await;
        if !st.loaded {
            let maybe_stored = self
                .inner
                .stored_sessions
                .get()
                .is_none_or(|known| known.contains(&session_hash(&st.id)))
                || self.was_evicted(&st.id);
            if maybe_stored {
                if let Some(meta) = self.inner.store.session_meta(&st.id)? {
                    st.meta = meta;
                }
            }
            st.loaded = true;
        }
        Ok(st)
    }

    fn fmt_ms(&self) -> impl Fn(u64) -> String + '_ {
        move |ms| fmt_time(ms, self.now_ms())
    }

    fn turn_view(&self, st: &SessionState, t: &TurnRecord) -> Turn {
        let wait = if t.status.is_terminal() {
            None
        } else {
            Some(wait_of(
                st,
                t,
                self.inner.cfg.turns.dispatch_timeout_ms,
                &self.fmt_ms(),
                Some(self.registry().supply(&t.function_id)),
            ))
        };
        to_turn(t, wait)
    }

    // ------------------------------------------------------------------ commit
}

/// A session id's hash for [`Inner::stored_sessions`] (SipHash with fixed keys, so the
/// same throughout the process; a collision only costs a store read).
fn session_hash(session_id: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    session_id.hash(&mut h);
    h.finish()
}

fn push_frame(p: &Push) -> String {
    // Pushes are built from our own types; serialization cannot fail.
    turnd_proto::frame::to_json_text(p, turnd_proto::frame::FRAME_CAPACITY)
        .expect("push frames serialize")
}

/// A Unix-ms time for a reason string: ISO-like UTC plus how long ago or ahead.
pub fn fmt_time(ms: u64, now: u64) -> String {
    let rel = if ms <= now {
        format!("{} ago", fmt_dur(now - ms))
    } else {
        format!("in {}", fmt_dur(ms - now))
    };
    format!("{} ({rel})", fmt_utc(ms))
}

fn fmt_dur(ms: u64) -> String {
    if ms < 1_000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        format!("{:.1}s", ms as f64 / 1000.0)
    } else if ms < 3_600_000 {
        format!("{}m{}s", ms / 60_000, (ms / 1000) % 60)
    } else {
        format!("{}h{}m", ms / 3_600_000, (ms / 60_000) % 60)
    }
}

/// Unix ms as `YYYY-MM-DDTHH:MM:SS.mmmZ`.
pub fn fmt_utc(ms: u64) -> String {
    match time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000) {
        Ok(t) => format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second(),
            t.millisecond()
        ),
        // Past the year 9999: no calendar date to show.
        Err(_) => format!("{ms} ms after the Unix epoch"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_formatting() {
        assert_eq!(fmt_utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(fmt_utc(1_764_480_000_123), "2025-11-30T05:20:00.123Z");
        assert_eq!(fmt_time(1000, 5000), "1970-01-01T00:00:01.000Z (4.0s ago)");
    }
}
