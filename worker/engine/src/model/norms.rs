//! A decoder layer's RMSNorm weights as a checkpoint names them, read once
//! for every backend: Llama's two, Gemma's four (around the attention and
//! the MLP) with its `(1 + w)` applied at load, and Qwen3's and Gemma 3's
//! per-head q/k norms.

use super::{ModelConfig, WeightFiles};
use crate::error::Result;

/// One layer's norms, each scaling as the forward pass multiplies.
#[derive(Debug)]
pub struct LayerNorms {
    pub input: Vec<f32>,
    /// Before the MLP: Llama's `post_attention_layernorm`, Gemma's
    /// `pre_feedforward_layernorm`.
    pub post: Vec<f32>,
    /// Gemma's norms of the attention's and the MLP's outputs.
    pub attn_out: Option<Vec<f32>>,
    pub mlp_out: Option<Vec<f32>>,
    /// Per-head norms of q and k, applied before RoPE.
    pub qk: Option<(Vec<f32>, Vec<f32>)>,
}

/// `name`'s weight of `width`, with Gemma's one added.
fn norm(files: &WeightFiles, c: &ModelConfig, name: &str, width: usize) -> Result<Vec<f32>> {
    let mut w = files.f32(&format!("{name}.weight"), &[width])?;
    if c.gemma.is_some() {
        w.iter_mut().for_each(|w| *w += 1.0);
    }
    Ok(w)
}

impl LayerNorms {
    pub fn load(files: &WeightFiles, c: &ModelConfig, layer: usize) -> Result<LayerNorms> {
        let at = |name: &str, width: usize| {
            norm(files, c, &format!("model.layers.{layer}.{name}"), width)
        };
        let h = c.hidden_size;
        let (post, attn_out, mlp_out) = match c.gemma {
            Some(_) => (
                at("pre_feedforward_layernorm", h)?,
                Some(at("post_attention_layernorm", h)?),
                Some(at("post_feedforward_layernorm", h)?),
            ),
            None => (at("post_attention_layernorm", h)?, None, None),
        };
        Ok(LayerNorms {
            input: at("input_layernorm", h)?,
            post,
            attn_out,
            mlp_out,
            qk: if c.qk_norm {
                Some((
                    at("self_attn.q_norm", c.head_dim)?,
                    at("self_attn.k_norm", c.head_dim)?,
                ))
            } else {
                None
            },
        })
    }
}

/// The final norm, before the lm_head.
pub fn final_norm(files: &WeightFiles, c: &ModelConfig) -> Result<Vec<f32>> {
    norm(files, c, "model.norm", c.hidden_size)
}
