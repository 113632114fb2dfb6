//! Turns suspended for input: a step's `suspend` outcome, `turn.resume`, and the end
//! of the wait at its deadline. A suspended turn keeps its session's lock with no
//! invocation out (phase `AwaitingInput`); its next step gets `{"state", "input"}`.

use serde_json::{json, Value};
use turnd_proto::{ErrorCause, EventKind, OnTimeout, Suspend};
use turnd_store::{InputWait, Phase, RawJson, ResumeKey, TurnRecord};

use super::dispatch::dispatch;
use super::outcomes::{cancel_turn, fail};
use super::{Ctx, Tx};

/// A step of the lock holder `h` (its invocation `inv_id` already ended) asked for
/// input: the turn waits for `turn.resume` with the suspend's state and prompt, or
/// fails (an oversized value, `timeout_ms: 0`, the step limit), or is cancelled when
/// a stop was asked.
pub(super) fn suspend(cx: &Ctx, tx: &mut Tx, mut h: TurnRecord, inv_id: String, s: Suspend) {
    let max_value = cx.cfg.turns.max_value_bytes;
    let state = RawJson::from_value(&s.state);
    let prompt = s.prompt.as_ref().map(RawJson::from_value);
    let invalid = |tx: &mut Tx, h: TurnRecord, code: &str, message: String| {
        fail(
            cx,
            tx,
            h,
            ErrorCause::InvalidResult,
            code,
            message,
            Some(inv_id.clone()),
        );
    };
    if state.len() as u64 > max_value || prompt.as_ref().is_some_and(|p| p.len() as u64 > max_value)
    {
        let message =
            format!("the suspend's state or prompt is larger than max_value_bytes ({max_value})");
        return invalid(tx, h, "too_large", message);
    }
    if s.timeout_ms == Some(0) {
        return invalid(
            tx,
            h,
            "bad_request",
            "a suspend's timeout_ms must be positive".into(),
        );
    }
    if h.stop.is_some() {
        return cancel_turn(cx, tx, h, None);
    }
    if h.step + 1 >= cx.cfg.turns.max_steps {
        let max = cx.cfg.turns.max_steps;
        let message = format!("the turn reached max_steps ({max})");
        return fail(
            cx,
            tx,
            h,
            ErrorCause::StepLimit,
            "step_limit",
            message,
            Some(inv_id),
        );
    }
    let now = tx.now;
    let deadline_ms = s.timeout_ms.map(|t| now.saturating_add(t));
    tx.event_value(
        &cx.st.id,
        &h.turn_id,
        EventKind::Suspended,
        json!({"invocation_id": inv_id, "step": h.step, "prompt": s.prompt, "deadline_ms": deadline_ms, "on_timeout": s.on_timeout}),
    );
    h.state = Some(state);
    h.phase = Phase::AwaitingInput;
    h.phase_since_ms = now;
    h.last_error = None;
    h.input_request = Some(Box::new(InputWait {
        prompt,
        since_ms: now,
        deadline_ms,
        on_timeout: s.on_timeout,
    }));
    tx.put_turn(cx.st, h);
}

/// What became of a `turn.resume`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResumeVerdict {
    /// The turn's next step was let go.
    Resumed,
    /// The turn was resumed before with this idempotency key and this input: nothing
    /// changes, the caller gets the turn as it is.
    Duplicate,
    /// The idempotency key resumed the turn before with another input.
    KeyConflict,
    /// The turn is not awaiting input (what it is doing instead, in words).
    NotWaiting(String),
}

/// What a resume with `key` and `input` is for turn `t` before anything else: a
/// repeat of one of its resumes (or a reuse of its key with another input), if it
/// is one.
pub fn resume_key_verdict(
    t: &TurnRecord,
    key: Option<&str>,
    input: &RawJson,
) -> Option<ResumeVerdict> {
    let key = key?;
    let k = t.resume_keys.iter().find(|k| k.key == key)?;
    Some(if k.same_input(input) {
        ResumeVerdict::Duplicate
    } else {
        ResumeVerdict::KeyConflict
    })
}

/// Event "resume": the input the suspended turn `seq` waits for. Only a turn
/// awaiting input is resumed; anything else changes nothing.
pub fn resume(
    cx: &Ctx,
    tx: &mut Tx,
    seq: u64,
    input: RawJson,
    key: Option<String>,
) -> ResumeVerdict {
    let Some(t) = tx.take(cx.st, seq) else {
        return ResumeVerdict::NotWaiting("it has ended".into());
    };
    if let Some(v) = resume_key_verdict(&t, key.as_deref(), &input) {
        return v;
    }
    if t.phase != Phase::AwaitingInput {
        let doing = if t.status.is_terminal() {
            format!("it is {}", t.status.as_str())
        } else {
            format!("it is {} at step {}", t.status.as_str(), t.step)
        };
        return ResumeVerdict::NotWaiting(doing);
    }
    next_step(cx, tx, t, Some(input), key, false);
    ResumeVerdict::Resumed
}

/// Let the suspended turn `h` go on: its next step (attempt 0) is wanted dispatched
/// with `{"state": <the suspend's state>, "input": <input or null>}`.
fn next_step(
    cx: &Ctx,
    tx: &mut Tx,
    mut h: TurnRecord,
    input: Option<RawJson>,
    key: Option<String>,
    timed_out: bool,
) {
    let input_value = input.as_ref().map_or(Value::Null, RawJson::to_value);
    let next = json!({"state": h.state().to_value(), "input": input_value});
    h.step += 1;
    h.attempt = 0;
    h.backoff_ms = 0;
    h.state = Some(RawJson::from_value(&next));
    h.input_request = None;
    h.phase = Phase::AwaitingWorker;
    h.phase_since_ms = tx.now;
    if let (Some(k), Some(i)) = (&key, &input) {
        h.resume_keys.push(ResumeKey::new(k.clone(), i));
    }
    tx.event_value(
        &cx.st.id,
        &h.turn_id,
        EventKind::Resumed,
        json!({"step": h.step, "idempotency_key": key, "timed_out": timed_out}),
    );
    dispatch(tx, h, None);
}

/// What is due for a lock holder awaiting input: at its input deadline it fails
/// with `input_timeout`, or its next step runs without input.
pub(super) fn input_due(cx: &Ctx, tx: &mut Tx, h: TurnRecord) {
    let Some(w) = h.input_request.as_deref().cloned() else {
        return;
    };
    if w.deadline_ms.is_none_or(|d| d > tx.now) {
        return;
    }
    match w.on_timeout {
        OnTimeout::Fail => {
            let message = format!(
                "no input came for step {} within its suspend's timeout_ms ({} ms)",
                h.step,
                w.deadline_ms.unwrap_or(0).saturating_sub(w.since_ms)
            );
            fail(
                cx,
                tx,
                h,
                ErrorCause::InputTimeout,
                "input_timeout",
                message,
                None,
            );
        }
        OnTimeout::Continue => next_step(cx, tx, h, None, None, true),
    }
}
