//! A Mixture-of-Experts layer's weights on the device (the router, every
//! expert's gate/up and down, dense or MXFP4; GPT-OSS's biases), what they
//! take, and a step's buffers for the block.

use cudarc::driver::CudaSlice;
use rayon::prelude::*;

use super::super::Dtype;
use super::super::device::{Device, cuda};
use super::super::quant::{HostPart, QuantLinear};
use crate::error::Result;
use crate::model::config::{Architecture, MoeConfig};
use crate::model::{ModelConfig, WeightFiles};

/// One layer's router and experts on the device.
pub(in crate::backend::cuda) struct MoeLayer {
    /// `[experts, hidden]`, f32 (as the CPU backend holds it).
    pub(super) router: CudaSlice<f32>,
    /// `[experts, 2 * inter, hidden]`: each expert's `[gate | up]`.
    pub(super) gate_up: ExpertWeights,
    /// `[experts, hidden, inter]`.
    pub(super) down: ExpertWeights,
    /// GPT-OSS's biases, f32: the router's `[experts]`, each expert's
    /// `[gate | up]` `[experts, 2 * inter]` and down `[experts, hidden]`.
    pub(super) biases: Option<ExpertBiases>,
}

/// One projection of every expert: dense `[experts, out, in]` in the
/// weights' type, or each expert's MXFP4 codes and E8M0 scales as the
/// checkpoint holds them (dequantized inside the projection: `quant.cu`).
pub(super) enum ExpertWeights {
    Dense(CudaSlice<u8>),
    Mxfp4(Vec<QuantLinear>),
}

pub(super) struct ExpertBiases {
    pub(super) router: CudaSlice<f32>,
    pub(super) gate_up: CudaSlice<f32>,
    pub(super) down: CudaSlice<f32>,
}

impl MoeLayer {
    /// Reads layer `layer`'s router and experts, named as the model's
    /// family stores them, one expert at a time.
    pub(in crate::backend::cuda) fn load(
        files: &WeightFiles,
        c: &ModelConfig,
        moe: MoeConfig,
        layer: usize,
        dev: &Device,
        dtype: Dtype,
    ) -> Result<MoeLayer> {
        if moe.gpt_oss.is_some() {
            return Self::load_gpt_oss(files, c, moe, layer, dev, dtype);
        }
        let (h, i, experts) = (c.hidden_size, c.intermediate_size, moe.num_experts);
        let (block, [gate, up, down]) = match c.architecture {
            Architecture::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
            _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        };
        let prefix = format!("model.layers.{layer}.{block}");
        let st = &dev.stream;
        let up_err = cuda("uploading weights");
        let router = st
            .clone_htod(&files.f32(&format!("{prefix}.gate.weight"), &[experts, h])?)
            .map_err(&up_err)?;
        let w = dtype.bytes();
        let mut gate_up = st
            .alloc_zeros::<u8>(experts * 2 * i * h * w)
            .map_err(&up_err)?;
        let mut down_w = st.alloc_zeros::<u8>(experts * h * i * w).map_err(&up_err)?;
        for e in 0..experts {
            let name = |m: &str| format!("{prefix}.experts.{e}.{m}.weight");
            let mut gu = files.f32(&name(gate), &[i, h])?;
            gu.extend(files.f32(&name(up), &[i, h])?);
            let at = e * 2 * i * h * w;
            st.memcpy_htod(
                &dtype.encode(&gu),
                &mut gate_up.slice_mut(at..at + 2 * i * h * w),
            )
            .map_err(&up_err)?;
            let d = files.f32(&name(down), &[h, i])?;
            let at = e * h * i * w;
            st.memcpy_htod(&dtype.encode(&d), &mut down_w.slice_mut(at..at + h * i * w))
                .map_err(&up_err)?;
        }
        Ok(MoeLayer {
            router,
            gate_up: ExpertWeights::Dense(gate_up),
            down: ExpertWeights::Dense(down_w),
            biases: None,
        })
    }

