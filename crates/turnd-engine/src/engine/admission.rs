//! Admission: `turn.submit`, its validation and idempotency.

use super::*;

impl Engine {
    /// `turn.submit`.
    pub async fn submit(&self, args: SubmitArgs) -> ApiResult<SubmitOk> {
        check_id("session_id", &args.session_id)?;
        check_id("function_id", &args.function_id)?;
        if let Some(k) = &args.idempotency_key {
            check_id("idempotency_key", k)?;
        }
        let max = self.inner.cfg.turns.max_value_bytes;
        let input = RawJson::from_value(&args.input);
        if input.len() as u64 > max {
            return Err(EngineError::InputTooLarge { max });
        }
        if args.turn_timeout_ms == Some(0) {
            return Err(EngineError::out_of_range("turn_timeout_ms", "positive"));
        }
        let cell = self.cell(&args.session_id);
        let mut st = self.lock(&cell).await.map_err(read_failed)?;
        if let Some(key) = &args.idempotency_key {
            if let Some(rec) = self
                .inner
                .store
                .idempotency(st.meta.keys(), key)
                .map_err(read_failed)?
            {
                let t = self
                    .turn_record_locked(&st, &rec.turn_id)
                    .map_err(read_failed)?
                    .ok_or_else(|| {
                        EngineError::invariant(format!(
                            "idempotency key names missing turn {}",
                            rec.turn_id
                        ))
                    })?;
                if t.function_id != args.function_id || t.input.to_value() != args.input {
                    return Err(EngineError::IdempotencyConflict {
                        key: key.clone(),
                        turn_id: t.turn_id.clone(),
                    });
                }
                Counters::inc(&self.inner.counters.deduplicated);
                return Ok(SubmitOk {
                    turn: self.turn_view(&st, &t),
                    deduplicated: true,
                });
            }
        }
        if st.active.len() as u64 >= self.inner.cfg.turns.max_queued_per_session {
            return Err(EngineError::QueueFull {
                session_id: st.id.to_string(),
                held: st.active.len(),
            });
        }
        let turn_id = new_turn_id();
        let submission = machine::Submission {
            turn_id: turn_id.clone(),
            function_id: args.function_id,
            input,
            idempotency_key: args.idempotency_key,
            turn_timeout_ms: args.turn_timeout_ms,
        };
        let tx = self.transition(&st, self.now_ms(), |cx, tx| {
            machine::submit(cx, tx, submission)
        });
        self.commit(&cell, &mut st, tx).await.map_err(unavailable)?;
        let t = self
            .turn_record_locked(&st, &turn_id)
            .map_err(read_failed)?
            .ok_or_else(|| EngineError::invariant("admitted turn vanished"))?;
        Ok(SubmitOk {
            turn: self.turn_view(&st, &t),
            deduplicated: false,
        })
    }
}
