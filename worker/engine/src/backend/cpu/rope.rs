//! Rotary position embeddings on the CPU: one model's tables (computed once
//! at load, from the config, as transformers computes them) and the
//! rotate-half rotation of each head.

use crate::backend::StepBatch;
use crate::model::rope::Rope;

/// The frequencies of one rotary embedding (a model has one, or Gemma 3
/// one for its global layers and one for its sliding ones).
#[derive(Debug)]
pub(super) struct RopeTables {
    /// The rotary pairs' inverse frequencies, `rotary_dim / 2`.
    inv_freq: Vec<f32>,
    /// LongRoPE's frequencies for sequences past its pretraining context.
    long_inv_freq: Option<Vec<f32>>,
    /// What cos and sin are multiplied by (YaRN's and LongRoPE's
    /// attention factor).
    factor: f32,
    /// Dynamic NTK's embedding, whose frequencies depend on the context.
    dynamic: Option<Rope>,
}

impl RopeTables {
    pub(super) fn new(rope: &Rope) -> RopeTables {
        RopeTables {
            inv_freq: rope.inv_freq(),
            long_inv_freq: rope.long_inv_freq(),
            factor: rope.attention_factor(),
            dynamic: rope.dynamic_after().map(|_| rope.clone()),
        }
    }

    /// Rotary pairs per head.
    pub(super) fn half(&self) -> usize {
        self.inv_freq.len()
    }

    /// `(cos, sin)` of every rotary frequency at each of the step's token
    /// positions, `[tokens, half]`, times the attention factor as
    /// transformers scales them: computed once per step, since every layer
    /// (of this embedding) and head rotates by the same angles.
    pub(super) fn table(&self, batch: &StepBatch<'_>) -> Vec<(f32, f32)> {
        let half = self.half();
        let mut table = vec![(0f32, 0f32); batch.tokens.len() * half];
        // Dynamic NTK's frequencies, by context length, for this step.
        let mut grown: std::collections::HashMap<usize, Vec<f32>> = Default::default();
        for s in &batch.seqs {
            for i in 0..s.len {
                let (t, position) = (s.start + i, s.first_position + i);
                let inv_freq = match (&self.dynamic, &self.long_inv_freq) {
                    (Some(rope), _) => {
                        let context = s.prompt_len.max(position + 1);
                        &*grown
                            .entry(context)
                            .or_insert_with(|| rope.dynamic_inv_freq(context))
                    }
                    (None, Some(long)) if s.long_rope => long,
                    _ => &self.inv_freq,
                };
                for (f, cs) in table[t * half..(t + 1) * half].iter_mut().enumerate() {
                    let (sin, cos) = (position as f32 * inv_freq[f]).sin_cos();
                    *cs = (cos * self.factor, sin * self.factor);
                }
            }
        }
        table
    }
}

/// Rotate-half RoPE of the leading `2 · angles.len()` dimensions of every
/// head in `v` by one token's angles; the rest pass through.
pub(super) fn rotate(v: &mut [f32], head_dim: usize, angles: &[(f32, f32)]) {
    let half = angles.len();
    for head in v.chunks_exact_mut(head_dim) {
        for (i, &(cos, sin)) in angles.iter().enumerate() {
            let (x1, x2) = (head[i], head[i + half]);
            head[i] = x1 * cos - x2 * sin;
            head[i + half] = x2 * cos + x1 * sin;
        }
    }
}
