//! The MLP's activation, `silu(gate) · up`, on vectors (and GeGLU's and
//! GPT-OSS's clamped SwiGLU, elementwise).
//!
//! `silu(g) = g / (1 + e^-g)`. The exponential is computed here rather than
//! by the C library, one element at a time, because the scalar call was
//! about 5% of a decode step. Every kernel runs the same operations in the
//! same order (the range reduction and polynomial below, with fused
//! multiply-adds where written), so all of them give the same bits, and an
//! element's value depends on nothing but its gate and up: batch-invariant.
//!
//! `e^x = 2^n · e^r`, with `n = round(x · log2 e)` (ties to even) and
//! `r = x - n · ln 2` in two parts (Cody and Waite; `n · LN2_HI` is exact),
//! `|r| <= ln 2 / 2`, and `e^r` by its Taylor polynomial of degree 7
//! (truncation error below 1e-8 relative). `2^n` is built from its
//! exponent bits, so `x` is clamped to `[EXP_LO, EXP_HI]`, where `n` runs
//! from -127 (bits 0: `e^x` taken as 0, so `silu(g)` is `g`, for gates
//! above about 88) to 128 (the bits of infinity: `silu(g)` is -0, for gates
//! below about -88.4, whose exact value is below 4e-37 in magnitude).

use super::panels::Kernel;

const LOG2_E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_LO: f32 = -88.0;
const EXP_HI: f32 = 88.8;
/// `1 / k!` for `k = 7` down to 0, in Horner order.
const TAYLOR: [f32; 8] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// `out[i] = silu(gate[i]) · up[i]`.
pub fn silu_mul(kernel: Kernel, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == out.len() && up.len() == out.len());
    match kernel {
        Kernel::Portable => {
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = silu_mul_one(g, u);
            }
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `detect`/`available` chose this kernel only where the CPU
        // has AVX2 and FMA; the lengths were asserted above.
        #[allow(unsafe_code)]
        Kernel::Avx2 => unsafe { x86::silu_mul_avx2(gate, up, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, with AVX-512F.
        #[allow(unsafe_code)]
        Kernel::Avx512 => unsafe { x86::silu_mul_avx512(gate, up, out) },
    }
}

/// `gelu(gate) · up` with GELU's tanh approximation (Gemma's
/// `gelu_pytorch_tanh`), as PyTorch computes it in f32:
/// `0.5 · g · (1 + tanh(√(2/π) · (g + 0.044715 · g³)))`.
pub fn gelu_tanh_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == out.len() && up.len() == out.len());
    const BETA: f32 = (std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5) as f32;
    const KAPPA: f32 = 0.044715;
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let inner = BETA * (g + KAPPA * g * g * g);
        *o = 0.5 * g * (1.0 + inner.tanh()) * u;
    }
}

/// GPT-OSS's clamped SwiGLU, as transformers' `GptOssExperts`: `g =
/// min(gate, limit)`, `u = clamp(up, -limit, limit)`, `out = (u + 1) · g ·
/// σ(alpha · g)`, with `σ(x) = 1 / (1 + e^-x)`.
pub fn clamped_swiglu(gate: &[f32], up: &[f32], alpha: f32, limit: f32, out: &mut [f32]) {
    assert!(gate.len() == out.len() && up.len() == out.len());
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let g = g.min(limit);
        let u = u.clamp(-limit, limit);
        let glu = g * (1.0 / (1.0 + (-(g * alpha)).exp()));
        *o = (u + 1.0) * glu;
    }
}

