//! A gateway process, as a library: its flags checked into a
//! [`GatewayConfig`] ([`ServeArgs::validate`], a function of the flags),
//! its listeners bound ([`Listeners::bind`]), everything it serves started
//! ([`start`]), and its drain ([`Running::drain`]). The binary only parses
//! flags, waits for a signal and calls these; a test starts a gateway in
//! process on port 0 the same way.

mod artifact_flags;
mod config;
mod flags;
mod worker_tls;

pub use config::{AdminConfig, ConfigError, GatewayConfig, WorkerTls};
pub use flags::{AdminJwtArgs, ServeArgs};
pub use worker_tls::WorkerTlsFlags;

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use metrics_exporter_prometheus::PrometheusHandle;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinHandle;

use crate::admin::AdminState;
use crate::api::{self, AppState};
use crate::audit::SpoolError;
use crate::concurrency::TenantSlots;
use crate::db::{self, DbError};
use crate::ratelimit::RateLimiter;
use crate::registry::{Registry, Snapshot};
use crate::rollout::ControllerConfig;
use crate::router::fleet::{Fleet, Transport};

/// After the drain deadline, how long open requests get to write their
/// rows and close their connections.
const CUT_SETTLE: Duration = Duration::from_secs(5);

/// Why a gateway did not start, or stopped on its own.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Database(#[from] DbError),
    #[error("--database-url: reading the registry (did `lorafleet-gateway migrate` run?): {0}")]
    Registry(#[source] sqlx::Error),
    #[error("--redis-url: {0}")]
    Redis(#[source] redis::RedisError),
    #[error("{flag} {addr}: {source}")]
    Bind {
        flag: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("--audit-spool: {0}")]
    Spool(#[source] SpoolError),
    #[error("the metrics recorder: {0}")]
    Metrics(String),
    #[error("the HTTP server stopped on its own")]
    Stopped,
}

/// The sockets a gateway serves on, bound before it starts (port 0 picks
/// a free one).
#[derive(Debug)]
pub struct Listeners {
    /// None for an admin plane served alone (`--admin-only`).
    pub http: Option<TcpListener>,
    pub metrics: TcpListener,
    pub admin: Option<TcpListener>,
}

impl Listeners {
    /// Binds the addresses `config` names.
    pub async fn bind(config: &GatewayConfig) -> Result<Listeners, ServerError> {
        async fn bind(flag: &'static str, addr: SocketAddr) -> Result<TcpListener, ServerError> {
            TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Bind { flag, addr, source })
        }
        Ok(Listeners {
            http: match config.listen {
                Some(addr) => Some(bind("--listen", addr).await?),
                None => None,
            },
            metrics: bind("--metrics-listen", config.metrics_listen).await?,
            admin: match &config.admin {
                Some(a) => Some(bind("--admin-listen", a.listen).await?),
                None => None,
            },
        })
    }
}

/// A started gateway.
#[derive(Debug)]
pub struct Running {
    /// The OpenAI API's address; None for an admin plane served alone.
    pub http: Option<SocketAddr>,
    pub metrics: SocketAddr,
    pub admin: Option<SocketAddr>,
    /// The HTTP server; None once it has ended.
    server: Option<JoinHandle<()>>,
    /// Stops accepting connections.
    stop: watch::Sender<bool>,
    /// Ends open requests (past the drain deadline).
    cut: watch::Sender<bool>,
    permits: Arc<Semaphore>,
    max_permits: usize,
    state: AppState,
    audit_writer: JoinHandle<()>,
    audit_flush: Duration,
    pool: PgPool,
    /// The metrics server, the upkeep timer, the rollout controller and
    /// the admin server: stopped with the gateway.
    background: Vec<JoinHandle<()>>,
}

/// The process's one Prometheus recorder: installed by the first gateway
/// started, shared by any other started in the same process.
fn prometheus() -> Result<PrometheusHandle, ServerError> {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    if let Some(h) = HANDLE.get() {
        return Ok(h.clone());
    }
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets(&[
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        ])
        .map_err(|e| ServerError::Metrics(e.to_string()))?
        .install_recorder()
        .map_err(|e| ServerError::Metrics(e.to_string()))?;
    Ok(HANDLE.get_or_init(|| handle).clone())
}

/// The transport the worker TLS settings choose; the files are read now,
/// so a bad one fails at start, naming its flag.
fn transport(tls: &WorkerTls) -> Result<Transport, ConfigError> {
    let Some(files) = tls.files.clone() else {
        tracing::warn!("talking to workers in plain text (--insecure-plaintext)");
        return Ok(Transport::Plaintext);
    };
    let config = lorafleet_tls::Reloading::start(files, tls.reload, lorafleet_tls::client::config)?;
    Ok(Transport::MutualTls {
        config,
        server_name: tls.server_name.clone(),
    })
}

/// Starts everything a gateway serves on `listeners`: the database pools
/// and the registry snapshot, Redis, the fleet, the audit writer, the
/// OpenAI API, the metrics endpoint and, when configured, the admin plane,
/// the console and the rollout controller.
pub async fn start(config: GatewayConfig, listeners: Listeners) -> Result<Running, ServerError> {
    let transport = transport(&config.worker_tls)?;
    // The request path's statements are short; a stuck one must not hold
    // a connection that audit writes and registry reloads need.
    let options = db::parse_database_url("--database-url", &config.database_url)?
        .options([("statement_timeout", "5s"), ("lock_timeout", "2s")]);
    // The audit writer's inserts in flight, plus registry reloads and
    // tenants' usage reports; kept open, since an answer waits for its
    // row's insert.
    let in_flight = crate::audit::INSERTS_IN_FLIGHT as u32;
    let most = in_flight + 4 + crate::usage::REPORTS_AT_ONCE as u32;
    let pool = db::connect_warm(options, in_flight, most, Duration::from_secs(5)).await?;
    let snapshot = Snapshot::load(&pool).await.map_err(ServerError::Registry)?;
    let registry = Registry::new(snapshot);
    let redis = match &config.redis_url {
        Some(url) => {
            let client = redis::Client::open(url.as_str()).map_err(ServerError::Redis)?;
            let options = redis::aio::ConnectionManagerConfig::new()
                .set_connection_timeout(Some(Duration::from_millis(500)))
                .set_response_timeout(Some(Duration::from_millis(500)))
                .set_number_of_retries(1);
            // Lazily: a gateway starts and serves while Redis is down.
            Some(
                redis::aio::ConnectionManager::new_lazy_with_config(client, options)
                    .map_err(ServerError::Redis)?,
            )
        }
        None => None,
    };
    let channel = format!("{}registry", config.redis_prefix);
    registry.spawn_refresher(
        pool.clone(),
        config.redis_url.clone(),
        channel.clone(),
        config.registry_refresh,
    );
    let fleet = Fleet::new(config.policy, transport);
    fleet.start(config.discovery.clone());
    let (audit, audit_writer) =
        crate::audit::start(pool.clone(), &config.audit).map_err(ServerError::Spool)?;
    let (cut, cut_rx) = watch::channel(false);
    let state = AppState {
        tenant_series: Arc::new(crate::api::series::TenantSeries::new(config.tenant_series)),
        registry,
        jwt: config.jwt.clone(),
        fleet,
        tenant_slots: TenantSlots::new(
            redis.clone(),
            config.redis_prefix.clone(),
            config.gateway_replicas,
        ),
        default_max_concurrent: config.max_concurrent_per_tenant,
        limiter: RateLimiter::new(redis, config.redis_prefix.clone(), config.gateway_replicas),
        audit,
        permits: Arc::new(Semaphore::new(config.max_concurrent_requests)),
        max_body_bytes: config.max_body_bytes,
        body_timeout: config.body_timeout,
        default_rpm_limit: config.default_rpm_limit,
        default_tpm_limit: config.default_tpm_limit,
        request_timeout: config.request_timeout,
        max_attempts: config.max_attempts,
        first_token_timeout: config.first_token_timeout,
        registry_max_age: config.registry_max_age,
        cut: cut_rx,
        sources: crate::sources::Sources::new(config.sources.clone()),
        usage_pool: pool.clone(),
        usage_reports: Arc::new(Semaphore::new(crate::usage::REPORTS_AT_ONCE)),
    };
    let mut background = vec![state.sources.spawn_flusher(state.audit.clone())];
    let admin = match (&config.admin, listeners.admin) {
        (Some(a), Some(listener)) => {
            let (addr, tasks) = start_admin(&config, a, listener, &state, channel).await?;
            background.extend(tasks);
            Some(addr)
        }
        _ => None,
    };
    let metrics = local_addr("--metrics-listen", &listeners.metrics)?;
    background.extend(serve_metrics(listeners.metrics, prometheus()?, &state));
    let (stop, stop_rx) = watch::channel(false);
    let stop_accepting = async move {
        let mut rx = stop_rx;
        let _ = rx.wait_for(|v| *v).await;
    };
    let (http, server) = match listeners.http {
        Some(listener) => {
            let http = local_addr("--listen", &listener)?;
            let server = serve_with_rules(
                listener,
                api::router(state.clone()),
                &config,
                &state,
                stop_accepting,
            );
            (Some(http), Some(server))
        }
        // The admin plane alone: no public listener.
        None => (None, None),
    };
    tracing::info!(http = ?http, metrics = %metrics, admin = ?admin, "listening");
    Ok(Running {
        http,
        metrics,
        admin,
        server,
        stop,
        cut,
        permits: state.permits.clone(),
        max_permits: config.max_concurrent_requests,
        state,
        audit_writer,
        audit_flush: config.audit_flush,
        pool,
        background,
    })
}

/// Serves `app` on `listener` under the connection rules (deadlines,
/// caps, a trusted proxy exempt from the per-source cap) until `stop`.
fn serve_with_rules(
    listener: TcpListener,
    app: axum::Router,
    config: &GatewayConfig,
    state: &AppState,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> JoinHandle<()> {
    let sources = state.sources.clone();
    tokio::spawn(crate::listener::serve(
        listener,
        app,
        config.connections,
        Arc::new(move |ip| sources.from_trusted_proxy(Some(ip))),
        stop,
    ))
}

fn local_addr(flag: &'static str, l: &TcpListener) -> Result<SocketAddr, ServerError> {
    l.local_addr().map_err(|source| ServerError::Bind {
        flag,
        addr: SocketAddr::from(([0, 0, 0, 0], 0)),
        source,
    })
}

/// The admin API and console on their listener, the rollout controller
/// with its evaluator, and the audit partition maintainer (every replica
/// with an admin plane runs them; a lease each lets one act at a time).
async fn start_admin(
    config: &GatewayConfig,
    a: &AdminConfig,
    listener: TcpListener,
    state: &AppState,
    channel: String,
) -> Result<(SocketAddr, Vec<JoinHandle<()>>), ServerError> {
    let addr = local_addr("--admin-listen", &listener)?;
    let admin_state = admin_state(config, a, state, channel).await?;
    let holder = format!(
        "{}-{}",
        config.audit.spool_owner,
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let controller = tokio::spawn(crate::rollout::run(
        admin_state.pool.clone(),
        admin_state.clone(),
        ControllerConfig {
            holder: holder.clone(),
            tick: config.rollout_tick,
            lease: config.rollout_lease,
        },
    ));
    let evaluator = tokio::spawn(crate::evaluator::run(
        admin_state.clone(),
        state.clone(),
        crate::evaluator::EvaluatorConfig {
            holder: holder.clone(),
            tick: config.rollout_tick,
        },
    ));
    let partitions = tokio::spawn(crate::audit::partitions::run(
        admin_state.pool.clone(),
        crate::audit::partitions::MaintainerConfig {
            holder,
            retention_days: config.audit_retention_days,
        },
    ));
    let console = crate::console::router(
        admin_state.clone(),
        crate::console::ConsoleOptions {
            secure_cookie: a.secure_cookie,
        },
    );
    let app = crate::admin::router(admin_state).merge(console);
    // The same deadlines and caps as the public listener.
    let server = serve_with_rules(listener, app, config, state, std::future::pending());
    Ok((addr, vec![controller, evaluator, partitions, server]))
}

/// The admin plane's state, on its own pool so admin queries never hold up
/// audit writes or registry reloads.
async fn admin_state(
    config: &GatewayConfig,
    a: &AdminConfig,
    state: &AppState,
    channel: String,
) -> Result<AdminState, ServerError> {
    let (flag, url) = match &config.admin_database_url {
        Some(url) => ("--admin-database-url", url.as_str()),
        None => ("--database-url", config.database_url.as_str()),
    };
    let timeout = format!("{}s", config.admin_statement_timeout.as_secs());
    let options = db::parse_database_url(flag, url)?.options([
        ("statement_timeout", timeout.as_str()),
        ("lock_timeout", "5s"),
    ]);
    Ok(AdminState {
        pool: db::connect(options, 4, Duration::from_secs(5)).await?,
        registry: state.registry.clone(),
        redis: state.limiter.redis(),
        channel,
        jwt: a.jwt.clone(),
        artifact_roots: a.artifact_roots.clone(),
        artifact_stores: a.artifact_stores.clone(),
        max_lora_rank: a.max_lora_rank,
        fleet: state.fleet.clone(),
    })
}

/// `GET /metrics` and `GET /readyz` with its reasons (the public port's
/// says only its status), and a timer that drains histogram samples (they
/// pile up until drained, whether or not Prometheus scrapes) and sets the
/// registry age gauge.
fn serve_metrics(
    listener: TcpListener,
    prometheus: PrometheusHandle,
    state: &AppState,
) -> [JoinHandle<()>; 2] {
    let upkeep = prometheus.clone();
    let registry = state.registry.clone();
    let ready_state = state.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let p = prometheus.clone();
                async move { p.render() }
            }),
        )
        .route(
            "/readyz",
            axum::routing::get(move || {
                let s = ready_state.clone();
                async move { api::readiness(&s) }
            }),
        );
    [
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        }),
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(5));
            loop {
                every.tick().await;
                upkeep.run_upkeep();
                metrics::gauge!("lorafleet_gateway_registry_age_seconds")
                    .set(registry.age().as_secs_f64());
            }
        }),
    ]
}

