//! A transparent WebSocket proxy that loses, delays and repeats frames on purpose.
//!
//! Workers connect to the proxy's `ws://127.0.0.1:PORT/v1` instead of the daemon; for
//! every accepted connection the proxy opens its own connection to the daemon (the
//! *upstream*) and forwards frames both ways. Text frames are parsed as JSON and
//! matched against [`Rule`]s, in the order they were added; the first rule that
//! applies decides the frame's [`Fate`]: dropped, delayed, duplicated, or (no rule)
//! forwarded unchanged. Frames that are not JSON are forwarded unchanged. Ping, pong
//! and close frames are always forwarded, so liveness detection on both sides still
//! works while rules lose application frames.
//!
//! Beyond single frames the proxy can cut every connection abruptly (the sockets are
//! dropped: no close frame, exactly what a crashed process or a dead network path
//! looks like), refuse new connections or hold them until released, and switch its
//! upstream to another daemon address so workers survive a daemon restart on a new
//! port as if it had kept its address.
//!
//! Everything is controlled at run time through a cloneable [`ProxyHandle`], and every
//! frame that passed is kept in a log with its fate, for assertions on what really
//! went over the wire.
//!
//! This file is the proxy's face ([`Proxy`]); `rules` holds what a rule is (which
//! frames, what happens to them), `state` what a running proxy holds and decides,
//! `handle` the run-time controls, and `forward` the connections themselves.

mod forward;
mod handle;
mod rules;
mod state;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::rng::SplitMix64;
use forward::accept_loop;
pub use handle::ProxyHandle;
pub use rules::{Action, Dir, Fate, Match, Rule, RuleId};
use state::{Counters, Refusal, State};
pub use state::{LoggedFrame, ProxyStats};

/// A running proxy. Dropping it stops accepting and cuts every connection.
pub struct Proxy {
    handle: ProxyHandle,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.handle.fmt(f)
    }
}

impl std::ops::Deref for Proxy {
    type Target = ProxyHandle;

    fn deref(&self) -> &ProxyHandle {
        &self.handle
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.handle.state.shutdown.cancel();
        self.handle.state.cut_where(|_| true);
        self.task.abort();
    }
}

impl Proxy {
    /// Listen on `127.0.0.1:0` and forward every connection to `upstream` (a daemon
    /// URL such as `ws://127.0.0.1:7420/v1`).
    pub async fn start(upstream: impl Into<String>) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            addr,
            upstream: Mutex::new(upstream.into()),
            rules: Mutex::new(Vec::new()),
            next_rule: AtomicU64::new(1),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            refusal: Mutex::new(Refusal::default()),
            hold: watch::Sender::new(false),
            counters: Counters::default(),
            log: Mutex::new(Vec::new()),
            logged: Notify::new(),
            rng: Mutex::new(SplitMix64::new(0)),
            shutdown: CancellationToken::new(),
        });
        let task = tokio::spawn(accept_loop(listener, state.clone()));
        Ok(Proxy {
            handle: ProxyHandle { state },
            task,
        })
    }

    /// A handle to control the proxy from elsewhere.
    pub fn handle(&self) -> ProxyHandle {
        self.handle.clone()
    }

    /// The proxy's listening address.
    pub fn addr(&self) -> SocketAddr {
        self.handle.state.addr
    }
}
