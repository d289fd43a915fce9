//! The audit suites' environment: real gateway and worker processes, real
//! Postgres (behind a proxy a test cuts), gateways logged in as a member of
//! `lorafleet_runtime`, and two tenants. Included by each suite with
//! `#[path]`; a suite uses only part of it.
#![allow(dead_code)]

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use lorafleet_tests::{
    Proxy, Server, TestDb, fixture_worker, gateway_command, login_member_of, migrated_db,
    seed_base_routes, spool_segments,
};
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

pub const ACME_KEY: &str = "lf_acmeaudit1.acme-secret-0123456789";
pub const GLOBEX_KEY: &str = "lf_globexaud1.globex-secret-0123456789";
pub const KEYS: [&str; 2] = [ACME_KEY, GLOBEX_KEY];

/// Two tenants, each with a key and a base-model route `chat`.
pub async fn seed(pool: &PgPool) {
    seed_base_routes(pool, &[("acme", ACME_KEY), ("globex", GLOBEX_KEY)], "chat").await;
}

/// A login role that is a member of `lorafleet_runtime` and nothing else.
pub async fn runtime_user(pool: &PgPool) -> String {
    login_member_of(pool, "lorafleet_runtime").await
}

pub struct Env {
    pub pool: PgPool,
    pub pg: Proxy,
    pub user: String,
    pub db_name: String,
    pub worker: Server,
    pub spool: tempfile::TempDir,
    pub http: reqwest::Client,
    pub _db: TestDb,
}

pub async fn env(label: &str) -> Env {
    let db = migrated_db(label).await;
    let pool = db.pool().await;
    seed(&pool).await;
    let user = runtime_user(&pool).await;
    Env {
        pool,
        pg: Proxy::start("127.0.0.1:5432"),
        user,
        db_name: db.name().to_owned(),
        worker: fixture_worker("w0", &[]),
        spool: tempfile::tempdir().unwrap(),
        http: reqwest::Client::new(),
        _db: db,
    }
}

impl Env {
    /// A gateway on this environment, once it has seen the worker.
    pub async fn gateway(&self, extra: &[&str]) -> Gateway {
        let mut cmd = gateway_command();
        cmd.args([
            "--database-url",
            &format!("postgres://{}@{}/{}", self.user, self.pg.addr, self.db_name),
        ])
        .args(["--workers", self.worker.addr("grpc")])
        // These tests load one tenant steadily; the limiter is not under
        // test here (tests/tests/gateway.rs covers it).
        .args(["--default-rpm-limit", "0", "--default-tpm-limit", "0"])
        .args(["--registry-refresh-secs", "1"])
        .args(["--audit-spool-owner", "gw-test"])
        .arg("--audit-spool")
        .arg(self.spool.path())
        .args(extra);
        let server = Server::start(cmd, "lorafleet-gateway listening ");
        let url = format!("http://{}", server.addr("http"));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = self.http.get(format!("{url}/readyz")).send().await;
            if r.is_ok_and(|r| r.status() == 200) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the gateway never became ready: {}",
                server.log_text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Gateway { server, url }
    }

    pub async fn rows(&self) -> Vec<(Uuid, String, i16, Option<String>)> {
        sqlx::query_as("SELECT request_id, status::text, http_status, error_code FROM audit_log")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    /// Waits until every answered request has its row, then checks: none
    /// doubled, and none unknown.
    pub async fn expect_rows(&self, answered: &HashSet<Uuid>, gw: &Gateway) {
        self.expect_rows_of(answered, gw, false).await;
    }

    /// As [`Env::expect_rows`]; `extra_allowed` lets rows of requests whose
    /// answer never reached the client (a killed process) be there too.
    pub async fn expect_rows_of(
        &self,
        answered: &HashSet<Uuid>,
        gw: &Gateway,
        extra_allowed: bool,
    ) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let rows = self.rows().await;
            let ids: Vec<Uuid> = rows.iter().map(|r| r.0).collect();
            let set: HashSet<Uuid> = ids.iter().copied().collect();
            let missing = answered.difference(&set).count();
            if missing == 0 {
                assert_eq!(ids.len(), set.len(), "duplicated rows");
                let unknown: Vec<_> = set.difference(answered).collect();
                assert!(
                    extra_allowed || unknown.is_empty(),
                    "rows no client was answered for: {unknown:?}"
                );
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{missing} of {} answered requests have no row: {}",
                answered.len(),
                gw.server.log_text()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub async fn dead_letters(&self) -> Vec<(String, String, Vec<u8>)> {
        sqlx::query_as("SELECT source, reason, payload FROM audit_dead_letter ORDER BY id")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }
}

pub struct Gateway {
    pub server: Server,
    pub url: String,
}

/// What a client saw: status, the request id the gateway answered with, body.
pub struct Answer {
    pub status: u16,
    pub id: Uuid,
    pub body: Value,
}

pub async fn post(http: &reqwest::Client, gw_url: &str, key: &str, body: Vec<u8>) -> Answer {
    let r = http
        .post(format!("{gw_url}/v1/completions"))
        .bearer_auth(key)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("the gateway answers");
    let status = r.status().as_u16();
    let id = r
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("status {status}: no x-request-id"));
    let text = r.text().await.unwrap();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    Answer { status, id, body }
}

pub fn normal(i: usize) -> Vec<u8> {
    json!({"model": "chat", "prompt": format!("request {i}"), "max_tokens": 2,
           "temperature": 0, "user": format!("user-{}", i % 7)})
    .to_string()
    .into_bytes()
}

pub fn segments(dir: &Path) -> usize {
    spool_segments(dir).len()
}

pub fn percentile(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v.get(((v.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or_default()
}
