//! The CUDA backend as a whole model and under the engine, on a GPU: the
//! f32 model on the golden fixtures for every adapter (greedy tokens equal
//! to the CPU reference's and PEFT's), bf16 and f16 as close to the f32
//! reference as transformers + PEFT in those types, a mixed batch equal to
//! one request at a time, device sampling with each request's own draws,
//! and slot copies that overlap the steps not using them. The kernels one
//! by one are in `cuda_gpu.rs`.
//!
//! These need a CUDA device: they are ignored by a plain `cargo test`,
//! and `deploy/gpu-check.sh` runs them with `--include-ignored`.

mod common;

use common::gpu::{assert_close, load_adapter, require_gpu, run_golden};
use common::*;
use lorafleet_engine::backend::cpu::CpuBackend;
use lorafleet_engine::backend::cuda::{CudaBackend, DeviceSample, Dtype, StepLimits};
use lorafleet_engine::backend::{Backend, BackendShape, StepBatch};
use lorafleet_engine::model::ModelConfig;
use lorafleet_engine::sampling::Rng;
use lorafleet_engine::{BackendChoice, EngineSettings, Event};

/// Runs a golden case on both backends: the GPU's logits within 1e-5 of
/// the CPU's and 1e-4 of PEFT's, its greedy tokens equal to both. Returns
/// the GPU's tokens.
fn assert_gpu_matches_cpu(
    cpu: &mut dyn Backend,
    gpu: &mut dyn Backend,
    model: &str,
    case: &GoldenCase,
    what: &str,
) -> Vec<u32> {
    let (cpu_logits, cpu_tokens) = run_golden(cpu, model, case);
    let (gpu_logits, gpu_tokens) = run_golden(gpu, model, case);
    assert_close(&gpu_logits, &cpu_logits, 1e-5, what);
    assert_close(&gpu_logits, &case.logits, 1e-4, &format!("{what} vs PEFT"));
    assert_eq!(gpu_tokens, cpu_tokens, "{what}: greedy tokens");
    assert_eq!(gpu_tokens, case.greedy, "{what}: greedy tokens vs PEFT");
    gpu_tokens
}

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

#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn the_model_in_f32_gives_the_cpu_backends_greedy_tokens_for_every_adapter() {
    require_gpu();
    let golden = golden();
    let mut checked = 0;
    for model in ["llama-gqa", "qwen2-tied"] {
        let dir = model_dir(model);
        let config = ModelConfig::from_dir(&dir).unwrap();
        let mut cpu = CpuBackend::load(&dir, &config, SHAPE).unwrap();
        let mut gpu = CudaBackend::load(&dir, &config, SHAPE, 0, Dtype::F32, LIMITS).unwrap();
        for case in golden.cases.iter().filter(|c| c.model == model) {
            let what = format!("{model}/{:?} {:?}", case.adapter, case.prompt);
            let gpu_tokens = assert_gpu_matches_cpu(&mut cpu, &mut gpu, model, case, &what);
            // The device's argmax of the last step is the host's.
            let last = gpu.sample_last(&[DeviceSample {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                u: 0.0,
            }]);
            assert_eq!(last.unwrap(), vec![*gpu_tokens.last().unwrap()]);
            checked += 1;
        }
    }
    assert_eq!(checked, golden.cases.len());
}

/// transformers + PEFT's own error in bf16 and f16 against the f32 golden
/// logits, per case, measured on a GPU by `scripts/reduced_precision.py`.
#[derive(serde::Deserialize)]
struct ReducedPrecision {
    device: String,
    cases: Vec<ReducedCase>,
}

#[derive(serde::Deserialize)]
struct ReducedCase {
    model: String,
    adapter: Option<String>,
    prompt: String,
    /// PEFT's default: the LoRA weights upcast to f32 (the engine's f32
    /// slots).
    bf16: f32,
    f16: f32,
    /// The LoRA weights in the model's type (the engine's 16-bit slots).
    bf16_adapter_in_type: f32,
    f16_adapter_in_type: f32,
}

