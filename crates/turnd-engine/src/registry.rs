//! Connected workers, the functions they serve, and dispatch capacity.
//!
//! The registry is plain data behind one short `std` mutex: it never awaits and never
//! takes a session lock, so sessions may consult it while holding their own lock.
//! It records which invocations are assigned to which `worker_id`, so a disconnect
//! or a reconnect finds every invocation it must reconcile.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use turnd_store::FunctionSettings;

mod outbox;
#[cfg(test)]
mod tests;
mod views;
mod waiting;

pub(crate) use outbox::{event_frame, invoke_frame, push_frame};
pub use outbox::{CloseReason, Outbox};

/// A live invocation assigned to a worker.
#[derive(Debug, Clone)]
pub struct Assignment {
    pub session_id: String,
    pub function_id: String,
}

#[derive(Debug)]
pub struct WorkerEntry {
    pub worker_id: String,
    pub name: String,
    pub instance_id: String,
    pub outbox: Option<Outbox>,
    /// [`Outbox::opened`] of the last connection attached, kept after it ends: a
    /// `hello` on a connection opened before it is stale.
    pub opened: u64,
    pub since_ms: u64,
    /// Function → concurrency of this worker's registration.
    pub functions: BTreeMap<String, u32>,
    /// Function → invocations running on this worker.
    pub inflight: HashMap<String, u32>,
    /// Live invocations assigned to this worker_id.
    pub assigned: HashMap<String, Assignment>,
}

impl WorkerEntry {
    fn connected(&self) -> bool {
        self.outbox.is_some()
    }
}

#[derive(Debug)]
struct FunctionEntry {
    /// Whether a worker has registered the function; until then it is known only
    /// from sessions waiting for it and `settings`/`concurrency` are placeholders.
    registered: bool,
    settings: FunctionSettings,
    concurrency: u32,
    /// Sessions whose lock holder waits for a worker of this function, oldest first.
    /// May hold stale entries (`waiting_for` is the truth); compacted by [`Registry::gc`].
    waiting: VecDeque<Arc<str>>,
    /// Sessions in `waiting_for` that wait for this function.
    waiters: usize,
    /// When a connected worker last served it (or it was registered); the entry is
    /// forgotten `linger` after, once no session waits for it.
    served_ms: u64,
}

/// Who could run a function, for the reason of an `awaiting_worker` wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Supply {
    pub registered: bool,
    pub connected: u64,
    /// When a connected worker last served it (Unix ms; 0: never): with none
    /// connected, when the last one left.
    pub served_ms: u64,
}

/// A reserved dispatch slot.
#[derive(Debug, Clone)]
pub struct Reservation {
    pub worker_id: String,
    pub instance_id: String,
    pub outbox: Outbox,
    pub settings: FunctionSettings,
}

/// What a worker can do beyond what protocol v1 assumes of every worker. A worker
/// whose client has no probe, heartbeat or cancel (an iii-sdk worker) is attached
/// with [`WorkerCaps::NO_PROBE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerCaps {
    /// The worker answers `probe`. Without it, a passed attempt deadline is an
    /// unknown outcome at once.
    pub probe: bool,
    /// On `hello`, every live invocation assigned to the worker counts as listed in
    /// `inflight` (its client keeps handlers running across reconnects).
    pub keeps_inflight: bool,
}

impl WorkerCaps {
    pub const V1: WorkerCaps = WorkerCaps {
        probe: true,
        keeps_inflight: false,
    };
    pub const NO_PROBE: WorkerCaps = WorkerCaps {
        probe: false,
        keeps_inflight: true,
    };
}

impl Default for WorkerCaps {
    fn default() -> Self {
        WorkerCaps::V1
    }
}

