//! Device memory planning: what the base weights, the KV cache, the adapter
//! slots and a step's workspace take, checked against the device's free
//! memory before anything is allocated, so a configuration that cannot fit
//! is refused with the numbers rather than failing midway.

use super::Dtype;
use crate::backend::BackendShape;
use crate::error::{EngineError, Result};
use crate::lora::Projection;
use crate::model::ModelConfig;

const MIB: u64 = 1 << 20;

/// Bytes each part of the backend needs on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryPlan {
    pub weights: u64,
    pub kv_cache: u64,
    pub adapter_slots: u64,
    /// One step's activations at the most tokens and logit rows a step
    /// may carry.
    pub workspace: u64,
    /// Kept free for the CUDA context, cuBLAS and allocator slack: 512 MiB
    /// plus 5% of the device.
    pub margin: u64,
    /// The device's memory in all.
    pub device_total: u64,
}

impl MemoryPlan {
    /// The plan for `config` with `shape`, weights in `dtype`, at most
    /// `max_tokens` tokens and `max_rows` logit rows per step, on a device
    /// of `total` bytes.
    pub fn new(
        config: &ModelConfig,
        shape: &BackendShape,
        dtype: Dtype,
        max_tokens: usize,
        max_rows: usize,
        total: u64,
    ) -> MemoryPlan {
        let c = config;
        let w = dtype.bytes() as u64;
        let linear: u64 = Projection::ALL
            .iter()
            .map(|p| {
                let (i, o) = p.shape(c);
                (i * o) as u64
            })
            .sum();
        let biases = (if c.qkv_bias {
            c.q_dim() + 2 * c.kv_dim()
        } else {
            0
        } + if c.o_bias { c.hidden_size } else { 0 }
            + if c.mlp_bias {
                2 * c.intermediate_size + c.hidden_size
            } else {
                0
            }) as u64;
        // A Mixture-of-Experts model has its experts and router in place of
        // the one MLP.
        let mlp = (3 * c.hidden_size * c.intermediate_size) as u64;
        let (linear, experts) = match c.moe {
            Some(moe) => (linear - mlp, super::moe::weight_bytes(c, moe, dtype)),
            None => (linear, 0),
        };
        // Two norms a layer, four for Gemma (around the attention and the
        // MLP), and Qwen3's and Gemma 3's per-head q/k norms.
        let norms = if c.gemma.is_some() { 4 } else { 2 } * c.hidden_size
            + if c.qk_norm { 2 * c.head_dim } else { 0 };
        let per_layer = linear * w + (biases + norms as u64) * 4;
        // Embeddings, and the lm_head (a second copy when tied).
        let vocab = (c.vocab_size * c.hidden_size) as u64 * w;
        let weights =
            per_layer * c.num_layers as u64 + experts + 2 * vocab + c.hidden_size as u64 * 4;
        let kv_cache = (0..c.num_layers)
            .map(|l| 2 * (cache_blocks(c, shape, l) * shape.block_size * c.kv_dim()) as u64 * w)
            .sum();
        let rank = shape.max_lora_rank.max(1) as u64;
        // f32 slots, the default; `with_slot_dtype` plans others.
        let adapter_slots = adapter_slot_bytes(c, shape, Dtype::F32);
        let (d, inter, q, kv) = (
            c.hidden_size as u64,
            c.intermediate_size as u64,
            c.q_dim() as u64,
            c.kv_dim() as u64,
        );
        let n = max_tokens as u64;
        let widest = d.max(inter).max(q);
        let splits = super::kernels::KernelShapes::for_model(c, shape.max_lora_rank, dtype)
            .splits(widest as usize) as u64;
        let activations = n * (3 * d + q + 2 * kv + q + 2 * inter + inter) * 4
            + 3 * splits * n * rank * 4
            + n * widest * w;
        let logits = max_rows as u64 * c.vocab_size as u64 * 4;
        let experts_workspace = c.moe.map_or(0, |moe| {
            super::moe::MoeBuffers::bytes(c, moe, dtype, rank as usize, max_tokens)
        });
        MemoryPlan {
            weights,
            kv_cache,
            adapter_slots,
            workspace: activations + logits + experts_workspace,
            margin: 512 * MIB + total / 20,
            device_total: total,
        }
    }

