//! Retention through the real binary: terminal turns are deleted within
//! `terminal_ms + 2 × sweep_interval_ms` with everything that belongs to them, a
//! session left with no turn is forgotten, unfinished turns stay however old, a freed
//! idempotency key can be used again, and all of it holds across a restart.

use std::time::{Duration, Instant};

use serde_json::json;
use turnd_client::turnd_proto::{ErrorCode, ListArgs, SubmitArgs, TurnStatus};
use turnd_client::Caller;
use turnd_tests::{echo_worker, http_get, metric, BinDaemon};

const TERMINAL_MS: u64 = 400;
const SWEEP_MS: u64 = 100;

fn env() -> Vec<(&'static str, String)> {
    vec![
        ("TURND_RETENTION__TERMINAL_MS", TERMINAL_MS.to_string()),
        ("TURND_RETENTION__SWEEP_INTERVAL_MS", SWEEP_MS.to_string()),
        ("TURND_LOG", "warn".to_string()),
    ]
}

async fn start(data: &std::path::Path) -> anyhow::Result<BinDaemon> {
    let env = env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    BinDaemon::start(data, &env).await
}

fn submit(session: &str, function: &str, key: Option<&str>, n: u64) -> SubmitArgs {
    SubmitArgs {
        session_id: session.into(),
        function_id: function.into(),
        input: json!({"n": n}),
        idempotency_key: key.map(str::to_string),
        turn_timeout_ms: None,
    }
}

fn list(session: &str) -> ListArgs {
    ListArgs {
        session_id: session.into(),
        status: None,
        limit: Some(100),
        before_seq: None,
    }
}

fn is_not_found<T: std::fmt::Debug>(r: Result<T, turnd_client::ClientError>) -> bool {
    match r {
        Err(e) => e.code() == Some(ErrorCode::NotFound),
        Ok(_) => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminal_turns_expire_and_unfinished_ones_stay() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let d = start(&data).await?;
    let w = echo_worker(&d.url, "w-ret", 4).await;
    let c = Caller::connect(&d.url, None).await?;

    // Two finished turns in "done"; in "mixed", a finished one ahead of one that
    // waits for a worker nobody serves.
    let mut finished = Vec::new();
    for (i, session) in ["done", "done", "mixed"].into_iter().enumerate() {
        let key = format!("k{i}");
        let t = c
            .submit(submit(session, "echo", Some(&key), i as u64))
            .await?;
        let done = c
            .wait_terminal(&t.turn.turn_id, Duration::from_secs(10))
            .await?;
        assert_eq!(done.status, TurnStatus::Completed);
        finished.push(t.turn.turn_id);
    }
    let waiting = c.submit(submit("mixed", "nobody", None, 9)).await?;
    let finished_at = Instant::now();

    // Deleted within terminal_ms + 2 × sweep_interval_ms (and some slack for a busy
    // machine).
    let bound = Duration::from_millis(TERMINAL_MS + 2 * SWEEP_MS + 1_000);
    loop {
        let mut left = 0;
        for id in &finished {
            if !is_not_found(c.get(id).await) {
                left += 1;
            }
        }
        if left == 0 {
            break;
        }
        assert!(
            finished_at.elapsed() < bound,
            "{left} terminal turns still there {:?} after they finished",
            finished_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        finished_at.elapsed() >= Duration::from_millis(TERMINAL_MS - 50),
        "deleted before terminal_ms had passed"
    );

    // "done" has nothing left: forgotten.
    assert!(is_not_found(c.inspect("done").await), "session done");
    assert!(is_not_found(c.events("done", Some(0), Some(10)).await));
    assert!(c.list(list("done")).await?.turns.is_empty());
    // "mixed" keeps its unfinished turn and only that turn's events.
    let s = c.inspect("mixed").await?;
    assert_eq!((s.turns.completed, s.turns.queued), (0, 1), "{s:?}");
    let listed = c.list(list("mixed")).await?;
    let ids: Vec<&str> = listed.turns.iter().map(|t| t.turn_id.as_str()).collect();
    assert_eq!(ids, vec![waiting.turn.turn_id.as_str()]);
    let events = c.events("mixed", Some(0), Some(100)).await?.events;
    assert!(!events.is_empty());
    assert!(
        events.iter().all(|e| e.turn_id == waiting.turn.turn_id),
        "{events:?}"
    );
    let (_, metrics) = http_get(&d.admin, "/metrics").await?;
    assert_eq!(
        metric(&metrics, "turnd_retention_deleted_turns_total"),
        Some(3.0)
    );

    // A freed idempotency key admits a new turn; "done" starts again at seq 1.
    let again = c.submit(submit("done", "echo", Some("k0"), 100)).await?;
    assert!(!again.deduplicated);
    assert_eq!(again.turn.seq, 1);
    c.wait_terminal(&again.turn.turn_id, Duration::from_secs(10))
        .await?;

    // Across a restart: the unfinished turn is still there (older than terminal_ms by
    // now), the new one expires in turn.
    drop(c);
    w.shutdown();
    let status = d.terminate().await?;
    assert!(status.success(), "turnd exited with {status}");
    let d = start(&data).await?;
    let c = Caller::connect(&d.url, None).await?;
    tokio::time::sleep(Duration::from_millis(TERMINAL_MS + 3 * SWEEP_MS)).await;
    let kept = c.get(&waiting.turn.turn_id).await?;
    assert_eq!(kept.status, TurnStatus::Queued);
    turnd_tests::eventually(5, "the turn admitted before the restart expires", || {
        let c = &c;
        let id = again.turn.turn_id.clone();
        async move { is_not_found(c.get(&id).await).then_some(()) }
    })
    .await?;
    let op = Caller::connect_as(&d.url, turnd_client::turnd_proto::Role::Operator, None).await?;
    let v = op.store_check().await?;
    assert!(v.is_empty(), "store.check: {v:?}");
    let status = d.terminate().await?;
    assert!(status.success(), "turnd exited with {status}");
    Ok(())
}
