//! A quantized `[out, in]` weight as it is stored: one code per weight,
//! a scale (and a zero point) per output and group of inputs, and each
//! input's group. `WeightFiles::quantized_matrix` (the weights module)
//! reads one from a checkpoint's tensors in any of the layouts of
//! [`super`]; a weight's
//! value is `(value(code) - zero) · scale`, computed in f32, or `value(code)
//! · scale` without zero points. The engine keeps weights in this form and
//! dequantizes them inside its projections; [`QuantizedMatrix::to_f32`] is
//! the same formula for whoever wants the dense matrix.

use super::Strategy;

/// The stored values, one per weight, `[out, in]` row-major.
#[derive(Debug, Clone, PartialEq)]
pub enum Codes {
    /// int8 (compressed-tensors `int-quantized`).
    Int8(Vec<i8>),
    /// 4-bit values `-8..=7` (compressed-tensors `pack-quantized`, which
    /// stores each plus 8).
    Int4(Vec<i8>),
    /// 4-bit values `0..=15`, under zero points (GPTQ, AWQ).
    Uint4(Vec<u8>),
    /// FP8 e4m3 bits.
    Fp8E4m3(Vec<u8>),
    /// FP4 E2M1 codes `0..=15` (MXFP4): sign, two exponent bits and one
    /// mantissa bit, the values of [`FP4_E2M1`].
    Fp4E2m1(Vec<u8>),
}

/// The value of each FP4 E2M1 code (OCP microscaling formats): ±{0, 0.5,
/// 1, 1.5, 2, 3, 4, 6}, the sign in the top bit.
pub const FP4_E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

impl Codes {
    pub fn len(&self) -> usize {
        match self {
            Codes::Int8(c) | Codes::Int4(c) => c.len(),
            Codes::Uint4(c) | Codes::Fp8E4m3(c) | Codes::Fp4E2m1(c) => c.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Code `i` as f32, exactly.
    pub fn value(&self, i: usize) -> f32 {
        match self {
            Codes::Int8(c) | Codes::Int4(c) => f32::from(c[i]),
            Codes::Uint4(c) => f32::from(c[i]),
            Codes::Fp8E4m3(c) => fp8_e4m3_to_f32(c[i]),
            Codes::Fp4E2m1(c) => FP4_E2M1[usize::from(c[i] & 0xf)],
        }
    }

    /// Bits a code takes in the checkpoint.
    pub fn bits(&self) -> usize {
        match self {
            Codes::Int8(_) | Codes::Fp8E4m3(_) => 8,
            Codes::Int4(_) | Codes::Uint4(_) | Codes::Fp4E2m1(_) => 4,
        }
    }
}

/// See the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedMatrix {
    pub out: usize,
    pub fan_in: usize,
    pub codes: Codes,
    /// `[groups, out]`.
    pub scales: Vec<f32>,
    /// `[groups, out]`; `None` where the format has none (symmetric).
    pub zeros: Option<Vec<f32>>,
    /// `[in]`: each input's group.
    pub group: Vec<u32>,
}

impl QuantizedMatrix {
    pub fn groups(&self) -> usize {
        self.scales.len() / self.out.max(1)
    }

    /// Weight `(o, k)`.
    pub fn weight(&self, o: usize, k: usize) -> f32 {
        let s = self.group[k] as usize * self.out + o;
        let v = self.codes.value(o * self.fan_in + k);
        match &self.zeros {
            Some(z) => (v - z[s]) * self.scales[s],
            None => v * self.scales[s],
        }
    }

    /// The matrix of rows `rows` of this one, in that order (GPT-OSS's
    /// interleaved gate and up rows stacked as gate, then up).
    pub fn select_rows(&self, rows: &[usize]) -> QuantizedMatrix {
        fn pick<T: Copy>(c: &[T], rows: &[usize], fan_in: usize) -> Vec<T> {
            rows.iter()
                .flat_map(|&r| c[r * fan_in..(r + 1) * fan_in].iter().copied())
                .collect()
        }
        let f = self.fan_in;
        let codes = match &self.codes {
            Codes::Int8(c) => Codes::Int8(pick(c, rows, f)),
            Codes::Int4(c) => Codes::Int4(pick(c, rows, f)),
            Codes::Uint4(c) => Codes::Uint4(pick(c, rows, f)),
            Codes::Fp8E4m3(c) => Codes::Fp8E4m3(pick(c, rows, f)),
            Codes::Fp4E2m1(c) => Codes::Fp4E2m1(pick(c, rows, f)),
        };
        // `[groups, out]`: each group's values of the chosen rows.
        let columns = |v: &[f32]| -> Vec<f32> {
            v.chunks_exact(self.out.max(1))
                .flat_map(|g| rows.iter().map(move |&r| g[r]))
                .collect()
        };
        QuantizedMatrix {
            out: rows.len(),
            fan_in: f,
            codes,
            scales: columns(&self.scales),
            zeros: self.zeros.as_deref().map(columns),
            group: self.group.clone(),
        }
    }

    /// The dense `[out, in]` matrix.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut w = Vec::with_capacity(self.out * self.fan_in);
        for o in 0..self.out {
            w.extend((0..self.fan_in).map(|k| self.weight(o, k)));
        }
        w
    }

    /// The first weight that is NaN or infinite, as (row-major index, value).
    pub(crate) fn first_non_finite(&self) -> Option<(usize, f32)> {
        (0..self.out * self.fan_in)
            .map(|i| (i, self.weight(i / self.fan_in, i % self.fan_in)))
            .find(|(_, v)| !v.is_finite())
    }

