//! A plain TCP proxy that can cut a path: for a process whose connection is not a
//! WebSocket (a turnd node's connection to NATS), so that a test can take it off
//! the network and give it back while every process keeps running.
//!
//! A [`TcpProxy`] listens on loopback and pipes every connection it accepts to one
//! upstream address, bytes unchanged. [`TcpProxy::cut`] drops every piped
//! connection at once (no FIN on the upstream side either: both sockets are
//! dropped, which is what a dead path looks like to each end soon enough) and
//! refuses new ones until [`TcpProxy::heal`]. Nothing else is interpreted.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// What the accept loop and the controls share.
struct Shared {
    upstream: SocketAddr,
    /// Refusing new connections (between a cut and a heal).
    cut: AtomicBool,
    /// Cancelled to drop every piped connection; replaced by each cut.
    conns: Mutex<CancellationToken>,
    accepted: AtomicU64,
    refused: AtomicU64,
}

impl Shared {
    fn current(&self) -> CancellationToken {
        self.conns
            .lock()
            .map(|t| t.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }
}

/// A running TCP proxy. Dropping it stops it and drops every connection.
pub struct TcpProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for TcpProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpProxy")
            .field("addr", &self.addr)
            .field("upstream", &self.shared.upstream)
            .field("cut", &self.is_cut())
            .finish()
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stop.cancel();
        self.shared.current().cancel();
        self.task.abort();
    }
}

impl TcpProxy {
    /// Listen on `127.0.0.1:0` and pipe every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<TcpProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            cut: AtomicBool::new(false),
            conns: Mutex::new(CancellationToken::new()),
            accepted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        });
        let stop = CancellationToken::new();
        let task = tokio::spawn(accept_loop(listener, shared.clone(), stop.clone()));
        Ok(TcpProxy {
            addr,
            shared,
            stop,
            task,
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Drop every piped connection and refuse new ones until [`TcpProxy::heal`].
    pub fn cut(&self) {
        self.shared.cut.store(true, Ordering::SeqCst);
        let old = match self.shared.conns.lock() {
            Ok(mut t) => std::mem::take(&mut *t),
            Err(p) => std::mem::take(&mut *p.into_inner()),
        };
        old.cancel();
    }

    /// Accept connections again.
    pub fn heal(&self) {
        self.shared.cut.store(false, Ordering::SeqCst);
    }

    /// Whether the path is cut now.
    pub fn is_cut(&self) -> bool {
        self.shared.cut.load(Ordering::SeqCst)
    }

    /// Connections piped so far, and refused while cut.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.shared.accepted.load(Ordering::Relaxed),
            self.shared.refused.load(Ordering::Relaxed),
        )
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, stop: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            a = listener.accept() => a,
        };
        let Ok((client, _)) = accepted else {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            continue;
        };
        if shared.cut.load(Ordering::SeqCst) {
            shared.refused.fetch_add(1, Ordering::Relaxed);
            drop(client);
            continue;
        }
        shared.accepted.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(pipe(client, shared.upstream, shared.current()));
    }
}

/// Pipe `client` to `upstream` both ways until either side ends or `cut` fires.
async fn pipe(mut client: TcpStream, upstream: SocketAddr, cut: CancellationToken) {
    let Ok(mut up) = TcpStream::connect(upstream).await else {
        return;
    };
    // Small frames (NATS protocol lines) go out at once, as without the proxy.
    if client.set_nodelay(true).is_err() || up.set_nodelay(true).is_err() {
        return;
    }
    tokio::select! {
        () = cut.cancelled() => {}
        _ = tokio::io::copy_bidirectional(&mut client, &mut up) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Bytes pass both ways; a cut ends the connection and refuses new ones; a heal
    /// lets them in again.
    #[tokio::test]
    async fn pipes_cuts_and_heals() -> anyhow::Result<()> {
        let echo = TcpListener::bind("127.0.0.1:0").await?;
        let echo_addr = echo.local_addr()?;
        tokio::spawn(async move {
            while let Ok((mut s, _)) = echo.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        let proxy = TcpProxy::start(echo_addr).await?;
        let mut c = TcpStream::connect(proxy.addr()).await?;
        c.write_all(b"ping").await?;
        let mut got = [0u8; 4];
        c.read_exact(&mut got).await?;
        assert_eq!(&got, b"ping");

        proxy.cut();
        assert!(proxy.is_cut());
        let mut rest = Vec::new();
        let n = tokio::time::timeout(std::time::Duration::from_secs(5), c.read_to_end(&mut rest))
            .await??;
        assert_eq!(n, 0, "a cut connection ends");
        let mut refused = TcpStream::connect(proxy.addr()).await?;
        let n = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            refused.read_to_end(&mut rest),
        )
        .await?
        .unwrap_or(0);
        assert_eq!(n, 0, "a connection while cut is dropped");
        assert_eq!(proxy.counts(), (1, 1));

        proxy.heal();
        let mut again = TcpStream::connect(proxy.addr()).await?;
        again.write_all(b"pong").await?;
        again.read_exact(&mut got).await?;
        assert_eq!(&got, b"pong");
        Ok(())
    }
}
