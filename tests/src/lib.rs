//! Harness for lorafleet's cross-process integration tests: a private
//! Postgres database per test, and the paths of the real binaries.
//!
//! Tests reach Postgres at `LORAFLEET_TEST_DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`); that URL is used only to
//! create and drop each test's own database.

use std::path::PathBuf;
use std::process::{Command, Output};

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, Executor, PgConnection};

pub mod browser;
pub mod s3;

/// The default server URL; trust auth on loopback.
pub const DEFAULT_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

fn admin_options() -> PgConnectOptions {
    let url =
        std::env::var("LORAFLEET_TEST_DATABASE_URL").unwrap_or_else(|_| DEFAULT_ADMIN_URL.into());
    url.parse().unwrap_or_else(|e| {
        panic!("LORAFLEET_TEST_DATABASE_URL {url:?} is not a Postgres URL: {e}")
    })
}

/// A database of its own for one test, dropped when the value is dropped,
/// even if the test panics.
#[derive(Debug)]
pub struct TestDb {
    name: String,
    options: PgConnectOptions,
}

impl TestDb {
    /// Creates an empty database named after `label` plus a random suffix.
    pub async fn create(label: &str) -> TestDb {
        let label: String = label
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '_'
                }
            })
            .take(30)
            .collect();
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let name = format!("lft_{label}_{}", &suffix[..12]);
        let admin = admin_options();
        let mut conn = admin
            .connect()
            .await
            .unwrap_or_else(|e| panic!("cannot reach the test Postgres server: {e}"));
        // The name is built from [a-z0-9_] only, so quoting it is safe.
        let create = format!(r#"CREATE DATABASE "{name}""#);
        conn.execute(sqlx::raw_sql(AssertSqlSafe(create)))
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {name}: {e}"));
        conn.close().await.ok();
        let options = admin.database(&name);
        TestDb { name, options }
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A URL for this database, to hand to a binary under test.
    pub fn url(&self) -> String {
        let admin = admin_options();
        let user = admin.get_username();
        format!(
            "postgres://{user}@{}:{}/{}",
            admin.get_host(),
            admin.get_port(),
            self.name
        )
    }

    /// A URL for this database as another user (trust auth on loopback).
    pub fn url_as(&self, user: &str) -> String {
        let admin = admin_options();
        format!(
            "postgres://{user}@{}:{}/{}",
            admin.get_host(),
            admin.get_port(),
            self.name
        )
    }

    /// A fresh pool on this database.
    pub async fn pool(&self) -> PgPool {
        PgPoolOptions::new()
            .max_connections(4)
            .connect_with(self.options.clone())
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", self.name))
    }

    /// A single connection on this database, for explicit transactions.
    pub async fn connection(&self) -> PgConnection {
        self.options
            .connect()
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", self.name))
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop runs outside any runtime guarantee, so use a private one on a
        // plain thread; FORCE ends connections the test left open.
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let mut conn = admin_options().connect().await?;
                let drop = format!(r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#);
                conn.execute(sqlx::raw_sql(AssertSqlSafe(drop))).await?;
                conn.close().await?;
                anyhow::Ok(())
            })
        })
        .join();
        if let Ok(Err(e)) = dropped {
            eprintln!("warning: could not drop test database {}: {e}", self.name);
        }
    }
}

/// The path of a workspace binary built next to the running test.
///
/// `cargo test` builds only the binaries of the package under test, so the
/// test command builds the workspace's binaries first
/// (`cargo build --workspace --bins`).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("test binary lives in target/<profile>/deps");
    let path = dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.is_file(),
        "{} is missing: run `cargo build --workspace --bins` before the tests",
        path.display()
    );
    path
}

/// Runs a binary to completion with the given arguments and environment,
/// with no inherited DATABASE_URL so tests state every setting they use.
pub fn run(name: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(binary(name));
    cmd.args(args).env_remove("DATABASE_URL");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap_or_else(|e| panic!("spawn {name}: {e}"))
}

