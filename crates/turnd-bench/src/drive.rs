//! `turnd-bench drive`: a small, known load against an external daemon, for
//! `scripts/check-fsync.sh`. It exercises every acknowledgement the durability
//! promise covers — `turn.submit`, `invocation.result` (one- and multi-step turns),
//! `turn.stop`, `session.stop` — plus one deduplicated submit (which writes nothing),
//! and prints what it did so the trace check can compare counts.

use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::json;
use turnd_client::turnd_proto::{SubmitArgs, TurnStatus};
use turnd_client::Caller;

use crate::daemon::{Workers, ECHO, NOBODY};

pub async fn drive(url: &str, sessions: usize, turns: usize, steps: u64) -> anyhow::Result<()> {
    let workers = Workers::start(url, 1, 4).await?;
    let caller = Caller::connect(url, None).await.context("connect caller")?;
    let mut submitted = 0u64;
    let mut deduplicated = 0u64;
    for s in 0..sessions {
        for j in 0..turns {
            let args = SubmitArgs {
                session_id: format!("drive-{s}"),
                function_id: ECHO.into(),
                input: json!({"steps": steps, "j": j}),
                idempotency_key: Some(format!("k-{s}-{j}")),
                turn_timeout_ms: None,
                on_busy: None,
            };
            let ok = caller.submit(args.clone()).await.context("submit")?;
            submitted += 1;
            let done = caller
                .wait_terminal(&ok.turn.turn_id, Duration::from_secs(30))
                .await
                .context("wait")?;
            if done.status != TurnStatus::Completed {
                bail!("turn {} ended {}", done.turn_id, done.status.as_str());
            }
            if j == 0 {
                // Same key, same request: answered from the store, nothing written.
                let again = caller.submit(args).await.context("resubmit")?;
                if !again.deduplicated {
                    bail!("resubmit with the same idempotency key was not deduplicated");
                }
                deduplicated += 1;
            }
        }
    }
    // Stops: turns nobody serves wait at the head of their session; stopping one is a
    // durable write, and so is stopping a whole session.
    let mut stops = 0u64;
    for i in 0..2 {
        let t = caller
            .submit_simple(&format!("drive-stop-{i}"), NOBODY, json!({"i": i}))
            .await
            .context("submit to stop")?;
        submitted += 1;
        let stopped = caller.stop(&t.turn_id, "drive").await.context("stop")?;
        if stopped.stop.is_none() {
            bail!("stopped turn {} has no stop record", t.turn_id);
        }
        stops += 1;
    }
    let t = caller
        .submit_simple("drive-stop-session", NOBODY, json!({}))
        .await
        .context("submit to stop the session")?;
    submitted += 1;
    let stopped = caller
        .stop_session(&t.session_id, "drive")
        .await
        .context("session.stop")?;
    let session_stops = stopped.len();
    let acked = workers
        .handles
        .iter()
        .map(|h| h.stats().results_acked)
        .sum::<u64>();
    caller.connection().close().await;
    workers.stop().await?;
    println!(
        "drive: submits={submitted} (+{deduplicated} deduplicated) results_acked={acked} turn_stops={stops} session_stops=1 (turns stopped: {session_stops})"
    );
    Ok(())
}
