//! The memory scenarios: `idle` (sessions with one queued turn each and no worker),
//! `idle_finished` (sessions whose turns all finished) and `idle_unknown` (reads of
//! sessions that do not exist): what the daemon's resident size is after each.

use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::json;
use std::sync::Arc;
use tokio::task::JoinSet;
use tokio::time::Instant;
use turnd_client::turnd_proto::TurnStatus;
use turnd_client::Caller;

use super::{data_dir, sync_label, Probe, TURN_LIMIT};
use crate::daemon::{callers, close_callers, BenchDaemon, Workers, ECHO, NOBODY};
use crate::measure::{proc_status_kb, Latencies, Row};
use crate::Common;

/// `idle`: `n` sessions with one queued turn each, no worker; reports memory.
pub async fn idle(common: &Common, n: usize, inflight: usize) -> anyhow::Result<()> {
    let (_tmp, data) = data_dir(common)?;
    let rss_before_start = proc_status_kb("VmRSS");
    let d = BenchDaemon::start(&data, common).await?;
    let cs = callers(&d.url, common.callers).await?;
    let rss_base = proc_status_kb("VmRSS");
    let probe = Probe::start(&d);
    let start = Instant::now();
    let Bounded {
        lat: mut submit,
        failed,
        first_error,
    } = bounded(n, inflight, |s| {
        let caller = cs[s % cs.len()].clone();
        async move {
            let r = caller
                .submit_simple(&format!("idle-{s}"), NOBODY, json!({"s": s}))
                .await;
            r.map(|_| ()).map_err(|e| e.to_string())
        }
    })
    .await;
    let wall = start.elapsed();
    let measured = probe.finish(&d);
    let stats = cs[0].stats().await.context("stats")?;
    let rss_loaded = proc_status_kb("VmRSS");
    // What the store still held in memory for sled then, and the resident size once
    // sled has taken it (connections still open), up to 2 s later.
    let overlay_loaded = d.overlay_len();
    let drained_by = Instant::now() + Duration::from_secs(2);
    while d.overlay_len() > 0 && Instant::now() < drained_by {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let overlay_after = d.overlay_len();
    let rss_applied = proc_status_kb("VmRSS");
    let alloc_applied = crate::measure::alloc_stats();
    close_callers(cs).await;
    // Let the closed connections' tasks and buffers go.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_settled = proc_status_kb("VmRSS");
    let alloc_settled = crate::measure::alloc_stats();
    let hwm = proc_status_kb("VmHWM");
    d.shutdown().await?;
    let kb = |v: Option<u64>| crate::measure::mb(v);
    println!(
        "idle: {} submitted ({} failed) in {:.2} s; daemon counts {} queued, {} sessions active",
        submit.len(),
        failed,
        wall.as_secs_f64(),
        stats.turns.queued,
        stats.sessions.active
    );
    let row = Row {
        scenario: "idle".into(),
        sync: sync_label(common),
        work: format!(
            "{n} sessions × 1 queued turn, no worker; {} caller conns, {inflight} submits in flight",
            common.callers
        ),
        wall: Some(wall),
        throughput: format!("{:.0} submits/s", submit.len() as f64 / wall.as_secs_f64().max(1e-9)),
        latency: submit.summary(),
        cpu: Some(measured.cpu),
        rss_peak_kb: hwm,
        commits: Some(measured.commits),
        notes: format!(
            "latency columns = submit→ack; RSS: {} before the daemon started, {} after start, {} with all {} turns queued (connections open; {} keys not yet in sled), {} once sled had them ({} keys left; {alloc_applied}), {} after the callers closed ({alloc_settled}); daemon reports {} queued turns; {}",
            kb(rss_before_start),
            kb(rss_base),
            kb(rss_loaded),
            n,
            overlay_loaded,
            kb(rss_applied),
            overlay_after,
            kb(rss_settled),
            stats.turns.queued,
            measured.notes
        ),
    };
    row.print();
    fail_if_any(failed, first_error, "submits")
}

/// Resident size once the daemon's memory has settled after a phase: the lowest of
/// a few readings over `wait`, taken after the engine holds no more than `live`
/// sessions (or `wait` passed).
async fn settled_rss(d: &BenchDaemon, live: usize, wait: Duration) -> (Option<u64>, usize) {
    let until = Instant::now() + wait;
    let engine = d.daemon.engine().expect("a daemon on its own");
    while engine.sessions_in_memory() > live && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut low = proc_status_kb("VmRSS");
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if let Some(now) = proc_status_kb("VmRSS") {
            low = Some(low.map_or(now, |l| l.min(now)));
        }
    }
    (low, engine.sessions_in_memory())
}

