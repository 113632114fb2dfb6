//! What the iii endpoint needs of the daemon beyond protocol v1 ops ([`crate::Router`]):
//! its worker attach and disconnect, who serves a function, a turn admitted with
//! settings of its own, the cluster-wide reads of `topic_stats`, and the endpoint's
//! own records (the reattach secret, the queue definitions).
//!
//! A daemon on its own is one [`Engine`] (implemented here: records in its store,
//! under keys `Xiii/...`). A node of a cluster implements it in `turnd-server` on
//! its shared worker registry, the engines of the partitions it leads (or their
//! leaders), and a replicated NATS KV bucket for the records, so that every node
//! signs with the same secret and sees the same queues.

use futures_util::future::BoxFuture;
use turnd_engine::registry::Supply;
use turnd_engine::{Engine, Outbox, SubmitOptions, WorkerCaps};
use turnd_proto::{
    ErrorBody, HelloArgs, Reconciled, SessionsListArgs, SessionsListOk, SubmitArgs, SubmitOk,
    Worker,
};
use turnd_store::Batch;

/// See the module documentation. Record keys are the endpoint's own (`secret`,
/// `queue/<name>`); each implementation maps them into its storage.
pub trait Daemon: Send + Sync {
    /// Attach an iii worker's connection (`WorkerCaps::NO_PROBE`) and reconcile its
    /// live invocations.
    fn worker_hello<'a>(
        &'a self,
        hello: &'a HelloArgs,
        outbox: Outbox,
    ) -> BoxFuture<'a, Result<Reconciled, ErrorBody>>;

    /// A worker's connection ended.
    fn worker_disconnected<'a>(&'a self, worker_id: &'a str, conn_id: &'a str)
        -> BoxFuture<'a, ()>;

    /// A connection ended: whatever it held ends.
    fn connection_closed(&self, conn_id: &str);

    /// Who could run `function_id` now.
    fn supply(&self, function_id: &str) -> Supply;

    /// The daemon's clock (Unix ms).
    fn now_ms(&self) -> u64;

    /// `turns.reconnect_grace_ms`.
    fn reconnect_grace_ms(&self) -> u64;

    /// `turn.submit` with settings of the turn's own, on the engine of its session.
    fn submit(
        &self,
        args: SubmitArgs,
        opts: SubmitOptions,
    ) -> BoxFuture<'_, Result<SubmitOk, ErrorBody>>;

    /// One page of `sessions.list`, over every session of the daemon.
    fn list_sessions(
        &self,
        args: SessionsListArgs,
    ) -> BoxFuture<'_, Result<SessionsListOk, ErrorBody>>;

    /// `workers.list`.
    fn workers(&self) -> Vec<Worker>;

    /// The record `key`, if any.
    fn record<'a>(&'a self, key: &'a str) -> BoxFuture<'a, anyhow::Result<Option<Vec<u8>>>>;

    /// Write the record `key`, durably, before it returns.
    fn put_record<'a>(&'a self, key: &'a str, value: Vec<u8>) -> BoxFuture<'a, anyhow::Result<()>>;

    /// The record `key`: `value`, written durably when there is none, or the one
    /// already there (so that writers racing to create it agree).
    fn create_record<'a>(
        &'a self,
        key: &'a str,
        value: Vec<u8>,
    ) -> BoxFuture<'a, anyhow::Result<Vec<u8>>>;
}

/// The store key of the endpoint's record `key`: the prefix `X` (records kept for
/// the endpoints, not read by the engine), then `iii/`.
pub(crate) fn store_key(key: &str) -> Vec<u8> {
    let mut k = b"Xiii/".to_vec();
    k.extend_from_slice(key.as_bytes());
    k
}

impl Daemon for Engine {
    fn worker_hello<'a>(
        &'a self,
        hello: &'a HelloArgs,
        outbox: Outbox,
    ) -> BoxFuture<'a, Result<Reconciled, ErrorBody>> {
        Box::pin(async move {
            Ok(self
                .worker_hello_with(hello, outbox, WorkerCaps::NO_PROBE)
                .await?)
        })
    }

    fn worker_disconnected<'a>(
        &'a self,
        worker_id: &'a str,
        conn_id: &'a str,
    ) -> BoxFuture<'a, ()> {
        Box::pin(Engine::worker_disconnected(self, worker_id, conn_id))
    }

    fn connection_closed(&self, conn_id: &str) {
        Engine::connection_closed(self, conn_id);
    }

    fn supply(&self, function_id: &str) -> Supply {
        Engine::supply(self, function_id)
    }

    fn now_ms(&self) -> u64 {
        Engine::now_ms(self)
    }

    fn reconnect_grace_ms(&self) -> u64 {
        self.config().turns.reconnect_grace_ms
    }

    fn submit(
        &self,
        args: SubmitArgs,
        opts: SubmitOptions,
    ) -> BoxFuture<'_, Result<SubmitOk, ErrorBody>> {
        Box::pin(async move {
            let ok = self.submit_with(args, opts).await?;
            Ok(ok.map_json(|j| j.to_value()))
        })
    }

    fn list_sessions(
        &self,
        args: SessionsListArgs,
    ) -> BoxFuture<'_, Result<SessionsListOk, ErrorBody>> {
        Box::pin(async move { Ok(Engine::list_sessions(self, args).await?) })
    }

    fn workers(&self) -> Vec<Worker> {
        Engine::workers(self)
    }

    fn record<'a>(&'a self, key: &'a str) -> BoxFuture<'a, anyhow::Result<Option<Vec<u8>>>> {
        Box::pin(async move { Ok(self.store().kv().get(&store_key(key))?) })
    }

    fn put_record<'a>(&'a self, key: &'a str, value: Vec<u8>) -> BoxFuture<'a, anyhow::Result<()>> {
        Box::pin(async move {
            let mut b = Batch::new();
            b.put_raw(store_key(key), value);
            Ok(self.store().commit(b).await?)
        })
    }

    fn create_record<'a>(
        &'a self,
        key: &'a str,
        value: Vec<u8>,
    ) -> BoxFuture<'a, anyhow::Result<Vec<u8>>> {
        // One daemon: only its own endpoint writes its records, once at start.
        Box::pin(async move {
            if let Some(v) = Daemon::record(self, key).await? {
                return Ok(v);
            }
            Daemon::put_record(self, key, value.clone()).await?;
            Ok(value)
        })
    }
}
