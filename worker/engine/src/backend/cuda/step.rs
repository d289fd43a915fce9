//! One forward step on the device: the workspace it runs in, the launches
//! of the whole model, and the CUDA graphs that replay a decode step's
//! launches in one call.
//!
//! Every buffer a step touches lives in a [`Workspace`] allocated once
//! (sized for the most tokens and logit rows a step carries), so a step
//! allocates nothing and its launches read the same addresses each time.
//! The step's metadata is copied into the workspace before the launches.
//!
//! A decode step (every sequence feeds one token and wants its logits) is
//! captured into a graph the second time its batch size is seen, and
//! replayed from then on: one launch instead of about 250. What differs
//! between two steps of one batch size — tokens, positions, KV rows, block
//! tables, the LoRA segments, slots, ranks and scales — is device data the
//! graph reads, so one graph serves any adapter mix. Everything that sets
//! a launch's shape is in the [`GraphKey`]; a graph is never replayed for a
//! step whose key differs.

use std::collections::HashMap;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice};

use super::device::{Arg, Device, LoraLaunch, LoraSlice, cuda};
use super::meta::{HostMeta, MetaShape, StepMeta};
use super::{CudaBackend, Dtype, Mlp};
use crate::backend::{GraphCounters, StepBatch};
use crate::error::Result;
use crate::lora::Projection;
use crate::model::ModelConfig;
use lorafleet_artifact::layers::{Activation, LayerKind};

/// The projections that share their input, launched together.
pub(super) const QKV: [Projection; 3] = [Projection::Q, Projection::K, Projection::V];
pub(super) const GATE_UP: [Projection; 2] = [Projection::Gate, Projection::Up];

/// The largest decode batch captured in a graph; larger ones run their
/// launches one by one.
pub const MAX_GRAPH_TOKENS: usize = 512;

/// Every buffer of a step, allocated once.
pub(super) struct Workspace {
    /// The most tokens and logit rows the buffers hold.
    tokens: usize,
    rows: usize,
    hidden: CudaSlice<f32>,
    pub(super) normed: CudaSlice<f32>,
    pub(super) qkv: CudaSlice<f32>,
    pub(super) attn: CudaSlice<f32>,
    proj: CudaSlice<f32>,
    pub(super) gu: CudaSlice<f32>,
    pub(super) act: CudaSlice<f32>,
    pub(super) h_part: CudaSlice<f32>,
    /// The GEMM inputs in the weights' type (none in f32 mode).
    pub(super) cast: Option<CudaSlice<u8>>,
    /// `[rows, vocab]`.
    pub(super) logits: CudaSlice<f32>,
    /// The greedy pick of each row.
    pub(super) picked: CudaSlice<i32>,
    /// The step's metadata ([`HostMeta`]).
    meta: CudaSlice<i32>,
    /// A Mixture-of-Experts model's expert rows.
    pub(super) moe: Option<super::moe::MoeBuffers>,
}

impl Workspace {
    pub(super) fn new(
        dev: &Device,
        c: &ModelConfig,
        dtype: Dtype,
        max_rank: usize,
        tokens: usize,
        rows: usize,
        meta: usize,
    ) -> Result<Workspace> {
        let (tokens, rows) = (tokens.max(1), rows.max(1));
        let st = &dev.stream;
        let f32s = |len: usize| {
            st.alloc_zeros::<f32>(len.max(1))
                .map_err(cuda("allocating the step workspace"))
        };
        let (d, inter, q_dim, kv_dim) = (c.hidden_size, c.intermediate_size, c.q_dim(), c.kv_dim());
        let widest = d.max(inter).max(q_dim);
        let splits = dev.shapes.splits(widest);
        Ok(Workspace {
            tokens,
            rows,
            hidden: f32s(tokens * d)?,
            normed: f32s(tokens * d)?,
            qkv: f32s(tokens * (q_dim + 2 * kv_dim))?,
            attn: f32s(tokens * q_dim)?,
            proj: f32s(tokens * d)?,
            gu: f32s(tokens * 2 * inter)?,
            act: f32s(tokens * inter)?,
            h_part: f32s(3 * splits * tokens * max_rank)?,
            cast: if dtype == Dtype::F32 {
                None
            } else {
                Some(
                    st.alloc_zeros::<u8>(tokens.max(rows) * widest * dtype.bytes())
                        .map_err(cuda("allocating the step workspace"))?,
                )
            },
            logits: f32s(rows * c.vocab_size)?,
            picked: st
                .alloc_zeros::<i32>(rows)
                .map_err(cuda("allocating the step workspace"))?,
            meta: st
                .alloc_zeros::<i32>(meta.max(1))
                .map_err(cuda("allocating the step workspace"))?,
            moe: c
                .moe
                .map(|m| super::moe::MoeBuffers::new(dev, c, m, dtype, tokens))
                .transpose()?,
        })
    }

