//! One session: what its lock holder is blocked on (and why it looks stuck), the
//! queue behind it, its turns with the worker that ran each (failed and cancelled
//! ones included, paged), and its events, the newest followed live and older ones
//! paged. It reads the engine directly (what the holder is blocked on, which
//! worker ran each turn, a watch of its events): on a node of a cluster, the
//! engine of the session's partition when the node leads it.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use maud::{html, Markup};
use turnd_engine::{fmt_utc, BlockedOn, Engine, TurnRun, TurnRuns};
use turnd_proto::{Event, EventKind, EventsArgs, ListArgs, Session};

use super::live::{query_string, region};
use super::render::{dur, empty_row, on_deadline, page, pct_encode, time, turn_href, Now};
use super::{Failure, Params, Ui};

/// Turns of a page of the session's turns table.
const TURN_ROWS: u64 = 20;
/// Events of a page of the events table (the newest page then follows new ones).
const EVENT_ROWS: u64 = 50;

fn session_id(q: &Params) -> Result<&str, Failure> {
    q.get("id")
        .map(String::as_str)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| Failure::new(StatusCode::BAD_REQUEST, "Session", "no session id given"))
}

/// An optional sequence number parameter.
fn seq_param(q: &Params, name: &str) -> Result<Option<u64>, Failure> {
    match q.get(name).filter(|v| !v.is_empty()) {
        None => Ok(None),
        Some(v) => v.parse().map(Some).map_err(|_| {
            Failure::new(
                StatusCode::BAD_REQUEST,
                "Session",
                format!("`{name}` must be a sequence number"),
            )
        }),
    }
}

/// The session screen's live region: counts, the blocked-on card, the queue, turns.
pub async fn live_view(ui: &Ui, q: &Params, now: Now) -> Result<Markup, Failure> {
    let id = session_id(q)?;
    let turns_before = seq_param(q, "turns_before")?;
    let e = ui.session_engine("Session", id).await?;
    let fail = |x| Failure::from_engine("Session", x);
    let inspected = e.inspect(id).await.map_err(fail)?;
    let blocked = e.blocked_on(id).await.map_err(fail)?;
    let runs = e
        .turn_runs(ListArgs {
            session_id: id.to_string(),
            status: None,
            limit: Some(TURN_ROWS),
            before_seq: turns_before,
        })
        .await
        .map_err(fail)?;
    let c = &inspected.turns;
    Ok(html! {
        p #turn-counts { "Turns: queued " (c.queued) ", running " (c.running) ", completed " (c.completed) ", failed " (c.failed) ", cancelled " (c.cancelled) }
        (blocked_card(blocked.as_ref(), now))
        (queue_table(&inspected, now))
        (turns_table(id, &runs, turns_before, now))
    })
}

fn queue_table(s: &Session, now: Now) -> Markup {
    html! {
        h2 { "Queue (" (s.queued.len()) " behind the holder)" }
        table #queue {
            thead { tr { th { "Seq" } th { "Turn" } th { "Function" } th { "Created" } } }
            tbody {
                @if s.queued.is_empty() { (empty_row(4, "No turn is queued behind the holder.")) }
                @for t in &s.queued { tr {
                    td.num { (t.seq) } td { a href=(turn_href(&t.turn_id)) { (t.turn_id) } } td { (t.function_id) } td { (time(t.created_at_ms, now)) }
                } }
            }
        }
    }
}

/// What a turn's row says of how it ended, or of what it waits for.
fn outcome(r: &TurnRun) -> Markup {
    let t = &r.turn;
    html! {
        @if let Some(err) = &t.error {
            span.bad { (err.cause.as_str()) } ": " (err.code) " — " (err.message)
        } @else if let Some(st) = &t.stop {
            "stopped: " (st.reason)
        } @else if let Some(w) = &t.wait {
            (w.state.as_str())
        }
    }
}

