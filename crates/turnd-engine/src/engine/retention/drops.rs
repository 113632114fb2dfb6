//! The windows a sweep drops whole, and the event values it writes out of a window
//! before that (see the parent module's doc).

use std::collections::HashMap;

use turnd_store::{windows, Batch, Store, StoreError, WindowInfo};

/// How long after a window's end turn ids may still be minted in it and not yet be
/// stored (an admission in progress); such a turn, should it finish after its
/// window was dropped, is stored in the main database instead, so this only keeps
/// that rare case rarer.
pub(super) const MINT_MARGIN_MS: u64 = 1_000;

/// The windows that can be dropped whole: not the newest (which takes new turns),
/// ended more than [`MINT_MARGIN_MS`] ago by the wall clock that mints turn ids, with
/// no folded record left (every turn of it expired and deleted) and no unfinished
/// turn minted in it.
pub(super) fn empty_windows(store: &Store, wall_ms: u64) -> Result<Vec<WindowInfo>, StoreError> {
    let kv = store.kv();
    let mut out = Vec::new();
    for w in kv.windows()? {
        let Some(end) = w.end_ms else { continue };
        if w.dropped || end.saturating_add(MINT_MARGIN_MS) > wall_ms {
            continue;
        }
        let (fs, fe) = windows::finished_key_range(w.start_ms, Some(end));
        let (ts, te) = windows::turn_key_range(w.start_ms, Some(end));
        // Unfinished turns first: a turn that finishes between the two reads moves from
        // the second range into the first, and is seen there. (One that finishes after
        // them is moved to the main database when the drop is taken.)
        if kv.scan(&ts, &te, false, 1)?.is_empty() && kv.scan(&fs, &fe, false, 1)?.is_empty() {
            out.push(w);
        }
    }
    Ok(out)
}

/// Event values read per page of a window's rescue.
pub(super) const RESCUE_PAGE: usize = 512;

/// The writes that keep, before the window `w` is dropped, the events it
/// holds of turns still stored. An event value is stored in the window of the
/// newest turn among its events, and retention leaves a deleted turn's values to its
/// window's drop; so a value of a turn the window is dropped for can also hold events
/// of an older turn, of an older window, that is still stored (one that was running
/// while the newer one was queued, and ended after it). Such a value is written again
/// with those events only, routed by the newest of their turns, out of this window.
/// The window holds no stored turn of its own by now ([`empty_windows`]), so every
/// value in it holds events of turns that are gone.
///
/// So a value whose events are all of turns minted in the window has nothing to keep,
/// and only its events' turn ids are read: those turns are deleted, and one stored
/// since (an admission committed late) is passed on whole by the drop, with every
/// value of its session the window holds (`turnd_store::windows::leftovers`). Only a
/// value with an event of another turn is read whole and each of its turns looked up.
pub(super) fn rescue(store: &Store, w: &WindowInfo) -> Result<Batch, StoreError> {
    let mut b = Batch::new();
    let mut stored: HashMap<String, bool> = HashMap::new();
    let own = |turn_id: &str| windows::turn_ms(turn_id).is_some_and(|ms| w.holds(ms));
    let (mut from, end) = (vec![b'E'], vec![b'E' + 1]);
    loop {
        let page = store
            .kv()
            .scan_window(w.start_ms, &from, &end, RESCUE_PAGE)?;
        for (_, v) in &page {
            if turnd_store::event_heads(v)?.iter().all(|h| own(&h.turn_id)) {
                continue;
            }
            let mut kept = Vec::new();
            for e in turnd_store::event_value(v)? {
                if store.turn_stored(&e.turn_id, &mut stored)? {
                    kept.push(e);
                }
            }
            b.put_events_in(&kept, true);
        }
        match turnd_store::next_page(&page, RESCUE_PAGE) {
            Some(next) => from = next,
            None => return Ok(b),
        }
    }
}

/// The open time windows: what a window's drop will take.
pub(super) struct Open(pub(super) Vec<WindowInfo>);

impl Open {
    pub(super) fn read(store: &Store) -> Result<Open, StoreError> {
        Ok(Open(
            store
                .kv()
                .windows()?
                .into_iter()
                .filter(|w| !w.dropped)
                .collect(),
        ))
    }

    /// Whether the keys routed at `ms` are in an open window (a turn's folded record,
    /// list entry and idempotency key by its id's time).
    pub(super) fn holds(&self, ms: Option<u64>) -> bool {
        ms.is_some_and(|ms| self.0.iter().any(|w| w.holds(ms)))
    }
}
