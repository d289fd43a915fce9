//! Mutual TLS between gateways and workers, with the real binaries: a
//! worker refuses every client that is not one of the fleet's gateways, and
//! both sides pick up rotated certificate files without a restart.

use std::path::Path;
use std::time::{Duration, Instant};

use lorafleet_proto::worker::v1 as pb;
use lorafleet_tests::{
    Server, assert_refused, certs, engine_fixtures, fixture_worker_from, gateway_command_with,
    migrated_db, worker_channel, worker_channel_config, worker_channel_with, worker_command,
    worker_command_with, write_fleet_certs,
};
use lorafleet_tls::rustls;
use pb::worker_client::WorkerClient;

fn fixture(cmd: std::process::Command, extra: &[&str]) -> Server {
    fixture_worker_from(cmd, "w0", extra)
}

/// Whether an `Info` call over `channel` succeeds. A refused client may see
/// the refusal at connect or at its first call (TLS 1.3 sends the server's
/// verdict on the client certificate after the client's handshake ends).
async fn info_ok(channel: Result<tonic::transport::Channel, String>) -> Result<(), String> {
    let channel = channel?;
    WorkerClient::new(channel)
        .info(pb::InfoRequest {})
        .await
        .map(|_| ())
        .map_err(|s| s.to_string())
}

