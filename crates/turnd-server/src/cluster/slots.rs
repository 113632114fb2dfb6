//! The node's loop, every third of `cluster.lease_ms`: renew its membership; for
//! each partition, renew the lease it holds (or stop leading when it lost it),
//! take over a partition whose lease is free when the placement ranks this node
//! first (or when its lease ran out a whole lease ago and this node is one of its
//! standbys), hand a partition over to its preferred leader when that node is back,
//! and keep the standbys the placement gives this node.
//!
//! A takeover stops the partition's standby here (its store is then warm), opens
//! the store on the partition's stream as its leader (`JetStreamLog::lead` appends
//! the fence that deposes any other writer), opens an engine on it with the node's
//! worker registry, records its epoch in the lease, and serves forwarded requests.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures_util::StreamExt;
use tokio_util::task::TaskTracker;
use turnd_cluster::lease::{Lease, Owner};
use turnd_cluster::members::{self, Member};
use turnd_cluster::standby::Standby;
use turnd_cluster::{JetStreamLog, LogConfig, LogError, Nats};
use turnd_engine::{Engine, Partition};
use turnd_store::{open_when_unlocked, LoggedKv, Store};

use super::placement::{place, should_take, LeaseView, Placement};
use super::{Led, Node};
use crate::cluster_config::ClusterConfig;

/// The subjects of the nodes' heartbeats, `turnd.alive.<node>`: core NATS, routed
/// between the servers whatever JetStream's streams are doing.
const BEAT_PREFIX: &str = "turnd.alive.";

/// When this node last heard each node's heartbeat (its own clock, ms). Every node
/// sends one every third of a lease, on the loop that renews its leases.
#[derive(Default)]
pub(crate) struct Heartbeats {
    heard: parking_lot::Mutex<std::collections::HashMap<String, u64>>,
}

impl Heartbeats {
    /// Whether `node`'s heartbeat was heard within `ms` of `now`.
    pub(crate) fn heard_within(&self, node: &str, now: u64, ms: u64) -> bool {
        self.heard
            .lock()
            .get(node)
            .is_some_and(|t| now.saturating_sub(*t) < ms)
    }

    /// Listen to every node's heartbeat until the node stops.
    async fn listen(node: Arc<Node>) {
        let mut sub = match node
            .nats
            .client()
            .subscribe(format!("{BEAT_PREFIX}*"))
            .await
        {
            Ok(sub) => sub,
            Err(e) => {
                tracing::warn!("cluster: listen to the nodes' heartbeats: {e}");
                return;
            }
        };
        loop {
            let msg = tokio::select! {
                m = sub.next() => m,
                _ = node.stop.cancelled() => None,
            };
            let Some(msg) = msg else { break };
            if let Some(from) = msg.subject.as_str().strip_prefix(BEAT_PREFIX) {
                node.beats
                    .heard
                    .lock()
                    .insert(from.to_string(), members::now_ms());
            }
        }
    }
}

/// Renew every lease this node holds, all at once; give up each partition whose
/// lease was lost or whose log takes no more appends (a node that took it over
/// wrote after this one: the lease goes to a node that can write).
async fn keep_leases(node: &Arc<Node>, now: u64) {
    let led = node.all_led();
    let kept = futures_util::future::join_all(led.iter().map(|(p, led)| async move {
        // Being handed over: the hand-over releases the lease.
        if node.busy.lock().contains(p) {
            return None;
        }
        if let Some(why) = led.log.status().failure {
            return Some((*p, format!("its log takes no more appends: {why}")));
        }
        if !renew(node, led, now).await {
            return Some((*p, "its lease was lost".to_string()));
        }
        None
    }))
    .await;
    drop(led);
    for (p, why) in kept.into_iter().flatten() {
        step_down(node, p, &why, false).await;
    }
}

/// Refuse to join a cluster created with another number of partitions.
pub(super) async fn check_partitions(nats: &Arc<Nats>, c: &ClusterConfig) -> anyhow::Result<()> {
    let owners = turnd_cluster::lease::Owners::open(nats, c.replicas as usize).await?;
    let stored = owners.partitions(c.partitions).await?;
    if stored != c.partitions {
        anyhow::bail!(
            "cluster.partitions is {} but the cluster was created with {stored}: the number of \
             partitions is fixed when a cluster is created; set cluster.partitions = {stored}",
            c.partitions
        );
    }
    Ok(())
}

