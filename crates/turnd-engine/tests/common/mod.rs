//! Helpers shared by the engine's integration tests: an engine on an in-memory store,
//! the usual request arguments, and letting spawned tasks run.

#![allow(dead_code)] // each test file uses its own subset

use serde_json::{json, Value};
use tokio::sync::mpsc::Receiver;
use turnd_engine::{Engine, EngineConfig};
use turnd_proto::*;
use turnd_store::Store;

pub type R = Result<(), Box<dyn std::error::Error>>;

pub async fn open(store: &Store) -> Engine {
    Engine::open(store.clone(), EngineConfig::default())
        .await
        .expect("engine opens on an in-memory store")
}

pub fn hello(worker_id: &str, instance_id: &str) -> HelloArgs {
    HelloArgs {
        protocol: 1,
        role: Role::Worker,
        token: None,
        name: None,
        worker_id: Some(worker_id.into()),
        instance_id: Some(instance_id.into()),
        inflight: vec![],
        finished: vec![],
    }
}

pub fn register(function_id: &str, delivery: Delivery) -> RegisterArgs {
    RegisterArgs {
        function_id: function_id.into(),
        concurrency: Some(1),
        timeout_ms: None,
        delivery: Some(delivery),
        max_attempts: None,
    }
}

pub fn submit(session: &str, function_id: &str) -> SubmitArgs {
    SubmitArgs {
        session_id: session.into(),
        function_id: function_id.into(),
        input: json!({"n": 1}),
        idempotency_key: None,
        turn_timeout_ms: None,
        on_busy: None,
    }
}

/// Let spawned timer and drive tasks run at the current (paused) instant.
pub async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

/// The next frame queued for a connection, without letting time run.
pub fn next_frame(rx: &mut Receiver<String>) -> Value {
    let f = rx.try_recv().expect("a frame was queued");
    serde_json::from_str(&f).expect("frames are JSON")
}
