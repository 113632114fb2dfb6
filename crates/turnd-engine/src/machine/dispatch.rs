//! Dispatch: wanting a worker slot for the session's next step, the slot granted (or
//! refused), promoting the next queued turn, and cancels sent to workers.

use serde_json::json;
use turnd_proto::{ErrorCause, EventKind, Invoke, PreviousTurn, TurnStatus};
use turnd_store::{InvState, InvWait, InvocationRecord, Phase, RawJson, TurnRecord};

use super::details;
use super::outcomes::fail;
use super::{Ctx, Effect, Grant, Previous, Tx, Want};

/// Ask the worker holding `inv` to stop it.
pub(super) fn send_cancel(tx: &mut Tx, inv: &InvocationRecord, reason: &str) {
    tx.effects.push(Effect::Cancel {
        worker_id: inv.worker_id.clone(),
        instance_id: inv.instance_id.clone(),
        invocation_id: inv.invocation_id.clone(),
        reason: reason.to_string(),
    });
}

/// Send a cancel for `inv`, an invocation of `turn_id` now waiting for the cancel's
/// answer, and record it with a `cancel_sent` event.
pub(super) fn send_cancel_recorded(
    tx: &mut Tx,
    session_id: &str,
    turn_id: &str,
    inv: &InvocationRecord,
    reason: &str,
) {
    send_cancel(tx, inv, reason);
    tx.event_value(
        session_id,
        turn_id,
        EventKind::CancelSent,
        json!({"invocation_id": inv.invocation_id, "worker_id": inv.worker_id, "reason": reason, "deadline_ms": inv.deadline_ms}),
    );
}

/// Want the current step of turn `h` dispatched (its attempt is the next one unless
/// `previous` names a lost invocation whose attempt is reused). The shell answers
/// with [`grant`].
pub(super) fn dispatch(tx: &mut Tx, h: TurnRecord, previous: Option<(&InvocationRecord, &str)>) {
    tx.dispatch = Some(Want {
        turn: h,
        previous: previous.map(|(prev, reason)| Previous {
            invocation_id: prev.invocation_id.clone(),
            attempt: prev.attempt,
            reason: reason.to_string(),
        }),
    });
}

/// Event "dispatch slot granted": the answer to the transition's [`Tx::dispatch`].
/// With a slot the step is invoked on it; without one the turn waits for a worker.
pub fn grant(cx: &Ctx, tx: &mut Tx, slot: Option<Grant>) {
    let Some(Want {
        turn: mut h,
        previous,
    }) = tx.dispatch.take()
    else {
        return;
    };
    let st = cx.st;
    let Some(r) = slot else {
        return no_slot(cx, tx, h, previous.as_ref());
    };
    let attempt = match &previous {
        Some(prev) => prev.attempt,
        None => h.attempt + 1,
    };
    let now = tx.now;
    let inv_id = r.invocation_id.clone();
    let settings = h
        .dispatch
        .as_deref()
        .map_or(r.settings, |d| d.apply(r.settings));
    let inv = InvocationRecord {
        invocation_id: inv_id.clone(),
        turn_id: h.turn_id.clone(),
        session_id: st.id.to_string(),
        function_id: h.function_id.clone(),
        step: h.step,
        attempt,
        worker_id: r.worker_id.clone(),
        instance_id: r.instance_id.clone(),
        settings,
        state: InvState::Active,
        wait: InvWait::AwaitingResult,
        wait_since_ms: now,
        deadline_ms: now + settings.timeout_ms,
        attempt_deadline_ms: now + settings.timeout_ms,
        dispatched_at_ms: now,
        ended_at_ms: None,
        outcome: None,
        late: false,
    };
    let (kind, detail) = match &previous {
        Some(prev) => (
            EventKind::Redispatched,
            details::dispatched(&inv, Some(&prev.invocation_id), Some(&prev.reason)),
        ),
        None => (EventKind::Dispatched, details::dispatched(&inv, None, None)),
    };
    tx.event(&st.id, &h.turn_id, kind, detail);
    tx.effects.push(Effect::Invoke {
        worker_id: r.worker_id,
        instance_id: r.instance_id,
        conn_id: r.conn_id,
        invoke: Invoke {
            invocation_id: inv_id.clone(),
            function_id: h.function_id.clone(),
            session_id: st.id.to_string(),
            turn_id: h.turn_id.clone(),
            step: h.step,
            attempt,
            input: h.state().clone(),
            deadline_ms: inv.deadline_ms,
            previous: previous_of(&h),
        },
    });
    h.status = TurnStatus::Running;
    h.phase = Phase::Invoked;
    h.phase_since_ms = now;
    h.attempt = attempt;
    h.invocation_id = Some(inv_id);
    h.retry_at_ms = None;
    h.settings = Some(settings);
    tx.put_turn(st, h);
    tx.put_new_invocation(st, inv);
}

/// No slot for the dispatch of `h`: it waits for a worker.
fn no_slot(cx: &Ctx, tx: &mut Tx, mut h: TurnRecord, previous: Option<&Previous>) {
    let st = cx.st;
    if h.phase != Phase::AwaitingWorker {
        h.phase = Phase::AwaitingWorker;
        h.phase_since_ms = tx.now;
    }
    h.retry_at_ms = None;
    if let Some(prev) = previous {
        // A redispatch that found no worker: the next dispatch (attempt + 1) uses
        // the attempt number the redispatch would have used.
        h.attempt = prev.attempt.saturating_sub(1);
    }
    if tx.turn(st, h.seq) != Some(&h) {
        tx.put_turn(st, h);
    }
}

/// Make the next queued turn the lock holder and want it dispatched.
pub(super) fn promote(cx: &Ctx, tx: &mut Tx) {
    let st = cx.st;
    let Some(mut h) = tx.holder_seq(st).and_then(|seq| tx.take(st, seq)) else {
        return;
    };
    if h.phase != Phase::Queued {
        return;
    }
    h.phase = Phase::AwaitingWorker;
    h.phase_since_ms = tx.now;
    h.locked_at_ms = Some(tx.now);
    if h.deadline_ms.map(|d| d <= tx.now).unwrap_or(false) {
        fail(
            cx,
            tx,
            h,
            ErrorCause::TimedOut,
            "turn_timeout",
            "the turn's deadline (turn_timeout_ms) passed while it was queued".into(),
            None,
        );
        return;
    }
    dispatch(tx, h, None);
}

/// The `previous` of an invoke of `h`: the turn it interrupted, at its step 0.
fn previous_of(h: &TurnRecord) -> Option<PreviousTurn<RawJson>> {
    let p = h.previous.as_deref().filter(|_| h.step == 0)?;
    Some(PreviousTurn {
        turn_id: p.turn_id.clone(),
        status: p.status,
        state: p.state.clone(),
    })
}
