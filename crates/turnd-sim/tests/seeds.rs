//! The simulator's fixed seeds: every invariant holds on each, and a seed replays
//! exactly. With a `planted-…` feature on, the seeds named for it must break an
//! invariant instead (`make sim-planted`).

use turnd_sim::{run_seed, Config, Report};

/// Seeds `make test` runs (through `cargo nextest run --workspace`).
#[cfg(not(feature = "planted"))]
const FIXED: [u64; 8] = [0, 1, 2, 3, 4, 5, 6, 7];

fn run(seed: u64) -> Report {
    let r = run_seed(seed, &Config::default());
    println!(
        "seed {seed}: {} turns, {} simulated ms, {:?}",
        r.turns, r.sim_ms, r.violation
    );
    r
}

#[cfg(not(feature = "planted"))]
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

/// A seed found a `hello` that a worker sent on a connection it then gave up,
/// delivered after the worker's newer connection had attached: it superseded that
/// connection and reconciled with out-of-date lists, so a running at-most-once
/// invocation counted as never received and ran a second time. (The registry's
/// `a_hello_on_a_connection_older_than_the_attached_one_is_stale` holds the rule
/// itself.) Seed 18 meets it: with the refusal of a stale `hello` taken out, it runs
/// an at-most-once handler twice.
#[cfg(not(feature = "planted"))]
#[test]
fn a_stale_hello_does_not_supersede_the_newer_connection() {
    assert_eq!(run(18).violation, None, "replay with turnd-sim --seed 18");
}

/// A seed found the simulated machine stopping inside a group right after the
/// daemon answered a `turn.stop`: the check of the lock's hand-over that follows
/// an answered stop read the stopped store and took the failed read for a broken
/// invariant, where the restart checks what was acknowledged. Seed 1389 meets it.
#[cfg(not(feature = "planted"))]
#[test]
fn a_check_that_meets_the_machine_stopped_leaves_it_to_the_restart() {
    assert_eq!(
        run(1389).violation,
        None,
        "replay with turnd-sim --seed 1389"
    );
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

/// Each planted bug: its feature, the seeds that must find it, and what the broken
/// invariant says. `make sim-planted` runs this test once per feature.
#[cfg(feature = "planted")]
const PLANTED: [(&str, bool, &[u64], &str); 3] = [
    (
        "planted-ack-before-commit",
        cfg!(feature = "planted-ack-before-commit"),
        &[0, 1, 2],
        "is lost",
    ),
    (
        "planted-reconcile-skips-finished",
        cfg!(feature = "planted-reconcile-skips-finished"),
        &[4, 6, 10],
        "at-most-once run twice",
    ),
    (
        "planted-stop-keeps-lock",
        cfg!(feature = "planted-stop-keeps-lock"),
        &[0, 6, 8],
        "lock hand-over",
    ),
];

/// With a planted bug on, each of its seeds must break the invariant it breaks.
#[cfg(feature = "planted")]
#[test]
fn the_planted_bug_is_found() {
    let on: Vec<_> = PLANTED.iter().filter(|p| p.1).collect();
    assert_eq!(on.len(), 1, "one planted bug at a time");
    let (feature, _, seeds, says) = on[0];
    assert!(!seeds.is_empty(), "no seed is named for {feature}");
    for &seed in *seeds {
        let v = run(seed).violation;
        assert!(
            v.as_deref().is_some_and(|v| v.contains(says)),
            "seed {seed} did not find {feature} (broken invariant: {v:?})"
        );
    }
}
