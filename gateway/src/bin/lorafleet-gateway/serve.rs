//! `lorafleet-gateway serve`: the OpenAI API over the worker fleet.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::sync::Semaphore;

use lorafleet_gateway::api::{self, AppState};
use lorafleet_gateway::auth::JwtArgs;
use lorafleet_gateway::db;
use lorafleet_gateway::ratelimit::RateLimiter;
use lorafleet_gateway::registry::{Registry, Snapshot};
use lorafleet_gateway::router::fleet::{Discovery, Fleet, Transport};
use lorafleet_gateway::router::policy::Policy;

/// Flags of `serve`; each has an environment fallback.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The registry database, as postgres://USER[:PASSWORD]@HOST:PORT/DATABASE.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Redis for shared rate limits and registry change announcements, as
    /// redis://HOST:PORT. Without it limits are per replica and the registry
    /// refreshes on the interval only.
    #[arg(long, env = "LORAFLEET_REDIS_URL", hide_env_values = true)]
    pub redis_url: Option<String>,
    /// Prefix of every Redis key and channel this gateway uses.
    #[arg(long, env = "LORAFLEET_REDIS_PREFIX", default_value = "lorafleet:")]
    pub redis_prefix: String,
    /// Where to serve the OpenAI API. Port 0 picks a free port, printed on stdout.
    #[arg(long, env = "LORAFLEET_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,
    /// Where to serve Prometheus metrics (`GET /metrics`).
    #[arg(long, env = "LORAFLEET_METRICS_LISTEN", default_value = "0.0.0.0:9091")]
    pub metrics_listen: SocketAddr,
    /// Worker gRPC addresses, HOST:PORT, comma-separated.
    #[arg(long, env = "LORAFLEET_WORKERS", value_delimiter = ',')]
    pub workers: Vec<String>,
    /// A DNS name (HOST:PORT) whose addresses are the workers, such as a
    /// Kubernetes headless service; re-resolved every --workers-dns-refresh-secs.
    #[arg(long, env = "LORAFLEET_WORKERS_DNS")]
    pub workers_dns: Option<String>,
    #[arg(long, env = "LORAFLEET_WORKERS_DNS_REFRESH_SECS", default_value_t = 10)]
    pub workers_dns_refresh_secs: u64,
    #[command(flatten)]
    pub worker_tls: WorkerTlsFlags,
    /// Bounded-load factor c: no worker above c × the average load.
    #[arg(long, env = "LORAFLEET_LOAD_FACTOR", default_value_t = 1.25)]
    pub load_factor: f64,
    /// In-flight requests one replica of an adapter carries before the
    /// adapter spreads to another worker.
    #[arg(long, env = "LORAFLEET_REPLICA_SHARE", default_value_t = 8.0)]
    pub replica_share: f64,
    /// Registry snapshot refresh interval, as a backstop to announcements.
    #[arg(long, env = "LORAFLEET_REGISTRY_REFRESH_SECS", default_value_t = 30)]
    pub registry_refresh_secs: u64,
    /// Requests handled at once; more get 429.
    #[arg(
        long,
        env = "LORAFLEET_MAX_CONCURRENT_REQUESTS",
        default_value_t = 1024
    )]
    pub max_concurrent_requests: usize,
    /// Requests one tenant may have in this gateway at once (its body
    /// reads included); more get 429 `tenant_concurrency_limit`. Default:
    /// a quarter of --max-concurrent-requests, so no tenant can take them
    /// all.
    #[arg(long, env = "LORAFLEET_MAX_CONCURRENT_PER_TENANT")]
    pub max_concurrent_per_tenant: Option<usize>,
    /// Requests per minute for a tenant whose registry row sets none; 0
    /// means unlimited.
    #[arg(long, env = "LORAFLEET_DEFAULT_RPM_LIMIT", default_value_t = 600)]
    pub default_rpm_limit: u32,
    /// Tokens per minute for a tenant whose registry row sets none; 0
    /// means unlimited.
    #[arg(long, env = "LORAFLEET_DEFAULT_TPM_LIMIT", default_value_t = 1_000_000)]
    pub default_tpm_limit: u64,
    /// Longest a client may take to send its request line and headers, in
    /// seconds; then the connection is closed.
    #[arg(long, env = "LORAFLEET_HEADER_TIMEOUT_SECS", default_value_t = 10)]
    pub header_timeout_secs: u64,
    /// Longest a client may take to send its request body, in seconds;
    /// then 408 `body_timeout`.
    #[arg(long, env = "LORAFLEET_BODY_TIMEOUT_SECS", default_value_t = 30)]
    pub body_timeout_secs: u64,
    /// Largest request body accepted, in bytes.
    #[arg(long, env = "LORAFLEET_MAX_BODY_BYTES", default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// Longest a completion may take, in seconds.
    #[arg(long, env = "LORAFLEET_REQUEST_TIMEOUT_SECS", default_value_t = 600)]
    pub request_timeout_secs: u64,
    /// Longest a worker may take to produce a request's first token, in
    /// seconds; then the next worker is tried (504 `first_token_timeout`
    /// when none answers in time).
    #[arg(
        long,
        env = "LORAFLEET_FIRST_TOKEN_TIMEOUT_SECS",
        default_value_t = 120
    )]
    pub first_token_timeout_secs: u64,
    /// Workers tried per request before the first token.
    #[arg(long, env = "LORAFLEET_MAX_ATTEMPTS", default_value_t = 3)]
    pub max_attempts: usize,
    /// Gateway replicas sharing the rate limits; without Redis each replica
    /// enforces its share.
    #[arg(long, env = "LORAFLEET_GATEWAY_REPLICAS", default_value_t = 1)]
    pub gateway_replicas: u32,
    /// The registry for the admin API, as a role with registry write access
    /// (`lorafleet_admin`); its own pool, so admin queries never hold up
    /// audit writes or registry reloads. Defaults to --database-url.
    #[arg(long, env = "LORAFLEET_ADMIN_DATABASE_URL", hide_env_values = true)]
    pub admin_database_url: Option<String>,
    /// Longest one admin API statement may run (audit queries and exports
    /// page by page), in seconds.
    #[arg(
        long,
        env = "LORAFLEET_ADMIN_STATEMENT_TIMEOUT_SECS",
        default_value_t = 30
    )]
    pub admin_statement_timeout_secs: u64,
    /// Longest age of the registry snapshot this replica serves from, in
    /// seconds. Past it (Postgres unreachable that long), completions get
    /// 503 `registry_stale` and /readyz fails, so a revoked key or route
    /// cannot keep working indefinitely.
    #[arg(long, env = "LORAFLEET_REGISTRY_MAX_AGE_SECS", default_value_t = 600)]
    pub registry_max_age_secs: u64,
    /// The audit spool's directory: rows wait here while Postgres is
    /// unreachable. Gateways may share it (a ReadWriteMany volume): each
    /// writes under its own --audit-spool-owner and adopts the rows of
    /// owners that are gone.
    #[arg(
        long,
        env = "LORAFLEET_AUDIT_SPOOL",
        default_value = "lorafleet-audit-spool"
    )]
    pub audit_spool: PathBuf,
    /// This process's name in the spool (default: $HOSTNAME, the pod name).
    #[arg(long, env = "LORAFLEET_AUDIT_SPOOL_OWNER")]
    pub audit_spool_owner: Option<String>,
    /// Disk limit of the whole spool, in bytes. When Postgres is
    /// unreachable and the spool is this full, new completions get 503
    /// `audit_unavailable`: nothing is served without its row.
    #[arg(long, env = "LORAFLEET_AUDIT_SPOOL_MAX_BYTES", default_value_t = 1 << 30)]
    pub audit_spool_max_bytes: u64,
    /// Rows the audit queue holds (each request in flight holds one).
    #[arg(long, env = "LORAFLEET_AUDIT_QUEUE_ROWS", default_value_t = 16384)]
    pub audit_queue_rows: usize,
    /// Bytes the audit queue holds.
    #[arg(long, env = "LORAFLEET_AUDIT_QUEUE_BYTES", default_value_t = 64 << 20)]
    pub audit_queue_bytes: usize,
    /// Longest a response waits for its audit row to be durable before it
    /// is refused instead (503 `audit_unavailable`), in seconds.
    #[arg(long, env = "LORAFLEET_AUDIT_ACK_TIMEOUT_SECS", default_value_t = 10)]
    pub audit_ack_timeout_secs: u64,
    /// What a completion's answer waits for: `commit` (its audit row
    /// committed in Postgres) or `journal` (the row fsynced in this
    /// gateway's spool directory, then inserted just after; a crash
    /// replays it). `journal` takes the database round trip off every
    /// answer; put the spool on a disk with fast fsync.
    #[arg(long, env = "LORAFLEET_AUDIT_DURABILITY", default_value = "commit")]
    pub audit_durability: lorafleet_gateway::audit::Durability,
    /// How often the rollout controller judges running rollouts (and the
    /// replica holding its lease renews it), in milliseconds.
    #[arg(long, env = "LORAFLEET_ROLLOUT_TICK_MS", default_value_t = 5000)]
    pub rollout_tick_ms: u64,
    /// How long the rollout lease lasts unrenewed, in seconds: when the
    /// replica driving rollouts dies, another takes over within this.
    #[arg(long, env = "LORAFLEET_ROLLOUT_LEASE_SECS", default_value_t = 30)]
    pub rollout_lease_secs: u64,
    /// On shutdown, how long the audit queue may take to reach Postgres or
    /// the spool, in seconds.
    #[arg(long, env = "LORAFLEET_AUDIT_FLUSH_SECS", default_value_t = 10)]
    pub audit_flush_secs: u64,
    /// On SIGTERM, how long running requests may take to finish, in
    /// seconds; then streams end with an error event and a `cancelled` row.
    #[arg(long, env = "LORAFLEET_DRAIN_DEADLINE_SECS", default_value_t = 30)]
    pub drain_deadline_secs: u64,
    #[command(flatten)]
    pub jwt: JwtArgs,
    /// Where to serve the admin API (`/admin/v1`). Off unless set; needs an
    /// admin JWT key.
    #[arg(long, env = "LORAFLEET_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// Let the admin console's session cookie travel over plain HTTP to a
    /// host other than localhost. By default it is `Secure`: browsers keep
    /// it only over HTTPS (or on `http://localhost`).
    #[arg(long, env = "LORAFLEET_CONSOLE_INSECURE_COOKIE")]
    pub console_insecure_cookie: bool,
    #[command(flatten)]
    pub admin_jwt: AdminJwtArgs,
    /// Directory holding adapter artifacts; registration reads and digests
    /// artifacts here. Repeatable.
    #[arg(long, env = "LORAFLEET_ARTIFACT_ROOT", value_delimiter = ',')]
    pub artifact_root: Vec<PathBuf>,
    /// The largest LoRA rank any worker pool accepts; registration refuses
    /// adapters above it.
    #[arg(long, env = "LORAFLEET_MAX_LORA_RANK", default_value_t = 64)]
    pub max_lora_rank: usize,
}

