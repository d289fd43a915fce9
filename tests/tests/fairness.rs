//! Fair shares across the real processes: the gateway sends each tenant's
//! id as the worker's fairness key, with the tenant's weight, and the
//! worker accounts each tenant's service apart.

use std::time::{Duration, Instant};

use lorafleet_tests::{fixture_worker, migrated_db, ready_gateway, seed_base_routes};
use serde_json::json;
use uuid::Uuid;

const ACME_KEY: &str = "lf_acmefair01.acme-secret-0123456789";
const GLOBEX_KEY: &str = "lf_globexfair1.globex-secret-0123456789";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenant_is_its_own_weighted_share_of_the_worker() {
    let db = migrated_db("fairness").await;
    let pool = db.pool().await;
    seed_base_routes(&pool, &[("acme", ACME_KEY), ("globex", GLOBEX_KEY)], "chat").await;
    sqlx::query("UPDATE tenants SET weight = 4 WHERE name = 'acme'")
        .execute(&pool)
        .await
        .unwrap();
    let id = |name: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, Uuid>("SELECT id FROM tenants WHERE name = $1")
                .bind(name)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let (acme, globex) = (id("acme").await, id("globex").await);
    let worker = fixture_worker("w0", &[]);
    let spool = tempfile::tempdir().unwrap();
    let gateway = ready_gateway(&db.url(), &worker, spool.path(), &[]).await;
    let http = reqwest::Client::new();
    // The same request from each tenant: 8 prompt tokens or so, 8 new.
    for key in [ACME_KEY, GLOBEX_KEY] {
        let r = http
            .post(format!("http://{}/v1/completions", gateway.addr("http")))
            .bearer_auth(key)
            .json(
                &json!({"model": "chat", "prompt": "hello there", "max_tokens": 8,
                          "ignore_eos": true}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    // Each tenant's service, divided by its weight: acme's is a quarter.
    let served = |metrics: &str, tenant: Uuid| {
        metrics
            .lines()
            .find(|l| l.starts_with(&format!("lorafleet_fair_served_tokens{{key=\"{tenant}\"}}")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = reqwest::get(format!("http://{}/metrics", worker.addr("metrics")))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        // The gauges follow the worker's periodic reports: wait for the one
        // after both requests ended.
        let (a, g) = (served(&metrics, acme), served(&metrics, globex));
        if let (Some(a), Some(g)) = (a, g)
            && g > 0.0
            && (a * 4.0 - g).abs() < 1e-6
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "acme {a:?} x 4 is not globex {g:?}: {metrics}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
