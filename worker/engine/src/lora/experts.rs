//! LoRA on a Mixture-of-Experts block, in the form PEFT writes for
//! transformers 5 models, whose experts are fused tensors: `target_parameters`
//! on `mlp.experts.gate_up_proj` (`[experts, 2 * inter, hidden]`),
//! `mlp.experts.down_proj` (`[experts, hidden, inter]`) and the router's
//! `mlp.gate.weight` (`[experts, hidden]`).
//!
//! PEFT keeps one `lora_A` of `[rank * experts, in]` (expert e's A is rows
//! `e * rank ..`) and one `lora_B` of `[out, rank * experts]` (expert e's B
//! is columns `k * experts + e`), and wraps the parameters of one module in
//! the order the module declares them: with both expert tensors targeted,
//! gate_up's factors sit under `experts.base_layer.` and down's under
//! `experts.`. GPT-OSS's experts (`[experts, in, out]`, gate and up
//! interleaved) have the same factors' shapes, `in` and `out` as for the
//! others.

use super::{AdapterConfig, AdapterError, AdapterLimits, ExpertTarget, strip_file, tensors};
use crate::backend::cpu::panels::PackedLinear;
use crate::model::WeightFiles;

/// One targeted tensor's factors, per expert, packed as two projections
/// (A: `fan_in` to `rank`, B: `rank` to `fan_out`) in the panels the CPU
/// projection kernels read, once, when the adapter is read: the shrink and
/// expand then run on those kernels, in their fixed per-row order.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertFactors {
    pub rank: usize,
    pub scale: f32,
    pub fan_in: usize,
    pub fan_out: usize,
    a: Vec<PackedLinear>,
    b: Vec<PackedLinear>,
}

impl ExpertFactors {
    /// From each expert's A (`[rank, fan_in]`) and B (`[fan_out, rank]`),
    /// row-major f32 (bf16 widened exactly).
    pub fn new(
        rank: usize,
        scale: f32,
        (fan_in, fan_out): (usize, usize),
        a: &[Vec<f32>],
        b: &[Vec<f32>],
    ) -> ExpertFactors {
        ExpertFactors {
            rank,
            scale,
            fan_in,
            fan_out,
            a: a.iter()
                .map(|a| PackedLinear::pack(a, None, fan_in, rank))
                .collect(),
            b: b.iter()
                .map(|b| PackedLinear::pack(b, None, rank, fan_out))
                .collect(),
        }
    }

    /// Adds `scale · (x·Aᵀ)·Bᵀ` of expert `e` to `out` for the `m` rows of
    /// `x` (`out` is `[m, fan_out]`), on the calling thread: the callers
    /// run one (expert, adapter) group of rows per thread. Each row's
    /// result is the same whatever rows come with it.
    pub fn add_delta_rows(&self, e: usize, x: &[f32], m: usize, out: &mut [f32]) {
        let mut t = vec![0f32; m * self.rank];
        self.a[e].add_scaled_on_this_thread(x, m, 1.0, &mut t);
        self.b[e].add_scaled_on_this_thread(&t, m, self.scale, out);
    }

    /// [`ExpertFactors::add_delta_rows`] for one row.
    pub fn add_delta(&self, e: usize, x: &[f32], out: &mut [f32]) {
        self.add_delta_rows(e, x, 1, out);
    }

    /// Expert `e`'s A and B as the projection kernels' f32 panels (A:
    /// `rank` outputs of `fan_in`, B: `fan_out` outputs of `rank`; see
    /// `PackedLinear::panels_f32`), for a backend that reads that layout.
    pub fn panels(&self, e: usize) -> (&[f32], &[f32]) {
        fn f32s(p: &PackedLinear) -> &[f32] {
            p.panels_f32().expect("expert factors are packed in f32")
        }
        (f32s(&self.a[e]), f32s(&self.b[e]))
    }

    /// How many experts the factors hold (1 for the router's).
    pub fn experts(&self) -> usize {
        self.a.len()
    }

    pub fn bytes(&self) -> usize {
        self.a
            .iter()
            .chain(&self.b)
            .map(PackedLinear::weight_bytes)
            .sum()
    }
}

