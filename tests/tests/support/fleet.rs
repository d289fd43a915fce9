//! The fleet the gateway suites run against: the real gateway in front of
//! two real workers on the fixture model, with real Postgres and Redis
//! (each behind a proxy a test can cut), seeded with tenants, adapters and
//! routes. Included by each suite with `#[path]`; a suite uses only part
//! of it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use lorafleet_tests::{
    Proxy, Server, TestDb, binary, engine_fixtures, fixture_worker, gateway_command, migrated_db,
};
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

pub const ACME_KEY: &str = "lf_acmekey01.acme-secret-0123456789";
pub const GLOBEX_KEY: &str = "lf_globexkey1.globex-secret-0123456789";
/// A tenant limited to 3 requests per minute.
pub const INITECH_KEY: &str = "lf_initechkey1.initech-secret-0123456789";
pub const HOOLI_KEY: &str = "lf_hoolikey001.hooli-secret-0123456789";
pub const MAX_TOKENS: usize = 12;

pub fn fixture_json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(engine_fixtures().join(name)).unwrap()).unwrap()
}

pub fn base_hash(model: &str) -> String {
    fixture_json("base_hashes.json")[model]
        .as_str()
        .unwrap()
        .to_owned()
}

pub fn digest(uri: &str) -> String {
    fixture_json("artifact_digests.json")[uri]
        .as_str()
        .unwrap()
        .to_owned()
}

pub struct Seeded {
    /// adapter fixture name -> lora_int_id
    pub adapters: HashMap<&'static str, i64>,
    pub acme: Uuid,
    pub llama: i64,
}

pub async fn seed(pool: &PgPool) -> Seeded {
    let tenant = |name: &'static str| async move {
        sqlx::query_scalar::<_, Uuid>("INSERT INTO tenants (name) VALUES ($1) RETURNING id")
            .bind(name)
            .fetch_one(pool)
            .await
            .unwrap()
    };
    let acme = tenant("acme").await;
    let globex = tenant("globex").await;
    let initech = tenant("initech").await;
    sqlx::query("UPDATE tenants SET rpm_limit = 3 WHERE id = $1")
        .bind(initech)
        .execute(pool)
        .await
        .unwrap();
    let hooli = tenant("hooli").await;
    sqlx::query("UPDATE tenants SET tpm_limit = 20 WHERE id = $1")
        .bind(hooli)
        .execute(pool)
        .await
        .unwrap();
    for (t, key) in [
        (acme, ACME_KEY),
        (globex, GLOBEX_KEY),
        (initech, INITECH_KEY),
        (hooli, HOOLI_KEY),
    ] {
        let (prefix, secret) = key.split_once('.').unwrap();
        sqlx::query(
            "INSERT INTO api_keys (tenant_id, prefix, secret_hash, scopes)
             VALUES ($1, $2, sha256(convert_to($3, 'UTF8')), ARRAY['inference', 'models:read'])",
        )
        .bind(t)
        .bind(prefix)
        .bind(secret)
        .execute(pool)
        .await
        .unwrap();
    }
    let base = |name: &'static str, arch: &'static str| async move {
        sqlx::query_scalar::<_, i64>(
            "INSERT INTO base_models (name, base_hash, architecture) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(name)
        .bind(base_hash(name))
        .bind(arch)
        .fetch_one(pool)
        .await
        .unwrap()
    };
    let llama = base("llama-gqa", "llama").await;
    let qwen = base("qwen2-tied", "qwen2").await;
    let mut adapters = HashMap::new();
    for (name, base_id, model, tenant) in [
        ("qv-r8", llama, "llama-gqa", acme),
        ("patterns", llama, "llama-gqa", acme),
        ("layer1-mlp", llama, "llama-gqa", globex),
        ("all-linear-r4", qwen, "qwen2-tied", acme),
    ] {
        let uri = format!("{model}/{name}");
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO adapters (name, version, base_model_id, tenant_id, rank, alpha,
                                   target_modules, artifact_uri, artifact_sha256)
             VALUES ($1, 1, $2, $3, 16, 16, ARRAY['q_proj', 'v_proj'], $4, $5)
             RETURNING lora_int_id",
        )
        .bind(name)
        .bind(base_id)
        .bind(tenant)
        .bind(&uri)
        .bind(digest(&uri))
        .fetch_one(pool)
        .await
        .unwrap();
        adapters.insert(name, id);
    }
    let a = |n: &str| adapters[n];
    route(pool, acme, "support", llama, &[(a("qv-r8"), 10_000)]).await;
    route(pool, acme, "base-llama", llama, &[]).await;
    route(
        pool,
        acme,
        "canary",
        llama,
        &[(a("qv-r8"), 7_000), (a("patterns"), 3_000)],
    )
    .await;
    route(
        pool,
        acme,
        "qwen-helper",
        qwen,
        &[(a("all-linear-r4"), 10_000)],
    )
    .await;
    route(pool, globex, "secret", llama, &[(a("layer1-mlp"), 10_000)]).await;
    route(pool, initech, "base", llama, &[]).await;
    route(pool, hooli, "base", llama, &[]).await;
    Seeded {
        adapters,
        acme,
        llama,
    }
}