    fn holds(&self, tokens: usize, rows: usize, meta: usize) -> bool {
        tokens <= self.tokens && rows <= self.rows && meta <= self.meta.len()
    }
}

/// What sets the shape of every launch in a captured step. The buffers'
/// addresses are fixed while the workspace stands; when it is replaced,
/// every graph is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct GraphKey {
    /// Tokens, and so sequences: each feeds one.
    tokens: usize,
    /// Logit rows.
    rows: usize,
    /// The LoRA launches' grid.
    lora_grid: usize,
    /// The projections that have LoRA launches.
    lora_kinds: u8,
}

enum GraphState {
    /// Run once without a graph: the second step of this shape is captured
    /// (the first lets cuBLAS settle its choices outside a capture).
    Seen,
    Captured(Graph),
    /// Capture failed; this shape runs without a graph.
    Failed,
}

/// A captured graph, owned by one backend.
struct Graph(CudaGraph);

// SAFETY: a graph is reached only through `&mut CudaBackend`, so it is
// never used from two threads at once; moving it to another thread with
// its backend is what the driver allows (graph objects need external
// serialisation, not one thread).
#[allow(unsafe_code)]
unsafe impl Send for Graph {}

/// The captured graphs of one backend.
pub(super) struct Graphs {
    pub(super) enabled: bool,
    entries: HashMap<GraphKey, GraphState>,
    counters: GraphCounters,
    /// Why the last capture failed, if one did.
    pub(super) last_failure: Option<String>,
    /// The last step's metadata, token and row counts (its metadata stays
    /// in the workspace until the next step), for the profiling hook.
    pub(super) last_step: Option<(StepMeta, usize, usize)>,
}

impl Graphs {
    pub(super) fn new(enabled: bool) -> Graphs {
        Graphs {
            enabled,
            entries: HashMap::new(),
            counters: GraphCounters::default(),
            last_failure: None,
            last_step: None,
        }
    }

    /// Drops every captured graph (they are captured again as steps of
    /// their shapes come).
    pub(super) fn clear(&mut self) {
        self.entries.clear();
    }

    pub(super) fn counters(&self) -> GraphCounters {
        GraphCounters {
            graphs: self
                .entries
                .values()
                .filter(|g| matches!(g, GraphState::Captured(_)))
                .count(),
            ..self.counters
        }
    }
}

/// How a step runs.
enum Run {
    Eager,
    Capture(GraphKey),
    Replay(GraphKey),
}

