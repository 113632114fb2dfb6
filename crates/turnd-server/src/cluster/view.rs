//! The cluster as its buckets and streams show it, read by any machine that has the
//! config (`turnd cluster status`), with no node running: each partition's leader,
//! epoch and lease, its stream's last message, and each node's applied mark and lag.

use serde::{Deserialize, Serialize};
use turnd_cluster::lease::Owners;
use turnd_cluster::marks::Marks;
use turnd_cluster::members::{Member, Members};
use turnd_cluster::Nats;

use crate::cluster_config::ClusterConfig;

/// One partition.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PartitionView {
    pub partition: u32,
    pub leader: Option<String>,
    pub epoch: u64,
    pub lease_until_ms: Option<u64>,
    /// The stream's first message held (past it, trimmed) and its last (0: none,
    /// or no stream yet).
    pub first_seq: u64,
    pub last_seq: u64,
    /// Each node's applied mark: messages of the stream it has not applied.
    pub lag: Vec<(String, u64)>,
}

/// `turnd cluster status --json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ClusterView {
    pub partitions: Vec<PartitionView>,
    pub members: Vec<Member>,
}

/// Read the cluster of `c` from its NATS servers.
pub async fn read(c: &ClusterConfig) -> anyhow::Result<ClusterView> {
    let nats = Nats::connect(&c.nats, "turnd-cluster-status").await?;
    let replicas = c.replicas as usize;
    let owners = Owners::open(&nats, replicas).await?;
    let marks = Marks::open(&nats, replicas).await?;
    let members = Members::open(&nats, replicas).await?;
    let count = owners.partitions(c.partitions).await?;
    let mut partitions = Vec::new();
    for p in 0..count {
        let lease = owners.get(p).await?;
        let (first_seq, last_seq) = match nats
            .jetstream()
            .get_stream(turnd_cluster::log::stream_name(p))
            .await
        {
            Ok(mut s) => s
                .info()
                .await
                .map_or((0, 0), |i| (i.state.first_sequence, i.state.last_sequence)),
            Err(_) => (0, 0),
        };
        let lag = marks
            .all(p)
            .await?
            .into_iter()
            .map(|m| {
                let applied = turnd_cluster::log::seq_of(m.mark);
                (m.node, last_seq.saturating_sub(applied))
            })
            .collect();
        partitions.push(PartitionView {
            partition: p,
            leader: lease.as_ref().map(|l| l.owner.node.clone()),
            epoch: lease.as_ref().map_or(0, |l| l.owner.epoch),
            lease_until_ms: lease.and_then(|l| l.owner.until_ms),
            first_seq,
            last_seq,
            lag,
        });
    }
    Ok(ClusterView {
        partitions,
        members: members.all().await?,
    })
}

/// The view as a table.
pub fn render(v: &ClusterView, now_ms: u64) -> String {
    let mut out = String::from("NODE        STATE     WS\n");
    for m in &v.members {
        let state = if m.until_ms <= now_ms {
            "gone"
        } else if m.draining {
            "draining"
        } else {
            "live"
        };
        out.push_str(&format!("{:<11} {:<9} {}\n", m.node, state, m.ws));
    }
    out.push_str("\nPARTITION  LEADER      EPOCH   LEASE     FIRST_SEQ LAST_SEQ  STANDBY LAG\n");
    for p in &v.partitions {
        let lease = match p.lease_until_ms {
            Some(u) if u > now_ms => format!("{} ms", u - now_ms),
            Some(_) => "expired".into(),
            None => "-".into(),
        };
        let lag: Vec<String> = p
            .lag
            .iter()
            .filter(|(n, _)| Some(n) != p.leader.as_ref())
            .map(|(n, l)| format!("{n}:{l}"))
            .collect();
        out.push_str(&format!(
            "{:<10} {:<11} {:<7} {:<9} {:<9} {:<9} {}\n",
            p.partition,
            p.leader.as_deref().unwrap_or("-"),
            p.epoch,
            lease,
            p.first_seq,
            p.last_seq,
            if lag.is_empty() {
                "-".into()
            } else {
                lag.join(" ")
            }
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table names each member's state and each partition's leader, lease and
    /// the lag of its nodes other than the leader.
    #[test]
    fn the_table_shows_leaders_leases_and_lag() {
        let member = |node: &str, until_ms: u64, draining: bool| Member {
            node: node.into(),
            until_ms,
            ws: format!("ws://{node}/v1"),
            admin: String::new(),
            draining,
        };
        let v = ClusterView {
            members: vec![
                member("n1", 2_000, false),
                member("n2", 500, false),
                member("n3", 2_000, true),
            ],
            partitions: vec![
                PartitionView {
                    partition: 0,
                    leader: Some("n1".into()),
                    epoch: 7,
                    lease_until_ms: Some(1_900),
                    first_seq: 12,
                    last_seq: 40,
                    lag: vec![("n1".into(), 0), ("n3".into(), 5)],
                },
                PartitionView {
                    partition: 1,
                    leader: None,
                    epoch: 0,
                    lease_until_ms: Some(900),
                    first_seq: 0,
                    last_seq: 0,
                    lag: vec![],
                },
            ],
        };
        let t = render(&v, 1_000);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[1].starts_with("n1") && lines[1].contains("live"),
            "{t}"
        );
        assert!(lines[2].contains("gone"), "{t}");
        assert!(lines[3].contains("draining"), "{t}");
        let p0 = lines
            .iter()
            .find(|l| l.starts_with("0 "))
            .expect("partition 0");
        assert!(
            p0.contains("n1") && p0.contains("900 ms") && p0.contains("n3:5"),
            "{t}"
        );
        assert!(
            !p0.contains("n1:0"),
            "the leader's own lag is not a standby's: {t}"
        );
        let p1 = lines
            .iter()
            .find(|l| l.starts_with("1 "))
            .expect("partition 1");
        assert!(p1.contains("expired"), "{t}");
    }
}
