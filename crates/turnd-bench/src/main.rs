//! `turnd-bench`: end-to-end benchmarks of turnd.
//!
//! Every scenario starts the real daemon *in this process* ([`turnd_server::Daemon`]
//! on `127.0.0.1:0`, a sled store in a temporary data directory, `storage.sync =
//! "always"` unless `--sync never` is given, which is NOT durable and labelled so in
//! every row), echo workers and callers that talk protocol v1 over loopback WebSocket
//! through the SDK, and prints a markdown row with the exact command line. Because
//! daemon, workers and callers share the process and its two cores, CPU and memory
//! figures are for all of them together.
//!
//! Scenarios: `sessions`, `sequential`, `multistep`, `idle`, `recovery`, `ui`,
//! `progress` (on the real binary). `drive` runs
//! a small known load against an external daemon (used by `scripts/check-fsync.sh`),
//! `reopen` is the fresh process `recovery` times, and `sled-batching` times sled
//! alone with daemon-shaped batches (where a group commit's time goes).

/// jemalloc instead of the system allocator: the daemon allocates and frees many
/// small buffers per request (frames, JSON values, store batches); in profiles glibc
/// malloc took about a quarter of all CPU time, and jemalloc keeps the resident size
/// of a daemon holding many sessions lower than glibc and mimalloc did (see
/// docs/benchmarks.md).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, compiled in. A burst of work leaves freed pages behind; by
/// default jemalloc returns them to the OS only while it is called again, after
/// 10 s, so an idle daemon kept them for good (tens of MB after 100,000 finished
/// sessions). A background thread now returns dirty pages 1 s after they are freed
/// (`dirty_decay_ms`), at once without the lazy `MADV_FREE` stage (`muzzy_decay_ms`);
/// no cost in CPU per turn was measurable (docs/benchmarks.md). `_RJEM_MALLOC_CONF`
/// in the environment overrides these.
#[export_name = "_rjem_malloc_conf"]
static MALLOC_CONF: &[u8; 60] = b"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0\0";

mod daemon;
mod drive;
mod machine;
mod measure;
mod progress;
mod scenarios;
mod sled_probe;
mod soak;
mod ui_page;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// End-to-end benchmarks of turnd: the real daemon in-process, echo workers and callers
/// over loopback WebSocket through the SDK.
#[derive(Parser)]
#[command(name = "turnd-bench")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// Settings every scenario shares.
#[derive(Args, Debug, Clone)]
pub struct Common {
    /// storage.sync of the daemon: `always` (durable: group-committed fdatasync before
    /// every acknowledgement) or `never` (NOT DURABLE: for comparison only).
    #[arg(long, default_value = "always", value_parser = ["always", "never"])]
    pub sync: String,
    /// Echo worker connections.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Concurrency each worker connection registers.
    #[arg(long, default_value_t = 512)]
    pub concurrency: u32,
    /// Caller (client) connections.
    #[arg(long, default_value_t = 32)]
    pub callers: usize,
    /// Directory for the temporary data directory (default: the system temp dir).
    #[arg(long)]
    pub tmp: Option<PathBuf>,
    /// Tracing filter for the daemon's logs on stderr. The real binary's default is
    /// `info`, which logs one line per finished turn.
    #[arg(long, default_value = "warn")]
    pub log: String,
    /// Filler added to every turn's input (which the echo workers return as its
    /// output), in bytes; 0: inputs of a few bytes.
    #[arg(long, default_value_t = 0)]
    pub input_bytes: usize,
    /// storage.checkpoint_mb of the daemon (0: never checkpoint).
    #[arg(long, default_value_t = turnd_store::DEFAULT_CHECKPOINT_MB)]
    pub checkpoint_mb: u64,
    /// storage.cache_mb of the daemon: sled's page cache.
    #[arg(long, default_value_t = turnd_store::DEFAULT_CACHE_MB)]
    pub cache_mb: u64,
    /// storage.apply_delay_ms of the daemon: how long a live record's write waits
    /// before it is written to sled.
    #[arg(long, default_value_t = turnd_store::logged::DEFAULT_APPLY_DELAY_MS)]
    pub apply_delay_ms: u64,
    /// The in-process daemon's store: `sled` (the commit log in front of sled, as
    /// `turnd serve` runs) or `memory` (NOT DURABLE, nothing on disk: the in-memory
    /// store the tests use, to show what the engine, the protocol and the connections
    /// cost without the storage path). Ignored by the scenarios that spawn `turnd`.
    #[arg(long, default_value = "sled", value_parser = ["sled", "memory"])]
    pub store: String,
}

