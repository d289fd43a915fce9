//! Mutual TLS between the fleet's gateways and its workers.
//!
//! A worker holds every tenant's adapters, so only the fleet's gateways may
//! call it: each side presents a certificate signed by the fleet's CA and
//! verifies the other's against it.
//!
//! - [`PemFiles`] names the three files each side reads (its certificate
//!   chain, its private key, the CA bundle), as Kubernetes Secrets and
//!   cert-manager provide them.
//! - [`Reloading`] rebuilds a rustls config whenever those files change, so
//!   rotation needs no restart. A broken update keeps the last good config.
//! - [`server`] is the worker's side: a config that requires a client
//!   certificate, and a stream of handshaken connections for tonic.
//! - [`client`] is the gateway's side: a config with its client certificate,
//!   and a connector that verifies each worker's name.
//! - [`issue`] generates a fleet CA and certificates, for the local fleet and
//!   tests (production uses cert-manager).

pub mod client;
pub mod issue;
mod pem;
mod reload;
pub mod server;

use std::path::PathBuf;
use std::sync::Arc;

pub use pem::{Loaded, PemFiles};
pub use reload::Reloading;
pub use rustls;

/// Why TLS material could not be used. Each names the flag whose file is at
/// fault, so a misconfigured Secret reads as one line.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{flag}: cannot read {}: {source}", path.display())]
    Read {
        flag: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{flag}: {why}")]
    Pem { flag: &'static str, why: String },
    #[error("{flag}: {why}")]
    Config { flag: &'static str, why: String },
    /// Neither the TLS files nor plain text was chosen.
    #[error("{cert}, {key} and {ca} are required for mutual TLS (or {plain} to go without it)")]
    NoChoice {
        cert: &'static str,
        key: &'static str,
        ca: &'static str,
        plain: &'static str,
    },
    /// Plain text and a TLS file were both given.
    #[error("{plain}: cannot be combined with {given}")]
    BothChosen {
        plain: &'static str,
        given: &'static str,
    },
    /// A name a peer's certificate must carry is neither a DNS name nor an
    /// IP address.
    #[error("{name:?} is not a DNS name or IP address: {why}")]
    ServerName { name: String, why: String },
    /// Some of the TLS files are missing.
    #[error("{missing}: required with the other TLS flags")]
    Incomplete { missing: String },
}

/// The one crypto provider both sides use (ring: no C toolchain beyond cc).
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Metric names, shared by both processes.
pub mod metric {
    /// Counter, label `result` = `ok` | `error`: certificate reloads.
    pub const RELOADS: &str = "lorafleet_tls_reloads_total";
    /// Counter: incoming handshakes that failed or timed out (worker).
    pub const HANDSHAKE_FAILURES: &str = "lorafleet_tls_handshake_failures_total";
}

/// The files from a side's TLS flags, or None for `--insecure-plaintext`.
/// Exactly one of the two must be given, so plain text is always a choice
/// someone wrote down. `names` are the flags for the certificate, the key,
/// the CA bundle and plain text, in that order; an error names them.
pub fn choose(
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    ca: Option<PathBuf>,
    insecure_plaintext: bool,
    names: [&'static str; 4],
) -> Result<Option<PemFiles>, TlsError> {
    let [cert_flag, key_flag, ca_flag, plain_flag] = names;
    match (cert, key, ca, insecure_plaintext) {
        (None, None, None, true) => Ok(None),
        (Some(cert), Some(key), Some(ca), false) => Ok(Some(PemFiles {
            cert,
            key,
            ca,
            flags: [cert_flag, key_flag, ca_flag],
        })),
        (None, None, None, false) => Err(TlsError::NoChoice {
            cert: cert_flag,
            key: key_flag,
            ca: ca_flag,
            plain: plain_flag,
        }),
        (cert, key, ca, true) => {
            let given = [(cert, cert_flag), (key, key_flag), (ca, ca_flag)]
                .into_iter()
                .find_map(|(p, f)| p.map(|_| f))
                .unwrap_or(cert_flag);
            Err(TlsError::BothChosen {
                plain: plain_flag,
                given,
            })
        }
        (cert, key, ca, false) => {
            let missing = [
                (cert.is_none(), cert_flag),
                (key.is_none(), key_flag),
                (ca.is_none(), ca_flag),
            ]
            .into_iter()
            .filter_map(|(m, f)| m.then_some(f))
            .collect::<Vec<_>>()
            .join(", ");
            Err(TlsError::Incomplete { missing })
        }
    }
}
