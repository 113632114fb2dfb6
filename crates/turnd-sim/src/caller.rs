//! A simulated caller: submits turns to sessions of its own, each with an
//! idempotency key, and submits again with the same key until it is answered (after a
//! lost answer, a refusal, a reconnect); stops turns and sessions now and then; looks
//! at a session (`session.inspect`) now and then and stops its lock holder when that
//! waits without an invocation (for a worker, backing off, held) with turns queued
//! behind it, as an operator clearing a stuck session would; goes away for a while and
//! comes back. Every answer goes into the ledger.

use std::collections::BTreeMap;

use serde_json::{json, Value};
use turnd_proto::frame::{decode_server_frame, ServerFrame};
use turnd_proto::{
    HelloArgs, Role, SessionIdArgs, SessionOk, SessionStopArgs, StopArgs, SubmitArgs, SubmitOk,
    TurnOk, WaitState,
};

use crate::ledger::Admitted;
use crate::peer::{request, Env, Link};
use crate::worker::FUNCTIONS;

/// How long a request waits for its answer before it is sent again.
const ANSWER_MS: u64 = 1_500;

#[derive(Debug, Clone)]
enum Req {
    Hello,
    Submit(usize),
    Stop(String),
    SessionStop,
    Inspect,
}

struct Submit {
    args: SubmitArgs,
    turn_id: Option<String>,
    sent_at: u64,
}

/// The pace and faults of a caller.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    /// Chance per step of a new turn while it has turns left to submit.
    pub submit: f64,
    pub stop: f64,
    pub session_stop: f64,
    /// Chance per step of a `session.inspect` (and a stop of a waiting holder).
    pub inspect: f64,
    pub with_timeout: f64,
}

/// One simulated caller. See the module documentation.
pub struct CallerPeer {
    name: String,
    sessions: Vec<String>,
    pub link: Link,
    next_id: u64,
    pending: BTreeMap<u64, (Req, u64)>,
    submits: Vec<Submit>,
    /// Turns it may still submit.
    pub budget: u64,
    away_until: u64,
}

impl CallerPeer {
    pub fn new(idx: usize, sessions: usize, budget: u64) -> CallerPeer {
        CallerPeer {
            name: format!("k{idx}"),
            sessions: (0..sessions).map(|s| format!("s{idx}_{s}")).collect(),
            link: Link::Down(0),
            next_id: 0,
            pending: BTreeMap::new(),
            submits: Vec::new(),
            budget,
            away_until: 0,
        }
    }

    /// Submissions not answered yet.
    pub fn unanswered(&self) -> usize {
        self.submits.iter().filter(|s| s.turn_id.is_none()).count()
    }

    fn send(&mut self, env: &mut Env, conn: u64, req: Req, op: &str, args: &impl serde::Serialize) {
        self.next_id += 1;
        let id = self.next_id;
        self.pending.insert(id, (req, env.now));
        env.sends.push((conn, request(id, op, args)));
    }

    /// Time passes: connect, submit, resubmit, stop.
    pub fn step(&mut self, env: &mut Env, pace: Pace) {
        if env.now < self.away_until {
            return;
        }
        match self.link {
            Link::Down(at) if env.now >= at => return self.connect(env),
            Link::Hello { conn, at, .. } if env.now >= at + ANSWER_MS => {
                return self.lose(env, conn)
            }
            _ => {}
        }
        let Some(conn) = self.link.ready() else {
            return;
        };
        let stale: Vec<usize> = self
            .submits
            .iter()
            .enumerate()
            .filter(|(_, s)| s.turn_id.is_none() && s.sent_at + ANSWER_MS <= env.now)
            .map(|(i, _)| i)
            .collect();
        for i in stale {
            self.submit(env, conn, i);
        }
        if self.budget > 0 && env.chance(pace.submit) {
            self.budget -= 1;
            self.new_turn(env, conn, pace);
        }
        if env.chance(pace.stop) {
            self.stop_one(env, conn);
        }
        if env.chance(pace.session_stop) {
            let s = self.sessions[env.range(0, self.sessions.len() as u64) as usize].clone();
            env.ledger.session_stops_sent.insert(s.clone());
            let args = SessionStopArgs {
                session_id: s.clone(),
                reason: Some("simulated session stop".into()),
            };
            self.send(env, conn, Req::SessionStop, "session.stop", &args);
        }
        if env.chance(pace.inspect) {
            let session_id =
                self.sessions[env.range(0, self.sessions.len() as u64) as usize].clone();
            let args = SessionIdArgs { session_id };
            self.send(env, conn, Req::Inspect, "session.inspect", &args);
        }
    }

    fn new_turn(&mut self, env: &mut Env, conn: u64, pace: Pace) {
        let session_id = self.sessions[env.range(0, self.sessions.len() as u64) as usize].clone();
        let f = FUNCTIONS[env.range(0, FUNCTIONS.len() as u64) as usize].0;
        let steps = if env.chance(0.2) { env.range(2, 4) } else { 1 };
        let key = format!("{}-{}", self.name, self.submits.len());
        let turn_timeout_ms = env.chance(pace.with_timeout).then(|| env.range(500, 6_000));
        env.ledger.submitted += 1;
        self.submits.push(Submit {
            args: SubmitArgs {
                session_id,
                function_id: f.to_string(),
                input: json!({ "steps": steps }),
                idempotency_key: Some(key),
                turn_timeout_ms,
                on_busy: None,
            },
            turn_id: None,
            sent_at: 0,
        });
        self.submit(env, conn, self.submits.len() - 1);
    }

