//! The CUDA kernels against the CPU reference, on a GPU: every kernel on
//! fresh random inputs with its output poisoned first (relative error
//! ≤ 1e-5 in f32). The whole model and the engine on the GPU are in
//! `cuda_engine.rs`.
//!
//! These need a CUDA device: they are ignored by a plain `cargo test`,
//! and `deploy/gpu-check.sh` runs them with `--include-ignored`.

mod common;

use common::gpu::{assert_close, poison, random, require_gpu};
use lorafleet_engine::backend::Segment;
use lorafleet_engine::backend::cpu::{SlotView, lora_segments};
use lorafleet_engine::backend::cuda::Dtype;
use lorafleet_engine::backend::cuda::kernels::KernelShapes;
use lorafleet_engine::backend::cuda::testing::{Arg, Buf, KernelHarness};
use lorafleet_engine::sampling;

const SHAPES: KernelShapes = KernelShapes {
    dtype: Dtype::F32,
    slot_dtype: Dtype::F32,
    head_dim: 16,
    max_rank: 16,
    shrink_kc: 64,
};

#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn norm_embedding_and_elementwise_kernels_match_the_cpu_reference() {
    require_gpu();
    let h = KernelHarness::new(SHAPES).unwrap();
    let d = 64;
    // RMSNorm over gathered rows, then over all rows.
    let x = random(1, 5 * d);
    let w = random(2, d);
    let reference = |row: usize| -> Vec<f32> {
        let xr = &x[row * d..(row + 1) * d];
        let mean_sq = xr.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / d as f64;
        let inv = 1.0 / (mean_sq + 1e-5).sqrt();
        (0..d)
            .map(|i| (f64::from(w[i]) * f64::from(xr[i]) * inv) as f32)
            .collect()
    };
    for rows in [Some(vec![4, 0, 2]), None] {
        let order: Vec<usize> = rows.clone().map_or((0..5).collect(), |r| {
            r.iter().map(|&v| v as usize).collect()
        });
        let (xb, wb) = (h.f32(&x).unwrap(), h.f32(&w).unwrap());
        let rows_buf = rows.as_ref().map(|r| h.i32(r).unwrap());
        let out = h.f32(&poison(order.len() * d)).unwrap();
        h.launch(
            "rms_norm",
            (order.len() as u32, 1, 1),
            256,
            &[
                Arg::Ptr(h.ptr(&xb)),
                Arg::Ptr(rows_buf.as_ref().map_or(0, |b| h.ptr(b))),
                Arg::Ptr(h.ptr(&wb)),
                Arg::Ptr(h.ptr(&out)),
                Arg::Ptr(0),
                Arg::I32(d as i32),
                Arg::F32(1e-5),
            ],
        )
        .unwrap();
        let want: Vec<f32> = order.iter().flat_map(|&r| reference(r)).collect();
        assert_close(&h.read(&out).unwrap(), &want, 1e-5, "rms_norm");
    }

    // Embedding lookup.
    let vocab = 50;
    let table = random(3, vocab * d);
    let tokens = [3, 49, 0, 3];
    let (tb, tok) = (h.f32(&table).unwrap(), h.i32(&tokens).unwrap());
    // Scaled by 1 (rows copied exactly) and by Gemma's √hidden.
    for scale in [1f32, 8f32.sqrt()] {
        let out = h.f32(&poison(tokens.len() * d)).unwrap();
        h.launch(
            "embed",
            (tokens.len() as u32, 1, 1),
            256,
            &[
                Arg::Ptr(h.ptr(&tb)),
                Arg::Ptr(h.ptr(&tok)),
                Arg::Ptr(h.ptr(&out)),
                Arg::I32(d as i32),
                Arg::F32(scale),
                Arg::I32(vocab as i32),
            ],
        )
        .unwrap();
        let want: Vec<f32> = tokens
            .iter()
            .flat_map(|&t| table[t as usize * d..(t as usize + 1) * d].to_vec())
            .map(|v| v * scale)
            .collect();
        assert_eq!(h.read(&out).unwrap(), want, "embed rows times {scale}");
    }
    // A token past the vocabulary (a grown one's, its row put in by its
    // adapter next) reads nothing: its row is zero.
    let grown = h.i32(&[2, vocab as i32 + 1]).unwrap();
    let out = h.f32(&poison(2 * d)).unwrap();
    h.launch(
        "embed",
        (2, 1, 1),
        256,
        &[
            Arg::Ptr(h.ptr(&tb)),
            Arg::Ptr(h.ptr(&grown)),
            Arg::Ptr(h.ptr(&out)),
            Arg::I32(d as i32),
            Arg::F32(1.0),
            Arg::I32(vocab as i32),
        ],
    )
    .unwrap();
    let got = h.read(&out).unwrap();
    assert_eq!(&got[..d], &table[2 * d..3 * d]);
    assert!(got[d..].iter().all(|&v| v == 0.0), "a grown token's row");

    // SiLU(gate) · up over [gate | up] rows.
    let (rows, inter) = (3, 96);
    let gu = random(4, rows * 2 * inter);
    let gub = h.f32(&gu).unwrap();
    let out = h.f32(&poison(rows * inter)).unwrap();
    h.launch(
        "silu_mul",
        (2, 1, 1),
        256,
        &[
            Arg::Ptr(h.ptr(&gub)),
            Arg::Ptr(h.ptr(&out)),
            Arg::Ptr(0),
            Arg::I32(rows as i32),
            Arg::I32(inter as i32),
        ],
    )
    .unwrap();
    let want: Vec<f32> = (0..rows * inter)
        .map(|i| {
            let (t, c) = (i / inter, i % inter);
            let (g, u) = (gu[t * 2 * inter + c], gu[t * 2 * inter + inter + c]);
            g / (1.0 + (-g).exp()) * u
        })
        .collect();
    assert_close(&h.read(&out).unwrap(), &want, 1e-5, "silu_mul");

    // GeGLU: gelu_tanh(gate) · up, as the CPU backend computes it.
    let out = h.f32(&poison(rows * inter)).unwrap();
    h.launch(
        "gelu_mul",
        (2, 1, 1),
        256,
        &[
            Arg::Ptr(h.ptr(&gub)),
            Arg::Ptr(h.ptr(&out)),
            Arg::Ptr(0),
            Arg::I32(rows as i32),
            Arg::I32(inter as i32),
        ],
    )
    .unwrap();
    let mut want = vec![0f32; rows * inter];
    for t in 0..rows {
        lorafleet_engine::backend::cpu::activation::gelu_tanh_mul(
            &gu[t * 2 * inter..][..inter],
            &gu[t * 2 * inter + inter..][..inter],
            &mut want[t * inter..][..inter],
        );
    }
    assert_close(&h.read(&out).unwrap(), &want, 1e-5, "gelu_mul");

    // Soft-capping: tanh(x / cap) · cap.
    let big: Vec<f32> = random(9, 500).iter().map(|v| v * 80.0).collect();
    let bb = h.f32(&big).unwrap();
    h.launch(
        "softcap",
        (2, 1, 1),
        256,
        &[Arg::Ptr(h.ptr(&bb)), Arg::I64(500), Arg::F32(30.0)],
    )
    .unwrap();
    let want: Vec<f32> = big.iter().map(|v| (v / 30.0).tanh() * 30.0).collect();
    assert_close(&h.read(&bb).unwrap(), &want, 1e-5, "softcap");

    // Bias and residual adds.
    let y = random(5, rows * inter);
    let bias = random(6, inter);
    let (yb, bb) = (h.f32(&y).unwrap(), h.f32(&bias).unwrap());
    h.launch(
        "add_bias",
        (1, 1, 1),
        256,
        &[
            Arg::Ptr(h.ptr(&yb)),
            Arg::Ptr(h.ptr(&bb)),
            Arg::I32(rows as i32),
            Arg::I32(inter as i32),
        ],
    )
    .unwrap();
    let want: Vec<f32> = (0..rows * inter).map(|i| y[i] + bias[i % inter]).collect();
    assert_eq!(h.read(&yb).unwrap(), want, "add_bias");
    let other = random(7, rows * inter);
    let ob = h.f32(&other).unwrap();
    h.launch(
        "add_into",
        (1, 1, 1),
        256,
        &[
            Arg::Ptr(h.ptr(&yb)),
            Arg::Ptr(h.ptr(&ob)),
            Arg::I64((rows * inter) as i64),
        ],
    )
    .unwrap();
    let want: Vec<f32> = want.iter().zip(&other).map(|(a, b)| a + b).collect();
    assert_eq!(h.read(&yb).unwrap(), want, "add_into");
}

