//! The benchmark scenarios. Each starts the real daemon in this process,
//! drives it over WebSocket through the SDK and prints one markdown row.
//!
//! Latency is measured from just before `turn.submit` is sent to the answer of the
//! `turn.wait` that saw the turn terminal; both requests go over the same caller
//! connection. Throughput is finished turns over the wall time from the first submit
//! to the last terminal answer.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::json;
use tokio::task::JoinSet;
use tokio::time::Instant;
use turnd_client::turnd_proto::TurnStatus;
use turnd_client::Caller;

use crate::daemon::{callers, close_callers, BenchDaemon, KvSnapshot, Workers, ECHO, NOBODY};
use crate::measure::{
    commit_delta, describe_threads, loadavg, proc_status_kb, threads_cpu, Cpu, Latencies, Row,
};
use crate::Common;

/// How long one turn may take before the benchmark gives up on it.
const TURN_LIMIT: Duration = Duration::from_secs(300);

/// Everything measured about the daemon over one phase.
pub struct Probe {
    cpu: Cpu,
    commits: turnd_store::CommitStats,
    kv: KvSnapshot,
    threads: BTreeMap<String, Duration>,
    start: Instant,
    load: Option<f64>,
}

/// What [`Probe::finish`] found.
pub struct Measured {
    pub cpu: Cpu,
    pub commits: turnd_store::CommitStats,
    pub notes: String,
}

impl Probe {
    pub fn start(d: &BenchDaemon) -> Probe {
        Probe {
            cpu: Cpu::now(),
            commits: d.commit_stats(),
            kv: d.kv_counts(),
            threads: threads_cpu(),
            start: Instant::now(),
            load: loadavg(),
        }
    }

    pub fn finish(self, d: &BenchDaemon) -> Measured {
        let wall = self.start.elapsed();
        let cpu = Cpu::now().since(self.cpu);
        let commits = commit_delta(&d.commit_stats(), &self.commits);
        let kv = d.kv_counts().since(self.kv);
        let threads = describe_threads(&self.threads, &threads_cpu(), cpu.total());
        let secs = wall.as_secs_f64().max(1e-9);
        let apply = commits.commit_micros.saturating_sub(commits.sync_micros) as f64 / 1e6 / secs;
        let sync = commits.sync_micros as f64 / 1e6 / secs;
        let load = |l: Option<f64>| l.map(|l| format!("{l:.1}")).unwrap_or_else(|| "?".into());
        let notes = format!(
            "log writer busy {:.0}% of the wall time writing and syncing the commit log and {:.0}% putting groups in the overlay; {}; {}; machine load average {} at start, {} at end (2 cores, shared)",
            sync * 100.0,
            apply * 100.0,
            kv.describe(),
            threads,
            load(self.load),
            load(loadavg())
        );
        Measured {
            cpu,
            commits,
            notes,
        }
    }
}

/// What one batch of turns did.
#[derive(Debug, Default)]
pub struct TurnsRun {
    pub completed: u64,
    pub failed: u64,
    pub first_error: Option<String>,
    pub wall: Duration,
    /// submit → terminal.
    pub terminal: Latencies,
    /// submit → acknowledged (one durable commit).
    pub submit: Latencies,
}

#[derive(Debug, Default)]
struct SessionRun {
    completed: u64,
    failed: u64,
    first_error: Option<String>,
    terminal: Latencies,
    submit: Latencies,
}

impl SessionRun {
    fn error(&mut self, e: String) {
        self.failed += 1;
        if self.first_error.is_none() {
            self.first_error = Some(e);
        }
    }
}

/// `sessions` sessions × `turns` turns of `steps` steps, all sessions at once: each
/// session submits its turns one after the other (each as soon as the previous submit
/// is acknowledged, so its FIFO order is the submit order) and waits for each on the
/// same connection in the background.
pub async fn run_turns(
    callers: &[Arc<Caller>],
    prefix: &str,
    sessions: usize,
    turns: usize,
    steps: u64,
    input_bytes: usize,
) -> anyhow::Result<TurnsRun> {
    if callers.is_empty() {
        bail!("no caller connections");
    }
    // Filler that makes each input (and so each echoed output) about this large.
    let pad: Arc<str> = "x".repeat(input_bytes).into();
    let start = Instant::now();
    let mut set = JoinSet::new();
    for s in 0..sessions {
        let caller = callers[s % callers.len()].clone();
        let sid = format!("{prefix}-{s}");
        let pad = pad.clone();
        set.spawn(async move {
            let mut run = SessionRun::default();
            let mut waits = JoinSet::new();
            for j in 0..turns {
                let t0 = Instant::now();
                let input = if pad.is_empty() {
                    json!({"steps": steps, "j": j})
                } else {
                    json!({"steps": steps, "j": j, "pad": &*pad})
                };
                match caller.submit_simple(&sid, ECHO, input).await {
                    Ok(turn) => {
                        run.submit.push(t0.elapsed());
                        let caller = caller.clone();
                        waits.spawn(async move {
                            let r = caller.wait_terminal(&turn.turn_id, TURN_LIMIT).await;
                            (r, t0.elapsed())
                        });
                    }
                    Err(e) => run.error(format!("submit: {e}")),
                }
            }
            while let Some(joined) = waits.join_next().await {
                match joined {
                    Ok((Ok(turn), took)) if turn.status == TurnStatus::Completed => {
                        run.completed += 1;
                        run.terminal.push(took);
                    }
                    Ok((Ok(turn), _)) => run.error(format!(
                        "turn {} ended {} ({:?})",
                        turn.turn_id,
                        turn.status.as_str(),
                        turn.error
                    )),
                    Ok((Err(e), _)) => run.error(format!("wait: {e}")),
                    Err(e) => run.error(format!("wait task: {e}")),
                }
            }
            run
        });
    }
    let mut out = TurnsRun::default();
    while let Some(joined) = set.join_next().await {
        let run = joined.context("session task failed")?;
        out.completed += run.completed;
        out.failed += run.failed;
        if out.first_error.is_none() {
            out.first_error = run.first_error;
        }
        out.terminal.extend(run.terminal);
        out.submit.extend(run.submit);
    }
    out.wall = start.elapsed();
    Ok(out)
}

