//! The restart scenarios: `fill` writes a store of finished and queued turns (and
//! may be killed once it has), `reopen` opens one in a fresh process and times each
//! part, and `recovery` times restarts of the real binary and of `reopen`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::json;
use tokio::time::Instant;

use super::{data_dir, run_turns, sync_label};
use crate::daemon::{callers, close_callers, BenchDaemon, Workers, NOBODY};
use crate::measure::{loadavg, proc_status_kb, Row};
use crate::Common;

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
        .args(["--apply-delay-ms", &common.apply_delay_ms.to_string()])
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
pub async fn recovery(common: &Common, a: &RecoveryArgs, p: &Prepared) -> anyhow::Result<()> {
    let size = du_mb(&p.data);
    let bin_ms = time_binary_starts(a, &p.data).await?;
    let reopens = time_reopens(&p.data, a.repeat).await?;
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
        sync: recovery_sync(common, a, p.reused),
        work: recovery_work(a, p.reused, size),
        wall: None,
        throughput,
        latency: [None; 4],
        cpu: None,
        rss_peak_kb: None,
        commits: None,
        notes: reopens.describe(),
    };
    row.print();
    Ok(())
}

/// Starts of the `turnd` binary (`--turnd`, or the one next to this binary) on the
/// prepared store, each to ready, in ms; none when there is no binary. sled 0.34
/// writes its snapshot only while it opens a store: the first start after writes
/// replays their log, later starts do not. Both are reported.
async fn time_binary_starts(a: &RecoveryArgs, data: &Path) -> anyhow::Result<Vec<f64>> {
    let turnd = a.turnd.clone().or_else(|| {
        let sibling = std::env::current_exe().ok()?.parent()?.join("turnd");
        sibling.exists().then_some(sibling)
    });
    let mut bin_ms = Vec::new();
    let Some(turnd) = &turnd else {
        eprintln!("recovery: no turnd binary next to turnd-bench (build it: cargo build --release -p turnd) — only the in-process reopen is measured");
        return Ok(bin_ms);
    };
    for i in 0..a.repeat {
        let took = time_binary(turnd, data).await?;
        eprintln!(
            "recovery: {} start → ready #{i}: {:.1} ms",
            turnd.display(),
            took.as_secs_f64() * 1e3
        );
        bin_ms.push(took.as_secs_f64() * 1e3);
    }
    Ok(bin_ms)
}

/// What the `turnd-bench reopen` processes measured, one entry per reopen.
#[derive(Default)]
struct Reopens {
    process_ms: Vec<f64>,
    engine_ms: Vec<f64>,
    store_ms: Vec<f64>,
    rss_kb: Vec<f64>,
    last: String,
}

impl Reopens {
    /// The row's notes: the medians, the last line, the machine's load.
    fn describe(mut self) -> String {
        format!(
            "fresh `turnd-bench reopen` process: spawn → recovered median {:.0} ms; inside it sled open median {:.0} ms, Engine::open (recovery) median {:.0} ms, RSS after recovery {:.0} MB; last: {}; machine load average {} (2 cores, shared)",
            median(&mut self.process_ms),
            median(&mut self.store_ms),
            median(&mut self.engine_ms),
            median(&mut self.rss_kb) / 1024.0,
            self.last,
            loadavg().map(|l| format!("{l:.1}")).unwrap_or_else(|| "?".into())
        )
    }
}

/// `repeat` fresh `turnd-bench reopen` processes on the prepared store.
async fn time_reopens(data: &Path, repeat: usize) -> anyhow::Result<Reopens> {
    let mut r = Reopens::default();
    for i in 0..repeat {
        let (took, line) = time_reopen(data).await?;
        eprintln!(
            "recovery: reopen #{i}: process {:.1} ms; {line}",
            took.as_secs_f64() * 1e3
        );
        r.process_ms.push(took.as_secs_f64() * 1e3);
        r.engine_ms
            .push(field(&line, "engine_open_ms").unwrap_or(f64::NAN));
        r.store_ms
            .push(field(&line, "open_store_ms").unwrap_or(f64::NAN));
        r.rss_kb.push(field(&line, "rss_kb").unwrap_or(f64::NAN));
        r.last = line;
    }
    Ok(r)
}

/// The row's sync column: how the store was written before the restarts.
fn recovery_sync(common: &Common, a: &RecoveryArgs, reused: bool) -> String {
    match (reused, a.top_up > 0) {
        (true, false) => "restarts: always; store reused as it was".to_string(),
        (true, true) => format!("restarts: always; top-up writes: {}", sync_label(common)),
        (false, _) => format!(
            "restarts: always; fill: {}{}",
            sync_label(common),
            if a.kill { ", ended by SIGKILL" } else { "" }
        ),
    }
}

/// The row's work column: what the store holds and its size.
fn recovery_work(a: &RecoveryArgs, reused: bool, size_mb: f64) -> String {
    format!(
        "{} finished turns in {} sessions + {} queued turns{}; data dir {:.0} MB",
        a.turns,
        a.sessions,
        a.queued,
        if reused && a.top_up > 0 {
            format!(
                " (reused store, {} more finished turns written just before the restarts)",
                a.top_up
            )
        } else {
            String::new()
        },
        size_mb
    )
}
