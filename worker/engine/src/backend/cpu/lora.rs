//! The grouped LoRA kernel (SGMV) over the packed adapter slots.

use super::panels::{GATHER, GROUP, Kernel, NR, PanelValue, Prefetch, SharedOut};

/// One projection's adapter slots, as [`lora_segments`] reads them, packed
/// into the panels of [`crate::backend::panels`]: the shrink `x·Aᵀ` is a
/// projection to `rank` outputs and the expand `h·B` one from `rank`
/// inputs, so both run on the same register tiles as the base weights.
pub struct SlotView<'a> {
    /// Per slot `[max_rank / NR, fan_in, NR]`: panel `q` holds rows
    /// `q*NR..(q+1)*NR` of A, k-major.
    pub a: &'a [f32],
    /// Per slot `[fan_out.div_ceil(NR), k, NR]` with `k` the slot's rank
    /// rounded up to [`NR`] (the region is sized for `max_rank`): panel `p`
    /// holds columns `p*NR..(p+1)*NR` of Bᵀ (`[rank, fan_out]`), rank-major.
    pub b: &'a [f32],
    /// A multiple of [`NR`].
    pub max_rank: usize,
    pub fan_in: usize,
    pub fan_out: usize,
    /// The rank of a slot's module; 0 if the adapter does not target it.
    pub rank: &'a dyn Fn(usize) -> usize,
    pub scale: &'a dyn Fn(usize) -> f32,
    /// Whether a slot's module is stored as bf16: its regions then hold
    /// the same layout in bf16 bits ([`as_bits`]), in their first half.
    pub bf16: &'a dyn Fn(usize) -> bool,
}

/// An f32 buffer's memory as bf16 bits, twice as many: a slot region sized
/// for f32 holds a bf16 module in its first half.
#[allow(unsafe_code)]
pub fn as_bits(v: &[f32]) -> &[u16] {
    // SAFETY: the same bytes, borrowed as long; u16 needs less alignment
    // than f32 and every bit pattern is a valid u16.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len() * 2) }
}

/// [`as_bits`], mutably.
#[allow(unsafe_code)]
pub fn as_bits_mut(v: &mut [f32]) -> &mut [u16] {
    // SAFETY: as in `as_bits`, and every bit pattern is also a valid f32.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 2) }
}

impl std::fmt::Debug for SlotView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotView")
            .field("max_rank", &self.max_rank)
            .finish_non_exhaustive()
    }
}

