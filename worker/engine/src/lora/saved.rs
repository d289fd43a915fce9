//! An adapter's own rows of the embedding layers: a layer saved whole
//! (`modules_to_save`) or some tokens' rows (`trainable_token_indices`),
//! used in place of the base's rows for that adapter's tokens and logits.
//! PEFT's forward for both is the base layer with those rows replaced
//! (`W.index_copy(0, indices, rows)`), so an embedding reads the row and
//! a logit is the row's dot product with the final hidden state.

use std::collections::HashMap;

use super::{AdapterConfig, AdapterError, strip_file};
use crate::model::{ModelConfig, WeightFiles};
use lorafleet_artifact::adapter::saved::{Layer, rows_tensor, whole_tensor};

/// Rows of `hidden` values, in the precision the adapter stored them.
#[derive(Debug, Clone, PartialEq)]
enum Values {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

/// A whole saved layer's values.
#[derive(Debug, Clone, Copy)]
pub enum WholeValues<'a> {
    F32(&'a [f32]),
    /// bf16 bits.
    Bf16(&'a [u16]),
}

/// The rows an adapter replaces in one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct Replaced {
    hidden: usize,
    values: Values,
    /// Token → its row; None when the layer is saved whole (row = token).
    index: Option<HashMap<u32, usize>>,
    /// The listed tokens in row order (empty when whole).
    tokens: Vec<u32>,
}

impl Replaced {
    /// The row that replaces `token`'s, if the adapter has one.
    fn row_of(&self, token: u32) -> Option<usize> {
        match &self.index {
            None => Some(token as usize),
            Some(index) => index.get(&token).copied(),
        }
    }

    fn read(&self, row: usize, out: &mut [f32]) {
        let at = row * self.hidden;
        match &self.values {
            Values::F32(v) => out.copy_from_slice(&v[at..at + self.hidden]),
            Values::Bf16(v) => {
                for (o, &b) in out.iter_mut().zip(&v[at..at + self.hidden]) {
                    *o = half::bf16::from_bits(b).to_f32();
                }
            }
        }
    }

    fn dot(&self, row: usize, h: &[f32]) -> f32 {
        let at = row * self.hidden;
        match &self.values {
            Values::F32(v) => v[at..at + self.hidden]
                .iter()
                .zip(h)
                .map(|(a, b)| a * b)
                .sum(),
            Values::Bf16(v) => v[at..at + self.hidden]
                .iter()
                .zip(h)
                .map(|(&a, b)| half::bf16::from_bits(a).to_f32() * b)
                .sum(),
        }
    }

    /// Writes `token`'s embedding into `out` when the adapter replaces
    /// it; false when the base's row stands.
    pub fn embed(&self, token: u32, out: &mut [f32]) -> bool {
        match self.row_of(token) {
            Some(r) => {
                self.read(r, out);
                true
            }
            None => false,
        }
    }

    /// Replaces the logits of the adapter's rows: every logit for a layer
    /// saved whole, the listed tokens' otherwise. `h` is the final
    /// hidden state (after the norm).
    pub fn logits(&self, h: &[f32], logits: &mut [f32]) {
        if self.index.is_none() {
            for (t, l) in logits.iter_mut().enumerate() {
                *l = self.dot(t, h);
            }
        } else {
            for (r, &t) in self.tokens.iter().enumerate() {
                logits[t as usize] = self.dot(r, h);
            }
        }
    }

    pub fn bytes(&self) -> usize {
        let values = match &self.values {
            Values::F32(v) => v.len() * 4,
            Values::Bf16(v) => v.len() * 2,
        };
        values + self.tokens.len() * 12
    }

    /// The rows it holds: a layer saved whole has one per token of its
    /// vocabulary (the base's, or one grown past it).
    pub fn rows(&self) -> usize {
        let values = match &self.values {
            Values::F32(v) => v.len(),
            Values::Bf16(v) => v.len(),
        };
        values / self.hidden.max(1)
    }

    /// Bytes the CPU backend's packed copy of a layer saved whole takes
    /// (its rows in panels of `NR`, bf16 inputs padded for AMX tiles), as
    /// `PackedLinear::pack` and `pack_bf16` allocate them.
    pub fn packed_bytes(&self) -> usize {
        use crate::backend::cpu::panels::NR;
        let rows = self.rows().div_ceil(NR) * NR;
        match &self.values {
            Values::F32(_) => rows * self.hidden * 4,
            Values::Bf16(_) => rows * crate::backend::cpu::amx::padded(self.hidden) * 2,
        }
    }

    /// Its rows widened to f32, `[rows, hidden]` row-major.
    pub fn values_f32(&self) -> Vec<f32> {
        match &self.values {
            Values::F32(v) => v.clone(),
            Values::Bf16(v) => v
                .iter()
                .map(|&b| half::bf16::from_bits(b).to_f32())
                .collect(),
        }
    }

    /// The tokens whose rows it replaces, in row order (empty when whole).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Whether the layer is saved whole.
    pub fn is_whole(&self) -> bool {
        self.index.is_none()
    }

    /// A layer saved whole, `[vocab, hidden]` row-major, in the precision
    /// stored: for a backend to pack as it packs the base's.
    pub fn whole(&self) -> Option<WholeValues<'_>> {
        if self.index.is_some() {
            return None;
        }
        Some(match &self.values {
            Values::F32(v) => WholeValues::F32(v),
            Values::Bf16(v) => WholeValues::Bf16(v),
        })
    }
}

/// The adapter's replaced rows of the embeddings and of the lm_head.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SavedLayers {
    pub embedding: Option<Replaced>,
    pub lm_head: Option<Replaced>,
}

