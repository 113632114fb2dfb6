//! A cluster for end-to-end tests: turnd nodes as the built binary on a rig of
//! `nats-server` processes (`turnd_cluster::testing::Rig`), what a node shows at
//! `GET /cluster`, and waits on it. Every process is started here and ended by its
//! PID; every wait is bounded.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::Value;
use turnd_client::{FunctionSpec, Worker, WorkerHandle};
use turnd_cluster::testing::Rig;
use turnd_proto::Outcome;

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

/// The rig's URLs as the value of `TURND_CLUSTER__NATS`.
pub fn nats_list(rig: &Rig) -> String {
    let urls = rig
        .urls()
        .iter()
        .map(|u| format!("{u:?}"))
        .collect::<Vec<_>>()
        .join(",");
    format!("[{urls}]")
}

/// Start node `n<i>` of a cluster of `partitions` on `rig` (R=3, two standbys, a
/// 900 ms lease), its data in `root/n<i>`, with `extra` settings.
pub async fn start_node(
    rig: &Rig,
    root: &Path,
    i: usize,
    partitions: u32,
    extra: &[(&str, &str)],
) -> anyhow::Result<BinDaemon> {
    let nats = nats_list(rig);
    let id = format!("n{i}");
    let sys = rig.sys_url(i % 3);
    let partitions = partitions.to_string();
    let mut env = vec![
        ("TURND_CLUSTER__NODE_ID", id.as_str()),
        ("TURND_CLUSTER__NATS", nats.as_str()),
        ("TURND_CLUSTER__NATS_SYSTEM", sys.as_str()),
        ("TURND_CLUSTER__PARTITIONS", partitions.as_str()),
        ("TURND_CLUSTER__REPLICAS", "3"),
        ("TURND_CLUSTER__STREAM_MAX_MB", "32"),
        ("TURND_CLUSTER__STANDBYS", "2"),
        ("TURND_CLUSTER__LEASE_MS", "900"),
        ("TURND_CLUSTER__DRAIN_TIMEOUT_MS", "5000"),
        ("TURND_LOG__LEVEL", "info"),
    ];
    env.extend_from_slice(extra);
    BinDaemon::start(&root.join(&id), &env).await
}

/// The cluster as the node at `admin` shows it (`GET /cluster`).
pub async fn status(admin: &str) -> anyhow::Result<Value> {
    let (code, body) = http_get(admin, "/cluster").await?;
    if code != 200 {
        bail!("GET /cluster answered {code}: {body}");
    }
    Ok(serde_json::from_str(&body)?)
}

/// Partition `p`'s leader as `st` (a `GET /cluster`) shows it.
pub fn leader_of(st: &Value, p: u32) -> Option<String> {
    st["partitions"]
        .as_array()?
        .iter()
        .find(|x| x["partition"] == p)?["leader"]
        .as_str()
        .map(str::to_string)
}

/// Wait until all `partitions` are led by one of `alive` with a lease that runs;
/// how long it took.
pub async fn all_led(
    admin: &str,
    partitions: u32,
    alive: &[&str],
    secs: u64,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let deadline = start + Duration::from_secs(secs);
    loop {
        if let Ok(st) = status(admin).await {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_millis() as u64;
            let ok = st["partitions"].as_array().is_some_and(|ps| {
                ps.len() == partitions as usize
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

/// A worker `w` serving `echo` (completes with its input), connected to every node.
pub async fn echo_worker_on_all(urls: &[String]) -> WorkerHandle {
    let mut o = worker_options(&urls[0], "w");
    o.also = urls[1..].to_vec();
    let w = Worker::new(o).function(
        FunctionSpec::new("echo").concurrency(16),
        |ctx| async move { Outcome::Complete(ctx.invoke.input.clone()) },
    );
    let h = w.spawn(tokio_util::sync::CancellationToken::new());
    h.connected().await;
    h
}

/// Send `sig` (`STOP`, `CONT`, `KILL`, ...) to process `pid`.
pub fn signal(pid: u32, sig: &str) -> anyhow::Result<()> {
    let status = std::process::Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status()?;
    if !status.success() {
        bail!("kill -{sig} {pid} failed");
    }
    Ok(())
}
