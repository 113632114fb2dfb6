//! Power loss of the disk, for tests of turnd's durability on the real binary.
//!
//! The recorder in `turnd-faultfs` (an `LD_PRELOAD` library) writes a [`journal`] of
//! every change the daemon makes under its data directory, with what it takes to undo
//! it, and of every `fsync`/`fdatasync`. This crate reads it back: [`model`] says
//! which changes were durable at each moment and which a power loss there may take
//! away, and [`state`] makes on disk the states such a loss may leave, in the
//! variants a real disk allows, for a test to restart the daemon on. What is modeled,
//! what is not, and how the end-to-end test uses it: `docs/powerloss.md`.
//!
//! Test-only; the daemon does not use it.

pub mod journal;
pub mod model;
pub mod state;
