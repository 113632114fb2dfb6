//! A transparent WebSocket proxy that loses, delays and repeats frames on purpose.
//!
//! Workers connect to the proxy's `ws://127.0.0.1:PORT/v1` instead of the daemon; for
//! every accepted connection the proxy opens its own connection to the daemon (the
//! *upstream*) and forwards frames both ways. Text frames are parsed as JSON and
//! matched against [`Rule`]s, in the order they were added; the first rule that
//! applies decides the frame's [`Fate`]: dropped, delayed, duplicated, or (no rule)
//! forwarded unchanged. Frames that are not JSON are forwarded unchanged. Ping, pong
//! and close frames are always forwarded, so liveness detection on both sides still
//! works while rules lose application frames.
//!
//! Beyond single frames the proxy can cut every connection abruptly (the sockets are
//! dropped: no close frame, exactly what a crashed process or a dead network path
//! looks like), refuse new connections or hold them until released, and switch its
//! upstream to another daemon address so workers survive a daemon restart on a new
//! port as if it had kept its address.
//!
//! Everything is controlled at run time through a cloneable [`ProxyHandle`], and every
//! frame that passed is kept in a log with its fate, for assertions on what really
//! went over the wire.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::{SinkExt, Stream, StreamExt};
use serde_json::Value;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::handshake::server::{
    ErrorResponse, Request as HttpRequest, Response,
};
use tokio_tungstenite::tungstenite::http::StatusCode;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::rng::SplitMix64;

/// The only path the proxy accepts, as the daemon does.
const WS_PATH: &str = "/v1";
/// How long a connection may take to finish its close handshake once one side sent a
/// close frame, before the proxy drops both sockets.
const CLOSE_LINGER: Duration = Duration::from_secs(1);
/// Frames kept in the log; later frames are counted but not logged.
const LOG_LIMIT: usize = 200_000;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Which way a frame travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dir {
    /// From the connecting peer (the worker) to the daemon: requests.
    ToServer,
    /// From the daemon to the connecting peer: responses and pushes.
    ToClient,
}

/// A predicate on a frame's JSON, e.g. "a request with `op == invocation.result`".
#[derive(Clone)]
pub struct Match {
    label: Arc<str>,
    pred: Arc<dyn Fn(&Value) -> bool + Send + Sync>,
}

impl std::fmt::Debug for Match {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Match({})", self.label)
    }
}

impl Match {
    /// A matcher from any predicate; `label` shows in debug output.
    pub fn custom(
        label: impl Into<String>,
        pred: impl Fn(&Value) -> bool + Send + Sync + 'static,
    ) -> Match {
        Match {
            label: Arc::from(label.into()),
            pred: Arc::new(pred),
        }
    }

    /// Every JSON frame.
    pub fn any() -> Match {
        Match::custom("any", |_| true)
    }

    /// Requests with this `op`, e.g. `invocation.result`.
    pub fn op(op: &str) -> Match {
        let want = op.to_string();
        Match::custom(format!("op == {op}"), move |v| {
            v.get("op").and_then(Value::as_str) == Some(want.as_str())
        })
    }

    /// Pushes of this kind: `invoke`, `probe`, `cancel` or `event`.
    pub fn push(kind: &str) -> Match {
        let want = kind.to_string();
        Match::custom(format!("push == {kind}"), move |v| {
            v.get("push").and_then(Value::as_str) == Some(want.as_str())
        })
    }

    /// Responses (frames with `ok` or `error`, no `op` and no `push`).
    pub fn response() -> Match {
        Match::custom("response", |v| {
            v.get("op").is_none()
                && v.get("push").is_none()
                && (v.get("ok").is_some() || v.get("error").is_some())
        })
    }

    /// Frames where the JSON pointer `pointer` (e.g. `/args/invocation_id`) equals
    /// `value`.
    pub fn field(pointer: &str, value: Value) -> Match {
        let p = pointer.to_string();
        Match::custom(format!("{pointer} == {value}"), move |v| {
            v.pointer(&p) == Some(&value)
        })
    }

    /// Frames about one invocation: requests naming it in `args.invocation_id` and
    /// pushes naming it in `invocation_id`.
    pub fn invocation(invocation_id: &str) -> Match {
        let want = invocation_id.to_string();
        Match::custom(format!("invocation {invocation_id}"), move |v| {
            let named = v
                .pointer("/args/invocation_id")
                .or_else(|| v.get("invocation_id"))
                .and_then(Value::as_str);
            named == Some(want.as_str())
        })
    }

