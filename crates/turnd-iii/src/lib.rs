//! turnd's iii endpoint: programs written with iii-sdk (npm 0.22.1, PyPI 0.25.0)
//! connect to turnd as they would to an iii engine and get turnd's guarantees.
//!
//! Each iii connection is turned into requests of the daemon, as a protocol-v1
//! connection's are: a connection that registers functions becomes a turnd worker
//! (`iii/<lineage>`), whose identity survives reconnects through iii's `reattach`; a
//! `trigger` becomes a turn. An iii frame that is a protocol v1 op (registering a
//! function, a result, waiting for a call's turn) goes through the daemon's
//! [`Router`], as that op would from a protocol v1 connection; what only iii has (its
//! worker attach, a call's turn with its dispatch bound, queues, its own records)
//! goes through [`Daemon`]: one engine, or a node of a cluster. See `docs/iii.md`
//! for the mapping and for what is and is not guaranteed.

#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "a test reads as one scenario from its setup to its last assertion"
    )
)]

pub mod config;
mod conn;
pub mod daemon;
pub mod queue;
pub mod wire;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use futures_util::future::BoxFuture;
use ring::hmac;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use turnd_engine::Caller;
use turnd_proto::{ErrorBody, Role};

pub use config::IiiConfig;
pub use daemon::Daemon;

/// The daemon's router of protocol v1 ops (`turnd-server`'s `router`), which the
/// endpoint is given when it starts serving: the caller, an op's name and its JSON
/// arguments in, the op's answer as JSON text or a protocol error out. It is a trait
/// here because `turnd-server`, which holds the router, depends on this crate.
pub trait Router: Send + Sync {
    fn dispatch<'a>(
        &'a self,
        caller: &'a Caller,
        op: &'a str,
        args: String,
    ) -> BoxFuture<'a, Result<String, ErrorBody>>;
}

/// State shared by every iii connection.
pub struct Iii {
    pub(crate) daemon: Arc<dyn Daemon>,
    pub(crate) cfg: IiiConfig,
    tokens: Vec<(Role, String)>,
    /// Signs reattach tokens; kept in the daemon's records so tokens verify after a
    /// restart (and, in a cluster, on every node).
    key: hmac::Key,
    /// Functions workers registered as HTTP-invoked (not run by turnd), for the
    /// answer to a call of one.
    pub(crate) http_functions: Mutex<HashSet<String>>,
    /// Interval of the endpoint's WebSocket pings; a peer silent for 3× this is gone.
    pub(crate) heartbeat: Duration,
    /// Cancelled when connections must close.
    pub(crate) closing: CancellationToken,
    conns: TaskTracker,
}

