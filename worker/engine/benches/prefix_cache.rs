//! Benchmark: prefix caching on a STAND-IN ~100M-parameter Llama with 16
//! rank-16 adapters. Prints a table. Run with:
//!
//!     cargo bench -p lorafleet-engine --bench prefix_cache
//!
//! 16 adapters x 32 requests. Each adapter's requests share a 512-token
//! system prompt and add a 16-token question of their own; each generates
//! 8 tokens, greedy. Every request arrives at once, as one continuous
//! batch of up to 32 sequences with 16 device slots. The table gives time
//! to first token (p50, p99, from arrival at the engine) and throughput
//! (generated tokens and prompt tokens per second of wall time), with the
//! cache on and off, and their ratios. Adapters are read into the host
//! tier before timing starts.

mod standin;

use std::time::{Duration, Instant};

use lorafleet_engine::{Engine, EngineSettings, Event, Prompt, Request, Sampling};

const ADAPTERS: usize = 16;
const PER_ADAPTER: usize = 32;
const SYSTEM: usize = 512;
const QUESTION: usize = 16;
const NEW: usize = 8;

fn main() {
    let model = standin::model();
    let dirs = standin::adapters(ADAPTERS);
    println!(
        "prefix caching, STAND-IN ~100M Llama (h={}, L={}), {ADAPTERS} rank-{} adapters x {PER_ADAPTER} requests, {SYSTEM}-token shared system prompt + {QUESTION}-token question, {NEW} new tokens, {} threads",
        standin::HIDDEN,
        standin::LAYERS,
        standin::RANK,
        rayon::current_num_threads()
    );
    let off = run(&model, &dirs, false);
    let on = run(&model, &dirs, true);
    println!(
        "| prefix cache | TTFT p50 | TTFT p99 | generated tokens/s | prompt tokens/s | prompt tokens served from the cache | wall s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (label, r) in [("off", &off), ("on", &on)] {
        println!(
            "| {label} | {:.0} ms | {:.0} ms | {:.1} | {:.0} | {} of {} | {:.1} |",
            r.p50.as_secs_f64() * 1e3,
            r.p99.as_secs_f64() * 1e3,
            r.generated as f64 / r.seconds,
            r.prompt as f64 / r.seconds,
            r.cached,
            r.prompt,
            r.seconds
        );
    }
    println!(
        "| on vs off | {:.1}x lower | {:.1}x lower | {:.1}x higher | | | |",
        off.p50.as_secs_f64() / on.p50.as_secs_f64(),
        off.p99.as_secs_f64() / on.p99.as_secs_f64(),
        (on.generated as f64 / on.seconds) / (off.generated as f64 / off.seconds),
    );
}

struct Run {
    p50: Duration,
    p99: Duration,
    generated: usize,
    prompt: usize,
    cached: usize,
    seconds: f64,
}

fn run(model: &std::path::Path, dirs: &[std::path::PathBuf], prefix_caching: bool) -> Run {
    let settings = EngineSettings {
        max_loras: ADAPTERS,
        max_lora_rank: 16,
        max_cpu_loras: ADAPTERS,
        max_cpu_lora_bytes: None,
        kv_blocks: 4096,
        block_size: 16,
        max_num_seqs: 32,
        max_batched_tokens: 512,
        max_waiting: 4096,
        max_pinned: None,
        prefix_caching,
        fair_admission: true,
        eviction: Default::default(),
        memory_budget_bytes: None,
    };
    let mut e = Engine::load_cpu(model, settings).expect("the stand-in model");
    let aid = standin::id;
    standin::register(&mut e, dirs);
    for i in 0..dirs.len() {
        e.prefetch(aid(i));
    }
    while e
        .stats()
        .adapters
        .iter()
        .any(|a| a.residency == lorafleet_engine::Residency::Loading)
    {
        e.pool().poll_loads(Some(Duration::from_millis(50)));
    }
    let system: Vec<u32> = (0..SYSTEM)
        .map(|k| ((k * 7919) % 31_000 + 3) as u32)
        .collect();
    let mut prompt_tokens = 0;
    let started = Instant::now();
    for r in 0..ADAPTERS * PER_ADAPTER {
        let mut ids = system.clone();
        ids.extend((0..QUESTION).map(|k| ((r * 131 + k * 17) % 31_000 + 3) as u32));
        prompt_tokens += ids.len();
        e.submit(Request {
            id: format!("r{r}").into(),
            adapter: Some(aid(r % ADAPTERS)),
            prompt: Prompt::TokenIds(ids),
            params: Sampling {
                max_tokens: NEW,
                temperature: 0.0,
                ignore_eos: true,
                ..Default::default()
            }
            .validate()
            .unwrap(),
        })
        .expect("accepted");
    }
    let (mut generated, mut cached) = (0, 0);
    let mut ttft = Vec::new();
    while e.has_work() {
        for (id, event) in e.step().expect("a step") {
            match event {
                Event::Delta { token_ids, .. } => generated += token_ids.len(),
                Event::Finished(f) => {
                    ttft.push(f.time_to_first_token);
                    cached += f.cached_tokens;
                }
                Event::Failed(err) => panic!("{id}: {err}"),
                Event::PromptLogprobs(_) => {}
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    ttft.sort();
    let at = |q: f64| ttft[((ttft.len() as f64 * q) as usize).min(ttft.len() - 1)];
    eprintln!(
        "prefix cache {}: {seconds:.1} s",
        if prefix_caching { "on" } else { "off" }
    );
    Run {
        p50: at(0.5),
        p99: at(0.99),
        generated,
        prompt: prompt_tokens,
        cached,
        seconds,
    }
}
