//! The registry forgets workers and functions nothing refers to any more (see
//! [`Registry::gc`]): a task runs it every quarter of `worker_linger_ms` (at least
//! every 50 ms, at most every minute).

use super::*;

impl Engine {
    /// Start the registry's forgetting task.
    pub(super) fn spawn_registry_gc(&self) {
        let linger = self.inner.cfg.turns.worker_linger_ms;
        let every = Duration::from_millis((linger / 4).clamp(50, 60_000));
        self.every(every, move |engine| async move {
            let now = engine.now_ms();
            engine.registry().gc(now, linger);
        });
    }

    /// Workers and functions in the registry (for tests and diagnostics).
    pub fn registry_sizes(&self) -> (usize, usize) {
        self.registry().sizes()
    }
}
