//! Rotary position embeddings as checkpoints ship them: `rope_theta` with
//! `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5),
//! read into one [`Rope`], and the inverse frequencies and attention factor
//! computed from it as transformers computes them (in f32), once at load,
//! for every backend.
//!
//! Every field of a scaling kind is understood or refused by name; a kind
//! the engine does not implement is refused by name too (`parse.rs`).

mod parse;
#[cfg(test)]
mod tests;

/// How the rotary frequencies are scaled.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `1 / theta^(2i/d)`.
    Default,
    /// Every frequency divided by `factor` (position interpolation).
    Linear { factor: f64 },
    /// Llama 3.1: low frequencies divided by `factor`, high ones kept, the
    /// band between them smoothly interpolated.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// YaRN: interpolation and extrapolation blended by a ramp between the
    /// correction dimensions of `beta_fast` and `beta_slow`, and cos and sin
    /// scaled by the attention factor.
    Yarn {
        factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        original_max_position_embeddings: usize,
        truncate: bool,
        attention_factor: f64,
    },
    /// Dynamic NTK: past `max_position_embeddings`, the base grows with the
    /// length the frequencies are computed for; within it, plain RoPE.
    Dynamic {
        factor: f64,
        max_position_embeddings: usize,
    },
    /// LongRoPE (Phi-3.5, Phi-4-mini): per-pair rescale factors, `short`
    /// while a sequence is within the pretraining context and `long`
    /// once it is longer, and cos and sin scaled by the attention factor.
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
    },
}

impl RopeScaling {
    /// The `rope_type` that names it.
    pub fn rope_type(&self) -> &'static str {
        match self {
            RopeScaling::Default => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::Yarn { .. } => "yarn",
            RopeScaling::LongRope { .. } => "longrope",
            RopeScaling::Dynamic { .. } => "dynamic",
        }
    }
}

/// Where a config keeps one rotary embedding.
#[derive(Debug, Clone, Copy)]
pub struct RopeSource<'s> {
    /// The top-level base field, and its value when absent.
    pub theta_field: &'s str,
    pub default_theta: f64,
    /// The top-level scaling objects that apply (transformers 4).
    pub scaling_fields: &'s [&'s str],
    /// The layer type transformers 5 nests this embedding under in
    /// `rope_parameters`; None where `rope_parameters` is flat.
    pub layer_kind: Option<&'s str>,
}

impl RopeSource<'static> {
    /// One embedding for every layer.
    pub const PLAIN: RopeSource<'static> = RopeSource {
        theta_field: "rope_theta",
        default_theta: 10_000.0,
        scaling_fields: &["rope_scaling"],
        layer_kind: None,
    };
}

/// A model's rotary embedding.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub theta: f64,
    /// The leading dimensions of each head that rotate
    /// (`head_dim · partial_rotary_factor`); the rest pass through.
    pub rotary_dim: usize,
    pub scaling: RopeScaling,
}

impl Rope {
    /// The Hugging Face default for a model with no scaling.
    pub fn plain(theta: f64, head_dim: usize) -> Rope {
        Rope {
            theta,
            rotary_dim: head_dim,
            scaling: RopeScaling::Default,
        }
    }

    /// The length past which a sequence rotates by [`Rope::long_inv_freq`]
    /// (LongRoPE's pretraining context), all its positions recomputed so,
    /// as transformers' Phi-3 does; None where the frequencies never
    /// depend on the length.
    pub fn long_after(&self) -> Option<usize> {
        match &self.scaling {
            RopeScaling::LongRope {
                original_max_position_embeddings,
                ..
            } => Some(*original_max_position_embeddings),
            _ => None,
        }
    }

    /// Dynamic NTK's threshold: a token whose context (see
    /// [`Rope::dynamic_inv_freq`]) is longer rotates by frequencies computed
    /// for that length.
    pub fn dynamic_after(&self) -> Option<usize> {
        match &self.scaling {
            RopeScaling::Dynamic {
                max_position_embeddings,
                ..
            } => Some(*max_position_embeddings),
            _ => None,
        }
    }