impl SlotView<'_> {
    /// Floats of one slot's A panels.
    pub fn a_len(max_rank: usize, fan_in: usize) -> usize {
        max_rank.div_ceil(NR) * fan_in * NR
    }

    /// Floats of one slot's Bᵀ panels.
    pub fn b_len(max_rank: usize, fan_out: usize) -> usize {
        fan_out.div_ceil(NR) * max_rank.next_multiple_of(NR) * NR
    }

    /// Packs one module of `rank` (A `[rank, fan_in]`, Bᵀ `[rank, fan_out]`,
    /// row-major) into one slot's regions `a` and `b`: A is transposed,
    /// then [`SlotView::pack_transposed`].
    #[allow(clippy::too_many_arguments)]
    pub fn pack<T: Copy + Default>(
        a_rows: &[T],
        b_t: &[T],
        rank: usize,
        fan_in: usize,
        fan_out: usize,
        max_rank: usize,
        a: &mut [T],
        b: &mut [T],
    ) {
        assert_eq!(a_rows.len(), rank * fan_in);
        let mut a_t = vec![T::default(); fan_in * rank];
        for (r, row) in a_rows.chunks_exact(fan_in.max(1)).enumerate() {
            for (i, &v) in row.iter().enumerate() {
                a_t[i * rank + r] = v;
            }
        }
        Self::pack_transposed(&a_t, b_t, rank, fan_in, fan_out, max_rank, a, b)
    }

    /// Packs one module of `rank` (Aᵀ `[fan_in, rank]`, Bᵀ `[rank,
    /// fan_out]`, row-major, as [`crate::lora::Factors`] holds them) into
    /// one slot's regions `a` and `b`. Only the part a module of this rank
    /// reads is written (and its padding zeroed), so a slot is never
    /// cleared first. The values are f32, or bf16 bits packed into
    /// [`as_bits_mut`] of the slot's regions.
    #[allow(clippy::too_many_arguments)]
    pub fn pack_transposed<T: Copy + Default>(
        a_t: &[T],
        b_t: &[T],
        rank: usize,
        fan_in: usize,
        fan_out: usize,
        max_rank: usize,
        a: &mut [T],
        b: &mut [T],
    ) {
        assert!(rank <= max_rank && max_rank.is_multiple_of(NR));
        assert_eq!(a_t.len(), fan_in * rank);
        assert_eq!(b_t.len(), rank * fan_out);
        if rank == 0 {
            // A module of rank 0 reads nothing.
            return;
        }
        let k = rank.next_multiple_of(NR);
        // A: panel q holds ranks q*NR.., input-major, which is Aᵀ's order:
        // a slot write (while the step waits) copies whole rows, and at
        // rank NR the whole panel at once.
        if rank == NR {
            a[..fan_in * NR].copy_from_slice(a_t);
        } else {
            for (q, panel) in a[..k * fan_in].chunks_exact_mut(fan_in * NR).enumerate() {
                let rows = (rank - q * NR).min(NR);
                for (dst, src) in panel.chunks_exact_mut(NR).zip(a_t.chunks_exact(rank)) {
                    dst[..rows].copy_from_slice(&src[q * NR..][..rows]);
                    dst[rows..].fill(T::default());
                }
            }
        }
        // Bᵀ: panel p holds k rows of NR outputs; rows past `rank` and
        // outputs past `fan_out` are zero. Each value is written once: a
        // slot write is bound by memory traffic.
        let b = &mut b[..fan_out.div_ceil(NR) * k * NR];
        for (p, panel) in b.chunks_exact_mut(k * NR).enumerate() {
            let cols = (fan_out - p * NR).min(NR);
            for (r, row) in panel.chunks_exact_mut(NR).enumerate() {
                let row: &mut [T; NR] = row.try_into().expect("NR values");
                if r >= rank {
                    *row = [T::default(); NR];
                } else if cols == NR {
                    *row = b_t[r * fan_out + p * NR..][..NR]
                        .try_into()
                        .expect("NR values");
                } else {
                    row[..cols].copy_from_slice(&b_t[r * fan_out + p * NR..][..cols]);
                    row[cols..].fill(T::default());
                }
            }
        }
    }
}

/// `out[t, 0..width]` for `n` rows of `x` (rows of `fan_in`) against the
/// given panels, [`GROUP`] at a time; `out` is `[n, width]`, `width` at
/// most the panels' outputs.
fn panels_into<W: PanelValue>(
    kernel: Kernel,
    x: &[f32],
    fan_in: usize,
    n: usize,
    panels: &[&[W]],
    width: usize,
    out: &mut [f32],
) {
    let mut local = vec![0f32; n * GROUP * NR];
    for (g, group) in panels.chunks(GROUP).enumerate() {
        let cols = group.len() * NR;
        let local = &mut local[..n * cols];
        kernel.group(x, fan_in, n, group, Prefetch::NONE, local);
        let lo = g * GROUP * NR;
        let take = cols.min(width - lo);
        for t in 0..n {
            out[t * width + lo..][..take].copy_from_slice(&local[t * cols..][..take]);
        }
    }
}

