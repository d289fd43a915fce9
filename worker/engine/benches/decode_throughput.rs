//! Benchmark (b): decode throughput on a ~100M-parameter STAND-IN Llama with
//! every request on the base model (0 adapters), then the traffic spread
//! over 1, 8, 64 and 512 distinct rank-16 adapters (q, k, v, o). Prints a
//! table. Run with:
//!
//!     cargo bench -p lorafleet-engine --bench decode_throughput
//!
//! The model is stored in f32 (`LORAFLEET_BENCH_DTYPE=bf16` for bf16,
//! `int8` or `int4` for that bf16 model quantized), and the weights'
//! bytes in memory are printed first.
//! Every configuration runs the same 512 requests (8 prompt tokens, 8
//! generated, greedy) as one continuous batch of up to 32 sequences with 32
//! device slots. Adapters are read into the host tier before timing starts,
//! as in S-LoRA's setting; host-to-device copies are part of the timing.
//!
//! One untimed warm-up run of the first configuration comes first (the
//! process's first run pays for page faults and cold caches). Then the
//! configurations take turns for `LORAFLEET_BENCH_ROUNDS` rounds (default
//! 5); the table gives each row's median tokens/s, the ratio of that median
//! to the first row's, and the median over rounds of the ratio taken within
//! one round. `LORAFLEET_BENCH_ADAPTERS=1,512` picks the adapter counts;
//! `LORAFLEET_BENCH_DORA=1` makes the adapters DoRA (`use_dora`, a
//! magnitude vector per module), `LORAFLEET_BENCH_SAVED_HEAD=1` gives each
//! its own lm_head (`modules_to_save`). `LORAFLEET_BENCH_EVICTION=lru` runs the device tier's LRU eviction
//! instead of eviction by value. `LORAFLEET_BENCH_STEPS=1` prints, for each run, the time spent in steps
//! of each size (tokens per step) on stderr: in this workload the steps of
//! 256 tokens are prefills and those of 32 decodes.

mod standin;

use std::time::{Duration, Instant};

use lorafleet_engine::{AdapterSource, Engine, EngineSettings, Request};

const REQUESTS: usize = 512;
const PROMPT: usize = 8;
const NEW: usize = 8;

#[path = "../../../gateway/benches/support/svg.rs"]
mod svg;

