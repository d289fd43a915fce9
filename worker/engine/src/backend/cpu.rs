//! The CPU backend: the exact reference for every other backend.
//!
//! All math is f32. Every per-token result is computed with a fixed
//! summation order that does not depend on which other tokens share the
//! step, so a sequence produces the same bits alone or in any batch, and a
//! recomputed prefill reproduces its decode-time KV exactly.

use std::path::Path;

use super::panels::{GATHER, GROUP, Kernel, NR, PackedLinear, PanelValue, Prefetch, SharedOut};
use super::{Backend, BackendShape, StepBatch};
use crate::error::{EngineError, Result};
use crate::lora::{Factors, HostAdapter, Projection};
use crate::model::{ModelConfig, WeightFiles};

/// A decoder layer's weights. Projections that read the same input are
/// packed as one (their rows stacked), so each runs as one parallel pass:
/// every output is still its own chain over its own row of weights.
#[derive(Debug)]
struct Layer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    /// q, k and v, stacked in that order.
    qkv: PackedLinear,
    o: PackedLinear,
    /// gate and up, stacked in that order.
    gate_up: PackedLinear,
    down: PackedLinear,
}

/// The adapter slots of every (layer, projection): one buffer per (layer,
/// projection), slot-major, each slot padded to `max_lora_rank` rounded up
/// to a whole panel, and packed into the panels the projection kernels
/// read (see [`SlotView`]).
#[derive(Debug)]
struct SlotTable {
    /// `max_lora_rank` rounded up to a multiple of [`NR`].
    max_rank: usize,
    /// `a[layer * 7 + proj]`: A panels, as [`SlotView::a`].
    a: Vec<Vec<f32>>,
    /// `b[layer * 7 + proj]`: Bᵀ panels, as [`SlotView::b`].
    b: Vec<Vec<f32>>,
    /// `rank[slot][layer * 7 + proj]`; 0 where the adapter has no module.
    rank: Vec<Vec<usize>>,
    /// `scale[slot][layer * 7 + proj]`.
    scale: Vec<Vec<f32>>,
    /// `bf16[slot][layer * 7 + proj]`: the module's regions hold bf16 bits
    /// ([`SlotView::bf16`]).
    bf16: Vec<Vec<bool>>,
}

/// The CPU backend.
#[derive(Debug)]
pub struct CpuBackend {
    config: ModelConfig,
    shape: BackendShape,
    embed: Vec<f32>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// Packed from `lm_head.weight`, or from the embeddings when tied.
    lm_head: PackedLinear,
    /// `k[layer]`, `v[layer]`: `[blocks, block_size, kv_dim]`.
    k_cache: Vec<Vec<f32>>,
    v_cache: Vec<Vec<f32>>,
    slots: SlotTable,
    inv_freq: Vec<f32>,
}

