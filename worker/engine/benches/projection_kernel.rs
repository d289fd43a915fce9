//! Benchmark: the dense projection kernel (`PackedLinear::forward`) at the
//! decode shapes of the STAND-IN ~100M Llama, in GFLOP/s. Prints a table.
//!
//!     cargo bench -p lorafleet-engine --bench projection_kernel

use std::time::Instant;

use lorafleet_engine::backend::cpu::amx;
use lorafleet_engine::backend::cpu::panels::{Kernel, PackedLinear};

fn random(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

const ROUNDS: usize = 5;

fn main() {
    println!(
        "projection kernel {:?}, bf16 on AMX tiles: {}, {} threads",
        Kernel::detect(),
        amx::available(),
        rayon::current_num_threads()
    );
    println!("| tokens | fan_in | fan_out | dtype | weights | µs per call | GFLOP/s |");
    println!("|---:|---:|---:|---|---|---:|---:|");
    for &(n, fan_in, fan_out) in &[
        (32, 768, 768),
        (32, 768, 256),
        (32, 768, 2048),
        (32, 2048, 768),
        (32, 768, 32000),
        (8, 768, 768),
        (1, 768, 768),
        (256, 768, 2048),
        (256, 2048, 768),
    ] {
        for dtype in ["f32", "bf16"] {
            let w = random(1, fan_in * fan_out);
            let bits: Vec<u16> = w
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_bits())
                .collect();
            let bytes = if dtype == "f32" { 4 } else { 2 };
            // "cold": enough copies that each call's weights come from memory,
            // as in a decode step over a model larger than the caches.
            let copies = (256 << 20) / (w.len() * bytes) + 1;
            let lins: Vec<PackedLinear> = (0..copies)
                .map(|_| match dtype {
                    "f32" => PackedLinear::pack(&w, None, fan_in, fan_out),
                    _ => PackedLinear::pack_bf16(&bits, None, fan_in, fan_out),
                })
                .collect();
            let x = random(2, n * fan_in);
            let mut out = vec![0f32; n * fan_out];
            let flops = 2.0 * (n * fan_in * fan_out) as f64;
            let reps = ((2e9 / flops) as usize).max(copies).max(3);
            for (label, cycle) in [("hot", 1), ("cold", copies)] {
                lins[0].forward(&x, n, &mut out);
                // The best of several rounds: on a shared machine the slower
                // rounds measure the neighbours, not the kernel.
                let s = (0..ROUNDS)
                    .map(|_| {
                        let t = Instant::now();
                        for r in 0..reps {
                            lins[r % cycle].forward(&x, n, &mut out);
                        }
                        t.elapsed().as_secs_f64() / reps as f64
                    })
                    .fold(f64::INFINITY, f64::min);
                println!(
                    "| {n} | {fan_in} | {fan_out} | {dtype} | {label} | {:.1} | {:.1} |",
                    s * 1e6,
                    flops / s / 1e9
                );
            }
        }
    }
}