/// The stated tolerance in a 16-bit type: the engine is no further from
/// the f32 reference than the reference implementation itself in that
/// type, computing the adapter as the engine does. With f32 slots (the
/// default) that is PEFT's default, the LoRA weights upcast to f32; with
/// slots in the model's type, PEFT with the LoRA weights in that type.
/// Per case, within 2e-2 or 1.5× transformers + PEFT's error, whichever is
/// larger (random fixture weights make some cases sensitive to any
/// rounding; with 16-bit slots, against the larger of PEFT's two errors,
/// as single cases swing either way); over all cases, a mean error no
/// larger than theirs.
#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn the_model_in_bf16_and_f16_is_as_close_to_the_reference_as_transformers_in_that_type() {
    require_gpu();
    let golden = golden();
    let text = std::fs::read_to_string(fixtures().join("reduced_precision.json")).unwrap();
    let reference: ReducedPrecision = serde_json::from_str(&text).unwrap();
    assert_eq!(reference.cases.len(), golden.cases.len());
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for slot_dtype in [Dtype::F32, dtype] {
            let (mut ours, mut theirs) = (Vec::new(), Vec::new());
            for model in ["llama-gqa", "qwen2-tied"] {
                let dir = model_dir(model);
                let config = ModelConfig::from_dir(&dir).unwrap();
                let mut gpu = CudaBackend::load_with_slot_dtype(
                    &dir, &config, SHAPE, 0, dtype, slot_dtype, LIMITS,
                )
                .unwrap();
                for case in golden.cases.iter().filter(|c| c.model == model) {
                    let what = format!(
                        "{dtype:?}, {slot_dtype:?} slots, {model}/{:?} {:?}",
                        case.adapter, case.prompt
                    );
                    let r = reference
                        .cases
                        .iter()
                        .find(|r| {
                            r.model == case.model
                                && r.adapter == case.adapter
                                && r.prompt == case.prompt
                        })
                        .unwrap_or_else(|| panic!("{what}: no reference figure"));
                    let (in_type, upcast) = if dtype == Dtype::Bf16 {
                        (r.bf16_adapter_in_type, r.bf16)
                    } else {
                        (r.f16_adapter_in_type, r.f16)
                    };
                    let (their, yardstick) = if slot_dtype == Dtype::F32 {
                        (upcast, upcast)
                    } else {
                        (in_type, in_type.max(upcast))
                    };
                    let (logits, _) = run_golden(&mut gpu, model, case);
                    let err = relative_error(&logits, &case.logits);
                    eprintln!(
                        "{what}: {err:.4} (transformers + PEFT: {their:.4}; adapter upcast {upcast:.4}, in the type {in_type:.4})"
                    );
                    assert_close(&logits, &case.logits, (1.5 * yardstick).max(2e-2), &what);
                    ours.push(err);
                    theirs.push(their);
                }
            }
            let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
            let (ours, theirs) = (mean(&ours), mean(&theirs));
            eprintln!(
                "{dtype:?}, {slot_dtype:?} slots: mean relative error {ours:.4}; transformers + PEFT on {}: {theirs:.4}",
                reference.device
            );
            assert!(
                ours <= theirs,
                "{dtype:?}, {slot_dtype:?} slots: mean relative error {ours} above transformers + PEFT's {theirs}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn a_mixed_batch_on_the_gpu_equals_one_request_at_a_time() {
    require_gpu();
    let model = "llama-gqa";
    let choice = BackendChoice::Cuda {
        device: 0,
        dtype: Dtype::F32,
        lora_dtype: Dtype::F32,
        graphs: true,
        pdl: false,
    };
    let requests = mixed_workload();
    let mut single = fixture_engine_on(
        model,
        EngineSettings {
            max_loras: 1,
            max_cpu_loras: 1,
            ..Default::default()
        },
        choice,
    );
    let alone: Vec<Vec<u32>> = requests
        .iter()
        .map(|r| {
            let c = single
                .run_to_completion(vec![r.clone()])
                .unwrap()
                .pop()
                .unwrap();
            assert!(c.error.is_none(), "{:?}", c.error);
            c.token_ids
        })
        .collect();
    let mut e = fixture_engine_on(
        model,
        EngineSettings {
            max_loras: 4,
            max_cpu_loras: 6,
            max_batched_tokens: 24,
            max_num_seqs: 12,
            ..Default::default()
        },
        choice,
    );
    let mut outputs: Vec<Vec<u32>> = vec![Vec::new(); requests.len()];
    let (mut finished, mut step, mut max_distinct) = (0, 0, 0);
    let mut pending = requests.iter();
    while finished < requests.len() {
        if step % 2 == 0 {
            for r in pending.by_ref().take(3) {
                e.submit(r.clone()).unwrap();
            }
        }
        for (id, event) in e.step().unwrap() {
            let i: usize = id[1..].parse().unwrap();
            match event {
                Event::Delta { token_ids, .. } => outputs[i].extend(token_ids),
                Event::Finished(_) => finished += 1,
                Event::Failed(err) => panic!("{id}: {err}"),
                Event::PromptLogprobs(_) => {}
            }
        }
        max_distinct = max_distinct.max(e.last_step().distinct_adapters);
        step += 1;
        assert!(step < 10_000, "the batch never drained");
    }
    assert!(max_distinct >= 2, "steps mixed adapters");
    for (i, (got, want)) in outputs.iter().zip(&alone).enumerate() {
        assert_eq!(
            got, want,
            "request r{i}: batched differs from alone on the GPU"
        );
    }
}

/// Decode steps replay CUDA graphs: the mixed workload (10 adapters and the
/// base model, greedy and sampled) submitted at once runs decode steps of
/// every adapter together through graphs, with the tokens of the same run
/// launched kernel by kernel and of each request alone. With
/// programmatic dependent launch (each kernel scheduled while the one
/// before drains, then waiting for its writes) the tokens are the same,
/// eager and through graphs.
#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn decode_steps_replay_cuda_graphs_with_the_tokens_of_eager_launches() {
    require_gpu();
    let model = "llama-gqa";
    let requests = mixed_workload();
    let settings = EngineSettings {
        max_loras: 10,
        max_cpu_loras: 10,
        max_num_seqs: 32,
        max_batched_tokens: 1024,
        ..Default::default()
    };
    let choice = |graphs, pdl| BackendChoice::Cuda {
        device: 0,
        dtype: Dtype::F32,
        lora_dtype: Dtype::F32,
        graphs,
        pdl,
    };
    // (tokens per request, graph replays, whether a replayed step mixed
    // every adapter and the base)
    let run = |graphs: bool, pdl: bool| {
        let mut e = fixture_engine_on(model, settings, choice(graphs, pdl));
        // Every adapter in the host tier first, so all requests start
        // together.
        for id in 1..=10 {
            e.prefetch(aid(id));
        }
        while e.pool().loads_in_flight() > 0 {
            e.pool().poll_loads(Some(std::time::Duration::from_secs(5)));
        }
        for r in &requests {
            e.submit(r.clone()).unwrap();
        }
        let mut outputs: Vec<Vec<u32>> = vec![Vec::new(); requests.len()];
        let mut mixed_replay = false;
        while e.has_work() {
            let before = e.stats().graphs.unwrap().replays;
            for (id, event) in e.step().unwrap() {
                let i: usize = id[1..].parse().unwrap();
                match event {
                    Event::Delta { token_ids, .. } => outputs[i].extend(token_ids),
                    Event::Finished(_) => {}
                    Event::Failed(err) => panic!("{id}: {err}"),
                    Event::PromptLogprobs(_) => {}
                }
            }
            let replayed = e.stats().graphs.unwrap().replays > before;
            // 10 adapters, plus base-model sequences (not counted as
            // adapters) in the same step.
            if replayed && e.last_step().distinct_adapters == 10 && e.last_step().sequences > 20 {
                mixed_replay = true;
            }
        }
        let counters = e.stats().graphs.unwrap();
        assert_eq!(counters.failed_captures, 0, "{counters:?}");
        (outputs, counters, mixed_replay)
    };
    let (eager, eager_counters, _) = run(false, false);
    assert_eq!(eager_counters.replays, 0, "graphs off: {eager_counters:?}");
    // PDL is on where the device has it (compute 9.0 and newer), so the
    // runs below do launch programmatically there.
    let dir = model_dir(model);
    let config = ModelConfig::from_dir(&dir).unwrap();
    let mut gpu = CudaBackend::load(&dir, &config, SHAPE, 0, Dtype::F32, LIMITS).unwrap();
    let hopper = !gpu.device_name().contains("(compute 8.");
    assert_eq!(gpu.set_pdl(true), hopper, "{}", gpu.device_name());
    drop(gpu);
    for (graphs, name) in [(false, "eager"), (true, "graph replay")] {
        let (programmatic, counters, _) = run(graphs, true);
        assert_eq!(counters.replays > 0, graphs, "{name}, PDL: {counters:?}");
        for (i, (p, want)) in programmatic.iter().zip(&eager).enumerate() {
            assert_eq!(
                p, want,
                "request r{i}: {name} with programmatic dependent launch differs from eager launches"
            );
        }
    }
    let (graphed, counters, mixed_replay) = run(true, false);
    assert!(counters.replays > 0 && counters.graphs > 0, "{counters:?}");
    assert!(
        mixed_replay,
        "a step of 10 adapters and the base ran from a graph: {counters:?}"
    );
    for (i, (g, want)) in graphed.iter().zip(&eager).enumerate() {
        assert!(!want.is_empty(), "request r{i} produced tokens");
        assert_eq!(
            g, want,
            "request r{i}: graph replay differs from eager launches"
        );
    }
    // Each request alone (batch 1, also through graphs) gives the same.
    let mut single = fixture_engine_on(
        model,
        EngineSettings {
            max_loras: 1,
            max_cpu_loras: 1,
            ..Default::default()
        },
        choice(true, false),
    );
    for (i, r) in requests.iter().enumerate() {
        let c = single
            .run_to_completion(vec![r.clone()])
            .unwrap()
            .pop()
            .unwrap();
        assert!(c.error.is_none(), "{:?}", c.error);
        assert_eq!(
            c.token_ids, graphed[i],
            "request r{i}: batched through graphs differs from alone"
        );
    }
    assert!(single.stats().graphs.unwrap().replays > 0);
}

