//! A quantized base served end to end: `lorafleet-worker generate` gives
//! the transformers + PEFT goldens on the 4-bit llama-gqa (compressed-tensors
//! pack-quantized, made by `make_quantized_fixtures.py`) and on the FP8_BLOCK
//! llama-gqa llm-compressor wrote (FP8 weights in blocks of 32 x 32, FP8
//! inputs per group of 32, `make_tool_quantized_fixtures.py`), and a
//! tenant's completion through the gateway — the base registered with
//! `lorafleetctl` from its directory (its base hash covers the quantized
//! bytes), a worker serving it, an adapter trained on llama-gqa routed to
//! it — gives the same text. So does GPT-OSS from its MXFP4 checkpoint as
//! released, with an adapter on its experts trained on the bf16 model.

#[path = "support/admin_plane.rs"]
mod admin_plane;
#[path = "support/goldens.rs"]
mod goldens;

use admin_plane::*;
use goldens::{assert_gateway_gives, generate_goldens};
use lorafleet_tests::engine_fixtures;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_gets_a_quantized_bases_golden_text_through_the_gateway() {
    served_end_to_end(
        "quantized_e2e",
        ("llama-gqa-int4", "golden_quantized.json"),
        LLAMA_GQA,
        "qkvo-r4",
        "int4, groups of 32",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_gets_an_fp8_block_bases_golden_text_through_the_gateway() {
    served_end_to_end(
        "quantized_fp8_block",
        ("llama-gqa-tool-fp8-block32", "golden_tool_quantized.json"),
        LLAMA_GQA,
        "qv-r8",
        "fp8-e4m3, blocks of 32x32, inputs fp8-e4m3 per group of 32",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_gets_gpt_oss_mxfp4_golden_text_with_an_expert_adapter_through_the_gateway() {
    served_end_to_end(
        "quantized_gpt_oss",
        ("gpt-oss-mxfp4", "golden_gpt_oss.json"),
        ("gpt-oss", "gpt_oss"),
        "experts-r4",
        "mxfp4, groups of 32",
    )
    .await;
}

/// The dense model the adapters were trained on, and the architecture.
const LLAMA_GQA: (&str, &str) = ("llama-gqa", "llama");

/// `model` (with its goldens' file) registered as `architecture`, served
/// and asked through the gateway, base and `adapter` (trained on `dense`);
/// the fleet shows it as `label`.
async fn served_end_to_end(
    name: &str,
    (model, goldens): (&str, &str),
    (dense, architecture): (&str, &str),
    adapter: &str,
    label: &str,
) {
    // The base and the adapter on each of the goldens' prompts.
    let prompts = if dense == "gpt-oss" { 4 } else { 3 };
    let expected = generate_goldens(goldens, model, dense, &[adapter], 2 * prompts);
    let p = plane_on(name, 1, model).await;
    // The adapter was trained on llama-gqa; it is declared for this
    // quantization of it by name (`base_model_name_or_path`), which the
    // registry checks against the base it is registered on: a copy for a
    // quantized base says so.
    let copy = p.root.path().join(dense).join(adapter);
    copy_dir(
        &engine_fixtures().join("adapters").join(dense).join(adapter),
        &copy,
    );
    let config_path = copy.join("adapter_config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["base_model_name_or_path"] = model.into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    let (key, base) = tenant_on_fixture_base(&p, "acme", model, architecture);
    // Not the dense model's hash: each quantization is its own base.
    let hashes: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(engine_fixtures().join("base_hashes.json")).unwrap(),
    )
    .unwrap();
    assert!(base["base_hash"].is_string(), "{base}");
    assert_ne!(base["base_hash"], hashes[dense], "{base}");
    let id = p.ctl_json(&[
        "adapters",
        "register",
        "support",
        "--tenant",
        "acme",
        "--base-model",
        model,
        "--artifact-uri",
        &format!("{dense}/{adapter}"),
    ])["lora_int_id"]
        .as_i64()
        .unwrap();
    // The same adapter as trained, declaring the dense model, is refused
    // on the quantized base by that field: an adapter is served only on
    // the quantization it is declared for.
    let dense_copy = p.root.path().join(dense).join("as-trained");
    copy_dir(
        &engine_fixtures().join("adapters").join(dense).join(adapter),
        &dense_copy,
    );
    p.ctl(&[
        "adapters",
        "register",
        "as-trained",
        "--tenant",
        "acme",
        "--base-model",
        model,
        "--artifact-uri",
        &format!("{dense}/as-trained"),
    ])
    .refused(6, "base_model_name_or_path");
    p.ctl_json(&[
        "routes",
        "set",
        "acme",
        "support",
        "--weights",
        &format!("{id}=10000"),
    ]);
    p.ctl_json(&[
        "routes",
        "set",
        "acme",
        "base",
        "--base",
        "--base-model",
        model,
    ]);
    assert_gateway_gives(&p, &key, &expected, |adapter| match adapter {
        Some(_) => "support",
        None => "base",
    })
    .await;
    let rows = p.audit_rows("acme", "support", 3).await;
    assert!(rows.iter().all(|r| r["lora_int_id"].as_i64() == Some(id)));
    let worker = &p.ctl_json(&["fleet"])["workers"][0];
    assert_eq!(worker["base_model"], model);
    // The fleet shows the quantization and what the weights take as the
    // worker holds them: the codes, well under the f32 checkpoint.
    assert_eq!(worker["quantization"], label, "{worker}");
    let held = worker["weights_bytes"].as_u64().unwrap();
    // The dense llama-gqa's shards, f32.
    let dense: u64 = std::fs::read_dir(engine_fixtures().join(dense))
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert!(held > 0 && held < dense * 3 / 4, "{held} of {dense}");
    let table = p.ctl(&["fleet"]).stdout;
    assert!(table.contains(label), "{table}");
}
