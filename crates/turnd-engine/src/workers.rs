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

use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard, RwLock};

use crate::registry::Registry;

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
