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
//! a POST), `/ui/go?id=` (a session or turn by id), and on a node of a cluster
//! `/ui/cluster` (`cluster.rs`: partitions, leaders, epochs, members, standbys, NATS
//! servers). Who may see them is checked first (`access.rs`): the `Host`, the origin
//! of writes, the operator token or sign-in session.
//!
//! On a node, a screen reads through the node ([`Backend::run`], as an operator):
//! turns, events and `store.check` are forwarded to their partition's leader or
//! gathered from every partition, the sessions list and the overview's counts are
//! gathered, workers are the node's own registry (every worker connects to every
//! node). The session screen reads engine state that is not a protocol op (what
//! the lock holder is blocked on, each turn's worker, a live watch): a node shows
//! it for the sessions of the partitions it leads, and for another session names
//! the node that leads it and that node's page.

mod access;
mod check;
mod cluster;
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
use serde::de::DeserializeOwned;
use serde::Serialize;
use turnd_engine::{Caller, Engine, EngineError};
use turnd_proto::{ErrorBody, ErrorCode, Op, Role};

use crate::backend::Backend;
use crate::cluster::Node;
use crate::router::Answer;
use crate::ws::Shared;

pub use render::pct_encode;

/// A request's query parameters (sorted, so that a screen's key and feed URL are
/// the same however the browser ordered them).
type Params = BTreeMap<String, String>;

/// The page's state beside the daemon's: sign-in sessions, open feeds, shared
/// renders, the store check.
pub struct Ui {
    pub(crate) shared: Arc<Shared>,
    logins: access::Logins,
    feeds: live::Feeds,
    renders: live::Renders,
    check: check::Checks,
}

impl Ui {
    pub fn new(shared: Arc<Shared>) -> Arc<Ui> {
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

    /// The node, when this daemon is a node of a cluster.
    fn node(&self) -> Option<&Arc<Node>> {
        match &self.shared.backend {
            Backend::Cluster(n) => Some(n),
            Backend::Single(_) => None,
        }
    }

    /// The engine that holds session `id`: a daemon's own; on a node, the engine of
    /// the session's partition while this node leads it (its lease running, the
    /// rule of the requests it runs). A session another node leads is not read
    /// here: the answer names that node and its page.
    async fn session_engine(&self, title: &'static str, id: &str) -> Result<Engine, Failure> {
        let n = match &self.shared.backend {
            Backend::Single(e) => return Ok(e.clone()),
            Backend::Cluster(n) => n,
        };
        let p = turnd_proto::session_partition(id, n.cluster.partitions);
        if let Some(led) = n.led(p).filter(|l| crate::cluster::lease_runs(&l.lease)) {
            return Ok(led.engine.clone());
        }
        let leader = n.leaders.read().get(&p).cloned();
        let why = match leader.filter(|l| l != n.id()) {
            Some(l) => {
                let members = n.members.all().await.unwrap_or_default();
                let page = members.iter().find(|m| m.node == l).map_or_else(
                    || "its operator page".to_string(),
                    |m| format!("{}{}", m.admin, render::session_href(id)),
                );
                format!(
                    "session {id:?} is in partition {p}, which node {l} leads: {page} shows it (or `turnd inspect`, `turnd turns` and `turnd events` through any node)"
                )
            }
            None => format!(
                "session {id:?} is in partition {p}, which has no leader here now (it is being taken over): try again in a moment"
            ),
        };
        Err(Failure::new(StatusCode::MISDIRECTED_REQUEST, title, why))
    }

    /// The daemon's clock (Unix ms).
    fn now_ms(&self) -> u64 {
        match &self.shared.backend {
            Backend::Single(e) => e.now_ms(),
            Backend::Cluster(n) => n.clock.now_ms(),
        }
    }

    /// Run a protocol op as an operator would over the WebSocket: on this daemon's
    /// engine, or on a node forwarded to its partition's leader (or gathered from
    /// every partition).
    async fn op<A: Serialize, T: DeserializeOwned>(
        &self,
        title: &'static str,
        op: Op,
        args: &A,
    ) -> Result<T, Failure> {
        let fail = |e: ErrorBody| Failure::from_error(title, &e);
        let args = serde_json::to_string(args)
            .map_err(|e| fail(ErrorBody::new(ErrorCode::Internal, e.to_string())))?;
        let caller = Caller {
            role: Role::Operator,
            worker_id: None,
        };
        match self.shared.backend.run(&caller, op, &args, None).await {
            Ok(Answer::Reply(text)) => serde_json::from_str(&text).map_err(|e| {
                fail(ErrorBody::new(
                    ErrorCode::Internal,
                    format!("unreadable answer to {}: {e}", op.name()),
                ))
            }),
            Ok(Answer::Queued) => Err(fail(ErrorBody::new(
                ErrorCode::Internal,
                "the op answered on a connection the page does not have",
            ))),
            Err(e) => Err(fail(e)),
        }
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

    /// A protocol error as the page answers it, by its code.
    fn from_error(title: &'static str, e: &ErrorBody) -> Failure {
        let status = match e.code {
            ErrorCode::NotFound => StatusCode::NOT_FOUND,
            ErrorCode::BadRequest => StatusCode::BAD_REQUEST,
            _ => StatusCode::SERVICE_UNAVAILABLE,
        };
        Failure::new(status, title, e.message.clone())
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
        .route("/ui/cluster", get(cluster::cluster))
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
