//! Results: a worker's `result`, `heartbeat` and `status` (probe answer) for its
//! invocations.

use super::*;

impl Engine {
    /// Apply the outcome of the session's current invocation and commit it.
    pub(super) async fn apply_current_result(
        &self,
        cell: &Arc<SessionCell>,
        st: &mut SessionState,
        outcome: Outcome,
    ) -> ApiResult<ResultOk> {
        let inv = st
            .inv
            .as_deref()
            .cloned()
            .ok_or_else(|| err(ErrorCode::Internal, "live invocation vanished"))?;
        let h = st
            .holder()
            .cloned()
            .ok_or_else(|| err(ErrorCode::Internal, "live invocation without a lock holder"))?;
        let mut tx = Tx::new(st, self.now_ms());
        self.apply_outcome(st, &mut tx, h, inv, outcome);
        self.commit(cell, st, tx)
            .await
            .map_err(|e| unavailable(&e))?;
        Counters::inc(&self.inner.counters.results_applied);
        Ok(ResultOk {
            accepted: Accepted::Applied,
        })
    }

    /// `invocation.result`.
    pub async fn result(&self, caller: &Caller, args: ResultArgs) -> ApiResult<ResultOk> {
        let unknown = || {
            Counters::inc(&self.inner.counters.results_unknown);
            Ok(ResultOk {
                accepted: Accepted::Unknown,
            })
        };
        let Some(session_id) = self.invocation_session(caller, &args.invocation_id)? else {
            return unknown();
        };
        let cell = self.cell(&session_id);
        let mut st = self.lock(&cell).await.map_err(read_failed)?;
        if st.current_inv(&args.invocation_id).is_some() {
            return self
                .apply_current_result(&cell, &mut st, args.outcome)
                .await;
        }
        // Not current: read its record under the lock, it may have ended while we
        // waited.
        let Some(rec) = self
            .inner
            .store
            .invocation(&args.invocation_id)
            .map_err(read_failed)?
        else {
            return unknown();
        };
        let now = self.now_ms();
        if rec.state == InvState::Finished || rec.late {
            Counters::inc(&self.inner.counters.results_duplicate);
            return Ok(ResultOk {
                accepted: Accepted::Duplicate,
            });
        }
        if rec.state == InvState::Active {
            return Err(err(
                ErrorCode::Internal,
                format!(
                    "invocation {} is active but not its session's current one",
                    rec.invocation_id
                ),
            ));
        }
        // A late result: recorded as evidence, and it amends an outcome_unknown failure
        // that names exactly this invocation when the late outcome is `complete`.
        let mut tx = Tx::new(&st, now);
        let mut late = rec.clone();
        late.late = true;
        tx.put_invocation(&st, late);
        tx.event(
            &st.id,
            &rec.turn_id,
            EventKind::LateResult,
            json!({"invocation_id": rec.invocation_id, "outcome": args.outcome.kind(), "invocation_state": rec.state.as_str(), "step": rec.step, "attempt": rec.attempt}),
        );
        if let Outcome::Complete(output) = &args.outcome {
            if let Some(t) = self.inner.store.turn(&rec.turn_id).map_err(read_failed)? {
                let names_it = t.status == TurnStatus::Failed
                    && t.error
                        .as_ref()
                        .map(|e| {
                            e.cause == ErrorCause::OutcomeUnknown
                                && e.invocation_id.as_deref() == Some(&rec.invocation_id)
                        })
                        .unwrap_or(false);
                let output = RawJson::from_value(output);
                if names_it && output.len() as u64 <= self.inner.cfg.max_value_bytes {
                    let before = json!({"status": t.status, "error": t.error});
                    let mut amended = t.clone();
                    amended.status = TurnStatus::Completed;
                    amended.output = output.non_null();
                    amended.recovered = true;
                    amended.error = None;
                    tx.event(
                        &st.id,
                        &t.turn_id,
                        EventKind::Amended,
                        json!({"invocation_id": rec.invocation_id, "before": before, "after": {"status": "completed", "recovered": true}}),
                    );
                    tx.put_turn_from(amended, Some(TurnStatus::Failed));
                }
            }
        }
        self.commit(&cell, &mut st, tx)
            .await
            .map_err(|e| unavailable(&e))?;
        Counters::inc(&self.inner.counters.results_late);
        Ok(ResultOk {
            accepted: Accepted::Late,
        })
    }