impl SavedLayers {
    pub fn bytes(&self) -> usize {
        self.embedding.as_ref().map_or(0, Replaced::bytes)
            + self.lm_head.as_ref().map_or(0, Replaced::bytes)
    }

    /// The vocabulary of the adapter's own layers, where they are saved
    /// whole: the base's, or one grown past it (new tokens' rows).
    pub fn vocab(&self) -> Option<usize> {
        [&self.embedding, &self.lm_head]
            .into_iter()
            .flatten()
            .find(|l| l.is_whole())
            .map(Replaced::rows)
    }
}

/// Reads `modules_to_save` and `trainable_token_indices` (the tensors'
/// presence and row counts were checked by `tensors::check`). A layer
/// saved whole has the base's vocabulary or one grown past it (tokens
/// added and `resize_token_embeddings`, as Unsloth and Axolotl add chat
/// tokens): then both embed_tokens and lm_head must be saved, with the
/// same rows, so a new token is both read and written. A vocabulary
/// shrunk below the base's is refused by its tensor, as is a trained row
/// of a token the base has no row for. Where the model ties its lm_head to
/// its embeddings, the embeddings' trained rows are the lm_head's too
/// (PEFT ties them).
pub(super) fn load(
    name: &str,
    config: &AdapterConfig,
    files: &WeightFiles,
    model: &ModelConfig,
) -> Result<SavedLayers, AdapterError> {
    let invalid = |tensor: &str, reason: String| AdapterError::InvalidTensor {
        adapter: name.into(),
        tensor: tensor.into(),
        reason,
    };
    let (vocab, hidden) = (model.vocab_size, model.hidden_size);
    // The saved layers' vocabulary: the base's, or one grown past it.
    let mut saved_rows: Option<(usize, &str)> = None;
    for layer in [Layer::Embedding, Layer::LmHead] {
        if !config.saved.keeps_whole(layer) {
            continue;
        }
        let tensor = whole_tensor(layer);
        let raw = files
            .raw(tensor)
            .map_err(|e| invalid(tensor, strip_file(e)))?;
        let rows = match raw.shape[..] {
            [rows, h] if h == hidden => rows,
            _ => {
                return Err(invalid(
                    tensor,
                    format!("has shape {:?}, expected [rows, {hidden}]", raw.shape),
                ));
            }
        };
        if rows < vocab {
            return Err(invalid(
                tensor,
                format!(
                    "has {rows} rows, fewer than the base model's vocabulary of {vocab}: a \
                     vocabulary shrunk below the base's is not served"
                ),
            ));
        }
        if let Some((other_rows, other)) = saved_rows
            && other_rows != rows
        {
            return Err(invalid(
                tensor,
                format!(
                    "has {rows} rows, but {other} has {other_rows}: the saved layers disagree \
                     on the vocabulary"
                ),
            ));
        }
        saved_rows = Some((rows, tensor));
    }
    let rows_whole = saved_rows.map_or(vocab, |(rows, _)| rows);
    if rows_whole > vocab {
        // New tokens are read through embed_tokens and written through
        // lm_head: both must hold their rows.
        if let Some(missing) = [Layer::Embedding, Layer::LmHead]
            .into_iter()
            .find(|&l| !config.saved.keeps_whole(l))
        {
            return Err(AdapterError::Invalid {
                adapter: name.into(),
                field: "modules_to_save".into(),
                reason: format!(
                    "the saved layers grow the vocabulary to {rows_whole} rows (the base model \
                     has {vocab}), so {} must be saved too: a new token needs a row in both",
                    missing.module_name()
                ),
            });
        }
    }
    let read = |tensor: &str, rows: usize| -> Result<Values, AdapterError> {
        let shape = [rows, hidden];
        let raw = files
            .raw(tensor)
            .map_err(|e| invalid(tensor, strip_file(e)))?;
        if raw.shape != shape {
            return Err(invalid(
                tensor,
                format!("has shape {:?}, expected {shape:?}", raw.shape),
            ));
        }
        Ok(
            match files
                .bf16_bits(tensor, &shape)
                .map_err(|e| invalid(tensor, strip_file(e)))?
            {
                Some(bits) => Values::Bf16(bits),
                None => Values::F32(
                    files
                        .f32(tensor, &shape)
                        .map_err(|e| invalid(tensor, strip_file(e)))?,
                ),
            },
        )
    };
    // `AdapterConfig::for_model` refused rows of a tied lm_head's own.
    let tied = model.tie_word_embeddings;
    let mut out = SavedLayers::default();
    for layer in [Layer::Embedding, Layer::LmHead] {
        let replaced = if config.saved.keeps_whole(layer) {
            Replaced {
                hidden,
                values: read(whole_tensor(layer), rows_whole)?,
                index: None,
                tokens: Vec::new(),
            }
        } else if let Some(tokens) = config.saved.rows_of(layer) {
            let tensor = rows_tensor(layer);
            if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(AdapterError::Invalid {
                    adapter: name.into(),
                    field: "trainable_token_indices".into(),
                    reason: format!("token {bad} is not below the base model's vocab_size {vocab}"),
                });
            }
            Replaced {
                hidden,
                values: read(tensor, tokens.len())?,
                index: Some(tokens.iter().enumerate().map(|(r, &t)| (t, r)).collect()),
                tokens: tokens.to_vec(),
            }
        } else {
            continue;
        };
        match layer {
            Layer::Embedding => out.embedding = Some(replaced),
            Layer::LmHead => out.lm_head = Some(replaced),
        }
    }
    if tied
        && out.lm_head.is_none()
        && let Some(e) = out.embedding.as_ref().filter(|e| !e.is_whole())
    {
        out.lm_head = Some(e.clone());
    }
    Ok(out)
}
