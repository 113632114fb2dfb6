//! The read-only operator page on the admin listener, under `/ui`: HTML rendered here
//! with maud (every value escaped), a little inline JavaScript for the live event
//! feed (server-sent events from the session's event stream), nothing fetched from
//! elsewhere.
//!
//! Screens: `/ui` (overview), `/ui/sessions` (the `sessions.list` view with its
//! filters), `/ui/session?id=` (what the lock holder is blocked on, the queue, the
//! event feed), `/ui/turn?id=` (steps and attempts as a timeline), `/ui/workers`
//! (workers and functions), `/ui/check` (runs `store.check`). With `[auth]` tokens
//! configured every screen needs an operator token: `Authorization: Bearer TOKEN`,
//! or the `HttpOnly` cookie set by the form at `/ui/login`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Form, Router};
use maud::{html, Markup, PreEscaped, DOCTYPE};
use serde_json::Value;
use turnd_engine::{fmt_utc, BlockedOn, Engine, EngineError, Outbox};
use turnd_proto::{
    new_connection_id, Event, EventKind, EventsArgs, Function, Role, SessionOrder, SessionRow,
    SessionsListArgs, SessionsListOk, Turn, WaitState, WatchArgs, Worker,
};

use crate::ws::Shared;

/// Rows of a sessions page, and of the oldest waits on the overview.
const PAGE_ROWS: u64 = 50;
const OVERVIEW_ROWS: u64 = 10;
/// Events shown when a session page loads (the feed then adds new ones).
const FEED_EVENTS: u64 = 50;
/// Longest input, output or error text shown before it is cut.
const MAX_VALUE_CHARS: usize = 2_000;
/// Events read for one turn's timeline at most.
const TIMELINE_MAX_EVENTS: usize = 10_000;
/// Frames a live feed may have queued before the browser is taken to be gone.
const FEED_QUEUE: usize = 1024;
const COOKIE: &str = "turnd_ui";

pub fn router() -> Router<Arc<Shared>> {
    Router::new()
        .route("/ui", get(overview))
        .route("/ui/", get(overview))
        .route("/ui/sessions", get(sessions))
        .route("/ui/session", get(session))
        .route("/ui/session/feed", get(feed))
        .route("/ui/turn", get(turn))
        .route("/ui/workers", get(workers))
        .route("/ui/check", get(check))
        .route("/ui/login", get(login_form).post(login))
}

type Params = Query<HashMap<String, String>>;

// ------------------------------------------------------------------ access

/// Whether the request carries an operator token (always, with no tokens configured).
fn authorized(s: &Shared, headers: &HeaderMap) -> bool {
    let tokens = &s.config.auth.tokens;
    if tokens.is_empty() {
        return true;
    }
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| t.trim().to_string());
    let cookie = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().strip_prefix(&format!("{COOKIE}=")).map(pct_decode));
    bearer
        .into_iter()
        .chain(cookie)
        .any(|given| operator_token(s, &given))
}

fn operator_token(s: &Shared, given: &str) -> bool {
    let mut ok = false;
    for t in &s.config.auth.tokens {
        // Compare against every token in constant time, whatever matches first.
        let eq = constant_time_eq::constant_time_eq(t.token.as_bytes(), given.as_bytes());
        ok |= eq && t.role == Role::Operator;
    }
    ok
}

fn login_page(status: StatusCode, message: Option<&str>) -> Response {
    let mut r = page(
        "Sign in",
        html! {
            h1 { "Sign in" }
            p { "This daemon has tokens configured: the page needs an operator token." }
            @if let Some(m) = message { p.bad { (m) } }
            form method="post" action="/ui/login" {
                label { "Operator token " input type="password" name="token" autocomplete="current-password"; }
                " " button type="submit" { "Sign in" }
            }
        },
    );
    *r.status_mut() = status;
    r
}

async fn login_form(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if authorized(&s, &headers) {
        return redirect("/ui");
    }
    login_page(StatusCode::OK, None)
}

