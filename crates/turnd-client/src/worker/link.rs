//! The connection loops of a worker (one per URL: a cluster's nodes each get one):
//! connect, say hello with the invocations it
//! holds, register every function, serve pushes until the connection ends, and
//! reconnect with capped backoff until shutdown; then stop what the worker started.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tracing::{debug, error, info, warn};
use turnd_proto::{HelloArgs, Push, RegisterOk, Role, CLOSE_SUPERSEDED, PROTOCOL_VERSION};

use super::pushes::{on_cancel, on_invoke, on_probe};
use super::shared::{bump, Attempts, Link, WorkerShared};
use super::{FunctionSpec, Registered};
use crate::connection::{lock, Connection};
use crate::error::ClientError;

/// Upper bound of the reconnect backoff (unless `reconnect_delay` itself is larger).
const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(5);
/// How long the supervisor waits for result and status tasks after shutdown; they
/// watch the shutdown token, so this is only a safety net.
const PUMP_DRAIN_LIMIT: Duration = Duration::from_secs(1);
/// The connection loop: connect, serve, reconnect with backoff, until shutdown.
pub(super) async fn supervise(
    shared: Arc<WorkerShared>,
    functions: Arc<HashMap<String, Registered>>,
) -> Result<(), ClientError> {
    let mut loops = tokio::task::JoinSet::new();
    for (index, url) in shared.urls().into_iter().enumerate() {
        loops.spawn(connection_loop(
            shared.clone(),
            functions.clone(),
            index,
            url,
        ));
    }
    let mut result = Ok(());
    while let Some(ended) = loops.join_next().await {
        let ended =
            ended.unwrap_or_else(|e| Err(ClientError::Connect(format!("worker task failed: {e}"))));
        if let Err(e) = ended {
            // One connection superseded: the whole worker stops.
            shared.shutdown.cancel();
            if result.is_ok() {
                result = Err(e);
            }
        }
    }
    // Stop everything this worker started: handlers see their tokens cancelled (they
    // are children of the shutdown token), pumps and status answers end.
    shared.shutdown.cancel();
    shared.link.send_replace(BTreeMap::new());
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

/// One URL's connection: connect, serve, reconnect with backoff, until shutdown.
async fn connection_loop(
    shared: Arc<WorkerShared>,
    functions: Arc<HashMap<String, Registered>>,
    index: usize,
    url: String,
) -> Result<(), ClientError> {
    let opts = &shared.opts;
    let cap = MAX_RECONNECT_DELAY.max(opts.reconnect_delay);
    let mut delay = opts.reconnect_delay;
    loop {
        if shared.shutdown.is_cancelled() {
            return Ok(());
        }
        let attempt = tokio::select! {
            _ = shared.shutdown.cancelled() => return Ok(()),
            attempt = connect_and_register(&shared, &functions, &url) => attempt,
        };
        match attempt {
            Ok((conn, pushes)) => {
                delay = opts.reconnect_delay;
                *lock(&shared.attempts) = Attempts::default();
                let generation = shared.generations.fetch_add(1, Ordering::Relaxed) + 1;
                bump(&shared.counters.connections);
                info!(worker_id = %opts.worker_id, %url, generation, "worker connected and registered");
                shared.link.send_modify(|l| {
                    l.insert(
                        index,
                        Link {
                            index,
                            generation,
                            conn: conn.clone(),
                        },
                    );
                });
                serve(&shared, &functions, (index, &conn), pushes).await;
                shared.link.send_modify(|l| {
                    l.remove(&index);
                });
                if shared.shutdown.is_cancelled() {
                    conn.close().await;
                    return Ok(());
                }
                if conn.close_code() == Some(CLOSE_SUPERSEDED) {
                    error!(worker_id = %opts.worker_id, "connection superseded by another worker with the same worker_id; stopping");
                    return Err(ClientError::Connect(format!(
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
            _ = shared.shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep(delay) => {}
        }
        delay = delay.saturating_mul(2).min(cap);
    }
}

/// Connect, say hello with this instance's lists, register every function.
async fn connect_and_register(
    shared: &Arc<WorkerShared>,
    functions: &HashMap<String, Registered>,
    url: &str,
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
    let (conn, hello_ok) = Connection::connect(url, hello).await?;
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

/// Handle the pushes of the connection to URL `index` until it ends or the worker
/// shuts down. The daemon that pushes about an invocation is the one that waits for
/// it (after a cluster's takeover, the partition's new leader): it becomes the
/// invocation's home.
async fn serve(
    shared: &Arc<WorkerShared>,
    functions: &Arc<HashMap<String, Registered>>,
    (index, conn): (usize, &Connection),
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
            Push::Invoke(invoke) => {
                let id = invoke.invocation_id.clone();
                on_invoke(shared, functions, invoke);
                shared.note_home(&id, index);
            }
            Push::Cancel {
                invocation_id,
                reason,
            } => {
                on_cancel(shared, invocation_id.clone(), &reason);
                shared.note_home(&invocation_id, index);
            }
            Push::Probe { invocation_id } => {
                shared.note_home(&invocation_id, index);
                on_probe(shared, conn, invocation_id);
            }
            Push::Event { watch_id, .. }
            | Push::Progress(turnd_proto::ProgressPush { watch_id, .. })
            | Push::ProgressDropped { watch_id, .. } => {
                debug!(%watch_id, "ignoring a watch's push on a worker connection")
            }
        }
    }
}
