//! The CPU backend: the exact reference for every other backend.
//!
//! All math is f32. Every per-token result is computed with a fixed
//! summation order that does not depend on which other tokens share the
//! step, so a sequence produces the same bits alone or in any batch, and a
//! recomputed prefill reproduces its decode-time KV exactly.

use std::path::Path;

use rayon::prelude::*;

use super::panels::PackedLinear;
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

/// The adapter slots of every (layer, projection), laid out as the GPU
/// holds them: one buffer per (layer, projection), slot-major, each slot
/// padded to `max_lora_rank`.
#[derive(Debug)]
struct SlotTable {
    max_rank: usize,
    /// `a[layer * 7 + proj]`: `[slots, max_rank, in]`.
    a: Vec<Vec<f32>>,
    /// `b_t[layer * 7 + proj]`: `[slots, max_rank, out]`.
    b_t: Vec<Vec<f32>>,
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
        let mut a = Vec::with_capacity(n);
        let mut b_t = Vec::with_capacity(n);
        for _ in 0..config.num_layers {
            for p in Projection::ALL {
                let (fan_in, fan_out) = p.shape(&config);
                a.push(vec![0f32; shape.slots * shape.max_lora_rank * fan_in]);
                b_t.push(vec![0f32; shape.slots * shape.max_lora_rank * fan_out]);
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
                max_rank: shape.max_lora_rank,
                a,
                b_t,
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

/// Four dot products against one shared row, each summed exactly as
/// [`dot`] sums it (same partial sums, same final order), so a token's
/// result is the same bits whether it is computed alone or in a tile.
#[inline(always)]
fn dot4(xs: [&[f32]; 4], w: &[f32]) -> [f32; 4] {
    let mut acc = [[0f32; 8]; 4];
    let chunks = w.len() / 8;
    for i in 0..chunks {
        let wc = &w[i * 8..i * 8 + 8];
        for (t, x) in xs.iter().enumerate() {
            let xc = &x[i * 8..i * 8 + 8];
            for j in 0..8 {
                acc[t][j] += xc[j] * wc[j];
            }
        }
    }
    let mut out = [0f32; 4];
    for (t, x) in xs.iter().enumerate() {
        let mut tail = 0f32;
        for i in chunks * 8..w.len() {
            tail += x[i] * w[i];
        }
        let a = &acc[t];
        out[t] = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])) + tail;
    }
    out
}

/// `dot(x[t], w)` for every row `t` of `x` (rows of `len`), four at a time.
#[inline(always)]
fn dots(x: &[f32], len: usize, w: &[f32], mut out: impl FnMut(usize, f32)) {
    let n = x.len() / len;
    let row = |t: usize| &x[t * len..(t + 1) * len];
    let mut t = 0;
    while t + 4 <= n {
        let r = dot4([row(t), row(t + 1), row(t + 2), row(t + 3)], w);
        for (k, v) in r.into_iter().enumerate() {
            out(t + k, v);
        }
        t += 4;
    }
    while t < n {
        out(t, dot(row(t), w));
        t += 1;
    }
}

/// Runs the hot loops compiled for the widest vector unit the CPU has.
///
/// The loops are plain lane-wise multiplies and adds with an explicit
/// reduction order and no fused multiply-add (Rust never contracts), so
/// every version computes the same bits; only the speed differs.
mod simd {
    /// Calls `f` inlined into a copy compiled with AVX2 when the CPU has it.
    #[inline(always)]
    pub fn dispatch<R>(f: impl FnOnce() -> R) -> R {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2, checked just above.
                #[allow(unsafe_code)]
                return unsafe { with_avx2(f) };
            }
        }
        f()
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
        f()
    }
}

/// One projection's adapter slots, as [`lora_segments`] reads them.
pub struct SlotView<'a> {
    /// `[slots, max_rank, fan_in]`.
    pub a: &'a [f32],
    /// `[slots, max_rank, fan_out]`.
    pub b_t: &'a [f32],
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

