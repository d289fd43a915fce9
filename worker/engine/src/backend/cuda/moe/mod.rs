//! The Mixture-of-Experts MLP on the device (Mixtral, Qwen3-MoE, GPT-OSS), and the
//! expert LoRA it carries.
//!
//! One layer's block runs as the CPU backend's does, step by step:
//!
//! 1. the router's logits (an f32 GEMM), plus each token's router LoRA;
//! 2. `moe_route` picks each token's `top_k` experts and weights on the
//!    device;
//! 3. the choices come to the host (`top_k` integers a token), which groups
//!    the tokens by expert, in token order, and uploads that order with the
//!    expert-LoRA groups in one copy;
//! 4. `moe_gather` lays the groups out row by row, one cuBLAS GEMM per
//!    expert with tokens runs its gate and up projections, the expert LoRA
//!    of the tokens whose adapter has one is added by the grouped
//!    `moe_lora_shrink` / `moe_lora_expand` pair (one pair per target for
//!    every adapter in the step, each slot's factors reached through a
//!    table of addresses; rows of adapters without expert weights are in no
//!    group), then SiLU·up, the down GEMMs and their LoRA;
//! 5. `moe_combine` weighs each token's experts, sums them in expert order
//!    and adds the sum to the residual stream.
//!
//! Step 3 reads the device mid-step, so a Mixture-of-Experts model's steps
//! are never captured as CUDA graphs (the backend turns them off).
//!
//! An adapter's expert LoRA lives in device memory of its own per slot,
//! allocated when the adapter is written (sized to its targets, not to the
//! largest rank of every expert of every layer), copied from the host
//! tier's panels as they are, and freed when the slot is cleared or
//! rewritten.
//!
//! A layer's weights (`weights.rs`): the router in f32; every expert's
//! gate/up and down dense in the weights' type, or MXFP4 codes with their
//! E8M0 scale bytes (GPT-OSS as released), each expert's projection a
//! quantized layer of its own; GPT-OSS's biases in f32.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use cudarc::cublas::sys::cudaDataType;

use cudarc::driver::{CudaSlice, CudaStream};

use super::CudaBackend;
use super::device::{Arg, Device, cuda};
use super::staging::Staging;
use crate::error::Result;
use crate::lora::{ExpertFactors, ExpertLayer, HostAdapter};

mod weights;

use weights::ExpertWeights;
pub(super) use weights::{MoeBuffers, MoeLayer, mxfp4, weight_bytes};

/// Which of a layer's expert LoRA tensors.
#[derive(Clone, Copy)]
enum Target {
    Router = 0,
    GateUp = 1,
    Down = 2,
}

const TARGETS: usize = 3;

impl Target {
    fn of(self, l: &ExpertLayer) -> Option<&ExpertFactors> {
        match self {
            Target::Router => l.router.as_ref(),
            Target::GateUp => l.gate_up.as_ref(),
            Target::Down => l.down.as_ref(),
        }
    }
}

/// Every slot's expert LoRA. A slot's factors (every layer and target of
/// its adapter) are one allocation written by one copy, in the host tier's
/// panel layout as it is (no conversion on a slot write). A table per
/// (layer, target) gives the kernels each slot's A and B addresses, rank
/// and scale (rank 0 where the slot's adapter lacks that tensor), so one
/// launch pair a target covers every adapter in the step.
pub(super) struct ExpertSlots {
    slots: usize,
    layers: usize,
    /// Each slot's factors, if its adapter has expert LoRA.
    data: Vec<Option<CudaSlice<f32>>>,
    /// `has[slot][layer * TARGETS + target]`.
    has: Vec<Vec<bool>>,
    /// The tables, mirrored on the host: per (layer, target), `slots` A
    /// addresses (u64), `slots` B addresses (u64), `slots` ranks (i32) and
    /// `slots` scales (f32).
    table_host: Vec<u8>,
    table: CudaSlice<u8>,
    /// Page-locked staging for slot writes.
    staging: Staging<f32>,
}

impl ExpertSlots {
    /// For `slots` slots of a model of `layers` Mixture-of-Experts layers
    /// (0 for a dense model: nothing is allocated).
    pub(super) fn new(dev: &Device, layers: usize, slots: usize) -> Result<ExpertSlots> {
        let bytes = layers * TARGETS * 24 * slots;
        Ok(ExpertSlots {
            slots,
            layers,
            data: (0..slots).map(|_| None).collect(),
            has: vec![vec![false; layers * TARGETS]; slots],
            table_host: vec![0; bytes],
            table: dev
                .stream
                .alloc_zeros::<u8>(bytes.max(1))
                .map_err(cuda("allocating the expert-LoRA tables"))?,
            staging: Staging::default(),
        })
    }