    /// Both this and `other`.
    pub fn and(self, other: Match) -> Match {
        let label = format!("({} and {})", self.label, other.label);
        Match::custom(label, move |v| self.matches(v) && other.matches(v))
    }

    /// This or `other`.
    pub fn or(self, other: Match) -> Match {
        let label = format!("({} or {})", self.label, other.label);
        Match::custom(label, move |v| self.matches(v) || other.matches(v))
    }

    /// Whether the frame matches.
    pub fn matches(&self, v: &Value) -> bool {
        (self.pred)(v)
    }
}

/// What a rule does to a frame it applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// The frame is never delivered.
    Drop,
    /// The frame is delivered after this delay, and the frames behind it in the same
    /// direction wait for it: order is preserved, as on a real (TCP) connection.
    Delay(Duration),
    /// The frame is delivered twice, back to back.
    Duplicate,
}

/// A fault to inject: frames going `dir` that match `matcher` get `action`, for the
/// next `times` such frames (or all of them), each with probability `chance`.
#[derive(Debug, Clone)]
pub struct Rule {
    dir: Dir,
    matcher: Match,
    action: Action,
    times: Option<u64>,
    chance: Option<f64>,
}

impl Rule {
    /// A rule applying `action` to every frame going `dir` that matches.
    pub fn new(dir: Dir, matcher: Match, action: Action) -> Rule {
        Rule {
            dir,
            matcher,
            action,
            times: None,
            chance: None,
        }
    }

    /// Drop matching frames.
    pub fn drop(dir: Dir, matcher: Match) -> Rule {
        Rule::new(dir, matcher, Action::Drop)
    }

    /// Delay matching frames by `by`.
    pub fn delay(dir: Dir, matcher: Match, by: Duration) -> Rule {
        Rule::new(dir, matcher, Action::Delay(by))
    }

    /// Deliver matching frames twice.
    pub fn duplicate(dir: Dir, matcher: Match) -> Rule {
        Rule::new(dir, matcher, Action::Duplicate)
    }

    /// Apply to the next `n` frames it hits only; then the rule is spent.
    pub fn times(mut self, n: u64) -> Rule {
        self.times = Some(n);
        self
    }

    /// Apply to each matching frame with probability `p` (drawn from the proxy's
    /// seeded generator, see [`ProxyHandle::seed`]); a frame it passes over is still
    /// offered to the rules after it.
    pub fn chance(mut self, p: f64) -> Rule {
        self.chance = Some(p.clamp(0.0, 1.0));
        self
    }
}

/// Identifies a rule added to a proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RuleId(u64);

/// What happened to a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Delivered unchanged.
    Forwarded,
    /// Never delivered.
    Dropped,
    /// Delivered after the delay (unless the connection ended first).
    Delayed(Duration),
    /// Delivered twice.
    Duplicated,
}

/// One text frame that went through the proxy.
#[derive(Debug, Clone)]
pub struct LoggedFrame {
    /// The proxied connection (numbered from 1 in accept order).
    pub conn: u64,
    /// Its direction.
    pub dir: Dir,
    /// When the proxy read it (Unix ms, comparable with the daemon's `at_ms`).
    pub at_unix_ms: u64,
    /// The frame's JSON (a JSON string holding the text when it was not JSON).
    pub frame: Value,
    /// What the proxy did with it.
    pub fate: Fate,
}

/// Counters of a proxy's decisions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Connections accepted and connected upstream.
    pub connections: u64,
    /// Connections refused (socket dropped at accept) while refusing.
    pub refused: u64,
    /// Connections dropped because the upstream daemon could not be reached.
    pub upstream_failures: u64,
    /// Connections cut by [`ProxyHandle::cut_all`] / [`ProxyHandle::cut_worker`].
    pub cut: u64,
    /// Text frames forwarded unchanged.
    pub forwarded: u64,
    /// Text frames dropped by a rule.
    pub dropped: u64,
    /// Text frames delayed by a rule.
    pub delayed: u64,
    /// Text frames duplicated by a rule.
    pub duplicated: u64,
}

