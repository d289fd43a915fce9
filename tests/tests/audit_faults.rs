//! The audit fault suite: real gateway and worker processes, real Postgres
//! (behind a proxy the test cuts), and an exact count at the end: the set of
//! request ids answered to clients against the rows in `audit_log`.
//!
//! Every scenario interleaves traffic from two tenants. The gateways log in
//! as a member of `lorafleet_runtime`, so the suite also proves that the
//! least-privileged role is enough to serve.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use lorafleet_tests::{
    Proxy, Server, TestDb, files_under, fixture_worker, gateway_command, login_member_of,
    migrated_db, rss_kib, seed_base_routes, signal, spool_segments,
};
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

const ACME_KEY: &str = "lf_acmeaudit1.acme-secret-0123456789";
const GLOBEX_KEY: &str = "lf_globexaud1.globex-secret-0123456789";
const KEYS: [&str; 2] = [ACME_KEY, GLOBEX_KEY];

/// Two tenants, each with a key and a base-model route `chat`.
async fn seed(pool: &PgPool) {
    seed_base_routes(pool, &[("acme", ACME_KEY), ("globex", GLOBEX_KEY)], "chat").await;
}

/// A login role that is a member of `lorafleet_runtime` and nothing else.
async fn runtime_user(pool: &PgPool) -> String {
    login_member_of(pool, "lorafleet_runtime").await
}

struct Env {
    pool: PgPool,
    pg: Proxy,
    user: String,
    db_name: String,
    worker: Server,
    spool: tempfile::TempDir,
    http: reqwest::Client,
    _db: TestDb,
}

