//! The CPU backend: the exact reference for every other backend.
//!
//! All math is f32. Every per-token result is computed with a fixed
//! summation order that does not depend on which other tokens share the
//! step, so a sequence produces the same bits alone or in any batch, and a
//! recomputed prefill reproduces its decode-time KV exactly.

use std::path::Path;

use rayon::prelude::*;

use super::panels::{GROUP, Kernel, NR, PackedLinear};
use super::{Backend, BackendShape, StepBatch};
use crate::error::{EngineError, Result};
use crate::lora::{HostAdapter, Projection};
use crate::model::{ModelConfig, WeightFiles};

#[derive(Debug)]
struct Layer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    /// Indexed by `Projection::index()`.
    proj: Vec<PackedLinear>,
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
    /// Loads the weights of a model directory.
    pub fn load(dir: &Path, config: &ModelConfig, shape: BackendShape) -> Result<CpuBackend> {
        let files = WeightFiles::open_model_dir(dir)?;
        let c = config;
        let embed = files.f32("model.embed_tokens.weight", &[c.vocab_size, c.hidden_size])?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let prefix = format!("model.layers.{l}");
            let mut proj = Vec::with_capacity(7);
            for p in Projection::ALL {
                let (fan_in, fan_out) = p.shape(c);
                let name = format!("{prefix}.{}.{}", p.parent(), p.module_name());
                let has_bias = match p {
                    Projection::Q | Projection::K | Projection::V => c.qkv_bias,
                    Projection::O => c.o_bias,
                    _ => c.mlp_bias,
                };
                let bias = if has_bias {
                    Some(files.f32(&format!("{name}.bias"), &[fan_out])?)
                } else {
                    None
                };
                let w = files.f32(&format!("{name}.weight"), &[fan_out, fan_in])?;
                proj.push(PackedLinear::pack(&w, bias, fan_in, fan_out));
            }
            layers.push(Layer {
                input_norm: files.f32(
                    &format!("{prefix}.input_layernorm.weight"),
                    &[c.hidden_size],
                )?,
                post_norm: files.f32(
                    &format!("{prefix}.post_attention_layernorm.weight"),
                    &[c.hidden_size],
                )?,
                proj,
            });
        }
        let norm = files.f32("model.norm.weight", &[c.hidden_size])?;
        let lm_head = if c.tie_word_embeddings && !files.contains("lm_head.weight") {
            PackedLinear::pack(&embed, None, c.hidden_size, c.vocab_size)
        } else {
            let w = files.f32("lm_head.weight", &[c.vocab_size, c.hidden_size])?;
            PackedLinear::pack(&w, None, c.hidden_size, c.vocab_size)
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
    /// row-major) into one slot's regions `a` and `b`. Only the part a
    /// module of this rank reads is written (and its padding zeroed), so a
    /// slot is never cleared first.
    #[allow(clippy::too_many_arguments)]
    pub fn pack(
        a_rows: &[f32],
        b_t: &[f32],
        rank: usize,
        fan_in: usize,
        fan_out: usize,
        max_rank: usize,
        a: &mut [f32],
        b: &mut [f32],
    ) {
        assert!(rank <= max_rank && max_rank.is_multiple_of(NR));
        assert_eq!(a_rows.len(), rank * fan_in);
        assert_eq!(b_t.len(), rank * fan_out);
        let k = rank.next_multiple_of(NR);
        // A: panel q holds ranks q*NR.., transposed to k-major.
        for (q, panel) in a[..k * fan_in].chunks_exact_mut(fan_in * NR).enumerate() {
            let rows = (rank - q * NR).min(NR);
            for (i, dst) in panel.chunks_exact_mut(NR).enumerate() {
                for (j, d) in dst.iter_mut().enumerate() {
                    *d = if j < rows {
                        a_rows[(q * NR + j) * fan_in + i]
                    } else {
                        0.0
                    };
                }
            }
        }
        // Bᵀ: panel p holds k rows of NR outputs; rows past `rank` and
        // outputs past `fan_out` are zero.
        let b = &mut b[..fan_out.div_ceil(NR) * k * NR];
        b.fill(0.0);
        for (p, panel) in b.chunks_exact_mut(k * NR).enumerate() {
            let cols = (fan_out - p * NR).min(NR);
            for r in 0..rank {
                panel[r * NR..r * NR + cols].copy_from_slice(&b_t[r * fan_out + p * NR..][..cols]);
            }
        }
    }
}

