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
//!
//! This file is the worker's face (the functions it serves, its options, the handle
//! of a running worker); `shared` holds the state its tasks share, `link` the
//! connection loop, `pushes` what is done with each push the server sends, and
//! `results` the delivery of one result until it is acknowledged.

mod link;
mod pushes;
mod results;
mod shared;

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info};
use turnd_proto::{
    Delivery, HeartbeatOk, InvocationIdArgs, Invoke, Outcome, Reconciled, RegisterArgs,
};

use crate::connection::lock;
use crate::error::ClientError;
use link::supervise;
use shared::{Attempts, Counters, Tables, WorkerShared};

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
    /// worker is not connected right now. Like the result and progress, it goes to
    /// the invocation's home (the daemon that last pushed about it) while that
    /// connection is up, else on any live one.
    pub async fn heartbeat(&self) -> Result<u64, ClientError> {
        let (conn, home) = self
            .shared
            .connection_for(&self.invoke.invocation_id)
            .ok_or(ClientError::Closed)?;
        let args = InvocationIdArgs {
            invocation_id: self.invoke.invocation_id.clone(),
        };
        let r = conn
            .call::<_, HeartbeatOk>("invocation.heartbeat", &args)
            .await;
        self.cancel_if_stale(r.map(|ok| ok.deadline_ms), home)
    }

    /// Stream partial output of this step to the turn's watchers that asked for
    /// progress; returns its `seq` (from 1 per invocation). Not durable, and answered
    /// without waiting for any write. On `not_found` (the invocation is no longer
    /// current, or its turn is being stopped) the cancel token is cancelled as well,
    /// and the error returned.
    pub async fn progress(&self, data: serde_json::Value) -> Result<u64, ClientError> {
        let (conn, home) = self
            .shared
            .connection_for(&self.invoke.invocation_id)
            .ok_or(ClientError::Closed)?;
        let args = turnd_proto::ProgressArgs {
            invocation_id: self.invoke.invocation_id.clone(),
            data,
        };
        let r = conn
            .call::<_, turnd_proto::ProgressOk>("invocation.progress", &args)
            .await;
        self.cancel_if_stale(r.map(|ok| ok.seq), home)
    }

    /// An answer about this invocation: `not_found` from its home means it is no
    /// longer current, so its handler is told to stop (another daemon than its home
    /// may just not know it: one that is not a node of the same cluster).
    fn cancel_if_stale<T>(&self, r: Result<T, ClientError>, home: bool) -> Result<T, ClientError> {
        if let Err(e) = &r {
            if home && e.code() == Some(turnd_proto::ErrorCode::NotFound) {
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
    /// The URLs of a cluster's other nodes: the worker keeps a connection to each as
    /// well, with the same worker_id and instance, since each node dispatches only
    /// the turns of the partitions it leads. Its tables are one: a probe on any
    /// connection is answered from them, and each connection's `hello` lists every
    /// invocation the worker runs or holds a result of. Each invocation has a home,
    /// the connection whose daemon last pushed about it (dispatched, cancelled or
    /// probed it): its result, heartbeats and progress go there while that
    /// connection is up, else on any live one (a node forwards them to the
    /// partition's leader; a result that daemon does not know waits for the home's
    /// next connection). Empty for one daemon.
    pub also: Vec<String>,
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
            also: Vec::new(),
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
        let (link, _) = watch::channel(std::collections::BTreeMap::new());
        let shared = Arc::new(WorkerShared {
            opts: self.opts,
            tables: Mutex::new(Tables::default()),
            link,
            generations: std::sync::atomic::AtomicU64::new(0),
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
        let all = 1 + self.shared.opts.also.len();
        tokio::select! {
            r = rx.wait_for(|l| l.len() == all) => {
                if r.is_err() {
                    debug!("worker link channel closed");
                }
            }
            _ = self.shared.shutdown.cancelled() => {}
        }
    }

    /// Whether the worker is connected (hello and registrations done) right now.
    pub fn is_connected(&self) -> bool {
        self.shared.link.borrow().len() == 1 + self.shared.opts.also.len()
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
