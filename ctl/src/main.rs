//! `lorafleetctl`: the platform admins' command line over the gateway's
//! admin API (`/admin/v1`). Tables for people, `--output json` for scripts,
//! and exit codes scripts can rely on (see `--help`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use serde_json::{Value, json};

mod audit;
mod certs;
mod cli;
mod client;
mod evals;
mod fleet;
mod registry;
mod render;
mod rollout;
mod routes;
mod token;
mod usage;

use audit::*;
use certs::*;
use cli::*;
use client::*;
use evals::*;
use fleet::*;
use registry::*;
use render::*;
use rollout::*;
use routes::*;
use token::*;
use usage::*;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("error: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}

fn hash_model_dir(dir: &Path) -> Result<String, Failure> {
    let bar = progress_bar("hashing base weights");
    let result = lorafleet_artifact::weights::base_hash(dir, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    result
        .map(|h| h.to_string())
        .map_err(|e| fail(USAGE, format!("--model-dir {}: {e}", dir.display())))
}

fn parse_duration(s: &str) -> Result<u64, Failure> {
    let bad = || {
        fail(
            USAGE,
            format!("--expires-in: {s:?} is not a duration such as 90d, 12h, 30m or 3600s"),
        )
    };
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = n.parse().map_err(|_| bad())?;
    let mult = match unit {
        "s" | "" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(bad()),
    };
    n.checked_mul(mult).filter(|v| *v > 0).ok_or_else(bad)
}

async fn run(cli: Cli) -> Result<(), Failure> {
    if let Command::Token(t) = &cli.command
        && t.action.is_none()
    {
        return mint_token(t);
    }
    if let Command::Certs(c) = &cli.command {
        return write_certs(c, cli.output);
    }
    if let Command::BaseModels(BaseCmd::Hash { model_dir }) = &cli.command {
        let hash = hash_model_dir(model_dir)?;
        match cli.output {
            Output::Json => println!("{}", json!({ "base_hash": hash })),
            Output::Table => println!("{hash}"),
        }
        return Ok(());
    }
    if let Command::Adapters(AdapterCmd::Digest { dir }) = &cli.command {
        let bar = progress_bar("hashing artifact");
        let digest = lorafleet_artifact::roots::digest_with_progress(dir, &mut |done, total| {
            bar.set_length(total);
            bar.set_position(done);
        });
        bar.finish_and_clear();
        let digest = digest.map_err(|e| fail(USAGE, e.to_string()))?;
        match cli.output {
            Output::Json => println!("{}", json!({ "artifact_sha256": digest })),
            Output::Table => println!("{digest}"),
        }
        return Ok(());
    }
    if cli.timeout_secs == 0 {
        return Err(fail(USAGE, "--timeout-secs: must be at least 1"));
    }
    if !(cli.server.starts_with("http://") || cli.server.starts_with("https://")) {
        return Err(fail(
            USAGE,
            format!(
                "--server: {:?} must start with http:// or https://",
                cli.server
            ),
        ));
    }
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(cli.timeout_secs))
        .build()
        .map_err(|e| fail(1, e.to_string()))?;
    let c = Client {
        http,
        base: cli.server.clone(),
        token: cli.token.clone(),
        output: cli.output,
    };
    match cli.command {
        Command::Tenants(cmd) => tenants(&c, cmd).await,
        Command::Keys(cmd) => keys(&c, cmd).await,
        Command::BaseModels(cmd) => base_models(&c, cmd).await,
        Command::Adapters(cmd) => adapters(&c, cmd).await,
        Command::Routes(cmd) => routes(&c, cmd).await,
        Command::Evals(cmd) => evals(&c, cmd).await,
        Command::Fleet => fleet(&c).await,
        Command::Audit(a) => audit(&c, a).await,
        Command::Usage(a) => usage(&c, a).await,
        Command::Prices(cmd) => prices(&c, cmd).await,
        Command::AuditPartitions => {
            let list: lorafleet_admin_types::AuditPartitions =
                c.get_as("/audit/partitions", &[]).await?;
            let body = as_json(&list);
            show_list(
                &c,
                &body,
                "partitions",
                &["name", "from_time", "to_time", "estimated_rows"],
            );
            if c.output != Output::Json {
                println!(
                    "maintainer: {} (lease until {})",
                    cell(&body["maintainer"]),
                    cell(&body["maintainer_lease_expires_at"])
                );
            }
            Ok(())
        }
        Command::Changes {
            object_type,
            object_id,
            limit,
        } => {
            let mut q = vec![("limit", limit.to_string())];
            if let Some(t) = object_type {
                q.push(("object_type", t));
            }
            if let Some(i) = object_id {
                q.push(("object_id", i));
            }
            let list: lorafleet_admin_types::ChangeList = c.get_as("/changes", &q).await?;
            show_list(
                &c,
                &as_json(&list),
                "changes",
                &["at", "actor", "role", "action", "object_type", "object_id"],
            );
            Ok(())
        }
        Command::Token(TokenArgs {
            action: Some(TokenAction::Revoke { revoked }),
            ..
        }) => revoke_token(&c, &revoked, "/tokens/revoke").await,
        Command::Token(TokenArgs {
            action: Some(TokenAction::RevokeTenant { revoked }),
            ..
        }) => revoke_token(&c, &revoked, "/tenant-tokens/revoke").await,
        Command::Token(_) | Command::Certs(_) => unreachable!("handled above"),
    }
}