/// `out[t, 0..width]` for `n` rows of `x` (rows of `fan_in`) against the
/// given panels, [`GROUP`] at a time; `out` is `[n, width]`, `width` at
/// most the panels' outputs.
fn panels_into(
    kernel: Kernel,
    x: &[f32],
    fan_in: usize,
    n: usize,
    panels: &[&[f32]],
    width: usize,
    out: &mut [f32],
) {
    let mut local = vec![0f32; n * GROUP * NR];
    for (g, group) in panels.chunks(GROUP).enumerate() {
        let cols = group.len() * NR;
        let local = &mut local[..n * cols];
        kernel.group(x, fan_in, n, group, local);
        let lo = g * GROUP * NR;
        let take = cols.min(width - lo);
        for t in 0..n {
            out[t * width + lo..][..take].copy_from_slice(&local[t * cols..][..take]);
        }
    }
}

/// The grouped LoRA kernel (SGMV): for each segment of tokens sharing a
/// slot, one shrink `h = x·Aᵀ` that reads each A panel once for the whole
/// segment, then one expand `out += s·(h·Bᵀ)`. Both are fused
/// multiply-add chains in a fixed order that depends only on the token's
/// own row and the slot's rank, so grouping never changes the numbers.
pub fn lora_segments(
    x: &[f32],
    segments: &[super::Segment],
    slots: &SlotView<'_>,
    out: &mut [f32],
) {
    let (fan_in, fan_out, max_rank) = (slots.fan_in, slots.fan_out, slots.max_rank);
    let tokens: usize = segments.iter().map(|s| s.end - s.start).sum();
    // Work items: tiles of up to 8 tokens within one segment, so a tile
    // shares its adapter's panels.
    const TILE: usize = 8;
    let mut tiles = Vec::new();
    for seg in segments {
        let rank = (slots.rank)(seg.slot);
        if rank == 0 {
            continue;
        }
        let mut t = seg.start;
        while t < seg.end {
            tiles.push((
                seg.slot,
                rank,
                (slots.scale)(seg.slot),
                t,
                (t + TILE).min(seg.end),
            ));
            t += TILE;
        }
    }
    let kernel = Kernel::detect();
    let (a_len, b_len) = (
        SlotView::a_len(max_rank, fan_in),
        SlotView::b_len(max_rank, fan_out),
    );
    let run = |&(slot, rank, scale, lo, hi): &(usize, usize, f32, usize, usize)| -> Vec<f32> {
        let n = hi - lo;
        let xs = &x[lo * fan_in..hi * fan_in];
        // Shrink over whole panels of rank: rows past `rank` are zero, so
        // their h is zero and adds nothing in the expand.
        let k = rank.next_multiple_of(NR);
        let a = &slots.a[slot * a_len..][..a_len];
        let a_panels: Vec<&[f32]> = a.chunks_exact(fan_in * NR).take(k / NR).collect();
        let mut h = vec![0f32; n * k];
        panels_into(kernel, xs, fan_in, n, &a_panels, k, &mut h);
        // Expand over the same k ranks.
        let b = &slots.b[slot * b_len..][..b_len];
        let b_panels: Vec<&[f32]> = b.chunks_exact(k * NR).take(fan_out.div_ceil(NR)).collect();
        let mut delta = vec![0f32; n * fan_out];
        panels_into(kernel, &h, k, n, &b_panels, fan_out, &mut delta);
        // Then the scale, as PEFT applies it.
        delta.iter_mut().for_each(|d| *d *= scale);
        delta
    };
    // Small batches are not worth the threads.
    let deltas: Vec<Vec<f32>> = if tokens >= 16 {
        tiles.par_iter().map(run).collect()
    } else {
        tiles.iter().map(run).collect()
    };
    for (&(_, _, _, lo, hi), delta) in tiles.iter().zip(deltas) {
        for (y, d) in out[lo * fan_out..hi * fan_out].iter_mut().zip(delta) {
            *y += d;
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
        };
        lora_segments(x, &batch.segments, &slots, out);
    }

    fn projection(
        &self,
        batch: &StepBatch<'_>,
        layer: usize,
        p: Projection,
        x: &[f32],
        n: usize,
    ) -> Vec<f32> {
        let lin = &self.layers[layer].proj[p.index()];
        let mut out = vec![0f32; n * lin.fan_out()];
        lin.forward(x, n, &mut out);
        if !batch.segments.is_empty() {
            self.apply_lora(batch, layer, p, x, &mut out);
        }
        out
    }

    fn rope(&self, v: &mut [f32], position: usize) {
        let half = self.config.head_dim / 2;
        for head in v.chunks_exact_mut(self.config.head_dim) {
            for i in 0..half {
                let angle = position as f32 * self.inv_freq[i];
                let (sin, cos) = angle.sin_cos();
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
        let max_rank = self.slots.max_rank;
        for (layer, modules) in adapter.modules.iter().enumerate() {
            for p in Projection::ALL {
                let Some(m) = &modules[p.index()] else {
                    continue;
                };
                let (fan_in, fan_out) = p.shape(&self.config);
                let key = layer * 7 + p.index();
                let (a_len, b_len) = (
                    SlotView::a_len(max_rank, fan_in),
                    SlotView::b_len(max_rank, fan_out),
                );
                SlotView::pack(
                    &m.a,
                    &m.b_t,
                    m.rank,
                    fan_in,
                    fan_out,
                    max_rank,
                    &mut self.slots.a[key][slot * a_len..][..a_len],
                    &mut self.slots.b[key][slot * b_len..][..b_len],
                );
                self.slots.rank[slot][key] = m.rank;
                self.slots.scale[slot][key] = m.scale;
            }
        }
        Ok(())
    }

    fn clear_slot(&mut self, slot: usize) -> Result<()> {
        if slot >= self.shape.slots {
            return Err(EngineError::Backend(format!("slot {slot} is out of range")));
        }
        // Rank 0 is what makes a module absent: `lora_segments` reads a
        // module's panels only up to its rank, and `SlotView::pack` writes
        // all of that, so stale weights past it are never read and the
        // slot's memory need not be zeroed.
        for key in 0..self.config.num_layers * 7 {
            self.slots.rank[slot][key] = 0;
            self.slots.scale[slot][key] = 0.0;
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
        let mut normed = vec![0f32; n * d];
        for layer in 0..c.num_layers {
            rms_norm(
                &hidden,
                &self.layers[layer].input_norm,
                c.rms_norm_eps,
                &mut normed,
            );
            let mut q = self.projection(batch, layer, Projection::Q, &normed, n);
            let mut k = self.projection(batch, layer, Projection::K, &normed, n);
            let v = self.projection(batch, layer, Projection::V, &normed, n);
            // Rotate and store the new keys and values before attending, so
            // a prefill's tokens see each other.
            for s in &batch.seqs {
                for i in 0..s.len {
                    let (t, pos) = (s.start + i, s.first_position + i);
                    self.rope(&mut q[t * c.q_dim()..(t + 1) * c.q_dim()], pos);
                    self.rope(&mut k[t * kv_dim..(t + 1) * kv_dim], pos);
                    let at = self.kv_index(s.block_table, pos);
                    self.k_cache[layer][at..at + kv_dim]
                        .copy_from_slice(&k[t * kv_dim..(t + 1) * kv_dim]);
                    self.v_cache[layer][at..at + kv_dim]
                        .copy_from_slice(&v[t * kv_dim..(t + 1) * kv_dim]);
                }
            }
            // Attention, one (token, head) at a time in parallel; keys in position order.
            let mut work: Vec<(usize, usize)> = Vec::with_capacity(n);
            for (si, s) in batch.seqs.iter().enumerate() {
                for i in 0..s.len {
                    work.push((si, i));
                }
            }
            let (kc, vc) = (&self.k_cache[layer], &self.v_cache[layer]);
            let this = &*self;
            let attn_rows: Vec<Vec<f32>> = work
                .par_iter()
                .map(|&(si, i)| {
                    let s = &batch.seqs[si];
                    let (t, pos) = (s.start + i, s.first_position + i);
                    let lo = c.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    let mut out = vec![0f32; c.q_dim()];
                    let mut scores = vec![0f32; pos + 1 - lo];
                    for h in 0..c.num_heads {
                        let kvh = h / c.gqa_group();
                        let qh = &q[t * c.q_dim() + h * hd..][..hd];
                        let mut max = f32::NEG_INFINITY;
                        for (j, p) in (lo..=pos).enumerate() {
                            let at = this.kv_index(s.block_table, p) + kvh * hd;
                            scores[j] = dot(qh, &kc[at..at + hd]) * scale;
                            max = max.max(scores[j]);
                        }
                        let mut sum = 0f32;
                        for sc in scores.iter_mut() {
                            *sc = (*sc - max).exp();
                            sum += *sc;
                        }
                        let oh = &mut out[h * hd..(h + 1) * hd];
                        for (j, p) in (lo..=pos).enumerate() {
                            let at = this.kv_index(s.block_table, p) + kvh * hd;
                            let w = scores[j] / sum;
                            for (o, &vv) in oh.iter_mut().zip(&vc[at..at + hd]) {
                                *o += w * vv;
                            }
                        }
                    }
                    out
                })
                .collect();
            let mut attn = vec![0f32; n * c.q_dim()];
            for (&(si, i), row) in work.iter().zip(attn_rows) {
                let t = batch.seqs[si].start + i;
                attn[t * c.q_dim()..(t + 1) * c.q_dim()].copy_from_slice(&row);
            }
            let o = self.projection(batch, layer, Projection::O, &attn, n);
            for (h, o) in hidden.iter_mut().zip(&o) {
                *h += o;
            }
            rms_norm(
                &hidden,
                &self.layers[layer].post_norm,
                c.rms_norm_eps,
                &mut normed,
            );
            let gate = self.projection(batch, layer, Projection::Gate, &normed, n);
            let up = self.projection(batch, layer, Projection::Up, &normed, n);
            let act: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let down = self.projection(batch, layer, Projection::Down, &act, n);
            for (h, o) in hidden.iter_mut().zip(&down) {
                *h += o;
            }
        }
        // Final norm and lm_head only for the rows that want logits.
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
        let mut logits = vec![0f32; rows.len() * c.vocab_size];
        self.lm_head.forward(&last_normed, rows.len(), &mut logits);
        Ok(logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Segment;

    fn random(seed: u64, n: usize) -> Vec<f32> {
        let mut rng = crate::sampling::Rng::new(seed);
        (0..n).map(|_| rng.next_f64() as f32 - 0.5).collect()
    }

    #[test]
    fn lora_segments_computes_the_delta_alike_grouped_or_one_token_at_a_time() {
        // Ranks below one panel, of exactly one, and across two; sizes that
        // leave partial panels on both sides.
        let (fan_in, fan_out, max_rank, tokens) = (40, 37, 32, 11);
        let ranks = [5usize, 16, 20];
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
        };
        let x = random(1, tokens * fan_in);
        let slot_of = |t: usize| [0, 0, 0, 1, 1, 2, 2, 2, 2, 1, 0][t];
        let segments: Vec<Segment> = (0..tokens).fold(Vec::<Segment>::new(), |mut segs, t| {
            match segs.last_mut() {
                Some(last) if last.slot == slot_of(t) => last.end = t + 1,
                _ => segs.push(Segment {
                    slot: slot_of(t),
                    start: t,
                    end: t + 1,
                }),
            }
            segs
        });
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
