//! Durability: nothing acknowledged is lost to a power loss, on the real binary.
//!
//! The real `turnd` runs with the recorder of `turnd-faultfs` preloaded, which
//! journals every change the daemon makes under its data directory's parent (writes
//! with the bytes they replaced, size changes, names created, removed and renamed)
//! and every `fsync`/`fdatasync`. Load runs through it, recording every
//! acknowledgement with its time (`load.rs`): submits, stops, results answered
//! `applied`. At a cut the recorder kills the daemon (SIGKILL) between two recorded
//! calls. `turnd-powerloss` then makes, from the journal, the disk a power loss at a
//! point of the run may leave: everything a sync had made durable by then, and of the
//! rest (in each variant a real disk allows) nothing, a prefix of each file's and
//! each directory's changes, or pages of 4 KiB kept at random. The daemon restarts on
//! that disk and `check.rs` checks that everything acknowledged before the point is
//! there, that `store.check` is clean and that work goes on. A daemon that refuses to
//! start fails the test: it lost acknowledged work as surely as one that starts
//! without it.
//!
//! - `every_sync_point_of_a_scripted_run` records one short run that crosses the
//!   commit log's roll-over to a new segment (renaming a spare to it), the making and
//!   recycling of spare segments, sled's checkpoints, time windows made and dropped by
//!   retention, and checks the power losses just before chosen syncs (before every
//!   one with `POWERLOSS_SEEDS`), as ALICE and CrashMonkey enumerate the crash states
//!   of a recorded run. The same run then shows that the checks fail on two planted
//!   bugs, modeled by a disk that drops a flush: acknowledgements made without the
//!   commit log's `fdatasync`, and the spare's rename into a segment not synced.
//! - `the_first_acknowledged_writes_of_a_new_store_survive` checks the states after
//!   the first acknowledgements of a new store, without time windows or checkpoints,
//!   whose own syncs of the data directory would hide a missing one.
//! - `random_cuts_under_load` cuts the daemon at random moments under load, several
//!   times, each time restarting it (still recorded) on a random power loss of the
//!   last run, so that cuts also land in recoveries.
//!
//! Every random choice comes from a seed, printed; `TURND_SEED=N` replays the choices
//! of one (not the daemon's own timing, so a replay records a run like it, not the
//! same run). `POWERLOSS_KEEP=DIR` keeps every run's recording in DIR, from which
//! `turnd-powerloss state` makes any printed state again. `docs/powerloss.md` has
//! the model, the knobs and the results.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

#[path = "powerloss/check.rs"]
mod check;
#[path = "powerloss/life.rs"]
mod life;
#[path = "powerloss/load.rs"]
mod load;
#[path = "powerloss/scripted.rs"]
mod scripted;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use turnd_client::turnd_proto::Role;
use turnd_client::Caller;
use turnd_powerloss::journal::now_ns;
use turnd_powerloss::state::{digest, Dice, Variant};
use turnd_testkit::SplitMix64;

use check::Expect;
use life::{Dirs, BARE, TERMINAL_MS};
use load::{acks, Shape, Shared};

/// Seeds to explore: `POWERLOSS_SEEDS` (`A..B` or a list `A,B`), else one seed from
/// `TURND_SEED` or the clock. With `POWERLOSS_SEEDS`, every sync point is checked.
fn seeds() -> (Vec<u64>, bool) {
    if let Ok(s) = std::env::var("POWERLOSS_SEEDS") {
        let v: Vec<u64> = match s.split_once("..") {
            Some((a, b)) => match (a.trim().parse(), b.trim().parse()) {
                (Ok(a), Ok(b)) => (a..b).collect(),
                _ => Vec::new(),
            },
            None => s.split(',').filter_map(|x| x.trim().parse().ok()).collect(),
        };
        if !v.is_empty() {
            return (v, true);
        }
    }
    (vec![SplitMix64::seed_from_env()], false)
}

