//! The daemon's configuration: defaults → TOML file → `TURND_<SECTION>__<KEY>`
//! environment → CLI flags, then one `validate()` that reports every problem at once.
//! Unknown keys are warned about, not refused, so a rollback to an older binary
//! still starts on a newer config file.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use turnd_engine::{EngineConfig, TurnsConfig};
use turnd_proto::Role;

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct Config {
    pub server: ServerConfig,
    /// The operator page on the admin listener: allowed hosts, sign-in, live feeds.
    pub admin: crate::admin::AdminConfig,
    pub storage: StorageConfig,
    /// The engine's own type: every key of `[turns]` is defined once, there.
    pub turns: TurnsConfig,
    pub retention: RetentionConfig,
    pub auth: AuthConfig,
    pub log: LogConfig,
    /// The iii endpoint (`docs/iii.md`): off unless `iii.listen` is set.
    pub iii: turnd_iii::IiiConfig,
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

/// A key whose value is one of a fixed set of names.
pub trait Choice: Sized + Copy + 'static {
    /// The key, `section.name`.
    const KEY: &'static str;
    /// Every value, in the order the messages name them.
    const ALL: &'static [Self];
    /// The value as written in the config.
    fn name(self) -> &'static str;

    /// The value named `s`, or the problem to report.
    fn parse(s: &str) -> Result<Self, String> {
        Self::ALL
            .iter()
            .copied()
            .find(|v| v.name() == s)
            .ok_or_else(|| Self::problem(format_args!("{s:?}")))
    }

    /// The problem with a value that is none of the allowed ones: names them.
    fn problem(given: impl std::fmt::Display) -> String {
        let names: Vec<String> = Self::ALL
            .iter()
            .map(|v| format!("{:?}", v.name()))
            .collect();
        format!("{} must be {}, not {given}", Self::KEY, names.join(" or "))
    }
}

/// `storage.sync`: whether an acknowledgement waits for `fdatasync`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StorageSync {
    /// fsync before every acknowledgement (group-committed). The default.
    #[default]
    Always,
    /// No fsync: acknowledged writes may be lost on power loss. Tests and benchmarks.
    Never,
}

impl Choice for StorageSync {
    const KEY: &'static str = "storage.sync";
    const ALL: &'static [Self] = &[StorageSync::Always, StorageSync::Never];
    fn name(self) -> &'static str {
        match self {
            StorageSync::Always => "always",
            StorageSync::Never => "never",
        }
    }
}

/// `log.format`: how log records are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines. The default.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