/// The grouped LoRA kernel (SGMV): for each segment of tokens sharing a
/// slot, one shrink `h = x·Aᵀ` that reads each A row once for the whole
/// segment, then one expand `out += s·(h·Bᵀ)`. Each token's result depends
/// only on its own row, so grouping never changes the numbers.
pub fn lora_segments(
    x: &[f32],
    segments: &[super::Segment],
    slots: &SlotView<'_>,
    out: &mut [f32],
) {
    let (fan_in, fan_out, max_rank) = (slots.fan_in, slots.fan_out, slots.max_rank);
    let tokens: usize = segments.iter().map(|s| s.end - s.start).sum();
    // Work items: tiles of up to 8 tokens within one segment, so a tile
    // shares its adapter's A and B rows.
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
    let (a_all, b_all) = (slots.a, slots.b_t);
    let run = |&(slot, rank, scale, lo, hi): &(usize, usize, f32, usize, usize)| -> Vec<f32> {
        let a = &a_all[slot * max_rank * fan_in..][..rank * fan_in];
        let b_t = &b_all[slot * max_rank * fan_out..][..rank * fan_out];
        let n = hi - lo;
        let xs = &x[lo * fan_in..hi * fan_in];
        // Shrink: h[t, k] = x[t]·A[k], each A row read once per tile.
        let mut h = vec![0f32; n * rank];
        for k in 0..rank {
            dots(xs, fan_in, &a[k * fan_in..(k + 1) * fan_in], |t, v| {
                h[t * rank + k] = v
            });
        }
        // Expand: delta[t] = Σ_k h[t, k]·Bᵀ[k], k in order, each B row read
        // once per tile; then the scale, as PEFT applies it.
        let mut delta = vec![0f32; n * fan_out];
        for k in 0..rank {
            let b = &b_t[k * fan_out..(k + 1) * fan_out];
            for t in 0..n {
                let hk = h[t * rank + k];
                for (d, &bv) in delta[t * fan_out..(t + 1) * fan_out].iter_mut().zip(b) {
                    *d += hk * bv;
                }
            }
        }
        delta.iter_mut().for_each(|d| *d *= scale);
        delta
    };
    let run = |tile: &(usize, usize, f32, usize, usize)| simd::dispatch(|| run(tile));
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
            b_t: &self.slots.b_t[key],
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
        if slot >= self.shape.slots {
            return Err(EngineError::Backend(format!("slot {slot} is out of range")));
        }
        if adapter.rank > self.shape.max_lora_rank {
            return Err(EngineError::Backend(format!(
                "adapter {} has rank {} above the slot rank {}",
                adapter.name, adapter.rank, self.shape.max_lora_rank
            )));
        }
        self.clear_slot(slot)?;
        let max_rank = self.slots.max_rank;
        for (layer, modules) in adapter.modules.iter().enumerate() {
            for p in Projection::ALL {
                let Some(m) = &modules[p.index()] else {
                    continue;
                };
                let (fan_in, fan_out) = p.shape(&self.config);
                let key = layer * 7 + p.index();
                self.slots.a[key][slot * max_rank * fan_in..][..m.rank * fan_in]
                    .copy_from_slice(&m.a);
                self.slots.b_t[key][slot * max_rank * fan_out..][..m.rank * fan_out]
                    .copy_from_slice(&m.b_t);
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
        let max_rank = self.slots.max_rank;
        for layer in 0..self.config.num_layers {
            for p in Projection::ALL {
                let (fan_in, fan_out) = p.shape(&self.config);
                let key = layer * 7 + p.index();
                self.slots.a[key][slot * max_rank * fan_in..][..max_rank * fan_in].fill(0.0);
                self.slots.b_t[key][slot * max_rank * fan_out..][..max_rank * fan_out].fill(0.0);
                self.slots.rank[slot][key] = 0;
                self.slots.scale[slot][key] = 0.0;
            }
        }
        Ok(())
    }

    fn forward(&mut self, batch: &StepBatch<'_>) -> Result<Vec<f32>> {
        let c = self.config.clone();
        let n = batch.tokens.len();
        let (d, hd, kv_dim) = (c.hidden_size, c.head_dim, c.kv_dim());
        for &t in &batch.tokens {
            if t as usize >= c.vocab_size {
                return Err(EngineError::request(
                    "prompt",
                    format!("token id {t} is not below vocab_size {}", c.vocab_size),
                ));
            }
        }
        for s in &batch.seqs {
            let needed = (s.first_position + s.len).div_ceil(self.shape.block_size);
            if s.block_table.len() < needed {
                return Err(EngineError::Backend(format!(
                    "a block table holds {} blocks, {needed} needed",
                    s.block_table.len()
                )));
            }
        }
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