fn data_dir(common: &Common) -> anyhow::Result<(tempfile::TempDir, PathBuf)> {
    let tmp = match &common.tmp {
        Some(p) => tempfile::Builder::new()
            .prefix("turnd-bench-")
            .tempdir_in(p)?,
        None => tempfile::Builder::new().prefix("turnd-bench-").tempdir()?,
    };
    let data = tmp.path().join("data");
    Ok((tmp, data))
}

fn sync_label(sync: &str) -> String {
    match sync {
        "never" => "**never (NOT durable)**".into(),
        other => other.into(),
    }
}

fn report_turns(
    scenario: &str,
    common: &Common,
    work: String,
    mut run: TurnsRun,
    m: Measured,
    steps: u64,
) -> anyhow::Result<()> {
    let Measured {
        cpu,
        commits,
        notes: diag,
    } = m;
    let secs = run.wall.as_secs_f64().max(1e-9);
    let rate = run.completed as f64 / secs;
    let mut throughput = format!("{rate:.0} turns/s");
    if steps > 1 {
        throughput.push_str(&format!(" ({:.0} steps/s)", rate * steps as f64));
    }
    let [s50, s90, s99, smax] = run.submit.summary();
    let f = |v: Option<f64>| v.map(|v| format!("{v:.2}")).unwrap_or_else(|| "–".into());
    let mut notes = format!(
        "submit→ack p50/p90/p99/max {}/{}/{}/{} ms; CPU {:.0} µs per turn",
        f(s50),
        f(s90),
        f(s99),
        f(smax),
        cpu.total().as_secs_f64() * 1e6 / run.completed.max(1) as f64
    );
    notes.push_str("; ");
    notes.push_str(&diag);
    if run.failed > 0 {
        notes.push_str(&format!(
            "; **{} turns failed** (first: {})",
            run.failed,
            run.first_error.as_deref().unwrap_or("?")
        ));
    }
    let row = Row {
        scenario: scenario.into(),
        sync: sync_label(&common.sync),
        work,
        wall: Some(run.wall),
        throughput,
        latency: run.terminal.summary(),
        cpu: Some(cpu),
        rss_peak_kb: proc_status_kb("VmHWM"),
        commits: Some(commits),
        notes,
    };
    println!(
        "{scenario}: {} completed, {} failed in {:.2} s = {rate:.0} turns/s",
        run.completed,
        run.failed,
        run.wall.as_secs_f64()
    );
    row.print();
    if run.failed > 0 {
        bail!("{} turns did not complete", run.failed);
    }
    Ok(())
}

/// `sessions`: K sessions × M one-step turns (or `steps` steps: `multistep`).
pub async fn sessions(
    common: &Common,
    scenario: &str,
    k: usize,
    m: usize,
    steps: u64,
) -> anyhow::Result<()> {
    let (_tmp, data) = data_dir(common)?;
    let d = BenchDaemon::start(&data, common).await?;
    let workers = Workers::start(&d.url, common.workers, common.concurrency).await?;
    let cs = callers(&d.url, common.callers).await?;
    // Warm up connections and code paths; not measured.
    run_turns(&cs, "warm", cs.len(), 2, 1, common.input_bytes).await?;
    let probe = Probe::start(&d);
    let run = run_turns(&cs, "bench", k, m, steps, common.input_bytes).await?;
    let measured = probe.finish(&d);
    let work = if steps > 1 {
        format!(
            "{k} sessions × {m} turns × {steps} steps; {} workers × concurrency {}; {} caller conns",
            common.workers, common.concurrency, common.callers
        )
    } else {
        format!(
            "{k} sessions × {m} one-step turns; {} workers × concurrency {}; {} caller conns",
            common.workers, common.concurrency, common.callers
        )
    };
    close_callers(cs).await;
    workers.stop().await?;
    d.shutdown().await?;
    report_turns(scenario, common, work, run, measured, steps)
}

