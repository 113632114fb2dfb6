//! Who tries to lead a partition: a lease in the KV bucket `turnd_owners` (key
//! `p<p>`, value `{node, epoch, until_ms?}` as JSON), written by revision. It
//! decides liveness only: two nodes that both think they hold it cost a duel of
//! fences, never state, since what makes a deposed leader harmless is the validity
//! rule ([`crate::fence`]). The engine's use of it (when to renew, when to give up
//! serving) is the node's.

use std::sync::Arc;

use async_nats::jetstream::kv;
use serde::{Deserialize, Serialize};

use crate::error::LogError;
use crate::nats::Nats;

/// The bucket of partition owners.
pub const OWNERS_BUCKET: &str = "turnd_owners";

/// The owners bucket's key holding the cluster's number of partitions.
const PARTITIONS_KEY: &str = "partitions";

/// What a partition's key holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    pub node: String,
    /// The owner's epoch (its fence's sequence; 0 before it fenced).
    pub epoch: u64,
    /// Wall-clock time (Unix ms) the lease runs until, as its holder wrote it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_ms: Option<u64>,
}

/// A lease held: the owner written and the revision it was written at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub partition: u32,
    pub owner: Owner,
    pub revision: u64,
}

impl Lease {
    /// Whether the lease still runs at `now_ms` (wall clock), as its holder wrote it.
    pub fn runs_at(&self, now_ms: u64) -> bool {
        self.owner.until_ms.is_some_and(|u| u > now_ms)
    }
}

/// The owners bucket.
#[derive(Clone)]
pub struct Owners {
    nats: Arc<Nats>,
    kv: kv::Store,
}

fn key(p: u32) -> String {
    format!("p{p}")
}

fn encode(o: &Owner) -> Result<bytes::Bytes, LogError> {
    serde_json::to_vec(o)
        .map(bytes::Bytes::from)
        .map_err(|e| LogError::Config(format!("encode an owner: {e}")))
}

impl Owners {
    /// Bind the bucket, making it (on `replicas` servers) when there is none.
    pub async fn open(nats: &Arc<Nats>, replicas: usize) -> Result<Owners, LogError> {
        let kv = nats.bucket(OWNERS_BUCKET, replicas).await?;
        Ok(Owners {
            nats: nats.clone(),
            kv,
        })
    }

    /// The cluster's number of partitions: `wanted` when this is the first node of
    /// the cluster (it is stored then), else the number stored when the cluster
    /// was created, whatever `wanted` is.
    pub async fn partitions(&self, wanted: u32) -> Result<u32, LogError> {
        match self
            .kv
            .create(PARTITIONS_KEY, wanted.to_string().into())
            .await
        {
            Ok(_) => return Ok(wanted),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
            Err(e) => return Err(LogError::nats("store the partitions", e)),
        }
        let e = self
            .kv
            .get(PARTITIONS_KEY)
            .await
            .map_err(|e| LogError::nats("read the partitions", e))?
            .ok_or_else(|| LogError::Corrupt("the cluster's partitions vanished".into()))?;
        std::str::from_utf8(&e)
            .ok()
            .and_then(|t| t.parse().ok())
            .ok_or_else(|| LogError::Corrupt("the cluster's partitions are unreadable".into()))
    }

    /// Partition `p`'s owner now, with its revision (None: nobody holds it, or it
    /// was released).
    pub async fn get(&self, p: u32) -> Result<Option<Lease>, LogError> {
        let Some(e) = self
            .nats
            .control("read an owner", self.kv.entry(key(p)))
            .await?
            .map_err(|e| LogError::nats("read an owner", e))?
        else {
            return Ok(None);
        };
        if e.operation != kv::Operation::Put {
            return Ok(None);
        }
        let owner: Owner = serde_json::from_slice(&e.value)
            .map_err(|err| LogError::Corrupt(format!("owner of p{p}: {err}")))?;
        Ok(Some(Lease {
            partition: p,
            owner,
            revision: e.revision,
        }))
    }

    /// Take partition `p` for `owner`: create its key, or, when it holds a lease
    /// whose `until_ms` is before `now_ms`, replace it by revision. None when
    /// another holds it (or won a race for it).
    pub async fn acquire(
        &self,
        p: u32,
        owner: Owner,
        now_ms: u64,
    ) -> Result<Option<Lease>, LogError> {
        let value = encode(&owner)?;
        let created = self
            .nats
            .control("create an owner", self.kv.create(key(p), value.clone()))
            .await?;
        match created {
            Ok(revision) => {
                return Ok(Some(Lease {
                    partition: p,
                    owner,
                    revision,
                }))
            }
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
            Err(e) => return Err(LogError::nats("create an owner", e)),
        }
        let Some(held) = self.get(p).await? else {
            return Ok(None);
        };
        // This node's own key (a create or take of it whose answer was lost, and
        // that landed) is this node's to take again at once.
        if held.owner.node != owner.node && held.owner.until_ms.is_none_or(|u| u > now_ms) {
            return Ok(None);
        }
        self.take(p, owner, held.revision).await
    }

    /// Replace partition `p`'s owner by `owner` if its key is still at `revision`
    /// (a lease its holder stopped renewing, as the caller judged by its own clock).
    pub async fn take(
        &self,
        p: u32,
        owner: Owner,
        revision: u64,
    ) -> Result<Option<Lease>, LogError> {
        let updated = self
            .nats
            .control(
                "take an owner",
                self.kv.update(key(p), encode(&owner)?, revision),
            )
            .await?;
        match updated {
            Ok(revision) => Ok(Some(Lease {
                partition: p,
                owner,
                revision,
            })),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(None),
            Err(e) => Err(LogError::nats("take an owner", e)),
        }
    }

    /// Renew `lease` (its epoch or `until_ms` changed as the caller wants): None
    /// when its key moved since (another took it).
    ///
    /// A key that moved may have moved by this holder's own renewal: one whose
    /// answer was lost (it was not answered within the control bound) but that
    /// landed. The key then still names this node in the lease's epoch (or the
    /// epoch being written), and is renewed from where it is.
    pub async fn renew(&self, lease: &Lease, owner: Owner) -> Result<Option<Lease>, LogError> {
        let p = lease.partition;
        if let Some(l) = self.take(p, owner.clone(), lease.revision).await? {
            return Ok(Some(l));
        }
        match self.get(p).await? {
            Some(now)
                if now.owner.node == owner.node
                    && (now.owner.epoch == lease.owner.epoch || now.owner.epoch == owner.epoch) =>
            {
                self.take(p, owner, now.revision).await
            }
            _ => Ok(None),
        }
    }

    /// Hand partition `lease.partition` over at once (a clean stop): its key is
    /// deleted if it is still at the lease's revision. Whether it was.
    pub async fn release(&self, lease: &Lease) -> Result<bool, LogError> {
        let deleted = self
            .nats
            .control(
                "release an owner",
                self.kv
                    .delete_expect_revision(key(lease.partition), Some(lease.revision)),
            )
            .await?;
        match deleted {
            Ok(()) => Ok(true),
            // The delete's error does not always say why: the key moved, or not.
            Err(e) => match self.get(lease.partition).await? {
                Some(now) if now.revision == lease.revision => {
                    Err(LogError::nats("release an owner", e))
                }
                _ => Ok(false),
            },
        }
    }
}