    /// `invocation.heartbeat`.
    pub async fn heartbeat(&self, caller: &Caller, invocation_id: &str) -> ApiResult<HeartbeatOk> {
        let not_current = || {
            err(
                ErrorCode::NotFound,
                format!("invocation {invocation_id} is not current; stop it"),
            )
        };
        let session_id = self
            .invocation_session(caller, invocation_id)?
            .ok_or_else(not_current)?;
        let cell = self.cell(&session_id);
        let mut st = self.lock(&cell).await.map_err(read_failed)?;
        let Some(inv) = st.current_inv(invocation_id).cloned() else {
            return Err(not_current());
        };
        if matches!(inv.wait, InvWait::Cancelling | InvWait::AwaitingResend) {
            return Ok(HeartbeatOk {
                deadline_ms: inv.deadline_ms,
            });
        }
        let now = self.now_ms();
        let mut tx = Tx::new(&st, now);
        let mut inv = inv;
        if inv.wait != InvWait::AwaitingResult {
            inv.wait = InvWait::AwaitingResult;
            inv.wait_since_ms = now;
        }
        inv.deadline_ms = now + inv.settings.timeout_ms;
        inv.attempt_deadline_ms = inv.deadline_ms;
        let deadline_ms = inv.deadline_ms;
        tx.put_invocation(&st, inv);
        self.commit(&cell, &mut st, tx)
            .await
            .map_err(|e| unavailable(&e))?;
        Ok(HeartbeatOk { deadline_ms })
    }

    /// `invocation.status`: a worker's answer to a probe.
    pub async fn status(&self, caller: &Caller, args: &StatusArgs) -> ApiResult<()> {
        let session_id = self
            .invocation_session(caller, &args.invocation_id)?
            .ok_or_else(|| {
                err(
                    ErrorCode::NotFound,
                    format!("no invocation {} exists", args.invocation_id),
                )
            })?;
        let label = match args.state {
            InvocationState::Running => "running",
            InvocationState::Finished => "finished",
            InvocationState::Unknown => "unknown",
        };
        self.inner.counters.probe_answer(label);
        let cell = self.cell(&session_id);
        let mut st = self.lock(&cell).await.map_err(read_failed)?;
        let Some(inv) = st
            .current_inv(&args.invocation_id)
            .filter(|i| i.wait == InvWait::Probing)
            .cloned()
        else {
            // Not probing this invocation (any more): a stale status changes nothing.
            return Ok(());
        };
        let Some(h) = st.holder().cloned() else {
            return Ok(());
        };
        let now = self.now_ms();
        let mut tx = Tx::new(&st, now);
        match args.state {
            InvocationState::Finished => {
                let mut inv = inv;
                inv.wait = InvWait::AwaitingResend;
                inv.wait_since_ms = now;
                inv.deadline_ms = now + self.inner.cfg.probe_timeout_ms;
                tx.put_invocation(&st, inv);
            }
            InvocationState::Unknown => {
                self.lost(
                    &st,
                    &mut tx,
                    h,
                    inv,
                    "the worker never received the invocation (probe answered unknown)",
                );
            }
            InvocationState::Running => {
                let mut inv = inv;
                inv.wait = InvWait::Cancelling;
                inv.wait_since_ms = now;
                inv.deadline_ms = now + self.inner.cfg.cancel_grace_ms;
                let reason = "the attempt ran past its deadline";
                self.send_cancel(&mut tx, &inv, reason);
                tx.event(
                    &st.id,
                    &h.turn_id,
                    EventKind::CancelSent,
                    json!({"invocation_id": inv.invocation_id, "worker_id": inv.worker_id, "reason": reason, "deadline_ms": inv.deadline_ms}),
                );
                tx.put_invocation(&st, inv);
            }
        }
        self.commit(&cell, &mut st, tx)
            .await
            .map_err(|e| unavailable(&e))?;
        Ok(())
    }

    // ---------------------------------------------------------------- recovery
}
