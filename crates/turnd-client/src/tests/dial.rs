//! A caller given several URLs: which one it connects to, which one it connects to
//! again, and which requests it sends again when their connection is lost.

use serde_json::json;
use turnd_proto::{SubmitArgs, TurnStatus};

use super::fake::{turn, FakeServer};
use crate::url::parse_url_list;
use crate::{Caller, ClientError};

/// A URL nobody listens on (a port bound, then released).
fn dead_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    crate::ws_url(l.local_addr().expect("local addr"))
}

fn submit(key: Option<&str>) -> SubmitArgs {
    SubmitArgs {
        session_id: "s-1".into(),
        function_id: "f".into(),
        input: json!(1),
        idempotency_key: key.map(str::to_string),
        turn_timeout_ms: None,
        on_busy: None,
    }
}

#[tokio::test]
async fn connects_to_the_first_url_that_answers() {
    let dead = dead_url();
    let a = FakeServer::start().await;
    let urls = [&dead, &a.url];
    let (caller, _peer) = tokio::join!(Caller::connect_any(&urls, None), async {
        let mut peer = a.accept().await;
        peer.hello(json!(null)).await;
        peer
    });
    let caller = caller.expect("connect to the live URL");
    assert_eq!(caller.url(), Some(a.url.clone()));
}

#[tokio::test]
async fn no_url_answering_names_each() {
    let (d1, d2) = (dead_url(), dead_url());
    let err = Caller::connect_any(&[&d1, &d2], None)
        .await
        .expect_err("nothing listens");
    let ClientError::Connect(msg) = &err else {
        panic!("a connect error: {err:?}");
    };
    assert!(msg.starts_with("no URL answered: "), "{msg}");
    assert!(msg.contains(&format!("{d1}: ")), "{msg}");
    assert!(msg.contains(&format!("; {d2}: ")), "{msg}");
    // One URL fails as `connect` always did: its own error.
    let one = Caller::connect(&d1, None)
        .await
        .expect_err("nothing listens");
    assert!(
        matches!(&one, ClientError::Connect(m) if m.starts_with(&d1)),
        "{one:?}"
    );
    let none = Caller::connect_any::<&str>(&[], None).await;
    assert!(matches!(none, Err(ClientError::Connect(_))), "{none:?}");
}

/// A read whose connection is lost in flight is sent again to the next URL; a submit
/// without an idempotency key is not (it fails with `Closed`), one with a key is.
#[tokio::test]
async fn a_lost_request_is_sent_again_only_when_safe() {
    let a = FakeServer::start().await;
    let b = FakeServer::start().await;
    let urls = [&a.url, &b.url];
    let (caller, mut pa) = tokio::join!(Caller::connect_any(&urls, None), async {
        let mut peer = a.accept().await;
        peer.hello(json!(null)).await;
        peer
    });
    let caller = caller.expect("connect");

    // A read: A drops the connection with it in flight, B answers it.
    let (got, mut pb) = tokio::join!(caller.get("t_1"), async {
        pa.expect("turn.get").await;
        drop(pa);
        let mut pb = b.accept().await;
        pb.hello(json!(null)).await;
        let req = pb.expect("turn.get").await;
        pb.ok(req.id, json!({"turn": turn("running")})).await;
        pb
    });
    assert_eq!(got.expect("answered by B").status, TurnStatus::Running);
    assert_eq!(caller.url(), Some(b.url.clone()));

    // A submit without a key: lost with B's connection, not sent again.
    let (lost, ()) = tokio::join!(caller.submit(submit(None)), async {
        pb.expect("turn.submit").await;
        drop(pb);
    });
    assert_eq!(lost.map(|_| ()), Err(ClientError::Closed));
    // The next request connects again, after B: to A, and it is the first A sees.
    let (pinged, mut pa) = tokio::join!(caller.ping(), async {
        let mut pa = a.accept().await;
        pa.hello(json!(null)).await;
        let req = pa.expect("ping").await;
        pa.ok(req.id, json!({})).await;
        pa
    });
    pinged.expect("ping answered by A");

    // A submit with a key: lost with A's connection, sent again to B.
    let (sent, _pb) = tokio::join!(caller.submit(submit(Some("k-1"))), async {
        pa.expect("turn.submit").await;
        drop(pa);
        let mut pb = b.accept().await;
        pb.hello(json!(null)).await;
        let req = pb.expect("turn.submit").await;
        assert_eq!(req.args["idempotency_key"], "k-1");
        pb.ok(
            req.id,
            json!({"turn": turn("queued"), "deduplicated": true}),
        )
        .await;
        pb
    });
    assert!(sent.expect("answered by B").deduplicated);
}

#[test]
fn url_lists_are_trimmed_and_empty_entries_refused() {
    assert_eq!(
        parse_url_list("ws://a/v1"),
        Ok(vec!["ws://a/v1".to_string()])
    );
    assert_eq!(
        parse_url_list(" ws://a/v1 ,\tws://b/v1 "),
        Ok(vec!["ws://a/v1".to_string(), "ws://b/v1".to_string()])
    );
    for (list, says) in [
        ("ws://a/v1,,ws://b/v1", "URL 2 of 3"),
        ("ws://a/v1,", "URL 2 of 2"),
        (",ws://a/v1", "URL 1 of 2"),
        ("ws://a/v1, ,ws://b/v1", "URL 2 of 3"),
    ] {
        let err = parse_url_list(list).expect_err(list);
        assert!(
            err.contains(says) && err.contains("is empty"),
            "{list}: {err}"
        );
    }
    for empty in ["", "  "] {
        let err = parse_url_list(empty).expect_err("empty");
        assert!(err.starts_with("no URL given"), "{err}");
    }
}
