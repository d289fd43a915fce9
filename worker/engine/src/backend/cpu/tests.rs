//! The CPU backend against naive references.

use super::*;
use crate::backend::Segment;

/// One segment per run of equal slots over tokens `0..tokens`.
fn segments_of(tokens: usize, slot_of: impl Fn(usize) -> usize) -> Vec<Segment> {
    let mut segs: Vec<Segment> = Vec::new();
    for t in 0..tokens {
        match segs.last_mut() {
            Some(last) if last.slot == slot_of(t) => last.end = t + 1,
            _ => segs.push(Segment {
                slot: slot_of(t),
                start: t,
                end: t + 1,
            }),
        }
    }
    segs
}

fn random(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = crate::sampling::Rng::new(seed);
    (0..n).map(|_| rng.next_f64() as f32 - 0.5).collect()
}

#[test]
fn attention_gives_the_same_bits_on_every_kernel() {
    // The AVX2 build of a row's attention must be the baseline's
    // arithmetic: grouped heads, a head size with a tail past the
    // eight partial sums, positions in a scattered order.
    let (heads, group, hd, positions) = (6, 3, 20, 11);
    let kv_dim = heads / group * hd;
    let q = random(1, heads * hd);
    let (k_cache, v_cache) = (random(2, 16 * kv_dim), random(3, 16 * kv_dim));
    let offsets: Vec<usize> = (0..positions).map(|p| (p * 7 % 16) * kv_dim).collect();
    let row = AttentionRow {
        q: &q,
        k_cache: &k_cache,
        v_cache: &v_cache,
        offsets: &offsets,
        heads,
        group,
        head_dim: hd,
        scale: 0.3,
        softcap: None,
        sinks: None,
    };
    let mut want = vec![0f32; heads * hd];
    row.attend_with(&mut want);
    assert!(want.iter().all(|v| v.is_finite()) && want.iter().any(|&v| v != 0.0));
    for &kernel in &Kernel::available() {
        let mut got = vec![0f32; heads * hd];
        row.attend(kernel, &mut got);
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "{kernel:?}");
    }
}

#[test]
fn a_sink_logit_takes_its_share_of_the_softmax_and_weighs_no_value() {
    // One position: each head's output is its value times the key's share
    // against the sink, 1 / (1 + e^(sink - score)).
    let (heads, hd) = (2, 4);
    let q = random(4, heads * hd);
    let (k, v) = (random(5, heads * hd), random(6, heads * hd));
    let sinks = [0.7f32, -1.3];
    let offsets = [0usize];
    let row = AttentionRow {
        q: &q,
        k_cache: &k,
        v_cache: &v,
        offsets: &offsets,
        heads,
        group: 1,
        head_dim: hd,
        scale: 0.5,
        softcap: None,
        sinks: Some(&sinks),
    };
    let mut out = vec![0f32; heads * hd];
    row.attend_with(&mut out);
    for h in 0..heads {
        let score: f32 = (0..hd).map(|i| q[h * hd + i] * k[h * hd + i]).sum::<f32>() * 0.5;
        let share = 1.0 / (1.0 + (sinks[h] - score).exp());
        for i in 0..hd {
            let want = v[h * hd + i] * share;
            assert!(
                (out[h * hd + i] - want).abs() < 1e-6,
                "head {h}: {} vs {want}",
                out[h * hd + i]
            );
        }
    }
}

