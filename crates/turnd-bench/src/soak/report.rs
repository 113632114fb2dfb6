//! What a soak prints: the settings, throughput and the longest intervals with no
//! completion, each set beside what held it up (slow syncs, the machine's threads),
//! latencies, disk and memory, the marks and each second's completions.

use std::time::{Duration, Instant};

use super::{End, Run, SoakArgs};
use crate::machine::{overlapping, Seen, Span, ThreadSpan};
use crate::measure::command_line;

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
pub(super) fn held_in(syncs: &[Span], machine: &Seen, start: f64, len: Duration) -> String {
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

/// Every interval with no completion, as (length, where it began after the start),
/// longest first.
fn gaps(completions: &[Instant], start: Instant) -> Vec<(Duration, Duration)> {
    let mut gaps: Vec<(Duration, Duration)> = Vec::with_capacity(completions.len());
    let mut prev = start;
    for c in completions {
        gaps.push((c.saturating_duration_since(prev), prev - start));
        prev = *c;
    }
    gaps.sort_unstable_by(|x, y| y.cmp(x));
    gaps
}

/// Print the run: the settings, throughput and stalls, latencies, disk and memory,
/// then the details (where the longest intervals were, the marks, each second).
pub(super) fn report(a: &SoakArgs, mut run: Run, end: &End) {
    let l = &mut run.log;
    l.completions.sort();
    let n = l.completions.len();
    let gaps = gaps(&l.completions, run.start);
    let longest = gaps.first().map_or(Duration::ZERO, |g| g.0);
    let mut per_sec = vec![0u64; a.seconds as usize + 2];
    for c in &l.completions {
        let s = c.saturating_duration_since(run.start).as_secs() as usize;
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
        n as f64 / run.wall.as_secs_f64(),
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
        "disk at end {:.1} MB · {:.0} bytes per turn · written to the disk {} · daemon RSS {} MB",
        end.disk as f64 / 1e6,
        end.disk as f64 / n.max(1) as f64,
        end.written.map_or("n/a".into(), |w| format!(
            "{:.0} MB, {:.1} kB per turn",
            w as f64 / 1e6,
            w as f64 / 1e3 / n.max(1) as f64
        )),
        end.rss_kb
            .map_or("n/a".into(), |k| format!("{:.0}", k as f64 / 1024.0))
    );
    report_details(a, &mut run, end, &gaps, full);
}

/// The report's indented lines: where the longest intervals were (also as Unix time,
/// to set beside a system trace), the sync times, the machine's dirty pages, the
/// daemon at rest, the reads of events, the marks, and each second's completions.
fn report_details(
    a: &SoakArgs,
    run: &mut Run,
    end: &End,
    gaps: &[(Duration, Duration)],
    full: &[u64],
) {
    let ms = |v: Option<f64>| v.map_or("n/a".into(), |v| format!("{v:.2}"));
    let unix_secs = |at: Duration| {
        (run.start_wall + at)
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    };
    println!(
        "  longest intervals with no completion: {}",
        gaps.iter()
            .take(5)
            .map(|(len, at)| format!(
                "{:.0} ms at {:.3} s (unix {:.3}; {})",
                len.as_secs_f64() * 1000.0,
                at.as_secs_f64(),
                unix_secs(*at),
                held_in(&end.slow_syncs, &run.machine, unix_secs(*at), *len)
            ))
            .collect::<Vec<_>>()
            .join(" · ")
    );
    if !end.sync_histogram.is_empty() {
        println!("  {}", end.sync_histogram);
    }
    if !run.machine.dirty_kb.is_empty() {
        let mut dirty = run.machine.dirty_kb.clone();
        dirty.sort_unstable();
        let at = |q: f64| crate::measure::nearest_rank(&dirty, q).unwrap_or(0) as f64 / 1024.0;
        println!(
            "  file pages not yet on disk, machine-wide (Dirty + Writeback), every 20 ms: median {:.1} MB · p99 {:.1} MB · max {:.1} MB",
            at(0.5),
            at(0.99),
            at(1.0)
        );
    }
    if let Some(idle) = &end.idle {
        println!("  {idle}");
    }
    if let Some((first, took)) = &mut run.reads {
        println!(
            "session.events of soak-0 from seq 0, limit 100, every {} ms from second {}: {} calls · first {} ms · median {} ms · p90 {} ms · max {} ms",
            a.read_events_every_ms,
            a.seconds / 2,
            took.len(),
            ms(*first),
            ms(took.pct_ms(0.50)),
            ms(took.pct_ms(0.90)),
            ms(took.pct_ms(1.0)),
        );
    }
    for (s, done, (main, windows, wal), rss, m) in &run.marks {
        println!(
            "  mark {s:>4} s: {done:>8} turns · disk {:>8.1} MB (main {:.1} · windows {:.1} · log {:.1}) · RSS {} MB · {m}",
            (main + windows + wal) as f64 / 1e6,
            *main as f64 / 1e6,
            *windows as f64 / 1e6,
            *wal as f64 / 1e6,
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
}