    /// Where the table of (`layer`, `target`) starts, in bytes.
    fn section(&self, layer: usize, target: Target) -> usize {
        (layer * TARGETS + target as usize) * 24 * self.slots
    }

    fn set_entry(
        &mut self,
        slot: usize,
        layer: usize,
        target: Target,
        entry: (u64, u64, i32, f32),
    ) {
        let (base, n) = (self.section(layer, target), self.slots);
        let t = &mut self.table_host;
        t[base + 8 * slot..][..8].copy_from_slice(&entry.0.to_le_bytes());
        t[base + 8 * (n + slot)..][..8].copy_from_slice(&entry.1.to_le_bytes());
        t[base + 16 * n + 4 * slot..][..4].copy_from_slice(&entry.2.to_le_bytes());
        t[base + 20 * n + 4 * slot..][..4].copy_from_slice(&entry.3.to_le_bytes());
        self.has[slot][layer * TARGETS + target as usize] = entry.2 > 0;
    }

    fn upload_table(&mut self, dev: &Device) -> Result<()> {
        if self.table_host.is_empty() {
            return Ok(());
        }
        dev.stream
            .memcpy_htod(&self.table_host, &mut self.table)
            .map_err(cuda("uploading the expert-LoRA tables"))
    }

    /// Puts `adapter`'s expert LoRA into `slot`, or empties the slot's if
    /// it has none. The factors are staged in page-locked memory (tensors
    /// in parallel) and copied on `copy`, the stream of the slot's dense
    /// copy, before that copy: the slot's ready event, recorded after it,
    /// covers both, and a step that uses the slot waits for it.
    pub(super) fn write(
        &mut self,
        dev: &Device,
        copy: &Arc<CudaStream>,
        slot: usize,
        adapter: &HostAdapter,
    ) -> Result<()> {
        if adapter.experts.iter().all(|l| l.is_empty()) {
            return self.clear(dev, slot);
        }
        // Where each present tensor's A panels then B panels go, every
        // expert's in turn.
        let mut parts: Vec<&[f32]> = Vec::new();
        let mut placed = Vec::new();
        let mut len = 0;
        for (l, layer) in adapter.experts.iter().take(self.layers).enumerate() {
            for target in [Target::Router, Target::GateUp, Target::Down] {
                let Some(f) = target.of(layer) else { continue };
                let a_at = len;
                parts.extend((0..f.experts()).map(|e| f.panels(e).0));
                len += (0..f.experts()).map(|e| f.panels(e).0.len()).sum::<usize>();
                let b_at = len;
                parts.extend((0..f.experts()).map(|e| f.panels(e).1));
                len += (0..f.experts()).map(|e| f.panels(e).1.len()).sum::<usize>();
                placed.push((l, target, a_at, b_at, f.rank as i32, f.scale));
            }
        }
        // The parts lie back to back.
        let at: Vec<usize> = parts
            .iter()
            .scan(0, |next, p| {
                let here = *next;
                *next += p.len();
                Some(here)
            })
            .collect();
        let data = self.staging.upload(
            dev,
            copy,
            &parts,
            &at,
            len,
            "copying an adapter's expert LoRA into its slot",
        )?;
        let base = dev.p(&data);
        self.zero(slot);
        for (l, target, a_at, b_at, rank, scale) in placed {
            let at = |i: usize| base + (i * 4) as u64;
            self.set_entry(slot, l, target, (at(a_at), at(b_at), rank, scale));
        }
        self.data[slot] = Some(data);
        self.upload_table(dev)
    }

    fn zero(&mut self, slot: usize) {
        for l in 0..self.layers {
            for target in [Target::Router, Target::GateUp, Target::Down] {
                self.set_entry(slot, l, target, (0, 0, 0, 0.0));
            }
        }
    }

    pub(super) fn clear(&mut self, dev: &Device, slot: usize) -> Result<()> {
        if self.data[slot].is_none() {
            return Ok(());
        }
        self.zero(slot);
        self.data[slot] = None;
        self.upload_table(dev)
    }

    fn has(&self, slot: Option<usize>, layer: usize, target: Target) -> bool {
        slot.is_some_and(|s| self.has[s][layer * TARGETS + target as usize])
    }

    fn any(&self, slot: Option<usize>, layer: usize) -> bool {
        [Target::Router, Target::GateUp, Target::Down]
            .into_iter()
            .any(|t| self.has(slot, layer, t))
    }

