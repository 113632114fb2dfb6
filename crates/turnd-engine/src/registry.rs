//! Connected workers, the functions they serve, and dispatch capacity.
//!
//! The registry is plain data behind one short `std` mutex: it never awaits and never
//! takes a session lock, so sessions may consult it while holding their own lock.
//! It records which invocations are assigned to which `worker_id`, so a disconnect
//! or a reconnect finds every invocation it must reconcile.

use std::collections::{BTreeMap, HashMap, VecDeque};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use turnd_proto::{Delivery, Function, Worker};
use turnd_store::FunctionSettings;

/// Why an outgoing frame is sent; the connection task closes with the right code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    /// Superseded by a newer connection of the same worker_id (code 4001).
    Superseded,
    /// Its outgoing queue overflowed: the peer does not read fast enough.
    SlowReader,
    /// A watch's replay could not read the store (code 1011).
    Unavailable,
    /// The connection's reading side ended (the peer closed it or it failed): the
    /// writer stops without a close frame of its own.
    ReaderEnded,
    /// The daemon is shutting down (code 1001).
    ServerClosing,
}

/// The sending side of one connection: a bounded queue of text frames. A peer that
/// cannot keep up is disconnected instead of making the daemon buffer without bound.
#[derive(Debug, Clone)]
pub struct Outbox {
    pub conn_id: String,
    tx: mpsc::Sender<String>,
    close: CancellationToken,
    reason: std::sync::Arc<parking_lot::Mutex<Option<CloseReason>>>,
}

