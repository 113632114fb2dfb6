//! What the benchmarks measure about themselves: latency percentiles, process CPU time
//! (`getrusage`), resident memory (`/proc/self/status`), the store's group-commit
//! counters, and the markdown row every scenario prints.
//!
//! The daemon runs in this process, so CPU and memory are those of the daemon *plus*
//! the workers and callers driving it; every row says so.

use std::collections::BTreeMap;
use std::time::Duration;

use turnd_store::CommitStats;

/// The `p`-quantile (nearest rank) of `sorted`, which is in ascending order; `None`
/// when it is empty.
pub fn nearest_rank(sorted: &[u64], p: f64) -> Option<u64> {
    let n = sorted.len();
    if n == 0 {
        return None;
    }
    let rank = ((p * n as f64).ceil() as usize).clamp(1, n);
    Some(sorted[rank - 1])
}

/// Latencies in microseconds.
#[derive(Debug, Default, Clone)]
pub struct Latencies {
    micros: Vec<u64>,
}

impl Latencies {
    pub fn push(&mut self, d: Duration) {
        self.micros
            .push(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    }

    pub fn extend(&mut self, other: Latencies) {
        self.micros.extend(other.micros);
    }

    pub fn len(&self) -> usize {
        self.micros.len()
    }

    /// The `p`-quantile (nearest rank) in milliseconds; `None` when empty.
    pub fn pct_ms(&mut self, p: f64) -> Option<f64> {
        self.micros.sort_unstable();
        nearest_rank(&self.micros, p).map(|us| us as f64 / 1000.0)
    }

    /// p50 / p90 / p99 / max in milliseconds.
    pub fn summary(&mut self) -> [Option<f64>; 4] {
        [
            self.pct_ms(0.50),
            self.pct_ms(0.90),
            self.pct_ms(0.99),
            self.pct_ms(1.0),
        ]
    }
}

/// CPU time used by this process so far.
#[derive(Debug, Clone, Copy, Default)]
pub struct Cpu {
    pub user: Duration,
    pub sys: Duration,
}

impl Cpu {
    pub fn now() -> Cpu {
        // SAFETY: getrusage only writes into the struct we pass; a zeroed `rusage` is
        // a valid value of that plain C struct.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: RUSAGE_SELF with a valid pointer to a live `rusage`.
        let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
        if rc != 0 {
            return Cpu::default();
        }
        let tv = |t: libc::timeval| {
            Duration::from_secs(t.tv_sec.max(0) as u64)
                + Duration::from_micros(t.tv_usec.max(0) as u64)
        };
        Cpu {
            user: tv(ru.ru_utime),
            sys: tv(ru.ru_stime),
        }
    }

    pub fn since(self, earlier: Cpu) -> Cpu {
        Cpu {
            user: self.user.saturating_sub(earlier.user),
            sys: self.sys.saturating_sub(earlier.sys),
        }
    }

    pub fn total(self) -> Duration {
        self.user + self.sys
    }
}

/// CPU time of this process's live threads, by thread name with any trailing
/// number removed (`sled-io-3` → `sled-io`), from `/proc/self/task/*/stat`.
pub fn threads_cpu() -> BTreeMap<String, Duration> {
    let mut out = BTreeMap::new();
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let ticks = if ticks > 0 { ticks as u64 } else { 100 };
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close]
            .trim_end_matches(|c: char| c.is_ascii_digit())
            .trim_end_matches('-')
            .to_string();
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // Fields 14 and 15 of stat(5); the slice starts at field 3.
        let parse = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
        if let (Some(u), Some(s)) = (parse(11), parse(12)) {
            let d = Duration::from_millis((u + s) * 1000 / ticks);
            *out.entry(name).or_insert(Duration::ZERO) += d;
        }
    }
    out
}

/// Per-thread-group CPU between two [`threads_cpu`] snapshots, largest first, with
/// the CPU of threads that ended in between (from the process total).
pub fn describe_threads(
    before: &BTreeMap<String, Duration>,
    after: &BTreeMap<String, Duration>,
    total: Duration,
) -> String {
    let mut rows: Vec<(String, Duration)> = after
        .iter()
        .map(|(k, v)| {
            let b = before.get(k).copied().unwrap_or(Duration::ZERO);
            (k.clone(), v.saturating_sub(b))
        })
        .filter(|(_, d)| !d.is_zero())
        .collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.1));
    let sum: Duration = rows.iter().map(|r| r.1).sum();
    let mut parts: Vec<String> = rows
        .iter()
        .map(|(k, d)| format!("{k} {:.2} s", d.as_secs_f64()))
        .collect();
    let gone = total.saturating_sub(sum);
    if gone >= Duration::from_millis(10) {
        parts.push(format!("threads that exited {:.2} s", gone.as_secs_f64()));
    }
    format!("CPU by thread: {}", parts.join(", "))
}