/// Admin JWT settings. Admin tokens carry `sub` and a `role` claim
/// (admin, auditor or viewer).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct AdminJwtArgs {
    /// File holding the shared secret for HS256/HS384/HS512 admin tokens.
    #[arg(long, env = "LORAFLEET_ADMIN_JWT_HMAC_SECRET_FILE")]
    pub admin_jwt_hmac_secret_file: Option<PathBuf>,
    /// PEM file with the RSA or EC public key for RS*/PS*/ES* admin tokens.
    #[arg(long, env = "LORAFLEET_ADMIN_JWT_PUBLIC_KEY_FILE")]
    pub admin_jwt_public_key_file: Option<PathBuf>,
    /// Algorithms accepted for admin tokens (comma-separated).
    #[arg(long, env = "LORAFLEET_ADMIN_JWT_ALGORITHMS", value_delimiter = ',')]
    pub admin_jwt_algorithms: Vec<String>,
    /// Required `iss` of admin tokens.
    #[arg(long, env = "LORAFLEET_ADMIN_JWT_ISSUER")]
    pub admin_jwt_issuer: Option<String>,
    /// Required `aud` of admin tokens.
    #[arg(long, env = "LORAFLEET_ADMIN_JWT_AUDIENCE")]
    pub admin_jwt_audience: Option<String>,
}