fn turns_table(id: &str, runs: &TurnRuns, before: Option<u64>, now: Now) -> Markup {
    let base = format!("/ui/session?id={}", pct_encode(id));
    let newest = runs.turns.first().map(|r| r.turn.seq);
    html! {
        h2 { "Turns" span.muted { " (newest first)" } }
        table #turns {
            thead { tr {
                th { "Seq" } th { "Turn" } th { "Function" } th { "Status" } th { "Cause / wait" }
                th { "Worker" } th { "Step / attempt" } th { "Created" } th { "Finished" }
            } }
            tbody {
                @if runs.turns.is_empty() { (empty_row(9, "No turn on this page (older turns are deleted after retention.terminal_ms).")) }
                @for r in &runs.turns {
                    @let t = &r.turn;
                    tr class=(t.status.as_str()) {
                        td.num { (t.seq) }
                        td { a href=(turn_href(&t.turn_id)) { (t.turn_id) } }
                        td { (t.function_id) }
                        td.status { (t.status.as_str()) @if t.superseded { " (superseded)" } }
                        td.wrap { (outcome(r)) }
                        td { @match &r.worker_id { Some(w) => { (w) } None => { span.muted { "-" } } } }
                        td.num { (t.step) " / " (t.attempt) }
                        td { (time(t.created_at_ms, now)) }
                        td { @match t.finished_at_ms { Some(f) => { (time(f, now)) } None => { span.muted { "-" } } } }
                    }
                }
            }
        }
        p.paging {
            @if let Some(b) = before {
                a href=(base) { "newest" } " "
                a #turns-newer href=(format!("{base}&turns_before={}", b.saturating_add(TURN_ROWS))) { "← newer" } " "
            }
            @if let (Some(next), Some(_)) = (runs.next_before_seq, newest) {
                a #turns-older href=(format!("{base}&turns_before={next}")) { "older →" }
            }
        }
    }
}

/// The session page's card of what the lock holder is blocked on.
fn blocked_card(blocked: Option<&BlockedOn>, now: Now) -> Markup {
    html! {
        div.card #blocked-on {
            h2 { "Blocked on" }
            @match blocked {
                None => { p { "Nothing: the session has no unfinished turn." } }
                Some(b) => { (blocked_details(b, now)) }
            }
        }
    }
}

fn blocked_details(b: &BlockedOn, now: Now) -> Markup {
    let t = &b.turn;
    html! {
        @if let Some(why) = b.stuck {
            p.bad #stuck-why { "Looks stuck: " (why.describe()) "." }
        }
        dl {
            dt { "Turn" } dd { a href=(turn_href(&t.turn_id)) { (t.turn_id) } " (" (t.function_id) ", " (t.status.as_str()) ", step " (t.step) ")" }
            dt { "Holds the lock since" } dd { (time(b.locked_since_ms, now)) }
            @if let Some(w) = &t.wait {
                dt { "Wait" } dd.wait-state { (w.state.as_str()) " since " (time(w.since_ms, now)) }
                dt { "Reason" } dd.wrap { (w.reason) }
                dt { "Deadline" } dd {
                    @match w.deadline_ms {
                        Some(d) => { (time(d, now)) @if let Some(o) = w.on_deadline { ", then " strong { (on_deadline(o)) } } }
                        None => { "none (waits until something changes)" }
                    }
                }
            }
            @if let Some(p) = &t.progress {
                dt { "Progress" } dd #progress.wrap { "#" (p.seq) ": " (p.data.to_string()) " (" (time(p.at_ms, now)) ")" }
            }
            dt { "Attempt" } dd #attempt {
                (t.attempt)
                @if let Some(m) = b.max_attempts { " of " (m) }
                @if t.wait.as_ref().is_some_and(|w| w.state == turnd_proto::WaitState::BackingOff) {
                    " (backing off before attempt " (t.attempt + 1) ")"
                }
            }
            @if let Some(inv) = &b.invocation {
                dt { "Invocation" } dd { (inv.invocation_id) }
                dt { "Worker" } dd #worker { (inv.worker_id) " (instance " (inv.instance_id) ")" }
                dt { "Running since" } dd { (time(inv.dispatched_at_ms, now)) " (timeout " (dur(inv.timeout_ms)) ")" }
                dt { "Last heartbeat" } dd #heartbeat { @match inv.last_heartbeat_ms { Some(h) => { (time(h, now)) } None => { "none since the dispatch" } } }
            }
            dt { "Last failure" } dd.wrap { @match &b.last_failure { Some(f) => { (f) } None => { "none" } } }
        }
    }
}