    /// GPT-OSS's block as the CPU backend reads it: the router
    /// (`mlp.router`, with its bias) and every expert's rows of
    /// `mlp.experts.gate_up_proj` and `down_proj` (`[experts, in, out]`,
    /// each with `…_bias`), gate and up de-interleaved into `[gate | up]`
    /// (an expert LoRA's rows are read in the same order). MXFP4 experts
    /// stay at 4 bits with their scale bytes; a checkpoint whose config
    /// says MXFP4 must store them so (the memory plan counted them so).
    fn load_gpt_oss(
        files: &WeightFiles,
        c: &ModelConfig,
        moe: MoeConfig,
        layer: usize,
        dev: &Device,
        dtype: Dtype,
    ) -> Result<MoeLayer> {
        let (h, i, experts) = (c.hidden_size, c.intermediate_size, moe.num_experts);
        let prefix = format!("model.layers.{layer}.mlp");
        let st = &dev.stream;
        let up_err = cuda("uploading weights");
        let up_f32 = |v: &[f32]| st.clone_htod(v).map_err(&up_err);
        let router = up_f32(&files.f32(&format!("{prefix}.router.weight"), &[experts, h])?)?;
        let router_bias = up_f32(&files.f32(&format!("{prefix}.router.bias"), &[experts])?)?;
        let (gate_up_name, down_name) = (
            format!("{prefix}.experts.gate_up_proj"),
            format!("{prefix}.experts.down_proj"),
        );
        let order = crate::backend::cpu::gate_up_order(i);
        let mxfp4 = mxfp4(c);
        // One parameter's experts, rows in `order` if given.
        let experts_of = |name: &str,
                          (fan_in, fan_out),
                          order: Option<&[usize]>|
         -> Result<ExpertWeights> {
            let shape = (experts, fan_in, fan_out);
            if mxfp4 {
                let Some(matrices) = files.mxfp4_experts(name, shape)? else {
                    return Err(crate::EngineError::Backend(format!(
                        "cuda: {name}: the config's quantization_config says mxfp4, but \
                         {name}_blocks is not in the checkpoint"
                    )));
                };
                // Laid out in parallel (32 experts of millions of codes each,
                // for the 20B), uploaded in order.
                let parts: Vec<HostPart> = matrices
                    .par_iter()
                    .map(|m| HostPart::new(&order.map_or_else(|| m.clone(), |o| m.select_rows(o))))
                    .collect();
                return parts
                    .iter()
                    .map(|p| QuantLinear::upload(dev, std::slice::from_ref(p), false))
                    .collect::<Result<Vec<_>>>()
                    .map(ExpertWeights::Mxfp4);
            }
            let mut all = Vec::with_capacity(experts * fan_in * fan_out);
            for w in files.dense_experts(name, shape)? {
                match order {
                    Some(o) => all.extend(
                        o.iter()
                            .flat_map(|&r| w[r * fan_in..(r + 1) * fan_in].iter().copied()),
                    ),
                    None => all.extend(w),
                }
            }
            Ok(ExpertWeights::Dense(
                st.clone_htod(&dtype.encode(&all)).map_err(&up_err)?,
            ))
        };
        let gate_up = experts_of(&gate_up_name, (h, 2 * i), Some(&order))?;
        let down = experts_of(&down_name, (i, h), None)?;
        let gate_up_bias = files.f32(&format!("{gate_up_name}_bias"), &[experts, 2 * i])?;
        let gate_up_bias: Vec<f32> = gate_up_bias
            .chunks_exact(2 * i)
            .flat_map(|b| order.iter().map(|&r| b[r]))
            .collect();
        let down_bias = files.f32(&format!("{down_name}_bias"), &[experts, h])?;
        Ok(MoeLayer {
            router,
            gate_up,
            down,
            biases: Some(ExpertBiases {
                router: router_bias,
                gate_up: up_f32(&gate_up_bias)?,
                down: up_f32(&down_bias)?,
            }),
        })
    }
}

/// The device bytes of the Mixture-of-Experts blocks of `c` with weights
/// in `dtype`, all layers (the router in f32).
pub(in crate::backend::cuda) fn weight_bytes(c: &ModelConfig, moe: MoeConfig, dtype: Dtype) -> u64 {
    let (h, i, e) = (
        c.hidden_size as u64,
        c.intermediate_size as u64,
        moe.num_experts as u64,
    );
    // GPT-OSS's biases in f32: the router's, gate/up's and down's.
    let biases = match moe.gpt_oss {
        Some(_) => e * (1 + 2 * i + h) * 4,
        None => 0,
    };
    // MXFP4 experts: two codes a byte and a scale byte per 32 inputs, for
    // gate/up (`2 inter` rows of `hidden`) and down (`hidden` of `inter`).
    let experts = if mxfp4(c) {
        let part = |rows: u64, fan_in: u64| rows * (fan_in.div_ceil(2) + fan_in.div_ceil(32));
        e * (part(2 * i, h) + part(h, i))
    } else {
        e * 3 * h * i * dtype.bytes() as u64
    };
    c.num_layers as u64 * (experts + e * h * 4 + biases)
}

