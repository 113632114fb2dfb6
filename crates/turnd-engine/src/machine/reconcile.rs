//! A worker's `hello`: the reconcile of each invocation assigned to it against the
//! lists it sent (in flight, finished), and invocations it never received.

use turnd_store::{InvState, InvWait, InvocationRecord, TurnRecord};

use super::deadlines::{give_up, outcome_unknown};
use super::dispatch::{dispatch, send_cancel};
use super::outcomes::cancel_turn;
use super::{Ctx, Tx};

/// What reconcile decided for one invocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The worker still runs it (or holds its result): it goes on.
    Kept,
    /// The worker never received it: dispatched again with the same attempt.
    Redispatched,
    /// The worker restarted: its outcome is unknown.
    Unknown,
}

/// Event "reconnect lists": a worker instance `instance_id` said hello listing
/// `inflight` and `finished`; reconcile the session's live invocation
/// `invocation_id` (None: it is not the live one any more, nothing to do).
pub fn reconcile(
    cx: &Ctx,
    tx: &mut Tx,
    invocation_id: &str,
    instance_id: &str,
    inflight: &[String],
    finished: &[String],
) -> Option<Verdict> {
    let st = cx.st;
    let mut inv = st.current_inv(invocation_id).cloned()?;
    let h = st.holder().cloned()?;
    let now = tx.now;
    if inv.instance_id != instance_id {
        outcome_unknown(
            cx,
            tx,
            h,
            inv,
            "the worker restarted (new instance_id) while the invocation was outstanding",
        );
        return Some(Verdict::Unknown);
    }
    if inflight.iter().any(|i| i == invocation_id) {
        if inv.wait == InvWait::Cancelling {
            send_cancel(tx, &inv, "stop requested");
        } else {
            // Kept: the attempt's own deadline applies again (a deadline that passed
            // while it was away leads to a probe at once).
            inv.wait = InvWait::AwaitingResult;
            inv.wait_since_ms = now;
            inv.deadline_ms = inv.attempt_deadline_ms.max(now);
        }
        tx.put_invocation(st, inv);
        Some(Verdict::Kept)
    } else if finished.iter().any(|i| i == invocation_id) {
        inv.wait = InvWait::AwaitingResend;
        inv.wait_since_ms = now;
        inv.deadline_ms = now + cx.cfg.turns.probe_timeout_ms;
        tx.put_invocation(st, inv);
        Some(Verdict::Kept)
    } else {
        lost(
            cx,
            tx,
            h,
            inv,
            "the worker reconnected without it: it never received the invocation",
        );
        Some(Verdict::Redispatched)
    }
}

/// An invocation the worker never received: dispatch again with the same attempt.
pub(super) fn lost(cx: &Ctx, tx: &mut Tx, h: TurnRecord, inv: InvocationRecord, reason: &str) {
    give_up(cx, tx, inv.clone(), InvState::Lost);
    if h.stop.is_some() {
        cancel_turn(cx, tx, h, None);
    } else {
        dispatch(tx, h, Some((&inv, reason)));
    }
}