impl CudaBackend {
    /// Runs one step on the device, leaving the logits of the rows that
    /// want them in the workspace (`last_logits` says how many rows).
    pub(super) fn run_step(&mut self, batch: &StepBatch<'_>) -> Result<()> {
        batch.check(&self.config, &self.shape)?;
        // As wide as its widest row: an adapter's grown vocabulary's.
        let width = batch.logits_width(self.config.vocab_size);
        crate::backend::check_own_vocab(
            batch,
            width,
            |s| self.outer.head_rows(s),
            |s| self.outer.embed_rows(s),
        )?;
        self.last_logits = None;
        let n = batch.tokens.len();
        if n == 0 {
            return Ok(());
        }
        let rows = batch.logit_rows();
        let decode =
            n <= MAX_GRAPH_TOKENS && batch.seqs.iter().all(|s| s.len == 1 && s.logit_rows == 1);
        let shape = MetaShape {
            block_size: self.shape.block_size,
            ring_len: self.shape.ring_len,
            freqs: self.token_freqs.as_ref(),
        };
        let host = HostMeta::build(batch, &rows, &shape, decode);
        if self.config.moe.is_some() {
            self.token_slots.clone_from(&batch.token_slot);
        }
        if !self.ws.holds(n, rows.len(), host.buf.len()) {
            // Larger than planned: a new workspace, and the graphs that
            // read the old one's addresses go with it.
            self.dev
                .stream
                .synchronize()
                .map_err(cuda("replacing the step workspace"))?;
            self.graphs.entries.clear();
            self.ws = Workspace::new(
                &self.dev,
                &self.config,
                self.dtype,
                self.slots.max_rank,
                n.max(self.ws.tokens),
                rows.len().max(self.ws.rows),
                host.buf.len().max(2 * self.ws.meta.len()),
            )?;
        }
        self.slots.wait_for(&self.dev, &batch.segments)?;
        let mut meta_dst = self.ws.meta.slice_mut(0..host.buf.len());
        self.dev
            .stream
            .memcpy_htod(&host.buf, &mut meta_dst)
            .map_err(cuda("uploading step metadata"))?;
        let mut meta = host.at(self.dev.p(&self.ws.meta));
        meta.h_part = self.dev.p(&self.ws.h_part);
        if meta.tiles > 0 {
            meta.lora_kinds = self.slots.kinds(&batch.segments);
        }
        self.graphs.last_step = Some((meta, n, rows.len()));
        // Embedding and lm_head LoRA are launched for this step's rows
        // alone: such a step never runs from a graph.
        self.outer_step = self.outer.plan(&self.dev, batch, &rows, width)?;

        let run = if decode && self.graphs.enabled && self.outer_step.is_empty() {
            let key = GraphKey {
                tokens: n,
                rows: rows.len(),
                lora_grid: meta.tiles,
                lora_kinds: meta.lora_kinds,
            };
            match self.graphs.entries.get(&key) {
                None => {
                    self.graphs.entries.insert(key, GraphState::Seen);
                    Run::Eager
                }
                Some(GraphState::Seen) => Run::Capture(key),
                Some(GraphState::Captured(_)) => Run::Replay(key),
                Some(GraphState::Failed) => Run::Eager,
            }
        } else {
            Run::Eager
        };
        match run {
            Run::Eager => {
                if decode {
                    self.graphs.counters.eager_decode_steps += 1;
                }
                self.launch_forward(&meta, n, rows.len())?;
            }
            Run::Capture(key) => {
                let state = match self.capture(&meta, n, rows.len()) {
                    Ok(graph) => GraphState::Captured(Graph(graph)),
                    Err(e) => {
                        // Kept for the worker's log and the tests.
                        self.graphs.last_failure = Some(format!("batch of {n}: {e}"));
                        self.graphs.counters.failed_captures += 1;
                        GraphState::Failed
                    }
                };
                self.graphs.entries.insert(key, state);
                return self.run_captured_or_eager(key, &meta, n, &rows);
            }
            Run::Replay(key) => return self.run_captured_or_eager(key, &meta, n, &rows),
        }
        self.finish_step(&rows)
    }

    fn run_captured_or_eager(
        &mut self,
        key: GraphKey,
        meta: &StepMeta,
        n: usize,
        rows: &[usize],
    ) -> Result<()> {
        match self.graphs.entries.get(&key) {
            Some(GraphState::Captured(Graph(graph))) => {
                graph.launch().map_err(cuda("replaying a decode graph"))?;
                self.graphs.counters.replays += 1;
            }
            _ => {
                self.graphs.counters.eager_decode_steps += 1;
                self.launch_forward(meta, n, rows.len())?;
            }
        }
        self.finish_step(rows)
    }

    fn finish_step(&mut self, rows: &[usize]) -> Result<()> {
        if rows.is_empty() {
            return self
                .dev
                .stream
                .synchronize()
                .map_err(cuda("running the step"));
        }
        self.last_logits = Some(rows.len());
        Ok(())
    }

    /// Captures the step's launches into a graph (nothing runs).
    fn capture(&self, meta: &StepMeta, n: usize, rows: usize) -> Result<CudaGraph> {
        self.capture_with(|| self.launch_forward(meta, n, rows))
    }

