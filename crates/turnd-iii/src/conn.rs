//! One iii connection: a reader that acts on each frame in order (worker frames in
//! line, triggers as their own tasks) and a writer that sends the connection's iii
//! frames and turns the engine's pushes (`invoke`) into `invokefunction`. A frame
//! that is a protocol v1 op is sent through the daemon's [`Router`] as that op.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::{SinkExt, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::handshake::server::{
    Callback, ErrorResponse, Request as HttpRequest, Response,
};
use tokio_tungstenite::tungstenite::http::StatusCode;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;
use turnd_engine::{Caller, CloseReason, Outbox};
use turnd_proto::frame::{decode_server_frame, Push, ServerFrame};
use turnd_proto::{
    new_connection_id, ErrorBody, ErrorCode, Failure, FunctionIdArgs, HelloArgs, Op, Outcome,
    RegisterOk, ResultArgs, ResultOk, Role, SubmitArgs, Turn, TurnStatus, CLOSE_SUPERSEDED,
    PROTOCOL_VERSION,
};

use crate::wire::{self, Action, IiiError, Inbound, InvocationResult, InvokeFunction, Outbound};
use crate::{Iii, Router};

mod calls;

/// Frames the engine may queue for one iii connection before it counts as a slow
/// reader and is disconnected.
const OUTBOX_FRAMES: usize = 4096;

/// Answers (iii frames) queued for one connection's writer before the peer counts as
/// a slow reader and is disconnected (1008).
const ANSWER_FRAMES: usize = 4096;

/// Triggers one connection may have running at once; one more is answered
/// `rate_limited` (when it asked for an answer) and not run.
const TRIGGERS_IN_FLIGHT: usize = 1024;

/// Longest single `turn.wait` of a sync trigger; it waits again until the turn ends
/// or the caller's connection closes.
const CALL_WAIT_MS: u64 = 60_000;

/// Which socket the SDK opened.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Path {
    Worker,
    Telemetry,
}

/// The token an upgrade request carries: `Authorization: Bearer …`, else `?token=`.
fn request_token(req: &HttpRequest) -> Option<String> {
    if let Some(h) = req.headers().get("authorization") {
        if let Ok(v) = h.to_str() {
            if let Some(t) = v
                .strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
            {
                return Some(t.trim().to_string());
            }
        }
    }
    req.uri().query().and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix("token="))
            .map(percent_decode)
    })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = b
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match (b[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(v)) => {
                out.push(v);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The handshake's checks of an upgrade request: its path (`/` for the worker
/// socket, `/otel` for telemetry, anything else 404) and its token (401 when not
/// accepted). It notes which socket was opened in `path`.
struct Upgrade<'a> {
    iii: &'a Iii,
    peer: SocketAddr,
    path: &'a mut Option<Path>,
}

impl Callback for Upgrade<'_> {
    fn on_request(self, req: &HttpRequest, resp: Response) -> Result<Response, ErrorResponse> {
        let p = req.uri().path();
        let which = if p == "/" || p.is_empty() {
            Path::Worker
        } else if p == "/otel" || p.starts_with("/otel/") {
            Path::Telemetry
        } else {
            let mut r = ErrorResponse::new(Some(format!(
                "no such path {p}; the iii endpoint serves / and /otel\n"
            )));
            *r.status_mut() = StatusCode::NOT_FOUND;
            return Err(r);
        };
        if !self.iii.token_ok(request_token(req).as_deref()) {
            let peer = self.peer;
            tracing::warn!(%peer, path = p, "iii connection refused: token not accepted (send Authorization: Bearer TOKEN or ?token=TOKEN)");
            let mut r = ErrorResponse::new(Some(
                "not_authenticated: token not accepted for an iii connection\n".to_string(),
            ));
            *r.status_mut() = StatusCode::UNAUTHORIZED;
            return Err(r);
        }
        *self.path = Some(which);
        Ok(resp)
    }
}

