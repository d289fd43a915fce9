//! A Mixture-of-Experts block's expert parameters stored as one tensor for
//! every expert (transformers 5's layout, and GPT-OSS's checkpoints): the
//! dense `[experts, in, out]` form and MXFP4's blocks and scales, read
//! into one `[out, in]` matrix per expert.

use safetensors::Dtype;

use super::WeightFiles;
use crate::error::{FileError, Result};
use crate::quantization::{Codes, Format, QuantizedMatrix};

/// The inputs an MXFP4 scale covers.
const MXFP4_GROUP: usize = 32;

impl WeightFiles {
    /// Whether parameter `name` of `[experts, in, out]` is stored as MXFP4
    /// blocks and scales (`{name}_blocks`, `{name}_scales`).
    pub fn stored_mxfp4(&self, name: &str) -> bool {
        self.quantization()
            .is_some_and(|q| q.format == Format::Mxfp4)
            && self.has_tensor(&format!("{name}_blocks"))
    }

    /// An `[experts, in, out]` parameter stored as MXFP4 (see
    /// [`crate::quantization`]), as one `[out, in]` matrix of codes and
    /// power-of-two scales per expert; `None` when it is not stored so.
    /// The blocks' and scales' dtypes and shapes are checked, and a scale
    /// of 255 (E8M0's NaN) is refused.
    pub fn mxfp4_experts(
        &self,
        name: &str,
        (experts, fan_in, out): (usize, usize, usize),
    ) -> Result<Option<Vec<QuantizedMatrix>>> {
        if !self.stored_mxfp4(name) {
            return Ok(None);
        }
        let (blocks_name, scales_name) = (format!("{name}_blocks"), format!("{name}_scales"));
        if !fan_in.is_multiple_of(MXFP4_GROUP) {
            return Err(FileError::model(
                self.file_of(&blocks_name)
                    .unwrap_or(std::path::Path::new("")),
                &blocks_name,
                format!("the input width {fan_in} is not a multiple of MXFP4's groups of 32"),
            ));
        }
        let groups = fan_in / MXFP4_GROUP;
        let typed = |tensor: &str, shape: &[usize]| -> Result<&[u8]> {
            let (raw, path) = self.shaped(tensor, shape)?;
            if raw.dtype != Dtype::U8 {
                return Err(FileError::model(
                    path,
                    tensor,
                    format!("dtype {:?} does not match MXFP4; expected U8", raw.dtype),
                ));
            }
            Ok(raw.data)
        };
        let blocks = typed(&blocks_name, &[experts, out, groups, MXFP4_GROUP / 2])?;
        let scales = typed(&scales_name, &[experts, out, groups])?;
        if let Some(at) = scales.iter().position(|&s| s == 0xff) {
            return Err(FileError::model(
                self.file_of(&scales_name)
                    .unwrap_or(std::path::Path::new("")),
                &scales_name,
                format!("holds 255 (E8M0's NaN) at element {at}"),
            ));
        }
        let per_expert = out * fan_in;
        Ok(Some(
            (0..experts)
                .map(|e| {
                    // Input k of output o: byte k / 2 of its row, the low
                    // nibble for even k.
                    let row = &blocks[e * per_expert / 2..(e + 1) * per_expert / 2];
                    let codes = (0..per_expert)
                        .map(|i| (row[i / 2] >> (4 * (i % 2))) & 0xf)
                        .collect();
                    // `[groups, out]`: 2^(s - 127).
                    let mut s = vec![0f32; groups * out];
                    for o in 0..out {
                        for g in 0..groups {
                            s[g * out + o] = e8m0(scales[(e * out + o) * groups + g]);
                        }
                    }
                    QuantizedMatrix {
                        out,
                        fan_in,
                        codes: Codes::Fp4E2m1(codes),
                        scales: s,
                        zeros: None,
                        group: (0..fan_in).map(|k| (k / MXFP4_GROUP) as u32).collect(),
                    }
                })
                .collect(),
        ))
    }

    /// An `[experts, in, out]` parameter stored dense, as one `[out, in]`
    /// f32 matrix per expert (bf16 and f16 widened exactly).
    pub fn dense_experts(
        &self,
        name: &str,
        (experts, fan_in, out): (usize, usize, usize),
    ) -> Result<Vec<Vec<f32>>> {
        let all = self.f32_values(name, &[experts, fan_in, out])?;
        Ok(all
            .chunks_exact(fan_in * out)
            .map(|w| transposed(w, fan_in, out))
            .collect())
    }

    /// [`WeightFiles::dense_experts`] as bf16 bits when the file stores the
    /// parameter in bf16; `None` for any other dtype.
    pub fn dense_experts_bf16(
        &self,
        name: &str,
        (experts, fan_in, out): (usize, usize, usize),
    ) -> Result<Option<Vec<Vec<u16>>>> {
        let Some(all) = self.bf16_bits(name, &[experts, fan_in, out])? else {
            return Ok(None);
        };
        Ok(Some(
            all.chunks_exact(fan_in * out)
                .map(|w| transposed(w, fan_in, out))
                .collect(),
        ))
    }
}

/// `[rows, cols]` row-major to `[cols, rows]`.
fn transposed<T: Copy + Default>(w: &[T], rows: usize, cols: usize) -> Vec<T> {
    let mut t = vec![T::default(); rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = w[r * cols + c];
        }
    }
    t
}

/// An E8M0 scale, `2^(e - 127)`, built from its bits so that it is exact
/// (`e = 0` is the subnormal 2^-127).
pub(crate) fn e8m0(e: u8) -> f32 {
    if e == 0 {
        f32::from_bits(1 << 22)
    } else {
        f32::from_bits(u32::from(e) << 23)
    }
}

#[cfg(test)]
mod tests {
    use super::e8m0;

    #[test]
    fn an_e8m0_scale_is_its_power_of_two() {
        assert_eq!(e8m0(127), 1.0);
        assert_eq!(e8m0(128), 2.0);
        assert_eq!(e8m0(120), 2f32.powi(-7));
        assert_eq!(e8m0(254), 2f32.powi(127));
        assert_eq!(e8m0(1), 2f32.powi(-126));
        assert_eq!(e8m0(0), 2f32.powi(-126) / 2.0);
    }
}