fn main() {
    let counts: Vec<usize> = std::env::var("LORAFLEET_BENCH_ADAPTERS")
        .map(|v| {
            v.split(',')
                .map(|x| x.trim().parse().expect("adapter counts"))
                .collect()
        })
        .unwrap_or_else(|_| vec![0, 1, 8, 64, 512]);
    // The stand-in is stored in f32; `bf16` runs the same draws rounded to
    // bf16 and stored so, which the engine keeps in bf16 in memory; `int8`
    // and `int4` that bf16 model quantized (see `standin::quantized`).
    let weights = std::env::var("LORAFLEET_BENCH_DTYPE").unwrap_or_else(|_| "f32".into());
    let model = match weights.as_str() {
        "f32" => standin::model_in(safetensors::Dtype::F32),
        "bf16" => standin::model_in(safetensors::Dtype::BF16),
        "int8" => standin::model_quantized(8),
        "int4" => standin::model_quantized(4),
        other => panic!("LORAFLEET_BENCH_DTYPE={other}: expected f32, bf16, int8 or int4"),
    };
    let rounds: usize = std::env::var("LORAFLEET_BENCH_ROUNDS")
        .map(|v| {
            v.parse()
                .expect("LORAFLEET_BENCH_ROUNDS: a count of rounds")
        })
        .unwrap_or(5)
        .max(1);
    let config = lorafleet_engine::model::ModelConfig::from_dir(&model).unwrap();
    let shape = lorafleet_engine::backend::BackendShape {
        slots: 1,
        max_lora_rank: 16,
        kv_blocks: 1,
        block_size: 16,
        ring_len: 0,
        ring_blocks: 0,
    };
    let backend = lorafleet_engine::backend::cpu::CpuBackend::load(&model, &config, shape).unwrap();
    let weight_mb = |b: usize| b as f64 / 1e6;
    println!(
        "weights in memory: {:.1} MB ({:.1} MB the layers' projections)",
        weight_mb(backend.weight_bytes()),
        weight_mb(backend.layer_projection_bytes())
    );
    drop(backend);
    // LORAFLEET_BENCH_DORA=1: the same adapters as DoRA (a magnitude vector
    // per module), to show what DoRA's per-row scale costs;
    // LORAFLEET_BENCH_SAVED_HEAD=1: each with its own lm_head.
    let on = |v: &str| std::env::var(v).is_ok_and(|v| v == "1");
    let (dora, saved_head) = (on("LORAFLEET_BENCH_DORA"), on("LORAFLEET_BENCH_SAVED_HEAD"));
    let kind = match (dora, saved_head) {
        (true, false) => standin::Kind::Dora,
        (false, true) => standin::Kind::SavedHead,
        (false, false) => standin::Kind::Plain,
        (true, true) => {
            panic!("LORAFLEET_BENCH_DORA and LORAFLEET_BENCH_SAVED_HEAD: one at a time")
        }
    };
    let adapter_dirs = standin::adapters_of_kind(
        &standin::SMALL,
        *counts.iter().max().unwrap(),
        standin::RANK,
        kind,
    );
    println!(
        "decode throughput, STAND-IN ~100M Llama (h={}, L={}, weights {weights}), rank {}{}, {REQUESTS} requests x {NEW} new tokens, {} threads, {rounds} rounds",
        standin::HIDDEN,
        standin::LAYERS,
        standin::RANK,
        match kind {
            standin::Kind::Plain => "",
            standin::Kind::Dora => " DoRA",
            standin::Kind::SavedHead => " with its own lm_head",
        },
        rayon::current_num_threads()
    );
    let warm_up = run_once(&model, &adapter_dirs[..counts[0]]);
    eprintln!(
        "warm-up (not counted): {} adapters, {:.1} tokens/s",
        counts[0],
        warm_up.tokens_per_s()
    );
    // The configurations take turns, round after round, so that a slow
    // spell of a shared machine lands on all of them alike; each ratio is
    // taken within one round, against that round's first configuration.
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); counts.len()];
    for round in 0..rounds {
        for (i, &n) in counts.iter().enumerate() {
            let run = run_once(&model, &adapter_dirs[..n]);
            eprintln!(
                "round {}: {n} adapters, {:.1} tokens/s",
                round + 1,
                run.tokens_per_s()
            );
            runs[i].push(run);
        }
    }
    println!(
        "| adapters | generated tokens | tokens/s (median) | each round | vs {0} adapters (ratio of medians) | vs {0} adapters (median of rounds) | device loads | late loads | mean distinct/step | stolen CPU s |",
        counts[0]
    );
    println!("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|");
    let first_median = median(&runs[0].iter().map(Run::tokens_per_s).collect::<Vec<_>>());
    let mut chart = svg::Bars {
        title: "Decode tokens/s against distinct adapters (CPU backend, STAND-IN ~100M Llama)",
        y_label: "tokens/s (median of rounds)",
        groups: Vec::new(),
        series: vec![(format!("{weights} weights"), Vec::new())],
    };
    for (i, &n) in counts.iter().enumerate() {
        let tps: Vec<f64> = runs[i].iter().map(Run::tokens_per_s).collect();
        let ratios: Vec<f64> = runs[i]
            .iter()
            .zip(&runs[0])
            .map(|(r, base)| r.tokens_per_s() / base.tokens_per_s())
            .collect();
        let last = runs[i].last().unwrap();
        let stolen: Option<f64> = runs[i].iter().map(|r| r.stolen).sum();
        let label = if n == 0 {
            "0 (base model)".to_owned()
        } else {
            n.to_string()
        };
        chart.groups.push(label.clone());
        chart.series[0].1.push(median(&tps));
        println!(
            "| {label} | {} | {:.1} | {} | {:.1}% | {:.1}% | {} | {} | {:.1} | {} |",
            last.generated,
            median(&tps),
            tps.iter()
                .map(|t| format!("{t:.1}"))
                .collect::<Vec<_>>()
                .join(" / "),
            median(&tps) / first_median * 100.0,
            median(&ratios) * 100.0,
            last.device_loads,
            last.late_loads,
            last.mean_distinct,
            stolen.map_or("n/a".to_string(), |s| format!("{s:.1}")),
        );
    }
    chart.write(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!(
            "../../docs/plots/cpu_decode_adapters_{weights}{}.svg",
            match kind {
                standin::Kind::Plain => "",
                standin::Kind::Dora => "_dora",
                standin::Kind::SavedHead => "_saved_head",
            }
        )),
    );
}

#[derive(Debug, Clone)]
struct Run {
    generated: usize,
    seconds: f64,
    device_loads: u64,
    /// Loads at admission a prefetch could have started a step earlier.
    late_loads: u64,
    mean_distinct: f64,
    /// CPU seconds stolen by the hypervisor during the run, if known.
    stolen: Option<f64>,
}

