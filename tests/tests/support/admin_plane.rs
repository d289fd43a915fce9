//! The admin plane a suite drives: the real `lorafleetctl` binary against
//! two real gateway replicas (sharing real Postgres and Redis) in front of
//! a real worker on the fixture model, with an artifact root of copies.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use lorafleet_tests::{
    Proxy, Server, TestDb, binary, engine_fixtures, gateway_command, login_member_of, migrated_db,
    worker_command,
};
use serde_json::{Value, json};
use uuid::Uuid;

pub const ISSUER: &str = "lorafleet-test";
pub const AUDIENCE: &str = "lorafleet-admin";

/// What one `lorafleetctl` run produced.
#[derive(Debug)]
pub struct Ctl {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Ctl {
    pub fn json(&self) -> Value {
        assert_eq!(self.code, 0, "lorafleetctl failed: {}", self.stderr);
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.stdout))
    }

    /// Asserts the exit code and that the message names `needle`.
    pub fn refused(&self, code: i32, needle: &str) {
        assert_eq!(
            self.code, code,
            "expected exit {code} naming {needle:?}; stdout {} stderr {}",
            self.stdout, self.stderr
        );
        assert!(
            self.stderr.contains(needle),
            "the error should name {needle:?}: {}",
            self.stderr
        );
    }
}

pub struct Plane {
    pub gateways: Vec<Server>,
    /// Redis as every gateway reaches it: a proxy a test can cut.
    pub redis: Proxy,
    pub worker: Server,
    /// Workers beyond the first (see [`plane_with_workers`]).
    pub more_workers: Vec<Server>,
    pub http: reqwest::Client,
    pub root: tempfile::TempDir,
    pub secret: PathBuf,
    pub admin_token: String,
    /// The environment every lorafleetctl run gets (the plane's `Extra`).
    pub env: Vec<(String, String)>,
    pub pool: sqlx::PgPool,
    pub _spools: Vec<tempfile::TempDir>,
    pub _secret_dir: tempfile::TempDir,
    pub _db: TestDb,
}

pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// An artifact root holding copies of fixture adapters and broken ones.
pub fn artifact_root() -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let fixtures = engine_fixtures().join("adapters");
    for a in [
        "llama-gqa/qv-r8",
        "llama-gqa/o-r2",
        "llama-gqa/k-r16",
        "qwen2-tied/qv-r8",
        "qwen3-moe/qv-r8",
        "qwen3-moe/experts-r4",
        "llama32-tied/all-linear-r4",
        "qwen3-yarn/all-linear-r4",
        "phi35-mini/qkv-o-r8",
        "gemma3-1b/all-linear-r4",
        "gemma2-2b/qkvo-r4",
        "dora/llama-gqa/dora-qv-r8",
        "bias/llama-gqa/bias-qv-r8",
        "embedding/llama-gqa/embed-head-rslora",
        "saved/llama-gqa/embed-head-o-r4",
        "saved/llama-gqa/tokens-q-r4",
        "saved/llama-gqa/tool-token-r4",
        "saved/llama-gqa/grown-vocab-r4",
    ] {
        copy_dir(&fixtures.join(a), &root.path().join(a));
    }
    let good = root.path().join("llama-gqa/qv-r8");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(good.join("adapter_config.json")).unwrap())
            .unwrap();
    let variant = |name: &str, edit: &dyn Fn(&mut Value)| {
        let dir = root.path().join("bad").join(name);
        copy_dir(&good, &dir);
        let mut c = config.clone();
        edit(&mut c);
        std::fs::write(dir.join("adapter_config.json"), c.to_string()).unwrap();
    };
    variant("dora", &|c| c["use_dora"] = json!(true));
    variant("no-base", &|c| {
        c.as_object_mut().unwrap().remove("base_model_name_or_path");
    });
    // Claims rank 4 while its tensors have rank 8.
    variant("shape", &|c| c["r"] = json!(4));
    // A saved lm_head with the base's 384 rows, and a tokenizer of its
    // own with a 385th token.
    let grown = root.path().join("bad/tokenizer");
    copy_dir(&fixtures.join("saved/llama-gqa/embed-head-o-r4"), &grown);
    let mut tok: Value = serde_json::from_str(
        &std::fs::read_to_string(engine_fixtures().join("llama-gqa/tokenizer.json")).unwrap(),
    )
    .unwrap();
    tok["added_tokens"]
        .as_array_mut()
        .unwrap()
        .push(json!({"id": 384, "content": "<|tool|>", "special": true}));
    std::fs::write(grown.join("tokenizer.json"), tok.to_string()).unwrap();
    let malformed = root.path().join("bad/malformed");
    copy_dir(&good, &malformed);
    std::fs::write(malformed.join("adapter_config.json"), "{\"r\": 8,").unwrap();
    root
}

