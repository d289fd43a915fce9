//! A step's metadata (tokens, positions, KV rows, block tables, LoRA
//! segments) uploaded to the device in one buffer.

use cudarc::driver::CudaSlice;

use super::CudaBackend;
use super::device::{self, SegmentPtrs, cuda};
use crate::backend::StepBatch;
use crate::error::Result;

/// A step's metadata on the device: addresses inside one uploaded i32
/// buffer.
pub(super) struct StepMeta {
    pub(super) tokens: u64,
    pub(super) pos: u64,
    pub(super) kv_row: u64,
    pub(super) tok_seq: u64,
    pub(super) bt_off: u64,
    pub(super) block_tables: u64,
    /// The LoRA segments and their tiles.
    pub(super) segments: SegmentPtrs,
    pub(super) tiles: usize,
    /// The rows whose logits are wanted.
    pub(super) rows: u64,
    /// The shrink's output and the expand's input: `[slices, splits,
    /// tokens, max_rank]` f32.
    pub(super) h_part: u64,
}

impl StepMeta {
    /// Builds and uploads the step's metadata in one copy.
    pub(super) fn upload(
        backend: &CudaBackend,
        batch: &StepBatch<'_>,
        rows: &[usize],
    ) -> Result<(StepMeta, CudaSlice<i32>)> {
        let bs = backend.shape.block_size;
        let mut buf: Vec<i32> = Vec::new();
        let section = |buf: &mut Vec<i32>, values: &mut dyn Iterator<Item = i32>| {
            let at = buf.len();
            buf.extend(values);
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
                (bt[p / bs] as usize * bs + p % bs) as i32
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
        let block_tables = section(
            &mut buf,
            &mut batch
                .seqs
                .iter()
                .flat_map(|s| s.block_table.iter().map(|&b| b as i32)),
        );
        let (segments, tiles) = device::push_segments(&mut buf, &batch.segments);
        let rows = section(&mut buf, &mut rows.iter().map(|&r| r as i32));
        // Keep every section's address valid even when it is empty.
        buf.push(0);
        let dev = backend
            .dev
            .stream
            .clone_htod(&buf)
            .map_err(cuda("uploading step metadata"))?;
        let base = backend.dev.p(&dev);
        let at = |i: usize| base + (i * 4) as u64;
        Ok((
            StepMeta {
                tokens: at(tokens),
                pos: at(pos),
                kv_row: at(kv_row),
                tok_seq: at(tok_seq),
                bt_off: at(bt_off),
                block_tables: at(block_tables),
                segments: segments.at(base),
                tiles,
                rows: at(rows),
                h_part: 0,
            },
            dev,
        ))
    }
}
