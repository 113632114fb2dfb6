//! `store.check`: the invariants of the semantics page, checked over a whole store.
//! Works on a live daemon's store and offline on a stopped daemon's data directory.

use std::collections::{BTreeMap, HashMap};

use turnd_proto::{TurnStatus, Violation};

use crate::{
    keys, FoldedTurn, InvState, InvocationRecord, Phase, SessionKeys, SessionMeta, Store,
    StoreError, TurnRecord, WindowInfo,
};

fn violation(invariant: &str, t: Option<&TurnRecord>, session: &str, detail: String) -> Violation {
    Violation {
        invariant: invariant.to_string(),
        turn_id: t.map(|t| t.turn_id.clone()),
        session_id: Some(session.to_string()),
        detail,
    }
}

/// Whether a session's stored counts are those of its stored turns, read again on
/// their own: on a live daemon a turn admitted or ended between the whole-store
/// reads of `check_store` makes them differ there. The session's meta is read
/// before and after its turns, and the reads are repeated while it changed.
fn counts_agree_now(store: &Store, session_id: &str) -> Result<bool, StoreError> {
    let mut agree = false;
    for _ in 0..5 {
        let Some(before) = store.session_meta(session_id)? else {
            return Ok(true);
        };
        let mut have = turnd_proto::TurnCounts::default();
        for (_, id) in store.session_turn_ids(before.keys(), u64::MAX, usize::MAX)? {
            if let Some(t) = store.turn_record(&id)? {
                *have.get_mut(t.status) += 1;
            }
        }
        let after = store.session_meta(session_id)?;
        agree = have == before.counts;
        if after.is_some_and(|a| a.last_event_seq == before.last_event_seq) {
            break;
        }
    }
    Ok(agree)
}

