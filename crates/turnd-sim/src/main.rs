//! `turnd-sim`: run the simulator of the whole daemon (`docs/simulator.md`).
//!
//! `turnd-sim --seed N` replays one seed and, when an invariant breaks, prints the
//! trace up to it; `turnd-sim --seeds A..B` explores a range on a thread per core,
//! one seed at a time each, and prints every seed's line. The exit status is 1 when
//! any seed broke an invariant.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use clap::Parser;
use turnd_sim::{run_seed, Config, Report};

#[derive(Parser)]
#[command(
    name = "turnd-sim",
    about = "Deterministic simulation of turnd under seeded faults"
)]
struct Args {
    /// Replay one seed, printing its trace if an invariant breaks.
    #[arg(long, conflicts_with = "seeds")]
    seed: Option<u64>,
    /// Explore seeds A..B (B excluded) in parallel.
    #[arg(long, value_parser = parse_range)]
    seeds: Option<Range<u64>>,
    /// Threads for --seeds (default: the machine's cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Turns each caller submits.
    #[arg(long, default_value_t = 80)]
    turns: u64,
    /// Lines of the trace printed before the broken invariant (0: all).
    #[arg(long, default_value_t = 300)]
    trace_lines: usize,
    /// Stop at the first seed that breaks an invariant.
    #[arg(long)]
    fail_fast: bool,
}

fn parse_range(s: &str) -> Result<Range<u64>, String> {
    let (a, b) = s.split_once("..").ok_or("expected A..B")?;
    let a: u64 = a.parse().map_err(|e| format!("{a}: {e}"))?;
    let b: u64 = b.parse().map_err(|e| format!("{b}: {e}"))?;
    if b <= a {
        return Err(format!("empty range {a}..{b}"));
    }
    Ok(a..b)
}

fn line(r: &Report, wall_ms: u128) -> String {
    let c = &r.counts;
    format!(
        "seed {} {}: {} turns, {} simulated ms in {wall_ms} ms, {} steps, {} frames, crashes {} daemon + {} in a group, {} disk failures, {} worker crashes, digest {:016x}",
        r.seed,
        if r.violation.is_some() { "FAILED" } else { "ok" },
        r.turns,
        r.sim_ms,
        c.steps,
        c.frames,
        c.daemon_crashes,
        c.group_crashes,
        c.disk_failures,
        c.worker_crashes,
        r.digest,
    )
}

fn replay(seed: u64, mut cfg: Config, lines: usize) -> bool {
    cfg.trace = true;
    let t = Instant::now();
    let r = run_seed(seed, &cfg);
    let wall = t.elapsed().as_millis();
    if let Some(v) = &r.violation {
        let from = if lines == 0 {
            0
        } else {
            r.trace.len().saturating_sub(lines)
        };
        for l in &r.trace[from..] {
            println!("{l}");
        }
        println!("seed {seed}: broken invariant: {v}");
    }
    println!("{}", line(&r, wall));
    r.violation.is_none()
}

fn explore(seeds: Range<u64>, cfg: Config, threads: usize, fail_fast: bool) -> bool {
    let next = AtomicU64::new(seeds.start);
    let failed = Mutex::new(Vec::new());
    let turns = AtomicU64::new(0);
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| loop {
                if fail_fast && failed.lock().is_ok_and(|f| !f.is_empty()) {
                    return;
                }
                let seed = next.fetch_add(1, Ordering::Relaxed);
                if seed >= seeds.end {
                    return;
                }
                let started = Instant::now();
                let r = run_seed(seed, &cfg);
                turns.fetch_add(r.turns, Ordering::Relaxed);
                println!("{}", line(&r, started.elapsed().as_millis()));
                if let Some(v) = r.violation {
                    println!("seed {seed}: broken invariant: {v}");
                    if let Ok(mut f) = failed.lock() {
                        f.push(seed);
                    }
                }
            });
        }
    });
    let secs = t.elapsed().as_secs_f64();
    let turns = turns.load(Ordering::Relaxed);
    let failed = failed.into_inner().unwrap_or_default();
    println!(
        "{} seeds, {turns} turns in {secs:.1} s on {threads} thread(s): {:.0} turns/s; failed seeds: {failed:?}",
        seeds.end - seeds.start,
        turns as f64 / secs.max(1e-9),
    );
    failed.is_empty()
}

fn main() {
    let args = Args::parse();
    let cfg = Config {
        turns_per_caller: args.turns,
        ..Config::default()
    };
    let ok = match (args.seed, args.seeds) {
        (Some(seed), _) => replay(seed, cfg, args.trace_lines),
        (None, Some(range)) => {
            let threads = args
                .threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
            explore(range, cfg, threads, args.fail_fast)
        }
        (None, None) => {
            eprintln!("turnd-sim: give --seed N or --seeds A..B");
            false
        }
    };
    std::process::exit(if ok { 0 } else { 1 });
}
