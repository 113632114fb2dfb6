//! Test support: start the real daemon in-process on `127.0.0.1:0` (optionally on a
//! fault-injecting store) or as the built binary when process death matters, and
//! talk raw frames to it; [`cluster`]: what the cluster's tests share; [`page`]:
//! the operator page's HTTP.

pub mod cluster;
pub mod page;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{bail, Context};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use turnd_client::{Caller, FunctionSpec, Worker, WorkerHandle, WorkerOptions};
use turnd_proto::{Event, EventKind, Outcome, Turn};
use turnd_server::{open_store, Config, Daemon, Listeners};
use turnd_store::faulty::{Faults, FaultyKv};
use turnd_store::Kv;

/// A config for tests: loopback port 0, a data dir, short timers.
pub fn test_config(data_dir: &Path) -> Config {
    let mut c = Config::default();
    c.server.listen = "127.0.0.1:0".into();
    c.server.admin_listen = "127.0.0.1:0".into();
    c.storage.data_dir = data_dir.to_path_buf();
    c.server.heartbeat_ms = 1_000;
    c.turns.retry_backoff_ms = 20;
    c.turns.probe_timeout_ms = 300;
    c.turns.reconnect_grace_ms = 600;
    c.turns.cancel_grace_ms = 300;
    c.turns.default_timeout_ms = 5_000;
    c
}

/// For a test whose peers go quiet (a raw worker or watcher that neither reads nor
/// sends while the test looks at the daemon, so it answers no pings): a daemon that
/// hears nothing from a connection for 3 heartbeats closes it, which on a busy
/// machine could happen within the test's waits. A minute's heartbeat keeps such
/// peers connected; a test that uses it is not about heartbeats.
pub fn quiet_raw_peers(c: &mut Config) {
    c.server.heartbeat_ms = 60_000;
}

/// An in-process daemon and its data directory.
pub struct TestDaemon {
    pub daemon: Option<Daemon>,
    pub dir: Arc<tempfile::TempDir>,
    pub faults: Option<Arc<Faults>>,
    pub url: String,
    pub admin: String,
}

impl TestDaemon {
    /// Start with the test config, adjusted by `f`.
    pub async fn start(f: impl FnOnce(&mut Config)) -> anyhow::Result<TestDaemon> {
        let dir = Arc::new(tempfile::tempdir()?);
        Self::start_in(dir, f, false).await
    }

    /// Start on a fault-injecting store (see [`Faults`]).
    pub async fn start_faulty(f: impl FnOnce(&mut Config)) -> anyhow::Result<TestDaemon> {
        let dir = Arc::new(tempfile::tempdir()?);
        Self::start_in(dir, f, true).await
    }

    pub async fn start_in(
        dir: Arc<tempfile::TempDir>,
        f: impl FnOnce(&mut Config),
        faulty: bool,
    ) -> anyhow::Result<TestDaemon> {
        let mut cfg = test_config(&dir.path().join("data"));
        f(&mut cfg);
        cfg.validate()?;
        let listeners = Listeners::bind(&cfg).await?;
        let sled = open_store(&cfg)?;
        let (kv, faults): (Arc<dyn Kv>, _) = if faulty {
            let (k, f) = FaultyKv::new(sled);
            (Arc::new(k), Some(f))
        } else {
            (sled, None)
        };
        let daemon = Daemon::start(cfg, listeners, kv).await?;
        let url = daemon.ws_url();
        let admin = daemon.admin_url();
        Ok(TestDaemon {
            daemon: Some(daemon),
            dir,
            faults,
            url,
            admin,
        })
    }

    pub fn engine(&self) -> &turnd_engine::Engine {
        self.daemon
            .as_ref()
            .expect("running")
            .engine()
            .expect("a daemon on its own")
    }

    pub async fn caller(&self) -> anyhow::Result<Caller> {
        Ok(Caller::connect(&self.url, None).await?)
    }

    pub async fn operator(&self) -> anyhow::Result<Caller> {
        Ok(Caller::connect_as(&self.url, turnd_proto::Role::Operator, None).await?)
    }

    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        if let Some(d) = self.daemon.take() {
            d.shutdown().await?;
        }
        Ok(())
    }
}

