//! The admin plane end to end: the real `lorafleetctl` binary against two
//! real gateway replicas (sharing real Postgres and Redis) in front of a
//! real worker on the fixture model.

#[path = "support/admin_plane.rs"]
mod admin_plane;

use std::collections::{HashMap, HashSet};
use std::process::Command;
use std::time::Duration;

use admin_plane::*;
use lorafleet_tests::{binary, engine_fixtures};
use serde_json::Value;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admins_run_the_registry_and_compliance_reads_the_audit_log_through_lorafleetctl() {
    let p = plane("admin_e2e").await;
    let fixtures = engine_fixtures();

    // --- Tokens and roles -------------------------------------------------
    p.run_as(None, &["tenants", "list"]).refused(2, "--token");
    p.run_as(Some("not-a-jwt"), &["tenants", "list"])
        .refused(3, "invalid token");
    let viewer = p.token("victor", "viewer");
    let auditor = p.token("audrey", "auditor");
    assert_eq!(p.run_as(Some(&viewer), &["tenants", "list"]).code, 0);
    p.run_as(Some(&viewer), &["tenants", "create", "nope"])
        .refused(3, "role viewer may not change the registry");
    p.run_as(Some(&viewer), &["audit"])
        .refused(3, "role viewer may not query the audit log");
    p.run_as(Some(&auditor), &["tenants", "create", "nope"])
        .refused(3, "role auditor may not change the registry");
    p.run_as(
        None,
        &[
            "token",
            "--hmac-secret-file",
            p.secret.to_str().unwrap(),
            "--subject",
            "x",
            "--role",
            "root",
            "--issuer",
            ISSUER,
            "--audience",
            AUDIENCE,
        ],
    )
    .refused(2, "--role");
    let unreachable = Command::new(binary("lorafleetctl"))
        .args(["--server", "http://127.0.0.1:1", "--token", "t", "fleet"])
        .output()
        .unwrap();
    assert_eq!(
        unreachable.status.code(),
        Some(7),
        "unreachable API exits 7"
    );

    // The container health checks.
    let health = |bin: &str, addr: &str| {
        Command::new(binary(bin))
            .args(["health", "--addr", addr])
            .output()
            .unwrap()
            .status
            .success()
    };
    assert!(health("lorafleet-gateway", p.gateways[0].addr("http")));
    assert!(health("lorafleet-worker", p.worker.addr("health")));
    // The gRPC port speaks mutual TLS only; a plain-text probe gets nothing.
    assert!(!health("lorafleet-worker", p.worker.addr("grpc")));
    assert!(!health("lorafleet-gateway", "127.0.0.1:1"));
    assert!(!health("lorafleet-worker", "127.0.0.1:1"));

    // --- Tenants ----------------------------------------------------------
    let acme = p.ctl_json(&["tenants", "create", "acme", "--display-name", "Acme"]);
    assert_eq!(acme["name"], "acme");
    let globex = p.ctl_json(&["tenants", "create", "globex", "--weight", "2.5"]);
    assert_eq!(
        (acme["weight"].as_f64(), globex["weight"].as_f64()),
        (Some(1.0), Some(2.5))
    );
    p.ctl(&["tenants", "create", "heavy", "--weight", "0"])
        .refused(6, "weight: 0 is not in (0, 1000]");
    p.ctl(&["tenants", "create", "acme"])
        .refused(5, "name: tenant \"acme\" already exists");
    p.ctl(&["tenants", "create", "Bad_Name"])
        .refused(6, "name:");
    p.ctl(&["tenants", "create", "zero", "--rpm-limit", "0"])
        .refused(6, "rpm_limit");
    let names: Vec<String> = p.ctl_json(&["tenants", "list"])["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, ["acme", "globex"]);
    let table = p.ctl(&["tenants", "list"]);
    assert!(
        table.stdout.starts_with("NAME") && table.stdout.contains("acme"),
        "a table for people: {}",
        table.stdout
    );

    // --- API keys ---------------------------------------------------------
    let created = p.ctl_json(&["keys", "create", "acme", "--name", "ci"]);
    let key = created["key"].as_str().unwrap().to_owned();
    let prefix = created["prefix"].as_str().unwrap().to_owned();
    assert!(key.starts_with(&format!("{prefix}.")), "{created}");
    let secret = key.split_once('.').unwrap().1.to_owned();
    let listed = p.ctl(&["--output", "json", "keys", "list", "acme"]);
    assert!(
        !listed.stdout.contains(&secret),
        "a listed key never shows its secret"
    );
    assert_eq!(listed.json()["keys"][0]["prefix"], prefix.as_str());
    assert!(listed.json()["keys"][0].get("key").is_none());
    p.ctl(&["keys", "create", "acme", "--scopes", "inference,admin"])
        .refused(6, "scopes[1]");
    p.ctl(&["keys", "create", "acme", "--expires-in", "soon"])
        .refused(2, "--expires-in");
    p.ctl(&[
        "keys",
        "create",
        "acme",
        "--expires-at",
        "2001-01-01T00:00:00Z",
    ])
    .refused(6, "expires_at");
    p.ctl(&["keys", "create", "nobody"]).refused(4, "tenant");
    let short = p.ctl_json(&["keys", "create", "acme", "--expires-in", "2s"]);
    let short_key = short["key"].as_str().unwrap().to_owned();
    let globex_key = p.ctl_json(&["keys", "create", "globex"])["key"]
        .as_str()
        .unwrap()
        .to_owned();

    // --- Base models ------------------------------------------------------
    let llama_dir = fixtures.join("llama-gqa");
    let hashes = fixture_json("base_hashes.json");
    let hashed = p.ctl(&["base-models", "hash", llama_dir.to_str().unwrap()]);
    assert_eq!(hashed.code, 0, "{}", hashed.stderr);
    assert_eq!(hashed.stdout.trim(), hashes["llama-gqa"]);
    let worker_says = Command::new(binary("lorafleet-worker"))
        .args(["base-hash", "--model"])
        .arg(&llama_dir)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&worker_says.stdout).trim(),
        hashed.stdout.trim(),
        "lorafleetctl and the worker compute the same base hash"
    );
    let llama = p.ctl_json(&[
        "base-models",
        "register",
        "llama-gqa",
        "--architecture",
        "llama",
        "--model-dir",
        llama_dir.to_str().unwrap(),
    ]);
    assert_eq!(llama["base_hash"], hashes["llama-gqa"]);
    p.ctl_json(&[
        "base-models",
        "register",
        "qwen2-tied",
        "--architecture",
        "qwen2",
        "--base-hash",
        hashes["qwen2-tied"].as_str().unwrap(),
    ]);
    let bases = p.ctl_json(&["base-models", "list"]);
    let bases: Vec<&str> = bases["base_models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap())
        .collect();
    assert_eq!(bases, ["llama-gqa", "qwen2-tied"]);
    p.ctl(&[
        "base-models",
        "register",
        "llama-gqa",
        "--architecture",
        "llama",
        "--base-hash",
        &"a".repeat(64),
    ])
    .refused(5, "name");
    p.ctl(&[
        "base-models",
        "register",
        "gpt",
        "--architecture",
        "gpt2",
        "--base-hash",
        &"b".repeat(64),
    ])
    .refused(6, "architecture");
    p.ctl(&[
        "base-models",
        "register",
        "short",
        "--architecture",
        "llama",
        "--base-hash",
        "abc",
    ])
    .refused(6, "base_hash");

    // --- Adapters ---------------------------------------------------------
    let register = |name: &str, base: &str, uri: &str, extra: &[&str]| {
        let mut args = vec![
            "--output",
            "json",
            "adapters",
            "register",
            name,
            "--base-model",
            base,
            "--artifact-uri",
            uri,
        ];
        args.extend_from_slice(extra);
        p.ctl(&args)
    };
    let v1 = register(
        "support",
        "llama-gqa",
        "llama-gqa/qv-r8",
        &["--tenant", "acme"],
    )
    .json();
    let v2 = register(
        "support",
        "llama-gqa",
        "llama-gqa/o-r2",
        &["--tenant", "acme"],
    )
    .json();
    let (a1, a2) = (
        v1["lora_int_id"].as_i64().unwrap(),
        v2["lora_int_id"].as_i64().unwrap(),
    );
    assert_eq!(
        (v1["version"].as_i64(), v2["version"].as_i64()),
        (Some(1), Some(2))
    );
    assert_eq!(
        (v1["rank"].as_i64(), v2["rank"].as_i64()),
        (Some(8), Some(2))
    );
    let digests = fixture_json("artifact_digests.json");
    assert_eq!(v1["artifact_sha256"], digests["llama-gqa/qv-r8"]);
    let local = p.ctl(&[
        "adapters",
        "digest",
        p.root.path().join("llama-gqa/o-r2").to_str().unwrap(),
    ]);
    assert_eq!(local.stdout.trim(), v2["artifact_sha256"].as_str().unwrap());
    let q1 = register("helper", "qwen2-tied", "qwen2-tied/qv-r8", &[]).json();
    let q1 = q1["lora_int_id"].as_i64().unwrap();

    register(
        "support",
        "llama-gqa",
        "llama-gqa/o-r2",
        &["--version", "1"],
    )
    .refused(5, "version");
    register("evil", "llama-gqa", "../../etc", &[]).refused(6, "artifact_uri");
    register("evil", "llama-gqa", "/etc", &[]).refused(6, "artifact_uri");
    register("missing", "llama-gqa", "llama-gqa/none", &[]).refused(6, "artifact_uri");
    register("broken", "llama-gqa", "bad/malformed", &[]).refused(6, "adapter_config.json");
    register("dora", "llama-gqa", "bad/dora", &[]).refused(6, "use_dora");
    register("nobase", "llama-gqa", "bad/no-base", &[]).refused(6, "base_model_name_or_path");
    register("other", "llama-gqa", "qwen2-tied/qv-r8", &[]).refused(6, "base_model_name_or_path");
    register("shape", "llama-gqa", "bad/shape", &[]).refused(6, "adapter_model.safetensors");
    register("big", "llama-gqa", "llama-gqa/k-r16", &[]).refused(6, "max LoRA rank 8");
    register("orphan", "no-such-base", "llama-gqa/qv-r8", &[]).refused(4, "base_model");
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM adapters")
        .fetch_one(&p.pool)
        .await
        .unwrap();
    assert_eq!(stored, 3, "refused registrations store nothing");
    // What a version does beyond plain LoRA is recorded and shown.
    assert_eq!(v1["features"], serde_json::json!([]));
    let dora = register(
        "dora-support",
        "llama-gqa",
        "dora/llama-gqa/dora-qv-r8",
        &[],
    )
    .json();
    assert_eq!(dora["features"], serde_json::json!(["dora"]), "{dora}");
    let biased = register(
        "bias-support",
        "llama-gqa",
        "bias/llama-gqa/bias-qv-r8",
        &[],
    )
    .json();
    assert_eq!(
        biased["features"],
        serde_json::json!(["lora_bias"]),
        "{biased}"
    );
    let embedding = register(
        "embedding-support",
        "llama-gqa",
        "embedding/llama-gqa/embed-head-rslora",
        &[],
    )
    .json();
    assert_eq!(
        embedding["features"],
        serde_json::json!(["embed_tokens", "lm_head"]),
        "{embedding}"
    );
    assert_eq!(
        embedding["target_modules"],
        serde_json::json!(["o_proj", "embed_tokens", "lm_head"]),
        "{embedding}"
    );
    assert_eq!(embedding["vocab_size"], serde_json::Value::Null);
    // Layers saved whole record their vocabulary; trained rows use the
    // base's.
    let saved = register(
        "saved-support",
        "llama-gqa",
        "saved/llama-gqa/embed-head-o-r4",
        &[],
    )
    .json();
    assert_eq!(
        (&saved["features"], &saved["vocab_size"]),
        (
            &serde_json::json!(["modules_to_save"]),
            &serde_json::json!(384)
        ),
        "{saved}"
    );
    let tokens = register(
        "tokens-support",
        "llama-gqa",
        "saved/llama-gqa/tokens-q-r4",
        &[],
    )
    .json();
    assert_eq!(
        (&tokens["features"], &tokens["vocab_size"]),
        (
            &serde_json::json!(["trainable_tokens"]),
            &serde_json::Value::Null
        ),
        "{tokens}"
    );
    register("grown", "llama-gqa", "bad/tokenizer", &[]).refused(6, "tokenizer.json");
    let versions = p.ctl_json(&["adapters", "list", "--name", "support"]);
    let versions: Vec<(i64, i64)> = versions["adapters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["lora_int_id"].as_i64().unwrap(),
                a["version"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(versions, [(a1, 1), (a2, 2)]);

    // --- Routes and canaries ----------------------------------------------
    let w = |pairs: &[(i64, u32)]| {
        pairs
            .iter()
            .map(|(id, bp)| format!("{id}={bp}"))
            .collect::<Vec<_>>()
            .join(",")
    };
    let route = p.ctl_json(&[
        "routes",
        "set",
        "acme",
        "support",
        "--weights",
        &w(&[(a1, 9000), (a2, 1000)]),
    ]);
    assert_eq!(route["etag"], "\"1\"");
    p.ctl_json(&[
        "routes",
        "set",
        "acme",
        "base-llama",
        "--base",
        "--base-model",
        "llama-gqa",
    ]);
    p.ctl(&[
        "routes",
        "set",
        "acme",
        "short",
        "--weights",
        &w(&[(a1, 9000)]),
    ])
    .refused(6, "sum to 9000");
    p.ctl(&[
        "routes",
        "set",
        "acme",
        "mixed",
        "--weights",
        &w(&[(a1, 5000), (q1, 5000)]),
    ])
    .refused(6, "one route serves one base model");
    p.ctl(&["routes", "set", "acme", "nine", "--weights", "7:9000"])
        .refused(2, "--weights");
    p.ctl(&[
        "routes",
        "set",
        "acme",
        "support",
        "--weights",
        &w(&[(a1, 8000), (a2, 2000)]),
    ])
    .refused(5, "If-Match");
    p.ctl(&[
        "routes",
        "set",
        "acme",
        "support",
        "--weights",
        &w(&[(a1, 8000), (a2, 2000)]),
        "--etag",
        "7",
    ])
    .refused(5, "stale");
    p.ctl(&["routes", "rollback", "acme", "base-llama", "--etag", "1"])
        .refused(5, "no earlier revision");
    let listed = p.ctl(&["routes", "list"]);
    assert!(
        listed.stdout.contains(&format!("{a1}=9000,{a2}=1000")),
        "{}",
        listed.stdout
    );

    let got = p.ctl_json(&["routes", "get", "acme", "support"]);
    assert_eq!(got["etag"], "\"1\"");
    assert_eq!(got["weights"][1]["weight_bp"], 1000);
    p.ctl(&["routes", "get", "acme", "nope"])
        .refused(4, "model");

    // Both replicas learn the route from the announcement, not the
    // 600-second refresh, within 2 s of the change.
    for replica in [0, 1] {
        let took = p.until_status(replica, &key, "support", 200).await;
        assert!(took < Duration::from_secs(2), "the route took {took:?}");
    }
    let route_id: Uuid = sqlx::query_scalar("SELECT id FROM routes WHERE model_name = 'support'")
        .fetch_one(&p.pool)
        .await
        .unwrap();

    // Traffic at 90/10: each request lands on the version its user's
    // canary bucket names, and the split is close to the weights.
    let mut sent: HashMap<String, i64> = HashMap::new();
    for i in 0..300 {
        let user = format!("user-{i}");
        let (status, body) = p.complete(i % 2, &key, "support", &user).await;
        assert_eq!(status, 200, "{body}");
        let expected = if lorafleet_gateway::registry::bucket(
            &lorafleet_gateway::ids::RouteId(route_id),
            &user,
        ) < 9000
        {
            a1
        } else {
            a2
        };
        sent.insert(request_id(&body), expected);
    }
    let rows = p.audit_rows("acme", "support", sent.len() + 2).await;
    let by_request: HashMap<String, &Value> = rows
        .iter()
        .map(|r| (r["request_id"].as_str().unwrap().to_owned(), r))
        .collect();
    let mut on_v2 = 0;
    for (id, expected) in &sent {
        let row = by_request
            .get(id)
            .unwrap_or_else(|| panic!("request {id} is not in the audit log"));
        assert_eq!(row["lora_int_id"].as_i64(), Some(*expected), "{row}");
        assert_eq!(row["worker_id"], "w0");
        assert_eq!(row["status"], "ok");
        if *expected == a2 {
            on_v2 += 1;
        }
    }
    let share = f64::from(on_v2) / sent.len() as f64;
    assert!((0.04..=0.17).contains(&share), "canary share {share}");

    // Promote the canary: all traffic moves.
    let promoted = p.ctl_json(&[
        "routes",
        "promote",
        "acme",
        "support",
        &a2.to_string(),
        "--etag",
        "1",
    ]);
    assert_eq!(promoted["etag"], "\"2\"");
    p.ctl(&[
        "routes",
        "promote",
        "acme",
        "support",
        &a1.to_string(),
        "--etag",
        "1",
    ])
    .refused(5, "stale");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut after: Vec<String> = Vec::new();
    for i in 0..40 {
        let (status, body) = p
            .complete(i % 2, &key, "support", &format!("user-{i}"))
            .await;
        assert_eq!(status, 200, "{body}");
        after.push(request_id(&body));
    }
    // Rollback restores 90/10, and promote again.
    let rolled = p.ctl_json(&["routes", "rollback", "acme", "support", "--etag", "2"]);
    assert_eq!(rolled["weights"].as_array().unwrap().len(), 2, "{rolled}");
    assert_eq!(rolled["etag"], "\"3\"");
    p.ctl_json(&[
        "routes",
        "promote",
        "acme",
        "support",
        &a2.to_string(),
        "--etag",
        "3",
    ]);

    // Retire v1: it can no longer be routed to; v2 cannot be retired while
    // it takes traffic.
    let retired = p.ctl_json(&["adapters", "retire", &a1.to_string()]);
    assert_eq!(retired["state"], "retired");
    p.ctl(&["adapters", "retire", &a1.to_string()])
        .refused(5, "already retired");
    p.ctl(&["adapters", "retire", &a2.to_string()])
        .refused(5, "acme/support");
    p.ctl(&[
        "routes",
        "set",
        "acme",
        "support",
        "--weights",
        &w(&[(a1, 5000), (a2, 5000)]),
        "--etag",
        "4",
    ])
    .refused(6, "retired");
    p.ctl(&["routes", "rollback", "acme", "support", "--etag", "4"])
        .refused(6, "retired");
    p.ctl(&["adapters", "retire", "999999"])
        .refused(4, "lora_int_id");

    // Every request after the promotion went to v2, found by request id.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    for id in after.iter().take(5) {
        let found = p.ctl_json(&["audit", "--request-id", id]);
        assert_eq!(
            found["rows"][0]["lora_int_id"].as_i64(),
            Some(a2),
            "{found}"
        );
    }
    let all = p
        .audit_rows("acme", "support", sent.len() + after.len() + 2)
        .await;
    for id in &after {
        let row = all
            .iter()
            .find(|r| r["request_id"] == id.as_str())
            .unwrap_or_else(|| panic!("request {id} is not in the audit log"));
        assert_eq!(row["lora_int_id"].as_i64(), Some(a2));
    }

    // --- Usage, read from the hourly rollups ------------------------------
    let at = |d: chrono::TimeDelta| {
        (chrono::Utc::now() + d).to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    };
    let usage = |group_by: &'static str| {
        p.http
            .get(format!("{}/admin/v1/usage", p.admin_url(0)))
            .query(&[
                ("from", at(chrono::TimeDelta::days(-1))),
                ("to", at(chrono::TimeDelta::hours(2))),
                ("group_by", group_by.to_owned()),
            ])
            .bearer_auth(&p.admin_token)
            .send()
    };
    let report: Value = usage("tenant,adapter").await.unwrap().json().await.unwrap();
    for adapter in [a1, a2] {
        let rows: Vec<&Value> = all.iter().filter(|r| r["lora_int_id"] == adapter).collect();
        let tokens: i64 = rows
            .iter()
            .map(|r| r["completion_tokens"].as_i64().unwrap())
            .sum();
        let got: Vec<&Value> = report["rows"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["lora_int_id"] == adapter && r["evaluation"] == false)
            .collect();
        assert_eq!(got.len(), 1, "one group per adapter: {report}");
        assert_eq!(
            got[0]["requests"].as_i64(),
            Some(rows.len() as i64),
            "{report}"
        );
        assert_eq!(
            got[0]["completion_tokens"].as_i64(),
            Some(tokens),
            "{report}"
        );
        assert!(got[0]["device_seconds"].as_f64().unwrap() > 0.0, "{report}");
    }
    // The same report through lorafleetctl, as JSON and as CSV.
    let (from, to) = (
        at(chrono::TimeDelta::days(-1)),
        at(chrono::TimeDelta::hours(2)),
    );
    let args = [
        "usage",
        "--from",
        &from,
        "--to",
        &to,
        "--group-by",
        "tenant,adapter",
    ];
    let via_ctl = p.ctl_json(&args);
    assert_eq!(via_ctl["rows"], report["rows"], "{via_ctl}");
    let csv = p.ctl(&[&args[..], &["--csv"]].concat()).stdout;
    let lines: Vec<&str> = csv.lines().collect();
    assert!(
        lines[0].starts_with("period,tenant_id,route_id,lora_int_id"),
        "{csv}"
    );
    assert_eq!(
        lines.len(),
        1 + report["rows"].as_array().unwrap().len(),
        "{csv}"
    );
    let refused = usage("tenant,model").await.unwrap();
    assert_eq!(refused.status(), 400);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["param"], "group_by", "{body}");
    // A tenant's own usage on the public port, with its API key: acme's
    // rows of the admin report, its routes by model name; another tenant
    // sees none of them, and a tenant cannot ask for tenants.
    let own = |key: String, group_by: &'static str| {
        p.http
            .get(format!("{}/v1/usage", p.api_url(0)))
            .query(&[
                ("from", at(chrono::TimeDelta::days(-1))),
                ("to", at(chrono::TimeDelta::hours(2))),
                ("group_by", group_by.to_owned()),
            ])
            .bearer_auth(key)
            .send()
    };
    let mine: Value = own(key.clone(), "route,adapter")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    // acme's id, from the group of its adapter.
    let acme_id = report["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["lora_int_id"] == a1)
        .map(|r| r["tenant_id"].clone())
        .unwrap();
    let admin_rows: Vec<&Value> = report["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["tenant_id"] == acme_id)
        .collect();
    let data = mine["data"].as_array().unwrap();
    assert_eq!(data.len(), admin_rows.len(), "{mine}\n{report}");
    for r in &admin_rows {
        let found = data
            .iter()
            .find(|d| d["lora_int_id"] == r["lora_int_id"] && d["evaluation"] == r["evaluation"])
            .unwrap_or_else(|| panic!("{r} is not in the tenant's report {mine}"));
        assert_eq!(found["model"], "support", "{found}");
        for field in [
            "requests",
            "completed",
            "prompt_tokens",
            "completion_tokens",
        ] {
            assert_eq!(found[field], r[field], "{field}: {found} against {r}");
        }
    }
    let theirs = p.ctl_json(&["keys", "create", "globex", "--name", "usage"]);
    let theirs = theirs["key"].as_str().unwrap().to_owned();
    let seen: Value = own(theirs.clone(), "adapter")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(seen["data"], serde_json::json!([]), "{seen}");
    let refused = own(key.clone(), "tenant").await.unwrap();
    assert_eq!(refused.status(), 400);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["param"], "group_by", "{body}");
    let anonymous = p
        .http
        .get(format!("{}/v1/usage", p.api_url(0)))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);

    // --- Audit queries ----------------------------------------------------
    let total = all.len();
    let count = |args: &[&str]| -> usize {
        let mut a = vec!["audit", "--all", "--limit", "1000"];
        a.extend_from_slice(args);
        p.ctl_json(&a)["rows"].as_array().unwrap().len()
    };
    let on_a2 = all.iter().filter(|r| r["lora_int_id"] == a2).count();
    assert_eq!(count(&["--lora-int-id", &a2.to_string()]), on_a2);
    assert_eq!(count(&["--adapter", "support:2"]), on_a2);
    let served = all
        .iter()
        .filter(|r| r["adapter_name"] == "support")
        .count();
    assert_eq!(count(&["--adapter", "support"]), served);
    let on_w0 = all.iter().filter(|r| r["worker_id"] == "w0").count();
    assert_eq!(count(&["--worker", "w0", "--model", "support"]), on_w0);
    assert!(on_w0 >= sent.len() + after.len());
    assert_eq!(count(&["--api-key", &prefix, "--model", "support"]), total);
    assert_eq!(count(&["--tenant", "globex"]), 0);
    // The probes made before a replica knew the route were refused.
    let ok = all.iter().filter(|r| r["status"] == "ok").count();
    assert_eq!(count(&["--model", "support", "--status", "ok"]), ok);
    assert_eq!(
        count(&["--model", "support", "--status", "rejected"]),
        total - ok
    );
    let newest = all[0]["received_at"].as_str().unwrap().to_owned();
    let oldest = all[total - 1]["received_at"].as_str().unwrap().to_owned();
    assert_eq!(
        count(&["--model", "support", "--since", &oldest, "--until", &newest]),
        total - 1,
        "since is inclusive, until exclusive"
    );
    p.ctl(&["audit", "--status", "maybe"]).refused(6, "status");
    p.ctl(&["audit", "--since", &newest, "--until", &oldest])
        .refused(6, "until");
    p.ctl(&["audit", "--limit", "5000"]).refused(6, "limit");
    p.ctl(&["audit", "--cursor", "nonsense"])
        .refused(6, "cursor");
    p.ctl(&["audit", "--tenant", "nobody"]).refused(4, "tenant");

    // Keyset pages cover every row once, newest first.
    let mut seen = HashSet::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        let mut args = vec!["audit", "--model", "support", "--limit", "37"];
        if let Some(c) = &cursor {
            args.extend(["--cursor", c.as_str()]);
        }
        let page = p.ctl_json(&args);
        for r in page["rows"].as_array().unwrap() {
            assert!(seen.insert(r["id"].as_i64().unwrap()), "a row on two pages");
        }
        pages += 1;
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    assert_eq!(seen.len(), total);
    assert!(pages >= total / 37, "{pages} pages");

    // Exports.
    let jsonl = p.ctl(&["audit", "--model", "support", "--export", "jsonl"]);
    assert_eq!(jsonl.code, 0, "{}", jsonl.stderr);
    let lines: Vec<Value> = jsonl
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), total);
    let csv = p.ctl(&["audit", "--model", "support", "--export", "csv"]);
    let mut csv_lines = csv.stdout.lines();
    let header = csv_lines.next().unwrap();
    assert!(header.starts_with("id,request_id,received_at"), "{header}");
    assert_eq!(csv_lines.count(), total);

    // --- Revocation, expiry and disabling reach every replica in 2 s ------
    assert_eq!(
        p.complete(1, &short_key, "support", "u").await.0,
        401,
        "expired"
    );
    p.ctl_json(&["keys", "revoke", &prefix]);
    let took = p.until_status(1, &key, "support", 401).await;
    assert!(took < Duration::from_secs(2), "revocation took {took:?}");
    p.ctl(&["keys", "revoke", &prefix])
        .refused(5, "already revoked");
    let (status, body) = p.complete(0, &key, "support", "u").await;
    assert_eq!(status, 401);
    assert!(body.to_string().contains("revoked"), "{body}");

    let key2 = p.ctl_json(&["keys", "create", "acme"])["key"]
        .as_str()
        .unwrap()
        .to_owned();
    p.until_status(1, &key2, "support", 200).await;
    p.ctl_json(&["tenants", "disable", "acme"]);
    let took = p.until_status(1, &key2, "support", 403).await;
    assert!(took < Duration::from_secs(2), "disabling took {took:?}");
    p.ctl(&["tenants", "disable", "acme"])
        .refused(5, "already disabled");
    p.ctl(&["tenants", "disable", "nobody"])
        .refused(4, "tenant");
    p.ctl_json(&["tenants", "enable", "acme"]);
    p.until_status(1, &key2, "support", 200).await;
    // Another tenant never reaches acme's routes.
    assert_eq!(p.complete(0, &globex_key, "support", "u").await.0, 404);

    // --- Fleet view ---------------------------------------------------------
    let fleet = p.ctl_json(&["fleet"]);
    let w0 = &fleet["workers"][0];
    assert_eq!(w0["worker_id"], "w0");
    assert_eq!(w0["up"], true);
    assert_eq!(w0["base_hash"], hashes["llama-gqa"]);
    assert_eq!(w0["status"], "serving");
    assert_eq!(w0["base_model"], "llama-gqa");
    assert!(w0["kv_blocks_total"].as_u64().unwrap() > 0, "{fleet}");
    // Each adapter's traffic over the window, from the audit log.
    let traffic = fleet["adapters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["lora_int_id"].as_i64() == Some(a2))
        .unwrap_or_else(|| panic!("no traffic for {a2}: {fleet}"));
    assert!(traffic["requests"].as_i64().unwrap() > 0, "{traffic}");
    let hit = traffic["device_hit_rate"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&hit), "{traffic}");
    let resident: Vec<i64> = ["device", "host"]
        .iter()
        .flat_map(|t| w0["adapters"][*t].as_array().cloned().unwrap_or_default())
        .filter_map(|v| v.as_i64())
        .collect();
    assert!(resident.contains(&a2), "{fleet}");

    // --- The admin change log -----------------------------------------------
    let changes = p.ctl_json(&["changes", "--limit", "200"]);
    let changes = changes["changes"].as_array().unwrap();
    let promote = changes
        .iter()
        .find(|c| c["action"] == "route.promote")
        .expect("a promote is recorded");
    assert_eq!(promote["actor"], "alice");
    assert_eq!(promote["object_id"], "acme/support");
    // The latest promote followed the rollback to 90/10.
    assert_eq!(promote["before"]["weights"].as_array().unwrap().len(), 2);
    assert_eq!(promote["after"]["weights"].as_array().unwrap().len(), 1);
    assert_eq!(
        promote["after"]["weights"][0]["lora_int_id"].as_i64(),
        Some(a2)
    );
    let key_change = changes
        .iter()
        .find(|c| c["action"] == "api_key.create")
        .unwrap();
    assert!(
        !key_change.to_string().contains(&secret),
        "secrets never reach the change log"
    );
    assert!(changes.iter().any(|c| c["action"] == "adapter.retire"
        && c["before"]["state"] == "active"
        && c["after"]["state"] == "retired"));
    // Refused changes leave no record.
    assert!(!changes.iter().any(|c| c["object_id"] == "mixed"));
    let tampered = sqlx::query("DELETE FROM admin_changes")
        .execute(&p.pool)
        .await;
    assert!(tampered.is_err(), "the change log is append-only");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_changes_a_tenants_limits_and_the_next_requests_follow_them() {
    let p = plane("tenant_limits").await;
    let (key, _, _) = acme_support(&p, "llama-gqa/o-r2");

    // Two requests a minute: of five, some are refused (a minute boundary
    // among them frees at most two more).
    let row = p.ctl_json(&["tenants", "update", "acme", "--rpm-limit", "2"]);
    assert_eq!(row["rpm_limit"], 2, "{row}");
    let mut refused = 0;
    for _ in 0..5 {
        let (status, body) = p.complete(0, &key, "support", "u").await;
        if status == 429 {
            assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
            refused += 1;
        } else {
            assert_eq!(status, 200, "{body}");
        }
    }
    assert!(refused >= 1, "the lowered limit applies");

    // Raised to unlimited: every request passes, on this replica at once
    // and on the other once it has reloaded.
    let row = p.ctl_json(&["tenants", "update", "acme", "--rpm-limit", "unlimited"]);
    assert_eq!(row["rpm_limit"], "unlimited", "{row}");
    for _ in 0..6 {
        let (status, body) = p.complete(0, &key, "support", "u").await;
        assert_eq!(status, 200, "{body}");
    }
    p.until_status(1, &key, "support", 200).await;

    // One request in flight at a time: of six sent at once, some are
    // refused by the tenant's own cap, and the refusal names it.
    let row = p.ctl_json(&["tenants", "update", "acme", "--max-concurrent", "1"]);
    assert_eq!(row["max_concurrent"], 1, "{row}");
    let answers = at_once(&p, &key, 6, 48).await;
    let capped: Vec<&Value> = answers
        .iter()
        .filter(|(s, _)| *s == 429)
        .map(|(_, b)| b)
        .collect();
    assert!(!capped.is_empty(), "{answers:?}");
    for b in &capped {
        assert_eq!(b["error"]["code"], "tenant_concurrency_limit", "{b}");
    }
    assert!(answers.iter().any(|(s, _)| *s == 200), "{answers:?}");
    // The cap holds across the two gateways: of eight long requests sent
    // at once, four to each, at most two run.
    p.ctl_json(&["tenants", "update", "acme", "--max-concurrent", "2"]);
    p.until_status(1, &key, "support", 200).await;
    let answers = at_once(&p, &key, 8, 200).await;
    let ran = answers.iter().filter(|(s, _)| *s == 200).count();
    assert!((1..=2).contains(&ran), "{ran} ran: {answers:?}");
    // Back to the gateway's default cap (far above six): all six pass.
    let row = p.ctl_json(&["tenants", "update", "acme", "--max-concurrent", "default"]);
    assert_eq!(row["max_concurrent"], Value::Null, "{row}");
    // (live on the other replica once its registry reloads).
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let answers = at_once(&p, &key, 6, 48).await;
        if answers.iter().all(|(s, _)| *s == 200) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{answers:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Refused by field, before anything changes.
    p.ctl(&["tenants", "update", "acme", "--rpm-limit", "0"])
        .refused(2, "not a limit");
    p.ctl(&["tenants", "update", "acme"])
        .refused(6, "names nothing to change");
    p.ctl(&["tenants", "update", "acme", "--weight", "0"])
        .refused(6, "weight");
    p.ctl(&["tenants", "update", "nobody", "--rpm-limit", "5"])
        .refused(4, "tenant \"nobody\"");
    let patch = |body: Value| {
        p.http
            .patch(format!("{}/admin/v1/tenants/acme", p.admin_url(0)))
            .bearer_auth(&p.admin_token)
            .json(&body)
            .send()
    };
    for (body, field) in [
        (serde_json::json!({"tpm_limit": 0}), "tpm_limit"),
        (serde_json::json!({"tpm_limit": "lots"}), "tpm_limit"),
        (
            serde_json::json!({"rpm_limit": 3_000_000_000u64}),
            "rpm_limit",
        ),
        (serde_json::json!({"burst": 3}), "burst"),
    ] {
        let r = patch(body.clone()).await.unwrap();
        assert_eq!(r.status(), 400, "{body}");
        let e: Value = r.json().await.unwrap();
        assert!(
            e["error"]["message"].as_str().unwrap().contains(field),
            "{body}: {e}"
        );
    }
    // A viewer may not change limits.
    let viewer = p.token("victor", "viewer");
    p.run_as(
        Some(&viewer),
        &["tenants", "update", "acme", "--rpm-limit", "9"],
    )
    .refused(3, "may not change the registry");
    // Sending the values it has changes nothing and records nothing.
    p.ctl_json(&["tenants", "update", "acme", "--rpm-limit", "unlimited"]);

    // Each change is in the change log, before and after.
    let changes = p.ctl_json(&["changes", "--object-type", "tenant", "--object-id", "acme"]);
    let updates: Vec<&Value> = changes["changes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["action"] == "tenant.update")
        .collect();
    assert_eq!(updates.len(), 5, "{changes}");
    let newest = updates[0];
    assert_eq!(newest["before"]["max_concurrent"], 2, "{newest}");
    assert_eq!(newest["after"]["max_concurrent"], Value::Null, "{newest}");
    assert_eq!(newest["actor"], "alice", "{newest}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_admin_token_is_refused_on_every_replica_within_two_seconds() {
    let p = plane("token_revocation").await;
    let get = |replica: usize, token: String| {
        let req = p
            .http
            .get(format!("{}/admin/v1/tenants", p.admin_url(replica)))
            .bearer_auth(token)
            .send();
        async move {
            let r = req.await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let until_refused = |token: String| {
        let get = &get;
        async move {
            let start = std::time::Instant::now();
            for replica in 0..2 {
                loop {
                    let (status, body) = get(replica, token.clone()).await;
                    if status == 401 {
                        assert!(
                            body["error"]["message"]
                                .as_str()
                                .unwrap()
                                .contains("revoked"),
                            "{body}"
                        );
                        break;
                    }
                    assert_eq!(status, 200, "{body}");
                    assert!(
                        start.elapsed() < Duration::from_secs(2),
                        "replica {replica} still accepts a revoked token"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    };

    // An admin revokes another's token by its jti.
    let victor = p.token("victor", "viewer");
    for replica in 0..2 {
        assert_eq!(get(replica, victor.clone()).await.0, 200);
    }
    let (jti, exp) = jti_and_exp(&victor);
    let expires_at = chrono::DateTime::from_timestamp(exp, 0)
        .unwrap()
        .to_rfc3339();
    let revoke = |token: &str, body: Value| {
        p.http
            .post(format!("{}/admin/v1/tokens/revoke", p.admin_url(0)))
            .bearer_auth(token)
            .json(&body)
            .send()
    };
    let body = serde_json::json!({"jti": jti, "expires_at": expires_at});
    // A viewer may not revoke others' tokens.
    let r = revoke(&victor, body.clone()).await.unwrap();
    assert_eq!(r.status(), 403);
    // A malformed revocation is refused by the field at fault.
    for (bad, field) in [
        (
            serde_json::json!({"jti": "", "expires_at": expires_at}),
            "jti",
        ),
        (
            serde_json::json!({"jti": "x".repeat(300), "expires_at": expires_at}),
            "jti",
        ),
        (serde_json::json!({"jti": "x"}), "expires_at"),
        (
            serde_json::json!({"jti": "x", "expires_at": "soon"}),
            "expires_at",
        ),
    ] {
        let r = revoke(&p.admin_token, bad.clone()).await.unwrap();
        assert_eq!(r.status(), 400, "{bad}");
        let e: Value = r.json().await.unwrap();
        assert!(
            e["error"]["message"].as_str().unwrap().contains(field),
            "{bad}: {e}"
        );
    }
    p.run_as(Some(&victor), &["token", "revoke", &victor])
        .refused(3, "may not change the registry");
    let revoked = p.ctl_json(&["token", "revoke", &victor]);
    assert_eq!(revoked["jti"], jti.as_str(), "{revoked}");
    until_refused(victor.clone()).await;
    // Twice is refused by name; the change log has it once.
    let r = revoke(&p.admin_token, body).await.unwrap();
    assert_eq!(r.status(), 409);
    p.ctl(&["token", "revoke", &victor])
        .refused(5, "already revoked");
    p.ctl(&["token", "revoke", "not-a-jwt"])
        .refused(2, "TOKEN: is not a JWT");
    let changes = p.ctl_json(&["changes", "--object-type", "admin_token"]);
    assert_eq!(changes["changes"].as_array().unwrap().len(), 1, "{changes}");
    assert_eq!(changes["changes"][0]["object_id"], jti.as_str());

    // Any holder revokes its own token (the console's sign-out does).
    let audrey = p.token("audrey", "auditor");
    let r = p
        .http
        .post(format!("{}/admin/v1/tokens/revoke-own", p.admin_url(1)))
        .bearer_auth(&audrey)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    until_refused(audrey).await;
    // Other tokens of the same subject are untouched.
    assert_eq!(get(0, p.token("audrey", "auditor")).await.0, 200);
}

/// Prices for chargeback: a base model's per device-hour and a route's per
/// million tokens, each from a whole hour on; the usage report prices every
/// hour at the prices in effect then, so a change mid-period splits the
/// cost at its time, and every price set is in the change log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_is_costed_at_the_prices_in_effect_each_hour() {
    let p = plane("prices").await;
    p.ctl_json(&["tenants", "create", "acme"]);
    let hash = fixture_json("base_hashes.json")["llama-gqa"]
        .as_str()
        .unwrap()
        .to_owned();
    p.ctl_json(&[
        "base-models",
        "register",
        "priced",
        "--architecture",
        "llama",
        "--base-hash",
        &hash,
    ]);
    p.ctl_json(&[
        "routes",
        "set",
        "acme",
        "support",
        "--base",
        "--base-model",
        "priced",
    ]);
    let route: Uuid = sqlx::query_scalar(
        "SELECT r.id FROM routes r JOIN tenants t ON t.id = r.tenant_id WHERE t.name = 'acme'",
    )
    .fetch_one(&p.pool)
    .await
    .unwrap();
    // Four hours of acme's usage, ending before this hour: each half a
    // device-hour, a million prompt and two million completion tokens, in
    // two audit rows, inserted as the audit writer inserts them (the
    // rollup trigger keeps the hours).
    let now = chrono::Utc::now().timestamp() / 3600 * 3600;
    let hour = |k: i64| chrono::DateTime::from_timestamp(now - (5 - k) * 3600, 0).unwrap();
    let inserted = sqlx::query(
        "INSERT INTO audit_log (request_id, received_at, completed_at, tenant_id, model_name,
                                route_id, base_hash, status, http_status, finish_reason,
                                prompt_tokens, completion_tokens, cached_tokens, occurrences,
                                device_us, latency_us)
         SELECT gen_random_uuid(), t, t, r.tenant_id, 'support', r.id, $3, 'ok', 200, 'stop',
                500000, 1000000, 0, 1, 900000000, 1
           FROM routes r, generate_series(0, 7) k,
                LATERAL (SELECT $2 + (k / 2) * INTERVAL '1 hour' + k * INTERVAL '1 minute' AS t) x
          WHERE r.id = $1",
    )
    .bind(route)
    .bind(hour(0))
    .bind(&hash)
    .execute(&p.pool)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(inserted, 8);
    let at =
        |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    // The base model at 2 a device-hour from hour 0, 3 from hour 2; the
    // route's tokens from hour 1 only.
    for (from, price) in [(0, "2"), (2, "3")] {
        p.ctl_json(&[
            "prices",
            "set",
            "--base-model",
            "priced",
            "--device-hour",
            price,
            "--from",
            &at(hour(from)),
        ]);
    }
    let set = p.ctl_json(&[
        "prices",
        "set",
        "--tenant",
        "acme",
        "--route",
        "support",
        "--prompt-per-million",
        "0.5",
        "--completion-per-million",
        "1.5",
        "--from",
        &at(hour(1)),
    ]);
    assert_eq!(set["route"], "support", "{set}");
    assert_eq!(set["completion_per_million"], 1.5, "{set}");
    let listed = p.ctl_json(&["prices", "list"]);
    assert_eq!(listed["prices"].as_array().unwrap().len(), 3, "{listed}");
    let report = |group_by: &str| {
        p.ctl_json(&[
            "usage",
            "--from",
            &at(hour(0)),
            "--to",
            &at(hour(4)),
            "--group-by",
            group_by,
        ])
    };
    let by_hour = report("hour");
    let rows = by_hour["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "{by_hour}");
    // (device cost, token cost) hour by hour: half an hour at 2, 2, 3, 3;
    // tokens 0.5·1 + 1.5·2 from hour 1.
    let want = [
        (1.0, None),
        (1.0, Some(3.5)),
        (1.5, Some(3.5)),
        (1.5, Some(3.5)),
    ];
    for (row, (device, tokens)) in rows.iter().zip(want) {
        let close = |v: &Value, w: f64| (v.as_f64().unwrap() - w).abs() < 1e-9;
        assert!(close(&row["device_seconds"], 1800.0), "{row}");
        assert!(close(&row["device_cost"], device), "{row}");
        match tokens {
            Some(t) => assert!(close(&row["token_cost"], t), "{row}"),
            None => assert!(row["token_cost"].is_null(), "{row}"),
        }
        assert!(close(&row["cost"], device + tokens.unwrap_or(0.0)), "{row}");
    }
    // The whole span: the hours' costs added.
    let whole = report("tenant");
    let total = &whole["rows"][0];
    assert!(
        (total["device_cost"].as_f64().unwrap() - 5.0).abs() < 1e-9,
        "{whole}"
    );
    assert!(
        (total["token_cost"].as_f64().unwrap() - 10.5).abs() < 1e-9,
        "{whole}"
    );
    assert!(
        (total["cost"].as_f64().unwrap() - 15.5).abs() < 1e-9,
        "{whole}"
    );
    // Refused by field: a time inside an hour, a second price from the same
    // hour (prices are history), a base model that is not registered.
    let inside = hour(3) + chrono::TimeDelta::minutes(30);
    p.ctl(&[
        "prices",
        "set",
        "--base-model",
        "priced",
        "--device-hour",
        "1",
        "--from",
        &at(inside),
    ])
    .refused(6, "effective_at");
    p.ctl(&[
        "prices",
        "set",
        "--base-model",
        "priced",
        "--device-hour",
        "1",
        "--from",
        &at(hour(2)),
    ])
    .refused(5, "effective_at");
    p.ctl(&[
        "prices",
        "set",
        "--base-model",
        "nothing",
        "--device-hour",
        "1",
        "--from",
        &at(hour(2)),
    ])
    .refused(4, "base_model");
    p.ctl(&[
        "prices",
        "set",
        "--tenant",
        "acme",
        "--route",
        "support",
        "--device-hour",
        "1",
        "--from",
        &at(hour(3)),
    ])
    .refused(6, "device_hour");
    let changes = p.ctl_json(&["changes", "--object-type", "price"]);
    assert_eq!(changes["changes"].as_array().unwrap().len(), 3, "{changes}");
    // A row of history cannot be changed in place, even by the database's
    // own roles.
    let e = sqlx::query("UPDATE prices SET device_hour = 0")
        .execute(&p.pool)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("history"), "{e}");
}
