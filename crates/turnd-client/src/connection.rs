//! One WebSocket connection to the daemon, with requests multiplexed by id.
//!
//! A single I/O task owns the socket. Requests get a connection-unique id, are written
//! through a channel and answered through a per-request oneshot, so any number of them
//! can be outstanding at once and answered in any order: a `turn.wait` that waits
//! never holds up a `ping` on the same connection. Pushes (frames without `id`) go to
//! one channel that the owner takes with [`Connection::pushes`].
//!
//! When the connection ends, for whatever reason, every outstanding request fails with
//! [`ClientError::Closed`] and the push channel ends, so nothing waits forever on a
//! dead socket.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::Value;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use tokio_util::sync::CancellationToken;
use tracing::{debug, trace, warn};
use turnd_proto::frame::{
    decode_raw_server_frame, encode_request, encode_request_typed, RawServerFrame,
};
use turnd_proto::{HelloArgs, HelloOk, Push};

use crate::error::ClientError;

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;
type Reply = oneshot::Sender<Result<Box<RawValue>, ClientError>>;

/// Heartbeat intervals of silence after which the server is taken to be gone.
const IDLE_HEARTBEATS: u64 = 3;

/// Size of the WebSocket read buffer. tungstenite zero-fills the whole buffer before
/// every read of the socket, so its 128 KiB default costs a 128 KiB memset per read;
/// answers and pushes are mostly far smaller, and a larger frame only takes more reads.
const READ_BUFFER_BYTES: usize = 8 * 1024;

/// Most requests the writer takes from its queue before it flushes them.
const WRITE_BATCH_FRAMES: usize = 64;

/// A deadline that does not come (a year).
const NEVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// How long a closing connection waits for the server's close handshake.
const CLOSE_LINGER: Duration = Duration::from_millis(500);

/// Lock a mutex, recovering the data if a panicking thread poisoned it: every
/// critical section here leaves the data consistent at each await-free step.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// State shared between the handles and the I/O task.
struct Shared {
    /// Outstanding requests by id; `None` once the connection has ended, so that a
    /// request registered after the end fails at once instead of waiting forever.
    pending: Mutex<Option<HashMap<u64, Reply>>>,
    /// Cancelled when the connection has ended.
    closed: CancellationToken,
    /// Close code the server sent, if any.
    close_code: Mutex<Option<u16>>,
    /// Silence (nothing received, not even a ping) after which the server is taken
    /// to be gone; `None` = never.
    idle_limit: Mutex<Option<Duration>>,
    /// Wakes the I/O task when `idle_limit` changes.
    idle_changed: Notify,
}

impl Shared {
    fn finish(&self) {
        let pending = lock(&self.pending).take();
        if let Some(pending) = pending {
            for (_, reply) in pending {
                // The requester may have given up already; nothing to tell then.
                if reply.send(Err(ClientError::Closed)).is_err() {
                    trace!("requester gone before connection end was reported");
                }
            }
        }
        self.closed.cancel();
    }
}

struct Inner {
    shared: Arc<Shared>,
    next_id: AtomicU64,
    out: mpsc::UnboundedSender<Message>,
    /// Asks the I/O task to close the socket.
    stop: CancellationToken,
    pushes: Mutex<Option<mpsc::UnboundedReceiver<Push>>>,
    io_task: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The last handle is gone: nobody can send or read any more.
        self.stop.cancel();
    }
}

/// One WebSocket connection speaking protocol v1. Cheap to clone; all clones share the
/// socket. Dropping the last clone closes it.
#[derive(Clone)]
pub struct Connection {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("closed", &self.is_closed())
            .finish_non_exhaustive()
    }
}

/// Removes a request's reply slot when the request future is dropped (for instance
/// by a caller's timeout), so abandoned requests do not accumulate.
struct PendingGuard<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        if let Some(pending) = lock(&self.shared.pending).as_mut() {
            pending.remove(&self.id);
        }
    }
}

/// Longest part of a refused upgrade's HTTP body quoted in an error.
const HTTP_BODY_QUOTED: usize = 200;

/// A failed connection attempt in words. A server that answers the upgrade with
/// plain HTTP usually says why in the body (turnd: `no such path; protocol v1 is
/// served at /v1`), so that is quoted with the status.
fn connect_error(e: &tokio_tungstenite::tungstenite::Error) -> String {
    use tokio_tungstenite::tungstenite::Error;
    match e {
        Error::Http(resp) => {
            let body = resp
                .body()
                .as_deref()
                .map(|b| String::from_utf8_lossy(b).trim().to_string())
                .filter(|b| !b.is_empty());
            match body {
                Some(b) => {
                    let quoted: String = b.chars().take(HTTP_BODY_QUOTED).collect();
                    format!(
                        "the server refused the WebSocket upgrade with HTTP {}: {quoted}",
                        resp.status()
                    )
                }
                None => format!(
                    "the server refused the WebSocket upgrade with HTTP {}",
                    resp.status()
                ),
            }
        }
        e => e.to_string(),
    }
}

