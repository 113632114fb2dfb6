//! A node of a turnd cluster (`docs/cluster.md`): the engines of the partitions it
//! leads, on one worker registry, and the way every request reaches the engine of
//! its partition, here or on the node that leads it.
//!
//! - [`slots`]: the node's loop: membership, leases, takeovers, standbys, hand-overs;
//! - [`route`]: which partition a request is for, and running it there (locally, or
//!   over NATS request/reply on the leader's `turnd.p.<p>.rpc`), cluster-wide reads
//!   gathered from every partition;
//! - [`rpc`]: the leader's side of a forwarded request;
//! - [`checkpoint`]: a partition's store copied from its leader by a node behind
//!   its trimmed stream;
//! - [`relay`], [`feed`]: a watch relayed from its partition's leader to the node
//!   its caller is connected to, resumed on the next leader when the partition moves;
//! - [`iii`]: what the iii endpoint needs of a node (its worker attach, turns with
//!   settings of their own, the endpoint's records shared by every node);
//! - [`placement`]: where each partition would rather be;
//! - [`status`]: what a node shows of the cluster (`GET /cluster`, `/metrics`);
//! - [`view`]: the cluster read from NATS by any machine (`turnd cluster status`).
//!
//! Safety rests on the log (`turnd-cluster`): a deposed leader's appends never count,
//! so the lease and the placement only decide who tries.

mod checkpoint;
mod feed;
pub mod iii;
pub mod placement;
mod relay;
mod route;
mod rpc;
pub mod servers;
mod slots;
pub mod status;
pub mod view;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::time::Duration;

use anyhow::Context;
use parking_lot::{Mutex, RwLock};
use tokio_util::sync::CancellationToken;
use turnd_cluster::checkpoint::Checkpoints;
use turnd_cluster::lease::{Lease, Owners};
use turnd_cluster::marks::Marks;
use turnd_cluster::members::Members;
use turnd_cluster::standby::Standby;
use turnd_cluster::{JetStreamLog, Nats};
use turnd_engine::{Clock, Engine, Outbox, WorkerCaps, Workers};
use turnd_proto::{ErrorBody, HelloArgs, Reconciled};

use crate::cluster_config::ClusterConfig;
use crate::config::Config;

/// A partition this node leads.
pub(crate) struct Led {
    pub engine: Engine,
    pub log: JetStreamLog,
    /// Shared with the forwarded requests' server, which serves only while it runs.
    pub lease: Arc<Mutex<Lease>>,
    /// Whether forwarded requests still start on the engine ([`rpc`]): closed
    /// (under the write lock) when the node hands the partition over.
    pub intake: RwLock<bool>,
    /// The requests running on the engine (local and forwarded): a hand-over waits
    /// for them before it stops the log.
    pub inflight: tokio_util::task::TaskTracker,
    pub kv: Arc<turnd_store::LoggedKv>,
}

impl Led {
    /// A place among the partition's requests ([`Led::inflight`]), held while the
    /// request runs; none once the intake closed for a hand-over (the request then
    /// takes the forward path, or is answered "not leading").
    pub fn admit(&self) -> Option<tokio_util::task::task_tracker::TaskTrackerToken> {
        let open = self.intake.read();
        (*open).then(|| self.inflight.token())
    }

    /// Close the intake: no request is admitted once this returns, and
    /// [`Led::inflight`] ends with the last one admitted before.
    pub fn close_intake(&self) {
        *self.intake.write() = false;
        self.inflight.close();
    }
}

/// Whether `lease` runs now by this node's own clock. A partition's requests, made
/// here or forwarded here, run on its engine only then: past it another node may
/// lead already, and this engine's reads would miss that leader's writes.
pub(crate) fn lease_runs(lease: &Mutex<Lease>) -> bool {
    lease.lock().runs_at(turnd_cluster::members::now_ms())
}