/// On the CUDA backend the engine draws tokens on the device, with each
/// request's own uniform draws: its tokens are those of the sampling
/// kernel fed `Rng::new(seed)` one draw per token, step by step.
#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn the_engine_samples_on_the_device_with_each_requests_own_draws() {
    require_gpu();
    let model = "llama-gqa";
    let prompt = golden().cases[0].prompt_ids.clone();
    let (temperature, top_k, top_p, seed, max_tokens) = (0.9f32, 50, 0.95f32, 7u64, 10);
    let mut engine = fixture_engine_on(
        model,
        EngineSettings::default(),
        BackendChoice::Cuda {
            device: 0,
            dtype: Dtype::F32,
            lora_dtype: Dtype::F32,
            graphs: true,
            pdl: false,
        },
    );
    let done = engine
        .run_to_completion(vec![lorafleet_engine::Request {
            id: "s".into(),
            adapter: None,
            prompt: lorafleet_engine::Prompt::TokenIds(prompt.clone()),
            params: lorafleet_engine::Sampling {
                max_tokens,
                temperature,
                top_p,
                top_k,
                seed: Some(seed),
                ignore_eos: true,
                ..Default::default()
            }
            .validate()
            .unwrap(),
        }])
        .unwrap()
        .pop()
        .unwrap();
    assert!(done.error.is_none(), "{:?}", done.error);

    let dir = model_dir(model);
    let config = ModelConfig::from_dir(&dir).unwrap();
    let mut gpu = CudaBackend::load(&dir, &config, SHAPE, 0, Dtype::F32, LIMITS).unwrap();
    let table: Vec<u32> = vec![5, 2, 7, 0, 3, 6, 1, 4];
    let mut rng = Rng::new(seed);
    let (mut want, mut input, mut pos) = (Vec::new(), prompt, 0);
    while want.len() < max_tokens {
        let mut batch = StepBatch::default();
        batch.push(&input, pos, &table, None, true);
        batch.finish();
        let row = DeviceSample {
            temperature,
            top_k,
            top_p,
            u: rng.next_f64() as f32,
        };
        let token = gpu.forward_sampled(&batch, &[row]).unwrap()[0];
        pos += input.len();
        input = vec![token];
        want.push(token);
    }
    assert_eq!(done.token_ids, want);
}

