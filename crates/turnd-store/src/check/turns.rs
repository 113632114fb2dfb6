//! The invariants of turns and invocations: an input stored apart is there, a turn
//! is stored in one form, a folded turn is finished with its own ended invocations,
//! a dropped window left no files, a failed turn has its cause and a cancelled one
//! its stop, an unfinished turn is where recovery looks for it, a running turn has a
//! way forward, a session has one lock holder with no queued turn ahead of it, a
//! turn suspended for input is its session's lock holder with no live invocation,
//! and a live invocation is its running turn's current one, one per session.

use std::collections::{BTreeMap, HashMap};

use turnd_proto::{TurnStatus, Violation};

use super::{violation, Invocations, Sessions, Turns};
use crate::error::StoreError;
use crate::kv::Kv;
use crate::model::keys;
use crate::model::records::{
    decode, FoldedTurn, InvState, InvocationRecord, Phase, SessionKeys, TurnRecord,
};
use crate::store::Store;

/// The turns stored under their own keys (unfinished ones).
pub(super) fn live_turns(kv: &dyn Kv) -> Result<Turns, StoreError> {
    let (ts, te) = keys::turn_range();
    let mut turns = HashMap::new();
    for (_, v) in kv.scan(&ts, &te, false, usize::MAX)? {
        let t: TurnRecord = decode("turn", &v)?;
        turns.insert(t.turn_id.clone(), t);
    }
    Ok(turns)
}

/// The invocations stored under their own keys.
pub(super) fn invocations(kv: &dyn Kv) -> Result<Invocations, StoreError> {
    let (is, ie) = keys::invocation_range();
    let mut invs = HashMap::new();
    for (_, v) in kv.scan(&is, &ie, false, usize::MAX)? {
        let i: InvocationRecord = decode("invocation", &v)?;
        invs.insert(i.invocation_id.clone(), i);
    }
    Ok(invs)
}

/// `turn_input_missing`: a turn whose input is stored apart has it under its own key
/// (an input written with the turn's admission batch, so a turn without it was torn).
pub(super) fn inputs_stored_apart(
    kv: &dyn Kv,
    turns: &Turns,
    out: &mut Vec<Violation>,
) -> Result<(), StoreError> {
    for t in turns.values() {
        if t.input.is_apart() && kv.get(&keys::turn_input(&t.turn_id))?.is_none() {
            out.push(violation(
                "turn_input_missing",
                Some(t),
                &t.session_id,
                "the turn's record says its input is stored apart, and it is not there".into(),
            ));
        }
    }
    Ok(())
}

/// Finished turns' folded records (`folded_record_misplaced`, `turn_stored_twice`,
/// `folded_unfinished_turn`, `folded_invocation_conflict`): a turn is stored in one
/// form only (the batch that folds it deletes its separate keys), it is terminal,
/// and its folded invocations are its own, ended, and not also under their own keys.
/// Each folded turn joins `turns`.
pub(super) fn folded_records(
    kv: &dyn Kv,
    turns: &mut Turns,
    invs: &Invocations,
    out: &mut Vec<Violation>,
) -> Result<(), StoreError> {
    let (fs, fe) = keys::finished_range();
    for (k, v) in kv.scan(&fs, &fe, false, usize::MAX)? {
        let f: FoldedTurn = decode("finished turn", &v)?;
        let t = &f.turn;
        if keys::finished_turn_id(&k) != Some(t.turn_id.as_str()) {
            out.push(violation(
                "folded_record_misplaced",
                Some(t),
                &t.session_id,
                format!("stored under {:?}", String::from_utf8_lossy(&k)),
            ));
        }
        if turns.contains_key(&t.turn_id) {
            out.push(violation(
                "turn_stored_twice",
                Some(t),
                &t.session_id,
                "the turn has a folded record and a record under its own key".into(),
            ));
        }
        if !t.status.is_terminal() {
            out.push(violation(
                "folded_unfinished_turn",
                Some(t),
                &t.session_id,
                format!("the folded record holds a {} turn", t.status.as_str()),
            ));
        }
        folded_invocations(&f, invs, out);
        turns.insert(t.turn_id.clone(), f.turn);
    }
    Ok(())
}

/// `folded_invocation_conflict`: the invocations folded into a finished turn.
fn folded_invocations(f: &FoldedTurn, invs: &Invocations, out: &mut Vec<Violation>) {
    let t = &f.turn;
    for i in &f.invocations {
        if i.turn_id != t.turn_id || i.is_active() || invs.contains_key(&i.invocation_id) {
            out.push(violation(
                "folded_invocation_conflict",
                Some(t),
                &t.session_id,
                format!(
                    "folded invocation {} (turn {}, {}) is another turn's, still active, or also stored under its own key",
                    i.invocation_id,
                    i.turn_id,
                    i.state.as_str()
                ),
            ));
        }
    }
}