    fn submit(&mut self, env: &mut Env, conn: u64, i: usize) {
        self.submits[i].sent_at = env.now;
        let args = self.submits[i].args.clone();
        self.send(env, conn, Req::Submit(i), "turn.submit", &args);
    }

    fn stop_one(&mut self, env: &mut Env, conn: u64) {
        // One of the last few: those are the ones likely still queued or running.
        let known: Vec<&String> = self
            .submits
            .iter()
            .rev()
            .filter_map(|s| s.turn_id.as_ref())
            .take(4)
            .collect();
        if known.is_empty() {
            return;
        }
        let turn_id = known[env.range(0, known.len() as u64) as usize].clone();
        self.stop(env, conn, turn_id);
    }

    fn stop(&mut self, env: &mut Env, conn: u64, turn_id: String) {
        env.ledger.stops_sent.insert(turn_id.clone());
        let args = StopArgs {
            turn_id: turn_id.clone(),
            reason: Some("simulated stop".into()),
        };
        self.send(env, conn, Req::Stop(turn_id), "turn.stop", &args);
    }

    /// A `session.inspect` answer: a lock holder that waits without an invocation,
    /// with turns queued behind it, is stopped.
    fn inspected(&mut self, env: &mut Env, conn: u64, v: Value) {
        let Ok(ok) = serde_json::from_value::<SessionOk>(v) else {
            env.ledger
                .violations
                .push("a session.inspect answer does not decode".into());
            return;
        };
        let Some(lock) = ok.session.lock else {
            return;
        };
        let waiting = matches!(
            lock.wait.state,
            WaitState::AwaitingWorker | WaitState::BackingOff | WaitState::Held
        );
        if waiting && !ok.session.queued.is_empty() {
            self.stop(env, conn, lock.turn_id);
        }
    }

    fn connect(&mut self, env: &mut Env) {
        let conn = env.open();
        let hello = HelloArgs::new(Role::Client);
        self.next_id += 1;
        let id = self.next_id;
        self.pending.insert(id, (Req::Hello, env.now));
        env.sends.push((conn, request(id, "hello", &hello)));
        self.link = Link::Hello {
            conn,
            id,
            at: env.now,
        };
    }

    fn lose(&mut self, env: &mut Env, conn: u64) {
        if self.link.conn() != Some(conn) {
            return;
        }
        env.cut.push(conn);
        self.closed(env, conn);
    }

    /// The daemon's end of `conn` closed (or the caller gave it up).
    pub fn closed(&mut self, env: &mut Env, conn: u64) {
        if self.link.conn() == Some(conn) {
            self.pending.clear();
            self.link = Link::Down(env.now + env.range(20, 400));
        }
    }

    /// Fault: the caller goes away for `ms` (its connection cut), then comes back.
    pub fn away(&mut self, env: &mut Env, ms: u64) {
        if let Some(conn) = self.link.conn() {
            self.lose(env, conn);
        }
        self.away_until = env.now + ms;
    }

    /// A frame arrives on `conn`.
    pub fn frame(&mut self, env: &mut Env, conn: u64, text: &str) {
        if self.link.conn() != Some(conn) {
            return;
        }
        let (id, r) = match decode_server_frame(text) {
            Ok(ServerFrame::Ok { id, ok }) => (id, Ok(ok)),
            Ok(ServerFrame::Error {
                id: Some(id),
                error,
            }) => (id, Err(error)),
            _ => return,
        };
        let Some((req, _)) = self.pending.remove(&id) else {
            return;
        };
        match (req, r) {
            (Req::Hello, Ok(_)) => self.link = Link::Ready(conn),
            (Req::Hello, Err(_)) => self.lose(env, conn),
            (Req::Submit(i), Ok(v)) => self.admitted(env, i, v),
            (Req::Inspect, Ok(v)) => self.inspected(env, conn, v),
            (Req::Stop(t), Ok(v)) => {
                if let Ok(ok) = serde_json::from_value::<TurnOk>(v) {
                    if ok.turn.stop.is_some() {
                        env.ledger.stops_acked.insert(t);
                    }
                }
            }
            // A refused submit is sent again after ANSWER_MS; other refusals and
            // session stops need nothing more.
            _ => {}
        }
    }

    fn admitted(&mut self, env: &mut Env, i: usize, v: Value) {
        let Ok(ok) = serde_json::from_value::<SubmitOk>(v) else {
            env.ledger
                .violations
                .push("a turn.submit answer does not decode".into());
            return;
        };
        let s = &mut self.submits[i];
        let key = s.args.idempotency_key.clone().unwrap_or_default();
        env.ledger.admitted(
            &ok.turn.turn_id,
            Admitted {
                session_id: ok.turn.session_id.clone(),
                seq: ok.turn.seq,
                key,
            },
        );
        if ok.turn.session_id != s.args.session_id {
            env.ledger.violations.push(format!(
                "submit to {} answered with a turn of {}",
                s.args.session_id, ok.turn.session_id
            ));
        }
        s.turn_id = Some(ok.turn.turn_id);
    }
}