#[test]
fn bf16_slots_give_the_bits_of_their_f32_widening() {
    // The same modules, rounded to bf16, packed as bf16 bits into every
    // other slot of one table and as their f32 widening into all of
    // another: gathered runs that switch between the two, lone tokens
    // (slot 5 has no other), and bf16 and f32 segments on shared tiles,
    // short and long, must give identical bits.
    let (fan_in, fan_out, max_rank, tokens) = (40, 37, 32, 30);
    let ranks = [5usize, 16, 20, 3, 9, 12];
    let (a_len, b_len) = (
        SlotView::a_len(max_rank, fan_in),
        SlotView::b_len(max_rank, fan_out),
    );
    let round = |v: Vec<f32>| -> Vec<u16> {
        v.iter()
            .map(|&f| half::bf16::from_f32(f).to_bits())
            .collect()
    };
    let (mut a16, mut b16) = (
        vec![0f32; ranks.len() * a_len],
        vec![0f32; ranks.len() * b_len],
    );
    let (mut a32, mut b32) = (a16.clone(), b16.clone());
    for (s, &r) in ranks.iter().enumerate() {
        let rows = round(random(30 + s as u64, r * fan_in));
        let b_t = round(random(40 + s as u64, r * fan_out));
        let widen = |v: &[u16]| {
            v.iter()
                .map(|&h| crate::backend::cpu::panels::bf16_to_f32(h))
                .collect::<Vec<f32>>()
        };
        let (a, b) = (
            &mut a32[s * a_len..][..a_len],
            &mut b32[s * b_len..][..b_len],
        );
        SlotView::pack(
            &widen(&rows),
            &widen(&b_t),
            r,
            fan_in,
            fan_out,
            max_rank,
            a,
            b,
        );
        let (a, b) = (
            &mut a16[s * a_len..][..a_len],
            &mut b16[s * b_len..][..b_len],
        );
        if s % 2 == 1 {
            let (a, b) = (&mut as_bits_mut(a)[..a_len], &mut as_bits_mut(b)[..b_len]);
            SlotView::pack(&rows, &b_t, r, fan_in, fan_out, max_rank, a, b);
        } else {
            SlotView::pack(
                &widen(&rows),
                &widen(&b_t),
                r,
                fan_in,
                fan_out,
                max_rank,
                a,
                b,
            );
        }
    }
    let f32_view = SlotView {
        a: &a32,
        b: &b32,
        max_rank,
        fan_in,
        fan_out,
        rank: &|s| ranks[s],
        scale: &|s| 0.5 + s as f32,
        bf16: &|_| false,
    };
    let mixed_view = SlotView {
        a: &a16,
        b: &b16,
        bf16: &|s| s % 2 == 1,
        ..f32_view
    };
    let x = random(2, tokens * fan_in);
    let order: Vec<usize> = [1, 1, 1, 0, 3, 1, 2, 5, 4]
        .into_iter()
        .chain([3; 14])
        .chain([0, 1, 2, 3, 4, 4, 4])
        .collect();
    let slot_of = |t: usize| order[t];
    let segments = segments_of(tokens, slot_of);
    let (mut want, mut got) = (vec![0f32; tokens * fan_out], vec![0f32; tokens * fan_out]);
    lora_segments(&x, &segments, &f32_view, &mut want);
    lora_segments(&x, &segments, &mixed_view, &mut got);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert!(want.iter().all(|v| v.is_finite()) && want.iter().any(|&v| v != 0.0));
    assert_eq!(bits(&got), bits(&want));
}

