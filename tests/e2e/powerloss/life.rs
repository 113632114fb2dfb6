//! One life of the recorded daemon and the check of a power-loss state: the
//! daemon's settings, its directories, starting it (recorded or not), cutting it,
//! running the load through it, and making and checking a state from a recording.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use turnd_client::turnd_proto::Role;
use turnd_client::Caller;
use turnd_powerloss::journal::now_ns;
use turnd_powerloss::model::Model;
use turnd_powerloss::state::{Dice, Recording, Variant};
use turnd_tests::{faultfs_lib, BinDaemon};

use super::check::{self, Counts, Expect};
use super::load::{self, Acks, Shape, Shared};

/// Retention's `terminal_ms` while recording: turns end and are deleted, and the
/// windows they were in dropped, within a short run.
pub const TERMINAL_MS: u64 = 600;

/// Settings of every life: short timers, and small commit log segments, checkpoints
/// and time windows, so that a short run crosses each of them.
const ENV: &[(&str, &str)] = &[
    ("TURND_LOG", "error"),
    ("TURND_SERVER__HEARTBEAT_MS", "1000"),
    ("TURND_TURNS__PROBE_TIMEOUT_MS", "300"),
    ("TURND_TURNS__RECONNECT_GRACE_MS", "300"),
    ("TURND_TURNS__CANCEL_GRACE_MS", "300"),
    ("TURND_TURNS__RETRY_BACKOFF_MS", "20"),
    ("TURND_TURNS__DEFAULT_TIMEOUT_MS", "5000"),
    ("TURND_STORAGE__LOG_SEGMENT_KB", "64"),
    ("TURND_STORAGE__CHECKPOINT_MB", "1"),
    ("TURND_STORAGE__APPLY_INTERVAL_MS", "20"),
    ("TURND_STORAGE__APPLY_DELAY_MS", "50"),
    ("TURND_STORAGE__WINDOW_MS", "200"),
    ("TURND_RETENTION__SWEEP_INTERVAL_MS", "100"),
];

/// Settings under which nothing but the commit log's own code syncs the data
/// directory after the store is made: no time windows, no checkpoints.
pub const BARE: &[(&str, &str)] = &[
    ("TURND_STORAGE__WINDOW_MS", "0"),
    ("TURND_STORAGE__CHECKPOINT_MB", "0"),
];

/// One recorded life's directories: `disk/` the recorded tree (the data directory is
/// `disk/data`), `ctl/` the recorder's, and the recording's work directories.
pub struct Dirs {
    pub base: PathBuf,
    pub disk: PathBuf,
    pub ctl: PathBuf,
}

impl Dirs {
    /// A life under `base` recording `disk` (made if missing).
    pub fn new(base: &Path, disk: &Path) -> anyhow::Result<Dirs> {
        std::fs::create_dir_all(disk)?;
        Ok(Dirs {
            base: base.to_path_buf(),
            disk: std::fs::canonicalize(disk)?,
            ctl: base.join("ctl"),
        })
    }

    /// The recording of this life, copied to `base/<work>` as the run ended.
    pub fn recording(&self, work: &str) -> anyhow::Result<Recording> {
        Recording::open(
            &self.ctl.join("journal"),
            &self.disk,
            &self.ctl.join("stash"),
            &self.base.join(work),
        )
        .map_err(|e| anyhow::anyhow!("{e}"))
    }
}

/// Where a test's directories go: `POWERLOSS_KEEP` (kept), or a temporary one.
pub fn workspace(name: &str) -> anyhow::Result<(PathBuf, Option<tempfile::TempDir>)> {
    match std::env::var_os("POWERLOSS_KEEP") {
        Some(keep) => {
            let dir = PathBuf::from(keep).join(format!("{name}-{}", now_ns()));
            std::fs::create_dir_all(&dir)?;
            println!("keeping the recordings in {dir:?}");
            Ok((dir, None))
        }
        None => {
            let t = tempfile::tempdir()?;
            Ok((t.path().to_path_buf(), Some(t)))
        }
    }
}

/// Start the daemon on `disk/data`, with settings of `extra` over [`ENV`]'s:
/// recorded into `ctl` when given; with retention (`TERMINAL_MS`) or without (every
/// turn kept).
pub async fn start(
    disk: &Path,
    ctl: Option<&Path>,
    retention: bool,
    extra: &[(&str, &str)],
) -> anyhow::Result<BinDaemon> {
    let lib = faultfs_lib()?;
    let mut env: Vec<(String, String)> = ENV
        .iter()
        .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
        .chain(extra)
        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
        .collect();
    let terminal = if retention { TERMINAL_MS } else { 0 };
    env.push(("TURND_RETENTION__TERMINAL_MS".into(), terminal.to_string()));
    if let Some(ctl) = ctl {
        let path = |p: &Path| p.to_string_lossy().into_owned();
        env.push(("LD_PRELOAD".into(), path(&lib)));
        env.push(("TURND_POWERLOSS_ROOT".into(), path(disk)));
        env.push(("TURND_POWERLOSS_DIR".into(), path(ctl)));
    }
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let ready = disk.with_extension("ready.json");
    BinDaemon::start_with(&disk.join("data"), &ready, "127.0.0.1:0", &env).await
}

