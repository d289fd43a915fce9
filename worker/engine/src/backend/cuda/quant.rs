//! Quantized base weights on the device: the codes at their width (a byte
//! each for int8 and FP8, two to a byte for 4-bit and MXFP4), scales and
//! zero points in f32 (MXFP4's scales as their E8M0 bytes), dequantized
//! inside the projections (`quant.cu`), never expanded in device memory
//! for good. GPT-OSS's MXFP4 experts are one such layer per expert
//! projection (`moe.rs`).
//!
//! A projection of few tokens (decode) runs `qmatmul`, which reads each
//! code once for a tile of tokens and multiplies in f32; a projection of
//! more tokens than [`FUSED_MAX_TOKENS`] dequantizes one part at a time
//! into a scratch matrix in the weights' type and runs cuBLAS on it, so
//! prefill keeps the tensor cores. FP8 weights of a checkpoint that
//! quantizes its activations too (`input_activations`) run as FP8 GEMMs
//! through cuBLASLt on compute 8.9 and newer ([`super::fp8`]).
//!
//! [`HostPart`] is the layout the kernels read, built and checked on the
//! host: [`HostPart::weight`] reads it exactly as `q_weight` does, and
//! equals [`QuantizedMatrix::weight`] for every weight (unit tests here,
//! on every quantized fixture in `tests/quantized.rs`).

use cudarc::driver::CudaSlice;

use lorafleet_artifact::quantization::{
    Codes, FP4_E2M1, Format, InputGranularity, InputKind, InputQuantization, Quantization,
    QuantizedMatrix, Strategy, fp8_e4m3_to_f32,
};

use super::device::{Arg, Device, cuda};
use super::fp8::Fp8Gemm;
use super::{CudaBackend, Dtype, Layer, Mlp, Weights};
use crate::error::{EngineError, Result};
use crate::lora::Projection;
use crate::model::{ModelConfig, WeightFiles};

/// The most tokens a projection runs through the fused kernel; more go
/// through a dequantized scratch matrix and cuBLAS.
pub const FUSED_MAX_TOKENS: usize = 16;

/// Tokens per block of `qmatmul` (`QT` in `quant.cu`).
const QT: usize = 8;

/// How a part's codes are stored, as `quant.cu` numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartFormat {
    /// A signed byte per weight.
    Int8 = 0,
    /// Unsigned 4-bit values, two to a byte, the even column low.
    Uint4 = 1,
    /// FP8 e4m3, a byte per weight.
    Fp8 = 2,
    /// MXFP4: FP4 E2M1 values, two to a byte, the even column low, with
    /// E8M0 scale bytes (GPT-OSS's experts).
    Fp4 = 3,
}

/// One quantized matrix laid out as the kernels read it (see `quant.cu`).
#[derive(Debug, Clone, PartialEq)]
pub struct HostPart {
    pub rows: usize,
    pub fan_in: usize,
    pub format: PartFormat,
    pub codes: Vec<u8>,
    pub row_bytes: usize,
    /// `[groups, rows]` (empty for MXFP4, whose scales are `e8m0`).
    pub scales: Vec<f32>,
    /// MXFP4's scales as the checkpoint holds them, a byte `e` each for
    /// 2^(e - 127), `[groups, rows]`; empty for every other format.
    pub e8m0: Vec<u8>,
    /// `[groups, rows]`, or `None`: every zero point is then `offset`.
    pub zeros: Option<Vec<f32>>,
    pub offset: f32,
    /// Input `k`'s group is `k / gsize`, unless `gidx` gives it.
    pub gsize: usize,
    pub gidx: Option<Vec<i32>>,
}