/// A slot write returns before its copy is done, and the copy runs on a
/// stream of its own: while it is held in flight, a step that does not use
/// the slot runs to the end; a step that uses the slot waits for the copy
/// and sees the adapter exactly.
#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn a_slot_copy_overlaps_the_steps_that_do_not_use_the_slot() {
    require_gpu();
    let model = "llama-gqa";
    let dir = model_dir(model);
    let config = ModelConfig::from_dir(&dir).unwrap();
    let mut gpu = CudaBackend::load(&dir, &config, SHAPE, 0, Dtype::F32, LIMITS).unwrap();
    let golden = golden();
    let case = |adapter: Option<&str>| {
        golden
            .cases
            .iter()
            .find(|c| c.model == model && c.adapter.as_deref() == adapter)
            .unwrap()
    };
    let adapter = load_adapter(&config, model, "qv-r8");
    // Both staging buffers allocated first, so the timed write allocates
    // nothing.
    gpu.write_slot(1, &adapter).unwrap();
    gpu.write_slot(1, &adapter).unwrap();
    gpu.clear_slot(1).unwrap();
    let table: Vec<u32> = vec![5, 2, 7, 0, 3, 6, 1, 4];
    let step = |gpu: &mut CudaBackend, case: &GoldenCase, slot: Option<usize>| {
        let mut batch = StepBatch::default();
        batch.push(&case.prompt_ids, 0, &table, slot, true);
        batch.finish();
        gpu.forward(&batch).unwrap()
    };
    // About a second of GPU clock, against a step of this model's
    // hundreds of microseconds.
    gpu.stall_slot_copies(2_000_000_000).unwrap();
    gpu.write_slot(1, &adapter).unwrap();
    assert!(
        gpu.slot_copy_in_flight(1),
        "the write returned before its copy"
    );
    let base = step(&mut gpu, case(None), None);
    assert!(
        gpu.slot_copy_in_flight(1),
        "a base-model step did not wait for the copy into slot 1"
    );
    assert_close(&base, &case(None).logits, 1e-4, "the base step");
    let tuned = step(&mut gpu, case(Some("qv-r8")), Some(1));
    assert!(!gpu.slot_copy_in_flight(1));
    assert_close(
        &tuned,
        &case(Some("qv-r8")).logits,
        1e-4,
        "the step on slot 1, after its copy",
    );
}