/// `dropped_window_on_disk`: a dropped time window has no files left once its drop
/// was taken (the applier deletes its directory right after making the drop
/// durable).
pub(super) fn dropped_windows_gone(
    kv: &dyn Kv,
    out: &mut Vec<Violation>,
) -> Result<(), StoreError> {
    for w in kv.windows()? {
        if w.dropped && w.bytes > 0 {
            out.push(Violation {
                invariant: "dropped_window_on_disk".into(),
                turn_id: None,
                session_id: None,
                detail: format!(
                    "the time window starting at {} is dropped and still holds {} bytes on disk",
                    w.start_ms, w.bytes
                ),
            });
        }
    }
    Ok(())
}

/// Each turn's own invariants (`failed_without_cause`, `cancelled_without_stop`,
/// `unindexed_active_turn`, `running_without_path`). Returns the unfinished turns by
/// session, for [`lock_holders`].
pub(super) fn turn_states<'t>(
    store: &Store,
    turns: &'t Turns,
    invs: &Invocations,
    sessions: &Sessions<'_>,
    marks: &HashMap<&str, u64>,
    out: &mut Vec<Violation>,
) -> Result<BTreeMap<String, Vec<&'t TurnRecord>>, StoreError> {
    let mut by_session: BTreeMap<String, Vec<&TurnRecord>> = BTreeMap::new();
    for t in turns.values() {
        if t.status == TurnStatus::Failed && t.error.is_none() {
            out.push(violation(
                "failed_without_cause",
                Some(t),
                &t.session_id,
                "failed turn has no error.cause".into(),
            ));
        }
        if t.status == TurnStatus::Cancelled && t.stop.is_none() {
            out.push(violation(
                "cancelled_without_stop",
                Some(t),
                &t.session_id,
                "cancelled turn has no stop record".into(),
            ));
        }
        if !t.status.is_terminal() {
            recovery_finds(store, t, sessions, marks, out)?;
            by_session.entry(t.session_id.clone()).or_default().push(t);
        }
        if t.status == TurnStatus::Running {
            running_has_path(t, invs, out);
        }
    }
    Ok(by_session)
}

/// `unindexed_active_turn`: recovery loads an unfinished turn, since it is at or
/// after the first unfinished turn its session's meta records, and its session's
/// turn list names it there, up to the meta's last turn.
fn recovery_finds(
    store: &Store,
    t: &TurnRecord,
    sessions: &Sessions<'_>,
    marks: &HashMap<&str, u64>,
    out: &mut Vec<Violation>,
) -> Result<(), StoreError> {
    if marks.get(t.session_id.as_str()).is_none_or(|m| t.seq < *m) {
        out.push(violation(
            "unindexed_active_turn",
            Some(t),
            &t.session_id,
            format!(
                "{} turn (seq {}) comes before the first unfinished turn its session's meta records ({:?}), so recovery would not load it",
                t.status.as_str(),
                t.seq,
                marks.get(t.session_id.as_str())
            ),
        ));
    }
    // Recovery finds it through its session's turn list, up to the meta's last
    // turn. (A session with no meta at all is reported by the mark check above.)
    let meta = sessions.by_id.get(t.session_id.as_str());
    let reach = SessionKeys {
        id: &t.session_id,
        from_ms: meta.and_then(|m| m.routed_from_ms),
    };
    let listed = store.list_entry(reach, t.seq)?;
    let last = meta.map(|m| m.last_turn_seq);
    if listed.as_deref() != Some(t.turn_id.as_str()) || last.is_some_and(|l| t.seq > l) {
        out.push(violation(
            "unindexed_active_turn",
            Some(t),
            &t.session_id,
            format!(
                "{} turn (seq {}) is not where recovery looks for it: its session's turn list holds {:?} there and the session's last turn is {:?}",
                t.status.as_str(),
                t.seq,
                listed,
                last
            ),
        ));
    }
    Ok(())
}

