//! The invariants of `docs/semantics.md`, checked against the daemon's store and the
//! ledger of what the peers did:
//!
//! - at each `invoke` the daemon pushes ([`Tracking::on_invoke`]): per-session FIFO
//!   (every turn of the session before it is terminal, and no earlier turn is
//!   dispatched after a later one) and at most one step in flight (the session's
//!   previous invocation is no longer active);
//! - as the daemon answers a `turn.stop` or `session.stop` ([`lock_handed_over`]):
//!   the session's first unfinished turn, if any, has taken the lock (a stop that
//!   ended the holder made the next turn the holder in the same write);
//! - after every start of the daemon and at the end ([`acked_kept`]): every
//!   acknowledged admission, result and stop is on record;
//! - at the end, once the quiet tail let every turn finish ([`truthful`],
//!   [`settled`]): every turn terminal, each terminal state truthful against what the
//!   workers did, late results kept, `check_store` clean, and the engine's memory
//!   back to live work.
//!
//! At-most-once is checked by the ledger as handlers start.

use std::collections::HashMap;

use turnd_engine::Engine;
use turnd_proto::{invocation_turn_id, Accepted, ErrorCause, Invoke, Outcome, TurnStatus};
use turnd_store::{check_store, InvState, Phase, SessionKeys, Store, StoreError, TurnRecord};

use crate::ledger::Ledger;

/// A broken invariant, or a store read that failed where none may.
pub type Checked = Result<(), String>;

/// How a failed store read is named in a [`Checked`] error.
pub const READ_FAILED: &str = "store read failed";

/// A failed store read as a [`Checked`] error.
pub fn read(e: StoreError) -> String {
    format!("{READ_FAILED}: {e}")
}

/// What the checks of dispatches remember between them.
#[derive(Default)]
pub struct Tracking {
    /// Per session: every turn below this seq is known terminal.
    verified: HashMap<String, u64>,
    /// Per session: its last invocation pushed.
    live: HashMap<String, String>,
}

impl Tracking {
    /// An `invoke` the daemon pushed, once its dispatch is durable.
    pub fn on_invoke(&mut self, store: &Store, inv: &Invoke) -> Checked {
        let s = &inv.session_id;
        if let Some(prev) = self.live.get(s).filter(|p| **p != inv.invocation_id) {
            if let Some(r) = store.invocation(prev).map_err(read)? {
                if r.is_active() {
                    return Err(format!(
                        "two steps in flight in session {s}: {prev} is still active when {} is dispatched",
                        inv.invocation_id
                    ));
                }
            }
        }
        self.live.insert(s.clone(), inv.invocation_id.clone());
        let t = store
            .turn(&inv.turn_id)
            .map_err(read)?
            .ok_or_else(|| format!("turn {} was dispatched and is not stored", inv.turn_id))?;
        let from = self.verified.get(s).copied().unwrap_or(1);
        if t.seq < from {
            return Err(format!(
                "FIFO: turn {} (seq {}) of {s} dispatched after a later turn was",
                t.turn_id, t.seq
            ));
        }
        let keys = SessionKeys {
            id: s,
            from_ms: None,
        };
        for seq in from..t.seq {
            let Some(id) = store.list_entry(keys, seq).map_err(read)? else {
                continue;
            };
            let before = store.turn(&id).map_err(read)?;
            if before.as_ref().is_some_and(|b| !b.status.is_terminal()) {
                return Err(format!(
                    "FIFO: turn {} (seq {}) of {s} dispatched while turn {id} (seq {seq}) is unfinished",
                    t.turn_id, t.seq
                ));
            }
        }
        self.verified.insert(s.clone(), from.max(t.seq));
        Ok(())
    }
}

