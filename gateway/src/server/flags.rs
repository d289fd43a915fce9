//! The flags of `lorafleet-gateway serve` (each with an environment
//! fallback), and [`ServeArgs::validate`]: every check of them, turning
//! them into a [`GatewayConfig`] or a [`FlagError`] that names the flag.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::artifact_flags::ArtifactFlags;
use crate::audit::{self, AuditConfig};
use crate::auth::{self, JwtArgs};
use crate::flag_error::{FlagError, ensure};
use crate::router::fleet::Discovery;
use crate::router::policy::Policy;
use crate::sources::{GuardConfig, SourcesConfig, TrustedProxies};

use super::config::{AdminConfig, ConfigError, GatewayConfig};
use super::worker_tls::WorkerTlsFlags;

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
    /// A worker holding the adapter in its device slots may take the
    /// request up to this × the average load (at least --load-factor):
    /// moving a request off it costs an adapter load elsewhere.
    #[arg(long, env = "LORAFLEET_RESIDENT_LOAD_FACTOR",
          default_value_t = crate::router::policy::RESIDENT_LOAD_FACTOR)]
    pub resident_load_factor: f64,
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
    /// Requests one tenant may have in flight at once (its body reads
    /// included), across the gateways through Redis, for a tenant whose
    /// registry row sets no `max_concurrent`; more get 429
    /// `tenant_concurrency_limit`. Default:
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
    /// Longest a connection may stay open with no request in flight and
    /// no bytes either way (HTTP/1 keep-alive and HTTP/2), in seconds.
    #[arg(long, env = "LORAFLEET_IDLE_TIMEOUT_SECS", default_value_t = 120)]
    pub idle_timeout_secs: u64,
    /// Seconds between HTTP/2 keep-alive pings; a ping unanswered as long
    /// drops the connection.
    #[arg(long, env = "LORAFLEET_HTTP2_KEEPALIVE_SECS", default_value_t = 30)]
    pub http2_keepalive_secs: u64,
    /// Most connections open at once on each HTTP listener (public and
    /// admin); one more is closed at once.
    #[arg(long, env = "LORAFLEET_MAX_CONNECTIONS", default_value_t = 16_384)]
    pub max_connections: usize,
    /// Most connections open at once from one source address (an IPv6
    /// source is its /64), on each HTTP listener.
    #[arg(
        long,
        env = "LORAFLEET_MAX_CONNECTIONS_PER_SOURCE",
        default_value_t = 512
    )]
    pub max_connections_per_source: usize,
    /// Longest a client may take to send its request body, in seconds;
    /// then 408 `body_timeout`.
    #[arg(long, env = "LORAFLEET_BODY_TIMEOUT_SECS", default_value_t = 30)]
    pub body_timeout_secs: u64,
    /// The proxies in front of the gateway (CIDRs or addresses,
    /// comma-separated) whose `X-Forwarded-For` is believed: the client is
    /// the nearest hop that is not one of them. Empty: the TCP peer.
    #[arg(long, env = "LORAFLEET_TRUSTED_PROXIES", value_delimiter = ',')]
    pub trusted_proxies: Vec<String>,
    /// Failed authentications one client address may make in a burst;
    /// past them its requests get 429 `too_many_failed_authentications`.
    #[arg(long, env = "LORAFLEET_FAILED_AUTH_BURST", default_value_t = 20)]
    pub failed_auth_burst: u32,
    /// Failed authentications per minute a client address gets back.
    #[arg(long, env = "LORAFLEET_FAILED_AUTH_PER_MINUTE", default_value_t = 10)]
    pub failed_auth_per_minute: u32,
    /// Seconds one audit row of a source's failed authentications covers.
    #[arg(long, env = "LORAFLEET_FAILED_AUTH_WINDOW_SECS", default_value_t = 60)]
    pub failed_auth_window_secs: u32,
    /// Client addresses the failed-authentication limit remembers at once;
    /// past them new addresses share one bucket.
    #[arg(
        long,
        env = "LORAFLEET_FAILED_AUTH_MAX_SOURCES",
        default_value_t = 100_000
    )]
    pub failed_auth_max_sources: usize,
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
    /// Tenants whose request metrics (requests, latency, time to first
    /// token, residency checks) have series of their own, by tenant and
    /// adapter: the ones with the most recent device time. Every other
    /// tenant counts as `tenant="other"`; 0 names none.
    #[arg(long, env = "LORAFLEET_TENANT_SERIES", default_value_t = 50)]
    pub tenant_series: usize,
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
    pub audit_durability: crate::audit::Durability,
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
    /// Days of audit rows kept: the gateway holding the partition lease
    /// drops each day's partition once it is this old, as an audited change
    /// (needs the admin plane). Unset keeps every row. The database
    /// refuses fewer days than its floor (`audit_retention_floor`).
    #[arg(long, env = "LORAFLEET_AUDIT_RETENTION_DAYS")]
    pub audit_retention_days: Option<u32>,
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
    /// Serve the admin plane alone: the admin API and console, the rollout
    /// controller, the audit partition maintainer and metrics, with no
    /// public OpenAI listener (`--listen` is not bound). Run it as its own
    /// deployment holding the `lorafleet_admin` login, so that the public
    /// gateway's pods hold no admin credentials. Needs `--admin-listen`.
    #[arg(long, env = "LORAFLEET_ADMIN_ONLY")]
    pub admin_only: bool,
    /// Let the admin console's session cookie travel over plain HTTP to a
    /// host other than localhost. By default it is `Secure`: browsers keep
    /// it only over HTTPS (or on `http://localhost`).
    #[arg(long, env = "LORAFLEET_CONSOLE_INSECURE_COOKIE")]
    pub console_insecure_cookie: bool,
    #[command(flatten)]
    pub admin_jwt: AdminJwtArgs,
    #[command(flatten)]
    pub artifacts: ArtifactFlags,
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
    /// The longest lifetime an admin token may have (its `exp` less its
    /// `iat`), in seconds: a revocation is kept that long at most.
    #[arg(
        long,
        env = "LORAFLEET_ADMIN_JWT_MAX_TTL_SECS",
        default_value_t = 86_400
    )]
    pub admin_jwt_max_ttl_secs: u64,
}