impl Outbox {
    /// A new outbox holding at most `capacity` frames, and its receiving side.
    pub fn new(conn_id: String, capacity: usize) -> (Outbox, mpsc::Receiver<String>) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        (
            Outbox {
                conn_id,
                tx,
                close: CancellationToken::new(),
                reason: Default::default(),
            },
            rx,
        )
    }

    /// Queue a frame without waiting. Returns false (and closes the connection when the
    /// queue is full) if it could not be queued.
    pub fn push(&self, frame: String) -> bool {
        // Nothing more once closed: a frame queued after one that was refused would
        // reach the peer past a gap, and it resumes after the last event it saw.
        if self.close.is_cancelled() {
            return false;
        }
        match self.tx.try_send(frame) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.close_with(CloseReason::SlowReader);
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    /// Queue a frame, waiting for room (responses: the request task may wait).
    pub async fn send(&self, frame: String) -> bool {
        self.tx.send(frame).await.is_ok()
    }

    pub fn close_with(&self, reason: CloseReason) {
        {
            let mut r = self.reason.lock();
            r.get_or_insert(reason);
        }
        self.close.cancel();
    }

    /// Resolves when the connection must close.
    pub fn closed(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.close.cancelled()
    }

    pub fn close_reason(&self) -> Option<CloseReason> {
        *self.reason.lock()
    }

    pub fn is_closed(&self) -> bool {
        self.close.is_cancelled() || self.tx.is_closed()
    }
}

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
    waiting: VecDeque<String>,
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
    functions: BTreeMap<String, FunctionEntry>,
    /// Round-robin cursor for picking among workers.
    cursor: usize,
    /// The function each waiting session's lock holder waits for. The per-function
    /// queues may hold stale entries; this map is the truth.
    waiting_for: HashMap<String, String>,
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
    /// Live invocations assigned to this worker_id, to reconcile.
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
        entry.outbox = Some(outbox);
        entry.since_ms = now_ms;
        let assigned = entry
            .assigned
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Attached {
            superseded,
            assigned,
        }
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
                    if let Some(fe) = self.functions.get_mut(f) {
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
            .entry(function_id.to_string())
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
        session_id: &str,
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

    /// Note that a session waits for a worker of `function_id`.
    pub fn wait_for(&mut self, function_id: &str, session_id: &str) {
        if self.waiting_for.get(session_id).map(String::as_str) == Some(function_id) {
            return;
        }
        self.unwait(session_id);
        let f = self
            .functions
            .entry(function_id.to_string())
            .or_insert_with(|| FunctionEntry {
                registered: false,
                settings: FunctionSettings {
                    timeout_ms: 0,
                    delivery: Delivery::AtMostOnce,
                    max_attempts: 1,
                },
                concurrency: 0,
                waiting: VecDeque::new(),
                waiters: 0,
                served_ms: 0,
            });
        f.waiters += 1;
        f.waiting.push_back(session_id.to_string());
        self.waiting_for
            .insert(session_id.to_string(), function_id.to_string());
    }

    /// The session no longer waits for a worker.
    pub fn not_waiting(&mut self, session_id: &str) {
        self.unwait(session_id);
    }

    /// Take the session out of `waiting_for`. A function that no worker registered
    /// and no session waits for any more is forgotten at once.
    fn unwait(&mut self, session_id: &str) {
        let Some(function_id) = self.waiting_for.remove(session_id) else {
            return;
        };
        if let Some(f) = self.functions.get_mut(&function_id) {
            f.waiters = f.waiters.saturating_sub(1);
            if f.waiters == 0 && !f.registered {
                self.functions.remove(&function_id);
            }
        }
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
            if served.contains_key(id.as_str()) {
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

    /// Entries of the registry, for tests: (workers, functions).
    pub fn sizes(&self) -> (usize, usize) {
        (self.workers.len(), self.functions.len())
    }

    /// Take up to `n` sessions waiting for `function_id`, oldest first.
    pub fn take_waiting(&mut self, function_id: &str, n: usize) -> Vec<String> {
        let mut out = Vec::new();
        let Some(f) = self.functions.get_mut(function_id) else {
            return out;
        };
        while out.len() < n {
            let Some(s) = f.waiting.pop_front() else {
                break;
            };
            if self.waiting_for.get(&s).map(|x| x == function_id) == Some(true) {
                self.waiting_for.remove(&s);
                f.waiters = f.waiters.saturating_sub(1);
                out.push(s);
            }
        }
        out
    }

    /// Sessions waiting for a function (for `functions.list`).
    fn waiting_count(&self, function_id: &str) -> u64 {
        self.functions
            .get(function_id)
            .map_or(0, |f| f.waiters as u64)
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

    pub fn connected_count(&self) -> u64 {
        self.workers.values().filter(|w| w.connected()).count() as u64
    }

    pub fn workers(&self) -> Vec<Worker> {
        let mut out: Vec<Worker> = self
            .workers
            .values()
            .map(|w| Worker {
                worker_id: w.worker_id.clone(),
                name: w.name.clone(),
                connected: w.connected(),
                instance_id: w.instance_id.clone(),
                since_ms: w.since_ms,
                functions: w.functions.keys().cloned().collect(),
                inflight: w.assigned.len() as u64,
            })
            .collect();
        out.sort_by(|a, b| a.worker_id.cmp(&b.worker_id));
        out
    }

    /// Who could run `function_id`: whether any worker registered it since start-up,
    /// and how many connected workers serve it now.
    pub fn supply(&self, function_id: &str) -> Supply {
        Supply {
            registered: self
                .functions
                .get(function_id)
                .is_some_and(|f| f.registered),
            connected: self.serving(function_id),
        }
    }

    pub fn functions(&self) -> Vec<Function> {
        self.functions
            .iter()
            .filter(|(id, f)| f.concurrency > 0 || self.waiting_count(id) > 0)
            .map(|(id, f)| Function {
                function_id: id.clone(),
                concurrency: f.concurrency,
                timeout_ms: f.settings.timeout_ms,
                delivery: f.settings.delivery,
                max_attempts: f.settings.max_attempts,
                workers: self.serving(id),
                queued: self.waiting_count(id),
                registered: f.registered,
            })
            .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> FunctionSettings {
        FunctionSettings {
            timeout_ms: 5_000,
            delivery: Delivery::AtLeastOnce,
            max_attempts: 3,
        }
    }

    #[test]
    fn a_function_known_only_from_a_waiting_session_is_listed_as_unregistered() {
        let mut r = Registry::default();
        assert!(r.reserve("ghost", "i_1", "s-1").is_none());
        let fs = r.functions();
        assert_eq!(fs.len(), 1);
        assert_eq!(fs[0].function_id, "ghost");
        assert!(!fs[0].registered);
        assert_eq!((fs[0].queued, fs[0].workers), (1, 0));

        // A registration (even by a worker that is not connected) makes its settings
        // real, and they stay after the session stops waiting.
        r.register("w-1", "ghost", 2, settings());
        r.not_waiting("s-1");
        let fs = r.functions();
        assert_eq!(fs.len(), 1);
        assert!(fs[0].registered);
        assert_eq!(fs[0].concurrency, 2);
        assert_eq!(fs[0].max_attempts, 3);
    }

    #[test]
    fn what_nothing_refers_to_is_forgotten_after_the_linger() {
        let mut r = Registry::default();
        let (outbox, _rx) = Outbox::new("c_1".into(), 4);
        r.attach("w-1", "w", "i-1", outbox, 1_000);
        r.register("w-1", "f", 1, settings());
        // A session waits for a function nobody registered, then stops waiting.
        r.wait_for("ghost", "s-1");
        assert_eq!(r.sizes(), (1, 2));
        r.not_waiting("s-1");
        assert_eq!(r.sizes(), (1, 1), "an unregistered function goes at once");
        // Connected: kept however long.
        r.gc(1_000_000, 500);
        assert_eq!(r.sizes(), (1, 1));
        // Gone at 2_000: listed until the linger has passed, with a live invocation
        // keeping the worker.
        let (outbox, _rx2) = Outbox::new("c_2".into(), 4);
        r.attach("w-1", "w", "i-1", outbox, 1_000_500);
        r.register("w-1", "f", 1, settings());
        assert!(r.reserve("f", "inv-1", "s-2").is_some());
        assert!(r.detach("w-1", "c_2", 1_002_000));
        r.gc(1_002_400, 500);
        assert_eq!(r.sizes(), (1, 1));
        r.gc(1_002_500, 500);
        assert_eq!(
            r.sizes(),
            (1, 0),
            "the function went; the worker holds inv-1"
        );
        r.release("w-1", "inv-1");
        r.gc(1_002_600, 500);
        assert_eq!(r.sizes(), (0, 0));
    }
}
