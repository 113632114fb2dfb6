//! The page's frame and the small pieces every screen renders with: the layout (the
//! header with its go-to box, the served stylesheet and script), error pages, links,
//! times the browser keeps ticking, durations and JSON values. Every value is put in
//! the HTML through maud, which escapes it.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use maud::{html, Markup, DOCTYPE};
use serde_json::Value;
use turnd_engine::fmt_utc;

use super::Ui;

/// Longest input, output or error text shown before it is cut.
const MAX_VALUE_CHARS: usize = 2_000;

/// The time a screen is rendered at: `Some` for a whole page (times are written out),
/// `None` for a live fragment (times are left to the browser, so that a fragment
/// changes only when what it shows does).
#[derive(Debug, Clone, Copy)]
pub struct Now(pub Option<u64>);

/// Percent-encode everything but unreserved characters (for query values).
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

pub fn session_href(id: &str) -> String {
    format!("/ui/session?id={}", pct_encode(id))
}

pub fn turn_href(id: &str) -> String {
    format!("/ui/turn?id={}", pct_encode(id))
}

pub fn dur(ms: u64) -> String {
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

fn ago_text(then: u64, now: u64) -> String {
    if then <= now {
        format!("{} ago", dur(now - then))
    } else {
        format!("in {}", dur(then - now))
    }
}

/// A moment, as "3.2s ago" or "in 4.0s" (UTC on hover); the script keeps it ticking.
pub fn time(ms: u64, now: Now) -> Markup {
    html! {
        span.t data-at=(ms) title=(fmt_utc(ms)) {
            @if let Some(n) = now.0 { (ago_text(ms, n)) }
        }
    }
}

/// How long since `since` ("12.5s"), ticking like [`time`].
pub fn age(since: u64, now: Now) -> Markup {
    html! {
        span.t data-at=(since) data-mode="for" title=(fmt_utc(since)) {
            @if let Some(n) = now.0 { (dur(n.saturating_sub(since))) }
        }
    }
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

pub fn value_block(label: &str, v: &Value) -> Markup {
    let (text, size, cut) = value_text(v);
    html! {
        h3 { (label) " " span.muted { "(" (size) " bytes of JSON" @if cut { ", cut to " (MAX_VALUE_CHARS) " characters" } ")" } }
        pre.value { (text) }
    }
}

/// A table row that says in words that a table is empty.
pub fn empty_row(cols: u32, text: &str) -> Markup {
    html! { tr.empty { td colspan=(cols) { (text) } } }
}

pub fn on_deadline(o: turnd_proto::OnDeadline) -> &'static str {
    o.as_str()
}

/// The whole document around a screen's body.
fn layout(ui: &Ui, title: &str, body: Markup) -> Markup {
    let v = env!("CARGO_PKG_VERSION");
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { "turnd · " (title) }
                link rel="stylesheet" href=(format!("/ui/assets/ui.css?v={v}"));
                script src=(format!("/ui/assets/ui.js?v={v}")) defer {}
            }
            body data-now=(ui.now_ms()) {
                header {
                    a.brand href="/ui" { "turnd" }
                    a href="/ui" { "Overview" }
                    a href="/ui/sessions" { "Sessions" }
                    a href="/ui/sessions?stuck=1" { "Stuck" }
                    a href="/ui/workers" { "Workers & functions" }
                    a href="/ui/check" { "Store check" }
                    @if let Some(n) = ui.node() { a #node href="/ui/cluster" { "Cluster (node " (n.id()) ")" } }
                    form.goto method="get" action="/ui/go" {
                        input type="search" name="id" placeholder="session or turn id" aria-label="session or turn id" required;
                        " " button type="submit" { "Go" }
                    }
                    @if ui.has_tokens() {
                        form.signout method="post" action="/ui/logout" { button type="submit" { "Sign out" } }
                    }
                }
                main { (body) }
            }
        }
    }
}

/// A screen as an HTML response that no cache keeps.
pub fn page(ui: &Ui, title: &str, body: Markup) -> Response {
    html_response(layout(ui, title, body))
}

pub fn html_response(m: Markup) -> Response {
    let mut r = m.into_string().into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

pub fn error_page(ui: &Ui, status: StatusCode, title: &str, message: &str) -> Response {
    let mut r = page(
        ui,
        title,
        html! { h1 { (title) } p.bad #error { (message) } },
    );
    *r.status_mut() = status;
    r
}

pub fn redirect(to: &str) -> Response {
    match HeaderValue::from_str(to) {
        Ok(v) => (StatusCode::SEE_OTHER, [(header::LOCATION, v)]).into_response(),
        Err(_) => (StatusCode::BAD_REQUEST, "bad redirect\n").into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_encoding_escapes_all_but_unreserved() {
        assert_eq!(pct_encode("a b&"), "a%20b%26");
        assert_eq!(pct_encode("<script>"), "%3Cscript%3E");
        assert_eq!(pct_encode("ok-_.~9"), "ok-_.~9");
    }

    #[test]
    fn durations_read_at_every_scale() {
        assert_eq!(dur(999), "999ms");
        assert_eq!(dur(2_700), "2.7s");
        assert_eq!(dur(61_000), "1m01s");
        assert_eq!(dur(3_660_000), "1h01m");
        assert_eq!(ago_text(1_000, 3_500), "2.5s ago");
        assert_eq!(ago_text(3_500, 1_000), "in 2.5s");
    }
}
