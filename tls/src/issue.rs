//! A fleet CA and its certificates, for the local fleet and tests.
//! Production issues them with cert-manager (see deploy/README.md); the
//! shapes here are the same: a CA, workers with `serverAuth` and their DNS
//! names, gateways with `clientAuth`. A certificate of one role is refused
//! in the other, so a worker's key cannot call another worker.

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};

pub use rcgen::Error;

/// Which side a certificate is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A worker: TLS server, named by its DNS names or IP addresses.
    Worker,
    /// A gateway: TLS client.
    Gateway,
}

/// A certificate and its key, PEM encoded.
#[derive(Debug, Clone)]
pub struct Pem {
    pub cert: String,
    pub key: String,
}

/// A certificate authority that can issue fleet certificates.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pem: Pem,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

impl Ca {
    /// A new self-signed CA named `common_name`, valid for `days`.
    pub fn generate(common_name: &str, days: u32) -> Result<Ca, rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = name(common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        validity(&mut params, days);
        let cert = params.self_signed(&key)?;
        let pem = Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        };
        Ok(Ca {
            issuer: Issuer::new(params, key),
            pem,
        })
    }

    /// The CA's certificate and key.
    pub fn pem(&self) -> &Pem {
        &self.pem
    }

    /// Issues a certificate for `role`, valid for `days`. A worker's `names`
    /// are its DNS names or IP addresses (at least one); a gateway's first
    /// name is its common name.
    pub fn issue(&self, role: Role, names: &[String], days: u32) -> Result<Pem, rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut params = match role {
            Role::Worker => CertificateParams::new(names.to_vec())?,
            Role::Gateway => CertificateParams::default(),
        };
        params.distinguished_name = name(names.first().map_or("lorafleet", String::as_str));
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![match role {
            Role::Worker => ExtendedKeyUsagePurpose::ServerAuth,
            Role::Gateway => ExtendedKeyUsagePurpose::ClientAuth,
        }];
        validity(&mut params, days);
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }
}

fn name(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "lorafleet");
    dn.push(DnType::CommonName, common_name);
    dn
}

fn validity(params: &mut CertificateParams, days: u32) {
    // A minute's slack for clocks that disagree a little.
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::minutes(1);
    params.not_after = now + Duration::days(i64::from(days));
}
