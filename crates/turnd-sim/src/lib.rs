//! A deterministic simulator of the whole daemon (`docs/simulator.md`): the real
//! engine, store code and request router, with simulated workers, callers, network,
//! disk, crashes and clocks, all decided by one `u64` seed, and the invariants of
//! `docs/semantics.md` checked as it runs.
//!
//! [`run_seed`] runs one seed on the calling thread and reports what it did and the
//! first broken invariant; the same seed always runs the same way (the
//! `same_seed_same_run` test holds it to that).

pub mod caller;
pub mod check;
pub mod config;
pub mod daemon;
pub mod disk;
pub mod ledger;
pub mod net;
pub mod peer;
pub mod worker;
pub mod world;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub use config::{Config, Faults};
pub use world::Counts;

/// What one seed did.
#[derive(Debug, Clone)]
pub struct Report {
    pub seed: u64,
    /// The first broken invariant.
    pub violation: Option<String>,
    /// Every line of the run (when [`Config::trace`]).
    pub trace: Vec<String>,
    /// Turns the callers were told were admitted.
    pub turns: u64,
    /// Simulated time of the run, ms.
    pub sim_ms: u64,
    pub counts: Counts,
    /// A hash of every frame sent either way: equal for two runs of one seed.
    pub digest: u64,
}

/// Run one seed on this thread.
pub fn run_seed(seed: u64, cfg: &Config) -> Report {
    let clock = Arc::new(AtomicU64::new(0));
    // Ids minted on this thread follow from the run: UUIDv7-shaped, the simulated
    // time first, then a count.
    let minted = clock.clone();
    let mut n: u64 = 0;
    let _ids = turnd_proto::ids::mint_from(Box::new(move || {
        n += 1;
        (u128::from(minted.load(Ordering::Relaxed)) << 80) | u128::from(n)
    }));
    let mut w = world::World::new(seed, cfg.clone(), clock);
    let result = w.run();
    let report = Report {
        seed,
        violation: result.err(),
        trace: w.trace.lines().to_vec(),
        turns: w.admitted() as u64,
        sim_ms: w.now,
        counts: w.counts.clone(),
        digest: w.digest,
    };
    w.finish();
    report
}