    /// The device addresses of (`layer`, `target`)'s A table, B table,
    /// ranks and scales.
    fn table(&self, dev: &Device, layer: usize, target: Target) -> [u64; 4] {
        let (base, n) = (
            dev.p(&self.table) + self.section(layer, target) as u64,
            self.slots as u64,
        );
        [base, base + 8 * n, base + 16 * n, base + 20 * n]
    }
}

/// The groups of one launch pair: every adapter's runs of rows for one
/// target.
struct Launch {
    /// Where its first group starts in the uploaded list, in entries.
    first: usize,
    count: usize,
    /// Rows in its longest group (the grid's x).
    longest: usize,
}

/// Appends to `flat` the groups `(first row, end row, slot, expert)` of
/// consecutive rows whose token's slot `has` the target; `per_expert`
/// gives, per expert, its first row and each of its rows' token slot.
fn groups(
    flat: &mut Vec<i32>,
    per_expert: &[(usize, Vec<Option<usize>>)],
    has: impl Fn(Option<usize>) -> bool,
) -> Launch {
    // The groups follow whatever `flat` holds before them (the rows'
    // tokens and choices, for the experts' groups).
    let first = flat.len();
    let mut longest = 0;
    for (e, (start, slots)) in per_expert.iter().enumerate() {
        let mut r = 0;
        while r < slots.len() {
            let s = slots[r];
            let mut end = r + 1;
            while end < slots.len() && slots[end] == s {
                end += 1;
            }
            if let (Some(slot), true) = (s, has(s)) {
                flat.extend([
                    (start + r) as i32,
                    (start + end) as i32,
                    slot as i32,
                    e as i32,
                ]);
                longest = longest.max(end - r);
            }
            r = end;
        }
    }
    Launch {
        first,
        count: (flat.len() - first) / 4,
        longest,
    }
}

