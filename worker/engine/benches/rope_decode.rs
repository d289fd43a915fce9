//! Benchmark: decode on a Llama-3.2-1B-shape STAND-IN (bf16, random
//! weights) with plain RoPE against the same weights with Llama 3.1's
//! `llama3` RoPE scaling (factor 32, as Llama-3.2-1B ships it), on the CPU
//! backend. The scaled frequencies are computed once at load, so a step
//! rotates by a table either way; this shows the decode rate does not
//! move. Prints a table. Run with:
//!
//!     cargo bench -p lorafleet-engine --bench rope_decode
//!
//! Each run is 8 requests of 16 prompt tokens and 32 new ones (greedy, no
//! adapter) as one batch; one untimed warm-up of each, then the two
//! configurations take turns for `LORAFLEET_BENCH_ROUNDS` rounds (default
//! 3). The table gives each one's median decode tokens/s and the median of
//! the within-round ratio.

mod standin;

use std::time::Instant;

use lorafleet_engine::{Engine, EngineSettings};

const REQUESTS: usize = 8;
const PROMPT: usize = 16;
const NEW: usize = 32;

fn main() {
    let rounds: usize = std::env::var("LORAFLEET_BENCH_ROUNDS")
        .map(|v| v.parse().expect("LORAFLEET_BENCH_ROUNDS: a count"))
        .unwrap_or(3);
    let plain = standin::model_shaped(&standin::LLAMA_1B, safetensors::Dtype::BF16);
    // The same files with the config as Llama-3.2-1B ships its RoPE.
    let scaled = plain.with_file_name("model-bf16-llama3-rope");
    std::fs::create_dir_all(&scaled).unwrap();
    for entry in std::fs::read_dir(&plain).unwrap() {
        let entry = entry.unwrap();
        let to = scaled.join(entry.file_name());
        if entry.file_name() != "config.json" && !to.exists() {
            std::os::unix::fs::symlink(entry.path(), &to).unwrap();
        }
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(plain.join("config.json")).unwrap()).unwrap();
    config["rope_theta"] = 500_000.0.into();
    config["max_position_embeddings"] = 131_072.into();
    config["rope_scaling"] = serde_json::json!({
        "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"
    });
    std::fs::write(scaled.join("config.json"), config.to_string()).unwrap();

    let settings = EngineSettings {
        max_num_seqs: REQUESTS,
        max_batched_tokens: REQUESTS * PROMPT,
        ..Default::default()
    };
    let mut engines: Vec<(&str, Engine)> = [
        ("plain (rope_theta 500000)", &plain),
        ("llama3 (factor 32)", &scaled),
    ]
    .into_iter()
    .map(|(name, dir)| {
        let e = Engine::load(dir, settings, lorafleet_engine::BackendChoice::Cpu).unwrap();
        (name, e)
    })
    .collect();
    let run = |e: &mut Engine| -> f64 {
        let requests = (0..REQUESTS)
            .map(|r| standin::decode_request(r, None, PROMPT, NEW))
            .collect();
        let start = Instant::now();
        let out = e.run_to_completion(requests).unwrap();
        let secs = start.elapsed().as_secs_f64();
        let tokens: usize = out.iter().map(|c| c.token_ids.len()).sum();
        assert_eq!(tokens, REQUESTS * NEW);
        tokens as f64 / secs
    };
    for (_, e) in engines.iter_mut() {
        run(e);
    }
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); engines.len()];
    for _ in 0..rounds {
        for (i, (_, e)) in engines.iter_mut().enumerate() {
            rates[i].push(run(e));
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let ratios: Vec<f64> = rates[1].iter().zip(&rates[0]).map(|(s, p)| s / p).collect();
    println!(
        "Llama-3.2-1B-shape stand-in (bf16), CPU backend, {} threads; {REQUESTS} requests x ({PROMPT} prompt + {NEW} new), {rounds} rounds",
        rayon::current_num_threads()
    );
    println!("| RoPE | tokens/s (median) | within-round ratio to plain |");
    println!("|---|---:|---:|");
    println!("| {} | {:.1} | 1.000 |", engines[0].0, median(&rates[0]));
    println!(
        "| {} | {:.1} | {:.3} |",
        engines[1].0,
        median(&rates[1]),
        median(&ratios)
    );
}
