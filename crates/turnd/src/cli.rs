//! Client commands (placeholder until the CLI lands).

use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum ClientCommand {
    /// Show the daemon's version.
    Ping,
}

pub fn main(_c: ClientCommand) -> i32 {
    0
}
