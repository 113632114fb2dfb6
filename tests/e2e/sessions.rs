//! `sessions.list` through the real daemon: every wait state a lock holder can be in,
//! the state, function and stuck filters, both orders, paging with the cursor, the
//! counts beside the page, roles and bad arguments.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};
use turnd_client::Caller;
use turnd_proto::{
    OnDeadline, SessionOrder, SessionRow, SessionsListArgs, SessionsListOk, TurnStatus, WaitState,
};
use turnd_tests::{eventually, wait_done, Raw, TestDaemon};

const T: u64 = 15;

async fn list(c: &Caller, args: SessionsListArgs) -> anyhow::Result<SessionsListOk> {
    Ok(c.sessions(&args).await?)
}

fn of_state(state: WaitState) -> SessionsListArgs {
    SessionsListArgs {
        state: Some(state),
        ..Default::default()
    }
}

fn ids(rows: &[SessionRow]) -> Vec<&str> {
    rows.iter().map(|r| r.session_id.as_str()).collect()
}

/// Wait until `session` is listed in `state`, and return its row.
async fn row_in(c: &Caller, session: &str, state: WaitState) -> anyhow::Result<SessionRow> {
    eventually(
        T,
        &format!("{session} listed as {state:?}"),
        || async move {
            let page = c.sessions(&of_state(state)).await.ok()?;
            page.sessions.into_iter().find(|r| r.session_id == session)
        },
    )
    .await
}

