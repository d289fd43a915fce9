//! Routing simulation: Zipf traffic over many adapters on simulated
//! workers, under the baselines, the peers' published policies and ours.
//! Prints a table per fleet. Run with:
//!
//!     cargo bench -p lorafleet-gateway --bench routing_sim
//!
//! `ROUTING_SIM_QUICK=1` runs only the first fleet (8 workers, 1,000
//! adapters, Zipf 1.0), the table BENCHMARKS.md has kept since the first
//! version; `ROUTING_SIM_LOAD_FACTOR=c` runs lorafleet with `--load-factor
//! c` instead of the default 1.25, `ROUTING_SIM_RESIDENT_FACTOR=r` with
//! `--resident-load-factor r` instead of the default 1.45.
//!
//! The workers are SIMULATED (no model runs): each holds an LRU of 16
//! device slots and an LRU host cache of 64. Time advances in ticks; each
//! tick brings half a request per worker, and each request holds its
//! worker for 16 ticks, so every worker carries 8 requests on average. A
//! request whose adapter is not in the chosen worker's device slots costs
//! one adapter load. 100,000 requests are measured per fleet after a
//! warm-up of 10,000.
//!
//! The policies, each fed what its system sees:
//! - round-robin, least-loaded, consistent hashing (the ring owner);
//! - **GIE LoRA affinity**: the Gateway API Inference Extension's
//!   scorers, the LoRA affinity scorer (1.0 where the adapter has requests
//!   running, 0.8 where the worker runs fewer distinct adapters than its
//!   slots, else 0) plus the queue scorer (1 for the least loaded worker,
//!   0 for the most, linear between), weights 1:1, highest total wins
//!   (ties by a seeded random draw);
//! - **llm-d load state**: the adapter's state on each worker (on the GPU
//!   1.0, in CPU memory 0.7, a free GPU slot 0.6, an evictable slot 0.3,
//!   else 0) plus a load scorer (1 − load / the busiest worker's load),
//!   weights 1:1;
//! - **sgl-router bounded consistent hashing**: the first worker clockwise
//!   from the adapter's point whose load stays within 1.25 × the mean
//!   (consistent hashing with bounded loads);
//! - **Dynamo rendezvous (HRW)**: the worker with the highest hash of
//!   (adapter, worker);
//! - **lorafleet**: `lorafleet_gateway::router::policy::Router`, the code
//!   the gateway runs, fed the view the fleet gives it (load = requests in
//!   flight, residency from the worker's slots).

use std::collections::{HashMap, VecDeque};

use lorafleet_gateway::router::policy::{Policy, Router, Tier, WorkerView};

const SLOTS: usize = 16;
const HOST_SLOTS: usize = 64;
const HOLD_TICKS: usize = 16;
const MEASURED: usize = 100_000;
const WARMUP: usize = 10_000;
/// The bound on load the balanced policies keep: c in c × mean.
const BOUND: f64 = 1.25;

