//! The `turnd` binary: parses the command line and hands off to the daemon
//! (`serve`, `check-config`) or to the client commands, which talk to a running
//! daemon through the SDK.

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
#[command(name = "turnd", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon.
    Serve(serve::ServeArgs),
    /// Load and validate the configuration, print problems, exit non-zero if any.
    CheckConfig(serve::ConfigArgs),
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
