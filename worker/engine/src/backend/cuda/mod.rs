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
mod dtype;
pub mod kernels;
mod meta;
pub mod plan;
mod sample;
mod slots;
#[doc(hidden)]
pub mod testing;

pub use super::DeviceSample;
pub use dtype::Dtype;
use meta::StepMeta;

use std::ffi::c_void;
use std::path::Path;

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys as blas_sys;
use cudarc::driver::{CudaContext, CudaSlice};

use self::device::{Arg, Device, LoraLaunch, LoraSlice, cuda};
use self::kernels::KernelShapes;
use self::plan::MemoryPlan;
use self::slots::Slots;
use super::{Backend, BackendShape, StepBatch};
use crate::error::{EngineError, Result};
use crate::lora::{HostAdapter, Projection};
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

/// A base linear layer: weights `[out, in]` in the backend's dtype and an
/// optional f32 bias.
struct Linear {
    w: CudaSlice<u8>,
    bias: Option<CudaSlice<f32>>,
    fan_in: usize,
    fan_out: usize,
}

struct Layer {
    input_norm: CudaSlice<f32>,
    post_norm: CudaSlice<f32>,
    /// `[q | k | v]`.
    qkv: Linear,
    o: Linear,
    /// `[gate | up]`.
    gate_up: Linear,
    down: Linear,
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
    slots: Slots,
    /// The logits of the last forward, `[rows, vocab]`, for device sampling.
    last_logits: Option<(CudaSlice<f32>, usize)>,
    plan: MemoryPlan,
    blas: CudaBlas,
    dev: Device,
}

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
        let c = config;
        if c.moe.is_some() || c.qk_norm {
            return Err(EngineError::InvalidModel {
                file: dir.join("config.json"),
                field: "model_type".into(),
                reason: format!(
                    "{} runs on the CPU backend only so far; the CUDA backend has no Mixture-of-Experts or q/k-norm kernels yet",
                    c.architecture.model_type()
                ),
            });
        }
        let dev = Device::open(
            ordinal,
            KernelShapes::for_model(c, shape.max_lora_rank, dtype),
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
        );
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

        let files = WeightFiles::open_model_dir(dir)?;
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
                for &p in projs {
                    let (_, out) = p.shape(c);
                    let name = format!("{prefix}.{}.{}", p.parent(), p.module_name());
                    w.extend(files.f32(&format!("{name}.weight"), &[out, fan_in])?);
                    let has_bias = match p {
                        Projection::Q | Projection::K | Projection::V => c.qkv_bias,
                        Projection::O => c.o_bias,
                        _ => c.mlp_bias,
                    };
                    if has_bias {
                        bias.extend(files.f32(&format!("{name}.bias"), &[out])?);
                    }
                    fan_out += out;
                }
                Ok(Linear {
                    w: up_w(&w)?,
                    bias: if bias.is_empty() {
                        None
                    } else {
                        Some(up_f32(&bias)?)
                    },
                    fan_in,
                    fan_out,
                })
            };
            layers.push(Layer {
                input_norm: up_f32(&files.f32(
                    &format!("{prefix}.input_layernorm.weight"),
                    &[c.hidden_size],
                )?)?,
                post_norm: up_f32(&files.f32(
                    &format!("{prefix}.post_attention_layernorm.weight"),
                    &[c.hidden_size],
                )?)?,
                qkv: fused(&[Projection::Q, Projection::K, Projection::V])?,
                o: fused(&[Projection::O])?,
                gate_up: fused(&[Projection::Gate, Projection::Up])?,
                down: fused(&[Projection::Down])?,
            });
        }
        let norm = up_f32(&files.f32("model.norm.weight", &[c.hidden_size])?)?;
        let lm_head = Linear {
            w: if c.tie_word_embeddings && !files.contains("lm_head.weight") {
                up_w(&embed_host)?
            } else {
                up_w(&files.f32("lm_head.weight", &[c.vocab_size, c.hidden_size])?)?
            },
            bias: None,
            fan_in: c.hidden_size,
            fan_out: c.vocab_size,
        };
        drop(embed_host);

        let kv_len = shape.kv_blocks * shape.block_size * c.kv_dim();
        let mut k_cache = Vec::with_capacity(c.num_layers);
        let mut v_cache = Vec::with_capacity(c.num_layers);
        let kv_bytes = kv_len * dtype.bytes();
        for _ in 0..c.num_layers {
            let bytes = || {
                stream
                    .alloc_zeros::<u8>(kv_bytes)
                    .map_err(cuda("allocating the KV cache"))
            };
            k_cache.push(bytes()?);
            v_cache.push(bytes()?);
        }
        let slots = Slots::new(&dev, c, &shape)?;
        let inv_freq: Vec<f32> = (0..c.head_dim / 2)
            .map(|i| 1.0 / c.rope_theta.powf((2 * i) as f32 / c.head_dim as f32))
            .collect();
        let inv_freq = up_f32(&inv_freq)?;
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
            slots,
            last_logits: None,
            plan,
            blas,
            dev,
        })
    }

    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// `y[n, out] = x[n, in] · Wᵀ (+ bias)`: x in the weights' type, y f32.
    fn linear(&self, lin: &Linear, x: u64, y: u64, n: usize) -> Result<()> {
        let (alpha, beta) = (1f32, 0f32);
        let ty = self.dtype.cuda_type();
        let (m, k) = (lin.fan_out as i32, lin.fan_in as i32);
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
                self.dev.p(&lin.w) as *const c_void,
                ty,
                k,
                x as *const c_void,
                ty,
                k,
                (&beta as *const f32).cast::<c_void>(),
                y as *mut c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                m,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(cuda("cuBLAS GEMM"))?;
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

    /// Adds the LoRA deltas of `projs` (one to three projections sharing the
    /// input `x`, `[n, fan_in]` f32) into their columns of the fused output
    /// `out`.
    fn lora(
        &self,
        layer: usize,
        projs: &[Projection],
        x: u64,
        n: usize,
        out: u64,
        meta: &StepMeta,
    ) -> Result<()> {
        let mut offset = 0;
        let slices = projs
            .iter()
            .map(|p| {
                let key = layer * 7 + p.index();
                let width = p.shape(&self.config).1;
                let slice = LoraSlice {
                    a: self.dev.p(&self.slots.a[key]),
                    b: self.dev.p(&self.slots.b[key]),
                    rank: self.slots.rank_of(&self.dev, key),
                    scale: self.slots.scale_of(&self.dev, key),
                    width,
                    offset,
                };
                offset += width;
                slice
            })
            .collect();
        self.dev.lora(&LoraLaunch {
            x,
            fan_in: projs[0].shape(&self.config).0,
            n,
            out,
            out_stride: offset,
            slices,
            segments: meta.segments,
            tiles: meta.tiles,
            h_part: meta.h_part,
        })
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
        self.slots.write(&self.dev, &self.config, slot, adapter)
    }

    fn clear_slot(&mut self, slot: usize) -> Result<()> {
        if slot >= self.shape.slots {
            return Err(EngineError::Backend(format!("slot {slot} is out of range")));
        }
        self.slots.clear(&self.dev, slot)
    }

    fn forward(&mut self, batch: &StepBatch<'_>) -> Result<Vec<f32>> {
        self.run_step(batch)?;
        match &self.last_logits {
            Some((logits, _)) => self
                .dev
                .stream
                .clone_dtoh(logits)
                .map_err(cuda("running the step")),
            None => Ok(Vec::new()),
        }
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

impl CudaBackend {
    /// Runs one step on the device, leaving the logits of the rows that
    /// want them in `last_logits` (None when no row does).
    fn run_step(&mut self, batch: &StepBatch<'_>) -> Result<()> {
        batch.check(&self.config, self.shape.block_size)?;
        self.last_logits = None;
        let c = self.config.clone();
        let n = batch.tokens.len();
        if n == 0 {
            return Ok(());
        }
        let (d, inter, q_dim, kv_dim) = (c.hidden_size, c.intermediate_size, c.q_dim(), c.kv_dim());
        let qkv_dim = q_dim + 2 * kv_dim;
        let rows: Vec<usize> = batch
            .seqs
            .iter()
            .filter(|s| s.want_logits)
            .map(|s| s.start + s.len - 1)
            .collect();
        self.slots.wait_for(&self.dev, &batch.segments)?;
        let (mut meta, _meta_buf) = StepMeta::upload(self, batch, &rows)?;
        let st = self.dev.stream.clone();
        let alloc = |len: usize| {
            st.alloc_zeros::<f32>(len.max(1))
                .map_err(cuda("allocating step buffers"))
        };
        let hidden = alloc(n * d)?;
        let normed = alloc(n * d)?;
        let qkv = alloc(n * qkv_dim)?;
        let attn = alloc(n * q_dim)?;
        let proj = alloc(n * d)?;
        let gu = alloc(n * 2 * inter)?;
        let act = alloc(n * inter)?;
        let widest = d.max(inter).max(q_dim);
        let splits = self.dev.shapes.splits(widest);
        let h_part = alloc(3 * splits * n * self.slots.max_rank)?;
        // The GEMM inputs in the weights' type; in f32 mode the f32
        // buffers serve directly.
        let cast_buf = if self.dtype == Dtype::F32 {
            None
        } else {
            Some(
                st.alloc_zeros::<u8>(n.max(rows.len()) * widest * self.dtype.bytes())
                    .map_err(cuda("allocating step buffers"))?,
            )
        };
        let cast = cast_buf.as_ref().map(|b| self.dev.p(b));
        let (hidden, normed, qkv, attn, proj, gu, act, h_part) = (
            self.dev.p(&hidden),
            self.dev.p(&normed),
            self.dev.p(&qkv),
            self.dev.p(&attn),
            self.dev.p(&proj),
            self.dev.p(&gu),
            self.dev.p(&act),
            self.dev.p(&h_part),
        );
        meta.h_part = h_part;
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
            ],
        )?;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let window = c.sliding_window.map_or(0, |w| w as i32);
        for (l, layer) in self.layers.iter().enumerate() {
            norm_rows(hidden, 0, &layer.input_norm, normed, n)?;
            self.linear(&layer.qkv, cast.unwrap_or(normed), qkv, n)?;
            self.lora(
                l,
                &[Projection::Q, Projection::K, Projection::V],
                normed,
                n,
                qkv,
                &meta,
            )?;
            self.dev.launch(
                "rope_store",
                (n as u32, 1, 1),
                128,
                &[
                    Arg::Ptr(qkv),
                    Arg::I32(q_dim as i32),
                    Arg::I32(kv_dim as i32),
                    Arg::Ptr(meta.pos),
                    Arg::Ptr(meta.kv_row),
                    Arg::Ptr(self.dev.p(&self.inv_freq)),
                    Arg::Ptr(self.dev.p(&self.k_cache[l])),
                    Arg::Ptr(self.dev.p(&self.v_cache[l])),
                ],
            )?;
            self.dev.launch(
                "attention",
                (n as u32, c.num_heads as u32, 1),
                128,
                &[
                    Arg::Ptr(qkv),
                    Arg::I32(q_dim as i32),
                    Arg::I32(kv_dim as i32),
                    Arg::Ptr(self.dev.p(&self.k_cache[l])),
                    Arg::Ptr(self.dev.p(&self.v_cache[l])),
                    Arg::Ptr(meta.pos),
                    Arg::Ptr(meta.tok_seq),
                    Arg::Ptr(meta.bt_off),
                    Arg::Ptr(meta.block_tables),
                    Arg::I32(self.shape.block_size as i32),
                    Arg::I32(window),
                    Arg::F32(scale),
                    Arg::Ptr(attn),
                ],
            )?;
            let x = gemm_input(attn, n * q_dim)?;
            self.linear(&layer.o, x, proj, n)?;
            self.lora(l, &[Projection::O], attn, n, proj, &meta)?;
            add(hidden, proj, n * d)?;
            norm_rows(hidden, 0, &layer.post_norm, normed, n)?;
            self.linear(&layer.gate_up, cast.unwrap_or(normed), gu, n)?;
            self.lora(l, &[Projection::Gate, Projection::Up], normed, n, gu, &meta)?;
            self.dev.launch(
                "silu_mul",
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
            self.linear(&layer.down, cast.unwrap_or(act), proj, n)?;
            self.lora(l, &[Projection::Down], act, n, proj, &meta)?;
            add(hidden, proj, n * d)?;
        }
        if rows.is_empty() {
            st.synchronize().map_err(cuda("running the step"))?;
            return Ok(());
        }
        norm_rows(hidden, meta.rows, &self.norm, normed, rows.len())?;
        let logits = alloc(rows.len() * c.vocab_size)?;
        self.linear(
            &self.lm_head,
            cast.unwrap_or(normed),
            self.dev.p(&logits),
            rows.len(),
        )?;
        self.last_logits = Some((logits, rows.len()));
        Ok(())
    }
}
