//! The cluster screen of a node (`/ui/cluster`): the cluster as this node sees it,
//! read by the same call as `GET /cluster` ([`crate::cluster::Node::status`]):
//! each partition's leader, epoch and whether its lease runs, this node's standbys
//! and their lag, the members (draining or not), the NATS servers' checks still
//! pending or found unproven, and the node's counts. It is kept live by its feed
//! like every screen; it shows the state of leases (running or not), not their end
//! times, so that a steady cluster's screen does not change at every renewal.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use maud::{html, Markup};
use turnd_cluster::members::{now_ms, Member};

use super::live::{feed_url, region, Screen};
use super::render::{empty_row, page};
use super::{Failure, Params, Ui};
use crate::cluster::status::{ClusterStatus, PartitionStatus, StandbyRow};

/// A lease's state at `now` (Unix ms), in words.
fn lease_state(p: &PartitionStatus, now: u64) -> &'static str {
    match p.lease_until_ms {
        Some(u) if u > now => "runs",
        Some(_) => "ran out",
        None => "none",
    }
}

fn member_state(m: &Member, now: u64) -> &'static str {
    if m.until_ms <= now {
        "gone"
    } else if m.draining {
        "draining"
    } else {
        "live"
    }
}

fn partitions_table(st: &ClusterStatus, now: u64) -> Markup {
    let standby = |p: u32| st.standbys.iter().find(|s| s.partition == p);
    html! {
        table #partitions {
            thead { tr { th { "Partition" } th { "Leader" } th { "Epoch" } th { "Lease" } th { "Here" } } }
            tbody {
                @if st.partitions.is_empty() { (empty_row(5, "The cluster has no partitions.")) }
                @for p in &st.partitions {
                    tr data-partition=(p.partition) {
                        td.num { (p.partition) }
                        td.leader { @match &p.leader { Some(l) => { (l) } None => { span.bad { "none" } } } }
                        td.epoch.num { (p.epoch) }
                        td { @if lease_state(p, now) == "runs" { span.ok { "runs" } } @else { span.bad { (lease_state(p, now)) } } }
                        td {
                            @if st.leading.contains(&p.partition) {
                                "led here"
                                @if let Some(s) = st.appends_on.get(&p.partition) { ", appends on " (s) }
                            }
                            @else if let Some(s) = standby(p.partition) { "standby, lag " (s.lag) }
                            @else { span.muted { "-" } }
                        }
                    }
                }
            }
        }
    }
}

fn standbys_table(rows: &[StandbyRow]) -> Markup {
    html! {
        table #standbys {
            thead { tr { th { "Partition" } th { "Applied" } th title="messages of the partition's stream not applied yet, when last read" { "Lag" } th { "Error" } } }
            tbody {
                @if rows.is_empty() { (empty_row(4, "This node keeps no standby now.")) }
                @for s in rows {
                    tr data-standby=(s.partition) {
                        td.num { (s.partition) } td.num { (s.applied) } td.num.lag { (s.lag) }
                        td.wrap { @match &s.error { Some(e) => { span.bad { (e) } } None => { span.muted { "-" } } } }
                    }
                }
            }
        }
    }
}

fn members_table(members: &[Member], now: u64) -> Markup {
    html! {
        table #members {
            thead { tr { th { "Node" } th { "State" } th { "WebSocket" } th { "Admin" } } }
            tbody {
                @if members.is_empty() { (empty_row(4, "No member is registered.")) }
                @for m in members {
                    @let state = member_state(m, now);
                    tr data-member=(m.node) {
                        td { (m.node) }
                        td.state { @if state == "live" { span.ok { (state) } } @else { span.bad { (state) } } }
                        td { (m.ws) } td { (m.admin) }
                    }
                }
            }
        }
    }
}

fn nats_card(st: &ClusterStatus) -> Markup {
    html! {
        div.card #nats { dl {
            dt { "NATS servers pending" } dd #nats-pending {
                @if st.nats.pending.is_empty() { span.ok { "none" } }
                @else { span.bad { (st.nats.pending.join(", ")) } " (not heard from at start: checked again until they answer)" }
            }
            dt { "NATS servers unproven" } dd #nats-unproven {
                @if st.nats.unproven.is_empty() { span.ok { "none" } }
                @else { @for u in &st.nats.unproven { span.bad { (u) } br; } }
            }
        } }
    }
}

fn counts_card(st: &ClusterStatus) -> Markup {
    html! {
        p #cluster-counts.muted {
            "Forwarded " (st.forwarded) " · takeovers " (st.takeovers) " · hand-overs " (st.handovers)
            " · checkpoints copied " (st.checkpoints_copied) ", served " (st.checkpoints_served)
            " · relayed watches " (st.watches) ", resumed " (st.watch_resumes) " · feeds " (st.feeds)
        }
    }
}

/// The screen's live region; on a daemon on its own, the answer that there is no
/// cluster.
pub async fn cluster_view(ui: &Ui) -> Result<Markup, Failure> {
    let Some(node) = ui.node() else {
        return Err(Failure::new(
            StatusCode::NOT_FOUND,
            "Cluster",
            "this daemon runs on its own: it is not a node of a cluster (no [cluster] table in its config)",
        ));
    };
    let st = node.status().await.map_err(|e| {
        Failure::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "Cluster",
            format!("the cluster's buckets could not be read: {e:#}"),
        )
    })?;
    let now = now_ms();
    let leading: Vec<String> = st.leading.iter().map(u32::to_string).collect();
    Ok(html! {
        h1 { "Cluster" }
        div.card { dl {
            dt { "This node" } dd #node-id { (st.node) }
            dt { "Leads" } dd #leading { @if leading.is_empty() { "no partition" } @else { "partitions " (leading.join(", ")) } }
        } }
        h2 { "Partitions" }
        (partitions_table(&st, now))
        p.muted { "Each node's applied mark for every partition: " code { "turnd cluster status" } "." }
        h2 { "This node's standbys" }
        (standbys_table(&st.standbys))
        h2 { "Members" }
        (members_table(&st.members, now))
        h2 { "NATS servers" }
        (nats_card(&st))
        (counts_card(&st))
    })
}

/// `GET /ui/cluster`.
pub async fn cluster(State(ui): State<Arc<Ui>>) -> Response {
    match cluster_view(&ui).await {
        Ok(body) => page(
            &ui,
            "Cluster",
            region(&feed_url(Screen::Cluster, &Params::new()), body),
        ),
        Err(f) => f.page(&ui),
    }
}
