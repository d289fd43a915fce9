//! Golden cases through the offline batch command, and the same prompts
//! through the gateway: what a tenant gets must be the goldens' text.
#![allow(dead_code)]

use lorafleet_tests::{engine_fixtures, run};
use serde_json::{Value, json};

use crate::admin_plane::Plane;

/// One golden case as served: its adapter (None for the base model), its
/// prompt and the text `lorafleet-worker generate` gave.
pub type Served = (Option<String>, String, String);

/// The cases of `model` in the fixtures' `file` for the base model and
/// `adapters` (found under `adapters/<adapter_model>/`), run through
/// `lorafleet-worker generate`: each case's greedy tokens are the
/// golden's. Expects `count` cases.
pub fn generate_goldens(
    file: &str,
    model: &str,
    adapter_model: &str,
    adapters: &[&str],
    count: usize,
) -> Vec<Served> {
    let fixtures = engine_fixtures();
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join(file)).unwrap()).unwrap();
    let max_new = golden["max_new_tokens"].as_u64().unwrap();
    let cases: Vec<&Value> = golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| {
            c["model"] == model
                && (c["adapter"].is_null() || adapters.iter().any(|a| c["adapter"] == *a))
        })
        .collect();
    assert_eq!(cases.len(), count);
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.jsonl"), dir.path().join("out.jsonl"));
    let lines: Vec<String> = cases
        .iter()
        .map(|c| {
            json!({"prompt": c["prompt"], "lora": c["adapter"], "max_tokens": max_new, "temperature": 0})
                .to_string()
        })
        .collect();
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let mut args: Vec<String> = vec![
        "generate".into(),
        "--model".into(),
        fixtures.join(model).display().to_string(),
        "--input".into(),
        input.display().to_string(),
        "--output".into(),
        output.display().to_string(),
    ];
    for a in adapters {
        let dir = fixtures.join("adapters").join(adapter_model).join(a);
        args.extend(["--lora".into(), format!("{a}={}", dir.display())]);
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run("lorafleet-worker", &refs, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let results: Vec<Value> = std::fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(results.len(), cases.len());
    results
        .iter()
        .zip(&cases)
        .map(|(r, c)| {
            assert_eq!(
                r["token_ids"], c["greedy"],
                "{} / {}",
                c["adapter"], c["prompt"]
            );
            (
                c["adapter"].as_str().map(str::to_owned),
                c["prompt"].as_str().unwrap().to_owned(),
                r["text"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// Each served case's prompt as a tenant's greedy completion through the
/// gateway, on the route `route(adapter)`: the text is the golden run's.
pub async fn assert_gateway_gives(
    p: &Plane,
    key: &str,
    expected: &[Served],
    route: impl Fn(Option<&str>) -> &'static str,
) {
    // A route set through one replica reaches the others within moments.
    let mut routes: Vec<&str> = expected
        .iter()
        .map(|(a, _, _)| route(a.as_deref()))
        .collect();
    routes.dedup();
    for r in routes {
        p.until_status(0, key, r, 200).await;
    }
    for (adapter, prompt, text) in expected {
        let model = route(adapter.as_deref());
        let resp = p
            .http
            .post(format!("{}/v1/completions", p.api_url(0)))
            .bearer_auth(key)
            .json(&json!({"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}))
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let body: Value = resp.json().await.unwrap();
        assert_eq!(status, 200, "{model} / {prompt}: {body}");
        assert_eq!(
            body["choices"][0]["text"].as_str().unwrap(),
            text,
            "{model} / {prompt}"
        );
    }
}
