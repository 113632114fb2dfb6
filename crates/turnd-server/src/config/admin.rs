//! `[admin]`: how the admin listener's operator page is exposed — the host names it
//! answers to besides loopback names and addresses, its sign-in sessions, the rate of
//! sign-in attempts and its live feeds — and the exposure check of
//! `server.admin_listen`, reported by `Config::validate` with every other problem.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::TokenConfig;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AdminConfig {
    /// Host names (the `Host` header, port left out) the operator page answers to
    /// besides `localhost`, `*.localhost` and IP addresses; a name starting with a dot
    /// also allows every name under it. Anything else is refused, so that a web page
    /// elsewhere cannot reach the page through a name it points at this machine (DNS
    /// rebinding).
    pub allowed_hosts: Vec<String>,
    /// Lifetime of a sign-in session of the page, in ms.
    pub session_ms: u64,
    /// Failed sign-ins one client address may make in a minute; more are refused with
    /// 429 until the minute is over.
    pub login_failures_per_minute: u64,
    /// Live feeds (server-sent events) of the page open at once, over every client.
    pub max_feeds: u64,
    /// Live feeds one client address may hold open.
    pub max_feeds_per_client: u64,
    /// Listen on a non-loopback `server.admin_listen` with no `auth.tokens`: the
    /// operator page, which shows every input, output and error, is then open to
    /// everyone who reaches the address.
    pub allow_unauthenticated: bool,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            allowed_hosts: Vec::new(),
            session_ms: 8 * 3_600_000,
            login_failures_per_minute: 10,
            max_feeds: 64,
            max_feeds_per_client: 8,
            allow_unauthenticated: false,
        }
    }
}

impl AdminConfig {
    /// Problems of `[admin]`, and of a non-loopback `admin_listen` no token guards.
    pub fn problems(&self, admin_listen: &str, tokens: &[TokenConfig]) -> Vec<String> {
        let mut p = Vec::new();
        if !(100..=30 * 86_400_000).contains(&self.session_ms) {
            p.push(format!(
                "admin.session_ms must be between 100 and 2592000000, not {}",
                self.session_ms
            ));
        }
        for (name, v) in [
            (
                "admin.login_failures_per_minute",
                self.login_failures_per_minute,
            ),
            ("admin.max_feeds", self.max_feeds),
            ("admin.max_feeds_per_client", self.max_feeds_per_client),
        ] {
            if v == 0 {
                p.push(format!("{name} must be positive"));
            }
        }
        for h in &self.allowed_hosts {
            let name = h.strip_prefix('.').unwrap_or(h);
            let ok = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.'));
            if !ok {
                p.push(format!(
                    "admin.allowed_hosts entry {h:?} is not a host name (letters, digits, '-' and '.', no port)"
                ));
            }
        }
        if let Ok(addr) = admin_listen.parse::<SocketAddr>() {
            if !addr.ip().is_loopback() && tokens.is_empty() && !self.allow_unauthenticated {
                p.push(format!(
                    "server.admin_listen {addr} is not a loopback address and auth.tokens is empty: \
                     the operator page would show every session's inputs, outputs and errors to \
                     anyone who reaches it; configure an operator token or set \
                     admin.allow_unauthenticated = true"
                ));
            }
        }
        p
    }
}