/// At most this many failed states are described; the others are counted.
const MAX_REPORTED: usize = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sync_point_of_a_scripted_run() -> anyhow::Result<()> {
    let (seeds, all) = seeds();
    let mut failed = Vec::new();
    for seed in seeds {
        println!("seed = {seed} (TURND_SEED={seed} replays the choices)");
        let mut s = scripted::run(seed).await?;
        let kinds = scripted::landmarks(&s.rec);
        for must in scripted::MUST_CROSS {
            ensure!(
                kinds.iter().any(|(k, _)| *k == must),
                "the scripted run (seed {seed}) never crossed {must}"
            );
        }
        failed.extend(scripted::explore(&mut s, seed, all).await?);
        scripted::planted_bugs(&s, seed).await?;
        // Back to the start: the journal undoes everything the run did.
        s.rec.rewind(0).map_err(|e| anyhow::anyhow!("{e}"))?;
        let back = digest(&s.rec.tree()).map_err(|e| anyhow::anyhow!("{e}"))?;
        ensure!(
            back == s.initial,
            "rewound to its start, the run's tree is {back:?}"
        );
    }
    if !failed.is_empty() {
        let shown: Vec<&str> = failed
            .iter()
            .take(MAX_REPORTED)
            .map(String::as_str)
            .collect();
        bail!(
            "{} power-loss states failed their checks; the first {}:\n{}",
            failed.len(),
            shown.len(),
            shown.join("\n\n")
        );
    }
    Ok(())
}

/// The first writes a new store acknowledges survive a power loss: the data
/// directory, made at the first start, and the commit log's directory in it are
/// durable before any record is acknowledged, and sled's `conf`, written when sled
/// makes its database, is whole. Checked at the sync points after the first
/// acknowledgement with every unsynced change lost, then at the last of them with
/// unsynced changes kept in part, a state for each of a dozen seeds. Without time
/// windows or checkpoints, whose own syncs of the data directory would hide a
/// missing one for most of a run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_acknowledged_writes_of_a_new_store_survive() -> anyhow::Result<()> {
    let seed = SplitMix64::seed_from_env();
    println!("seed = {seed} (TURND_SEED={seed} replays the choices)");
    let (base, _temp) = life::workspace("first")?;
    let dirs = Dirs::new(&base, &base.join("disk"))?;
    let daemon = life::start(&dirs.disk, Some(&dirs.ctl), false, BARE).await?;
    let record = Shared::default();
    let stop = CancellationToken::new();
    let mut tasks = JoinSet::new();
    let shape = Arc::new(Shape {
        pad: 64,
        pause_ms: (5, 10),
        step_ms: (0, 5),
    });
    life::load(&daemon.url, &record, seed, 1, &shape, &stop, &mut tasks).await?;
    let started = Instant::now();
    while acks(&record).submits.len() < 5 && started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    life::cut(daemon, &dirs.ctl).await?;
    life::stop_load(&stop, &mut tasks).await;
    let acks = std::mem::take(&mut *acks(&record));
    ensure!(
        acks.submits.len() >= 5,
        "too few submits acknowledged: {}",
        acks.submits.len()
    );
    let mut rec = dirs.recording("work")?;
    let first_ack = acks.submits.iter().map(|a| a.t_ack).min().unwrap_or(0);
    let points: Vec<usize> = rec
        .model
        .sync_points()
        .into_iter()
        .filter(|&p| rec.model.ops[p].0 > first_ack)
        .take(6)
        .collect();
    let last = points.last().copied().unwrap_or(0);
    let mut states: Vec<(usize, Variant, u64)> = points
        .iter()
        .map(|&p| (p, Variant::ALL[0], seed))
        .chain((0..12).map(|k| (last, Variant::ALL[1 + k % 5], seed ^ k as u64)))
        .collect();
    states.sort_by_key(|s| std::cmp::Reverse(s.0));
    for (k, (p, variant, state_seed)) in states.into_iter().enumerate() {
        rec.rewind(p).map_err(|e| anyhow::anyhow!("{e}"))?;
        let out = base.join(format!("state-{k}"));
        let (c, _, pending) =
            life::check_state(&rec, &acks, variant, state_seed, &|_, _| false, &out, BARE).await?;
        println!(
            "  op {p} ({}), {variant}, seed {state_seed}: {pending} pending ops, {} turns there",
            rec.describe(p),
            c.turns
        );
    }
    Ok(())
}

