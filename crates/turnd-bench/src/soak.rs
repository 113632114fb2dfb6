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

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};
use turnd_client::turnd_proto::{ErrorCode, TurnStatus};
use turnd_client::Caller;

use crate::daemon::{callers, close_callers, Workers, ECHO};
use crate::machine::{overlapping, MachineWatch, Seen, Span, ThreadSpan};
use crate::measure::{command_line, http_get, Latencies};
use crate::scenarios::serve_command;

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

/// The value of the sample `name` (a line `name value`) of a `/metrics` body, or
/// "n/a".
fn sample(body: &str, name: &str) -> String {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .map_or("n/a".into(), str::to_string)
}

/// `KEY=VALUE` of `--env`.
fn key_value(kv: &str) -> Result<(String, String), String> {
    kv.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("takes KEY=VALUE, not {kv:?}"))
}

/// Blocks allocated under `dir`, in bytes (a preallocated file counts in full).
pub fn disk_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => disk_bytes(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}

/// Blocks allocated in the data directory's three parts: the main sled database (and
/// everything else outside the two subdirectories), `windows/` and `log/`.
fn disk_parts(data: &Path) -> (u64, u64, u64) {
    let windows = disk_bytes(&data.join("windows"));
    let log = disk_bytes(&data.join("log"));
    let all = disk_bytes(data);
    (all.saturating_sub(windows + log), windows, log)
}

fn rss_kb(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

struct Daemon {
    child: tokio::process::Child,
    url: String,
    admin: String,
    pid: u32,
    /// The commit log syncs of 10 ms or more the daemon logged (see [`slow_sync`]).
    slow_syncs: Arc<Mutex<Vec<Span>>>,
    /// The task passing the daemon's log on; it ends when the daemon does.
    log_reader: Option<tokio::task::JoinHandle<()>>,
}

/// The slow sync a line of the daemon's log reports, if it is one (Unix seconds): the
/// committer logs every group commit whose write and `fdatasync` took 10 ms or more
/// (debug; warn from 100 ms) with `took_ms`, after the sync, under the line's time.
fn slow_sync(line: &str) -> Option<Span> {
    if !line.contains("turnd_store::logged:") {
        return None;
    }
    let at = line.split_whitespace().next()?;
    let at =
        time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339).ok()?;
    let end = at.unix_timestamp_nanos() as f64 / 1e9;
    let took_ms: u64 = line
        .split("took_ms=")
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(Span {
        start: end - took_ms as f64 / 1000.0,
        end,
        ms: took_ms as f64,
    })
}

/// Per-thread sums of the samples of `spans` that overlap `[start, end)`, the largest
/// first, at most three: `who ms, who ms`.
fn top_threads<'a>(
    spans: impl Iterator<Item = (&'a ThreadSpan, &'a str)>,
    start: f64,
    end: f64,
) -> Option<String> {
    let mut sums: Vec<(String, f64)> = Vec::new();
    for (t, what) in spans.filter(|(t, _)| t.span.overlaps(start, end)) {
        let who = if what.is_empty() {
            t.who.clone()
        } else {
            format!("{} in {what}", t.who)
        };
        match sums.iter_mut().find(|(w, _)| *w == who) {
            Some((_, ms)) => *ms += t.span.ms,
            None => sums.push((who, t.span.ms)),
        }
    }
    sums.sort_by(|a, b| b.1.total_cmp(&a.1));
    (!sums.is_empty()).then(|| {
        sums.iter()
            .take(3)
            .map(|(who, ms)| format!("{who} {ms:.0} ms"))
            .collect::<Vec<_>>()
            .join(", ")
    })
}