/// Runs the real `lorafleet-gateway migrate` on `db` (off the runtime's
/// threads, so the test's tasks keep running) and returns what it printed.
pub async fn migrate(db: &TestDb) -> Output {
    let url = db.url();
    tokio::task::spawn_blocking(move || {
        run(
            "lorafleet-gateway",
            &["migrate", "--database-url", &url],
            &[],
        )
    })
    .await
    .expect("migrate task")
}

/// Creates a database and brings it to the current schema by running the
/// real `lorafleet-gateway migrate`.
pub async fn migrated_db(label: &str) -> TestDb {
    let db = TestDb::create(label).await;
    let out = migrate(&db).await;
    assert!(
        out.status.success(),
        "lorafleet-gateway migrate failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    db
}

/// A new login role that is a member of `role` (one of the roles the
/// migrations create, such as `lorafleet_runtime`) and nothing else: what a
/// serving process logs in as.
pub async fn login_member_of(pool: &PgPool, role: &str) -> String {
    assert!(
        role.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
        "{role}"
    );
    let name = format!(
        "lft_{}_{}",
        &role[10..].chars().take(5).collect::<String>(),
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    // Both names are [a-z0-9_] only, so the statement is safe.
    let sql = format!("CREATE ROLE {name} LOGIN IN ROLE {role}");
    pool.execute(sqlx::raw_sql(AssertSqlSafe(sql)))
        .await
        .unwrap_or_else(|e| panic!("CREATE ROLE {name}: {e}"));
    name
}

/// Seeds the fixture base model `llama-gqa` and, for each (tenant name,
/// API key `prefix.secret`), the tenant, its key (scope `inference`) and a
/// route `model` to the base model.
pub async fn seed_base_routes(pool: &PgPool, tenants: &[(&str, &str)], model: &str) {
    let hashes: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(engine_fixtures().join("base_hashes.json"))
            .expect("the fixtures' base_hashes.json"),
    )
    .expect("base_hashes.json is JSON");
    let base: i64 = sqlx::query_scalar(
        "INSERT INTO base_models (name, base_hash, architecture) VALUES ('llama-gqa', $1, 'llama')
         RETURNING id",
    )
    .bind(hashes["llama-gqa"].as_str().expect("llama-gqa's hash"))
    .fetch_one(pool)
    .await
    .expect("insert the base model");
    for (name, key) in tenants {
        let tenant: uuid::Uuid =
            sqlx::query_scalar("INSERT INTO tenants (name) VALUES ($1) RETURNING id")
                .bind(name)
                .fetch_one(pool)
                .await
                .expect("insert a tenant");
        let (prefix, secret) = key.split_once('.').expect("a key is prefix.secret");
        sqlx::query(
            "INSERT INTO api_keys (tenant_id, prefix, secret_hash, scopes)
             VALUES ($1, $2, sha256(convert_to($3, 'UTF8')), ARRAY['inference'])",
        )
        .bind(tenant)
        .bind(prefix)
        .bind(secret)
        .execute(pool)
        .await
        .expect("insert a key");
        let mut tx = pool.begin().await.expect("begin");
        let route: uuid::Uuid = sqlx::query_scalar(
            "INSERT INTO routes (tenant_id, model_name, current_revision) VALUES ($1, $2, 1)
             RETURNING id",
        )
        .bind(tenant)
        .bind(model)
        .fetch_one(&mut *tx)
        .await
        .expect("insert a route");
        sqlx::query(
            "INSERT INTO route_revisions (route_id, revision, base_model_id, target)
             VALUES ($1, 1, $2, 'base')",
        )
        .bind(route)
        .bind(base)
        .execute(&mut *tx)
        .await
        .expect("insert a revision");
        tx.commit().await.expect("commit");
    }
}

/// The Python that has lm-eval and the OpenAI SDK (`.ci/run` installs it
/// in `target/lm-eval-venv`; `LORAFLEET_LM_EVAL_PYTHON` names another).
pub fn sdk_python() -> PathBuf {
    if let Some(p) = std::env::var_os("LORAFLEET_LM_EVAL_PYTHON") {
        return PathBuf::from(p);
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/lm-eval-venv/bin/python");
    assert!(
        p.exists(),
        "{} is missing: `bash .ci/run` installs lm-eval and the OpenAI SDK there \
         (or set LORAFLEET_LM_EVAL_PYTHON)",
        p.display()
    );
    p
}

/// The engine's fixture directory: small models, adapters and goldens
/// made by `worker/engine/scripts/make_fixtures.py`.
pub fn engine_fixtures() -> PathBuf {
    // LORAFLEET_FIXTURES where the tests run from another checkout than
    // the one they were built in (the GPU check copies binaries there).
    std::env::var_os("LORAFLEET_FIXTURES").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../worker/engine/tests/fixtures"),
        PathBuf::from,
    )
}

/// The fleet's certificates for tests: a CA, a worker certificate naming
/// 127.0.0.1 and localhost, and a gateway certificate. Generated once per
/// build directory (by whichever test process comes first) and shared.
#[derive(Debug)]
pub struct TestCerts {
    pub dir: PathBuf,
}

impl TestCerts {
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

/// See [`TestCerts`].
pub fn certs() -> &'static TestCerts {
    static CERTS: std::sync::OnceLock<TestCerts> = std::sync::OnceLock::new();
    CERTS.get_or_init(|| {
        let target = binary("lorafleet-worker")
            .parent()
            .expect("target/<profile>")
            .to_owned();
        let dir = target.join("lorafleet-test-certs-v1");
        if !dir.join("gateway-key.pem").is_file() {
            // Written aside, then renamed into place in one step, so a
            // process racing this one sees all the files or none.
            let scratch = tempfile::tempdir_in(&target).expect("scratch dir for certificates");
            write_fleet_certs(scratch.path(), "lorafleet test CA");
            let _ = std::fs::rename(scratch.keep(), &dir);
        }
        assert!(dir.join("gateway-key.pem").is_file(), "{}", dir.display());
        TestCerts { dir }
    })
}

/// Writes a new CA and its worker and gateway certificates into `dir`, as
/// `lorafleetctl certs` names them; long-lived, as test material.
pub fn write_fleet_certs(dir: &std::path::Path, ca_name: &str) {
    use lorafleet_tls::issue::{Ca, Role};
    let ca = Ca::generate(ca_name, 3650).expect("CA");
    let names = ["127.0.0.1".to_owned(), "localhost".to_owned()];
    let worker = ca.issue(Role::Worker, &names, 3650).expect("worker cert");
    let gateway = ca
        .issue(Role::Gateway, &["lorafleet-gateway".to_owned()], 3650)
        .expect("gateway cert");
    std::fs::create_dir_all(dir).unwrap();
    for (name, text) in [
        ("ca.pem", &ca.pem().cert),
        ("ca-key.pem", &ca.pem().key),
        ("worker.pem", &worker.cert),
        ("worker-key.pem", &worker.key),
        ("gateway.pem", &gateway.cert),
        ("gateway-key.pem", &gateway.key),
    ] {
        std::fs::write(dir.join(name), text).unwrap();
    }
}

/// `lorafleet-worker serve` on loopback ports (gRPC, metrics, health), with
/// mutual TLS from [`certs`]; the caller adds the model and the rest.
pub fn worker_command() -> Command {
    worker_command_with(&certs().dir)
}

/// [`worker_command`] with the TLS files of `dir` (named as [`certs`]
/// names them).
pub fn worker_command_with(dir: &std::path::Path) -> Command {
    let c = TestCerts {
        dir: dir.to_owned(),
    };
    let mut cmd = Command::new(binary("lorafleet-worker"));
    cmd.args(["serve", "--grpc-listen", "127.0.0.1:0"])
        .args(["--metrics-listen", "127.0.0.1:0"])
        .args(["--health-listen", "127.0.0.1:0"])
        .arg("--tls-cert")
        .arg(c.path("worker.pem"))
        .arg("--tls-key")
        .arg(c.path("worker-key.pem"))
        .arg("--tls-client-ca")
        .arg(c.path("ca.pem"));
    // LORAFLEET_TEST_BACKEND=cuda runs every worker the tests start on the
    // GPU, in f32 so that greedy tokens equal the goldens
    // (`deploy/gpu-check.sh` does this); the default is the CPU backend.
    if let Ok(backend) = std::env::var("LORAFLEET_TEST_BACKEND") {
        cmd.args(["--backend", &backend]);
        if backend == "cuda" {
            cmd.args(["--dtype", "f32"]);
        }
    }
    cmd
}

/// `lorafleet-gateway serve` on loopback ports, calling workers with mutual
/// TLS from [`certs`]; the caller adds the database, the workers and the rest.
pub fn gateway_command() -> Command {
    gateway_command_with(&certs().dir)
}

/// [`gateway_command`] with the TLS files of `dir`.
pub fn gateway_command_with(dir: &std::path::Path) -> Command {
    let c = TestCerts {
        dir: dir.to_owned(),
    };
    let mut cmd = Command::new(binary("lorafleet-gateway"));
    cmd.args(["serve", "--listen", "127.0.0.1:0"])
        .args(["--metrics-listen", "127.0.0.1:0"])
        // Failed authentications reach the audit log a second after, not
        // a minute, so tests that count rows need not wait.
        .args(["--failed-auth-window-secs", "1"])
        .arg("--worker-tls-cert")
        .arg(c.path("gateway.pem"))
        .arg("--worker-tls-key")
        .arg(c.path("gateway-key.pem"))
        .arg("--worker-tls-ca")
        .arg(c.path("ca.pem"));
    cmd
}

/// A gRPC channel to a worker as the gateway makes it: mutual TLS with the
/// gateway's certificate from [`certs`], the worker named by its IP.
pub async fn worker_channel(addr: &str) -> Result<tonic::transport::Channel, String> {
    let c = certs();
    worker_channel_with(
        addr,
        &c.path("gateway.pem"),
        &c.path("gateway-key.pem"),
        &c.path("ca.pem"),
    )
    .await
}

/// [`worker_channel`] with other client files.
pub async fn worker_channel_with(
    addr: &str,
    cert: &std::path::Path,
    key: &std::path::Path,
    ca: &std::path::Path,
) -> Result<tonic::transport::Channel, String> {
    let files = lorafleet_tls::PemFiles {
        cert: cert.to_owned(),
        key: key.to_owned(),
        ca: ca.to_owned(),
        flags: ["cert", "key", "ca"],
    };
    let config = files
        .load()
        .and_then(|l| lorafleet_tls::client::config(&l))
        .map_err(|e| e.to_string())?;
    worker_channel_config(addr, config).await
}

/// A gRPC channel to a worker over TLS with any client config.
pub async fn worker_channel_config(
    addr: &str,
    config: lorafleet_tls::rustls::ClientConfig,
) -> Result<tonic::transport::Channel, String> {
    let config = lorafleet_tls::Reloading::fixed(config);
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let connector =
        lorafleet_tls::client::Connector::new(config, host).map_err(|e| e.to_string())?;
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| e.to_string())?
        .connect_with_connector(connector)
        .await
        .map_err(|e| format!("{e}: {:?}", std::error::Error::source(&e)))
}