/// The reference the vector kernels follow operation for operation.
fn silu_mul_one(g: f32, u: f32) -> f32 {
    let x = (-g).clamp(EXP_LO, EXP_HI);
    let n = (x * LOG2_E).round_ties_even();
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let p = TAYLOR[1..].iter().fold(TAYLOR[0], |p, &c| p.mul_add(r, c));
    let e = p * f32::from_bits(((n as i32 + 127) as u32) << 23);
    g / (1.0 + e) * u
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86 {
    use std::arch::x86_64::*;

    use super::{EXP_HI, EXP_LO, LN2_HI, LN2_LO, LOG2_E, TAYLOR};

    const ROUND: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

    /// `-v` as the scalar code negates: the sign bit flipped (zero's too).
    #[inline(always)]
    unsafe fn neg512(v: __m512) -> __m512 {
        // SAFETY: inlined into a function that enables AVX-512F.
        unsafe {
            _mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(v),
                _mm512_set1_epi32(i32::MIN),
            ))
        }
    }

    /// # Safety
    /// The CPU has AVX-512F; the three slices have one length.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn silu_mul_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let len = out.len();
        let mut i = 0;
        while i < len {
            // A partial last vector through a mask, so that it runs the
            // same operations as the others.
            let mask: __mmask16 = if len - i >= 16 {
                0xffff
            } else {
                (1u16 << (len - i)) - 1
            };
            // SAFETY: the mask keeps every access below `len` in all three.
            unsafe {
                let g = _mm512_maskz_loadu_ps(mask, gate.as_ptr().add(i));
                let u = _mm512_maskz_loadu_ps(mask, up.as_ptr().add(i));
                let x = neg512(g);
                let x = _mm512_min_ps(
                    _mm512_max_ps(x, _mm512_set1_ps(EXP_LO)),
                    _mm512_set1_ps(EXP_HI),
                );
                let n = _mm512_roundscale_ps::<ROUND>(_mm512_mul_ps(x, _mm512_set1_ps(LOG2_E)));
                let minus_n = neg512(n);
                let r = _mm512_fmadd_ps(minus_n, _mm512_set1_ps(LN2_HI), x);
                let r = _mm512_fmadd_ps(minus_n, _mm512_set1_ps(LN2_LO), r);
                let mut p = _mm512_set1_ps(TAYLOR[0]);
                for &c in &TAYLOR[1..] {
                    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
                }
                let two_n = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
                    _mm512_cvtps_epi32(n),
                    _mm512_set1_epi32(127),
                )));
                let e = _mm512_mul_ps(p, two_n);
                let s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0), e));
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), mask, _mm512_mul_ps(s, u));
            }
            i += 16;
        }
    }

    /// # Safety
    /// The CPU has AVX2 and FMA; the three slices have one length.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let len = out.len();
        let mut i = 0;
        while i < len {
            let left = (len - i).min(8) as i32;
            // Lanes below `left` on, as `maskload` wants: the sign bit set.
            let mask = _mm256_cmpgt_epi32(
                _mm256_set1_epi32(left),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            );
            // SAFETY: the mask keeps every access below `len` in all three.
            unsafe {
                let g = _mm256_maskload_ps(gate.as_ptr().add(i), mask);
                let u = _mm256_maskload_ps(up.as_ptr().add(i), mask);
                let x = _mm256_xor_ps(g, _mm256_set1_ps(-0.0));
                let x = _mm256_min_ps(
                    _mm256_max_ps(x, _mm256_set1_ps(EXP_LO)),
                    _mm256_set1_ps(EXP_HI),
                );
                let n = _mm256_round_ps::<ROUND>(_mm256_mul_ps(x, _mm256_set1_ps(LOG2_E)));
                let minus_n = _mm256_xor_ps(n, _mm256_set1_ps(-0.0));
                let r = _mm256_fmadd_ps(minus_n, _mm256_set1_ps(LN2_HI), x);
                let r = _mm256_fmadd_ps(minus_n, _mm256_set1_ps(LN2_LO), r);
                let mut p = _mm256_set1_ps(TAYLOR[0]);
                for &c in &TAYLOR[1..] {
                    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
                }
                let two_n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                    _mm256_cvtps_epi32(n),
                    _mm256_set1_epi32(127),
                )));
                let e = _mm256_mul_ps(p, two_n);
                let s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e));
                _mm256_maskstore_ps(out.as_mut_ptr().add(i), mask, _mm256_mul_ps(s, u));
            }
            i += 8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values() -> Vec<f32> {
        let mut rng = crate::sampling::Rng::new(11);
        let mut v: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            87.5,
            -87.5,
            88.2,
            -88.2,
            88.5,
            -88.5,
            200.0,
            -200.0,
            1e30,
            -1e30,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        v.extend((0..20_000).map(|_| (rng.next_f64() * 60.0 - 30.0) as f32));
        v.extend((0..2_000).map(|_| (rng.next_f64() * 400.0 - 200.0) as f32));
        v.extend((0..2_000).map(|_| (rng.next_f64() * 1e-3 - 5e-4) as f32));
        // An odd length, so that every kernel runs a partial last vector.
        v.push(3.25);
        v
    }

    #[test]
    fn every_kernel_gives_the_bits_of_the_reference_tails_included() {
        let gate = values();
        let up: Vec<f32> = gate.iter().map(|g| 0.5 - g * 0.01).collect();
        let want: Vec<u32> = gate
            .iter()
            .zip(&up)
            .map(|(&g, &u)| silu_mul_one(g, u).to_bits())
            .collect();
        for &kernel in &Kernel::available() {
            // Every length from 1 to 40 too: each tail size of each width.
            for len in (1..=40).chain([gate.len()]) {
                let mut out = vec![f32::NAN; len];
                silu_mul(kernel, &gate[..len], &up[..len], &mut out);
                let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want[..len], "{kernel:?} len={len}");
            }
        }
    }

    #[test]
    fn silu_is_within_a_few_ulp_of_the_exact_value() {
        for g in values().into_iter().filter(|g| g.is_finite()) {
            let exact = f64::from(g) / (1.0 + (-f64::from(g)).exp());
            let got = f64::from(silu_mul_one(g, 1.0));
            // Relative 1e-6 (a few ulp of f32), and absolute 4e-37 for the
            // gates below -88.4 whose exponential is taken as infinite.
            assert!(
                (got - exact).abs() <= 1e-6 * exact.abs() + 4e-37,
                "silu({g}) = {got}, exactly {exact}"
            );
        }
    }
}
