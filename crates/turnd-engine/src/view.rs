//! How a turn is shown: the protocol `Turn` of a record, and the `Wait` of an
//! unfinished one: why it is not moving and what happens next, computed from the
//! session's state and, for a turn waiting for a worker, who could run it.

use turnd_proto::{Delivery, InputRequest, OnDeadline, OnTimeout, Turn, Wait, WaitState};
use turnd_store::{Held, InputWait, InvWait, InvocationRecord, Phase, RawJson, TurnRecord};

use crate::machine::held_until;
use crate::registry::Supply;
use crate::session::SessionState;

/// How a wait's reason writes a time, or None for a wait without its reason: the
/// wait index keeps only a wait's state and times, and writing the text of every
/// lock holder's wait at every transition was most of what indexing it cost.
type Said<'a> = Option<&'a dyn Fn(u64) -> String>;

/// The reason `text` writes with `said`'s times, or an empty one without.
fn say(said: Said<'_>, text: impl FnOnce(&dyn Fn(u64) -> String) -> String) -> String {
    said.map(text).unwrap_or_default()
}

/// The protocol view of a stored turn, its input and output as the JSON text stored
/// (sent as it is, never parsed into a tree and written again).
pub fn to_turn(t: &TurnRecord, wait: Option<Wait>) -> Turn<RawJson> {
    Turn {
        turn_id: t.turn_id.clone(),
        session_id: t.session_id.clone(),
        seq: t.seq,
        function_id: t.function_id.clone(),
        status: t.status,
        step: t.step,
        attempt: t.attempt,
        input: RawJson::clone(&t.input),
        output: t.output.clone(),
        error: t.error.as_deref().cloned(),
        stop: t.stop.as_deref().cloned(),
        superseded: t.superseded,
        recovered: t.recovered,
        created_at_ms: t.created_at_ms,
        updated_at_ms: t.updated_at_ms,
        finished_at_ms: t.finished_at_ms,
        input_request: t
            .input_request
            .as_deref()
            .filter(|_| t.phase == Phase::AwaitingInput)
            .map(|w| InputRequest {
                prompt: w.prompt.as_ref().map(RawJson::to_value),
                since_ms: w.since_ms,
                deadline_ms: w.deadline_ms,
                on_timeout: w.on_timeout,
            }),
        progress: None,
        wait: if t.status.is_terminal() { None } else { wait },
    }
}

/// A prompt as a line of text: a string as it is, any other value as its JSON.
pub fn prompt_text(prompt: Option<&RawJson>) -> String {
    match prompt.map(RawJson::to_value) {
        None => "no prompt".into(),
        Some(serde_json::Value::String(s)) => s,
        Some(v) => v.to_string(),
    }
}

/// The wait of a lock holder whose last step suspended it for input.
fn input_wait(t: &TurnRecord, w: &InputWait, said: Said<'_>) -> Wait {
    let mut wait = base_wait(
        WaitState::AwaitingInput,
        say(said, |fmt_ms| {
            format!(
                "awaiting input after step {} (since {}): {}",
                t.step,
                fmt_ms(w.since_ms),
                prompt_text(w.prompt.as_ref())
            )
        }),
        w.since_ms,
    );
    if let Some(d) = w.deadline_ms {
        wait.deadline_ms = Some(d);
        wait.on_deadline = Some(match w.on_timeout {
            OnTimeout::Fail => OnDeadline::Fail,
            OnTimeout::Continue => OnDeadline::Continue,
        });
    }
    wait
}

fn base_wait(state: WaitState, reason: String, since_ms: u64) -> Wait {
    Wait {
        state,
        reason,
        since_ms,
        deadline_ms: None,
        on_deadline: None,
        invocation_id: None,
        worker_id: None,
        ahead: None,
        last_error: None,
    }
}

/// What happens to an invocation whose outcome becomes unknown.
fn on_unknown(inv: &InvocationRecord) -> OnDeadline {
    if inv.settings.delivery == Delivery::AtLeastOnce && inv.attempt < inv.settings.max_attempts {
        OnDeadline::Redispatch
    } else {
        OnDeadline::Fail
    }
}

