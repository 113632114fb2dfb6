//! The turn state machine as pure transitions.
//!
//! Every function here takes a session's state (through [`Ctx`]), an event and `now`
//! (in the [`Tx`]) and builds the transition in the `Tx`: the records to write, the
//! durable events, and the effects to carry out once the write is durable, as plain
//! data ([`Effect`]). Nothing here locks, reads the store, asks the worker registry or
//! touches a runtime: what a transition needs to know about the world comes in with
//! the event ([`Ctx::worker_connected`], a [`Grant`], a stored record the caller
//! read). The engine (`engine/*.rs`) is the shell around it: it locks the session,
//! calls a transition, settles the slots ([`Tx::frees`], [`Tx::dispatch`] answered
//! with [`grant`]), commits the batch and then carries out the effects.
//!
//! Events and their transitions:
//!
//! | event | function |
//! |---|---|
//! | `turn.submit` | [`submit`] |
//! | a dispatch slot granted (or refused) | [`grant`] |
//! | a step's result | [`result`] |
//! | a late result (an invocation no longer current) | [`late_result`] |
//! | `invocation.heartbeat` | [`heartbeat`] |
//! | `invocation.status` (a probe answer) | [`probe_answer`] |
//! | the session's next deadline, a disconnect, freed capacity | [`due`] |
//! | a worker's `hello` (its in-flight and finished lists) | [`reconcile`] |
//! | `turn.stop`, `session.stop` | [`stop_turn`], [`stop_session`] |
//! | `turn.resume` of a turn suspended for input | [`resume`] (a [`ResumeVerdict`]) |
//! | `turn.submit` with `on_busy` `interrupt` or `rollback` | [`submit`] (which stops the session's unfinished turns first) |
//! | the daemon started with an invocation in flight | [`recovered`] |
//! | retention deleted finished turns | [`expired`] (an [`ExpiryVerdict`]) |
//!
//! Each returns what it decided where the shell needs to know (whether a result was
//! the live invocation's, a [`LateVerdict`], a [`Verdict`], ...); the rest of its
//! decision is in the `Tx`. A function per event rather than one entry point: each
//! event's decision has a type of its own, which the shell gets as it is instead of
//! unpacking it from an enum of every decision. [`next_due`] says when the session's
//! timer must fire next.

use turnd_proto::Invoke;
use turnd_store::{FunctionSettings, Phase, RawJson, SessionMeta, TurnRecord};

use crate::config::EngineConfig;
use crate::session::SessionState;

mod admission;
mod deadlines;
mod details;
mod dispatch;
mod input;
mod lifecycle;
mod outcomes;
mod reconcile;
mod results;
mod stop;
mod tx;

#[cfg(test)]
mod hold_tests;
#[cfg(test)]
mod input_tests;
#[cfg(test)]
mod lifecycle_tests;
#[cfg(test)]
mod proptests;
#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;

pub use admission::{submit, Submission};
pub use deadlines::{due, next_due};
pub use dispatch::grant;
pub use input::{resume, resume_key_verdict, ResumeVerdict};
pub use lifecycle::{expired, recovered, total, uncount, Expiry, ExpiryVerdict};
pub use reconcile::{reconcile, Verdict};
pub use results::{
    heartbeat, late_result, probe_answer, result, Heartbeat, LateVerdict, ProbeVerdict,
};
pub use stop::{stop_session, stop_turn};
pub use tx::Tx;

/// What a transition reads: the session as it was before it, the configuration, and
/// what the shell knows of the world.
pub struct Ctx<'a> {
    pub st: &'a SessionState,
    pub cfg: &'a EngineConfig,
    /// Whether the worker connection (worker and instance) of the session's live
    /// invocation is attached; false when there is none.
    pub worker_connected: bool,
    /// Whether the worker of the session's live invocation answers probes. A worker
    /// that cannot be probed (an iii worker) has a passed attempt deadline taken as an
    /// unknown outcome at once.
    pub worker_probes: bool,
}

/// A side effect to carry out after the transition is durable, as plain data.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Send `invoke` to the connection `conn_id` the slot was granted on (nothing if
    /// that connection is gone: the invocation is then lost and reconciled).
    Invoke {
        worker_id: String,
        instance_id: String,
        conn_id: String,
        invoke: Invoke<RawJson>,
    },
    /// Tell the worker to stop running an invocation.
    Cancel {
        worker_id: String,
        instance_id: String,
        invocation_id: String,
        reason: String,
    },
    /// Ask the worker what became of an invocation past its deadline.
    Probe {
        worker_id: String,
        instance_id: String,
        invocation_id: String,
    },
}

/// A worker slot held by an invocation the transition ended; the shell frees it
/// before it looks for the next dispatch's slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub worker_id: String,
    pub instance_id: String,
    pub invocation_id: String,
    pub function_id: String,
}

/// A step the transition wants dispatched: the shell asks the registry for a slot and
/// answers with [`grant`].
#[derive(Debug, Clone, PartialEq)]
pub struct Want {
    /// The turn as the dispatch must start from (step, state and attempt set).
    pub turn: TurnRecord,
    /// A redispatch of a lost or unknown invocation: its attempt is reused.
    pub previous: Option<Previous>,
}

/// The invocation a redispatch replaces.
#[derive(Debug, Clone, PartialEq)]
pub struct Previous {
    pub invocation_id: String,
    /// The attempt number the redispatch uses.
    pub attempt: u32,
    pub reason: String,
}

/// Until when the session's hold ([`SessionMeta::held`]) keeps the lock holder `h`
/// from being dispatched: while `h` waits to be dispatched and the hold outlasted
/// the start of that wait. A hold that ended before `h` began to wait (it is cleared
/// lazily) keeps nothing.
pub fn held_until(meta: &SessionMeta, h: &TurnRecord) -> Option<u64> {
    let held = meta.held.as_deref()?;
    (matches!(h.phase, Phase::Queued | Phase::AwaitingWorker) && held.until_ms > h.phase_since_ms)
        .then_some(held.until_ms)
}

/// Whether the session dispatches nothing at `tx.now`: an invocation it holds for
/// may still be running.
pub fn holding(tx: &Tx) -> bool {
    tx.meta.held.as_deref().is_some_and(|h| h.until_ms > tx.now)
}

/// A worker slot the registry reserved for a new invocation.
#[derive(Debug, Clone, PartialEq)]
pub struct Grant {
    pub invocation_id: String,
    pub worker_id: String,
    pub instance_id: String,
    pub conn_id: String,
    pub settings: FunctionSettings,
}
