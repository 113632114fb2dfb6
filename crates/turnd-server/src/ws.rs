//! WebSocket protocol v1: one task reads a connection, one writes it.
//!
//! The reader decodes frames, answers bad ones, runs `hello` in line (so the
//! connection's role is settled before anything else runs) and spawns every other
//! request as its own task, so a `turn.wait` never holds up the connection. The
//! writer drains the connection's bounded [`Outbox`] and sends the server pings. A
//! peer that does not read fast enough overflows its outbox and is disconnected.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio_tungstenite::tungstenite::handshake::server::{
    ErrorResponse, Request as HttpRequest, Response,
};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use turnd_engine::{Caller, CloseReason, Engine, Outbox};
use turnd_proto::frame::{encode_error, encode_ok, encode_ok_text, to_json_text, FRAME_CAPACITY};
use turnd_proto::*;

use crate::config::Config;
use crate::error::to_wire;

/// State shared by every connection.
pub struct Shared {
    pub engine: Engine,
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

/// A connection's place in the limits; released when dropped.
struct Slot<'a> {
    counts: &'a ConnectionCounts,
    ip: std::net::IpAddr,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.counts.total.fetch_sub(1, Ordering::Relaxed);
        if let Ok(mut m) = self.counts.per_ip.lock() {
            if let Some(n) = m.get_mut(&self.ip) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    m.remove(&self.ip);
                }
            }
        }
    }
}

impl ConnectionCounts {
    /// Take a slot for a new connection from `ip`, or say which limit refuses it.
    fn admit(&self, ip: std::net::IpAddr, max_total: u64, max_ip: u64) -> Result<Slot<'_>, String> {
        let total = self.total.fetch_add(1, Ordering::Relaxed) + 1;
        let mut m = self.per_ip.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(ip).or_insert(0);
        *n += 1;
        let per_ip = *n;
        drop(m);
        let slot = Slot { counts: self, ip };
        if total > max_total {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(format!(
                "the server holds its maximum of {max_total} connections (server.max_connections)"
            ));
        }
        if per_ip > max_ip {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(format!(
                "{ip} holds its maximum of {max_ip} connections (server.max_connections_per_ip)"
            ));
        }
        Ok(slot)
    }
}