/// Mixture-of-Experts models on the GPU in f32 — Qwen3-MoE (per-head q/k
/// norms, top-k without renormalizing) and Mixtral (renormalized) — for
/// every case of their golden set: the base model, attention LoRA, expert
/// LoRA on gate/up and down, and the router's LoRA. Logits within 1e-5 of
/// the CPU backend and 1e-4 of PEFT, the same greedy tokens; a case goes
/// through the expert-LoRA kernels exactly when it does on the CPU (never
/// for the base model or an adapter without expert weights, even with an
/// expert adapter written in the slot beside it).
#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn moe_models_in_f32_give_the_cpu_backends_tokens_for_every_adapter() {
    require_gpu();
    let golden = golden_moe();
    let (mut checked, mut expert_cases) = (0, 0);
    for model in ["qwen3-moe", "mixtral-moe"] {
        let dir = model_dir(model);
        let config = ModelConfig::from_dir(&dir).unwrap();
        assert!(
            config.moe.is_some(),
            "{model} is a Mixture-of-Experts model"
        );
        let mut cpu = CpuBackend::load(&dir, &config, SHAPE).unwrap();
        let mut gpu = CudaBackend::load(&dir, &config, SHAPE, 0, Dtype::F32, LIMITS).unwrap();
        for case in golden.cases.iter().filter(|c| c.model == model) {
            let what = format!("{model}/{:?} {:?}", case.adapter, case.prompt);
            let (cpu_before, gpu_before) = (cpu.expert_lora_rows(), gpu.expert_lora_rows());
            assert_gpu_matches_cpu(&mut cpu, &mut gpu, model, case, &what);
            let cpu_rows = cpu.expert_lora_rows() - cpu_before;
            let gpu_rows = gpu.expert_lora_rows() - gpu_before;
            // The CPU runs its last layer over the logit rows alone, so
            // the counts match in being zero, not in size.
            assert_eq!(
                gpu_rows == 0,
                cpu_rows == 0,
                "{what}: expert-LoRA rows {gpu_rows} on the GPU, {cpu_rows} on the CPU"
            );
            if case.adapter.is_none() {
                assert_eq!(
                    gpu_rows, 0,
                    "{what}: the base model took the expert-LoRA path"
                );
            }
            expert_cases += usize::from(gpu_rows > 0);
            checked += 1;
        }
    }
    assert_eq!(checked, golden.cases.len());
    assert!(
        expert_cases >= 9,
        "expert adapters were checked: {expert_cases}"
    );
}

