//! Device loads under eviction by value against LRU, on Zipf traffic:
//! the real `AdapterPool` with the CPU backend on the fixture model, N
//! adapters (all in the host tier), 32 device slots, requests drawn from a
//! Zipf distribution over the adapters, each holding its adapter's slot
//! (a lease) for the next HOLD arrivals as a running sequence would, and
//! waiting in arrival order when no slot can be had. The counts do not
//! depend on the machine. Run with:
//!
//!     cargo bench -p lorafleet-engine --bench eviction
//!
//! `LORAFLEET_BENCH_ARRIVALS` (default 20000) sets the trace's length.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::VecDeque;

use lorafleet_engine::backend::BackendShape;
use lorafleet_engine::backend::cpu::CpuBackend;
use lorafleet_engine::eviction::EvictionPolicy;
use lorafleet_engine::pool::{AdapterPool, Residency};
use lorafleet_engine::{AdapterId, AdapterSource};

const SLOTS: usize = 32;
/// Arrivals a request keeps its slot for: about a decode batch's worth of
/// requests running at once.
const HOLD: u64 = 16;

/// splitmix64: the same trace for both policies.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Adapter indices 0..n, index k drawn with weight 1 / (k + 1)^s.
fn zipf_trace(n: usize, s: f64, len: usize, seed: u64) -> Vec<usize> {
    let weights: Vec<f64> = (0..n).map(|k| 1.0 / ((k + 1) as f64).powf(s)).collect();
    let total: f64 = weights.iter().sum();
    let mut cdf = Vec::with_capacity(n);
    let mut acc = 0.0;
    for w in &weights {
        acc += w / total;
        cdf.push(acc);
    }
    let mut rng = Rng(seed);
    // Popularity is not the order of registration: shuffle the ranks.
    let mut rank_to_adapter: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        rank_to_adapter.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    (0..len)
        .map(|_| {
            let u = rng.unit();
            let rank = cdf.partition_point(|&c| c < u).min(n - 1);
            rank_to_adapter[rank]
        })
        .collect()
}

fn id(k: usize) -> AdapterId {
    AdapterId::new(k as u64 + 1).expect("ids start at 1")
}

/// Device loads for `trace` over `n` adapters under `policy`.
fn device_loads(n: usize, trace: &[usize], policy: EvictionPolicy) -> (u64, u64) {
    let model = "llama-gqa";
    let dir = common::model_dir(model);
    let config = lorafleet_engine::model::ModelConfig::from_dir(&dir).unwrap();
    let mut backend = CpuBackend::load(
        &dir,
        &config,
        BackendShape {
            slots: SLOTS,
            max_lora_rank: 16,
            kv_blocks: 4,
            block_size: 4,
            ring_len: 0,
            ring_blocks: 0,
        },
    )
    .unwrap();
    let mut pool = AdapterPool::new(
        config,
        16,
        SLOTS,
        n,
        lorafleet_engine::pool::BaseHash::parse(&"0".repeat(64)).unwrap(),
    );
    pool.set_eviction(policy);
    let name = common::adapter_names(model)[0].clone();
    let source = AdapterSource {
        name: name.clone(),
        dir: common::adapter_dir(model, &name),
        declared_base_hash: None,
        digest: None,
    };
    for k in 0..n {
        pool.register(id(k), source.clone()).unwrap();
        pool.request_load(id(k));
    }
    while (0..n).any(|k| pool.residency(id(k)) != Residency::Host) {
        pool.poll_loads(Some(std::time::Duration::from_millis(50)));
    }
    let before = pool.counters();
    let mut running: VecDeque<(u64, lorafleet_engine::pool::Lease)> = VecDeque::new();
    let mut waiting: VecDeque<AdapterId> = VecDeque::new();
    let mut max_waiting = 0;
    for (t, &k) in trace.iter().enumerate() {
        let t = t as u64;
        while running.front().is_some_and(|(end, _)| *end <= t) {
            running.pop_front();
        }
        pool.on_arrival(id(k));
        waiting.push_back(id(k));
        // Admit in arrival order; a request that gets no slot waits, and
        // so does everyone behind it (no overtaking, as LRU's baseline).
        while let Some(&a) = waiting.front() {
            match pool.ensure_device(a, &[], &mut backend).unwrap() {
                Some(_) => {
                    waiting.pop_front();
                    let lease = pool.lease(a);
                    pool.on_dequeue(a);
                    running.push_back((t + HOLD, lease));
                }
                None => break,
            }
        }
        max_waiting = max_waiting.max(waiting.len());
    }
    let after = pool.counters();
    (after.device_loads - before.device_loads, max_waiting as u64)
}

fn main() {
    let arrivals: usize = std::env::var("LORAFLEET_BENCH_ARRIVALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    println!(
        "device loads, LRU against eviction by value: {arrivals} Zipf arrivals, {SLOTS} device \
         slots, each request holding its slot for {HOLD} arrivals (fixture llama-gqa, CPU backend)"
    );
    println!(
        "| adapters | Zipf s | LRU loads | value loads | value / LRU | LRU hit rate | value hit rate |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for n in [64, 256, 1000] {
        for s in [0.8, 1.0, 1.2] {
            let trace = zipf_trace(n, s, arrivals, 0x5EED ^ n as u64);
            let (lru, _) = device_loads(n, &trace, EvictionPolicy::Lru);
            let (value, _) = device_loads(n, &trace, EvictionPolicy::Value);
            let hit = |loads: u64| 1.0 - loads as f64 / arrivals as f64;
            println!(
                "| {n} | {s} | {lru} | {value} | {:.3} | {:.1}% | {:.1}% |",
                value as f64 / lru as f64,
                hit(lru) * 100.0,
                hit(value) * 100.0
            );
        }
    }
}
