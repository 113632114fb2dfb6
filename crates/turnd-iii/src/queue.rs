//! iii queues on turnd: `queue::define` keeps a definition in the store; an enqueued
//! message becomes a turn in a session derived from the queue (and, for a fifo
//! queue, its message group), so a group runs one message at a time and groups run
//! in parallel; `engine::queue::topic_stats` answers from the engine's live state.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use turnd_proto::{SessionOrder, SessionsListArgs, PAGE_MAX};
use turnd_store::{Batch, Store, StoreError};

use crate::store_key;
use crate::wire::IiiError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum QueueType {
    #[default]
    Standard,
    Fifo,
}

/// A queue's `config` as iii's queue worker takes it. Only `type` and
/// `message_group_field` change what turnd does; the other fields are kept and
/// shown by `topic_stats` (turnd's own settings govern retries and deadlines).
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DefineArgs {
    queue: String,
    #[serde(default)]
    config: QueueConfig,
}

const QUEUE_PREFIX: &str = "queue/";

/// Every stored queue definition.
pub fn load(store: &Store) -> Result<HashMap<String, QueueDef>, StoreError> {
    let start = store_key(QUEUE_PREFIX);
    let mut end = start.clone();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    let mut out = HashMap::new();
    for (k, v) in store.kv().scan(&start, &end, false, usize::MAX)? {
        let def: QueueDef = serde_json::from_slice(&v).map_err(|e| {
            StoreError::Corrupt(format!("iii queue {}: {e}", String::from_utf8_lossy(&k)))
        })?;
        out.insert(def.queue.clone(), def);
    }
    Ok(out)
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
        let changed = self
            .queues
            .lock()
            .map(|m| m.get(&def.queue) != Some(&def))
            .unwrap_or(true);
        if changed {
            let bytes = serde_json::to_vec(&def)
                .map_err(|e| IiiError::new("internal", format!("encode queue: {e}")))?;
            let mut b = Batch::new();
            b.put_raw(store_key(&format!("{QUEUE_PREFIX}{}", def.queue)), bytes);
            self.engine.store().commit(b).await.map_err(|e| {
                IiiError::new(
                    "unavailable",
                    format!("{e}; the queue was not defined, retry later"),
                )
            })?;
            if let Ok(mut m) = self.queues.lock() {
                m.insert(def.queue.clone(), def.clone());
            }
        }
        Ok(json!({"queue": def.queue, "changed": changed}))
    }

    /// The session an enqueued message runs in: `<queue>:<group>` for a fifo queue,
    /// `<queue>:~<invocation>` (one session per message) for a standard one.
    pub(crate) fn queue_session(
        &self,
        queue: &str,
        data: &Value,
        message_id: &str,
    ) -> Result<String, IiiError> {
        let def = self
            .queues
            .lock()
            .ok()
            .and_then(|m| m.get(queue).cloned())
            .ok_or_else(|| {
                IiiError::new(
                    "enqueue_error",
                    format!("queue {queue:?} is not defined: call queue::define before enqueueing"),
                )
            })?;
        match def.config.kind {
            QueueType::Standard => Ok(format!("{queue}:~{message_id}")),
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
                Ok(format!("{queue}:{group}"))
            }
        }
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
        let config = self
            .queues
            .lock()
            .ok()
            .and_then(|m| m.get(&queue).map(|d| d.config.clone()));
        let prefix = format!("{queue}:");
        let (mut depth, mut running) = (0u64, 0u64);
        let mut functions: Vec<String> = Vec::new();
        let mut after = None;
        loop {
            let page = self
                .engine
                .list_sessions(SessionsListArgs {
                    order: Some(SessionOrder::Id),
                    limit: Some(PAGE_MAX),
                    after: after.take(),
                    ..SessionsListArgs::default()
                })
                .await
                .map_err(|e| IiiError::new("unavailable", e.to_string()))?;
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
            .engine
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
}
