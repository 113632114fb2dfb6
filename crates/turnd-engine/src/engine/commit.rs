//! Committing a transition and what follows it: the write through the group commit,
//! events to the log and the counters, the session's timer, and the drive loop that
//! does whatever is due.

use super::dispatch::{Settled, Settlement};
use super::*;

impl Engine {
    /// Commit a settled transition and apply it. On failure nothing in memory
    /// changed and every slot it reserved or freed is put back.
    pub(super) async fn commit(
        &self,
        cell: &Arc<SessionCell>,
        st: &mut SessionState,
        settled: Settled,
    ) -> Result<(), StoreError> {
        let Settled { mut tx, slots } = settled;
        if tx.is_empty() && tx.idempotency.is_none() {
            self.after_change(st, Vec::new());
            return Ok(());
        }
        let batch = tx.batch(st);
        match self.inner.store.commit(batch).await {
            Ok(()) => {
                {
                    let mut e = self.inner.storage_error.lock();
                    *e = None;
                }
                let released: Vec<String> = slots
                    .released
                    .iter()
                    .map(|r| r.function_id.clone())
                    .collect();
                let applied = tx.apply(st);
                // The session's write succeeded: a retried one is no longer pending.
                st.pending = None;
                {
                    let mut c = self.inner.counts.lock();
                    for (from, to) in &applied.shifts {
                        c.shift(*from, *to);
                    }
                }
                for e in &applied.events {
                    self.count_event(e);
                }
                for eff in applied.effects {
                    self.carry_out(eff);
                }
                self.publish(&st.id, &applied.events);
                self.track_live(cell, &applied.admitted, &applied.terminal);
                self.notify_terminal(&applied.terminal);
                self.after_change(st, released);
                Ok(())
            }
            Err(e) => {
                Counters::inc(&self.inner.counters.write_failures);
                {
                    let mut le = self.inner.storage_error.lock();
                    *le = Some(e.to_string());
                }
                self.restore(st, &slots, tx.now);
                Err(e)
            }
        }
    }

    /// Put back what settling a transition did in the registry: its write failed.
    fn restore(&self, st: &SessionState, slots: &Settlement, now: u64) {
        let mut reg = self.registry();
        for (worker_id, inv_id) in &slots.reserved {
            reg.release(worker_id, inv_id);
        }
        for slot in &slots.released {
            reg.remember_assignment(
                &slot.worker_id,
                &slot.instance_id,
                &slot.invocation_id,
                Assignment {
                    session_id: st.id.to_string(),
                    function_id: slot.function_id.clone(),
                },
                now,
            );
        }
        // Building the transition may have noted the session as waiting for a
        // worker (a reservation that found none): the state did not change, so
        // neither may that note, or the function's entry would outlive every
        // connection and turn that names it.
        note_waiting(&mut reg, st);
    }