#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn bf16_and_f16_conversions_round_to_nearest_even() {
    require_gpu();
    let x = random(8, 1000);
    for dtype in [Dtype::Bf16, Dtype::F16] {
        let h = KernelHarness::new(KernelShapes { dtype, ..SHAPES }).unwrap();
        let xb = h.f32(&x).unwrap();
        // 1000 halves fit in 500 i32s.
        let out = h.i32(&vec![-1; 500]).unwrap();
        h.launch(
            "to_wt",
            (4, 1, 1),
            256,
            &[Arg::Ptr(h.ptr(&xb)), Arg::Ptr(h.ptr(&out)), Arg::I64(1000)],
        )
        .unwrap();
        let words = h.read_i32(&out).unwrap();
        let halves: Vec<u16> = words
            .iter()
            .flat_map(|w| {
                let w = *w as u32;
                [w as u16, (w >> 16) as u16]
            })
            .collect();
        let want: Vec<u16> = x
            .iter()
            .map(|&v| match dtype {
                Dtype::Bf16 => half::bf16::from_f32(v).to_bits(),
                _ => half::f16::from_f32(v).to_bits(),
            })
            .collect();
        assert_eq!(halves, want, "{dtype:?}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn rope_kv_store_and_paged_attention_match_the_cpu_reference() {
    require_gpu();
    let h = KernelHarness::new(SHAPES).unwrap();
    let (hd, heads, kv_heads, bs, blocks) = (16usize, 4usize, 2usize, 4usize, 8usize);
    let (q_dim, kv_dim) = (heads * hd, kv_heads * hd);
    let stride = q_dim + 2 * kv_dim;
    // Sequence 0 prefills positions 0..5 (blocks 5, 2); sequence 1 decodes
    // position 9 (blocks 7, 0, 3), its positions 0..9 already cached.
    let tables: [Vec<i32>; 2] = [vec![5, 2], vec![7, 0, 3]];
    let tok: Vec<(usize, usize)> = vec![(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 9)];
    let n = tok.len();
    let row_of = |s: usize, p: usize| tables[s][p / bs] as usize * bs + p % bs;
    let qkv = random(10, n * stride);
    let mut k_cache = poison(blocks * bs * kv_dim);
    let mut v_cache = poison(blocks * bs * kv_dim);
    let (k_old, v_old) = (random(11, 9 * kv_dim), random(12, 9 * kv_dim));
    for p in 0..9 {
        let r = row_of(1, p);
        k_cache[r * kv_dim..(r + 1) * kv_dim].copy_from_slice(&k_old[p * kv_dim..(p + 1) * kv_dim]);
        v_cache[r * kv_dim..(r + 1) * kv_dim].copy_from_slice(&v_old[p * kv_dim..(p + 1) * kv_dim]);
    }
    let inv_freq: Vec<f32> = (0..hd / 2)
        .map(|i| 1.0 / 10000f32.powf((2 * i) as f32 / hd as f32))
        .collect();

    // The reference: rotate, store, attend, as the CPU backend does.
    let mut ref_qkv = qkv.clone();
    let (mut ref_k, mut ref_v) = (k_cache.clone(), v_cache.clone());
    for (t, &(s, p)) in tok.iter().enumerate() {
        let row = &mut ref_qkv[t * stride..(t + 1) * stride];
        for head in row[..q_dim + kv_dim].chunks_exact_mut(hd) {
            for i in 0..hd / 2 {
                let (sin, cos) = (p as f32 * inv_freq[i]).sin_cos();
                let (x1, x2) = (head[i], head[i + hd / 2]);
                head[i] = x1 * cos - x2 * sin;
                head[i + hd / 2] = x2 * cos + x1 * sin;
            }
        }
        let r = row_of(s, p);
        ref_k[r * kv_dim..(r + 1) * kv_dim].copy_from_slice(&row[q_dim..q_dim + kv_dim]);
        ref_v[r * kv_dim..(r + 1) * kv_dim].copy_from_slice(&row[q_dim + kv_dim..]);
    }
    // GPT-OSS's sink logit per head joins the softmax's maximum and sum and
    // weighs no value.
    let attend = |window: usize, cap: f32, sinks: Option<&[f32]>| -> Vec<f32> {
        let mut out = vec![0f32; n * q_dim];
        for (t, &(s, p)) in tok.iter().enumerate() {
            let lo = if window > 0 {
                (p + 1).saturating_sub(window)
            } else {
                0
            };
            for head in 0..heads {
                let kvh = head / (heads / kv_heads);
                let q = &ref_qkv[t * stride + head * hd..][..hd];
                let scores: Vec<f64> = (lo..=p)
                    .map(|j| {
                        let k = &ref_k[row_of(s, j) * kv_dim + kvh * hd..][..hd];
                        let s = q.iter().zip(k).map(|(a, b)| f64::from(a * b)).sum::<f64>()
                            / (hd as f64).sqrt();
                        if cap > 0.0 {
                            (s / f64::from(cap)).tanh() * f64::from(cap)
                        } else {
                            s
                        }
                    })
                    .collect();
                let sink = sinks.map(|s| f64::from(s[head]));
                let max = scores
                    .iter()
                    .cloned()
                    .chain(sink)
                    .fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - max).exp());
                for dd in 0..hd {
                    let mut acc = 0f64;
                    for (i, j) in (lo..=p).enumerate() {
                        acc += e[i] / sum * f64::from(ref_v[row_of(s, j) * kv_dim + kvh * hd + dd]);
                    }
                    out[t * q_dim + head * hd + dd] = acc as f32;
                }
            }
        }
        out
    };

    let qkv_b = h.f32(&qkv).unwrap();
    let pos = h
        .i32(&tok.iter().map(|&(_, p)| p as i32).collect::<Vec<_>>())
        .unwrap();
    let kv_row = h
        .i32(
            &tok.iter()
                .map(|&(s, p)| row_of(s, p) as i32)
                .collect::<Vec<_>>(),
        )
        .unwrap();
    let tok_seq = h
        .i32(&tok.iter().map(|&(s, _)| s as i32).collect::<Vec<_>>())
        .unwrap();
    let bt_off = h.i32(&[0, 2]).unwrap();
    let bt = h.i32(&[5, 2, 7, 0, 3]).unwrap();
    let freq = h.f32(&inv_freq).unwrap();
    let (kc, vc) = (h.f32(&k_cache).unwrap(), h.f32(&v_cache).unwrap());
    h.launch(
        "rope_store",
        (n as u32, 1, 1),
        128,
        &[
            Arg::Ptr(h.ptr(&qkv_b)),
            Arg::I32(q_dim as i32),
            Arg::I32(kv_dim as i32),
            Arg::Ptr(h.ptr(&pos)),
            Arg::Ptr(h.ptr(&kv_row)),
            Arg::Ptr(h.ptr(&freq)),
            Arg::I32(0),
            Arg::I32((hd / 2) as i32),
            Arg::F32(1.0),
            Arg::Ptr(h.ptr(&kc)),
            Arg::Ptr(h.ptr(&vc)),
        ],
    )
    .unwrap();
    assert_close(&h.read(&qkv_b).unwrap(), &ref_qkv, 1e-5, "rope");
    // Only the rows this step wrote are compared: the rest stay poisoned.
    let written = |cache: &[f32]| -> Vec<f32> {
        tok.iter()
            .flat_map(|&(s, p)| cache[row_of(s, p) * kv_dim..][..kv_dim].to_vec())
            .collect()
    };
    assert_close(
        &written(&h.read(&kc).unwrap()),
        &written(&ref_k),
        1e-5,
        "k store",
    );
    assert_eq!(written(&h.read(&vc).unwrap()), written(&ref_v), "v store");
    // Each sequence's ring of two blocks for a window of 3: ring slot
    // b % 2 holds block b of the positions the window reaches (sequence
    // 0: blocks 0 and 1; sequence 1, at position 9: blocks 1 and 2).
    let rings = h.i32(&[5, 2, 3, 0]).unwrap();
    let sinks: Vec<f32> = (0..heads).map(|h| 0.8 * h as f32 - 0.6).collect();
    let sinks_b = h.f32(&sinks).unwrap();
    for (window, cap, ring_len, sinked) in [
        (0usize, 0f32, 0i32, false),
        (3, 0.0, 0, false),
        (0, 0.5, 0, false),
        (3, 0.5, 2, false),
        (0, 0.0, 0, true),
        (3, 0.0, 2, true),
    ] {
        let tables = if ring_len > 0 { &rings } else { &bt };
        let out = h.f32(&poison(n * q_dim)).unwrap();
        h.launch(
            "attention",
            (n as u32, heads as u32, 1),
            128,
            &[
                Arg::Ptr(h.ptr(&qkv_b)),
                Arg::I32(q_dim as i32),
                Arg::I32(kv_dim as i32),
                Arg::Ptr(h.ptr(&kc)),
                Arg::Ptr(h.ptr(&vc)),
                Arg::Ptr(h.ptr(&pos)),
                Arg::Ptr(h.ptr(&tok_seq)),
                Arg::Ptr(h.ptr(&bt_off)),
                Arg::Ptr(h.ptr(tables)),
                Arg::I32(bs as i32),
                Arg::I32(ring_len),
                Arg::I32(window as i32),
                Arg::F32(1.0 / (hd as f32).sqrt()),
                Arg::F32(cap),
                Arg::Ptr(if sinked { h.ptr(&sinks_b) } else { 0 }),
                Arg::Ptr(h.ptr(&out)),
            ],
        )
        .unwrap();
        assert_close(
            &h.read(&out).unwrap(),
            &attend(window, cap, sinked.then_some(&sinks[..])),
            1e-5,
            &format!("attention (window {window}, cap {cap}, ring {ring_len}, sinks {sinked})"),
        );
    }

    // Each token's own frequencies (LongRoPE, dynamic NTK: rows
    // `freq_stride` apart), over a partial rotary width (a quarter of each
    // head) with an attention factor on cos and sin.
    let rot_half = hd / 4;
    let rows: Vec<f32> = (0..n)
        .flat_map(|t| (0..rot_half).map(move |i| (1.0 + t as f32) / 50f32.powi(i as i32 + 1)))
        .collect();
    let factor = 1.3f32;
    let mut want = qkv.clone();
    for (t, &(_, p)) in tok.iter().enumerate() {
        let row = &mut want[t * stride..(t + 1) * stride];
        for head in row[..q_dim + kv_dim].chunks_exact_mut(hd) {
            for i in 0..rot_half {
                let (sin, cos) = (p as f32 * rows[t * rot_half + i]).sin_cos();
                let (cos, sin) = (cos * factor, sin * factor);
                let (x1, x2) = (head[i], head[i + rot_half]);
                head[i] = x1 * cos - x2 * sin;
                head[i + rot_half] = x2 * cos + x1 * sin;
            }
        }
    }
    let qkv_b = h.f32(&qkv).unwrap();
    let per_token = h.f32(&rows).unwrap();
    let (kc, vc) = (h.f32(&k_cache).unwrap(), h.f32(&v_cache).unwrap());
    h.launch(
        "rope_store",
        (n as u32, 1, 1),
        128,
        &[
            Arg::Ptr(h.ptr(&qkv_b)),
            Arg::I32(q_dim as i32),
            Arg::I32(kv_dim as i32),
            Arg::Ptr(h.ptr(&pos)),
            Arg::Ptr(h.ptr(&kv_row)),
            Arg::Ptr(h.ptr(&per_token)),
            Arg::I32(rot_half as i32),
            Arg::I32(rot_half as i32),
            Arg::F32(factor),
            Arg::Ptr(h.ptr(&kc)),
            Arg::Ptr(h.ptr(&vc)),
        ],
    )
    .unwrap();
    assert_close(
        &h.read(&qkv_b).unwrap(),
        &want,
        1e-5,
        "rope with each token's frequencies, partial, scaled",
    );
}