#[derive(Default)]
struct Counters {
    connections: AtomicU64,
    refused: AtomicU64,
    upstream_failures: AtomicU64,
    cut: AtomicU64,
    forwarded: AtomicU64,
    dropped: AtomicU64,
    delayed: AtomicU64,
    duplicated: AtomicU64,
}

struct RuleEntry {
    id: u64,
    rule: Rule,
    hits: u64,
}

struct ConnEntry {
    worker_id: Option<String>,
    /// Drops both sockets.
    cut: CancellationToken,
    /// Drops the peer's socket only; the daemon's stays open (half-open).
    sever: CancellationToken,
}

#[derive(Default)]
struct Refusal {
    on: bool,
    until: Option<Instant>,
}

struct State {
    addr: SocketAddr,
    upstream: Mutex<String>,
    rules: Mutex<Vec<RuleEntry>>,
    next_rule: AtomicU64,
    conns: Mutex<HashMap<u64, ConnEntry>>,
    next_conn: AtomicU64,
    refusal: Mutex<Refusal>,
    hold: watch::Sender<bool>,
    counters: Counters,
    log: Mutex<Vec<LoggedFrame>>,
    logged: Notify,
    rng: Mutex<SplitMix64>,
    shutdown: CancellationToken,
}

impl State {
    fn refusing(&self) -> bool {
        let r = lock(&self.refusal);
        r.on || r.until.map(|u| Instant::now() < u).unwrap_or(false)
    }

    /// The fate of a text frame: the first rule that applies decides.
    fn decide(&self, dir: Dir, frame: Option<&Value>) -> Fate {
        let Some(frame) = frame else {
            return Fate::Forwarded;
        };
        let mut rules = lock(&self.rules);
        for entry in rules.iter_mut() {
            let r = &entry.rule;
            if r.dir != dir || r.times.map(|n| entry.hits >= n).unwrap_or(false) {
                continue;
            }
            if !r.matcher.matches(frame) {
                continue;
            }
            if let Some(p) = r.chance {
                if !lock(&self.rng).chance(p) {
                    continue;
                }
            }
            entry.hits += 1;
            return match r.action {
                Action::Drop => Fate::Dropped,
                Action::Delay(d) => Fate::Delayed(d),
                Action::Duplicate => Fate::Duplicated,
            };
        }
        Fate::Forwarded
    }

    fn record(&self, conn: u64, dir: Dir, frame: Value, fate: Fate) {
        let c = &self.counters;
        let counter = match fate {
            Fate::Forwarded => &c.forwarded,
            Fate::Dropped => &c.dropped,
            Fate::Delayed(_) => &c.delayed,
            Fate::Duplicated => &c.duplicated,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        {
            let mut log = lock(&self.log);
            if log.len() < LOG_LIMIT {
                log.push(LoggedFrame {
                    conn,
                    dir,
                    at_unix_ms: unix_ms(),
                    frame,
                    fate,
                });
            }
        }
        self.logged.notify_waiters();
    }

    fn cut_where(&self, pred: impl Fn(&ConnEntry) -> bool) -> usize {
        let conns = lock(&self.conns);
        let mut n = 0;
        for c in conns.values().filter(|c| pred(c)) {
            if !c.cut.is_cancelled() {
                c.cut.cancel();
                n += 1;
            }
        }
        self.counters.cut.fetch_add(n as u64, Ordering::Relaxed);
        n
    }
}

/// Control of a running [`Proxy`]; cheap to clone, usable from any task.
#[derive(Clone)]
pub struct ProxyHandle {
    state: Arc<State>,
}

impl std::fmt::Debug for ProxyHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyHandle")
            .field("addr", &self.state.addr)
            .field("upstream", &self.upstream())
            .field("stats", &self.stats())
            .finish()
    }
}

impl ProxyHandle {
    /// The URL workers connect to: `ws://127.0.0.1:PORT/v1`.
    pub fn url(&self) -> String {
        format!("ws://{}{WS_PATH}", self.state.addr)
    }

    /// The daemon URL new connections are forwarded to.
    pub fn upstream(&self) -> String {
        lock(&self.state.upstream).clone()
    }

    /// Forward new connections to `url` from now on (existing ones are unchanged; cut
    /// them to move their peers over).
    pub fn set_upstream(&self, url: impl Into<String>) {
        *lock(&self.state.upstream) = url.into();
    }

