//! Dense projections `y = x·Wᵀ (+ b)` over weights packed into panels.
//!
//! A panel holds [`NR`] consecutive output features, k-major: for each input
//! feature `k`, the `NR` weights `W[o][k]` side by side. A register tile
//! then multiplies a few tokens by one or more panels, broadcasting
//! one input value per token and loading each panel row once per `k`, so
//! the work is bound by multiply-adds rather than by memory.
//!
//! Every output is one fused multiply-add chain over `k` in order, starting
//! from zero, and the bias is added last. The chain depends on nothing but
//! the token's own row and the weights: the portable loop, the AVX2 kernel
//! and the AVX-512 kernel give the same bits, and so does any tile size,
//! which is what keeps a token's result independent of its batch.

use rayon::prelude::*;

/// Output features per panel.
pub const NR: usize = 16;
/// Panels per task and per AVX-512 tile: 8 tokens x 3 panels is 24 of the
/// 32 vector registers for accumulators.
pub const GROUP: usize = 3;
/// Input features per pass over a group's panels, so the part of the
/// panels a pass reads (3 x 16 x 128 x 4 bytes) stays in L1 while every
/// token tile uses it.
const KC: usize = 128;

/// A dense projection with its weights packed into panels.
#[derive(Debug)]
pub struct PackedLinear {
    /// `[fan_out.div_ceil(NR), fan_in, NR]`; the last panel is zero-padded.
    panels: Panels,
    bias: Option<Vec<f32>>,
    fan_in: usize,
    fan_out: usize,
}

/// Panel storage in the checkpoint's own precision. bf16 weights stay bf16
/// in memory, which halves what a decode step reads, and are widened to
/// f32 a group of panels at a time just before use: widening bf16 is exact
/// (the 16 bits become the top half of an f32), so the products are the
/// ones f32 weights of the same values give, bit for bit.
#[derive(Debug)]
enum Panels {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

/// Packs row-major `[fan_out, fan_in]` values into zero-padded panels.
fn pack_panels<T: Copy + Default>(w: &[T], fan_in: usize, fan_out: usize) -> Vec<T> {
    assert_eq!(
        w.len(),
        fan_in * fan_out,
        "weights of [{fan_out}, {fan_in}]"
    );
    let count = fan_out.div_ceil(NR);
    let mut panels = vec![T::default(); count * fan_in * NR];
    for (p, panel) in panels.chunks_exact_mut(fan_in * NR).enumerate() {
        for j in 0..NR.min(fan_out - p * NR) {
            let row = &w[(p * NR + j) * fan_in..][..fan_in];
            for (k, &v) in row.iter().enumerate() {
                panel[k * NR + j] = v;
            }
        }
    }
    panels
}

impl PackedLinear {
    /// Packs row-major `[fan_out, fan_in]` weights, as Hugging Face stores them.
    pub fn pack(w: &[f32], bias: Option<Vec<f32>>, fan_in: usize, fan_out: usize) -> Self {
        PackedLinear {
            panels: Panels::F32(pack_panels(w, fan_in, fan_out)),
            bias,
            fan_in,
            fan_out,
        }
    }

    /// As [`PackedLinear::pack`], for bf16 weights given as their bits;
    /// they stay bf16 in memory (see [`Panels`]).
    pub fn pack_bf16(w: &[u16], bias: Option<Vec<f32>>, fan_in: usize, fan_out: usize) -> Self {
        PackedLinear {
            panels: Panels::Bf16(pack_panels(w, fan_in, fan_out)),
            bias,
            fan_in,
            fan_out,
        }
    }

    pub fn fan_in(&self) -> usize {
        self.fan_in
    }

    pub fn fan_out(&self) -> usize {
        self.fan_out
    }

    /// Bytes the weights take in memory.
    pub fn weight_bytes(&self) -> usize {
        match &self.panels {
            Panels::F32(p) => p.len() * 4,
            Panels::Bf16(p) => p.len() * 2,
        }
    }