/// Start the node's loop, and beside it the renewal of the leases it holds.
pub(super) fn spawn(node: &Arc<Node>) -> tokio::task::JoinHandle<()> {
    let tick = Duration::from_millis((node.cluster.lease_ms / 3).max(50));
    tokio::spawn(Heartbeats::listen(node.clone()));
    // The heartbeat, and the leases this node holds, renewed on a loop of their
    // own, all at once: a renewal waits out its bound when the owners bucket does
    // not answer, and neither that wait nor the main loop's (membership, marks,
    // takeovers) may delay a renewal past what the partition may serve.
    let renewing = node.clone();
    tokio::spawn(async move {
        loop {
            let beat = format!("{BEAT_PREFIX}{}", renewing.id);
            if let Err(e) = renewing.nats.client().publish(beat, "".into()).await {
                tracing::debug!("cluster: send a heartbeat: {e}");
            }
            keep_leases(&renewing, members::now_ms()).await;
            tokio::select! {
                _ = tokio::time::sleep(tick) => {}
                _ = renewing.stop.cancelled() => break,
            }
        }
    });
    let node = node.clone();
    tokio::spawn(async move {
        loop {
            if let Err(e) = round(&node).await {
                tracing::warn!("cluster: {e:#}");
            }
            tokio::select! {
                _ = tokio::time::sleep(tick) => {}
                _ = node.stop.cancelled() => break,
            }
        }
    })
}

/// One round of the loop.
async fn round(node: &Arc<Node>) -> anyhow::Result<()> {
    let now = members::now_ms();
    // The members only place partitions: when their bucket does not answer (its
    // stream electing a leader), the round goes on with the members it last read,
    // so that the leases (another bucket, another stream) are still renewed and
    // taken.
    if let Err(e) = put_member(node, now, node.draining.is_cancelled()).await {
        tracing::warn!("cluster: renew membership: {e:#}");
    }
    let live = match node.members.all_bounded().await {
        Ok(all) => {
            let live = members::placeable(&all, now);
            *node.live.write() = live.clone();
            live
        }
        Err(e) => {
            tracing::warn!("cluster: read the members (the last read is used): {e:#}");
            node.live.read().clone()
        }
    };
    put_marks(node).await;
    let mut hand_over = Vec::new();
    for p in 0..node.cluster.partitions {
        if node.busy.lock().contains(&p) {
            continue;
        }
        let placement = place(p, &live, node.cluster.standbys as usize);
        match partition_round(node, p, placement, now).await {
            Ok(true) => hand_over.push(p),
            Ok(false) => {}
            Err(e) => tracing::warn!(partition = p, "cluster: {e:#}"),
        }
    }
    // Hand-overs wait for their partitions' requests to settle: they run once every
    // lease of the round is renewed, all at once, so that none delays another
    // partition's renewal past its lease.
    futures_util::future::join_all(
        hand_over
            .iter()
            .map(|p| step_down(node, *p, "handed over to its preferred leader", true)),
    )
    .await;
    Ok(())
}

/// Renew this node's membership (whether it drains: a draining node is placed
/// nowhere).
async fn put_member(node: &Node, now: u64, draining: bool) -> anyhow::Result<()> {
    node.members
        .put(&Member {
            node: node.id.clone(),
            until_ms: now + node.cluster.lease_ms,
            ws: node.endpoints.0.clone(),
            admin: node.endpoints.1.clone(),
            draining,
        })
        .await?;
    Ok(())
}

