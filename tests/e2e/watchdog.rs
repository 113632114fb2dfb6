//! systemd's watchdog through the real binary: the test plays systemd's notify socket
//! (a Unix datagram socket passed as `NOTIFY_SOCKET`) and sets `WATCHDOG_USEC`.
//!
//! While the store is healthy the daemon sends `WATCHDOG=1` every half of the
//! interval after `READY=1`. Once `Kv::health` fails (here: sled's writes fail with
//! `EIO` through `turnd-faultfs`'s `fail-db-writes` while the commit log and the disk
//! probe work, for 10 × `storage.heal_interval_ms`), `/healthz` answers 503, the
//! daemon sends `STATUS=<reason>` and no `WATCHDOG=1` after it, so that systemd kills
//! it and `Restart=on-failure` starts it again; the start replays the commit log and
//! every acknowledged turn is there. Without `WATCHDOG_USEC` (or with a
//! `WATCHDOG_PID` of another process) no `WATCHDOG=1` is sent. Linux only
//! (`LD_PRELOAD` of glibc symbols).
#![cfg(target_os = "linux")]
#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use serde_json::json;
use tokio::net::UnixDatagram;
use turnd_client::turnd_proto::TurnStatus;
use turnd_client::Caller;
use turnd_tests::{echo_turns, echo_worker, faultfs_lib, http_get, BinDaemon};

/// `WATCHDOG_USEC` of the test daemons: pings every 200 ms.
const WATCHDOG_USEC: &str = "400000";
const PING_PERIOD: Duration = Duration::from_millis(200);
const WAIT: Duration = Duration::from_secs(15);

/// systemd's end of the notify protocol: a datagram socket in a temporary directory.
struct NotifySocket {
    sock: UnixDatagram,
    path: String,
}

impl NotifySocket {
    fn bind(dir: &Path) -> anyhow::Result<NotifySocket> {
        let path = dir.join("notify.sock");
        let sock = UnixDatagram::bind(&path).context("bind the notify socket")?;
        Ok(NotifySocket {
            sock,
            path: path.to_string_lossy().into_owned(),
        })
    }

    /// The lines of every datagram that arrives within `within`, in order.
    async fn during(&self, within: Duration) -> anyhow::Result<Vec<String>> {
        let until = tokio::time::Instant::now() + within;
        let mut lines = Vec::new();
        let mut buf = vec![0u8; 4096];
        while let Ok(r) = tokio::time::timeout_at(until, self.sock.recv(&mut buf)).await {
            let n = r?;
            let text = String::from_utf8_lossy(buf.get(..n).unwrap_or_default());
            lines.extend(text.lines().map(str::to_string));
        }
        Ok(lines)
    }

    /// The lines that arrive up to and with the first that starts with `prefix`
    /// (at most `within`).
    async fn until(&self, prefix: &str, within: Duration) -> anyhow::Result<Vec<String>> {
        let until = tokio::time::Instant::now() + within;
        let mut lines = Vec::new();
        let mut buf = vec![0u8; 4096];
        loop {
            let n = tokio::time::timeout_at(until, self.sock.recv(&mut buf))
                .await
                .with_context(|| format!("no {prefix}… within {within:?}; got {lines:?}"))??;
            let text = String::from_utf8_lossy(buf.get(..n).unwrap_or_default());
            for line in text.lines() {
                lines.push(line.to_string());
                if line.starts_with(prefix) {
                    return Ok(lines);
                }
            }
        }
    }
}

fn pings(lines: &[String]) -> usize {
    lines.iter().filter(|l| *l == "WATCHDOG=1").count()
}

