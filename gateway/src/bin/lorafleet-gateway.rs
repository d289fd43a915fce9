//! `lorafleet-gateway`: the tenants' front door. For now it carries the
//! registry migrations; `serve` arrives with the gateway itself.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use lorafleet_gateway::db;

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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
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
