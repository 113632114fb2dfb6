//! A worker serving two functions until Ctrl-C:
//!
//! - `echo`: completes with its input;
//! - `countdown`: a multi-step turn; input `{"from": N}` runs N more steps, each
//!   carrying the count down, and completes with `{"done": true}`.
//!
//!     cargo run -p turnd-client --example worker -- [URL] [WORKER_ID]
//!
//! URL defaults to `$TURND_URL`, else `ws://127.0.0.1:7420/v1`; the token, if the
//! daemon needs one, comes from `$TURND_TOKEN` (a worker token). Logs go to stderr
//! (`RUST_LOG=debug` for more): while the daemon cannot be reached, one warning per
//! attempt says why.

use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnd_client::turnd_proto::{Failure, Outcome};
use turnd_client::{ConnectionState, FunctionSpec, Worker, WorkerOptions};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .or_else(|| std::env::var("TURND_URL").ok())
        .unwrap_or_else(|| "ws://127.0.0.1:7420/v1".to_string());
    let worker_id = args.next().unwrap_or_else(|| "example-worker".to_string());
    let mut opts = WorkerOptions::new(&url, &worker_id);
    opts.token = std::env::var("TURND_TOKEN").ok().filter(|t| !t.is_empty());

    let shutdown = CancellationToken::new();
    let worker = Worker::new(opts)
        .function(FunctionSpec::new("echo").concurrency(4), |ctx| async move {
            Outcome::Complete(ctx.invoke.input.clone())
        })
        .function(
            FunctionSpec::new("countdown").timeout_ms(10_000),
            |ctx| async move {
                let Some(n) = ctx.invoke.input.get("from").and_then(|v| v.as_u64()) else {
                    return Outcome::Fail(Failure {
                        code: "bad_input".into(),
                        message: r#"countdown wants {"from": N}"#.into(),
                        retryable: false,
                    });
                };
                if n == 0 {
                    Outcome::Complete(json!({"done": true}))
                } else {
                    Outcome::Continue(json!({"from": n - 1}))
                }
            },
        )
        .spawn(shutdown.clone());

    // Say where the connection stands instead of waiting silently.
    match worker.connected_within(Duration::from_secs(10)).await {
        Ok(()) => {
            eprintln!("worker {worker_id} serves echo and countdown at {url}; Ctrl-C stops it")
        }
        Err(e) => eprintln!("still trying to connect: {e}"),
    }
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        _ = async {
            // The worker stops by itself only when another connection took its id.
            while worker.state() != ConnectionState::Stopped {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        } => {}
    }
    shutdown.cancel();
    worker.join().await?;
    Ok(())
}