/// Workers, functions and capacity.
#[derive(Debug, Default)]
pub struct Registry {
    workers: HashMap<String, WorkerEntry>,
    functions: BTreeMap<Arc<str>, FunctionEntry>,
    /// Round-robin cursor for picking among workers.
    cursor: usize,
    /// The function each waiting session's lock holder waits for. The per-function
    /// queues may hold stale entries; this map is the truth. Keys are the sessions'
    /// shared ids, values the keys of `functions`: no copy per waiting session.
    waiting_for: HashMap<Arc<str>, Arc<str>>,
    /// The latest time the registry was told (attach, detach, gc), for marking when
    /// a function was last served without a clock of its own.
    now_hint: u64,
    /// Workers attached with other than [`WorkerCaps::V1`].
    caps: HashMap<String, WorkerCaps>,
}

/// What a worker `hello` replaced.
pub struct Attached {
    /// The superseded connection, if the worker_id was connected.
    pub superseded: Option<Outbox>,
    /// Live invocations assigned to this worker_id, to reconcile, by invocation id.
    pub assigned: Vec<(String, Assignment)>,
}

impl Registry {
    /// Attach a worker connection (a `hello`). A connection already attached for the
    /// same worker_id is superseded; what it held stays assigned for reconciliation.
    pub fn attach(
        &mut self,
        worker_id: &str,
        name: &str,
        instance_id: &str,
        outbox: Outbox,
        now_ms: u64,
    ) -> Attached {
        let entry = self
            .workers
            .entry(worker_id.to_string())
            .or_insert_with(|| WorkerEntry {
                worker_id: worker_id.to_string(),
                name: name.to_string(),
                instance_id: instance_id.to_string(),
                outbox: None,
                opened: 0,
                since_ms: now_ms,
                functions: BTreeMap::new(),
                inflight: HashMap::new(),
                assigned: HashMap::new(),
            });
        self.now_hint = self.now_hint.max(now_ms);
        let superseded = entry.outbox.take();
        entry.functions.clear();
        entry.name = name.to_string();
        entry.instance_id = instance_id.to_string();
        entry.opened = outbox.opened();
        entry.outbox = Some(outbox);
        entry.since_ms = now_ms;
        let mut assigned: Vec<(String, Assignment)> = entry
            .assigned
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        // In a stable order, whatever the map's: the reconcile that follows writes
        // and pushes in this order, which a seeded simulation replays.
        assigned.sort_by(|a, b| a.0.cmp(&b.0));
        Attached {
            superseded,
            assigned,
        }
    }

    /// Whether a `hello` of `worker_id` on `outbox` is stale: the worker attached a
    /// connection opened after this one, so it has moved on (this `hello` was
    /// delayed on a connection it gave up), and its lists are older than those it
    /// reconciled with since.
    pub fn is_stale(&self, worker_id: &str, outbox: &Outbox) -> bool {
        self.workers
            .get(worker_id)
            .is_some_and(|e| e.opened > outbox.opened())
    }

    /// Set what a worker_id can do (kept across its connections).
    pub fn set_caps(&mut self, worker_id: &str, caps: WorkerCaps) {
        if caps == WorkerCaps::V1 {
            self.caps.remove(worker_id);
        } else {
            self.caps.insert(worker_id.to_string(), caps);
        }
    }

    pub fn caps(&self, worker_id: &str) -> WorkerCaps {
        self.caps.get(worker_id).copied().unwrap_or_default()
    }

    /// Detach a connection that ended. Returns false when the worker_id has a newer
    /// connection (this one was superseded) and nothing changed.
    pub fn detach(&mut self, worker_id: &str, conn_id: &str, now_ms: u64) -> bool {
        let Some(entry) = self.workers.get_mut(worker_id) else {
            return false;
        };
        match &entry.outbox {
            Some(o) if o.conn_id == conn_id => {
                entry.outbox = None;
                // What it served lingers from now (see `gc`).
                for f in entry.functions.keys() {
                    if let Some(fe) = self.functions.get_mut(f.as_str()) {
                        fe.served_ms = fe.served_ms.max(now_ms);
                    }
                }
                entry.functions.clear();
                entry.since_ms = now_ms;
                self.now_hint = self.now_hint.max(now_ms);
                true
            }
            _ => false,
        }
    }

