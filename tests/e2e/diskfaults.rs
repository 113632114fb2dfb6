//! Durability against a failing disk: the real binary with `turnd-faultfs` preloaded.
//!
//! `crates/turnd-faultfs` is an `LD_PRELOAD` library that makes `pwrite` (how the
//! commit log and sled write) or `fdatasync`/`fsync` fail with `EIO` while a flag file
//! exists. The fault is below the store, so these tests see what the commit log, sled
//! and the engine do with real I/O errors: the request whose write could not be made
//! durable is refused with `unavailable` and `/readyz` fails; once the disk works
//! again the daemon repairs its log and takes writes again on its own, within a
//! bounded time and without a restart; the refused request leaves nothing behind;
//! and after `SIGKILL` and a restart every acknowledged turn is there with its result
//! and `store.check` is clean. Linux only (`LD_PRELOAD` of glibc symbols).
#![cfg(target_os = "linux")]
#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;
use turnd_client::turnd_proto::{ErrorCode, ListArgs, TurnStatus};
use turnd_client::{Caller, ClientError, WorkerHandle};
use turnd_tests::{echo_turns, echo_worker, faultfs_lib, http_get, metric, BinDaemon};

const WAIT: Duration = Duration::from_secs(15);

fn refused(r: Result<impl std::fmt::Debug, ClientError>, what: &str) {
    match r {
        Err(e) => assert_eq!(e.code(), Some(ErrorCode::Unavailable), "{what}: {e}"),
        Ok(v) => panic!("{what}: accepted ({v:?}) while the store cannot make it durable"),
    }
}

/// How often the test daemon's commit log tries to repair itself.
const HEAL_MS: &str = "100";

/// A data directory on a disk that `turnd-faultfs` fails on demand: the flag files
/// go in `flags`.
struct FaultyDisk {
    _dir: tempfile::TempDir,
    data: PathBuf,
    flags: PathBuf,
}

impl FaultyDisk {
    fn new() -> anyhow::Result<FaultyDisk> {
        let dir = tempfile::tempdir()?;
        let (data, flags) = (dir.path().join("data"), dir.path().join("faultfs"));
        std::fs::create_dir(&flags)?;
        Ok(FaultyDisk {
            _dir: dir,
            data,
            flags,
        })
    }

    /// The real binary on this disk, with the library preloaded and `env` besides.
    async fn start(&self, env: &[(&str, &str)]) -> anyhow::Result<BinDaemon> {
        let lib = faultfs_lib()?;
        let (lib, flags) = (lib.to_string_lossy(), self.flags.to_string_lossy());
        let mut all = vec![("LD_PRELOAD", &*lib), ("TURND_FAULTFS_DIR", &*flags)];
        all.extend_from_slice(env);
        BinDaemon::start(&self.data, &all).await
    }
}

