//! Deadlines and loss: what `drive` does when a session's timer fires (probe, give up,
//! retry, time out) and the outcome-unknown rules.

use super::*;

impl Engine {
    /// Build the transition that is due now for the session, if any.
    pub(super) fn due(&self, st: &SessionState, tx: &mut Tx) {
        let now = tx.now;
        let Some(h) = tx.holder_seq(st).and_then(|s| tx.take(st, s)) else {
            return;
        };
        if h.deadline_ms.map(|d| d <= now).unwrap_or(false) && h.stop.is_some() {
            // Stopped before its own deadline passed: the stop is what ends it.
            if let Some(inv) = tx.live(st).cloned() {
                self.send_cancel(tx, &inv, "stop requested");
                self.give_up(st, tx, inv, InvState::Abandoned);
            }
            self.cancel_turn(st, tx, h, None);
            return;
        }
        if h.deadline_ms.map(|d| d <= now).unwrap_or(false) {
            let inv = tx.live(st).cloned();
            if let Some(inv) = &inv {
                self.send_cancel(tx, inv, "the turn's deadline passed");
                self.give_up(st, tx, inv.clone(), InvState::TimedOut);
            }
            self.fail(
                st,
                tx,
                h,
                ErrorCause::TimedOut,
                "turn_timeout",
                "the turn's deadline (turn_timeout_ms) passed".into(),
                inv.map(|i| i.invocation_id),
            );
            return;
        }
        match h.phase {
            Phase::Queued | Phase::AwaitingWorker => {
                let since = if h.phase == Phase::Queued {
                    now
                } else {
                    h.phase_since_ms
                };
                if let Some(d) = self.inner.cfg.dispatch_timeout_ms {
                    if since + d <= now {
                        let f = h.function_id.clone();
                        self.fail(
                            st,
                            tx,
                            h,
                            ErrorCause::NoWorker,
                            "no_worker",
                            format!("no worker served {f} within dispatch_timeout_ms ({d} ms)"),
                            None,
                        );
                        return;
                    }
                }
                self.dispatch(st, tx, h, None);
            }
            Phase::BackingOff => {
                if h.retry_at_ms.map(|r| r <= now).unwrap_or(true) {
                    self.dispatch(st, tx, h, None);
                }
            }
            Phase::Invoked => {
                let Some(inv) = tx.live(st).cloned() else {
                    // The dispatch record is missing: the invocation was never written,
                    // so it was never sent. Dispatch again.
                    self.dispatch(st, tx, h, None);
                    return;
                };
                let connected = self
                    .registry()
                    .is_connected(&inv.worker_id, &inv.instance_id);
                if !connected && inv.wait == InvWait::Cancelling && h.stop.is_some() {
                    // Stopped, and the worker is gone: nothing can answer the cancel.
                    self.give_up(st, tx, inv, InvState::Abandoned);
                    self.cancel_turn(st, tx, h, None);
                    return;
                }
                if !connected
                    && matches!(
                        inv.wait,
                        InvWait::AwaitingResult | InvWait::Probing | InvWait::AwaitingResend
                    )
                {
                    let mut inv = inv;
                    inv.wait = InvWait::AwaitingReconnect;
                    inv.wait_since_ms = now;
                    inv.deadline_ms = now + self.inner.cfg.reconnect_grace_ms;
                    tx.put_invocation(st, inv);
                    return;
                }
                if inv.deadline_ms > now {
                    return;
                }
                match inv.wait {
                    InvWait::AwaitingResult if !self.registry().caps(&inv.worker_id).probe => self
                        .outcome_unknown(
                            st,
                            tx,
                            h,
                            inv,
                            "the attempt deadline passed and the worker cannot be probed",
                        ),
                    InvWait::AwaitingResult => {
                        let mut inv = inv;
                        inv.wait = InvWait::Probing;
                        inv.wait_since_ms = now;
                        inv.deadline_ms = now + self.inner.cfg.probe_timeout_ms;
                        tx.event(
                            &st.id,
                            &h.turn_id,
                            EventKind::ProbeSent,
                            json!({"invocation_id": inv.invocation_id, "worker_id": inv.worker_id, "deadline_ms": inv.deadline_ms}),
                        );
                        if let Some(o) = self.registry().outbox_of(&inv.worker_id, &inv.instance_id) {
                            let frame = push_frame(&Push::Probe {
                                invocation_id: inv.invocation_id.clone(),
                            });
                            tx.effects.push(Effect::Push(o, frame));
                        }
                        tx.put_invocation(st, inv);
                    }
                    InvWait::Probing => {
                        self.outcome_unknown(st, tx, h, inv, "no answer to the probe within probe_timeout_ms")
                    }
                    InvWait::AwaitingResend => self.outcome_unknown(
                        st,
                        tx,
                        h,
                        inv,
                        "the worker reported the invocation finished but its result did not arrive within probe_timeout_ms",
                    ),
                    InvWait::AwaitingReconnect => self.outcome_unknown(
                        st,
                        tx,
                        h,
                        inv,
                        "the worker did not reconnect within reconnect_grace_ms",
                    ),
                    InvWait::Cancelling => {
                        if h.stop.is_some() {
                            self.give_up(st, tx, inv, InvState::Abandoned);
                            self.cancel_turn(st, tx, h, None);
                        } else {
                            self.timed_out(st, tx, h, inv);
                        }
                    }
                }
            }
            Phase::Done => {}
        }
    }