impl CpuBackend {
    /// Bytes the packed projection weights and the lm_head take: half for
    /// a bf16 checkpoint of what f32 takes.
    pub fn projection_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.qkv, &l.o, &l.gate_up, &l.down]
                    .iter()
                    .map(|p| p.weight_bytes())
                    .sum::<usize>()
            })
            .sum();
        layers + self.lm_head.weight_bytes()
    }

    /// Loads the weights of a model directory.
    pub fn load(dir: &Path, config: &ModelConfig, shape: BackendShape) -> Result<CpuBackend> {
        let files = WeightFiles::open_model_dir(dir)?;
        let c = config;
        let embed = files.f32("model.embed_tokens.weight", &[c.vocab_size, c.hidden_size])?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let prefix = format!("model.layers.{l}");
            // Weights `[fan_out, fan_in]` of the given projections stacked
            // by rows, and their biases likewise.
            let stacked = |parts: &[Projection]| -> Result<PackedLinear> {
                let has_bias = match parts[0] {
                    Projection::Q | Projection::K | Projection::V => c.qkv_bias,
                    Projection::O => c.o_bias,
                    _ => c.mlp_bias,
                };
                let fan_in = parts[0].shape(c).0;
                let (mut w16, mut bias, mut fan_out) = (Some(Vec::new()), Vec::new(), 0);
                let mut weights = Vec::new();
                for p in parts {
                    let out = p.shape(c).1;
                    let name = format!("{prefix}.{}.{}", p.parent(), p.module_name());
                    let weight = format!("{name}.weight");
                    // bf16 checkpoints keep their weights in bf16 (see
                    // `panels`); any other dtype in the stack means f32.
                    w16 = match (w16, files.bf16_bits(&weight, &[out, fan_in])?) {
                        (Some(mut all), Some(bits)) => {
                            all.extend(bits);
                            Some(all)
                        }
                        _ => None,
                    };
                    if has_bias {
                        bias.extend(files.f32(&format!("{name}.bias"), &[out])?);
                    }
                    weights.push((weight, out));
                    fan_out += out;
                }
                let bias = has_bias.then_some(bias);
                if let Some(w16) = w16 {
                    return Ok(PackedLinear::pack_bf16(&w16, bias, fan_in, fan_out));
                }
                let mut w = Vec::with_capacity(fan_in * fan_out);
                for (weight, out) in &weights {
                    w.extend(files.f32(weight, &[*out, fan_in])?);
                }
                Ok(PackedLinear::pack(&w, bias, fan_in, fan_out))
            };
            use Projection::*;
            layers.push(Layer {
                input_norm: files.f32(
                    &format!("{prefix}.input_layernorm.weight"),
                    &[c.hidden_size],
                )?,
                post_norm: files.f32(
                    &format!("{prefix}.post_attention_layernorm.weight"),
                    &[c.hidden_size],
                )?,
                qkv: stacked(&[Q, K, V])?,
                o: stacked(&[O])?,
                gate_up: stacked(&[Gate, Up])?,
                down: stacked(&[Down])?,
            });
        }
        let norm = files.f32("model.norm.weight", &[c.hidden_size])?;
        let head_name = if c.tie_word_embeddings && !files.contains("lm_head.weight") {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        };
        let head_shape = [c.vocab_size, c.hidden_size];
        let lm_head = match files.bf16_bits(head_name, &head_shape)? {
            Some(bits) => PackedLinear::pack_bf16(&bits, None, c.hidden_size, c.vocab_size),
            None if head_name == "lm_head.weight" => {
                let w = files.f32(head_name, &head_shape)?;
                PackedLinear::pack(&w, None, c.hidden_size, c.vocab_size)
            }
            None => PackedLinear::pack(&embed, None, c.hidden_size, c.vocab_size),
        };
        Ok(Self::from_parts(
            c.clone(),
            shape,
            embed,
            layers,
            norm,
            lm_head,
        ))
    }

    fn from_parts(
        config: ModelConfig,
        shape: BackendShape,
        embed: Vec<f32>,
        layers: Vec<Layer>,
        norm: Vec<f32>,
        lm_head: PackedLinear,
    ) -> CpuBackend {
        let kv_len = shape.kv_blocks * shape.block_size * config.kv_dim();
        let n = config.num_layers * 7;
        let max_rank = shape.max_lora_rank.next_multiple_of(NR);
        let mut a = Vec::with_capacity(n);
        let mut b = Vec::with_capacity(n);
        for _ in 0..config.num_layers {
            for p in Projection::ALL {
                let (fan_in, fan_out) = p.shape(&config);
                a.push(vec![0f32; shape.slots * SlotView::a_len(max_rank, fan_in)]);
                b.push(vec![0f32; shape.slots * SlotView::b_len(max_rank, fan_out)]);
            }
        }
        let half = config.head_dim / 2;
        // As transformers computes it: 1 / theta^(2i/d), in f32.
        let inv_freq = (0..half)
            .map(|i| {
                1.0 / config
                    .rope_theta
                    .powf((2 * i) as f32 / config.head_dim as f32)
            })
            .collect();
        CpuBackend {
            k_cache: (0..config.num_layers).map(|_| vec![0f32; kv_len]).collect(),
            v_cache: (0..config.num_layers).map(|_| vec![0f32; kv_len]).collect(),
            slots: SlotTable {
                max_rank,
                a,
                b,
                rank: vec![vec![0; n]; shape.slots],
                scale: vec![vec![0.0; n]; shape.slots],
                bf16: vec![vec![false; n]; shape.slots],
            },
            config,
            shape,
            embed,
            layers,
            norm,
            lm_head,
            inv_freq,
        }
    }
}

