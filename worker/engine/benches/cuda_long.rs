//! Long prompts on the GPU, in the workload shape of the multi-LoRA
//! serving post among the project's seed documents: 1,600 prompt tokens
//! and 600 new ones per request, 16 requests at a time (a closed loop:
//! each finished request is replaced at once), on the STAND-IN model of
//! Llama-3.2-1B's shape (random bf16 weights; for benchmarks only) with 8
//! rank-32 adapters on q, k, v and o, against the base model alone on the
//! same GPU:
//!
//! - output tokens/s over the run and time to first token (p50, p90);
//! - where a prefill step's device time goes (one 1,600-token prompt:
//!   base GEMMs, LoRA, attention, the rest), each part replayed from a
//!   graph of its own.
//!
//! Targets (issue: one adapter nearly free, long prompts fast): output
//! tokens/s with LoRA ≥ 90% of base-only; TTFT ≤ 1.15× base-only.
//!
//! Run on a machine with an NVIDIA GPU:
//!   cargo bench -p lorafleet-engine --bench cuda_long
//! (`deploy/gpu-check.sh` builds it here and runs it there). Knobs:
//! `LORAFLEET_LONG_REQUESTS` (requests per run, default 48);
//! `LORAFLEET_LONG_MODEL=gpt-oss` (or `gpt-oss-mxfp4`): the same workload
//! on the GPT-OSS-20B-architecture stand-in (`standin::gpt_oss_model`),
//! its 8 adapters of rank 16 on q/k/v/o and every expert (no prefill
//! profile: a Mixture-of-Experts step reads the router's choices back
//! mid-step, so its parts cannot be replayed from graphs).

mod standin;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use lorafleet_engine::backend::cuda::{CudaBackend, Dtype, StepLimits};
use lorafleet_engine::backend::{Backend, BackendShape, StepBatch};
use lorafleet_engine::lora::{AdapterLimits, HostAdapter};
use lorafleet_engine::model::ModelConfig;
use lorafleet_engine::{BackendChoice, Engine, EngineSettings, Event};
use standin::LLAMA_1B as SHAPE;

const PROMPT: usize = 1600;
const NEW: usize = 600;
const AT_ONCE: usize = 16;
const ADAPTERS: usize = 8;
const RANK: usize = 32;

fn main() {
    if let Err(e) = lorafleet_engine::backend::cuda::probe() {
        eprintln!("cuda_long needs a GPU: {e}");
        std::process::exit(2);
    }
    let requests: usize = std::env::var("LORAFLEET_LONG_REQUESTS")
        .map(|v| v.parse().expect("LORAFLEET_LONG_REQUESTS: a request count"))
        .unwrap_or(48);
    let which = std::env::var("LORAFLEET_LONG_MODEL").unwrap_or_default();
    let (model, dirs, rank, what) = match which.as_str() {
        "" | "llama" => (
            standin::model_shaped(&SHAPE, safetensors::Dtype::BF16),
            standin::adapters_ranked(&SHAPE, ADAPTERS, RANK),
            RANK,
            format!(
                "STAND-IN Llama-3.2-1B shape (h={}, L={}, bf16), {ADAPTERS} adapters of rank {RANK} on q/k/v/o",
                SHAPE.hidden, SHAPE.layers
            ),
        ),
        "gpt-oss" | "gpt-oss-mxfp4" => (
            standin::gpt_oss_model(which == "gpt-oss-mxfp4"),
            standin::gpt_oss_adapters(ADAPTERS),
            standin::RANK,
            format!(
                "STAND-IN GPT-OSS-20B architecture (h={}, L={}, {} experts top {}, {} experts), {ADAPTERS} adapters of rank {} on q/k/v/o and every expert",
                standin::HIDDEN,
                standin::LAYERS,
                standin::GPT_OSS_EXPERTS,
                standin::GPT_OSS_TOP_K,
                if which == "gpt-oss" { "bf16" } else { "MXFP4" },
                standin::RANK
            ),
        ),
        other => panic!("LORAFLEET_LONG_MODEL={other:?}: not llama, gpt-oss or gpt-oss-mxfp4"),
    };
    let settings = EngineSettings {
        max_loras: ADAPTERS,
        max_lora_rank: rank,
        max_cpu_loras: ADAPTERS,
        max_cpu_lora_bytes: None,
        // Every running sequence's whole context, twice over.
        kv_blocks: 2 * AT_ONCE * (PROMPT + NEW).div_ceil(16),
        block_size: 16,
        max_num_seqs: AT_ONCE,
        max_batched_tokens: 2048,
        max_waiting: 4096,
        max_pinned: None,
        prefix_caching: true,
        fair_admission: true,
        eviction: Default::default(),
        memory_budget_bytes: None,
    };
    println!(
        "long prompts, {what}, {requests} requests of {PROMPT} prompt and {NEW} new tokens, {AT_ONCE} at a time (f32 slots)",
    );
    println!();
    println!(
        "| run | output tokens/s | vs base | TTFT p50 ms | TTFT p90 ms | TTFT p50 vs base | steps | wall s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let choice = BackendChoice::Cuda {
        device: 0,
        dtype: Dtype::Bf16,
        lora_dtype: Dtype::F32,
        graphs: true,
        // LORAFLEET_BENCH_PDL=1: kernels with programmatic dependent launch.
        pdl: std::env::var("LORAFLEET_BENCH_PDL").is_ok_and(|v| v == "1"),
    };
    let mut engine = Engine::load(&model, settings, choice).unwrap();
    standin::register(&mut engine, &dirs);
    // Untimed: module load, cuBLAS heuristics, graph captures.
    run(&mut engine, AT_ONCE, true);
    let mut base = None;
    for (name, lora) in [
        ("base only", false),
        ("8 adapters", true),
        ("base only, again", false),
    ] {
        let r = run(&mut engine, requests, lora);
        let (otps, ttft) = *base.get_or_insert((r.otps, r.ttft_p50));
        println!(
            "| {name} | {:.0} | {:.1}% | {:.1} | {:.1} | {:.2}x | {} | {:.2} |",
            r.otps,
            r.otps / otps * 100.0,
            r.ttft_p50,
            r.ttft_p90,
            r.ttft_p50 / ttft,
            r.steps,
            r.wall
        );
    }
    drop(engine);
    if which.is_empty() || which == "llama" {
        prefill_profile(&model, &dirs[0]);
    }
}

