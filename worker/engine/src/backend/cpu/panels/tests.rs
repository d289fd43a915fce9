//! The projection kernels against a naive reference, on every kernel this
//! CPU has.

use super::*;

fn random(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = crate::sampling::Rng::new(seed);
    (0..n).map(|_| rng.next_f64() as f32 - 0.5).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

fn bf16_bits(v: &[f32]) -> Vec<u16> {
    v.iter()
        .map(|v| half::bf16::from_f32(*v).to_bits())
        .collect()
}

fn widened(h: &[u16]) -> Vec<f32> {
    h.iter()
        .map(|&h| f32::from_bits(u32::from(h) << 16))
        .collect()
}

fn bf16_panels(lin: &PackedLinear) -> &[u16] {
    match &lin.panels {
        Panels::Bf16(all) => all,
        Panels::F32(_) | Panels::Quant(_) => panic!("the panels are not bf16"),
    }
}

#[test]
fn bf16_panels_give_the_bits_of_their_f32_widening() {
    // Every kernel widens each bf16 pattern (finite, subnormal, signed
    // zero) exactly, out of the pair layout, for odd and even fan_in.
    let patterns: Vec<u16> = (0..=u16::MAX).step_by(7).chain([0x8000, 0x0001]).collect();
    for (fan_in, fan_out) in [(97, 33), (64, 48), (1, 16), (130, 7)] {
        let w: Vec<u16> = (0..fan_in * fan_out)
            .map(|i| patterns[(i * 31) % patterns.len()])
            .collect();
        let narrow = PackedLinear::pack_bf16(&w, None, fan_in, fan_out);
        let wide = PackedLinear::pack(&widened(&w), None, fan_in, fan_out);
        for &kernel in &Kernel::available() {
            let mut got = vec![f32::NAN; wide.f32_panels().len()];
            kernel.widen_bf16(bf16_panels(&narrow), fan_in, &mut got);
            assert_eq!(
                bits(&got),
                bits(wide.f32_panels()),
                "{kernel:?} fan_in={fan_in}"
            );
        }
    }
    // Where bf16 is widened, projections give the bits of f32 weights.
    // (20, 301, 80): tiles of 8, 8 and 4 rows, groups of 3 and 2
    // panels, two blocks of KC inputs and an odd tail in the third.
    for (n, fan_in, fan_out) in [
        (7, 45, 9),
        (32, 77, 100),
        (3, 300, 48),
        (40, 64, 200),
        (20, 301, 80),
    ] {
        let x = random(1, n * fan_in);
        let w = bf16_bits(&random(2, fan_out * fan_in));
        let bias = random(3, fan_out);
        let narrow = PackedLinear::pack_bf16(&w, Some(bias.clone()), fan_in, fan_out);
        let wide = PackedLinear::pack(&widened(&w), Some(bias), fan_in, fan_out);
        let kpad = amx::padded(fan_in);
        assert_eq!(narrow.weight_bytes(), fan_out.div_ceil(NR) * kpad * NR * 2);
        for &kernel in &Kernel::available() {
            let (mut a, mut b) = (vec![0f32; n * fan_out], vec![0f32; n * fan_out]);
            narrow.forward_with(kernel, false, &x, n, &mut [&mut a]);
            wide.forward_with(kernel, false, &x, n, &mut [&mut b]);
            assert_eq!(
                bits(&a),
                bits(&b),
                "{kernel:?} n={n} fan_in={fan_in} fan_out={fan_out}"
            );
        }
    }
}

#[test]
fn k_major_bf16_panels_give_the_bits_of_their_f32_widening_in_every_kernel() {
    // Adapter slots keep bf16 in the f32 panel layout; `group` and
    // `gather` widen as they load, so every kernel, every tile size and
    // every panel count must give the bits of the widened panels.
    // fan_in past KC (and past 2 x KC) makes the AVX-512 group resume
    // its sums across k blocks.
    for (n, fan_in) in [(1, 16), (7, 40), (8, 96), (19, 33), (9, 300)] {
        let x = random(4, n * fan_in);
        let narrow: Vec<Vec<u16>> = (0..GROUP)
            .map(|q| bf16_bits(&random(5 + q as u64, fan_in * NR)))
            .collect();
        let wide: Vec<Vec<f32>> = narrow.iter().map(|p| widened(p)).collect();
        for &kernel in &Kernel::available() {
            for count in 1..=GROUP {
                let narrow: Vec<&[u16]> = narrow[..count].iter().map(|p| &p[..]).collect();
                let wide: Vec<&[f32]> = wide[..count].iter().map(|p| &p[..]).collect();
                let (mut a, mut b) = (vec![0f32; n * count * NR], vec![0f32; n * count * NR]);
                kernel.group(&x, fan_in, n, &narrow, Prefetch::NONE, &mut a);
                kernel.group(&x, fan_in, n, &wide, Prefetch::NONE, &mut b);
                assert_eq!(bits(&a), bits(&b), "{kernel:?} group n={n} panels={count}");
            }
            // Gathered rows, each with its own run of two panels.
            let rows = n.min(GATHER);
            let runs16: Vec<Vec<u16>> = (0..rows)
                .map(|r| bf16_bits(&random(20 + r as u64, 2 * fan_in * NR)))
                .collect();
            let runs32: Vec<Vec<f32>> = runs16.iter().map(|r| widened(r)).collect();
            let narrow: Vec<(&[f32], &[u16])> = (0..rows)
                .map(|r| (&x[r * fan_in..], &runs16[r][..]))
                .collect();
            let wide: Vec<(&[f32], &[f32])> = (0..rows)
                .map(|r| (&x[r * fan_in..], &runs32[r][..]))
                .collect();
            let (mut a, mut b) = (vec![0f32; rows * 2 * NR], vec![0f32; rows * 2 * NR]);
            kernel.gather(&narrow, fan_in, 2, &mut a);
            kernel.gather(&wide, fan_in, 2, &mut b);
            assert!(b.iter().any(|&v| v != 0.0));
            assert_eq!(bits(&a), bits(&b), "{kernel:?} gather rows={rows}");
        }
    }
}

#[test]
fn activations_split_into_three_bf16_parts_exactly() {
    let mut rng = crate::sampling::Rng::new(9);
    for i in 0..200_000 {
        // Magnitudes from 1e-30 to 1e30, both signs, and the edges.
        let v = match i {
            0 => 0.0,
            1 => -0.0,
            2 => f32::MAX,
            3 => f32::MIN_POSITIVE * 2f32.powi(24),
            _ => {
                let e = rng.next_f64() * 200.0 - 100.0;
                let s = if rng.next_f64() < 0.5 { -1.0 } else { 1.0 };
                (s * 2f64.powf(e) * (1.0 + rng.next_f64())) as f32
            }
        };
        let parts = amx::split(v);
        let sum: f64 = parts
            .iter()
            .map(|&h| f64::from(f32::from_bits(u32::from(h) << 16)))
            .sum();
        assert_eq!(sum, f64::from(v), "{v:e} split into {parts:04x?}");
    }
}

#[test]
fn amx_is_used_where_the_cpu_and_os_offer_it() {
    // The tile path must not turn itself off silently on a machine
    // that has it: that would only show as lost speed.
    let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let has = |f: &str| flags.split_whitespace().any(|w| w == f);
    if cfg!(all(target_arch = "x86_64", target_os = "linux")) && has("amx_tile") && has("amx_bf16")
    {
        assert!(amx::available(), "the CPU reports AMX but it is not used");
    }
    if !has("amx_tile") {
        assert!(!amx::available(), "AMX claimed without amx_tile");
    }
}

#[test]
fn amx_projections_are_as_accurate_as_f32_and_batch_invariant() {
    if !amx::available() {
        // Nothing to run the tiles on; the widened path is the one
        // this machine uses, and the test above covers it.
        return;
    }
    let kernel = Kernel::detect();
    for (n, fan_in, fan_out) in [
        (7, 45, 9),
        (33, 77, 100),
        (3, 300, 48),
        (40, 768, 200),
        (1, 2048, 64),
    ] {
        let x = random(1, n * fan_in);
        let w = bf16_bits(&random(2, fan_out * fan_in));
        let wf = widened(&w);
        let bias = random(3, fan_out);
        let lin = PackedLinear::pack_bf16(&w, Some(bias.clone()), fan_in, fan_out);
        let mut got = vec![f32::NAN; n * fan_out];
        lin.forward_with(kernel, true, &x, n, &mut [&mut got]);
        let mut fma = vec![0f32; n * fan_out];
        lin.forward_with(kernel, false, &x, n, &mut [&mut fma]);
        assert_ne!(
            bits(&got),
            bits(&fma),
            "the tiles ran (their rounding differs)"
        );
        // Against the exact sum: the error, relative to the sum of
        // |terms|, is within a few f32 roundings per addition, as an
        // f32 chain's is.
        let mut worst = (0f64, 0f64);
        for t in 0..n {
            for o in 0..fan_out {
                let (mut exact, mut mass) = (0f64, 0f64);
                for k in 0..fan_in {
                    let term = f64::from(x[t * fan_in + k]) * f64::from(wf[o * fan_in + k]);
                    exact += term;
                    mass += term.abs();
                }
                exact += f64::from(bias[o]);
                mass += f64::from(bias[o]).abs();
                let at = t * fan_out + o;
                worst.0 = worst.0.max((f64::from(got[at]) - exact).abs() / mass);
                worst.1 = worst.1.max((f64::from(fma[at]) - exact).abs() / mass);
            }
        }
        let bound = 3.0 * fan_in as f64 * f64::from(f32::EPSILON);
        assert!(
            worst.0 <= bound && worst.0 <= 8.0 * worst.1.max(f64::from(f32::EPSILON)),
            "fan_in={fan_in}: tiles {:e}, f32 chain {:e}",
            worst.0,
            worst.1
        );
        // Each token alone, and every prefix of the batch, gives the
        // bits it had in the batch.
        for m in [1, 2, 15, 16, 17, n] {
            let m = m.min(n);
            let mut part = vec![f32::NAN; m * fan_out];
            lin.forward_with(kernel, true, &x[..m * fan_in], m, &mut [&mut part]);
            assert_eq!(bits(&part), bits(&got[..m * fan_out]), "first {m} of {n}");
        }
        for t in 0..n {
            let mut alone = vec![f32::NAN; fan_out];
            lin.forward_with(
                kernel,
                true,
                &x[t * fan_in..][..fan_in],
                1,
                &mut [&mut alone],
            );
            assert_eq!(
                bits(&alone),
                bits(&got[t * fan_out..][..fan_out]),
                "token {t} of {n}"
            );
        }
    }
}

#[test]
fn no_rows_give_no_outputs() {
    let lin = PackedLinear::pack(&random(2, 3 * 13), Some(random(3, 3)), 13, 3);
    lin.forward(&[], 0, &mut []);
    lin.forward_parts(&[], 0, &mut [&mut [], &mut []]);
    let [a, b] = lin.forward_split(&[], 0, [1, 2]);
    assert!(a.is_empty() && b.is_empty());
}

#[test]
fn every_kernel_gives_the_same_bits_alone_or_in_any_batch() {
    // Odd sizes exercise every edge: a padded last panel, an odd panel
    // count, and every remainder of tokens past the last full tile.
    let kernels = Kernel::available();
    for (n, fan_in, fan_out) in [
        (7, 45, 9),
        (13, 64, 50),
        (1, 13, 3),
        (6, 8, 33),
        (32, 77, 40),
        (17, 300, 48),
    ] {
        let x = random(1, n * fan_in);
        let w = random(2, fan_out * fan_in);
        let bias = random(3, fan_out);
        let lin = PackedLinear::pack(&w, Some(bias.clone()), fan_in, fan_out);
        // The definition: one fused chain per output, then the bias.
        let mut want = vec![0f32; n * fan_out];
        for t in 0..n {
            for o in 0..fan_out {
                let mut acc = 0f32;
                for k in 0..fan_in {
                    acc = x[t * fan_in + k].mul_add(w[o * fan_in + k], acc);
                }
                want[t * fan_out + o] = acc + bias[o];
            }
        }
        let mut got = vec![0f32; n * fan_out];
        lin.forward(&x, n, &mut got);
        assert_eq!(bits(&got), bits(&want), "forward n={n} fan_in={fan_in}");
        // Split into parts whose edges fall inside panels and groups,
        // each part gets its own columns with the same bits.
        let widths = [
            fan_out / 3 + 1,
            fan_out / 2,
            fan_out - fan_out / 3 - 1 - fan_out / 2,
        ];
        let mut parts: Vec<Vec<f32>> = widths.iter().map(|w| vec![f32::NAN; n * w]).collect();
        let mut views: Vec<&mut [f32]> = parts.iter_mut().map(|p| &mut p[..]).collect();
        lin.forward_parts(&x, n, &mut views);
        let mut joined = Vec::new();
        for t in 0..n {
            for (part, &w) in parts.iter().zip(&widths) {
                joined.extend_from_slice(&part[t * w..(t + 1) * w]);
            }
        }
        assert_eq!(
            bits(&joined),
            bits(&want),
            "forward_parts n={n} fan_out={fan_out}"
        );
        // Into new buffers, never zeroed: the same bits again.
        let split = lin.forward_split(&x, n, widths);
        for (got, part) in split.iter().zip(&parts) {
            assert_eq!(
                bits(got),
                bits(part),
                "forward_split n={n} fan_out={fan_out}"
            );
        }
        for &kernel in &kernels {
            for p in 0..fan_out.div_ceil(NR) {
                let mut single = vec![0f32; n * NR];
                kernel.single(&x, fan_in, n, lin.panel(p), &mut single);
                for t in 0..n {
                    for j in 0..NR.min(fan_out - p * NR) {
                        let o = p * NR + j;
                        assert_eq!(
                            (single[t * NR + j] + bias[o]).to_bits(),
                            want[t * fan_out + o].to_bits(),
                            "{kernel:?} single n={n} t={t} o={o}"
                        );
                    }
                }
                // Each token alone gives the bits it had in the batch.
                for t in 0..n {
                    let mut alone = vec![0f32; NR];
                    let row = &x[t * fan_in..(t + 1) * fan_in];
                    kernel.single(row, fan_in, 1, lin.panel(p), &mut alone);
                    assert_eq!(bits(&alone), bits(&single[t * NR..(t + 1) * NR]));
                }
            }
            // Gathered rows, each against its own panel, give the bits
            // `single` gave each of them.
            // Runs of one or two panels, starting where each row says.
            let count = fan_out.div_ceil(NR);
            let run = if count > 1 { 2 } else { 1 };
            let first: Vec<usize> = (0..n).map(|t| (t * 5 + 1) % (count - run + 1)).collect();
            for lo in (0..n).step_by(GATHER) {
                let hi = (lo + GATHER).min(n);
                let rows: Vec<(&[f32], &[f32])> = (lo..hi)
                    .map(|t| {
                        let at = first[t] * fan_in * NR;
                        (
                            &x[t * fan_in..(t + 1) * fan_in],
                            &lin.f32_panels()[at..at + run * fan_in * NR],
                        )
                    })
                    .collect();
                let mut gathered = vec![0f32; rows.len() * run * NR];
                kernel.gather(&rows, fan_in, run, &mut gathered);
                for t in lo..hi {
                    for q in 0..run {
                        let mut alone = vec![0f32; NR];
                        let row = &x[t * fan_in..(t + 1) * fan_in];
                        kernel.single(row, fan_in, 1, lin.panel(first[t] + q), &mut alone);
                        let at = ((t - lo) * run + q) * NR;
                        assert_eq!(
                            bits(&gathered[at..at + NR]),
                            bits(&alone),
                            "{kernel:?} gather n={n} t={t} panel {q}"
                        );
                    }
                }
            }
            for count in 1..=GROUP.min(fan_out.div_ceil(NR)) {
                let panels: Vec<&[f32]> = (0..count).map(|p| lin.panel(p)).collect();
                let mut group = vec![0f32; n * count * NR];
                kernel.group(&x, fan_in, n, &panels, Prefetch::NONE, &mut group);
                for t in 0..n {
                    for o in 0..(count * NR).min(fan_out) {
                        assert_eq!(
                            (group[t * count * NR + o] + bias[o]).to_bits(),
                            want[t * fan_out + o].to_bits(),
                            "{kernel:?} group of {count} n={n} t={t} o={o}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn a_projection_on_this_thread_gives_the_bits_of_the_team_one() {
    // Expert LoRA runs its small projections one per thread; a row's
    // result must not depend on whether the team or one thread ran it,
    // nor on the rows beside it. Shapes: rank-wide (one group of panels)
    // and wide (many groups, a ragged last panel).
    for (fan_in, fan_out) in [(96, 16), (16, 200), (130, 5)] {
        let lin = PackedLinear::pack(&random(1, fan_in * fan_out), None, fan_in, fan_out);
        let x = random(2, 7 * fan_in);
        let mut team = vec![0f32; 7 * fan_out];
        lin.forward(&x, 7, &mut team);
        let base = random(3, 7 * fan_out);
        let mut local = base.clone();
        lin.add_scaled_on_this_thread(&x, 7, 0.5, &mut local);
        let want: Vec<f32> = base.iter().zip(&team).map(|(b, t)| b + 0.5 * t).collect();
        assert_eq!(bits(&local), bits(&want), "{fan_in} -> {fan_out}");
        // Row 3 alone.
        let mut alone = base[3 * fan_out..4 * fan_out].to_vec();
        lin.add_scaled_on_this_thread(&x[3 * fan_in..4 * fan_in], 1, 0.5, &mut alone);
        assert_eq!(bits(&alone), bits(&want[3 * fan_out..4 * fan_out]));
    }
}
