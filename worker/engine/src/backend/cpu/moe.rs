//! The Mixture-of-Experts MLP on the CPU (Mixtral, Qwen3-MoE, GPT-OSS).
//!
//! A router (a linear map to one logit per expert, then a softmax) picks
//! each token's `top_k` experts; the chosen probabilities, renormalized
//! where the model says so, weigh the experts' SwiGLU outputs. GPT-OSS's
//! router has a bias and takes the softmax of the chosen logits alone; its
//! experts have biases and a clamped SwiGLU ([`GptOssExperts`]), and their
//! weights are read from one `[experts, in, out]` tensor each (bf16, or
//! MXFP4 codes kept at 4 bits). Tokens are
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
use crate::model::config::{Architecture, GptOssExperts, MoeConfig};
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
    /// GPT-OSS's router bias, `[num_experts]`.
    router_bias: Option<Vec<f32>>,
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
        if moe.gpt_oss.is_some() {
            return Self::load_gpt_oss(files, c, moe, layer);
        }
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
            router_bias: None,
            experts,
        })
    }

    /// GPT-OSS's block: the router's weight and bias (`mlp.router`), and
    /// each expert's rows of `mlp.experts.gate_up_proj` and
    /// `mlp.experts.down_proj` (`[experts, in, out]`, with `…_bias`), gate
    /// and up de-interleaved into gate's rows then up's, as the other
    /// families stack them (an expert LoRA's rows are read in the same
    /// order: `lora::experts`).
    fn load_gpt_oss(
        files: &WeightFiles,
        c: &ModelConfig,
        moe: MoeConfig,
        layer: usize,
    ) -> Result<MoeBlock> {
        let (h, i, n) = (c.hidden_size, c.intermediate_size, moe.num_experts);
        let prefix = format!("model.layers.{layer}.mlp");
        let router = files.f32(&format!("{prefix}.router.weight"), &[n, h])?;
        let router_bias = files.f32(&format!("{prefix}.router.bias"), &[n])?;
        let (gate_up, down) = (
            format!("{prefix}.experts.gate_up_proj"),
            format!("{prefix}.experts.down_proj"),
        );
        let order = gate_up_order(i);
        let gate_ups = pack_experts(files, &gate_up, (n, h, 2 * i), Some(&order))?;
        let downs = pack_experts(files, &down, (n, i, h), None)?;
        Ok(MoeBlock {
            moe,
            hidden: h,
            inter: i,
            router,
            router_bias: Some(router_bias),
            experts: gate_ups
                .into_iter()
                .zip(downs)
                .map(|(gate_up, down)| Expert { gate_up, down })
                .collect(),
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
                if let Some(bias) = &self.router_bias {
                    for (l, b) in logits.iter_mut().zip(bias) {
                        *l += b;
                    }
                }
                if let Some(router) = lora[t].and_then(|l| l.router.as_ref()) {
                    router.add_delta(0, row, &mut logits);
                }
                match self.moe.gpt_oss {
                    Some(_) => choose_logits(&logits, self.moe.top_k),
                    None => choose(&logits, self.moe.top_k, self.moe.norm_topk_prob),
                }
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
                    match self.moe.gpt_oss {
                        Some(GptOssExperts {
                            swiglu_alpha,
                            swiglu_limit,
                        }) => activation::clamped_swiglu(g, u, swiglu_alpha, swiglu_limit, a),
                        None => activation::silu_mul(kernel, g, u, a),
                    }
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

/// GPT-OSS's gate and up rows in stacked order: the checkpoint interleaves
/// them (gate `r` is row `2 r`, up `r` row `2 r + 1`).
pub(crate) fn gate_up_order(inter: usize) -> Vec<usize> {
    (0..inter)
        .map(|r| 2 * r)
        .chain((0..inter).map(|r| 2 * r + 1))
        .collect()
}

/// Every expert's projection from one `[experts, fan_in, fan_out]`
/// parameter and its `[experts, fan_out]` bias (`{name}_bias`): MXFP4 codes
/// at 4 bits, bf16 in bf16, anything else in f32; rows in `order` if given.
fn pack_experts(
    files: &WeightFiles,
    name: &str,
    (n, fan_in, fan_out): (usize, usize, usize),
    order: Option<&[usize]>,
) -> Result<Vec<PackedLinear>> {
    let bias = files.f32(&format!("{name}_bias"), &[n, fan_out])?;
    let bias_of = |e: usize| {
        let b = &bias[e * fan_out..(e + 1) * fan_out];
        Some(match order {
            Some(o) => o.iter().map(|&r| b[r]).collect(),
            None => b.to_vec(),
        })
    };
    fn rows<T: Copy>(w: Vec<T>, order: Option<&[usize]>, fan_in: usize) -> Vec<T> {
        match order {
            Some(o) => o
                .iter()
                .flat_map(|&r| w[r * fan_in..(r + 1) * fan_in].iter().copied())
                .collect(),
            None => w,
        }
    }
    let shape = (n, fan_in, fan_out);
    if let Some(matrices) = files.mxfp4_experts(name, shape)? {
        return Ok(matrices
            .iter()
            .enumerate()
            .map(|(e, m)| {
                let m = order.map_or_else(|| m.clone(), |o| m.select_rows(o));
                PackedLinear::pack_quantized(&[&m], bias_of(e)).expect("one quantized matrix packs")
            })
            .collect());
    }
    if let Some(all) = files.dense_experts_bf16(name, shape)? {
        return Ok(all
            .into_iter()
            .enumerate()
            .map(|(e, w)| {
                PackedLinear::pack_bf16(&rows(w, order, fan_in), bias_of(e), fan_in, fan_out)
            })
            .collect());
    }
    Ok(files
        .dense_experts(name, shape)?
        .into_iter()
        .enumerate()
        .map(|(e, w)| PackedLinear::pack(&rows(w, order, fan_in), bias_of(e), fan_in, fan_out))
        .collect())
}

/// GPT-OSS's router for one token: the `top_k` largest logits (the lower
/// expert first on a tie), weighed by the softmax over those alone (as
/// transformers' `GptOssTopKRouter`); returned in expert order.
fn choose_logits(logits: &[f32], top_k: usize) -> Vec<(usize, f32)> {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let top = &order[..top_k];
    let max = logits[top[0]];
    let exps: Vec<f32> = top.iter().map(|&e| (logits[e] - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    let mut chosen: Vec<(usize, f32)> = top.iter().zip(&exps).map(|(&e, x)| (e, x / sum)).collect();
    chosen.sort_by_key(|&(e, _)| e);
    chosen
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
    use super::{choose, choose_logits, gate_up_order};

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

    #[test]
    fn gpt_oss_weighs_its_chosen_logits_by_their_own_softmax() {
        let chosen = choose_logits(&[0.0, 3.0, 1.0, 2.0], 2);
        assert_eq!(chosen.iter().map(|c| c.0).collect::<Vec<_>>(), [1, 3]);
        let (a, b) = (3f32.exp(), 2f32.exp());
        assert!((chosen[0].1 - a / (a + b)).abs() < 1e-6);
        assert!((chosen[1].1 - b / (a + b)).abs() < 1e-6);
        assert_eq!(gate_up_order(3), [0, 2, 4, 1, 3, 5]);
    }
}
