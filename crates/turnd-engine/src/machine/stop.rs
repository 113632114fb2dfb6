//! Stop: `turn.stop`, `session.stop`, and the interrupt of a submit with `on_busy`
//! `interrupt` or `rollback`.

use serde_json::json;
use turnd_proto::{EventKind, StopInfo, TurnStatus};
use turnd_store::{Held, InvState, InvWait, InvocationRecord, Phase, PreviousState, TurnRecord};

use super::deadlines::give_up;
use super::dispatch::send_cancel_recorded;
use super::outcomes::cancel_turn;
use super::{Ctx, Tx};

/// Event "stop" of one non-terminal turn (`seq`). A turn stopped already, or
/// terminal, is left as it is.
pub fn stop_turn(cx: &Ctx, tx: &mut Tx, seq: u64, reason: String) {
    let st = cx.st;
    let Some(mut t) = tx.take(st, seq) else {
        return;
    };
    if t.status.is_terminal() || t.stop.is_some() {
        return;
    }
    let reason = if reason.is_empty() {
        "stop requested".to_string()
    } else {
        reason
    };
    t.stop = Some(Box::new(StopInfo {
        requested_at_ms: tx.now,
        reason: reason.clone(),
    }));
    tx.event_value(
        &st.id,
        &t.turn_id,
        EventKind::StopRequested,
        json!({"reason": reason}),
    );
    let is_holder = tx.holder_seq(st) == Some(seq);
    let live = if is_holder {
        tx.live(st).cloned()
    } else {
        None
    };
    match live {
        Some(mut inv) if t.phase == Phase::Invoked => {
            if cx.worker_connected && inv.wait != InvWait::AwaitingReconnect {
                if inv.wait != InvWait::Cancelling {
                    inv.wait = InvWait::Cancelling;
                    inv.wait_since_ms = tx.now;
                    inv.deadline_ms = tx.now + cx.cfg.turns.cancel_grace_ms;
                }
                send_cancel_recorded(tx, &st.id, &t.turn_id, &inv, &reason);
                tx.put_invocation(st, inv);
                tx.put_turn(st, t);
            } else {
                // Waiting for a reconnect: cancelled at once, the invocation abandoned;
                // a result that still arrives is a late result.
                give_up(cx, tx, inv, InvState::Abandoned);
                cancel_turn(cx, tx, t, None);
            }
        }
        #[cfg(feature = "planted-stop-keeps-lock")]
        _ if is_holder => cancelled_in_place(cx, tx, t),
        #[cfg(not(feature = "planted-stop-keeps-lock"))]
        _ if is_holder => cancel_turn(cx, tx, t, None),
        // A queued turn behind the holder: cancelled at once, never dispatched.
        _ => cancel_queued(tx, st, t),
    }
}

/// The planted bug of the feature `planted-stop-keeps-lock`: the holder is cancelled
/// as a queued turn is, and no next turn takes the lock.
#[cfg(feature = "planted-stop-keeps-lock")]
fn cancelled_in_place(cx: &Ctx, tx: &mut Tx, mut t: turnd_store::TurnRecord) {
    let detail = json!({"stop": t.stop, "step": t.step});
    t.status = TurnStatus::Cancelled;
    t.phase = Phase::Done;
    t.finished_at_ms = Some(tx.now);
    tx.event_value(&cx.st.id, &t.turn_id, EventKind::Cancelled, detail);
    tx.put_turn(cx.st, t);
}

/// Event "stop" of every non-terminal turn of the session.
pub fn stop_session(cx: &Ctx, tx: &mut Tx, reason: &str) {
    let seqs: Vec<u64> = cx.st.active.seqs().collect();
    // Queued turns first, newest first, so stopping the holder promotes nothing.
    for seq in seqs.iter().rev() {
        stop_turn(cx, tx, *seq, reason.to_string());
    }
}

/// How a submit with `on_busy` `interrupt` or `rollback` stops the session's
/// unfinished turns.
#[derive(Debug, Clone, Copy)]
pub struct Interrupt<'a> {
    /// The interrupting turn (named in each stop).
    pub by: &'a str,
    /// `rollback`: the stopped turns are marked superseded.
    pub superseded: bool,
}

