//! `lorafleet-worker serve`: loads the base model once and serves the
//! `lorafleet.worker.v1` contract and `grpc.health.v1` over gRPC, until
//! SIGTERM or Ctrl-C, then drains.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use lorafleet_engine::artifact::ArtifactRoots;
use lorafleet_engine::{BackendChoice, Engine};
use lorafleet_proto::worker::v1 as pb;

use lorafleet_worker::info::WorkerInfo;
use lorafleet_worker::runtime::EngineHandle;
use lorafleet_worker::service::WorkerService;

/// How long connections may linger after the drain before the process exits.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// Flags of `serve`; each has an environment fallback.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The base model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long, env = "LORAFLEET_MODEL")]
    model: PathBuf,
    /// A directory adapter artifact URIs resolve in; repeat for more (env: comma-separated).
    #[arg(
        long = "artifact-root",
        env = "LORAFLEET_ARTIFACT_ROOTS",
        value_delimiter = ',',
        required = true
    )]
    artifact_roots: Vec<PathBuf>,
    /// Where to serve gRPC. Port 0 picks a free port, printed on stdout.
    #[arg(long, env = "LORAFLEET_GRPC_LISTEN", default_value = "0.0.0.0:50051")]
    grpc_listen: SocketAddr,
    /// Where to serve Prometheus metrics (`GET /metrics`). Port 0 picks a
    /// free port, printed on stdout.
    #[arg(long, env = "LORAFLEET_METRICS_LISTEN", default_value = "0.0.0.0:9090")]
    metrics_listen: SocketAddr,
    /// This worker's id on the hash ring (in Kubernetes, the pod name).
    #[arg(long, env = "LORAFLEET_WORKER_ID")]
    worker_id: String,
    #[command(flatten)]
    engine: crate::flags::EngineFlags,
    /// On SIGTERM, how long running streams may take to finish, in seconds.
    #[arg(long, env = "LORAFLEET_DRAIN_DEADLINE_SECS", default_value_t = 30)]
    drain_deadline_secs: u64,
    /// Where this worker keeps its private copies of verified adapter
    /// artifacts (emptied at start; the pool reads adapters only from
    /// here). Default: a directory named after the worker id and process
    /// under the system's temporary directory, removed on a clean exit.
    #[arg(long, env = "LORAFLEET_ADAPTER_CACHE")]
    adapter_cache: Option<PathBuf>,
    #[command(flatten)]
    tls: TlsFlags,
    /// Where to serve grpc.health.v1 alone, in plain text, for probes that
    /// cannot present a client certificate (the kubelet's). It tells only
    /// SERVING or NOT_SERVING. Port 0 picks a free port, printed on stdout.
    #[arg(long, env = "LORAFLEET_HEALTH_LISTEN", default_value = "0.0.0.0:50052")]
    health_listen: SocketAddr,
}

/// Mutual TLS on the gRPC port: only clients whose certificate the fleet's
/// CA signed (the gateways) may call this worker.
#[derive(Debug, clap::Args)]
pub struct TlsFlags {
    /// This worker's certificate chain (PEM), naming its DNS names.
    #[arg(long, env = "LORAFLEET_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "LORAFLEET_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// The CA bundle (PEM) that clients' certificates must chain to.
    #[arg(long, env = "LORAFLEET_TLS_CLIENT_CA")]
    tls_client_ca: Option<PathBuf>,
    /// Serve gRPC in plain text, to anyone who can reach the port. Only for
    /// a trusted network; required when no TLS flags are given.
    #[arg(long, env = "LORAFLEET_INSECURE_PLAINTEXT")]
    insecure_plaintext: bool,
    /// How often the TLS files are checked for a change, in seconds; a
    /// change applies to new connections without a restart.
    #[arg(long, env = "LORAFLEET_TLS_RELOAD_SECS", default_value_t = 10)]
    tls_reload_secs: u64,
}

