//! Rotary position embeddings as checkpoints ship them: `rope_theta` with
//! `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5),
//! read into one [`Rope`], and the inverse frequencies and attention factor
//! computed from it as transformers computes them (in f32), once at load,
//! for every backend.
//!
//! Every field of a scaling kind is understood or refused by name; a kind
//! the engine does not implement is refused by name too.

use serde_json::{Map, Value};

use crate::error::{FileError, Result};
use crate::model_config::Fields;

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
    /// Reads the rotary embedding from a `config.json`: `rope_theta` and
    /// `partial_rotary_factor` at the top level, and `rope_scaling` or
    /// `rope_parameters` (whose own `rope_theta` and
    /// `partial_rotary_factor` come first). `head_dim` is the model's.
    pub fn parse(f: &Fields<'_>, head_dim: usize) -> Result<Rope> {
        Rope::parse_from(f, head_dim, &RopeSource::PLAIN)
    }

    /// Reads one rotary embedding from where `src` says the config keeps
    /// it (Gemma 3 has one for its global layers and one for its sliding
    /// ones).
    pub fn parse_from(f: &Fields<'_>, head_dim: usize, src: &RopeSource<'_>) -> Result<Rope> {
        let mut theta = f.f64(src.theta_field)?;
        let mut partial = f
            .f64("partial_rotary_factor")?
            .map(|p| ("partial_rotary_factor".to_owned(), p));
        let mut scaling = RopeScaling::Default;
        let mut seen: Option<String> = None;
        let mut objects: Vec<(String, &Map<String, Value>)> = Vec::new();
        fn object<'v>(
            f: &Fields<'_>,
            field: &str,
            value: &'v Value,
        ) -> Result<&'v Map<String, Value>> {
            match value {
                Value::Object(map) => Ok(map),
                _ => Err(f.err(field, "must be an object")),
            }
        }
        for field in src.scaling_fields {
            if let Some(value) = f.get(field) {
                objects.push((field.to_string(), object(f, field, value)?));
            }
        }
        if let Some(value) = f.get("rope_parameters") {
            let map = object(f, "rope_parameters", value)?;
            match src.layer_kind {
                // transformers 5 nests it by layer type.
                Some(kind) => {
                    if let Some(inner) = map.get(kind).filter(|v| !v.is_null()) {
                        let name = format!("rope_parameters.{kind}");
                        objects.push((name.clone(), object(f, &name, inner)?));
                    }
                }
                None => objects.push(("rope_parameters".to_owned(), map)),
            }
        }
        for (field, map) in objects {
            if map.is_empty() {
                continue;
            }
            if let Some(other) = &seen {
                return Err(f.err(
                    &field,
                    format!("is given beside `{other}`; a config holds one of them"),
                ));
            }
            let sub = Sub {
                f,
                field: &field,
                map,
            };
            if let Some(t) = sub.f64("rope_theta")? {
                theta = Some(t);
            }
            if let Some(p) = sub.f64("partial_rotary_factor")? {
                partial = Some((format!("{field}.partial_rotary_factor"), p));
            }
            scaling = sub.scaling()?;
            seen = Some(field);
        }
        let theta = theta.unwrap_or(src.default_theta);
        if theta <= 0.0 {
            return Err(f.err("rope_theta", format!("{theta} must be positive")));
        }
        let rotary_dim = match partial {
            None => head_dim,
            Some((name, p)) => {
                let dim = (head_dim as f64 * p) as usize;
                if !(p > 0.0 && p <= 1.0) || dim == 0 || !dim.is_multiple_of(2) {
                    return Err(f.err(
                        &name,
                        format!(
                            "{p} must be in (0, 1] and give an even, positive number of rotary dimensions of head_dim {head_dim} (it gives {dim})"
                        ),
                    ));
                }
                dim
            }
        };
        if let RopeScaling::LongRope {
            short_factor,
            long_factor,
            ..
        } = &scaling
        {
            for (key, list) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                if list.len() != rotary_dim / 2 {
                    return Err(f.err(
                        &format!("{}.{key}", seen.as_deref().unwrap_or("rope_scaling")),
                        format!(
                            "has {} factors; the {rotary_dim} rotary dimensions need {}",
                            list.len(),
                            rotary_dim / 2
                        ),
                    ));
                }
            }
        }
        Ok(Rope {
            theta,
            rotary_dim,
            scaling,
        })
    }

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

