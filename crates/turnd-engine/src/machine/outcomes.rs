//! Outcomes: a step's result applied to its turn (completed, failed, cancelled, retry,
//! next step) and the terminal records.

use serde_json::json;
use turnd_proto::{ErrorCause, EventKind, Failure, Outcome, StopInfo, TurnError, TurnStatus};
use turnd_store::{InvState, InvWait, InvocationRecord, Phase, RawJson, TurnRecord};

use super::deadlines::{attempt_timed_out, give_up};
use super::details;
use super::dispatch::{dispatch, promote};
use super::input::suspend;
use super::{Ctx, Tx};

/// End the turn `h` with `status`, then promote the next queued turn.
pub(super) fn terminal(
    cx: &Ctx,
    tx: &mut Tx,
    mut h: TurnRecord,
    status: TurnStatus,
    detail: RawJson,
) {
    let kind = match status {
        TurnStatus::Completed => EventKind::Completed,
        TurnStatus::Failed => EventKind::Failed,
        _ => EventKind::Cancelled,
    };
    h.status = status;
    h.phase = Phase::Done;
    h.phase_since_ms = tx.now;
    h.finished_at_ms = Some(tx.now);
    h.retry_at_ms = None;
    h.input_request = None;
    tx.event(&cx.st.id, &h.turn_id, kind, detail);
    tx.put_turn(cx.st, h);
    promote(cx, tx);
}

/// Fail the turn `h`; its error carries the cause.
pub(super) fn fail(
    cx: &Ctx,
    tx: &mut Tx,
    mut h: TurnRecord,
    cause: ErrorCause,
    code: &str,
    message: String,
    invocation_id: Option<String>,
) {
    let error = TurnError {
        cause,
        code: code.to_string(),
        message,
        step: h.step,
        invocation_id,
    };
    let detail = RawJson::from_value(&json!({ "error": error, "step": h.step }));
    h.error = Some(Box::new(error));
    terminal(cx, tx, h, TurnStatus::Failed, detail);
}

fn complete(cx: &Ctx, tx: &mut Tx, mut h: TurnRecord, output: RawJson) {
    h.output = output.non_null();
    let detail = details::completed(h.step);
    terminal(cx, tx, h, TurnStatus::Completed, detail);
}

/// Cancel a turn. A turn without a stop record (its worker cancelled on its own)
/// gets one that says so: every cancelled turn says why.
pub(super) fn cancel_turn(cx: &Ctx, tx: &mut Tx, mut h: TurnRecord, worker_message: Option<&str>) {
    if h.stop.is_none() {
        h.stop = Some(Box::new(StopInfo {
            requested_at_ms: tx.now,
            reason: format!(
                "cancelled by the worker: {}",
                worker_message
                    .filter(|m| !m.is_empty())
                    .unwrap_or("no message")
            ),
        }));
    }
    let detail = RawJson::from_value(&json!({ "stop": h.stop, "step": h.step }));
    terminal(cx, tx, h, TurnStatus::Cancelled, detail);
}