pub async fn plane(label: &str) -> Plane {
    plane_with_workers(label, 1).await
}

/// The plane with `workers` workers (ids w0, w1, …) behind both gateways.
pub async fn plane_with_workers(label: &str, workers: usize) -> Plane {
    plane_on(label, workers, "llama-gqa").await
}

/// The plane with its workers on the fixture model `model`.
pub async fn plane_on(label: &str, workers: usize, model: &str) -> Plane {
    plane_sized(label, 2, workers, model).await
}

/// The plane with `gateways` gateway replicas (each told there are that
/// many) and `workers` workers on the fixture model `model`.
pub async fn plane_sized(label: &str, gateways: usize, workers: usize, model: &str) -> Plane {
    plane_with(label, gateways, workers, model, &Extra::default()).await
}

/// What a test adds to every worker and gateway of its plane: environment
/// variables and flags.
#[derive(Debug, Default, Clone)]
pub struct Extra {
    pub env: Vec<(String, String)>,
    pub worker_args: Vec<String>,
    pub gateway_args: Vec<String>,
}

/// [`plane_sized`] with `extra` environment and flags.
pub async fn plane_with(
    label: &str,
    gateways: usize,
    workers: usize,
    model: &str,
    extra: &Extra,
) -> Plane {
    let replicas = gateways.to_string();
    let db = migrated_db(label).await;
    let pool = db.pool().await;
    // The gateways log in with the least privileges: the request path as
    // lorafleet_runtime, the admin API as lorafleet_admin.
    let runtime_url = db.url_as(&login_member_of(&pool, "lorafleet_runtime").await);
    let admin_url = db.url_as(&login_member_of(&pool, "lorafleet_admin").await);
    let root = artifact_root();
    let secret_dir = tempfile::tempdir().unwrap();
    let secret = secret_dir.path().join("admin.secret");
    std::fs::write(&secret, "an-admin-secret-of-at-least-32-bytes-0123456789").unwrap();

    let fixtures = engine_fixtures();
    let mut started: Vec<Server> = (0..workers.max(1))
        .map(|i| {
            let mut cmd = worker_command();
            cmd.args(["--worker-id", &format!("w{i}"), "--max-loras", "2"])
                .arg("--model")
                .arg(fixtures.join(model))
                .arg("--artifact-root")
                .arg(root.path())
                .args(&extra.worker_args)
                .envs(extra.env.iter().cloned());
            Server::start(cmd, "lorafleet-worker listening ")
        })
        .collect();
    let addrs: Vec<String> = started.iter().map(|w| w.addr("grpc").to_owned()).collect();
    let worker = started.remove(0);

    let redis_prefix = format!("test:{}:", Uuid::new_v4());
    let redis = Proxy::start("127.0.0.1:6379");
    let mut started_gateways = Vec::new();
    let mut spools = Vec::new();
    for _ in 0..gateways {
        let spool = tempfile::tempdir().unwrap();
        let mut cmd = gateway_command();
        cmd.args(["--admin-listen", "127.0.0.1:0"])
            .args(["--database-url", &runtime_url])
            .args(["--admin-database-url", &admin_url])
            .args(["--redis-url", &format!("redis://{}", redis.addr)])
            .args(["--redis-prefix", &redis_prefix])
            // Without Redis, each replica keeps its share of every limit.
            .args(["--gateway-replicas", &replicas])
            .args(["--workers", &addrs.join(",")])
            // Long, so that changes must travel by announcement.
            .args(["--registry-refresh-secs", "600"])
            .args(
                if extra.gateway_args.iter().any(|a| a == "--max-lora-rank") {
                    &[][..]
                } else {
                    &["--max-lora-rank", "8"][..]
                },
            )
            // Rollouts in seconds: judged every 200 ms, a leader replaced
            // within 2 s.
            .args(["--rollout-tick-ms", "200", "--rollout-lease-secs", "2"])
            .arg("--admin-jwt-hmac-secret-file")
            .arg(&secret)
            .args(["--admin-jwt-algorithms", "HS256"])
            .args(["--admin-jwt-issuer", ISSUER])
            .args(["--admin-jwt-audience", AUDIENCE])
            .arg("--artifact-root")
            .arg(root.path())
            .arg("--audit-spool")
            .arg(spool.path())
            .args(&extra.gateway_args)
            .envs(extra.env.iter().cloned());
        started_gateways.push(Server::start(cmd, "lorafleet-gateway listening "));
        spools.push(spool);
    }
    let mut p = Plane {
        gateways: started_gateways,
        redis,
        worker,
        more_workers: started,
        http: reqwest::Client::new(),
        root,
        secret,
        admin_token: String::new(),
        env: extra.env.clone(),
        pool,
        _spools: spools,
        _secret_dir: secret_dir,
        _db: db,
    };
    p.admin_token = p.token("alice", "admin");
    p
}

