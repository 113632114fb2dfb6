//! Checkpoints on their way between nodes: the JetStream object store
//! `turnd_checkpoints` (on `replicas` servers), where a partition's leader puts a
//! checkpoint of its store for a node that asked for one, under
//! `p<p>.<node>`, and that node reads it back and deletes it. The object store cuts
//! it in chunks and checks its SHA-256 digest as it is read, so a checkpoint of any
//! size crosses NATS whatever its `max_payload`, and arrives whole or not at all.

use std::path::Path;
use std::sync::Arc;

use async_nats::jetstream::object_store::{self, ObjectStore};
use tokio::io::AsyncWriteExt;

use crate::error::LogError;
use crate::nats::Nats;

/// The object store of checkpoints in transit.
pub const CHECKPOINTS_BUCKET: &str = "turnd_checkpoints";

/// The name of the checkpoint of partition `p` made for `node`.
pub fn name(p: u32, node: &str) -> String {
    format!("p{p}.{node}")
}

/// The checkpoints bucket.
#[derive(Clone)]
pub struct Checkpoints {
    store: ObjectStore,
}

impl Checkpoints {
    /// Bind the bucket, making it (file storage on `replicas` servers) when there is
    /// none.
    pub async fn open(nats: &Arc<Nats>, replicas: usize) -> Result<Checkpoints, LogError> {
        let js = nats.jetstream();
        if let Ok(store) = js.get_object_store(CHECKPOINTS_BUCKET).await {
            return Ok(Checkpoints { store });
        }
        let store = js
            .create_object_store(object_store::Config {
                bucket: CHECKPOINTS_BUCKET.into(),
                description: Some("turnd: checkpoints of partitions' stores in transit".into()),
                num_replicas: replicas,
                storage: async_nats::jetstream::stream::StorageType::File,
                ..Default::default()
            })
            .await
            .map_err(|e| LogError::nats("make the checkpoints bucket", e))?;
        Ok(Checkpoints { store })
    }

    /// Put the file at `path` under `name`; its size.
    pub async fn put(&self, name: &str, path: &Path) -> Result<u64, LogError> {
        let mut file = tokio::fs::File::open(path)
            .await
            .map_err(|e| LogError::Config(format!("open {path:?}: {e}")))?;
        let info = self
            .store
            .put(name, &mut file)
            .await
            .map_err(|e| LogError::nats("put a checkpoint", e))?;
        Ok(info.size as u64)
    }

    /// Read `name` into a new file at `path`; its size. Fails if what was
    /// read does not match the digest it was put with.
    pub async fn get(&self, name: &str, path: &Path) -> Result<u64, LogError> {
        let mut object = self
            .store
            .get(name)
            .await
            .map_err(|e| LogError::nats("get a checkpoint", e))?;
        let mut file = tokio::fs::File::create(path)
            .await
            .map_err(|e| LogError::Config(format!("create {path:?}: {e}")))?;
        let size = tokio::io::copy(&mut object, &mut file)
            .await
            .map_err(|e| LogError::nats("read a checkpoint", e))?;
        file.flush()
            .await
            .map_err(|e| LogError::Config(format!("write {path:?}: {e}")))?;
        Ok(size)
    }

    /// Delete `name` (a checkpoint read, or given up).
    pub async fn delete(&self, name: &str) -> Result<(), LogError> {
        self.store
            .delete(name)
            .await
            .map_err(|e| LogError::nats("delete a checkpoint", e))
    }
}
