//! The x86-64 projection tiles (AVX2 and AVX-512): register-blocked
//! multiply-add chains over packed panels.

use super::NR;
use std::arch::x86_64::*;

/// Splits `n` rows into tiles of `$mr` and the rest, each tile run by
/// `tile::<M>` with `M` known at compile time so its accumulators stay
/// in registers. A rest of one or two rows would be a tile with too few
/// independent chains to keep the multiply-add units busy (each waits
/// on its own last result), so it is merged with the last full tile and
/// split in halves: 32 rows in tiles of 6 run as 6, 6, 6, 6, 4, 4.
macro_rules! tiles {
    ($mr:literal, $n:expr, $tile:ident [$($g:tt),*] ( $($arg:expr),* )) => {{
        let n = $n;
        let (mut full, mut rest) = (n / $mr, n % $mr);
        if full > 0 && (1..3).contains(&rest) {
            full -= 1;
            rest += $mr;
        }
        let mut t = 0;
        for _ in 0..full {
            $tile::<$mr, $($g),*>(t, $($arg),*);
            t += $mr;
        }
        let halves = if rest > $mr { [rest.div_ceil(2), rest / 2] } else { [rest, 0] };
        for m in halves {
            match m {
                0 => {}
                1 => $tile::<1, $($g),*>(t, $($arg),*),
                2 => $tile::<2, $($g),*>(t, $($arg),*),
                3 => $tile::<3, $($g),*>(t, $($arg),*),
                4 => $tile::<4, $($g),*>(t, $($arg),*),
                5 => $tile::<5, $($g),*>(t, $($arg),*),
                6 => $tile::<6, $($g),*>(t, $($arg),*),
                7 => $tile::<7, $($g),*>(t, $($arg),*),
                _ => unreachable!("tiles of at most 8"),
            }
            t += m;
        }
    }};
}

/// Eight consecutive panel values at `p` as f32: bf16 bits are
/// zero-extended and shifted into the top half, which is exact. Inlined
/// into callers that enable AVX2.
#[inline(always)]
unsafe fn load8<W: super::PanelValue>(p: *const W) -> __m256 {
    // SAFETY: the caller keeps the eight values inside its panel.
    unsafe {
        if W::BF16 {
            let bits = _mm_loadu_si128(p.cast());
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits)))
        } else {
            _mm256_loadu_ps(p.cast())
        }
    }
}

/// Sixteen consecutive panel values at `p` as f32, as [`load8`]. Inlined
/// into callers that enable AVX-512F.
#[inline(always)]
unsafe fn load16<W: super::PanelValue>(p: *const W) -> __m512 {
    // SAFETY: the caller keeps the sixteen values inside its panel.
    unsafe {
        if W::BF16 {
            let bits = _mm256_loadu_si256(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits)))
        } else {
            _mm512_loadu_ps(p.cast())
        }
    }
}

/// # Safety
/// The CPU has AVX2 and FMA; `x` holds `n` rows of `fan_in`, `panel`
/// `fan_in * NR` values and `out` `n * NR`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn single_avx2<W: super::PanelValue>(
    x: &[f32],
    fan_in: usize,
    n: usize,
    panel: &[W],
    out: &mut [f32],
) {
    #[inline(always)]
    unsafe fn tile<const M: usize, W: super::PanelValue>(
        t: usize,
        x: *const f32,
        fan_in: usize,
        w: *const W,
        out: *mut f32,
    ) {
        // SAFETY (whole body): rows t..t+M < n and k < fan_in keep every
        // read inside x and the panel; writes stay in rows t..t+M of out.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 2]; M];
            // The first tile streams the panel in from memory; it also
            // asks for the panel after it (the next one in memory), a
            // row per step, so the next call finds it in L2.
            let next = w.wrapping_add(fan_in * NR);
            for k in 0..fan_in {
                if t == 0 {
                    _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(k * NR).cast());
                }
                let w0 = load8(w.add(k * NR));
                let w1 = load8(w.add(k * NR + 8));
                for (m, a) in acc.iter_mut().enumerate() {
                    let xv = _mm256_broadcast_ss(&*x.add((t + m) * fan_in + k));
                    a[0] = _mm256_fmadd_ps(xv, w0, a[0]);
                    a[1] = _mm256_fmadd_ps(xv, w1, a[1]);
                }
            }
            for (m, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add((t + m) * NR), a[0]);
                _mm256_storeu_ps(out.add((t + m) * NR + 8), a[1]);
            }
        }
    }
    let (xp, wp, op) = (x.as_ptr(), panel.as_ptr(), out.as_mut_ptr());
    // SAFETY: see the function's contract.
    unsafe { tiles!(6, n, tile[W](xp, fan_in, wp, op)) }
}