/// One `rope_scaling` / `rope_parameters` object, its fields named
/// `rope_scaling.factor` and so on in errors.
struct Sub<'a> {
    f: &'a Fields<'a>,
    field: &'a str,
    map: &'a Map<String, Value>,
}

impl Sub<'_> {
    fn name(&self, key: &str) -> String {
        format!("{}.{key}", self.field)
    }

    fn err(&self, key: &str, reason: impl Into<String>) -> FileError {
        self.f.err(&self.name(key), reason)
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(self.err(key, format!("must be a finite number, got {v}"))),
            },
        }
    }

    /// A required factor: a positive finite number.
    fn positive(&self, key: &str) -> Result<f64> {
        match self.f64(key)? {
            Some(x) if x > 0.0 => Ok(x),
            Some(x) => Err(self.err(key, format!("{x} must be a positive number"))),
            None => Err(self.err(key, "is required")),
        }
    }

    /// The pretraining context: the top-level `original_max_position_embeddings`
    /// (Phi-3 keeps it there, and transformers prefers it), else this
    /// object's, else `max_position_embeddings`.
    fn original_context(&self) -> Result<usize> {
        let top = self.f.usize("original_max_position_embeddings")?;
        let here = match self.get("original_max_position_embeddings") {
            None => None,
            Some(v) => Some(v.as_u64().map(|n| n as usize).ok_or_else(|| {
                self.err(
                    "original_max_position_embeddings",
                    format!("must be a non-negative integer, got {v}"),
                )
            })?),
        };
        let n = match (top, here) {
            (Some(n), _) | (None, Some(n)) => n,
            (None, None) => self.f.usize("max_position_embeddings")?.ok_or_else(|| {
                self.err(
                    "original_max_position_embeddings",
                    "is required (or max_position_embeddings)",
                )
            })?,
        };
        if n == 0 {
            return Err(self.err("original_max_position_embeddings", "must be positive"));
        }
        Ok(n)
    }

    /// Refuses any key a kind does not read, by name.
    fn only(&self, kind: &str, allowed: &[&str]) -> Result<()> {
        const ALWAYS: [&str; 4] = ["rope_type", "type", "rope_theta", "partial_rotary_factor"];
        for key in self.map.keys() {
            if !ALWAYS.contains(&key.as_str()) && !allowed.contains(&key.as_str()) {
                return Err(self.err(
                    key,
                    format!("is not a field of rope type {kind:?} that the engine implements"),
                ));
            }
        }
        Ok(())
    }

    fn scaling(&self) -> Result<RopeScaling> {
        let kind_key = if self.map.contains_key("rope_type") {
            "rope_type"
        } else {
            "type"
        };
        let kind = match self.get(kind_key) {
            None => "default",
            Some(Value::String(s)) => s.as_str(),
            Some(v) => return Err(self.err(kind_key, format!("must be a string, got {v}"))),
        };
        match kind {
            "default" => {
                self.only(kind, &[])?;
                Ok(RopeScaling::Default)
            }
            "linear" => {
                self.only(kind, &["factor"])?;
                Ok(RopeScaling::Linear {
                    factor: self.positive("factor")?,
                })
            }
            "llama3" => {
                self.only(
                    kind,
                    &[
                        "factor",
                        "low_freq_factor",
                        "high_freq_factor",
                        "original_max_position_embeddings",
                    ],
                )?;
                let (low, high) = (
                    self.positive("low_freq_factor")?,
                    self.positive("high_freq_factor")?,
                );
                if high <= low {
                    return Err(self.err(
                        "high_freq_factor",
                        format!("{high} must be above low_freq_factor {low}"),
                    ));
                }
                Ok(RopeScaling::Llama3 {
                    factor: self.positive("factor")?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: self.original_context()?,
                })
            }
            "yarn" => self.yarn(),
            "longrope" => self.longrope(),
            "dynamic" => {
                self.only(kind, &["factor"])?;
                Ok(RopeScaling::Dynamic {
                    factor: self.positive("factor")?,
                    max_position_embeddings: self.f.usize("max_position_embeddings")?.unwrap_or(2048).max(1),
                })
            }
            other => {
                Err(self.err(
                    kind_key,
                    format!(
                        "rope type {other:?} is not supported; expected one of \"default\", \"linear\", \"dynamic\", \"llama3\", \"yarn\", \"longrope\""
                    ),
                ))
            }
        }
    }

    /// A list of positive finite factors.
    fn factors(&self, key: &str) -> Result<Vec<f64>> {
        let Some(v) = self.get(key) else {
            return Err(self.err(key, "is required"));
        };
        let list = v
            .as_array()
            .ok_or_else(|| self.err(key, format!("must be a list of numbers, got {v}")))?;
        list.iter()
            .enumerate()
            .map(|(i, x)| match x.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(x),
                _ => Err(self.err(
                    &format!("{key}[{i}]"),
                    format!("must be a positive number, got {x}"),
                )),
            })
            .collect()
    }

    fn longrope(&self) -> Result<RopeScaling> {
        self.only(
            "longrope",
            &[
                "short_factor",
                "long_factor",
                "factor",
                "attention_factor",
                "original_max_position_embeddings",
            ],
        )?;
        let original = self.original_context()?;
        // Phi-3 gives no factor: the ratio of the context to the
        // pretraining one sets the attention factor.
        let factor = match self.get("factor") {
            None => {
                let max = self.f.usize("max_position_embeddings")?.ok_or_else(|| {
                    self.err("factor", "is required (or max_position_embeddings)")
                })?;
                max as f64 / original as f64
            }
            Some(_) => self.positive("factor")?,
        };
        let attention_factor = match self.f64("attention_factor")? {
            Some(a) if a > 0.0 => a,
            Some(a) => {
                return Err(self.err("attention_factor", format!("{a} must be a positive number")));
            }
            None if factor <= 1.0 => 1.0,
            None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
        };
        Ok(RopeScaling::LongRope {
            short_factor: self.factors("short_factor")?,
            long_factor: self.factors("long_factor")?,
            original_max_position_embeddings: original,
            attention_factor,
        })
    }

    fn yarn(&self) -> Result<RopeScaling> {
        self.only(
            "yarn",
            &[
                "factor",
                "attention_factor",
                "beta_fast",
                "beta_slow",
                "mscale",
                "mscale_all_dim",
                "original_max_position_embeddings",
                "truncate",
            ],
        )?;
        let original = self.original_context()?;
        // A null factor is the ratio of the context to the pretraining one.
        let factor = match self.get("factor") {
            None => {
                let max = self.f.usize("max_position_embeddings")?.ok_or_else(|| {
                    self.err("factor", "is required (or max_position_embeddings)")
                })?;
                max as f64 / original as f64
            }
            Some(_) => self.positive("factor")?,
        };
        let beta = |key: &str, default: f64| -> Result<f64> {
            match self.f64(key)? {
                // transformers reads `or 32` / `or 1`: a 0 means the default.
                None => Ok(default),
                Some(0.0) => Ok(default),
                Some(x) if x > 0.0 => Ok(x),
                Some(x) => Err(self.err(key, format!("{x} must be a positive number"))),
            }
        };
        let (beta_fast, beta_slow) = (beta("beta_fast", 32.0)?, beta("beta_slow", 1.0)?);
        let truncate = match self.get("truncate") {
            None => true,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(self.err("truncate", format!("must be true or false, got {v}"))),
        };
        let get_mscale = |scale: f64, m: f64| {
            if scale <= 1.0 {
                1.0
            } else {
                0.1 * m * scale.ln() + 1.0
            }
        };
        let (mscale, mscale_all_dim) = (self.f64("mscale")?, self.f64("mscale_all_dim")?);
        let attention_factor = match self.f64("attention_factor")? {
            Some(a) if a > 0.0 => a,
            Some(a) => {
                return Err(self.err("attention_factor", format!("{a} must be a positive number")));
            }
            None => match (mscale, mscale_all_dim) {
                // transformers tests their truth: a 0 counts as absent.
                (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                    get_mscale(factor, m) / get_mscale(factor, all)
                }
                _ => get_mscale(factor, 1.0),
            },
        };
        Ok(RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            original_max_position_embeddings: original,
            truncate,
            attention_factor,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn rope(config: Value) -> Result<Rope> {
        let map = config.as_object().unwrap().clone();
        let f = Fields {
            file: Path::new("config.json"),
            map: &map,
        };
        Rope::parse(&f, 64)
    }

    #[test]
    fn llama3_keeps_high_frequencies_divides_low_ones_and_smooths_between() {
        let r = rope(serde_json::json!({
            "rope_theta": 500000.0, "max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        }))
        .unwrap();
        let plain = Rope::plain(500000.0, 64).inv_freq();
        let scaled = r.inv_freq();
        assert_eq!(scaled[0], plain[0], "the highest frequency is kept");
        assert_eq!(
            scaled[31],
            plain[31] / 8.0,
            "the lowest is divided by the factor"
        );
        assert!(
            scaled
                .iter()
                .zip(&plain)
                .all(|(s, p)| s <= p && *s >= p / 8.0),
            "every frequency lies between the two"
        );
        assert_eq!(r.attention_factor(), 1.0);
    }

    #[test]
    fn yarn_reads_its_attention_factor_from_mscale() {
        let r = rope(serde_json::json!({
            "rope_theta": 10000.0, "max_position_embeddings": 32768,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
        }))
        .unwrap();
        assert!((r.attention_factor() - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-6);
        let r = rope(serde_json::json!({
            "rope_parameters": {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                "beta_fast": 32, "beta_slow": 1, "rope_theta": 150000.0}
        }))
        .unwrap();
        assert_eq!(r.attention_factor(), 1.0, "mscale over mscale_all_dim");
        assert_eq!(r.theta, 150000.0);
    }

    #[test]
    fn partial_rotary_factor_rotates_the_leading_dimensions() {
        let r = rope(serde_json::json!({"partial_rotary_factor": 0.75})).unwrap();
        assert_eq!(r.rotary_dim, 48);
        assert_eq!(r.inv_freq().len(), 24);
    }

    #[test]
    fn what_it_does_not_implement_or_contradicts_itself_is_refused_by_field() {
        for (config, needle) in [
            (
                serde_json::json!({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0, "beta_fast": 1}}),
                "`rope_scaling.beta_fast`: is not a field of rope type \"dynamic\"",
            ),
            (
                serde_json::json!({"max_position_embeddings": 64, "rope_scaling": {"rope_type": "longrope",
                    "short_factor": [1.0], "long_factor": [1.0]}}),
                "`rope_scaling.short_factor`: has 1 factors; the 64 rotary dimensions need 32",
            ),
            (
                serde_json::json!({"max_position_embeddings": 64, "rope_scaling": {"rope_type": "longrope",
                    "short_factor": [1.0], "long_factor": [-1.0]}}),
                "`rope_scaling.long_factor[0]`: must be a positive number",
            ),
            (
                serde_json::json!({"rope_scaling": {"type": "su"}}),
                "`rope_scaling.type`: rope type \"su\"",
            ),
            (
                serde_json::json!({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}),
                "`rope_scaling.factor`: -2 must be a positive number",
            ),
            (
                serde_json::json!({"rope_scaling": {"rope_type": "linear"}}),
                "`rope_scaling.factor`: is required",
            ),
            (
                serde_json::json!({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 3}}),
                "`rope_scaling.beta_fast`: is not a field of rope type \"linear\"",
            ),
            (
                serde_json::json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                    "low_freq_factor": 4.0, "high_freq_factor": 1.0}}),
                "`rope_scaling.high_freq_factor`",
            ),
            (
                serde_json::json!({"partial_rotary_factor": 1.5}),
                "`partial_rotary_factor`",
            ),
            (serde_json::json!({"rope_theta": 0.0}), "`rope_theta`"),
            (
                serde_json::json!({"max_position_embeddings": 64, "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "truncate": "no"}}),
                "`rope_scaling.truncate`",
            ),
        ] {
            let err = rope(config).unwrap_err().to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        }
    }
}
