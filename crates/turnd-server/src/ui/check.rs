//! `store.check` from the page: a POST (a write, so the origin check applies, and no
//! link or image elsewhere can start it) runs it, one run at a time; the page shows
//! the last run's result. `store.check` reads the whole store, so a second request
//! while one runs is answered 409 instead of starting another. It runs as the
//! protocol's `store.check`: on a node of a cluster, on every partition's leader.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use maud::{html, Markup};
use serde_json::json;
use turnd_proto::{CheckOk, Op, Violation};

use super::render::{dur, error_page, page, redirect, time, Now};
use super::Ui;

/// The store check's runs.
#[derive(Default)]
pub struct Checks {
    /// Held while a run is in progress.
    running: tokio::sync::Mutex<()>,
    /// When the run in progress started (daemon clock, ms).
    started_ms: Mutex<Option<u64>>,
    last: Mutex<Option<Run>>,
}

/// A finished run.
struct Run {
    at_ms: u64,
    took_ms: u64,
    result: Result<Vec<Violation>, String>,
}

fn result_view(r: &Run, now: Now) -> Markup {
    html! {
        p #check-result {
            "Last run " (time(r.at_ms, now)) ", took " (dur(r.took_ms)) ": "
            @match &r.result {
                Ok(vs) if vs.is_empty() => { span.ok { "no violations" } }
                Ok(vs) => { span.bad { (vs.len()) " violation(s)" } }
                Err(e) => { span.bad { "the check failed: " (e) } }
            }
        }
        @if let Ok(vs) = &r.result {
            @if !vs.is_empty() {
                table { thead { tr { th { "Invariant" } th { "Session" } th { "Turn" } th { "Detail" } } }
                tbody { @for v in vs { tr {
                    td { (v.invariant) } td { (v.session_id.as_deref().unwrap_or("-")) } td { (v.turn_id.as_deref().unwrap_or("-")) } td.wrap { (v.detail) }
                } } } }
            }
        }
    }
}

/// `GET /ui/check`: the last run and a button that starts one.
pub async fn check_page(State(ui): State<Arc<Ui>>) -> Response {
    let now = Now(Some(ui.now_ms()));
    let started = *ui
        .check
        .started_ms
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let last = ui.check.last.lock().unwrap_or_else(PoisonError::into_inner);
    let body = html! {
        h1 { "store.check" }
        p { "Reads the whole store and checks its invariants (it takes longer the more turns are stored; one run at a time)." }
        @if let Some(s) = started { p.muted #check-running { "A run is in progress, started " (time(s, now)) "." } }
        form method="post" action="/ui/check" { button type="submit" { "Run store.check" } }
        @match last.as_ref() {
            Some(r) => { (result_view(r, now)) }
            None => { p #check-result.muted { "No run since the daemon started." } }
        }
    };
    drop(last);
    page(&ui, "store.check", body)
}

/// `POST /ui/check`: run the check unless one is running, then show the result.
pub async fn run(State(ui): State<Arc<Ui>>) -> Response {
    let Ok(_running) = ui.check.running.try_lock() else {
        return error_page(
            &ui,
            StatusCode::CONFLICT,
            "store.check",
            "store.check is already running: its result will be on /ui/check when it ends",
        );
    };
    let at_ms = ui.now_ms();
    set(&ui.check.started_ms, Some(at_ms));
    let started = Instant::now();
    let result = ui
        .op::<_, CheckOk>("store.check", Op::StoreCheck, &json!({}))
        .await
        .map(|ok| ok.violations)
        .map_err(|f| f.message);
    let took_ms = started.elapsed().as_millis() as u64;
    set(
        &ui.check.last,
        Some(Run {
            at_ms,
            took_ms,
            result,
        }),
    );
    set(&ui.check.started_ms, None);
    redirect("/ui/check")
}

fn set<T>(m: &Mutex<T>, v: T) {
    *m.lock().unwrap_or_else(PoisonError::into_inner) = v;
}
