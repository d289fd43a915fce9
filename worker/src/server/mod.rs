//! A worker process, as a library: its flags checked into a
//! [`WorkerConfig`] ([`ServeArgs::validate`]), its listeners bound
//! ([`Listeners::bind`]), the model loaded and `lorafleet.worker.v1` and
//! `grpc.health.v1` served ([`start`]), and its drain ([`Running::drain`]).
//! The binary only parses flags, waits for a signal and calls these.

mod cache;
mod flags;

pub use flags::{EngineFlags, ServeArgs, TlsFlags};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use lorafleet_domain::flag::FlagError;
use lorafleet_engine::artifact::ArtifactRoots;
use lorafleet_engine::{BackendChoice, Engine, EngineError, EngineSettings};
use lorafleet_proto::health::HealthReporter;
use lorafleet_proto::worker::v1 as pb;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::info::WorkerInfo;
use crate::runtime::EngineHandle;
use crate::service::WorkerService;

/// How long connections may linger after the drain before the server is
/// stopped anyway.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// How long a client may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the flags cannot start a worker: the flag, and why.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Flag(#[from] FlagError),
    /// The TLS flags (their choice, or the files they name).
    #[error(transparent)]
    Tls(#[from] lorafleet_tls::TlsError),
}

/// Why a worker did not start, or stopped on its own.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("--adapter-cache: {what} {}: {source}", path.display())]
    Cache {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{flag} {addr}: {source}")]
    Bind {
        flag: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("--metrics-listen: {0}")]
    Metrics(#[source] metrics_exporter_prometheus::BuildError),
    #[error("{flags}: {source}")]
    Model {
        flags: String,
        #[source]
        source: EngineError,
    },
    #[error("the model load task failed: {0}")]
    LoadTask(#[source] tokio::task::JoinError),
    #[error("gRPC server: {0}")]
    Grpc(#[source] tonic::transport::Error),
    #[error("the gRPC server stopped on its own")]
    Stopped,
}

/// Every setting of a worker, checked.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The base model directory.
    pub model: PathBuf,
    pub artifact_roots: ArtifactRoots,
    /// The object stores artifact URIs may name (`s3://`).
    pub artifact_stores: lorafleet_store::ObjectStores,
    pub grpc_listen: SocketAddr,
    pub metrics_listen: SocketAddr,
    pub health_listen: SocketAddr,
    pub worker_id: String,
    pub settings: EngineSettings,
    pub backend: BackendChoice,
    /// On SIGTERM, how long running streams may take to finish.
    pub drain_deadline: Duration,
    /// None: a directory of this process under the temporary directory,
    /// removed after the drain.
    pub adapter_cache: Option<PathBuf>,
    /// None: plain text (`--insecure-plaintext`).
    pub tls: Option<lorafleet_tls::PemFiles>,
    pub tls_reload: Duration,
}

/// The sockets a worker serves on, bound before it starts (port 0 picks a
/// free one).
#[derive(Debug)]
pub struct Listeners {
    pub grpc: TcpListener,
    pub health: TcpListener,
    pub metrics: TcpListener,
}

impl Listeners {
    pub async fn bind(config: &WorkerConfig) -> Result<Listeners, ServerError> {
        async fn bind(flag: &'static str, addr: SocketAddr) -> Result<TcpListener, ServerError> {
            TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Bind { flag, addr, source })
        }
        Ok(Listeners {
            grpc: bind("--grpc-listen", config.grpc_listen).await?,
            health: bind("--health-listen", config.health_listen).await?,
            metrics: bind("--metrics-listen", config.metrics_listen).await?,
        })
    }
}

/// A started worker.
#[derive(Debug)]
pub struct Running {
    pub grpc: SocketAddr,
    pub metrics: SocketAddr,
    pub health: SocketAddr,
    /// Whether gRPC is served over mutual TLS.
    pub mutual_tls: bool,
    server: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
    /// Ends the gRPC server's graceful shutdown wait.
    stop: watch::Sender<bool>,
    draining: Arc<AtomicBool>,
    in_flight: Arc<AtomicUsize>,
    reporter: HealthReporter,
    handle: EngineHandle,
    /// The default adapter cache, removed after the drain, with its lock
    /// (held until then).
    remove_cache: Option<(PathBuf, std::fs::File)>,
    probes: JoinHandle<()>,
}

/// The adapter cache, emptied: every copy in it is one this process
/// verified. `--adapter-cache` as given; by default a locked directory of
/// this process under the temporary directory, after the caches of
/// workers that are gone were removed.
fn adapter_cache(config: &WorkerConfig) -> Result<(PathBuf, Option<std::fs::File>), ServerError> {
    let error = |what, path: &PathBuf, source| ServerError::Cache {
        what,
        path: path.clone(),
        source,
    };
    if let Some(dir) = &config.adapter_cache {
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| error("emptying", dir, e))?;
        }
        std::fs::create_dir_all(dir).map_err(|e| error("creating", dir, e))?;
        return Ok((dir.clone(), None));
    }
    let root = std::env::temp_dir();
    let removed = cache::sweep(&root);
    if !removed.is_empty() {
        tracing::info!(
            count = removed.len(),
            "removed the adapter caches of workers that are gone"
        );
    }
    let dir = cache::default_dir(&root, &config.worker_id);
    let lock = cache::create_locked(&dir).map_err(|e| error("creating", &dir, e))?;
    Ok((dir, Some(lock)))
}

