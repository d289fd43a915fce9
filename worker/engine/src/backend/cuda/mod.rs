//! The CUDA backend on `cudarc`: base GEMMs through cuBLAS, everything
//! else in NVRTC kernels compiled at start for the model's shapes
//! (`kernels.cu`).
//!
//! The CUDA libraries are loaded at run time, so this code builds and links
//! on machines without CUDA; [`probe`] turns a missing driver, NVRTC or
//! cuBLAS into an ordinary error before any call that would panic.
//!
//! Layouts on the device:
//! - base weights in the chosen [`Dtype`], row-major `[out, in]` as in the
//!   checkpoint, with q/k/v fused into one `[q | k | v]` matrix and
//!   gate/up into `[gate | up]`; norms and biases in f32;
//! - activations and the residual stream in f32; the KV cache (`[blocks,
//!   block_size, kv_dim]` per layer, as the CPU backend) in the weights'
//!   type;
//! - adapter slots per (layer, projection) in f32: A `[slots, max_rank,
//!   in]` and Bᵀ `[slots, max_rank, out]`, with each slot's rank and scale
//!   in two small arrays the kernels read, so a slot is read only up to
//!   its own rank and never needs clearing.

// Kernel launches, raw device pointers and the library probes are FFI.
#![allow(unsafe_code)]

mod device;
mod dora;
mod dtype;
mod fp8;
pub mod kernels;
mod logits;
mod meta;
mod moe;
mod outer;
pub mod plan;
pub mod quant;
mod sample;
mod slots;
mod staging;
mod step;
#[doc(hidden)]
pub mod testing;

pub use super::DeviceSample;
pub use dtype::Dtype;
pub use step::MAX_GRAPH_TOKENS;
use step::{Graphs, Workspace};

use std::ffi::c_void;
use std::path::Path;

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys as blas_sys;
use cudarc::driver::{CudaContext, CudaSlice};

use self::device::{Arg, Device, cuda};
use self::kernels::KernelShapes;
use self::plan::MemoryPlan;
use self::slots::Slots;
use super::{Backend, BackendShape, GraphCounters, StepBatch};
use crate::error::{EngineError, Result};
use crate::lora::{HostAdapter, Projection};
use crate::model::norms::{LayerNorms, final_norm};
use crate::model::{ModelConfig, WeightFiles};

/// Checks that the CUDA driver, NVRTC and cuBLAS libraries can be loaded
/// and that a device exists. cudarc panics on a call into a library it
/// cannot load, so this runs before any such call.
pub fn probe() -> Result<()> {
    let missing = |what: &str, lib: &str| {
        Err(EngineError::Backend(format!(
            "the {what} ({lib}) was not found; this machine has no usable CUDA installation"
        )))
    };
    // SAFETY: each probe only tries to open a shared library by name.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return missing("NVIDIA driver library", "libcuda.so");
    }
    if !kernels::nvrtc_present() {
        return missing("NVRTC library", "libnvrtc.so");
    }
    if !unsafe { blas_sys::is_culib_present() } {
        return missing("cuBLAS library", "libcublas.so");
    }
    let count = CudaContext::device_count()
        .map_err(|e| EngineError::Backend(format!("the CUDA driver cannot count devices: {e}")))?;
    if count < 1 {
        return Err(EngineError::Backend(
            "cuda: no CUDA device is visible".into(),
        ));
    }
    Ok(())
}

/// A base linear layer: weights `[out, in]` in the backend's dtype (or
/// quantized as the checkpoint stores them) and an optional f32 bias.
struct Linear {
    w: Weights,
    bias: Option<CudaSlice<f32>>,
    fan_in: usize,
    fan_out: usize,
}

enum Weights {
    Dense(CudaSlice<u8>),
    Quantized(Box<quant::QuantLinear>),
}

