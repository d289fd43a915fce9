//! Prefix caching across the real processes: a repeated long prompt is
//! served partly from the worker's prefix cache, and the tenant's usage,
//! the audit row and the worker's metrics say how many prompt tokens were;
//! with `--no-prefix-caching` none are.

use std::time::{Duration, Instant};

use lorafleet_tests::{TestDb, fixture_worker, migrated_db, ready_gateway, seed_base_routes};
use serde_json::{Value, json};

const ACME_KEY: &str = "lf_acmeprefix1.acme-secret-0123456789";

/// Two identical requests: the cached tokens of each, the database and the
/// worker's prefix-cache hits as its metrics last said.
async fn twice(worker_flags: &[&str], label: &str) -> (u64, u64, TestDb, f64) {
    let db = migrated_db(label).await;
    let pool = db.pool().await;
    seed_base_routes(&pool, &[("acme", ACME_KEY)], "chat").await;
    let worker = fixture_worker("w0", worker_flags);
    let spool = tempfile::tempdir().unwrap();
    let gateway = ready_gateway(&db.url(), &worker, spool.path(), &[]).await;
    let http = reqwest::Client::new();
    // A long shared system prompt: many full KV blocks.
    let system = "You are a careful assistant for the support desk. ".repeat(12);
    let mut cached = Vec::new();
    for _ in 0..2 {
        let body: Value = http
            .post(format!(
                "http://{}/v1/chat/completions",
                gateway.addr("http")
            ))
            .bearer_auth(ACME_KEY)
            .json(&json!({"model": "chat", "max_tokens": 2, "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": "How do I reset my password?"}
            ]}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let usage = &body["usage"];
        assert!(usage["prompt_tokens"].as_u64().unwrap() > 64, "{body}");
        cached.push(
            usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        );
    }
    // The worker publishes its counters with each engine report.
    let deadline = Instant::now() + Duration::from_secs(10);
    let hits = loop {
        let metrics = reqwest::get(format!("http://{}/metrics", worker.addr("metrics")))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let hits = metrics
            .lines()
            .find(|l| l.starts_with("lorafleet_prefix_cache_hit_tokens_total"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        if hits >= cached[1] as f64 || Instant::now() > deadline {
            break hits;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    (cached[0], cached[1], db, hits)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_is_served_from_the_cache_and_reported() {
    let (first, second, db, hits) = twice(&[], "prefix_on").await;
    assert_eq!(first, 0, "nothing cached yet");
    assert!(second >= 64, "the shared blocks were reused: {second}");
    // The rows are durable before the answers.
    let rows: Vec<i32> =
        sqlx::query_scalar("SELECT cached_tokens FROM audit_log ORDER BY received_at")
            .fetch_all(&db.pool().await)
            .await
            .unwrap();
    assert_eq!(rows, vec![0, second as i32], "the audit rows record it");
    // And the worker's forward-pass time each request used.
    let device: Vec<Option<i64>> =
        sqlx::query_scalar("SELECT device_us FROM audit_log ORDER BY received_at")
            .fetch_all(&db.pool().await)
            .await
            .unwrap();
    assert!(
        device.iter().all(|d| d.is_some_and(|us| us > 0)),
        "each row keeps its device time: {device:?}"
    );
    assert!(
        hits >= second as f64,
        "the worker counted {hits} hit tokens"
    );

    let (first, second, _, hits) = twice(&["--no-prefix-caching"], "prefix_off").await;
    assert_eq!((first, second, hits), (0, 0, 0.0), "off means off");
}