#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn grouped_lora_shrink_and_expand_match_the_cpu_kernel() {
    require_gpu();
    let h = KernelHarness::new(SHAPES).unwrap();
    // Three slices sharing an input of 96 features: two split-K chunks of
    // 64, the second partial. Slot 2 lacks the second slice (rank 0).
    // Slot 1's segment of 37 tokens spans three tiles, the last partial.
    // Some (slice, slot)s carry what DoRA and lora_bias add: slot 1's first
    // slice both, slot 3's second a bias, slot 0's third DoRA over a base
    // bias the scaling leaves out (the CPU backend's `b + g ⊙ (y − b)`).
    let (fan_in, max_rank, slots, tokens) = (96usize, 16usize, 4usize, 48usize);
    let widths = [64usize, 32, 32];
    let ranks: [[usize; 4]; 3] = [[5, 16, 12, 1], [5, 16, 0, 1], [3, 8, 12, 16]];
    let scales: [[f32; 4]; 3] = [
        [0.5, 2.0, 1.5, 0.25],
        [1.0, 0.5, 0.0, 3.0],
        [2.0, 1.0, 0.75, 0.5],
    ];
    let slot_of = |t: usize| match t {
        0..3 => 0,
        3..40 => 1,
        40..42 => 3,
        42..45 => 2,
        _ => 0,
    };
    let mut segments: Vec<Segment> = Vec::new();
    for t in 0..tokens {
        match segments.last_mut() {
            Some(last) if last.slot == slot_of(t) => last.end = t + 1,
            _ => segments.push(Segment {
                slot: slot_of(t),
                start: t,
                end: t + 1,
            }),
        }
    }
    let x = random(20, tokens * fan_in);
    let stride: usize = widths.iter().sum();
    let base = random(21, tokens * stride);
    let mut want = base.clone();
    let mut a_dev = Vec::new();
    let mut b_dev = Vec::new();
    let mut offset = 0;
    for (z, &width) in widths.iter().enumerate() {
        // Device layout: A [slots, max_rank, fan_in], Bᵀ [slots, max_rank, width],
        // rows past a slot's rank left as random garbage that must not be read.
        let mut a = random(30 + z as u64, slots * max_rank * fan_in);
        let mut b = random(40 + z as u64, slots * max_rank * width);
        let (a_len, b_len) = (SlotView::a_len(16, fan_in), SlotView::b_len(16, width));
        let mut a_packed = vec![0f32; slots * a_len];
        let mut b_packed = vec![0f32; slots * b_len];
        for s in 0..slots {
            let r = ranks[z][s];
            let rows = random(50 + (z * 10 + s) as u64, r * fan_in);
            let b_t = random(60 + (z * 10 + s) as u64, r * width);
            a[s * max_rank * fan_in..][..r * fan_in].copy_from_slice(&rows);
            b[s * max_rank * width..][..r * width].copy_from_slice(&b_t);
            SlotView::pack(
                &rows,
                &b_t,
                r,
                fan_in,
                width,
                16,
                &mut a_packed[s * a_len..][..a_len],
                &mut b_packed[s * b_len..][..b_len],
            );
        }
        let view = SlotView {
            a: &a_packed,
            b: &b_packed,
            max_rank: 16,
            fan_in,
            fan_out: width,
            rank: &|s| ranks[z][s],
            scale: &|s| scales[z][s],
            bf16: &|_| false,
        };
        let mut delta_base: Vec<f32> = (0..tokens)
            .flat_map(|t| base[t * stride + offset..][..width].to_vec())
            .collect();
        lora_segments(&x, &segments, &view, &mut delta_base);
        for t in 0..tokens {
            want[t * stride + offset..][..width].copy_from_slice(&delta_base[t * width..][..width]);
        }
        a_dev.push(h.f32(&a).unwrap());
        b_dev.push(h.f32(&b).unwrap());
        offset += width;
    }
    let rank_dev: Vec<Buf> = ranks
        .iter()
        .map(|r| h.i32(&r.map(|v| v as i32)).unwrap())
        .collect();
    let scale_dev: Vec<Buf> = scales.iter().map(|s| h.f32(s).unwrap()).collect();
    let (_meta, seg_args, tiles) = h.segments(&segments).unwrap();
    let splits = fan_in.div_ceil(64);
    let h_part = h.f32(&poison(3 * splits * tokens * max_rank)).unwrap();
    let (xb, out) = (h.f32(&x).unwrap(), h.f32(&base).unwrap());
    let mut args = vec![
        Arg::Ptr(h.ptr(&xb)),
        Arg::I32(fan_in as i32),
        Arg::I32(tokens as i32),
    ];
    args.extend(seg_args);
    args.extend(a_dev.iter().map(|b| Arg::Ptr(h.ptr(b))));
    args.extend(rank_dev.iter().map(|b| Arg::Ptr(h.ptr(b))));
    args.push(Arg::Ptr(h.ptr(&h_part)));
    args.push(Arg::I64((max_rank * fan_in) as i64));
    h.launch("lora_shrink", (tiles as u32, splits as u32, 3), 256, &args)
        .unwrap();
    let mut args = vec![
        Arg::Ptr(h.ptr(&h_part)),
        Arg::I32(splits as i32),
        Arg::I32(tokens as i32),
    ];
    args.extend(seg_args);
    args.extend(b_dev.iter().map(|b| Arg::Ptr(h.ptr(b))));
    args.extend(rank_dev.iter().map(|b| Arg::Ptr(h.ptr(b))));
    args.extend(scale_dev.iter().map(|b| Arg::Ptr(h.ptr(b))));
    args.extend(widths.iter().map(|&w| Arg::I32(w as i32)));
    args.extend([0, 64, 96].map(Arg::I32));
    args.push(Arg::Ptr(h.ptr(&out)));
    args.push(Arg::I32(stride as i32));
    args.extend(widths.iter().map(|&w| Arg::I64((max_rank * w) as i64)));
    // Flags of (slice, slot), each slot's vectors `[g | c]` of every
    // slice, and slice 2's base bias.
    let mut flags = [[0i32; 4]; 3];
    flags[0][1] = 3;
    flags[1][3] = 2;
    flags[2][0] = 1;
    let v_at: Vec<usize> = widths
        .iter()
        .scan(0, |at, w| {
            let here = *at;
            *at += 2 * w;
            Some(here)
        })
        .collect();
    let v_stride: usize = widths.iter().map(|w| 2 * w).sum();
    let vectors: Vec<f32> = random(70, slots * v_stride)
        .iter()
        .map(|v| 1.0 + 0.25 * v)
        .collect();
    let beta = random(71, widths[2]);
    let mut offset = 0;
    for (z, &width) in widths.iter().enumerate() {
        for t in 0..tokens {
            let slot = slot_of(t);
            let f = flags[z][slot];
            let v = &vectors[slot * v_stride + v_at[z]..][..2 * width];
            for o in 0..width {
                let y = &mut want[t * stride + offset + o];
                if f & 2 != 0 {
                    *y += v[width + o];
                }
                if f & 1 != 0 {
                    let b = if z == 2 { beta[o] } else { 0.0 };
                    *y = b + v[o] * (*y - b);
                }
            }
        }
        offset += width;
    }
    let flags_dev: Vec<Buf> = flags.iter().map(|f| h.i32(f).unwrap()).collect();
    let vec_dev = h.f32(&vectors).unwrap();
    let beta_dev = h.f32(&beta).unwrap();
    args.extend(flags_dev.iter().map(|b| Arg::Ptr(h.ptr(b))));
    args.extend(
        v_at.iter()
            .map(|&at| Arg::Ptr(h.ptr(&vec_dev) + (at * 4) as u64)),
    );
    args.extend([0, 0, h.ptr(&beta_dev)].map(Arg::Ptr));
    args.push(Arg::I64(v_stride as i64));
    h.launch("lora_expand", (tiles as u32, 1, 3), 256, &args)
        .unwrap();
    let got = h.read(&out).unwrap();
    assert_close(
        &got,
        &want,
        1e-5,
        "lora shrink + expand, with DoRA and lora_bias flags",
    );
    // Slot 2's second slice has rank 0: its columns are the base, untouched.
    for t in 42..45 {
        assert_eq!(
            &got[t * stride + 64..][..32],
            &base[t * stride + 64..][..32]
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn expert_lora_shrink_and_expand_match_the_cpu_reference() {
    require_gpu();
    use lorafleet_engine::lora::ExpertFactors;
    let h = KernelHarness::new(SHAPES).unwrap();
    let max_rank = SHAPES.max_rank;
    // Two slots, four experts, 96 inputs and 80 outputs; groups of (rows,
    // slot, expert), with row 7 in none (its adapter has no expert
    // weights, so its output must stay as it was).
    let (slots, experts, fan_in, fan_out, rows) = (2usize, 4usize, 96usize, 80usize, 8usize);
    let ranks = [5usize, 16];
    let scales = [0.5f32, 2.0];
    let groups: [(usize, usize, usize, usize); 3] = [(0, 3, 0, 2), (3, 4, 1, 0), (4, 7, 1, 3)];
    let x = random(31, rows * fan_in);
    let base = random(34, rows * fan_out);
    // Each slot's factors as the engine holds them (A [rank, fan_in] and
    // B [fan_out, rank] per expert), the CPU reference.
    let factors: Vec<ExpertFactors> = (0..slots)
        .map(|s| {
            let r = ranks[s];
            let a_e: Vec<Vec<f32>> = (0..experts)
                .map(|e| random(40 + (s * experts + e) as u64, r * fan_in))
                .collect();
            let b_e: Vec<Vec<f32>> = (0..experts)
                .map(|e| random(80 + (s * experts + e) as u64, fan_out * r))
                .collect();
            ExpertFactors::new(r, scales[s], (fan_in, fan_out), &a_e, &b_e)
        })
        .collect();
    let mut want = base.clone();
    for &(lo, hi, slot, expert) in &groups {
        for row in lo..hi {
            factors[slot].add_delta(
                expert,
                &x[row * fan_in..(row + 1) * fan_in],
                &mut want[row * fan_out..(row + 1) * fan_out],
            );
        }
    }
    // On the device: each slot's panels as one allocation of its own, as
    // a slot write lays them out, reached through a table of addresses.
    let panels = |s: usize, which: usize| -> Vec<f32> {
        (0..experts)
            .flat_map(|e| {
                let (a, b) = factors[s].panels(e);
                if which == 0 { a.to_vec() } else { b.to_vec() }
            })
            .collect()
    };
    let a_bufs: Vec<_> = (0..slots).map(|s| h.f32(&panels(s, 0)).unwrap()).collect();
    let b_bufs: Vec<_> = (0..slots).map(|s| h.f32(&panels(s, 1)).unwrap()).collect();
    let table = |bufs: &[_]| {
        h.pointers(&bufs.iter().map(|b| h.ptr(b)).collect::<Vec<u64>>())
            .unwrap()
    };
    let (a_ptrs, b_ptrs) = (table(&a_bufs), table(&b_bufs));
    let flat: Vec<i32> = groups
        .iter()
        .flat_map(|&(lo, hi, s, e)| [lo as i32, hi as i32, s as i32, e as i32])
        .collect();
    let xb = h.f32(&x).unwrap();
    let gb = h.i32(&flat).unwrap();
    let rb = h.i32(&ranks.map(|r| r as i32)).unwrap();
    let sb = h.f32(&scales).unwrap();
    let t = h.f32(&poison(rows * max_rank)).unwrap();
    let out = h.f32(&base).unwrap();
    let grid = (3, groups.len() as u32, 1);
    h.launch(
        "moe_lora_shrink",
        grid,
        256,
        &[
            Arg::Ptr(h.ptr(&xb)),
            Arg::I32(fan_in as i32),
            Arg::Ptr(h.ptr(&gb)),
            Arg::Ptr(h.ptr(&a_ptrs)),
            Arg::Ptr(h.ptr(&rb)),
            Arg::Ptr(h.ptr(&t)),
        ],
    )
    .unwrap();
    h.launch(
        "moe_lora_expand",
        grid,
        256,
        &[
            Arg::Ptr(h.ptr(&t)),
            Arg::I32(fan_out as i32),
            Arg::Ptr(h.ptr(&gb)),
            Arg::Ptr(h.ptr(&b_ptrs)),
            Arg::Ptr(h.ptr(&rb)),
            Arg::Ptr(h.ptr(&sb)),
            Arg::Ptr(h.ptr(&out)),
        ],
    )
    .unwrap();
    assert_close(&h.read(&out).unwrap(), &want, 1e-5, "expert LoRA");
}

#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn argmax_and_seeded_sampling_kernels_agree_with_the_host() {
    require_gpu();
    let h = KernelHarness::new(SHAPES).unwrap();
    let vocab = 1000;
    let mut logits = random(70, 4 * vocab);
    // Row 3: a tie between ids 3 and 7 at the top; the lowest id wins.
    logits[3 * vocab + 3] = 5.0;
    logits[3 * vocab + 7] = 5.0;
    let lb = h.f32(&logits).unwrap();
    let out = h.i32(&[-1; 4]).unwrap();
    h.launch(
        "argmax_rows",
        (4, 1, 1),
        256,
        &[
            Arg::Ptr(h.ptr(&lb)),
            Arg::I32(vocab as i32),
            Arg::Ptr(h.ptr(&out)),
        ],
    )
    .unwrap();
    let got = h.read_i32(&out).unwrap();
    for r in 0..4 {
        assert_eq!(
            got[r] as u32,
            sampling::argmax(&logits[r * vocab..(r + 1) * vocab]),
            "row {r}"
        );
    }
    assert_eq!(got[3], 3);

    // Distinct logits, so top-k's cut is exact.
    let spread: Vec<f32> = (0..vocab)
        .map(|i| ((i * 37) % vocab) as f32 / 50.0)
        .collect();
    let by_logit = {
        let mut ids: Vec<usize> = (0..vocab).collect();
        ids.sort_by(|&a, &b| spread[b].total_cmp(&spread[a]));
        ids
    };
    // Three peaks holding 64.6%, 23.8% and 8.7% of the mass: top_p 0.9
    // keeps exactly those three, far from any rounding edge.
    let mut peaked = vec![0f32; vocab];
    peaked[700] = 10.0;
    peaked[200] = 9.0;
    peaked[900] = 8.0;
    let cases: [(&[f32], usize, f32, Vec<usize>); 3] = [
        (&spread, 1, 1.0, by_logit[..1].to_vec()),
        (&spread, 5, 1.0, by_logit[..5].to_vec()),
        (&peaked, 0, 0.9, vec![700, 200, 900]),
    ];
    for (row, top_k, top_p, kept) in cases {
        let lb = h.f32(row).unwrap();
        let mut drawn = Vec::new();
        for step in 0..40 {
            let u = step as f32 / 40.0;
            let run = || {
                let args_t = h.f32(&[1.0]).unwrap();
                let args_k = h.i32(&[top_k as i32]).unwrap();
                let args_p = h.f32(&[top_p]).unwrap();
                let args_u = h.f32(&[u]).unwrap();
                let out = h.i32(&[-1]).unwrap();
                h.launch(
                    "sample_rows",
                    (1, 1, 1),
                    1024,
                    &[
                        Arg::Ptr(h.ptr(&lb)),
                        Arg::I32(vocab as i32),
                        Arg::Ptr(h.ptr(&args_t)),
                        Arg::Ptr(h.ptr(&args_k)),
                        Arg::Ptr(h.ptr(&args_p)),
                        Arg::Ptr(h.ptr(&args_u)),
                        Arg::Ptr(h.ptr(&out)),
                    ],
                )
                .unwrap();
                h.read_i32(&out).unwrap()[0]
            };
            let token = run();
            assert_eq!(token, run(), "the same draw gives the same token");
            assert!(
                token >= 0 && kept.contains(&(token as usize)),
                "top_k {top_k} top_p {top_p} u {u}: {token} is outside the kept set {kept:?}"
            );
            drawn.push(token);
        }
        // u = 0 takes the first kept id in id order.
        assert_eq!(drawn[0] as usize, *kept.iter().min().unwrap());
        if kept.len() > 1 {
            drawn.sort_unstable();
            drawn.dedup();
            assert!(drawn.len() > 1, "draws spread over the kept set");
        }
    }
}

/// The e4m3 code nearest `v` (ties to the even code), saturating at
/// ±448, by search over every finite code: the host's reference for the
/// device's rounding.
fn e4m3_nearest(v: f32) -> u8 {
    use lorafleet_artifact::quantization::fp8_e4m3_to_f32 as value;
    let sign = if v.is_sign_negative() { 0x80 } else { 0 };
    let a = v.abs().min(448.0);
    let mut best = 0u8;
    for c in 0u8..0x7f {
        let (d, b) = ((value(c) - a).abs(), (value(best) - a).abs());
        if d < b || (d == b && c % 2 == 0 && best % 2 == 1) {
            best = c;
        }
    }
    sign | best
}

/// The W8A8 path as an FP8 layer runs it (`fp8_rows`, cuBLASLt's FP8
/// GEMM, `fp8_scale`) against the host: every token scale is max|x| / 448,
/// every code the e4m3 value nearest x / scale (both exactly), and y the
/// products of the codes' values times both scales, summed in f64. Within
/// 1e-3 relative: the products are exact, and Hopper's FP8 tensor cores
/// accumulate with fewer bits than f32 (1.8e-4 measured on an H100); a
/// wrong layout, transpose or scale is off by about 1.
#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn fp8_gemms_give_the_products_of_the_hosts_e4m3_codes() {
    use lorafleet_artifact::quantization::fp8_e4m3_to_f32 as value;
    require_gpu();
    let h = KernelHarness::new(SHAPES).unwrap();
    let (n, m, k) = (5, 48, 256);
    let mut x = random(41, n * k);
    // One row of zeros: its scale is 1 and its codes 0.
    x[k..2 * k].iter_mut().for_each(|v| *v = 0.0);
    let w = random(42, m * k);
    let w_scale: Vec<f32> = (0..m)
        .map(|o| {
            w[o * k..(o + 1) * k]
                .iter()
                .fold(0f32, |a, v| a.max(v.abs()))
                / 448.0
        })
        .collect();
    let w_codes: Vec<u8> = (0..m * k)
        .map(|i| e4m3_nearest(w[i] / w_scale[i / k]))
        .collect();
    let (y, xq, rs) = h.fp8_linear(&x, &w_codes, &w_scale, (n, m, k)).unwrap();
    for t in 0..n {
        let row = &x[t * k..(t + 1) * k];
        let amax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
        let s = if amax > 0.0 { amax / 448.0 } else { 1.0 };
        assert_eq!(rs[t].to_bits(), s.to_bits(), "token {t}'s scale");
        for (i, &v) in row.iter().enumerate() {
            assert_eq!(
                xq[t * k + i],
                e4m3_nearest(v / s),
                "token {t}, feature {i}: {v} / {s}"
            );
        }
    }
    let want: Vec<f32> = (0..n * m)
        .map(|i| {
            let (t, o) = (i / m, i % m);
            let dot: f64 = (0..k)
                .map(|j| f64::from(value(xq[t * k + j])) * f64::from(value(w_codes[o * k + j])))
                .sum();
            (dot * f64::from(rs[t]) * f64::from(w_scale[o])) as f32
        })
        .collect();
    assert_close(&y, &want, 1e-3, "FP8 GEMM");
}

