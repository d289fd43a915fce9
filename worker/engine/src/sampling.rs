//! Sampling: greedy, temperature, top-k and top-p, each request drawing from
//! its own seeded random stream so that its tokens do not depend on what
//! else shares the batch.

use crate::error::{EngineError, Result};
use crate::logprobs::MAX_TOP_LOGPROBS;

/// How a request chooses tokens and when it stops.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub max_tokens: usize,
    /// 0 means greedy.
    pub temperature: f32,
    /// In (0, 1]; 1 means off.
    pub top_p: f32,
    /// 0 means off.
    pub top_k: usize,
    /// None: a seed is drawn for the request.
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Log probabilities of every completion token, with this many most
    /// likely alternatives at each (0 to 20). None: no log probabilities.
    pub logprobs: Option<usize>,
    /// The same for every prompt token after the first (OpenAI's `echo`).
    /// A request that sets it computes its whole prompt: its prefill skips
    /// no cached blocks. With it, `max_tokens` may be 0 (score the prompt
    /// alone).
    pub prompt_logprobs: Option<usize>,
    /// Added to a token's logit before sampling, -100 to 100 each (see
    /// [`crate::penalties`]).
    pub logit_bias: Vec<(u32, f32)>,
    /// End-of-sequence and stop token ids cannot end the sequence before
    /// this many tokens.
    pub min_tokens: usize,
    /// 1 is off; above 1 discourages every token of prompt and output.
    pub repetition_penalty: f32,
    /// OpenAI's, -2 to 2; 0 is off.
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// What the output must match (structured outputs). None: anything.
    pub constraint: Option<crate::constraint::Constraint>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 16,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            logit_bias: Vec::new(),
            min_tokens: 0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            constraint: None,
        }
    }
}

/// The most stop strings a request may carry.
pub const MAX_STOP_STRINGS: usize = 16;
/// The longest stop string, in bytes. Every generated token is checked
/// against each stop string on the engine's thread, over a window as long
/// as the longest one, so both limits bound what one request can cost
/// every other request's tokens.
pub const MAX_STOP_STRING_BYTES: usize = 256;
/// The most `logit_bias` entries a request may carry (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;

/// The most stop token ids a request may carry.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

impl SamplingParams {
    /// Checks every field; `prefix` names where the parameters came from
    /// (for example "sampling").
    pub fn validate(&self, prefix: &str, vocab_size: usize) -> Result<()> {
        let field = |name: &str| {
            if prefix.is_empty() {
                name.to_owned()
            } else {
                format!("{prefix}.{name}")
            }
        };
        if self.max_tokens == 0 && self.prompt_logprobs.is_none() {
            return Err(EngineError::request(
                field("max_tokens"),
                "must be at least 1 (0 only with prompt_logprobs)",
            ));
        }
        for (name, n) in [
            ("logprobs", self.logprobs),
            ("prompt_logprobs", self.prompt_logprobs),
        ] {
            if let Some(n) = n
                && n > MAX_TOP_LOGPROBS
            {
                return Err(EngineError::request(
                    field(name),
                    format!("{n} is above the limit of {MAX_TOP_LOGPROBS}"),
                ));
            }
        }
        if !(self.temperature.is_finite() && (0.0..=2.0).contains(&self.temperature)) {
            return Err(EngineError::request(
                field("temperature"),
                format!("{} is not in [0, 2]", self.temperature),
            ));
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(EngineError::request(
                field("top_p"),
                format!("{} is not in (0, 1]", self.top_p),
            ));
        }
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(v.is_finite() && (-2.0..=2.0).contains(&v)) {
                return Err(EngineError::request(
                    field(name),
                    format!("{v} is not in [-2, 2]"),
                ));
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(EngineError::request(
                field("repetition_penalty"),
                format!("{} is not a positive number", self.repetition_penalty),
            ));
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(EngineError::request(
                field("logit_bias"),
                format!("at most {MAX_LOGIT_BIAS} entries"),
            ));
        }
        for &(id, bias) in &self.logit_bias {
            if id as usize >= vocab_size {
                return Err(EngineError::request(
                    field(&format!("logit_bias[{id}]")),
                    format!("{id} is not below vocab_size {vocab_size}"),
                ));
            }
            if !(bias.is_finite() && (-100.0..=100.0).contains(&bias)) {
                return Err(EngineError::request(
                    field(&format!("logit_bias[{id}]")),
                    format!("{bias} is not in [-100, 100]"),
                ));
            }
        }
        if self.min_tokens > self.max_tokens {
            return Err(EngineError::request(
                field("min_tokens"),
                format!(
                    "{} is above max_tokens {}",
                    self.min_tokens, self.max_tokens
                ),
            ));
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return Err(EngineError::request(
                field("stop"),
                format!("at most {MAX_STOP_STRINGS} stop strings"),
            ));
        }
        for (i, stop) in self.stop.iter().enumerate() {
            if stop.is_empty() {
                return Err(EngineError::request(
                    field(&format!("stop[{i}]")),
                    "is empty",
                ));
            }
            if stop.len() > MAX_STOP_STRING_BYTES {
                return Err(EngineError::request(
                    field(&format!("stop[{i}]")),
                    format!(
                        "is {} bytes, longer than the limit of {MAX_STOP_STRING_BYTES}",
                        stop.len()
                    ),
                ));
            }
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(EngineError::request(
                field("stop_token_ids"),
                format!("at most {MAX_STOP_TOKEN_IDS} stop token ids"),
            ));
        }
        if let Some(id) = self
            .stop_token_ids
            .iter()
            .find(|&&id| id as usize >= vocab_size)
        {
            return Err(EngineError::request(
                field("stop_token_ids"),
                format!("{id} is not below vocab_size {vocab_size}"),
            ));
        }
        Ok(())
    }
}