/// Whether a JSON text nests deeper than `max` (counted without parsing, so a
/// hostile frame cannot make the parser recurse).
fn too_deep(text: &str, max: u64) -> bool {
    let mut depth = 0u64;
    let mut in_str = false;
    let mut escaped = false;
    for b in text.bytes() {
        if in_str {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_str = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_str = true,
            b'{' | b'[' => {
                depth += 1;
                if depth > max {
                    return true;
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

/// A token bucket: `rate` requests per second, bursts up to `rate`.
#[derive(Debug)]
struct Bucket {
    rate: f64,
    tokens: f64,
    at: tokio::time::Instant,
}

impl Bucket {
    /// The bucket of a `max_requests_per_second`; none when it is 0 (no limit).
    fn new(rate: u64) -> Option<Bucket> {
        (rate > 0).then(|| Bucket {
            rate: rate as f64,
            tokens: rate as f64,
            at: tokio::time::Instant::now(),
        })
    }

    fn take(&mut self) -> bool {
        let now = tokio::time::Instant::now();
        let dt = now.duration_since(self.at).as_secs_f64();
        self.at = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.rate);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
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

struct Auth {
    role: Role,
    worker_id: Option<String>,
}

struct Conn {
    shared: Arc<Shared>,
    outbox: Outbox,
    auth: OnceLock<Auth>,
    peer: SocketAddr,
    /// Requests of this connection being run (spawned and not yet answered).
    inflight: AtomicU64,
}

/// One request counted as in flight on its connection and in the daemon's total;
/// uncounted when dropped, however the request task ends.
struct InFlight(Arc<Conn>);

impl InFlight {
    /// Count a request, unless the connection already runs `max`.
    fn take(conn: &Arc<Conn>, max: u64) -> Option<InFlight> {
        if conn.inflight.fetch_add(1, Ordering::Relaxed) >= max {
            conn.inflight.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        conn.shared
            .connections
            .requests_inflight
            .fetch_add(1, Ordering::Relaxed);
        Some(InFlight(conn.clone()))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
        self.0
            .shared
            .connections
            .requests_inflight
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// Size at which a connection's set of exempted invocations (see
/// [`Exempted`]) first drops those no longer live.
const EXEMPTED_PRUNE_AT: usize = 4096;

/// The invocations whose first result on a connection was not counted against its
/// request rate (see [`Conn::exempt_result`]). Invocation ids are never reused, so an
/// id that is no longer live can never be exempted again and is dropped when the set
/// reaches `prune_at`; after a prune the threshold is twice what stayed, so a worker
/// with thousands of live invocations does not make every exemption a full pass.
struct Exempted {
    ids: HashSet<String>,
    prune_at: usize,
}

fn bad(code: ErrorCode, msg: impl Into<String>) -> ErrorBody {
    ErrorBody::new(code, msg)
}

/// Decode a request's `args` (its JSON text) into the op's typed arguments.
fn args<T: DeserializeOwned>(text: &str) -> Result<T, ErrorBody> {
    serde_json::from_str(text).map_err(|e| bad(ErrorCode::BadRequest, format!("bad `args`: {e}")))
}

/// A successful answer, already serialized (JSON text written by serde_json):
/// written into the `ok` frame as is.
type Reply = String;

fn ok<T: serde::Serialize>(v: T) -> Result<Reply, ErrorBody> {
    to_json_text(&v, FRAME_CAPACITY)
        .map_err(|e| bad(ErrorCode::Internal, format!("encode response: {e}")))
}

/// Size of a connection's WebSocket read buffer. tungstenite zero-fills the whole
/// buffer before every read of the socket, including reads that find nothing; at its
/// default of 128 KiB that zeroing was about 2% of all CPU under load. Frames are
/// mostly far smaller, and a larger frame only takes more reads.
const READ_BUFFER_BYTES: usize = 8 * 1024;

/// Most frames a connection's writer takes from its queue before it flushes them.
const WRITE_BATCH_FRAMES: usize = 64;

/// How long a connection closed for a frame over `max_frame_bytes` goes on reading
/// (and dropping) what the peer still sends of it; see [`linger`].
const LINGER: Duration = Duration::from_secs(1);

/// Serve one accepted TCP connection until it ends.
#[allow(
    clippy::too_many_lines,
    reason = "the reader loop of a connection: one select over its sources, on the hot path"
)]
pub async fn serve_connection<S>(shared: Arc<Shared>, stream: S, peer: SocketAddr)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let max = shared.config.server.max_frame_bytes as usize;
    let ws_config = WebSocketConfig::default()
        .read_buffer_size(READ_BUFFER_BYTES)
        .max_message_size(Some(max))
        .max_frame_size(Some(max));
    // The handshake callback's error type is fixed by tungstenite.
    #[allow(clippy::result_large_err)]
    let check_path = |req: &HttpRequest, resp: Response| -> Result<Response, ErrorResponse> {
        if req.uri().path() == WS_PATH {
            Ok(resp)
        } else {
            let mut r = ErrorResponse::new(Some(format!(
                "no such path; protocol v1 is served at {WS_PATH}\n"
            )));
            *r.status_mut() = tokio_tungstenite::tungstenite::http::StatusCode::NOT_FOUND;
            Err(r)
        }
    };
    let ws =
        match tokio_tungstenite::accept_hdr_async_with_config(stream, check_path, Some(ws_config))
            .await
        {
            Ok(ws) => ws,
            Err(e) => {
                tracing::debug!(%peer, "WebSocket handshake failed: {e}");
                return;
            }
        };
    let limits = &shared.config.server;
    let _slot = match shared.connections.admit(
        peer.ip(),
        limits.max_connections,
        limits.max_connections_per_ip,
    ) {
        Ok(slot) => slot,
        Err(why) => {
            tracing::warn!(%peer, "connection refused: {why}");
            let mut ws = ws;
            let body = bad(ErrorCode::RateLimited, why);
            if ws
                .send(Message::text(encode_error(None, &body)))
                .await
                .is_ok()
            {
                let frame = CloseFrame {
                    code: CloseCode::from(1013),
                    reason: "connection limit".into(),
                };
                if let Err(e) = ws.send(Message::Close(Some(frame))).await {
                    tracing::debug!("close frame not sent: {e}");
                }
            }
            return;
        }
    };
    let conn_id = new_connection_id();
    let (outbox, out_rx) =
        Outbox::new(conn_id.clone(), shared.config.server.outbox_frames as usize);
    let conn = Arc::new(Conn {
        shared: shared.clone(),
        outbox: outbox.clone(),
        auth: OnceLock::new(),
        peer,
        inflight: AtomicU64::new(0),
    });
    shared.connections.of(None).fetch_add(1, Ordering::Relaxed);
    tracing::debug!(%peer, conn_id, "connection opened");
    let (sink, mut stream) = ws.split();
    let heartbeat = Duration::from_millis(shared.config.server.heartbeat_ms);

    let stall = Duration::from_millis(shared.config.server.write_stall_ms);
    let (close_tx, close_rx) = tokio::sync::oneshot::channel();
    let writer = tokio::spawn(write_loop(
        sink,
        out_rx,
        outbox.clone(),
        close_rx,
        heartbeat,
        stall,
    ));

    let mut bad_in_row = 0u32;
    let mut bucket = Bucket::new(shared.config.server.max_requests_per_second);
    // Invocations whose first result on this connection was not counted by `bucket`.
    let mut exempted = Exempted {
        ids: HashSet::new(),
        prune_at: EXEMPTED_PRUNE_AT,
    };
    let max_depth = shared.config.server.max_json_depth;
    let close: Option<(u16, String)> = loop {
        let next = tokio::select! {
            n = tokio::time::timeout(heartbeat * 3, stream.next()) => n,
            _ = outbox.closed() => break None,
            _ = shared.closing.cancelled() => break Some((1001, "server shutting down".into())),
        };
        let msg = match next {
            Err(_) => {
                tracing::info!(%peer, conn_id, "peer silent for 3 heartbeats; closing");
                break Some((1001, "no frames for 3 heartbeats".into()));
            }
            Ok(None) => break None,
            Ok(Some(Err(WsError::Capacity(e)))) => {
                let body = bad(
                    ErrorCode::TooLarge,
                    format!("frame over max_frame_bytes ({max}): {e}"),
                );
                outbox.push(encode_error(None, &body));
                break Some((CLOSE_TOO_BIG, "frame too large".into()));
            }
            Ok(Some(Err(e))) => {
                tracing::debug!(%peer, conn_id, "connection error: {e}");
                break None;
            }
            Ok(Some(Ok(m))) => m,
        };
        let text = match msg {
            Message::Text(t) => t,
            Message::Binary(_) => {
                bad_in_row += 1;
                let body = bad(
                    ErrorCode::BadFrame,
                    "binary frames are not accepted; send JSON text frames",
                );
                if !conn.respond_error(None, body).await {
                    break None;
                }
                if bad_in_row >= MAX_BAD_FRAMES {
                    break Some((CLOSE_POLICY, "too many bad frames in a row".into()));
                }
                continue;
            }
            Message::Close(_) => break None,
            _ => continue,
        };
        if too_deep(text.as_str(), max_depth) {
            bad_in_row += 1;
            let body = bad(
                ErrorCode::TooLarge,
                format!("JSON nests deeper than server.max_json_depth ({max_depth})"),
            );
            if !conn.respond_error(None, body).await {
                break None;
            }
            if bad_in_row >= MAX_BAD_FRAMES {
                break Some((CLOSE_POLICY, "too many bad frames in a row".into()));
            }
            continue;
        }
        let req = match decode_raw_request(text.as_str()) {
            Ok(r) => r,
            Err(fe) => {
                bad_in_row += 1;
                if !conn
                    .respond_error(fe.id, bad(ErrorCode::BadFrame, fe.message))
                    .await
                {
                    break None;
                }
                if bad_in_row >= MAX_BAD_FRAMES {
                    break Some((CLOSE_POLICY, "too many bad frames in a row".into()));
                }
                continue;
            }
        };
        bad_in_row = 0;
        if bucket.is_some()
            && !conn.exempt_result(&req, &mut exempted)
            && !bucket.as_mut().is_some_and(Bucket::take)
        {
            let body = bad(
                ErrorCode::RateLimited,
                format!(
                    "more than {} requests per second on this connection",
                    shared.config.server.max_requests_per_second
                ),
            );
            if !conn.respond_error(Some(req.id), body).await {
                break None;
            }
            continue;
        }
        if req.op == Op::Hello.name() {
            let r = conn.hello(req.args_text()).await;
            if !conn.respond(req.id, r).await {
                break None;
            }
            continue;
        }
        let Some(auth) = conn.auth.get() else {
            let body = bad(ErrorCode::NotAuthenticated, "send `hello` first");
            if !conn.respond_error(Some(req.id), body).await {
                break None;
            }
            continue;
        };
        let Some(op) = Op::parse(&req.op) else {
            let body = bad(
                ErrorCode::UnknownOp,
                format!("no op {:?} in protocol v1", req.op),
            );
            if !conn.respond_error(Some(req.id), body).await {
                break None;
            }
            continue;
        };
        if !op.allowed_for(auth.role) {
            let body = bad(
                ErrorCode::Forbidden,
                format!("role {} may not use {}", auth.role.as_str(), op.name()),
            );
            if !conn.respond_error(Some(req.id), body).await {
                break None;
            }
            continue;
        }
        if shared.draining.is_cancelled() && op != Op::Ping {
            let body = bad(
                ErrorCode::ShuttingDown,
                "the server is shutting down; nothing was changed",
            );
            if !conn.respond_error(Some(req.id), body).await {
                break None;
            }
            continue;
        }
        let max_inflight = shared.config.server.max_inflight_per_connection;
        let Some(counted) = InFlight::take(&conn, max_inflight) else {
            let body = bad(
                ErrorCode::RateLimited,
                format!(
                    "this connection already has {max_inflight} requests in progress \
                     (server.max_inflight_per_connection); wait for their answers"
                ),
            );
            if !conn.respond_error(Some(req.id), body).await {
                break None;
            }
            continue;
        };
        let id = req.id;
        let a = req.args_text().to_owned();
        shared.requests.spawn(async move {
            let c = &counted.0;
            let r = c.run(op, &a, id).await;
            if let Some(r) = r {
                c.respond(id, r).await;
            }
            drop(counted);
        });
    };
    // Tag the outbox first, then say which close frame: the writer sends the frame
    // of whichever cause tagged it first, this one or the engine's.
    outbox.close_with(CloseReason::ReaderEnded);
    let too_big = matches!(close, Some((CLOSE_TOO_BIG, _)));
    if close_tx.send(close).is_err() {
        tracing::trace!("writer already gone");
    }
    shared.engine.connection_closed(&conn_id);
    let role = conn.auth.get().map(|a| a.role);
    if let Some(Auth {
        worker_id: Some(w), ..
    }) = conn.auth.get()
    {
        shared.engine.worker_disconnected(w, &conn_id).await;
    }
    shared.connections.of(role).fetch_sub(1, Ordering::Relaxed);
    match tokio::time::timeout(Duration::from_secs(2), writer).await {
        Ok(Ok(sink)) if too_big => match sink.reunite(stream) {
            Ok(ws) => linger(ws, &shared.closing).await,
            Err(e) => tracing::debug!(conn_id, "no socket to linger on: {e}"),
        },
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::debug!(conn_id, "writer failed: {e}"),
        Err(_) => tracing::debug!(conn_id, "writer did not finish in time"),
    }
    tracing::debug!(%peer, conn_id, "connection closed");
}

/// After the close for a frame over `max_frame_bytes`, whose rest is still arriving
/// unread: a socket closed with unread data makes the kernel answer with a reset,
/// which can reach the peer before the close frame does and make its system drop that
/// frame unread, so the peer would see a reset instead of close code 1009. The write
/// side is shut instead (the peer reads the close frame, then the end of the stream),
/// and what still arrives is read and dropped until the peer closes, for at most
/// [`LINGER`], and no longer once the daemon closes its connections. (A writer that
/// took longer than its 2 s to send the close frame has dropped its socket already:
/// there is nothing to linger on.)
async fn linger<S>(mut ws: tokio_tungstenite::WebSocketStream<S>, closing: &CancellationToken)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let raw = ws.get_mut();
    let drain = async {
        if let Err(e) = raw.shutdown().await {
            tracing::trace!("shutdown of the write side: {e}");
        }
        let mut buf = vec![0u8; READ_BUFFER_BYTES];
        while let Ok(n) = raw.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    };
    tokio::select! {
        drained = tokio::time::timeout(LINGER, drain) => if drained.is_err() {
            tracing::debug!("peer still sending {} ms after the close", LINGER.as_millis());
        },
        _ = closing.cancelled() => {}
    }
}

/// The close frame (code, reason) for why the engine closed a connection; `None`:
/// send none.
fn engine_close_frame(r: CloseReason) -> Option<(u16, String)> {
    let (code, reason) = match r {
        CloseReason::Superseded => (
            CLOSE_SUPERSEDED,
            "superseded by a newer connection of this worker_id",
        ),
        CloseReason::SlowReader => (
            1008,
            "outgoing queue full: the peer does not read fast enough",
        ),
        CloseReason::Unavailable => (
            1011,
            "a watch's events could not be read from the store; watch again with `after`",
        ),
        CloseReason::ServerClosing => (1001, "server closing"),
        CloseReason::ReaderEnded => return None,
    };
    Some((code, reason.to_string()))
}

/// The close frame of a closed connection: the first cause that tagged its outbox
/// decides. The reader tags it ([`CloseReason::ReaderEnded`]) just before it sends
/// its own choice on `from_reader` (`None`: the peer is gone, no frame); any other
/// tag is the engine's.
async fn close_frame(
    outbox: &Outbox,
    from_reader: &mut tokio::sync::oneshot::Receiver<Option<(u16, String)>>,
) -> Option<(u16, String)> {
    match outbox.close_reason() {
        Some(CloseReason::ReaderEnded) => from_reader.await.ok().flatten(),
        Some(r) => engine_close_frame(r),
        None => Some((1001, "server closing".to_string())),
    }
}

/// The writer of a connection: drains the outbox, pings, and sends the close
/// frame. Every write must finish within `stall`: a peer that does not read fills
/// the socket's buffers, and the connection is then closed (1008) rather than
/// holding its queue and every request waiting for room in it.
///
/// The connection ends when its outbox is closed, by the engine or by the reader
/// (which tags it, then sends its close frame on `from_reader`). Only that one arm
/// ends the loop, and the frame is the first tag's whichever way it was woken, so
/// the peer gets the same close code however the arms race.
async fn write_loop<S>(
    mut sink: S,
    mut out_rx: tokio::sync::mpsc::Receiver<String>,
    outbox: Outbox,
    mut from_reader: tokio::sync::oneshot::Receiver<Option<(u16, String)>>,
    heartbeat: Duration,
    stall: Duration,
) -> S
where
    S: futures_util::Sink<Message, Error = WsError> + Unpin,
{
    let mut ping = tokio::time::interval(heartbeat);
    ping.tick().await;
    let close = loop {
        let wrote = tokio::select! {
            frame = out_rx.recv() => match frame {
                Some(f) => {
                    // Frames already queued behind this one go out in the same
                    // write: one flush (one send syscall) for the lot. When the queue
                    // runs dry the writer yields once before it flushes, so that the
                    // tasks already woken on this thread (answers and pushes being
                    // made) add theirs to the same write; with nothing else to run the
                    // yield returns at once. Under `turnd-bench sessions` this cut the
                    // process's CPU per turn by 16 - 20 % (docs/benchmarks.md).
                    let write = async {
                        sink.feed(Message::text(f)).await?;
                        let mut batched = 1;
                        let mut yielded = false;
                        while batched < WRITE_BATCH_FRAMES {
                            let Ok(more) = out_rx.try_recv() else {
                                if yielded {
                                    break;
                                }
                                yielded = true;
                                tokio::task::yield_now().await;
                                continue;
                            };
                            sink.feed(Message::text(more)).await?;
                            batched += 1;
                        }
                        sink.flush().await
                    };
                    tokio::time::timeout(stall, write).await
                }
                None => break None,
            },
            _ = ping.tick() => {
                tokio::time::timeout(stall, sink.send(Message::Ping(Vec::new().into()))).await
            }
            _ = outbox.closed() => break close_frame(&outbox, &mut from_reader).await,
        };
        match wrote {
            Ok(Ok(())) => {}
            Ok(Err(_)) => break None,
            Err(_) => {
                outbox.close_with(CloseReason::SlowReader);
                break match outbox.close_reason() {
                    Some(CloseReason::SlowReader) => Some((
                        1008,
                        format!(
                            "nothing could be written for {} ms: the peer does not read",
                            stall.as_millis()
                        ),
                    )),
                    _ => close_frame(&outbox, &mut from_reader).await,
                };
            }
        }
    };
    // Flush what is queued (responses already promised), then close; a peer that
    // does not read gets no longer than `stall` for all of it.
    let finish = async {
        while let Ok(f) = out_rx.try_recv() {
            if sink.send(Message::text(f)).await.is_err() {
                break;
            }
        }
        if let Some((code, reason)) = close {
            let frame = CloseFrame {
                code: CloseCode::from(code),
                reason: reason.into(),
            };
            if let Err(e) = sink.send(Message::Close(Some(frame))).await {
                tracing::debug!("close frame not sent: {e}");
            }
        }
        if let Err(e) = sink.close().await {
            tracing::trace!("socket close: {e}");
        }
    };
    if tokio::time::timeout(stall, finish).await.is_err() {
        tracing::debug!("connection closed without its last frames: the peer does not read");
    }
    sink
}

impl Conn {
    async fn respond(&self, id: u64, r: Result<Reply, ErrorBody>) -> bool {
        match r {
            Ok(v) => self.outbox.send(encode_ok_text(id, &v)).await,
            Err(e) => self.respond_error(Some(id), e).await,
        }
    }

    async fn respond_error(&self, id: Option<u64>, e: ErrorBody) -> bool {
        self.outbox.send(encode_error(id, &e)).await
    }

    fn token_ok(&self, role: Role, token: Option<&str>) -> bool {
        let tokens = &self.shared.config.auth.tokens;
        if tokens.is_empty() {
            return true;
        }
        let given = token.unwrap_or("").as_bytes();
        let mut ok = false;
        for t in tokens {
            // Compare against every token in constant time, whatever matches first.
            let eq = constant_time_eq::constant_time_eq(t.token.as_bytes(), given);
            ok |= eq && (t.role == role || t.role == Role::Operator);
        }
        ok
    }

    async fn hello(&self, a: &str) -> Result<Reply, ErrorBody> {
        if self.auth.get().is_some() {
            return Err(bad(
                ErrorCode::Conflict,
                "this connection already said hello",
            ));
        }
        if self.shared.draining.is_cancelled() {
            return Err(bad(ErrorCode::ShuttingDown, "the server is shutting down"));
        }
        let h: HelloArgs = args(a)?;
        if h.protocol != PROTOCOL_VERSION {
            return Err(bad(
                ErrorCode::UnsupportedProtocol,
                format!(
                    "protocol {} is not supported; this server speaks {PROTOCOL_VERSION}",
                    h.protocol
                ),
            ));
        }
        if !self.token_ok(h.role, h.token.as_deref()) {
            tracing::warn!(peer = %self.peer, role = h.role.as_str(), "hello refused: token does not match");
            return Err(bad(
                ErrorCode::NotAuthenticated,
                format!("token not accepted for role {}", h.role.as_str()),
            ));
        }
        // A worker, or an operator that names a worker_id, serves functions from this
        // connection; an operator may use every op.
        let serves = h.role == Role::Worker || (h.role == Role::Operator && h.worker_id.is_some());
        let reconciled = if serves {
            Some(
                self.shared
                    .engine
                    .worker_hello(&h, self.outbox.clone())
                    .await
                    .map_err(to_wire)?,
            )
        } else {
            None
        };
        let auth = Auth {
            role: h.role,
            worker_id: if serves { h.worker_id.clone() } else { None },
        };
        if self.auth.set(auth).is_err() {
            return Err(bad(
                ErrorCode::Conflict,
                "this connection already said hello",
            ));
        }
        let counts = &self.shared.connections;
        counts.of(None).fetch_sub(1, Ordering::Relaxed);
        counts.of(Some(h.role)).fetch_add(1, Ordering::Relaxed);
        let cfg = &self.shared.config.server;
        ok(HelloOk {
            server: "turnd".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            boot_id: self.shared.engine.boot_id().to_string(),
            connection_id: self.outbox.conn_id.clone(),
            heartbeat_ms: cfg.heartbeat_ms,
            max_frame_bytes: cfg.max_frame_bytes,
            reconciled,
        })
    }

    /// Whether the request is the first `invocation.result` on this connection for a
    /// live invocation dispatched to this worker; such a result is not counted against
    /// the connection's request rate. The daemon dispatches no more than the
    /// concurrency the worker registered, and each invocation is exempted once
    /// ([`Exempted`] remembers it, whatever its result turned out to be), so the
    /// exemptions are bounded by the dispatches; refusing a result would only hold a
    /// finished step back until the worker resends it. Resends, malformed results and
    /// every other request are counted.
    fn exempt_result(&self, req: &RawRequest<'_>, exempted: &mut Exempted) -> bool {
        #[derive(serde::Deserialize)]
        struct Id<'a> {
            #[serde(borrow)]
            invocation_id: std::borrow::Cow<'a, str>,
        }
        if req.op != Op::InvocationResult.name() {
            return false;
        }
        let Some(worker_id) = self
            .auth
            .get()
            .filter(|a| a.role == Role::Worker)
            .and_then(|a| a.worker_id.as_deref())
        else {
            return false;
        };
        let Ok(a) = serde_json::from_str::<Id<'_>>(req.args_text()) else {
            return false;
        };
        let engine = &self.shared.engine;
        if exempted.ids.contains(a.invocation_id.as_ref())
            || !engine.is_assigned(worker_id, &a.invocation_id)
        {
            return false;
        }
        if exempted.ids.len() >= exempted.prune_at {
            engine.retain_assigned(worker_id, &mut exempted.ids);
            exempted.prune_at = EXEMPTED_PRUNE_AT.max(2 * exempted.ids.len());
        }
        exempted.ids.insert(a.invocation_id.into_owned());
        true
    }

    fn caller(&self) -> Caller {
        let a = self.auth.get();
        Caller {
            role: a.map(|a| a.role).unwrap_or(Role::Client),
            worker_id: a.and_then(|a| a.worker_id.clone()),
        }
    }

    fn worker_id(&self) -> Result<String, ErrorBody> {
        self.auth
            .get()
            .and_then(|a| a.worker_id.clone())
            .ok_or_else(|| {
                bad(
                    ErrorCode::Forbidden,
                    "this op needs a worker connection (hello with role worker, or operator with a worker_id)",
                )
            })
    }

    /// Run one request. `None` means the response was already sent (watch).
    #[allow(
        clippy::too_many_lines,
        reason = "the dispatch of the request path: one short arm per op"
    )]
    async fn run(&self, op: Op, a: &str, id: u64) -> Option<Result<Reply, ErrorBody>> {
        let e = &self.shared.engine;
        let r = match op {
            Op::Hello => Err(bad(
                ErrorCode::Conflict,
                "this connection already said hello",
            )),
            Op::Ping => ok(serde_json::json!({})),
            Op::FunctionRegister => match (self.worker_id(), args::<RegisterArgs>(a)) {
                (Ok(w), Ok(r)) => e.register(&w, &r).map_err(to_wire).and_then(ok),
                (Err(x), _) | (_, Err(x)) => Err(x),
            },
            Op::FunctionUnregister => match (self.worker_id(), args::<FunctionIdArgs>(a)) {
                (Ok(w), Ok(r)) => e
                    .unregister(&w, &r.function_id)
                    .map_err(to_wire)
                    .and_then(|_| ok(serde_json::json!({}))),
                (Err(x), _) | (_, Err(x)) => Err(x),
            },
            Op::InvocationResult => match args::<ResultArgs>(a) {
                Ok(r) => e
                    .result(&self.caller(), r)
                    .await
                    .map_err(to_wire)
                    .and_then(ok),
                Err(x) => Err(x),
            },
            Op::InvocationHeartbeat => match args::<InvocationIdArgs>(a) {
                Ok(r) => e
                    .heartbeat(&self.caller(), &r.invocation_id)
                    .await
                    .map_err(to_wire)
                    .and_then(ok),
                Err(x) => Err(x),
            },
            Op::InvocationStatus => match args::<StatusArgs>(a) {
                Ok(r) => e
                    .status(&self.caller(), &r)
                    .await
                    .map_err(to_wire)
                    .and_then(|_| ok(serde_json::json!({}))),
                Err(x) => Err(x),
            },
            Op::TurnSubmit => match args::<SubmitArgs>(a) {
                Ok(r) => e.submit(r).await.map_err(to_wire).and_then(ok),
                Err(x) => Err(x),
            },
            Op::TurnGet => match args::<TurnIdArgs>(a) {
                Ok(r) => e
                    .get_turn(&r.turn_id)
                    .await
                    .map_err(to_wire)
                    .and_then(|turn| ok(TurnOk { turn })),
                Err(x) => Err(x),
            },
            Op::TurnWait => match args::<WaitArgs>(a) {
                Ok(r) => e
                    .wait_turn(&r.turn_id, r.timeout_ms)
                    .await
                    .map_err(to_wire)
                    .and_then(|turn| ok(TurnOk { turn })),
                Err(x) => Err(x),
            },
            Op::TurnStop => match args::<StopArgs>(a) {
                Ok(r) => e
                    .stop_turn(&r.turn_id, r.reason)
                    .await
                    .map_err(to_wire)
                    .and_then(|turn| ok(TurnOk { turn })),
                Err(x) => Err(x),
            },
            Op::TurnList => match args::<ListArgs>(a) {
                Ok(r) => e.list_turns(r).await.map_err(to_wire).and_then(ok),
                Err(x) => Err(x),
            },
            Op::SessionInspect => match args::<SessionIdArgs>(a) {
                Ok(r) => e
                    .inspect(&r.session_id)
                    .await
                    .map_err(to_wire)
                    .and_then(|session| ok(SessionOk { session })),
                Err(x) => Err(x),
            },
            Op::SessionStop => match args::<SessionStopArgs>(a) {
                Ok(r) => e
                    .stop_session(&r.session_id, r.reason)
                    .await
                    .map_err(to_wire)
                    .and_then(|turns| ok(TurnsOk { turns })),
                Err(x) => Err(x),
            },
            Op::SessionEvents => match args::<EventsArgs>(a) {
                Ok(r) => e.events(r).await.map_err(to_wire).and_then(ok),
                Err(x) => Err(x),
            },
            Op::Watch => match args::<WatchArgs>(a) {
                Ok(r) => {
                    let max = self.shared.config.server.max_watches_per_connection as usize;
                    let res = e
                        .watch(r, &self.outbox, max, |w| {
                            encode_ok(id, &serde_json::to_value(w).unwrap_or(Value::Null))
                        })
                        .await;
                    return match res {
                        Ok(()) => None,
                        Err(x) => Some(Err(to_wire(x))),
                    };
                }
                Err(x) => Err(x),
            },
            Op::Unwatch => match args::<WatchIdArgs>(a) {
                Ok(r) => e
                    .unwatch(&self.outbox.conn_id, &r.watch_id)
                    .map_err(to_wire)
                    .and_then(|_| ok(serde_json::json!({}))),
                Err(x) => Err(x),
            },
            Op::Stats => ok(StatsOk { stats: e.stats() }),
            Op::WorkersList => ok(WorkersOk {
                workers: e.workers(),
            }),
            Op::FunctionsList => ok(FunctionsOk {
                functions: e.functions(),
            }),
            Op::SessionsList => match args::<SessionsListArgs>(a) {
                Ok(r) => e.list_sessions(r).await.map_err(to_wire).and_then(ok),
                Err(x) => Err(x),
            },
            Op::StoreCheck => {
                let engine = e.clone();
                match tokio::task::spawn_blocking(move || engine.check()).await {
                    Ok(r) => r
                        .map_err(to_wire)
                        .and_then(|violations| ok(CheckOk { violations })),
                    Err(j) => Err(bad(
                        ErrorCode::Internal,
                        format!("store check task failed: {j}"),
                    )),
                }
            }
        };
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_is_counted_outside_strings() {
        assert!(!too_deep(r#"{"a":[1,{"b":2}]}"#, 3));
        assert!(too_deep(r#"{"a":[1,{"b":[2]}]}"#, 3));
        assert!(!too_deep(r#"{"a":"[[[[[[[[[[\"[[[["}"#, 2));
        assert!(too_deep(&"[".repeat(100), 64));
    }

    #[tokio::test(start_paused = true)]
    async fn bucket_refills_with_time() {
        assert!(Bucket::new(0).is_none(), "0 is no limit");
        let mut b = Bucket::new(2).expect("a bucket");
        assert!(b.take());
        assert!(b.take());
        assert!(!b.take());
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(b.take());
        assert!(!b.take());
    }

    /// The close code a peer receives when the reader's close and the engine's both
    /// have happened before the writer looks: every arm of its `select!` is then
    /// ready, and the code must be the first cause's whichever arm wins.
    async fn close_code_seen(
        first_engine: Option<CloseReason>,
        reader: Option<(u16, &str)>,
        then_engine: Option<CloseReason>,
    ) -> Option<u16> {
        use tokio_tungstenite::tungstenite::protocol::Role;
        use tokio_tungstenite::WebSocketStream;
        let (server_io, client_io) = tokio::io::duplex(1 << 16);
        let server = WebSocketStream::from_raw_socket(server_io, Role::Server, None).await;
        let mut client = WebSocketStream::from_raw_socket(client_io, Role::Client, None).await;
        let (outbox, out_rx) = Outbox::new("c".into(), 8);
        // A frame queued before the close, as a response would be.
        assert!(outbox.push("{\"id\":1}".into()));
        let (close_tx, close_rx) = tokio::sync::oneshot::channel();
        if let Some(r) = first_engine {
            outbox.close_with(r);
        }
        outbox.close_with(CloseReason::ReaderEnded);
        close_tx
            .send(reader.map(|(c, r)| (c, r.to_string())))
            .expect("the writer is not started yet");
        if let Some(r) = then_engine {
            outbox.close_with(r);
        }
        let (sink, _stream) = server.split();
        let writer = tokio::spawn(write_loop(
            sink,
            out_rx,
            outbox,
            close_rx,
            Duration::from_millis(1),
            Duration::from_secs(5),
        ));
        let mut code = None;
        let mut texts = 0;
        while let Some(Ok(m)) = client.next().await {
            match m {
                Message::Text(_) => texts += 1,
                Message::Close(c) => {
                    code = c.map(|c| u16::from(c.code));
                    break;
                }
                _ => {}
            }
        }
        drop(writer.await.expect("the writer ends"));
        assert_eq!(texts, 1, "the queued frame goes out before the close");
        code
    }

    #[tokio::test]
    async fn the_first_cause_of_a_close_decides_its_code_whichever_arm_wins() {
        // `select!` picks among ready arms at random: many rounds of each.
        for _ in 0..40 {
            // The reader closed first (a frame over the limit), then the engine
            // (an overflowing push): 1009.
            let code = close_code_seen(
                None,
                Some((CLOSE_TOO_BIG, "frame too large")),
                Some(CloseReason::SlowReader),
            )
            .await;
            assert_eq!(code, Some(CLOSE_TOO_BIG));
            // The engine closed first (a newer connection of the worker), then the
            // reader saw the outbox close: 4001.
            let code = close_code_seen(Some(CloseReason::Superseded), None, None).await;
            assert_eq!(code, Some(CLOSE_SUPERSEDED));
            // The engine first, then the reader with a code of its own: 4001.
            let code = close_code_seen(
                Some(CloseReason::Superseded),
                Some((1001, "server shutting down")),
                None,
            )
            .await;
            assert_eq!(code, Some(CLOSE_SUPERSEDED));
            // The reader first, shutting down, then the engine: 1001.
            let code = close_code_seen(
                None,
                Some((1001, "server shutting down")),
                Some(CloseReason::Unavailable),
            )
            .await;
            assert_eq!(code, Some(1001));
            // The peer went away: no close frame of ours.
            assert_eq!(close_code_seen(None, None, None).await, None);
        }
    }
}
