//! A session driven through the machine without a runtime, a store or a registry:
//! one worker (connected or not, with a free slot or not), a clock moved by hand,
//! and every record the transitions wrote kept as the store would.

use std::collections::{BTreeSet, HashMap};

use turnd_proto::{Delivery, Event, EventKind, Outcome};
use turnd_store::{FunctionSettings, InvocationRecord, RawJson, TurnRecord};

use super::*;
use crate::config::TurnsConfig;

pub(super) struct Sim {
    pub st: SessionState,
    pub cfg: EngineConfig,
    pub now: u64,
    /// Whether the worker's connection is attached.
    pub connected: bool,
    /// The worker's current instance.
    pub instance: String,
    /// Whether the worker has room for a dispatch.
    pub free: bool,
    /// Whether the worker answers probes.
    pub probes: bool,
    pub settings: FunctionSettings,
    minted: u32,
    /// Slots granted and not freed, by invocation id.
    pub slots: BTreeSet<String>,
    /// Every durable event, in order.
    pub events: Vec<Event<RawJson>>,
    /// Every turn and invocation as last written.
    pub turns: HashMap<String, TurnRecord>,
    pub invs: HashMap<String, InvocationRecord>,
}

impl Sim {
    pub fn new(delivery: Delivery, max_attempts: u32) -> Sim {
        let cfg = EngineConfig {
            turns: TurnsConfig {
                default_timeout_ms: 1_000,
                probe_timeout_ms: 100,
                reconnect_grace_ms: 500,
                cancel_grace_ms: 200,
                max_steps: 5,
                dispatch_timeout_ms: None,
                retry_backoff_ms: 50,
                retry_backoff_max_ms: 150,
                ..TurnsConfig::default()
            },
            ..EngineConfig::default()
        };
        Sim {
            st: SessionState::new("s1"),
            cfg,
            now: 1_000_000,
            connected: true,
            instance: "i1".into(),
            free: true,
            probes: true,
            settings: FunctionSettings {
                timeout_ms: 1_000,
                delivery,
                max_attempts,
            },
            minted: 0,
            slots: BTreeSet::new(),
            events: Vec::new(),
            turns: HashMap::new(),
            invs: HashMap::new(),
        }
    }

    /// Build a transition, settle it as the engine would, apply it; its effects.
    pub fn run<R>(&mut self, f: impl FnOnce(&Ctx, &mut Tx) -> R) -> Vec<Effect> {
        self.step(f).1
    }

    /// [`Sim::run`], returning what the transition decided with its effects.
    pub fn step<R>(&mut self, f: impl FnOnce(&Ctx, &mut Tx) -> R) -> (R, Vec<Effect>) {
        let mut tx = Tx::new(&self.st, self.now);
        let worker_connected = self.connected
            && self
                .st
                .inv
                .as_ref()
                .is_some_and(|i| i.instance_id == self.instance);
        let cx = Ctx {
            st: &self.st,
            cfg: &self.cfg,
            worker_connected,
            worker_probes: self.probes,
        };
        let decided = f(&cx, &mut tx);
        for s in std::mem::take(&mut tx.frees) {
            self.slots.remove(&s.invocation_id);
        }
        if tx.dispatch.is_some() {
            let g = (self.free && self.connected && !holding(&tx)).then(|| {
                self.minted += 1;
                Grant {
                    invocation_id: format!("inv_{}", self.minted),
                    worker_id: "w1".into(),
                    instance_id: self.instance.clone(),
                    conn_id: "c1".into(),
                    settings: self.settings,
                }
            });
            if let Some(g) = &g {
                self.slots.insert(g.invocation_id.clone());
            }
            grant(&cx, &mut tx, g);
        }
        for i in &tx.inv_writes {
            self.invs.insert(i.invocation_id.clone(), i.clone());
        }
        for t in tx.turns.values() {
            self.turns.insert(t.turn_id.clone(), t.clone());
        }
        let applied = tx.apply(&mut self.st);
        self.events.extend(applied.events);
        (decided, applied.effects)
    }

