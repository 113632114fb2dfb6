//! The operator page in a real browser: headless Chromium loads every screen of a
//! daemon driven into known states (`--dump-dom`), and, through chromedriver
//! (WebDriver), the live feed of a session page shows a new event without a reload.
//!
//! Needs Debian's `chromium` and `chromium-driver` (`make browser` installs them;
//! `make test` does so first). `TURND_CHROMIUM` and `TURND_CHROMEDRIVER` override
//! where they are looked for. With `TURND_UI_SCREENSHOTS=DIR` the first test also
//! writes a screenshot of each screen to `DIR/ui-*.png` (the ones in docs/).

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use turnd_proto::TurnStatus;
use turnd_server::ui::pct_encode;
use turnd_tests::{wait_done, Raw, TestDaemon};

const T: u64 = 15;

/// The first of `names` found on PATH (or the override in `env`).
fn find(env: &str, names: &[&str]) -> anyhow::Result<PathBuf> {
    if let Ok(p) = std::env::var(env) {
        return Ok(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        for n in names {
            let p = dir.join(n);
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    bail!(
        "none of {names:?} found on PATH (set {env}); `make browser` installs Debian's chromium and chromium-driver"
    )
}

fn chromium() -> anyhow::Result<PathBuf> {
    find(
        "TURND_CHROMIUM",
        &["chromium", "chromium-browser", "google-chrome"],
    )
}

/// The flags every headless run gets: no sandbox (containers, root), nothing
/// fetched from the network by the browser itself.
const FLAGS: [&str; 8] = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
];

/// Run Chromium once on `url` with `extra` flags and a fresh profile; its stdout.
async fn chromium_run(url: &str, extra: &[String]) -> anyhow::Result<String> {
    let profile = tempfile::tempdir()?;
    let mut cmd = tokio::process::Command::new(chromium()?);
    cmd.args(FLAGS)
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(extra)
        .arg(url)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .with_context(|| format!("chromium on {url} did not finish within 60s"))??;
    if !out.status.success() {
        bail!("chromium on {url}: {:?}", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The DOM of `url` after it loaded and its scripts ran.
async fn dump_dom(url: &str) -> anyhow::Result<String> {
    chromium_run(url, &["--dump-dom".to_string()]).await
}

async fn screenshot(url: &str, to: &Path) -> anyhow::Result<()> {
    chromium_run(
        url,
        &[
            format!("--screenshot={}", to.display()),
            "--window-size=1400,1000".to_string(),
            "--hide-scrollbars".to_string(),
        ],
    )
    .await?;
    if !to.is_file() {
        bail!("no screenshot at {}", to.display());
    }
    Ok(())
}

const EVIL_SESSION: &str = "<script>alert(1)</script>";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_screen_loads_in_chromium() -> anyhow::Result<()> {
    // The raw worker below reads nothing while the browser runs: long heartbeats.
    let td = TestDaemon::start(|c| {
        c.turns.dispatch_timeout_ms = Some(600_000);
        c.server.heartbeat_ms = 120_000;
        c.turns.reconnect_grace_ms = 600_000;
    })
    .await?;
    let c = td.caller().await?;
    // Stuck: a function nobody serves, with markup in the session id and input.
    let evil = c
        .submit_simple(
            EVIL_SESSION,
            "report.render",
            json!({"title": "<script>alert(2)</script>"}),
        )
        .await?;
    c.submit_simple(EVIL_SESSION, "report.render", json!({"page": 2}))
        .await?;
    let (mut w, _) = Raw::hello(
        &td.url,
        "worker",
        json!({"worker_id": "w-model-1", "instance_id": "i-7f3a", "name": "model-worker"}),
    )
    .await?;
    w.ok(
        "function.register",
        json!({"function_id": "model.step", "timeout_ms": 120_000, "concurrency": 4}),
    )
    .await?;
    // A failed turn, then a running one.
    let failed = c
        .submit_simple("chat-42", "model.step", json!({"prompt": "hello"}))
        .await?;
    let invoke = w.next_push().await?;
    w.ok(
        "invocation.result",
        json!({"invocation_id": invoke["invocation_id"], "outcome": {"fail": {"code": "upstream_503", "message": "model backend unavailable"}}}),
    )
    .await?;
    assert_eq!(
        wait_done(&c, &failed.turn_id, T).await?.status,
        TurnStatus::Failed
    );
    let running = c
        .submit_simple("chat-42", "model.step", json!({"prompt": "again"}))
        .await?;
    let invoke = w.next_push().await?;
    let inv = invoke["invocation_id"].as_str().unwrap_or("?").to_string();
    c.submit_simple("chat-42", "model.step", json!({"prompt": "queued"}))
        .await?;

    let screens = [
        ("overview", "/ui".to_string()),
        ("sessions", "/ui/sessions".to_string()),
        (
            "session",
            format!("/ui/session?id={}", pct_encode("chat-42")),
        ),
        ("turn", format!("/ui/turn?id={}", failed.turn_id)),
        ("workers", "/ui/workers".to_string()),
    ];
    for (name, path) in &screens {
        let dom = dump_dom(&format!("{}{path}", td.admin)).await?;
        assert!(dom.contains("<header>"), "{name}: {dom}");
        // The markup in the data is text in the DOM, never an element.
        assert!(!dom.contains("<script>alert"), "{name}: {dom}");
        match *name {
            "overview" => {
                assert!(dom.contains(r#"<dd id="readiness"><span class="ok">ready</span>"#));
                assert!(dom.contains(r#"<dd id="active">2</dd>"#), "{dom}");
                assert!(dom.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
                assert!(dom.contains("awaiting_worker"));
                assert!(dom.contains("awaiting_result"));
            }
            "sessions" => {
                assert!(dom.contains("chat-42"));
                assert!(dom.contains("stuck"));
                assert!(dom.contains("report.render"));
                // Which rule tripped, and the running one's worker.
                assert!(
                    dom.contains("no connected worker serves its function"),
                    "{dom}"
                );
                assert!(dom.contains("<td>w-model-1</td>"), "{dom}");
            }
            "session" => {
                assert!(dom.contains(r#"id="blocked-on""#));
                assert!(dom.contains(&running.turn_id));
                assert!(dom.contains(&inv));
                assert!(dom.contains("w-model-1"));
                assert!(dom.contains("Queue (1 behind the holder)"), "{dom}");
                // The failed turn in the turns table, with its cause and worker.
                assert!(dom.contains(&failed.turn_id), "{dom}");
                assert!(dom.contains("model backend unavailable"), "{dom}");
                assert!(dom.contains(r#"<td class="status">failed</td>"#), "{dom}");
                assert!(dom.contains(r#"<dd id="attempt">1 of "#), "{dom}");
            }
            "turn" => {
                assert!(
                    dom.contains(r#"<dd id="turn-workers">w-model-1</dd>"#),
                    "{dom}"
                );
                assert!(dom.contains("handler_failed"));
                assert!(dom.contains("upstream_503"));
                assert!(dom.contains("<td>dispatched</td>"));
                assert!(dom.contains("<td>failed</td>"));
                assert!(dom.contains("hello"), "the input");
            }
            "workers" => {
                assert!(dom.contains("w-model-1"));
                assert!(dom.contains("1 / 4"), "in flight vs concurrency: {dom}");
                assert!(dom.contains("no worker"), "report.render is flagged");
            }
            _ => unreachable!(),
        }
    }
    // The stuck session's own page renders its id as text.
    let dom = dump_dom(&format!(
        "{}/ui/session?id={}",
        td.admin,
        pct_encode(EVIL_SESSION)
    ))
    .await?;
    assert!(dom.contains(&evil.turn_id));
    assert!(dom.contains(r#"<span id="session-id">&lt;script&gt;alert(1)&lt;/script&gt;</span>"#));

    if let Some(dir) = std::env::var_os("TURND_UI_SCREENSHOTS") {
        let dir = PathBuf::from(dir);
        for (name, path) in &screens {
            screenshot(
                &format!("{}{path}", td.admin),
                &dir.join(format!("ui-{name}.png")),
            )
            .await?;
        }
    }
    td.shutdown().await
}

/// A minimal WebDriver client: one JSON request per connection.
struct Driver {
    addr: String,
    session: String,
    child: tokio::process::Child,
    _profile: tempfile::TempDir,
}

async fn webdriver(addr: &str, method: &str, path: &str, body: Value) -> anyhow::Result<Value> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let body = if method == "GET" || method == "DELETE" {
        String::new()
    } else {
        body.to_string()
    };
    s.write_all(
        format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await?;
    // chromedriver keeps the connection open: read the head, then Content-Length bytes.
    let body = tokio::time::timeout(Duration::from_secs(60), async {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                bail!("connection closed before a full answer");
            }
            buf.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&buf).into_owned();
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let len = head
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("content-length")
                            .then(|| v.trim().parse::<usize>().ok())
                            .flatten()
                    })
                    .context("no Content-Length")?;
                if body.len() >= len {
                    return anyhow::Ok(body[..len].to_string());
                }
            }
        }
    })
    .await
    .context("chromedriver did not answer within 60s")??;
    let v: Value = serde_json::from_str(&body).with_context(|| format!("not JSON: {body}"))?;
    if v.pointer("/value/error").is_some() {
        bail!("webdriver {method} {path}: {v}");
    }
    Ok(v["value"].clone())
}

impl Driver {
    async fn start() -> anyhow::Result<Driver> {
        let bin = find("TURND_CHROMEDRIVER", &["chromedriver"])?;
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0")?;
            l.local_addr()?.port()
        };
        let child = tokio::process::Command::new(bin)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        let addr = format!("127.0.0.1:{port}");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(T);
        loop {
            if let Ok(v) = webdriver(&addr, "GET", "/status", Value::Null).await {
                if v["ready"] == true {
                    break;
                }
            }
            if tokio::time::Instant::now() > deadline {
                bail!("chromedriver did not become ready");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let profile = tempfile::tempdir()?;
        let mut args: Vec<String> = FLAGS.iter().map(|f| f.to_string()).collect();
        args.push(format!("--user-data-dir={}", profile.path().display()));
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": chromium()?, "args": args},
            "goog:loggingPrefs": {"browser": "ALL"}
        }}});
        let v = webdriver(&addr, "POST", "/session", caps).await?;
        let session = v["sessionId"].as_str().context("no sessionId")?.to_string();
        Ok(Driver {
            addr,
            session,
            child,
            _profile: profile,
        })
    }

    async fn call(&self, method: &str, path: &str, body: Value) -> anyhow::Result<Value> {
        webdriver(
            &self.addr,
            method,
            &format!("/session/{}{path}", self.session),
            body,
        )
        .await
    }

    async fn script(&self, js: &str) -> anyhow::Result<Value> {
        self.call("POST", "/execute/sync", json!({"script": js, "args": []}))
            .await
    }

    /// The browser console's messages since the last call.
    async fn console(&self) -> anyhow::Result<Vec<String>> {
        let v = self
            .call("POST", "/se/log", json!({"type": "browser"}))
            .await?;
        Ok(v.as_array()
            .map(|a| {
                a.iter()
                    .map(|m| m["message"].as_str().unwrap_or_default().to_string())
                    .collect()
            })
            .unwrap_or_default())
    }

    async fn open(&self, url: &str) -> anyhow::Result<()> {
        self.call("POST", "/url", json!({"url": url})).await?;
        Ok(())
    }

    /// Run `js` until it returns something other than null or false, at most `T`.
    async fn until(&self, what: &str, js: &str) -> anyhow::Result<Value> {
        for _ in 0..(T * 10) {
            let v = self.script(js).await?;
            if !v.is_null() && v != json!(false) {
                return Ok(v);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("timed out waiting for {what}")
    }

    async fn quit(mut self) -> anyhow::Result<()> {
        let path = format!("/session/{}", self.session);
        if let Err(e) = webdriver(&self.addr, "DELETE", &path, Value::Null).await {
            eprintln!("ending the browser session: {e}");
        }
        self.child.kill().await?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_feed_shows_a_new_event_without_a_reload() -> anyhow::Result<()> {
    let td = TestDaemon::start(|_| {}).await?;
    let c = td.caller().await?;
    c.submit_simple("s-live", "nobody", json!(1)).await?;
    let driver = Driver::start().await?;
    // Checks return errors instead of panicking, so that the browser session is
    // always ended (chromedriver's Chromium outlives a killed chromedriver).
    let result = async {
        driver
            .call(
                "POST",
                "/url",
                json!({"url": format!("{}/ui/session?id=s-live", td.admin)}),
            )
            .await?;
        // Mark the document: a reload would lose the mark.
        driver.script("window.__turnd_mark = 1; return 1;").await?;
        let before = driver
            .script("return document.querySelectorAll('#feed tbody tr').length;")
            .await?;
        anyhow::ensure!(
            before == json!(1),
            "the admitted event of the first turn: {before}"
        );
        // Wait for the feed to be open, then append an event.
        let mut live = false;
        for _ in 0..150 {
            let s = driver
                .script("return document.getElementById('feed-status').textContent;")
                .await?;
            if s == "live" {
                live = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::ensure!(live, "the feed never opened");
        let second = c.submit_simple("s-live", "nobody", json!(2)).await?;
        let mut shown = Value::Null;
        for _ in 0..150 {
            shown = driver
                .script(
                    "var r = document.querySelector('#feed tr.live-event'); \
                     return r ? [window.__turnd_mark, r.textContent] : null;",
                )
                .await?;
            if !shown.is_null() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::ensure!(shown[0] == json!(1), "same document, no reload: {shown}");
        let text = shown[1].as_str().unwrap_or_default();
        anyhow::ensure!(text.contains(&second.turn_id), "{text}");
        anyhow::ensure!(text.contains("admitted"), "{text}");
        anyhow::Ok(())
    }
    .await;
    driver.quit().await?;
    result?;
    td.shutdown().await
}

/// Runs `check` with a browser and always ends the browser session (chromedriver's
/// Chromium outlives a killed chromedriver).
async fn with_browser<F, Fut>(check: F) -> anyhow::Result<()>
where
    F: FnOnce(Driver) -> Fut,
    Fut: std::future::Future<Output = (Driver, anyhow::Result<()>)>,
{
    let driver = Driver::start().await?;
    let (driver, result) = check(driver).await;
    driver.quit().await?;
    result
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_screen_runs_its_script_under_the_content_security_policy() -> anyhow::Result<()> {
    let td = TestDaemon::start(|_| {}).await?;
    let c = td.caller().await?;
    let t = c.submit_simple("s-csp", "nobody", json!(1)).await?;
    let admin = td.admin.clone();
    with_browser(|driver| async move {
        let result = async {
            for path in [
                "/ui".to_string(),
                "/ui/sessions".to_string(),
                "/ui/session?id=s-csp".to_string(),
                format!("/ui/turn?id={}", t.turn_id),
                "/ui/workers".to_string(),
                "/ui/check".to_string(),
            ] {
                driver.open(&format!("{admin}{path}")).await?;
                // The served stylesheet applies.
                let display = driver
                    .script("return getComputedStyle(document.querySelector('header')).display;")
                    .await?;
                anyhow::ensure!(
                    display == json!("flex"),
                    "{path}: the stylesheet: {display}"
                );
                // The served script runs: it fills the ticking times and, where the
                // screen has a live region, opens its feed.
                if path != "/ui/check" {
                    driver
                        .until(
                            &format!("{path}: the live feed"),
                            "return document.body.dataset.feed === 'live';",
                        )
                        .await?;
                }
                let console = driver.console().await?;
                let refused: Vec<&String> = console
                    .iter()
                    .filter(|m| m.contains("Content Security Policy") || m.contains("Refused to"))
                    .collect();
                anyhow::ensure!(refused.is_empty(), "{path}: {refused:?}");
            }
            anyhow::Ok(())
        }
        .await;
        (driver, result)
    })
    .await?;
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_screens_follow_the_daemon_without_a_reload() -> anyhow::Result<()> {
    let td = TestDaemon::start(|_| {}).await?;
    let c = td.caller().await?;
    let t = c.submit_simple("s-stop", "nobody", json!(1)).await?;
    let admin = td.admin.clone();
    let cc = &c;
    with_browser(|driver| async move {
        let result = async {
            // A session page: the turn is stopped elsewhere; the card and the turns
            // table say so in the same document.
            driver
                .open(&format!("{admin}/ui/session?id=s-stop"))
                .await?;
            driver.script("window.__turnd_mark = 1; return 1;").await?;
            let card = driver
                .script("return document.getElementById('blocked-on').textContent;")
                .await?;
            anyhow::ensure!(
                card.as_str().is_some_and(|c| c.contains("awaiting_worker")),
                "{card}"
            );
            driver
                .until("the feed", "return document.body.dataset.feed === 'live';")
                .await?;
            cc.stop(&t.turn_id, "an operator stopped it").await?;
            let seen = driver
                .until(
                    "the stop on the open page",
                    "var c = document.getElementById('blocked-on').textContent; \
                     var s = document.querySelector('#turns td.status'); \
                     return c.indexOf('no unfinished turn') >= 0 && s && \
                       s.textContent === 'cancelled' ? [window.__turnd_mark, \
                       document.getElementById('turns').textContent] : null;",
                )
                .await?;
            anyhow::ensure!(seen[0] == json!(1), "same document: {seen}");
            anyhow::ensure!(
                seen[1]
                    .as_str()
                    .is_some_and(|s| s.contains("an operator stopped it")),
                "{seen}"
            );
            // The list: a new session shows up in the open list.
            driver.open(&format!("{admin}/ui/sessions")).await?;
            driver.script("window.__turnd_mark = 2; return 1;").await?;
            driver
                .until("the feed", "return document.body.dataset.feed === 'live';")
                .await?;
            cc.submit_simple("s-late", "nobody", json!(2)).await?;
            let mark = driver
                .until(
                    "the new row",
                    "return document.querySelector('#sessions tr[data-session=\"s-late\"]') \
                       ? window.__turnd_mark : null;",
                )
                .await?;
            anyhow::ensure!(mark == json!(2), "same document: {mark}");
            // Relative times tick.
            let read = "var e = document.querySelector('#sessions [data-at]'); \
                        return e ? e.textContent : null;";
            let first = driver.until("a time", read).await?;
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            let later = driver.script(read).await?;
            anyhow::ensure!(
                first != later,
                "the time did not tick: {first} then {later}"
            );
            anyhow::Ok(())
        }
        .await;
        (driver, result)
    })
    .await?;
    td.shutdown().await
}