/// Mutual TLS to the workers: the gateway proves itself with a certificate
/// the fleet's CA signed and checks each worker's against the same CA.
#[derive(Debug, clap::Args)]
pub struct WorkerTlsFlags {
    /// The gateway's client certificate chain (PEM).
    #[arg(long, env = "LORAFLEET_WORKER_TLS_CERT")]
    pub worker_tls_cert: Option<PathBuf>,
    /// The private key of --worker-tls-cert (PEM).
    #[arg(long, env = "LORAFLEET_WORKER_TLS_KEY")]
    pub worker_tls_key: Option<PathBuf>,
    /// The CA bundle (PEM) that workers' certificates must chain to.
    #[arg(long, env = "LORAFLEET_WORKER_TLS_CA")]
    pub worker_tls_ca: Option<PathBuf>,
    /// The name every worker's certificate must carry. Default: each
    /// worker's host as --workers names it, or the --workers-dns host (whose
    /// answers are bare addresses).
    #[arg(long, env = "LORAFLEET_WORKER_TLS_NAME")]
    pub worker_tls_name: Option<String>,
    /// Talk to workers in plain text. Only for a trusted network; required
    /// when no --worker-tls-* flags are given.
    #[arg(long, env = "LORAFLEET_INSECURE_PLAINTEXT")]
    pub insecure_plaintext: bool,
    /// How often the TLS files are checked for a change, in seconds; new
    /// connections use the new files without a restart.
    #[arg(long, env = "LORAFLEET_TLS_RELOAD_SECS", default_value_t = 10)]
    pub tls_reload_secs: u64,
}

