//! `soak`: a sustained closed-loop load on a real `turnd` binary.
//!
//! The binary named by `--turnd` (so that two builds run the very same load) is
//! started on a fresh data directory with `storage.sync = always`; `--sessions`
//! sessions each submit one one-step echo turn, wait until it is terminal, and submit
//! the next, for `--seconds`. Echo workers and callers run in this process. Printed:
//! completions per second, the longest interval in which no turn completed (a stall of
//! every commit shows here) and the five longest with where they began (seconds into
//! the run, and Unix time to set beside a system trace) with what held each up (the
//! commit log syncs of 10 ms or more the daemon logged in it, the machine's own
//! stalls, and each thread's waits for a core, time on one and waits in the kernel,
//! see [`crate::machine`]), submit → terminal p50/p99/p99.9/max, bytes of disk per
//! turn (blocks allocated in the data directory at each mark and at the end), the
//! daemon's RSS, and the machine's file pages written but not yet on the disk (what
//! a sync or the kernel's write-back will send at once). `--retention-ms` sets `retention.terminal_ms` (with a sweep every
//! `--sweep-ms`), for a run whose rounds of equal work should leave the data
//! directory flat.
//!
//! This file holds the run (the closed loop, the marks, the daemon at rest);
//! `daemon` starts the binary and reads what it reports, `report` prints the run.

mod daemon;
mod report;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};
use turnd_client::turnd_proto::{ErrorCode, TurnStatus};
use turnd_client::Caller;

use crate::daemon::{callers, close_callers, Workers, ECHO};
use crate::machine::{MachineWatch, Seen, Span};
use crate::measure::{http_get, Latencies};
use daemon::{
    disk_bytes, disk_parts, rss_kb, sample, spawn, store_metrics, sync_summary, written_bytes,
    Daemon,
};
use report::report;

/// What one soak run is.
#[derive(clap::Args)]
pub struct SoakArgs {
    /// The turnd binary to run (so that two builds run the same load).
    #[arg(long)]
    pub turnd: PathBuf,
    #[arg(long, default_value_t = 100)]
    pub sessions: usize,
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// Filler in every input (returned as the output), in bytes.
    #[arg(long, default_value_t = 0)]
    pub input_bytes: usize,
    /// Make each turn's filler random letters and digits, drawn afresh for every turn,
    /// and have the worker return it reversed: neither compresses, and the output
    /// repeats no run of the input (without it the filler is `x` repeated, returned
    /// unchanged, which compresses to almost nothing).
    #[arg(long)]
    pub random_filler: bool,
    /// retention.terminal_ms of the daemon (default: the daemon's own).
    #[arg(long)]
    pub retention_ms: Option<u64>,
    /// retention.sweep_interval_ms, with --retention-ms.
    #[arg(long, default_value_t = 1000)]
    pub sweep_ms: u64,
    /// Seconds between marks of disk use and RSS.
    #[arg(long, default_value_t = 10)]
    pub mark_every: u64,
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    #[arg(long, default_value_t = 8)]
    pub callers: usize,
    /// Directory for the temporary data directory (default: the system temp dir).
    #[arg(long)]
    pub tmp: Option<PathBuf>,
    /// More environment for the daemon, KEY=VALUE (e.g. TURND_STORAGE__CHECKPOINT_MB=0).
    #[arg(long = "env", value_parser = key_value)]
    pub env: Vec<(String, String)>,
    /// From the middle of the run on, read the first 100 events of session `soak-0`
    /// from `seq` 0 (`session.events`) on a connection of its own every this many
    /// milliseconds, and print how long the calls took (0: no such reads).
    #[arg(long, default_value_t = 0)]
    pub read_events_every_ms: u64,
    /// After the load, leave the daemon idle (connections open) this many seconds and
    /// print its RSS, threads and open files then: what it keeps once work stops.
    #[arg(long, default_value_t = 0)]
    pub idle_after: u64,
}

/// `--read-events-every-ms`: the calls' durations, each timed from send to answer.
async fn read_events(
    url: String,
    every: Duration,
    from: Instant,
    end: Instant,
) -> (Option<f64>, Latencies) {
    let mut first = None;
    let mut took = Latencies::default();
    tokio::time::sleep_until(from.into()).await;
    let Ok(c) = Caller::connect(&url, None).await else {
        return (first, took);
    };
    while Instant::now() + every < end {
        let t0 = Instant::now();
        if c.events("soak-0", Some(0), Some(100)).await.is_err() {
            break;
        }
        let d = t0.elapsed();
        first.get_or_insert(d.as_secs_f64() * 1000.0);
        took.push(d);
        tokio::time::sleep(every).await;
    }
    (first, took)
}

