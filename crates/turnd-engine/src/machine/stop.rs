//! Stop: `turn.stop` and `session.stop`.

use serde_json::json;
use turnd_proto::{EventKind, StopInfo, TurnStatus};
use turnd_store::{InvState, InvWait, Phase};

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
    tx.event(
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
        _ => {
            // A queued turn behind the holder: cancelled at once, never dispatched.
            let detail = json!({"stop": t.stop, "step": t.step});
            t.status = TurnStatus::Cancelled;
            t.phase = Phase::Done;
            t.finished_at_ms = Some(tx.now);
            tx.event(&st.id, &t.turn_id, EventKind::Cancelled, detail);
            tx.put_turn(st, t);
        }
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
    tx.event(&cx.st.id, &t.turn_id, EventKind::Cancelled, detail);
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