impl Connection {
    /// Connect to `url` (e.g. `ws://127.0.0.1:7420/v1`) and send `hello` as the first
    /// request. Fails with [`ClientError::Protocol`] when the server refuses the hello
    /// (the connection is closed then).
    pub async fn connect(
        url: &str,
        hello: HelloArgs,
    ) -> Result<(Connection, HelloOk), ClientError> {
        let conn = Connection::connect_raw(url).await?;
        // On a refusal, dropping the only handle closes the socket in the background:
        // the caller learns of it without waiting for the close handshake.
        let ok: HelloOk = conn.call("hello", &hello).await?;
        if ok.heartbeat_ms > 0 {
            conn.set_idle_timeout(Some(Duration::from_millis(
                ok.heartbeat_ms.saturating_mul(IDLE_HEARTBEATS),
            )));
        }
        Ok((conn, ok))
    }

    /// Connect to `url` without sending `hello` (tests of `not_authenticated`, or a
    /// caller that builds its own hello with [`Connection::request`]).
    pub async fn connect_raw(url: &str) -> Result<Connection, ClientError> {
        Connection::connect_raw_tls(url, None).await
    }

    /// Like [`Connection::connect_raw`], with a TLS client configuration for `wss://`
    /// URLs (for example one that trusts a private CA). Without one, `wss://` uses
    /// the system's root certificates.
    pub async fn connect_raw_tls(
        url: &str,
        tls: Option<std::sync::Arc<rustls::ClientConfig>>,
    ) -> Result<Connection, ClientError> {
        // Nagle off: requests are small and latency matters more than packet count.
        let connector = tls.map(tokio_tungstenite::Connector::Rustls);
        let ws_config = WebSocketConfig::default().read_buffer_size(READ_BUFFER_BYTES);
        let (ws, _response) =
            tokio_tungstenite::connect_async_tls_with_config(url, Some(ws_config), true, connector)
                .await
                .map_err(|e| ClientError::Connect(format!("{url}: {}", connect_error(&e))))?;
        Ok(Connection::from_stream(ws))
    }

    /// Like [`Connection::connect`], with a TLS client configuration (see
    /// [`Connection::connect_raw_tls`]).
    pub async fn connect_tls(
        url: &str,
        hello: HelloArgs,
        tls: std::sync::Arc<rustls::ClientConfig>,
    ) -> Result<(Connection, HelloOk), ClientError> {
        let conn = Connection::connect_raw_tls(url, Some(tls)).await?;
        let ok: HelloOk = conn.call("hello", &hello).await?;
        if ok.heartbeat_ms > 0 {
            conn.set_idle_timeout(Some(Duration::from_millis(
                ok.heartbeat_ms.saturating_mul(IDLE_HEARTBEATS),
            )));
        }
        Ok((conn, ok))
    }

    fn from_stream(ws: Ws) -> Connection {
        let shared = Arc::new(Shared {
            pending: Mutex::new(Some(HashMap::new())),
            closed: CancellationToken::new(),
            close_code: Mutex::new(None),
            idle_limit: Mutex::new(None),
            idle_changed: Notify::new(),
        });
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        let (push_tx, push_rx) = mpsc::unbounded_channel();
        let stop = CancellationToken::new();
        let io_task = tokio::spawn(run_io(ws, shared.clone(), out_rx, push_tx, stop.clone()));
        Connection {
            inner: Arc::new(Inner {
                shared,
                next_id: AtomicU64::new(1),
                out: out_tx,
                stop,
                pushes: Mutex::new(Some(push_rx)),
                io_task: Mutex::new(Some(io_task)),
            }),
        }
    }

    /// Send one request and wait for its response: the `ok` value, or the server's
    /// error as [`ClientError::Protocol`], or [`ClientError::Closed`] when the
    /// connection ends first. Other requests proceed concurrently.
    pub async fn request(&self, op: &str, args: Value) -> Result<Value, ClientError> {
        let ok = self
            .exchange(op, |id| Ok(encode_request(id, op, &args)))
            .await?;
        serde_json::from_str(ok.get()).map_err(|e| ClientError::Decode(format!("{op} answer: {e}")))
    }

    /// [`Connection::request`] with typed arguments and a typed answer, each encoded
    /// or decoded in one pass.
    pub async fn call<A: Serialize, R: DeserializeOwned>(
        &self,
        op: &str,
        args: &A,
    ) -> Result<R, ClientError> {
        let ok = self
            .exchange(op, |id| {
                encode_request_typed(id, op, args)
                    .map_err(|e| ClientError::Decode(format!("encode {op} args: {e}")))
            })
            .await?;
        serde_json::from_str(ok.get()).map_err(|e| ClientError::Decode(format!("{op} answer: {e}")))
    }

