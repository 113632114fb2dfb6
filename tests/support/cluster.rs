//! Test support for a cluster of real `turnd` processes on NATS JetStream: a node
//! started on a list of NATS URLs (the rig's, or proxies in front of them), what a
//! node shows (`GET /cluster`), waits for every partition to be led, and retries of
//! requests that a failover answers with a retryable error, an echo worker on
//! every node. Every wait is bounded.

use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::json;
use serde_json::Value;
use turnd_client::{Caller, ClientError, FunctionSpec, Worker, WorkerHandle};
use turnd_proto::{Failure, Outcome};

use crate::{http_get, worker_options, BinDaemon};

/// Skip a test (loudly) when there is no nats-server to run.
#[macro_export]
macro_rules! need_nats {
    () => {
        if ::turnd_cluster::testing::Rig::binary().is_none() {
            eprintln!("SKIPPED: no nats-server binary (run `make venv`, or set NATS_SERVER)");
            return Ok(());
        }
    };
}

/// Partitions of the test clusters.
pub const PARTITIONS: u32 = 6;

/// `urls` as the value of `TURND_CLUSTER__NATS` (a TOML list).
pub fn nats_list(urls: &[String]) -> String {
    let urls = urls
        .iter()
        .map(|u| format!("{u:?}"))
        .collect::<Vec<_>>()
        .join(",");
    format!("[{urls}]")
}

/// Start node `n<i>` in `root/n<i>` on the NATS servers `nats` (its system-account
/// connection to `sys`), its WebSocket listener on `listen` (`127.0.0.1:0`, or the
/// address it had, so that workers reconnect to a restarted node by themselves).
/// Leases of 900 ms, every node warm for every partition.
pub async fn start_node(
    root: &std::path::Path,
    i: usize,
    nats: &[String],
    sys: &str,
    listen: &str,
) -> anyhow::Result<BinDaemon> {
    start_node_with(root, i, nats, sys, listen, &[]).await
}

/// [`start_node`] with `extra` settings besides.
pub async fn start_node_with(
    root: &std::path::Path,
    i: usize,
    nats: &[String],
    sys: &str,
    listen: &str,
    extra: &[(&str, &str)],
) -> anyhow::Result<BinDaemon> {
    let nats = nats_list(nats);
    let id = format!("n{i}");
    let partitions = PARTITIONS.to_string();
    let mut env = vec![
        ("TURND_CLUSTER__NODE_ID", id.as_str()),
        ("TURND_CLUSTER__NATS", nats.as_str()),
        ("TURND_CLUSTER__NATS_SYSTEM", sys),
        ("TURND_CLUSTER__PARTITIONS", partitions.as_str()),
        ("TURND_CLUSTER__REPLICAS", "3"),
        ("TURND_CLUSTER__STREAM_MAX_MB", "32"),
        ("TURND_CLUSTER__STANDBYS", "2"),
        ("TURND_CLUSTER__LEASE_MS", "900"),
        ("TURND_CLUSTER__DRAIN_TIMEOUT_MS", "5000"),
        ("TURND_LOG__LEVEL", "info"),
    ];
    env.extend_from_slice(extra);
    BinDaemon::start_on(&root.join(&id), listen, &env).await
}

/// Nodes `n0`, `n1`, `n2` on `rig`, their data under `root`, each with `extra`
/// settings besides [`start_node`]'s.
pub async fn start_three(
    rig: &turnd_cluster::testing::Rig,
    root: &std::path::Path,
    extra: &[(&str, &str)],
) -> anyhow::Result<Vec<BinDaemon>> {
    let mut nodes = Vec::new();
    for i in 0..3 {
        let sys = rig.sys_url(i % 3);
        nodes.push(start_node_with(root, i, &rig.urls(), &sys, "127.0.0.1:0", extra).await?);
    }
    Ok(nodes)
}

/// The cluster as the node with admin address `admin` shows it (`GET /cluster`).
pub async fn status(admin: &str) -> anyhow::Result<Value> {
    let (code, body) = http_get(admin, "/cluster").await?;
    if code != 200 {
        bail!("GET /cluster answered {code}: {body}");
    }
    Ok(serde_json::from_str(&body)?)
}

/// A worker serving `echo` (completes with its input) and `beat` (the same after a
/// heartbeat and a progress), connected to every node.
pub async fn echo_worker_on_all(urls: &[String]) -> WorkerHandle {
    echo_worker(urls, 16).await
}

