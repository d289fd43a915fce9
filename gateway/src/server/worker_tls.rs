//! The flags of mutual TLS to the workers, checked into a [`WorkerTls`].

use std::path::PathBuf;
use std::time::Duration;

use crate::flag_error::{FlagError, ensure};
use crate::router::fleet::Discovery;

use super::config::{ConfigError, WorkerTls};

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
    /// The TLS files these flags choose (None: plain text) and the name
    /// workers' certificates must carry. Files are read at start.
    pub(super) fn validate(&self, discovery: &Discovery) -> Result<WorkerTls, ConfigError> {
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
        )?;
        ensure(
            self.tls_reload_secs > 0,
            "--tls-reload-secs",
            "must be at least 1",
        )?;
        let reload = Duration::from_secs(self.tls_reload_secs);
        let Some(files) = files else {
            ensure(
                self.worker_tls_name.is_none(),
                "--worker-tls-name",
                "needs the --worker-tls-* files, not --insecure-plaintext",
            )?;
            return Ok(WorkerTls {
                files: None,
                server_name: None,
                reload,
            });
        };
        let server_name = match (&self.worker_tls_name, discovery) {
            (Some(name), _) => {
                lorafleet_tls::rustls::pki_types::ServerName::try_from(name.as_str())
                    .map_err(|e| FlagError::new("--worker-tls-name", format!("{name:?}: {e}")))?;
                Some(name.clone())
            }
            (None, Discovery::Dns(name, _)) => Some(
                name.rsplit_once(':')
                    .map_or(name.as_str(), |(h, _)| h)
                    .to_owned(),
            ),
            (None, Discovery::Static(_)) => None,
        };
        Ok(WorkerTls {
            files: Some(files),
            server_name,
            reload,
        })
    }
}
