//! Two engines of one node on one worker registry: a worker connection's
//! concurrency is shared by every engine that dispatches to it, and a session that
//! waited for a worker is driven by its own engine when capacity frees.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use serde_json::json;
use turnd_engine::{Caller, Engine, EngineConfig, Outbox, WakeHook, Workers};
use turnd_proto::*;
use turnd_store::mem::MemKv;
use turnd_store::{check_store, Store};

mod common;
use common::*;

/// The engine of each session, for the node's wake hook.
type Owners = Arc<Mutex<HashMap<String, Engine>>>;

/// A hook that drives each session handed back on the engine that owns it, and
/// records which sessions it was handed.
fn route(owners: &Owners, woken: &Arc<Mutex<Vec<String>>>) -> WakeHook {
    let (owners, woken) = (owners.clone(), woken.clone());
    Arc::new(move |session_id: Arc<str>| {
        woken.lock().push(session_id.to_string());
        let owner = owners.lock().get(&*session_id).cloned();
        if let Some(engine) = owner {
            tokio::spawn(async move { engine.drive(&session_id).await });
        }
    })
}

async fn open_on(workers: &Workers) -> (Store, Engine) {
    let store = Store::new(Arc::new(MemKv::new()));
    let engine = Engine::open_with(store.clone(), EngineConfig::default(), workers.clone())
        .await
        .expect("engine opens on an in-memory store");
    (store, engine)
}

#[tokio::test(start_paused = true)]
async fn engines_sharing_a_registry_share_a_workers_slot_and_drive_their_own_sessions() -> R {
    let workers = Workers::new();
    let owners: Owners = Arc::default();
    let woken = Arc::new(Mutex::new(Vec::new()));
    workers.on_wake(route(&owners, &woken));
    let (store_a, a) = open_on(&workers).await;
    let (store_b, b) = open_on(&workers).await;
    owners.lock().insert("sa".into(), a.clone());
    owners.lock().insert("sb".into(), b.clone());

    // One worker with one slot, attached through engine a.
    let (ob, mut rx) = Outbox::new("c1".into(), 64);
    a.worker_hello(&hello("w", "i1"), ob).await?;
    a.register("w", &register("f", Delivery::AtMostOnce))?;
    assert_eq!(b.workers().len(), 1, "engine b sees the worker too");

    let ta = a.submit(submit("sa", "f")).await?.turn;
    settle().await;
    let first = next_frame(&mut rx);
    assert_eq!(first["turn_id"].as_str(), Some(ta.turn_id.as_str()));

    // The slot is taken by engine a's dispatch: engine b's turn waits for it.
    let tb = b.submit(submit("sb", "f")).await?.turn;
    settle().await;
    let waiting = b.get_turn(&tb.turn_id).await?;
    let wait = waiting.wait.expect("a wait");
    assert_eq!(wait.state, WaitState::AwaitingWorker);
    assert!(rx.try_recv().is_err(), "no second dispatch");

    // The worker finishes engine a's invocation: the freed slot goes to engine
    // b's session, driven by engine b.
    let worker = Caller {
        role: Role::Worker,
        worker_id: Some("w".into()),
    };
    let done = ResultArgs {
        invocation_id: first["invocation_id"].as_str().unwrap_or_default().into(),
        outcome: Outcome::Complete(json!("a")),
    };
    a.result(&worker, done).await?;
    settle().await;
    assert_eq!(*woken.lock(), ["sb"]);
    let second = next_frame(&mut rx);
    assert_eq!(second["push"], "invoke");
    assert_eq!(second["turn_id"].as_str(), Some(tb.turn_id.as_str()));
    assert_eq!(b.get_turn(&tb.turn_id).await?.status, TurnStatus::Running);
    assert!(b.session_ids_in_memory().contains(&"sb".to_string()));
    assert!(!a.session_ids_in_memory().contains(&"sb".to_string()));

    assert!(check_store(&store_a)?.is_empty());
    assert!(check_store(&store_b)?.is_empty());
    owners.lock().clear();
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn an_engine_of_its_own_drives_the_sessions_its_registry_hands_back() -> R {
    let workers = Workers::new();
    let (_, e) = open_on(&workers).await;
    let t = e.submit(submit("s", "f")).await?.turn;
    settle().await;
    // No worker yet: the turn waits; a registration hands the session back.
    let (ob, mut rx) = Outbox::new("c1".into(), 64);
    e.worker_hello(&hello("w", "i1"), ob).await?;
    e.register("w", &register("f", Delivery::AtMostOnce))?;
    settle().await;
    let invoke = next_frame(&mut rx);
    assert_eq!(invoke["turn_id"].as_str(), Some(t.turn_id.as_str()));
    Ok(())
}