    /// Record a worker known only from stored invocations (after a restart).
    pub fn remember_assignment(
        &mut self,
        worker_id: &str,
        instance_id: &str,
        invocation_id: &str,
        a: Assignment,
        now_ms: u64,
    ) {
        let entry = self
            .workers
            .entry(worker_id.to_string())
            .or_insert_with(|| WorkerEntry {
                worker_id: worker_id.to_string(),
                name: String::new(),
                instance_id: instance_id.to_string(),
                outbox: None,
                opened: 0,
                since_ms: now_ms,
                functions: BTreeMap::new(),
                inflight: HashMap::new(),
                assigned: HashMap::new(),
            });
        *entry.inflight.entry(a.function_id.clone()).or_insert(0) += 1;
        entry.assigned.insert(invocation_id.to_string(), a);
    }

    /// Register a function on a worker. Returns the number of connected workers now
    /// serving it.
    pub fn register(
        &mut self,
        worker_id: &str,
        function_id: &str,
        concurrency: u32,
        settings: FunctionSettings,
    ) -> u64 {
        if let Some(w) = self.workers.get_mut(worker_id) {
            w.functions.insert(function_id.to_string(), concurrency);
        }
        let f = self
            .functions
            .entry(Arc::from(function_id))
            .or_insert_with(|| FunctionEntry {
                registered: true,
                settings,
                concurrency,
                waiting: VecDeque::new(),
                waiters: 0,
                served_ms: 0,
            });
        if f.settings != settings || f.concurrency != concurrency {
            tracing::info!(
                function_id,
                worker_id,
                ?settings,
                concurrency,
                "function settings replaced by a new registration"
            );
        }
        f.registered = true;
        f.settings = settings;
        f.concurrency = concurrency;
        f.served_ms = f.served_ms.max(self.now_hint);
        self.serving(function_id)
    }

    pub fn unregister(&mut self, worker_id: &str, function_id: &str) -> bool {
        self.workers
            .get_mut(worker_id)
            .map(|w| w.functions.remove(function_id).is_some())
            .unwrap_or(false)
    }

    fn serving(&self, function_id: &str) -> u64 {
        self.workers
            .values()
            .filter(|w| w.connected() && w.functions.contains_key(function_id))
            .count() as u64
    }

    /// Reserve a slot on a connected worker serving `function_id` with free capacity;
    /// without one, the session is noted as waiting for the function.
    pub fn reserve(
        &mut self,
        function_id: &str,
        invocation_id: &str,
        session_id: &Arc<str>,
    ) -> Option<Reservation> {
        let Some(settings) = self.functions.get(function_id).map(|f| f.settings) else {
            self.wait_for(function_id, session_id);
            return None;
        };
        let mut candidates: Vec<&String> = self
            .workers
            .iter()
            .filter(|(_, w)| {
                w.outbox.as_ref().map(|o| !o.is_closed()).unwrap_or(false)
                    && w.functions
                        .get(function_id)
                        .map(|c| w.inflight.get(function_id).copied().unwrap_or(0) < *c)
                        .unwrap_or(false)
            })
            .map(|(k, _)| k)
            .collect();
        if candidates.is_empty() {
            // Noted in the same critical section as the failed reservation, so a
            // worker that registers right after wakes this session.
            self.wait_for(function_id, session_id);
            return None;
        }
        candidates.sort();
        self.cursor = self.cursor.wrapping_add(1);
        let id = candidates[self.cursor % candidates.len()].clone();
        self.unwait(session_id);
        let w = self.workers.get_mut(&id)?;
        *w.inflight.entry(function_id.to_string()).or_insert(0) += 1;
        w.assigned.insert(
            invocation_id.to_string(),
            Assignment {
                session_id: session_id.to_string(),
                function_id: function_id.to_string(),
            },
        );
        Some(Reservation {
            worker_id: w.worker_id.clone(),
            instance_id: w.instance_id.clone(),
            outbox: w.outbox.clone()?,
            settings,
        })
    }

