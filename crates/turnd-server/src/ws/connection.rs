//! A connection from its handshake to its end: the WebSocket upgrade on
//! [`WS_PATH`], its place in the connection limits (a refused connection is told why
//! and closed with 1013), its reader and writer tasks, and what its end lets go of
//! (its watches, its worker's attachment, its count). A connection closed for a frame
//! over `max_frame_bytes`, or with 1001, lingers ([`linger`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::handshake::server::{
    Callback, ErrorResponse, Request as HttpRequest, Response,
};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;
use turnd_engine::{CloseReason, Outbox};
use turnd_proto::frame::encode_error;
use turnd_proto::{
    new_connection_id, ErrorBody, ErrorCode, CLOSE_GOING_AWAY, CLOSE_TOO_BIG, WS_PATH,
};

use super::reader::Reader;
use super::writer::write_loop;
use super::{Conn, Shared};

/// Size of a connection's WebSocket read buffer. tungstenite zero-fills the whole
/// buffer before every read of the socket, including reads that find nothing; at its
/// default of 128 KiB that zeroing was about 2% of all CPU under load. Frames are
/// mostly far smaller, and a larger frame only takes more reads.
const READ_BUFFER_BYTES: usize = 8 * 1024;

/// How long a connection closed for a frame over `max_frame_bytes`, or with 1001,
/// goes on reading (and dropping) what the peer still sends; see [`linger`].
const LINGER: Duration = Duration::from_secs(1);

/// Serve one accepted TCP connection until it ends.
pub async fn serve_connection<S>(shared: Arc<Shared>, stream: S, peer: SocketAddr)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let Some(mut ws) = handshake(&shared, stream, peer).await else {
        return;
    };
    let limits = &shared.config.server;
    let _slot = match shared.connections.admit(
        peer.ip(),
        limits.max_connections,
        limits.max_connections_per_ip,
    ) {
        Ok(slot) => slot,
        Err(why) => return refuse(&mut ws, peer, why).await,
    };
    let conn_id = new_connection_id();
    let (outbox, out_rx) = Outbox::new(conn_id.clone(), limits.outbox_frames as usize);
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
    let (close_tx, close_rx) = tokio::sync::oneshot::channel();
    let writer = tokio::spawn(write_loop(
        sink,
        out_rx,
        outbox.clone(),
        close_rx,
        Duration::from_millis(limits.heartbeat_ms),
        Duration::from_millis(limits.write_stall_ms),
    ));
    let close = Reader::new(conn.clone()).run(&mut stream).await;
    // Tag the outbox first, then say which close frame: the writer sends the frame
    // of whichever cause tagged it first, this one or the engine's.
    outbox.close_with(CloseReason::ReaderEnded);
    // After these closes the peer may still be sending: the rest of a frame over
    // the limit, or requests sent before it read the close (1001 says they were
    // not read: the peer must get the close frame to know to send them again).
    let lingers = matches!(close, Some((CLOSE_TOO_BIG | CLOSE_GOING_AWAY, _)));
    if close_tx.send(close).is_err() {
        tracing::trace!("writer already gone");
    }
    ended(&conn).await;
    finish(writer, stream, lingers, &conn_id).await;
    tracing::debug!(%peer, conn_id, "connection closed");
}

/// The WebSocket upgrade, on [`WS_PATH`] only (any other path is answered 404).
async fn handshake<S>(shared: &Shared, stream: S, peer: SocketAddr) -> Option<WebSocketStream<S>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let max = shared.config.server.max_frame_bytes as usize;
    let ws_config = WebSocketConfig::default()
        .read_buffer_size(READ_BUFFER_BYTES)
        .max_message_size(Some(max))
        .max_frame_size(Some(max));
    match tokio_tungstenite::accept_hdr_async_with_config(stream, OnlyWsPath, Some(ws_config)).await
    {
        Ok(ws) => Some(ws),
        Err(e) => {
            tracing::debug!(%peer, "WebSocket handshake failed: {e}");
            None
        }
    }
}

/// The handshake's check of the request's path: protocol v1 is served on
/// [`WS_PATH`] only, any other path is answered 404.
struct OnlyWsPath;

impl Callback for OnlyWsPath {
    fn on_request(self, req: &HttpRequest, resp: Response) -> Result<Response, ErrorResponse> {
        if req.uri().path() == WS_PATH {
            return Ok(resp);
        }
        let mut r = ErrorResponse::new(Some(format!(
            "no such path; protocol v1 is served at {WS_PATH}\n"
        )));
        *r.status_mut() = tokio_tungstenite::tungstenite::http::StatusCode::NOT_FOUND;
        Err(r)
    }
}

/// Refuse a connection over a limit: say why, then close with 1013.
async fn refuse<S>(ws: &mut WebSocketStream<S>, peer: SocketAddr, why: String)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    tracing::warn!(%peer, "connection refused: {why}");
    let body = ErrorBody::new(ErrorCode::RateLimited, why);
    if ws
        .send(Message::text(encode_error(None, &body)))
        .await
        .is_ok()
    {
        turnd_socket::close(ws, Some((1013, "connection limit"))).await;
    }
}

/// What a connection's end lets go of: its watches, its worker's attachment (the
/// engine starts the reconnect grace of the worker's invocations) and its count.
async fn ended(conn: &Conn) {
    let shared = &conn.shared;
    let conn_id = &conn.outbox.conn_id;
    shared.backend.connection_closed(conn_id);
    if let Some(w) = conn.auth.get().and_then(|c| c.worker_id.as_deref()) {
        shared.backend.worker_disconnected(w, conn_id).await;
    }
    shared
        .connections
        .of(conn.role())
        .fetch_sub(1, Ordering::Relaxed);
}

/// Wait (2 s at most) for the writer to send its last frames and the close frame,
/// then linger when the peer may still be sending (`lingers`).
async fn finish<S>(
    writer: JoinHandle<SplitSink<WebSocketStream<S>, Message>>,
    stream: SplitStream<WebSocketStream<S>>,
    lingers: bool,
    conn_id: &str,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    match tokio::time::timeout(Duration::from_secs(2), writer).await {
        Ok(Ok(sink)) if lingers => match sink.reunite(stream) {
            Ok(ws) => linger(ws).await,
            Err(e) => tracing::debug!(conn_id, "no socket to linger on: {e}"),
        },
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::debug!(conn_id, "writer failed: {e}"),
        Err(_) => tracing::debug!(conn_id, "writer did not finish in time"),
    }
}

/// After a close whose peer may still be sending (the rest of a frame over
/// `max_frame_bytes`; requests sent before the peer read a 1001): a socket closed
/// with unread data makes the kernel answer with a reset, which can reach the peer
/// before the close frame does and make its system drop that frame unread, so the
/// peer would see a reset instead of the close code. The write side is shut instead
/// (the peer reads the close frame, then the end of the stream), and what still
/// arrives is read and dropped, never run, until the peer closes, for at most
/// [`LINGER`]. (A writer that took longer than its 2 s to send the close frame has
/// dropped its socket already: there is nothing to linger on.)
async fn linger<S>(mut ws: WebSocketStream<S>)
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
    if tokio::time::timeout(LINGER, drain).await.is_err() {
        tracing::debug!(
            "peer still sending {} ms after the close",
            LINGER.as_millis()
        );
    }
}
