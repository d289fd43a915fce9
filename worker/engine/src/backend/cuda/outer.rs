//! What an adapter changes outside the layers, on the GPU, each applied to
//! its adapter's rows alone: LoRA on the token embeddings (PEFT's
//! `lora.Embedding`, a token's row plus `s · B · A[:, token]`, both times
//! Gemma's embedding scale, as PEFT scales the LoRA output by it) and on
//! the lm_head
//! (`logits + s · B · A · h`), and its own rows of those layers
//! (`modules_to_save`: a layer saved whole; `trainable_token_indices`: some
//! tokens' rows) in place of the base's. A step's logits are, in order:
//! the base lm_head's, an own whole lm_head's for its rows (a GEMM), the
//! lm_head LoRA added, an own token rows' logits put in, then Gemma's
//! final soft-cap, as on the CPU backend.
//!
//! A slot's tensors are one allocation, made and copied from page-locked
//! memory on the copy stream when the slot is written (as expert LoRA's
//! are): the embedding LoRA's `Aᵀ [vocab, rank]`
//! and `B [hidden, rank]` as the host tier holds them, the lm_head LoRA's
//! A and B panels as the host tier packs them (read by the expert-LoRA
//! kernels as one expert), own embedding rows and a whole own lm_head in
//! the weights' type (the lm_head for the base's GEMM), own lm_head rows
//! of some tokens in f32. A step with such a slot runs its
//! launches eagerly (never from a CUDA graph): which rows get them is the
//! step's own, planned on the host ([`OuterStep`]).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::Dtype;
use super::device::{Arg, Device, cuda};
use super::staging::Staging;
use crate::backend::{Segment, StepBatch};
use crate::error::Result;
use crate::lora::HostAdapter;
use crate::lora::saved::Replaced;

/// The embedding LoRA of one slot on the device (addresses into the
/// slot's allocation, as are all below).
struct EmbedFactors {
    a_t: u64,
    b: u64,
    rank: usize,
    scale: f32,
}

/// An adapter's own rows of a layer on the device: `[rows, hidden]` (the
/// embeddings' in the weights' type, as the base's table; the lm_head's in
/// f32), and the tokens they replace (None: the layer saved whole, row =
/// token).
struct SavedRows {
    values: u64,
    ids: Option<u64>,
    /// Listed tokens (0 when whole).
    count: usize,
    /// Rows held: a whole layer's vocabulary (the base's or one grown
    /// past it).
    rows: usize,
}

/// An adapter's own lm_head: saved whole (`[rows, hidden]` in the
/// weights' type, run as the base's is; rows the base's vocabulary or one
/// grown past it), or some tokens' rows.
enum SavedHead {
    Whole(u64, usize),
    Rows(SavedRows),
}

/// One slot's changes outside the layers.
#[derive(Default)]
struct OuterSlot {
    /// Every tensor below, in one allocation; None for a slot with none.
    data: Option<CudaSlice<u8>>,
    embed: Option<EmbedFactors>,
    /// The lm_head LoRA's A and B panels; their addresses, rank and scale
    /// are in the table.
    head: Option<(u64, u64)>,
    saved_embed: Option<SavedRows>,
    saved_head: Option<SavedHead>,
}

impl OuterSlot {
    fn is_empty(&self) -> bool {
        self.data.is_none()
    }

    /// Whether the slot changes its rows' logits.
    fn heads(&self) -> bool {
        self.head.is_some() || self.saved_head.is_some()
    }
}

pub(super) struct OuterSlots {
    slots: Vec<OuterSlot>,
    /// The weights' type (an own whole lm_head's).
    dtype: Dtype,
    /// The base's vocabulary.
    vocab: usize,
    /// A step's logits as wide as its widest row, when an adapter's grown
    /// vocabulary makes it wider than the base's: grown (after the stream
    /// drains) as steps need.
    wide: Option<CudaSlice<f32>>,
    /// The lm_head LoRA's table, mirrored on the host: `slots` A addresses
    /// (u64), `slots` B addresses (u64), `slots` ranks (i32) and `slots`
    /// scales (f32), as the expert-LoRA kernels read them.
    table_host: Vec<u8>,
    table: CudaSlice<u8>,
    /// The lm_head LoRA groups of the step being launched, uploaded as it
    /// is planned; grown (after the stream drains) when a step has more.
    groups: Option<CudaSlice<i32>>,
    /// Page-locked staging for slot writes.
    staging: Staging<u8>,
}