/// # Safety
/// The CPU has AVX2 and FMA; 1 to `GATHER` rows, each `x` at least
/// `fan_in` values and each run of panels `panels * fan_in * NR`; `out`
/// `rows.len() * panels * NR`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn gather_avx2<W: super::PanelValue>(
    rows: &[(&[f32], &[W])],
    fan_in: usize,
    panels: usize,
    out: &mut [f32],
) {
    #[inline(always)]
    unsafe fn tile<const M: usize, W: super::PanelValue>(
        rows: &[(&[f32], &[W])],
        fan_in: usize,
        panels: usize,
        out: *mut f32,
    ) {
        let x: [*const f32; M] = std::array::from_fn(|m| rows[m].0.as_ptr());
        let width = panels * NR;
        for p in 0..panels {
            let w: [*const W; M] = std::array::from_fn(|m| rows[m].1[p * fan_in * NR..].as_ptr());
            // SAFETY (whole body): k < fan_in keeps every read inside
            // each row's x and panel p; writes stay in rows 0..M, columns
            // of panel p, of out.
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); 2]; M];
                for k in 0..fan_in {
                    for (m, a) in acc.iter_mut().enumerate() {
                        let xv = _mm256_broadcast_ss(&*x[m].add(k));
                        let w0 = load8(w[m].add(k * NR));
                        let w1 = load8(w[m].add(k * NR + 8));
                        a[0] = _mm256_fmadd_ps(xv, w0, a[0]);
                        a[1] = _mm256_fmadd_ps(xv, w1, a[1]);
                    }
                }
                for (m, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.add(m * width + p * NR), a[0]);
                    _mm256_storeu_ps(out.add(m * width + p * NR + 8), a[1]);
                }
            }
        }
    }
    let op = out.as_mut_ptr();
    // SAFETY: see the function's contract.
    unsafe {
        match rows.len() {
            1 => tile::<1, W>(rows, fan_in, panels, op),
            2 => tile::<2, W>(rows, fan_in, panels, op),
            3 => tile::<3, W>(rows, fan_in, panels, op),
            4 => tile::<4, W>(rows, fan_in, panels, op),
            5 => tile::<5, W>(rows, fan_in, panels, op),
            6 => tile::<6, W>(rows, fan_in, panels, op),
            _ => unreachable!("1 to GATHER rows"),
        }
    }
}

/// # Safety
/// The CPU has AVX2; `src` is one pair-layout panel of at least
/// `fan_in` (rounded up to even) inputs and `dst` `fan_in * NR` values.
#[target_feature(enable = "avx2")]
pub unsafe fn widen_avx2(src: &[u16], fan_in: usize, dst: &mut [f32]) {
    // Each 32-bit lane holds one output's pair: the low half is input
    // 2r, the high half input 2r + 1.
    let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    for r in 0..fan_in / 2 {
        for h in 0..2 {
            // SAFETY: pair row r < fan_in / 2 lies in the panel, and
            // inputs 2r and 2r + 1 < fan_in in dst.
            unsafe {
                let v = _mm256_loadu_si256(src.as_ptr().add(r * 2 * NR + h * 16).cast());
                let even = _mm256_slli_epi32::<16>(v);
                let odd = _mm256_and_si256(v, high);
                let d = dst.as_mut_ptr().add(2 * r * NR + h * 8);
                _mm256_storeu_ps(d, _mm256_castsi256_ps(even));
                _mm256_storeu_ps(d.add(NR), _mm256_castsi256_ps(odd));
            }
        }
    }
    if fan_in % 2 == 1 {
        // An odd last input (no model has one) the simple way, with
        // the rest again.
        super::widen_portable(src, fan_in, dst);
    }
}

