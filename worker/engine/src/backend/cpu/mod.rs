//! The CPU backend: the exact reference for every other backend.
//!
//! All math is f32. Every per-token result is computed with a fixed
//! summation order that does not depend on which other tokens share the
//! step, so a sequence produces the same bits alone or in any batch, and a
//! recomputed prefill reproduces its decode-time KV exactly.
//!
//! - `load.rs`: a model directory loaded and packed, and what a KV block,
//!   a ring and a slot take;
//! - `attention.rs`: one token's attention over its cached positions;
//! - `rope.rs`: a step's rotary tables and the rotation;
//! - `lora.rs`: the grouped LoRA kernel (SGMV) over packed adapter slots;
//! - `panels.rs`: packed weights and the projection kernels;
//! - `amx.rs`: bf16 projections on AMX tiles;
//! - `activation.rs`: the MLP's `silu(gate) · up` (and GeGLU's);
//! - `team.rs`: the threads that run the forward pass's parallel loops.

pub mod activation;
pub mod amx;
mod attention;
mod dora;
mod load;
mod lora;
mod moe;
mod outer;
pub mod panels;
mod rope;
pub mod team;

pub use lora::{SlotView, as_bits, as_bits_mut, lora_segments};
pub(crate) use moe::gate_up_order;

use attention::{AttentionRow, dot};

use crate::backend::{Backend, BackendShape, SeqStep, StepBatch};
use crate::error::{EngineError, Result};
use crate::lora::{ExpertLayer, Factors, HostAdapter, Projection};
use crate::model::ModelConfig;
use lorafleet_artifact::layers::{Activation, LayerKind};
use panels::{Kernel, PackedLinear};