/// The 1-minute load average (`/proc/loadavg`): how busy the shared machine was.
pub fn loadavg() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A field of `/proc/self/status` in kB (`VmRSS`, `VmHWM`).
pub fn proc_status_kb(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        rest.trim().trim_end_matches("kB").trim().parse().ok()
    })
}

/// jemalloc's view of the process's heap: bytes the program holds (`allocated`), in
/// pages it uses (`active`), pages resident (`resident`, also the allocator's own
/// metadata and dirty pages not yet returned), and mapped or retained address space.
/// Tells memory the program still holds from pages the allocator keeps.
pub fn alloc_stats() -> String {
    use tikv_jemalloc_ctl::{epoch, stats};
    let read = || -> Result<String, tikv_jemalloc_ctl::Error> {
        epoch::advance()?;
        let m = |b: usize| b as f64 / (1024.0 * 1024.0);
        Ok(format!(
            "jemalloc allocated {:.0} MB, active {:.0} MB, resident {:.0} MB, metadata {:.0} MB, mapped {:.0} MB, retained {:.0} MB",
            m(stats::allocated::read()?),
            m(stats::active::read()?),
            m(stats::resident::read()?),
            m(stats::metadata::read()?),
            m(stats::mapped::read()?),
            m(stats::retained::read()?),
        ))
    };
    read().unwrap_or_else(|e| format!("jemalloc stats unavailable: {e}"))
}

pub fn mb(kb: Option<u64>) -> String {
    match kb {
        Some(kb) => format!("{:.0} MB", kb as f64 / 1024.0),
        None => "n/a".into(),
    }
}

/// Commit counters accumulated between two snapshots.
pub fn commit_delta(after: &CommitStats, before: &CommitStats) -> CommitStats {
    CommitStats {
        syncs: after.syncs.saturating_sub(before.syncs),
        batches: after.batches.saturating_sub(before.batches),
        commit_micros: after.commit_micros.saturating_sub(before.commit_micros),
        sync_micros: after.sync_micros.saturating_sub(before.sync_micros),
        sync_buckets: std::array::from_fn(|i| {
            after.sync_buckets[i].saturating_sub(before.sync_buckets[i])
        }),
        max_group: after.max_group,
        checkpoints: after.checkpoints.saturating_sub(before.checkpoints),
        checkpoint_micros: after
            .checkpoint_micros
            .saturating_sub(before.checkpoint_micros),
        max_checkpoint_micros: after.max_checkpoint_micros,
        log_bytes: after.log_bytes.saturating_sub(before.log_bytes),
        applies: after.applies.saturating_sub(before.applies),
        applied_keys: after.applied_keys.saturating_sub(before.applied_keys),
        apply_micros: after.apply_micros.saturating_sub(before.apply_micros),
        dropped_deletes: after.dropped_deletes.saturating_sub(before.dropped_deletes),
        merged_event_values: after
            .merged_event_values
            .saturating_sub(before.merged_event_values),
        carried_records: after.carried_records.saturating_sub(before.carried_records),
        room_waits: after.room_waits.saturating_sub(before.room_waits),
        room_wait_micros: after
            .room_wait_micros
            .saturating_sub(before.room_wait_micros),
        overlay_keys: after.overlay_keys,
        overlay_bytes: after.overlay_bytes,
        log_segments: after.log_segments,
        log_trims: after.log_trims.saturating_sub(before.log_trims),
        log_recycled: after.log_recycled.saturating_sub(before.log_recycled),
        log_zeroed: after.log_zeroed.saturating_sub(before.log_zeroed),
        log_reserved: after.log_reserved.saturating_sub(before.log_reserved),
        window_leftovers: after
            .window_leftovers
            .saturating_sub(before.window_leftovers),
        windows_closed: after.windows_closed,
        window_reopens: after.window_reopens.saturating_sub(before.window_reopens),
    }
}

