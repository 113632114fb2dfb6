//! The benchmark scenarios. Each starts the real daemon in this process,
//! drives it over WebSocket through the SDK and prints one markdown row.
//!
//! Latency is measured from just before `turn.submit` is sent to the answer of the
//! `turn.wait` that saw the turn terminal; both requests go over the same caller
//! connection. Throughput is finished turns over the wall time from the first submit
//! to the last terminal answer.
//!
//! This file holds what every scenario of turns shares (the [`Probe`] of a phase,
//! [`run_turns`], the printed row) and the two throughput scenarios, `sessions`
//! and `sequential`; `idle` holds the memory scenarios, `recovery` the restart
//! scenarios and their fill.

mod idle;
mod recovery;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::json;
use tokio::task::JoinSet;
use tokio::time::Instant;
use turnd_client::turnd_proto::TurnStatus;
use turnd_client::Caller;

use crate::daemon::{callers, close_callers, BenchDaemon, KvSnapshot, Workers, ECHO};
use crate::measure::{
    commit_delta, describe_threads, loadavg, proc_status_kb, threads_cpu, Cpu, Latencies, Row,
};
use crate::Common;

pub use idle::{idle, idle_finished, idle_unknown};
pub use recovery::{fill, prepare_recovery, recovery, reopen, serve_command, RecoveryArgs};

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

/// Longest [`settled`] waits for the store.
const SETTLE_LIMIT: Duration = Duration::from_secs(30);

/// Wait until the store has written everything committed to sled (the overlay
/// empty), at most [`SETTLE_LIMIT`]: the writes a load leaves waiting their delay
/// (`storage.apply_delay_ms`) are part of what it cost, and a phase that begins
/// with them still waiting would count another's. Returns how long it waited, or
/// None when the overlay was still not empty.
pub async fn settled(d: &BenchDaemon) -> Option<Duration> {
    let t0 = Instant::now();
    while d.overlay_len() > 0 {
        if t0.elapsed() >= SETTLE_LIMIT {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Some(t0.elapsed())
}

impl Probe {
    /// Start measuring once the store has settled ([`settled`]).
    pub async fn start_settled(d: &BenchDaemon) -> Probe {
        if settled(d).await.is_none() {
            tracing::warn!("the store did not settle before the measured phase");
        }
        Probe::start(d)
    }

    /// Finish once the store has settled: the CPU, the keys written to sled and the
    /// threads' times include the writes the phase left waiting (the wall time for
    /// throughput is the caller's).
    pub async fn finish_settled(self, d: &BenchDaemon) -> Measured {
        let waited = settled(d).await;
        let mut m = self.finish(d);
        m.notes = match waited {
            Some(w) => format!(
                "{}; measured until the store settled, {} ms after the last turn",
                m.notes,
                w.as_millis()
            ),
            None => format!(
                "{}; the store had NOT settled {} s after the last turn",
                m.notes,
                SETTLE_LIMIT.as_secs()
            ),
        };
        m
    }

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

/// The sync column: the store's durability as the run had it.
fn sync_label(common: &Common) -> String {
    match (common.store.as_str(), common.sync.as_str()) {
        ("memory", _) => "**in memory (NOT durable)**".into(),
        (_, "never") => "**never (NOT durable)**".into(),
        (_, other) => other.into(),
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
        sync: sync_label(common),
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
    let probe = Probe::start_settled(&d).await;
    let run = run_turns(&cs, "bench", k, m, steps, common.input_bytes).await?;
    let measured = probe.finish_settled(&d).await;
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
    let measured = probe.finish_settled(&d).await;
    close_callers(cs).await;
    workers.stop().await?;
    d.shutdown().await?;
    let work = format!(
        "1 session × {n} sequential turns (submit, wait, next); {warmup} warm-up turns not counted"
    );
    report_turns("sequential", common, work, run, measured, 1)
}
