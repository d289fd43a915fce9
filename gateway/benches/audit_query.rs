//! Audit-query benchmark: compliance questions over a generated audit log
//! of at least 1M rows (10 tenants, 30 days, 1,000 adapters, 8 workers) in
//! a throwaway Postgres database.
//!
//! Each question is one tenant's one-day window, newest first, 100 rows a
//! page: the first page, a deep page (after 3,000 rows, reached by keyset
//! cursor), and the first page with an adapter and status filter too. Each
//! is timed through the gateway's `AuditQuery` (the SQL alone) and through
//! the real admin HTTP API (`GET /admin/v1/audit`, JWT checked, JSON
//! encoded) served in-process on loopback. The log is partitioned by day
//! (migration 0014) from the first generated day on, so a question reads
//! one day's partition; the table line says how many partitions there are
//! and how large the log is on disk.
//!
//! cargo bench -p lorafleet-gateway --bench audit_query [-- ROWS]
//!
//! Then each tenant's usage report over the whole span (by adapter and
//! day, read from the hourly rollups), timed the same two ways.
//!
//! `AUDIT_BENCH_KEEP=1` keeps the database at the end (its name is
//! printed) to look at the plans by hand.

use std::time::{Duration, Instant};

use chrono::{DateTime, TimeZone, Utc};
use lorafleet_gateway::admin::{self, AuditFilter, AuditQuery, Cursor};
use lorafleet_gateway::registry::{Registry, Snapshot};
use lorafleet_gateway::router::fleet::Fleet;
use lorafleet_gateway::router::policy::Policy;
use sqlx::Connection;

const TENANTS: usize = 10;
/// Days the rows span (`AUDIT_BENCH_DAYS` to pack them denser: 10M rows
/// over 3 days fill each day's partition as 100M over 30 do).
fn days() -> i64 {
    std::env::var("AUDIT_BENCH_DAYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&d: &i64| (1..=30).contains(&d))
        .unwrap_or(30)
}
const SAMPLES: usize = 300;
const DEEP_ROWS: usize = 3_000;

fn percentile(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1e3
}

/// A small deterministic generator, so runs ask the same questions.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
}

