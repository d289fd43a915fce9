//! Adapter artifacts in an S3-compatible bucket, end to end, against a
//! real S3 server (`s3s-fs` over a directory, on loopback): `lorafleetctl
//! adapters push` uploads a PEFT directory and registers it (the gateway
//! fetches it back and checks it as it checks a file artifact); a tenant's
//! completion through the gateway, the worker fetching the adapter from
//! the bucket into its verified cache, gives the goldens' text, and so does
//! a restarted worker (empty cache, fetched again); an object
//! changed after registration, a missing object and a store that stops
//! answering are each refused with a clear error while the adapter already
//! fetched keeps serving; URIs outside the allowed stores and a push over
//! an existing artifact are refused by field.

#[path = "support/admin_plane.rs"]
mod admin_plane;
#[path = "support/goldens.rs"]
mod goldens;

use admin_plane::*;
use goldens::{assert_gateway_gives, generate_goldens};
use lorafleet_tests::s3::S3Server;
use lorafleet_tests::{Proxy, engine_fixtures};
use serde_json::json;

const ADAPTER: &str = "qkvo-r4";

async fn status_of(p: &Plane, key: &str, model: &str) -> (u16, serde_json::Value) {
    let resp = p
        .http
        .post(format!("{}/v1/completions", p.api_url(0)))
        .bearer_auth(key)
        .json(&json!({"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_in_a_bucket_are_pushed_served_and_refused_when_changed_missing_or_unreachable() {
    let s3 = S3Server::start(&["adapters", "elsewhere"]);
    // The workers reach the store through a proxy the test can stall.
    let proxy = Proxy::start(s3.endpoint.trim_start_matches("http://"));
    let mut env: Vec<(String, String)> = s3
        .client_env()
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    env.push((
        "LORAFLEET_ARTIFACT_STORES".into(),
        "fleet=s3://adapters/prod".into(),
    ));
    env.push((
        "LORAFLEET_ARTIFACT_STORE_ENDPOINT".into(),
        s3.endpoint.clone(),
    ));
    let extra = Extra {
        env,
        worker_args: vec![
            "--artifact-store-endpoint".into(),
            format!("http://{}", proxy.addr),
            "--artifact-fetch-timeout-secs".into(),
            "4".into(),
        ],
        gateway_args: Vec::new(),
    };
    let expected = generate_goldens("golden.json", "llama-gqa", "llama-gqa", &[ADAPTER], 6);
    let mut p = plane_with("object_store", 1, 1, "llama-gqa", &extra).await;
    p.ctl_json(&["tenants", "create", "acme"]);
    let key = p.ctl_json(&["keys", "create", "acme"])["key"]
        .as_str()
        .unwrap()
        .to_owned();
    p.ctl_json(&[
        "base-models",
        "register",
        "llama-gqa",
        "--architecture",
        "llama",
        "--model-dir",
        engine_fixtures().join("llama-gqa").to_str().unwrap(),
    ]);
    let source = engine_fixtures().join("adapters/llama-gqa").join(ADAPTER);
    let source = source.to_str().unwrap();
    let push = |version: u32| {
        p.ctl_json(&[
            "adapters",
            "push",
            source,
            "--to",
            &format!("s3://adapters/prod/acme/support/v{version}"),
            "--name",
            "support",
            "--version",
            &version.to_string(),
            "--tenant",
            "acme",
            "--base-model",
            "llama-gqa",
        ])
    };
    // Pushed and registered in one step: the digest is the directory's.
    let v1 = push(1);
    let local = p.ctl_json(&["adapters", "digest", source])["artifact_sha256"].clone();
    assert_eq!(v1["artifact_sha256"], local, "{v1}");
    assert_eq!(v1["artifact_uri"], "s3://adapters/prod/acme/support/v1");
    assert!(
        s3.object_file("adapters", "prod/acme/support/v1/adapter_model.safetensors")
            .is_file()
    );
    let route = |model: &str, id: &serde_json::Value| {
        p.ctl_json(&[
            "routes",
            "set",
            "acme",
            model,
            "--weights",
            &format!("{}=10000", id.as_i64().unwrap()),
        ]);
    };
    route("support", &v1["lora_int_id"]);
    p.ctl_json(&[
        "routes",
        "set",
        "acme",
        "base",
        "--base",
        "--base-model",
        "llama-gqa",
    ]);
    // Fetched from the bucket by the worker: the goldens' text.
    assert_gateway_gives(&p, &key, &expected, |adapter| match adapter {
        Some(_) => "support",
        None => "base",
    })
    .await;

    // Changed after registration, at the same size: the worker's fetch
    // hashes it, refuses it, and keeps no copy.
    let v2 = push(2);
    route("changed", &v2["lora_int_id"]);
    let config = s3.object_file("adapters", "prod/acme/support/v2/adapter_config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replacen('{', " ", 1)).unwrap();
    let (status, body) = status_of(&p, &key, "changed").await;
    assert_ne!(status, 200, "{body}");
    // Grown after registration: refused from the listing against the size
    // the registry recorded, before a byte of it is read.
    let v5 = push(5);
    assert!(v5["artifact_bytes"].as_u64().is_some_and(|b| b > 0), "{v5}");
    route("grown", &v5["lora_int_id"]);
    let weights = s3.object_file("adapters", "prod/acme/support/v5/adapter_model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    bytes.extend(std::iter::repeat_n(0u8, 1 << 20));
    std::fs::write(&weights, bytes).unwrap();
    let (status, body) = status_of(&p, &key, "grown").await;
    assert_ne!(status, 200, "{body}");
    // A missing object: deleted after registration.
    let v3 = push(3);
    route("missing", &v3["lora_int_id"]);
    std::fs::remove_dir_all(s3.object_file("adapters", "prod/acme/support/v3")).unwrap();
    let (status, body) = status_of(&p, &key, "missing").await;
    assert_ne!(status, 200, "{body}");
    // The store stops answering: the fetch gives up at its deadline.
    let v4 = push(4);
    route("stalled", &v4["lora_int_id"]);
    proxy.stall();
    let started = std::time::Instant::now();
    let (status, body) = status_of(&p, &key, "stalled").await;
    assert_ne!(status, 200, "{body}");
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    // The adapter fetched already keeps serving meanwhile.
    assert_eq!(status_of(&p, &key, "support").await.0, 200);
    proxy.restore();
    // Each refusal says why in the worker's log.
    let log = p.worker.log_text();
    for why in [
        "support/v2: digest",
        "more than the",
        "not found in any artifact root or store",
        "support/v4: the object store is unavailable",
    ] {
        assert!(log.contains(why), "{why}: {log}");
    }
    // Once the store answers again, the stalled adapter is fetched.
    p.until_status(0, &key, "stalled", 200).await;

    // What operators watch, by store: bytes fetched, failures by reason,
    // and the transient errors the client retried.
    let metrics = reqwest::get(format!("http://{}/metrics", p.worker.addr("metrics")))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for series in [
        "lorafleet_artifact_fetch_bytes_total{store=\"fleet\"}",
        "lorafleet_artifact_fetch_seconds_count{store=\"fleet\"}",
        "reason=\"digest_mismatch\"",
        "reason=\"too_large\"",
        "reason=\"not_found\"",
        "reason=\"unavailable\"",
        "lorafleet_artifact_store_transient_errors_total{store=\"fleet\"}",
    ] {
        assert!(metrics.contains(series), "{series}: {metrics}");
    }

    // A restarted worker (a new process, an empty cache, the same address)
    // fetches from the bucket again and serves the same text.
    let addr = p.worker.addr("grpc").to_owned();
    p.worker.stop();
    p.worker = restarted_worker(&addr, &p, &extra);
    assert_gateway_gives(&p, &key, &expected, |adapter| match adapter {
        Some(_) => "support",
        None => "base",
    })
    .await;
    let log = p.worker.log_text();
    assert!(
        log.contains("artifact fetched") && log.contains("support/v1"),
        "{log}"
    );

    // Refused by field: a bucket no store allows, and a push over an
    // existing artifact (artifacts are immutable).
    p.ctl(&[
        "adapters",
        "register",
        "other",
        "--tenant",
        "acme",
        "--base-model",
        "llama-gqa",
        "--artifact-uri",
        "s3://elsewhere/prod/acme/x",
    ])
    .refused(6, "artifact_uri");
    let again = p.ctl(&[
        "adapters",
        "push",
        source,
        "--to",
        "s3://adapters/prod/acme/support/v1",
        "--name",
        "support",
        "--tenant",
        "acme",
        "--base-model",
        "llama-gqa",
    ]);
    assert_ne!(again.code, 0);
    assert!(again.stderr.contains("immutable"), "{}", again.stderr);
}

/// A worker as the plane starts it, listening on `addr`.
fn restarted_worker(addr: &str, p: &Plane, extra: &Extra) -> lorafleet_tests::Server {
    let c = lorafleet_tests::certs();
    let mut cmd = std::process::Command::new(lorafleet_tests::binary("lorafleet-worker"));
    cmd.args(["serve", "--grpc-listen", addr])
        .args([
            "--metrics-listen",
            "127.0.0.1:0",
            "--health-listen",
            "127.0.0.1:0",
        ])
        .arg("--tls-cert")
        .arg(c.path("worker.pem"))
        .arg("--tls-key")
        .arg(c.path("worker-key.pem"))
        .arg("--tls-client-ca")
        .arg(c.path("ca.pem"))
        .args(["--worker-id", "w0", "--max-loras", "2"])
        .arg("--model")
        .arg(engine_fixtures().join("llama-gqa"))
        .arg("--artifact-root")
        .arg(p.root.path())
        .args(&extra.worker_args)
        .envs(extra.env.iter().cloned());
    lorafleet_tests::Server::start(cmd, "lorafleet-worker listening ")
}
