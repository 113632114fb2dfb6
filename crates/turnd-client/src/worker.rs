//! The worker side: serve functions, and make the daemon's loss handling work.
//!
//! The daemon can only reconcile losses (semantics, "Loss") if the worker does its
//! part, and this module is that part:
//!
//! - one `instance_id` for the life of a [`Worker`], announced in every `hello`, with
//!   the invocations still running (`inflight`) and the results not yet acknowledged
//!   (`finished`), so that a reconnect keeps work instead of losing it;
//! - every result is held until the server acknowledges it, resent after
//!   `result_ack_timeout` without an answer, after a retryable error, right after every
//!   reconnect, and at once when a `probe` or `cancel` shows the server is waiting;
//! - `probe` is answered from what this worker really knows (`running`, `finished`,
//!   `unknown`), and `cancel` reaches the handler's [`CancellationToken`];
//! - a lost connection is re-established with capped backoff until shutdown, while
//!   handlers keep running.
//!
//! One supervisor task owns the connection loop; each handler runs in its own task and
//! each unacknowledged result has a "pump" task that delivers it.

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use serde_json::Value;
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};
use turnd_proto::{
    Cancelled, Delivery, Failure, HeartbeatOk, HelloArgs, InvocationIdArgs, InvocationState,
    Invoke, Outcome, Push, Reconciled, RegisterArgs, RegisterOk, ResultArgs, ResultOk, Role,
    StatusArgs, CLOSE_SUPERSEDED, PROTOCOL_VERSION,
};

use crate::connection::{lock, Connection};
use crate::error::ClientError;

/// Upper bound of the reconnect backoff (unless `reconnect_delay` itself is larger).
const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(5);
/// How long the supervisor waits for result and status tasks after shutdown; they
/// watch the shutdown token, so this is only a safety net.
const PUMP_DRAIN_LIMIT: Duration = Duration::from_secs(1);

/// A function this worker serves, and the settings it registers it with.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionSpec {
    /// The function's id, e.g. `model.step`.
    pub function_id: String,
    /// Invocations this connection runs at once for this function (default 1).
    pub concurrency: u32,
    /// An attempt's deadline, renewable by heartbeat; `None` = the server's default.
    pub timeout_ms: Option<u64>,
    /// Delivery mode (default `at_most_once`).
    pub delivery: Delivery,
    /// Attempts per step; `None` = the server's default for the delivery mode.
    pub max_attempts: Option<u32>,
}

impl FunctionSpec {
    /// A spec with the protocol defaults: concurrency 1, at-most-once, server timeout.
    pub fn new(function_id: impl Into<String>) -> FunctionSpec {
        FunctionSpec {
            function_id: function_id.into(),
            concurrency: 1,
            timeout_ms: None,
            delivery: Delivery::AtMostOnce,
            max_attempts: None,
        }
    }

    /// Set `concurrency`.
    pub fn concurrency(mut self, concurrency: u32) -> FunctionSpec {
        self.concurrency = concurrency;
        self
    }

    /// Set `timeout_ms`.
    pub fn timeout_ms(mut self, timeout_ms: u64) -> FunctionSpec {
        self.timeout_ms = Some(timeout_ms);
        self
    }

    /// Set `delivery`.
    pub fn delivery(mut self, delivery: Delivery) -> FunctionSpec {
        self.delivery = delivery;
        self
    }

    /// Set `max_attempts`.
    pub fn max_attempts(mut self, max_attempts: u32) -> FunctionSpec {
        self.max_attempts = Some(max_attempts);
        self
    }

    /// The `function.register` arguments for this spec.
    pub fn register_args(&self) -> RegisterArgs {
        RegisterArgs {
            function_id: self.function_id.clone(),
            concurrency: Some(self.concurrency),
            timeout_ms: self.timeout_ms,
            delivery: Some(self.delivery),
            max_attempts: self.max_attempts,
        }
    }
}

