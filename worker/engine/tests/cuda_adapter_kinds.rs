//! Adapters as people train them, on the GPU: DoRA (`use_dora`, the scales
//! `m / ‖W + s·B·A‖` computed on the device as the slot is written), a
//! bias on lora_B (`lora_bias`), LoRA on the token embeddings and the
//! lm_head, and an adapter's own rows of those layers (`modules_to_save`,
//! `trainable_token_indices`), in f32, on a dense Llama, a Qwen2 whose
//! q/k/v carry biases of their own (kept out of DoRA's scaling) and whose
//! lm_head is tied to its embeddings, Gemma 3 and 2 (their embedding
//! scale on the LoRA output too), and a Mixture-of-Experts model:
//! every golden case's logits within 1e-5 of the CPU backend and 1e-4 of
//! transformers + PEFT, greedy tokens equal (decode steps of an adapter
//! with embedding or lm_head LoRA or rows never replay a graph, though a
//! plain adapter's of the same key was captured in its slot); every kind
//! and the base in one step, each row its own golden; a vocabulary grown
//! past the base's, its rows' logits as wide as the step; DoRA on a
//! quantized base (llm-compressor's W8A16) from its dequantized rows. PEFT
//! made the fixtures
//! (`scripts/make_dora_fixtures.py`, `scripts/make_bias_fixtures.py`,
//! `scripts/make_embedding_fixtures.py`,
//! `scripts/make_saved_module_fixtures.py`).
//!
//! These need a CUDA device: they are ignored by a plain `cargo test`,
//! and `deploy/gpu-check.sh` runs them with `--include-ignored`.

mod common;

use common::gpu::{assert_close, require_gpu, run_golden};
use common::*;
use lorafleet_engine::backend::cpu::CpuBackend;
use lorafleet_engine::backend::cuda::{CudaBackend, Dtype, StepLimits};
use lorafleet_engine::backend::{Backend, BackendShape, StepBatch};
use lorafleet_engine::lora::{AdapterLimits, HostAdapter};
use lorafleet_engine::model::ModelConfig;

const SHAPE: BackendShape = BackendShape {
    slots: 2,
    max_lora_rank: 16,
    kv_blocks: 8,
    block_size: 4,
    ring_len: 0,
    ring_blocks: 0,
};