/// Worker options for tests: short ack timeout and reconnect delay.
pub fn worker_options(url: &str, worker_id: &str) -> WorkerOptions {
    let mut o = WorkerOptions::new(url, worker_id);
    o.result_ack_timeout = Duration::from_millis(300);
    o.reconnect_delay = Duration::from_millis(50);
    o
}

/// A worker serving `echo` (completes with its input), connected.
pub async fn echo_worker(url: &str, worker_id: &str, concurrency: u32) -> WorkerHandle {
    let w = Worker::new(worker_options(url, worker_id)).function(
        FunctionSpec::new("echo").concurrency(concurrency),
        |ctx| async move { Outcome::Complete(ctx.invoke.input.clone()) },
    );
    let h = w.spawn(tokio_util::sync::CancellationToken::new());
    h.connected().await;
    h
}

/// Every event of a session, in order, paging through `session.events`.
pub async fn all_events(c: &Caller, session_id: &str) -> anyhow::Result<Vec<Event>> {
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let page = c
            .events(session_id, Some(after), Some(1000))
            .await
            .with_context(|| format!("session.events {session_id}"))?;
        if page.events.is_empty() {
            return Ok(out);
        }
        after = page.next;
        out.extend(page.events);
    }
}

/// The kinds of a turn's events, in session order.
pub fn event_kinds(events: &[Event], turn_id: &str) -> Vec<EventKind> {
    events
        .iter()
        .filter(|e| e.turn_id == turn_id)
        .map(|e| e.kind)
        .collect()
}

/// Submit turns `from..from + n` (input: the number) to `session` for `echo` (see
/// [`echo_worker`]), then wait until each completed (at most 15 s each). Returns
/// each acknowledged turn's id with its number.
pub async fn echo_turns(
    c: &Caller,
    session: &str,
    from: u64,
    n: u64,
) -> anyhow::Result<Vec<(String, u64)>> {
    let mut acked = Vec::new();
    for i in from..from + n {
        let t = c.submit_simple(session, "echo", json!(i)).await?;
        acked.push((t.turn_id, i));
    }
    for (id, _) in &acked {
        let done = c.wait_terminal(id, Duration::from_secs(15)).await?;
        assert_eq!(done.status, turnd_proto::TurnStatus::Completed, "{done:?}");
    }
    Ok(acked)
}

/// Wait until the turn is terminal (at most `secs`).
pub async fn wait_done(c: &Caller, turn_id: &str, secs: u64) -> anyhow::Result<Turn> {
    Ok(c.wait_terminal(turn_id, Duration::from_secs(secs)).await?)
}