impl ServeArgs {
    /// Every check of the flags, in the order an operator reads them; the
    /// first refusal names its flag. Reads only the key files the flags
    /// name (JWT keys, artifact roots); connects to nothing.
    pub fn validate(&self) -> Result<GatewayConfig, ConfigError> {
        let discovery = self.discovery()?;
        let worker_tls = self.worker_tls.validate(&discovery)?;
        self.check_limits()?;
        let per_tenant = self.per_tenant()?;
        let jwt = self.jwt.config()?;
        let admin = self.admin_key()?;
        let (artifact_roots, artifact_stores) = self.artifacts.validate()?;
        ensure(
            self.max_lora_rank > 0,
            "--max-lora-rank",
            "must be at least 1",
        )?;
        let admin = admin.map(|(listen, jwt)| AdminConfig {
            listen,
            jwt: Arc::new(jwt),
            artifact_roots,
            artifact_stores,
            max_lora_rank: self.max_lora_rank,
            secure_cookie: !self.console_insecure_cookie,
        });
        let audit = self.audit_config()?;
        let sources = self.sources()?;
        ensure(
            !self.admin_only || admin.is_some(),
            "--admin-only",
            "needs the admin plane (--admin-listen and an admin token key)",
        )?;
        if let Some(days) = self.audit_retention_days {
            ensure(
                days > 0,
                "--audit-retention-days",
                "must be at least 1 (leave it unset to keep every row)",
            )?;
            ensure(
                admin.is_some(),
                "--audit-retention-days",
                "needs the admin plane (--admin-listen): retention runs as its role",
            )?;
        }
        // The admin pool's URL, checked now so a bad one is named.
        crate::db::parse_database_url("--database-url", &self.database_url)
            .map_err(|e| FlagError::new("--database-url", flag_reason(&e.to_string())))?;
        if let Some(url) = &self.admin_database_url {
            crate::db::parse_database_url("--admin-database-url", url)
                .map_err(|e| FlagError::new("--admin-database-url", flag_reason(&e.to_string())))?;
        }
        Ok(GatewayConfig {
            database_url: self.database_url.clone(),
            admin_database_url: self.admin_database_url.clone(),
            redis_url: self.redis_url.clone(),
            redis_prefix: self.redis_prefix.clone(),
            listen: (!self.admin_only).then_some(self.listen),
            metrics_listen: self.metrics_listen,
            discovery,
            worker_tls,
            policy: Policy {
                load_factor: self.load_factor,
                resident_load_factor: self.resident_load_factor,
            },
            registry_refresh: Duration::from_secs(self.registry_refresh_secs),
            max_concurrent_requests: self.max_concurrent_requests,
            max_concurrent_per_tenant: per_tenant,
            default_rpm_limit: (self.default_rpm_limit > 0).then_some(self.default_rpm_limit),
            default_tpm_limit: (self.default_tpm_limit > 0).then_some(self.default_tpm_limit),
            header_timeout: Duration::from_secs(self.header_timeout_secs),
            connections: crate::listener::ConnectionLimits {
                header_timeout: Duration::from_secs(self.header_timeout_secs),
                idle_timeout: Duration::from_secs(self.idle_timeout_secs),
                http2_keepalive: Duration::from_secs(self.http2_keepalive_secs),
                max_connections: self.max_connections,
                max_connections_per_source: self.max_connections_per_source,
            },
            body_timeout: Duration::from_secs(self.body_timeout_secs),
            max_body_bytes: self.max_body_bytes,
            request_timeout: Duration::from_secs(self.request_timeout_secs),
            first_token_timeout: Duration::from_secs(self.first_token_timeout_secs),
            max_attempts: self.max_attempts,
            tenant_series: self.tenant_series,
            gateway_replicas: self.gateway_replicas,
            admin_statement_timeout: Duration::from_secs(self.admin_statement_timeout_secs),
            registry_max_age: Duration::from_secs(self.registry_max_age_secs),
            audit,
            sources,
            audit_flush: Duration::from_secs(self.audit_flush_secs),
            audit_retention_days: self.audit_retention_days,
            rollout_tick: Duration::from_millis(self.rollout_tick_ms),
            rollout_lease: Duration::from_secs(self.rollout_lease_secs),
            drain_deadline: Duration::from_secs(self.drain_deadline_secs),
            jwt,
            admin,
        })
    }

