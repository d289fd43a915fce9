//! The usage rollups (`usage_hourly`, migration 0023; `usage_daily`,
//! migration 0031) against the log they sum, and the reports read from
//! them against the hours they price.

use chrono::{DateTime, Utc};
use lorafleet_gateway::admin::types::UsageRow as Report;
use lorafleet_gateway::db::MIGRATOR;
use lorafleet_gateway::usage::{Grouping, UsageQuery};
use lorafleet_tests::{TestDb, login_member_of};
use sqlx::PgPool;
use uuid::Uuid;

/// Twelve audit rows in one statement, as the writer inserts them (`ON
/// CONFLICT DO NOTHING`), `tag` naming their request ids: two tenants,
/// three hours from `base`, every status, an adapter on half, an
/// evaluation row, an aggregated row of three, device time on half, and
/// (with `load`, once migration 0029 made the column) adapter-load time on
/// the adapter rows.
async fn usage_rows(pool: &PgPool, tag: &str, base: DateTime<Utc>, load: bool) -> u64 {
    let (load_column, load_value) = if load {
        (", load_us", ", CASE WHEN k % 2 = 0 THEN 37 * k + 1 END")
    } else {
        ("", "")
    };
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO audit_log (request_id, received_at, completed_at, tenant_id, subject,
                                model_name, route_id, lora_int_id, adapter_name,
                                adapter_version, base_hash, status, http_status, finish_reason,
                                prompt_tokens, completion_tokens, cached_tokens, occurrences,
                                device_us, latency_us{load_column})
         SELECT md5($1 || k)::UUID, t, t, md5('tenant' || k % 2)::UUID,
                CASE WHEN k = 5 THEN 'rollout-evaluator' END, 'm', md5('route')::UUID,
                CASE WHEN k % 2 = 0 THEN 7 END, CASE WHEN k % 2 = 0 THEN 'a' END,
                CASE WHEN k % 2 = 0 THEN 1 END, 'h',
                (ARRAY['ok', 'error', 'rejected'])[k % 3 + 1]::audit_status,
                (ARRAY[200, 500, 429])[k % 3 + 1], CASE WHEN k % 3 = 0 THEN 'stop' END,
                10 + k, k, k % 4, CASE WHEN k = 7 THEN 3 ELSE 1 END,
                CASE WHEN k % 2 = 0 THEN 1000 * k END, 1{load_value}
           FROM generate_series(0, 11) k,
                LATERAL (SELECT $2 + (k % 3) * INTERVAL '1 hour' + k * INTERVAL '1 second' AS t) x
         ON CONFLICT (request_id, received_at) DO NOTHING"
    )))
    .bind(tag)
    .bind(base)
    .execute(pool)
    .await
    .unwrap()
    .rows_affected()
}

/// The rows of the rollup by `unit` (`hour` or `day`), in key order.
async fn rollup_rows(pool: &PgPool, unit: &str) -> Vec<UsageRow> {
    let table = if unit == "day" {
        "usage_daily"
    } else {
        "usage_hourly"
    };
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {unit}, tenant_id, route_id, lora_int_id, base_hash, evaluation, status::TEXT,
                requests, prompt_tokens, completion_tokens, cached_tokens, ARRAY[device_us, load_us]
           FROM {table} ORDER BY 1, 2, 3, 4, 5, 6, 7"
    )))
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The log's `GROUP BY` by `unit`, as the rollup of that unit holds it.
async fn log_rows(pool: &PgPool, unit: &str) -> Vec<UsageRow> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT date_trunc('{unit}', received_at, 'UTC'), tenant_id, route_id, lora_int_id,
                base_hash, coalesce(subject = 'rollout-evaluator', false), status::TEXT,
                sum(occurrences)::BIGINT, sum(prompt_tokens)::BIGINT,
                sum(completion_tokens)::BIGINT, sum(cached_tokens)::BIGINT,
                ARRAY[coalesce(sum(device_us), 0), coalesce(sum(load_us), 0)]::BIGINT[]
           FROM audit_log GROUP BY 1, 2, 3, 4, 5, 6, 7 ORDER BY 1, 2, 3, 4, 5, 6, 7"
    )))
    .fetch_all(pool)
    .await
    .unwrap()
}

type UsageRow = (
    DateTime<Utc>,
    Option<Uuid>,
    Option<Uuid>,
    Option<i64>,
    Option<String>,
    bool,
    String,
    i64,
    i64,
    i64,
    i64,
    // Device and adapter-load microseconds.
    Vec<i64>,
);