/// `KEY=VALUE` of `--env`.
fn key_value(kv: &str) -> Result<(String, String), String> {
    kv.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("takes KEY=VALUE, not {kv:?}"))
}

/// The input of the `i`th turn of a session: `pad` as its filler, or with
/// `random`, `bytes` random letters and digits that the echo worker returns reversed
/// (see [`crate::daemon::echo`]).
fn filled(i: u64, pad: &str, random: bool, bytes: usize) -> Value {
    if random {
        let fresh: String = std::iter::repeat_with(fastrand::alphanumeric)
            .take(bytes)
            .collect();
        json!({"i": i, "pad": fresh, "reverse_pad": true})
    } else {
        json!({"i": i, "pad": pad})
    }
}

/// What one session's task saw. Each task keeps its own, merged at the end: one log
/// behind a lock shared by every session would copy all completions at each doubling
/// of its `Vec` (32 – 128 MB past 2^21 turns) with the lock held, and every session
/// would wait, which the soak would count as the daemon's intervals with no
/// completion.
#[derive(Default)]
struct Log {
    completions: Vec<Instant>,
    latencies: Latencies,
}

/// Disk, RSS and the store's metrics at one mark: seconds into the run, turns done,
/// (main, windows, log) bytes, the daemon's RSS and the metrics' summary.
type Mark = (u64, u64, (u64, u64, u64), Option<u64>, String);

/// What the closed loop saw, from the first submit to the last completion.
struct Run {
    start: Instant,
    start_wall: std::time::SystemTime,
    wall: Duration,
    log: Log,
    marks: Vec<Mark>,
    machine: Seen,
    reads: Option<(Option<f64>, Latencies)>,
}

/// What was read of the daemon once the load ended.
struct End {
    disk: u64,
    /// Bytes the daemon had written to the disk by the end of the load.
    written: Option<u64>,
    rss_kb: Option<u64>,
    /// `--idle-after`'s line.
    idle: Option<String>,
    /// The commit log's sync times (`/metrics`), or "".
    sync_histogram: String,
    /// The syncs of 10 ms or more the daemon logged.
    slow_syncs: Vec<Span>,
}

pub async fn soak(a: SoakArgs) -> anyhow::Result<()> {
    let tmp = match &a.tmp {
        Some(t) => tempfile::tempdir_in(t)?,
        None => tempfile::tempdir()?,
    };
    let data = tmp.path().join("data");
    let mut d = spawn(&a, &data).await?;
    let workers = Workers::start(&d.url, a.workers, 512).await?;
    let cs = callers(&d.url, a.callers).await?;
    let run = closed_loop(&a, &d, &cs, &data).await?;
    let disk_end = disk_bytes(&data);
    let rss_end = rss_kb(d.pid);
    let written = written_bytes(d.pid);
    let idle = if a.idle_after > 0 {
        Some(at_rest(&a, &d, &cs, &data).await?)
    } else {
        None
    };
    let sync_histogram = match http_get(&d.admin, "/metrics").await {
        Ok((_, body)) => sync_summary(&body),
        Err(_) => String::new(),
    };
    close_callers(cs).await;
    workers.stop().await?;
    d.child.kill().await.context("stop the daemon")?;
    // Every line the daemon wrote before it stopped, read (its log ends with it).
    if let Some(reader) = d.log_reader.take() {
        if tokio::time::timeout(Duration::from_secs(5), reader)
            .await
            .is_err()
        {
            eprintln!("the daemon's log was still open 5 s after it was stopped");
        }
    }
    let end = End {
        disk: disk_end,
        written,
        rss_kb: rss_end,
        idle,
        sync_histogram,
        slow_syncs: d.slow_syncs.lock().map(|s| s.clone()).unwrap_or_default(),
    };
    report(&a, run, &end);
    Ok(())
}

