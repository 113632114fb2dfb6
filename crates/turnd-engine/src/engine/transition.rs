//! A transition from its building to its effects: what it reads of the world
//! ([`machine::Ctx`]), settling the worker slots it frees and wants with the
//! registry ([`Engine::settle`], a [`Settlement`]), its write through the group
//! commit and its application ([`Engine::commit`]), and what follows a change: its
//! effects carried out, its events counted and published, waiters woken, the wait
//! index, the registry's waiting lists and the session's timer brought in step
//! ([`Engine::after_change`]).

use std::sync::Arc;

use turnd_proto::{new_invocation_id_of, Push};
use turnd_store::{Phase, StoreError};

use super::Engine;
use crate::machine::{self, Effect, Tx};
use crate::metrics::Counters;
use crate::registry::{invoke_frame, push_frame, Assignment, Registry};
use crate::session::SessionState;
use crate::sessions::SessionCell;
use crate::wait_index::WaitEntry;

/// What the engine did in the registry for one transition before its write: the
/// slots it reserved for the dispatch the transition wanted, and the slots of the
/// invocations it ended that it freed. Put back if the write fails.
#[derive(Debug, Default)]
struct Settlement {
    /// (worker_id, invocation_id) of each slot reserved.
    reserved: Vec<(String, String)>,
    released: Vec<machine::Slot>,
}

/// A transition built and settled with the registry, ready to commit.
pub(super) struct Settled {
    tx: Tx,
    slots: Settlement,
}

impl Settled {
    /// Whether the transition writes nothing.
    pub(super) fn is_empty(&self) -> bool {
        self.tx.is_empty()
    }
}

impl Engine {
    /// What a transition of session `st` reads: the state, the configuration and
    /// whether the worker of its live invocation is attached.
    pub(super) fn ctx<'a>(&'a self, st: &'a SessionState) -> machine::Ctx<'a> {
        let (worker_connected, worker_probes) = st
            .inv
            .as_deref()
            .map(|i| {
                let reg = self.registry();
                (
                    reg.is_connected(&i.worker_id, &i.instance_id),
                    reg.caps(&i.worker_id).probe,
                )
            })
            .unwrap_or((false, true));
        machine::Ctx {
            st,
            cfg: &self.inner.cfg,
            worker_connected,
            worker_probes,
        }
    }

    /// Settle a built transition with the registry: free the slots of the
    /// invocations it ended (so the same worker can take the next step), then look
    /// for a slot for the step it wants dispatched and answer the machine with it.
    /// Returns what it reserved and freed, to put back if the write fails.
    fn settle(&self, st: &SessionState, tx: &mut Tx) -> Settlement {
        let mut slots = Settlement::default();
        let grant = {
            let mut reg = self.registry();
            for slot in std::mem::take(&mut tx.frees) {
                if reg.release(&slot.worker_id, &slot.invocation_id).is_some() {
                    slots.released.push(slot);
                }
            }
            let Some(want) = &tx.dispatch else {
                return slots;
            };
            if machine::holding(tx) {
                // An invocation the session holds for may still be running: no slot
                // is looked for, and the session is not noted as waiting for one.
                None
            } else {
                let inv_id = new_invocation_id_of(&want.turn.turn_id);
                let grant = reg
                    .reserve(&want.turn.function_id, &inv_id, &st.id)
                    .map(|r| machine::Grant {
                        invocation_id: inv_id,
                        worker_id: r.worker_id,
                        instance_id: r.instance_id,
                        conn_id: r.outbox.conn_id.clone(),
                        settings: r.settings,
                    });
                if let Some(g) = &grant {
                    slots
                        .reserved
                        .push((g.worker_id.clone(), g.invocation_id.clone()));
                }
                grant
            }
        };
        let cx = machine::Ctx {
            st,
            cfg: &self.inner.cfg,
            worker_connected: false,
            worker_probes: true,
        };
        machine::grant(&cx, tx, grant);
        slots
    }

    /// Build a transition on session `st` at `now` with `f`, a transition of the
    /// machine, and settle it (not yet committed). Returns it with what `f` decided.
    pub(super) fn transition<R>(
        &self,
        st: &SessionState,
        now: u64,
        f: impl FnOnce(&machine::Ctx, &mut Tx) -> R,
    ) -> (Settled, R) {
        let mut tx = Tx::new(st, now);
        let decided = f(&self.ctx(st), &mut tx);
        let slots = self.settle(st, &mut tx);
        (Settled { tx, slots }, decided)
    }