/// The wait of a lock holder that has no worker slot, with why (from `supply`).
fn awaiting_worker(
    t: &TurnRecord,
    dispatch_timeout_ms: Option<u64>,
    said: Said<'_>,
    supply: Option<Supply>,
) -> Wait {
    let f = &t.function_id;
    let mut w = base_wait(
        WaitState::AwaitingWorker,
        say(said, |fmt_ms| {
            let why = match supply {
                Some(Supply {
                    registered: false, ..
                }) => format!("no worker has registered {f}"),
                Some(Supply { connected: 0, .. }) => format!(
                    "no connected worker serves {f} (the workers that registered it are gone)"
                ),
                Some(Supply { connected, .. }) => {
                    format!("all {connected} connected worker(s) serving {f} are busy")
                }
                None => format!("no connected worker serving {f} has free capacity"),
            };
            format!("{why} (waiting since {})", fmt_ms(t.phase_since_ms))
        }),
        t.phase_since_ms,
    );
    let by = t.dispatch.as_deref().and_then(|d| d.dispatch_by_ms);
    let timeout = dispatch_timeout_ms.map(|d| t.phase_since_ms + d);
    if let Some(d) = [by, timeout].into_iter().flatten().min() {
        w.deadline_ms = Some(d);
        w.on_deadline = Some(OnDeadline::Fail);
    }
    w
}

/// The wait of a lock holder the session's hold keeps back: an earlier turn's
/// invocation, given up on a worker that cannot cancel it, may still be running.
fn held_wait(t: &TurnRecord, held: &Held, said: Said<'_>) -> Wait {
    let mut w = base_wait(
        WaitState::Held,
        say(said, |fmt_ms| {
            format!(
                "invocation {} of turn {} was given up on worker {}, which cannot cancel it, \
                 and may still be running; held until its result or its deadline at {}",
                held.invocation_id,
                held.turn_id,
                held.worker_id,
                fmt_ms(held.until_ms)
            )
        }),
        held.since_ms.max(t.phase_since_ms),
    );
    w.deadline_ms = Some(held.until_ms);
    w.on_deadline = Some(OnDeadline::Dispatch);
    if said.is_some() {
        w.invocation_id = Some(held.invocation_id.clone());
        w.worker_id = Some(held.worker_id.clone());
    }
    w
}

/// Why a non-terminal turn is not moving, and what happens next.
///
/// `supply` says who could run the holder's function (None: not needed, the reason
/// is not shown).
pub fn wait_of(
    st: &SessionState,
    t: &TurnRecord,
    dispatch_timeout_ms: Option<u64>,
    fmt_ms: &dyn Fn(u64) -> String,
    supply: Option<Supply>,
) -> Wait {
    wait_said(st, t, dispatch_timeout_ms, Some(fmt_ms), supply)
}

/// [`wait_of`] without its words: the reason left empty and the invocation and
/// worker it names left out; the state, times and deadline only, for the wait
/// index.
pub(crate) fn wait_shape(
    st: &SessionState,
    t: &TurnRecord,
    dispatch_timeout_ms: Option<u64>,
) -> Wait {
    wait_said(st, t, dispatch_timeout_ms, None, None)
}

