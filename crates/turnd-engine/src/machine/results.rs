//! Results: a worker's `result` (current or late), `heartbeat` and `status` (probe
//! answer) for its invocations. Each is fenced by invocation: only the session's
//! live invocation moves the turn.

use serde_json::json;
use turnd_proto::{ErrorCause, EventKind, InvocationState, Outcome, TurnStatus};
use turnd_store::{InvState, InvWait, InvocationRecord, Phase, RawJson, TurnRecord};

use super::dispatch::{dispatch, send_cancel_recorded};
use super::outcomes::apply_outcome;
use super::reconcile::lost;
use super::{held_until, Ctx, Tx};

/// Event "result": the outcome of `invocation_id`. Returns false, and builds nothing,
/// when it is not the session's live invocation (the shell then looks up its record
/// for [`late_result`]).
pub fn result(cx: &Ctx, tx: &mut Tx, invocation_id: &str, outcome: Outcome<RawJson>) -> bool {
    let Some(inv) = tx
        .live(cx.st)
        .filter(|i| i.invocation_id == invocation_id)
        .cloned()
    else {
        return false;
    };
    let Some(h) = tx.holder_seq(cx.st).and_then(|s| tx.take(cx.st, s)) else {
        return false;
    };
    apply_outcome(cx, tx, h, inv, outcome);
    true
}

/// What became of a result for an invocation that is not the live one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LateVerdict {
    /// Its result was applied already (or recorded late already): nothing changes.
    Duplicate,
    /// Recorded as evidence (and, where it names the failure, amending it).
    Recorded,
    /// The record says active, but it is not the session's live invocation.
    ActiveNotCurrent,
}

/// Event "late result": a result for `rec`, which ended before it came. Recorded as
/// evidence; a `complete` amends an `outcome_unknown` failure of `turn` that names
/// exactly this invocation. `turn` is the stored turn of `rec` (read for a
/// `complete` only).
pub fn late_result(
    cx: &Ctx,
    tx: &mut Tx,
    rec: &InvocationRecord,
    outcome: &Outcome<RawJson>,
    turn: Option<&TurnRecord>,
) -> LateVerdict {
    if rec.state == InvState::Finished || rec.late {
        return LateVerdict::Duplicate;
    }
    if rec.state == InvState::Active {
        return LateVerdict::ActiveNotCurrent;
    }
    let st = cx.st;
    let mut late = rec.clone();
    late.late = true;
    tx.put_invocation(st, late);
    tx.event_value(
        &st.id,
        &rec.turn_id,
        EventKind::LateResult,
        json!({"invocation_id": rec.invocation_id, "outcome": outcome.kind(), "invocation_state": rec.state.as_str(), "step": rec.step, "attempt": rec.attempt}),
    );
    release_hold(cx, tx, &rec.invocation_id);
    let (Outcome::Complete(output), Some(t)) = (outcome, turn) else {
        return LateVerdict::Recorded;
    };
    let names_it = t.status == TurnStatus::Failed
        && t.error
            .as_ref()
            .map(|e| {
                e.cause == ErrorCause::OutcomeUnknown
                    && e.invocation_id.as_deref() == Some(&rec.invocation_id)
            })
            .unwrap_or(false);
    let output = output.clone();
    if names_it && output.len() as u64 <= cx.cfg.turns.max_value_bytes {
        let before = json!({"status": t.status, "error": t.error});
        let mut amended = t.clone();
        amended.status = TurnStatus::Completed;
        amended.output = output.non_null();
        amended.recovered = true;
        amended.error = None;
        tx.event_value(
            &st.id,
            &t.turn_id,
            EventKind::Amended,
            json!({"invocation_id": rec.invocation_id, "before": before, "after": {"status": "completed", "recovered": true}}),
        );
        tx.put_turn_from(amended, Some(TurnStatus::Failed));
    }
    LateVerdict::Recorded
}

/// The result of the invocation the session holds for arrived: it no longer runs,
/// so the hold ends and the lock holder, if it waits, is dispatched.
fn release_hold(cx: &Ctx, tx: &mut Tx, invocation_id: &str) {
    if tx
        .meta
        .held
        .as_deref()
        .is_none_or(|h| h.invocation_id != invocation_id)
    {
        return;
    }
    let st = cx.st;
    let holder = tx.holder_seq(st).and_then(|s| tx.take(st, s));
    if let Some(mut h) = holder.filter(|h| held_until(&tx.meta, h).is_some()) {
        h.phase = Phase::AwaitingWorker;
        h.phase_since_ms = tx.now;
        dispatch(tx, h, None);
    }
    tx.meta.held = None;
}

/// The answer to a heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heartbeat {
    /// Not the live invocation: the worker should stop it.
    NotCurrent,
    /// The invocation's deadline now.
    Deadline(u64),
}

/// Event "heartbeat": the live invocation's deadline moves to `now + timeout_ms`
/// (not while it is being cancelled or its result is awaited again).
pub fn heartbeat(cx: &Ctx, tx: &mut Tx, invocation_id: &str) -> Heartbeat {
    let Some(mut inv) = cx.st.current_inv(invocation_id).cloned() else {
        return Heartbeat::NotCurrent;
    };
    if matches!(inv.wait, InvWait::Cancelling | InvWait::AwaitingResend) {
        return Heartbeat::Deadline(inv.deadline_ms);
    }
    let now = tx.now;
    if inv.wait != InvWait::AwaitingResult {
        inv.wait = InvWait::AwaitingResult;
        inv.wait_since_ms = now;
    }
    inv.deadline_ms = now + inv.settings.timeout_ms;
    inv.attempt_deadline_ms = inv.deadline_ms;
    let deadline = inv.deadline_ms;
    tx.put_invocation(cx.st, inv);
    Heartbeat::Deadline(deadline)
}

/// What became of a probe answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeVerdict {
    /// Not about the invocation being probed (any more): nothing changes.
    Stale,
    /// The answer moved the invocation on.
    Applied,
}

/// Event "probe answer" (`invocation.status`). Only an answer about the invocation
/// being probed changes anything.
pub fn probe_answer(
    cx: &Ctx,
    tx: &mut Tx,
    invocation_id: &str,
    state: InvocationState,
) -> ProbeVerdict {
    let st = cx.st;
    let Some(mut inv) = st
        .current_inv(invocation_id)
        .filter(|i| i.wait == InvWait::Probing)
        .cloned()
    else {
        return ProbeVerdict::Stale;
    };
    let Some(h) = st.holder().cloned() else {
        return ProbeVerdict::Stale;
    };
    let now = tx.now;
    match state {
        InvocationState::Finished => {
            inv.wait = InvWait::AwaitingResend;
            inv.wait_since_ms = now;
            inv.deadline_ms = now + cx.cfg.turns.probe_timeout_ms;
            tx.put_invocation(st, inv);
        }
        InvocationState::Unknown => lost(
            cx,
            tx,
            h,
            inv,
            "the worker never received the invocation (probe answered unknown)",
        ),
        InvocationState::Running => {
            inv.wait = InvWait::Cancelling;
            inv.wait_since_ms = now;
            inv.deadline_ms = now + cx.cfg.turns.cancel_grace_ms;
            let reason = "the attempt ran past its deadline";
            send_cancel_recorded(tx, &st.id, &h.turn_id, &inv, reason);
            tx.put_invocation(st, inv);
        }
    }
    ProbeVerdict::Applied
}
