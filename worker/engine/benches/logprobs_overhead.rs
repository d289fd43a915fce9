//! What log probabilities and structured outputs cost: decode tokens/s on
//! the ~100M-parameter
//! STAND-IN Llama with traffic spread over 8 rank-16 adapters, without log
//! probabilities, with them on every request (0, 5 and 20 alternatives),
//! with them on one request in 8 (a step carrying any scoring request
//! brings its logits to the host), and the loglikelihood request
//! lm-evaluation-harness sends (the prompt scored, one token), and with a
//! JSON schema on every request or one in 8. Prints a table. Run with:
//!
//!     cargo bench -p lorafleet-engine --bench logprobs_overhead
//!
//! Each configuration runs 256 requests (8 prompt tokens, 16 generated,
//! greedy) as one continuous batch of up to 32 sequences; configurations
//! take turns for `LORAFLEET_BENCH_ROUNDS` rounds (default 3) and the table
//! gives each one's median tokens/s (prompt tokens scored count for the
//! loglikelihood row) and the median over rounds of its ratio to the first
//! row's within one round.

mod standin;

use std::time::Instant;

use lorafleet_engine::constraint::Constraint;
use lorafleet_engine::{Engine, EngineSettings, Request};

const REQUESTS: usize = 256;
const PROMPT: usize = 8;
const NEW: usize = 16;
const ADAPTERS: usize = 8;

#[derive(Clone, Copy)]
struct Config {
    label: &'static str,
    /// Every `every`-th request asks (0: none does).
    every: usize,
    logprobs: Option<usize>,
    prompt_logprobs: Option<usize>,
    new: usize,
    schema: bool,
}

/// An object of numbers: 16 tokens stay inside it whatever the model says.
const SCHEMA: &str = r#"{"type":"object","properties":{"a":{"type":"array","items":{"type":"integer"}}},"required":["a"]}"#;

const CONFIGS: [Config; 8] = [
    Config {
        label: "no logprobs",
        every: 0,
        logprobs: None,
        prompt_logprobs: None,
        new: NEW,
        schema: false,
    },
    Config {
        label: "logprobs 0, every request",
        every: 1,
        logprobs: Some(0),
        prompt_logprobs: None,
        new: NEW,
        schema: false,
    },
    Config {
        label: "logprobs 5, every request",
        every: 1,
        logprobs: Some(5),
        prompt_logprobs: None,
        new: NEW,
        schema: false,
    },
    Config {
        label: "logprobs 20, every request",
        every: 1,
        logprobs: Some(20),
        prompt_logprobs: None,
        new: NEW,
        schema: false,
    },
    Config {
        label: "logprobs 5, 1 request in 8",
        every: 8,
        logprobs: Some(5),
        prompt_logprobs: None,
        new: NEW,
        schema: false,
    },
    Config {
        label: "echo + logprobs 1, max_tokens 1 (lm-eval)",
        every: 1,
        logprobs: Some(1),
        prompt_logprobs: Some(1),
        new: 1,
        schema: false,
    },
    Config {
        label: "JSON schema, every request",
        every: 1,
        logprobs: None,
        prompt_logprobs: None,
        new: NEW,
        schema: true,
    },
    Config {
        label: "JSON schema, 1 request in 8",
        every: 8,
        logprobs: None,
        prompt_logprobs: None,
        new: NEW,
        schema: true,
    },
];

fn main() {
    let rounds: usize = std::env::var("LORAFLEET_BENCH_ROUNDS")
        .map(|v| v.parse().expect("LORAFLEET_BENCH_ROUNDS: a count"))
        .unwrap_or(3)
        .max(1);
    let model = standin::model();
    let adapters = standin::adapters(ADAPTERS);
    println!(
        "logprobs overhead, STAND-IN ~100M Llama (h={}, L={}, vocab {}), {ADAPTERS} adapters of rank {}, {REQUESTS} requests, {} threads, {rounds} rounds",
        standin::HIDDEN,
        standin::LAYERS,
        standin::VOCAB,
        standin::RANK,
        rayon::current_num_threads()
    );
    let _ = run_once(&model, &adapters, CONFIGS[0]); // warm-up
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); CONFIGS.len()];
    for round in 0..rounds {
        for (i, c) in CONFIGS.iter().enumerate() {
            let r = run_once(&model, &adapters, *c);
            eprintln!("round {}: {}: {r:.1} tokens/s", round + 1, c.label);
            rates[i].push(r);
        }
    }
    println!("| requests | tokens/s (median) | each round | vs no logprobs (median of rounds) |");
    println!("|---|---:|---|---:|");
    for (i, c) in CONFIGS.iter().enumerate() {
        let ratios: Vec<f64> = rates[i].iter().zip(&rates[0]).map(|(r, b)| r / b).collect();
        println!(
            "| {} | {:.1} | {} | {:.1}% |",
            c.label,
            median(&rates[i]),
            rates[i]
                .iter()
                .map(|t| format!("{t:.1}"))
                .collect::<Vec<_>>()
                .join(" / "),
            median(&ratios) * 100.0
        );
    }
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Tokens per second of one run: generated tokens, plus prompt tokens
/// scored.
fn run_once(model: &std::path::Path, adapters: &[std::path::PathBuf], c: Config) -> f64 {
    let settings = EngineSettings {
        max_loras: 8,
        max_lora_rank: 16,
        max_num_seqs: 32,
        max_batched_tokens: 512,
        kv_blocks: 512,
        block_size: 16,
        max_waiting: 4096,
        ..Default::default()
    };
    let mut e = Engine::load_cpu(model, settings).unwrap();
    standin::register(&mut e, adapters);
    let requests: Vec<Request> = (0..REQUESTS)
        .map(|r| {
            let mut req =
                standin::decode_request(r, Some(standin::id(r % ADAPTERS)), PROMPT, c.new);
            if c.every > 0 && r % c.every == 0 {
                let mut params = req.params.into_inner();
                params.logprobs = c.logprobs;
                params.prompt_logprobs = c.prompt_logprobs;
                if c.schema {
                    params.constraint = Some(Constraint::JsonSchema(SCHEMA.into()));
                }
                req.params = params.validate().unwrap();
            }
            req
        })
        .collect();
    let started = Instant::now();
    let out = e.run_to_completion(requests).unwrap();
    let seconds = started.elapsed().as_secs_f64();
    let tokens: usize = out
        .iter()
        .map(|o| {
            assert!(o.error.is_none(), "{:?}", o.error);
            o.token_ids.len() + o.prompt_logprobs.len().saturating_sub(1)
        })
        .sum();
    tokens as f64 / seconds
}