    /// Add a rule after the existing ones.
    pub fn add(&self, rule: Rule) -> RuleId {
        let id = self.state.next_rule.fetch_add(1, Ordering::Relaxed);
        lock(&self.state.rules).push(RuleEntry { id, rule, hits: 0 });
        RuleId(id)
    }

    /// Remove a rule; false if it was not there.
    pub fn remove(&self, id: RuleId) -> bool {
        let mut rules = lock(&self.state.rules);
        let before = rules.len();
        rules.retain(|r| r.id != id.0);
        rules.len() != before
    }

    /// Remove every rule: from now on every frame is forwarded.
    pub fn clear_rules(&self) {
        lock(&self.state.rules).clear();
    }

    /// How many frames a rule has applied to so far (0 once removed).
    pub fn hits(&self, id: RuleId) -> u64 {
        lock(&self.state.rules)
            .iter()
            .find(|r| r.id == id.0)
            .map(|r| r.hits)
            .unwrap_or(0)
    }

    /// Drop the next `n` frames going `dir` that match.
    pub fn drop_next(&self, dir: Dir, matcher: Match, n: u64) -> RuleId {
        self.add(Rule::drop(dir, matcher).times(n))
    }

    /// Drop every frame going `dir` that matches, until the rule is removed.
    pub fn drop_all(&self, dir: Dir, matcher: Match) -> RuleId {
        self.add(Rule::drop(dir, matcher))
    }

    /// Delay every frame going `dir` that matches by `by`.
    pub fn delay(&self, dir: Dir, matcher: Match, by: Duration) -> RuleId {
        self.add(Rule::delay(dir, matcher, by))
    }

    /// Deliver the next `n` frames going `dir` that match twice.
    pub fn duplicate_next(&self, dir: Dir, matcher: Match, n: u64) -> RuleId {
        self.add(Rule::duplicate(dir, matcher).times(n))
    }

    /// Reseed the generator behind [`Rule::chance`].
    pub fn seed(&self, seed: u64) {
        *lock(&self.state.rng) = SplitMix64::new(seed);
    }

    /// Cut every open connection now: both sockets are dropped without a close frame.
    /// Returns how many were cut.
    pub fn cut_all(&self) -> usize {
        self.state.cut_where(|_| true)
    }

    /// Cut the connections whose `hello` named this `worker_id`.
    pub fn cut_worker(&self, worker_id: &str) -> usize {
        self.state
            .cut_where(|c| c.worker_id.as_deref() == Some(worker_id))
    }

