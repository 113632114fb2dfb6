//! iii queues on turnd: `queue::define` keeps a definition in the daemon's records
//! (the store of a daemon on its own, a bucket every node of a cluster shares),
//! read again for each message that names the queue; an enqueued
//! message becomes a turn in a session derived from the queue (and, for a fifo
//! queue, its message group), so a group runs one message at a time and groups run
//! in parallel, with the queue's deadline and retries as the turn's own dispatch
//! settings; `engine::queue::topic_stats` answers from the engine's live state.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use turnd_engine::SubmitOptions;
use turnd_proto::{Delivery, SessionOrder, SessionsListArgs, PAGE_MAX};
use turnd_store::TurnDispatch;

use crate::wire::IiiError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum QueueType {
    #[default]
    Standard,
    Fifo,
}

/// A queue's `config` as iii's queue worker takes it. `type` and
/// `message_group_field` choose a message's session; `timeout_ms`, `max_retries`
/// and `backoff_ms` become its turn's dispatch settings ([`QueueDef::submit_options`]).
/// `queue::define` refuses the fields turnd has no counterpart for
/// ([`QueueConfig::refused`]); definitions stored before that are still read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct QueueConfig {
    #[serde(rename = "type", default)]
    pub kind: QueueType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_group_field: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_retries: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub poll_interval_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redeliver_on_engine_restart: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_priority: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_field: Option<String>,
}

/// A defined queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueueDef {
    pub queue: String,
    pub config: QueueConfig,
}

impl QueueConfig {
    /// The fields set that turnd does not honour, each with why; `queue::define`
    /// refuses a config with any.
    pub fn refused(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut no = |set: bool, why: &str| {
            if set {
                out.push(why.to_string());
            }
        };
        no(self.concurrency.is_some(), "`concurrency`: turnd runs a queue's messages up to their function's concurrency per worker connection ([iii] concurrency, [[iii.functions]])");
        no(self.poll_interval_ms.is_some(), "`poll_interval_ms`: turnd does not poll, it dispatches a message as soon as its group and a worker are free");
        no(self.redeliver_on_engine_restart.is_some(), "`redeliver_on_engine_restart`: turnd keeps every message across its restarts and reconciles the delivery in flight itself (a reattaching worker keeps it; otherwise its outcome is unknown and `max_retries` applies)");
        no(self.max_priority.is_some() || self.priority_field.is_some(), "`max_priority`/`priority_field`: turnd runs a group's messages in the order they were enqueued and has no priorities");
        if self.timeout_ms == Some(0) {
            out.push("`timeout_ms` must be positive".into());
        }
        if self.max_retries.is_some_and(|r| r > 999) {
            out.push("`max_retries` must be at most 999 (1000 attempts)".into());
        }
        if self.backoff_ms == Some(0) {
            out.push("`backoff_ms` must be positive".into());
        }
        out
    }
}

