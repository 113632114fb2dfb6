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

mod cli;
mod serve;

use clap::{Parser, Subcommand};

/// turnd: a turn-orchestration daemon with durable per-session FIFO turns.
#[derive(Parser)]
#[command(
    name = "turnd",
    version,
    about,
    propagate_version = true,
    after_help = "Client commands talk to the daemon at --url (TURND_URL, default \
ws://127.0.0.1:7420/v1) with --token (TURND_TOKEN).

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
    #[command(flatten)]
    Client(cli::ClientCommand),
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Serve(a) => serve::serve(a),
        Command::CheckConfig(a) => serve::check_config(a),
        Command::Client(c) => cli::main(c),
    };
    std::process::exit(code);
}
