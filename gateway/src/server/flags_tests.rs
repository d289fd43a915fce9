//! The `serve` flags' tests: each refusal names its flag.

use clap::Parser;

use super::*;

#[derive(Debug, Parser)]
#[command(args_override_self = true)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

/// The flags with the settings every case needs first, so a case can
/// override them.
fn parse(flags: &[&str]) -> ServeArgs {
    let base = [
        "serve",
        "--insecure-plaintext",
        "--database-url",
        "postgres://postgres@127.0.0.1:5432/unused",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    let workers: &[&str] = if flags.contains(&"--workers-dns") && !flags.contains(&"--workers") {
        &[]
    } else {
        &["--workers", "127.0.0.1:1"]
    };
    let args = base.iter().chain(workers).chain(flags);
    Cli::try_parse_from(args).unwrap().serve
}

#[test]
fn every_bad_flag_is_refused_by_name() {
    for (flags, expected) in BAD_FLAGS {
        let refused = parse(flags)
            .validate()
            .map(|_| ())
            .expect_err(&format!("{flags:?} was accepted"));
        let message = refused.to_string();
        assert!(
            message.starts_with(expected),
            "{flags:?}: expected {expected:?}, got {message:?}"
        );
    }
}

/// Bad flags and the start of the refusal each gets.
const BAD_FLAGS: &[(&[&str], &str)] = &[
    (&["--workers", ""], "--workers: \"\" is not HOST:PORT"),
    (
        &["--workers", "nohost"],
        "--workers: \"nohost\" is not HOST:PORT",
    ),
    (
        &["--workers", "127.0.0.1:1", "--workers-dns", "workers:50051"],
        "--workers and --workers-dns: give one, not both",
    ),
    (
        &["--workers-dns", "workers"],
        "--workers-dns: \"workers\" must be HOST:PORT",
    ),
    (
        &["--load-factor", "0.5"],
        "--load-factor: 0.5 must be at least 1.0",
    ),
    (
        &["--resident-load-factor", "1.1"],
        "--resident-load-factor: 1.1 must be at least --load-factor (1.25)",
    ),
    (
        &["--load-factor", "2", "--resident-load-factor", "inf"],
        "--resident-load-factor: inf must be at least --load-factor (2)",
    ),
    (
        &["--max-attempts", "0"],
        "--max-attempts: must be at least 1",
    ),
    (
        &["--idle-timeout-secs", "0"],
        "--idle-timeout-secs: must be at least 1",
    ),
    (
        &["--http2-keepalive-secs", "0"],
        "--http2-keepalive-secs: must be at least 1",
    ),
    (
        &["--max-connections", "0"],
        "--max-connections: must be at least 1",
    ),
    (
        &["--max-connections-per-source", "0"],
        "--max-connections-per-source: must be at least 1",
    ),
    (
        &["--trusted-proxies", "10.0.0.0/8,proxy"],
        "--trusted-proxies: \"proxy\" is not a CIDR",
    ),
    (
        &["--failed-auth-burst", "0"],
        "--failed-auth-burst: must be at least 1",
    ),
    (
        &["--failed-auth-window-secs", "7200"],
        "--failed-auth-window-secs: 7200 is more than an hour",
    ),
    (
        &["--first-token-timeout-secs", "0"],
        "--first-token-timeout-secs: must be at least 1",
    ),
    (
        &["--registry-max-age-secs", "0"],
        "--registry-max-age-secs: must be at least 1",
    ),
    (
        &["--audit-retention-days", "0"],
        "--audit-retention-days: must be at least 1",
    ),
    (
        &["--audit-retention-days", "30"],
        "--audit-retention-days: needs the admin plane (--admin-listen)",
    ),
    (
        &["--admin-only"],
        "--admin-only: needs the admin plane (--admin-listen and an admin token key)",
    ),
    (
        &["--audit-queue-bytes", "100"],
        "--audit-queue-bytes: 100 is less than one row",
    ),
    (
        &["--audit-spool-max-bytes", "1000"],
        "--audit-spool-max-bytes: 1000 must be at least twice --audit-queue-bytes",
    ),
    (
        &["--audit-spool-owner", "../escape"],
        "--audit-spool-owner: \"../escape\" must be 1 to 128 letters",
    ),
    (
        &["--audit-spool", "/etc/hostname"],
        "--audit-spool: /etc/hostname is a file; it must be a directory",
    ),
    (
        &["--max-body-bytes", "0"],
        "--max-body-bytes: must be at least 1",
    ),
    (
        &["--rollout-lease-secs", "0"],
        "--rollout-lease-secs: must be at least 1",
    ),
    (
        &["--rollout-tick-ms", "20000"],
        "--rollout-tick-ms: 20000 must be at most half of --rollout-lease-secs (30 s)",
    ),
    (
        &["--jwt-algorithms", "HS256"],
        "--jwt-algorithms: set --jwt-hmac-secret-file or --jwt-public-key-file too",
    ),
    (
        &["--database-url", "mysql://db/x"],
        "--database-url: must start with postgres://",
    ),
    (
        &["--admin-database-url", "mysql://db/x"],
        "--admin-database-url: must start with postgres://",
    ),
    (
        &["--admin-listen", "127.0.0.1:0"],
        "--admin-listen: needs an admin token key",
    ),
    (
        &["--admin-jwt-algorithms", "HS256"],
        "--admin-jwt-algorithms: set --admin-jwt-hmac-secret-file or --admin-jwt-public-key-file too",
    ),
    (
        &["--artifact-root", "/no/such/artifact/root"],
        "--artifact-root: artifact root /no/such/artifact/root",
    ),
    (
        &["--max-lora-rank", "0"],
        "--max-lora-rank: must be at least 1",
    ),
    (
        &["--max-concurrent-per-tenant", "0"],
        "--max-concurrent-per-tenant: must be at least 1",
    ),
    (
        &["--max-concurrent-per-tenant", "5000"],
        "--max-concurrent-per-tenant: 5000 is above --max-concurrent-requests (1024)",
    ),
    (
        &["--body-timeout-secs", "0"],
        "--body-timeout-secs: must be at least 1",
    ),
    (
        &["--header-timeout-secs", "0"],
        "--header-timeout-secs: must be at least 1",
    ),
    (
        &["--tls-reload-secs", "0"],
        "--tls-reload-secs: must be at least 1",
    ),
    (
        &["--worker-tls-name", "worker"],
        "--worker-tls-name: needs the --worker-tls-* files, not --insecure-plaintext",
    ),
    (
        &["--worker-tls-ca", "/ca.pem"],
        "--insecure-plaintext: cannot be combined with --worker-tls-ca",
    ),
];

#[test]
fn good_flags_become_the_config_they_say() {
    let c = parse(&[
        "--max-concurrent-requests",
        "100",
        "--default-rpm-limit",
        "0",
        "--rollout-tick-ms",
        "250",
        "--audit-spool-owner",
        "gw-1",
    ])
    .validate()
    .unwrap();
    assert_eq!(c.max_concurrent_requests, 100);
    // A quarter of the global cap by default, so no tenant takes all.
    assert_eq!(c.max_concurrent_per_tenant, 25);
    assert_eq!(c.default_rpm_limit, None, "0 means unlimited");
    assert_eq!(c.default_tpm_limit, Some(1_000_000));
    assert_eq!(c.rollout_tick, Duration::from_millis(250));
    assert_eq!(c.audit.spool_owner, "gw-1");
    assert!(c.worker_tls.files.is_none());
    assert!(c.admin.is_none());
    assert!(matches!(c.discovery, Discovery::Static(ref w) if w == &["127.0.0.1:1"]));
    // Debug never shows the database URL (it may hold a password).
    let shown = format!(
        "{:?}",
        parse(&["--database-url", "postgres://u:hunter2@db/x"])
            .validate()
            .unwrap()
    );
    assert!(!shown.contains("hunter2"), "{shown}");
}

#[test]
fn an_admin_token_lifetime_of_zero_is_refused_by_its_flag() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("admin.secret");
    std::fs::write(&secret, "s".repeat(48)).unwrap();
    let admin = [
        "--admin-listen",
        "127.0.0.1:0",
        "--admin-jwt-hmac-secret-file",
        secret.to_str().unwrap(),
        "--admin-jwt-algorithms",
        "HS256",
        "--admin-jwt-issuer",
        "i",
        "--admin-jwt-audience",
        "a",
    ];
    let ok = parse(&admin).validate().unwrap();
    assert_eq!(
        ok.admin.unwrap().jwt.max_ttl_secs(),
        Some(86_400),
        "a day by default"
    );
    let mut zero = admin.to_vec();
    zero.extend(["--admin-jwt-max-ttl-secs", "0"]);
    let refused = parse(&zero).validate().unwrap_err().to_string();
    assert!(
        refused.contains("--admin-jwt-max-ttl-secs: must be at least 1"),
        "{refused}"
    );
}
