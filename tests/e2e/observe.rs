//! What operators see: every wait state with its reason, since, deadline and
//! on_deadline; inspect, stats and /metrics agreeing with it; in-flight work never
//! hidden; watch delivering every event once, in order, across a reconnect.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use turnd_client::Caller;
use turnd_proto::{Event, OnDeadline, Turn, TurnStatus, Wait, WaitState, WatchArgs};
use turnd_tests::{eventually, http_get, metric, wait_done, Raw, TestDaemon};

const T: u64 = 15;

/// Wait until the turn's wait is in `state`.
async fn wait_state(c: &Caller, turn_id: &str, state: WaitState) -> anyhow::Result<(Turn, Wait)> {
    eventually(T, &format!("wait state {state:?}"), || async move {
        let t = c.get(turn_id).await.ok()?;
        let w = t.wait.clone()?;
        (w.state == state).then_some((t, w))
    })
    .await
}

/// The inspect view, stats and /metrics all show the session in `state`.
async fn assert_everywhere(
    td: &TestDaemon,
    c: &Caller,
    session: &str,
    turn_id: &str,
    state: WaitState,
) -> anyhow::Result<()> {
    let s = c.inspect(session).await?;
    let lock = s.lock.clone().expect("a lock holder");
    if lock.turn_id == turn_id {
        assert_eq!(lock.wait.state, state, "inspect lock: {lock:?}");
        assert!(!lock.wait.reason.is_empty());
    }
    let stats = c.stats().await?;
    assert!(
        stats
            .sessions
            .blocked
            .get(state.as_str())
            .copied()
            .unwrap_or(0)
            >= 1,
        "stats.sessions.blocked lacks {state:?}: {:?}",
        stats.sessions.blocked
    );
    let (code, body) = http_get(&td.admin, "/metrics").await?;
    assert_eq!(code, 200);
    let sample = format!("turnd_sessions_waiting{{state=\"{}\"}}", state.as_str());
    assert!(
        metric(&body, &sample).unwrap_or(0.0) >= 1.0,
        "{sample} missing in\n{body}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_behind_and_awaiting_worker() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| c.turns.dispatch_timeout_ms = Some(60_000)).await?;
    let c = td.caller().await?;
    let a = c
        .submit_simple("qb", "nobody.serves.this", json!(1))
        .await?;
    let b = c
        .submit_simple("qb", "nobody.serves.this", json!(2))
        .await?;
    let (ta, wa) = wait_state(&c, &a.turn_id, WaitState::AwaitingWorker).await?;
    assert_eq!(ta.status, TurnStatus::Queued, "never dispatched");
    assert!(
        wa.reason
            .starts_with("no worker has registered nobody.serves.this"),
        "{}",
        wa.reason
    );
    assert_eq!(wa.on_deadline, Some(OnDeadline::Fail));
    let deadline = wa
        .deadline_ms
        .expect("dispatch_timeout_ms gives a deadline");
    assert_eq!(deadline, wa.since_ms + 60_000);
    let (_, wb) = wait_state(&c, &b.turn_id, WaitState::QueuedBehind).await?;
    assert_eq!(wb.ahead, Some(1));
    assert!(wb.reason.contains(&a.turn_id), "{}", wb.reason);
    assert_eq!(wb.deadline_ms, None);
    let s = c.inspect("qb").await?;
    assert_eq!(s.queued.len(), 1);
    assert_eq!(s.queued[0].turn_id, b.turn_id);
    assert_eq!(s.turns.queued, 2);
    assert_everywhere(&td, &c, "qb", &a.turn_id, WaitState::AwaitingWorker).await?;
    let f = c.functions().await?;
    let entry = f
        .iter()
        .find(|f| f.function_id == "nobody.serves.this")
        .expect("listed");
    assert_eq!(entry.workers, 0);
    assert_eq!(entry.queued, 1, "one session waits for it");
    let s = c.inspect("qb").await?;
    let lock = s.lock.expect("a lock holder");
    assert!(
        lock.wait.reason.starts_with("no worker has registered"),
        "{}",
        lock.wait.reason
    );
    td.shutdown().await
}

/// The reason of an `awaiting_worker` wait tells a function no worker ever
/// registered from one whose workers are gone and from one whose workers are busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn awaiting_worker_says_why_no_worker_runs_it() -> anyhow::Result<()> {
    let td = TestDaemon::start(|_| {}).await?;
    let c = td.caller().await?;
    // A worker of concurrency 1 whose handler never returns: the first turn holds its
    // only slot, so a second session's turn waits for a busy worker.
    let w = turnd_client::Worker::new(turnd_tests::worker_options(&td.url, "w-busy")).function(
        turnd_client::FunctionSpec::new("busy").concurrency(1),
        |_ctx| async move { std::future::pending::<turnd_proto::Outcome>().await },
    );
    let stop = tokio_util::sync::CancellationToken::new();
    let h = w.spawn(stop.clone());
    h.connected().await;
    let first = c.submit_simple("b1", "busy", json!(1)).await?;
    eventually(T, "the first turn runs", || async {
        let t = c.get(&first.turn_id).await.ok()?;
        (t.status == TurnStatus::Running).then_some(())
    })
    .await?;
    let second = c.submit_simple("b2", "busy", json!(2)).await?;
    let (_, w2) = wait_state(&c, &second.turn_id, WaitState::AwaitingWorker).await?;
    assert!(
        w2.reason
            .starts_with("all 1 connected worker(s) serving busy are busy"),
        "{}",
        w2.reason
    );
    // The worker goes away: its function is still known, but nobody serves it.
    stop.cancel();
    h.join().await?;
    eventually(T, "the reason after the worker left", || async {
        let t = c.get(&second.turn_id).await.ok()?;
        let r = t.wait?.reason;
        r.starts_with("no connected worker serves busy")
            .then_some(())
    })
    .await?;
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn awaiting_result_then_reconnect_and_in_flight_work_is_counted() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| {
        c.turns.reconnect_grace_ms = 60_000;
        turnd_tests::quiet_raw_peers(c);
    })
    .await?;
    let c = td.caller().await?;
    let (mut w, _) = Raw::hello(
        &td.url,
        "worker",
        json!({"worker_id": "w-obs", "instance_id": "i1"}),
    )
    .await?;
    w.ok(
        "function.register",
        json!({"function_id": "hold", "timeout_ms": 45_000}),
    )
    .await?;
    let t = c.submit_simple("ar", "hold", json!(null)).await?;
    let invoke = w.next_push().await?;
    let inv = invoke["invocation_id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let (turn, wait) = wait_state(&c, &t.turn_id, WaitState::AwaitingResult).await?;
    assert_eq!(turn.status, TurnStatus::Running);
    assert_eq!(wait.invocation_id.as_deref(), Some(inv.as_str()));
    assert_eq!(wait.worker_id.as_deref(), Some("w-obs"));
    assert_eq!(wait.on_deadline, Some(OnDeadline::Probe));
    assert_eq!(
        Some(wait.deadline_ms.expect("deadline")),
        invoke["deadline_ms"].as_u64()
    );
    assert_everywhere(&td, &c, "ar", &t.turn_id, WaitState::AwaitingResult).await?;
    // In-flight work is never hidden: counted in stats and /metrics.
    let stats = c.stats().await?;
    assert_eq!(stats.invocations_inflight, 1);
    assert_eq!(stats.turns.running, 1);
    assert_eq!(stats.sessions.active, 1);
    assert!(stats.oldest_wait_ms.is_some());
    let (_, body) = http_get(&td.admin, "/metrics").await?;
    assert_eq!(
        metric(&body, "turnd_invocations_inflight"),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        metric(&body, "turnd_turns{status=\"running\"}"),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        metric(&body, "turnd_connections{role=\"worker\"}"),
        Some(1.0),
        "{body}"
    );
    let workers = c.workers().await?;
    assert_eq!(
        workers
            .iter()
            .find(|x| x.worker_id == "w-obs")
            .map(|x| x.inflight),
        Some(1)
    );

    // The worker goes away: its invocation waits for the reconnect, with a deadline.
    drop(w);
    let (_, wait) = wait_state(&c, &t.turn_id, WaitState::AwaitingReconnect).await?;
    assert_eq!(
        wait.on_deadline,
        Some(OnDeadline::Fail),
        "at_most_once fails at the deadline"
    );
    assert_eq!(wait.deadline_ms, Some(wait.since_ms + 60_000));
    assert!(wait.reason.contains("w-obs"), "{}", wait.reason);
    assert_everywhere(&td, &c, "ar", &t.turn_id, WaitState::AwaitingReconnect).await?;
    assert_eq!(
        c.stats().await?.invocations_inflight,
        1,
        "still in flight while awaiting the reconnect"
    );
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backing_off_and_cancelling() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| {
        c.turns.retry_backoff_ms = 60_000;
        c.turns.cancel_grace_ms = 60_000;
        turnd_tests::quiet_raw_peers(c);
    })
    .await?;
    let c = td.caller().await?;
    let (mut w, _) = Raw::hello(
        &td.url,
        "worker",
        json!({"worker_id": "w-bo", "instance_id": "i1"}),
    )
    .await?;
    w.ok(
        "function.register",
        json!({"function_id": "flaky", "delivery": "at_least_once"}),
    )
    .await?;
    w.ok("function.register", json!({"function_id": "stuck"}))
        .await?;
    let t = c.submit_simple("bo", "flaky", json!(null)).await?;
    let invoke = w.next_push().await?;
    let r = w
        .ok(
            "invocation.result",
            json!({"invocation_id": invoke["invocation_id"], "outcome": {"fail": {"code": "busy", "message": "try later", "retryable": true}}}),
        )
        .await?;
    assert_eq!(r["accepted"], "applied");
    let (_, wait) = wait_state(&c, &t.turn_id, WaitState::BackingOff).await?;
    assert_eq!(wait.on_deadline, Some(OnDeadline::Retry));
    assert_eq!(wait.deadline_ms, Some(wait.since_ms + 60_000));
    assert!(
        wait.last_error.as_deref().unwrap_or("").contains("busy"),
        "{wait:?}"
    );
    assert_everywhere(&td, &c, "bo", &t.turn_id, WaitState::BackingOff).await?;

    let s = c.submit_simple("cx", "stuck", json!(null)).await?;
    let _invoke = w.next_push().await?;
    let stopped = c.stop(&s.turn_id, "operator asked").await?;
    let wait = stopped.wait.clone().expect("still waiting for the cancel");
    assert_eq!(wait.state, WaitState::Cancelling);
    assert_eq!(wait.on_deadline, Some(OnDeadline::Cancel));
    assert_eq!(wait.deadline_ms, Some(wait.since_ms + 60_000));
    let cancel = w.next_push().await?;
    assert_eq!(cancel["push"], "cancel");
    assert_everywhere(&td, &c, "cx", &s.turn_id, WaitState::Cancelling).await?;
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finalizing_is_visible_and_readyz_fails() -> anyhow::Result<()> {
    let td = TestDaemon::start_faulty(turnd_tests::quiet_raw_peers).await?;
    let c = td.caller().await?;
    let t = c.submit_simple("fin", "echo", json!(1)).await?;
    let faults = td.faults.clone().expect("faulty store");
    faults.set_fail_writes(true);
    let (mut w, _) = Raw::hello(
        &td.url,
        "worker",
        json!({"worker_id": "w-fin", "instance_id": "i1"}),
    )
    .await?;
    w.ok("function.register", json!({"function_id": "echo"}))
        .await?;
    let (_, wait) = wait_state(&c, &t.turn_id, WaitState::Finalizing).await?;
    assert_eq!(wait.on_deadline, Some(OnDeadline::Retry));
    assert!(wait.last_error.is_some());
    assert_everywhere(&td, &c, "fin", &t.turn_id, WaitState::Finalizing).await?;
    let (code, body) = http_get(&td.admin, "/readyz").await?;
    assert_eq!(code, 503, "{body}");
    let (_, m) = http_get(&td.admin, "/metrics").await?;
    assert_eq!(metric(&m, "turnd_storage_writable"), Some(0.0));
    faults.set_fail_writes(false);
    let invoke = w.next_push().await?;
    w.ok(
        "invocation.result",
        json!({"invocation_id": invoke["invocation_id"], "outcome": {"complete": 1}}),
    )
    .await?;
    assert_eq!(
        wait_done(&c, &t.turn_id, T).await?.status,
        TurnStatus::Completed
    );
    assert_eq!(http_get(&td.admin, "/readyz").await?.0, 200);
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_delivers_every_event_once_in_order_across_a_reconnect() -> anyhow::Result<()> {
    let td = TestDaemon::start(|_| {}).await?;
    let c = td.caller().await?;
    let worker = turnd_tests::echo_worker(&td.url, "w-watch", 4).await;
    let first = c.submit_simple("wt", "echo", json!(0)).await?;
    wait_done(&c, &first.turn_id, T).await?;

    // Watch from the start (after 0), read a few events, lose the connection.
    let watcher = Caller::connect(&td.url, None).await?;
    let mut stream = watcher
        .watch(WatchArgs {
            session_id: Some("wt".into()),
            turn_id: None,
            after: Some(0),
            progress: false,
        })
        .await?;
    let mut seen: Vec<u64> = Vec::new();
    for _ in 0..3 {
        let e = tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await?
            .expect("event");
        seen.push(e.seq);
    }
    watcher.connection().close().await;
    drop(stream);

    // Work goes on while nobody watches.
    let mut ids = Vec::new();
    for i in 1..=5 {
        ids.push(c.submit_simple("wt", "echo", json!(i)).await?.turn_id);
    }
    // Resume from the last seq seen; a second watcher sees the live stream.
    let watcher2 = Caller::connect(&td.url, None).await?;
    let last = *seen.last().expect("saw events");
    let mut stream2 = watcher2
        .watch(WatchArgs {
            session_id: Some("wt".into()),
            turn_id: None,
            after: Some(last),
            progress: false,
        })
        .await?;
    for id in &ids {
        wait_done(&c, id, T).await?;
    }
    let total = c.inspect("wt").await?.last_event;
    while seen.last().copied() != Some(total) {
        let e = tokio::time::timeout(Duration::from_secs(5), stream2.next())
            .await?
            .expect("event");
        seen.push(e.seq);
    }
    let expect: Vec<u64> = (1..=total).collect();
    assert_eq!(seen, expect, "every event once, in order, no gap");

    // Two watchers of one session both get each new event once.
    let mut a = watcher2
        .watch(WatchArgs {
            session_id: Some("wt".into()),
            turn_id: None,
            after: None,
            progress: false,
        })
        .await?;
    let t = c.submit_simple("wt", "echo", json!("x")).await?;
    wait_done(&c, &t.turn_id, T).await?;
    let end = c.inspect("wt").await?.last_event;
    let mut got_a = Vec::new();
    let mut got_2 = Vec::new();
    while got_a.last().copied() != Some(end) {
        got_a.push(
            tokio::time::timeout(Duration::from_secs(5), a.next())
                .await?
                .expect("event")
                .seq,
        );
    }
    while got_2.last().copied() != Some(end) {
        got_2.push(
            tokio::time::timeout(Duration::from_secs(5), stream2.next())
                .await?
                .expect("event")
                .seq,
        );
    }
    assert_eq!(got_a, (total + 1..=end).collect::<Vec<_>>());
    assert_eq!(got_a, got_2);
    worker.shutdown();
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_terminal_transitions_by_cause_and_health_answers() -> anyhow::Result<()> {
    let td = TestDaemon::start(turnd_tests::quiet_raw_peers).await?;
    let c = td.caller().await?;
    let (mut w, _) = Raw::hello(
        &td.url,
        "worker",
        json!({"worker_id": "w-m", "instance_id": "i1"}),
    )
    .await?;
    w.ok("function.register", json!({"function_id": "f"}))
        .await?;
    let mut turns = Vec::new();
    for outcome in [
        json!({"complete": 1}),
        json!({"fail": {"code": "bad", "message": "no"}}),
    ] {
        let t = c.submit_simple("m", "f", Value::Null).await?;
        let invoke = w.next_push().await?;
        w.ok(
            "invocation.result",
            json!({"invocation_id": invoke["invocation_id"], "outcome": outcome}),
        )
        .await?;
        turns.push(wait_done(&c, &t.turn_id, T).await?);
    }
    assert_eq!(
        turns[1].error.as_ref().map(|e| e.cause.as_str()),
        Some("handler_failed")
    );
    let (code, body) = http_get(&td.admin, "/metrics").await?;
    assert_eq!(code, 200);
    assert_eq!(
        metric(
            &body,
            "turnd_terminal_transitions_total{status=\"completed\",cause=\"\"}"
        ),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        metric(
            &body,
            "turnd_terminal_transitions_total{status=\"failed\",cause=\"handler_failed\"}"
        ),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        metric(&body, "turnd_results_total{accepted=\"applied\"}"),
        Some(2.0),
        "{body}"
    );
    assert_eq!(metric(&body, "turnd_admissions_total"), Some(2.0), "{body}");
    let commits = metric(&body, "turnd_storage_commits_total").unwrap_or(0.0);
    assert!(commits >= 1.0, "{body}");
    // Every group commit is in the histogram of its sync's duration.
    let syncs = "turnd_storage_sync_duration_seconds";
    assert_eq!(
        metric(&body, &format!("{syncs}_count")),
        Some(commits),
        "{body}"
    );
    assert_eq!(
        metric(&body, &format!("{syncs}_bucket{{le=\"+Inf\"}}")),
        Some(commits),
        "{body}"
    );
    assert_eq!(http_get(&td.admin, "/healthz").await?.0, 200);
    assert_eq!(http_get(&td.admin, "/nope").await?.0, 404);
    td.shutdown().await
}

/// A turn that ends within `storage.apply_delay_ms` of its admission never reaches
/// sled: its record (created at admission) and its invocation's (created at
/// dispatch) wait in the overlay, and their deletes when it ends are dropped rather
/// than written, as `turnd_storage_dropped_deletes_total` counts. The turn's
/// answer and its finished record are read back all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_ending_within_the_apply_delay_leaves_no_deletes_to_write() -> anyhow::Result<()> {
    let td = TestDaemon::start(|cfg| {
        cfg.storage.apply_interval_ms = 10;
        cfg.storage.apply_delay_ms = 2_000;
    })
    .await?;
    let c = td.caller().await?;
    let _worker = turnd_tests::echo_worker(&td.url, "w-d", 1).await;
    let t = c.submit_simple("d", "echo", json!(7)).await?;
    wait_done(&c, &t.turn_id, T).await?;
    let admin = td.admin.clone();
    let dropped = eventually(T, "the turn's deletes to be dropped", || {
        let admin = admin.clone();
        async move {
            let (_, body) = http_get(&admin, "/metrics").await.ok()?;
            metric(&body, "turnd_storage_dropped_deletes_total").filter(|n| *n >= 2.0)
        }
    })
    .await?;
    assert_eq!(dropped, 2.0, "the turn's record and its invocation's");
    // sled kept up: no group commit waited for it.
    let (_, body) = http_get(&td.admin, "/metrics").await?;
    assert_eq!(
        metric(&body, "turnd_storage_full_overlay_waits_total"),
        Some(0.0)
    );
    assert_eq!(
        metric(&body, "turnd_storage_full_overlay_wait_seconds_total"),
        Some(0.0)
    );
    let read = c.get(&t.turn_id).await?;
    assert_eq!(read.status, TurnStatus::Completed);
    assert_eq!(read.output, Some(json!(7)));
    td.shutdown().await
}

/// A session's event values committed within one round of the applier reach sled
/// as one value (`turnd_storage_merged_event_values_total` counts the others), and
/// `session.events` reads every event once and in order: before, after the values
/// went to sled, and after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_event_values_of_a_round_read_back_whole_and_in_order() -> anyhow::Result<()> {
    let dir = Arc::new(tempfile::tempdir()?);
    // One round a second, after the turns below are done: it takes all their event
    // values at once.
    let config = |cfg: &mut turnd_server::config::Config| {
        cfg.storage.apply_interval_ms = 1_000;
        cfg.storage.apply_delay_ms = 200;
    };
    let td = TestDaemon::start_in(dir.clone(), config, false).await?;
    let c = td.caller().await?;
    let worker = turnd_tests::echo_worker(&td.url, "w-m", 4).await;
    turnd_tests::echo_turns(&c, "merged", 0, 6).await?;
    let seqs = |events: &[Event]| events.iter().map(|e| e.seq).collect::<Vec<_>>();
    let before = turnd_tests::all_events(&c, "merged").await?;
    let want: Vec<u64> = (1..=before.len() as u64).collect();
    assert_eq!(seqs(&before), want);
    let admin = td.admin.clone();
    let merged = eventually(T, "every event value to be in sled", || {
        let admin = admin.clone();
        async move {
            let (_, body) = http_get(&admin, "/metrics").await.ok()?;
            let merged = metric(&body, "turnd_storage_merged_event_values_total")?;
            let left = metric(&body, "turnd_storage_unapplied_keys")?;
            (merged >= 1.0 && left == 0.0).then_some(merged)
        }
    })
    .await?;
    // Six turns write twelve values (an admission's; a result's, which dispatches
    // the next turn); a round takes them together.
    assert!(merged >= 1.0, "{merged} values merged");
    let after = turnd_tests::all_events(&c, "merged").await?;
    assert_eq!(after, before);
    drop(c);
    drop(worker);
    td.shutdown().await?;
    let td = TestDaemon::start_in(dir, config, false).await?;
    let c = td.caller().await?;
    assert_eq!(turnd_tests::all_events(&c, "merged").await?, before);
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_registering_during_admission_is_never_missed() -> anyhow::Result<()> {
    // A turn admitted while its function's first worker registers must be
    // dispatched: the session is noted as waiting in the same critical section
    // as its failed reservation, so the registration wakes it.
    let td = TestDaemon::start(|_| {}).await?;
    let c = td.caller().await?;
    for i in 0..40 {
        let function = format!("race-{i}");
        let session = format!("race-{i}");
        let submit = c.submit_simple(&session, &function, json!(i));
        let url = td.url.clone();
        let f2 = function.clone();
        let worker = tokio::spawn(async move {
            let (mut w, _) = Raw::hello(
                &url,
                "worker",
                json!({"worker_id": format!("w-{f2}"), "instance_id": "i"}),
            )
            .await?;
            w.ok("function.register", json!({"function_id": f2}))
                .await?;
            let invoke = w.next_push().await?;
            w.ok(
                "invocation.result",
                json!({"invocation_id": invoke["invocation_id"], "outcome": {"complete": true}}),
            )
            .await?;
            anyhow::Ok(w)
        });
        let t = submit.await?;
        let done = wait_done(&c, &t.turn_id, 5).await?;
        assert_eq!(done.status, TurnStatus::Completed, "iteration {i}");
        drop(worker.await??);
    }
    td.shutdown().await
}
