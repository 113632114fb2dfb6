//! A simulated worker that keeps the protocol's worker duties as the SDKs do
//! (`docs/semantics.md`, "Loss: detected and reconciled"): a stable instance id until
//! it crashes, `inflight` and `finished` in every `hello`, results kept and resent
//! until the daemon answers them (and at once on a `probe` or `cancel` for them),
//! truthful `probe` answers, `cancel` delivered to the handler. Its handlers take a
//! time the seed draws and return what the seed draws; every start and every result
//! goes into the ledger.
//!
//! Faults it suffers: a crash (it comes back as a new instance with nothing), a cut
//! connection (back as the same instance), a stall (it reads nothing and does
//! nothing for a while, then takes everything that arrived), slow handlers.

use std::collections::{BTreeMap, HashSet};

use serde_json::{json, Value};
use turnd_proto::frame::{decode_server_frame, ServerFrame};
use turnd_proto::{
    Accepted, Cancelled, Delivery, Failure, HelloArgs, InvocationState, Invoke, Outcome, Push,
    RegisterArgs, ResultArgs, ResultOk, Role, StatusArgs, PROTOCOL_VERSION,
};

use crate::ledger::Start;
use crate::peer::{request, Env, Link};

/// The functions every worker serves: (id, delivery, attempts).
pub const FUNCTIONS: [(&str, Delivery, u32); 2] = [
    ("f_alo", Delivery::AtLeastOnce, 3),
    ("f_amo", Delivery::AtMostOnce, 1),
];
/// Attempt deadline the functions register.
pub const TIMEOUT_MS: u64 = 1_000;
/// How long a result waits for its answer before it is sent again.
const RESULT_ACK_MS: u64 = 700;
/// How long a `hello` waits for its answer before the connection is given up.
const HELLO_MS: u64 = 2_000;

#[derive(Debug, Clone, Copy)]
enum Req {
    Hello,
    Other,
    Result,
}

struct Run {
    invoke: Invoke,
    done_at: u64,
    outcome: Outcome,
    ignores_cancel: bool,
}

struct Unacked {
    outcome: Outcome,
    sent_at: u64,
}

/// One simulated worker. See the module documentation.
pub struct Worker {
    pub worker_id: String,
    instance: u32,
    pub link: Link,
    next_id: u64,
    pending: BTreeMap<u64, (Req, String)>,
    running: BTreeMap<String, Run>,
    unacked: BTreeMap<String, Unacked>,
    seen: HashSet<String>,
    stalled_until: u64,
    /// Frames that arrived during a stall, by connection.
    inbox: Vec<(u64, String)>,
    slow_until: u64,
    pub crashes: u32,
}

impl Worker {
    pub fn new(idx: usize) -> Worker {
        Worker {
            worker_id: format!("w{idx}"),
            instance: 0,
            link: Link::Down(0),
            next_id: 0,
            pending: BTreeMap::new(),
            running: BTreeMap::new(),
            unacked: BTreeMap::new(),
            seen: HashSet::new(),
            stalled_until: 0,
            inbox: Vec::new(),
            slow_until: 0,
            crashes: 0,
        }
    }

    fn instance_id(&self) -> String {
        format!("{}-i{}", self.worker_id, self.instance)
    }

    /// Work the worker still holds: handlers running or results unanswered.
    pub fn holds_work(&self) -> bool {
        !self.running.is_empty() || !self.unacked.is_empty()
    }

    /// Send a request; `inv` names the invocation a result is for.
    fn send(
        &mut self,
        env: &mut Env,
        conn: u64,
        (req, inv): (Req, &str),
        op: &str,
        args: &impl serde::Serialize,
    ) {
        self.next_id += 1;
        let id = self.next_id;
        self.pending.insert(id, (req, inv.to_string()));
        env.sends.push((conn, request(id, op, args)));
    }