    /// Captures what `launch` puts on the compute stream into a graph
    /// (nothing runs).
    pub(super) fn capture_with(&self, launch: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
        let st = &self.dev.stream;
        st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(cuda("beginning a graph capture"))?;
        let launched = launch();
        // The capture always ends, so the stream is usable whatever
        // happened inside it.
        let ended = st.end_capture(CUgraphInstantiate_flags(0));
        launched?;
        let graph = ended
            .map_err(cuda("ending a graph capture"))?
            .ok_or_else(|| {
                crate::EngineError::Backend("cuda: the captured graph is empty".into())
            })?;
        graph.upload().map_err(cuda("uploading a decode graph"))?;
        Ok(graph)
    }

    /// Every launch of one forward pass over `n` tokens, with `rows` logit
    /// rows, on the compute stream.
    pub(super) fn launch_forward(&self, meta: &StepMeta, n: usize, rows: usize) -> Result<()> {
        let c = &self.config;
        let ws = &self.ws;
        let (d, inter, q_dim, kv_dim) = (c.hidden_size, c.intermediate_size, c.q_dim(), c.kv_dim());
        let cast = ws.cast.as_ref().map(|b| self.dev.p(b));
        let p = |s: &CudaSlice<f32>| self.dev.p(s);
        let (hidden, normed, qkv, attn, proj, gu, act) = (
            p(&ws.hidden),
            p(&ws.normed),
            p(&ws.qkv),
            p(&ws.attn),
            p(&ws.proj),
            p(&ws.gu),
            p(&ws.act),
        );
        // A kernel's f32 output as a GEMM input: the cast buffer after
        // `to_wt`, or the f32 buffer itself.
        let gemm_input = |src: u64, len: usize| -> Result<u64> {
            match cast {
                None => Ok(src),
                Some(dst) => {
                    self.dev.launch(
                        "to_wt",
                        Device::elementwise_grid(len),
                        256,
                        &[Arg::Ptr(src), Arg::Ptr(dst), Arg::I64(len as i64)],
                    )?;
                    Ok(dst)
                }
            }
        };
        let norm_rows = |x: u64, rows_ptr: u64, w: &CudaSlice<f32>, out: u64, count: usize| {
            self.dev.launch(
                "rms_norm",
                (count as u32, 1, 1),
                256,
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(rows_ptr),
                    Arg::Ptr(self.dev.p(w)),
                    Arg::Ptr(out),
                    Arg::Ptr(cast.unwrap_or(0)),
                    Arg::I32(d as i32),
                    Arg::F32(c.rms_norm_eps),
                ],
            )
        };
        // A Gemma norm of an attention or MLP output, in place.
        let norm_out = |x: u64, w: &Option<CudaSlice<f32>>| -> Result<()> {
            match w {
                None => Ok(()),
                Some(w) => self.dev.launch(
                    "rms_norm",
                    (n as u32, 1, 1),
                    256,
                    &[
                        Arg::Ptr(x),
                        Arg::Ptr(0),
                        Arg::Ptr(self.dev.p(w)),
                        Arg::Ptr(x),
                        Arg::Ptr(0),
                        Arg::I32(d as i32),
                        Arg::F32(c.rms_norm_eps),
                    ],
                ),
            }
        };
        let add = |h: u64, y: u64, len: usize| {
            self.dev.launch(
                "add_into",
                Device::elementwise_grid(len),
                256,
                &[Arg::Ptr(h), Arg::Ptr(y), Arg::I64(len as i64)],
            )
        };
        self.dev.launch(
            "embed",
            (n as u32, 1, 1),
            256,
            &[
                Arg::Ptr(self.dev.p(&self.embed)),
                Arg::Ptr(meta.tokens),
                Arg::Ptr(hidden),
                Arg::I32(d as i32),
                Arg::F32(c.gemma.as_ref().map_or(1.0, |g| g.embed_scale)),
                Arg::I32(c.vocab_size as i32),
            ],
        )?;
        self.outer.embed(
            &self.dev,
            &self.outer_step,
            (meta.tokens, hidden),
            d,
            c.gemma.as_ref().map_or(1.0, |g| g.embed_scale),
        )?;
        for (l, layer) in self.layers.iter().enumerate() {
            let sliding = c.layer_kinds[l] == LayerKind::Sliding;
            // A sliding layer of a model with both kinds stores its keys
            // and values in the sequences' rings.
            let kv_row = if sliding && self.shape.ring_len > 0 {
                meta.ring_row
            } else {
                meta.kv_row
            };
            let rope = c.rope_of(l);
            let (freqs, freq_stride) = match (&self.local_inv_freq, &self.token_freqs) {
                (Some(local), _) if sliding => (p(local), 0),
                (_, Some(per_token)) => (meta.freqs, per_token.half()),
                _ => (p(&self.inv_freq), 0),
            };
            norm_rows(hidden, 0, &layer.input_norm, normed, n)?;
            // Each LoRA shrink runs beside the base GEMM that reads the
            // same input (`lora_fork`); its expand adds into the GEMM's
            // output once both are done (`lora_join`).
            let lora = self.lora_launch(l, &QKV, normed, n, qkv, meta);
            self.dev.lora_fork(lora.as_ref())?;
            self.linear(&layer.qkv, cast.unwrap_or(normed), qkv, n)?;
            self.dev.lora_join(lora.as_ref())?;
            if let Some((q_w, k_w)) = &layer.qk_norm {
                self.dev.launch(
                    "head_norm",
                    (n as u32, 1, 1),
                    128,
                    &[
                        Arg::Ptr(qkv),
                        Arg::I32(q_dim as i32),
                        Arg::I32(kv_dim as i32),
                        Arg::Ptr(self.dev.p(q_w)),
                        Arg::Ptr(self.dev.p(k_w)),
                        Arg::F32(c.rms_norm_eps),
                    ],
                )?;
            }
            self.dev.launch(
                "rope_store",
                (n as u32, 1, 1),
                128,
                &[
                    Arg::Ptr(qkv),
                    Arg::I32(q_dim as i32),
                    Arg::I32(kv_dim as i32),
                    Arg::Ptr(meta.pos),
                    Arg::Ptr(kv_row),
                    Arg::Ptr(freqs),
                    Arg::I32(freq_stride as i32),
                    Arg::I32((rope.rotary_dim / 2) as i32),
                    Arg::F32(rope.attention_factor()),
                    Arg::Ptr(self.dev.p(&self.k_cache[l])),
                    Arg::Ptr(self.dev.p(&self.v_cache[l])),
                ],
            )?;
            self.attention(l, meta, n, qkv, attn)?;
            let x = gemm_input(attn, n * q_dim)?;
            let lora = self.lora_launch(l, &[Projection::O], attn, n, proj, meta);
            self.dev.lora_fork(lora.as_ref())?;
            self.linear(&layer.o, x, proj, n)?;
            self.dev.lora_join(lora.as_ref())?;
            norm_out(proj, &layer.attn_out_norm)?;
            add(hidden, proj, n * d)?;
            norm_rows(hidden, 0, &layer.post_norm, normed, n)?;
            let (gate_up, down) = match &layer.mlp {
                Mlp::Dense { gate_up, down } => (gate_up, down),
                Mlp::Moe(block) => {
                    // The experts add into the residual stream themselves:
                    // no family has a norm of the MLP's output there.
                    debug_assert!(layer.mlp_out_norm.is_none());
                    self.moe_block(l, block, normed, n, hidden)?;
                    continue;
                }
            };
            let lora = self.lora_launch(l, &GATE_UP, normed, n, gu, meta);
            self.dev.lora_fork(lora.as_ref())?;
            self.linear(gate_up, cast.unwrap_or(normed), gu, n)?;
            self.dev.lora_join(lora.as_ref())?;
            let activation = match c.activation {
                Activation::Silu => "silu_mul",
                Activation::GeluTanh => "gelu_mul",
            };
            self.dev.launch(
                activation,
                Device::elementwise_grid(n * inter),
                256,
                &[
                    Arg::Ptr(gu),
                    Arg::Ptr(act),
                    Arg::Ptr(cast.unwrap_or(0)),
                    Arg::I32(n as i32),
                    Arg::I32(inter as i32),
                ],
            )?;
            let lora = self.lora_launch(l, &[Projection::Down], act, n, proj, meta);
            self.dev.lora_fork(lora.as_ref())?;
            self.linear(down, cast.unwrap_or(act), proj, n)?;
            self.dev.lora_join(lora.as_ref())?;
            norm_out(proj, &layer.mlp_out_norm)?;
            add(hidden, proj, n * d)?;
        }
        if rows == 0 {
            return Ok(());
        }
        norm_rows(hidden, meta.rows, &self.norm, normed, rows)?;
        self.logits(normed, cast, rows)
    }
}

