//! turnd across machines under seeded fault schedules, with a history checker.
//!
//! Three `nats-server` (R=3, `sync_interval: always`) and three `turnd` nodes on
//! loopback, each node's NATS connections through a proxy that can cut them; one
//! caller per session submitting turns through random nodes, a worker connected to
//! every node. From a seed (printed at the start; `CLUSTER_SEED=` replays it) a
//! schedule of faults is applied while the load runs: kill -9 of a node, SIGSTOP and
//! SIGCONT of one, kill -9 of a NATS server, a node and a server at once, a node cut
//! from NATS, a rolling restart. Then the checker reads what every node holds and
//! reports the first violation of: no acknowledged turn lost, every turn terminal,
//! per-session FIFO, one step of a session in flight, `store.check` clean, every
//! replica of a partition equal, no request failed by a rolling restart.
//!
//! `seeded_faults_keep_every_promise` is in `make test-cluster`;
//! `seeded_faults_long` (ignored) is `make test-cluster-long SEEDS=…`;
//! `measure_failover` (ignored) is `make bench-failover`.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

mod checker;
mod harness;
mod load;
mod replicas;
mod schedule;

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use turnd_testkit::SplitMix64;
use turnd_tests::cluster::{check_clean, retrying, PARTITIONS};
use turnd_tests::need_nats;

use checker::History;
use harness::{recording_worker, Cluster};
use load::Load;
use schedule::Fault;

/// Sessions the load runs.
const SESSIONS: usize = 8;
/// The streams' size limit the nodes are started with (`STREAM_MAX_MB` 32).
const STREAM_MAX_BYTES: i64 = 32 << 20;
/// The seeds of `make test-cluster` when `CLUSTER_SEED` is not set.
const SHORT_SEEDS: [u64; 1] = [1];

/// Seeds from `var` (comma-separated, decimal or 0x hex), if set.
fn seeds_from(var: &str) -> anyhow::Result<Option<Vec<u64>>> {
    let Ok(s) = std::env::var(var) else {
        return Ok(None);
    };
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let seed = match part.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16),
            None => part.parse(),
        }
        .with_context(|| format!("{var}: {part:?} is not a seed"))?;
        out.push(seed);
    }
    Ok(Some(out))
}

