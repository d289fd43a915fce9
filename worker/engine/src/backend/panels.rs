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

use super::amx;

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
/// in memory, which halves what a decode step reads.
///
/// bf16 panels are laid out for AMX tiles (see [`super::amx`]): inputs in
/// pairs, padded to a multiple of [`amx::KB`]. Where the CPU has AMX they
/// are multiplied there; elsewhere they are widened to f32 a group of
/// panels at a time just before use. Widening is exact (the 16 bits become
/// the top half of an f32), so there the products are the ones f32 weights
/// of the same values give, bit for bit.
#[derive(Debug)]
enum Panels {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

/// Packs row-major `[fan_out, fan_in]` bf16 bits into the AMX pair layout:
/// panel `p`, input `k`, output `j` of the panel at
/// `p * kpad * NR + (k / 2) * 2 * NR + 2 * j + k % 2`, zero-padded.
fn pack_pairs(w: &[u16], fan_in: usize, fan_out: usize) -> Vec<u16> {
    assert_eq!(
        w.len(),
        fan_in * fan_out,
        "weights of [{fan_out}, {fan_in}]"
    );
    let kpad = amx::padded(fan_in);
    let mut panels = vec![0u16; fan_out.div_ceil(NR) * kpad * NR];
    for (p, panel) in panels.chunks_exact_mut(kpad * NR).enumerate() {
        for j in 0..NR.min(fan_out - p * NR) {
            let row = &w[(p * NR + j) * fan_in..][..fan_in];
            for (k, &v) in row.iter().enumerate() {
                panel[(k / 2) * 2 * NR + 2 * j + k % 2] = v;
            }
        }
    }
    panels
}

/// Packs row-major `[fan_out, fan_in]` values into zero-padded panels.
fn pack_panels(w: &[f32], fan_in: usize, fan_out: usize) -> Vec<f32> {
    assert_eq!(
        w.len(),
        fan_in * fan_out,
        "weights of [{fan_out}, {fan_in}]"
    );
    let count = fan_out.div_ceil(NR);
    let mut panels = vec![0f32; count * fan_in * NR];
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
            panels: Panels::Bf16(pack_pairs(w, fan_in, fan_out)),
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
        self.forward_with(Kernel::detect(), amx::available(), x, n, outs);
    }

    /// As [`PackedLinear::forward_parts`], into new buffers of the given
    /// widths. Every element is written by the projection itself, so the
    /// buffers are never zeroed first.
    pub fn forward_split<const K: usize>(
        &self,
        x: &[f32],
        n: usize,
        widths: [usize; K],
    ) -> [Vec<f32>; K] {
        let mut outs: [Vec<f32>; K] = widths.map(|w| Vec::with_capacity(n * w));
        let parts: Vec<(usize, SharedOut)> = outs
            .iter_mut()
            .zip(widths)
            .map(|(o, w)| (w, SharedOut(o.as_mut_ptr())))
            .collect();
        self.fill(Kernel::detect(), amx::available(), x, n, &parts);
        for (o, w) in outs.iter_mut().zip(widths) {
            // SAFETY: the capacity is n * w, and `fill` returned, so it
            // wrote every row of every part's columns (the parts cover
            // fan_out and every group of panels ran).
            #[allow(unsafe_code)]
            unsafe {
                o.set_len(n * w)
            };
        }
        outs
    }

    /// [`PackedLinear::forward_parts`] on a chosen kernel, and on AMX tiles
    /// for bf16 panels if `amx`.
    fn forward_with(
        &self,
        kernel: Kernel,
        amx: bool,
        x: &[f32],
        n: usize,
        outs: &mut [&mut [f32]],
    ) {
        if n == 0 {
            assert!(outs.iter().all(|o| o.is_empty()), "no rows, no outputs");
            return;
        }
        let parts: Vec<(usize, SharedOut)> = outs
            .iter_mut()
            .map(|out| {
                let width = out.len() / n;
                assert_eq!(out.len(), n * width, "an output holds whole rows");
                (width, SharedOut(out.as_mut_ptr()))
            })
            .collect();
        self.fill(kernel, amx, x, n, &parts);
    }