    /// Carry out one effect of a committed transition.
    fn carry_out(&self, effect: Effect) {
        let (outbox, frame) = match effect {
            Effect::Invoke {
                worker_id,
                instance_id,
                conn_id,
                invoke,
            } => {
                // Only on the connection the slot was granted on: on any other the
                // invocation is reconciled as lost.
                let o = self
                    .registry()
                    .outbox_of(&worker_id, &instance_id)
                    .filter(|o| o.conn_id == conn_id);
                (o, invoke_frame(invoke))
            }
            Effect::Cancel {
                worker_id,
                instance_id,
                invocation_id,
                reason,
            } => (
                self.registry().outbox_of(&worker_id, &instance_id),
                push_frame(&Push::Cancel {
                    invocation_id,
                    reason,
                }),
            ),
            Effect::Probe {
                worker_id,
                instance_id,
                invocation_id,
            } => (
                self.registry().outbox_of(&worker_id, &instance_id),
                push_frame(&Push::Probe { invocation_id }),
            ),
        };
        match outbox {
            Some(o) => {
                if !o.push(frame) {
                    tracing::debug!(conn_id = %o.conn_id, "push to a closed or full connection");
                }
            }
            None => tracing::debug!("push to a worker that is no longer connected"),
        }
    }

    /// Commit a settled transition and apply it. On failure nothing in memory
    /// changed and every slot it reserved or freed is put back.
    pub(super) async fn commit(
        &self,
        cell: &Arc<SessionCell>,
        st: &mut SessionState,
        settled: Settled,
    ) -> Result<(), StoreError> {
        let Settled { mut tx, slots } = settled;
        if tx.is_empty() && tx.idempotency.is_none() {
            self.after_change(st, Vec::new());
            return Ok(());
        }
        let batch = tx.batch(st);
        match self.inner.store.commit(batch).await {
            Ok(()) => {
                {
                    let mut e = self.inner.storage_error.lock();
                    *e = None;
                }
                let released: Vec<String> = slots
                    .released
                    .iter()
                    .map(|r| r.function_id.clone())
                    .collect();
                let applied = tx.apply(st);
                // Before its events go out: a frame of an invocation that just ended
                // must not reach a watcher after them.
                self.inner.progress.sync(st);
                // The session's write succeeded: a retried one is no longer pending.
                st.pending = None;
                {
                    let mut c = self.inner.counts.lock();
                    for (from, to) in &applied.shifts {
                        c.shift(*from, *to);
                    }
                }
                for e in &applied.events {
                    self.inner.counters.count_event(e);
                }
                for eff in applied.effects {
                    self.carry_out(eff);
                }
                self.inner.watches.publish(&st.id, &applied.events);
                self.inner
                    .sessions
                    .track_live(cell, &applied.admitted, &applied.terminal);
                self.inner.waiters.notify(&applied.terminal);
                self.after_change(st, released);
                Ok(())
            }
            Err(e) => {
                Counters::inc(&self.inner.counters.write_failures);
                {
                    let mut le = self.inner.storage_error.lock();
                    *le = Some(e.to_string());
                }
                self.restore(st, &slots, tx.now);
                Err(e)
            }
        }
    }

    /// Put back what settling a transition did in the registry: its write failed.
    fn restore(&self, st: &SessionState, slots: &Settlement, now: u64) {
        let mut reg = self.registry();
        for (worker_id, inv_id) in &slots.reserved {
            reg.release(worker_id, inv_id);
        }
        for slot in &slots.released {
            reg.remember_assignment(
                &slot.worker_id,
                &slot.instance_id,
                &slot.invocation_id,
                Assignment {
                    session_id: st.id.to_string(),
                    function_id: slot.function_id.clone(),
                },
                now,
            );
        }
        // Building the transition may have noted the session as waiting for a
        // worker (a reservation that found none): the state did not change, so
        // neither may that note, or the function's entry would outlive every
        // connection and turn that names it.
        note_waiting(&mut reg, st);
    }

    /// After any change: wake sessions waiting for freed capacity, update the
    /// session's entry in the wait index (which `sessions.list` and `stats` read) and
    /// in the registry's waiting lists, and re-arm its timer.
    pub(super) fn after_change(&self, st: &mut SessionState, freed: Vec<String>) {
        for f in freed {
            self.inner.workers.wake(&f);
        }
        self.inner.progress.sync(st);
        let entry = WaitEntry::of(st, self.inner.cfg.turns.dispatch_timeout_ms);
        self.inner.waits.lock().set(&st.id, entry);
        note_waiting(&mut self.registry(), st);
        self.arm(st);
    }

    /// Put the session's next deadline in the timer queue.
    fn arm(&self, st: &mut SessionState) {
        let due = machine::next_due(st, &self.inner.cfg);
        if due == st.timer {
            return;
        }
        let due = due.filter(|_| !self.inner.shutdown.is_cancelled());
        self.inner.timers.set(&st.id, st.timer, due);
        st.timer = due;
    }
}

/// Bring the registry's note of what the session waits for in step with its state:
/// the function of its holder while that is queued or awaits a worker, else nothing.
/// A holder the session's hold keeps back waits for that, not for a worker: freed
/// capacity goes to sessions that can take it.
fn note_waiting(reg: &mut Registry, st: &SessionState) {
    match st.holder() {
        Some(h)
            if matches!(h.phase, Phase::Queued | Phase::AwaitingWorker)
                && machine::held_until(&st.meta, h).is_none() =>
        {
            reg.wait_for(&h.function_id, &st.id)
        }
        _ => reg.not_waiting(&st.id),
    }
}
