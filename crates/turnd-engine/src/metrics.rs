//! Counters of what the engine did, read by the admin `/metrics` endpoint, and the
//! log line of every durable event they count.

use parking_lot::Mutex;
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use turnd_proto::{Event, EventKind};
use turnd_store::RawJson;

/// Monotonic counters. Gauges (turns by status, sessions by wait state, in-flight
/// invocations) are computed from live state when scraped.
#[derive(Debug, Default)]
pub struct Counters {
    pub admissions: AtomicU64,
    pub deduplicated: AtomicU64,
    pub dispatches: AtomicU64,
    pub redispatches: AtomicU64,
    pub results_applied: AtomicU64,
    pub results_duplicate: AtomicU64,
    pub results_late: AtomicU64,
    pub results_unknown: AtomicU64,
    pub probes_sent: AtomicU64,
    pub outcome_unknown: AtomicU64,
    pub amendments: AtomicU64,
    pub retries_scheduled: AtomicU64,
    pub cancels_sent: AtomicU64,
    pub stops: AtomicU64,
    pub write_failures: AtomicU64,
    /// Terminal turns deleted by retention.
    pub turns_expired: AtomicU64,
    /// Time windows of finished turns dropped whole by retention.
    pub windows_dropped: AtomicU64,
    /// Time retention's sweeps took, start to end, in microseconds: near the sweep
    /// interval, the sweeps run back to back and may fall behind.
    pub retention_sweep_micros: AtomicU64,
    /// Of that, the time a sweep waited because the store was behind (its deletes
    /// give way to live commits), in microseconds.
    pub retention_held_back_micros: AtomicU64,
    /// Steps that suspended their turn for input, and suspended turns let go (by
    /// `turn.resume` or a deadline with `on_timeout: "continue"`).
    pub suspends: AtomicU64,
    pub resumes: AtomicU64,
    /// `turn.submit`s refused `busy` (`on_busy: "reject"`), and turns stopped by a
    /// submit with `on_busy` `interrupt` or `rollback`.
    pub busy_rejected: AtomicU64,
    pub interrupted: AtomicU64,
    /// `invocation.progress` frames accepted, refused (not current, too large), pushed
    /// to watches, and dropped for slow or replaying watches.
    pub progress_accepted: AtomicU64,
    pub progress_refused: AtomicU64,
    pub progress_pushed: AtomicU64,
    pub progress_dropped: AtomicU64,
    /// Probe answers by state.
    pub probe_answers: Mutex<BTreeMap<&'static str, u64>>,
    /// Terminal transitions to `completed` and `cancelled` (counted apart from the
    /// failures: one atomic add per turn instead of a locked map's lookup).
    pub completed: AtomicU64,
    pub cancelled: AtomicU64,
    /// Terminal transitions to `failed`, by cause (`failed:<cause>`).
    pub terminal: Mutex<BTreeMap<String, u64>>,
}

impl Counters {
    pub fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    /// Add `d` to a counter of microseconds.
    pub fn add_time(c: &AtomicU64, d: std::time::Duration) {
        c.fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn terminal(&self, key: String) {
        {
            let mut m = self.terminal.lock();
            *m.entry(key).or_insert(0) += 1;
        }
    }

    pub fn probe_answer(&self, state: &'static str) {
        {
            let mut m = self.probe_answers.lock();
            *m.entry(state).or_insert(0) += 1;
        }
    }

    /// Terminal transitions by status and cause (`completed`, `cancelled`,
    /// `failed:<cause>`); a status none reached yet is left out.
    pub fn terminal_snapshot(&self) -> BTreeMap<String, u64> {
        let mut m = self.terminal.lock().clone();
        for (k, c) in [
            ("completed", &self.completed),
            ("cancelled", &self.cancelled),
        ] {
            let n = Counters::get(c);
            if n > 0 {
                m.insert(k.to_owned(), n);
            }
        }
        m
    }

    pub fn probe_answers_snapshot(&self) -> BTreeMap<&'static str, u64> {
        self.probe_answers.lock().clone()
    }

