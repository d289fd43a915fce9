//! The CUDA kernel source and its NVRTC compilation, specialised to one
//! model's shapes. Compiling needs only the NVRTC library, not a GPU, so a
//! test on any machine with NVRTC proves that every kernel compiles.

use cudarc::nvrtc::{CompileOptions, Ptx};

use super::Dtype;
use crate::error::{EngineError, Result};
use crate::model::ModelConfig;

/// The kernel source; [`KernelShapes::source`] prepends the defines.
pub const SOURCE: &str = include_str!("kernels.cu");

/// The quantized weights' kernels, compiled after [`SOURCE`], whose types
/// and helpers they use.
pub const QUANT_SOURCE: &str = include_str!("quant.cu");

/// Every kernel the backend launches, by its `extern "C"` name.
pub const KERNELS: &[&str] = &[
    "embed",
    "embed_lora",
    "embed_saved",
    "saved_logits",
    "rms_norm",
    "to_wt",
    "add_bias",
    "add_into",
    "silu_mul",
    "gelu_mul",
    "softcap",
    "widen_logits",
    "rope_store",
    "attention",
    "lora_shrink",
    "lora_expand",
    "dora_scales",
    "moe_lora_shrink",
    "moe_lora_expand",
    "head_norm",
    "moe_route",
    "moe_gather",
    "moe_combine",
    "moe_bias",
    "swiglu_clamped",
    "argmax_rows",
    "sample_rows",
    "spin",
    "qmatmul",
    "qdequant",
    "fp8_rows",
    "fp8_scale",
    "quant_inputs",
];

/// The most input features one split-K chunk of the shrink covers. 128
/// gave a step of few adapters more blocks but cost the many-adapter steps
/// more (BENCHMARKS.md, cuda_lora).
pub const MAX_SHRINK_KC: usize = 512;

/// Tokens per tile of the grouped LoRA kernels: each tile is one block.
/// The kernels take four tokens at a time.
pub const LORA_TT: usize = 16;
const _: () = assert!(LORA_TT.is_multiple_of(4));

/// The compile-time shapes of one model's kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelShapes {
    pub dtype: Dtype,
    /// The type the adapter slots hold (the weights' type unless chosen).
    pub slot_dtype: Dtype,
    pub head_dim: usize,
    /// The rank each adapter slot is sized for.
    pub max_rank: usize,
    /// Input features per split-K chunk of the shrink: a multiple of 32.
    pub shrink_kc: usize,
}

impl KernelShapes {
    pub fn for_model(config: &ModelConfig, max_lora_rank: usize, dtype: Dtype) -> KernelShapes {
        KernelShapes {
            dtype,
            slot_dtype: dtype,
            head_dim: config.head_dim,
            max_rank: max_lora_rank.max(1),
            shrink_kc: config.hidden_size.next_multiple_of(32).min(MAX_SHRINK_KC),
        }
    }

    /// Split-K chunks of the shrink for an input of `fan_in` features.
    pub fn splits(&self, fan_in: usize) -> usize {
        fan_in.div_ceil(self.shrink_kc)
    }

    /// The source with this model's defines in front.
    pub fn source(&self) -> String {
        let code = |d: Dtype| match d {
            Dtype::F32 => 0,
            Dtype::Bf16 => 1,
            Dtype::F16 => 2,
        };
        let (wdtype, sdtype) = (code(self.dtype), code(self.slot_dtype));
        format!(
            "#define WDTYPE {wdtype}\n#define SDTYPE {sdtype}\n#define HEAD_DIM {}\n#define MAX_RANK {}\n#define SHRINK_KC {}\n\
             #define LORA_TT {LORA_TT}\n#define PANEL {}\n{SOURCE}\n{QUANT_SOURCE}",
            self.head_dim,
            self.max_rank,
            self.shrink_kc,
            crate::backend::cpu::panels::NR
        )
    }

    fn check(&self) -> Result<()> {
        let bad = |what: String| Err(EngineError::Backend(format!("cuda kernels: {what}")));
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) || self.head_dim > 256 {
            return bad(format!(
                "head_dim {} must be even and at most 256",
                self.head_dim
            ));
        }
        if self.max_rank > 256 {
            return bad(format!("max_lora_rank {} is above 256", self.max_rank));
        }
        if self.shrink_kc == 0 || !self.shrink_kc.is_multiple_of(32) {
            return bad(format!(
                "shrink chunk {} is not a multiple of 32",
                self.shrink_kc
            ));
        }
        Ok(())
    }
}

/// Whether the NVRTC library can be loaded. Checked before any NVRTC call,
/// which would otherwise panic when the library is absent.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the shared library by its known names.
    #[allow(unsafe_code)]
    unsafe {
        cudarc::nvrtc::sys::is_culib_present()
    }
}

/// Compiles the kernels for `arch` (a virtual architecture such as
/// `compute_90`, which the driver finishes for the GPU at load time).
pub fn compile(shapes: &KernelShapes, arch: &'static str) -> Result<Ptx> {
    shapes.check()?;
    if !nvrtc_present() {
        return Err(EngineError::Backend(
            "the NVRTC library (libnvrtc.so) was not found; install the CUDA toolkit's NVRTC or \
             put its directory on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let options = CompileOptions {
        arch: Some(arch),
        // Every fused multiply-add is written out with fmaf, so the others
        // round as the CPU reference rounds.
        fmad: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        use_fast_math: Some(false),
        name: Some("lorafleet_kernels.cu".into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(shapes.source(), options).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => EngineError::Backend(format!(
            "cuda kernels do not compile for {arch}: {}",
            log.to_string_lossy()
        )),
        other => EngineError::Backend(format!("cuda kernels: NVRTC failed: {other}")),
    })
}

/// The PTX virtual architecture for a device's compute capability (8.0 or
/// newer: the bf16 conversions need it).
pub fn arch_for(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 7) => "compute_87",
        (8, 9) => "compute_89",
        (9, 0) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        // A newer device runs PTX of an older architecture.
        (m, _) if m >= 10 => "compute_90",
        _ => "compute_80",
    }
}