/// A dot product with a fixed order: eight interleaved partial sums, then
/// the tail. The order depends only on the length.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        let (x, y) = (&a[i * 8..i * 8 + 8], &b[i * 8..i * 8 + 8]);
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut tail = 0f32;
    for i in chunks * 8..a.len() {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// One token's attention over its cached positions, every head.
struct AttentionRow<'a> {
    /// The token's query, `[heads * head_dim]`.
    q: &'a [f32],
    k_cache: &'a [f32],
    v_cache: &'a [f32],
    /// Where each attended position's keys and values start, in position
    /// order.
    offsets: &'a [usize],
    heads: usize,
    /// Query heads per key-value head.
    group: usize,
    head_dim: usize,
    scale: f32,
}

impl AttentionRow<'_> {
    /// Writes the attention output into `out` (`[heads * head_dim]`, zeroed).
    fn attend(&self, kernel: Kernel, out: &mut [f32]) {
        match kernel {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `detect` chose an x86 kernel only where the CPU has AVX2.
            #[allow(unsafe_code)]
            Kernel::Avx2 | Kernel::Avx512 => unsafe { self.attend_avx2(out) },
            _ => self.attend_with(out),
        }
    }

    /// The same code compiled for AVX2: `dot`'s eight partial sums become
    /// one vector, and the weighted sum of values runs eight lanes at a
    /// time. Rust never fuses a multiply and an add on its own, so every
    /// value is the same bits as in the baseline build.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[allow(unsafe_code)]
    unsafe fn attend_avx2(&self, out: &mut [f32]) {
        self.attend_with(out)
    }

    #[inline(always)]
    fn attend_with(&self, out: &mut [f32]) {
        debug_assert!(out.iter().all(|&v| v == 0.0), "the output starts at zero");
        let hd = self.head_dim;
        let mut scores = vec![0f32; self.offsets.len()];
        for h in 0..self.heads {
            let kv = (h / self.group) * hd;
            let qh = &self.q[h * hd..(h + 1) * hd];
            let mut max = f32::NEG_INFINITY;
            for (sc, &at) in scores.iter_mut().zip(self.offsets) {
                *sc = dot(qh, &self.k_cache[at + kv..at + kv + hd]) * self.scale;
                max = max.max(*sc);
            }
            let mut sum = 0f32;
            for sc in scores.iter_mut() {
                *sc = (*sc - max).exp();
                sum += *sc;
            }
            let oh = &mut out[h * hd..(h + 1) * hd];
            for (&sc, &at) in scores.iter().zip(self.offsets) {
                let w = sc / sum;
                for (o, &v) in oh.iter_mut().zip(&self.v_cache[at + kv..at + kv + hd]) {
                    *o += w * v;
                }
            }
        }
    }
}

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
    segments: &[super::Segment],
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

fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mean_sq = dot(xr, xr) / d as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for i in 0..d {
            or[i] = weight[i] * (xr[i] * inv);
        }
    }
}

impl CpuBackend {
    /// Adds each segment's LoRA delta to `out` for projection `p` of `layer`.
    fn apply_lora(
        &self,
        batch: &StepBatch<'_>,
        layer: usize,
        p: Projection,
        x: &[f32],
        out: &mut [f32],
    ) {
        let (fan_in, fan_out) = p.shape(&self.config);
        let key = layer * 7 + p.index();
        let slots = SlotView {
            a: &self.slots.a[key],
            b: &self.slots.b[key],
            max_rank: self.slots.max_rank,
            fan_in,
            fan_out,
            rank: &|slot| self.slots.rank[slot][key],
            scale: &|slot| self.slots.scale[slot][key],
            bf16: &|slot| self.slots.bf16[slot][key],
        };
        lora_segments(x, &batch.segments, &slots, out);
    }

