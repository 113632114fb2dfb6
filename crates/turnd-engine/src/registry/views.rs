//! What the registry shows: the worker and function lists of `workers.list` and
//! `functions.list`, and the counts of the stats and the wait reasons.

use turnd_proto::{Function, Worker};

use super::{Registry, Supply};

impl Registry {
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
            served_ms: self.functions.get(function_id).map_or(0, |f| f.served_ms),
        }
    }

    pub fn functions(&self) -> Vec<Function> {
        self.functions
            .iter()
            .filter(|(id, f)| f.concurrency > 0 || self.waiting_count(id) > 0)
            .map(|(id, f)| Function {
                function_id: id.to_string(),
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

    /// Entries of the registry, for tests: (workers, functions).
    pub fn sizes(&self) -> (usize, usize) {
        (self.workers.len(), self.functions.len())
    }
}
