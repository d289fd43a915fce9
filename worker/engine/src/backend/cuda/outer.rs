//! LoRA outside the layers on the GPU: on the token embeddings (PEFT's
//! `lora.Embedding`, a token's row plus `s · B · A[:, token]`, after
//! Gemma's scale as PEFT wraps the scaled embedding) and on the lm_head
//! (`logits + s · B · A · h`, before Gemma's final soft-cap), each applied
//! to its adapter's rows alone.
//!
//! A slot's factors are their own allocation, made when the slot is
//! written (as expert LoRA's are): the embedding's `Aᵀ [vocab, rank]` and
//! `B [hidden, rank]` as the host tier holds them, the lm_head's A and B
//! panels as the host tier packs them (read by the expert-LoRA kernels as
//! one expert). A step with such a slot runs its launches eagerly (never
//! from a CUDA graph): which rows get them is the step's own, planned on
//! the host ([`OuterStep`]).

use cudarc::driver::CudaSlice;

use super::device::{Arg, Device, cuda};
use crate::backend::{Segment, StepBatch};
use crate::error::Result;
use crate::lora::HostAdapter;

/// The embedding LoRA of one slot on the device.
struct EmbedFactors {
    a_t: CudaSlice<f32>,
    b: CudaSlice<f32>,
    rank: usize,
    scale: f32,
}

/// One slot's LoRA outside the layers.
#[derive(Default)]
struct OuterSlot {
    embed: Option<EmbedFactors>,
    /// The lm_head LoRA's A and B panels; their addresses, rank and scale
    /// are in the table.
    head: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
}

pub(super) struct OuterSlots {
    slots: Vec<OuterSlot>,
    /// The lm_head LoRA's table, mirrored on the host: `slots` A addresses
    /// (u64), `slots` B addresses (u64), `slots` ranks (i32) and `slots`
    /// scales (f32), as the expert-LoRA kernels read them.
    table_host: Vec<u8>,
    table: CudaSlice<u8>,
    /// The groups of the step being launched, uploaded as it is planned;
    /// grown (after the stream drains) when a step has more.
    groups: Option<CudaSlice<i32>>,
}

/// What one step does outside the layers: the segments whose slot has
/// embedding LoRA, and the groups of logit rows (first row, end row, slot,
/// 0) whose slot has lm_head LoRA, with the longest group's rows.
#[derive(Debug, Default, Clone)]
pub(super) struct OuterStep {
    embed: Vec<Segment>,
    head: Vec<i32>,
    longest: usize,
    /// Where `head` was uploaded.
    groups: u64,
}

impl OuterStep {
    pub fn is_empty(&self) -> bool {
        self.embed.is_empty() && self.head.is_empty()
    }
}

impl OuterSlots {
    pub fn new(dev: &Device, slots: usize) -> Result<OuterSlots> {
        let bytes = 24 * slots;
        Ok(OuterSlots {
            slots: (0..slots).map(|_| OuterSlot::default()).collect(),
            table_host: vec![0; bytes],
            table: dev
                .stream
                .alloc_zeros::<u8>(bytes.max(1))
                .map_err(cuda("allocating the lm_head LoRA table"))?,
            groups: None,
        })
    }

    /// Puts `adapter`'s embedding and lm_head LoRA into `slot` (on the
    /// compute stream: after every step queued before, which never use a
    /// slot being written), or empties the slot's if it has none.
    pub fn write(&mut self, dev: &Device, slot: usize, adapter: &HostAdapter) -> Result<()> {
        let up = |v: &[f32]| {
            dev.stream
                .clone_htod(v)
                .map_err(cuda("copying an adapter's embedding or lm_head LoRA"))
        };
        let outer = &adapter.outer;
        let embed = match &outer.embedding {
            Some(e) => Some(EmbedFactors {
                a_t: up(e.a_t())?,
                b: up(e.b())?,
                rank: e.rank,
                scale: e.scale,
            }),
            None => None,
        };
        let (head, entry) = match &outer.lm_head {
            Some(h) => {
                let (a, b) = h.panels(0);
                let (a, b) = (up(a)?, up(b)?);
                let entry = (dev.p(&a), dev.p(&b), h.rank as i32, h.scale);
                (Some((a, b)), entry)
            }
            None => (None, (0, 0, 0, 0.0)),
        };
        self.slots[slot] = OuterSlot { embed, head };
        self.set_entry(slot, entry);
        self.upload_table(dev)
    }

    pub fn clear(&mut self, dev: &Device, slot: usize) -> Result<()> {
        if self.slots[slot].embed.is_none() && self.slots[slot].head.is_none() {
            return Ok(());
        }
        self.slots[slot] = OuterSlot::default();
        self.set_entry(slot, (0, 0, 0, 0.0));
        self.upload_table(dev)
    }

