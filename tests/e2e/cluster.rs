//! turnd across machines, through the real binaries: three NATS servers (JetStream,
//! R=3, `sync_interval: always`) and three turnd nodes on loopback, each process
//! started here and ended by its PID. A turn submitted to any node runs on the
//! leader of its session's partition; a node killed with SIGKILL has its partitions
//! taken over by the others, and no acknowledged turn is lost; a node stopped with
//! SIGTERM hands its partitions over. Every wait is bounded in count and time.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use serde_json::{json, Value};
use turnd_client::{Caller, WorkerHandle};
use turnd_cluster::testing::Rig;
use turnd_proto::{SubmitArgs, TurnStatus};
use turnd_tests::cluster::{
    all_led, check_clean, echo_worker, echo_worker_on_all, nats_list, retrying, signal, start_node,
    start_three, status, PARTITIONS,
};
use turnd_tests::{need_nats, BinDaemon};

/// Start node `i` of the cluster on `rig`, its data in `root/n<i>`.
async fn node(rig: &Rig, root: &std::path::Path, i: usize) -> anyhow::Result<BinDaemon> {
    start_node(root, i, &rig.urls(), &rig.sys_url(i % 3), "127.0.0.1:0").await
}

/// Submit `turn_id`-keyed echo turns to `n` sessions through `url`, one new caller
/// per try (a connection closed on a write in doubt is not reused), with an
/// idempotency key each: the acknowledged turn ids.
async fn submit_all(url: &str, tag: &str, n: usize) -> anyhow::Result<Vec<(String, String)>> {
    let mut acked = Vec::new();
    for i in 0..n {
        let session = format!("s{}", i % 12);
        let key = format!("{tag}-{i}");
        let ok = retrying(20, || {
            let (session, key) = (session.clone(), key.clone());
            async move {
                let c = Caller::connect(url, None).await?;
                c.submit(SubmitArgs {
                    session_id: session,
                    function_id: "echo".into(),
                    input: json!({ "i": i }),
                    idempotency_key: Some(key),
                    turn_timeout_ms: None,
                    on_busy: None,
                })
                .await
            }
        })
        .await
        .with_context(|| format!("submit {key}"))?;
        acked.push((ok.turn.turn_id, session));
    }
    Ok(acked)
}

/// Wait through `url` until every turn of `acked` completed.
async fn all_completed(url: &str, acked: &[(String, String)]) -> anyhow::Result<()> {
    for (turn_id, _) in acked {
        let t = retrying(30, || async move {
            let c = Caller::connect(url, None).await?;
            c.wait_terminal(turn_id, Duration::from_secs(20)).await
        })
        .await
        .with_context(|| format!("wait for {turn_id}"))?;
        if t.status != TurnStatus::Completed {
            bail!("turn {turn_id} ended {:?}: {t:?}", t.status);
        }
    }
    Ok(())
}

/// Three nats-server and three nodes, every partition led, and an echo worker
/// (running up to `concurrency` invocations) connected to every node.
struct Cluster {
    rig: Rig,
    _root: tempfile::TempDir,
    nodes: Vec<BinDaemon>,
    urls: Vec<String>,
    worker: WorkerHandle,
}

impl Cluster {
    async fn start(concurrency: u32) -> anyhow::Result<Cluster> {
        let rig = Rig::start(3).await.map_err(anyhow::Error::msg)?;
        let root = tempfile::tempdir()?;
        let nodes = start_three(&rig, root.path(), &[]).await?;
        let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
        all_led(&nodes[0].admin, &["n0", "n1", "n2"], 30).await?;
        let worker = echo_worker(&urls, concurrency).await;
        Ok(Cluster {
            rig,
            _root: root,
            nodes,
            urls,
            worker,
        })
    }

    /// The worker shut down and every node killed.
    async fn stop(self) -> anyhow::Result<()> {
        self.worker.shutdown();
        for n in self.nodes {
            n.kill().await?;
        }
        Ok(())
    }
}