/// One layer's LoRA on its Mixture-of-Experts block.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExpertLayer {
    pub gate_up: Option<ExpertFactors>,
    pub down: Option<ExpertFactors>,
    /// The router's, as one "expert" mapping hidden to one logit per
    /// expert.
    pub router: Option<ExpertFactors>,
}

impl ExpertLayer {
    pub fn is_empty(&self) -> bool {
        self.gate_up.is_none() && self.down.is_none() && self.router.is_none()
    }
}

/// Reads every layer's expert LoRA; empty layers where none is targeted.
pub(super) fn load(
    name: &str,
    config: &AdapterConfig,
    files: &WeightFiles,
    limits: AdapterLimits<'_>,
) -> Result<Vec<ExpertLayer>, AdapterError> {
    let model = limits.model;
    let Some(moe) = model.moe else {
        return Ok(Vec::new());
    };
    let invalid = |tensor: &str, reason: String| AdapterError::InvalidTensor {
        adapter: name.into(),
        tensor: tensor.into(),
        reason,
    };
    let experts = moe.num_experts;
    let (h, i) = (model.hidden_size, model.intermediate_size);
    let mut layers = vec![ExpertLayer::default(); model.num_layers];
    for (l, layer) in layers.iter_mut().enumerate() {
        if !config.transforms_layer(l) {
            continue;
        }
        for &target in &config.expert_targets {
            let prefix = tensors::expert_prefix(l, target, &config.expert_targets);
            // PEFT matches rank_pattern and alpha_pattern against the
            // parameter's path (its "all-linear" gives the fused gate_up
            // twice the rank this way).
            let path = target.path(l);
            let (r, alpha) = config.rank_and_alpha(name, &path)?;
            let scale = if config.use_rslora {
                alpha / (r as f32).sqrt()
            } else {
                alpha / r as f32
            };
            // (fan_in, fan_out, experts in the factors)
            let (fan_in, fan_out, n) = match target {
                ExpertTarget::GateUp => (h, 2 * i, experts),
                ExpertTarget::Down => (i, h, experts),
                ExpertTarget::Router => (h, experts, 1),
            };
            let (a_name, b_name) = (
                format!("{prefix}.lora_A.weight"),
                format!("{prefix}.lora_B.weight"),
            );
            let a = files
                .f32(&a_name, &[r * n, fan_in])
                .map_err(|e| invalid(&a_name, strip_file(e)))?;
            let b = files
                .f32(&b_name, &[fan_out, r * n])
                .map_err(|e| invalid(&b_name, strip_file(e)))?;
            // Expert e's A is rows e·r.. of lora_A; its B is the columns
            // k·n + e of lora_B.
            let a_of = |e: usize| a[e * r * fan_in..(e + 1) * r * fan_in].to_vec();
            let b_of = |e: usize| {
                let mut b_e = vec![0f32; fan_out * r];
                for o in 0..fan_out {
                    for k in 0..r {
                        b_e[o * r + k] = b[o * (r * n) + k * n + e];
                    }
                }
                b_e
            };
            // GPT-OSS interleaves gate and up; the backend stacks them as
            // gate's rows then up's (`cpu::moe::gate_up_order`), and so
            // are B's rows here.
            let order = (model.moe.is_some_and(|m| m.gpt_oss.is_some())
                && target == ExpertTarget::GateUp)
                .then(|| crate::backend::cpu::gate_up_order(i));
            let b_of = |e: usize| {
                let b_e = b_of(e);
                match &order {
                    Some(order) => order
                        .iter()
                        .flat_map(|&o| b_e[o * r..(o + 1) * r].iter().copied())
                        .collect(),
                    None => b_e,
                }
            };
            let (a_e, b_e): (Vec<_>, Vec<_>) = (0..n).map(|e| (a_of(e), b_of(e))).unzip();
            let factors = ExpertFactors::new(r, scale, (fan_in, fan_out), &a_e, &b_e);
            match target {
                ExpertTarget::GateUp => layer.gate_up = Some(factors),
                ExpertTarget::Down => layer.down = Some(factors),
                ExpertTarget::Router => layer.router = Some(factors),
            }
        }
    }
    Ok(layers)
}