/// What held up `[start, start + len)` (Unix seconds), in words: the slow syncs that
/// overlap it and how much of it they cover, then the machine's late wake-ups, the
/// threads' waits for a core, their time on one and in uninterruptible sleep, and
/// steal in it (see [`crate::machine`]).
fn held_in(syncs: &[Span], machine: &Seen, start: f64, len: Duration) -> String {
    let end = start + len.as_secs_f64();
    let list = |over: &[Span]| {
        over.iter()
            .map(|s| format!("{:.0}", s.ms))
            .collect::<Vec<_>>()
            .join(" + ")
    };
    let mut words = Vec::new();
    match overlapping(syncs, start, end) {
        (over, _) if over.is_empty() => {
            words.push("no commit log sync of 10 ms or more in it".to_string());
        }
        (over, share) => words.push(format!(
            "commit log syncs of {} ms in it, covering {:.0} %",
            list(&over),
            100.0 * share
        )),
    }
    let (late, share) = overlapping(&machine.late_wakeups, start, end);
    if !late.is_empty() {
        words.push(format!(
            "a sleeping thread woke {} ms late, covering {:.0} %",
            list(&late),
            100.0 * share
        ));
    }
    // Per thread: its waits for a core, its time on one, and the samples in which it
    // waited in the kernel (with where), each summed over the samples that overlap.
    if let Some(top) = top_threads(machine.waits.iter().map(|t| (t, "")), start, end) {
        words.push(format!("waited for a core in the samples over it: {top}"));
    }
    if let Some(top) = top_threads(machine.ran.iter().map(|t| (t, "")), start, end) {
        words.push(format!("ran in the samples over it: {top}"));
    }
    let blocked = machine.blocked.iter().map(|b| (&b.at, b.wchan.as_str()));
    if let Some(top) = top_threads(blocked, start, end) {
        words.push(format!(
            "in uninterruptible sleep in the samples over it: {top}"
        ));
    }
    let (steal, _) = overlapping(&machine.steal, start, end);
    if !steal.is_empty() {
        words.push(format!(
            "steal of {:.0} ms in the samples over it",
            steal.iter().map(|s| s.ms).sum::<f64>()
        ));
    }
    words.join("; ")
}

/// A few store gauges and counters from the daemon's `/metrics` (empty: not exported
/// by this build, or not reachable).
async fn store_metrics(admin: &str) -> String {
    let Ok((_, body)) = http_get(admin, "/metrics").await else {
        return String::new();
    };
    let pick = [
        "turnd_storage_checkpoints_total",
        "turnd_storage_checkpoint_seconds_total",
        "turnd_storage_unapplied_keys",
        "turnd_storage_log_segments",
        "turnd_retention_deleted_turns_total",
        "turnd_retention_sweep_seconds_total",
        "turnd_retention_held_back_seconds_total",
        "turnd_storage_window_leftover_keys_total",
        "turnd_storage_apply_seconds_total",
        "turnd_storage_applied_keys_total",
        "turnd_storage_full_overlay_waits_total",
        "turnd_storage_full_overlay_wait_seconds_total",
        "turnd_storage_log_trims_total",
        "turnd_storage_log_recycled_segments_total",
        "turnd_storage_log_zeroed_segments_total",
        "turnd_storage_log_reserved_segments_total",
        "turnd_storage_log_bytes_total",
        "turnd_storage_windows_closed",
        "turnd_storage_window_reopens_total",
    ];
    body.lines()
        .filter(|l| pick.iter().any(|p| l.starts_with(p)))
        .map(|l| l.trim_start_matches("turnd_").to_string())
        .collect::<Vec<_>>()
        .join(" · ")
}

/// The commit log's group commits by how long their write and `fdatasync` took,
/// from the daemon's histogram (empty: not exported by this build).
fn sync_summary(body: &str) -> String {
    let name = "turnd_storage_sync_duration_seconds";
    // (upper bound, cumulative count) of each bucket.
    let buckets: Vec<(f64, f64)> = body
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix("_bucket{le=\"")?;
            let (bound, rest) = rest.split_once("\"}")?;
            let bound = if bound == "+Inf" {
                f64::INFINITY
            } else {
                bound.parse().ok()?
            };
            Some((bound, rest.trim().parse().ok()?))
        })
        .collect();
    let value = |suffix: &str| {
        body.lines().find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(suffix)?
                .trim()
                .parse::<f64>()
                .ok()
        })
    };
    let (Some(count), Some(sum)) = (value("_count"), value("_sum")) else {
        return String::new();
    };
    let over = |ms: f64| {
        buckets
            .iter()
            .find(|(b, _)| (*b - ms / 1000.0).abs() < 1e-9)
            .map_or("n/a".into(), |(_, below)| format!("{:.0}", count - below))
    };
    format!(
        "commit log syncs {count:.0} · mean {:.3} ms · over 10 ms {} · over 20 ms {} · over 50 ms {} · over 100 ms {}",
        sum * 1000.0 / count.max(1.0),
        over(10.0),
        over(20.0),
        over(50.0),
        over(100.0)
    )
}