/// A running node. See the module documentation.
pub struct Node {
    pub(crate) id: String,
    pub(crate) cfg: Config,
    pub(crate) cluster: ClusterConfig,
    pub(crate) nats: Arc<Nats>,
    pub(crate) owners: Owners,
    pub(crate) marks: Marks,
    /// Checkpoints of stores on their way between nodes.
    pub(crate) checkpoints: Checkpoints,
    pub(crate) members: Members,
    pub(crate) workers: Workers,
    pub(crate) clock: Clock,
    pub(crate) led: RwLock<HashMap<u32, Arc<Led>>>,
    /// Each partition's leader as the last round (or a forward) saw its lease.
    pub(crate) leaders: RwLock<HashMap<u32, String>>,
    /// The members that take partitions, as the last round read them.
    pub(crate) live: RwLock<Vec<String>>,
    pub(crate) standbys: Mutex<HashMap<u32, Standby>>,
    /// Partitions whose stream no longer holds what this node's store lacks: the
    /// node copies the leader's checkpoint before it leads or keeps a standby.
    pub(crate) behind: Mutex<std::collections::HashSet<u32>>,
    /// Partitions being taken over or handed over now (the loop skips them).
    pub(crate) busy: Mutex<std::collections::HashSet<u32>>,
    /// When the owners bucket last failed to answer this node (ms, 0: never).
    pub(crate) owners_silent_at: std::sync::atomic::AtomicU64,
    /// Since when this node has read each partition's lease absent (ms).
    pub(crate) absent_since: Mutex<HashMap<u32, u64>>,
    /// The nodes' heartbeats, as this node heard them.
    pub(crate) beats: slots::Heartbeats,
    pub(crate) boot_id: String,
    /// Set when the node drains: it gives up its partitions and takes no more.
    pub(crate) draining: CancellationToken,
    /// Ends the node's loop.
    pub(crate) stop: CancellationToken,
    /// Cancelled when the node is dropped: ends its forwards' subscription, which
    /// outlives the loop and the drain ([`rpc`]).
    pub(crate) gone: CancellationToken,
    /// Where this node's listeners are, as members show them.
    pub(crate) endpoints: (String, String),
    /// Forwarded requests, takeovers and hand-overs counted for `/metrics`.
    pub(crate) counters: status::Counters,
    /// The node's loop, awaited by a drain (so that a takeover in progress ends, and
    /// is handed over, before the node stops).
    pub(crate) looping: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The watches of this node's connections, each relayed from its leader.
    pub(crate) relays: relay::Relays,
    /// The feeds this node runs as a leader, for watches of any node.
    pub(crate) feeds: Arc<std::sync::atomic::AtomicU64>,
    /// What is not yet proven of the NATS servers ([`servers`]).
    pub(crate) servers: servers::Checks,
}

impl Drop for Node {
    fn drop(&mut self) {
        self.gone.cancel();
    }
}

impl Node {
    /// Connect to NATS, check that its servers sync before they acknowledge (or that
    /// the operator allowed otherwise), bind the cluster's buckets and start the
    /// node's loop. `endpoints`: this node's WebSocket and admin URLs.
    pub async fn start(cfg: Config, endpoints: (String, String)) -> anyhow::Result<Arc<Node>> {
        let cluster = cfg
            .cluster
            .clone()
            .context("no [cluster] table in the config")?;
        let replicas = cluster.replicas as usize;
        let (sys, report) = servers::at_start(&cluster).await?;
        let nats = Nats::connect(&cluster.nats, &format!("turnd-{}", cluster.node_id))
            .await
            .context("connect to NATS (cluster.nats)")?;
        // The loop tries again every third of a lease: a lease or membership
        // request not answered by then is tried again rather than waited for.
        nats.set_control_timeout(Duration::from_millis((cluster.lease_ms / 3).max(100)));
        if cluster.publish_to_stream_leader && cluster.nats.len() > 1 {
            nats.connect_each(&cluster.nats, &format!("turnd-{}", cluster.node_id))
                .await
                .context("connect to each NATS server (cluster.publish_to_stream_leader)")?;
        }
        let owners = Owners::open(&nats, replicas)
            .await
            .context("owners bucket")?;
        let marks = Marks::open(&nats, replicas).await.context("marks bucket")?;
        let checkpoints = Checkpoints::open(&nats, replicas)
            .await
            .context("checkpoints bucket")?;
        let members = Members::open(&nats, replicas)
            .await
            .context("members bucket")?;
        slots::check_partitions(&nats, &cluster).await?;
        let node = Arc::new(Node {
            id: cluster.node_id.clone(),
            cluster,
            cfg,
            nats,
            owners,
            marks,
            checkpoints,
            members,
            workers: Workers::new(),
            clock: Clock::new(),
            led: RwLock::new(HashMap::new()),
            live: RwLock::new(Vec::new()),
            leaders: RwLock::new(HashMap::new()),
            standbys: Mutex::new(HashMap::new()),
            behind: Mutex::new(Default::default()),
            busy: Mutex::new(Default::default()),
            owners_silent_at: std::sync::atomic::AtomicU64::new(0),
            absent_since: Mutex::new(HashMap::new()),
            beats: slots::Heartbeats::default(),
            boot_id: uuid::Uuid::new_v4().simple().to_string(),
            draining: CancellationToken::new(),
            stop: CancellationToken::new(),
            gone: CancellationToken::new(),
            endpoints,
            counters: status::Counters::default(),
            looping: Mutex::new(None),
            relays: relay::Relays::default(),
            feeds: Arc::default(),
            servers: parking_lot::Mutex::new(servers::ServerChecks {
                pending: report.pending,
                unproven: Vec::new(),
            }),
        });
        if let Some(sys) = sys {
            servers::recheck(&node, sys);
        }
        node.wake_engines();
        checkpoint::serve(&node)
            .await
            .context("serve checkpoints")?;
        rpc::serve(&node)
            .await
            .context("serve forwarded requests")?;
        *node.looping.lock() = Some(slots::spawn(&node));
        Ok(node)
    }