impl HostPart {
    pub fn new(m: &QuantizedMatrix) -> HostPart {
        let (rows, fan_in) = (m.out, m.fan_in);
        let (format, row_bytes) = match m.codes {
            Codes::Int8(_) => (PartFormat::Int8, fan_in),
            Codes::Fp8E4m3(_) => (PartFormat::Fp8, fan_in),
            Codes::Int4(_) | Codes::Uint4(_) => (PartFormat::Uint4, fan_in.div_ceil(2)),
            Codes::Fp4E2m1(_) => (PartFormat::Fp4, fan_in.div_ceil(2)),
        };
        let mut codes = vec![0u8; rows * row_bytes];
        // Signed 4-bit values are stored plus 8, with every zero point 8
        // higher: (v + 8) - (z + 8) is v - z exactly.
        let shift = matches!(m.codes, Codes::Int4(_));
        for o in 0..rows {
            for k in 0..fan_in {
                let i = o * fan_in + k;
                let at = o * row_bytes;
                match &m.codes {
                    Codes::Int8(c) => codes[at + k] = c[i] as u8,
                    Codes::Fp8E4m3(c) => codes[at + k] = c[i],
                    Codes::Int4(c) => {
                        codes[at + k / 2] |= (((c[i] + 8) as u8) & 0xf) << (4 * (k % 2))
                    }
                    Codes::Uint4(c) | Codes::Fp4E2m1(c) => {
                        codes[at + k / 2] |= (c[i] & 0xf) << (4 * (k % 2))
                    }
                }
            }
        }
        let (zeros, offset) = match (&m.zeros, shift) {
            (Some(z), true) => (Some(z.iter().map(|z| z + 8.0).collect()), 0.0),
            (Some(z), false) => (Some(z.clone()), 0.0),
            (None, true) => (None, 8.0),
            (None, false) => (None, 0.0),
        };
        // Groups of consecutive inputs when the group index says so (every
        // format but GPTQ's act-order); the index itself otherwise.
        let gsize = m
            .group
            .iter()
            .position(|&g| g != 0)
            .unwrap_or(fan_in)
            .max(1);
        let regular = m
            .group
            .iter()
            .enumerate()
            .all(|(k, &g)| g as usize == k / gsize);
        // MXFP4's scales back to their E8M0 bytes (the reader made each
        // the power of two its byte stands for), a quarter of f32's size.
        let (scales, e8m0) = match format {
            PartFormat::Fp4 => (Vec::new(), m.scales.iter().map(|&s| e8m0_byte(s)).collect()),
            _ => (m.scales.clone(), Vec::new()),
        };
        HostPart {
            rows,
            fan_in,
            format,
            codes,
            row_bytes,
            scales,
            e8m0,
            zeros,
            offset,
            gsize: if regular { gsize } else { 0 },
            gidx: (!regular).then(|| m.group.iter().map(|&g| g as i32).collect()),
        }
    }

    /// Weight `(o, k)` read from this layout as `q_weight` reads it.
    pub fn weight(&self, o: usize, k: usize) -> f32 {
        let row = &self.codes[o * self.row_bytes..];
        let v = match self.format {
            PartFormat::Int8 => f32::from(row[k] as i8),
            PartFormat::Uint4 => f32::from((row[k / 2] >> (4 * (k % 2))) & 0xf),
            PartFormat::Fp8 => fp8_e4m3_to_f32(row[k]),
            PartFormat::Fp4 => FP4_E2M1[usize::from((row[k / 2] >> (4 * (k % 2))) & 0xf)],
        };
        let g = match &self.gidx {
            Some(gidx) => gidx[k] as usize,
            None => k / self.gsize,
        };
        let s = g * self.rows + o;
        if self.format == PartFormat::Fp4 {
            return v * e8m0_value(self.e8m0[s]);
        }
        let z = self.zeros.as_ref().map_or(self.offset, |z| z[s]);
        (v - z) * self.scales[s]
    }

    /// Whether one scale covers each whole row (per tensor or per
    /// channel, no zero points): what an FP8 GEMM can scale after the
    /// product.
    pub fn row_scaled(&self) -> bool {
        self.zeros.is_none() && self.gidx.is_none() && self.gsize >= self.fan_in
    }

