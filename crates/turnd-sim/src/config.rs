//! What a run simulates: how many peers, how much work, which faults how often, and
//! the daemon's timers (short ones, so that a run covers many deadlines).

use turnd_engine::{EngineConfig, TurnsConfig};

use crate::caller::Pace;
use crate::net::NetFaults;

/// Fault rates: per frame for the network, per step (1 – 4 simulated ms) otherwise.
#[derive(Debug, Clone, Copy)]
pub struct Faults {
    pub net: NetFaults,
    pub worker_crash: f64,
    pub worker_cut: f64,
    pub worker_stall: f64,
    pub worker_slow: f64,
    pub caller_away: f64,
    /// Every worker cut off at once for a while.
    pub outage: f64,
    pub daemon_crash: f64,
    /// A crash inside the next group commit (after its append, or torn).
    pub group_crash: f64,
    pub disk_fail: f64,
    /// A restart's clock may jump this far either way.
    pub clock_jump_ms: u64,
}

impl Faults {
    pub const NONE: Faults = Faults {
        net: NetFaults::NONE,
        worker_crash: 0.0,
        worker_cut: 0.0,
        worker_stall: 0.0,
        worker_slow: 0.0,
        caller_away: 0.0,
        outage: 0.0,
        daemon_crash: 0.0,
        group_crash: 0.0,
        disk_fail: 0.0,
        clock_jump_ms: 0,
    };

    /// The default mix: every fault often enough that a run of a few hundred turns
    /// meets each of them several times.
    pub const MIXED: Faults = Faults {
        net: NetFaults {
            drop: 0.01,
            dup: 0.01,
            delay: 0.01,
            long_ms: 1_500,
        },
        worker_crash: 0.0004,
        worker_cut: 0.001,
        worker_stall: 0.0005,
        worker_slow: 0.0005,
        caller_away: 0.0005,
        outage: 0.0003,
        daemon_crash: 0.0003,
        group_crash: 0.0003,
        disk_fail: 0.0005,
        clock_jump_ms: 3_000,
    };
}

/// A run's shape. See the module documentation.
#[derive(Debug, Clone)]
pub struct Config {
    pub workers: usize,
    pub callers: usize,
    pub sessions_per_caller: usize,
    pub turns_per_caller: u64,
    pub pace: Pace,
    pub faults: Faults,
    /// How long the quiet tail may take to finish every turn.
    pub tail_ms: u64,
    pub max_steps: u64,
    /// Keep the trace of every step (replay of one seed).
    pub trace: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            workers: 3,
            callers: 3,
            sessions_per_caller: 3,
            turns_per_caller: 80,
            pace: Pace {
                submit: 0.08,
                stop: 0.004,
                session_stop: 0.0004,
                inspect: 0.01,
                with_timeout: 0.1,
            },
            faults: Faults::MIXED,
            tail_ms: 60_000,
            max_steps: 400_000,
            trace: false,
        }
    }
}

impl Config {
    /// The daemon's engine settings: short timers, retention off (it keeps every
    /// turn, so the checks at the end see them all).
    pub fn engine(&self) -> EngineConfig {
        EngineConfig {
            turns: TurnsConfig {
                default_timeout_ms: 1_000,
                probe_timeout_ms: 300,
                reconnect_grace_ms: 1_500,
                cancel_grace_ms: 500,
                retry_backoff_ms: 50,
                retry_backoff_max_ms: 400,
                worker_linger_ms: 2_000,
                ..TurnsConfig::default()
            },
            retention_terminal_ms: 0,
            retention_sweep_interval_ms: 3_600_000,
            partition: None,
        }
    }

    /// In the quiet tail no one stops anything, so every turn runs to its end.
    pub fn pace_quiet(&self) -> Pace {
        Pace {
            stop: 0.0,
            session_stop: 0.0,
            inspect: 0.0,
            ..self.pace
        }
    }
}