/// Lock hand-over (`docs/semantics.md`, "Lock hand-over" and "Stop"): the first unfinished
/// turn of `session_id` holds the lock, dispatched or waiting as the holder; none is
/// left queued with no holder before it. Checked as a stop is answered, when its
/// write is durable and nothing else has run since.
pub fn lock_handed_over(store: &Store, session_id: &str) -> Checked {
    let Some(meta) = store.session_meta(session_id).map_err(read)? else {
        return Ok(());
    };
    if meta.active_from.is_none() {
        return Ok(());
    }
    let first = store
        .unfinished_turns(&meta)
        .map_err(read)?
        .into_iter()
        .next();
    match first {
        Some(t) if t.phase == Phase::Queued => Err(format!(
            "lock hand-over: turn {} (seq {}) is the first unfinished turn of {session_id} and has not taken the lock",
            t.turn_id, t.seq
        )),
        _ => Ok(()),
    }
}

/// Every acknowledged write is on record.
pub fn acked_kept(store: &Store, l: &Ledger) -> Checked {
    for (turn_id, a) in &l.admitted {
        match store.turn(turn_id).map_err(read)? {
            Some(t) if t.session_id == a.session_id && t.seq == a.seq => {}
            Some(t) => {
                return Err(format!(
                    "acknowledged turn {turn_id} (seq {} of {}) is stored as seq {} of {}",
                    a.seq, a.session_id, t.seq, t.session_id
                ))
            }
            None => return Err(format!("acknowledged turn {turn_id} is lost")),
        }
    }
    for (inv, a) in &l.acks {
        if *a != Accepted::Applied {
            continue;
        }
        match store.invocation(inv).map_err(read)? {
            Some(r) if r.state == InvState::Finished => {}
            Some(r) => {
                return Err(format!(
                    "result of {inv} was acknowledged applied, and the invocation is {:?} ({:?})",
                    r.state, r.wait
                ))
            }
            None => {
                return Err(format!(
                    "result of {inv} was acknowledged applied, and the invocation is lost"
                ))
            }
        }
    }
    for t in &l.stops_acked {
        let rec = store.turn(t).map_err(read)?;
        if rec.is_none_or(|r| r.stop.is_none()) {
            return Err(format!("the acknowledged stop of {t} is lost"));
        }
    }
    Ok(())
}

/// Every turn a caller or a worker knows of is terminal and its state is truthful.
pub fn truthful(store: &Store, l: &Ledger) -> Checked {
    let mut turns: Vec<&String> = l.admitted.keys().collect();
    turns.extend(l.starts.values().map(|s| &s.turn_id));
    turns.sort();
    turns.dedup();
    for turn_id in turns {
        let t = store
            .turn(turn_id)
            .map_err(read)?
            .ok_or_else(|| format!("turn {turn_id} is not stored"))?;
        if !t.status.is_terminal() {
            return Err(format!(
                "turn {turn_id} is {:?} after the quiet tail",
                t.status
            ));
        }
        terminal_truthful(l, &t)?;
    }
    for (inv, a) in &l.acks {
        let produced = l.produced.get(inv);
        let turn = l.starts.get(inv).map(|s| s.turn_id.clone());
        let t = match turn {
            Some(t) => store.turn(&t).map_err(read)?,
            None => None,
        };
        match (a, produced, t) {
            (Accepted::Applied, Some(Outcome::Complete(v)), Some(t)) => {
                let out = t.output.as_ref().map(|o| o.to_value());
                if t.status != TurnStatus::Completed || out.as_ref() != Some(v) {
                    return Err(format!(
                        "the complete result of {inv} was applied, and turn {} is {:?} with {out:?}",
                        t.turn_id, t.status
                    ));
                }
            }
            (Accepted::Late, Some(o), Some(t)) => late_kept(store, inv, o, &t)?,
            _ => {}
        }
    }
    Ok(())
}

/// A late result is on record, and amends a turn failed for exactly its outcome.
fn late_kept(store: &Store, inv: &str, o: &Outcome, t: &TurnRecord) -> Checked {
    let rec = store.invocation(inv).map_err(read)?;
    if !rec.is_some_and(|r| r.late) {
        return Err(format!("the late result of {inv} is not kept"));
    }
    let named = t.error.as_ref().is_some_and(|e| {
        e.cause == ErrorCause::OutcomeUnknown && e.invocation_id.as_deref() == Some(inv)
    });
    if matches!(o, Outcome::Complete(_)) && t.status == TurnStatus::Failed && named {
        return Err(format!(
            "the late complete result of {inv} did not amend turn {}, failed for its unknown outcome",
            t.turn_id
        ));
    }
    Ok(())
}