/// What one step does outside the layers: the segments whose slot changes
/// their embeddings, the runs of logit rows (slot, first row, end row)
/// whose slot changes their logits, and of those the lm_head LoRA's groups
/// (first row, end row, slot, 0) with the longest group's rows.
#[derive(Debug, Default, Clone)]
pub(super) struct OuterStep {
    embed: Vec<Segment>,
    rows: Vec<(usize, usize, usize)>,
    head: Vec<i32>,
    longest: usize,
    /// Where `head` was uploaded.
    groups: u64,
    /// The step's logits' width where it is wider than the base's
    /// vocabulary, and where they go (`[rows, width]`); 0 otherwise.
    width: usize,
    wide: u64,
}

impl OuterStep {
    pub fn is_empty(&self) -> bool {
        self.embed.is_empty() && self.rows.is_empty()
    }

    /// `(width, address)` of the step's logits where they are wider than
    /// the base's vocabulary.
    pub fn wide(&self) -> Option<(usize, u64)> {
        (self.width > 0).then_some((self.width, self.wide))
    }
}

impl OuterSlots {
    pub fn new(dev: &Device, slots: usize, dtype: Dtype, vocab: usize) -> Result<OuterSlots> {
        let bytes = 24 * slots;
        Ok(OuterSlots {
            slots: (0..slots).map(|_| OuterSlot::default()).collect(),
            dtype,
            vocab,
            wide: None,
            table_host: vec![0; bytes],
            table: dev
                .stream
                .alloc_zeros::<u8>(bytes.max(1))
                .map_err(cuda("allocating the lm_head LoRA table"))?,
            groups: None,
            staging: Staging::default(),
        })
    }

    /// Puts `adapter`'s embedding and lm_head LoRA and its own rows of
    /// those layers into `slot`, or empties the slot's if it has none. The
    /// tensors are laid out in page-locked memory (in parallel) and copied
    /// as one on `copy`, the stream of the slot's dense copy, before that
    /// copy: the slot's ready event, recorded after it, covers this one
    /// too, and a step that uses the slot waits for it. The table goes on
    /// the compute stream (read only by steps that wait for the slot).
    pub fn write(
        &mut self,
        dev: &Device,
        copy: &Arc<CudaStream>,
        slot: usize,
        adapter: &HostAdapter,
    ) -> Result<()> {
        let outer = &adapter.outer;
        if outer.is_empty() {
            return self.clear(dev, slot);
        }
        // Each tensor's bytes, 16-byte aligned in the one image.
        let mut parts: Vec<Vec<u8>> = Vec::new();
        let mut place = |bytes: Vec<u8>| {
            parts.push(bytes);
            parts.len() - 1
        };
        let f32s = |v: &[f32]| Dtype::F32.encode(v);
        let ids_of = |r: &Replaced| -> Vec<u8> {
            r.tokens()
                .iter()
                .flat_map(|&t| (t as i32).to_le_bytes())
                .collect()
        };
        let embed = outer
            .embedding
            .as_ref()
            .map(|e| (place(f32s(e.a_t())), place(f32s(e.b())), e.rank, e.scale));
        let head = outer.lm_head.as_ref().map(|h| {
            let (a, b) = h.panels(0);
            (place(f32s(a)), place(f32s(b)), h.rank, h.scale)
        });
        let rows_of = |r: &Replaced, dtype: Dtype, place: &mut dyn FnMut(Vec<u8>) -> usize| {
            let values = place(dtype.encode(&r.values_f32()));
            let ids = (!r.is_whole()).then(|| place(ids_of(r)));
            (values, ids, r.tokens().len(), r.rows())
        };
        let saved_embed = outer
            .saved
            .embedding
            .as_ref()
            .map(|r| rows_of(r, self.dtype, &mut place));
        let saved_head = outer.saved.lm_head.as_ref().map(|r| {
            // A whole one in the weights' type, for the base's GEMM; some
            // tokens' rows in f32.
            let dtype = if r.is_whole() { self.dtype } else { Dtype::F32 };
            (r.is_whole(), rows_of(r, dtype, &mut place))
        });
        let mut at = Vec::with_capacity(parts.len());
        let mut len = 0;
        for p in &parts {
            at.push(len);
            len = (len + p.len()).next_multiple_of(16);
        }
        let slices: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let data = self.staging.upload(
            dev,
            copy,
            &slices,
            &at,
            len.max(16),
            "copying an adapter's embedding or lm_head rows or LoRA into its slot",
        )?;
        let base = dev.p(&data);
        let addr = |i: usize| base + at[i] as u64;
        let rows = |(values, ids, count, rows): (usize, Option<usize>, usize, usize)| SavedRows {
            values: addr(values),
            ids: ids.map(addr),
            count,
            rows,
        };
        let entry = head.map_or((0, 0, 0, 0.0), |(a, b, rank, scale)| {
            (addr(a), addr(b), rank as i32, scale)
        });
        self.slots[slot] = OuterSlot {
            embed: embed.map(|(a_t, b, rank, scale)| EmbedFactors {
                a_t: addr(a_t),
                b: addr(b),
                rank,
                scale,
            }),
            head: head.map(|(a, b, ..)| (addr(a), addr(b))),
            saved_embed: saved_embed.map(rows),
            saved_head: saved_head.map(|(whole, r)| {
                if whole {
                    SavedHead::Whole(addr(r.0), r.3)
                } else {
                    SavedHead::Rows(rows(r))
                }
            }),
            data: Some(data),
        };
        self.set_entry(slot, entry);
        self.upload_table(dev)
    }

