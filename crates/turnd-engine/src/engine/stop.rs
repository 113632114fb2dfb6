//! Stop: `turn.stop` and `session.stop`.

use super::*;

impl Engine {
    /// `turn.stop`.
    pub async fn stop_turn(&self, turn_id: &str, reason: Option<String>) -> ApiResult<Turn> {
        let rec = self.stored_turn(turn_id)?;
        let cell = self.cell(&rec.session_id);
        let mut st = self.lock(&cell).await.map_err(read_failed)?;
        let Some(t) = st.find(turn_id).cloned() else {
            // Terminal already: nothing changes.
            let t = self
                .inner
                .store
                .turn(turn_id)
                .map_err(read_failed)?
                .unwrap_or(rec);
            return Ok(to_turn(&t, None));
        };
        if t.stop.is_some() {
            return Ok(self.turn_view(&st, &t));
        }
        let now = self.now_ms();
        let mut tx = Tx::new(&st, now);
        self.stop_one(&st, &mut tx, t.seq, reason.unwrap_or_default());
        self.commit(&cell, &mut st, tx)
            .await
            .map_err(|e| unavailable(&e))?;
        let t = self
            .turn_record_locked(&st, turn_id)
            .map_err(read_failed)?
            .ok_or_else(|| err(ErrorCode::Internal, "stopped turn vanished"))?;
        Ok(self.turn_view(&st, &t))
    }

    /// Stop one non-terminal turn within a transaction.
    pub(super) fn stop_one(&self, st: &SessionState, tx: &mut Tx, seq: u64, reason: String) {
        let Some(mut t) = tx.take(st, seq) else {
            return;
        };
        if t.status.is_terminal() || t.stop.is_some() {
            return;
        }
        let reason = if reason.is_empty() {
            "stop requested".to_string()
        } else {
            reason
        };
        t.stop = Some(StopInfo {
            requested_at_ms: tx.now,
            reason: reason.clone(),
        });
        tx.event(
            &st.id,
            &t.turn_id,
            EventKind::StopRequested,
            json!({"reason": reason}),
        );
        let is_holder = tx.holder_seq(st) == Some(seq);
        let live = if is_holder {
            tx.live(st).cloned()
        } else {
            None
        };
        match live {
            Some(inv) if t.phase == Phase::Invoked => {
                let connected = self
                    .registry()
                    .is_connected(&inv.worker_id, &inv.instance_id);
                if connected && inv.wait != InvWait::AwaitingReconnect {
                    let mut inv = inv;
                    if inv.wait != InvWait::Cancelling {
                        inv.wait = InvWait::Cancelling;
                        inv.wait_since_ms = tx.now;
                        inv.deadline_ms = tx.now + self.inner.cfg.cancel_grace_ms;
                    }
                    self.send_cancel(tx, &inv, &reason);
                    tx.event(
                        &st.id,
                        &t.turn_id,
                        EventKind::CancelSent,
                        json!({"invocation_id": inv.invocation_id, "worker_id": inv.worker_id, "reason": reason, "deadline_ms": inv.deadline_ms}),
                    );
                    tx.put_invocation(st, inv);
                    tx.put_turn(st, t);
                } else {
                    // Waiting for a reconnect: cancelled at once, the invocation abandoned;
                    // a result that still arrives is a late result.
                    self.give_up(st, tx, inv, InvState::Abandoned);
                    self.cancel_turn(st, tx, t, None);
                }
            }
            _ => {
                if is_holder {
                    self.cancel_turn(st, tx, t, None);
                } else {
                    // A queued turn behind the holder: cancelled at once, never dispatched.
                    let detail = json!({"stop": t.stop, "step": t.step});
                    t.status = TurnStatus::Cancelled;
                    t.phase = Phase::Done;
                    t.finished_at_ms = Some(tx.now);
                    tx.event(&st.id, &t.turn_id, EventKind::Cancelled, detail);
                    tx.put_turn(st, t);
                }
            }
        }
    }

    /// `session.stop`.
    pub async fn stop_session(
        &self,
        session_id: &str,
        reason: Option<String>,
    ) -> ApiResult<Vec<Turn>> {
        check_id("session_id", session_id)?;
        let cell = self.cell(session_id);
        let mut st = self.lock(&cell).await.map_err(read_failed)?;
        if st.meta.last_turn_seq == 0 {
            return Err(err(
                ErrorCode::NotFound,
                format!("no session {session_id} exists"),
            ));
        }
        let now = self.now_ms();
        let mut tx = Tx::new(&st, now);
        let seqs: Vec<u64> = st.active.seqs().collect();
        let reason = reason.unwrap_or_default();
        // Queued turns first, newest first, so stopping the holder promotes nothing.
        for seq in seqs.iter().rev() {
            self.stop_one(&st, &mut tx, *seq, reason.clone());
        }
        let ids: Vec<String> = st.active.iter().map(|t| t.turn_id.clone()).collect();
        self.commit(&cell, &mut st, tx)
            .await
            .map_err(|e| unavailable(&e))?;
        let mut out = Vec::new();
        for id in ids {
            if let Some(t) = self.turn_record_locked(&st, &id).map_err(read_failed)? {
                out.push(self.turn_view(&st, &t));
            }
        }
        Ok(out)
    }
}