fn local_addr(flag: &'static str, l: &TcpListener) -> Result<SocketAddr, ServerError> {
    l.local_addr().map_err(|source| ServerError::Bind {
        flag,
        addr: SocketAddr::from(([0, 0, 0, 0], 0)),
        source,
    })
}

/// Reads the TLS files (before the model loads, so a bad certificate fails
/// in seconds), empties the adapter cache, installs the metrics endpoint,
/// loads the model, and serves gRPC and the plain-text health port.
pub async fn start(config: WorkerConfig, listeners: Listeners) -> Result<Running, ServerError> {
    let tls = match config.tls.clone() {
        Some(files) => Some(
            lorafleet_tls::Reloading::start(
                files,
                config.tls_reload,
                lorafleet_tls::server::config,
            )
            .map_err(ConfigError::from)?,
        ),
        None => {
            tracing::warn!(
                "serving gRPC in plain text (--insecure-plaintext): anyone who reaches the port can generate with every adapter"
            );
            None
        }
    };
    let (cache, cache_lock) = adapter_cache(&config)?;
    let metrics = local_addr("--metrics-listen", &listeners.metrics)?;
    crate::telemetry::install(listeners.metrics).map_err(ServerError::Metrics)?;
    let engine = load(&config).await?;
    let name = config
        .model
        .file_name()
        .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
    // The engine's settings, as it derived them (a memory budget sets the
    // KV blocks).
    let settings = engine.settings();
    let info = WorkerInfo::describe(&engine, &config.worker_id, name, &settings);
    let engine_memory = engine.memory_plan().map(|p| {
        crate::telemetry::record_memory_plan(&p);
        p.summary()
    });
    tracing::info!(
        worker_id = %config.worker_id,
        base_hash = %info.base_model.base_hash,
        quantization = %info.base_model.quantization,
        weights_bytes = info.base_model.weights_bytes,
        backend = %info.backend,
        max_loras = settings.max_loras,
        max_cpu_loras = settings.max_cpu_loras,
        kv_blocks = settings.kv_blocks,
        memory_budget_bytes = settings.memory_budget_bytes,
        device = %info.device_name,
        memory = engine_memory.as_deref().unwrap_or("host memory"),
        "model loaded"
    );
    crate::telemetry::set_base_model(&info.base_model.name);
    let handle = EngineHandle::spawn(engine, Duration::from_millis(250));
    let draining = Arc::new(AtomicBool::new(false));
    let service = WorkerService::new(
        handle.clone(),
        config.artifact_roots.clone(),
        cache.clone(),
        info,
        draining.clone(),
    )
    .with_stores(config.artifact_stores.clone());
    let in_flight = service.in_flight();
    let (reporter, health_service) = lorafleet_proto::health::health_reporter();
    reporter
        .set_serving::<pb::worker_server::WorkerServer<WorkerService>>()
        .await;
    let grpc = local_addr("--grpc-listen", &listeners.grpc)?;
    let health = local_addr("--health-listen", &listeners.health)?;
    // Probes only: the health service alone, never the worker's.
    let probes = tonic::transport::Server::builder()
        .add_service(health_service.clone())
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(
            listeners.health,
        ));
    let probes = tokio::spawn(async move {
        if let Err(e) = probes.await {
            tracing::error!(error = %e, "health listener stopped");
        }
    });
    let (stop, stop_rx) = watch::channel(false);
    let shutdown = async move {
        let mut rx = stop_rx;
        let _ = rx.wait_for(|v| *v).await;
    };
    let router = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(pb::worker_server::WorkerServer::new(service));
    let mutual_tls = tls.is_some();
    let server = match tls {
        Some(tls) => tokio::spawn(router.serve_with_incoming_shutdown(
            lorafleet_tls::server::incoming(listeners.grpc, tls, HANDSHAKE_TIMEOUT),
            shutdown,
        )),
        None => tokio::spawn(router.serve_with_incoming_shutdown(
            nodelay(tokio_stream::wrappers::TcpListenerStream::new(
                listeners.grpc,
            )),
            shutdown,
        )),
    };
    tracing::info!(grpc = %grpc, metrics = %metrics, health = %health, mtls = mutual_tls, "listening");
    Ok(Running {
        grpc,
        metrics,
        health,
        mutual_tls,
        server: Some(server),
        stop,
        draining,
        in_flight,
        reporter,
        handle,
        remove_cache: cache_lock.map(|lock| (cache, lock)),
        probes,
    })
}

