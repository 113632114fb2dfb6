//! Appends in doubt against real faults of the stream's leader server (R=3):
//! SIGSTOP then SIGCONT, and kill -9 then a restart on its data. A writer on
//! another server appends groups one after another throughout; afterwards every
//! acknowledged group is in the stream exactly once, and nothing else is.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{append, cfg, lead, record};
use turnd_cluster::log::{read_valid, stream_name};
use turnd_cluster::testing::Rig;
use turnd_cluster::{need_nats, LogConfig, Nats};

/// The name of the server leading partition `p`'s stream.
async fn stream_leader(nats: &Nats, p: u32) -> String {
    for _ in 0..100 {
        if let Ok(mut s) = nats.jetstream().get_stream(stream_name(p)).await {
            if let Ok(info) = s.info().await {
                if let Some(l) = info.cluster.as_ref().and_then(|c| c.leader.clone()) {
                    return l;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no leader of partition {p}'s stream");
}

/// Append groups `g0`, `g1`, … one after another until `done`, noting each one
/// acknowledged in `acked`.
async fn write_until(
    log: turnd_cluster::JetStreamLog,
    done: Arc<AtomicBool>,
    acked: Arc<std::sync::Mutex<Vec<u64>>>,
) {
    let mut i = 0u64;
    while !done.load(Ordering::Relaxed) {
        match append(&log, vec![record(&format!("g{i}"), 1000)]).await {
            Ok(_) => acked.lock().expect("acked").push(i),
            Err(e) => panic!("append g{i} failed: {e}"),
        }
        i += 1;
    }
}

/// Check that the stream holds every group in `acked` exactly once, and nothing
/// else.
async fn each_acknowledged_once(reader: &Arc<Nats>, c: &LogConfig, acked: &[u64]) {
    let read = read_valid(reader, c, 0).await.expect("read the stream");
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for r in &read.records {
        let tag = String::from_utf8_lossy(&r.payload)
            .trim_end_matches('.')
            .to_string();
        *seen.entry(tag).or_default() += 1;
    }
    for i in acked {
        assert_eq!(
            seen.get(&format!("g{i}")),
            Some(&1),
            "acknowledged g{i} once"
        );
    }
    assert_eq!(
        seen.len(),
        acked.len(),
        "nothing but the acknowledged groups"
    );
}

enum Fault {
    Pause,
    Kill,
}

/// Append groups tagged `g<i>` on a writer connected to a server that does not
/// lead the stream, hit the stream's leader server with `fault` once the writer is
/// going, and check what the stream holds once the writer acknowledged `after`
/// more groups since the server came back.
async fn appends_through(fault: Fault, p: u32) {
    let mut rig = Rig::start(3).await.expect("rig");
    let c: LogConfig = cfg(p, 3);
    let first = rig.connect_to(0, "probe").await.expect("connect");
    // Make the stream, then find its leader and write from another server.
    drop(lead(&first, &c, "setup", 0).await.expect("setup leads"));
    let leader_name = stream_leader(&first, p).await;
    let victim = rig.index_of(&leader_name).expect("leader's index");
    let writer_at = (victim + 1) % 3;
    eprintln!("stream leader {leader_name} (index {victim}); writer on index {writer_at}");
    let nats = rig.connect_to(writer_at, "w").await.expect("connect");
    let log = lead(&nats, &c, "w", 0).await.expect("the writer leads").log;

    let done = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(std::sync::Mutex::new(Vec::<u64>::new()));
    let writer = tokio::spawn(write_until(log.clone(), done.clone(), acked.clone()));
    let count = || acked.lock().expect("acked").len();
    let wait_for = |n: usize, within: Duration| {
        let (count, log) = (&count, &log);
        async move {
            let until = Instant::now() + within;
            while count() < n {
                assert!(
                    Instant::now() < until,
                    "{} of {n} acknowledged in time; the writer's log: {:?}",
                    count(),
                    log.status()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    wait_for(30, Duration::from_secs(20)).await;
    match fault {
        Fault::Pause => {
            rig.pause(victim);
            tokio::time::sleep(Duration::from_secs(8)).await;
            rig.resume(victim);
        }
        Fault::Kill => {
            rig.kill9(victim);
            tokio::time::sleep(Duration::from_secs(6)).await;
            rig.restart(victim).expect("restart");
        }
    }
    let at_return = count();
    wait_for(at_return + 30, Duration::from_secs(60)).await;
    done.store(true, Ordering::Relaxed);
    if tokio::time::timeout(Duration::from_secs(60), writer)
        .await
        .is_err()
    {
        // An append still unsettled: end it, or the test would wait for it.
        log.stop();
        panic!("the writer's last append did not settle within 60 s");
    }

    let acked = acked.lock().expect("acked").clone();
    let status = log.status();
    eprintln!(
        "acknowledged {}, in doubt and settled {}",
        acked.len(),
        status.settled_in_doubt
    );
    assert!(status.failure.is_none());
    let reader = rig.connect_to(writer_at, "r").await.expect("connect");
    each_acknowledged_once(&reader, &c, &acked).await;
    assert!(
        status.settled_in_doubt >= 1,
        "the fault left an append in doubt, settled (else the test proved nothing)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_in_doubt_through_a_paused_stream_leader_count_once() {
    need_nats!();
    appends_through(Fault::Pause, 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_in_doubt_through_a_killed_stream_leader_count_once() {
    need_nats!();
    appends_through(Fault::Kill, 21).await;
}