/// The number in `var`, or `default`.
fn env_count(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What a run found.
struct Report {
    acked: usize,
    failovers: Vec<(Fault, Duration)>,
    rolling_failed: Vec<load::Seen>,
}

/// Run the faults of `plan` with load on a fresh cluster and check the history;
/// Err names the seed and the first violation.
async fn run(seed: u64, plan: &[Fault]) -> anyhow::Result<Report> {
    eprintln!("faults: seed {seed} (CLUSTER_SEED={seed} replays it): {plan:?}");
    let mut c = Cluster::start().await?;
    c.settled(60).await?;
    let h = History::default();
    let worker = recording_worker(&c.urls, &h).await;
    let mut load = Load::start(&c.urls, SESSIONS, seed, &h);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let mut rng = SplitMix64::new(seed ^ 0x5eed);
    let mut report = Report {
        acked: 0,
        failovers: Vec::new(),
        rolling_failed: Vec::new(),
    };
    for (n, f) in plan.iter().enumerate() {
        let at = Instant::now();
        let applied = schedule::apply(&mut c, &load, *f)
            .await
            .with_context(|| format!("seed {seed}: fault {n} {f:?}"))?;
        eprintln!(
            "faults: {f:?} done in {:?} (failover {:?}), {} turns acknowledged so far",
            at.elapsed(),
            applied.failover,
            h.count()
        );
        if let Some(d) = applied.failover {
            report.failovers.push((*f, d));
        }
        if let Some(failed) = applied.rolling_failed {
            report.rolling_failed.extend(failed);
        }
        tokio::time::sleep(Duration::from_millis(rng.range(300, 1_000))).await;
    }
    load.stop().await?;
    report.acked = h.count();
    let verdict = check_all(&mut c, &h, &load, &report.rolling_failed).await?;
    worker.shutdown();
    if let Err(v) = verdict {
        bail!("seed {seed}: VIOLATION: {v}");
    }
    eprintln!(
        "faults: seed {seed}: every promise kept; {} turns acknowledged, failovers {:?}, \
         rolling restart failed {} requests {:?}",
        report.acked,
        report.failovers,
        report.rolling_failed.len(),
        load::tally(&report.rolling_failed)
    );
    Ok(report)
}

/// Every check, in order; the first violation.
async fn check_all(
    c: &mut Cluster,
    h: &History,
    load: &Load,
    rolling: &[load::Seen],
) -> anyhow::Result<Result<(), String>> {
    if let Some(f) = load.fatal().first() {
        return Ok(Err(format!(
            "a request to n{} sent at {} failed for good: {}",
            f.node,
            f.sent_utc(),
            f.what
        )));
    }
    // A rolling restart fails no request: a draining node forwards its
    // connections' requests to the partitions' next leaders and closes them only
    // once they are answered, with a 1001 that tells the caller to send again what
    // it sent in the instant of the close (the node never read it); a hand-over
    // lets the writes in flight settle. One case is not prevented yet
    // (docs/cluster.md, "What a node cannot do yet"), and is counted, not failed: a
    // write refused as deposed (a restarted node fenced a log whose holder renewed
    // its lease late; nothing changed).
    let (known, failed): (Vec<&load::Seen>, Vec<&load::Seen>) =
        rolling.iter().partition(|e| e.what.contains("deposed"));
    if !known.is_empty() {
        let known: Vec<load::Seen> = known.iter().map(|e| (*e).clone()).collect();
        eprintln!(
            "rolling restart: {} requests refused as deposed (by kind {:?}; each sent again with its key), the first to n{}: {}",
            known.len(),
            load::tally(&known),
            known[0].node,
            known[0].what
        );
    }
    if let Some(f) = failed.first() {
        let failed: Vec<load::Seen> = failed.iter().map(|e| (*e).clone()).collect();
        return Ok(Err(format!(
            "a rolling restart failed {} requests (by kind {:?}), the first to n{} sent at {}: {}",
            failed.len(),
            load::tally(&failed),
            f.node,
            f.sent_utc(),
            f.what
        )));
    }
    let url = c.url()?.to_string();
    // Every acknowledged turn ends (bounded: each wait at most 30 s).
    for a in h.acked().values().flatten() {
        let id = a.turn_id.clone();
        let url = url.clone();
        let done = retrying(60, || {
            let (id, url) = (id.clone(), url.clone());
            async move {
                let c = turnd_client::Caller::connect(&url, None).await?;
                c.wait_terminal(&id, Duration::from_secs(30)).await
            }
        })
        .await;
        if let Err(e) = done {
            if !e.to_string().contains("not_found") {
                return Ok(Err(format!(
                    "turn {} (session {}) did not end: {e:#}",
                    a.turn_id, a.session
                )));
            }
        }
    }
    let caller = turnd_client::Caller::connect(&url, None).await?;
    match checker::check_cluster(h, &caller).await? {
        Ok(n) => eprintln!("checker: {n} acknowledged turns, their sessions' events and runs hold"),
        Err(v) => return Ok(Err(v)),
    }
    if let Err(e) = check_clean(&url).await {
        return Ok(Err(format!("{e:#}")));
    }
    c.stop_nodes().await?;
    let nats = c.rig.connect("checker").await?;
    match replicas::check_replicas(&nats, &c.roots(), PARTITIONS, STREAM_MAX_BYTES).await? {
        Ok(sizes) => eprintln!("checker: every replica equal, keys per partition {sizes:?}"),
        Err(v) => return Ok(Err(v)),
    }
    Ok(Ok(()))
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)]
}

/// A short seeded run of every kind of fault once (`make test-cluster`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_faults_keep_every_promise() -> anyhow::Result<()> {
    need_nats!();
    let seeds = seeds_from("CLUSTER_SEED")?.unwrap_or_else(|| SHORT_SEEDS.to_vec());
    for seed in seeds {
        let plan = schedule::every_kind(&mut SplitMix64::new(seed));
        run(seed, &plan).await?;
    }
    Ok(())
}