/// What this node does for partition `p` this round; whether it hands the
/// partition over to its preferred leader (once the round's leases are renewed).
async fn partition_round(
    node: &Arc<Node>,
    p: u32,
    placement: Option<Placement>,
    now: u64,
) -> anyhow::Result<bool> {
    let me = node.id.as_str();
    if let Some(led) = node.led(p) {
        // Its lease is renewed by [`keep_leases`].
        // Its preferred leader is back and has caught up as a standby: hand it over.
        return Ok(match placement.as_ref().filter(|pl| pl.leader != me) {
            Some(pl) => caught_up(node, &led, p, &pl.leader).await,
            None => false,
        });
    }
    let Some(pl) = placement else {
        return Ok(false);
    };
    if node.draining.is_cancelled() {
        return Ok(false);
    }
    if node.owners_silent_within(members::now_ms(), node.cluster.lease_ms / 3) {
        // The owners bucket did not answer lately: its holder may be leading on
        // ([`renew`]), and a read now would wait out its bound for nothing.
        return Ok(false);
    }
    let held = match node.owners.get(p).await {
        Ok(h) => h,
        Err(e) => {
            node.owners_unanswered(members::now_ms());
            return Err(e.into());
        }
    };
    node.note_leader(p, held.as_ref(), now);
    let absent_for = {
        let mut absent = node.absent_since.lock();
        match &held {
            None => now.saturating_sub(*absent.entry(p).or_insert(now)),
            Some(_) => {
                absent.remove(&p);
                0
            }
        }
    };
    let should_lead = should_take(
        &pl,
        &LeaseView {
            me,
            now,
            lease_ms: node.cluster.lease_ms,
            held: held.as_ref(),
            absent_for,
            holder_heard: held.as_ref().is_some_and(|l| {
                node.beats
                    .heard_within(&l.owner.node, now, node.cluster.lease_ms)
            }),
            owners_silent: node.owners_silent_within(now, 2 * node.cluster.lease_ms),
        },
    );
    // The preferred leader keeps a standby too while another node leads, so that it
    // is warm when it takes the partition back.
    let standby_here = pl.holds(me);
    // A store behind the stream cannot lead: it copies the leader's checkpoint first.
    let behind = node.behind.lock().contains(&p);
    if should_lead && !behind {
        take_over(node, p, held, now).await?;
    } else if standby_here {
        keep_standby(node, p)?;
    } else {
        // Not placed here: no standby, and nothing to copy.
        node.behind.lock().remove(&p);
        if let Some(s) = node.standbys.lock().remove(&p) {
            stop_standby(s);
        }
    }
    Ok(false)
}

/// Whether `node_id`'s standby of partition `p` has applied nearly everything this
/// node's log holds (so that a hand-over to it starts warm and the stream it needs
/// is still there).
async fn caught_up(node: &Arc<Node>, led: &Led, p: u32, node_id: &str) -> bool {
    let Ok(marks) = node.marks.all(p).await else {
        return false;
    };
    let last = led.log.status().last_seq;
    marks
        .iter()
        .find(|m| m.node == node_id)
        .is_some_and(|m| turnd_cluster::log::seq_of(m.mark) + HANDOVER_LAG >= last)
}

/// How far (in messages) a preferred leader's standby may be behind for a hand-over.
const HANDOVER_LAG: u64 = 16;

/// Renew `led`'s lease; whether it is still this node's.
async fn renew(node: &Arc<Node>, led: &Led, now: u64) -> bool {
    let lease = led.lease.lock().clone();
    let owner = Owner {
        node: node.id.clone(),
        epoch: led.log.epoch(),
        until_ms: Some(now + node.cluster.lease_ms),
    };
    match node.owners.renew(&lease, owner).await {
        Ok(Some(l)) => {
            *led.lease.lock() = l;
            true
        }
        Ok(None) => false,
        // The owners bucket does not answer (its stream electing a leader after a
        // server died, or NATS unreachable). The partition's stream, another stream
        // led by another server perhaps, tells whether a node fenced it: a node
        // taking the partition over appends its fence first. While it says none
        // did, keep leading, and serve for a lease past the read (requests run only
        // while the lease runs by this node's clock). A contender that met the
        // bucket silent too and hears this node's heartbeat does not take the
        // lease within two leases of that silence ([`should_take`]), and this
        // node's renewal, the next round after the bucket answers again, keeps the
        // partition here. When the stream does not answer either, lead on only
        // while the lease runs.
        Err(e) => {
            tracing::warn!(partition = lease.partition, "cluster: renew the lease: {e}");
            let asked = members::now_ms();
            node.owners_unanswered(asked);
            match led.log.still_ends_here().await {
                Ok(true) => {
                    let mut l = led.lease.lock();
                    let until = asked + node.cluster.lease_ms;
                    if l.owner.until_ms.is_some_and(|u| u < until) {
                        l.owner.until_ms = Some(until);
                    }
                    true
                }
                Ok(false) => {
                    tracing::warn!(
                        partition = lease.partition,
                        "cluster: the partition's stream no longer ends at this leader's message"
                    );
                    false
                }
                Err(s) => {
                    tracing::warn!(
                        partition = lease.partition,
                        "cluster: the partition's stream does not answer either: {s}"
                    );
                    led.lease.lock().runs_at(now)
                }
            }
        }
    }
}

