//! LoRA adapters in PEFT format: `adapter_config.json` plus
//! `adapter_model.safetensors`, parsed and checked against the base model
//! into a [`HostAdapter`], the host-tier form the pool keeps.
//!
//! Each targeted projection gets `y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ` with
//! `s = alpha / r` (or `alpha / √r` with `use_rslora`); a DoRA adapter's
//! (`use_dora`) gets `y = b + (m / ‖W + s·B·A‖) ⊙ (x·Wᵀ + s·(x·Aᵀ)·Bᵀ)`, its
//! magnitude `m` and the norm of each output row of the adapted weight, as
//! PEFT computes it. Everything else PEFT can express that would change
//! this math is refused by name.

use std::path::Path;

pub use lorafleet_artifact::adapter::config;
use lorafleet_artifact::adapter::tensors::{self, Factor};
pub use lorafleet_artifact::adapter::{AdapterConfig, AdapterError, ExpertTarget, Projection};

pub mod experts;
pub use experts::{ExpertFactors, ExpertLayer};
pub mod outer;
pub use outer::{BaseCopy, EmbeddingLora, Outer};
pub mod saved;

use crate::model::{ModelConfig, WeightFiles};

/// One projection's LoRA factors in one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraModule {
    pub rank: usize,
    pub scale: f32,
    pub factors: Factors,
    /// DoRA's magnitude vector, one value per output row of this part.
    pub magnitude: Option<Vec<f32>>,
    /// lora_B's bias (`lora_bias`), one value per output row of this part;
    /// added scaled, `s · b`, with the delta.
    pub bias: Option<Vec<f32>>,
}

/// A module's A and Bᵀ in the precision the adapter file stores them in.
///
/// Both transposed, row-major: Aᵀ `[in_features, rank]` and Bᵀ
/// `[rank, out_features]`. That is the order the CPU slot panels hold them
/// in (input-major A, rank-major B), so writing a slot copies whole rows
/// instead of transposing A on the step's time.
#[derive(Debug, Clone, PartialEq)]
pub enum Factors {
    F32 {
        a_t: Vec<f32>,
        b_t: Vec<f32>,
    },
    /// Both stored as bf16 in the file, kept as their bits: half the host
    /// memory, half the bytes a slot write copies and a decode step reads.
    /// Widening bf16 to f32 is exact, so the numbers are those of the f32
    /// widening.
    Bf16 {
        a_t: Vec<u16>,
        b_t: Vec<u16>,
    },
}

impl LoraModule {
    /// A as f32, row-major `[rank, in_features]` (widened exactly when
    /// stored as bf16).
    pub fn a_f32(&self) -> Vec<f32> {
        let fan_in = self.factors_len().0 / self.rank.max(1);
        match &self.factors {
            Factors::F32 { a_t, .. } => transpose(a_t, fan_in, self.rank),
            Factors::Bf16 { a_t, .. } => transpose(&widen(a_t), fan_in, self.rank),
        }
    }

    /// Writes A, `[rank, fan_in]` row-major f32, into `dst` (its length),
    /// in order, with no copy between: a slot write fills page-locked
    /// memory this way.
    pub fn write_a_f32(&self, dst: &mut [f32]) {
        self.write_a_as(dst, |v| v, crate::backend::cpu::panels::bf16_to_f32);
    }

    /// Writes Bᵀ, `[rank, fan_out]` row-major f32, into `dst` (its length).
    pub fn write_b_t_f32(&self, dst: &mut [f32]) {
        self.write_b_t_as(dst, |v| v, crate::backend::cpu::panels::bf16_to_f32);
    }

