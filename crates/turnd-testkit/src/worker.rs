//! Misbehaving workers on the real SDK, with every handler execution counted.
//!
//! The daemon's loss handling is judged by what workers really did: a turn that
//! completed although its handler ran twice under `at_most_once` is a failure the turn
//! record alone cannot show. So every handler here records each execution in [`Runs`]
//! (a count, per turn, and the `invoke` it got), and behaves as its [`Script`] says:
//! each execution takes the next [`Act`] from the script's queue, or the script's
//! default once the queue is empty. Acts cover the ways real handlers go wrong: hang
//! and ignore `cancel`, wait for the test to release them ([`Gate`]), fail.
//!
//! [`KitWorker`] wraps an SDK worker serving scripted functions. It can die mid-step
//! ([`KitWorker::die`]: its connection goes away and its running handlers are never
//! heard from again) and come back ([`KitWorker::respawn`]) as the same instance
//! (same `instance_id`, but a new process that knows nothing of what the old one was
//! running) or as a new instance, sharing the scripts and run counters of the original
//! so counts add up over every "process" of the worker.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::future::BoxFuture;
use serde_json::Value;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::debug;
use turnd_client::turnd_proto::{Cancelled, Failure, Invoke, Outcome};
use turnd_client::{FunctionSpec, Handler, InvocationCtx, Worker, WorkerHandle, WorkerOptions};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A switch a handler can wait on: closed until the test opens it.
#[derive(Debug, Clone)]
pub struct Gate {
    open: Arc<watch::Sender<bool>>,
}

impl Default for Gate {
    fn default() -> Self {
        Gate::new()
    }
}

impl Gate {
    /// A closed gate.
    pub fn new() -> Gate {
        Gate {
            open: Arc::new(watch::Sender::new(false)),
        }
    }

    /// Open it: every waiter (now and later) proceeds.
    pub fn open(&self) {
        self.open.send_replace(true);
    }

    /// Whether it is open.
    pub fn is_open(&self) -> bool {
        *self.open.borrow()
    }