fn wait_said(
    st: &SessionState,
    t: &TurnRecord,
    dispatch_timeout_ms: Option<u64>,
    said: Said<'_>,
    supply: Option<Supply>,
) -> Wait {
    let holder = st.holder();
    if holder.map(|h| h.seq) != Some(t.seq) {
        let ahead = st.active.count_before(t.seq) as u64;
        let h = holder.map(|h| h.turn_id.as_str()).unwrap_or_default();
        let mut w = base_wait(
            WaitState::QueuedBehind,
            say(said, |_| {
                format!(
                    "queued behind turn {h} ({ahead} ahead in session {})",
                    st.id
                )
            }),
            t.created_at_ms,
        );
        w.ahead = Some(ahead);
        return w;
    }
    if let Some(p) = &st.pending {
        let mut w = base_wait(
            WaitState::Finalizing,
            say(said, |fmt_ms| {
                format!(
                    "a state change could not be written; retrying since {}: {}",
                    fmt_ms(p.since_ms),
                    p.error
                )
            }),
            p.since_ms,
        );
        w.deadline_ms = Some(p.retry_at_ms);
        w.on_deadline = Some(OnDeadline::Retry);
        w.last_error = Some(p.error.clone());
        return with_turn_deadline(w, t, said.is_some());
    }
    let held = st
        .meta
        .held
        .as_deref()
        .filter(|_| held_until(&st.meta, t).is_some());
    let w = match (held, t.phase) {
        (Some(held), _) => held_wait(t, held, said),
        (None, Phase::Queued | Phase::AwaitingWorker | Phase::Done) => {
            awaiting_worker(t, dispatch_timeout_ms, said, supply)
        }
        (None, Phase::BackingOff) => backoff_wait(t, said),
        (None, Phase::AwaitingInput) => match t.input_request.as_deref() {
            Some(w) => input_wait(t, w, said),
            None => base_wait(
                WaitState::AwaitingInput,
                say(said, |_| "awaiting input (its request is missing)".into()),
                t.phase_since_ms,
            ),
        },
        (None, Phase::Invoked) => match &st.inv {
            Some(inv) => inv_wait(t, inv, said),
            None => base_wait(
                WaitState::AwaitingWorker,
                say(said, |_| {
                    "invocation record missing; waiting to dispatch again".into()
                }),
                t.phase_since_ms,
            ),
        },
    };
    with_turn_deadline(w, t, said.is_some())
}

/// The wait of a lock holder whose step failed and is retried after a backoff.
fn backoff_wait(t: &TurnRecord, said: Said<'_>) -> Wait {
    let mut w = base_wait(
        WaitState::BackingOff,
        say(said, |fmt_ms| {
            format!(
                "attempt {} of step {} failed ({}); retrying at {}",
                t.attempt,
                t.step,
                t.last_error.as_deref().unwrap_or("retryable failure"),
                fmt_ms(t.retry_at_ms.unwrap_or(0))
            )
        }),
        t.phase_since_ms,
    );
    w.deadline_ms = t.retry_at_ms;
    w.on_deadline = Some(OnDeadline::Retry);
    w.last_error = t.last_error.clone();
    w
}

fn with_turn_deadline(mut w: Wait, t: &TurnRecord, said: bool) -> Wait {
    if let Some(d) = t.deadline_ms {
        if w.deadline_ms.map(|x| d < x).unwrap_or(true) {
            w.deadline_ms = Some(d);
            w.on_deadline = Some(OnDeadline::Fail);
            if said {
                w.reason.push_str(" (the turn's own deadline comes first)");
            }
        }
    }
    w
}

fn inv_wait(t: &TurnRecord, inv: &InvocationRecord, said: Said<'_>) -> Wait {
    let (state, on) = match inv.wait {
        InvWait::AwaitingResult => (WaitState::AwaitingResult, OnDeadline::Probe),
        InvWait::Probing | InvWait::AwaitingResend => (WaitState::AwaitingResult, on_unknown(inv)),
        InvWait::Cancelling => (
            WaitState::Cancelling,
            if t.stop.is_some() {
                OnDeadline::Cancel
            } else if inv.settings.delivery == Delivery::AtLeastOnce
                && inv.attempt < inv.settings.max_attempts
            {
                OnDeadline::Retry
            } else {
                OnDeadline::Fail
            },
        ),
        InvWait::AwaitingReconnect => (WaitState::AwaitingReconnect, on_unknown(inv)),
    };
    let mut w = base_wait(
        state,
        say(said, |fmt_ms| inv_reason(t, inv, fmt_ms)),
        inv.wait_since_ms,
    );
    w.deadline_ms = Some(inv.deadline_ms);
    w.on_deadline = Some(on);
    if said.is_some() {
        w.invocation_id = Some(inv.invocation_id.clone());
        w.worker_id = Some(inv.worker_id.clone());
    }
    w
}

