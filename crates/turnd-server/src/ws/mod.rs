//! WebSocket protocol v1: one task reads a connection, one writes it.
//!
//! The reader decodes frames, answers bad ones, runs `hello` in line (so the
//! connection's role is settled before anything else runs) and starts every other
//! request as its own task, so a `turn.wait` never holds up the connection; what the
//! request does is the [`router`](crate::router)'s. The writer drains the
//! connection's bounded [`Outbox`] and sends the server pings. A peer that does not
//! read fast enough overflows its outbox and is disconnected.
//!
//! - [`connection`]: the handshake, the connection's place in the limits, its tasks
//!   and its end (with the linger after a frame over the limit).
//! - [`reader`]: the reader task, from a frame to an answer or a started request.
//! - [`request`]: what stands between a request and the router (`hello` first, the
//!   draining daemon, the in-flight cap), and the request's own task.
//! - [`hello`]: `hello`, tokens and roles.
//! - [`limits`]: the connection, request-rate, in-flight and JSON-depth limits.
//! - [`writer`]: the writer task and the close code a connection ends with.

mod connection;
mod hello;
mod limits;
mod reader;
mod request;
mod writer;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use turnd_engine::{Caller, Outbox};
use turnd_proto::frame::{encode_error, encode_ok_text};
use turnd_proto::{ErrorBody, Role};

use crate::config::Config;
use crate::router::Reply;

pub use connection::serve_connection;

/// State shared by every connection.
pub struct Shared {
    pub backend: crate::backend::Backend,
    pub config: Config,
    /// Cancelled when the daemon starts draining: new requests get `shutting_down`.
    pub draining: CancellationToken,
    /// Cancelled when connections must close.
    pub closing: CancellationToken,
    /// Requests in progress, waited for on shutdown.
    pub requests: TaskTracker,
    pub connections: ConnectionCounts,
}

/// Connections by role, for metrics, and by address, for limits.
#[derive(Default)]
pub struct ConnectionCounts {
    pub unauthenticated: AtomicU64,
    pub worker: AtomicU64,
    pub client: AtomicU64,
    pub operator: AtomicU64,
    pub total: AtomicU64,
    pub per_ip: std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, u64>>,
    /// Connections refused by a limit.
    pub refused: AtomicU64,
    /// Requests being run, over every connection.
    pub requests_inflight: AtomicU64,
}

impl ConnectionCounts {
    fn of(&self, role: Option<Role>) -> &AtomicU64 {
        match role {
            None => &self.unauthenticated,
            Some(Role::Worker) => &self.worker,
            Some(Role::Client) => &self.client,
            Some(Role::Operator) => &self.operator,
        }
    }
}

/// One connection, as its reader and its requests' tasks see it.
struct Conn {
    shared: Arc<Shared>,
    outbox: Outbox,
    /// Who the connection is, once its `hello` was accepted.
    auth: OnceLock<Caller>,
    peer: std::net::SocketAddr,
    /// Requests of this connection being run (started and not yet answered).
    inflight: AtomicU64,
}

impl Conn {
    /// Queue a request's answer; false when the connection is closed.
    async fn respond(&self, id: u64, r: Result<Reply, ErrorBody>) -> bool {
        match r {
            Ok(v) => self.outbox.send(encode_ok_text(id, &v)).await,
            Err(e) => self.respond_error(Some(id), e).await,
        }
    }

    async fn respond_error(&self, id: Option<u64>, e: ErrorBody) -> bool {
        self.outbox.send(encode_error(id, &e)).await
    }

    /// The connection's role, once it said `hello`.
    fn role(&self) -> Option<Role> {
        self.auth.get().map(|c| c.role)
    }

    /// Count the connection under its role from now on (after its `hello`).
    fn count_as(&self, role: Role) {
        let counts = &self.shared.connections;
        counts.of(None).fetch_sub(1, Ordering::Relaxed);
        counts.of(Some(role)).fetch_add(1, Ordering::Relaxed);
    }
}