impl CudaBackend {
    /// Layer `l`'s attention over the cache for the step's `n` tokens:
    /// queries from `qkv`, outputs into `attn`.
    pub(super) fn attention(
        &self,
        l: usize,
        meta: &StepMeta,
        n: usize,
        qkv: u64,
        attn: u64,
    ) -> Result<()> {
        let c = &self.config;
        // A sliding layer of a model with both kinds keeps its keys and
        // values in the sequences' rings.
        let sliding = c.layer_kinds[l] == LayerKind::Sliding;
        let ring_len = if sliding { self.shape.ring_len } else { 0 };
        let tables = if ring_len > 0 {
            meta.rings
        } else {
            meta.block_tables
        };
        let cap = c
            .gemma
            .as_ref()
            .and_then(|g| g.attn_logit_softcapping)
            .unwrap_or(0.0);
        self.dev.launch(
            "attention",
            (n as u32, c.num_heads as u32, 1),
            128,
            &[
                Arg::Ptr(qkv),
                Arg::I32(c.q_dim() as i32),
                Arg::I32(c.kv_dim() as i32),
                Arg::Ptr(self.dev.p(&self.k_cache[l])),
                Arg::Ptr(self.dev.p(&self.v_cache[l])),
                Arg::Ptr(meta.pos),
                Arg::Ptr(meta.tok_seq),
                Arg::Ptr(meta.bt_off),
                Arg::Ptr(tables),
                Arg::I32(self.shape.block_size as i32),
                Arg::I32(ring_len as i32),
                Arg::I32(c.window(l).map_or(0, |w| w as i32)),
                Arg::F32(c.attention_scale()),
                Arg::F32(cap),
                Arg::Ptr(self.layers[l].sinks.as_ref().map_or(0, |s| self.dev.p(s))),
                Arg::Ptr(attn),
            ],
        )
    }

