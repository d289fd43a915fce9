//! The compute backends behind one trait. The CPU backend is the exact
//! reference; a CUDA backend implements the same trait with the same slot
//! and KV layouts.

pub mod cpu;
pub mod cuda;

use crate::error::{EngineError, Result};
use crate::lora::HostAdapter;
use crate::model::ModelConfig;

/// One sequence's part of a step.
#[derive(Debug, Clone)]
pub struct SeqStep<'a> {
    /// Index of this sequence's first token in [`StepBatch::tokens`]. A
    /// sequence's tokens are contiguous.
    pub start: usize,
    /// How many new tokens this sequence feeds in this step.
    pub len: usize,
    /// The position of its first new token (tokens before it are in the
    /// KV cache already).
    pub first_position: usize,
    /// KV blocks holding positions `0..first_position + len`.
    pub block_table: &'a [u32],
    /// How many of this sequence's last tokens want logits: 0 (a prefill
    /// chunk that does not reach the end), 1 (the next token is chosen
    /// from the last), or more (prompt log probabilities).
    pub logit_rows: usize,
    /// The sequence rotates by the model's long RoPE frequencies
    /// ([`crate::model::rope::Rope::long_after`]): its length is past
    /// LongRoPE's pretraining context.
    pub long_rope: bool,
    /// The sequence's prompt length: dynamic NTK RoPE rotates a token at
    /// position `p` by the frequencies of `max(prompt_len, p + 1)`
    /// ([`crate::model::rope::Rope::dynamic_inv_freq`]).
    pub prompt_len: usize,
    /// The sequence's ring for the sliding layers (see
    /// [`BackendShape::ring_len`]); empty where there is none.
    pub ring: &'a [u32],
}

/// A contiguous run of tokens that use one adapter slot: the SGMV segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub slot: usize,
    pub start: usize,
    pub end: usize,
}

/// Everything one forward step needs. Sequences are ordered by adapter slot
/// (base-model sequences first), so each slot's tokens form one segment.
#[derive(Debug, Clone, Default)]
pub struct StepBatch<'a> {
    pub tokens: Vec<u32>,
    pub seqs: Vec<SeqStep<'a>>,
    /// The adapter slot of each token, or None for the base model.
    pub token_slot: Vec<Option<usize>>,
    /// Runs of tokens sharing one slot; base-model tokens are in none.
    pub segments: Vec<Segment>,
    /// Logits per row, where a row's adapter has a vocabulary grown past
    /// the base model's (its own embed_tokens and lm_head of more rows):
    /// the widest of the step's rows. Each row's logits past its own
    /// vocabulary are -inf. 0 (and anything below the model's
    /// `vocab_size`) is the model's `vocab_size`.
    pub width: usize,
}

impl<'a> StepBatch<'a> {
    /// Appends one sequence's tokens.
    pub fn push(
        &mut self,
        tokens: &[u32],
        first_position: usize,
        block_table: &'a [u32],
        slot: Option<usize>,
        want_logits: bool,
    ) {
        self.push_rows(
            tokens,
            first_position,
            block_table,
            slot,
            usize::from(want_logits),
        );
    }

    /// [`StepBatch::push`], with logits for the last `logit_rows` tokens
    /// (at most `tokens.len()`).
    pub fn push_rows(
        &mut self,
        tokens: &[u32],
        first_position: usize,
        block_table: &'a [u32],
        slot: Option<usize>,
        logit_rows: usize,
    ) {
        debug_assert!(logit_rows <= tokens.len());
        let start = self.tokens.len();
        self.tokens.extend_from_slice(tokens);
        self.token_slot
            .extend(std::iter::repeat_n(slot, tokens.len()));
        self.seqs.push(SeqStep {
            start,
            len: tokens.len(),
            first_position,
            block_table,
            logit_rows: logit_rows.min(tokens.len()),
            long_rope: false,
            prompt_len: 0,
            ring: &[],
        });
    }

    /// Builds the segments from `token_slot`: one per run of equal slots.
    pub fn finish(&mut self) {
        self.segments.clear();
        let mut t = 0;
        while t < self.token_slot.len() {
            let slot = self.token_slot[t];
            let mut end = t + 1;
            while end < self.token_slot.len() && self.token_slot[end] == slot {
                end += 1;
            }
            if let Some(slot) = slot {
                self.segments.push(Segment {
                    slot,
                    start: t,
                    end,
                });
            }
            t = end;
        }
    }

