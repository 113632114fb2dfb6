//! What connections run their requests on: one engine (a daemon on its own), or a
//! node of a cluster ([`crate::cluster::Node`]), which runs each request on the
//! engine of its partition, here or on the node that leads it. The WebSocket
//! connection asks only this, so it is the same code in both.

use std::collections::HashSet;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use turnd_engine::{Caller, Engine, Outbox};
use turnd_proto::{ErrorBody, HelloArgs, Op, Reconciled};

use crate::cluster::Node;
use crate::router::{self, Answer, Origin};

/// See the module documentation.
#[derive(Clone)]
pub enum Backend {
    Single(Engine),
    Cluster(Arc<Node>),
}

impl Backend {
    /// Run an admitted op.
    pub async fn run(
        &self,
        caller: &Caller,
        op: Op,
        args: &str,
        origin: Option<&Origin<'_>>,
    ) -> Result<Answer, ErrorBody> {
        match self {
            Backend::Single(e) => router::run(e, caller, op, args, origin).await,
            // Boxed: a node's future (forwarding over NATS) is about twice a
            // single engine's, and would size every request task of a daemon on
            // its own.
            Backend::Cluster(n) => router::own_size(n.run(caller, op, args, origin)).await,
        }
    }

    /// A worker's `hello`.
    pub async fn worker_hello(
        &self,
        hello: &HelloArgs,
        outbox: Outbox,
    ) -> Result<Reconciled, ErrorBody> {
        match self {
            Backend::Single(e) => Ok(e.worker_hello(hello, outbox).await?),
            Backend::Cluster(n) => n.worker_hello(hello, outbox).await,
        }
    }

    /// What `hello` answers as `boot_id`.
    pub fn boot_id(&self) -> &str {
        match self {
            Backend::Single(e) => e.boot_id(),
            Backend::Cluster(n) => n.boot_id(),
        }
    }

    /// Whether `invocation_id` is live and dispatched to `worker_id`.
    pub fn is_assigned(&self, worker_id: &str, invocation_id: &str) -> bool {
        match self {
            Backend::Single(e) => e.is_assigned(worker_id, invocation_id),
            Backend::Cluster(n) => n.workers().is_assigned(worker_id, invocation_id),
        }
    }

    /// Keep only the invocation ids that are live and dispatched to `worker_id`.
    pub fn retain_assigned(&self, worker_id: &str, ids: &mut HashSet<String>) {
        match self {
            Backend::Single(e) => e.retain_assigned(worker_id, ids),
            Backend::Cluster(n) => n.workers().retain_assigned(worker_id, ids),
        }
    }

    /// A connection ended: its watches end.
    pub fn connection_closed(&self, conn_id: &str) {
        match self {
            Backend::Single(e) => e.connection_closed(conn_id),
            Backend::Cluster(n) => n.connection_closed(conn_id),
        }
    }

    /// A worker's connection ended.
    pub async fn worker_disconnected(&self, worker_id: &str, conn_id: &str) {
        match self {
            Backend::Single(e) => e.worker_disconnected(worker_id, conn_id).await,
            Backend::Cluster(n) => n.worker_disconnected(worker_id, conn_id).await,
        }
    }
}

/// The router as the iii endpoint calls it: a request carried without a
/// connection.
pub struct IiiRouter {
    pub backend: Backend,
}

impl turnd_iii::Router for IiiRouter {
    fn dispatch<'a>(
        &'a self,
        caller: &'a Caller,
        op: &'a str,
        args: String,
    ) -> BoxFuture<'a, Result<router::Reply, ErrorBody>> {
        Box::pin(async move {
            let op = router::admit(caller, op)?;
            match self.backend.run(caller, op, &args, None).await? {
                Answer::Reply(r) => Ok(r),
                // Without an origin a watch is refused before it is run.
                Answer::Queued => Err(router::not_routed(Op::Watch)),
            }
        })
    }
}
