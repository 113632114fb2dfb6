//! The scripted run of `every_sync_point_of_a_scripted_run`: one recorded life under
//! a fixed load until it crossed each landmark (a roll-over of the commit log to a
//! spare, a trimmed segment kept as a spare, a checkpoint of sled's main database, a
//! time window made and one dropped), the sync points chosen around them, their
//! states checked, and the two planted bugs the checks must catch.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use turnd_powerloss::model::{Model, Op};
use turnd_powerloss::state::{digest, Recording, Variant};
use turnd_tests::{http_get, metric};

use super::check::Counts;
use super::life::{self, Dirs, Made};
use super::load::{acks, Acks, Shape, Shared};

/// A recorded run of the scripted load and what it acknowledged.
pub struct Scripted {
    pub dirs: Dirs,
    pub rec: Recording,
    pub acks: Arc<Acks>,
    /// The recorded tree before the run.
    pub initial: BTreeMap<String, String>,
    _temp: Option<tempfile::TempDir>,
}

/// Record the daemon under the scripted load (three sessions, steps of 20 – 60 ms so
/// that live records reach sled and it checkpoints) until the run crossed a
/// checkpoint, a recycled log segment and a dropped time window (at most 20 s),
/// then cut it.
pub async fn run(seed: u64) -> anyhow::Result<Scripted> {
    let (base, temp) = life::workspace("scripted")?;
    let dirs = Dirs::new(&base, &base.join("disk"))?;
    let initial = digest(&dirs.disk).map_err(|e| anyhow::anyhow!("{e}"))?;
    let daemon = life::start(&dirs.disk, Some(&dirs.ctl), true, &[]).await?;
    let record = Shared::default();
    let stop = CancellationToken::new();
    let mut tasks = JoinSet::new();
    let shape = Arc::new(Shape {
        pad: 6 * 1024,
        pause_ms: (5, 20),
        step_ms: (20, 60),
    });
    life::load(&daemon.url, &record, seed, 3, &shape, &stop, &mut tasks).await?;
    let started = Instant::now();
    // A drop is counted once committed, and its directory deleted a moment later
    // (later still on a busy machine): the load goes on until a window directory
    // seen on the disk is gone, and then for 300 ms more.
    let windows = dirs.disk.join("data").join("windows");
    let mut seen = BTreeSet::new();
    let mut crossed_for = 0;
    while crossed_for < 3 && started.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (_, m) = http_get(&daemon.admin, "/metrics").await?;
        let n = |name: &str| metric(&m, name).unwrap_or(0.0);
        let now = window_dirs(&windows);
        let removed = seen.iter().any(|w| !now.contains(w));
        seen.extend(now);
        let crossed = n("turnd_storage_checkpoints_total") >= 1.0
            && n("turnd_storage_log_recycled_segments_total") >= 1.0
            && n("turnd_retention_dropped_windows_total") >= 1.0
            && removed;
        crossed_for = if crossed { crossed_for + 1 } else { 0 };
    }
    life::cut(daemon, &dirs.ctl).await?;
    life::stop_load(&stop, &mut tasks).await;
    let rec = dirs.recording("work")?;
    let acks = std::mem::take(&mut *acks(&record));
    println!(
        "scripted run (seed {seed}): {:.1} s, {} ops journaled, {} sync points; {} submits, {} stops, {} applied results acknowledged",
        started.elapsed().as_secs_f64(),
        rec.model.ops.len(),
        rec.model.sync_points().len(),
        acks.submits.len(),
        acks.stops.len(),
        acks.applied.len()
    );
    Ok(Scripted {
        dirs,
        rec,
        acks: Arc::new(acks),
        initial,
        _temp: temp,
    })
}

/// The time windows' directories on the disk now (not those being made).
fn window_dirs(windows: &std::path::Path) -> BTreeSet<std::ffi::OsString> {
    std::fs::read_dir(windows)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name())
                .filter(|n| !n.to_string_lossy().ends_with(".new"))
                .collect()
        })
        .unwrap_or_default()
}

