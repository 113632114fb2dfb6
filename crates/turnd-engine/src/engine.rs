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

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use turnd_proto::*;
use turnd_store::{
    check_store, FunctionSettings, IdempotencyRecord, InvState, InvWait, InvocationRecord, Phase,
    RawJson, SessionMeta, Store, StoreError, TurnRecord,
};

mod retention;

use crate::clock::Clock;
use crate::config::EngineConfig;
use crate::metrics::Counters;
use crate::registry::{Assignment, CloseReason, Outbox, Registry};
use crate::session::{
    dispatch_detail, to_turn, wait_of, Effect, Pending, SessionState, Summary, Tx,
};

#[path = "sessions_list.rs"]
mod sessions_list;
pub use sessions_list::{BlockedOn, LiveInvocation};

type ApiResult<T> = Result<T, ErrorBody>;

fn err(code: ErrorCode, msg: impl Into<String>) -> ErrorBody {
    ErrorBody::new(code, msg)
}

fn unavailable(e: &StoreError) -> ErrorBody {
    err(
        ErrorCode::Unavailable,
        format!("{e}; nothing was changed, retry later"),
    )
}

fn read_failed(e: StoreError) -> ErrorBody {
    err(ErrorCode::Unavailable, format!("{e}"))
}

const MAX_ID_BYTES: usize = 256;

/// Validate a caller-chosen id (session, function, worker, idempotency key).
fn check_id(what: &str, s: &str) -> ApiResult<()> {
    if s.is_empty() || s.len() > MAX_ID_BYTES || s.chars().any(|c| c.is_control()) {
        return Err(err(
            ErrorCode::BadRequest,
            format!("`{what}` must be 1 to {MAX_ID_BYTES} bytes with no control characters"),
        ));
    }
    Ok(())
}

/// Delay before retrying a failed internal write: starts small, doubles, capped.
const RETRY_FIRST_MS: u64 = 50;
const RETRY_MAX_MS: u64 = 2_000;

struct SessionCell {
    state: tokio::sync::Mutex<SessionState>,
    summary: Mutex<Option<Summary>>,
}

struct Watch {
    watch_id: String,
    conn_id: String,
    outbox: Outbox,
    turn_id: Option<String>,
}