/// `running_without_path`: a running turn has a live invocation or a timer.
fn running_has_path(t: &TurnRecord, invs: &Invocations, out: &mut Vec<Violation>) {
    let live = match t.phase {
        Phase::AwaitingWorker => true,
        Phase::BackingOff => t.retry_at_ms.is_some(),
        // Waits for `turn.resume` (or its input deadline).
        Phase::AwaitingInput => t.input_request.is_some(),
        Phase::Invoked => t
            .invocation_id
            .as_ref()
            .and_then(|id| invs.get(id))
            .map(|i| i.is_active() && i.turn_id == t.turn_id)
            .unwrap_or(false),
        Phase::Queued | Phase::Done => false,
    };
    if !live {
        out.push(violation(
            "running_without_path",
            Some(t),
            &t.session_id,
            format!(
                "running turn in phase {:?} has no live invocation and no timer (invocation {:?})",
                t.phase, t.invocation_id
            ),
        ));
    }
}

/// `suspended_not_holder`, `suspended_with_invocation`: a turn suspended for input
/// holds its session's lock (no unfinished turn before it), and the session has no
/// live invocation while it waits: its step ended with the suspend.
pub(super) fn suspended_turns(
    unfinished: &BTreeMap<String, Vec<&TurnRecord>>,
    invs: &Invocations,
    out: &mut Vec<Violation>,
) {
    for (sid, ts) in unfinished {
        let Some(s) = ts.iter().find(|t| t.phase == Phase::AwaitingInput) else {
            continue;
        };
        if let Some(before) = ts.iter().filter(|t| t.seq < s.seq).min_by_key(|t| t.seq) {
            out.push(violation(
                "suspended_not_holder",
                Some(s),
                sid,
                format!(
                    "turn awaiting input (seq {}) is behind unfinished turn {} (seq {})",
                    s.seq, before.turn_id, before.seq
                ),
            ));
        }
        let live: Vec<&str> = invs
            .values()
            .filter(|i| i.is_active() && i.session_id == *sid)
            .map(|i| i.invocation_id.as_str())
            .collect();
        if !live.is_empty() {
            out.push(violation(
                "suspended_with_invocation",
                Some(s),
                sid,
                format!(
                    "turn awaiting input while the session has live invocation(s): {}",
                    live.join(", ")
                ),
            ));
        }
    }
}

/// `two_lock_holders`, `queued_ahead_of_running`: per session, at most one running
/// turn, and no queued turn ahead of it.
pub(super) fn lock_holders(
    unfinished: BTreeMap<String, Vec<&TurnRecord>>,
    out: &mut Vec<Violation>,
) {
    for (sid, mut ts) in unfinished {
        ts.sort_by_key(|t| t.seq);
        let running: Vec<_> = ts
            .iter()
            .filter(|t| t.status == TurnStatus::Running)
            .collect();
        if running.len() > 1 {
            out.push(violation(
                "two_lock_holders",
                Some(running[1]),
                &sid,
                format!("{} running turns in one session", running.len()),
            ));
        }
        if let Some(r) = running.first() {
            if let Some(q) = ts
                .iter()
                .find(|t| t.status == TurnStatus::Queued && t.seq < r.seq)
            {
                out.push(violation(
                    "queued_ahead_of_running",
                    Some(q),
                    &sid,
                    format!(
                        "queued turn seq {} is ahead of running turn {} (seq {})",
                        q.seq, r.turn_id, r.seq
                    ),
                ));
            }
        }
    }
}

/// `orphan_invocation`, `two_live_invocations`: at most one non-terminal invocation
/// per session, and it belongs to a running turn.
pub(super) fn live_invocations(turns: &Turns, invs: &Invocations, out: &mut Vec<Violation>) {
    let mut live_by_session: BTreeMap<&str, Vec<&InvocationRecord>> = BTreeMap::new();
    for i in invs.values().filter(|i| i.state == InvState::Active) {
        live_by_session.entry(&i.session_id).or_default().push(i);
        let owner_running = turns
            .get(&i.turn_id)
            .map(|t| {
                t.status == TurnStatus::Running
                    && t.invocation_id.as_deref() == Some(&i.invocation_id)
            })
            .unwrap_or(false);
        if !owner_running {
            out.push(Violation {
                invariant: "orphan_invocation".into(),
                turn_id: Some(i.turn_id.clone()),
                session_id: Some(i.session_id.clone()),
                detail: format!(
                    "live invocation {} is not the current invocation of a running turn",
                    i.invocation_id
                ),
            });
        }
    }
    for (sid, live) in live_by_session {
        if live.len() > 1 {
            out.push(Violation {
                invariant: "two_live_invocations".into(),
                turn_id: None,
                session_id: Some(sid.to_string()),
                detail: format!(
                    "{} non-terminal invocations: {}",
                    live.len(),
                    live.iter()
                        .map(|i| i.invocation_id.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
    }
}
