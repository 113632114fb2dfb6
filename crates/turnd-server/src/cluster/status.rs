//! What a node shows of the cluster: the partitions (leader, epoch, lease), the
//! members, this node's standbys and their lag (`GET /cluster` on the admin
//! listener, `turnd cluster status`, `/metrics`); and how the answers of every
//! partition to a cluster-wide read are combined.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use turnd_proto::{
    ErrorBody, ErrorCode, SessionOrder, SessionRow, SessionsListArgs, SessionsListOk, Stats,
    StatsOk,
};

use super::Node;
use crate::router::decode;

/// A count for `/metrics`.
pub type Counter = prometheus_client::metrics::counter::Counter;

/// The node's counts.
#[derive(Default)]
pub struct Counters {
    /// Requests forwarded to another node's partition.
    pub forwarded: Counter,
    /// Partitions this node took over.
    pub takeovers: Counter,
    /// Partitions this node stopped leading.
    pub handovers: Counter,
    /// Checkpoints of a partition's store this node copied from a leader.
    pub checkpoints_copied: Counter,
    /// Checkpoints of its partitions' stores this node put for another node.
    pub checkpoints_served: Counter,
    /// Tries to resume a relayed watch on its partition's next leader.
    pub watch_resumes: Counter,
}

/// One partition as the cluster's owners bucket shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PartitionStatus {
    pub partition: u32,
    /// The node holding its lease (None: nobody now).
    pub leader: Option<String>,
    pub epoch: u64,
    /// Until when the lease runs (Unix ms).
    pub lease_until_ms: Option<u64>,
}

/// A standby of this node.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StandbyRow {
    pub partition: u32,
    pub applied: u64,
    /// Messages of the stream not yet applied, when last read.
    pub lag: u64,
    pub error: Option<String>,
}

/// `GET /cluster`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ClusterStatus {
    pub node: String,
    pub partitions: Vec<PartitionStatus>,
    pub members: Vec<turnd_cluster::members::Member>,
    /// Partitions this node leads.
    pub leading: Vec<u32>,
    /// Of the partitions this node leads, those whose appends go out on a
    /// connection to their stream leader's server, with that server's name
    /// (`cluster.publish_to_stream_leader`); the others' go out on the main one.
    #[serde(default)]
    pub appends_on: std::collections::BTreeMap<u32, String>,
    pub standbys: Vec<StandbyRow>,
    pub forwarded: u64,
    pub takeovers: u64,
    pub handovers: u64,
    pub checkpoints_copied: u64,
    pub checkpoints_served: u64,
    /// Watches this node's connections hold.
    #[serde(default)]
    pub watches: u64,
    #[serde(default)]
    pub watch_resumes: u64,
    /// Feeds this node runs as a leader, for watches of any node.
    #[serde(default)]
    pub feeds: u64,
    /// The NATS servers not yet checked, or found not proven safe after start.
    #[serde(default)]
    pub nats: super::servers::ServerChecks,
}

impl Node {
    /// The cluster as this node sees it now.
    pub async fn status(&self) -> anyhow::Result<ClusterStatus> {
        let mut partitions = Vec::new();
        for p in 0..self.cluster.partitions {
            let lease = self.owners.get(p).await?;
            partitions.push(PartitionStatus {
                partition: p,
                leader: lease.as_ref().map(|l| l.owner.node.clone()),
                epoch: lease.as_ref().map_or(0, |l| l.owner.epoch),
                lease_until_ms: lease.and_then(|l| l.owner.until_ms),
            });
        }
        let mut standbys: Vec<StandbyRow> = self
            .standbys
            .lock()
            .iter()
            .map(|(p, s)| {
                let st = s.status();
                StandbyRow {
                    partition: *p,
                    applied: st.applied,
                    lag: st.lag,
                    error: st.error,
                }
            })
            .collect();
        standbys.sort_by_key(|s| s.partition);
        Ok(ClusterStatus {
            node: self.id.clone(),
            partitions,
            members: self.members.all().await?,
            leading: self.all_led().into_iter().map(|(p, _)| p).collect(),
            appends_on: self
                .all_led()
                .into_iter()
                .filter_map(|(p, led)| led.log.status().appends_on.map(|s| (p, s)))
                .collect(),
            standbys,
            forwarded: self.counters.forwarded.get(),
            takeovers: self.counters.takeovers.get(),
            handovers: self.counters.handovers.get(),
            checkpoints_copied: self.counters.checkpoints_copied.get(),
            checkpoints_served: self.counters.checkpoints_served.get(),
            watches: self.relays.count() as u64,
            watch_resumes: self.counters.watch_resumes.get(),
            feeds: self.feeds.load(std::sync::atomic::Ordering::Relaxed),
            nats: self.servers.lock().clone(),
        })
    }
}

