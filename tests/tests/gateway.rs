//! The real gateway in front of two real workers on the fixture model, with
//! real Postgres and Redis (each behind a proxy the test can cut): tenants
//! get exactly their adapters, and the gateway rides out outages.

#[path = "support/fleet.rs"]
mod fleet;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use fleet::*;
use lorafleet_tests::{signal, spool_segments};
use serde_json::{Value, json};
use uuid::Uuid;

#[tokio::test]
async fn tenants_get_exactly_their_adapter_and_nothing_else() {
    // The test client stands for a trusted proxy: its traceparent is joined.
    let f = fleet_with("gateway_exact", &["--trusted-proxies", "127.0.0.1"]).await;
    let prompts = ["The quick brown fox", "Once upon a time"];
    let want = offline(&[
        (prompts[0], Some("qv-r8")),
        (prompts[1], Some("qv-r8")),
        (prompts[0], None),
        (prompts[1], Some("patterns")),
    ]);

    // A named model applies exactly its adapter; the base route gets the base.
    let mut calls = Vec::new();
    for (model, prompt) in [
        ("support", prompts[0]),
        ("support", prompts[1]),
        ("base-llama", prompts[0]),
    ] {
        calls.push(f.complete(model, prompt, None));
    }
    let results = futures::future::join_all(calls).await;
    for (i, (status, v)) in results.iter().enumerate() {
        assert_eq!(*status, 200, "{v}");
        assert_eq!(text(v), want[i], "case {i}: {v}");
        assert_eq!(v["object"], "text_completion");
        assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    }
    assert_ne!(want[0], want[2], "the adapter changes the output");

    // Unknown model and another tenant's model: the same 404.
    let (s1, unknown) = f.complete("nope", prompts[0], None).await;
    let (s2, foreign) = f.complete("secret", prompts[0], None).await;
    assert_eq!((s1, s2), (404, 404));
    assert_eq!(unknown["error"]["code"], "model_not_found");
    assert_eq!(
        foreign["error"]["message"]
            .as_str()
            .unwrap()
            .replace("secret", "nope"),
        unknown["error"]["message"].as_str().unwrap()
    );
    // Its owner reaches it.
    let (s, v) = f
        .post(
            "/v1/completions",
            Some(GLOBEX_KEY),
            json!({"model": "secret", "prompt": prompts[0], "max_tokens": 2}),
        )
        .await;
    assert_eq!(s, 200, "{v}");

    // A base-hash mismatch (no worker serves qwen2-tied) is an error, never
    // the base model's output.
    let (s, v) = f.complete("qwen-helper", prompts[0], None).await;
    assert_eq!(s, 503, "{v}");
    assert_eq!(v["error"]["code"], "no_compatible_worker");
    assert!(v.get("choices").is_none());

    // Credentials.
    let (s, v) = f
        .post(
            "/v1/completions",
            None,
            json!({"model": "support", "prompt": "x"}),
        )
        .await;
    assert_eq!(s, 401, "{v}");
    for bad in [
        "lf_acmekey01.wrong",
        "lf_nokey12345.x",
        "eyJhbGciOiJIUzI1NiJ9.e30.x",
    ] {
        let (s, v) = f
            .post(
                "/v1/completions",
                Some(bad),
                json!({"model": "support", "prompt": "x"}),
            )
            .await;
        assert_eq!(s, 401, "{bad}: {v}");
        assert_eq!(v["error"]["type"], "authentication_error");
    }
    // Bad bodies name the field.
    let (s, v) = f
        .post(
            "/v1/completions",
            Some(ACME_KEY),
            json!({"model": "support", "prompt": "x", "max_tokens": "many"}),
        )
        .await;
    assert_eq!(
        (s, v["error"]["param"].as_str()),
        (400, Some("max_tokens")),
        "{v}"
    );

    // /v1/models lists only the caller's routes.
    let models = |key: &'static str| {
        let http = f.http.clone();
        let url = format!("{}/v1/models", f.base_url);
        async move {
            let v: Value = http
                .get(url)
                .bearer_auth(key)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            v["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["id"].as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(
        models(ACME_KEY).await,
        ["base-llama", "canary", "qwen-helper", "support"]
    );
    assert_eq!(models(GLOBEX_KEY).await, ["secret"]);

    // Streaming chat with usage: role first, content deltas, finish, usage, [DONE].
    let resp = f
        .http
        .post(format!("{}/v1/chat/completions", f.base_url))
        .bearer_auth(ACME_KEY)
        .json(&json!({
            "model": "support", "stream": true, "stream_options": {"include_usage": true},
            "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello there"}]
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let body = resp.text().await.unwrap();
    let events: Vec<&str> = body
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert_eq!(*events.last().unwrap(), "[DONE]", "{body}");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage = &chunks.last().unwrap()["usage"];
    assert!(
        chunks.last().unwrap()["choices"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    let finish = &chunks[chunks.len() - 2]["choices"][0]["finish_reason"];
    assert!(finish == "stop" || finish == "length", "{body}");
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );

    // A registry change announced on Redis reaches the snapshot.
    route(&f.pool, f.seeded.acme, "late", f.seeded.llama, &[]).await;
    let mut redis = redis::Client::open("redis://127.0.0.1:6379")
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let _: i64 = redis::cmd("PUBLISH")
            .arg(format!("{}registry", f.redis_prefix))
            .arg("changed")
            .query_async(&mut redis)
            .await
            .unwrap();
        if models(ACME_KEY).await.contains(&"late".to_owned()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the announced route never appeared"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Per-tenant rate limit: 3 a minute, then 429 with Retry-After. The
    // windows are calendar minutes: start well inside one.
    let second = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        % 60;
    if second >= 55 {
        tokio::time::sleep(Duration::from_secs(61 - second)).await;
    }
    let mut statuses = Vec::new();
    let mut retry_after = None;
    for _ in 0..4 {
        let r = f
            .http
            .post(format!("{}/v1/completions", f.base_url))
            .bearer_auth(INITECH_KEY)
            .json(&json!({"model": "base", "prompt": "x", "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        statuses.push(r.status().as_u16());
        if let Some(v) = r.headers().get("retry-after") {
            retry_after = Some(v.to_str().unwrap().parse::<u64>().unwrap());
        }
    }
    assert_eq!(statuses, [200, 200, 200, 429]);
    assert!(
        retry_after.is_some_and(|s| (1..=60).contains(&s)),
        "{retry_after:?}"
    );

    // Tokens per minute (20 for hooli): each finished completion's tokens
    // are charged to the minute just after its response, and once the
    // minute's total with the next request's reservation passes the limit,
    // requests get 429 naming the token limit. Never before; soon after.
    let mut charged = 0;
    let mut reached_at = None;
    let mut token_limited_requests = 1; // the refused one
    let refused = loop {
        let r = f
            .http
            .post(format!("{}/v1/completions", f.base_url))
            .bearer_auth(HOOLI_KEY)
            .json(&json!({"model": "base", "prompt": "x", "max_tokens": 8}))
            .send()
            .await
            .unwrap();
        if r.status() == 429 {
            break r;
        }
        assert_eq!(r.status(), 200);
        token_limited_requests += 1;
        charged += r.json::<Value>().await.unwrap()["usage"]["total_tokens"]
            .as_u64()
            .unwrap();
        if charged >= 20 && reached_at.is_none() {
            reached_at = Some(Instant::now());
        }
        assert!(
            reached_at.is_none_or(|t| t.elapsed() < Duration::from_secs(5)),
            "tokens per minute not enforced 5 s after {charged} tokens"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Refused once what the request reserves (its prompt, estimated at one
    // token for "x", plus its max_tokens) would pass the limit, never
    // sooner. Completions are sampled, so one that ends early at EOS can
    // leave the total short of 20 when that happens.
    assert!(charged + 1 + 8 > 20, "refused after only {charged} tokens");
    assert!(refused.headers().contains_key("retry-after"));
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tokens per minute"),
        "{body}"
    );

    // The caller's trace, through a trusted proxy, reaches the worker.
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let r = f
        .http
        .post(format!("{}/v1/completions", f.base_url))
        .bearer_auth(ACME_KEY)
        .header("traceparent", format!("00-{trace_id}-b7ad6b7169203331-01"))
        .json(&json!({"model": "support", "prompt": "traced", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f.workers.iter().any(|w| {
        w.log_text()
            .lines()
            .any(|l| l.contains("\"accepted\"") && l.contains(trace_id))
    }) {
        assert!(
            Instant::now() < deadline,
            "no worker logged the caller's trace id"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Canary: a user stays on one version; the split follows the weights.
    let mut first: BTreeMap<String, String> = BTreeMap::new();
    let mut requests = Vec::new();
    for round in 0..2 {
        let mut calls = Vec::new();
        for u in 0..60 {
            let user = format!("user-{u}");
            let body = json!({"model": "canary", "prompt": "Hi", "max_tokens": 1, "user": user});
            let f = &f;
            calls
                .push(async move { (user, f.post("/v1/completions", Some(ACME_KEY), body).await) });
        }
        for (user, (s, v)) in futures::future::join_all(calls).await {
            assert_eq!(s, 200, "{v}");
            let id = v["id"]
                .as_str()
                .unwrap()
                .trim_start_matches("cmpl-")
                .to_owned();
            requests.push((round, user.clone(), id.clone()));
            if round == 0 {
                first.insert(user, id);
            }
        }
    }
    // 3 ok, 2 404s, 1 globex, 1 503, 4 401s, 1 400, 1 chat, 4 limited,
    // the token-limited ones, 1 traced, 120 canary.
    let total = 3 + 2 + 1 + 1 + 4 + 1 + 1 + 4 + token_limited_requests + 1 + 120;
    f.wait_audit(total).await;
    let rows: Vec<(Uuid, Option<i64>)> = sqlx::query_as(
        "SELECT request_id, lora_int_id FROM audit_log WHERE model_name = 'canary' AND status = 'ok'",
    )
    .fetch_all(&f.pool)
    .await
    .unwrap();
    let by_id: HashMap<String, i64> = rows
        .into_iter()
        .map(|(id, l)| (id.to_string(), l.unwrap()))
        .collect();
    let mut per_user: HashMap<String, Vec<i64>> = HashMap::new();
    for (_, user, id) in &requests {
        per_user.entry(user.clone()).or_default().push(by_id[id]);
    }
    for (user, versions) in &per_user {
        assert_eq!(versions[0], versions[1], "{user} changed version");
    }
    let patterns = per_user
        .values()
        .filter(|v| v[0] == f.seeded.adapters["patterns"])
        .count();
    // 30% of 60 users, with room for chance (binomial sd ~3.5).
    assert!(
        (6..=30).contains(&patterns),
        "{patterns} of 60 users on the 30% version"
    );

    // Audit rows say who went where.
    let (worker, adapter, residency): (Option<String>, Option<String>, Option<String>) =
        sqlx::query_as(
            "SELECT worker_id, adapter_name, adapter_residency FROM audit_log
             WHERE model_name = 'support' AND status = 'ok' LIMIT 1",
        )
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert!(matches!(worker.as_deref(), Some("w0" | "w1")));
    assert_eq!(adapter.as_deref(), Some("qv-r8"));
    assert!(residency.is_some());
    let rejected: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_log WHERE status = 'rejected' AND http_status = 404",
    )
    .fetch_one(&f.pool)
    .await
    .unwrap();
    assert_eq!(rejected, 2);

    // Per-tenant, per-adapter metrics, and the residency hit rate at routing.
    let metrics = f.gateway_metrics().await;
    let value = |series: &str| metric(&metrics, series);
    assert!(
        value(r#"lorafleet_gateway_requests_total{tenant="acme",adapter="qv-r8@1",status="ok"}"#)
            >= 3.0
    );
    assert!(
        value(r#"lorafleet_gateway_requests_total{tenant="initech",adapter="base",status="ok"}"#)
            >= 3.0
    );
    assert!(metrics.contains(
        "lorafleet_gateway_residency_checks_total{tenant=\"acme\",adapter=\"qv-r8@1\",hit="
    ));
    assert!(
        metrics.contains("lorafleet_gateway_time_to_first_token_seconds_count{tenant=\"acme\"")
    );
}

/// Rows in the spool: lines of every segment under the spool directory.
fn spool_lines(dir: &Path) -> usize {
    spool_segments(dir)
        .iter()
        .map(|p| {
            std::fs::read_to_string(p).map_or(0, |s| s.lines().filter(|l| !l.is_empty()).count())
        })
        .sum()
}

#[tokio::test]
async fn the_gateway_rides_out_a_dead_worker_and_redis_and_postgres_outages() {
    let mut f = fleet("gateway_outages").await;
    let mut sent = 0;
    let ok = |(s, v): (u16, Value)| {
        assert_eq!(s, 200, "{v}");
    };
    for i in 0..4 {
        ok(f.complete("support", &format!("warm {i}"), None).await);
        sent += 1;
    }

    // A worker dies: requests that have not started streaming still succeed.
    let mut dead = f.workers.remove(0);
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();
    for i in 0..10 {
        ok(f.complete(
            if i % 2 == 0 { "support" } else { "canary" },
            "after the kill",
            None,
        )
        .await);
        sent += 1;
    }

    // Redis goes away: rate limits fall back to this replica; serving goes on.
    f.redis.cut();
    for _ in 0..5 {
        ok(f.complete("support", "no redis", None).await);
        sent += 1;
    }
    f.redis.restore();
    f.wait_audit(sent).await;

    // Postgres goes away: the snapshot serves, audit rows go to the spool.
    f.pg.cut();
    for _ in 0..8 {
        ok(f.complete("support", "no postgres", None).await);
        sent += 1;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while spool_lines(f.spool.path()) < 8 {
        assert!(
            Instant::now() < deadline,
            "{} rows spooled: {}",
            spool_lines(f.spool.path()),
            f.gateway.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    f.pg.restore();
    // Replayed with none lost and none doubled.
    f.wait_audit(sent).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !spool_segments(f.spool.path()).is_empty() {
        assert!(Instant::now() < deadline, "the spool was never cleared");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Graceful shutdown loses nothing either.
    let mut calls = Vec::new();
    for _ in 0..3 {
        calls.push(f.complete("support", "last ones", None));
    }
    for r in futures::future::join_all(calls).await {
        ok(r);
        sent += 1;
    }
    let pid = f.gateway.child.id();
    signal(pid, "TERM");
    let exit = f.gateway.child.wait().unwrap();
    assert!(exit.success(), "{exit}: {}", f.gateway.log_text());
    assert_eq!(f.audit_count().await, sent);
}

/// A `traceparent` from a caller that is not a trusted proxy is not joined:
/// the request runs in the gateway's own trace, which the worker logs.
#[tokio::test]
async fn a_traceparent_is_joined_only_from_a_trusted_proxy() {
    let f = fleet("gateway_untrusted_trace").await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let r = f
        .http
        .post(format!("{}/v1/completions", f.base_url))
        .bearer_auth(ACME_KEY)
        .header("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"))
        .json(&json!({"model": "support", "prompt": "traced", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    let request_id = body["id"]
        .as_str()
        .unwrap()
        .trim_start_matches("cmpl-")
        .to_owned();
    let deadline = Instant::now() + Duration::from_secs(10);
    let line = loop {
        let found = f.workers.iter().find_map(|w| {
            w.log_text()
                .lines()
                .find(|l| l.contains("\"accepted\"") && l.contains(&request_id))
                .map(str::to_owned)
        });
        if let Some(line) = found {
            break line;
        }
        assert!(Instant::now() < deadline, "no worker logged the request");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(line.contains("trace_id"), "the request is traced: {line}");
    assert!(
        !line.contains(trace_id),
        "an untrusted caller chose the trace: {line}"
    );
}

/// Past `--tenant-series` tenants, a tenant's requests count as `other`:
/// the first tenant seen keeps its own series, the second does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_metrics_name_only_the_top_tenants() {
    let f = fleet_with("gateway_tenant_series", &["--tenant-series", "1"]).await;
    let (status, v) = f.complete("support", "Once upon a time", None).await;
    assert_eq!(status, 200, "{v}");
    for _ in 0..2 {
        let r = f
            .http
            .post(format!("{}/v1/completions", f.base_url))
            .bearer_auth(INITECH_KEY)
            .json(&json!({"model": "base", "prompt": "x", "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
    }
    let metrics = f.gateway_metrics().await;
    let value = |series: &str| metric(&metrics, series);
    assert_eq!(
        value(r#"lorafleet_gateway_requests_total{tenant="acme",adapter="qv-r8@1",status="ok"}"#),
        1.0
    );
    assert_eq!(
        value(r#"lorafleet_gateway_requests_total{tenant="other",adapter="other",status="ok"}"#),
        2.0
    );
    assert!(!metrics.contains("tenant=\"initech\""), "{metrics}");
    // Named from its first request on, at routing too.
    assert!(metrics.contains(
        "lorafleet_gateway_residency_checks_total{tenant=\"acme\",adapter=\"qv-r8@1\",hit="
    ));
}
