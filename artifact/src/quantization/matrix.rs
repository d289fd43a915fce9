//! A quantized `[out, in]` weight as it is stored: one code per weight,
//! a scale (and a zero point) per output and group of inputs, and each
//! input's group. [`WeightFiles::quantized_matrix`] reads one from a
//! checkpoint's tensors in any of the layouts of [`super`]; a weight's
//! value is `(value(code) - zero) · scale`, computed in f32, or `value(code)
//! · scale` without zero points. The engine keeps weights in this form and
//! dequantizes them inside its projections; [`QuantizedMatrix::to_f32`] is
//! the same formula for whoever wants the dense matrix.

use std::path::Path;

use safetensors::Dtype;

use super::{Format, Strategy};
use crate::error::{FileError, Result};
use crate::weights::{RawTensor, WeightFiles};

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
}

impl Codes {
    pub fn len(&self) -> usize {
        match self {
            Codes::Int8(c) | Codes::Int4(c) => c.len(),
            Codes::Uint4(c) | Codes::Fp8E4m3(c) => c.len(),
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
        }
    }

    /// Bits a code takes in the checkpoint.
    pub fn bits(&self) -> usize {
        match self {
            Codes::Int8(_) | Codes::Fp8E4m3(_) => 8,
            Codes::Int4(_) | Codes::Uint4(_) => 4,
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

    /// The dense `[out, in]` matrix.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut w = Vec::with_capacity(self.out * self.fan_in);
        for o in 0..self.out {
            w.extend((0..self.fan_in).map(|k| self.weight(o, k)));
        }
        w
    }

    /// The first weight that is NaN or infinite, as (row-major index, value).
    fn first_non_finite(&self) -> Option<(usize, f32)> {
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
    }
}

/// Nibble `i` (bits `4 i`) of the little-endian int32 at byte `at`.
fn nibble(words: &[u8], at: usize, i: usize) -> u8 {
    let word = u32::from_le_bytes([words[at], words[at + 1], words[at + 2], words[at + 3]]);
    ((word >> (4 * i)) & 0xf) as u8
}

/// A per-strategy scale (or zero point) tensor of an `[out, in]` matrix
/// as `[groups, out]`.
fn by_group(strategy: Strategy, out: usize, fan_in: usize, flat: Vec<f32>) -> Vec<f32> {
    match strategy {
        Strategy::Tensor => vec![flat[0]; out],
        Strategy::Channel => flat,
        Strategy::Group(g) => {
            let groups = fan_in.div_ceil(g);
            (0..groups * out)
                .map(|i| flat[(i % out) * groups + i / out])
                .collect()
        }
    }
}

impl WeightFiles {
    /// A quantized `[out, in]` weight as stored (see the module docs);
    /// `None` when `name` is not stored quantized. Every tensor's dtype
    /// and shape are checked, and a weight that dequantizes to NaN or an
    /// infinity is refused, as [`WeightFiles::f32`] refuses one.
    pub fn quantized_matrix(&self, name: &str, shape: &[usize]) -> Result<Option<QuantizedMatrix>> {
        let Some((q, stem)) = self.quantized(name) else {
            return Ok(None);
        };
        let &[out, fan_in] = shape else {
            return Err(FileError::model(
                self.file_of(&format!("{stem}.weight_scale"))
                    .unwrap_or(Path::new("")),
                name,
                format!("a quantized weight must be a matrix, expected {shape:?}"),
            ));
        };
        let (m, scale_name) = if matches!(q.format, Format::Gptq4 | Format::Gptq4V2 | Format::Awq4)
        {
            (
                self.gptq_matrix(q.format, q.strategy, stem, (out, fan_in))?,
                format!("{stem}.scales"),
            )
        } else {
            (
                self.compressed_matrix(q.format, q.strategy, q.symmetric, name, (out, fan_in))?,
                format!("{stem}.weight_scale"),
            )
        };
        if let Some((at, value)) = m.first_non_finite() {
            let path = self
                .file_of(&scale_name)
                .unwrap_or(Path::new(""))
                .to_path_buf();
            return Err(Self::non_finite(&path, name, value, at));
        }
        Ok(Some(m))
    }

    /// A tensor of the given dtype and shape.
    fn stored(
        &self,
        tensor: &str,
        dtype: Dtype,
        shape: &[usize],
        format: Format,
    ) -> Result<RawTensor<'_>> {
        let (raw, path) = self.shaped(tensor, shape)?;
        if raw.dtype != dtype {
            return Err(FileError::model(
                path,
                tensor,
                format!(
                    "dtype {:?} does not match the {} quantization; expected {dtype:?}",
                    raw.dtype,
                    format.name()
                ),
            ));
        }
        Ok(raw)
    }