/// The hourly and daily usage rollups (migrations 0023 and 0031) each
/// equal a `GROUP BY` over the log, exactly: rows the log held before the
/// migrations (backfilled),
/// rows the serving role inserted since (many in one statement), and a
/// replay of those that inserts nothing and adds nothing.
#[tokio::test]
async fn usage_rollups_equal_a_group_by_over_the_log() {
    let db = TestDb::create("usage_rollup").await;
    let pool = db.pool().await;
    MIGRATOR.run_to(22, &pool).await.unwrap();
    let hour = Utc::now().timestamp() / 3600 * 3600 - 2 * 86_400;
    let base = DateTime::from_timestamp(hour + 15 * 60, 0).unwrap();
    assert_eq!(usage_rows(&pool, "before", base, false).await, 12);
    MIGRATOR.run(&pool).await.unwrap();
    let runtime = PgPool::connect(&db.url_as(&login_member_of(&pool, "lorafleet_runtime").await))
        .await
        .unwrap();
    assert_eq!(usage_rows(&runtime, "after", base, true).await, 12);
    assert_eq!(
        usage_rows(&runtime, "after", base, true).await,
        0,
        "a replay"
    );
    let (rollup, log) = (
        rollup_rows(&pool, "hour").await,
        log_rows(&pool, "hour").await,
    );
    assert_eq!(rollup, log);
    // The daily rollup (migration 0031, backfilled from the hours, then
    // kept by the same trigger) is the log's GROUP BY by day.
    let (daily, log_daily) = (
        rollup_rows(&pool, "day").await,
        log_rows(&pool, "day").await,
    );
    assert_eq!(daily, log_daily);
    assert!(!daily.is_empty());
    // Three hours, both tenants, the evaluation row apart.
    assert!(rollup.len() >= 7, "{rollup:?}");
    assert!(rollup.iter().any(|r| r.5), "evaluation traffic apart");
    assert!(
        rollup.iter().any(|r| r.11[1] > 0),
        "adapter-load time rolled up"
    );
    let requests: i64 = rollup.iter().map(|r| r.7).sum();
    assert_eq!(
        requests,
        2 * (12 + 2),
        "an aggregated row counts its occurrences"
    );
}

