//! A tiny scripted WebSocket server: each test plays the server side of exactly the
//! frames it is about, so the SDK's behaviour can be checked without a daemon.

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;
use turnd_proto::{decode_request, HelloArgs, Request};

/// How long a scripted step waits for the client before the test fails.
pub const STEP: Duration = Duration::from_secs(5);

pub struct FakeServer {
    listener: TcpListener,
    pub url: String,
}

impl FakeServer {
    pub async fn start() -> FakeServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        FakeServer {
            listener,
            url: crate::ws_url(addr),
        }
    }

    /// Accept the next WebSocket connection.
    pub async fn accept(&self) -> FakePeer {
        let (tcp, _) = tokio::time::timeout(STEP, self.listener.accept())
            .await
            .expect("client connects in time")
            .expect("accept");
        let ws = tokio_tungstenite::accept_async(tcp)
            .await
            .expect("websocket handshake");
        FakePeer { ws }
    }
}

pub struct FakePeer {
    ws: WebSocketStream<TcpStream>,
}

pub fn hello_ok(reconciled: Value) -> Value {
    json!({
        "server": "turnd", "version": "0.1.0", "boot_id": "b1", "connection_id": "c1",
        "heartbeat_ms": 5000, "max_frame_bytes": 1048576, "reconciled": reconciled,
    })
}

pub fn invoke(invocation_id: &str, function_id: &str, input: Value) -> Value {
    json!({
        "push": "invoke", "invocation_id": invocation_id, "function_id": function_id,
        "session_id": "s-1", "turn_id": "t_1", "step": 0, "attempt": 1,
        "input": input, "deadline_ms": 0,
    })
}

pub fn turn(status: &str) -> Value {
    json!({
        "turn_id": "t_1", "session_id": "s-1", "seq": 1, "function_id": "f",
        "status": status, "step": 0, "attempt": 1, "input": null,
        "created_at_ms": 1, "updated_at_ms": 1,
    })
}

pub fn event(seq: u64) -> Value {
    json!({"seq": seq, "session_id": "s-1", "turn_id": "t_1", "at_ms": 1, "kind": "admitted", "detail": {}})
}

impl FakePeer {
    /// The next request within `within`; `None` when none came or the peer left.
    pub async fn try_recv(&mut self, within: Duration) -> Option<Request> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let msg = tokio::time::timeout_at(deadline, self.ws.next())
                .await
                .ok()?;
            match msg {
                None | Some(Err(_)) => return None,
                // Keep reading so tungstenite flushes its close reply, as a real
                // server's read loop does.
                Some(Ok(Message::Close(_))) => continue,
                Some(Ok(Message::Text(text))) => {
                    return Some(
                        decode_request(text.as_str()).expect("client sends valid requests"),
                    )
                }
                Some(Ok(_)) => continue,
            }
        }
    }

    /// The next request; fails the test if none comes in time.
    pub async fn recv(&mut self) -> Request {
        self.try_recv(STEP)
            .await
            .expect("a request from the client")
    }

    /// The next request, which must be `op`.
    pub async fn expect(&mut self, op: &str) -> Request {
        let req = self.recv().await;
        assert_eq!(req.op, op, "unexpected request {req:?}");
        req
    }

    pub async fn send(&mut self, frame: Value) {
        self.ws
            .send(Message::text(frame.to_string()))
            .await
            .expect("send to client");
    }

    pub async fn ok(&mut self, id: u64, ok: Value) {
        self.send(json!({"id": id, "ok": ok})).await;
    }

    pub async fn error(&mut self, id: u64, code: &str) {
        let retryable = matches!(
            code,
            "rate_limited" | "unavailable" | "shutting_down" | "internal"
        );
        self.send(json!({"id": id, "error": {"code": code, "message": "scripted", "retryable": retryable}}))
            .await;
    }

    /// Answer a hello; returns its arguments.
    pub async fn hello(&mut self, reconciled: Value) -> HelloArgs {
        let req = self.expect("hello").await;
        let args: HelloArgs = serde_json::from_value(req.args).expect("hello args");
        self.ok(req.id, hello_ok(reconciled)).await;
        args
    }

    /// Answer a worker's hello and its `functions` registrations.
    pub async fn worker_hello(&mut self, functions: usize, reconciled: Value) -> HelloArgs {
        let hello = self.hello(reconciled).await;
        for _ in 0..functions {
            let req = self.expect("function.register").await;
            let id = req.args["function_id"].clone();
            self.ok(req.id, json!({"function_id": id, "workers": 1}))
                .await;
        }
        hello
    }

    pub async fn ping(&mut self) {
        self.ws
            .send(Message::Ping(Vec::new().into()))
            .await
            .expect("ping");
    }

    pub async fn close(&mut self, code: u16) {
        let frame = CloseFrame {
            code: CloseCode::from(code),
            reason: "scripted".into(),
        };
        self.ws.close(Some(frame)).await.expect("close");
    }
}
