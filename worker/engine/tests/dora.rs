//! DoRA adapters (`use_dora`) as PEFT makes them
//! (`scripts/make_dora_fixtures.py`: A, B and the magnitude moved off their
//! initial values) on the CPU backend: logits within 1e-4 of transformers +
//! PEFT and greedy tokens equal, on a dense Llama, a Qwen2 with q/k/v
//! biases, the attention of a Mixture-of-Experts model and a quantized
//! (8-bit packed) base; in one step beside a plain LoRA adapter and the
//! base model, each row as it is alone; and a magnitude of the wrong
//! length refused by its tensor.

mod common;

use common::*;
use lorafleet_engine::backend::cpu::CpuBackend;
use lorafleet_engine::backend::{Backend, BackendShape, StepBatch};
use lorafleet_engine::lora::{AdapterLimits, HostAdapter};
use lorafleet_engine::model::ModelConfig;

fn golden_dora() -> Golden {
    let text = std::fs::read_to_string(fixtures().join("golden_dora.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// (model, where its DoRA adapters are, under `adapters/`).
const MODELS: [(&str, &str); 4] = [
    ("llama-gqa", "dora/llama-gqa"),
    ("qwen2-tied", "dora/qwen2-tied"),
    ("mixtral-moe", "dora/mixtral-moe"),
    ("llama-gqa-tool-w8a16", "dora/llama-gqa"),
];

const SHAPE: BackendShape = BackendShape {
    slots: 3,
    max_lora_rank: 16,
    kv_blocks: 32,
    block_size: 4,
    ring_len: 0,
    ring_blocks: 0,
};

fn load(model: &str, dir: &str, name: &str) -> HostAdapter {
    let config = ModelConfig::from_dir(&model_dir(model)).unwrap();
    let limits = AdapterLimits {
        model: &config,
        max_lora_rank: 16,
        base_hash_check: None,
    };
    HostAdapter::load(name, &adapter_dir(dir, name), limits).unwrap()
}

#[test]
fn dora_adapters_match_peft() {
    let golden = golden_dora();
    let mut checked = 0;
    for (model, dir) in MODELS {
        checked += check_golden_cases_on_cpu(&golden, model, dir);
    }
    assert_eq!(checked, golden.cases.len());
    assert_eq!(checked, 3 * (4 + 5), "3 prompts x (4 bases + 5 adapters)");
}

/// A DoRA adapter, a plain LoRA adapter and the base model in one step:
/// each sequence's logits are its own golden's, so the scale touches only
/// the DoRA rows.
#[test]
fn dora_rows_beside_plain_lora_and_base_rows_are_each_their_own() {
    let model = "llama-gqa";
    let dir = model_dir(model);
    let config = ModelConfig::from_dir(&dir).unwrap();
    let mut backend = CpuBackend::load(&dir, &config, SHAPE).unwrap();
    let dora = load(model, "dora/llama-gqa", "dora-qv-r8");
    assert!(dora.is_dora());
    backend.write_slot(1, &dora).unwrap();
    let plain = load(model, model, "qv-r8");
    assert!(!plain.is_dora());
    backend.write_slot(2, &plain).unwrap();
    let (dora_golden, plain_golden) = (golden_dora(), golden());
    let prompt = "The quick brown fox";
    let case = |g: &Golden, adapter: Option<&str>| {
        g.cases
            .iter()
            .find(|c| c.model == model && c.adapter.as_deref() == adapter && c.prompt == prompt)
            .unwrap()
            .logits
            .clone()
    };
    let want = [
        case(&dora_golden, None),
        case(&dora_golden, Some("dora-qv-r8")),
        case(&plain_golden, Some("qv-r8")),
    ];
    let ids = &dora_golden
        .cases
        .iter()
        .find(|c| c.model == model && c.prompt == prompt)
        .unwrap()
        .prompt_ids;
    // Base-model rows first, then by slot.
    let tables: Vec<Vec<u32>> = (0..3).map(|s| (s * 8..s * 8 + 8).collect()).collect();
    let mut batch = StepBatch::default();
    for (s, slot) in [None, Some(1), Some(2)].into_iter().enumerate() {
        batch.push(ids, 0, &tables[s], slot, true);
    }
    batch.finish();
    let logits = backend.forward(&batch).unwrap();
    let vocab = config.vocab_size;
    for (i, want) in want.iter().enumerate() {
        let got = &logits[i * vocab..(i + 1) * vocab];
        let err = relative_error(got, want);
        assert!(err <= 1e-4, "row {i}: relative error {err}");
    }
    // Cleared, the slot is plain again: the base row of slot 1 is the base.
    backend.clear_slot(1).unwrap();
    let mut batch = StepBatch::default();
    batch.push(ids, 0, &tables[1], Some(1), true);
    batch.finish();
    let err = relative_error(&backend.forward(&batch).unwrap(), &want[0]);
    assert!(err <= 1e-4, "a cleared DoRA slot: relative error {err}");
}

/// An adapter's scales are computed once and kept by its digest: evicted
/// and written again, to any slot, it takes them from the cache and its
/// logits are still PEFT's; another adapter, or one without a digest,
/// computes its own.
#[test]
fn dora_scales_are_computed_once_per_adapter_and_kept_across_evictions() {
    let model = "llama-gqa";
    let dir = model_dir(model);
    let config = ModelConfig::from_dir(&dir).unwrap();
    let mut backend = CpuBackend::load(&dir, &config, SHAPE).unwrap();
    let mut dora = load(model, "dora/llama-gqa", "dora-qv-r8");
    dora.digest = Some("digest-of-dora-qv-r8".into());
    let golden = golden_dora();
    let case = golden
        .cases
        .iter()
        .find(|c| c.model == model && c.adapter.as_deref() == Some("dora-qv-r8"))
        .unwrap();
    for slot in [1, 2, 1] {
        backend.write_slot(slot, &dora).unwrap();
        check_golden_case(&mut backend, case, Some(slot));
        backend.clear_slot(slot).unwrap();
    }
    assert_eq!(backend.dora_scales_computed(), 1);
    let mut other = load(model, "dora/llama-gqa", "dora-all-linear-rslora");
    other.digest = Some("digest-of-dora-all-linear".into());
    backend.write_slot(0, &other).unwrap();
    assert_eq!(backend.dora_scales_computed(), 2);
    dora.digest = None;
    backend.write_slot(1, &dora).unwrap();
    backend.write_slot(1, &dora).unwrap();
    assert_eq!(backend.dora_scales_computed(), 4);
}

/// A magnitude vector of the wrong length, or one without `use_dora`, is
/// refused by its tensor's name before anything is served.
#[test]
fn a_magnitude_of_the_wrong_length_is_refused_by_its_tensor() {
    let model = "llama-gqa";
    let config = ModelConfig::from_dir(&model_dir(model)).unwrap();
    let limits = AdapterLimits {
        model: &config,
        max_lora_rank: 16,
        base_hash_check: None,
    };
    let src = adapter_dir("dora/llama-gqa", "dora-qv-r8");
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(
        src.join("adapter_config.json"),
        tmp.path().join("adapter_config.json"),
    )
    .unwrap();
    let tensors = safetensors::SafeTensors::deserialize(
        &std::fs::read(src.join("adapter_model.safetensors")).unwrap(),
    )
    .unwrap()
    .tensors()
    .into_iter()
    .map(|(name, view)| {
        (
            name,
            view.dtype(),
            view.shape().to_vec(),
            view.data().to_vec(),
        )
    })
    .collect::<Vec<_>>();
    let target = "base_model.model.model.layers.1.self_attn.v_proj.lora_magnitude_vector";
    let write = |cut: bool| {
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(name, dtype, shape, data)| {
                let (shape, data) = if cut && name == target {
                    (vec![shape[0] - 1], &data[..data.len() - 4])
                } else {
                    (shape.clone(), &data[..])
                };
                (
                    name.clone(),
                    safetensors::tensor::TensorView::new(*dtype, shape, data).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &tmp.path().join("adapter_model.safetensors"))
            .unwrap();
    };
    write(true);
    let err = HostAdapter::load("cut", tmp.path(), limits)
        .unwrap_err()
        .to_string();
    assert!(err.contains(target) && err.contains("31 values"), "{err}");
    // The same file under a config without use_dora: the magnitudes are
    // not the LoRA it says.
    write(false);
    let path = tmp.path().join("adapter_config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    c["use_dora"] = false.into();
    std::fs::write(&path, c.to_string()).unwrap();
    let err = HostAdapter::load("plain", tmp.path(), limits)
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not set use_dora"), "{err}");
}
