//! LoRA outside the layers on the CPU backend: the slot's embedding and
//! lm_head LoRA (applied in `forward`), and the check that an adapter's
//! saved copies of those layers are this base's own values.

use super::{CpuBackend, Embedding, panels};
use crate::error::{EngineError, Result};
use crate::lora::HostAdapter;

impl CpuBackend {
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
