//! Routing simulation: Zipf traffic over 1,000 adapters on 8 simulated
//! workers with 16 device slots each, under four policies. Prints a table.
//! Run with:
//!
//!     cargo bench -p lorafleet-gateway --bench routing_sim
//!
//! The workers are simulated (no model runs): each holds an LRU of 16
//! device slots and an LRU host cache of 64. Time advances in ticks; 4
//! requests arrive per tick and each holds its worker for 16 ticks, so the
//! fleet carries 64 requests at once (8 per worker). A request whose adapter
//! is not in the chosen worker's device slots costs one adapter load.
//! "Our policy" is `lorafleet_gateway::router::policy::Router`, the code the gateway
//! runs, fed the same view the fleet gives it (load = requests in flight,
//! residency from the worker's slots).

use std::collections::VecDeque;

use lorafleet_gateway::router::policy::{Policy, Router, Tier, WorkerView};

const ADAPTERS: usize = 1000;
const WORKERS: usize = 8;
const SLOTS: usize = 16;
const HOST_SLOTS: usize = 64;
const ARRIVALS_PER_TICK: usize = 4;
const HOLD_TICKS: usize = 16;
const TICKS: usize = 25_000;
const WARMUP_TICKS: usize = 2_500;
const ZIPF_S: f64 = 1.0;

/// splitmix64: a small, seeded, deterministic generator.
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// An LRU of adapter ids, most recent last.
struct Lru {
    cap: usize,
    items: VecDeque<u64>,
}

impl Lru {
    fn contains(&self, id: u64) -> bool {
        self.items.contains(&id)
    }
    /// Touches `id`; returns the evicted id, if any.
    fn touch(&mut self, id: u64) -> Option<u64> {
        if let Some(p) = self.items.iter().position(|&x| x == id) {
            self.items.remove(p);
            self.items.push_back(id);
            return None;
        }
        self.items.push_back(id);
        (self.items.len() > self.cap).then(|| self.items.pop_front().unwrap())
    }
}