    /// Writes A, `[rank, fan_in]` row-major, into `dst` (its length), each
    /// value through `from_f32`, or `from_bf16` (its bits) when the file
    /// stored bf16.
    pub fn write_a_as<T>(
        &self,
        dst: &mut [T],
        from_f32: impl Fn(f32) -> T,
        from_bf16: impl Fn(u16) -> T,
    ) {
        let (len, _) = self.factors_len();
        assert_eq!(dst.len(), len);
        let rank = self.rank.max(1);
        let fan_in = len / rank;
        for (r, row) in dst.chunks_exact_mut(fan_in.max(1)).enumerate() {
            match &self.factors {
                Factors::F32 { a_t, .. } => {
                    for (i, d) in row.iter_mut().enumerate() {
                        *d = from_f32(a_t[i * rank + r]);
                    }
                }
                Factors::Bf16 { a_t, .. } => {
                    for (i, d) in row.iter_mut().enumerate() {
                        *d = from_bf16(a_t[i * rank + r]);
                    }
                }
            }
        }
    }

    /// Writes Bᵀ, `[rank, fan_out]` row-major, into `dst` (its length), as
    /// [`LoraModule::write_a_as`].
    pub fn write_b_t_as<T>(
        &self,
        dst: &mut [T],
        from_f32: impl Fn(f32) -> T,
        from_bf16: impl Fn(u16) -> T,
    ) {
        match &self.factors {
            Factors::F32 { b_t, .. } => {
                for (d, &b) in dst.iter_mut().zip(b_t) {
                    *d = from_f32(b);
                }
            }
            Factors::Bf16 { b_t, .. } => {
                for (d, &b) in dst.iter_mut().zip(b_t) {
                    *d = from_bf16(b);
                }
            }
        }
    }

    /// The lengths of A and Bᵀ, in values.
    pub fn factor_lens(&self) -> (usize, usize) {
        self.factors_len()
    }

    /// The lengths of Aᵀ and Bᵀ.
    fn factors_len(&self) -> (usize, usize) {
        match &self.factors {
            Factors::F32 { a_t, b_t } => (a_t.len(), b_t.len()),
            Factors::Bf16 { a_t, b_t } => (a_t.len(), b_t.len()),
        }
    }

    /// Bᵀ as f32 (widened exactly when stored as bf16).
    pub fn b_t_f32(&self) -> std::borrow::Cow<'_, [f32]> {
        match &self.factors {
            Factors::F32 { b_t, .. } => std::borrow::Cow::Borrowed(b_t),
            Factors::Bf16 { b_t, .. } => std::borrow::Cow::Owned(widen(b_t)),
        }
    }

    /// Bytes of weights held.
    pub fn bytes(&self) -> usize {
        let (a, b) = self.factors_len();
        let magnitude = self.magnitude.as_ref().map_or(0, |m| m.len() * 4);
        let bias = self.bias.as_ref().map_or(0, |b| b.len() * 4);
        magnitude
            + bias
            + match &self.factors {
                Factors::F32 { .. } => (a + b) * 4,
                Factors::Bf16 { .. } => (a + b) * 2,
            }
    }

    /// `(ΔW)[o]`, the LoRA delta of output row `o` scaled: `s · Σ_r B[o, r]
    /// A[r, ·]`, `fan_in` values.
    pub fn delta_row(&self, o: usize, fan_in: usize) -> Vec<f32> {
        let rank = self.rank.max(1);
        let b_t = self.b_t_f32();
        let fan_out = b_t.len() / rank;
        let a_t: std::borrow::Cow<'_, [f32]> = match &self.factors {
            Factors::F32 { a_t, .. } => std::borrow::Cow::Borrowed(a_t),
            Factors::Bf16 { a_t, .. } => std::borrow::Cow::Owned(widen(a_t)),
        };
        (0..fan_in)
            .map(|k| {
                let lora: f32 = (0..rank)
                    .map(|r| a_t[k * rank + r] * b_t[r * fan_out + o])
                    .sum();
                self.scale * lora
            })
            .collect()
    }

    /// DoRA's scale of each output row, `m / ‖W + s·B·A‖`, given the
    /// base weight's rows (`row(o, out)` writes row `o`, `fan_in` values)
    /// as the backend holds them; `None` for a plain LoRA module.
    pub fn dora_scales(&self, fan_in: usize, row: impl Fn(usize, &mut [f32])) -> Option<Vec<f32>> {
        let magnitude = self.magnitude.as_ref()?;
        let mut w = vec![0f32; fan_in];
        Some(
            magnitude
                .iter()
                .enumerate()
                .map(|(o, &m)| {
                    row(o, &mut w);
                    let delta = self.delta_row(o, fan_in);
                    let squares: f64 = w
                        .iter()
                        .zip(&delta)
                        .map(|(&w, &d)| f64::from(w + d) * f64::from(w + d))
                        .sum();
                    m / squares.sqrt() as f32
                })
                .collect(),
        )
    }
}