    /// The projections `parts` of `layer`, packed together as `lin`, for
    /// the `n` rows of `x`, each with its LoRA deltas added: one output
    /// `[n, fan_out]` per part.
    fn projections<const K: usize>(
        &self,
        batch: &StepBatch<'_>,
        layer: usize,
        lin: &PackedLinear,
        parts: [Projection; K],
        x: &[f32],
        n: usize,
    ) -> [Vec<f32>; K] {
        let mut outs = lin.forward_split(x, n, parts.map(|p| p.shape(&self.config).1));
        if !batch.segments.is_empty() {
            for (p, out) in parts.iter().zip(&mut outs) {
                self.apply_lora(batch, layer, *p, x, out);
            }
        }
        outs
    }

    /// `(cos, sin)` of every rotary frequency at each of the step's token
    /// positions, `[tokens, head_dim / 2]`: computed once per step, since
    /// every layer and head rotates by the same angles.
    fn rope_table(&self, batch: &StepBatch<'_>) -> Vec<(f32, f32)> {
        let half = self.config.head_dim / 2;
        let mut table = vec![(0f32, 0f32); batch.tokens.len() * half];
        for s in &batch.seqs {
            for i in 0..s.len {
                let (t, position) = (s.start + i, s.first_position + i);
                for (f, cs) in table[t * half..(t + 1) * half].iter_mut().enumerate() {
                    let (sin, cos) = (position as f32 * self.inv_freq[f]).sin_cos();
                    *cs = (cos, sin);
                }
            }
        }
        table
    }

    /// Rotate-half RoPE of every head in `v` by one token's angles.
    fn rope(&self, v: &mut [f32], angles: &[(f32, f32)]) {
        let half = self.config.head_dim / 2;
        for head in v.chunks_exact_mut(self.config.head_dim) {
            for (i, &(cos, sin)) in angles.iter().enumerate() {
                let (x1, x2) = (head[i], head[i + half]);
                head[i] = x1 * cos - x2 * sin;
                head[i + half] = x2 * cos + x1 * sin;
            }
        }
    }

