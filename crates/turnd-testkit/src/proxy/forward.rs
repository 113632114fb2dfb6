//! The proxied connections: accept (or refuse, or hold), open the upstream
//! connection, and forward frames both ways through the rules until both sides
//! closed, one side vanished, or a cut.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, Stream, StreamExt};
use serde_json::Value;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::handshake::server::{
    ErrorResponse, Request as HttpRequest, Response,
};
use tokio_tungstenite::tungstenite::http::StatusCode;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use super::rules::{Dir, Fate};
use super::state::{lock, ConnEntry, State};

/// The only path the proxy accepts, as the daemon does.
pub(super) const WS_PATH: &str = "/v1";
/// How long a connection may take to finish its close handshake once one side sent a
/// close frame, before the proxy drops both sockets.
const CLOSE_LINGER: Duration = Duration::from_secs(1);

pub(super) async fn accept_loop(listener: TcpListener, state: Arc<State>) {
    let conns = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            _ = state.shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((tcp, peer)) => {
                conns.spawn(serve_connection(state.clone(), tcp, peer));
            }
            Err(e) => {
                warn!("proxy failed to accept a connection: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    conns.close();
}

async fn serve_connection(state: Arc<State>, tcp: TcpStream, peer: SocketAddr) {
    if state.refusing() {
        state.counters.refused.fetch_add(1, Ordering::Relaxed);
        debug!(%peer, "proxy refusing a connection");
        return;
    }
    let mut hold = state.hold.subscribe();
    tokio::select! {
        _ = state.shutdown.cancelled() => return,
        held = hold.wait_for(|on| !*on) => {
            if held.is_err() {
                return;
            }
        }
    }
    // A refusal may have started while the connection was held.
    if state.refusing() {
        state.counters.refused.fetch_add(1, Ordering::Relaxed);
        return;
    }
    if let Err(e) = tcp.set_nodelay(true) {
        debug!(%peer, "set TCP_NODELAY: {e}");
    }
    #[allow(clippy::result_large_err)]
    let check_path = |req: &HttpRequest, resp: Response| -> Result<Response, ErrorResponse> {
        if req.uri().path() == WS_PATH {
            Ok(resp)
        } else {
            let mut r = ErrorResponse::new(Some(format!("the proxy serves {WS_PATH} only\n")));
            *r.status_mut() = StatusCode::NOT_FOUND;
            Err(r)
        }
    };
    let client = match tokio_tungstenite::accept_hdr_async(tcp, check_path).await {
        Ok(ws) => ws,
        Err(e) => {
            debug!(%peer, "proxy handshake with the peer failed: {e}");
            return;
        }
    };
    let upstream = lock(&state.upstream).clone();
    let server = match tokio_tungstenite::connect_async_with_config(&upstream, None, true).await {
        Ok((ws, _)) => ws,
        Err(e) => {
            // The peer sees its connection drop, as if the daemon were unreachable.
            state
                .counters
                .upstream_failures
                .fetch_add(1, Ordering::Relaxed);
            debug!(%peer, %upstream, "proxy could not reach the daemon: {e}");
            return;
        }
    };
    let id = state.next_conn.fetch_add(1, Ordering::Relaxed);
    let cut = state.shutdown.child_token();
    let sever = CancellationToken::new();
    lock(&state.conns).insert(
        id,
        ConnEntry {
            worker_id: None,
            cut: cut.clone(),
            sever: sever.clone(),
        },
    );
    state.counters.connections.fetch_add(1, Ordering::Relaxed);
    let ends = Ends {
        cut: &cut,
        sever: &sever,
        closing: CancellationToken::new(),
    };
    pipe(&state, id, client, server, &ends).await;
    lock(&state.conns).remove(&id);
}

/// How a proxied connection ends.
struct Ends<'a> {
    /// Both sockets dropped (a cut, or one side vanished).
    cut: &'a CancellationToken,
    /// The peer's socket dropped, the daemon's kept.
    sever: &'a CancellationToken,
    /// A close frame was seen: the close handshake gets a moment, then both go.
    closing: CancellationToken,
}

/// A frame on its way, and when it may be written (delayed frames hold up the frames
/// behind them, as on a real connection).
struct Outgoing {
    msg: Message,
    not_before: Option<Instant>,
}

impl Outgoing {
    fn now(msg: Message) -> Outgoing {
        Outgoing {
            msg,
            not_before: None,
        }
    }
}

/// Forward frames both ways until both sides closed, one side vanished, or a cut.
async fn pipe<C, S>(
    state: &Arc<State>,
    id: u64,
    client: tokio_tungstenite::WebSocketStream<C>,
    server: tokio_tungstenite::WebSocketStream<S>,
    ends: &Ends<'_>,
) where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (client_sink, client_stream) = client.split();
    let (server_sink, server_stream) = server.split();
    let (to_server, to_server_rx) = mpsc::unbounded_channel();
    let (to_client, to_client_rx) = mpsc::unbounded_channel();
    // The peer's halves live in these two futures only, so severing them drops the
    // peer's socket while the daemon's stays open.
    let peer_reader = async {
        tokio::select! {
            _ = ends.sever.cancelled() => {}
            _ = read_side(state, id, Dir::ToServer, client_stream, to_server, ends) => {}
        }
    };
    let peer_writer = async {
        tokio::select! {
            _ = ends.sever.cancelled() => {}
            _ = write_side(to_client_rx, client_sink, ends.cut) => {}
        }
    };
    let run = async {
        tokio::join!(
            peer_reader,
            read_side(state, id, Dir::ToClient, server_stream, to_client, ends),
            write_side(to_server_rx, server_sink, ends.cut),
            peer_writer,
        )
    };
    tokio::select! {
        // A cut drops both sockets here, without a close frame.
        _ = ends.cut.cancelled() => {}
        _ = run => {}
        _ = async {
            ends.closing.cancelled().await;
            tokio::time::sleep(CLOSE_LINGER).await;
        } => {}
    }
}

