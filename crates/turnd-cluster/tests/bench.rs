//! Numbers for `docs/benchmarks.md`, against three nats-server processes on
//! loopback with `sync_interval: always` and a stream of three replicas: the
//! latency of sequential appends of a ~1 KB group, and what the store's group
//! commit makes of many committers at once. Ignored by default (they measure, they
//! do not check); run with
//! `cargo nextest run -p turnd-cluster --test bench --run-ignored only --no-capture`.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{cfg, held_to, lead, open_store, record, store_opts, three_with_stream};
use turnd_cluster::need_nats;
use turnd_cluster::testing::Rig;
use turnd_cluster::JetStreamLog;
use turnd_store::log::CommitLog;
use turnd_store::{keys, Batch, Kv};

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement"]
async fn sequential_appends_of_a_1kb_group_at_r3() {
    need_nats!();
    let c = cfg(30, 3);
    let (rig, _, leader) = three_with_stream(&c).await;
    // Write from the server that leads the stream (one hop less per append).
    let at = rig.index_of(&leader).expect("a rig server");
    let nats = rig.connect_to(at, "w").await.expect("connect");
    let log = lead(&nats, &c, "w", 0).await.expect("lead").log;
    let n = 2000;
    let t = tokio::task::spawn_blocking(move || time_appends(log, n))
        .await
        .expect("thread");
    println!(
        "sequential 1 KB appends, R3, sync always, writer on the stream leader's server: n={n} p50={:.2} ms p99={:.2} ms max={:.2} ms ({:.0} appends/s)",
        t.p50, t.p99, t.max, t.rate
    );
}

/// What [`time_appends`] measured: p50, p99 and max in ms, and appends a second.
struct Timed {
    p50: f64,
    p99: f64,
    max: f64,
    rate: f64,
}

/// `n` sequential appends of a 1 KB group on `log`, timed.
fn time_appends(log: JetStreamLog, n: usize) -> Timed {
    let group = [record("one-kb-group", 1024)];
    let refs: Vec<&[u8]> = group.iter().map(Vec::as_slice).collect();
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        log.append(&refs, true).expect("append");
        times.push(t.elapsed());
    }
    let total: Duration = times.iter().sum();
    times.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    Timed {
        p50: ms(percentile(&times, 0.5)),
        p99: ms(percentile(&times, 0.99)),
        max: ms(times[n - 1]),
        rate: n as f64 / total.as_secs_f64(),
    }
}

/// A writer whose main connection is on a server that does not lead the stream,
/// in rounds: its appends published on that connection (routed to the leader and
/// acknowledged back through it), then on a connection of its own to the leader's
/// server (`Nats::connect_each`, as a node with `cluster.publish_to_stream_leader`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement"]
async fn sequential_appends_through_another_server_and_on_the_leaders_own_connection() {
    need_nats!();
    let c = cfg(32, 3);
    let (rig, _, leader) = three_with_stream(&c).await;
    let other = (rig.index_of(&leader).expect("a rig server") + 1) % 3;
    let routed = rig.connect_to(other, "routed").await.expect("connect");
    let direct = rig.connect_to(other, "direct").await.expect("connect");
    held_to(&rig, &direct, "direct", &leader).await;
    let n = 1000;
    let rounds = 3;
    for round in 1..=rounds {
        for (label, nats) in [("routed", &routed), ("direct", &direct)] {
            // Each writer leads in turn: its fence follows the other's messages.
            let log = lead(nats, &c, label, 0).await.expect("lead").log;
            let on = log.status().appends_on;
            let t = tokio::task::spawn_blocking(move || time_appends(log, n))
                .await
                .expect("thread");
            println!(
                "round {round}, {label} (appends on {}): n={n} p50={:.2} ms p99={:.2} ms ({:.0} appends/s)",
                on.as_deref().unwrap_or("the main connection, on a server that does not lead"),
                t.p50, t.p99, t.rate
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement"]
async fn many_committers_at_once_on_the_store_at_r3() {
    need_nats!();
    let rig = Rig::start(3).await.expect("rig");
    let c = cfg(31, 3);
    let nats = rig.connect_to(0, "w").await.expect("connect");
    let dir = tempfile::tempdir().expect("dir");
    let (kv, _, log) = open_store(&nats, &c, "w", dir.path(), store_opts())
        .await
        .expect("open");
    let kv = Arc::new(kv);
    for committers in [1usize, 16, 256] {
        let done = Arc::new(AtomicU64::new(0));
        let before = log.status().last_seq;
        let until = Instant::now() + Duration::from_secs(5);
        let tasks: Vec<_> = (0..committers)
            .map(|t| {
                let (kv, done) = (kv.clone(), done.clone());
                tokio::spawn(async move {
                    let mut i = 0u64;
                    while Instant::now() < until {
                        let mut b = Batch::new();
                        b.put_raw(keys::session_meta(&format!("s{t}")), vec![b'v'; 200]);
                        b.put_raw(keys::event(&format!("s{t}"), i), vec![b'e'; 400]);
                        kv.commit(b).await.expect("answered").expect("committed");
                        done.fetch_add(1, Ordering::Relaxed);
                        i += 1;
                    }
                })
            })
            .collect();
        let start = Instant::now();
        for t in tasks {
            t.await.expect("committer");
        }
        let secs = start.elapsed().as_secs_f64();
        let batches = done.load(Ordering::Relaxed);
        let groups = log.status().last_seq - before;
        println!(
            "{committers} committers, R3, sync always: {:.0} batches/s in {:.0} groups/s ({:.1} batches a group, max group {})",
            batches as f64 / secs,
            groups as f64 / secs,
            batches as f64 / groups.max(1) as f64,
            kv.commit_stats().max_group
        );
    }
}