/// Loads the base model on a blocking thread; an error names the flags.
async fn load(config: &WorkerConfig) -> Result<Engine, ServerError> {
    let (model, settings, choice) = (config.model.clone(), config.settings, config.backend);
    tokio::task::spawn_blocking(move || Engine::load(&model, settings, choice))
        .await
        .map_err(ServerError::LoadTask)?
        .map_err(|source| ServerError::Model {
            flags: match config.backend {
                BackendChoice::Cpu => format!("--model {}", config.model.display()),
                BackendChoice::Cuda { .. } => {
                    format!("--backend cuda, --model {}", config.model.display())
                }
            },
            source,
        })
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

impl Running {
    /// Resolves only if the gRPC server stops on its own: the caller then
    /// exits with an error rather than linger unable to serve.
    pub async fn stopped(&mut self) -> ServerError {
        match self.server.as_mut() {
            Some(server) => {
                let result = server.await;
                self.server = None;
                match result {
                    Ok(Err(e)) => ServerError::Grpc(e),
                    _ => ServerError::Stopped,
                }
            }
            None => std::future::pending().await,
        }
    }

    /// Takes no new requests (they are refused `draining`; the health
    /// service says NOT_SERVING) and lets running streams finish and reach
    /// their clients, up to `deadline`; then idle connections and Watch
    /// streams (which never end on their own) get a short grace, and the
    /// engine stops.
    pub async fn drain(mut self, deadline: Duration) {
        tracing::info!(deadline_secs = deadline.as_secs(), "draining");
        self.draining.store(true, Ordering::Release);
        self.reporter
            .set_not_serving::<pb::worker_server::WorkerServer<WorkerService>>()
            .await;
        let until = Instant::now() + deadline;
        let mut reports = self.handle.reports();
        loop {
            let idle = {
                let r = reports.borrow_and_update();
                r.stats.running == 0 && r.stats.waiting == 0
            };
            if (idle && self.in_flight.load(Ordering::Acquire) == 0) || Instant::now() >= until {
                break;
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), reports.changed()).await;
        }
        let _ = self.stop.send(true);
        if let Some(mut server) = self.server.take()
            && tokio::time::timeout(SHUTDOWN_GRACE, &mut server)
                .await
                .is_err()
        {
            server.abort();
        }
        self.probes.abort();
        self.handle.shutdown();
        if let Some((cache, lock)) = self.remove_cache {
            let _ = std::fs::remove_dir_all(cache);
            drop(lock);
        }
        tracing::info!("stopped");
    }
}
