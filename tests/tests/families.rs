//! One adapter of each model family served end to end: a Llama 3.2 (RoPE
//! `llama3` scaling, tied embeddings), Qwen3 (q/k norms, YaRN) and
//! Phi-3.5-mini (fused projections, an adapter on `qkv_proj`, LongRoPE past
//! its original context), Gemma 3 1B (sliding and global layers with their
//! own RoPE, GeGLU, (1 + w) norms) and Gemma 2 (soft-capping) stand-in, each behind a
//! gateway on its own worker, the base model and adapter registered through
//! `lorafleetctl`, and a tenant's completion asked with the official OpenAI
//! Python SDK: every prompt and completion token's log probability over a
//! prompt of at least 96 tokens is transformers + PEFT's
//! (`golden_families.json`) within 1e-4.

#[path = "support/admin_plane.rs"]
mod admin_plane;

use std::path::PathBuf;
use std::process::Command;

use admin_plane::*;
use lorafleet_tests::engine_fixtures;
use serde_json::Value;

/// Each family's fixture, its `model_type` and the adapter served.
const FAMILIES: [(&str, &str, &str); 5] = [
    ("llama32-tied", "llama", "all-linear-r4"),
    ("qwen3-yarn", "qwen3", "all-linear-r4"),
    ("phi35-mini", "phi3", "qkv-o-r8"),
    ("gemma3-1b", "gemma3_text", "all-linear-r4"),
    ("gemma2-2b", "gemma2", "qkvo-r4"),
];

fn python() -> PathBuf {
    lorafleet_tests::sdk_python()
}

/// The long-prompt golden case of `model` with `adapter`.
fn golden_case(model: &str, adapter: &str) -> (Value, Value) {
    let g: Value = serde_json::from_str(
        &std::fs::read_to_string(engine_fixtures().join("golden_families.json")).unwrap(),
    )
    .unwrap();
    let case = g["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["model"] == model && c["adapter"] == adapter)
        .max_by_key(|c| c["prompt_ids"].as_array().unwrap().len())
        .unwrap()
        .clone();
    (g, case)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_gets_each_familys_adapter_as_transformers_and_peft_score_it() {
    for (model, architecture, adapter) in FAMILIES {
        let (g, case) = golden_case(model, adapter);
        let ids = case["prompt_ids"].as_array().unwrap();
        assert!(ids.len() >= 96, "{model}: a long prompt");
        let p = plane_on(&format!("families_{}", model.replace('-', "_")), 1, model).await;
        let (key, _) = tenant_on_fixture_base(&p, "acme", model, architecture);
        let id = p.ctl_json(&[
            "adapters",
            "register",
            "tuned",
            "--tenant",
            "acme",
            "--base-model",
            model,
            "--artifact-uri",
            &format!("{model}/{adapter}"),
        ])["lora_int_id"]
            .as_i64()
            .unwrap();
        route_all(&p, "acme", "tuned", id);
        p.until_status(0, &key, "tuned", 200).await;

        let out = Command::new(python())
            .args([
                PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                    .join("openai_sdk/families.py")
                    .to_str()
                    .unwrap(),
                &format!("{}/v1", p.api_url(0)),
                "tuned",
                &serde_json::to_string(ids).unwrap(),
                &g["new_tokens"].to_string(),
                &g["top"].to_string(),
            ])
            .env("OPENAI_API_KEY", &key)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{model}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got: Value = serde_json::from_slice(&out.stdout).unwrap();
        let want: Vec<&Value> = case["prompt"]
            .as_array()
            .unwrap()
            .iter()
            .chain(case["completion"].as_array().unwrap())
            .collect();
        let lps = got["token_logprobs"].as_array().unwrap();
        assert!(
            lps[0].is_null(),
            "{model}: the first prompt token is unscored"
        );
        assert_eq!(lps.len() - 1, want.len(), "{model}: {got}");
        assert_eq!(got["prompt_tokens"], ids.len(), "{model}");
        assert_eq!(
            got["completion_tokens"],
            case["completion"].as_array().unwrap().len(),
            "{model}"
        );
        for (i, (g, w)) in lps[1..].iter().zip(&want).enumerate() {
            let (g, w) = (g.as_f64().unwrap(), w["logprob"].as_f64().unwrap());
            assert!(
                (g - w).abs() <= 1e-4,
                "{model} token {}: {g} against {w}",
                i + 1
            );
            let tops = got["top_logprobs"][i + 1].as_array().unwrap();
            let wtops = w_top(want[i]);
            for (a, b) in tops.iter().zip(&wtops) {
                let a = a.as_f64().unwrap();
                assert!(
                    (a - b).abs() <= 1e-4,
                    "{model} token {} top: {a} against {b}",
                    i + 1
                );
            }
        }
        // The audit log names the adapter version that served.
        let rows = p.audit_rows("acme", "tuned", 1).await;
        assert_eq!(rows[0]["lora_int_id"].as_i64(), Some(id), "{model}");
    }
}

/// A golden entry's top log probabilities, largest first.
fn w_top(entry: &Value) -> Vec<f64> {
    let mut v: Vec<f64> = entry["top"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[1].as_f64().unwrap())
        .collect();
    v.sort_by(|a, b| b.total_cmp(a));
    v
}