struct Outcome {
    otps: f64,
    ttft_p50: f64,
    ttft_p90: f64,
    steps: usize,
    wall: f64,
}

/// `n` requests, `AT_ONCE` at a time, request r on adapter r % 8 (with
/// `lora`) or the base model.
fn run(e: &mut Engine, n: usize, lora: bool) -> Outcome {
    if lora {
        for i in 0..ADAPTERS {
            e.prefetch(standin::id(i));
        }
        while e
            .stats()
            .adapters
            .iter()
            .any(|a| a.residency == lorafleet_engine::Residency::Loading)
        {
            e.pool().poll_loads(Some(Duration::from_millis(50)));
        }
    }
    let request = |r: usize| {
        let adapter = lora.then(|| standin::id(r % ADAPTERS));
        standin::decode_request(r, adapter, PROMPT, NEW)
    };
    let started = Instant::now();
    let mut submitted: HashMap<String, Instant> = HashMap::new();
    let mut ttft = Vec::new();
    let mut next = 0;
    while next < n.min(AT_ONCE) {
        let req = request(next);
        submitted.insert(req.id.to_string(), Instant::now());
        e.submit(req).unwrap();
        next += 1;
    }
    let (mut generated, mut steps) = (0usize, 0usize);
    while e.has_work() {
        let events = e.step().unwrap();
        steps += 1;
        for (id, ev) in events {
            match ev {
                Event::Delta { token_ids, .. } => {
                    if let Some(at) = submitted.remove(id.as_str()) {
                        ttft.push(at.elapsed().as_secs_f64() * 1e3);
                    }
                    generated += token_ids.len();
                }
                Event::Finished(_) if next < n => {
                    let req = request(next);
                    submitted.insert(req.id.to_string(), Instant::now());
                    e.submit(req).unwrap();
                    next += 1;
                }
                Event::Failed(err) => panic!("request {id} failed: {err}"),
                _ => {}
            }
        }
    }
    let wall = started.elapsed().as_secs_f64();
    assert_eq!(generated, n * NEW, "every request generated its tokens");
    ttft.sort_by(f64::total_cmp);
    let q = |p: f64| ttft[((ttft.len() - 1) as f64 * p).round() as usize];
    Outcome {
        otps: generated as f64 / wall,
        ttft_p50: q(0.5),
        ttft_p90: q(0.9),
        steps,
        wall,
    }
}

/// One 1,600-token prompt's prefill step on a `CudaBackend`, with and
/// without its adapter: where the device time goes.
fn prefill_profile(model: &std::path::Path, adapter: &std::path::Path) {
    let config = ModelConfig::from_dir(model).unwrap();
    let shape = BackendShape {
        slots: 2,
        max_lora_rank: RANK,
        kv_blocks: PROMPT.div_ceil(16) + 8,
        block_size: 16,
        ring_len: 0,
        ring_blocks: 0,
    };
    let limits = StepLimits {
        max_tokens: 2048,
        max_rows: 16,
    };
    let host = HostAdapter::load(
        "a0",
        adapter,
        AdapterLimits {
            model: &config,
            max_lora_rank: RANK,
            base_hash_check: None,
        },
    )
    .unwrap();
    let mut gpu = CudaBackend::load(model, &config, shape, 0, Dtype::Bf16, limits).unwrap();
    gpu.write_slot(0, &host).unwrap();
    while gpu.slot_copy_in_flight(0) {
        std::hint::spin_loop();
    }
    let prompt: Vec<u32> = (0..PROMPT).map(|k| (k * 7 % 380 + 3) as u32).collect();
    let table: Vec<u32> = (0..PROMPT.div_ceil(16) as u32).collect();
    println!();
    println!(
        "| prefill step, {PROMPT} tokens | whole step ms | base GEMMs ms | LoRA launches ms | attention ms | the rest ms | attention share |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (name, slot) in [("with an adapter (rank 32)", Some(0)), ("base only", None)] {
        let mut batch = StepBatch::default();
        batch.push(&prompt, 0, &table, slot, true);
        batch.finish();
        gpu.forward(&batch).unwrap();
        let parts: HashMap<&str, f64> = gpu.profile_last_step(10).unwrap().into_iter().collect();
        let whole = parts["whole step"];
        println!(
            "| {name} | {whole:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1}% |",
            parts["base GEMMs"],
            parts["LoRA launches"],
            parts["attention"],
            parts["the rest"],
            parts["attention"] / whole * 100.0
        );
    }
}