/// # Safety
/// The CPU has AVX-512F; `x` holds `n` rows of `fan_in`, each panel
/// `fan_in * NR` values, and `out` `n * panels.len() * NR`; 1 to 3 panels.
#[target_feature(enable = "avx512f")]
pub unsafe fn group_avx512<W: super::PanelValue>(
    x: &[f32],
    fan_in: usize,
    n: usize,
    panels: &[&[W]],
    ahead: super::Prefetch,
    out: &mut [f32],
) {
    // Every k of every tile is one tick: spread the lines of `ahead`
    // evenly over them.
    let tiles = n.div_ceil(8);
    let mut pf = Ahead::new(ahead, tiles * fan_in);
    // SAFETY: the caller's contract, for each panel count.
    unsafe {
        match panels.len() {
            1 => group::<1, W>(x, fan_in, n, starts(panels), &mut pf, out),
            2 => group::<2, W>(x, fan_in, n, starts(panels), &mut pf, out),
            3 => group::<3, W>(x, fan_in, n, starts(panels), &mut pf, out),
            _ => unreachable!("1 to 3 panels"),
        }
    }
}

/// Software prefetch of a region into L2, a cache line at a time, at a
/// steady rate over a known number of ticks.
struct Ahead {
    at: *const i8,
    end: *const i8,
    /// Ticks between two bursts, and lines per burst.
    every: usize,
    lines: usize,
    countdown: usize,
}

impl Ahead {
    fn new(region: super::Prefetch, ticks: usize) -> Ahead {
        let lines = region.bytes.div_ceil(64);
        let ticks = ticks.max(1);
        let (every, per) = if lines >= ticks {
            (1, lines.div_ceil(ticks))
        } else {
            (ticks / lines.max(1), 1)
        };
        Ahead {
            at: region.start.cast(),
            end: region.start.wrapping_add(region.bytes).cast(),
            every,
            lines: per,
            countdown: every,
        }
    }

    #[inline(always)]
    fn tick(&mut self) {
        self.countdown -= 1;
        if self.countdown == 0 {
            self.countdown = self.every;
            for _ in 0..self.lines {
                if self.at < self.end {
                    // SAFETY: a prefetch is a hint that never faults;
                    // the address lies inside the caller's slice.
                    unsafe { _mm_prefetch::<_MM_HINT_T1>(self.at) };
                    self.at = self.at.wrapping_add(64);
                }
            }
        }
    }
}