impl Running {
    /// Resolves only if the HTTP server stops on its own (it does not,
    /// short of a bug): the caller then exits with an error rather than
    /// linger unable to serve.
    pub async fn stopped(&mut self) -> ServerError {
        match self.server.as_mut() {
            Some(server) => {
                let _ = server.await;
                self.server = None;
                ServerError::Stopped
            }
            None => std::future::pending().await,
        }
    }

    /// Stops accepting connections and gives open requests until
    /// `deadline`; then ends them, each with an error event or a 503 and
    /// its `cancelled` audit row. Every admitted row is placed (Postgres or
    /// the spool) before this returns, within the audit flush time.
    pub async fn drain(mut self, deadline: Duration) {
        let _ = self.stop.send(true);
        tracing::info!(deadline_secs = deadline.as_secs(), "draining");
        let until = tokio::time::Instant::now() + deadline;
        let mut finished = match self.server.as_mut() {
            None => true,
            Some(server) => tokio::select! {
                _ = server => true,
                _ = tokio::time::sleep_until(until) => false,
            },
        };
        let open = || self.max_permits - self.permits.available_permits();
        if !finished || open() > 0 {
            // Past the deadline: open requests end now.
            tracing::warn!(open = open(), "drain deadline passed; ending open requests");
            let _ = self.cut.send(true);
            let settle = tokio::time::Instant::now() + CUT_SETTLE;
            while open() > 0 && tokio::time::Instant::now() < settle {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if let Some(server) = self.server.as_mut().filter(|_| !finished) {
                finished = tokio::time::timeout_at(settle, &mut *server).await.is_ok();
                if !finished {
                    server.abort();
                }
            }
        }
        // Failed authentications of the windows still open get their rows.
        self.state.sources.flush(&self.state.audit, true);
        // The writer stops once every admitted row is placed, even if idle
        // connections still hold the state.
        self.state.audit.close();
        drop(self.state);
        if tokio::time::timeout(self.audit_flush, self.audit_writer)
            .await
            .is_err()
        {
            tracing::error!(
                flush_secs = self.audit_flush.as_secs(),
                "the audit writer did not finish in time; rows no client was answered for may be lost"
            );
        }
        for task in self.background {
            task.abort();
        }
        self.pool.close().await;
        tracing::info!("stopped");
    }
}
