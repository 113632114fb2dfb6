//! The operator page on the admin listener (`/ui`), over plain HTTP against the real
//! daemon: every screen of a daemon driven into known states, the escaping of every
//! value taken from sessions, functions, inputs and errors, access with tokens, and
//! the live feed's server-sent events.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use turnd_proto::{Role, SessionsListArgs, TurnStatus};
use turnd_server::config::TokenConfig;
use turnd_server::ui::pct_encode;
use turnd_tests::{wait_done, Raw, TestDaemon};

const T: u64 = 15;

struct Reply {
    status: u16,
    head: String,
    body: String,
}

/// One HTTP/1.1 request to the admin listener (`Connection: close`).
async fn http(
    admin: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> anyhow::Result<Reply> {
    let addr = admin.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .context("no complete answer within 10s")??;
    let text = String::from_utf8_lossy(&buf).to_string();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .map(|(h, b)| (h.to_string(), b.to_string()))
        .unwrap_or((text.clone(), String::new()));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("no status line in {head:?}"))?;
    Ok(Reply { status, head, body })
}

async fn get(admin: &str, path: &str) -> anyhow::Result<Reply> {
    http(admin, "GET", path, &[], "").await
}

/// A page that must render (200) with no unescaped markup taken from the data.
async fn screen(admin: &str, path: &str) -> anyhow::Result<String> {
    let r = get(admin, path).await?;
    if r.status != 200 {
        bail!("{path}: {}\n{}", r.status, r.body);
    }
    assert!(
        r.head.to_ascii_lowercase().contains("text/html"),
        "{path}: {}",
        r.head
    );
    for raw in ["<script>alert", "<img src=x", "<b>fn</b>"] {
        assert!(!r.body.contains(raw), "{path} renders {raw:?} as markup");
    }
    Ok(r.body)
}

