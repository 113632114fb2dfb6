//! A Rust caller given several URLs (as for a cluster's nodes), through two
//! independent `turnd serve` processes: it connects to the first URL that answers,
//! and when that daemon dies its next request is answered by the next one. The two
//! daemons share nothing, so a turn only one of them holds tells which answered.

use std::time::Duration;

use serde_json::json;
use turnd_client::Caller;
use turnd_proto::ErrorCode;
use turnd_tests::BinDaemon;

/// A URL nobody listens on (a port bound, then released).
fn dead_url() -> anyhow::Result<String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(turnd_client::ws_url(l.local_addr()?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_skips_a_dead_url_and_fails_over_when_its_daemon_dies() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let a = BinDaemon::start(&dir.path().join("a"), &[]).await?;
    let b = BinDaemon::start(&dir.path().join("b"), &[]).await?;
    // A turn only B holds (no worker serves it: it stays queued).
    let on_b = Caller::connect(&b.url, None).await?;
    let t = on_b.submit_simple("s-b", "nobody", json!(1)).await?;

    // [dead, A]: connected to A, which does not know B's turn.
    let dead = dead_url()?;
    let c = Caller::connect_any(&[dead.as_str(), a.url.as_str()], None).await?;
    assert_eq!(c.url().as_deref(), Some(a.url.as_str()));
    let missing = c.get(&t.turn_id).await.expect_err("A does not hold it");
    assert_eq!(missing.code(), Some(ErrorCode::NotFound), "{missing:?}");

    // [A, B] with A killed between two requests: the next is answered by B.
    let c = Caller::connect_any(&[a.url.as_str(), b.url.as_str()], None).await?;
    c.ping().await?;
    assert_eq!(c.url().as_deref(), Some(a.url.as_str()));
    a.kill().await?;
    let got = tokio::time::timeout(Duration::from_secs(20), c.get(&t.turn_id)).await??;
    assert_eq!(got.turn_id, t.turn_id);
    assert_eq!(c.url().as_deref(), Some(b.url.as_str()));

    Ok(())
}

/// Turns `c`'s daemon holds, in any state.
async fn turns_held(c: &Caller) -> anyhow::Result<u64> {
    let t = c.stats().await?.turns;
    Ok(t.queued + t.running + t.completed + t.failed + t.cancelled)
}

/// A daemon that shuts down answers every request it read and closes with 1001; a
/// request it never read changed nothing, so the caller sends it again to the next
/// URL, whatever its op. Callers submitting turns without idempotency keys, many in
/// flight on each connection, across a SIGTERM of A: no request fails unanswered,
/// and A (restarted) and B together hold exactly the turns acknowledged: none lost,
/// none run twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_a_stopping_daemon_never_read_are_sent_again_and_run_once() -> anyhow::Result<()> {
    const CALLERS: usize = 4;
    const IN_FLIGHT: usize = 8;
    let dir = tempfile::tempdir()?;
    let a = BinDaemon::start(&dir.path().join("a"), &[]).await?;
    let b = BinDaemon::start(&dir.path().join("b"), &[]).await?;
    let urls = [a.url.clone(), b.url.clone()];
    let acked = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let on_b = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for t in 0..CALLERS {
        let (urls, acked, on_b) = (urls.clone(), acked.clone(), on_b.clone());
        tasks.push(tokio::spawn(async move {
            let c = Caller::connect_any(&[urls[0].as_str(), urls[1].as_str()], None).await?;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            let mut k = 0u64;
            // Until 40 rounds went to B after A stopped (bounded in time).
            while on_b.load(std::sync::atomic::Ordering::Relaxed) < 40 {
                anyhow::ensure!(
                    tokio::time::Instant::now() < deadline,
                    "A's shutdown did not move the callers to B within 60 s"
                );
                let round = (0..IN_FLIGHT).map(|i| {
                    // A session per submit: no per-session queue limit is met.
                    let session = format!("s{t}-{k}-{i}");
                    let c = &c;
                    async move { c.submit_simple(&session, "nobody", json!(1)).await }
                });
                for r in futures_util::future::join_all(round).await {
                    match r {
                        Ok(_) => {
                            acked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        // An answer: nothing was created; a new submit follows.
                        Err(e) if e.code() == Some(ErrorCode::ShuttingDown) => {}
                        Err(e) => anyhow::bail!("caller {t}: a submit failed: {e}"),
                    }
                }
                if c.url().as_deref() == Some(urls[1].as_str()) {
                    on_b.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                k += 1;
            }
            anyhow::Ok(())
        }));
    }
    // Let the callers run on A (some rounds acknowledged, however slowly this
    // machine started them), then stop it while they send.
    turnd_tests::eventually(30, "submits acknowledged by A", || {
        let acked = acked.clone();
        async move { (acked.load(std::sync::atomic::Ordering::Relaxed) >= 32).then_some(()) }
    })
    .await?;
    let a_dir = a.data_dir.clone();
    let status = a.terminate().await?;
    assert!(status.success(), "A exited with {status}");
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(90), t).await???;
    }
    let a = BinDaemon::start(&a_dir, &[]).await?;
    let held_a = turns_held(&Caller::connect(&a.url, None).await?).await?;
    let held_b = turns_held(&Caller::connect(&b.url, None).await?).await?;
    let acked = acked.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!("acknowledged {acked}: A holds {held_a}, B holds {held_b}");
    assert!(held_a > 0 && held_b > 0, "both daemons took submits");
    assert_eq!(held_a + held_b, acked, "turns held = turns acknowledged");
    Ok(())
}
