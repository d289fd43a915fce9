//! `config.json` and `generation_config.json` of a Hugging Face model
//! directory, read into one validated [`ModelConfig`].
//!
//! Every field that changes the math is either understood or refused by
//! name; nothing is silently ignored.

mod gpt_oss;
pub mod layers;

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{FileError, Result};
pub use crate::json::{Fields, read_json_object};
use layers::LayerKind;

/// The decoder families the engine runs. They share one forward pass and
/// differ only in the switches of [`ModelConfig`]; Mixtral, Qwen3-MoE and
/// GPT-OSS replace the MLP with a Mixture-of-Experts block ([`MoeConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Phi3,
    Gemma2,
    Gemma3,
    Mixtral,
    Qwen3Moe,
    GptOss,
}

impl Architecture {
    /// The Hugging Face `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Phi3 => "phi3",
            Architecture::Gemma2 => "gemma2",
            Architecture::Gemma3 => "gemma3_text",
            Architecture::Mixtral => "mixtral",
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::GptOss => "gpt_oss",
        }
    }

    /// Whether its MLP is a Mixture of Experts.
    pub fn is_moe(self) -> bool {
        match self {
            Architecture::Llama
            | Architecture::Mistral
            | Architecture::Qwen2
            | Architecture::Qwen3
            | Architecture::Phi3
            | Architecture::Gemma2
            | Architecture::Gemma3 => false,
            Architecture::Mixtral | Architecture::Qwen3Moe | Architecture::GptOss => true,
        }
    }

    /// Every architecture, for the lists that name them all.
    pub const ALL: [Architecture; 10] = [
        Architecture::Llama,
        Architecture::Mistral,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Phi3,
        Architecture::Gemma2,
        Architecture::Gemma3,
        Architecture::Mixtral,
        Architecture::Qwen3Moe,
        Architecture::GptOss,
    ];

    /// Whether its checkpoints hold q, k and v as one `qkv_proj` and gate
    /// and up as one `gate_up_proj` (Phi-3), rows stacked in that order.
    pub fn fused_projections(self) -> bool {
        self == Architecture::Phi3
    }

    /// The architecture a `model_type` names. A multimodal Gemma 3
    /// checkpoint (`gemma3`) is served as its language model.
    pub fn from_model_type(model_type: &str) -> Option<Architecture> {
        if model_type == "gemma3" {
            return Some(Architecture::Gemma3);
        }
        Architecture::ALL
            .into_iter()
            .find(|a| a.model_type() == model_type)
    }
}

/// A Mixture-of-Experts block in place of every layer's MLP: a router picks
/// `top_k` of `num_experts` SwiGLU experts per token and sums their outputs
/// weighted by the router's softmax.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// Experts each token goes to (`num_experts_per_tok`).
    pub top_k: usize,
    /// Renormalize the chosen experts' probabilities to sum to one
    /// (Mixtral always; Qwen3-MoE with `norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// GPT-OSS's block; None for Mixtral's and Qwen3-MoE's.
    pub gpt_oss: Option<GptOssExperts>,
}

/// GPT-OSS's Mixture-of-Experts block, as transformers' `GptOssMLP`: the
/// router (`mlp.router`) has a bias and weighs the top `top_k` logits by
/// their own softmax; every expert's gate and up are one `[hidden, 2 ·
/// inter]` parameter, gate and up interleaved (`mlp.experts.gate_up_proj`,
/// with `gate_up_proj_bias`), and down one `[inter, hidden]` with a bias;
/// the activation is `(clamp(up, ±limit) + 1) · g · σ(alpha · g)` with `g =
/// min(gate, limit)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptOssExperts {
    pub swiglu_limit: f32,
    pub swiglu_alpha: f32,
}

