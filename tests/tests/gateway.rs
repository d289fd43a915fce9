//! The real gateway in front of two real workers on the fixture model, with
//! real Postgres and Redis (each behind a proxy the test can cut).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use lorafleet_tests::{
    Proxy, Server, TestDb, binary, engine_fixtures, fixture_worker, gateway_command, migrated_db,
    signal, spool_segments,
};
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

const ACME_KEY: &str = "lf_acmekey01.acme-secret-0123456789";
const GLOBEX_KEY: &str = "lf_globexkey1.globex-secret-0123456789";
/// A tenant limited to 3 requests per minute.
const INITECH_KEY: &str = "lf_initechkey1.initech-secret-0123456789";
const HOOLI_KEY: &str = "lf_hoolikey001.hooli-secret-0123456789";
const MAX_TOKENS: usize = 12;

fn fixture_json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(engine_fixtures().join(name)).unwrap()).unwrap()
}

fn base_hash(model: &str) -> String {
    fixture_json("base_hashes.json")[model]
        .as_str()
        .unwrap()
        .to_owned()
}

fn digest(uri: &str) -> String {
    fixture_json("artifact_digests.json")[uri]
        .as_str()
        .unwrap()
        .to_owned()
}

struct Seeded {
    /// adapter fixture name -> lora_int_id
    adapters: HashMap<&'static str, i64>,
    acme: Uuid,
    llama: i64,
}

