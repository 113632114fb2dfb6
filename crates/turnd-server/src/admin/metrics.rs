//! `GET /metrics`: the daemon's counters and gauges as OpenMetrics text, built afresh
//! at every scrape from the engine's counters, its state and the store's commit
//! statistics.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use turnd_engine::metrics::Counters;
use turnd_proto::{TurnStatus, WaitState};
use turnd_store::{CommitStats, SYNC_BUCKET_BOUNDS};

type Labels = Vec<(String, String)>;

fn counter(reg: &mut Registry, name: &str, help: &str, v: u64) {
    let c: Counter = Counter::default();
    c.inc_by(v);
    reg.register(name, help, c);
}

/// A counter of seconds, from a total in microseconds.
fn seconds(reg: &mut Registry, name: &str, help: &str, micros: u64) {
    let c: Counter<f64, AtomicU64> = Counter::default();
    c.inc_by(micros as f64 / 1e6);
    reg.register(name, help, c);
}

/// A histogram whose buckets were counted elsewhere (the store's [`CommitStats`]),
/// encoded as it stands at the scrape.
#[derive(Debug)]
struct CountedHistogram {
    sum: f64,
    count: u64,
    /// Upper bound and count of each bucket, not cumulative (the encoder adds up).
    buckets: Vec<(f64, u64)>,
}

