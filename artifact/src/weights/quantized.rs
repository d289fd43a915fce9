//! A quantized weight read from a checkpoint's tensors into the stored
//! form of [`QuantizedMatrix`], in any of the layouts of
//! [`crate::quantization`].

use std::path::Path;

use safetensors::Dtype;

use super::{RawTensor, WeightFiles};
use crate::error::{FileError, Result};
use crate::quantization::{
    Codes, Format, QuantizedMatrix, Strategy, by_group, input_groups, nibble, packed_value,
    scale_shape, unpack_awq, unpack_int4_rows, word_at,
};

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
        } else if q.format == Format::TransformersFp8 {
            (
                self.transformers_fp8_matrix(q.strategy, name, (out, fan_in))?,
                format!("{stem}.weight_scale_inv"),
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
            Format::PackedInt4 | Format::PackedInt8 => {
                let bits = if format == Format::PackedInt4 { 4 } else { 8 };
                self.check_weight_shape(stem, (out, fan_in))?;
                let per_row = (fan_in * bits).div_ceil(32);
                let words = self.stored(
                    &format!("{stem}.weight_packed"),
                    Dtype::I32,
                    &[out, per_row],
                    format,
                )?;
                // Each value is stored plus 2^(bits - 1).
                let offset = 1i32 << (bits - 1);
                let values = (0..out * fan_in).map(|i| {
                    let (o, c) = (i / fan_in, i % fan_in);
                    let word = |w: usize| word_at(words.data, o * per_row + w);
                    packed_value(word, bits, c) as i32 - offset
                });
                if bits == 4 {
                    Codes::Int4(values.map(|v| v as i8).collect())
                } else {
                    Codes::Int8(values.map(|v| v as i8).collect())
                }
            }
            Format::Gptq4
            | Format::Gptq4V2
            | Format::Awq4
            | Format::TransformersFp8
            | Format::Mxfp4 => {
                unreachable!("{} is read by its own reader", format.name())
            }
        };
        let scale_shape = scale_shape(strategy, out, fan_in);
        let scales = self.f32_values(&format!("{stem}.weight_scale"), &scale_shape)?;
        let zero_point = format!("{stem}.weight_zero_point");
        let zeros = match (symmetric, format) {
            (true, _) => None,
            // Packed like the weights, each plus 2^(bits - 1), but along
            // the output: output o at bit bits · o of its group's column
            // of words.
            (false, Format::PackedInt4 | Format::PackedInt8) => {
                let bits = if format == Format::PackedInt4 { 4 } else { 8 };
                let groups = scale_shape[1];
                let rows = (out * bits).div_ceil(32);
                let words = self.stored(&zero_point, Dtype::I32, &[rows, groups], format)?;
                let offset = 1i32 << (bits - 1);
                let flat = (0..out * groups)
                    .map(|i| {
                        let (o, g) = (i / groups, i % groups);
                        let word = |w: usize| word_at(words.data, w * groups + g);
                        (packed_value(word, bits, o) as i32 - offset) as f32
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
            group: input_groups(strategy, fan_in),
        })
    }

    /// `W.weight_shape` beside packed codes, when the checkpoint has it
    /// (int32 or int64): the matrix's `[out, in]`.
    fn check_weight_shape(&self, stem: &str, (out, fan_in): (usize, usize)) -> Result<()> {
        let name = format!("{stem}.weight_shape");
        if !self.has_tensor(&name) {
            return Ok(());
        }
        let raw = self.raw(&name)?;
        let path = self.file_of(&name).unwrap_or(Path::new("")).to_path_buf();
        let dims: Vec<i64> = match raw.dtype {
            Dtype::I32 => raw
                .data
                .chunks_exact(4)
                .map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                .collect(),
            Dtype::I64 => raw
                .data
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect(),
            other => {
                return Err(FileError::model(
                    &path,
                    &name,
                    format!("dtype {other:?} is not supported; expected I32 or I64"),
                ));
            }
        };
        if dims != [out as i64, fan_in as i64] {
            return Err(FileError::model(
                &path,
                &name,
                format!("says {dims:?}, but the model's config makes the weight [{out}, {fan_in}]"),
            ));
        }
        Ok(())
    }

    /// A weight in transformers' `fp8` format: `W.weight` FP8 e4m3 and
    /// `W.weight_scale_inv` per block (`[⌈out / rows⌉, ⌈in / cols⌉]`; one
    /// block for `weight_block_size: null`), `code · scale_inv`.
    fn transformers_fp8_matrix(
        &self,
        strategy: Strategy,
        name: &str,
        (out, fan_in): (usize, usize),
    ) -> Result<QuantizedMatrix> {
        let stem = name.strip_suffix(".weight").unwrap_or(name);
        let format = Format::TransformersFp8;
        let codes = Codes::Fp8E4m3(
            self.stored(name, Dtype::F8_E4M3, &[out, fan_in], format)?
                .data
                .to_vec(),
        );
        // One block for the whole matrix without a block size.
        let strategy = match strategy {
            Strategy::Tensor => Strategy::Block {
                rows: out.max(1),
                cols: fan_in.max(1),
            },
            other => other,
        };
        let scales = self.f32_values(
            &format!("{stem}.weight_scale_inv"),
            &scale_shape(strategy, out, fan_in),
        )?;
        Ok(QuantizedMatrix {
            out,
            fan_in,
            codes,
            scales: by_group(strategy, out, fan_in, scales),
            zeros: None,
            group: input_groups(strategy, fan_in),
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
            // GPTQ and AWQ configurations never make blocks.
            Strategy::Tensor | Strategy::Channel | Strategy::Block { .. } => fan_in,
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