/// A validated model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The width of the MLP's gate and up projections: of the one MLP of a
    /// dense model, of each expert of a Mixture-of-Experts model.
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    /// The rotary embedding: its base, rotary dimensions and scaling.
    pub rope: crate::rope::Rope,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Biases on q, k and v (Qwen2 always; Llama with `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on o (Llama with `attention_bias`).
    pub o_bias: bool,
    /// Biases on gate, up and down (Llama with `mlp_bias`).
    pub mlp_bias: bool,
    /// The window of the sliding layers: the most recent positions they
    /// attend to (Mistral: every layer; Gemma: those `layer_kinds` says).
    pub sliding_window: Option<usize>,
    /// Each layer's attention span.
    pub layer_kinds: Vec<layers::LayerKind>,
    /// The MLP's activation on the gate.
    pub activation: layers::Activation,
    /// Gemma 2 and 3's norms, scales and soft-capping; None for the
    /// Llama layer.
    pub gemma: Option<layers::Gemma>,
    /// RMSNorm over each head of q and k before the rotary embedding
    /// (Qwen3).
    pub qk_norm: bool,
    /// Mixture-of-Experts MLPs; None for a dense model.
    pub moe: Option<MoeConfig>,
    /// A learned logit per query head that joins every softmax of the
    /// attention and is never attended to (GPT-OSS's `self_attn.sinks`).
    pub attention_sinks: bool,
    /// How the linear weights are stored quantized; None for a dense
    /// checkpoint (f32, f16 or bf16).
    pub quantization: Option<crate::quantization::Quantization>,
    pub bos_token_id: Option<u32>,
    /// Every token that ends a sequence, from config.json and
    /// generation_config.json together.
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Reads `config.json` and, if present, `generation_config.json` from a
    /// model directory.
    pub fn from_dir(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let root = read_json_object(&path)?;
        let mut config = match gemma3_language_model(&path, &root)? {
            // A field the checkpoint gives in its text_config is named so.
            Some(text) => parse_config(&path, &text).map_err(|e| match e {
                FileError::InvalidModel {
                    file,
                    field,
                    reason,
                } => {
                    let given = root
                        .get("text_config")
                        .and_then(Value::as_object)
                        .is_some_and(|t| {
                            t.contains_key(field.split(['.', '[']).next().unwrap_or(""))
                        });
                    FileError::InvalidModel {
                        file,
                        field: if given {
                            format!("text_config.{field}")
                        } else {
                            field
                        },
                        reason,
                    }
                }
                other => other,
            })?,
            None => parse_config(&path, &root)?,
        };
        // A quantization the weights cannot be read in is refused with the
        // configuration, by its field.
        config.quantization = crate::quantization::parse(&path, &root)?;
        let gen_path = dir.join("generation_config.json");
        if gen_path.exists() {
            let generation = read_json_object(&gen_path)?;
            let f = Fields {
                file: &gen_path,
                map: &generation,
            };
            if let Some(bos) = f
                .token_ids("bos_token_id")?
                .and_then(|v| v.first().copied())
            {
                config.bos_token_id = Some(bos);
            }
            for id in f.token_ids("eos_token_id")?.unwrap_or_default() {
                if !config.eos_token_ids.contains(&id) {
                    config.eos_token_ids.push(id);
                }
            }
        }
        for (field, id) in config
            .bos_token_id
            .iter()
            .map(|id| ("bos_token_id", id))
            .chain(config.eos_token_ids.iter().map(|id| ("eos_token_id", id)))
        {
            if *id as usize >= config.vocab_size {
                return Err(FileError::model(
                    &path,
                    field,
                    format!(
                        "token id {id} is not below vocab_size {}",
                        config.vocab_size
                    ),
                ));
            }
        }
        Ok(config)
    }

    /// The window a layer attends through, if it slides.
    pub fn window(&self, layer: usize) -> Option<usize> {
        match self.layer_kinds.get(layer) {
            Some(layers::LayerKind::Sliding) => self.sliding_window,
            _ => None,
        }
    }

    /// Whether the layers are of both kinds (Gemma 2 and 3): the sliding
    /// ones then keep only their window of keys and values.
    pub fn mixed_layers(&self) -> bool {
        self.sliding_window.is_some()
            && self.layer_kinds.contains(&LayerKind::Full)
            && self.layer_kinds.contains(&LayerKind::Sliding)
    }

    /// The window every layer slides by (Mistral v0.1, Phi-3 with
    /// `sliding_window`): no position behind it is read again, so a
    /// sequence's blocks behind it can go.
    pub fn uniform_window(&self) -> Option<usize> {
        let all = !self.layer_kinds.is_empty()
            && self.layer_kinds.iter().all(|k| *k == LayerKind::Sliding);
        self.sliding_window.filter(|_| all)
    }

    /// The layers whose keys and values a sequence's block table holds:
    /// every layer, or the global ones of a model with both kinds.
    pub fn table_layers(&self) -> usize {
        if self.mixed_layers() {
            self.layer_kinds
                .iter()
                .filter(|k| **k == LayerKind::Full)
                .count()
        } else {
            self.num_layers
        }
    }

    /// The rotary embedding of a layer: Gemma 3's sliding layers have
    /// their own.
    pub fn rope_of(&self, layer: usize) -> &crate::rope::Rope {
        match (&self.gemma, self.layer_kinds.get(layer)) {
            (Some(g), Some(layers::LayerKind::Sliding)) => {
                g.local_rope.as_ref().unwrap_or(&self.rope)
            }
            _ => &self.rope,
        }
    }

    /// What attention scores are multiplied by: `head_dim^-½`, or Gemma's
    /// `query_pre_attn_scalar^-½`.
    pub fn attention_scale(&self) -> f32 {
        match &self.gemma {
            Some(g) => g.query_pre_attn_scalar.powf(-0.5) as f32,
            None => 1.0 / (self.head_dim as f32).sqrt(),
        }
    }

    /// Query heads per KV head (grouped-query attention).
    pub fn gqa_group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Width of the q projection's output.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of the k and v projections' outputs.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// A multimodal Gemma 3 checkpoint's (`gemma3`) language model as a
/// `gemma3_text` config: its `text_config`, which lists only what differs
/// from transformers' `Gemma3TextConfig`, over those defaults, with the
/// top level's token ids where it has none. None for any other model.
fn gemma3_language_model(
    path: &Path,
    root: &Map<String, Value>,
) -> Result<Option<Map<String, Value>>> {
    if root.get("model_type").and_then(Value::as_str) != Some("gemma3") {
        return Ok(None);
    }
    let text = match root.get("text_config") {
        Some(Value::Object(t)) => t,
        Some(_) => return Err(FileError::model(path, "text_config", "must be an object")),
        None => {
            return Err(FileError::model(
                path,
                "text_config",
                "is required: a gemma3 checkpoint's language model is configured there",
            ));
        }
    };
    let mut merged: Map<String, Value> = serde_json::json!({
        "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "bos_token_id": 2, "eos_token_id": 1
    })
    .as_object()
    .cloned()
    .unwrap_or_default();
    for key in ["bos_token_id", "eos_token_id", "tie_word_embeddings"] {
        if let Some(v) = root.get(key).filter(|v| !v.is_null()) {
            merged.insert(key.to_owned(), v.clone());
        }
    }
    for (k, v) in text {
        merged.insert(k.clone(), v.clone());
    }
    merged.insert("model_type".into(), "gemma3_text".into());
    Ok(Some(merged))
}

fn parse_config(path: &Path, map: &Map<String, Value>) -> Result<ModelConfig> {
    let f = Fields { file: path, map };
    let model_type = f
        .str("model_type")?
        .ok_or_else(|| f.err("model_type", "is required"))?;
    let architecture = Architecture::from_model_type(model_type).ok_or_else(|| {
        let known: Vec<&str> = Architecture::ALL.iter().map(|a| a.model_type()).collect();
        f.err(
            "model_type",
            format!(
                "{model_type:?} is not supported; expected one of {}",
                known.join(", ")
            ),
        )
    })?;
    let hidden_size = f.positive("hidden_size")?;
    let num_heads = f.positive("num_attention_heads")?;
    let num_kv_heads = f.usize("num_key_value_heads")?.unwrap_or(num_heads);
    if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        return Err(f.err(
            "num_key_value_heads",
            format!("{num_kv_heads} must be positive and divide num_attention_heads {num_heads}"),
        ));
    }
    let head_dim = match f.usize("head_dim")? {
        Some(d) if d > 0 => d,
        Some(_) => return Err(f.err("head_dim", "must be positive")),
        None if hidden_size % num_heads == 0 => hidden_size / num_heads,
        None => {
            return Err(f.err(
                "hidden_size",
                format!("{hidden_size} is not divisible by num_attention_heads {num_heads} and no head_dim is given"),
            ));
        }
    };
    if head_dim % 2 != 0 {
        return Err(f.err(
            "head_dim",
            format!("{head_dim} must be even for rotary embeddings"),
        ));
    }
    let num_layers = f.positive("num_hidden_layers")?;
    let gemma_parts = match architecture {
        Architecture::Gemma2 | Architecture::Gemma3 => {
            Some(layers::parse_gemma(&f, architecture, num_layers, head_dim)?)
        }
        _ => {
            if let Some(act) = f.str("hidden_act")?
                && act != "silu"
            {
                return Err(f.err(
                    "hidden_act",
                    format!("{act:?} is not supported; expected \"silu\""),
                ));
            }
            None
        }
    };
    let gpt_oss_parts = match architecture {
        Architecture::GptOss => Some(gpt_oss::parse_layers(&f, num_layers, head_dim)?),
        _ => None,
    };
    if f.usize("pretraining_tp")?.is_some_and(|tp| tp != 1) {
        return Err(f.err("pretraining_tp", "only 1 is supported"));
    }
    let attention_bias = f
        .bool("attention_bias")?
        .unwrap_or(architecture == Architecture::GptOss);
    let (qkv_bias, o_bias, mlp_bias) = match architecture {
        Architecture::Qwen2 => (true, false, false),
        Architecture::Llama => (
            attention_bias,
            attention_bias,
            f.bool("mlp_bias")?.unwrap_or(false),
        ),
        Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::GptOss => {
            (attention_bias, attention_bias, false)
        }
        Architecture::Gemma2 | Architecture::Gemma3 => (attention_bias, attention_bias, false),
        Architecture::Mistral | Architecture::Mixtral | Architecture::Phi3 => (false, false, false),
    };
    let sliding_window = match architecture {
        Architecture::Mistral | Architecture::Mixtral | Architecture::Phi3 => {
            f.usize("sliding_window")?
        }
        Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => {
            if f.bool("use_sliding_window")?.unwrap_or(false) {
                return Err(f.err(
                    "use_sliding_window",
                    "Qwen sliding-window attention is not supported",
                ));
            }
            None
        }
        Architecture::Llama => None,
        Architecture::Gemma2 | Architecture::Gemma3 => gemma_parts.as_ref().map(|g| g.1),
        Architecture::GptOss => gpt_oss_parts.as_ref().map(|p| p.1),
    };
    if sliding_window == Some(0) {
        return Err(f.err("sliding_window", "must be positive"));
    }
    // transformers 5 lists each layer's attention; outside Gemma one
    // window serves every layer, the uniform `sliding_window` above.
    let uniform = if sliding_window.is_some() {
        LayerKind::Sliding
    } else {
        LayerKind::Full
    };
    let (layer_kinds, rope, gemma) = match (gemma_parts, gpt_oss_parts) {
        (Some((kinds, _, rope, gemma)), _) => (kinds, rope, Some(gemma)),
        (None, Some((kinds, _, rope))) => (kinds, rope, None),
        (None, None) => {
            if let Some(kinds) = layers::layer_types(&f, num_layers)?
                && let Some(i) = kinds.iter().position(|k| *k != uniform)
            {
                return Err(f.err(
                    &format!("layer_types[{i}]"),
                    format!(
                        "is {:?}; this model's layers are all {:?} (layers of different kinds are not supported)",
                        kinds[i].name(),
                        uniform.name()
                    ),
                ));
            }
            (
                vec![uniform; num_layers],
                crate::rope::Rope::parse(&f, head_dim)?,
                None,
            )
        }
    };
    let eps = f.f64("rms_norm_eps")?.unwrap_or(1e-6);
    if eps <= 0.0 {
        return Err(f.err("rms_norm_eps", "must be positive"));
    }
    // Gemma ties its embeddings unless told otherwise.
    let tie_default = gemma.is_some();
    let moe = parse_moe(&f, architecture)?;
    let intermediate_size = match architecture {
        Architecture::Qwen3Moe => f.positive("moe_intermediate_size")?,
        _ => f.positive("intermediate_size")?,
    };
    Ok(ModelConfig {
        architecture,
        vocab_size: f.positive("vocab_size")?,
        hidden_size,
        intermediate_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        rms_norm_eps: eps as f32,
        rope,
        max_position_embeddings: f.usize("max_position_embeddings")?.unwrap_or(2048).max(1),
        tie_word_embeddings: f.bool("tie_word_embeddings")?.unwrap_or(tie_default),
        qkv_bias,
        o_bias,
        mlp_bias,
        sliding_window,
        layer_kinds,
        activation: if gemma.is_some() {
            layers::Activation::GeluTanh
        } else {
            layers::Activation::Silu
        },
        gemma,
        qk_norm: matches!(
            architecture,
            Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Gemma3
        ),
        moe,
        attention_sinks: architecture == Architecture::GptOss,
        quantization: None,
        bos_token_id: f
            .token_ids("bos_token_id")?
            .and_then(|v| v.first().copied()),
        eos_token_ids: f.token_ids("eos_token_id")?.unwrap_or_default(),
    })
}

/// The Mixture-of-Experts fields; anything that would change the routing
/// and is not supported is refused by name.
fn parse_moe(f: &Fields<'_>, architecture: Architecture) -> Result<Option<MoeConfig>> {
    let norm_topk_prob = match architecture {
        // GPT-OSS's softmax over the chosen logits: renormalized.
        Architecture::Mixtral | Architecture::GptOss => true,
        Architecture::Qwen3Moe => f.bool("norm_topk_prob")?.unwrap_or(false),
        _ => return Ok(None),
    };
    // Qwen3-MoE has written both names.
    let experts_field = if f.get("num_experts").is_some() {
        "num_experts"
    } else {
        "num_local_experts"
    };
    let num_experts = f.positive(experts_field)?;
    let top_k = match architecture {
        // transformers' GptOssConfig routes to 4 unless told otherwise.
        Architecture::GptOss if f.get("num_experts_per_tok").is_none() => 4,
        _ => f.positive("num_experts_per_tok")?,
    };
    if top_k > num_experts {
        return Err(f.err(
            "num_experts_per_tok",
            format!("{top_k} is more than the {num_experts} experts"),
        ));
    }
    if architecture == Architecture::Qwen3Moe {
        // Every layer sparse: the layout the engine runs.
        if f.usize("decoder_sparse_step")?.is_some_and(|s| s != 1) {
            return Err(f.err(
                "decoder_sparse_step",
                "only 1 (every layer a Mixture-of-Experts layer) is supported",
            ));
        }
        if let Some(layers) = f.get("mlp_only_layers")
            && layers.as_array().is_none_or(|a| !a.is_empty())
        {
            return Err(f.err(
                "mlp_only_layers",
                format!("{layers} is not supported; only [] (no dense layers)"),
            ));
        }
        if f.usize("shared_expert_intermediate_size")?
            .is_some_and(|s| s > 0)
        {
            return Err(f.err(
                "shared_expert_intermediate_size",
                "shared experts are not supported",
            ));
        }
    }
    let gpt_oss = match architecture {
        Architecture::GptOss => Some(gpt_oss::parse_experts(f, top_k)?),
        _ => None,
    };
    Ok(Some(MoeConfig {
        num_experts,
        top_k,
        norm_topk_prob,
        gpt_oss,
    }))
}

#[cfg(test)]
mod tests;