    /// The plan with adapter slots of `slot_dtype` instead of the
    /// weights' type.
    pub fn with_slot_dtype(
        self,
        config: &ModelConfig,
        shape: &BackendShape,
        slot_dtype: Dtype,
    ) -> MemoryPlan {
        MemoryPlan {
            adapter_slots: adapter_slot_bytes(config, shape, slot_dtype),
            ..self
        }
    }

    /// The plan with the linear weights `q` describes held quantized,
    /// and its scratch buffers in the workspace.
    pub fn with_quantized(self, q: &super::quant::QuantPlan) -> MemoryPlan {
        MemoryPlan {
            weights: self.weights - q.replaced + q.quantized,
            workspace: self.workspace + q.scratch,
            ..self
        }
    }

    pub fn needed(&self) -> u64 {
        self.weights + self.kv_cache + self.adapter_slots + self.workspace + self.margin
    }

    /// Refuses a plan that does not fit in `free` bytes, naming each part.
    pub fn check(&self, free: u64) -> Result<()> {
        if self.needed() <= free {
            return Ok(());
        }
        Err(EngineError::Backend(format!(
            "cuda: the configuration needs {} MiB of device memory but {} MiB are free ({}); \
             lower --kv-blocks, --max-loras, --max-lora-rank or --max-batched-tokens, or use a \
             smaller --dtype",
            self.needed() / MIB,
            free / MIB,
            self.summary()
        )))
    }