    /// Send the request `frame(id)` encodes under a fresh id, and wait for its answer
    /// as JSON text.
    async fn exchange(
        &self,
        op: &str,
        frame: impl FnOnce(u64) -> Result<String, ClientError>,
    ) -> Result<Box<RawValue>, ClientError> {
        let shared = &*self.inner.shared;
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let text = frame(id)?;
        let (tx, rx) = oneshot::channel();
        match lock(&shared.pending).as_mut() {
            Some(pending) => {
                pending.insert(id, tx);
            }
            None => return Err(ClientError::Closed),
        }
        let _guard = PendingGuard { shared, id };
        trace!(id, op, "sending request");
        if self.inner.out.send(Message::text(text)).is_err() {
            return Err(ClientError::Closed);
        }
        match rx.await {
            Ok(result) => result,
            Err(_) => Err(ClientError::Closed),
        }
    }

    /// Take the stream of pushes (`invoke`, `cancel`, `probe`, `event`). Only the first
    /// call gets it; later calls return `None`. The stream ends with the connection.
    /// Pushes arriving before it is taken are kept.
    pub fn pushes(&self) -> Option<mpsc::UnboundedReceiver<Push>> {
        lock(&self.inner.pushes).take()
    }

    /// Whether the connection has ended.
    pub fn is_closed(&self) -> bool {
        self.inner.shared.closed.is_cancelled()
    }

    /// Resolves when the connection has ended (at once if it already has).
    pub async fn closed(&self) {
        self.inner.shared.closed.cancelled().await
    }

    /// The close code the server sent, if it closed the connection with one
    /// (e.g. [`turnd_proto::CLOSE_SUPERSEDED`]).
    pub fn close_code(&self) -> Option<u16> {
        *lock(&self.inner.shared.close_code)
    }

    /// End the connection when nothing at all arrives from the server for `limit`
    /// (`None`: never). [`Connection::connect`] sets it to 3 × the server's
    /// `heartbeat_ms`, mirroring the server's own rule: the server pings every
    /// `heartbeat_ms`, so a longer silence means the server or the path to it is gone
    /// (a half-open TCP connection would otherwise wait for minutes).
    pub fn set_idle_timeout(&self, limit: Option<Duration>) {
        *lock(&self.inner.shared.idle_limit) = limit;
        self.inner.shared.idle_changed.notify_one();
    }

    /// Close the connection and wait until it has ended. Outstanding requests fail
    /// with [`ClientError::Closed`].
    pub async fn close(&self) {
        self.inner.stop.cancel();
        let task = lock(&self.inner.io_task).take();
        if let Some(task) = task {
            if let Err(e) = task.await {
                warn!("connection I/O task failed: {e}");
            }
        }
        self.closed().await;
    }
}

/// The I/O task: writes queued requests, reads responses and pushes, and reports the
/// end of the connection to everyone waiting.
async fn run_io(
    mut ws: Ws,
    shared: Arc<Shared>,
    mut out_rx: mpsc::UnboundedReceiver<Message>,
    push_tx: mpsc::UnboundedSender<Push>,
    stop: CancellationToken,
) {
    // Whether we close (send a close frame and wait for the server's), and whether
    // the server closed (tungstenite has queued the reply that must be flushed).
    let mut close_gracefully = false;
    let mut peer_closed = false;
    // Silence detection: one timer, moved only when it fires or the limit changes,
    // so a busy connection pays one clock read per frame and nothing more.
    let mut last_rx = Instant::now();
    let idle_deadline = |last_rx: Instant| match *lock(&shared.idle_limit) {
        Some(limit) => last_rx + limit,
        None => Instant::now() + NEVER,
    };
    let idle = tokio::time::sleep_until(idle_deadline(last_rx));
    tokio::pin!(idle);
    loop {
        tokio::select! {
            () = shared.idle_changed.notified() => {
                idle.as_mut().reset(idle_deadline(last_rx));
            }
            () = &mut idle => {
                let deadline = idle_deadline(last_rx);
                if deadline <= Instant::now() {
                    warn!(silent_ms = last_rx.elapsed().as_millis() as u64, "nothing received from the server for too long; dropping the connection");
                    break;
                }
                idle.as_mut().reset(deadline);
            }
            _ = stop.cancelled() => {
                close_gracefully = true;
                break;
            }
            msg = out_rx.recv() => match msg {
                Some(msg) => {
                    if let Err(e) = write_queued(&mut ws, msg, &mut out_rx).await {
                        debug!("failed to write to the connection: {e}");
                        break;
                    }
                }
                None => {
                    close_gracefully = true;
                    break;
                }
            },
            frame = ws.next() => {
                last_rx = Instant::now();
                match read_frame(&shared, &push_tx, frame) {
                    Read::Going => {}
                    Read::Ended => break,
                    Read::PeerClosed => {
                        peer_closed = true;
                        break;
                    }
                }
            }
        }
    }
    // Fail outstanding requests before anything else so that nobody waits on a
    // socket that is shutting down.
    shared.finish();
    drop(push_tx);
    linger(ws, peer_closed, close_gracefully).await;
}

