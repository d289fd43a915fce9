//! Decode throughput on a Mixture-of-Experts STAND-IN (a Qwen3-MoE shape of
//! ~100M active parameters, 8 experts, top 2, bf16; see
//! `standin::moe_model`): every request on the base model, then spread over
//! 1, 8 and 64 distinct rank-16 adapters with LoRA on q, k, v, o and on
//! every expert. Prints a table. Run with:
//!
//!     cargo bench -p lorafleet-engine --bench moe_decode
//!
//! `LORAFLEET_BENCH_MODEL=gpt-oss` (or `gpt-oss-mxfp4`) runs it on the
//! GPT-OSS stand-in instead (`standin::gpt_oss_model`: GPT-OSS-20B's
//! architecture, 32 experts, top 4, its experts bf16 or MXFP4 as
//! released), with its adapters as PEFT writes them for GPT-OSS.
//!
//! The same `REQUESTS` requests in every row (8 prompt tokens, 8 generated,
//! greedy), request r on adapter r mod N, as one continuous batch of up to
//! 32 sequences with 32 slots; adapters are in the host tier before timing.
//! The rows take turns for `LORAFLEET_BENCH_ROUNDS` rounds (default 3);
//! the table gives medians. `peft_moe_baseline.py` runs the same workload
//! through transformers + PEFT.
//!
//! `LORAFLEET_BENCH_BACKEND=cuda` runs it on CUDA device 0 with bf16
//! weights and f32 slots (`deploy/gpu-check.sh` does, beside
//! `peft_moe_baseline.py` with `PEFT_DEVICE=cuda`).

mod standin;

use std::time::{Duration, Instant};

use lorafleet_engine::backend::cuda::Dtype;
use lorafleet_engine::{AdapterSource, BackendChoice, Engine, EngineSettings, Request};

/// The backend the bench runs on: the CPU, or CUDA device 0 with
/// `LORAFLEET_BENCH_BACKEND=cuda`.
fn backend() -> BackendChoice {
    match std::env::var("LORAFLEET_BENCH_BACKEND").as_deref() {
        Ok("cuda") => BackendChoice::Cuda {
            device: 0,
            dtype: Dtype::Bf16,
            lora_dtype: Dtype::F32,
            graphs: true,
            pdl: false,
        },
        _ => BackendChoice::Cpu,
    }
}

const REQUESTS: usize = 128;
const PROMPT: usize = 8;
const NEW: usize = 8;