    /// Each part by its metric label, in bytes.
    pub fn parts(&self) -> [(&'static str, u64); 5] {
        [
            ("weights", self.weights),
            ("kv_cache", self.kv_cache),
            ("adapter_slots", self.adapter_slots),
            ("workspace", self.workspace),
            ("margin", self.margin),
        ]
    }

    /// "weights 2470 MiB, KV cache 1024 MiB, …" for logs and errors.
    pub fn summary(&self) -> String {
        format!(
            "weights {} MiB, KV cache {} MiB, adapter slots {} MiB, workspace {} MiB, margin {} MiB",
            self.weights / MIB,
            self.kv_cache / MIB,
            self.adapter_slots / MIB,
            self.workspace / MIB,
            self.margin / MIB
        )
    }
}

/// The blocks of keys and values layer `layer` holds: the KV blocks, or
/// for a sliding layer of a model with both kinds, every sequence's ring
/// ([`BackendShape::ring_len`]).
pub(super) fn cache_blocks(c: &ModelConfig, shape: &BackendShape, layer: usize) -> usize {
    if shape.ring_len > 0 && c.layer_kinds[layer] == lorafleet_artifact::layers::LayerKind::Sliding
    {
        shape.ring_blocks
    } else {
        shape.kv_blocks
    }
}

/// Bytes of every adapter slot: A and Bᵀ of each (layer, projection) at the
/// slot rank in `dtype`, its f32 DoRA scales and `lora_bias` vector (one
/// value each per output row), and its 4-byte rank, scale and flags.
fn adapter_slot_bytes(c: &ModelConfig, shape: &BackendShape, dtype: Dtype) -> u64 {
    let rank = shape.max_lora_rank.max(1) as u64;
    let (slot_values, vector_values): (u64, u64) = Projection::ALL
        .iter()
        .map(|p| {
            let (i, o) = p.shape(c);
            (rank * (i + o) as u64, 2 * o as u64)
        })
        .fold((0, 0), |(s, v), (ds, dv)| (s + ds, v + dv));
    let slots = shape.slots as u64;
    (slot_values * slots * dtype.bytes() as u64 + vector_values * slots * 4 + 3 * slots * 7 * 4)
        * c.num_layers as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Architecture;

    fn llama_8b() -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Llama,
            vocab_size: 128_256,
            hidden_size: 4096,
            intermediate_size: 14_336,
            num_layers: 32,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            rms_norm_eps: 1e-5,
            rope: lorafleet_artifact::rope::Rope::plain(500_000.0, 128),
            max_position_embeddings: 8192,
            tie_word_embeddings: false,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            sliding_window: None,
            layer_kinds: vec![lorafleet_artifact::layers::LayerKind::Full; 32],
            activation: lorafleet_artifact::layers::Activation::Silu,
            gemma: None,
            qk_norm: false,
            quantization: None,
            moe: None,
            attention_sinks: false,
            bos_token_id: Some(128_000),
            eos_token_ids: vec![128_001],
        }
    }

    const GIB: u64 = 1 << 30;

    #[test]
    fn an_8b_model_in_bf16_plans_its_weights_and_kv_cache() {
        let shape = BackendShape {
            slots: 32,
            max_lora_rank: 16,
            kv_blocks: 4096,
            block_size: 16,
            ring_len: 0,
            ring_blocks: 0,
        };
        let plan = MemoryPlan::new(&llama_8b(), &shape, Dtype::Bf16, 2048, 256, 80 * GIB);
        // 8.03B parameters at 2 bytes; the lm_head is its own matrix.
        let gib = plan.weights as f64 / GIB as f64;
        assert!((14.5..15.5).contains(&gib), "weights {gib} GiB");
        // 2 (K, V) × 32 layers × 65536 positions × 1024 × 2 bytes (bf16).
        assert_eq!(plan.kv_cache, 2 * 32 * 65_536 * 1024 * 2);
        // 32 slots × 32 layers × rank 16 × (sum of in + out over 7
        // projections) × 4 bytes, each slot's two f32 vectors (DoRA's
        // scales, `lora_bias`) of every output row, and its rank, scale
        // and flags of each projection.
        let sum_in_out = (4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14_336) * 3;
        let sum_out: u64 = 4096 + 1024 + 1024 + 4096 + 14_336 * 2 + 4096;
        let vectors = 32 * 2 * sum_out * 4 * 32;
        assert_eq!(
            plan.adapter_slots,
            (32 * 16 * sum_in_out as u64 + 3 * 32 * 7) * 4 * 32 + vectors
        );
        // The vectors are under 7% of rank-16 f32 slots (11 MB a slot).
        assert!(vectors * 100 < plan.adapter_slots * 7);
        // bf16 slots (`--lora-dtype bf16`): the factors at 2 bytes, the
        // vectors, ranks, scales and flags still 4.
        let bf16_slots = plan.with_slot_dtype(&llama_8b(), &shape, Dtype::Bf16);
        assert_eq!(
            bf16_slots.adapter_slots,
            (32 * 16 * sum_in_out as u64 * 2 + 3 * 32 * 7 * 4) * 32 + vectors
        );
        assert_eq!(bf16_slots.weights, plan.weights);
        assert!(plan.check(80 * GIB).is_ok(), "{}", plan.summary());
        // In f32 the weights alone double; on a 24 GiB device it cannot fit.
        let f32_plan = MemoryPlan::new(&llama_8b(), &shape, Dtype::F32, 2048, 256, 24 * GIB);
        let err = f32_plan.check(24 * GIB).unwrap_err().to_string();
        assert!(err.contains("needs"), "{err}");
        assert!(err.contains("MiB are free"), "{err}");
        assert!(err.contains("KV cache 16384 MiB"), "{err}");
        assert!(err.contains("weights 30"), "{err}");
        assert!(err.contains("--kv-blocks"), "{err}");
    }

    #[test]
    fn a_mixture_of_experts_model_plans_every_expert_and_its_router() {
        // Qwen3-30B-A3B's shape: 48 layers of 128 experts of width 768.
        let c = ModelConfig {
            architecture: Architecture::Qwen3Moe,
            vocab_size: 151_936,
            hidden_size: 2048,
            intermediate_size: 768,
            num_layers: 48,
            num_heads: 32,
            num_kv_heads: 4,
            head_dim: 128,
            qk_norm: true,
            moe: Some(crate::model::config::MoeConfig {
                num_experts: 128,
                top_k: 8,
                norm_topk_prob: true,
                gpt_oss: None,
            }),
            ..llama_8b()
        };
        let shape = BackendShape {
            slots: 8,
            max_lora_rank: 16,
            kv_blocks: 1024,
            block_size: 16,
            ring_len: 0,
            ring_blocks: 0,
        };
        let plan = MemoryPlan::new(&c, &shape, Dtype::Bf16, 512, 64, 141 * GIB);
        // 30.5B parameters at 2 bytes (29.0B of them in experts), the
        // routers in f32.
        let gib = plan.weights as f64 / GIB as f64;
        assert!((56.0..58.0).contains(&gib), "weights {gib} GiB");
        let dense = MemoryPlan::new(
            &ModelConfig {
                moe: None,
                ..c.clone()
            },
            &shape,
            Dtype::Bf16,
            512,
            64,
            141 * GIB,
        );
        assert!(
            plan.weights > 50 * dense.weights / 10,
            "{} vs {}",
            plan.weights,
            dense.weights
        );
        // The expert rows of a step: 512 tokens × top 8.
        assert!(plan.workspace > dense.workspace + (512 * 8 * 2048 * 4) as u64);
        assert!(plan.check(141 * GIB).is_ok(), "{}", plan.summary());
    }

    #[test]
    fn every_part_grows_with_its_own_setting() {
        let base = BackendShape {
            slots: 4,
            max_lora_rank: 16,
            kv_blocks: 256,
            block_size: 16,
            ring_len: 0,
            ring_blocks: 0,
        };
        let c = llama_8b();
        let plan = |shape: BackendShape, tokens: usize| {
            MemoryPlan::new(&c, &shape, Dtype::Bf16, tokens, 64, 80 * GIB)
        };
        let p0 = plan(base, 512);
        let more_kv = plan(
            BackendShape {
                kv_blocks: 512,
                ..base
            },
            512,
        );
        assert_eq!(more_kv.kv_cache, 2 * p0.kv_cache);
        assert_eq!(more_kv.weights, p0.weights);
        let more_slots = plan(BackendShape { slots: 8, ..base }, 512);
        assert!(more_slots.adapter_slots > p0.adapter_slots);
        assert_eq!(more_slots.kv_cache, p0.kv_cache);
        let more_tokens = plan(base, 1024);
        assert!(more_tokens.workspace > p0.workspace);
        assert_eq!(more_tokens.adapter_slots, p0.adapter_slots);
    }

    #[test]
    fn a_model_with_both_kinds_of_layers_plans_rings_for_its_sliding_layers() {
        use lorafleet_artifact::layers::LayerKind;
        // Gemma 3's pattern: five sliding layers to one global, 30 layers.
        let kinds: Vec<LayerKind> = (0..30)
            .map(|l| {
                if l % 6 == 5 {
                    LayerKind::Full
                } else {
                    LayerKind::Sliding
                }
            })
            .collect();
        let c = ModelConfig {
            num_layers: 30,
            sliding_window: Some(512),
            layer_kinds: kinds,
            ..llama_8b()
        };
        assert!(c.mixed_layers());
        let shape = BackendShape {
            slots: 4,
            max_lora_rank: 16,
            kv_blocks: 4096,
            block_size: 16,
            ring_len: 66,
            ring_blocks: 66 * 64,
        };
        let plan = MemoryPlan::new(&c, &shape, Dtype::Bf16, 512, 64, 80 * GIB);
        let row = 16 * 1024 * 2;
        assert_eq!(plan.kv_cache, 2 * (5 * 4096 + 25 * 66 * 64) * row);
        assert_eq!(cache_blocks(&c, &shape, 0), 66 * 64);
        assert_eq!(cache_blocks(&c, &shape, 5), 4096);
        // Without rings every layer holds the blocks.
        let flat = MemoryPlan::new(
            &c,
            &BackendShape {
                ring_len: 0,
                ring_blocks: 0,
                ..shape
            },
            Dtype::Bf16,
            512,
            64,
            80 * GIB,
        );
        assert_eq!(flat.kv_cache, 2 * 30 * 4096 * row);
    }

    /// GPT-OSS-20B from its released `config.json` (the fixture's, its
    /// sizes set back to the release's): the plan's weights with MXFP4
    /// experts within 10% of the checkpoint's bytes, counted tensor by
    /// tensor as the release stores them (bf16 attention, router,
    /// embeddings, lm_head, norms and biases; the experts' blocks at half a
    /// byte a weight and a scale byte per 32).
    #[test]
    fn gpt_oss_20b_with_mxfp4_experts_plans_about_its_checkpoints_bytes() {
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/gpt-oss-mxfp4/config.json");
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
        let (v, h, i, layers, heads, kv_heads, hd, e) = (201_088u64, 2880, 2880, 24, 64, 8, 64, 32);
        for (key, value) in [
            ("vocab_size", v),
            ("hidden_size", h),
            ("intermediate_size", i),
            ("num_hidden_layers", layers),
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv_heads),
            ("head_dim", hd),
            ("num_local_experts", e),
            ("sliding_window", 128),
            ("initial_context_length", 4096),
            ("max_position_embeddings", 131_072),
        ] {
            json[key] = value.into();
        }
        json["rope_scaling"]["original_max_position_embeddings"] = 4096.into();
        json["layer_types"] = (0..layers)
            .map(|l| {
                if l % 2 == 0 {
                    "sliding_attention"
                } else {
                    "full_attention"
                }
            })
            .collect::<Vec<_>>()
            .into();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), json.to_string()).unwrap();
        let c = ModelConfig::from_dir(dir.path()).unwrap();
        assert!(super::super::moe::mxfp4(&c));
        let shape = BackendShape {
            slots: 8,
            max_lora_rank: 16,
            kv_blocks: 1024,
            block_size: 16,
            ring_len: 0,
            ring_blocks: 0,
        };
        let plan = MemoryPlan::new(&c, &shape, Dtype::Bf16, 512, 64, 141 * GIB);
        // The checkpoint, tensor by tensor, in bytes.
        let (q, kv) = (heads * hd, kv_heads * hd);
        let attention = 2 * (h * q + q + 2 * (h * kv + kv) + q * h + h + heads);
        let router = 2 * (e * h + e);
        let blocks = |rows: u64, fan_in: u64| rows * fan_in / 2 + rows * fan_in / 32;
        let experts = e * (blocks(2 * i, h) + blocks(h, i)) + 2 * e * (2 * i + h);
        let norms = 2 * 2 * h;
        let checkpoint = 2 * v * h * 2 + layers * (attention + router + experts + norms) + 2 * h;
        // 12.8 GiB, as released.
        assert!(
            (12.7..12.9).contains(&(checkpoint as f64 / GIB as f64)),
            "{checkpoint}"
        );
        let ratio = plan.weights as f64 / checkpoint as f64;
        assert!(
            (0.9..=1.1).contains(&ratio),
            "planned {} against the checkpoint's {checkpoint} bytes: {ratio:.3}",
            plan.weights
        );
        // The same model with bf16 experts plans over three times as much
        // for them.
        let bf16 = MemoryPlan::new(
            &ModelConfig {
                quantization: None,
                ..c.clone()
            },
            &shape,
            Dtype::Bf16,
            512,
            64,
            141 * GIB,
        );
        assert!(
            bf16.weights > 2 * plan.weights,
            "{} vs {}",
            bf16.weights,
            plan.weights
        );
    }
}