#[test]
fn lora_segments_computes_the_delta_alike_grouped_or_one_token_at_a_time() {
    // Ranks below one panel, of exactly one, and across two; sizes that
    // leave partial panels on both sides.
    // Runs of one-token segments (ranks rounding up to 16, and to 32)
    // take the gathered path, longer segments the shared one.
    let (fan_in, fan_out, max_rank, tokens) = (40, 37, 32, 21);
    let ranks = [5usize, 16, 20, 3, 9, 12, 30, 1];
    let (a_len, b_len) = (
        SlotView::a_len(max_rank, fan_in),
        SlotView::b_len(max_rank, fan_out),
    );
    let mut a = vec![0f32; ranks.len() * a_len];
    let mut b = vec![0f32; ranks.len() * b_len];
    let mut modules = Vec::new();
    for (s, &r) in ranks.iter().enumerate() {
        let (rows, b_t) = (
            random(10 + s as u64, r * fan_in),
            random(20 + s as u64, r * fan_out),
        );
        SlotView::pack(
            &rows,
            &b_t,
            r,
            fan_in,
            fan_out,
            max_rank,
            &mut a[s * a_len..][..a_len],
            &mut b[s * b_len..][..b_len],
        );
        modules.push((rows, b_t));
    }
    let view = SlotView {
        a: &a,
        b: &b,
        max_rank,
        fan_in,
        fan_out,
        rank: &|s| ranks[s],
        scale: &|s| 0.5 + s as f32,
        bf16: &|_| false,
    };
    let x = random(1, tokens * fan_in);
    let slot_of = |t: usize| {
        [
            0, 0, 0, 1, 1, 2, 2, 2, 2, 1, 0, 3, 4, 5, 7, 1, 0, 3, 2, 6, 7,
        ][t]
    };
    let segments = segments_of(tokens, slot_of);
    let mut grouped = vec![0f32; tokens * fan_out];
    lora_segments(&x, &segments, &view, &mut grouped);
    let mut alone = vec![0f32; tokens * fan_out];
    for t in 0..tokens {
        let one = Segment {
            slot: slot_of(t),
            start: t,
            end: t + 1,
        };
        lora_segments(&x, &[one], &view, &mut alone);
    }
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&grouped), bits(&alone));
    // And both are the definition, s·(x·Aᵀ)·Bᵀ.
    for t in 0..tokens {
        let (s, (rows, b_t)) = (slot_of(t), &modules[slot_of(t)]);
        let h: Vec<f64> = (0..ranks[s])
            .map(|r| {
                (0..fan_in)
                    .map(|i| x[t * fan_in + i] as f64 * rows[r * fan_in + i] as f64)
                    .sum()
            })
            .collect();
        for o in 0..fan_out {
            let want: f64 = (0.5 + s as f64)
                * (0..ranks[s])
                    .map(|r| h[r] * b_t[r * fan_out + o] as f64)
                    .sum::<f64>();
            let got = grouped[t * fan_out + o] as f64;
            assert!(
                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "t={t} o={o}"
            );
        }
    }
    // A slot reused by a smaller rank over the old weights, never
    // cleared, computes what a fresh slot does.
    let mut reused_a = a.clone();
    let mut reused_b = b.clone();
    SlotView::pack(
        &modules[0].0,
        &modules[0].1,
        ranks[0],
        fan_in,
        fan_out,
        max_rank,
        &mut reused_a[2 * a_len..][..a_len],
        &mut reused_b[2 * b_len..][..b_len],
    );
    let reused = SlotView {
        a: &reused_a,
        b: &reused_b,
        rank: &|s| ranks[if s == 2 { 0 } else { s }],
        scale: &|s| if s == 2 { 0.5 } else { 0.5 + s as f32 },
        ..view
    };
    let (mut fresh, mut stale) = (vec![0f32; fan_out], vec![0f32; fan_out]);
    lora_segments(
        &x[..fan_in],
        &[Segment {
            slot: 0,
            start: 0,
            end: 1,
        }],
        &view,
        &mut fresh,
    );
    lora_segments(
        &x[..fan_in],
        &[Segment {
            slot: 2,
            start: 0,
            end: 1,
        }],
        &reused,
        &mut stale,
    );
    assert_eq!(bits(&fresh), bits(&stale));
    // And it is s·(x·Aᵀ)·Bᵀ.
    for t in 0..tokens {
        let s = slot_of(t);
        let (rows, b_t) = &modules[s];
        let r = ranks[s];
        for o in 0..fan_out {
            let mut want = 0f64;
            for k in 0..r {
                let h: f64 = (0..fan_in)
                    .map(|i| f64::from(x[t * fan_in + i]) * f64::from(rows[k * fan_in + i]))
                    .sum();
                want += h * f64::from(b_t[k * fan_out + o]);
            }
            want *= f64::from(0.5 + s as f32);
            let got = f64::from(grouped[t * fan_out + o]);
            assert!(
                (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "t={t} o={o}: {got} vs {want}"
            );
        }
    }
}
