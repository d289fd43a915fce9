//! The audit log's integrity with real processes: the runtime role cannot
//! erase it, bad rows are quarantined one by one, clients that go away
//! still get their rows, and the gateway stops serving when it cannot keep
//! its rows or its registry (a stale snapshot, a full spool).

#[path = "support/audit_env.rs"]
mod audit_env;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use audit_env::*;
use lorafleet_gateway::audit::Durability;
use lorafleet_tests::{files_under, migrated_db, signal};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

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
    data_errors_case(Durability::Commit, "audit_data_errors").await;
}

/// The same through the journal: each batch is fsynced in the spool and
/// answered before its insert, and a journal segment whose rows are all
/// in Postgres (or quarantined) is deleted, not replayed.
#[tokio::test]
async fn journaled_rows_land_once_and_leave_no_segment() {
    data_errors_case(Durability::Journal, "audit_data_errors_journal").await;
}

async fn data_errors_case(durability: Durability, label: &str) {
    use lorafleet_gateway::audit::{AuditConfig, AuditRecord, start};
    let db = migrated_db(label).await;
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
        durability,
    };
    let (log, writer) = start(pool.clone(), &config).unwrap();
    let row = |i: usize| {
        let mut r = AuditRecord::refused(Uuid::now_v7(), chrono::Utc::now());
        r.api_key_prefix = Some("lf_x".into());
        r.end_user = Some(format!("u{i}"));
        r.model_name = format!("m{i}");
        // Every 37th row breaks audit_log_http_status_range.
        r.http_status = if i % 37 == 5 { 0 } else { 401 };
        r.error_code = Some("invalid_api_key".into());
        r.latency_us = 1;
        r.client_addr = Some("203.0.113.9".into());
        r
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
        Option<i64>,
    );
    let rows: Vec<Row> = loop {
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT request_id, status::text, http_status, error_code, completion_tokens,
                    end_user, api_key_prefix, device_us
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
    let (id, status, http, code, tokens, user, prefix, device) = &rows[0];
    // The device time it used up to its last token, though no `Finished`
    // came.
    assert!(device.is_some_and(|us| us > 0), "{device:?}");
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
    let (_, status, http, code, tokens, _, prefix, device) = &rows[1];
    assert!(device.is_some_and(|us| us > 0), "{device:?}");
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
    assert_eq!(
        ready.text().await.unwrap(),
        "not ready",
        "no details in public"
    );
    let why = e
        .http
        .get(format!("http://{}/readyz", gw.server.addr("metrics")))
        .send()
        .await
        .unwrap();
    assert_eq!(why.status(), 503);
    assert!(why.text().await.unwrap().contains("registry snapshot"));
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
            // About 25 rows' lines (a row records its client address and
            // occurrences too).
            "--audit-spool-max-bytes",
            "81920",
        ])
        .await;
    let mut answered = HashSet::new();
    let spooled = || {
        files_under(e.spool.path())
            .iter()
            .filter_map(|p| std::fs::metadata(p).ok())
            .map(|m| m.len())
            .sum::<u64>()
    };
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
                // A full queue is refused too while the writer is still
                // giving up on Postgres and has not moved it to the spool
                // yet (a busy machine): only refusals once the spool holds
                // most of its limit (the rest of the limit is rows still in
                // the queue) count here.
                if spooled() < 81920 / 2 {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
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
    let spooled = spooled();
    assert!(spooled <= 81920, "{spooled} bytes spooled");
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
