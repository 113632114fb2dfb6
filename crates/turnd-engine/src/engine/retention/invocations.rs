//! The invocation records of finished turns' earlier steps and attempts, under their
//! own keys until retention deletes them with their turns.

use std::collections::HashMap;

use turnd_store::{keys, Batch, Store, StoreError};

/// Keys of invocation records under their own keys dispatched at or before a sweep's
/// cutoff, by turn ([`early_invocations`]).
pub(super) type Early = HashMap<String, Vec<Vec<u8>>>;

/// Invocation records read per page of [`early_invocations`].
pub(super) const INVOCATION_PAGE: usize = 1024;

/// The invocation records under their own keys (in the main database) whose ids were
/// minted at or before `cutoff` (wall clock), by turn. A finished turn's last invocation is folded into its
/// record; those of its earlier steps and attempts stay under their own keys until
/// retention deletes them with the turn. A turn's events name them, but a turn left
/// to its window has none read ([`left_to_window`]), so they are found here: an
/// invocation id begins with its own UUIDv7 (`inv_` and 32 hex digits), so the keys
/// are in dispatch order and the read stops at the cutoff. What it reads is what was
/// dispatched since the last sweep's cutoff, and the invocations of turns that have
/// run longer than `retention_terminal_ms`. One whose turn is gone by the time it is
/// read (minted with a wall clock ahead of the engine's) is deleted then.
pub(super) fn early_invocations(store: &Store, cutoff: u64) -> Result<Early, StoreError> {
    let mut from = keys::invocation("inv_");
    let end = keys::invocation(&format!("inv_{:012x}", cutoff.saturating_add(1)));
    let mut out: Early = HashMap::new();
    loop {
        let page = store.kv().scan(&from, &end, false, INVOCATION_PAGE)?;
        for (k, v) in &page {
            let inv: turnd_store::InvocationRecord = serde_json::from_slice(v)
                .map_err(|e| StoreError::Corrupt(format!("invocation: {e}")))?;
            out.entry(inv.turn_id).or_default().push(k.clone());
        }
        match turnd_store::next_page(&page, INVOCATION_PAGE) {
            Some(next) => from = next,
            None => return Ok(out),
        }
    }
}

/// Deletes of the invocation records of `early` whose turns are gone and that are
/// still there.
pub(super) fn stale_invocations(store: &Store, early: &Early) -> Result<Batch, StoreError> {
    let mut b = Batch::new();
    for (turn_id, ks) in early {
        if store.turn_exists(turn_id)? {
            continue;
        }
        for k in ks {
            if store.kv().get(k)?.is_some() {
                b.delete(k.clone());
            }
        }
    }
    Ok(b)
}