/// A real worker on the fixture model `llama-gqa` with the fixture
/// adapters as its artifact root, on loopback ports; `extra` adds flags.
pub fn fixture_worker(id: &str, extra: &[&str]) -> Server {
    fixture_worker_from(worker_command(), id, extra)
}

/// [`fixture_worker`] from a `serve` command the caller prepared (other
/// TLS files, say).
pub fn fixture_worker_from(mut cmd: Command, id: &str, extra: &[&str]) -> Server {
    let fixtures = engine_fixtures();
    cmd.args(["--worker-id", id])
        .args(extra)
        .arg("--model")
        .arg(fixtures.join("llama-gqa"))
        .arg("--artifact-root")
        .arg(fixtures.join("adapters"));
    Server::start(cmd, "lorafleet-worker listening ")
}

/// Runs `cmd` with `flags` added and checks that it refuses to start with
/// `expected` in its error output: a refusal by name.
pub fn assert_refused(mut cmd: Command, flags: &[&str], expected: &str) {
    let out = cmd.args(flags).output().expect("run the command");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{flags:?} was accepted");
    assert!(
        stderr.contains(expected),
        "{flags:?}: expected {expected:?} in {stderr}"
    );
}

/// Every file under `dir`, at any depth (none if it does not exist).
pub fn files_under(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// The audit spool's segment files under a spool directory.
pub fn spool_segments(dir: &std::path::Path) -> Vec<PathBuf> {
    files_under(dir)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect()
}

/// Sends a signal (`"TERM"`, `"STOP"`, `"CONT"`, ...) to a process.
pub fn signal(pid: u32, name: &str) {
    let sent = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()
        .unwrap_or_else(|e| panic!("kill -{name} {pid}: {e}"));
    assert!(sent.success(), "kill -{name} {pid}: {sent}");
}

/// A process's resident memory in KiB (0 if it is gone).
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// A real server process started by a test, killed when dropped.
#[derive(Debug)]
pub struct Server {
    pub child: std::process::Child,
    /// The `key=value` words of the first stdout line that starts with the
    /// ready prefix, e.g. `grpc` -> `127.0.0.1:4242`.
    pub addrs: std::collections::HashMap<String, String>,
    /// Its stderr (the structured log), line by line.
    pub log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let pid = self.child.id();
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A killed worker cannot remove its default adapter cache (the next
        // worker to start would, `worker/src/server/cache.rs`): the harness
        // does, so that the suite leaves no directory behind.
        let suffix = format!("-{pid}");
        if let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) {
            for e in entries.flatten() {
                let name = e.file_name();
                let name = name.to_string_lossy();
                if name.starts_with("lorafleet-adapter-cache-") && name.ends_with(&suffix) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }
}

impl Server {
    /// Kills the process and waits for it (what dropping it does, without
    /// giving up the value).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts `cmd` and waits (up to 60 s) for its ready line on stdout.
    pub fn start(mut cmd: Command, ready_prefix: &str) -> Server {
        use std::io::{BufRead, BufReader};
        use std::process::Stdio;
        let mut child = cmd
            .env_remove("DATABASE_URL")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().expect("log").push(line);
            }
        });
        let (tx, rx) = std::sync::mpsc::channel();
        let prefix = ready_prefix.to_owned();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix(&prefix) {
                    let _ = tx.send(rest.to_owned());
                }
            }
        });
        let line = match rx.recv_timeout(std::time::Duration::from_secs(60)) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "{cmd:?} never printed {ready_prefix:?}; its log:\n{}",
                    log.lock().expect("log").join("\n")
                );
            }
        };
        let addrs = line
            .split_whitespace()
            .filter_map(|w| w.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        Server { child, addrs, log }
    }

    pub fn addr(&self, key: &str) -> &str {
        self.addrs
            .get(key)
            .unwrap_or_else(|| panic!("no {key}= in the ready line: {:?}", self.addrs))
    }

    /// The log so far, as one string.
    pub fn log_text(&self) -> String {
        self.log.lock().expect("log").join("\n")
    }
}

