//! The engine's timers on paused tokio time, with the default (long) timer values:
//! every deadline is reached by advancing the clock, never by sleeping.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use turnd_engine::{Caller, Outbox};
use turnd_proto::*;
use turnd_store::mem::MemKv;
use turnd_store::{check_store, Store};

mod common;
use common::*;

async fn advance(ms: u64) {
    tokio::time::advance(Duration::from_millis(ms)).await;
    settle().await;
}

fn wait_of<J>(t: &Turn<J>) -> Wait {
    t.wait
        .clone()
        .expect("a non-terminal turn says what it waits for")
}

#[tokio::test(start_paused = true)]
async fn a_dead_worker_fails_an_at_most_once_turn_exactly_at_the_grace() -> R {
    let store = Store::new(Arc::new(MemKv::new()));
    let e = open(&store).await;
    let (ob, mut rx) = Outbox::new("c1".into(), 64);
    e.worker_hello(&hello("w", "i1"), ob).await?;
    e.register("w", &register("f", Delivery::AtMostOnce))?;
    let t = e.submit(submit("s", "f")).await?.turn;
    settle().await;
    let invoke = next_frame(&mut rx);
    assert_eq!(invoke["push"], "invoke");

    e.worker_disconnected("w", "c1").await;
    let waiting = e.get_turn(&t.turn_id).await?;
    let w = wait_of(&waiting);
    assert_eq!(w.state, WaitState::AwaitingReconnect);
    assert_eq!(w.on_deadline, Some(OnDeadline::Fail));
    assert_eq!(
        w.deadline_ms,
        Some(w.since_ms + 10_000),
        "default reconnect_grace_ms"
    );

    advance(9_999).await;
    assert_eq!(e.get_turn(&t.turn_id).await?.status, TurnStatus::Running);
    advance(1).await;
    let failed = e.get_turn(&t.turn_id).await?;
    assert_eq!(failed.status, TurnStatus::Failed);
    let err = failed.error.expect("a cause");
    assert_eq!(err.cause, ErrorCause::OutcomeUnknown);
    assert_eq!(
        err.invocation_id.as_deref(),
        invoke["invocation_id"].as_str()
    );
    assert_eq!(
        failed.finished_at_ms, w.deadline_ms,
        "ended exactly at the deadline"
    );
    assert!(check_store(&store)?.is_empty());
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_silent_attempt_is_probed_at_its_deadline_then_given_up() -> R {
    let store = Store::new(Arc::new(MemKv::new()));
    let e = open(&store).await;
    let (ob, mut rx) = Outbox::new("c1".into(), 64);
    e.worker_hello(&hello("w", "i1"), ob).await?;
    e.register("w", &register("f", Delivery::AtLeastOnce))?;
    let t = e.submit(submit("s", "f")).await?.turn;
    settle().await;
    let first = next_frame(&mut rx);
    let w = wait_of(&e.get_turn(&t.turn_id).await?);
    assert_eq!(w.state, WaitState::AwaitingResult);
    assert_eq!(w.on_deadline, Some(OnDeadline::Probe));
    assert_eq!(w.deadline_ms, first["deadline_ms"].as_u64());
    assert_eq!(
        w.deadline_ms,
        Some(w.since_ms + 30_000),
        "default timeout_ms"
    );

    advance(30_000).await;
    let probe = next_frame(&mut rx);
    assert_eq!(probe["push"], "probe");
    assert_eq!(probe["invocation_id"], first["invocation_id"]);
    let w = wait_of(&e.get_turn(&t.turn_id).await?);
    assert_eq!(
        w.on_deadline,
        Some(OnDeadline::Redispatch),
        "at_least_once with attempts left"
    );
    assert_eq!(
        w.deadline_ms,
        Some(w.since_ms + 2_000),
        "default probe_timeout_ms"
    );

    // No answer to the probe: outcome unknown, attempt 2 dispatched to the worker.
    advance(2_000).await;
    let second = next_frame(&mut rx);
    assert_eq!(second["push"], "invoke");
    assert_eq!(second["attempt"], 2);
    assert_ne!(second["invocation_id"], first["invocation_id"]);
    let kinds: Vec<EventKind> = e
        .events(EventsArgs {
            session_id: "s".into(),
            after: None,
            limit: None,
        })
        .await?
        .events
        .iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(
        kinds,
        [
            EventKind::Admitted,
            EventKind::Dispatched,
            EventKind::ProbeSent,
            EventKind::OutcomeUnknown,
            EventKind::Redispatched
        ]
    );
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn retry_backoff_doubles_and_is_visible() -> R {
    let store = Store::new(Arc::new(MemKv::new()));
    let e = open(&store).await;
    let (ob, mut rx) = Outbox::new("c1".into(), 64);
    e.worker_hello(&hello("w", "i1"), ob).await?;
    let mut args = register("f", Delivery::AtLeastOnce);
    args.max_attempts = Some(3);
    e.register("w", &args)?;
    let worker = Caller {
        role: Role::Worker,
        worker_id: Some("w".into()),
    };
    let t = e.submit(submit("s", "f")).await?.turn;
    let fail = Outcome::Fail(Failure {
        code: "busy".into(),
        message: "later".into(),
        retryable: true,
    });
    for (attempt, backoff) in [(1u64, 500u64), (2, 1_000)] {
        settle().await;
        let invoke = next_frame(&mut rx);
        assert_eq!(invoke["attempt"], attempt);
        let id = invoke["invocation_id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let ok = e
            .result(
                &worker,
                ResultArgs {
                    invocation_id: id,
                    outcome: fail.clone(),
                },
            )
            .await?;
        assert_eq!(ok.accepted, Accepted::Applied);
        let w = wait_of(&e.get_turn(&t.turn_id).await?);
        assert_eq!(w.state, WaitState::BackingOff);
        assert_eq!(w.on_deadline, Some(OnDeadline::Retry));
        assert_eq!(
            w.deadline_ms,
            Some(w.since_ms + backoff),
            "attempt {attempt}"
        );
        advance(backoff - 1).await;
        assert!(
            rx.try_recv().is_err(),
            "no dispatch before the backoff ends"
        );
        advance(1).await;
    }
    settle().await;
    let third = next_frame(&mut rx);
    assert_eq!(third["attempt"], 3);
    let id = third["invocation_id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    e.result(
        &worker,
        ResultArgs {
            invocation_id: id,
            outcome: fail,
        },
    )
    .await?;
    let done = e.get_turn(&t.turn_id).await?;
    assert_eq!(done.status, TurnStatus::Failed);
    assert_eq!(
        done.error.map(|e| e.cause),
        Some(ErrorCause::AttemptsExhausted)
    );
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_restart_gives_in_flight_work_a_fresh_grace_and_keeps_the_queue() -> R {
    let store = Store::new(Arc::new(MemKv::new()));
    let first = open(&store).await;
    let (ob, _rx) = Outbox::new("c1".into(), 64);
    first.worker_hello(&hello("w", "i1"), ob).await?;
    first.register("w", &register("f", Delivery::AtMostOnce))?;
    let a = first.submit(submit("s", "f")).await?.turn;
    let b = first.submit(submit("s", "f")).await?.turn;
    settle().await;
    first.shutdown();
    drop(first);

    advance(60_000).await;
    let second = open(&store).await;
    settle().await;
    let w = wait_of(&second.get_turn(&a.turn_id).await?);
    assert_eq!(w.state, WaitState::AwaitingReconnect);
    assert_eq!(
        w.deadline_ms,
        Some(second.now_ms() + 10_000),
        "a fresh grace from the restart"
    );
    assert_eq!(
        wait_of(&second.get_turn(&b.turn_id).await?).state,
        WaitState::QueuedBehind
    );

    // The same instance comes back with the step still running: kept.
    let (ob, mut rx) = Outbox::new("c2".into(), 64);
    let mut h = hello("w", "i1");
    h.inflight = vec![w.invocation_id.clone().unwrap_or_default()];
    let rec = second.worker_hello(&h, ob).await?;
    assert_eq!(rec.kept, h.inflight);
    second.register("w", &register("f", Delivery::AtMostOnce))?;
    let worker = Caller {
        role: Role::Worker,
        worker_id: Some("w".into()),
    };
    let ok = second
        .result(
            &worker,
            ResultArgs {
                invocation_id: h.inflight[0].clone(),
                outcome: Outcome::Complete(json!(1)),
            },
        )
        .await?;
    assert_eq!(ok.accepted, Accepted::Applied);
    settle().await;
    let next = next_frame(&mut rx);
    assert_eq!(
        next["turn_id"],
        json!(b.turn_id),
        "the queued turn runs next"
    );
    assert!(check_store(&store)?.is_empty());
    Ok(())
}