/// A decoder layer's weights. Projections that read the same input are
/// packed as one (their rows stacked), so each runs as one parallel pass:
/// every output is still its own chain over its own row of weights.
#[derive(Debug)]
struct Layer {
    input_norm: Vec<f32>,
    /// The norm before the MLP (Llama's `post_attention_layernorm`,
    /// Gemma's `pre_feedforward_layernorm`).
    post_norm: Vec<f32>,
    /// Gemma's norms of the attention's and the MLP's outputs
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`).
    attn_out_norm: Option<Vec<f32>>,
    mlp_out_norm: Option<Vec<f32>>,
    /// q, k and v, stacked in that order.
    qkv: PackedLinear,
    o: PackedLinear,
    /// Per-head RMSNorm weights of q and k (Qwen3), applied before RoPE.
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// GPT-OSS's sink logit of each query head (`self_attn.sinks`).
    sinks: Option<Vec<f32>>,
    mlp: Mlp,
}

/// A layer's MLP: one SwiGLU, or a Mixture of SwiGLU experts.
#[derive(Debug)]
enum Mlp {
    Dense {
        /// gate and up, stacked in that order.
        gate_up: PackedLinear,
        down: PackedLinear,
    },
    Moe(moe::MoeBlock),
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
    /// `dora[slot][layer * 7 + proj]`: a DoRA module's scale of each output
    /// row, `m / ‖W + s·B·A‖`, computed from this backend's base weights
    /// when the slot is written; `None` for plain LoRA.
    dora: Vec<Vec<Option<Vec<f32>>>>,
    /// `bias[slot][layer * 7 + proj]`: lora_B's bias times the module's
    /// scale (`lora_bias`), added to the slot's rows with the delta.
    bias: Vec<Vec<Option<Vec<f32>>>>,
}

/// The token embeddings, in the checkpoint's precision. A model whose
/// lm_head is tied to them reads each row out of the lm_head's panels
/// (`PackedLinear::row`), the same values, so the table is held once.
#[derive(Debug)]
enum Embedding {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
    Head,
}

impl Embedding {
    fn bytes(&self) -> usize {
        match self {
            Embedding::F32(t) => t.len() * 4,
            Embedding::Bf16(t) => t.len() * 2,
            Embedding::Head => 0,
        }
    }
}

/// The CPU backend.
#[derive(Debug)]
pub struct CpuBackend {
    config: ModelConfig,
    shape: BackendShape,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// Packed from `lm_head.weight`, or from the embeddings when tied.
    lm_head: PackedLinear,
    /// `k[layer]`, `v[layer]`: `[blocks, block_size, kv_dim]`.
    k_cache: Vec<Vec<f32>>,
    v_cache: Vec<Vec<f32>>,
    slots: SlotTable,
    /// `base_row_norms[layer * 7 + proj]`: `‖W_o‖²` of each output row of
    /// the base projection, for DoRA's norms; computed the first time a
    /// DoRA module of that projection is written to a slot.
    base_row_norms: Vec<std::sync::OnceLock<Vec<f64>>>,
    /// DoRA's scales of the adapters written most recently, by digest.
    dora_cache: dora::ScaleCache,
    /// `expert_slots[slot]`: the slot's adapter's LoRA on the
    /// Mixture-of-Experts blocks, per layer; None where it has none.
    expert_slots: Vec<Option<std::sync::Arc<Vec<ExpertLayer>>>>,
    /// `outer_slots[slot]`: the slot's adapter's LoRA on the embeddings
    /// and the lm_head; None where it has neither.
    outer_slots: Vec<Option<std::sync::Arc<crate::lora::Outer>>>,
    /// `head_slots[slot]`: the slot's adapter's own lm_head
    /// (`modules_to_save`), packed as the base's is.
    head_slots: Vec<Option<std::sync::Arc<PackedLinear>>>,
    /// The digests of the base's embedding and lm_head values
    /// (`lora::outer::values_digest`), for an adapter's saved copies.
    base_digests: [std::sync::OnceLock<[u8; 32]>; 2],
    /// Rows that went through an expert LoRA, all steps together: tokens
    /// whose adapter has no expert weights skip that path, and the tests
    /// check it here.
    expert_lora_rows: std::sync::atomic::AtomicU64,
    /// The rotary embedding's tables: the model's, and Gemma 3's sliding
    /// layers' own.
    rope: rope::RopeTables,
    local_rope: Option<rope::RopeTables>,
}

impl CpuBackend {
    /// Token rows that have gone through an expert LoRA (shrink and expand
    /// on an expert or the router) since the backend was made.
    pub fn expert_lora_rows(&self) -> u64 {
        self.expert_lora_rows
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes the model's weights take in memory: the projections, the
    /// lm_head and the token embeddings (nothing for embeddings tied to
    /// the lm_head), with the norms.
    pub fn weight_bytes(&self) -> usize {
        let norms: usize = self
            .layers
            .iter()
            .map(|l| (l.input_norm.len() + l.post_norm.len()) * 4)
            .sum();
        self.projection_bytes() + self.embed.bytes() + norms + self.norm.len() * 4
    }

    /// Bytes the packed projection weights and the lm_head take: half for
    /// a bf16 checkpoint of what f32 takes.
    pub fn projection_bytes(&self) -> usize {
        self.layer_projection_bytes() + self.lm_head.weight_bytes()
    }

    /// Bytes the Mixture-of-Experts blocks take: routers and experts,
    /// their codes and scales for a quantized checkpoint.
    pub fn moe_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match &l.mlp {
                Mlp::Moe(block) => block.weight_bytes(),
                Mlp::Dense { .. } => 0,
            })
            .sum()
    }

    /// Bytes the layers' packed projections take: their codes, scales and
    /// zero points for a quantized checkpoint.
    pub fn layer_projection_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                let mlp = match &l.mlp {
                    Mlp::Dense { gate_up, down } => gate_up.weight_bytes() + down.weight_bytes(),
                    Mlp::Moe(block) => block.weight_bytes(),
                };
                l.qkv.weight_bytes() + l.o.weight_bytes() + mlp
            })
            .sum()
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
            let mut offset = 0;
            for (p, out) in parts.iter().zip(&mut outs) {
                self.apply_lora(batch, layer, *p, x, out);
                self.apply_lora_bias(batch, layer, *p, out);
                let width = p.shape(&self.config).1;
                let bias = lin.bias().map(|b| &b[offset..offset + width]);
                self.apply_dora(batch, layer, *p, bias, out);
                offset += width;
            }
        }
        outs
    }

    /// `lora_bias`: each such segment's rows of `out` get `s · b_B`.
    fn apply_lora_bias(&self, batch: &StepBatch<'_>, layer: usize, p: Projection, out: &mut [f32]) {
        let key = layer * 7 + p.index();
        let width = p.shape(&self.config).1;
        for seg in &batch.segments {
            let Some(bias) = &self.slots.bias[seg.slot][key] else {
                continue;
            };
            for row in out[seg.start * width..seg.end * width].chunks_exact_mut(width) {
                for (v, b) in row.iter_mut().zip(bias) {
                    *v += b;
                }
            }
        }
    }

    /// The packed projection that holds `p` of `layer`, and the first of
    /// its rows that are `p`'s; `None` for a Mixture-of-Experts layer's
    /// MLP projections.
    fn base_linear(&self, layer: usize, p: Projection) -> Option<(&PackedLinear, usize)> {
        let l = &self.layers[layer];
        let out = |p: Projection| p.shape(&self.config).1;
        match (p, &l.mlp) {
            (Projection::Q, _) => Some((&l.qkv, 0)),
            (Projection::K, _) => Some((&l.qkv, out(Projection::Q))),
            (Projection::V, _) => Some((&l.qkv, out(Projection::Q) + out(Projection::K))),
            (Projection::O, _) => Some((&l.o, 0)),
            (Projection::Gate, Mlp::Dense { gate_up, .. }) => Some((gate_up, 0)),
            (Projection::Up, Mlp::Dense { gate_up, .. }) => Some((gate_up, out(Projection::Gate))),
            (Projection::Down, Mlp::Dense { down, .. }) => Some((down, 0)),
            (Projection::Gate | Projection::Up | Projection::Down, Mlp::Moe(_)) => None,
        }
    }

    /// Where `position`'s key (and value) of sequence `s` is in `layer`'s
    /// cache: through its block table, or its ring for a sliding layer of
    /// a model with both kinds.
    fn kv_at(&self, layer: usize, s: &SeqStep<'_>, position: usize) -> usize {
        let bs = self.shape.block_size;
        let block =
            if self.shape.ring_len > 0 && self.config.layer_kinds[layer] == LayerKind::Sliding {
                s.ring[(position / bs) % self.shape.ring_len]
            } else {
                s.block_table[position / bs]
            };
        (block as usize * bs + position % bs) * self.config.kv_dim()
    }
}

impl Backend for CpuBackend {
    fn memory_units(&self) -> Option<crate::budget::MemoryUnits> {
        Some(CpuBackend::memory_units(
            &self.config,
            self.shape.block_size,
            self.shape.max_lora_rank,
        ))
    }

    fn weight_bytes(&self) -> u64 {
        CpuBackend::weight_bytes(self) as u64
    }

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
        team::for_each_mut(&mut modules, |(a, b), key| {
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
                    self.slots.bias[slot][layer * 7 + i] = m
                        .bias
                        .as_ref()
                        .map(|b| b.iter().map(|v| m.scale * v).collect());
                }
            }
        }
        // DoRA's scales, from the base weights as this backend holds them
        // (dequantized rows for a quantized base, as PEFT dequantizes), or
        // from the cache when the adapter was written before.
        if adapter.is_dora() {
            let cached = adapter
                .digest
                .as_deref()
                .and_then(|d| self.dora_cache.get(d));
            let scales = match cached {
                Some(scales) => scales,
                None => {
                    let scales = match self.dora_scales(adapter) {
                        Ok(s) => s,
                        Err(e) => {
                            self.clear_slot(slot)?;
                            return Err(e);
                        }
                    };
                    self.dora_cache.computed += 1;
                    if let Some(d) = &adapter.digest {
                        self.dora_cache.put(d.clone(), scales.clone());
                    }
                    scales
                }
            };
            for (key, s) in scales.iter() {
                self.slots.dora[slot][*key] = Some(s.clone());
            }
        }
        if adapter.experts.iter().any(|l| !l.is_empty()) {
            self.expert_slots[slot] = Some(adapter.experts.clone());
        }
        if let Err(e) = self.check_copies(adapter) {
            self.clear_slot(slot)?;
            return Err(e);
        }
        if adapter.has_outer() {
            self.outer_slots[slot] = Some(adapter.outer.clone());
        }
        self.head_slots[slot] = self.pack_saved_head(adapter);
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
        self.expert_slots[slot] = None;
        self.outer_slots[slot] = None;
        self.head_slots[slot] = None;
        for key in 0..self.config.num_layers * 7 {
            self.slots.rank[slot][key] = 0;
            self.slots.scale[slot][key] = 0.0;
            self.slots.bf16[slot][key] = false;
            self.slots.dora[slot][key] = None;
            self.slots.bias[slot][key] = None;
        }
        Ok(())
    }

    fn forward(&mut self, batch: &StepBatch<'_>) -> Result<Vec<f32>> {
        let c = self.config.clone();
        let n = batch.tokens.len();
        let (d, hd, kv_dim) = (c.hidden_size, c.head_dim, c.kv_dim());
        batch.check(&c, &self.shape)?;
        let width = batch.logits_width(c.vocab_size);
        super::check_own_vocab(batch, width, |s| self.head_rows(s), |s| self.embed_rows(s))?;
        let mut hidden = vec![0f32; n * d];
        for (t, (&tok, row)) in batch
            .tokens
            .iter()
            .zip(hidden.chunks_exact_mut(d))
            .enumerate()
        {
            let at = tok as usize * d;
            let outer = self.outer_of(batch.token_slot[t]);
            let own = outer
                .and_then(|o| o.saved.embedding.as_ref())
                .is_some_and(|e| e.embed(tok, row));
            match &self.embed {
                _ if own => {}
                Embedding::F32(table) => row.copy_from_slice(&table[at..at + d]),
                Embedding::Bf16(table) => {
                    for (v, &b) in row.iter_mut().zip(&table[at..at + d]) {
                        *v = panels::bf16_to_f32(b);
                    }
                }
                Embedding::Head => self.lm_head.row(tok as usize, row),
            }
            let embed_scale = c.gemma.as_ref().map_or(1.0, |g| g.embed_scale);
            if c.gemma.is_some() {
                for v in row.iter_mut() {
                    *v *= embed_scale;
                }
            }
            // Gemma's scale applies to the LoRA output too: PEFT scales it
            // by the scaled embedding's own factor (`_get_embed_scale`),
            // and Gemma 2 scales the embedding's whole output.
            if let Some(e) = outer.and_then(|o| o.embedding.as_ref()) {
                e.add_delta(tok, embed_scale, row);
            }
        }
        let scale = c.attention_scale();
        let softcap = c.gemma.as_ref().and_then(|g| g.attn_logit_softcapping);
        let half = self.rope.half();
        let global_angles = self.rope.table(batch);
        let local_angles = self.local_rope.as_ref().map(|r| r.table(batch));
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
            if let Some((qn, kn)) = &l.qk_norm {
                let (q_in, k_in) = (q.clone(), k.clone());
                rms_norm(&q_in, qn, c.rms_norm_eps, &mut q);
                rms_norm(&k_in, kn, c.rms_norm_eps, &mut k);
            }
            let angles = match (&local_angles, c.layer_kinds[layer]) {
                (Some(local), LayerKind::Sliding) => local,
                _ => &global_angles,
            };
            // Rotate and store the new keys and values before attending, so
            // a prefill's tokens see each other.
            for s in &batch.seqs {
                for i in 0..s.len {
                    let (t, pos) = (s.start + i, s.first_position + i);
                    let angles = &angles[t * half..(t + 1) * half];
                    rope::rotate(&mut q[t * c.q_dim()..(t + 1) * c.q_dim()], hd, angles);
                    rope::rotate(&mut k[t * kv_dim..(t + 1) * kv_dim], hd, angles);
                    let at = self.kv_at(layer, s, pos);
                    self.k_cache[layer][at..at + kv_dim]
                        .copy_from_slice(&k[t * kv_dim..(t + 1) * kv_dim]);
                    self.v_cache[layer][at..at + kv_dim]
                        .copy_from_slice(&v[t * kv_dim..(t + 1) * kv_dim]);
                }
            }
            let kept: usize = batch.seqs.iter().map(|s| s.logit_rows).sum();
            if layer + 1 == c.num_layers && kept < n {
                let mut sub = StepBatch::default();
                let (mut sub_q, mut sub_hidden) = (Vec::new(), Vec::new());
                for s in batch.seqs.iter().filter(|s| s.logit_rows > 0) {
                    let (k, end) = (s.logit_rows, s.start + s.len);
                    let t = end - k;
                    sub.push_rows(
                        &batch.tokens[t..end],
                        s.first_position + s.len - k,
                        s.block_table,
                        batch.token_slot[t],
                        k,
                    );
                    if let Some(last) = sub.seqs.last_mut() {
                        (last.ring, last.long_rope, last.prompt_len) =
                            (s.ring, s.long_rope, s.prompt_len);
                    }
                    sub_q.extend_from_slice(&q[t * c.q_dim()..end * c.q_dim()]);
                    sub_hidden.extend_from_slice(&hidden[t * d..end * d]);
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
            let window = c.window(layer);
            let sinks = l.sinks.as_deref();
            let (this, kernel) = (&*self, Kernel::detect());
            let mut attn = vec![0f32; n * c.q_dim()];
            let mut rows: Vec<&mut [f32]> = attn.chunks_exact_mut(c.q_dim()).collect();
            team::for_each_mut(&mut rows, |out, t| {
                let (si, i) = work[t];
                let s = &batch.seqs[si];
                let (t, pos) = (s.start + i, s.first_position + i);
                let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                let offsets: Vec<usize> = (lo..=pos).map(|p| this.kv_at(layer, s, p)).collect();
                let row = AttentionRow {
                    q: &q[t * c.q_dim()..(t + 1) * c.q_dim()],
                    k_cache: kc,
                    v_cache: vc,
                    offsets: &offsets,
                    heads: c.num_heads,
                    group: c.gqa_group(),
                    head_dim: hd,
                    scale,
                    softcap,
                    sinks,
                };
                row.attend(kernel, out);
            });
            drop(rows);
            let [mut o] = self.projections(batch, layer, &l.o, [Projection::O], &attn, n);
            if let Some(norm) = &l.attn_out_norm {
                let raw = o.clone();
                rms_norm(&raw, norm, c.rms_norm_eps, &mut o);
            }
            for (h, o) in hidden.iter_mut().zip(&o) {
                *h += o;
            }
            rms_norm(
                &hidden,
                &self.layers[layer].post_norm,
                c.rms_norm_eps,
                &mut normed,
            );
            let out = match &l.mlp {
                Mlp::Dense { gate_up, down } => {
                    let [gate, up] = self.projections(
                        batch,
                        layer,
                        gate_up,
                        [Projection::Gate, Projection::Up],
                        &normed,
                        n,
                    );
                    let mut act = vec![0f32; gate.len()];
                    let (width, kernel) = (c.intermediate_size, Kernel::detect());
                    let mut rows: Vec<&mut [f32]> = act.chunks_exact_mut(width).collect();
                    team::for_each_mut(&mut rows, |a, t| {
                        let (g, u) = (&gate[t * width..][..width], &up[t * width..][..width]);
                        match c.activation {
                            Activation::Silu => activation::silu_mul(kernel, g, u, a),
                            Activation::GeluTanh => activation::gelu_tanh_mul(g, u, a),
                        }
                    });
                    drop(rows);
                    let [out] = self.projections(batch, layer, down, [Projection::Down], &act, n);
                    out
                }
                Mlp::Moe(block) => {
                    // Each token's expert LoRA for this layer, by its slot.
                    let lora: Vec<Option<&ExpertLayer>> = batch
                        .token_slot
                        .iter()
                        .map(|s| {
                            s.and_then(|s| self.expert_slots[s].as_ref())
                                .map(|layers| &layers[layer])
                                .filter(|l| !l.is_empty())
                        })
                        .collect();
                    block.forward(&normed, n, &lora, &self.expert_lora_rows)
                }
            };
            let out = match &l.mlp_out_norm {
                Some(norm) => {
                    let mut normed_out = vec![0f32; out.len()];
                    rms_norm(&out, norm, c.rms_norm_eps, &mut normed_out);
                    normed_out
                }
                None => out,
            };
            for (h, o) in hidden.iter_mut().zip(&out) {
                *h += o;
            }
        }
        // Final norm and lm_head only for the rows that want logits.
        let batch = trimmed.as_ref().unwrap_or(batch);
        let rows = batch.logit_rows();
        let mut last = vec![0f32; rows.len() * d];
        for (i, &t) in rows.iter().enumerate() {
            last[i * d..(i + 1) * d].copy_from_slice(&hidden[t * d..(t + 1) * d]);
        }
        let mut last_normed = vec![0f32; last.len()];
        rms_norm(&last, &self.norm, c.rms_norm_eps, &mut last_normed);
        // The base's lm_head for the rows whose adapter has none of its
        // own; the others' own, slot by slot.
        let mut logits = self.base_head_logits(batch, &rows, &last_normed, width);
        let v = c.vocab_size;
        self.saved_head_logits(batch, &rows, &last_normed, width, &mut logits);
        for (i, &t) in rows.iter().enumerate() {
            let Some(outer) = self.outer_of(batch.token_slot[t]) else {
                continue;
            };
            let (h, row) = (
                &last_normed[i * d..(i + 1) * d],
                &mut logits[i * width..i * width + v],
            );
            if let Some(head) = &outer.lm_head {
                head.add_delta(0, h, row);
            }
            // The adapter's own rows of the lm_head replace the base's
            // (a whole one's, packed, above).
            if let Some(own) = outer.saved.lm_head.as_ref().filter(|o| !o.is_whole()) {
                own.logits(h, row);
            }
        }
        if let Some(cap) = c.gemma.as_ref().and_then(|g| g.final_logit_softcapping) {
            for l in &mut logits {
                *l = (*l / cap).tanh() * cap;
            }
        }
        // A row's logits past its own vocabulary, in a step wider than it.
        if width > v {
            for (i, &t) in rows.iter().enumerate() {
                let own = self.head_rows(batch.token_slot[t]);
                logits[i * width + own..(i + 1) * width].fill(f32::NEG_INFINITY);
            }
        }
        Ok(logits)
    }
}

#[cfg(test)]
mod tests;
