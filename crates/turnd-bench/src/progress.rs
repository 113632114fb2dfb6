//! `progress`: what streamed progress costs. The real `turnd` binary runs as a child
//! process, so that its CPU time (from `/proc/PID/stat`) is the daemon's alone; an
//! SDK worker and SDK watchers run in this process. K sessions each run one turn
//! that lasts `--secs`: with progress, its step sends `--fps` progress frames a
//! second to a watch of its session that asked for progress; without, it sleeps as
//! long and the watch asks for none. Each frame carries the time it was sent, so its
//! watcher measures the worker → daemon → watcher latency on loopback (one clock:
//! both ends are this process).

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use clap::Args;
use serde_json::{json, Value};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use turnd_client::turnd_proto::{EventKind, Outcome, WatchArgs};
use turnd_client::{Caller, FunctionSpec, InvocationCtx, WatchItem, Worker, WorkerOptions};

use crate::measure::Latencies;
use crate::scenarios::serve_command;

const STREAM: &str = "bench.stream";

#[derive(Args, Debug, Clone)]
pub struct ProgressArgs {
    /// The `turnd` binary to run (a release build).
    #[arg(long, default_value = "target/release/turnd")]
    pub turnd: PathBuf,
    /// Sessions streaming at once, one turn each.
    #[arg(long, default_value_t = 100)]
    pub sessions: usize,
    /// Progress frames a second per session.
    #[arg(long, default_value_t = 50)]
    pub fps: u64,
    /// How long each turn streams.
    #[arg(long, default_value_t = 10)]
    pub secs: u64,
    /// Bytes of text in each frame's data.
    #[arg(long, default_value_t = 64)]
    pub frame_bytes: usize,
}

fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The streaming step: `frames` frames `every_ms` apart (or, without `progress`, a
/// sleep as long), then complete.
async fn stream(ctx: InvocationCtx) -> Outcome {
    let input = ctx.invoke.input.clone();
    let frames = input["frames"].as_u64().unwrap_or(0);
    let every = Duration::from_millis(input["every_ms"].as_u64().unwrap_or(20));
    let text = input["text"].clone();
    if input["progress"] != json!(true) {
        tokio::time::sleep(every * u32::try_from(frames).unwrap_or(0)).await;
        return Outcome::Complete(json!(frames));
    }
    let mut tick = tokio::time::interval(every);
    for i in 0..frames {
        tick.tick().await;
        let data = json!({"t": now_micros(), "i": i, "text": text});
        if ctx.progress(data).await.is_err() {
            return Outcome::Cancelled(Default::default());
        }
    }
    Outcome::Complete(json!(frames))
}

/// User + system CPU time of process `pid` so far.
fn proc_cpu(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = stat.rsplit_once(')').context("stat format")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 =
        f.get(11).context("utime")?.parse::<u64>()? + f.get(12).context("stime")?.parse::<u64>()?;
    // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(Duration::from_micros(ticks * 1_000_000 / hz))
}

/// Start `turnd serve` on `data`; its URL and pid.
async fn spawn(turnd: &Path, data: &Path) -> anyhow::Result<(tokio::process::Child, String)> {
    let ready = data.with_extension("ready.json");
    let child = serve_command(turnd, data, &ready)
        .env("TURND_SERVER__MAX_WATCHES_PER_CONNECTION", "1000")
        .spawn()
        .with_context(|| format!("spawn {}", turnd.display()))?;
    let started = Instant::now();
    let body = loop {
        if let Ok(b) = std::fs::read_to_string(&ready) {
            break b;
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!("no ready file from {} within 60 s", turnd.display());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let v: Value = serde_json::from_str(&body)?;
    Ok((
        child,
        v["ws"].as_str().context("ws in ready file")?.to_string(),
    ))
}

/// One watched turn of `session`: watch, submit, then read until it completed; the
/// latencies of the progress frames it got, and how many were dropped.
async fn watched_turn(
    c: std::sync::Arc<Caller>,
    session: String,
    input: Value,
) -> anyhow::Result<(Latencies, u64)> {
    let progress = input["progress"] == json!(true);
    let args = WatchArgs {
        session_id: Some(session.clone()),
        turn_id: None,
        after: None,
        progress,
    };
    let mut w = c.watch(args).await?;
    c.submit_simple(&session, STREAM, input).await?;
    let (mut lat, mut dropped) = (Latencies::default(), 0);
    while let Some(item) = w.next_item().await {
        match item {
            WatchItem::Progress(p) => {
                let sent = p.data["t"].as_u64().unwrap_or(0);
                lat.push(Duration::from_micros(now_micros().saturating_sub(sent)));
            }
            WatchItem::ProgressDropped { count, .. } => dropped += count,
            WatchItem::Event(e) if e.kind == EventKind::Completed => return Ok((lat, dropped)),
            WatchItem::Event(e) if e.kind == EventKind::Failed => bail!("turn failed: {e:?}"),
            WatchItem::Event(_) => {}
        }
    }
    bail!("the watch of {session} ended before its turn")
}

/// One run, with or without progress: the daemon's CPU time, the wall time, the
/// frames' latencies and the frames dropped.
async fn run(
    a: &ProgressArgs,
    with_progress: bool,
) -> anyhow::Result<(Duration, Duration, Latencies, u64)> {
    let tmp = tempfile::Builder::new().prefix("turnd-bench-").tempdir()?;
    let (mut child, url) = spawn(&a.turnd, &tmp.path().join("data")).await?;
    let pid = child.id().context("daemon pid")?;
    let shutdown = CancellationToken::new();
    let concurrency = u32::try_from(a.sessions).unwrap_or(u32::MAX);
    let worker = Worker::new(WorkerOptions::new(&url, "bench-stream"))
        .function(
            FunctionSpec::new(STREAM)
                .concurrency(concurrency)
                .timeout_ms(a.secs * 1000 + 60_000),
            stream,
        )
        .spawn(shutdown.clone());
    worker.connected_within(Duration::from_secs(10)).await?;
    let callers = crate::daemon::callers(&url, a.sessions.div_ceil(50)).await?;
    let input = json!({
        "frames": a.fps * a.secs,
        "every_ms": 1000 / a.fps.max(1),
        "progress": with_progress,
        "text": "x".repeat(a.frame_bytes),
    });
    let (cpu0, t0) = (proc_cpu(pid)?, Instant::now());
    let mut tasks = JoinSet::new();
    for i in 0..a.sessions {
        let c = callers[i % callers.len()].clone();
        tasks.spawn(watched_turn(c, format!("p-{i}"), input.clone()));
    }
    let (mut lat, mut dropped) = (Latencies::default(), 0);
    while let Some(r) = tasks.join_next().await {
        let (l, d) = r??;
        lat.extend(l);
        dropped += d;
    }
    let (cpu, wall) = (proc_cpu(pid)?.saturating_sub(cpu0), t0.elapsed());
    shutdown.cancel();
    worker.join().await?;
    crate::daemon::close_callers(callers).await;
    child.kill().await?;
    Ok((cpu, wall, lat, dropped))
}

/// `progress`: the same turns without and with progress; one row each.
pub async fn progress(a: &ProgressArgs) -> anyhow::Result<()> {
    println!("| progress | sessions × fps × s | frames got (dropped) | latency p50 / p99 / max ms | daemon CPU s | daemon CPU % of a core |");
    println!("|---|---|---|---|---|---|");
    for with_progress in [false, true] {
        let (cpu, wall, mut lat, dropped) = run(a, with_progress).await?;
        let [p50, _, p99, max] = lat.summary();
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
        println!(
            "| {} | {} × {} × {} | {} ({dropped}) | {} / {} / {} | {:.2} | {:.1} |",
            if with_progress { "on" } else { "off" },
            a.sessions,
            a.fps,
            a.secs,
            lat.len(),
            ms(p50),
            ms(p99),
            ms(max),
            cpu.as_secs_f64(),
            cpu.as_secs_f64() * 100.0 / wall.as_secs_f64().max(1e-9),
        );
    }
    Ok(())
}