/// A terminal turn's state against what the workers did.
fn terminal_truthful(l: &Ledger, t: &TurnRecord) -> Checked {
    let id = &t.turn_id;
    let of_turn = |inv: &str| l.starts.get(inv).is_some_and(|s| s.turn_id == *id);
    match t.status {
        TurnStatus::Completed => {
            let out = t.output.as_ref().map(|o| o.to_value());
            let by = out
                .as_ref()
                .and_then(|o| o.get("by"))
                .and_then(|b| b.as_str())
                .unwrap_or("");
            let real = of_turn(by)
                && matches!(l.produced.get(by), Some(Outcome::Complete(v)) if Some(v) == out.as_ref());
            if !real {
                return Err(format!(
                    "turn {id} completed with {out:?}, which no worker returned for it"
                ));
            }
        }
        TurnStatus::Cancelled => {
            let by_worker = l
                .produced
                .iter()
                .any(|(inv, o)| of_turn(inv) && matches!(o, Outcome::Cancelled(_)));
            if !l.stop_asked(id, &t.session_id) && !by_worker {
                return Err(format!("turn {id} is cancelled, and no one asked for it"));
            }
        }
        TurnStatus::Failed => failure_attributed(l, t)?,
        _ => {}
    }
    Ok(())
}

/// A failed turn's error names a cause that happened.
fn failure_attributed(l: &Ledger, t: &TurnRecord) -> Checked {
    let id = &t.turn_id;
    let Some(e) = t.error.as_ref() else {
        return Err(format!("turn {id} failed without an error"));
    };
    let of_turn = |inv: &str| invocation_turn_id(inv).as_deref() == Some(id.as_str());
    let failed_with = |code: &str| {
        l.produced
            .iter()
            .any(|(inv, o)| of_turn(inv) && matches!(o, Outcome::Fail(f) if f.code == code))
    };
    let names_own = e.invocation_id.as_deref().is_some_and(of_turn);
    let ok = match e.cause {
        ErrorCause::HandlerFailed => failed_with(&e.code),
        ErrorCause::AttemptsExhausted => failed_with(&e.code) || names_own,
        ErrorCause::OutcomeUnknown => names_own,
        ErrorCause::TimedOut => t.deadline_ms.is_some() || names_own,
        // The simulated workers never suspend: no turn waits for input.
        ErrorCause::NoWorker
        | ErrorCause::StepLimit
        | ErrorCause::InvalidResult
        | ErrorCause::InputTimeout => false,
    };
    if !ok {
        return Err(format!(
            "turn {id} failed as {e:?}, which nothing the workers did explains"
        ));
    }
    Ok(())
}

/// The store checks clean, nothing is unfinished, and the engine's memory holds
/// live work alone.
pub fn settled(engine: &Engine, store: &Store) -> Checked {
    let v = check_store(store).map_err(read)?;
    if let Some(first) = v.first() {
        return Err(format!(
            "store.check: {} violation(s), first: {first:?}",
            v.len()
        ));
    }
    for m in store.session_metas().map_err(read)? {
        if let Some(seq) = m.active_from {
            return Err(format!(
                "session {} still has unfinished turn seq {seq}",
                m.session_id
            ));
        }
    }
    let live = engine.live_turn_index_len();
    let sessions = engine.session_ids_in_memory();
    if live != 0 || !sessions.is_empty() || engine.turn_wait_count() != 0 {
        return Err(format!(
            "memory not back to live work: {live} live turns indexed, sessions in memory {sessions:?}, {} waiters",
            engine.turn_wait_count()
        ));
    }
    Ok(())
}
