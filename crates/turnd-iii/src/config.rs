//! The `[iii]` section of turnd's configuration: the endpoint's address and frame
//! limit, how long a call may wait for a worker, and the dispatch settings of the
//! functions iii workers register (iii sends none).

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};
use turnd_proto::{Delivery, RegisterArgs};

/// `[iii]`: the iii endpoint (off unless `listen` is set) and the dispatch settings
/// of the functions iii workers register (iii sends none).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct IiiConfig {
    /// Listen address of the iii endpoint, e.g. `127.0.0.1:49134`. Unset: no endpoint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    /// Largest frame accepted on the iii endpoint, in bytes.
    pub max_frame_bytes: u64,
    /// A sync or void call still waiting for a worker this long fails (it is never
    /// dispatched later).
    pub call_dispatch_timeout_ms: u64,
    /// How long a call of a function no connected worker serves waits for a worker
    /// that served it and left less than `turns.reconnect_grace_ms` ago (it may be
    /// reattaching; at most `call_dispatch_timeout_ms`); any other such call is
    /// answered `function_not_found` at once.
    pub call_grace_ms: u64,
    /// Defaults for every function an iii worker registers.
    pub concurrency: u32,
    /// Attempt deadline; unset: [`DEFAULT_TIMEOUT_MS`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    pub delivery: Delivery,
    /// Unset: 1 for `at_most_once`, 3 for `at_least_once`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// Whether a handler's error may be retried (`at_least_once` with attempts left).
    pub retryable: bool,
    /// Settings by function id: the first rule whose `id` matches wins; an `id`
    /// ending in `*` matches every function id starting with what comes before it.
    pub functions: Vec<FunctionRule>,
}

/// Dispatch settings of the functions whose id matches `id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionRule {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery: Option<Delivery>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retryable: Option<bool>,
}

/// The attempt deadline of a function an iii worker registers, unless `[iii]` sets
/// one: 30 minutes, the longest iii itself lets a handler run by default (a queue
/// delivery's `timeout_ms`; a call has no deadline at all in iii). An iii worker
/// sends no heartbeat, so a shorter deadline would cut handlers iii lets finish.
pub const DEFAULT_TIMEOUT_MS: u64 = 30 * 60 * 1000;

impl Default for IiiConfig {
    fn default() -> Self {
        IiiConfig {
            listen: None,
            max_frame_bytes: 16 * 1024 * 1024,
            // iii-sdk's default call timeout: a caller with the SDK's defaults has
            // given up by then.
            call_dispatch_timeout_ms: 30_000,
            // About two of the SDK's first reconnect attempts (1 s ± 30 %).
            call_grace_ms: 2_000,
            concurrency: 10,
            timeout_ms: None,
            delivery: Delivery::AtMostOnce,
            max_attempts: None,
            retryable: false,
            functions: Vec::new(),
        }
    }
}

/// What a function registered by an iii worker is registered with.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub register: RegisterArgs,
    pub retryable: bool,
}

impl FunctionRule {
    fn matches(&self, function_id: &str) -> bool {
        match self.id.strip_suffix('*') {
            Some(prefix) => function_id.starts_with(prefix),
            None => self.id == function_id,
        }
    }
}

impl IiiConfig {
    /// The settings `function_id` is registered with.
    pub fn settings(&self, function_id: &str) -> Settings {
        let rule = self.functions.iter().find(|r| r.matches(function_id));
        let pick = |f: fn(&FunctionRule) -> Option<u64>| rule.and_then(f);
        Settings {
            register: RegisterArgs {
                function_id: function_id.to_string(),
                concurrency: Some(rule.and_then(|r| r.concurrency).unwrap_or(self.concurrency)),
                timeout_ms: Some(
                    pick(|r| r.timeout_ms)
                        .or(self.timeout_ms)
                        .unwrap_or(DEFAULT_TIMEOUT_MS),
                ),
                delivery: Some(rule.and_then(|r| r.delivery).unwrap_or(self.delivery)),
                max_attempts: rule.and_then(|r| r.max_attempts).or(self.max_attempts),
            },
            retryable: rule.and_then(|r| r.retryable).unwrap_or(self.retryable),
        }
    }

