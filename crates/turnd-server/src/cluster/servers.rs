//! The NATS servers as a node checked them ([`turnd_cluster::checks`]): at start,
//! where what is not proven to sync before it acknowledges refuses the node (unless
//! `cluster.allow_unsafe_nats`), and where servers that did not answer while a proven
//! majority did are *pending*; then, while any is pending, again every
//! [`RECHECK`], until each has answered. A server found unsafe then is named in
//! `/cluster`, `/metrics` and the log; the node goes on (it cannot make the server
//! sync, and stopping every node would stop the cluster), so an operator sees it.

use std::sync::{Arc, Weak};
use std::time::Duration;

use anyhow::Context;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use turnd_cluster::checks::{check_servers, Report};
use turnd_cluster::LogError;

use super::Node;
use crate::cluster_config::ClusterConfig;

/// How often a node checks again while some servers are pending.
const RECHECK: Duration = Duration::from_secs(2);

/// What is not (yet) proven of the NATS servers, as the last check found it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ServerChecks {
    /// Servers not heard from while a proven majority was: checked again.
    #[serde(default)]
    pub pending: Vec<String>,
    /// What a later check found not proven safe.
    #[serde(default)]
    pub unproven: Vec<String>,
}

/// The check at start: the system account's connection (kept while servers are
/// pending, to check them again) and what was found. Err: the node must not start.
pub(super) async fn at_start(
    cluster: &ClusterConfig,
) -> anyhow::Result<(Option<async_nats::Client>, Report)> {
    let urls = cluster
        .system_urls()
        .map_err(|e| anyhow::anyhow!("cluster.nats_system: {e}"))?;
    let sys = if urls.is_empty() {
        None
    } else {
        Some(
            turnd_cluster::nats::connect_any(&urls)
                .await
                .context("connect to NATS's system account (cluster.nats_system)")?,
        )
    };
    let report = check_servers(&cluster.nats, sys.as_ref(), cluster.allow_unsafe_nats)
        .await
        .context("check the NATS servers (cluster.nats)")?;
    tracing::info!(
        servers = report.servers.len(),
        pending = report.pending.len(),
        "cluster: NATS servers checked"
    );
    let sys = match sys {
        Some(sys) if report.pending.is_empty() => {
            if let Err(e) = sys.drain().await {
                tracing::debug!("close the system account's connection: {e}");
            }
            None
        }
        sys => sys,
    };
    Ok((sys, report))
}

/// Check the servers again every [`RECHECK`] until none is pending (or the node
/// stops), keeping what each check found in the node's [`ServerChecks`].
pub(super) fn recheck(node: &Arc<Node>, sys: async_nats::Client) {
    let weak: Weak<Node> = Arc::downgrade(node);
    let stop = node.stop.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(RECHECK) => {}
            }
            let Some(node) = weak.upgrade() else { break };
            let (urls, allow) = (node.cluster.nats.clone(), node.cluster.allow_unsafe_nats);
            let found = match check_servers(&urls, Some(&sys), allow).await {
                Ok(r) => ServerChecks {
                    pending: r.pending,
                    unproven: Vec::new(),
                },
                Err(LogError::Config(e)) => ServerChecks {
                    pending: Vec::new(),
                    unproven: vec![e],
                },
                // No server answered now: what the last check found stands.
                Err(e) => {
                    tracing::debug!("cluster: check the NATS servers again: {e}");
                    continue;
                }
            };
            let done = found.pending.is_empty() && found.unproven.is_empty();
            if !found.unproven.is_empty() && !node.cluster.allow_unsafe_nats {
                tracing::error!(
                    "cluster: a NATS server is not proven to sync before it acknowledges: {}",
                    found.unproven.join("; ")
                );
            }
            *node.servers.lock() = found;
            if done {
                tracing::info!("cluster: every NATS server is checked");
                break;
            }
        }
        if let Err(e) = sys.drain().await {
            tracing::debug!("close the system account's connection: {e}");
        }
    });
}

/// The node's [`ServerChecks`], shared with the checks that run again.
pub(crate) type Checks = Mutex<ServerChecks>;