    #[cfg(test)]
    fn f32_panels(&self) -> &[f32] {
        match &self.panels {
            Panels::F32(all) => all,
            Panels::Bf16(_) => panic!("the panels are bf16"),
        }
    }

    #[cfg(test)]
    fn panel(&self, p: usize) -> &[f32] {
        &self.f32_panels()[p * self.fan_in * NR..][..self.fan_in * NR]
    }

    /// `out[t, o] = x[t]·W[o] (+ b[o])` for the `n` rows of `x`, in
    /// parallel over groups of panels so each panel is read once per call.
    pub fn forward(&self, x: &[f32], n: usize, out: &mut [f32]) {
        self.forward_parts(x, n, &mut [out]);
    }

    /// As [`PackedLinear::forward`], with the outputs split by columns into
    /// `outs`, each `[n, width]` and the widths adding up to `fan_out`: the
    /// projections stacked into one are written straight to their own
    /// buffers. Each task writes its own columns, so nothing is copied
    /// after the parallel part.
    pub fn forward_parts(&self, x: &[f32], n: usize, outs: &mut [&mut [f32]]) {
        let (fan_in, fan_out) = (self.fan_in, self.fan_out);
        assert_eq!(x.len(), n * fan_in, "x holds {n} rows of {fan_in}");
        if n == 0 {
            assert!(outs.iter().all(|o| o.is_empty()), "no rows, no outputs");
            return;
        }
        let mut parts = Vec::with_capacity(outs.len());
        let mut lo = 0;
        for out in outs.iter_mut() {
            let width = out.len() / n;
            assert_eq!(out.len(), n * width, "an output holds whole rows");
            parts.push((lo, width, SharedOut(out.as_mut_ptr())));
            lo += width;
        }
        assert_eq!(lo, fan_out, "the outputs cover fan_out");
        let panels = fan_out.div_ceil(NR);
        let panel_len = fan_in * NR;
        let kernel = Kernel::detect();
        (0..panels.div_ceil(GROUP)).into_par_iter().for_each_init(
            || (vec![0f32; n * GROUP * NR], Vec::new()),
            |(local, wide), b| {
                let (first, count) = (b * GROUP, GROUP.min(panels - b * GROUP));
                let width = count * NR;
                let local = &mut local[..n * width];
                // The group after this one is what this task most likely
                // runs next (rayon hands each thread a run of groups).
                let next =
                    (first + count) * panel_len..((first + count + GROUP).min(panels)) * panel_len;
                match &self.panels {
                    Panels::F32(all) => {
                        let group: Vec<&[f32]> = all[first * panel_len..][..count * panel_len]
                            .chunks_exact(panel_len)
                            .collect();
                        kernel.group(x, fan_in, n, &group, Prefetch::of(&all[next]), local);
                    }
                    Panels::Bf16(all) => {
                        wide.resize(GROUP * panel_len, 0f32);
                        let wide = &mut wide[..count * panel_len];
                        kernel.widen_bf16(&all[first * panel_len..][..count * panel_len], wide);
                        let group: Vec<&[f32]> = wide.chunks_exact(panel_len).collect();
                        kernel.group(x, fan_in, n, &group, Prefetch::of(&all[next]), local);
                    }
                }
                let (glo, ghi) = (first * NR, (first * NR + width).min(fan_out));
                for (plo, pw, out) in &parts {
                    let (lo, hi) = (glo.max(*plo), ghi.min(plo + pw));
                    if lo >= hi {
                        continue;
                    }
                    for t in 0..n {
                        let src = &local[t * width + lo - glo..t * width + hi - glo];
                        // SAFETY: columns lo..hi of this part belong to this
                        // group alone, and row t is inside the part's
                        // `[n, pw]` buffer, which outlives the parallel loop.
                        #[allow(unsafe_code)]
                        let dst = unsafe { out.row(t * pw + lo - plo, hi - lo) };
                        dst.copy_from_slice(src);
                        if let Some(bias) = &self.bias {
                            for (y, &b) in dst.iter_mut().zip(&bias[lo..hi]) {
                                *y += b;
                            }
                        }
                    }
                }
            },
        );
    }
}

/// Memory a kernel call should ask into L2 while it computes: the weights
/// its caller reads next. Only an address range; it is never read through.
#[derive(Debug, Clone, Copy)]
pub struct Prefetch {
    start: *const u8,
    bytes: usize,
}

impl Prefetch {
    pub const NONE: Prefetch = Prefetch {
        start: std::ptr::null(),
        bytes: 0,
    };

