//! What a rule is: the direction and frames it applies to ([`Dir`], [`Match`]), what
//! it does to them ([`Action`]), how often, and what became of a frame ([`Fate`]).

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

/// Which way a frame travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dir {
    /// From the connecting peer (the worker) to the daemon: requests.
    ToServer,
    /// From the daemon to the connecting peer: responses and pushes.
    ToClient,
}

/// A predicate on a frame's JSON, e.g. "a request with `op == invocation.result`".
#[derive(Clone)]
pub struct Match {
    label: Arc<str>,
    pred: Arc<dyn Fn(&Value) -> bool + Send + Sync>,
}

impl std::fmt::Debug for Match {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Match({})", self.label)
    }
}

impl Match {
    /// A matcher from any predicate; `label` shows in debug output.
    pub fn custom(
        label: impl Into<String>,
        pred: impl Fn(&Value) -> bool + Send + Sync + 'static,
    ) -> Match {
        Match {
            label: Arc::from(label.into()),
            pred: Arc::new(pred),
        }
    }

    /// Every JSON frame.
    pub fn any() -> Match {
        Match::custom("any", |_| true)
    }

    /// Requests with this `op`, e.g. `invocation.result`.
    pub fn op(op: &str) -> Match {
        let want = op.to_string();
        Match::custom(format!("op == {op}"), move |v| {
            v.get("op").and_then(Value::as_str) == Some(want.as_str())
        })
    }

    /// Pushes of this kind: `invoke`, `probe`, `cancel` or `event`.
    pub fn push(kind: &str) -> Match {
        let want = kind.to_string();
        Match::custom(format!("push == {kind}"), move |v| {
            v.get("push").and_then(Value::as_str) == Some(want.as_str())
        })
    }

    /// Responses (frames with `ok` or `error`, no `op` and no `push`).
    pub fn response() -> Match {
        Match::custom("response", |v| {
            v.get("op").is_none()
                && v.get("push").is_none()
                && (v.get("ok").is_some() || v.get("error").is_some())
        })
    }

    /// Frames where the JSON pointer `pointer` (e.g. `/args/invocation_id`) equals
    /// `value`.
    pub fn field(pointer: &str, value: Value) -> Match {
        let p = pointer.to_string();
        Match::custom(format!("{pointer} == {value}"), move |v| {
            v.pointer(&p) == Some(&value)
        })
    }

    /// Frames about one invocation: requests naming it in `args.invocation_id` and
    /// pushes naming it in `invocation_id`.
    pub fn invocation(invocation_id: &str) -> Match {
        let want = invocation_id.to_string();
        Match::custom(format!("invocation {invocation_id}"), move |v| {
            let named = v
                .pointer("/args/invocation_id")
                .or_else(|| v.get("invocation_id"))
                .and_then(Value::as_str);
            named == Some(want.as_str())
        })
    }

    /// Both this and `other`.
    pub fn and(self, other: Match) -> Match {
        let label = format!("({} and {})", self.label, other.label);
        Match::custom(label, move |v| self.matches(v) && other.matches(v))
    }

    /// This or `other`.
    pub fn or(self, other: Match) -> Match {
        let label = format!("({} or {})", self.label, other.label);
        Match::custom(label, move |v| self.matches(v) || other.matches(v))
    }

    /// Whether the frame matches.
    pub fn matches(&self, v: &Value) -> bool {
        (self.pred)(v)
    }
}

/// What a rule does to a frame it applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// The frame is never delivered.
    Drop,
    /// The frame is delivered after this delay, and the frames behind it in the same
    /// direction wait for it: order is preserved, as on a real (TCP) connection.
    Delay(Duration),
    /// The frame is delivered twice, back to back.
    Duplicate,
}

/// A fault to inject: frames going `dir` that match `matcher` get `action`, for the
/// next `times` such frames (or all of them), each with probability `chance`.
#[derive(Debug, Clone)]
pub struct Rule {
    pub(super) dir: Dir,
    pub(super) matcher: Match,
    pub(super) action: Action,
    pub(super) times: Option<u64>,
    pub(super) chance: Option<f64>,
}

impl Rule {
    /// A rule applying `action` to every frame going `dir` that matches.
    pub fn new(dir: Dir, matcher: Match, action: Action) -> Rule {
        Rule {
            dir,
            matcher,
            action,
            times: None,
            chance: None,
        }
    }

    /// Drop matching frames.
    pub fn drop(dir: Dir, matcher: Match) -> Rule {
        Rule::new(dir, matcher, Action::Drop)
    }

    /// Delay matching frames by `by`.
    pub fn delay(dir: Dir, matcher: Match, by: Duration) -> Rule {
        Rule::new(dir, matcher, Action::Delay(by))
    }

    /// Deliver matching frames twice.
    pub fn duplicate(dir: Dir, matcher: Match) -> Rule {
        Rule::new(dir, matcher, Action::Duplicate)
    }

    /// Apply to the next `n` frames it hits only; then the rule is spent.
    pub fn times(mut self, n: u64) -> Rule {
        self.times = Some(n);
        self
    }

    /// Apply to each matching frame with probability `p` (drawn from the proxy's
    /// seeded generator, see [`ProxyHandle::seed`]); a frame it passes over is still
    /// offered to the rules after it.
    pub fn chance(mut self, p: f64) -> Rule {
        self.chance = Some(p.clamp(0.0, 1.0));
        self
    }
}

/// Identifies a rule added to a proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RuleId(pub(super) u64);

/// What happened to a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Delivered unchanged.
    Forwarded,
    /// Never delivered.
    Dropped,
    /// Delivered after the delay (unless the connection ended first).
    Delayed(Duration),
    /// Delivered twice.
    Duplicated,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn matchers() {
        let result =
            json!({"id": 3, "op": "invocation.result", "args": {"invocation_id": "inv_1"}});
        let invoke = json!({"push": "invoke", "invocation_id": "inv_1"});
        let ack = json!({"id": 3, "ok": {"accepted": "applied"}});
        assert!(Match::op("invocation.result").matches(&result));
        assert!(!Match::op("invocation.result").matches(&invoke));
        assert!(Match::push("invoke").matches(&invoke));
        assert!(Match::invocation("inv_1").matches(&result));
        assert!(Match::invocation("inv_1").matches(&invoke));
        assert!(!Match::invocation("inv_2").matches(&invoke));
        assert!(Match::response().matches(&ack));
        assert!(!Match::response().matches(&result));
        assert!(Match::field("/ok/accepted", json!("applied")).matches(&ack));
        assert!(Match::push("probe")
            .or(Match::push("invoke"))
            .matches(&invoke));
        assert!(!Match::push("probe")
            .and(Match::push("invoke"))
            .matches(&invoke));
    }
}
