//! Trimming the partitions' streams and copying a peer's checkpoint, through the
//! real binaries: three NATS servers (R=3, `sync_interval: always`) and three turnd
//! nodes on loopback with small trimming bounds, each process started here and
//! ended by its PID. The streams' first messages move up under load; a paused
//! standby's mark holds its trims back; a node down past the replica timeout comes
//! back behind its streams, copies the leaders' checkpoints, takes its partitions
//! back and serves every acknowledged turn. Every wait is bounded.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};
use turnd_client::Caller;
use turnd_cluster::log::{seq_of, stream_name};
use turnd_cluster::marks::Marks;
use turnd_cluster::testing::Rig;
use turnd_cluster::Nats;
use turnd_proto::{SubmitArgs, TurnStatus};
use turnd_tests::cluster::{echo_worker_on_all, retrying, signal, status};
use turnd_tests::BinDaemon;

const PARTITIONS: u32 = 4;
const NODES: [&str; 3] = ["n0", "n1", "n2"];
/// How long a mark may stand still and still hold trims back: far longer than the
/// pause below, so that a busy machine's slower load cannot stretch the pause past it.
const REPLICA_TIMEOUT: Duration = Duration::from_secs(10);

/// Start node `i` on `rig`, listening on `listen`, its data in `root/n<i>`: one standby per partition,
/// trims once 8 groups are held, every 100 ms, a mark that stood still for
/// [`REPLICA_TIMEOUT`] no longer counted.
async fn node(
    rig: &Rig,
    root: &std::path::Path,
    i: usize,
    listen: &str,
) -> anyhow::Result<BinDaemon> {
    let urls: Vec<String> = rig.urls().iter().map(|u| format!("{u:?}")).collect();
    let nats = format!("[{}]", urls.join(","));
    let sys = rig.sys_url(i % 3);
    let id = NODES[i];
    let partitions = PARTITIONS.to_string();
    let replica_timeout = REPLICA_TIMEOUT.as_millis().to_string();
    let env = [
        ("TURND_CLUSTER__NODE_ID", id),
        ("TURND_CLUSTER__NATS", nats.as_str()),
        ("TURND_CLUSTER__NATS_SYSTEM", sys.as_str()),
        ("TURND_CLUSTER__PARTITIONS", partitions.as_str()),
        ("TURND_CLUSTER__REPLICAS", "3"),
        ("TURND_CLUSTER__STREAM_MAX_MB", "32"),
        ("TURND_CLUSTER__STANDBYS", "1"),
        ("TURND_CLUSTER__LEASE_MS", "900"),
        (
            "TURND_CLUSTER__REPLICA_TIMEOUT_MS",
            replica_timeout.as_str(),
        ),
        ("TURND_CLUSTER__TRIM_EVERY", "8"),
        ("TURND_CLUSTER__TRIM_INTERVAL_MS", "100"),
        ("TURND_CLUSTER__DRAIN_TIMEOUT_MS", "5000"),
        ("TURND_LOG__LEVEL", "info"),
    ];
    BinDaemon::start_on(&root.join(id), listen, &env).await
}

