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

/// Creates a database and brings it to the current schema by running the
/// real `lorafleet-gateway migrate`.
pub async fn migrated_db(label: &str) -> TestDb {
    let db = TestDb::create(label).await;
    let url = db.url();
    let out = tokio::task::spawn_blocking(move || {
        run(
            "lorafleet-gateway",
            &["migrate", "--database-url", &url],
            &[],
        )
    })
    .await
    .expect("migrate task");
    assert!(
        out.status.success(),
        "lorafleet-gateway migrate failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    db
}

/// The engine's fixture directory: small models, adapters and goldens
/// made by `worker/engine/scripts/make_fixtures.py`.
pub fn engine_fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../worker/engine/tests/fixtures")
}
