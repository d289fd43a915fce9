//! The sampling controls that change a row of logits before a token is
//! drawn, in this order: `logit_bias` (added), `min_tokens` (end-of-sequence
//! and stop token ids masked until that many tokens are out),
//! `repetition_penalty` (Hugging Face's and vLLM's: over prompt and output
//! tokens, a positive logit divided by it, a negative one multiplied), then
//! `frequency_penalty` and `presence_penalty` (OpenAI's: over output tokens,
//! `count × frequency + (count > 0) × presence` subtracted).
//!
//! Log probabilities are taken before any of them, from the model's own
//! logits.

use std::collections::HashMap;

use crate::sampling::Sampling;

/// What a sequence has produced so far, as the controls read it.
#[derive(Debug)]
pub struct History<'a> {
    pub prompt: &'a [u32],
    pub output: &'a [u32],
    /// The model's end-of-sequence ids (masked under `min_tokens` unless
    /// `ignore_eos`).
    pub eos: &'a [u32],
}

/// The row after every control, or None when none applies (the row is
/// used as it is).
pub fn adjust(logits: &[f32], params: &Sampling, h: &History<'_>) -> Option<Vec<f32>> {
    if !params.adjusts_logits() {
        return None;
    }
    let mut row = logits.to_vec();
    for &(id, bias) in &params.logit_bias {
        if let Some(x) = row.get_mut(id as usize) {
            *x += bias;
        }
    }
    if h.output.len() < params.min_tokens {
        let eos = if params.ignore_eos { &[][..] } else { h.eos };
        for &id in eos.iter().chain(&params.stop_token_ids) {
            if let Some(x) = row.get_mut(id as usize) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    if params.repetition_penalty != 1.0 {
        let p = params.repetition_penalty;
        let mut seen: Vec<u32> = h.prompt.iter().chain(h.output).copied().collect();
        seen.sort_unstable();
        seen.dedup();
        for id in seen {
            if let Some(x) = row.get_mut(id as usize) {
                *x = if *x > 0.0 { *x / p } else { *x * p };
            }
        }
    }
    if params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &id in h.output {
            *counts.entry(id).or_default() += 1;
        }
        for (id, n) in counts {
            if let Some(x) = row.get_mut(id as usize) {
                *x -= n as f32 * params.frequency_penalty + params.presence_penalty;
            }
        }
    }
    Some(row)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_control_as_defined() {
        let logits = [2.0f32, -2.0, 1.0, 0.5];
        let h = History {
            prompt: &[0],
            output: &[2, 2, 3],
            eos: &[1],
        };
        let with = |p: Sampling| adjust(&logits, &p, &h).unwrap();
        assert!(adjust(&logits, &Sampling::default(), &h).is_none());
        let p = Sampling {
            logit_bias: vec![(1, 5.0), (99, 1.0)],
            ..Default::default()
        };
        assert_eq!(with(p), [2.0, 3.0, 1.0, 0.5]);
        let p = Sampling {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        // Prompt and output tokens; a positive logit halves, a negative doubles.
        assert_eq!(with(p), [1.0, -2.0, 0.5, 0.25]);
        let p = Sampling {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..Default::default()
        };
        // Output tokens only: 2 twice, 3 once.
        assert_eq!(with(p), [2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25]);
        let p = Sampling {
            min_tokens: 4,
            stop_token_ids: vec![3],
            ..Default::default()
        };
        assert_eq!(with(p), [2.0, f32::NEG_INFINITY, 1.0, f32::NEG_INFINITY]);
        let p = Sampling {
            min_tokens: 3,
            stop_token_ids: vec![3],
            ..Default::default()
        };
        assert_eq!(with(p), logits, "three tokens are out: nothing is masked");
    }
}