    /// Logits per row: [`StepBatch::width`], at least the model's
    /// `vocab_size`.
    pub fn logits_width(&self, vocab_size: usize) -> usize {
        self.width.max(vocab_size)
    }

    /// Checks what every backend relies on: token ids below the vocabulary
    /// (the widest of the step's: a backend checks each slot's own), and
    /// block tables (and rings, where the sliding layers keep them) long
    /// enough for each sequence's positions.
    pub fn check(&self, config: &ModelConfig, shape: &BackendShape) -> Result<()> {
        let block_size = shape.block_size;
        let vocab = self.logits_width(config.vocab_size);
        if let Some(t) = self.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::request(
                lorafleet_domain::generation::Field::Prompt,
                format!("token id {t} is not below vocab_size {vocab}"),
            ));
        }
        for s in &self.seqs {
            let needed = (s.first_position + s.len).div_ceil(block_size);
            if s.block_table.len() < needed {
                return Err(EngineError::Backend(format!(
                    "a block table holds {} blocks, {needed} needed",
                    s.block_table.len()
                )));
            }
            if shape.ring_len > 0 && s.ring.len() < needed.min(shape.ring_len) {
                return Err(EngineError::Backend(format!(
                    "a ring holds {} blocks, {} needed",
                    s.ring.len(),
                    needed.min(shape.ring_len)
                )));
            }
        }
        Ok(())
    }

    /// The token index of every token that wants logits, in sequence
    /// order: the rows a step's logits come from.
    pub fn logit_rows(&self) -> Vec<usize> {
        self.seqs
            .iter()
            .flat_map(|s| s.start + s.len - s.logit_rows..s.start + s.len)
            .collect()
    }

    /// The number of distinct adapter slots used.
    pub fn distinct_adapters(&self) -> usize {
        let mut slots: Vec<usize> = self.segments.iter().map(|s| s.slot).collect();
        slots.sort_unstable();
        slots.dedup();
        slots.len()
    }
}

/// Sizes fixed when a backend is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendShape {
    /// Adapter slots in the device tier.
    pub slots: usize,
    /// The rank every slot is sized for.
    pub max_lora_rank: usize,
    /// KV cache blocks.
    pub kv_blocks: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// A model whose layers are of both kinds (Gemma 2 and 3) keeps its
    /// sliding layers' keys and values in a ring of this many blocks per
    /// sequence, reused as the window moves: position `p` lives in ring
    /// block `(p / block_size) % ring_len` ([`SeqStep::ring`]). 0: the
    /// sliding layers use the block table as the global ones do.
    pub ring_len: usize,
    /// Ring blocks in all: every running sequence's ring.
    pub ring_blocks: usize,
}

/// Checks that `adapter` may be written into `slot` of a backend of `shape`.
pub(crate) fn check_slot_write(
    shape: &BackendShape,
    slot: usize,
    adapter: &HostAdapter,
) -> Result<()> {
    if slot >= shape.slots {
        return Err(EngineError::Backend(format!("slot {slot} is out of range")));
    }
    if adapter.rank > shape.max_lora_rank {
        return Err(EngineError::Backend(format!(
            "adapter {} has rank {} above the slot rank {}",
            adapter.name, adapter.rank, shape.max_lora_rank
        )));
    }
    Ok(())
}

/// What every backend checks of a step whose adapters may have their own
/// vocabulary (`modules_to_save` with a grown one): no logit row's adapter
/// writes more logits (`head_rows` of its slot) than the step is `width`
/// wide, and every token id is below the rows its slot embeds
/// (`embed_rows`: the base's vocabulary, or an adapter's own).
pub(crate) fn check_own_vocab(
    batch: &StepBatch<'_>,
    width: usize,
    head_rows: impl Fn(Option<usize>) -> usize,
    embed_rows: impl Fn(Option<usize>) -> usize,
) -> Result<()> {
    if let Some(own) = batch
        .logit_rows()
        .iter()
        .map(|&t| head_rows(batch.token_slot[t]))
        .find(|&own| own > width)
    {
        return Err(EngineError::Backend(format!(
            "a row's adapter writes {own} logits; the step's are {width} wide"
        )));
    }
    for (t, &tok) in batch.tokens.iter().enumerate() {
        // An id past the base's needs its adapter's own (grown) rows.
        let rows = embed_rows(batch.token_slot[t]);
        if tok as usize >= rows {
            return Err(EngineError::request(
                lorafleet_domain::generation::Field::Prompt,
                format!("token id {tok} is not below vocab_size {rows}"),
            ));
        }
    }
    Ok(())
}