/// Pinged while healthy; once sled keeps failing while the disk takes writes,
/// `/healthz` fails, `STATUS=` says why and the pings stop; after `SIGKILL` (what
/// systemd's watchdog does, with `SIGABRT`) and a start on the same data directory,
/// every acknowledged turn is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watchdog_is_pinged_while_the_store_is_healthy_and_no_longer_once_it_needs_a_restart(
) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let flags = dir.path().join("faultfs");
    std::fs::create_dir(&flags)?;
    let notify = NotifySocket::bind(dir.path())?;
    let lib = faultfs_lib()?;
    let (lib, flags_s) = (lib.to_string_lossy(), flags.to_string_lossy());
    let d = BinDaemon::start(
        &data,
        &[
            ("NOTIFY_SOCKET", &notify.path),
            ("WATCHDOG_USEC", WATCHDOG_USEC),
            ("LD_PRELOAD", &lib),
            ("TURND_FAULTFS_DIR", &flags_s),
            ("TURND_STORAGE__HEAL_INTERVAL_MS", "100"),
            ("TURND_STORAGE__APPLY_INTERVAL_MS", "20"),
        ],
    )
    .await?;
    let before = notify.until("READY=1", WAIT).await?;
    assert_eq!(pings(&before), 0, "pinged before READY=1: {before:?}");
    // Three pings in fifteen periods: more than a loaded machine can delay them by.
    let healthy = notify.during(PING_PERIOD * 15).await?;
    assert!(pings(&healthy) >= 3, "pings while healthy: {healthy:?}");
    assert!(
        healthy.iter().all(|l| l == "WATCHDOG=1"),
        "only pings while healthy: {healthy:?}"
    );
    assert_eq!(http_get(&d.admin, "/healthz").await?.0, 200);

    let w = echo_worker(&d.url, "w-wd", 8).await;
    let c = Caller::connect(&d.url, None).await?;
    let acked = echo_turns(&c, "wd", 0, 5).await?;
    // sled's writes fail from here on; the commit log still takes every commit.
    // While they fail the applier closes sled to open it again, and with that open
    // failing too, reads of what sled held answer `unavailable`. So what is written
    // now needs no read: turns for a function nobody serves, each in a session of
    // its own (a new session reads nothing), acknowledged once in the commit log.
    std::fs::write(flags.join("fail-db-writes"), b"")?;
    let mut queued = Vec::new();
    for i in 100..105u64 {
        let t = c
            .submit_simple(&format!("wd-{i}"), "nobody", json!(i))
            .await?;
        queued.push((t.turn_id, i));
    }
    let (_, why) = turnd_tests::eventually(20, "/healthz 503 while sled fails", || async {
        http_get(&d.admin, "/healthz")
            .await
            .ok()
            .filter(|(code, _)| *code == 503)
    })
    .await?;
    assert!(why.contains("writing to sled has failed"), "{why}");
    let last = notify.until("STATUS=", WAIT).await?;
    let status = last.last().context("a STATUS= line")?;
    assert!(
        status.contains("writing to sled has failed"),
        "STATUS= carries the reason: {status}"
    );
    let after = notify.during(PING_PERIOD * 5).await?;
    assert!(after.is_empty(), "sent after STATUS=: {after:?}");
    assert_eq!(http_get(&d.admin, "/healthz").await?.0, 503);

    // What systemd does next: kill it (the watchdog's SIGABRT) and start it again.
    std::fs::remove_file(flags.join("fail-db-writes"))?;
    drop(c);
    w.shutdown();
    d.kill().await?;
    let d = BinDaemon::start(&data, &[]).await?;
    assert_eq!(http_get(&d.admin, "/healthz").await?.0, 200);
    let c = Caller::connect(&d.url, None).await?;
    for (id, i) in &acked {
        let t = c.get(id).await?;
        assert_eq!(t.status, TurnStatus::Completed, "{t:?}");
        assert_eq!(t.output, Some(json!(i)), "{t:?}");
    }
    for (id, i) in &queued {
        let t = c.get(id).await?;
        assert_eq!(t.status, TurnStatus::Queued, "{t:?}");
        assert_eq!(t.input, json!(i), "{t:?}");
    }
    let op = Caller::connect_as(&d.url, turnd_client::turnd_proto::Role::Operator, None).await?;
    let v = op.store_check().await?;
    assert!(v.is_empty(), "store.check after the restart: {v:?}");
    stop(d).await
}

/// `SIGTERM`: the daemon exits with status 0.
async fn stop(d: BinDaemon) -> anyhow::Result<()> {
    let status = d.terminate().await?;
    assert!(status.success(), "turnd exited with {status}");
    Ok(())
}

/// Start with `env` next to `NOTIFY_SOCKET`; `READY=1` arrives, then nothing for
/// five ping periods; `SIGTERM` sends `STOPPING=1`.
async fn never_pinged(env: &[(&str, &str)]) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let notify = NotifySocket::bind(dir.path())?;
    let mut all = vec![("NOTIFY_SOCKET", notify.path.as_str())];
    all.extend_from_slice(env);
    let d = BinDaemon::start(&dir.path().join("data"), &all).await?;
    let before = notify.until("READY=1", WAIT).await?;
    assert_eq!(before, ["READY=1"]);
    let after = notify.during(PING_PERIOD * 5).await?;
    assert!(after.is_empty(), "sent after READY=1: {after:?}");
    stop(d).await?;
    let stopping = notify.during(Duration::from_millis(200)).await?;
    assert_eq!(stopping, ["STOPPING=1"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_watchdog_usec_only_ready_and_stopping_are_sent() -> anyhow::Result<()> {
    never_pinged(&[]).await
}

/// `WATCHDOG_PID` names the process systemd watches; another one's is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watchdog_for_another_pid_is_not_pinged() -> anyhow::Result<()> {
    never_pinged(&[("WATCHDOG_USEC", WATCHDOG_USEC), ("WATCHDOG_PID", "1")]).await
}