impl Choice for LogFormat {
    const KEY: &'static str = "log.format";
    const ALL: &'static [Self] = &[LogFormat::Text, LogFormat::Json];
    fn name(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

/// Take the value of `C::KEY` out of the merged raw config when it is none of the
/// allowed ones, returning the problem, so that the typed deserialization does not
/// stop at it and the problem is reported with the config's others.
fn take_invalid<C: Choice>(merged: &mut toml::Value) -> Option<String> {
    let (section, key) = C::KEY.split_once('.')?;
    let table = merged.get_mut(section)?.as_table_mut()?;
    let problem = match table.get(key)? {
        toml::Value::String(s) => C::parse(s).err()?,
        other => C::problem(other),
    };
    table.remove(key);
    Some(problem)
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

/// The message for `turns.result_ack_timeout_ms`, a key of earlier versions that
/// nothing in the daemon read: refused, so a file that sets it does not look as if it
/// changed anything.
const RESULT_ACK_TIMEOUT_REFUSED: &str = "turns.result_ack_timeout_ms is not a daemon \
    setting (no daemon ever read it): remove it; a worker's resend interval is set in \
    its SDK (Rust WorkerOptions::result_ack_timeout, Python \
    Worker(result_ack_timeout=...), TypeScript resultAckTimeoutMs)";

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
    /// Load: defaults, then the file (if any), then `TURND_*` variables from `env`.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Loaded, ConfigError> {
        let defaults = toml::Value::try_from(Config::default())
            .map_err(|e| ConfigError::one(format!("defaults: {e}")))?;
        let mut merged = defaults.clone();
        let mut warnings = Vec::new();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| ConfigError::one(format!("read {}: {e}", path.display())))?;
            let file_value: toml::Value = toml::from_str(&text)
                .map_err(|e| ConfigError::one(format!("parse {}: {e}", path.display())))?;
            unknown_keys(&defaults, &defaults, &file_value, "", &mut warnings);
            merge(&mut merged, file_value);
        }
        let mut problems = Vec::new();
        for (k, v) in env {
            let Some(rest) = k.strip_prefix("TURND_") else {
                continue;
            };
            let Some((section, key)) = rest.split_once("__") else {
                continue;
            };
            let (section, key) = (section.to_ascii_lowercase(), key.to_ascii_lowercase());
            let path = format!("{section}.{key}");
            let known = defaults.get(&section).and_then(|s| s.get(&key)).is_some()
                || OPTIONAL_KEYS.contains(&path.as_str());
            if !known {
                warnings.push(format!(
                    "unknown config key {path} (from {k}) ignored{}",
                    did_you_mean(&defaults, &path, |p| format!(
                        "TURND_{}",
                        p.to_ascii_uppercase().replacen('.', "__", 1)
                    ))
                ));
                continue;
            }
            let value = parse_env_value(&v);
            match merged.as_table_mut().and_then(|t| {
                t.entry(section.clone())
                    .or_insert_with(|| toml::Value::Table(Default::default()))
                    .as_table_mut()
            }) {
                Some(t) => {
                    t.insert(key, value);
                }
                None => problems.push(format!("{k}: section {section} is not a table")),
            }
        }
        if merged
            .get("turns")
            .and_then(|t| t.get("result_ack_timeout_ms"))
            .is_some()
        {
            problems.push(RESULT_ACK_TIMEOUT_REFUSED.to_string());
        }
        if !problems.is_empty() {
            return Err(ConfigError { problems });
        }
        let mut invalid = BTreeMap::new();
        for (key, problem) in [
            (StorageSync::KEY, take_invalid::<StorageSync>(&mut merged)),
            (LogFormat::KEY, take_invalid::<LogFormat>(&mut merged)),
        ] {
            if let Some(p) = problem {
                invalid.insert(key, p);
            }
        }
        let mut config: Config = merged
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::one(e.to_string()))?;
        config.invalid = invalid;
        if let Some(path) = config.auth.token_file.clone() {
            config.auth.tokens.extend(read_token_file(&path)?);
        }
        Ok(Loaded { config, warnings })
    }

    /// Set `storage.sync` from its name (a command-line flag, say); a name that is
    /// none of the allowed ones is reported by [`Config::validate`].
    pub fn set_storage_sync(&mut self, name: &str) {
        if let Some(v) = self.choose::<StorageSync>(name) {
            self.storage.sync = v;
        }
    }

    /// Set `log.format` from its name; see [`Config::set_storage_sync`].
    pub fn set_log_format(&mut self, name: &str) {
        if let Some(v) = self.choose::<LogFormat>(name) {
            self.log.format = v;
        }
    }

    fn choose<C: Choice>(&mut self, name: &str) -> Option<C> {
        match C::parse(name) {
            Ok(v) => {
                self.invalid.remove(C::KEY);
                Some(v)
            }
            Err(problem) => {
                self.invalid.insert(C::KEY, problem);
                None
            }
        }
    }

    /// Check every value; report all problems at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut p: Vec<String> = self.invalid.values().cloned().collect();
        self.server_problems(&mut p);
        self.storage_problems(&mut p);
        self.turns_problems(&mut p);
        self.exposure_problems(&mut p);
        if p.is_empty() {
            Ok(())
        } else {
            Err(ConfigError { problems: p })
        }
    }

    /// Problems of `[server]`.
    fn server_problems(&self, p: &mut Vec<String>) {
        for (key, value) in [
            ("server.listen", &self.server.listen),
            ("server.admin_listen", &self.server.admin_listen),
        ] {
            if let Some(problem) = address_problem(key, value) {
                p.push(problem);
            }
        }
        if self.server.max_frame_bytes < 1024 {
            p.push("server.max_frame_bytes must be at least 1024".into());
        }
        if self.server.heartbeat_ms < 10 {
            p.push("server.heartbeat_ms must be at least 10".into());
        }
        if self.server.write_stall_ms < 10 {
            p.push("server.write_stall_ms must be at least 10".into());
        }
        for (name, v) in [
            ("server.outbox_frames", self.server.outbox_frames),
            ("server.max_json_depth", self.server.max_json_depth),
            ("server.max_connections", self.server.max_connections),
            (
                "server.max_connections_per_ip",
                self.server.max_connections_per_ip,
            ),
            (
                "server.max_inflight_per_connection",
                self.server.max_inflight_per_connection,
            ),
            (
                "server.max_watches_per_connection",
                self.server.max_watches_per_connection,
            ),
        ] {
            if v == 0 {
                p.push(format!("{name} must be positive"));
            }
        }
        match (&self.server.tls_cert, &self.server.tls_key) {
            (Some(c), Some(k)) => {
                for (name, f) in [("server.tls_cert", c), ("server.tls_key", k)] {
                    if !f.is_file() {
                        p.push(format!("{name} {} is not a readable file", f.display()));
                    }
                }
            }
            (None, None) => {}
            _ => p.push("server.tls_cert and server.tls_key must be set together".into()),
        }
    }

    /// Problems of `[retention]` and `[storage]`.
    fn storage_problems(&self, p: &mut Vec<String>) {
        if let Some(h) = self.retention.terminal_hours {
            p.push(format!(
                "retention.terminal_hours was replaced by retention.terminal_ms (milliseconds): \
                 write terminal_ms = {} instead",
                h.saturating_mul(3_600_000)
            ));
        }
        if !(1..=86_400_000).contains(&self.retention.sweep_interval_ms) {
            p.push(format!(
                "retention.sweep_interval_ms must be between 1 and 86400000, not {}",
                self.retention.sweep_interval_ms
            ));
        }
        if self.storage.data_dir.as_os_str().is_empty() {
            p.push("storage.data_dir must not be empty".into());
        }
        if !(1..=1 << 20).contains(&self.storage.cache_mb) {
            p.push(format!(
                "storage.cache_mb must be between 1 and 1048576, not {}",
                self.storage.cache_mb
            ));
        }
        for (key, v, lo, hi) in [
            (
                "storage.log_segment_kb",
                self.storage.log_segment_kb,
                64,
                4 << 20,
            ),
            (
                "storage.apply_interval_ms",
                self.storage.apply_interval_ms,
                1,
                60_000,
            ),
            (
                "storage.apply_delay_ms",
                self.storage.apply_delay_ms,
                0,
                10_000,
            ),
            (
                "storage.heal_interval_ms",
                self.storage.heal_interval_ms,
                1,
                3_600_000,
            ),
            ("storage.window_ms", self.window_ms(), 0, 30 * 86_400_000),
            ("storage.window_mb", self.storage.window_mb, 1, 1 << 20),
            (
                "storage.window_close_ms",
                self.storage.window_close_ms,
                0,
                30 * 86_400_000,
            ),
        ] {
            if !(lo..=hi).contains(&v) {
                p.push(format!("{key} must be between {lo} and {hi}, not {v}"));
            }
        }
        if (1..100).contains(&self.storage.window_close_ms) {
            p.push(format!(
                "storage.window_close_ms must be 0 (windows stay open) or at least 100, not {}",
                self.storage.window_close_ms
            ));
        }
        if self.storage.checkpoint_mb > 1 << 20 {
            p.push(format!(
                "storage.checkpoint_mb must be between 0 and 1048576, not {}",
                self.storage.checkpoint_mb
            ));
        }
    }

    /// Problems of `[turns]`.
    fn turns_problems(&self, p: &mut Vec<String>) {
        let t = &self.turns;
        for (name, v) in [
            ("turns.default_timeout_ms", t.default_timeout_ms),
            ("turns.probe_timeout_ms", t.probe_timeout_ms),
            ("turns.reconnect_grace_ms", t.reconnect_grace_ms),
            ("turns.cancel_grace_ms", t.cancel_grace_ms),
            ("turns.retry_backoff_ms", t.retry_backoff_ms),
            ("turns.retry_backoff_max_ms", t.retry_backoff_max_ms),
            ("turns.max_queued_per_session", t.max_queued_per_session),
            ("turns.max_value_bytes", t.max_value_bytes),
            ("turns.max_progress_bytes", t.max_progress_bytes),
        ] {
            if v == 0 {
                p.push(format!("{name} must be positive"));
            }
        }
        if t.max_steps == 0 {
            p.push("turns.max_steps must be positive".into());
        }
        if t.dispatch_timeout_ms == Some(0) {
            p.push("turns.dispatch_timeout_ms must be positive (omit it to wait for good)".into());
        }
    }

    /// Problems of `[auth]`, `[iii]`, and of listening beyond loopback without tokens.
    fn exposure_problems(&self, p: &mut Vec<String>) {
        for (i, tok) in self.auth.tokens.iter().enumerate() {
            if tok.token.len() < 8 {
                p.push(format!(
                    "auth.tokens[{i}] ({}) is shorter than 8 characters",
                    tok.role.as_str()
                ));
            }
        }
        p.extend(self.iii.problems());
        p.extend(
            self.admin
                .problems(&self.server.admin_listen, &self.auth.tokens),
        );
        if let Some(Ok(addr)) = self.iii.listen.as_deref().map(str::parse::<SocketAddr>) {
            if !addr.ip().is_loopback()
                && self.auth.tokens.is_empty()
                && !self.auth.allow_unauthenticated
            {
                p.push(format!(
                    "iii.listen {addr} is not a loopback address and auth.tokens is empty; \
                     configure tokens or set auth.allow_unauthenticated = true"
                ));
            }
        }
        if let Ok(addr) = self.server.listen.parse::<SocketAddr>() {
            if !addr.ip().is_loopback()
                && self.auth.tokens.is_empty()
                && !self.auth.allow_unauthenticated
            {
                p.push(format!(
                    "server.listen {addr} is not a loopback address and auth.tokens is empty; \
                     configure tokens or set auth.allow_unauthenticated = true"
                ));
            }
        }
    }

    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            turns: self.turns.clone(),
            retention_terminal_ms: self.retention.terminal_ms,
            retention_sweep_interval_ms: self.retention.sweep_interval_ms,
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