struct Inner {
    cfg: EngineConfig,
    store: Store,
    clock: Clock,
    boot_id: String,
    /// Every session used since start-up. A cell leaves only when retention forgets
    /// its session, after deleting its meta from the store (`retention.rs`): any other
    /// session evicted from here would be taken for a new one by `stored_sessions`
    /// and reuse its `seq`s.
    sessions: Mutex<HashMap<String, Arc<SessionCell>>>,
    /// The session of every unfinished turn, by the 128 bits of its id, so
    /// `turn.get` and `turn.wait` find a live turn without a store read (a sled read
    /// waits for any group commit being applied). A hint only: a turn missing here,
    /// or no longer in its session, is read from the store.
    live_turns: Mutex<HashMap<u128, Arc<SessionCell>>>,
    /// Hashes of the ids of every session with a meta in the store at start-up, set
    /// once recovery has read them all. A session missing here and not yet in memory
    /// has no meta (every session used since start-up stays in memory), so its first
    /// use reads nothing (a sled read waits for any group commit being applied). A
    /// collision only costs a read.
    stored_sessions: OnceLock<HashSet<u64>>,
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
                registry: Mutex::new(Registry::default()),
                waiters: Mutex::new(HashMap::new()),
                watches: Mutex::new(HashMap::new()),
                counts: Mutex::new(TurnCounts::default()),
                counters: Counters::default(),
                storage_error: Mutex::new(None),
                waits: Mutex::new(sessions_list::WaitIndex::default()),
                recovered: AtomicBool::new(false),
                shutdown: CancellationToken::new(),
            }),
        };
        engine.recover().await?;
        engine.spawn_retention();
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
        let last_error = self.inner.storage_error.lock().ok().and_then(|e| e.clone());
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
                if let Some((_, h)) = st.timer.take() {
                    h.abort();
                }
            }
        }
    }

    fn cells(&self) -> Vec<Arc<SessionCell>> {
        self.inner
            .sessions
            .lock()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        // The registry holds plain data and no code that can panic while it is
        // locked; a poisoned lock still holds consistent data.
        self.inner
            .registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    fn cell(&self, session_id: &str) -> Arc<SessionCell> {
        let mut m = self
            .inner
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        m.entry(session_id.to_string())
            .or_insert_with(|| {
                Arc::new(SessionCell {
                    state: tokio::sync::Mutex::new(SessionState::new(session_id)),
                    summary: Mutex::new(None),
                })
            })
            .clone()
    }

    fn wait_index(&self) -> std::sync::MutexGuard<'_, sessions_list::WaitIndex> {
        // Plain data: a poisoned lock still holds a usable index.
        self.inner.waits.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn live_turns(&self) -> std::sync::MutexGuard<'_, HashMap<u128, Arc<SessionCell>>> {
        // Plain data: a poisoned lock still holds a usable map.
        self.inner
            .live_turns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
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
    }

    /// Entries in the in-memory index of unfinished turns: as many as there are
    /// unfinished turns (for diagnostics and tests).
    pub fn live_turn_index_len(&self) -> usize {
        self.live_turns().len()
    }

    /// The session cell of an unfinished turn, if `live_turns` knows it.
    fn live_cell(&self, turn_id: &str) -> Option<Arc<SessionCell>> {
        let k = turn_id_bits(turn_id)?;
        self.live_turns().get(&k).cloned()
    }

    fn existing_cell(&self, session_id: &str) -> Option<Arc<SessionCell>> {
        self.inner
            .sessions
            .lock()
            .ok()
            .and_then(|m| m.get(session_id).cloned())
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
                .is_none_or(|known| known.contains(&session_hash(&st.id)));
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
                self.inner.cfg.dispatch_timeout_ms,
                &self.fmt_ms(),
                Some(self.registry().supply(&t.function_id)),
            ))
        };
        to_turn(t, wait)
    }

    // ------------------------------------------------------------------ commit

    /// Commit a transaction and apply it. On failure nothing in memory changed and
    /// every slot the transaction reserved or freed is put back.
    async fn commit(
        &self,
        cell: &Arc<SessionCell>,
        st: &mut SessionState,
        mut tx: Tx,
    ) -> Result<(), StoreError> {
        if tx.is_empty() && tx.idempotency.is_none() {
            self.after_change(cell, st, Vec::new());
            return Ok(());
        }
        let batch = tx.batch(st);
        match self.inner.store.commit(batch).await {
            Ok(()) => {
                if let Ok(mut e) = self.inner.storage_error.lock() {
                    *e = None;
                }
                let released: Vec<String> = tx.released.iter().map(|r| r.3.clone()).collect();
                let applied = tx.apply(st);
                if let Ok(mut c) = self.inner.counts.lock() {
                    for (from, to) in &applied.shifts {
                        c.shift(*from, *to);
                    }
                }
                for e in &applied.events {
                    self.count_event(e);
                }
                for eff in applied.effects {
                    match eff {
                        Effect::Push(outbox, frame) => {
                            if !outbox.push(frame) {
                                tracing::debug!(conn_id = %outbox.conn_id, "push to a closed or full connection");
                            }
                        }
                    }
                }
                self.publish(&st.id, &applied.events);
                self.track_live(cell, &applied.admitted, &applied.terminal);
                self.notify_terminal(&applied.terminal);
                self.after_change(cell, st, released);
                Ok(())
            }
            Err(e) => {
                Counters::inc(&self.inner.counters.write_failures);
                if let Ok(mut le) = self.inner.storage_error.lock() {
                    *le = Some(e.to_string());
                }
                let mut reg = self.registry();
                for (worker_id, inv_id) in &tx.reserved {
                    reg.release(worker_id, inv_id);
                }
                for (worker_id, instance_id, inv_id, function_id) in &tx.released {
                    reg.remember_assignment(
                        worker_id,
                        instance_id,
                        inv_id,
                        Assignment {
                            session_id: st.id.clone(),
                            function_id: function_id.clone(),
                        },
                        tx.now,
                    );
                }
                Err(e)
            }
        }
    }

    /// Log a durable event with the identity fields every turn log line carries.
    fn log_event(&self, e: &Event) {
        let d = &e.detail;
        let step = d.get("step").and_then(Value::as_u64);
        let attempt = d.get("attempt").and_then(Value::as_u64);
        let inv = d.get("invocation_id").and_then(Value::as_str).unwrap_or("");
        let kind = serde_json::to_value(e.kind).unwrap_or(Value::Null);
        let kind = kind.as_str().unwrap_or("");
        macro_rules! log {
            ($lvl:ident) => {
                tracing::$lvl!(
                    session_id = %e.session_id,
                    turn_id = %e.turn_id,
                    step,
                    attempt,
                    invocation_id = inv,
                    seq = e.seq,
                    event = kind,
                    detail = %d,
                    "turn event"
                )
            };
        }
        match e.kind {
            EventKind::Failed
            | EventKind::OutcomeUnknown
            | EventKind::LateResult
            | EventKind::Amended
            | EventKind::Redispatched => log!(warn),
            EventKind::Completed
            | EventKind::Cancelled
            | EventKind::StopRequested
            | EventKind::ProbeSent
            | EventKind::CancelSent
            | EventKind::RetryScheduled => log!(info),
            EventKind::Admitted | EventKind::Dispatched | EventKind::Result => log!(debug),
        }
    }

    fn count_event(&self, e: &Event) {
        self.log_event(e);
        let c = &self.inner.counters;
        match e.kind {
            EventKind::Admitted => Counters::inc(&c.admissions),
            EventKind::Dispatched => Counters::inc(&c.dispatches),
            EventKind::Redispatched => Counters::inc(&c.redispatches),
            EventKind::ProbeSent => Counters::inc(&c.probes_sent),
            EventKind::OutcomeUnknown => Counters::inc(&c.outcome_unknown),
            EventKind::Amended => Counters::inc(&c.amendments),
            EventKind::RetryScheduled => Counters::inc(&c.retries_scheduled),
            EventKind::CancelSent => Counters::inc(&c.cancels_sent),
            EventKind::StopRequested => Counters::inc(&c.stops),
            EventKind::Completed => c.terminal("completed".into()),
            EventKind::Cancelled => c.terminal("cancelled".into()),
            EventKind::Failed => {
                let cause = e
                    .detail
                    .get("error")
                    .and_then(|x| x.get("cause"))
                    .and_then(Value::as_str)
                    .unwrap_or("unknown");
                c.terminal(format!("failed:{cause}"));
            }
            EventKind::Result | EventKind::LateResult => {}
        }
    }

    /// After any change: wake sessions waiting for freed capacity, update the
    /// session's summary and re-arm its timer.
    fn after_change(&self, cell: &SessionCell, st: &mut SessionState, freed: Vec<String>) {
        for f in freed {
            self.wake(&f);
        }
        let entry = sessions_list::WaitEntry::of(st, self.inner.cfg.dispatch_timeout_ms);
        let summary = entry.as_ref().map(|e| Summary {
            state: e.state,
            since_ms: e.since_ms,
            inflight: st.inv.is_some(),
        });
        if let Ok(mut s) = cell.summary.lock() {
            *s = summary;
        }
        self.wait_index().set(&st.id, entry);
        {
            let mut reg = self.registry();
            match st.holder() {
                Some(h) if matches!(h.phase, Phase::Queued | Phase::AwaitingWorker) => {
                    reg.wait_for(&h.function_id, &st.id)
                }
                _ => reg.not_waiting(&st.id),
            }
        }
        self.arm(st);
    }

    /// The next time something is due for this session.
    fn next_due(&self, st: &SessionState) -> Option<u64> {
        if let Some(p) = &st.pending {
            return Some(p.retry_at_ms);
        }
        let h = st.holder()?;
        let mut due = h.deadline_ms;
        let mut consider = |x: Option<u64>| {
            if let Some(x) = x {
                due = Some(due.map_or(x, |d| d.min(x)));
            }
        };
        match h.phase {
            Phase::Queued | Phase::AwaitingWorker => consider(
                self.inner
                    .cfg
                    .dispatch_timeout_ms
                    .map(|d| h.phase_since_ms + d),
            ),
            Phase::BackingOff => consider(h.retry_at_ms),
            Phase::Invoked => consider(st.inv.as_ref().map(|i| i.deadline_ms)),
            Phase::Done => {}
        }
        due
    }

    fn arm(&self, st: &mut SessionState) {
        let due = self.next_due(st);
        if let (Some(d), Some((at, _))) = (due, &st.timer) {
            if *at == d {
                return;
            }
        }
        if let Some((_, h)) = st.timer.take() {
            h.abort();
        }
        let Some(due) = due else { return };
        if self.inner.shutdown.is_cancelled() {
            return;
        }
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let sid = st.id.clone();
        let at = self.inner.clock.instant_at(due);
        let handle = tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            if let Some(inner) = weak.upgrade() {
                let engine = Engine { inner };
                engine.drive_timer(&sid).await;
            }
        });
        st.timer = Some((due, handle.abort_handle()));
    }

    /// Spawn a drive of a session (used where the caller must not wait for it).
    fn spawn_drive(&self, session_id: String) {
        let engine = self.clone();
        tokio::spawn(async move { engine.drive(&session_id).await });
    }

    fn wake(&self, function_id: &str) {
        let sessions = {
            let mut reg = self.registry();
            let free = reg.free_capacity(function_id);
            reg.take_waiting(function_id, free)
        };
        for s in sessions {
            self.spawn_drive(s);
        }
    }

    async fn drive_timer(&self, session_id: &str) {
        let Some(cell) = self.existing_cell(session_id) else {
            return;
        };
        {
            // The timer task is the one being replaced; forget it before driving so
            // arm() does not abort the running task.
            let mut st = cell.state.lock().await;
            st.timer = None;
        }
        self.drive(session_id).await;
    }

    /// Do whatever is due for a session, until nothing is.
    pub async fn drive(&self, session_id: &str) {
        let cell = self.cell(session_id);
        let mut st = match self.lock(&cell).await {
            Ok(st) => st,
            Err(e) => {
                tracing::error!(session_id, "failed to load session: {e}");
                return;
            }
        };
        for _ in 0..16 {
            let now = self.now_ms();
            if let Some(p) = &st.pending {
                if p.retry_at_ms > now {
                    break;
                }
            }
            let mut tx = Tx::new(&st, now);
            self.due(&st, &mut tx);
            if tx.is_empty() {
                st.pending = None;
                self.after_change(&cell, &mut st, Vec::new());
                break;
            }
            if let Err(e) = self.commit(&cell, &mut st, tx).await {
                let delay = st
                    .pending
                    .as_ref()
                    .map(|p| (p.delay_ms * 2).min(RETRY_MAX_MS))
                    .unwrap_or(RETRY_FIRST_MS);
                let since = st.pending.as_ref().map(|p| p.since_ms).unwrap_or(now);
                tracing::warn!(
                    session_id,
                    delay_ms = delay,
                    "failed to write a state change, retrying: {e}"
                );
                st.pending = Some(Pending {
                    error: e.to_string(),
                    since_ms: since,
                    retry_at_ms: now + delay,
                    delay_ms: delay,
                });
                self.after_change(&cell, &mut st, Vec::new());
                break;
            }
        }
    }

    // ------------------------------------------------------------- transitions

    /// Build the transition that is due now for the session, if any.
    fn due(&self, st: &SessionState, tx: &mut Tx) {
        let now = tx.now;
        let Some(h) = tx.holder_seq(st).and_then(|s| tx.take(st, s)) else {
            return;
        };
        if h.deadline_ms.map(|d| d <= now).unwrap_or(false) && h.stop.is_some() {
            // Stopped before its own deadline passed: the stop is what ends it.
            if let Some(inv) = tx.live(st).cloned() {
                self.send_cancel(tx, &inv, "stop requested");
                self.give_up(st, tx, inv, InvState::Abandoned);
            }
            self.cancel_turn(st, tx, h, None);
            return;
        }
        if h.deadline_ms.map(|d| d <= now).unwrap_or(false) {
            let inv = tx.live(st).cloned();
            if let Some(inv) = &inv {
                self.send_cancel(tx, inv, "the turn's deadline passed");
                self.give_up(st, tx, inv.clone(), InvState::TimedOut);
            }
            self.fail(
                st,
                tx,
                h,
                ErrorCause::TimedOut,
                "turn_timeout",
                "the turn's deadline (turn_timeout_ms) passed".into(),
                inv.map(|i| i.invocation_id),
            );
            return;
        }
        match h.phase {
            Phase::Queued | Phase::AwaitingWorker => {
                let since = if h.phase == Phase::Queued {
                    now
                } else {
                    h.phase_since_ms
                };
                if let Some(d) = self.inner.cfg.dispatch_timeout_ms {
                    if since + d <= now {
                        let f = h.function_id.clone();
                        self.fail(
                            st,
                            tx,
                            h,
                            ErrorCause::NoWorker,
                            "no_worker",
                            format!("no worker served {f} within dispatch_timeout_ms ({d} ms)"),
                            None,
                        );
                        return;
                    }
                }
                self.dispatch(st, tx, h, None);
            }
            Phase::BackingOff => {
                if h.retry_at_ms.map(|r| r <= now).unwrap_or(true) {
                    self.dispatch(st, tx, h, None);
                }
            }
            Phase::Invoked => {
                let Some(inv) = tx.live(st).cloned() else {
                    // The dispatch record is missing: the invocation was never written,
                    // so it was never sent. Dispatch again.
                    self.dispatch(st, tx, h, None);
                    return;
                };
                let connected = self
                    .registry()
                    .is_connected(&inv.worker_id, &inv.instance_id);
                if !connected && inv.wait == InvWait::Cancelling && h.stop.is_some() {
                    // Stopped, and the worker is gone: nothing can answer the cancel.
                    self.give_up(st, tx, inv, InvState::Abandoned);
                    self.cancel_turn(st, tx, h, None);
                    return;
                }
                if !connected
                    && matches!(
                        inv.wait,
                        InvWait::AwaitingResult | InvWait::Probing | InvWait::AwaitingResend
                    )
                {
                    let mut inv = inv;
                    inv.wait = InvWait::AwaitingReconnect;
                    inv.wait_since_ms = now;
                    inv.deadline_ms = now + self.inner.cfg.reconnect_grace_ms;
                    tx.put_invocation(st, inv);
                    return;
                }
                if inv.deadline_ms > now {
                    return;
                }
                match inv.wait {
                    InvWait::AwaitingResult => {
                        let mut inv = inv;
                        inv.wait = InvWait::Probing;
                        inv.wait_since_ms = now;
                        inv.deadline_ms = now + self.inner.cfg.probe_timeout_ms;
                        tx.event(
                            &st.id,
                            &h.turn_id,
                            EventKind::ProbeSent,
                            json!({"invocation_id": inv.invocation_id, "worker_id": inv.worker_id, "deadline_ms": inv.deadline_ms}),
                        );
                        if let Some(o) = self.registry().outbox_of(&inv.worker_id, &inv.instance_id) {
                            let frame = push_frame(&Push::Probe {
                                invocation_id: inv.invocation_id.clone(),
                            });
                            tx.effects.push(Effect::Push(o, frame));
                        }
                        tx.put_invocation(st, inv);
                    }
                    InvWait::Probing => {
                        self.outcome_unknown(st, tx, h, inv, "no answer to the probe within probe_timeout_ms")
                    }
                    InvWait::AwaitingResend => self.outcome_unknown(
                        st,
                        tx,
                        h,
                        inv,
                        "the worker reported the invocation finished but its result did not arrive within probe_timeout_ms",
                    ),
                    InvWait::AwaitingReconnect => self.outcome_unknown(
                        st,
                        tx,
                        h,
                        inv,
                        "the worker did not reconnect within reconnect_grace_ms",
                    ),
                    InvWait::Cancelling => {
                        if h.stop.is_some() {
                            self.give_up(st, tx, inv, InvState::Abandoned);
                            self.cancel_turn(st, tx, h, None);
                        } else {
                            self.timed_out(st, tx, h, inv);
                        }
                    }
                }
            }
            Phase::Done => {}
        }
    }

    /// Mark an invocation given up (or finished) and free its slot now, so the same
    /// worker can take the session's next dispatch in this transaction.
    fn give_up(&self, st: &SessionState, tx: &mut Tx, mut inv: InvocationRecord, state: InvState) {
        inv.state = state;
        inv.ended_at_ms = Some(tx.now);
        if self
            .registry()
            .release(&inv.worker_id, &inv.invocation_id)
            .is_some()
        {
            tx.released.push((
                inv.worker_id.clone(),
                inv.instance_id.clone(),
                inv.invocation_id.clone(),
                inv.function_id.clone(),
            ));
        }
        tx.put_invocation(st, inv);
    }

    fn send_cancel(&self, tx: &mut Tx, inv: &InvocationRecord, reason: &str) {
        if let Some(o) = self.registry().outbox_of(&inv.worker_id, &inv.instance_id) {
            let frame = push_frame(&Push::Cancel {
                invocation_id: inv.invocation_id.clone(),
                reason: reason.to_string(),
            });
            tx.effects.push(Effect::Push(o, frame));
        }
    }

    /// Dispatch the current step of turn `h` (its attempt is the next one unless
    /// `previous` names a lost invocation whose attempt is reused).
    fn dispatch(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        mut h: TurnRecord,
        previous: Option<(&InvocationRecord, &str)>,
    ) {
        let inv_id = new_invocation_id();
        let reservation = self.registry().reserve(&h.function_id, &inv_id, &st.id);
        let Some(r) = reservation else {
            if h.phase != Phase::AwaitingWorker {
                h.phase = Phase::AwaitingWorker;
                h.phase_since_ms = tx.now;
            }
            h.retry_at_ms = None;
            if let Some((prev, _)) = previous {
                // A redispatch that found no worker: the next dispatch (attempt + 1)
                // uses the attempt number the redispatch would have used.
                h.attempt = prev.attempt.saturating_sub(1);
            }
            if tx.turn(st, h.seq) != Some(&h) {
                tx.put_turn(st, h);
            }
            return;
        };
        tx.reserved.push((r.worker_id.clone(), inv_id.clone()));
        let attempt = match previous {
            Some((prev, _)) => prev.attempt,
            None => h.attempt + 1,
        };
        let now = tx.now;
        let inv = InvocationRecord {
            invocation_id: inv_id.clone(),
            turn_id: h.turn_id.clone(),
            session_id: st.id.clone(),
            function_id: h.function_id.clone(),
            step: h.step,
            attempt,
            worker_id: r.worker_id.clone(),
            instance_id: r.instance_id.clone(),
            settings: r.settings,
            state: InvState::Active,
            wait: InvWait::AwaitingResult,
            wait_since_ms: now,
            deadline_ms: now + r.settings.timeout_ms,
            attempt_deadline_ms: now + r.settings.timeout_ms,
            dispatched_at_ms: now,
            ended_at_ms: None,
            outcome: None,
            late: false,
        };
        let (kind, detail) = match previous {
            Some((prev, reason)) => (
                EventKind::Redispatched,
                dispatch_detail(&inv, Some(&prev.invocation_id), Some(reason)),
            ),
            None => (EventKind::Dispatched, dispatch_detail(&inv, None, None)),
        };
        tx.event(&st.id, &h.turn_id, kind, detail);
        let frame = push_frame(&Push::Invoke(Invoke {
            invocation_id: inv_id.clone(),
            function_id: h.function_id.clone(),
            session_id: st.id.clone(),
            turn_id: h.turn_id.clone(),
            step: h.step,
            attempt,
            input: h.state().to_value(),
            deadline_ms: inv.deadline_ms,
        }));
        tx.effects.push(Effect::Push(r.outbox, frame));
        h.status = TurnStatus::Running;
        h.phase = Phase::Invoked;
        h.phase_since_ms = now;
        h.attempt = attempt;
        h.invocation_id = Some(inv_id);
        h.retry_at_ms = None;
        h.settings = Some(r.settings);
        tx.put_turn(st, h);
        tx.put_invocation(st, inv);
    }

    /// Make the next queued turn the lock holder and dispatch it if a worker is free.
    fn promote(&self, st: &SessionState, tx: &mut Tx) {
        if let Some(seq) = tx.holder_seq(st) {
            if let Some(h) = tx.take(st, seq) {
                if h.phase == Phase::Queued {
                    let mut h = h;
                    h.phase = Phase::AwaitingWorker;
                    h.phase_since_ms = tx.now;
                    h.locked_at_ms = Some(tx.now);
                    if h.deadline_ms.map(|d| d <= tx.now).unwrap_or(false) {
                        self.fail(
                            st,
                            tx,
                            h,
                            ErrorCause::TimedOut,
                            "turn_timeout",
                            "the turn's deadline (turn_timeout_ms) passed while it was queued"
                                .into(),
                            None,
                        );
                        return;
                    }
                    self.dispatch(st, tx, h, None);
                }
            }
        }
    }

    fn terminal(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        mut h: TurnRecord,
        status: TurnStatus,
        detail: Value,
    ) {
        let kind = match status {
            TurnStatus::Completed => EventKind::Completed,
            TurnStatus::Failed => EventKind::Failed,
            _ => EventKind::Cancelled,
        };
        h.status = status;
        h.phase = Phase::Done;
        h.phase_since_ms = tx.now;
        h.finished_at_ms = Some(tx.now);
        h.retry_at_ms = None;
        tx.event(&st.id, &h.turn_id, kind, detail);
        tx.put_turn(st, h);
        self.promote(st, tx);
    }

    #[allow(clippy::too_many_arguments)]
    fn fail(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        mut h: TurnRecord,
        cause: ErrorCause,
        code: &str,
        message: String,
        invocation_id: Option<String>,
    ) {
        let error = TurnError {
            cause,
            code: code.to_string(),
            message,
            step: h.step,
            invocation_id,
        };
        let detail = json!({ "error": error, "step": h.step });
        h.error = Some(error);
        self.terminal(st, tx, h, TurnStatus::Failed, detail);
    }

    fn complete(&self, st: &SessionState, tx: &mut Tx, mut h: TurnRecord, output: RawJson) {
        h.output = output.non_null();
        let detail = json!({ "step": h.step });
        self.terminal(st, tx, h, TurnStatus::Completed, detail);
    }

    /// Cancel a turn. A turn without a stop record (its worker cancelled on its own)
    /// gets one that says so: every cancelled turn says why.
    fn cancel_turn(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        mut h: TurnRecord,
        worker_message: Option<&str>,
    ) {
        if h.stop.is_none() {
            h.stop = Some(StopInfo {
                requested_at_ms: tx.now,
                reason: format!(
                    "cancelled by the worker: {}",
                    worker_message
                        .filter(|m| !m.is_empty())
                        .unwrap_or("no message")
                ),
            });
        }
        let detail = json!({ "stop": h.stop, "step": h.step });
        self.terminal(st, tx, h, TurnStatus::Cancelled, detail);
    }

    /// Rule 4 of the semantics: an attempt whose outcome is unknown.
    fn outcome_unknown(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        h: TurnRecord,
        inv: InvocationRecord,
        reason: &str,
    ) {
        tx.event(
            &st.id,
            &h.turn_id,
            EventKind::OutcomeUnknown,
            json!({"invocation_id": inv.invocation_id, "worker_id": inv.worker_id, "step": inv.step, "attempt": inv.attempt, "reason": reason}),
        );
        let settings = inv.settings;
        let inv_id = inv.invocation_id.clone();
        self.give_up(st, tx, inv.clone(), InvState::Unknown);
        if h.stop.is_some() {
            self.cancel_turn(st, tx, h, None);
        } else if settings.delivery == Delivery::AtLeastOnce {
            if inv.attempt < settings.max_attempts {
                let mut next = inv;
                next.attempt += 1;
                self.dispatch(st, tx, h, Some((&next, reason)));
            } else {
                self.fail(
                    st,
                    tx,
                    h,
                    ErrorCause::AttemptsExhausted,
                    "outcome_unknown",
                    format!("outcome of the last attempt is unknown ({reason}) and all {} attempts are used", settings.max_attempts),
                    Some(inv_id),
                );
            }
        } else {
            self.fail(
                st,
                tx,
                h,
                ErrorCause::OutcomeUnknown,
                "outcome_unknown",
                format!(
                    "outcome of {inv_id} is unknown: {reason}; at_most_once never runs it again"
                ),
                Some(inv_id),
            );
        }
    }

    /// The attempt ran past its deadline and did not answer the cancel in time.
    fn timed_out(&self, st: &SessionState, tx: &mut Tx, mut h: TurnRecord, inv: InvocationRecord) {
        let settings = inv.settings;
        let inv_id = inv.invocation_id.clone();
        let attempt = inv.attempt;
        self.give_up(st, tx, inv, InvState::TimedOut);
        let message = format!("{inv_id} was still running past its deadline and did not answer the cancel within cancel_grace_ms");
        if settings.delivery == Delivery::AtLeastOnce && attempt < settings.max_attempts {
            h.last_error = Some(message.clone());
            self.schedule_retry(st, tx, h, &inv_id, message);
        } else {
            self.fail(
                st,
                tx,
                h,
                ErrorCause::TimedOut,
                "timed_out",
                message,
                Some(inv_id),
            );
        }
    }

    fn schedule_retry(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        mut h: TurnRecord,
        inv_id: &str,
        error: String,
    ) {
        let cfg = &self.inner.cfg;
        let delay = if h.backoff_ms == 0 {
            cfg.retry_backoff_ms
        } else {
            h.backoff_ms
        };
        h.backoff_ms = (delay.saturating_mul(2)).min(cfg.retry_backoff_max_ms);
        h.phase = Phase::BackingOff;
        h.phase_since_ms = tx.now;
        h.retry_at_ms = Some(tx.now + delay);
        h.last_error = Some(error.clone());
        tx.event(
            &st.id,
            &h.turn_id,
            EventKind::RetryScheduled,
            json!({"invocation_id": inv_id, "delay_ms": delay, "retry_at_ms": tx.now + delay, "error": error, "next_attempt": h.attempt + 1}),
        );
        tx.put_turn(st, h);
    }

    /// Apply the outcome of the live invocation to the lock holder.
    fn apply_outcome(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        mut h: TurnRecord,
        inv: InvocationRecord,
        outcome: Outcome,
    ) {
        let max_value = self.inner.cfg.max_value_bytes;
        tx.event(
            &st.id,
            &h.turn_id,
            EventKind::Result,
            json!({"invocation_id": inv.invocation_id, "outcome": outcome.kind(), "step": inv.step, "attempt": inv.attempt}),
        );
        let settings = inv.settings;
        let inv_id = inv.invocation_id.clone();
        let mut done = inv.clone();
        done.outcome = Some(outcome.kind().to_string());
        self.give_up(st, tx, done, InvState::Finished);
        let stopped = h.stop.is_some();
        // A step's value is serialized once, for the size limit and for the record.
        let too_large = |v: &RawJson| v.len() as u64 > max_value;
        let fail_too_large = |tx: &mut Tx, h: TurnRecord, inv_id: String| {
            self.fail(
                st,
                tx,
                h,
                ErrorCause::InvalidResult,
                "too_large",
                format!("the step's result is larger than max_value_bytes ({max_value})"),
                Some(inv_id),
            );
        };
        match outcome {
            Outcome::Complete(v) => {
                let output = RawJson::from_value(&v);
                if too_large(&output) {
                    fail_too_large(tx, h, inv_id);
                } else {
                    self.complete(st, tx, h, output);
                }
            }
            Outcome::Continue(v) => {
                let state = RawJson::from_value(&v);
                if too_large(&state) {
                    fail_too_large(tx, h, inv_id);
                } else if stopped {
                    self.cancel_turn(st, tx, h, None);
                } else if h.step + 1 >= self.inner.cfg.max_steps {
                    let max = self.inner.cfg.max_steps;
                    self.fail(
                        st,
                        tx,
                        h,
                        ErrorCause::StepLimit,
                        "step_limit",
                        format!("the turn reached max_steps ({max})"),
                        Some(inv_id),
                    );
                } else {
                    h.step += 1;
                    h.attempt = 0;
                    h.backoff_ms = 0;
                    h.state = Some(state);
                    h.last_error = None;
                    h.phase = Phase::AwaitingWorker;
                    h.phase_since_ms = tx.now;
                    self.dispatch(st, tx, h, None);
                }
            }
            Outcome::Fail(f) => {
                let msg = if f.message.is_empty() {
                    f.code.clone()
                } else {
                    format!("{}: {}", f.code, f.message)
                };
                if f.retryable && !stopped && inv.attempt < settings.max_attempts {
                    self.schedule_retry(st, tx, h, &inv_id, msg);
                } else {
                    let cause = if f.retryable && !stopped {
                        ErrorCause::AttemptsExhausted
                    } else {
                        ErrorCause::HandlerFailed
                    };
                    let message = if cause == ErrorCause::AttemptsExhausted {
                        format!("{msg} (after {} attempts)", inv.attempt)
                    } else {
                        f.message.clone()
                    };
                    h.last_error = None;
                    self.fail(st, tx, h, cause, &f.code, message, Some(inv_id));
                }
            }
            Outcome::Cancelled(c) => self.cancel_turn(st, tx, h, Some(&c.message)),
        }
    }

    // ------------------------------------------------------------------ client

    /// `turn.submit`.
    pub async fn submit(&self, args: SubmitArgs) -> ApiResult<SubmitOk> {
        check_id("session_id", &args.session_id)?;
        check_id("function_id", &args.function_id)?;
        if let Some(k) = &args.idempotency_key {
            check_id("idempotency_key", k)?;
        }
        let max = self.inner.cfg.max_value_bytes;
        let input = RawJson::from_value(&args.input);
        if input.len() as u64 > max {
            return Err(err(
                ErrorCode::TooLarge,
                format!("`input` is larger than max_value_bytes ({max})"),
            ));
        }
        if args.turn_timeout_ms == Some(0) {
            return Err(err(
                ErrorCode::BadRequest,
                "`turn_timeout_ms` must be positive",
            ));
        }
        let cell = self.cell(&args.session_id);
        let mut st = self.lock(&cell).await.map_err(read_failed)?;
        if let Some(key) = &args.idempotency_key {
            if let Some(rec) = self
                .inner
                .store
                .idempotency(&args.session_id, key)
                .map_err(read_failed)?
            {
                let t = self
                    .turn_record_locked(&st, &rec.turn_id)
                    .map_err(read_failed)?
                    .ok_or_else(|| {
                        err(
                            ErrorCode::Internal,
                            format!("idempotency key names missing turn {}", rec.turn_id),
                        )
                    })?;
                if t.function_id != args.function_id || t.input.to_value() != args.input {
                    return Err(err(
                        ErrorCode::Conflict,
                        format!("idempotency key {key:?} was used for turn {} with a different function_id or input", t.turn_id),
                    ));
                }
                Counters::inc(&self.inner.counters.deduplicated);
                return Ok(SubmitOk {
                    turn: self.turn_view(&st, &t),
                    deduplicated: true,
                });
            }
        }
        if st.active.len() as u64 >= self.inner.cfg.max_queued_per_session {
            return Err(err(
                ErrorCode::RateLimited,
                format!(
                    "session {} already holds {} unfinished turns (max_queued_per_session)",
                    st.id,
                    st.active.len()
                ),
            ));
        }
        let now = self.now_ms();
        let mut tx = Tx::new(&st, now);
        tx.meta.last_turn_seq += 1;
        let seq = tx.meta.last_turn_seq;
        let turn_id = new_turn_id();
        let mut t =
            TurnRecord::admitted(turn_id.clone(), &st.id, seq, &args.function_id, input, now);
        t.idempotency_key = args.idempotency_key.clone();
        t.deadline_ms = args.turn_timeout_ms.map(|d| now + d);
        tx.event(
            &st.id,
            &turn_id,
            EventKind::Admitted,
            json!({"function_id": t.function_id, "seq": seq, "idempotency_key": t.idempotency_key}),
        );
        if let Some(key) = args.idempotency_key {
            tx.idempotency = Some((
                key,
                IdempotencyRecord {
                    turn_id: turn_id.clone(),
                },
            ));
        }
        tx.put_turn_from(t, None);
        self.promote(&st, &mut tx);
        self.commit(&cell, &mut st, tx)
            .await
            .map_err(|e| unavailable(&e))?;
        let t = self
            .turn_record_locked(&st, &turn_id)
            .map_err(read_failed)?
            .ok_or_else(|| err(ErrorCode::Internal, "admitted turn vanished"))?;
        Ok(SubmitOk {
            turn: self.turn_view(&st, &t),
            deduplicated: false,
        })
    }

    /// A turn as the session (locked) knows it: from memory if non-terminal, else
    /// from the store.
    fn turn_record_locked(
        &self,
        st: &SessionState,
        turn_id: &str,
    ) -> Result<Option<TurnRecord>, StoreError> {
        if let Some(t) = st.find(turn_id) {
            return Ok(Some(t.clone()));
        }
        self.inner.store.turn(turn_id)
    }

    /// A turn's stored record, or `not_found`.
    fn stored_turn(&self, turn_id: &str) -> ApiResult<TurnRecord> {
        check_id("turn_id", turn_id)?;
        self.inner
            .store
            .turn(turn_id)
            .map_err(read_failed)?
            .ok_or_else(|| err(ErrorCode::NotFound, format!("no turn {turn_id} exists")))
    }

    /// `turn.get`.
    pub async fn get_turn(&self, turn_id: &str) -> ApiResult<Turn> {
        // A live turn's id is one this daemon minted, so only ids that pass
        // `check_id` (in `stored_turn`) can be found here.
        if let Some(cell) = self.live_cell(turn_id) {
            let st = self.lock(&cell).await.map_err(read_failed)?;
            if let Some(t) = st.find(turn_id) {
                return Ok(self.turn_view(&st, t));
            }
            // It ended while we waited for the lock: the store has it.
        }
        let rec = self.stored_turn(turn_id)?;
        if rec.status.is_terminal() {
            return Ok(to_turn(&rec, None));
        }
        let cell = self.cell(&rec.session_id);
        let st = self.lock(&cell).await.map_err(read_failed)?;
        let t = self
            .turn_record_locked(&st, turn_id)
            .map_err(read_failed)?
            .unwrap_or(rec);
        Ok(self.turn_view(&st, &t))
    }

    /// `turn.wait`.
    pub async fn wait_turn(&self, turn_id: &str, timeout_ms: Option<u64>) -> ApiResult<Turn> {
        let timeout = timeout_ms.unwrap_or(WAIT_DEFAULT_MS);
        if timeout > WAIT_MAX_MS {
            return Err(err(
                ErrorCode::BadRequest,
                format!("`timeout_ms` must be at most {WAIT_MAX_MS}"),
            ));
        }
        let (tx, rx) = oneshot::channel();
        if let Ok(mut w) = self.inner.waiters.lock() {
            w.entry(turn_id.to_string()).or_default().push(tx);
        }
        let t = self.get_turn(turn_id).await;
        let t = match t {
            Ok(t) if !t.status.is_terminal() => t,
            other => {
                self.prune_waiters(turn_id);
                return other;
            }
        };
        let done = tokio::select! {
            t = rx => t.ok(),
            _ = tokio::time::sleep(Duration::from_millis(timeout)) => None,
            _ = self.inner.shutdown.cancelled() => None,
        };
        self.prune_waiters(turn_id);
        // The terminal turn comes with the notice, as committed; otherwise (timeout,
        // shutdown) the turn as it stands now.
        if let Some(done) = done {
            return Ok(done);
        }
        match self.get_turn(turn_id).await {
            Ok(t) => Ok(t),
            Err(e) if e.code == ErrorCode::NotFound => Ok(t),
            Err(e) => Err(e),
        }
    }

    fn prune_waiters(&self, turn_id: &str) {
        if let Ok(mut w) = self.inner.waiters.lock() {
            if let Some(v) = w.get_mut(turn_id) {
                v.retain(|s| !s.is_closed());
                if v.is_empty() {
                    w.remove(turn_id);
                }
            }
        }
    }

    fn notify_terminal(&self, turns: &[TurnRecord]) {
        if turns.is_empty() {
            return;
        }
        if let Ok(mut w) = self.inner.waiters.lock() {
            for t in turns {
                if let Some(v) = w.remove(&t.turn_id) {
                    let turn = to_turn(t, None);
                    for s in v {
                        // A waiter that gave up needs no notice.
                        if s.send(turn.clone()).is_err() {
                            tracing::trace!(turn_id = %t.turn_id, "turn.wait caller already gone");
                        }
                    }
                }
            }
        }
    }

    /// `turn.stop`.
    pub async fn stop_turn(&self, turn_id: &str, reason: Option<String>) -> ApiResult<Turn> {
        let rec = self.stored_turn(turn_id)?;
        let cell = self.cell(&rec.session_id);
        let mut st = self.lock(&cell).await.map_err(read_failed)?;
        let Some(t) = st.find(turn_id).cloned() else {
            // Terminal already: nothing changes.
            let t = self
                .inner
                .store
                .turn(turn_id)
                .map_err(read_failed)?
                .unwrap_or(rec);
            return Ok(to_turn(&t, None));
        };
        if t.stop.is_some() {
            return Ok(self.turn_view(&st, &t));
        }
        let now = self.now_ms();
        let mut tx = Tx::new(&st, now);
        self.stop_one(&st, &mut tx, t.seq, reason.unwrap_or_default());
        self.commit(&cell, &mut st, tx)
            .await
            .map_err(|e| unavailable(&e))?;
        let t = self
            .turn_record_locked(&st, turn_id)
            .map_err(read_failed)?
            .ok_or_else(|| err(ErrorCode::Internal, "stopped turn vanished"))?;
        Ok(self.turn_view(&st, &t))
    }

    /// Stop one non-terminal turn within a transaction.
    fn stop_one(&self, st: &SessionState, tx: &mut Tx, seq: u64, reason: String) {
        let Some(mut t) = tx.take(st, seq) else {
            return;
        };
        if t.status.is_terminal() || t.stop.is_some() {
            return;
        }
        let reason = if reason.is_empty() {
            "stop requested".to_string()
        } else {
            reason
        };
        t.stop = Some(StopInfo {
            requested_at_ms: tx.now,
            reason: reason.clone(),
        });
        tx.event(
            &st.id,
            &t.turn_id,
            EventKind::StopRequested,
            json!({"reason": reason}),
        );
        let is_holder = tx.holder_seq(st) == Some(seq);
        let live = if is_holder {
            tx.live(st).cloned()
        } else {
            None
        };
        match live {
            Some(inv) if t.phase == Phase::Invoked => {
                let connected = self
                    .registry()
                    .is_connected(&inv.worker_id, &inv.instance_id);
                if connected && inv.wait != InvWait::AwaitingReconnect {
                    let mut inv = inv;
                    if inv.wait != InvWait::Cancelling {
                        inv.wait = InvWait::Cancelling;
                        inv.wait_since_ms = tx.now;
                        inv.deadline_ms = tx.now + self.inner.cfg.cancel_grace_ms;
                    }
                    self.send_cancel(tx, &inv, &reason);
                    tx.event(
                        &st.id,
                        &t.turn_id,
                        EventKind::CancelSent,
                        json!({"invocation_id": inv.invocation_id, "worker_id": inv.worker_id, "reason": reason, "deadline_ms": inv.deadline_ms}),
                    );
                    tx.put_invocation(st, inv);
                    tx.put_turn(st, t);
                } else {
                    // Waiting for a reconnect: cancelled at once, the invocation abandoned;
                    // a result that still arrives is a late result.
                    self.give_up(st, tx, inv, InvState::Abandoned);
                    self.cancel_turn(st, tx, t, None);
                }
            }
            _ => {
                if is_holder {
                    self.cancel_turn(st, tx, t, None);
                } else {
                    // A queued turn behind the holder: cancelled at once, never dispatched.
                    let detail = json!({"stop": t.stop, "step": t.step});
                    t.status = TurnStatus::Cancelled;
                    t.phase = Phase::Done;
                    t.finished_at_ms = Some(tx.now);
                    tx.event(&st.id, &t.turn_id, EventKind::Cancelled, detail);
                    tx.put_turn(st, t);
                }
            }
        }
    }

    /// `session.stop`.
    pub async fn stop_session(
        &self,
        session_id: &str,
        reason: Option<String>,
    ) -> ApiResult<Vec<Turn>> {
        check_id("session_id", session_id)?;
        let cell = self.cell(session_id);
        let mut st = self.lock(&cell).await.map_err(read_failed)?;
        if st.meta.last_turn_seq == 0 {
            return Err(err(
                ErrorCode::NotFound,
                format!("no session {session_id} exists"),
            ));
        }
        let now = self.now_ms();
        let mut tx = Tx::new(&st, now);
        let seqs: Vec<u64> = st.active.seqs().collect();
        let reason = reason.unwrap_or_default();
        // Queued turns first, newest first, so stopping the holder promotes nothing.
        for seq in seqs.iter().rev() {
            self.stop_one(&st, &mut tx, *seq, reason.clone());
        }
        let ids: Vec<String> = st.active.iter().map(|t| t.turn_id.clone()).collect();
        self.commit(&cell, &mut st, tx)
            .await
            .map_err(|e| unavailable(&e))?;
        let mut out = Vec::new();
        for id in ids {
            if let Some(t) = self.turn_record_locked(&st, &id).map_err(read_failed)? {
                out.push(self.turn_view(&st, &t));
            }
        }
        Ok(out)
    }

    /// `turn.list`.
    pub async fn list_turns(&self, args: ListArgs) -> ApiResult<ListOk> {
        check_id("session_id", &args.session_id)?;
        let limit = args.limit.unwrap_or(PAGE_DEFAULT);
        if limit == 0 || limit > PAGE_MAX {
            return Err(err(
                ErrorCode::BadRequest,
                format!("`limit` must be 1 to {PAGE_MAX}"),
            ));
        }
        let cell = self.cell(&args.session_id);
        let st = self.lock(&cell).await.map_err(read_failed)?;
        let mut before = args.before_seq.unwrap_or(u64::MAX);
        let mut out = Vec::new();
        let mut more = true;
        while out.len() < limit as usize && more {
            let ids = self
                .inner
                .store
                .session_turn_ids(&args.session_id, before, 256)
                .map_err(read_failed)?;
            more = ids.len() == 256;
            for (seq, id) in ids {
                before = seq;
                let Some(t) = self.turn_record_locked(&st, &id).map_err(read_failed)? else {
                    continue;
                };
                if args.status.map(|s| s == t.status).unwrap_or(true) {
                    out.push(self.turn_view(&st, &t));
                    if out.len() == limit as usize {
                        more = seq > 1;
                        break;
                    }
                }
            }
        }
        let next = if more && before > 1 {
            out.last().map(|t| t.seq)
        } else {
            None
        };
        Ok(ListOk {
            turns: out,
            next_before_seq: next,
        })
    }

    /// `session.inspect`.
    pub async fn inspect(&self, session_id: &str) -> ApiResult<Session> {
        check_id("session_id", session_id)?;
        let cell = self.cell(session_id);
        let st = self.lock(&cell).await.map_err(read_failed)?;
        if st.meta.last_turn_seq == 0 {
            return Err(err(
                ErrorCode::NotFound,
                format!("no session {session_id} exists"),
            ));
        }
        let fmt = self.fmt_ms();
        let lock = st.holder().map(|h| SessionLock {
            turn_id: h.turn_id.clone(),
            since_ms: h.locked_at_ms.unwrap_or(h.created_at_ms),
            wait: wait_of(
                &st,
                h,
                self.inner.cfg.dispatch_timeout_ms,
                &fmt,
                Some(self.registry().supply(&h.function_id)),
            ),
        });
        let queued = st
            .active
            .iter()
            .skip(1)
            .map(|t| QueuedTurn {
                turn_id: t.turn_id.clone(),
                seq: t.seq,
                function_id: t.function_id.clone(),
                created_at_ms: t.created_at_ms,
            })
            .collect();
        Ok(Session {
            session_id: session_id.to_string(),
            lock,
            queued,
            turns: st.meta.counts.clone(),
            last_event: st.meta.last_event_seq,
        })
    }

    /// `session.events`.
    pub async fn events(&self, args: EventsArgs) -> ApiResult<EventsOk> {
        check_id("session_id", &args.session_id)?;
        let limit = args.limit.unwrap_or(PAGE_DEFAULT);
        if limit == 0 || limit > PAGE_MAX {
            return Err(err(
                ErrorCode::BadRequest,
                format!("`limit` must be 1 to {PAGE_MAX}"),
            ));
        }
        let after = args.after.unwrap_or(0);
        let meta = self
            .inner
            .store
            .session_meta(&args.session_id)
            .map_err(read_failed)?;
        if meta.is_none() {
            return Err(err(
                ErrorCode::NotFound,
                format!("no session {} exists", args.session_id),
            ));
        }
        let events = self
            .inner
            .store
            .events(&args.session_id, after, limit as usize)
            .map_err(read_failed)?;
        let next = events.last().map(|e| e.seq).unwrap_or(after);
        Ok(EventsOk { events, next })
    }

    /// `watch`: replays events after `after` (when given), then pushes every new
    /// event once, in order. `respond` builds the response frame, which is queued
    /// before any event so the peer learns the watch id first.
    pub async fn watch(
        &self,
        args: WatchArgs,
        outbox: &Outbox,
        max_watches: usize,
        respond: impl FnOnce(&WatchOk) -> String,
    ) -> ApiResult<()> {
        let (session_id, turn_id) = match (&args.session_id, &args.turn_id) {
            (Some(s), None) => {
                check_id("session_id", s)?;
                (s.clone(), None)
            }
            (None, Some(t)) => {
                let rec = self.stored_turn(t)?;
                (rec.session_id, Some(t.clone()))
            }
            _ => {
                return Err(err(
                    ErrorCode::BadRequest,
                    "give exactly one of `session_id` and `turn_id`",
                ))
            }
        };
        {
            let w = self
                .inner
                .watches
                .lock()
                .map_err(|_| err(ErrorCode::Internal, "watch table poisoned"))?;
            let mine = w
                .values()
                .flatten()
                .filter(|x| x.conn_id == outbox.conn_id)
                .count();
            if mine >= max_watches {
                return Err(err(
                    ErrorCode::RateLimited,
                    format!("at most {max_watches} watches per connection"),
                ));
            }
        }
        let cell = self.cell(&session_id);
        let st = self.lock(&cell).await.map_err(read_failed)?;
        let watch_id = new_watch_id();
        let replay = match args.after {
            Some(after) => self
                .inner
                .store
                .events(&session_id, after, usize::MAX)
                .map_err(read_failed)?,
            None => Vec::new(),
        };
        if !outbox
            .send(respond(&WatchOk {
                watch_id: watch_id.clone(),
            }))
            .await
        {
            return Ok(());
        }
        for e in replay {
            if turn_id.as_ref().map(|t| *t == e.turn_id).unwrap_or(true) {
                outbox.push(push_frame(&Push::Event {
                    watch_id: watch_id.clone(),
                    event: e,
                }));
            }
        }
        if let Ok(mut w) = self.inner.watches.lock() {
            w.entry(session_id).or_default().push(Watch {
                watch_id,
                conn_id: outbox.conn_id.clone(),
                outbox: outbox.clone(),
                turn_id,
            });
        }
        drop(st);
        Ok(())
    }

    /// `unwatch`.
    pub fn unwatch(&self, conn_id: &str, watch_id: &str) -> ApiResult<()> {
        let mut w = self
            .inner
            .watches
            .lock()
            .map_err(|_| err(ErrorCode::Internal, "watch table poisoned"))?;
        let mut found = false;
        for v in w.values_mut() {
            let before = v.len();
            v.retain(|x| !(x.watch_id == watch_id && x.conn_id == conn_id));
            found |= v.len() != before;
        }
        w.retain(|_, v| !v.is_empty());
        if found {
            Ok(())
        } else {
            Err(err(
                ErrorCode::NotFound,
                format!("no watch {watch_id} on this connection"),
            ))
        }
    }

    fn publish(&self, session_id: &str, events: &[Event]) {
        if events.is_empty() {
            return;
        }
        let Ok(w) = self.inner.watches.lock() else {
            return;
        };
        let Some(subs) = w.get(session_id) else {
            return;
        };
        for sub in subs {
            for e in events {
                if sub
                    .turn_id
                    .as_ref()
                    .map(|t| *t == e.turn_id)
                    .unwrap_or(true)
                {
                    sub.outbox.push(push_frame(&Push::Event {
                        watch_id: sub.watch_id.clone(),
                        event: e.clone(),
                    }));
                }
            }
        }
    }

    /// A connection ended: drop its watches.
    pub fn connection_closed(&self, conn_id: &str) {
        if let Ok(mut w) = self.inner.watches.lock() {
            for v in w.values_mut() {
                v.retain(|x| x.conn_id != conn_id);
            }
            w.retain(|_, v| !v.is_empty());
        }
    }

    /// `stats`.
    pub fn stats(&self) -> Stats {
        let now = self.now_ms();
        let mut blocked = std::collections::BTreeMap::new();
        let mut active = 0;
        let mut inflight = 0;
        let mut oldest: Option<u64> = None;
        for c in self.cells() {
            let s = c.summary.lock().ok().and_then(|s| *s);
            if let Some(s) = s {
                active += 1;
                if s.inflight {
                    inflight += 1;
                }
                *blocked.entry(s.state.as_str().to_string()).or_insert(0u64) += 1;
                let age = now.saturating_sub(s.since_ms);
                oldest = Some(oldest.map_or(age, |o| o.max(age)));
            }
        }
        let reg = self.registry();
        Stats {
            sessions: SessionStats { active, blocked },
            turns: self
                .inner
                .counts
                .lock()
                .map(|c| c.clone())
                .unwrap_or_default(),
            invocations_inflight: inflight,
            workers_connected: reg.connected_count(),
            oldest_wait_ms: oldest,
            storage: self.storage_health(),
        }
    }

    pub fn workers(&self) -> Vec<Worker> {
        self.registry().workers()
    }

    pub fn functions(&self) -> Vec<Function> {
        self.registry().functions()
    }

    /// `store.check`.
    pub fn check(&self) -> ApiResult<Vec<Violation>> {
        check_store(&self.inner.store).map_err(read_failed)
    }

    // ------------------------------------------------------------------ worker

    /// A worker `hello`: attach the connection (superseding an older one of the same
    /// worker_id) and reconcile every invocation assigned to this worker_id.
    pub async fn worker_hello(&self, hello: &HelloArgs, outbox: Outbox) -> ApiResult<Reconciled> {
        let worker_id = hello
            .worker_id
            .as_deref()
            .ok_or_else(|| err(ErrorCode::BadRequest, "a worker `hello` needs `worker_id`"))?;
        check_id("worker_id", worker_id)?;
        let instance_id = hello
            .instance_id
            .clone()
            .unwrap_or_else(|| outbox.conn_id.clone());
        let name = hello.name.clone().unwrap_or_else(|| worker_id.to_string());
        let conn_id = outbox.conn_id.clone();
        let attached =
            self.registry()
                .attach(worker_id, &name, &instance_id, outbox, self.now_ms());
        if let Some(old) = attached.superseded {
            tracing::info!(worker_id, old_conn = %old.conn_id, "worker connection superseded by a new hello");
            old.close_with(CloseReason::Superseded);
        }
        match self.reconcile(hello, &instance_id, attached.assigned).await {
            Ok(rec) => Ok(rec),
            Err(e) => {
                // The hello is refused: the connection must not stay attached.
                self.worker_disconnected(worker_id, &conn_id).await;
                Err(e)
            }
        }
    }

    /// Reconcile every invocation assigned to a worker_id that said hello.
    async fn reconcile(
        &self,
        hello: &HelloArgs,
        instance_id: &str,
        assigned: Vec<(String, Assignment)>,
    ) -> ApiResult<Reconciled> {
        let mut rec = Reconciled::default();
        for (inv_id, a) in assigned {
            let cell = self.cell(&a.session_id);
            let mut st = self.lock(&cell).await.map_err(read_failed)?;
            let Some(inv) = st.current_inv(&inv_id).cloned() else {
                continue;
            };
            let Some(h) = st.holder().cloned() else {
                continue;
            };
            let now = self.now_ms();
            let mut tx = Tx::new(&st, now);
            let verdict;
            if inv.instance_id == instance_id {
                if hello.inflight.contains(&inv_id) {
                    let mut inv = inv;
                    if inv.wait == InvWait::Cancelling {
                        self.send_cancel(&mut tx, &inv, "stop requested");
                    } else {
                        // Kept: the attempt's own deadline applies again (a deadline that
                        // passed while it was away leads to a probe at once).
                        inv.wait = InvWait::AwaitingResult;
                        inv.wait_since_ms = now;
                        inv.deadline_ms = inv.attempt_deadline_ms.max(now);
                    }
                    tx.put_invocation(&st, inv);
                    verdict = 0;
                } else if hello.finished.contains(&inv_id) {
                    let mut inv = inv;
                    inv.wait = InvWait::AwaitingResend;
                    inv.wait_since_ms = now;
                    inv.deadline_ms = now + self.inner.cfg.probe_timeout_ms;
                    tx.put_invocation(&st, inv);
                    verdict = 0;
                } else {
                    self.lost(
                        &st,
                        &mut tx,
                        h,
                        inv,
                        "the worker reconnected without it: it never received the invocation",
                    );
                    verdict = 1;
                }
            } else {
                self.outcome_unknown(
                    &st,
                    &mut tx,
                    h,
                    inv,
                    "the worker restarted (new instance_id) while the invocation was outstanding",
                );
                verdict = 2;
            }
            self.commit(&cell, &mut st, tx)
                .await
                .map_err(|e| unavailable(&e))?;
            match verdict {
                0 => rec.kept.push(inv_id),
                1 => rec.redispatched.push(inv_id),
                _ => rec.unknown.push(inv_id),
            }
        }
        // Work the worker still runs that the daemon already gave up (stopped while
        // it was away, outcome unknown, superseded): tell it to stop, and list it.
        let worker_id = hello.worker_id.as_deref().unwrap_or("");
        for inv_id in &hello.inflight {
            if rec.kept.contains(inv_id)
                || rec.redispatched.contains(inv_id)
                || rec.unknown.contains(inv_id)
            {
                continue;
            }
            let Ok(Some(inv)) = self.inner.store.invocation(inv_id) else {
                continue;
            };
            if inv.worker_id != worker_id || inv.is_active() {
                continue;
            }
            if let Some(o) = self.registry().outbox_of(worker_id, instance_id) {
                let frame = push_frame(&Push::Cancel {
                    invocation_id: inv_id.clone(),
                    reason: format!(
                        "the invocation was given up ({}) while the worker was away",
                        inv.state.as_str()
                    ),
                });
                if !o.push(frame) {
                    tracing::debug!(invocation_id = %inv_id, "cancel for a given-up invocation not queued");
                }
            }
            rec.unknown.push(inv_id.clone());
        }
        Ok(rec)
    }

    /// An invocation the worker never received: dispatch again with the same attempt.
    fn lost(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        h: TurnRecord,
        inv: InvocationRecord,
        reason: &str,
    ) {
        self.give_up(st, tx, inv.clone(), InvState::Lost);
        if h.stop.is_some() {
            self.cancel_turn(st, tx, h, None);
        } else {
            self.dispatch(st, tx, h, Some((&inv, reason)));
        }
    }

    /// A worker connection ended: every session with an invocation on it re-checks
    /// its worker (and starts waiting for the reconnect).
    pub async fn worker_disconnected(&self, worker_id: &str, conn_id: &str) {
        let sessions = {
            let mut reg = self.registry();
            if !reg.detach(worker_id, conn_id, self.now_ms()) {
                return;
            }
            reg.assigned_sessions(worker_id)
        };
        for s in sessions {
            self.drive(&s).await;
        }
    }

    /// `function.register`.
    pub fn register(&self, worker_id: &str, args: &RegisterArgs) -> ApiResult<RegisterOk> {
        check_id("function_id", &args.function_id)?;
        let concurrency = args.concurrency.unwrap_or(1);
        if concurrency == 0 || concurrency > 10_000 {
            return Err(err(
                ErrorCode::BadRequest,
                "`concurrency` must be 1 to 10000",
            ));
        }
        let timeout_ms = args.timeout_ms.unwrap_or(self.inner.cfg.default_timeout_ms);
        if timeout_ms == 0 {
            return Err(err(ErrorCode::BadRequest, "`timeout_ms` must be positive"));
        }
        let delivery = args.delivery.unwrap_or_default();
        let max_attempts = args.max_attempts.unwrap_or(delivery.default_max_attempts());
        if max_attempts == 0 || max_attempts > 1000 {
            return Err(err(
                ErrorCode::BadRequest,
                "`max_attempts` must be 1 to 1000",
            ));
        }
        let workers = self.registry().register(
            worker_id,
            &args.function_id,
            concurrency,
            FunctionSettings {
                timeout_ms,
                delivery,
                max_attempts,
            },
        );
        self.wake(&args.function_id);
        Ok(RegisterOk {
            function_id: args.function_id.clone(),
            workers,
        })
    }

    /// `function.unregister`.
    pub fn unregister(&self, worker_id: &str, function_id: &str) -> ApiResult<()> {
        if self.registry().unregister(worker_id, function_id) {
            Ok(())
        } else {
            Err(err(
                ErrorCode::NotFound,
                format!("function {function_id} is not registered on this connection"),
            ))
        }
    }

    /// Look up an invocation and check the caller may act on it.
    fn invocation_for(
        &self,
        caller: &Caller,
        invocation_id: &str,
    ) -> ApiResult<Option<InvocationRecord>> {
        check_id("invocation_id", invocation_id)?;
        let Some(inv) = self
            .inner
            .store
            .invocation(invocation_id)
            .map_err(read_failed)?
        else {
            return Ok(None);
        };
        if let Some(w) = &caller.worker_id {
            if caller.role == Role::Worker && inv.worker_id != *w {
                return Err(err(
                    ErrorCode::Forbidden,
                    format!("invocation {invocation_id} was not dispatched to worker {w}"),
                ));
            }
        }
        Ok(Some(inv))
    }

    /// Whether `invocation_id` is live and dispatched to `worker_id` (a registry
    /// lookup; no store read).
    pub fn is_assigned(&self, worker_id: &str, invocation_id: &str) -> bool {
        self.registry()
            .assigned_session(worker_id, invocation_id)
            .is_some()
    }

    /// Keep only the invocation ids that are live and dispatched to `worker_id`.
    pub fn retain_assigned(&self, worker_id: &str, ids: &mut HashSet<String>) {
        let registry = self.registry();
        ids.retain(|id| registry.assigned_session(worker_id, id).is_some());
    }

    /// The session of an invocation the caller may act on (`None`: no such
    /// invocation). A worker's own live invocation is found in the registry's
    /// assignments, which also prove it may report it, without a store read (a sled
    /// read waits for any group commit being applied); anything else is looked up in
    /// the store by [`Engine::invocation_for`].
    fn invocation_session(
        &self,
        caller: &Caller,
        invocation_id: &str,
    ) -> ApiResult<Option<String>> {
        if let (Role::Worker, Some(w)) = (caller.role, caller.worker_id.as_deref()) {
            if let Some(s) = self.registry().assigned_session(w, invocation_id) {
                return Ok(Some(s));
            }
        }
        Ok(self
            .invocation_for(caller, invocation_id)?
            .map(|rec| rec.session_id))
    }

    /// Apply the outcome of the session's current invocation and commit it.
    async fn apply_current_result(
        &self,
        cell: &Arc<SessionCell>,
        st: &mut SessionState,
        outcome: Outcome,
    ) -> ApiResult<ResultOk> {
        let inv = st
            .inv
            .as_deref()
            .cloned()
            .ok_or_else(|| err(ErrorCode::Internal, "live invocation vanished"))?;
        let h = st
            .holder()
            .cloned()
            .ok_or_else(|| err(ErrorCode::Internal, "live invocation without a lock holder"))?;
        let mut tx = Tx::new(st, self.now_ms());
        self.apply_outcome(st, &mut tx, h, inv, outcome);
        self.commit(cell, st, tx)
            .await
            .map_err(|e| unavailable(&e))?;
        Counters::inc(&self.inner.counters.results_applied);
        Ok(ResultOk {
            accepted: Accepted::Applied,
        })
    }

    /// `invocation.result`.
    pub async fn result(&self, caller: &Caller, args: ResultArgs) -> ApiResult<ResultOk> {
        let unknown = || {
            Counters::inc(&self.inner.counters.results_unknown);
            Ok(ResultOk {
                accepted: Accepted::Unknown,
            })
        };
        let Some(session_id) = self.invocation_session(caller, &args.invocation_id)? else {
            return unknown();
        };
        let cell = self.cell(&session_id);
        let mut st = self.lock(&cell).await.map_err(read_failed)?;
        if st.current_inv(&args.invocation_id).is_some() {
            return self
                .apply_current_result(&cell, &mut st, args.outcome)
                .await;
        }
        // Not current: read its record under the lock, it may have ended while we
        // waited.
        let Some(rec) = self
            .inner
            .store
            .invocation(&args.invocation_id)
            .map_err(read_failed)?
        else {
            return unknown();
        };
        let now = self.now_ms();
        if rec.state == InvState::Finished || rec.late {
            Counters::inc(&self.inner.counters.results_duplicate);
            return Ok(ResultOk {
                accepted: Accepted::Duplicate,
            });
        }
        if rec.state == InvState::Active {
            return Err(err(
                ErrorCode::Internal,
                format!(
                    "invocation {} is active but not its session's current one",
                    rec.invocation_id
                ),
            ));
        }
        // A late result: recorded as evidence, and it amends an outcome_unknown failure
        // that names exactly this invocation when the late outcome is `complete`.
        let mut tx = Tx::new(&st, now);
        let mut late = rec.clone();
        late.late = true;
        tx.put_invocation(&st, late);
        tx.event(
            &st.id,
            &rec.turn_id,
            EventKind::LateResult,
            json!({"invocation_id": rec.invocation_id, "outcome": args.outcome.kind(), "invocation_state": rec.state.as_str(), "step": rec.step, "attempt": rec.attempt}),
        );
        if let Outcome::Complete(output) = &args.outcome {
            if let Some(t) = self.inner.store.turn(&rec.turn_id).map_err(read_failed)? {
                let names_it = t.status == TurnStatus::Failed
                    && t.error
                        .as_ref()
                        .map(|e| {
                            e.cause == ErrorCause::OutcomeUnknown
                                && e.invocation_id.as_deref() == Some(&rec.invocation_id)
                        })
                        .unwrap_or(false);
                let output = RawJson::from_value(output);
                if names_it && output.len() as u64 <= self.inner.cfg.max_value_bytes {
                    let before = json!({"status": t.status, "error": t.error});
                    let mut amended = t.clone();
                    amended.status = TurnStatus::Completed;
                    amended.output = output.non_null();
                    amended.recovered = true;
                    amended.error = None;
                    tx.event(
                        &st.id,
                        &t.turn_id,
                        EventKind::Amended,
                        json!({"invocation_id": rec.invocation_id, "before": before, "after": {"status": "completed", "recovered": true}}),
                    );
                    tx.put_turn_from(amended, Some(TurnStatus::Failed));
                }
            }
        }
        self.commit(&cell, &mut st, tx)
            .await
            .map_err(|e| unavailable(&e))?;
        Counters::inc(&self.inner.counters.results_late);
        Ok(ResultOk {
            accepted: Accepted::Late,
        })
    }

    /// `invocation.heartbeat`.
    pub async fn heartbeat(&self, caller: &Caller, invocation_id: &str) -> ApiResult<HeartbeatOk> {
        let not_current = || {
            err(
                ErrorCode::NotFound,
                format!("invocation {invocation_id} is not current; stop it"),
            )
        };
        let session_id = self
            .invocation_session(caller, invocation_id)?
            .ok_or_else(not_current)?;
        let cell = self.cell(&session_id);
        let mut st = self.lock(&cell).await.map_err(read_failed)?;
        let Some(inv) = st.current_inv(invocation_id).cloned() else {
            return Err(not_current());
        };
        if matches!(inv.wait, InvWait::Cancelling | InvWait::AwaitingResend) {
            return Ok(HeartbeatOk {
                deadline_ms: inv.deadline_ms,
            });
        }
        let now = self.now_ms();
        let mut tx = Tx::new(&st, now);
        let mut inv = inv;
        if inv.wait != InvWait::AwaitingResult {
            inv.wait = InvWait::AwaitingResult;
            inv.wait_since_ms = now;
        }
        inv.deadline_ms = now + inv.settings.timeout_ms;
        inv.attempt_deadline_ms = inv.deadline_ms;
        let deadline_ms = inv.deadline_ms;
        tx.put_invocation(&st, inv);
        self.commit(&cell, &mut st, tx)
            .await
            .map_err(|e| unavailable(&e))?;
        Ok(HeartbeatOk { deadline_ms })
    }

    /// `invocation.status`: a worker's answer to a probe.
    pub async fn status(&self, caller: &Caller, args: &StatusArgs) -> ApiResult<()> {
        let session_id = self
            .invocation_session(caller, &args.invocation_id)?
            .ok_or_else(|| {
                err(
                    ErrorCode::NotFound,
                    format!("no invocation {} exists", args.invocation_id),
                )
            })?;
        let label = match args.state {
            InvocationState::Running => "running",
            InvocationState::Finished => "finished",
            InvocationState::Unknown => "unknown",
        };
        self.inner.counters.probe_answer(label);
        let cell = self.cell(&session_id);
        let mut st = self.lock(&cell).await.map_err(read_failed)?;
        let Some(inv) = st
            .current_inv(&args.invocation_id)
            .filter(|i| i.wait == InvWait::Probing)
            .cloned()
        else {
            // Not probing this invocation (any more): a stale status changes nothing.
            return Ok(());
        };
        let Some(h) = st.holder().cloned() else {
            return Ok(());
        };
        let now = self.now_ms();
        let mut tx = Tx::new(&st, now);
        match args.state {
            InvocationState::Finished => {
                let mut inv = inv;
                inv.wait = InvWait::AwaitingResend;
                inv.wait_since_ms = now;
                inv.deadline_ms = now + self.inner.cfg.probe_timeout_ms;
                tx.put_invocation(&st, inv);
            }
            InvocationState::Unknown => {
                self.lost(
                    &st,
                    &mut tx,
                    h,
                    inv,
                    "the worker never received the invocation (probe answered unknown)",
                );
            }
            InvocationState::Running => {
                let mut inv = inv;
                inv.wait = InvWait::Cancelling;
                inv.wait_since_ms = now;
                inv.deadline_ms = now + self.inner.cfg.cancel_grace_ms;
                let reason = "the attempt ran past its deadline";
                self.send_cancel(&mut tx, &inv, reason);
                tx.event(
                    &st.id,
                    &h.turn_id,
                    EventKind::CancelSent,
                    json!({"invocation_id": inv.invocation_id, "worker_id": inv.worker_id, "reason": reason, "deadline_ms": inv.deadline_ms}),
                );
                tx.put_invocation(&st, inv);
            }
        }
        self.commit(&cell, &mut st, tx)
            .await
            .map_err(|e| unavailable(&e))?;
        Ok(())
    }

    // ---------------------------------------------------------------- recovery

    /// Install one session's unfinished turns (in `seq` order) at start-up, and queue
    /// the write that gives its in-flight invocation a fresh reconnect grace.
    async fn recover_session(
        &self,
        ts: Vec<TurnRecord>,
        meta: SessionMeta,
        now: u64,
        pending: &mut Vec<(String, Tx, turnd_store::CommitTicket)>,
    ) -> Result<(), StoreError> {
        let Some(sid) = ts.first().map(|t| t.session_id.clone()) else {
            return Ok(());
        };
        let store = &self.inner.store;
        let grace = self.inner.cfg.reconnect_grace_ms;
        let cell = self.cell(&sid);
        let mut st = cell.state.lock().await;
        if !st.loaded {
            st.meta = meta;
            st.loaded = true;
        }
        let bits: Vec<u128> = ts.iter().filter_map(|t| turn_id_bits(&t.turn_id)).collect();
        self.track_live(&cell, &bits, &[]);
        for t in ts {
            st.active.insert(t);
        }
        let holder = st.holder().cloned();
        if let Some(h) = holder.filter(|h| h.phase == Phase::Invoked) {
            if let Some(inv) = h
                .invocation_id
                .as_deref()
                .map(|id| store.invocation(id))
                .transpose()?
                .flatten()
            {
                if inv.is_active() {
                    self.registry().remember_assignment(
                        &inv.worker_id,
                        &inv.instance_id,
                        &inv.invocation_id,
                        Assignment {
                            session_id: sid.clone(),
                            function_id: inv.function_id.clone(),
                        },
                        now,
                    );
                    st.inv = Some(Box::new(inv));
                }
            }
        }
        // Every in-flight invocation waits a fresh grace for its worker; a cancel
        // in progress keeps its own (earlier) deadline.
        let mut tx = Tx::new(&st, now);
        if let Some(mut inv) = st
            .inv
            .as_deref()
            .filter(|i| i.wait != InvWait::Cancelling)
            .cloned()
        {
            inv.wait = InvWait::AwaitingReconnect;
            inv.wait_since_ms = now;
            inv.deadline_ms = now + grace;
            tx.put_invocation(&st, inv);
        }
        if !tx.is_empty() {
            let batch = tx.batch(&st);
            pending.push((sid, tx, store.kv().commit(batch)));
        }
        Ok(())
    }

    /// Load every non-terminal turn, give every in-flight invocation a fresh reconnect
    /// grace, and re-arm every timer from its stored absolute time.
    async fn recover(&self) -> Result<(), StoreError> {
        let store = &self.inner.store;
        let now = self.now_ms();
        let mut pending = Vec::new();
        // Stores written before session metas kept `active_from` are moved first.
        let moved = store.migrate_legacy_active_index().await?;
        if moved > 0 {
            tracing::info!(
                sessions = moved,
                "moved the index of unfinished turns into the session metas"
            );
        }
        // One pass over the session metas, page by page: every session is counted, and
        // a session with unfinished turns gets them from its turn list, from the meta's
        // `active_from` on. Memory is bounded by a page.
        let mut metas = MetaCursor::new(store);
        while let Some(meta) = metas.pop()? {
            if meta.active_from.is_none() {
                continue;
            }
            let ts = store.unfinished_turns(&meta)?;
            self.recover_session(ts, meta, now, &mut pending).await?;
        }
        let (totals, mut known) = metas.finish();
        if let Ok(mut c) = self.inner.counts.lock() {
            *c = totals;
        }
        known.shrink_to_fit();
        if self.inner.stored_sessions.set(known).is_err() {
            tracing::warn!("session ids read twice at recovery; keeping the first set");
        }
        for (sid, tx, ticket) in pending {
            match ticket.await {
                Ok(Ok(())) => {
                    let cell = self.cell(&sid);
                    let mut st = cell.state.lock().await;
                    let _applied = tx.apply(&mut st);
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(StoreError::Closed),
            }
        }
        for c in self.cells() {
            let mut st = c.state.lock().await;
            self.after_change(&c, &mut st, Vec::new());
            let sid = st.id.clone();
            let has_holder = st.holder().is_some();
            drop(st);
            if has_holder {
                self.spawn_drive(sid);
            }
        }
        self.inner.recovered.store(true, Ordering::SeqCst);
        Ok(())
    }
}