/// Whether the checkpoint's experts are MXFP4 (GPT-OSS as released); the
/// format quantizes the experts alone.
pub(in crate::backend::cuda) fn mxfp4(c: &ModelConfig) -> bool {
    c.quantization
        .as_ref()
        .is_some_and(|q| q.format == lorafleet_artifact::quantization::Format::Mxfp4)
}

impl MoeLayer {
    /// The largest expert projection held quantized (`rows × fan_in`) and
    /// its widest input, for the scratch a many-token step dequantizes one
    /// into; zero when the experts are dense.
    pub(in crate::backend::cuda) fn largest_quantized(&self) -> (usize, usize) {
        [&self.gate_up, &self.down]
            .into_iter()
            .filter_map(|w| match w {
                ExpertWeights::Mxfp4(q) => q.first(),
                ExpertWeights::Dense(_) => None,
            })
            .map(|q| (q.largest_part() * q.fan_in(), q.fan_in()))
            .fold((0, 0), |(a, b), (x, y)| (a.max(x), b.max(y)))
    }
}

/// A step's buffers for the Mixture-of-Experts blocks, for `tokens` tokens
/// (`tokens * top_k` expert rows).
pub(in crate::backend::cuda) struct MoeBuffers {
    /// `[tokens, experts]`.
    pub(super) logits: CudaSlice<f32>,
    /// Each token's experts and weights, `[tokens, top_k]`.
    pub(super) route_e: CudaSlice<i32>,
    pub(super) route_w: CudaSlice<f32>,
    /// The rows' tokens (`order`, `[rows]`), then each (token, choice)'s
    /// row (`row_of`, `[rows]`).
    pub(super) index: CudaSlice<i32>,
    /// The router LoRA's (first row, end row, slot, expert) groups (the
    /// experts' follow the rows' order in `index`).
    pub(super) groups: CudaSlice<i32>,
    pub(super) xg: CudaSlice<f32>,
    /// `xg` in the weights' type (none in f32 mode); likewise `actg_w`.
    pub(super) xg_w: Option<CudaSlice<u8>>,
    pub(super) gug: CudaSlice<f32>,
    pub(super) actg: CudaSlice<f32>,
    pub(super) actg_w: Option<CudaSlice<u8>>,
    pub(super) downg: CudaSlice<f32>,
    /// The expert LoRA's shrink output, `[rows, max_rank]`.
    pub(super) t: CudaSlice<f32>,
}

impl MoeBuffers {
    pub(in crate::backend::cuda) fn new(
        dev: &Device,
        c: &ModelConfig,
        moe: MoeConfig,
        dtype: Dtype,
        tokens: usize,
    ) -> Result<MoeBuffers> {
        let st = &dev.stream;
        let err = cuda("allocating the step workspace");
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let rows = tokens * moe.top_k;
        let f32s = |len: usize| st.alloc_zeros::<f32>(len.max(1)).map_err(&err);
        let cast = |len: usize| -> Result<Option<CudaSlice<u8>>> {
            if dtype == Dtype::F32 {
                return Ok(None);
            }
            Ok(Some(
                st.alloc_zeros::<u8>(len.max(1) * dtype.bytes())
                    .map_err(&err)?,
            ))
        };
        Ok(MoeBuffers {
            logits: f32s(tokens * moe.num_experts)?,
            route_e: st.alloc_zeros::<i32>(rows.max(1)).map_err(&err)?,
            route_w: f32s(rows)?,
            // The rows' tokens and each choice's row, then the gate/up and
            // down groups (at most one a row each), then each row's expert
            // (for GPT-OSS's expert biases).
            index: st.alloc_zeros::<i32>(11 * rows.max(1)).map_err(&err)?,
            // The router's groups: at most one a token.
            groups: st.alloc_zeros::<i32>(4 * tokens.max(1)).map_err(&err)?,
            xg: f32s(rows * h)?,
            xg_w: cast(rows * h)?,
            gug: f32s(rows * 2 * i)?,
            actg: f32s(rows * i)?,
            actg_w: cast(rows * i)?,
            downg: f32s(rows * h)?,
            t: f32s(rows * dev.shapes.max_rank)?,
        })
    }

    /// Bytes for `tokens` tokens (the memory plan's share).
    pub fn bytes(
        c: &ModelConfig,
        moe: MoeConfig,
        dtype: Dtype,
        max_rank: usize,
        tokens: usize,
    ) -> u64 {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let rows = tokens * moe.top_k;
        let f32s = tokens * moe.num_experts + rows * (1 + 2 * h + 3 * i + max_rank);
        let ints = 12 * rows + 4 * tokens;
        let cast = if dtype == Dtype::F32 {
            0
        } else {
            rows * (h + i) * dtype.bytes()
        };
        (4 * (f32s + ints) + cast) as u64
    }
}
