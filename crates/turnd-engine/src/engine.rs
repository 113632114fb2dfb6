//! The engine: the shell around the turn state machine, and the face the network
//! edges call.
//!
//! Every session has one writer: its async mutex. An operation locks the session,
//! builds a transition of the machine on top of the unchanged state, settles its
//! worker slots with the registry, commits the batch through the store's group
//! commit, and only then applies it to memory and carries out its side effects
//! (pushes to workers and watchers, waking `turn.wait`ers, re-arming the session's
//! timer): `engine/transition.rs`. A request whose write fails is answered
//! `unavailable` and changes nothing; an internal transition whose write fails leaves
//! the session `finalizing` and is retried with backoff until written
//! (`engine/drive.rs`).
//!
//! The engine composes parts that each own one thing: the sessions in memory
//! ([`Sessions`]), the shared worker registry ([`Workers`]), the `turn.wait`ers
//! ([`Waiters`]), the watches ([`Watches`]), the wait index behind `sessions.list`
//! and `stats` ([`WaitIndex`]) and the timer queue ([`TimerQueue`]). The files under
//! `engine/` are its operations, grouped by what they answer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};
use tokio_util::sync::CancellationToken;
use turnd_proto::{Role, StorageHealth, TurnCounts, PAGE_DEFAULT, PAGE_MAX};
use turnd_store::{Store, StoreError};

use crate::clock::Clock;
use crate::config::EngineConfig;
pub(crate) use crate::error::check_id;
use crate::error::{EngineError, EngineResult};
use crate::metrics::Counters;
use crate::progress::ProgressTable;
use crate::registry::Registry;
use crate::sessions::Sessions;
use crate::timers::TimerQueue;
use crate::wait_index::WaitIndex;
use crate::waiters::Waiters;
use crate::watches::Watches;
use crate::workers::Workers;

mod drive;
mod hello;
mod operator;
mod progress;
mod queries;
mod recovery;
mod results;
mod resume;
mod retention;
mod sessions_list;
mod stop;
mod submit;
mod transition;
mod watch;

pub use operator::{BlockedOn, LiveInvocation, TurnRun, TurnRuns};
pub use sessions_list::{sessions_cursor, RowDetail, SessionsPage};
pub use submit::SubmitOptions;

type ApiResult<T> = EngineResult<T>;

/// A request's write failed: nothing was changed.
fn unavailable(e: StoreError) -> EngineError {
    EngineError::NotWritten(e)
}

fn read_failed(e: StoreError) -> EngineError {
    EngineError::ReadFailed(e)
}

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

struct Inner {
    cfg: EngineConfig,
    store: Store,
    clock: Clock,
    boot_id: String,
    /// The sessions in use (a cell leaves when its last user lets it go and the
    /// session is idle, or when retention forgets it) and the live-turn index.
    sessions: Arc<Sessions>,
    /// The worker registry, which other engines of the node may share.
    workers: Workers,
    waiters: Waiters,
    watches: Watches,
    /// The progress of every session's live invocation.
    progress: ProgressTable,
    /// What every session's lock holder waits for, ordered for `sessions.list`.
    waits: Mutex<WaitIndex>,
    /// Every session's next deadline.
    timers: Arc<TimerQueue>,
    /// Turns by status over every session (`stats`).
    counts: Mutex<TurnCounts>,
    counters: Counters,
    storage_error: Mutex<Option<String>>,
    recovered: AtomicBool,
    shutdown: CancellationToken,
    /// Retention's store reads running at a time (`retention.rs`).
    retention_reads: tokio::sync::Semaphore,
}