/// `idle --what finished`: `n` sessions that each run one turn to completion on an
/// echo worker, then idle; reports the resident size after they finished against the
/// empty daemon's.
pub async fn idle_finished(common: &Common, n: usize, inflight: usize) -> anyhow::Result<()> {
    let (_tmp, data) = data_dir(common)?;
    let rss_before_start = proc_status_kb("VmRSS");
    let d = BenchDaemon::start(&data, common).await?;
    let workers = Workers::start(&d.url, common.workers, common.concurrency).await?;
    let cs = callers(&d.url, common.callers).await?;
    let (rss_base, _) = settled_rss(&d, 0, Duration::from_secs(1)).await;
    let alloc_base = crate::measure::alloc_stats();
    let probe = Probe::start(&d);
    let start = Instant::now();
    let Bounded {
        mut lat,
        failed,
        first_error,
    } = bounded(n, inflight, |s| {
        let caller = cs[s % cs.len()].clone();
        run_done(caller, s)
    })
    .await;
    let wall = start.elapsed();
    let measured = probe.finish(&d);
    let stats = cs[0].stats().await.context("stats")?;
    // Idle: long enough for the store to reopen sled once writes have paused (which
    // gives back what its cache grew to in the burst), and a few readings after.
    let idle = turnd_store::DEFAULT_IDLE_REOPEN + Duration::from_secs(3);
    let (rss_done, in_memory) = settled_rss(&d, 0, idle).await;
    let alloc_done = crate::measure::alloc_stats();
    close_callers(cs).await;
    workers.stop().await?;
    let (rss_settled, _) = settled_rss(&d, 0, Duration::from_secs(2)).await;
    let alloc_settled = crate::measure::alloc_stats();
    let hwm = proc_status_kb("VmHWM");
    d.shutdown().await?;
    let kb = |v: Option<u64>| crate::measure::mb(v);
    let growth = match (rss_done, rss_base) {
        (Some(a), Some(b)) => format!("{} MB", (a as i64 - b as i64) / 1024),
        _ => "–".into(),
    };
    let row = Row {
        scenario: "idle (finished)".into(),
        sync: sync_label(common),
        work: format!(
            "{n} sessions × 1 turn run to completion, then idle; {} caller conns, {inflight} turns in flight",
            common.callers
        ),
        wall: Some(wall),
        throughput: format!("{:.0} turns/s", lat.len() as f64 / wall.as_secs_f64().max(1e-9)),
        latency: lat.summary(),
        cpu: Some(measured.cpu),
        rss_peak_kb: hwm,
        commits: Some(measured.commits),
        notes: format!(
            "latency columns = submit→completed; RSS: {} before the daemon started, {} with the daemon, workers and callers connected, {} after all {n} turns completed ({growth} over the connected daemon; {in_memory} sessions in memory, {} completed), {} after the callers and workers closed; connected: {alloc_base}; all completed: {alloc_done}; closed: {alloc_settled}; {}",
            kb(rss_before_start),
            kb(rss_base),
            kb(rss_done),
            stats.turns.completed,
            kb(rss_settled),
            measured.notes
        ),
    };
    row.print();
    fail_if_any(failed, first_error, "turns")
}

/// `idle --what unknown`: `n` reads of ids that do not exist (`session.inspect`,
/// `turn.list`, `session.events`, `session.stop`, `turn.get` in turn) on an empty
/// daemon; reports how much the resident size grew.
pub async fn idle_unknown(common: &Common, n: usize, inflight: usize) -> anyhow::Result<()> {
    let (_tmp, data) = data_dir(common)?;
    let d = BenchDaemon::start(&data, common).await?;
    let cs = callers(&d.url, common.callers).await?;
    // Warm every connection and code path once, so that the growth below is the
    // reads' own.
    for (i, c) in cs.iter().enumerate() {
        if let Ok(s) = c.inspect(&format!("warm-{i}")).await {
            bail!("session warm-{i} exists: {s:?}");
        }
    }
    let (rss_base, _) = settled_rss(&d, 0, Duration::from_secs(1)).await;
    let probe = Probe::start(&d);
    let start = Instant::now();
    let Bounded {
        mut lat,
        failed,
        first_error,
    } = bounded(n, inflight, |s| {
        let caller = cs[s % cs.len()].clone();
        read_unknown(caller, s)
    })
    .await;
    let wall = start.elapsed();
    let measured = probe.finish(&d);
    let (rss_after, in_memory) = settled_rss(&d, 0, Duration::from_secs(2)).await;
    let registry = d
        .daemon
        .engine()
        .expect("a daemon on its own")
        .registry_sizes();
    close_callers(cs).await;
    let hwm = proc_status_kb("VmHWM");
    d.shutdown().await?;
    let kb = |v: Option<u64>| crate::measure::mb(v);
    let growth = match (rss_after, rss_base) {
        (Some(a), Some(b)) => format!("{:.1} MB", (a as f64 - b as f64) / 1024.0),
        _ => "–".into(),
    };
    let row = Row {
        scenario: "idle (unknown ids)".into(),
        sync: sync_label(common),
        work: format!(
            "{n} reads of unknown ids (inspect, list, events, stop, get); {} caller conns, {inflight} in flight",
            common.callers
        ),
        wall: Some(wall),
        throughput: format!("{:.0} reads/s", lat.len() as f64 / wall.as_secs_f64().max(1e-9)),
        latency: lat.summary(),
        cpu: Some(measured.cpu),
        rss_peak_kb: hwm,
        commits: Some(measured.commits),
        notes: format!(
            "RSS: {} before the reads, {} after ({growth} growth); {in_memory} sessions in memory, registry {} workers / {} functions; {}",
            kb(rss_base),
            kb(rss_after),
            registry.0,
            registry.1,
            measured.notes
        ),
    };
    row.print();
    fail_if_any(failed, first_error, "reads")
}

