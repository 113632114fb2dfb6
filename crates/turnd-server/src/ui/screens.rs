//! The overview, the sessions list and the go-to box: what is waiting, for how long,
//! on which worker, and why a session looks stuck (the engine's own rule, named).
//! On a node of a cluster the lists are `sessions.list` gathered from every
//! partition and the counts every partition's `stats` summed; a row then names
//! its worker but not its heartbeat or stuck rule (`turnd inspect` shows them).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use maud::{html, Markup};
use serde_json::json;
use turnd_engine::{RowDetail, SessionsPage};
use turnd_proto::{
    Op, SessionIdArgs, SessionOk, SessionOrder, SessionRow, SessionsListArgs, StatsOk,
    StorageHealth, TurnCounts, TurnIdArgs, TurnOk, WaitState,
};

use super::live::{feed_url, region, Screen};
use super::render::{
    age, empty_row, on_deadline, page, pct_encode, redirect, session_href, time, turn_href, Now,
};
use super::turn::registry;
use super::{Failure, Params, Ui};
use crate::backend::Backend;

/// Rows of a sessions page, and of the oldest waits on the overview.
const PAGE_ROWS: u64 = 50;
const OVERVIEW_ROWS: u64 = 10;

fn counts_line(counts: &BTreeMap<String, u64>, base: &str) -> Markup {
    html! {
        p.counts {
            @if counts.is_empty() { span.muted { "No session is waiting." } }
            @for st in WaitState::ALL {
                @if let Some(n) = counts.get(st.as_str()) {
                    span { a href=(format!("{base}state={}", st.as_str())) { (st.as_str()) } ": " strong.count { (n) } }
                }
            }
        }
    }
}

fn deadline_cell(r: &SessionRow, now: Now) -> Markup {
    html! {
        @match r.wait.deadline_ms {
            Some(d) => { (time(d, now)) @if let Some(o) = r.wait.on_deadline { ", then " (on_deadline(o)) } }
            None => { "none" }
        }
    }
}

fn session_row(r: &SessionRow, d: Option<&RowDetail>, now: Now) -> Markup {
    let inv = d.and_then(|d| d.invocation.as_ref());
    let why = d.and_then(|d| d.stuck);
    // Without the page's details (on a node), the row's own wait names the worker.
    let worker = inv.map(|i| &i.worker_id).or(r.wait.worker_id.as_ref());
    html! {
        tr class=(if r.stuck { "stuck" } else { "" }) data-session=(r.session_id) {
            td { a href=(session_href(&r.session_id)) { (r.session_id) } }
            td {
                (r.wait.state.as_str())
                @if r.stuck {
                    " " span.bad { "stuck" }
                    @if let Some(w) = why { br; span.why { (w.describe()) } }
                }
            }
            td { (age(r.wait.since_ms, now)) }
            td { (r.function_id) }
            td.num { (r.attempt) }
            td { @match worker { Some(w) => { (w) } None => { span.muted { "-" } } } }
            td { @match inv { Some(i) => { (age(i.last_sign_ms(), now)) } None => { span.muted { "-" } } } }
            td.num { (r.queued) }
            td { (deadline_cell(r, now)) }
            td { a href=(turn_href(&r.turn_id)) { (r.turn_id) } }
            td.wrap { (r.wait.reason) }
        }
    }
}

fn sessions_table(p: &SessionsPage, now: Now, empty: &str) -> Markup {
    html! {
        table #sessions {
            thead { tr {
                th { "Session" } th { "State" } th { "Waiting" } th { "Function" }
                th { "Attempt" } th { "Worker" } th title="since the invocation's last heartbeat, or its dispatch" { "Heartbeat" }
                th { "Queued" } th { "Deadline" } th { "Holder turn" } th { "Reason" }
            } }
            tbody {
                @if p.list.sessions.is_empty() { (empty_row(11, empty)) }
                @for (i, r) in p.list.sessions.iter().enumerate() {
                    (session_row(r, p.details.get(i), now))
                }
            }
        }
    }
}

/// What a node's lists leave out, said under them.
fn node_note(ui: &Ui) -> Markup {
    html! {
        @if ui.node().is_some() {
            p.muted #node-note { "On a node of a cluster these rows come from every partition's leader, without each invocation's heartbeat or the stuck rule's detail: " code { "turnd inspect SESSION" } " shows them." }
        }
    }
}

// ------------------------------------------------------------------ overview

/// The daemon's facts the overview shows beside its sessions.
struct Facts {
    /// Which daemon this is: its boot, and on a node the node's id.
    node: Option<String>,
    boot_id: String,
    ready: bool,
    storage: StorageHealth,
    turns: TurnCounts,
}