/// `sequential`: one session, `n` turns, each submitted after the previous finished.
pub async fn sequential(common: &Common, n: usize, warmup: usize) -> anyhow::Result<()> {
    let (_tmp, data) = data_dir(common)?;
    let d = BenchDaemon::start(&data, common).await?;
    let workers = Workers::start(&d.url, 1, 1).await?;
    let cs = callers(&d.url, 1).await?;
    let caller = cs[0].clone();
    let mut run = TurnsRun::default();
    let mut probe = Probe::start(&d);
    let mut start = Instant::now();
    for i in 0..warmup + n {
        if i == warmup {
            probe = Probe::start(&d);
            start = Instant::now();
        }
        let t0 = Instant::now();
        let turn = caller
            .submit_simple("seq", ECHO, json!({"i": i}))
            .await
            .context("submit")?;
        let acked = t0.elapsed();
        let done = caller
            .wait_terminal(&turn.turn_id, TURN_LIMIT)
            .await
            .context("wait")?;
        let took = t0.elapsed();
        if done.status != TurnStatus::Completed {
            bail!("turn {} ended {}", done.turn_id, done.status.as_str());
        }
        if i >= warmup {
            run.completed += 1;
            run.submit.push(acked);
            run.terminal.push(took);
        }
    }
    run.wall = start.elapsed();
    let measured = probe.finish(&d);
    close_callers(cs).await;
    workers.stop().await?;
    d.shutdown().await?;
    let work = format!(
        "1 session × {n} sequential turns (submit, wait, next); {warmup} warm-up turns not counted"
    );
    report_turns("sequential", common, work, run, measured, 1)
}

/// `idle`: `n` sessions with one queued turn each, no worker; reports memory.
pub async fn idle(common: &Common, n: usize, inflight: usize) -> anyhow::Result<()> {
    let (_tmp, data) = data_dir(common)?;
    let rss_before_start = proc_status_kb("VmRSS");
    let d = BenchDaemon::start(&data, common).await?;
    let cs = callers(&d.url, common.callers).await?;
    let rss_base = proc_status_kb("VmRSS");
    let probe = Probe::start(&d);
    let start = Instant::now();
    let Bounded {
        lat: mut submit,
        failed,
        first_error,
    } = bounded(n, inflight, |s| {
        let caller = cs[s % cs.len()].clone();
        async move {
            let r = caller
                .submit_simple(&format!("idle-{s}"), NOBODY, json!({"s": s}))
                .await;
            r.map(|_| ()).map_err(|e| e.to_string())
        }
    })
    .await;
    let wall = start.elapsed();
    let measured = probe.finish(&d);
    let stats = cs[0].stats().await.context("stats")?;
    let rss_loaded = proc_status_kb("VmRSS");
    // What the store still held in memory for sled then, and the resident size once
    // sled has taken it (connections still open), up to 2 s later.
    let overlay_loaded = d.kv.overlay_len();
    let drained_by = Instant::now() + Duration::from_secs(2);
    while d.kv.overlay_len() > 0 && Instant::now() < drained_by {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let overlay_after = d.kv.overlay_len();
    let rss_applied = proc_status_kb("VmRSS");
    let alloc_applied = crate::measure::alloc_stats();
    close_callers(cs).await;
    // Let the closed connections' tasks and buffers go.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_settled = proc_status_kb("VmRSS");
    let alloc_settled = crate::measure::alloc_stats();
    let hwm = proc_status_kb("VmHWM");
    d.shutdown().await?;
    let kb = |v: Option<u64>| crate::measure::mb(v);
    println!(
        "idle: {} submitted ({} failed) in {:.2} s; daemon counts {} queued, {} sessions active",
        submit.len(),
        failed,
        wall.as_secs_f64(),
        stats.turns.queued,
        stats.sessions.active
    );
    let row = Row {
        scenario: "idle".into(),
        sync: sync_label(&common.sync),
        work: format!(
            "{n} sessions × 1 queued turn, no worker; {} caller conns, {inflight} submits in flight",
            common.callers
        ),
        wall: Some(wall),
        throughput: format!("{:.0} submits/s", submit.len() as f64 / wall.as_secs_f64().max(1e-9)),
        latency: submit.summary(),
        cpu: Some(measured.cpu),
        rss_peak_kb: hwm,
        commits: Some(measured.commits),
        notes: format!(
            "latency columns = submit→ack; RSS: {} before the daemon started, {} after start, {} with all {} turns queued (connections open; {} keys not yet in sled), {} once sled had them ({} keys left; {alloc_applied}), {} after the callers closed ({alloc_settled}); daemon reports {} queued turns; {}",
            kb(rss_before_start),
            kb(rss_base),
            kb(rss_loaded),
            n,
            overlay_loaded,
            kb(rss_applied),
            overlay_after,
            kb(rss_settled),
            stats.turns.queued,
            measured.notes
        ),
    };
    row.print();
    fail_if_any(failed, first_error, "submits")
}

/// Resident size once the daemon's memory has settled after a phase: the lowest of
/// a few readings over `wait`, taken after the engine holds no more than `live`
/// sessions (or `wait` passed).
async fn settled_rss(d: &BenchDaemon, live: usize, wait: Duration) -> (Option<u64>, usize) {
    let until = Instant::now() + wait;
    let engine = d.daemon.engine().expect("a daemon on its own");
    while engine.sessions_in_memory() > live && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut low = proc_status_kb("VmRSS");
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if let Some(now) = proc_status_kb("VmRSS") {
            low = Some(low.map_or(now, |l| l.min(now)));
        }
    }
    (low, engine.sessions_in_memory())
}