    /// Free the slot of an invocation that ended (or whose dispatch was not written).
    /// Returns the function whose capacity grew, if any.
    pub fn release(&mut self, worker_id: &str, invocation_id: &str) -> Option<String> {
        let w = self.workers.get_mut(worker_id)?;
        let a = w.assigned.remove(invocation_id)?;
        if let Some(n) = w.inflight.get_mut(&a.function_id) {
            *n = n.saturating_sub(1);
        }
        Some(a.function_id)
    }

    /// The outbox of a worker if it is connected as `instance_id`.
    pub fn outbox_of(&self, worker_id: &str, instance_id: &str) -> Option<Outbox> {
        self.workers
            .get(worker_id)
            .filter(|w| w.instance_id == instance_id)
            .and_then(|w| w.outbox.clone())
            .filter(|o| !o.is_closed())
    }

    /// Forget what nothing refers to any more: a worker that is disconnected, has no
    /// live invocation and left `linger_ms` ago or more; a function no connected
    /// worker serves, no session waits for, and that was last served `linger_ms` ago
    /// or more. Also drops the stale entries of the functions' waiting queues.
    pub fn gc(&mut self, now_ms: u64, linger_ms: u64) {
        self.now_hint = self.now_hint.max(now_ms);
        let expired = |since: u64| now_ms.saturating_sub(since) >= linger_ms;
        self.workers
            .retain(|_, w| w.connected() || !w.assigned.is_empty() || !expired(w.since_ms));
        let workers = &self.workers;
        self.caps.retain(|id, _| workers.contains_key(id));
        let mut served: HashMap<&str, ()> = HashMap::new();
        for w in self.workers.values().filter(|w| w.connected()) {
            for f in w.functions.keys() {
                served.insert(f.as_str(), ());
            }
        }
        let mut gone = Vec::new();
        for (id, f) in self.functions.iter_mut() {
            if served.contains_key(&**id) {
                f.served_ms = f.served_ms.max(now_ms);
            } else if f.waiters == 0 && expired(f.served_ms) {
                gone.push(id.clone());
            }
        }
        for id in gone {
            self.functions.remove(&id);
        }
        let waiting_for = &self.waiting_for;
        for (id, f) in self.functions.iter_mut() {
            if f.waiting.len() > 2 * f.waiters + 16 {
                f.waiting
                    .retain(|s| waiting_for.get(s).is_some_and(|x| x == id));
            }
        }
    }

    /// Free slots for a function over connected workers.
    pub fn free_capacity(&self, function_id: &str) -> usize {
        self.workers
            .values()
            .filter(|w| w.connected())
            .filter_map(|w| {
                w.functions.get(function_id).map(|c| {
                    c.saturating_sub(w.inflight.get(function_id).copied().unwrap_or(0)) as usize
                })
            })
            .sum()
    }

    pub fn is_connected(&self, worker_id: &str, instance_id: &str) -> bool {
        self.outbox_of(worker_id, instance_id).is_some()
    }

    /// The session of a live invocation assigned to `worker_id`.
    pub fn assigned_session(&self, worker_id: &str, invocation_id: &str) -> Option<String> {
        self.workers
            .get(worker_id)?
            .assigned
            .get(invocation_id)
            .map(|a| a.session_id.clone())
    }

    /// Sessions of the live invocations assigned to a worker.
    pub fn assigned_sessions(&self, worker_id: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .workers
            .get(worker_id)
            .map(|w| w.assigned.values().map(|a| a.session_id.clone()).collect())
            .unwrap_or_default();
        v.sort();
        v.dedup();
        v
    }
}
