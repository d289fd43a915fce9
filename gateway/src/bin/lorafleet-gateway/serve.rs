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
    let (http, metrics) = (running.http, running.metrics);
    match running.admin {
        Some(admin) => {
            println!("lorafleet-gateway listening http={http} metrics={metrics} admin={admin}")
        }
        None => println!("lorafleet-gateway listening http={http} metrics={metrics}"),
    }
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
