//! The page's live feeds (server-sent events): every screen keeps one open, and its
//! live region is replaced by the fragment the feed sends (`event: refresh`) whenever
//! what it shows changed; a session page's feed also carries the session's new events
//! (default `message` events, each the protocol's Event JSON with its `seq` as the
//! SSE id, so that a reconnecting browser resumes after the last one it got).
//!
//! CPU stays bounded however many browsers watch: a screen (its path and query) is
//! rendered at most once a second, shared by every feed of that screen, and a feed
//! sends a fragment only when it differs from the last one it sent. Fragments carry
//! no relative times (the browser ticks them), so an idle screen sends nothing.
//! Feeds are capped in total and per client address, and each holds a permit that
//! it gives back when the browser goes away.

use std::collections::HashMap;
use std::convert::Infallible;
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use maud::{html, Markup};
use serde_json::Value;
use tokio::sync::mpsc::Receiver;
use turnd_engine::{Engine, Outbox};
use turnd_proto::{new_connection_id, WatchArgs};

use super::render::{error_page, Now};
use super::{screens, session, turn, Failure, Params, Ui};
use crate::admin::state::ClientAddr;

/// Frames a session feed may have queued before the browser is taken to be gone.
const FEED_QUEUE: usize = 1024;
/// A screen is rendered for the feeds at most this often.
const FRESH: Duration = Duration::from_secs(1);

/// A screen the page shows, by the name its live feed uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Screen {
    Overview,
    Sessions,
    Session,
    Turn,
    Workers,
    Cluster,
}