/// Run turns, make the disk fail with `flag`, check the refusals, let the disk work
/// again and check that the daemon heals by itself; kill, restart on a working disk and
/// check that everything acknowledged is there and the refused submit is not.
async fn acknowledged_turns_survive(flag: &str) -> anyhow::Result<()> {
    let disk = FaultyDisk::new()?;
    let d = disk
        .start(&[("TURND_STORAGE__HEAL_INTERVAL_MS", HEAL_MS)])
        .await?;
    let w = echo_worker(&d.url, "w-disk", 8).await;
    let c = Caller::connect(&d.url, None).await?;
    let mut acked = echo_turns(&c, "disk", 0, 5).await?;
    assert_eq!(http_get(&d.admin, "/readyz").await?.0, 200);

    std::fs::write(disk.flags.join(flag), b"")?;
    refused(
        c.submit_simple("disk", "echo", json!("during")).await,
        "submit while the disk fails",
    );
    assert_eq!(http_get(&d.admin, "/readyz").await?.0, 503);
    std::fs::remove_file(disk.flags.join(flag))?;

    // The log repairs itself within its heal interval: a submit is taken again.
    let healed_at = tokio::time::Instant::now();
    let first = loop {
        match c.submit_simple("disk", "echo", json!(50)).await {
            Ok(t) => break t,
            Err(e) if e.code() == Some(ErrorCode::Unavailable) => {
                assert!(
                    healed_at.elapsed() < Duration::from_secs(5),
                    "still refused 5 s after the disk works again: {e}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    let done = c.wait_terminal(&first.turn_id, WAIT).await?;
    assert_eq!(done.status, TurnStatus::Completed, "{done:?}");
    acked.push((first.turn_id, 50));
    acked.extend(echo_turns(&c, "disk", 100, 3).await?);
    turnd_tests::eventually(5, "/readyz 200 after the repair", || async {
        matches!(http_get(&d.admin, "/readyz").await, Ok((200, _))).then_some(())
    })
    .await?;
    drop(c);
    w.shutdown();
    d.kill().await?;

    let d = BinDaemon::start(&disk.data, &[]).await?;
    let c = Caller::connect(&d.url, None).await?;
    all_completed(&c, &acked).await?;
    // The refused submit left no turn: the repair wrote over whatever it had left.
    let listed = c
        .list(ListArgs {
            session_id: "disk".into(),
            status: None,
            limit: Some(100),
            before_seq: None,
        })
        .await?;
    let mut ids: Vec<&str> = listed.turns.iter().map(|t| t.turn_id.as_str()).collect();
    let mut want: Vec<&str> = acked.iter().map(|(id, _)| id.as_str()).collect();
    ids.sort();
    want.sort();
    assert_eq!(ids, want, "the session's turns after the restart");
    store_is_clean(&d.url).await?;
    let w = echo_worker(&d.url, "w-disk", 8).await;
    echo_turns(&c, "disk", 200, 3).await?;
    w.shutdown();
    stop(d).await
}

/// Every acknowledged turn (id, input) read back completed, with its input as output.
async fn all_completed(c: &Caller, acked: &[(String, u64)]) -> anyhow::Result<()> {
    for (id, i) in acked {
        let t = c.get(id).await?;
        assert_eq!(t.status, TurnStatus::Completed, "{t:?}");
        assert_eq!(t.output, Some(json!(i)), "{t:?}");
    }
    Ok(())
}

/// `store.check` finds nothing.
async fn store_is_clean(url: &str) -> anyhow::Result<()> {
    let op = Caller::connect_as(url, turnd_client::turnd_proto::Role::Operator, None).await?;
    let v = op.store_check().await?;
    assert!(v.is_empty(), "store.check after the restart: {v:?}");
    Ok(())
}

/// Within `secs`, sled (which refuses every write after a failed one until it is
/// opened again) has taken every record of the commit log.
async fn all_applied(admin: &str, secs: u64) -> anyhow::Result<()> {
    turnd_tests::eventually(
        secs,
        "sled takes the commit log's records again",
        || async {
            let (_, m) = http_get(admin, "/metrics").await.ok()?;
            (metric(&m, "turnd_storage_unapplied_keys")? == 0.0).then_some(())
        },
    )
    .await
}

async fn stop(d: BinDaemon) -> anyhow::Result<()> {
    let status = d.terminate().await?;
    assert!(status.success(), "turnd exited with {status}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_fdatasync_refuses_writes_until_repaired_and_loses_nothing() -> anyhow::Result<()>
{
    acknowledged_turns_survive("fail-syncs").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_log_write_refuses_writes_until_repaired_and_loses_nothing() -> anyhow::Result<()>
{
    acknowledged_turns_survive("fail-writes").await
}

/// Without its flag files the library changes nothing: the daemon runs turns and
/// shuts down cleanly with it loaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fault_library_without_flags_changes_nothing() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let lib = faultfs_lib()?;
    let flags: &Path = dir.path();
    let d = BinDaemon::start(
        &data,
        &[
            ("LD_PRELOAD", &lib.to_string_lossy()),
            ("TURND_FAULTFS_DIR", &flags.to_string_lossy()),
        ],
    )
    .await?;
    let w: WorkerHandle = echo_worker(&d.url, "w-disk", 8).await;
    let c = Caller::connect(&d.url, None).await?;
    echo_turns(&c, "disk", 0, 5).await?;
    w.shutdown();
    stop(d).await
}

/// Group commits whose commit log sync took longer than 100 ms, from `/metrics`.
async fn syncs_over_100ms(admin: &str) -> anyhow::Result<f64> {
    let (_, body) = http_get(admin, "/metrics").await?;
    let h = "turnd_storage_sync_duration_seconds";
    let count = metric(&body, &format!("{h}_count")).ok_or_else(|| anyhow::anyhow!("{body}"))?;
    let within = metric(&body, &format!("{h}_bucket{{le=\"0.1\"}}"))
        .ok_or_else(|| anyhow::anyhow!("{body}"))?;
    Ok(count - within)
}

/// A disk whose syncs stall: commits wait for the commit log's `fdatasync`, nothing
/// is refused, and the commit log's sync histogram on `/metrics`
/// (`turnd_storage_sync_duration_seconds`) shows the slow syncs, which is how an
/// operator tells a stalling disk from a stalled daemon.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_whose_syncs_stall_slows_commits_and_the_sync_histogram_shows_it(
) -> anyhow::Result<()> {
    let disk = FaultyDisk::new()?;
    let d = disk.start(&[]).await?;
    let w = echo_worker(&d.url, "w-slow", 8).await;
    let c = Caller::connect(&d.url, None).await?;
    echo_turns(&c, "slow", 0, 3).await?;
    let before = syncs_over_100ms(&d.admin).await?;

    std::fs::write(disk.flags.join("slow-syncs"), b"150")?;
    let started = std::time::Instant::now();
    echo_turns(&c, "slow", 10, 2).await?;
    // Each turn's admission is one commit at least, and each waited for its sync.
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "two turns on a disk whose syncs take 150 ms took {:?}",
        started.elapsed()
    );
    std::fs::remove_file(disk.flags.join("slow-syncs"))?;
    let slow = syncs_over_100ms(&d.admin).await? - before;
    assert!(slow >= 2.0, "{slow} group commits counted over 100 ms");

    echo_turns(&c, "slow", 20, 3).await?;
    w.shutdown();
    stop(d).await
}

/// A full disk under load: four sessions keep submitting turns while every
/// write of the commit log (and of sled) fails with `ENOSPC` for a while. Submits
/// are refused with `unavailable` and `/readyz` answers 503 meanwhile; once space is
/// back the daemon takes writes again without a restart, every turn it acknowledged
/// (before, during or after) completes, and after `SIGKILL` and a restart every one
/// is there with its output, nothing refused is, and `store.check` is clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_writes_until_space_is_back_and_loses_nothing() -> anyhow::Result<()> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let disk = FaultyDisk::new()?;
    let d = disk
        .start(&[
            ("TURND_STORAGE__HEAL_INTERVAL_MS", HEAL_MS),
            ("TURND_STORAGE__APPLY_INTERVAL_MS", "20"),
        ])
        .await?;
    let w = echo_worker(&d.url, "w-full", 8).await;
    let c = Arc::new(Caller::connect(&d.url, None).await?);
    let acked: Arc<Mutex<Vec<(String, String, u64)>>> = Arc::default();
    let refusals = Arc::new(Mutex::new(0u64));
    let halt = Arc::new(AtomicBool::new(false));
    let mut load = tokio::task::JoinSet::new();
    for s in 0..4 {
        let (c, acked, refusals, halt) = (c.clone(), acked.clone(), refusals.clone(), halt.clone());
        load.spawn(async move {
            let session = format!("full-{s}");
            let mut i = 0u64;
            while !halt.load(Ordering::Relaxed) {
                i += 1;
                match c.submit_simple(&session, "echo", json!(i)).await {
                    Ok(t) => {
                        acked
                            .lock()
                            .map_err(|_| anyhow::anyhow!("poisoned"))?
                            .push((session.clone(), t.turn_id.clone(), i));
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Err(e) if e.code() == Some(ErrorCode::Unavailable) => {
                        *refusals.lock().map_err(|_| anyhow::anyhow!("poisoned"))? += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            Ok::<(), anyhow::Error>(())
        });
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    std::fs::write(disk.flags.join("disk-full"), b"")?;
    turnd_tests::eventually(5, "/readyz 503 while the disk is full", || async {
        matches!(http_get(&d.admin, "/readyz").await, Ok((503, _))).then_some(())
    })
    .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let during = *refusals.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
    assert!(during > 0, "no submit was refused while the disk was full");
    std::fs::remove_file(disk.flags.join("disk-full"))?;
    let acked_before_room = acked.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.len();
    turnd_tests::eventually(5, "/readyz 200 once space is back", || async {
        matches!(http_get(&d.admin, "/readyz").await, Ok((200, _))).then_some(())
    })
    .await?;
    // The load goes on with room again; then it stops and every acknowledged turn
    // must have completed (each session waited for its own).
    turnd_tests::eventually(5, "submits acknowledged again", || {
        let acked = acked.clone();
        async move { (acked.lock().ok()?.len() >= acked_before_room + 8).then_some(()) }
    })
    .await?;
    halt.store(true, Ordering::Relaxed);
    while let Some(r) = load.join_next().await {
        r??;
    }
    let acked = acked
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone();
    // Every acknowledged turn completes, without a restart. Until sled is opened again
    // (within the heal interval once the disk takes writes) a read that reaches it
    // may be refused as `unavailable`, which is retryable; an acknowledged turn is
    // never missing.
    for (_, id, _) in &acked {
        let done = turnd_tests::eventually(15, "the acknowledged turn read back", || async {
            match c.wait_terminal(id, WAIT).await {
                Err(e) if e.code() == Some(ErrorCode::Unavailable) => None,
                other => Some(other),
            }
        })
        .await??;
        assert_eq!(done.status, TurnStatus::Completed, "{done:?}");
    }
    // sled, which refuses every write after a failed one until it is opened again,
    // takes the commit log's records again: nothing is left waiting for it.
    all_applied(&d.admin, 5).await?;
    assert_eq!(http_get(&d.admin, "/healthz").await?.0, 200);
    drop(c);
    w.shutdown();
    d.kill().await?;

    let d = BinDaemon::start(&disk.data, &[]).await?;
    let c = Caller::connect(&d.url, None).await?;
    let mut by_session: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for (session, id, i) in &acked {
        let t = c.get(id).await?;
        assert_eq!(t.status, TurnStatus::Completed, "{t:?}");
        assert_eq!(t.output, Some(json!(i)), "{t:?}");
        by_session
            .entry(session.clone())
            .or_default()
            .push(id.clone());
    }
    // Nothing refused left a turn behind.
    for (session, mut want) in by_session {
        let listed = c
            .list(ListArgs {
                session_id: session.clone(),
                status: None,
                limit: Some(1000),
                before_seq: None,
            })
            .await?;
        let mut ids: Vec<String> = listed.turns.into_iter().map(|t| t.turn_id).collect();
        ids.sort();
        want.sort();
        assert_eq!(ids, want, "the turns of {session} after the restart");
    }
    store_is_clean(&d.url).await?;
    stop(d).await
}

/// A time window falls due while sled's files refuse writes (`fail-db-writes`; the
/// commit log works, so turns are acknowledged and complete meanwhile). Either the
/// new window's sled cannot be opened, and nothing of it may be left: at the next
/// start every directory under `windows/` is a window, and one left by the failed
/// try would take the keys of its time from the window they are written to
/// meanwhile, so that they would read as missing. Or it opens, and its first writes
/// fail like the main database's. Once sled takes writes again the applier opens
/// the main database and every window again and writes the commit log's records to
/// them; after `SIGKILL` and a restart every acknowledged turn is there with its
/// output and `store.check` is clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_started_while_sled_fails_loses_nothing() -> anyhow::Result<()> {
    const WINDOW_MS: u64 = 150;
    let disk = FaultyDisk::new()?;
    let window = WINDOW_MS.to_string();
    let d = disk
        .start(&[
            ("TURND_STORAGE__HEAL_INTERVAL_MS", HEAL_MS),
            ("TURND_STORAGE__APPLY_INTERVAL_MS", "20"),
            ("TURND_STORAGE__WINDOW_MS", &window),
        ])
        .await?;
    let w = echo_worker(&d.url, "w-win", 8).await;
    let c = Caller::connect(&d.url, None).await?;
    let windows =
        || -> anyhow::Result<usize> { Ok(std::fs::read_dir(disk.data.join("windows"))?.count()) };
    let mut acked = echo_turns(&c, "win", 0, 3).await?;
    turnd_tests::eventually(5, "the first window", || async {
        (windows().ok()? >= 1).then_some(())
    })
    .await?;
    tokio::time::sleep(Duration::from_millis(WINDOW_MS + 50)).await;

    // The next window is due; sled's files refuse writes for three of its lengths.
    std::fs::write(disk.flags.join("fail-db-writes"), b"")?;
    let failing = tokio::time::Instant::now();
    let mut i = 100;
    while failing.elapsed() < Duration::from_millis(3 * WINDOW_MS) {
        acked.extend(echo_turns(&c, "win", i, 1).await?);
        i += 1;
    }
    std::fs::remove_file(disk.flags.join("fail-db-writes"))?;
    all_applied(&d.admin, 10).await?;
    acked.extend(echo_turns(&c, "win", 1000, 3).await?);
    drop(c);
    w.shutdown();
    d.kill().await?;

    let d = BinDaemon::start(&disk.data, &[]).await?;
    let c = Caller::connect(&d.url, None).await?;
    all_completed(&c, &acked).await?;
    store_is_clean(&d.url).await?;
    stop(d).await
}