fn main() {
    if std::env::args().any(|a| a == "--plot-only") {
        // Redraw the plot from the recorded runs, running nothing.
        plot(0, &[]);
        return;
    }
    let rows: u64 = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let days = days();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let db = format!("lorafleet_audit_bench_{}", std::process::id());
        let server = "postgres://postgres@127.0.0.1:5432/postgres";
        let mut c = sqlx::PgConnection::connect(server).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
            .execute(&mut c)
            .await
            .unwrap();
        let url = format!("postgres://postgres@127.0.0.1:5432/{db}");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect(&url)
            .await
            .unwrap();
        // Partitioned by day from the first generated day on, as a log
        // partitioned then and written since would be.
        let start: DateTime<Utc> = Utc.with_ymd_and_hms(2026, 10, 1, 0, 0, 0).unwrap();
        lorafleet_gateway::db::MIGRATOR
            .run_to(13, &pool)
            .await
            .unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE audit_log ADD CONSTRAINT audit_log_before_partitions
             CHECK (received_at < '{}'::timestamptz)",
            start.to_rfc3339()
        )))
        .execute(&pool)
        .await
        .unwrap();
        // The migrations alone: prepare_online would move a cutover that is
        // past to two days ahead.
        lorafleet_gateway::db::MIGRATOR.run(&pool).await.unwrap();

        let t0 = Instant::now();
        for i in 0..TENANTS {
            sqlx::query("INSERT INTO tenants (name) VALUES ($1)")
                .bind(format!("tenant-{i:02}"))
                .execute(&pool)
                .await
                .unwrap();
        }
        // The registry's adapters adapter-0 … adapter-999 (lora_int_id 1 …
        // 1000), which the rows name.
        let base: i64 = sqlx::query_scalar(
            "INSERT INTO base_models (name, base_hash, architecture)
             VALUES ('bench-base', repeat('ab', 32), 'llama') RETURNING id",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO adapters (name, version, base_model_id, rank, alpha, target_modules,
                                   artifact_uri, artifact_sha256)
             SELECT 'adapter-' || n, 1, $1, 8, 16, ARRAY['q_proj'], 'bench/' || n, repeat('ab', 32)
               FROM generate_series(0, 999) n ORDER BY n",
        )
        .bind(base)
        .execute(&pool)
        .await
        .unwrap();
        let step_us = days * 86_400 * 1_000_000 / rows as i64;
        // Rows in time order, as a gateway writes them; every tenant spread
        // over the whole month. A million rows a statement: the rollup
        // trigger's transition table of one statement of 100M rows spills
        // tens of GB to temporary files.
        const CHUNK: u64 = 1_000_000;
        for first in (0..rows).step_by(CHUNK as usize) {
            sqlx::query(
                "WITH t AS (SELECT array_agg(id ORDER BY name) AS ids FROM tenants)
                 INSERT INTO audit_log (request_id, received_at, completed_at, tenant_id, model_name,
                     lora_int_id, adapter_name, adapter_version, base_hash, worker_id,
                     adapter_residency, status, http_status, error_code, finish_reason,
                     prompt_tokens, completion_tokens, latency_us, ttft_us)
                 SELECT gen_random_uuid(), ts, ts + interval '300 milliseconds',
                        t.ids[1 + (g % 10)::INT], 'model-' || (g % 7),
                        1 + g % 1000, 'adapter-' || (g % 1000), 1, repeat('ab', 32),
                        'w' || (g % 8), 'device',
                        CASE WHEN g % 50 = 0 THEN 'error'::audit_status ELSE 'ok' END,
                        CASE WHEN g % 50 = 0 THEN 502 ELSE 200 END,
                        CASE WHEN g % 50 = 0 THEN 'worker_failed' END,
                        CASE WHEN g % 50 = 0 THEN NULL ELSE 'stop' END,
                        20, 50, 300000, 40000
                 FROM t, generate_series($4, $1 - 1) AS g,
                      LATERAL (SELECT $2 + make_interval(secs => g * $3 / 1e6) AS ts) x",
            )
            .bind((first + CHUNK).min(rows) as i64)
            .bind(start)
            .bind(step_us as f64)
            .bind(first as i64)
            .execute(&pool)
            .await
            .unwrap();
        }
        // And the rollups the trigger kept, as autovacuum would.
        sqlx::query("ANALYZE audit_log, usage_hourly, usage_daily")
            .execute(&pool)
            .await
            .unwrap();
        let loaded = t0.elapsed();
        let count: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_log")
            .fetch_one(&pool)
            .await
            .unwrap();

        // The real admin API, in-process on loopback.
        let secret_dir = tempfile::tempdir().unwrap();
        let secret_path = secret_dir.path().join("admin.secret");
        let secret = "a-benchmark-secret-of-at-least-32-bytes";
        std::fs::write(&secret_path, secret).unwrap();
        let jwt = lorafleet_gateway::auth::jwt_config(
            "--admin-jwt-",
            Some(&secret_path),
            None,
            &["HS256".to_owned()],
            Some("bench"),
            Some("admin"),
        )
        .unwrap()
        .unwrap();
        let now = Utc::now().timestamp();
        let token = jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &serde_json::json!({"sub": "bench", "role": "auditor", "iss": "bench",
                                "aud": "admin", "exp": now + 3600,
                                "jti": uuid::Uuid::now_v7().to_string()}),
            &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()),
        )
        .unwrap();
        let app = admin::router(admin::AdminState {
            pool: pool.clone(),
            registry: Registry::new(Snapshot::load(&pool).await.unwrap()),
            redis: None,
            channel: String::new(),
            jwt: std::sync::Arc::new(jwt),
            artifact_roots: None,
            artifact_stores: lorafleet_store::ObjectStores::none(),
            max_lora_rank: 64,
            fleet: Fleet::new(
                Policy::default(),
                lorafleet_gateway::router::fleet::Transport::Plaintext,
            ),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let http = reqwest::Client::new();

        let mut rng = Lcg(42);
        let questions: Vec<(String, DateTime<Utc>)> = (0..SAMPLES)
            .map(|_| {
                let tenant = format!("tenant-{:02}", rng.next() as usize % TENANTS);
                let day = start + chrono::Duration::days(rng.next() as i64 % days);
                (tenant, day)
            })
            .collect();
        let filter = |tenant: &str, day: DateTime<Utc>| AuditFilter {
            tenant: Some(tenant.to_owned()),
            since: Some(day),
            until: Some(day + chrono::Duration::days(1)),
            limit: Some(100),
            ..AuditFilter::default()
        };

        // Cursors for the deep page of each question, walked page by page.
        let mut deep_cursors = Vec::new();
        for (tenant, day) in &questions {
            let q = AuditQuery::new(&pool, &filter(tenant, *day)).await.unwrap();
            let mut cursor = None;
            for _ in 0..DEEP_ROWS / 100 {
                cursor = q.page(&pool, cursor).await.unwrap().1;
            }
            deep_cursors.push(cursor.expect("a day holds more than 3,000 rows per tenant"));
        }

        let mut results: Vec<(&str, &str, Vec<Duration>)> = Vec::new();
        for (name, deep, extra) in [
            ("first page", false, false),
            ("deep page (after 3,000 rows)", true, false),
            ("first page, + adapter and status filter", false, true),
        ] {
            let mut sql = Vec::new();
            let mut api = Vec::new();
            for (i, (tenant, day)) in questions.iter().enumerate() {
                let mut f = filter(tenant, *day);
                // An adapter the tenant's rows name with status ok (row g:
                // tenant g % 10, adapter g % 1000, an error when g % 50 = 0).
                let k: usize = tenant["tenant-".len()..].parse().unwrap();
                let m = i % 100 + usize::from(k == 0 && i % 5 == 0);
                let adapter = format!("adapter-{}", k + 10 * m);
                if extra {
                    f.adapter = Some(adapter.clone());
                    f.status = Some("ok".into());
                }
                let cursor = deep.then(|| deep_cursors[i]);
                let t = Instant::now();
                let q = AuditQuery::new(&pool, &f).await.unwrap();
                let (page, _) = q.page(&pool, cursor).await.unwrap();
                sql.push(t.elapsed());
                assert!(
                    if extra {
                        !page.is_empty()
                    } else {
                        page.len() == 100
                    },
                    "{name}: {} rows for {f:?}: {:?}\n{}",
                    page.len(),
                    q,
                    q.explain(&pool, cursor).await.unwrap()
                );

                let mut query: Vec<(&str, String)> = vec![
                    ("tenant", tenant.clone()),
                    ("since", day.to_rfc3339()),
                    ("until", (*day + chrono::Duration::days(1)).to_rfc3339()),
                    ("limit", "100".into()),
                ];
                if extra {
                    query.push(("adapter", adapter.clone()));
                    query.push(("status", "ok".into()));
                }
                if let Some(c) = cursor {
                    query.push(("cursor", Cursor::encode(&c)));
                }
                let t = Instant::now();
                let resp = http
                    .get(format!("http://{addr}/admin/v1/audit"))
                    .bearer_auth(&token)
                    .query(&query)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
                let body: serde_json::Value = resp.json().await.unwrap();
                api.push(t.elapsed());
                assert_eq!(body["rows"].as_array().unwrap().len(), page.len());
            }
            results.push((name, "AuditQuery (SQL)", sql));
            results.push((name, "admin HTTP API", api));
        }

        let usage = usage_reports(&pool, &http, addr, &token, start, days).await;

        let (partitions, bytes): (i64, i64) = sqlx::query_as(
            "SELECT count(*), sum(pg_total_relation_size(name::regclass))::INT8
               FROM audit_log_partitions()",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        println!();
        println!(
            "audit_log: {count} rows ({TENANTS} tenants, {days} days) in {partitions} partitions, \
             {:.2} GiB with indexes, generated and analysed in {:.1} s; {SAMPLES} questions each",
            bytes as f64 / (1u64 << 30) as f64,
            loaded.as_secs_f64()
        );
        println!();
        println!("| question (one tenant, one day, 100 rows) | through | p50 | p99 | max |");
        println!("|---|---|---:|---:|---:|");
        let mut p99s = Vec::new();
        for (name, through, mut v) in results {
            let (p50, p99) = (percentile(&mut v, 0.50), percentile(&mut v, 0.99));
            let max = v.last().unwrap().as_secs_f64() * 1e3;
            println!("| {name} | {through} | {p50:.2} ms | {p99:.2} ms | {max:.2} ms |");
            p99s.push((format!("{name}, {through}"), p99));
        }
        if days == 30 {
            plot(count as u64, &p99s);
        }
        println!();
        println!(
            "| usage report (one tenant, {days} days, by adapter and day, from the rollups) | through | p50 | p99 | max | rows |"
        );
        println!("|---|---|---:|---:|---:|---:|");
        for (through, mut v, rows) in usage {
            let (p50, p99) = (percentile(&mut v, 0.50), percentile(&mut v, 0.99));
            let max = v.last().unwrap().as_secs_f64() * 1e3;
            println!("| 30-day report | {through} | {p50:.2} ms | {p99:.2} ms | {max:.2} ms | {rows} |");
        }

        pool.close().await;
        if std::env::var_os("AUDIT_BENCH_KEEP").is_some() {
            println!("\nkept the database {db} (AUDIT_BENCH_KEEP): drop it by hand");
            return;
        }
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
        )))
        .execute(&mut c)
        .await
        .unwrap();
    });
}