async fn next_invoke(w: &mut Raw) -> anyhow::Result<Value> {
    loop {
        let p = w.next_push().await?;
        if p["push"] == "invoke" {
            return Ok(p);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_wait_state_is_listed_and_filtered() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| {
        c.turns.dispatch_timeout_ms = Some(60_000);
        c.turns.retry_backoff_ms = 60_000;
        c.turns.cancel_grace_ms = 60_000;
        c.turns.reconnect_grace_ms = 60_000;
        turnd_tests::quiet_raw_peers(c);
    })
    .await?;
    let c = td.caller().await?;

    // awaiting_worker: nobody serves `nobody`; the second session has a turn queued.
    let aw1 = c.submit_simple("aw-1", "nobody", json!(1)).await?;
    let aw2 = c.submit_simple("aw-2", "nobody", json!(2)).await?;
    c.submit_simple("aw-2", "nobody", json!(3)).await?;

    let (mut w, _) = Raw::hello(
        &td.url,
        "worker",
        json!({"worker_id": "w-list", "instance_id": "i1"}),
    )
    .await?;
    for f in [
        json!({"function_id": "hold", "timeout_ms": 45_000}),
        json!({"function_id": "flaky", "delivery": "at_least_once"}),
        json!({"function_id": "stuck", "timeout_ms": 45_000}),
    ] {
        w.ok("function.register", f).await?;
    }
    // awaiting_result
    let ar = c.submit_simple("ar", "hold", json!(null)).await?;
    let ar_invoke = next_invoke(&mut w).await?;
    // backing_off
    let bo = c.submit_simple("bo", "flaky", json!(null)).await?;
    let bo_invoke = next_invoke(&mut w).await?;
    w.ok(
        "invocation.result",
        json!({"invocation_id": bo_invoke["invocation_id"], "outcome": {"fail": {"code": "busy", "message": "try later", "retryable": true}}}),
    )
    .await?;
    // cancelling
    let cx = c.submit_simple("cx", "stuck", json!(null)).await?;
    next_invoke(&mut w).await?;
    c.stop(&cx.turn_id, "operator asked").await?;
    // awaiting_reconnect: a second worker takes a turn and goes away.
    let (mut gone, _) = Raw::hello(
        &td.url,
        "worker",
        json!({"worker_id": "w-gone", "instance_id": "i1"}),
    )
    .await?;
    gone.ok(
        "function.register",
        json!({"function_id": "gone", "timeout_ms": 45_000}),
    )
    .await?;
    let rc = c.submit_simple("rc", "gone", json!(null)).await?;
    next_invoke(&mut gone).await?;
    drop(gone);

    let r = row_in(&c, "rc", WaitState::AwaitingReconnect).await?;
    assert_eq!(r.turn_id, rc.turn_id);
    assert_eq!(r.function_id, "gone");
    assert_eq!(r.wait.worker_id.as_deref(), Some("w-gone"));
    assert_eq!(r.wait.on_deadline, Some(OnDeadline::Fail));
    assert_eq!(r.wait.deadline_ms, Some(r.wait.since_ms + 60_000));
    assert!(r.wait.reason.contains("w-gone"), "{}", r.wait.reason);
    assert_eq!(r.attempt, 1);

    let r = row_in(&c, "ar", WaitState::AwaitingResult).await?;
    assert_eq!(r.turn_id, ar.turn_id);
    assert_eq!(
        r.wait.invocation_id.as_deref(),
        ar_invoke["invocation_id"].as_str()
    );
    assert_eq!(r.wait.on_deadline, Some(OnDeadline::Probe));
    assert_eq!(r.wait.deadline_ms, ar_invoke["deadline_ms"].as_u64());
    assert_eq!((r.step, r.attempt, r.queued), (0, 1, 0));
    assert!(!r.stuck);

    let r = row_in(&c, "bo", WaitState::BackingOff).await?;
    assert_eq!(r.turn_id, bo.turn_id);
    assert_eq!(r.wait.on_deadline, Some(OnDeadline::Retry));
    assert!(
        r.wait.last_error.as_deref().unwrap_or("").contains("busy"),
        "{r:?}"
    );

    let r = row_in(&c, "cx", WaitState::Cancelling).await?;
    assert_eq!(r.turn_id, cx.turn_id);
    assert_eq!(r.wait.on_deadline, Some(OnDeadline::Cancel));

    let page = list(&c, of_state(WaitState::AwaitingWorker)).await?;
    assert_eq!(ids(&page.sessions), ["aw-1", "aw-2"], "oldest wait first");
    assert_eq!(page.total, 2);
    assert_eq!(page.next, None);
    let (r1, r2) = (&page.sessions[0], &page.sessions[1]);
    assert_eq!((r1.turn_id.as_str(), r1.queued), (aw1.turn_id.as_str(), 0));
    assert_eq!((r2.turn_id.as_str(), r2.queued), (aw2.turn_id.as_str(), 1));
    assert_eq!(r2.wait.on_deadline, Some(OnDeadline::Fail));
    assert_eq!(r2.wait.deadline_ms, Some(r2.wait.since_ms + 60_000));
    assert!(r2.wait.reason.contains("nobody"), "{}", r2.wait.reason);
    assert!(r1.stuck && r2.stuck, "nobody serves `nobody`");
    assert_eq!(r1.attempt, 0);

    // Everything, and the counts of the same query.
    let all = list(&c, SessionsListArgs::default()).await?;
    assert_eq!(all.total, 6);
    assert_eq!(all.sessions.len(), 6);
    let expect: BTreeMap<String, u64> = [
        ("awaiting_worker", 2),
        ("awaiting_result", 1),
        ("awaiting_reconnect", 1),
        ("backing_off", 1),
        ("cancelling", 1),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    assert_eq!(all.counts, expect);
    let since: Vec<u64> = all.sessions.iter().map(|r| r.wait.since_ms).collect();
    let mut sorted = since.clone();
    sorted.sort();
    assert_eq!(since, sorted, "oldest wait first");
    let stats = c.stats().await?;
    assert_eq!(stats.sessions.active, all.total);

    // A queued turn never shows as a lock holder.
    assert_eq!(list(&c, of_state(WaitState::QueuedBehind)).await?.total, 0);

    // Function filter, alone and with a state.
    let by_fn = list(
        &c,
        SessionsListArgs {
            function_id: Some("nobody".into()),
            ..Default::default()
        },
    )
    .await?;
    assert_eq!(ids(&by_fn.sessions), ["aw-1", "aw-2"]);
    assert_eq!(
        by_fn.counts.get("awaiting_worker"),
        Some(&2),
        "{:?}",
        by_fn.counts
    );
    assert_eq!(by_fn.counts.len(), 1);
    let none = list(
        &c,
        SessionsListArgs {
            function_id: Some("nobody".into()),
            state: Some(WaitState::AwaitingResult),
            ..Default::default()
        },
    )
    .await?;
    assert!(none.sessions.is_empty());
    assert_eq!(none.total, 0);
    let both = list(
        &c,
        SessionsListArgs {
            function_id: Some("hold".into()),
            state: Some(WaitState::AwaitingResult),
            ..Default::default()
        },
    )
    .await?;
    assert_eq!(ids(&both.sessions), ["ar"]);

    // Stuck: only the sessions waiting for a function nobody serves.
    let stuck = list(
        &c,
        SessionsListArgs {
            stuck: Some(true),
            ..Default::default()
        },
    )
    .await?;
    assert_eq!(ids(&stuck.sessions), ["aw-1", "aw-2"]);
    assert_eq!(stuck.total, 2);

    // A finished session leaves the list.
    w.ok(
        "invocation.result",
        json!({"invocation_id": ar_invoke["invocation_id"], "outcome": {"complete": 1}}),
    )
    .await?;
    assert_eq!(
        wait_done(&c, &ar.turn_id, T).await?.status,
        TurnStatus::Completed
    );
    let all = list(&c, SessionsListArgs::default()).await?;
    assert_eq!(all.total, 5);
    assert!(!ids(&all.sessions).contains(&"ar"));
    assert_eq!(all.counts.get("awaiting_result"), None);

    // A worker for `nobody` arrives: those sessions are no longer stuck.
    w.ok(
        "function.register",
        json!({"function_id": "nobody", "concurrency": 1}),
    )
    .await?;
    next_invoke(&mut w).await?;
    let stuck = list(
        &c,
        SessionsListArgs {
            stuck: Some(true),
            ..Default::default()
        },
    )
    .await?;
    assert_eq!(stuck.total, 0, "{stuck:?}");
    let r = row_in(&c, "aw-2", WaitState::AwaitingWorker).await?;
    assert!(
        !r.stuck,
        "waits for a free slot of a served function: {r:?}"
    );
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_invocation_turns_stuck_before_its_deadline() -> anyhow::Result<()> {
    let td = TestDaemon::start(turnd_tests::quiet_raw_peers).await?;
    let c = td.caller().await?;
    let (mut w, _) = Raw::hello(
        &td.url,
        "worker",
        json!({"worker_id": "w-quiet", "instance_id": "i1"}),
    )
    .await?;
    w.ok(
        "function.register",
        json!({"function_id": "quiet", "timeout_ms": 4_000}),
    )
    .await?;
    c.submit_simple("quiet-1", "quiet", json!(null)).await?;
    let invoke = next_invoke(&mut w).await?;
    let stuck_args = SessionsListArgs {
        stuck: Some(true),
        ..Default::default()
    };
    let first = list(&c, stuck_args.clone()).await?;
    assert_eq!(first.total, 0, "just dispatched: {first:?}");
    // No heartbeat for more than half the timeout: stuck, while still awaiting the
    // result (the deadline is 4 s after dispatch).
    let row = eventually(T, "stale invocation listed as stuck", || {
        let c = &c;
        let args = stuck_args.clone();
        async move { c.sessions(&args).await.ok()?.sessions.into_iter().next() }
    })
    .await?;
    assert_eq!(row.session_id, "quiet-1");
    assert_eq!(row.wait.state, WaitState::AwaitingResult);
    assert!(row.stuck);
    // A heartbeat makes it fresh again.
    w.ok(
        "invocation.heartbeat",
        json!({"invocation_id": invoke["invocation_id"]}),
    )
    .await?;
    let after = list(&c, stuck_args).await?;
    assert_eq!(after.total, 0, "{after:?}");
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finalizing_is_listed() -> anyhow::Result<()> {
    let td = TestDaemon::start_faulty(turnd_tests::quiet_raw_peers).await?;
    let c = td.caller().await?;
    c.submit_simple("fin", "echo", json!(1)).await?;
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
    let r = row_in(&c, "fin", WaitState::Finalizing).await?;
    assert_eq!(r.wait.on_deadline, Some(OnDeadline::Retry));
    assert!(r.wait.last_error.is_some());
    faults.set_fail_writes(false);
    let invoke = next_invoke(&mut w).await?;
    w.ok(
        "invocation.result",
        json!({"invocation_id": invoke["invocation_id"], "outcome": {"complete": 1}}),
    )
    .await?;
    eventually(T, "fin leaves the list", || async {
        let p = c.sessions(&SessionsListArgs::default()).await.ok()?;
        (p.total == 0).then_some(())
    })
    .await?;
    td.shutdown().await
}

/// Page through everything with `limit`, checking `total` on every page.
async fn all_pages(
    c: &Caller,
    mut args: SessionsListArgs,
    total: u64,
) -> anyhow::Result<Vec<SessionRow>> {
    let mut out = Vec::new();
    let mut pages = 0;
    loop {
        let p = list(c, args.clone()).await?;
        assert_eq!(p.total, total);
        assert!(p.sessions.len() as u64 <= args.limit.unwrap_or(100));
        out.extend(p.sessions);
        pages += 1;
        assert!(pages < 100, "paging does not end");
        match p.next {
            Some(n) => args.after = Some(n),
            None => return Ok(out),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_orders_page_without_gaps_or_repeats() -> anyhow::Result<()> {
    let td = TestDaemon::start(|_| {}).await?;
    let c = td.caller().await?;
    // Submitted in an order that differs from the ids' order; two functions.
    let mut submitted = Vec::new();
    for i in 0..25u32 {
        let name = format!("p{:02}", (i * 7) % 25);
        let f = if i % 2 == 0 { "even" } else { "odd" };
        c.submit_simple(&name, f, json!(i)).await?;
        submitted.push(name);
        if i % 5 == 0 {
            // Distinct wait ages for part of them.
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
    }
    let by_wait = all_pages(
        &c,
        SessionsListArgs {
            limit: Some(7),
            ..Default::default()
        },
        25,
    )
    .await?;
    let keys: Vec<(u64, String)> = by_wait
        .iter()
        .map(|r| (r.wait.since_ms, r.session_id.clone()))
        .collect();
    let mut sorted = keys.clone();
    sorted.sort();
    assert_eq!(keys, sorted, "oldest wait first, then by id");
    assert_eq!(keys.len(), 25);
    assert_eq!(keys[0].1, "p00", "the first submitted waits longest");

    let by_id = all_pages(
        &c,
        SessionsListArgs {
            limit: Some(4),
            order: Some(SessionOrder::Id),
            ..Default::default()
        },
        25,
    )
    .await?;
    let got: Vec<&str> = ids(&by_id);
    let mut expect: Vec<&str> = submitted.iter().map(String::as_str).collect();
    expect.sort();
    assert_eq!(got, expect);
    assert_ne!(
        ids(&by_wait),
        got,
        "the two orders differ for these sessions"
    );

    // Paging with a filter.
    let odd = all_pages(
        &c,
        SessionsListArgs {
            function_id: Some("odd".into()),
            limit: Some(5),
            order: Some(SessionOrder::Id),
            ..Default::default()
        },
        12,
    )
    .await?;
    assert!(odd.iter().all(|r| r.function_id == "odd"));
    let odd_ids = ids(&odd);
    let mut s = odd_ids.clone();
    s.sort();
    s.dedup();
    assert_eq!(odd_ids, s);
    let even = all_pages(
        &c,
        SessionsListArgs {
            function_id: Some("even".into()),
            state: Some(WaitState::AwaitingWorker),
            limit: Some(5),
            ..Default::default()
        },
        13,
    )
    .await?;
    assert_eq!(even.len(), 13);

    // A cursor of the other order, or garbage, is refused.
    let p = list(
        &c,
        SessionsListArgs {
            limit: Some(3),
            ..Default::default()
        },
    )
    .await?;
    let next = p.next.expect("more pages");
    let (mut raw, _) = Raw::hello(&td.url, "client", json!({})).await?;
    for bad in [
        json!({"order": "id", "after": next}),
        json!({"after": "nonsense"}),
        json!({"limit": 0}),
        json!({"limit": 1001}),
        json!({"state": "sleeping"}),
        json!({"order": "random"}),
        json!({"function_id": ""}),
    ] {
        assert_eq!(
            raw.error_code("sessions.list", bad.clone()).await?,
            "bad_request",
            "{bad}"
        );
    }
    let ok = raw
        .ok("sessions.list", json!({"order": "wait", "after": next}))
        .await?;
    assert_eq!(ok["total"], 25);
    assert_eq!(ok["sessions"].as_array().map(Vec::len), Some(25 - 3));
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_and_an_empty_daemon() -> anyhow::Result<()> {
    let td = TestDaemon::start(|_| {}).await?;
    let (mut op, _) = Raw::hello(&td.url, "operator", json!({})).await?;
    let ok = op.ok("sessions.list", json!(null)).await?;
    assert_eq!(
        ok,
        json!({"sessions": [], "next": null, "total": 0, "counts": {}})
    );
    let (mut w, _) = Raw::hello(&td.url, "worker", json!({"worker_id": "w-r"})).await?;
    assert_eq!(w.error_code("sessions.list", json!({})).await?, "forbidden");
    td.shutdown().await
}