/// Apply the outcome of the live invocation `inv` to the lock holder `h`.
pub(super) fn apply_outcome(
    cx: &Ctx,
    tx: &mut Tx,
    mut h: TurnRecord,
    inv: InvocationRecord,
    outcome: Outcome<RawJson>,
) {
    let max_value = cx.cfg.turns.max_value_bytes;
    tx.event(
        &cx.st.id,
        &h.turn_id,
        EventKind::Result,
        details::result(&inv, outcome.kind()),
    );
    let settings = inv.settings;
    let inv_id = inv.invocation_id.clone();
    let attempt = inv.attempt;
    // Cancelled by the daemon because the attempt ran past its deadline (a stop
    // sets `stop` as well): a `cancelled` answer then ends the attempt for that
    // reason, not the worker's own.
    let deadline_cancel = inv.wait == InvWait::Cancelling && h.stop.is_none();
    let mut done = inv;
    done.outcome = Some(outcome.kind().to_string());
    give_up(cx, tx, done, InvState::Finished);
    let stopped = h.stop.is_some();
    let too_large = |v: &RawJson| v.len() as u64 > max_value;
    let fail_too_large = |tx: &mut Tx, h: TurnRecord, inv_id: String| {
        fail(
            cx,
            tx,
            h,
            ErrorCause::InvalidResult,
            "too_large",
            format!("the step's result is larger than max_value_bytes ({max_value})"),
            Some(inv_id),
        );
    };
    match outcome {
        Outcome::Complete(output) => {
            if too_large(&output) {
                fail_too_large(tx, h, inv_id);
            } else {
                complete(cx, tx, h, output);
            }
        }
        Outcome::Continue(state) => {
            if too_large(&state) {
                fail_too_large(tx, h, inv_id);
            } else if stopped {
                cancel_turn(cx, tx, h, None);
            } else if h.step + 1 >= cx.cfg.turns.max_steps {
                let max = cx.cfg.turns.max_steps;
                fail(
                    cx,
                    tx,
                    h,
                    ErrorCause::StepLimit,
                    "step_limit",
                    format!("the turn reached max_steps ({max})"),
                    Some(inv_id),
                );
            } else {
                h.step += 1;
                h.attempt = 0;
                h.backoff_ms = 0;
                h.state = Some(state);
                h.last_error = None;
                h.phase = Phase::AwaitingWorker;
                h.phase_since_ms = tx.now;
                dispatch(tx, h, None);
            }
        }
        Outcome::Fail(mut f) => {
            if let Some(r) = h.dispatch.as_deref().and_then(|d| d.retryable) {
                f.retryable = r;
            }
            let retry = f.retryable && !stopped && attempt < settings.max_attempts;
            failed_attempt(cx, tx, h, &inv_id, attempt, f, retry, stopped);
        }
        Outcome::Cancelled(c) if deadline_cancel => {
            let message = deadline_cancel_message(&inv_id, &c.message);
            attempt_timed_out(cx, tx, h, &inv_id, attempt, settings, message);
        }
        Outcome::Cancelled(c) => cancel_turn(cx, tx, h, Some(&c.message)),
        Outcome::Suspend(s) => suspend(cx, tx, h, inv_id, s),
    }
}

/// Why an attempt that answered the deadline's `cancel` with `cancelled` ended.
fn deadline_cancel_message(inv_id: &str, worker_message: &str) -> String {
    let said = if worker_message.is_empty() {
        String::new()
    } else {
        format!(": {worker_message}")
    };
    format!("{inv_id} ran past its deadline and was cancelled for it (the worker honoured the cancel{said})")
}

/// The worker reported the attempt failed: retry it (`retry`) or fail the turn.
#[allow(clippy::too_many_arguments)]
fn failed_attempt(
    cx: &Ctx,
    tx: &mut Tx,
    mut h: TurnRecord,
    inv_id: &str,
    attempt: u32,
    f: Failure,
    retry: bool,
    stopped: bool,
) {
    let msg = if f.message.is_empty() {
        f.code.clone()
    } else {
        format!("{}: {}", f.code, f.message)
    };
    if retry {
        schedule_retry(cx, tx, h, inv_id, msg);
        return;
    }
    let cause = if f.retryable && !stopped {
        ErrorCause::AttemptsExhausted
    } else {
        ErrorCause::HandlerFailed
    };
    let message = if cause == ErrorCause::AttemptsExhausted {
        format!("{msg} (after {attempt} attempts)")
    } else {
        f.message.clone()
    };
    h.last_error = None;
    fail(cx, tx, h, cause, &f.code, message, Some(inv_id.to_string()));
}

/// A retryable failure: back off (doubling, capped), then dispatch the next attempt.
pub(super) fn schedule_retry(
    cx: &Ctx,
    tx: &mut Tx,
    mut h: TurnRecord,
    inv_id: &str,
    error: String,
) {
    let cfg = cx.cfg;
    let delay = if h.backoff_ms == 0 {
        cfg.turns.retry_backoff_ms
    } else {
        h.backoff_ms
    };
    h.backoff_ms = (delay.saturating_mul(2)).min(cfg.turns.retry_backoff_max_ms);
    h.phase = Phase::BackingOff;
    h.phase_since_ms = tx.now;
    h.retry_at_ms = Some(tx.now + delay);
    h.last_error = Some(error.clone());
    tx.event_value(
        &cx.st.id,
        &h.turn_id,
        EventKind::RetryScheduled,
        json!({"invocation_id": inv_id, "delay_ms": delay, "retry_at_ms": tx.now + delay, "error": error, "next_attempt": h.attempt + 1}),
    );
    tx.put_turn(cx.st, h);
}
