//! One turn (its steps and attempts as a timeline, the workers that ran it, input,
//! output, error, stop), read through the protocol's `turn.get` and
//! `session.events` (on a node, from the turn's partition's leader), and the
//! workers and functions screen (on a node, the node's own registry).

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use maud::{html, Markup};
use turnd_engine::fmt_utc;
use turnd_proto::{
    Event, EventKind, EventsArgs, EventsOk, Function, Op, Turn, TurnIdArgs, TurnOk, Worker,
};

use super::live::{feed_url, region, Screen};
use super::render::{dur, empty_row, page, pct_encode, session_href, time, value_block, Now};
use super::session::kind;
use super::{Failure, Params, Ui};
use crate::backend::Backend;

/// Events read for one turn's timeline at most.
const TIMELINE_MAX_EVENTS: usize = 10_000;

/// The turn's events, from the session's stream: up to its terminal event, reading
/// at most `TIMELINE_MAX_EVENTS` of the session's (`session.events`, which a node
/// forwards to the session's partition's leader).
async fn turn_timeline(ui: &Ui, t: &Turn) -> Result<Vec<Event>, Failure> {
    let mut timeline = Vec::new();
    let mut after = 0;
    let mut read = 0;
    loop {
        let args = EventsArgs {
            session_id: t.session_id.clone(),
            after: Some(after),
            limit: Some(1000),
        };
        let page: EventsOk = ui.op("Turn", Op::SessionEvents, &args).await?;
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

/// The workers the timeline's dispatches went to, in order, each once.
fn workers_of(timeline: &[Event]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for ev in timeline {
        if matches!(ev.kind, EventKind::Dispatched | EventKind::Redispatched) {
            if let Some(w) = ev.detail.get("worker_id").and_then(|v| v.as_str()) {
                if !out.iter().any(|x| x == w) {
                    out.push(w.to_string());
                }
            }
        }
    }
    out
}

fn detail_num(ev: &Event, key: &str) -> String {
    ev.detail
        .get(key)
        .map(|v| v.to_string())
        .unwrap_or_default()
}

fn turn_card(t: &Turn, workers: &[String], now: Now) -> Markup {
    html! {
        div.card { dl {
            dt { "Session" } dd { a href=(session_href(&t.session_id)) { (t.session_id) } " (seq " (t.seq) ")" }
            dt { "Function" } dd { (t.function_id) }
            dt { "Status" } dd #status { (t.status.as_str()) @if t.superseded { span #superseded { " (superseded by a later message)" } } }
            dt { "Step / attempt" } dd { (t.step) " / " (t.attempt) }
            dt { "Worker" } dd #turn-workers {
                @if workers.is_empty() { "none yet (never dispatched)" } @else { (workers.join(", ")) }
            }
            dt { "Created" } dd { (time(t.created_at_ms, now)) }
            @if let Some(f) = t.finished_at_ms { dt { "Finished" } dd { (time(f, now)) } }
            dt { "Recovered" } dd #recovered { (if t.recovered { "yes (its outcome was decided after a restart or a lost result)" } else { "no" }) }
            @if let Some(w) = &t.wait {
                dt { "Wait" } dd.wrap { (w.state.as_str()) ": " (w.reason) }
            }
            @if let Some(r) = &t.input_request {
                dt { "Asks" } dd #input-request.wrap {
                    (r.prompt.as_ref().map_or("(no prompt)".to_string(), |p| p.as_str().map_or_else(|| p.to_string(), str::to_string)))
                    " — since " (time(r.since_ms, now))
                    @if let Some(d) = r.deadline_ms { ", until " (time(d, now)) ", then " (r.on_timeout.as_str()) }
                }
            }
            @if let Some(p) = &t.progress {
                dt { "Progress" } dd #progress.wrap { "#" (p.seq) " of step " (p.step) ": " (p.data.to_string()) " (" (time(p.at_ms, now)) ")" }
            }
            @if let Some(err) = &t.error {
                dt { "Error" } dd #error.bad.wrap { (err.cause.as_str()) ": " (err.code) " — " (err.message) " (step " (err.step) @if let Some(i) = &err.invocation_id { ", " (i) } ")" }
            }
            @if let Some(st) = &t.stop {
                dt { "Stop" } dd.wrap { (st.reason) " (" (time(st.requested_at_ms, now)) ")" }
            }
        } }
    }
}

