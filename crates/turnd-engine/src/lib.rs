//! turnd's engine: the turn state machine, per-session FIFO locks, dispatch to
//! workers, timers and reconciliation of lost results, dispatches and workers.
//!
//! It owns no sockets: the server hands it requests and [`Outbox`]es to push frames
//! to, and it owns no disk format: it writes through `turnd_store::Store`.

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
pub mod registry;
mod session;
mod view;

pub use clock::Clock;
pub use config::{EngineConfig, TurnsConfig};
pub use engine::{
    fmt_time, fmt_utc, BlockedOn, Caller, Engine, LiveInvocation, RowDetail, SessionsPage,
    StuckRule, SubmitOptions, TurnRun, TurnRuns,
};
pub use error::{EngineError, EngineResult};
pub use registry::{CloseReason, Outbox, WorkerCaps};
