//! `lorafleet-gateway`: the tenants' front door. `serve` runs the OpenAI API
//! over the worker fleet; `migrate` applies the registry migrations.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use lorafleet_gateway::db;

mod serve;

#[derive(Debug, Parser)]
#[command(name = "lorafleet-gateway", version, about = "The lorafleet gateway")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Applies pending registry migrations, then exits. Safe to run from
    /// several replicas at once.
    Migrate(MigrateArgs),
    /// Serves the OpenAI-compatible API until SIGTERM, then drains.
    Serve(Box<lorafleet_gateway::server::ServeArgs>),
    /// Asks a gateway's `/healthz`; exit 0 if it answers 200. For container
    /// health checks.
    Health {
        /// The gateway's HTTP address.
        #[arg(long, default_value = "127.0.0.1:8080")]
        addr: String,
    },
}

#[derive(Debug, clap::Args)]
struct MigrateArgs {
    /// The registry database, as postgres://USER[:PASSWORD]@HOST:PORT/DATABASE.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// How long to wait for a database connection, in seconds.
    #[arg(long, env = "LORAFLEET_DB_CONNECT_TIMEOUT_SECS", default_value_t = 10)]
    connect_timeout_secs: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Command::Health { addr } = &cli.command {
        return match runtime.block_on(health(addr)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let result = runtime.block_on(async {
        let _telemetry = lorafleet_telemetry::init("lorafleet-gateway")?;
        run(cli).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn health(addr: &str) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    let resp = client
        .get(format!("http://{addr}/healthz"))
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("--addr {addr}: {e}"))?;
    anyhow::ensure!(
        resp.status().is_success(),
        "--addr {addr}: /healthz answered {}",
        resp.status()
    );
    println!("ok");
    Ok(())
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Health { .. } => unreachable!("answered before telemetry starts"),
        Command::Serve(args) => serve::run(*args).await,
        Command::Migrate(args) => {
            if args.connect_timeout_secs == 0 {
                anyhow::bail!("--connect-timeout-secs: must be at least 1");
            }
            let options = db::parse_database_url("--database-url", &args.database_url)?;
            let pool =
                db::connect(options, 1, Duration::from_secs(args.connect_timeout_secs)).await?;
            let applied = db::migrate(&pool).await?;
            tracing::info!(
                applied,
                total = db::MIGRATOR.iter().count(),
                "registry migrations are up to date"
            );
            pool.close().await;
            Ok(())
        }
    }
}