/// Take partition `p`'s lease and lead it.
async fn take_over(node: &Arc<Node>, p: u32, held: Option<Lease>, now: u64) -> anyhow::Result<()> {
    let owner = Owner {
        node: node.id.clone(),
        epoch: 0,
        until_ms: Some(now + node.cluster.lease_ms),
    };
    let taken = match held {
        None => node.owners.acquire(p, owner, now).await,
        Some(h) => node.owners.take(p, owner, h.revision).await,
    };
    let lease = match taken {
        Ok(l) => l,
        Err(e) => {
            node.owners_unanswered(members::now_ms());
            return Err(e.into());
        }
    };
    let Some(lease) = lease else { return Ok(()) };
    node.busy.lock().insert(p);
    let started = std::time::Instant::now();
    let r = lead(node, p, lease.clone()).await;
    node.busy.lock().remove(&p);
    match r {
        Ok(()) => {
            node.counters.takeovers.inc();
            tracing::info!(
                partition = p,
                millis = started.elapsed().as_millis() as u64,
                "cluster: leading partition"
            );
            Ok(())
        }
        Err(e) => {
            if is_behind(&e) {
                node.behind.lock().insert(p);
            }
            if let Err(r) = node.owners.release(&lease).await {
                tracing::warn!(
                    partition = p,
                    "cluster: release after a failed takeover: {r}"
                );
            }
            Err(e.context(format!("take over partition {p}")))
        }
    }
}

/// Whether `e` says the store is behind the stream ([`LogError::Behind`]).
fn is_behind(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<LogError>()
            .is_some_and(|l| matches!(l, LogError::Behind { .. }))
    })
}

/// Open partition `p`'s store as its leader, and its engine; serve it.
async fn lead(node: &Arc<Node>, p: u32, lease: Lease) -> anyhow::Result<()> {
    let standby = node.standbys.lock().remove(&p);
    let (kv, log) = open_leading(node, p, standby).await?;
    let kv = Arc::new(kv);
    let mut ecfg = node.cfg.engine_config();
    ecfg.partition = Some(Partition {
        index: p,
        count: node.cluster.partitions,
    });
    let engine = Engine::open_with(Store::new(kv.clone()), ecfg, node.workers.clone())
        .await
        .context("recover the partition's turns")?;
    let led = Arc::new(Led {
        engine,
        log,
        lease: Arc::new(parking_lot::Mutex::new(lease)),
        intake: parking_lot::RwLock::new(true),
        inflight: TaskTracker::new(),
        kv,
    });
    // The epoch into the lease at once, for `cluster status`.
    if !renew(node, &led, members::now_ms()).await {
        led.log.stop();
        led.engine.shutdown();
        anyhow::bail!("lost the lease while opening");
    }
    node.led.write().insert(p, led);
    Ok(())
}