/// `idle --what finished`: `n` sessions that each run one turn to completion on an
/// echo worker, then idle; reports the resident size after they finished against the
/// empty daemon's.
pub async fn idle_finished(common: &Common, n: usize, inflight: usize) -> anyhow::Result<()> {
    let (_tmp, data) = data_dir(common)?;
    let rss_before_start = proc_status_kb("VmRSS");
    let d = BenchDaemon::start(&data, common).await?;
    let workers = Workers::start(&d.url, common.workers, common.concurrency).await?;
    let cs = callers(&d.url, common.callers).await?;
    let (rss_base, _) = settled_rss(&d, 0, Duration::from_secs(1)).await;
    let alloc_base = crate::measure::alloc_stats();
    let probe = Probe::start(&d);
    let start = Instant::now();
    let Bounded {
        mut lat,
        failed,
        first_error,
    } = bounded(n, inflight, |s| {
        let caller = cs[s % cs.len()].clone();
        run_done(caller, s)
    })
    .await;
    let wall = start.elapsed();
    let measured = probe.finish(&d);
    let stats = cs[0].stats().await.context("stats")?;
    // Idle: long enough for the store to reopen sled once writes have paused (which
    // gives back what its cache grew to in the burst), and a few readings after.
    let idle = turnd_store::DEFAULT_IDLE_REOPEN + Duration::from_secs(3);
    let (rss_done, in_memory) = settled_rss(&d, 0, idle).await;
    let alloc_done = crate::measure::alloc_stats();
    close_callers(cs).await;
    workers.stop().await?;
    let (rss_settled, _) = settled_rss(&d, 0, Duration::from_secs(2)).await;
    let alloc_settled = crate::measure::alloc_stats();
    let hwm = proc_status_kb("VmHWM");
    d.shutdown().await?;
    let kb = |v: Option<u64>| crate::measure::mb(v);
    let growth = match (rss_done, rss_base) {
        (Some(a), Some(b)) => format!("{} MB", (a as i64 - b as i64) / 1024),
        _ => "–".into(),
    };
    let row = Row {
        scenario: "idle (finished)".into(),
        sync: sync_label(&common.sync),
        work: format!(
            "{n} sessions × 1 turn run to completion, then idle; {} caller conns, {inflight} turns in flight",
            common.callers
        ),
        wall: Some(wall),
        throughput: format!("{:.0} turns/s", lat.len() as f64 / wall.as_secs_f64().max(1e-9)),
        latency: lat.summary(),
        cpu: Some(measured.cpu),
        rss_peak_kb: hwm,
        commits: Some(measured.commits),
        notes: format!(
            "latency columns = submit→completed; RSS: {} before the daemon started, {} with the daemon, workers and callers connected, {} after all {n} turns completed ({growth} over the connected daemon; {in_memory} sessions in memory, {} completed), {} after the callers and workers closed; connected: {alloc_base}; all completed: {alloc_done}; closed: {alloc_settled}; {}",
            kb(rss_before_start),
            kb(rss_base),
            kb(rss_done),
            stats.turns.completed,
            kb(rss_settled),
            measured.notes
        ),
    };
    row.print();
    fail_if_any(failed, first_error, "turns")
}