    /// Device bytes: codes, scales, zero points and group index.
    pub fn bytes(&self) -> usize {
        self.codes.len()
            + 4 * self.scales.len()
            + self.e8m0.len()
            + self.zeros.as_ref().map_or(0, |z| 4 * z.len())
            + self.gidx.as_ref().map_or(0, |g| 4 * g.len())
    }
}

/// An E8M0 scale's byte: `s` is 2^(e - 127), as the checkpoint reader
/// builds it from that byte.
fn e8m0_byte(s: f32) -> u8 {
    let bits = s.to_bits();
    if bits == 1 << 22 {
        return 0;
    }
    assert!(
        bits & 0x807f_ffff == 0 && bits != 0,
        "an MXFP4 scale {s} is not a power of two E8M0 holds"
    );
    (bits >> 23) as u8
}

/// 2^(e - 127), as `e8m0_value` in `quant.cu` reads it.
fn e8m0_value(e: u8) -> f32 {
    if e == 0 {
        f32::from_bits(1 << 22)
    } else {
        f32::from_bits(u32::from(e) << 23)
    }
}

/// One part on the device; its codes start `codes_at` bytes into the
/// layer's codes.
struct Part {
    codes_at: usize,
    row_bytes: usize,
    format: PartFormat,
    /// f32 `[groups, rows]`, or MXFP4's E8M0 bytes, as raw bytes.
    scales: CudaSlice<u8>,
    zeros: Option<CudaSlice<f32>>,
    offset: f32,
    gsize: usize,
    gidx: Option<CudaSlice<i32>>,
    rows: usize,
}

/// A quantized linear layer: one part per fused projection (q, k and v
/// stacked), each with its own scales and groups, their codes one after
/// another in one buffer. When every part is FP8 with a scale per row,
/// that buffer is the whole `[fan_out, fan_in]` FP8 matrix an FP8 GEMM
/// reads, and `row_scales` its rows' scales.
pub(super) struct QuantLinear {
    codes: CudaSlice<u8>,
    parts: Vec<Part>,
    row_scales: Option<CudaSlice<f32>>,
    fan_in: usize,
}

impl QuantLinear {
    /// Uploads the parts of one (fused) projection, in output order; with
    /// `fp8_rows`, also each row's scale for FP8 GEMMs when every part can
    /// run as one (FP8, row-scaled).
    pub fn upload(dev: &Device, parts: &[HostPart], fp8_rows: bool) -> Result<QuantLinear> {
        let s = &dev.stream;
        let up_f32 = |v: &[f32]| s.clone_htod(v).map_err(cuda("uploading quantized weights"));
        let mut all = Vec::with_capacity(parts.iter().map(|p| p.codes.len()).sum());
        let mut uploaded = Vec::with_capacity(parts.len());
        for p in parts {
            let scales: Vec<u8> = match p.format {
                PartFormat::Fp4 => p.e8m0.clone(),
                _ => p.scales.iter().flat_map(|v| v.to_le_bytes()).collect(),
            };
            uploaded.push(Part {
                codes_at: all.len(),
                row_bytes: p.row_bytes,
                format: p.format,
                scales: s
                    .clone_htod(&scales)
                    .map_err(cuda("uploading quantized weights"))?,
                zeros: p.zeros.as_deref().map(up_f32).transpose()?,
                offset: p.offset,
                gsize: p.gsize,
                gidx: p
                    .gidx
                    .as_deref()
                    .map(|g| s.clone_htod(g).map_err(cuda("uploading quantized weights")))
                    .transpose()?,
                rows: p.rows,
            });
            all.extend_from_slice(&p.codes);
        }
        let row_scales = if fp8_rows && fp8_ready(parts) {
            let scales: Vec<f32> = parts
                .iter()
                .flat_map(|p| p.scales[..p.rows].iter().copied())
                .collect();
            Some(up_f32(&scales)?)
        } else {
            None
        };
        Ok(QuantLinear {
            codes: s
                .clone_htod(&all)
                .map_err(cuda("uploading quantized weights"))?,
            parts: uploaded,
            row_scales,
            fan_in: parts.first().map_or(0, |p| p.fan_in),
        })
    }

