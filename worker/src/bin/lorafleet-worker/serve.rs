//! `lorafleet-worker serve`: loads the base model once and serves the
//! `lorafleet.worker.v1` contract and `grpc.health.v1` over gRPC, until
//! SIGTERM or Ctrl-C, then drains. Everything but the signal and the
//! startup line lives in `lorafleet_worker::server`.

use std::io::Write;

use lorafleet_worker::server::{self, Listeners, ServeArgs};

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let config = args.validate()?;
    let drain = config.drain_deadline;
    let listeners = Listeners::bind(&config).await?;
    let mut running = server::start(config, listeners).await?;
    // Tests and operators read this line to find the ports.
    println!(
        "lorafleet-worker listening grpc={} metrics={} health={} tls={}",
        running.grpc,
        running.metrics,
        running.health,
        if running.mutual_tls { "mutual" } else { "off" }
    );
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