/// One tile of `M` rows by `P` panels over inputs `k0..k1`: the
/// AVX-512 register tile every group call runs. `w[q]` points at input
/// `kw` of panel `q` (0 for whole panels, `k0` for a block widened into
/// scratch).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile512<const M: usize, const P: usize, W: super::PanelValue>(
    t: usize,
    x: *const f32,
    fan_in: usize,
    k0: usize,
    k1: usize,
    kw: usize,
    w: [*const W; P],
    pf: &mut Ahead,
    out: *mut f32,
) {
    let width = P * NR;
    // SAFETY (whole body): rows t..t+M < n, kw <= k < fan_in and q < P
    // keep every access inside x, the panels and rows t..t+M of out.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); P]; M];
        if k0 > 0 {
            // Resume the chains where the last pass stored them:
            // a store and a load do not change a value.
            for (m, a) in acc.iter_mut().enumerate() {
                for (q, v) in a.iter_mut().enumerate() {
                    *v = _mm512_loadu_ps(out.add((t + m) * width + q * NR));
                }
            }
        }
        for k in k0..k1 {
            pf.tick();
            let mut wv = [_mm512_setzero_ps(); P];
            for (q, v) in wv.iter_mut().enumerate() {
                *v = load16(w[q].add((k - kw) * NR));
            }
            for (m, a) in acc.iter_mut().enumerate() {
                let xv = _mm512_set1_ps(*x.add((t + m) * fan_in + k));
                for (v, &wq) in a.iter_mut().zip(&wv) {
                    *v = _mm512_fmadd_ps(xv, wq, *v);
                }
            }
        }
        for (m, a) in acc.iter().enumerate() {
            for (q, &v) in a.iter().enumerate() {
                _mm512_storeu_ps(out.add((t + m) * width + q * NR), v);
            }
        }
    }
}

#[inline(always)]
unsafe fn group<const P: usize, W: super::PanelValue>(
    x: &[f32],
    fan_in: usize,
    n: usize,
    w: [*const W; P],
    pf: &mut Ahead,
    out: &mut [f32],
) {
    let (xp, op) = (x.as_ptr(), out.as_mut_ptr());
    let mut k0 = 0;
    while k0 < fan_in {
        let k1 = (k0 + super::KC).min(fan_in);
        // SAFETY: see the function's contract.
        unsafe { tiles!(8, n, tile512[P, W](xp, fan_in, k0, k1, 0, w, pf, op)) }
        k0 = k1;
    }
}

/// # Safety
/// The CPU has AVX-512F; `x` holds `n` rows of `fan_in`, `src` panels
/// `first..first + count` (1 to 3) of `fan_in` inputs, `scratch` holds
/// `count * KC * NR` values and `out` `n * count * NR`.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn group_widened_avx512<S: super::Widen>(
    x: &[f32],
    fan_in: usize,
    n: usize,
    first: usize,
    count: usize,
    src: &S,
    scratch: &mut [f32],
    ahead: super::Prefetch,
    out: &mut [f32],
) {
    let tiles = n.div_ceil(8);
    let mut pf = Ahead::new(ahead, tiles * fan_in);
    // SAFETY: the caller's contract, for each panel count.
    unsafe {
        match count {
            1 => widened::<1, S>(x, fan_in, n, first, src, scratch, &mut pf, out),
            2 => widened::<2, S>(x, fan_in, n, first, src, scratch, &mut pf, out),
            3 => widened::<3, S>(x, fan_in, n, first, src, scratch, &mut pf, out),
            _ => unreachable!("1 to 3 panels"),
        }
    }
}

/// [`group`] on panels that widen a block at a time: each block of `KC`
/// inputs of each panel is widened into `scratch` (24 KB for three
/// panels, so it stays in L1) just before its tiles run. The tiles are
/// [`group`]'s, on the widened values.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn widened<const P: usize, S: super::Widen>(
    x: &[f32],
    fan_in: usize,
    n: usize,
    first: usize,
    src: &S,
    scratch: &mut [f32],
    pf: &mut Ahead,
    out: &mut [f32],
) {
    let (xp, op) = (x.as_ptr(), out.as_mut_ptr());
    let block = super::KC * NR;
    let mut k0 = 0;
    while k0 < fan_in {
        let k1 = (k0 + super::KC).min(fan_in);
        for (q, dst) in scratch.chunks_exact_mut(block).take(P).enumerate() {
            src.widen(first + q, k0, k1, &mut dst[..(k1 - k0) * NR]);
        }
        let sp = scratch.as_ptr();
        // SAFETY: block q of scratch holds inputs k0..k1 of panel q.
        let ws: [*const f32; P] = std::array::from_fn(|q| unsafe { sp.add(q * block) });
        // SAFETY: see the function's contract.
        unsafe { tiles!(8, n, tile512[P, f32](xp, fan_in, k0, k1, k0, ws, pf, op)) }
        k0 = k1;
    }
}