/// `idle --what unknown`: `n` reads of ids that do not exist (`session.inspect`,
/// `turn.list`, `session.events`, `session.stop`, `turn.get` in turn) on an empty
/// daemon; reports how much the resident size grew.
pub async fn idle_unknown(common: &Common, n: usize, inflight: usize) -> anyhow::Result<()> {
    let (_tmp, data) = data_dir(common)?;
    let d = BenchDaemon::start(&data, common).await?;
    let cs = callers(&d.url, common.callers).await?;
    // Warm every connection and code path once, so that the growth below is the
    // reads' own.
    for (i, c) in cs.iter().enumerate() {
        if let Ok(s) = c.inspect(&format!("warm-{i}")).await {
            bail!("session warm-{i} exists: {s:?}");
        }
    }
    let (rss_base, _) = settled_rss(&d, 0, Duration::from_secs(1)).await;
    let probe = Probe::start(&d);
    let start = Instant::now();
    let Bounded {
        mut lat,
        failed,
        first_error,
    } = bounded(n, inflight, |s| {
        let caller = cs[s % cs.len()].clone();
        read_unknown(caller, s)
    })
    .await;
    let wall = start.elapsed();
    let measured = probe.finish(&d);
    let (rss_after, in_memory) = settled_rss(&d, 0, Duration::from_secs(2)).await;
    let registry = d
        .daemon
        .engine()
        .expect("a daemon on its own")
        .registry_sizes();
    close_callers(cs).await;
    let hwm = proc_status_kb("VmHWM");
    d.shutdown().await?;
    let kb = |v: Option<u64>| crate::measure::mb(v);
    let growth = match (rss_after, rss_base) {
        (Some(a), Some(b)) => format!("{:.1} MB", (a as f64 - b as f64) / 1024.0),
        _ => "–".into(),
    };
    let row = Row {
        scenario: "idle (unknown ids)".into(),
        sync: sync_label(&common.sync),
        work: format!(
            "{n} reads of unknown ids (inspect, list, events, stop, get); {} caller conns, {inflight} in flight",
            common.callers
        ),
        wall: Some(wall),
        throughput: format!("{:.0} reads/s", lat.len() as f64 / wall.as_secs_f64().max(1e-9)),
        latency: lat.summary(),
        cpu: Some(measured.cpu),
        rss_peak_kb: hwm,
        commits: Some(measured.commits),
        notes: format!(
            "RSS: {} before the reads, {} after ({growth} growth); {in_memory} sessions in memory, registry {} workers / {} functions; {}",
            kb(rss_base),
            kb(rss_after),
            registry.0,
            registry.1,
            measured.notes
        ),
    };
    row.print();
    fail_if_any(failed, first_error, "reads")
}

/// One session's one turn, submitted and waited for until it completed.
async fn run_done(caller: Arc<Caller>, s: usize) -> Result<(), String> {
    let t = caller
        .submit_simple(&format!("done-{s}"), ECHO, json!({"s": s}))
        .await
        .map_err(|e| e.to_string())?;
    let t = caller
        .wait_terminal(&t.turn_id, TURN_LIMIT)
        .await
        .map_err(|e| e.to_string())?;
    if t.status == TurnStatus::Completed {
        Ok(())
    } else {
        Err(format!("turn {} ended {:?}", t.turn_id, t.status))
    }
}

/// One read of an id that does not exist, by kind in turn; not found is success.
async fn read_unknown(caller: Arc<Caller>, s: usize) -> Result<(), String> {
    let sid = format!("ghost-{s}");
    let r = match s % 5 {
        0 => caller.inspect(&sid).await.map(|_| ()),
        1 => caller
            .list(turnd_client::turnd_proto::ListArgs {
                session_id: sid,
                status: None,
                limit: None,
                before_seq: None,
            })
            .await
            .map(|_| ()),
        2 => caller.events(&sid, Some(0), None).await.map(|_| ()),
        3 => caller.stop_session(&sid, "bench").await.map(|_| ()),
        _ => caller.get(&format!("t_{s:032x}")).await.map(|_| ()),
    };
    // Every one of them is not found (turn.list answers an empty page).
    match r {
        Ok(()) => Ok(()),
        Err(turnd_client::ClientError::Protocol(b))
            if b.code == turnd_client::turnd_proto::ErrorCode::NotFound =>
        {
            Ok(())
        }
        Err(e) => Err(e.to_string()),
    }
}

type SubmitResult = (Result<(), String>, Duration);

/// An error naming how many of `what` failed, and the first failure.
fn fail_if_any(failed: u64, first_error: Option<String>, what: &str) -> anyhow::Result<()> {
    if failed > 0 {
        bail!(
            "{failed} {what} failed (first: {})",
            first_error.unwrap_or_default()
        );
    }
    Ok(())
}

/// What [`bounded`] saw: the time of every task that succeeded, and the failures.
struct Bounded {
    lat: Latencies,
    failed: u64,
    first_error: Option<String>,
}

/// Runs `task(0..n)`, at most `inflight` at a time, timing each.
async fn bounded<F, Fut>(n: usize, inflight: usize, mut task: F) -> Bounded
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>> + Send + 'static,
{
    let mut out = Bounded {
        lat: Latencies::default(),
        failed: 0,
        first_error: None,
    };
    let mut set = JoinSet::new();
    for s in 0..n {
        while set.len() >= inflight.max(1) {
            collect_submit(&mut set, &mut out).await;
        }
        let fut = task(s);
        set.spawn(async move {
            let t0 = Instant::now();
            (fut.await, t0.elapsed())
        });
    }
    while !set.is_empty() {
        collect_submit(&mut set, &mut out).await;
    }
    out
}

async fn collect_submit(set: &mut JoinSet<SubmitResult>, out: &mut Bounded) {
    if let Some(joined) = set.join_next().await {
        match joined {
            Ok((Ok(()), took)) => out.lat.push(took),
            Ok((Err(e), _)) => {
                out.failed += 1;
                out.first_error.get_or_insert(e);
            }
            Err(e) => {
                out.failed += 1;
                out.first_error.get_or_insert(e.to_string());
            }
        }
    }
}

