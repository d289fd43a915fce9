//! Loading a model directory into the CPU backend: the layers' weights
//! packed (projections that read the same input stacked as one), the
//! embeddings and lm_head, the KV caches (rings for a model with both
//! kinds of layers) and the adapter slots; and what a KV block, a ring and
//! an adapter slot take, for a shared memory budget.

use std::path::Path;

use super::panels::{NR, PackedLinear};
use super::{CpuBackend, Embedding, Layer, Mlp, SlotTable, SlotView, moe, rope};
use crate::backend::BackendShape;
use crate::error::{EngineError, Result};
use crate::lora::Projection;
use crate::model::norms::{LayerNorms, final_norm};
use crate::model::{ModelConfig, WeightFiles};
use lorafleet_artifact::layers::LayerKind;

impl CpuBackend {
    /// What a KV block and an adapter slot of this backend take, in
    /// bytes: keys and values in f32 for every layer, and each module's
    /// A and Bᵀ panels in f32 at `max_lora_rank` rounded up to a panel.
    pub fn memory_units(
        config: &ModelConfig,
        block_size: usize,
        max_lora_rank: usize,
    ) -> crate::budget::MemoryUnits {
        let max_rank = max_lora_rank.next_multiple_of(NR);
        let per_layer: usize = Projection::ALL
            .iter()
            .map(|p| {
                let (fan_in, fan_out) = p.shape(config);
                SlotView::a_len(max_rank, fan_in) + SlotView::b_len(max_rank, fan_out)
            })
            .sum();
        crate::budget::MemoryUnits {
            // A model with both kinds of layers keeps its sliding layers'
            // keys and values in rings beside the blocks (see
            // `BackendShape::ring_len`): a block holds the global layers'.
            block_bytes: (2 * config.table_layers() * block_size * config.kv_dim() * 4) as u64,
            slot_bytes: (config.num_layers * per_layer * 4) as u64,
        }
    }

    /// Bytes the sliding layers' rings take (`BackendShape::ring_blocks`
    /// blocks of keys and values for each sliding layer, in f32): held
    /// beside the KV blocks, so a shared memory budget sets them aside
    /// first.
    pub fn ring_bytes(config: &ModelConfig, shape: &BackendShape) -> u64 {
        let sliding = config.num_layers - config.table_layers();
        (shape.ring_blocks * sliding * 2 * shape.block_size * config.kv_dim() * 4) as u64
    }

