//! Helpers the cluster's tests share: a log's settings with short timeouts, and
//! the log's blocking calls run off the test's runtime (as the store's threads
//! run them).
#![allow(dead_code, reason = "each test binary uses some of them")]

use std::sync::Arc;
use std::time::Duration;

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