/// What a handler gets for one invocation.
#[derive(Clone)]
pub struct InvocationCtx {
    /// The `invoke` push: ids, step, attempt, input and deadline.
    pub invoke: Invoke,
    /// Cancelled when the server sends `cancel` for this invocation, when a heartbeat
    /// learns the invocation is no longer current, or when the worker shuts down. By
    /// convention the handler then returns [`Outcome::Cancelled`].
    pub cancel: CancellationToken,
    shared: Arc<WorkerShared>,
}

impl std::fmt::Debug for InvocationCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InvocationCtx")
            .field("invoke", &self.invoke)
            .field("cancelled", &self.cancel.is_cancelled())
            .finish_non_exhaustive()
    }
}

impl InvocationCtx {
    /// Tell the server this invocation is still working; returns the new deadline
    /// (Unix ms). On `not_found` (the invocation is no longer current) the cancel token
    /// is cancelled as well, and the error returned. [`ClientError::Closed`] when the
    /// worker is not connected right now.
    pub async fn heartbeat(&self) -> Result<u64, ClientError> {
        let conn = self
            .shared
            .current_connection()
            .ok_or(ClientError::Closed)?;
        let args = InvocationIdArgs {
            invocation_id: self.invoke.invocation_id.clone(),
        };
        let r = conn
            .call::<_, HeartbeatOk>("invocation.heartbeat", &args)
            .await;
        self.cancel_if_stale(r.map(|ok| ok.deadline_ms))
    }

    /// Stream partial output of this step to the turn's watchers that asked for
    /// progress; returns its `seq` (from 1 per invocation). Not durable, and answered
    /// without waiting for any write. On `not_found` (the invocation is no longer
    /// current, or its turn is being stopped) the cancel token is cancelled as well,
    /// and the error returned.
    pub async fn progress(&self, data: serde_json::Value) -> Result<u64, ClientError> {
        let conn = self
            .shared
            .current_connection()
            .ok_or(ClientError::Closed)?;
        let args = turnd_proto::ProgressArgs {
            invocation_id: self.invoke.invocation_id.clone(),
            data,
        };
        let r = conn
            .call::<_, turnd_proto::ProgressOk>("invocation.progress", &args)
            .await;
        self.cancel_if_stale(r.map(|ok| ok.seq))
    }

    /// An answer about this invocation: `not_found` means it is no longer current, so
    /// its handler is told to stop.
    fn cancel_if_stale<T>(&self, r: Result<T, ClientError>) -> Result<T, ClientError> {
        if let Err(e) = &r {
            if e.code() == Some(turnd_proto::ErrorCode::NotFound) {
                info!(invocation_id = %self.invoke.invocation_id, "invocation no longer current; cancelling its handler");
                self.cancel.cancel();
            }
        }
        r
    }

    /// Whether the handler has been asked to stop.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Shorthand for `self.invoke.invocation_id`.
    pub fn invocation_id(&self) -> &str {
        &self.invoke.invocation_id
    }
}

/// A function handler: runs one invocation and returns its outcome.
pub type Handler = Arc<dyn Fn(InvocationCtx) -> BoxFuture<'static, Outcome> + Send + Sync>;

/// How a [`Worker`] connects and identifies itself.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Daemon URL, e.g. `ws://127.0.0.1:7420/v1`.
    pub url: String,
    /// Token for role `worker`, if the daemon requires one.
    pub token: Option<String>,
    /// Stable across restarts of this worker.
    pub worker_id: String,
    /// Human-readable name shown in `workers.list`.
    pub name: String,
    /// Identifies this process start: the default is a fresh UUID each time options
    /// are built. Keep it to reconnect as the same instance; build new options (or set
    /// a new id) to behave like a restarted worker.
    pub instance_id: String,
    /// Resend a result that got no answer within this time (default 2000 ms).
    pub result_ack_timeout: Duration,
    /// First delay before reconnecting (default 200 ms); doubled per failed attempt,
    /// capped at 5 s.
    pub reconnect_delay: Duration,
}

