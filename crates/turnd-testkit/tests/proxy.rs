//! The proxy against a tiny echo WebSocket server: every fault does what it says.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use turnd_testkit::{Dir, Match, Proxy, Rule};

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// An echo server: every text frame comes back; counts connections opened and ended.
struct Echo {
    url: String,
    opened: Arc<AtomicUsize>,
    ended: Arc<AtomicUsize>,
}

async fn echo_server() -> anyhow::Result<Echo> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("ws://{}/v1", listener.local_addr()?);
    let opened = Arc::new(AtomicUsize::new(0));
    let ended = Arc::new(AtomicUsize::new(0));
    let (o, e) = (opened.clone(), ended.clone());
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (o, e) = (o.clone(), e.clone());
            tokio::spawn(async move {
                let Ok(mut ws) = tokio_tungstenite::accept_async(tcp).await else {
                    return;
                };
                o.fetch_add(1, Ordering::SeqCst);
                while let Some(Ok(m)) = ws.next().await {
                    let echoed = match m {
                        Message::Text(t) => ws.send(Message::Text(t)).await.is_ok(),
                        Message::Close(_) => false,
                        _ => true,
                    };
                    if !echoed {
                        break;
                    }
                }
                e.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    Ok(Echo { url, opened, ended })
}

async fn connect(url: &str) -> anyhow::Result<Ws> {
    Ok(tokio_tungstenite::connect_async(url).await?.0)
}

async fn send(ws: &mut Ws, v: Value) -> anyhow::Result<()> {
    ws.send(Message::text(v.to_string())).await?;
    Ok(())
}

/// The next text frame as JSON, or None when nothing comes within `ms`.
async fn recv(ws: &mut Ws, ms: u64) -> anyhow::Result<Option<Value>> {
    loop {
        match tokio::time::timeout(Duration::from_millis(ms), ws.next()).await {
            Err(_) => return Ok(None),
            Ok(Some(Ok(Message::Text(t)))) => return Ok(Some(serde_json::from_str(t.as_str())?)),
            Ok(Some(Ok(Message::Close(c)))) => anyhow::bail!("closed: {c:?}"),
            Ok(Some(Ok(_))) => continue,
            Ok(Some(Err(e))) => anyhow::bail!("socket error: {e}"),
            Ok(None) => anyhow::bail!("ended"),
        }
    }
}

async fn eventually(what: &str, mut f: impl FnMut() -> bool) -> anyhow::Result<()> {
    for _ in 0..500 {
        if f() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    anyhow::bail!("timed out waiting for {what}")
}

#[tokio::test]
async fn forwards_drops_and_duplicates() -> anyhow::Result<()> {
    let echo = echo_server().await?;
    let proxy = Proxy::start(echo.url.clone()).await?;
    let mut ws = connect(&proxy.url()).await?;
    send(
        &mut ws,
        json!({"id": 1, "op": "hello", "args": {"worker_id": "w1"}}),
    )
    .await?;
    assert_eq!(
        recv(&mut ws, 2000).await?,
        Some(json!({"id": 1, "op": "hello", "args": {"worker_id": "w1"}}))
    );

    let dropped = proxy.drop_next(Dir::ToServer, Match::op("x"), 1);
    send(&mut ws, json!({"op": "x", "n": 1})).await?;
    send(&mut ws, json!({"op": "x", "n": 2})).await?;
    assert_eq!(recv(&mut ws, 2000).await?, Some(json!({"op": "x", "n": 2})));
    assert_eq!(proxy.hits(dropped), 1);

    proxy.duplicate_next(Dir::ToClient, Match::field("/n", json!(3)), 1);
    send(&mut ws, json!({"op": "x", "n": 3})).await?;
    assert_eq!(recv(&mut ws, 2000).await?, Some(json!({"op": "x", "n": 3})));
    assert_eq!(recv(&mut ws, 2000).await?, Some(json!({"op": "x", "n": 3})));
    assert_eq!(recv(&mut ws, 200).await?, None);

    let s = proxy.stats();
    assert_eq!((s.connections, s.dropped, s.duplicated), (1, 1, 1));
    assert_eq!(proxy.count(Dir::ToServer, &Match::op("x")), 3);
    assert_eq!(proxy.worker_connections("w1"), 1);
    Ok(())
}

#[tokio::test]
async fn delay_keeps_order() -> anyhow::Result<()> {
    let echo = echo_server().await?;
    let proxy = Proxy::start(echo.url.clone()).await?;
    let mut ws = connect(&proxy.url()).await?;
    proxy.add(
        Rule::delay(
            Dir::ToServer,
            Match::field("/n", json!(1)),
            Duration::from_millis(300),
        )
        .times(1),
    );
    let started = tokio::time::Instant::now();
    send(&mut ws, json!({"n": 1})).await?;
    send(&mut ws, json!({"n": 2})).await?;
    assert_eq!(recv(&mut ws, 2000).await?, Some(json!({"n": 1})));
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(recv(&mut ws, 2000).await?, Some(json!({"n": 2})));
    Ok(())
}

#[tokio::test]
async fn chance_rules_follow_the_seed() -> anyhow::Result<()> {
    let echo = echo_server().await?;
    let mut outcomes = Vec::new();
    for _ in 0..2 {
        let proxy = Proxy::start(echo.url.clone()).await?;
        proxy.seed(7);
        proxy.add(Rule::drop(Dir::ToServer, Match::any()).chance(0.5));
        let mut ws = connect(&proxy.url()).await?;
        for n in 0..20 {
            send(&mut ws, json!({"n": n})).await?;
        }
        send(&mut ws, json!({"end": true})).await?;
        // Wait for everything to pass the proxy, then read what got through.
        let end = Match::field("/end", json!(true));
        assert!(
            proxy
                .wait_frames(Dir::ToServer, &end, 1, Duration::from_secs(2))
                .await
        );
        let mut got = Vec::new();
        while let Some(v) = recv(&mut ws, 300).await? {
            got.push(v);
        }
        assert!(got.len() < 21, "nothing dropped");
        outcomes.push(got);
    }
    assert_eq!(outcomes[0], outcomes[1], "same seed, different drops");
    Ok(())
}

#[tokio::test]
async fn cut_drops_both_sides_without_close_frame() -> anyhow::Result<()> {
    let echo = echo_server().await?;
    let proxy = Proxy::start(echo.url.clone()).await?;
    let mut ws = connect(&proxy.url()).await?;
    send(&mut ws, json!({"n": 1})).await?;
    recv(&mut ws, 2000).await?;
    assert_eq!(proxy.cut_all(), 1);
    match tokio::time::timeout(Duration::from_secs(2), ws.next()).await? {
        Some(Ok(Message::Close(c))) => anyhow::bail!("got a close frame: {c:?}"),
        Some(Ok(m)) => anyhow::bail!("got {m:?}"),
        Some(Err(_)) | None => {}
    }
    let ended = echo.ended.clone();
    eventually("the server side to end", || {
        ended.load(Ordering::SeqCst) == 1
    })
    .await?;
    assert_eq!(proxy.connections(), 0);
    Ok(())
}

#[tokio::test]
async fn half_open_keeps_the_server_side() -> anyhow::Result<()> {
    let echo = echo_server().await?;
    let proxy = Proxy::start(echo.url.clone()).await?;
    let mut ws = connect(&proxy.url()).await?;
    send(
        &mut ws,
        json!({"id": 1, "op": "hello", "args": {"worker_id": "w-h"}}),
    )
    .await?;
    recv(&mut ws, 2000).await?;
    assert_eq!(proxy.half_open_worker("w-h"), 1);
    let r = tokio::time::timeout(Duration::from_secs(2), ws.next()).await?;
    assert!(
        !matches!(r, Some(Ok(Message::Text(_)))),
        "peer side still open: {r:?}"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        echo.ended.load(Ordering::SeqCst),
        0,
        "server side was closed"
    );
    proxy.cut_all();
    let ended = echo.ended.clone();
    eventually("the server side to end", || {
        ended.load(Ordering::SeqCst) == 1
    })
    .await
}

#[tokio::test]
async fn refuse_hold_and_switch_upstream() -> anyhow::Result<()> {
    let first = echo_server().await?;
    let second = echo_server().await?;
    let proxy = Proxy::start(first.url.clone()).await?;

    proxy.refuse(true);
    assert!(
        connect(&proxy.url()).await.is_err(),
        "connected while refusing"
    );
    proxy.refuse(false);
    let mut ws = connect(&proxy.url()).await?;
    send(&mut ws, json!({"n": 1})).await?;
    assert!(recv(&mut ws, 2000).await?.is_some());
    assert_eq!(proxy.stats().refused, 1);

    proxy.hold(true);
    proxy.set_upstream(second.url.clone());
    let url = proxy.url();
    let pending = tokio::spawn(async move { connect(&url).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!pending.is_finished(), "connected while held");
    proxy.hold(false);
    let mut held = pending.await??;
    send(&mut held, json!({"n": 2})).await?;
    assert!(recv(&mut held, 2000).await?.is_some());
    assert_eq!(first.opened.load(Ordering::SeqCst), 1);
    assert_eq!(second.opened.load(Ordering::SeqCst), 1);

    let wrong = proxy.url().replace("/v1", "/other");
    assert!(connect(&wrong).await.is_err(), "accepted another path");
    Ok(())
}