/// A staggered mixed batch of the Mixture-of-Experts models' adapters on the
/// GPU (steps of several adapters, prefill beside decode) gives every
/// request the tokens it gets alone.
#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn a_staggered_mixed_batch_of_moe_adapters_on_the_gpu_equals_one_at_a_time() {
    require_gpu();
    for model in ["qwen3-moe", "mixtral-moe"] {
        assert_staggered_batch_equals_alone(
            model,
            BackendChoice::Cuda {
                device: 0,
                dtype: Dtype::F32,
                lora_dtype: Dtype::F32,
                graphs: true,
                pdl: false,
            },
        );
    }
}

/// The Mixture-of-Experts models in bf16 on the GPU: logits within 0.1
/// relative of the f32 reference (a wrong cast or layout is off by about 1)
/// and its greedy tokens in at least half the cases (random fixture weights
/// make some cases flip on any rounding, and a flipped router choice moves
/// a token's whole expert mix).
#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn moe_models_in_bf16_stay_near_the_f32_reference() {
    require_gpu();
    let golden = golden_moe();
    let (mut same, mut cases, mut worst) = (0, 0, 0f32);
    for model in ["qwen3-moe", "mixtral-moe"] {
        let dir = model_dir(model);
        let config = ModelConfig::from_dir(&dir).unwrap();
        let mut gpu = CudaBackend::load(&dir, &config, SHAPE, 0, Dtype::Bf16, LIMITS).unwrap();
        for case in golden.cases.iter().filter(|c| c.model == model) {
            let (logits, tokens) = run_golden(&mut gpu, model, case);
            let err = relative_error(&logits, &case.logits);
            worst = worst.max(err);
            assert!(
                err <= 0.1,
                "{model}/{:?}: bf16 relative error {err}",
                case.adapter
            );
            same += usize::from(tokens == case.greedy);
            cases += 1;
        }
    }
    eprintln!("bf16 MoE: worst relative error {worst}, greedy tokens equal in {same} of {cases}");
    assert!(
        same * 2 >= cases,
        "greedy tokens equal in only {same} of {cases}"
    );
}

