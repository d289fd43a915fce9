//! The grouped LoRA kernels on the GPU, for decode shapes: shrink + expand
//! time for one 4096 → 4096 projection at batch 1 to 256, rank 8, 16 and
//! 64, with 1 to 64 distinct adapters in the batch. Each row compares the
//! grouped launch pair with
//! - the memory-bandwidth floor: the bytes the pair must move (every
//!   adapter's A and B once, the input once, the output read and written)
//!   at the device's measured copy bandwidth;
//! - one launch pair per adapter, as a loop over adapters would run.
//!
//! Each pair is timed as a captured CUDA graph's replays with device
//! events (a decode step replays its graph the same way), so the host's
//! launch cost is out of the numbers. "fixed µs" is the same pair with
//! every slot at rank 0, where both kernels return at once: the cost no
//! amount of bandwidth removes.
//!
//! Targets: within 2x of the floor at batch >= 32; at least 5x faster
//! than one launch per adapter at 32 adapters.
//!
//! Run on a machine with an NVIDIA GPU:
//!   cargo bench -p lorafleet-engine --bench cuda_lora
//! (or `deploy/gpu-check.sh`, which builds it here and runs it there).

use lorafleet_engine::backend::Segment;
use lorafleet_engine::backend::cuda::testing::LoraBench;

const HIDDEN: usize = 4096;
const BATCHES: [usize; 7] = [1, 4, 16, 32, 64, 128, 256];
const RANKS: [usize; 3] = [8, 16, 64];
const ADAPTERS: [usize; 4] = [1, 8, 32, 64];

/// `n` tokens spread round-robin over `adapters` slots, then grouped into
/// contiguous segments as the engine orders a step.
fn segments(n: usize, adapters: usize) -> Vec<Segment> {
    let mut slot_of: Vec<usize> = (0..n).map(|t| t % adapters).collect();
    slot_of.sort_unstable();
    let mut out: Vec<Segment> = Vec::new();
    for (t, &slot) in slot_of.iter().enumerate() {
        match out.last_mut() {
            Some(last) if last.slot == slot => last.end = t + 1,
            _ => out.push(Segment {
                slot,
                start: t,
                end: t + 1,
            }),
        }
    }
    out
}

fn main() {
    if let Err(e) = lorafleet_engine::backend::cuda::probe() {
        eprintln!("cuda_lora needs a GPU: {e}");
        std::process::exit(2);
    }
    let max_batch = *BATCHES.iter().max().unwrap();
    let max_adapters = *ADAPTERS.iter().max().unwrap();
    let mut bandwidth = None;
    let mut misses = Vec::new();
    println!(
        "| rank | batch | adapters | grouped µs | floor µs | x floor | fixed µs | per-adapter µs | speedup |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for rank in RANKS {
        let mut bench = LoraBench::new(HIDDEN, HIDDEN, max_adapters, rank, rank, max_batch)
            .unwrap_or_else(|e| panic!("{e}"));
        let bw = *bandwidth.get_or_insert_with(|| {
            let bw = bench.copy_bandwidth(1 << 30, 20).unwrap();
            eprintln!("device: {}", bench.device_name());
            eprintln!("device-to-device copy bandwidth: {bw:.0} GB/s");
            bw
        });
        for batch in BATCHES {
            for adapters in ADAPTERS {
                if adapters > batch {
                    continue;
                }
                let segs = segments(batch, adapters);
                let grouped = bench.time(&segs, false).unwrap();
                let looped = bench.time(&segs, true).unwrap();
                bench.set_rank(0).unwrap();
                let fixed = bench.time(&segs, false).unwrap();
                bench.set_rank(rank).unwrap();
                let bytes = 4 * (adapters * rank * (HIDDEN + HIDDEN) + batch * HIDDEN * 3);
                let floor = bytes as f64 / (bw * 1e9) * 1e6;
                let x_floor = grouped / floor;
                let speedup = looped / grouped;
                println!(
                    "| {rank} | {batch} | {adapters} | {grouped:.1} | {floor:.1} | {x_floor:.2} | {fixed:.1} | {looped:.1} | {speedup:.1}x |"
                );
                if batch >= 32 && x_floor > 2.0 {
                    misses.push(format!(
                        "rank {rank} batch {batch} adapters {adapters}: {x_floor:.2}x the floor"
                    ));
                }
                if adapters == 32 && speedup < 5.0 {
                    misses.push(format!(
                        "rank {rank} batch {batch} adapters 32: only {speedup:.1}x over per-adapter launches"
                    ));
                }
            }
        }
    }
    if misses.is_empty() {
        println!("\nall targets met");
    } else {
        println!("\ntargets missed:");
        for m in misses {
            println!("- {m}");
        }
    }
}
