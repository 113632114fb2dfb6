//! The iii worker protocol as iii-sdk (npm 0.22.1, PyPI 0.25.0) speaks it: JSON text
//! frames tagged by a lower-case `type`. Only the messages turnd acts on are typed;
//! every other type is read as [`Inbound::Other`] and ignored, as both SDKs do.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use turnd_engine::EngineError;
use turnd_proto::ErrorBody;

/// A frame an iii connection sends to turnd.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Inbound {
    /// `{previous_worker_id, reattach_token?}`: sent first on every reconnect.
    Reattach {
        previous_worker_id: String,
        #[serde(default)]
        reattach_token: Option<String>,
    },
    RegisterFunction(RegisterFunction),
    UnregisterFunction {
        id: String,
    },
    InvokeFunction(InvokeFunction),
    InvocationResult(InvocationResult),
    RegisterTrigger(RegisterTrigger),
    /// Any other type (trigger types, the observe family, pings, …).
    #[serde(other)]
    Other,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RegisterFunction {
    pub id: String,
    /// Set for functions the engine would reach over HTTP; turnd runs none.
    #[serde(default)]
    pub invocation: Option<Value>,
}

/// `invokefunction`, both ways. From a caller it is a `trigger`; to a worker it is a
/// dispatched invocation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InvokeFunction {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub invocation_id: Option<String>,
    pub function_id: String,
    #[serde(default)]
    pub data: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<Action>,
}

/// How a caller wants a trigger run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Action {
    Enqueue { queue: String },
    Void,
}

/// An error as iii carries it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IiiError {
    #[serde(default)]
    pub code: String,
    #[serde(default)]
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stacktrace: Option<String>,
}

impl IiiError {
    pub fn new(code: &str, message: impl Into<String>) -> IiiError {
        IiiError {
            code: code.to_string(),
            message: message.into(),
            stacktrace: None,
        }
    }
}

/// A protocol error as iii carries it: the same code and message, so that a refused
/// trigger reads as the same refusal over either endpoint.
impl From<ErrorBody> for IiiError {
    fn from(e: ErrorBody) -> IiiError {
        IiiError::new(e.code.as_str(), e.message)
    }
}

/// An engine error with the code [`EngineError::code`] gives it.
impl From<EngineError> for IiiError {
    fn from(e: EngineError) -> IiiError {
        IiiError::from(ErrorBody::from(e))
    }
}

/// `invocationresult`, both ways: `result` (absent for a handler that returned
/// nothing) or `error`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InvocationResult {
    pub invocation_id: String,
    #[serde(default)]
    pub function_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<IiiError>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RegisterTrigger {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub trigger_type: String,
    #[serde(default)]
    pub function_id: String,
}

/// A frame turnd sends to an iii connection.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Outbound {
    WorkerRegistered {
        worker_id: String,
        reattach_token: String,
    },
    InvokeFunction(InvokeFunction),
    InvocationResult(InvocationResult),
    TriggerRegistrationResult {
        id: String,
        trigger_type: String,
        function_id: String,
        error: IiiError,
    },
}

impl Outbound {
    pub fn encode(&self) -> String {
        // Plain structs of strings and JSON values: serializing cannot fail.
        serde_json::to_string(self).unwrap_or_else(|e| {
            tracing::error!("encode an iii frame: {e}");
            String::from("{}")
        })
    }
}

/// Decode one text frame. Anything that is not a JSON object with a string `type` is
/// an error; a known type with bad fields is an error too.
pub fn decode(text: &str) -> Result<Inbound, String> {
    serde_json::from_str(text).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn frames_of_both_sdks_decode() {
        // Python may put `type` last.
        let f = decode(r#"{"id":"a::b","description":"x","type":"registerfunction"}"#);
        assert!(
            matches!(f, Ok(Inbound::RegisterFunction(RegisterFunction { ref id, .. })) if id == "a::b")
        );
        let f = decode(
            r#"{"type":"invokefunction","function_id":"f","data":{"k":1},"action":{"type":"enqueue","queue":"q"},"invocation_id":"i1","traceparent":"00-x"}"#,
        );
        match f {
            Ok(Inbound::InvokeFunction(i)) => {
                assert_eq!(i.invocation_id.as_deref(), Some("i1"));
                assert_eq!(i.action, Some(Action::Enqueue { queue: "q".into() }));
                assert_eq!(i.data, json!({"k": 1}));
            }
            other => panic!("{other:?}"),
        }
        let f = decode(
            r#"{"type":"invokefunction","function_id":"f","data":null,"action":{"type":"void"}}"#,
        );
        assert!(matches!(
            f,
            Ok(Inbound::InvokeFunction(InvokeFunction {
                action: Some(Action::Void),
                invocation_id: None,
                ..
            }))
        ));
        let f = decode(
            r#"{"type":"invocationresult","invocation_id":"i","function_id":"f","error":{"code":"invocation_failed","message":"boom","stacktrace":"at"}}"#,
        );
        match f {
            Ok(Inbound::InvocationResult(r)) => {
                assert_eq!(r.error.map(|e| e.code), Some("invocation_failed".into()));
                assert_eq!(r.result, None);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            decode(r#"{"type":"registertriggertype","id":"t","description":"d"}"#),
            Ok(Inbound::Other)
        );
        assert_eq!(decode(r#"{"type":"observe","x":1}"#), Ok(Inbound::Other));
        assert!(decode(r#"{"no":"type"}"#).is_err());
        assert!(decode(r#"{"type":"reattach"}"#).is_err());
    }

    #[test]
    fn outbound_frames_carry_their_type() {
        let f = Outbound::WorkerRegistered {
            worker_id: "w".into(),
            reattach_token: "t".into(),
        }
        .encode();
        let v: Value = serde_json::from_str(&f).expect("json");
        assert_eq!(v["type"], "workerregistered");
        let f = Outbound::InvocationResult(InvocationResult {
            invocation_id: "i".into(),
            function_id: "f".into(),
            result: None,
            error: Some(IiiError::new("cancelled", "stopped")),
        })
        .encode();
        let v: Value = serde_json::from_str(&f).expect("json");
        assert_eq!(v["type"], "invocationresult");
        assert_eq!(v["error"]["code"], "cancelled");
        assert!(v.get("result").is_none());
    }
}
