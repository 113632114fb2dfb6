//! What the simulated peers did and were told: the facts the invariants are checked
//! against. Workers write which invocations they started and what each returned, and
//! how the daemon took each result; callers write every admission, stop and answer
//! they were given. Nothing here is read from the daemon's side.

use std::collections::{BTreeMap, HashMap, HashSet};

use turnd_proto::{Accepted, Outcome};

/// An invocation a worker's handler started.
#[derive(Debug, Clone)]
pub struct Start {
    pub turn_id: String,
    pub session_id: String,
    pub function_id: String,
    pub step: u32,
    pub attempt: u32,
    pub worker: String,
}

/// A turn a caller was told was admitted.
#[derive(Debug, Clone)]
pub struct Admitted {
    pub session_id: String,
    pub seq: u64,
    pub key: String,
}

/// The facts. See the module documentation.
#[derive(Default)]
pub struct Ledger {
    /// Invocations started by a handler, by id.
    pub starts: BTreeMap<String, Start>,
    /// Handlers started per (turn, step, attempt) of an at-most-once function.
    pub at_most_once: HashMap<(String, u32, u32), Vec<String>>,
    /// What each handler returned, by invocation id.
    pub produced: HashMap<String, Outcome>,
    /// How the daemon took each result (the first answer of each kind kept).
    pub acks: HashMap<String, Accepted>,
    /// Turns admitted, as the callers were told, by turn id.
    pub admitted: BTreeMap<String, Admitted>,
    /// The turn each idempotency key was answered with, by (session, key).
    pub keys: HashMap<(String, String), String>,
    /// Turns a `turn.stop` was sent for, and sessions a `session.stop` was sent for.
    pub stops_sent: HashSet<String>,
    pub session_stops_sent: HashSet<String>,
    /// Turns whose stop was acknowledged with the stop recorded in the answer.
    pub stops_acked: HashSet<String>,
    /// Violations of the peers' own checks, as they happen.
    pub violations: Vec<String>,
    /// Turns submitted by callers (every key sent at least once).
    pub submitted: u64,
}

impl Ledger {
    pub fn started(&mut self, inv: &str, s: Start, at_most_once: bool) {
        if at_most_once {
            let runs = self
                .at_most_once
                .entry((s.turn_id.clone(), s.step, s.attempt))
                .or_default();
            runs.push(inv.to_string());
            if runs.len() > 1 {
                self.violations.push(format!(
                    "at-most-once run twice: turn {} step {} attempt {} ran as {:?}",
                    s.turn_id, s.step, s.attempt, runs
                ));
            }
        }
        self.starts.insert(inv.to_string(), s);
    }

    pub fn produced(&mut self, inv: &str, o: &Outcome) {
        self.produced.insert(inv.to_string(), o.clone());
    }

    pub fn acked(&mut self, inv: &str, a: Accepted) {
        let prev = self.acks.entry(inv.to_string()).or_insert(a);
        // The first answer that took the result counts; a duplicate after it is
        // expected (a resend crossed the answer).
        if *prev == Accepted::Duplicate || *prev == Accepted::Unknown {
            *prev = a;
        }
    }

    pub fn admitted(&mut self, turn_id: &str, a: Admitted) {
        let k = (a.session_id.clone(), a.key.clone());
        match self.keys.get(&k) {
            Some(t) if t != turn_id => self.violations.push(format!(
                "idempotency key {} of session {} answered with turn {turn_id}, before with {t}",
                a.key, a.session_id
            )),
            _ => {
                self.keys.insert(k, turn_id.to_string());
            }
        }
        if let Some(old) = self.admitted.get(turn_id) {
            if old.seq != a.seq || old.session_id != a.session_id {
                self.violations.push(format!(
                    "turn {turn_id} answered at seq {} of {}, before at seq {} of {}",
                    a.seq, a.session_id, old.seq, old.session_id
                ));
            }
        }
        self.admitted.insert(turn_id.to_string(), a);
    }

    /// Whether a stop was asked for the turn (by turn or by session).
    pub fn stop_asked(&self, turn_id: &str, session_id: &str) -> bool {
        self.stops_sent.contains(turn_id) || self.session_stops_sent.contains(session_id)
    }
}
