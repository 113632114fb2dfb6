//! turnd's network face: the WebSocket protocol v1 listener, the admin HTTP listener,
//! the configuration, and the daemon's start-up and graceful shutdown.
//!
//! [`Daemon::start`] takes already-bound listeners and a store, so the binary, the
//! integration tests and the benchmarks all start the real server the same way
//! (tests on `127.0.0.1:0`, optionally on a fault-injecting store).

#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "a test reads as one scenario from its setup to its last assertion"
    )
)]

pub mod admin;
pub mod backend;
pub mod cluster;
pub mod cluster_config;
pub mod config;
pub mod router;
pub mod tls;
pub mod ui;
pub mod ws;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use turnd_engine::Engine;
use turnd_store::{Kv, LoggedKv, LoggedOptions, SledOptions, Store, SyncMode};

pub use config::Config;
use config::StorageSync;
use ws::{ConnectionCounts, Shared};

/// The listeners, bound before any heavy start-up work.
pub struct Listeners {
    pub ws: TcpListener,
    pub admin: TcpListener,
    /// The iii endpoint's, when `iii.listen` is set.
    pub iii: Option<TcpListener>,
}

impl Listeners {
    pub async fn bind(cfg: &Config) -> anyhow::Result<Listeners> {
        let ws = bind_one(&cfg.server.listen, "WebSocket", "--listen", "LISTEN").await?;
        let admin = bind_one(
            &cfg.server.admin_listen,
            "admin",
            "--admin-listen",
            "ADMIN_LISTEN",
        )
        .await?;
        let iii = match &cfg.iii.listen {
            Some(addr) => Some(TcpListener::bind(addr).await.with_context(|| {
                format!("bind iii listener {addr} (iii.listen, TURND_III__LISTEN)")
            })?),
            None => None,
        };
        Ok(Listeners { ws, admin, iii })
    }
}

/// Bind one listener; an address in use names the flag and the variable that move it.
async fn bind_one(addr: &str, what: &str, flag: &str, key: &str) -> anyhow::Result<TcpListener> {
    match TcpListener::bind(addr).await {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(anyhow::anyhow!(
            "bind {what} listener {addr}: address in use: pass {flag} or set TURND_SERVER__{key} \
             (another turnd may be running there)"
        )),
        Err(e) => Err(anyhow::Error::new(e).context(format!("bind {what} listener {addr}"))),
    }
}

/// How the config says the store is opened.
pub fn store_options(cfg: &Config) -> anyhow::Result<LoggedOptions> {
    let mode = match cfg.storage.sync {
        StorageSync::Always => SyncMode::Always,
        StorageSync::Never => SyncMode::Never,
    };
    Ok(LoggedOptions {
        sled: SledOptions {
            sync: mode,
            cache_mb: cfg.storage.cache_mb,
            checkpoint_mb: cfg.storage.checkpoint_mb,
            ..SledOptions::default()
        },
        segment_bytes: cfg.storage.log_segment_kb.saturating_mul(1024),
        apply_interval: Duration::from_millis(cfg.storage.apply_interval_ms),
        apply_delay: Duration::from_millis(cfg.storage.apply_delay_ms),
        heal_interval: Duration::from_millis(cfg.storage.heal_interval_ms),
        windows: turnd_store::WindowOptions {
            window_ms: cfg.window_ms(),
            window_bytes: cfg.storage.window_mb.saturating_mul(1024 * 1024),
        },
        idle_reopen: turnd_store::DEFAULT_IDLE_REOPEN,
        window_close_after: (cfg.storage.window_close_ms > 0)
            .then(|| Duration::from_millis(cfg.storage.window_close_ms)),
        overlay_bytes: turnd_store::DEFAULT_OVERLAY_BYTES,
        overlay_keys: turnd_store::DEFAULT_OVERLAY_KEYS,
        mark_interval: turnd_store::DEFAULT_MARK_INTERVAL,
    })
}

/// Open the store the config names: the commit log in front, sled behind. What the
/// log holds past sled's applied mark is read back before this returns (the store's
/// applier writes it to sled).
pub fn open_store(cfg: &Config) -> anyhow::Result<Arc<LoggedKv>> {
    let (kv, replayed) = LoggedKv::open(&cfg.storage.data_dir, store_options(cfg)?)
        .with_context(|| format!("open store in {}", cfg.storage.data_dir.display()))?;
    if replayed.records > 0 {
        tracing::info!(
            "read back {} records ({} bytes) of the commit log past sled's mark in {} ms",
            replayed.records,
            replayed.bytes,
            replayed.millis
        );
    }
    Ok(Arc::new(kv))
}

