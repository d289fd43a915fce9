//! The Mixture-of-Experts MLP on the CPU (Mixtral, Qwen3-MoE).
//!
//! A router (a linear map to one logit per expert, then a softmax) picks
//! each token's `top_k` experts; the chosen probabilities, renormalized
//! where the model says so, weigh the experts' SwiGLU outputs. Tokens are
//! grouped by expert, so each expert's projections run once over all its
//! tokens; every output row is still its own fixed chain over its own
//! weights, and a token's experts are summed in expert order, so a token's
//! result does not depend on the batch around it.

use super::attention::dot;
use super::load::pack_stacked;
use super::panels::{Kernel, PackedLinear};
use super::{activation, team};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::Result;
use crate::lora::{ExpertFactors, ExpertLayer};
use crate::model::config::{Architecture, MoeConfig};
use crate::model::{ModelConfig, WeightFiles};

/// One expert: gate and up stacked, then down.
#[derive(Debug)]
struct Expert {
    gate_up: PackedLinear,
    down: PackedLinear,
}

/// A layer's router and experts.
#[derive(Debug)]
pub(super) struct MoeBlock {
    moe: MoeConfig,
    hidden: usize,
    inter: usize,
    /// `[num_experts, hidden]`, row-major, f32.
    router: Vec<f32>,
    experts: Vec<Expert>,
}

impl MoeBlock {
    /// Reads layer `layer`'s router and experts, named as the model's
    /// family stores them (per expert, as Hugging Face checkpoints hold
    /// them).
    pub(super) fn load(
        files: &WeightFiles,
        c: &ModelConfig,
        moe: MoeConfig,
        layer: usize,
    ) -> Result<MoeBlock> {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let (block, [gate, up, down]) = match c.architecture {
            Architecture::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
            _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        };
        let prefix = format!("model.layers.{layer}.{block}");
        let router = files.f32(&format!("{prefix}.gate.weight"), &[moe.num_experts, h])?;
        let mut experts = Vec::with_capacity(moe.num_experts);
        for e in 0..moe.num_experts {
            let name = |m: &str| format!("{prefix}.experts.{e}.{m}.weight");
            experts.push(Expert {
                gate_up: pack_stacked(files, &[(name(gate), i), (name(up), i)], None, h)?,
                down: pack_stacked(files, &[(name(down), h)], None, i)?,
            });
        }
        Ok(MoeBlock {
            moe,
            hidden: h,
            inter: i,
            router,
            experts,
        })
    }

    pub(super) fn weight_bytes(&self) -> usize {
        self.router.len() * 4
            + self
                .experts
                .iter()
                .map(|e| e.gate_up.weight_bytes() + e.down.weight_bytes())
                .sum::<usize>()
    }

    /// Each token's experts and their weights, in expert order; a token's
    /// adapter may carry a LoRA on the router's logits.
    fn route(&self, x: &[f32], n: usize, lora: &[Option<&ExpertLayer>]) -> Vec<Vec<(usize, f32)>> {
        let (h, experts) = (self.hidden, self.moe.num_experts);
        (0..n)
            .map(|t| {
                let row = &x[t * h..(t + 1) * h];
                let mut logits: Vec<f32> = (0..experts)
                    .map(|e| dot(row, &self.router[e * h..(e + 1) * h]))
                    .collect();
                if let Some(router) = lora[t].and_then(|l| l.router.as_ref()) {
                    router.add_delta(0, row, &mut logits);
                }
                choose(&logits, self.moe.top_k, self.moe.norm_topk_prob)
            })
            .collect()
    }