/// A route at revision 1; no weights means the base model.
pub async fn route(pool: &PgPool, tenant: Uuid, model: &str, base: i64, weights: &[(i64, i32)]) {
    let mut tx = pool.begin().await.unwrap();
    let id: Uuid = sqlx::query_scalar(
        "INSERT INTO routes (tenant_id, model_name, current_revision) VALUES ($1, $2, 1) RETURNING id",
    )
    .bind(tenant)
    .bind(model)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO route_revisions (route_id, revision, base_model_id, target)
         VALUES ($1, 1, $2, $3::route_target)",
    )
    .bind(id)
    .bind(base)
    .bind(if weights.is_empty() {
        "base"
    } else {
        "adapters"
    })
    .execute(&mut *tx)
    .await
    .unwrap();
    for (lora, bp) in weights {
        sqlx::query(
            "INSERT INTO route_weights (route_id, revision, base_model_id, lora_int_id, weight_bp)
             VALUES ($1, 1, $2, $3, $4)",
        )
        .bind(id)
        .bind(base)
        .bind(lora)
        .bind(bp)
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
}

pub fn worker(id: &str) -> Server {
    fixture_worker(id, &["--max-loras", "2"])
}

pub struct Fleet {
    pub pool: PgPool,
    pub pg: Proxy,
    pub redis: Proxy,
    pub workers: Vec<Server>,
    pub gateway: Server,
    pub http: reqwest::Client,
    pub base_url: String,
    pub spool: tempfile::TempDir,
    pub seeded: Seeded,
    pub redis_prefix: String,
    /// The last field, so dropped last: the database outlives the processes
    /// using it.
    pub _db: TestDb,
}

pub async fn fleet(label: &str) -> Fleet {
    fleet_with(label, &[]).await
}

/// [`fleet`] with `extra` gateway flags.
pub async fn fleet_with(label: &str, extra: &[&str]) -> Fleet {
    let db = migrated_db(label).await;
    let pool = db.pool().await;
    let seeded = seed(&pool).await;
    let pg = Proxy::start("127.0.0.1:5432");
    let redis = Proxy::start("127.0.0.1:6379");
    let workers = vec![worker("w0"), worker("w1")];
    let spool = tempfile::tempdir().unwrap();
    let redis_prefix = format!("test:{}:", Uuid::new_v4());
    let addrs: Vec<&str> = workers.iter().map(|w| w.addr("grpc")).collect();
    let mut cmd = gateway_command();
    cmd.args([
        "--database-url",
        &format!("postgres://postgres@{}/{}", pg.addr, db.name()),
    ])
    .args(["--redis-url", &format!("redis://{}", redis.addr)])
    .args(["--redis-prefix", &format!("test:{}:", Uuid::new_v4())])
    .args(["--workers", &addrs.join(",")])
    .args(["--registry-refresh-secs", "1"])
    .args(["--first-token-timeout-secs", "5"])
    .args(extra)
    .arg("--audit-spool")
    .arg(spool.path());
    let gateway = Server::start(cmd, "lorafleet-gateway listening ");
    let base_url = format!("http://{}", gateway.addr("http"));
    let http = reqwest::Client::new();
    // Ready once both workers have reported.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = http
            .get(format!("http://{}/readyz", gateway.addr("metrics")))
            .send()
            .await;
        if let Ok(r) = r
            && r.status() == 200
            && r.text().await.unwrap().contains("2 workers up")
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the gateway never saw both workers: {}",
            gateway.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Fleet {
        pool,
        pg,
        redis,
        workers,
        gateway,
        http,
        base_url,
        spool,
        seeded,
        redis_prefix,
        _db: db,
    }
}

