//! Each node's durable applied mark per partition, in the KV bucket `turnd_marks`
//! (key `p<p>.<node>`, the mark as decimal text), so that a leader trims its stream
//! only below what every live replica holds.
//!
//! A node writes its mark after its store made it durable (a standby after each
//! apply, a leader after its store's marks). Whether a node is live is judged by
//! the reader's own monotonic clock, not by timestamps from another machine: a
//! node counts as live until its key's revision has not moved for the replica
//! timeout ([`Liveness`]), and every node seen counts as live for that long from
//! the first time this reader saw it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::kv;

use crate::error::LogError;
use crate::nats::Nats;

/// The bucket of applied marks.
pub const MARKS_BUCKET: &str = "turnd_marks";

/// One node's mark as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    pub node: String,
    pub mark: u64,
    pub revision: u64,
}

/// The marks bucket.
#[derive(Clone)]
pub struct Marks {
    nats: Arc<Nats>,
    kv: kv::Store,
    required: Option<Required>,
}

/// The nodes whose marks of a partition a trim must wait for even before they wrote
/// one (a standby that has only started).
pub type Required = Arc<dyn Fn(u32) -> Vec<String> + Send + Sync>;

fn key(p: u32, node: &str) -> String {
    format!("p{p}.{node}")
}

impl Marks {
    /// Bind the bucket, making it (on `replicas` servers, one value per key) when
    /// there is none.
    pub async fn open(nats: &Arc<Nats>, replicas: usize) -> Result<Marks, LogError> {
        let kv = nats.bucket(MARKS_BUCKET, replicas).await?;
        Ok(Marks {
            nats: nats.clone(),
            kv,
            required: None,
        })
    }

    /// These marks, with the nodes whose marks a trim of partition `p` waits for
    /// although they have written none yet: `required(p)`.
    pub fn requiring(mut self, required: Required) -> Marks {
        self.required = Some(required);
        self
    }

    /// Whether a node that `required` names for partition `p` (other than `me`) has
    /// no mark among `seen`: then nothing may be trimmed.
    pub fn missing_required(&self, p: u32, me: &str, seen: &[Mark]) -> bool {
        self.required.as_ref().is_some_and(|req| {
            req(p)
                .iter()
                .any(|n| n != me && !seen.iter().any(|m| &m.node == n))
        })
    }

    /// Record `node`'s durable applied mark of partition `p`; its revision.
    pub async fn put(&self, p: u32, node: &str, mark: u64) -> Result<u64, LogError> {
        crate::log::check_node(node)?;
        self.kv
            .put(key(p, node), mark.to_string().into())
            .await
            .map_err(|e| LogError::nats("put a mark", e))
    }

    /// Every node's mark of partition `p`.
    pub async fn all(&self, p: u32) -> Result<Vec<Mark>, LogError> {
        let keys = self
            .nats
            .bucket_keys(MARKS_BUCKET, &format!("p{p}.*"))
            .await?;
        let mut out = Vec::new();
        for k in keys {
            let Some(e) = self
                .kv
                .entry(k.clone())
                .await
                .map_err(|e| LogError::nats("read a mark", e))?
            else {
                continue;
            };
            if e.operation != kv::Operation::Put {
                continue;
            }
            let mark = std::str::from_utf8(&e.value)
                .ok()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| LogError::Corrupt(format!("mark {k} is not a number")))?;
            let node = k.split_once('.').map_or(k.as_str(), |(_, n)| n).to_string();
            out.push(Mark {
                node,
                mark,
                revision: e.revision,
            });
        }
        Ok(out)
    }
}

/// When a reader of marks last saw each node's revision move.
#[derive(Debug, Default)]
pub struct Liveness {
    seen: HashMap<String, (u64, Instant)>,
}

impl Liveness {
    /// The marks of `marks` whose nodes count as live at `now` (but `me`'s: the
    /// caller's own mark is its own to give): a node's revision moved within
    /// `timeout`, by this reader's clock.
    pub fn live(&mut self, marks: &[Mark], me: &str, now: Instant, timeout: Duration) -> Vec<u64> {
        let mut out = Vec::new();
        for m in marks.iter().filter(|m| m.node != me) {
            let at = match self.seen.get(&m.node) {
                Some((rev, at)) if *rev == m.revision => *at,
                _ => {
                    self.seen.insert(m.node.clone(), (m.revision, now));
                    now
                }
            };
            if now.saturating_duration_since(at) < timeout {
                out.push(m.mark);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(node: &str, mark: u64, revision: u64) -> Mark {
        Mark {
            node: node.into(),
            mark,
            revision,
        }
    }

    #[test]
    fn a_node_is_waited_for_until_its_mark_stood_still_for_the_timeout() {
        let mut l = Liveness::default();
        let t0 = Instant::now();
        let to = Duration::from_secs(10);
        let marks = [mark("a", 5, 1), mark("b", 9, 1), mark("me", 2, 1)];
        assert_eq!(l.live(&marks, "me", t0, to), vec![5, 9]);
        // b moves on, a stands still.
        let later = [mark("a", 5, 1), mark("b", 12, 2)];
        assert_eq!(
            l.live(&later, "me", t0 + Duration::from_secs(9), to),
            vec![5, 12]
        );
        assert_eq!(
            l.live(&later, "me", t0 + Duration::from_secs(11), to),
            vec![12]
        );
        // a comes back.
        let back = [mark("a", 6, 3), mark("b", 12, 2)];
        assert_eq!(
            l.live(&back, "me", t0 + Duration::from_secs(12), to),
            vec![6, 12]
        );
    }
}
