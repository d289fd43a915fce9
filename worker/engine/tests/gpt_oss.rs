//! GPT-OSS on the CPU backend, from its bf16 checkpoint and from its MXFP4
//! checkpoint as released (`scripts/make_gpt_oss_fixtures.py`: the
//! 20B's `config.json` with the sizes shrunk, the window 8): against
//! transformers + PEFT (logits within 1e-4 relative, greedy tokens
//! exactly) with attention sinks, alternating sliding and full layers,
//! YaRN, the biased router and experts and the clamped SwiGLU; LoRA on
//! q/k/v/o and on the experts (`target_parameters`) mixed in one batch
//! with the base; the MXFP4 experts held at 4 bits.

mod common;

use common::*;
use lorafleet_engine::BackendChoice;
use lorafleet_engine::backend::BackendShape;
use lorafleet_engine::backend::cpu::CpuBackend;
use lorafleet_engine::lora::{AdapterLimits, HostAdapter};
use lorafleet_engine::model::Architecture;
use lorafleet_engine::model::ModelConfig;
use lorafleet_engine::model::layers::LayerKind;

const MODELS: [&str; 2] = ["gpt-oss", "gpt-oss-mxfp4"];

fn golden_gpt_oss() -> Golden {
    golden_named("golden_gpt_oss.json")
}

#[test]
fn gpt_oss_matches_transformers_and_peft_from_bf16_and_from_mxfp4() {
    let golden = golden_gpt_oss();
    let mut checked = 0;
    for model in MODELS {
        let config = ModelConfig::from_dir(&model_dir(model)).unwrap();
        assert_eq!(config.architecture, Architecture::GptOss);
        assert!(config.attention_sinks && config.qkv_bias && config.o_bias);
        assert_eq!(config.sliding_window, Some(8));
        assert_eq!(
            config.layer_kinds,
            [
                LayerKind::Sliding,
                LayerKind::Full,
                LayerKind::Sliding,
                LayerKind::Full
            ]
        );
        let moe = config.moe.unwrap();
        assert_eq!((moe.num_experts, moe.top_k), (8, 4));
        assert!(moe.gpt_oss.is_some());
        assert_eq!(
            config.quantization.as_ref().map(|q| q.format.name()),
            (model == "gpt-oss-mxfp4").then_some("mxfp4")
        );
        // The adapters were trained on the bf16 base; the same tensors
        // serve the MXFP4 one (the goldens are each base's own).
        checked += check_golden_cases_on_cpu(&golden, model, "gpt-oss");
    }
    assert_eq!(checked, golden.cases.len());
    assert!(
        checked >= 32,
        "both bases, 3 adapters and the base, 4 prompts: {checked}"
    );
}

#[test]
fn the_engine_batches_gpt_oss_adapters_and_the_base_into_the_golden_tokens() {
    for model in MODELS {
        gpt_oss_engine_matches_the_goldens(model, BackendChoice::Cpu);
    }
}

#[test]
fn a_staggered_mixed_batch_of_gpt_oss_adapters_equals_one_at_a_time() {
    assert_staggered_batch_equals_alone("gpt-oss", BackendChoice::Cpu);
}

#[test]
fn the_mxfp4_experts_stay_at_four_bits() {
    let shape = BackendShape {
        slots: 1,
        max_lora_rank: 16,
        kv_blocks: 8,
        block_size: 4,
        ring_len: 0,
        ring_blocks: 0,
    };
    let load = |model: &str| {
        let dir = model_dir(model);
        let config = ModelConfig::from_dir(&dir).unwrap();
        (CpuBackend::load(&dir, &config, shape).unwrap(), config)
    };
    let (bf16, config) = load("gpt-oss");
    let (mx, _) = load("gpt-oss-mxfp4");
    let (h, i, e, l) = (
        config.hidden_size,
        config.intermediate_size,
        config.moe.unwrap().num_experts,
        config.num_layers,
    );
    let weights = l * e * (2 * i * h + i * h);
    // bf16: two bytes a weight. MXFP4: half a byte a code and an f32 scale
    // per 32 inputs (the checkpoint's E8M0 byte widened), beside the
    // routers (f32) and each expert's map of inputs to groups.
    let (router, group_maps) = (l * e * h * 4, l * e * (h + i) * 4);
    assert!(bf16.moe_bytes() >= weights * 2, "{}", bf16.moe_bytes());
    let mx_bytes = mx.moe_bytes();
    assert!(mx_bytes >= weights / 2, "{mx_bytes}");
    assert!(
        mx_bytes <= weights / 2 + weights / 32 * 4 + router + group_maps,
        "MXFP4 experts take {mx_bytes} bytes for {weights} weights"
    );
    assert!(
        mx_bytes * 2 < bf16.moe_bytes(),
        "{mx_bytes} vs {}",
        bf16.moe_bytes()
    );
}

#[test]
fn what_gpt_oss_does_not_serve_is_refused_by_field() {
    let config = ModelConfig::from_dir(&model_dir("gpt-oss")).unwrap();
    let limits = AdapterLimits {
        model: &config,
        max_lora_rank: 16,
        base_hash_check: None,
    };
    let dir = tempfile::tempdir().unwrap();
    let src = adapter_dir("gpt-oss", "experts-r4");
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("adapter_config.json")).unwrap())
            .unwrap();
    // The router is `mlp.router` here: Mixtral's `mlp.gate.weight` names
    // nothing of GPT-OSS.
    c["target_parameters"] = serde_json::json!(["mlp.gate.weight"]);
    std::fs::write(dir.path().join("adapter_config.json"), c.to_string()).unwrap();
    let err = HostAdapter::load("x", dir.path(), limits)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("target_parameters") && err.contains("mlp.router"),
        "{err}"
    );
}
