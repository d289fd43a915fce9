//! The engine's sizing flags, shared by `serve` and `generate`, and their
//! validation into errors that name the flag.

use lorafleet_engine::backend::cuda::Dtype;
use lorafleet_engine::{BackendChoice, EngineSettings};

/// Engine sizes and limits; each flag has an environment fallback.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineFlags {
    /// The compute backend: "cpu" (the f32 reference) or "cuda".
    #[arg(long, env = "LORAFLEET_BACKEND", default_value = "cpu")]
    backend: String,
    /// The type base weights are held in on the cuda backend: "bf16",
    /// "f16" or "f32" (default bf16). The cpu backend computes in f32 only.
    #[arg(long, env = "LORAFLEET_DTYPE")]
    dtype: Option<String>,
    /// The CUDA device ordinal.
    #[arg(long, env = "LORAFLEET_CUDA_DEVICE", default_value_t = 0)]
    cuda_device: usize,
    /// The type the cuda backend's adapter slots hold: "f32" (default:
    /// an f32 adapter's exact values, as PEFT computes) or "bf16"/"f16"
    /// (half the bytes a slot load copies).
    #[arg(long, env = "LORAFLEET_LORA_DTYPE")]
    lora_dtype: Option<String>,
    /// Launches every kernel of a decode step one by one on the cuda
    /// backend, instead of replaying the step from a captured CUDA graph
    /// (vLLM's --enforce-eager).
    #[arg(long, env = "LORAFLEET_NO_CUDA_GRAPHS")]
    no_cuda_graphs: bool,
    /// Device slots: the most distinct adapters in one step.
    #[arg(long, env = "LORAFLEET_MAX_LORAS", default_value_t = 4)]
    max_loras: usize,
    /// The largest adapter rank accepted.
    #[arg(long, env = "LORAFLEET_MAX_LORA_RANK", default_value_t = 16)]
    max_lora_rank: usize,
    /// Adapters kept in the host tier.
    #[arg(long, env = "LORAFLEET_MAX_CPU_LORAS", default_value_t = 32)]
    max_cpu_loras: usize,
    /// Bytes of adapter weights kept in the host tier, as well as the
    /// count: an adapter counts its real size (LoRA on every expert of a
    /// Mixture-of-Experts model weighs many attention-only ones). Default:
    /// the count alone.
    #[arg(long, env = "LORAFLEET_MAX_CPU_LORA_BYTES")]
    max_cpu_lora_bytes: Option<usize>,
    /// KV cache blocks.
    #[arg(long, env = "LORAFLEET_KV_BLOCKS", default_value_t = 2048)]
    kv_blocks: usize,
    /// Tokens per KV block.
    #[arg(long, env = "LORAFLEET_BLOCK_SIZE", default_value_t = 16)]
    block_size: usize,
    /// The most sequences in one step.
    #[arg(long, env = "LORAFLEET_MAX_NUM_SEQS", default_value_t = 64)]
    max_num_seqs: usize,
    /// The most tokens in one step; longer prompts are prefilled in chunks.
    #[arg(long, env = "LORAFLEET_MAX_BATCHED_TOKENS", default_value_t = 512)]
    max_batched_tokens: usize,
    /// The most waiting requests before new ones are refused.
    #[arg(long, env = "LORAFLEET_MAX_WAITING", default_value_t = 1024)]
    max_waiting: usize,
    /// The most adapters pinned at once (default: --max-loras minus one, so
    /// one slot always serves unpinned traffic).
    #[arg(long, env = "LORAFLEET_MAX_PINNED")]
    max_pinned: Option<usize>,
    /// Turns off prefix caching: computed KV blocks are then never kept
    /// and shared between requests with the same prefix and weights.
    #[arg(long, env = "LORAFLEET_NO_PREFIX_CACHING")]
    no_prefix_caching: bool,
    /// Admits waiting requests in arrival order instead of by fair shares
    /// between tenants.
    #[arg(long, env = "LORAFLEET_NO_FAIR_ADMISSION")]
    no_fair_admission: bool,
}

impl EngineFlags {
    /// The checked backend choice; an error names the flag.
    pub fn backend(&self) -> anyhow::Result<BackendChoice> {
        let dtype = self
            .dtype
            .as_deref()
            .map(|d| {
                d.parse::<Dtype>()
                    .map_err(|e| anyhow::anyhow!("--dtype: {e}"))
            })
            .transpose()?;
        let lora_dtype = self
            .lora_dtype
            .as_deref()
            .map(|d| {
                d.parse::<Dtype>()
                    .map_err(|e| anyhow::anyhow!("--lora-dtype: {e}"))
            })
            .transpose()?;
        match self.backend.as_str() {
            "cpu" => match dtype {
                _ if lora_dtype.is_some() => anyhow::bail!(
                    "--lora-dtype: the cpu backend holds adapters in f32; it applies to --backend cuda"
                ),
                _ if self.no_cuda_graphs => anyhow::bail!(
                    "--no-cuda-graphs: the cpu backend has no CUDA graphs; it applies to --backend cuda"
                ),
                None | Some(Dtype::F32) => Ok(BackendChoice::Cpu),
                Some(other) => anyhow::bail!(
                    "--dtype: {} is not available on the cpu backend, which computes in f32",
                    other.name()
                ),
            },
            "cuda" => {
                // Before anything else is read, so a machine without a GPU
                // stack says so at once.
                lorafleet_engine::backend::cuda::probe().map_err(|e| match e {
                    lorafleet_engine::EngineError::Backend(why) => {
                        anyhow::anyhow!("--backend cuda: {why}")
                    }
                    other => anyhow::anyhow!("--backend cuda: {other}"),
                })?;
                Ok(BackendChoice::Cuda {
                    device: self.cuda_device,
                    dtype: dtype.unwrap_or(Dtype::Bf16),
                    lora_dtype: lora_dtype.unwrap_or(Dtype::F32),
                    graphs: !self.no_cuda_graphs,
                })
            }
            other => {
                anyhow::bail!("--backend: {other:?} is not available; expected \"cpu\" or \"cuda\"")
            }
        }
    }

    /// The checked settings; an error names the flag, as `--max-loras: …`.
    pub fn settings(&self) -> anyhow::Result<EngineSettings> {
        let settings = EngineSettings {
            max_loras: self.max_loras,
            max_lora_rank: self.max_lora_rank,
            max_cpu_loras: self.max_cpu_loras,
            max_cpu_lora_bytes: self.max_cpu_lora_bytes,
            kv_blocks: self.kv_blocks,
            block_size: self.block_size,
            max_num_seqs: self.max_num_seqs,
            max_batched_tokens: self.max_batched_tokens,
            max_waiting: self.max_waiting,
            max_pinned: self.max_pinned,
            prefix_caching: !self.no_prefix_caching,
            fair_admission: !self.no_fair_admission,
        };
        settings
            .validate()
            .map_err(|e| anyhow::anyhow!("--{}", e.to_string().replace('_', "-")))?;
        Ok(settings)
    }
}
