//! `turn.submit`: the checks of its arguments, the idempotency key, `on_busy`, then
//! the machine's `submit` under the session's lock.

use turnd_proto::{new_turn_id, new_turn_id_in, OnBusy, SubmitArgs, SubmitOk};
use turnd_store::{RawJson, TurnDispatch};

use super::{check_id, read_failed, unavailable, ApiResult, Engine};
use crate::error::EngineError;
use crate::machine;
use crate::metrics::Counters;
use crate::session::SessionState;
use crate::TurnView;

/// What an endpoint in process may give a turn beyond `turn.submit`'s arguments.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SubmitOptions {
    /// Dispatch settings in place of the function's registration.
    pub dispatch: Option<TurnDispatch>,
    /// The first retry's backoff in place of `turns.retry_backoff_ms`.
    pub retry_backoff_ms: Option<u64>,
}

impl SubmitOptions {
    fn check(&self) -> ApiResult<()> {
        let Some(d) = &self.dispatch else {
            return Ok(());
        };
        if d.timeout_ms == Some(0) {
            return Err(EngineError::out_of_range("timeout_ms", "positive"));
        }
        if d.max_attempts.is_some_and(|a| a == 0 || a > 1000) {
            return Err(EngineError::out_of_range("max_attempts", "1 to 1000"));
        }
        Ok(())
    }
}

impl Engine {
    /// `turn.submit`.
    pub async fn submit(&self, args: SubmitArgs) -> ApiResult<SubmitOk<RawJson>> {
        self.submit_with(args, SubmitOptions::default()).await
    }

    /// `turn.submit` with settings of the turn's own ([`SubmitOptions`]). A resent
    /// submit that finds its idempotency key returns the turn it admitted.
    pub async fn submit_with(
        &self,
        args: SubmitArgs,
        opts: SubmitOptions,
    ) -> ApiResult<SubmitOk<RawJson>> {
        let args = args.map_input(|v| RawJson::from_value(&v));
        Box::pin(self.admit(args, opts)).await
    }

    /// `turn.submit` with its input as the JSON text the request carried, taken as
    /// it is when compact ([`RawJson::compacted`]).
    pub async fn submit_raw(
        &self,
        args: SubmitArgs<RawJson>,
        opts: SubmitOptions,
    ) -> ApiResult<SubmitOk<RawJson>> {
        let args = args.map_input(RawJson::compacted);
        Box::pin(self.admit(args, opts)).await
    }

    /// A submit of an input as the daemon keeps it.
    async fn admit(
        &self,
        args: SubmitArgs<RawJson>,
        opts: SubmitOptions,
    ) -> ApiResult<SubmitOk<RawJson>> {
        self.check_submit(&args, &opts)?;
        let cell = self.sessions().cell(&args.session_id);
        let mut st = self.sessions().lock(&cell).await.map_err(read_failed)?;
        if let Some(turn) = self.admitted_before(&st, &args)? {
            Counters::inc(&self.inner.counters.deduplicated);
            return Ok(SubmitOk {
                turn,
                deduplicated: true,
            });
        }
        let on_busy = args.on_busy.unwrap_or_default();
        self.check_busy(&st, on_busy)?;
        let turn_id = match self.config().partition {
            Some(p) => new_turn_id_in(p.index),
            None => new_turn_id(),
        };
        let submission = machine::Submission {
            turn_id: turn_id.clone(),
            function_id: args.function_id,
            input: args.input,
            idempotency_key: args.idempotency_key,
            turn_timeout_ms: args.turn_timeout_ms,
            dispatch: opts.dispatch,
            retry_backoff_ms: opts.retry_backoff_ms,
            on_busy,
        };
        let (admitted, interrupted) = self.transition(&st, self.now_ms(), |cx, tx| {
            machine::submit(cx, tx, submission)
        });
        // Boxed: a submit may wait long for its session's lock, and what it holds
        // meanwhile should not include room for the commit.
        Box::pin(self.commit(&cell, &mut st, admitted))
            .await
            .map_err(unavailable)?;
        let stopped = interrupted.turn_ids.len() as u64;
        Counters::add(&self.inner.counters.interrupted, stopped);
        // The turn admitted is the session's newest (admission gives it the next
        // seq, and nothing ends it before the answer): its view is made from it in
        // place, without a search of the session's turns or a copy of its record.
        let t = st
            .active
            .last()
            .filter(|t| t.turn_id == turn_id)
            .ok_or_else(|| EngineError::invariant("admitted turn is not the session's newest"))?;
        Ok(SubmitOk {
            turn: self.turn_view(&st, t),
            deduplicated: false,
        })
    }

