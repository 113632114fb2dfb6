//! Connection: multiplexing, errors, end of connection, hello.

use std::time::Duration;

use serde_json::json;
use turnd_proto::{ErrorCode, HelloArgs, Role, PROTOCOL_VERSION};

use super::fake::{FakeServer, STEP};
use crate::{ClientError, Connection};

#[tokio::test]
async fn requests_are_multiplexed_and_answered_out_of_order() {
    let server = FakeServer::start().await;
    let (conn, mut peer) = tokio::join!(Connection::connect_raw(&server.url), server.accept());
    let conn = conn.expect("connect");

    let waiting = tokio::spawn({
        let conn = conn.clone();
        async move { conn.request("turn.wait", json!({"turn_id": "t_1"})).await }
    });
    let wait_req = peer.expect("turn.wait").await;

    let ping = tokio::spawn({
        let conn = conn.clone();
        async move { conn.request("ping", json!({})).await }
    });
    let ping_req = peer.expect("ping").await;
    assert_ne!(wait_req.id, ping_req.id, "ids are unique per connection");

    // The later request is answered first and must not wait for the earlier one.
    peer.ok(ping_req.id, json!({"pong": true})).await;
    let pong = tokio::time::timeout(STEP, ping)
        .await
        .expect("ping answered while turn.wait is pending")
        .expect("join");
    assert_eq!(pong, Ok(json!({"pong": true})));
    assert!(!waiting.is_finished(), "turn.wait got no answer yet");

    peer.ok(wait_req.id, json!({"turn": "x"})).await;
    let waited = tokio::time::timeout(STEP, waiting)
        .await
        .expect("answered")
        .expect("join");
    assert_eq!(waited, Ok(json!({"turn": "x"})));
}

#[tokio::test]
async fn error_responses_and_connection_end_reach_the_requester() {
    let server = FakeServer::start().await;
    let (conn, mut peer) = tokio::join!(Connection::connect_raw(&server.url), server.accept());
    let conn = conn.expect("connect");

    let (answer, ()) = tokio::join!(conn.request("turn.get", json!({"turn_id": "t_x"})), async {
        let req = peer.expect("turn.get").await;
        peer.error(req.id, "not_found").await;
    });
    let err = answer.expect_err("server refused");
    assert_eq!(err.code(), Some(ErrorCode::NotFound));
    assert!(!err.is_retryable());

    // A pending request fails with Closed when the server goes away.
    let pending = tokio::spawn({
        let conn = conn.clone();
        async move { conn.request("turn.wait", json!({"turn_id": "t_1"})).await }
    });
    peer.expect("turn.wait").await;
    drop(peer);
    let result = tokio::time::timeout(STEP, pending)
        .await
        .expect("fails in time")
        .expect("join");
    assert_eq!(result, Err(ClientError::Closed));
    tokio::time::timeout(STEP, conn.closed())
        .await
        .expect("closed resolves");
    assert!(conn.is_closed());
    assert_eq!(
        conn.request("ping", json!({})).await,
        Err(ClientError::Closed)
    );
}

#[tokio::test]
async fn hello_is_sent_first_and_a_refusal_is_an_error() {
    let server = FakeServer::start().await;
    let hello = HelloArgs {
        protocol: PROTOCOL_VERSION,
        role: Role::Client,
        token: Some("wrong".into()),
        name: None,
        worker_id: None,
        instance_id: None,
        inflight: vec![],
        finished: vec![],
    };
    let (result, ()) = tokio::join!(Connection::connect(&server.url, hello), async {
        let mut peer = server.accept().await;
        let req = peer.expect("hello").await;
        assert_eq!(req.args["token"], "wrong");
        assert_eq!(req.args["protocol"], 1);
        peer.error(req.id, "not_authenticated").await;
    });
    let err = result.expect_err("hello refused");
    assert_eq!(err.code(), Some(ErrorCode::NotAuthenticated));
}

#[tokio::test]
async fn pushes_are_taken_once_and_close_ends_them() {
    let server = FakeServer::start().await;
    let (conn, mut peer) = tokio::join!(Connection::connect_raw(&server.url), server.accept());
    let conn = conn.expect("connect");
    // A push that arrives before the stream is taken is kept.
    peer.send(json!({"push": "probe", "invocation_id": "inv_1"}))
        .await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut pushes = conn.pushes().expect("first take");
    assert!(conn.pushes().is_none(), "second take gets nothing");
    let push = tokio::time::timeout(STEP, pushes.recv())
        .await
        .expect("in time");
    assert_eq!(
        push,
        Some(turnd_proto::Push::Probe {
            invocation_id: "inv_1".into()
        })
    );
    let ((), rest) = tokio::join!(conn.close(), peer.try_recv(STEP));
    assert!(rest.is_none(), "server sees the close");
    assert!(conn.is_closed());
    assert_eq!(
        tokio::time::timeout(STEP, pushes.recv())
            .await
            .expect("ends"),
        None
    );
}

#[tokio::test]
async fn close_code_is_recorded() {
    let server = FakeServer::start().await;
    let (conn, mut peer) = tokio::join!(Connection::connect_raw(&server.url), server.accept());
    let conn = conn.expect("connect");
    peer.close(turnd_proto::CLOSE_SUPERSEDED).await;
    tokio::time::timeout(STEP, conn.closed())
        .await
        .expect("closed");
    assert_eq!(conn.close_code(), Some(turnd_proto::CLOSE_SUPERSEDED));
}

#[tokio::test]
async fn a_silent_server_is_taken_as_gone() {
    let server = FakeServer::start().await;
    let hello = HelloArgs {
        protocol: PROTOCOL_VERSION,
        role: Role::Client,
        token: None,
        name: None,
        worker_id: None,
        instance_id: None,
        inflight: vec![],
        finished: vec![],
    };
    let (conn, mut peer) = tokio::join!(Connection::connect(&server.url, hello), async {
        let mut peer = server.accept().await;
        let req = peer.expect("hello").await;
        let mut ok = super::fake::hello_ok(json!(null));
        ok["heartbeat_ms"] = json!(30);
        peer.ok(req.id, ok).await;
        peer
    });
    let (conn, _) = conn.expect("connect");
    // Pings count as life: 200 ms of pings every 20 ms keep a 90 ms limit happy.
    for _ in 0..10 {
        peer.ping().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!conn.is_closed(), "closed although the server pings");
    }
    // Then silence: the connection ends on its own.
    let pending = conn.request("turn.wait", json!({"turn_id": "t_1"}));
    let result = tokio::time::timeout(STEP, pending)
        .await
        .expect("ends in time");
    assert_eq!(result, Err(ClientError::Closed));
    assert!(conn.is_closed());
}
