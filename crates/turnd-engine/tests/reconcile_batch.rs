//! A worker with many invocations in flight is reconciled through shared group
//! commits when it disconnects and when it says hello again, on a real store that
//! syncs every commit. The benchmark (docs/benchmarks.md, "Reconcile of a worker
//! with many invocations") is not part of the suite:
//! `cargo test -p turnd-engine --test reconcile_batch -- --ignored --nocapture`.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use turnd_engine::{Engine, EngineConfig, Outbox};
use turnd_proto::*;
use turnd_store::mem::MemKv;
use turnd_store::{
    Batch, CommitReply, CommitTicket, Entry, Kv, LoggedKv, LoggedOptions, Store, StoreError,
};

struct Measured {
    disconnect: Duration,
    disconnect_syncs: u64,
    reconcile: Duration,
    reconcile_syncs: u64,
}

/// `n` sessions with one invocation each on worker `w`; the worker disconnects and
/// says hello again listing all of them in flight.
async fn run(n: usize) -> Result<Measured, Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let (kv, _) = LoggedKv::open(dir.path(), LoggedOptions::default())?;
    let store = Store::new(Arc::new(kv));
    let engine = Engine::open(store.clone(), EngineConfig::default()).await?;
    let syncs = || store.kv().commit_stats().syncs;
    let (outbox, mut rx) = Outbox::new("c1".into(), 4 * n + 16);
    engine.worker_hello(&hello("w", "i1"), outbox).await?;
    let mut reg = register("f", Delivery::AtLeastOnce);
    reg.concurrency = Some(n as u32);
    engine.register("w", &reg)?;
    for i in 0..n {
        engine.submit(submit(&format!("s{i}"), "f")).await?;
    }
    let mut inflight = Vec::new();
    while let Ok(f) = rx.try_recv() {
        let v: serde_json::Value = serde_json::from_str(&f)?;
        if let Some(id) = v["invocation_id"].as_str() {
            inflight.push(id.to_string());
        }
    }
    assert_eq!(inflight.len(), n, "every session dispatched");

    let (s0, t) = (syncs(), Instant::now());
    engine.worker_disconnected("w", "c1").await;
    let (disconnect, disconnect_syncs) = (t.elapsed(), syncs() - s0);

    let mut h = hello("w", "i1");
    h.inflight = inflight;
    let (outbox, _rx2) = Outbox::new("c2".into(), 4 * n + 16);
    let (s0, t) = (syncs(), Instant::now());
    let rec = engine.worker_hello(&h, outbox).await?;
    let (reconcile, reconcile_syncs) = (t.elapsed(), syncs() - s0);
    assert_eq!(rec.kept.len(), n, "every invocation kept");
    engine.shutdown();
    Ok(Measured {
        disconnect,
        disconnect_syncs,
        reconcile,
        reconcile_syncs,
    })
}

/// A commit written but not yet acknowledged, and its acknowledgement.
type Held = (CommitTicket, CommitReply);

/// A store whose commits, while held, are written but not acknowledged until
/// released: how many a transition has waiting at once shows whether sessions go
/// through the group commit together or one after the other.
struct HeldKv {
    inner: MemKv,
    hold: AtomicBool,
    held: Mutex<Vec<Held>>,
}

impl HeldKv {
    fn held(&self) -> usize {
        self.held.lock().map(|h| h.len()).unwrap_or(0)
    }

    async fn release(&self) {
        self.hold.store(false, Ordering::SeqCst);
        let held: Vec<_> = self
            .held
            .lock()
            .map(|mut h| h.drain(..).collect())
            .unwrap_or_default();
        for (ticket, ack) in held {
            let r = ticket.await.unwrap_or(Err(StoreError::Closed));
            assert!(ack.send(r).is_ok(), "the committer waits for its ack");
        }
    }

    /// Wait until `n` commits are held (false after two seconds).
    async fn wait_held(&self, n: usize) -> bool {
        for _ in 0..200 {
            if self.held() >= n {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }
}

impl Kv for HeldKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.get(key)
    }
    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        self.inner.scan(start, end, reverse, limit)
    }
    fn commit(&self, batch: Batch) -> CommitTicket {
        let ticket = self.inner.commit(batch);
        if !self.hold.load(Ordering::SeqCst) {
            return ticket;
        }
        let (tx, rx) = CommitTicket::new();
        if let Ok(mut h) = self.held.lock() {
            h.push((ticket, tx));
        }
        rx
    }
    fn sync(&self) -> Result<(), StoreError> {
        self.inner.sync()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_sessions_go_through_the_group_commit_together() -> R {
    let n = 32;
    let kv = Arc::new(HeldKv {
        inner: MemKv::new(),
        hold: AtomicBool::new(false),
        held: Mutex::new(Vec::new()),
    });
    let store = Store::new(kv.clone());
    let engine = Engine::open(store, EngineConfig::default()).await?;
    let (outbox, mut rx) = Outbox::new("c1".into(), 4 * n + 16);
    engine.worker_hello(&hello("w", "i1"), outbox).await?;
    let mut reg = register("f", Delivery::AtLeastOnce);
    reg.concurrency = Some(n as u32);
    engine.register("w", &reg)?;
    for i in 0..n {
        engine.submit(submit(&format!("s{i}"), "f")).await?;
    }
    let mut inflight = Vec::new();
    while let Ok(f) = rx.try_recv() {
        let v: serde_json::Value = serde_json::from_str(&f)?;
        if let Some(id) = v["invocation_id"].as_str() {
            inflight.push(id.to_string());
        }
    }
    assert_eq!(inflight.len(), n);

    // The disconnect: every session's write is waiting at once.
    kv.hold.store(true, Ordering::SeqCst);
    let e = engine.clone();
    let gone = tokio::spawn(async move { e.worker_disconnected("w", "c1").await });
    let together = kv.wait_held(n).await;
    let held = kv.held();
    kv.release().await;
    gone.await?;
    assert!(
        together,
        "worker_disconnected had {held} of {n} writes waiting at once"
    );

    // The hello: the same.
    kv.hold.store(true, Ordering::SeqCst);
    let mut h = hello("w", "i1");
    h.inflight = inflight;
    let (outbox, _rx2) = Outbox::new("c2".into(), 4 * n + 16);
    let e = engine.clone();
    let back = tokio::spawn(async move { e.worker_hello(&h, outbox).await });
    let together = kv.wait_held(n).await;
    let held = kv.held();
    kv.release().await;
    let rec = back.await?.map_err(|e| e.to_string())?;
    assert!(together, "hello had {held} of {n} writes waiting at once");
    assert_eq!(rec.kept.len(), n);
    engine.shutdown();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: run it by hand"]
async fn bench_reconcile_of_a_worker_with_512_invocations() -> R {
    let n: usize = std::env::var("RECONCILE_SESSIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512);
    let m = run(n).await?;
    println!(
        "{n} invocations: worker_disconnected {:.1} ms ({} syncs), hello reconcile {:.1} ms ({} syncs)",
        m.disconnect.as_secs_f64() * 1e3,
        m.disconnect_syncs,
        m.reconcile.as_secs_f64() * 1e3,
        m.reconcile_syncs
    );
    Ok(())
}
