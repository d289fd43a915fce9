//! One memory budget for KV blocks and adapter slots against fixed splits
//! of the same bytes, on three workloads over the fixture model (the real
//! engine, CPU backend): long sequences on one adapter, short requests over
//! ten adapters, and the two mixed. The counts (preemptions, device loads,
//! steps) do not depend on the machine. Run with:
//!
//!     cargo bench -p lorafleet-engine --bench memory_budget

#[path = "../tests/common/mod.rs"]
mod common;

use common::*;
use lorafleet_engine::backend::cpu::CpuBackend;
use lorafleet_engine::model::ModelConfig;
use lorafleet_engine::{EngineSettings, Prompt, Request, Sampling};

const MODEL: &str = "llama-gqa";
const BLOCK_SIZE: usize = 16;

fn request(id: String, adapter: u64, prompt_tokens: u32, max_tokens: usize) -> Request {
    let salt: u32 = id.bytes().map(u32::from).sum();
    Request {
        adapter: Some(aid(adapter)),
        prompt: Prompt::TokenIds(
            (0..prompt_tokens)
                .map(|i| 3 + (i * 7 + salt) % 380)
                .collect(),
        ),
        params: Sampling {
            max_tokens,
            temperature: 0.0,
            ignore_eos: true,
            ..Default::default()
        }
        .validate()
        .unwrap(),
        id: id.into(),
    }
}

fn workloads() -> Vec<(&'static str, Vec<Request>)> {
    let long = |tag: &str, n: u64| -> Vec<Request> {
        (0..n)
            .map(|i| request(format!("{tag}{i}"), 1, 70, 60))
            .collect()
    };
    let many = |tag: &str, n: u64| -> Vec<Request> {
        (0..n)
            .map(|i| request(format!("{tag}{i}"), 1 + i % 10, 8, 6))
            .collect()
    };
    let mut mixed = Vec::new();
    for (l, m) in long("ml", 8).into_iter().zip(many("mm", 64).chunks(8)) {
        mixed.push(l);
        mixed.extend_from_slice(m);
    }
    vec![
        ("long, 1 adapter", long("l", 16)),
        ("short, 10 adapters", many("m", 120)),
        ("mixed", mixed),
    ]
}

fn main() {
    let config = ModelConfig::from_dir(&model_dir(MODEL)).unwrap();
    let u = CpuBackend::memory_units(&config, BLOCK_SIZE, 16);
    let budget = 4 * u.slot_bytes + 40 * u.block_bytes;
    println!(
        "budget {budget} bytes = 4 slots ({} bytes each) + 40 KV blocks ({} bytes each)\n",
        u.slot_bytes, u.block_bytes
    );
    // (name, max_loras, kv_blocks, shared budget)
    let fixed = |slots: u64| {
        let blocks = (budget - slots * u.slot_bytes) / u.block_bytes;
        (
            format!("fixed: {slots} slots + {blocks} blocks"),
            slots as usize,
            blocks as usize,
            None,
        )
    };
    let setups = vec![
        fixed(1),
        fixed(4),
        fixed(6),
        (
            "shared budget, up to 8 slots".to_owned(),
            8,
            0,
            Some(budget),
        ),
    ];
    println!(
        "| workload | memory | preemptions | device loads | steps | peak KV blocks | peak filled slots | wall s |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    for (workload, requests) in workloads() {
        for (name, max_loras, kv_blocks, shared) in &setups {
            let settings = EngineSettings {
                max_loras: *max_loras,
                max_lora_rank: 16,
                max_cpu_loras: 12,
                kv_blocks: if shared.is_some() { 1 } else { *kv_blocks },
                block_size: BLOCK_SIZE,
                max_num_seqs: 16,
                max_batched_tokens: 256,
                max_pinned: Some(0),
                memory_budget_bytes: *shared,
                ..Default::default()
            };
            let mut e = fixture_engine(MODEL, settings);
            let started = std::time::Instant::now();
            let done = e.run_to_completion(requests.clone()).unwrap();
            let wall = started.elapsed().as_secs_f64();
            assert!(done.iter().all(|c| c.error.is_none()));
            let preemptions: u32 = done
                .iter()
                .filter_map(|c| c.finish.as_ref())
                .map(|f| f.preemptions)
                .sum();
            let stats = e.stats();
            let (peak_kv, peak_slots) = match stats.memory {
                Some(m) => (
                    (m.peak_kv / u.block_bytes).to_string(),
                    (m.peak_adapters / u.slot_bytes).to_string(),
                ),
                None => ("-".into(), "-".into()),
            };
            println!(
                "| {workload} | {name} | {preemptions} | {} | {} | {peak_kv} | {peak_slots} | {wall:.2} |",
                stats.pool.device_loads, stats.run.steps
            );
        }
    }
}