/// Settings of the `recovery` scenario.
#[derive(Debug, Clone, clap::Args)]
pub struct RecoveryArgs {
    /// Finished turns to retain.
    #[arg(long, default_value_t = 1_000_000)]
    pub turns: u64,
    #[arg(long, default_value_t = 1000)]
    pub sessions: usize,
    /// Extra turns left queued (no worker) so recovery has live turns to load.
    #[arg(long, default_value_t = 1000)]
    pub queued: usize,
    /// Keep the data directory here (`DIR/data`) instead of a temporary one.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Measure the existing `DIR/data` without filling it again.
    #[arg(long, requires = "dir")]
    pub reuse: bool,
    /// The turnd binary (default: `turnd` next to this executable, if present).
    #[arg(long)]
    pub turnd: Option<PathBuf>,
    /// Restarts measured of each kind.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// With --reuse: write this many more finished turns before the restarts (the
    /// first restart then replays what they wrote).
    #[arg(long, default_value_t = 0, requires = "reuse")]
    pub top_up: u64,
    /// Fill in a child process and end it with SIGKILL instead of a clean shutdown,
    /// so that the restarts recover from a crash.
    #[arg(long, conflicts_with = "reuse")]
    pub kill: bool,
}

/// Fill a data directory with `turns` finished turns (plus `queued` waiting ones)
/// through the daemon, then shut it down cleanly; with `a.kill`, print `filled` and
/// wait (for the SIGKILL of `fill_and_kill`) instead.
pub async fn fill(
    common: &Common,
    data: &Path,
    a: &RecoveryArgs,
    prefix: &str,
) -> anyhow::Result<()> {
    let d = BenchDaemon::start(data, common).await?;
    let workers = Workers::start(&d.url, common.workers, common.concurrency).await?;
    let cs = callers(&d.url, common.callers).await?;
    let start = Instant::now();
    let mut done = 0u64;
    let sessions = a.sessions.max(1);
    while done < a.turns {
        let left = a.turns - done;
        let per = (left.div_ceil(sessions as u64)).min(50) as usize;
        let k = if (per as u64) * (sessions as u64) > left {
            (left as usize).div_ceil(per).min(sessions)
        } else {
            sessions
        };
        let run = run_turns(&cs, prefix, k, per, 1, common.input_bytes).await?;
        if run.failed > 0 {
            bail!(
                "fill: {} turns failed (first: {})",
                run.failed,
                run.first_error.unwrap_or_default()
            );
        }
        done += run.completed;
        eprintln!(
            "fill: {done}/{} turns ({:.0}/s so far)",
            a.turns,
            done as f64 / start.elapsed().as_secs_f64().max(1e-9)
        );
    }
    for s in 0..a.queued {
        cs[s % cs.len()]
            .submit_simple(
                &format!("{prefix}-{}", s % sessions),
                NOBODY,
                json!({"q": s}),
            )
            .await
            .context("submit a queued turn")?;
    }
    eprintln!(
        "fill: {done} finished + {} queued turns in {:.1} s; {}",
        a.queued,
        start.elapsed().as_secs_f64(),
        crate::measure::fmt_commits(&d.commit_stats())
    );
    if a.kill {
        println!("filled");
        std::io::Write::flush(&mut std::io::stdout()).context("flush stdout")?;
        std::future::pending::<()>().await;
    }
    close_callers(cs).await;
    workers.stop().await?;
    d.shutdown().await?;
    Ok(())
}

/// In a fresh process: open the store and start the daemon on it (recovery), timing
/// each part. Prints one `reopen …` line that `recovery` parses.
pub async fn reopen(data: &Path) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let cfg = crate::daemon::bench_config(data, "always", turnd_store::DEFAULT_CHECKPOINT_MB);
    let listeners = turnd_server::Listeners::bind(&cfg).await?;
    let t_bind = t0.elapsed();
    let kv = turnd_server::open_store(&cfg)?;
    let t_open = t0.elapsed();
    let daemon = turnd_server::Daemon::start(cfg, listeners, kv).await?;
    let t_ready = t0.elapsed();
    let rss = proc_status_kb("VmRSS").unwrap_or(0);
    let stats = daemon.engine().expect("a daemon on its own").stats();
    println!(
        "reopen bind_ms={:.1} open_store_ms={:.1} engine_open_ms={:.1} total_ms={:.1} rss_kb={rss} queued={} completed={}",
        t_bind.as_secs_f64() * 1e3,
        (t_open - t_bind).as_secs_f64() * 1e3,
        (t_ready - t_open).as_secs_f64() * 1e3,
        t_ready.as_secs_f64() * 1e3,
        stats.turns.queued + stats.turns.running,
        stats.turns.completed,
    );
    daemon.shutdown().await
}