pub async fn turn_view(ui: &Ui, q: &Params, now: Now) -> Result<Markup, Failure> {
    let Some(id) = q.get("id").filter(|s| !s.is_empty()) else {
        return Err(Failure::new(
            StatusCode::BAD_REQUEST,
            "Turn",
            "no turn id given",
        ));
    };
    let args = TurnIdArgs {
        turn_id: id.clone(),
    };
    let t: Turn = ui.op::<_, TurnOk>("Turn", Op::TurnGet, &args).await?.turn;
    let timeline = turn_timeline(ui, &t).await?;
    let workers = workers_of(&timeline);
    Ok(html! {
        h1 { "Turn " span #turn-id { (t.turn_id) } }
        (turn_card(&t, &workers, now))
        h2 { "Timeline" }
        table #timeline {
            thead { tr { th { "Seq" } th { "At" } th { "Event" } th { "Step" } th { "Attempt" } th { "Detail" } } }
            tbody {
                @if timeline.is_empty() { (empty_row(6, "No events are left of this turn.")) }
                @for ev in &timeline {
                    tr class=(kind(ev.kind)) {
                        td.num { (ev.seq) } td { (fmt_utc(ev.at_ms)) } td { (kind(ev.kind)) }
                        td.num { (detail_num(ev, "step")) }
                        td.num { (detail_num(ev, "attempt")) }
                        td.wrap { (serde_json::to_string(&ev.detail).unwrap_or_default()) }
                    }
                }
            }
        }
        p.muted { "Heartbeats are not events: the session page shows the live invocation's last heartbeat." }
        (value_block("Input", &t.input))
        @if let Some(o) = &t.output { (value_block("Output", o)) }
    })
}

pub async fn turn(State(ui): State<Arc<Ui>>, Query(q): Query<Params>) -> Response {
    let now = Now(Some(ui.now_ms()));
    match turn_view(&ui, &q, now).await {
        Ok(body) => page(&ui, "Turn", region(&feed_url(Screen::Turn, &q), body)),
        Err(f) => f.page(&ui),
    }
}

// ------------------------------------------------------------------ workers

fn workers_table(ws: &[Worker], fs: &[Function], now: Now) -> Markup {
    html! {
        table #workers {
            thead { tr { th { "Worker" } th { "Name" } th { "State" } th { "Since" } th { "Instance" } th { "In flight / concurrency" } th { "Functions" } } }
            tbody {
                @if ws.is_empty() { (empty_row(7, "No worker has connected since the daemon started.")) }
                @for w in ws {
                    @let capacity: u64 = fs.iter().filter(|f| w.functions.contains(&f.function_id)).map(|f| u64::from(f.concurrency)).sum();
                    tr {
                        td { (w.worker_id) } td { (w.name) }
                        td { @if w.connected { span.ok { "connected" } } @else { span.bad { "disconnected" } } }
                        td { (time(w.since_ms, now)) } td { (w.instance_id) }
                        td.num { (w.inflight) " / " (capacity) }
                        td.wrap { (w.functions.join(", ")) }
                    }
                }
            }
        }
    }
}

/// `node`: the daemon is a node of a cluster, whose registry counts the waiting
/// sessions of the partitions it leads only.
fn functions_table(fs: &[Function], node: bool) -> Markup {
    html! {
        table #functions {
            thead { tr { th { "Function" } th { "Workers" } th { @if node { "Sessions waiting (partitions led here)" } @else { "Sessions waiting" } } th { "Concurrency" } th { "Timeout" } th { "Delivery" } th { "Max attempts" } } }
            tbody {
                @if fs.is_empty() { (empty_row(7, "No function is registered and no turn waits for one.")) }
                @for f in fs {
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
                }
            }
        }
    }
}

/// The workers and functions the daemon knows. A node's registry is the node's
/// own: every worker connects to every node.
pub fn registry(ui: &Ui) -> (Vec<Worker>, Vec<Function>) {
    match &ui.shared.backend {
        Backend::Single(e) => (e.workers(), e.functions()),
        Backend::Cluster(n) => (n.workers().workers(), n.workers().functions()),
    }
}

pub fn workers_view(ui: &Ui, now: Now) -> Markup {
    let (ws, fs) = registry(ui);
    html! {
        h1 { "Workers" }
        (workers_table(&ws, &fs, now))
        h1 { "Functions" }
        (functions_table(&fs, ui.node().is_some()))
    }
}

pub async fn workers(State(ui): State<Arc<Ui>>) -> Response {
    let now = Now(Some(ui.now_ms()));
    let body = workers_view(&ui, now);
    page(
        &ui,
        "Workers & functions",
        region(&feed_url(Screen::Workers, &Params::new()), body),
    )
}
