//! The three PEM files each side reads, parsed into what rustls needs.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};

use crate::TlsError;

/// A certificate chain, its private key and the CA bundle that the peer's
/// certificate must chain to, with the flag names errors are reported under.
#[derive(Debug, Clone)]
pub struct PemFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
    /// The flags these paths came from, as `["--tls-cert", "--tls-key",
    /// "--tls-client-ca"]`.
    pub flags: [&'static str; 3],
}

/// The files' contents, parsed.
#[derive(Debug)]
pub struct Loaded {
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
    pub roots: Arc<RootCertStore>,
    /// The flags, for errors raised while building a config from this.
    pub flags: [&'static str; 3],
}

/// The raw bytes of the three files, and their digest (to see a change).
#[derive(Debug)]
pub(crate) struct Raw {
    cert: Vec<u8>,
    key: Vec<u8>,
    ca: Vec<u8>,
    pub(crate) digest: [u8; 32],
}

impl PemFiles {
    pub(crate) fn read(&self) -> Result<Raw, TlsError> {
        let read = |path: &PathBuf, flag: &'static str| {
            std::fs::read(path).map_err(|source| TlsError::Read {
                flag,
                path: path.clone(),
                source,
            })
        };
        let cert = read(&self.cert, self.flags[0])?;
        let key = read(&self.key, self.flags[1])?;
        let ca = read(&self.ca, self.flags[2])?;
        let mut h = Sha256::new();
        for part in [&cert, &key, &ca] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part);
        }
        Ok(Raw {
            cert,
            key,
            ca,
            digest: h.finalize().into(),
        })
    }

    /// Reads and parses the files; an error names the flag at fault.
    pub fn load(&self) -> Result<Loaded, TlsError> {
        self.parse(&self.read()?)
    }

    pub(crate) fn parse(&self, raw: &Raw) -> Result<Loaded, TlsError> {
        let [cert_flag, key_flag, ca_flag] = self.flags;
        let chain = certificates(&raw.cert, cert_flag)?;
        let key = PrivateKeyDer::from_pem_slice(&raw.key).map_err(|e| TlsError::Pem {
            flag: key_flag,
            why: format!("no usable PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"),
        })?;
        let mut roots = RootCertStore::empty();
        for (i, ca) in certificates(&raw.ca, ca_flag)?.into_iter().enumerate() {
            roots.add(ca).map_err(|e| TlsError::Pem {
                flag: ca_flag,
                why: format!("certificate {} is not a usable CA certificate: {e}", i + 1),
            })?;
        }
        Ok(Loaded {
            chain,
            key,
            roots: Arc::new(roots),
            flags: self.flags,
        })
    }
}

fn certificates(pem: &[u8], flag: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let chain = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            flag,
            why: format!("not a PEM certificate file: {e}"),
        })?;
    if chain.is_empty() {
        return Err(TlsError::Pem {
            flag,
            why: "holds no PEM CERTIFICATE block".into(),
        });
    }
    Ok(chain)
}