    /// Drop the peer side of the connections whose `hello` named `worker_id`, but keep
    /// their daemon side open and answering pings: the daemon still believes the old
    /// connection alive (a half-open connection) when the worker reconnects, so the
    /// new `hello` supersedes it. Returns how many were severed.
    pub fn half_open_worker(&self, worker_id: &str) -> usize {
        let conns = lock(&self.state.conns);
        let mut n = 0;
        for c in conns
            .values()
            .filter(|c| c.worker_id.as_deref() == Some(worker_id) && !c.sever.is_cancelled())
        {
            c.sever.cancel();
            n += 1;
        }
        self.state
            .counters
            .cut
            .fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Refuse new connections (their sockets are dropped at accept) until
    /// `refuse(false)`. Open connections are not touched.
    pub fn refuse(&self, on: bool) {
        let mut r = lock(&self.state.refusal);
        r.on = on;
        if !on {
            r.until = None;
        }
    }

    /// Refuse new connections for `d` from now.
    pub fn refuse_for(&self, d: Duration) {
        lock(&self.state.refusal).until = Some(Instant::now() + d);
    }

    /// Hold new connections: they are accepted but wait, before their WebSocket
    /// handshake, until `hold(false)`; then they proceed at once. Unlike refusing, the
    /// peer's connect attempt simply takes longer, so it reconnects the moment the
    /// hold ends instead of after its next backoff step.
    pub fn hold(&self, on: bool) {
        self.state.hold.send_replace(on);
    }

    /// Open connections right now.
    pub fn connections(&self) -> usize {
        lock(&self.state.conns)
            .values()
            .filter(|c| !c.cut.is_cancelled() && !c.sever.is_cancelled())
            .count()
    }

    /// Open connections whose `hello` named this `worker_id`.
    pub fn worker_connections(&self, worker_id: &str) -> usize {
        lock(&self.state.conns)
            .values()
            .filter(|c| {
                !c.cut.is_cancelled()
                    && !c.sever.is_cancelled()
                    && c.worker_id.as_deref() == Some(worker_id)
            })
            .count()
    }

    /// The counters so far.
    pub fn stats(&self) -> ProxyStats {
        let c = &self.state.counters;
        ProxyStats {
            connections: c.connections.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            upstream_failures: c.upstream_failures.load(Ordering::Relaxed),
            cut: c.cut.load(Ordering::Relaxed),
            forwarded: c.forwarded.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            delayed: c.delayed.load(Ordering::Relaxed),
            duplicated: c.duplicated.load(Ordering::Relaxed),
        }
    }

    /// Every text frame logged so far, in the order the proxy read them.
    pub fn frames(&self) -> Vec<LoggedFrame> {
        lock(&self.state.log).clone()
    }

    /// The logged frames going `dir` that match.
    pub fn frames_matching(&self, dir: Dir, matcher: &Match) -> Vec<LoggedFrame> {
        lock(&self.state.log)
            .iter()
            .filter(|f| f.dir == dir && matcher.matches(&f.frame))
            .cloned()
            .collect()
    }

    /// How many logged frames going `dir` match (whatever their fate).
    pub fn count(&self, dir: Dir, matcher: &Match) -> usize {
        lock(&self.state.log)
            .iter()
            .filter(|f| f.dir == dir && matcher.matches(&f.frame))
            .count()
    }

    /// Wait until at least `n` frames going `dir` that match were logged; false when
    /// `timeout` passed first.
    pub async fn wait_frames(
        &self,
        dir: Dir,
        matcher: &Match,
        n: usize,
        timeout: Duration,
    ) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let notified = self.state.logged.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.count(dir, matcher) >= n {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.count(dir, matcher) >= n;
            }
        }
    }
}

/// A running proxy. Dropping it stops accepting and cuts every connection.
pub struct Proxy {
    handle: ProxyHandle,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.handle.fmt(f)
    }
}

impl std::ops::Deref for Proxy {
    type Target = ProxyHandle;

    fn deref(&self) -> &ProxyHandle {
        &self.handle
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.handle.state.shutdown.cancel();
        self.handle.state.cut_where(|_| true);
        self.task.abort();
    }
}