/// What is wrong with `value` as the listen address `key`, if anything. Listen
/// addresses are an IP address and a port: a host name such as `localhost` is not
/// resolved, which the parser's own words ("invalid socket address syntax") do not say.
pub fn address_problem(key: &str, value: &str) -> Option<String> {
    let e = value.parse::<SocketAddr>().err()?;
    let hint = match value.rsplit_once(':') {
        Some((host, port))
            if port.parse::<u16>().is_ok() && host.parse::<std::net::IpAddr>().is_err() =>
        {
            format!(
                "host names such as {host:?} are not resolved: write an IP address and the \
                 port, 127.0.0.1:{port} for loopback, 0.0.0.0:{port} for every interface, \
                 [::1]:{port} for IPv6 loopback"
            )
        }
        _ => "write an IP address and a port, such as 127.0.0.1:7420".to_string(),
    };
    Some(format!("{key} {value:?}: {e}; {hint}"))
}

/// Read `ROLE TOKEN` lines.
fn read_token_file(path: &Path) -> Result<Vec<TokenConfig>, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::one(format!("read auth.token_file {}: {e}", path.display())))?;
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut parts = line.split_whitespace();
        let role = match parts.next() {
            Some("worker") => Role::Worker,
            Some("client") => Role::Client,
            Some("operator") => Role::Operator,
            other => {
                problems.push(format!(
                    "{}:{}: role must be worker, client or operator, not {:?}",
                    path.display(),
                    n + 1,
                    other.unwrap_or("")
                ));
                continue;
            }
        };
        match (parts.next(), parts.next()) {
            (Some(token), None) => out.push(TokenConfig {
                role,
                token: token.to_string(),
            }),
            _ => problems.push(format!(
                "{}:{}: expected `ROLE TOKEN`",
                path.display(),
                n + 1
            )),
        }
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(ConfigError { problems })
    }
}

