//! `[cluster]`: turnd across machines on NATS JetStream ([cluster](../../../docs/cluster.md)).
//! Without the table the daemon is one node on its local commit log, exactly as
//! without this module; with it, sessions are spread over a fixed number of
//! partitions, each with its own replicated stream, one leading node and standbys.

use serde::{Deserialize, Serialize};

/// The `[cluster]` table. Absent: one node, no NATS.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ClusterConfig {
    /// This node's name in the cluster: 1 to 64 letters, digits, `-` or `_`, unique
    /// among the nodes and the same across its restarts (its stores and marks are
    /// kept under it).
    pub node_id: String,
    /// URLs of the NATS servers (`nats://HOST:PORT`, `tls://…`); the client connects
    /// to one and fails over to the others.
    pub nats: Vec<String>,
    /// A URL of NATS's system account (`nats://USER:PASS@HOST:PORT`), through which the
    /// node reads each server's settings to prove that it syncs to disk before it
    /// acknowledges. Without it that cannot be shown, and the node refuses to start
    /// unless `allow_unsafe_nats` is set.
    pub nats_system: String,
    /// Partitions the sessions are spread over, fixed when the cluster is created
    /// (stored in the cluster; a node configured otherwise refuses to start).
    pub partitions: u32,
    /// JetStream replicas of each partition's stream: 3 in production (a majority of
    /// 3 servers survives the loss of one), 1 for tests on one server.
    pub replicas: u32,
    /// The size limit of each partition's stream on each server (MB); past it,
    /// appends are refused (`unavailable`) until trims make room. The servers'
    /// JetStream storage must hold `partitions` times this.
    pub stream_max_mb: u64,
    /// Nodes besides the leader that apply each partition's stream to their own store,
    /// so that a takeover starts warm.
    pub standbys: u32,
    /// How long a partition's lease lasts without renewal (ms); renewed every third of
    /// it. The lease decides who tries to lead, never what counts (the stream's
    /// validity rule does).
    pub lease_ms: u64,
    /// How long a graceful stop waits for the node's partitions to be taken over by
    /// others before it ends anyway (ms).
    pub drain_timeout_ms: u64,
    /// A node whose applied mark was not renewed for this long no longer holds back
    /// the trimming of a stream (ms).
    pub replica_timeout_ms: u64,
    /// A partition's leader trims its stream once more than this many groups are
    /// held past the last trim.
    pub trim_every: u64,
    /// At most this often (ms).
    pub trim_interval_ms: u64,
    /// How long a standby goes on gathering a partition's messages after the first
    /// of a batch before it applies (and syncs) them as one (ms); 0 applies what
    /// is there at once.
    pub standby_linger_ms: u64,
    /// Hold a connection to each server of `nats` besides the main one, and publish
    /// each led partition's appends on the one to its stream's leader: a publish
    /// and its acknowledgement then pass through no other server. Off: every
    /// append goes out on the main connection.
    pub publish_to_stream_leader: bool,
    /// Run on NATS servers that cannot be shown to sync to disk before they
    /// acknowledge (older than 2.10.23, or unknown): an acknowledged turn may then be
    /// lost to a power failure of a majority of them.
    pub allow_unsafe_nats: bool,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            node_id: String::new(),
            nats: Vec::new(),
            nats_system: String::new(),
            partitions: 16,
            replicas: 3,
            stream_max_mb: 1024,
            standbys: 1,
            lease_ms: 3_000,
            drain_timeout_ms: 10_000,
            replica_timeout_ms: 60_000,
            trim_every: 1024,
            trim_interval_ms: 5_000,
            standby_linger_ms: 10,
            publish_to_stream_leader: true,
            allow_unsafe_nats: false,
        }
    }
}

impl ClusterConfig {
    /// `cluster.nats_system`'s URLs (none when it is empty: the servers' sync
    /// setting is then not checked through the system account).
    pub fn system_urls(&self) -> Result<Vec<String>, String> {
        if self.nats_system.trim().is_empty() {
            return Ok(Vec::new());
        }
        turnd_proto::url_list::parse(&self.nats_system)
    }