/// Every model family of `golden_families.json` in f32 on the GPU, each
/// model's adapters in one mixed batch with prefill chunks of 8 tokens:
/// RoPE `llama3`, YaRN, LongRoPE (Phi-3.5, a sequence switching to its long
/// factors and recomputed) and dynamic NTK (each token's own frequencies),
/// Qwen3's explicit head_dim and q/k norms, Phi's fused projections and an
/// adapter on them, Gemma 2 and 3 (√hidden embeddings, (1 + w) norms
/// around the attention and the MLP, GeGLU, sliding layers reading their
/// rings with their own RoPE, attention and final-logit soft-capping):
/// every prompt position's and greedy token's log probability within 1e-3
/// of transformers + PEFT, greedy tokens equal.
#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn model_families_on_the_gpu_give_transformers_and_peft_logprobs() {
    require_gpu();
    let g = logprob_golden("golden_families.json");
    let cuda = BackendChoice::Cuda {
        device: 0,
        dtype: Dtype::F32,
        lora_dtype: Dtype::F32,
        graphs: true,
        pdl: false,
    };
    let mut models: Vec<&str> = g.cases.iter().map(|c| c.model.as_str()).collect();
    models.sort_unstable();
    models.dedup();
    assert!(models.len() >= 10, "{models:?}");
    for model in models {
        assert!(
            check_logprob_goldens_on(&g, model, cuda, 1e-3) > 0,
            "{model}"
        );
    }
}

/// GPT-OSS from its bf16 checkpoint and from its MXFP4 one (experts held
/// at 4 bits with their E8M0 scale bytes, dequantized inside the expert
/// projections), in f32 on the GPU: attention sinks, biases on q/k/v/o,
/// sliding and full layers, YaRN, the biased router weighing its chosen
/// logits by their own softmax, de-interleaved biased experts and the
/// clamped SwiGLU, for the base and its three adapters (attention; q and
/// every expert through `target_parameters`; down-only rsLoRA). Every
/// golden case one at a time: logits within 1e-5 of the CPU backend and
/// 1e-4 of transformers + PEFT (whose MXFP4 reference is transformers' own
/// dequantization), greedy tokens equal, the expert-LoRA path taken
/// exactly when the CPU takes it. Then every case of each base in one
/// engine batch on the GPU (rings for the sliding layers, chunked prefill,
/// prefill steps past the fused kernel's 16 tokens): the goldens' tokens.
#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn gpt_oss_on_the_gpu_gives_the_cpu_backends_and_transformers_logits() {
    require_gpu();
    let golden = golden_named("golden_gpt_oss.json");
    let mut checked = 0;
    for model in ["gpt-oss", "gpt-oss-mxfp4"] {
        let dir = model_dir(model);
        let config = ModelConfig::from_dir(&dir).unwrap();
        let cases: Vec<&GoldenCase> = golden.cases.iter().filter(|c| c.model == model).collect();
        let shape = BackendShape {
            kv_blocks: cases.iter().map(|c| golden_blocks(c)).max().unwrap(),
            ..SHAPE
        };
        let mut cpu = CpuBackend::load(&dir, &config, shape).unwrap();
        let mut gpu = CudaBackend::load(&dir, &config, shape, 0, Dtype::F32, LIMITS).unwrap();
        let mut expert_cases = 0;
        for case in &cases {
            let what = format!("{model}/{:?} {:?}", case.adapter, case.prompt);
            let (cpu_before, gpu_before) = (cpu.expert_lora_rows(), gpu.expert_lora_rows());
            // The adapters are fixtures of the bf16 base; they serve both.
            assert_gpu_matches_cpu(&mut cpu, &mut gpu, "gpt-oss", case, &what);
            let gpu_rows = gpu.expert_lora_rows() - gpu_before;
            assert_eq!(
                gpu_rows == 0,
                cpu.expert_lora_rows() - cpu_before == 0,
                "{what}: expert-LoRA rows {gpu_rows} on the GPU"
            );
            expert_cases += usize::from(gpu_rows > 0);
            checked += 1;
        }
        assert!(cases.len() >= 16, "{model}: {}", cases.len());
        assert!(
            expert_cases >= 4,
            "{model}: the experts adapter was checked: {expert_cases}"
        );

        gpt_oss_engine_matches_the_goldens(
            model,
            BackendChoice::Cuda {
                device: 0,
                dtype: Dtype::F32,
                lora_dtype: Dtype::F32,
                graphs: true,
                pdl: false,
            },
        );
    }
    assert_eq!(checked, golden.cases.len());
}