struct Worker {
    device: Lru,
    host: Lru,
    /// Tick at which each in-flight request ends.
    running: Vec<usize>,
    served: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Sim {
    RoundRobin,
    LeastLoaded,
    PlainHash,
    Ours,
}

struct Outcome {
    requests: u64,
    device_hits: u64,
    loads: u64,
    max_over_mean_served: f64,
    peak_over_mean_load: f64,
}

fn simulate(policy: Sim) -> Outcome {
    // Zipf CDF over adapter ranks 1..=ADAPTERS.
    let weights: Vec<f64> = (1..=ADAPTERS)
        .map(|k| 1.0 / (k as f64).powf(ZIPF_S))
        .collect();
    let total: f64 = weights.iter().sum();
    let mut cdf = Vec::with_capacity(ADAPTERS);
    let mut acc = 0.0;
    for w in &weights {
        acc += w / total;
        cdf.push(acc);
    }
    let mut rng = Rng(7);
    let ids: Vec<String> = (0..WORKERS).map(|i| format!("worker-{i}")).collect();
    let mut router = Router::new(Policy::default());
    router.set_workers(&ids.iter().map(String::as_str).collect::<Vec<_>>());
    let mut workers: Vec<Worker> = (0..WORKERS)
        .map(|_| Worker {
            device: Lru {
                cap: SLOTS,
                items: VecDeque::new(),
            },
            host: Lru {
                cap: HOST_SLOTS,
                items: VecDeque::new(),
            },
            running: Vec::new(),
            served: 0,
        })
        .collect();
    // Requests in flight per adapter (what the gateway tracks).
    let mut adapter_running: Vec<Vec<usize>> = vec![Vec::new(); ADAPTERS + 1];
    let mut rr = 0usize;
    let (mut requests, mut hits, mut loads) = (0u64, 0u64, 0u64);
    let mut peak_ratio_sum = 0.0;
    let mut peak_samples = 0u64;
    for tick in 0..TICKS {
        for w in &mut workers {
            w.running.retain(|&end| end > tick);
        }
        for ends in adapter_running.iter_mut() {
            ends.retain(|&end| end > tick);
        }
        for _ in 0..ARRIVALS_PER_TICK {
            let u = rng.next_f64();
            let adapter = cdf.partition_point(|&c| c < u).min(ADAPTERS - 1) as u64 + 1;
            let w = match policy {
                Sim::RoundRobin => {
                    rr = (rr + 1) % WORKERS;
                    rr
                }
                Sim::LeastLoaded => (0..WORKERS)
                    .min_by_key(|&i| (workers[i].running.len(), i))
                    .unwrap(),
                Sim::PlainHash => router.ring_order(adapter)[0],
                Sim::Ours => {
                    let views: Vec<WorkerView<'_>> = workers
                        .iter()
                        .zip(&ids)
                        .map(|(w, id)| WorkerView {
                            id,
                            load: w.running.len() as u32,
                            residency: if w.device.contains(adapter) {
                                Tier::Device
                            } else if w.host.contains(adapter) {
                                Tier::Host
                            } else {
                                Tier::Absent
                            },
                            eligible: true,
                        })
                        .collect();
                    let in_flight = adapter_running[adapter as usize].len() as u32;
                    router.choose(adapter, in_flight, &views).unwrap().order[0]
                }
            };
            let worker = &mut workers[w];
            let measured = tick >= WARMUP_TICKS;
            if worker.device.contains(adapter) {
                if measured {
                    hits += 1;
                }
            } else if measured {
                loads += 1;
            }
            worker.device.touch(adapter);
            worker.host.touch(adapter);
            worker.running.push(tick + HOLD_TICKS);
            adapter_running[adapter as usize].push(tick + HOLD_TICKS);
            if measured {
                worker.served += 1;
                requests += 1;
            }
        }
        if tick >= WARMUP_TICKS {
            let loads_now: Vec<usize> = workers.iter().map(|w| w.running.len()).collect();
            let mean = loads_now.iter().sum::<usize>() as f64 / WORKERS as f64;
            let max = *loads_now.iter().max().unwrap() as f64;
            if mean > 0.0 {
                peak_ratio_sum += max / mean;
                peak_samples += 1;
            }
        }
    }
    let served: Vec<u64> = workers.iter().map(|w| w.served).collect();
    let mean = served.iter().sum::<u64>() as f64 / WORKERS as f64;
    Outcome {
        requests,
        device_hits: hits,
        loads,
        max_over_mean_served: *served.iter().max().unwrap() as f64 / mean,
        peak_over_mean_load: peak_ratio_sum / peak_samples as f64,
    }
}

fn main() {
    println!(
        "routing simulation: Zipf(s={ZIPF_S}) over {ADAPTERS} adapters, {WORKERS} workers x {SLOTS} device slots \
         (+{HOST_SLOTS} host), {ARRIVALS_PER_TICK} arrivals/tick, {HOLD_TICKS}-tick requests, \
         {} measured ticks",
        TICKS - WARMUP_TICKS
    );
    println!(
        "| policy | requests | device-hit rate | adapter loads | loads vs least-loaded | max/mean requests served | mean of (max/mean in flight) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let baseline = simulate(Sim::LeastLoaded).loads as f64;
    for (name, p) in [
        ("round-robin", Sim::RoundRobin),
        ("least-loaded", Sim::LeastLoaded),
        ("consistent hashing", Sim::PlainHash),
        (
            "lorafleet (bounded load + affinity + hot replicas)",
            Sim::Ours,
        ),
    ] {
        let o = simulate(p);
        println!(
            "| {name} | {} | {:.1}% | {} | {:+.1}% | {:.3} | {:.3} |",
            o.requests,
            o.device_hits as f64 / o.requests as f64 * 100.0,
            o.loads,
            (o.loads as f64 / baseline - 1.0) * 100.0,
            o.max_over_mean_served,
            o.peak_over_mean_load,
        );
    }
}
