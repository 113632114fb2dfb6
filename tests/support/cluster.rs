//! What the cluster's end-to-end tests share: a node's `GET /cluster`, an echo
//! worker on every node, a request retried while a partition moves, a signal to a
//! process by its PID.

use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::Value;
use turnd_client::{ClientError, FunctionSpec, Worker, WorkerHandle};
use turnd_proto::Outcome;

use crate::{http_get, worker_options};

/// The cluster as the node with admin URL `admin` shows it (`GET /cluster`).
pub async fn status(admin: &str) -> anyhow::Result<Value> {
    let (code, body) = http_get(admin, "/cluster").await?;
    if code != 200 {
        bail!("GET /cluster answered {code}: {body}");
    }
    Ok(serde_json::from_str(&body)?)
}

/// A worker serving `echo` (completes with its input), connected to every node.
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

/// Run `f` until it does not fail with a retryable error (a partition between
/// leaders, a connection closed on a write in doubt), at most `secs`.
pub async fn retrying<T, F, Fut>(secs: u64, mut f: F) -> Result<T, ClientError>
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
            Err(e) => return Err(e),
        }
    }
}

/// `kill -<sig> <pid>`.
pub fn signal(pid: u32, sig: &str) -> anyhow::Result<()> {
    let status = std::process::Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status()?;
    if !status.success() {
        bail!("kill -{sig} {pid} failed");
    }
    Ok(())
}