async fn spawn(a: &SoakArgs, data: &Path) -> anyhow::Result<Daemon> {
    let ready = data.with_extension("ready.json");
    let mut cmd = serve_command(&a.turnd, data, &ready);
    if let Some(ms) = a.retention_ms {
        cmd.env("TURND_RETENTION__TERMINAL_MS", ms.to_string())
            .env("TURND_RETENTION__SWEEP_INTERVAL_MS", a.sweep_ms.to_string());
    }
    // The committer's lines about slow syncs, so that the longest intervals can be
    // set beside them; `--env TURND_LOG=...` replaces this.
    cmd.env("TURND_LOG", "warn,turnd_store::logged=debug");
    for (k, v) in &a.env {
        cmd.env(k, v);
    }
    cmd.stderr(std::process::Stdio::piped());
    let mut child = cmd
        .spawn()
        .with_context(|| format!("spawn {}", a.turnd.display()))?;
    // The daemon's log goes on to ours, line by line, and its slow syncs are kept.
    let slow_syncs: Arc<Mutex<Vec<Span>>> = Arc::default();
    let log_reader = child.stderr.take().map(|stderr| {
        let kept = slow_syncs.clone();
        tokio::spawn(async move {
            use tokio::io::AsyncBufReadExt;
            let mut lines = tokio::io::BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("{line}");
                if let (Some(s), Ok(mut kept)) = (slow_sync(&line), kept.lock()) {
                    kept.push(s);
                }
            }
        })
    });
    let started = Instant::now();
    let body = loop {
        if let Ok(b) = std::fs::read_to_string(&ready) {
            break b;
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!("no ready file from {} within 60 s", a.turnd.display());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let v: Value = serde_json::from_str(&body)?;
    Ok(Daemon {
        url: v["ws"].as_str().context("ws in ready file")?.to_string(),
        admin: v["admin"].as_str().unwrap_or_default().to_string(),
        pid: child.id().context("daemon pid")?,
        child,
        slow_syncs,
        log_reader,
    })
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

#[allow(
    clippy::too_many_lines,
    reason = "a measured run reads as one script, from starting the daemon to the printed row"
)]
pub async fn soak(a: SoakArgs) -> anyhow::Result<()> {
    let tmp = match &a.tmp {
        Some(t) => tempfile::tempdir_in(t)?,
        None => tempfile::tempdir()?,
    };
    let data = tmp.path().join("data");
    let mut d = spawn(&a, &data).await?;
    let workers = Workers::start(&d.url, a.workers, 512).await?;
    let cs = callers(&d.url, a.callers).await?;
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
    // Marks: disk and RSS every `mark_every` seconds.
    let mut marks = Vec::new();
    let mut next_mark = start + Duration::from_secs(a.mark_every.max(1));
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if Instant::now() >= next_mark {
            let done = done_count.load(Ordering::Relaxed);
            marks.push((
                start.elapsed().as_secs(),
                done,
                disk_parts(&data),
                rss_kb(d.pid),
                store_metrics(&d.admin).await,
            ));
            next_mark += Duration::from_secs(a.mark_every.max(1));
        }
    }
    let mut l = Log::default();
    while let Some(r) = tasks.join_next().await {
        let task = r.context("session task")??;
        l.completions.extend(task.completions);
        l.latencies.extend(task.latencies);
    }
    let wall = start.elapsed();
    let machine = machine.stop();
    let reads = match reads {
        Some(r) => Some(r.await.context("events reads")?),
        None => None,
    };
    let disk_end = disk_bytes(&data);
    let rss_end = rss_kb(d.pid);
    let idle = if a.idle_after > 0 {
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
        let mut gone = false;
        for _ in 0..2 {
            let t0 = Instant::now();
            let Some(c) = cs.first() else { break };
            match c.events("soak-0", Some(0), Some(100)).await {
                Ok(_) => reads.push(format!("{:.1}", t0.elapsed().as_secs_f64() * 1000.0)),
                Err(e) if e.code() == Some(ErrorCode::NotFound) => {
                    gone = true;
                    break;
                }
                Err(e) => return Err(e).context("read soak-0's first events after the idle wait"),
            }
        }
        Some(if gone {
            format!("{at_rest} · soak-0 is gone (its turns expired under retention)")
        } else {
            format!(
                "{at_rest} · then soak-0's first 100 events read in {} ms",
                reads.join(" and ")
            )
        })
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

    l.completions.sort();
    let n = l.completions.len();
    // Every interval with no completion, as (length, where it began after the start).
    let mut gaps: Vec<(Duration, Duration)> = Vec::with_capacity(n);
    let mut prev = start;
    for c in &l.completions {
        gaps.push((c.saturating_duration_since(prev), prev - start));
        prev = *c;
    }
    gaps.sort_unstable_by(|x, y| y.cmp(x));
    let longest = gaps.first().map_or(Duration::ZERO, |g| g.0);
    let mut per_sec = vec![0u64; a.seconds as usize + 2];
    for c in &l.completions {
        let s = c.saturating_duration_since(start).as_secs() as usize;
        if let Some(b) = per_sec.get_mut(s) {
            *b += 1;
        }
    }
    let full = &per_sec[..(a.seconds as usize).min(per_sec.len())];
    let ms = |v: Option<f64>| v.map_or("n/a".into(), |v| format!("{v:.2}"));
    println!("## soak: {}", command_line());
    println!(
        "binary {} · {} sessions closed loop · {} s · input filler {} B{} · retention {}",
        a.turnd.display(),
        a.sessions,
        a.seconds,
        a.input_bytes,
        if a.random_filler {
            " (random, returned reversed)"
        } else {
            ""
        },
        a.retention_ms.map_or("off".to_string(), |m| format!(
            "{m} ms, sweep {} ms",
            a.sweep_ms
        ))
    );
    println!(
        "turns {n} · {:.0} turns/s · per-second min {} / max {} · longest interval with no completion {:.0} ms",
        n as f64 / wall.as_secs_f64(),
        full.iter().min().copied().unwrap_or(0),
        full.iter().max().copied().unwrap_or(0),
        longest.as_secs_f64() * 1000.0
    );
    println!(
        "submit → terminal p50 {} ms · p99 {} ms · p99.9 {} ms · max {} ms",
        ms(l.latencies.pct_ms(0.50)),
        ms(l.latencies.pct_ms(0.99)),
        ms(l.latencies.pct_ms(0.999)),
        ms(l.latencies.pct_ms(1.0)),
    );
    println!(
        "disk at end {:.1} MB · {:.0} bytes per turn · daemon RSS {} MB",
        disk_end as f64 / 1e6,
        disk_end as f64 / n.max(1) as f64,
        rss_end.map_or("n/a".into(), |k| format!("{:.0}", k as f64 / 1024.0))
    );
    // Where the longest intervals were, also as Unix time (to set beside a system trace).
    let unix_secs = |at: Duration| {
        (start_wall + at)
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    };
    let slow_syncs = d.slow_syncs.lock().map(|s| s.clone()).unwrap_or_default();
    println!(
        "  longest intervals with no completion: {}",
        gaps.iter()
            .take(5)
            .map(|(len, at)| format!(
                "{:.0} ms at {:.3} s (unix {:.3}; {})",
                len.as_secs_f64() * 1000.0,
                at.as_secs_f64(),
                unix_secs(*at),
                held_in(&slow_syncs, &machine, unix_secs(*at), *len)
            ))
            .collect::<Vec<_>>()
            .join(" · ")
    );
    if !sync_histogram.is_empty() {
        println!("  {sync_histogram}");
    }
    if !machine.dirty_kb.is_empty() {
        let mut dirty = machine.dirty_kb.clone();
        dirty.sort_unstable();
        let at = |q: f64| crate::measure::nearest_rank(&dirty, q).unwrap_or(0) as f64 / 1024.0;
        println!(
            "  file pages not yet on disk, machine-wide (Dirty + Writeback), every 20 ms: median {:.1} MB · p99 {:.1} MB · max {:.1} MB",
            at(0.5),
            at(0.99),
            at(1.0)
        );
    }
    if let Some(idle) = &idle {
        println!("  {idle}");
    }
    if let Some((first, mut took)) = reads {
        println!(
            "session.events of soak-0 from seq 0, limit 100, every {} ms from second {}: {} calls · first {} ms · median {} ms · p90 {} ms · max {} ms",
            a.read_events_every_ms,
            a.seconds / 2,
            took.len(),
            ms(first),
            ms(took.pct_ms(0.50)),
            ms(took.pct_ms(0.90)),
            ms(took.pct_ms(1.0)),
        );
    }
    for (s, done, (main, windows, wal), rss, m) in marks {
        println!(
            "  mark {s:>4} s: {done:>8} turns · disk {:>8.1} MB (main {:.1} · windows {:.1} · log {:.1}) · RSS {} MB · {m}",
            (main + windows + wal) as f64 / 1e6,
            main as f64 / 1e6,
            windows as f64 / 1e6,
            wal as f64 / 1e6,
            rss.map_or("n/a".into(), |k| format!("{:.0}", k as f64 / 1024.0))
        );
    }
    println!(
        "  per second: {}",
        full.iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_random_filler_is_fresh_letters_and_digits_of_the_size_asked() {
        let a = filled(3, "xx", true, 64);
        let b = filled(3, "xx", true, 64);
        let pad = a["pad"].as_str().expect("pad");
        assert_eq!(pad.len(), 64);
        assert!(pad.bytes().all(|c| c.is_ascii_alphanumeric()), "{pad}");
        assert_ne!(a["pad"], b["pad"]);
        assert_eq!(a["reverse_pad"], true);
        assert_eq!(filled(3, "xx", false, 64), json!({"i": 3, "pad": "xx"}));
    }

    #[test]
    fn a_slow_sync_line_gives_its_span_and_other_lines_nothing() {
        let line = "2026-12-04T20:52:53.952907Z  WARN turnd_store::logged: the commit log's write and fdatasync took 120 ms; every commit waited for the disk took_ms=120 batches=93 bytes=184517";
        let s = slow_sync(line).expect("a slow sync");
        assert!((s.ms - 120.0).abs() < 1e-9, "{s:?}");
        assert!((s.end - 1_796_417_573.952_907).abs() < 1e-3, "{s:?}");
        assert!((s.end - s.start - 0.120).abs() < 1e-6, "{s:?}");
        let other = "2026-12-04T20:52:21.221972Z DEBUG turnd_store::logged: made the commit log's next segment ahead of need";
        assert!(slow_sync(other).is_none());
        assert!(slow_sync("no time turnd_store::logged: took_ms=5").is_none());
    }

    #[test]
    fn an_interval_lists_the_syncs_that_overlap_it_and_their_share() {
        let span = |start: f64, ms: f64| Span {
            start,
            end: start + ms / 1000.0,
            ms,
        };
        let syncs = [span(10.000, 95.0), span(10.095, 35.0), span(20.0, 50.0)];
        let quiet = Seen {
            late_wakeups: vec![],
            steal: vec![],
            dirty_kb: vec![],
            waits: vec![],
            ran: vec![],
            blocked: vec![],
        };
        assert_eq!(
            held_in(&syncs, &quiet, 10.0, Duration::from_millis(135)),
            "commit log syncs of 95 + 35 ms in it, covering 96 %"
        );
        assert_eq!(
            held_in(&syncs, &quiet, 15.0, Duration::from_millis(40)),
            "no commit log sync of 10 ms or more in it"
        );
        let threads = |samples: &[(&str, f64, f64)]| -> Vec<ThreadSpan> {
            samples
                .iter()
                .map(|&(who, start, ms)| ThreadSpan {
                    span: Span {
                        start,
                        end: start + 0.01,
                        ms,
                    },
                    who: who.into(),
                })
                .collect()
        };
        let held = Seen {
            late_wakeups: vec![span(15.005, 30.0)],
            steal: vec![span(14.99, 20.0), span(15.01, 10.0), span(16.0, 10.0)],
            dirty_kb: vec![],
            waits: threads(&[
                ("turnd/turnd-log", 15.0, 4.0),
                ("bench/tokio-runtime-w", 15.01, 9.0),
                ("turnd/turnd-log", 15.02, 8.0),
                ("turnd/turnd-apply", 15.2, 30.0),
            ]),
            ran: threads(&[
                ("turnd/tokio-rt-worker", 15.0, 10.0),
                ("turnd/tokio-rt-worker", 15.01, 10.0),
                ("turnd/turnd-store-app", 15.02, 4.0),
                ("turnd/tokio-rt-worker", 15.3, 10.0),
            ]),
            blocked: threads(&[
                ("turnd/turnd-log-write", 15.0, 10.0),
                ("turnd/turnd-log-write", 15.01, 10.0),
                ("turnd/turnd-store-app", 15.02, 10.0),
            ])
            .into_iter()
            .zip([
                "jbd2_log_wait_commit",
                "jbd2_log_wait_commit",
                "folio_wait_bit",
            ])
            .map(|(at, wchan)| crate::machine::Blocked {
                at,
                wchan: wchan.into(),
            })
            .collect(),
        };
        assert_eq!(
            held_in(&syncs, &held, 15.0, Duration::from_millis(40)),
            "no commit log sync of 10 ms or more in it; a sleeping thread woke 30 ms late, \
             covering 75 %; waited for a core in the samples over it: turnd/turnd-log 12 ms, \
             bench/tokio-runtime-w 9 ms; ran in the samples over it: turnd/tokio-rt-worker \
             20 ms, turnd/turnd-store-app 4 ms; in uninterruptible sleep in the samples over \
             it: turnd/turnd-log-write in jbd2_log_wait_commit 20 ms, turnd/turnd-store-app \
             in folio_wait_bit 10 ms; steal of 30 ms in the samples over it"
        );
    }
}