    /// The FP8 matrix and its row scales, when the layer runs FP8 GEMMs.
    pub fn fp8_matrix(&self, dev: &Device) -> Option<(u64, u64)> {
        self.row_scales
            .as_ref()
            .map(|r| (dev.p(&self.codes), dev.p(r)))
    }

    /// The inputs of every part.
    pub fn fan_in(&self) -> usize {
        self.fan_in
    }

    /// The rows of the largest part.
    pub fn largest_part(&self) -> usize {
        self.parts.iter().map(|p| p.rows).max().unwrap_or(0)
    }

    fn args(&self, dev: &Device, p: &Part, fan_in: usize) -> Vec<Arg> {
        vec![
            Arg::Ptr(dev.p(&self.codes) + p.codes_at as u64),
            Arg::I64(p.row_bytes as i64),
            Arg::I32(p.format as i32),
            Arg::Ptr(dev.p(&p.scales)),
            Arg::Ptr(p.zeros.as_ref().map_or(0, |z| dev.p(z))),
            Arg::F32(p.offset),
            Arg::I32(p.gsize as i32),
            Arg::Ptr(p.gidx.as_ref().map_or(0, |g| dev.p(g))),
            Arg::I32(p.rows as i32),
            Arg::I32(fan_in as i32),
        ]
    }

    /// `y[n, fan_out] = x[n, fan_in] · Wᵀ` through the fused kernel, one
    /// launch per part: x in the weights' type, y f32.
    pub fn fused(&self, dev: &Device, fan_in: usize, x: u64, y: u64, n: usize) -> Result<()> {
        let fan_out: usize = self.parts.iter().map(|p| p.rows).sum();
        let mut offset = 0;
        for p in &self.parts {
            let mut args = self.args(dev, p, fan_in);
            args.extend([
                Arg::Ptr(x),
                Arg::I32(n as i32),
                Arg::Ptr(y),
                Arg::I32(fan_out as i32),
                Arg::I32(offset as i32),
            ]);
            let grid = (p.rows.div_ceil(8) as u32, n.div_ceil(QT) as u32, 1);
            dev.launch("qmatmul", grid, 256, &args)?;
            offset += p.rows;
        }
        Ok(())
    }

    /// For each part in order: dequantizes it into `scratch` (the
    /// weights' type, at least the largest part) and hands `gemm` the
    /// part's rows and its first output column.
    pub fn dequantized(
        &self,
        dev: &Device,
        fan_in: usize,
        scratch: u64,
        mut gemm: impl FnMut(usize, usize) -> Result<()>,
    ) -> Result<()> {
        let mut offset = 0;
        for p in &self.parts {
            let mut args = self.args(dev, p, fan_in);
            args.push(Arg::Ptr(scratch));
            dev.launch(
                "qdequant",
                Device::elementwise_grid(p.rows * fan_in),
                256,
                &args,
            )?;
            gemm(p.rows, offset)?;
            offset += p.rows;
        }
        Ok(())
    }
}

/// Whether the parts can run as one FP8 GEMM: every one FP8 with a scale
/// per row, and the whole a shape cuBLASLt takes.
pub fn fp8_ready(parts: &[HostPart]) -> bool {
    let rows: usize = parts.iter().map(|p| p.rows).sum();
    parts
        .iter()
        .all(|p| p.format == PartFormat::Fp8 && p.row_scaled())
        && parts
            .first()
            .is_some_and(|p| super::fp8::shape_fits(rows, p.fan_in))
}

/// What quantized linear weights take on the device, planned from the
/// checkpoint's configuration before anything is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QuantPlan {
    /// Bytes those weights would take dense in the weights' type.
    pub replaced: u64,
    /// Bytes they take quantized ([`HostPart::bytes`]; GPTQ's group index
    /// counted whether or not its groups are in order).
    pub quantized: u64,
    /// The scratch a many-token projection dequantizes one part into,
    /// and the FP8 GEMMs' activation buffers.
    pub scratch: u64,
}

