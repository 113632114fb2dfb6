//! The leader's side of a forwarded request. A node subscribes once, for its whole
//! life, to `turnd.p.*.rpc.<node>` (in a queue group of its own, so that a request
//! reaches one engine even if a node subscribed twice): a request for partition `p`
//! is run through the router on `p`'s engine as the caller that sent it, and
//! answered with the answer, a coded error, or "in doubt"; a relayed `watch` starts
//! a feed ([`super::feed`]) and is answered with where it starts. A request for a
//! partition this node does not lead (handed over, never taken, or its lease run
//! out by this node's own clock: another node may lead already, and this engine's
//! reads would miss its writes) is not run: it is answered "not leading", and the
//! sender asks the lease's holder.
//!
//! The subscription outlives every hand-over on purpose. One that ends loses the
//! requests NATS delivers to it in that instant: async-nats (0.52) removes a
//! drained subscription as soon as its unsubscribe is written, not once the server
//! has processed it, and drops what arrives for it after. Their senders would wait
//! out the whole forward timeout, for a write in doubt. Kept, the subscription
//! answers every request it gets.
//! A hand-over closes the partition's intake ([`Led::intake`]) and waits for the
//! requests it started ([`Led::inflight`]) before the log stops.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
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

/// The subject of partition `p`'s requests to `node`, its leader: a request goes
/// to the leader the sender knows, never to whichever node still listens (a leader
/// paused past its lease keeps its subscriptions until it wakes).
pub(super) fn subject(p: u32, node: &str) -> String {
    format!("turnd.p.{p}.rpc.{node}")
}

/// The subject of every partition's requests to `node`.
fn subject_all(node: &str) -> String {
    format!("turnd.p.*.rpc.{node}")
}

/// The partition a forward's `subject` names.
fn partition_of(subject: &str) -> Option<u32> {
    subject
        .strip_prefix("turnd.p.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// Serve the node's forwarded requests until the node is dropped: each request for
/// a partition it leads, while its intake is open and its lease runs, as a task of
/// the partition's [`Led::inflight`]; any other is answered "not leading".
pub(super) async fn serve(node: &Arc<Node>) -> anyhow::Result<()> {
    let client = node.nats.client().clone();
    let all = subject_all(&node.id);
    let mut sub = client
        .queue_subscribe(all.clone(), format!("turnd-rpc-{}", node.id))
        .await
        .map_err(|e| anyhow::anyhow!("subscribe to {all}: {e}"))?;
    let lease = Duration::from_millis(node.cluster.lease_ms);
    let cfg = FeedCfg {
        capacity: usize::try_from(node.cfg.server.outbox_frames).unwrap_or(usize::MAX),
        beat: lease / 3,
        silence: lease * 3,
        running: node.feeds.clone(),
    };
    let (weak, gone) = (Arc::downgrade(node), node.gone.clone());
    tokio::spawn(async move {
        loop {
            let msg = tokio::select! {
                m = sub.next() => m,
                () = gone.cancelled() => None,
            };
            let (Some(msg), Some(node)) = (msg, weak.upgrade()) else {
                break;
            };
            let Some(reply_to) = msg.reply.clone() else {
                continue;
            };
            // Admitted under the intake's read lock: a hand-over that closed it
            // waits for every request admitted before, and none is after.
            let run = partition_of(msg.subject.as_str()).and_then(|p| node.serving(p));
            drop(node);
            let (client, cfg) = (client.clone(), cfg.clone());
            tokio::spawn(async move {
                let reply = match &run {
                    Some((led, _admitted)) => answer(&client, &led.engine, &msg.payload, cfg).await,
                    None => ForwardReply::NotLeading,
                };
                match serde_json::to_vec(&reply) {
                    Ok(body) => {
                        if let Err(e) = client.publish(reply_to, body.into()).await {
                            tracing::debug!("cluster: reply to a forward: {e}");
                        }
                    }
                    Err(e) => tracing::warn!("cluster: encode a forward's reply: {e}"),
                }
                // The place among the partition's requests is held until here.
                drop(run);
            });
        }
    });
    Ok(())
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