/// Every partition's `stats`, summed; `workers` is this node's count of connected
/// workers (each connects to every node).
pub(super) fn sum_stats(texts: &[String], workers: u64) -> Result<Stats, ErrorBody> {
    let mut all: Option<Stats> = None;
    for t in texts {
        let s = decode::<StatsOk>(t)?.stats;
        let Some(acc) = all.as_mut() else {
            all = Some(s);
            continue;
        };
        acc.sessions.active += s.sessions.active;
        for (k, v) in s.sessions.blocked {
            *acc.sessions.blocked.entry(k).or_default() += v;
        }
        acc.turns.queued += s.turns.queued;
        acc.turns.running += s.turns.running;
        acc.turns.completed += s.turns.completed;
        acc.turns.failed += s.turns.failed;
        acc.turns.cancelled += s.turns.cancelled;
        acc.invocations_inflight += s.invocations_inflight;
        acc.oldest_wait_ms = acc.oldest_wait_ms.max(s.oldest_wait_ms);
        if !s.storage.writable {
            acc.storage = s.storage;
        }
    }
    let mut s = all.ok_or_else(|| ErrorBody::new(ErrorCode::Internal, "no partitions"))?;
    s.workers_connected = workers;
    Ok(s)
}

/// Every partition's page of `sessions.list` (each after the same cursor, in the
/// same order), merged into the cluster's page.
pub(super) fn merge_sessions(
    texts: &[String],
    args: SessionsListArgs,
) -> Result<SessionsListOk, ErrorBody> {
    let order = args.order.unwrap_or_default();
    let limit = args.limit.unwrap_or(turnd_proto::PAGE_DEFAULT) as usize;
    let mut rows: Vec<SessionRow> = Vec::new();
    let mut more = false;
    let mut total = 0;
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    for t in texts {
        let page: SessionsListOk = decode(t)?;
        more |= page.next.is_some();
        total += page.total;
        for (k, v) in page.counts {
            *counts.entry(k).or_default() += v;
        }
        rows.extend(page.sessions);
    }
    match order {
        SessionOrder::Wait => rows.sort_by(|a, b| {
            (a.wait.since_ms, &a.session_id).cmp(&(b.wait.since_ms, &b.session_id))
        }),
        SessionOrder::Id => rows.sort_by(|a, b| a.session_id.cmp(&b.session_id)),
    }
    more |= rows.len() > limit;
    rows.truncate(limit);
    let next = match rows.last() {
        Some(last) if more => Some(turnd_engine::sessions_cursor(last, order)),
        _ => None,
    };
    Ok(SessionsListOk {
        sessions: rows,
        next,
        total,
        counts,
    })
}

impl Node {
    /// This node's standbys and their lag, by partition.
    pub(crate) fn status_standbys(&self) -> Vec<(u32, u64)> {
        let mut v: Vec<(u32, u64)> = self
            .standbys
            .lock()
            .iter()
            .map(|(p, s)| (*p, s.status().lag))
            .collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnd_proto::{Wait, WaitState};

    fn row(id: &str, since: u64) -> SessionRow {
        SessionRow {
            session_id: id.into(),
            turn_id: format!("t-{id}"),
            function_id: "f".into(),
            step: 0,
            attempt: 0,
            locked_since_ms: since,
            queued: 0,
            stuck: false,
            wait: Wait {
                state: WaitState::AwaitingWorker,
                reason: String::new(),
                since_ms: since,
                deadline_ms: None,
                on_deadline: None,
                invocation_id: None,
                worker_id: None,
                ahead: None,
                last_error: None,
            },
        }
    }

    fn page(rows: Vec<SessionRow>, more: bool) -> String {
        let n = rows.len() as u64;
        serde_json::to_string(&SessionsListOk {
            next: more.then(|| "x".into()),
            sessions: rows,
            total: n + u64::from(more),
            counts: BTreeMap::from([("running".to_string(), n + u64::from(more))]),
        })
        .expect("encode")
    }

    /// The partitions' pages are merged in the page's order, cut to the limit, with
    /// a cursor at the last row kept when any rows remain, totals summed.
    #[test]
    fn pages_of_every_partition_merge_into_one_page_in_order() {
        let pages = [
            page(vec![row("b", 30), row("d", 10)], false),
            page(vec![row("a", 20), row("c", 40)], true),
        ];
        let args = |order, limit| SessionsListArgs {
            order: Some(order),
            limit: Some(limit),
            ..SessionsListArgs::default()
        };
        let by_wait = merge_sessions(&pages, args(SessionOrder::Wait, 3)).expect("merge");
        let ids: Vec<&str> = by_wait
            .sessions
            .iter()
            .map(|r| r.session_id.as_str())
            .collect();
        assert_eq!(ids, ["d", "a", "b"]);
        assert_eq!(by_wait.next.as_deref(), Some("w:30:b"));
        assert_eq!(by_wait.total, 5);
        assert_eq!(by_wait.counts.get("running"), Some(&5));
        let by_id = merge_sessions(&pages, args(SessionOrder::Id, 4)).expect("merge");
        let ids: Vec<&str> = by_id
            .sessions
            .iter()
            .map(|r| r.session_id.as_str())
            .collect();
        assert_eq!(ids, ["a", "b", "c", "d"]);
        // Partition 2 had more past its page: the merged page says so too.
        assert_eq!(by_id.next.as_deref(), Some("i:d"));
        let last = [page(vec![row("a", 1)], false), page(vec![], false)];
        let done = merge_sessions(&last, args(SessionOrder::Id, 4)).expect("merge");
        assert_eq!(done.next, None);
    }
}
