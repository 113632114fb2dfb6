//! Admission: a new turn joins the session's FIFO and, when it is first, is wanted
//! dispatched; with `on_busy` `interrupt` or `rollback` it first stops the
//! session's unfinished turns.

use turnd_proto::{EventKind, OnBusy};
use turnd_store::{IdempotencyRecord, RawJson, TurnDispatch, TurnRecord};

use super::details;
use super::dispatch::promote;
use super::stop::{interrupt, Interrupt, Interrupted};
use super::{Ctx, Tx};

/// A validated `turn.submit` (the shell checked ids, sizes and idempotency).
#[derive(Debug, Clone)]
pub struct Submission {
    /// The new turn's id, minted by the shell.
    pub turn_id: String,
    pub function_id: String,
    pub input: RawJson,
    pub idempotency_key: Option<String>,
    pub turn_timeout_ms: Option<u64>,
    /// Dispatch settings in place of the function's, for every dispatch of the turn.
    pub dispatch: Option<TurnDispatch>,
    /// The first retry's backoff in place of `turns.retry_backoff_ms`.
    pub retry_backoff_ms: Option<u64>,
    /// What to do with the session's unfinished turns (`reject` is the shell's: it
    /// never reaches the machine).
    pub on_busy: OnBusy,
}

/// Event "submit": admit a turn at the end of the session's queue (after stopping
/// the session's unfinished turns, with `on_busy` `interrupt` or `rollback`).
/// Returns what it stopped.
pub fn submit(cx: &Ctx, tx: &mut Tx, s: Submission) -> Interrupted {
    let st = cx.st;
    let now = tx.now;
    let interrupted = if s.on_busy.interrupts() {
        let how = Interrupt {
            by: &s.turn_id,
            superseded: s.on_busy == OnBusy::Rollback,
        };
        interrupt(cx, tx, how)
    } else {
        Interrupted::default()
    };
    tx.meta.last_turn_seq += 1;
    let seq = tx.meta.last_turn_seq;
    let mut t = TurnRecord::admitted(s.turn_id.clone(), &st.id, seq, &s.function_id, s.input, now);
    t.idempotency_key = s.idempotency_key.clone();
    t.deadline_ms = s.turn_timeout_ms.map(|d| now + d);
    t.dispatch = s.dispatch.map(Box::new);
    if let Some(b) = s.retry_backoff_ms {
        t.backoff_ms = b;
    }
    t.previous = interrupted.previous.clone().map(Box::new);
    let detail = details::admitted(
        &t.function_id,
        seq,
        t.idempotency_key.as_deref(),
        s.on_busy
            .interrupts()
            .then_some((s.on_busy, &interrupted.turn_ids[..])),
    );
    tx.event(&st.id, &s.turn_id, EventKind::Admitted, detail);
    if let Some(key) = s.idempotency_key {
        tx.idempotency = Some((key, IdempotencyRecord { turn_id: s.turn_id }));
    }
    tx.put_turn_from(t, None);
    promote(cx, tx);
    interrupted
}
