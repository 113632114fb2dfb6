//! The shell around the machine's transitions: what a transition reads of the world
//! ([`machine::Ctx`]), the worker slots it frees and wants ([`Engine::settle`]), and
//! its effects carried out once it is durable ([`Engine::carry_out`]).

use super::*;

/// What the engine did in the registry for one transition before its write: the
/// slots it reserved for the dispatch the transition wanted, and the slots of the
/// invocations it ended that it freed. Put back if the write fails.
#[derive(Debug, Default)]
pub(super) struct Settlement {
    /// (worker_id, invocation_id) of each slot reserved.
    pub(super) reserved: Vec<(String, String)>,
    pub(super) released: Vec<machine::Slot>,
}

/// A transition built and settled with the registry, ready to commit.
pub(super) struct Settled {
    pub(super) tx: Tx,
    pub(super) slots: Settlement,
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
    pub(super) fn settle(&self, st: &SessionState, tx: &mut Tx) -> Settlement {
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
    pub(super) fn carry_out(&self, effect: Effect) {
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
                (o, push_frame(&Push::Invoke(invoke)))
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
}
