//! The engine on the GPU, on a STAND-IN model of Llama-3.2-1B's shape
//! (random weights stored in bf16; for benchmarks only) with rank-16
//! adapters on q, k, v and o:
//!
//! - decode tokens/s with the traffic spread over 1, 8, 64 and 512 distinct
//!   adapters (`LORAFLEET_BENCH_ADAPTERS`), in the workload of
//!   `decode_throughput`: 512 requests of 8 prompt tokens and 8 new ones,
//!   greedy, up to 32 sequences a step, 32 device slots, the adapters read
//!   into the host tier before timing;
//! - batch-1 decode: the time per token of one request generating 128
//!   tokens, against the weights-through-HBM floor (every weight the step
//!   reads, once, at the device-to-device copy bandwidth);
//! - an adapter's copy from the host tier into a device slot: p50 and p99
//!   over 64 writes, from the call until the copy's event has fired.
//!
//! Targets (issue: CUDA on a real GPU): at 512 adapters ≥ 90% of the
//! one-adapter tokens/s; batch-1 decode within 1.5× of the floor; upload
//! p50 ≤ 2 ms.
//!
//! Run on a machine with an NVIDIA GPU:
//!   cargo bench -p lorafleet-engine --bench cuda_decode
//! (`LORAFLEET_BENCH_DORA=1`: the same adapters as DoRA;
//! `LORAFLEET_BENCH_SAVED_HEAD=1`: each with its own lm_head.)
//! Each run adds its tokens/s to the chart of tokens/s against adapters
//! (`plots/gpu_decode.rs`: `docs/plots/gpu_decode_adapters.svg`);
//! `cuda_decode --plot-only` redraws it without a GPU.
//! (`deploy/gpu-check.sh` builds it here and runs it there). The stand-in
//! is written under `LORAFLEET_BENCH_STANDIN` (default
//! `target/bench-standin`), about 6 GB with 512 adapters.

mod standin;

#[path = "../../../gateway/benches/support/svg.rs"]
mod svg;

#[path = "plots/gpu_decode.rs"]
mod plot;

use std::time::{Duration, Instant};

use lorafleet_engine::backend::cuda::testing::LoraBench;
use lorafleet_engine::backend::cuda::{CudaBackend, DeviceSample, Dtype, StepLimits};
use lorafleet_engine::backend::{Backend, BackendShape, StepBatch};
use lorafleet_engine::lora::{AdapterLimits, HostAdapter};
use lorafleet_engine::model::ModelConfig;
use lorafleet_engine::{BackendChoice, Engine, EngineSettings};
use standin::LLAMA_1B as SHAPE;

const REQUESTS: usize = 512;
/// The backend of the batch-1 and batch-32 measurements: 4 slots.
const SMALL_SHAPE: BackendShape = BackendShape {
    slots: 4,
    max_lora_rank: 16,
    kv_blocks: 64,
    block_size: 16,
    ring_len: 0,
    ring_blocks: 0,
};
const SMALL_LIMITS: StepLimits = StepLimits {
    max_tokens: 512,
    max_rows: 32,
};
const PROMPT: usize = 8;
const NEW: usize = 8;

