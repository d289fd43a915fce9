//! Unauthenticated traffic is cheap: a flood of bad keys from one address
//! is answered 429 once past its per-source limit, before any body is read,
//! and reaches the audit log as a few aggregated rows that still count
//! every request. `X-Forwarded-For` is believed only from
//! `--trusted-proxies`.

#[path = "support/fleet.rs"]
mod fleet;

use std::collections::HashMap;

use fleet::*;
use futures::StreamExt;
use serde_json::json;

/// One bad-key request: its status and `Retry-After`.
async fn bad_key(f: &Fleet, i: usize, forwarded_for: Option<&str>) -> (u16, Option<u64>) {
    let mut r = f
        .http
        .post(format!("{}/v1/completions", f.base_url))
        .bearer_auth(format!("lf_flood{i:05}.not-a-secret"))
        .json(&json!({"model": "support", "prompt": "hi"}));
    if let Some(x) = forwarded_for {
        r = r.header("x-forwarded-for", x);
    }
    let resp = r.send().await.expect("the gateway answers");
    let retry = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    (resp.status().as_u16(), retry)
}

/// Failed-authentication rows (no tenant): (rows, requests they count).
async fn failed_rows(f: &Fleet) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*), coalesce(sum(occurrences), 0)::int8 FROM audit_log
         WHERE tenant_id IS NULL AND error_code IN
               ('invalid_api_key', 'too_many_failed_authentications')",
    )
    .fetch_one(&f.pool)
    .await
    .unwrap()
}

async fn wait_failed(f: &Fleet, requests: i64) -> i64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (rows, counted) = failed_rows(f).await;
        if counted >= requests {
            assert_eq!(counted, requests, "every failed request counted once");
            return rows;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{counted} of {requests} failed requests in the audit log"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// 10,000 bad keys from one address: the first 20 (the burst) get 401,
/// the rest 429 with `Retry-After`; the audit log holds a few rows that
/// count all 10,000, with the address and the first and last key prefix;
/// a tenant at the same address is still served, and its own row carries
/// the address too. A forged `X-Forwarded-For` changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_key_flood_is_throttled_and_costs_a_few_audit_rows() {
    let f = fleet("failed_auth_flood").await;
    const FLOOD: usize = 10_000;
    let statuses: Vec<(u16, Option<u64>)> = futures::stream::iter(0..FLOOD)
        .map(|i| {
            let f = &f;
            // Every tenth forges a different address: not believed.
            let forged = (i % 10 == 0).then(|| format!("198.51.100.{}", i % 250));
            async move { bad_key(f, i, forged.as_deref()).await }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    let mut by_status: HashMap<u16, usize> = HashMap::new();
    for (s, retry) in &statuses {
        *by_status.entry(*s).or_default() += 1;
        if *s == 429 {
            assert!(retry.is_some_and(|r| r >= 1), "429 without Retry-After");
        }
    }
    let unauth = by_status.get(&401).copied().unwrap_or(0);
    let throttled = by_status.get(&429).copied().unwrap_or(0);
    println!("{FLOOD} bad keys: {unauth} × 401, {throttled} × 429");
    assert_eq!(unauth + throttled, FLOOD, "{by_status:?}");
    // The burst, plus what the bucket refilled (10 a minute) meanwhile.
    assert!((20..=40).contains(&unauth), "{by_status:?}");

    // The address behind the flood still gets its tenants served.
    let (s, v) = f.complete("support", "hello", None).await;
    assert_eq!(s, 200, "{v}");

    let rows = wait_failed(&f, FLOOD as i64).await;
    println!("{FLOOD} failed authentications: {rows} audit rows");
    assert!(rows <= 40, "{rows} rows for one address");
    let (addrs, first, last): (Vec<Option<String>>, Option<String>, Option<String>) =
        sqlx::query_as(
            "SELECT array_agg(DISTINCT host(client_addr)),
                    (array_agg(api_key_prefix ORDER BY received_at))[1],
                    (array_agg(last_key_prefix ORDER BY completed_at DESC))[1]
             FROM audit_log WHERE tenant_id IS NULL",
        )
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert_eq!(
        addrs,
        vec![Some("127.0.0.1".to_owned())],
        "the forged header is not believed"
    );
    for p in [first, last] {
        assert!(
            p.as_deref().is_some_and(|p| p.starts_with("lf_flood")),
            "{p:?}"
        );
    }
    // The tenant's own row: one row, with its address.
    f.wait_audit(FLOOD as i64 + 1).await;
    let addr: Option<String> =
        sqlx::query_scalar("SELECT host(client_addr) FROM audit_log WHERE tenant_id IS NOT NULL")
            .fetch_one(&f.pool)
            .await
            .unwrap();
    assert_eq!(addr.as_deref(), Some("127.0.0.1"));
}

/// Behind a trusted proxy, each forwarded address has its own bucket and
/// its own rows; a completion's row carries the forwarded address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_trusted_proxy_each_client_address_is_its_own_source() {
    let f = fleet_with("failed_auth_proxy", &["--trusted-proxies", "127.0.0.0/8"]).await;
    // The proxy appends what it saw after whatever the client wrote.
    let via = |client: &str| format!("6.6.6.6, {client}");
    let mut first = Vec::new();
    for i in 0..25 {
        first.push(bad_key(&f, i, Some(&via("203.0.113.1"))).await.0);
    }
    assert!(first[..20].iter().all(|s| *s == 401), "{first:?}");
    assert!(first[20..].iter().all(|s| *s == 429), "{first:?}");
    // Another client behind the same proxy starts with a full bucket.
    assert_eq!(bad_key(&f, 99, Some(&via("203.0.113.2"))).await.0, 401);
    // A completion records its client.
    let status = f
        .http
        .post(format!("{}/v1/completions", f.base_url))
        .bearer_auth(ACME_KEY)
        .header("x-forwarded-for", "192.0.2.44")
        .json(&json!({"model": "support", "prompt": "hello", "max_tokens": 2}))
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status, 200);
    wait_failed(&f, 26).await;
    let per_client: Vec<(Option<String>, i64)> = sqlx::query_as(
        "SELECT host(client_addr), sum(occurrences)::int8 FROM audit_log
         WHERE tenant_id IS NULL GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&f.pool)
    .await
    .unwrap();
    assert_eq!(
        per_client,
        vec![
            (Some("203.0.113.1".to_owned()), 25),
            (Some("203.0.113.2".to_owned()), 1)
        ]
    );
    f.wait_audit(27).await;
    let addr: Option<String> =
        sqlx::query_scalar("SELECT host(client_addr) FROM audit_log WHERE tenant_id IS NOT NULL")
            .fetch_one(&f.pool)
            .await
            .unwrap();
    assert_eq!(addr.as_deref(), Some("192.0.2.44"));
}
