//! LoRA outside the layers: on the token embeddings (`embed_tokens`,
//! PEFT's `lora.Embedding`: a token's row plus `s · B · A[:, token]`) and on
//! the lm_head (`logits + s · B · A · h`). Both are applied per row, by the
//! row's adapter, so they batch with other adapters and the base.
//!
//! PEFT saves the embedding layer itself beside such a LoRA
//! (`save_embedding_layers`) and loads it over the model's; the adapter
//! keeps a digest of each copy ([`BaseCopy`]) for the backend to compare
//! with its own weights, so a copy that is not the base's (a resized or
//! retrained vocabulary) is refused by name rather than served wrong.

use sha2::{Digest, Sha256};

use super::{AdapterConfig, AdapterError, ExpertFactors, strip_file};
use crate::model::{ModelConfig, WeightFiles};
use lorafleet_artifact::adapter::tensors::{self, Factor, Holds};

/// LoRA on the token embeddings.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingLora {
    pub rank: usize,
    pub scale: f32,
    /// `[vocab, rank]`: A transposed, so a token's column of A is a row.
    a_t: Vec<f32>,
    /// `[hidden, rank]`.
    b: Vec<f32>,
}

impl EmbeddingLora {
    /// Adds `s · B · A[:, token]` times the model's embedding scale
    /// (`embed_scale`: Gemma's √hidden, else 1) to `row` (`[hidden]`).
    pub fn add_delta(&self, token: u32, embed_scale: f32, row: &mut [f32]) {
        let r = self.rank;
        let a = &self.a_t[token as usize * r..][..r];
        for (v, b) in row.iter_mut().zip(self.b.chunks_exact(r)) {
            let d: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
            *v += d * self.scale * embed_scale;
        }
    }

    pub fn bytes(&self) -> usize {
        (self.a_t.len() + self.b.len()) * 4
    }

    /// `[vocab, rank]`: each token's column of A as a row.
    pub fn a_t(&self) -> &[f32] {
        &self.a_t
    }

    /// `[hidden, rank]`.
    pub fn b(&self) -> &[f32] {
        &self.b
    }
}

/// Which layer a saved copy is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layer {
    Embedding,
    LmHead,
}

/// A copy of an embedding layer the adapter file holds: its tensor's name
/// and the digest of its values widened to f32 ([`values_digest`]).
#[derive(Debug, Clone, PartialEq)]
pub struct BaseCopy {
    pub tensor: String,
    pub layer: Layer,
    pub digest: [u8; 32],
}

/// SHA-256 over f32 values' bits, little-endian, in order: how a saved
/// copy and the base's own rows are compared whatever dtype each is in.
pub fn values_digest(rows: impl Iterator<Item = f32>) -> [u8; 32] {
    let mut h = Sha256::new();
    for v in rows {
        h.update(v.to_bits().to_le_bytes());
    }
    h.finalize().into()
}

/// The adapter's LoRA outside the layers, and its copies of the layers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outer {
    pub embedding: Option<EmbeddingLora>,
    /// As one "expert" mapping hidden to the vocabulary.
    pub lm_head: Option<ExpertFactors>,
    pub copies: Vec<BaseCopy>,
    /// Rows the adapter replaces (`modules_to_save`,
    /// `trainable_token_indices`).
    pub saved: super::saved::SavedLayers,
}

impl Outer {
    pub fn bytes(&self) -> usize {
        self.embedding.as_ref().map_or(0, EmbeddingLora::bytes)
            + self.lm_head.as_ref().map_or(0, ExpertFactors::bytes)
            + self.saved.bytes()
    }

    /// Whether it changes anything outside the layers.
    pub fn is_empty(&self) -> bool {
        self.embedding.is_none()
            && self.lm_head.is_none()
            && self.saved.embedding.is_none()
            && self.saved.lm_head.is_none()
    }

    pub fn rank(&self) -> usize {
        let e = self.embedding.as_ref().map_or(0, |e| e.rank);
        e.max(self.lm_head.as_ref().map_or(0, |h| h.rank))
    }
}

