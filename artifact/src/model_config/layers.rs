//! How a family's decoder layers depart from Llama's: which layers attend
//! through a sliding window, the MLP's activation, and Gemma's norms,
//! scales and soft-capping, read from `config.json` with every field
//! understood or refused by name.

use super::{Architecture, Fields};
use crate::error::Result;
use crate::rope::{Rope, RopeSource};

/// What a layer's attention may see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Every earlier position.
    Full,
    /// The last `sliding_window` positions, itself included.
    Sliding,
}

impl LayerKind {
    /// The name transformers' `layer_types` gives it.
    pub fn name(self) -> &'static str {
        match self {
            LayerKind::Full => "full_attention",
            LayerKind::Sliding => "sliding_attention",
        }
    }
}

/// The MLP's activation on the gate: `act(gate) · up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu` (SwiGLU).
    Silu,
    /// `gelu_pytorch_tanh` (GeGLU, tanh approximation).
    GeluTanh,
}

/// Gemma 2 and 3's departures from the Llama layer.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma {
    /// Token embeddings are multiplied by √hidden_size.
    pub embed_scale: f32,
    /// Attention scores are scaled by `query_pre_attn_scalar^-½`.
    pub query_pre_attn_scalar: f64,
    /// `tanh(s / cap) · cap` on attention scores (Gemma 2).
    pub attn_logit_softcapping: Option<f32>,
    /// `tanh(l / cap) · cap` on the final logits (Gemma 2).
    pub final_logit_softcapping: Option<f32>,
    /// The rotary embedding of the sliding layers (Gemma 3's
    /// `rope_local_base_freq`); None where they share the global one.
    pub local_rope: Option<Rope>,
}

/// The layer fields of a Gemma 2 or Gemma 3 config: (layer kinds, window,
/// global rope, Gemma's parts).
pub(crate) fn parse_gemma(
    f: &Fields<'_>,
    architecture: Architecture,
    num_layers: usize,
    head_dim: usize,
) -> Result<(Vec<LayerKind>, usize, Rope, Gemma)> {
    // Gemma writes `hidden_activation` (and Gemma 2 `hidden_act` too).
    for field in ["hidden_activation", "hidden_act"] {
        if let Some(act) = f.str(field)?
            && act != "gelu_pytorch_tanh"
        {
            return Err(f.err(
                field,
                format!("{act:?} is not supported; expected \"gelu_pytorch_tanh\""),
            ));
        }
    }
    if f.bool("use_bidirectional_attention")?.unwrap_or(false) {
        return Err(f.err(
            "use_bidirectional_attention",
            "bidirectional attention is not supported (a decoder attends causally)",
        ));
    }
    let window = match f.usize("sliding_window")? {
        Some(w) if w > 0 => w,
        Some(_) => return Err(f.err("sliding_window", "must be positive")),
        None => return Err(f.err("sliding_window", "is required for its sliding layers")),
    };
    // transformers 4 configs give a pattern: every `pattern`th layer is
    // global (Gemma 2 alternates).
    let kinds = match layer_types(f, num_layers)? {
        Some(kinds) => kinds,
        None => {
            let pattern = match architecture {
                Architecture::Gemma2 => 2,
                _ => match f.usize("sliding_window_pattern")? {
                    Some(p) if p > 0 => p,
                    Some(_) => return Err(f.err("sliding_window_pattern", "must be positive")),
                    None => 6,
                },
            };
            (0..num_layers)
                .map(|i| {
                    if (i + 1) % pattern != 0 {
                        LayerKind::Sliding
                    } else {
                        LayerKind::Full
                    }
                })
                .collect()
        }
    };
    let softcap = |field: &str| -> Result<Option<f32>> {
        match f.f64(field)? {
            None => Ok(None),
            Some(c) if c > 0.0 => Ok(Some(c as f32)),
            Some(c) => Err(f.err(field, format!("{c} must be positive"))),
        }
    };
    let query_pre_attn_scalar = match f.f64("query_pre_attn_scalar")? {
        Some(q) if q > 0.0 => q,
        Some(q) => return Err(f.err("query_pre_attn_scalar", format!("{q} must be positive"))),
        None => 256.0,
    };
    let (rope, local_rope) = match architecture {
        Architecture::Gemma3 => {
            let global = RopeSource {
                theta_field: "rope_theta",
                default_theta: 1_000_000.0,
                scaling_fields: &["rope_scaling"],
                layer_kind: Some("full_attention"),
            };
            let local = RopeSource {
                theta_field: "rope_local_base_freq",
                default_theta: 10_000.0,
                scaling_fields: &[],
                layer_kind: Some("sliding_attention"),
            };
            (
                Rope::parse_from(f, head_dim, &global)?,
                Some(Rope::parse_from(f, head_dim, &local)?),
            )
        }
        _ => (Rope::parse(f, head_dim)?, None),
    };
    let hidden = f.positive("hidden_size")?;
    Ok((
        kinds,
        window,
        rope,
        Gemma {
            // √hidden in f64, then f32, as transformers builds the buffer.
            embed_scale: (hidden as f64).sqrt() as f32,
            query_pre_attn_scalar,
            attn_logit_softcapping: softcap("attn_logit_softcapping")?,
            final_logit_softcapping: softcap("final_logit_softcapping")?,
            local_rope,
        },
    ))
}

/// transformers 5's `layer_types`, checked: one known kind per layer.
pub(crate) fn layer_types(f: &Fields<'_>, num_layers: usize) -> Result<Option<Vec<LayerKind>>> {
    let Some(types) = f.get("layer_types") else {
        return Ok(None);
    };
    let types = types
        .as_array()
        .ok_or_else(|| f.err("layer_types", format!("must be a list, got {types}")))?;
    if types.len() != num_layers {
        return Err(f.err(
            "layer_types",
            format!(
                "has {} entries for num_hidden_layers {num_layers}",
                types.len()
            ),
        ));
    }
    types
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            Some("full_attention") => Ok(LayerKind::Full),
            Some("sliding_attention") => Ok(LayerKind::Sliding),
            _ => Err(f.err(
                &format!("layer_types[{i}]"),
                format!("{t} is not \"full_attention\" or \"sliding_attention\""),
            )),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}
