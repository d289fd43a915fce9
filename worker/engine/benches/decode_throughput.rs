//! Benchmark (b): decode throughput on a ~100M-parameter STAND-IN Llama with
//! the traffic spread over 1, 8, 64 and 512 distinct rank-16 adapters (q, k,
//! v, o). Prints a table. Run with:
//!
//!     cargo bench -p lorafleet-engine --bench decode_throughput
//!
//! The model is stored in f32 (`LORAFLEET_BENCH_DTYPE=bf16` for bf16).
//! Every configuration runs the same 512 requests (8 prompt tokens, 8
//! generated, greedy) as one continuous batch of up to 32 sequences with 32
//! device slots. Adapters are read into the host tier before timing starts,
//! as in S-LoRA's setting; host-to-device copies are part of the timing.

mod standin;

use std::time::{Duration, Instant};

use lorafleet_engine::{AdapterSource, Engine, EngineSettings, Prompt, Request, SamplingParams};

const REQUESTS: usize = 512;
const PROMPT: usize = 8;
const NEW: usize = 8;

fn main() {
    let counts: Vec<usize> = std::env::var("LORAFLEET_BENCH_ADAPTERS")
        .map(|v| {
            v.split(',')
                .map(|x| x.trim().parse().expect("adapter counts"))
                .collect()
        })
        .unwrap_or_else(|_| vec![1, 8, 64, 512]);
    // The stand-in is stored in f32; `bf16` runs the same draws rounded to
    // bf16 and stored so, which the engine keeps in bf16 in memory.
    let dtype = match std::env::var("LORAFLEET_BENCH_DTYPE").as_deref() {
        Ok("f32") | Err(_) => safetensors::Dtype::F32,
        Ok("bf16") => safetensors::Dtype::BF16,
        Ok(other) => panic!("LORAFLEET_BENCH_DTYPE={other}: expected bf16 or f32"),
    };
    let model = standin::model_in(dtype);
    let adapter_dirs = standin::adapters(*counts.iter().max().unwrap());
    println!(
        "decode throughput, STAND-IN ~100M Llama (h={}, L={}, weights {dtype:?}), rank {}, {REQUESTS} requests x {NEW} new tokens, {} threads",
        standin::HIDDEN,
        standin::LAYERS,
        standin::RANK,
        rayon::current_num_threads()
    );
    println!(
        "| adapters | generated tokens | seconds | tokens/s | vs 1 adapter | device loads | mean distinct/step | stolen CPU s |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut baseline = None;
    for &n in &counts {
        let settings = EngineSettings {
            max_loras: 32,
            max_lora_rank: 16,
            max_cpu_loras: 512,
            kv_blocks: 512,
            block_size: 16,
            max_num_seqs: 32,
            max_batched_tokens: 512,
            max_waiting: 4096,
        };
        let mut e = Engine::load_cpu(&model, settings).unwrap();
        for (i, dir) in adapter_dirs.iter().take(n).enumerate() {
            e.register_adapter(
                i as u64 + 1,
                AdapterSource {
                    name: format!("a{i}"),
                    dir: dir.clone(),
                    declared_base_hash: None,
                },
            )
            .unwrap();
            e.prefetch(i as u64 + 1);
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
            .map(|r| Request {
                id: format!("r{r}"),
                adapter: Some((r % n) as u64 + 1),
                prompt: Prompt::TokenIds(
                    (0..PROMPT)
                        .map(|k| ((r * 31 + k * 7) % 380 + 3) as u32)
                        .collect(),
                ),
                params: SamplingParams {
                    max_tokens: NEW,
                    temperature: 0.0,
                    ignore_eos: true,
                    ..Default::default()
                },
            })
            .collect();
        let loads_before = e.stats().pool.device_loads;
        let stolen_before = stolen_cpu_seconds();
        let started = Instant::now();
        let mut generated = 0;
        let (mut steps, mut distinct) = (0usize, 0usize);
        for r in requests {
            e.submit(r).unwrap();
        }
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
            }
        }
        let secs = started.elapsed().as_secs_f64();
        let stolen = match (stolen_before, stolen_cpu_seconds()) {
            (Some(a), Some(b)) => format!("{:.1}", b - a),
            _ => "n/a".to_string(),
        };
        let tps = generated as f64 / secs;
        let base = *baseline.get_or_insert(tps);
        println!(
            "| {n} | {generated} | {secs:.2} | {tps:.1} | {:.1}% | {} | {:.1} | {stolen} |",
            tps / base * 100.0,
            e.stats().pool.device_loads - loads_before,
            distinct as f64 / steps as f64
        );
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
