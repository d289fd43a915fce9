//! `lorafleetctl`: the platform admins' command line over the gateway's
//! admin API. Its subcommands arrive with the admin plane.

use clap::Parser;

/// Administers a lorafleet deployment through the gateway's admin API.
#[derive(Debug, Parser)]
#[command(name = "lorafleetctl", version, about)]
struct Cli {}

fn main() {
    let _cli = Cli::parse();
    eprintln!(
        "lorafleetctl {}: no command given; see --help",
        env!("CARGO_PKG_VERSION")
    );
    std::process::exit(2);
}