/// A compute device holding the base weights, the KV cache and the adapter
/// slots.
pub trait Backend: Send {
    /// "cpu" or "cuda".
    fn name(&self) -> &'static str;
    /// A human-readable device name.
    fn device_name(&self) -> String;
    /// Bytes the base model's weights take in the backend's memory, as
    /// held (a quantized checkpoint's codes where the backend keeps them).
    fn weight_bytes(&self) -> u64;
    /// What one KV block and one adapter slot take, for a memory budget
    /// they share ([`crate::budget`]); None where the backend's memory is
    /// divided otherwise (the CUDA backend's plan).
    fn memory_units(&self) -> Option<crate::budget::MemoryUnits> {
        None
    }
    /// How device memory is divided, planned at start; None where there
    /// is no separate device memory.
    fn memory_plan(&self) -> Option<cuda::plan::MemoryPlan> {
        None
    }
    /// Device memory in use and in all, now; None where there is no
    /// separate device memory.
    fn device_memory(&self) -> Option<DeviceMemory> {
        None
    }
    fn config(&self) -> &ModelConfig;
    fn shape(&self) -> BackendShape;
    /// Copies an adapter into a device slot, replacing what was there.
    fn write_slot(&mut self, slot: usize, adapter: &HostAdapter) -> Result<()>;
    /// Empties a device slot.
    fn clear_slot(&mut self, slot: usize) -> Result<()>;
    /// Whether the last write into `slot` has reached the device: a step
    /// using the slot now would not wait for its copy. Backends whose
    /// writes complete before returning say true.
    fn slot_ready(&self, slot: usize) -> bool {
        let _ = slot;
        true
    }
    /// Runs one step: writes the new tokens' keys and values into the KV
    /// cache and returns logits, [`StepBatch::logits_width`] per row of
    /// [`StepBatch::logit_rows`], in that order.
    fn forward(&mut self, batch: &StepBatch<'_>) -> Result<Vec<f32>>;
    /// Whether [`Backend::forward_sampled`] is available: the backend
    /// draws tokens where the logits are, and they never travel to the
    /// host.
    fn samples_on_device(&self) -> bool {
        false
    }
    /// Runs one step as [`Backend::forward`] and draws one token per
    /// sequence that wants logits, in sequence order, each as its `rows`
    /// entry says.
    fn forward_sampled(
        &mut self,
        batch: &StepBatch<'_>,
        rows: &[DeviceSample],
    ) -> Result<Vec<u32>> {
        let _ = (batch, rows);
        Err(EngineError::Backend(format!(
            "the {} backend does not sample on its device",
            self.name()
        )))
    }
    /// How decode steps ran through captured graphs; None where the
    /// backend has none.
    fn graph_counters(&self) -> Option<GraphCounters> {
        None
    }
}

/// How a backend's decode steps ran: replayed from a captured graph, or
/// launched one kernel at a time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphCounters {
    /// Graphs captured and held (one per decode batch size seen twice).
    pub graphs: usize,
    /// Decode steps replayed from a graph.
    pub replays: u64,
    /// Decode steps launched kernel by kernel (graphs off, a batch size's
    /// first step, or a failed capture).
    pub eager_decode_steps: u64,
    /// Captures that failed (that batch size then runs without a graph).
    pub failed_captures: u64,
}

/// A device's memory at one moment, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    pub used: u64,
    pub total: u64,
}

/// How one row's next token is drawn on the device: `u` is the request's
/// own uniform draw in [0, 1) from its seeded stream, taken on the host,
/// so the token does not depend on what else is in the batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceSample {
    /// 0 is greedy: the highest logit, the lowest id among ties.
    pub temperature: f32,
    /// 0 is off.
    pub top_k: usize,
    /// 1 is off.
    pub top_p: f32,
    pub u: f32,
}