/// Serve one accepted TCP connection of the iii endpoint until it ends.
pub(crate) async fn serve(
    iii: Arc<Iii>,
    router: Arc<dyn Router>,
    stream: TcpStream,
    peer: SocketAddr,
) {
    let max = iii.cfg.max_frame_bytes as usize;
    let ws_config = WebSocketConfig::default()
        .max_message_size(Some(max))
        .max_frame_size(Some(max));
    let mut path = None;
    let check = Upgrade {
        iii: &iii,
        peer,
        path: &mut path,
    };
    let ws = match tokio_tungstenite::accept_hdr_async_with_config(stream, check, Some(ws_config))
        .await
    {
        Ok(ws) => ws,
        Err(e) => {
            tracing::debug!(%peer, "iii handshake failed: {e}");
            return;
        }
    };
    match path {
        Some(Path::Worker) => serve_worker(iii, router, ws, peer).await,
        Some(Path::Telemetry) => {
            // The SDKs' telemetry: read and dropped, so they do not reconnect forever.
            let (mut sink, mut stream) = ws.split();
            loop {
                tokio::select! {
                    m = stream.next() => match m {
                        Some(Ok(Message::Close(_))) | Some(Err(_)) | None => break,
                        Some(Ok(_)) => {}
                    },
                    _ = iii.closing.cancelled() => break,
                }
            }
            if let Err(e) = sink.close().await {
                tracing::trace!("telemetry socket close: {e}");
            }
        }
        None => {}
    }
}

struct Conn {
    iii: Arc<Iii>,
    /// Where the frames that are protocol v1 ops go.
    router: Arc<dyn Router>,
    peer: SocketAddr,
    /// iii frames for the writer.
    tx: mpsc::Sender<String>,
    /// Set when the writer's queue was full: the peer does not read its answers.
    slow: AtomicBool,
    /// Permits for the triggers running at once.
    triggers: Arc<tokio::sync::Semaphore>,
    /// Where the engine pushes invocations for this connection's worker.
    outbox: Outbox,
    /// The worker lineage, set by the first frame: a verified `reattach` keeps the
    /// previous one, anything else starts a new one.
    lineage: Mutex<Option<String>>,
    /// Whether the engine knows this connection as the worker's (`worker_hello`).
    attached: AtomicBool,
    /// Cancelled when the connection has ended.
    done: CancellationToken,
}

/// The writer of an iii connection: answers, the engine's pushes as iii frames,
/// pings every heartbeat, and the close frame once the connection ends.
async fn write_frames(
    mut sink: futures_util::stream::SplitSink<
        tokio_tungstenite::WebSocketStream<TcpStream>,
        Message,
    >,
    mut frames: mpsc::Receiver<String>,
    mut pushes: mpsc::Receiver<String>,
    outbox: Outbox,
    conn: Arc<Conn>,
    heartbeat: std::time::Duration,
) {
    let done = conn.done.clone();
    let mut ping = tokio::time::interval(heartbeat);
    ping.tick().await;
    let close: Option<(u16, &str)> = loop {
        tokio::select! {
            f = frames.recv() => match f {
                Some(f) => if sink.send(Message::text(f)).await.is_err() { break None },
                None => break None,
            },
            p = pushes.recv() => match p {
                Some(p) => {
                    if let Some(f) = translate_push(&p) {
                        if sink.send(Message::text(f)).await.is_err() { break None }
                    }
                }
                None => break None,
            },
            _ = ping.tick() => {
                if sink.send(Message::Ping(Vec::new().into())).await.is_err() { break None }
            }
            _ = outbox.closed() => break match outbox.close_reason() {
                Some(r) => close_frame(r),
                None => Some((1001, "server closing")),
            },
            // The reader ends the connection after tagging why (if it did): both
            // arms can be ready at once, so this one looks at the tag too.
            _ = done.cancelled() => break match outbox.close_reason() {
                Some(r) => close_frame(r),
                None => conn.slow.load(Ordering::SeqCst).then_some(
                    (1008, "outgoing queue full: the peer does not read its answers"),
                ),
            },
        }
    };
    turnd_socket::close(&mut sink, close).await;
}

