//! The limits a connection is held to: its place among the daemon's connections
//! (`server.max_connections`, `server.max_connections_per_ip`), its request rate
//! (`server.max_requests_per_second`, with the first result of each of its
//! invocations exempt), its requests in flight (`server.max_inflight_per_connection`)
//! and how deep a frame's JSON may nest (`server.max_json_depth`).

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use turnd_proto::{Op, RawRequest, Role};

use super::{Conn, ConnectionCounts};

/// A connection's place in the limits; released when dropped.
pub(super) struct Slot<'a> {
    counts: &'a ConnectionCounts,
    ip: IpAddr,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.counts.total.fetch_sub(1, Ordering::Relaxed);
        if let Ok(mut m) = self.counts.per_ip.lock() {
            if let Some(n) = m.get_mut(&self.ip) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    m.remove(&self.ip);
                }
            }
        }
    }
}

impl ConnectionCounts {
    /// Take a slot for a new connection from `ip`, or say which limit refuses it.
    pub(super) fn admit(
        &self,
        ip: IpAddr,
        max_total: u64,
        max_ip: u64,
    ) -> Result<Slot<'_>, String> {
        let total = self.total.fetch_add(1, Ordering::Relaxed) + 1;
        let mut m = self.per_ip.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(ip).or_insert(0);
        *n += 1;
        let per_ip = *n;
        drop(m);
        let slot = Slot { counts: self, ip };
        if total > max_total {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(format!(
                "the server holds its maximum of {max_total} connections (server.max_connections)"
            ));
        }
        if per_ip > max_ip {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(format!(
                "{ip} holds its maximum of {max_ip} connections (server.max_connections_per_ip)"
            ));
        }
        Ok(slot)
    }
}

/// A token bucket: `rate` requests per second, bursts up to `rate`.
#[derive(Debug)]
pub(super) struct Bucket {
    rate: f64,
    tokens: f64,
    at: tokio::time::Instant,
}

impl Bucket {
    /// The bucket of a `max_requests_per_second`; none when it is 0 (no limit).
    pub(super) fn new(rate: u64) -> Option<Bucket> {
        (rate > 0).then(|| Bucket {
            rate: rate as f64,
            tokens: rate as f64,
            at: tokio::time::Instant::now(),
        })
    }

    pub(super) fn take(&mut self) -> bool {
        let now = tokio::time::Instant::now();
        let dt = now.duration_since(self.at).as_secs_f64();
        self.at = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.rate);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Size at which a connection's set of exempted invocations (see
/// [`Exempted`]) first drops those no longer live.
const EXEMPTED_PRUNE_AT: usize = 4096;

/// The invocations whose first result on a connection was not counted against its
/// request rate (see [`Exempted::exempt`]). Invocation ids are never reused, so an
/// id that is no longer live can never be exempted again and is dropped when the set
/// reaches `prune_at`; after a prune the threshold is twice what stayed, so a worker
/// with thousands of live invocations does not make every exemption a full pass.
pub(super) struct Exempted {
    ids: HashSet<String>,
    prune_at: usize,
}

impl Exempted {
    pub(super) fn new() -> Exempted {
        Exempted {
            ids: HashSet::new(),
            prune_at: EXEMPTED_PRUNE_AT,
        }
    }

    /// Whether the request is the first `invocation.result` on this connection for
    /// a live invocation dispatched to this worker; such a result is not counted
    /// against the connection's request rate. The daemon dispatches no more than the
    /// concurrency the worker registered, and each invocation is exempted once (this
    /// set remembers it, whatever its result turned out to be), so the exemptions
    /// are bounded by the dispatches; refusing a result would only hold a finished
    /// step back until the worker resends it. Resends, malformed results and every
    /// other request are counted.
    pub(super) fn exempt(&mut self, conn: &Conn, req: &RawRequest<'_>) -> bool {
        #[derive(serde::Deserialize)]
        struct Id<'a> {
            #[serde(borrow)]
            invocation_id: std::borrow::Cow<'a, str>,
        }
        if req.op != Op::InvocationResult.name() {
            return false;
        }
        let Some(worker_id) = conn
            .auth
            .get()
            .filter(|a| a.role == Role::Worker)
            .and_then(|a| a.worker_id.as_deref())
        else {
            return false;
        };
        let Ok(a) = serde_json::from_str::<Id<'_>>(req.args_text()) else {
            return false;
        };
        let engine = &conn.shared.backend;
        if self.ids.contains(a.invocation_id.as_ref())
            || !engine.is_assigned(worker_id, &a.invocation_id)
        {
            return false;
        }
        if self.ids.len() >= self.prune_at {
            engine.retain_assigned(worker_id, &mut self.ids);
            self.prune_at = EXEMPTED_PRUNE_AT.max(2 * self.ids.len());
        }
        self.ids.insert(a.invocation_id.into_owned());
        true
    }
}

/// One request counted as in flight on its connection and in the daemon's total;
/// uncounted when dropped, however the request task ends.
pub(super) struct InFlight(pub(super) Arc<Conn>);

impl InFlight {
    /// Count a request, unless the connection already runs `max`.
    pub(super) fn take(conn: &Arc<Conn>, max: u64) -> Option<InFlight> {
        if conn.inflight.fetch_add(1, Ordering::Relaxed) >= max {
            conn.inflight.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        conn.shared
            .connections
            .requests_inflight
            .fetch_add(1, Ordering::Relaxed);
        Some(InFlight(conn.clone()))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
        self.0
            .shared
            .connections
            .requests_inflight
            .fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn bucket_refills_with_time() {
        assert!(Bucket::new(0).is_none(), "0 is no limit");
        let mut b = Bucket::new(2).expect("a bucket");
        assert!(b.take());
        assert!(b.take());
        assert!(!b.take());
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(b.take());
        assert!(!b.take());
    }
}