impl Run {
    fn tokens_per_s(&self) -> f64 {
        self.generated as f64 / self.seconds
    }
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len().is_multiple_of(2) {
        (v[mid - 1] + v[mid]) / 2.0
    } else {
        v[mid]
    }
}

/// One timed run of all requests over the first `adapter_dirs.len()`
/// adapters, on a fresh engine.
fn run_once(model: &std::path::Path, adapter_dirs: &[std::path::PathBuf]) -> Run {
    let n = adapter_dirs.len();
    let settings = EngineSettings {
        max_loras: 32,
        max_lora_rank: 16,
        max_cpu_loras: 512,
        max_cpu_lora_bytes: None,
        kv_blocks: 512,
        block_size: 16,
        max_num_seqs: 32,
        max_batched_tokens: 512,
        max_waiting: 4096,
        max_pinned: None,
        prefix_caching: true,
        fair_admission: true,
        // LORAFLEET_BENCH_EVICTION=lru compares the device tier's old policy.
        eviction: std::env::var("LORAFLEET_BENCH_EVICTION")
            .map(|v| v.parse().expect("LORAFLEET_BENCH_EVICTION: value or lru"))
            .unwrap_or_default(),
        memory_budget_bytes: None,
    };
    let mut e = Engine::load_cpu(model, settings).unwrap();
    let loading = Instant::now();
    for (i, dir) in adapter_dirs.iter().enumerate() {
        e.register_adapter(
            aid(i as u64 + 1),
            AdapterSource {
                name: format!("a{i}"),
                dir: dir.clone(),
                declared_base_hash: None,
                digest: None,
            },
        )
        .unwrap();
        e.prefetch(aid(i as u64 + 1));
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
    eprintln!(
        "{n} adapters read into the host tier in {:.2} s",
        loading.elapsed().as_secs_f64()
    );
    let requests: Vec<Request> = (0..REQUESTS)
        // 0 adapters: every request runs on the base model alone.
        .map(|r| standin::decode_request(r, (n > 0).then(|| aid((r % n) as u64 + 1)), PROMPT, NEW))
        .collect();
    let loads_before = e.stats().pool.device_loads;
    let late_before = e.stats().pool.late_loads;
    let stolen_before = stolen_cpu_seconds();
    let started = Instant::now();
    let mut generated = 0;
    let (mut steps, mut distinct) = (0usize, 0usize);
    for r in requests {
        e.submit(r).unwrap();
    }
    // Steps grouped by size, so that prefill and decode costs show apart.
    let mut by_tokens: std::collections::BTreeMap<usize, (usize, f64)> = Default::default();
    while e.has_work() {
        let step_started = Instant::now();
        let events = e.step().unwrap();
        let entry = by_tokens.entry(e.last_step().tokens).or_default();
        entry.0 += 1;
        entry.1 += step_started.elapsed().as_secs_f64();
        for (_, ev) in events {
            if let lorafleet_engine::Event::Delta { token_ids, .. } = ev {
                generated += token_ids.len();
            }
        }
        let s = e.last_step();
        if s.sequences > 0 {
            steps += 1;
            distinct += s.distinct_adapters;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    if std::env::var("LORAFLEET_BENCH_STEPS").is_ok_and(|v| v == "1") {
        for (tokens, (steps, s)) in &by_tokens {
            eprintln!(
                "steps of {tokens} tokens: {steps}, {s:.3} s, {:.2} ms each",
                s / *steps as f64 * 1e3
            );
        }
    }
    Run {
        generated,
        seconds,
        device_loads: e.stats().pool.device_loads - loads_before,
        late_loads: e.stats().pool.late_loads - late_before,
        mean_distinct: distinct as f64 / steps as f64,
        stolen: stolen_before
            .zip(stolen_cpu_seconds())
            .map(|(before, after)| after - before),
    }
}

/// CPU time the hypervisor gave to other guests, all CPUs together, from
/// the `steal` column of `/proc/stat` (Linux; in clock ticks of 1/100 s).
/// On a shared virtual machine a row that lost seconds here measured the
/// neighbours as much as the engine, so the table shows it.
fn stolen_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = stat.lines().find(|l| l.starts_with("cpu "))?;
    let steal: f64 = cpu.split_whitespace().nth(8)?.parse().ok()?;
    Some(steal / 100.0)
}

fn aid(n: u64) -> lorafleet_engine::AdapterId {
    lorafleet_engine::AdapterId::new(n).expect("ids start at 1")
}