    /// Time passes: connect, finish handlers, resend results.
    pub fn step(&mut self, env: &mut Env) {
        if env.now < self.stalled_until {
            return;
        }
        self.drain_inbox(env);
        match self.link {
            Link::Down(at) if env.now >= at => self.connect(env),
            Link::Hello { conn, at, .. } if env.now >= at + HELLO_MS => self.lose(env, conn),
            _ => {}
        }
        let done: Vec<String> = self
            .running
            .iter()
            .filter(|(_, r)| r.done_at <= env.now)
            .map(|(k, _)| k.clone())
            .collect();
        for inv in done {
            self.finish(env, &inv, None);
        }
        let Some(conn) = self.link.ready() else {
            return;
        };
        let due: Vec<String> = self
            .unacked
            .iter()
            .filter(|(_, u)| u.sent_at + RESULT_ACK_MS <= env.now)
            .map(|(k, _)| k.clone())
            .collect();
        for inv in due {
            self.send_result(env, conn, &inv);
        }
    }

    fn connect(&mut self, env: &mut Env) {
        let conn = env.open();
        let hello = HelloArgs {
            protocol: PROTOCOL_VERSION,
            role: Role::Worker,
            token: None,
            name: None,
            worker_id: Some(self.worker_id.clone()),
            instance_id: Some(self.instance_id()),
            inflight: self.running.keys().cloned().collect(),
            finished: self.unacked.keys().cloned().collect(),
        };
        self.next_id += 1;
        let id = self.next_id;
        self.pending.insert(id, (Req::Hello, String::new()));
        env.sends.push((conn, request(id, "hello", &hello)));
        self.link = Link::Hello {
            conn,
            id,
            at: env.now,
        };
        let inst = self.instance_id();
        env.trace.push(env.now, || {
            format!(
                "{inst} connects c{conn} inflight {:?} finished {:?}",
                hello.inflight, hello.finished
            )
        });
    }

    /// The connection is gone (cut by either end): connect again soon, the same
    /// instance.
    fn lose(&mut self, env: &mut Env, conn: u64) {
        if self.link.conn() != Some(conn) {
            return;
        }
        env.cut.push(conn);
        self.pending.clear();
        let back = env.now + env.range(20, 400);
        self.link = Link::Down(back);
    }

    /// The daemon's end of `conn` closed.
    pub fn closed(&mut self, env: &mut Env, conn: u64) {
        if self.link.conn() == Some(conn) {
            self.pending.clear();
            let back = env.now + env.range(20, 400);
            self.link = Link::Down(back);
        }
    }

    /// Fault: the connection is cut.
    pub fn cut(&mut self, env: &mut Env) {
        if let Some(conn) = self.link.conn() {
            self.lose(env, conn);
        }
    }

    /// Fault: the worker is cut off for `ms` (every worker at once: an outage), then
    /// comes back as the same instance.
    pub fn away(&mut self, env: &mut Env, ms: u64) {
        self.cut(env);
        self.link = Link::Down(env.now + ms);
    }

    /// Fault: the process dies and comes back as a new instance holding nothing.
    pub fn crash(&mut self, env: &mut Env) {
        if let Some(conn) = self.link.conn() {
            env.cut.push(conn);
        }
        self.crashes += 1;
        self.instance += 1;
        self.pending.clear();
        self.running.clear();
        self.unacked.clear();
        self.seen.clear();
        self.inbox.clear();
        self.stalled_until = 0;
        self.link = Link::Down(env.now + env.range(50, 1_500));
    }

    /// Fault: the process stops reading and working for `ms`.
    pub fn stall(&mut self, now: u64, ms: u64) {
        self.stalled_until = now + ms;
    }

    /// Fault: its handlers are slow for `ms`.
    pub fn slow(&mut self, now: u64, ms: u64) {
        self.slow_until = now + ms;
    }

    /// A frame arrives on `conn`.
    pub fn frame(&mut self, env: &mut Env, conn: u64, text: &str) {
        if self.link.conn() != Some(conn) {
            return;
        }
        if env.now < self.stalled_until {
            self.inbox.push((conn, text.to_string()));
            return;
        }
        // A stream delivers in order: what arrived during a stall that just ended
        // is read before this frame, even when it comes before the worker's step.
        self.drain_inbox(env);
        self.take(env, conn, text);
    }

    /// Read the frames that arrived during a stall, in the order they came.
    fn drain_inbox(&mut self, env: &mut Env) {
        for (conn, f) in std::mem::take(&mut self.inbox) {
            self.take(env, conn, &f);
        }
    }