    pub fn of<T>(region: &[T]) -> Prefetch {
        Prefetch {
            start: region.as_ptr().cast(),
            bytes: std::mem::size_of_val(region),
        }
    }
}

/// An output buffer that parallel tasks write disjoint parts of.
#[derive(Debug, Clone, Copy)]
pub struct SharedOut(*mut f32);

// SAFETY: a `SharedOut` is only written through `row`, whose callers
// guarantee that no two tasks touch the same elements.
#[allow(unsafe_code)]
unsafe impl Send for SharedOut {}
#[allow(unsafe_code)]
unsafe impl Sync for SharedOut {}

impl SharedOut {
    pub fn new(out: &mut [f32]) -> SharedOut {
        SharedOut(out.as_mut_ptr())
    }

    /// `len` elements from `at`.
    ///
    /// # Safety
    /// `at..at + len` lies inside the buffer, which is alive, and no other
    /// task reads or writes it while the slice lives.
    #[allow(unsafe_code)]
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn row(&self, at: usize, len: usize) -> &mut [f32] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(at), len) }
    }
}

/// The widest kernel this CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Kernel {
    pub fn detect() -> Kernel {
        static WIDEST: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *WIDEST.get_or_init(|| *Kernel::available().last().expect("the portable kernel"))
    }

    /// Every kernel this CPU can run, narrowest first.
    pub fn available() -> Vec<Kernel> {
        let mut all = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                all.push(Kernel::Avx2);
            }
            // Every AVX-512 CPU has AVX2 and FMA, which `single` relies on.
            if std::arch::is_x86_feature_detected!("avx512f") && all.len() == 2 {
                all.push(Kernel::Avx512);
            }
        }
        all
    }

    /// `out[t, 0..NR] = x[t]·panel` for `n` rows: `out` is `[n, NR]`.
    pub fn single(self, x: &[f32], fan_in: usize, n: usize, panel: &[f32], out: &mut [f32]) {
        assert!(x.len() >= n * fan_in && panel.len() == fan_in * NR && out.len() == n * NR);
        match self {
            Kernel::Portable => portable(x, fan_in, n, &[panel], out),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `detect`/`available` chose this kernel only where the
            // CPU has AVX2 and FMA (AVX-512F implies both); the sizes were
            // asserted above.
            #[allow(unsafe_code)]
            Kernel::Avx2 | Kernel::Avx512 => unsafe { x86::single_avx2(x, fan_in, n, panel, out) },
        }
    }

    /// Up to [`GROUP`] adjacent panels at once: `out` is `[n, panels * NR]`.
    ///
    /// `ahead` is memory the caller reads next (the next group's panels):
    /// it is asked into L2 a few lines at a time while this call computes,
    /// so reading weights from memory overlaps the multiply-adds instead
    /// of alternating with them. It does not change any result.
    pub fn group(
        self,
        x: &[f32],
        fan_in: usize,
        n: usize,
        panels: &[&[f32]],
        ahead: Prefetch,
        out: &mut [f32],
    ) {
        assert!((1..=GROUP).contains(&panels.len()), "1 to {GROUP} panels");
        assert!(
            x.len() >= n * fan_in
                && panels.iter().all(|p| p.len() == fan_in * NR)
                && out.len() == n * panels.len() * NR
        );
        match self {
            Kernel::Portable => portable(x, fan_in, n, panels, out),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                let width = panels.len() * NR;
                let mut one = vec![0f32; n * NR];
                for (q, panel) in panels.iter().enumerate() {
                    // SAFETY: the CPU has AVX2 and FMA (see `single`); sizes asserted.
                    #[allow(unsafe_code)]
                    unsafe {
                        x86::single_avx2(x, fan_in, n, panel, &mut one)
                    };
                    for t in 0..n {
                        out[t * width + q * NR..][..NR].copy_from_slice(&one[t * NR..][..NR]);
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has AVX-512F, checked by `detect`/`available`;
            // sizes asserted above.
            #[allow(unsafe_code)]
            Kernel::Avx512 => unsafe { x86::group_avx512(x, fan_in, n, panels, ahead, out) },
        }
    }
}

/// Rows per [`Kernel::gather`] call: 6 rows x 2 vectors is 12 of the 16
/// AVX2 registers for accumulators.
pub const GATHER: usize = 6;

impl Kernel {
    /// `out[r, p*NR..(p+1)*NR] = x_r·panel_r,p` for up to [`GATHER`] rows,
    /// each with its own run of `panels` consecutive panels: `rows[r]` is
    /// (`x_r`, at least `fan_in` values; the panels, `panels * fan_in * NR`),
    /// and `out` is `[rows.len(), panels * NR]`.
    ///
    /// This is the shape of a decode step over many adapters, where every
    /// token brings its own adapter: one token per panel leaves a tile with
    /// a single dependent chain per vector, while rows of different panels
    /// side by side keep the multiply-adds independent. Each output is the
    /// same chain as in [`Kernel::single`], so a token's bits do not depend
    /// on which kernel ran it.
    pub fn gather(self, rows: &[(&[f32], &[f32])], fan_in: usize, panels: usize, out: &mut [f32]) {
        assert!((1..=GATHER).contains(&rows.len()), "1 to {GATHER} rows");
        assert!(
            rows.iter()
                .all(|(x, p)| x.len() >= fan_in && p.len() == panels * fan_in * NR)
                && out.len() == rows.len() * panels * NR
        );
        match self {
            Kernel::Portable => {
                let width = panels * NR;
                for ((x, run), out) in rows.iter().zip(out.chunks_exact_mut(width)) {
                    let run: Vec<&[f32]> = run.chunks_exact(fan_in * NR).collect();
                    portable(&x[..fan_in], fan_in, 1, &run, out);
                }
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has AVX2 and FMA (see `single`); sizes asserted.
            #[allow(unsafe_code)]
            Kernel::Avx2 | Kernel::Avx512 => unsafe { x86::gather_avx2(rows, fan_in, panels, out) },
        }
    }
}

impl Kernel {
    /// `dst[i] = src[i]` widened from bf16 bits to f32: exact, the bits
    /// become the top half of the f32.
    pub fn widen_bf16(self, src: &[u16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len(), "as many f32 as bf16 values");
        match self {
            Kernel::Portable => widen_portable(src, dst),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has AVX2 (see `single`); lengths asserted.
            #[allow(unsafe_code)]
            Kernel::Avx2 => unsafe { x86::widen_avx2(src, dst) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has AVX-512F (see `group`); lengths asserted.
            #[allow(unsafe_code)]
            Kernel::Avx512 => unsafe { x86::widen_avx512(src, dst) },
        }
    }
}

fn widen_portable(src: &[u16], dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits(u32::from(s) << 16);
    }
}

/// The reference: one `mul_add` chain per output, `k` in order.
fn portable(x: &[f32], fan_in: usize, n: usize, panels: &[&[f32]], out: &mut [f32]) {
    let width = panels.len() * NR;
    for t in 0..n {
        let row = &x[t * fan_in..(t + 1) * fan_in];
        for (q, panel) in panels.iter().enumerate() {
            for j in 0..NR {
                let mut acc = 0f32;
                for (k, &xv) in row.iter().enumerate() {
                    acc = xv.mul_add(panel[k * NR + j], acc);
                }
                out[t * width + q * NR + j] = acc;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86 {
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

    /// # Safety
    /// The CPU has AVX2 and FMA; `x` holds `n` rows of `fan_in`, `panel`
    /// `fan_in * NR` values and `out` `n * NR`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn single_avx2(x: &[f32], fan_in: usize, n: usize, panel: &[f32], out: &mut [f32]) {
        #[inline(always)]
        unsafe fn tile<const M: usize>(
            t: usize,
            x: *const f32,
            fan_in: usize,
            w: *const f32,
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
                    let w0 = _mm256_loadu_ps(w.add(k * NR));
                    let w1 = _mm256_loadu_ps(w.add(k * NR + 8));
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
        unsafe { tiles!(6, n, tile[](xp, fan_in, wp, op)) }
    }

    /// # Safety
    /// The CPU has AVX2 and FMA; 1 to `GATHER` rows, each `x` at least
    /// `fan_in` values and each run of panels `panels * fan_in * NR`; `out`
    /// `rows.len() * panels * NR`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gather_avx2(
        rows: &[(&[f32], &[f32])],
        fan_in: usize,
        panels: usize,
        out: &mut [f32],
    ) {
        #[inline(always)]
        unsafe fn tile<const M: usize>(
            rows: &[(&[f32], &[f32])],
            fan_in: usize,
            panels: usize,
            out: *mut f32,
        ) {
            let x: [*const f32; M] = std::array::from_fn(|m| rows[m].0.as_ptr());
            let width = panels * NR;
            for p in 0..panels {
                let w: [*const f32; M] =
                    std::array::from_fn(|m| rows[m].1[p * fan_in * NR..].as_ptr());
                // SAFETY (whole body): k < fan_in keeps every read inside
                // each row's x and panel p; writes stay in rows 0..M, columns
                // of panel p, of out.
                unsafe {
                    let mut acc = [[_mm256_setzero_ps(); 2]; M];
                    for k in 0..fan_in {
                        for (m, a) in acc.iter_mut().enumerate() {
                            let xv = _mm256_broadcast_ss(&*x[m].add(k));
                            let w0 = _mm256_loadu_ps(w[m].add(k * NR));
                            let w1 = _mm256_loadu_ps(w[m].add(k * NR + 8));
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
                1 => tile::<1>(rows, fan_in, panels, op),
                2 => tile::<2>(rows, fan_in, panels, op),
                3 => tile::<3>(rows, fan_in, panels, op),
                4 => tile::<4>(rows, fan_in, panels, op),
                5 => tile::<5>(rows, fan_in, panels, op),
                6 => tile::<6>(rows, fan_in, panels, op),
                _ => unreachable!("1 to GATHER rows"),
            }
        }
    }

    /// # Safety
    /// The CPU has AVX2; `src` and `dst` have the same length.
    #[target_feature(enable = "avx2")]
    pub unsafe fn widen_avx2(src: &[u16], dst: &mut [f32]) {
        let body = src.len() / 8 * 8;
        for i in (0..body).step_by(8) {
            // SAFETY: i + 8 <= body <= both lengths.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
                let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_castsi256_ps(w));
            }
        }
        super::widen_portable(&src[body..], &mut dst[body..]);
    }

    /// # Safety
    /// The CPU has AVX-512F; `src` and `dst` have the same length.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn widen_avx512(src: &[u16], dst: &mut [f32]) {
        let body = src.len() / 16 * 16;
        for i in (0..body).step_by(16) {
            // SAFETY: i + 16 <= body <= both lengths.
            unsafe {
                let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
                let w = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_castsi512_ps(w));
            }
        }
        super::widen_portable(&src[body..], &mut dst[body..]);
    }

    /// # Safety
    /// The CPU has AVX-512F; `x` holds `n` rows of `fan_in`, each panel
    /// `fan_in * NR` values, and `out` `n * panels.len() * NR`; 1 to 3 panels.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn group_avx512(
        x: &[f32],
        fan_in: usize,
        n: usize,
        panels: &[&[f32]],
        ahead: super::Prefetch,
        out: &mut [f32],
    ) {
        // Every k of every tile is one tick: spread the lines of `ahead`
        // evenly over them.
        let tiles = n.div_ceil(8);
        let mut pf = Ahead::new(ahead, tiles * fan_in);
        // SAFETY: the caller's contract, for each panel count.
        unsafe {
            match *panels {
                [a] => group::<1>(x, fan_in, n, [a.as_ptr()], &mut pf, out),
                [a, b] => group::<2>(x, fan_in, n, [a.as_ptr(), b.as_ptr()], &mut pf, out),
                [a, b, c] => group::<3>(
                    x,
                    fan_in,
                    n,
                    [a.as_ptr(), b.as_ptr(), c.as_ptr()],
                    &mut pf,
                    out,
                ),
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

    #[inline(always)]
    unsafe fn group<const P: usize>(
        x: &[f32],
        fan_in: usize,
        n: usize,
        w: [*const f32; P],
        pf: &mut Ahead,
        out: &mut [f32],
    ) {
        #[inline(always)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn tile<const M: usize, const P: usize>(
            t: usize,
            x: *const f32,
            fan_in: usize,
            k0: usize,
            k1: usize,
            w: [*const f32; P],
            pf: &mut Ahead,
            out: *mut f32,
        ) {
            let width = P * NR;
            // SAFETY (whole body): rows t..t+M < n, k < fan_in and q < P keep
            // every access inside x, the panels and rows t..t+M of out.
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
                        *v = _mm512_loadu_ps(w[q].add(k * NR));
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
        let (xp, op) = (x.as_ptr(), out.as_mut_ptr());
        let mut k0 = 0;
        while k0 < fan_in {
            let k1 = (k0 + super::KC).min(fan_in);
            // SAFETY: see the function's contract.
            unsafe { tiles!(8, n, tile[P](xp, fan_in, k0, k1, w, pf, op)) }
            k0 = k1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(seed: u64, n: usize) -> Vec<f32> {
        let mut rng = crate::sampling::Rng::new(seed);
        (0..n).map(|_| rng.next_f64() as f32 - 0.5).collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    #[test]
    fn bf16_panels_give_the_bits_of_their_f32_widening() {
        // Every kernel widens each bf16 pattern (finite, subnormal, signed
        // zero) exactly, at lengths that leave every remainder.
        let patterns: Vec<u16> = (0..=u16::MAX).step_by(7).chain([0x8000, 0x0001]).collect();
        for &kernel in &Kernel::available() {
            for len in [patterns.len(), 1, 15, 17, 33] {
                let mut wide = vec![f32::NAN; len];
                kernel.widen_bf16(&patterns[..len], &mut wide);
                for (&h, &f) in patterns.iter().zip(&wide) {
                    assert_eq!(f.to_bits(), u32::from(h) << 16, "{kernel:?} {h:#06x}");
                }
            }
        }
        for (n, fan_in, fan_out) in [(7, 45, 9), (32, 77, 100), (3, 300, 48), (40, 64, 200)] {
            let x = random(1, n * fan_in);
            let bits16: Vec<u16> = random(2, fan_out * fan_in)
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_bits())
                .collect();
            let widened: Vec<f32> = bits16
                .iter()
                .map(|&h| f32::from_bits(u32::from(h) << 16))
                .collect();
            let bias = random(3, fan_out);
            let narrow = PackedLinear::pack_bf16(&bits16, Some(bias.clone()), fan_in, fan_out);
            let wide = PackedLinear::pack(&widened, Some(bias), fan_in, fan_out);
            assert_eq!(narrow.weight_bytes() * 2, wide.weight_bytes());
            let (mut a, mut b) = (vec![0f32; n * fan_out], vec![0f32; n * fan_out]);
            narrow.forward(&x, n, &mut a);
            wide.forward(&x, n, &mut b);
            assert_eq!(
                bits(&a),
                bits(&b),
                "n={n} fan_in={fan_in} fan_out={fan_out}"
            );
        }
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
}