    /// A compressed-tensors weight: `W.weight` (or `W.weight_packed`),
    /// `W.weight_scale` and, asymmetric, `W.weight_zero_point`.
    fn compressed_matrix(
        &self,
        format: Format,
        strategy: Strategy,
        symmetric: bool,
        name: &str,
        (out, fan_in): (usize, usize),
    ) -> Result<QuantizedMatrix> {
        let stem = name.strip_suffix(".weight").unwrap_or(name);
        let codes = match format {
            Format::Int8 => Codes::Int8(
                self.stored(name, Dtype::I8, &[out, fan_in], format)?
                    .data
                    .iter()
                    .map(|&b| b as i8)
                    .collect(),
            ),
            Format::Fp8E4m3 => Codes::Fp8E4m3(
                self.stored(name, Dtype::F8_E4M3, &[out, fan_in], format)?
                    .data
                    .to_vec(),
            ),
            Format::PackedInt4 => {
                let per_row = fan_in.div_ceil(8);
                let words = self.stored(
                    &format!("{stem}.weight_packed"),
                    Dtype::I32,
                    &[out, per_row],
                    format,
                )?;
                Codes::Int4(
                    (0..out * fan_in)
                        .map(|i| {
                            let (o, c) = (i / fan_in, i % fan_in);
                            nibble(words.data, (o * per_row + c / 8) * 4, c % 8) as i8 - 8
                        })
                        .collect(),
                )
            }
            Format::Gptq4 | Format::Gptq4V2 | Format::Awq4 => {
                unreachable!("{} is read by gptq_matrix", format.name())
            }
        };
        let scale_shape = scale_shape(strategy, out, fan_in);
        let scales = self.f32_values(&format!("{stem}.weight_scale"), &scale_shape)?;
        let zero_point = format!("{stem}.weight_zero_point");
        let zeros = match (symmetric, format) {
            (true, _) => None,
            // Packed like the weights, each plus 8, but along the output:
            // output o in bits 4 (o mod 8) of word row o / 8.
            (false, Format::PackedInt4) => {
                let groups = scale_shape[1];
                let words =
                    self.stored(&zero_point, Dtype::I32, &[out.div_ceil(8), groups], format)?;
                let flat = (0..out * groups)
                    .map(|i| {
                        let (o, g) = (i / groups, i % groups);
                        f32::from(nibble(words.data, ((o / 8) * groups + g) * 4, o % 8) as i8 - 8)
                    })
                    .collect();
                Some(by_group(strategy, out, fan_in, flat))
            }
            (false, _) => {
                let raw = self.stored(&zero_point, Dtype::I8, &scale_shape, format)?;
                let flat = raw.data.iter().map(|&b| f32::from(b as i8)).collect();
                Some(by_group(strategy, out, fan_in, flat))
            }
        };
        Ok(QuantizedMatrix {
            out,
            fan_in,
            codes,
            scales: by_group(strategy, out, fan_in, scales),
            zeros,
            group: (0..fan_in)
                .map(|k| match strategy {
                    Strategy::Group(g) => (k / g) as u32,
                    Strategy::Tensor | Strategy::Channel => 0,
                })
                .collect(),
        })
    }

    /// A GPTQ or AWQ weight: `W.qweight`, `W.qzeros`, `W.scales` and, for
    /// GPTQ, `W.g_idx` when present.
    fn gptq_matrix(
        &self,
        format: Format,
        strategy: Strategy,
        stem: &str,
        (out, fan_in): (usize, usize),
    ) -> Result<QuantizedMatrix> {
        let int32 = |tensor: &str, shape: &[usize]| self.stored(tensor, Dtype::I32, shape, format);
        let group_size = match strategy {
            Strategy::Group(g) => g,
            Strategy::Tensor | Strategy::Channel => fan_in,
        };
        let groups = fan_in.div_ceil(group_size);
        let qzeros = int32(&format!("{stem}.qzeros"), &[groups, out.div_ceil(8)])?;
        // Both unpack to [in, out]; the codes are [out, in].
        let (by_input, zeros): (Vec<u32>, Vec<f32>) = if format == Format::Awq4 {
            let qweight = int32(&format!("{stem}.qweight"), &[fan_in, out.div_ceil(8)])?;
            let zeros = unpack_awq(qzeros.data, (groups, out));
            (
                unpack_awq(qweight.data, (fan_in, out)),
                zeros.into_iter().map(|z| z as f32).collect(),
            )
        } else {
            let qweight = int32(&format!("{stem}.qweight"), &[fan_in.div_ceil(8), out])?;
            // The zeros are packed along the output, in order: a [groups,
            // out] matrix read a row at a time, stored minus one in
            // AutoGPTQ's format.
            let offset = if format == Format::Gptq4 { 1.0 } else { 0.0 };
            let per_row = out.div_ceil(8);
            let zeros = (0..groups * out)
                .map(|i| {
                    let (g, o) = (i / out, i % out);
                    f32::from(nibble(qzeros.data, (g * per_row + o / 8) * 4, o % 8)) + offset
                })
                .collect();
            (unpack_int4_rows(qweight.data, (fan_in, out)), zeros)
        };
        let codes = Codes::Uint4(
            (0..out * fan_in)
                .map(|i| by_input[(i % fan_in) * out + i / fan_in] as u8)
                .collect(),
        );
        let scales = self.f32_values(&format!("{stem}.scales"), &[groups, out])?;
        let g_idx = format!("{stem}.g_idx");
        let group: Vec<u32> = if format != Format::Awq4 && self.has_tensor(&g_idx) {
            let raw = int32(&g_idx, &[fan_in])?;
            let path = self.file_of(&g_idx).unwrap_or(Path::new("")).to_path_buf();
            raw.data
                .chunks_exact(4)
                .map(|b| {
                    let g = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    u32::try_from(g)
                        .ok()
                        .filter(|&g| (g as usize) < groups)
                        .ok_or_else(|| {
                            FileError::model(
                                &path,
                                &g_idx,
                                format!("group {g} is not below {groups}"),
                            )
                        })
                })
                .collect::<Result<_>>()?
        } else {
            (0..fan_in).map(|k| (k / group_size) as u32).collect()
        };
        Ok(QuantizedMatrix {
            out,
            fan_in,
            codes,
            scales,
            zeros: Some(zeros),
            group,
        })
    }
}