#[derive(Subcommand)]
enum Cmd {
    /// K sessions × M one-step turns, every session submitting at once.
    Sessions {
        #[command(flatten)]
        common: Common,
        #[arg(long, default_value_t = 1000)]
        sessions: usize,
        #[arg(long, default_value_t = 20)]
        turns: usize,
    },
    /// One session, N turns one after the other (submit, wait until terminal, next).
    Sequential {
        #[command(flatten)]
        common: Common,
        #[arg(long, default_value_t = 2000)]
        turns: usize,
        /// Turns run first and not counted.
        #[arg(long, default_value_t = 100)]
        warmup: usize,
    },
    /// K sessions × M turns of S steps each (the worker answers `continue` S-1 times).
    Multistep {
        #[command(flatten)]
        common: Common,
        #[arg(long, default_value_t = 100)]
        sessions: usize,
        #[arg(long, default_value_t = 10)]
        turns: usize,
        #[arg(long, default_value_t = 5)]
        steps: u64,
    },
    /// N sessions with one queued turn each and no worker: memory.
    Idle {
        #[command(flatten)]
        common: Common,
        #[arg(long, default_value_t = 100_000)]
        sessions: usize,
        /// Submits in flight at once.
        #[arg(long, default_value_t = 1024)]
        inflight: usize,
        /// `queued`: each session holds one queued turn for a function no worker
        /// serves. `finished`: each session runs one turn to completion on an echo
        /// worker, then all are idle. `unknown`: that many reads of session and turn
        /// ids that do not exist (the daemon starts empty).
        #[arg(long, default_value = "queued", value_parser = ["queued", "finished", "unknown"])]
        what: String,
    },
    /// N sessions waiting for a worker nobody runs, then the render time of the
    /// operator page's screens and the answer time of `sessions.list`.
    Ui {
        #[command(flatten)]
        common: Common,
        #[arg(long, default_value_t = 100_000)]
        sessions: usize,
        /// Submits in flight at once while filling.
        #[arg(long, default_value_t = 1024)]
        inflight: usize,
        /// Requests timed per page.
        #[arg(long, default_value_t = 20)]
        repeat: usize,
    },
    /// Fill a store with R finished turns, then time restarts: the real `turnd`
    /// binary (spawn → ready file) and a fresh in-process open (sled open +
    /// Engine::open).
    Recovery {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        args: scenarios::RecoveryArgs,
    },
    /// (used by `recovery --kill`) Fill a data directory, print `filled` and wait to
    /// be killed.
    #[command(hide = true)]
    FillAndHold {
        #[command(flatten)]
        common: Common,
        #[arg(long)]
        data_dir: PathBuf,
        #[arg(long)]
        turns: u64,
        #[arg(long)]
        sessions: usize,
        #[arg(long)]
        queued: usize,
    },
    /// (used by `recovery`) Open a data directory in this fresh process and time it.
    #[command(hide = true)]
    Reopen {
        #[arg(long)]
        data_dir: PathBuf,
    },
    /// sled alone: groups of daemon-shaped batches applied one by one vs merged.
    SledBatching {
        #[arg(long, default_value_t = 200)]
        groups: usize,
        #[arg(long, default_value_t = 50)]
        per_group: usize,
        #[arg(long, default_value_t = 7)]
        keys: usize,
        #[arg(long, default_value_t = 270)]
        value_bytes: usize,
    },
    /// A sustained closed-loop load on a real `turnd` binary: throughput per second,
    /// the longest interval with no completion, p50/p99/p99.9, disk per turn, RSS.
    Soak(soak::SoakArgs),
    /// What streamed progress costs the real `turnd` binary: K sessions each
    /// streaming F frames/s to a watcher for S seconds, beside the same turns without
    /// progress; the daemon's CPU and the worker → watcher latency.
    Progress(progress::ProgressArgs),
    /// A small known load against an external daemon (for scripts/check-fsync.sh).
    Drive {
        /// The daemon's WebSocket URL, e.g. ws://127.0.0.1:7420/v1.
        #[arg(long)]
        url: String,
        #[arg(long, default_value_t = 3)]
        sessions: usize,
        #[arg(long, default_value_t = 4)]
        turns: usize,
        #[arg(long, default_value_t = 2)]
        steps: u64,
    },
}

