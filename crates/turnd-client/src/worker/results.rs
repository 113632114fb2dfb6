//! The delivery of one result: sent on the current connection, resent after the
//! acknowledgement timeout, after a retryable error, after a reconnect, or at once
//! when a probe or cancel shows the server waits for it, until the server
//! acknowledges it or refuses it for good.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use tokio::sync::Notify;
use tracing::{debug, error, warn};
use turnd_proto::{Outcome, ResultArgs, ResultOk};

use super::shared::{bump, Link, WorkerShared};
use crate::error::ClientError;

/// Deliver one result until the server acknowledges it (or refuses it for good),
/// on the connection to URL `origin` while it lives (see [`pick`]).
pub(super) async fn pump_result(
    shared: Arc<WorkerShared>,
    invocation_id: String,
    outcome: Outcome,
    resend_now: Arc<Notify>,
    origin: usize,
) {
    let ack_timeout = shared.opts.result_ack_timeout;
    let args = ResultArgs {
        invocation_id: invocation_id.clone(),
        outcome,
    };
    let mut links = shared.link.subscribe();
    // Generations whose connections are known to be gone.
    let mut dead: HashSet<u64> = HashSet::new();
    let mut first = true;
    loop {
        let link = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            link = links.wait_for(|l| l.values().any(|l| !dead.contains(&l.generation))) => match link {
                Ok(links) => match pick(&links, origin, &dead) {
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
                dead.insert(link.generation);
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

/// The connection an invocation's requests (its result, heartbeats, progress) go
/// on: the one to URL `origin`, where its invoke came from, while it lives (and is
/// not in `dead`); else any live one. On a cluster the node that pushed the invoke
/// leads the invocation's partition, so they are served there without being
/// forwarded to it over NATS (for a result, a hop of the turn's critical path);
/// another node still takes them and forwards them.
pub(super) fn pick<'a>(
    links: &'a BTreeMap<usize, Link>,
    origin: usize,
    dead: &HashSet<u64>,
) -> Option<&'a Link> {
    let live = |l: &&Link| !dead.contains(&l.generation);
    links
        .get(&origin)
        .filter(live)
        .or_else(|| links.values().find(live))
}