    pub fn load(dir: &Path, config: &ModelConfig, shape: BackendShape) -> Result<CpuBackend> {
        let files = WeightFiles::open_model_dir(dir)?;
        let c = config;
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let prefix = format!("model.layers.{l}");
            // The given projections stacked by rows, with their biases.
            let stacked = |parts: &[Projection]| -> Result<PackedLinear> {
                let has_bias = match parts[0] {
                    Projection::Q | Projection::K | Projection::V => c.qkv_bias,
                    Projection::O => c.o_bias,
                    _ => c.mlp_bias,
                };
                let mut weights = Vec::new();
                let mut bias = Vec::new();
                for (path, out) in lorafleet_artifact::adapter::stored_tensors(c, parts) {
                    let name = format!("{prefix}.{path}");
                    if has_bias {
                        bias.extend(files.f32(&format!("{name}.bias"), &[out])?);
                    }
                    weights.push((format!("{name}.weight"), out));
                }
                pack_stacked(
                    &files,
                    &weights,
                    has_bias.then_some(bias),
                    parts[0].shape(c).0,
                )
            };
            use Projection::*;
            let norms = LayerNorms::load(&files, c, l)?;
            layers.push(Layer {
                input_norm: norms.input,
                post_norm: norms.post,
                attn_out_norm: norms.attn_out,
                mlp_out_norm: norms.mlp_out,
                qkv: stacked(&[Q, K, V])?,
                o: stacked(&[O])?,
                qk_norm: norms.qk,
                sinks: match c.attention_sinks {
                    true => Some(files.f32(&format!("{prefix}.self_attn.sinks"), &[c.num_heads])?),
                    false => None,
                },
                mlp: match c.moe {
                    Some(moe) => Mlp::Moe(moe::MoeBlock::load(&files, c, moe, l)?),
                    None => Mlp::Dense {
                        gate_up: stacked(&[Gate, Up])?,
                        down: stacked(&[Down])?,
                    },
                },
            });
        }
        let norm = final_norm(&files, c)?;
        let embed_name = "model.embed_tokens.weight";
        let head_name = if c.tie_word_embeddings && !files.contains("lm_head.weight") {
            embed_name
        } else {
            "lm_head.weight"
        };
        let table = [c.vocab_size, c.hidden_size];
        let lm_head = match files.bf16_bits(head_name, &table)? {
            Some(bits) => PackedLinear::pack_bf16(&bits, None, c.hidden_size, c.vocab_size),
            None => {
                let w = files.f32(head_name, &table)?;
                PackedLinear::pack(&w, None, c.hidden_size, c.vocab_size)
            }
        };
        let embed = if head_name == embed_name {
            Embedding::Head
        } else {
            match files.bf16_bits(embed_name, &table)? {
                Some(bits) => Embedding::Bf16(bits),
                None => Embedding::F32(files.f32(embed_name, &table)?),
            }
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
        embed: Embedding,
        layers: Vec<Layer>,
        norm: Vec<f32>,
        lm_head: PackedLinear,
    ) -> CpuBackend {
        let kv_len = shape.kv_blocks * shape.block_size * config.kv_dim();
        let ring_len = shape.ring_blocks * shape.block_size * config.kv_dim();
        let cache_len = |layer: usize| {
            if shape.ring_len > 0 && config.layer_kinds[layer] == LayerKind::Sliding {
                ring_len
            } else {
                kv_len
            }
        };
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
        // As transformers computes them, once.
        let rope = rope::RopeTables::new(&config.rope);
        let local_rope = config
            .gemma
            .as_ref()
            .and_then(|g| g.local_rope.as_ref())
            .map(rope::RopeTables::new);
        CpuBackend {
            k_cache: (0..config.num_layers)
                .map(|l| vec![0f32; cache_len(l)])
                .collect(),
            v_cache: (0..config.num_layers)
                .map(|l| vec![0f32; cache_len(l)])
                .collect(),
            slots: SlotTable {
                max_rank,
                a,
                b,
                rank: vec![vec![0; n]; shape.slots],
                scale: vec![vec![0.0; n]; shape.slots],
                bf16: vec![vec![false; n]; shape.slots],
                dora: vec![vec![None; n]; shape.slots],
                bias: vec![vec![None; n]; shape.slots],
            },
            base_row_norms: (0..n).map(|_| std::sync::OnceLock::new()).collect(),
            // Twice the slots: an adapter evicted and asked again soon.
            dora_cache: super::dora::ScaleCache::new(2 * shape.slots),
            expert_slots: vec![None; shape.slots],
            outer_slots: vec![None; shape.slots],
            head_slots: vec![None; shape.slots],
            base_digests: Default::default(),
            expert_lora_rows: Default::default(),
            config,
            shape,
            embed,
            layers,
            norm,
            lm_head,
            rope,
            local_rope,
        }
    }
}

/// Weights `[fan_out, fan_in]` stacked by rows into one projection, with
/// their biases. A quantized checkpoint keeps its codes at their width
/// and a bf16 one its weights in bf16 (see `panels`); a stack that mixes
/// them is packed in f32.
pub(super) fn pack_stacked(
    files: &WeightFiles,
    weights: &[(String, usize)],
    bias: Option<Vec<f32>>,
    fan_in: usize,
) -> Result<PackedLinear> {
    let fan_out: usize = weights.iter().map(|(_, out)| out).sum();
    let quantized = weights
        .iter()
        .map(|(name, out)| files.quantized_matrix(name, &[*out, fan_in]))
        .collect::<std::result::Result<Option<Vec<_>>, _>>()?;
    // A quantized stack's inputs are quantized as the checkpoint's scheme
    // says (each part is a quantized layer of the same scheme).
    let input = files.quantization().and_then(|q| q.input);
    let input = match &quantized {
        Some(_) => input,
        None if input.is_some() && weights.iter().any(|(name, _)| files.stored_quantized(name)) => {
            return Err(EngineError::Backend(format!(
                "{}: the projections fused with it are not all quantized, and its inputs \
                 are quantized on the fly (`input_activations`); they cannot share one input",
                weights[0].0
            )));
        }
        None => None,
    };
    if let Some(stack) = quantized {
        let stack: Vec<_> = stack.iter().collect();
        if let Some(packed) = PackedLinear::pack_quantized(&stack, bias.clone()) {
            return Ok(packed.with_input(input));
        }
    }
    let mut w16 = Some(Vec::new());
    for (name, out) in weights {
        w16 = match (w16, files.bf16_bits(name, &[*out, fan_in])?) {
            (Some(mut all), Some(bits)) => {
                all.extend(bits);
                Some(all)
            }
            _ => None,
        };
    }
    if let Some(w16) = w16 {
        return Ok(PackedLinear::pack_bf16(&w16, bias, fan_in, fan_out));
    }
    let mut w = Vec::with_capacity(fan_in * fan_out);
    for (name, out) in weights {
        w.extend(files.f32(name, &[*out, fan_in])?);
    }
    Ok(PackedLinear::pack(&w, bias, fan_in, fan_out).with_input(input))
}
