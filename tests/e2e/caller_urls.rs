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
