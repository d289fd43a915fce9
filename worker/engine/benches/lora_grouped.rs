//! Benchmark (a): the grouped LoRA kernel (one shrink and one expand per
//! adapter segment, SGMV-style) against a per-request loop (the same kernel
//! called once per request), for a mixed batch of 64 tokens from 64
//! requests spread over 1, 8, 32 and 64 adapters. Rank 16, 768 -> 768 (a q
//! projection of the stand-in model). Prints a table. Run with:
//!
//!     cargo bench -p lorafleet-engine --bench lora_grouped

use std::time::Instant;

use lorafleet_engine::backend::Segment;
use lorafleet_engine::backend::cpu::{SlotView, lora_segments};
use lorafleet_engine::sampling::Rng;

const TOKENS: usize = 64;
const DIM: usize = 768;
const RANK: usize = 16;

fn random(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.next_f64() as f32 - 0.5).collect()
}

fn time(iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    t.elapsed().as_secs_f64() / iters as f64
}

fn main() {
    let mut rng = Rng::new(3);
    let slots = 64;
    let (a_len, b_len) = (SlotView::a_len(RANK, DIM), SlotView::b_len(RANK, DIM));
    let mut a = vec![0f32; slots * a_len];
    let mut b = vec![0f32; slots * b_len];
    for s in 0..slots {
        let (rows, b_t) = (random(&mut rng, RANK * DIM), random(&mut rng, RANK * DIM));
        SlotView::pack(
            &rows,
            &b_t,
            RANK,
            DIM,
            DIM,
            RANK,
            &mut a[s * a_len..][..a_len],
            &mut b[s * b_len..][..b_len],
        );
    }
    let x = random(&mut rng, TOKENS * DIM);
    let view = SlotView {
        a: &a,
        b: &b,
        max_rank: RANK,
        fan_in: DIM,
        fan_out: DIM,
        rank: &|_| RANK,
        scale: &|_| 2.0,
        bf16: &|_| false,
    };
    println!(
        "grouped LoRA vs per-request loop: {TOKENS} tokens, rank {RANK}, {DIM}x{DIM}, {} threads",
        rayon::current_num_threads()
    );
    println!("| adapters | grouped (us) | per-request loop (us) | speedup | outputs equal |");
    println!("|---:|---:|---:|---:|:---:|");
    for adapters in [1usize, 8, 32, 64] {
        // Requests sorted by adapter, as the engine orders a step.
        let per = TOKENS / adapters;
        let segments: Vec<Segment> = (0..adapters)
            .map(|s| Segment {
                slot: s,
                start: s * per,
                end: (s + 1) * per,
            })
            .collect();
        let singles: Vec<Segment> = (0..TOKENS)
            .map(|t| Segment {
                slot: t / per,
                start: t,
                end: t + 1,
            })
            .collect();
        let mut out_g = vec![0f32; TOKENS * DIM];
        let mut out_l = vec![0f32; TOKENS * DIM];
        let grouped = time(200, || lora_segments(&x, &segments, &view, &mut out_g));
        let looped = time(200, || {
            for seg in &singles {
                lora_segments(&x, std::slice::from_ref(seg), &view, &mut out_l);
            }
        });
        // One clean pass each, to compare the numbers.
        out_g.fill(0.0);
        out_l.fill(0.0);
        lora_segments(&x, &segments, &view, &mut out_g);
        for seg in &singles {
            lora_segments(&x, std::slice::from_ref(seg), &view, &mut out_l);
        }
        println!(
            "| {adapters} | {:.1} | {:.1} | {:.2}x | {} |",
            grouped * 1e6,
            looped * 1e6,
            looped / grouped,
            if out_g == out_l { "yes" } else { "NO" }
        );
    }
}