    /// Bytes the codes take packed at their width, with the scales and
    /// zero points in f32.
    pub fn stored_bytes(&self) -> usize {
        let per = self.scales.len() * 4;
        self.codes.len() * self.codes.bits() / 8 + per + self.zeros.as_ref().map_or(0, |_| per)
    }
}

/// Where AutoAWQ's GEMM layout puts the eight columns of a word: nibble
/// `i` of word `w` holds column `8 w + AWQ_ORDER[i]`.
pub const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

/// Unpacks AWQ's `[rows, cols / 8]` words (packed along the columns in
/// [`AWQ_ORDER`]) into `[rows, cols]` 4-bit values.
pub fn unpack_awq(words: &[u8], (rows, cols): (usize, usize)) -> Vec<u32> {
    let per_row = cols.div_ceil(8);
    let mut values = vec![0u32; rows * cols];
    for r in 0..rows {
        for w in 0..per_row {
            let at = (r * per_row + w) * 4;
            let word = u32::from_le_bytes([words[at], words[at + 1], words[at + 2], words[at + 3]]);
            for (i, &c) in AWQ_ORDER.iter().enumerate() {
                if 8 * w + c < cols {
                    values[r * cols + 8 * w + c] = (word >> (4 * i)) & 0xf;
                }
            }
        }
    }
    values
}

/// Unpacks 4-bit values packed eight to an int32 along the rows of a
/// `[rows.div_ceil(8), cols]` word matrix (GPTQ's `qweight`): value `(r,
/// c)` is bits `4 (r mod 8)` of word `(r / 8, c)`.
pub fn unpack_int4_rows(words: &[u8], (rows, cols): (usize, usize)) -> Vec<u32> {
    let mut values = vec![0u32; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            let at = ((r / 8) * cols + c) * 4;
            let word = u32::from_le_bytes([words[at], words[at + 1], words[at + 2], words[at + 3]]);
            values[r * cols + c] = (word >> (4 * (r % 8))) & 0xf;
        }
    }
    values
}

/// FP8 e4m3 (the OCP "fn" variant: no infinities, S.1111.111 is NaN) to f32.
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0xf);
    let mant = f32::from(b & 0x7);
    if exp == 0xf && b & 0x7 == 0x7 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        mant / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + mant / 8.0) * 2f32.powi(exp - 7)
    };
    sign * magnitude
}

/// The shape the scale tensor of an `[out, in]` matrix has, by strategy.
pub fn scale_shape(strategy: Strategy, out: usize, fan_in: usize) -> Vec<usize> {
    match strategy {
        Strategy::Tensor => vec![1],
        Strategy::Channel => vec![out, 1],
        Strategy::Group(g) => vec![out, fan_in.div_ceil(g)],
        Strategy::Block { rows, cols } => vec![out.div_ceil(rows), fan_in.div_ceil(cols)],
    }
}

/// Each input's group under `strategy`: its group of inputs, or its block
/// column.
pub(crate) fn input_groups(strategy: Strategy, fan_in: usize) -> Vec<u32> {
    (0..fan_in)
        .map(|k| match strategy {
            Strategy::Group(g) | Strategy::Block { cols: g, .. } => (k / g) as u32,
            Strategy::Tensor | Strategy::Channel => 0,
        })
        .collect()
}

/// Value `i` of a row of `bits`-wide values packed densely into
/// little-endian int32 words (value `i` at bit `bits · i`), as
/// compressed-tensors' `pack_to_int32` writes them; `bits` divides 32, so
/// no value straddles two words. `word(w)` is the row's word `w`.
pub(crate) fn packed_value(word: impl Fn(usize) -> u32, bits: usize, i: usize) -> u32 {
    let at = bits * i;
    (word(at / 32) >> (at % 32)) & ((1u32 << bits) - 1)
}

/// The little-endian int32 at word index `w` of `bytes`.
pub(crate) fn word_at(bytes: &[u8], w: usize) -> u32 {
    u32::from_le_bytes([
        bytes[4 * w],
        bytes[4 * w + 1],
        bytes[4 * w + 2],
        bytes[4 * w + 3],
    ])
}

/// Nibble `i` (bits `4 i`) of the little-endian int32 at byte `at`.
pub(crate) fn nibble(words: &[u8], at: usize, i: usize) -> u8 {
    let word = u32::from_le_bytes([words[at], words[at + 1], words[at + 2], words[at + 3]]);
    ((word >> (4 * i)) & 0xf) as u8
}

/// A per-strategy scale (or zero point) tensor of an `[out, in]` matrix
/// as `[groups, out]`.
pub(crate) fn by_group(strategy: Strategy, out: usize, fan_in: usize, flat: Vec<f32>) -> Vec<f32> {
    match strategy {
        Strategy::Tensor => vec![flat[0]; out],
        Strategy::Channel => flat,
        Strategy::Group(g) => {
            let groups = fan_in.div_ceil(g);
            (0..groups * out)
                .map(|i| flat[(i % out) * groups + i / out])
                .collect()
        }
        // [⌈out / rows⌉, ⌈in / cols⌉]: each output takes its block row's.
        Strategy::Block { rows, cols } => {
            let groups = fan_in.div_ceil(cols);
            (0..groups * out)
                .map(|i| flat[(i % out) / rows * groups + i / out])
                .collect()
        }
    }
}