/// What an interrupt stopped: the turns' ids, and the lock holder's last durable
/// state (its `previous` for the new turn) when there was one.
#[derive(Debug, Clone, Default)]
pub struct Interrupted {
    pub turn_ids: Vec<String>,
    pub previous: Option<PreviousState>,
}

/// Event "interrupt": every unfinished turn of the session ends at once, cancelled
/// with the stop reason `interrupted` (or the stop it had already), the queued ones
/// first. The lock holder's live invocation gets `cancel` and is abandoned; while it
/// may still run on its connected worker the session holds (its meta's `held`) until
/// its result arrives or `turns.cancel_grace_ms` passes, so the next step never runs
/// beside it.
pub fn interrupt(cx: &Ctx, tx: &mut Tx, how: Interrupt) -> Interrupted {
    let st = cx.st;
    let holder = tx.holder_seq(st);
    let seqs: Vec<u64> = st.active.seqs().collect();
    let mut out = Interrupted::default();
    for seq in seqs.into_iter().rev() {
        let Some(mut t) = tx.take(st, seq).filter(|t| !t.status.is_terminal()) else {
            continue;
        };
        t.superseded |= how.superseded;
        if t.stop.is_none() {
            t.stop = Some(Box::new(StopInfo {
                requested_at_ms: tx.now,
                reason: "interrupted".into(),
            }));
            let mut detail = json!({"reason": "interrupted", "by": how.by});
            if how.superseded {
                detail["superseded"] = json!(true);
            }
            tx.event_value(&st.id, &t.turn_id, EventKind::StopRequested, detail);
        }
        out.turn_ids.push(t.turn_id.clone());
        if Some(seq) != holder {
            cancel_queued(tx, st, t);
            continue;
        }
        out.previous = Some(PreviousState {
            turn_id: t.turn_id.clone(),
            status: TurnStatus::Cancelled,
            state: t.state().clone(),
        });
        if let Some(inv) = tx.live(st).cloned().filter(|_| t.phase == Phase::Invoked) {
            abandon_for_interrupt(cx, tx, &t.turn_id, inv);
        }
        cancel_turn(cx, tx, t, None);
    }
    out.turn_ids.reverse();
    out
}

/// The interrupted holder's live invocation: `cancel` sent when its worker is there
/// to get it, then abandoned; the session holds for it while it may still run.
fn abandon_for_interrupt(cx: &Ctx, tx: &mut Tx, turn_id: &str, inv: InvocationRecord) {
    let reachable = cx.worker_connected && inv.wait != InvWait::AwaitingReconnect;
    if reachable {
        send_cancel_recorded(tx, &cx.st.id, turn_id, &inv, "interrupted");
    }
    let (id, worker) = (inv.invocation_id.clone(), inv.worker_id.clone());
    give_up(cx, tx, inv, InvState::Abandoned);
    if !reachable {
        return;
    }
    let until = tx.now + cx.cfg.turns.cancel_grace_ms;
    // A worker that cannot cancel is held for to the attempt's deadline already
    // (`give_up`), when that is later.
    if tx
        .meta
        .held
        .as_deref()
        .is_some_and(|h| h.invocation_id == id && h.until_ms >= until)
    {
        return;
    }
    tx.meta.held = Some(Box::new(Held {
        invocation_id: id,
        turn_id: turn_id.to_string(),
        worker_id: worker,
        since_ms: tx.now,
        until_ms: until,
    }));
}

/// A turn queued behind the holder, cancelled at once (never dispatched).
fn cancel_queued(tx: &mut Tx, st: &crate::session::SessionState, mut t: TurnRecord) {
    let detail = json!({"stop": t.stop, "step": t.step});
    t.status = TurnStatus::Cancelled;
    t.phase = Phase::Done;
    t.finished_at_ms = Some(tx.now);
    tx.event_value(&st.id, &t.turn_id, EventKind::Cancelled, detail);
    tx.put_turn(st, t);
}
