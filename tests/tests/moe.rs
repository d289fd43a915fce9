//! A Mixture-of-Experts model served end to end: `lorafleet-worker
//! generate` gives the transformers + PEFT goldens on Qwen3-MoE, and a
//! tenant's completion through the gateway, routed to a worker on that
//! model with LoRA adapters registered through `lorafleetctl` (one on
//! attention, one on the experts), gives the same text.

#[path = "support/admin_plane.rs"]
mod admin_plane;

use admin_plane::*;
use lorafleet_tests::{engine_fixtures, run};
use serde_json::{Value, json};

const MODEL: &str = "qwen3-moe";

/// The adapters served, and the route each gets.
const ADAPTERS: [(&str, &str); 2] = [("qv-r8", "support"), ("experts-r4", "experts")];

/// The golden cases of the base model and [`ADAPTERS`], through the
/// offline batch command; returns each case's (adapter, prompt, text).
fn generate_goldens() -> Vec<(Option<String>, String, String)> {
    let fixtures = engine_fixtures();
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join("golden_moe.json")).unwrap())
            .unwrap();
    let max_new = golden["max_new_tokens"].as_u64().unwrap();
    let cases: Vec<&Value> = golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| {
            c["model"] == MODEL
                && (c["adapter"].is_null() || ADAPTERS.iter().any(|(a, _)| c["adapter"] == *a))
        })
        .collect();
    assert_eq!(cases.len(), 9);
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
        fixtures.join(MODEL).display().to_string(),
        "--input".into(),
        input.display().to_string(),
        "--output".into(),
        output.display().to_string(),
    ];
    for (a, _) in ADAPTERS {
        let dir = fixtures.join("adapters").join(MODEL).join(a);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_gets_a_moe_adapters_golden_text_through_the_gateway() {
    let expected = generate_goldens();
    let p = plane_on("moe_e2e", 1, MODEL).await;
    p.ctl_json(&["tenants", "create", "acme"]);
    let key = p.ctl_json(&["keys", "create", "acme"])["key"]
        .as_str()
        .unwrap()
        .to_owned();
    p.ctl_json(&[
        "base-models",
        "register",
        MODEL,
        "--architecture",
        "qwen3_moe",
        "--model-dir",
        engine_fixtures().join(MODEL).to_str().unwrap(),
    ]);
    let mut ids = Vec::new();
    for (adapter, route) in ADAPTERS {
        let id = p.ctl_json(&[
            "adapters",
            "register",
            route,
            "--tenant",
            "acme",
            "--base-model",
            MODEL,
            "--artifact-uri",
            &format!("{MODEL}/{adapter}"),
        ])["lora_int_id"]
            .as_i64()
            .unwrap();
        p.ctl_json(&[
            "routes",
            "set",
            "acme",
            route,
            "--weights",
            &format!("{id}=10000"),
        ]);
        ids.push(id);
    }
    let v1 = ids[0];
    p.ctl_json(&[
        "routes",
        "set",
        "acme",
        "base",
        "--base",
        "--base-model",
        MODEL,
    ]);
    // Per-expert modules (which a transformers 5 MoE does not have) are
    // refused at registration, naming the field.
    let bad = p.root.path().join("qwen3-moe/experts");
    copy_dir(&p.root.path().join("qwen3-moe/qv-r8"), &bad);
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(bad.join("adapter_config.json")).unwrap())
            .unwrap();
    config["target_modules"] = json!(["q_proj", "down_proj"]);
    std::fs::write(bad.join("adapter_config.json"), config.to_string()).unwrap();
    p.ctl(&[
        "adapters",
        "register",
        "experts",
        "--tenant",
        "acme",
        "--base-model",
        MODEL,
        "--artifact-uri",
        "qwen3-moe/experts",
    ])
    .refused(6, "target_modules");

    for (adapter, prompt, text) in &expected {
        let model = match adapter {
            Some(a) => ADAPTERS.iter().find(|(n, _)| n == a).unwrap().1,
            None => "base",
        };
        let resp = p
            .http
            .post(format!("{}/v1/completions", p.api_url(0)))
            .bearer_auth(&key)
            .json(&json!({"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let body: Value = resp.json().await.unwrap();
        assert_eq!(
            body["choices"][0]["text"].as_str().unwrap(),
            text,
            "{model} / {prompt}"
        );
    }
    // The audit log names the adapter version that served, and the fleet
    // view the worker's base model.
    let rows = p.audit_rows("acme", "support", 3).await;
    assert!(rows.iter().all(|r| r["lora_int_id"].as_i64() == Some(v1)));
    let rows = p.audit_rows("acme", "experts", 3).await;
    assert!(
        rows.iter()
            .all(|r| r["lora_int_id"].as_i64() == Some(ids[1]))
    );
    let fleet = p.ctl_json(&["fleet"]);
    assert_eq!(fleet["workers"][0]["base_model"], MODEL);
}
