//! `lorafleet-worker`: one process serving one base model and many LoRA
//! adapters over the `lorafleet.worker.v1` gRPC contract.

use clap::Parser;

/// Serves a base model and its LoRA adapters over gRPC.
#[derive(Debug, Parser)]
#[command(name = "lorafleet-worker", version, about)]
struct Cli {}

fn main() {
    let _cli = Cli::parse();
    eprintln!(
        "lorafleet-worker {}: no command given; see --help (serving protocol {})",
        env!("CARGO_PKG_VERSION"),
        lorafleet_proto::WORKER_SERVICE_NAME
    );
    std::process::exit(2);
}
