//! Benchmark: one tenant floods the engine; does another still get its
//! first tokens? Throughput and each tenant's time to first token with
//! fair admission on and off, on the STAND-IN ~100M-parameter Llama (base
//! model). Prints a table. Run with:
//!
//!     cargo bench -p lorafleet-engine --bench fairness
//!
//! Tenant A submits 160 requests, then tenant B 16, all at once (32-token
//! prompts, 16 new tokens, greedy), as one continuous batch of up to 16
//! sequences. TTFT is from submission.

mod standin;

use std::time::{Duration, Instant};

use lorafleet_engine::{Engine, EngineSettings, Event, Fairness, Prompt, Request, Sampling};

const A: usize = 160;
const B: usize = 16;

fn main() {
    let model = standin::model();
    println!(
        "fair admission, STAND-IN ~100M Llama (h={}, L={}), tenant A {A} requests then tenant B {B}, 32-token prompts, 16 new tokens, 16 sequences a step, {} threads",
        standin::HIDDEN,
        standin::LAYERS,
        rayon::current_num_threads()
    );
    println!(
        "| fair admission | generated tokens/s | A's TTFT p50 | B's TTFT p50 | B's TTFT p99 | wall s |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for fair in [false, true] {
        let r = run(&model, fair);
        println!(
            "| {} | {:.1} | {:.0} ms | {:.0} ms | {:.0} ms | {:.1} |",
            if fair { "on" } else { "off" },
            r.generated as f64 / r.seconds,
            at(&r.a, 0.5).as_secs_f64() * 1e3,
            at(&r.b, 0.5).as_secs_f64() * 1e3,
            at(&r.b, 0.99).as_secs_f64() * 1e3,
            r.seconds
        );
    }
}

struct Run {
    a: Vec<Duration>,
    b: Vec<Duration>,
    generated: usize,
    seconds: f64,
}

fn at(v: &[Duration], q: f64) -> Duration {
    v[((v.len() as f64 * q) as usize).min(v.len() - 1)]
}

fn run(model: &std::path::Path, fair_admission: bool) -> Run {
    let settings = EngineSettings {
        max_num_seqs: 16,
        max_batched_tokens: 512,
        fair_admission,
        ..Default::default()
    };
    let mut e = Engine::load_cpu(model, settings).expect("the stand-in model");
    let request = |id: String, i: usize| Request {
        id: id.into(),
        adapter: None,
        prompt: Prompt::TokenIds(
            (0..32)
                .map(|k| ((i * 131 + k * 17) % 31_000 + 3) as u32)
                .collect(),
        ),
        params: Sampling {
            max_tokens: 16,
            temperature: 0.0,
            ignore_eos: true,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    };
    let share = |key: &str| Fairness {
        key: key.into(),
        weight: 1.0,
    };
    let started = Instant::now();
    for i in 0..A {
        e.submit_fair(request(format!("a{i}"), i), share("a"))
            .expect("accepted");
    }
    for i in 0..B {
        e.submit_fair(request(format!("b{i}"), A + i), share("b"))
            .expect("accepted");
    }
    let (mut a, mut b, mut generated) = (Vec::new(), Vec::new(), 0);
    let mut seen = std::collections::HashSet::new();
    while e.has_work() {
        for (id, event) in e.step().expect("a step") {
            if let Event::Delta { token_ids, .. } = event {
                generated += token_ids.len();
                if seen.insert(id.clone()) {
                    if id.starts_with('a') {
                        a.push(started.elapsed());
                    } else {
                        b.push(started.elapsed());
                    }
                }
            }
        }
    }
    a.sort();
    b.sort();
    Run {
        a,
        b,
        generated,
        seconds: started.elapsed().as_secs_f64(),
    }
}