/// A runtime like the daemon's own: multi-threaded, one worker per core.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

fn init_tracing(filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn announce(common: &Common) {
    if common.sync == "never" {
        eprintln!("turnd-bench: storage.sync = never: acknowledgements are NOT durable in this run (comparison only)");
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Sessions {
            common,
            sessions,
            turns,
        } => {
            init_tracing(&common.log);
            announce(&common);
            runtime()?.block_on(scenarios::sessions(&common, "sessions", sessions, turns, 1))
        }
        Cmd::Sequential {
            common,
            turns,
            warmup,
        } => {
            init_tracing(&common.log);
            announce(&common);
            runtime()?.block_on(scenarios::sequential(&common, turns, warmup))
        }
        Cmd::Multistep {
            common,
            sessions,
            turns,
            steps,
        } => {
            init_tracing(&common.log);
            announce(&common);
            runtime()?.block_on(scenarios::sessions(
                &common,
                "multistep",
                sessions,
                turns,
                steps.max(1),
            ))
        }
        Cmd::Idle {
            common,
            sessions,
            inflight,
            what,
        } => {
            init_tracing(&common.log);
            announce(&common);
            match what.as_str() {
                "finished" => {
                    runtime()?.block_on(scenarios::idle_finished(&common, sessions, inflight))
                }
                "unknown" => {
                    runtime()?.block_on(scenarios::idle_unknown(&common, sessions, inflight))
                }
                _ => runtime()?.block_on(scenarios::idle(&common, sessions, inflight)),
            }
        }
        Cmd::Ui {
            common,
            sessions,
            inflight,
            repeat,
        } => {
            init_tracing(&common.log);
            announce(&common);
            runtime()?.block_on(ui_page::ui(&common, sessions, inflight, repeat))
        }
        Cmd::Recovery { common, args } => {
            init_tracing(&common.log);
            announce(&common);
            let a = scenarios::RecoveryArgs {
                repeat: args.repeat.max(1),
                ..args
            };
            let prepared = scenarios::prepare_recovery(&common, &a)?;
            runtime()?.block_on(scenarios::recovery(&common, &a, &prepared))
        }
        other => run_tool(other),
    }
}

/// The commands that are not a scenario of their own: helpers of `recovery`,
/// sled alone, `soak` and `drive`.
fn run_tool(cmd: Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::FillAndHold {
            common,
            data_dir,
            turns,
            sessions,
            queued,
        } => {
            init_tracing(&common.log);
            let a = scenarios::RecoveryArgs {
                turns,
                sessions,
                queued,
                dir: None,
                reuse: false,
                turnd: None,
                repeat: 1,
                top_up: 0,
                kill: true,
            };
            runtime()?.block_on(scenarios::fill(&common, &data_dir, &a, "rec"))
        }
        Cmd::Reopen { data_dir } => {
            init_tracing("warn");
            runtime()?.block_on(scenarios::reopen(&data_dir))
        }
        Cmd::SledBatching {
            groups,
            per_group,
            keys,
            value_bytes,
        } => sled_probe::probe(sled_probe::Shape {
            groups,
            per_group,
            keys,
            value_bytes,
        }),
        Cmd::Progress(args) => runtime()?.block_on(progress::progress(&args)),
        Cmd::Soak(args) => {
            init_tracing("warn");
            runtime()?.block_on(soak::soak(args))
        }
        Cmd::Drive {
            url,
            sessions,
            turns,
            steps,
        } => {
            init_tracing("warn");
            runtime()?.block_on(drive::drive(&url, sessions, turns, steps))
        }
        Cmd::Sessions { .. }
        | Cmd::Sequential { .. }
        | Cmd::Multistep { .. }
        | Cmd::Idle { .. }
        | Cmd::Ui { .. }
        | Cmd::Recovery { .. } => run(Cli { cmd }),
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("turnd-bench: failed to run: {e:#}");
            ExitCode::FAILURE
        }
    }
}
