//! `lorafleet-worker`: one process serving one base model and many LoRA
//! adapters. Subcommands: `serve` serves gRPC; `base-hash` prints a model's
//! base hash; `generate` runs a JSONL file of requests offline as one mixed
//! batch.

mod generate;
mod serve;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "lorafleet-worker",
    version,
    about = "Serves a base model and its LoRA adapters"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Prints the base hash of a Hugging Face model directory: SHA-256 over
    /// its weights in canonical order, independent of sharding.
    BaseHash {
        /// The model directory (config.json, *.safetensors).
        #[arg(long, env = "LORAFLEET_MODEL")]
        model: PathBuf,
    },
    /// Runs every request of a JSONL file as one continuous mixed batch and
    /// writes the results in input order.
    Generate(Box<generate::GenerateArgs>),
    /// Serves the model and its adapters over gRPC (lorafleet.worker.v1 and
    /// grpc.health.v1) until SIGTERM, then drains.
    Serve(Box<lorafleet_worker::server::ServeArgs>),
    /// Asks a worker's grpc.health.v1 whether it is SERVING; exit 0 if so.
    /// For container health checks, on the plain-text `--health-listen`.
    Health {
        /// The worker's health address (`serve --health-listen`).
        #[arg(long, default_value = "127.0.0.1:50052")]
        addr: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::BaseHash { model } => base_hash(&model),
        Command::Generate(args) => generate::run(*args),
        Command::Health { addr } => tokio::runtime::Runtime::new()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(health(&addr))),
        Command::Serve(args) => tokio::runtime::Runtime::new()
            .map_err(anyhow::Error::from)
            .and_then(|rt| {
                rt.block_on(async {
                    let _telemetry = lorafleet_telemetry::init("lorafleet-worker")?;
                    serve::run(*args).await
                })
            }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn health(addr: &str) -> anyhow::Result<()> {
    use lorafleet_proto::health::{HealthCheckRequest, health_client::HealthClient};
    let check = async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
            .connect()
            .await?;
        let status = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await?
            .into_inner()
            .status;
        anyhow::Ok(status)
    };
    let status = tokio::time::timeout(std::time::Duration::from_secs(5), check)
        .await
        .map_err(|_| anyhow::anyhow!("--addr {addr}: no answer within 5 s"))?
        .map_err(|e| anyhow::anyhow!("--addr {addr}: {e}"))?;
    // 1 is SERVING in grpc.health.v1.
    anyhow::ensure!(
        status == 1,
        "--addr {addr}: the worker is not SERVING (status {status})"
    );
    println!("SERVING");
    Ok(())
}

fn base_hash(model: &std::path::Path) -> anyhow::Result<()> {
    let show = std::io::stderr().is_terminal();
    let hash = lorafleet_engine::model::base_hash(model, &mut |done, total| {
        if show {
            eprint!(
                "\rhashing {:>5.1}%",
                done as f64 * 100.0 / total.max(1) as f64
            );
        }
    })?;
    if show {
        eprintln!();
    }
    println!("{hash}");
    Ok(())
}