    /// Every problem with the section, prefixed `iii.`.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if let Some(l) = &self.listen {
            if let Err(e) = l.parse::<SocketAddr>() {
                p.push(format!("iii.listen {l:?}: {e}"));
            }
        }
        if self.max_frame_bytes < 1024 {
            p.push("iii.max_frame_bytes must be at least 1024".into());
        }
        if self.call_dispatch_timeout_ms == 0 {
            p.push("iii.call_dispatch_timeout_ms must be positive".into());
        }
        let check =
            |p: &mut Vec<String>, at: &str, c: Option<u32>, t: Option<u64>, a: Option<u32>| {
                if matches!(c, Some(c) if c == 0 || c > 10_000) {
                    p.push(format!("{at}concurrency must be 1 to 10000"));
                }
                if t == Some(0) {
                    p.push(format!("{at}timeout_ms must be positive"));
                }
                if matches!(a, Some(a) if a == 0 || a > 1000) {
                    p.push(format!("{at}max_attempts must be 1 to 1000"));
                }
            };
        check(
            &mut p,
            "iii.",
            Some(self.concurrency),
            self.timeout_ms,
            self.max_attempts,
        );
        for (i, r) in self.functions.iter().enumerate() {
            if r.id.is_empty() {
                p.push(format!("iii.functions[{i}].id must not be empty"));
            }
            check(
                &mut p,
                &format!("iii.functions[{i}]."),
                r.concurrency,
                r.timeout_ms,
                r.max_attempts,
            );
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_matching_rule_wins_and_defaults_fill_the_rest() {
        let cfg = IiiConfig {
            timeout_ms: Some(9000),
            functions: vec![
                FunctionRule {
                    id: "orders::pay".into(),
                    concurrency: Some(1),
                    timeout_ms: None,
                    delivery: Some(Delivery::AtMostOnce),
                    max_attempts: None,
                    retryable: None,
                },
                FunctionRule {
                    id: "orders::*".into(),
                    concurrency: Some(4),
                    timeout_ms: Some(2000),
                    delivery: Some(Delivery::AtLeastOnce),
                    max_attempts: Some(5),
                    retryable: Some(true),
                },
            ],
            ..IiiConfig::default()
        };
        let pay = cfg.settings("orders::pay");
        assert_eq!(pay.register.concurrency, Some(1));
        assert_eq!(pay.register.timeout_ms, Some(9000));
        assert_eq!(pay.register.delivery, Some(Delivery::AtMostOnce));
        assert!(!pay.retryable);
        let ship = cfg.settings("orders::ship");
        assert_eq!(ship.register.concurrency, Some(4));
        assert_eq!(ship.register.timeout_ms, Some(2000));
        assert_eq!(ship.register.max_attempts, Some(5));
        assert!(ship.retryable);
        let other = cfg.settings("mail::send");
        assert_eq!(other.register.concurrency, Some(10));
        assert_eq!(
            IiiConfig::default().settings("x").register.timeout_ms,
            Some(DEFAULT_TIMEOUT_MS)
        );
        assert_eq!(other.register.max_attempts, None);
        assert!(cfg.problems().is_empty());
        let bad = IiiConfig {
            listen: Some("nope".into()),
            call_dispatch_timeout_ms: 0,
            concurrency: 0,
            functions: vec![FunctionRule {
                id: String::new(),
                concurrency: None,
                timeout_ms: Some(0),
                delivery: None,
                max_attempts: Some(0),
                retryable: None,
            }],
            ..IiiConfig::default()
        };
        assert_eq!(bad.problems().len(), 6, "{:?}", bad.problems());
    }
}