    /// Adds the LoRA deltas of `projs` (one to three projections sharing the
    /// input `x`, `[n, fan_in]` f32) into their columns of the fused output
    /// `out`, shrink and expand in turn on the compute stream.
    pub(super) fn lora(
        &self,
        layer: usize,
        projs: &[Projection],
        x: u64,
        n: usize,
        out: u64,
        meta: &StepMeta,
    ) -> Result<()> {
        match self.lora_launch(layer, projs, x, n, out, meta) {
            Some(l) => self.dev.lora(&l),
            None => Ok(()),
        }
    }

    /// The grouped LoRA launch of `projs` in `layer` over the projections
    /// that some adapter of the step has (`StepMeta::lora_kinds`); None
    /// where the step has no LoRA work for any of them.
    pub(super) fn lora_launch(
        &self,
        layer: usize,
        projs: &[Projection],
        x: u64,
        n: usize,
        out: u64,
        meta: &StepMeta,
    ) -> Option<LoraLaunch> {
        if meta.tiles == 0 {
            return None;
        }
        let mut offset = 0;
        let mut slices = Vec::with_capacity(projs.len());
        for p in projs {
            let width = p.shape(&self.config).1;
            if meta.lora_kinds & (1 << p.index()) != 0 {
                let key = layer * 7 + p.index();
                slices.push(LoraSlice {
                    a: self.slots.a_of(&self.dev, key),
                    b: self.slots.b_of(&self.dev, key),
                    b_stride: self.slots.stride,
                    rank: self.slots.rank_of(&self.dev, key),
                    scale: self.slots.scale_of(&self.dev, key),
                    flags: self.slots.flags_of(&self.dev, key),
                    vectors: self.slots.vectors_at(&self.dev, key),
                    bias: self.base_bias(layer, *p),
                    width,
                    offset,
                });
            }
            offset += width;
        }
        if slices.is_empty() {
            return None;
        }
        Some(LoraLaunch {
            x,
            fan_in: projs[0].shape(&self.config).0,
            n,
            out,
            out_stride: offset,
            slices,
            a_stride: self.slots.stride,
            segments: meta.segments,
            tiles: meta.tiles,
            h_part: meta.h_part,
            v_stride: self.slots.v_stride,
        })
    }
}