    /// The registry hands each session it wakes to the engine of its partition.
    fn wake_engines(self: &Arc<Self>) {
        let weak: Weak<Node> = Arc::downgrade(self);
        self.workers.on_wake(Arc::new(move |session_id: Arc<str>| {
            let Some(node) = weak.upgrade() else { return };
            let p = turnd_proto::session_partition(&session_id, node.cluster.partitions);
            if let Some(led) = node.led(p) {
                tokio::spawn(async move { led.engine.drive(&session_id).await });
            }
        }));
    }

    /// The marks a partition's log trims by: they wait for the partition's preferred
    /// leader and standbys by the placement, even before those wrote a mark.
    pub(crate) fn trim_marks(self: &Arc<Self>) -> Marks {
        let weak: Weak<Node> = Arc::downgrade(self);
        self.marks.clone().requiring(Arc::new(move |p| {
            weak.upgrade()
                .and_then(|n| {
                    let live = n.live.read().clone();
                    placement::place(p, &live, n.cluster.standbys as usize)
                })
                .map(|pl| {
                    let mut nodes = pl.standbys;
                    nodes.push(pl.leader);
                    nodes
                })
                .unwrap_or_default()
        }))
    }

    /// Record who leads partition `p` by its lease as read at `now_ms` (nobody when
    /// there is none, or it ran out and its holder's heartbeat was not heard within
    /// a lease), for forwards; that node. A holder whose lease ran out while the
    /// owners bucket did not answer may lead on ([`slots`]); asked, it answers that
    /// it does not lead when it does not.
    pub(crate) fn note_leader(&self, p: u32, lease: Option<&Lease>, now_ms: u64) -> Option<String> {
        let leader = lease
            .filter(|l| {
                l.runs_at(now_ms)
                    || self
                        .beats
                        .heard_within(&l.owner.node, now_ms, self.cluster.lease_ms)
            })
            .map(|l| l.owner.node.clone());
        match &leader {
            Some(l) => self.leaders.write().insert(p, l.clone()),
            None => self.leaders.write().remove(&p),
        };
        leader
    }

