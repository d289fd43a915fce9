//! LoRA outside the layers on the CPU backend: the slot's embedding and
//! lm_head LoRA (applied in `forward`), and the check that an adapter's
//! saved copies of those layers are this base's own values.

use std::sync::Arc;

use super::{CpuBackend, Embedding, PackedLinear, StepBatch, panels};
use crate::error::{EngineError, Result};
use crate::lora::HostAdapter;
use crate::lora::saved::WholeValues;

impl CpuBackend {
    /// The adapter's own lm_head (`modules_to_save`), packed for the same
    /// kernel as the base's, when it saves one whole.
    pub(super) fn pack_saved_head(&self, adapter: &HostAdapter) -> Option<Arc<PackedLinear>> {
        let d = self.config.hidden_size;
        let head = adapter.outer.saved.lm_head.as_ref()?.whole()?;
        // Its own rows: the base's vocabulary, or one grown past it.
        Some(Arc::new(match head {
            WholeValues::F32(w) => PackedLinear::pack(w, None, d, w.len() / d),
            WholeValues::Bf16(w) => PackedLinear::pack_bf16(w, None, d, w.len() / d),
        }))
    }

    /// The logits a token's slot writes: its adapter's own lm_head's rows
    /// where it has one, the base's vocabulary otherwise.
    pub(super) fn head_rows(&self, slot: Option<usize>) -> usize {
        slot.and_then(|s| self.head_slots[s].as_ref())
            .map_or(self.config.vocab_size, |h| h.fan_out())
    }

    /// The token ids a token's slot has embeddings for: its adapter's own
    /// embed_tokens' rows where it saved the layer whole, the base's
    /// vocabulary otherwise.
    pub(super) fn embed_rows(&self, slot: Option<usize>) -> usize {
        self.outer_of(slot)
            .and_then(|o| o.saved.embedding.as_ref())
            .filter(|e| e.is_whole())
            .map_or(self.config.vocab_size, |e| e.rows())
    }

    /// The base lm_head's logits `[rows, width]` for the rows whose slot
    /// has no lm_head of its own, in each row's first `vocab_size` (the
    /// rest, and the other rows, are left zero for
    /// [`CpuBackend::saved_head_logits`] and the padding).
    pub(super) fn base_head_logits(
        &self,
        batch: &StepBatch<'_>,
        rows: &[usize],
        normed: &[f32],
        width: usize,
    ) -> Vec<f32> {
        let (v, d) = (self.config.vocab_size, self.config.hidden_size);
        let own =
            |i: usize| batch.token_slot[rows[i]].is_some_and(|s| self.head_slots[s].is_some());
        if width == v && !(0..rows.len()).any(own) {
            let [logits] = self.lm_head.forward_split(normed, rows.len(), [v]);
            return logits;
        }
        let base: Vec<usize> = (0..rows.len()).filter(|&i| !own(i)).collect();
        let mut logits = vec![0f32; rows.len() * width];
        if base.is_empty() {
            return logits;
        }
        let x: Vec<f32> = base
            .iter()
            .flat_map(|&i| normed[i * d..(i + 1) * d].iter().copied())
            .collect();
        let [out] = self.lm_head.forward_split(&x, base.len(), [v]);
        for (k, &i) in base.iter().enumerate() {
            logits[i * width..i * width + v].copy_from_slice(&out[k * v..(k + 1) * v]);
        }
        logits
    }

    /// Replaces the logits of the rows whose slot has its own lm_head:
    /// each slot's rows gathered and run through its packed head at once,
    /// into each row's first rows of `width`.
    pub(super) fn saved_head_logits(
        &self,
        batch: &StepBatch<'_>,
        rows: &[usize],
        normed: &[f32],
        width: usize,
        logits: &mut [f32],
    ) {
        let d = self.config.hidden_size;
        for (slot, head) in self.head_slots.iter().enumerate() {
            let Some(head) = head else { continue };
            let mine: Vec<usize> = (0..rows.len())
                .filter(|&i| batch.token_slot[rows[i]] == Some(slot))
                .collect();
            if mine.is_empty() {
                continue;
            }
            let x: Vec<f32> = mine
                .iter()
                .flat_map(|&i| normed[i * d..(i + 1) * d].iter().copied())
                .collect();
            let v = head.fan_out();
            let mut out = vec![0f32; mine.len() * v];
            head.forward(&x, mine.len(), &mut out);
            for (k, &i) in mine.iter().enumerate() {
                logits[i * width..i * width + v].copy_from_slice(&out[k * v..(k + 1) * v]);
            }
        }
    }

    /// The embedding and lm_head LoRA of a token's slot, if any.
    pub(super) fn outer_of(&self, slot: Option<usize>) -> Option<&crate::lora::Outer> {
        slot.and_then(|s| self.outer_slots[s].as_deref())
    }

    /// An adapter's saved copies of the embedding layers must be this
    /// base's own values (PEFT loads them over the model's).
    pub(super) fn check_copies(&self, adapter: &HostAdapter) -> Result<()> {
        use crate::lora::outer::{Layer, values_digest};
        let (v, d) = (self.config.vocab_size, self.config.hidden_size);
        for copy in &adapter.outer.copies {
            let base = match copy.layer {
                Layer::Embedding => self.base_digests[0].get_or_init(|| {
                    let mut row = vec![0f32; d];
                    values_digest((0..v).flat_map(|tok| {
                        match &self.embed {
                            Embedding::F32(table) => row.copy_from_slice(&table[tok * d..][..d]),
                            Embedding::Bf16(table) => {
                                for (x, &b) in row.iter_mut().zip(&table[tok * d..][..d]) {
                                    *x = panels::bf16_to_f32(b);
                                }
                            }
                            Embedding::Head => self.lm_head.row(tok, &mut row),
                        }
                        row.clone()
                    }))
                }),
                Layer::LmHead => self.base_digests[1].get_or_init(|| {
                    let mut row = vec![0f32; d];
                    values_digest((0..v).flat_map(|tok| {
                        self.lm_head.row(tok, &mut row);
                        row.clone()
                    }))
                }),
            };
            if *base != copy.digest {
                return Err(EngineError::Adapter(
                    lorafleet_artifact::adapter::AdapterError::InvalidTensor {
                        adapter: adapter.name.clone(),
                        tensor: copy.tensor.clone(),
                        reason: "is not the base model's own layer (a resized or retrained \
                                 vocabulary, modules_to_save, is not supported)"
                            .into(),
                    },
                ));
            }
        }
        Ok(())
    }
}