impl QuantPlan {
    /// The plan for `files`' layers, or `None` when no linear weight is
    /// stored quantized.
    pub fn new(
        files: &WeightFiles,
        c: &ModelConfig,
        dtype: Dtype,
        max_tokens: usize,
        fp8_gemms: bool,
    ) -> Option<QuantPlan> {
        let q = files.quantization()?;
        let w = dtype.bytes() as u64;
        let (mut plan, mut largest, mut widest) = (QuantPlan::default(), 0u64, 0u64);
        use Projection::*;
        // The projections as the checkpoint stores them: one tensor each,
        // or fused (Phi-3's `qkv_proj` and `gate_up_proj`).
        let groups: &[&[Projection]] = if c.moe.is_some() {
            &[&[Q, K, V], &[O]]
        } else {
            &[&[Q, K, V], &[O], &[Gate, Up], &[Down]]
        };
        for l in 0..c.num_layers {
            for group in groups {
                let fan_in = group[0].shape(c).0 as u64;
                let tensors = lorafleet_artifact::adapter::stored_tensors(c, group);
                // A group that mixes quantized and dense tensors is read
                // dense (`read_parts`).
                let quantized = tensors.iter().all(|(path, _)| {
                    files.stored_quantized(&format!("model.layers.{l}.{path}.weight"))
                });
                if !quantized {
                    continue;
                }
                for (_, out) in tensors {
                    let out = out as u64;
                    plan.replaced += fan_in * out * w;
                    plan.quantized += planned_bytes(q, out, fan_in);
                    largest = largest.max(fan_in * out);
                    widest = widest.max(fan_in);
                }
            }
        }
        // MXFP4 experts (GPT-OSS): their bytes are the MoE block's
        // (`moe::weight_bytes`); a step of many tokens dequantizes one
        // expert's projection at a time into the scratch.
        if c.moe.is_some() && super::moe::mxfp4(c) {
            let (h, i) = (c.hidden_size as u64, c.intermediate_size as u64);
            largest = largest.max(2 * i * h);
            widest = widest.max(h.max(i));
        }
        if largest == 0 {
            return None;
        }
        plan.scratch = largest * w;
        // The step's inputs as quantized layers read them.
        if q.input.is_some() {
            plan.scratch += max_tokens as u64 * widest * w;
        }
        if fp8_gemms {
            plan.scratch += max_tokens as u64 * (widest + 4);
        }
        Some(plan)
    }
}

/// Device bytes of one quantized `[out, in]` weight, as [`HostPart::bytes`]
/// counts them.
fn planned_bytes(q: &Quantization, out: u64, fan_in: u64) -> u64 {
    let (row_bytes, gptq) = match q.format {
        Format::Int8 | Format::PackedInt8 | Format::Fp8E4m3 | Format::TransformersFp8 => {
            (fan_in, false)
        }
        Format::PackedInt4 | Format::Awq4 | Format::Mxfp4 => (fan_in.div_ceil(2), false),
        Format::Gptq4 | Format::Gptq4V2 => (fan_in.div_ceil(2), true),
    };
    let groups = match q.strategy {
        Strategy::Tensor | Strategy::Channel => 1,
        Strategy::Group(g) | Strategy::Block { cols: g, .. } => fan_in.div_ceil(g as u64),
    };
    let zeros = !q.symmetric || matches!(q.format, Format::Gptq4 | Format::Gptq4V2 | Format::Awq4);
    let per = groups * out * 4;
    // FP8 GEMMs add a scale per row, for a part whose scales are per row
    // (`HostPart::row_scaled`: one group, no zero points).
    let rows = if q.fp8_inputs_per_token() && groups == 1 && !zeros {
        4 * out
    } else {
        0
    };
    out * row_bytes + per * (1 + u64::from(zeros)) + if gptq { 4 * fan_in } else { 0 } + rows
}

