//! A fleet of three gateways and four workers, all real processes on one
//! Redis and one Postgres: every gateway sends an adapter to the same
//! worker, a tenant's requests per minute and concurrency cap hold exactly
//! across the three, and a gateway killed under load loses no answered
//! request's audit row (each is there exactly once).

#[path = "support/admin_plane.rs"]
mod admin_plane;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use admin_plane::*;
use serde_json::{Value, json};

const GATEWAYS: usize = 3;
const WORKERS: usize = 4;

async fn ready(p: &Plane) {
    for g in 0..GATEWAYS {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            // The reasons are on the metrics listener; the public port
            // says only its status.
            let r = p
                .http
                .get(format!("http://{}/readyz", p.gateways[g].addr("metrics")))
                .send()
                .await;
            if let Ok(r) = r
                && r.status() == 200
                && r.text()
                    .await
                    .unwrap()
                    .contains(&format!("{WORKERS} workers up"))
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "gateway {g} never saw every worker"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let public = p
            .http
            .get(format!("{}/readyz", p.api_url(g)))
            .send()
            .await
            .unwrap();
        assert_eq!(public.status(), 200);
        assert_eq!(public.text().await.unwrap(), "ready", "gateway {g}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_agree_share_limits_exactly_and_lose_no_answered_row() {
    let p = plane_sized("fleet_of_gateways", GATEWAYS, WORKERS, "llama-gqa").await;
    // Every gateway sees every worker before any request, so that none
    // places an adapter while its ring owner looks down.
    ready(&p).await;
    let (key, _, _) = acme_support(&p, "llama-gqa/o-r2");
    route_all(
        &p,
        "acme",
        "ops",
        register_adapter(&p, "acme", "ops", "llama-gqa/o-r2"),
    );
    for g in 0..GATEWAYS {
        for model in ["support", "ops"] {
            p.until_status(g, &key, model, 200).await;
        }
    }
    // A warm-up round from every gateway, then a second for the workers'
    // residency reports to reach every gateway: the views then agree.
    for g in 0..GATEWAYS {
        for model in ["support", "ops"] {
            let (s, v) = p.complete(g, &key, model, "warm").await;
            assert_eq!(s, 200, "{v}");
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;

    // Routing agreement: one request at a time, each model from every
    // gateway lands on one worker.
    for round in 0..3 {
        for g in 0..GATEWAYS {
            for model in ["support", "ops"] {
                let (s, v) = p.complete(g, &key, model, &format!("agree-{round}")).await;
                assert_eq!(s, 200, "{v}");
            }
        }
    }
    let placed: Vec<(String, String)> = sqlx::query_as(
        "SELECT model_name, worker_id FROM audit_log
         WHERE status = 'ok' AND end_user LIKE 'agree-%'",
    )
    .fetch_all(&p.pool)
    .await
    .unwrap();
    assert_eq!(placed.len(), 3 * GATEWAYS * 2, "{placed:?}");
    let mut workers_of: HashMap<String, HashSet<String>> = HashMap::new();
    for (model, worker) in placed {
        workers_of.entry(model).or_default().insert(worker);
    }
    let trace: Vec<(String, String, String, Option<String>)> = sqlx::query_as(
        "SELECT end_user, model_name, worker_id, adapter_residency FROM audit_log
         WHERE status = 'ok' AND (end_user = 'warm' OR end_user LIKE 'agree-%')
         ORDER BY received_at",
    )
    .fetch_all(&p.pool)
    .await
    .unwrap();
    for (model, workers) in &workers_of {
        assert_eq!(workers.len(), 1, "{model} went to {workers:?}: {trace:#?}");
    }

    // Requests per minute, exact across the three: a tenant of six a
    // minute, nine requests sent round robin, six pass. (Its route is
    // awaited through /v1/models, which spends none of them.)
    p.ctl_json(&["tenants", "create", "globex", "--rpm-limit", "6"]);
    let globex = p.ctl_json(&["keys", "create", "globex"])["key"]
        .as_str()
        .unwrap()
        .to_owned();
    let id = register_adapter(&p, "globex", "support", "llama-gqa/qv-r8");
    route_all(&p, "globex", "support", id);
    for g in 0..GATEWAYS {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let models: Value = p
                .http
                .get(format!("{}/v1/models", p.api_url(g)))
                .bearer_auth(&globex)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap_or(Value::Null);
            if models["data"].as_array().is_some_and(|d| !d.is_empty()) {
                break;
            }
            assert!(Instant::now() < deadline, "gateway {g}: {models}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    away_from_a_minute_boundary().await;
    let mut passed = 0;
    for i in 0..9 {
        let (s, v) = p.complete(i % GATEWAYS, &globex, "support", "rpm").await;
        match s {
            200 => passed += 1,
            429 => assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{v}"),
            other => panic!("{other}: {v}"),
        }
    }
    assert_eq!(passed, 6, "the minute's six, across three gateways");

    // Concurrency, exact across the three: of twelve long requests sent at
    // once, four to each gateway, at most three run.
    p.ctl_json(&["tenants", "update", "acme", "--max-concurrent", "3"]);
    for g in 0..GATEWAYS {
        p.until_status(g, &key, "support", 200).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let answers = at_once(&p, &key, 12, 400).await;
    let ran = answers.iter().filter(|(s, _)| *s == 200).count();
    assert!((1..=3).contains(&ran), "{ran} ran: {answers:?}");
    p.ctl_json(&["tenants", "update", "acme", "--max-concurrent", "default"]);
    for g in 0..GATEWAYS {
        p.until_status(g, &key, "support", 200).await;
    }

    // A gateway killed under load: every request any gateway answered has
    // its row exactly once.
    let p = std::sync::Arc::new(p);
    let sends: Vec<_> = (0..36)
        .map(|i| {
            let p = p.clone();
            let key = key.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(20 * i as u64)).await;
                let r = p
                    .http
                    .post(format!("{}/v1/completions", p.api_url(i % GATEWAYS)))
                    .bearer_auth(&key)
                    .json(&json!({"model": "support", "prompt": "under load",
                                  "max_tokens": 32, "ignore_eos": true, "user": "load"}))
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status() == 200 => {
                        r.json::<Value>().await.ok().map(|v| request_id(&v))
                    }
                    _ => None,
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed = p.gateways[GATEWAYS - 1].child.id();
    lorafleet_tests::signal(killed, "KILL");
    let mut answered = Vec::new();
    for s in sends {
        if let Some(id) = s.await.unwrap() {
            answered.push(id);
        }
    }
    assert!(answered.len() >= 20, "{} answered", answered.len());
    for id in &answered {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM audit_log WHERE request_id = $1::uuid")
                .bind(id)
                .fetch_one(&p.pool)
                .await
                .unwrap();
        assert_eq!(n, 1, "request {id}: {n} rows");
    }
}
