//! Sessions waiting for a worker of a function: noted when a reservation finds no
//! free slot, taken oldest first when capacity appears.

use std::collections::VecDeque;
use std::sync::Arc;

use turnd_proto::Delivery;
use turnd_store::FunctionSettings;

use super::{FunctionEntry, Registry};

impl Registry {
    /// Note that a session waits for a worker of `function_id`.
    pub fn wait_for(&mut self, function_id: &str, session_id: &Arc<str>) {
        if self.waiting_for.get(&**session_id).map(|f| &**f) == Some(function_id) {
            return;
        }
        self.unwait(session_id);
        let name = match self.functions.get_key_value(function_id) {
            Some((name, _)) => name.clone(),
            None => Arc::from(function_id),
        };
        let f = self
            .functions
            .entry(name.clone())
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
        f.waiting.push_back(session_id.clone());
        self.waiting_for.insert(session_id.clone(), name);
    }

    /// The session no longer waits for a worker.
    pub fn not_waiting(&mut self, session_id: &str) {
        self.unwait(session_id);
    }

    /// Take the session out of `waiting_for`. A function that no worker registered
    /// and no session waits for any more is forgotten at once.
    pub(super) fn unwait(&mut self, session_id: &str) {
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

    /// Take up to `n` sessions waiting for `function_id`, oldest first.
    pub fn take_waiting(&mut self, function_id: &str, n: usize) -> Vec<Arc<str>> {
        let mut out = Vec::new();
        let Some(f) = self.functions.get_mut(function_id) else {
            return out;
        };
        while out.len() < n {
            let Some(s) = f.waiting.pop_front() else {
                break;
            };
            if self
                .waiting_for
                .get(&s)
                .is_some_and(|x| **x == *function_id)
            {
                self.waiting_for.remove(&s);
                f.waiters = f.waiters.saturating_sub(1);
                out.push(s);
            }
        }
        out
    }

    /// Sessions waiting for a function (for `functions.list`).
    pub(super) fn waiting_count(&self, function_id: &str) -> u64 {
        self.functions
            .get(function_id)
            .map_or(0, |f| f.waiters as u64)
    }
}