/// Write `first` and the requests already queued behind it in one write: one flush
/// (one send syscall) for the lot. When the queue runs dry it yields once before the
/// flush, so that tasks already woken on this thread add their requests to the same
/// write (with nothing else to run the yield returns at once).
async fn write_queued(
    ws: &mut Ws,
    first: Message,
    out_rx: &mut mpsc::UnboundedReceiver<Message>,
) -> Result<(), tokio_tungstenite::tungstenite::Error> {
    let mut written = ws.feed(first).await;
    let mut batched = 1;
    let mut yielded = false;
    while written.is_ok() && batched < WRITE_BATCH_FRAMES {
        let Ok(more) = out_rx.try_recv() else {
            if yielded {
                break;
            }
            yielded = true;
            tokio::task::yield_now().await;
            continue;
        };
        written = ws.feed(more).await;
        batched += 1;
    }
    match written {
        Ok(()) => ws.flush().await,
        Err(e) => Err(e),
    }
}

/// What a frame read from the server means for the connection.
enum Read {
    /// It goes on.
    Going,
    /// It ended (the stream ended or failed).
    Ended,
    /// The server closed it: its close frame is answered while lingering.
    PeerClosed,
}

/// Take one frame read from the server: answers and pushes are handed on.
fn read_frame(
    shared: &Shared,
    push_tx: &mpsc::UnboundedSender<Push>,
    frame: Option<Result<Message, tokio_tungstenite::tungstenite::Error>>,
) -> Read {
    match frame {
        None => Read::Ended,
        Some(Err(e)) => {
            debug!("failed to read from the connection: {e}");
            Read::Ended
        }
        Some(Ok(Message::Text(text))) => {
            handle_text(shared, push_tx, text.as_str());
            Read::Going
        }
        Some(Ok(Message::Close(frame))) => {
            if let Some(frame) = frame {
                debug!(code = u16::from(frame.code), reason = %frame.reason, "server closed the connection");
                *lock(&shared.close_code) = Some(u16::from(frame.code));
            }
            // Nothing may follow a close frame: the connection has ended for us now,
            // even if the server is slow to drop the socket.
            Read::PeerClosed
        }
        Some(Ok(Message::Binary(_))) => {
            warn!("ignoring a binary frame from the server (protocol v1 is text only)");
            Read::Going
        }
        Some(Ok(_)) => Read::Going, // ping/pong: answered by tungstenite
    }
}

/// The end of a connection: answer the server's close, or send ours and wait for
/// its answer, for at most `CLOSE_LINGER`.
async fn linger(mut ws: Ws, peer_closed: bool, close_gracefully: bool) {
    let linger = async {
        if peer_closed {
            if let Err(e) = ws.flush().await {
                trace!("failed to answer the server's close: {e}");
            }
        } else if close_gracefully {
            if let Err(e) = ws.close(None).await {
                trace!("failed to send close frame: {e}");
            }
            // Until the server's close frame (handshake done) or the end of the stream.
            while let Some(Ok(msg)) = ws.next().await {
                if msg.is_close() {
                    break;
                }
            }
        }
    };
    if tokio::time::timeout(CLOSE_LINGER, linger).await.is_err() {
        trace!("server did not finish the close handshake in time");
    }
}

fn handle_text(shared: &Shared, push_tx: &mpsc::UnboundedSender<Push>, text: &str) {
    let frame = match decode_raw_server_frame(text) {
        Ok(frame) => frame,
        Err(e) => {
            warn!("ignoring an undecodable frame from the server: {e}");
            return;
        }
    };
    let (id, result) = match frame {
        RawServerFrame::Push(push) => {
            if push_tx.send(push).is_err() {
                trace!("push dropped: its receiver is gone");
            }
            return;
        }
        RawServerFrame::Ok { id, ok } => (id, Ok(ok.to_owned())),
        RawServerFrame::Error {
            id: Some(id),
            error,
        } => (id, Err(ClientError::Protocol(error))),
        RawServerFrame::Error { id: None, error } => {
            warn!("server reported an error for no request: {error}");
            return;
        }
    };
    let reply = lock(&shared.pending).as_mut().and_then(|p| p.remove(&id));
    match reply {
        Some(reply) => {
            if reply.send(result).is_err() {
                trace!(id, "requester gone before its answer arrived");
            }
        }
        None => debug!(id, "answer for a request nobody waits for"),
    }
}