impl Fleet {
    pub async fn post(&self, path: &str, key: Option<&str>, body: Value) -> (u16, Value) {
        let mut r = self
            .http
            .post(format!("{}{path}", self.base_url))
            .json(&body);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        let resp = r.send().await.expect("the gateway answers");
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        // Every error a tenant sees in these tests is checked for what
        // belongs in the logs only.
        if status >= 400 && key.is_some() {
            lorafleet_tests::assert_tenant_safe(&text);
        }
        let v = match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(_) => Value::String(text),
        };
        // And every field it names is one the client sent.
        if status >= 400 {
            lorafleet_tests::assert_client_param(&body, &v);
        }
        (status, v)
    }

    /// A streamed request's whole SSE body, as acme.
    pub async fn stream(&self, path: &str, body: &Value) -> String {
        let mut body = body.clone();
        body["stream"] = true.into();
        self.http
            .post(format!("{}{path}", self.base_url))
            .bearer_auth(ACME_KEY)
            .json(&body)
            .send()
            .await
            .expect("the gateway answers")
            .text()
            .await
            .expect("a whole body")
    }

    pub async fn complete(&self, model: &str, prompt: &str, user: Option<&str>) -> (u16, Value) {
        let mut body = json!({
            "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0
        });
        if let Some(u) = user {
            body["user"] = u.into();
        }
        self.post("/v1/completions", Some(ACME_KEY), body).await
    }

    /// The gateway's metrics, as Prometheus scrapes them.
    pub async fn gateway_metrics(&self) -> String {
        self.http
            .get(format!("http://{}/metrics", self.gateway.addr("metrics")))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// The requests the audit log records: one a row, except the rows of
    /// failed authentications, which count theirs.
    pub async fn audit_count(&self) -> i64 {
        sqlx::query_scalar("SELECT coalesce(sum(occurrences), 0)::int8 FROM audit_log")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub async fn wait_audit(&self, want: i64) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let n = self.audit_count().await;
            if n >= want {
                assert_eq!(n, want, "no duplicate audit rows");
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{n} of {want} audit rows arrived: {}",
                self.gateway.log_text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The engine's offline `generate` output (text) for each (prompt, adapter).
pub fn offline(cases: &[(&str, Option<&str>)]) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let output = dir.path().join("out.jsonl");
    let lines: Vec<String> = cases
        .iter()
        .map(|(p, a)| {
            json!({"prompt": p, "lora": a, "max_tokens": MAX_TOKENS, "temperature": 0}).to_string()
        })
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let adapters = engine_fixtures().join("adapters/llama-gqa");
    let out = Command::new(binary("lorafleet-worker"))
        .args(["generate", "--max-loras", "2"])
        .arg("--model")
        .arg(engine_fixtures().join("llama-gqa"))
        .args(["qv-r8", "patterns", "layer1-mlp"].iter().flat_map(|n| {
            [
                "--lora".to_owned(),
                format!("{n}={}", adapters.join(n).display()),
            ]
        }))
        .arg("--input")
        .arg(&input)
        .arg("--output")
        .arg(&output)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["text"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect()
}

pub fn text(v: &Value) -> &str {
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"))
}

/// The value of one series (its name and labels, exactly) in `metrics`.
pub fn metric(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no {series} in {metrics}"))
}
