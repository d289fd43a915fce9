//! A projection's inputs quantized on the fly, as compressed-tensors' own
//! forward does for a scheme with dynamic `input_activations`: for each
//! token and span of inputs (the whole row, or each group of
//! `group_size`), `scale = max(|x|) / (range / 2)` (`range` 255 for int8,
//! 896 for FP8 e4m3; a zero scale becomes f32's epsilon), each input
//! becomes `round(clamp(x / scale)) · scale` — to the nearest integer in
//! `[-128, 127]`, ties to even, or to the nearest e4m3 value in `[-448,
//! 448]`, ties to an even code — all in f32.

use super::{InputGranularity, InputKind, InputQuantization, fp8_e4m3_to_f32};

impl InputQuantization {
    /// `x` (`n` rows of `fan_in`) as the projection sees it.
    pub fn apply(&self, x: &[f32], fan_in: usize) -> Vec<f32> {
        let span = match self.granularity {
            InputGranularity::Token => fan_in,
            InputGranularity::Group(g) => g.min(fan_in).max(1),
        };
        let mut out = Vec::with_capacity(x.len());
        for row in x.chunks(fan_in.max(1)) {
            for values in row.chunks(span) {
                let largest = values.iter().fold(0f32, |m, v| m.max(v.abs()));
                let half = match self.kind {
                    InputKind::Int8 => 127.5f32,
                    InputKind::Fp8E4m3 => 448.0,
                };
                let mut scale = largest / half;
                if scale == 0.0 {
                    scale = f32::EPSILON;
                }
                out.extend(values.iter().map(|&v| {
                    let q = match self.kind {
                        InputKind::Int8 => (v / scale).clamp(-128.0, 127.0).round_ties_even(),
                        InputKind::Fp8E4m3 => {
                            fp8_e4m3_to_f32(f32_to_fp8_e4m3((v / scale).clamp(-448.0, 448.0)))
                        }
                    };
                    q * scale
                }));
            }
        }
        out
    }
}

/// The e4m3 code nearest `v` (finite, within ±448), ties to the even code
/// (the even mantissa): the cast torch's `float8_e4m3fn` makes.
pub fn f32_to_fp8_e4m3(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs();
    // The non-negative finite codes 0..=0x7e are increasing in value.
    let (mut lo, mut hi) = (0u8, 0x7eu8);
    if a >= fp8_e4m3_to_f32(hi) {
        return sign | hi;
    }
    // The last code at or below `a`.
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fp8_e4m3_to_f32(mid) <= a {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (below, above) = (fp8_e4m3_to_f32(lo), fp8_e4m3_to_f32(hi));
    let code = if a - below < above - a {
        lo
    } else if above - a < a - below {
        hi
    } else if lo % 2 == 0 {
        lo
    } else {
        hi
    };
    if code == 0 { sign } else { sign | code }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_rounding_is_to_the_nearest_code_with_ties_to_even() {
        for code in 0..=0x7eu8 {
            let v = fp8_e4m3_to_f32(code);
            assert_eq!(f32_to_fp8_e4m3(v), code, "{v}");
            assert_eq!(
                f32_to_fp8_e4m3(-v),
                if code == 0 { 0x80 } else { 0x80 | code }
            );
        }
        // 1.0 is 0x38 and the next value 1.125 is 0x39: the midpoint goes
        // to the even code, either side to the nearer.
        assert_eq!(f32_to_fp8_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_fp8_e4m3(1.07), 0x39);
        // 1.125 (0x39) and 1.25 (0x3a): the midpoint to 0x3a.
        assert_eq!(f32_to_fp8_e4m3(1.1875), 0x3a);
        // Below the smallest subnormal's half, zero.
        assert_eq!(f32_to_fp8_e4m3(2f32.powi(-11)), 0);
        assert_eq!(f32_to_fp8_e4m3(448.0), 0x7e);
    }

    #[test]
    fn inputs_are_quantized_per_token_or_per_group_from_their_own_largest_value() {
        let int8 = InputQuantization {
            kind: InputKind::Int8,
            granularity: InputGranularity::Token,
        };
        // One row: largest 2.55, scale 0.02; 1.0 is 50 steps exactly, 0.011
        // rounds to 1 step (0.55), 0.01 is exactly half a step: to 0.
        let x = [2.55f32, -1.0, 0.011, 0.0];
        let scale = 2.55f32 / 127.5;
        let y = int8.apply(&x, 4);
        assert_eq!(
            y[0],
            (2.55f32 / scale).clamp(-128.0, 127.0).round_ties_even() * scale
        );
        assert_eq!(y[1], (-1.0f32 / scale).round_ties_even() * scale);
        assert_eq!(y[2], scale);
        assert_eq!(y[3], 0.0);
        // A row of zeros stays zeros; rows are apart.
        assert_eq!(int8.apply(&[0.0, 0.0, 4.0, 1.0], 2)[..2], [0.0, 0.0]);
        // Groups of 2: each its own scale, so the small group keeps its
        // precision.
        let grouped = InputQuantization {
            kind: InputKind::Fp8E4m3,
            granularity: InputGranularity::Group(2),
        };
        let x = [100.0f32, 1.0, 0.003, 0.001];
        let by_group = grouped.apply(&x, 4);
        let token = InputQuantization {
            kind: InputKind::Fp8E4m3,
            granularity: InputGranularity::Token,
        };
        let by_token = token.apply(&x, 4);
        assert_eq!(by_group[0], by_token[0]);
        assert!((by_group[2] - 0.003).abs() < 1e-6, "{}", by_group[2]);
        let off = |y: f32| (y - 0.001f32).abs();
        assert!(
            off(by_group[3]) * 3.0 < off(by_token[3]),
            "{by_group:?} {by_token:?}"
        );
    }
}