/// The parts of the projections `projs` of the layer at `prefix`, when
/// every one is stored quantized (a stack that mixes them is read dense).
pub(super) fn read_parts(
    files: &WeightFiles,
    prefix: &str,
    projs: &[Projection],
    c: &ModelConfig,
) -> Result<Option<Vec<HostPart>>> {
    let mut parts = Vec::with_capacity(projs.len());
    let fan_in = projs[0].shape(c).0;
    let tensors = lorafleet_artifact::adapter::stored_tensors(c, projs);
    // A group read dense would drop the quantized parts' input scheme: the
    // CPU backend refuses such a checkpoint, and so does this one.
    let quantized = |path: &str| files.stored_quantized(&format!("{prefix}.{path}.weight"));
    let some = tensors.iter().any(|(p, _)| quantized(p));
    let all = tensors.iter().all(|(p, _)| quantized(p));
    if some && !all && files.quantization().is_some_and(|q| q.input.is_some()) {
        return Err(EngineError::Backend(format!(
            "{prefix}: the projections fused with {} are not all quantized, and its inputs are \
             quantized on the fly (`input_activations`); they cannot share one input",
            tensors[0].0
        )));
    }
    for (path, out) in tensors {
        let name = format!("{prefix}.{path}.weight");
        let Some(m) = files.quantized_matrix(&name, &[out, fan_in])? else {
            return Ok(None);
        };
        if out > i32::MAX as usize || fan_in > i32::MAX as usize {
            return Err(EngineError::Backend(format!(
                "cuda: quantized weight {name} of {out} x {fan_in} is too large for the kernels"
            )));
        }
        parts.push(HostPart::new(&m));
    }
    Ok(Some(parts))
}

/// What quantized projections need beside their weights: the scratch a
/// many-token projection dequantizes a part into, and for FP8 GEMMs the
/// step's activations in FP8 with a scale per token.
pub(super) struct QuantScratch {
    w: CudaSlice<u8>,
    max_tokens: usize,
    fp8: Option<Fp8Scratch>,
    /// The checkpoint's input scheme and the step's inputs as quantized
    /// layers read them (`[max_tokens, widest fan_in]`, the weights' type).
    inputs: Option<(InputQuantization, CudaSlice<u8>)>,
}

/// FP8 GEMMs and the step's activations as they read them: e4m3 codes
/// `[max_tokens, widest fan_in]` and a scale per token. Goes before the
/// device (field order of the backend).
struct Fp8Scratch {
    gemm: Fp8Gemm,
    xq: CudaSlice<u8>,
    row_scale: CudaSlice<f32>,
}

impl QuantScratch {
    pub fn new(
        dev: &Device,
        layers: &[Layer],
        dtype: Dtype,
        max_tokens: usize,
        fp8: Option<Fp8Gemm>,
        input: Option<InputQuantization>,
    ) -> Result<QuantScratch> {
        let (mut largest, mut widest) = (0, 0);
        for layer in layers {
            let mut linears = vec![&layer.qkv, &layer.o];
            if let Mlp::Dense { gate_up, down } = &layer.mlp {
                linears.extend([gate_up, down]);
            }
            for lin in linears {
                if let Weights::Quantized(q) = &lin.w {
                    largest = largest.max(q.largest_part() * lin.fan_in);
                    widest = widest.max(lin.fan_in);
                }
            }
            if let Mlp::Moe(m) = &layer.mlp {
                let (part, fan_in) = m.largest_quantized();
                largest = largest.max(part);
                widest = widest.max(fan_in);
            }
        }
        let s = &dev.stream;
        let alloc = |n: usize| {
            s.alloc_zeros::<u8>(n.max(1))
                .map_err(cuda("allocating quantized scratch"))
        };
        let fp8 = match fp8 {
            Some(gemm) => Some(Fp8Scratch {
                gemm,
                xq: alloc(max_tokens * widest)?,
                row_scale: s
                    .alloc_zeros::<f32>(max_tokens.max(1))
                    .map_err(cuda("allocating quantized scratch"))?,
            }),
            None => None,
        };
        let inputs = match input {
            Some(q) => Some((q, alloc(max_tokens * widest * dtype.bytes())?)),
            None => None,
        };
        Ok(QuantScratch {
            w: alloc(largest * dtype.bytes())?,
            max_tokens,
            fp8,
            inputs,
        })
    }
}