fn parse_env_value(v: &str) -> toml::Value {
    // A TOML scalar (number, bool, quoted string, array/inline table) when it parses
    // as one; a bare string otherwise.
    match toml::from_str::<toml::Table>(&format!("v = {v}")) {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(v.into())),
        Err(_) => toml::Value::String(v.into()),
    }
}

fn merge(base: &mut toml::Value, over: toml::Value) {
    match (base, over) {
        (toml::Value::Table(b), toml::Value::Table(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(bv) if bv.is_table() && v.is_table() => merge(bv, v),
                    _ => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, o) => *b = o,
    }
}

fn unknown_keys(
    all: &toml::Value,
    defaults: &toml::Value,
    given: &toml::Value,
    prefix: &str,
    out: &mut Vec<String>,
) {
    let (Some(d), Some(g)) = (defaults.as_table(), given.as_table()) else {
        return;
    };
    for (k, v) in g {
        let path = key_path(prefix, k);
        match d.get(k) {
            Some(dv) if dv.is_table() => unknown_keys(all, dv, v, &path, out),
            Some(_) => {}
            None if OPTIONAL_KEYS.contains(&path.as_str()) => {}
            None => out.push(format!(
                "unknown config key {path} ignored{}",
                did_you_mean(all, &path, str::to_string)
            )),
        }
    }
}

/// `"; did you mean X?"` for an unknown key `path`, naming (through `spell`, as the
/// file or the environment writes it) the known key it most likely meant: the most
/// alike key of the same table, or a key of that name in another table (a key put in
/// the wrong section); `""` when none is close.
fn did_you_mean(defaults: &toml::Value, path: &str, spell: impl Fn(&str) -> String) -> String {
    /// How alike (Jaro-Winkler, 0 to 1) two names must be to be offered:
    /// `listen_addr` ~ `listen` is 0.91, `data_dri` ~ `data_dir` 0.97, while
    /// unrelated keys of one table stay below 0.75.
    const ALIKE: f64 = 0.8;
    let (table, name) = path.rsplit_once('.').unwrap_or(("", path));
    let mut known: Vec<String> = Vec::new();
    collect_keys(defaults, "", &mut known);
    known.extend(OPTIONAL_KEYS.iter().map(|k| k.to_string()));
    let split = |k: &str| -> (String, String) {
        match k.rsplit_once('.') {
            Some((t, n)) => (t.to_string(), n.to_string()),
            None => (String::new(), k.to_string()),
        }
    };
    let best = known
        .iter()
        .filter(|k| split(k).0 == table)
        .map(|k| (strsim::jaro_winkler(name, &split(k).1), k))
        .filter(|(score, _)| *score >= ALIKE)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k.clone())
        .or_else(|| known.iter().find(|k| split(k).1 == name).cloned());
    match best {
        Some(k) => format!("; did you mean {}?", spell(&k)),
        None => String::new(),
    }
}

