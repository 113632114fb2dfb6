//! The invariants of sessions: where recovery starts in each turn list names an
//! unfinished turn, every turn list entry names a stored turn of its session, every
//! routed key is where the session's reads look (and an event value is routed by
//! its newest turn), the stored counts are those of the stored turns, and events
//! are about stored turns, numbered without gaps.

use std::collections::HashMap;

use turnd_proto::Violation;

use super::{violation, Sessions, Turns};
use crate::error::StoreError;
use crate::model::events::event_value;
use crate::model::keys;
use crate::model::records::{SessionMeta, TurnRecord};
use crate::store::Store;
use crate::windows::WindowInfo;

/// `active_index_dangling`, `terminal_lock_holder`: where recovery starts reading
/// each session's turn list (the meta's `active_from`) names a stored turn, and one
/// that is not finished. Returns those marks by session.
pub(super) fn recovery_marks<'m>(
    store: &Store,
    sessions: &Sessions<'m>,
    turns: &Turns,
    out: &mut Vec<Violation>,
) -> Result<HashMap<&'m str, u64>, StoreError> {
    let mut marks = HashMap::new();
    for m in sessions.all {
        let Some(seq) = m.active_from else { continue };
        marks.insert(m.session_id.as_str(), seq);
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
    Ok(marks)
}

/// `list_entry_dangling`: every entry of a session's turn list names a stored turn
/// of that session (retention deletes a turn's entry with its record, or leaves it
/// to its window's drop: see [`left_to_window`]).
pub(super) fn list_entries(
    store: &Store,
    turns: &Turns,
    sessions: &Sessions<'_>,
    windows: &[WindowInfo],
    out: &mut Vec<Violation>,
) -> Result<(), StoreError> {
    let (ls, le) = keys::session_turn_range();
    for (k, v) in store.kv().scan(&ls, &le, false, usize::MAX)? {
        let id = String::from_utf8_lossy(&v).to_string();
        let sid = keys::session_of(&k).unwrap_or_default();
        let known = |t: &TurnRecord| t.session_id == sid;
        let seq = keys::seq_suffix(&k).unwrap_or_default();
        let meta = sessions.by_id.get(sid.as_str()).copied();
        let before_active = meta.is_some_and(|m| m.active_from.is_none_or(|a| seq < a));
        // On a live daemon a turn admitted after the turns were read is read now.
        let left = before_active && left_to_window(meta, &k, windows);
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
    Ok(())
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

/// `routed_key_unreachable`, `event_value_misrouted`: every routed key of a session
/// (turn list entry, event value, idempotency key) is where reads of the session
/// look: its session has a meta whose `routed_from_ms` is at or before the key's
/// route. And an event value is routed by the newest turn among its events, so that
/// the window it is in outlives each of them (see [`crate::windows`]).
pub(super) fn routes_reachable(
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
                event_value_routed(&v, route, sid, out)?;
            }
        }
    }
    Ok(())
}

/// `event_value_misrouted`: an event value routed at `route` is routed by the newest
/// turn among its events.
fn event_value_routed(
    value: &[u8],
    route: u64,
    sid: String,
    out: &mut Vec<Violation>,
) -> Result<(), StoreError> {
    let newest = event_value(value)?
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
    Ok(())
}

/// `counts_mismatch`: a session's stored counts by status are those of its stored
/// turns (admission, every status change and retention's deletions keep them in
/// step).
pub(super) fn counts(
    store: &Store,
    turns: &Turns,
    metas: &[SessionMeta],
    out: &mut Vec<Violation>,
) -> Result<(), StoreError> {
    let mut counted: HashMap<&str, turnd_proto::TurnCounts> = HashMap::new();
    for t in turns.values() {
        *counted.entry(&t.session_id).or_default().get_mut(t.status) += 1;
    }
    for m in metas {
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
    Ok(())
}

/// Whether a session's stored counts are those of its stored turns, read again on
/// their own: on a live daemon a turn admitted or ended between the whole-store
/// reads of `check_store` makes them differ there. The session's meta is read
/// before and after its turns, and the reads are repeated while it changed: its
/// last event (a turn admitted or ended) or its counts (retention deletes turns and
/// lowers the counts without an event).
pub(super) fn counts_agree_now(store: &Store, session_id: &str) -> Result<bool, StoreError> {
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
        if after
            .is_some_and(|a| a.last_event_seq == before.last_event_seq && a.counts == before.counts)
        {
            break;
        }
    }
    Ok(agree)
}

/// `event_of_missing_turn`: every event of the session is about a stored turn
/// (retention deletes a turn's events with it, or leaves them to its window's drop).
pub(super) fn events_of_stored_turns(
    store: &Store,
    meta: &SessionMeta,
    turns: &Turns,
    windows: &[WindowInfo],
    out: &mut Vec<Violation>,
) -> Result<(), StoreError> {
    let mut from: Option<Vec<u8>> = None;
    loop {
        let (values, next) = store.event_values_page(meta.keys(), from.as_deref(), 256)?;
        for (key, events) in values {
            if left_to_window(Some(meta), &key, windows) {
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
            None => return Ok(()),
        }
    }
}

/// `event_gap`: a session's events are contiguous from 1 up to its last event;
/// once retention deleted events of the session, ascending and not past it.
pub(super) fn event_sequence(
    store: &Store,
    meta: &SessionMeta,
    out: &mut Vec<Violation>,
) -> Result<(), StoreError> {
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
    Ok(())
}