impl WorkerOptions {
    /// Options with the defaults: `name` = `worker_id`, no token, a new instance id.
    pub fn new(url: impl Into<String>, worker_id: impl Into<String>) -> WorkerOptions {
        let worker_id = worker_id.into();
        WorkerOptions {
            url: url.into(),
            token: None,
            name: worker_id.clone(),
            worker_id,
            instance_id: new_instance_id(),
            result_ack_timeout: Duration::from_millis(2000),
            reconnect_delay: Duration::from_millis(200),
        }
    }
}

impl Default for WorkerOptions {
    /// The default daemon address, worker id `worker`, a new instance id.
    fn default() -> WorkerOptions {
        WorkerOptions::new("ws://127.0.0.1:7420/v1", "worker")
    }
}

/// A fresh instance id.
pub fn new_instance_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// Counters of a running worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Handlers started (one per accepted `invoke`).
    pub invocations_started: u64,
    /// Results sent for the first time.
    pub results_sent: u64,
    /// Results sent again (no answer in time, retryable error, reconnect, probe).
    pub results_resent: u64,
    /// Results the server acknowledged.
    pub results_acked: u64,
    /// Results dropped because the server refused them with a non-retryable error.
    pub results_dropped: u64,
    /// Connections on which hello and every registration succeeded.
    pub connections: u64,
}

#[derive(Default)]
struct Counters {
    invocations_started: AtomicU64,
    results_sent: AtomicU64,
    results_resent: AtomicU64,
    results_acked: AtomicU64,
    results_dropped: AtomicU64,
    connections: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// A result waiting for its acknowledgement.
struct Unacked {
    /// Wakes the result's pump to send it again now.
    resend_now: Arc<Notify>,
}

#[derive(Default)]
struct Tables {
    /// Handlers still running, with their cancel tokens.
    running: HashMap<String, CancellationToken>,
    /// Results not yet acknowledged.
    unacked: HashMap<String, Unacked>,
}

/// Where a worker's connection stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectionState {
    /// Hello and every registration succeeded; the worker serves.
    Connected,
    /// Not connected yet, or the connection was lost: the worker keeps trying (with
    /// backoff). `failed_attempts` counts the attempts that failed since the last
    /// connection, `last_error` says why the last one did.
    Connecting {
        failed_attempts: u64,
        last_error: Option<String>,
    },
    /// The worker has stopped (shut down, or superseded by another connection).
    Stopped,
}

/// Failed connection attempts since the last successful one.
#[derive(Default)]
struct Attempts {
    failed: u64,
    last_error: Option<String>,
}

/// The connection the worker currently serves on (hello and registrations done).
#[derive(Clone)]
struct Link {
    generation: u64,
    conn: Connection,
}

struct WorkerShared {
    opts: WorkerOptions,
    tables: Mutex<Tables>,
    link: watch::Sender<Option<Link>>,
    counters: Counters,
    reconciled: Mutex<Option<Reconciled>>,
    attempts: Mutex<Attempts>,
    shutdown: CancellationToken,
    /// Result pumps and status answers; drained on shutdown.
    pumps: TaskTracker,
    /// Handler tasks; cancelled (not awaited) on shutdown.
    handlers: TaskTracker,
}

impl WorkerShared {
    fn current_connection(&self) -> Option<Connection> {
        self.link.borrow().as_ref().map(|l| l.conn.clone())
    }

    /// Take a result for delivery: the invocation is no longer running, its outcome is
    /// held until acknowledged, and a pump delivers it.
    fn hold_result(self: &Arc<Self>, invocation_id: String, outcome: Outcome) {
        let resend_now = Arc::new(Notify::new());
        {
            let mut tables = lock(&self.tables);
            tables.running.remove(&invocation_id);
            let previous = tables.unacked.insert(
                invocation_id.clone(),
                Unacked {
                    resend_now: resend_now.clone(),
                },
            );
            if previous.is_some() {
                warn!(%invocation_id, "replacing a held result for the same invocation");
            }
        }
        let shared = self.clone();
        self.pumps
            .spawn(pump_result(shared, invocation_id, outcome, resend_now));
    }

