//! What a running proxy holds: its rules with their hits, its connections, whether
//! it refuses or holds new ones, its counters and its log of frames; and the two
//! decisions made on it (a frame's fate, which connections a cut ends).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;
use tokio::sync::{watch, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::rules::{Action, Dir, Fate, Rule};
use crate::rng::SplitMix64;

/// Frames kept in the log; later frames are counted but not logged.
const LOG_LIMIT: usize = 200_000;

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
/// One text frame that went through the proxy.
#[derive(Debug, Clone)]
pub struct LoggedFrame {
    /// The proxied connection (numbered from 1 in accept order).
    pub conn: u64,
    /// Its direction.
    pub dir: Dir,
    /// When the proxy read it (Unix ms, comparable with the daemon's `at_ms`).
    pub at_unix_ms: u64,
    /// The frame's JSON (a JSON string holding the text when it was not JSON).
    pub frame: Value,
    /// What the proxy did with it.
    pub fate: Fate,
}

/// Counters of a proxy's decisions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Connections accepted and connected upstream.
    pub connections: u64,
    /// Connections refused (socket dropped at accept) while refusing.
    pub refused: u64,
    /// Connections dropped because the upstream daemon could not be reached.
    pub upstream_failures: u64,
    /// Connections cut by [`ProxyHandle::cut_all`] / [`ProxyHandle::cut_worker`].
    pub cut: u64,
    /// Text frames forwarded unchanged.
    pub forwarded: u64,
    /// Text frames dropped by a rule.
    pub dropped: u64,
    /// Text frames delayed by a rule.
    pub delayed: u64,
    /// Text frames duplicated by a rule.
    pub duplicated: u64,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) connections: AtomicU64,
    pub(super) refused: AtomicU64,
    pub(super) upstream_failures: AtomicU64,
    pub(super) cut: AtomicU64,
    pub(super) forwarded: AtomicU64,
    pub(super) dropped: AtomicU64,
    pub(super) delayed: AtomicU64,
    pub(super) duplicated: AtomicU64,
}

pub(super) struct RuleEntry {
    pub(super) id: u64,
    pub(super) rule: Rule,
    pub(super) hits: u64,
}

pub(super) struct ConnEntry {
    pub(super) worker_id: Option<String>,
    /// Drops both sockets.
    pub(super) cut: CancellationToken,
    /// Drops the peer's socket only; the daemon's stays open (half-open).
    pub(super) sever: CancellationToken,
}

#[derive(Default)]
pub(super) struct Refusal {
    pub(super) on: bool,
    pub(super) until: Option<Instant>,
}

pub(super) struct State {
    pub(super) addr: SocketAddr,
    pub(super) upstream: Mutex<String>,
    pub(super) rules: Mutex<Vec<RuleEntry>>,
    pub(super) next_rule: AtomicU64,
    pub(super) conns: Mutex<HashMap<u64, ConnEntry>>,
    pub(super) next_conn: AtomicU64,
    pub(super) refusal: Mutex<Refusal>,
    pub(super) hold: watch::Sender<bool>,
    pub(super) counters: Counters,
    pub(super) log: Mutex<Vec<LoggedFrame>>,
    pub(super) logged: Notify,
    pub(super) rng: Mutex<SplitMix64>,
    pub(super) shutdown: CancellationToken,
}

impl State {
    pub(super) fn refusing(&self) -> bool {
        let r = lock(&self.refusal);
        r.on || r.until.map(|u| Instant::now() < u).unwrap_or(false)
    }

    /// The fate of a text frame: the first rule that applies decides.
    pub(super) fn decide(&self, dir: Dir, frame: Option<&Value>) -> Fate {
        let Some(frame) = frame else {
            return Fate::Forwarded;
        };
        let mut rules = lock(&self.rules);
        for entry in rules.iter_mut() {
            let r = &entry.rule;
            if r.dir != dir || r.times.map(|n| entry.hits >= n).unwrap_or(false) {
                continue;
            }
            if !r.matcher.matches(frame) {
                continue;
            }
            if let Some(p) = r.chance {
                if !lock(&self.rng).chance(p) {
                    continue;
                }
            }
            entry.hits += 1;
            return match r.action {
                Action::Drop => Fate::Dropped,
                Action::Delay(d) => Fate::Delayed(d),
                Action::Duplicate => Fate::Duplicated,
            };
        }
        Fate::Forwarded
    }

    pub(super) fn record(&self, conn: u64, dir: Dir, frame: Value, fate: Fate) {
        let c = &self.counters;
        let counter = match fate {
            Fate::Forwarded => &c.forwarded,
            Fate::Dropped => &c.dropped,
            Fate::Delayed(_) => &c.delayed,
            Fate::Duplicated => &c.duplicated,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        {
            let mut log = lock(&self.log);
            if log.len() < LOG_LIMIT {
                log.push(LoggedFrame {
                    conn,
                    dir,
                    at_unix_ms: unix_ms(),
                    frame,
                    fate,
                });
            }
        }
        self.logged.notify_waiters();
    }

    pub(super) fn cut_where(&self, pred: impl Fn(&ConnEntry) -> bool) -> usize {
        let conns = lock(&self.conns);
        let mut n = 0;
        for c in conns.values().filter(|c| pred(c)) {
            if !c.cut.is_cancelled() {
                c.cut.cancel();
                n += 1;
            }
        }
        self.counters.cut.fetch_add(n as u64, Ordering::Relaxed);
        n
    }
}
