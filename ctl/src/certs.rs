//! Generating a fleet CA and certificates for mutual TLS.

use lorafleet_tls::issue::{Ca, Role};

use super::*;

/// Exit code of a failure that is not the caller's (see EXIT_CODES).
const FAILURE: u8 = 1;

/// The files `certs` writes, with the side that reads each.
const FILES: [&str; 6] = [
    "ca.pem",
    "ca-key.pem",
    "worker.pem",
    "worker-key.pem",
    "gateway.pem",
    "gateway-key.pem",
];

pub(crate) fn write_certs(c: &CertsArgs, output: Output) -> Result<(), Failure> {
    if c.days == 0 {
        return Err(fail(USAGE, "--days: must be at least 1"));
    }
    for name in &c.worker_names {
        lorafleet_tls::rustls::pki_types::ServerName::try_from(name.as_str()).map_err(|e| {
            fail(
                USAGE,
                format!("--worker-name: {name:?} is not a DNS name or IP address: {e}"),
            )
        })?;
    }
    if c.gateway_name.trim().is_empty() {
        return Err(fail(USAGE, "--gateway-name: must not be empty"));
    }
    for name in FILES {
        let path = c.out.join(name);
        if path.exists() {
            return Err(fail(
                USAGE,
                format!("--out: {} exists; refusing to overwrite it", path.display()),
            ));
        }
    }
    let issue_failed =
        |e: lorafleet_tls::issue::Error| fail(FAILURE, format!("generating certificates: {e}"));
    // A name of its own, so a peer from another fleet's CA is reported as
    // an unknown issuer rather than a bad signature.
    let ca_name = format!(
        "lorafleet fleet CA {}",
        chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ")
    );
    let ca = Ca::generate(&ca_name, c.days.saturating_mul(10)).map_err(issue_failed)?;
    let worker = ca
        .issue(Role::Worker, &c.worker_names, c.days)
        .map_err(issue_failed)?;
    let gateway = ca
        .issue(Role::Gateway, std::slice::from_ref(&c.gateway_name), c.days)
        .map_err(issue_failed)?;
    std::fs::create_dir_all(&c.out)
        .map_err(|e| fail(FAILURE, format!("--out: creating {}: {e}", c.out.display())))?;
    let contents = [
        &ca.pem().cert,
        &ca.pem().key,
        &worker.cert,
        &worker.key,
        &gateway.cert,
        &gateway.key,
    ];
    for (name, text) in FILES.iter().zip(contents) {
        write_private(&c.out.join(name), text)?;
    }
    match output {
        Output::Json => println!(
            "{}",
            json!({ "dir": c.out, "files": FILES, "worker_names": c.worker_names, "days": c.days })
        ),
        Output::Table => {
            println!("wrote {} to {}", FILES.join(", "), c.out.display());
            println!(
                "workers:  --tls-cert worker.pem --tls-key worker-key.pem --tls-client-ca ca.pem"
            );
            println!(
                "gateways: --worker-tls-cert gateway.pem --worker-tls-key gateway-key.pem --worker-tls-ca ca.pem"
            );
        }
    }
    Ok(())
}

/// Writes `text` readable by its owner only (keys are secrets; the
/// certificates need not be, but one rule is simpler to check).
fn write_private(path: &Path, text: &str) -> Result<(), Failure> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options
        .open(path)
        .map_err(|e| fail(FAILURE, format!("--out: writing {}: {e}", path.display())))?;
    file.write_all(text.as_bytes())
        .map_err(|e| fail(FAILURE, format!("--out: writing {}: {e}", path.display())))
}