    fn take(&mut self, env: &mut Env, conn: u64, text: &str) {
        if self.link.conn() != Some(conn) {
            return;
        }
        match decode_server_frame(text) {
            Ok(ServerFrame::Push(p)) => self.push(env, conn, p),
            Ok(ServerFrame::Ok { id, ok }) => self.answered(env, conn, id, Ok(ok)),
            Ok(ServerFrame::Error {
                id: Some(id),
                error,
            }) => self.answered(env, conn, id, Err(error.code.as_str().to_string())),
            Ok(ServerFrame::Error { id: None, .. }) | Err(_) => {}
        }
    }

    fn answered(&mut self, env: &mut Env, conn: u64, id: u64, r: Result<Value, String>) {
        let Some((req, inv)) = self.pending.remove(&id) else {
            return;
        };
        match (req, r) {
            (Req::Hello, Ok(_)) => {
                self.link = Link::Ready(conn);
                for (f, delivery, attempts) in FUNCTIONS {
                    let args = RegisterArgs {
                        function_id: f.to_string(),
                        concurrency: Some(4),
                        timeout_ms: Some(TIMEOUT_MS),
                        delivery: Some(delivery),
                        max_attempts: Some(attempts),
                    };
                    self.send(env, conn, (Req::Other, ""), "function.register", &args);
                }
                let all: Vec<String> = self.unacked.keys().cloned().collect();
                for inv in all {
                    self.send_result(env, conn, &inv);
                }
            }
            (Req::Hello, Err(_)) => self.lose(env, conn),
            (Req::Result, Ok(v)) => {
                let Ok(ok) = serde_json::from_value::<ResultOk>(v) else {
                    return;
                };
                if self.unacked.remove(&inv).is_some() || ok.accepted != Accepted::Duplicate {
                    env.ledger.acked(&inv, ok.accepted);
                }
                env.trace.push(env.now, || {
                    format!("{} result {inv} {:?}", self.worker_id, ok.accepted)
                });
            }
            // Refused (unavailable): sent again after the ack timeout.
            (Req::Result, Err(_)) | (Req::Other, _) => {}
        }
    }

    fn push(&mut self, env: &mut Env, conn: u64, p: Push) {
        match p {
            Push::Invoke(inv) => self.invoked(env, inv),
            Push::Probe { invocation_id } => {
                let state = if self.running.contains_key(&invocation_id) {
                    InvocationState::Running
                } else if self.unacked.contains_key(&invocation_id) {
                    InvocationState::Finished
                } else {
                    InvocationState::Unknown
                };
                let args = StatusArgs {
                    invocation_id: invocation_id.clone(),
                    state,
                };
                self.send(env, conn, (Req::Other, ""), "invocation.status", &args);
                if state == InvocationState::Finished {
                    self.send_result(env, conn, &invocation_id);
                }
            }
            Push::Cancel { invocation_id, .. } => {
                if self.unacked.contains_key(&invocation_id) {
                    self.send_result(env, conn, &invocation_id);
                } else if self
                    .running
                    .get(&invocation_id)
                    .is_some_and(|r| !r.ignores_cancel)
                {
                    let o = Outcome::Cancelled(Cancelled {
                        message: "cancel honoured".into(),
                    });
                    self.finish(env, &invocation_id, Some(o));
                }
            }
            Push::Event { .. } | Push::Progress(_) | Push::ProgressDropped { .. } => {}
        }
    }

    fn invoked(&mut self, env: &mut Env, inv: Invoke) {
        if !self.seen.insert(inv.invocation_id.clone()) {
            return;
        }
        let amo = inv.function_id == FUNCTIONS[1].0;
        env.ledger.started(
            &inv.invocation_id,
            Start {
                turn_id: inv.turn_id.clone(),
                session_id: inv.session_id.clone(),
                function_id: inv.function_id.clone(),
                step: inv.step,
                attempt: inv.attempt,
                worker: self.instance_id(),
            },
            amo,
        );
        let mut took = match env.range(0, 100) {
            0..=3 => env.range(TIMEOUT_MS - 200, TIMEOUT_MS * 3),
            _ => env.range(1, 40),
        };
        if env.now < self.slow_until {
            took *= 4;
        }
        let outcome = plan(env, &inv);
        let ignores_cancel = env.chance(0.1);
        let id = inv.invocation_id.clone();
        env.trace.push(env.now, || {
            format!(
                "{} starts {id} {} step {} attempt {} for {took} ms",
                self.instance_id(),
                inv.turn_id,
                inv.step,
                inv.attempt
            )
        });
        self.running.insert(
            id,
            Run {
                invoke: inv,
                done_at: env.now + took,
                outcome,
                ignores_cancel,
            },
        );
    }