fn main() {
    if std::env::args().any(|a| a == "--plot-only") {
        plot::draw();
        return;
    }
    if let Err(e) = lorafleet_engine::backend::cuda::probe() {
        eprintln!("cuda_decode needs a GPU: {e}");
        std::process::exit(2);
    }
    let counts: Vec<usize> = std::env::var("LORAFLEET_BENCH_ADAPTERS")
        .map(|v| {
            v.split(',')
                .map(|x| x.trim().parse().expect("adapter counts"))
                .collect()
        })
        .unwrap_or_else(|_| vec![1, 8, 64, 512]);
    let written = Instant::now();
    let model = standin::model_shaped(&SHAPE, safetensors::Dtype::BF16);
    // LORAFLEET_BENCH_DORA=1: the same adapters as DoRA (a magnitude vector
    // per module; the scales computed on the device as each slot is
    // written, applied in the expand), to show what DoRA costs on the GPU;
    // LORAFLEET_BENCH_SAVED_HEAD=1: each with its own lm_head (bf16, 525 MB
    // a copy at this shape: count the adapters accordingly).
    let on = |v: &str| std::env::var(v).is_ok_and(|v| v == "1");
    let kind = match (on("LORAFLEET_BENCH_DORA"), on("LORAFLEET_BENCH_SAVED_HEAD")) {
        (true, false) => standin::Kind::Dora,
        (false, true) => standin::Kind::SavedHead,
        (false, false) => standin::Kind::Plain,
        (true, true) => {
            panic!("LORAFLEET_BENCH_DORA and LORAFLEET_BENCH_SAVED_HEAD: one at a time")
        }
    };
    let other_kind = kind != standin::Kind::Plain;
    let dirs =
        standin::adapters_of_kind(&SHAPE, *counts.iter().max().unwrap(), standin::RANK, kind);
    eprintln!(
        "stand-in model and {} adapters ready in {:.1} s",
        dirs.len(),
        written.elapsed().as_secs_f64()
    );
    // Bench knobs: LORAFLEET_BENCH_SLOTS (device slots, default 32: as
    // many as sequences in a step) and LORAFLEET_BENCH_TABLES_ONLY=1 (the
    // tokens/s tables alone).
    let slots: usize = std::env::var("LORAFLEET_BENCH_SLOTS")
        .map(|v| v.parse().expect("LORAFLEET_BENCH_SLOTS: a slot count"))
        .unwrap_or(32);
    let settings = EngineSettings {
        max_loras: slots,
        max_lora_rank: 16,
        max_cpu_loras: 512,
        max_cpu_lora_bytes: None,
        kv_blocks: 2048,
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
    println!(
        "decode, STAND-IN Llama-3.2-1B shape (h={}, L={}, vocab {}, bf16), rank {}{}, {REQUESTS} requests x {NEW} new tokens, up to 32 a step, {slots} device slots",
        SHAPE.hidden,
        SHAPE.layers,
        SHAPE.vocab,
        standin::RANK,
        match kind {
            standin::Kind::Dora => " DoRA",
            standin::Kind::SavedHead => " with an own lm_head each",
            standin::Kind::Plain => "",
        },
    );
    // The adapter slots in f32 (the default) and in bf16; with
    // LORAFLEET_BENCH_PDL=1 each also with programmatic dependent launch
    // (=only: with it alone).
    let pdl_runs: &[bool] = match std::env::var("LORAFLEET_BENCH_PDL").as_deref() {
        Ok("1") => &[false, true],
        Ok("only") => &[true],
        _ => &[false],
    };
    let mut series = Vec::new();
    for (lora_dtype, pdl) in [Dtype::F32, Dtype::Bf16]
        .into_iter()
        .flat_map(|d| pdl_runs.iter().map(move |&p| (d, p)))
    {
        let choice = BackendChoice::Cuda {
            device: 0,
            dtype: Dtype::Bf16,
            lora_dtype,
            graphs: true,
            pdl,
        };
        let mut engine = Engine::load(&model, settings, choice).unwrap();
        standin::register(&mut engine, &dirs);
        println!();
        // The first count is what the others are compared with: 0 is
        // the base model alone (no request names an adapter).
        let first = match counts[0] {
            0 => "base only".to_owned(),
            1 => "1 adapter".to_owned(),
            c => format!("{c} adapters"),
        };
        let launches = if pdl { ", PDL" } else { "" };
        println!(
            "| adapters ({} slots{launches}) | tokens/s | vs {first} | device loads | mean distinct/step | steps | mean sequences/step | steps from a graph |",
            lora_dtype.name()
        );
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
        // One untimed run first: module load, cuBLAS heuristics, page faults.
        run(&mut engine, counts[0]);
        let mut first = None;
        let mut tokens_per_s = Vec::new();
        for &n in &counts {
            let replays = engine.stats().graphs.unwrap().replays;
            let (tps, loads, distinct, steps, seqs) = run(&mut engine, n);
            let replayed = engine.stats().graphs.unwrap().replays - replays;
            let base = *first.get_or_insert(tps);
            tokens_per_s.push((n, tps));
            println!(
                "| {n} | {tps:.0} | {:.1}% | {loads} | {distinct:.1} | {steps} | {seqs:.1} | {replayed} |",
                tps / base * 100.0
            );
        }
        let device = engine.device_name();
        series.push(plot::Series {
            label: format!(
                "{}, {}, {slots} {} slots{launches}",
                device.split(" (").next().unwrap_or(&device),
                chrono::Utc::now().format("%Y-%m-%d"),
                lora_dtype.name()
            ),
            tokens_per_s,
        });
    }
    // A DoRA or own-head run's series is not the chart's plain-LoRA one.
    if other_kind {
        println!("\n(adapters of another kind: the quantized bases and the chart are left out)");
    } else {
        plot::record(series);
        quantized_bases(&model, &dirs, settings);
    }

    if std::env::var("LORAFLEET_BENCH_TABLES_ONLY").is_ok_and(|v| v == "1") {
        return;
    }
    let config = ModelConfig::from_dir(&model).unwrap();
    let (shape, limits) = (SMALL_SHAPE, SMALL_LIMITS);
    let mut gpu = CudaBackend::load(&model, &config, shape, 0, Dtype::Bf16, limits).unwrap();
    let plan = gpu.memory_plan().unwrap();
    // Per token a decode step reads every linear weight and the lm_head
    // once; of the embedding table, one row.
    let embed = (config.vocab_size * config.hidden_size * 2) as u64;
    let read = plan.weights - embed;
    let bandwidth = LoraBench::new(64, 64, 1, 8, 8, 1)
        .unwrap()
        .copy_bandwidth(1 << 30, 20)
        .unwrap();
    let floor_ms = read as f64 / (bandwidth * 1e9) * 1e3;
    let table: Vec<u32> = (0..9).collect();
    let greedy = [DeviceSample {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        u: 0.0,
    }];
    let step = |gpu: &mut CudaBackend, tokens: &[u32], pos: usize| -> u32 {
        let mut batch = StepBatch::default();
        batch.push(tokens, pos, &table, None, true);
        batch.finish();
        gpu.forward_sampled(&batch, &greedy).unwrap()[0]
    };
    let prompt: Vec<u32> = (3..3 + PROMPT as u32).collect();
    println!();
    println!("| batch-1 decode | ms per token | HBM floor ms | x floor |");
    println!("|---|---:|---:|---:|");
    // Launched kernel by kernel, then replayed from a CUDA graph (the same
    // tokens either way). Then where the step's device time goes, each
    // part replayed from a graph of its own.
    let mut tokens_seen = Vec::new();
    let mut profiles = Vec::new();
    for (name, graphs, pdl) in [
        ("kernel by kernel", false, false),
        ("CUDA graph", true, false),
        ("CUDA graph, PDL", true, true),
    ] {
        gpu.set_graphs(graphs);
        if !gpu.set_pdl(pdl) && pdl {
            println!("| {name}: not available on this device | | | |");
            continue;
        }
        let mut token = step(&mut gpu, &prompt, 0);
        let mut generated = vec![token];
        // Warm-up decode steps (the graph is captured on the second), then
        // 128 timed ones.
        for pos in PROMPT..PROMPT + 8 {
            token = step(&mut gpu, &[token], pos);
            generated.push(token);
        }
        let started = Instant::now();
        for pos in PROMPT + 8..PROMPT + 8 + 128 {
            token = step(&mut gpu, &[token], pos);
            generated.push(token);
        }
        let per_token_ms = started.elapsed().as_secs_f64() * 1e3 / 128.0;
        println!(
            "| {name}: {:.2} GB of weights read per token, copy bandwidth {bandwidth:.0} GB/s | {per_token_ms:.3} | {floor_ms:.3} | {:.2} |",
            read as f64 / 1e9,
            per_token_ms / floor_ms
        );
        tokens_seen.push(generated);
        if graphs {
            profiles.push((name, gpu.profile_last_step(100).unwrap()));
        }
    }
    gpu.set_pdl(false);
    let counters = gpu.graph_counters().unwrap();
    for seen in &tokens_seen[1..] {
        assert_eq!(
            &tokens_seen[0], seen,
            "graph replays (and PDL) give the tokens of kernel-by-kernel launches"
        );
    }
    assert!(
        counters.replays >= 128,
        "the timed steps replayed a graph: {counters:?}"
    );
    println!();
    println!("| batch-1 step, device time | ms | x floor |");
    println!("|---|---:|---:|");
    for (name, parts) in profiles {
        for (part, ms) in parts {
            println!("| {name}: {part} | {ms:.3} | {:.2} |", ms / floor_ms);
        }
    }

    let limits = AdapterLimits {
        model: &config,
        max_lora_rank: 16,
        base_hash_check: None,
    };
    let hosts: Vec<HostAdapter> = dirs
        .iter()
        .take(8)
        .enumerate()
        .map(|(i, d)| HostAdapter::load(&format!("a{i}"), d, limits).unwrap())
        .collect();
    let mut took: Vec<Duration> = Vec::new();
    let mut staged: Vec<Duration> = Vec::new();
    for i in 0..72 {
        let slot = i % 4;
        let started = Instant::now();
        gpu.write_slot(slot, &hosts[i % hosts.len()]).unwrap();
        let returned = started.elapsed();
        while gpu.slot_copy_in_flight(slot) {
            std::hint::spin_loop();
        }
        // The first writes allocate the staging buffers.
        if i >= 8 {
            took.push(started.elapsed());
            staged.push(returned);
        }
    }
    took.sort();
    staged.sort();
    let q =
        |v: &[Duration], q: f64| v[((v.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e3;
    let at = |p: f64| q(&took, p);
    let bytes: usize = hosts[0]
        .modules
        .iter()
        .flatten()
        .flatten()
        .map(|m| {
            let (a, b) = m.factor_lens();
            4 * (a + b)
        })
        .sum();
    println!();
    println!(
        "| slot upload (rank 16, q/k/v/o, {:.1} MB as f32) | p50 ms | p99 ms |",
        bytes as f64 / 1e6
    );
    println!("|---|---:|---:|");
    println!(
        "| host tier to device slot, {} writes | {:.3} | {:.3} |",
        took.len(),
        at(0.5),
        at(0.99)
    );
    println!(
        "| of which staging on the host (until write_slot returns) | {:.3} | {:.3} |",
        q(&staged, 0.5),
        q(&staged, 0.99)
    );
    drop(gpu);
    batch32_lora(&model, &config, &hosts[0]);
}

/// A batch-32 decode step of one adapter, replayed from its graph, with
/// the slots in bf16 and in f32, and with no adapter: ms per step and the
/// LoRA launches' device time.
fn batch32_lora(model: &std::path::Path, config: &ModelConfig, host: &HostAdapter) {
    let (shape, limits) = (SMALL_SHAPE, SMALL_LIMITS);
    let greedy = vec![
        DeviceSample {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            u: 0.0,
        };
        32
    ];
    let tables: Vec<Vec<u32>> = (0..32u32).map(|i| vec![2 * i, 2 * i + 1]).collect();
    println!();
    println!(
        "| batch-32 decode step, one adapter | ms per step | x no adapter | launches per step | LoRA launches, device ms | slot upload p50 ms |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    // (name, PDL, ms, launches, LoRA ms, upload ms). Each slot type's
    // backend is loaded once; the step with no adapter runs on the bf16
    // one. Each row runs with plain launches, then with programmatic
    // dependent launch (on a device that has it).
    let mut rows = Vec::new();
    for (slot_dtype, cases) in [
        (
            Dtype::Bf16,
            &[("bf16 slots", Some(0)), ("no adapter", None)][..],
        ),
        (Dtype::F32, &[("f32 slots", Some(0))][..]),
    ] {
        let mut gpu = CudaBackend::load_with_slot_dtype(
            model,
            config,
            shape,
            0,
            Dtype::Bf16,
            slot_dtype,
            limits,
        )
        .unwrap();
        let mut uploads = Vec::new();
        for i in 0..24 {
            let started = Instant::now();
            gpu.write_slot(1 + i % 3, host).unwrap();
            while gpu.slot_copy_in_flight(1 + i % 3) {
                std::hint::spin_loop();
            }
            if i >= 4 {
                uploads.push(started.elapsed().as_secs_f64() * 1e3);
            }
        }
        uploads.sort_by(f64::total_cmp);
        let upload = uploads[uploads.len() / 2];
        gpu.write_slot(0, host).unwrap();
        let prompt: Vec<u32> = (3..3 + PROMPT as u32).collect();
        for pdl in [false, true] {
            if !gpu.set_pdl(pdl) && pdl {
                continue;
            }
            for &(name, adapter) in cases {
                let step = |gpu: &mut CudaBackend, len: usize, pos: usize| {
                    let mut batch = StepBatch::default();
                    for t in &tables {
                        batch.push(&prompt[..len], pos, t, adapter, true);
                    }
                    batch.finish();
                    gpu.forward_sampled(&batch, &greedy).unwrap();
                };
                step(&mut gpu, PROMPT, 0);
                // The first decode step of this batch size and adapter
                // mix runs launch by launch: count them.
                let before = gpu.launches_issued();
                step(&mut gpu, 1, PROMPT);
                let launches = gpu.launches_issued() - before;
                for pos in PROMPT + 1..PROMPT + 4 {
                    step(&mut gpu, 1, pos);
                }
                let started = Instant::now();
                for pos in PROMPT + 4..PROMPT + 20 {
                    step(&mut gpu, 1, pos);
                }
                let ms = started.elapsed().as_secs_f64() * 1e3 / 16.0;
                let lora = gpu
                    .profile_last_step(50)
                    .unwrap()
                    .into_iter()
                    .find(|(part, _)| *part == "LoRA launches")
                    .map_or(0.0, |(_, ms)| ms);
                rows.push((name, pdl, ms, launches, lora, upload));
            }
        }
    }
    // Each row against the step with no adapter launched the same way.
    let base = |pdl: bool| {
        rows.iter()
            .find(|r| r.0 == "no adapter" && r.1 == pdl)
            .map_or(1.0, |r| r.2)
    };
    for &(name, pdl, ms, launches, lora, upload) in &rows {
        println!(
            "| {name}{} | {ms:.3} | {:.2} | {launches} | {lora:.3} | {upload:.3} |",
            if pdl { ", PDL" } else { "" },
            ms / base(pdl)
        );
    }
}

/// One timed run of the workload over `n` adapters on a warm engine:
/// tokens/s, device loads, mean distinct adapters per step, steps, mean
/// sequences per step.
/// The same workload at 1 and 64 adapters on the stand-in's bases
/// (`LORAFLEET_BENCH_BASES`, default `bf16,int8,int4,fp8`): bf16, and the
/// bf16 model quantized as `standin::quantize` writes it (int8 per channel,
/// 4-bit per group of 128, FP8 per channel with per-token activations,
/// which runs FP8 GEMMs through cuBLASLt). Weights in bf16 on the device
/// for the dense base; codes at their width for the others.
fn quantized_bases(model: &std::path::Path, dirs: &[std::path::PathBuf], settings: EngineSettings) {
    let kinds =
        std::env::var("LORAFLEET_BENCH_BASES").unwrap_or_else(|_| "bf16,int8,int4,fp8".to_owned());
    let many = 64.min(dirs.len());
    println!();
    println!(
        "| base weights | weights on the device | tokens/s, 1 adapter | tokens/s, {many} adapters | vs bf16 ({many}) |"
    );
    println!("|---|---:|---:|---:|---:|");
    let mut bf16 = None;
    for kind in kinds.split(',').map(str::trim) {
        let dir = if kind == "bf16" {
            model.to_path_buf()
        } else {
            standin::quantize(model, kind)
        };
        let choice = BackendChoice::Cuda {
            device: 0,
            dtype: Dtype::Bf16,
            lora_dtype: Dtype::F32,
            graphs: true,
            pdl: false,
        };
        let mut engine = Engine::load(&dir, settings, choice).unwrap();
        standin::register(&mut engine, dirs);
        // Untimed: module load, cuBLAS(Lt) heuristics.
        run(&mut engine, 1);
        let (one, ..) = run(&mut engine, 1);
        let (at_many, ..) = run(&mut engine, many);
        let base = *bf16.get_or_insert(at_many);
        println!(
            "| {kind} | {:.0} MiB | {one:.0} | {at_many:.0} | {:.1}% |",
            engine.weight_bytes() as f64 / (1 << 20) as f64,
            at_many / base * 100.0
        );
    }
}

fn run(e: &mut Engine, n: usize) -> (f64, u64, f64, usize, f64) {
    // n = 0: every request on the base model alone.
    for i in 0..n {
        e.prefetch(standin::id(i));
    }
    while e
        .stats()
        .adapters
        .iter()
        .take(n)
        .any(|a| a.residency == lorafleet_engine::Residency::Loading)
    {
        e.pool().poll_loads(Some(Duration::from_millis(50)));
    }
    let loads_before = e.stats().pool.device_loads;
    for r in 0..REQUESTS {
        e.submit(standin::decode_request(
            r,
            (n > 0).then(|| standin::id(r % n)),
            PROMPT,
            NEW,
        ))
        .unwrap();
    }
    let started = Instant::now();
    let (mut generated, mut steps, mut distinct, mut seqs) = (0usize, 0usize, 0usize, 0usize);
    while e.has_work() {
        for (_, ev) in e.step().unwrap() {
            if let lorafleet_engine::Event::Delta { token_ids, .. } = ev {
                generated += token_ids.len();
            }
        }
        let s = e.last_step();
        if s.sequences > 0 {
            steps += 1;
            distinct += s.distinct_adapters;
            seqs += s.sequences;
        }
    }
    (
        generated as f64 / started.elapsed().as_secs_f64(),
        e.stats().pool.device_loads - loads_before,
        distinct as f64 / steps.max(1) as f64,
        steps,
        seqs as f64 / steps.max(1) as f64,
    )
}
