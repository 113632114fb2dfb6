//! Dispatch: granting a worker slot to the session's next step, promoting the next
//! queued turn, and cancels sent to workers.

use super::*;

impl Engine {
    pub(super) fn send_cancel(&self, tx: &mut Tx, inv: &InvocationRecord, reason: &str) {
        if let Some(o) = self.registry().outbox_of(&inv.worker_id, &inv.instance_id) {
            let frame = push_frame(&Push::Cancel {
                invocation_id: inv.invocation_id.clone(),
                reason: reason.to_string(),
            });
            tx.effects.push(Effect::Push(o, frame));
        }
    }

    /// Dispatch the current step of turn `h` (its attempt is the next one unless
    /// `previous` names a lost invocation whose attempt is reused).
    pub(super) fn dispatch(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        mut h: TurnRecord,
        previous: Option<(&InvocationRecord, &str)>,
    ) {
        let inv_id = new_invocation_id();
        let reservation = self.registry().reserve(&h.function_id, &inv_id, &st.id);
        let Some(r) = reservation else {
            if h.phase != Phase::AwaitingWorker {
                h.phase = Phase::AwaitingWorker;
                h.phase_since_ms = tx.now;
            }
            h.retry_at_ms = None;
            if let Some((prev, _)) = previous {
                // A redispatch that found no worker: the next dispatch (attempt + 1)
                // uses the attempt number the redispatch would have used.
                h.attempt = prev.attempt.saturating_sub(1);
            }
            if tx.turn(st, h.seq) != Some(&h) {
                tx.put_turn(st, h);
            }
            return;
        };
        tx.reserved.push((r.worker_id.clone(), inv_id.clone()));
        let attempt = match previous {
            Some((prev, _)) => prev.attempt,
            None => h.attempt + 1,
        };
        let now = tx.now;
        let inv = InvocationRecord {
            invocation_id: inv_id.clone(),
            turn_id: h.turn_id.clone(),
            session_id: st.id.clone(),
            function_id: h.function_id.clone(),
            step: h.step,
            attempt,
            worker_id: r.worker_id.clone(),
            instance_id: r.instance_id.clone(),
            settings: r.settings,
            state: InvState::Active,
            wait: InvWait::AwaitingResult,
            wait_since_ms: now,
            deadline_ms: now + r.settings.timeout_ms,
            attempt_deadline_ms: now + r.settings.timeout_ms,
            dispatched_at_ms: now,
            ended_at_ms: None,
            outcome: None,
            late: false,
        };
        let (kind, detail) = match previous {
            Some((prev, reason)) => (
                EventKind::Redispatched,
                dispatch_detail(&inv, Some(&prev.invocation_id), Some(reason)),
            ),
            None => (EventKind::Dispatched, dispatch_detail(&inv, None, None)),
        };
        tx.event(&st.id, &h.turn_id, kind, detail);
        let frame = push_frame(&Push::Invoke(Invoke {
            invocation_id: inv_id.clone(),
            function_id: h.function_id.clone(),
            session_id: st.id.clone(),
            turn_id: h.turn_id.clone(),
            step: h.step,
            attempt,
            input: h.state().to_value(),
            deadline_ms: inv.deadline_ms,
        }));
        tx.effects.push(Effect::Push(r.outbox, frame));
        h.status = TurnStatus::Running;
        h.phase = Phase::Invoked;
        h.phase_since_ms = now;
        h.attempt = attempt;
        h.invocation_id = Some(inv_id);
        h.retry_at_ms = None;
        h.settings = Some(r.settings);
        tx.put_turn(st, h);
        tx.put_invocation(st, inv);
    }

    /// Make the next queued turn the lock holder and dispatch it if a worker is free.
    pub(super) fn promote(&self, st: &SessionState, tx: &mut Tx) {
        if let Some(seq) = tx.holder_seq(st) {
            if let Some(h) = tx.take(st, seq) {
                if h.phase == Phase::Queued {
                    let mut h = h;
                    h.phase = Phase::AwaitingWorker;
                    h.phase_since_ms = tx.now;
                    h.locked_at_ms = Some(tx.now);
                    if h.deadline_ms.map(|d| d <= tx.now).unwrap_or(false) {
                        self.fail(
                            st,
                            tx,
                            h,
                            ErrorCause::TimedOut,
                            "turn_timeout",
                            "the turn's deadline (turn_timeout_ms) passed while it was queued"
                                .into(),
                            None,
                        );
                        return;
                    }
                    self.dispatch(st, tx, h, None);
                }
            }
        }
    }
}