/// The value of one counter on a `/metrics` page (0 when absent).
fn counter(metrics_addr: &str, name: &str) -> f64 {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(metrics_addr).unwrap();
    conn.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    conn.read_to_string(&mut body).unwrap();
    body.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn copy_certs(from: &Path, to: &Path, names: &[&str]) {
    std::fs::create_dir_all(to).unwrap();
    for name in names {
        // Written aside and renamed, as a Secret volume swaps its files.
        let tmp = to.join(format!(".{name}.tmp"));
        std::fs::copy(from.join(name), &tmp).unwrap();
        std::fs::rename(&tmp, to.join(name)).unwrap();
    }
}

async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn a_worker_accepts_the_fleets_gateways_only() {
    let worker = fixture(worker_command(), &[]);
    let addr = worker.addr("grpc");
    let c = certs();

    // The gateway's certificate from the fleet's CA: accepted.
    info_ok(worker_channel(addr).await)
        .await
        .expect("the gateway's certificate is accepted");

    // Plain text: refused.
    let plain = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .map_err(|e| e.to_string());
    assert!(
        info_ok(plain).await.is_err(),
        "a plain-text client is refused"
    );

    // TLS that trusts the worker but presents no certificate: refused.
    let roots = lorafleet_tls::PemFiles {
        cert: c.path("gateway.pem"),
        key: c.path("gateway-key.pem"),
        ca: c.path("ca.pem"),
        flags: ["cert", "key", "ca"],
    }
    .load()
    .unwrap()
    .roots;
    let mut anonymous = rustls::ClientConfig::builder_with_provider(lorafleet_tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    anonymous.alpn_protocols = vec![b"h2".to_vec()];
    let err = info_ok(worker_channel_config(addr, anonymous).await)
        .await
        .expect_err("a client without a certificate is refused");
    assert!(!err.is_empty());

    // A certificate from another CA (the client still trusts this worker):
    // refused.
    let other = tempfile::tempdir().unwrap();
    write_fleet_certs(other.path(), "another CA");
    let err = info_ok(
        worker_channel_with(
            addr,
            &other.path().join("gateway.pem"),
            &other.path().join("gateway-key.pem"),
            &c.path("ca.pem"),
        )
        .await,
    )
    .await
    .expect_err("a certificate from another CA is refused");
    assert!(!err.is_empty());

    // The fleet's CA, but a worker's certificate (serverAuth only): refused,
    // so a worker's key cannot call another worker.
    info_ok(
        worker_channel_with(
            addr,
            &c.path("worker.pem"),
            &c.path("worker-key.pem"),
            &c.path("ca.pem"),
        )
        .await,
    )
    .await
    .expect_err("a worker's certificate is not a client certificate");

    // Each refusal is counted and logged with its reason; none reached the
    // worker service.
    let refused = counter(
        worker.addr("metrics"),
        "lorafleet_tls_handshake_failures_total",
    );
    assert!(refused >= 4.0, "4 refusals counted, got {refused}");
    let log = worker.log_text();
    assert!(log.contains("TLS handshake refused"), "{log}");
    // And the gateway is still welcome afterwards.
    info_ok(worker_channel(addr).await).await.unwrap();
}

#[tokio::test]
async fn rotated_files_apply_to_new_connections_without_a_restart() {
    let c = certs();
    const WORKER_FILES: [&str; 3] = ["worker.pem", "worker-key.pem", "ca.pem"];
    const GATEWAY_FILES: [&str; 3] = ["gateway.pem", "gateway-key.pem", "ca.pem"];
    // Both sides start on the first CA's files.
    let worker_dir = tempfile::tempdir().unwrap();
    copy_certs(&c.dir, worker_dir.path(), &WORKER_FILES);
    let worker = fixture(
        worker_command_with(worker_dir.path()),
        &["--tls-reload-secs", "1"],
    );
    let addr = worker.addr("grpc").to_owned();
    let old = worker_channel(&addr)
        .await
        .expect("connect before rotation");
    info_ok(Ok(old.clone())).await.unwrap();

    // The gateway starts with another CA's files: it cannot verify the
    // worker (nor the worker it), so it has no worker up.
    let rotated = tempfile::tempdir().unwrap();
    write_fleet_certs(rotated.path(), "rotated CA");
    let db = migrated_db("mtls_rotation").await;
    let gateway_dir = tempfile::tempdir().unwrap();
    copy_certs(rotated.path(), gateway_dir.path(), &GATEWAY_FILES);
    let mut cmd = gateway_command_with(gateway_dir.path());
    cmd.args(["--database-url", &db.url()])
        .args(["--workers", &addr])
        .args(["--tls-reload-secs", "1"])
        .arg("--audit-spool")
        .arg(worker_dir.path().join("spool"));
    let gateway = Server::start(cmd, "lorafleet-gateway listening ");
    let http = reqwest::Client::new();
    let readyz = format!("http://{}/readyz", gateway.addr("http"));
    let ready = async || {
        http.get(&readyz)
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!ready().await, "no worker is up with the wrong CA");
    // The reason is in the gateway's log, once, not a silent retry loop.
    let log = gateway.log_text();
    assert!(log.contains("cannot reach the worker"), "{log}");
    // The right files arrive: the gateway's next connection uses them.
    copy_certs(&c.dir, gateway_dir.path(), &GATEWAY_FILES);
    eventually(
        "the gateway reaches the worker after its files changed",
        ready,
    )
    .await;
    assert!(gateway.log_text().contains("TLS certificates reloaded"));

    // The worker moves to the new CA: its certificate, and the CA its
    // clients must chain to.
    copy_certs(rotated.path(), worker_dir.path(), &WORKER_FILES);
    let new_client = async || {
        info_ok(
            worker_channel_with(
                &addr,
                &rotated.path().join("gateway.pem"),
                &rotated.path().join("gateway-key.pem"),
                &rotated.path().join("ca.pem"),
            )
            .await,
        )
        .await
        .is_ok()
    };
    eventually("a client of the new CA is accepted", new_client).await;
    // A new connection with the old files fails both ways round: the old CA
    // cannot verify the worker's new certificate, and the worker no longer
    // trusts the old client certificate.
    assert!(info_ok(worker_channel(&addr).await).await.is_err());
    // The connection opened before the rotation keeps working.
    info_ok(Ok(old))
        .await
        .expect("open connections keep their session");
    assert!(worker.log_text().contains("TLS certificates reloaded"));

    // A broken update (a key that does not fit the certificate) is refused
    // and the last good files stay in use.
    std::fs::copy(
        c.path("worker-key.pem"),
        worker_dir.path().join("worker-key.pem"),
    )
    .unwrap();
    eventually("the broken update is reported", async || {
        worker.log_text().contains("new TLS files refused")
    })
    .await;
    assert!(new_client().await, "the last good files still serve");
    assert!(
        counter(
            worker.addr("metrics"),
            "lorafleet_tls_reloads_total{result=\"error\"}"
        ) >= 1.0
    );
}

#[test]
fn tls_flags_are_refused_by_name() {
    let c = certs();
    let cert = c.path("worker.pem");
    let key = c.path("worker-key.pem");
    let ca = c.path("ca.pem");
    let not_pem = engine_fixtures().join("llama-gqa/config.json");
    let (cert, key, ca, not_pem) = (
        cert.to_str().unwrap(),
        key.to_str().unwrap(),
        ca.to_str().unwrap(),
        not_pem.to_str().unwrap(),
    );
    let fixtures = engine_fixtures();
    let model = fixtures.join("llama-gqa");
    let worker_cases: &[(&[&str], &str)] = &[
        (
            &[],
            "--tls-cert, --tls-key and --tls-client-ca are required for mutual TLS (or --insecure-plaintext",
        ),
        (
            &["--insecure-plaintext", "--tls-cert", cert],
            "--insecure-plaintext: cannot be combined with --tls-cert",
        ),
        (
            &["--tls-cert", cert, "--tls-key", key],
            "--tls-client-ca: required with the other TLS flags",
        ),
        (
            &[
                "--tls-cert",
                cert,
                "--tls-key",
                "/no/such/key.pem",
                "--tls-client-ca",
                ca,
            ],
            "--tls-key: cannot read /no/such/key.pem",
        ),
        (
            &[
                "--tls-cert",
                not_pem,
                "--tls-key",
                key,
                "--tls-client-ca",
                ca,
            ],
            "--tls-cert: holds no PEM CERTIFICATE block",
        ),
        (
            // The CA's own key does not fit the worker's certificate.
            &[
                "--tls-cert",
                cert,
                "--tls-key",
                &format!("{}/ca-key.pem", c.dir.display()),
                "--tls-client-ca",
                ca,
            ],
            "--tls-key: does not fit the certificate",
        ),
        (
            &[
                "--tls-cert",
                cert,
                "--tls-key",
                key,
                "--tls-client-ca",
                ca,
                "--tls-reload-secs",
                "0",
            ],
            "--tls-reload-secs: must be at least 1",
        ),
    ];
    for (flags, expected) in worker_cases {
        let mut cmd = std::process::Command::new(lorafleet_tests::binary("lorafleet-worker"));
        cmd.args(["serve", "--worker-id", "w", "--grpc-listen", "127.0.0.1:0"])
            .args(["--metrics-listen", "127.0.0.1:0"])
            .args(["--health-listen", "127.0.0.1:0"])
            .arg("--model")
            .arg(&model)
            .arg("--artifact-root")
            .arg(fixtures.join("adapters"))
            .env_remove("LORAFLEET_INSECURE_PLAINTEXT");
        assert_refused(cmd, flags, expected);
    }
    let gateway_cases: &[(&[&str], &str)] = &[
        (
            &[],
            "--worker-tls-cert, --worker-tls-key and --worker-tls-ca are required for mutual TLS (or --insecure-plaintext",
        ),
        (
            &["--insecure-plaintext", "--worker-tls-ca", ca],
            "--insecure-plaintext: cannot be combined with --worker-tls-ca",
        ),
        (
            &["--insecure-plaintext", "--worker-tls-name", "w"],
            "--worker-tls-name: needs the --worker-tls-* files",
        ),
        (
            &[
                "--worker-tls-cert",
                cert,
                "--worker-tls-key",
                key,
                "--worker-tls-ca",
                not_pem,
            ],
            "--worker-tls-ca: holds no PEM CERTIFICATE block",
        ),
        (
            &[
                "--worker-tls-cert",
                cert,
                "--worker-tls-key",
                key,
                "--worker-tls-ca",
                ca,
                "--worker-tls-name",
                "not a name!",
            ],
            "--worker-tls-name: \"not a name!\"",
        ),
    ];
    for (flags, expected) in gateway_cases {
        let mut cmd = std::process::Command::new(lorafleet_tests::binary("lorafleet-gateway"));
        cmd.args(["serve", "--listen", "127.0.0.1:0"])
            .args(["--metrics-listen", "127.0.0.1:0"])
            .args(["--workers", "127.0.0.1:1"])
            .args([
                "--database-url",
                "postgres://postgres@127.0.0.1:5432/unused",
            ])
            .env_remove("LORAFLEET_INSECURE_PLAINTEXT");
        assert_refused(cmd, flags, expected);
    }
}

/// `lorafleetctl certs` writes a fleet CA and the two role certificates,
/// readable by the owner only, that a worker and a gateway accept; it never
/// overwrites, and refuses bad flags by name.
#[tokio::test]
async fn lorafleetctl_certs_makes_a_working_fleet_ca() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("certs");
    let ctl = |args: &[&str]| {
        std::process::Command::new(lorafleet_tests::binary("lorafleetctl"))
            .arg("certs")
            .args(args)
            .output()
            .unwrap()
    };
    let out_s = out.to_str().unwrap();
    let made = ctl(&["--out", out_s, "--worker-name", "127.0.0.1"]);
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    for name in [
        "ca.pem",
        "ca-key.pem",
        "worker.pem",
        "worker-key.pem",
        "gateway.pem",
        "gateway-key.pem",
    ] {
        let meta = std::fs::metadata(out.join(name)).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(meta.permissions().mode() & 0o777, 0o600, "{name}");
    }
    // The files work: a worker serves with them and a gateway-side client
    // with the gateway's files is accepted.
    let worker = fixture(worker_command_with(&out), &[]);
    info_ok(
        worker_channel_with(
            worker.addr("grpc"),
            &out.join("gateway.pem"),
            &out.join("gateway-key.pem"),
            &out.join("ca.pem"),
        )
        .await,
    )
    .await
    .expect("the generated certificates work");
    for (args, expected) in [
        (
            vec!["--out", out_s, "--worker-name", "127.0.0.1"],
            "refusing to overwrite",
        ),
        (
            vec![
                "--out",
                "/nonexistent-x",
                "--worker-name",
                "a",
                "--days",
                "0",
            ],
            "--days: must be at least 1",
        ),
        (
            vec!["--out", "/nonexistent-x", "--worker-name", "not a name!"],
            "--worker-name: \"not a name!\"",
        ),
    ] {
        let o = ctl(&args);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}