/// A small, fast, seedable generator (xoshiro256**), owned by one request.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        // SplitMix64 spreads the seed over the state.
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Picks the next token from one row of logits.
pub fn sample(logits: &[f32], params: &SamplingParams, rng: &mut Rng) -> u32 {
    if params.temperature == 0.0 {
        return argmax(logits);
    }
    // Candidates by descending logit; ties broken by id, so the order is total.
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    order.sort_unstable_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    if params.top_k > 0 {
        order.truncate(params.top_k);
    }
    let max = logits[order[0] as usize] as f64;
    let t = params.temperature as f64;
    let mut probs: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i as usize] as f64 - max) / t).exp())
        .collect();
    let sum: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= sum);
    if params.top_p < 1.0 {
        let mut cumulative = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            cumulative += p;
            if cumulative >= params.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        let kept: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= kept);
    }
    let u = rng.next_f64();
    let mut cumulative = 0.0;
    for (i, p) in probs.iter().enumerate() {
        cumulative += p;
        if u < cumulative {
            return order[i];
        }
    }
    order[probs.len() - 1]
}

/// The highest logit, the lowest id among ties.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_top_k_and_top_p() {
        let logits = [0.0, 3.0, 1.0, 3.0, -1.0];
        let mut rng = Rng::new(1);
        let greedy = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        assert_eq!(
            sample(&logits, &greedy, &mut rng),
            1,
            "ties go to the lowest id"
        );
        let top1 = SamplingParams {
            temperature: 1.0,
            top_k: 1,
            ..Default::default()
        };
        for _ in 0..20 {
            assert_eq!(sample(&logits, &top1, &mut rng), 1);
        }
        // top_p just above the two 3.0 logits' mass keeps only them.
        let top_p = SamplingParams {
            temperature: 1.0,
            top_p: 0.8,
            ..Default::default()
        };
        for _ in 0..100 {
            assert!([1, 3].contains(&sample(&logits, &top_p, &mut rng)));
        }
    }

    #[test]
    fn a_seed_fixes_the_stream_and_temperature_spreads_it() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let p = SamplingParams {
            temperature: 1.5,
            ..Default::default()
        };
        let draw = |seed| {
            let mut rng = Rng::new(seed);
            (0..64)
                .map(|_| sample(&logits, &p, &mut rng))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        let distinct: std::collections::BTreeSet<_> = draw(7).into_iter().collect();
        assert!(distinct.len() > 5, "sampling explores: {distinct:?}");
    }

    #[test]
    fn validation_names_the_field() {
        let bad = [
            (
                SamplingParams {
                    max_tokens: 0,
                    ..Default::default()
                },
                "sampling.max_tokens",
            ),
            (
                SamplingParams {
                    temperature: 2.5,
                    ..Default::default()
                },
                "sampling.temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..Default::default()
                },
                "sampling.temperature",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..Default::default()
                },
                "sampling.top_p",
            ),
            (
                SamplingParams {
                    stop: vec!["x".into(), String::new()],
                    ..Default::default()
                },
                "sampling.stop[1]",
            ),
            (
                SamplingParams {
                    stop_token_ids: vec![99],
                    ..Default::default()
                },
                "sampling.stop_token_ids",
            ),
            (
                SamplingParams {
                    stop: vec!["x".repeat(MAX_STOP_STRING_BYTES + 1)],
                    ..Default::default()
                },
                "sampling.stop[0]",
            ),
            (
                SamplingParams {
                    stop_token_ids: vec![1; MAX_STOP_TOKEN_IDS + 1],
                    ..Default::default()
                },
                "sampling.stop_token_ids",
            ),
            (
                SamplingParams {
                    frequency_penalty: 2.5,
                    ..Default::default()
                },
                "sampling.frequency_penalty",
            ),
            (
                SamplingParams {
                    presence_penalty: f32::NAN,
                    ..Default::default()
                },
                "sampling.presence_penalty",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..Default::default()
                },
                "sampling.repetition_penalty",
            ),
            (
                SamplingParams {
                    logit_bias: vec![(60, 1.0)],
                    ..Default::default()
                },
                "sampling.logit_bias[60]",
            ),
            (
                SamplingParams {
                    logit_bias: vec![(3, 101.0)],
                    ..Default::default()
                },
                "sampling.logit_bias[3]",
            ),
            (
                SamplingParams {
                    min_tokens: 17,
                    ..Default::default()
                },
                "sampling.min_tokens",
            ),
            (
                SamplingParams {
                    logprobs: Some(21),
                    ..Default::default()
                },
                "sampling.logprobs",
            ),
            (
                SamplingParams {
                    prompt_logprobs: Some(21),
                    ..Default::default()
                },
                "sampling.prompt_logprobs",
            ),
        ];
        for (p, field) in bad {
            let err = p.validate("sampling", 50).unwrap_err().to_string();
            assert!(err.starts_with(field), "{err}");
        }
        SamplingParams::default().validate("sampling", 50).unwrap();
        SamplingParams {
            max_tokens: 0,
            prompt_logprobs: Some(0),
            ..Default::default()
        }
        .validate("sampling", 50)
        .unwrap();
    }
}
