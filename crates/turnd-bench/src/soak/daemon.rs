//! The daemon under soak: the real binary started on the data directory with the
//! run's settings, its log read for slow syncs, and what the run reads of it (disk,
//! RSS, `/metrics`).

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::Value;

use super::SoakArgs;
use crate::machine::Span;
use crate::measure::http_get;
use crate::scenarios::serve_command;

/// The value of the sample `name` (a line `name value`) of a `/metrics` body, or
/// "n/a".
pub(super) fn sample(body: &str, name: &str) -> String {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .map_or("n/a".into(), str::to_string)
}

/// Blocks allocated under `dir`, in bytes (a preallocated file counts in full).
pub(super) fn disk_bytes(dir: &Path) -> u64 {
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
pub(super) fn disk_parts(data: &Path) -> (u64, u64, u64) {
    let windows = disk_bytes(&data.join("windows"));
    let log = disk_bytes(&data.join("log"));
    let all = disk_bytes(data);
    (all.saturating_sub(windows + log), windows, log)
}

/// The number after `key` in the `/proc/PID/<file>` of `pid` (a unit after it, as
/// `kB`, is left out).
fn proc_field(pid: u32, file: &str, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/{file}")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Bytes the process has had written to the disk (`write_bytes` of `/proc/PID/io`:
/// the page-cache pages it dirtied, which their writeback sends to the disk whole).
pub(super) fn written_bytes(pid: u32) -> Option<u64> {
    proc_field(pid, "io", "write_bytes:")
}

pub(super) fn rss_kb(pid: u32) -> Option<u64> {
    proc_field(pid, "status", "VmRSS:")
}

pub(super) struct Daemon {
    pub(super) child: tokio::process::Child,
    pub(super) url: String,
    pub(super) admin: String,
    pub(super) pid: u32,
    /// The commit log syncs of 10 ms or more the daemon logged (see [`slow_sync`]).
    pub(super) slow_syncs: Arc<Mutex<Vec<Span>>>,
    /// The task passing the daemon's log on; it ends when the daemon does.
    pub(super) log_reader: Option<tokio::task::JoinHandle<()>>,
}

/// The slow sync a line of the daemon's log reports, if it is one (Unix seconds): the
/// committer logs every group commit whose write and `fdatasync` took 10 ms or more
/// (debug; warn from 100 ms) with `took_ms`, after the sync, under the line's time.
pub(super) fn slow_sync(line: &str) -> Option<Span> {
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

/// A few store gauges and counters from the daemon's `/metrics` (empty: not exported
/// by this build, or not reachable).
pub(super) async fn store_metrics(admin: &str) -> String {
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
pub(super) fn sync_summary(body: &str) -> String {
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

pub(super) async fn spawn(a: &SoakArgs, data: &Path) -> anyhow::Result<Daemon> {
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
