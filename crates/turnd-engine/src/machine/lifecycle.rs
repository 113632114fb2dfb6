//! What happens to a session outside its turns' own events: the daemon restarted
//! with an invocation of it in flight, and retention deleted some of its finished
//! turns (and may forget the session).

use turnd_proto::{TurnCounts, TurnStatus};
use turnd_store::{InvWait, SessionMeta};

use super::{Ctx, Tx};

/// Event "recovered": the daemon started with this session's invocation in flight.
/// Its worker reconnects (or not) from now: the invocation waits a fresh
/// `reconnect_grace_ms` for it. A cancel in progress keeps its own (earlier)
/// deadline.
pub fn recovered(cx: &Ctx, tx: &mut Tx) {
    let Some(mut inv) = tx
        .live(cx.st)
        .filter(|i| i.wait != InvWait::Cancelling)
        .cloned()
    else {
        return;
    };
    inv.wait = InvWait::AwaitingReconnect;
    inv.wait_since_ms = tx.now;
    inv.deadline_ms = tx.now + cx.cfg.turns.reconnect_grace_ms;
    tx.put_invocation(cx.st, inv);
}

/// What retention deleted of a session: the statuses of its deleted turns, whether
/// events were taken out of its stored values (or left to a window's drop), and
/// whether a watch is on the session.
#[derive(Debug, Clone, Copy)]
pub struct Expiry<'a> {
    pub statuses: &'a [TurnStatus],
    pub pruned: bool,
    pub watched: bool,
}

/// What became of a session some of whose finished turns retention deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpiryVerdict {
    /// It keeps its meta, with the counts less the deleted turns.
    Kept,
    /// Nothing of it is left (no turn, no unfinished work, no watcher, no timer, no
    /// write to retry): it is forgotten, and a later submit starts it again from
    /// `seq` 1. The shell deletes its meta and every key left of it.
    Forgotten,
}

/// Event "expired": retention deleted finished turns of the session. Their counts
/// leave the session's; a session left with nothing is forgotten.
pub fn expired(cx: &Ctx, tx: &mut Tx, gone: Expiry) -> ExpiryVerdict {
    let st = cx.st;
    uncount(&mut tx.meta.counts, gone.statuses);
    tx.meta.events_pruned |= gone.pruned;
    let forget = total(&tx.meta.counts) == 0
        && st.active.len() == 0
        && st.pending.is_none()
        && st.timer.is_none()
        && !gone.watched;
    if !forget {
        return ExpiryVerdict::Kept;
    }
    tx.meta = SessionMeta::new(&st.id);
    ExpiryVerdict::Forgotten
}

/// Turns of all statuses in `c`.
pub fn total(c: &TurnCounts) -> u64 {
    c.queued + c.running + c.completed + c.failed + c.cancelled
}

/// `counts` less one turn of each of `statuses`.
pub fn uncount(counts: &mut TurnCounts, statuses: &[TurnStatus]) {
    for s in statuses {
        let c = counts.get_mut(*s);
        *c = c.saturating_sub(1);
    }
}
