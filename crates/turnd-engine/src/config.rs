//! The engine's timers and limits: the `[turns]` config section ([`TurnsConfig`],
//! read by the server straight into this type) and the `[retention]` keys.

use serde::{Deserialize, Serialize};

/// Timers and limits of the turn state machine: every field is a config key of the
/// `[turns]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TurnsConfig {
    /// Attempt deadline for functions registered without `timeout_ms`.
    pub default_timeout_ms: u64,
    /// How long to wait for `invocation.status` after a `probe`, and for a result the
    /// worker said it holds.
    pub probe_timeout_ms: u64,
    /// How long a disconnected worker's invocations wait for it to come back.
    pub reconnect_grace_ms: u64,
    /// How long a `cancel` waits for the worker's answer.
    pub cancel_grace_ms: u64,
    /// Steps per turn before it fails with `step_limit`.
    pub max_steps: u32,
    /// How long a turn waits for a worker before it fails with `no_worker`; `None`
    /// waits for good.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dispatch_timeout_ms: Option<u64>,
    /// First retry backoff; doubled per retry.
    pub retry_backoff_ms: u64,
    /// Cap of the retry backoff.
    pub retry_backoff_max_ms: u64,
    /// Non-terminal turns a session may hold (queued and running); more are refused
    /// with `rate_limited`.
    pub max_queued_per_session: u64,
    /// Largest `input` (and step output/state) in bytes of JSON.
    pub max_value_bytes: u64,
    /// Largest `data` of `invocation.progress`, in bytes of JSON.
    pub max_progress_bytes: u64,
    /// How long a worker that disconnected, and the functions only it registered,
    /// stay in the registry (and in `workers.list`/`functions.list`) once nothing
    /// else refers to them.
    pub worker_linger_ms: u64,
}

impl Default for TurnsConfig {
    fn default() -> Self {
        TurnsConfig {
            default_timeout_ms: 30_000,
            probe_timeout_ms: 2_000,
            reconnect_grace_ms: 10_000,
            cancel_grace_ms: 5_000,
            max_steps: 1_000,
            dispatch_timeout_ms: None,
            retry_backoff_ms: 500,
            retry_backoff_max_ms: 60_000,
            max_queued_per_session: 10_000,
            max_value_bytes: 512 * 1024,
            max_progress_bytes: 64 * 1024,
            worker_linger_ms: 600_000,
        }
    }
}

/// Everything the engine is configured with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EngineConfig {
    /// The `[turns]` section.
    pub turns: TurnsConfig,
    /// How long a terminal turn is kept after it finished; 0 keeps it for good
    /// (`retention.terminal_ms`).
    pub retention_terminal_ms: u64,
    /// How often retention looks for turns to delete (`retention.sweep_interval_ms`).
    pub retention_sweep_interval_ms: u64,
    /// The partition of a cluster this engine holds the sessions of (None: every
    /// session, one daemon on its own). Set by the node, not a config key.
    #[serde(skip)]
    pub partition: Option<Partition>,
}

/// One partition of a cluster's sessions: `index` of `count`. A session is in it when
/// `turnd_proto::session_partition(id, count) == index`; the engine mints its turn
/// ids in it, so that requests naming them route to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partition {
    pub index: u32,
    pub count: u32,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            turns: TurnsConfig::default(),
            retention_terminal_ms: 72 * 3_600_000,
            retention_sweep_interval_ms: 60_000,
            partition: None,
        }
    }
}