/// Wait until every partition is led by one of `alive`.
async fn all_led(admin: &str, alive: &[&str], secs: u64) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Ok(st) = status(admin).await {
            let led = st["partitions"].as_array().is_some_and(|ps| {
                ps.len() == PARTITIONS as usize
                    && ps.iter().all(|p| {
                        p["leader"].as_str().is_some_and(|l| alive.contains(&l))
                            && p["epoch"].as_u64().is_some_and(|e| e > 0)
                    })
            });
            if led {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!("not every partition led by {alive:?} within {secs} s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Submit `n` echo turns over 12 sessions through `url` (a new caller per try, an
/// idempotency key each, retried while a partition moves): the acknowledged ids.
async fn submit(url: &str, tag: &str, n: usize) -> anyhow::Result<Vec<String>> {
    let sessions: Vec<String> = (0..12).map(|i| format!("s{i}")).collect();
    submit_to(url, tag, n, &sessions).await
}

/// [`submit`] over `sessions`.
async fn submit_to(
    url: &str,
    tag: &str,
    n: usize,
    sessions: &[String],
) -> anyhow::Result<Vec<String>> {
    let mut acked = Vec::new();
    for i in 0..n {
        let key = format!("{tag}-{i}");
        let ok = retrying(30, || async {
            let c = Caller::connect(url, None).await?;
            c.submit(SubmitArgs {
                session_id: sessions[i % sessions.len()].clone(),
                function_id: "echo".into(),
                input: json!({ "i": i, "pad": "x".repeat(256) }),
                idempotency_key: Some(key.clone()),
                turn_timeout_ms: None,
                on_busy: None,
            })
            .await
        })
        .await
        .with_context(|| format!("submit {key}"))?;
        acked.push(ok.turn.turn_id);
    }
    Ok(acked)
}

/// Every turn of `acked`, read through `url`, completed.
async fn all_completed(url: &str, acked: &[String]) -> anyhow::Result<()> {
    for id in acked {
        let t = retrying(30, || async {
            let c = Caller::connect(url, None).await?;
            c.wait_terminal(id, Duration::from_secs(20)).await
        })
        .await
        .with_context(|| format!("wait for {id}"))?;
        if t.status != TurnStatus::Completed {
            bail!("turn {id} ended {:?}: {t:?}", t.status);
        }
    }
    Ok(())
}

/// Each partition's stream's first message held.
async fn first_seqs(nats: &Arc<Nats>) -> anyhow::Result<Vec<u64>> {
    let mut out = Vec::new();
    for p in 0..PARTITIONS {
        let mut s = nats.jetstream().get_stream(stream_name(p)).await?;
        out.push(s.info().await?.state.first_sequence);
    }
    Ok(out)
}

/// `node`'s applied mark of each partition, as `turnd_marks` holds it.
async fn marks_of(marks: &Marks, node: &str) -> anyhow::Result<BTreeMap<u32, u64>> {
    let mut out = BTreeMap::new();
    for p in 0..PARTITIONS {
        if let Some(m) = marks.all(p).await?.into_iter().find(|m| m.node == node) {
            out.insert(p, m.mark);
        }
    }
    Ok(out)
}

/// The applied mark of each store `node` left in `dir` (read while it is down).
fn stores_left(dir: &std::path::Path) -> anyhow::Result<BTreeMap<u32, u64>> {
    let mut out = BTreeMap::new();
    let mut opts = turnd_store::LoggedOptions::default();
    opts.windows.window_ms = 0;
    for p in 0..PARTITIONS {
        let d = dir.join(format!("p{p}"));
        if d.exists() {
            let f = turnd_store::logged::Follower::open(&d, opts)?;
            out.insert(p, f.applied());
            f.close();
        }
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_behind_trimmed_streams_copies_checkpoints_and_serves_every_turn(
) -> anyhow::Result<()> {
    if Rig::binary().is_none() {
        eprintln!("SKIPPED: no nats-server binary (run `make venv`, or set NATS_SERVER)");
        return Ok(());
    }
    let rig = Rig::start(3).await.map_err(anyhow::Error::msg)?;
    let root = tempfile::tempdir()?;
    let mut nodes = Vec::new();
    for i in 0..3 {
        nodes.push(Some(node(&rig, root.path(), i, "127.0.0.1:0").await?));
    }
    let urls: Vec<String> = nodes.iter().flatten().map(|n| n.url.clone()).collect();
    let admins: Vec<String> = nodes.iter().flatten().map(|n| n.admin.clone()).collect();
    let pids: Vec<u32> = nodes
        .iter()
        .flatten()
        .map(|n| n.child.id().unwrap_or(0))
        .collect();
    eprintln!("nats-server pids {:?}, turnd pids {pids:?}", rig.pids());
    all_led(&admins[0], &NODES, 30).await?;
    let worker = echo_worker_on_all(&urls).await;
    let nats = Nats::connect(&rig.urls(), "turnd-test").await?;
    let marks = Marks::open(&nats, 3).await?;

    // Under load the streams are trimmed: their first messages move up. A trim
    // waits for the standbys' durable marks (made once a second at most while
    // messages come, and when a standby reads nothing new): within seconds.
    let mut acked = submit(&urls[0], "a", 120).await?;
    all_completed(&urls[0], &acked).await?;
    let mut firsts = first_seqs(&nats).await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while firsts.iter().filter(|f| **f > 1).count() < 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        firsts = first_seqs(&nats).await?;
    }
    eprintln!("first messages held after the first load: {firsts:?}");
    assert!(
        firsts.iter().filter(|f| **f > 1).count() >= 2,
        "the streams were trimmed under load: {firsts:?}"
    );

    // A standby paused for less than the replica timeout holds the trims back: no
    // stream is trimmed past its mark while the others go on.
    let paused = 1;
    let standbys: Vec<u32> = status(&admins[paused]).await?["standbys"]
        .as_array()
        .map(|rows| {
            rows.iter()
                .filter(|r| r["error"].is_null())
                .filter_map(|r| r["partition"].as_u64())
                .map(|p| p as u32)
                .collect()
        })
        .unwrap_or_default();
    assert!(!standbys.is_empty(), "n{paused} keeps standbys");
    // The load goes to sessions of those partitions (led by the others).
    let sessions: Vec<String> = (0..400)
        .map(|i| format!("s{i}"))
        .filter(|s| standbys.contains(&turnd_proto::session_partition(s, PARTITIONS)))
        .take(6)
        .collect();
    signal(pids[paused], "STOP")?;
    let stopped = Instant::now();
    let mut round = 0;
    while stopped.elapsed() < Duration::from_millis(2500) {
        acked.extend(submit_to(&urls[0], &format!("b{round}"), 4, &sessions).await?);
        round += 1;
    }
    let during = first_seqs(&nats).await?;
    // Every trim seen in `during` was made within this time of the pause: its
    // mark's last move (a round, well under a second, before the pause) stood
    // still for less than the replica timeout then.
    let paused_for = stopped.elapsed();
    let mut held = marks_of(&marks, NODES[paused]).await?;
    held.retain(|p, _| standbys.contains(p));
    eprintln!(
        "paused n{paused} {paused_for:?}: its standbys' marks {held:?}, first messages {during:?}"
    );
    assert!(
        paused_for < REPLICA_TIMEOUT - Duration::from_secs(2),
        "the pause stayed within the replica timeout: {paused_for:?}"
    );
    assert_eq!(held.len(), standbys.len(), "every standby has a mark");
    for (p, m) in &held {
        assert!(
            during[*p as usize] <= seq_of(*m) + 1,
            "partition {p}'s stream was trimmed to {} past the paused standby's mark {}",
            during[*p as usize],
            seq_of(*m)
        );
    }
    signal(pids[paused], "CONT")?;
    all_led(&admins[0], &NODES, 30).await?;
    all_completed(&urls[0], &acked).await?;

    // A node killed and kept down past the replica timeout, while the load goes on,
    // is left behind the trimmed streams.
    let victim = 2;
    if let Some(n) = nodes[victim].take() {
        n.kill().await?;
    }
    all_led(&admins[0], &NODES[..2], 30).await?;
    let killed = Instant::now();
    let dir = root.path().join(NODES[victim]);
    let mut round = 0;
    let behind = loop {
        acked.extend(submit(&urls[0], &format!("c{round}"), 40).await?);
        round += 1;
        let firsts = first_seqs(&nats).await?;
        let left = stores_left(&dir)?;
        let behind: Vec<u32> = (0..PARTITIONS)
            .filter(|p| seq_of(left.get(p).copied().unwrap_or(0)) + 1 < firsts[*p as usize])
            .collect();
        if killed.elapsed() > REPLICA_TIMEOUT + Duration::from_secs(1)
            && behind.len() == PARTITIONS as usize
        {
            eprintln!("n{victim}'s stores {left:?}, the streams held from {firsts:?}");
            break behind;
        }
        if killed.elapsed() > Duration::from_secs(60) {
            bail!("the streams were not trimmed past n{victim}'s stores: {left:?} {firsts:?}");
        }
    };

    // Back, it copies the leaders' checkpoints and takes its partitions back (once
    // the worker is attached to it too: a turn in flight at a hand-over to a node
    // the worker has not reconnected to yet waits out the reconnect grace).
    all_completed(&urls[0], &acked).await?;
    // On its old address, where the worker reconnects by itself.
    let addr = urls[victim]
        .trim_start_matches("ws://")
        .split('/')
        .next()
        .context("the node's address")?;
    let back = node(&rig, root.path(), victim, addr).await?;
    let back_url = back.url.clone();
    let back_admin = back.admin.clone();
    nodes[victim] = Some(back);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let attached = async {
            let c = Caller::connect(&back_url, None).await?;
            c.stats().await
        }
        .await
        .is_ok_and(|s| s.workers_connected > 0);
        if attached {
            break;
        }
        if Instant::now() > deadline {
            bail!("the worker did not attach to n{victim}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let st = loop {
        let st = status(&back_admin).await?;
        let leads = st["leading"].as_array().map_or(0, Vec::len);
        if leads > 0 && st["checkpoints_copied"].as_u64().unwrap_or(0) > 0 {
            break st;
        }
        if Instant::now() > deadline {
            bail!("n{victim} came back but did not lead from a copied checkpoint: {st}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!(
        "n{victim} back: behind on {behind:?}; leads {}, copied {} checkpoints",
        st["leading"], st["checkpoints_copied"]
    );
    let leads: Vec<u64> = st["leading"]
        .as_array()
        .map(|l| l.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    assert!(
        leads.iter().any(|p| behind.contains(&(*p as u32))),
        "n{victim} leads a partition its own store was behind on: {leads:?} {behind:?}"
    );
    let served: u64 = {
        let mut n = 0;
        for a in &admins[..2] {
            n += status(a).await?["checkpoints_served"].as_u64().unwrap_or(0);
        }
        n
    };
    assert!(served > 0, "the leaders served the checkpoints");

    // Every acknowledged turn, read through the node that came back.
    all_completed(&back_url, &acked).await?;
    let more = submit(&back_url, "e", 24).await?;
    all_completed(&back_url, &more).await?;
    let violations = {
        let c = Caller::connect_as(&back_url, turnd_proto::Role::Operator, None).await?;
        c.store_check().await?
    };
    assert!(violations.is_empty(), "store.check: {violations:?}");
    worker.shutdown();
    for n in nodes.into_iter().flatten() {
        n.kill().await?;
    }
    Ok(())
}