/// splitmix64: a small, seeded, deterministic generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }
    fn next_f64(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// An LRU of adapter ids, most recent last.
struct Lru {
    cap: usize,
    items: VecDeque<u64>,
}

impl Lru {
    fn new(cap: usize) -> Lru {
        Lru {
            cap,
            items: VecDeque::with_capacity(cap + 1),
        }
    }
    fn contains(&self, id: u64) -> bool {
        self.items.contains(&id)
    }
    fn touch(&mut self, id: u64) {
        if let Some(p) = self.items.iter().position(|&x| x == id) {
            self.items.remove(p);
        }
        self.items.push_back(id);
        if self.items.len() > self.cap {
            self.items.pop_front();
        }
    }
}

struct Worker {
    device: Lru,
    host: Lru,
    /// (tick it ends, adapter) of each request in flight.
    running: Vec<(usize, u64)>,
    /// Requests in flight per adapter.
    active: HashMap<u64, u32>,
    served: u64,
}

impl Worker {
    fn load(&self) -> u32 {
        self.running.len() as u32
    }
    fn expire(&mut self, tick: usize) {
        let active = &mut self.active;
        self.running.retain(|&(end, a)| {
            let live = end > tick;
            if !live && let Some(n) = active.get_mut(&a) {
                *n -= 1;
                if *n == 0 {
                    active.remove(&a);
                }
            }
            live
        });
    }
    fn tier(&self, adapter: u64) -> Tier {
        if self.device.contains(adapter) {
            Tier::Device
        } else if self.host.contains(adapter) {
            Tier::Host
        } else {
            Tier::Absent
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Sim {
    RoundRobin,
    LeastLoaded,
    PlainHash,
    Gie,
    LlmD,
    BoundedHash,
    Rendezvous,
    Ours,
}

const POLICIES: [(&str, Sim); 8] = [
    ("round-robin", Sim::RoundRobin),
    ("least-loaded", Sim::LeastLoaded),
    ("consistent hashing", Sim::PlainHash),
    ("GIE LoRA affinity + queue", Sim::Gie),
    ("llm-d load state + load", Sim::LlmD),
    ("sgl-router bounded consistent hashing", Sim::BoundedHash),
    ("Dynamo rendezvous (HRW)", Sim::Rendezvous),
    ("lorafleet", Sim::Ours),
];

#[derive(Clone, Copy)]
struct Fleet {
    workers: usize,
    adapters: usize,
    zipf: f64,
}

struct Outcome {
    requests: u64,
    device_hits: u64,
    loads: u64,
    max_over_mean_served: f64,
    peak_over_mean_load: f64,
}

/// The highest score's index; ties by a draw from `rng`.
fn best(scores: &[f64], rng: &mut Rng) -> usize {
    let top = scores.iter().copied().fold(f64::MIN, f64::max);
    let tied: Vec<usize> = (0..scores.len())
        .filter(|&i| (scores[i] - top).abs() < 1e-12)
        .collect();
    tied[(rng.next() % tied.len() as u64) as usize]
}

/// The policies' own state: round-robin's position and the draws that
/// break score ties.
struct Picks {
    rr: usize,
    rng: Rng,
}

fn choose(
    policy: Sim,
    adapter: u64,
    workers: &[Worker],
    ids: &[String],
    router: &Router,
    picks: &mut Picks,
) -> usize {
    let n = workers.len();
    let (rr, rng) = (&mut picks.rr, &mut picks.rng);
    match policy {
        Sim::RoundRobin => {
            *rr = (*rr + 1) % n;
            *rr
        }
        Sim::LeastLoaded => (0..n).min_by_key(|&i| (workers[i].load(), i)).unwrap(),
        Sim::PlainHash => router.ring_order(adapter)[0],
        Sim::Gie => {
            let (lo, hi) = workers.iter().fold((u32::MAX, 0), |(lo, hi), w| {
                (lo.min(w.load()), hi.max(w.load()))
            });
            let scores: Vec<f64> = workers
                .iter()
                .map(|w| {
                    let affinity = if w.active.contains_key(&adapter) {
                        1.0
                    } else if w.active.len() < SLOTS {
                        0.8
                    } else {
                        0.0
                    };
                    let queue = if hi == lo {
                        1.0
                    } else {
                        f64::from(hi - w.load()) / f64::from(hi - lo)
                    };
                    affinity + queue
                })
                .collect();
            best(&scores, rng)
        }
        Sim::LlmD => {
            let hi = workers.iter().map(Worker::load).max().unwrap_or(0).max(1);
            let scores: Vec<f64> = workers
                .iter()
                .map(|w| {
                    let state = if w.device.contains(adapter) {
                        1.0
                    } else if w.host.contains(adapter) {
                        0.7
                    } else if w.device.items.len() < SLOTS {
                        0.6
                    } else if w.device.items.iter().any(|a| !w.active.contains_key(a)) {
                        0.3
                    } else {
                        0.0
                    };
                    state + 1.0 - f64::from(w.load()) / f64::from(hi)
                })
                .collect();
            best(&scores, rng)
        }
        Sim::BoundedHash => {
            let total: u32 = workers.iter().map(Worker::load).sum();
            let cap = (BOUND * f64::from(total + 1) / n as f64).ceil() as u32;
            let order = router.ring_order(adapter);
            order
                .iter()
                .copied()
                .find(|&i| workers[i].load() < cap)
                .unwrap_or(order[0])
        }
        Sim::Rendezvous => (0..n)
            .max_by_key(|&i| mix(adapter ^ mix(i as u64 + 0x5bd1_e995)))
            .unwrap(),
        Sim::Ours => {
            let views: Vec<WorkerView<'_>> = workers
                .iter()
                .zip(ids)
                .map(|(w, id)| WorkerView {
                    id,
                    load: w.load(),
                    residency: w.tier(adapter),
                    eligible: true,
                })
                .collect();
            router.choose(adapter, &views).unwrap().order[0]
        }
    }
}

/// lorafleet's policy: the gateway's defaults, or `ROUTING_SIM_LOAD_FACTOR`
/// and `ROUTING_SIM_RESIDENT_FACTOR` (the gateway's `--load-factor` and
/// `--resident-load-factor`) to trace its loads against balance.
fn policy_from_env() -> Policy {
    let mut p = Policy::default();
    if let Some(c) = std::env::var("ROUTING_SIM_LOAD_FACTOR")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        p.load_factor = c;
    }
    if let Some(c) = std::env::var("ROUTING_SIM_RESIDENT_FACTOR")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        p.resident_load_factor = c;
    }
    p
}

fn simulate(fleet: Fleet, policy: Sim) -> Outcome {
    // Zipf over adapter ranks; popularity shuffled over the ids.
    let weights: Vec<f64> = (1..=fleet.adapters)
        .map(|k| 1.0 / (k as f64).powf(fleet.zipf))
        .collect();
    let total: f64 = weights.iter().sum();
    let mut cdf = Vec::with_capacity(fleet.adapters);
    let mut acc = 0.0;
    for w in &weights {
        acc += w / total;
        cdf.push(acc);
    }
    let mut rng = Rng(7);
    let mut ids_of_rank: Vec<u64> = (1..=fleet.adapters as u64).collect();
    for i in (1..ids_of_rank.len()).rev() {
        ids_of_rank.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let mut picks = Picks {
        rr: 0,
        rng: Rng(11),
    };
    let ids: Vec<String> = (0..fleet.workers).map(|i| format!("worker-{i}")).collect();
    let mut router = Router::new(policy_from_env());
    router.set_workers(&ids.iter().map(String::as_str).collect::<Vec<_>>());
    let mut workers: Vec<Worker> = (0..fleet.workers)
        .map(|_| Worker {
            device: Lru::new(SLOTS),
            host: Lru::new(HOST_SLOTS),
            running: Vec::new(),
            active: HashMap::new(),
            served: 0,
        })
        .collect();
    let (mut requests, mut hits, mut loads) = (0u64, 0u64, 0u64);
    let (mut peak_ratio_sum, mut peak_samples) = (0.0, 0u64);
    // Half a request per worker per tick: 8 in flight per worker.
    let per_tick = (fleet.workers / 2).max(1);
    let mut arrived = 0usize;
    let mut tick = 0usize;
    while arrived < WARMUP + MEASURED {
        for w in &mut workers {
            w.expire(tick);
        }
        for _ in 0..per_tick {
            let u = rng.next_f64();
            let rank = cdf.partition_point(|&c| c < u).min(fleet.adapters - 1);
            let adapter = ids_of_rank[rank];
            let w = choose(policy, adapter, &workers, &ids, &router, &mut picks);
            let measured = arrived >= WARMUP;
            let worker = &mut workers[w];
            if measured {
                if worker.device.contains(adapter) {
                    hits += 1;
                } else {
                    loads += 1;
                }
                worker.served += 1;
                requests += 1;
            }
            worker.device.touch(adapter);
            worker.host.touch(adapter);
            worker.running.push((tick + HOLD_TICKS, adapter));
            *worker.active.entry(adapter).or_default() += 1;
            arrived += 1;
        }
        if arrived > WARMUP {
            let now: Vec<u32> = workers.iter().map(Worker::load).collect();
            let mean = f64::from(now.iter().sum::<u32>()) / fleet.workers as f64;
            if mean > 0.0 {
                peak_ratio_sum += f64::from(*now.iter().max().unwrap()) / mean;
                peak_samples += 1;
            }
        }
        tick += 1;
    }
    let served: Vec<u64> = workers.iter().map(|w| w.served).collect();
    let mean = served.iter().sum::<u64>() as f64 / fleet.workers as f64;
    Outcome {
        requests,
        device_hits: hits,
        loads,
        max_over_mean_served: *served.iter().max().unwrap() as f64 / mean,
        peak_over_mean_load: peak_ratio_sum / peak_samples as f64,
    }
}

#[path = "support/svg.rs"]
mod svg;

/// The plots a full run writes, linked from BENCHMARKS.md: adapter loads,
/// and the balance that buys them.
const PLOTS: [&str; 2] = [
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/plots/routing_sim_loads.svg"
    ),
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/plots/routing_sim_balance.svg"
    ),
];

fn main() {
    let quick = std::env::var_os("ROUTING_SIM_QUICK").is_some();
    let mut fleets = Vec::new();
    for workers in [8, 64] {
        for adapters in [1_000, 100_000] {
            for zipf in [1.0, 0.8, 1.2] {
                fleets.push(Fleet {
                    workers,
                    adapters,
                    zipf,
                });
            }
        }
    }
    if quick {
        fleets.truncate(1);
    }
    let mut summary = Vec::new();
    let series = || {
        POLICIES
            .iter()
            .map(|(name, _)| (name.to_string(), Vec::new()))
            .collect()
    };
    let mut chart = svg::Bars {
        title: "Adapter loads per 100 requests, by policy (SIMULATED workers; lower is better)",
        y_label: "adapter loads per 100 requests",
        groups: Vec::new(),
        series: series(),
    };
    let mut balance = svg::Bars {
        title: "Max/mean requests served per worker, by policy (SIMULATED workers; 1 is even)",
        y_label: "max / mean requests served",
        groups: Vec::new(),
        series: series(),
    };
    for fleet in fleets {
        println!(
            "\nrouting simulation (SIMULATED workers): Zipf(s={}) over {} adapters, {} workers x \
             {SLOTS} device slots (+{HOST_SLOTS} host), {HOLD_TICKS}-tick requests, 8 in flight \
             per worker, {MEASURED} measured requests",
            fleet.zipf, fleet.adapters, fleet.workers
        );
        println!(
            "| policy | device-hit rate | adapter loads | loads vs lorafleet | max/mean requests served | mean of (max/mean in flight) |"
        );
        println!("|---|---:|---:|---:|---:|---:|");
        let outcomes: Vec<(&str, Outcome)> = POLICIES
            .iter()
            .map(|&(name, p)| (name, simulate(fleet, p)))
            .collect();
        chart.groups.push(format!(
            "{} workers, {}K, s={}",
            fleet.workers,
            fleet.adapters / 1000,
            fleet.zipf
        ));
        balance
            .groups
            .push(chart.groups.last().cloned().unwrap_or_default());
        for (i, (_, o)) in outcomes.iter().enumerate() {
            chart.series[i]
                .1
                .push(o.loads as f64 / o.requests as f64 * 100.0);
            balance.series[i].1.push(o.max_over_mean_served);
        }
        let ours = outcomes.last().expect("lorafleet runs last").1.loads as f64;
        for (name, o) in &outcomes {
            println!(
                "| {name} | {:.1}% | {} | {:+.1}% | {:.3} | {:.3} |",
                o.device_hits as f64 / o.requests as f64 * 100.0,
                o.loads,
                (o.loads as f64 / ours - 1.0) * 100.0,
                o.max_over_mean_served,
                o.peak_over_mean_load,
            );
        }
        // Against the peers whose balance stays within the bound: the
        // policies that load fewer than lorafleet while they do.
        let (_, us) = outcomes.last().expect("lorafleet runs last");
        let beaten_by: Vec<&str> = outcomes[3..7]
            .iter()
            .filter(|(_, o)| o.loads <= us.loads && o.max_over_mean_served <= BOUND)
            .map(|(name, _)| *name)
            .collect();
        summary.push((fleet, us.max_over_mean_served, beaten_by));
    }
    if !quick {
        chart.write(std::path::Path::new(PLOTS[0]));
        balance.write(std::path::Path::new(PLOTS[1]));
    }
    println!(
        "\n| workers | adapters | Zipf s | lorafleet max/mean | peers within {BOUND} with no more loads |"
    );
    println!("|---:|---:|---:|---:|---|");
    for (f, balance, beaten_by) in summary {
        println!(
            "| {} | {} | {} | {balance:.3} | {} |",
            f.workers,
            f.adapters,
            f.zipf,
            if beaten_by.is_empty() {
                "none".to_owned()
            } else {
                beaten_by.join(", ")
            }
        );
    }
}