    /// The block's output for `n` rows of `x` (to be added to the
    /// residual stream). `lora[t]` is token t's adapter's LoRA on this
    /// block, if any: rows without one never enter the expert LoRA path
    /// (`lora_rows` counts those that do).
    pub(super) fn forward(
        &self,
        x: &[f32],
        n: usize,
        lora: &[Option<&ExpertLayer>],
        lora_rows: &AtomicU64,
    ) -> Vec<f32> {
        let (h, inter) = (self.hidden, self.inter);
        let routes = self.route(x, n, lora);
        let with_lora = lora.iter().filter(|l| l.is_some()).count();
        if with_lora > 0 {
            lora_rows.fetch_add(with_lora as u64, Ordering::Relaxed);
        }
        // Per expert: its tokens, in token order.
        let mut tokens: Vec<Vec<usize>> = vec![Vec::new(); self.experts.len()];
        for (t, chosen) in routes.iter().enumerate() {
            for &(e, _) in chosen {
                tokens[e].push(t);
            }
        }
        // Per expert: its output rows, in the order of `tokens[e]`.
        let kernel = Kernel::detect();
        let outputs: Vec<Vec<f32>> = self
            .experts
            .iter()
            .zip(&tokens)
            .enumerate()
            .map(|(e, (expert, rows))| {
                let m = rows.len();
                if m == 0 {
                    return Vec::new();
                }
                let mut xe = Vec::with_capacity(m * h);
                for &t in rows {
                    xe.extend_from_slice(&x[t * h..(t + 1) * h]);
                }
                let [mut gate, mut up] = expert.gate_up.forward_split(&xe, m, [inter, inter]);
                // Expert LoRA, grouped by (expert, adapter): the rows of one
                // adapter are adjacent, since the batch is ordered by slot,
                // and each run of them is one shrink and one expand on one
                // thread, the runs side by side on the team.
                let gate_up_runs: Vec<(usize, usize, &ExpertFactors)> = runs(rows, lora)
                    .into_iter()
                    .filter_map(|(lo, hi, l)| l.gate_up.as_ref().map(|f| (lo, hi, f)))
                    .collect();
                if !gate_up_runs.is_empty() {
                    let mut deltas: Vec<Vec<f32>> = gate_up_runs
                        .iter()
                        .map(|&(lo, hi, _)| vec![0f32; (hi - lo) * 2 * inter])
                        .collect();
                    team::for_each_mut(&mut deltas, |d, i| {
                        let (lo, hi, f) = gate_up_runs[i];
                        f.add_delta_rows(e, &xe[lo * h..hi * h], hi - lo, d);
                    });
                    for (&(lo, _, _), d) in gate_up_runs.iter().zip(&deltas) {
                        for (r, d) in (lo..).zip(d.chunks_exact(2 * inter)) {
                            let (dg, du) = d.split_at(inter);
                            for (g, v) in gate[r * inter..][..inter].iter_mut().zip(dg) {
                                *g += v;
                            }
                            for (u, v) in up[r * inter..][..inter].iter_mut().zip(du) {
                                *u += v;
                            }
                        }
                    }
                }
                let mut act = vec![0f32; m * inter];
                let mut act_rows: Vec<&mut [f32]> = act.chunks_exact_mut(inter).collect();
                team::for_each_mut(&mut act_rows, |a, r| {
                    let (g, u) = (&gate[r * inter..][..inter], &up[r * inter..][..inter]);
                    activation::silu_mul(kernel, g, u, a);
                });
                drop(act_rows);
                let [mut down] = expert.down.forward_split(&act, m, [h]);
                // The runs are disjoint and in order: each gets its own
                // rows of `down` to add to.
                let mut down_runs: Vec<(&mut [f32], usize, usize, &ExpertFactors)> = Vec::new();
                let mut rest: &mut [f32] = &mut down;
                let mut at = 0;
                for (lo, hi, l) in runs(rows, lora) {
                    let Some(f) = l.down.as_ref() else { continue };
                    let (_, from_lo) = std::mem::take(&mut rest).split_at_mut((lo - at) * h);
                    let (mine, after) = from_lo.split_at_mut((hi - lo) * h);
                    down_runs.push((mine, lo, hi, f));
                    (rest, at) = (after, hi);
                }
                team::for_each_mut(&mut down_runs, |(out, lo, hi, f), _| {
                    f.add_delta_rows(e, &act[*lo * inter..*hi * inter], *hi - *lo, out);
                });
                drop(down_runs);
                down
            })
            .collect();
        // Where token t's row sits in expert e's output.
        let mut cursor = vec![0usize; self.experts.len()];
        let mut out = vec![0f32; n * h];
        for (t, chosen) in routes.iter().enumerate() {
            let acc = &mut out[t * h..(t + 1) * h];
            for &(e, w) in chosen {
                let row = &outputs[e][cursor[e] * h..(cursor[e] + 1) * h];
                cursor[e] += 1;
                for (a, y) in acc.iter_mut().zip(row) {
                    *a += y * w;
                }
            }
        }
        out
    }
}

/// The runs of `rows` (indices into one expert's rows) whose tokens share
/// one adapter's expert LoRA: (first, end, that LoRA). Rows without one
/// are in no run.
fn runs<'a>(
    rows: &[usize],
    lora: &[Option<&'a ExpertLayer>],
) -> Vec<(usize, usize, &'a ExpertLayer)> {
    let mut out: Vec<(usize, usize, &'a ExpertLayer)> = Vec::new();
    for (r, &t) in rows.iter().enumerate() {
        let Some(layer) = lora[t] else { continue };
        match out.last_mut() {
            Some((_, end, last)) if *end == r && std::ptr::eq(*last, layer) => *end = r + 1,
            _ => out.push((r, r + 1, layer)),
        }
    }
    out
}

/// The router's choice for one token: the softmax of `logits`, its `top_k`
/// largest probabilities (the lower expert first on a tie), renormalized
/// to sum to one if `normalize`; returned in expert order.
fn choose(logits: &[f32], top_k: usize, normalize: bool) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]).then(a.cmp(&b)));
    let mut chosen: Vec<(usize, f32)> =
        order[..top_k].iter().map(|&e| (e, exps[e] / sum)).collect();
    if normalize {
        let total: f32 = chosen.iter().map(|(_, p)| p).sum();
        for (_, p) in &mut chosen {
            *p /= total;
        }
    }
    chosen.sort_by_key(|&(e, _)| e);
    chosen
}

#[cfg(test)]
mod tests {
    use super::choose;

    #[test]
    fn the_router_keeps_the_top_k_and_renormalizes_them_if_asked() {
        let logits = [0.0f32, 2.0, 1.0, 2.0];
        let raw = choose(&logits, 2, false);
        // Experts 1 and 3 tie for the top: both are kept, in expert order.
        assert_eq!(raw.iter().map(|c| c.0).collect::<Vec<_>>(), [1, 3]);
        let total: f32 = [0.0f32, 2.0, 1.0, 2.0].iter().map(|l| l.exp()).sum();
        assert!((raw[0].1 - 2f32.exp() / total).abs() < 1e-6);
        let norm = choose(&logits, 2, true);
        assert!((norm[0].1 - 0.5).abs() < 1e-6 && (norm[1].1 - 0.5).abs() < 1e-6);
        // Top-1 of three distinct logits: the largest alone, weight 1.
        assert_eq!(choose(&[0.5, -1.0, 3.0], 1, true), vec![(2, 1.0)]);
    }
}
