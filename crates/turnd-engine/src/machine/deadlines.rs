//! Deadlines and loss: what is due when a session's timer fires (probe, give up,
//! retry, time out), the outcome-unknown rules, and when the timer fires next.

use serde_json::json;
use turnd_proto::{Delivery, ErrorCause, EventKind};
use turnd_store::{FunctionSettings, Held, InvState, InvWait, InvocationRecord, Phase, TurnRecord};

use super::dispatch::{dispatch, send_cancel};
use super::input::input_due;
use super::outcomes::{cancel_turn, fail, schedule_retry};
use super::{held_until, Ctx, Effect, Slot, Tx};
use crate::config::EngineConfig;
use crate::session::SessionState;

/// The transition that is due now for the session, if any (the timer fired, the
/// worker went away, capacity was freed, a write is retried).
pub fn due(cx: &Ctx, tx: &mut Tx) {
    let st = cx.st;
    let now = tx.now;
    let Some(h) = tx.holder_seq(st).and_then(|s| tx.take(st, s)) else {
        return;
    };
    if h.deadline_ms.map(|d| d <= now).unwrap_or(false) {
        turn_deadline(cx, tx, h);
        return;
    }
    match h.phase {
        Phase::Queued | Phase::AwaitingWorker => waiting_due(cx, tx, h),
        Phase::BackingOff => {
            if h.retry_at_ms.map(|r| r <= now).unwrap_or(true) {
                dispatch(tx, h, None);
            }
        }
        Phase::Invoked => invoked_due(cx, tx, h),
        Phase::AwaitingInput => input_due(cx, tx, h),
        Phase::Done => {}
    }
}

/// What is due for a lock holder that waits to be dispatched: its dispatch bound or
/// `turns.dispatch_timeout_ms` passed (it fails with `no_worker`), the session's
/// hold ended, or a worker may take it now.
fn waiting_due(cx: &Ctx, tx: &mut Tx, mut h: TurnRecord) {
    let now = tx.now;
    let f = h.function_id.clone();
    let no_worker = |tx: &mut Tx, h: TurnRecord, message: String| {
        fail(cx, tx, h, ErrorCause::NoWorker, "no_worker", message, None);
    };
    if let Some(by) = h.dispatch.as_deref().and_then(|d| d.dispatch_by_ms) {
        if by <= now {
            let after = by.saturating_sub(h.created_at_ms);
            let message = format!(
                "no worker took {f} by the turn's dispatch bound ({after} ms after its admission)"
            );
            return no_worker(tx, h, message);
        }
    }
    if let Some(until) = held_until(&tx.meta, &h) {
        if until <= now {
            // The invocation held for passed its deadline: the holder waits for a
            // worker from now on.
            tx.meta.held = None;
            h.phase = Phase::AwaitingWorker;
            h.phase_since_ms = now;
            dispatch(tx, h, None);
        }
        return;
    }
    let since = if h.phase == Phase::Queued {
        now
    } else {
        h.phase_since_ms
    };
    if let Some(d) = cx.cfg.turns.dispatch_timeout_ms {
        if since + d <= now {
            let message = format!("no worker served {f} within dispatch_timeout_ms ({d} ms)");
            return no_worker(tx, h, message);
        }
    }
    dispatch(tx, h, None);
}

/// The turn's own deadline passed.
fn turn_deadline(cx: &Ctx, tx: &mut Tx, h: TurnRecord) {
    let inv = tx.live(cx.st).cloned();
    if h.stop.is_some() {
        // Stopped before its own deadline passed: the stop is what ends it.
        if let Some(inv) = inv {
            send_cancel(tx, &inv, "stop requested");
            give_up(cx, tx, inv, InvState::Abandoned);
        }
        cancel_turn(cx, tx, h, None);
        return;
    }
    if let Some(inv) = &inv {
        send_cancel(tx, inv, "the turn's deadline passed");
        give_up(cx, tx, inv.clone(), InvState::TimedOut);
    }
    fail(
        cx,
        tx,
        h,
        ErrorCause::TimedOut,
        "turn_timeout",
        "the turn's deadline (turn_timeout_ms) passed".into(),
        inv.map(|i| i.invocation_id),
    );
}

