//! Results: a worker's `result`, `heartbeat` and `status` (probe answer) for its
//! invocations.

use turnd_proto::{
    Accepted, HeartbeatOk, InvocationState, Outcome, ResultArgs, ResultOk, StatusArgs,
};
use turnd_store::{FoldedTurn, InvState, InvocationRecord, RawJson, TurnRecord};

use super::{read_failed, unavailable, ApiResult, Caller, Engine};
use crate::error::EngineError;
use crate::machine;
use crate::metrics::Counters;

impl Engine {
    /// `invocation.result`.
    pub async fn result(&self, caller: &Caller, args: ResultArgs) -> ApiResult<ResultOk> {
        let args = args.map_json(|v| RawJson::from_value(&v));
        Box::pin(self.take_result(caller, args)).await
    }

    /// `invocation.result` with its value as the JSON text the request carried, taken
    /// as it is when compact ([`RawJson::compacted`]).
    pub async fn result_raw(
        &self,
        caller: &Caller,
        args: ResultArgs<RawJson>,
    ) -> ApiResult<ResultOk> {
        let args = args.map_json(RawJson::compacted);
        Box::pin(self.take_result(caller, args)).await
    }

    /// A result with its value as the daemon keeps it.
    async fn take_result(&self, caller: &Caller, args: ResultArgs<RawJson>) -> ApiResult<ResultOk> {
        let unknown = || {
            Counters::inc(&self.inner.counters.results_unknown);
            Ok(ResultOk {
                accepted: Accepted::Unknown,
            })
        };
        let Some(session_id) = self.invocation_session(caller, &args.invocation_id)? else {
            return unknown();
        };
        let cell = self.sessions().cell(&session_id);
        let mut st = self.sessions().lock(&cell).await.map_err(read_failed)?;
        let now = self.now_ms();
        if st.current_inv(&args.invocation_id).is_some() {
            let outcome = args.outcome;
            let (settled, current) = self.transition(&st, now, |cx, tx| {
                machine::result(cx, tx, &args.invocation_id, outcome)
            });
            if !current {
                return Err(EngineError::invariant(
                    "live invocation without a lock holder",
                ));
            }
            self.commit(&cell, &mut st, settled)
                .await
                .map_err(unavailable)?;
            Counters::inc(&self.inner.counters.results_applied);
            return Ok(ResultOk {
                accepted: Accepted::Applied,
            });
        }
        let outcome = args.outcome;
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
        let (folded, turn) = self.late_result_records(&rec, &outcome)?;
        let (settled, verdict) = self.transition(&st, now, |cx, tx| {
            if let Some(f) = folded {
                tx.fold_onto(f);
            }
            machine::late_result(cx, tx, &rec, &outcome, turn.as_ref())
        });
        match verdict {
            machine::LateVerdict::Duplicate => {
                Counters::inc(&self.inner.counters.results_duplicate);
                Ok(ResultOk {
                    accepted: Accepted::Duplicate,
                })
            }
            machine::LateVerdict::ActiveNotCurrent => Err(EngineError::invariant(format!(
                "invocation {} is active but not its session's current one",
                rec.invocation_id
            ))),
            machine::LateVerdict::Recorded => {
                self.commit(&cell, &mut st, settled)
                    .await
                    .map_err(unavailable)?;
                Counters::inc(&self.inner.counters.results_late);
                Ok(ResultOk {
                    accepted: Accepted::Late,
                })
            }
        }
    }

    /// What a late result of `rec` reads before its transition: the turn's folded
    /// record when it is finished (what the late result writes goes into it), and the
    /// stored turn, for a `complete` that may amend its failure.
    fn late_result_records(
        &self,
        rec: &InvocationRecord,
        outcome: &Outcome<RawJson>,
    ) -> ApiResult<(Option<FoldedTurn>, Option<TurnRecord>)> {
        let recordable = !rec.late && !matches!(rec.state, InvState::Finished | InvState::Active);
        let folded = if recordable {
            self.inner
                .store
                .finished(&rec.turn_id)
                .map_err(read_failed)?
        } else {
            None
        };
        let turn = match outcome {
            Outcome::Complete(_) if recordable => match &folded {
                Some(f) => Some(f.turn.clone()),
                None => self.inner.store.turn(&rec.turn_id).map_err(read_failed)?,
            },
            _ => None,
        };
        Ok((folded, turn))
    }

    /// `invocation.heartbeat`.
    pub async fn heartbeat(&self, caller: &Caller, invocation_id: &str) -> ApiResult<HeartbeatOk> {
        let not_current = || EngineError::NotCurrent {
            invocation_id: invocation_id.to_string(),
        };
        let session_id = self
            .invocation_session(caller, invocation_id)?
            .ok_or_else(not_current)?;
        let cell = self.sessions().cell(&session_id);
        let mut st = self.sessions().lock(&cell).await.map_err(read_failed)?;
        let (settled, answer) = self.transition(&st, self.now_ms(), |cx, tx| {
            machine::heartbeat(cx, tx, invocation_id)
        });
        let machine::Heartbeat::Deadline(deadline_ms) = answer else {
            return Err(not_current());
        };
        if !settled.is_empty() {
            self.commit(&cell, &mut st, settled)
                .await
                .map_err(unavailable)?;
        }
        Ok(HeartbeatOk { deadline_ms })
    }

    /// `invocation.status`: a worker's answer to a probe.
    pub async fn status(&self, caller: &Caller, args: &StatusArgs) -> ApiResult<()> {
        let session_id = self
            .invocation_session(caller, &args.invocation_id)?
            .ok_or_else(|| EngineError::NoInvocation(args.invocation_id.clone()))?;
        let label = match args.state {
            InvocationState::Running => "running",
            InvocationState::Finished => "finished",
            InvocationState::Unknown => "unknown",
        };
        self.inner.counters.probe_answer(label);
        let cell = self.sessions().cell(&session_id);
        let mut st = self.sessions().lock(&cell).await.map_err(read_failed)?;
        let (settled, answer) = self.transition(&st, self.now_ms(), |cx, tx| {
            machine::probe_answer(cx, tx, &args.invocation_id, args.state)
        });
        if answer == machine::ProbeVerdict::Stale {
            // Not probing this invocation (any more): a stale status changes nothing.
            return Ok(());
        }
        self.commit(&cell, &mut st, settled)
            .await
            .map_err(unavailable)?;
        Ok(())
    }
}