    /// Wait until it is open.
    pub async fn wait(&self) {
        let mut rx = self.open.subscribe();
        // The sender lives in `self`, so the channel cannot close while we wait.
        if rx.wait_for(|open| *open).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// What one handler execution does.
#[derive(Debug, Clone)]
pub enum Act {
    /// Complete with the invocation's input.
    Echo,
    /// Complete with this value.
    Complete(Value),
    /// Return `continue` with this state (the turn goes on to its next step).
    Continue(Value),
    /// Fail with this failure.
    Fail(Failure),
    /// Never return, and ignore `cancel`: a handler stuck in a loop or a syscall.
    Hang,
    /// Wait for `cancel`, then return `cancelled`: a well-behaved long handler.
    HangUntilCancelled,
    /// Wait until the gate opens (ignoring `cancel`), then complete with the input.
    Gate(Gate),
    /// Sleep (ignoring `cancel`), then complete with the input.
    Sleep(Duration),
    /// Send `invocation.heartbeat` every `every` until the gate opens (ignoring
    /// `cancel` and heartbeat errors, e.g. while disconnected), then complete with the
    /// input: a long step that keeps renewing its deadline.
    Heartbeat {
        /// Interval between heartbeats.
        every: Duration,
        /// Opens when the step should finish.
        until: Gate,
    },
}

#[derive(Debug)]
struct ScriptInner {
    queue: VecDeque<Act>,
    default: Act,
}

/// The acts of a function's executions: queued acts first, in order, then the default.
#[derive(Debug, Clone)]
pub struct Script {
    inner: Arc<Mutex<ScriptInner>>,
}

impl Default for Script {
    fn default() -> Self {
        Script::new(Act::Echo)
    }
}

impl Script {
    /// A script that does `default` every time.
    pub fn new(default: Act) -> Script {
        Script {
            inner: Arc::new(Mutex::new(ScriptInner {
                queue: VecDeque::new(),
                default,
            })),
        }
    }

    /// Queue `act` for the next execution that has no queued act yet.
    pub fn then(self, act: Act) -> Script {
        lock(&self.inner).queue.push_back(act);
        self
    }

    /// Queue `act` (through a shared reference).
    pub fn push(&self, act: Act) {
        lock(&self.inner).queue.push_back(act);
    }

    /// Change the default act.
    pub fn set_default(&self, act: Act) {
        lock(&self.inner).default = act;
    }

    /// The act for the next execution.
    pub fn next_act(&self) -> Act {
        let mut inner = lock(&self.inner);
        match inner.queue.pop_front() {
            Some(act) => act,
            None => inner.default.clone(),
        }
    }
}

#[derive(Debug)]
struct RunsInner {
    log: Mutex<Vec<Invoke>>,
    changed: watch::Sender<usize>,
}

/// Counted handler executions of one function (over every process of a worker that
/// shares them).
#[derive(Debug, Clone)]
pub struct Runs {
    count: Arc<AtomicUsize>,
    inner: Arc<RunsInner>,
}

impl Default for Runs {
    fn default() -> Self {
        Runs::new()
    }
}

impl Runs {
    /// No executions yet.
    pub fn new() -> Runs {
        Runs {
            count: Arc::new(AtomicUsize::new(0)),
            inner: Arc::new(RunsInner {
                log: Mutex::new(Vec::new()),
                changed: watch::Sender::new(0),
            }),
        }
    }

    /// Record one execution (done by the scripted handler before it acts).
    pub fn record(&self, invoke: &Invoke) {
        let n = {
            let mut log = lock(&self.inner.log);
            log.push(invoke.clone());
            self.count.fetch_add(1, Ordering::SeqCst) + 1
        };
        self.inner.changed.send_replace(n);
    }

    /// Executions so far.
    pub fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    /// The underlying counter.
    pub fn counter(&self) -> Arc<AtomicUsize> {
        self.count.clone()
    }

    /// Executions for one turn.
    pub fn for_turn(&self, turn_id: &str) -> usize {
        lock(&self.inner.log)
            .iter()
            .filter(|i| i.turn_id == turn_id)
            .count()
    }

    /// Executions per turn id.
    pub fn by_turn(&self) -> HashMap<String, usize> {
        let mut m = HashMap::new();
        for i in lock(&self.inner.log).iter() {
            *m.entry(i.turn_id.clone()).or_insert(0) += 1;
        }
        m
    }

    /// The `invoke` of every execution, in start order.
    pub fn invocations(&self) -> Vec<Invoke> {
        lock(&self.inner.log).clone()
    }

    /// The `invoke` of the latest execution.
    pub fn last(&self) -> Option<Invoke> {
        lock(&self.inner.log).last().cloned()
    }

    /// Wait until at least `n` executions started; returns the `n`-th one's `invoke`,
    /// or `None` when `timeout` passed first.
    pub async fn wait_for(&self, n: usize, timeout: Duration) -> Option<Invoke> {
        let mut rx = self.inner.changed.subscribe();
        let reached = tokio::time::timeout(timeout, rx.wait_for(|c| *c >= n)).await;
        match reached {
            Ok(Ok(_)) => lock(&self.inner.log).get(n.checked_sub(1)?).cloned(),
            _ => None,
        }
    }
}

/// A handler that records each execution in `runs` and then does the script's act.
pub fn scripted_handler(script: Script, runs: Runs) -> Handler {
    Arc::new(move |ctx: InvocationCtx| -> BoxFuture<'static, Outcome> {
        runs.record(&ctx.invoke);
        let act = script.next_act();
        Box::pin(perform(act, ctx))
    })
}

async fn perform(act: Act, ctx: InvocationCtx) -> Outcome {
    let input = ctx.invoke.input.clone();
    match act {
        Act::Echo => Outcome::Complete(input),
        Act::Complete(v) => Outcome::Complete(v),
        Act::Continue(v) => Outcome::Continue(v),
        Act::Fail(f) => Outcome::Fail(f),
        Act::Hang => std::future::pending().await,
        Act::HangUntilCancelled => {
            ctx.cancel.cancelled().await;
            Outcome::Cancelled(Cancelled {
                message: "cancelled as asked".into(),
            })
        }
        Act::Gate(gate) => {
            gate.wait().await;
            Outcome::Complete(input)
        }
        Act::Sleep(d) => {
            tokio::time::sleep(d).await;
            Outcome::Complete(input)
        }
        Act::Heartbeat { every, until } => {
            loop {
                tokio::select! {
                    _ = until.wait() => break,
                    _ = tokio::time::sleep(every) => {
                        if let Err(e) = ctx.heartbeat().await {
                            debug!(invocation_id = %ctx.invoke.invocation_id, "heartbeat failed: {e}");
                        }
                    }
                }
            }
            Outcome::Complete(input)
        }
    }
}

/// Worker options for fault tests: result resend after 300 ms without an
/// acknowledgement and a 50 ms first reconnect delay, so every SDK-side timer is short.
pub fn fast_options(url: &str, worker_id: &str) -> WorkerOptions {
    let mut o = WorkerOptions::new(url, worker_id);
    o.result_ack_timeout = Duration::from_millis(300);
    o.reconnect_delay = Duration::from_millis(50);
    o
}

#[derive(Debug, Clone)]
struct KitFunction {
    spec: FunctionSpec,
    script: Script,
    runs: Runs,
}

/// Builds a [`KitWorker`].
#[derive(Debug, Clone)]
pub struct KitWorkerBuilder {
    opts: WorkerOptions,
    functions: Vec<KitFunction>,
}

impl KitWorkerBuilder {
    /// Adjust the SDK options (token, timers, instance id, ...).
    pub fn options(mut self, f: impl FnOnce(&mut WorkerOptions)) -> Self {
        f(&mut self.opts);
        self
    }