    /// The numeric flags: each at least 1, and the rollout tick at most
    /// half the lease.
    fn check_limits(&self) -> Result<(), FlagError> {
        ensure(
            self.load_factor >= 1.0 && self.load_factor.is_finite(),
            "--load-factor",
            format!("{} must be at least 1.0", self.load_factor),
        )?;
        ensure(
            self.resident_load_factor >= self.load_factor && self.resident_load_factor.is_finite(),
            "--resident-load-factor",
            format!(
                "{} must be at least --load-factor ({})",
                self.resident_load_factor, self.load_factor
            ),
        )?;
        for (flag, v) in [
            ("--registry-refresh-secs", self.registry_refresh_secs),
            ("--request-timeout-secs", self.request_timeout_secs),
            ("--first-token-timeout-secs", self.first_token_timeout_secs),
            ("--body-timeout-secs", self.body_timeout_secs),
            ("--header-timeout-secs", self.header_timeout_secs),
            ("--idle-timeout-secs", self.idle_timeout_secs),
            ("--http2-keepalive-secs", self.http2_keepalive_secs),
            ("--max-connections", self.max_connections as u64),
            (
                "--max-connections-per-source",
                self.max_connections_per_source as u64,
            ),
            (
                "--max-concurrent-requests",
                self.max_concurrent_requests as u64,
            ),
            ("--max-body-bytes", self.max_body_bytes as u64),
            ("--max-attempts", self.max_attempts as u64),
            ("--gateway-replicas", u64::from(self.gateway_replicas)),
            (
                "--admin-statement-timeout-secs",
                self.admin_statement_timeout_secs,
            ),
            ("--registry-max-age-secs", self.registry_max_age_secs),
            ("--audit-queue-rows", self.audit_queue_rows as u64),
            ("--audit-ack-timeout-secs", self.audit_ack_timeout_secs),
            ("--audit-flush-secs", self.audit_flush_secs),
            ("--rollout-tick-ms", self.rollout_tick_ms),
            ("--rollout-lease-secs", self.rollout_lease_secs),
        ] {
            ensure(v > 0, flag, "must be at least 1")?;
        }
        ensure(
            self.rollout_tick_ms.saturating_mul(2) <= self.rollout_lease_secs.saturating_mul(1000),
            "--rollout-tick-ms",
            format!(
                "{} must be at most half of --rollout-lease-secs ({} s), so that the lease is \
                 renewed before it expires",
                self.rollout_tick_ms, self.rollout_lease_secs
            ),
        )?;
        Ok(())
    }