async fn login(State(s): State<Arc<Shared>>, Form(f): Form<HashMap<String, String>>) -> Response {
    let token = f.get("token").map(String::as_str).unwrap_or("");
    if s.config.auth.tokens.is_empty() {
        return redirect("/ui");
    }
    if !operator_token(&s, token) {
        return login_page(
            StatusCode::UNAUTHORIZED,
            Some("That is not an operator token."),
        );
    }
    let cookie = format!(
        "{COOKIE}={}; Path=/ui; HttpOnly; SameSite=Strict",
        pct_encode(token)
    );
    let mut r = redirect("/ui");
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

fn redirect(to: &'static str) -> Response {
    (StatusCode::SEE_OTHER, [(header::LOCATION, to)]).into_response()
}

/// Refuse a request without an operator token.
macro_rules! guard {
    ($s:expr, $h:expr) => {
        if !authorized(&$s, &$h) {
            return login_page(StatusCode::UNAUTHORIZED, None);
        }
    };
}

// ------------------------------------------------------------------ helpers

/// Percent-encode everything but unreserved characters (for query values and the
/// cookie).
pub fn pct_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn pct_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = |c: u8| (c as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn session_href(id: &str) -> String {
    format!("/ui/session?id={}", pct_encode(id))
}

fn turn_href(id: &str) -> String {
    format!("/ui/turn?id={}", pct_encode(id))
}

fn ago(then: u64, now: u64) -> String {
    if then <= now {
        format!("{} ago", dur(now - then))
    } else {
        format!("in {}", dur(then - now))
    }
}

fn dur(ms: u64) -> String {
    if ms < 1_000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        format!("{:.1}s", ms as f64 / 1000.0)
    } else if ms < 3_600_000 {
        format!("{}m{:02}s", ms / 60_000, (ms / 1000) % 60)
    } else {
        format!("{}h{:02}m", ms / 3_600_000, (ms / 60_000) % 60)
    }
}

fn time(ms: u64, now: u64) -> Markup {
    html! { span title=(fmt_utc(ms)) { (ago(ms, now)) } }
}

/// A JSON value as text, cut to `MAX_VALUE_CHARS` with its size.
fn value_text(v: &Value) -> (String, usize, bool) {
    let text = serde_json::to_string_pretty(v).unwrap_or_else(|e| format!("<{e}>"));
    let size = serde_json::to_string(v).map(|t| t.len()).unwrap_or(0);
    if text.chars().count() > MAX_VALUE_CHARS {
        (text.chars().take(MAX_VALUE_CHARS).collect(), size, true)
    } else {
        (text, size, false)
    }
}

fn value_block(label: &str, v: &Value) -> Markup {
    let (text, size, cut) = value_text(v);
    html! {
        h3 { (label) " " span.muted { "(" (size) " bytes of JSON" @if cut { ", cut to " (MAX_VALUE_CHARS) " characters" } ")" } }
        pre.value { (text) }
    }
}

const STYLE: &str = r#"
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1d2b3a;color:#fff;padding:8px 16px;display:flex;gap:16px;align-items:center}
header a{color:#cde;text-decoration:none}header a:hover{text-decoration:underline}
header .brand{font-weight:bold;color:#fff}
main{padding:12px 16px}
table{border-collapse:collapse;margin:8px 0;background:#fff}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#eef}
td.num{text-align:right}
.bad{color:#b00020;font-weight:bold}.ok{color:#17702a;font-weight:bold}
.muted{color:#777;font-weight:normal}
.card{background:#fff;border:1px solid #ccd;border-radius:6px;padding:8px 16px;margin:8px 0;max-width:1100px}
.card dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px;margin:0}
.card dt{color:#555}
.stuck{background:#fff1f1}
pre.value{background:#fff;border:1px solid #ddd;padding:6px;max-height:320px;overflow:auto;white-space:pre-wrap;word-break:break-all}
.filters a{margin-right:8px}
.counts span{margin-right:12px}
"#;

/// Appends each event of the live feed to the events table, as text.
const FEED_JS: &str = r#"
(function () {
  var feed = document.getElementById('feed');
  if (!feed || !window.EventSource) { return; }
  var body = feed.querySelector('tbody');
  var status = document.getElementById('feed-status');
  var url = '/ui/session/feed?id=' + encodeURIComponent(feed.dataset.session) +
    '&after=' + encodeURIComponent(feed.dataset.after);
  var es = new EventSource(url);
  es.onopen = function () { status.textContent = 'live'; };
  es.onerror = function () { status.textContent = 'reconnecting'; };
  es.onmessage = function (m) {
    var e;
    try { e = JSON.parse(m.data); } catch (x) { return; }
    var tr = document.createElement('tr');
    tr.className = 'live-event';
    var cells = [String(e.seq), new Date(e.at_ms).toISOString(), e.turn_id, e.kind,
      JSON.stringify(e.detail)];
    for (var i = 0; i < cells.length; i++) {
      var td = document.createElement('td');
      td.textContent = cells[i];
      tr.appendChild(td);
    }
    body.appendChild(tr);
    feed.dataset.after = String(e.seq);
  };
})();
"#;

fn layout(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { "turnd · " (title) }
                style { (PreEscaped(STYLE)) }
            }
            body {
                header {
                    a.brand href="/ui" { "turnd" }
                    a href="/ui" { "Overview" }
                    a href="/ui/sessions" { "Sessions" }
                    a href="/ui/sessions?stuck=1" { "Stuck" }
                    a href="/ui/workers" { "Workers & functions" }
                }
                main { (body) }
            }
        }
    }
}

fn page(title: &str, body: Markup) -> Response {
    let mut r = layout(title, body).into_string().into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn error_page(status: StatusCode, title: &str, message: &str) -> Response {
    let mut r = page(title, html! { h1 { (title) } p.bad { (message) } });
    *r.status_mut() = status;
    r
}

fn counts_line(counts: &std::collections::BTreeMap<String, u64>, base: &str) -> Markup {
    html! {
        p.counts {
            @if counts.is_empty() { span.muted { "no session is waiting" } }
            @for st in WaitState::ALL {
                @if let Some(n) = counts.get(st.as_str()) {
                    span { a href=(format!("{base}state={}", st.as_str())) { (st.as_str()) } ": " strong.count { (n) } }
                }
            }
        }
    }
}

fn sessions_table(rows: &[SessionRow], now: u64) -> Markup {
    html! {
        table #sessions {
            thead { tr {
                th { "Session" } th { "State" } th { "Waiting" } th { "Function" }
                th { "Attempt" } th { "Queued" } th { "Deadline" } th { "Holder turn" } th { "Reason" }
            } }
            tbody {
                @for r in rows {
                    tr class=(if r.stuck { "stuck" } else { "" }) data-session=(r.session_id) {
                        td { a href=(session_href(&r.session_id)) { (r.session_id) } }
                        td { (r.wait.state.as_str()) @if r.stuck { " " span.bad { "stuck" } } }
                        td { (dur(now.saturating_sub(r.wait.since_ms))) }
                        td { (r.function_id) }
                        td.num { (r.attempt) }
                        td.num { (r.queued) }
                        td {
                            @match r.wait.deadline_ms {
                                Some(d) => { (time(d, now)) @if let Some(o) = r.wait.on_deadline { ", then " (on_deadline(o)) } }
                                None => { "none" }
                            }
                        }
                        td { a href=(turn_href(&r.turn_id)) { (r.turn_id) } }
                        td { (r.wait.reason) }
                    }
                }
            }
        }
    }
}

fn on_deadline(o: turnd_proto::OnDeadline) -> &'static str {
    use turnd_proto::OnDeadline::*;
    match o {
        Probe => "probe",
        Redispatch => "redispatch",
        Fail => "fail",
        Cancel => "cancel",
        Retry => "retry",
    }
}

// ------------------------------------------------------------------ screens

async fn overview(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    guard!(s, headers);
    let e = &s.engine;
    let now = e.now_ms();
    let list = match e
        .list_sessions(SessionsListArgs {
            limit: Some(OVERVIEW_ROWS),
            ..Default::default()
        })
        .await
    {
        Ok(l) => l,
        Err(x) => return error_page(StatusCode::SERVICE_UNAVAILABLE, "Overview", &x.to_string()),
    };
    let health = e.storage_health();
    let ready = e.ready() && !s.draining.is_cancelled();
    let workers = e.workers();
    let connected = workers.iter().filter(|w| w.connected).count();
    let turns = e.turn_counts();
    page(
        "Overview",
        html! {
            h1 { "Overview" }
            div.card { dl {
                dt { "Version" } dd #version { "turnd " (env!("CARGO_PKG_VERSION")) " (boot " (e.boot_id()) ")" }
                dt { "Readiness" } dd #readiness {
                    @if ready { span.ok { "ready" } }
                    @else if s.draining.is_cancelled() { span.bad { "shutting down" } }
                    @else { span.bad { "not ready" } }
                }
                dt { "Storage" } dd #storage {
                    @if health.writable { span.ok { "writable" } }
                    @else { span.bad { "NOT WRITABLE" } ": " (health.last_error.as_deref().unwrap_or("")) }
                    " · " a href="/ui/check" { "run store.check" }
                }
                dt { "Sessions with unfinished turns" } dd #active { (list.total) }
                dt { "Oldest wait" } dd #oldest {
                    @match list.sessions.first() {
                        Some(r) => { (dur(now.saturating_sub(r.wait.since_ms))) " — " a href=(session_href(&r.session_id)) { (r.session_id) } " (" (r.wait.state.as_str()) ")" }
                        None => { "none" }
                    }
                }
                dt { "Turns" } dd { "queued " (turns.queued) ", running " (turns.running) ", completed " (turns.completed) ", failed " (turns.failed) ", cancelled " (turns.cancelled) }
                dt { "Workers" } dd #workers { (connected) " connected of " (workers.len()) " known · " a href="/ui/workers" { "details" } }
            } }
            h2 { "Sessions by wait state" }
            (counts_line(&list.counts, "/ui/sessions?"))
            h2 { "Oldest waits" }
            (sessions_table(&list.sessions, now))
            @if list.total > list.sessions.len() as u64 { p { a href="/ui/sessions" { "all " (list.total) " sessions" } } }
        },
    )
}

async fn sessions(State(s): State<Arc<Shared>>, headers: HeaderMap, Query(q): Params) -> Response {
    guard!(s, headers);
    let state = match q.get("state").filter(|v| !v.is_empty()) {
        Some(v) => match WaitState::ALL.into_iter().find(|w| w.as_str() == v) {
            Some(w) => Some(w),
            None => return error_page(StatusCode::BAD_REQUEST, "Sessions", "no such wait state"),
        },
        None => None,
    };
    let function_id = q.get("function").filter(|v| !v.is_empty()).cloned();
    let stuck = q.get("stuck").is_some_and(|v| v == "1");
    let by_id = q.get("order").is_some_and(|v| v == "id");
    let args = SessionsListArgs {
        state,
        function_id: function_id.clone(),
        stuck: stuck.then_some(true),
        order: Some(if by_id {
            SessionOrder::Id
        } else {
            SessionOrder::Wait
        }),
        limit: Some(PAGE_ROWS),
        after: q.get("after").filter(|v| !v.is_empty()).cloned(),
    };
    let list: SessionsListOk = match s.engine.list_sessions(args).await {
        Ok(l) => l,
        Err(x) => return error_page(StatusCode::BAD_REQUEST, "Sessions", &x.to_string()),
    };
    let now = s.engine.now_ms();
    // The query string of this view without the cursor, for links.
    let mut base = String::new();
    if let Some(f) = &function_id {
        base.push_str(&format!("function={}&", pct_encode(f)));
    }
    if stuck {
        base.push_str("stuck=1&");
    }
    if by_id {
        base.push_str("order=id&");
    }
    let mut this = base.clone();
    if let Some(st) = state {
        this.push_str(&format!("state={}&", st.as_str()));
    }
    page(
        "Sessions",
        html! {
            h1 { "Sessions" @if stuck { " that look stuck" } }
            p.filters {
                "Filters: "
                a href="/ui/sessions" { "all" }
                a href="/ui/sessions?stuck=1" { "stuck" }
                @if let Some(f) = &function_id { span { "function " strong { (f) } } }
                @if let Some(st) = state { span { "state " strong { (st.as_str()) } } }
                " · order: "
                @if by_id { a href=(format!("/ui/sessions?{}", this.replace("order=id&", ""))) { "oldest wait first" } " | by id" }
                @else { "oldest wait first | " a href=(format!("/ui/sessions?{this}order=id")) { "by id" } }
            }
            @if stuck { p.muted { "Stuck: past the wait's deadline, waiting for a function no connected worker serves, or an invocation with no heartbeat for more than half its timeout." } }
            (counts_line(&list.counts, &format!("/ui/sessions?{base}")))
            p #total { strong { (list.total) } " matching session(s); showing " (list.sessions.len()) }
            (sessions_table(&list.sessions, now))
            @if let Some(next) = &list.next {
                p { a #next href=(format!("/ui/sessions?{this}after={}", pct_encode(next))) { "next page" } }
            }
        },
    )
}

async fn session(State(s): State<Arc<Shared>>, headers: HeaderMap, Query(q): Params) -> Response {
    guard!(s, headers);
    let Some(id) = q.get("id").cloned() else {
        return error_page(StatusCode::BAD_REQUEST, "Session", "no session id given");
    };
    let e = &s.engine;
    let now = e.now_ms();
    let inspected = match e.inspect(&id).await {
        Ok(x) => x,
        Err(x) => return error_page(StatusCode::NOT_FOUND, "Session", &x.to_string()),
    };
    let blocked = match e.blocked_on(&id).await {
        Ok(b) => b,
        Err(x) => return error_page(StatusCode::SERVICE_UNAVAILABLE, "Session", &x.to_string()),
    };
    let last = inspected.last_event;
    let from = last.saturating_sub(FEED_EVENTS);
    let events = match e
        .events(EventsArgs {
            session_id: id.clone(),
            after: Some(from),
            limit: Some(FEED_EVENTS),
        })
        .await
    {
        Ok(x) => x.events,
        Err(x) => return error_page(StatusCode::SERVICE_UNAVAILABLE, "Session", &x.to_string()),
    };
    let after = events.last().map(|e| e.seq).unwrap_or(from);
    page(
        "Session",
        html! {
            h1 { "Session " span #session-id { (id) } }
            p { "Turns: queued " (inspected.turns.queued) ", running " (inspected.turns.running) ", completed " (inspected.turns.completed) ", failed " (inspected.turns.failed) ", cancelled " (inspected.turns.cancelled) }
            (blocked_card(blocked.as_ref(), now))
            h2 { "Queue (" (inspected.queued.len()) " behind the holder)" }
            table #queue {
                thead { tr { th { "Seq" } th { "Turn" } th { "Function" } th { "Created" } } }
                tbody { @for q in &inspected.queued { tr {
                    td.num { (q.seq) } td { a href=(turn_href(&q.turn_id)) { (q.turn_id) } } td { (q.function_id) } td { (time(q.created_at_ms, now)) }
                } } }
            }
            h2 { "Events " span #feed-status.muted { "(loading the live feed)" } }
            table #feed data-session=(id) data-after=(after) {
                thead { tr { th { "Seq" } th { "At" } th { "Turn" } th { "Kind" } th { "Detail" } } }
                tbody { @for ev in &events { (event_row(ev)) } }
            }
            script { (PreEscaped(FEED_JS)) }
        },
    )
}

/// The session page's card of what the lock holder is blocked on.
fn blocked_card(blocked: Option<&BlockedOn>, now: u64) -> Markup {
    html! {
        div.card #blocked-on {
            h2 { "Blocked on" }
            @match blocked {
                None => { p { "Nothing: the session has no unfinished turn." } }
                Some(b) => {
                    @let t = &b.turn;
                    dl {
                        dt { "Turn" } dd { a href=(turn_href(&t.turn_id)) { (t.turn_id) } " (" (t.function_id) ", " (t.status.as_str()) ", step " (t.step) ")" }
                        dt { "Holds the lock since" } dd { (time(b.locked_since_ms, now)) }
                        @if let Some(w) = &t.wait {
                            dt { "Wait" } dd.wait-state { (w.state.as_str()) " since " (time(w.since_ms, now)) }
                            dt { "Reason" } dd { (w.reason) }
                            dt { "Deadline" } dd {
                                @match w.deadline_ms {
                                    Some(d) => { (time(d, now)) @if let Some(o) = w.on_deadline { ", then " strong { (on_deadline(o)) } } }
                                    None => { "none (waits until something changes)" }
                                }
                            }
                        }
                        dt { "Attempt" } dd { (t.attempt) }
                        @if let Some(inv) = &b.invocation {
                            dt { "Invocation" } dd { (inv.invocation_id) }
                            dt { "Worker" } dd { (inv.worker_id) " (instance " (inv.instance_id) ")" }
                            dt { "Running since" } dd { (time(inv.dispatched_at_ms, now)) " (timeout " (dur(inv.timeout_ms)) ")" }
                            dt { "Last heartbeat" } dd { @match inv.last_heartbeat_ms { Some(h) => { (time(h, now)) } None => { "none since the dispatch" } } }
                        }
                        dt { "Last failure" } dd { @match &b.last_failure { Some(f) => { (f) } None => { "none" } } }
                    }
                }
            }
        }
    }
}

/// An event kind as the protocol spells it.
fn kind(k: EventKind) -> String {
    serde_json::to_value(k)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default()
}

fn event_row(ev: &Event) -> Markup {
    html! {
        tr {
            td.num { (ev.seq) } td { (fmt_utc(ev.at_ms)) }
            td { a href=(turn_href(&ev.turn_id)) { (ev.turn_id) } }
            td { (kind(ev.kind)) }
            td { (serde_json::to_string(&ev.detail).unwrap_or_default()) }
        }
    }
}

/// Server-sent events: every new event of the session after `after`, as the
/// protocol's Event JSON.
async fn feed(State(s): State<Arc<Shared>>, headers: HeaderMap, Query(q): Params) -> Response {
    guard!(s, headers);
    let Some(id) = q.get("id").cloned() else {
        return error_page(StatusCode::BAD_REQUEST, "Feed", "no session id given");
    };
    let after = match q.get("after").map(|a| a.parse::<u64>()) {
        Some(Ok(a)) => a,
        Some(Err(_)) => return error_page(StatusCode::BAD_REQUEST, "Feed", "bad `after`"),
        None => 0,
    };
    // A browser that reconnects sends the id of the last event it got: resume there,
    // so that no event is shown twice.
    let after = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(after, |last| last.max(after));
    let (outbox, rx) = Outbox::new(new_connection_id(), FEED_QUEUE);
    let args = WatchArgs {
        session_id: Some(id),
        turn_id: None,
        after: Some(after),
    };
    // The watch replays stored events as the feed takes them, so it runs beside the
    // stream; its answer (accepted, or why not) comes first.
    let (began_tx, mut began) = tokio::sync::mpsc::channel::<Result<(), String>>(2);
    let accepted = began_tx.clone();
    let (engine, watch_outbox) = (s.engine.clone(), outbox.clone());
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
        Some(Ok(())) => {}
        Some(Err(m)) => return error_page(StatusCode::BAD_REQUEST, "Feed", &m),
        None => return error_page(StatusCode::BAD_REQUEST, "Feed", "the watch ended"),
    }
    let closing = s.closing.clone();
    let guard = FeedGuard {
        engine: s.engine.clone(),
        conn_id: outbox.conn_id.clone(),
    };
    let stream = futures_util::stream::unfold(
        (rx, outbox, closing, guard),
        |(mut rx, outbox, closing, guard)| async move {
            loop {
                let frame = tokio::select! {
                    f = rx.recv() => f?,
                    _ = outbox.closed() => return None,
                    _ = closing.cancelled() => return None,
                };
                let Ok(v) = serde_json::from_str::<Value>(&frame) else {
                    continue;
                };
                if v.get("push").and_then(Value::as_str) != Some("event") {
                    continue;
                }
                let Some(ev) = v.get("event") else { continue };
                let seq = ev.get("seq").and_then(Value::as_u64).unwrap_or(0);
                let item = SseEvent::default().id(seq.to_string()).data(ev.to_string());
                return Some((
                    Ok::<SseEvent, Infallible>(item),
                    (rx, outbox, closing, guard),
                ));
            }
        },
    );
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

/// Drops the feed's watch when the browser goes away.
struct FeedGuard {
    engine: turnd_engine::Engine,
    conn_id: String,
}

impl Drop for FeedGuard {
    fn drop(&mut self) {
        self.engine.connection_closed(&self.conn_id);
    }
}

/// The turn's events, from the session's stream: up to its terminal event, reading
/// at most `TIMELINE_MAX_EVENTS` of the session's.
async fn turn_timeline(e: &Engine, t: &Turn) -> Result<Vec<Event>, EngineError> {
    let mut timeline = Vec::new();
    let mut after = 0;
    let mut read = 0;
    loop {
        let page = e
            .events(EventsArgs {
                session_id: t.session_id.clone(),
                after: Some(after),
                limit: Some(1000),
            })
            .await?;
        if page.events.is_empty() {
            break;
        }
        read += page.events.len();
        after = page.next;
        let mut ended = false;
        for ev in page.events {
            if ev.turn_id == t.turn_id {
                ended |= matches!(
                    ev.kind,
                    EventKind::Completed | EventKind::Failed | EventKind::Cancelled
                ) && t.status.is_terminal();
                timeline.push(ev);
            }
        }
        if ended || read >= TIMELINE_MAX_EVENTS {
            break;
        }
    }
    Ok(timeline)
}

async fn turn(State(s): State<Arc<Shared>>, headers: HeaderMap, Query(q): Params) -> Response {
    guard!(s, headers);
    let Some(id) = q.get("id").cloned() else {
        return error_page(StatusCode::BAD_REQUEST, "Turn", "no turn id given");
    };
    let e = &s.engine;
    let now = e.now_ms();
    let t: Turn = match e.get_turn(&id).await {
        Ok(t) => t,
        Err(x) => return error_page(StatusCode::NOT_FOUND, "Turn", &x.to_string()),
    };
    let timeline = match turn_timeline(e, &t).await {
        Ok(events) => events,
        Err(x) => return error_page(StatusCode::SERVICE_UNAVAILABLE, "Turn", &x.to_string()),
    };
    page(
        "Turn",
        html! {
            h1 { "Turn " span #turn-id { (t.turn_id) } }
            div.card { dl {
                dt { "Session" } dd { a href=(session_href(&t.session_id)) { (t.session_id) } " (seq " (t.seq) ")" }
                dt { "Function" } dd { (t.function_id) }
                dt { "Status" } dd #status { (t.status.as_str()) }
                dt { "Step / attempt" } dd { (t.step) " / " (t.attempt) }
                dt { "Created" } dd { (time(t.created_at_ms, now)) }
                @if let Some(f) = t.finished_at_ms { dt { "Finished" } dd { (time(f, now)) } }
                dt { "Recovered" } dd #recovered { (if t.recovered { "yes (its outcome was decided after a restart or a lost result)" } else { "no" }) }
                @if let Some(w) = &t.wait {
                    dt { "Wait" } dd { (w.state.as_str()) ": " (w.reason) }
                }
                @if let Some(err) = &t.error {
                    dt { "Error" } dd #error.bad { (err.cause.as_str()) ": " (err.code) " — " (err.message) " (step " (err.step) @if let Some(i) = &err.invocation_id { ", " (i) } ")" }
                }
                @if let Some(st) = &t.stop {
                    dt { "Stop" } dd { (st.reason) " (" (time(st.requested_at_ms, now)) ")" }
                }
            } }
            h2 { "Timeline" }
            table #timeline {
                thead { tr { th { "Seq" } th { "At" } th { "Event" } th { "Step" } th { "Attempt" } th { "Detail" } } }
                tbody { @for ev in &timeline {
                    tr class=(kind(ev.kind)) {
                        td.num { (ev.seq) } td { (fmt_utc(ev.at_ms)) } td { (kind(ev.kind)) }
                        td.num { (ev.detail.get("step").map(|v| v.to_string()).unwrap_or_default()) }
                        td.num { (ev.detail.get("attempt").map(|v| v.to_string()).unwrap_or_default()) }
                        td { (serde_json::to_string(&ev.detail).unwrap_or_default()) }
                    }
                } }
            }
            p.muted { "Heartbeats are not events: the session page shows the live invocation's last heartbeat." }
            (value_block("Input", &t.input))
            @if let Some(o) = &t.output { (value_block("Output", o)) }
        },
    )
}

async fn workers(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    guard!(s, headers);
    let now = s.engine.now_ms();
    let ws: Vec<Worker> = s.engine.workers();
    let fs: Vec<Function> = s.engine.functions();
    page(
        "Workers & functions",
        html! {
            h1 { "Workers" }
            table #workers {
                thead { tr { th { "Worker" } th { "Name" } th { "State" } th { "Since" } th { "Instance" } th { "In flight / concurrency" } th { "Functions" } } }
                tbody { @for w in &ws {
                    @let capacity: u64 = fs.iter().filter(|f| w.functions.contains(&f.function_id)).map(|f| u64::from(f.concurrency)).sum();
                    tr {
                        td { (w.worker_id) } td { (w.name) }
                        td { @if w.connected { span.ok { "connected" } } @else { span.bad { "disconnected" } } }
                        td { (time(w.since_ms, now)) } td { (w.instance_id) }
                        td.num { (w.inflight) " / " (capacity) }
                        td { (w.functions.join(", ")) }
                    }
                } }
            }
            h1 { "Functions" }
            table #functions {
                thead { tr { th { "Function" } th { "Workers" } th { "Sessions waiting" } th { "Concurrency" } th { "Timeout" } th { "Delivery" } th { "Max attempts" } } }
                tbody { @for f in &fs {
                    @let orphan = f.queued > 0 && f.workers == 0;
                    tr class=(if orphan { "stuck" } else { "" }) {
                        td { a href=(format!("/ui/sessions?function={}", pct_encode(&f.function_id))) { (f.function_id) } }
                        td.num { (f.workers) }
                        td.num { (f.queued) @if orphan { " " span.bad.no-worker { "no worker" } } }
                        td.num { (f.concurrency) }
                        td { @if f.timeout_ms == 0 { "-" } @else { (dur(f.timeout_ms)) } }
                        td { (serde_json::to_value(f.delivery).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default()) }
                        td.num { (f.max_attempts) }
                    }
                } }
            }
        },
    )
}

