//! Copying a partition's store from its leader, for a node whose store is behind
//! the partition's stream (trimmed past its applied mark while the node was away):
//! such a node can neither lead the partition nor keep a standby of it by reading
//! the stream, so it starts again from the leader's store.
//!
//! The node asks the leader on the leader's `turnd.ckpt.<node>` (`{partition,
//! node}`). The leader writes a checkpoint of its store at its applied mark
//! (`LoggedKv::write_checkpoint`) to a file in its data directory, records that mark
//! as the asking node's in `turnd_marks` (so its trims keep the records after it
//! while the node copies, as for any live standby), puts the file in the object
//! store `turnd_checkpoints` as `p<p>.<node>`, and replies with the mark. The node
//! reads it back (its digest checked), puts it in place of its store of the
//! partition (`install_checkpoint`: made beside it, synced, renamed), deletes the
//! object, records its mark, and keeps a standby from there, which reads the stream
//! from the mark on. The validity rule needs nothing from the checkpoint: a reader
//! starts at the stream's first message held, which a trim left at a valid anchor.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use turnd_cluster::checkpoint;
use turnd_store::logged::{install_checkpoint, CheckpointInfo};

use super::Node;

/// A node's request for a checkpoint of a partition's store.
#[derive(Serialize, Deserialize)]
struct Ask {
    partition: u32,
    node: String,
}

/// The leader's reply.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Reply {
    /// The checkpoint is in the bucket under the asking node's name.
    Ok {
        mark: u64,
        entries: u64,
        bytes: u64,
    },
    Error(String),
}

/// How long a node waits for the leader to write and put a checkpoint.
const ASK_TIMEOUT: Duration = Duration::from_secs(300);

fn subject(node: &str) -> String {
    format!("turnd.ckpt.{node}")
}

/// Serve checkpoints of the partitions this node leads, until `node.stop`.
pub(super) async fn serve(node: &Arc<Node>) -> anyhow::Result<()> {
    let client = node.nats.client().clone();
    let mut sub = client
        .subscribe(subject(&node.id))
        .await
        .map_err(|e| anyhow::anyhow!("subscribe to {}: {e}", subject(&node.id)))?;
    let weak = Arc::downgrade(node);
    let stop = node.stop.clone();
    tokio::spawn(async move {
        loop {
            let msg = tokio::select! {
                m = sub.next() => m,
                () = stop.cancelled() => None,
            };
            let (Some(msg), Some(node)) = (msg, weak.upgrade()) else {
                break;
            };
            let Some(reply_to) = msg.reply.clone() else {
                continue;
            };
            let client = client.clone();
            tokio::spawn(async move {
                let reply = make(&node, &msg.payload).await.unwrap_or_else(|e| {
                    tracing::warn!("cluster: a checkpoint asked for: {e:#}");
                    Reply::Error(format!("{e:#}"))
                });
                match serde_json::to_vec(&reply) {
                    Ok(body) => {
                        if let Err(e) = client.publish(reply_to, body.into()).await {
                            tracing::debug!("cluster: reply to a checkpoint's request: {e}");
                        }
                    }
                    Err(e) => tracing::warn!("cluster: encode a checkpoint's reply: {e}"),
                }
            });
        }
    });
    Ok(())
}

/// Write a checkpoint of the partition asked for and put it in the bucket.
async fn make(node: &Arc<Node>, payload: &[u8]) -> anyhow::Result<Reply> {
    let ask: Ask = serde_json::from_slice(payload).context("an unreadable request")?;
    let p = ask.partition;
    let led = node
        .led(p)
        .with_context(|| format!("{} does not lead partition {p}", node.id))?;
    let file = tempfile::NamedTempFile::new_in(&node.cfg.storage.data_dir)
        .context("a file for the checkpoint")?;
    let (file, info) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let mut out = file.reopen().context("open the checkpoint's file")?;
        let info = led.kv.write_checkpoint(&mut out)?;
        Ok((file, info))
    })
    .await
    .context("the checkpoint's thread")??;
    node.marks
        .put(p, &ask.node, info.mark)
        .await
        .context("hold trims at the checkpoint's mark")?;
    let bytes = node
        .checkpoints
        .put(&checkpoint::name(p, &ask.node), file.path())
        .await?;
    node.counters.checkpoints_served.inc();
    tracing::info!(
        partition = p,
        node = ask.node,
        mark = info.mark,
        entries = info.entries,
        bytes,
        "cluster: put a checkpoint of the partition's store"
    );
    Ok(Reply::Ok {
        mark: info.mark,
        entries: info.entries,
        bytes,
    })
}

/// Copy partition `p`'s store from its leader into this node's directory of it
/// (which no store or standby may have open).
pub(super) async fn copy(node: &Arc<Node>, p: u32) -> anyhow::Result<CheckpointInfo> {
    let leader = node
        .leaders
        .read()
        .get(&p)
        .cloned()
        .filter(|l| *l != node.id)
        .with_context(|| format!("no other node leads partition {p} to copy its store from"))?;
    let ask = serde_json::to_vec(&Ask {
        partition: p,
        node: node.id.clone(),
    })?;
    let request = async_nats::Request::new()
        .payload(ask.into())
        .timeout(Some(ASK_TIMEOUT));
    let msg = node
        .nats
        .client()
        .send_request(subject(&leader), request)
        .await
        .with_context(|| format!("ask {leader} for a checkpoint"))?;
    let (mark, bytes) = match serde_json::from_slice(&msg.payload)? {
        Reply::Ok { mark, bytes, .. } => (mark, bytes),
        Reply::Error(e) => anyhow::bail!("{leader} made no checkpoint: {e}"),
    };
    let name = checkpoint::name(p, &node.id);
    let file = tempfile::NamedTempFile::new_in(&node.cfg.storage.data_dir)
        .context("a file for the checkpoint")?;
    let got = node.checkpoints.get(&name, file.path()).await?;
    anyhow::ensure!(got == bytes, "read {got} bytes of a checkpoint of {bytes}");
    let dir = node.dir(p);
    let opts = node.store_options()?;
    let info = tokio::task::spawn_blocking(move || -> anyhow::Result<CheckpointInfo> {
        let mut input = file.reopen().context("open the checkpoint's file")?;
        Ok(install_checkpoint(&dir, &mut input, opts)?)
    })
    .await
    .context("the checkpoint's thread")??;
    anyhow::ensure!(
        info.mark == mark,
        "the checkpoint holds mark {} not {mark}",
        info.mark
    );
    if let Err(e) = node.checkpoints.delete(&name).await {
        tracing::warn!(partition = p, "cluster: delete a copied checkpoint: {e}");
    }
    node.marks.put(p, &node.id, info.mark).await?;
    node.counters.checkpoints_copied.inc();
    tracing::info!(
        partition = p,
        from = leader,
        mark = info.mark,
        entries = info.entries,
        bytes,
        "cluster: copied the partition's store from its leader"
    );
    Ok(info)
}
