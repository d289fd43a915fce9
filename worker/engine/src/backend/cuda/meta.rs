//! A step's metadata (tokens, positions, KV rows, block tables, LoRA
//! segments), built on the host and copied into the workspace's metadata
//! buffer in one copy.

use super::device::{self, SegmentPtrs};
use crate::backend::{SeqStep, StepBatch};
use crate::model::rope::Rope;

/// Rotary frequencies that differ between a step's tokens: LongRoPE's
/// short or long factors by the sequence's length, dynamic NTK's by its
/// context. The host writes each token's row into the step's metadata
/// ([`StepMeta::freqs`]); the values are the CPU backend's.
#[derive(Debug)]
pub(super) struct TokenFreqs {
    short: Vec<f32>,
    long: Option<Vec<f32>>,
    dynamic: Option<Rope>,
}

impl TokenFreqs {
    /// None where every token shares one row of frequencies.
    pub(super) fn new(rope: &Rope) -> Option<TokenFreqs> {
        if rope.long_after().is_none() && rope.dynamic_after().is_none() {
            return None;
        }
        Some(TokenFreqs {
            short: rope.inv_freq(),
            long: rope.long_inv_freq(),
            dynamic: rope.dynamic_after().map(|_| rope.clone()),
        })
    }

    /// Rotary pairs per head: the length of a token's row.
    pub(super) fn half(&self) -> usize {
        self.short.len()
    }

    /// A sequence's row where it does not depend on the position:
    /// LongRoPE's short or long factors.
    fn row(&self, s: &SeqStep<'_>) -> &[f32] {
        match &self.long {
            Some(long) if s.long_rope => long,
            _ => &self.short,
        }
    }
}