async fn check(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    guard!(s, headers);
    let engine = s.engine.clone();
    let started = tokio::time::Instant::now();
    let result = tokio::task::spawn_blocking(move || engine.check()).await;
    let took = started.elapsed();
    let vs = match result {
        Ok(Ok(v)) => v,
        Ok(Err(x)) => {
            return error_page(
                StatusCode::SERVICE_UNAVAILABLE,
                "store.check",
                &x.to_string(),
            )
        }
        Err(j) => {
            return error_page(
                StatusCode::INTERNAL_SERVER_ERROR,
                "store.check",
                &format!("the check task failed: {j}"),
            )
        }
    };
    page(
        "store.check",
        html! {
            h1 { "store.check" }
            p #check-result {
                @if vs.is_empty() { span.ok { "no violations" } } @else { span.bad { (vs.len()) " violation(s)" } }
                " (" (dur(took.as_millis() as u64)) ")"
            }
            @if !vs.is_empty() {
                table { thead { tr { th { "Invariant" } th { "Session" } th { "Turn" } th { "Detail" } } }
                tbody { @for v in &vs { tr {
                    td { (v.invariant) } td { (v.session_id.as_deref().unwrap_or("-")) } td { (v.turn_id.as_deref().unwrap_or("-")) } td { (v.detail) }
                } } } }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_encoding_round_trips() {
        for s in ["plain", "a b/c?d=e&f#g", "<script>", "ünï", "%41", "x%"] {
            assert_eq!(pct_decode(&pct_encode(s)), s, "{s}");
        }
        assert_eq!(pct_encode("a b&"), "a%20b%26");
    }
}
