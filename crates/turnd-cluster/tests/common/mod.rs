//! Helpers the cluster's tests share: a log's settings with short timeouts, and
//! the log's blocking calls run off the test's runtime (as the store's threads
//! run them).
#![allow(dead_code, reason = "each test binary uses some of them")]

use std::sync::Arc;
use std::time::Duration;

use turnd_cluster::testing::Rig;
use turnd_cluster::{JetStreamLog, LogConfig, LogError, Nats};
use turnd_store::log::{CommitLog, Opened};
use turnd_store::StoreError;

/// Partition `p`'s settings on `replicas` servers, with timeouts for tests.
pub fn cfg(p: u32, replicas: usize) -> LogConfig {
    LogConfig {
        replicas,
        max_bytes: 64 << 20,
        ack_timeout: Duration::from_millis(1500),
        read_timeout: Duration::from_secs(20),
        ..LogConfig::new(p)
    }
}

/// [`JetStreamLog::lead`] on a blocking thread.
pub async fn lead(
    nats: &Arc<Nats>,
    cfg: &LogConfig,
    node: &str,
    applied: u64,
) -> Result<Opened<JetStreamLog>, LogError> {
    let (nats, cfg, node) = (nats.clone(), cfg.clone(), node.to_string());
    tokio::task::spawn_blocking(move || JetStreamLog::lead(&nats, &cfg, &node, applied, None))
        .await
        .expect("lead's thread")
}

/// An append of `group` on a blocking thread.
pub async fn append(log: &JetStreamLog, group: Vec<Vec<u8>>) -> Result<u64, StoreError> {
    let log = log.clone();
    tokio::task::spawn_blocking(move || {
        let refs: Vec<&[u8]> = group.iter().map(Vec::as_slice).collect();
        log.append(&refs, true)
    })
    .await
    .expect("append's thread")
}

/// A record of `n` bytes saying `tag`.
pub fn record(tag: &str, n: usize) -> Vec<u8> {
    let mut r = tag.as_bytes().to_vec();
    r.resize(n.max(tag.len()), b'.');
    r
}

/// A store on partition `cfg.partition`'s log, led by `node`, in `dir`; with the
/// log's handle (to stop it, or read its status).
pub async fn open_store(
    nats: &Arc<Nats>,
    cfg: &LogConfig,
    node: &str,
    dir: &std::path::Path,
    opts: turnd_store::LoggedOptions,
) -> Result<(turnd_store::LoggedKv, turnd_store::Replayed, JetStreamLog), StoreError> {
    let (nats, cfg, node, dir) = (
        nats.clone(),
        cfg.clone(),
        node.to_string(),
        dir.to_path_buf(),
    );
    tokio::task::spawn_blocking(move || {
        let mut handle = None;
        let (kv, replayed) = turnd_store::LoggedKv::open_with_log(&dir, opts, |applied| {
            let opened = JetStreamLog::lead(&nats, &cfg, &node, applied, None)?;
            handle = Some(opened.log.clone());
            Ok(opened.boxed())
        })?;
        let log = handle.ok_or_else(|| StoreError::Write("the log was not opened".into()))?;
        Ok((kv, replayed, log))
    })
    .await
    .expect("open's thread")
}

/// Options for a store in tests: the applier every 5 ms, no delay.
pub fn store_opts() -> turnd_store::LoggedOptions {
    turnd_store::LoggedOptions {
        apply_interval: Duration::from_millis(5),
        apply_delay: Duration::ZERO,
        ..turnd_store::LoggedOptions::default()
    }
}

/// A rig of three servers on which partition `c.partition`'s stream is made: the
/// rig, a connection to server 0, and the name of the server leading the stream.
pub async fn three_with_stream(c: &LogConfig) -> (Rig, Arc<Nats>, String) {
    let rig = Rig::start(3).await.expect("rig");
    let probe = rig.connect_to(0, "probe").await.expect("connect");
    drop(lead(&probe, c, "setup", 0).await.expect("make the stream"));
    let stream = turnd_cluster::log::stream_name(c.partition);
    let leader = Rig::stream_leader(&probe, &stream)
        .await
        .expect("the stream has a leader");
    (rig, probe, leader)
}

/// `nats` holding a connection to each of `rig`'s servers, once the one to `server`
/// is up (waited for, at most 5 s): that connection.
pub async fn held_to(rig: &Rig, nats: &Nats, name: &str, server: &str) -> async_nats::Client {
    nats.connect_each(&rig.urls(), name)
        .await
        .expect("connect each");
    for _ in 0..100 {
        if let Some(c) = nats.on_server(server) {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no connection up to {server} within 5 s");
}
