//! Who is in the cluster now: each node renews its own key in the `turnd_nodes`
//! bucket every third of the lease, saying until when (wall-clock ms) it counts
//! itself alive, where its WebSocket and admin listeners are, and whether it is
//! draining. The partitions' placement is computed from the live members; like
//! the lease, membership only decides who tries to lead, never what counts.

use std::sync::Arc;

use async_nats::jetstream::kv;
use serde::{Deserialize, Serialize};

use crate::{LogError, Nats};

/// The bucket of members.
pub const NODES_BUCKET: &str = "turnd_nodes";

/// What a node's key holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub node: String,
    /// Wall-clock time (Unix ms) until which the node counts itself alive.
    pub until_ms: u64,
    /// Its protocol endpoint (`ws://HOST:PORT/v1`).
    #[serde(default)]
    pub ws: String,
    /// Its admin endpoint (`http://HOST:PORT`).
    #[serde(default)]
    pub admin: String,
    /// It is handing its partitions over before it stops: no partition is placed
    /// on it.
    #[serde(default)]
    pub draining: bool,
}

/// The members bucket.
#[derive(Clone)]
pub struct Members {
    nats: Arc<Nats>,
    kv: kv::Store,
}

impl Members {
    /// Bind the bucket, making it (on `replicas` servers) when there is none.
    pub async fn open(nats: &Arc<Nats>, replicas: usize) -> Result<Members, LogError> {
        Ok(Members {
            nats: nats.clone(),
            kv: nats.bucket(NODES_BUCKET, replicas).await?,
        })
    }

    /// Write `m` as its node's entry.
    pub async fn put(&self, m: &Member) -> Result<(), LogError> {
        let value =
            serde_json::to_vec(m).map_err(|e| LogError::Config(format!("encode a member: {e}")))?;
        self.nats
            .control("write a member", self.kv.put(m.node.as_str(), value.into()))
            .await?
            .map(|_| ())
            .map_err(|e| LogError::nats("write a member", e))
    }

    /// Remove `node`'s entry (a clean stop).
    pub async fn remove(&self, node: &str) -> Result<(), LogError> {
        self.nats
            .control("remove a member", self.kv.delete(node))
            .await?
            .map_err(|e| LogError::nats("remove a member", e))
    }

    /// [`Members::all`] within the control bound: a node's loop goes on with the
    /// members it read last rather than wait.
    pub async fn all_bounded(&self) -> Result<Vec<Member>, LogError> {
        self.nats.control("list the members", self.all()).await?
    }

    /// Every entry, live or not, in node order.
    pub async fn all(&self) -> Result<Vec<Member>, LogError> {
        let names = self.nats.bucket_keys(NODES_BUCKET, ">").await?;
        let mut out = Vec::with_capacity(names.len());
        for n in names {
            let Some(e) = self
                .kv
                .entry(n.as_str())
                .await
                .map_err(|e| LogError::nats("read a member", e))?
            else {
                continue;
            };
            if e.operation != kv::Operation::Put {
                continue;
            }
            match serde_json::from_slice::<Member>(&e.value) {
                Ok(m) => out.push(m),
                Err(err) => tracing::warn!("member {n}: unreadable entry: {err}"),
            }
        }
        Ok(out)
    }
}

/// The ids of the members alive at `now_ms` that take partitions (not draining).
pub fn placeable(members: &[Member], now_ms: u64) -> Vec<String> {
    members
        .iter()
        .filter(|m| m.until_ms > now_ms && !m.draining)
        .map(|m| m.node.clone())
        .collect()
}

/// Wall-clock now in Unix ms.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(node: &str, until_ms: u64, draining: bool) -> Member {
        Member {
            node: node.into(),
            until_ms,
            ws: String::new(),
            admin: String::new(),
            draining,
        }
    }

    #[test]
    fn only_live_members_that_are_not_draining_take_partitions() {
        let ms = [m("a", 100, false), m("b", 50, false), m("c", 200, true)];
        assert_eq!(placeable(&ms, 60), vec!["a".to_string()]);
        assert_eq!(placeable(&ms, 10), vec!["a".to_string(), "b".to_string()]);
        assert!(placeable(&ms, 100).is_empty());
    }
}