impl CudaBackend {
    /// `y[n, fan_out] = x[n, fan_in] · Wᵀ` for a quantized layer: an FP8
    /// GEMM when the layer runs them, the fused kernel for few tokens, a
    /// dequantized part and cuBLAS for many.
    pub(super) fn quantized_linear(
        &self,
        q: &QuantLinear,
        fan_in: usize,
        fan_out: usize,
        x: u64,
        y: u64,
        n: usize,
    ) -> Result<()> {
        let dev = &self.dev;
        let scratch = self.quant.as_ref().ok_or_else(|| {
            EngineError::Backend("cuda: a quantized layer without its scratch".into())
        })?;
        if n > scratch.max_tokens {
            return Err(EngineError::Backend(format!(
                "cuda: a step of {n} tokens passes the {} the backend was sized for",
                scratch.max_tokens
            )));
        }
        if let (Some(f), Some((w, w_scales))) = (&scratch.fp8, q.fp8_matrix(dev)) {
            let (gemm, xq, rs) = (&f.gemm, dev.p(&f.xq), dev.p(&f.row_scale));
            dev.launch(
                "fp8_rows",
                (n as u32, 1, 1),
                256,
                &[
                    Arg::Ptr(x),
                    Arg::I32(fan_in as i32),
                    Arg::Ptr(xq),
                    Arg::Ptr(rs),
                ],
            )?;
            gemm.matmul(dev, w, xq, y, fan_out, (fan_out, n, fan_in))?;
            return dev.launch(
                "fp8_scale",
                Device::elementwise_grid(n * fan_out),
                256,
                &[
                    Arg::Ptr(y),
                    Arg::Ptr(rs),
                    Arg::Ptr(w_scales),
                    Arg::I32(n as i32),
                    Arg::I32(fan_out as i32),
                ],
            );
        }
        // Inputs quantized as the checkpoint's scheme says (FP8 GEMMs,
        // above, quantize theirs per token themselves).
        let x = match &scratch.inputs {
            Some((input, buf)) => {
                let xq = dev.p(buf);
                let (span, fp8) = match (input.granularity, input.kind) {
                    (InputGranularity::Token, kind) => (fan_in, kind == InputKind::Fp8E4m3),
                    (InputGranularity::Group(g), kind) => {
                        (g.clamp(1, fan_in.max(1)), kind == InputKind::Fp8E4m3)
                    }
                };
                dev.launch(
                    "quant_inputs",
                    (n as u32, fan_in.div_ceil(span) as u32, 1),
                    256,
                    &[
                        Arg::Ptr(x),
                        Arg::I32(fan_in as i32),
                        Arg::I32(span as i32),
                        Arg::I32(i32::from(fp8)),
                        Arg::Ptr(xq),
                    ],
                )?;
                xq
            }
            None => x,
        };
        if n <= FUSED_MAX_TOKENS {
            return q.fused(dev, fan_in, x, y, n);
        }
        let w = dev.p(&scratch.w);
        let ty = self.dtype.cuda_type();
        q.dequantized(dev, fan_in, w, |rows, offset| {
            self.gemm_ld(w, ty, fan_in, rows, x, y + 4 * offset as u64, n, fan_out)
        })
    }

