//! Mixture-of-Experts models (Qwen3-MoE, Mixtral) on the CPU backend:
//! against transformers + PEFT (logits within 1e-4 relative, greedy tokens
//! exactly), a staggered mixed batch equal to one request at a time, and
//! the refusals of what the engine does not run yet.

mod common;

use common::*;
use lorafleet_engine::backend::cpu::CpuBackend;
use lorafleet_engine::backend::{Backend, BackendShape, StepBatch};
use lorafleet_engine::lora::{AdapterLimits, HostAdapter};
use lorafleet_engine::model::ModelConfig;

const MODELS: [&str; 2] = ["qwen3-moe", "mixtral-moe"];

#[test]
fn moe_forward_matches_transformers_and_peft() {
    let golden = golden_moe();
    let mut checked = 0;
    for model in MODELS {
        let dir = model_dir(model);
        let config = ModelConfig::from_dir(&dir).unwrap();
        assert!(
            config.moe.is_some(),
            "{model} is a Mixture-of-Experts model"
        );
        checked += check_golden_cases_on_cpu(&golden, model, model);
    }
    assert_eq!(checked, golden.cases.len());
    assert!(checked >= 21, "every model, adapter and prompt: {checked}");
}

#[test]
fn a_staggered_mixed_batch_of_moe_adapters_equals_one_at_a_time() {
    for model in MODELS {
        assert_staggered_batch_equals_alone(model, lorafleet_engine::BackendChoice::Cpu);
    }
}

#[test]
fn what_the_engine_does_not_run_yet_is_refused_by_field() {
    let config = ModelConfig::from_dir(&model_dir("qwen3-moe")).unwrap();
    let limits = || AdapterLimits {
        model: &config,
        max_lora_rank: 16,
        base_hash_check: None,
    };
    // Per-expert modules do not exist in a transformers 5 MoE (its experts
    // are fused tensors), and only the expert and router tensors may be
    // targeted as parameters.
    let dir = tempfile::tempdir().unwrap();
    let src = adapter_dir("qwen3-moe", "qv-r8");
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let original: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("adapter_config.json")).unwrap())
            .unwrap();
    for (field, value, needle) in [
        (
            "target_modules",
            serde_json::json!(["q_proj", "gate_proj"]),
            "gate_proj",
        ),
        (
            "target_parameters",
            serde_json::json!(["self_attn.q_proj.weight"]),
            "target_parameters",
        ),
    ] {
        let mut c = original.clone();
        c[field] = value;
        std::fs::write(dir.path().join("adapter_config.json"), c.to_string()).unwrap();
        let err = HostAdapter::load("x", dir.path(), limits())
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{field}: {err}");
    }
}

#[test]
fn the_expert_lora_path_is_skipped_for_adapters_without_expert_weights() {
    let model = "qwen3-moe";
    let dir = model_dir(model);
    let config = ModelConfig::from_dir(&dir).unwrap();
    let shape = BackendShape {
        slots: 2,
        max_lora_rank: 16,
        kv_blocks: 16,
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
    let attention = HostAdapter::load("qv-r8", &adapter_dir(model, "qv-r8"), limits).unwrap();
    let experts =
        HostAdapter::load("experts-r4", &adapter_dir(model, "experts-r4"), limits).unwrap();
    assert!(attention.experts.iter().all(|l| l.is_empty()));
    assert!(
        experts
            .experts
            .iter()
            .all(|l| l.gate_up.is_some() && l.down.is_some())
    );
    backend.write_slot(0, &attention).unwrap();
    backend.write_slot(1, &experts).unwrap();
    let prompt = [1u32, 40, 41, 42, 43];
    let step = |backend: &mut CpuBackend, slots: &[Option<usize>]| {
        let mut batch = StepBatch::default();
        let tables: Vec<Vec<u32>> = (0..slots.len() as u32)
            .map(|i| vec![i * 2, i * 2 + 1])
            .collect();
        for (slot, table) in slots.iter().zip(&tables) {
            batch.push(&prompt, 0, table, *slot, true);
        }
        batch.finish();
        backend.forward(&batch).unwrap();
    };
    // The base model and an attention-only adapter: no row enters it.
    step(&mut backend, &[None, Some(0)]);
    assert_eq!(backend.expert_lora_rows(), 0);
    // An adapter with expert weights beside them: only its rows do, in
    // each layer (the last layer runs only the row that wants logits).
    step(&mut backend, &[None, Some(0), Some(1)]);
    assert_eq!(
        backend.expert_lora_rows(),
        (prompt.len() * (config.num_layers - 1) + 1) as u64
    );
}