const LIMITS: StepLimits = StepLimits {
    max_tokens: 64,
    max_rows: 8,
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
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn every_adapter_kind_on_the_gpu_gives_the_cpu_backends_and_peft_logits() {
    require_gpu();
    let mut checked = 0;
    for (file, model, dir) in [
        ("golden_dora.json", "llama-gqa", "dora/llama-gqa"),
        ("golden_dora.json", "qwen2-tied", "dora/qwen2-tied"),
        ("golden_dora.json", "mixtral-moe", "dora/mixtral-moe"),
        // llm-compressor's W8A16 checkpoint: the scales from its rows
        // dequantized as its GEMMs dequantize them.
        ("golden_dora.json", "llama-gqa-tool-w8a16", "dora/llama-gqa"),
        ("golden_bias.json", "llama-gqa", "bias/llama-gqa"),
        ("golden_bias.json", "qwen2-tied", "bias/qwen2-tied"),
        ("golden_embedding.json", "llama-gqa", "embedding/llama-gqa"),
        (
            "golden_embedding.json",
            "qwen2-tied",
            "embedding/qwen2-tied",
        ),
        ("golden_embedding.json", "gemma3-1b", "embedding/gemma3-1b"),
        ("golden_embedding.json", "gemma2-2b", "embedding/gemma2-2b"),
        ("golden_saved.json", "llama-gqa", "saved/llama-gqa"),
        ("golden_saved.json", "qwen2-tied", "saved/qwen2-tied"),
        ("golden_saved.json", "mixtral-moe", "saved/mixtral-moe"),
    ] {
        let golden = golden_named(file);
        let model_path = model_dir(model);
        let config = ModelConfig::from_dir(&model_path).unwrap();
        let cases: Vec<&GoldenCase> = golden.cases.iter().filter(|c| c.model == model).collect();
        let shape = BackendShape {
            kv_blocks: cases.iter().map(|c| golden_blocks(c)).max().unwrap(),
            ..SHAPE
        };
        let mut cpu = CpuBackend::load(&model_path, &config, shape).unwrap();
        let mut gpu =
            CudaBackend::load(&model_path, &config, shape, 0, Dtype::F32, LIMITS).unwrap();
        let mut adapted = 0;
        // Decode graphs of the base and of a plain q/v adapter in slot 1,
        // captured before any of these: an embedding or lm_head adapter's
        // decode steps (slot 1, q/v LoRA too: the same graph key) must
        // never replay one (a Mixture-of-Experts model's steps are never
        // graphed).
        let plain = golden_named("golden.json");
        let primed: Vec<&GoldenCase> = plain
            .cases
            .iter()
            .filter(|c| c.model == model && [None, Some("qv-r8")].contains(&c.adapter.as_deref()))
            .take(4)
            .collect();
        if config.moe.is_none() {
            for c in &primed {
                run_golden(&mut gpu, model, c);
            }
        }
        let outside_layers = ["golden_embedding.json", "golden_saved.json"].contains(&file);
        for case in &cases {
            let what = format!("{dir}/{:?} {:?}", case.adapter, case.prompt);
            let replays = gpu.graph_counters().unwrap().replays;
            let (cpu_logits, cpu_tokens) = run_golden(&mut cpu, dir, case);
            let (gpu_logits, gpu_tokens) = run_golden(&mut gpu, dir, case);
            // A quantized base's kernels differ from the CPU's in their
            // sums' order (as in cuda_quantized.rs).
            let near_cpu = if model.contains("-tool-") { 1e-4 } else { 1e-5 };
            assert_close(&gpu_logits, &cpu_logits, near_cpu, &what);
            assert_close(&gpu_logits, &case.logits, 1e-4, &format!("{what} vs PEFT"));
            assert_eq!(gpu_tokens, cpu_tokens, "{what}: greedy tokens");
            assert_eq!(gpu_tokens, case.greedy, "{what}: greedy tokens vs PEFT");
            if outside_layers && case.adapter.is_some() {
                assert_eq!(
                    gpu.graph_counters().unwrap().replays,
                    replays,
                    "{what}: a step with embedding or lm_head work replayed a graph"
                );
            }
            adapted += usize::from(case.adapter.is_some());
            checked += 1;
        }
        if !primed.is_empty() && config.moe.is_none() {
            assert!(
                gpu.graph_counters().unwrap().replays > 0,
                "{model}: the plain steps replayed no graph"
            );
        }
        assert!(adapted >= 3, "{file} {model}: {adapted} adapter cases");
    }
    // DoRA: 4 bases and 5 adapters, bias: 2 adapters, embedding and
    // lm_head LoRA: 6 adapters, own rows: 7 adapters, 3 prompts each.
    assert_eq!(checked, 3 * (4 + 5 + 2 + 6 + 7), "{checked} cases");
}

/// A DoRA slot, a `lora_bias` slot and the base model in one step: each
/// row is its own golden, so one slot's flags and vectors touch only its
/// rows; a slot written again with a plain adapter is plain.
#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn a_dora_slot_a_bias_slot_and_the_base_in_one_gpu_step_are_each_their_own() {
    require_gpu();
    let model = "llama-gqa";
    let dir = model_dir(model);
    let config = ModelConfig::from_dir(&dir).unwrap();
    let shape = BackendShape {
        kv_blocks: 24,
        ..SHAPE
    };
    let mut gpu = CudaBackend::load(&dir, &config, shape, 0, Dtype::F32, LIMITS).unwrap();
    gpu.write_slot(0, &load(model, "dora/llama-gqa", "dora-qv-r8"))
        .unwrap();
    gpu.write_slot(1, &load(model, "bias/llama-gqa", "bias-qv-r8"))
        .unwrap();
    let prompt = "The quick brown fox";
    let pick = |g: &Golden, adapter: Option<&str>| golden_case(g, model, adapter, prompt);
    let (dora, bias, plain) = (
        golden_named("golden_dora.json"),
        golden_named("golden_bias.json"),
        golden(),
    );
    let rows = [
        (pick(&plain, None), None),
        (pick(&dora, Some("dora-qv-r8")), Some(0)),
        (pick(&bias, Some("bias-qv-r8")), Some(1)),
    ];
    let tables: Vec<Vec<u32>> = (0..3).map(|s| (s * 8..s * 8 + 8).collect()).collect();
    let step = |gpu: &mut CudaBackend, rows: &[(GoldenCase, Option<usize>)]| {
        let mut batch = StepBatch::default();
        for (i, (case, slot)) in rows.iter().enumerate() {
            batch.push(&case.prompt_ids, 0, &tables[i], *slot, true);
        }
        batch.finish();
        gpu.forward(&batch).unwrap()
    };
    let logits = step(&mut gpu, &rows);
    let v = config.vocab_size;
    for (i, (case, _)) in rows.iter().enumerate() {
        let err = relative_error(&logits[i * v..(i + 1) * v], &case.logits);
        assert!(
            err <= 1e-4,
            "row {i} ({:?}): relative error {err}",
            case.adapter
        );
    }
    // Slot 0 written again with a plain adapter: no DoRA scale is left.
    gpu.write_slot(0, &load(model, model, "qv-r8")).unwrap();
    let again = [(pick(&plain, Some("qv-r8")), Some(0))];
    let err = relative_error(&step(&mut gpu, &again), &again[0].0.logits);
    assert!(err <= 1e-4, "a plain adapter where DoRA was: {err}");
}

/// Every kind the engine serves in one GPU step, each row its own golden
/// (the test the CPU backend runs in `saved_modules.rs`).
#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn every_adapter_kind_and_the_base_in_one_gpu_step_are_each_their_own() {
    require_gpu();
    let dir = model_dir("llama-gqa");
    let config = ModelConfig::from_dir(&dir).unwrap();
    let shape = BackendShape {
        slots: EVERY_KIND_SLOTS,
        kv_blocks: 96,
        ..SHAPE
    };
    let mut gpu = CudaBackend::load(&dir, &config, shape, 0, Dtype::F32, LIMITS).unwrap();
    every_adapter_kind_in_one_step(&mut gpu, 1e-4);
}

/// A vocabulary grown past the base's (its own embed_tokens and lm_head
/// with three more rows) beside the base and an own lm_head of the base's
/// rows in one GPU step: each row PEFT's logits over its own vocabulary
/// and -inf past it, the new tokens embedded from the adapter's own rows;
/// the refusals the CPU backend gives (the test it runs in
/// `saved_modules.rs`).
#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn a_grown_vocabulary_s_rows_have_their_own_logits_on_the_gpu() {
    require_gpu();
    let dir = model_dir("llama-gqa");
    let config = ModelConfig::from_dir(&dir).unwrap();
    let shape = BackendShape {
        kv_blocks: 48,
        ..SHAPE
    };
    let mut gpu = CudaBackend::load(&dir, &config, shape, 0, Dtype::F32, LIMITS).unwrap();
    grown_vocabulary_beside_the_base_in_one_step(&mut gpu, &golden_grown());
}