    /// Every problem of the table, each naming its key.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        let id_ok = (1..=64).contains(&self.node_id.len())
            && self
                .node_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !id_ok {
            p.push(format!(
                "cluster.node_id {:?} must be 1 to 64 letters, digits, '-' or '_' (a name for \
                 this node, unique in the cluster and the same across its restarts)",
                self.node_id
            ));
        }
        if self.nats.is_empty() {
            p.push(
                "cluster.nats must list the NATS servers' URLs, such as [\"nats://10.0.0.1:4222\"]"
                    .into(),
            );
        }
        for url in &self.nats {
            if !["nats://", "tls://", "ws://", "wss://"]
                .iter()
                .any(|s| url.starts_with(s))
            {
                p.push(format!(
                    "cluster.nats {url:?} is not a NATS URL (nats://HOST:PORT or tls://HOST:PORT)"
                ));
            }
        }
        if let Err(e) = self.system_urls() {
            p.push(format!("cluster.nats_system: {e}"));
        }
        if !(1..=turnd_proto::MAX_PARTITIONS).contains(&self.partitions) {
            p.push(format!(
                "cluster.partitions must be between 1 and {}, not {}",
                turnd_proto::MAX_PARTITIONS,
                self.partitions
            ));
        }
        if ![1, 3, 5].contains(&self.replicas) {
            p.push(format!(
                "cluster.replicas must be 1, 3 or 5 (JetStream's replica counts), not {}",
                self.replicas
            ));
        }
        if self.standbys > 16 {
            p.push(format!(
                "cluster.standbys must be between 0 and 16, not {}",
                self.standbys
            ));
        }
        for (key, v, lo, hi) in [
            ("cluster.lease_ms", self.lease_ms, 300, 600_000),
            ("cluster.stream_max_mb", self.stream_max_mb, 1, 1 << 20),
            (
                "cluster.drain_timeout_ms",
                self.drain_timeout_ms,
                0,
                3_600_000,
            ),
            (
                "cluster.replica_timeout_ms",
                self.replica_timeout_ms,
                1_000,
                30 * 86_400_000,
            ),
            ("cluster.trim_every", self.trim_every, 1, 1 << 30),
            (
                "cluster.trim_interval_ms",
                self.trim_interval_ms,
                10,
                86_400_000,
            ),
            ("cluster.standby_linger_ms", self.standby_linger_ms, 0, 1000),
        ] {
            if !(lo..=hi).contains(&v) {
                p.push(format!("{key} must be between {lo} and {hi}, not {v}"));
            }
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_system_account_lists_urls_and_refuses_an_empty_entry() {
        let with = |v: &str| ClusterConfig {
            nats_system: v.into(),
            ..ClusterConfig::default()
        };
        assert_eq!(
            with(" nats://a:1 ,nats://b:2").system_urls(),
            Ok(vec!["nats://a:1".to_string(), "nats://b:2".to_string()])
        );
        assert_eq!(with("").system_urls(), Ok(Vec::new()));
        let p = with("nats://a:1, ,nats://b:2").problems();
        assert!(
            p.iter()
                .any(|e| e.starts_with("cluster.nats_system: URL 2 of 3")),
            "{p:?}"
        );
    }

    #[test]
    fn a_table_without_a_node_or_servers_says_what_to_write() {
        let p = ClusterConfig::default().problems();
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(p[0].contains("cluster.node_id"), "{p:?}");
        assert!(p[1].contains("cluster.nats"), "{p:?}");
        let ok = ClusterConfig {
            node_id: "n-1".into(),
            nats: vec!["nats://127.0.0.1:4222".into()],
            ..ClusterConfig::default()
        };
        assert!(ok.problems().is_empty(), "{:?}", ok.problems());
        let bad = ClusterConfig {
            node_id: "n 1".into(),
            nats: vec!["127.0.0.1:4222".into()],
            partitions: 0,
            replicas: 2,
            lease_ms: 10,
            trim_every: 0,
            trim_interval_ms: 1,
            standby_linger_ms: 5_000,
            ..ok
        };
        let p = bad.problems();
        for key in [
            "cluster.node_id",
            "not a NATS URL",
            "cluster.partitions",
            "cluster.replicas",
            "cluster.lease_ms",
            "cluster.trim_every",
            "cluster.trim_interval_ms",
            "cluster.standby_linger_ms",
        ] {
            assert!(p.iter().any(|x| x.contains(key)), "{key} in {p:?}");
        }
    }
}