/// The listeners' addresses, and the TLS acceptor when the config turns TLS on.
fn addresses(
    cfg: &Config,
    listeners: &Listeners,
) -> anyhow::Result<(SocketAddr, SocketAddr, Option<tokio_rustls::TlsAcceptor>)> {
    let ws_addr = listeners
        .ws
        .local_addr()
        .context("WebSocket listener address")?;
    let admin_addr = listeners
        .admin
        .local_addr()
        .context("admin listener address")?;
    let tls = match (&cfg.server.tls_cert, &cfg.server.tls_key) {
        (Some(c), Some(k)) => Some(tls::acceptor(c, k)?),
        _ => None,
    };
    Ok((ws_addr, admin_addr, tls))
}

/// A running daemon.
pub struct Daemon {
    pub ws_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// The iii endpoint's address, when it is on.
    pub iii_addr: Option<SocketAddr>,
    /// Whether both listeners speak TLS.
    pub tls: bool,
    /// The engine, or the node of a cluster, its connections run on.
    pub backend: backend::Backend,
    shutdown: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Daemon {
    /// Recover the store and serve on the given listeners until `shutdown()`.
    pub async fn start(
        cfg: Config,
        listeners: Listeners,
        kv: Arc<dyn Kv>,
    ) -> anyhow::Result<Daemon> {
        let (ws_addr, admin_addr, tls) = addresses(&cfg, &listeners)?;
        let iii_addr = match &listeners.iii {
            Some(l) => Some(l.local_addr().context("iii listener address")?),
            None => None,
        };
        let store = Store::new(kv.clone());
        let engine = Engine::open(store, cfg.engine_config())
            .await
            .context("recover the store")?;
        let closing = CancellationToken::new();
        let iii = match iii_addr {
            Some(_) => Some(open_iii(&cfg, Arc::new(engine.clone()), &closing).await?),
            None => None,
        };
        let backend = backend::Backend::Single(engine);
        let shutdown = CancellationToken::new();
        let is_tls = tls.is_some();
        let shared = Arc::new(Shared {
            backend: backend.clone(),
            config: cfg,
            draining: CancellationToken::new(),
            closing,
            requests: TaskTracker::new(),
            connections: ConnectionCounts::default(),
        });
        let task = tokio::spawn(serve(
            shared,
            listeners,
            tls,
            Some(kv),
            shutdown.clone(),
            iii,
        ));
        Ok(Daemon {
            ws_addr,
            admin_addr,
            iii_addr,
            tls: is_tls,
            backend,
            shutdown,
            task,
        })
    }

    /// Join the cluster of `cfg.cluster` as one of its nodes and serve on the given
    /// listeners until `shutdown()`: each partition's store and engine are opened
    /// when this node takes the partition over (`docs/cluster.md`).
    pub async fn start_cluster(cfg: Config, listeners: Listeners) -> anyhow::Result<Daemon> {
        let (ws_addr, admin_addr, tls) = addresses(&cfg, &listeners)?;
        let iii_addr = match &listeners.iii {
            Some(l) => Some(l.local_addr().context("iii listener address")?),
            None => None,
        };
        let (ws_scheme, admin_scheme) = if tls.is_some() {
            ("wss", "https")
        } else {
            ("ws", "http")
        };
        let endpoints = (
            format!("{ws_scheme}://{ws_addr}{}", turnd_proto::WS_PATH),
            format!("{admin_scheme}://{admin_addr}"),
        );
        let node = cluster::Node::start(cfg.clone(), endpoints).await?;
        let closing = CancellationToken::new();
        let iii = match iii_addr {
            Some(_) => {
                let daemon = cluster::iii::NodeIii::open(node.clone())
                    .await
                    .context("the iii endpoint's records")?;
                Some(open_iii(&cfg, daemon, &closing).await?)
            }
            None => None,
        };
        let backend = backend::Backend::Cluster(node);
        let shutdown = CancellationToken::new();
        let is_tls = tls.is_some();
        let shared = Arc::new(Shared {
            backend: backend.clone(),
            config: cfg,
            draining: CancellationToken::new(),
            closing,
            requests: TaskTracker::new(),
            connections: ConnectionCounts::default(),
        });
        let task = tokio::spawn(serve(shared, listeners, tls, None, shutdown.clone(), iii));
        Ok(Daemon {
            ws_addr,
            admin_addr,
            iii_addr,
            tls: is_tls,
            backend,
            shutdown,
            task,
        })
    }

    /// The engine of a daemon on its own (None: a node of a cluster).
    pub fn engine(&self) -> Option<&Engine> {
        match &self.backend {
            backend::Backend::Single(e) => Some(e),
            backend::Backend::Cluster(_) => None,
        }
    }

    /// `ws://ADDR/v1` (`wss://` with TLS).
    pub fn ws_url(&self) -> String {
        let scheme = if self.tls { "wss" } else { "ws" };
        format!("{scheme}://{}{}", self.ws_addr, turnd_proto::WS_PATH)
    }

    /// `ws://ADDR` of the iii endpoint, when it is on.
    pub fn iii_url(&self) -> Option<String> {
        self.iii_addr.map(turnd_iii::url)
    }

    /// `http://ADDR` (`https://` with TLS).
    pub fn admin_url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.admin_addr)
    }

    /// A token that starts a graceful shutdown when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Shut down gracefully and wait until done.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        self.join().await
    }

    /// Wait until the daemon has stopped (after its shutdown token was cancelled).
    pub async fn join(self) -> anyhow::Result<()> {
        match self.task.await {
            Ok(r) => r,
            Err(e) => Err(anyhow::anyhow!("server task failed: {e}")),
        }
    }
}

