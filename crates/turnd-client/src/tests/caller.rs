//! Caller: watch routing, a watch opened again after a lost connection, and wait
//! loops.

use std::time::Duration;

use serde_json::json;
use turnd_proto::{TurnStatus, WatchArgs};

use super::fake::{event, turn, FakePeer, FakeServer, STEP};
use crate::{Caller, ClientError, WatchItem};

/// A watch of session `s-1` from its first event (with `after` given, a caller
/// sends `watch` alone).
fn watch_session() -> WatchArgs {
    WatchArgs {
        session_id: Some("s-1".into()),
        turn_id: None,
        after: Some(0),
        progress: false,
    }
}

/// A caller connected to `server`, and the server's side of its connection.
async fn connected(server: &FakeServer) -> (Caller, FakePeer) {
    let (caller, peer) = tokio::join!(Caller::connect(&server.url, None), async {
        let mut peer = server.accept().await;
        peer.hello(json!(null)).await;
        peer
    });
    (caller.expect("connect"), peer)
}

fn progress(watch_id: &str, seq: u64) -> serde_json::Value {
    json!({"push": "progress", "watch_id": watch_id, "turn_id": "t_1",
           "invocation_id": "inv_1", "step": 0, "attempt": 1, "seq": seq, "data": seq})
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

    // The other watch still works.
    peer.send(json!({"push": "event", "watch_id": "w_2", "event": event(12)}))
        .await;
    let e = tokio::time::timeout(STEP, w2.next())
        .await
        .expect("in time");
    assert_eq!(e.expect("event").seq, 12);
}

#[tokio::test]
async fn a_watch_is_opened_again_from_its_last_event_after_a_lost_connection() {
    let server = FakeServer::start().await;
    let (caller, mut peer) = connected(&server).await;
    // Without `after`, it starts at the session's last event as read first.
    let args = WatchArgs {
        progress: true,
        after: None,
        ..watch_session()
    };
    let (w, ()) = tokio::join!(caller.watch(args), async {
        let req = peer.expect("session.inspect").await;
        let session = turnd_proto::Session {
            session_id: "s-1".into(),
            lock: None,
            queued: vec![],
            turns: turnd_proto::TurnCounts::default(),
            last_event: 4,
        };
        peer.ok(req.id, json!({"session": session})).await;
        let req = peer.expect("watch").await;
        assert_eq!(req.args["after"], 4);
        assert_eq!(req.args["progress"], true);
        peer.ok(req.id, json!({"watch_id": "w_1"})).await;
        for seq in [5, 6] {
            peer.send(json!({"push": "event", "watch_id": "w_1", "event": event(seq)}))
                .await;
        }
        peer.send(progress("w_1", 0)).await;
    });
    let mut w = w.expect("watch");
    let mut items = vec![];
    for _ in 0..3 {
        items.push(
            tokio::time::timeout(STEP, w.next_item())
                .await
                .expect("in time"),
        );
    }
    assert!(
        matches!(&items[1], Some(WatchItem::Event(e)) if e.seq == 6),
        "{items:?}"
    );
    assert!(
        matches!(&items[2], Some(WatchItem::Progress(p)) if p.seq == 0),
        "{items:?}"
    );

    // The connection is lost: the stream opens the watch again on a new one, from
    // the last event it delivered; an event it delivered already is not repeated,
    // and the progress frames it missed are counted.
    drop(peer);
    let (next, mut peer) = tokio::join!(tokio::time::timeout(STEP, w.next_item()), async {
        let mut peer = server.accept().await;
        peer.hello(json!(null)).await;
        let req = peer.expect("watch").await;
        assert_eq!(req.args["after"], 6);
        assert_eq!(req.args["session_id"], "s-1");
        peer.ok(req.id, json!({"watch_id": "w_2"})).await;
        for seq in [6, 7] {
            peer.send(json!({"push": "event", "watch_id": "w_2", "event": event(seq)}))
                .await;
        }
        peer.send(progress("w_2", 3)).await;
        peer
    });
    assert!(matches!(&next.expect("in time"), Some(WatchItem::Event(e)) if e.seq == 7));
    let dropped = tokio::time::timeout(STEP, w.next_item())
        .await
        .expect("in time");
    assert_eq!(
        dropped,
        Some(WatchItem::ProgressDropped {
            turn_id: "t_1".into(),
            invocation_id: "inv_1".into(),
            count: 2
        })
    );
    let frame = tokio::time::timeout(STEP, w.next_item())
        .await
        .expect("in time");
    assert!(
        matches!(&frame, Some(WatchItem::Progress(p)) if p.seq == 3),
        "{frame:?}"
    );
    assert_eq!(w.starts(), 2);

    // Unwatched by its first id: the current opening is unwatched, the stream ends.
    let (unwatched, ()) = tokio::join!(caller.unwatch("w_1"), async {
        let req = peer.expect("unwatch").await;
        assert_eq!(req.args["watch_id"], "w_2");
        peer.ok(req.id, json!({})).await;
    });
    unwatched.expect("unwatch");
    assert_eq!(
        tokio::time::timeout(STEP, w.next()).await.expect("ends"),
        None
    );
}

#[tokio::test]
async fn a_watch_of_a_given_connection_ends_with_it() {
    let server = FakeServer::start().await;
    let (conn, mut peer) =
        tokio::join!(crate::Connection::connect_raw(&server.url), server.accept());
    let caller = Caller::from_connection(conn.expect("connect"));
    let (w, ()) = tokio::join!(caller.watch(watch_session()), async {
        let req = peer.expect("watch").await;
        peer.ok(req.id, json!({"watch_id": "w_1"})).await;
    });
    let mut w = w.expect("watch");
    drop(peer);
    assert_eq!(
        tokio::time::timeout(STEP, w.next()).await.expect("ends"),
        None
    );
}

#[tokio::test]
async fn wait_terminal_repeats_wait_until_terminal() {
    let server = FakeServer::start().await;
    let (caller, mut peer) = connected(&server).await;
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
    let (caller, mut peer) = connected(&server).await;
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

/// A request's future holds no room for dialing again (which only a lost
/// connection needs): a caller that spawns a task per wait or submit moved about
/// 12 KB per task with that room inline, and moves about 1 KB without it.
#[tokio::test]
async fn a_request_future_is_small() {
    let server = FakeServer::start().await;
    let (caller, _peer) = connected(&server).await;
    let wait = caller.wait_terminal("t_1", Duration::from_secs(1));
    let wait_size = std::mem::size_of_val(&wait);
    drop(wait);
    let submit = caller.submit_simple("s-1", "f", json!({}));
    let submit_size = std::mem::size_of_val(&submit);
    drop(submit);
    for (what, size) in [("wait_terminal", wait_size), ("submit_simple", submit_size)] {
        assert!(size < 4096, "{what}'s future is {size} bytes");
    }
}
