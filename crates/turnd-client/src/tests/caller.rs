//! Caller: watch routing and wait loops.

use std::time::Duration;

use serde_json::json;
use turnd_proto::{TurnStatus, WatchArgs};

use super::fake::{event, turn, FakeServer, STEP};
use crate::{Caller, ClientError};

fn watch_session() -> WatchArgs {
    WatchArgs {
        session_id: Some("s-1".into()),
        turn_id: None,
        after: None,
        progress: false,
    }
}

#[tokio::test]
async fn pushes_route_to_their_own_watch() {
    let server = FakeServer::start().await;
    let (caller, mut peer) = tokio::join!(Caller::connect(&server.url, Some("tok")), async {
        let mut peer = server.accept().await;
        let hello = peer.hello(json!(null)).await;
        assert_eq!(hello.role, turnd_proto::Role::Client);
        assert_eq!(hello.token.as_deref(), Some("tok"));
        peer
    });
    let caller = caller.expect("connect");

    // Events can be routed before `watch` has returned the stream: one pushed before
    // the answer (a concurrent server may do that) and one right after it. Neither
    // may be lost.
    let (w1, ()) = tokio::join!(caller.watch(watch_session()), async {
        let req = peer.expect("watch").await;
        peer.send(json!({"push": "event", "watch_id": "w_1", "event": event(1)}))
            .await;
        tokio::time::sleep(Duration::from_millis(30)).await;
        peer.ok(req.id, json!({"watch_id": "w_1"})).await;
        peer.send(json!({"push": "event", "watch_id": "w_1", "event": event(2)}))
            .await;
    });
    let mut w1 = w1.expect("watch 1");
    let (w2, ()) = tokio::join!(caller.watch(watch_session()), async {
        let req = peer.expect("watch").await;
        peer.ok(req.id, json!({"watch_id": "w_2"})).await;
    });
    let mut w2 = w2.expect("watch 2");
    assert_eq!(w1.watch_id, "w_1");
    assert_eq!(w2.watch_id, "w_2");

    for (watch, seq) in [("w_2", 10), ("w_1", 3), ("w_2", 11), ("w_1", 4)] {
        peer.send(json!({"push": "event", "watch_id": watch, "event": event(seq)}))
            .await;
    }
    let mut seqs1 = vec![];
    let mut seqs2 = vec![];
    for _ in 0..4 {
        let e = tokio::time::timeout(STEP, w1.next())
            .await
            .expect("in time");
        seqs1.push(e.expect("event").seq);
    }
    for _ in 0..2 {
        let e = tokio::time::timeout(STEP, w2.next())
            .await
            .expect("in time");
        seqs2.push(e.expect("event").seq);
    }
    assert_eq!(seqs1, [1, 2, 3, 4]);
    assert_eq!(seqs2, [10, 11]);

    let (unwatched, ()) = tokio::join!(caller.unwatch("w_1"), async {
        let req = peer.expect("unwatch").await;
        assert_eq!(req.args["watch_id"], "w_1");
        peer.ok(req.id, json!({})).await;
    });
    unwatched.expect("unwatch");
    assert_eq!(
        tokio::time::timeout(STEP, w1.next()).await.expect("ends"),
        None
    );

    // The other watch still works, and ends with the connection.
    peer.send(json!({"push": "event", "watch_id": "w_2", "event": event(12)}))
        .await;
    let e = tokio::time::timeout(STEP, w2.next())
        .await
        .expect("in time");
    assert_eq!(e.expect("event").seq, 12);
    drop(peer);
    assert_eq!(
        tokio::time::timeout(STEP, w2.next()).await.expect("ends"),
        None
    );
}

#[tokio::test]
async fn wait_terminal_repeats_wait_until_terminal() {
    let server = FakeServer::start().await;
    let (caller, mut peer) = tokio::join!(Caller::connect(&server.url, None), async {
        let mut peer = server.accept().await;
        peer.hello(json!(null)).await;
        peer
    });
    let caller = caller.expect("connect");
    let (result, ()) = tokio::join!(caller.wait_terminal("t_1", STEP), async {
        let req = peer.expect("turn.wait").await;
        let ms = req.args["timeout_ms"].as_u64().expect("timeout_ms sent");
        assert!(ms <= 5000 && ms > 0, "bounded by the overall time: {ms}");
        peer.ok(req.id, json!({"turn": turn("running")})).await;
        let req = peer.expect("turn.wait").await;
        peer.ok(req.id, json!({"turn": turn("completed")})).await;
    });
    assert_eq!(result.expect("terminal").status, TurnStatus::Completed);
}

#[tokio::test]
async fn wait_terminal_times_out() {
    let server = FakeServer::start().await;
    let (caller, mut peer) = tokio::join!(Caller::connect(&server.url, None), async {
        let mut peer = server.accept().await;
        peer.hello(json!(null)).await;
        peer
    });
    let caller = caller.expect("connect");
    let serve = tokio::spawn(async move {
        // Behave like the server: hold each wait for its timeout, turn still running.
        while let Some(req) = peer.try_recv(STEP).await {
            let ms = req.args["timeout_ms"].as_u64().unwrap_or(30_000);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            peer.ok(req.id, json!({"turn": turn("running")})).await;
        }
    });
    let started = tokio::time::Instant::now();
    let result = caller
        .wait_terminal("t_1", Duration::from_millis(150))
        .await;
    assert_eq!(result, Err(ClientError::Timeout));
    assert!(started.elapsed() < Duration::from_secs(2));
    drop(caller);
    tokio::time::timeout(STEP, serve)
        .await
        .expect("server script ends")
        .expect("join");
}
