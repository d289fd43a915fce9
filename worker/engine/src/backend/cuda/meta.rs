//! A step's metadata (tokens, positions, KV rows, block tables, LoRA
//! segments), built on the host and copied into the workspace's metadata
//! buffer in one copy.

use super::device::{self, SegmentPtrs};
use crate::backend::StepBatch;

/// A step's metadata on the device: addresses inside the workspace's i32
/// metadata buffer.
#[derive(Debug, Clone, Copy)]
pub(super) struct StepMeta {
    pub(super) tokens: u64,
    pub(super) pos: u64,
    pub(super) kv_row: u64,
    pub(super) tok_seq: u64,
    pub(super) bt_off: u64,
    pub(super) block_tables: u64,
    /// The LoRA segments and their tiles.
    pub(super) segments: SegmentPtrs,
    /// The LoRA launches' grid: the tiles, or for a graph the most tiles
    /// the step's token count can have.
    pub(super) tiles: usize,
    /// The rows whose logits are wanted.
    pub(super) rows: u64,
    /// The shrink's output and the expand's input: `[slices, splits,
    /// tokens, max_rank]` f32.
    pub(super) h_part: u64,
}

/// A step's metadata on the host, with each section's start (an index into
/// `buf`).
pub(super) struct HostMeta {
    pub(super) buf: Vec<i32>,
    tokens: usize,
    pos: usize,
    kv_row: usize,
    tok_seq: usize,
    bt_off: usize,
    rows: usize,
    segments: SegmentPtrs,
    tiles: usize,
    block_tables: usize,
    /// The step's token count when every section but the block tables
    /// (the last) sits where it does for any step of that count.
    fixed: Option<usize>,
}

impl HostMeta {
    /// Builds a step's metadata. With `fixed`, each section is padded to
    /// what the step's token count can need, so every address but the
    /// block tables' contents depends on that count alone (what a CUDA
    /// graph captured for the count reads).
    pub(super) fn build(
        batch: &StepBatch<'_>,
        rows: &[usize],
        block_size: usize,
        fixed: bool,
    ) -> HostMeta {
        let n = batch.tokens.len();
        let mut buf: Vec<i32> = Vec::new();
        let section = |buf: &mut Vec<i32>, values: &mut dyn Iterator<Item = i32>| {
            let at = buf.len();
            buf.extend(values);
            if fixed {
                // Decode steps: one token, one sequence and one row each.
                buf.resize(at + n, 0);
            }
            at
        };
        let tokens = section(&mut buf, &mut batch.tokens.iter().map(|&t| t as i32));
        // (sequence, position) of each token: a sequence's tokens are
        // contiguous and in sequence order (`StepBatch::push`).
        let by_token: Vec<(usize, usize)> = batch
            .seqs
            .iter()
            .enumerate()
            .flat_map(|(si, s)| (0..s.len).map(move |i| (si, s.first_position + i)))
            .collect();
        let pos = section(&mut buf, &mut by_token.iter().map(|&(_, p)| p as i32));
        let kv_row = section(
            &mut buf,
            &mut by_token.iter().map(|&(si, p)| {
                let bt = batch.seqs[si].block_table;
                (bt[p / block_size] as usize * block_size + p % block_size) as i32
            }),
        );
        let tok_seq = section(&mut buf, &mut by_token.iter().map(|&(si, _)| si as i32));
        let mut offsets = Vec::with_capacity(batch.seqs.len());
        let mut total = 0;
        for s in &batch.seqs {
            offsets.push(total as i32);
            total += s.block_table.len();
        }
        let bt_off = section(&mut buf, &mut offsets.into_iter());
        let rows = section(&mut buf, &mut rows.iter().map(|&r| r as i32));
        let (segments, tiles) =
            device::push_segments(&mut buf, &batch.segments, fixed.then_some(n));
        // Last, so its length moves no other section.
        let block_tables = buf.len();
        buf.extend(
            batch
                .seqs
                .iter()
                .flat_map(|s| s.block_table.iter().map(|&b| b as i32)),
        );
        // Keep every section's address valid even when it is empty.
        buf.push(0);
        HostMeta {
            buf,
            tokens,
            pos,
            kv_row,
            tok_seq,
            bt_off,
            rows,
            segments,
            tiles,
            block_tables,
            fixed: fixed.then_some(n),
        }
    }

    /// The sections' device addresses once `buf` is copied to `base`.
    pub(super) fn at(&self, base: u64) -> StepMeta {
        let at = |i: usize| base + (i * 4) as u64;
        StepMeta {
            tokens: at(self.tokens),
            pos: at(self.pos),
            kv_row: at(self.kv_row),
            tok_seq: at(self.tok_seq),
            bt_off: at(self.bt_off),
            block_tables: at(self.block_tables),
            segments: self.segments.at(base),
            // A graph's grid covers the most tiles its token count can
            // have: one per token.
            // (none at all when no token has an adapter: that graph has no
            // LoRA launches).
            tiles: match self.fixed {
                Some(n) if self.tiles > 0 => n,
                _ => self.tiles,
            },
            rows: at(self.rows),
            h_part: 0,
        }
    }
}
