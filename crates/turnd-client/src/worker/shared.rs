//! What a running worker's tasks share: the invocations still running and the
//! results not yet acknowledged, each one's home (the connection its requests go
//! on while that is up), the connections it serves on, its
//! counters, and the trackers of its tasks. Holding a result (and starting its
//! delivery) and releasing it are the two changes of the tables outside a push.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::warn;
use turnd_proto::{Outcome, Reconciled};

use super::results::pump_result;
use super::{WorkerOptions, WorkerStats};
use crate::connection::{lock, Connection};

#[derive(Default)]
pub(super) struct Counters {
    pub(super) invocations_started: AtomicU64,
    pub(super) results_sent: AtomicU64,
    pub(super) results_resent: AtomicU64,
    pub(super) results_acked: AtomicU64,
    pub(super) results_dropped: AtomicU64,
    pub(super) connections: AtomicU64,
}

pub(super) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// A result waiting for its acknowledgement.
pub(super) struct Unacked {
    /// Wakes the result's pump to send it again now.
    pub(super) resend_now: Arc<Notify>,
}

#[derive(Default)]
pub(super) struct Tables {
    /// Handlers still running, with their cancel tokens.
    pub(super) running: HashMap<String, CancellationToken>,
    /// Results not yet acknowledged.
    pub(super) unacked: HashMap<String, Unacked>,
    /// Each running or held invocation's home: the index of the URL whose daemon
    /// last pushed about it (the one that waits for it).
    pub(super) homes: HashMap<String, usize>,
}
/// Failed connection attempts since the last successful one.
#[derive(Default)]
pub(super) struct Attempts {
    pub(super) failed: u64,
    pub(super) last_error: Option<String>,
}

/// A connection the worker serves on (hello and registrations done); its
/// generation is unique among all the worker's connections.
#[derive(Clone)]
pub(super) struct Link {
    /// The index of its URL (0: `url`, then `also`).
    pub(super) index: usize,
    pub(super) generation: u64,
    pub(super) conn: Connection,
}

pub(super) struct WorkerShared {
    pub(super) opts: WorkerOptions,
    pub(super) tables: Mutex<Tables>,
    /// The connections it serves on now, by the index of their URL (0: `url`, then
    /// `also`).
    pub(super) link: watch::Sender<BTreeMap<usize, Link>>,
    /// The last generation given to a connection.
    pub(super) generations: AtomicU64,
    pub(super) counters: Counters,
    pub(super) reconciled: Mutex<Option<Reconciled>>,
    pub(super) attempts: Mutex<Attempts>,
    pub(super) shutdown: CancellationToken,
    /// Result pumps and status answers; drained on shutdown.
    pub(super) pumps: TaskTracker,
    /// Handler tasks; cancelled (not awaited) on shutdown.
    pub(super) handlers: TaskTracker,
}

impl WorkerShared {
    /// The connection an invocation's requests go on now: its home's while that is
    /// up, else any live one; and whether it is its home's (or it has none).
    pub(super) fn connection_for(&self, invocation_id: &str) -> Option<(Connection, bool)> {
        let home = self.home(invocation_id);
        self.pick(&self.link.borrow(), home, &HashSet::new())
            .map(|l| (l.conn, home.is_none_or(|h| h == l.index)))
    }

    /// `home`'s link when it is up, else any live one; none whose generation is in
    /// `skip`.
    pub(super) fn pick(
        &self,
        links: &BTreeMap<usize, Link>,
        home: Option<usize>,
        skip: &HashSet<u64>,
    ) -> Option<Link> {
        let ok = |l: &&Link| !skip.contains(&l.generation);
        home.and_then(|h| links.get(&h).filter(ok))
            .or_else(|| links.values().find(ok))
            .cloned()
    }

    /// The index of the URL whose daemon last pushed about `invocation_id`.
    pub(super) fn home(&self, invocation_id: &str) -> Option<usize> {
        lock(&self.tables).homes.get(invocation_id).copied()
    }

    /// The daemon at URL `index` pushed about `invocation_id`: that is where its
    /// requests go from now on, while the worker runs it or holds its result.
    pub(super) fn note_home(&self, invocation_id: &str, index: usize) {
        let mut tables = lock(&self.tables);
        if tables.running.contains_key(invocation_id) || tables.unacked.contains_key(invocation_id)
        {
            tables.homes.insert(invocation_id.to_string(), index);
        }
    }

    /// Every URL the worker connects to.
    pub(super) fn urls(&self) -> Vec<String> {
        let mut urls = vec![self.opts.url.clone()];
        urls.extend(self.opts.also.iter().cloned());
        urls
    }

    /// Take a result for delivery: the invocation is no longer running, its outcome is
    /// held until acknowledged, and a pump delivers it.
    pub(super) fn hold_result(self: &Arc<Self>, invocation_id: String, outcome: Outcome) {
        let resend_now = Arc::new(Notify::new());
        {
            let mut tables = lock(&self.tables);
            tables.running.remove(&invocation_id);
            let previous = tables.unacked.insert(
                invocation_id.clone(),
                Unacked {
                    resend_now: resend_now.clone(),
                },
            );
            if previous.is_some() {
                warn!(%invocation_id, "replacing a held result for the same invocation");
            }
        }
        let shared = self.clone();
        self.pumps
            .spawn(pump_result(shared, invocation_id, outcome, resend_now));
    }

    /// Forget a held result, but only if it is still the one this pump delivers.
    pub(super) fn release_result(&self, invocation_id: &str, resend_now: &Arc<Notify>) {
        let mut tables = lock(&self.tables);
        if let Some(held) = tables.unacked.get(invocation_id) {
            if Arc::ptr_eq(&held.resend_now, resend_now) {
                tables.unacked.remove(invocation_id);
                if !tables.running.contains_key(invocation_id) {
                    tables.homes.remove(invocation_id);
                }
            }
        }
    }

    pub(super) fn snapshot(&self) -> WorkerStats {
        let c = &self.counters;
        WorkerStats {
            invocations_started: c.invocations_started.load(Ordering::Relaxed),
            results_sent: c.results_sent.load(Ordering::Relaxed),
            results_resent: c.results_resent.load(Ordering::Relaxed),
            results_acked: c.results_acked.load(Ordering::Relaxed),
            results_dropped: c.results_dropped.load(Ordering::Relaxed),
            connections: c.connections.load(Ordering::Relaxed),
        }
    }
}