/// Longer runs: `SEEDS` (a list, or `N` random seeds as `random:N`), `FAULTS`
/// faults each (`make test-cluster-long`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: make test-cluster-long SEEDS=..."]
async fn seeded_faults_long() -> anyhow::Result<()> {
    need_nats!();
    let faults = env_count("FAULTS", 12);
    let seeds = match std::env::var("SEEDS").ok().as_deref().map(str::trim) {
        Some(s) if s.starts_with("random:") => {
            let n: u64 = s["random:".len()..].parse().context("SEEDS=random:N")?;
            let mut rng = SplitMix64::new(SplitMix64::seed_from_env());
            (0..n).map(|_| rng.next_u64()).collect()
        }
        _ => seeds_from("SEEDS")?.unwrap_or_else(|| vec![1, 2, 3]),
    };
    for seed in seeds {
        let plan = schedule::random(&mut SplitMix64::new(seed), faults);
        run(seed, &plan).await?;
    }
    Ok(())
}

/// Not a check: how long a killed node's partitions take to serve again, alone and
/// with a NATS server killed at the same moment (`RUNS` each), and how many
/// requests a rolling restart fails (`make bench-failover`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: make bench-failover"]
async fn measure_failover() -> anyhow::Result<()> {
    need_nats!();
    let runs = env_count("RUNS", 10);
    let mut c = Cluster::start().await?;
    c.settled(60).await?;
    let h = History::default();
    let worker = recording_worker(&c.urls, &h).await;
    let mut load = Load::start(&c.urls, SESSIONS, 7, &h);
    for (label, with_nats) in [("a node", false), ("a node and a NATS server", true)] {
        let mut took = Vec::new();
        for r in 0..runs {
            let node = 1 + r % 2;
            let led = led_by(&c, node).await?;
            let at = Instant::now();
            if with_nats {
                c.rig.kill9(r % 3);
            }
            c.kill(node).await?;
            let served = serving_again(&c, &led, at).await?;
            took.push(served);
            if with_nats {
                schedule::restart_server(&mut c, r % 3).await?;
            }
            c.restart(node).await?;
            c.settled(60).await?;
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        took.sort();
        println!(
            "failover, {label} killed ({runs} runs): served again p50 {:?}, p99 {:?}, max {:?}",
            quantile(&took, 0.5),
            quantile(&took, 0.99),
            took[took.len() - 1]
        );
    }
    let from = Instant::now();
    for node in 0..3 {
        c.terminate(node).await?;
        c.restart(node).await?;
        c.settled(60).await?;
    }
    let errors = load.errors_between(from, Instant::now());
    println!(
        "rolling restart of 3 nodes in {:?}: {} requests failed, by kind {:?}",
        from.elapsed(),
        errors.len(),
        load::tally(&errors)
    );
    load.stop().await?;
    println!("{} turns acknowledged during the measurement", h.count());
    worker.shutdown();
    c.stop_nodes().await?;
    Ok(())
}

/// The partitions node `i` leads now.
async fn led_by(c: &Cluster, i: usize) -> anyhow::Result<Vec<u32>> {
    let st = turnd_tests::cluster::status(c.admin()?).await?;
    Ok(turnd_tests::cluster::leaders(&st)
        .iter()
        .enumerate()
        .filter(|(_, l)| l.as_deref() == Some(harness::NAMES[i]))
        .map(|(p, _)| p as u32)
        .collect())
}

/// From `at` (the kill), how long until a turn is acknowledged on every partition
/// of `led` (those the killed node led).
async fn serving_again(c: &Cluster, led: &[u32], at: Instant) -> anyhow::Result<Duration> {
    let url = c.url()?.to_string();
    for &p in led {
        let session = (0..10_000)
            .map(|i| format!("probe-{i}"))
            .find(|s| turnd_proto::session_partition(s, PARTITIONS) == p)
            .context("a session of the partition")?;
        let url = url.clone();
        retrying(60, || {
            let (url, session) = (url.clone(), session.clone());
            async move {
                let c = turnd_client::Caller::connect(&url, None).await?;
                c.submit_simple(&session, "echo", serde_json::json!({}))
                    .await
            }
        })
        .await?;
    }
    Ok(at.elapsed())
}