/// The engine: owns every session and the timers, and dispatches to the workers of
/// its registry.
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
    /// Open the engine on a store, with a worker registry of its own, and recover
    /// every non-terminal turn.
    pub async fn open(store: Store, cfg: EngineConfig) -> Result<Engine, StoreError> {
        Engine::open_with(store, cfg, Workers::new()).await
    }

    /// Open the engine on a store dispatching to the workers of `workers`, a
    /// registry other engines of the node may share, and recover every non-terminal
    /// turn. Unless the registry has a wake hook already, the engine sets one that
    /// drives the sessions handed back itself (a node with several engines sets its
    /// own first, handing each session to its engine).
    pub async fn open_with(
        store: Store,
        cfg: EngineConfig,
        workers: Workers,
    ) -> Result<Engine, StoreError> {
        Engine::open_at(store, cfg, workers, Clock::new()).await
    }

    /// [`Engine::open_with`] on `clock` rather than one pinned to the machine's wall
    /// clock: the simulator's engine reads its simulated world's time.
    pub async fn open_at(
        store: Store,
        cfg: EngineConfig,
        workers: Workers,
        clock: Clock,
    ) -> Result<Engine, StoreError> {
        let engine = Engine {
            inner: Arc::new(Inner {
                cfg,
                sessions: Arc::new(Sessions::new(store.clone())),
                store,
                clock,
                boot_id: uuid::Uuid::new_v4().simple().to_string(),
                workers,
                waiters: Waiters::default(),
                watches: Watches::default(),
                progress: ProgressTable::default(),
                waits: Mutex::new(WaitIndex::default()),
                timers: Arc::default(),
                counts: Mutex::new(TurnCounts::default()),
                counters: Counters::default(),
                storage_error: Mutex::new(None),
                recovered: AtomicBool::new(false),
                shutdown: CancellationToken::new(),
                retention_reads: tokio::sync::Semaphore::new(retention::READS_AT_ONCE),
            }),
        };
        engine
            .inner
            .workers
            .on_wake_unless_set(|| engine.drives_woken());
        engine.spawn_timers();
        engine.recover().await?;
        engine.spawn_retention();
        engine.spawn_registry_gc();
        Ok(engine)
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.cfg
    }

    /// Whether this engine holds `session_id`: always, unless it holds one partition
    /// of a cluster's sessions ([`crate::config::Partition`]).
    pub fn owns_session(&self, session_id: &str) -> bool {
        self.inner
            .cfg
            .partition
            .is_none_or(|p| turnd_proto::session_partition(session_id, p.count) == p.index)
    }

    /// Whether this engine holds the session of `invocation_id` (by the partition the
    /// id names; always without partitions).
    pub fn owns_invocation(&self, invocation_id: &str) -> bool {
        self.inner
            .cfg
            .partition
            .is_none_or(|p| turnd_proto::invocation_partition(invocation_id) == Some(p.index))
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

    /// The worker registry this engine dispatches through, to share with another
    /// engine ([`Engine::open_with`]).
    pub fn worker_registry(&self) -> &Workers {
        &self.inner.workers
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
        for c in self.sessions().all() {
            if let Ok(mut st) = c.state.try_lock() {
                let old = st.timer.take();
                self.inner.timers.set(&st.id, old, None);
            }
        }
    }

    /// Whether [`Engine::shutdown`] was called.
    pub fn is_shut_down(&self) -> bool {
        self.inner.shutdown.is_cancelled()
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

    fn sessions(&self) -> &Arc<Sessions> {
        &self.inner.sessions
    }

    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.inner.workers.registry()
    }

    /// Sessions whose state is in memory (for `/metrics`).
    pub fn sessions_in_memory(&self) -> usize {
        self.sessions().len()
    }

    /// The ids of the sessions whose state is in memory, sorted: which ones
    /// [`Engine::sessions_in_memory`] counts (for tests and diagnostics; read-only).
    pub fn session_ids_in_memory(&self) -> Vec<String> {
        self.sessions().ids()
    }

    /// Entries in the in-memory index of unfinished turns: as many as there are
    /// unfinished turns (for diagnostics and tests).
    pub fn live_turn_index_len(&self) -> usize {
        self.sessions().live_len()
    }

    /// Watches held by every connection (for `/metrics`).
    pub fn watch_count(&self) -> usize {
        self.inner.watches.count()
    }

    /// Live invocations that may send progress (for `/metrics`).
    pub fn progress_live_count(&self) -> usize {
        self.inner.progress.len()
    }

    /// `turn.wait` requests registered for a turn's end (for `/metrics`).
    pub fn turn_wait_count(&self) -> usize {
        self.inner.waiters.count()
    }
}