async fn env(label: &str) -> Env {
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
    async fn gateway(&self, extra: &[&str]) -> Gateway {
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

    async fn rows(&self) -> Vec<(Uuid, String, i16, Option<String>)> {
        sqlx::query_as("SELECT request_id, status::text, http_status, error_code FROM audit_log")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    /// Waits until every answered request has its row, then checks: none
    /// doubled, and none unknown.
    async fn expect_rows(&self, answered: &HashSet<Uuid>, gw: &Gateway) {
        self.expect_rows_of(answered, gw, false).await;
    }

    /// As [`Env::expect_rows`]; `extra_allowed` lets rows of requests whose
    /// answer never reached the client (a killed process) be there too.
    async fn expect_rows_of(&self, answered: &HashSet<Uuid>, gw: &Gateway, extra_allowed: bool) {
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

    async fn dead_letters(&self) -> Vec<(String, String, Vec<u8>)> {
        sqlx::query_as("SELECT source, reason, payload FROM audit_dead_letter ORDER BY id")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }
}

struct Gateway {
    server: Server,
    url: String,
}

/// What a client saw: status, the request id the gateway answered with, body.
struct Answer {
    status: u16,
    id: Uuid,
    body: Value,
}

async fn post(http: &reqwest::Client, gw_url: &str, key: &str, body: Vec<u8>) -> Answer {
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

fn normal(i: usize) -> Vec<u8> {
    json!({"model": "chat", "prompt": format!("request {i}"), "max_tokens": 2,
           "temperature": 0, "user": format!("user-{}", i % 7)})
    .to_string()
    .into_bytes()
}

fn segments(dir: &Path) -> usize {
    spool_segments(dir).len()
}

fn percentile(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v.get(((v.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_is_refused_by_field_and_never_blocks_good_rows() {
    let e = env("audit_poison").await;
    let gw = e.gateway(&["--max-body-bytes", "4194304"]).await;
    let mib = "a".repeat(1 << 20);
    // (raw body, the field the 400 must name)
    let poisons: Vec<(Vec<u8>, &str)> = vec![
        (br#"{"model": "x\u0000y", "prompt": "p"}"#.to_vec(), "model"),
        (
            br#"{"model": "chat", "prompt": "p", "user": "a\u0000b"}"#.to_vec(),
            "user",
        ),
        (
            br#"{"model": "chat\u0007", "prompt": "p"}"#.to_vec(),
            "model",
        ),
        (
            br#"{"model": "chat", "prompt": "p", "user": "line\nbreak\u001b[31m"}"#.to_vec(),
            "user",
        ),
        (br#"{"model": "x\ud800y", "prompt": "p"}"#.to_vec(), "model"),
        (
            br#"{"model": "chat", "prompt": "p", "user": "\udfff"}"#.to_vec(),
            "user",
        ),
        (
            json!({"model": mib, "prompt": "p"})
                .to_string()
                .into_bytes(),
            "model",
        ),
        (
            json!({"model": "chat", "prompt": "p", "user": mib})
                .to_string()
                .into_bytes(),
            "user",
        ),
    ];
    let total = 1000 + poisons.len() * 10;
    let mut answered = HashSet::new();
    let mut poisoned = BTreeMap::new();
    let mut i = 0;
    let mut batch = Vec::new();
    while i < total {
        let http = e.http.clone();
        let url = gw.url.clone();
        let key = KEYS[i % 2];
        // Every 101st request is poison, the rest normal.
        let (body, field) = if i % 101 == 100 {
            let (b, f) = &poisons[(i / 101) % poisons.len()];
            (b.clone(), Some(*f))
        } else {
            (normal(i), None)
        };
        batch.push(tokio::spawn(async move {
            (post(&http, &url, key, body).await, field)
        }));
        i += 1;
        if batch.len() == 16 || i == total {
            for h in batch.drain(..) {
                let (a, field) = h.await.unwrap();
                answered.insert(a.id);
                match field {
                    None => assert_eq!(a.status, 200, "{}", a.body),
                    Some(f) => {
                        assert_eq!(a.status, 400, "{f}: {}", a.body);
                        assert_eq!(a.body["error"]["param"], f, "{}", a.body);
                        poisoned.insert(a.id, f);
                    }
                }
            }
        }
    }
    assert!(poisoned.len() >= 9, "{}", poisoned.len());
    e.expect_rows(&answered, &gw).await;
    // Poisoned rows record the refusal, with a safe rendering.
    type Row = (Uuid, String, Option<String>, String, Option<String>);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT request_id, model_name, end_user, status::text, error_code FROM audit_log",
    )
    .fetch_all(&e.pool)
    .await
    .unwrap();
    for (id, model, user, status, code) in rows {
        let text = format!("{model} {}", user.clone().unwrap_or_default());
        assert!(!text.chars().any(char::is_control), "{id}: {text:?}");
        assert!(model.len() <= 600 && user.as_ref().is_none_or(|u| u.len() <= 600));
        if poisoned.contains_key(&id) {
            assert_eq!(status, "rejected");
            assert_eq!(code.as_deref(), Some("invalid_request"));
        } else {
            assert_eq!(status, "ok", "{id}");
            assert!(user.unwrap().starts_with("user-"));
        }
    }
    assert!(
        e.dead_letters().await.is_empty(),
        "nothing needed quarantine"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_outage_loses_no_row_and_memory_stays_bounded() {
    let e = env("audit_outage").await;
    let gw = e.gateway(&[]).await;
    let pid = gw.server.child.id();
    let run = |secs: u64| {
        let (http, url) = (e.http.clone(), gw.url.clone());
        async move {
            let stop = Instant::now() + Duration::from_secs(secs);
            let mut tasks = Vec::new();
            for c in 0..4 {
                let (http, url) = (http.clone(), url.clone());
                tasks.push(tokio::spawn(async move {
                    let mut out = Vec::new();
                    let mut i = c;
                    while Instant::now() < stop {
                        let t = Instant::now();
                        let a = post(&http, &url, KEYS[i % 2], normal(i)).await;
                        out.push((a, t.elapsed()));
                        i += 4;
                    }
                    out
                }));
            }
            let mut all = Vec::new();
            for t in tasks {
                all.extend(t.await.unwrap());
            }
            all
        }
    };
    let mut answered = HashSet::new();
    let before = run(3).await;
    let mut before_lat: Vec<Duration> = before.iter().map(|(_, d)| *d).collect();
    answered.extend(before.iter().map(|(a, _)| a.id));

    e.pg.cut();
    let sampler = tokio::spawn(async move {
        let mut peak = 0;
        for _ in 0..70 {
            peak = peak.max(rss_kib(pid));
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        peak
    });
    let during = run(30).await;
    e.pg.restore();
    let peak_kib = sampler.await.unwrap();
    for (a, _) in &during {
        assert_eq!(a.status, 200, "{}", a.body);
    }
    let mut during_lat: Vec<Duration> = during.iter().map(|(_, d)| *d).collect();
    answered.extend(during.iter().map(|(a, _)| a.id));
    assert!(during.len() > 100, "steady load: {} requests", during.len());
    e.expect_rows(&answered, &gw).await;
    println!(
        "outage: {} requests before (p50 {:?}, p99 {:?}), {} during the 30 s outage \
         (p50 {:?}, p99 {:?}); peak RSS {} MiB",
        before.len(),
        percentile(&mut before_lat, 0.5),
        percentile(&mut before_lat, 0.99),
        during.len(),
        percentile(&mut during_lat, 0.5),
        percentile(&mut during_lat, 0.99),
        peak_kib / 1024
    );
    // The bound: the queue's 64 MiB of bytes can never be reached by rows
    // this small, so the process stays near its idle size.
    assert!(peak_kib < 256 * 1024, "peak RSS {} MiB", peak_kib / 1024);
    // The spool was used, and is empty again.
    let deadline = Instant::now() + Duration::from_secs(30);
    while segments(e.spool.path()) > 0 {
        assert!(Instant::now() < deadline, "the spool was never emptied");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_an_outage_loses_no_answered_row() {
    let e = env("audit_crash").await;
    let mut gw = e.gateway(&[]).await;
    let mut answered = HashSet::new();
    for i in 0..20 {
        let a = post(&e.http, &gw.url, KEYS[i % 2], normal(i)).await;
        assert_eq!(a.status, 200, "{}", a.body);
        answered.insert(a.id);
    }
    e.pg.cut();
    // Load in flight while the process dies: some requests get no answer.
    let mut tasks = Vec::new();
    for c in 0..6 {
        let (http, url) = (e.http.clone(), gw.url.clone());
        tasks.push(tokio::spawn(async move {
            let mut got = Vec::new();
            for i in 0.. {
                let r = http
                    .post(format!("{url}/v1/completions"))
                    .bearer_auth(KEYS[(c + i) % 2])
                    .body(normal(i))
                    .header("content-type", "application/json")
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status() == 200 => {
                        let id: Uuid = r.headers()["x-request-id"]
                            .to_str()
                            .unwrap()
                            .parse()
                            .unwrap();
                        // The body must arrive whole for it to count as answered.
                        if r.text().await.is_ok() {
                            got.push(id);
                        }
                    }
                    Ok(r) => panic!("status {}", r.status()),
                    Err(_) => break,
                }
            }
            got
        }));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    gw.server.child.kill().unwrap();
    gw.server.child.wait().unwrap();
    let mut during = 0;
    for t in tasks {
        let got = t.await.unwrap();
        during += got.len();
        answered.extend(got);
    }
    assert!(during > 20, "{during} answered during the outage");
    e.pg.restore();
    let spooled = segments(e.spool.path());
    assert!(spooled > 0, "the outage's rows were spooled");
    // Restarted on the same spool: it replays the dead process's rows.
    let gw = e.gateway(&[]).await;
    // Rows of requests that never got an answer may or may not be there.
    e.expect_rows_of(&answered, &gw, true).await;
    let total = e.rows().await.len();
    println!(
        "crash: {} answered, {} rows ({} of requests cut off by the kill)",
        answered.len(),
        total,
        total - answered.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_spool_is_quarantined_line_by_line() {
    let e = env("audit_corrupt").await;
    // A gone gateway's spool: good rows around a non-UTF-8 line, a line
    // that is not a row, and a torn last line.
    let dead = e.spool.path().join("gw-gone-7f9c");
    std::fs::create_dir_all(&dead).unwrap();
    let row = |i: u32| {
        let now = chrono::Utc::now();
        json!({"request_id": Uuid::now_v7(), "received_at": now, "completed_at": now,
               "tenant_id": null, "api_key_id": null, "subject": null,
               "model_name": format!("spooled {i}"), "route_id": null, "route_revision": null,
               "lora_int_id": null, "adapter_name": null, "adapter_version": null,
               "base_hash": null, "worker_id": null, "adapter_residency": null,
               "status": "rejected", "http_status": 401, "error_code": "invalid_api_key",
               "finish_reason": null, "prompt_tokens": 0, "completion_tokens": 0,
               "latency_us": 5, "ttft_us": null, "attempts": 0})
    };
    let mut good = HashSet::new();
    let mut seg = Vec::new();
    for i in 0..700u32 {
        let r = row(i);
        good.insert(r["request_id"].as_str().unwrap().parse::<Uuid>().unwrap());
        seg.extend_from_slice(r.to_string().as_bytes());
        seg.push(b'\n');
        if i == 10 {
            seg.extend_from_slice(b"{\"request_id\": \"\xff\xfe not utf-8\"}\n");
        }
        if i == 600 {
            seg.extend_from_slice(b"{\"not\": \"a row\"}\n");
        }
    }
    seg.extend_from_slice(br#"{"request_id": "0190e7c2-torn"#);
    std::fs::write(dead.join("0000000000000001-000001.jsonl"), &seg).unwrap();
    std::fs::write(dead.join("LOCK"), b"").unwrap();

    let gw = e.gateway(&[]).await;
    e.expect_rows(&good, &gw).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while dead.exists() {
        assert!(
            Instant::now() < deadline,
            "the adopted spool was never removed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let bad = e.dead_letters().await;
    assert_eq!(bad.len(), 3, "{bad:?}");
    assert!(bad.iter().all(|(s, _, _)| s == "spool"));
    assert!(bad[0].1.contains("not UTF-8"), "{}", bad[0].1);
    assert_eq!(bad[0].2, b"{\"request_id\": \"\xff\xfe not utf-8\"}");
    assert!(bad[1].1.contains("not an audit row"), "{}", bad[1].1);
    assert!(bad[2].1.contains("torn line"), "{}", bad[2].1);
    assert_eq!(bad[2].2, br#"{"request_id": "0190e7c2-torn"#);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_open_streams_ends_them_and_writes_every_row() {
    let e = env("audit_sigterm").await;
    let mut gw = e
        .gateway(&["--drain-deadline-secs", "2", "--audit-flush-secs", "5"])
        .await;
    let mut answered = HashSet::new();
    // Plain requests first, then streams that have begun.
    for i in 0..10 {
        let a = post(&e.http, &gw.url, KEYS[i % 2], normal(i)).await;
        assert_eq!(a.status, 200, "{}", a.body);
        answered.insert(a.id);
    }
    let mut streams = Vec::new();
    for i in 0..6 {
        let mut r = e
            .http
            .post(format!("{}/v1/chat/completions", gw.url))
            .bearer_auth(KEYS[i % 2])
            .json(
                &json!({"model": "chat", "messages": [{"role": "user", "content": "a story"}],
                          "max_tokens": 400, "stream": true, "ignore_eos": true}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        answered.insert(
            r.headers()["x-request-id"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap(),
        );
        let first = r.chunk().await.unwrap().unwrap();
        streams.push((r, String::from_utf8_lossy(&first).into_owned()));
    }
    // The worker stalls, so only the drain deadline can end the streams.
    let worker_pid = e.worker.child.id();
    signal(worker_pid, "STOP");
    let started = Instant::now();
    let pid = gw.server.child.id();
    signal(pid, "TERM");
    let exit = gw.server.child.wait().unwrap();
    let took = started.elapsed();
    signal(worker_pid, "CONT");
    assert!(exit.success(), "{exit}: {}", gw.server.log_text());
    // Drain 2 s + settle 5 s + flush 5 s is the most it may take.
    assert!(took < Duration::from_secs(12), "exit took {took:?}");
    assert!(
        took >= Duration::from_secs(2),
        "exit took {took:?}: before the drain deadline"
    );
    // Every stream ends with an error event that says why.
    for (mut r, mut text) in streams {
        while let Ok(Some(c)) = r.chunk().await {
            text.push_str(&String::from_utf8_lossy(&c));
        }
        assert!(text.contains("\"code\":\"gateway_shutdown\""), "{text}");
        assert!(!text.contains("[DONE]"), "{text}");
    }
    e.expect_rows(&answered, &gw).await;
    let rows = e.rows().await;
    let cut = rows
        .iter()
        .filter(|r| r.1 == "cancelled" && r.3.as_deref() == Some("gateway_shutdown"))
        .count();
    let ok = rows.iter().filter(|r| r.1 == "ok").count();
    assert_eq!((ok, cut), (10, 6), "{rows:?}");
    println!("sigterm: exited in {took:?}; {ok} rows ok, {cut} streams cut at the deadline");
}

/// One minimal audit row.
async fn insert_row(pool: &PgPool) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO audit_log (request_id, received_at, completed_at, model_name, status,
                                http_status, latency_us)
         VALUES ($1, now(), now(), 'chat', 'rejected', 401, 1)",
    )
    .bind(Uuid::now_v7())
    .execute(pool)
    .await
    .map(|_| ())
}

#[tokio::test]
async fn the_runtime_role_cannot_erase_the_audit_log() {
    let db = migrated_db("audit_privilege").await;
    let pool = db.pool().await;
    seed(&pool).await;
    let user = runtime_user(&pool).await;
    insert_row(&pool).await.unwrap();
    let url = db.url_as(&user);
    let rt = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap();
    let denied = |sql: &'static str| {
        let rt = rt.clone();
        async move {
            let e = sqlx::raw_sql(sql).execute(&rt).await.expect_err(sql);
            let code = e
                .as_database_error()
                .and_then(|d| d.code())
                .map(|c| c.into_owned());
            assert_eq!(code.as_deref(), Some("42501"), "{sql}: {e}");
        }
    };
    denied("TRUNCATE audit_log").await;
    denied("DELETE FROM audit_log").await;
    denied("ALTER TABLE audit_log DISABLE TRIGGER ALL").await;
    denied("ALTER TABLE audit_log DISABLE TRIGGER audit_log_append_only").await;
    denied("DROP TABLE audit_log").await;
    denied("UPDATE tenants SET rpm_limit = 1").await;
    denied("DELETE FROM audit_dead_letter").await;
    // What it is for still works: read the registry, write and read rows.
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM tenants")
        .fetch_one(&rt)
        .await
        .unwrap();
    assert_eq!(n, 2);
    insert_row(&rt).await.unwrap();
    rt.close().await;
}

/// A batch holding rows Postgres refuses as data (SQLSTATE class 23 here:
/// check constraints) is split: every good row lands, each bad one is
/// quarantined with its reason, and nothing waits on the spool.
#[tokio::test]
async fn data_errors_quarantine_only_the_bad_rows() {
    use lorafleet_gateway::audit::{AuditConfig, AuditRecord, start};
    let db = migrated_db("audit_data_errors").await;
    let pool = db.pool().await;
    let spool = tempfile::tempdir().unwrap();
    let config = AuditConfig {
        spool_dir: spool.path().to_owned(),
        spool_owner: "writer-test".into(),
        spool_max_bytes: 1 << 30,
        segment_bytes: 1 << 20,
        queue_rows: 4096,
        queue_bytes: 64 << 20,
        ack_timeout: Duration::from_secs(30),
    };
    let (log, writer) = start(pool.clone(), &config).unwrap();
    let row = |i: usize| {
        let now = chrono::Utc::now();
        AuditRecord {
            request_id: Uuid::now_v7(),
            received_at: now,
            completed_at: now,
            tenant_id: None,
            api_key_id: None,
            api_key_prefix: Some("lf_x".into()),
            subject: None,
            end_user: Some(format!("u{i}")),
            model_name: format!("m{i}"),
            route_id: None,
            route_revision: None,
            lora_int_id: None,
            adapter_name: None,
            adapter_version: None,
            base_hash: None,
            worker_id: None,
            adapter_residency: None,
            status: "rejected".into(),
            // Every 37th row breaks audit_log_http_status_range.
            http_status: if i % 37 == 5 { 0 } else { 401 },
            error_code: Some("invalid_api_key".into()),
            finish_reason: None,
            prompt_tokens: 0,
            completion_tokens: 0,
            latency_us: 1,
            ttft_us: None,
            attempts: 0,
        }
    };
    // Admitted all at once, so the writer takes them as large batches.
    let rows: Vec<AuditRecord> = (0..1000).map(row).collect();
    let bad: HashSet<Uuid> = rows
        .iter()
        .filter(|r| r.http_status == 0)
        .map(|r| r.request_id)
        .collect();
    let tickets: Vec<_> = rows.iter().map(|_| log.admit().unwrap()).collect();
    let acks: Vec<_> = tickets
        .into_iter()
        .zip(rows.iter().cloned())
        .map(|(t, r)| t.record(r))
        .collect();
    for a in acks {
        assert!(a.wait().await, "every row is durable");
    }
    drop(log);
    writer.await.unwrap();
    let landed: Vec<Uuid> = sqlx::query_scalar("SELECT request_id FROM audit_log")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(landed.len(), 1000 - bad.len());
    assert!(landed.iter().all(|id| !bad.contains(id)));
    let dead: Vec<(String, Option<Uuid>, String)> =
        sqlx::query_as("SELECT source, request_id, reason FROM audit_dead_letter")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(dead.len(), bad.len());
    for (source, id, reason) in dead {
        assert_eq!(source, "insert");
        assert!(bad.contains(&id.unwrap()));
        assert!(reason.contains("audit_log_http_status_range"), "{reason}");
    }
    assert_eq!(segments(spool.path()), 0, "a data error is not an outage");
}

/// A client that goes away still leaves its row: `cancelled`, with the
/// tokens it used, for a plain request and for a stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_go_away_still_get_their_rows() {
    let e = env("audit_disconnect").await;
    let gw = e.gateway(&[]).await;
    let long = |stream: bool| {
        json!({"model": "chat", "prompt": "a long story", "max_tokens": 400,
               "ignore_eos": true, "stream": stream, "user": "leaver"})
    };
    // A stream read for a few chunks, then dropped.
    let mut r = e
        .http
        .post(format!("{}/v1/completions", gw.url))
        .bearer_auth(ACME_KEY)
        .json(&long(true))
        .send()
        .await
        .unwrap();
    let stream_id: Uuid = r.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let mut chunks = 0;
    while chunks < 5 {
        let c = r.chunk().await.unwrap().unwrap();
        chunks += String::from_utf8_lossy(&c).matches("data: ").count();
    }
    drop(r);
    // A plain request whose client gives up while the worker generates:
    // the worker is stopped mid-way so the answer cannot come first.
    let worker_pid = e.worker.child.id();
    let plain = {
        let (http, url) = (e.http.clone(), gw.url.clone());
        let body = long(false);
        tokio::spawn(async move {
            http.post(format!("{url}/v1/completions"))
                .bearer_auth(GLOBEX_KEY)
                .json(&body)
                .send()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal(worker_pid, "STOP");
    tokio::time::sleep(Duration::from_millis(200)).await;
    plain.abort();
    let _ = plain.await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    signal(worker_pid, "CONT");

    let deadline = Instant::now() + Duration::from_secs(30);
    type Row = (
        Uuid,
        String,
        i16,
        Option<String>,
        i32,
        Option<String>,
        Option<String>,
    );
    let rows: Vec<Row> = loop {
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT request_id, status::text, http_status, error_code, completion_tokens,
                    end_user, api_key_prefix
             FROM audit_log ORDER BY received_at",
        )
        .fetch_all(&e.pool)
        .await
        .unwrap();
        if rows.len() >= 2 {
            break rows;
        }
        assert!(
            Instant::now() < deadline,
            "{rows:?}: {}",
            gw.server.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(rows.len(), 2, "{rows:?}");
    let (id, status, http, code, tokens, user, prefix) = &rows[0];
    assert_eq!(*id, stream_id);
    assert_eq!(
        (status.as_str(), code.as_deref()),
        ("cancelled", Some("client_closed"))
    );
    assert_eq!(*http, 200, "the stream's headers had gone out");
    assert!(
        *tokens as usize >= chunks,
        "{tokens} tokens, {chunks} chunks read"
    );
    assert_eq!(user.as_deref(), Some("leaver"));
    assert_eq!(prefix.as_deref(), Some(ACME_KEY.split_once('.').unwrap().0));
    let (_, status, http, code, tokens, _, prefix) = &rows[1];
    assert_eq!(
        (status.as_str(), code.as_deref()),
        ("cancelled", Some("client_closed"))
    );
    assert_eq!(*http, 499);
    assert!(*tokens > 0, "the tokens it used: {tokens}");
    assert_eq!(
        prefix.as_deref(),
        Some(GLOBEX_KEY.split_once('.').unwrap().0)
    );
}

/// A replica serves from its snapshot through an outage, but only up to
/// `--registry-max-age-secs`: then completions get 503 `registry_stale`
/// (with their rows) and /readyz fails, until Postgres is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_registry_stops_serving_until_postgres_returns() {
    let e = env("audit_stale").await;
    let gw = e.gateway(&["--registry-max-age-secs", "3"]).await;
    let mut answered = HashSet::new();
    let a = post(&e.http, &gw.url, ACME_KEY, normal(0)).await;
    assert_eq!(a.status, 200, "{}", a.body);
    answered.insert(a.id);
    e.pg.cut();
    let a = post(&e.http, &gw.url, GLOBEX_KEY, normal(1)).await;
    assert_eq!(a.status, 200, "young enough: {}", a.body);
    answered.insert(a.id);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let a = post(&e.http, &gw.url, ACME_KEY, normal(2)).await;
    assert_eq!(a.status, 503, "{}", a.body);
    assert_eq!(a.body["error"]["code"], "registry_stale");
    answered.insert(a.id);
    let ready = e
        .http
        .get(format!("{}/readyz", gw.url))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    assert!(ready.text().await.unwrap().contains("registry snapshot"));
    let metrics_url = format!("http://{}/metrics", gw.server.addr("metrics"));
    e.pg.restore();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let a = post(&e.http, &gw.url, GLOBEX_KEY, normal(3)).await;
        answered.insert(a.id);
        if a.status == 200 {
            break;
        }
        assert_eq!(a.body["error"]["code"], "registry_stale");
        assert!(Instant::now() < deadline, "never served again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let metrics = e
        .http
        .get(metrics_url)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("lorafleet_gateway_registry_age_seconds"),
        "{metrics}"
    );
    e.expect_rows(&answered, &gw).await;
}

/// Fail closed: while Postgres is unreachable and the spool is at its disk
/// limit, new requests get 503 `audit_unavailable` and nothing is served
/// without its row; once Postgres is back, serving resumes and every
/// answered request has its row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_spool_during_an_outage_refuses_new_requests() {
    let e = env("audit_full").await;
    let gw = e
        .gateway(&[
            "--audit-queue-bytes",
            "16384",
            "--audit-spool-max-bytes",
            "65536",
        ])
        .await;
    let mut answered = HashSet::new();
    e.pg.cut();
    let mut refused = 0;
    for i in 0..400 {
        let a = post(&e.http, &gw.url, KEYS[i % 2], normal(i)).await;
        match a.status {
            200 => {
                answered.insert(a.id);
            }
            503 => {
                assert_eq!(a.body["error"]["code"], "audit_unavailable", "{}", a.body);
                refused += 1;
                if refused == 5 {
                    break;
                }
            }
            s => panic!("{s}: {}", a.body),
        }
    }
    assert_eq!(refused, 5, "the spool's limit was never reached");
    assert!(
        answered.len() > 20,
        "{} served before the limit",
        answered.len()
    );
    let spooled = files_under(e.spool.path())
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum::<u64>();
    assert!(spooled <= 65536, "{spooled} bytes spooled");
    e.pg.restore();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let a = post(&e.http, &gw.url, ACME_KEY, normal(0)).await;
        if a.status == 200 {
            answered.insert(a.id);
            break;
        }
        assert!(Instant::now() < deadline, "never served again: {}", a.body);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    e.expect_rows(&answered, &gw).await;
}
