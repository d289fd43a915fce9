//! Benchmark: does one tenant's stop strings slow another tenant's decode?
//! Prints a table. Run with:
//!
//!     cargo bench -p lorafleet-engine --bench stop_strings
//!
//! On the fixture model (`llama-gqa`: 2 layers, hidden 64, its real
//! tokenizer), whose forward pass is so cheap that any per-token cost of
//! matching stop strings shows: the harshest setting for this check.
//! Tenant B runs 32 requests of 64 greedy tokens with no stop strings.
//! Beside them, tenant A runs 32 more requests that carry either no stop
//! strings or 16 of the longest allowed (256 bytes), which never match.
//! The table gives B's tokens/s in each setting (median over
//! `LORAFLEET_BENCH_ROUNDS` rounds, default 7, the settings taking turns),
//! and the median over rounds of the ratio taken within one round.

use std::path::PathBuf;
use std::time::Instant;

use lorafleet_engine::sampling::{MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS};
use lorafleet_engine::{Engine, EngineSettings, Prompt, Request, Sampling};

const PER_TENANT: usize = 32;
const NEW: usize = 64;

fn main() {
    let rounds: usize = std::env::var("LORAFLEET_BENCH_ROUNDS")
        .map(|v| v.parse().expect("LORAFLEET_BENCH_ROUNDS: a count"))
        .unwrap_or(7)
        .max(1);
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama-gqa");
    // Stop strings that keep a naive matcher busy: long runs of letters,
    // which the text keeps almost-matching, ending in a byte it never has.
    let stops: Vec<String> = (0..MAX_STOP_STRINGS)
        .map(|i| {
            let c = char::from(b'a' + i as u8);
            let mut s: String = std::iter::repeat_n(c, MAX_STOP_STRING_BYTES - 1).collect();
            s.push('\u{7}');
            s
        })
        .collect();
    println!(
        "stop strings: tenant B's decode beside tenant A's requests, fixture llama-gqa, \
         {PER_TENANT} + {PER_TENANT} requests x {NEW} tokens, {rounds} rounds"
    );
    // Untimed warm-up.
    run(&model, &[]);
    let mut plain = Vec::new();
    let mut stopped = Vec::new();
    for round in 0..rounds {
        let p = run(&model, &[]);
        let s = run(&model, &stops);
        eprintln!("round {}: {p:.0} / {s:.0} B tokens/s", round + 1);
        plain.push(p);
        stopped.push(s);
    }
    let ratios: Vec<f64> = stopped.iter().zip(&plain).map(|(s, p)| s / p).collect();
    println!(
        "| tenant A's requests carry | B tokens/s (median) | each round | vs none (median of rounds) |"
    );
    println!("|---|---:|---|---:|");
    for (label, v, ratio) in [
        ("no stop strings", &plain, 1.0),
        ("16 stop strings of 256 bytes", &stopped, median(&ratios)),
    ] {
        println!(
            "| {label} | {:.0} | {} | {:.1}% |",
            median(v),
            v.iter()
                .map(|t| format!("{t:.0}"))
                .collect::<Vec<_>>()
                .join(" / "),
            ratio * 100.0
        );
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

/// Tenant B's tokens per second, with A's requests carrying `stops`.
fn run(model: &std::path::Path, stops: &[String]) -> f64 {
    let settings = EngineSettings {
        max_loras: 4,
        max_lora_rank: 8,
        max_cpu_loras: 4,
        max_cpu_lora_bytes: None,
        kv_blocks: 1024,
        block_size: 16,
        max_num_seqs: 2 * PER_TENANT,
        max_batched_tokens: 1024,
        max_waiting: 4096,
        max_pinned: None,
        prefix_caching: true,
        fair_admission: true,
        eviction: Default::default(),
        memory_budget_bytes: None,
    };
    let mut e = Engine::load_cpu(model, settings).expect("the fixture model");
    let request = |tenant: &str, i: usize, stop: Vec<String>| Request {
        id: format!("{tenant}{i}").into(),
        adapter: None,
        prompt: Prompt::TokenIds(
            (0..8)
                .map(|k| ((i * 31 + k * 7) % 300 + 3) as u32)
                .collect(),
        ),
        params: Sampling {
            max_tokens: NEW,
            temperature: 0.0,
            ignore_eos: true,
            stop,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    };
    let mut requests = Vec::new();
    for i in 0..PER_TENANT {
        requests.push(request("b", i, Vec::new()));
        requests.push(request("a", i, stops.to_vec()));
    }
    let started = Instant::now();
    let done = e.run_to_completion(requests).expect("the batch runs");
    let seconds = started.elapsed().as_secs_f64();
    let b_tokens: usize = done
        .iter()
        .filter(|c| c.request_id.starts_with('b'))
        .map(|c| c.token_ids.len())
        .sum();
    assert_eq!(b_tokens, PER_TENANT * NEW, "every B request ran to its end");
    assert!(done.iter().all(|c| c.error.is_none()), "no request failed");
    b_tokens as f64 / seconds
}
