//! `store.check`: the invariants of the semantics page, checked over a whole store.
//! Works on a live daemon's store and offline on a stopped daemon's data directory.
//!
//! [`check_store`] reads the turns (live and folded) and invocations once, then runs
//! one function per invariant over them and the sessions' metas: those of turns and
//! invocations in [`turns`], those of sessions (recovery's marks, turn lists,
//! routes, counts, events) in [`sessions`]. Each reports a [`Violation`] named by
//! the invariant it breaks.

mod sessions;
#[cfg(test)]
mod tests;
mod turns;

use std::collections::HashMap;

use turnd_proto::Violation;

use crate::error::StoreError;
use crate::model::records::{InvocationRecord, SessionMeta, TurnRecord};
use crate::store::Store;

/// Check every invariant and return each violation found.
pub fn check_store(store: &Store) -> Result<Vec<Violation>, StoreError> {
    let kv = &**store.kv();
    let mut out = Vec::new();
    let mut turns = turns::live_turns(kv)?;
    let invs = turns::invocations(kv)?;
    turns::inputs_stored_apart(kv, &turns, &mut out)?;
    turns::folded_records(kv, &mut turns, &invs, &mut out)?;
    turns::dropped_windows_gone(kv, &mut out)?;
    let metas = store.session_metas()?;
    let sessions = Sessions::new(&metas);
    let marks = sessions::recovery_marks(store, &sessions, &turns, &mut out)?;
    let unfinished = turns::turn_states(store, &turns, &invs, &sessions, &marks, &mut out)?;
    turns::suspended_turns(&unfinished, &invs, &mut out);
    turns::lock_holders(unfinished, &mut out);
    turns::live_invocations(&turns, &invs, &mut out);
    let windows = kv.windows()?;
    sessions::list_entries(store, &turns, &sessions, &windows, &mut out)?;
    sessions::routes_reachable(store, &sessions.by_id, &mut out)?;
    sessions::counts(store, &turns, &metas, &mut out)?;
    for meta in &metas {
        sessions::events_of_stored_turns(store, meta, &turns, &windows, &mut out)?;
        sessions::event_sequence(store, meta, &mut out)?;
    }
    Ok(out)
}

/// Every stored turn by id: live ones under their own keys, then finished ones from
/// their folded records.
type Turns = HashMap<String, TurnRecord>;

/// Every invocation stored under its own key, by id.
type Invocations = HashMap<String, InvocationRecord>;

/// The sessions' metas, by session id.
struct Sessions<'a> {
    all: &'a [SessionMeta],
    by_id: HashMap<&'a str, &'a SessionMeta>,
}

impl<'a> Sessions<'a> {
    fn new(metas: &'a [SessionMeta]) -> Sessions<'a> {
        Sessions {
            all: metas,
            by_id: metas.iter().map(|m| (m.session_id.as_str(), m)).collect(),
        }
    }
}

/// A violation about a turn (or, with `t` None, a session) of `session`.
fn violation(invariant: &str, t: Option<&TurnRecord>, session: &str, detail: String) -> Violation {
    Violation {
        invariant: invariant.to_string(),
        turn_id: t.map(|t| t.turn_id.clone()),
        session_id: Some(session.to_string()),
        detail,
    }
}