    /// What the session's unfinished turns mean for a submit with `on_busy`: with
    /// `reject`, any is `busy` (nothing is stored); with `enqueue`, the session must
    /// have room for one more. An interrupting submit stops them all, so it always
    /// has room.
    fn check_busy(&self, st: &SessionState, on_busy: OnBusy) -> ApiResult<()> {
        let held = st.active.len();
        match on_busy {
            OnBusy::Reject if held > 0 => {
                Counters::inc(&self.inner.counters.busy_rejected);
                Err(EngineError::Busy {
                    session_id: st.id.to_string(),
                    unfinished: held,
                    holder: st.holder().map(|t| t.turn_id.clone()).unwrap_or_default(),
                })
            }
            OnBusy::Interrupt | OnBusy::Rollback => Ok(()),
            _ if held as u64 >= self.inner.cfg.turns.max_queued_per_session => {
                Err(EngineError::QueueFull {
                    session_id: st.id.to_string(),
                    held,
                })
            }
            _ => Ok(()),
        }
    }

    /// A caller's `input` as stored, and its idempotency key, checked: `too_large`
    /// over `turns.max_value_bytes` (a submit's and a resume's alike).
    pub(super) fn checked_input(&self, input: &RawJson, key: Option<&str>) -> ApiResult<()> {
        if let Some(k) = key {
            check_id("idempotency_key", k)?;
        }
        let max = self.inner.cfg.turns.max_value_bytes;
        if input.len() as u64 > max {
            return Err(EngineError::InputTooLarge { max });
        }
        Ok(())
    }

    /// Check a submit's arguments.
    fn check_submit(&self, args: &SubmitArgs<RawJson>, opts: &SubmitOptions) -> ApiResult<()> {
        opts.check()?;
        check_id("session_id", &args.session_id)?;
        check_id("function_id", &args.function_id)?;
        self.checked_input(&args.input, args.idempotency_key.as_deref())?;
        if args.turn_timeout_ms == Some(0) {
            return Err(EngineError::out_of_range("turn_timeout_ms", "positive"));
        }
        Ok(())
    }

    /// The turn a submit with the same idempotency key admitted before, if any; a
    /// conflict if that one had another function or input.
    fn admitted_before(
        &self,
        st: &SessionState,
        args: &SubmitArgs<RawJson>,
    ) -> ApiResult<Option<TurnView>> {
        let Some(key) = &args.idempotency_key else {
            return Ok(None);
        };
        let store = &self.inner.store;
        let Some(rec) = store
            .idempotency(st.meta.keys(), key)
            .map_err(read_failed)?
        else {
            return Ok(None);
        };
        let t = self
            .turn_record_locked(st, &rec.turn_id)
            .map_err(read_failed)?
            .ok_or_else(|| {
                EngineError::invariant(format!(
                    "idempotency key names missing turn {}",
                    rec.turn_id
                ))
            })?;
        // Compared parsed: the same input sent with its members in another order is
        // the same input.
        if t.function_id != args.function_id || *t.input != args.input.to_value() {
            return Err(EngineError::IdempotencyConflict {
                key: key.clone(),
                turn_id: t.turn_id.clone(),
            });
        }
        Ok(Some(self.turn_view(st, &t)))
    }
}
