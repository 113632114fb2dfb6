//! Workers: `hello` and the reconcile of a reconnecting worker's invocations, a
//! worker's disconnect, function registration, who may act on an invocation, and
//! the task that makes the registry forget what nothing refers to any more (see
//! [`crate::registry::Registry::gc`]).

use std::collections::HashSet;
use std::time::Duration;

use turnd_proto::{HelloArgs, Push, Reconciled, RegisterArgs, RegisterOk, Role};
use turnd_store::InvocationRecord;

use super::{check_id, read_failed, unavailable, ApiResult, Caller, Engine};
use crate::error::EngineError;
use crate::machine;
use crate::registry::{push_frame, Assignment, Outbox, WorkerCaps};
use crate::workers::AttachedWorker;

impl Engine {
    /// A worker `hello`: attach the connection (superseding an older one of the same
    /// worker_id) and reconcile every invocation assigned to this worker_id.
    pub async fn worker_hello(&self, hello: &HelloArgs, outbox: Outbox) -> ApiResult<Reconciled> {
        self.worker_hello_with(hello, outbox, WorkerCaps::V1).await
    }

    /// A worker `hello` for a worker that can do what `caps` says.
    pub async fn worker_hello_with(
        &self,
        hello: &HelloArgs,
        outbox: Outbox,
        caps: WorkerCaps,
    ) -> ApiResult<Reconciled> {
        let attached = self
            .inner
            .workers
            .attach(hello, outbox, caps, self.now_ms())?;
        match self.reconcile_worker(&attached).await {
            Ok(rec) => Ok(rec),
            Err(e) => {
                // The hello is refused: the connection must not stay attached.
                self.worker_disconnected(&attached.worker_id, &attached.conn_id)
                    .await;
                Err(e)
            }
        }
    }

    /// Reconcile the invocations of a worker that said hello ([`Workers::attach`])
    /// whose sessions this engine holds; those of other engines (other partitions of
    /// a cluster) are theirs to reconcile, and are neither listed nor cancelled here.
    pub async fn reconcile_worker(&self, attached: &AttachedWorker) -> ApiResult<Reconciled> {
        let assigned = attached
            .assigned
            .iter()
            .filter(|(_, a)| self.owns_session(&a.session_id))
            .cloned()
            .collect();
        self.reconcile(&attached.hello, &attached.instance_id, assigned)
            .await
    }

    /// Reconcile every invocation assigned to a worker_id that said hello.
    pub(super) async fn reconcile(
        &self,
        hello: &HelloArgs,
        instance_id: &str,
        assigned: Vec<(String, Assignment)>,
    ) -> ApiResult<Reconciled> {
        // Every session at once, so their writes share the group commit's syncs
        // (a worker with hundreds of invocations must not wait for as many syncs).
        let verdicts = futures_util::future::join_all(
            assigned
                .iter()
                .map(|(inv_id, a)| self.reconcile_one(hello, instance_id, inv_id, &a.session_id)),
        )
        .await;
        let mut rec = Reconciled::default();
        for ((inv_id, _), verdict) in assigned.into_iter().zip(verdicts) {
            match verdict? {
                Some(machine::Verdict::Kept) => rec.kept.push(inv_id),
                Some(machine::Verdict::Redispatched) => rec.redispatched.push(inv_id),
                Some(machine::Verdict::Unknown) => rec.unknown.push(inv_id),
                None => {}
            }
        }
        // Work the worker still runs that the daemon already gave up (stopped while
        // it was away, outcome unknown, superseded): tell it to stop, and list it.
        let worker_id = hello.worker_id.as_deref().unwrap_or("");
        for inv_id in hello.inflight.iter().filter(|i| self.owns_invocation(i)) {
            if rec.kept.contains(inv_id)
                || rec.redispatched.contains(inv_id)
                || rec.unknown.contains(inv_id)
            {
                continue;
            }
            let Ok(Some(inv)) = self.inner.store.invocation(inv_id) else {
                continue;
            };
            if inv.worker_id != worker_id || inv.is_active() {
                continue;
            }
            if let Some(o) = self.registry().outbox_of(worker_id, instance_id) {
                let frame = push_frame(&Push::Cancel {
                    invocation_id: inv_id.clone(),
                    reason: format!(
                        "the invocation was given up ({}) while the worker was away",
                        inv.state.as_str()
                    ),
                });
                if !o.push(frame) {
                    tracing::debug!(invocation_id = %inv_id, "cancel for a given-up invocation not queued");
                }
            }
            rec.unknown.push(inv_id.clone());
        }
        Ok(rec)
    }