impl Proxy {
    /// Listen on `127.0.0.1:0` and forward every connection to `upstream` (a daemon
    /// URL such as `ws://127.0.0.1:7420/v1`).
    pub async fn start(upstream: impl Into<String>) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            addr,
            upstream: Mutex::new(upstream.into()),
            rules: Mutex::new(Vec::new()),
            next_rule: AtomicU64::new(1),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            refusal: Mutex::new(Refusal::default()),
            hold: watch::Sender::new(false),
            counters: Counters::default(),
            log: Mutex::new(Vec::new()),
            logged: Notify::new(),
            rng: Mutex::new(SplitMix64::new(0)),
            shutdown: CancellationToken::new(),
        });
        let task = tokio::spawn(accept_loop(listener, state.clone()));
        Ok(Proxy {
            handle: ProxyHandle { state },
            task,
        })
    }

    /// A handle to control the proxy from elsewhere.
    pub fn handle(&self) -> ProxyHandle {
        self.handle.clone()
    }

    /// The proxy's listening address.
    pub fn addr(&self) -> SocketAddr {
        self.handle.state.addr
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<State>) {
    let conns = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            _ = state.shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((tcp, peer)) => {
                conns.spawn(serve_connection(state.clone(), tcp, peer));
            }
            Err(e) => {
                warn!("proxy failed to accept a connection: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    conns.close();
}

async fn serve_connection(state: Arc<State>, tcp: TcpStream, peer: SocketAddr) {
    if state.refusing() {
        state.counters.refused.fetch_add(1, Ordering::Relaxed);
        debug!(%peer, "proxy refusing a connection");
        return;
    }
    let mut hold = state.hold.subscribe();
    tokio::select! {
        _ = state.shutdown.cancelled() => return,
        held = hold.wait_for(|on| !*on) => {
            if held.is_err() {
                return;
            }
        }
    }
    // A refusal may have started while the connection was held.
    if state.refusing() {
        state.counters.refused.fetch_add(1, Ordering::Relaxed);
        return;
    }
    if let Err(e) = tcp.set_nodelay(true) {
        debug!(%peer, "set TCP_NODELAY: {e}");
    }
    #[allow(clippy::result_large_err)]
    let check_path = |req: &HttpRequest, resp: Response| -> Result<Response, ErrorResponse> {
        if req.uri().path() == WS_PATH {
            Ok(resp)
        } else {
            let mut r = ErrorResponse::new(Some(format!("the proxy serves {WS_PATH} only\n")));
            *r.status_mut() = StatusCode::NOT_FOUND;
            Err(r)
        }
    };
    let client = match tokio_tungstenite::accept_hdr_async(tcp, check_path).await {
        Ok(ws) => ws,
        Err(e) => {
            debug!(%peer, "proxy handshake with the peer failed: {e}");
            return;
        }
    };
    let upstream = lock(&state.upstream).clone();
    let server = match tokio_tungstenite::connect_async_with_config(&upstream, None, true).await {
        Ok((ws, _)) => ws,
        Err(e) => {
            // The peer sees its connection drop, as if the daemon were unreachable.
            state
                .counters
                .upstream_failures
                .fetch_add(1, Ordering::Relaxed);
            debug!(%peer, %upstream, "proxy could not reach the daemon: {e}");
            return;
        }
    };
    let id = state.next_conn.fetch_add(1, Ordering::Relaxed);
    let cut = state.shutdown.child_token();
    let sever = CancellationToken::new();
    lock(&state.conns).insert(
        id,
        ConnEntry {
            worker_id: None,
            cut: cut.clone(),
            sever: sever.clone(),
        },
    );
    state.counters.connections.fetch_add(1, Ordering::Relaxed);
    let ends = Ends {
        cut: &cut,
        sever: &sever,
        closing: CancellationToken::new(),
    };
    pipe(&state, id, client, server, &ends).await;
    lock(&state.conns).remove(&id);
}

/// How a proxied connection ends.
struct Ends<'a> {
    /// Both sockets dropped (a cut, or one side vanished).
    cut: &'a CancellationToken,
    /// The peer's socket dropped, the daemon's kept.
    sever: &'a CancellationToken,
    /// A close frame was seen: the close handshake gets a moment, then both go.
    closing: CancellationToken,
}

/// A frame on its way, and when it may be written (delayed frames hold up the frames
/// behind them, as on a real connection).
struct Outgoing {
    msg: Message,
    not_before: Option<Instant>,
}

impl Outgoing {
    fn now(msg: Message) -> Outgoing {
        Outgoing {
            msg,
            not_before: None,
        }
    }
}

/// Forward frames both ways until both sides closed, one side vanished, or a cut.
async fn pipe<C, S>(
    state: &Arc<State>,
    id: u64,
    client: tokio_tungstenite::WebSocketStream<C>,
    server: tokio_tungstenite::WebSocketStream<S>,
    ends: &Ends<'_>,
) where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (client_sink, client_stream) = client.split();
    let (server_sink, server_stream) = server.split();
    let (to_server, to_server_rx) = mpsc::unbounded_channel();
    let (to_client, to_client_rx) = mpsc::unbounded_channel();
    // The peer's halves live in these two futures only, so severing them drops the
    // peer's socket while the daemon's stays open.
    let peer_reader = async {
        tokio::select! {
            _ = ends.sever.cancelled() => {}
            _ = read_side(state, id, Dir::ToServer, client_stream, to_server, ends) => {}
        }
    };
    let peer_writer = async {
        tokio::select! {
            _ = ends.sever.cancelled() => {}
            _ = write_side(to_client_rx, client_sink, ends.cut) => {}
        }
    };
    let run = async {
        tokio::join!(
            peer_reader,
            read_side(state, id, Dir::ToClient, server_stream, to_client, ends),
            write_side(to_server_rx, server_sink, ends.cut),
            peer_writer,
        )
    };
    tokio::select! {
        // A cut drops both sockets here, without a close frame.
        _ = ends.cut.cancelled() => {}
        _ = run => {}
        _ = async {
            ends.closing.cancelled().await;
            tokio::time::sleep(CLOSE_LINGER).await;
        } => {}
    }
}

