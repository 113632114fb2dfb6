//! Where a partition's appends are published: on a connection to the server that
//! leads its stream when the node holds one ([`Nats::connect_each`]), so that a
//! publish and its acknowledgement do not pass through another server on their
//! way; on the node's main connection otherwise, and for every try of an append
//! in doubt. The stream's leader is read when the log opens and again every
//! `LogConfig::follow_leader_every` while it leads. Which connection carries a
//! publish changes nothing it means: the expected last sequence and the message
//! id are judged by the stream, whoever relays them.
//!
//! [`Nats::connect_each`]: crate::nats::Nats::connect_each

use std::sync::Arc;

use super::stream::API_TRY_TIMEOUT;
use super::JetStreamLog;

/// The connection a partition's appends go out on, and the server it reaches.
#[derive(Clone)]
pub(super) struct Route {
    pub(super) server: String,
    pub(super) client: async_nats::Client,
}

impl JetStreamLog {
    /// The connection the next append's first try goes out on: the route's while
    /// it is up, else None (the main connection).
    pub(super) fn publisher(&self) -> Option<async_nats::Client> {
        let s = self.state().ok()?;
        let r = s.route.as_ref()?;
        (r.client.connection_state() == async_nats::connection::State::Connected)
            .then(|| r.client.clone())
    }

    /// Route the appends to the server named `leader` (the stream's leader as last
    /// read), on a connection to it if one is up; to the main connection when
    /// there is none or no leader is known.
    pub(super) fn route_to(&self, leader: Option<&str>) {
        let route = leader.and_then(|name| {
            self.inner.nats.on_server(name).map(|client| Route {
                server: name.to_string(),
                client,
            })
        });
        if let Ok(mut s) = self.state() {
            let now = route.as_ref().map(|r| r.server.as_str());
            if s.route.as_ref().map(|r| r.server.as_str()) != now {
                tracing::debug!(
                    "partition {}: appends published on {}",
                    self.inner.cfg.partition,
                    now.unwrap_or("the main connection")
                );
            }
            s.route = route;
        }
    }

    /// Read the stream's leader every `follow_leader_every` until the node stops
    /// serving the partition (or the log is gone), and route the appends to it.
    pub(super) fn follow_stream_leader(&self) {
        let every = self.inner.cfg.follow_leader_every;
        if every.is_zero() {
            return;
        }
        let weak = Arc::downgrade(&self.inner);
        let stop = self.inner.stop.clone();
        drop(self.inner.nats.spawn(async move {
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(every) => {}
                }
                let Some(inner) = weak.upgrade() else { return };
                let log = JetStreamLog { inner };
                let stream = log.inner.stream.clone();
                match tokio::time::timeout(API_TRY_TIMEOUT, stream.get_info()).await {
                    Ok(Ok(info)) => {
                        log.route_to(info.cluster.as_ref().and_then(|c| c.leader.as_deref()))
                    }
                    Ok(Err(e)) => tracing::debug!(
                        "partition {}: read the stream's leader: {e}",
                        log.inner.cfg.partition
                    ),
                    Err(_) => tracing::debug!(
                        "partition {}: read the stream's leader: no answer within {API_TRY_TIMEOUT:?}",
                        log.inner.cfg.partition
                    ),
                }
            }
        }));
    }
}