    /// Writes all `n` rows of each part's columns: `parts` are (width,
    /// buffer of `[n, width]`, which may be uninitialized), the widths
    /// adding up to `fan_out`, side by side.
    fn fill(&self, kernel: Kernel, amx: bool, x: &[f32], n: usize, parts: &[(usize, SharedOut)]) {
        let (fan_in, fan_out) = (self.fan_in, self.fan_out);
        assert_eq!(x.len(), n * fan_in, "x holds {n} rows of {fan_in}");
        let mut lo = 0;
        let parts: Vec<(usize, usize, SharedOut)> = parts
            .iter()
            .map(|&(width, out)| {
                lo += width;
                (lo - width, width, out)
            })
            .collect();
        assert_eq!(lo, fan_out, "the outputs cover fan_out");
        if n == 0 {
            return;
        }
        let panels = fan_out.div_ceil(NR);
        // The activations are split for the tiles once, for every task.
        let split = match &self.panels {
            Panels::Bf16(_) if amx => Some(amx::Split::new(x, n, fan_in)),
            _ => None,
        };
        let (group_size, rows) = match &split {
            Some(split) => (amx::GROUP, split.rows()),
            None => (GROUP, n),
        };
        super::team::for_each(
            panels.div_ceil(group_size),
            || (vec![0f32; rows * group_size * NR], Vec::new()),
            |(local, wide): &mut (Vec<f32>, Vec<f32>), b| {
                let (first, count) = (b * group_size, group_size.min(panels - b * group_size));
                let width = count * NR;
                let local = &mut local[..rows * width];
                match (&self.panels, &split) {
                    (Panels::F32(all), _) => {
                        let panel_len = fan_in * NR;
                        let group: Vec<&[f32]> = all[first * panel_len..][..count * panel_len]
                            .chunks_exact(panel_len)
                            .collect();
                        // The group after this one is what this task most
                        // likely runs next (the team hands each thread a
                        // run of groups).
                        let next = &all[(first + count) * panel_len
                            ..(first + count + GROUP).min(panels) * panel_len];
                        kernel.group(x, fan_in, n, &group, Prefetch::of(next), local);
                    }
                    (Panels::Bf16(all), Some(split)) => {
                        let panel_len = amx::padded(fan_in) * NR;
                        let group = &all[first * panel_len..][..count * panel_len];
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: `split` exists only where the caller
                        // passed `amx`, which `forward_parts` takes from
                        // `amx::available`, and the tests only where it
                        // is true.
                        #[allow(unsafe_code)]
                        unsafe {
                            amx::group(split, group, count, local)
                        };
                        #[cfg(not(target_arch = "x86_64"))]
                        unreachable!("AMX on {split:?} without x86_64 {group:?}");
                    }
                    (Panels::Bf16(all), None) => {
                        let panel_len = amx::padded(fan_in) * NR;
                        let group: Vec<&[u16]> = all[first * panel_len..][..count * panel_len]
                            .chunks_exact(panel_len)
                            .collect();
                        let next = &all[(first + count) * panel_len
                            ..(first + count + GROUP).min(panels) * panel_len];
                        kernel.group_bf16_pairs(
                            x,
                            fan_in,
                            n,
                            &group,
                            wide,
                            Prefetch::of(next),
                            local,
                        );
                    }
                }
                let (glo, ghi) = (first * NR, (first * NR + width).min(fan_out));
                for (plo, pw, out) in &parts {
                    let (lo, hi) = (glo.max(*plo), ghi.min(plo + pw));
                    if lo >= hi {
                        continue;
                    }
                    for t in 0..n {
                        let src = &mut local[t * width + lo - glo..t * width + hi - glo];
                        if let Some(bias) = &self.bias {
                            for (y, &b) in src.iter_mut().zip(&bias[lo..hi]) {
                                *y += b;
                            }
                        }
                        // SAFETY: columns lo..hi of this part belong to this
                        // group alone, and row t is inside the part's
                        // `[n, pw]` buffer, which outlives the parallel loop.
                        #[allow(unsafe_code)]
                        unsafe {
                            out.write(t * pw + lo - plo, src)
                        };
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

// SAFETY: a `SharedOut` is only written through `row` and `write`, whose
// callers guarantee that no two tasks touch the same elements.
#[allow(unsafe_code)]
unsafe impl Send for SharedOut {}
#[allow(unsafe_code)]
unsafe impl Sync for SharedOut {}

impl SharedOut {
    pub fn new(out: &mut [f32]) -> SharedOut {
        SharedOut(out.as_mut_ptr())
    }

    /// Copies `src` to the elements from `at`, which need not have been
    /// initialized.
    ///
    /// # Safety
    /// `at..at + src.len()` lies inside the buffer, which is alive, and no
    /// other task reads or writes it meanwhile.
    #[allow(unsafe_code)]
    pub unsafe fn write(&self, at: usize, src: &[f32]) {
        // SAFETY: the caller's contract; `src` is another buffer.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.0.add(at), src.len()) }
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
    ///
    /// The panels may hold f32 or bf16 bits ([`PanelValue`]), widened
    /// exactly as they are loaded: the same bits as their f32 widening.
    pub fn group<W: PanelValue>(
        self,
        x: &[f32],
        fan_in: usize,
        n: usize,
        panels: &[&[W]],
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
            Kernel::Portable => {
                let wide: Vec<std::borrow::Cow<'_, [f32]>> =
                    panels.iter().map(|p| W::widen(p)).collect();
                let wide: Vec<&[f32]> = wide.iter().map(|p| &p[..]).collect();
                portable(x, fan_in, n, &wide, out)
            }
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
    ///
    /// The panels may hold f32 or bf16 values ([`PanelValue`]); bf16 is
    /// widened exactly as it is loaded, so a bf16 run gives the bits of its
    /// f32 widening while reading half the bytes.
    pub fn gather<W: PanelValue>(
        self,
        rows: &[(&[f32], &[W])],
        fan_in: usize,
        panels: usize,
        out: &mut [f32],
    ) {
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
                    let run = W::widen(run);
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

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for u16 {}
}

/// A value panels may hold: f32, or bf16 as its bits (`u16`). Sealed: the
/// kernels' loads trust `BF16` for the value's size, so no other type may
/// implement it.
pub trait PanelValue: sealed::Sealed + Copy + Default + Send + Sync + 'static {
    /// Whether the value is bf16 bits.
    const BF16: bool;
    /// The values as f32, exactly.
    fn widen(values: &[Self]) -> std::borrow::Cow<'_, [f32]>;
}

impl PanelValue for f32 {
    const BF16: bool = false;
    fn widen(values: &[f32]) -> std::borrow::Cow<'_, [f32]> {
        std::borrow::Cow::Borrowed(values)
    }
}

impl PanelValue for u16 {
    const BF16: bool = true;
    fn widen(values: &[u16]) -> std::borrow::Cow<'_, [f32]> {
        std::borrow::Cow::Owned(values.iter().map(|&b| bf16_to_f32(b)).collect())
    }
}

/// A bf16 value's f32: its bits are the top half, so this is exact.
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

impl Kernel {
    /// Widens bf16 panels in the pair layout ([`PackedLinear::pack_bf16`],
    /// `kpad = amx::padded(fan_in)` inputs each) to f32 panels of `fan_in`
    /// inputs, k-major: exact, the bits become the top half of the f32.
    pub fn widen_bf16(self, src: &[u16], fan_in: usize, dst: &mut [f32]) {
        let (kpad, count) = (amx::padded(fan_in), dst.len() / (fan_in * NR).max(1));
        assert_eq!(dst.len(), count * fan_in * NR, "whole f32 panels");
        assert_eq!(src.len(), count * kpad * NR, "as many bf16 panels");
        for (src, dst) in src
            .chunks_exact(kpad * NR)
            .zip(dst.chunks_exact_mut(fan_in * NR))
        {
            match self {
                Kernel::Portable => widen_portable(src, fan_in, dst),
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the CPU has AVX2 (see `single`); sizes asserted.
                // (The AVX-512 projections widen a block at a time in
                // `group_bf16_pairs` instead.)
                #[allow(unsafe_code)]
                Kernel::Avx2 | Kernel::Avx512 => unsafe { x86::widen_avx2(src, fan_in, dst) },
            }
        }
    }
}

impl Kernel {
    /// [`Kernel::group`] on bf16 panels in the pair layout
    /// ([`PackedLinear::pack_bf16`], `amx::padded(fan_in)` inputs each),
    /// widened exactly on the way: the bits of the same call on their f32
    /// widening. `scratch` is the caller's to reuse from call to call. The
    /// AVX-512 kernel widens one block of inputs at a time into L1; the
    /// others widen the whole group first.
    #[allow(clippy::too_many_arguments)]
    pub fn group_bf16_pairs(
        self,
        x: &[f32],
        fan_in: usize,
        n: usize,
        panels: &[&[u16]],
        scratch: &mut Vec<f32>,
        ahead: Prefetch,
        out: &mut [f32],
    ) {
        let kpad = amx::padded(fan_in);
        assert!((1..=GROUP).contains(&panels.len()), "1 to {GROUP} panels");
        assert!(
            x.len() >= n * fan_in
                && panels.iter().all(|p| p.len() == kpad * NR)
                && out.len() == n * panels.len() * NR
        );
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => {
                scratch.resize(panels.len() * KC * NR, 0.0);
                // SAFETY: the CPU has AVX-512F, checked by
                // `detect`/`available`; sizes asserted above.
                #[allow(unsafe_code)]
                unsafe {
                    x86::group_pairs_avx512(x, fan_in, n, panels, scratch, ahead, out)
                }
            }
            _ => {
                scratch.resize(panels.len() * fan_in * NR, 0.0);
                for (panel, wide) in panels.iter().zip(scratch.chunks_exact_mut(fan_in * NR)) {
                    self.widen_bf16(panel, fan_in, wide);
                }
                let wide: Vec<&[f32]> = scratch.chunks_exact(fan_in * NR).collect();
                self.group(x, fan_in, n, &wide, ahead, out);
            }
        }
    }
}

/// One panel: each pair row `r` of `2 * NR` bf16 holds inputs `2r` (even
/// places) and `2r + 1` (odd places) of the `NR` outputs.
fn widen_portable(src: &[u16], fan_in: usize, dst: &mut [f32]) {
    for k in 0..fan_in {
        for j in 0..NR {
            let h = src[(k / 2) * 2 * NR + 2 * j + k % 2];
            dst[k * NR + j] = f32::from_bits(u32::from(h) << 16);
        }
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
                let w: [*const W; M] =
                    std::array::from_fn(|m| rows[m].1[p * fan_in * NR..].as_ptr());
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
                            _mm512_storeu_ps(
                                d.add(NR),
                                _mm512_castsi512_ps(_mm512_and_si512(v, high)),
                            );
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
            Panels::F32(_) => panic!("the panels are f32"),
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
        if cfg!(all(target_arch = "x86_64", target_os = "linux"))
            && has("amx_tile")
            && has("amx_bf16")
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
}
