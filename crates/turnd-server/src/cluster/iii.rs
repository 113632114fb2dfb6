//! What the iii endpoint needs of a node ([`turnd_iii::Daemon`]): an iii worker's
//! hello attaches to the node's worker registry and is reconciled by each engine it
//! leads, as a protocol-v1 worker's is; a turn with settings of its own (a queue's
//! message, a call's dispatch bound) runs on its partition's engine, here or on the
//! leader, which gets the settings with the forwarded `turn.submit`; `sessions.list`
//! (for `topic_stats`) is gathered from every partition; and the endpoint's records
//! (the reattach secret, the queues) are in the bucket every node shares
//! ([`turnd_cluster::records`]), so that a token one node signed verifies on any
//! other and a queue defined through one node is seen by all.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use turnd_cluster::records::Records;
use turnd_engine::registry::Supply;
use turnd_engine::{Caller, Engine, Outbox, SubmitOptions, WorkerCaps};
use turnd_proto::{
    session_partition, ErrorBody, HelloArgs, Op, Reconciled, Role, SessionsListArgs,
    SessionsListOk, SubmitArgs, SubmitOk, Worker,
};
use turnd_store::TurnDispatch;

use super::rpc::Forwarded;
use super::Node;
use crate::router::{decode, encode, Answer};

/// A turn's own settings ([`SubmitOptions`]) as a forwarded `turn.submit` carries
/// them to the partition's leader.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct TurnSettings {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch: Option<TurnDispatch>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_backoff_ms: Option<u64>,
}

impl From<SubmitOptions> for TurnSettings {
    fn from(o: SubmitOptions) -> TurnSettings {
        TurnSettings {
            dispatch: o.dispatch,
            retry_backoff_ms: o.retry_backoff_ms,
        }
    }
}

impl From<TurnSettings> for SubmitOptions {
    fn from(s: TurnSettings) -> SubmitOptions {
        SubmitOptions {
            dispatch: s.dispatch,
            retry_backoff_ms: s.retry_backoff_ms,
        }
    }
}

/// The leader's side of a forwarded `turn.submit` with settings.
pub(super) async fn submit(
    engine: &Engine,
    args: &str,
    s: TurnSettings,
) -> Result<Answer, ErrorBody> {
    let ok = engine.submit_with(decode(args)?, s.into()).await?;
    encode(&ok).map(Answer::Reply)
}

/// The iii endpoint's daemon on a node. See the module documentation.
pub struct NodeIii {
    node: Arc<Node>,
    records: Records,
}

impl NodeIii {
    /// Bind the records bucket (made on `cluster.replicas` servers when there is
    /// none).
    pub async fn open(node: Arc<Node>) -> anyhow::Result<Arc<NodeIii>> {
        let records = Records::open(&node.nats, node.cluster.replicas as usize).await?;
        Ok(Arc::new(NodeIii { node, records }))
    }

    /// `turn.submit` with `opts` on the session's partition: its engine when this
    /// node leads it (and its lease runs), else forwarded to its leader.
    async fn submit_on(
        &self,
        args: SubmitArgs,
        opts: SubmitOptions,
    ) -> Result<SubmitOk, ErrorBody> {
        let node = &self.node;
        let p = session_partition(&args.session_id, node.cluster.partitions);
        if let Some((led, _admitted)) = node.serving(p) {
            let ok = led.engine.submit_with(args, opts).await?;
            return Ok(ok.map_json(|j| j.to_value()));
        }
        let f = Forwarded {
            role: Role::Client,
            worker_id: None,
            op: Op::TurnSubmit.name().to_string(),
            args: serde_json::to_string(&args).map_err(|e| {
                ErrorBody::new(
                    turnd_proto::ErrorCode::Internal,
                    format!("encode a submit: {e}"),
                )
            })?,
            relay: None,
            settings: Some(opts.into()),
        };
        node.counters.forwarded.inc();
        let text = node
            .ask_leader(p, Op::TurnSubmit, &f, super::route::FORWARD_TIMEOUT)
            .await?;
        decode(&text)
    }
}

/// The bucket's key of the endpoint's record `key`.
fn key(key: &str) -> String {
    format!("iii/{key}")
}

impl turnd_iii::Daemon for NodeIii {
    fn worker_hello<'a>(
        &'a self,
        hello: &'a HelloArgs,
        outbox: Outbox,
    ) -> BoxFuture<'a, Result<Reconciled, ErrorBody>> {
        Box::pin(
            self.node
                .worker_hello_with(hello, outbox, WorkerCaps::NO_PROBE),
        )
    }

    fn worker_disconnected<'a>(
        &'a self,
        worker_id: &'a str,
        conn_id: &'a str,
    ) -> BoxFuture<'a, ()> {
        Box::pin(self.node.worker_disconnected(worker_id, conn_id))
    }

    fn connection_closed(&self, conn_id: &str) {
        self.node.connection_closed(conn_id);
    }

    fn supply(&self, function_id: &str) -> Supply {
        self.node.workers.supply(function_id)
    }

    fn now_ms(&self) -> u64 {
        self.node.clock.now_ms()
    }

    fn reconnect_grace_ms(&self) -> u64 {
        self.node.cfg.turns.reconnect_grace_ms
    }

    fn submit(
        &self,
        args: SubmitArgs,
        opts: SubmitOptions,
    ) -> BoxFuture<'_, Result<SubmitOk, ErrorBody>> {
        Box::pin(self.submit_on(args, opts))
    }

    fn list_sessions(
        &self,
        args: SessionsListArgs,
    ) -> BoxFuture<'_, Result<SessionsListOk, ErrorBody>> {
        Box::pin(async move {
            let caller = Caller {
                role: Role::Client,
                worker_id: None,
            };
            let args = serde_json::to_string(&args).map_err(|e| {
                ErrorBody::new(
                    turnd_proto::ErrorCode::Internal,
                    format!("encode a list: {e}"),
                )
            })?;
            match self
                .node
                .run(&caller, Op::SessionsList, &args, None)
                .await?
            {
                Answer::Reply(text) => decode(&text),
                Answer::Queued => Err(ErrorBody::new(
                    turnd_proto::ErrorCode::Internal,
                    "a gathered read was queued",
                )),
            }
        })
    }

    fn workers(&self) -> Vec<Worker> {
        self.node.workers.workers()
    }

    fn record<'a>(&'a self, k: &'a str) -> BoxFuture<'a, anyhow::Result<Option<Vec<u8>>>> {
        Box::pin(async move { Ok(self.records.get(&key(k)).await?) })
    }

    fn put_record<'a>(&'a self, k: &'a str, value: Vec<u8>) -> BoxFuture<'a, anyhow::Result<()>> {
        Box::pin(async move { Ok(self.records.put(&key(k), value).await?) })
    }

    fn create_record<'a>(
        &'a self,
        k: &'a str,
        value: Vec<u8>,
    ) -> BoxFuture<'a, anyhow::Result<Vec<u8>>> {
        Box::pin(async move { Ok(self.records.create(&key(k), value).await?) })
    }
}
