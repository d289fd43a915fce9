//! Gateway admission with the real gateway and worker: one tenant can never
//! take another tenant's capacity. A tenant's slow bodies hold only its own
//! slots; the global permits are taken only once a body has arrived, and a
//! body that does not arrive in time ends with 408.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use lorafleet_tests::{Server, fixture_worker, gateway_command, migrated_db, seed_base_routes};
use serde_json::{Value, json};

const ACME_KEY: &str = "lf_acmeadmit1.acme-secret-0123456789";
const GLOBEX_KEY: &str = "lf_globexadm1.globex-secret-0123456789";

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

/// The real gateway on `worker` with `extra` flags, once it is ready.
async fn ready_gateway(
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
    let deadline = Instant::now() + Duration::from_secs(30);
    while !http
        .get(format!("http://{}/readyz", gateway.addr("http")))
        .send()
        .await
        .is_ok_and(|r| r.status() == 200)
    {
        assert!(Instant::now() < deadline, "the gateway became ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    gateway
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_with_slow_bodies_holds_only_its_own_slots() {
    let db = migrated_db("admission").await;
    let pool = db.pool().await;
    seed_base_routes(&pool, &[("acme", ACME_KEY), ("globex", GLOBEX_KEY)], "chat").await;
    let worker = fixture_worker("w0", &[]);
    let spool = tempfile::tempdir().unwrap();
    let gateway = ready_gateway(
        &db.url(),
        &worker,
        spool.path(),
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
    let db = migrated_db("admission_default").await;
    let pool = db.pool().await;
    seed_base_routes(&pool, &[("acme", ACME_KEY)], "chat").await;
    let worker = fixture_worker("w0", &[]);
    let spool = tempfile::tempdir().unwrap();
    let gateway = ready_gateway(
        &db.url(),
        &worker,
        spool.path(),
        &["--default-rpm-limit", "2"],
    )
    .await;
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
}
