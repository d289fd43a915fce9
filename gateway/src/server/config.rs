//! A gateway's checked settings: what [`super::ServeArgs::validate`] makes
//! of the flags, and what [`super::start`] starts from.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use lorafleet_artifact::roots::ArtifactRoots;

use crate::audit::AuditConfig;
use crate::auth::JwtConfig;
use crate::flag_error::FlagError;
use crate::router::fleet::Discovery;
use crate::router::policy::Policy;

/// Why the flags cannot start a gateway: the flag, and why.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Flag(#[from] FlagError),
    /// The worker TLS flags (their choice; the files are read at start).
    #[error(transparent)]
    Tls(#[from] lorafleet_tls::TlsError),
}

/// Mutual TLS to the workers, or plain text (`files` None).
#[derive(Debug, Clone)]
pub struct WorkerTls {
    pub files: Option<lorafleet_tls::PemFiles>,
    /// The name every worker's certificate must carry (None: each worker's
    /// own host).
    pub server_name: Option<String>,
    /// How often the files are checked for a change.
    pub reload: Duration,
}

/// The admin plane and console (`--admin-listen`).
#[derive(Clone)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    pub jwt: Arc<JwtConfig>,
    pub artifact_roots: Option<Arc<ArtifactRoots>>,
    /// The object stores `s3://` artifacts may be registered from.
    pub artifact_stores: lorafleet_store::ObjectStores,
    pub max_lora_rank: usize,
    /// The console's session cookie is `Secure`.
    pub secure_cookie: bool,
}

/// Every setting of a gateway, checked.
#[derive(Clone)]
pub struct GatewayConfig {
    pub database_url: String,
    /// The admin plane's own pool; `database_url` when None.
    pub admin_database_url: Option<String>,
    pub redis_url: Option<String>,
    pub redis_prefix: String,
    /// The public OpenAI API's address; None for an admin plane served
    /// alone (`--admin-only`).
    pub listen: Option<SocketAddr>,
    pub metrics_listen: SocketAddr,
    pub discovery: Discovery,
    pub worker_tls: WorkerTls,
    pub policy: Policy,
    pub registry_refresh: Duration,
    pub max_concurrent_requests: usize,
    pub max_concurrent_per_tenant: usize,
    pub default_rpm_limit: Option<u32>,
    pub default_tpm_limit: Option<u64>,
    pub header_timeout: Duration,
    /// Every HTTP listener's deadlines and caps.
    pub connections: crate::listener::ConnectionLimits,
    pub body_timeout: Duration,
    pub max_body_bytes: usize,
    pub request_timeout: Duration,
    pub first_token_timeout: Duration,
    pub max_attempts: usize,
    /// Tenants whose request metrics have series of their own.
    pub tenant_series: usize,
    pub gateway_replicas: u32,
    pub admin_statement_timeout: Duration,
    pub registry_max_age: Duration,
    pub audit: AuditConfig,
    /// The client address and the failed-authentication limit.
    pub sources: crate::sources::SourcesConfig,
    /// On shutdown, how long the audit queue may take to be placed.
    pub audit_flush: Duration,
    /// `--audit-retention-days`: None keeps every row.
    pub audit_retention_days: Option<u32>,
    pub rollout_tick: Duration,
    pub rollout_lease: Duration,
    /// On SIGTERM, how long running requests may take to finish.
    pub drain_deadline: Duration,
    /// Tenants' JWTs, when a key is configured.
    pub jwt: Option<JwtConfig>,
    pub admin: Option<AdminConfig>,
}

// By hand: the database URLs may hold a password and the JWT keys are
// secrets; neither belongs in a log line.
impl std::fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminConfig")
            .field("listen", &self.listen)
            .field("artifact_roots", &self.artifact_roots)
            .field("max_lora_rank", &self.max_lora_rank)
            .field("secure_cookie", &self.secure_cookie)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for GatewayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayConfig")
            .field("listen", &self.listen)
            .field("metrics_listen", &self.metrics_listen)
            .field("discovery", &self.discovery)
            .field("worker_tls", &self.worker_tls)
            .field("policy", &self.policy)
            .field("max_concurrent_requests", &self.max_concurrent_requests)
            .field("max_concurrent_per_tenant", &self.max_concurrent_per_tenant)
            .field("audit", &self.audit)
            .field("drain_deadline", &self.drain_deadline)
            .field("admin", &self.admin)
            .finish_non_exhaustive()
    }
}