    /// Mark an invocation given up (or finished) and free its slot now, so the same
    /// worker can take the session's next dispatch in this transaction.
    pub(super) fn give_up(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        mut inv: InvocationRecord,
        state: InvState,
    ) {
        inv.state = state;
        inv.ended_at_ms = Some(tx.now);
        if self
            .registry()
            .release(&inv.worker_id, &inv.invocation_id)
            .is_some()
        {
            tx.released.push((
                inv.worker_id.clone(),
                inv.instance_id.clone(),
                inv.invocation_id.clone(),
                inv.function_id.clone(),
            ));
        }
        tx.put_invocation(st, inv);
    }

    /// Rule 4 of the semantics: an attempt whose outcome is unknown.
    pub(super) fn outcome_unknown(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        h: TurnRecord,
        inv: InvocationRecord,
        reason: &str,
    ) {
        tx.event(
            &st.id,
            &h.turn_id,
            EventKind::OutcomeUnknown,
            json!({"invocation_id": inv.invocation_id, "worker_id": inv.worker_id, "step": inv.step, "attempt": inv.attempt, "reason": reason}),
        );
        let settings = inv.settings;
        let inv_id = inv.invocation_id.clone();
        self.give_up(st, tx, inv.clone(), InvState::Unknown);
        if h.stop.is_some() {
            self.cancel_turn(st, tx, h, None);
        } else if settings.delivery == Delivery::AtLeastOnce {
            if inv.attempt < settings.max_attempts {
                let mut next = inv;
                next.attempt += 1;
                self.dispatch(st, tx, h, Some((&next, reason)));
            } else {
                self.fail(
                    st,
                    tx,
                    h,
                    ErrorCause::AttemptsExhausted,
                    "outcome_unknown",
                    format!("outcome of the last attempt is unknown ({reason}) and all {} attempts are used", settings.max_attempts),
                    Some(inv_id),
                );
            }
        } else {
            self.fail(
                st,
                tx,
                h,
                ErrorCause::OutcomeUnknown,
                "outcome_unknown",
                format!(
                    "outcome of {inv_id} is unknown: {reason}; at_most_once never runs it again"
                ),
                Some(inv_id),
            );
        }
    }

    /// The attempt ran past its deadline and did not answer the cancel in time.
    pub(super) fn timed_out(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        mut h: TurnRecord,
        inv: InvocationRecord,
    ) {
        let settings = inv.settings;
        let inv_id = inv.invocation_id.clone();
        let attempt = inv.attempt;
        self.give_up(st, tx, inv, InvState::TimedOut);
        let message = format!("{inv_id} was still running past its deadline and did not answer the cancel within cancel_grace_ms");
        if settings.delivery == Delivery::AtLeastOnce && attempt < settings.max_attempts {
            h.last_error = Some(message.clone());
            self.schedule_retry(st, tx, h, &inv_id, message);
        } else {
            self.fail(
                st,
                tx,
                h,
                ErrorCause::TimedOut,
                "timed_out",
                message,
                Some(inv_id),
            );
        }
    }

    pub(super) fn schedule_retry(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        mut h: TurnRecord,
        inv_id: &str,
        error: String,
    ) {
        let cfg = &self.inner.cfg;
        let delay = if h.backoff_ms == 0 {
            cfg.retry_backoff_ms
        } else {
            h.backoff_ms
        };
        h.backoff_ms = (delay.saturating_mul(2)).min(cfg.retry_backoff_max_ms);
        h.phase = Phase::BackingOff;
        h.phase_since_ms = tx.now;
        h.retry_at_ms = Some(tx.now + delay);
        h.last_error = Some(error.clone());
        tx.event(
            &st.id,
            &h.turn_id,
            EventKind::RetryScheduled,
            json!({"invocation_id": inv_id, "delay_ms": delay, "retry_at_ms": tx.now + delay, "error": error, "next_attempt": h.attempt + 1}),
        );
        tx.put_turn(st, h);
    }
}