/// What a step's metadata is built from besides the batch.
pub(super) struct MetaShape<'a> {
    pub(super) block_size: usize,
    /// Blocks per ring ([`crate::backend::BackendShape::ring_len`]); 0
    /// where the sliding layers use the block tables.
    pub(super) ring_len: usize,
    pub(super) freqs: Option<&'a TokenFreqs>,
}

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
    /// Each token's KV row in its sequence's ring, and each sequence's
    /// ring, `ring_len` entries apart (the sliding layers of a model with
    /// both kinds).
    pub(super) ring_row: u64,
    pub(super) rings: u64,
    /// Each token's rotary frequencies (f32, one row of
    /// [`TokenFreqs::half`] each) where they differ between tokens.
    pub(super) freqs: u64,
    /// The LoRA segments and their tiles.
    pub(super) segments: SegmentPtrs,
    /// The LoRA launches' grid: the tiles, or for a graph the most tiles
    /// the step's token count can have.
    pub(super) tiles: usize,
    /// The projections (bit `Projection::index`) that some adapter of the
    /// step has: the others get no LoRA launches. Set by the backend from
    /// its slots.
    pub(super) lora_kinds: u8,
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
    ring_row: usize,
    rings: usize,
    freqs: usize,
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
        shape: &MetaShape<'_>,
        fixed: bool,
    ) -> HostMeta {
        let block_size = shape.block_size;
        let n = batch.tokens.len();
        let mut buf: Vec<i32> = Vec::new();
        // A section of up to `per` entries per token.
        let wide = |buf: &mut Vec<i32>, per: usize, values: &mut dyn Iterator<Item = i32>| {
            let at = buf.len();
            buf.extend(values);
            if fixed {
                // Decode steps: one token, one sequence and one row each.
                buf.resize(at + n * per, 0);
            }
            at
        };
        let section =
            |buf: &mut Vec<i32>, values: &mut dyn Iterator<Item = i32>| wide(buf, 1, values);
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
        let ring_len = shape.ring_len;
        let ring_row = section(
            &mut buf,
            &mut by_token.iter().map(|&(si, p)| {
                if ring_len == 0 {
                    return 0;
                }
                let ring = batch.seqs[si].ring;
                (ring[(p / block_size) % ring_len] as usize * block_size + p % block_size) as i32
            }),
        );
        // Each ring padded to `ring_len`, so sequence i's starts at
        // i * ring_len.
        let rings = wide(
            &mut buf,
            ring_len,
            &mut batch
                .seqs
                .iter()
                .flat_map(|s| (0..ring_len).map(|i| s.ring.get(i).map_or(0, |&b| b as i32))),
        );
        let half = shape.freqs.map_or(0, |f| f.half());
        let mut rows_of_step: Vec<i32> = Vec::new();
        if let Some(f) = shape.freqs {
            // Dynamic NTK's rows by context length, computed once a step.
            let mut grown: std::collections::HashMap<usize, Vec<f32>> = Default::default();
            for &(si, p) in &by_token {
                let s = &batch.seqs[si];
                let row: &[f32] = match &f.dynamic {
                    Some(rope) => grown
                        .entry(s.prompt_len.max(p + 1))
                        .or_insert_with_key(|&context| rope.dynamic_inv_freq(context)),
                    None => f.row(s),
                };
                rows_of_step.extend(row.iter().map(|v| v.to_bits() as i32));
            }
        }
        let freqs = wide(&mut buf, half, &mut rows_of_step.into_iter());
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
            ring_row,
            rings,
            freqs,
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
            ring_row: at(self.ring_row),
            rings: at(self.rings),
            freqs: at(self.freqs),
            segments: self.segments.at(base),
            // A graph's grid covers the most tiles its token count can
            // have: one per token.
            // (none at all when no token has an adapter: that graph has no
            // LoRA launches).
            tiles: match self.fixed {
                Some(n) if self.tiles > 0 => n,
                _ => self.tiles,
            },
            lora_kinds: 0,
            rows: at(self.rows),
            h_part: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::rope::RopeScaling;

    fn longrope() -> Rope {
        Rope {
            theta: 10_000.0,
            rotary_dim: 8,
            scaling: RopeScaling::LongRope {
                short_factor: vec![1.0, 1.5, 2.0, 4.0],
                long_factor: vec![2.0, 3.0, 5.0, 8.0],
                original_max_position_embeddings: 16,
                attention_factor: 1.2,
            },
        }
    }

    fn section(meta: &HostMeta, at: usize, len: usize) -> &[i32] {
        &meta.buf[at..at + len]
    }

    /// Two decode sequences: the first within LongRoPE's context, the
    /// second past it (long factors), each with a ring of two blocks of 4.
    fn decode<'a>(rings: [&'a [u32]; 2], tables: [&'a [u32]; 2], long: bool) -> StepBatch<'a> {
        let mut batch = StepBatch::default();
        batch.push(&[3], 9, tables[0], None, true);
        batch.push(&[5], 18, tables[1], Some(0), true);
        for (s, ring) in batch.seqs.iter_mut().zip(rings) {
            s.ring = ring;
        }
        batch.seqs[1].long_rope = long;
        batch.finish();
        batch
    }

    #[test]
    fn ring_rows_rings_and_each_tokens_frequencies_are_written_where_the_kernels_read_them() {
        let rope = longrope();
        let freqs = TokenFreqs::new(&rope).expect("longrope differs between tokens");
        let shape = MetaShape {
            block_size: 4,
            ring_len: 2,
            freqs: Some(&freqs),
        };
        let (t0, t1): (&[u32], &[u32]) = (&[0, 1, 2], &[3, 4, 5, 6, 7]);
        let batch = decode([&[7, 3], &[5]], [t0, t1], true);
        let meta = HostMeta::build(&batch, &[0, 1], &shape, false);
        // Position 9 is in block 2, ring slot 0 (block 7); position 18 in
        // block 4, ring slot 0 (block 5).
        assert_eq!(section(&meta, meta.ring_row, 2), [7 * 4 + 1, 5 * 4 + 2]);
        // Each ring padded to ring_len.
        assert_eq!(section(&meta, meta.rings, 4), [7, 3, 5, 0]);
        let row = |t: usize| -> Vec<f32> {
            section(&meta, meta.freqs + t * 4, 4)
                .iter()
                .map(|&b| f32::from_bits(b as u32))
                .collect()
        };
        assert_eq!(row(0), rope.inv_freq());
        assert_eq!(Some(row(1)), rope.long_inv_freq());
        assert_ne!(row(0), row(1));
        // The global layers' KV rows go through the block tables still.
        assert_eq!(section(&meta, meta.kv_row, 2), [2 * 4 + 1, 7 * 4 + 2]);
    }

    #[test]
    fn a_decode_steps_sections_sit_where_any_step_of_its_size_puts_them() {
        let rope = Rope {
            theta: 10_000.0,
            rotary_dim: 8,
            scaling: RopeScaling::Dynamic {
                factor: 2.0,
                max_position_embeddings: 8,
            },
        };
        let freqs = TokenFreqs::new(&rope).expect("dynamic differs between tokens");
        let shape = MetaShape {
            block_size: 4,
            ring_len: 2,
            freqs: Some(&freqs),
        };
        let (t0, t1): (&[u32], &[u32]) = (&[0, 1, 2], &[3, 4, 5, 6, 7]);
        let (u0, u1): (&[u32], &[u32]) = (&[9, 8, 7, 6, 5, 4], &[1, 2, 3, 4, 5]);
        let a = HostMeta::build(
            &decode([&[7, 3], &[5]], [t0, t1], false),
            &[0, 1],
            &shape,
            true,
        );
        let b = HostMeta::build(
            &decode([&[1, 2], &[4, 6]], [u0, u1], true),
            &[0, 1],
            &shape,
            true,
        );
        let at = |m: &HostMeta| {
            let s = m.at(0);
            [
                s.tokens,
                s.pos,
                s.kv_row,
                s.ring_row,
                s.rings,
                s.freqs,
                s.block_tables,
            ]
        };
        assert_eq!(at(&a), at(&b));
        // Dynamic NTK: the token at position 18 rotates by the frequencies
        // of a context of 19, the one at 9 by those of 10.
        let row = |m: &HostMeta, t: usize| -> Vec<f32> {
            section(m, m.freqs + t * 4, 4)
                .iter()
                .map(|&b| f32::from_bits(b as u32))
                .collect()
        };
        assert_eq!(row(&a, 0), rope.dynamic_inv_freq(10));
        assert_eq!(row(&a, 1), rope.dynamic_inv_freq(19));
        assert_ne!(row(&a, 0), row(&a, 1));
    }
}