/// How long a client may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    if args.worker_id.trim().is_empty() {
        bail!("--worker-id: must not be empty");
    }
    let tls_files = lorafleet_tls::choose(
        args.tls.tls_cert.clone(),
        args.tls.tls_key.clone(),
        args.tls.tls_client_ca.clone(),
        args.tls.insecure_plaintext,
        [
            "--tls-cert",
            "--tls-key",
            "--tls-client-ca",
            "--insecure-plaintext",
        ],
    )
    .map_err(|e| anyhow::anyhow!(e))?;
    if args.tls.tls_reload_secs == 0 {
        bail!("--tls-reload-secs: must be at least 1");
    }
    // Read before the model loads, so a bad certificate fails in seconds.
    let tls = match tls_files {
        Some(files) => Some(lorafleet_tls::Reloading::start(
            files,
            Duration::from_secs(args.tls.tls_reload_secs),
            lorafleet_tls::server::config,
        )?),
        None => {
            tracing::warn!(
                "serving gRPC in plain text (--insecure-plaintext): anyone who reaches the port can generate with every adapter"
            );
            None
        }
    };
    let settings = args.engine.settings()?;
    let choice = args.engine.backend()?;
    let cache = args.adapter_cache.clone().unwrap_or_else(|| {
        let name: String = args
            .worker_id
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        // Per process too: tests run several workers with one id at once.
        std::env::temp_dir().join(format!(
            "lorafleet-adapter-cache-{name}-{}",
            std::process::id()
        ))
    });
    // Every copy in it was verified by this process, none by an earlier one.
    if cache.exists() {
        std::fs::remove_dir_all(&cache)
            .with_context(|| format!("--adapter-cache: emptying {}", cache.display()))?;
    }
    std::fs::create_dir_all(&cache)
        .with_context(|| format!("--adapter-cache: creating {}", cache.display()))?;
    let roots = ArtifactRoots::new(&args.artifact_roots)
        .map_err(|e| anyhow::anyhow!("--artifact-root: {e}"))?;
    let listener = tokio::net::TcpListener::bind(args.grpc_listen)
        .await
        .with_context(|| format!("--grpc-listen {}", args.grpc_listen))?;

    let health_listener = tokio::net::TcpListener::bind(args.health_listen)
        .await
        .with_context(|| format!("--health-listen {}", args.health_listen))?;
    let metrics_listener = tokio::net::TcpListener::bind(args.metrics_listen)
        .await
        .with_context(|| format!("--metrics-listen {}", args.metrics_listen))?;
    let metrics_addr = metrics_listener.local_addr()?;
    lorafleet_worker::telemetry::install(metrics_listener).context("--metrics-listen")?;
    let model = args.model.clone();
    let engine = tokio::task::spawn_blocking(move || Engine::load(&model, settings, choice))
        .await?
        .with_context(|| match choice {
            BackendChoice::Cpu => format!("--model {}", args.model.display()),
            BackendChoice::Cuda { .. } => {
                format!("--backend cuda, --model {}", args.model.display())
            }
        })?;
    let name = args
        .model
        .file_name()
        .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
    let info = WorkerInfo::describe(&engine, &args.worker_id, name, &settings);
    let engine_memory = engine.memory_plan().map(|p| {
        lorafleet_worker::telemetry::record_memory_plan(&p);
        p.summary()
    });
    tracing::info!(
        worker_id = %args.worker_id,
        base_hash = %info.base_model.base_hash,
        backend = %info.backend,
        max_loras = settings.max_loras,
        max_cpu_loras = settings.max_cpu_loras,
        kv_blocks = settings.kv_blocks,
        device = %info.device_name,
        memory = engine_memory.as_deref().unwrap_or("host memory"),
        "model loaded"
    );
    let handle = EngineHandle::spawn(engine, Duration::from_millis(250));
    let draining = Arc::new(AtomicBool::new(false));
    let service = WorkerService::new(handle.clone(), roots, cache.clone(), info, draining.clone());
    let in_flight = service.in_flight();
    let (health, health_service) = lorafleet_proto::health::health_reporter();
    health
        .set_serving::<pb::worker_server::WorkerServer<WorkerService>>()
        .await;

    let addr = listener.local_addr()?;
    let health_addr = health_listener.local_addr()?;
    // Probes only: the health service alone, never the worker's.
    let probes = tonic::transport::Server::builder()
        .add_service(health_service.clone())
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(
            health_listener,
        ));
    tokio::spawn(async move {
        if let Err(e) = probes.await {
            tracing::error!(error = %e, "health listener stopped");
        }
    });
    // Tests and operators read this line to find the port.
    println!(
        "lorafleet-worker listening grpc={addr} metrics={metrics_addr} health={health_addr} tls={}",
        if tls.is_some() { "mutual" } else { "off" }
    );
    std::io::stdout().flush()?;
    tracing::info!(grpc = %addr, metrics = %metrics_addr, health = %health_addr, mtls = tls.is_some(), "listening");

    let drain_deadline = Duration::from_secs(args.drain_deadline_secs);
    let reports = handle.reports();
    let shutdown = async move {
        wait_for_signal().await;
        tracing::info!(deadline_secs = drain_deadline.as_secs(), "draining");
        draining.store(true, Ordering::Release);
        health
            .set_not_serving::<pb::worker_server::WorkerServer<WorkerService>>()
            .await;
        // Running streams finish and reach their clients, up to the deadline.
        let deadline = Instant::now() + drain_deadline;
        let mut reports = reports;
        loop {
            let idle = {
                let r = reports.borrow_and_update();
                r.stats.running == 0 && r.stats.waiting == 0
            };
            if (idle && in_flight.load(Ordering::Acquire) == 0) || Instant::now() >= deadline {
                break;
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), reports.changed()).await;
        }
    };
    let drained = Arc::new(tokio::sync::Notify::new());
    let drained_signal = drained.clone();
    let shutdown = async move {
        shutdown.await;
        drained_signal.notify_one();
    };
    let router = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(pb::worker_server::WorkerServer::new(service));
    let server: std::pin::Pin<
        Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>,
    > = match tls {
        Some(config) => Box::pin(router.serve_with_incoming_shutdown(
            lorafleet_tls::server::incoming(listener, config, HANDSHAKE_TIMEOUT),
            shutdown,
        )),
        None => Box::pin(router.serve_with_incoming_shutdown(
            nodelay(tokio_stream::wrappers::TcpListenerStream::new(listener)),
            shutdown,
        )),
    };
    // Once drained, idle connections and Watch streams (which never end on
    // their own) get a short grace period, then the process exits anyway.
    tokio::select! {
        result = server => result.context("gRPC server")?,
        _ = async {
            drained.notified().await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => {}
    }
    handle.shutdown();
    if args.adapter_cache.is_none() {
        let _ = std::fs::remove_dir_all(&cache);
    }
    tracing::info!("stopped");
    Ok(())
}

/// Accepted connections with Nagle's algorithm off (as the TLS acceptor
/// sets it): a token event is a small write that must leave at once.
fn nodelay(
    incoming: tokio_stream::wrappers::TcpListenerStream,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    tokio_stream::StreamExt::map(incoming, |conn| {
        conn.inspect(|c| {
            let _ = c.set_nodelay(true);
        })
    })
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).expect("install the SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