struct Layer {
    input_norm: CudaSlice<f32>,
    /// The norm before the MLP (Llama's `post_attention_layernorm`,
    /// Gemma's `pre_feedforward_layernorm`).
    post_norm: CudaSlice<f32>,
    /// Gemma's norms of the attention's and the MLP's outputs
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`).
    attn_out_norm: Option<CudaSlice<f32>>,
    mlp_out_norm: Option<CudaSlice<f32>>,
    /// `[q | k | v]`.
    qkv: Linear,
    /// Per-head RMSNorm weights of the queries and keys (Qwen3), applied
    /// before RoPE.
    qk_norm: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    o: Linear,
    /// GPT-OSS's sink logit of each query head (`self_attn.sinks`).
    sinks: Option<CudaSlice<f32>>,
    mlp: Mlp,
}

/// A layer's MLP: one SwiGLU, or a Mixture of SwiGLU experts.
enum Mlp {
    Dense {
        /// `[gate | up]`.
        gate_up: Linear,
        down: Linear,
    },
    Moe(moe::MoeLayer),
}

/// The CUDA backend.
pub struct CudaBackend {
    config: ModelConfig,
    shape: BackendShape,
    dtype: Dtype,
    // Field order is drop order: buffers and the cuBLAS handle go before
    // the device (stream and context) they belong to.
    embed: CudaSlice<u8>,
    layers: Vec<Layer>,
    norm: CudaSlice<f32>,
    lm_head: Linear,
    /// In the weights' type.
    k_cache: Vec<CudaSlice<u8>>,
    v_cache: Vec<CudaSlice<u8>>,
    inv_freq: CudaSlice<f32>,
    /// The sliding layers' own frequencies (Gemma 3's
    /// `rope_local_base_freq`).
    local_inv_freq: Option<CudaSlice<f32>>,
    /// Frequencies that differ between tokens (LongRoPE, dynamic NTK),
    /// written into each step's metadata.
    token_freqs: Option<meta::TokenFreqs>,
    slots: Slots,
    /// Each slot's expert LoRA, for a Mixture-of-Experts model's adapters
    /// that have one.
    expert_slots: moe::ExpertSlots,
    /// Each slot's embedding and lm_head LoRA, for adapters that have one.
    outer: outer::OuterSlots,
    /// What the step being launched does outside the layers.
    outer_step: outer::OuterStep,
    /// The adapter slot of each token of the step being launched (the
    /// Mixture-of-Experts blocks group their LoRA rows by it).
    token_slots: Vec<Option<usize>>,
    /// Token rows that have gone through an expert LoRA, all steps
    /// together (as the CPU backend counts them).
    expert_lora_rows: std::sync::atomic::AtomicU64,
    /// Decode steps captured as CUDA graphs, by shape; they go before the
    /// workspace whose addresses they hold.
    graphs: Graphs,
    ws: Workspace,
    /// How many rows of `ws.logits` the last forward left, for device
    /// sampling.
    last_logits: Option<usize>,
    plan: MemoryPlan,
    /// The quantized layers' scratch and FP8 GEMMs, when there are any.
    quant: Option<quant::QuantScratch>,
    blas: CudaBlas,
    /// cuBLAS's workspace, set explicitly so that a captured GEMM never
    /// allocates.
    _blas_workspace: CudaSlice<u8>,
    dev: Device,
}

/// The cuBLAS workspace (what cuBLAS itself asks for on Hopper).
const BLAS_WORKSPACE: usize = 32 << 20;

/// The most a step carries, for sizing its workspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepLimits {
    /// Tokens in one step.
    pub max_tokens: usize,
    /// Sequences wanting logits in one step.
    pub max_rows: usize,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.dev.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// Loads a model directory onto CUDA device `ordinal`, with base
    /// weights in `dtype`.
    pub fn load(
        dir: &Path,
        config: &ModelConfig,
        shape: BackendShape,
        ordinal: usize,
        dtype: Dtype,
        limits: StepLimits,
    ) -> Result<CudaBackend> {
        Self::load_with_slot_dtype(dir, config, shape, ordinal, dtype, Dtype::F32, limits)
    }

    /// [`CudaBackend::load`] with adapter slots held in `slot_dtype`
    /// rather than f32. f32 slots keep an f32 adapter's values exactly (as
    /// PEFT computes by default) and are the faster ones for the LoRA
    /// kernels today; 16-bit slots halve the bytes a slot write copies
    /// (BENCHMARKS.md, "decode on a Llama-3.2-1B-shape stand-in").
    pub fn load_with_slot_dtype(
        dir: &Path,
        config: &ModelConfig,
        shape: BackendShape,
        ordinal: usize,
        dtype: Dtype,
        slot_dtype: Dtype,
        limits: StepLimits,
    ) -> Result<CudaBackend> {
        let c = config;
        let dev = Device::open(
            ordinal,
            KernelShapes {
                slot_dtype,
                ..KernelShapes::for_model(c, shape.max_lora_rank, dtype)
            },
        )?;
        let (free, total) = dev
            .ctx
            .mem_get_info()
            .map_err(cuda("reading free device memory"))?;
        let plan = MemoryPlan::new(
            c,
            &shape,
            dtype,
            limits.max_tokens,
            limits.max_rows,
            total as u64,
        )
        .with_slot_dtype(c, &shape, slot_dtype);
        let files = WeightFiles::open_model_dir(dir)?;
        // FP8 checkpoints that quantize their activations run FP8 GEMMs
        // where the device has them (compute 8.9 and newer).
        let fp8_gemms = files
            .quantization()
            .is_some_and(|q| q.fp8_inputs_per_token())
            && dev.cc >= (8, 9)
            && fp8::present();
        let quant_plan = quant::QuantPlan::new(&files, c, dtype, limits.max_tokens, fp8_gemms);
        let plan = match &quant_plan {
            Some(q) => plan.with_quantized(q),
            None => plan,
        };
        // Refused before anything is allocated.
        plan.check(free as u64)?;
        let stream = dev.stream.clone();
        let blas = CudaBlas::new(stream.clone()).map_err(cuda("starting cuBLAS"))?;
        // Plain f32 math in f32 mode (no TF32), so it can be checked
        // against the CPU reference.
        unsafe {
            blas_sys::cublasSetMathMode(*blas.handle(), blas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH)
        }
        .result()
        .map_err(cuda("setting the cuBLAS math mode"))?;
        let blas_workspace = stream
            .alloc_zeros::<u8>(BLAS_WORKSPACE)
            .map_err(cuda("allocating the cuBLAS workspace"))?;
        // SAFETY: the workspace outlives the handle (field order) and is
        // used only by work on the handle's stream.
        unsafe {
            blas_sys::cublasSetWorkspace_v2(
                *blas.handle(),
                dev.p(&blas_workspace) as *mut c_void,
                BLAS_WORKSPACE,
            )
        }
        .result()
        .map_err(cuda("setting the cuBLAS workspace"))?;

        let fp8_gemm = if fp8_gemms {
            Some(fp8::Fp8Gemm::new(&dev)?)
        } else {
            None
        };
        let up_f32 = |v: &[f32]| stream.clone_htod(v).map_err(cuda("uploading weights"));
        let up_w = |v: &[f32]| {
            stream
                .clone_htod(&dtype.encode(v))
                .map_err(cuda("uploading weights"))
        };
        let embed_host = files.f32("model.embed_tokens.weight", &[c.vocab_size, c.hidden_size])?;
        let embed = up_w(&embed_host)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let prefix = format!("model.layers.{l}");
            // Rows of several projections stacked into one matrix, with
            // their biases, if the model has them.
            let fused = |projs: &[Projection]| -> Result<Linear> {
                let (fan_in, _) = projs[0].shape(c);
                let mut w = Vec::new();
                let mut bias = Vec::new();
                let mut fan_out = 0;
                let quantized = quant::read_parts(&files, &prefix, projs, c)?;
                let has_bias = match projs[0] {
                    Projection::Q | Projection::K | Projection::V => c.qkv_bias,
                    Projection::O => c.o_bias,
                    _ => c.mlp_bias,
                };
                for (path, out) in lorafleet_artifact::adapter::stored_tensors(c, projs) {
                    let name = format!("{prefix}.{path}");
                    if quantized.is_none() {
                        w.extend(files.f32(&format!("{name}.weight"), &[out, fan_in])?);
                    }
                    if has_bias {
                        bias.extend(files.f32(&format!("{name}.bias"), &[out])?);
                    }
                    fan_out += out;
                }
                let w = match quantized {
                    Some(parts) => {
                        let fp8_rows = fp8_gemm.as_ref().is_some_and(|g| {
                            quant::fp8_ready(&parts)
                                && g.supports(fan_out, fan_in, limits.max_tokens)
                        });
                        Weights::Quantized(Box::new(quant::QuantLinear::upload(
                            &dev, &parts, fp8_rows,
                        )?))
                    }
                    None => Weights::Dense(up_w(&w)?),
                };
                Ok(Linear {
                    w,
                    bias: if bias.is_empty() {
                        None
                    } else {
                        Some(up_f32(&bias)?)
                    },
                    fan_in,
                    fan_out,
                })
            };
            // Read as the CPU backend reads them (Gemma's 1 + w at load).
            let norms = LayerNorms::load(&files, c, l)?;
            layers.push(Layer {
                input_norm: up_f32(&norms.input)?,
                post_norm: up_f32(&norms.post)?,
                attn_out_norm: norms.attn_out.as_deref().map(up_f32).transpose()?,
                mlp_out_norm: norms.mlp_out.as_deref().map(up_f32).transpose()?,
                qkv: fused(&[Projection::Q, Projection::K, Projection::V])?,
                qk_norm: match &norms.qk {
                    Some((q, k)) => Some((up_f32(q)?, up_f32(k)?)),
                    None => None,
                },
                o: fused(&[Projection::O])?,
                sinks: match c.attention_sinks {
                    true => Some(up_f32(
                        &files.f32(&format!("{prefix}.self_attn.sinks"), &[c.num_heads])?,
                    )?),
                    false => None,
                },
                mlp: match c.moe {
                    Some(m) => Mlp::Moe(moe::MoeLayer::load(&files, c, m, l, &dev, dtype)?),
                    None => Mlp::Dense {
                        gate_up: fused(&[Projection::Gate, Projection::Up])?,
                        down: fused(&[Projection::Down])?,
                    },
                },
            });
        }
        let norm = up_f32(&final_norm(&files, c)?)?;
        let lm_head = Linear {
            w: Weights::Dense(
                if c.tie_word_embeddings && !files.contains("lm_head.weight") {
                    up_w(&embed_host)?
                } else {
                    up_w(&files.f32("lm_head.weight", &[c.vocab_size, c.hidden_size])?)?
                },
            ),
            bias: None,
            fan_in: c.hidden_size,
            fan_out: c.vocab_size,
        };
        drop(embed_host);

        let mut k_cache = Vec::with_capacity(c.num_layers);
        let mut v_cache = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            // A sliding layer of a model with both kinds holds its rings.
            let blocks = plan::cache_blocks(c, &shape, l);
            let kv_bytes = blocks * shape.block_size * c.kv_dim() * dtype.bytes();
            let bytes = || {
                stream
                    .alloc_zeros::<u8>(kv_bytes.max(1))
                    .map_err(cuda("allocating the KV cache"))
            };
            k_cache.push(bytes()?);
            v_cache.push(bytes()?);
        }
        let quant = match &quant_plan {
            Some(_) => Some(quant::QuantScratch::new(
                &dev,
                &layers,
                dtype,
                limits.max_tokens,
                fp8_gemm,
                files.quantization().and_then(|q| q.input),
            )?),
            None => None,
        };
        let slots = Slots::new(&dev, c, &shape)?;
        let moe_layers = if c.moe.is_some() { c.num_layers } else { 0 };
        let expert_slots = moe::ExpertSlots::new(&dev, moe_layers, shape.slots)?;
        let outer = outer::OuterSlots::new(&dev, shape.slots, dtype, c.vocab_size)?;
        // The CPU backend's frequencies, computed once from the config.
        let inv_freq = up_f32(&c.rope.inv_freq())?;
        let local_inv_freq = c
            .gemma
            .as_ref()
            .and_then(|g| g.local_rope.as_ref())
            .map(|r| up_f32(&r.inv_freq()))
            .transpose()?;
        let token_freqs = meta::TokenFreqs::new(&c.rope);
        // Every section of a step's metadata is at most one entry per
        // token (two per tile) and a row of frequencies per token, a ring
        // per sequence, plus the block tables; grown if a step needs more.
        let per_token = 16 + token_freqs.as_ref().map_or(0, |f| f.half());
        let meta = per_token * limits.max_tokens + (4 + shape.ring_len) * limits.max_rows + 4096;
        let ws = Workspace::new(
            &dev,
            c,
            dtype,
            slots.max_rank,
            limits.max_tokens,
            limits.max_rows,
            meta,
        )?;
        stream.synchronize().map_err(cuda("loading the model"))?;
        Ok(CudaBackend {
            config: c.clone(),
            shape,
            dtype,
            embed,
            layers,
            norm,
            lm_head,
            k_cache,
            v_cache,
            inv_freq,
            local_inv_freq,
            token_freqs,
            slots,
            expert_slots,
            outer,
            outer_step: Default::default(),
            token_slots: Vec::new(),
            expert_lora_rows: Default::default(),
            // A Mixture-of-Experts step reads the router's choices back
            // mid-step, which a graph cannot hold.
            graphs: Graphs::new(c.moe.is_none()),
            ws,
            last_logits: None,
            plan,
            quant,
            blas,
            _blas_workspace: blas_workspace,
            dev,
        })
    }

    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Turns CUDA graphs for decode steps on (the default) or off; off,
    /// every step launches its kernels one by one.
    /// A Mixture-of-Experts model never uses them (its steps read the
    /// router's choices back mid-step).
    pub fn set_graphs(&mut self, enabled: bool) {
        self.graphs.enabled = enabled && self.config.moe.is_none();
    }

    /// Turns programmatic dependent launch on or off (off by default):
    /// each kernel may then be scheduled while the one before it drains,
    /// which hides launch latency between dependent kernels (cuBLAS's
    /// GEMMs launch as they always do). It changes no result: every kernel
    /// waits for its predecessor's writes before its first load. Graphs
    /// captured before are dropped, to be captured again with the new
    /// launches. Returns whether it is on (never on a device older than
    /// compute 9.0).
    pub fn set_pdl(&mut self, enabled: bool) -> bool {
        let was = self.dev.pdl();
        let on = self.dev.set_pdl(enabled);
        if on != was {
            self.graphs.clear();
        }
        on
    }

    /// Token rows that have gone through an expert LoRA (router, gate/up
    /// or down of a Mixture-of-Experts block) since the backend was made:
    /// tokens whose adapter has no expert weights never do.
    pub fn expert_lora_rows(&self) -> u64 {
        self.expert_lora_rows
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Why the last graph capture failed, if one did (that batch size then
    /// runs without a graph).
    pub fn graph_failure(&self) -> Option<&str> {
        self.graphs.last_failure.as_deref()
    }

    /// `y[n, out] = x[n, in] · Wᵀ (+ bias)`: x in the weights' type, y f32.
    fn linear(&self, lin: &Linear, x: u64, y: u64, n: usize) -> Result<()> {
        self.dev.count_launch();
        match &lin.w {
            Weights::Dense(w) => {
                let ty = self.dtype.cuda_type();
                self.gemm(self.dev.p(w), ty, lin.fan_in, lin.fan_out, x, y, n)?;
            }
            Weights::Quantized(q) => self.quantized_linear(q, lin.fan_in, lin.fan_out, x, y, n)?,
        }
        self.add_bias(lin, y, n)
    }

    /// `y[n, fan_out] = x[n, fan_in] · Wᵀ` through cuBLAS: W row-major
    /// `[fan_out, fan_in]` at `w`, W and x of type `ty`, y f32.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        w: u64,
        ty: blas_sys::cudaDataType,
        fan_in: usize,
        fan_out: usize,
        x: u64,
        y: u64,
        n: usize,
    ) -> Result<()> {
        self.gemm_ld(w, ty, fan_in, fan_out, x, y, n, fan_out)
    }

    /// [`CudaBackend::gemm`] with y's rows `ldy` apart (`ldy ≥ fan_out`).
    #[allow(clippy::too_many_arguments)]
    fn gemm_ld(
        &self,
        w: u64,
        ty: blas_sys::cudaDataType,
        fan_in: usize,
        fan_out: usize,
        x: u64,
        y: u64,
        n: usize,
        ldy: usize,
    ) -> Result<()> {
        let (alpha, beta) = (1f32, 0f32);
        let (m, k) = (fan_out as i32, fan_in as i32);
        // Row-major y[n, m] = x[n, k]·W[m, k]ᵀ is column-major
        // yᵀ[m, n] = W·xᵀ: W is a column-major [k, m] matrix, transposed.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m,
                n as i32,
                k,
                (&alpha as *const f32).cast::<c_void>(),
                w as *const c_void,
                ty,
                k,
                x as *const c_void,
                ty,
                k,
                (&beta as *const f32).cast::<c_void>(),
                y as *mut c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                ldy as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(cuda("cuBLAS GEMM"))
    }

    fn add_bias(&self, lin: &Linear, y: u64, n: usize) -> Result<()> {
        if let Some(bias) = &lin.bias {
            self.dev.launch(
                "add_bias",
                Device::elementwise_grid(n * lin.fan_out),
                256,
                &[
                    Arg::Ptr(y),
                    Arg::Ptr(self.dev.p(bias)),
                    Arg::I32(n as i32),
                    Arg::I32(lin.fan_out as i32),
                ],
            )?;
        }
        Ok(())
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_name(&self) -> String {
        self.dev.name.clone()
    }

    fn memory_plan(&self) -> Option<MemoryPlan> {
        Some(self.plan)
    }

    fn weight_bytes(&self) -> u64 {
        self.plan.weights
    }

    fn device_memory(&self) -> Option<super::DeviceMemory> {
        // Another process on the device counts too: this is the device's
        // own account.
        let (free, total) = self.dev.ctx.mem_get_info().ok()?;
        Some(super::DeviceMemory {
            used: (total - free) as u64,
            total: total as u64,
        })
    }

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn shape(&self) -> BackendShape {
        self.shape
    }

    fn write_slot(&mut self, slot: usize, adapter: &HostAdapter) -> Result<()> {
        super::check_slot_write(&self.shape, slot, adapter)?;
        let (dora, quantized_dora) = self.dora_bases(adapter)?;
        // The expert factors' copy goes first on the copy stream, so the
        // slot's ready event, recorded after the dense copy, covers both.
        self.expert_slots
            .write(&self.dev, self.slots.copy_stream(), slot, adapter)?;
        self.outer
            .write(&self.dev, self.slots.copy_stream(), slot, adapter)?;
        self.slots.write(&self.dev, slot, adapter, &dora)?;
        self.quantized_dora_scales(slot, &quantized_dora)
    }

    fn slot_ready(&self, slot: usize) -> bool {
        !self.slots.copy_in_flight(slot)
    }

    fn clear_slot(&mut self, slot: usize) -> Result<()> {
        if slot >= self.shape.slots {
            return Err(EngineError::Backend(format!("slot {slot} is out of range")));
        }
        self.expert_slots.clear(&self.dev, slot)?;
        self.outer.clear(&self.dev, slot)?;
        self.slots.clear(&self.dev, slot)
    }

    fn forward(&mut self, batch: &StepBatch<'_>) -> Result<Vec<f32>> {
        self.run_step(batch)?;
        match self.last_logits {
            Some(rows) => {
                // A step wider than the base's vocabulary left its rows in
                // the wide logits.
                let (logits, width) = self
                    .outer
                    .wide_logits(&self.outer_step)
                    .unwrap_or((&self.ws.logits, self.config.vocab_size));
                self.dev
                    .stream
                    .clone_dtoh(&logits.slice(0..rows * width))
                    .map_err(cuda("running the step"))
            }
            None => Ok(Vec::new()),
        }
    }

    fn graph_counters(&self) -> Option<GraphCounters> {
        Some(self.graphs.counters())
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn forward_sampled(
        &mut self,
        batch: &StepBatch<'_>,
        rows: &[DeviceSample],
    ) -> Result<Vec<u32>> {
        self.run_step(batch)?;
        if rows.is_empty() && self.last_logits.is_none() {
            return Ok(Vec::new());
        }
        self.sample_last(rows)
    }
}