/// An event kind as the protocol spells it.
pub fn kind(k: EventKind) -> String {
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
            td.wrap { (serde_json::to_string(&ev.detail).unwrap_or_default()) }
        }
    }
}

/// The events section: the newest page (followed live), or the page before
/// `events_before`.
async fn events_section(
    e: &Engine,
    id: &str,
    last: u64,
    before: Option<u64>,
) -> Result<(Markup, u64), Failure> {
    let end = before
        .unwrap_or(last.saturating_add(1))
        .min(last.saturating_add(1));
    let from = end.saturating_sub(EVENT_ROWS + 1);
    let events: Vec<Event> = e
        .events(EventsArgs {
            session_id: id.to_string(),
            after: Some(from),
            limit: Some(EVENT_ROWS),
        })
        .await
        .map_err(|x| Failure::from_engine("Session", x))?
        .events
        .into_iter()
        .filter(|e| e.seq < end)
        .collect();
    let after = events.last().map(|e| e.seq).unwrap_or(from);
    let base = format!("/ui/session?id={}", pct_encode(id));
    let live = before.is_none();
    let first = events.first().map(|e| e.seq).unwrap_or(end);
    let markup = html! {
        h2 { "Events " @if live { span #feed-status.muted { "(loading the live feed)" } } @else { span.muted { "(an older page)" } } }
        table #feed data-append=(if live { "1" } else { "0" }) {
            thead { tr { th { "Seq" } th { "At" } th { "Turn" } th { "Kind" } th { "Detail" } } }
            tbody {
                @if events.is_empty() { (empty_row(5, "No events on this page (older events are deleted with their turns).")) }
                @for ev in &events { (event_row(ev)) }
            }
        }
        p.paging {
            @if !live {
                a href=(base) { "newest" } " "
                a #events-newer href=(format!("{base}&events_before={}", end.saturating_add(EVENT_ROWS))) { "← newer" } " "
            }
            @if first > 1 {
                a #events-older href=(format!("{base}&events_before={first}")) { "older →" }
            }
        }
        p.muted { "Heartbeats are not events: the card above shows the live invocation's last heartbeat." }
    };
    Ok((markup, after))
}

pub async fn session(State(ui): State<Arc<Ui>>, Query(q): Query<Params>) -> Response {
    match session_page(&ui, &q).await {
        Ok(r) => r,
        Err(f) => f.page(&ui),
    }
}

async fn session_page(ui: &Ui, q: &Params) -> Result<Response, Failure> {
    let id = session_id(q)?;
    let e = ui.session_engine("Session", id).await?;
    let now = Now(Some(e.now_ms()));
    let events_before = seq_param(q, "events_before")?;
    let live = live_view(ui, q, now).await?;
    let last = e
        .inspect(id)
        .await
        .map_err(|x| Failure::from_engine("Session", x))?
        .last_event;
    let (events, after) = events_section(&e, id, last, events_before).await?;
    // The live region depends on the id and the turns page only.
    let mut live_q = q.clone();
    live_q.remove("events_before");
    let feed = format!("/ui/session/feed?{}&after={after}", query_string(&live_q));
    let body = html! {
        h1 { "Session " span #session-id { (id) } }
        (region(&feed, live))
        (events)
    };
    Ok(page(ui, "Session", body))
}