    /// One tenant's concurrency in this gateway: a quarter of the global
    /// cap by default, so no tenant can take them all.
    fn per_tenant(&self) -> Result<usize, FlagError> {
        Ok(match self.max_concurrent_per_tenant {
            Some(0) => {
                return Err(FlagError::new(
                    "--max-concurrent-per-tenant",
                    "must be at least 1",
                ));
            }
            Some(n) if n > self.max_concurrent_requests => {
                return Err(FlagError::new(
                    "--max-concurrent-per-tenant",
                    format!(
                        "{n} is above --max-concurrent-requests ({})",
                        self.max_concurrent_requests
                    ),
                ));
            }
            Some(n) => n,
            None => (self.max_concurrent_requests / 4).max(1),
        })
    }

    /// The client address and the failed-authentication limit.
    fn sources(&self) -> Result<SourcesConfig, FlagError> {
        let trusted_proxies = TrustedProxies::parse(&self.trusted_proxies)?;
        for (flag, v) in [
            ("--failed-auth-burst", u64::from(self.failed_auth_burst)),
            (
                "--failed-auth-per-minute",
                u64::from(self.failed_auth_per_minute),
            ),
            (
                "--failed-auth-window-secs",
                u64::from(self.failed_auth_window_secs),
            ),
            (
                "--failed-auth-max-sources",
                self.failed_auth_max_sources as u64,
            ),
        ] {
            ensure(v > 0, flag, "must be at least 1")?;
        }
        ensure(
            self.failed_auth_window_secs <= 3600,
            "--failed-auth-window-secs",
            format!("{} is more than an hour", self.failed_auth_window_secs),
        )?;
        Ok(SourcesConfig {
            trusted_proxies,
            guard: GuardConfig {
                burst: self.failed_auth_burst,
                per_minute: self.failed_auth_per_minute,
                max_sources: self.failed_auth_max_sources,
            },
            window_secs: self.failed_auth_window_secs,
        })
    }

    /// The audit log's settings.
    fn audit_config(&self) -> Result<AuditConfig, FlagError> {
        ensure(
            self.audit_queue_bytes >= audit::MAX_ROW_BYTES,
            "--audit-queue-bytes",
            format!(
                "{} is less than one row ({} bytes)",
                self.audit_queue_bytes,
                audit::MAX_ROW_BYTES
            ),
        )?;
        ensure(
            self.audit_spool_max_bytes >= 2 * self.audit_queue_bytes as u64,
            "--audit-spool-max-bytes",
            format!(
                "{} must be at least twice --audit-queue-bytes ({}), so that a full queue \
                 always fits on disk",
                self.audit_spool_max_bytes, self.audit_queue_bytes
            ),
        )?;
        ensure(
            !self.audit_spool.is_file(),
            "--audit-spool",
            format!(
                "{} is a file; it must be a directory (the spool is kept in segments)",
                self.audit_spool.display()
            ),
        )?;
        Ok(AuditConfig {
            spool_dir: self.audit_spool.clone(),
            spool_owner: spool_owner(self.audit_spool_owner.as_deref())?,
            spool_max_bytes: self.audit_spool_max_bytes,
            segment_bytes: (8 << 20).min(self.audit_spool_max_bytes / 4).max(1),
            queue_rows: self.audit_queue_rows,
            queue_bytes: self.audit_queue_bytes,
            ack_timeout: Duration::from_secs(self.audit_ack_timeout_secs),
            durability: self.audit_durability,
        })
    }