/// One echo turn of `session` through `c`, waited for until it completed.
async fn one_turn(c: &Caller, session: &str, input: Value) -> anyhow::Result<()> {
    turn_of(c, session, "echo", input).await
}

/// One turn of `function` for `session` through `c`, waited for until it completed.
async fn turn_of(c: &Caller, session: &str, function: &str, input: Value) -> anyhow::Result<()> {
    let ok = c
        .submit(SubmitArgs {
            session_id: session.into(),
            function_id: function.into(),
            input,
            idempotency_key: None,
            turn_timeout_ms: None,
            on_busy: None,
        })
        .await?;
    let done = c
        .wait_terminal(&ok.turn.turn_id, Duration::from_secs(30))
        .await?;
    if done.status != TurnStatus::Completed {
        bail!("turn {} ended {:?}", ok.turn.turn_id, done.status);
    }
    Ok(())
}

/// Once `nodes` (n0, n1, n2) lead every partition: their PIDs (printed with the
/// rig's), their WebSocket URLs, n0's admin address, and an echo worker on all.
async fn serving(
    rig: &Rig,
    nodes: &[BinDaemon],
) -> anyhow::Result<(Vec<u32>, Vec<String>, String, WorkerHandle)> {
    let pids: Vec<u32> = nodes.iter().filter_map(|n| n.child.id()).collect();
    eprintln!("nats-server pids {:?}, turnd pids {pids:?}", rig.pids());
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    let admin = nodes[0].admin.clone();
    all_led(&admin, &["n0", "n1", "n2"], 30).await?;
    let worker = echo_worker_on_all(&urls).await;
    Ok((pids, urls, admin, worker))
}

/// Each node's takeovers and the partitions it gave up, from its `/metrics`
/// (which reads no bucket).
async fn moves_of(nodes: &[BinDaemon]) -> anyhow::Result<Vec<(f64, f64)>> {
    let mut out = Vec::new();
    for n in nodes {
        let (_, m) = turnd_tests::http_get(&n.admin, "/metrics").await?;
        let got = |name: &str| turnd_tests::metric(&m, name).unwrap_or(-1.0);
        out.push((
            got("turnd_cluster_takeovers"),
            got("turnd_cluster_handovers"),
        ));
    }
    Ok(out)
}