/// Cuts of `random_cuts_under_load` per seed (`POWERLOSS_CUTS`, default 4).
fn cuts() -> usize {
    std::env::var("POWERLOSS_CUTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_cuts_under_load() -> anyhow::Result<()> {
    let (seeds, _) = seeds();
    for seed in seeds {
        random_lives(seed)
            .await
            .with_context(|| format!("seed {seed}"))?;
    }
    Ok(())
}

/// One run of [`random_cuts_under_load`]: lives of the recorded daemon (without
/// retention), each under load until a cut at a random moment (a third of them
/// within 100 ms of the start, among the recovery's writes), each next one started
/// on a random power loss of the last at a random point (its cut, or any op before
/// it), after checking it.
async fn random_lives(seed: u64) -> anyhow::Result<()> {
    println!("seed = {seed} (TURND_SEED={seed} replays the choices)");
    let mut prng = SplitMix64::new(seed);
    let (base, _temp) = life::workspace("random")?;
    let record = Shared::default();
    let shape = Arc::new(Shape {
        pad: 2048,
        pause_ms: (2, 15),
        step_ms: (0, 10),
    });
    let cuts = cuts();
    let mut disk = base.join("life-0").join("disk");
    for life in 0..=cuts {
        let dirs = Dirs::new(&base.join(format!("life-{life}")), &disk)?;
        if life >= 2 {
            std::fs::remove_dir_all(base.join(format!("life-{}", life - 2)))?;
        }
        let initial = digest(&dirs.disk).map_err(|e| anyhow::anyhow!("{e}"))?;
        // Without retention: a turn it deleted while the checks read would look lost.
        // (The scripted run crosses retention's drops.)
        let daemon = life::start(&dirs.disk, Some(&dirs.ctl), false, &[])
            .await
            .with_context(|| format!("start life {life} on the power loss of the last"))?;
        let op = Caller::connect_as(&daemon.url, Role::Operator, None).await?;
        let required = std::mem::take(&mut *acks(&record));
        let e = Expect {
            acks: &required,
            before: now_ns(),
            deletable_before: 0,
            terminal_ns: TERMINAL_MS * 1_000_000,
        };
        let c = check::check(&op, &e)
            .await
            .with_context(|| format!("checks at the start of life {life}"))?;
        println!(
            "life {life}: {} turns ({} deleted by retention), {} stops, {} applied results, {} events there",
            c.turns, c.retained_away, c.stops, c.applied, c.events
        );
        let mut tasks = JoinSet::new();
        if life == cuts {
            let waited = check::work_goes_on(&daemon.url, &op, &e, &record, &mut tasks, 30).await?;
            println!("life {life}: {waited} unfinished turns ended, a new turn completed");
            tasks.abort_all();
            daemon.kill().await?;
            return Ok(());
        }
        *acks(&record) = required;
        let stop = CancellationToken::new();
        life::load(
            &daemon.url,
            &record,
            seed ^ life as u64,
            4,
            &shape,
            &stop,
            &mut tasks,
        )
        .await?;
        let after = if prng.chance(0.3) {
            prng.range(0, 100)
        } else {
            prng.range(200, 1500)
        };
        tokio::time::sleep(Duration::from_millis(after)).await;
        life::cut(daemon, &dirs.ctl).await?;
        life::stop_load(&stop, &mut tasks).await;
        let mut rec = dirs.recording("work")?;
        let end = rec.at();
        let p = if prng.chance(0.5) {
            end
        } else {
            prng.below(end as u64 + 1) as usize
        };
        rec.rewind(p).map_err(|e| anyhow::anyhow!("{e}"))?;
        let variant = Variant::ALL[prng.below(Variant::ALL.len() as u64) as usize];
        let state_seed = prng.next_u64();
        let out = dirs.base.join("state");
        let mut dice = Dice::new(state_seed);
        let loss = rec
            .crash_state(variant, &|_, _| false, &mut |n| dice.below(n), &out)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let t_p = life::time_of(&rec, p);
        {
            let mut a = acks(&record);
            a.submits.retain(|x| x.t_ack < t_p);
            a.stops.retain(|x| x.1 < t_p);
            a.applied.retain(|x| x.t_ack < t_p);
        }
        println!(
            "life {life}: cut {after} ms into the load, {end} ops journaled; power loss before op {p} ({}), {variant}, seed {state_seed}: {} of {} pending ops kept",
            if p < end { rec.describe(p) } else { "the cut".into() },
            loss.kept,
            loss.pending
        );
        rec.rewind(0).map_err(|e| anyhow::anyhow!("{e}"))?;
        let back = digest(&rec.tree()).map_err(|e| anyhow::anyhow!("{e}"))?;
        ensure!(
            back == initial,
            "life {life} rewound to its start is not what it started from"
        );
        disk = out.join("tree");
    }
    Ok(())
}