/// The facts of a daemon on its own (its engine), or of a node: its own state, and
/// what every partition's `stats` add up to.
async fn facts(ui: &Ui) -> Result<Facts, Failure> {
    let draining = ui.shared.draining.is_cancelled();
    match &ui.shared.backend {
        Backend::Single(e) => Ok(Facts {
            node: None,
            boot_id: e.boot_id().to_string(),
            ready: e.ready() && !draining,
            storage: e.storage_health(),
            turns: e.turn_counts(),
        }),
        Backend::Cluster(n) => {
            let stats: StatsOk = ui.op("Overview", Op::Stats, &json!({})).await?;
            Ok(Facts {
                node: Some(n.id().to_string()),
                boot_id: n.boot_id().to_string(),
                ready: !draining && !n.draining.is_cancelled(),
                storage: stats.stats.storage,
                turns: stats.stats.turns,
            })
        }
    }
}

/// A page of `sessions.list` with what the page adds to each row: from the engine
/// of a daemon on its own; on a node, gathered from every partition, with nothing
/// added (no row's invocation or stuck rule, and no cursor back).
async fn sessions_page(
    ui: &Ui,
    title: &'static str,
    args: SessionsListArgs,
) -> Result<SessionsPage, Failure> {
    match &ui.shared.backend {
        Backend::Single(e) => e
            .sessions_page(args)
            .await
            .map_err(|x| Failure::from_engine(title, x)),
        Backend::Cluster(_) => Ok(SessionsPage {
            list: ui.op(title, Op::SessionsList, &args).await?,
            details: Vec::new(),
            previous: None,
        }),
    }
}

pub async fn overview_view(ui: &Ui, now: Now) -> Result<Markup, Failure> {
    let args = SessionsListArgs {
        limit: Some(OVERVIEW_ROWS),
        ..Default::default()
    };
    let list = sessions_page(ui, "Overview", args).await?;
    let f = facts(ui).await?;
    let (health, turns) = (&f.storage, &f.turns);
    let (workers, _) = registry(ui);
    let connected = workers.iter().filter(|w| w.connected).count();
    Ok(html! {
        h1 { "Overview" }
        div.card { dl {
            dt { "Version" } dd #version { "turnd " (env!("CARGO_PKG_VERSION")) " (boot " (f.boot_id) ")" }
            @if let Some(n) = &f.node {
                dt { "Node" } dd #node-id { (n) " of a cluster · " a href="/ui/cluster" { "partitions and leaders" } }
            }
            dt { "Readiness" } dd #readiness {
                @if f.ready { span.ok { "ready" } }
                @else if f.node.is_some() { span.bad { "draining" } }
                @else if ui.shared.draining.is_cancelled() { span.bad { "shutting down" } }
                @else { span.bad { "not ready" } }
            }
            dt { "Storage" } dd #storage {
                @if health.writable { span.ok { "writable" } }
                @else { span.bad { "NOT WRITABLE" } ": " (health.last_error.as_deref().unwrap_or("")) }
                " · " a href="/ui/check" { "store.check" }
            }
            dt { "Sessions with unfinished turns" } dd #active { (list.list.total) }
            dt { "Oldest wait" } dd #oldest {
                @match list.list.sessions.first() {
                    Some(r) => { (age(r.wait.since_ms, now)) " — " a href=(session_href(&r.session_id)) { (r.session_id) } " (" (r.wait.state.as_str()) ")" }
                    None => { "none" }
                }
            }
            dt { "Turns" } dd #turn-counts { "queued " (turns.queued) ", running " (turns.running) ", completed " (turns.completed) ", failed " (turns.failed) ", cancelled " (turns.cancelled) }
            dt { "Workers" } dd #workers { (connected) " connected of " (workers.len()) " known · " a href="/ui/workers" { "details" } }
        } }
        h2 { "Sessions by wait state" }
        (counts_line(&list.list.counts, "/ui/sessions?"))
        h2 { "Oldest waits" }
        (sessions_table(&list, now, "No session has an unfinished turn."))
        (node_note(ui))
        @if list.list.total > list.list.sessions.len() as u64 { p { a href="/ui/sessions" { "all " (list.list.total) " sessions" } } }
        p.muted { "A finished session (its turns completed, failed or cancelled) is not listed here: open it by id with the box above." }
    })
}

pub async fn overview(State(ui): State<Arc<Ui>>) -> Response {
    let now = Now(Some(ui.now_ms()));
    match overview_view(&ui, now).await {
        Ok(body) => page(
            &ui,
            "Overview",
            region(&feed_url(Screen::Overview, &Params::new()), body),
        ),
        Err(f) => f.page(&ui),
    }
}

