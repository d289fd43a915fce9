//! GPT-OSS's `config.json` (`model_type: "gpt_oss"`), read as transformers'
//! `GptOssConfig` reads it, its defaults included: sliding and full layers
//! alternating from `layer_types` (the first slides), a window of
//! `sliding_window` (128), YaRN RoPE (factor 32 over 4,096 positions, base
//! 150,000) unless the config gives its own, biases on q/k/v/o
//! (`attention_bias`, true), and the Mixture-of-Experts block's clamped
//! SwiGLU (`swiglu_limit` 7, `swiglu_alpha` 1.702).

use serde_json::{Map, Value, json};

use super::layers::{LayerKind, layer_types};
use super::{Fields, GptOssExperts};
use crate::error::Result;
use crate::rope::{Rope, RopeSource};

/// The layer kinds, the window and the rotary embedding.
pub(super) fn parse_layers(
    f: &Fields<'_>,
    num_layers: usize,
    head_dim: usize,
) -> Result<(Vec<LayerKind>, usize, Rope)> {
    let window = match f.get("sliding_window") {
        None | Some(Value::Null) => 128,
        Some(_) => match f.usize("sliding_window")? {
            Some(w) if w > 0 => w,
            _ => return Err(f.err("sliding_window", "must be a positive integer")),
        },
    };
    let kinds = match layer_types(f, num_layers)? {
        Some(kinds) => kinds,
        None => (0..num_layers)
            .map(|i| {
                if i % 2 == 0 {
                    LayerKind::Sliding
                } else {
                    LayerKind::Full
                }
            })
            .collect(),
    };
    // transformers' default scaling where the config gives none.
    let given = ["rope_scaling", "rope_parameters"]
        .iter()
        .any(|k| f.get(k).is_some_and(|v| !v.is_null()));
    let mut with_default: Map<String, Value>;
    let fields = if given {
        Fields {
            file: f.file,
            map: f.map,
        }
    } else {
        with_default = f.map.clone();
        with_default.insert(
            "rope_scaling".into(),
            json!({
                "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": false, "original_max_position_embeddings": 4096
            }),
        );
        Fields {
            file: f.file,
            map: &with_default,
        }
    };
    let src = RopeSource {
        default_theta: 150_000.0,
        ..RopeSource::PLAIN
    };
    let rope = Rope::parse_from(&fields, head_dim, &src)?;
    Ok((kinds, window, rope))
}

/// The experts' fields: the SwiGLU's clamp and slope, and the two names
/// GPT-OSS gives the experts per token, which must agree.
pub(super) fn parse_experts(f: &Fields<'_>, top_k: usize) -> Result<GptOssExperts> {
    if let Some(k) = f.usize("experts_per_token")?
        && k != top_k
    {
        return Err(f.err(
            "experts_per_token",
            format!("is {k} but num_experts_per_tok is {top_k}; the model routes to one number of experts"),
        ));
    }
    let positive = |field: &str, default: f64| -> Result<f32> {
        match f.f64(field)? {
            None => Ok(default as f32),
            Some(v) if v > 0.0 && v.is_finite() => Ok(v as f32),
            Some(v) => Err(f.err(field, format!("{v} must be positive"))),
        }
    };
    Ok(GptOssExperts {
        swiglu_limit: positive("swiglu_limit", 7.0)?,
        swiglu_alpha: positive("swiglu_alpha", 1.702)?,
    })
}
