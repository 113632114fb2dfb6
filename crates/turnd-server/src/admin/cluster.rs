//! The admin listener of a node of a cluster: `GET /healthz`, `GET /readyz`,
//! `GET /metrics` (the node's partitions, standbys and forwards, with the gauges
//! of each engine it leads labelled by partition) and `GET /cluster`, the cluster
//! as this node sees it (what `turnd cluster status` prints). The operator page
//! is mounted beside these routes (`crate::ui`).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::cluster::Node;
use crate::ws::Shared;

#[derive(Clone)]
struct NodeState {
    node: Arc<Node>,
    shared: Arc<Shared>,
}

/// The node's admin routes.
pub(super) fn router(node: Arc<Node>, shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/cluster", get(status))
        .with_state(NodeState { node, shared })
}

async fn readyz(State(s): State<NodeState>) -> impl IntoResponse {
    // The node drains (hands its partitions over) before the connections close.
    if s.shared.draining.is_cancelled() || s.node.draining.is_cancelled() {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n");
    }
    // A node that cannot reach NATS serves nothing: it leads no partition it can
    // write, and cannot forward a request to one that does.
    if s.node.nats.client().connection_state() != async_nats::connection::State::Connected {
        return (StatusCode::SERVICE_UNAVAILABLE, "NATS unreachable\n");
    }
    (StatusCode::OK, "ready\n")
}

async fn status(State(s): State<NodeState>) -> Response {
    match s.node.status().await {
        Ok(st) => match serde_json::to_string_pretty(&st) {
            Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
            Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("encode: {e}\n")).into_response(),
        },
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("cluster status: {e:#}\n"),
        )
            .into_response(),
    }
}

type Labels = Vec<(String, String)>;

fn gauge(reg: &mut Registry, name: &str, help: &str, v: i64) {
    let g: Gauge = Gauge::default();
    g.set(v);
    reg.register(name, help, g);
}

async fn metrics(State(s): State<NodeState>) -> Response {
    let mut reg = Registry::with_prefix("turnd_cluster");
    let led = s.node.all_led();
    gauge(
        &mut reg,
        "partitions_led",
        "Partitions this node leads",
        led.len() as i64,
    );
    register_partitions(&mut reg, &s.node, &led);
    for (name, help, v) in node_gauges(&s.node) {
        gauge(&mut reg, name, help, i64::try_from(v).unwrap_or(i64::MAX));
    }
    let mut body = String::new();
    if let Err(e) = encode(&mut body, &reg) {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encode metrics: {e}\n"),
        )
            .into_response();
    }
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

/// The gauges by partition: standbys' lag, and the epoch and active sessions of
/// each partition led here.
/// The node's counters and counts, each a gauge: (name, help, value).
fn node_gauges(node: &Node) -> Vec<(&'static str, &'static str, u64)> {
    let c = &node.counters;
    let checks = node.servers.lock().clone();
    vec![
        (
            "forwarded",
            "Requests forwarded to another node's partition",
            c.forwarded.get(),
        ),
        (
            "takeovers",
            "Partitions this node took over",
            c.takeovers.get(),
        ),
        (
            "handovers",
            "Partitions this node stopped leading",
            c.handovers.get(),
        ),
        (
            "checkpoints_copied",
            "Checkpoints of a partition's store this node copied from its leader",
            c.checkpoints_copied.get(),
        ),
        (
            "checkpoints_served",
            "Checkpoints of a led partition's store this node put for another node",
            c.checkpoints_served.get(),
        ),
        (
            "nats_pending",
            "Checks of NATS servers that did not answer since this node started, made again until they answer",
            checks.pending.len() as u64,
        ),
        (
            "nats_unproven",
            "Findings of a later check that a NATS server is not proven to sync before it acknowledges",
            checks.unproven.len() as u64,
        ),
        (
            "watches",
            "Watches this node's connections hold, each relayed from its partition's leader",
            node.relays.count() as u64,
        ),
        (
            "feeds",
            "Relayed watches this node feeds as their partition's leader",
            node.feeds.load(std::sync::atomic::Ordering::Relaxed),
        ),
        (
            "watch_resumes",
            "Tries to resume a relayed watch on its partition's next leader",
            c.watch_resumes.get(),
        ),
    ]
}

fn register_partitions(reg: &mut Registry, node: &Node, led: &[(u32, Arc<crate::cluster::Led>)]) {
    let standbys = node.status_standbys();
    gauge(
        reg,
        "standbys",
        "Partitions this node keeps a warm standby of",
        standbys.len() as i64,
    );
    let lag = Family::<Labels, Gauge>::default();
    for (p, l) in &standbys {
        lag.get_or_create(&vec![("partition".into(), p.to_string())])
            .set(*l as i64);
    }
    reg.register(
        "standby_lag",
        "Messages of a partition's stream a standby has not applied",
        lag,
    );
    let epoch = Family::<Labels, Gauge>::default();
    let active = Family::<Labels, Gauge>::default();
    for (p, l) in led {
        let labels = vec![("partition".into(), p.to_string())];
        epoch.get_or_create(&labels).set(l.log.epoch() as i64);
        active
            .get_or_create(&labels)
            .set(l.engine.stats().sessions.active as i64);
    }
    reg.register(
        "epoch",
        "The epoch of each partition this node leads",
        epoch,
    );
    reg.register(
        "sessions_active",
        "Sessions with unfinished turns, by partition led here",
        active,
    );
}