    fn set_entry(&mut self, slot: usize, entry: (u64, u64, i32, f32)) {
        let (n, t) = (self.slots.len(), &mut self.table_host);
        t[8 * slot..][..8].copy_from_slice(&entry.0.to_le_bytes());
        t[8 * (n + slot)..][..8].copy_from_slice(&entry.1.to_le_bytes());
        t[16 * n + 4 * slot..][..4].copy_from_slice(&entry.2.to_le_bytes());
        t[20 * n + 4 * slot..][..4].copy_from_slice(&entry.3.to_le_bytes());
    }

    fn upload_table(&mut self, dev: &Device) -> Result<()> {
        dev.stream
            .memcpy_htod(&self.table_host, &mut self.table)
            .map_err(cuda("uploading the lm_head LoRA table"))
    }

    /// The step's work outside the layers, from its segments and its logit
    /// rows (token indices, in order); its lm_head groups uploaded on the
    /// compute stream (after the steps queued before, which read the last
    /// ones).
    pub fn plan(
        &mut self,
        dev: &Device,
        batch: &StepBatch<'_>,
        rows: &[usize],
    ) -> Result<OuterStep> {
        let mut step = OuterStep::default();
        if self
            .slots
            .iter()
            .all(|s| s.embed.is_none() && s.head.is_none())
        {
            return Ok(step);
        }
        step.embed = batch
            .segments
            .iter()
            .filter(|s| self.slots[s.slot].embed.is_some())
            .copied()
            .collect();
        let head_slot =
            |i: usize| batch.token_slot[rows[i]].filter(|&s| self.slots[s].head.is_some());
        let mut i = 0;
        while i < rows.len() {
            let Some(slot) = head_slot(i) else {
                i += 1;
                continue;
            };
            let first = i;
            while i < rows.len() && head_slot(i) == Some(slot) {
                i += 1;
            }
            step.head.extend([first as i32, i as i32, slot as i32, 0]);
            step.longest = step.longest.max(i - first);
        }
        if step.head.is_empty() {
            return Ok(step);
        }
        let err = cuda("uploading the lm_head LoRA groups");
        if self
            .groups
            .as_ref()
            .is_none_or(|g| g.len() < step.head.len())
        {
            // The old buffer may still be read by a step in flight.
            dev.stream.synchronize().map_err(&err)?;
            self.groups = Some(
                dev.stream
                    .alloc_zeros::<i32>(step.head.len().max(64))
                    .map_err(&err)?,
            );
        }
        let groups = self.groups.as_mut().expect("allocated above");
        let mut dst = groups.slice_mut(0..step.head.len());
        dev.stream.memcpy_htod(&step.head, &mut dst).map_err(err)?;
        step.groups = dev.p(groups);
        Ok(step)
    }

    /// Adds each planned segment's embedding LoRA into `hidden` (`[n, d]`
    /// f32), the token ids at `tokens`.
    pub fn embed(
        &self,
        dev: &Device,
        step: &OuterStep,
        tokens: u64,
        hidden: u64,
        d: usize,
    ) -> Result<()> {
        for seg in &step.embed {
            let Some(e) = &self.slots[seg.slot].embed else {
                continue;
            };
            dev.launch(
                "embed_lora",
                ((seg.end - seg.start) as u32, 1, 1),
                256,
                &[
                    Arg::Ptr(tokens),
                    Arg::I32(seg.start as i32),
                    Arg::Ptr(hidden),
                    Arg::I32(d as i32),
                    Arg::Ptr(dev.p(&e.a_t)),
                    Arg::Ptr(dev.p(&e.b)),
                    Arg::I32(e.rank as i32),
                    Arg::F32(e.scale),
                ],
            )?;
        }
        Ok(())
    }

    /// Adds each planned group's lm_head LoRA into `logits` (`[rows,
    /// vocab]` f32) from the normed rows `normed` (`[rows, d]` f32), through
    /// the expert-LoRA pair, `t` (`[rows, max_rank]` f32) between them.
    #[allow(clippy::too_many_arguments)]
    pub fn head(
        &self,
        dev: &Device,
        step: &OuterStep,
        (normed, d): (u64, usize),
        (logits, vocab): (u64, usize),
        t: u64,
    ) -> Result<()> {
        if step.head.is_empty() {
            return Ok(());
        }
        let n = self.slots.len() as u64;
        let table = dev.p(&self.table);
        let (a_ptrs, b_ptrs, ranks, scales) =
            (table, table + 8 * n, table + 16 * n, table + 20 * n);
        let grid = (step.longest as u32, (step.head.len() / 4) as u32, 1);
        let groups = step.groups;
        dev.launch(
            "moe_lora_shrink",
            grid,
            256,
            &[
                Arg::Ptr(normed),
                Arg::I32(d as i32),
                Arg::Ptr(groups),
                Arg::Ptr(a_ptrs),
                Arg::Ptr(ranks),
                Arg::Ptr(t),
            ],
        )?;
        dev.launch(
            "moe_lora_expand",
            grid,
            256,
            &[
                Arg::Ptr(t),
                Arg::I32(vocab as i32),
                Arg::Ptr(groups),
                Arg::Ptr(b_ptrs),
                Arg::Ptr(ranks),
                Arg::Ptr(scales),
                Arg::Ptr(logits),
            ],
        )
    }
}