/// The landmarks the scripted run must cross.
pub const MUST_CROSS: [&str; 5] = [
    "a spare renamed to the next segment",
    "a trimmed segment kept as a spare",
    "a checkpoint of sled's main database",
    "a time window made",
    "a time window dropped",
];

/// Every op of a landmark kind, by a name op's shape: the kind and the op's index.
pub fn landmarks(rec: &Recording) -> Vec<(&'static str, usize)> {
    let mut out = Vec::new();
    for (i, (_, op)) in rec.model.ops.iter().enumerate() {
        let dir = op.dir_of().map(|d| rec.name_of(d)).unwrap_or_default();
        let kind = match op {
            Op::Rename { from, to, .. } if dir == "data/log" => {
                match (from.ends_with(b".seg"), to.ends_with(b".seg")) {
                    (false, true) => Some(MUST_CROSS[0]),
                    (true, false) => Some(MUST_CROSS[1]),
                    _ if to == b"spare" => Some("a new spare segment renamed into place"),
                    _ => None,
                }
            }
            Op::Unlink { name, .. } if dir == "data/log" && name.ends_with(b".seg") => {
                Some("a trimmed segment deleted")
            }
            Op::Rename { to, .. } if dir == "data" && to.starts_with(b"snap.") => {
                Some(MUST_CROSS[2])
            }
            Op::Rename { from, .. } if dir == "data/windows" && from.ends_with(b".new") => {
                Some(MUST_CROSS[3])
            }
            Op::Rmdir { .. } if dir == "data/windows" => Some(MUST_CROSS[4]),
            _ => None,
        };
        if let Some(k) = kind {
            out.push((k, i));
        }
    }
    out
}

/// The sync points to check: with `all`, every one; else the first three after the
/// first acknowledgement (`first_ack`, a time), the first and second after the first
/// of each landmark kind, and points spread over the run, up to `most`. Each with
/// why it was chosen.
pub fn chosen_points(
    rec: &Recording,
    first_ack: u64,
    all: bool,
    most: usize,
) -> Vec<(usize, String)> {
    let syncs = rec.model.sync_points();
    if all {
        return syncs
            .into_iter()
            .map(|p| (p, "every sync point".into()))
            .collect();
    }
    let mut picked: BTreeMap<usize, String> = BTreeMap::new();
    let after_ack = syncs
        .iter()
        .copied()
        .filter(|&p| rec.model.ops[p].0 > first_ack);
    for (n, p) in after_ack.take(3).enumerate() {
        picked.insert(p, format!("sync {} after the first acknowledgement", n + 1));
    }
    let mut seen_kinds = BTreeSet::new();
    for (kind, i) in landmarks(rec) {
        if !seen_kinds.insert(kind) {
            continue;
        }
        let after = syncs.iter().copied().filter(|&p| p > i).take(2);
        for (n, p) in after.enumerate() {
            picked
                .entry(p)
                .or_insert_with(|| format!("sync {} after {kind}", n + 1));
        }
    }
    let spread = most.saturating_sub(picked.len()).max(1);
    for k in 0..spread {
        if let Some(&p) = syncs.get(syncs.len() * (2 * k + 1) / (2 * spread)) {
            picked
                .entry(p)
                .or_insert_with(|| "spread over the run".into());
        }
    }
    picked.into_iter().take(most).collect()
}

/// Seconds an exploration may take (`POWERLOSS_BUDGET_S`, default 3600 for every
/// sync point, 120 else): the states left when it runs out are counted as not
/// checked.
fn budget(all: bool) -> Duration {
    let default = if all { 3600 } else { 120 };
    Duration::from_secs(
        std::env::var("POWERLOSS_BUDGET_S")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(default),
    )
}