/// The store of partition `p` in its directory, on its stream, led by this node.
async fn open_leading(
    node: &Arc<Node>,
    p: u32,
    standby: Option<Standby>,
) -> anyhow::Result<(LoggedKv, JetStreamLog)> {
    let nats = node.nats.clone();
    let lcfg = log_config(node, p);
    let me = node.id.clone();
    let dir = node.dir(p);
    let marks = node.trim_marks();
    let opts = node.store_options()?;
    tokio::task::spawn_blocking(move || -> anyhow::Result<(LoggedKv, JetStreamLog)> {
        if let Some(s) = standby {
            if let Err(e) = s.stop() {
                tracing::warn!(partition = p, "cluster: the standby had stopped: {e}");
            }
        }
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let mut handle = None;
        let mut behind = None;
        // The standby just stopped (or a checkpoint was just installed) on this
        // directory: sled may hold its file lock a moment longer.
        let opened = open_when_unlocked(|| {
            LoggedKv::open_with_log(&dir, opts, |applied| {
                let opened = JetStreamLog::lead(&nats, &lcfg, &me, applied, Some(marks.clone()))
                    .inspect_err(|e| {
                        behind = Some(e.clone()).filter(|e| matches!(e, LogError::Behind { .. }))
                    })?;
                handle = Some(opened.log.clone());
                Ok(opened.boxed())
            })
        });
        if let Some(b) = behind {
            return Err(anyhow::Error::new(b));
        }
        let (kv, replayed) =
            opened.with_context(|| format!("open {} on its stream", dir.display()))?;
        tracing::info!(
            partition = p,
            records = replayed.records,
            "cluster: replayed the stream past the local store"
        );
        let log = handle.context("the log was not opened")?;
        Ok((kv, log))
    })
    .await
    .context("the takeover's thread")?
}

/// Partition `p`'s log settings from the config.
fn log_config(node: &Node, p: u32) -> LogConfig {
    LogConfig {
        replicas: node.cluster.replicas as usize,
        max_bytes: i64::try_from(node.cluster.stream_max_mb.saturating_mul(1 << 20))
            .unwrap_or(i64::MAX),
        replica_timeout: Duration::from_millis(node.cluster.replica_timeout_ms),
        trim_every: node.cluster.trim_every as usize,
        trim_interval: Duration::from_millis(node.cluster.trim_interval_ms),
        standby_linger: Duration::from_millis(node.cluster.standby_linger_ms),
        ..LogConfig::new(p)
    }
}

/// Write each standby's durable applied mark (every round, so that its revision
/// moves and the leader counts it live while it runs).
async fn put_marks(node: &Arc<Node>) {
    let marks: Vec<(u32, u64)> = node
        .standbys
        .lock()
        .iter()
        .filter(|(_, s)| s.status().error.is_none())
        .map(|(p, s)| (*p, s.status().applied))
        .collect();
    for (p, applied) in marks {
        if let Err(e) = node.marks.put(p, &node.id, applied).await {
            tracing::warn!(partition = p, "cluster: put the standby's mark: {e}");
        }
    }
}

/// Keep a standby of partition `p` running here (copying the leader's checkpoint
/// first when the stream no longer holds what this node's store lacks).
fn keep_standby(node: &Arc<Node>, p: u32) -> anyhow::Result<()> {
    let mut standbys = node.standbys.lock();
    let behind = standbys.get(&p).is_some_and(|s| s.status().behind);
    if behind || node.behind.lock().contains(&p) {
        let old = standbys.remove(&p);
        drop(standbys);
        copy_checkpoint(node, p, old);
        return Ok(());
    }
    if let Some(s) = standbys.get(&p) {
        if s.status().error.is_none() {
            return Ok(());
        }
    }
    if let Some(old) = standbys.remove(&p) {
        stop_standby(old);
    }
    let dir = node.dir(p);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let s = Standby::start(
        &node.nats,
        &log_config(node, p),
        &dir,
        node.store_options()?,
    )
    .with_context(|| format!("start the standby of partition {p}"))?;
    standbys.insert(p, s);
    Ok(())
}