/// Reads the embedding and lm_head LoRA `config` targets (checked by
/// `tensors::check` before).
pub(super) fn load(
    name: &str,
    config: &AdapterConfig,
    files: &WeightFiles,
    model: &ModelConfig,
) -> Result<Outer, AdapterError> {
    let invalid = |tensor: &str, reason: String| AdapterError::InvalidTensor {
        adapter: name.into(),
        tensor: tensor.into(),
        reason,
    };
    let (vocab, hidden) = (model.vocab_size, model.hidden_size);
    let mut out = Outer {
        saved: super::saved::load(name, config, files, model)?,
        ..Outer::default()
    };
    let expected = tensors::expected_outside_layers(config);
    let find = |holds: Holds, factor: Factor| {
        expected
            .iter()
            .find(|e| e.holds == holds && e.factor == factor)
            .map(|e| e.name.clone())
    };
    for holds in [Holds::Embedding, Holds::LmHead] {
        let (Some(a_name), Some(b_name), Some(copy)) = (
            find(holds, Factor::A),
            find(holds, Factor::B),
            find(holds, Factor::BaseCopy),
        ) else {
            continue;
        };
        let path = match holds {
            Holds::Embedding => "model.embed_tokens",
            _ => "lm_head",
        };
        let (r, alpha) = config.rank_and_alpha(name, path)?;
        let scale = if config.use_rslora {
            alpha / (r as f32).sqrt()
        } else {
            alpha / r as f32
        };
        let read = |tensor: &str, shape: &[usize]| {
            files
                .f32(tensor, shape)
                .map_err(|e| invalid(tensor, strip_file(e)))
        };
        match holds {
            Holds::Embedding => {
                let a = read(&a_name, &[r, vocab])?;
                let b = read(&b_name, &[hidden, r])?;
                let mut a_t = vec![0f32; vocab * r];
                for k in 0..r {
                    for t in 0..vocab {
                        a_t[t * r + k] = a[k * vocab + t];
                    }
                }
                out.embedding = Some(EmbeddingLora {
                    rank: r,
                    scale,
                    a_t,
                    b,
                });
            }
            _ => {
                let a = read(&a_name, &[r, hidden])?;
                let b = read(&b_name, &[vocab, r])?;
                out.lm_head = Some(ExpertFactors::new(r, scale, (hidden, vocab), &[a], &[b]));
            }
        }
        if files.contains(&copy) {
            out.copies.push(BaseCopy {
                digest: copy_digest(files, &copy, [vocab, hidden], &invalid)?,
                tensor: copy,
                layer: match holds {
                    Holds::Embedding => Layer::Embedding,
                    _ => Layer::LmHead,
                },
            });
        }
    }
    Ok(out)
}

/// [`values_digest`] of a saved copy, read as it is stored (f32, bf16 or
/// f16, widened exactly) without holding it widened.
fn copy_digest(
    files: &WeightFiles,
    tensor: &str,
    shape: [usize; 2],
    invalid: &dyn Fn(&str, String) -> AdapterError,
) -> Result<[u8; 32], AdapterError> {
    use safetensors::Dtype;
    let raw = files
        .raw(tensor)
        .map_err(|e| invalid(tensor, strip_file(e)))?;
    if raw.shape != shape {
        return Err(invalid(
            tensor,
            format!(
                "has shape {:?}, but the model's embedding layer is {shape:?}",
                raw.shape
            ),
        ));
    }
    let two = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
    Ok(match raw.dtype {
        Dtype::F32 => values_digest(
            raw.data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
        Dtype::BF16 => values_digest(
            raw.data
                .chunks_exact(2)
                .map(|b| half::bf16::from_bits(two(b)).to_f32()),
        ),
        Dtype::F16 => values_digest(
            raw.data
                .chunks_exact(2)
                .map(|b| half::f16::from_bits(two(b)).to_f32()),
        ),
        other => {
            return Err(invalid(
                tensor,
                format!("dtype {other:?} is not supported; expected F32, F16 or BF16"),
            ));
        }
    })
}