fn main() {
    let counts = [0usize, 1, 8, 64];
    let rounds: usize = std::env::var("LORAFLEET_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1);
    let made = Instant::now();
    let which = std::env::var("LORAFLEET_BENCH_MODEL").unwrap_or_default();
    let (model, adapters, shape) = match which.as_str() {
        "" | "qwen3-moe" => (
            standin::moe_model(),
            standin::moe_adapters(64),
            format!(
                "Qwen3-MoE shape (h={}, L={}, {} experts of {}, top {}, bf16)",
                standin::HIDDEN,
                standin::LAYERS,
                standin::MOE_EXPERTS,
                standin::MOE_INTERMEDIATE,
                standin::MOE_TOP_K
            ),
        ),
        "gpt-oss" | "gpt-oss-mxfp4" => {
            let mxfp4 = which == "gpt-oss-mxfp4";
            (
                standin::gpt_oss_model(mxfp4),
                standin::gpt_oss_adapters(64),
                format!(
                    "GPT-OSS-20B architecture (h={}, L={}, sinks, sliding 128 and full, {} experts of {}, top {}, experts {})",
                    standin::HIDDEN,
                    standin::LAYERS,
                    standin::GPT_OSS_EXPERTS,
                    standin::HIDDEN,
                    standin::GPT_OSS_TOP_K,
                    if mxfp4 { "MXFP4" } else { "bf16" }
                ),
            )
        }
        other => panic!("LORAFLEET_BENCH_MODEL={other:?}: not qwen3-moe, gpt-oss or gpt-oss-mxfp4"),
    };
    eprintln!("stand-in ready in {:.1} s", made.elapsed().as_secs_f64());
    let on = match backend() {
        BackendChoice::Cpu => format!("CPU, {} threads", rayon::current_num_threads()),
        BackendChoice::Cuda { .. } => "CUDA device 0, bf16 weights, f32 slots".to_owned(),
    };
    println!(
        "MoE decode throughput, STAND-IN {shape}, rank {} on q/k/v/o and every expert, {REQUESTS} requests x {NEW} new tokens, {on}, {rounds} rounds",
        standin::RANK,
    );
    let mut tps: Vec<Vec<f64>> = vec![Vec::new(); counts.len()];
    let mut loads = vec![(0u64, 0f64); counts.len()];
    for round in 0..rounds {
        for (i, &n) in counts.iter().enumerate() {
            let (t, device_loads, write_ms) = run_once(&model, &adapters[..n]);
            eprintln!(
                "round {}: {n} adapters, {t:.1} tokens/s, {device_loads} device loads, {write_ms:.1} ms writing slots",
                round + 1
            );
            tps[i].push(t);
            loads[i] = (device_loads, write_ms);
        }
    }
    println!(
        "| adapters | tokens/s (median) | each round | vs base model | device loads | ms in slot writes (engine thread) |"
    );
    println!("|---:|---:|---|---:|---:|---:|");
    let base = median(&tps[0]);
    for (i, &n) in counts.iter().enumerate() {
        let label = if n == 0 {
            "0 (base model)".to_owned()
        } else {
            n.to_string()
        };
        println!(
            "| {label} | {:.1} | {} | {:.1}% | {} | {:.1} |",
            median(&tps[i]),
            tps[i]
                .iter()
                .map(|t| format!("{t:.1}"))
                .collect::<Vec<_>>()
                .join(" / "),
            median(&tps[i]) / base * 100.0,
            loads[i].0,
            loads[i].1
        );
    }
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One timed run over the given adapters on a fresh engine: tokens/s, the
/// device loads and the milliseconds the engine thread spent writing
/// slots during it.
fn run_once(model: &std::path::Path, dirs: &[std::path::PathBuf]) -> (f64, u64, f64) {
    let n = dirs.len();
    let settings = EngineSettings {
        max_loras: 32,
        max_lora_rank: 16,
        max_cpu_loras: 64,
        max_cpu_lora_bytes: None,
        kv_blocks: 512,
        block_size: 16,
        max_num_seqs: 32,
        max_batched_tokens: 512,
        max_waiting: 4096,
        max_pinned: None,
        prefix_caching: true,
        fair_admission: true,
        eviction: Default::default(),
        memory_budget_bytes: None,
    };
    let mut e = Engine::load(model, settings, backend()).unwrap();
    for (i, dir) in dirs.iter().enumerate() {
        e.register_adapter(
            standin::id(i),
            AdapterSource {
                name: format!("a{i}"),
                dir: dir.clone(),
                declared_base_hash: None,
                digest: None,
            },
        )
        .unwrap();
        e.prefetch(standin::id(i));
    }
    while e
        .stats()
        .adapters
        .iter()
        .filter(|a| a.residency != lorafleet_engine::Residency::Loading)
        .count()
        < n
    {
        e.pool().poll_loads(Some(Duration::from_millis(50)));
    }
    let requests: Vec<Request> = (0..REQUESTS)
        .map(|r| standin::decode_request(r, (n > 0).then(|| standin::id(r % n)), PROMPT, NEW))
        .collect();
    let loads_before = e.stats().pool.device_loads;
    e.take_slot_upload_times();
    let started = Instant::now();
    for r in requests {
        e.submit(r).unwrap();
    }
    let mut generated = 0;
    while e.has_work() {
        for (_, ev) in e.step().unwrap() {
            if let lorafleet_engine::Event::Delta { token_ids, .. } = ev {
                generated += token_ids.len();
            }
        }
    }
    let tps = generated as f64 / started.elapsed().as_secs_f64();
    let writes: Duration = e.take_slot_upload_times().iter().sum();
    (
        tps,
        e.stats().pool.device_loads - loads_before,
        writes.as_secs_f64() * 1e3,
    )
}