/// DoRA's scale of each output row, computed on the device from the base
/// rows and a slot's A and Bᵀ (`dora_scales`), is the direct sum over
/// `W + s·B·A` that the CPU backend is checked against, to 1e-6.
#[test]
#[ignore = "needs a CUDA GPU: deploy/gpu-check.sh runs it"]
fn dora_scales_on_the_device_are_the_direct_sum_over_the_adapted_weight() {
    require_gpu();
    use lorafleet_engine::lora::{Factors, LoraModule};
    let h = KernelHarness::new(SHAPES).unwrap();
    // 300 inputs: more than one pass of the block's 256 threads.
    let (fan_in, width, rank) = (300usize, 24usize, 5usize);
    let w = random(90, width * fan_in);
    let m = LoraModule {
        rank,
        scale: 1.5,
        factors: Factors::F32 {
            a_t: random(91, fan_in * rank),
            b_t: random(92, rank * width),
        },
        magnitude: Some((0..width).map(|i| 1.0 + i as f32 / 10.0).collect()),
        bias: None,
    };
    let want = m
        .dora_scales(fan_in, |o, row| {
            row.copy_from_slice(&w[o * fan_in..(o + 1) * fan_in])
        })
        .unwrap();
    let (w_dev, a_dev, b_dev) = (
        h.f32(&w).unwrap(),
        h.f32(&m.a_f32()).unwrap(),
        h.f32(&m.b_t_f32()).unwrap(),
    );
    let g = h.f32(m.magnitude.as_ref().unwrap()).unwrap();
    h.launch(
        "dora_scales",
        (width as u32, 1, 1),
        256,
        &[
            Arg::Ptr(h.ptr(&w_dev)),
            Arg::I32(fan_in as i32),
            Arg::Ptr(h.ptr(&a_dev)),
            Arg::Ptr(h.ptr(&b_dev)),
            Arg::I32(width as i32),
            Arg::I32(rank as i32),
            Arg::F32(m.scale),
            Arg::Ptr(h.ptr(&g)),
        ],
    )
    .unwrap();
    assert_close(&h.read(&g).unwrap(), &want, 1e-6, "DoRA scales");
}