/// Poll `f` every 10 ms until it returns Some, at most `secs`.
pub async fn eventually<T, F, Fut>(secs: u64, what: &str, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f().await {
            return Ok(v);
        }
        if tokio::time::Instant::now() > deadline {
            bail!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The value of one sample line of /metrics, e.g. `turnd_sessions_waiting{state="backing_off"}`.
pub fn metric(body: &str, sample: &str) -> Option<f64> {
    body.lines()
        .find(|l| l.starts_with(sample) && l[sample.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// GET a path on a plain-HTTP admin listener (`http://ADDR`): status and body.
pub async fn http_get(admin: &str, path: &str) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = admin.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf).to_string();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("no status line in {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((code, body))
}

/// A raw WebSocket peer speaking JSON frames, for protocol-level tests.
pub struct Raw {
    pub ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
    next_id: u64,
    /// Pushes received while waiting for responses.
    pub pushes: Vec<Value>,
}

impl Raw {
    pub async fn connect(url: &str) -> anyhow::Result<Raw> {
        let (ws, _) = tokio_tungstenite::connect_async(url).await?;
        Ok(Raw {
            ws,
            next_id: 1,
            pushes: Vec::new(),
        })
    }

    /// Wrap a plain TCP WebSocket made by the caller (e.g. with socket options).
    pub fn from_stream(ws: WebSocketStream<TcpStream>) -> RawTcp {
        RawTcp { ws, next_id: 1 }
    }

    /// Connect and say hello with `role` (extra hello args merged in).
    pub async fn hello(url: &str, role: &str, extra: Value) -> anyhow::Result<(Raw, Value)> {
        let mut r = Raw::connect(url).await?;
        let mut args = json!({"protocol": 1, "role": role, "token": "t"});
        if let (Some(a), Some(e)) = (args.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                a.insert(k.clone(), v.clone());
            }
        }
        let resp = r.request("hello", args).await?;
        Ok((r, resp))
    }

    pub async fn send_text(&mut self, text: &str) -> anyhow::Result<()> {
        self.ws.send(Message::text(text.to_string())).await?;
        Ok(())
    }

    /// Next JSON frame (responses and pushes), at most 5 s.
    pub async fn recv(&mut self) -> anyhow::Result<Value> {
        loop {
            let m = tokio::time::timeout(Duration::from_secs(5), self.ws.next())
                .await
                .context("no frame within 5s")?;
            match m {
                Some(Ok(Message::Text(t))) => return Ok(serde_json::from_str(t.as_str())?),
                Some(Ok(Message::Close(c))) => bail!("closed: {c:?}"),
                Some(Ok(_)) => continue,
                Some(Err(e)) => bail!("socket error: {e}"),
                None => bail!("connection ended"),
            }
        }
    }

    /// Send a request and return the whole response frame (pushes are kept aside).
    pub async fn request(&mut self, op: &str, args: Value) -> anyhow::Result<Value> {
        let id = self.next_id;
        self.next_id += 1;
        self.send_text(&json!({"id": id, "op": op, "args": args}).to_string())
            .await?;
        loop {
            let f = self.recv().await?;
            if f.get("push").is_some() {
                self.pushes.push(f);
                continue;
            }
            if f.get("id") == Some(&json!(id)) {
                return Ok(f);
            }
        }
    }

    /// Send `n` requests `op` with `args` at once, without waiting for answers, and
    /// return their response frames in the order sent (pushes are kept aside), with
    /// the time from before the first was sent until the last answer was read: the
    /// daemon read every one of them within that time.
    pub async fn burst(
        &mut self,
        op: &str,
        args: &Value,
        n: usize,
    ) -> anyhow::Result<(Vec<Value>, Duration)> {
        let first = self.next_id;
        self.next_id += n as u64;
        let started = std::time::Instant::now();
        for id in first..first + n as u64 {
            let frame = json!({"id": id, "op": op, "args": args}).to_string();
            self.ws.feed(Message::text(frame)).await?;
        }
        self.ws.flush().await?;
        let mut answers: Vec<Option<Value>> = vec![None; n];
        let mut left = n;
        while left > 0 {
            let f = self.recv().await?;
            if f.get("push").is_some() {
                self.pushes.push(f);
                continue;
            }
            let slot = f
                .get("id")
                .and_then(Value::as_u64)
                .and_then(|id| id.checked_sub(first))
                .and_then(|i| usize::try_from(i).ok())
                .and_then(|i| answers.get_mut(i));
            if let Some(slot) = slot.filter(|s| s.is_none()) {
                *slot = Some(f);
                left -= 1;
            }
        }
        Ok((answers.into_iter().flatten().collect(), started.elapsed()))
    }

    /// Send a request and return its `ok` member, failing on an error response.
    pub async fn ok(&mut self, op: &str, args: Value) -> anyhow::Result<Value> {
        let f = self.request(op, args).await?;
        match f.get("ok") {
            Some(v) => Ok(v.clone()),
            None => bail!("{op} failed: {f}"),
        }
    }

    /// Send a request and return its error code, failing on success.
    pub async fn error_code(&mut self, op: &str, args: Value) -> anyhow::Result<String> {
        let f = self.request(op, args).await?;
        match f.pointer("/error/code").and_then(Value::as_str) {
            Some(c) => Ok(c.to_string()),
            None => bail!("{op} unexpectedly succeeded: {f}"),
        }
    }

    /// The text of the next frame that contains `part`, at most 5 s (frames before it
    /// are dropped): for tests of the bytes a frame carries.
    pub async fn text_with(&mut self, part: &str) -> anyhow::Result<String> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            match tokio::time::timeout_at(deadline, self.ws.next()).await {
                Ok(Some(Ok(Message::Text(t)))) if t.as_str().contains(part) => {
                    return Ok(t.as_str().to_string())
                }
                Ok(Some(Ok(_))) => continue,
                Ok(Some(Err(e))) => bail!("socket error: {e}"),
                Ok(None) => bail!("connection ended"),
                Err(_) => bail!("no frame with {part} within 5 s"),
            }
        }
    }

    /// The next push (from the kept ones first), at most 5 s.
    pub async fn next_push(&mut self) -> anyhow::Result<Value> {
        if !self.pushes.is_empty() {
            return Ok(self.pushes.remove(0));
        }
        loop {
            let f = self.recv().await?;
            if f.get("push").is_some() {
                return Ok(f);
            }
        }
    }
}

/// The incoming half of a [`raw_peer`]'s connection.
pub type RawStream = futures_util::stream::SplitStream<WebSocketStream<MaybeTlsStream<TcpStream>>>;

/// A raw protocol peer on `url`, for tests that play a worker frame by frame and
/// answer from several tasks: the frames given to the returned sender are written, in
/// order, by a task on `tasks` until the connection fails; the stream yields what
/// arrives ([`next_json`]).
pub async fn raw_peer(
    url: &str,
    tasks: &mut tokio::task::JoinSet<()>,
) -> anyhow::Result<(tokio::sync::mpsc::UnboundedSender<String>, RawStream)> {
    let (ws, _) = tokio_tungstenite::connect_async(url)
        .await
        .with_context(|| format!("connect a raw peer to {url}"))?;
    let (mut sink, stream) = ws.split();
    let (out, mut out_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    tasks.spawn(async move {
        while let Some(frame) = out_rx.recv().await {
            if sink.send(Message::text(frame)).await.is_err() {
                break;
            }
        }
    });
    Ok((out, stream))
}

/// The next text frame of `stream` as JSON; an error once the connection ended.
pub async fn next_json<S>(stream: &mut S) -> anyhow::Result<Value>
where
    S: futures_util::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    loop {
        match stream.next().await {
            Some(Ok(Message::Text(t))) => match serde_json::from_str(t.as_str()) {
                Ok(v) => return Ok(v),
                Err(e) => bail!("undecodable frame from the daemon: {e}"),
            },
            Some(Ok(Message::Close(_))) | None => bail!("connection ended"),
            Some(Ok(_)) => continue,
            Some(Err(e)) => bail!("connection failed: {e}"),
        }
    }
}

/// A raw peer over a plain TCP stream (see [`Raw::from_stream`]).
pub struct RawTcp {
    pub ws: WebSocketStream<TcpStream>,
    next_id: u64,
}

impl RawTcp {
    /// Send a request and return its `ok` member (pushes before it are skipped).
    pub async fn ok(&mut self, op: &str, args: Value) -> anyhow::Result<Value> {
        let id = self.next_id;
        self.next_id += 1;
        self.ws
            .send(Message::text(
                json!({"id": id, "op": op, "args": args}).to_string(),
            ))
            .await?;
        loop {
            let m = tokio::time::timeout(Duration::from_secs(5), self.ws.next())
                .await
                .context("no frame within 5s")?;
            let f: Value = match m {
                Some(Ok(Message::Text(t))) => serde_json::from_str(t.as_str())?,
                Some(Ok(_)) => continue,
                Some(Err(e)) => bail!("socket error: {e}"),
                None => bail!("connection ended"),
            };
            if f.get("id") == Some(&json!(id)) {
                return f
                    .get("ok")
                    .cloned()
                    .with_context(|| format!("{op} failed: {f}"));
            }
        }
    }
}

/// A connection to the daemon at `url` with a tiny receive buffer (4 KiB), for a
/// peer that stops reading: its socket fills up soon, and the daemon's outgoing
/// queue with it.
pub async fn small_buffer_peer(url: &str) -> anyhow::Result<RawTcp> {
    let sock = tokio::net::TcpSocket::new_v4()?;
    sock.set_recv_buffer_size(4096)?;
    let addr = url
        .trim_start_matches("ws://")
        .trim_end_matches("/v1")
        .parse()?;
    let stream = sock.connect(addr).await?;
    let (ws, _) = tokio_tungstenite::client_async(url, stream).await?;
    Ok(Raw::from_stream(ws))
}

/// The built `turnd` binary, built once per test run if missing.
pub fn turnd_bin() -> anyhow::Result<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| cargo_built("TURND_BIN", &["-p", "turnd", "--bin", "turnd"], "turnd"))
        .clone()
        .map_err(|e| anyhow::anyhow!(e))
}

