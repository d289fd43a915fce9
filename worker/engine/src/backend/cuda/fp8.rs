//! FP8 GEMMs through cuBLASLt, for FP8 checkpoints that quantize their
//! activations too (W8A8, compute 8.9 and newer): each token's activations
//! are cast to e4m3 with a scale of its own (`fp8_rows`, max|x| / 448, as
//! vLLM's dynamic per-token scheme), cuBLASLt multiplies the codes with
//! f32 accumulation, and `fp8_scale` multiplies each product by its token's
//! scale and its output row's weight scale (per tensor or per channel).
//! The A/B scale pointers stay unset (1).
//!
//! Layout: row-major `y[n, m] = xq[n, k] · W[m, k]ᵀ` is column-major
//! `D[m, n] = Wᵀ[m, k] · xq[k, n]` with A = W stored `[k, m]` and
//! transposed: the "TN" form FP8 GEMMs require.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::CudaSlice;

use super::device::{Device, cuda};
use crate::error::{EngineError, Result};

/// cuBLASLt's workspace (its own recommendation on Hopper).
const WORKSPACE: usize = 32 << 20;

/// Whether cuBLASLt can be loaded.
pub fn present() -> bool {
    // SAFETY: only tries to open the shared library by its known names.
    unsafe { lt_sys::is_culib_present() }
}

/// Whether FP8 GEMMs of `m` outputs over `k` inputs can run: cuBLASLt
/// wants both a multiple of 16.
pub fn shape_fits(m: usize, k: usize) -> bool {
    m.is_multiple_of(16) && k.is_multiple_of(16) && m > 0 && k > 0
}

type Algo = lt_sys::cublasLtMatmulAlgo_t;

/// A cuBLASLt handle, its workspace and the algorithm chosen per shape.
pub(super) struct Fp8Gemm {
    handle: lt_sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    algos: Mutex<HashMap<(usize, usize, usize), Algo>>,
}

// SAFETY: the handle is used from one thread at a time (the backend is
// used through &mut or from its one stream's owner), as cuBLASLt allows.
unsafe impl Send for Fp8Gemm {}
unsafe impl Sync for Fp8Gemm {}

/// The descriptors of one GEMM, destroyed when dropped.
struct Descs {
    desc: lt_sys::cublasLtMatmulDesc_t,
    layouts: Vec<lt_sys::cublasLtMatrixLayout_t>,
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: each was created once and is destroyed once.
        unsafe {
            for &l in &self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

fn lt_err(what: &'static str) -> impl Fn(lt::CublasError) -> EngineError {
    move |e| EngineError::Backend(format!("cuda: cuBLASLt {what}: {e:?}"))
}

impl Fp8Gemm {
    pub fn new(dev: &Device) -> Result<Fp8Gemm> {
        if !present() {
            return Err(EngineError::Backend(
                "cuda: FP8 GEMMs need cuBLASLt (libcublasLt.so), which was not found".into(),
            ));
        }
        let handle = lt::create_handle().map_err(lt_err("creating a handle"))?;
        let workspace = dev
            .stream
            .alloc_zeros::<u8>(WORKSPACE)
            .map_err(cuda("allocating the cuBLASLt workspace"))?;
        Ok(Fp8Gemm {
            handle,
            workspace,
            algos: Mutex::new(HashMap::new()),
        })
    }

    /// The matmul and layout descriptors of `[m, k] x [k, n]` in FP8 with
    /// an f32 result `ldd` apart.
    fn descs(m: usize, n: usize, k: usize, ldd: usize) -> Result<Descs> {
        let desc = lt::create_matmul_desc(
            lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lt_sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(lt_err("creating a matmul descriptor"))?;
        let mut d = Descs {
            desc,
            layouts: Vec::with_capacity(3),
        };
        let (t, nt) = (1i32, 0i32);
        for (attr, v) in [
            (
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &t,
            ),
            (
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                &nt,
            ),
        ] {
            // SAFETY: the descriptor is live; the value is an i32 as the
            // attribute's type (cublasOperation_t) is.
            unsafe {
                lt::set_matmul_desc_attribute(
                    d.desc,
                    attr,
                    (v as *const i32).cast::<c_void>(),
                    size_of::<i32>(),
                )
            }
            .map_err(lt_err("setting a transpose"))?;
        }
        let e4m3 = lt_sys::cudaDataType::CUDA_R_8F_E4M3;
        for (ty, rows, cols, ld) in [
            (e4m3, k, m, k),
            (e4m3, k, n, k),
            (lt_sys::cudaDataType::CUDA_R_32F, m, n, ldd),
        ] {
            let l = lt::create_matrix_layout(ty, rows as u64, cols as u64, ld as i64)
                .map_err(lt_err("creating a layout"))?;
            d.layouts.push(l);
        }
        Ok(d)
    }

    fn algo(&self, d: &Descs, key: (usize, usize, usize)) -> Result<Algo> {
        let mut algos = self.algos.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = algos.get(&key) {
            return Ok(*a);
        }
        let pref = lt::create_matmul_pref().map_err(lt_err("creating a preference"))?;
        let size = WORKSPACE;
        // SAFETY: every descriptor is live; the preference is destroyed
        // once, below.
        let found = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&size as *const usize).cast::<c_void>(),
                size_of::<usize>(),
            )
            .and_then(|()| {
                lt::get_matmul_algo_heuristic(
                    self.handle,
                    d.desc,
                    d.layouts[0],
                    d.layouts[1],
                    d.layouts[2],
                    d.layouts[2],
                    pref,
                )
            })
        };
        // SAFETY: created above, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        let algo = found
            .map_err(|e| {
                EngineError::Backend(format!(
                    "cuda: cuBLASLt has no FP8 GEMM for {} x {} x {}: {e:?}",
                    key.0, key.1, key.2
                ))
            })?
            .algo;
        algos.insert(key, algo);
        Ok(algo)
    }

    /// Whether cuBLASLt has an algorithm for these shapes (asked at load,
    /// for one token and for a full step).
    pub fn supports(&self, m: usize, k: usize, max_tokens: usize) -> bool {
        [1, max_tokens.max(1)].iter().all(|&n| {
            Self::descs(m, n, k, m)
                .and_then(|d| self.algo(&d, (m, n, k)))
                .is_ok()
        })
    }

    /// `y[n, m] = xq[n, k] · w[m, k]ᵀ` (both e4m3 on the device, y f32
    /// with rows `ldy` apart), unscaled.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        dev: &Device,
        w: u64,
        xq: u64,
        y: u64,
        ldy: usize,
        (m, n, k): (usize, usize, usize),
    ) -> Result<()> {
        let d = Self::descs(m, n, k, ldy)?;
        let algo = self.algo(&d, (m, n, k))?;
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: the pointers are live device buffers of the stated
        // shapes on the backend's stream; the workspace is ours and used
        // only on that stream.
        unsafe {
            lt::matmul(
                self.handle,
                d.desc,
                (&alpha as *const f32).cast::<c_void>(),
                (&beta as *const f32).cast::<c_void>(),
                w as *const c_void,
                d.layouts[0],
                xq as *const c_void,
                d.layouts[1],
                y as *const c_void,
                d.layouts[2],
                y as *mut c_void,
                d.layouts[2],
                &algo,
                dev.p(&self.workspace) as *mut c_void,
                WORKSPACE,
                dev.stream.cu_stream() as lt_sys::cudaStream_t,
            )
        }
        .map_err(lt_err("FP8 GEMM"))
    }
}

impl Drop for Fp8Gemm {
    fn drop(&mut self) {
        // SAFETY: created once in new, destroyed once here.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}