    /// Dynamic NTK's frequencies for a context of `seq_len` positions, in
    /// f32 as transformers computes them: the base times
    /// `(factor · seq_len / max_position_embeddings − (factor − 1))^(d / (d − 2))`.
    /// transformers computes them for the longest position of each forward
    /// pass and keeps the keys it cached, so with a cache a prompt of `L`
    /// tokens rotates by the frequencies of `L` and each later token by
    /// those of its own length: a token at position `p` of a sequence whose
    /// prompt has `L` tokens uses `seq_len = max(L, p + 1)`. Plain RoPE's
    /// frequencies within `max_position_embeddings`, and for any other
    /// scaling.
    pub fn dynamic_inv_freq(&self, seq_len: usize) -> Vec<f32> {
        let RopeScaling::Dynamic {
            factor,
            max_position_embeddings,
        } = &self.scaling
        else {
            return self.inv_freq();
        };
        if seq_len <= *max_position_embeddings {
            return self.inv_freq();
        }
        let dim = self.rotary_dim;
        let factor = *factor as f32;
        let grown = factor * seq_len as f32 / *max_position_embeddings as f32 - (factor - 1.0);
        let base = self.theta as f32 * grown.powf((dim as f64 / (dim as f64 - 2.0)) as f32);
        (0..dim / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32))
            .collect()
    }

    /// The longest sequence the model serves: `max_position_embeddings`,
    /// times the factor for dynamic NTK (which is what it is for).
    pub fn max_model_len(&self, max_position_embeddings: usize) -> usize {
        match &self.scaling {
            RopeScaling::Dynamic { factor, .. } => {
                (max_position_embeddings as f64 * factor.max(1.0)) as usize
            }
            _ => max_position_embeddings,
        }
    }

    /// LongRoPE's frequencies for a sequence longer than
    /// [`Rope::long_after`].
    pub fn long_inv_freq(&self) -> Option<Vec<f32>> {
        match &self.scaling {
            RopeScaling::LongRope { long_factor, .. } => Some(self.longrope(long_factor)),
            _ => None,
        }
    }

    /// `1 / (factor_i · theta^(2i/d))`, in f32 as transformers computes it.
    fn longrope(&self, factors: &[f64]) -> Vec<f32> {
        let (dim, base) = (self.rotary_dim, self.theta as f32);
        factors
            .iter()
            .enumerate()
            .map(|(i, &f)| 1.0 / (f as f32 * base.powf((2 * i) as f32 / dim as f32)))
            .collect()
    }

    /// The inverse frequency of each rotary pair, `rotary_dim / 2` of them,
    /// in f32 as transformers computes them (LongRoPE's short ones).
    pub fn inv_freq(&self) -> Vec<f32> {
        let dim = self.rotary_dim;
        let base = self.theta as f32;
        let exponent = |i: usize| (2 * i) as f32 / dim as f32;
        let plain: Vec<f32> = (0..dim / 2).map(|i| 1.0 / base.powf(exponent(i))).collect();
        match &self.scaling {
            RopeScaling::Default | RopeScaling::Dynamic { .. } => plain,
            RopeScaling::Linear { factor } => {
                let factor = *factor as f32;
                plain.into_iter().map(|f| f / factor).collect()
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let (factor, low, high) = (
                    *factor as f32,
                    *low_freq_factor as f32,
                    *high_freq_factor as f32,
                );
                let old = *original_max_position_embeddings as f32;
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                plain
                    .into_iter()
                    .map(|f| {
                        let wavelen = (2.0 * std::f64::consts::PI) as f32 / f;
                        let scaled = if wavelen > low_wavelen { f / factor } else { f };
                        if wavelen < high_wavelen || wavelen > low_wavelen {
                            scaled
                        } else {
                            let smooth = (old / wavelen - low) / (high - low);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        }
                    })
                    .collect()
            }
            RopeScaling::LongRope { short_factor, .. } => self.longrope(short_factor),
            RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings,
                truncate,
                ..
            } => {
                let correction = |rotations: f64| {
                    (dim as f64
                        * (*original_max_position_embeddings as f64
                            / (rotations * 2.0 * std::f64::consts::PI))
                            .ln())
                        / (2.0 * self.theta.ln())
                };
                let (mut low, mut high) = (correction(*beta_fast), correction(*beta_slow));
                if *truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
                if low == high {
                    high += 0.001;
                }
                let (low, high, factor) = (low as f32, high as f32, *factor as f32);
                (0..dim / 2)
                    .map(|i| {
                        let pos_freq = base.powf(exponent(i));
                        let extrapolation = 1.0 / pos_freq;
                        let interpolation = 1.0 / (factor * pos_freq);
                        let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                        let keep = 1.0 - ramp;
                        interpolation * (1.0 - keep) + extrapolation * keep
                    })
                    .collect()
            }
        }
    }

    /// What cos and sin are multiplied by (YaRN's attention factor; 1
    /// otherwise).
    pub fn attention_factor(&self) -> f32 {
        match &self.scaling {
            RopeScaling::Yarn {
                attention_factor, ..
            }
            | RopeScaling::LongRope {
                attention_factor, ..
            } => *attention_factor as f32,
            _ => 1.0,
        }
    }
}