/// `libturnd_faultfs.so` (the `LD_PRELOAD` library of `crates/turnd-faultfs` that
/// makes file writes and syncs fail on demand), built once per test run if missing.
pub fn faultfs_lib() -> anyhow::Result<PathBuf> {
    static LIB: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        cargo_built(
            "TURND_FAULTFS_LIB",
            &["-p", "turnd-faultfs"],
            "libturnd_faultfs.so",
        )
    })
    .clone()
    .map_err(|e| anyhow::anyhow!(e))
}

/// The `turnd-client` example program `name` (`crates/turnd-client/examples/`): in
/// `TURND_EXAMPLES_DIR` when set (`make test` builds them there with the binary),
/// else built with cargo.
pub fn client_example(name: &str) -> anyhow::Result<PathBuf> {
    if let Ok(dir) = std::env::var("TURND_EXAMPLES_DIR") {
        return Ok(PathBuf::from(dir).join(name));
    }
    cargo_built(
        "",
        &["-p", "turnd-client", "--example", name],
        &format!("examples/{name}"),
    )
    .map_err(|e| anyhow::anyhow!(e))
}

/// The path in `env_var`, or else `artifact` in the debug target directory after
/// `cargo build` with `args`.
fn cargo_built(env_var: &str, args: &[&str], artifact: &str) -> Result<PathBuf, String> {
    if let Some(p) = (!env_var.is_empty())
        .then(|| std::env::var(env_var).ok())
        .flatten()
    {
        return Ok(PathBuf::from(p));
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or("no workspace root")?
        .to_path_buf();
    let status = std::process::Command::new(env!("CARGO"))
        .arg("build")
        .args(args)
        .current_dir(&root)
        .status()
        .map_err(|e| format!("run cargo build: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build {} failed", args.join(" ")));
    }
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("target"));
    Ok(target.join("debug").join(artifact))
}