async fn seed(pool: &PgPool) -> Seeded {
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
async fn route(pool: &PgPool, tenant: Uuid, model: &str, base: i64, weights: &[(i64, i32)]) {
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

fn worker(id: &str) -> Server {
    fixture_worker(id, &["--max-loras", "2"])
}

struct Fleet {
    pool: PgPool,
    pg: Proxy,
    redis: Proxy,
    workers: Vec<Server>,
    gateway: Server,
    http: reqwest::Client,
    base_url: String,
    spool: tempfile::TempDir,
    seeded: Seeded,
    redis_prefix: String,
    /// The last field, so dropped last: the database outlives the processes
    /// using it.
    _db: TestDb,
}

async fn fleet(label: &str) -> Fleet {
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
    .arg("--audit-spool")
    .arg(spool.path());
    let gateway = Server::start(cmd, "lorafleet-gateway listening ");
    let base_url = format!("http://{}", gateway.addr("http"));
    let http = reqwest::Client::new();
    // Ready once both workers have reported.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = http.get(format!("{base_url}/readyz")).send().await;
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
    async fn post(&self, path: &str, key: Option<&str>, body: Value) -> (u16, Value) {
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
        (status, v)
    }

    async fn complete(&self, model: &str, prompt: &str, user: Option<&str>) -> (u16, Value) {
        let mut body = json!({
            "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0
        });
        if let Some(u) = user {
            body["user"] = u.into();
        }
        self.post("/v1/completions", Some(ACME_KEY), body).await
    }

    async fn audit_count(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM audit_log")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn wait_audit(&self, want: i64) {
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
fn offline(cases: &[(&str, Option<&str>)]) -> Vec<String> {
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

fn text(v: &Value) -> &str {
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"))
}

#[tokio::test]
async fn tenants_get_exactly_their_adapter_and_nothing_else() {
    let f = fleet("gateway_exact").await;
    let prompts = ["The quick brown fox", "Once upon a time"];
    let want = offline(&[
        (prompts[0], Some("qv-r8")),
        (prompts[1], Some("qv-r8")),
        (prompts[0], None),
        (prompts[1], Some("patterns")),
    ]);

    // A named model applies exactly its adapter; the base route gets the base.
    let mut calls = Vec::new();
    for (model, prompt) in [
        ("support", prompts[0]),
        ("support", prompts[1]),
        ("base-llama", prompts[0]),
    ] {
        calls.push(f.complete(model, prompt, None));
    }
    let results = futures::future::join_all(calls).await;
    for (i, (status, v)) in results.iter().enumerate() {
        assert_eq!(*status, 200, "{v}");
        assert_eq!(text(v), want[i], "case {i}: {v}");
        assert_eq!(v["object"], "text_completion");
        assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    }
    assert_ne!(want[0], want[2], "the adapter changes the output");

    // Unknown model and another tenant's model: the same 404.
    let (s1, unknown) = f.complete("nope", prompts[0], None).await;
    let (s2, foreign) = f.complete("secret", prompts[0], None).await;
    assert_eq!((s1, s2), (404, 404));
    assert_eq!(unknown["error"]["code"], "model_not_found");
    assert_eq!(
        foreign["error"]["message"]
            .as_str()
            .unwrap()
            .replace("secret", "nope"),
        unknown["error"]["message"].as_str().unwrap()
    );
    // Its owner reaches it.
    let (s, v) = f
        .post(
            "/v1/completions",
            Some(GLOBEX_KEY),
            json!({"model": "secret", "prompt": prompts[0], "max_tokens": 2}),
        )
        .await;
    assert_eq!(s, 200, "{v}");

    // A base-hash mismatch (no worker serves qwen2-tied) is an error, never
    // the base model's output.
    let (s, v) = f.complete("qwen-helper", prompts[0], None).await;
    assert_eq!(s, 503, "{v}");
    assert_eq!(v["error"]["code"], "no_compatible_worker");
    assert!(v.get("choices").is_none());

    // Credentials.
    let (s, v) = f
        .post(
            "/v1/completions",
            None,
            json!({"model": "support", "prompt": "x"}),
        )
        .await;
    assert_eq!(s, 401, "{v}");
    for bad in [
        "lf_acmekey01.wrong",
        "lf_nokey12345.x",
        "eyJhbGciOiJIUzI1NiJ9.e30.x",
    ] {
        let (s, v) = f
            .post(
                "/v1/completions",
                Some(bad),
                json!({"model": "support", "prompt": "x"}),
            )
            .await;
        assert_eq!(s, 401, "{bad}: {v}");
        assert_eq!(v["error"]["type"], "authentication_error");
    }
    // Bad bodies name the field.
    let (s, v) = f
        .post(
            "/v1/completions",
            Some(ACME_KEY),
            json!({"model": "support", "prompt": "x", "max_tokens": "many"}),
        )
        .await;
    assert_eq!(
        (s, v["error"]["param"].as_str()),
        (400, Some("max_tokens")),
        "{v}"
    );

    // /v1/models lists only the caller's routes.
    let models = |key: &'static str| {
        let http = f.http.clone();
        let url = format!("{}/v1/models", f.base_url);
        async move {
            let v: Value = http
                .get(url)
                .bearer_auth(key)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            v["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["id"].as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(
        models(ACME_KEY).await,
        ["base-llama", "canary", "qwen-helper", "support"]
    );
    assert_eq!(models(GLOBEX_KEY).await, ["secret"]);

    // Streaming chat with usage: role first, content deltas, finish, usage, [DONE].
    let resp = f
        .http
        .post(format!("{}/v1/chat/completions", f.base_url))
        .bearer_auth(ACME_KEY)
        .json(&json!({
            "model": "support", "stream": true, "stream_options": {"include_usage": true},
            "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello there"}]
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let body = resp.text().await.unwrap();
    let events: Vec<&str> = body
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert_eq!(*events.last().unwrap(), "[DONE]", "{body}");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage = &chunks.last().unwrap()["usage"];
    assert!(
        chunks.last().unwrap()["choices"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    let finish = &chunks[chunks.len() - 2]["choices"][0]["finish_reason"];
    assert!(finish == "stop" || finish == "length", "{body}");
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );

    // A registry change announced on Redis reaches the snapshot.
    route(&f.pool, f.seeded.acme, "late", f.seeded.llama, &[]).await;
    let mut redis = redis::Client::open("redis://127.0.0.1:6379")
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let _: i64 = redis::cmd("PUBLISH")
            .arg(format!("{}registry", f.redis_prefix))
            .arg("changed")
            .query_async(&mut redis)
            .await
            .unwrap();
        if models(ACME_KEY).await.contains(&"late".to_owned()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the announced route never appeared"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Per-tenant rate limit: 3 a minute, then 429 with Retry-After. The
    // windows are calendar minutes: start well inside one.
    let second = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        % 60;
    if second >= 55 {
        tokio::time::sleep(Duration::from_secs(61 - second)).await;
    }
    let mut statuses = Vec::new();
    let mut retry_after = None;
    for _ in 0..4 {
        let r = f
            .http
            .post(format!("{}/v1/completions", f.base_url))
            .bearer_auth(INITECH_KEY)
            .json(&json!({"model": "base", "prompt": "x", "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        statuses.push(r.status().as_u16());
        if let Some(v) = r.headers().get("retry-after") {
            retry_after = Some(v.to_str().unwrap().parse::<u64>().unwrap());
        }
    }
    assert_eq!(statuses, [200, 200, 200, 429]);
    assert!(
        retry_after.is_some_and(|s| (1..=60).contains(&s)),
        "{retry_after:?}"
    );

    // Tokens per minute (20 for hooli): each finished completion's tokens
    // are charged to the minute just after its response, and once the
    // minute's total reaches the limit requests get 429 naming the token
    // limit. Never before the total reaches it; soon after it does.
    let mut charged = 0;
    let mut reached_at = None;
    let mut token_limited_requests = 1; // the refused one
    let refused = loop {
        let r = f
            .http
            .post(format!("{}/v1/completions", f.base_url))
            .bearer_auth(HOOLI_KEY)
            .json(&json!({"model": "base", "prompt": "x", "max_tokens": 8}))
            .send()
            .await
            .unwrap();
        if r.status() == 429 {
            break r;
        }
        assert_eq!(r.status(), 200);
        token_limited_requests += 1;
        charged += r.json::<Value>().await.unwrap()["usage"]["total_tokens"]
            .as_u64()
            .unwrap();
        if charged >= 20 && reached_at.is_none() {
            reached_at = Some(Instant::now());
        }
        assert!(
            reached_at.is_none_or(|t| t.elapsed() < Duration::from_secs(5)),
            "tokens per minute not enforced 5 s after {charged} tokens"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(charged >= 20, "refused after only {charged} tokens");
    assert!(refused.headers().contains_key("retry-after"));
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tokens per minute"),
        "{body}"
    );

    // The caller's trace reaches the worker.
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let r = f
        .http
        .post(format!("{}/v1/completions", f.base_url))
        .bearer_auth(ACME_KEY)
        .header("traceparent", format!("00-{trace_id}-b7ad6b7169203331-01"))
        .json(&json!({"model": "support", "prompt": "traced", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f.workers.iter().any(|w| {
        w.log_text()
            .lines()
            .any(|l| l.contains("\"accepted\"") && l.contains(trace_id))
    }) {
        assert!(
            Instant::now() < deadline,
            "no worker logged the caller's trace id"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Canary: a user stays on one version; the split follows the weights.
    let mut first: BTreeMap<String, String> = BTreeMap::new();
    let mut requests = Vec::new();
    for round in 0..2 {
        let mut calls = Vec::new();
        for u in 0..60 {
            let user = format!("user-{u}");
            let body = json!({"model": "canary", "prompt": "Hi", "max_tokens": 1, "user": user});
            let f = &f;
            calls
                .push(async move { (user, f.post("/v1/completions", Some(ACME_KEY), body).await) });
        }
        for (user, (s, v)) in futures::future::join_all(calls).await {
            assert_eq!(s, 200, "{v}");
            let id = v["id"]
                .as_str()
                .unwrap()
                .trim_start_matches("cmpl-")
                .to_owned();
            requests.push((round, user.clone(), id.clone()));
            if round == 0 {
                first.insert(user, id);
            }
        }
    }
    // 3 ok, 2 404s, 1 globex, 1 503, 4 401s, 1 400, 1 chat, 4 limited,
    // the token-limited ones, 1 traced, 120 canary.
    let total = 3 + 2 + 1 + 1 + 4 + 1 + 1 + 4 + token_limited_requests + 1 + 120;
    f.wait_audit(total).await;
    let rows: Vec<(Uuid, Option<i64>)> = sqlx::query_as(
        "SELECT request_id, lora_int_id FROM audit_log WHERE model_name = 'canary' AND status = 'ok'",
    )
    .fetch_all(&f.pool)
    .await
    .unwrap();
    let by_id: HashMap<String, i64> = rows
        .into_iter()
        .map(|(id, l)| (id.to_string(), l.unwrap()))
        .collect();
    let mut per_user: HashMap<String, Vec<i64>> = HashMap::new();
    for (_, user, id) in &requests {
        per_user.entry(user.clone()).or_default().push(by_id[id]);
    }
    for (user, versions) in &per_user {
        assert_eq!(versions[0], versions[1], "{user} changed version");
    }
    let patterns = per_user
        .values()
        .filter(|v| v[0] == f.seeded.adapters["patterns"])
        .count();
    // 30% of 60 users, with room for chance (binomial sd ~3.5).
    assert!(
        (6..=30).contains(&patterns),
        "{patterns} of 60 users on the 30% version"
    );

    // Audit rows say who went where.
    let (worker, adapter, residency): (Option<String>, Option<String>, Option<String>) =
        sqlx::query_as(
            "SELECT worker_id, adapter_name, adapter_residency FROM audit_log
             WHERE model_name = 'support' AND status = 'ok' LIMIT 1",
        )
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert!(matches!(worker.as_deref(), Some("w0" | "w1")));
    assert_eq!(adapter.as_deref(), Some("qv-r8"));
    assert!(residency.is_some());
    let rejected: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_log WHERE status = 'rejected' AND http_status = 404",
    )
    .fetch_one(&f.pool)
    .await
    .unwrap();
    assert_eq!(rejected, 2);

    // Per-tenant, per-adapter metrics, and the residency hit rate at routing.
    let metrics = f
        .http
        .get(format!("http://{}/metrics", f.gateway.addr("metrics")))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let value = |series: &str| -> f64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
            .unwrap_or_else(|| panic!("no {series} in {metrics}"))
    };
    assert!(
        value(r#"lorafleet_gateway_requests_total{tenant="acme",adapter="qv-r8@1",status="ok"}"#)
            >= 3.0
    );
    assert!(
        value(r#"lorafleet_gateway_requests_total{tenant="initech",adapter="base",status="ok"}"#)
            >= 3.0
    );
    assert!(metrics.contains(
        "lorafleet_gateway_residency_checks_total{tenant=\"acme\",adapter=\"qv-r8@1\",hit="
    ));
    assert!(
        metrics.contains("lorafleet_gateway_time_to_first_token_seconds_count{tenant=\"acme\"")
    );
}

/// Rows in the spool: lines of every segment under the spool directory.
fn spool_lines(dir: &Path) -> usize {
    spool_segments(dir)
        .iter()
        .map(|p| {
            std::fs::read_to_string(p).map_or(0, |s| s.lines().filter(|l| !l.is_empty()).count())
        })
        .sum()
}

#[tokio::test]
async fn the_gateway_rides_out_a_dead_worker_and_redis_and_postgres_outages() {
    let mut f = fleet("gateway_outages").await;
    let mut sent = 0;
    let ok = |(s, v): (u16, Value)| {
        assert_eq!(s, 200, "{v}");
    };
    for i in 0..4 {
        ok(f.complete("support", &format!("warm {i}"), None).await);
        sent += 1;
    }

    // A worker dies: requests that have not started streaming still succeed.
    let mut dead = f.workers.remove(0);
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();
    for i in 0..10 {
        ok(f.complete(
            if i % 2 == 0 { "support" } else { "canary" },
            "after the kill",
            None,
        )
        .await);
        sent += 1;
    }

    // Redis goes away: rate limits fall back to this replica; serving goes on.
    f.redis.cut();
    for _ in 0..5 {
        ok(f.complete("support", "no redis", None).await);
        sent += 1;
    }
    f.redis.restore();
    f.wait_audit(sent).await;

    // Postgres goes away: the snapshot serves, audit rows go to the spool.
    f.pg.cut();
    for _ in 0..8 {
        ok(f.complete("support", "no postgres", None).await);
        sent += 1;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while spool_lines(f.spool.path()) < 8 {
        assert!(
            Instant::now() < deadline,
            "{} rows spooled: {}",
            spool_lines(f.spool.path()),
            f.gateway.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    f.pg.restore();
    // Replayed with none lost and none doubled.
    f.wait_audit(sent).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !spool_segments(f.spool.path()).is_empty() {
        assert!(Instant::now() < deadline, "the spool was never cleared");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Graceful shutdown loses nothing either.
    let mut calls = Vec::new();
    for _ in 0..3 {
        calls.push(f.complete("support", "last ones", None));
    }
    for r in futures::future::join_all(calls).await {
        ok(r);
        sent += 1;
    }
    let pid = f.gateway.child.id();
    signal(pid, "TERM");
    let exit = f.gateway.child.wait().unwrap();
    assert!(exit.success(), "{exit}: {}", f.gateway.log_text());
    assert_eq!(f.audit_count().await, sent);
}

/// A worker that takes the request and never answers is skipped at the
/// first-token deadline: the request moves to the other worker, and its row
/// says so.
/// A worker's refusal reaches the tenant as a stable reason code: never the
/// worker's own words, which may name fields, URIs or digests of the
/// operator's files (those go to the gateway's log).
#[tokio::test]
async fn a_worker_refusal_reaches_the_tenant_as_a_reason_code() {
    let f = fleet("gateway_refusal").await;
    // An adapter registered with a digest its files do not have.
    let uri = "llama-gqa/o-r2";
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO adapters (name, version, base_model_id, tenant_id, rank, alpha,
                               target_modules, artifact_uri, artifact_sha256)
         VALUES ('tampered', 1, $1, $2, 2, 4, ARRAY['o_proj'], $3, $4)
         RETURNING lora_int_id",
    )
    .bind(f.seeded.llama)
    .bind(f.seeded.acme)
    .bind(uri)
    .bind("ab".repeat(32))
    .fetch_one(&f.pool)
    .await
    .unwrap();
    route(
        &f.pool,
        f.seeded.acme,
        "tampered",
        f.seeded.llama,
        &[(id, 10_000)],
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(15);
    let (status, body) = loop {
        let (s, v) = f.complete("tampered", "hello", None).await;
        // 404 until the gateway's registry refresh sees the new route.
        if s != 404 || Instant::now() > deadline {
            break (s, v);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(status, 503, "{body}");
    let error = &body["error"];
    assert_eq!(error["code"], "adapter_unavailable", "{body}");
    let message = error["message"].as_str().unwrap();
    assert!(message.contains("artifact_digest_mismatch"), "{message}");
    for leak in [uri, "adapter.artifact_sha256", "abab", "registered digest"] {
        assert!(!message.contains(leak), "{leak:?} in {message}");
    }
    assert!(
        f.gateway
            .log_text()
            .contains("the worker could not use the adapter"),
        "the worker's words are in the gateway's log"
    );
}

#[tokio::test]
async fn a_worker_that_never_answers_is_skipped_at_the_first_token_deadline() {
    let f = fleet("gateway_first_token").await;
    let (s, v) = f.complete("support", "warm", None).await;
    assert_eq!(s, 200, "{v}");
    f.wait_audit(1).await;
    let served: String = sqlx::query_scalar("SELECT worker_id FROM audit_log")
        .fetch_one(&f.pool)
        .await
        .unwrap();
    let stuck = if served == "w0" { 0 } else { 1 };
    let pid = f.workers[stuck].child.id();
    signal(pid, "STOP");
    let started = Instant::now();
    let answer = f.complete("support", "a stuck worker", None).await;
    let took = started.elapsed();
    signal(pid, "CONT");
    assert_eq!(answer.0, 200, "{}", answer.1);
    assert!(
        took >= Duration::from_secs(5),
        "{took:?}: before the deadline"
    );
    f.wait_audit(2).await;
    let (attempts, worker): (i16, String) = sqlx::query_as(
        "SELECT attempts, worker_id FROM audit_log ORDER BY received_at DESC LIMIT 1",
    )
    .fetch_one(&f.pool)
    .await
    .unwrap();
    assert_eq!(attempts, 2, "the stuck worker, then the other");
    assert_ne!(worker, served);
}

#[test]
fn serve_refuses_bad_flags_by_name() {
    let cases: &[(&[&str], &str)] = &[
        (&["--workers", ""], "--workers: \"\" is not HOST:PORT"),
        (
            &["--workers", "nohost"],
            "--workers: \"nohost\" is not HOST:PORT",
        ),
        (
            &["--workers-dns", "workers:50051"],
            "--workers and --workers-dns: give one, not both",
        ),
        (
            &["--load-factor", "0.5"],
            "--load-factor: 0.5 must be at least 1.0",
        ),
        (
            &["--replica-share", "0"],
            "--replica-share: 0 must be at least 1",
        ),
        (
            &["--max-attempts", "0"],
            "--max-attempts: must be at least 1",
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
            &["--jwt-algorithms", "HS256"],
            "--jwt-algorithms: set --jwt-hmac-secret-file or --jwt-public-key-file too",
        ),
        (
            &["--database-url", "mysql://db/x"],
            "--database-url: must start with postgres://",
        ),
        (&["--load-factor", "lots"], "--load-factor"),
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
        (&["--default-tpm-limit", "lots"], "--default-tpm-limit"),
    ];
    for (flags, expected) in cases {
        let out = Command::new(binary("lorafleet-gateway"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
            ])
            // Defaults through the environment, so a case can override them by flag.
            .env("LORAFLEET_INSECURE_PLAINTEXT", "true")
            .env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/unused")
            .env("LORAFLEET_WORKERS", "127.0.0.1:1")
            .args(flags.iter())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?}");
        assert!(
            stderr.contains(expected),
            "{flags:?}: expected {expected:?} in {stderr}"
        );
    }
    // Logging settings are checked the same way, by variable.
    for (var, value, expected) in [
        (
            "LORAFLEET_LOG_FORMAT",
            "yaml",
            "LORAFLEET_LOG_FORMAT: \"yaml\" is not",
        ),
        ("RUST_LOG", "info,[", "RUST_LOG: \"info,[\" is not a filter"),
    ] {
        let out = Command::new(binary("lorafleet-gateway"))
            .args(["serve", "--workers", "127.0.0.1:1", "--insecure-plaintext"])
            .args([
                "--database-url",
                "postgres://postgres@127.0.0.1:5432/unused",
            ])
            .env(var, value)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(expected),
            "{var}: {stderr}"
        );
    }
}
