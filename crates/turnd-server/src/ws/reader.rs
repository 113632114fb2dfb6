//! The reader task of a connection: it waits for the next frame (the peer's silence
//! for 3 heartbeats, the daemon closing and the engine closing the connection end
//! it; on the daemon's close it stops reading and waits for the answers of the
//! requests it started, so that none is left unanswered), answers frames that are not requests and counts them (too many in a row
//! close the connection), holds the request rate, runs `hello` and
//! `invocation.progress` in line and starts every other request
//! ([`super::request::start`]).

use std::sync::Arc;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use turnd_proto::frame::encode_error;
use turnd_proto::{
    decode_raw_request, ErrorBody, ErrorCode, Op, RawRequest, CLOSE_GOING_AWAY, CLOSE_POLICY,
    CLOSE_TOO_BIG, MAX_BAD_FRAMES,
};

use super::limits::{Bucket, Exempted};
use super::{request, Conn};

/// The close frame a connection ends with (code, reason); `None`: no frame of ours.
pub(super) type Close = Option<(u16, String)>;

/// What the reader does after a frame.
enum Flow {
    Next,
    End(Close),
}

/// The reader's state: the connection and what its limits count.
pub(super) struct Reader {
    conn: Arc<Conn>,
    heartbeat: Duration,
    /// Bad frames in a row.
    bad_in_row: u32,
    bucket: Option<Bucket>,
    /// Invocations whose first result on this connection was not counted by `bucket`.
    exempted: Exempted,
}

impl Reader {
    pub(super) fn new(conn: Arc<Conn>) -> Reader {
        let cfg = &conn.shared.config.server;
        Reader {
            heartbeat: Duration::from_millis(cfg.heartbeat_ms),
            bucket: Bucket::new(cfg.max_requests_per_second),
            conn,
            bad_in_row: 0,
            exempted: Exempted::new(),
        }
    }

    /// Read the connection until it ends; the close frame it ends with.
    pub(super) async fn run<St>(mut self, stream: &mut St) -> Close
    where
        St: Stream<Item = Result<Message, WsError>> + Unpin,
    {
        loop {
            let msg = match self.next(stream).await {
                Ok(m) => m,
                Err(close) => return close,
            };
            let flow = match msg {
                Message::Text(t) => self.text(t.as_str()).await,
                Message::Binary(_) => {
                    let body = ErrorBody::new(
                        ErrorCode::BadFrame,
                        "binary frames are not accepted; send JSON text frames",
                    );
                    self.bad(None, body).await
                }
                Message::Close(_) => Flow::End(None),
                _ => Flow::Next,
            };
            if let Flow::End(close) = flow {
                return close;
            }
        }
    }

    /// The next message, or how the connection ends.
    async fn next<St>(&self, stream: &mut St) -> Result<Message, Close>
    where
        St: Stream<Item = Result<Message, WsError>> + Unpin,
    {
        let conn = &self.conn;
        let (peer, conn_id) = (conn.peer, &conn.outbox.conn_id);
        let next = tokio::select! {
            n = tokio::time::timeout(self.heartbeat * 3, stream.next()) => n,
            _ = conn.outbox.closed() => return Err(None),
            _ = conn.shared.closing.cancelled() => {
                if self.answered().await {
                    return Err(Some((CLOSE_GOING_AWAY, "server shutting down".into())));
                }
                return Err(Some((
                    1011,
                    "server shutting down with requests of this connection unanswered: \
                     their outcome is unknown"
                        .into(),
                )));
            }
        };
        match next {
            Err(_) => {
                tracing::info!(%peer, conn_id, "peer silent for 3 heartbeats; closing");
                // 1001 promises that every request read was answered: one still
                // running would be answered on a closed connection.
                if conn.inflight.load(std::sync::atomic::Ordering::Relaxed) > 0 {
                    return Err(Some((
                        1011,
                        "no frames for 3 heartbeats, with requests unanswered".into(),
                    )));
                }
                Err(Some((
                    CLOSE_GOING_AWAY,
                    "no frames for 3 heartbeats".into(),
                )))
            }
            Ok(None) => Err(None),
            Ok(Some(Err(WsError::Capacity(e)))) => {
                let max = conn.shared.config.server.max_frame_bytes;
                let body = ErrorBody::new(
                    ErrorCode::TooLarge,
                    format!("frame over max_frame_bytes ({max}): {e}"),
                );
                conn.outbox.push(encode_error(None, &body));
                Err(Some((CLOSE_TOO_BIG, "frame too large".into())))
            }
            Ok(Some(Err(e))) => {
                tracing::debug!(%peer, conn_id, "connection error: {e}");
                Err(None)
            }
            Ok(Some(Ok(m))) => Ok(m),
        }
    }

    /// Wait (for at most `server.shutdown_timeout_ms`) until every request this
    /// connection started has queued its answer, reading no more frames meanwhile;
    /// false when some had not by then.
    async fn answered(&self) -> bool {
        let conn = &self.conn;
        let limit = Duration::from_millis(conn.shared.config.server.shutdown_timeout_ms);
        let deadline = tokio::time::Instant::now() + limit;
        while conn.inflight.load(std::sync::atomic::Ordering::Relaxed) > 0 {
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(
                    conn_id = conn.outbox.conn_id,
                    "requests unanswered at close"
                );
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }

    /// Answer a bad frame and count it; too many in a row end the connection.
    async fn bad(&mut self, id: Option<u64>, body: ErrorBody) -> Flow {
        self.bad_in_row += 1;
        if !self.conn.respond_error(id, body).await {
            return Flow::End(None);
        }
        if self.bad_in_row >= MAX_BAD_FRAMES {
            return Flow::End(Some((CLOSE_POLICY, "too many bad frames in a row".into())));
        }
        Flow::Next
    }

    /// A text frame: a request, unless it nests too deep or does not decode.
    async fn text(&mut self, text: &str) -> Flow {
        let max_depth = self.conn.shared.config.server.max_json_depth;
        if turnd_proto::json_text::nests_deeper_than(text, max_depth) {
            let body = ErrorBody::new(
                ErrorCode::TooLarge,
                format!("JSON nests deeper than server.max_json_depth ({max_depth})"),
            );
            return self.bad(None, body).await;
        }
        let req = match decode_raw_request(text) {
            Ok(r) => r,
            Err(fe) => {
                return self
                    .bad(fe.id, ErrorBody::new(ErrorCode::BadFrame, fe.message))
                    .await
            }
        };
        self.bad_in_row = 0;
        let over_rate = self.over_rate(&req);
        let conn = &self.conn;
        let answered = if over_rate {
            let body = ErrorBody::new(
                ErrorCode::RateLimited,
                format!(
                    "more than {} requests per second on this connection",
                    conn.shared.config.server.max_requests_per_second
                ),
            );
            conn.respond_error(Some(req.id), body).await
        } else if req.op == Op::Hello.name() {
            let r = conn.hello(req.args_text()).await;
            conn.respond(req.id, r).await
        } else if request::in_line(&req) {
            request::run_in_line(conn, &req).await
        } else {
            match request::start(conn, &req) {
                Ok(()) => true,
                Err(body) => conn.respond_error(Some(req.id), body).await,
            }
        };
        if answered {
            Flow::Next
        } else {
            Flow::End(None)
        }
    }

    /// Whether the request is over the connection's request rate (the first result
    /// of an invocation is not counted).
    fn over_rate(&mut self, req: &RawRequest<'_>) -> bool {
        self.bucket.is_some()
            && !self.exempted.exempt(&self.conn, req)
            && !self.bucket.as_mut().is_some_and(Bucket::take)
    }
}
