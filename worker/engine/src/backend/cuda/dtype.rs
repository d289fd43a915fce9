//! The type the base weights are held and multiplied in on the device.

use cudarc::cublas::sys as blas_sys;

/// The type the base weights are held and multiplied in. The LoRA path
/// and every accumulation are f32 whatever this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    /// Full precision: the mode in which the backend is checked against
    /// the CPU reference.
    F32,
    Bf16,
    F16,
}

impl Dtype {
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }

    pub(super) fn bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }

    pub(super) fn cuda_type(self) -> blas_sys::cudaDataType {
        match self {
            Dtype::F32 => blas_sys::cudaDataType::CUDA_R_32F,
            Dtype::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
            Dtype::F16 => blas_sys::cudaDataType::CUDA_R_16F,
        }
    }

    /// Host bytes of `values` in this type (round to nearest even).
    pub(super) fn encode(self, values: &[f32]) -> Vec<u8> {
        match self {
            Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Dtype::Bf16 => values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
            Dtype::F16 => values
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
        }
    }
}

impl std::str::FromStr for Dtype {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "f32" | "float32" => Ok(Dtype::F32),
            "bf16" | "bfloat16" => Ok(Dtype::Bf16),
            "f16" | "float16" => Ok(Dtype::F16),
            other => Err(format!("{other:?} is not one of f32, bf16, f16")),
        }
    }
}