    fn kv_index(&self, block_table: &[u32], position: usize) -> usize {
        let bs = self.shape.block_size;
        (block_table[position / bs] as usize * bs + position % bs) * self.config.kv_dim()
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn device_name(&self) -> String {
        format!(
            "{} CPU ({} threads)",
            std::env::consts::ARCH,
            rayon::current_num_threads()
        )
    }

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn shape(&self) -> BackendShape {
        self.shape
    }

    fn write_slot(&mut self, slot: usize, adapter: &HostAdapter) -> Result<()> {
        super::check_slot_write(&self.shape, slot, adapter)?;
        self.clear_slot(slot)?;
        let (max_rank, config) = (self.slots.max_rank, &self.config);
        // Every (layer, projection) has its own buffers, so the modules are
        // packed in parallel: a slot write is a memory-bound copy of a few
        // MB that the step waits for. On the team, whose workers may still
        // be awake from the last step.
        let mut modules: Vec<(&mut Vec<f32>, &mut Vec<f32>)> = self
            .slots
            .a
            .iter_mut()
            .zip(self.slots.b.iter_mut())
            .collect();
        super::team::for_each_mut(&mut modules, |(a, b), key| {
            let p = Projection::ALL[key % 7];
            let Some(m) = adapter
                .modules
                .get(key / 7)
                .and_then(|m| m[p.index()].as_ref())
            else {
                return;
            };
            let (fan_in, fan_out) = p.shape(config);
            let (a_len, b_len) = (
                SlotView::a_len(max_rank, fan_in),
                SlotView::b_len(max_rank, fan_out),
            );
            let (a, b) = (
                &mut a[slot * a_len..][..a_len],
                &mut b[slot * b_len..][..b_len],
            );
            match &m.factors {
                Factors::F32 { a_t, b_t } => {
                    SlotView::pack_transposed(a_t, b_t, m.rank, fan_in, fan_out, max_rank, a, b)
                }
                Factors::Bf16 { a_t, b_t } => SlotView::pack_transposed(
                    a_t,
                    b_t,
                    m.rank,
                    fan_in,
                    fan_out,
                    max_rank,
                    &mut as_bits_mut(a)[..a_len],
                    &mut as_bits_mut(b)[..b_len],
                ),
            }
        });
        drop(modules);
        for (layer, modules) in adapter.modules.iter().enumerate() {
            for (i, m) in modules.iter().enumerate() {
                if let Some(m) = m {
                    self.slots.rank[slot][layer * 7 + i] = m.rank;
                    self.slots.scale[slot][layer * 7 + i] = m.scale;
                    self.slots.bf16[slot][layer * 7 + i] =
                        matches!(m.factors, Factors::Bf16 { .. });
                }
            }
        }
        Ok(())
    }

    fn clear_slot(&mut self, slot: usize) -> Result<()> {
        if slot >= self.shape.slots {
            return Err(EngineError::Backend(format!("slot {slot} is out of range")));
        }
        // Rank 0 is what makes a module absent: `lora_segments` reads a
        // module's panels only up to its rank, and a slot write covers all
        // of that, so stale weights past it are never read and the slot's
        // memory need not be zeroed.
        for key in 0..self.config.num_layers * 7 {
            self.slots.rank[slot][key] = 0;
            self.slots.scale[slot][key] = 0.0;
            self.slots.bf16[slot][key] = false;
        }
        Ok(())
    }

    fn forward(&mut self, batch: &StepBatch<'_>) -> Result<Vec<f32>> {
        let c = self.config.clone();
        let n = batch.tokens.len();
        let (d, hd, kv_dim) = (c.hidden_size, c.head_dim, c.kv_dim());
        batch.check(&c, self.shape.block_size)?;
        let mut hidden = vec![0f32; n * d];
        for (t, &tok) in batch.tokens.iter().enumerate() {
            hidden[t * d..(t + 1) * d]
                .copy_from_slice(&self.embed[tok as usize * d..(tok as usize + 1) * d]);
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let (rope, half) = (self.rope_table(batch), hd / 2);
        let mut normed = vec![0f32; n * d];
        // The last layer's output matters only at the rows that want
        // logits: past its keys and values (which every row stores), it
        // runs on those rows alone, as one-token sequences at their
        // positions. Each row's chains do not depend on the batch around
        // it, so the logits are the same bits.
        let mut trimmed: Option<StepBatch<'_>> = None;
        for layer in 0..c.num_layers {
            rms_norm(
                &hidden,
                &self.layers[layer].input_norm,
                c.rms_norm_eps,
                &mut normed,
            );
            let l = &self.layers[layer];
            let [mut q, mut k, v] = self.projections(
                batch,
                layer,
                &l.qkv,
                [Projection::Q, Projection::K, Projection::V],
                &normed,
                n,
            );
            // Rotate and store the new keys and values before attending, so
            // a prefill's tokens see each other.
            for s in &batch.seqs {
                for i in 0..s.len {
                    let (t, pos) = (s.start + i, s.first_position + i);
                    let angles = &rope[t * half..(t + 1) * half];
                    self.rope(&mut q[t * c.q_dim()..(t + 1) * c.q_dim()], angles);
                    self.rope(&mut k[t * kv_dim..(t + 1) * kv_dim], angles);
                    let at = self.kv_index(s.block_table, pos);
                    self.k_cache[layer][at..at + kv_dim]
                        .copy_from_slice(&k[t * kv_dim..(t + 1) * kv_dim]);
                    self.v_cache[layer][at..at + kv_dim]
                        .copy_from_slice(&v[t * kv_dim..(t + 1) * kv_dim]);
                }
            }
            let kept = batch.seqs.iter().filter(|s| s.want_logits).count();
            if layer + 1 == c.num_layers && kept < n {
                let mut sub = StepBatch::default();
                let (mut sub_q, mut sub_hidden) = (Vec::new(), Vec::new());
                for s in batch.seqs.iter().filter(|s| s.want_logits) {
                    let t = s.start + s.len - 1;
                    sub.push(
                        &batch.tokens[t..t + 1],
                        s.first_position + s.len - 1,
                        s.block_table,
                        batch.token_slot[t],
                        true,
                    );
                    sub_q.extend_from_slice(&q[t * c.q_dim()..(t + 1) * c.q_dim()]);
                    sub_hidden.extend_from_slice(&hidden[t * d..(t + 1) * d]);
                }
                sub.finish();
                (q, hidden) = (sub_q, sub_hidden);
                normed.truncate(kept * d);
                trimmed = Some(sub);
            }
            let batch = trimmed.as_ref().unwrap_or(batch);
            let n = batch.tokens.len();
            // Attention, one token (all its heads) per task; keys in position order.
            let mut work: Vec<(usize, usize)> = Vec::with_capacity(n);
            for (si, s) in batch.seqs.iter().enumerate() {
                for i in 0..s.len {
                    work.push((si, i));
                }
            }
            // Work item t is token t: sequences hold contiguous tokens, in order.
            debug_assert!(
                work.iter()
                    .enumerate()
                    .all(|(t, &(si, i))| batch.seqs[si].start + i == t)
            );
            let (kc, vc) = (&self.k_cache[layer], &self.v_cache[layer]);
            let (this, kernel) = (&*self, Kernel::detect());
            let mut attn = vec![0f32; n * c.q_dim()];
            let mut rows: Vec<&mut [f32]> = attn.chunks_exact_mut(c.q_dim()).collect();
            super::team::for_each_mut(&mut rows, |out, t| {
                let (si, i) = work[t];
                let s = &batch.seqs[si];
                let (t, pos) = (s.start + i, s.first_position + i);
                let lo = c.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w));
                let offsets: Vec<usize> = (lo..=pos)
                    .map(|p| this.kv_index(s.block_table, p))
                    .collect();
                let row = AttentionRow {
                    q: &q[t * c.q_dim()..(t + 1) * c.q_dim()],
                    k_cache: kc,
                    v_cache: vc,
                    offsets: &offsets,
                    heads: c.num_heads,
                    group: c.gqa_group(),
                    head_dim: hd,
                    scale,
                };
                row.attend(kernel, out);
            });
            drop(rows);
            let [o] = self.projections(batch, layer, &l.o, [Projection::O], &attn, n);
            for (h, o) in hidden.iter_mut().zip(&o) {
                *h += o;
            }
            rms_norm(
                &hidden,
                &self.layers[layer].post_norm,
                c.rms_norm_eps,
                &mut normed,
            );
            let [gate, up] = self.projections(
                batch,
                layer,
                &l.gate_up,
                [Projection::Gate, Projection::Up],
                &normed,
                n,
            );
            let mut act = vec![0f32; gate.len()];
            let (width, kernel) = (c.intermediate_size, Kernel::detect());
            let mut rows: Vec<&mut [f32]> = act.chunks_exact_mut(width).collect();
            super::team::for_each_mut(&mut rows, |a, t| {
                let (g, u) = (&gate[t * width..][..width], &up[t * width..][..width]);
                super::activation::silu_mul(kernel, g, u, a);
            });
            drop(rows);
            let [down] = self.projections(batch, layer, &l.down, [Projection::Down], &act, n);
            for (h, o) in hidden.iter_mut().zip(&down) {
                *h += o;
            }
        }
        // Final norm and lm_head only for the rows that want logits.
        let batch = trimmed.as_ref().unwrap_or(batch);
        let rows: Vec<usize> = batch
            .seqs
            .iter()
            .filter(|s| s.want_logits)
            .map(|s| s.start + s.len - 1)
            .collect();
        let mut last = vec![0f32; rows.len() * d];
        for (i, &t) in rows.iter().enumerate() {
            last[i * d..(i + 1) * d].copy_from_slice(&hidden[t * d..(t + 1) * d]);
        }
        let mut last_normed = vec![0f32; last.len()];
        rms_norm(&last, &self.norm, c.rms_norm_eps, &mut last_normed);
        let [logits] = self
            .lm_head
            .forward_split(&last_normed, rows.len(), [c.vocab_size]);
        Ok(logits)
    }
}

#[cfg(test)]
mod tests {
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
                    .map(|&h| crate::backend::panels::bf16_to_f32(h))
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
}