/// One session's one turn, submitted and waited for until it completed.
async fn run_done(caller: Arc<Caller>, s: usize) -> Result<(), String> {
    let t = caller
        .submit_simple(&format!("done-{s}"), ECHO, json!({"s": s}))
        .await
        .map_err(|e| e.to_string())?;
    let t = caller
        .wait_terminal(&t.turn_id, TURN_LIMIT)
        .await
        .map_err(|e| e.to_string())?;
    if t.status == TurnStatus::Completed {
        Ok(())
    } else {
        Err(format!("turn {} ended {:?}", t.turn_id, t.status))
    }
}

/// One read of an id that does not exist, by kind in turn; not found is success.
async fn read_unknown(caller: Arc<Caller>, s: usize) -> Result<(), String> {
    let sid = format!("ghost-{s}");
    let r = match s % 5 {
        0 => caller.inspect(&sid).await.map(|_| ()),
        1 => caller
            .list(turnd_client::turnd_proto::ListArgs {
                session_id: sid,
                status: None,
                limit: None,
                before_seq: None,
            })
            .await
            .map(|_| ()),
        2 => caller.events(&sid, Some(0), None).await.map(|_| ()),
        3 => caller.stop_session(&sid, "bench").await.map(|_| ()),
        _ => caller.get(&format!("t_{s:032x}")).await.map(|_| ()),
    };
    // Every one of them is not found (turn.list answers an empty page).
    match r {
        Ok(()) => Ok(()),
        Err(turnd_client::ClientError::Protocol(b))
            if b.code == turnd_client::turnd_proto::ErrorCode::NotFound =>
        {
            Ok(())
        }
        Err(e) => Err(e.to_string()),
    }
}

type SubmitResult = (Result<(), String>, Duration);

/// An error naming how many of `what` failed, and the first failure.
fn fail_if_any(failed: u64, first_error: Option<String>, what: &str) -> anyhow::Result<()> {
    if failed > 0 {
        bail!(
            "{failed} {what} failed (first: {})",
            first_error.unwrap_or_default()
        );
    }
    Ok(())
}

/// What [`bounded`] saw: the time of every task that succeeded, and the failures.
struct Bounded {
    lat: Latencies,
    failed: u64,
    first_error: Option<String>,
}

/// Runs `task(0..n)`, at most `inflight` at a time, timing each.
async fn bounded<F, Fut>(n: usize, inflight: usize, mut task: F) -> Bounded
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>> + Send + 'static,
{
    let mut out = Bounded {
        lat: Latencies::default(),
        failed: 0,
        first_error: None,
    };
    let mut set = JoinSet::new();
    for s in 0..n {
        while set.len() >= inflight.max(1) {
            collect_submit(&mut set, &mut out).await;
        }
        let fut = task(s);
        set.spawn(async move {
            let t0 = Instant::now();
            (fut.await, t0.elapsed())
        });
    }
    while !set.is_empty() {
        collect_submit(&mut set, &mut out).await;
    }
    out
}

async fn collect_submit(set: &mut JoinSet<SubmitResult>, out: &mut Bounded) {
    if let Some(joined) = set.join_next().await {
        match joined {
            Ok((Ok(()), took)) => out.lat.push(took),
            Ok((Err(e), _)) => {
                out.failed += 1;
                out.first_error.get_or_insert(e);
            }
            Err(e) => {
                out.failed += 1;
                out.first_error.get_or_insert(e.to_string());
            }
        }
    }
}
