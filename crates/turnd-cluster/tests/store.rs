//! The whole store (`LoggedKv`) on the JetStream log: batches committed by many
//! committers at once, the node crashed, and the store opened in a fresh directory
//! on another node holds every acknowledged batch and no torn one; a warm standby
//! tailing the stream holds, at the leader's position, every key the leader holds,
//! and a takeover on its directory replays only the rest.

mod common;

use std::time::{Duration, Instant};

use common::{cfg, open_store, store_opts};
use turnd_cluster::log::seq_of;
use turnd_cluster::need_nats;
use turnd_cluster::standby::Standby;
use turnd_cluster::testing::Rig;
use turnd_store::{keys, Batch, Kv, LoggedKv};

/// The keys batch `i` writes (three, so that a torn batch would show).
fn batch_keys(i: u64) -> [Vec<u8>; 3] {
    ["a", "b", "c"].map(|k| keys::session_meta(&format!("s{i}-{k}")))
}

fn batch(i: u64) -> Batch {
    let mut b = Batch::new();
    for k in batch_keys(i) {
        b.put_raw(k, format!("v{i}").into_bytes());
    }
    b
}

/// Whether batch `i` is in the store: `Some(true)` whole, `Some(false)` not at all,
/// `None` torn.
fn present(kv: &LoggedKv, i: u64) -> Option<bool> {
    let found: Vec<bool> = batch_keys(i)
        .iter()
        .map(|k| kv.get(k).expect("get") == Some(format!("v{i}").into_bytes()))
        .collect();
    if found.iter().all(|f| *f) {
        Some(true)
    } else if found.iter().all(|f| !*f) {
        Some(false)
    } else {
        None
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_nodes_acknowledged_batches_are_all_on_a_fresh_node() {
    need_nats!();
    let rig = Rig::start(3).await.expect("rig");
    let c = cfg(10, 3);
    let a = rig.connect_to(0, "a").await.expect("connect");
    let dir_a = tempfile::tempdir().expect("tempdir");
    let (kv, _, log) = open_store(&a, &c, "a", dir_a.path(), store_opts())
        .await
        .expect("open on a");
    let kv = std::sync::Arc::new(kv);
    // 8 committers at once, 30 batches each: the committer groups them.
    let mut tasks = Vec::new();
    for t in 0..8u64 {
        let kv = kv.clone();
        tasks.push(tokio::spawn(async move {
            let mut acked = Vec::new();
            for j in 0..30u64 {
                let i = t * 1000 + j;
                if let Ok(Ok(())) = kv.commit(batch(i)).await {
                    acked.push(i);
                }
            }
            acked
        }));
    }
    let mut acked = Vec::new();
    for t in tasks {
        acked.extend(t.await.expect("committer"));
    }
    assert_eq!(acked.len(), 240, "every batch acknowledged");
    // More in flight, unanswered, as the node dies: the crash stops its log and
    // leaves its store as it is (no close: a close would apply and trim).
    let unanswered: Vec<_> = (9000..9020).map(|i| kv.commit(batch(i))).collect();
    log.stop();
    std::mem::forget(unanswered);
    std::mem::forget(kv);

    let b = rig.connect_to(2, "b").await.expect("connect");
    let dir_b = tempfile::tempdir().expect("tempdir");
    let (kv_b, replayed, _) = open_store(&b, &c, "b", dir_b.path(), store_opts())
        .await
        .expect("open on b, fresh");
    assert!(replayed.records >= 240);
    for i in &acked {
        assert_eq!(
            present(&kv_b, *i),
            Some(true),
            "acknowledged batch {i} is there"
        );
    }
    for i in 9000..9020 {
        assert!(present(&kv_b, i).is_some(), "batch {i} is whole or absent");
    }
}

/// Every key and value a store holds (past the applied mark).
fn every_key(kv: &LoggedKv) -> Vec<(Vec<u8>, Vec<u8>)> {
    kv.scan(b"\x01", &[0xff; 4], false, usize::MAX)
        .expect("scan")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_holds_every_key_the_leader_holds_and_a_takeover_replays_the_rest() {
    need_nats!();
    let rig = Rig::start(1).await.expect("rig");
    let c = cfg(11, 1);
    let a = rig.connect("a").await.expect("connect");
    let b = rig.connect("b").await.expect("connect");
    let (dir_a, dir_b) = (
        tempfile::tempdir().expect("dir"),
        tempfile::tempdir().expect("dir"),
    );
    let (leader, _, log) = open_store(&a, &c, "a", dir_a.path(), store_opts())
        .await
        .expect("open the leader");
    let standby = Standby::start(&b, &c, dir_b.path(), store_opts()).expect("start a standby");
    let commit = |i: u64| {
        let mut bt = batch(i % 50);
        bt.put_raw(keys::event("shared", i), vec![b'e'; (i % 9) as usize * 300]);
        if i.is_multiple_of(7) {
            bt.delete(keys::session_meta(&format!("s{}-a", i / 2)));
        }
        leader.commit(bt)
    };
    for i in 0..100u64 {
        commit(i).await.expect("answered").expect("committed");
    }
    let last = log.status().last_seq;
    let until = Instant::now() + Duration::from_secs(30);
    while seq_of(standby.status().applied) < last {
        assert!(
            Instant::now() < until,
            "the standby caught up: {:?}",
            standby.status()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(standby.status().lag, 0);
    let applied = tokio::task::spawn_blocking(move || standby.stop())
        .await
        .expect("thread")
        .expect("stop the standby");
    assert_eq!(seq_of(applied), last);
    // The leader goes on; the standby's store misses these.
    for i in 100..150u64 {
        commit(i).await.expect("answered").expect("committed");
    }

    let (taken, replayed, _) = open_store(&b, &c, "b", dir_b.path(), store_opts())
        .await
        .expect("take over on the standby's store");
    assert_eq!(
        replayed.records, 50,
        "only the records past the standby's mark"
    );
    let lead_keys = every_key(&leader);
    assert!(lead_keys.len() > 150);
    let at = lead_keys
        .iter()
        .zip(every_key(&taken))
        .position(|(x, y)| *x != y);
    assert_eq!(at, None, "every key equal");
    assert_eq!(every_key(&taken).len(), lead_keys.len());
}
