//! Fault schedules from a seed, and how each fault is applied to the running
//! cluster: kill -9 of a node (and its restart), SIGSTOP/SIGCONT of a node (a
//! deposed leader that wakes), kill -9 of a NATS server (and its restart), both at
//! once, a node cut from NATS, and a rolling restart (SIGTERM each node in turn,
//! then start it again). After each the cluster must settle: every partition led by
//! a node that is up, within a bound.

use std::time::{Duration, Instant};

use turnd_testkit::SplitMix64;

use crate::harness::Cluster;
use crate::load::{Load, Seen};

/// How long the cluster may take to settle after a fault.
const SETTLE_SECS: u64 = 60;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// kill -9 a node; start it again `down_ms` later.
    KillNode { node: usize, down_ms: u64 },
    /// SIGSTOP a node for `ms` (past its leases), then SIGCONT.
    PauseNode { node: usize, ms: u64 },
    /// kill -9 a NATS server; start it again `down_ms` later.
    KillNats { server: usize, down_ms: u64 },
    /// kill -9 a node and a NATS server at the same moment.
    KillNodeAndNats {
        node: usize,
        server: usize,
        down_ms: u64,
    },
    /// Cut a node from every NATS server for `ms`.
    CutNode { node: usize, ms: u64 },
    /// SIGTERM each node in turn (it drains), start it again, let it settle.
    Rolling,
}

const KINDS: u64 = 6;

fn fault_of_kind(kind: u64, rng: &mut SplitMix64) -> Fault {
    let node = rng.below(3) as usize;
    let server = rng.below(3) as usize;
    match kind {
        0 => Fault::KillNode {
            node,
            down_ms: rng.range(200, 2_000),
        },
        1 => Fault::PauseNode {
            node,
            ms: rng.range(1_500, 3_500),
        },
        2 => Fault::KillNats {
            server,
            down_ms: rng.range(500, 3_000),
        },
        3 => Fault::KillNodeAndNats {
            node,
            server,
            down_ms: rng.range(500, 2_000),
        },
        4 => Fault::CutNode {
            node,
            ms: rng.range(1_500, 4_000),
        },
        _ => Fault::Rolling,
    }
}

/// Every kind of fault once, in an order and with parameters from `rng`.
pub fn every_kind(rng: &mut SplitMix64) -> Vec<Fault> {
    let mut kinds: Vec<u64> = (0..KINDS).collect();
    for i in (1..kinds.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        kinds.swap(i, j);
    }
    kinds.into_iter().map(|k| fault_of_kind(k, rng)).collect()
}

/// `n` faults of kinds drawn from `rng`.
pub fn random(rng: &mut SplitMix64, n: usize) -> Vec<Fault> {
    (0..n)
        .map(|_| {
            let k = rng.below(KINDS);
            fault_of_kind(k, rng)
        })
        .collect()
}

/// What applying a fault showed.
#[derive(Debug, Default)]
pub struct Applied {
    /// From a kill (or a pause, or a cut) to every partition led by a node that
    /// is up.
    pub failover: Option<Duration>,
    /// A rolling restart: the requests that failed while it ran (answered with an
    /// error, or not answered on a connection that was open), connections
    /// refused by a node that was down aside.
    pub rolling_failed: Option<Vec<Seen>>,
}

async fn sleep_ms(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

/// Start NATS server `i` again and wait until every server's JetStream answers.
pub async fn restart_server(c: &mut Cluster, i: usize) -> anyhow::Result<()> {
    c.rig.restart(i).map_err(anyhow::Error::msg)?;
    c.rig
        .wait_ready(Duration::from_secs(SETTLE_SECS))
        .await
        .map_err(anyhow::Error::msg)
}

/// Apply `f` to `c` while `load` runs, and wait until the cluster settled.
pub async fn apply(c: &mut Cluster, load: &Load, f: Fault) -> anyhow::Result<Applied> {
    let mut out = Applied::default();
    match f {
        Fault::KillNode { node, down_ms } => {
            let at = Instant::now();
            c.kill(node).await?;
            out.failover = Some(c.settled(SETTLE_SECS).await?);
            sleep_ms(down_ms.saturating_sub(at.elapsed().as_millis() as u64)).await;
            c.restart(node).await?;
        }
        Fault::PauseNode { node, ms } => {
            c.pause(node)?;
            out.failover = Some(c.settled(SETTLE_SECS).await?);
            sleep_ms(ms).await;
            c.resume(node)?;
        }
        Fault::KillNats { server, down_ms } => {
            c.rig.kill9(server);
            sleep_ms(down_ms).await;
            restart_server(c, server).await?;
        }
        Fault::KillNodeAndNats {
            node,
            server,
            down_ms,
        } => {
            c.rig.kill9(server);
            c.kill(node).await?;
            out.failover = Some(c.settled(SETTLE_SECS).await?);
            sleep_ms(down_ms).await;
            // The node starts while the server is still down: a proven majority
            // answers, and the server is checked once it is back.
            c.restart(node).await?;
            restart_server(c, server).await?;
        }
        Fault::CutNode { node, ms } => {
            c.cut(node);
            // A node cut from NATS says so: load balancers take it out of rotation.
            c.readyz_says(node, "NATS unreachable", Duration::from_secs(SETTLE_SECS))
                .await?;
            out.failover = Some(c.settled(SETTLE_SECS).await?);
            sleep_ms(ms).await;
            c.heal(node);
        }
        Fault::Rolling => {
            let from = Instant::now();
            for node in 0..3 {
                c.terminate(node).await?;
                c.restart(node).await?;
                c.settled(SETTLE_SECS).await?;
            }
            let failed = load
                .errors_between(from, Instant::now())
                .into_iter()
                .filter(|s| !s.what.starts_with("failed to connect"))
                .collect();
            out.rolling_failed = Some(failed);
        }
    }
    c.settled(SETTLE_SECS).await?;
    Ok(out)
}