// ------------------------------------------------------------------ sessions

/// The filters of a sessions view, from its query.
struct Filters {
    args: SessionsListArgs,
    /// The view's query string without cursor or state, for links (ends in `&`).
    base: String,
    /// ... and with the state.
    this: String,
}

fn filters(q: &Params) -> Result<Filters, Failure> {
    let state = match q.get("state").filter(|v| !v.is_empty()) {
        Some(v) => match WaitState::ALL.into_iter().find(|w| w.as_str() == v) {
            Some(w) => Some(w),
            None => {
                return Err(Failure::new(
                    StatusCode::BAD_REQUEST,
                    "Sessions",
                    format!("no such wait state {v:?}"),
                ))
            }
        },
        None => None,
    };
    let function_id = q.get("function").filter(|v| !v.is_empty()).cloned();
    let stuck = q.get("stuck").is_some_and(|v| v == "1");
    let by_id = q.get("order").is_some_and(|v| v == "id");
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
    let args = SessionsListArgs {
        state,
        function_id,
        stuck: stuck.then_some(true),
        order: Some(if by_id {
            SessionOrder::Id
        } else {
            SessionOrder::Wait
        }),
        limit: Some(PAGE_ROWS),
        after: q.get("after").filter(|v| !v.is_empty()).cloned(),
    };
    Ok(Filters { args, base, this })
}

fn paging(p: &SessionsPage, this: &str) -> Markup {
    html! {
        p.paging {
            @match &p.previous {
                Some(Some(c)) => { a #prev href=(format!("/ui/sessions?{this}after={}", pct_encode(c))) { "← previous page" } }
                Some(None) => { a #prev href=(format!("/ui/sessions?{}", this.trim_end_matches('&'))) { "← previous page" } }
                None => {}
            }
            " "
            @if let Some(next) = &p.list.next {
                a #next href=(format!("/ui/sessions?{this}after={}", pct_encode(next))) { "next page →" }
            }
        }
    }
}

pub async fn sessions_view(ui: &Ui, q: &Params, now: Now) -> Result<Markup, Failure> {
    let f = filters(q)?;
    let (stuck, by_id) = (
        f.args.stuck == Some(true),
        f.args.order == Some(SessionOrder::Id),
    );
    let (state, function_id) = (f.args.state, f.args.function_id.clone());
    let list = sessions_page(ui, "Sessions", f.args).await?;
    let this = &f.this;
    Ok(html! {
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
        p.muted { "Stuck: past the wait's deadline, waiting for a function no connected worker serves, or an invocation with no heartbeat for more than half its timeout; each stuck row says which." }
        (counts_line(&list.list.counts, &format!("/ui/sessions?{}", f.base)))
        p #total { strong { (list.list.total) } " matching session(s); showing " (list.list.sessions.len()) }
        (sessions_table(&list, now, "No session matches these filters."))
        (node_note(ui))
        (paging(&list, this))
    })
}

pub async fn sessions(State(ui): State<Arc<Ui>>, Query(q): Query<Params>) -> Response {
    let now = Now(Some(ui.now_ms()));
    match sessions_view(&ui, &q, now).await {
        Ok(body) => page(
            &ui,
            "Sessions",
            region(&feed_url(Screen::Sessions, &q), body),
        ),
        Err(f) => f.page(&ui),
    }
}

// ------------------------------------------------------------------ go to

/// `/ui/go?id=X`: the turn `X`, else the session `X`.
pub async fn go(State(ui): State<Arc<Ui>>, Query(q): Query<Params>) -> Response {
    let id = q.get("id").map(|s| s.trim()).unwrap_or("");
    if id.is_empty() {
        return Failure::new(StatusCode::BAD_REQUEST, "Go to", "no id given").page(&ui);
    }
    let turn = TurnIdArgs { turn_id: id.into() };
    if ui
        .op::<_, TurnOk>("Go to", Op::TurnGet, &turn)
        .await
        .is_ok()
    {
        return redirect(&turn_href(id));
    }
    let session = SessionIdArgs {
        session_id: id.into(),
    };
    if ui
        .op::<_, SessionOk>("Go to", Op::SessionInspect, &session)
        .await
        .is_ok()
    {
        return redirect(&session_href(id));
    }
    Failure::new(
        StatusCode::NOT_FOUND,
        "Go to",
        format!("no session or turn has the id {id:?} (a turn's id starts with t_; finished turns are kept for retention.terminal_ms)"),
    )
    .page(&ui)
}
