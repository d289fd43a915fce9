//! Sampling: greedy, temperature, top-k and top-p, each request drawing from
//! its own seeded random stream so that its tokens do not depend on what
//! else shares the batch.

pub use lorafleet_domain::generation::{
    MAX_LOGIT_BIAS, MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, Sampling,
};

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
pub fn sample(logits: &[f32], params: &Sampling, rng: &mut Rng) -> u32 {
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
    if params.min_p > 0.0 {
        // Relative to the most likely token, so the normalization above
        // does not change which tokens stay.
        let floor = params.min_p as f64 * probs[0];
        let keep = probs.iter().take_while(|&&p| p >= floor).count();
        probs.truncate(keep.max(1));
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
        let greedy = Sampling {
            temperature: 0.0,
            ..Default::default()
        };
        assert_eq!(
            sample(&logits, &greedy, &mut rng),
            1,
            "ties go to the lowest id"
        );
        let top1 = Sampling {
            temperature: 1.0,
            top_k: 1,
            ..Default::default()
        };
        for _ in 0..20 {
            assert_eq!(sample(&logits, &top1, &mut rng), 1);
        }
        // top_p just above the two 3.0 logits' mass keeps only them.
        let top_p = Sampling {
            temperature: 1.0,
            top_p: 0.8,
            ..Default::default()
        };
        for _ in 0..100 {
            assert!([1, 3].contains(&sample(&logits, &top_p, &mut rng)));
        }
    }

    /// Min-p keeps the tokens at least `min_p` times as likely as the most
    /// likely one: with probabilities 0.5, 0.3, 0.15 and 0.05, a floor of
    /// 0.25 x 0.5 keeps three, 0.35 x 0.5 two, and none drops the first.
    #[test]
    fn min_p_drops_the_tokens_below_its_share_of_the_most_likely() {
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let drawn = |min_p: f32| {
            let params = Sampling {
                min_p,
                ..Default::default()
            };
            let mut seen = [0usize; 4];
            for seed in 0..4000 {
                seen[sample(&logits, &params, &mut Rng::new(seed)) as usize] += 1;
            }
            seen
        };
        let off = drawn(0.0);
        assert!(off.iter().all(|&n| n > 0), "{off:?}");
        let quarter = drawn(0.25);
        assert_eq!(quarter[3], 0, "{quarter:?}");
        assert!(quarter[..3].iter().all(|&n| n > 0), "{quarter:?}");
        // Renormalized over the three kept: 0.15 / 0.95 of the draws.
        let share = quarter[2] as f64 / 4000.0;
        assert!((share - 0.15 / 0.95).abs() < 0.03, "{share}");
        let more = drawn(0.35);
        assert_eq!((more[2], more[3]), (0, 0), "{more:?}");
        assert_eq!(drawn(1.0), [4000, 0, 0, 0]);
    }

    #[test]
    fn a_seed_fixes_the_stream_and_temperature_spreads_it() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let p = Sampling {
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
}