/// Serve an accepted WebSocket connection in a task of its own (after the TLS
/// handshake, with a time limit, when TLS is on).
fn accept_connection(
    shared: &Arc<Shared>,
    conns: &TaskTracker,
    tls: Option<&tokio_rustls::TlsAcceptor>,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(%peer, "set TCP_NODELAY: {e}");
    }
    match tls {
        Some(acceptor) => {
            let acceptor = acceptor.clone();
            let shared = shared.clone();
            conns.spawn(async move {
                match tokio::time::timeout(tls::HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(s)) => ws::serve_connection(shared, s, peer).await,
                    Ok(Err(e)) => tracing::debug!(%peer, "TLS handshake failed: {e}"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
        None => {
            conns.spawn(ws::serve_connection(shared.clone(), stream, peer));
        }
    }
}

/// The iii endpoint on `daemon` (an engine, or a node of a cluster), its connections
/// closed when `closing` is cancelled.
async fn open_iii(
    cfg: &Config,
    daemon: Arc<dyn turnd_iii::Daemon>,
    closing: &CancellationToken,
) -> anyhow::Result<Arc<turnd_iii::Iii>> {
    turnd_iii::Iii::open(
        daemon,
        cfg.iii.clone(),
        cfg.auth
            .tokens
            .iter()
            .map(|t| (t.role, t.token.clone()))
            .collect(),
        Duration::from_millis(cfg.server.heartbeat_ms),
        closing.clone(),
    )
    .await
    .context("open the iii endpoint")
}

async fn serve(
    shared: Arc<Shared>,
    listeners: Listeners,
    tls: Option<tokio_rustls::TlsAcceptor>,
    kv: Option<Arc<dyn Kv>>,
    shutdown: CancellationToken,
    iii: Option<Arc<turnd_iii::Iii>>,
) -> anyhow::Result<()> {
    let conns = TaskTracker::new();
    let iii_task = match (iii, listeners.iii) {
        (Some(iii), Some(l)) => {
            let router = Arc::new(backend::IiiRouter {
                backend: shared.backend.clone(),
            });
            Some(tokio::spawn(iii.serve(l, router)))
        }
        _ => None,
    };
    let admin = admin::spawn(&shared, listeners.admin, tls.clone());
    loop {
        tokio::select! {
            accepted = listeners.ws.accept() => match accepted {
                Ok((stream, peer)) => accept_connection(&shared, &conns, tls.as_ref(), stream, peer),
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!("failed to accept a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = shutdown.cancelled() => break,
        }
    }
    let limit = Duration::from_millis(shared.config.server.shutdown_timeout_ms);
    tracing::info!("shutting down: draining requests in progress");
    drop(listeners.ws);
    // turn.wait requests end at once; every other request finishes its write. A
    // node of a cluster hands its partitions over first, while its connections'
    // requests are still taken (forwarded to the partitions' next leaders), and
    // closes them only once nothing of it is left to serve.
    match &shared.backend {
        backend::Backend::Single(engine) => {
            shared.draining.cancel();
            engine.shutdown();
        }
        backend::Backend::Cluster(node) => {
            node.drain().await;
            // Each connection stops reading, answers what it started, and closes.
            // `draining` stays as it is: a request read in the instant its
            // connection saw `closing` is forwarded like any other, never refused.
            shared.closing.cancel();
        }
    }
    shared.requests.close();
    if tokio::time::timeout(limit, shared.requests.wait())
        .await
        .is_err()
    {
        tracing::warn!("requests still running after {limit:?}; closing anyway");
    }
    shared.closing.cancel();
    conns.close();
    if tokio::time::timeout(Duration::from_secs(3), conns.wait())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after 3s; closing anyway");
    }
    if let Some(t) = iii_task {
        if let Err(e) = t.await {
            tracing::warn!("iii endpoint task failed: {e}");
        }
    }
    match admin.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!("admin listener ended with an error: {e}"),
        Err(e) => tracing::warn!("admin listener task failed: {e}"),
    }
    if let Some(kv) = kv {
        kv.sync().context("sync the store at shutdown")?;
    }
    tracing::info!("shutdown complete");
    Ok(())
}
