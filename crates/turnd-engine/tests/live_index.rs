//! The in-memory index of unfinished turns (turn id → session) follows every way a
//! turn starts and ends, and is rebuilt by recovery: it never keeps an ended turn.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::sync::Arc;

use serde_json::json;
use tokio::sync::mpsc::Receiver;
use turnd_engine::{Caller, Outbox};
use turnd_proto::*;
use turnd_store::mem::MemKv;
use turnd_store::Store;

mod common;
use common::*;

/// The invocation id of the next `invoke` push queued for the worker.
fn next_invocation(rx: &mut Receiver<String>) -> String {
    let f = next_frame(rx);
    assert_eq!(f["push"], "invoke", "{f}");
    f["invocation_id"].as_str().expect("an id").to_string()
}

#[tokio::test(start_paused = true)]
async fn the_live_turn_index_holds_exactly_the_unfinished_turns() -> R {
    let store = Store::new(Arc::new(MemKv::new()));
    let e = open(&store).await;
    let (ob, mut rx) = Outbox::new("c1".into(), 64);
    e.worker_hello(&hello("w", "i1"), ob).await?;
    e.register("w", &register("f", Delivery::AtLeastOnce))?;
    let worker = Caller {
        role: Role::Worker,
        worker_id: Some("w".into()),
    };
    let a = e.submit(submit("s", "f")).await?.turn;
    let b = e.submit(submit("s", "f")).await?.turn;
    let c = e.submit(submit("s", "f")).await?.turn;
    e.submit(submit("other", "nobody")).await?;
    settle().await;
    assert_eq!(e.live_turn_index_len(), 4, "four unfinished turns");

    // Stopped while queued: out of the index.
    e.stop_turn(&c.turn_id, None).await?;
    assert_eq!(e.live_turn_index_len(), 3);
    // Completed by its worker: out; the next one is dispatched and stays in.
    let inv = next_invocation(&mut rx);
    let args = ResultArgs {
        invocation_id: inv,
        outcome: Outcome::Complete(json!("a")),
    };
    e.result(&worker, args).await?;
    settle().await;
    assert_eq!(e.get_turn(&a.turn_id).await?.status, TurnStatus::Completed);
    assert_eq!(e.live_turn_index_len(), 2);
    // Failed by its worker (not retryable): out.
    let inv = next_invocation(&mut rx);
    let args = ResultArgs {
        invocation_id: inv,
        outcome: Outcome::Fail(Failure {
            code: "bad".into(),
            message: "no".into(),
            retryable: false,
        }),
    };
    e.result(&worker, args).await?;
    settle().await;
    assert_eq!(e.get_turn(&b.turn_id).await?.status, TurnStatus::Failed);
    assert_eq!(e.live_turn_index_len(), 1, "only the turn nobody serves");

    // Recovery rebuilds it from the store.
    e.shutdown();
    let again = open(&store).await;
    assert_eq!(again.live_turn_index_len(), 1);
    Ok(())
}
