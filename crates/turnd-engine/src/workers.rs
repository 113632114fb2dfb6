//! The worker registry as a handle that engines share.
//!
//! A worker connection's concurrency is the connection's, whatever session a
//! dispatch is for, so every engine that dispatches to the workers of one node uses
//! one [`Workers`]: the [`Registry`] behind its short mutex, and the hook through
//! which the registry hands back the sessions that waited for a worker when capacity
//! frees or a function is registered. A session is driven by the engine that holds
//! it, so the hook is the node's to set: with one engine, the engine sets it to
//! drive the session itself ([`crate::Engine::open`]); a node with several engines
//! sets one that hands each session to its own engine.

use std::collections::HashSet;
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard, RwLock};
use turnd_proto::{Function, HelloArgs, RegisterArgs, RegisterOk, Worker};
use turnd_store::FunctionSettings;

use crate::error::{EngineError, EngineResult};
use crate::registry::{Assignment, CloseReason, Outbox, Registry, WorkerCaps};

/// What the registry calls with each session it hands back to be driven.
pub type WakeHook = Arc<dyn Fn(Arc<str>) + Send + Sync>;

/// The shared worker registry (see the module doc). Cloning it shares it.
#[derive(Clone, Default)]
pub struct Workers {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    registry: Mutex<Registry>,
    wake: RwLock<Option<WakeHook>>,
}

impl Workers {
    /// An empty registry with no hook yet.
    pub fn new() -> Workers {
        Workers::default()
    }

    /// Drive the sessions the registry hands back with `hook` (in place of any
    /// hook set before).
    pub fn on_wake(&self, hook: WakeHook) {
        *self.shared.wake.write() = Some(hook);
    }

    /// [`Workers::on_wake`], unless a hook is set already. Whether it was set.
    pub(crate) fn on_wake_unless_set(&self, hook: impl FnOnce() -> WakeHook) -> bool {
        let mut wake = self.shared.wake.write();
        if wake.is_some() {
            return false;
        }
        *wake = Some(hook());
        true
    }

    /// The registry, locked. Never held across an await or a session's lock.
    pub(crate) fn registry(&self) -> MutexGuard<'_, Registry> {
        self.shared.registry.lock()
    }

    /// Attach a worker connection that said `hello` (superseding, and closing, an
    /// older connection of the same worker_id): who it is, and the live invocations
    /// assigned to its worker_id, which the engines holding their sessions then
    /// reconcile. A worker that keeps its handlers across reconnects is taken to
    /// still run every one of them (its `hello` lists them all).
    pub fn attach(
        &self,
        hello: &HelloArgs,
        outbox: Outbox,
        caps: WorkerCaps,
        now_ms: u64,
    ) -> EngineResult<AttachedWorker> {
        let worker_id = hello.worker_id.as_deref().ok_or(EngineError::NoWorkerId)?;
        crate::error::check_id("worker_id", worker_id)?;
        let instance_id = hello
            .instance_id
            .clone()
            .unwrap_or_else(|| outbox.conn_id.clone());
        let name = hello.name.clone().unwrap_or_else(|| worker_id.to_string());
        let conn_id = outbox.conn_id.clone();
        let attached = {
            let mut reg = self.registry();
            if reg.is_stale(worker_id, &outbox) {
                return Err(EngineError::StaleHello(worker_id.to_string()));
            }
            reg.set_caps(worker_id, caps);
            reg.attach(worker_id, &name, &instance_id, outbox, now_ms)
        };
        if let Some(old) = attached.superseded {
            tracing::info!(worker_id, old_conn = %old.conn_id, "worker connection superseded by a new hello");
            old.close_with(CloseReason::Superseded);
        }
        let mut hello = hello.clone();
        if caps.keeps_inflight {
            hello
                .inflight
                .extend(attached.assigned.iter().map(|(id, _)| id.clone()));
        }
        Ok(AttachedWorker {
            hello,
            worker_id: worker_id.to_string(),
            instance_id,
            conn_id,
            assigned: attached.assigned,
        })
    }

    /// A worker connection ended: the sessions with an invocation assigned to its
    /// worker_id, for their engines to drive (they start waiting for the
    /// reconnect); None when `conn_id` was not the worker's attached connection.
    pub fn detach(&self, worker_id: &str, conn_id: &str, now_ms: u64) -> Option<Vec<String>> {
        let mut reg = self.registry();
        if !reg.detach(worker_id, conn_id, now_ms) {
            return None;
        }
        Some(reg.assigned_sessions(worker_id))
    }

    /// `function.register` by `worker_id`, with `default_timeout_ms` for a
    /// registration without one; sessions waiting for the function are handed to
    /// the wake hook.
    pub fn register(
        &self,
        worker_id: &str,
        args: &RegisterArgs,
        default_timeout_ms: u64,
    ) -> EngineResult<RegisterOk> {
        crate::error::check_id("function_id", &args.function_id)?;
        let concurrency = args.concurrency.unwrap_or(1);
        if concurrency == 0 || concurrency > 10_000 {
            return Err(EngineError::out_of_range("concurrency", "1 to 10000"));
        }
        let timeout_ms = args.timeout_ms.unwrap_or(default_timeout_ms);
        if timeout_ms == 0 {
            return Err(EngineError::out_of_range("timeout_ms", "positive"));
        }
        let delivery = args.delivery.unwrap_or_default();
        let max_attempts = args.max_attempts.unwrap_or(delivery.default_max_attempts());
        if max_attempts == 0 || max_attempts > 1000 {
            return Err(EngineError::out_of_range("max_attempts", "1 to 1000"));
        }
        let workers = self.registry().register(
            worker_id,
            &args.function_id,
            concurrency,
            FunctionSettings {
                timeout_ms,
                delivery,
                max_attempts,
            },
        );
        self.wake(&args.function_id);
        Ok(RegisterOk {
            function_id: args.function_id.clone(),
            workers,
        })
    }

    /// `function.unregister`.
    pub fn unregister(&self, worker_id: &str, function_id: &str) -> EngineResult<()> {
        if self.registry().unregister(worker_id, function_id) {
            Ok(())
        } else {
            Err(EngineError::NotRegistered {
                function_id: function_id.to_string(),
            })
        }
    }

    /// Whether `invocation_id` is live and dispatched to `worker_id`.
    pub fn is_assigned(&self, worker_id: &str, invocation_id: &str) -> bool {
        self.registry()
            .assigned_session(worker_id, invocation_id)
            .is_some()
    }

    /// Keep only the invocation ids that are live and dispatched to `worker_id`.
    pub fn retain_assigned(&self, worker_id: &str, ids: &mut HashSet<String>) {
        let registry = self.registry();
        ids.retain(|id| registry.assigned_session(worker_id, id).is_some());
    }

    /// `workers.list`, as this registry knows them.
    pub fn workers(&self) -> Vec<Worker> {
        self.registry().workers()
    }

    /// Who could run `function_id` now, as this registry knows it.
    pub fn supply(&self, function_id: &str) -> crate::registry::Supply {
        self.registry().supply(function_id)
    }

    /// `functions.list`, as this registry knows them.
    pub fn functions(&self) -> Vec<Function> {
        self.registry().functions()
    }

    /// Whether the worker connection (worker and instance) is attached.
    pub fn is_connected(&self, worker_id: &str, instance_id: &str) -> bool {
        self.registry().is_connected(worker_id, instance_id)
    }

    /// Capacity for `function_id` may have grown: take as many of the sessions
    /// waiting for it as there are free slots, oldest first, and hand each to the
    /// hook.
    pub(crate) fn wake(&self, function_id: &str) {
        let sessions = {
            let mut reg = self.registry();
            let free = reg.free_capacity(function_id);
            reg.take_waiting(function_id, free)
        };
        if sessions.is_empty() {
            return;
        }
        let Some(hook) = self.shared.wake.read().clone() else {
            tracing::warn!(
                function_id,
                "sessions waiting for a worker, and no hook to drive them"
            );
            return;
        };
        for s in sessions {
            hook(s);
        }
    }
}