/// Each partition's leader and epoch as node `admin` sees them.
async fn leaders(admin: &str) -> anyhow::Result<Vec<(String, u64)>> {
    let st = status(admin).await?;
    Ok(st["partitions"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .map(|p| (p["leader"].to_string(), p["epoch"].as_u64().unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default())
}

/// Partitions move to their preferred leaders once those caught up: wait (at most
/// 20 s) until two reads half a second apart show every partition led, by the same
/// leaders in the same epochs, and return them. A read that fails (`GET /cluster`
/// answers 503 while a bucket it reads does not answer) counts as not settled.
async fn settled_leaders(admin: &str) -> anyhow::Result<Vec<(String, u64)>> {
    let mut last = Vec::new();
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = match leaders(admin).await {
            Ok(now) => now,
            Err(e) => {
                eprintln!("not settled: {e:#}");
                last = Vec::new();
                continue;
            }
        };
        if now == last && now.iter().all(|(leader, _)| leader != "null") {
            return Ok(now);
        }
        last = now;
    }
    bail!("the partitions' leaders did not settle: {last:?}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_run_on_any_node_and_survive_a_killed_leader() -> anyhow::Result<()> {
    need_nats!();
    let rig = Rig::start(3).await.map_err(anyhow::Error::msg)?;
    eprintln!("nats-server pids {:?}", rig.pids());
    let root = tempfile::tempdir()?;
    let mut nodes = Vec::new();
    for i in 0..3 {
        nodes.push(Some(node(&rig, root.path(), i).await?));
    }
    let pids: Vec<_> = nodes.iter().flatten().map(|n| n.child.id()).collect();
    eprintln!("turnd pids {pids:?}");
    let urls: Vec<String> = nodes.iter().flatten().map(|n| n.url.clone()).collect();
    let admins: Vec<String> = nodes.iter().flatten().map(|n| n.admin.clone()).collect();
    let took = all_led(&admins[0], &["n0", "n1", "n2"], 30).await?;
    eprintln!("every partition led {took:?} after the nodes were ready");
    // `turnd cluster status` reads the same from NATS, with no node of its own (a
    // partition moving to its preferred leader has none for a moment: read again).
    let mut tries = 0;
    let view = loop {
        let out = tokio::process::Command::new(turnd_tests::turnd_bin()?)
            .args(["cluster", "status", "--json"])
            .env("TURND_CLUSTER__NATS", nats_list(&rig.urls()))
            .env("TURND_CLUSTER__PARTITIONS", PARTITIONS.to_string())
            .output()
            .await?;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let view: Value = serde_json::from_slice(&out.stdout)?;
        let led = view["partitions"].as_array().is_some_and(|ps| {
            ps.len() == PARTITIONS as usize
                && ps.iter().all(|p| {
                    p["leader"]
                        .as_str()
                        .is_some_and(|l| ["n0", "n1", "n2"].contains(&l))
                })
        });
        tries += 1;
        if led {
            break view;
        }
        if tries >= 20 {
            bail!("turnd cluster status never showed every partition led: {view}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(view["members"].as_array().map(Vec::len), Some(3), "{view}");

    // One worker, connected to every node.
    let worker = echo_worker_on_all(&urls).await;

    // Through every node: the same sessions, forwarded where another node leads.
    let mut acked = Vec::new();
    for (i, u) in urls.iter().enumerate() {
        acked.extend(submit_all(u, &format!("a{i}"), 12).await?);
    }
    all_completed(&urls[0], &acked).await?;
    let forwarded: u64 = {
        let mut f = 0;
        for a in &admins {
            f += status(a).await?["forwarded"].as_u64().unwrap_or(0);
        }
        f
    };
    assert!(
        forwarded > 0,
        "some requests were forwarded to another node's partition"
    );
    // Kill the node that leads the most partitions but is not node 0.
    let st = status(&admins[0]).await?;
    let leads = |n: &str| {
        st["partitions"]
            .as_array()
            .map_or(0, |ps| ps.iter().filter(|p| p["leader"] == n).count())
    };
    let victim = if leads("n1") >= leads("n2") { 1 } else { 2 };
    eprintln!(
        "killing n{victim} (pid {:?}), leading {} partitions",
        pids[victim],
        leads(&format!("n{victim}"))
    );
    // Turns in flight on its partitions as it dies.
    let inflight = submit_all(&urls[0], "b", 12).await?;
    if let Some(n) = nodes[victim].take() {
        n.kill().await?;
    }
    let killed = Instant::now();
    let alive: Vec<&str> = ["n0", "n1", "n2"]
        .into_iter()
        .enumerate()
        .filter(|(i, _)| *i != victim)
        .map(|(_, n)| n)
        .collect();
    all_led(&admins[0], &alive, 30).await?;
    eprintln!(
        "failover: every partition led again {:?} after the kill",
        killed.elapsed()
    );
    let after = submit_all(&urls[0], "c", 12).await?;
    all_completed(&urls[0], &acked).await?;
    all_completed(&urls[0], &inflight).await?;
    all_completed(&urls[0], &after).await?;
    // The same key again answers the first turn (the acknowledged write survived).
    let again = submit_all(&urls[0], "b", 1).await?;
    assert_eq!(
        again[0].0, inflight[0].0,
        "an idempotent resubmit finds the first turn"
    );
    check_clean(&urls[0]).await?;

    // A graceful stop hands the partitions over.
    let other = if victim == 1 { 2 } else { 1 };
    if let Some(n) = nodes[other].take() {
        let status = n.terminate().await?;
        assert!(status.success(), "drained node exited {status}");
    }
    all_led(&admins[0], &["n0"], 30).await?;
    let last = submit_all(&urls[0], "d", 6).await?;
    all_completed(&urls[0], &last).await?;
    check_clean(&urls[0]).await?;
    worker.shutdown();
    Ok(())
}

/// A node configured with another number of partitions than the cluster was
/// created with is refused, saying what to set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_other_partitions_is_refused() -> anyhow::Result<()> {
    need_nats!();
    let rig = Rig::start(1).await.map_err(anyhow::Error::msg)?;
    let root = tempfile::tempdir()?;
    let url = format!("[{:?}]", rig.urls()[0]);
    let sys = rig.sys_url(0);
    let start = |id: &'static str, partitions: &'static str| {
        let dir = root.path().join(id);
        let (url, sys) = (url.clone(), sys.clone());
        async move {
            BinDaemon::start(
                &dir,
                &[
                    ("TURND_CLUSTER__NODE_ID", id),
                    ("TURND_CLUSTER__NATS", url.as_str()),
                    ("TURND_CLUSTER__NATS_SYSTEM", sys.as_str()),
                    ("TURND_CLUSTER__PARTITIONS", partitions),
                    ("TURND_CLUSTER__REPLICAS", "1"),
                    ("TURND_CLUSTER__STREAM_MAX_MB", "32"),
                ],
            )
            .await
        }
    };
    let first = start("a", "4").await?;
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(turnd_tests::turnd_bin()?)
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .arg("--data-dir")
            .arg(root.path().join("b"))
            .env("TURND_CLUSTER__NODE_ID", "b")
            .env("TURND_CLUSTER__NATS", &url)
            .env("TURND_CLUSTER__NATS_SYSTEM", &sys)
            .env("TURND_CLUSTER__PARTITIONS", "8")
            .env("TURND_CLUSTER__REPLICAS", "1")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .context("the refused node did not exit")??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a node with 8 partitions joined a cluster of 4"
    );
    assert!(
        stderr.contains("cluster.partitions is 8 but the cluster was created with 4"),
        "{stderr}"
    );
    first.kill().await?;
    Ok(())
}

/// A node starts while one NATS server of three is down (its system-account URL
/// the dead server's first): a proven majority answered, so the missing server is
/// pending, shown in `/cluster` and `/metrics`, not refused; the node leads and
/// serves; once the server is back, the node checks it and nothing is pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_starts_while_a_nats_server_is_down_and_checks_it_when_it_is_back(
) -> anyhow::Result<()> {
    need_nats!();
    let mut rig = Rig::start(3).await.map_err(anyhow::Error::msg)?;
    let root = tempfile::tempdir()?;
    // The partitions' streams are made while every server is up.
    let n0 = node(&rig, root.path(), 0).await?;
    all_led(&n0.admin, &["n0"], 30).await?;
    rig.kill9(2);
    let sys = format!("{},{}", rig.sys_url(2), rig.sys_url(1));
    let n1 = start_node(root.path(), 1, &rig.urls(), &sys, "127.0.0.1:0").await?;
    let pending = |st: &Value| st["nats"]["pending"].as_array().map_or(0, Vec::len);
    let st = status(&n1.admin).await?;
    assert!(pending(&st) > 0, "nothing pending with a server down: {st}");
    let (_, metrics) = turnd_tests::http_get(&n1.admin, "/metrics").await?;
    assert!(
        turnd_tests::metric(&metrics, "turnd_cluster_nats_pending").is_some_and(|v| v > 0.0),
        "{metrics}"
    );
    // It takes its share of the partitions and serves turns of every partition.
    let urls = vec![n0.url.clone(), n1.url.clone()];
    let worker = echo_worker_on_all(&urls).await;
    let acked = submit_all(&n1.url, "down", 2 * PARTITIONS as usize).await?;
    all_completed(&n1.url, &acked).await?;
    turnd_tests::eventually(30, "node n1 leads a partition", || async {
        let st = status(&n1.admin).await.ok()?;
        st["leading"]
            .as_array()
            .filter(|l| !l.is_empty())
            .map(|_| ())
    })
    .await?;
    // The server back: the node's next check finds it, and nothing is pending.
    rig.restart(2).map_err(anyhow::Error::msg)?;
    let began = Instant::now();
    turnd_tests::eventually(30, "the returned server is checked", || async {
        let st = status(&n1.admin).await.ok()?;
        (pending(&st) == 0 && st["nats"]["unproven"].as_array().is_some_and(Vec::is_empty))
            .then_some(())
    })
    .await?;
    println!(
        "pending cleared {:?} after the restart began",
        began.elapsed()
    );
    worker.shutdown();
    n1.kill().await?;
    n0.kill().await?;
    Ok(())
}

/// A leader paused (SIGSTOP) past its leases loses its partitions to the others;
/// woken (SIGCONT), it finds its logs deposed and its leases gone, gives the
/// partitions up instead of writing, and later takes back those it should lead
/// once its standbys caught up. No acknowledged turn is lost, and every turn
/// submitted through the woken node completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_wakes_deposed_and_gives_up() -> anyhow::Result<()> {
    need_nats!();
    let rig = Rig::start(3).await.map_err(anyhow::Error::msg)?;
    let root = tempfile::tempdir()?;
    let nodes = start_three(&rig, root.path(), &[]).await?;
    let (pids, urls, admin, worker) = serving(&rig, &nodes).await?;
    let before = submit_all(&urls[0], "p", 12).await?;
    all_completed(&urls[0], &before).await?;
    // Wait until n1 leads something (the placement gives each node about a third).
    let led_by_n1 = |st: &Value| {
        st["partitions"]
            .as_array()
            .map_or(0, |ps| ps.iter().filter(|p| p["leader"] == "n1").count())
    };
    let mut tries = 0;
    while led_by_n1(&status(&admin).await?) == 0 {
        tries += 1;
        if tries > 100 {
            bail!("n1 leads nothing: {}", status(&admin).await?);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    signal(pids[1], "STOP")?;
    let paused = Instant::now();
    all_led(&admin, &["n0", "n2"], 30).await?;
    eprintln!(
        "a paused leader's partitions led again {:?} after the pause",
        paused.elapsed()
    );
    let during = submit_all(&urls[0], "q", 12).await?;
    signal(pids[1], "CONT")?;
    // The woken node gives up what it lost, then takes back what it should lead.
    all_led(&admin, &["n0", "n1", "n2"], 30).await?;
    let st = status(&nodes[1].admin).await?;
    eprintln!(
        "after waking, n1 took over {} and handed over {}",
        st["takeovers"], st["handovers"]
    );
    let after = submit_all(&urls[1], "r", 12).await?;
    all_completed(&urls[1], &before).await?;
    all_completed(&urls[1], &during).await?;
    all_completed(&urls[1], &after).await?;
    check_clean(&urls[1]).await?;
    worker.shutdown();
    for n in nodes {
        n.kill().await?;
    }
    Ok(())
}

/// The NATS server leading the owners bucket is paused: no lease can be renewed
/// until JetStream elects another leader of the bucket, seconds later, past every
/// lease. Each partition's leader goes on serving all the same, since its own
/// stream (led by a server still running) says no node fenced it, and no contender
/// takes a lease whose holder's heartbeat it hears. Turns run on every partition
/// throughout, each within 8 s, and no node takes over or gives up a partition
/// while the server is paused. (The nodes connect to the two other servers only,
/// so that their own connections stay up.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaders_serve_on_while_the_owners_bucket_elects_a_leader() -> anyhow::Result<()> {
    need_nats!();
    let rig = Rig::start(3).await.map_err(anyhow::Error::msg)?;
    let nats = rig.connect("test").await?;
    turnd_cluster::lease::Owners::open(&nats, 3).await?;
    let owners_stream = format!("KV_{}", turnd_cluster::lease::OWNERS_BUCKET);
    Rig::move_leader(&nats, &owners_stream, |l| l == "n3")
        .await
        .map_err(anyhow::Error::msg)?;
    let root = tempfile::tempdir()?;
    let two = rig.urls()[..2].to_vec();
    let mut nodes = Vec::new();
    for i in 0..3 {
        nodes.push(start_node(root.path(), i, &two, &rig.sys_url(i % 2), "127.0.0.1:0").await?);
    }
    let (_, urls, admin, worker) = serving(&rig, &nodes).await?;
    // Hand-overs to the preferred leaders wait for their standbys to catch up: the
    // leaders read the same over 3 s are where the placement puts them.
    let mut before = settled_leaders(&admin).await?;
    let mut settled = false;
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let now = settled_leaders(&admin).await?;
        settled = now == before;
        before = now;
        if settled {
            break;
        }
    }
    ensure!(settled, "the leaders did not settle in 30 s: {before:?}");
    for p in 0..PARTITIONS {
        let stream = turnd_cluster::log::stream::stream_name(p);
        Rig::move_leader(&nats, &stream, |l| l != "n3")
            .await
            .map_err(anyhow::Error::msg)?;
    }
    let c = Caller::connect(&urls[0], None).await?;
    for i in 0..12 {
        one_turn(&c, &format!("s{i}"), json!({ "warm": i })).await?;
    }
    // No hand-over still under way: the nodes' moves read the same 2 s apart.
    let mut moves = moves_of(&nodes).await?;
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let now = moves_of(&nodes).await?;
        if now == moves {
            break;
        }
        moves = now;
    }
    rig.pause(2);
    let paused = Instant::now();
    let mut turns = 0;
    let mut bucket_back = None;
    while paused.elapsed() < Duration::from_secs(10) {
        let session = format!("s{}", turns % 12);
        tokio::time::timeout(
            Duration::from_secs(8),
            one_turn(&c, &session, json!({ "during": turns })),
        )
        .await
        .with_context(|| {
            format!(
                "turn {turns} of {session}, {:?} into the pause",
                paused.elapsed()
            )
        })??;
        turns += 1;
        if bucket_back.is_none()
            && Rig::stream_leader(&nats, &owners_stream)
                .await
                .is_some_and(|l| l != "n3")
        {
            bucket_back = Some(paused.elapsed());
        }
    }
    eprintln!(
        "{turns} turns ran in the 10 s the server was paused; the owners bucket had a new leader {bucket_back:?} into it"
    );
    assert_eq!(
        moves_of(&nodes).await?,
        moves,
        "takeovers and partitions given up by each node, before and at the end of the pause"
    );
    rig.resume(2);
    let after = settled_leaders(&admin).await?;
    eprintln!("leaders and epochs before the pause {before:?}, after {after:?}");
    check_clean(&urls[0]).await?;
    worker.shutdown();
    for n in nodes {
        n.kill().await?;
    }
    Ok(())
}

/// A worker connected to every node sends each result, heartbeat and progress back
/// on the connection its invoke came on, so the partition's leader serves them
/// without a forward over NATS: sessions led by nodes other than the worker's first
/// URL run turns that heartbeat and progress through their leaders, and no node
/// forwards anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_goes_back_to_the_node_that_invoked_it() -> anyhow::Result<()> {
    need_nats!();
    let cl = Cluster::start(16).await?;
    let admin = &cl.nodes[0].admin;
    let forwarded = || async {
        let mut f = 0;
        for n in &cl.nodes {
            f += status(&n.admin).await?["forwarded"].as_u64().unwrap_or(0);
        }
        anyhow::Ok(f)
    };
    // A placement that moves during a round may forward a request: try again then.
    for round in 0..5 {
        let before = settled_leaders(admin).await?;
        let sent = forwarded().await?;
        let mut turns = 0;
        for s in 0..24 {
            let session = format!("r{round}-{s}");
            let p = turnd_proto::session_partition(&session, PARTITIONS) as usize;
            let li: usize = before[p]
                .0
                .trim_matches('"')
                .trim_start_matches('n')
                .parse()?;
            if li == 0 {
                continue;
            }
            let c = Caller::connect(&cl.urls[li], None).await?;
            turn_of(&c, &session, "beat", json!({ "s": s })).await?;
            turns += 1;
        }
        if leaders(admin).await? != before {
            eprintln!("round {round}: the placement moved; again");
            continue;
        }
        assert!(turns > 0, "no session of another node's partitions");
        assert_eq!(
            forwarded().await? - sent,
            0,
            "{turns} turns through their leaders, and a node forwarded requests \
             (an invocation's request sent to a node that does not lead its partition)"
        );
        return cl.stop().await;
    }
    bail!("the placement moved in every round")
}