impl Screen {
    fn parse(s: &str) -> Option<Screen> {
        Some(match s {
            "overview" => Screen::Overview,
            "sessions" => Screen::Sessions,
            "session" => Screen::Session,
            "turn" => Screen::Turn,
            "workers" => Screen::Workers,
            "cluster" => Screen::Cluster,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Screen::Overview => "overview",
            Screen::Sessions => "sessions",
            Screen::Session => "session",
            Screen::Turn => "turn",
            Screen::Workers => "workers",
            Screen::Cluster => "cluster",
        }
    }
}

/// The live region of a screen as it stands.
pub async fn render(ui: &Ui, screen: Screen, q: &Params, now: Now) -> Result<Markup, Failure> {
    match screen {
        Screen::Overview => screens::overview_view(ui, now).await,
        Screen::Sessions => screens::sessions_view(ui, q, now).await,
        Screen::Session => session::live_view(ui, q, now).await,
        Screen::Turn => turn::turn_view(ui, q, now).await,
        Screen::Workers => Ok(turn::workers_view(ui, now)),
        Screen::Cluster => super::cluster::cluster_view(ui).await,
    }
}

/// A query string from parameters (sorted, percent-encoded).
pub fn query_string(q: &Params) -> String {
    q.iter()
        .map(|(k, v)| format!("{}={}", super::pct_encode(k), super::pct_encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// The live region of a screen: the fragment the feed at `feed` replaces.
pub fn region(feed: &str, body: Markup) -> Markup {
    html! { div #live data-feed=(feed) { (body) } }
}

/// The URL of a screen's live feed.
pub fn feed_url(screen: Screen, q: &Params) -> String {
    format!("/ui/live/{}?{}", screen.name(), query_string(q))
}

// ------------------------------------------------------------------ caps

/// Live feeds open, in total and per client address.
#[derive(Default)]
pub struct Feeds {
    open: Mutex<(u64, HashMap<IpAddr, u64>)>,
}

/// A feed's place under the caps, given back when the feed ends.
pub struct FeedPermit {
    ui: Arc<Ui>,
    ip: IpAddr,
}

impl Drop for FeedPermit {
    fn drop(&mut self) {
        let mut open = self
            .ui
            .feeds
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        open.0 = open.0.saturating_sub(1);
        if let Some(n) = open.1.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.1.remove(&self.ip);
            }
        }
    }
}

/// A place for one more feed of `ip`, or the answer that says why not.
fn open_feed(ui: &Arc<Ui>, ip: IpAddr) -> Result<FeedPermit, Failure> {
    let cfg = &ui.shared.config.admin;
    let mut open = ui.feeds.open.lock().unwrap_or_else(PoisonError::into_inner);
    let mine = open.1.get(&ip).copied().unwrap_or(0);
    let why = if mine >= cfg.max_feeds_per_client {
        format!(
            "this address already holds {mine} live feeds of the page (admin.max_feeds_per_client = {}): close other tabs of the page",
            cfg.max_feeds_per_client
        )
    } else if open.0 >= cfg.max_feeds {
        format!(
            "{} live feeds of the page are open (admin.max_feeds = {}): try again later",
            open.0, cfg.max_feeds
        )
    } else {
        open.0 += 1;
        *open.1.entry(ip).or_insert(0) += 1;
        return Ok(FeedPermit { ui: ui.clone(), ip });
    };
    Err(Failure::new(
        StatusCode::TOO_MANY_REQUESTS,
        "Live feed",
        why,
    ))
}

// ------------------------------------------------------------------ renders

/// A fragment as rendered, with its hash (so that a feed compares hashes, and a
/// screen's many feeds do not hash the same text again).
#[derive(Clone)]
struct Rendered {
    at: Instant,
    html: Arc<str>,
    hash: u64,
}

/// Fragments rendered for feeds in the last second, by screen and query.
#[derive(Default)]
pub struct Renders {
    map: Mutex<HashMap<String, Rendered>>,
}

impl Renders {
    fn fresh(&self, key: &str) -> Option<Rendered> {
        let map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        map.get(key).filter(|r| r.at.elapsed() < FRESH).cloned()
    }

    fn store(&self, key: String, r: Rendered) {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        // Screens nobody watches any more go; the map holds about one entry a feed.
        map.retain(|_, old| old.at.elapsed() < FRESH * 10);
        map.insert(key, r);
    }
}

/// The fragment of a feed's screen, from the shared renders when fresh.
async fn fragment(ui: &Ui, screen: Screen, q: &Params, key: &str) -> Rendered {
    if let Some(r) = ui.renders.fresh(key) {
        return r;
    }
    let markup = match render(ui, screen, q, Now(None)).await {
        Ok(m) => m,
        Err(f) => html! { p.bad { (f.title) ": " (f.message) } },
    };
    // A carriage return cannot travel in an SSE data field; in HTML it may be a
    // character reference.
    let html: Arc<str> = Arc::from(markup.into_string().replace('\r', "&#13;"));
    let mut h = std::hash::DefaultHasher::new();
    html.hash(&mut h);
    let r = Rendered {
        at: Instant::now(),
        html,
        hash: h.finish(),
    };
    ui.renders.store(key.to_string(), r.clone());
    r
}

// ------------------------------------------------------------------ feeds

/// What a feed holds while it is open.
struct Feed {
    ui: Arc<Ui>,
    screen: Screen,
    q: Params,
    key: String,
    last: Option<u64>,
    tick: tokio::time::Interval,
    events: Option<(Receiver<String>, Outbox, WatchGuard)>,
    _permit: FeedPermit,
}

impl Feed {
    fn new(ui: Arc<Ui>, screen: Screen, q: Params, permit: FeedPermit) -> Feed {
        let mut tick = tokio::time::interval(FRESH);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let key = format!("{}?{}", screen.name(), query_string(&q));
        Feed {
            ui,
            screen,
            q,
            key,
            last: None,
            tick,
            events: None,
            _permit: permit,
        }
    }

    /// The screen's fragment, when it differs from the last one sent.
    async fn refresh(&mut self) -> Option<SseEvent> {
        let r = fragment(&self.ui, self.screen, &self.q, &self.key).await;
        if self.last == Some(r.hash) {
            return None;
        }
        self.last = Some(r.hash);
        Some(SseEvent::default().event("refresh").data(&*r.html))
    }

    /// The next thing to send, or `None` when the feed ends.
    async fn next(&mut self) -> Option<SseEvent> {
        let closing = self.ui.shared.closing.clone();
        loop {
            let frame = async {
                match &mut self.events {
                    Some((rx, outbox, _)) => tokio::select! {
                        f = rx.recv() => f,
                        _ = outbox.closed() => None,
                    },
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = closing.cancelled() => return None,
                f = frame => {
                    if let Some(ev) = event_of(&f?) {
                        return Some(ev);
                    }
                }
                _ = self.tick.tick() => {
                    if let Some(ev) = self.refresh().await {
                        return Some(ev);
                    }
                }
            }
        }
    }

    fn respond(self) -> Response {
        let stream = futures_util::stream::unfold(self, |mut feed| async move {
            let ev = feed.next().await?;
            Some((Ok::<SseEvent, Infallible>(ev), feed))
        });
        Sse::new(stream)
            .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
            .into_response()
    }
}

/// A pushed frame as an SSE message, when it is an event.
fn event_of(frame: &str) -> Option<SseEvent> {
    let v = serde_json::from_str::<Value>(frame).ok()?;
    if v.get("push").and_then(Value::as_str) != Some("event") {
        return None;
    }
    let ev = v.get("event")?;
    let seq = ev.get("seq").and_then(Value::as_u64).unwrap_or(0);
    Some(SseEvent::default().id(seq.to_string()).data(ev.to_string()))
}

/// `/ui/live/{screen}`: the screen's fragments.
pub async fn live(
    State(ui): State<Arc<Ui>>,
    ConnectInfo(ClientAddr(peer)): ConnectInfo<ClientAddr>,
    Path(screen): Path<String>,
    Query(q): Query<Params>,
) -> Response {
    let Some(screen) = Screen::parse(&screen) else {
        return error_page(&ui, StatusCode::NOT_FOUND, "Live feed", "no such screen");
    };
    // A screen that cannot be shown (no such turn, say) gets no feed.
    if let Err(f) = render(&ui, screen, &q, Now(None)).await {
        return f.page(&ui);
    }
    let permit = match open_feed(&ui, peer.ip()) {
        Ok(p) => p,
        Err(f) => return f.page(&ui),
    };
    Feed::new(ui, screen, q, permit).respond()
}

/// `/ui/session/feed?id=S&after=SEQ`: the session's new events after `SEQ` (or the
/// browser's `Last-Event-ID`), and the session screen's fragments.
pub async fn session_feed(
    State(ui): State<Arc<Ui>>,
    ConnectInfo(ClientAddr(peer)): ConnectInfo<ClientAddr>,
    headers: HeaderMap,
    Query(mut q): Query<Params>,
) -> Response {
    let Some(id) = q.get("id").cloned() else {
        return error_page(&ui, StatusCode::BAD_REQUEST, "Feed", "no session id given");
    };
    let after = match q.remove("after").map(|a| a.parse::<u64>()) {
        Some(Ok(a)) => a,
        Some(Err(_)) => return error_page(&ui, StatusCode::BAD_REQUEST, "Feed", "bad `after`"),
        None => 0,
    };
    // A browser that reconnects sends the id of the last event it got: resume there,
    // so that no event is shown twice.
    let after = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(after, |last| last.max(after));
    let engine = match ui.session_engine("Feed", &id).await {
        Ok(e) => e,
        Err(f) => return f.page(&ui),
    };
    if let Err(x) = engine.inspect(&id).await {
        return Failure::from_engine("Feed", x).page(&ui);
    }
    let permit = match open_feed(&ui, peer.ip()) {
        Ok(p) => p,
        Err(f) => return f.page(&ui),
    };
    let events = match watch(&engine, id, after).await {
        Ok(e) => e,
        Err(m) => return error_page(&ui, StatusCode::BAD_REQUEST, "Feed", &m),
    };
    let mut feed = Feed::new(ui, Screen::Session, q, permit);
    feed.events = Some(events);
    feed.respond()
}

/// A watch of the session's events after `after`, feeding a queue of its own.
async fn watch(
    engine: &Engine,
    session_id: String,
    after: u64,
) -> Result<(Receiver<String>, Outbox, WatchGuard), String> {
    let (outbox, rx) = Outbox::new(new_connection_id(), FEED_QUEUE);
    let guard = WatchGuard {
        engine: engine.clone(),
        conn_id: outbox.conn_id.clone(),
    };
    let args = WatchArgs {
        session_id: Some(session_id),
        turn_id: None,
        after: Some(after),
        progress: false,
    };
    // The watch replays stored events as the feed takes them, so it runs beside the
    // stream; its answer (accepted, or why not) comes first.
    let (began_tx, mut began) = tokio::sync::mpsc::channel::<Result<(), String>>(2);
    let accepted = began_tx.clone();
    let (engine, watch_outbox) = (engine.clone(), outbox.clone());
    tokio::spawn(async move {
        let respond = move |_: &turnd_proto::WatchOk| {
            if accepted.try_send(Ok(())).is_err() {
                tracing::trace!("feed gone before its watch began");
            }
            String::new()
        };
        if let Err(x) = engine.watch(args, &watch_outbox, 1, respond).await {
            if began_tx.send(Err(x.to_string())).await.is_err() {
                tracing::trace!("feed gone before its watch was refused");
            }
        }
    });
    match began.recv().await {
        Some(Ok(())) => Ok((rx, outbox, guard)),
        Some(Err(m)) => Err(m),
        None => Err("the watch ended".into()),
    }
}

/// Drops the feed's watch when the browser goes away.
struct WatchGuard {
    engine: Engine,
    conn_id: String,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.engine.connection_closed(&self.conn_id);
    }
}