impl Iii {
    /// Load (or create, durably) the reattach secret.
    pub async fn open(
        daemon: Arc<dyn Daemon>,
        cfg: IiiConfig,
        tokens: Vec<(Role, String)>,
        heartbeat: Duration,
        closing: CancellationToken,
    ) -> anyhow::Result<Arc<Iii>> {
        let mut fresh = vec![0u8; 32];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut fresh)
            .map_err(|_| anyhow::anyhow!("no randomness for the iii secret"))?;
        let secret = daemon
            .create_record("secret", fresh)
            .await
            .context("read or write the iii secret")?;
        if secret.len() != 32 {
            anyhow::bail!("the stored iii secret has {} bytes, not 32", secret.len());
        }
        Ok(Arc::new(Iii {
            daemon,
            cfg,
            tokens,
            key: hmac::Key::new(hmac::HMAC_SHA256, &secret),
            http_functions: Mutex::new(HashSet::new()),
            heartbeat,
            closing,
            conns: TaskTracker::new(),
        }))
    }

    /// Serve the listener until `closing` is cancelled, then wait (briefly) for the
    /// connections to end. Requests that are protocol v1 ops go to `router`.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, router: Arc<dyn Router>) {
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        if let Err(e) = stream.set_nodelay(true) {
                            tracing::debug!(%peer, "set TCP_NODELAY: {e}");
                        }
                        self.conns.spawn(conn::serve(self.clone(), router.clone(), stream, peer));
                    }
                    Err(e) => {
                        tracing::warn!("iii endpoint: failed to accept a connection: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                _ = self.closing.cancelled() => break,
            }
        }
        drop(listener);
        self.conns.close();
        if tokio::time::timeout(Duration::from_secs(3), self.conns.wait())
            .await
            .is_err()
        {
            tracing::warn!("iii connections still open after 3s; closing anyway");
        }
    }

    /// Whether a token may open an iii connection: an iii connection is worker and
    /// caller at once, so the token must be configured for both roles, or be an
    /// operator token. Without tokens configured every connection is accepted.
    pub(crate) fn token_ok(&self, given: Option<&str>) -> bool {
        if self.tokens.is_empty() {
            return true;
        }
        let given = given.unwrap_or("").as_bytes();
        let (mut worker, mut client, mut operator) = (false, false, false);
        for (role, t) in &self.tokens {
            // Compare against every token in constant time, whatever matches first.
            let eq = constant_time_eq::constant_time_eq(t.as_bytes(), given);
            match role {
                Role::Worker => worker |= eq,
                Role::Client => client |= eq,
                Role::Operator => operator |= eq,
            }
        }
        operator || (worker && client)
    }

    /// The reattach token of a lineage: HMAC-SHA256 of it under the stored secret.
    pub(crate) fn reattach_token(&self, lineage: &str) -> String {
        let tag = hmac::sign(&self.key, lineage.as_bytes());
        tag.as_ref().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Whether `token` is the reattach token of `lineage`.
    pub(crate) fn reattach_ok(&self, lineage: &str, token: &str) -> bool {
        let Some(bytes) = unhex(token) else {
            return false;
        };
        hmac::verify(&self.key, lineage.as_bytes(), &bytes).is_ok()
    }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect()
}

/// The address an iii listener is bound to, for logs and the ready file.
pub fn url(addr: SocketAddr) -> String {
    format!("ws://{addr}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnd_engine::{Engine, EngineConfig};
    use turnd_store::mem::MemKv;
    use turnd_store::Store;

    async fn iii(kv: Arc<MemKv>, tokens: Vec<(Role, String)>) -> Arc<Iii> {
        let engine = Engine::open(Store::new(kv), EngineConfig::default())
            .await
            .expect("engine");
        Iii::open(
            Arc::new(engine),
            IiiConfig::default(),
            tokens,
            Duration::from_secs(5),
            CancellationToken::new(),
        )
        .await
        .expect("iii")
    }

    #[tokio::test]
    async fn reattach_tokens_verify_after_a_restart_and_only_for_their_lineage() {
        let kv = Arc::new(MemKv::new());
        let a = iii(kv.clone(), vec![]).await;
        let t = a.reattach_token("L1");
        assert!(a.reattach_ok("L1", &t));
        assert!(!a.reattach_ok("L2", &t));
        assert!(!a.reattach_ok("L1", "00"));
        assert!(!a.reattach_ok("L1", "zz"));
        // The same store: the same secret.
        let b = iii(kv, vec![]).await;
        assert!(b.reattach_ok("L1", &t));
        // Another store: another secret.
        let c = iii(Arc::new(MemKv::new()), vec![]).await;
        assert!(!c.reattach_ok("L1", &t));
    }

    #[tokio::test]
    async fn a_token_must_serve_worker_and_client_or_be_an_operator_token() {
        let kv = Arc::new(MemKv::new());
        let open = iii(kv.clone(), vec![]).await;
        assert!(open.token_ok(None));
        let t = |r, s: &str| (r, s.to_string());
        let a = iii(
            kv,
            vec![
                t(Role::Worker, "both"),
                t(Role::Client, "both"),
                t(Role::Worker, "w-only"),
                t(Role::Operator, "op"),
            ],
        )
        .await;
        assert!(a.token_ok(Some("both")));
        assert!(a.token_ok(Some("op")));
        assert!(!a.token_ok(Some("w-only")));
        assert!(!a.token_ok(Some("nope")));
        assert!(!a.token_ok(None));
    }
}