    /// Note that the owners bucket failed to answer a request at `now_ms`.
    pub(crate) fn owners_unanswered(&self, now_ms: u64) {
        self.owners_silent_at
            .fetch_max(now_ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the owners bucket failed to answer this node within `ms` of `now_ms`.
    pub(crate) fn owners_silent_within(&self, now_ms: u64, ms: u64) -> bool {
        let at = self
            .owners_silent_at
            .load(std::sync::atomic::Ordering::Relaxed);
        now_ms.saturating_sub(at) < ms
    }

    /// Partition `p`'s engine, when this node leads it.
    pub(crate) fn led(&self, p: u32) -> Option<Arc<Led>> {
        self.led.read().get(&p).cloned()
    }

    /// Partition `p`'s engine for a request, with its place among the partition's
    /// requests ([`Led::admit`], held while the request runs): only while this node
    /// leads `p` and its lease runs by its own clock (past it, another node may lead
    /// already, and this engine's reads would be stale until the next round notices
    /// the loss), and the intake is open. None: the lease's holder must answer.
    pub(crate) fn serving(
        &self,
        p: u32,
    ) -> Option<(Arc<Led>, tokio_util::task::task_tracker::TaskTrackerToken)> {
        let led = self.led(p).filter(|l| lease_runs(&l.lease))?;
        let admitted = led.admit()?;
        Some((led, admitted))
    }

    /// Every partition this node leads.
    pub(crate) fn all_led(&self) -> Vec<(u32, Arc<Led>)> {
        let mut v: Vec<_> = self
            .led
            .read()
            .iter()
            .map(|(p, l)| (*p, l.clone()))
            .collect();
        v.sort_by_key(|(p, _)| *p);
        v
    }

    /// A partition's store options: as configured, without windows (a window's
    /// files are local, and do not carry to the node that takes over).
    pub(crate) fn store_options(&self) -> anyhow::Result<turnd_store::LoggedOptions> {
        let mut o = crate::store_options(&self.cfg)?;
        o.windows.window_ms = 0;
        Ok(o)
    }

    /// Where partition `p`'s local store lives.
    pub(crate) fn dir(&self, p: u32) -> PathBuf {
        self.cfg.storage.data_dir.join(format!("p{p}"))
    }

    pub fn boot_id(&self) -> &str {
        &self.boot_id
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// The worker registry every engine of the node dispatches to.
    pub fn workers(&self) -> &Workers {
        &self.workers
    }

    /// A worker's `hello`: attached once, then reconciled by each engine for the
    /// invocations of its own partitions.
    pub async fn worker_hello(
        &self,
        hello: &HelloArgs,
        outbox: Outbox,
    ) -> Result<Reconciled, ErrorBody> {
        self.worker_hello_with(hello, outbox, WorkerCaps::V1).await
    }

    /// [`Node::worker_hello`] of a worker that can do what `caps` says.
    pub async fn worker_hello_with(
        &self,
        hello: &HelloArgs,
        outbox: Outbox,
        caps: WorkerCaps,
    ) -> Result<Reconciled, ErrorBody> {
        let attached = self
            .workers
            .attach(hello, outbox, caps, self.clock.now_ms())?;
        let mut rec = Reconciled::default();
        for (_, led) in self.all_led() {
            match led.engine.reconcile_worker(&attached).await {
                Ok(r) => {
                    rec.kept.extend(r.kept);
                    rec.redispatched.extend(r.redispatched);
                    rec.unknown.extend(r.unknown);
                }
                Err(e) => {
                    self.worker_disconnected(&attached.worker_id, &attached.conn_id)
                        .await;
                    return Err(e.into());
                }
            }
        }
        Ok(rec)
    }

    /// A worker connection ended: detached once, driven by each engine.
    pub async fn worker_disconnected(&self, worker_id: &str, conn_id: &str) {
        let Some(sessions) = self.workers.detach(worker_id, conn_id, self.clock.now_ms()) else {
            return;
        };
        for (_, led) in self.all_led() {
            led.engine.drive_owned(&sessions).await;
        }
    }

    /// A connection ended: its watches end.
    pub fn connection_closed(&self, conn_id: &str) {
        self.relays.connection_closed(conn_id);
    }

    /// Hand every partition over and leave the cluster: the node says it drains,
    /// renews its leases and gives every partition up at once (its requests
    /// settled, then its log stopped, its engine stopped, its lease released) so
    /// that the nodes that rank next take them at once; meanwhile this node's
    /// connections are still served (forwarded). Waits at most
    /// `cluster.drain_timeout_ms`.
    pub async fn drain(self: &Arc<Self>) {
        self.draining.cancel();
        self.stop.cancel();
        let limit = Duration::from_millis(self.cluster.drain_timeout_ms);
        let looping = self.looping.lock().take();
        let drained = async {
            if let Some(l) = looping {
                if let Err(e) = l.await {
                    tracing::warn!("cluster: the node's loop ended with: {e}");
                }
            }
            slots::drain(self).await;
        };
        if tokio::time::timeout(limit, drained).await.is_err() {
            tracing::warn!("cluster: drain took over {limit:?}; stopping anyway");
        }
    }
}
