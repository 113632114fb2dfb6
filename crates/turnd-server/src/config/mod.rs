//! The daemon's configuration: defaults → TOML file → `TURND_<SECTION>__<KEY>`
//! environment → CLI flags, then one `validate()` that reports every problem at once.
//! Unknown keys are warned about, not refused, so a rollback to an older binary
//! still starts on a newer config file.
//!
//! This file holds the [`Config`] struct with every table and its defaults, the keys
//! that are valid though absent from the defaults, and the error of a config that
//! cannot be used: what the config *is*. The rest is one module per job:
//!
//! - `load`: reading the file and the environment, merging them over the defaults,
//!   warning about unknown keys (with a "did you mean"), the token file;
//! - `choice`: keys with a fixed set of values (`storage.sync`, `log.format`);
//! - `check`: [`Config::validate`], one function per table's problems;
//! - `admin`: `[admin]`, the operator page's exposure, and its problems.

mod admin;
mod check;
mod choice;
mod load;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use turnd_engine::{EngineConfig, TurnsConfig};
use turnd_proto::Role;

pub use admin::AdminConfig;
pub use check::address_problem;
pub use choice::{Choice, LogFormat, StorageSync};

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct Config {
    pub server: ServerConfig,
    /// The operator page on the admin listener: allowed hosts, sign-in, live feeds.
    pub admin: AdminConfig,
    pub storage: StorageConfig,
    /// The engine's own type: every key of `[turns]` is defined once, there.
    pub turns: TurnsConfig,
    pub retention: RetentionConfig,
    pub auth: AuthConfig,
    pub log: LogConfig,
    /// The iii endpoint (`docs/iii.md`): off unless `iii.listen` is set.
    pub iii: turnd_iii::IiiConfig,
    /// turnd across machines (`docs/cluster.md`): one node on its local commit log
    /// unless the table is there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<crate::cluster_config::ClusterConfig>,
    /// Values of keys with a fixed set of values (`storage.sync`, `log.format`) that
    /// were none of them, by key, with the problem to report; the default stands in
    /// for each. [`Config::validate`] reports them with every other problem.
    #[serde(skip)]
    invalid: BTreeMap<&'static str, String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ServerConfig {
    /// WebSocket listen address (protocol v1 at `/v1`).
    pub listen: String,
    /// Admin HTTP listen address (`/healthz`, `/readyz`, `/metrics`, the operator
    /// page under `/ui`; see `[admin]`).
    pub admin_listen: String,
    /// Largest frame accepted, in bytes.
    pub max_frame_bytes: u64,
    /// Interval of server WebSocket pings; a peer silent for 3× this is gone.
    pub heartbeat_ms: u64,
    /// Frames queued for one connection before it counts as a slow reader and is
    /// disconnected.
    pub outbox_frames: u64,
    /// Watches one connection may hold.
    pub max_watches_per_connection: u64,
    /// How long a graceful shutdown waits for requests in progress.
    pub shutdown_timeout_ms: u64,
    /// Deepest JSON nesting accepted in a frame; deeper frames get `too_large`.
    pub max_json_depth: u64,
    /// Open connections in total; more are refused (`rate_limited`, close 1013).
    pub max_connections: u64,
    /// Open connections from one IP address.
    pub max_connections_per_ip: u64,
    /// PEM certificate chain; with `tls_key`, both listeners speak TLS (wss, https).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// Requests per second one connection may send (a token bucket of this size
    /// refilled every second); more get `rate_limited`. 0: no rate limit (the
    /// default; `max_inflight_per_connection` bounds what one connection can hold).
    pub max_requests_per_second: u64,
    /// Requests of one connection being run at once; more get `rate_limited`.
    pub max_inflight_per_connection: u64,
    /// How long a connection's writer may fail to write anything before the
    /// connection is closed with 1008 (the peer does not read).
    pub write_stall_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StorageConfig {
    /// Directory of the sled store.
    pub data_dir: PathBuf,
    /// `always` (fsync before every acknowledgement, group-committed) or `never`
    /// (tests and benchmarks only: acknowledged writes may be lost on power loss).
    pub sync: StorageSync,
    /// MiB of decoded pages sled keeps in memory. The engine holds every live turn
    /// itself; the cache serves reads of finished turns and events.
    pub cache_mb: u64,
    /// MiB of keys and values written after which the store checkpoints (closes and
    /// opens sled so that it writes a snapshot), bounding what a restart replays.
    /// 0: never.
    pub checkpoint_mb: u64,
    /// KiB of one commit log segment file (preallocated).
    pub log_segment_kb: u64,
    /// How often the records of the commit log are written to sled behind it.
    pub apply_interval_ms: u64,
    /// How long the write of a live record (turn, invocation, session meta) or of an
    /// event value waits before it is written to sled, so that one rewritten or
    /// deleted meanwhile is written once or never, and a session's event values of a
    /// round go as one. 0: at the next round.
    pub apply_delay_ms: u64,
    /// How often a commit log whose write or sync failed tries to repair itself.
    pub heal_interval_ms: u64,
    /// A new time window of finished turns starts when the newest is this old (ms);
    /// 0: no windows (finished turns stay in the main database). Unset: follows
    /// `retention.terminal_ms` ([`Config::window_ms`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_ms: Option<u64>,
    /// ... or this large on disk (MiB).
    pub window_mb: u64,
    /// A time window no read or write used for this long (ms) is closed until it is
    /// needed again, which gives back the memory sled keeps for every page of an
    /// open database; 0: windows stay open.
    pub window_close_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RetentionConfig {
    /// How long a terminal turn is kept after it finished, in ms; 0 keeps it for good.
    pub terminal_ms: u64,
    /// How often retention looks for turns to delete, in ms.
    pub sweep_interval_ms: u64,
    /// The key of earlier versions, in hours: refused, with a message naming
    /// `terminal_ms` (a file that still sets it must not silently keep turns longer or
    /// shorter than it says).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub terminal_hours: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenConfig {
    pub role: Role,
    pub token: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct AuthConfig {
    /// Tokens by role: `tokens = [{ role = "worker", token = "…" }, …]`.
    pub tokens: Vec<TokenConfig>,
    /// A file of more tokens, one `ROLE TOKEN` pair per line (`#` comments), so
    /// secrets can stay out of the main config file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    /// Start without tokens on a non-loopback address.
    pub allow_unauthenticated: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LogConfig {
    /// `text` or `json`.
    pub format: LogFormat,
    /// A tracing filter, e.g. `info` or `turnd_engine=debug,info`.
    pub level: String,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: "127.0.0.1:7420".into(),
            admin_listen: "127.0.0.1:7421".into(),
            max_frame_bytes: 1024 * 1024,
            heartbeat_ms: 5_000,
            outbox_frames: 4_096,
            max_watches_per_connection: 64,
            shutdown_timeout_ms: 10_000,
            max_json_depth: 64,
            max_connections: 10_000,
            max_connections_per_ip: 1_000,
            max_requests_per_second: 0,
            max_inflight_per_connection: 1_024,
            write_stall_ms: 10_000,
            tls_cert: None,
            tls_key: None,
        }
    }
}

impl Default for StorageConfig {
    fn default() -> Self {
        StorageConfig {
            data_dir: PathBuf::from("./data"),
            sync: StorageSync::Always,
            cache_mb: turnd_store::DEFAULT_CACHE_MB,
            checkpoint_mb: turnd_store::DEFAULT_CHECKPOINT_MB,
            log_segment_kb: turnd_store::logged::DEFAULT_SEGMENT_KB,
            apply_interval_ms: turnd_store::logged::DEFAULT_APPLY_INTERVAL_MS,
            apply_delay_ms: turnd_store::logged::DEFAULT_APPLY_DELAY_MS,
            heal_interval_ms: turnd_store::logged::DEFAULT_HEAL_INTERVAL_MS,
            window_ms: None,
            window_mb: turnd_store::windows::DEFAULT_WINDOW_MB,
            window_close_ms: turnd_store::logged::DEFAULT_WINDOW_CLOSE_MS,
        }
    }
}

impl Default for RetentionConfig {
    fn default() -> Self {
        let e = EngineConfig::default();
        RetentionConfig {
            terminal_ms: e.retention_terminal_ms,
            sweep_interval_ms: e.retention_sweep_interval_ms,
            terminal_hours: None,
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Text,
            level: "info".into(),
        }
    }
}

/// Keys that are valid but absent from the serialized defaults.
const OPTIONAL_KEYS: &[&str] = &[
    "turns.dispatch_timeout_ms",
    "auth.token_file",
    "server.tls_cert",
    "server.tls_key",
    "retention.terminal_hours",
    "turns.result_ack_timeout_ms",
    "storage.window_ms",
    "iii.listen",
    "iii.timeout_ms",
    "iii.max_attempts",
];

/// A config that could not be loaded, with every problem found.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration:\n  - {}", .problems.join("\n  - "))]
pub struct ConfigError {
    pub problems: Vec<String>,
}

impl ConfigError {
    fn one(p: String) -> Self {
        ConfigError { problems: vec![p] }
    }
}

/// A loaded config and the warnings met on the way (unknown keys).
pub struct Loaded {
    pub config: Config,
    pub warnings: Vec<String>,
}

impl Config {
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            turns: self.turns.clone(),
            retention_terminal_ms: self.retention.terminal_ms,
            retention_sweep_interval_ms: self.retention.sweep_interval_ms,
            partition: None,
        }
    }

    /// `storage.window_ms` as set, or the length that follows the retention when it
    /// is not ([`turnd_store::windows::window_ms_for_retention`]).
    pub fn window_ms(&self) -> u64 {
        self.storage.window_ms.unwrap_or_else(|| {
            turnd_store::windows::window_ms_for_retention(self.retention.terminal_ms)
        })
    }

    /// The effective config as TOML (tokens redacted; `storage.window_ms` as it is
    /// used, set or not).
    pub fn to_toml_redacted(&self) -> String {
        let mut c = self.clone();
        c.storage.window_ms = Some(self.window_ms());
        // Tokens read from the token file stay in the file.
        if c.auth.token_file.is_some() {
            c.auth.tokens.clear();
        }
        for t in &mut c.auth.tokens {
            t.token = "<redacted>".into();
        }
        toml::to_string_pretty(&c).unwrap_or_else(|e| format!("# cannot render config: {e}"))
    }
}