/// Waits until the wall clock is at least 10 s from a minute boundary, so
/// that a per-minute window does not roll over mid-check.
pub async fn away_from_a_minute_boundary() {
    use chrono::Timelike;
    while chrono::Utc::now().second() >= 50 {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `n` completions from `key` sent at once, spread over the gateways, each
/// asking for `max_tokens`; their statuses and bodies.
pub async fn at_once(p: &Plane, key: &str, n: usize, max_tokens: u32) -> Vec<(u16, Value)> {
    at_once_to(p, None, key, n, max_tokens).await
}

/// [`at_once`], all to gateway `replica` when it is given.
pub async fn at_once_to(
    p: &Plane,
    replica: Option<usize>,
    key: &str,
    n: usize,
    max_tokens: u32,
) -> Vec<(u16, Value)> {
    let sends = (0..n).map(|i| {
        let to = replica.unwrap_or(i % p.gateways.len());
        let req = p
            .http
            .post(format!("{}/v1/completions", p.api_url(to)))
            .bearer_auth(key)
            .json(&serde_json::json!({"model": "support", "prompt": "Hello",
                                      "max_tokens": max_tokens, "ignore_eos": true}))
            .send();
        async move {
            let r = req.await.expect("the gateway answers");
            let status = r.status().as_u16();
            (status, r.json().await.unwrap_or(Value::Null))
        }
    });
    futures::future::join_all(sends).await
}

impl Plane {
    pub fn admin_url(&self, replica: usize) -> String {
        format!("http://{}", self.gateways[replica].addr("admin"))
    }

    pub fn api_url(&self, replica: usize) -> String {
        format!("http://{}", self.gateways[replica].addr("http"))
    }

    pub fn token(&self, subject: &str, role: &str) -> String {
        self.token_for(subject, role, 3600)
    }

    /// A token valid for `ttl_secs`.
    pub fn token_for(&self, subject: &str, role: &str, ttl_secs: u64) -> String {
        let ttl = ttl_secs.to_string();
        let out = self.run_as(
            None,
            &[
                "token",
                "--ttl-secs",
                &ttl,
                "--hmac-secret-file",
                self.secret.to_str().unwrap(),
                "--subject",
                subject,
                "--role",
                role,
                "--issuer",
                ISSUER,
                "--audience",
                AUDIENCE,
            ],
        );
        assert_eq!(out.code, 0, "token: {}", out.stderr);
        out.stdout.trim().to_owned()
    }

    pub fn run_as(&self, token: Option<&str>, args: &[&str]) -> Ctl {
        let mut cmd = Command::new(binary("lorafleetctl"));
        cmd.args(args)
            .env_remove("LORAFLEET_ADMIN_TOKEN")
            .env("LORAFLEET_ADMIN_URL", self.admin_url(0))
            .envs(self.env.iter().cloned());
        if let Some(t) = token {
            cmd.env("LORAFLEET_ADMIN_TOKEN", t);
        }
        let out = cmd.output().expect("run lorafleetctl");
        Ctl {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// lorafleetctl as alice, the admin.
    pub fn ctl(&self, args: &[&str]) -> Ctl {
        self.run_as(Some(&self.admin_token), args)
    }

    pub fn ctl_json(&self, args: &[&str]) -> Value {
        let mut a = vec!["--output", "json"];
        a.extend_from_slice(args);
        self.ctl(&a).json()
    }

    pub async fn complete(
        &self,
        replica: usize,
        key: &str,
        model: &str,
        user: &str,
    ) -> (u16, Value) {
        let resp = self
            .http
            .post(format!("{}/v1/completions", self.api_url(replica)))
            .bearer_auth(key)
            .json(&json!({"model": model, "prompt": "Hello", "max_tokens": 2,
                          "temperature": 0, "user": user}))
            .send()
            .await
            .expect("the gateway answers");
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// Waits until `replica` answers `key` on `model` with `want`, and
    /// returns how long that took.
    pub async fn until_status(
        &self,
        replica: usize,
        key: &str,
        model: &str,
        want: u16,
    ) -> Duration {
        let start = Instant::now();
        loop {
            let (status, body) = self.complete(replica, key, model, "probe").await;
            if status == want {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "replica {replica} still answers {status} ({body}), not {want}"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Every audit row of (tenant, model), through `lorafleetctl audit`,
    /// once `want` rows are there.
    pub async fn audit_rows(&self, tenant: &str, model: &str, want: usize) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let body = self.ctl_json(&[
                "audit", "--tenant", tenant, "--model", model, "--all", "--limit", "1000",
            ]);
            let rows = body["rows"].as_array().unwrap().clone();
            if rows.len() >= want {
                return rows;
            }
            assert!(
                Instant::now() < deadline,
                "{} of {want} audit rows",
                rows.len()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The replica whose metrics say it holds the rollout lease, once one
/// does.
pub async fn rollout_leader(p: &Plane) -> usize {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut leaders = Vec::new();
        for (i, g) in p.gateways.iter().enumerate() {
            let m = reqwest::get(format!("http://{}/metrics", g.addr("metrics")))
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            if m.lines().any(|l| l == "lorafleet_gateway_rollout_leader 1") {
                leaders.push(i);
            }
        }
        assert!(leaders.len() <= 1, "two leaders: {leaders:?}");
        if let Some(&l) = leaders.first() {
            return l;
        }
        assert!(Instant::now() < deadline, "no replica leads");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Registers adapter `name` for `tenant` on the fixture base model from
/// the artifact `uri`; its `lora_int_id`.
pub fn register_adapter(p: &Plane, tenant: &str, name: &str, uri: &str) -> i64 {
    p.ctl_json(&[
        "adapters",
        "register",
        name,
        "--tenant",
        tenant,
        "--base-model",
        "llama-gqa",
        "--artifact-uri",
        uri,
    ])["lora_int_id"]
        .as_i64()
        .unwrap()
}

/// Tenant `tenant` with an API key, and the engine fixture `model`
/// registered from its directory as `architecture`. Returns the key and
/// the registered base model.
pub fn tenant_on_fixture_base(
    p: &Plane,
    tenant: &str,
    model: &str,
    architecture: &str,
) -> (String, Value) {
    p.ctl_json(&["tenants", "create", tenant]);
    let key = p.ctl_json(&["keys", "create", tenant])["key"]
        .as_str()
        .unwrap()
        .to_owned();
    let base = p.ctl_json(&[
        "base-models",
        "register",
        model,
        "--architecture",
        architecture,
        "--model-dir",
        engine_fixtures().join(model).to_str().unwrap(),
    ]);
    (key, base)
}

/// Routes `tenant`'s `model` wholly to adapter `id`.
pub fn route_all(p: &Plane, tenant: &str, model: &str, id: i64) {
    p.ctl_json(&[
        "routes",
        "set",
        tenant,
        model,
        "--weights",
        &format!("{id}=10000"),
    ]);
}

/// Tenant acme with a key, the fixture base model, `support` v1 (qv-r8)
/// at 100% and a candidate v2 from `candidate_uri`. Returns (key, v1, v2).
pub fn acme_support(p: &Plane, candidate_uri: &str) -> (String, i64, i64) {
    p.ctl_json(&["tenants", "create", "acme"]);
    let key = p.ctl_json(&["keys", "create", "acme"])["key"]
        .as_str()
        .unwrap()
        .to_owned();
    let llama = lorafleet_tests::engine_fixtures().join("llama-gqa");
    p.ctl_json(&[
        "base-models",
        "register",
        "llama-gqa",
        "--architecture",
        "llama",
        "--model-dir",
        llama.to_str().unwrap(),
    ]);
    let register = |uri: &str| register_adapter(p, "acme", "support", uri);
    let v1 = register("llama-gqa/qv-r8");
    let v2 = register(candidate_uri);
    route_all(p, "acme", "support", v1);
    (key, v1, v2)
}

pub fn fixture_json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(engine_fixtures().join(name)).unwrap()).unwrap()
}

pub fn request_id(completion: &Value) -> String {
    completion["id"]
        .as_str()
        .and_then(|id| id.strip_prefix("cmpl-"))
        .unwrap_or_else(|| panic!("no completion id in {completion}"))
        .to_owned()
}

/// A token's `jti` and `exp`, read from its payload (unverified).
pub fn jti_and_exp(token: &str) -> (String, i64) {
    use base64::Engine as _;
    let payload = token.split('.').nth(1).expect("a JWT");
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload)
        .expect("base64url");
    let claims: Value = serde_json::from_slice(&bytes).unwrap();
    (
        claims["jti"]
            .as_str()
            .expect("lorafleetctl mints a jti")
            .to_owned(),
        claims["exp"].as_i64().unwrap(),
    )
}