    pub fn clear(&mut self, dev: &Device, slot: usize) -> Result<()> {
        if self.slots[slot].is_empty() {
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

    /// The logits a row of `slot` writes: its own whole lm_head's rows, or
    /// the base's vocabulary.
    pub fn head_rows(&self, slot: Option<usize>) -> usize {
        match slot.and_then(|s| self.slots[s].saved_head.as_ref()) {
            Some(SavedHead::Whole(_, rows)) => *rows,
            _ => self.vocab,
        }
    }

    /// The token ids `slot` embeds: its own whole embeddings' rows, or the
    /// base's vocabulary.
    pub fn embed_rows(&self, slot: Option<usize>) -> usize {
        slot.and_then(|s| self.slots[s].saved_embed.as_ref())
            .filter(|r| r.ids.is_none())
            .map_or(self.vocab, |r| r.rows)
    }

    /// The step's work outside the layers, from its segments and its logit
    /// rows (token indices, in order), its logits `width` wide; its lm_head
    /// LoRA groups uploaded on the compute stream (after the steps queued
    /// before, which read the last ones).
    pub fn plan(
        &mut self,
        dev: &Device,
        batch: &StepBatch<'_>,
        rows: &[usize],
        width: usize,
    ) -> Result<OuterStep> {
        let mut step = OuterStep::default();
        if self.slots.iter().all(OuterSlot::is_empty) {
            return Ok(step);
        }
        if width > self.vocab {
            let len = rows.len() * width;
            if self.wide.as_ref().is_none_or(|w| w.len() < len) {
                let err = cuda("allocating a grown vocabulary's logits");
                // The old buffer may still be read by a step in flight.
                dev.stream.synchronize().map_err(&err)?;
                self.wide = Some(dev.stream.alloc_zeros::<f32>(len).map_err(&err)?);
            }
            step.width = width;
            step.wide = dev.p(self.wide.as_ref().expect("allocated above"));
        }
        step.embed = batch
            .segments
            .iter()
            .filter(|s| {
                let o = &self.slots[s.slot];
                o.embed.is_some() || o.saved_embed.is_some()
            })
            .copied()
            .collect();
        let head_slot = |i: usize| batch.token_slot[rows[i]].filter(|&s| self.slots[s].heads());
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
            step.rows.push((slot, first, i));
            if self.slots[slot].head.is_some() {
                step.head.extend([first as i32, i as i32, slot as i32, 0]);
                step.longest = step.longest.max(i - first);
            }
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
        dev.stream.memcpy_htod(&step.head, &mut dst).map_err(&err)?;
        step.groups = dev.p(groups);
        Ok(step)
    }

    /// Puts each planned segment's own embedding rows into `hidden` (`[n,
    /// d]` f32, the base's rows times `scale`, Gemma's, there before), the
    /// token ids at `tokens`, then adds its embedding LoRA (times `scale`
    /// too, as PEFT scales it).
    pub fn embed(
        &self,
        dev: &Device,
        step: &OuterStep,
        (tokens, hidden): (u64, u64),
        d: usize,
        scale: f32,
    ) -> Result<()> {
        for seg in &step.embed {
            let grid = ((seg.end - seg.start) as u32, 1, 1);
            let slot = &self.slots[seg.slot];
            if let Some(r) = &slot.saved_embed {
                dev.launch(
                    "embed_saved",
                    grid,
                    256,
                    &[
                        Arg::Ptr(tokens),
                        Arg::I32(seg.start as i32),
                        Arg::Ptr(hidden),
                        Arg::I32(d as i32),
                        Arg::Ptr(r.values),
                        Arg::Ptr(r.ids.unwrap_or(0)),
                        Arg::I32(r.count as i32),
                        Arg::F32(scale),
                    ],
                )?;
            }
            if let Some(e) = &slot.embed {
                dev.launch(
                    "embed_lora",
                    grid,
                    256,
                    &[
                        Arg::Ptr(tokens),
                        Arg::I32(seg.start as i32),
                        Arg::Ptr(hidden),
                        Arg::I32(d as i32),
                        Arg::Ptr(e.a_t),
                        Arg::Ptr(e.b),
                        Arg::I32(e.rank as i32),
                        Arg::F32(e.scale),
                        Arg::F32(scale),
                        Arg::I32(self.vocab as i32),
                    ],
                )?;
            }
        }
        Ok(())
    }

    /// The planned runs of rows whose slot has its own whole lm_head: (its
    /// `[rows, hidden]` weights in the weights' type, its rows, first row,
    /// end row), for the caller's GEMM over those rows; those of the base's
    /// vocabulary (`grown` false) or those grown past it.
    pub fn whole_heads<'a>(
        &'a self,
        step: &'a OuterStep,
        grown: bool,
    ) -> impl Iterator<Item = (u64, usize, usize, usize)> + 'a {
        step.rows
            .iter()
            .filter_map(move |&(slot, lo, hi)| match &self.slots[slot].saved_head {
                Some(SavedHead::Whole(w, rows)) if (*rows > self.vocab) == grown => {
                    Some((*w, *rows, lo, hi))
                }
                _ => None,
            })
    }