/// Check every invariant and return each violation found.
pub fn check_store(store: &Store) -> Result<Vec<Violation>, StoreError> {
    let kv = store.kv();
    let mut out = Vec::new();

    let (ts, te) = keys::turn_range();
    let mut turns: HashMap<String, TurnRecord> = HashMap::new();
    for (_, v) in kv.scan(&ts, &te, false, usize::MAX)? {
        let t: TurnRecord =
            serde_json::from_slice(&v).map_err(|e| StoreError::Corrupt(format!("turn: {e}")))?;
        turns.insert(t.turn_id.clone(), t);
    }
    let (is, ie) = keys::invocation_range();
    let mut invs: HashMap<String, InvocationRecord> = HashMap::new();
    for (_, v) in kv.scan(&is, &ie, false, usize::MAX)? {
        let i: InvocationRecord = serde_json::from_slice(&v)
            .map_err(|e| StoreError::Corrupt(format!("invocation: {e}")))?;
        invs.insert(i.invocation_id.clone(), i);
    }
    // A turn whose input is stored apart has it under its own key (an input written
    // with the turn's admission batch, so a turn without it was torn).
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
    // Finished turns' folded records: a turn is stored in one form only (the batch
    // that folds it deletes its separate keys), it is terminal, and its folded
    // invocations are its own, ended, and not also under their own keys.
    let (fs, fe) = keys::finished_range();
    for (k, v) in kv.scan(&fs, &fe, false, usize::MAX)? {
        let f: FoldedTurn = serde_json::from_slice(&v)
            .map_err(|e| StoreError::Corrupt(format!("finished turn: {e}")))?;
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
        turns.insert(t.turn_id.clone(), f.turn);
    }

    // A dropped time window has no files left once its drop was taken (the applier
    // deletes its directory right after making the drop durable).
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

    // Where recovery starts reading each session's turn list: the meta's
    // `active_from`.
    let metas = store.session_metas()?;
    let mut marks: HashMap<&str, u64> = HashMap::new();
    let last_seqs: HashMap<&str, u64> = metas
        .iter()
        .map(|m| (m.session_id.as_str(), m.last_turn_seq))
        .collect();
    let by_id: HashMap<&str, &SessionMeta> =
        metas.iter().map(|m| (m.session_id.as_str(), m)).collect();
    for m in &metas {
        let Some(seq) = m.active_from else { continue };
        marks.insert(&m.session_id, seq);
        let at = store.list_entry(m.keys(), seq)?;
        match at.as_deref().map(|id| (id, turns.get(id))) {
            None | Some((_, None)) => out.push(Violation {
                invariant: "active_index_dangling".into(),
                turn_id: at.clone(),
                session_id: Some(m.session_id.clone()),
                detail: format!(
                    "the session's first unfinished turn is seq {seq}, which names no stored turn"
                ),
            }),
            Some((_, Some(t))) if t.status.is_terminal() => out.push(violation(
                "terminal_lock_holder",
                Some(t),
                &t.session_id,
                format!(
                    "turn is {} but the session's meta names it as its first unfinished turn",
                    t.status.as_str()
                ),
            )),
            Some(_) => {}
        }
    }

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
            let reach = SessionKeys {
                id: &t.session_id,
                from_ms: by_id
                    .get(t.session_id.as_str())
                    .and_then(|m| m.routed_from_ms),
            };
            let listed = store.list_entry(reach, t.seq)?;
            let last = last_seqs.get(t.session_id.as_str()).copied();
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
            by_session.entry(t.session_id.clone()).or_default().push(t);
        }
        if t.status == TurnStatus::Running {
            let live = match t.phase {
                Phase::AwaitingWorker => true,
                Phase::BackingOff => t.retry_at_ms.is_some(),
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
    }

    // Per session: at most one running turn, and no queued turn ahead of it.
    for (sid, mut ts) in by_session {
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

    // At most one non-terminal invocation per session, and it belongs to a running turn.
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

    // Every entry of a session's turn list names a stored turn of that session
    // (retention deletes a turn's entry with its record, or leaves it to its window's
    // drop: see `left_to_window`).
    let windows: Vec<WindowInfo> = kv.windows()?;
    let (ls, le) = keys::session_turn_range();
    for (k, v) in kv.scan(&ls, &le, false, usize::MAX)? {
        let id = String::from_utf8_lossy(&v).to_string();
        let sid = keys::session_of(&k).unwrap_or_default();
        let known = |t: &TurnRecord| t.session_id == sid;
        let seq = keys::seq_suffix(&k).unwrap_or_default();
        let meta = by_id.get(sid.as_str()).copied();
        let before_active = meta.is_some_and(|m| m.active_from.is_none_or(|a| seq < a));
        // On a live daemon a turn admitted after the turns were read is read now.
        let left = before_active && left_to_window(meta, &k, &windows);
        if !(left
            || turns.get(&id).is_some_and(known)
            || store.turn_record(&id)?.is_some_and(|t| known(&t)))
        {
            out.push(Violation {
                invariant: "list_entry_dangling".into(),
                turn_id: Some(id),
                session_id: Some(sid),
                detail: format!(
                    "the session's turn list holds seq {} naming no stored turn of the session",
                    keys::seq_suffix(&k).unwrap_or_default()
                ),
            });
        }
    }

    routes_reachable(store, &by_id, &mut out)?;

    // A session's stored counts by status are those of its stored turns
    // (admission, every status change and retention's deletions keep them in step).
    let mut counted: HashMap<&str, turnd_proto::TurnCounts> = HashMap::new();
    for t in turns.values() {
        *counted.entry(&t.session_id).or_default().get_mut(t.status) += 1;
    }
    for m in &metas {
        let have = counted.remove(m.session_id.as_str()).unwrap_or_default();
        if have != m.counts && !counts_agree_now(store, &m.session_id)? {
            out.push(Violation {
                invariant: "counts_mismatch".into(),
                turn_id: None,
                session_id: Some(m.session_id.clone()),
                detail: format!(
                    "the session counts {:?} but its stored turns are {:?}",
                    m.counts, have
                ),
            });
        }
    }

    // Event sequences: contiguous from 1 up to the session's last event; once
    // retention deleted events of the session, ascending and not past it. Every
    // event is about a stored turn (retention deletes a turn's events with it).
    for meta in &metas {
        let mut from: Option<Vec<u8>> = None;
        loop {
            let (values, next) = store.event_values_page(meta.keys(), from.as_deref(), 256)?;
            for (key, events) in values {
                if left_to_window(Some(meta), &key, &windows) {
                    continue;
                }
                for e in events
                    .iter()
                    .filter(|e| !e.turn_id.is_empty() && !turns.contains_key(&e.turn_id))
                {
                    // Admitted after the turns were read, on a live daemon.
                    if store.turn_record(&e.turn_id)?.is_some() {
                        continue;
                    }
                    out.push(Violation {
                        invariant: "event_of_missing_turn".into(),
                        turn_id: Some(e.turn_id.clone()),
                        session_id: Some(meta.session_id.clone()),
                        detail: format!("event seq {} is about a turn that is not stored", e.seq),
                    });
                }
            }
            match next {
                Some(n) => from = Some(n),
                None => break,
            }
        }
        let events = store.stored_events(meta.keys(), 0, usize::MAX)?;
        let mut expect = 1;
        for e in &events {
            let gap = if meta.events_pruned {
                e.seq < expect || e.seq > meta.last_event_seq
            } else {
                e.seq != expect
            };
            if gap {
                out.push(Violation {
                    invariant: "event_gap".into(),
                    turn_id: None,
                    session_id: Some(meta.session_id.clone()),
                    detail: format!("event seq {} follows {}", e.seq, expect.saturating_sub(1)),
                });
            }
            expect = e.seq + 1;
        }
        if !meta.events_pruned
            && expect.saturating_sub(1) != meta.last_event_seq
            && !(events.is_empty() && meta.last_event_seq == 0)
        {
            out.push(Violation {
                invariant: "event_gap".into(),
                turn_id: None,
                session_id: Some(meta.session_id.clone()),
                detail: format!(
                    "last stored event is {} but the session counted {}",
                    expect.saturating_sub(1),
                    meta.last_event_seq
                ),
            });
        }
    }
    Ok(out)
}

/// Whether a key of a session's turn list or events may name a turn that is gone:
/// retention deleted turns of the session (`events_pruned`) and leaves their list
/// entries and event values in their time window to the window's drop
/// (`engine/retention/plan.rs`), which takes them. (A replay after a crash that finds the
/// drop durable but not the mark after it writes such keys of the log to the main
/// database, where they stay, passed over by reads: so the key's window may be
/// dropped.)
fn left_to_window(meta: Option<&SessionMeta>, key: &[u8], windows: &[WindowInfo]) -> bool {
    meta.is_some_and(|m| m.events_pruned)
        && keys::session_route(key)
            .is_some_and(|ms| windows.first().is_some_and(|w| w.start_ms <= ms))
}

/// Every routed key of a session (turn list entry, event value, idempotency key)
/// is where reads of the session look: its session has a meta whose
/// `routed_from_ms` is at or before the key's route. And an event value is routed by
/// the newest turn among its events, so that the window it is in outlives each of
/// them (see [`crate::windows`]).
fn routes_reachable(
    store: &Store,
    metas: &HashMap<&str, &SessionMeta>,
    out: &mut Vec<Violation>,
) -> Result<(), StoreError> {
    let kv = store.kv();
    for (s, e) in [
        keys::session_turn_range(),
        (vec![b'E'], vec![b'F']),
        (vec![b'K'], vec![b'L']),
    ] {
        for (k, v) in kv.scan(&s, &e, false, usize::MAX)? {
            let Some(route) = keys::session_route(&k) else {
                continue;
            };
            let sid = k
                .get(1..)
                .and_then(|b| b.split(|c| *c == 0).next())
                .map(|b| String::from_utf8_lossy(b).to_string())
                .unwrap_or_default();
            let from = metas.get(sid.as_str()).and_then(|m| m.routed_from_ms);
            if from.is_none_or(|f| route < f) {
                out.push(Violation {
                    invariant: "routed_key_unreachable".into(),
                    turn_id: None,
                    session_id: Some(sid.clone()),
                    detail: format!(
                        "a key routed at {route} ({:?}) is before where its session's reads look ({from:?})",
                        String::from_utf8_lossy(&k)
                    ),
                });
            }
            if k.first() == Some(&b'E') {
                let newest = crate::event_value(&v)?
                    .iter()
                    .filter_map(|e| keys::turn_ms(&e.turn_id))
                    .max();
                if newest != Some(route) {
                    out.push(Violation {
                        invariant: "event_value_misrouted".into(),
                        turn_id: None,
                        session_id: Some(sid),
                        detail: format!(
                            "an event value routed at {route} holds events whose newest turn is of {newest:?}"
                        ),
                    });
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{mem::MemKv, Batch, RawJson, SessionMeta};
    use serde_json::json;
    use std::sync::Arc;
    use turnd_proto::{Event, EventKind};

    fn invariants(store: &Store) -> Vec<String> {
        let mut v: Vec<String> = check_store(store)
            .expect("check")
            .into_iter()
            .map(|v| v.invariant)
            .collect();
        v.sort();
        v
    }

    /// What a torn or half-done deletion would leave: a turn-list entry naming no
    /// turn, an event about a turn that is not stored, counts that are not those of
    /// the stored turns. A whole store has none of them.
    #[tokio::test]
    async fn leftovers_of_deleted_turns_are_reported() {
        let store = Store::new(Arc::new(MemKv::new()));
        let input = RawJson::from_value(&json!(null));
        let mut t = TurnRecord::admitted("t1".into(), "s", 1, "f", input, 0);
        t.status = TurnStatus::Completed;
        t.phase = Phase::Done;
        let mut meta = SessionMeta::new("s");
        meta.last_turn_seq = 1;
        meta.last_event_seq = 1;
        meta.counts.completed = 1;
        let ev = |seq: u64, turn: &str| Event {
            seq,
            session_id: "s".into(),
            turn_id: turn.into(),
            at_ms: 0,
            kind: EventKind::Admitted,
            detail: json!({}),
        };
        let mut b = Batch::new();
        b.put_admission(&t);
        b.put_turn(&t);
        b.put_session_meta(&meta);
        b.put_events(&[ev(1, "t1")]);
        store.commit(b).await.expect("commit");
        assert!(invariants(&store).is_empty(), "{:?}", invariants(&store));

        let mut b = Batch::new();
        b.put_raw(keys::session_turn("s", 2), b"t-gone".to_vec());
        meta.last_turn_seq = 2;
        meta.last_event_seq = 2;
        meta.counts.completed = 2;
        b.put_session_meta(&meta);
        b.put_events(&[ev(2, "t-gone")]);
        store.commit(b).await.expect("commit");
        assert_eq!(
            invariants(&store),
            vec![
                "counts_mismatch",
                "event_of_missing_turn",
                "list_entry_dangling"
            ]
        );
    }
}
