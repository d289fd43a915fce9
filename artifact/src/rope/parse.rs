//! Reading a [`Rope`] from a `config.json`: which objects hold it, and
//! every field of each scaling kind understood or refused by name.

use serde_json::{Map, Value};

use super::{Rope, RopeScaling, RopeSource};
use crate::error::{FileError, Result};
use crate::json::Fields;

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

    /// `factor`, or where it is null the ratio of the context to the
    /// pretraining one (`original`), as transformers falls back.
    fn factor_or_ratio(&self, original: usize) -> Result<f64> {
        match self.get("factor") {
            Some(_) => self.positive("factor"),
            None => {
                let max = self.f.usize("max_position_embeddings")?.ok_or_else(|| {
                    self.err("factor", "is required (or max_position_embeddings)")
                })?;
                Ok(max as f64 / original as f64)
            }
        }
    }

    /// An `attention_factor` the config gives: a positive number.
    fn attention_factor(&self) -> Result<Option<f64>> {
        match self.f64("attention_factor")? {
            Some(a) if a <= 0.0 => {
                Err(self.err("attention_factor", format!("{a} must be a positive number")))
            }
            given => Ok(given),
        }
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
        let factor = self.factor_or_ratio(original)?;
        let attention_factor = match self.attention_factor()? {
            Some(a) => a,
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
        let factor = self.factor_or_ratio(original)?;
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
        let attention_factor = match self.attention_factor()? {
            Some(a) => a,
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