/// Cut the recorded daemon: the recorder kills it at its next recorded call.
pub async fn cut(mut d: BinDaemon, ctl: &Path) -> anyhow::Result<()> {
    use std::os::unix::process::ExitStatusExt;
    const SIGKILL: i32 = 9;
    std::fs::write(ctl.join("cut"), b"")?;
    let status = tokio::time::timeout(Duration::from_secs(10), d.child.wait())
        .await
        .context("the daemon made no recorded call for 10 s after the cut")??;
    ensure!(
        status.signal() == Some(SIGKILL),
        "the daemon ended with {status}, not by the cut"
    );
    std::fs::remove_file(ctl.join("cut"))?;
    Ok(())
}

/// The load: one raw worker and `sessions` callers, until `stop`.
pub async fn load(
    url: &str,
    record: &Shared,
    seed: u64,
    sessions: usize,
    shape: &Arc<Shape>,
    stop: &CancellationToken,
    tasks: &mut JoinSet<()>,
) -> anyhow::Result<()> {
    load::worker(url, record.clone(), seed, shape.step_ms, tasks).await?;
    for s in 0..sessions {
        tasks.spawn(load::caller(
            url.to_string(),
            format!("pl-{s}"),
            shape.clone(),
            record.clone(),
            seed.wrapping_add(s as u64 + 1),
            stop.clone(),
        ));
    }
    Ok(())
}

/// Stop the load on `tasks` once the daemon is gone.
pub async fn stop_load(stop: &CancellationToken, tasks: &mut JoinSet<()>) {
    stop.cancel();
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
}

/// The time of point `p` of `rec` (the end: its last op's).
pub fn time_of(rec: &Recording, p: usize) -> u64 {
    rec.model
        .ops
        .get(p)
        .or(rec.model.ops.last())
        .map_or(0, |(t, _)| *t)
}

/// A power-loss state made on disk, to check.
pub struct Made {
    /// The state: its tree is `out/tree`.
    pub out: PathBuf,
    /// The time of its point: what was acknowledged before must be there.
    pub before: u64,
    /// The point, op and variant, and what was lost, for messages.
    pub label: String,
    pub pending: usize,
}

/// Make in `out` the state a power loss at `rec`'s current point leaves (`variant`,
/// `seed`, `lie`).
pub fn make_state(
    rec: &Recording,
    variant: Variant,
    seed: u64,
    lie: &dyn Fn(&Model, usize) -> bool,
    out: &Path,
) -> anyhow::Result<Made> {
    let p = rec.at();
    let mut dice = Dice::new(seed);
    let loss = rec
        .crash_state(variant, lie, &mut |n| dice.below(n), out)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let op = if p < rec.model.ops.len() {
        rec.describe(p)
    } else {
        "the end".into()
    };
    Ok(Made {
        out: out.to_path_buf(),
        before: time_of(rec, p),
        label: format!(
            "power loss before op {p} ({op}), {variant}, seed {seed}: {} pending ops, {} kept; pending: {:?}",
            loss.pending,
            loss.kept,
            loss.described.iter().take(40).collect::<Vec<_>>()
        ),
        pending: loss.pending,
    })
}

/// Start a daemon (not recorded, retention off, settings `extra`) on the state, run
/// every check against what `acks` acknowledged before its point, stop it, and
/// remove the state (unless it failed and `POWERLOSS_KEEP` is set). Err says what
/// failed, and where.
pub async fn verify(
    made: &Made,
    acks: &Acks,
    extra: &[(&str, &str)],
) -> anyhow::Result<(Counts, usize)> {
    let r = verify_tree(&made.out.join("tree"), acks, made.before, extra).await;
    if r.is_ok() || std::env::var_os("POWERLOSS_KEEP").is_none() {
        std::fs::remove_dir_all(&made.out)?;
    }
    r.with_context(|| made.label.clone())
}

async fn verify_tree(
    tree: &Path,
    acks: &Acks,
    before: u64,
    extra: &[(&str, &str)],
) -> anyhow::Result<(Counts, usize)> {
    let daemon = start(tree, None, false, extra).await?;
    let op = Caller::connect_as(&daemon.url, Role::Operator, None).await?;
    let e = Expect {
        acks,
        before,
        deletable_before: before,
        terminal_ns: TERMINAL_MS * 1_000_000,
    };
    let counts = check::check(&op, &e).await?;
    let mut tasks = JoinSet::new();
    let scratch = Shared::default();
    let waited = check::work_goes_on(&daemon.url, &op, &e, &scratch, &mut tasks, 20).await?;
    tasks.abort_all();
    daemon.kill().await?;
    Ok((counts, waited))
}

/// [`make_state`] and [`verify`] it.
pub async fn check_state(
    rec: &Recording,
    acks: &Acks,
    variant: Variant,
    seed: u64,
    lie: &dyn Fn(&Model, usize) -> bool,
    out: &Path,
    extra: &[(&str, &str)],
) -> anyhow::Result<(Counts, usize, usize)> {
    let made = make_state(rec, variant, seed, lie, out)?;
    let (counts, waited) = verify(&made, acks, extra).await?;
    Ok((counts, waited, made.pending))
}