/// One piece of a step's LoRA work: the tokens `lo..hi`, either one slot's
/// (a tile of up to [`SHARED_TILE`] tokens of one segment, sharing its
/// panels) or up to [`GATHER`] one-token segments of different slots whose
/// ranks round up to the same `k`, gathered side by side.
#[derive(Debug)]
struct LoraWork {
    lo: usize,
    hi: usize,
    /// The rank rounded up to whole panels.
    k: usize,
    /// Whether the slots hold bf16 (a gather never mixes the two).
    bf16: bool,
    /// `(slot, scale)` of each token in `lo..hi` (one entry when shared).
    slots: Vec<(usize, f32)>,
}

/// Tokens per tile of one segment.
const SHARED_TILE: usize = 8;

/// The grouped LoRA kernel (SGMV): for each segment of tokens sharing a
/// slot, one shrink `h = x·Aᵀ` that reads each A panel once for the whole
/// segment, then one expand `out += s·(h·Bᵀ)`. Segments of one token (a
/// decode step over many adapters) are gathered a few at a time instead,
/// each token against its own slot's panels. Both are fused multiply-add
/// chains in a fixed order that depends only on the token's own row and the
/// slot's rank, so neither grouping nor gathering changes the numbers.
pub fn lora_segments(
    x: &[f32],
    segments: &[crate::backend::Segment],
    slots: &SlotView<'_>,
    out: &mut [f32],
) {
    let (fan_in, fan_out, max_rank) = (slots.fan_in, slots.fan_out, slots.max_rank);
    // The work items below write their own rows of `out` in parallel,
    // which needs segments in order, apart, and inside both buffers.
    assert!(
        segments.iter().all(|s| s.start <= s.end)
            && segments.windows(2).all(|w| w[0].end <= w[1].start)
            && segments
                .last()
                .is_none_or(|s| s.end * fan_out <= out.len() && s.end * fan_in <= x.len()),
        "segments in order, apart, and inside x and out"
    );
    let tokens: usize = segments.iter().map(|s| s.end - s.start).sum();
    let mut work: Vec<LoraWork> = Vec::new();
    for seg in segments {
        let rank = (slots.rank)(seg.slot);
        if rank == 0 {
            continue;
        }
        let (k, scale, bf16) = (
            rank.next_multiple_of(NR),
            (slots.scale)(seg.slot),
            (slots.bf16)(seg.slot),
        );
        if seg.end - seg.start == 1 {
            if let Some(w) = work.last_mut().filter(|w| {
                w.slots.len() > 1 || w.hi - w.lo == 1 // a gather, or one token
            }) && w.hi == seg.start
                && w.k == k
                && w.bf16 == bf16
                && w.slots.len() < GATHER
            {
                w.hi += 1;
                w.slots.push((seg.slot, scale));
                continue;
            }
            work.push(LoraWork {
                lo: seg.start,
                hi: seg.end,
                k,
                bf16,
                slots: vec![(seg.slot, scale)],
            });
            continue;
        }
        for lo in (seg.start..seg.end).step_by(SHARED_TILE) {
            work.push(LoraWork {
                lo,
                hi: (lo + SHARED_TILE).min(seg.end),
                k,
                bf16,
                slots: vec![(seg.slot, scale)],
            });
        }
    }
    let kernel = Kernel::detect();
    let (a_len, b_len) = (
        SlotView::a_len(max_rank, fan_in),
        SlotView::b_len(max_rank, fan_out),
    );
    let (a_all, b_all) = (slots.a, slots.b);
    // A slot's A and Bᵀ regions, as f32 or as bf16 bits.
    let f32_regions = |slot: usize| {
        (
            &a_all[slot * a_len..][..a_len],
            &b_all[slot * b_len..][..b_len],
        )
    };
    let bf16_regions = |slot: usize| {
        (
            as_bits(&a_all[slot * a_len..][..a_len]),
            as_bits(&b_all[slot * b_len..][..b_len]),
        )
    };
    let run = |w: &LoraWork| -> Vec<f32> {
        let (n, k) = (w.hi - w.lo, w.k);
        let xs = &x[w.lo * fan_in..w.hi * fan_in];
        // Shrink over whole panels of rank: rows past `rank` are zero, so
        // their h is zero and adds nothing in the expand.
        let mut h = vec![0f32; n * k];
        let mut delta = vec![0f32; n * fan_out];
        let dims = (fan_in, fan_out);
        if w.bf16 {
            lora_item(kernel, xs, &mut h, &mut delta, w, dims, bf16_regions);
        } else {
            lora_item(kernel, xs, &mut h, &mut delta, w, dims, f32_regions);
        }
        // Then the scale, as PEFT applies it.
        if let [(_, scale)] = w.slots[..] {
            delta.iter_mut().for_each(|d| *d *= scale);
        } else {
            for (row, &(_, scale)) in delta.chunks_exact_mut(fan_out).zip(&w.slots) {
                row.iter_mut().for_each(|d| *d *= scale);
            }
        }
        delta
    };
    let shared = SharedOut::new(out);
    let add = |w: &LoraWork| {
        let delta = run(w);
        // SAFETY: the work items cover disjoint token ranges, so rows
        // lo..hi of `out` are this item's alone.
        #[allow(unsafe_code)]
        let rows = unsafe { shared.row(w.lo * fan_out, (w.hi - w.lo) * fan_out) };
        for (y, d) in rows.iter_mut().zip(delta) {
            *y += d;
        }
    };
    // Small batches are not worth the threads.
    if tokens >= 16 {
        super::team::for_each(work.len(), || (), |_, i| add(&work[i]));
    } else {
        work.iter().for_each(add);
    }
}