    /// Serve `spec` following `script`, counting executions in fresh [`Runs`].
    pub fn function(self, spec: FunctionSpec, script: Script) -> Self {
        self.function_with(spec, script, Runs::new())
    }

    /// Serve `spec` following `script`, counting executions in `runs` (shared with
    /// other workers to count a function's executions over all of them).
    pub fn function_with(mut self, spec: FunctionSpec, script: Script, runs: Runs) -> Self {
        self.functions.push(KitFunction { spec, script, runs });
        self
    }

    /// Start the worker (it connects in the background).
    pub fn spawn(self) -> KitWorker {
        let mut worker = Worker::new(self.opts.clone());
        for f in &self.functions {
            worker = worker.handler(
                f.spec.clone(),
                scripted_handler(f.script.clone(), f.runs.clone()),
            );
        }
        let shutdown = CancellationToken::new();
        let handle = worker.spawn(shutdown.clone());
        KitWorker {
            handle,
            opts: self.opts,
            functions: self.functions,
            shutdown,
        }
    }

    /// Start the worker and wait until it is connected and registered.
    pub async fn start(self) -> KitWorker {
        let w = self.spawn();
        w.connected().await;
        w
    }
}

/// How a respawned worker identifies itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Instance {
    /// The same `instance_id` as before. The new process knows nothing of what the old
    /// one was running, so its `hello` lists nothing: the daemon concludes those
    /// invocations were never received.
    Same,
    /// A fresh `instance_id`: a restarted worker, whose predecessor's outstanding
    /// invocations have an unknown outcome.
    New,
}

/// A running SDK worker serving scripted, counted functions.
pub struct KitWorker {
    handle: WorkerHandle,
    opts: WorkerOptions,
    functions: Vec<KitFunction>,
    shutdown: CancellationToken,
}

impl std::fmt::Debug for KitWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KitWorker")
            .field("worker_id", &self.opts.worker_id)
            .field("instance_id", &self.opts.instance_id)
            .field("stats", &self.handle.stats())
            .finish_non_exhaustive()
    }
}

impl KitWorker {
    /// A builder for a worker connecting to `url` as `worker_id`, with
    /// [`fast_options`].
    pub fn builder(url: &str, worker_id: &str) -> KitWorkerBuilder {
        KitWorkerBuilder {
            opts: fast_options(url, worker_id),
            functions: Vec::new(),
        }
    }

    /// The SDK's handle (stats, `last_reconciled`, ...).
    pub fn handle(&self) -> &WorkerHandle {
        &self.handle
    }

    /// The options it runs with.
    pub fn options(&self) -> &WorkerOptions {
        &self.opts
    }

    /// Its `worker_id`.
    pub fn worker_id(&self) -> &str {
        &self.opts.worker_id
    }

    /// Its `instance_id`.
    pub fn instance_id(&self) -> &str {
        &self.opts.instance_id
    }

    /// Wait until it is connected and registered.
    pub async fn connected(&self) {
        self.handle.connected().await
    }

    /// The executions of `function_id`.
    ///
    /// # Panics
    /// When this worker does not serve `function_id` (a mistake in the test).
    pub fn runs(&self, function_id: &str) -> Runs {
        self.function(function_id).runs.clone()
    }

    /// The script of `function_id`.
    ///
    /// # Panics
    /// When this worker does not serve `function_id` (a mistake in the test).
    pub fn script(&self, function_id: &str) -> Script {
        self.function(function_id).script.clone()
    }

    fn function(&self, function_id: &str) -> &KitFunction {
        match self
            .functions
            .iter()
            .find(|f| f.spec.function_id == function_id)
        {
            Some(f) => f,
            None => panic!(
                "worker {} does not serve {function_id}",
                self.opts.worker_id
            ),
        }
    }

    /// Die mid-step: the worker stops (its socket goes away, it never reconnects) while
    /// its handlers may still be running; whatever they return is never sent. To make
    /// the socket vanish without a close frame, cut it at the proxy as well
    /// ([`crate::ProxyHandle::cut_worker`]).
    pub fn die(&self) {
        self.shutdown.cancel();
    }

    /// Start another process of this worker: same `worker_id`, URL, functions, scripts
    /// and run counters; the same or a new `instance_id`. Call [`KitWorker::die`] on
    /// this one first unless two processes should compete.
    pub fn respawn(&self, instance: Instance) -> KitWorker {
        let mut opts = self.opts.clone();
        if instance == Instance::New {
            opts.instance_id = turnd_client::new_instance_id();
        }
        KitWorkerBuilder {
            opts,
            functions: self.functions.clone(),
        }
        .spawn()
    }

    /// Stop the worker and wait for its supervisor to end.
    pub async fn stop(self) -> Result<(), turnd_client::ClientError> {
        self.shutdown.cancel();
        self.handle.join().await
    }
}