    /// Copies the step's `[rows, vocab]` logits at `compact` into its wide
    /// ones, -inf past the base's vocabulary (nothing for a step no wider).
    pub fn widen(&self, dev: &Device, step: &OuterStep, compact: u64, rows: usize) -> Result<()> {
        let Some((width, wide)) = step.wide() else {
            return Ok(());
        };
        dev.launch(
            "widen_logits",
            Device::elementwise_grid(rows * width),
            256,
            &[
                Arg::Ptr(compact),
                Arg::I32(self.vocab as i32),
                Arg::Ptr(wide),
                Arg::I32(width as i32),
                Arg::I64((rows * width) as i64),
            ],
        )
    }

    /// The wide logits of the last step, `[rows, width]`, if it was wider
    /// than the base's vocabulary.
    pub fn wide_logits(&self, step: &OuterStep) -> Option<(&CudaSlice<f32>, usize)> {
        step.wide().and(self.wide.as_ref()).map(|w| (w, step.width))
    }

    /// Adds each planned group's lm_head LoRA into `logits` (`[rows,
    /// vocab]` f32) from the normed rows `normed` (`[rows, d]` f32), through
    /// the expert-LoRA pair, `t` (`[rows, max_rank]` f32) between them.
    pub fn head_lora(
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
        let grid = (step.longest as u32, (step.head.len() / 4) as u32, 1);
        super::moe::grouped_lora_pair(
            dev,
            grid,
            (normed, d),
            (logits, vocab),
            step.groups,
            [table, table + 8 * n, table + 16 * n, table + 20 * n],
            t,
        )
    }

    /// Puts each planned run's own token rows' logits into `logits`
    /// (`[rows, vocab]` f32), from the normed rows `normed` (`[rows, d]`
    /// f32), in place of what was there.
    pub fn saved_logits(
        &self,
        dev: &Device,
        step: &OuterStep,
        (normed, d): (u64, usize),
        (logits, vocab): (u64, usize),
    ) -> Result<()> {
        for &(slot, lo, hi) in &step.rows {
            let Some(SavedHead::Rows(r)) = &self.slots[slot].saved_head else {
                continue;
            };
            let Some(ids) = r.ids else { continue };
            dev.launch(
                "saved_logits",
                ((hi - lo) as u32, r.count.div_ceil(8) as u32, 1),
                256,
                &[
                    Arg::Ptr(normed),
                    Arg::I32(d as i32),
                    Arg::I32(lo as i32),
                    Arg::Ptr(logits),
                    Arg::I32(vocab as i32),
                    Arg::Ptr(r.values),
                    Arg::Ptr(ids),
                    Arg::I32(r.count as i32),
                ],
            )?;
        }
        Ok(())
    }
}
