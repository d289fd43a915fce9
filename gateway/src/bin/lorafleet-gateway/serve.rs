//! `lorafleet-gateway serve`: the OpenAI API over the worker fleet, until
//! SIGTERM, then a drain. Everything but the signal and the startup line
//! lives in `lorafleet_gateway::server`.

use std::io::Write;

use lorafleet_gateway::server::{self, Listeners, ServeArgs};

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let config = args.validate()?;
    let drain = config.drain_deadline;
    let listeners = Listeners::bind(&config).await?;
    let mut running = server::start(config, listeners).await?;
    let mut line = String::from("lorafleet-gateway listening");
    if let Some(http) = running.http {
        line.push_str(&format!(" http={http}"));
    }
    line.push_str(&format!(" metrics={}", running.metrics));
    if let Some(admin) = running.admin {
        line.push_str(&format!(" admin={admin}"));
    }
    println!("{line}");
    std::io::stdout().flush()?;
    tokio::select! {
        _ = wait_for_signal() => {}
        e = running.stopped() => return Err(e.into()),
    }
    running.drain(drain).await;
    Ok(())
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install the SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