/// Copy partition `p`'s store from its leader, in the background (the loop passes
/// the partition by meanwhile), after the standby `old` stopped; a standby starts
/// from it in a later round.
fn copy_checkpoint(node: &Arc<Node>, p: u32, old: Option<Standby>) {
    node.behind.lock().insert(p);
    node.busy.lock().insert(p);
    let node = node.clone();
    tokio::spawn(async move {
        if let Some(s) = old {
            let stopped = tokio::task::spawn_blocking(move || s.stop()).await;
            tracing::debug!(
                partition = p,
                "cluster: the standby behind stopped: {stopped:?}"
            );
        }
        match super::checkpoint::copy(&node, p).await {
            Ok(_) => {
                node.behind.lock().remove(&p);
            }
            Err(e) => tracing::warn!(
                partition = p,
                "cluster: copy the leader's checkpoint: {e:#}"
            ),
        }
        node.busy.lock().remove(&p);
    });
}

/// Stop a standby off the async threads (it joins its thread).
fn stop_standby(s: Standby) {
    tokio::task::spawn_blocking(move || {
        if let Err(e) = s.stop() {
            tracing::debug!("cluster: standby stopped with: {e}");
        }
    });
}

/// Stop leading partition `p`, gracefully: it takes no new requests (this node's
/// own go the forward path, which waits for the next leader; the forwards'
/// subscription is drained, so that what NATS delivered is still run), the
/// requests in progress settle and are answered (for at most a third of a lease,
/// so that the lease still runs when it is released), and only then is the log
/// stopped (an append still in flight is in doubt, and its connection is closed
/// rather than answered), the engine shut down, the store closed and the lease
/// released, so that the next leader takes the partition at once. Without
/// `settle` (its lease lost, its log deposed: another node may lead it already)
/// nothing is waited for.
pub(super) async fn step_down(node: &Arc<Node>, p: u32, why: &str, settle: bool) {
    let Some(led) = node.led.write().remove(&p) else {
        return;
    };
    node.busy.lock().insert(p);
    tracing::info!(partition = p, "cluster: stepping down: {why}");
    // No request starts on the engine after this; a forward is answered "not
    // leading".
    led.close_intake();
    // A log that takes no more appends has nothing to settle.
    if settle && led.log.status().failure.is_none() {
        settled(&led, Duration::from_millis(node.cluster.lease_ms / 3)).await;
    }
    led.engine.shutdown();
    led.log.stop();
    let lease = led.lease.lock().clone();
    let kv = led.kv.clone();
    drop(led);
    let closed = tokio::task::spawn_blocking(move || kv.close()).await;
    if !matches!(closed, Ok(Ok(()))) {
        tracing::debug!(partition = p, "cluster: close the store: {closed:?}");
    }
    if let Err(e) = node.owners.release(&lease).await {
        tracing::warn!(partition = p, "cluster: release the lease: {e}");
    }
    node.counters.handovers.inc();
    node.busy.lock().remove(&p);
}

/// Wait (at most `limit`) until every request admitted on `led`'s engine before
/// its intake closed has been answered.
async fn settled(led: &Led, limit: Duration) {
    let started = std::time::Instant::now();
    if tokio::time::timeout(limit, led.inflight.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            running = led.inflight.len(),
            "cluster: requests still running after {limit:?}; stopping the log under them"
        );
    } else {
        tracing::debug!(
            millis = started.elapsed().as_millis() as u64,
            "cluster: the partition's requests settled"
        );
    }
}

/// Give up every partition and every standby, then leave the members. The leases
/// are renewed first and the partitions handed over all at once, so that none runs
/// out while this node still serves it (a lease that ran out lets another node take
/// the partition and fence its log under the writes in flight here).
pub(super) async fn drain(node: &Arc<Node>) {
    let led = node.all_led();
    let now = members::now_ms();
    if let Err(e) = put_member(node, now, true).await {
        tracing::warn!("cluster: say that the node drains: {e}");
    }
    futures_util::future::join_all(led.iter().map(|(p, l)| async move {
        if renew(node, l, now).await {
            step_down(node, *p, "the node is draining", true).await;
        } else {
            step_down(node, *p, "its lease was lost while draining", false).await;
        }
    }))
    .await;
    let standbys: Vec<Standby> = node.standbys.lock().drain().map(|(_, s)| s).collect();
    for s in standbys {
        stop_standby(s);
    }
    if let Err(e) = node.members.remove(&node.id).await {
        tracing::warn!("cluster: leave the members: {e}");
    }
}