/// The attempt deadline passed: ask the worker about the invocation, and wait
/// `turns.probe_timeout_ms` for its answer.
fn probe(cx: &Ctx, tx: &mut Tx, h: &TurnRecord, mut inv: InvocationRecord) {
    let st = cx.st;
    let now = tx.now;
    inv.wait = InvWait::Probing;
    inv.wait_since_ms = now;
    inv.deadline_ms = now + cx.cfg.turns.probe_timeout_ms;
    tx.event_value(
        &st.id,
        &h.turn_id,
        EventKind::ProbeSent,
        json!({"invocation_id": inv.invocation_id, "worker_id": inv.worker_id, "deadline_ms": inv.deadline_ms}),
    );
    tx.effects.push(Effect::Probe {
        worker_id: inv.worker_id.clone(),
        instance_id: inv.instance_id.clone(),
        invocation_id: inv.invocation_id.clone(),
    });
    tx.put_invocation(st, inv);
}

/// What is due for a lock holder with an invocation out.
fn invoked_due(cx: &Ctx, tx: &mut Tx, h: TurnRecord) {
    let st = cx.st;
    let now = tx.now;
    let Some(mut inv) = tx.live(st).cloned() else {
        // The dispatch record is missing: the invocation was never written, so it
        // was never sent. Dispatch again.
        dispatch(tx, h, None);
        return;
    };
    let connected = cx.worker_connected;
    if !connected && inv.wait == InvWait::Cancelling && h.stop.is_some() {
        // Stopped, and the worker is gone: nothing can answer the cancel.
        give_up(cx, tx, inv, InvState::Abandoned);
        cancel_turn(cx, tx, h, None);
        return;
    }
    if !connected
        && matches!(
            inv.wait,
            InvWait::AwaitingResult | InvWait::Probing | InvWait::AwaitingResend
        )
    {
        inv.wait = InvWait::AwaitingReconnect;
        inv.wait_since_ms = now;
        inv.deadline_ms = now + cx.cfg.turns.reconnect_grace_ms;
        tx.put_invocation(st, inv);
        return;
    }
    if connected && inv.wait == InvWait::AwaitingReconnect && cx.cfg.partition.is_some() {
        present(cx, tx, &h, inv);
        return;
    }
    if inv.deadline_ms > now {
        return;
    }
    match inv.wait {
        InvWait::AwaitingResult if !cx.worker_probes => outcome_unknown(
            cx,
            tx,
            h,
            inv,
            "the attempt deadline passed and the worker cannot be probed",
        ),
        InvWait::AwaitingResult => probe(cx, tx, &h, inv),
        InvWait::Probing => outcome_unknown(
            cx,
            tx,
            h,
            inv,
            "no answer to the probe within probe_timeout_ms",
        ),
        InvWait::AwaitingResend => outcome_unknown(
            cx,
            tx,
            h,
            inv,
            "the worker reported the invocation finished but its result did not arrive within probe_timeout_ms",
        ),
        InvWait::AwaitingReconnect => outcome_unknown(
            cx,
            tx,
            h,
            inv,
            "the worker did not reconnect within reconnect_grace_ms",
        ),
        InvWait::Cancelling => {
            if h.stop.is_some() {
                give_up(cx, tx, inv, InvState::Abandoned);
                cancel_turn(cx, tx, h, None);
            } else {
                timed_out(cx, tx, h, inv);
            }
        }
    }
}

/// A cluster's new leader of the partition recovered the invocation while its worker
/// was attached to this node already (its `hello` came before the node led the
/// partition, so no `hello` will reconcile it): ask the worker about it now, as at a
/// passed deadline. A worker that cannot be probed keeps its handlers across
/// reconnects (an iii worker): it is taken to still run it, under its attempt
/// deadline.
fn present(cx: &Ctx, tx: &mut Tx, h: &TurnRecord, mut inv: InvocationRecord) {
    if cx.worker_probes {
        probe(cx, tx, h, inv);
        return;
    }
    inv.wait = InvWait::AwaitingResult;
    inv.wait_since_ms = tx.now;
    inv.deadline_ms = inv.attempt_deadline_ms.max(tx.now);
    tx.put_invocation(cx.st, inv);
}

/// Mark an invocation given up (or finished) and free its slot before the next
/// dispatch is looked for, so the same worker can take the session's next step in
/// this transaction.
///
/// An invocation given up without its result (stopped, or past the turn's deadline)
/// on a worker that cannot cancel it may still be running: the session holds
/// ([`SessionMeta::held`]) until its result arrives or its attempt deadline passes,
/// and dispatches nothing meanwhile.
pub(super) fn give_up(cx: &Ctx, tx: &mut Tx, mut inv: InvocationRecord, state: InvState) {
    if !cx.worker_probes
        && matches!(state, InvState::Abandoned | InvState::TimedOut)
        && inv.attempt_deadline_ms > tx.now
    {
        tx.meta.held = Some(Box::new(Held {
            invocation_id: inv.invocation_id.clone(),
            turn_id: inv.turn_id.clone(),
            worker_id: inv.worker_id.clone(),
            since_ms: tx.now,
            until_ms: inv.attempt_deadline_ms,
        }));
    }
    inv.state = state;
    inv.ended_at_ms = Some(tx.now);
    tx.frees.push(Slot {
        worker_id: inv.worker_id.clone(),
        instance_id: inv.instance_id.clone(),
        invocation_id: inv.invocation_id.clone(),
        function_id: inv.function_id.clone(),
    });
    tx.put_invocation(cx.st, inv);
}