async fn serve_worker(
    iii: Arc<Iii>,
    router: Arc<dyn Router>,
    ws: tokio_tungstenite::WebSocketStream<TcpStream>,
    peer: SocketAddr,
) {
    let conn_id = new_connection_id();
    let (outbox, pushes) = Outbox::new(conn_id.clone(), OUTBOX_FRAMES);
    let (tx, frames) = mpsc::channel::<String>(ANSWER_FRAMES);
    let conn = Arc::new(Conn {
        iii: iii.clone(),
        router,
        peer,
        tx,
        slow: AtomicBool::new(false),
        triggers: Arc::new(tokio::sync::Semaphore::new(TRIGGERS_IN_FLIGHT)),
        outbox: outbox.clone(),
        lineage: Mutex::new(None),
        attached: AtomicBool::new(false),
        done: CancellationToken::new(),
    });
    tracing::debug!(%peer, conn_id, "iii connection opened");
    let (sink, mut stream) = ws.split();
    let heartbeat = iii.heartbeat;

    let writer = tokio::spawn(write_frames(
        sink,
        frames,
        pushes,
        outbox.clone(),
        conn.clone(),
        heartbeat,
    ));

    loop {
        let next = tokio::select! {
            n = tokio::time::timeout(heartbeat * 3, stream.next()) => n,
            _ = outbox.closed() => break,
            _ = conn.done.cancelled() => break,
            _ = iii.closing.cancelled() => {
                outbox.close_with(CloseReason::ServerClosing);
                break;
            }
        };
        let msg = match next {
            Err(_) => {
                tracing::info!(%peer, conn_id, "iii peer silent for 3 heartbeats; closing");
                break;
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                tracing::debug!(%peer, conn_id, "iii connection error: {e}");
                break;
            }
            Ok(Some(Ok(m))) => m,
        };
        match msg {
            Message::Text(t) => conn.handle(t.as_str()).await,
            // Binary frames, pings and pongs carry nothing turnd acts on.
            Message::Close(_) => break,
            _ => {}
        }
    }
    conn.done.cancel();
    iii.daemon.connection_closed(&conn_id);
    if conn.attached.load(Ordering::Acquire) {
        if let Some(w) = conn.worker_id() {
            iii.daemon.worker_disconnected(&w, &conn_id).await;
        }
    }
    let mut writer = writer;
    if tokio::time::timeout(std::time::Duration::from_secs(2), &mut writer)
        .await
        .is_err()
    {
        // A peer that does not read can hold the writer in a send for good.
        tracing::debug!(conn_id, "iii writer did not finish in time; dropped");
        writer.abort();
    }
    tracing::debug!(%peer, conn_id, "iii connection closed");
}

/// The close frame (code, reason) for why the engine closed an iii connection; `None`:
/// send none.
fn close_frame(r: CloseReason) -> Option<(u16, &'static str)> {
    match r {
        CloseReason::Superseded => {
            Some((CLOSE_SUPERSEDED, "superseded by a reattach of this worker"))
        }
        CloseReason::SlowReader => Some((
            1008,
            "outgoing queue full: the peer does not read fast enough",
        )),
        CloseReason::Unavailable => Some((1011, "the store could not be read")),
        CloseReason::ReaderEnded => None,
        CloseReason::ServerClosing => Some((1001, "server closing")),
        CloseReason::InDoubt => Some((1011, "a request's outcome is in doubt")),
    }
}

/// An engine push as the iii frame the SDK understands (`None`: iii has no such
/// message).
fn translate_push(frame: &str) -> Option<String> {
    match decode_server_frame(frame) {
        Ok(ServerFrame::Push(Push::Invoke(inv))) => Some(
            Outbound::InvokeFunction(InvokeFunction {
                metadata: Some(json!({"turnd": {
                    "invocation_id": inv.invocation_id,
                    "session_id": inv.session_id,
                    "turn_id": inv.turn_id,
                    "step": inv.step,
                    "attempt": inv.attempt,
                    "deadline_ms": inv.deadline_ms,
                }})),
                invocation_id: Some(inv.invocation_id),
                function_id: inv.function_id,
                data: inv.input,
                action: None,
            })
            .encode(),
        ),
        Ok(ServerFrame::Push(Push::Cancel { invocation_id, .. })) => {
            tracing::debug!(
                invocation_id,
                "iii has no cancel message; the stop waits out the cancel grace"
            );
            None
        }
        Ok(other) => {
            tracing::debug!("nothing to send an iii connection for {other:?}");
            None
        }
        Err(e) => {
            tracing::warn!("undecodable engine push for an iii connection: {e}");
            None
        }
    }
}

