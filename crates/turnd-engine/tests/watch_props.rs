//! The paged replay of `watch`: whatever the interleaving of commits to the session
//! and of the watcher's reads, the watcher receives every event after `after` once,
//! in order, replay then live, with no gap; or, when it did not read fast enough for
//! a live push, an in-order prefix of them and a slow-reader close.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::sync::Arc;

use proptest::prelude::*;
use serde_json::Value;
use tokio::sync::mpsc::Receiver;
use turnd_engine::{CloseReason, Engine, Outbox};
use turnd_proto::*;
use turnd_store::mem::MemKv;
use turnd_store::Store;

mod common;
use common::*;

#[derive(Debug, Clone)]
enum Step {
    /// Submit this many turns (each commits an `admitted` event).
    Commit(u8),
    /// The watcher reads up to this many frames.
    Read(u8),
    /// Let the replay task run.
    Yield,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        2 => (1u8..4).prop_map(Step::Commit),
        3 => (1u8..40).prop_map(Step::Read),
        1 => Just(Step::Yield),
    ]
}

/// Frames read so far: the seqs of the events, in order of arrival.
fn read(rx: &mut Receiver<String>, up_to: usize, seqs: &mut Vec<u64>, answered: &mut bool) {
    for _ in 0..up_to {
        let Ok(f) = rx.try_recv() else { return };
        let v: Value = serde_json::from_str(&f).expect("frames are JSON");
        if v["push"] == "event" {
            seqs.push(v["event"]["seq"].as_u64().expect("an event has a seq"));
        } else {
            assert_eq!(v["ok"], true, "the watch's answer: {v}");
            assert!(seqs.is_empty(), "the answer comes before any event");
            *answered = true;
        }
    }
}

async fn commit(e: &Engine, n: u8) -> Result<(), TestCaseError> {
    for _ in 0..n {
        e.submit(submit("s", "nobody"))
            .await
            .map_err(|x| TestCaseError::fail(format!("submit: {x:?}")))?;
    }
    Ok(())
}

async fn run(
    before: u16,
    after: u16,
    capacity: usize,
    steps: Vec<Step>,
) -> Result<(), TestCaseError> {
    let store = Store::new(Arc::new(MemKv::new()));
    let e = open(&store).await;
    for _ in 0..before {
        commit(&e, 1).await?;
    }
    let after = u64::from(after.min(before));
    let (ob, mut rx) = Outbox::new("c1".into(), capacity);
    let watcher = {
        let e = e.clone();
        let ob = ob.clone();
        tokio::spawn(async move {
            let args = WatchArgs {
                session_id: Some("s".into()),
                turn_id: None,
                after: Some(after),
                progress: false,
            };
            e.watch(args, &ob, 8, |ok| {
                serde_json::json!({"id": 1, "ok": true, "result": {"watch_id": ok.watch_id}})
                    .to_string()
            })
            .await
        })
    };
    let mut seqs = Vec::new();
    let mut answered = false;
    for s in steps {
        match s {
            Step::Commit(n) => commit(&e, n).await?,
            Step::Read(n) => read(&mut rx, n.into(), &mut seqs, &mut answered),
            Step::Yield => {}
        }
        settle().await;
    }
    // Read everything that is left: the replay finishes as the queue drains.
    for _ in 0..10_000 {
        read(&mut rx, usize::MAX, &mut seqs, &mut answered);
        settle().await;
        if watcher.is_finished() && rx.is_empty() {
            break;
        }
    }
    prop_assert!(watcher.is_finished(), "the replay ends once it is read");
    let r = watcher
        .await
        .map_err(|x| TestCaseError::fail(x.to_string()))?;
    prop_assert!(r.is_ok(), "{:?}", r);
    prop_assert!(answered);
    let last = e
        .inspect("s")
        .await
        .map(|s| s.last_event)
        .unwrap_or_default();
    let all: Vec<u64> = (after + 1..=last).collect();
    match ob.close_reason() {
        None => prop_assert_eq!(&seqs, &all),
        Some(CloseReason::SlowReader) => {
            // A live push found the queue full: what arrived is a prefix.
            prop_assert!(all.starts_with(&seqs), "{:?} of {:?}", seqs, all);
        }
        Some(r) => prop_assert!(false, "closed: {:?}", r),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn a_watcher_gets_every_event_once_in_order(
        before in 0u16..700,
        after in 0u16..700,
        capacity in 2usize..24,
        steps in prop::collection::vec(step(), 0..60),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .map_err(|x| TestCaseError::fail(x.to_string()))?;
        rt.block_on(run(before, after, capacity, steps))?;
    }
}
