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
    use crate::quantization::FP4_E2M1;
    use crate::weights::WeightFiles;
    use safetensors::{Dtype, tensor::TensorView};

    /// A model directory with one MXFP4 parameter `p` of one expert, 32
    /// inputs and 2 outputs: codes 0..15 then 15..0 for output 0, each
    /// code 3 for output 1; scales 127 (×1) and `second`.
    fn mxfp4_dir(second: u8) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let codes: Vec<u8> = (0..16u8).chain((0..16u8).rev()).collect();
        let mut blocks: Vec<u8> = codes.chunks(2).map(|p| p[0] | (p[1] << 4)).collect();
        blocks.extend([0x33u8; 16]);
        let scales = [127u8, second];
        let tensors = [
            (
                "p_blocks",
                TensorView::new(Dtype::U8, vec![1, 2, 1, 16], &blocks).unwrap(),
            ),
            (
                "p_scales",
                TensorView::new(Dtype::U8, vec![1, 2, 1], &scales).unwrap(),
            ),
        ];
        safetensors::serialize_to_file(tensors, None, &dir.path().join("model.safetensors"))
            .unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"quantization_config": {"quant_method": "mxfp4"}}"#,
        )
        .unwrap();
        dir
    }

    #[test]
    fn mxfp4_blocks_read_low_nibble_first_under_their_power_of_two() {
        let dir = mxfp4_dir(129);
        let files = WeightFiles::open_model_dir(dir.path()).unwrap();
        let m = files.mxfp4_experts("p", (1, 32, 2)).unwrap().unwrap();
        let w = m[0].to_f32();
        for k in 0..32 {
            let code = if k < 16 { k } else { 31 - k };
            assert_eq!(w[k], FP4_E2M1[code], "output 0, input {k}");
            assert_eq!(w[32 + k], FP4_E2M1[3] * 4.0, "output 1, input {k}");
        }
        // Not stored so: None; a wrong shape or a NaN scale: refused.
        assert!(files.mxfp4_experts("q", (1, 32, 2)).unwrap().is_none());
        let e = files
            .mxfp4_experts("p", (1, 64, 2))
            .unwrap_err()
            .to_string();
        assert!(e.contains("p_blocks") && e.contains("shape"), "{e}");
        let dir = mxfp4_dir(255);
        let files = WeightFiles::open_model_dir(dir.path()).unwrap();
        let e = files
            .mxfp4_experts("p", (1, 32, 2))
            .unwrap_err()
            .to_string();
        assert!(e.contains("p_scales") && e.contains("NaN"), "{e}");
    }

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