/// `prefix.key`, or `key` at the top.
fn key_path(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

/// Every key of `v` (tables included), as dotted paths under `prefix`.
fn collect_keys(v: &toml::Value, prefix: &str, out: &mut Vec<String>) {
    let Some(t) = v.as_table() else {
        return;
    };
    for (k, v) in t {
        let path = key_path(prefix, k);
        collect_keys(v, &path, out);
        out.push(path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_and_warnings() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("t.toml");
        std::fs::write(
            &f,
            "[server]\nheartbeat_ms = 250\nbogus = 1\n[turns]\ndispatch_timeout_ms = 900\n",
        )
        .expect("write");
        let env = vec![
            (
                "TURND_TURNS__PROBE_TIMEOUT_MS".to_string(),
                "77".to_string(),
            ),
            ("TURND_STORAGE__DATA_DIR".to_string(), "/tmp/x".to_string()),
            ("TURND_NOPE__X".to_string(), "1".to_string()),
            ("HOME".to_string(), "/root".to_string()),
        ];
        let l = Config::load(Some(&f), env).expect("loads");
        assert_eq!(l.config.server.heartbeat_ms, 250);
        assert_eq!(l.config.turns.probe_timeout_ms, 77);
        assert_eq!(l.config.turns.dispatch_timeout_ms, Some(900));
        assert_eq!(l.config.storage.data_dir, PathBuf::from("/tmp/x"));
        assert_eq!(l.config.turns.reconnect_grace_ms, 10_000);
        assert_eq!(l.warnings.len(), 2, "{:?}", l.warnings);
        l.config.validate().expect("valid");
    }

    /// `storage.window_ms` left unset follows `retention.terminal_ms` (a 24th of it,
    /// 10 s to 1 h); set, in a file or the environment, it is taken as it is, without
    /// an unknown-key warning. The store is opened with the length in effect, and the
    /// printed config shows it.
    #[test]
    fn window_ms_follows_the_retention_unless_set() {
        let dir = tempfile::tempdir().expect("tempdir");
        let window = |file: &str, env: &[(&str, &str)]| {
            let f = dir.path().join("w.toml");
            std::fs::write(&f, file).expect("write");
            let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
            let l = Config::load(Some(&f), env).expect("loads");
            assert!(l.warnings.is_empty(), "{:?}", l.warnings);
            l.config.validate().expect("valid");
            let opened = crate::store_options(&l.config).expect("options");
            assert_eq!(opened.windows.window_ms, l.config.window_ms());
            l.config
        };
        let retention = |ms: &str| format!("[retention]\nterminal_ms = {ms}\n");
        // The defaults: 72 h of retention, so the 1 h cap.
        assert_eq!(window("", &[]).window_ms(), 3_600_000);
        assert_eq!(window(&retention("3600000"), &[]).window_ms(), 150_000);
        assert_eq!(window(&retention("60000"), &[]).window_ms(), 10_000);
        // Turns kept for good.
        assert_eq!(window(&retention("0"), &[]).window_ms(), 3_600_000);
        // Set: as it is, 0 (no windows) included.
        let set = format!("{}[storage]\nwindow_ms = 0\n", retention("3600000"));
        assert_eq!(window(&set, &[]).window_ms(), 0);
        let env = [("TURND_STORAGE__WINDOW_MS", "5000")];
        let c = window(&retention("3600000"), &env);
        assert_eq!(c.window_ms(), 5_000);
        assert!(window(&retention("3600000"), &[])
            .to_toml_redacted()
            .contains("window_ms = 150000"));
        assert!(c.to_toml_redacted().contains("window_ms = 5000"));
    }

    /// `storage.window_close_ms` is 0 (windows stay open) or at least 100 ms: a
    /// shorter time would close and open old windows all the time.
    #[test]
    fn window_close_ms_is_zero_or_at_least_100() {
        let validated = |ms: &str| {
            let env = vec![("TURND_STORAGE__WINDOW_CLOSE_MS".to_string(), ms.to_string())];
            Config::load(None, env).and_then(|l| l.config.validate().map(|()| l.config))
        };
        for ok in ["0", "100", "60000"] {
            assert!(validated(ok).is_ok(), "{ok}");
        }
        for bad in ["1", "99"] {
            match validated(bad) {
                Err(e) => assert!(e.to_string().contains("storage.window_close_ms"), "{e}"),
                Ok(_) => panic!("window_close_ms = {bad} accepted"),
            }
        }
    }

    /// The hours key of earlier versions is refused, naming the key that replaced it
    /// and the value to write, from a file and from the environment alike.
    #[test]
    fn the_old_retention_key_is_refused_with_its_replacement() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("t.toml");
        std::fs::write(&f, "[retention]\nterminal_hours = 24\n").expect("write");
        let load = |file: Option<&Path>, env: Vec<(String, String)>| {
            Config::load(file, env).and_then(|l| l.config.validate().map(|()| l))
        };
        let msg = match load(Some(&f), Vec::new()) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("terminal_hours accepted"),
        };
        assert!(
            msg.contains("retention.terminal_ms") && msg.contains("86400000"),
            "{msg}"
        );
        let env = vec![(
            "TURND_RETENTION__TERMINAL_HOURS".to_string(),
            "1".to_string(),
        )];
        let msg = match load(None, env) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("terminal_hours accepted"),
        };
        assert!(msg.contains("terminal_ms = 3600000"), "{msg}");
        let ok = vec![(
            "TURND_RETENTION__TERMINAL_MS".to_string(),
            "5000".to_string(),
        )];
        let loaded = load(None, ok).expect("terminal_ms loads");
        assert_eq!(loaded.config.engine_config().retention_terminal_ms, 5000);
    }

    /// The SDK-only key of earlier versions is refused with a message that says
    /// where a worker's resend interval is set, from a file and from the environment.
    #[test]
    fn the_dead_result_ack_key_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("t.toml");
        std::fs::write(&f, "[turns]\nresult_ack_timeout_ms = 2000\n").expect("write");
        for (file, env) in [
            (Some(f.as_path()), Vec::new()),
            (
                None,
                vec![(
                    "TURND_TURNS__RESULT_ACK_TIMEOUT_MS".to_string(),
                    "2000".to_string(),
                )],
            ),
        ] {
            let msg = match Config::load(file, env) {
                Err(e) => e.to_string(),
                Ok(_) => panic!("result_ack_timeout_ms accepted"),
            };
            assert!(
                msg.contains("turns.result_ack_timeout_ms")
                    && msg.contains("WorkerOptions::result_ack_timeout"),
                "{msg}"
            );
        }
    }

    /// A value of `storage.sync` or `log.format` that is none of the allowed ones is
    /// reported with the config's other problems, naming the allowed values; a good
    /// value from the environment replaces a bad one of the file.
    #[test]
    fn a_bad_choice_is_reported_with_every_other_problem() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("t.toml");
        std::fs::write(
            &f,
            "[storage]\nsync = \"sometimes\"\n[server]\nmax_frame_bytes = 10\n[log]\nformat = 3\n",
        )
        .expect("write");
        let l = Config::load(Some(&f), Vec::new()).expect("loads; validate reports");
        let e = l.config.validate().expect_err("invalid");
        assert_eq!(e.problems.len(), 3, "{e}");
        for want in [
            "storage.sync must be \"always\" or \"never\", not \"sometimes\"",
            "log.format must be \"text\" or \"json\", not 3",
            "server.max_frame_bytes must be at least 1024",
        ] {
            assert!(e.problems.iter().any(|p| p == want), "{want}: {e}");
        }
        let env = vec![("TURND_STORAGE__SYNC".to_string(), "never".to_string())];
        let l = Config::load(Some(&f), env).expect("loads");
        assert_eq!(l.config.storage.sync, StorageSync::Never);
        let e = l.config.validate().expect_err("still invalid");
        assert_eq!(e.problems.len(), 2, "{e}");
    }

    #[test]
    fn validate_reports_every_problem() {
        let mut c = Config::default();
        c.server.listen = "0.0.0.0:7420".into();
        c.set_storage_sync("sometimes");
        c.turns.max_steps = 0;
        let e = c.validate().expect_err("invalid");
        assert_eq!(e.problems.len(), 3, "{e}");
        c.auth.allow_unauthenticated = true;
        c.set_storage_sync("never");
        c.turns.max_steps = 5;
        c.validate().expect("valid with allow_unauthenticated");
    }
}
