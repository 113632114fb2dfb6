//! [`Config::validate`]: every value checked, every problem reported at once, one
//! function per table; and the listen-address check the CLI shares.

use std::net::SocketAddr;

use super::Config;
use super::ConfigError;

impl Config {
    /// Check every value; report all problems at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut p: Vec<String> = self.invalid.values().cloned().collect();
        self.server_problems(&mut p);
        self.storage_problems(&mut p);
        self.turns_problems(&mut p);
        self.exposure_problems(&mut p);
        if let Some(c) = &self.cluster {
            p.extend(c.problems());
        }
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
