//! The admin HTTP listener: `GET /healthz`, `GET /readyz`, `GET /metrics`
//! (`metrics.rs`; a node of a cluster's in `cluster.rs`), and the operator page
//! under `/ui` (`crate::ui`, on a node too), served with the client's address (for
//! the page's per-address limits) and with security headers on every response, the
//! page's refusals and errors included: a Content-Security-Policy that allows the
//! page's own files and nothing else (no inline script or style, no framing, forms
//! posting only here), `nosniff`, `X-Frame-Options: DENY` and no `Referer` leaving
//! the page.

mod cluster;
mod metrics;
pub(crate) mod state;

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tower_http::set_header::SetResponseHeaderLayer;

use crate::tls::TlsListener;

use crate::backend::Backend;
use crate::ws::Shared;

pub use state::{Admin, ClientAddr};

/// The page's policy: its own stylesheet, script, feeds and forms, nothing else.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
    style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; \
    frame-ancestors 'none'; base-uri 'none'";

/// The headers every admin response carries.
fn security_headers() -> [(HeaderName, HeaderValue); 4] {
    [
        (
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CONTENT_SECURITY_POLICY),
        ),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
        (header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY")),
        (
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        ),
    ]
}

pub fn router(shared: Arc<Shared>) -> Router {
    let mut app = match &shared.backend {
        Backend::Single(engine) => {
            let admin = Arc::new(Admin {
                engine: engine.clone(),
                shared: shared.clone(),
            });
            Router::new()
                .route("/healthz", get(healthz))
                .route("/readyz", get(readyz))
                .route("/metrics", get(metrics::metrics))
                .with_state(admin.clone())
                .merge(crate::ui::router(crate::ui::Ui::new(shared.clone())))
        }
        Backend::Cluster(node) => cluster::router(node.clone(), shared.clone())
            .merge(crate::ui::router(crate::ui::Ui::new(shared.clone()))),
    };
    for (name, value) in security_headers() {
        app = app.layer(SetResponseHeaderLayer::overriding(name, value));
    }
    app
}

/// The admin listener's task, ending gracefully once the server is closing.
pub fn spawn(
    shared: &Arc<Shared>,
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
) -> JoinHandle<std::io::Result<()>> {
    let admin_shutdown = shared.closing.clone();
    let app = router(shared.clone()).into_make_service_with_connect_info::<ClientAddr>();
    let graceful = async move { admin_shutdown.cancelled().await };
    tokio::spawn(async move {
        match tls {
            Some(acceptor) => {
                let l = TlsListener {
                    inner: listener,
                    acceptor,
                };
                axum::serve(l, app).with_graceful_shutdown(graceful).await
            }
            None => {
                axum::serve(listener, app)
                    .with_graceful_shutdown(graceful)
                    .await
            }
        }
    })
}

/// Fails when the store cannot go on without a restart (a thread of its own ended),
/// so that a supervisor restarts the daemon.
async fn healthz(State(s): State<Arc<Admin>>) -> impl IntoResponse {
    match s.engine.store().kv().health() {
        Ok(()) => (StatusCode::OK, "ok\n".to_string()),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")),
    }
}

async fn readyz(State(s): State<Arc<Admin>>) -> impl IntoResponse {
    if s.draining.is_cancelled() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting down\n".to_string(),
        );
    }
    let health = s.engine.storage_health();
    if !s.engine.ready() {
        let why = health
            .last_error
            .map(|e| format!("storage not writable: {e}\n"))
            .unwrap_or_else(|| "recovery has not finished\n".into());
        return (StatusCode::SERVICE_UNAVAILABLE, why);
    }
    (StatusCode::OK, "ready\n".to_string())
}