/// # Safety
/// The CPU has AVX-512F; `x` holds `n` rows of `fan_in`, each panel is
/// a pair-layout bf16 panel of at least `fan_in` (rounded up to even)
/// inputs, `scratch` holds `panels.len() * KC * NR` values and `out`
/// `n * panels.len() * NR`; 1 to 3 panels.
#[target_feature(enable = "avx512f")]
pub unsafe fn group_pairs_avx512(
    x: &[f32],
    fan_in: usize,
    n: usize,
    panels: &[&[u16]],
    scratch: &mut [f32],
    ahead: super::Prefetch,
    out: &mut [f32],
) {
    let tiles = n.div_ceil(8);
    let mut pf = Ahead::new(ahead, tiles * fan_in);
    // SAFETY: the caller's contract, for each panel count.
    unsafe {
        match panels.len() {
            1 => pairs::<1>(x, fan_in, n, starts(panels), scratch, &mut pf, out),
            2 => pairs::<2>(x, fan_in, n, starts(panels), scratch, &mut pf, out),
            3 => pairs::<3>(x, fan_in, n, starts(panels), scratch, &mut pf, out),
            _ => unreachable!("1 to 3 panels"),
        }
    }
}

/// The first `P` panels' start pointers, for the kernels that take
/// their panel count at compile time.
fn starts<W, const P: usize>(panels: &[&[W]]) -> [*const W; P] {
    std::array::from_fn(|q| panels[q].as_ptr())
}

/// [`group`] on bf16 pair-layout panels: each block of `KC` inputs is
/// widened into `scratch` (24 KB for three panels, so it stays in L1)
/// just before its tiles run, instead of widening whole panels into a
/// copy that only L2 holds. The tiles are [`group`]'s, on the same
/// values, so the bits are those of the f32 widening.
#[inline(always)]
unsafe fn pairs<const P: usize>(
    x: &[f32],
    fan_in: usize,
    n: usize,
    w: [*const u16; P],
    scratch: &mut [f32],
    pf: &mut Ahead,
    out: &mut [f32],
) {
    let (xp, op, sp) = (x.as_ptr(), out.as_mut_ptr(), scratch.as_mut_ptr());
    let block = super::KC * NR;
    // SAFETY: inlined into `group_pairs_avx512`, which enables AVX-512F.
    let high = unsafe { _mm512_set1_epi32(0xffff_0000_u32 as i32) };
    let mut k0 = 0;
    while k0 < fan_in {
        let k1 = (k0 + super::KC).min(fan_in);
        // k0 is a multiple of KC, so even: the block starts a pair row.
        for (q, &panel) in w.iter().enumerate() {
            for r in k0 / 2..k1.div_ceil(2) {
                // SAFETY: pair row r < fan_in.div_ceil(2) lies in the
                // panel; inputs 2r - k0 (and 2r + 1 - k0 when below
                // k1 - k0) lie in block q of scratch.
                unsafe {
                    let v = _mm512_loadu_si512(panel.add(r * 2 * NR).cast());
                    let d = sp.add(q * block + (2 * r - k0) * NR);
                    _mm512_storeu_ps(d, _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v)));
                    if 2 * r + 1 < k1 {
                        _mm512_storeu_ps(d.add(NR), _mm512_castsi512_ps(_mm512_and_si512(v, high)));
                    }
                }
            }
        }
        // SAFETY: block q of scratch holds inputs k0..k1 of panel q.
        let ws: [*const f32; P] =
            std::array::from_fn(|q| unsafe { sp.add(q * block) }.cast_const());
        // SAFETY: see the function's contract.
        unsafe { tiles!(8, n, tile512[P, f32](xp, fan_in, k0, k1, k0, ws, pf, op)) }
        k0 = k1;
    }
}
