//! Adapters with a bias on lora_B (`lora_bias: true`) as PEFT makes them
//! (`scripts/make_bias_fixtures.py`), on the CPU backend: logits within
//! 1e-4 of transformers + PEFT and greedy tokens equal (a Llama, and a
//! Qwen2 whose q/k/v carry biases of their own), the bias added to its
//! adapter's rows alone beside the base model, and a bias of the wrong
//! length refused by its tensor.

mod common;

use common::*;
use lorafleet_engine::backend::cpu::CpuBackend;
use lorafleet_engine::backend::{Backend, BackendShape, StepBatch};
use lorafleet_engine::lora::{AdapterLimits, HostAdapter};
use lorafleet_engine::model::ModelConfig;

fn golden_bias() -> Golden {
    let text = std::fs::read_to_string(fixtures().join("golden_bias.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn lora_bias_adapters_match_peft() {
    let golden = golden_bias();
    let checked = check_golden_cases_on_cpu(&golden, "llama-gqa", "bias/llama-gqa")
        + check_golden_cases_on_cpu(&golden, "qwen2-tied", "bias/qwen2-tied");
    assert_eq!(checked, golden.cases.len());
    assert_eq!(checked, 6);
}

#[test]
fn the_bias_goes_to_its_adapters_rows_alone() {
    let model = "llama-gqa";
    let dir = model_dir(model);
    let config = ModelConfig::from_dir(&dir).unwrap();
    let shape = BackendShape {
        slots: 2,
        max_lora_rank: 16,
        kv_blocks: 32,
        block_size: 4,
        ring_len: 0,
        ring_blocks: 0,
    };
    let mut backend = CpuBackend::load(&dir, &config, shape).unwrap();
    let limits = AdapterLimits {
        model: &config,
        max_lora_rank: 16,
        base_hash_check: None,
    };
    let adapter =
        HostAdapter::load("b", &adapter_dir("bias/llama-gqa", "bias-qv-r8"), limits).unwrap();
    assert!(adapter.has_lora_bias());
    backend.write_slot(1, &adapter).unwrap();
    let prompt = "The quick brown fox";
    let pick = |g: Golden, adapter: Option<&str>| {
        g.cases
            .into_iter()
            .find(|c| c.model == model && c.adapter.as_deref() == adapter && c.prompt == prompt)
            .unwrap()
    };
    let (base, biased) = (
        pick(golden(), None),
        pick(golden_bias(), Some("bias-qv-r8")),
    );
    let tables: Vec<Vec<u32>> = (0..2).map(|s| (s * 8..s * 8 + 8).collect()).collect();
    let mut batch = StepBatch::default();
    batch.push(&base.prompt_ids, 0, &tables[0], None, true);
    batch.push(&biased.prompt_ids, 0, &tables[1], Some(1), true);
    batch.finish();
    let logits = backend.forward(&batch).unwrap();
    let v = config.vocab_size;
    assert!(relative_error(&logits[..v], &base.logits) <= 1e-4);
    assert!(relative_error(&logits[v..], &biased.logits) <= 1e-4);
}

#[test]
fn a_bias_of_the_wrong_length_is_refused_by_its_tensor() {
    use lorafleet_engine::lora::config::AdapterConfig;
    let text = std::fs::read_to_string(
        adapter_dir("bias/llama-gqa", "bias-qv-r8").join("adapter_config.json"),
    )
    .unwrap();
    let config = AdapterConfig::from_text("a", &text, Some(2)).unwrap();
    let mut header = lorafleet_artifact::safetensors_header::read(
        &adapter_dir("bias/llama-gqa", "bias-qv-r8").join("adapter_model.safetensors"),
    )
    .unwrap();
    let name = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.bias";
    header.tensors.get_mut(name).unwrap().shape = vec![31];
    let err = lorafleet_artifact::adapter::tensors::check("a", &config, &header, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains(name) && err.contains("31 values"), "{err}");
}