/// A TCP proxy on a loopback port in front of a real service, which a test
/// can cut (closing every open connection and refusing new ones) and
/// restore: an outage of Postgres or Redis as a client sees it, without
/// stopping the server that other tests share.
#[derive(Debug)]
pub struct Proxy {
    pub addr: std::net::SocketAddr,
    up: std::sync::Arc<std::sync::atomic::AtomicBool>,
    stalled: std::sync::Arc<std::sync::atomic::AtomicBool>,
    generation: tokio::sync::watch::Sender<u64>,
}

impl Proxy {
    /// Starts the proxy on a thread of its own, so that it keeps forwarding
    /// while the test's own runtime is blocked.
    pub fn start(target: &str) -> Proxy {
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("proxy address");
        let up = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let stalled = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (generation, _) = tokio::sync::watch::channel(0u64);
        let target = target.to_owned();
        let (flag, cut, stall) = (up.clone(), generation.clone(), stalled.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("proxy runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                // While stalled, a connection is held open and silent, and
                // closed at the restore.
                let hold = |stall: std::sync::Arc<std::sync::atomic::AtomicBool>| async move {
                    while stall.load(Ordering::SeqCst) {
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    }
                };
                while let Ok((mut client, _)) = listener.accept().await {
                    if !flag.load(Ordering::SeqCst) {
                        drop(client);
                        continue;
                    }
                    let mut cut = cut.subscribe();
                    let target = target.clone();
                    let stall = stall.clone();
                    tokio::spawn(async move {
                        if stall.load(Ordering::SeqCst) {
                            hold(stall).await;
                            return;
                        }
                        let Ok(mut server) = tokio::net::TcpStream::connect(&target).await else {
                            return;
                        };
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                            _ = cut.changed() => hold(stall).await,
                        }
                    });
                }
            });
        });
        Proxy {
            addr,
            up,
            stalled,
            generation,
        }
    }

    /// Holds every connection open without forwarding a byte, new ones
    /// too, until [`Proxy::restore`]: a server that hangs rather than
    /// refuses.
    pub fn stall(&self) {
        self.stalled
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    /// Closes every connection and refuses new ones until [`Proxy::restore`].
    pub fn cut(&self) {
        self.up.store(false, std::sync::atomic::Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    pub fn restore(&self) {
        self.stalled
            .store(false, std::sync::atomic::Ordering::SeqCst);
        self.up.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Fails if an error body a tenant sees holds what belongs in the logs: a
/// filesystem path (a token with two `/`-separated parts) or a hex digest
/// (16 or more hex digits in a row).
pub fn assert_tenant_safe(body: &str) {
    for token in body.split(|c: char| c.is_whitespace() || "\"'`,;()[]{}".contains(c)) {
        let parts: Vec<&str> = token.split('/').collect();
        let path_like =
            parts.len() >= 3 && parts[1..].iter().filter(|p| !p.is_empty()).count() >= 2;
        assert!(!path_like, "a path {token:?} in a tenant's error: {body}");
    }
    let mut run = 0;
    for c in body.chars() {
        run = if c.is_ascii_hexdigit() { run + 1 } else { 0 };
        assert!(run < 16, "a hex digest in a tenant's error: {body}");
    }
}

/// The request fields of the OpenAI API a refusal may name although the
/// client left them out (a default was at fault, or the field is required).
pub const OPENAI_REQUEST_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "logprobs",
    "top_logprobs",
    "echo",
    "best_of",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "user",
    "response_format",
    "tools",
    "tool_choice",
    "suffix",
    // Extensions the gateway accepts, as vLLM does.
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_json",
];

/// Asserts that the `param` of a refusal (`answer`, an OpenAI error body)
/// is a field of the request as the client sent it (`sent`): a path such
/// as `messages[2].content` or `stop[0]` that exists in the body, or a
/// top-level request field; never a name of the gateway's or the worker's
/// own (`sampling.max_tokens`, `prompt.token_ids`).
pub fn assert_client_param(sent: &serde_json::Value, answer: &serde_json::Value) {
    let Some(param) = answer["error"]["param"].as_str() else {
        return;
    };
    let steps = param_steps(param).unwrap_or_else(|| {
        panic!("param {param:?} is not a field path: {answer}");
    });
    let (serde_json::Value::Object(_), Some(Step::Key(top))) = (sent, steps.first()) else {
        panic!("param {param:?} does not start with a field name: {answer}");
    };
    let mut at = sent;
    for (i, step) in steps.iter().enumerate() {
        let next = match step {
            Step::Key(k) => at.get(k.as_str()),
            Step::Index(n) => at.get(*n),
        };
        match next {
            Some(v) => at = v,
            None => {
                // Only a top-level field the client left out may be named
                // without being in the body.
                assert!(
                    i == 0 && steps.len() == 1 && OPENAI_REQUEST_FIELDS.contains(&top.as_str()),
                    "param {param:?} names nothing the client sent ({sent}): {answer}"
                );
                return;
            }
        }
    }
}

enum Step {
    Key(String),
    Index(usize),
}

/// `a.b[2].c` as keys and indices.
fn param_steps(param: &str) -> Option<Vec<Step>> {
    let mut steps = Vec::new();
    for part in param.split('.') {
        let (key, mut rest) = match part.find('[') {
            Some(i) => (&part[..i], &part[i..]),
            None => (part, ""),
        };
        if key.is_empty() && steps.is_empty() {
            return None;
        }
        if !key.is_empty() {
            steps.push(Step::Key(key.to_owned()));
        }
        while let Some(r) = rest.strip_prefix('[') {
            let (n, after) = r.split_once(']')?;
            steps.push(Step::Index(n.parse().ok()?));
            rest = after;
        }
        if !rest.is_empty() {
            return None;
        }
    }
    Some(steps)
}

/// The real gateway on `worker` (and `--database-url`), its audit spool in
/// `spool`, with `extra` flags, once its `/readyz` says ready.
pub async fn ready_gateway(
    db_url: &str,
    worker: &Server,
    spool: &std::path::Path,
    extra: &[&str],
) -> Server {
    let mut cmd = gateway_command();
    cmd.args(["--database-url", db_url])
        .args(["--workers", worker.addr("grpc")])
        .args(extra)
        .arg("--audit-spool")
        .arg(spool);
    let gateway = Server::start(cmd, "lorafleet-gateway listening ");
    let http = reqwest::Client::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !http
        .get(format!("http://{}/readyz", gateway.addr("http")))
        .send()
        .await
        .is_ok_and(|r| r.status() == 200)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the gateway became ready"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    gateway
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn refusal(param: &str) -> serde_json::Value {
        json!({"error": {"message": "m", "type": "invalid_request_error", "param": param}})
    }

    #[test]
    fn a_param_the_client_sent_passes() {
        let sent = json!({"model": "m", "messages": [{"role": "user"}, {"role": "x", "content": 3}],
                          "stop": ["a"]});
        for p in [
            "model",
            "messages[1].content",
            "stop[0]",
            "messages",
            "max_tokens",
        ] {
            assert_client_param(&sent, &refusal(p));
        }
        assert_client_param(&sent, &json!({"error": {"param": null}}));
    }

    #[test]
    #[should_panic(expected = "names nothing the client sent")]
    fn an_internal_name_fails() {
        assert_client_param(&json!({"prompt": "x"}), &refusal("sampling.max_tokens"));
    }

    #[test]
    #[should_panic(expected = "names nothing the client sent")]
    fn a_path_into_what_was_not_sent_fails() {
        assert_client_param(&json!({"prompt": [1, 2]}), &refusal("prompt.token_ids"));
    }

    #[test]
    #[should_panic(expected = "names nothing the client sent")]
    fn an_index_past_the_end_fails() {
        assert_client_param(&json!({"stop": ["a"]}), &refusal("stop[3]"));
    }
}