async fn read_side<St>(
    state: &Arc<State>,
    id: u64,
    dir: Dir,
    mut stream: St,
    tx: mpsc::UnboundedSender<Outgoing>,
    ends: &Ends<'_>,
) where
    St: Stream<Item = Result<Message, WsError>> + Unpin,
{
    // Once the peer is severed, the daemon's frames are read (so its pings are still
    // answered) and discarded.
    let send = |o: Outgoing| tx.send(o).is_ok() || ends.sever.is_cancelled();
    loop {
        let msg = match stream.next().await {
            Some(Ok(m)) => m,
            Some(Err(e)) => {
                debug!(conn = id, ?dir, "proxied connection failed: {e}");
                ends.cut.cancel();
                return;
            }
            None => {
                // The socket ended without a close handshake: end the other side the
                // same way.
                ends.cut.cancel();
                return;
            }
        };
        match msg {
            Message::Text(text) => {
                let value: Option<Value> = serde_json::from_str(text.as_str()).ok();
                if dir == Dir::ToServer {
                    note_hello(state, id, value.as_ref());
                }
                let fate = state.decide(dir, value.as_ref());
                let logged = value.unwrap_or_else(|| Value::String(text.as_str().to_string()));
                state.record(id, dir, logged, fate);
                let sent = match fate {
                    Fate::Forwarded => send(Outgoing::now(Message::Text(text))),
                    Fate::Dropped => true,
                    Fate::Duplicated => {
                        send(Outgoing::now(Message::Text(text.clone())))
                            && send(Outgoing::now(Message::Text(text)))
                    }
                    Fate::Delayed(by) => send(Outgoing {
                        msg: Message::Text(text),
                        not_before: Some(Instant::now() + by),
                    }),
                };
                if !sent {
                    return;
                }
            }
            Message::Close(frame) => {
                if !send(Outgoing::now(Message::Close(frame))) {
                    debug!(
                        conn = id,
                        "close frame not forwarded: the other side is gone"
                    );
                }
                ends.closing.cancel();
                return;
            }
            Message::Frame(_) => {}
            other => {
                // Binary, ping and pong: forwarded as they are.
                if !send(Outgoing::now(other)) {
                    return;
                }
            }
        }
    }
}

async fn write_side<Si>(
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    mut sink: Si,
    cut: &CancellationToken,
) where
    Si: futures_util::Sink<Message, Error = WsError> + Unpin,
{
    while let Some(out) = rx.recv().await {
        if let Some(at) = out.not_before {
            tokio::time::sleep_until(at).await;
        }
        let is_close = out.msg.is_close();
        if let Err(e) = sink.send(out.msg).await {
            debug!("proxy failed to write a frame: {e}");
            cut.cancel();
            return;
        }
        if is_close {
            return;
        }
    }
}

/// Remember the `worker_id` a connection's `hello` names, for [`ProxyHandle::cut_worker`].
fn note_hello(state: &State, id: u64, frame: Option<&Value>) {
    let Some(frame) = frame else { return };
    if frame.get("op").and_then(Value::as_str) != Some("hello") {
        return;
    }
    if let Some(w) = frame.pointer("/args/worker_id").and_then(Value::as_str) {
        if let Some(c) = lock(&state.conns).get_mut(&id) {
            c.worker_id = Some(w.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn matchers() {
        let result =
            json!({"id": 3, "op": "invocation.result", "args": {"invocation_id": "inv_1"}});
        let invoke = json!({"push": "invoke", "invocation_id": "inv_1"});
        let ack = json!({"id": 3, "ok": {"accepted": "applied"}});
        assert!(Match::op("invocation.result").matches(&result));
        assert!(!Match::op("invocation.result").matches(&invoke));
        assert!(Match::push("invoke").matches(&invoke));
        assert!(Match::invocation("inv_1").matches(&result));
        assert!(Match::invocation("inv_1").matches(&invoke));
        assert!(!Match::invocation("inv_2").matches(&invoke));
        assert!(Match::response().matches(&ack));
        assert!(!Match::response().matches(&result));
        assert!(Match::field("/ok/accepted", json!("applied")).matches(&ack));
        assert!(Match::push("probe")
            .or(Match::push("invoke"))
            .matches(&invoke));
        assert!(!Match::push("probe")
            .and(Match::push("invoke"))
            .matches(&invoke));
    }
}
