//! Benchmark: a 4,096-token conversation on a Gemma-3-1B-shape STAND-IN
//! (bf16, random weights) on the CPU backend, with its sliding layers (22
//! of 26 layers attend to the last 512 positions) against the same weights
//! with every layer global. Prints prefill tokens/s (the 4,096-token
//! prompt, in chunks of 512), decode tokens/s (64 new tokens), the KV
//! blocks the sequence holds at its end and their bytes: with sliding
//! layers a block holds the 4 global layers' keys and values, and the 22
//! sliding layers keep theirs in a ring of blocks covering the window and a
//! chunk (at f32, the CPU backend's cache type). Run with:
//!
//!     cargo bench -p lorafleet-engine --bench gemma_window
//!
//! `LORAFLEET_BENCH_PROMPT` sets the prompt length, `LORAFLEET_BENCH_ROUNDS`
//! the rounds (default 1; the two take turns).

mod standin;

use std::time::Instant;

use lorafleet_engine::{Engine, EngineSettings, Event};

const NEW: usize = 64;

fn main() {
    let prompt: usize = std::env::var("LORAFLEET_BENCH_PROMPT")
        .map(|v| v.parse().expect("LORAFLEET_BENCH_PROMPT: a length"))
        .unwrap_or(4096);
    let rounds: usize = std::env::var("LORAFLEET_BENCH_ROUNDS")
        .map(|v| v.parse().expect("LORAFLEET_BENCH_ROUNDS: a count"))
        .unwrap_or(1);
    let block_size = 16;
    let settings = EngineSettings {
        max_num_seqs: 1,
        max_batched_tokens: 512,
        block_size,
        kv_blocks: (prompt + NEW).div_ceil(block_size) + 8,
        ..Default::default()
    };
    let configs = [
        (
            "sliding (22 of 26 layers, window 512)",
            standin::gemma3_1b(false),
        ),
        ("every layer global", standin::gemma3_1b(true)),
    ];
    let mut results: Vec<Vec<(f64, f64, usize)>> = vec![Vec::new(); configs.len()];
    for _ in 0..rounds {
        for (i, (_, dir)) in configs.iter().enumerate() {
            let mut e = Engine::load(dir, settings, lorafleet_engine::BackendChoice::Cpu).unwrap();
            let request = standin::decode_request(0, None, prompt, NEW);
            e.submit(request).unwrap();
            let start = Instant::now();
            let (mut first, mut tokens, mut held) = (None, 0, 0);
            while e.has_work() {
                for (_, event) in e.step().unwrap() {
                    match event {
                        Event::Delta { token_ids, .. } => {
                            first.get_or_insert_with(Instant::now);
                            tokens += token_ids.len();
                        }
                        Event::Failed(err) => panic!("{err}"),
                        _ => {}
                    }
                }
                held = held.max(e.stats().kv_blocks_used);
            }
            let first = first.expect("a token");
            let prefill = prompt as f64 / (first - start).as_secs_f64();
            let decode = (tokens - 1) as f64 / first.elapsed().as_secs_f64();
            results[i].push((prefill, decode, held));
        }
    }
    let median = |v: Vec<f64>| {
        let mut v = v;
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "Gemma-3-1B-shape stand-in (bf16), CPU backend, {} threads; one conversation of {prompt} prompt tokens + {NEW} new, blocks of {block_size}, {rounds} round(s)",
        rayon::current_num_threads()
    );
    println!(
        "| layers | prefill tokens/s | decode tokens/s | KV blocks held (most) | KV MiB held |"
    );
    println!("|---|---:|---:|---:|---:|");
    for ((name, dir), r) in configs.iter().zip(&results) {
        let config = lorafleet_engine::model::ModelConfig::from_dir(dir).unwrap();
        let per_layer_block = 2 * block_size * config.kv_dim() * 4;
        let blocks = r.iter().map(|x| x.2).max().unwrap();
        let mut bytes = blocks * config.table_layers() * per_layer_block;
        if config.mixed_layers() {
            // The ring the engine sizes: the window and a chunk, and a block.
            let window = config.sliding_window.unwrap();
            let ring = (window + settings.max_batched_tokens - 1).div_ceil(block_size) + 1;
            bytes += ring * (config.num_layers - config.table_layers()) * per_layer_block;
        }
        println!(
            "| {name} | {:.1} | {:.2} | {blocks} | {:.1} |",
            median(r.iter().map(|x| x.0).collect()),
            median(r.iter().map(|x| x.1).collect()),
            bytes as f64 / (1 << 20) as f64
        );
    }
}
