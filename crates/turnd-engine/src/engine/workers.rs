//! Workers: `hello` and the reconcile of a reconnecting worker's invocations, a
//! worker's disconnect, and function registration.

use super::*;
use crate::registry::WorkerCaps;

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
        let worker_id = hello
            .worker_id
            .as_deref()
            .ok_or_else(|| err(ErrorCode::BadRequest, "a worker `hello` needs `worker_id`"))?;
        check_id("worker_id", worker_id)?;
        let instance_id = hello
            .instance_id
            .clone()
            .unwrap_or_else(|| outbox.conn_id.clone());
        let name = hello.name.clone().unwrap_or_else(|| worker_id.to_string());
        let conn_id = outbox.conn_id.clone();
        let attached = {
            let mut reg = self.registry();
            reg.set_caps(worker_id, caps);
            reg.attach(worker_id, &name, &instance_id, outbox, self.now_ms())
        };
        if let Some(old) = attached.superseded {
            tracing::info!(worker_id, old_conn = %old.conn_id, "worker connection superseded by a new hello");
            old.close_with(CloseReason::Superseded);
        }
        // A worker that keeps its handlers across reconnects still runs all of them.
        let kept;
        let hello = if caps.keeps_inflight {
            let mut all = hello.clone();
            all.inflight
                .extend(attached.assigned.iter().map(|(id, _)| id.clone()));
            kept = all;
            &kept
        } else {
            hello
        };
        match self.reconcile(hello, &instance_id, attached.assigned).await {
            Ok(rec) => Ok(rec),
            Err(e) => {
                // The hello is refused: the connection must not stay attached.
                self.worker_disconnected(worker_id, &conn_id).await;
                Err(e)
            }
        }
    }

    /// Reconcile every invocation assigned to a worker_id that said hello.
    pub(super) async fn reconcile(
        &self,
        hello: &HelloArgs,
        instance_id: &str,
        assigned: Vec<(String, Assignment)>,
    ) -> ApiResult<Reconciled> {
        let mut rec = Reconciled::default();
        for (inv_id, a) in assigned {
            let cell = self.cell(&a.session_id);
            let mut st = self.lock(&cell).await.map_err(read_failed)?;
            let Some(inv) = st.current_inv(&inv_id).cloned() else {
                continue;
            };
            let Some(h) = st.holder().cloned() else {
                continue;
            };
            let now = self.now_ms();
            let mut tx = Tx::new(&st, now);
            let verdict;
            if inv.instance_id == instance_id {
                if hello.inflight.contains(&inv_id) {
                    let mut inv = inv;
                    if inv.wait == InvWait::Cancelling {
                        self.send_cancel(&mut tx, &inv, "stop requested");
                    } else {
                        // Kept: the attempt's own deadline applies again (a deadline that
                        // passed while it was away leads to a probe at once).
                        inv.wait = InvWait::AwaitingResult;
                        inv.wait_since_ms = now;
                        inv.deadline_ms = inv.attempt_deadline_ms.max(now);
                    }
                    tx.put_invocation(&st, inv);
                    verdict = 0;
                } else if hello.finished.contains(&inv_id) {
                    let mut inv = inv;
                    inv.wait = InvWait::AwaitingResend;
                    inv.wait_since_ms = now;
                    inv.deadline_ms = now + self.inner.cfg.probe_timeout_ms;
                    tx.put_invocation(&st, inv);
                    verdict = 0;
                } else {
                    self.lost(
                        &st,
                        &mut tx,
                        h,
                        inv,
                        "the worker reconnected without it: it never received the invocation",
                    );
                    verdict = 1;
                }
            } else {
                self.outcome_unknown(
                    &st,
                    &mut tx,
                    h,
                    inv,
                    "the worker restarted (new instance_id) while the invocation was outstanding",
                );
                verdict = 2;
            }
            self.commit(&cell, &mut st, tx)
                .await
                .map_err(|e| unavailable(&e))?;
            match verdict {
                0 => rec.kept.push(inv_id),
                1 => rec.redispatched.push(inv_id),
                _ => rec.unknown.push(inv_id),
            }
        }
        // Work the worker still runs that the daemon already gave up (stopped while
        // it was away, outcome unknown, superseded): tell it to stop, and list it.
        let worker_id = hello.worker_id.as_deref().unwrap_or("");
        for inv_id in &hello.inflight {
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

    /// An invocation the worker never received: dispatch again with the same attempt.
    pub(super) fn lost(
        &self,
        st: &SessionState,
        tx: &mut Tx,
        h: TurnRecord,
        inv: InvocationRecord,
        reason: &str,
    ) {
        self.give_up(st, tx, inv.clone(), InvState::Lost);
        if h.stop.is_some() {
            self.cancel_turn(st, tx, h, None);
        } else {
            self.dispatch(st, tx, h, Some((&inv, reason)));
        }
    }

    /// A worker connection ended: every session with an invocation on it re-checks
    /// its worker (and starts waiting for the reconnect).
    pub async fn worker_disconnected(&self, worker_id: &str, conn_id: &str) {
        let sessions = {
            let mut reg = self.registry();
            if !reg.detach(worker_id, conn_id, self.now_ms()) {
                return;
            }
            reg.assigned_sessions(worker_id)
        };
        for s in sessions {
            self.drive(&s).await;
        }
    }

    /// `function.register`.
    pub fn register(&self, worker_id: &str, args: &RegisterArgs) -> ApiResult<RegisterOk> {
        check_id("function_id", &args.function_id)?;
        let concurrency = args.concurrency.unwrap_or(1);
        if concurrency == 0 || concurrency > 10_000 {
            return Err(err(
                ErrorCode::BadRequest,
                "`concurrency` must be 1 to 10000",
            ));
        }
        let timeout_ms = args.timeout_ms.unwrap_or(self.inner.cfg.default_timeout_ms);
        if timeout_ms == 0 {
            return Err(err(ErrorCode::BadRequest, "`timeout_ms` must be positive"));
        }
        let delivery = args.delivery.unwrap_or_default();
        let max_attempts = args.max_attempts.unwrap_or(delivery.default_max_attempts());
        if max_attempts == 0 || max_attempts > 1000 {
            return Err(err(
                ErrorCode::BadRequest,
                "`max_attempts` must be 1 to 1000",
            ));
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
    pub fn unregister(&self, worker_id: &str, function_id: &str) -> ApiResult<()> {
        if self.registry().unregister(worker_id, function_id) {
            Ok(())
        } else {
            Err(err(
                ErrorCode::NotFound,
                format!("function {function_id} is not registered on this connection"),
            ))
        }
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
                return Err(err(
                    ErrorCode::Forbidden,
                    format!("invocation {invocation_id} was not dispatched to worker {w}"),
                ));
            }
        }
        Ok(Some(inv))
    }

    /// Whether `invocation_id` is live and dispatched to `worker_id` (a registry
    /// lookup; no store read).
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
}
