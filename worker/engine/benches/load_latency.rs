//! Benchmark: time to first token by where a request's adapter is when it
//! arrives (a device slot, the host tier, or only on disk), on the STAND-IN
//! ~100M-parameter Llama with rank-16 adapters. Prints a table. Run with:
//!
//!     cargo bench -p lorafleet-engine --bench load_latency
//!
//! One request at a time (a 64-token prompt, one new token, greedy) on an
//! otherwise idle engine, so the table shows the load alone: a device hit
//! runs at once; a host-tier arrival first copies the adapter into a slot;
//! a disk arrival first reads it into the host tier (on the loader thread)
//! and then copies it. `LORAFLEET_BENCH_ROUNDS` (default 7) arrivals per
//! tier, each on an adapter put in that tier just before; the median and
//! the worst are reported, with the median's ratio to a device hit's.
//! Prefix caching is off, so no arrival is helped by an earlier one.

mod standin;

use std::time::{Duration, Instant};

use lorafleet_engine::{
    AdapterId, Engine, EngineSettings, Event, Prompt, Request, Residency, Sampling,
};

fn main() {
    let rounds: usize = std::env::var("LORAFLEET_BENCH_ROUNDS")
        .map(|v| v.parse().expect("LORAFLEET_BENCH_ROUNDS: a count"))
        .unwrap_or(7)
        .max(1);
    let model = standin::model();
    let dirs = standin::adapters(3);
    let settings = EngineSettings {
        max_loras: 4,
        max_lora_rank: 16,
        max_cpu_loras: 8,
        prefix_caching: false,
        ..Default::default()
    };
    let mut e = Engine::load_cpu(&model, settings).expect("the stand-in model");
    let aid = standin::id;
    standin::register(&mut e, &dirs);
    println!(
        "time to first token by the adapter's tier on arrival, STAND-IN ~100M Llama (h={}, L={}), rank {}, 64-token prompt, {rounds} arrivals per tier, {} threads",
        standin::HIDDEN,
        standin::LAYERS,
        standin::RANK,
        rayon::current_num_threads()
    );
    // A warm-up request, not counted.
    ttft(&mut e, aid(0), 0, None);
    let mut results: Vec<(&str, Vec<Duration>)> = Vec::new();
    let mut n = 1;
    for (tier, adapter) in [("device", 0), ("host", 1), ("disk", 2)] {
        let id = aid(adapter);
        let mut times = Vec::new();
        for _ in 0..rounds {
            // Put the adapter in the tier, then let the engine settle.
            e.unload_adapter(id).expect("unload");
            settle(&mut e);
            match tier {
                "device" => {
                    e.prefetch(id);
                    wait_for(&mut e, id, Residency::Host);
                    e.promote(id).expect("a free slot");
                    wait_for(&mut e, id, Residency::Device);
                }
                "host" => {
                    e.prefetch(id);
                    wait_for(&mut e, id, Residency::Host);
                }
                _ => {}
            }
            let arrived = match tier {
                "device" => Residency::Device,
                "host" => Residency::Host,
                _ => Residency::NotLoaded,
            };
            times.push(ttft(&mut e, id, n, Some(arrived)));
            n += 1;
        }
        times.sort();
        results.push((tier, times));
    }
    let median = |v: &[Duration]| v[v.len() / 2];
    let device = median(&results[0].1);
    println!("| adapter on arrival | TTFT median | TTFT worst | median vs a device hit |");
    println!("|---|---:|---:|---:|");
    for (tier, times) in &results {
        println!(
            "| {tier} | {:.1} ms | {:.1} ms | {:.2}x |",
            median(times).as_secs_f64() * 1e3,
            times.last().unwrap().as_secs_f64() * 1e3,
            median(times).as_secs_f64() / device.as_secs_f64()
        );
    }
}

fn residency(e: &Engine, id: AdapterId) -> Residency {
    e.stats()
        .adapters
        .iter()
        .find(|a| a.id == id)
        .map_or(Residency::NotLoaded, |a| a.residency)
}

fn wait_for(e: &mut Engine, id: AdapterId, want: Residency) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while residency(e, id) != want {
        assert!(
            Instant::now() < deadline,
            "adapter {id} never reached {want:?}"
        );
        e.pool().poll_loads(Some(Duration::from_millis(5)));
        e.step().expect("a step");
    }
}

fn settle(e: &mut Engine) {
    for _ in 0..3 {
        e.step().expect("a step");
    }
}

/// From submit to the first token of one request on `adapter`, which the
/// engine must report as having been in the tier `arrived` on arrival.
fn ttft(e: &mut Engine, adapter: AdapterId, n: usize, arrived: Option<Residency>) -> Duration {
    let prompt: Vec<u32> = (0..64)
        .map(|k| ((n * 977 + k * 31) % 31_000 + 3) as u32)
        .collect();
    let started = Instant::now();
    e.submit(Request {
        id: format!("t{n}").into(),
        adapter: Some(adapter),
        prompt: Prompt::TokenIds(prompt),
        params: Sampling {
            max_tokens: 1,
            temperature: 0.0,
            ignore_eos: true,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    })
    .expect("accepted");
    let mut first = None;
    while e.has_work() {
        for (_, event) in e.step().expect("a step") {
            match event {
                Event::Delta { .. } if first.is_none() => first = Some(started.elapsed()),
                Event::Finished(f) => {
                    if let Some(want) = arrived {
                        assert_eq!(f.residency, Some(want), "the tier on arrival");
                    }
                }
                Event::Failed(err) => panic!("{err}"),
                Event::Delta { .. } | Event::PromptLogprobs(_) => {}
            }
        }
    }
    first.expect("a first token")
}