fn widen(bits: &[u16]) -> Vec<f32> {
    bits.iter()
        .map(|&b| crate::backend::cpu::panels::bf16_to_f32(b))
        .collect()
}

/// `[rows, cols]` row-major to `[cols, rows]`.
fn transpose<T: Copy + Default>(m: &[T], rows: usize, cols: usize) -> Vec<T> {
    let mut t = vec![T::default(); rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = m[r * cols + c];
        }
    }
    t
}

/// A validated adapter in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct HostAdapter {
    pub name: String,
    /// The largest rank over its modules.
    pub rank: usize,
    /// `modules[layer][projection.index()]`.
    pub modules: Vec<[Option<LoraModule>; 7]>,
    /// `experts[layer]`: LoRA on a Mixture-of-Experts block; empty for a
    /// dense model or an adapter without expert targets.
    /// Shared, not copied, by the slots that hold the adapter.
    pub experts: std::sync::Arc<Vec<ExpertLayer>>,
    /// LoRA on the token embeddings and the lm_head, and the adapter's
    /// copies of those layers; shared by the slots that hold it.
    pub outer: std::sync::Arc<Outer>,
    /// Bytes of weights held.
    pub bytes: usize,
    /// The artifact digest of the files it was read from, when the pool
    /// knows it: the identity a backend may keep work on the adapter by
    /// (DoRA's norms) across the adapter's evictions.
    pub digest: Option<String>,
}

impl HostAdapter {
    /// Whether any module's lora_B has a bias (`lora_bias`).
    pub fn has_lora_bias(&self) -> bool {
        self.modules
            .iter()
            .flatten()
            .flatten()
            .any(|m| m.bias.is_some())
    }

    /// What a device slot holding it holds beyond the slot's LoRA panels,
    /// in bytes: an lm_head saved whole, which the CPU backend packs beside
    /// the slot for its rows' logits (the same values, in the precision
    /// stored, padded as packed). Everything else it has is shared with
    /// the host tier.
    pub fn slot_extra_bytes(&self) -> u64 {
        self.outer
            .saved
            .lm_head
            .as_ref()
            .filter(|h| h.is_whole())
            .map_or(0, |h| h.packed_bytes() as u64)
    }

    /// Whether it has LoRA on the token embeddings or the lm_head, or
    /// rows of its own there.
    pub fn has_outer(&self) -> bool {
        !self.outer.is_empty()
    }

    /// Whether any module is DoRA (has a magnitude vector).
    pub fn is_dora(&self) -> bool {
        self.modules
            .iter()
            .flatten()
            .flatten()
            .any(|m| m.magnitude.is_some())
    }
}

/// What a loader checks an adapter against.
#[derive(Debug, Clone, Copy)]
pub struct AdapterLimits<'a> {
    pub model: &'a ModelConfig,
    pub max_lora_rank: usize,
    /// The served base model's hash, and the hash the adapter declares (for
    /// example from its registry descriptor), when the caller has one.
    pub base_hash_check: Option<(&'a str, &'a str)>,
}