    /// Forget a held result, but only if it is still the one this pump delivers.
    fn release_result(&self, invocation_id: &str, resend_now: &Arc<Notify>) {
        let mut tables = lock(&self.tables);
        if let Some(held) = tables.unacked.get(invocation_id) {
            if Arc::ptr_eq(&held.resend_now, resend_now) {
                tables.unacked.remove(invocation_id);
            }
        }
    }

    fn snapshot(&self) -> WorkerStats {
        let c = &self.counters;
        WorkerStats {
            invocations_started: c.invocations_started.load(Ordering::Relaxed),
            results_sent: c.results_sent.load(Ordering::Relaxed),
            results_resent: c.results_resent.load(Ordering::Relaxed),
            results_acked: c.results_acked.load(Ordering::Relaxed),
            results_dropped: c.results_dropped.load(Ordering::Relaxed),
            connections: c.connections.load(Ordering::Relaxed),
        }
    }
}

struct Registered {
    spec: FunctionSpec,
    handler: Handler,
}

/// A worker under construction: options plus the functions it serves.
pub struct Worker {
    opts: WorkerOptions,
    functions: Vec<Registered>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("opts", &self.opts)
            .field(
                "functions",
                &self
                    .functions
                    .iter()
                    .map(|r| r.spec.function_id.as_str())
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Worker {
    /// A worker with no functions yet.
    pub fn new(opts: WorkerOptions) -> Worker {
        Worker {
            opts,
            functions: Vec::new(),
        }
    }

    /// Serve `spec.function_id` with the async function `f`. A second registration of
    /// the same function id replaces the first.
    pub fn function<F, Fut>(self, spec: FunctionSpec, f: F) -> Self
    where
        F: Fn(InvocationCtx) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Outcome> + Send + 'static,
    {
        let handler: Handler =
            Arc::new(move |ctx| -> BoxFuture<'static, Outcome> { Box::pin(f(ctx)) });
        self.handler(spec, handler)
    }

    /// Serve `spec.function_id` with an already boxed [`Handler`].
    pub fn handler(mut self, spec: FunctionSpec, handler: Handler) -> Self {
        self.functions
            .retain(|r| r.spec.function_id != spec.function_id);
        self.functions.push(Registered { spec, handler });
        self
    }

    /// Start the worker in the background. It connects, registers, serves and
    /// reconnects until `shutdown` (or [`WorkerHandle::shutdown`]) is cancelled.
    /// Must be called inside a tokio runtime.
    pub fn spawn(self, shutdown: CancellationToken) -> WorkerHandle {
        let shutdown = shutdown.child_token();
        let (link, _) = watch::channel(None);
        let shared = Arc::new(WorkerShared {
            opts: self.opts,
            tables: Mutex::new(Tables::default()),
            link,
            counters: Counters::default(),
            reconciled: Mutex::new(None),
            attempts: Mutex::new(Attempts::default()),
            shutdown,
            pumps: TaskTracker::new(),
            handlers: TaskTracker::new(),
        });
        let functions: Arc<HashMap<String, Registered>> = Arc::new(
            self.functions
                .into_iter()
                .map(|r| (r.spec.function_id.clone(), r))
                .collect(),
        );
        let task = tokio::spawn(supervise(shared.clone(), functions));
        WorkerHandle { shared, task }
    }
}

/// Control of a running [`Worker`]. Dropping it does not stop the worker; cancel the
/// shutdown token or call [`WorkerHandle::shutdown`].
pub struct WorkerHandle {
    shared: Arc<WorkerShared>,
    task: JoinHandle<Result<(), ClientError>>,
}

impl std::fmt::Debug for WorkerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerHandle")
            .field("worker_id", &self.shared.opts.worker_id)
            .field("instance_id", &self.shared.opts.instance_id)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl WorkerHandle {
    /// Resolves once hello and every registration succeeded on the current connection
    /// (at once if that is so now), or once the worker has stopped.
    pub async fn connected(&self) {
        let mut rx = self.shared.link.subscribe();
        tokio::select! {
            r = rx.wait_for(Option::is_some) => {
                if r.is_err() {
                    debug!("worker link channel closed");
                }
            }
            _ = self.shared.shutdown.cancelled() => {}
        }
    }

    /// Whether the worker is connected (hello and registrations done) right now.
    pub fn is_connected(&self) -> bool {
        self.shared.link.borrow().is_some()
    }

    /// Where the connection stands, with the last error while it cannot connect.
    pub fn state(&self) -> ConnectionState {
        if self.is_connected() {
            return ConnectionState::Connected;
        }
        if self.shared.shutdown.is_cancelled() || self.task.is_finished() {
            return ConnectionState::Stopped;
        }
        let a = lock(&self.shared.attempts);
        ConnectionState::Connecting {
            failed_attempts: a.failed,
            last_error: a.last_error.clone(),
        }
    }

    /// Like [`WorkerHandle::connected`], giving up after `limit`: an error that
    /// says why the worker is not connected (the last failed attempt's error).
    pub async fn connected_within(&self, limit: Duration) -> Result<(), ClientError> {
        // `connected` also returns once the worker stops; the state tells which.
        let waited = tokio::time::timeout(limit, self.connected()).await;
        match self.state() {
            ConnectionState::Connected => Ok(()),
            ConnectionState::Stopped => Err(ClientError::Connect(format!(
                "{}: the worker has stopped",
                self.shared.opts.url
            ))),
            ConnectionState::Connecting {
                failed_attempts,
                last_error,
            } => {
                let why = last_error.unwrap_or_else(|| "no attempt has finished yet".into());
                let within = if waited.is_err() {
                    format!("within {limit:?}")
                } else {
                    "now".to_string()
                };
                Err(ClientError::Connect(format!(
                    "{}: not connected {within} ({failed_attempts} failed attempt(s)): {why}",
                    self.shared.opts.url
                )))
            }
        }
    }

    /// The `reconciled` answer of the last successful `hello`.
    pub fn last_reconciled(&self) -> Option<Reconciled> {
        lock(&self.shared.reconciled).clone()
    }

    /// This worker's instance id.
    pub fn instance_id(&self) -> &str {
        &self.shared.opts.instance_id
    }

    /// Ask the worker to stop: no more reconnects, the socket is closed and running
    /// handlers are cancelled.
    pub fn shutdown(&self) {
        self.shared.shutdown.cancel();
    }

    /// Wait until the worker has stopped. `Ok` after a shutdown; an error when it had to
    /// stop for another reason (its connection was superseded by another process with
    /// the same `worker_id`).
    pub async fn join(self) -> Result<(), ClientError> {
        match self.task.await {
            Ok(result) => result,
            Err(e) => Err(ClientError::Connect(format!("worker task failed: {e}"))),
        }
    }

    /// A snapshot of the worker's counters.
    pub fn stats(&self) -> WorkerStats {
        self.shared.snapshot()
    }
}

/// The connection loop: connect, serve, reconnect with backoff, until shutdown.
async fn supervise(
    shared: Arc<WorkerShared>,
    functions: Arc<HashMap<String, Registered>>,
) -> Result<(), ClientError> {
    let opts = &shared.opts;
    let cap = MAX_RECONNECT_DELAY.max(opts.reconnect_delay);
    let mut delay = opts.reconnect_delay;
    let mut generation = 0u64;
    let result = loop {
        if shared.shutdown.is_cancelled() {
            break Ok(());
        }
        let attempt = tokio::select! {
            _ = shared.shutdown.cancelled() => break Ok(()),
            attempt = connect_and_register(&shared, &functions) => attempt,
        };
        match attempt {
            Ok((conn, pushes)) => {
                delay = opts.reconnect_delay;
                *lock(&shared.attempts) = Attempts::default();
                generation += 1;
                bump(&shared.counters.connections);
                info!(worker_id = %opts.worker_id, generation, "worker connected and registered");
                shared.link.send_replace(Some(Link {
                    generation,
                    conn: conn.clone(),
                }));
                serve(&shared, &functions, &conn, pushes).await;
                shared.link.send_replace(None);
                if shared.shutdown.is_cancelled() {
                    conn.close().await;
                    break Ok(());
                }
                if conn.close_code() == Some(CLOSE_SUPERSEDED) {
                    error!(worker_id = %opts.worker_id, "connection superseded by another worker with the same worker_id; stopping");
                    break Err(ClientError::Connect(format!(
                        "superseded: another connection took worker_id {}",
                        opts.worker_id
                    )));
                }
                warn!(worker_id = %opts.worker_id, "worker connection lost; reconnecting");
            }
            Err(e) => {
                let failed = {
                    let mut a = lock(&shared.attempts);
                    a.failed += 1;
                    a.last_error = Some(e.to_string());
                    a.failed
                };
                // The error names the URL (or the refusal); once per attempt, so a
                // worker pointed at the wrong place never waits silently.
                warn!(
                    worker_id = %opts.worker_id,
                    attempt = failed,
                    "failed to connect worker: {e}; retrying in {delay:?}"
                );
            }
        }
        tokio::select! {
            _ = shared.shutdown.cancelled() => break Ok(()),
            _ = tokio::time::sleep(delay) => {}
        }
        delay = delay.saturating_mul(2).min(cap);
    };
    // Stop everything this worker started: handlers see their tokens cancelled (they
    // are children of the shutdown token), pumps and status answers end.
    shared.shutdown.cancel();
    shared.link.send_replace(None);
    shared.pumps.close();
    shared.handlers.close();
    if tokio::time::timeout(PUMP_DRAIN_LIMIT, shared.pumps.wait())
        .await
        .is_err()
    {
        warn!("result tasks did not end within {PUMP_DRAIN_LIMIT:?} of shutdown");
    }
    result
}

/// Connect, say hello with this instance's lists, register every function.
async fn connect_and_register(
    shared: &Arc<WorkerShared>,
    functions: &HashMap<String, Registered>,
) -> Result<(Connection, mpsc::UnboundedReceiver<Push>), ClientError> {
    let opts = &shared.opts;
    let (inflight, finished) = {
        let tables = lock(&shared.tables);
        let mut inflight: Vec<String> = tables.running.keys().cloned().collect();
        let mut finished: Vec<String> = tables.unacked.keys().cloned().collect();
        inflight.sort();
        finished.sort();
        (inflight, finished)
    };
    let hello = HelloArgs {
        protocol: PROTOCOL_VERSION,
        role: Role::Worker,
        token: opts.token.clone(),
        name: Some(opts.name.clone()),
        worker_id: Some(opts.worker_id.clone()),
        instance_id: Some(opts.instance_id.clone()),
        inflight,
        finished,
    };
    let (conn, hello_ok) = Connection::connect(&opts.url, hello).await?;
    let pushes = conn
        .pushes()
        .expect("a new connection's push stream has not been taken");
    if let Some(reconciled) = &hello_ok.reconciled {
        if !reconciled.redispatched.is_empty() || !reconciled.unknown.is_empty() {
            info!(
                kept = reconciled.kept.len(),
                redispatched = ?reconciled.redispatched,
                unknown = ?reconciled.unknown,
                "server reconciled this worker's invocations"
            );
        }
    }
    *lock(&shared.reconciled) = hello_ok.reconciled;
    let mut specs: Vec<&FunctionSpec> = functions.values().map(|r| &r.spec).collect();
    specs.sort_by(|a, b| a.function_id.cmp(&b.function_id));
    for spec in specs {
        // On failure the connection is dropped here, which closes it in the background.
        let ok: RegisterOk = conn
            .call("function.register", &spec.register_args())
            .await?;
        debug!(function_id = %ok.function_id, workers = ok.workers, "function registered");
    }
    Ok((conn, pushes))
}

/// Handle pushes until the connection ends or the worker shuts down.
async fn serve(
    shared: &Arc<WorkerShared>,
    functions: &Arc<HashMap<String, Registered>>,
    conn: &Connection,
    mut pushes: mpsc::UnboundedReceiver<Push>,
) {
    loop {
        let push = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            push = pushes.recv() => match push {
                Some(push) => push,
                // The stream ends after the connection ended and every push that
                // arrived before was handled (an invoke that arrived is work to do).
                None => return,
            },
        };
        match push {
            Push::Invoke(invoke) => on_invoke(shared, functions, invoke),
            Push::Cancel {
                invocation_id,
                reason,
            } => on_cancel(shared, invocation_id, &reason),
            Push::Probe { invocation_id } => on_probe(shared, conn, invocation_id),
            Push::Event { watch_id, .. }
            | Push::Progress(turnd_proto::ProgressPush { watch_id, .. })
            | Push::ProgressDropped { watch_id, .. } => {
                debug!(%watch_id, "ignoring a watch's push on a worker connection")
            }
        }
    }
}

fn on_invoke(
    shared: &Arc<WorkerShared>,
    functions: &Arc<HashMap<String, Registered>>,
    invoke: Invoke,
) {
    let invocation_id = invoke.invocation_id.clone();
    let cancel = shared.shutdown.child_token();
    {
        let mut tables = lock(&shared.tables);
        if tables.running.contains_key(&invocation_id) {
            debug!(%invocation_id, "invoke for an invocation already running; ignored");
            return;
        }
        if let Some(held) = tables.unacked.get(&invocation_id) {
            debug!(%invocation_id, "invoke for an invocation already finished; resending its result");
            held.resend_now.notify_one();
            return;
        }
        tables.running.insert(invocation_id.clone(), cancel.clone());
    }
    bump(&shared.counters.invocations_started);
    let handler = functions
        .get(&invoke.function_id)
        .map(|r| r.handler.clone());
    debug!(%invocation_id, function_id = %invoke.function_id, step = invoke.step, attempt = invoke.attempt, "invocation started");
    let function_id = invoke.function_id.clone();
    let ctx = InvocationCtx {
        invoke,
        cancel,
        shared: shared.clone(),
    };
    let task_shared = shared.clone();
    shared.handlers.spawn(async move {
        let outcome = match handler {
            Some(handler) => {
                let run = AssertUnwindSafe(async move { handler(ctx).await }).catch_unwind();
                match run.await {
                    Ok(outcome) => outcome,
                    Err(_) => {
                        error!(%invocation_id, %function_id, "handler panicked; reporting failure");
                        Outcome::Fail(Failure {
                            code: "handler_panicked".into(),
                            message: format!("the handler of {function_id} panicked"),
                            retryable: false,
                        })
                    }
                }
            }
            None => {
                error!(%invocation_id, %function_id, "invoke for a function this worker does not serve");
                Outcome::Fail(Failure {
                    code: "unknown_function".into(),
                    message: format!("this worker does not serve {function_id}"),
                    retryable: false,
                })
            }
        };
        debug!(%invocation_id, outcome = outcome.kind(), "invocation finished");
        task_shared.hold_result(invocation_id, outcome);
    });
}

fn on_cancel(shared: &Arc<WorkerShared>, invocation_id: String, reason: &str) {
    let known = {
        let tables = lock(&shared.tables);
        if let Some(token) = tables.running.get(&invocation_id) {
            info!(%invocation_id, reason, "cancel: stopping the handler");
            token.cancel();
            true
        } else if let Some(held) = tables.unacked.get(&invocation_id) {
            info!(%invocation_id, reason, "cancel: already finished; resending the result");
            held.resend_now.notify_one();
            true
        } else {
            false
        }
    };
    if !known {
        info!(%invocation_id, reason, "cancel for an invocation this worker is not running");
        shared.hold_result(
            invocation_id,
            Outcome::Cancelled(Cancelled {
                message: "not running".into(),
            }),
        );
    }
}

fn on_probe(shared: &Arc<WorkerShared>, conn: &Connection, invocation_id: String) {
    let (state, resend) = {
        let tables = lock(&shared.tables);
        if tables.running.contains_key(&invocation_id) {
            (InvocationState::Running, None)
        } else if let Some(held) = tables.unacked.get(&invocation_id) {
            (InvocationState::Finished, Some(held.resend_now.clone()))
        } else {
            (InvocationState::Unknown, None)
        }
    };
    debug!(%invocation_id, ?state, "answering probe");
    let conn = conn.clone();
    let shutdown = shared.shutdown.clone();
    shared.pumps.spawn(async move {
        let args = StatusArgs {
            invocation_id: invocation_id.clone(),
            state,
        };
        let answer = tokio::select! {
            _ = shutdown.cancelled() => return,
            answer = conn.call::<_, Value>("invocation.status", &args) => answer,
        };
        if let Err(e) = answer {
            warn!(%invocation_id, "failed to answer probe: {e}");
        }
        // Status first, then the result the status promised.
        if let Some(resend) = resend {
            resend.notify_one();
        }
    });
}

/// Deliver one result until the server acknowledges it (or refuses it for good).
async fn pump_result(
    shared: Arc<WorkerShared>,
    invocation_id: String,
    outcome: Outcome,
    resend_now: Arc<Notify>,
) {
    let ack_timeout = shared.opts.result_ack_timeout;
    let args = ResultArgs {
        invocation_id: invocation_id.clone(),
        outcome,
    };
    let mut links = shared.link.subscribe();
    // A generation whose connection is known to be gone.
    let mut dead: Option<u64> = None;
    let mut first = true;
    loop {
        let link = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            link = links.wait_for(|l| matches!(l, Some(l) if Some(l.generation) != dead)) => match link {
                Ok(link) => match link.as_ref() {
                    Some(link) => link.clone(),
                    None => continue,
                },
                Err(_) => return,
            },
        };
        if first {
            bump(&shared.counters.results_sent);
            first = false;
        } else {
            bump(&shared.counters.results_resent);
        }
        let answer = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            _ = resend_now.notified() => {
                debug!(%invocation_id, "resending result on request");
                continue;
            }
            answer = tokio::time::timeout(ack_timeout, link.conn.call::<_, ResultOk>("invocation.result", &args)) => answer,
        };
        match answer {
            Ok(Ok(ok)) => {
                bump(&shared.counters.results_acked);
                debug!(%invocation_id, accepted = ?ok.accepted, "result acknowledged");
                shared.release_result(&invocation_id, &resend_now);
                return;
            }
            Ok(Err(ClientError::Protocol(e))) if e.retryable || e.code.retryable() => {
                warn!(%invocation_id, "server could not take the result yet ({e}); resending later");
                tokio::select! {
                    _ = shared.shutdown.cancelled() => return,
                    _ = resend_now.notified() => {}
                    _ = tokio::time::sleep(ack_timeout) => {}
                }
            }
            Ok(Err(ClientError::Protocol(e))) => {
                error!(%invocation_id, "server refused the result ({e}); dropping it");
                bump(&shared.counters.results_dropped);
                shared.release_result(&invocation_id, &resend_now);
                return;
            }
            Ok(Err(ClientError::Decode(e))) => {
                // The server answered `ok`: the result is durable, only the detail of
                // the answer is unreadable.
                warn!(%invocation_id, "result acknowledged with an unexpected answer: {e}");
                bump(&shared.counters.results_acked);
                shared.release_result(&invocation_id, &resend_now);
                return;
            }
            Ok(Err(ClientError::Closed)) => {
                debug!(%invocation_id, generation = link.generation, "connection lost before the result was acknowledged; resending after reconnect");
                dead = Some(link.generation);
            }
            Ok(Err(e)) => {
                warn!(%invocation_id, "failed to send result: {e}; resending later");
                tokio::select! {
                    _ = shared.shutdown.cancelled() => return,
                    _ = tokio::time::sleep(ack_timeout) => {}
                }
            }
            Err(_elapsed) => {
                debug!(%invocation_id, "no acknowledgement within {ack_timeout:?}; resending");
            }
        }
    }
}