/// Why a turn waits for its invocation, in words.
fn inv_reason(t: &TurnRecord, inv: &InvocationRecord, fmt_ms: &dyn Fn(u64) -> String) -> String {
    let id = &inv.invocation_id;
    let worker = &inv.worker_id;
    let since = fmt_ms(inv.wait_since_ms);
    match inv.wait {
        InvWait::AwaitingResult => format!(
            "awaiting result of {id} ({}) from worker {worker} since {since}",
            t.function_id
        ),
        InvWait::Probing => format!(
            "deadline of {id} passed; probe sent to worker {worker} at {since}, awaiting its status"
        ),
        InvWait::AwaitingResend => {
            format!("worker {worker} reported {id} finished at {since}; awaiting the resent result")
        }
        InvWait::Cancelling if t.stop.is_some() => {
            format!("stop requested; cancel of {id} sent to worker {worker} at {since}")
        }
        InvWait::Cancelling => {
            format!("{id} ran past its deadline; cancel sent to worker {worker} at {since}")
        }
        InvWait::AwaitingReconnect => format!(
            "worker {worker} running {id} is disconnected since {since}; awaiting its reconnect"
        ),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};
    use turnd_proto::frame::to_json_text;
    use turnd_proto::{Invoke, PreviousTurn, Push, TurnOk, TurnStatus};
    use turnd_store::{RawJson, TurnRecord};

    use super::to_turn;
    use crate::registry::{invoke_frame, push_frame};

    /// Payloads of many shapes: nesting, floats, escapes, non-ASCII text, integers at
    /// the ends of their range.
    fn payloads() -> Vec<Value> {
        vec![
            json!(null),
            json!({
                "messages": [{"role": "user", "content": "h\u{e9}llo \"quoted\" \\ \n\t\u{1} \u{1F600}"}],
                "t": 0.1, "big": u64::MAX, "neg": i64::MIN, "e": 1e300, "small": 5e-324, "z": {}, "a": [],
            }),
            json!([1, 2.5, "x", true, false, null, -0.0]),
            json!("a string"),
        ]
    }

    /// A turn is sent with its input and output as the store holds their text: the
    /// frame is the one the same turn with parsed values makes, byte for byte.
    #[test]
    fn turns_sent_from_stored_text_are_the_frames_parsed_values_make() {
        for (i, input) in payloads().into_iter().enumerate() {
            let mut t =
                TurnRecord::admitted(format!("t{i}"), "s", 1, "f", RawJson::from_value(&input), 5);
            t.status = TurnStatus::Completed;
            t.output = Some(RawJson::from_value(&json!({"echo": input})));
            let raw = to_turn(&t, None);
            let parsed = raw.clone().map_json(|j| j.to_value());
            assert_eq!(parsed.input, input);
            assert_eq!(parsed.output, Some(json!({"echo": input})));
            let sent = to_json_text(&TurnOk { turn: raw }, 64).expect("stored text");
            let made = to_json_text(&TurnOk { turn: parsed }, 64).expect("parsed values");
            assert_eq!(sent, made);
        }
    }

    /// An invoke push of `input`, from a turn that interrupted one with `state`.
    fn invoke<J>(input: J, state: J) -> Invoke<J> {
        Invoke {
            invocation_id: "i1".into(),
            function_id: "f".into(),
            session_id: "s".into(),
            turn_id: "t1".into(),
            step: 0,
            attempt: 2,
            input,
            deadline_ms: 9,
            previous: Some(PreviousTurn {
                turn_id: "t0".into(),
                status: TurnStatus::Cancelled,
                state,
            }),
        }
    }

    /// The same for an invoke push, its interrupted turn's state included.
    #[test]
    fn invokes_sent_from_stored_text_are_the_frames_parsed_values_make() {
        for input in payloads() {
            let state = json!({"state": input});
            let sent = invoke_frame(invoke(
                RawJson::from_value(&input),
                RawJson::from_value(&state),
            ));
            let made = push_frame(&Push::Invoke(invoke(input.clone(), state.clone())));
            assert_eq!(sent, made);
        }
    }
}
