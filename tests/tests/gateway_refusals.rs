//! The gateway's refusals and deadlines with real workers: a worker's
//! refusal reaches the tenant as a reason code, a worker that never answers
//! is skipped at the first-token deadline, and bad flags are refused by
//! name. A gateway also starts in process, on port 0, and drains.

#[path = "support/fleet.rs"]
mod fleet;

use std::process::Command;
use std::time::{Duration, Instant};

use fleet::*;
use lorafleet_tests::{binary, signal};
use serde_json::{Value, json};

/// A worker's refusal reaches the tenant as a stable reason code: never the
/// worker's own words, which may name fields, URIs or digests of the
/// operator's files (those go to the gateway's log).
#[tokio::test]
async fn a_worker_refusal_reaches_the_tenant_as_a_reason_code() {
    let f = fleet("gateway_refusal").await;
    // An adapter registered with a digest its files do not have.
    let uri = "llama-gqa/o-r2";
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO adapters (name, version, base_model_id, tenant_id, rank, alpha,
                               target_modules, artifact_uri, artifact_sha256)
         VALUES ('tampered', 1, $1, $2, 2, 4, ARRAY['o_proj'], $3, $4)
         RETURNING lora_int_id",
    )
    .bind(f.seeded.llama)
    .bind(f.seeded.acme)
    .bind(uri)
    .bind("ab".repeat(32))
    .fetch_one(&f.pool)
    .await
    .unwrap();
    route(
        &f.pool,
        f.seeded.acme,
        "tampered",
        f.seeded.llama,
        &[(id, 10_000)],
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(15);
    let (status, body) = loop {
        let (s, v) = f.complete("tampered", "hello", None).await;
        // 404 until the gateway's registry refresh sees the new route.
        if s != 404 || Instant::now() > deadline {
            break (s, v);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(status, 503, "{body}");
    let error = &body["error"];
    assert_eq!(error["code"], "adapter_unavailable", "{body}");
    let message = error["message"].as_str().unwrap();
    assert!(message.contains("artifact_digest_mismatch"), "{message}");
    for leak in [uri, "adapter.artifact_sha256", "abab", "registered digest"] {
        assert!(!message.contains(leak), "{leak:?} in {message}");
    }
    assert!(
        f.gateway
            .log_text()
            .contains("the worker could not use the adapter"),
        "the worker's words are in the gateway's log"
    );
}

/// A request that cannot fit the model's context is a 400
/// `context_length_exceeded` naming `max_tokens`: decided by the gateway,
/// before any limit is charged, when it is certain (`max_tokens` alone, or
/// with a prompt of token ids), and by the worker for a text prompt.
#[tokio::test]
async fn a_request_over_the_context_is_refused_in_the_clients_terms_before_any_limit() {
    let f = fleet("context_length").await;
    let over = |body: Value| {
        let f = &f;
        async move {
            let (status, v) = f.post("/v1/completions", Some(INITECH_KEY), body).await;
            assert_eq!(status, 400, "{v}");
            assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
            assert_eq!(v["error"]["param"], "max_tokens", "{v}");
            v["error"]["message"].as_str().unwrap().to_owned()
        }
    };
    // The fixture's context is 512 tokens; initech may send 3 requests a
    // minute. Five refusals by the gateway cost none of them.
    for _ in 0..5 {
        let m = over(json!({"model": "base", "prompt": "hi", "max_tokens": 100_000_000})).await;
        assert!(m.contains("512"), "{m}");
    }
    let ids: Vec<u32> = (1..=20).collect();
    let m = over(json!({"model": "base", "prompt": ids, "max_tokens": 500})).await;
    assert!(m.contains("the prompt (20 tokens)"), "{m}");
    // A text prompt's length is the worker's to count: the same answer.
    let long = "hello ".repeat(60);
    let m = over(json!({"model": "base", "prompt": long, "max_tokens": 500})).await;
    assert!(m.starts_with("max_tokens:"), "{m}");
    // The refusals before the worker charged nothing: of three requests a
    // minute, two remain after the one the worker refused.
    for _ in 0..2 {
        let (status, v) = f
            .post(
                "/v1/completions",
                Some(INITECH_KEY),
                json!({"model": "base", "prompt": "hi", "max_tokens": 2}),
            )
            .await;
        assert_eq!(status, 200, "{v}");
    }
}

/// Every refusal of a request's fields names the field as the client sent
/// it: a top-level name, or a path into the body (`messages[1].role`,
/// `stop[0]`), whether the gateway or the worker refused it. `Fleet::post`
/// checks the same of every refusal any test provokes; this walks one of
/// each kind the API has.
#[tokio::test]
async fn every_refusal_names_a_field_the_client_sent() {
    let f = fleet("refusal_params").await;
    let long = "hello ".repeat(700);
    let completions = [
        (json!({"model": "support"}), "prompt"),
        (json!({"prompt": "x"}), "model"),
        (
            json!({"model": "support", "prompt": "x", "max_tokens": "ten"}),
            "max_tokens",
        ),
        (
            json!({"model": "support", "prompt": "x", "temperature": 9}),
            "temperature",
        ),
        (
            json!({"model": "support", "prompt": "x", "top_p": 2}),
            "top_p",
        ),
        (json!({"model": "support", "prompt": "x", "n": 0}), "n"),
        (
            json!({"model": "support", "prompt": "x", "stop": ["a", ""]}),
            "stop[1]",
        ),
        (
            json!({"model": "support", "prompt": "x", "logprobs": 99}),
            "logprobs",
        ),
        (
            json!({"model": "support", "prompt": "x", "n": 3, "best_of": 2}),
            "best_of",
        ),
        (
            json!({"model": "support", "prompt": "x", "presence_penalty": 7}),
            "presence_penalty",
        ),
        (
            json!({"model": "support", "prompt": "x", "user": "u".repeat(10_000)}),
            "user",
        ),
        (json!({"model": "support", "prompt": []}), "prompt"),
        (
            json!({"model": "support", "prompt": [1, 4_000_000_000u64]}),
            "prompt",
        ),
        (
            json!({"model": "support", "prompt": [1, 2], "max_tokens": 100_000_000}),
            "max_tokens",
        ),
        (
            json!({"model": "support", "prompt": vec![7; 600], "max_tokens": 1}),
            "prompt",
        ),
        (
            json!({"model": "support", "prompt": long, "max_tokens": 1}),
            "prompt",
        ),
        (
            json!({"model": "support", "prompt": "x",
                   "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}),
            "response_format",
        ),
    ];
    let chat = [
        (json!({"model": "support", "messages": []}), "messages"),
        (
            json!({"model": "support", "messages": [{"role": "user", "content": "hi"},
                                                     {"role": "pirate", "content": "arr"}]}),
            "messages[1].role",
        ),
        (
            json!({"model": "support", "messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
        ),
        (
            json!({"model": "support", "messages": [{"role": "user", "content": "hi"}],
                   "tool_choice": "sometimes"}),
            "tool_choice",
        ),
        (
            json!({"model": "support", "messages": [{"role": "user", "content": long}],
                   "max_tokens": 1}),
            "messages",
        ),
    ];
    let mut seen = Vec::new();
    for (path, cases) in [
        ("/v1/completions", &completions[..]),
        ("/v1/chat/completions", &chat[..]),
    ] {
        for (body, param) in cases {
            let (status, v) = f.post(path, Some(ACME_KEY), body.clone()).await;
            assert!((400..500).contains(&status), "{path} {body}: {status} {v}");
            seen.push((path, v["error"]["param"].clone(), *param, v));
        }
    }
    let wrong: Vec<String> = seen
        .iter()
        .filter(|(_, got, want, _)| got != want)
        .map(|(path, got, want, v)| format!("{path}: want {want:?}, got {got}: {v}"))
        .collect();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A worker that takes the request and never answers is skipped at the
/// first-token deadline: the request moves to the other worker, and its row
/// says so.
#[tokio::test]
async fn a_worker_that_never_answers_is_skipped_at_the_first_token_deadline() {
    let f = fleet("gateway_first_token").await;
    let (s, v) = f.complete("support", "warm", None).await;
    assert_eq!(s, 200, "{v}");
    f.wait_audit(1).await;
    let served: String = sqlx::query_scalar("SELECT worker_id FROM audit_log")
        .fetch_one(&f.pool)
        .await
        .unwrap();
    let stuck = if served == "w0" { 0 } else { 1 };
    let pid = f.workers[stuck].child.id();
    signal(pid, "STOP");
    let started = Instant::now();
    let answer = f.complete("support", "a stuck worker", None).await;
    let took = started.elapsed();
    signal(pid, "CONT");
    assert_eq!(answer.0, 200, "{}", answer.1);
    assert!(
        took >= Duration::from_secs(5),
        "{took:?}: before the deadline"
    );
    f.wait_audit(2).await;
    let (attempts, worker): (i16, String) = sqlx::query_as(
        "SELECT attempts, worker_id FROM audit_log ORDER BY received_at DESC LIMIT 1",
    )
    .fetch_one(&f.pool)
    .await
    .unwrap();
    assert_eq!(attempts, 2, "the stuck worker, then the other");
    assert_ne!(worker, served);
}

#[test]
fn serve_refuses_bad_flags_by_name() {
    // Every check of the flags' values is a unit test of
    // `ServeArgs::validate` (gateway/src/server/flags.rs); here, that the
    // process reports them, and what clap refuses before them.
    let cases: &[(&[&str], &str)] = &[
        (&["--workers", ""], "--workers: \"\" is not HOST:PORT"),
        (
            &["--database-url", "mysql://db/x"],
            "--database-url: must start with postgres://",
        ),
        (
            &["--admin-listen", "127.0.0.1:0"],
            "--admin-listen: needs an admin token key",
        ),
        (
            &["--audit-durability", "eventually"],
            "\"eventually\" is neither \"commit\" nor \"journal\"",
        ),
        (&["--load-factor", "lots"], "--load-factor"),
        (&["--default-tpm-limit", "lots"], "--default-tpm-limit"),
    ];
    for (flags, expected) in cases {
        let out = Command::new(binary("lorafleet-gateway"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
            ])
            // Defaults through the environment, so a case can override them by flag.
            .env("LORAFLEET_INSECURE_PLAINTEXT", "true")
            .env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/unused")
            .env("LORAFLEET_WORKERS", "127.0.0.1:1")
            .args(flags.iter())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?}");
        assert!(
            stderr.contains(expected),
            "{flags:?}: expected {expected:?} in {stderr}"
        );
    }
    // Logging settings are checked the same way, by variable.
    for (var, value, expected) in [
        (
            "LORAFLEET_LOG_FORMAT",
            "yaml",
            "LORAFLEET_LOG_FORMAT: \"yaml\" is not",
        ),
        ("RUST_LOG", "info,[", "RUST_LOG: \"info,[\" is not a filter"),
    ] {
        let out = Command::new(binary("lorafleet-gateway"))
            .args(["serve", "--workers", "127.0.0.1:1", "--insecure-plaintext"])
            .args([
                "--database-url",
                "postgres://postgres@127.0.0.1:5432/unused",
            ])
            .env(var, value)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(expected),
            "{var}: {stderr}"
        );
    }
}

/// The gateway as a library: flags checked into a config, listeners bound
/// on port 0, everything started in this process, served, then drained.
#[tokio::test]
async fn a_gateway_starts_in_process_and_drains() {
    use clap::Parser;
    use lorafleet_gateway::server::{self, Listeners, ServeArgs};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }
    let db = lorafleet_tests::migrated_db("gateway_in_process").await;
    let spool = tempfile::tempdir().unwrap();
    let url = db.url();
    let config = Cli::parse_from([
        "serve",
        "--database-url",
        &url,
        "--workers",
        "127.0.0.1:1",
        "--insecure-plaintext",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--audit-spool",
        spool.path().to_str().unwrap(),
        "--audit-spool-owner",
        "in-process",
    ])
    .serve
    .validate()
    .unwrap();
    let listeners = Listeners::bind(&config).await.unwrap();
    let running = server::start(config, listeners).await.unwrap();
    let http = running.http.expect("the public listener");
    assert_ne!(http.port(), 0, "port 0 became a real port");
    let client = reqwest::Client::new();
    let health = client
        .get(format!("http://{http}/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let metrics = client
        .get(format!("http://{}/metrics", running.metrics))
        .send()
        .await
        .unwrap();
    assert_eq!(metrics.status(), 200);
    // A completion with no credential is refused by the running API.
    let refused = client
        .post(format!("http://{http}/v1/completions"))
        .json(&serde_json::json!({"model": "m", "prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    tokio::time::timeout(
        Duration::from_secs(20),
        running.drain(Duration::from_secs(2)),
    )
    .await
    .expect("the drain ends");
    assert!(
        client
            .get(format!("http://{http}/healthz"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .is_err(),
        "a drained gateway accepts no connection"
    );
}
