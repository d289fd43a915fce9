//! Gateway admission with the real gateway and worker: one tenant can never
//! take another tenant's capacity. A tenant's slow bodies hold only its own
//! slots; the global permits are taken only once a body has arrived, and a
//! body that does not arrive in time ends with 408. Concurrency caps and
//! token budgets hold exactly under concurrent requests.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use lorafleet_tests::{
    assert_tenant_safe, fixture_worker, migrated_db, ready_gateway, seed_base_routes,
};
use serde_json::{Value, json};

const ACME_KEY: &str = "lf_acmeadmit1.acme-secret-0123456789";
const GLOBEX_KEY: &str = "lf_globexadm1.globex-secret-0123456789";

/// One test's world: a database seeded with `tenants` on the route
/// "chat", one fixture worker, and a ready gateway with `flags`.
struct Env {
    db: lorafleet_tests::TestDb,
    pool: sqlx::PgPool,
    worker: lorafleet_tests::Server,
    spool: tempfile::TempDir,
    gateway: lorafleet_tests::Server,
}

/// [`Env`], running `setup` (SQL) on the seeded database before the
/// gateway reads it.
async fn env(label: &str, tenants: &[(&str, &str)], setup: &[&'static str], flags: &[&str]) -> Env {
    let db = migrated_db(label).await;
    let pool = db.pool().await;
    seed_base_routes(&pool, tenants, "chat").await;
    for sql in setup {
        sqlx::query(*sql).execute(&pool).await.unwrap();
    }
    let worker = fixture_worker("w0", &[]);
    let spool = tempfile::tempdir().unwrap();
    let gateway = ready_gateway(&db.url(), &worker, spool.path(), flags).await;
    Env {
        db,
        pool,
        worker,
        spool,
        gateway,
    }
}

/// `n` copies of `body` from `key`, sent at once.
fn at_once(
    http: &reqwest::Client,
    addr: &str,
    key: &'static str,
    body: &Value,
    n: usize,
) -> Vec<tokio::task::JoinHandle<(u16, Value)>> {
    (0..n)
        .map(|_| {
            let (http, addr, body) = (http.clone(), addr.to_owned(), body.clone());
            tokio::spawn(async move { complete(&http, &addr, key, body).await })
        })
        .collect()
}

/// A request whose headers arrive at once and whose body never finishes.
fn slow_body(addr: &str, key: &str) -> std::net::TcpStream {
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n\
         content-type: application/json\r\ncontent-length: 200\r\n\r\n{{\"model\": "
    )
    .unwrap();
    c.flush().unwrap();
    c
}

fn status_of(mut c: std::net::TcpStream) -> (u16, String) {
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    // The response is small; read until the body's JSON closes or EOF.
    while let Ok(n) = c.read(&mut chunk) {
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.ends_with(b"}") || buf.ends_with(b"}\n") {
            break;
        }
    }
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_with_slow_bodies_holds_only_its_own_slots() {
    let e = env(
        "admission",
        &[("acme", ACME_KEY), ("globex", GLOBEX_KEY)],
        &[],
        &[
            "--max-concurrent-requests",
            "2",
            "--max-concurrent-per-tenant",
            "2",
            "--body-timeout-secs",
            "3",
        ],
    )
    .await;
    let gateway = &e.gateway;
    let addr = gateway.addr("http").to_owned();
    let http = reqwest::Client::new();
    let complete = |key: &'static str| {
        let (http, addr) = (http.clone(), addr.clone());
        async move {
            let r = http
                .post(format!("http://{addr}/v1/completions"))
                .bearer_auth(key)
                .json(&json!({"model": "chat", "prompt": "hello", "max_tokens": 2}))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };

    // Acme trickles two bodies: its two slots are taken.
    let started = Instant::now();
    let slow = [slow_body(&addr, ACME_KEY), slow_body(&addr, ACME_KEY)];
    tokio::time::sleep(Duration::from_millis(500)).await;
    // A third acme request is refused at once, by its own limit.
    let (status, body) = complete(ACME_KEY).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "tenant_concurrency_limit", "{body}");
    // Globex is served meanwhile: acme's slow bodies hold no global permit
    // (there are only 2, and acme has 2 requests open).
    for _ in 0..3 {
        let (status, body) = complete(GLOBEX_KEY).await;
        assert_eq!(status, 200, "{body}");
    }
    // The slow bodies end with 408 at the body deadline.
    for c in slow {
        let (status, text) = tokio::task::spawn_blocking(move || status_of(c))
            .await
            .unwrap();
        assert_eq!(status, 408, "{text}");
        assert!(text.contains("body_timeout"), "{text}");
    }
    assert!(started.elapsed() >= Duration::from_secs(3));
    // And acme's slots are free again.
    let (status, body) = complete(ACME_KEY).await;
    assert_eq!(status, 200, "{body}");

    // An unauthenticated client never gets to send a body.
    let c = slow_body(&addr, "lf_nobody01.not-a-key");
    let (status, text) = tokio::task::spawn_blocking(move || status_of(c))
        .await
        .unwrap();
    assert_eq!(status, 401, "{text}");
}

/// A tenant whose registry row sets no limits gets the gateway's default
/// requests per minute, as the schema promises, rather than none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_without_limits_gets_the_gateway_default() {
    let e = env(
        "admission_default",
        &[("acme", ACME_KEY)],
        &[],
        &["--default-rpm-limit", "2"],
    )
    .await;
    let gateway = &e.gateway;
    let addr = gateway.addr("http").to_owned();
    let http = reqwest::Client::new();
    // Five requests at once: at 2 a minute, some are refused (even if a
    // minute boundary falls among them, it cannot free more than 2 more).
    let mut refused = Vec::new();
    for _ in 0..5 {
        let r = http
            .post(format!("http://{addr}/v1/completions"))
            .bearer_auth(ACME_KEY)
            .json(&json!({"model": "chat", "prompt": "hello", "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        if r.status() == 429 {
            refused.push(r.json::<Value>().await.unwrap());
        }
    }
    assert!(!refused.is_empty(), "the default limit applies");
    for body in &refused {
        assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
    }

    // A stop string of 100 KiB is refused by its index before it travels.
    let huge = "x".repeat(100 * 1024);
    let (status, body) = complete(
        &http,
        gateway.addr("http"),
        ACME_KEY,
        json!({"model": "chat", "prompt": "hello", "max_tokens": 1, "stop": [huge]}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "stop[0]", "{body}");
    assert!(
        body.to_string().len() < 1024,
        "the refusal does not echo it"
    );

    // The tokens-per-minute default too: a request larger than it is told
    // to lower max_tokens.
    let gateway = ready_gateway(
        &e.db.url(),
        &e.worker,
        e.spool.path(),
        &["--default-tpm-limit", "100"],
    )
    .await;
    let r = http
        .post(format!("http://{}/v1/completions", gateway.addr("http")))
        .bearer_auth(ACME_KEY)
        .json(&json!({"model": "chat", "prompt": "hello", "max_tokens": 200}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let body: Value = r.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("lower max_tokens"), "{body}");
}

/// `tenant`'s requests in the gateway at once, at most: the largest overlap
/// of its served rows' generation spans (first token to row). Each span
/// lies inside the time the request held its tenant slot.
async fn most_at_once(pool: &sqlx::PgPool, tenant: &str) -> usize {
    let spans: Vec<(chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>)> =
        sqlx::query_as(
            "SELECT a.received_at + make_interval(secs => a.ttft_us / 1e6), a.completed_at
             FROM audit_log a JOIN tenants t ON t.id = a.tenant_id
             WHERE t.name = $1 AND a.status = 'ok'",
        )
        .bind(tenant)
        .fetch_all(pool)
        .await
        .unwrap();
    let mut edges: Vec<(chrono::DateTime<chrono::Utc>, i32)> =
        spans.iter().flat_map(|&(a, b)| [(a, 1), (b, -1)]).collect();
    // An end before a start at the same instant: touching is not overlap.
    edges.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, d) in edges {
        now += d;
        most = most.max(now);
    }
    most as usize
}

async fn wait_rows(pool: &sqlx::PgPool, want: i64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_log")
            .fetch_one(pool)
            .await
            .unwrap();
        if n >= want {
            return;
        }
        assert!(Instant::now() < deadline, "{n} of {want} audit rows");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A completion from `key`: (status, body).
async fn complete(http: &reqwest::Client, addr: &str, key: &str, body: Value) -> (u16, Value) {
    let r = http
        .post(format!("http://{addr}/v1/completions"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let body = r.json::<Value>().await.unwrap_or(Value::Null);
    if status != 200 {
        assert_tenant_safe(&body.to_string());
    }
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_cap_gets_429_and_others_run_meanwhile() {
    let e = env(
        "admission_cap",
        &[("acme", ACME_KEY), ("globex", GLOBEX_KEY)],
        &[],
        &["--max-concurrent-per-tenant", "4"],
    )
    .await;
    let gateway = &e.gateway;
    let addr = gateway.addr("http").to_owned();
    let http = reqwest::Client::new();
    let long = json!({"model": "chat", "prompt": "hello", "max_tokens": 400, "ignore_eos": true});
    // Twenty acme requests at once, and globex's beside them.
    let acme = at_once(&http, &addr, ACME_KEY, &long, 20);
    let globex = at_once(&http, &addr, GLOBEX_KEY, &long, 4);
    let mut served = 0;
    for h in acme {
        let (status, body) = h.await.unwrap();
        match status {
            200 => served += 1,
            429 => {
                assert_eq!(body["error"]["code"], "tenant_concurrency_limit", "{body}");
                assert!(body.to_string().len() < 400, "{body}");
            }
            other => panic!("{other}: {body}"),
        }
    }
    for h in globex {
        let (status, body) = h.await.unwrap();
        assert_eq!(status, 200, "globex is not held back by acme: {body}");
    }
    assert!((4..20).contains(&served), "{served} of 20 acme requests");
    wait_rows(&e.pool, 24).await;
    let acme_most = most_at_once(&e.pool, "acme").await;
    assert!(acme_most <= 4, "{acme_most} acme requests ran at once");
    assert!(acme_most >= 2, "{acme_most}: the requests did overlap");
}

/// Seconds until the next minute, waited out first if fewer than `need`
/// remain: a test whose budget is one minute's stays inside it.
async fn inside_one_minute(need: u64) {
    let into = chrono::Utc::now().timestamp() as u64 % 60;
    if 60 - into < need {
        tokio::time::sleep(Duration::from_secs(60 - into + 1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_budget_holds_under_concurrency_and_charges_every_end() {
    let prefix = format!("lf-admission-tpm-{}:", uuid::Uuid::new_v4());
    let e = env(
        "admission_tpm",
        &[("acme", ACME_KEY)],
        &["UPDATE tenants SET tpm_limit = 1000 WHERE name = 'acme'"],
        &[
            "--redis-url",
            "redis://127.0.0.1:6379",
            "--redis-prefix",
            &prefix,
        ],
    )
    .await;
    let gateway = &e.gateway;
    let tenant: uuid::Uuid = sqlx::query_scalar("SELECT id FROM tenants WHERE name = 'acme'")
        .fetch_one(&e.pool)
        .await
        .unwrap();
    let addr = gateway.addr("http").to_owned();
    let http = reqwest::Client::new();
    inside_one_minute(40).await;
    let minute = chrono::Utc::now().timestamp() / 60;

    // A stream that the client drops after its first tokens is charged
    // the tokens it used, not its reservation.
    let r = http
        .post(format!("http://{addr}/v1/completions"))
        .bearer_auth(ACME_KEY)
        .json(
            &json!({"model": "chat", "prompt": "hello", "max_tokens": 300,
                      "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut r = r;
    let first = r.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "), "{first:?}");
    drop(r);

    // Twenty at once, each reserving 200 tokens plus its prompt: at most
    // five fit in 1000 (fewer, with the cancelled stream's tokens).
    let body = json!({"model": "chat", "prompt": "hello", "max_tokens": 200, "ignore_eos": true});
    let tries = at_once(&http, &addr, ACME_KEY, &body, 20);
    let mut admitted = 0;
    for t in tries {
        let (status, body) = t.await.unwrap();
        match status {
            200 => admitted += 1,
            429 => {
                assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
                assert!(
                    body["error"]["message"]
                        .as_str()
                        .unwrap()
                        .contains("tokens per minute"),
                    "{body}"
                );
            }
            other => panic!("{other}: {body}"),
        }
    }
    assert!((1..=5).contains(&admitted), "{admitted} admitted");
    assert!(
        chrono::Utc::now().timestamp() / 60 == minute,
        "the test stayed inside one minute"
    );

    // The minute's count is exactly the tokens the rows say were used:
    // every reservation was settled, the cancelled stream's too.
    wait_rows(&e.pool, 21).await;
    let used: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(prompt_tokens + completion_tokens), 0)::bigint FROM audit_log
         WHERE status IN ('ok', 'cancelled')",
    )
    .fetch_one(&e.pool)
    .await
    .unwrap();
    let cancelled: i32 =
        sqlx::query_scalar("SELECT completion_tokens FROM audit_log WHERE status = 'cancelled'")
            .fetch_one(&e.pool)
            .await
            .unwrap();
    assert!(cancelled > 0 && cancelled < 300, "{cancelled}");
    let mut redis = redis::Client::open("redis://127.0.0.1:6379")
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let key = format!("{prefix}rl:{tenant}:tpm:{minute}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let counted: i64 = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut redis)
            .await
            .unwrap();
        if counted == used {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the minute counts {counted} tokens; the rows used {used}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The next minute, the budget is back.
    // (Concurrent refusals can hold the count up for an instant and turn
    // away a request that would have fit, so the burst may leave room:
    // spend it, one request at a time.)
    let mut spent = false;
    for _ in 0..5 {
        let (status, answer) = complete(&http, &addr, ACME_KEY, body.clone()).await;
        if status == 429 {
            spent = true;
            break;
        }
        assert_eq!(status, 200, "{answer}");
    }
    assert!(spent, "the minute's budget ran out");
    let wait = 60 - chrono::Utc::now().timestamp() % 60;
    tokio::time::sleep(Duration::from_secs(wait as u64 + 1)).await;
    let (status, answer) = complete(&http, &addr, ACME_KEY, body).await;
    assert_eq!(status, 200, "{answer}");
}

/// A client that never finishes its headers is dropped at the header
/// deadline, and counted; it never reaches the API, so it has no row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_its_headers_is_dropped_at_the_deadline() {
    let e = env(
        "admission_headers",
        &[("acme", ACME_KEY)],
        &[],
        &["--header-timeout-secs", "2"],
    )
    .await;
    let gateway = &e.gateway;
    let addr = gateway.addr("http").to_owned();
    let started = Instant::now();
    let closed = tokio::task::spawn_blocking(move || {
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        c.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bear")
            .unwrap();
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut buf = [0u8; 1024];
        // The server closes the connection: EOF, or a reset.
        loop {
            match c.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    });
    closed.await.unwrap();
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(15),
        "closed after {took:?}"
    );
    let metrics = reqwest::get(format!("http://{}/metrics", gateway.addr("metrics")))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("lorafleet_gateway_header_timeouts_total") && l.ends_with(" 1")),
        "{metrics}"
    );
    // The listener still serves.
    let http = reqwest::Client::new();
    let (status, body) = complete(
        &http,
        gateway.addr("http"),
        ACME_KEY,
        json!({"model": "chat", "prompt": "hello", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

/// One trickling body: headers at once, then one byte of body a second.
/// Returns the status the gateway answered with (0 if none).
async fn trickle(addr: String, key: &'static str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(c) = tokio::net::TcpStream::connect(&addr).await else {
        return 0;
    };
    let (mut rd, mut wr) = c.into_split();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n\
         content-type: application/json\r\ncontent-length: 200\r\n\r\n{{"
    );
    if wr.write_all(head.as_bytes()).await.is_err() {
        return 0;
    }
    let writer = tokio::spawn(async move {
        for _ in 0..60 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if wr.write_all(b" ").await.is_err() {
                return;
            }
        }
    });
    let mut buf = vec![0u8; 2048];
    let n = tokio::time::timeout(Duration::from_secs(60), rd.read(&mut buf))
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or(0);
    writer.abort();
    String::from_utf8_lossy(&buf[..n])
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// Tenant A trickles 500 bodies a byte a second; tenant B is served all
/// the while, and every one of A's requests ends at the body deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_trickling_bodies_do_not_hold_back_another_tenant() {
    let e = env(
        "admission_trickle",
        &[("acme", ACME_KEY), ("globex", GLOBEX_KEY)],
        &[],
        &[
            "--max-concurrent-requests",
            "1024",
            "--max-concurrent-per-tenant",
            "600",
            "--body-timeout-secs",
            "5",
        ],
    )
    .await;
    let gateway = &e.gateway;
    let addr = gateway.addr("http").to_owned();
    let slow: Vec<_> = (0..500)
        .map(|_| tokio::spawn(trickle(addr.clone(), ACME_KEY)))
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Globex meanwhile: 4 callers, 10 requests each.
    let http = reqwest::Client::new();
    let callers: Vec<_> = (0..4)
        .map(|_| {
            let (http, addr) = (http.clone(), addr.clone());
            tokio::spawn(async move {
                let mut took = Vec::new();
                for _ in 0..10 {
                    let started = Instant::now();
                    let (status, body) = complete(
                        &http,
                        &addr,
                        GLOBEX_KEY,
                        json!({"model": "chat", "prompt": "hello", "max_tokens": 2}),
                    )
                    .await;
                    assert_eq!(status, 200, "{body}");
                    took.push(started.elapsed());
                }
                took
            })
        })
        .collect();
    let mut took = Vec::new();
    for c in callers {
        took.extend(c.await.unwrap());
    }
    took.sort();
    let p99 = took[took.len() * 99 / 100 - 1];
    println!(
        "globex beside 500 trickling bodies: {} requests, p50 {:?}, p99 {:?}",
        took.len(),
        took[took.len() / 2],
        p99
    );
    let mut statuses = std::collections::BTreeMap::new();
    for s in slow {
        *statuses.entry(s.await.unwrap()).or_insert(0) += 1;
    }
    assert_eq!(
        statuses,
        std::collections::BTreeMap::from([(408, 500)]),
        "every trickling body ends at the deadline"
    );
}