impl CudaBackend {
    /// Layer `l`'s Mixture-of-Experts block over the `n` rows of `normed`
    /// (f32), added into `hidden`.
    pub(super) fn moe_block(
        &self,
        l: usize,
        layer: &MoeLayer,
        normed: u64,
        n: usize,
        hidden: u64,
    ) -> Result<()> {
        let c = &self.config;
        let moe = c.moe.expect("a Mixture-of-Experts layer has a MoE config");
        let b = self
            .ws
            .moe
            .as_ref()
            .expect("a Mixture-of-Experts model's workspace has its buffers");
        let dev = &self.dev;
        let p = |s: &CudaSlice<f32>| dev.p(s);
        let (h, inter, experts, k) = (
            c.hidden_size,
            c.intermediate_size,
            moe.num_experts,
            moe.top_k,
        );
        let rows = n * k;
        let slot_of = &self.token_slots[..n];
        let slots = &self.expert_slots;
        let with_lora = slot_of.iter().filter(|&&s| slots.any(s, l)).count();
        self.expert_lora_rows
            .fetch_add(with_lora as u64, Ordering::Relaxed);

        // 1. The router's logits and each token's router LoRA.
        self.gemm(
            dev.p(&layer.router),
            cudaDataType::CUDA_R_32F,
            h,
            experts,
            normed,
            p(&b.logits),
            n,
        )?;
        if let Some(biases) = &layer.biases {
            dev.launch(
                "add_bias",
                Device::elementwise_grid(n * experts),
                256,
                &[
                    Arg::Ptr(p(&b.logits)),
                    Arg::Ptr(p(&biases.router)),
                    Arg::I32(n as i32),
                    Arg::I32(experts as i32),
                ],
            )?;
        }
        let mut flat = Vec::new();
        let token_rows = [(0usize, slot_of.to_vec())];
        let routers = groups(&mut flat, &token_rows, |s| slots.has(s, l, Target::Router));
        if routers.count > 0 {
            self.upload_i32(&flat, &b.groups)?;
            self.expert_lora(
                &routers,
                l,
                Target::Router,
                (normed, h),
                (p(&b.logits), experts),
                (dev.p(&b.groups), p(&b.t)),
            )?;
        }

        // 2. Each token's experts, 3. grouped by expert on the host.
        dev.launch(
            "moe_route",
            ((n as u32).div_ceil(128), 1, 1),
            128,
            &[
                Arg::Ptr(p(&b.logits)),
                Arg::I32(n as i32),
                Arg::I32(experts as i32),
                Arg::I32(k as i32),
                Arg::I32(i32::from(moe.norm_topk_prob)),
                Arg::I32(i32::from(moe.gpt_oss.is_some())),
                Arg::Ptr(dev.p(&b.route_e)),
                Arg::Ptr(p(&b.route_w)),
            ],
        )?;
        let chosen = dev
            .stream
            .clone_dtoh(&b.route_e.slice(0..rows))
            .map_err(cuda("reading the router's choices"))?;
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); experts];
        for (a, &e) in chosen.iter().enumerate() {
            let e = usize::try_from(e)
                .ok()
                .filter(|&e| e < experts)
                .ok_or_else(|| {
                    crate::EngineError::Backend(format!(
                        "cuda: the router chose expert {e} of {experts}"
                    ))
                })?;
            by_expert[e].push(a);
        }
        // The rows' tokens and each choice's row, then (below) the
        // expert-LoRA groups: one upload.
        let mut index = vec![0i32; 2 * rows];
        let mut per_expert = Vec::with_capacity(experts);
        let mut r = 0;
        for assigned in &by_expert {
            let start = r;
            for &a in assigned {
                index[r] = (a / k) as i32;
                index[rows + a] = r as i32;
                r += 1;
            }
            per_expert.push((
                start,
                assigned.iter().map(|&a| slot_of[a / k]).collect::<Vec<_>>(),
            ));
        }
        let gate_ups = groups(&mut index, &per_expert, |s| slots.has(s, l, Target::GateUp));
        let downs = groups(&mut index, &per_expert, |s| slots.has(s, l, Target::Down));
        // Each row's expert, for the experts' biases.
        let row_expert = index.len();
        if layer.biases.is_some() {
            for (e, assigned) in by_expert.iter().enumerate() {
                index.extend(std::iter::repeat_n(e as i32, assigned.len()));
            }
        }
        self.upload_i32(&index, &b.index)?;
        let expert_bias = |y: u64, bias: &CudaSlice<f32>, width: usize| -> Result<()> {
            dev.launch(
                "moe_bias",
                Device::elementwise_grid(rows * width),
                256,
                &[
                    Arg::Ptr(y),
                    Arg::Ptr(p(bias)),
                    Arg::Ptr(dev.p(&b.index) + (row_expert * 4) as u64),
                    Arg::I32(rows as i32),
                    Arg::I32(width as i32),
                ],
            )
        };
        let expert_groups = (dev.p(&b.index), p(&b.t));

        // 4. The experts over their rows.
        let w = self.dtype.bytes() as u64;
        let (xg, actg) = (p(&b.xg), p(&b.actg));
        let xg_in = b.xg_w.as_ref().map_or(xg, |c| dev.p(c));
        let act_in = b.actg_w.as_ref().map_or(actg, |c| dev.p(c));
        let in_bytes = if b.xg_w.is_some() { w } else { 4 };
        dev.launch(
            "moe_gather",
            (rows as u32, 1, 1),
            256,
            &[
                Arg::Ptr(normed),
                Arg::Ptr(dev.p(&b.index)),
                Arg::I32(h as i32),
                Arg::Ptr(xg),
                Arg::Ptr(b.xg_w.as_ref().map_or(0, |c| dev.p(c))),
            ],
        )?;
        for (e, (start, slots)) in per_expert.iter().enumerate() {
            let (start, m) = (*start as u64, slots.len());
            if m == 0 {
                continue;
            }
            let x = xg_in + start * h as u64 * in_bytes;
            let y = p(&b.gug) + start * (2 * inter) as u64 * 4;
            self.expert_projection(&layer.gate_up, e, (h, 2 * inter), x, y, m)?;
        }
        if let Some(biases) = &layer.biases {
            expert_bias(p(&b.gug), &biases.gate_up, 2 * inter)?;
        }
        self.expert_lora(
            &gate_ups,
            l,
            Target::GateUp,
            (xg, h),
            (p(&b.gug), 2 * inter),
            expert_groups,
        )?;
        let mut act_args = vec![
            Arg::Ptr(p(&b.gug)),
            Arg::Ptr(actg),
            Arg::Ptr(b.actg_w.as_ref().map_or(0, |c| dev.p(c))),
            Arg::I32(rows as i32),
            Arg::I32(inter as i32),
        ];
        let activation = match moe.gpt_oss {
            Some(g) => {
                act_args.extend([Arg::F32(g.swiglu_alpha), Arg::F32(g.swiglu_limit)]);
                "swiglu_clamped"
            }
            None => "silu_mul",
        };
        dev.launch(
            activation,
            Device::elementwise_grid(rows * inter),
            256,
            &act_args,
        )?;
        for (e, (start, slots)) in per_expert.iter().enumerate() {
            let (start, m) = (*start as u64, slots.len());
            if m == 0 {
                continue;
            }
            let x = act_in + start * inter as u64 * in_bytes;
            let y = p(&b.downg) + start * h as u64 * 4;
            self.expert_projection(&layer.down, e, (inter, h), x, y, m)?;
        }
        if let Some(biases) = &layer.biases {
            expert_bias(p(&b.downg), &biases.down, h)?;
        }
        self.expert_lora(
            &downs,
            l,
            Target::Down,
            (actg, inter),
            (p(&b.downg), h),
            expert_groups,
        )?;

        // 5. Each token's experts, weighed, into the residual stream.
        dev.launch(
            "moe_combine",
            (n as u32, 1, 1),
            256,
            &[
                Arg::Ptr(hidden),
                Arg::Ptr(p(&b.downg)),
                Arg::Ptr(dev.p(&b.index) + (rows * 4) as u64),
                Arg::Ptr(p(&b.route_w)),
                Arg::I32(k as i32),
                Arg::I32(h as i32),
            ],
        )
    }

    /// Expert `e`'s projection of its `m` rows: `y = x · Wᵀ`, x in the
    /// weights' type, y f32.
    fn expert_projection(
        &self,
        weights: &ExpertWeights,
        e: usize,
        (fan_in, fan_out): (usize, usize),
        x: u64,
        y: u64,
        m: usize,
    ) -> Result<()> {
        match weights {
            ExpertWeights::Dense(all) => {
                let w = self.dev.p(all) + (e * fan_out * fan_in * self.dtype.bytes()) as u64;
                self.gemm(w, self.dtype.cuda_type(), fan_in, fan_out, x, y, m)
            }
            ExpertWeights::Mxfp4(q) => self.quantized_linear(&q[e], fan_in, fan_out, x, y, m),
        }
    }

    /// Copies `values` into the start of `dst` on the compute stream.
    fn upload_i32(&self, values: &[i32], dst: &CudaSlice<i32>) -> Result<()> {
        let dst_ptr = self.dev.p(dst);
        // SAFETY: `dst` holds at least `values.len()` entries (the
        // buffers are sized for the step's rows); a copy from pageable
        // memory has read the source when it returns.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst_ptr, values, self.dev.stream.cu_stream())
        }
        .map_err(cuda("uploading the experts' grouping"))
    }

    /// The grouped expert-LoRA pair of every adapter in the step for
    /// (`l`, `target`): `x` (f32, `fan_in` wide) to `out` (f32, `fan_out`
    /// wide), over the groups of `launch` in the uploaded list.
    fn expert_lora(
        &self,
        launch: &Launch,
        l: usize,
        target: Target,
        (x, fan_in): (u64, usize),
        (out, fan_out): (u64, usize),
        (groups, t): (u64, u64),
    ) -> Result<()> {
        if launch.count == 0 {
            return Ok(());
        }
        let dev = &self.dev;
        let table = self.expert_slots.table(dev, l, target);
        let groups = groups + (launch.first * 4) as u64;
        let grid = (launch.longest as u32, launch.count as u32, 1);
        grouped_lora_pair(dev, grid, (x, fan_in), (out, fan_out), groups, table, t)
    }
}