    pub fn submit(&mut self) -> String {
        self.submit_with(None)
    }

    pub fn submit_with(&mut self, turn_timeout_ms: Option<u64>) -> String {
        self.submit_opts(turn_timeout_ms, None)
    }

    pub fn submit_opts(
        &mut self,
        turn_timeout_ms: Option<u64>,
        dispatch: Option<turnd_store::TurnDispatch>,
    ) -> String {
        self.submit_full(turn_timeout_ms, dispatch, turnd_proto::OnBusy::Enqueue)
    }

    /// Submit with `on_busy` (the shell's `reject` never reaches the machine).
    pub fn submit_on_busy(&mut self, on_busy: turnd_proto::OnBusy) -> String {
        self.submit_full(None, None, on_busy)
    }

    fn submit_full(
        &mut self,
        turn_timeout_ms: Option<u64>,
        dispatch: Option<turnd_store::TurnDispatch>,
        on_busy: turnd_proto::OnBusy,
    ) -> String {
        let turn_id = format!("t_{}", self.st.meta.last_turn_seq + 1);
        let s = Submission {
            turn_id: turn_id.clone(),
            function_id: "f".into(),
            input: RawJson::from_value(&serde_json::json!({"n": 1})),
            idempotency_key: None,
            turn_timeout_ms,
            dispatch,
            retry_backoff_ms: None,
            on_busy,
        };
        self.run(|cx, tx| submit(cx, tx, s));
        turn_id
    }

    /// The live invocation's id.
    pub fn live(&self) -> String {
        self.st
            .inv
            .as_ref()
            .map(|i| i.invocation_id.clone())
            .expect("a live invocation")
    }

    /// A result for `inv`; whether it was the live one.
    pub fn result(&mut self, inv: &str, outcome: Outcome) -> bool {
        let outcome = raw(outcome);
        self.step(|cx, tx| result(cx, tx, inv, outcome)).0
    }

    /// Move the clock by `ms` and do what is due.
    pub fn advance(&mut self, ms: u64) -> Vec<Effect> {
        self.now += ms;
        self.run(due)
    }

    pub fn turn(&self, turn_id: &str) -> &TurnRecord {
        self.turns.get(turn_id).expect("a written turn")
    }

    pub fn inv(&self, inv: &str) -> &InvocationRecord {
        self.invs.get(inv).expect("a written invocation")
    }

    /// The kinds of the events of turn `turn_id`, in order.
    pub fn kinds(&self, turn_id: &str) -> Vec<EventKind> {
        self.events
            .iter()
            .filter(|e| e.turn_id == turn_id)
            .map(|e| e.kind)
            .collect()
    }

    pub fn last_event(&self, kind: EventKind) -> &Event<RawJson> {
        self.events
            .iter()
            .rev()
            .find(|e| e.kind == kind)
            .expect("an event of that kind")
    }
}

/// An outcome as the engine takes it: its value as compact JSON text.
pub(super) fn raw(outcome: Outcome) -> Outcome<RawJson> {
    outcome.map_json(|v| RawJson::from_value(&v))
}

/// The invocations the effects send.
pub(super) fn invokes(effects: &[Effect]) -> Vec<&Invoke<RawJson>> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Invoke { invoke, .. } => Some(invoke),
            _ => None,
        })
        .collect()
}

/// The invocation ids the effects cancel.
pub(super) fn cancels(effects: &[Effect]) -> Vec<&str> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Cancel { invocation_id, .. } => Some(invocation_id.as_str()),
            _ => None,
        })
        .collect()
}

pub(super) fn probes(effects: &[Effect]) -> Vec<&str> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Probe { invocation_id, .. } => Some(invocation_id.as_str()),
            _ => None,
        })
        .collect()
}
