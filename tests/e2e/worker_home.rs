//! A Rust worker given several URLs (`WorkerOptions.also`, as for a cluster's nodes),
//! through two independent daemons: each dispatches only its own turns and neither
//! knows the other's invocations, so an invocation's result, heartbeats and progress
//! must reach the daemon that dispatched it (a cluster's node would forward them;
//! these cannot).

use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnd_client::{FunctionSpec, Worker};
use turnd_proto::{Outcome, TurnStatus};
use turnd_tests::{worker_options, TestDaemon};

/// Each invocation's requests go on the connection it came on, whichever URL is
/// first: the turns of both daemons complete, with their heartbeat and progress
/// taken and their handlers never cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invocations_requests_go_to_the_daemon_that_dispatched_it() -> anyhow::Result<()> {
    let a = TestDaemon::start(|_| {}).await?;
    let b = TestDaemon::start(|_| {}).await?;
    // b's URL first: an invocation of a's must not go there.
    let mut o = worker_options(&b.url, "w-home");
    o.also = vec![a.url.clone()];
    let w = Worker::new(o).function(FunctionSpec::new("work"), |ctx| async move {
        let heartbeat = ctx.heartbeat().await.is_ok();
        let progress = ctx.progress(json!("half")).await.is_ok();
        Outcome::Complete(json!({
            "input": ctx.invoke.input.clone(),
            "heartbeat": heartbeat,
            "progress": progress,
            "cancelled": ctx.is_cancelled(),
        }))
    });
    let worker = w.spawn(CancellationToken::new());
    worker.connected().await;
    for (name, d) in [("a", &a), ("b", &b)] {
        let c = d.caller().await?;
        let t = c.submit_simple("s-home", "work", json!(name)).await?;
        let done = c.wait_terminal(&t.turn_id, Duration::from_secs(10)).await?;
        assert_eq!(done.status, TurnStatus::Completed, "on {name}: {done:?}");
        assert_eq!(
            done.output,
            Some(json!({"input": name, "heartbeat": true, "progress": true, "cancelled": false})),
            "on {name}"
        );
    }
    worker.shutdown();
    a.shutdown().await?;
    b.shutdown().await
}