impl Conn {
    fn send(&self, f: Outbound) {
        match self.tx.try_send(f.encode()) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                tracing::warn!(peer = %self.peer, "iii connection closed: {ANSWER_FRAMES} answers queued and not read");
                self.slow.store(true, Ordering::SeqCst);
                self.done.cancel();
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                tracing::debug!(peer = %self.peer, "iii frame not sent: the connection ended");
            }
        }
    }

    /// A protocol v1 op through the daemon's router, its answer decoded.
    async fn request<T: DeserializeOwned>(
        &self,
        caller: &Caller,
        op: Op,
        args: &impl Serialize,
    ) -> Result<T, ErrorBody> {
        let args = serde_json::to_string(args)
            .map_err(|e| ErrorBody::new(ErrorCode::Internal, format!("encode {op:?}: {e}")))?;
        let answer = self.router.dispatch(caller, op.name(), args).await?;
        serde_json::from_str(&answer).map_err(|e| {
            ErrorBody::new(
                ErrorCode::Internal,
                format!("decode the answer of {}: {e}", op.name()),
            )
        })
    }

    fn lineage(&self) -> Option<String> {
        self.lineage.lock().ok().and_then(|l| l.clone())
    }

    fn worker_id(&self) -> Option<String> {
        self.lineage().map(|l| format!("iii/{l}"))
    }

    /// Act on one text frame.
    async fn handle(self: &Arc<Self>, text: &str) {
        let first = self.lineage().is_none();
        let frame = wire::decode(text);
        if first {
            if let Ok(Inbound::Reattach {
                previous_worker_id,
                reattach_token,
            }) = &frame
            {
                let verified = reattach_token
                    .as_deref()
                    .is_some_and(|t| self.iii.reattach_ok(previous_worker_id, t));
                if verified {
                    self.begin(previous_worker_id.clone(), true).await;
                    return;
                }
                tracing::info!(peer = %self.peer, previous_worker_id, "iii reattach refused: the token does not verify; a new worker identity is given");
            }
            self.begin(uuid::Uuid::new_v4().to_string(), false).await;
        }
        let frame = match frame {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(peer = %self.peer, "iii frame ignored: {e}");
                return;
            }
        };
        match frame {
            Inbound::Reattach { .. } => {
                tracing::debug!(peer = %self.peer, "iii reattach ignored: only a connection's first frame may reattach");
            }
            Inbound::RegisterFunction(r) => self.register(r).await,
            Inbound::UnregisterFunction { id } => {
                if let Ok(mut h) = self.iii.http_functions.lock() {
                    h.remove(&id);
                }
                if let Some(w) = self.worker_id() {
                    let args = FunctionIdArgs {
                        function_id: id.clone(),
                    };
                    let r: Result<Value, _> = self
                        .request(&as_worker(w), Op::FunctionUnregister, &args)
                        .await;
                    if let Err(e) = r {
                        tracing::debug!(function_id = id, "iii unregisterfunction: {e}");
                    }
                }
            }
            Inbound::InvocationResult(r) => self.result(r).await,
            Inbound::InvokeFunction(i) => match self.triggers.clone().try_acquire_owned() {
                Ok(permit) => {
                    let c = self.clone();
                    tokio::spawn(async move {
                        c.trigger(i).await;
                        drop(permit);
                    });
                }
                Err(_) => self.answer(
                    &i,
                    Err(IiiError::new(
                        "rate_limited",
                        format!("{TRIGGERS_IN_FLIGHT} triggers of this connection are already running; retry later"),
                    )),
                ),
            },
            Inbound::RegisterTrigger(t) => self.send(Outbound::TriggerRegistrationResult {
                id: t.id,
                trigger_type: t.trigger_type.clone(),
                function_id: t.function_id,
                error: IiiError::new(
                    "trigger_type_not_found",
                    format!("turnd serves no trigger type {:?}", t.trigger_type),
                ),
            }),
            Inbound::Other => {}
        }
    }

    /// Settle the connection's lineage and tell the SDK (`workerregistered`). A
    /// reattached lineage is attached at once, with every live invocation of that
    /// worker counted as still running: the SDK keeps its handlers running across
    /// reconnects and answers on the new socket.
    async fn begin(&self, lineage: String, reattached: bool) {
        if let Ok(mut l) = self.lineage.lock() {
            *l = Some(lineage.clone());
        }
        if reattached {
            self.attach().await;
        }
        self.send(Outbound::WorkerRegistered {
            reattach_token: self.iii.reattach_token(&lineage),
            worker_id: lineage,
        });
    }

    /// Make this connection the engine's worker `iii/<lineage>` (once).
    async fn attach(&self) -> bool {
        if self.attached.load(Ordering::Acquire) {
            return true;
        }
        let (Some(lineage), Some(worker_id)) = (self.lineage(), self.worker_id()) else {
            return false;
        };
        let hello = HelloArgs {
            protocol: PROTOCOL_VERSION,
            role: Role::Worker,
            token: None,
            name: Some(worker_id.clone()),
            worker_id: Some(worker_id.clone()),
            instance_id: Some(lineage),
            inflight: Vec::new(),
            finished: Vec::new(),
        };
        match self
            .iii
            .daemon
            .worker_hello(&hello, self.outbox.clone())
            .await
        {
            Ok(rec) => {
                tracing::info!(peer = %self.peer, worker_id, kept = rec.kept.len(), unknown = rec.unknown.len(), "iii worker attached");
                self.attached.store(true, Ordering::Release);
                true
            }
            Err(e) => {
                tracing::warn!(peer = %self.peer, worker_id, "iii worker not attached: {e}");
                false
            }
        }
    }

    async fn register(&self, r: wire::RegisterFunction) {
        if r.invocation.is_some() {
            tracing::warn!(peer = %self.peer, function_id = r.id, "iii function not registered: turnd does not invoke functions over HTTP; calls of it are answered function_not_found");
            if let Ok(mut h) = self.iii.http_functions.lock() {
                h.insert(r.id);
            }
            return;
        }
        if !self.attach().await {
            return;
        }
        let Some(w) = self.worker_id() else { return };
        let settings = self.iii.cfg.settings(&r.id);
        let registered: Result<RegisterOk, _> = self
            .request(
                &as_worker(w.clone()),
                Op::FunctionRegister,
                &settings.register,
            )
            .await;
        match registered {
            Ok(ok) => {
                tracing::debug!(
                    worker_id = w,
                    function_id = ok.function_id,
                    "iii function registered"
                )
            }
            Err(e) => {
                tracing::warn!(
                    worker_id = w,
                    function_id = r.id,
                    "iii function not registered: {e}"
                )
            }
        }
    }

    async fn result(&self, r: InvocationResult) {
        let Some(w) = self.worker_id() else { return };
        let outcome = match r.error {
            Some(e) => Outcome::Fail(Failure {
                code: e.code,
                message: e.message,
                retryable: self.iii.cfg.settings(&r.function_id).retryable,
            }),
            None => Outcome::Complete(r.result.unwrap_or(Value::Null)),
        };
        let id = r.invocation_id;
        let args = ResultArgs {
            invocation_id: id.clone(),
            outcome,
        };
        let taken: Result<ResultOk, _> = self
            .request(&as_worker(w.clone()), Op::InvocationResult, &args)
            .await;
        match taken {
            Ok(ok) => {
                tracing::debug!(worker_id = w, invocation_id = id, accepted = ?ok.accepted, "iii invocationresult")
            }
            Err(e) => tracing::warn!(
                worker_id = w,
                invocation_id = id,
                "iii invocationresult not taken: {e}"
            ),
        }
    }
}