/// The grouped expert-LoRA pair over uploaded groups of (first row, end
/// row, slot, expert) at `groups`, `grid` (the longest group's rows, the
/// groups): `x` (f32, `fan_in` wide) through each group's slot's A into
/// `t` (`[rows, max_rank]` f32), then B into `out` (f32, `fan_out` wide),
/// added; `table` the slots' A and B addresses, ranks and scales.
pub(super) fn grouped_lora_pair(
    dev: &Device,
    grid: (u32, u32, u32),
    (x, fan_in): (u64, usize),
    (out, fan_out): (u64, usize),
    groups: u64,
    [a_ptrs, b_ptrs, ranks, scales]: [u64; 4],
    t: u64,
) -> Result<()> {
    dev.launch(
        "moe_lora_shrink",
        grid,
        256,
        &[
            Arg::Ptr(x),
            Arg::I32(fan_in as i32),
            Arg::Ptr(groups),
            Arg::Ptr(a_ptrs),
            Arg::Ptr(ranks),
            Arg::Ptr(t),
        ],
    )?;
    dev.launch(
        "moe_lora_expand",
        grid,
        256,
        &[
            Arg::Ptr(t),
            Arg::I32(fan_out as i32),
            Arg::Ptr(groups),
            Arg::Ptr(b_ptrs),
            Arg::Ptr(ranks),
            Arg::Ptr(scales),
            Arg::Ptr(out),
        ],
    )
}
