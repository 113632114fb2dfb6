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
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use turnd_proto::{Role, SessionsListArgs, TurnStatus};
use turnd_server::config::TokenConfig;
use turnd_server::ui::pct_encode;
use turnd_tests::page::{exchange, get, header, http, next_sse, open_feed, Lines, Reply};
use turnd_tests::{wait_done, Raw, TestDaemon};

const T: u64 = 15;

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
    // The raw worker below answers no pings while the screens render: a long
    // heartbeat keeps the daemon from closing it as silent meanwhile.
    let td = TestDaemon::start(|c| {
        c.turns.dispatch_timeout_ms = Some(60_000);
        turnd_tests::quiet_raw_peers(c);
    })
    .await?;
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
    // A minute's timeout: `s-run` below would look stuck after half of it without a
    // heartbeat, and the screens read before its heartbeat must not find it so.
    w.ok(
        "function.register",
        json!({"function_id": "f", "timeout_ms": 60_000}),
    )
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
    assert!(
        body.contains(r#"<span class="why">no connected worker serves its function</span>"#),
        "{body}"
    );
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
    // Which stuck rule tripped, on the card and on the list.
    assert!(
        body.contains("Looks stuck: no connected worker serves its function."),
        "{body}"
    );
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

    // store.check on demand: a POST runs it, the page shows the last run.
    let body = screen(&td.admin, "/ui/check").await?;
    assert!(body.contains("No run since the daemon started"), "{body}");
    let r = http(&td.admin, "POST", "/ui/check", &[], "").await?;
    assert_eq!(r.status, 303, "{}", r.head);
    let body = screen(&td.admin, "/ui/check").await?;
    assert!(body.contains("no violations"), "{body}");

    // The turns table of a session shows its failed turn, its cause and its worker.
    let body = screen(&td.admin, "/ui/session?id=s-fail").await?;
    assert!(body.contains(&failed.turn_id), "{body}");
    assert!(body.contains(r#"<td class="status">failed</td>"#), "{body}");
    assert!(
        body.contains("w-&lt;b&gt;fn&lt;/b&gt;"),
        "the worker: {body}"
    );
    // The go-to box finds a turn and a session by id, and says when neither exists.
    for (id, to) in [
        (
            failed.turn_id.clone(),
            format!("/ui/turn?id={}", failed.turn_id),
        ),
        ("s-fail".to_string(), "/ui/session?id=s-fail".to_string()),
    ] {
        let r = get(&td.admin, &format!("/ui/go?id={}", pct_encode(&id))).await?;
        assert_eq!(r.status, 303, "{id}");
        assert!(r.head.contains(&format!("location: {to}")), "{}", r.head);
    }
    assert_eq!(get(&td.admin, "/ui/go?id=nosuch").await?.status, 404);
    // A daemon on its own has no cluster screen, and its header no link to one.
    let r = get(&td.admin, "/ui/cluster").await?;
    assert_eq!(r.status, 404, "{}", r.body);
    assert!(r.body.contains("not a node of a cluster"), "{}", r.body);
    assert!(!r.body.contains("Cluster (node"), "{}", r.body);
    // The admin listener's root leads to the page.
    let r = get(&td.admin, "/").await?;
    assert_eq!(r.status, 303);
    assert!(r.head.contains("location: /ui"), "{}", r.head);

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
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/ui", "Max-Age="] {
        assert!(cookie_line.contains(attr), "{attr}: {cookie_line}");
    }
    assert!(!cookie_line.contains("Secure"), "plain HTTP: {cookie_line}");
    let cookie = cookie_line
        .split_once(':')
        .map(|(_, v)| v.trim())
        .and_then(|v| v.split(';').next())
        .context("cookie value")?
        .to_string();
    // The cookie holds a random session id, never the token.
    let id = cookie.strip_prefix("turnd_ui=").context("cookie name")?;
    assert_eq!(id.len(), 64, "{cookie}");
    assert!(!cookie.contains(OP), "{cookie}");
    let r = http(&td.admin, "GET", "/ui/sessions", &[("Cookie", &cookie)], "").await?;
    assert_eq!(r.status, 200, "{}", r.body);
    // A second sign-in gets another session.
    let again = http(
        &td.admin,
        "POST",
        "/ui/login",
        &form,
        &format!("token={OP}"),
    )
    .await?;
    assert!(!again.head.contains(id), "a new id every sign-in");
    // Signing out ends the session on the server: the same cookie is refused after.
    let r = http(&td.admin, "POST", "/ui/logout", &[("Cookie", &cookie)], "").await?;
    assert_eq!(r.status, 303, "{}", r.head);
    assert!(
        r.head.contains("Max-Age=0"),
        "the cookie is cleared: {}",
        r.head
    );
    let r = http(&td.admin, "GET", "/ui/sessions", &[("Cookie", &cookie)], "").await?;
    assert_eq!(r.status, 401, "a closed session");
    // Behind a proxy that says the browser used https, the cookie is Secure.
    let r = http(
        &td.admin,
        "POST",
        "/ui/login",
        &[form[0], ("X-Forwarded-Proto", "https")],
        &format!("token={OP}"),
    )
    .await?;
    assert!(r.head.contains("; Secure"), "{}", r.head);
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
    let feed = format!("/ui/session/feed?id=s-feed&after={last}");
    let (status, mut lines) = open_feed(&td.admin, &feed, "127.0.0.1").await?;
    assert_eq!(status, 200);
    // A new event after the page was loaded arrives on the open stream.
    let second = c.submit_simple("s-feed", "nobody", json!(2)).await?;
    let event = tokio::time::timeout(Duration::from_secs(T), next_event(&mut lines))
        .await
        .context("no event on the feed")??;
    assert_eq!(event["turn_id"], second.turn_id.as_str());
    assert_eq!(event["kind"], "admitted");
    assert_eq!(event["seq"], last + 1);
    // A reconnecting browser sends Last-Event-ID: the feed resumes after it.
    let third = c.submit_simple("s-feed", "nobody", json!(3)).await?;
    let addr = td.admin.trim_start_matches("http://").to_string();
    let mut again = tokio::net::TcpStream::connect(&addr).await?;
    again
        .write_all(
            format!("GET /ui/session/feed?id=s-feed&after={last} HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\nLast-Event-ID: {}\r\n\r\n", last + 1)
                .as_bytes(),
        )
        .await?;
    let mut again = BufReader::new(again).lines();
    let resumed = tokio::time::timeout(Duration::from_secs(T), next_event(&mut again))
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

// ------------------------------------------------------------------ safe on a network

/// The security headers every admin answer carries.
fn assert_hardened(r: &Reply, what: &str) {
    let csp = header(r, "content-security-policy")
        .unwrap_or_else(|| panic!("{what}: no Content-Security-Policy\n{}", r.head));
    for directive in [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "frame-ancestors 'none'",
        "form-action 'self'",
    ] {
        assert!(csp.contains(directive), "{what}: {directive} in {csp}");
    }
    assert!(!csp.contains("unsafe"), "{what}: {csp}");
    assert_eq!(
        header(r, "x-content-type-options"),
        Some("nosniff"),
        "{what}"
    );
    assert_eq!(header(r, "x-frame-options"), Some("DENY"), "{what}");
    assert_eq!(header(r, "referrer-policy"), Some("no-referrer"), "{what}");
}

const OP: &str = "operator-secret-1";

fn operator_token() -> TokenConfig {
    TokenConfig {
        role: Role::Operator,
        token: OP.into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admin_answer_carries_the_security_headers() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| c.auth.tokens = vec![operator_token()]).await?;
    let bearer = format!("Bearer {OP}");
    // Without a token: the 401 sign-in page of every screen, the open endpoints, the
    // assets, the root, an unknown path.
    for path in [
        "/",
        "/healthz",
        "/readyz",
        "/metrics",
        "/ui",
        "/ui/sessions",
        "/ui/session?id=x",
        "/ui/session/feed?id=x",
        "/ui/live/overview",
        "/ui/turn?id=x",
        "/ui/workers",
        "/ui/check",
        "/ui/go?id=x",
        "/ui/login",
        "/ui/assets/ui.css",
        "/ui/assets/ui.js",
        "/nosuch",
    ] {
        let r = get(&td.admin, path).await?;
        assert_hardened(&r, path);
    }
    assert_eq!(get(&td.admin, "/ui").await?.status, 401);
    // With the token: screens, an error page, a refused write, a refused host.
    for path in ["/ui", "/ui/workers", "/ui/session?id=nosuch"] {
        let r = http(&td.admin, "GET", path, &[("Authorization", &bearer)], "").await?;
        assert_hardened(&r, path);
    }
    let r = http(
        &td.admin,
        "POST",
        "/ui/check",
        &[
            ("Authorization", &bearer),
            ("Origin", "http://attacker.example"),
        ],
        "",
    )
    .await?;
    assert_eq!(r.status, 403);
    assert_hardened(&r, "a refused write");
    let r = http(&td.admin, "GET", "/ui", &[("Host", "attacker.example")], "").await?;
    assert_eq!(r.status, 403);
    assert_hardened(&r, "a refused host");
    // The page's own script and style are files it serves, so the policy allows them.
    let r = http(&td.admin, "GET", "/ui", &[("Authorization", &bearer)], "").await?;
    assert!(
        r.body.contains(r#"<script src="/ui/assets/ui.js"#),
        "{}",
        r.body
    );
    assert!(!r.body.contains("<style"), "no inline style");
    assert!(!r.body.contains("<script>"), "no inline script");
    assert!(!r.body.contains("style=\""), "no style attribute");
    let js = get(&td.admin, "/ui/assets/ui.js").await?;
    assert_eq!(js.status, 200);
    assert!(header(&js, "content-type").is_some_and(|t| t.starts_with("text/javascript")));
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_answers_only_to_loopback_names_addresses_and_listed_hosts() -> anyhow::Result<()>
{
    let td = TestDaemon::start(|_| {}).await?;
    let c = td.caller().await?;
    c.submit_simple("s-secret", "nobody", json!({"card": "4111"}))
        .await?;
    let port = td.admin.rsplit(':').next().unwrap_or("0").to_string();
    // A name someone else's DNS points at this machine (DNS rebinding): refused, with
    // nothing of the daemon's data.
    for host in [
        "attacker.example".to_string(),
        format!("attacker.example:{port}"),
        "localhost.attacker.example".to_string(),
    ] {
        for path in [
            "/ui",
            "/ui/sessions",
            "/ui/session?id=s-secret",
            "/ui/session/feed?id=s-secret",
            "/ui/live/sessions",
            "/ui/check",
        ] {
            let r = http(&td.admin, "GET", path, &[("Host", &host)], "").await?;
            assert_eq!(r.status, 403, "{host} {path}");
            assert!(!r.body.contains("s-secret"), "{host} {path}: {}", r.body);
            assert!(r.body.contains("admin.allowed_hosts"), "{}", r.body);
        }
        let r = http(&td.admin, "POST", "/ui/check", &[("Host", &host)], "").await?;
        assert_eq!(r.status, 403, "{host}: a write");
    }
    // Loopback names and any address are what a browser on this machine or an
    // operator typing the address sends.
    for host in [
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        format!("[::1]:{port}"),
        "ops.localhost".to_string(),
        format!("10.0.0.7:{port}"),
    ] {
        let r = http(&td.admin, "GET", "/ui/sessions", &[("Host", &host)], "").await?;
        assert_eq!(r.status, 200, "{host}");
        assert!(r.body.contains("s-secret"), "{host}");
    }
    // The health endpoints hold no session data: probes reach them by any name.
    let r = http(&td.admin, "GET", "/healthz", &[("Host", "lb.example")], "").await?;
    assert_eq!(r.status, 200);
    td.shutdown().await?;

    // A deployment names its hosts.
    let td = TestDaemon::start(|c| {
        c.admin.allowed_hosts = vec!["turnd.example.net".into(), ".ops.example.net".into()]
    })
    .await?;
    for (host, status) in [
        ("turnd.example.net", 200),
        ("TURND.example.net:8443", 200),
        ("eu.ops.example.net", 200),
        ("attacker.example", 403),
        ("turnd.example.net.attacker.example", 403),
    ] {
        let r = http(&td.admin, "GET", "/ui", &[("Host", host)], "").await?;
        assert_eq!(r.status, status, "{host}");
    }
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_refuses_an_open_admin_listener() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data)?;
    let check = |name: &str, extra: &str| -> anyhow::Result<std::process::Output> {
        let f = dir.path().join(name);
        std::fs::write(
            &f,
            format!(
                "[server]\nadmin_listen = \"0.0.0.0:0\"\n[storage]\ndata_dir = {:?}\n{extra}",
                data.display().to_string()
            ),
        )?;
        Ok(std::process::Command::new(turnd_tests::turnd_bin()?)
            .args(["check-config", "--config"])
            .arg(&f)
            .env_remove("TURND_SERVER__ADMIN_LISTEN")
            .output()?)
    };
    let out = check("open.toml", "")?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("server.admin_listen 0.0.0.0:0 is not a loopback address")
            && err.contains("admin.allow_unauthenticated"),
        "{err}"
    );
    // With an operator token, or said explicitly, it passes.
    let token = "[auth]\ntokens = [{ role = \"operator\", token = \"operator-secret-1\" }]\n";
    for (name, extra) in [
        ("token.toml", token),
        ("explicit.toml", "[admin]\nallow_unauthenticated = true\n"),
    ] {
        let out = check(name, extra)?;
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Bad values of the admin keys are reported with the rest.
    let out = check(
        "bad.toml",
        "[admin]\nallow_unauthenticated = true\nmax_feeds = 0\nallowed_hosts = [\"host:80\"]\n",
    )?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("admin.max_feeds must be positive") && err.contains("\"host:80\""),
        "{err}"
    );
    Ok(())
}

fn form() -> [(&'static str, &'static str); 1] {
    [("Content-Type", "application/x-www-form-urlencoded")]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sign_in_is_rate_limited_and_its_sessions_expire() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| {
        c.auth.tokens = vec![operator_token()];
        c.admin.login_failures_per_minute = 3;
        c.admin.session_ms = 400;
    })
    .await?;
    // A session ends at its expiry.
    let r = http(
        &td.admin,
        "POST",
        "/ui/login",
        &form(),
        &format!("token={OP}"),
    )
    .await?;
    assert_eq!(r.status, 303);
    let cookie = header(&r, "set-cookie")
        .and_then(|v| v.split(';').next())
        .context("a cookie")?
        .to_string();
    let r = http(&td.admin, "GET", "/ui", &[("Cookie", &cookie)], "").await?;
    assert_eq!(r.status, 200);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r = http(&td.admin, "GET", "/ui", &[("Cookie", &cookie)], "").await?;
    assert_eq!(r.status, 401, "the session expired");
    // Three wrong tokens, then even the right one is refused for the rest of the
    // minute, from this address.
    for i in 0..3 {
        let r = http(
            &td.admin,
            "POST",
            "/ui/login",
            &form(),
            "token=wrong-token-1",
        )
        .await?;
        assert_eq!(r.status, 401, "try {i}");
    }
    let r = http(
        &td.admin,
        "POST",
        "/ui/login",
        &form(),
        &format!("token={OP}"),
    )
    .await?;
    assert_eq!(r.status, 429, "{}", r.head);
    assert!(header(&r, "retry-after").is_some(), "{}", r.head);
    assert!(header(&r, "set-cookie").is_none());
    assert!(r.body.contains("Too many failed sign-ins"), "{}", r.body);
    // The token itself still works as a bearer token (scripts, curl).
    let r = http(
        &td.admin,
        "GET",
        "/ui",
        &[("Authorization", &format!("Bearer {OP}"))],
        "",
    )
    .await?;
    assert_eq!(r.status, 200);
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_from_another_origin_are_refused() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| c.auth.tokens = vec![operator_token()]).await?;
    let bearer = format!("Bearer {OP}");
    let auth = ("Authorization", bearer.as_str());
    let here = td.admin.clone();
    for (name, value) in [
        ("Origin", "http://attacker.example"),
        ("Origin", "null"),
        ("Sec-Fetch-Site", "cross-site"),
        ("Sec-Fetch-Site", "same-site"),
    ] {
        let r = http(&td.admin, "POST", "/ui/check", &[auth, (name, value)], "").await?;
        assert_eq!(r.status, 403, "{name}: {value}");
        assert!(r.body.contains("refused"), "{}", r.body);
        let r = http(
            &td.admin,
            "POST",
            "/ui/login",
            &[form()[0], (name, value)],
            &format!("token={OP}"),
        )
        .await?;
        assert_eq!(r.status, 403, "sign-in from {value}");
        assert!(header(&r, "set-cookie").is_none());
    }
    // Nothing ran.
    let r = http(&td.admin, "GET", "/ui/check", &[auth], "").await?;
    assert!(
        r.body.contains("No run since the daemon started"),
        "{}",
        r.body
    );
    // The page's own form: same origin.
    for (name, value) in [("Origin", here.as_str()), ("Sec-Fetch-Site", "same-origin")] {
        let r = http(&td.admin, "POST", "/ui/check", &[auth, (name, value)], "").await?;
        assert_eq!(r.status, 303, "{name}: {value}");
    }
    let r = http(&td.admin, "GET", "/ui/check", &[auth], "").await?;
    assert!(r.body.contains("no violations"), "{}", r.body);
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_check_is_a_post_and_runs_one_at_a_time() -> anyhow::Result<()> {
    let td =
        TestDaemon::start(|c| c.storage.sync = turnd_server::config::StorageSync::Never).await?;
    let c = td.caller().await?;
    // Enough turns that one check takes a while.
    for chunk in 0..20 {
        let submits = (0..100).map(|i| {
            let c = &c;
            async move {
                c.submit_simple(&format!("s-{chunk}-{i}"), "nobody", json!({"i": i}))
                    .await
            }
        });
        for r in futures_util::future::join_all(submits).await {
            r?;
        }
    }
    // A GET shows the page and runs nothing.
    let r = get(&td.admin, "/ui/check").await?;
    assert!(r.body.contains("No run since the daemon started"));
    // Bursts of runs at once: while one runs, the others are told so.
    let mut busy = None;
    for _ in 0..20 {
        let burst = (0..6).map(|_| http(&td.admin, "POST", "/ui/check", &[], ""));
        let answers = futures_util::future::join_all(burst).await;
        for a in answers {
            let a = a?;
            assert!(matches!(a.status, 303 | 409), "{}", a.head);
            if a.status == 409 {
                busy = Some(a.body);
            }
        }
        if busy.is_some() {
            break;
        }
    }
    let busy = busy.context("no run was ever refused while another ran")?;
    assert!(busy.contains("already running"), "{busy}");
    let r = get(&td.admin, "/ui/check").await?;
    assert!(r.body.contains("no violations"), "{}", r.body);
    td.shutdown().await
}

/// The next event of the session on a session feed (its screen's fragments, sent on
/// the same stream as `refresh` events, passed over).
async fn next_event(lines: &mut Lines) -> anyhow::Result<Value> {
    loop {
        let (name, data) = next_sse(lines).await?;
        if name == "message" {
            return Ok(serde_json::from_str(&data)?);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_feeds_are_capped_and_need_something_to_follow() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| {
        c.admin.max_feeds_per_client = 2;
        c.admin.max_feeds = 3;
    })
    .await?;
    let c = td.caller().await?;
    c.submit_simple("s1", "nobody", json!(1)).await?;
    // Feeds of what does not exist are refused, and take no place under the caps.
    for path in [
        "/ui/session/feed?id=nosuch",
        "/ui/live/turn?id=t_nosuch",
        "/ui/live/nosuch",
    ] {
        let (code, _) = open_feed(&td.admin, path, "127.0.0.1").await?;
        assert_eq!(code, 404, "{path}");
    }
    let (a, _keep_a) = open_feed(&td.admin, "/ui/session/feed?id=s1", "127.0.0.1").await?;
    let (b, keep_b) = open_feed(&td.admin, "/ui/live/overview", "127.0.0.1").await?;
    assert_eq!((a, b), (200, 200));
    // A third from the same address is over its cap.
    let r = get(&td.admin, "/ui/live/sessions").await?;
    assert_eq!(r.status, 429);
    assert!(r.body.contains("admin.max_feeds_per_client"), "{}", r.body);
    // Another address may open one more, then the total is reached.
    let (d, _keep_d) = open_feed(&td.admin, "/ui/live/workers", "127.0.0.2").await?;
    assert_eq!(d, 200);
    let (e, mut refused) = open_feed(&td.admin, "/ui/live/workers", "127.0.0.2").await?;
    assert_eq!(e, 429);
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(T), async {
        while let Ok(Some(l)) = refused.next_line().await {
            text.push_str(&l);
        }
    })
    .await
    .context("the refusal did not end")?;
    assert!(text.contains("admin.max_feeds ="), "{text}");
    // A browser that goes away gives its place back.
    drop(keep_b);
    let _reopened = turnd_tests::eventually(T, "a closed feed's place is given back", || async {
        match open_feed(&td.admin, "/ui/live/sessions", "127.0.0.1").await {
            Ok((200, lines)) => Some(lines),
            _ => None,
        }
    })
    .await?;
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_screens_feed_sends_its_changes() -> anyhow::Result<()> {
    let td = TestDaemon::start(|_| {}).await?;
    let c = td.caller().await?;
    let (code, mut lines) = open_feed(&td.admin, "/ui/live/sessions", "127.0.0.1").await?;
    assert_eq!(code, 200);
    let (name, data) = tokio::time::timeout(Duration::from_secs(T), next_sse(&mut lines))
        .await
        .context("no first fragment")??;
    assert_eq!(name, "refresh");
    assert!(data.contains("No session matches these filters."), "{data}");
    c.submit_simple("s-new", "nobody", json!(1)).await?;
    let (name, data) = tokio::time::timeout(Duration::from_secs(T), next_sse(&mut lines))
        .await
        .context("no fragment after a change")??;
    assert_eq!(name, "refresh");
    assert!(data.contains(">s-new<"), "{data}");
    // The fragment leaves times to the browser: it says when, not how long ago.
    assert!(data.contains("data-at="), "{data}");
    assert!(!data.contains(" ago<"), "{data}");
    td.shutdown().await
}

/// The `href` of the link with this `id` in a page, as the browser would follow it.
fn link(body: &str, id: &str) -> Option<String> {
    let anchor = format!(r#"id="{id}" href=""#);
    let rest = &body[body.find(&anchor)? + anchor.len()..];
    Some(rest[..rest.find('"')?].replace("&amp;", "&"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_go_both_ways_and_a_retry_says_which_attempt() -> anyhow::Result<()> {
    let td = TestDaemon::start(|c| {
        c.storage.sync = turnd_server::config::StorageSync::Never;
        c.turns.retry_backoff_ms = 600_000;
        c.turns.retry_backoff_max_ms = 600_000;
    })
    .await?;
    let c = td.caller().await?;
    let submits = (0..60).map(|i| {
        let c = &c;
        async move {
            c.submit_simple(&format!("p-{i:02}"), "nobody", json!(i))
                .await
        }
    });
    for r in futures_util::future::join_all(submits).await {
        r?;
    }
    // The list, by id: 50 rows, then the 10 others; "previous" leads back.
    let first = screen(&td.admin, "/ui/sessions?order=id").await?;
    assert!(first.contains(">p-00<") && first.contains(">p-49<") && !first.contains(">p-50<"));
    assert!(
        link(&first, "prev").is_none(),
        "the first page has no previous"
    );
    let next = link(&first, "next").context("a next page")?;
    let second = screen(&td.admin, &next).await?;
    assert!(second.contains(">p-50<") && second.contains(">p-59<") && !second.contains(">p-49<"));
    assert!(link(&second, "next").is_none(), "the last page");
    let prev = link(&second, "prev").context("a previous page")?;
    let back = screen(&td.admin, &prev).await?;
    assert!(
        back.contains(">p-00<") && back.contains(">p-49<") && !back.contains(">p-50<"),
        "{prev}"
    );

    // One session's turns and events, older pages and back.
    for i in 0..60 {
        c.submit_simple("many", "nobody", json!(i)).await?;
    }
    let page = screen(&td.admin, "/ui/session?id=many").await?;
    let turn_rows = |b: &str| b.matches(r#"<td class="status">"#).count();
    assert_eq!(turn_rows(&page), 20);
    let older = link(&page, "turns-older").context("older turns")?;
    let page2 = screen(&td.admin, &older).await?;
    assert_eq!(turn_rows(&page2), 20, "{older}");
    assert!(link(&page2, "turns-newer").is_some());
    let events_older = link(&page, "events-older").context("older events")?;
    let page3 = screen(&td.admin, &events_older).await?;
    assert!(page3.contains("(an older page)"), "{events_older}");
    assert!(
        page3.contains(r#"<td class="num">1</td>"#),
        "the first event: {page3}"
    );
    assert!(link(&page3, "events-newer").is_some());

    // A retryable failure backs off: the card says which attempt of how many.
    let (mut w, _) = Raw::hello(
        &td.url,
        "worker",
        json!({"worker_id": "w1", "instance_id": "i1"}),
    )
    .await?;
    w.ok(
        "function.register",
        json!({"function_id": "flaky", "delivery": "at_least_once", "max_attempts": 3}),
    )
    .await?;
    c.submit_simple("b", "flaky", json!(1)).await?;
    let invoke = w.next_push().await?;
    w.ok(
        "invocation.result",
        json!({"invocation_id": invoke["invocation_id"], "outcome": {"fail": {"code": "busy", "message": "try again", "retryable": true}}}),
    )
    .await?;
    let body = turnd_tests::eventually(T, "backing off", || async {
        let b = screen(&td.admin, "/ui/session?id=b").await.ok()?;
        b.contains("backing_off").then_some(b)
    })
    .await?;
    assert!(
        body.contains(r#"<dd id="attempt">1 of 3 (backing off before attempt 2)</dd>"#),
        "{body}"
    );
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_tls_the_sign_in_cookie_is_secure() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()])?;
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert, ck.cert.pem())?;
    std::fs::write(&key, ck.signing_key.serialize_pem())?;
    let td = TestDaemon::start(|c| {
        c.auth.tokens = vec![operator_token()];
        c.server.tls_cert = Some(cert.clone());
        c.server.tls_key = Some(key.clone());
    })
    .await?;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ck.cert.der().clone())?;
    let client = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let addr = td.admin.trim_start_matches("https://").to_string();
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(client))
        .connect(
            rustls::pki_types::ServerName::try_from("127.0.0.1")?.to_owned(),
            tokio::net::TcpStream::connect(&addr).await?,
        )
        .await?;
    let r = exchange(
        tls,
        &addr,
        "POST /ui/login",
        &form(),
        &format!("token={OP}"),
    )
    .await?;
    assert_eq!(r.status, 303, "{}", r.head);
    let cookie = header(&r, "set-cookie").context("a cookie")?;
    assert!(cookie.ends_with("; Secure"), "{cookie}");
    assert_hardened(&r, "an answer over TLS");
    td.shutdown().await
}
