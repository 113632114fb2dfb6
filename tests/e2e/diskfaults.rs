//! Durability against a failing disk: the real binary with `turnd-faultfs` preloaded.
//!
//! `crates/turnd-faultfs` is an `LD_PRELOAD` library that makes `pwrite` (how sled
//! writes its log) or `fdatasync`/`fsync` fail with `EIO` while a flag file exists.
//! The fault is below sled, so these tests see what sled and the store writer do with
//! real I/O errors: the request whose write could not be made durable is refused
//! with `unavailable`, every later write is refused until a restart even once the
//! disk works again (after a failed write-back nothing tells what reached the disk),
//! `/readyz` fails, and after `SIGKILL` and a restart every acknowledged turn is there
//! with its result and `store.check` is clean. Linux only (`LD_PRELOAD` of glibc
//! symbols).
#![cfg(target_os = "linux")]

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use turnd_client::turnd_proto::{ErrorCode, TurnStatus};
use turnd_client::{Caller, ClientError, WorkerHandle};
use turnd_tests::{echo_worker, faultfs_lib, http_get, BinDaemon};

const WAIT: Duration = Duration::from_secs(15);

fn refused(r: Result<impl std::fmt::Debug, ClientError>, what: &str) {
    match r {
        Err(e) => assert_eq!(e.code(), Some(ErrorCode::Unavailable), "{what}: {e}"),
        Ok(v) => panic!("{what}: accepted ({v:?}) while the store cannot make it durable"),
    }
}

async fn run_turns(c: &Caller, from: u64, n: u64) -> anyhow::Result<Vec<(String, u64)>> {
    let mut acked = Vec::new();
    for i in from..from + n {
        let t = c.submit_simple("disk", "echo", json!(i)).await?;
        acked.push((t.turn_id, i));
    }
    for (id, _) in &acked {
        let done = c.wait_terminal(id, WAIT).await?;
        assert_eq!(done.status, TurnStatus::Completed, "{done:?}");
    }
    Ok(acked)
}

/// Run turns, make the disk fail with `flag`, check the refusals, kill, restart on
/// a working disk and check that everything acknowledged is there.
async fn acknowledged_turns_survive(flag: &str) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let flags = dir.path().join("faultfs");
    std::fs::create_dir(&flags)?;
    let lib = faultfs_lib()?;
    let (lib, flags_s) = (lib.to_string_lossy(), flags.to_string_lossy());
    let d = BinDaemon::start(
        &data,
        &[("LD_PRELOAD", &lib), ("TURND_FAULTFS_DIR", &flags_s)],
    )
    .await?;
    let w = echo_worker(&d.url, "w-disk", 8).await;
    let c = Caller::connect(&d.url, None).await?;
    let acked = run_turns(&c, 0, 5).await?;
    assert_eq!(http_get(&d.admin, "/readyz").await?.0, 200);

    std::fs::write(flags.join(flag), b"")?;
    refused(
        c.submit_simple("disk", "echo", json!("during")).await,
        "submit while the disk fails",
    );
    std::fs::remove_file(flags.join(flag))?;
    refused(
        c.submit_simple("disk", "echo", json!("after")).await,
        "submit after the disk works again, before a restart",
    );
    refused(
        c.submit_simple("other", "echo", json!("after")).await,
        "submit to another session before a restart",
    );
    assert_eq!(http_get(&d.admin, "/readyz").await?.0, 503);
    drop(c);
    w.shutdown();
    d.kill().await?;

    let d = BinDaemon::start(&data, &[]).await?;
    let c = Caller::connect(&d.url, None).await?;
    for (id, i) in &acked {
        let t = c.get(id).await?;
        assert_eq!(t.status, TurnStatus::Completed, "{t:?}");
        assert_eq!(t.output, Some(json!(i)), "{t:?}");
    }
    let op = Caller::connect_as(&d.url, turnd_client::turnd_proto::Role::Operator, None).await?;
    let v = op.store_check().await?;
    assert!(v.is_empty(), "store.check after the restart: {v:?}");
    // Writes work again, whether or not the refused turn reached the disk.
    let w = echo_worker(&d.url, "w-disk", 8).await;
    run_turns(&c, 100, 3).await?;
    w.shutdown();
    stop(d).await
}

async fn stop(d: BinDaemon) -> anyhow::Result<()> {
    let status = d.terminate().await?;
    assert!(status.success(), "turnd exited with {status}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_fdatasync_refuses_writes_until_restart_and_loses_nothing() -> anyhow::Result<()>
{
    acknowledged_turns_survive("fail-syncs").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_log_write_refuses_writes_until_restart_and_loses_nothing() -> anyhow::Result<()>
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
    run_turns(&c, 0, 5).await?;
    w.shutdown();
    stop(d).await
}