impl HostAdapter {
    /// Reads and validates a PEFT adapter directory.
    pub fn load(
        name: &str,
        dir: &Path,
        limits: AdapterLimits<'_>,
    ) -> Result<HostAdapter, AdapterError> {
        if let Some((actual, declared)) = limits.base_hash_check
            && actual != declared
        {
            return Err(AdapterError::BaseHashMismatch {
                adapter: name.into(),
                declared: declared.into(),
                actual: actual.into(),
            });
        }
        let config =
            AdapterConfig::from_file(name, &dir.join("adapter_config.json"), limits.model)?;
        let weights_path = dir.join("adapter_model.safetensors");
        if !weights_path.exists() {
            return Err(AdapterError::Io {
                adapter: name.into(),
                path: "adapter_model.safetensors".into(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            });
        }
        let shown = weights_path.display().to_string();
        let mut files =
            WeightFiles::open(vec![weights_path]).map_err(|e| AdapterError::Invalid {
                adapter: name.into(),
                field: "adapter_model.safetensors".into(),
                // The file's own name only: the reason may reach a client, and
                // where this machine keeps the file is not the client's to know.
                reason: e.to_string().replace(&shown, "adapter_model.safetensors"),
            })?;
        files.serve_language_model_adapter();
        let adapter = build(name, &config, &files, limits)?;
        // Its own tokenizer's ids need rows: the base's, or those of its
        // own layers where they grow the vocabulary.
        let (rows, what) = match adapter.outer.saved.vocab() {
            Some(rows) if rows > limits.model.vocab_size => {
                (rows, "its own embed_tokens and lm_head")
            }
            _ => (limits.model.vocab_size, "the base model's vocabulary"),
        };
        lorafleet_artifact::adapter::saved::check_tokenizer(name, dir, rows as u64, what)?;
        Ok(adapter)
    }
}

/// Refuses a rank above the engine's maximum, naming `r` or the
/// `rank_pattern` entry that gives it, before any tensor is looked at.
fn check_ranks(
    name: &str,
    config: &AdapterConfig,
    limits: AdapterLimits<'_>,
) -> Result<(), AdapterError> {
    let outside = tensors::expected_outside_layers(config);
    for layer in 0..limits.model.num_layers {
        for e in tensors::expected_in_layer(config, layer)
            .iter()
            .chain(&outside)
        {
            let path = tensors::rank_path(e);
            let (rank, _) = config.rank_and_alpha(name, &path)?;
            if rank > limits.max_lora_rank {
                return Err(AdapterError::RankTooLarge {
                    adapter: name.into(),
                    field: if rank == config.r {
                        "r".into()
                    } else {
                        format!("rank_pattern ({path})")
                    },
                    rank,
                    max: limits.max_lora_rank,
                });
            }
        }
    }
    Ok(())
}

fn build(
    name: &str,
    config: &AdapterConfig,
    files: &WeightFiles,
    limits: AdapterLimits<'_>,
) -> Result<HostAdapter, AdapterError> {
    let model = limits.model;
    let invalid = |tensor: &str, reason: String| AdapterError::InvalidTensor {
        adapter: name.into(),
        tensor: tensor.into(),
        reason,
    };
    // Every tensor must be one the config implies, and every one it implies
    // must be there: anything else would be ignored math. The registry
    // checks the same rules at registration.
    check_ranks(name, config, limits)?;
    tensors::check(name, config, &files.header(), Some(model.num_layers))?;
    let mut modules: Vec<[Option<LoraModule>; 7]> =
        (0..model.num_layers).map(|_| Default::default()).collect();
    let (mut max_rank, mut bytes) = (0usize, 0usize);
    for (layer, slots) in modules.iter_mut().enumerate() {
        for t in config.targets_in_layer(layer) {
            let module_path = format!("model.layers.{layer}.{}", t.path);
            let (rank, alpha) = config.rank_and_alpha(name, &module_path)?;
            let fan_in = t.parts[0].shape(model).0;
            let fan_out: usize = t.parts.iter().map(|p| p.shape(model).1).sum();
            let a_name = tensors::module_tensor(layer, t, Factor::A);
            let b_name = tensors::module_tensor(layer, t, Factor::B);
            // DoRA's magnitude and lora_B's bias: a value per output row.
            let per_output = |on: bool, factor: Factor| -> Result<_, AdapterError> {
                if !on {
                    return Ok(None);
                }
                let name = tensors::module_tensor(layer, t, factor);
                let values = files.f32(&name, &[fan_out]);
                values.map(Some).map_err(|e| invalid(&name, strip_file(e)))
            };
            let magnitude = per_output(config.use_dora, Factor::Magnitude)?;
            let lora_bias = per_output(config.lora_bias, Factor::Bias)?;
            // bf16 stays bf16 when both factors are stored so; anything
            // else is widened to f32, exactly.
            let a_bits = files
                .bf16_bits(&a_name, &[rank, fan_in])
                .map_err(|e| invalid(&a_name, strip_file(e)))?;
            let b_bits = files
                .bf16_bits(&b_name, &[fan_out, rank])
                .map_err(|e| invalid(&b_name, strip_file(e)))?;
            // A fused module's parts share its A; each takes its own rows
            // of B (B's rows are the fused output's, in the parts' order),
            // so the parts' deltas are the fused module's, split.
            let mut row = 0;
            let parts = t.parts.iter().map(|&p| {
                let out = p.shape(model).1;
                let rows = row..row + out;
                row += out;
                (p, rows)
            });
            let parts: Vec<_> = parts.collect();
            let scale = if config.use_rslora {
                alpha / (rank as f32).sqrt()
            } else {
                alpha / rank as f32
            };
            max_rank = max_rank.max(rank);
            let split = match (a_bits, b_bits) {
                (Some(a), Some(b)) => split_parts(&a, &b, rank, fan_in, &parts, |a_t, b_t| {
                    Factors::Bf16 { a_t, b_t }
                }),
                _ => {
                    let a = files
                        .f32(&a_name, &[rank, fan_in])
                        .map_err(|e| invalid(&a_name, strip_file(e)))?;
                    let b = files
                        .f32(&b_name, &[fan_out, rank])
                        .map_err(|e| invalid(&b_name, strip_file(e)))?;
                    split_parts(&a, &b, rank, fan_in, &parts, |a_t, b_t| Factors::F32 {
                        a_t,
                        b_t,
                    })
                }
            };
            for ((p, factors), (_, rows)) in split.into_iter().zip(&parts) {
                let module = LoraModule {
                    rank,
                    scale,
                    factors,
                    magnitude: magnitude.as_ref().map(|m| m[rows.clone()].to_vec()),
                    bias: lora_bias.as_ref().map(|b| b[rows.clone()].to_vec()),
                };
                bytes += module.bytes();
                slots[p.index()] = Some(module);
            }
        }
    }
    let experts = experts::load(name, config, files, limits)?;
    max_rank = experts
        .iter()
        .flat_map(|l| [&l.gate_up, &l.down, &l.router])
        .flatten()
        .map(|f| f.rank)
        .fold(max_rank, usize::max);
    bytes += experts
        .iter()
        .flat_map(|l| [&l.gate_up, &l.down, &l.router])
        .flatten()
        .map(ExpertFactors::bytes)
        .sum::<usize>();
    let outer = outer::load(name, config, files, model)?;
    max_rank = max_rank.max(outer.rank());
    bytes += outer.bytes();
    Ok(HostAdapter {
        name: name.into(),
        rank: max_rank,
        modules,
        experts: std::sync::Arc::new(experts),
        outer: std::sync::Arc::new(outer),
        bytes,
        digest: None,
    })
}

/// A module's factors, A `[rank, fan_in]` and B `[out, rank]`, as the
/// host tier holds them (Aᵀ and Bᵀ) for each of its parts: every part
/// shares A and takes its own rows of B.
fn split_parts<T: Copy + Default>(
    a: &[T],
    b: &[T],
    rank: usize,
    fan_in: usize,
    parts: &[(Projection, std::ops::Range<usize>)],
    factors: impl Fn(Vec<T>, Vec<T>) -> Factors,
) -> Vec<(Projection, Factors)> {
    let a_t = transpose(a, rank, fan_in);
    parts
        .iter()
        .map(|(p, rows)| {
            let b_rows = &b[rows.start * rank..rows.end * rank];
            (
                *p,
                factors(a_t.clone(), transpose(b_rows, rows.len(), rank)),
            )
        })
        .collect()
}

/// The reason part of a weight error; the tensor is already named by the caller.
fn strip_file(e: lorafleet_artifact::FileError) -> String {
    match e {
        lorafleet_artifact::FileError::InvalidModel { reason, .. } => reason,
        other => other.to_string(),
    }
}