/// Entries per page when recovery reads the session metas.
const RECOVERY_PAGE: usize = 4096;

/// Walks the session metas in key order, page by page, adding every meta to the
/// totals.
struct MetaCursor<'a> {
    store: &'a Store,
    page: std::collections::VecDeque<SessionMeta>,
    next: Option<Vec<u8>>,
    totals: TurnCounts,
    /// [`session_hash`] of every meta read.
    known: HashSet<u64>,
}

impl<'a> MetaCursor<'a> {
    fn new(store: &'a Store) -> Self {
        MetaCursor {
            store,
            page: Default::default(),
            next: Some(Store::FIRST.to_vec()),
            totals: TurnCounts::default(),
            known: HashSet::new(),
        }
    }

    /// The next meta in key order, counted into the totals.
    fn pop(&mut self) -> Result<Option<SessionMeta>, StoreError> {
        if self.page.is_empty() {
            let Some(from) = self.next.take() else {
                return Ok(None);
            };
            let (metas, next) = self.store.session_metas_page(&from, RECOVERY_PAGE)?;
            self.page = metas.into();
            self.next = next;
        }
        let m = self.page.pop_front();
        if let Some(m) = &m {
            self.known.insert(session_hash(&m.session_id));
            for s in TurnStatus::ALL {
                *self.totals.get_mut(s) += m.counts.get(s);
            }
        }
        Ok(m)
    }

    /// The totals and the hashes of the session ids of every meta popped (recovery
    /// pops them all).
    fn finish(self) -> (TurnCounts, HashSet<u64>) {
        (self.totals, self.known)
    }
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
    serde_json::to_string(p).expect("push frames serialize")
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

/// Unix ms as `YYYY-MM-DDTHH:MM:SS.mmmZ` (civil-from-days, proleptic Gregorian).
pub fn fmt_utc(ms: u64) -> String {
    let secs = ms / 1000;
    let days = (secs / 86_400) as i64;
    let sod = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        sod / 3600,
        (sod / 60) % 60,
        sod % 60,
        ms % 1000
    )
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