/// Run the sessions' closed loop for `--seconds`, with the marks and the reads of
/// events beside it, and the machine watched throughout.
async fn closed_loop(
    a: &SoakArgs,
    d: &Daemon,
    cs: &[Arc<Caller>],
    data: &Path,
) -> anyhow::Result<Run> {
    let done_count = Arc::new(AtomicU64::new(0));
    let pad: Arc<str> = "x".repeat(a.input_bytes).into();
    let (random_filler, input_bytes) = (a.random_filler, a.input_bytes);
    let machine = MachineWatch::start(vec![
        ("turnd".into(), d.pid),
        ("bench".into(), std::process::id()),
    ]);
    let start = Instant::now();
    let start_wall = std::time::SystemTime::now();
    let end = start + Duration::from_secs(a.seconds);
    let mut tasks = tokio::task::JoinSet::new();
    for s in 0..a.sessions {
        let c = cs[s % cs.len()].clone();
        let done_count = done_count.clone();
        let pad = pad.clone();
        tasks.spawn(async move {
            let sid = format!("soak-{s}");
            let mut log = Log::default();
            let mut i = 0u64;
            while Instant::now() < end {
                let t0 = Instant::now();
                let t = c
                    .submit_simple(&sid, ECHO, filled(i, &pad, random_filler, input_bytes))
                    .await
                    .context("submit")?;
                let done = c
                    .wait_terminal(&t.turn_id, Duration::from_secs(120))
                    .await
                    .context("wait")?;
                if done.status != TurnStatus::Completed {
                    bail!("turn {} ended {}", done.turn_id, done.status.as_str());
                }
                let now = Instant::now();
                log.completions.push(now);
                log.latencies.push(now - t0);
                done_count.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            Ok::<Log, anyhow::Error>(log)
        });
    }
    let reads = (a.read_events_every_ms > 0).then(|| {
        tokio::spawn(read_events(
            d.url.clone(),
            Duration::from_millis(a.read_events_every_ms),
            start + Duration::from_secs(a.seconds / 2),
            end,
        ))
    });
    let marks = take_marks(a, d, data, start, end, &done_count).await;
    let mut log = Log::default();
    while let Some(r) = tasks.join_next().await {
        let task = r.context("session task")??;
        log.completions.extend(task.completions);
        log.latencies.extend(task.latencies);
    }
    let wall = start.elapsed();
    let machine = machine.stop();
    let reads = match reads {
        Some(r) => Some(r.await.context("events reads")?),
        None => None,
    };
    Ok(Run {
        start,
        start_wall,
        wall,
        log,
        marks,
        machine,
        reads,
    })
}

/// Marks: disk and RSS every `mark_every` seconds until `end`.
async fn take_marks(
    a: &SoakArgs,
    d: &Daemon,
    data: &Path,
    start: Instant,
    end: Instant,
    done_count: &AtomicU64,
) -> Vec<Mark> {
    let mut marks = Vec::new();
    let mut next_mark = start + Duration::from_secs(a.mark_every.max(1));
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if Instant::now() >= next_mark {
            let done = done_count.load(Ordering::Relaxed);
            marks.push((
                start.elapsed().as_secs(),
                done,
                disk_parts(data),
                rss_kb(d.pid),
                store_metrics(&d.admin).await,
            ));
            next_mark += Duration::from_secs(a.mark_every.max(1));
        }
    }
    marks
}

/// `--idle-after`: the daemon at rest after the load, then a read that reaches the
/// oldest window.
async fn at_rest(
    a: &SoakArgs,
    d: &Daemon,
    cs: &[Arc<Caller>],
    data: &Path,
) -> anyhow::Result<String> {
    tokio::time::sleep(Duration::from_secs(a.idle_after)).await;
    let count = |what: &str| {
        std::fs::read_dir(format!("/proc/{}/{what}", d.pid)).map_or(0, Iterator::count)
    };
    let at_rest = format!(
        "after {} s idle: daemon RSS {} MB · {} threads · {} open files · {} windows ({} closed)",
        a.idle_after,
        rss_kb(d.pid).map_or("n/a".into(), |k| format!("{:.0}", k as f64 / 1024.0)),
        count("task"),
        count("fd"),
        std::fs::read_dir(data.join("windows")).map_or(0, Iterator::count),
        match http_get(&d.admin, "/metrics").await {
            Ok((_, body)) => sample(&body, "turnd_storage_windows_closed"),
            Err(_) => "n/a".into(),
        },
    );
    // Then a read that reaches the oldest window (soak-0's first events), twice:
    // the first opens the windows it needs if they were closed. Under a retention
    // shorter than the wait, the session may be gone (`not_found`): said so.
    let mut reads = Vec::new();
    for _ in 0..2 {
        let t0 = Instant::now();
        let Some(c) = cs.first() else { break };
        match c.events("soak-0", Some(0), Some(100)).await {
            Ok(_) => reads.push(format!("{:.1}", t0.elapsed().as_secs_f64() * 1000.0)),
            Err(e) if e.code() == Some(ErrorCode::NotFound) => {
                return Ok(format!(
                    "{at_rest} · soak-0 is gone (its turns expired under retention)"
                ));
            }
            Err(e) => return Err(e).context("read soak-0's first events after the idle wait"),
        }
    }
    Ok(format!(
        "{at_rest} · then soak-0's first 100 events read in {} ms",
        reads.join(" and ")
    ))
}
