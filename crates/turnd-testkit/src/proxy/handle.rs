//! [`ProxyHandle`]: the run-time controls of a running proxy (rules, cuts,
//! refusals, the upstream) and what it saw (counters, the log of frames).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::forward::WS_PATH;
use super::rules::{Dir, Match, Rule, RuleId};
use super::state::{lock, LoggedFrame, ProxyStats, RuleEntry, State};
use crate::rng::SplitMix64;

/// Control of a running [`Proxy`]; cheap to clone, usable from any task.
#[derive(Clone)]
pub struct ProxyHandle {
    pub(super) state: Arc<State>,
}

impl std::fmt::Debug for ProxyHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyHandle")
            .field("addr", &self.state.addr)
            .field("upstream", &self.upstream())
            .field("stats", &self.stats())
            .finish()
    }
}

impl ProxyHandle {
    /// The URL workers connect to: `ws://127.0.0.1:PORT/v1`.
    pub fn url(&self) -> String {
        format!("ws://{}{WS_PATH}", self.state.addr)
    }

    /// The daemon URL new connections are forwarded to.
    pub fn upstream(&self) -> String {
        lock(&self.state.upstream).clone()
    }

    /// Forward new connections to `url` from now on (existing ones are unchanged; cut
    /// them to move their peers over).
    pub fn set_upstream(&self, url: impl Into<String>) {
        *lock(&self.state.upstream) = url.into();
    }

    /// Add a rule after the existing ones.
    pub fn add(&self, rule: Rule) -> RuleId {
        let id = self.state.next_rule.fetch_add(1, Ordering::Relaxed);
        lock(&self.state.rules).push(RuleEntry { id, rule, hits: 0 });
        RuleId(id)
    }

    /// Remove a rule; false if it was not there.
    pub fn remove(&self, id: RuleId) -> bool {
        let mut rules = lock(&self.state.rules);
        let before = rules.len();
        rules.retain(|r| r.id != id.0);
        rules.len() != before
    }

    /// Remove every rule: from now on every frame is forwarded.
    pub fn clear_rules(&self) {
        lock(&self.state.rules).clear();
    }

    /// How many frames a rule has applied to so far (0 once removed).
    pub fn hits(&self, id: RuleId) -> u64 {
        lock(&self.state.rules)
            .iter()
            .find(|r| r.id == id.0)
            .map(|r| r.hits)
            .unwrap_or(0)
    }

    /// Drop the next `n` frames going `dir` that match.
    pub fn drop_next(&self, dir: Dir, matcher: Match, n: u64) -> RuleId {
        self.add(Rule::drop(dir, matcher).times(n))
    }

    /// Drop every frame going `dir` that matches, until the rule is removed.
    pub fn drop_all(&self, dir: Dir, matcher: Match) -> RuleId {
        self.add(Rule::drop(dir, matcher))
    }

    /// Delay every frame going `dir` that matches by `by`.
    pub fn delay(&self, dir: Dir, matcher: Match, by: Duration) -> RuleId {
        self.add(Rule::delay(dir, matcher, by))
    }

    /// Deliver the next `n` frames going `dir` that match twice.
    pub fn duplicate_next(&self, dir: Dir, matcher: Match, n: u64) -> RuleId {
        self.add(Rule::duplicate(dir, matcher).times(n))
    }

    /// Reseed the generator behind [`Rule::chance`].
    pub fn seed(&self, seed: u64) {
        *lock(&self.state.rng) = SplitMix64::new(seed);
    }

    /// Cut every open connection now: both sockets are dropped without a close frame.
    /// Returns how many were cut.
    pub fn cut_all(&self) -> usize {
        self.state.cut_where(|_| true)
    }

    /// Cut the connections whose `hello` named this `worker_id`.
    pub fn cut_worker(&self, worker_id: &str) -> usize {
        self.state
            .cut_where(|c| c.worker_id.as_deref() == Some(worker_id))
    }

    /// Drop the peer side of the connections whose `hello` named `worker_id`, but keep
    /// their daemon side open and answering pings: the daemon still believes the old
    /// connection alive (a half-open connection) when the worker reconnects, so the
    /// new `hello` supersedes it. Returns how many were severed.
    pub fn half_open_worker(&self, worker_id: &str) -> usize {
        let conns = lock(&self.state.conns);
        let mut n = 0;
        for c in conns
            .values()
            .filter(|c| c.worker_id.as_deref() == Some(worker_id) && !c.sever.is_cancelled())
        {
            c.sever.cancel();
            n += 1;
        }
        self.state
            .counters
            .cut
            .fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Refuse new connections (their sockets are dropped at accept) until
    /// `refuse(false)`. Open connections are not touched.
    pub fn refuse(&self, on: bool) {
        let mut r = lock(&self.state.refusal);
        r.on = on;
        if !on {
            r.until = None;
        }
    }

    /// Refuse new connections for `d` from now.
    pub fn refuse_for(&self, d: Duration) {
        lock(&self.state.refusal).until = Some(Instant::now() + d);
    }

    /// Hold new connections: they are accepted but wait, before their WebSocket
    /// handshake, until `hold(false)`; then they proceed at once. Unlike refusing, the
    /// peer's connect attempt simply takes longer, so it reconnects the moment the
    /// hold ends instead of after its next backoff step.
    pub fn hold(&self, on: bool) {
        self.state.hold.send_replace(on);
    }

    /// Open connections right now.
    pub fn connections(&self) -> usize {
        lock(&self.state.conns)
            .values()
            .filter(|c| !c.cut.is_cancelled() && !c.sever.is_cancelled())
            .count()
    }

    /// Open connections whose `hello` named this `worker_id`.
    pub fn worker_connections(&self, worker_id: &str) -> usize {
        lock(&self.state.conns)
            .values()
            .filter(|c| {
                !c.cut.is_cancelled()
                    && !c.sever.is_cancelled()
                    && c.worker_id.as_deref() == Some(worker_id)
            })
            .count()
    }

    /// The counters so far.
    pub fn stats(&self) -> ProxyStats {
        let c = &self.state.counters;
        ProxyStats {
            connections: c.connections.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            upstream_failures: c.upstream_failures.load(Ordering::Relaxed),
            cut: c.cut.load(Ordering::Relaxed),
            forwarded: c.forwarded.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            delayed: c.delayed.load(Ordering::Relaxed),
            duplicated: c.duplicated.load(Ordering::Relaxed),
        }
    }

    /// Every text frame logged so far, in the order the proxy read them.
    pub fn frames(&self) -> Vec<LoggedFrame> {
        lock(&self.state.log).clone()
    }

    /// The logged frames going `dir` that match.
    pub fn frames_matching(&self, dir: Dir, matcher: &Match) -> Vec<LoggedFrame> {
        lock(&self.state.log)
            .iter()
            .filter(|f| f.dir == dir && matcher.matches(&f.frame))
            .cloned()
            .collect()
    }

    /// How many logged frames going `dir` match (whatever their fate).
    pub fn count(&self, dir: Dir, matcher: &Match) -> usize {
        lock(&self.state.log)
            .iter()
            .filter(|f| f.dir == dir && matcher.matches(&f.frame))
            .count()
    }

    /// Wait until at least `n` frames going `dir` that match were logged; false when
    /// `timeout` passed first.
    pub async fn wait_frames(
        &self,
        dir: Dir,
        matcher: &Match,
        n: usize,
        timeout: Duration,
    ) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let notified = self.state.logged.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.count(dir, matcher) >= n {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.count(dir, matcher) >= n;
            }
        }
    }
}
