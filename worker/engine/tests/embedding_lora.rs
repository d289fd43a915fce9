//! LoRA on the token embeddings and on the lm_head as PEFT makes it
//! (`scripts/make_embedding_fixtures.py`), on the CPU backend: logits
//! within 1e-4 of transformers + PEFT and greedy tokens equal (a Llama, a
//! Qwen2 whose lm_head is tied to its embeddings, and Gemma 3 and Gemma 2,
//! whose embedding scale PEFT applies to the LoRA output too), each applied to its
//! adapter's rows alone beside a plain adapter and the base in one step,
//! and a saved copy of the embeddings that is not the base's refused by
//! its tensor.

mod common;

use common::*;
use lorafleet_engine::backend::cpu::CpuBackend;
use lorafleet_engine::backend::{Backend, BackendShape, StepBatch};
use lorafleet_engine::lora::{AdapterLimits, HostAdapter};
use lorafleet_engine::model::ModelConfig;

fn golden_embedding() -> Golden {
    golden_named("golden_embedding.json")
}

#[test]
fn embedding_and_lm_head_lora_match_peft() {
    let golden = golden_embedding();
    let checked = check_golden_cases_on_cpu(&golden, "llama-gqa", "embedding/llama-gqa")
        + check_golden_cases_on_cpu(&golden, "qwen2-tied", "embedding/qwen2-tied")
        // Gemma's embedding scale applies to the LoRA output too; Gemma 2
        // soft-caps the logits after the lm_head LoRA.
        + check_golden_cases_on_cpu(&golden, "gemma3-1b", "embedding/gemma3-1b")
        + check_golden_cases_on_cpu(&golden, "gemma2-2b", "embedding/gemma2-2b");
    assert_eq!(checked, golden.cases.len());
    assert_eq!(checked, 18);
}

fn backend(model: &str, slots: usize) -> (CpuBackend, ModelConfig) {
    let dir = model_dir(model);
    let config = ModelConfig::from_dir(&dir).unwrap();
    let shape = BackendShape {
        slots,
        max_lora_rank: 16,
        kv_blocks: 32,
        block_size: 4,
        ring_len: 0,
        ring_blocks: 0,
    };
    (CpuBackend::load(&dir, &config, shape).unwrap(), config)
}

fn load(config: &ModelConfig, dir: std::path::PathBuf) -> Result<HostAdapter, String> {
    let limits = AdapterLimits {
        model: config,
        max_lora_rank: 16,
        base_hash_check: None,
    };
    HostAdapter::load("a", &dir, limits).map_err(|e| e.to_string())
}

#[test]
fn each_adapter_changes_its_own_rows_beside_a_plain_adapter_and_the_base() {
    let model = "llama-gqa";
    let (mut backend, config) = backend(model, 3);
    let both = load(
        &config,
        adapter_dir("embedding/llama-gqa", "embed-head-rslora"),
    )
    .unwrap();
    let head = load(&config, adapter_dir("embedding/llama-gqa", "head-qv-r8")).unwrap();
    let plain = load(&config, adapter_dir(model, "qv-r8")).unwrap();
    assert!(both.has_outer() && head.has_outer() && !plain.has_outer());
    backend.write_slot(0, &both).unwrap();
    backend.write_slot(1, &plain).unwrap();
    backend.write_slot(2, &head).unwrap();
    let prompt = "The quick brown fox";
    let pick = |g: &Golden, adapter: Option<&str>| {
        g.cases
            .iter()
            .find(|c| c.model == model && c.adapter.as_deref() == adapter && c.prompt == prompt)
            .unwrap()
            .clone()
    };
    let (plain_golden, embedding) = (golden(), golden_embedding());
    let cases = [
        (pick(&embedding, Some("embed-head-rslora")), Some(0)),
        (pick(&plain_golden, None), None),
        (pick(&plain_golden, Some("qv-r8")), Some(1)),
        (pick(&embedding, Some("head-qv-r8")), Some(2)),
    ];
    let mut batch = StepBatch::default();
    let tables: Vec<Vec<u32>> = (0..4).map(|s| (s * 8..s * 8 + 8).collect()).collect();
    for ((case, slot), table) in cases.iter().zip(&tables) {
        batch.push(&case.prompt_ids, 0, table, *slot, true);
    }
    batch.finish();
    let logits = backend.forward(&batch).unwrap();
    let v = config.vocab_size;
    for (i, (case, _)) in cases.iter().enumerate() {
        let err = relative_error(&logits[i * v..(i + 1) * v], &case.logits);
        assert!(err <= 1e-4, "{:?}: {err}", case.adapter);
    }
    // A cleared slot is the base again.
    backend.clear_slot(0).unwrap();
    let mut batch = StepBatch::default();
    batch.push(&cases[0].0.prompt_ids, 0, &tables[0], Some(0), true);
    batch.finish();
    let base = pick(&plain_golden, None);
    assert!(relative_error(&backend.forward(&batch).unwrap(), &base.logits) <= 1e-4);
}

#[test]
fn a_saved_embedding_that_is_not_the_bases_is_refused_by_its_tensor() {
    let (mut backend, config) = backend("llama-gqa", 1);
    // The same adapter on a base whose embeddings differ: qwen2-tied has
    // the same shapes but its own values.
    let dir = tempfile::tempdir().unwrap();
    let src = adapter_dir("embedding/llama-gqa", "embed-r4");
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let (mut other, other_config) = self::backend("qwen2-tied", 1);
    let adapter = load(&other_config, dir.path().to_path_buf()).unwrap();
    let err = other.write_slot(0, &adapter).unwrap_err().to_string();
    assert!(
        err.contains("base_model.model.model.embed_tokens.base_layer.weight")
            && err.contains("not the base model's own"),
        "{err}"
    );
    // On its own base it is served.
    let adapter = load(&config, src).unwrap();
    backend.write_slot(0, &adapter).unwrap();
    // A target the file lacks is refused by its tensor at load.
    let mut c: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    c["target_modules"] = serde_json::json!(["embed_tokens", "lm_head"]);
    std::fs::write(dir.path().join("adapter_config.json"), c.to_string()).unwrap();
    let err = load(&config, dir.path().to_path_buf()).unwrap_err();
    assert!(
        err.contains("base_model.model.lm_head.lora_A.weight") && err.contains("missing"),
        "{err}"
    );
    // With DoRA, by the field.
    c["target_modules"] = serde_json::json!(["embed_tokens"]);
    c["use_dora"] = true.into();
    std::fs::write(dir.path().join("adapter_config.json"), c.to_string()).unwrap();
    let err = load(&config, dir.path().to_path_buf()).unwrap_err();
    assert!(err.contains("use_dora"), "{err}");
}
