//! The read-only operator page on the admin listener, under `/ui`: HTML rendered here
//! with maud (every value escaped), one served stylesheet and one served script (the
//! Content-Security-Policy allows nothing inline and nothing from elsewhere), and a
//! live feed per screen (server-sent events) that keeps it following the daemon.
//!
//! Screens: `/ui` (overview), `/ui/sessions` (the `sessions.list` view with its
//! filters, paged both ways), `/ui/session?id=` (what the lock holder is blocked on
//! and why it looks stuck, the queue, the session's turns, its events), `/ui/turn?id=`
//! (steps and attempts as a timeline, the workers that ran it), `/ui/workers`
//! (workers and functions), `/ui/check` (`store.check`, one run at a time, started by
//! a POST), `/ui/go?id=` (a session or turn by id). Who may see them is checked
//! first (`access.rs`): the `Host`, the origin of writes, the operator token or
//! sign-in session.

mod access;
mod check;
mod live;
mod render;
mod screens;
mod session;
mod turn;

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use turnd_engine::EngineError;

pub use render::pct_encode;

/// A request's query parameters (sorted, so that a screen's key and feed URL are
/// the same however the browser ordered them).
type Params = BTreeMap<String, String>;

/// The page's state beside the daemon's: sign-in sessions, open feeds, shared
/// renders, the store check.
pub struct Ui {
    pub(crate) shared: Arc<crate::admin::state::Admin>,
    logins: access::Logins,
    feeds: live::Feeds,
    renders: live::Renders,
    check: check::Checks,
}

impl Ui {
    pub fn new(shared: Arc<crate::admin::state::Admin>) -> Arc<Ui> {
        Arc::new(Ui {
            shared,
            logins: access::Logins::new(),
            feeds: live::Feeds::default(),
            renders: live::Renders::default(),
            check: check::Checks::default(),
        })
    }

    /// Whether `[auth]` has tokens (then the page needs an operator).
    fn has_tokens(&self) -> bool {
        !self.shared.config.auth.tokens.is_empty()
    }
}

/// Why a screen cannot be shown.
#[derive(Debug)]
pub struct Failure {
    status: StatusCode,
    title: &'static str,
    message: String,
}

impl Failure {
    fn new(status: StatusCode, title: &'static str, message: impl Into<String>) -> Failure {
        Failure {
            status,
            title,
            message: message.into(),
        }
    }

    /// An engine error as the page answers it: 404 for what does not exist, 400 for
    /// a bad argument, 503 for the rest (the store could not be read).
    fn from_engine(title: &'static str, e: EngineError) -> Failure {
        let status = match e {
            EngineError::NoSession(_) | EngineError::NoTurn(_) => StatusCode::NOT_FOUND,
            EngineError::BadId { .. } | EngineError::BadCursor | EngineError::OutOfRange { .. } => {
                StatusCode::BAD_REQUEST
            }
            _ => StatusCode::SERVICE_UNAVAILABLE,
        };
        Failure::new(status, title, e.to_string())
    }

    fn page(&self, ui: &Ui) -> Response {
        render::error_page(ui, self.status, self.title, &self.message)
    }
}

/// The page's routes; every one goes through [`access::guard`] first.
pub fn router(ui: Arc<Ui>) -> Router {
    Router::new()
        .route("/", get(|| async { render::redirect("/ui") }))
        .route("/ui", get(screens::overview))
        .route("/ui/", get(screens::overview))
        .route("/ui/sessions", get(screens::sessions))
        .route("/ui/go", get(screens::go))
        .route("/ui/session", get(session::session))
        .route("/ui/session/feed", get(live::session_feed))
        .route("/ui/live/{screen}", get(live::live))
        .route("/ui/turn", get(turn::turn))
        .route("/ui/workers", get(turn::workers))
        .route("/ui/check", get(check::check_page).post(check::run))
        .route("/ui/login", get(access::login_form).post(access::login))
        .route("/ui/logout", post(access::logout))
        .route("/ui/assets/ui.css", get(css))
        .route("/ui/assets/ui.js", get(js))
        .route_layer(middleware::from_fn_with_state(ui.clone(), access::guard))
        .with_state(ui)
}

const CSS: &str = include_str!("assets/ui.css");
const JS: &str = include_str!("assets/ui.js");

fn asset(body: &'static str, kind: &'static str) -> Response {
    let mut r = body.into_response();
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    // The URLs carry the version: a new binary's assets have new URLs.
    r.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("max-age=86400"),
    );
    r
}

async fn css() -> Response {
    asset(CSS, "text/css; charset=utf-8")
}

async fn js() -> Response {
    asset(JS, "text/javascript; charset=utf-8")
}