fn du_mb(dir: &Path) -> f64 {
    fn walk(p: &Path) -> u64 {
        let Ok(rd) = std::fs::read_dir(p) else {
            return 0;
        };
        rd.flatten()
            .map(|e| match e.metadata() {
                Ok(m) if m.is_dir() => walk(&e.path()),
                Ok(m) => m.len(),
                Err(_) => 0,
            })
            .sum()
    }
    walk(dir) as f64 / (1024.0 * 1024.0)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// `turnd serve` on free loopback ports over `data`, writing its addresses to
/// `ready`, logging warnings and errors to this process's stderr.
pub fn serve_command(turnd: &Path, data: &Path, ready: &Path) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(turnd);
    cmd.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ])
    .arg("--data-dir")
    .arg(data)
    .arg("--ready-file")
    .arg(ready)
    .env("TURND_LOG", "warn")
    .stdout(Stdio::null())
    .stderr(Stdio::inherit())
    .kill_on_drop(true);
    cmd
}

/// Time from spawning `turnd serve` on `data` to its ready file (written after
/// recovery, once it serves).
async fn time_binary(turnd: &Path, data: &Path) -> anyhow::Result<Duration> {
    let ready = data.with_extension("ready.json");
    if ready.exists() {
        std::fs::remove_file(&ready)?;
    }
    let t0 = Instant::now();
    let mut child = serve_command(turnd, data, &ready)
        .spawn()
        .with_context(|| format!("spawn {}", turnd.display()))?;
    let took = loop {
        if ready.exists() {
            break t0.elapsed();
        }
        if let Some(status) = child.try_wait()? {
            bail!("turnd exited before it was ready: {status}");
        }
        if t0.elapsed() > Duration::from_secs(600) {
            bail!("turnd not ready within 600 s");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    // turnd writes its ready file just before it installs its SIGTERM handler; a
    // SIGTERM in between ends it by the default action. Give it a moment.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let pid = child.id().context("child pid")?;
    // SAFETY: kill(2) with a pid of our own running child and a valid signal number.
    let rc = unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    if rc != 0 {
        bail!("failed to send SIGTERM to turnd");
    }
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .context("turnd did not exit within 60 s of SIGTERM")??;
    if !status.success() {
        bail!("turnd exited with {status}");
    }
    Ok(took)
}

/// Time a fresh `turnd-bench reopen` process: its own breakdown, and spawn → line.
async fn time_reopen(data: &Path) -> anyhow::Result<(Duration, String)> {
    let exe = std::env::current_exe().context("own executable")?;
    let t0 = Instant::now();
    let out = tokio::process::Command::new(exe)
        .arg("reopen")
        .arg("--data-dir")
        .arg(data)
        .stderr(Stdio::inherit())
        .output()
        .await
        .context("run turnd-bench reopen")?;
    let took = t0.elapsed();
    if !out.status.success() {
        bail!("reopen failed: {}", out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("reopen "))
        .context("no reopen line")?
        .to_string();
    Ok((took, line))
}

fn field(line: &str, key: &str) -> Option<f64> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}

/// `recovery --kill`: fill in a child process (`turnd-bench fill-and-hold`) and end it
/// with SIGKILL once it has filled, so that nothing is shut down or flushed beyond
/// what the daemon did while running.
async fn fill_and_kill(common: &Common, data: &Path, a: &RecoveryArgs) -> anyhow::Result<()> {
    use tokio::io::AsyncBufReadExt;
    let exe = std::env::current_exe().context("own executable")?;
    let mut child = tokio::process::Command::new(exe)
        .arg("fill-and-hold")
        .args(["--sync", &common.sync, "--log", &common.log])
        .args(["--workers", &common.workers.to_string()])
        .args(["--concurrency", &common.concurrency.to_string()])
        .args(["--callers", &common.callers.to_string()])
        .args(["--checkpoint-mb", &common.checkpoint_mb.to_string()])
        .args(["--cache-mb", &common.cache_mb.to_string()])
        .args(["--input-bytes", &common.input_bytes.to_string()])
        .arg("--data-dir")
        .arg(data)
        .args(["--turns", &a.turns.to_string()])
        .args(["--sessions", &a.sessions.to_string()])
        .args(["--queued", &a.queued.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("run turnd-bench fill-and-hold")?;
    let stdout = child.stdout.take().context("child stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    loop {
        match lines.next_line().await.context("read child stdout")? {
            Some(l) if l == "filled" => break,
            Some(_) => {}
            None => bail!(
                "fill-and-hold ended before it filled: {:?}",
                child.wait().await
            ),
        }
    }
    child.kill().await.context("SIGKILL the filling process")?;
    eprintln!("fill: the filling process was killed with SIGKILL");
    Ok(())
}

/// Where `recovery` measures: the data directory, and the temporary directory that
/// holds it (removed on drop) unless `--dir` was given.
pub struct Prepared {
    pub data: PathBuf,
    pub reused: bool,
    _tmp: Option<tempfile::TempDir>,
}

/// `recovery`, first part: fill a data directory (unless reused). The fill runs in
/// its own runtime, dropped before this returns, so every task holding the store is
/// gone and sled's lock released before the restarts are timed.
pub fn prepare_recovery(common: &Common, a: &RecoveryArgs) -> anyhow::Result<Prepared> {
    let (tmp, data) = match &a.dir {
        Some(d) => (None, d.join("data")),
        None => {
            let (t, d) = data_dir(common)?;
            (Some(t), d)
        }
    };
    let reused = a.reuse && data.join("db").exists();
    if reused {
        eprintln!("recovery: reusing {}", data.display());
        if a.top_up > 0 {
            // sled 0.34 writes its snapshot only while it opens a store, so the first
            // start after a run replays everything that run wrote: top up to see it.
            let top = RecoveryArgs {
                turns: a.top_up,
                queued: 0,
                ..a.clone()
            };
            let rt = crate::runtime()?;
            // Other sessions: the first fill's queued turns hold the locks of its own.
            rt.block_on(fill(common, &data, &top, "top"))?;
            drop(rt);
        }
    } else {
        if data.exists() {
            bail!(
                "{} exists; pass --reuse to measure it, or remove it",
                data.display()
            );
        }
        let rt = crate::runtime()?;
        if a.kill {
            rt.block_on(fill_and_kill(common, &data, a))?;
        } else {
            rt.block_on(fill(common, &data, a, "rec"))?;
        }
        drop(rt);
    }
    Ok(Prepared {
        data,
        reused,
        _tmp: tmp,
    })
}

/// `recovery`, second part: time restarts of the real binary and of an in-process
/// open in a fresh process.
#[allow(
    clippy::too_many_lines,
    reason = "a measured run reads as one script, from starting the daemon to the printed row"
)]
pub async fn recovery(common: &Common, a: &RecoveryArgs, p: &Prepared) -> anyhow::Result<()> {
    let data = p.data.clone();
    let reused = p.reused;
    let size = du_mb(&data);
    let mut bin_ms = Vec::new();
    let turnd = a.turnd.clone().or_else(|| {
        let sibling = std::env::current_exe().ok()?.parent()?.join("turnd");
        sibling.exists().then_some(sibling)
    });
    if let Some(turnd) = &turnd {
        for i in 0..a.repeat {
            let took = time_binary(turnd, &data).await?;
            eprintln!(
                "recovery: {} start → ready #{i}: {:.1} ms",
                turnd.display(),
                took.as_secs_f64() * 1e3
            );
            bin_ms.push(took.as_secs_f64() * 1e3);
        }
    } else {
        eprintln!("recovery: no turnd binary next to turnd-bench (build it: cargo build --release -p turnd) — only the in-process reopen is measured");
    }
    let mut reopen_ms = Vec::new();
    let mut engine_ms = Vec::new();
    let mut store_ms = Vec::new();
    let mut rss = Vec::new();
    let mut last = String::new();
    for i in 0..a.repeat {
        let (took, line) = time_reopen(&data).await?;
        eprintln!(
            "recovery: reopen #{i}: process {:.1} ms; {line}",
            took.as_secs_f64() * 1e3
        );
        reopen_ms.push(took.as_secs_f64() * 1e3);
        engine_ms.push(field(&line, "engine_open_ms").unwrap_or(f64::NAN));
        store_ms.push(field(&line, "open_store_ms").unwrap_or(f64::NAN));
        rss.push(field(&line, "rss_kb").unwrap_or(f64::NAN));
        last = line;
    }
    // sled 0.34 writes its snapshot only while it opens a store: the first start
    // after writes replays their log, later starts do not. Both are reported.
    let throughput = match bin_ms.split_first() {
        None => "binary not measured".to_string(),
        Some((first, rest)) => format!(
            "`turnd serve` start → ready: first start after the writes {first:.0} ms; next starts {}",
            rest.iter()
                .map(|v| format!("{v:.0} ms"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let row = Row {
        scenario: "recovery".into(),
        sync: match (reused, a.top_up > 0) {
            (true, false) => "restarts: always; store reused as it was".to_string(),
            (true, true) => format!(
                "restarts: always; top-up writes: {}",
                sync_label(&common.sync)
            ),
            (false, _) => format!(
                "restarts: always; fill: {}{}",
                sync_label(&common.sync),
                if a.kill { ", ended by SIGKILL" } else { "" }
            ),
        },
        work: format!(
            "{} finished turns in {} sessions + {} queued turns{}; data dir {:.0} MB",
            a.turns,
            a.sessions,
            a.queued,
            if reused && a.top_up > 0 {
                format!(" (reused store, {} more finished turns written just before the restarts)", a.top_up)
            } else {
                String::new()
            },
            size
        ),
        wall: None,
        throughput,
        latency: [None; 4],
        cpu: None,
        rss_peak_kb: None,
        commits: None,
        notes: format!(
            "fresh `turnd-bench reopen` process: spawn → recovered median {:.0} ms; inside it sled open median {:.0} ms, Engine::open (recovery) median {:.0} ms, RSS after recovery {:.0} MB; last: {last}; machine load average {} (2 cores, shared)",
            median(&mut reopen_ms),
            median(&mut store_ms),
            median(&mut engine_ms),
            median(&mut rss) / 1024.0,
            loadavg().map(|l| format!("{l:.1}")).unwrap_or_else(|| "?".into())
        ),
    };
    row.print();
    Ok(())
}