impl QueueDef {
    /// The dispatch settings of a message of this queue, in place of its function's:
    /// `timeout_ms` is each delivery's deadline; `max_retries` N > 0 is
    /// `at_least_once` with N + 1 attempts and every failure retried (as iii's queue
    /// does), 0 is `at_most_once`, one attempt; `backoff_ms` is the first retry's
    /// delay (doubled per retry, at most `turns.retry_backoff_max_ms`). A field left
    /// out takes the function's setting from `[iii]`.
    pub fn submit_options(&self) -> SubmitOptions {
        let c = &self.config;
        let dispatch = TurnDispatch {
            timeout_ms: c.timeout_ms,
            delivery: c.max_retries.map(|r| {
                if r == 0 {
                    Delivery::AtMostOnce
                } else {
                    Delivery::AtLeastOnce
                }
            }),
            max_attempts: c.max_retries.map(|r| r + 1),
            retryable: c.max_retries.map(|r| r > 0),
            dispatch_by_ms: None,
        };
        SubmitOptions {
            dispatch: (dispatch != TurnDispatch::default()).then_some(dispatch),
            retry_backoff_ms: c.backoff_ms,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DefineArgs {
    queue: String,
    #[serde(default)]
    config: QueueConfig,
}

/// The record key of queue `name`'s definition.
fn record_key(name: &str) -> String {
    format!("queue/{name}")
}

/// A queue name: 1 to 128 bytes of letters, digits, `_`, `-` and `.` (so the session
/// ids derived from it, `<queue>:<group>`, are never ambiguous).
fn check_name(q: &str) -> Result<(), IiiError> {
    let ok = !q.is_empty()
        && q.len() <= 128
        && q.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(IiiError::new(
            "invalid_queue",
            format!("queue name {q:?} must be 1 to 128 letters, digits, '_', '-' or '.'"),
        ))
    }
}

impl crate::Iii {
    /// `queue::define {queue, config}` → `{queue, changed}`, once durable.
    pub(crate) async fn define_queue(&self, data: Value) -> Result<Value, IiiError> {
        let args: DefineArgs = serde_json::from_value(data)
            .map_err(|e| IiiError::new("invalid_queue_config", format!("queue::define: {e}")))?;
        check_name(&args.queue)?;
        let refused = args.config.refused();
        if !refused.is_empty() {
            return Err(IiiError::new(
                "invalid_queue_config",
                format!(
                    "queue::define {:?}: not supported by turnd, remove: {}",
                    args.queue,
                    refused.join("; ")
                ),
            ));
        }
        if args.config.kind == QueueType::Fifo
            && args
                .config
                .message_group_field
                .as_deref()
                .is_none_or(str::is_empty)
        {
            return Err(IiiError::new(
                "invalid_queue_config",
                "a fifo queue needs `message_group_field`",
            ));
        }
        let def = QueueDef {
            queue: args.queue.clone(),
            config: args.config,
        };
        let changed = self.queue_def(&def.queue).await?.as_ref() != Some(&def);
        if changed {
            let bytes = serde_json::to_vec(&def)
                .map_err(|e| IiiError::new("internal", format!("encode queue: {e}")))?;
            self.daemon
                .put_record(&record_key(&def.queue), bytes)
                .await
                .map_err(|e| {
                    IiiError::new(
                        "unavailable",
                        format!("{e:#}; the queue was not defined, retry later"),
                    )
                })?;
        }
        Ok(json!({"queue": def.queue, "changed": changed}))
    }

    /// The session an enqueued message runs in: `<queue>:<group>` for a fifo queue,
    /// `<queue>:~<invocation>` (one session per message) for a standard one; and the
    /// queue's dispatch settings for it.
    pub(crate) async fn queue_session(
        &self,
        queue: &str,
        data: &Value,
        message_id: &str,
    ) -> Result<(String, SubmitOptions), IiiError> {
        let def = self.queue_def(queue).await?.ok_or_else(|| {
            IiiError::new(
                "enqueue_error",
                format!("queue {queue:?} is not defined: call queue::define before enqueueing"),
            )
        })?;
        let opts = def.submit_options();
        match def.config.kind {
            QueueType::Standard => Ok((format!("{queue}:~{message_id}"), opts)),
            QueueType::Fifo => {
                let field = def.config.message_group_field.unwrap_or_default();
                let group = match data.get(&field) {
                    Some(Value::String(s)) if !s.is_empty() => s.clone(),
                    Some(Value::Number(n)) => n.to_string(),
                    _ => {
                        return Err(IiiError::new(
                            "enqueue_error",
                            format!(
                                "fifo queue {queue:?} needs `{field}` in the payload as a non-empty string or a number"
                            ),
                        ))
                    }
                };
                Ok((format!("{queue}:{group}"), opts))
            }
        }
    }

    /// Queue `name`'s stored definition, read from the daemon's records.
    async fn queue_def(&self, name: &str) -> Result<Option<QueueDef>, IiiError> {
        let bytes = self.daemon.record(&record_key(name)).await.map_err(|e| {
            IiiError::new(
                "unavailable",
                format!("read queue {name:?}: {e:#}; retry later"),
            )
        })?;
        bytes
            .map(|b| {
                serde_json::from_slice(&b)
                    .map_err(|e| IiiError::new("internal", format!("stored queue {name:?}: {e}")))
            })
            .transpose()
    }

    /// `engine::queue::topic_stats {topic|queue}`: `depth` counts every unfinished
    /// message (queued and running) from the engine's live sessions.
    pub(crate) async fn topic_stats(&self, data: Value) -> Result<Value, IiiError> {
        let queue = ["queue", "topic"]
            .iter()
            .find_map(|k| data.get(k).and_then(Value::as_str))
            .ok_or_else(|| {
                IiiError::new("invalid_argument", "topic_stats needs `queue` or `topic`")
            })?
            .to_string();
        let config = self.queue_def(&queue).await?.map(|d| d.config);
        let prefix = format!("{queue}:");
        let (mut depth, mut running) = (0u64, 0u64);
        let mut functions: Vec<String> = Vec::new();
        let mut after = None;
        loop {
            let page = self
                .daemon
                .list_sessions(SessionsListArgs {
                    order: Some(SessionOrder::Id),
                    limit: Some(PAGE_MAX),
                    after: after.take(),
                    ..SessionsListArgs::default()
                })
                .await
                .map_err(IiiError::from)?;
            for row in &page.sessions {
                if row.session_id.starts_with(&prefix) {
                    depth += 1 + row.queued;
                    if row.wait.invocation_id.is_some() {
                        running += 1;
                    }
                    if !functions.contains(&row.function_id) {
                        functions.push(row.function_id.clone());
                    }
                }
            }
            match page.next {
                Some(n) => after = Some(n),
                None => break,
            }
        }
        let consumers = self
            .daemon
            .workers()
            .into_iter()
            .filter(|w| w.connected && w.functions.iter().any(|f| functions.contains(f)))
            .count();
        Ok(json!({
            "depth": depth,
            "in_flight": running,
            "consumer_count": consumers,
            "dlq_depth": 0,
            "config": config,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_names_keep_session_ids_unambiguous() {
        assert!(check_name("orders").is_ok());
        assert!(check_name("a.b-c_1").is_ok());
        assert!(check_name("").is_err());
        assert!(check_name("a:b").is_err());
        assert!(check_name(&"x".repeat(129)).is_err());
    }

    fn config(v: Value) -> QueueConfig {
        serde_json::from_value(v).expect("a queue config")
    }

    #[test]
    fn retries_deadline_and_backoff_map_onto_the_turn_and_the_rest_is_refused() {
        let def = |c: Value| QueueDef {
            queue: "q".into(),
            config: config(c),
        };
        let o = def(json!({"type": "fifo", "message_group_field": "g", "max_retries": 3, "backoff_ms": 250, "timeout_ms": 9000})).submit_options();
        let d = o.dispatch.expect("dispatch settings");
        assert_eq!(d.timeout_ms, Some(9000));
        assert_eq!(d.delivery, Some(Delivery::AtLeastOnce));
        assert_eq!(d.max_attempts, Some(4));
        assert_eq!(d.retryable, Some(true));
        assert_eq!(o.retry_backoff_ms, Some(250));
        let d = def(json!({"max_retries": 0}))
            .submit_options()
            .dispatch
            .expect("dispatch settings");
        assert_eq!(
            (d.delivery, d.max_attempts, d.retryable),
            (Some(Delivery::AtMostOnce), Some(1), Some(false))
        );
        // Nothing set: the function's settings from [iii].
        assert_eq!(
            def(json!({"type": "standard"})).submit_options(),
            SubmitOptions::default()
        );
        assert!(
            config(json!({"max_retries": 3, "backoff_ms": 1, "timeout_ms": 1}))
                .refused()
                .is_empty()
        );
        for field in [
            json!({"concurrency": 10}),
            json!({"poll_interval_ms": 100}),
            json!({"redeliver_on_engine_restart": false}),
            json!({"max_priority": 9}),
            json!({"priority_field": "p"}),
            json!({"timeout_ms": 0}),
            json!({"max_retries": 1000}),
            json!({"backoff_ms": 0}),
        ] {
            assert_eq!(config(field.clone()).refused().len(), 1, "{field}");
        }
    }
}