/// Each tenant's report over the whole span, grouped by adapter and day,
/// asked [`SAMPLES`] times in turn: through `UsageQuery` (the SQL alone)
/// and the admin HTTP API (`GET /admin/v1/usage`). Each report's requests
/// add up to the tenant's audit rows (a `count(*)` over the log, checked
/// once per tenant). Returns (through, times, rows per report).
async fn usage_reports(
    pool: &sqlx::PgPool,
    http: &reqwest::Client,
    addr: std::net::SocketAddr,
    token: &str,
    start: DateTime<Utc>,
    days: i64,
) -> Vec<(&'static str, Vec<Duration>, usize)> {
    use lorafleet_gateway::usage::{Grouping, UsageQuery};
    let to = start + chrono::Duration::days(days);
    let tenants: Vec<(uuid::Uuid, i64)> = sqlx::query_as(
        "SELECT t.id, (SELECT count(*) FROM audit_log a WHERE a.tenant_id = t.id)
           FROM tenants t ORDER BY t.name",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let grouping = Grouping::parse(Some("adapter,day"), &["adapter", "day"]).unwrap();
    let (mut sql, mut api, mut rows) = (Vec::new(), Vec::new(), 0);
    for i in 0..SAMPLES {
        let (tenant, logged) = tenants[i % tenants.len()];
        let t = Instant::now();
        let report = UsageQuery::new(start, to, grouping, Some(tenant))
            .unwrap()
            .rows(pool)
            .await
            .unwrap();
        sql.push(t.elapsed());
        rows = report.len();
        if i < tenants.len() {
            let requests: i64 = report.iter().map(|r| r.requests).sum();
            assert_eq!(requests, logged, "the rollups are the log's GROUP BY");
        }
        let t = Instant::now();
        let resp = http
            .get(format!("http://{addr}/admin/v1/usage"))
            .bearer_auth(token)
            .query(&[
                ("from", start.to_rfc3339()),
                ("to", to.to_rfc3339()),
                ("group_by", "adapter,day".into()),
                ("tenant", tenant.to_string()),
            ])
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        // Timed to the body's last byte; read as JSON after.
        let bytes = resp.bytes().await.unwrap();
        api.push(t.elapsed());
        let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(body["rows"].as_array().unwrap().len(), report.len());
    }
    vec![
        ("UsageQuery (SQL)", sql, rows),
        ("admin HTTP API", api, rows),
    ]
}

#[path = "support/svg.rs"]
mod svg;

/// Each log size's p99s so far (`docs/plots/audit_query_p99.json`: this
/// run's replace its size's), drawn as p99 against log size
/// (`docs/plots/audit_query_p99.svg`). Only runs over the default 30 days
/// are kept, so every size has the same days and a denser day is a larger
/// log.
fn plot(rows: u64, p99s: &[(String, f64)]) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/plots");
    let json = std::path::Path::new(dir).join("audit_query_p99.json");
    let mut sizes: std::collections::BTreeMap<u64, serde_json::Map<String, serde_json::Value>> =
        std::fs::read_to_string(&json)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| {
                v.as_object().map(|o| {
                    o.iter()
                        .filter_map(|(k, v)| Some((k.parse().ok()?, v.as_object()?.clone())))
                        .collect()
                })
            })
            .unwrap_or_default();
    let round = |v: f64| serde_json::json!((v * 100.0).round() / 100.0);
    if !p99s.is_empty() {
        sizes.insert(
            rows,
            p99s.iter().map(|(k, v)| (k.clone(), round(*v))).collect(),
        );
    }
    let text = serde_json::to_string_pretty(
        &sizes
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::Object(v.clone())))
            .collect::<serde_json::Map<_, _>>(),
    )
    .unwrap();
    std::fs::write(&json, text + "\n").unwrap_or_else(|e| panic!("{}: {e}", json.display()));
    // Every question asked at any size, in the order first asked.
    let mut names: Vec<String> = Vec::new();
    for m in sizes.values() {
        for k in m.keys() {
            if !names.contains(k) {
                names.push(k.clone());
            }
        }
    }
    let chart = svg::Bars {
        title: "Audit log questions: p99 against the log's size (one tenant, one day, 100 rows)",
        y_label: "p99, ms (target 50)",
        groups: sizes
            .keys()
            .map(|r| format!("{}M rows", *r as f64 / 1e6))
            .collect(),
        series: names
            .iter()
            .map(|n| {
                let values = sizes
                    .values()
                    .map(|m| m.get(n).and_then(|v| v.as_f64()).unwrap_or(f64::NAN))
                    .collect();
                (n.clone(), values)
            })
            .collect(),
    };
    chart.write(&std::path::Path::new(dir).join("audit_query_p99.svg"));
}
