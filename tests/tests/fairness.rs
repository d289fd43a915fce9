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

/// A JSON schema of `bytes` or so, its own for `tag` (so no compiled copy
/// of another request's can serve it): many properties, each a regular
/// expression or an enum of its own, the costliest shape for the
/// compiler's lexer.
fn costly_schema(tag: usize, bytes: usize) -> serde_json::Value {
    let mut properties = serde_json::Map::new();
    let (mut i, mut size) = (0, 0);
    while size < bytes {
        let kind = if i % 2 == 0 {
            json!({"type": "string", "pattern": format!("^[a-f]{{{}}}[0-9]{{2,{}}}x{tag}$", i % 7 + 1, i % 5 + 3)})
        } else {
            json!({"enum": (0..6).map(|j| format!("v{tag}_{i}_{j}")).collect::<Vec<_>>()})
        };
        let name = format!("field_{tag}_{i}");
        size += name.len() + kind.to_string().len() + 4;
        properties.insert(name, kind);
        i += 1;
    }
    let required: Vec<String> = properties.keys().take(4).cloned().collect();
    json!({"type": "object", "properties": properties, "required": required})
}

/// Tenant B's gaps between streamed deltas over streams of 48 tokens:
/// the mean gap and the longest (a stall shows in the second), each
/// averaged over the streams, in seconds.
#[derive(Debug, Clone, Copy)]
struct Gaps {
    mean: f64,
    longest: f64,
}

async fn inter_token_gaps(http: &reqwest::Client, gateway: &str, streams: usize) -> Gaps {
    let mut all = Gaps {
        mean: 0.0,
        longest: 0.0,
    };
    for _ in 0..streams {
        let mut r = http
            .post(format!("http://{gateway}/v1/completions"))
            .bearer_auth(GLOBEX_KEY)
            .json(
                &json!({"model": "chat", "prompt": "hello there", "max_tokens": 48,
                          "ignore_eos": true, "stream": true}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let mut deltas: Vec<Instant> = Vec::new();
        while let Some(c) = r.chunk().await.unwrap() {
            let n = String::from_utf8_lossy(&c).matches("\"text\"").count();
            deltas.extend(std::iter::repeat_n(Instant::now(), n));
        }
        assert!(
            deltas.len() >= 16,
            "B's stream carried {} deltas",
            deltas.len()
        );
        let gaps: Vec<f64> = deltas
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs_f64())
            .collect();
        all.mean += gaps.iter().sum::<f64>() / gaps.len() as f64 / streams as f64;
        all.longest += gaps.iter().copied().fold(0.0, f64::max) / streams as f64;
    }
    all
}

/// Tenant A's flood: `lanes` loops of requests of 16 choices each, with a
/// schema near the largest the limits take (a new one each request) or
/// none, until `stop`. Returns the requests that were served.
fn flood(
    http: &reqwest::Client,
    gateway: &str,
    lanes: usize,
    costly: bool,
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Vec<tokio::task::JoinHandle<usize>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static TAG: AtomicUsize = AtomicUsize::new(0);
    (0..lanes)
        .map(|_| {
            let (http, url, stop) = (
                http.clone(),
                format!("http://{gateway}/v1/completions"),
                stop.clone(),
            );
            tokio::spawn(async move {
                let mut served = 0;
                while !stop.load(Ordering::Relaxed) {
                    let mut body = json!({"model": "chat", "prompt": "Answer in JSON:",
                        "max_tokens": 8, "n": 16, "temperature": 1.0, "ignore_eos": true});
                    if costly {
                        let tag = TAG.fetch_add(1, Ordering::Relaxed);
                        // Built off the runtime's threads, which read B's
                        // stream.
                        body["guided_json"] =
                            tokio::task::spawn_blocking(move || costly_schema(tag, 60 * 1024))
                                .await
                                .unwrap();
                    }
                    let r = http
                        .post(&url)
                        .bearer_auth(ACME_KEY)
                        .json(&body)
                        .send()
                        .await
                        .expect("A's request is answered");
                    match r.status().as_u16() {
                        200 => {
                            let v: serde_json::Value = r.json().await.unwrap();
                            let choices = v["choices"].as_array().unwrap();
                            assert_eq!(choices.len(), 16, "{v}");
                            if costly {
                                // Each choice keeps to its schema: an object
                                // opening with one of its fields.
                                for c in choices {
                                    let text = c["text"].as_str().unwrap();
                                    assert!(text.starts_with("{\"field_"), "{text:?}");
                                }
                            }
                            served += 1;
                        }
                        429 => tokio::time::sleep(Duration::from_millis(50)).await,
                        other => panic!("A's request: {other} {:?}", r.text().await),
                    }
                }
                served
            })
        })
        .collect()
}

/// Issue 62's "tenant work off the engine thread", through real processes:
/// tenant A sends the costliest constrained requests the limits allow (16
/// choices, a schema of about 60 KB, new each time) in 4 loops while
/// tenant B streams. Compiling A's schemas and computing their masks must
/// not stall B's steps: B's inter-token gap beside that flood stays within
/// 2× of its gap beside the same flood without schemas. (Beside B alone
/// it is larger either way: A's rows share B's steps, constrained or not;
/// fair admission orders the queue, it does not keep A's rows out.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenants_costliest_constraints_do_not_stall_another_tenants_tokens() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let db = migrated_db("fair_constraints").await;
    let pool = db.pool().await;
    seed_base_routes(&pool, &[("acme", ACME_KEY), ("globex", GLOBEX_KEY)], "chat").await;
    let worker = fixture_worker("w0", &[]);
    let spool = tempfile::tempdir().unwrap();
    let gateway = ready_gateway(&db.url(), &worker, spool.path(), &[]).await;
    let addr = gateway.addr("http").to_owned();
    let http = reqwest::Client::new();
    inter_token_gaps(&http, &addr, 1).await; // warm up
    let alone = inter_token_gaps(&http, &addr, 3).await;
    let mut beside = Vec::new();
    for costly in [false, true] {
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let lanes = flood(&http, &addr, 4, costly, &stop);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let gaps = inter_token_gaps(&http, &addr, 3).await;
        stop.store(true, Ordering::Relaxed);
        let mut served = 0;
        for lane in lanes {
            served += lane.await.unwrap();
        }
        assert!(served >= 4, "A's flood was served {served} requests");
        eprintln!(
            "B's gaps (mean, longest): alone {:.2}/{:.2} ms, beside A's {} flood {:.2}/{:.2} ms \
             ({served} requests of A)",
            alone.mean * 1e3,
            alone.longest * 1e3,
            if costly { "constrained" } else { "plain" },
            gaps.mean * 1e3,
            gaps.longest * 1e3,
        );
        beside.push(gaps);
    }
    let (plain, constrained) = (beside[0], beside[1]);
    for (what, ratio) in [
        ("mean", constrained.mean / plain.mean),
        ("longest", constrained.longest / plain.longest),
    ] {
        assert!(
            ratio <= 2.0,
            "B's {what} gap beside A's constrained flood is {ratio:.2}x the same beside A's \
             plain flood: {beside:?} (alone {alone:?})"
        );
    }
}
