//! The delivery of one result: sent on its home's connection while that is up (else
//! on any live one; a result a daemon other than its home does not know waits for
//! the home's next connection), resent after the
//! acknowledgement timeout, after a retryable error, after a reconnect, or at once
//! when a probe or cancel shows the server waits for it, until the server
//! acknowledges it or refuses it for good.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use tokio::sync::{watch, Notify};
use tracing::{debug, error, warn};
use turnd_proto::{Accepted, Outcome, ResultArgs, ResultOk};

use super::shared::{bump, Link, WorkerShared};
use crate::error::ClientError;

/// Deliver one result until the server acknowledges it (or refuses it for good).
pub(super) async fn pump_result(
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
    // Generations whose connections are known to be gone.
    let mut dead: HashSet<u64> = HashSet::new();
    let mut first = true;
    loop {
        let Some(link) = next_link(&shared, &mut links, &dead, &invocation_id).await else {
            return;
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
            Ok(Ok(ok))
                if ok.accepted == Accepted::Unknown
                    && shared.home(&invocation_id).is_some_and(|h| h != link.index) =>
            {
                // Not a node of one cluster with the daemon that dispatched it (that
                // one would have forwarded it): wait for that daemon's connection.
                debug!(%invocation_id, index = link.index, "result unknown away from its home; waiting for it");
                dead.insert(link.generation);
            }
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

/// The connection to send a result on next: its home's while that is up, else any
/// live one, none of the `dead`; `None` when the worker stops.
async fn next_link(
    shared: &WorkerShared,
    links: &mut watch::Receiver<BTreeMap<usize, Link>>,
    dead: &HashSet<u64>,
    invocation_id: &str,
) -> Option<Link> {
    loop {
        let live = tokio::select! {
            _ = shared.shutdown.cancelled() => return None,
            live = links.wait_for(|l| l.values().any(|l| !dead.contains(&l.generation))) => live.ok()?,
        };
        if let Some(link) = shared.pick(&live, shared.home(invocation_id), dead) {
            return Some(link);
        }
    }
}
