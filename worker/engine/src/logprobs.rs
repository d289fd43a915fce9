//! Log probabilities: the model's own log-softmax over the whole
//! vocabulary, in f32, before temperature, top-k, top-p or any other
//! sampling control (what OpenAI and vLLM return by default).
//!
//! They are computed on the engine thread from a step's logits, only for
//! the sequences that ask: completion tokens for `logprobs`, prompt tokens
//! for `prompt_logprobs` (OpenAI's `echo`).

/// The most alternatives a request may ask for at each position.
pub use lorafleet_domain::generation::MAX_TOP_LOGPROBS;

/// The most prompt positions one sequence scores in a step: each is a row
/// of logits (`vocab_size` floats) brought to the host, so a long prompt
/// is scored over several prefill chunks.
pub const MAX_SCORED_POSITIONS_PER_STEP: usize = 256;

/// One position's token, its log probability and the most likely tokens
/// there.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    /// None only for a prompt's first token, which nothing predicts.
    pub logprob: Option<f32>,
    /// The most likely tokens at this position with their log
    /// probabilities, most likely first (ties by lower id); as many as the
    /// request asked for.
    pub top: Vec<(u32, f32)>,
}

/// Scores `token` against one row of logits, with the `top_n` most likely
/// tokens of the row.
pub fn score(logits: &[f32], token: u32, top_n: usize) -> TokenLogprob {
    // max + log(sum(exp(x - max))), the sum in f64 so a large vocabulary
    // loses nothing to rounding.
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    let lp = |x: f32| (x as f64 - log_z) as f32;
    TokenLogprob {
        token,
        logprob: Some(lp(logits[token as usize])),
        top: top(logits, top_n)
            .into_iter()
            .map(|id| (id, lp(logits[id as usize])))
            .collect(),
    }
}

/// The ids of the `n` highest logits, highest first, ties by lower id.
fn top(logits: &[f32], n: usize) -> Vec<u32> {
    let n = n.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    let better = |a: u32, b: u32| {
        logits[a as usize]
            .total_cmp(&logits[b as usize])
            .reverse()
            .then(a.cmp(&b))
    };
    // One pass keeping the best n in order: n is at most 20.
    let mut best: Vec<u32> = Vec::with_capacity(n + 1);
    for id in 0..logits.len() as u32 {
        if best.len() == n && better(id, best[n - 1]).is_ge() {
            continue;
        }
        let at = best.partition_point(|&b| better(b, id).is_lt());
        best.insert(at, id);
        best.truncate(n);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_and_the_top_tokens() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
        let s = score(&logits, 2, 3);
        assert!((s.logprob.unwrap() as f64 - (2.0 - z.ln())).abs() < 1e-6);
        let ids: Vec<u32> = s.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 2], "most likely first, ties by lower id");
        let total: f64 = logits
            .iter()
            .enumerate()
            .map(|(i, _)| (score(&logits, i as u32, 0).logprob.unwrap() as f64).exp())
            .sum();
        assert!(
            (total - 1.0).abs() < 1e-6,
            "probabilities sum to one: {total}"
        );
        assert!(score(&logits, 0, 0).top.is_empty());
        assert_eq!(score(&logits, 0, 99).top.len(), 5);
    }

    #[test]
    fn large_logits_do_not_overflow() {
        let logits = [1000.0f32, 999.0, -1000.0];
        let s = score(&logits, 1, 1);
        let expected = -(1.0 + (-1.0f64).exp()).ln() - 1.0;
        assert!((s.logprob.unwrap() as f64 - expected).abs() < 1e-5);
        assert_eq!(s.top[0].0, 0);
    }
}