/// States checked at once (`POWERLOSS_JOBS`, default 1): each its own daemon.
fn jobs() -> usize {
    std::env::var("POWERLOSS_JOBS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1)
}

/// Variants checked at each point: `POWERLOSS_VARIANTS=all` every one, else one,
/// in turn from point to point.
fn variants_at(seed: u64, k: usize) -> Vec<Variant> {
    if std::env::var("POWERLOSS_VARIANTS").is_ok_and(|v| v == "all") {
        Variant::ALL.to_vec()
    } else {
        vec![Variant::ALL[(seed as usize + k) % Variant::ALL.len()]]
    }
}

/// Passes of an exploration of every point (see [`explore`]).
const PASSES: usize = 8;

/// A checked state: why its point was chosen, and the outcome.
type Checked = (usize, String, String, anyhow::Result<(Counts, usize)>);

/// Check the states of [`chosen_points`] (every sync point with `all`), newest
/// first, within the [`budget`], [`jobs`] at a time: a description of each that
/// failed (without `all`, the first failure ends it).
pub async fn explore(s: &mut Scripted, seed: u64, all: bool) -> anyhow::Result<Vec<String>> {
    let first_ack = s.acks.submits.iter().map(|a| a.t_ack).min().unwrap_or(0);
    let points = chosen_points(&s.rec, first_ack, all, 16);
    let (started, limit, jobs) = (Instant::now(), budget(all), jobs());
    let (mut checked, mut pending, mut failed) = (0usize, 0usize, Vec::new());
    let mut running: JoinSet<Checked> = JoinSet::new();
    let report = |c: Checked, failed: &mut Vec<String>| {
        let (k, why, label, r) = c;
        match r {
            Ok((c, waited)) if !all || k % 50 == 0 => println!(
                "  {why}: {label}: {} turns ({} deleted by retention), {} stops, {} applied results, {} events there; {waited} unfinished turns ended after the restart",
                c.turns, c.retained_away, c.stops, c.applied, c.events
            ),
            Ok(_) => {}
            Err(e) => {
                let f = format!("seed {seed}, {why}: {e:#}");
                println!("  FAILED: {f}");
                failed.push(f);
            }
        }
    };
    // With every point, passes over every PASSES-th point each, so that a budget
    // spent midway has covered the whole run; each pass on a fresh copy of the
    // recording, which only goes back.
    let passes = if all { PASSES } else { 1 };
    let mut skipped = 0;
    for pass in 0..passes {
        let mut fresh = None;
        if passes > 1 {
            fresh = Some(s.dirs.recording(&format!("pass-{pass}"))?);
        }
        let rec = fresh.as_mut().unwrap_or(&mut s.rec);
        let mine = points
            .iter()
            .enumerate()
            .rev()
            .filter(|(k, _)| k % passes == pass);
        for (k, (p, why)) in mine {
            if started.elapsed() > limit || (!all && !failed.is_empty()) {
                skipped += 1;
                continue;
            }
            rec.rewind(*p).map_err(|e| anyhow::anyhow!("{e}"))?;
            for variant in variants_at(seed, k) {
                let state_seed = seed ^ (*p as u64);
                let out = s.dirs.base.join(format!("state-{p}-{variant}"));
                let made: Made = life::make_state(rec, variant, state_seed, &|_, _| false, &out)?;
                pending += made.pending;
                checked += 1;
                let (acks, why) = (s.acks.clone(), format!("op {p}, {why}"));
                running.spawn(async move {
                    let r = life::verify(&made, &acks, &[]).await;
                    let label = made.label.split(": ").next().unwrap_or("").to_string();
                    (k, why, label, r)
                });
                while running.len() >= jobs {
                    if let Some(c) = running.join_next().await {
                        report(c.context("a state's check panicked")?, &mut failed);
                    }
                }
            }
        }
        if fresh.is_some() {
            std::fs::remove_dir_all(s.dirs.base.join(format!("pass-{pass}")))?;
        }
    }
    if skipped > 0 {
        println!("stopped: {skipped} of {} points not checked", points.len());
    }
    while let Some(c) = running.join_next().await {
        report(c.context("a state's check panicked")?, &mut failed);
    }
    println!(
        "seed {seed}: {checked} power-loss states checked ({} failed, {pending} pending ops in all), {:.1} s",
        failed.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(failed)
}

/// A planted bug: its name, the syncs its disk drops, and the ops between which its
/// states can show it.
type Planted<'a> = (&'a str, &'a dyn Fn(&Model, usize) -> bool, usize, usize);

/// The checks must catch two planted bugs, each modeled by a disk that drops a flush
/// (the recorder's journal is true; the state counts some syncs as never done):
/// acknowledgements made without the commit log's `fdatasync` (every one dropped),
/// and no sync of the log's directory after a spare was renamed to the next segment
/// (the first such sync after the first acknowledgement dropped; the rename is then
/// durable only once the next sync of the directory returns). On a fresh copy of the
/// recording, sync points where the bug can show are tried, newest first, until a
/// check fails.
pub async fn planted_bugs(s: &Scripted, seed: u64) -> anyhow::Result<()> {
    let model = &s.rec.model;
    let is_log_fdatasync = |m: &Model, i: usize| {
        matches!(&m.ops[i].1, Op::Sync { path, data_only: true, .. }
            if path.starts_with(b"data/log/") && path.ends_with(b".seg"))
    };
    let is_log_dir_sync =
        |m: &Model, i: usize| matches!(&m.ops[i].1, Op::Sync { path, .. } if path == b"data/log");
    let syncs = model.sync_points();
    let first_log_sync = syncs
        .iter()
        .copied()
        .find(|&i| is_log_fdatasync(model, i))
        .context("no fdatasync of the commit log")?;
    let first_ack = s.acks.submits.iter().map(|a| a.t_ack).min().unwrap_or(0);
    let roll = landmarks(&s.rec)
        .into_iter()
        .find(|(k, i)| *k == MUST_CROSS[0] && model.ops[*i].0 > first_ack)
        .map(|(_, i)| i)
        .context("no roll-over after the first acknowledgement")?;
    let mut dir_syncs = syncs
        .iter()
        .copied()
        .filter(|&i| i > roll && is_log_dir_sync(model, i));
    let dropped = dir_syncs
        .next()
        .context("no sync of the log's directory after the roll-over")?;
    let next_dir_sync = dir_syncs.next().unwrap_or(model.ops.len());
    let no_dir_sync_after_roll = move |_: &Model, i: usize| i == dropped;
    let bugs: [Planted; 2] = [
        (
            "acknowledged before the commit log's fdatasync",
            &is_log_fdatasync,
            first_log_sync,
            model.ops.len(),
        ),
        (
            "no directory sync after the spare's rename",
            &no_dir_sync_after_roll,
            dropped,
            next_dir_sync,
        ),
    ];
    for (n, (name, lie, from, to)) in bugs.into_iter().enumerate() {
        let started = Instant::now();
        let mut rec = s.dirs.recording(&format!("planted-{n}"))?;
        let candidates: Vec<usize> = syncs
            .iter()
            .copied()
            .filter(|&p| p > from && p <= to)
            .collect();
        let stride = candidates.len().div_ceil(12).max(1);
        println!(
            "planted bug \"{name}\": {} sync points after op {from} up to op {to}, every {stride} tried",
            candidates.len()
        );
        let mut caught = None;
        for (tried, &p) in candidates.iter().rev().step_by(stride).enumerate() {
            rec.rewind(p).map_err(|e| anyhow::anyhow!("{e}"))?;
            let out = s.dirs.base.join(format!("planted-{n}-{p}"));
            let lost = Variant::ALL[0];
            if let Err(e) = life::check_state(&rec, &s.acks, lost, seed, lie, &out, &[]).await {
                caught = Some((p, tried + 1, e));
                break;
            }
        }
        let Some((p, tried, e)) = caught else {
            bail!("the planted bug \"{name}\" was not caught (seed {seed})");
        };
        println!(
            "planted bug \"{name}\" caught (seed {seed}) at op {p} ({}), after {tried} states, {:.1} s: {:#}",
            rec.describe(p),
            started.elapsed().as_secs_f64(),
            e
        );
    }
    Ok(())
}