/// A report by day (or over a whole span) reads a whole day from the daily
/// rollup only when no price starts inside it, and prices every hour as a
/// report by hour does: a day with a price change inside, and a span's
/// partial first and last days, are read an hour at a time. Checked
/// against the same span by hour, added up per day; then again with the
/// hourly rows of the days the daily rollup stands for deleted, which
/// leaves the report unchanged only if those days are read from it.
#[tokio::test]
async fn a_report_by_day_reads_days_without_a_price_change_from_the_daily_rollup() {
    let db = TestDb::create("usage_daily").await;
    let pool = db.pool().await;
    MIGRATOR.run(&pool).await.unwrap();
    let d0 = (Utc::now().timestamp() / 86_400 - 8) * 86_400;
    let at = |d: i64, h: i64| DateTime::from_timestamp(d0 + d * 86_400 + h * 3600, 0).unwrap();
    sqlx::query(
        "INSERT INTO base_models (name, base_hash, architecture)
         VALUES ('priced', repeat('cd', 32), 'llama')",
    )
    .execute(&pool)
    .await
    .unwrap();
    // Six days of two tenants' rows, one every 3 hours, each hour's device
    // time different; one statement, as the writer inserts.
    sqlx::query(
        "INSERT INTO audit_log (request_id, received_at, completed_at, tenant_id, model_name,
                                base_hash, status, http_status, finish_reason, prompt_tokens,
                                completion_tokens, cached_tokens, occurrences, device_us,
                                latency_us)
         SELECT gen_random_uuid(), t, t, md5('tenant' || k % 2)::UUID, 'm', repeat('cd', 32),
                'ok', 200, 'stop', k, 2 * k, 0, 1, 60000000 * (k % 7 + 1), 1
           FROM generate_series(0, 47) k,
                LATERAL (SELECT $1 + k * INTERVAL '3 hours' + INTERVAL '10 minutes' AS t) x",
    )
    .bind(at(0, 0))
    .execute(&pool)
    .await
    .unwrap();
    // 2 a device-hour from day 0, 3 from inside day 2, 5 from day 3's
    // first hour.
    for (t, price) in [(at(0, 0), 2), (at(2, 13), 3), (at(3, 0), 5)] {
        sqlx::query(
            "INSERT INTO prices (base_model, effective_at, device_hour, created_by)
             VALUES ('priced', $1, $2::INT4, 'test')",
        )
        .bind(t)
        .bind(price)
        .execute(&pool)
        .await
        .unwrap();
    }
    let (from, to) = (at(0, 7), at(5, 5));
    let report = |group_by: &'static str, tenant: Option<Uuid>| {
        let pool = pool.clone();
        async move {
            let g = Grouping::parse(Some(group_by), &["tenant", "day", "hour"]).unwrap();
            UsageQuery::new(from, to, g, tenant)
                .unwrap()
                .rows(&pool)
                .await
                .unwrap()
        }
    };
    // What each day should say: its hours, each at its own price.
    let by_day = |hours: &[Report]| {
        let mut days: Vec<(DateTime<Utc>, i64, i64, f64, f64)> = Vec::new();
        for h in hours {
            let t = h.period.unwrap().timestamp();
            let day = DateTime::from_timestamp(t / 86_400 * 86_400, 0).unwrap();
            if days.last().map(|d| d.0) != Some(day) {
                days.push((day, 0, 0, 0.0, 0.0));
            }
            let d = days.last_mut().unwrap();
            d.1 += h.requests;
            d.2 += h.prompt_tokens;
            d.3 += h.device_seconds;
            d.4 += h.device_cost.unwrap();
        }
        days
    };
    let check = |days: &[Report], want: &[(DateTime<Utc>, i64, i64, f64, f64)], what: &str| {
        assert_eq!(days.len(), want.len(), "{what}: {days:?}");
        for (d, w) in days.iter().zip(want) {
            assert_eq!(
                (d.period, d.requests, d.prompt_tokens),
                (Some(w.0), w.1, w.2),
                "{what}"
            );
            assert!((d.device_seconds - w.3).abs() < 1e-6, "{what}: {d:?} {w:?}");
            assert!(
                (d.device_cost.unwrap() - w.4).abs() < 1e-9,
                "{what}: priced as its hours are: {d:?} {w:?}"
            );
        }
    };
    let hours = report("hour", None).await;
    let want = by_day(&hours);
    assert_eq!(
        want.len(),
        6,
        "four whole days and two partial ones: {want:?}"
    );
    // Day 2 mixes two prices: a day priced at its first hour alone would
    // differ.
    let day2: Vec<f64> = hours
        .iter()
        .filter(|h| h.period.unwrap() >= at(2, 0) && h.period.unwrap() < at(3, 0))
        .map(|h| h.device_cost.unwrap() / h.device_seconds * 3600.0)
        .collect();
    let priced = |p: f64| day2.iter().any(|&v| (v - p).abs() < 1e-9);
    assert!(priced(2.0) && priced(3.0), "{day2:?}");
    check(&report("day", None).await, &want, "every tenant");
    let one: Uuid = sqlx::query_scalar("SELECT md5('tenant1')::UUID")
        .fetch_one(&pool)
        .await
        .unwrap();
    let one_want = by_day(&report("hour", Some(one)).await);
    check(&report("day", Some(one)).await, &one_want, "one tenant");
    let total = |rows: &[Report]| {
        rows.iter()
            .map(|r| (r.requests, r.device_cost.unwrap()))
            .fold((0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1))
    };
    let (whole, by_hours) = (total(&report("tenant", None).await), total(&hours));
    assert_eq!(whole.0, by_hours.0);
    assert!(
        (whole.1 - by_hours.1).abs() < 1e-9,
        "{whole:?} {by_hours:?}"
    );

    // Days 1, 3 and 4 are whole, with no price starting inside: their hours
    // are not read.
    let deleted = sqlx::query(
        "DELETE FROM usage_hourly WHERE (hour >= $1 AND hour < $2) OR (hour >= $3 AND hour < $4)",
    )
    .bind(at(1, 0))
    .bind(at(2, 0))
    .bind(at(3, 0))
    .bind(at(5, 0))
    .execute(&pool)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(deleted, 24, "eight hours of rows a day");
    check(&report("day", None).await, &want, "from the daily rollup");
    assert_eq!(
        report("hour", None).await.len(),
        hours.len() - 24,
        "by hour, the hours alone"
    );
}