    fn discovery(&self) -> Result<Discovery, FlagError> {
        match (&self.workers_dns, self.workers.is_empty()) {
            (Some(_), false) => Err(FlagError::new(
                "--workers and --workers-dns",
                "give one, not both",
            )),
            (None, true) => Err(FlagError::new("--workers", "required (or --workers-dns)")),
            (Some(name), true) => {
                ensure(
                    name.contains(':'),
                    "--workers-dns",
                    format!("{name:?} must be HOST:PORT"),
                )?;
                ensure(
                    self.workers_dns_refresh_secs > 0,
                    "--workers-dns-refresh-secs",
                    "must be at least 1",
                )?;
                Ok(Discovery::Dns(
                    name.clone(),
                    Duration::from_secs(self.workers_dns_refresh_secs),
                ))
            }
            (None, false) => {
                for w in &self.workers {
                    ensure(
                        w.parse::<SocketAddr>().is_ok() || w.contains(':'),
                        "--workers",
                        format!("{w:?} is not HOST:PORT"),
                    )?;
                }
                Ok(Discovery::Static(self.workers.clone()))
            }
        }
    }

    /// The admin plane's address and token key, when `--admin-listen`
    /// asks for it.
    fn admin_key(&self) -> Result<Option<(SocketAddr, auth::JwtConfig)>, FlagError> {
        let a = &self.admin_jwt;
        let jwt = auth::jwt_config(
            "--admin-jwt-",
            a.admin_jwt_hmac_secret_file.as_deref(),
            a.admin_jwt_public_key_file.as_deref(),
            &a.admin_jwt_algorithms,
            a.admin_jwt_issuer.as_deref(),
            a.admin_jwt_audience.as_deref(),
        )?;
        let (listen, jwt) = match (self.admin_listen, jwt) {
            (Some(_), None) => {
                return Err(FlagError::new(
                    "--admin-listen",
                    "needs an admin token key (--admin-jwt-hmac-secret-file or \
                     --admin-jwt-public-key-file)",
                ));
            }
            (None, Some(_)) => {
                return Err(FlagError::new(
                    "--admin-jwt-*",
                    "set --admin-listen too, or drop the admin key",
                ));
            }
            (None, None) => return Ok(None),
            (Some(listen), Some(jwt)) => (listen, jwt),
        };
        ensure(
            a.admin_jwt_max_ttl_secs > 0,
            "--admin-jwt-max-ttl-secs",
            "must be at least 1",
        )?;
        Ok(Some((listen, jwt.with_max_ttl(a.admin_jwt_max_ttl_secs))))
    }
}

/// The reason part of a "FLAG: reason" message.
fn flag_reason(message: &str) -> String {
    message
        .split_once(": ")
        .map_or(message, |(_, r)| r)
        .to_owned()
}

/// This process's directory name in the audit spool.
fn spool_owner(flag: Option<&str>) -> Result<String, FlagError> {
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
    ensure(
        ok,
        "--audit-spool-owner",
        format!(
            "{owner:?} must be 1 to 128 letters, digits, '-', '_' or '.', not starting with '.'"
        ),
    )?;
    Ok(owner)
}

#[cfg(test)]
#[path = "flags_tests.rs"]
mod tests;