const EVIL_SESSION: &str = "<script>alert(1)</script>";
const EVIL_FUNCTION: &str = "<b>fn</b>";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_screen_renders_and_escapes_what_it_shows() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| c.turns.dispatch_timeout_ms = Some(60_000)).await?;
    let c = td.caller().await?;
    // A session whose id, function and input are markup, waiting for a worker.
    let evil = c
        .submit_simple(
            EVIL_SESSION,
            EVIL_FUNCTION,
            json!({"text": "<script>alert(2)</script>"}),
        )
        .await?;
    c.submit_simple(EVIL_SESSION, EVIL_FUNCTION, json!(2))
        .await?;
    // A turn that failed with markup in its error, run by a worker named with markup.
    let (mut w, _) = Raw::hello(
        &td.url,
        "worker",
        json!({"worker_id": "w-<b>fn</b>", "instance_id": "i1", "name": "<script>alert(4)</script>"}),
    )
    .await?;
    w.ok("function.register", json!({"function_id": "f"}))
        .await?;
    let failed = c.submit_simple("s-fail", "f", json!("in")).await?;
    let invoke = w.next_push().await?;
    w.ok(
        "invocation.result",
        json!({"invocation_id": invoke["invocation_id"], "outcome": {"fail": {"code": "<img src=x onerror=alert(3)>", "message": "<script>alert(5)</script>"}}}),
    )
    .await?;
    assert_eq!(
        wait_done(&c, &failed.turn_id, T).await?.status,
        TurnStatus::Failed
    );
    // A turn running on the worker: blocked on it.
    let running = c.submit_simple("s-run", "f", json!({"n": 1})).await?;
    let invoke = w.next_push().await?;

    // Overview: readiness, storage, counts by wait state, oldest wait, workers,
    // version.
    let body = screen(&td.admin, "/ui").await?;
    assert!(body.contains(r#"id="readiness""#) && body.contains("ready"));
    assert!(body.contains("writable"));
    assert!(body.contains("turnd 0.1.0"), "version");
    assert!(body.contains("awaiting_worker"), "{body}");
    assert!(
        body.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "the session id as text"
    );
    // The counts and the list come from one sessions.list answer.
    let list = c.sessions(&SessionsListArgs::default()).await?;
    assert_eq!(list.total, 2);
    assert!(body.contains(r#"<dd id="active">2</dd>"#), "{body}");

    // Sessions, with the stuck filter.
    let body = screen(&td.admin, "/ui/sessions").await?;
    assert!(body.contains("&lt;b&gt;fn&lt;/b&gt;"), "function as text");
    assert!(body.contains("s-run"));
    let body = screen(&td.admin, "/ui/sessions?stuck=1").await?;
    assert!(body.contains("&lt;script&gt;alert(1)"), "nobody serves it");
    assert!(!body.contains(">s-run<"), "s-run is running fine: {body}");
    let body = screen(&td.admin, "/ui/sessions?state=awaiting_result").await?;
    assert!(body.contains(">s-run<"), "{body}");
    assert!(!body.contains("alert(1)"));
    assert_eq!(get(&td.admin, "/ui/sessions?state=nap").await?.status, 400);

    // One session: blocked-on card, queue, events.
    let body = screen(
        &td.admin,
        &format!("/ui/session?id={}", pct_encode(EVIL_SESSION)),
    )
    .await?;
    assert!(body.contains("Blocked on"));
    assert!(body.contains(&evil.turn_id));
    assert!(body.contains("awaiting_worker"));
    assert!(body.contains("Queue (1 behind the holder)"), "{body}");
    assert!(body.contains("admitted"));
    let body = screen(&td.admin, "/ui/session?id=s-run").await?;
    assert!(body.contains(invoke["invocation_id"].as_str().unwrap_or("?")));
    assert!(body.contains("Running since"));
    assert!(body.contains("Last heartbeat"));
    assert!(body.contains("none since the dispatch"), "{body}");
    assert!(body.contains(&running.turn_id));
    // A heartbeat shows as the last sign of life.
    tokio::time::sleep(Duration::from_millis(20)).await;
    w.ok(
        "invocation.heartbeat",
        json!({"invocation_id": invoke["invocation_id"]}),
    )
    .await?;
    let body = screen(&td.admin, "/ui/session?id=s-run").await?;
    assert!(!body.contains("none since the dispatch"), "{body}");
    assert_eq!(get(&td.admin, "/ui/session?id=nosuch").await?.status, 404);

    // One turn: timeline, input, error with its cause.
    let body = screen(&td.admin, &format!("/ui/turn?id={}", evil.turn_id)).await?;
    assert!(
        body.contains("&lt;script&gt;alert(2)&lt;/script&gt;"),
        "input as text"
    );
    assert!(body.contains("bytes of JSON"));
    let body = screen(&td.admin, &format!("/ui/turn?id={}", failed.turn_id)).await?;
    assert!(body.contains("handler_failed"));
    assert!(
        body.contains("&lt;img src=x onerror=alert(3)&gt;"),
        "{body}"
    );
    for kind in ["admitted", "dispatched", "result", "failed"] {
        assert!(
            body.contains(&format!("<td>{kind}</td>")),
            "{kind} in the timeline"
        );
    }
    assert!(body.contains(r#"id="recovered">no<"#));

    // Workers and functions: the function no one serves is flagged.
    let body = screen(&td.admin, "/ui/workers").await?;
    assert!(body.contains("w-&lt;b&gt;fn&lt;/b&gt;"));
    assert!(body.contains("no worker"), "{body}");
    assert!(body.contains("1 / 1"), "in flight vs concurrency: {body}");

    // store.check on demand.
    let body = screen(&td.admin, "/ui/check").await?;
    assert!(body.contains("no violations"), "{body}");

    // The page changes nothing: a POST to a screen is refused.
    assert_eq!(http(&td.admin, "POST", "/ui", &[], "").await?.status, 405);
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_tokens_the_page_needs_an_operator_token() -> anyhow::Result<()> {
    const OP: &str = "operator-secret-1";
    const CLIENT: &str = "client-secret-1";
    let td = TestDaemon::start(|c| {
        c.auth.tokens = vec![
            TokenConfig {
                role: Role::Operator,
                token: OP.into(),
            },
            TokenConfig {
                role: Role::Client,
                token: CLIENT.into(),
            },
        ];
    })
    .await?;
    // The health endpoints stay open.
    assert_eq!(get(&td.admin, "/healthz").await?.status, 200);
    assert_eq!(get(&td.admin, "/readyz").await?.status, 200);
    assert_eq!(get(&td.admin, "/metrics").await?.status, 200);
    for path in [
        "/ui",
        "/ui/sessions",
        "/ui/workers",
        "/ui/check",
        "/ui/session?id=x",
        "/ui/session/feed?id=x",
    ] {
        let r = get(&td.admin, path).await?;
        assert_eq!(r.status, 401, "{path}");
        assert!(r.body.contains(r#"name="token""#), "{path}: a login form");
        let r = http(
            &td.admin,
            "GET",
            path,
            &[("Authorization", &format!("Bearer {CLIENT}"))],
            "",
        )
        .await?;
        assert_eq!(r.status, 401, "{path}: a client token is not enough");
    }
    let r = http(
        &td.admin,
        "GET",
        "/ui",
        &[("Authorization", &format!("Bearer {OP}"))],
        "",
    )
    .await?;
    assert_eq!(r.status, 200);
    // The login form sets an HttpOnly cookie for an operator token only.
    let form = [("Content-Type", "application/x-www-form-urlencoded")];
    let r = http(
        &td.admin,
        "POST",
        "/ui/login",
        &form,
        &format!("token={CLIENT}"),
    )
    .await?;
    assert_eq!(r.status, 401);
    assert!(!r.head.to_ascii_lowercase().contains("set-cookie"));
    let r = http(
        &td.admin,
        "POST",
        "/ui/login",
        &form,
        &format!("token={OP}"),
    )
    .await?;
    assert_eq!(r.status, 303, "{}", r.head);
    let cookie_line = r
        .head
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("set-cookie:"))
        .context("a cookie")?;
    assert!(cookie_line.contains("HttpOnly"), "{cookie_line}");
    let cookie = cookie_line
        .split_once(':')
        .map(|(_, v)| v.trim())
        .and_then(|v| v.split(';').next())
        .context("cookie value")?
        .to_string();
    let r = http(&td.admin, "GET", "/ui/sessions", &[("Cookie", &cookie)], "").await?;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = http(
        &td.admin,
        "GET",
        "/ui",
        &[("Cookie", "turnd_ui=operator-secret-2")],
        "",
    )
    .await?;
    assert_eq!(r.status, 401);
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_feed_streams_new_events_of_the_session() -> anyhow::Result<()> {
    let td = TestDaemon::start(|_| {}).await?;
    let c = td.caller().await?;
    let first = c.submit_simple("s-feed", "nobody", json!(1)).await?;
    let last = c.inspect("s-feed").await?.last_event;
    let addr = td.admin.trim_start_matches("http://").to_string();
    let mut s = tokio::net::TcpStream::connect(&addr).await?;
    s.write_all(
        format!("GET /ui/session/feed?id=s-feed&after={last} HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n")
            .as_bytes(),
    )
    .await?;
    let mut lines = BufReader::new(s).lines();
    let status = lines.next_line().await?.unwrap_or_default();
    assert!(status.contains(" 200 "), "{status}");
    // A new event after the page was loaded arrives on the open stream.
    let second = c.submit_simple("s-feed", "nobody", json!(2)).await?;
    let event: Value = tokio::time::timeout(Duration::from_secs(T), async {
        loop {
            let line = lines.next_line().await?.context("stream ended")?;
            if let Some(data) = line.strip_prefix("data: ") {
                return anyhow::Ok(serde_json::from_str::<Value>(data)?);
            }
        }
    })
    .await
    .context("no event on the feed")??;
    assert_eq!(event["turn_id"], second.turn_id.as_str());
    assert_eq!(event["kind"], "admitted");
    assert_eq!(event["seq"], last + 1);
    // A reconnecting browser sends Last-Event-ID: the feed resumes after it.
    let third = c.submit_simple("s-feed", "nobody", json!(3)).await?;
    let mut again = tokio::net::TcpStream::connect(&addr).await?;
    again
        .write_all(
            format!("GET /ui/session/feed?id=s-feed&after={last} HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\nLast-Event-ID: {}\r\n\r\n", last + 1)
                .as_bytes(),
        )
        .await?;
    let mut again = BufReader::new(again).lines();
    let resumed: Value = tokio::time::timeout(Duration::from_secs(T), async {
        loop {
            let line = again.next_line().await?.context("stream ended")?;
            if let Some(data) = line.strip_prefix("data: ") {
                return anyhow::Ok(serde_json::from_str::<Value>(data)?);
            }
        }
    })
    .await
    .context("no event on the resumed feed")??;
    assert_eq!(resumed["seq"], last + 2, "{resumed}");
    assert_eq!(resumed["turn_id"], third.turn_id.as_str());
    drop(again);
    c.stop(&first.turn_id, "done").await?;
    // An open feed does not hold up the daemon's shutdown; the stream ends.
    tokio::time::timeout(Duration::from_secs(T), td.shutdown())
        .await
        .context("shutdown waited for the open feed")??;
    let rest = tokio::time::timeout(Duration::from_secs(T), async {
        while lines.next_line().await.ok().flatten().is_some() {}
    })
    .await;
    assert!(rest.is_ok(), "the feed ended with the daemon");
    Ok(())
}