/// The real binary running as a child process.
pub struct BinDaemon {
    pub child: tokio::process::Child,
    pub url: String,
    pub admin: String,
    pub data_dir: PathBuf,
}

impl BinDaemon {
    /// Start `turnd serve` on `data_dir` with extra `TURND_*` environment settings;
    /// returns once its ready file names its addresses.
    pub async fn start(data_dir: &Path, env: &[(&str, &str)]) -> anyhow::Result<BinDaemon> {
        Self::start_on(data_dir, "127.0.0.1:0", env).await
    }

    /// Like [`BinDaemon::start`], on a chosen WebSocket listen address (to restart a
    /// daemon where its workers will reconnect by themselves).
    pub async fn start_on(
        data_dir: &Path,
        listen: &str,
        env: &[(&str, &str)],
    ) -> anyhow::Result<BinDaemon> {
        Self::start_with(
            data_dir,
            &data_dir.with_extension("ready.json"),
            listen,
            env,
        )
        .await
    }

    /// Like [`BinDaemon::start_on`], with the ready file at `ready` (outside a
    /// directory tree a test records); fails as soon as the daemon exits unready.
    pub async fn start_with(
        data_dir: &Path,
        ready: &Path,
        listen: &str,
        env: &[(&str, &str)],
    ) -> anyhow::Result<BinDaemon> {
        let bin = turnd_bin()?;
        if ready.exists() {
            std::fs::remove_file(ready)?;
        }
        let mut cmd = tokio::process::Command::new(bin);
        cmd.args(["serve", "--listen", listen, "--admin-listen", "127.0.0.1:0"])
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--ready-file")
            .arg(ready)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit())
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().context("spawn turnd")?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let body = loop {
            if let Ok(body) = std::fs::read_to_string(ready) {
                break body;
            }
            if let Some(status) = child.try_wait()? {
                bail!("turnd exited with {status} before it was ready");
            }
            if tokio::time::Instant::now() > deadline {
                bail!("timed out waiting for the ready file");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let v: Value = serde_json::from_str(&body)?;
        Ok(BinDaemon {
            child,
            url: v["ws"].as_str().context("ws in ready file")?.to_string(),
            admin: v["admin"]
                .as_str()
                .context("admin in ready file")?
                .to_string(),
            data_dir: data_dir.to_path_buf(),
        })
    }

    /// SIGKILL and reap.
    pub async fn kill(mut self) -> anyhow::Result<()> {
        self.child.kill().await?;
        Ok(())
    }

    /// SIGTERM and wait for the exit status.
    pub async fn terminate(mut self) -> anyhow::Result<std::process::ExitStatus> {
        let pid = self.child.id().context("child pid")?;
        let status = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()?;
        if !status.success() {
            bail!("kill -TERM failed");
        }
        Ok(tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await??)
    }
}