    /// Whether this backend's FP8 layers run FP8 GEMMs (W8A8) rather than
    /// dequantizing their weights.
    pub fn fp8_gemms(&self) -> bool {
        self.quant.as_ref().is_some_and(|q| q.fp8.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix(codes: Codes, zeros: Option<Vec<f32>>, group: Vec<u32>) -> QuantizedMatrix {
        let (out, fan_in) = (3, group.len());
        let groups = group.iter().max().map_or(1, |g| *g as usize + 1);
        QuantizedMatrix {
            out,
            fan_in,
            codes,
            scales: (0..groups * out).map(|i| 0.5 + i as f32 * 0.25).collect(),
            zeros,
            group,
        }
    }

    fn assert_same(m: &QuantizedMatrix) -> HostPart {
        let p = HostPart::new(m);
        for o in 0..m.out {
            for k in 0..m.fan_in {
                assert_eq!(
                    p.weight(o, k).to_bits(),
                    m.weight(o, k).to_bits(),
                    "weight ({o}, {k}) of {:?}",
                    m.codes
                );
            }
        }
        p
    }

    #[test]
    fn every_format_reads_back_each_weight_bit_for_bit() {
        // 5 inputs: an odd row of 4-bit codes shares no byte with the next.
        let n = 15;
        let signed: Vec<i8> = (0..n).map(|i| (i as i8 % 16) - 8).collect();
        let unsigned: Vec<u8> = (0..n).map(|i| (i * 7 % 16) as u8).collect();
        let wide: Vec<i8> = (0..n).map(|i| (i as i8).wrapping_mul(37)).collect();
        let fp8: Vec<u8> = (0..n).map(|i| (i * 29 % 255) as u8).collect();
        let by_two = vec![0, 0, 1, 1, 2];
        let zeros = Some(vec![1.0, -2.0, 3.0, 0.0, 5.0, -1.0, 2.0, 7.0, -3.0]);
        let p = assert_same(&matrix(Codes::Int4(signed.clone()), None, by_two.clone()));
        assert_eq!(
            (p.format, p.row_bytes, p.offset, p.gsize),
            (PartFormat::Uint4, 3, 8.0, 2)
        );
        assert_same(&matrix(Codes::Int4(signed), zeros.clone(), by_two.clone()));
        assert_same(&matrix(
            Codes::Uint4(unsigned.clone()),
            zeros.clone(),
            by_two.clone(),
        ));
        let p = assert_same(&matrix(Codes::Int8(wide.clone()), None, vec![0; 5]));
        assert_eq!((p.gsize, p.row_scaled()), (5, true));
        assert_same(&matrix(Codes::Int8(wide), zeros.clone(), by_two));
        let p = assert_same(&matrix(Codes::Fp8E4m3(fp8.clone()), None, vec![0; 5]));
        assert!(p.row_scaled() && p.format == PartFormat::Fp8);
        // GPTQ's act-order: groups not in input order keep their index.
        let p = assert_same(&matrix(Codes::Uint4(unsigned), zeros, vec![2, 0, 1, 0, 2]));
        assert_eq!(
            (p.gsize, p.gidx.as_deref()),
            (0, Some(&[2, 0, 1, 0, 2][..]))
        );
        assert!(!p.row_scaled());
    }

    /// MXFP4 (GPT-OSS's experts): every E2M1 code under E8M0 scales from
    /// 2^-127 to 2^127 reads back as the checkpoint's weight, the scales
    /// held as their bytes.
    #[test]
    fn mxfp4_reads_back_each_weight_bit_for_bit_with_byte_scales() {
        let (out, fan_in) = (3, 64);
        let codes: Vec<u8> = (0..out * fan_in).map(|i| (i * 5 % 16) as u8).collect();
        let bytes = [0u8, 1, 100, 127, 140, 254];
        let m = QuantizedMatrix {
            out,
            fan_in,
            codes: Codes::Fp4E2m1(codes),
            scales: (0..2 * out)
                .map(|i| e8m0_value(bytes[i % bytes.len()]))
                .collect(),
            zeros: None,
            group: (0..fan_in as u32).map(|k| k / 32).collect(),
        };
        let p = assert_same(&m);
        assert_eq!(
            (p.format, p.row_bytes, p.gsize, p.scales.len()),
            (PartFormat::Fp4, 32, 32, 0)
        );
        assert_eq!(p.e8m0, [0, 1, 100, 127, 140, 254]);
        // Codes at half a byte, a scale byte per 32.
        assert_eq!(p.bytes(), out * fan_in / 2 + out * fan_in / 32);
    }
}