async fn read_side<St>(
    state: &Arc<State>,
    id: u64,
    dir: Dir,
    mut stream: St,
    tx: mpsc::UnboundedSender<Outgoing>,
    ends: &Ends<'_>,
) where
    St: Stream<Item = Result<Message, WsError>> + Unpin,
{
    // Once the peer is severed, the daemon's frames are read (so its pings are still
    // answered) and discarded.
    let send = |o: Outgoing| tx.send(o).is_ok() || ends.sever.is_cancelled();
    loop {
        let msg = match stream.next().await {
            Some(Ok(m)) => m,
            Some(Err(e)) => {
                debug!(conn = id, ?dir, "proxied connection failed: {e}");
                ends.cut.cancel();
                return;
            }
            None => {
                // The socket ended without a close handshake: end the other side the
                // same way.
                ends.cut.cancel();
                return;
            }
        };
        match msg {
            Message::Text(text) => {
                let value: Option<Value> = serde_json::from_str(text.as_str()).ok();
                if dir == Dir::ToServer {
                    note_hello(state, id, value.as_ref());
                }
                let fate = state.decide(dir, value.as_ref());
                let logged = value.unwrap_or_else(|| Value::String(text.as_str().to_string()));
                state.record(id, dir, logged, fate);
                let sent = match fate {
                    Fate::Forwarded => send(Outgoing::now(Message::Text(text))),
                    Fate::Dropped => true,
                    Fate::Duplicated => {
                        send(Outgoing::now(Message::Text(text.clone())))
                            && send(Outgoing::now(Message::Text(text)))
                    }
                    Fate::Delayed(by) => send(Outgoing {
                        msg: Message::Text(text),
                        not_before: Some(Instant::now() + by),
                    }),
                };
                if !sent {
                    return;
                }
            }
            Message::Close(frame) => {
                if !send(Outgoing::now(Message::Close(frame))) {
                    debug!(
                        conn = id,
                        "close frame not forwarded: the other side is gone"
                    );
                }
                ends.closing.cancel();
                return;
            }
            Message::Frame(_) => {}
            other => {
                // Binary, ping and pong: forwarded as they are.
                if !send(Outgoing::now(other)) {
                    return;
                }
            }
        }
    }
}

async fn write_side<Si>(
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    mut sink: Si,
    cut: &CancellationToken,
) where
    Si: futures_util::Sink<Message, Error = WsError> + Unpin,
{
    while let Some(out) = rx.recv().await {
        if let Some(at) = out.not_before {
            tokio::time::sleep_until(at).await;
        }
        let is_close = out.msg.is_close();
        if let Err(e) = sink.send(out.msg).await {
            debug!("proxy failed to write a frame: {e}");
            cut.cancel();
            return;
        }
        if is_close {
            return;
        }
    }
}

/// Remember the `worker_id` a connection's `hello` names, for [`ProxyHandle::cut_worker`].
fn note_hello(state: &State, id: u64, frame: Option<&Value>) {
    let Some(frame) = frame else { return };
    if frame.get("op").and_then(Value::as_str) != Some("hello") {
        return;
    }
    if let Some(w) = frame.pointer("/args/worker_id").and_then(Value::as_str) {
        if let Some(c) = lock(&state.conns).get_mut(&id) {
            c.worker_id = Some(w.to_string());
        }
    }
}