impl EncodeMetric for CountedHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_histogram::<NoLabelSet>(self.sum, self.count, &self.buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

fn gauge(reg: &mut Registry, name: &str, help: &str, v: i64) {
    let g: Gauge = Gauge::default();
    g.set(v);
    reg.register(name, help, g);
}

fn load(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

pub(super) async fn metrics(State(s): State<Arc<super::Admin>>) -> impl IntoResponse {
    let mut reg = Registry::with_prefix("turnd");
    register_state(&mut reg, &s);
    register_connections(&mut reg, &s);
    register_transitions(&mut reg, s.engine.counters());
    register_recovery(&mut reg, s.engine.counters());
    register_agent(&mut reg, s.engine.counters());
    let cs = s.engine.store().kv().commit_stats();
    register_storage(&mut reg, &cs);
    register_commit_log(&mut reg, &cs);
    register_log_segments(&mut reg, &cs);
    register_windows(&mut reg, &cs);
    let wins = s.engine.store().kv().windows().unwrap_or_default();
    gauge(
        &mut reg,
        "storage_windows",
        "Time windows of finished turns on disk",
        wins.iter().filter(|w| !w.dropped).count() as i64,
    );

    let mut body = String::new();
    if let Err(e) = encode(&mut body, &reg) {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            format!("encode metrics: {e}\n"),
        );
    }
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
}

/// Gauges of what is there now: turns, waits, sessions, invocations, workers, storage.
fn register_state(reg: &mut Registry, s: &super::Admin) {
    let e = &s.engine;
    let stats = e.stats();
    let turns = Family::<Labels, Gauge>::default();
    for st in TurnStatus::ALL {
        turns
            .get_or_create(&vec![("status".into(), st.as_str().into())])
            .set(stats.turns.get(st) as i64);
    }
    reg.register("turns", "Turns by status", turns);

    let waits = Family::<Labels, Gauge>::default();
    for w in WaitState::ALL {
        let n = stats.sessions.blocked.get(w.as_str()).copied().unwrap_or(0);
        waits
            .get_or_create(&vec![("state".into(), w.as_str().into())])
            .set(n as i64);
    }
    reg.register(
        "sessions_waiting",
        "Active sessions by the wait state of their lock holder",
        waits,
    );
    gauge(
        reg,
        "sessions_active",
        "Sessions with unfinished turns",
        stats.sessions.active as i64,
    );
    gauge(
        reg,
        "invocations_inflight",
        "Invocations dispatched and not finished",
        stats.invocations_inflight as i64,
    );
    gauge(
        reg,
        "oldest_wait_seconds",
        "Age of the oldest wait of any session's lock holder",
        stats.oldest_wait_ms.map(|m| (m / 1000) as i64).unwrap_or(0),
    );
    gauge(
        reg,
        "workers_connected",
        "Connected workers",
        stats.workers_connected as i64,
    );
    gauge(
        reg,
        "storage_writable",
        "1 when the last storage write succeeded",
        stats.storage.writable as i64,
    );
}

/// Open connections, sessions in memory, watches and requests in flight.
fn register_connections(reg: &mut Registry, s: &super::Admin) {
    let e = &s.engine;
    let conns = Family::<Labels, Gauge>::default();
    for (role, v) in [
        ("unauthenticated", &s.connections.unauthenticated),
        ("worker", &s.connections.worker),
        ("client", &s.connections.client),
        ("operator", &s.connections.operator),
    ] {
        conns
            .get_or_create(&vec![("role".into(), role.into())])
            .set(load(v) as i64);
    }
    reg.register("connections", "Open connections by role", conns);
    gauge(
        reg,
        "sessions_in_memory",
        "Sessions whose state is held in memory: those with unfinished turns, and those in use by a request right now",
        e.sessions_in_memory() as i64,
    );
    gauge(
        reg,
        "watches",
        "Watches held by every connection",
        e.watch_count() as i64,
    );
    gauge(
        reg,
        "turn_waits",
        "turn.wait requests waiting for a turn to end",
        e.turn_wait_count() as i64,
    );
    gauge(
        reg,
        "requests_inflight",
        "Requests being run, over every connection",
        load(&s.connections.requests_inflight) as i64,
    );
}

/// Counters of the turn lifecycle's transitions.
fn register_transitions(reg: &mut Registry, c: &Counters) {
    counter(
        reg,
        "admissions",
        "Turns admitted",
        Counters::get(&c.admissions),
    );
    counter(
        reg,
        "admissions_deduplicated",
        "Submits answered with an existing turn",
        Counters::get(&c.deduplicated),
    );
    let terminal = Family::<Labels, Counter>::default();
    for (k, v) in c.terminal_snapshot() {
        let (status, cause) = match k.split_once(':') {
            Some((s, c)) => (s.to_string(), c.to_string()),
            None => (k.clone(), String::new()),
        };
        terminal
            .get_or_create(&vec![("status".into(), status), ("cause".into(), cause)])
            .inc_by(v);
    }
    reg.register(
        "terminal_transitions",
        "Turns that reached a terminal state, by status and cause",
        terminal,
    );
    counter(
        reg,
        "dispatches",
        "Invocations dispatched",
        Counters::get(&c.dispatches),
    );
    counter(
        reg,
        "redispatches",
        "Invocations dispatched again after a lost dispatch or unknown outcome",
        Counters::get(&c.redispatches),
    );
    let results = Family::<Labels, Counter>::default();
    for (k, v) in [
        ("applied", &c.results_applied),
        ("duplicate", &c.results_duplicate),
        ("late", &c.results_late),
        ("unknown", &c.results_unknown),
    ] {
        results
            .get_or_create(&vec![("accepted".into(), k.into())])
            .inc_by(Counters::get(v));
    }
    reg.register(
        "results",
        "invocation.result frames by how they were taken",
        results,
    );
}

/// Counters of how losses were detected and handled: probes, unknown outcomes,
/// amendments, retries, cancels, stops, failed writes, retention.
fn register_recovery(reg: &mut Registry, c: &Counters) {
    counter(
        reg,
        "probes_sent",
        "Probes sent at attempt deadlines",
        Counters::get(&c.probes_sent),
    );
    let answers = Family::<Labels, Counter>::default();
    for (k, v) in c.probe_answers_snapshot() {
        answers
            .get_or_create(&vec![("state".into(), k.into())])
            .inc_by(v);
    }
    reg.register(
        "probe_answers",
        "invocation.status answers by state",
        answers,
    );
    counter(
        reg,
        "outcome_unknown",
        "Attempts whose outcome became unknown",
        Counters::get(&c.outcome_unknown),
    );
    counter(
        reg,
        "amendments",
        "Turns amended to completed by a late result",
        Counters::get(&c.amendments),
    );
    counter(
        reg,
        "retries_scheduled",
        "Retries scheduled after retryable failures or timeouts",
        Counters::get(&c.retries_scheduled),
    );
    counter(
        reg,
        "cancels_sent",
        "cancel pushes sent",
        Counters::get(&c.cancels_sent),
    );
    counter(reg, "stops", "Turns stopped", Counters::get(&c.stops));
    counter(
        reg,
        "storage_write_failures",
        "Storage commits that failed",
        Counters::get(&c.write_failures),
    );

    counter(
        reg,
        "retention_deleted_turns",
        "Terminal turns deleted by retention",
        Counters::get(&c.turns_expired),
    );
    counter(
        reg,
        "retention_dropped_windows",
        "Time windows of finished turns deleted whole by retention",
        Counters::get(&c.windows_dropped),
    );
    seconds(
        reg,
        "retention_sweep_seconds",
        "Time retention's sweeps took, start to end",
        Counters::get(&c.retention_sweep_micros),
    );
    seconds(
        reg,
        "retention_held_back_seconds",
        "Of the sweeps' time, the time they waited because the store was behind",
        Counters::get(&c.retention_held_back_micros),
    );
}

/// Counters of agent turns: suspends and resumes, `on_busy` refusals and
/// interrupts, and progress frames by what became of them.
fn register_agent(reg: &mut Registry, c: &Counters) {
    for (name, help, v) in [
        (
            "suspends",
            "Steps that suspended their turn for input",
            &c.suspends,
        ),
        (
            "resumes",
            "Suspended turns let go (turn.resume, or an input deadline with on_timeout continue)",
            &c.resumes,
        ),
        (
            "busy_rejected",
            "turn.submit refused busy (on_busy reject): nothing stored",
            &c.busy_rejected,
        ),
        (
            "interrupted_turns",
            "Turns stopped by a submit with on_busy interrupt or rollback",
            &c.interrupted,
        ),
    ] {
        counter(reg, name, help, Counters::get(v));
    }
    let progress = Family::<Labels, Counter>::default();
    for (k, v) in [
        ("accepted", &c.progress_accepted),
        ("refused", &c.progress_refused),
        ("pushed", &c.progress_pushed),
        ("dropped", &c.progress_dropped),
    ] {
        progress
            .get_or_create(&vec![("outcome".into(), k.into())])
            .inc_by(Counters::get(v));
    }
    reg.register(
        "progress_frames",
        "invocation.progress frames: accepted or refused from workers, pushed to or dropped for watches (one per watch)",
        progress,
    );
}

/// The store's commit log, group commits, checkpoints and applies.
fn register_storage(reg: &mut Registry, cs: &CommitStats) {
    counter(
        reg,
        "storage_commits",
        "Group commits (syncs) performed",
        cs.syncs,
    );
    counter(reg, "storage_batches", "Atomic batches written", cs.batches);
    seconds(
        reg,
        "storage_commit_seconds",
        "Time spent in group commits: encoding, writing and syncing the commit log (divide by storage_commits for the mean)",
        cs.commit_micros,
    );
    seconds(
        reg,
        "storage_sync_seconds",
        "Of storage_commit_seconds, the time spent writing the commit log and its fdatasync",
        cs.sync_micros,
    );
    let bounds = SYNC_BUCKET_BOUNDS.iter().copied().chain([f64::INFINITY]);
    reg.register(
        "storage_sync_duration_seconds",
        "Group commits by the time the write and fdatasync of the commit log took (the time storage_sync_seconds adds up)",
        CountedHistogram {
            sum: cs.sync_micros as f64 / 1e6,
            count: cs.sync_buckets.iter().sum(),
            buckets: bounds.zip(cs.sync_buckets).collect(),
        },
    );
    gauge(
        reg,
        "storage_max_group",
        "Largest number of batches that shared one sync",
        cs.max_group as i64,
    );
    counter(
        reg,
        "storage_checkpoints",
        "Checkpoints: sled closed and opened again so that a restart replays less of sled's log (store reads and applies wait meanwhile, commits do not)",
        cs.checkpoints,
    );
    seconds(
        reg,
        "storage_checkpoint_seconds",
        "Time spent in checkpoints",
        cs.checkpoint_micros,
    );
}

/// The commit log and the applies of its records to sled.
fn register_commit_log(reg: &mut Registry, cs: &CommitStats) {
    counter(
        reg,
        "storage_log_bytes",
        "Bytes of batches appended to the commit log",
        cs.log_bytes,
    );
    counter(
        reg,
        "storage_applies",
        "Rounds in which the commit log's records were written to sled",
        cs.applies,
    );
    counter(
        reg,
        "storage_applied_keys",
        "Keys written to sled by those rounds (each key once per round)",
        cs.applied_keys,
    );
    counter(
        reg,
        "storage_dropped_deletes",
        "Deletes of keys that never reached sled (created and deleted before an apply), dropped instead of written",
        cs.dropped_deletes,
    );
    counter(
        reg,
        "storage_merged_event_values",
        "Event values written to sled inside a later value of the same session instead of under their own key",
        cs.merged_event_values,
    );
    counter(
        reg,
        "storage_carried_records",
        "Records of live turns and invocations appended to the commit log again instead of written to sled",
        cs.carried_records,
    );
    seconds(
        reg,
        "storage_apply_seconds",
        "Time spent writing the commit log's records to sled",
        cs.apply_micros,
    );
    counter(
        reg,
        "storage_full_overlay_waits",
        "Group commits that waited because too many committed keys were not yet in sled",
        cs.room_waits,
    );
    seconds(
        reg,
        "storage_full_overlay_wait_seconds",
        "Time group commits waited for sled to take committed keys",
        cs.room_wait_micros,
    );
    gauge(
        reg,
        "storage_unapplied_keys",
        "Keys committed to the commit log but not yet written to sled",
        cs.overlay_keys as i64,
    );
    gauge(
        reg,
        "storage_unapplied_bytes",
        "Bytes of the keys and values committed to the commit log but not yet written to sled",
        cs.overlay_bytes as i64,
    );
    gauge(
        reg,
        "storage_log_segments",
        "Files of the commit log",
        cs.log_segments as i64,
    );
}

/// The time windows closed until needed, and what dropped windows left behind.
fn register_windows(reg: &mut Registry, cs: &CommitStats) {
    gauge(
        reg,
        "storage_windows_closed",
        "Of storage_windows, those closed because no read or write used them for storage.window_close_ms",
        cs.windows_closed as i64,
    );
    counter(
        reg,
        "storage_window_reopens",
        "Closed time windows opened again by a read or write that needed them",
        cs.window_reopens,
    );
    counter(
        reg,
        "storage_window_leftover_keys",
        "Keys a dropped time window still held, moved to the main database instead of going with the window",
        cs.window_leftovers,
    );
}

/// The commit log's segments as they are trimmed, kept for reuse, zeroed and reserved.
fn register_log_segments(reg: &mut Registry, cs: &CommitStats) {
    counter(
        reg,
        "storage_log_trims",
        "Commit log segments deleted once sled held their records, flushed and synced",
        cs.log_trims,
    );
    counter(
        reg,
        "storage_log_recycled_segments",
        "Trimmed commit log segments kept as the log's next segment instead of deleted",
        cs.log_recycled,
    );
    counter(
        reg,
        "storage_log_zeroed_segments",
        "Commit log segments written with zeros ahead of need because no trimmed one was at hand",
        cs.log_zeroed,
    );
    counter(
        reg,
        "storage_log_reserved_segments",
        "Commit log segments begun with blocks only reserved because no spare was ready",
        cs.log_reserved,
    );
}
