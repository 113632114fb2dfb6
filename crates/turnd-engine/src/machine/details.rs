//! The details of the events every turn has (`admitted`, `dispatched` or
//! `redispatched`, `result`, `completed`), written straight to the JSON text the
//! store keeps and a watch is pushed, without a [`serde_json::Value`] tree built
//! and dropped for each.
//!
//! Each struct declares its members in the order serde_json writes a parsed
//! object's (sorted by name), so the text is the one the same detail as a `Value`
//! writes, byte for byte (the tests below compare them). Rarer events build their
//! detail as a `Value` ([`Tx::event_value`](super::Tx::event_value)).

use serde::Serialize;
use turnd_proto::OnBusy;
use turnd_store::{InvocationRecord, RawJson};

#[derive(Serialize)]
struct Admitted<'a> {
    function_id: &'a str,
    idempotency_key: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    interrupted: Option<&'a [String]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    on_busy: Option<OnBusy>,
    seq: u64,
}

/// `admitted`: with the turns it interrupted when `on_busy` interrupts.
pub(super) fn admitted(
    function_id: &str,
    seq: u64,
    idempotency_key: Option<&str>,
    interrupting: Option<(OnBusy, &[String])>,
) -> RawJson {
    RawJson::of(&Admitted {
        function_id,
        idempotency_key,
        interrupted: interrupting.map(|(_, ids)| ids),
        on_busy: interrupting.map(|(on_busy, _)| on_busy),
        seq,
    })
}

#[derive(Serialize)]
struct Dispatched<'a> {
    attempt: u32,
    deadline_ms: u64,
    invocation_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    previous_invocation_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'a str>,
    step: u32,
    worker_id: &'a str,
}

/// `dispatched`, or `redispatched` with the invocation it replaces and why.
pub(super) fn dispatched(
    inv: &InvocationRecord,
    previous: Option<&str>,
    reason: Option<&str>,
) -> RawJson {
    RawJson::of(&Dispatched {
        attempt: inv.attempt,
        deadline_ms: inv.deadline_ms,
        invocation_id: &inv.invocation_id,
        previous_invocation_id: previous,
        reason,
        step: inv.step,
        worker_id: &inv.worker_id,
    })
}

#[derive(Serialize)]
struct Result<'a> {
    attempt: u32,
    invocation_id: &'a str,
    outcome: &'a str,
    step: u32,
}

/// `result`: the live invocation's answer, by its kind.
pub(super) fn result(inv: &InvocationRecord, outcome: &str) -> RawJson {
    RawJson::of(&Result {
        attempt: inv.attempt,
        invocation_id: &inv.invocation_id,
        outcome,
        step: inv.step,
    })
}

#[derive(Serialize)]
struct Completed {
    step: u32,
}

/// `completed`, at the turn's last step.
pub(super) fn completed(step: u32) -> RawJson {
    RawJson::of(&Completed { step })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use turnd_store::{FunctionSettings, InvState, InvWait};

    fn text(v: serde_json::Value) -> String {
        RawJson::from_value(&v).as_str().to_string()
    }

    fn invocation() -> InvocationRecord {
        InvocationRecord {
            invocation_id: "inv_\"quoted\"_é".into(),
            turn_id: "t".into(),
            session_id: "s".into(),
            function_id: "f".into(),
            step: 3,
            attempt: 2,
            worker_id: "w\\1".into(),
            instance_id: "i".into(),
            settings: FunctionSettings {
                timeout_ms: 1000,
                delivery: turnd_proto::Delivery::AtLeastOnce,
                max_attempts: 3,
            },
            state: InvState::Active,
            wait: InvWait::AwaitingResult,
            wait_since_ms: 1,
            deadline_ms: u64::MAX,
            attempt_deadline_ms: 2,
            dispatched_at_ms: 1,
            ended_at_ms: None,
            outcome: None,
            late: false,
        }
    }

    #[test]
    fn typed_details_write_the_text_a_value_writes() {
        let inv = invocation();
        let mut detail = json!({
            "invocation_id": inv.invocation_id,
            "worker_id": inv.worker_id,
            "step": inv.step,
            "attempt": inv.attempt,
            "deadline_ms": inv.deadline_ms,
        });
        assert_eq!(dispatched(&inv, None, None).as_str(), text(detail.clone()));
        detail["previous_invocation_id"] = json!("inv_old");
        detail["reason"] = json!("worker \"gone\"");
        assert_eq!(
            dispatched(&inv, Some("inv_old"), Some("worker \"gone\"")).as_str(),
            text(detail)
        );
        assert_eq!(
            result(&inv, "complete").as_str(),
            text(
                json!({"invocation_id": inv.invocation_id, "outcome": "complete", "step": inv.step, "attempt": inv.attempt})
            )
        );
        assert_eq!(completed(7).as_str(), text(json!({"step": 7})));
        assert_eq!(
            admitted("fn.\u{1F600}", 9, None, None).as_str(),
            text(json!({"function_id": "fn.\u{1F600}", "seq": 9, "idempotency_key": null}))
        );
        let ids = vec!["t1".to_string(), "t2".to_string()];
        assert_eq!(
            admitted("f", 10, Some("key\n1"), Some((OnBusy::Rollback, &ids))).as_str(),
            text(json!({
                "function_id": "f",
                "seq": 10,
                "idempotency_key": "key\n1",
                "on_busy": OnBusy::Rollback,
                "interrupted": ids,
            }))
        );
    }
}
