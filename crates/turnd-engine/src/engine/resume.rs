//! `turn.resume`: the input a turn suspended for input waits for, let go by the
//! machine's `resume` under the session's lock and answered once durable.

use turnd_proto::{ResumeArgs, SubmitOk};
use turnd_store::{RawJson, TurnRecord};

use super::{read_failed, unavailable, ApiResult, Engine};
use crate::error::EngineError;
use crate::machine::{self, ResumeVerdict};
use crate::metrics::Counters;
use crate::session::SessionState;

impl Engine {
    /// `turn.resume`: `conflict` unless the turn awaits input (or the resume repeats
    /// one of its earlier resumes: the same key and input get the turn as it is now,
    /// `deduplicated`).
    pub async fn resume(&self, args: ResumeArgs) -> ApiResult<SubmitOk<RawJson>> {
        let input = RawJson::from_value(&args.input);
        self.checked_input(&input, args.idempotency_key.as_deref())?;
        let rec = self.stored_turn(&args.turn_id)?;
        let cell = self.sessions().cell(&rec.session_id);
        let mut st = self.sessions().lock(&cell).await.map_err(read_failed)?;
        let key = args.idempotency_key;
        let Some(seq) = st.find(&args.turn_id).map(|t| t.seq) else {
            // Finished: only a repeat of one of its resumes is answered.
            let t = self
                .turn_record_locked(&st, &args.turn_id)
                .map_err(read_failed)?
                .unwrap_or(rec);
            let verdict =
                machine::resume_key_verdict(&t, key.as_deref(), &input).unwrap_or_else(|| {
                    ResumeVerdict::NotWaiting(format!("it is {}", t.status.as_str()))
                });
            return self.resumed(&st, &t, verdict);
        };
        let (settled, verdict) = self.transition(&st, self.now_ms(), |cx, tx| {
            machine::resume(cx, tx, seq, input, key)
        });
        if verdict == ResumeVerdict::Resumed {
            self.commit(&cell, &mut st, settled)
                .await
                .map_err(unavailable)?;
        }
        let t = self
            .turn_record_locked(&st, &args.turn_id)
            .map_err(read_failed)?
            .ok_or_else(|| EngineError::invariant("resumed turn vanished"))?;
        self.resumed(&st, &t, verdict)
    }

    /// The answer to a resume of `t` that came to `verdict`.
    fn resumed(
        &self,
        st: &SessionState,
        t: &TurnRecord,
        verdict: ResumeVerdict,
    ) -> ApiResult<SubmitOk<RawJson>> {
        let deduplicated = match verdict {
            ResumeVerdict::Resumed => false,
            ResumeVerdict::Duplicate => {
                Counters::inc(&self.inner.counters.deduplicated);
                true
            }
            ResumeVerdict::KeyConflict => {
                return Err(EngineError::ResumeKeyConflict {
                    key: t
                        .resume_keys
                        .last()
                        .map(|k| k.key.clone())
                        .unwrap_or_default(),
                    turn_id: t.turn_id.clone(),
                })
            }
            ResumeVerdict::NotWaiting(doing) => {
                return Err(EngineError::NotAwaitingInput {
                    turn_id: t.turn_id.clone(),
                    doing,
                })
            }
        };
        Ok(SubmitOk {
            turn: self.turn_view(st, t),
            deduplicated,
        })
    }
}