/// A worker connection attached ([`Workers::attach`]): its `hello` (with every
/// assigned invocation in `inflight` when it keeps its handlers across reconnects),
/// and what its engines reconcile.
pub struct AttachedWorker {
    pub hello: HelloArgs,
    pub worker_id: String,
    pub instance_id: String,
    pub conn_id: String,
    /// Live invocations assigned to the worker_id, with their sessions.
    pub assigned: Vec<(String, Assignment)>,
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use parking_lot::Mutex;
    use turnd_proto::Delivery;
    use turnd_store::FunctionSettings;

    use super::{WakeHook, Workers};
    use crate::registry::Outbox;

    fn recorder() -> (Arc<Mutex<Vec<String>>>, WakeHook) {
        let woken = Arc::new(Mutex::new(Vec::new()));
        let into = woken.clone();
        let hook: WakeHook = Arc::new(move |s: Arc<str>| into.lock().push(s.to_string()));
        (woken, hook)
    }

    #[test]
    fn freed_capacity_hands_the_oldest_waiting_sessions_to_the_hook() {
        let workers = Workers::new();
        let (woken, hook) = recorder();
        workers.on_wake(hook);
        let (outbox, _rx) = Outbox::new("c1".into(), 4);
        {
            let mut reg = workers.registry();
            for s in ["s1", "s2", "s3"] {
                reg.wait_for("f", &Arc::from(s));
            }
            reg.attach("w1", "w1", "i1", outbox, 0);
            let settings = FunctionSettings {
                timeout_ms: 1_000,
                delivery: Delivery::AtMostOnce,
                max_attempts: 1,
            };
            reg.register("w1", "f", 2, settings);
        }
        workers.wake("f");
        assert_eq!(*woken.lock(), ["s1", "s2"], "two free slots, oldest first");
        // Nobody took a slot: the next wake hands back the rest.
        workers.wake("f");
        assert_eq!(*woken.lock(), ["s1", "s2", "s3"]);
    }

    #[test]
    fn a_hook_set_first_is_kept() {
        let workers = Workers::new();
        let (woken, hook) = recorder();
        workers.on_wake(hook);
        let (_, other) = recorder();
        assert!(!workers.on_wake_unless_set(|| other));
        workers.registry().wait_for("f", &Arc::from("s1"));
        let (outbox, _rx) = Outbox::new("c1".into(), 4);
        workers.registry().attach("w1", "w1", "i1", outbox, 0);
        let settings = FunctionSettings {
            timeout_ms: 1_000,
            delivery: Delivery::AtMostOnce,
            max_attempts: 1,
        };
        workers.registry().register("w1", "f", 1, settings);
        workers.wake("f");
        assert_eq!(*woken.lock(), ["s1"]);
    }
}