/// Rule 4 of the semantics: an attempt whose outcome is unknown.
pub(super) fn outcome_unknown(
    cx: &Ctx,
    tx: &mut Tx,
    h: TurnRecord,
    inv: InvocationRecord,
    reason: &str,
) {
    tx.event_value(
        &cx.st.id,
        &h.turn_id,
        EventKind::OutcomeUnknown,
        json!({"invocation_id": inv.invocation_id, "worker_id": inv.worker_id, "step": inv.step, "attempt": inv.attempt, "reason": reason}),
    );
    let settings = inv.settings;
    let inv_id = inv.invocation_id.clone();
    give_up(cx, tx, inv.clone(), InvState::Unknown);
    if h.stop.is_some() {
        cancel_turn(cx, tx, h, None);
    } else if settings.delivery == Delivery::AtLeastOnce {
        if inv.attempt < settings.max_attempts {
            let mut next = inv;
            next.attempt += 1;
            dispatch(tx, h, Some((&next, reason)));
        } else {
            fail(
                cx,
                tx,
                h,
                ErrorCause::AttemptsExhausted,
                "outcome_unknown",
                format!(
                    "outcome of the last attempt is unknown ({reason}) and all {} attempts are used",
                    settings.max_attempts
                ),
                Some(inv_id),
            );
        }
    } else {
        fail(
            cx,
            tx,
            h,
            ErrorCause::OutcomeUnknown,
            "outcome_unknown",
            format!("outcome of {inv_id} is unknown: {reason}; at_most_once never runs it again"),
            Some(inv_id),
        );
    }
}

/// The attempt ran past its deadline and did not answer the cancel in time.
fn timed_out(cx: &Ctx, tx: &mut Tx, h: TurnRecord, inv: InvocationRecord) {
    let settings = inv.settings;
    let inv_id = inv.invocation_id.clone();
    let attempt = inv.attempt;
    give_up(cx, tx, inv, InvState::TimedOut);
    let message = format!("{inv_id} was still running past its deadline and did not answer the cancel within cancel_grace_ms");
    attempt_timed_out(cx, tx, h, &inv_id, attempt, settings, message);
}

/// The attempt `inv_id` of `h` ran past its deadline and was cancelled for it (its
/// invocation already ended): the deadline is the cause, whether the worker
/// answered the cancel or not. Under `at_least_once` with attempts left the step is
/// retried; otherwise the turn fails `timed_out`.
pub(super) fn attempt_timed_out(
    cx: &Ctx,
    tx: &mut Tx,
    mut h: TurnRecord,
    inv_id: &str,
    attempt: u32,
    settings: FunctionSettings,
    message: String,
) {
    let inv_id = inv_id.to_string();
    if settings.delivery == Delivery::AtLeastOnce && attempt < settings.max_attempts {
        h.last_error = Some(message.clone());
        schedule_retry(cx, tx, h, &inv_id, message);
    } else {
        fail(
            cx,
            tx,
            h,
            ErrorCause::TimedOut,
            "timed_out",
            message,
            Some(inv_id),
        );
    }
}

/// The next time something is due for the session (Unix ms), if anything is.
pub fn next_due(st: &SessionState, cfg: &EngineConfig) -> Option<u64> {
    if let Some(p) = &st.pending {
        return Some(p.retry_at_ms);
    }
    let h = st.holder()?;
    let phase_due = match h.phase {
        Phase::Queued | Phase::AwaitingWorker => {
            let by = h.dispatch.as_deref().and_then(|d| d.dispatch_by_ms);
            let wait = match held_until(&st.meta, h) {
                Some(until) => Some(until),
                None => cfg.turns.dispatch_timeout_ms.map(|d| h.phase_since_ms + d),
            };
            earliest(by, wait)
        }
        Phase::BackingOff => h.retry_at_ms,
        Phase::Invoked => st.inv.as_ref().map(|i| i.deadline_ms),
        Phase::AwaitingInput => h.input_request.as_ref().and_then(|w| w.deadline_ms),
        Phase::Done => None,
    };
    earliest(h.deadline_ms, phase_due)
}

fn earliest(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}
