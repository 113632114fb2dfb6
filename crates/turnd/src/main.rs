//! The `turnd` binary: parses the command line and hands off to the daemon
//! (`serve`, `check-config`) or to the client commands, which talk to a running
//! daemon through the SDK.

#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "a test reads as one scenario from its setup to its last assertion"
    )
)]

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

mod cli;
mod serve;
mod watchdog;

use clap::{Parser, Subcommand};

/// turnd: a turn-orchestration daemon with durable per-session FIFO turns.
#[derive(Parser)]
#[command(
    name = "turnd",
    version,
    about,
    propagate_version = true,
    after_help = "Client commands talk to the daemon at --url (TURND_URL, default \
ws://127.0.0.1:7420/v1) with --token (TURND_TOKEN). A cluster's nodes' URLs may be \
given separated by commas: the first that answers is used.

Exit codes of the client commands:
  0  done; the turn completed (or, for `turn`, is not finished yet)
  1  the daemon refused the request, the turn failed or was cancelled, or `check` found violations
  2  the daemon cannot be reached or the connection was lost, or bad usage
  3  a wait (--timeout-secs) ran out with the turn unfinished"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon.
    Serve(serve::ServeArgs),
    /// Load and validate the configuration, print problems, exit non-zero if any.
    ///
    /// Exit 0 when the configuration is valid (unknown keys are reported but pass,
    /// unless --strict), 2 when it is not.
    CheckConfig(serve::CheckConfigArgs),
    /// A cluster of nodes on NATS JetStream (the config's [cluster] table).
    #[command(subcommand)]
    Cluster(serve::ClusterCommand),
    #[command(flatten)]
    Client(cli::ClientCommand),
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Serve(a) => serve::serve(a),
        Command::CheckConfig(a) => serve::check_config(a),
        Command::Cluster(c) => serve::cluster(c),
        Command::Client(c) => cli::main(c),
    };
    std::process::exit(code);
}

#[cfg(test)]
mod tests {
    /// The options compiled into the binary reach jemalloc: without them its
    /// background thread is off and `opt.background_thread` reads false.
    #[test]
    fn jemalloc_runs_with_the_compiled_options() {
        assert_eq!(tikv_jemalloc_ctl::opt::background_thread::read(), Ok(true));
        assert_eq!(tikv_jemalloc_ctl::background_thread::read(), Ok(true));
    }
}