    /// A handler returns (`instead`: a cancelled one).
    fn finish(&mut self, env: &mut Env, inv: &str, instead: Option<Outcome>) {
        let Some(run) = self.running.remove(inv) else {
            return;
        };
        let outcome = instead.unwrap_or(run.outcome);
        env.ledger.produced(inv, &outcome);
        let turn = run.invoke.turn_id;
        env.trace.push(env.now, || {
            format!(
                "{} returns {inv} of {turn}: {}",
                self.instance_id(),
                outcome.kind()
            )
        });
        self.unacked.insert(
            inv.to_string(),
            Unacked {
                outcome,
                sent_at: 0,
            },
        );
        if let Some(conn) = self.link.ready() {
            self.send_result(env, conn, inv);
        }
    }

    fn send_result(&mut self, env: &mut Env, conn: u64, inv: &str) {
        let Some(u) = self.unacked.get_mut(inv) else {
            return;
        };
        u.sent_at = env.now;
        let args = ResultArgs {
            invocation_id: inv.to_string(),
            outcome: u.outcome.clone(),
        };
        self.send(env, conn, (Req::Result, inv), "invocation.result", &args);
    }
}

/// What a handler returns for `inv`: its input says how many steps its turn takes.
fn plan(env: &mut Env, inv: &Invoke) -> Outcome {
    let steps = inv.input.get("steps").and_then(Value::as_u64).unwrap_or(1);
    match env.range(0, 100) {
        0..=4 => Outcome::Fail(Failure {
            code: "flaky".into(),
            message: format!("retryable failure of {}", inv.invocation_id),
            retryable: true,
        }),
        5..=6 => Outcome::Fail(Failure {
            code: "boom".into(),
            message: format!("failure of {}", inv.invocation_id),
            retryable: false,
        }),
        _ if u64::from(inv.step) + 1 < steps => {
            Outcome::Continue(json!({"steps": steps, "by": inv.invocation_id}))
        }
        _ => Outcome::Complete(json!({"by": inv.invocation_id})),
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::ledger::Ledger;
    use crate::peer::Trace;

    /// A frame on `conn` at `now`: what the worker sent back.
    fn deliver(
        w: &mut Worker,
        ledger: &mut Ledger,
        now: u64,
        conn: u64,
        frame: &str,
    ) -> Vec<String> {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut trace = Trace::new(false);
        let mut next_conn = 10;
        let mut env = Env {
            now,
            rng: &mut rng,
            ledger,
            trace: &mut trace,
            sends: Vec::new(),
            opened: Vec::new(),
            cut: Vec::new(),
            next_conn: &mut next_conn,
        };
        w.frame(&mut env, conn, frame);
        env.sends.into_iter().map(|(_, f)| f).collect()
    }

    #[test]
    fn frames_that_arrived_during_a_stall_are_read_before_a_later_one() {
        let mut w = Worker::new(0);
        w.link = Link::Ready(1);
        let mut ledger = Ledger::default();
        w.stall(0, 100);
        let invoke = json!({"push": "invoke", "invocation_id": "inv_a", "function_id": FUNCTIONS[1].0,
            "session_id": "s", "turn_id": "t", "step": 0, "attempt": 1, "input": {}, "deadline_ms": 1000});
        assert!(deliver(&mut w, &mut ledger, 10, 1, &invoke.to_string()).is_empty());
        // The stall ends; a probe arrives before the worker's next step.
        let probe = json!({"push": "probe", "invocation_id": "inv_a"});
        let sent = deliver(&mut w, &mut ledger, 100, 1, &probe.to_string());
        assert!(
            sent.iter()
                .any(|f| f.contains("invocation.status") && f.contains("\"running\"")),
            "the probe of an invocation received before it is answered running: {sent:?}"
        );
    }
}
