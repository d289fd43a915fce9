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
//! `experts.`.

use super::{AdapterConfig, AdapterError, AdapterLimits, ExpertTarget, strip_file};
use crate::model::WeightFiles;

/// One targeted tensor's factors, per expert, in f32 (bf16 widened
/// exactly): Aᵀ `[fan_in, rank]` and Bᵀ `[rank, fan_out]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertFactors {
    pub rank: usize,
    pub scale: f32,
    pub fan_in: usize,
    pub fan_out: usize,
    /// `a_t[expert]`.
    pub a_t: Vec<Vec<f32>>,
    /// `b_t[expert]`.
    pub b_t: Vec<Vec<f32>>,
}

impl ExpertFactors {
    /// Adds `scale · (x·Aᵀ)·Bᵀ` of expert `e` to `out`, for one row `x`,
    /// in a fixed order (whatever else is in the batch). Where the CPU has
    /// AVX2 the same operations run on wider vectors: Rust never fuses a
    /// multiply and an add, so the results are the same bits.
    pub fn add_delta(&self, e: usize, x: &[f32], out: &mut [f32]) {
        let (a_t, b_t) = (&self.a_t[e], &self.b_t[e]);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            #[allow(unsafe_code)]
            unsafe {
                delta_avx2(a_t, b_t, self.rank, self.fan_out, self.scale, x, out)
            };
            return;
        }
        delta(a_t, b_t, self.rank, self.fan_out, self.scale, x, out);
    }

    pub fn bytes(&self) -> usize {
        4 * (self.a_t.iter().map(Vec::len).sum::<usize>()
            + self.b_t.iter().map(Vec::len).sum::<usize>())
    }
}

#[inline(always)]
fn delta(
    a_t: &[f32],
    b_t: &[f32],
    r: usize,
    fan_out: usize,
    scale: f32,
    x: &[f32],
    out: &mut [f32],
) {
    let mut t = [0f32; 512];
    let t = &mut t[..r];
    for (xi, row) in x.iter().zip(a_t.chunks_exact(r)) {
        for (tk, a) in t.iter_mut().zip(row) {
            *tk += xi * a;
        }
    }
    for (tk, b_row) in t.iter().zip(b_t.chunks_exact(fan_out)) {
        let s = scale * tk;
        for (o, b) in out.iter_mut().zip(b_row) {
            *o += s * b;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn delta_avx2(
    a_t: &[f32],
    b_t: &[f32],
    r: usize,
    fan_out: usize,
    scale: f32,
    x: &[f32],
    out: &mut [f32],
) {
    delta(a_t, b_t, r, fan_out, scale, x, out)
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

/// Where each targeted parameter's factors are stored in one layer.
fn prefixes(layer: usize, targets: &[ExpertTarget]) -> Vec<(ExpertTarget, String)> {
    let experts = format!("base_model.model.model.layers.{layer}.mlp.experts");
    let both = targets.contains(&ExpertTarget::GateUp) && targets.contains(&ExpertTarget::Down);
    targets
        .iter()
        .map(|&t| {
            let prefix = match t {
                ExpertTarget::GateUp if both => format!("{experts}.base_layer"),
                ExpertTarget::GateUp | ExpertTarget::Down => experts.clone(),
                ExpertTarget::Router => format!("base_model.model.model.layers.{layer}.mlp.gate"),
            };
            (t, prefix)
        })
        .collect()
}

/// The tensor names the expert targets of `config` store, for the check
/// that an adapter holds nothing else.
pub(super) fn expected_names(config: &AdapterConfig, layers: usize) -> Vec<String> {
    (0..layers)
        .filter(|&l| config.transforms_layer(l))
        .flat_map(|l| prefixes(l, &config.expert_targets))
        .flat_map(|(_, p)| [format!("{p}.lora_A.weight"), format!("{p}.lora_B.weight")])
        .collect()
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
    let invalid = |field: &str, reason: String| AdapterError::Invalid {
        adapter: name.into(),
        field: field.into(),
        reason,
    };
    let experts = moe.num_experts;
    let (h, i) = (model.hidden_size, model.intermediate_size);
    let mut layers = vec![ExpertLayer::default(); model.num_layers];
    for (l, layer) in layers.iter_mut().enumerate() {
        if !config.transforms_layer(l) {
            continue;
        }
        for (target, prefix) in prefixes(l, &config.expert_targets) {
            // PEFT matches rank_pattern and alpha_pattern against the
            // parameter's path (its "all-linear" gives the fused gate_up
            // twice the rank this way).
            let path = target.path(l);
            let (r, alpha) = config.rank_and_alpha(name, &path)?;
            if r > limits.max_lora_rank {
                return Err(AdapterError::RankTooLarge {
                    adapter: name.into(),
                    field: if r == config.r {
                        "r".into()
                    } else {
                        format!("rank_pattern ({path})")
                    },
                    rank: r,
                    max: limits.max_lora_rank,
                });
            }
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
            let mut factors = ExpertFactors {
                rank: r,
                scale,
                fan_in,
                fan_out,
                a_t: Vec::with_capacity(n),
                b_t: Vec::with_capacity(n),
            };
            for e in 0..n {
                let mut a_t = vec![0f32; fan_in * r];
                for k in 0..r {
                    for x in 0..fan_in {
                        a_t[x * r + k] = a[(e * r + k) * fan_in + x];
                    }
                }
                let mut b_t = vec![0f32; r * fan_out];
                for k in 0..r {
                    for o in 0..fan_out {
                        b_t[k * fan_out + o] = b[o * (r * n) + k * n + e];
                    }
                }
                factors.a_t.push(a_t);
                factors.b_t.push(b_t);
            }
            match target {
                ExpertTarget::GateUp => layer.gate_up = Some(factors),
                ExpertTarget::Down => layer.down = Some(factors),
                ExpertTarget::Router => layer.router = Some(factors),
            }
        }
    }
    Ok(layers)
}