    /// Count a durable event (and log it with the identity fields of its turn).
    pub(crate) fn count_event(&self, e: &Event<RawJson>) {
        log_event(e);
        let c = self;
        match e.kind {
            EventKind::Admitted => Counters::inc(&c.admissions),
            EventKind::Dispatched => Counters::inc(&c.dispatches),
            EventKind::Redispatched => Counters::inc(&c.redispatches),
            EventKind::ProbeSent => Counters::inc(&c.probes_sent),
            EventKind::OutcomeUnknown => Counters::inc(&c.outcome_unknown),
            EventKind::Amended => Counters::inc(&c.amendments),
            EventKind::RetryScheduled => Counters::inc(&c.retries_scheduled),
            EventKind::CancelSent => Counters::inc(&c.cancels_sent),
            EventKind::StopRequested => Counters::inc(&c.stops),
            EventKind::Completed => Counters::inc(&c.completed),
            EventKind::Cancelled => Counters::inc(&c.cancelled),
            EventKind::Failed => {
                let detail = e.detail.to_value();
                let cause = detail
                    .get("error")
                    .and_then(|x| x.get("cause"))
                    .and_then(Value::as_str)
                    .unwrap_or("unknown");
                c.terminal(format!("failed:{cause}"));
            }
            EventKind::Suspended => Counters::inc(&c.suspends),
            EventKind::Resumed => Counters::inc(&c.resumes),
            EventKind::Result | EventKind::LateResult => {}
        }
    }
}

/// Log a durable event with the identity fields every turn log line carries.
fn log_event(e: &Event<RawJson>) {
    // The fields are looked up only for a line that is written: every transition
    // passes here, and most of its events log at debug.
    let enabled = match e.kind {
        EventKind::Failed
        | EventKind::OutcomeUnknown
        | EventKind::LateResult
        | EventKind::Amended
        | EventKind::Redispatched => tracing::enabled!(tracing::Level::WARN),
        EventKind::Completed
        | EventKind::Cancelled
        | EventKind::StopRequested
        | EventKind::ProbeSent
        | EventKind::CancelSent
        | EventKind::RetryScheduled
        | EventKind::Suspended
        | EventKind::Resumed => tracing::enabled!(tracing::Level::INFO),
        EventKind::Admitted | EventKind::Dispatched | EventKind::Result => {
            tracing::enabled!(tracing::Level::DEBUG)
        }
    };
    if !enabled {
        return;
    }
    let d = &e.detail.to_value();
    let step = d.get("step").and_then(Value::as_u64);
    let attempt = d.get("attempt").and_then(Value::as_u64);
    let inv = d.get("invocation_id").and_then(Value::as_str).unwrap_or("");
    let kind = serde_json::to_value(e.kind).unwrap_or(Value::Null);
    let kind = kind.as_str().unwrap_or("");
    macro_rules! log {
        ($lvl:ident) => {
            tracing::$lvl!(
                session_id = %e.session_id,
                turn_id = %e.turn_id,
                step,
                attempt,
                invocation_id = inv,
                seq = e.seq,
                event = kind,
                detail = %d,
                "turn event"
            )
        };
    }
    match e.kind {
        EventKind::Failed
        | EventKind::OutcomeUnknown
        | EventKind::LateResult
        | EventKind::Amended
        | EventKind::Redispatched => log!(warn),
        EventKind::Completed
        | EventKind::Cancelled
        | EventKind::StopRequested
        | EventKind::ProbeSent
        | EventKind::CancelSent
        | EventKind::RetryScheduled
        | EventKind::Suspended
        | EventKind::Resumed => log!(info),
        EventKind::Admitted | EventKind::Dispatched | EventKind::Result => log!(debug),
    }
}
