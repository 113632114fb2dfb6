//! turnd's engine: the turn state machine, per-session FIFO locks, dispatch to
//! workers, timers and reconciliation of lost results, dispatches and workers.
//!
//! It owns no sockets: the server hands it requests and [`Outbox`]es to push frames
//! to, and it owns no disk format: it writes through `turnd_store::Store`.
//!
//! The layers, from the bottom: the worker registry (`registry`, plain data, and
//! `workers`, the handle engines share); one session's state (`session`); the
//! machine's pure transitions and the overlay they build (`machine`); how a turn is
//! shown (`view`); the parts the engine composes (`sessions`, `waiters`, `watches`,
//! `wait_index`, `timers`, `progress`); and the engine itself (`engine`), the shell that runs
//! the transitions and answers every operation.

#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "a test reads as one scenario from its setup to its last assertion"
    )
)]

pub mod clock;
pub mod config;
mod engine;
mod error;
mod machine;
pub mod metrics;
mod progress;
pub mod registry;
mod session;
mod sessions;
mod timers;
mod view;
mod wait_index;
mod waiters;
mod watches;
mod workers;

pub use clock::{fmt_time, fmt_utc, Clock};
pub use config::{EngineConfig, Partition, TurnsConfig};
pub use engine::{
    sessions_cursor, BlockedOn, Caller, Engine, LiveInvocation, RowDetail, SessionsPage,
    SubmitOptions, TurnRun, TurnRuns,
};
pub use error::{EngineError, EngineResult};
pub use registry::{CloseReason, Outbox, WorkerCaps};
pub use wait_index::StuckRule;
pub use workers::{AttachedWorker, WakeHook, Workers};

/// A turn as the engine shows it: the protocol's `Turn` with its input and output as
/// the JSON text the store holds, serialized into frames as it is.
pub type TurnView = turnd_proto::Turn<turnd_store::RawJson>;
