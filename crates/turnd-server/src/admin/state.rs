//! What the admin listener's routes share with the operator page: the state a
//! daemon on its own serves its health and metrics from ([`Admin`]; the page reads
//! the daemon's shared state and backend, on a node too) and the client's address
//! as the listener accepted it ([`ClientAddr`]). A leaf module, so that the page
//! and the listener that mounts it do not import each other.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::connect_info::Connected;
use axum::serve::IncomingStream;
use tokio::net::TcpListener;
use turnd_engine::Engine;

use crate::tls::TlsListener;
use crate::ws::Shared;

/// The client's address, as the admin listener accepted it (plain or TLS).
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr(pub SocketAddr);

impl Connected<IncomingStream<'_, TcpListener>> for ClientAddr {
    fn connect_info(stream: IncomingStream<'_, TcpListener>) -> Self {
        ClientAddr(*stream.remote_addr())
    }
}

impl Connected<IncomingStream<'_, TlsListener>> for ClientAddr {
    fn connect_info(stream: IncomingStream<'_, TlsListener>) -> Self {
        ClientAddr(*stream.remote_addr())
    }
}

/// What the admin listener of a daemon on its own serves from: the state its
/// connections share, and its engine.
pub struct Admin {
    pub engine: Engine,
    pub shared: Arc<Shared>,
}

impl std::ops::Deref for Admin {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.shared
    }
}