/// The unscaled deltas of one work item. A tile of one slot runs one shrink
/// of its tokens over the slot's A panels into `h`, then one expand over its
/// Bᵀ panels into `delta`, each panel row loaded once for the whole tile. A
/// gather runs each token against its own slot's run of panels, A's
/// `k / NR` then Bᵀ's. `regions` gives a slot's A and Bᵀ regions in the
/// values they are stored in.
fn lora_item<'s, W: PanelValue>(
    kernel: Kernel,
    xs: &[f32],
    h: &mut [f32],
    delta: &mut [f32],
    w: &LoraWork,
    (fan_in, fan_out): (usize, usize),
    regions: impl Fn(usize) -> (&'s [W], &'s [W]),
) {
    let (k, n) = (w.k, w.hi - w.lo);
    let panels = fan_out.div_ceil(NR);
    if let [(slot, _)] = w.slots[..] {
        let (a, b) = regions(slot);
        // Panel q of A holds ranks q*NR..; panel p of Bᵀ outputs p*NR...
        let a_panels: Vec<&[W]> = a[..k * fan_in].chunks_exact(fan_in * NR).collect();
        panels_into(kernel, xs, fan_in, n, &a_panels, k, h);
        let b_panels: Vec<&[W]> = b[..panels * k * NR].chunks_exact(k * NR).collect();
        panels_into(kernel, h, k, n, &b_panels, fan_out, delta);
        return;
    }
    let rows: Vec<(&[f32], &[W])> = (0..n)
        .map(|r| (&xs[r * fan_in..], &regions(w.slots[r].0).0[..k * fan_in]))
        .collect();
    kernel.gather(&rows, fan_in, k / NR, h);
    let rows: Vec<(&[f32], &[W])> = (0..n)
        .map(|r| (&h[r * k..], &regions(w.slots[r].0).1[..panels * k * NR]))
        .collect();
    if panels * NR == fan_out {
        kernel.gather(&rows, k, panels, delta);
    } else {
        let mut padded = vec![0f32; n * panels * NR];
        kernel.gather(&rows, k, panels, &mut padded);
        for (d, p) in delta
            .chunks_exact_mut(fan_out)
            .zip(padded.chunks_exact(panels * NR))
        {
            d.copy_from_slice(&p[..fan_out]);
        }
    }
}
