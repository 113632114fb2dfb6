//! The simulator's fixed seeds: every invariant holds on each, and a seed replays
//! exactly. With a `planted-…` feature on, the seeds named for it must break an
//! invariant instead (`make sim-planted`).

use turnd_sim::{run_seed, Config, Report};

/// Seeds `make test` runs (through `cargo nextest run --workspace`).
const FIXED: [u64; 8] = [0, 1, 2, 3, 4, 5, 6, 7];

fn run(seed: u64) -> Report {
    let r = run_seed(seed, &Config::default());
    println!(
        "seed {seed}: {} turns, {} simulated ms, {:?}",
        r.turns, r.sim_ms, r.violation
    );
    r
}

#[cfg(not(any(
    feature = "planted-ack-before-commit",
    feature = "planted-reconcile-skips-finished",
    feature = "planted-stop-keeps-lock"
)))]
#[test]
fn fixed_seeds_hold_every_invariant() {
    for seed in FIXED {
        let r = run(seed);
        assert!(r.turns > 100, "seed {seed} admitted only {} turns", r.turns);
        assert_eq!(
            r.violation, None,
            "seed {seed}: replay with turnd-sim --seed {seed}"
        );
    }
}

/// Seed 9 found a `hello` that a worker sent on a connection it then gave up,
/// delivered after the worker's newer connection had attached: it superseded that
/// connection and reconciled with out-of-date lists, so a running at-most-once
/// invocation counted as never received and ran a second time. (The registry's
/// `a_hello_on_a_connection_older_than_the_attached_one_is_stale` holds the rule
/// itself.)
#[cfg(not(any(
    feature = "planted-ack-before-commit",
    feature = "planted-reconcile-skips-finished",
    feature = "planted-stop-keeps-lock"
)))]
#[test]
fn a_stale_hello_does_not_supersede_the_newer_connection() {
    assert_eq!(run(9).violation, None, "replay with turnd-sim --seed 9");
}

#[test]
fn same_seed_same_run() {
    let a = run(3);
    // On another thread, whose hash maps are seeded differently.
    let b = std::thread::spawn(|| run(3)).join().expect("thread");
    assert_eq!(
        (a.digest, a.turns, a.sim_ms, a.counts.steps),
        (b.digest, b.turns, b.sim_ms, b.counts.steps)
    );
    let other = run(4);
    assert_ne!(a.digest, other.digest, "two seeds ran the same way");
}

/// With a planted bug on, each of `seeds` must break an invariant.
#[cfg(any(
    feature = "planted-ack-before-commit",
    feature = "planted-reconcile-skips-finished",
    feature = "planted-stop-keeps-lock"
))]
#[test]
fn the_planted_bug_is_found() {
    let seeds: &[u64] = if cfg!(feature = "planted-ack-before-commit") {
        &[0, 1, 5]
    } else if cfg!(feature = "planted-reconcile-skips-finished") {
        &[0, 3, 4]
    } else {
        &[]
    };
    for &seed in seeds {
        assert!(
            run(seed).violation.is_some(),
            "seed {seed} did not find the planted bug"
        );
    }
}
