//! Outcomes: a step's result applied to its turn (completed, failed, cancelled, retry,
//! next step) and the terminal records.

use super::*;

impl Engine {
    pub(super) fn terminal(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        mut h: TurnRecord,
        status: TurnStatus,
        detail: Value,
    ) {
        let kind = match status {
            TurnStatus::Completed => EventKind::Completed,
            TurnStatus::Failed => EventKind::Failed,
            _ => EventKind::Cancelled,
        };
        h.status = status;
        h.phase = Phase::Done;
        h.phase_since_ms = tx.now;
        h.finished_at_ms = Some(tx.now);
        h.retry_at_ms = None;
        tx.event(&st.id, &h.turn_id, kind, detail);
        tx.put_turn(st, h);
        self.promote(st, tx);
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn fail(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        mut h: TurnRecord,
        cause: ErrorCause,
        code: &str,
        message: String,
        invocation_id: Option<String>,
    ) {
        let error = TurnError {
            cause,
            code: code.to_string(),
            message,
            step: h.step,
            invocation_id,
        };
        let detail = json!({ "error": error, "step": h.step });
        h.error = Some(error);
        self.terminal(st, tx, h, TurnStatus::Failed, detail);
    }

    pub(super) fn complete(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        mut h: TurnRecord,
        output: RawJson,
    ) {
        h.output = output.non_null();
        let detail = json!({ "step": h.step });
        self.terminal(st, tx, h, TurnStatus::Completed, detail);
    }

    /// Cancel a turn. A turn without a stop record (its worker cancelled on its own)
    /// gets one that says so: every cancelled turn says why.
    pub(super) fn cancel_turn(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        mut h: TurnRecord,
        worker_message: Option<&str>,
    ) {
        if h.stop.is_none() {
            h.stop = Some(StopInfo {
                requested_at_ms: tx.now,
                reason: format!(
                    "cancelled by the worker: {}",
                    worker_message
                        .filter(|m| !m.is_empty())
                        .unwrap_or("no message")
                ),
            });
        }
        let detail = json!({ "stop": h.stop, "step": h.step });
        self.terminal(st, tx, h, TurnStatus::Cancelled, detail);
    }

    /// Apply the outcome of the live invocation to the lock holder.
    pub(super) fn apply_outcome(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        mut h: TurnRecord,
        inv: InvocationRecord,
        outcome: Outcome,
    ) {
        let max_value = self.inner.cfg.max_value_bytes;
        tx.event(
            &st.id,
            &h.turn_id,
            EventKind::Result,
            json!({"invocation_id": inv.invocation_id, "outcome": outcome.kind(), "step": inv.step, "attempt": inv.attempt}),
        );
        let settings = inv.settings;
        let inv_id = inv.invocation_id.clone();
        let mut done = inv.clone();
        done.outcome = Some(outcome.kind().to_string());
        self.give_up(st, tx, done, InvState::Finished);
        let stopped = h.stop.is_some();
        // A step's value is serialized once, for the size limit and for the record.
        let too_large = |v: &RawJson| v.len() as u64 > max_value;
        let fail_too_large = |tx: &mut Tx, h: TurnRecord, inv_id: String| {
            self.fail(
                st,
                tx,
                h,
                ErrorCause::InvalidResult,
                "too_large",
                format!("the step's result is larger than max_value_bytes ({max_value})"),
                Some(inv_id),
            );
        };
        match outcome {
            Outcome::Complete(v) => {
                let output = RawJson::from_value(&v);
                if too_large(&output) {
                    fail_too_large(tx, h, inv_id);
                } else {
                    self.complete(st, tx, h, output);
                }
            }
            Outcome::Continue(v) => {
                let state = RawJson::from_value(&v);
                if too_large(&state) {
                    fail_too_large(tx, h, inv_id);
                } else if stopped {
                    self.cancel_turn(st, tx, h, None);
                } else if h.step + 1 >= self.inner.cfg.max_steps {
                    let max = self.inner.cfg.max_steps;
                    self.fail(
                        st,
                        tx,
                        h,
                        ErrorCause::StepLimit,
                        "step_limit",
                        format!("the turn reached max_steps ({max})"),
                        Some(inv_id),
                    );
                } else {
                    h.step += 1;
                    h.attempt = 0;
                    h.backoff_ms = 0;
                    h.state = Some(state);
                    h.last_error = None;
                    h.phase = Phase::AwaitingWorker;
                    h.phase_since_ms = tx.now;
                    self.dispatch(st, tx, h, None);
                }
            }
            Outcome::Fail(f) => {
                let msg = if f.message.is_empty() {
                    f.code.clone()
                } else {
                    format!("{}: {}", f.code, f.message)
                };
                if f.retryable && !stopped && inv.attempt < settings.max_attempts {
                    self.schedule_retry(st, tx, h, &inv_id, msg);
                } else {
                    let cause = if f.retryable && !stopped {
                        ErrorCause::AttemptsExhausted
                    } else {
                        ErrorCause::HandlerFailed
                    };
                    let message = if cause == ErrorCause::AttemptsExhausted {
                        format!("{msg} (after {} attempts)", inv.attempt)
                    } else {
                        f.message.clone()
                    };
                    h.last_error = None;
                    self.fail(st, tx, h, cause, &f.code, message, Some(inv_id));
                }
            }
            Outcome::Cancelled(c) => self.cancel_turn(st, tx, h, Some(&c.message)),
        }
    }

    // ------------------------------------------------------------------ client
}
