//! The leader's side of a forwarded request: partition `p`'s leader subscribes to
//! `turnd.p.<p>.rpc.<node>` (in the queue group of the partition, so that a request
//! reaches one engine even if a node subscribed twice), runs
//! each request through the router on its engine as the caller that sent it, and
//! replies with the answer, a coded error, or "in doubt". A relayed `watch` starts
//! a feed ([`super::feed`]) and is answered with where it starts. A hand-over stops
//! its intake gracefully: the subscription is drained (the requests NATS already
//! delivered are still run and answered), and every request in progress is tracked
//! so that the hand-over can wait for it before the log stops. A request that
//! arrives once this node's lease has run out by its own clock is not run: another
//! node may lead already, and this engine's reads would miss its writes. It is
//! answered "not leading", and the sender asks the lease's holder.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use turnd_cluster::lease::Lease;
use turnd_engine::{Caller, Engine};
use turnd_proto::{ErrorBody, ErrorCode, Op, Role};

use super::feed::{self, FeedCfg, RelayTo};
use super::Node;
use crate::router::{self, Answer};

/// A request carried to a partition's leader.
#[derive(Serialize, Deserialize)]
pub(super) struct Forwarded {
    pub role: Role,
    pub worker_id: Option<String>,
    pub op: String,
    /// The request's `args`, as JSON text.
    pub args: String,
    /// A `watch`: where its frames go.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay: Option<RelayTo>,
    /// A `turn.submit` with settings of the turn's own (the iii endpoint's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<super::iii::TurnSettings>,
}

/// The leader's reply.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum ForwardReply {
    /// The op's answer as JSON text.
    Ok(String),
    Error(ErrorBody),
    /// The request's write is in doubt: the forwarding node must not answer it.
    InDoubt(String),
    /// This node's lease had run out: nothing was run; ask the lease's holder.
    NotLeading,
}

/// What serves a partition's forwarded requests: its engine while `lease` runs,
/// until `stop`, each request a task of `inflight`.
pub(super) struct Serving {
    pub engine: Engine,
    pub lease: Arc<parking_lot::Mutex<Lease>>,
    pub stop: CancellationToken,
    pub inflight: TaskTracker,
}

/// The subject of partition `p`'s requests to `node`, its leader: a request goes
/// to the leader the sender knows, never to whichever node still listens (a leader
/// paused past its lease keeps its subscriptions until it wakes).
pub(super) fn subject(p: u32, node: &str) -> String {
    format!("turnd.p.{p}.rpc.{node}")
}

/// Serve partition `p`'s forwarded requests on `s.engine` until `s.stop` (then the
/// subscription is drained: what NATS delivered already is still served) or until
/// aborted. Each request runs as a task of `s.inflight`.
pub(super) async fn serve(
    node: &Arc<Node>,
    p: u32,
    s: Serving,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let Serving {
        engine,
        lease: held,
        stop,
        inflight,
    } = s;
    let client = node.nats.client().clone();
    let lease = Duration::from_millis(node.cluster.lease_ms);
    let cfg = FeedCfg {
        capacity: usize::try_from(node.cfg.server.outbox_frames).unwrap_or(usize::MAX),
        beat: lease / 3,
        silence: lease * 3,
        running: node.feeds.clone(),
    };
    let mut sub = client
        .queue_subscribe(subject(p, &node.id), format!("turnd-p{p}"))
        .await
        .map_err(|e| anyhow::anyhow!("subscribe to {}: {e}", subject(p, &node.id)))?;
    Ok(tokio::spawn(async move {
        let mut draining = false;
        loop {
            let next = tokio::select! {
                m = sub.next() => m,
                () = stop.cancelled(), if !draining => {
                    draining = true;
                    if let Err(e) = sub.drain().await {
                        tracing::debug!(partition = p, "cluster: drain the forwards' subscription: {e}");
                        break;
                    }
                    continue;
                }
            };
            let Some(msg) = next else { break };
            let Some(reply_to) = msg.reply.clone() else {
                continue;
            };
            let (client, engine, cfg) = (client.clone(), engine.clone(), cfg.clone());
            let held = held.clone();
            inflight.spawn(async move {
                let reply = if super::lease_runs(&held) {
                    answer(&client, &engine, &msg.payload, cfg).await
                } else {
                    ForwardReply::NotLeading
                };
                match serde_json::to_vec(&reply) {
                    Ok(body) => {
                        if let Err(e) = client.publish(reply_to, body.into()).await {
                            tracing::debug!("cluster: reply to a forward: {e}");
                        }
                    }
                    Err(e) => tracing::warn!("cluster: encode a forward's reply: {e}"),
                }
            });
        }
    }))
}

/// Run one forwarded request.
async fn answer(
    client: &async_nats::Client,
    engine: &Engine,
    payload: &[u8],
    cfg: FeedCfg,
) -> ForwardReply {
    let f: Forwarded = match serde_json::from_slice(payload) {
        Ok(f) => f,
        Err(e) => {
            return ForwardReply::Error(ErrorBody::new(
                ErrorCode::BadRequest,
                format!("unreadable forwarded request: {e}"),
            ))
        }
    };
    let caller = Caller {
        role: f.role,
        worker_id: f.worker_id,
    };
    let op = match router::admit(&caller, &f.op) {
        Ok(op) => op,
        Err(e) => return ForwardReply::Error(e),
    };
    if let Some(to) = f.relay {
        if op != Op::Watch {
            return ForwardReply::Error(ErrorBody::new(
                ErrorCode::BadRequest,
                format!("{} cannot be relayed", op.name()),
            ));
        }
        return feed::open(client, engine, &f.args, to, cfg).await;
    }
    let ran = match f.settings {
        Some(s) if op == Op::TurnSubmit => super::iii::submit(engine, &f.args, s).await,
        Some(_) => Err(ErrorBody::new(
            ErrorCode::BadRequest,
            format!("{} takes no turn settings", op.name()),
        )),
        None => router::run(engine, &caller, op, &f.args, None).await,
    };
    match ran {
        Ok(Answer::Reply(text)) => ForwardReply::Ok(text),
        Ok(Answer::Queued) => ForwardReply::Error(ErrorBody::new(
            ErrorCode::Internal,
            "a forwarded request cannot be queued on a connection",
        )),
        Err(e) if e.in_doubt => ForwardReply::InDoubt(e.message),
        Err(e) => ForwardReply::Error(e),
    }
}