    /// Reconcile one invocation assigned to a worker that said hello, in its
    /// session (None: it is not the session's live invocation any more).
    async fn reconcile_one(
        &self,
        hello: &HelloArgs,
        instance_id: &str,
        inv_id: &str,
        session_id: &str,
    ) -> ApiResult<Option<machine::Verdict>> {
        let cell = self.sessions().cell(session_id);
        let mut st = self.sessions().lock(&cell).await.map_err(read_failed)?;
        // The planted bug of the feature `planted-reconcile-skips-finished`: the
        // worker's `finished` list is not looked at.
        #[cfg(feature = "planted-reconcile-skips-finished")]
        let finished: &[String] = &[];
        #[cfg(not(feature = "planted-reconcile-skips-finished"))]
        let finished = &hello.finished;
        let (settled, verdict) = self.transition(&st, self.now_ms(), |cx, tx| {
            machine::reconcile(cx, tx, inv_id, instance_id, &hello.inflight, finished)
        });
        if verdict.is_some() {
            self.commit(&cell, &mut st, settled)
                .await
                .map_err(unavailable)?;
        }
        Ok(verdict)
    }

    /// A worker connection ended: every session with an invocation on it re-checks
    /// its worker (and starts waiting for the reconnect).
    pub async fn worker_disconnected(&self, worker_id: &str, conn_id: &str) {
        let Some(sessions) = self.inner.workers.detach(worker_id, conn_id, self.now_ms()) else {
            return;
        };
        self.drive_owned(&sessions).await;
    }

    /// Drive every one of `sessions` this engine holds, at once, so that their writes
    /// share the group commit's syncs.
    pub async fn drive_owned(&self, sessions: &[String]) {
        futures_util::future::join_all(
            sessions
                .iter()
                .filter(|s| self.owns_session(s))
                .map(|s| self.drive(s)),
        )
        .await;
    }

    /// `function.register`.
    pub fn register(&self, worker_id: &str, args: &RegisterArgs) -> ApiResult<RegisterOk> {
        self.inner
            .workers
            .register(worker_id, args, self.inner.cfg.turns.default_timeout_ms)
    }

    /// `function.unregister`.
    pub fn unregister(&self, worker_id: &str, function_id: &str) -> ApiResult<()> {
        self.inner.workers.unregister(worker_id, function_id)
    }

    /// Look up an invocation and check the caller may act on it.
    pub(super) fn invocation_for(
        &self,
        caller: &Caller,
        invocation_id: &str,
    ) -> ApiResult<Option<InvocationRecord>> {
        check_id("invocation_id", invocation_id)?;
        let Some(inv) = self
            .inner
            .store
            .invocation(invocation_id)
            .map_err(read_failed)?
        else {
            return Ok(None);
        };
        if let Some(w) = &caller.worker_id {
            if caller.role == Role::Worker && inv.worker_id != *w {
                return Err(EngineError::NotYourInvocation {
                    invocation_id: invocation_id.to_string(),
                    worker_id: w.clone(),
                });
            }
        }
        Ok(Some(inv))
    }

    /// Whether `invocation_id` is live and dispatched to `worker_id` (a registry
    /// lookup; no store read).
    pub fn is_assigned(&self, worker_id: &str, invocation_id: &str) -> bool {
        self.inner.workers.is_assigned(worker_id, invocation_id)
    }

    /// Keep only the invocation ids that are live and dispatched to `worker_id`.
    pub fn retain_assigned(&self, worker_id: &str, ids: &mut HashSet<String>) {
        self.inner.workers.retain_assigned(worker_id, ids);
    }

    /// The session of an invocation the caller may act on (`None`: no such
    /// invocation). A worker's own live invocation is found in the registry's
    /// assignments, which also prove it may report it, without a store read (a sled
    /// read waits for any group commit being applied); anything else is looked up in
    /// the store by [`Engine::invocation_for`].
    pub(super) fn invocation_session(
        &self,
        caller: &Caller,
        invocation_id: &str,
    ) -> ApiResult<Option<String>> {
        if let (Role::Worker, Some(w)) = (caller.role, caller.worker_id.as_deref()) {
            if let Some(s) = self.registry().assigned_session(w, invocation_id) {
                return Ok(Some(s));
            }
        }
        Ok(self
            .invocation_for(caller, invocation_id)?
            .map(|rec| rec.session_id))
    }

    /// Start the registry's forgetting task: every quarter of `worker_linger_ms`
    /// (at least every 50 ms, at most every minute).
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