    /// Log a durable event with the identity fields every turn log line carries.
    pub(super) fn log_event(&self, e: &Event) {
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
            | EventKind::RetryScheduled => tracing::enabled!(tracing::Level::INFO),
            EventKind::Admitted | EventKind::Dispatched | EventKind::Result => {
                tracing::enabled!(tracing::Level::DEBUG)
            }
        };
        if !enabled {
            return;
        }
        let d = &e.detail;
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
            | EventKind::RetryScheduled => log!(info),
            EventKind::Admitted | EventKind::Dispatched | EventKind::Result => log!(debug),
        }
    }

    pub(super) fn count_event(&self, e: &Event) {
        self.log_event(e);
        let c = &self.inner.counters;
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
                let cause = e
                    .detail
                    .get("error")
                    .and_then(|x| x.get("cause"))
                    .and_then(Value::as_str)
                    .unwrap_or("unknown");
                c.terminal(format!("failed:{cause}"));
            }
            EventKind::Result | EventKind::LateResult => {}
        }
    }

    /// After any change: wake sessions waiting for freed capacity, update the
    /// session's entry in the wait index (which `sessions.list` and `stats` read) and
    /// in the registry's waiting lists, and re-arm its timer.
    pub(super) fn after_change(&self, st: &mut SessionState, freed: Vec<String>) {
        for f in freed {
            self.wake(&f);
        }
        let entry = sessions_list::WaitEntry::of(st, self.inner.cfg.turns.dispatch_timeout_ms);
        self.wait_index().set(&st.id, entry);
        note_waiting(&mut self.registry(), st);
        self.arm(st);
    }

    /// Put the session's next deadline in the timer queue.
    pub(super) fn arm(&self, st: &mut SessionState) {
        let due = machine::next_due(st, &self.inner.cfg);
        if due == st.timer {
            return;
        }
        let due = due.filter(|_| !self.inner.shutdown.is_cancelled());
        self.inner.timers.set(&st.id, st.timer, due);
        st.timer = due;
    }

    /// Start the timer queue's task: each due entry spawns a drive of its session.
    pub(super) fn spawn_timers(&self) {
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let queue = self.inner.timers.clone();
        let clock = self.inner.clock;
        let shutdown = self.inner.shutdown.clone();
        tokio::spawn(async move {
            queue
                .run(clock, shutdown, |sid, due| {
                    let Some(inner) = weak.upgrade() else {
                        return false;
                    };
                    let engine = Engine { inner };
                    tokio::spawn(async move { engine.drive_timer(&sid, due).await });
                    true
                })
                .await
        });
    }

    /// Spawn a drive of a session (used where the caller must not wait for it).
    pub(super) fn spawn_drive(&self, session_id: Arc<str>) {
        let engine = self.clone();
        tokio::spawn(async move { engine.drive(&session_id).await });
    }

    pub(super) fn wake(&self, function_id: &str) {
        let sessions = {
            let mut reg = self.registry();
            let free = reg.free_capacity(function_id);
            reg.take_waiting(function_id, free)
        };
        for s in sessions {
            self.spawn_drive(s);
        }
    }

    /// The timer queue fired the session's entry for `due`.
    pub(super) async fn drive_timer(&self, session_id: &str, due: u64) {
        let Some(cell) = self.existing_cell(session_id) else {
            return;
        };
        {
            // The entry left the queue: forget it, so the drive arms the next one.
            let mut st = cell.state.lock().await;
            if st.timer == Some(due) {
                st.timer = None;
            }
        }
        self.drive(session_id).await;
    }

    /// Do whatever is due for a session, until nothing is.
    pub async fn drive(&self, session_id: &str) {
        let cell = self.cell(session_id);
        let mut st = match self.lock(&cell).await {
            Ok(st) => st,
            Err(e) => {
                tracing::error!(session_id, "failed to load session: {e}");
                return;
            }
        };
        for _ in 0..16 {
            let now = self.now_ms();
            if let Some(p) = &st.pending {
                if p.retry_at_ms > now {
                    break;
                }
            }
            let (settled, ()) = self.transition(&st, now, machine::due);
            if settled.is_empty() {
                st.pending = None;
                self.after_change(&mut st, Vec::new());
                break;
            }
            if let Err(e) = self.commit(&cell, &mut st, settled).await {
                let delay = st
                    .pending
                    .as_ref()
                    .map(|p| (p.delay_ms * 2).min(RETRY_MAX_MS))
                    .unwrap_or(RETRY_FIRST_MS);
                let since = st.pending.as_ref().map(|p| p.since_ms).unwrap_or(now);
                tracing::warn!(
                    session_id,
                    delay_ms = delay,
                    disk_full = e.is_disk_full(),
                    "failed to write a state change, retrying: {e}"
                );
                st.pending = Some(Box::new(Pending {
                    error: e.to_string(),
                    since_ms: since,
                    retry_at_ms: now + delay,
                    delay_ms: delay,
                }));
                self.after_change(&mut st, Vec::new());
                break;
            }
        }
    }
}

/// Bring the registry's note of what the session waits for in step with its state:
/// the function of its holder while that is queued or awaits a worker, else nothing.
/// A holder the session's hold keeps back waits for that, not for a worker: freed
/// capacity goes to sessions that can take it.
fn note_waiting(reg: &mut Registry, st: &SessionState) {
    match st.holder() {
        Some(h)
            if matches!(h.phase, Phase::Queued | Phase::AwaitingWorker)
                && machine::held_until(&st.meta, h).is_none() =>
        {
            reg.wait_for(&h.function_id, &st.id)
        }
        _ => reg.not_waiting(&st.id),
    }
}
