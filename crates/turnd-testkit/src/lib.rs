//! Fault injection for turnd: the tools the loss tests use to lose things on purpose.
//!
//! The daemon promises (semantics, "Loss") that a lost result, a lost dispatch, a dead
//! worker or a restart is detected and reconciled within a configured time. Proving
//! that needs losses that happen exactly where a test wants them, through the real
//! daemon and the real SDK, and this crate provides them:
//!
//! - [`Proxy`]: a transparent WebSocket proxy between workers and the daemon that can
//!   drop, delay or duplicate chosen frames, cut every connection abruptly, refuse or
//!   hold new connections, and switch to another upstream daemon (a restarted one)
//!   while workers stay connected to the same address. Rules change at run time
//!   through a cloneable [`ProxyHandle`]; every decision is counted and logged.
//! - [`KitWorker`]: workers built on the SDK whose handlers follow a [`Script`] of
//!   [`Act`]s (echo, hang and ignore cancel, wait for a [`Gate`], fail, ...), with every
//!   execution counted in [`Runs`]; a worker can die mid-step and come back as the
//!   same or as a new instance.
//! - [`TcpProxy`]: a plain TCP pipe that can cut a path (a cluster node's connection
//!   to NATS) and heal it.
//! - [`SplitMix64`]: a tiny seeded PRNG for randomized tests that must replay exactly.
//!
//! Nothing here is used by the daemon itself; it only ever talks to the daemon over
//! its public protocol.

#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "a test reads as one scenario from its setup to its last assertion"
    )
)]
#![warn(missing_docs)]

pub mod proxy;
pub mod rng;
pub mod tcp;
pub mod worker;

pub use proxy::{
    Action, Dir, Fate, LoggedFrame, Match, Proxy, ProxyHandle, ProxyStats, Rule, RuleId,
};
pub use rng::SplitMix64;
pub use tcp::TcpProxy;
pub use worker::{
    fast_options, scripted_handler, Act, Gate, Instance, KitWorker, KitWorkerBuilder, Runs, Script,
};