/// An iii connection acting as its worker, for the worker ops.
fn as_worker(worker_id: String) -> Caller {
    Caller {
        role: Role::Worker,
        worker_id: Some(worker_id),
    }
}

/// An iii connection acting as a caller (a `trigger`), for the caller ops.
fn as_client() -> Caller {
    Caller {
        role: Role::Client,
        worker_id: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_tokens_are_percent_decoded() {
        assert_eq!(percent_decode("a%2Fb+c"), "a/b c");
        assert_eq!(percent_decode("plain"), "plain");
        assert_eq!(percent_decode("bad%zz"), "bad%zz");
    }

    fn push(p: &Push) -> String {
        serde_json::to_string(p).expect("json")
    }

    #[test]
    fn only_invocations_become_iii_frames() {
        let invoke = push(&Push::Invoke(turnd_proto::Invoke {
            invocation_id: "i1".into(),
            function_id: "f".into(),
            session_id: "s".into(),
            turn_id: "t".into(),
            step: 1,
            attempt: 2,
            input: json!({"x": 1}),
            deadline_ms: 99,
            previous: None,
        }));
        let f = translate_push(&invoke).expect("an invokefunction");
        let v: Value = serde_json::from_str(&f).expect("json");
        assert_eq!(v["type"], "invokefunction");
        assert_eq!(v["invocation_id"], "i1");
        assert_eq!(v["data"], json!({"x": 1}));
        assert_eq!(v["metadata"]["turnd"]["attempt"], 2);
        assert_eq!(v["metadata"]["turnd"]["session_id"], "s");
        let cancel = push(&Push::Cancel {
            invocation_id: "i1".into(),
            reason: "stop".into(),
        });
        assert_eq!(translate_push(&cancel), None);
        let probe = push(&Push::Probe {
            invocation_id: "i1".into(),
        });
        assert_eq!(translate_push(&probe), None);
    }
}
