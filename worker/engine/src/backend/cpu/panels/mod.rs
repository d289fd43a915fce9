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

use lorafleet_artifact::quantization::{InputQuantization, QuantizedMatrix};

use super::amx;
use quant::QuantPanels;
pub use quant::Widen;

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
#[derive(Debug, Clone, PartialEq)]
pub struct PackedLinear {
    /// `[fan_out.div_ceil(NR), fan_in, NR]`; the last panel is zero-padded.
    panels: Panels,
    bias: Option<Vec<f32>>,
    fan_in: usize,
    fan_out: usize,
    /// How the inputs are quantized before the product, for a checkpoint
    /// whose scheme says so (see [`InputQuantization`]); the LoRA deltas
    /// read the inputs as they are.
    input: Option<InputQuantization>,
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
#[derive(Debug, Clone, PartialEq)]
enum Panels {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
    /// int8, 4-bit or FP8 codes with their scales (see [`quant`]).
    Quant(Box<QuantPanels>),
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
            input: None,
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
            input: None,
        }
    }

    /// Quantized `[out_i, fan_in]` matrices stacked by rows, kept at their
    /// width (see [`quant`]); `None` when they cannot share one set of
    /// panels (see [`QuantPanels::pack`]).
    pub fn pack_quantized(stack: &[&QuantizedMatrix], bias: Option<Vec<f32>>) -> Option<Self> {
        let panels = QuantPanels::pack(stack)?;
        Some(PackedLinear {
            panels: Panels::Quant(Box::new(panels)),
            bias,
            fan_in: stack[0].fan_in,
            fan_out: stack.iter().map(|m| m.out).sum(),
            input: None,
        })
    }

    /// The same projection with its inputs quantized first, as `input`
    /// says.
    pub fn with_input(mut self, input: Option<InputQuantization>) -> Self {
        self.input = input;
        self
    }

    /// The bias added to each output, if the projection has one.
    pub fn bias(&self) -> Option<&[f32]> {
        self.bias.as_deref()
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
            Panels::Quant(p) => p.bytes(),
        }
    }

    /// The f32 panels as they are laid out (`[fan_out.div_ceil(NR),
    /// fan_in, NR]`, zero-padded), for a backend that reads that layout;
    /// None for bf16 or quantized panels.
    pub fn panels_f32(&self) -> Option<&[f32]> {
        match &self.panels {
            Panels::F32(all) => Some(all),
            Panels::Bf16(_) | Panels::Quant(_) => None,
        }
    }

    #[cfg(test)]
    fn f32_panels(&self) -> &[f32] {
        match &self.panels {
            Panels::F32(all) => all,
            Panels::Bf16(_) | Panels::Quant(_) => panic!("the panels are not f32"),
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
        self.fill(
            Kernel::detect(),
            amx::available(),
            x,
            n,
            &parts,
            true,
            false,
        );
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
        self.fill(kernel, amx, x, n, &parts, true, false);
    }

    /// `out[t, o] += scale · x[t]·W[o]` for the `n` rows of `x`, all on the
    /// calling thread: for small projections that a caller already runs
    /// many of side by side on the team. The products are those of
    /// [`PackedLinear::forward`] (the same kernel, the same groups of
    /// panels), so a row's result does not depend on which one ran it.
    pub fn add_scaled_on_this_thread(&self, x: &[f32], n: usize, scale: f32, out: &mut [f32]) {
        assert_eq!(out.len(), n * self.fan_out, "out holds {n} rows of fan_out");
        let mut y: Vec<f32> = Vec::with_capacity(n * self.fan_out);
        let parts = [(self.fan_out, SharedOut(y.as_mut_ptr()))];
        self.fill(
            Kernel::detect(),
            amx::available(),
            x,
            n,
            &parts,
            false,
            false,
        );
        // SAFETY: the capacity is n * fan_out, and `fill` returned, so it
        // wrote every row of every column.
        #[allow(unsafe_code)]
        unsafe {
            y.set_len(n * self.fan_out)
        };
        for (o, v) in out.iter_mut().zip(&y) {
            *o += scale * v;
        }
    }

    /// Writes all `n` rows of each part's columns: `parts` are (width,
    /// buffer of `[n, width]`, which may be uninitialized), the widths
    /// adding up to `fan_out`, side by side. The groups of panels run on
    /// the team if `parallel`, else one after another on this thread.
    /// `raw`: the products alone, `x·Wᵀ`, without the input's quantization
    /// or the bias.
    #[allow(clippy::too_many_arguments)]
    fn fill(
        &self,
        kernel: Kernel,
        amx: bool,
        x: &[f32],
        n: usize,
        parts: &[(usize, SharedOut)],
        parallel: bool,
        raw: bool,
    ) {
        let (fan_in, fan_out) = (self.fan_in, self.fan_out);
        assert_eq!(x.len(), n * fan_in, "x holds {n} rows of {fan_in}");
        let quantized;
        let x = match &self.input {
            Some(q) if !raw => {
                quantized = q.apply(x, fan_in);
                &quantized[..]
            }
            _ => x,
        };
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
        let groups = panels.div_ceil(group_size);
        let scratch = || (vec![0f32; rows * group_size * NR], Vec::new());
        let run = |(local, wide): &mut (Vec<f32>, Vec<f32>), b: usize| {
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
                (Panels::Quant(all), _) => {
                    let next = all.codes_of(first + count, first + count + GROUP);
                    kernel.group_widened(
                        x,
                        fan_in,
                        n,
                        first,
                        count,
                        all.as_ref(),
                        wide,
                        Prefetch::of(next),
                        local,
                    );
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
                    kernel.group_bf16_pairs(x, fan_in, n, &group, wide, Prefetch::of(next), local);
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
                    if let Some(bias) = self.bias.as_ref().filter(|_| !raw) {
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
        };
        if parallel {
            super::team::for_each(groups, scratch, run);
        } else {
            let mut state = scratch();
            (0..groups).for_each(|b| run(&mut state, b));
        }
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

mod quant;
mod row;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86;

#[cfg(test)]
mod tests;