/// Not a check: what a sequential turn costs on the cluster (`make bench-cluster`,
/// with `TURND_BIN` a release build). One turn at a time of a session led by each
/// node, through that node, and of node 0's session through node 1 (forwarded),
/// printed as p50 / p99 / max in ms; the numbers go to `docs/benchmarks.md`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: make bench-cluster"]
async fn measure_sequential_turns() -> anyhow::Result<()> {
    need_nats!();
    let cl = Cluster::start(16).await?;
    let (nodes, urls) = (&cl.nodes, &cl.urls);
    settled_leaders(&nodes[0].admin).await?;
    let turns = usize::try_from(env_or("TURNS", 500))?;
    let led = leaders(&nodes[0].admin).await?;
    appends_on(nodes).await?;
    // A session of a partition each node leads, measured through its leader; the
    // worker's first URL is node 0's, so the sessions of the other two show what a
    // worker sees of the partitions led elsewhere. Then one forwarded.
    let mut runs = Vec::new();
    for li in 0..3 {
        let Some(session) = (0..1000).map(|k| format!("bench-seq-{k}")).find(|s| {
            let p = turnd_proto::session_partition(s, PARTITIONS) as usize;
            led[p].0.trim_matches('"') == format!("n{li}")
        }) else {
            continue;
        };
        runs.push((format!("through its leader n{li}"), session.clone(), li));
        if li == 0 {
            runs.push(("forwarded by n1 to n0".into(), session, 1));
        }
    }
    for (label, session, via) in runs {
        let c = Caller::connect(&urls[via], None).await?;
        let mut ms = Vec::with_capacity(turns);
        for i in 0..turns {
            let t = Instant::now();
            one_turn(&c, &session, json!({ "i": i })).await?;
            ms.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        ms.sort_by(f64::total_cmp);
        let at = |q: f64| ms[((ms.len() as f64 * q) as usize).min(ms.len() - 1)];
        println!(
            "cluster sequential ({label}, {turns} turns): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            at(0.5),
            at(0.99),
            ms[ms.len() - 1]
        );
    }
    appends_on(nodes).await?;
    cl.stop().await
}

/// Print where each node's led partitions' appends go out: partition to the
/// server (its stream's leader) on whose own connection they are published.
async fn appends_on(nodes: &[BinDaemon]) -> anyhow::Result<()> {
    for (i, n) in nodes.iter().enumerate() {
        let st = status(&n.admin).await?;
        println!(
            "n{i} leads {} and publishes on the stream leader's server for {}",
            st["leading"], st["appends_on"]
        );
    }
    Ok(())
}

/// `name` from the environment, or `default`.
fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A process's CPU time (user and system) in ms, from `/proc/<pid>/stat` (in
/// USER_HZ, 100 a second); 0 for one that is gone.
fn cpu_ms(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // The fields after the command's closing parenthesis: state is the first,
    // utime the 12th and stime the 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    (f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0)) as f64 * 10.0
}

/// `sessions` closed loops of one echo turn at a time, each on a caller of its
/// own connected to `urls[i % urls.len()]`, for a second of warm-up and then `secs`
/// seconds measured: turns a second, a turn's p50 / p99, and the CPU time per turn
/// of the turnd processes `turnd`, the nats-servers `nats` and this process (the
/// callers and the worker), printed under `label`.
async fn load(
    label: &str,
    urls: &[String],
    turnd: &[u32],
    nats: &[u32],
    sessions: u64,
    secs: u64,
) -> anyhow::Result<()> {
    let from = Instant::now() + Duration::from_secs(1);
    let until = from + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for i in 0..sessions {
        let url = urls[i as usize % urls.len()].clone();
        tasks.push(tokio::spawn(async move {
            let c = Caller::connect(&url, None).await?;
            let session = format!("load-{i}");
            let mut ms = Vec::new();
            let mut k = 0u64;
            while Instant::now() < until {
                let t = Instant::now();
                one_turn(&c, &session, json!({ "k": k })).await?;
                if t >= from && Instant::now() <= until {
                    ms.push(t.elapsed().as_secs_f64() * 1000.0);
                }
                k += 1;
            }
            anyhow::Ok(ms)
        }));
    }
    let group = |pids: &[u32]| pids.iter().map(|p| cpu_ms(*p)).sum::<f64>();
    let me = std::process::id();
    tokio::time::sleep_until(from.into()).await;
    let before = (group(turnd), group(nats), cpu_ms(me));
    tokio::time::sleep_until(until.into()).await;
    let after = (group(turnd), group(nats), cpu_ms(me));
    let mut ms = Vec::new();
    for t in tasks {
        ms.extend(t.await??);
    }
    ms.sort_by(f64::total_cmp);
    let n = ms.len().max(1);
    let at = |q: f64| {
        ms.get(((n as f64 * q) as usize).min(n - 1))
            .copied()
            .unwrap_or(0.0)
    };
    let per_turn = |a: f64, b: f64| (b - a) * 1000.0 / n as f64;
    println!(
        "{label}: {sessions} sessions, {} turns in {secs} s: {:.0} turns/s, p50 {:.2} ms, p99 {:.2} ms; \
         CPU per turn: turnd {:.0} µs, nats-server {:.0} µs, callers and worker {:.0} µs",
        ms.len(),
        ms.len() as f64 / secs as f64,
        at(0.5),
        at(0.99),
        per_turn(before.0, after.0),
        per_turn(before.1, after.1),
        per_turn(before.2, after.2),
    );
    Ok(())
}

/// Not a check: the three-node cluster's throughput beside one node's on the same
/// machine (`make bench-cluster-throughput`, with `TURND_BIN` a release build).
/// `SESSIONS` sessions (64) in closed loops for `SECS` seconds (10): on one node
/// (no `[cluster]`: its own commit log on the local disk) every caller on it; on
/// the cluster the callers spread over the three nodes, so that two requests in
/// three are forwarded to their partition's leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: make bench-cluster-throughput"]
async fn measure_throughput() -> anyhow::Result<()> {
    need_nats!();
    let sessions = env_or("SESSIONS", 64);
    let secs = env_or("SECS", 10);
    let concurrency = u32::try_from(sessions)?;
    if std::env::var_os("ONLY_CLUSTER").is_none() {
        let root = tempfile::tempdir()?;
        let d = BinDaemon::start(&root.path().join("one"), &[("TURND_LOG__LEVEL", "info")]).await?;
        let urls = vec![d.url.clone()];
        let worker = echo_worker(&urls, concurrency).await;
        let pids: Vec<u32> = d.child.id().into_iter().collect();
        load("one node", &urls, &pids, &[], sessions, secs).await?;
        worker.shutdown();
        d.kill().await?;
    }
    let cl = Cluster::start(concurrency).await?;
    settled_leaders(&cl.nodes[0].admin).await?;
    let pids: Vec<u32> = cl.nodes.iter().filter_map(|n| n.child.id()).collect();
    eprintln!("turnd pids {pids:?}, nats-server pids {:?}", cl.rig.pids());
    load(
        "three nodes",
        &cl.urls,
        &pids,
        &cl.rig.pids(),
        sessions,
        secs,
    )
    .await?;
    cl.stop().await
}