impl WorkerTlsFlags {
    /// The transport these flags choose; files are read now, so a bad one
    /// fails at startup, naming its flag.
    fn transport(&self, discovery: &Discovery) -> anyhow::Result<Transport> {
        let files = lorafleet_tls::choose(
            self.worker_tls_cert.clone(),
            self.worker_tls_key.clone(),
            self.worker_tls_ca.clone(),
            self.insecure_plaintext,
            [
                "--worker-tls-cert",
                "--worker-tls-key",
                "--worker-tls-ca",
                "--insecure-plaintext",
            ],
        )
        .map_err(|e| anyhow::anyhow!(e))?;
        if self.tls_reload_secs == 0 {
            bail!("--tls-reload-secs: must be at least 1");
        }
        let Some(files) = files else {
            if self.worker_tls_name.is_some() {
                bail!(
                    "--worker-tls-name: needs the --worker-tls-* files, not --insecure-plaintext"
                );
            }
            tracing::warn!("talking to workers in plain text (--insecure-plaintext)");
            return Ok(Transport::Plaintext);
        };
        let server_name = match (&self.worker_tls_name, discovery) {
            (Some(name), _) => {
                lorafleet_tls::rustls::pki_types::ServerName::try_from(name.as_str())
                    .map_err(|e| anyhow::anyhow!("--worker-tls-name: {name:?}: {e}"))?;
                Some(name.clone())
            }
            (None, Discovery::Dns(name, _)) => Some(
                name.rsplit_once(':')
                    .map_or(name.as_str(), |(h, _)| h)
                    .to_owned(),
            ),
            (None, Discovery::Static(_)) => None,
        };
        let config = lorafleet_tls::Reloading::start(
            files,
            Duration::from_secs(self.tls_reload_secs),
            lorafleet_tls::client::config,
        )?;
        Ok(Transport::MutualTls {
            config,
            server_name,
        })
    }
}

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let discovery = match (&args.workers_dns, args.workers.is_empty()) {
        (Some(_), false) => bail!("--workers and --workers-dns: give one, not both"),
        (None, true) => bail!("--workers: required (or --workers-dns)"),
        (Some(name), true) => {
            if !name.contains(':') {
                bail!("--workers-dns: {name:?} must be HOST:PORT");
            }
            if args.workers_dns_refresh_secs == 0 {
                bail!("--workers-dns-refresh-secs: must be at least 1");
            }
            Discovery::Dns(
                name.clone(),
                Duration::from_secs(args.workers_dns_refresh_secs),
            )
        }
        (None, false) => {
            for w in &args.workers {
                if w.parse::<SocketAddr>().is_err() && !w.contains(':') {
                    bail!("--workers: {w:?} is not HOST:PORT");
                }
            }
            Discovery::Static(args.workers.clone())
        }
    };
    let transport = args.worker_tls.transport(&discovery)?;
    if !(args.load_factor >= 1.0 && args.load_factor.is_finite()) {
        bail!("--load-factor: {} must be at least 1.0", args.load_factor);
    }
    if !(args.replica_share >= 1.0 && args.replica_share.is_finite()) {
        bail!("--replica-share: {} must be at least 1", args.replica_share);
    }
    for (flag, v) in [
        ("--registry-refresh-secs", args.registry_refresh_secs),
        ("--request-timeout-secs", args.request_timeout_secs),
        ("--first-token-timeout-secs", args.first_token_timeout_secs),
        ("--body-timeout-secs", args.body_timeout_secs),
        ("--header-timeout-secs", args.header_timeout_secs),
        (
            "--max-concurrent-requests",
            args.max_concurrent_requests as u64,
        ),
        ("--max-body-bytes", args.max_body_bytes as u64),
        ("--max-attempts", args.max_attempts as u64),
        ("--gateway-replicas", u64::from(args.gateway_replicas)),
        (
            "--admin-statement-timeout-secs",
            args.admin_statement_timeout_secs,
        ),
        ("--registry-max-age-secs", args.registry_max_age_secs),
        ("--audit-queue-rows", args.audit_queue_rows as u64),
        ("--audit-ack-timeout-secs", args.audit_ack_timeout_secs),
        ("--audit-flush-secs", args.audit_flush_secs),
        ("--rollout-tick-ms", args.rollout_tick_ms),
        ("--rollout-lease-secs", args.rollout_lease_secs),
    ] {
        if v == 0 {
            bail!("{flag}: must be at least 1");
        }
    }
    if args.rollout_tick_ms.saturating_mul(2) > args.rollout_lease_secs.saturating_mul(1000) {
        bail!(
            "--rollout-tick-ms: {} must be at most half of --rollout-lease-secs ({} s), \
             so that the lease is renewed before it expires",
            args.rollout_tick_ms,
            args.rollout_lease_secs
        );
    }
    let per_tenant = match args.max_concurrent_per_tenant {
        Some(0) => bail!("--max-concurrent-per-tenant: must be at least 1"),
        Some(n) if n > args.max_concurrent_requests => bail!(
            "--max-concurrent-per-tenant: {n} is above --max-concurrent-requests ({})",
            args.max_concurrent_requests
        ),
        Some(n) => n,
        None => (args.max_concurrent_requests / 4).max(1),
    };
    let jwt = args.jwt.config()?;
    let a = &args.admin_jwt;
    let admin_jwt = lorafleet_gateway::auth::jwt_config(
        "--admin-jwt-",
        a.admin_jwt_hmac_secret_file.as_deref(),
        a.admin_jwt_public_key_file.as_deref(),
        &a.admin_jwt_algorithms,
        a.admin_jwt_issuer.as_deref(),
        a.admin_jwt_audience.as_deref(),
    )?;
    let admin_jwt = match (args.admin_listen, admin_jwt) {
        (Some(_), None) => bail!(
            "--admin-listen: needs an admin token key (--admin-jwt-hmac-secret-file or --admin-jwt-public-key-file)"
        ),
        (None, Some(_)) => bail!("--admin-jwt-*: set --admin-listen too, or drop the admin key"),
        (_, k) => k,
    };
    let artifact_roots = lorafleet_gateway::admin::artifact_roots(&args.artifact_root)?;
    if args.max_lora_rank == 0 {
        bail!("--max-lora-rank: must be at least 1");
    }
    if args.audit_queue_bytes < lorafleet_gateway::audit::MAX_ROW_BYTES {
        bail!(
            "--audit-queue-bytes: {} is less than one row ({} bytes)",
            args.audit_queue_bytes,
            lorafleet_gateway::audit::MAX_ROW_BYTES
        );
    }
    if args.audit_spool_max_bytes < 2 * args.audit_queue_bytes as u64 {
        bail!(
            "--audit-spool-max-bytes: {} must be at least twice --audit-queue-bytes ({}), \
             so that a full queue always fits on disk",
            args.audit_spool_max_bytes,
            args.audit_queue_bytes
        );
    }
    if args.audit_spool.is_file() {
        bail!(
            "--audit-spool: {} is a file; it must be a directory (the spool is kept in segments)",
            args.audit_spool.display()
        );
    }
    let audit_config = lorafleet_gateway::audit::AuditConfig {
        spool_dir: args.audit_spool.clone(),
        spool_owner: spool_owner(args.audit_spool_owner.as_deref())?,
        spool_max_bytes: args.audit_spool_max_bytes,
        segment_bytes: (8 << 20).min(args.audit_spool_max_bytes / 4).max(1),
        queue_rows: args.audit_queue_rows,
        queue_bytes: args.audit_queue_bytes,
        ack_timeout: Duration::from_secs(args.audit_ack_timeout_secs),
        durability: args.audit_durability,
    };
    // The request path's statements are short; a stuck one must not hold
    // a connection that audit writes and registry reloads need.
    let options = db::parse_database_url("--database-url", &args.database_url)?
        .options([("statement_timeout", "5s"), ("lock_timeout", "2s")]);
    // The audit writer's inserts in flight, plus registry reloads; kept
    // open, since an answer waits for its row's insert.
    let in_flight = lorafleet_gateway::audit::INSERTS_IN_FLIGHT as u32;
    let pool = db::connect_warm(options, in_flight, in_flight + 4, Duration::from_secs(5)).await?;
    let admin_timeout = format!("{}s", args.admin_statement_timeout_secs);
    let admin_pool = if args.admin_listen.is_some() {
        let (flag, url) = match &args.admin_database_url {
            Some(url) => ("--admin-database-url", url.as_str()),
            None => ("--database-url", args.database_url.as_str()),
        };
        let options = db::parse_database_url(flag, url)?.options([
            ("statement_timeout", admin_timeout.as_str()),
            ("lock_timeout", "5s"),
        ]);
        Some(db::connect(options, 4, Duration::from_secs(5)).await?)
    } else {
        None
    };
    let snapshot = Snapshot::load(&pool)
        .await
        .context("--database-url: reading the registry (did `lorafleet-gateway migrate` run?)")?;
    let registry = Registry::new(snapshot);
    let redis = match &args.redis_url {
        Some(url) => {
            let client = redis::Client::open(url.as_str())
                .map_err(|e| anyhow::anyhow!("--redis-url: {e}"))?;
            let config = redis::aio::ConnectionManagerConfig::new()
                .set_connection_timeout(Some(Duration::from_millis(500)))
                .set_response_timeout(Some(Duration::from_millis(500)))
                .set_number_of_retries(1);
            // Lazily: a gateway starts and serves while Redis is down.
            Some(
                redis::aio::ConnectionManager::new_lazy_with_config(client, config)
                    .map_err(|e| anyhow::anyhow!("--redis-url: {e}"))?,
            )
        }
        None => None,
    };
    registry.spawn_refresher(
        pool.clone(),
        args.redis_url.clone(),
        format!("{}registry", args.redis_prefix),
        Duration::from_secs(args.registry_refresh_secs),
    );
    let fleet = Fleet::new(
        Policy {
            load_factor: args.load_factor,
            replica_share: args.replica_share,
        },
        transport,
    );
    fleet.start(discovery);
    let (audit, audit_writer) = lorafleet_gateway::audit::start(pool.clone(), &audit_config)
        .map_err(|e| anyhow::anyhow!("--audit-spool: {e}"))?;
    let (cut_tx, cut_rx) = tokio::sync::watch::channel(false);
    let state = AppState {
        registry,
        jwt,
        fleet,
        limiter: RateLimiter::new(redis, args.redis_prefix.clone(), args.gateway_replicas),
        audit,
        permits: Arc::new(Semaphore::new(args.max_concurrent_requests)),
        tenant_slots: api::TenantSlots::new(per_tenant),
        max_body_bytes: args.max_body_bytes,
        body_timeout: Duration::from_secs(args.body_timeout_secs),
        default_rpm_limit: (args.default_rpm_limit > 0).then_some(args.default_rpm_limit),
        default_tpm_limit: (args.default_tpm_limit > 0).then_some(args.default_tpm_limit),
        request_timeout: Duration::from_secs(args.request_timeout_secs),
        max_attempts: args.max_attempts,
        first_token_timeout: Duration::from_secs(args.first_token_timeout_secs),
        registry_max_age: Duration::from_secs(args.registry_max_age_secs),
        cut: cut_rx,
    };
    let admin_addr = match (args.admin_listen, admin_jwt) {
        (Some(listen), Some(jwt)) => {
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("--admin-listen {listen}"))?;
            let addr = listener.local_addr()?;
            let admin_state = lorafleet_gateway::admin::AdminState {
                pool: admin_pool
                    .clone()
                    .expect("an admin pool with --admin-listen"),
                registry: state.registry.clone(),
                redis: state.limiter.redis(),
                channel: format!("{}registry", args.redis_prefix),
                jwt: Arc::new(jwt),
                artifact_roots,
                max_lora_rank: args.max_lora_rank,
                fleet: state.fleet.clone(),
            };
            // Every replica with an admin plane runs the rollout
            // controller; the lease lets one act at a time.
            tokio::spawn(lorafleet_gateway::rollout::run(
                admin_state.pool.clone(),
                admin_state.clone(),
                lorafleet_gateway::rollout::ControllerConfig {
                    holder: format!(
                        "{}-{}",
                        audit_config.spool_owner,
                        &uuid::Uuid::new_v4().simple().to_string()[..8]
                    ),
                    tick: Duration::from_millis(args.rollout_tick_ms),
                    lease: Duration::from_secs(args.rollout_lease_secs),
                },
            ));
            let console = lorafleet_gateway::console::router(
                admin_state.clone(),
                lorafleet_gateway::console::ConsoleOptions {
                    secure_cookie: !args.console_insecure_cookie,
                },
            );
            let admin = lorafleet_gateway::admin::router(admin_state).merge(console);
            tokio::spawn(async move {
                let _ = axum::serve(listener, admin).await;
            });
            Some(addr)
        }
        _ => None,
    };
    let permits = state.permits.clone();
    let max_permits = args.max_concurrent_requests;

    let metrics_listener = tokio::net::TcpListener::bind(args.metrics_listen)
        .await
        .with_context(|| format!("--metrics-listen {}", args.metrics_listen))?;
    let metrics_addr = metrics_listener.local_addr()?;
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets(&[
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        ])
        .context("metric buckets")?
        .install_recorder()
        .context("installing the metrics recorder")?;
    let upkeep = prometheus.clone();
    let registry_age = state.registry.clone();
    let metrics_app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let p = prometheus.clone();
            async move { p.render() }
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(metrics_listener, metrics_app).await;
    });
    // Histogram samples pile up until drained; drain them on a timer
    // rather than only when Prometheus scrapes.
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
            metrics::gauge!("lorafleet_gateway_registry_age_seconds")
                .set(registry_age.age().as_secs_f64());
        }
    });

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("--listen {}", args.listen))?;
    let addr = listener.local_addr()?;
    let app = api::router(state.clone());
    match admin_addr {
        Some(admin) => {
            println!("lorafleet-gateway listening http={addr} metrics={metrics_addr} admin={admin}")
        }
        None => println!("lorafleet-gateway listening http={addr} metrics={metrics_addr}"),
    }
    use std::io::Write;
    std::io::stdout().flush()?;
    tracing::info!(http = %addr, metrics = %metrics_addr, admin = ?admin_addr, "listening");

    let drain = Duration::from_secs(args.drain_deadline_secs);
    let (signal_tx, signal_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        wait_for_signal().await;
        let _ = signal_tx.send(true);
    });
    let stop_accepting = {
        let mut rx = signal_rx.clone();
        async move {
            let _ = rx.wait_for(|v| *v).await;
        }
    };
    let header_timeout = Duration::from_secs(args.header_timeout_secs);
    let mut server = tokio::spawn(async move {
        lorafleet_gateway::listener::serve(listener, app, header_timeout, stop_accepting).await;
        Ok::<(), std::io::Error>(())
    });
    let signal_seen = signal_rx.clone();
    let mut signalled = signal_rx;
    // Whether the server task has ended; a finished JoinHandle is never
    // polled again.
    let mut finished = false;
    tokio::select! {
        biased;
        _ = signalled.wait_for(|v| *v) => {}
        r = &mut server => {
            finished = true;
            // With no connection open, the graceful shutdown may end the
            // server before this select sees the signal.
            if !*signal_seen.borrow() {
                r.context("HTTP server")?.context("HTTP server")?;
                bail!("the HTTP server stopped on its own");
            }
        }
    }
    // SIGTERM: no new connections; open requests have the drain deadline.
    tracing::info!(deadline_secs = drain.as_secs(), "draining");
    let deadline = tokio::time::Instant::now() + drain;
    if !finished {
        finished = tokio::select! {
            _ = &mut server => true,
            _ = tokio::time::sleep_until(deadline) => false,
        };
    }
    if !finished || permits.available_permits() < max_permits {
        // Past the deadline: open requests end now, each with an error
        // event or a 503 and its `cancelled` row.
        let open = max_permits - permits.available_permits();
        tracing::warn!(open, "drain deadline passed; ending open requests");
        let _ = cut_tx.send(true);
        let settle = tokio::time::Instant::now() + CUT_SETTLE;
        while permits.available_permits() < max_permits && tokio::time::Instant::now() < settle {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if !finished && tokio::time::timeout_at(settle, &mut server).await.is_err() {
            server.abort();
        }
    }
    // The writer stops once every admitted row is placed, even if idle
    // connections still hold the state.
    state.audit.close();
    drop(state);
    let flush = Duration::from_secs(args.audit_flush_secs);
    if tokio::time::timeout(flush, audit_writer).await.is_err() {
        tracing::error!(
            flush_secs = flush.as_secs(),
            "the audit writer did not finish in time; rows no client was answered for may be lost"
        );
    }
    pool.close().await;
    tracing::info!("stopped");
    Ok(())
}

/// After the drain deadline, how long open requests get to write their
/// rows and close their connections.
const CUT_SETTLE: Duration = Duration::from_secs(5);

/// This process's directory name in the audit spool.
fn spool_owner(flag: Option<&str>) -> anyhow::Result<String> {
    let owner = match flag {
        Some(o) => o.to_owned(),
        None => std::env::var("HOSTNAME")
            .ok()
            .filter(|h| !h.is_empty())
            .or_else(|| {
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .ok()
                    .map(|h| h.trim().to_owned())
            })
            .unwrap_or_else(|| "gateway".into()),
    };
    let ok = !owner.is_empty()
        && owner.len() <= 128
        && owner
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !owner.starts_with('.');
    if !ok {
        bail!(
            "--audit-spool-owner: {owner:?} must be 1 to 128 letters, digits, '-', '_' or '.', \
             not starting with '.'"
        );
    }
    Ok(owner)
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install the SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