pub fn fmt_commits(c: &CommitStats) -> String {
    if c.syncs == 0 {
        return "0 commits".into();
    }
    let mut s = format!(
        "{} group commits / {} batches (avg {:.1} per group, max {}) / per group {:.0} µs framing, writing and fdatasync of the commit log + {:.0} µs putting its writes in the overlay",
        c.syncs,
        c.batches,
        c.batches as f64 / c.syncs as f64,
        c.max_group,
        c.sync_micros as f64 / c.syncs as f64,
        c.commit_micros.saturating_sub(c.sync_micros) as f64 / c.syncs as f64
    );
    if c.applies > 0 {
        s.push_str(&format!(
            " / {} applies to sled, {} keys ({} deletes dropped, {} event values merged, {} live records carried), {:.0} ms in all",
            c.applies,
            c.applied_keys,
            c.dropped_deletes,
            c.merged_event_values,
            c.carried_records,
            c.apply_micros as f64 / 1000.0
        ));
    }
    if c.room_waits > 0 {
        s.push_str(&format!(
            " / {} groups waited {:.0} ms in all for sled to take keys (full overlay)",
            c.room_waits,
            c.room_wait_micros as f64 / 1000.0
        ));
    }
    if c.checkpoints > 0 {
        s.push_str(&format!(
            " / {} checkpoints, {:.0} ms in all, longest {:.0} ms",
            c.checkpoints,
            c.checkpoint_micros as f64 / 1000.0,
            c.max_checkpoint_micros as f64 / 1000.0
        ));
    }
    s
}

/// This process's command line, for the report.
pub fn command_line() -> String {
    let mut args = std::env::args();
    let exe = args.next().unwrap_or_else(|| "turnd-bench".into());
    // Show the binary as it is usually run from the workspace root.
    let exe = match exe.find("target/") {
        Some(i) => exe[i..].to_string(),
        None => exe,
    };
    std::iter::once(exe)
        .chain(args.map(|a| if a.contains(' ') { format!("'{a}'") } else { a }))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One markdown row of the result table.
#[derive(Debug, Default)]
pub struct Row {
    pub scenario: String,
    pub sync: String,
    pub work: String,
    pub wall: Option<Duration>,
    pub throughput: String,
    pub latency: [Option<f64>; 4],
    pub cpu: Option<Cpu>,
    pub rss_peak_kb: Option<u64>,
    pub commits: Option<CommitStats>,
    pub notes: String,
}

pub const HEADER: &str = "| scenario | command | sync | work | wall | throughput | p50 ms | p90 ms | p99 ms | max ms | CPU user+sys (bench process) | peak RSS (VmHWM, bench process) | group commits | notes |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|";

impl Row {
    pub fn print(&self) {
        let ms = |v: Option<f64>| match v {
            Some(v) if v < 10.0 => format!("{v:.2}"),
            Some(v) => format!("{v:.1}"),
            None => "–".into(),
        };
        let wall = self
            .wall
            .map(|w| format!("{:.2} s", w.as_secs_f64()))
            .unwrap_or_else(|| "–".into());
        let cpu = match (self.cpu, self.wall) {
            (Some(c), Some(w)) if w.as_secs_f64() > 0.0 => format!(
                "{:.2}+{:.2} s ({:.2} cores)",
                c.user.as_secs_f64(),
                c.sys.as_secs_f64(),
                c.total().as_secs_f64() / w.as_secs_f64()
            ),
            (Some(c), _) => format!("{:.2}+{:.2} s", c.user.as_secs_f64(), c.sys.as_secs_f64()),
            (None, _) => "–".into(),
        };
        let commits = self
            .commits
            .as_ref()
            .map(fmt_commits)
            .unwrap_or_else(|| "–".into());
        println!();
        println!("{HEADER}");
        println!(
            "| {} | `{}` | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            self.scenario,
            command_line(),
            self.sync,
            self.work,
            wall,
            self.throughput,
            ms(self.latency[0]),
            ms(self.latency[1]),
            ms(self.latency[2]),
            ms(self.latency[3]),
            cpu,
            mb(self.rss_peak_kb),
            commits,
            self.notes
        );
    }
}

/// GET `path` on an admin listener (`http://ADDR`): the status and the body.
pub async fn http_get(admin: &str, path: &str) -> anyhow::Result<(u16, String)> {
    use anyhow::Context;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = admin.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no status line")?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let mut l = Latencies::default();
        for i in 1..=100u64 {
            l.push(Duration::from_micros(i * 1000));
        }
        assert_eq!(l.pct_ms(0.5), Some(50.0));
        assert_eq!(l.pct_ms(0.99), Some(99.0));
        assert_eq!(l.pct_ms(1.0), Some(100.0));
        assert_eq!(Latencies::default().pct_ms(0.5), None);
    }

    #[test]
    fn reads_own_memory_and_cpu() {
        assert!(proc_status_kb("VmRSS").unwrap_or(0) > 0);
        assert!(proc_status_kb("VmHWM").unwrap_or(0) > 0);
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = std::hint::black_box(x.wrapping_add(i));
        }
        assert!(Cpu::now().total() > Duration::ZERO, "{x}");
        assert!(threads_cpu().values().any(|d| !d.is_zero()));
    }
}