/// [`echo_worker_on_all`] running up to `concurrency` invocations at once.
pub async fn echo_worker(urls: &[String], concurrency: u32) -> WorkerHandle {
    echo_worker_named(urls, "w", concurrency).await
}

/// [`echo_worker`] with its own worker id (a second worker with the same id and a
/// new instance would be that worker restarted: its outstanding invocations end).
pub async fn echo_worker_named(urls: &[String], worker_id: &str, concurrency: u32) -> WorkerHandle {
    let mut o = worker_options(&urls[0], worker_id);
    o.also = urls[1..].to_vec();
    let w = Worker::new(o)
        .function(
            FunctionSpec::new("echo").concurrency(concurrency),
            |ctx| async move { Outcome::Complete(ctx.invoke.input.clone()) },
        )
        .function(
            FunctionSpec::new("beat").concurrency(concurrency),
            // A heartbeat and a progress before the input back; either failing
            // fails the turn.
            |ctx| async move {
                match (ctx.heartbeat().await, ctx.progress(json!("half")).await) {
                    (Ok(_), Ok(_)) => Outcome::Complete(ctx.invoke.input.clone()),
                    (h, p) => Outcome::Fail(Failure {
                        code: "beat".into(),
                        message: format!("heartbeat {h:?}, progress {p:?}"),
                        retryable: false,
                    }),
                }
            },
        );
    let h = w.spawn(tokio_util::sync::CancellationToken::new());
    h.connected().await;
    h
}

/// Partition `p`'s leader as `st` (a [`status`]) shows it.
pub fn leader_of(st: &Value, p: u32) -> Option<String> {
    st["partitions"]
        .as_array()?
        .iter()
        .find(|x| x["partition"] == p)?["leader"]
        .as_str()
        .map(str::to_string)
}

/// The node leading each partition, as `st` (a [`status`]) shows it.
pub fn leaders(st: &Value) -> Vec<Option<String>> {
    st["partitions"].as_array().map_or_else(Vec::new, |ps| {
        ps.iter()
            .map(|p| p["leader"].as_str().map(str::to_string))
            .collect()
    })
}

/// Wait until every partition is led by one of `alive` with a lease that runs;
/// how long it took.
pub async fn all_led(admin: &str, alive: &[&str], secs: u64) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let deadline = start + Duration::from_secs(secs);
    loop {
        if let Ok(st) = status(admin).await {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_millis() as u64;
            let ok = st["partitions"].as_array().is_some_and(|ps| {
                ps.len() == PARTITIONS as usize
                    && ps.iter().all(|p| {
                        p["leader"].as_str().is_some_and(|l| alive.contains(&l))
                            && p["lease_until_ms"].as_u64().is_some_and(|u| u > now)
                            && p["epoch"].as_u64().is_some_and(|e| e > 0)
                    })
            });
            if ok {
                return Ok(start.elapsed());
            }
        }
        if Instant::now() > deadline {
            bail!(
                "not every partition led by {alive:?} within {secs} s: {:?}",
                status(admin).await
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Wait until every partition is led by its preferred leader among `nodes` (the
/// hand-overs that follow the nodes' start are over), at most `secs`.
pub async fn placed(admin: &str, nodes: &[&str], secs: u64) -> anyhow::Result<()> {
    let live: Vec<String> = nodes.iter().map(|n| n.to_string()).collect();
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let st = status(admin).await?;
        let preferred =
            |p| turnd_server::cluster::placement::place(p, &live, 0).map(|pl| pl.leader);
        if (0..PARTITIONS).all(|p| leader_of(&st, p).is_some() && leader_of(&st, p) == preferred(p))
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("partitions not on their preferred leaders within {secs} s: {st}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Run `f` until it does not fail with a retryable error (a partition between
/// leaders, a connection closed on a write in doubt), at most `secs`.
pub async fn retrying<T, F, Fut>(secs: u64, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() < deadline && e.is_retryable() => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// `store.check` through `url`: no violation on any partition.
pub async fn check_clean(url: &str) -> anyhow::Result<()> {
    let v = retrying(20, || async move {
        let c = Caller::connect_as(url, turnd_proto::Role::Operator, None).await?;
        c.store_check().await
    })
    .await?;
    if !v.is_empty() {
        bail!("store.check found {v:?}");
    }
    Ok(())
}

/// Send `sig` (`STOP`, `CONT`, `TERM`, `KILL`) to the process `pid`.
pub fn signal(pid: u32, sig: &str) -> anyhow::Result<()> {
    let status = std::process::Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status()?;
    if !status.success() {
        bail!("kill -{sig} {pid} failed");
    }
    Ok(())
}
