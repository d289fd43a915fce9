//! How an engine is sized and which backend it runs on.

use crate::error::{EngineError, Result};

/// The engine's sizes and limits. Field names match the worker's flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineSettings {
    /// Device slots: the most distinct adapters in one step.
    pub max_loras: usize,
    /// The largest adapter rank accepted; every slot is sized for it.
    pub max_lora_rank: usize,
    /// Adapters the host tier holds.
    pub max_cpu_loras: usize,
    /// Bytes of adapter weights the host tier holds, if capped: each
    /// adapter counts its real size, so one with LoRA on every expert of a
    /// Mixture-of-Experts model costs what it weighs.
    pub max_cpu_lora_bytes: Option<usize>,
    /// KV cache blocks.
    pub kv_blocks: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// The most sequences in one step.
    pub max_num_seqs: usize,
    /// The most tokens in one step; longer prompts are prefilled in chunks.
    pub max_batched_tokens: usize,
    /// The most requests waiting for admission.
    pub max_waiting: usize,
    /// The most adapters pinned at once; None means `max_loras - 1`, so
    /// one slot always serves unpinned traffic.
    pub max_pinned: Option<usize>,
    /// Whether computed KV blocks are kept and shared between requests
    /// with the same prefix and weights (see [`crate::kv`]).
    pub prefix_caching: bool,
    /// Whether waiting requests are admitted by fair shares between their
    /// fairness keys (tenants) rather than in arrival order.
    pub fair_admission: bool,
    /// How a device slot is chosen for eviction (see [`crate::eviction`]).
    pub eviction: crate::eviction::EvictionPolicy,
    /// One byte budget for the KV cache and the adapter slots together
    /// (see [`crate::budget`]); `kv_blocks` then follows from it (the
    /// budget less one slot, in blocks) and `max_loras` is the most slots.
    /// None: `kv_blocks` and `max_loras` are fixed, each on its own.
    pub memory_budget_bytes: Option<u64>,
}

impl Default for EngineSettings {
    fn default() -> Self {
        EngineSettings {
            max_loras: 4,
            max_lora_rank: 16,
            max_cpu_loras: 32,
            max_cpu_lora_bytes: None,
            kv_blocks: 1024,
            block_size: 16,
            max_num_seqs: 64,
            max_batched_tokens: 512,
            max_waiting: 1024,
            max_pinned: None,
            prefix_caching: true,
            fair_admission: true,
            eviction: crate::eviction::EvictionPolicy::Value,
            memory_budget_bytes: None,
        }
    }
}

impl EngineSettings {
    /// Checks every limit, naming the setting that is wrong.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("max_loras", self.max_loras),
            ("max_lora_rank", self.max_lora_rank),
            ("max_cpu_loras", self.max_cpu_loras),
            ("kv_blocks", self.kv_blocks),
            ("block_size", self.block_size),
            ("max_num_seqs", self.max_num_seqs),
            ("max_batched_tokens", self.max_batched_tokens),
            ("max_waiting", self.max_waiting),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(EngineError::setting(name, "must be at least 1"));
            }
        }
        if self.max_cpu_lora_bytes == Some(0) {
            return Err(EngineError::setting(
                "max_cpu_lora_bytes",
                "must be at least 1 when given",
            ));
        }
        if self.max_cpu_loras < self.max_loras {
            return Err(EngineError::setting(
                "max_cpu_loras",
                format!(
                    "{} must be at least max_loras ({}): the host tier holds every device adapter",
                    self.max_cpu_loras, self.max_loras
                ),
            ));
        }
        if let Some(p) = self.max_pinned
            && p >= self.max_loras
        {
            return Err(EngineError::setting(
                "max_pinned",
                format!(
                    "{p} must be below max_loras ({}): one slot always serves unpinned traffic",
                    self.max_loras
                ),
            ));
        }
        if self.max_lora_rank > 512 {
            return Err(EngineError::setting(
                "max_lora_rank",
                format!("{} is above 512", self.max_lora_rank),
            ));
        }
        Ok(())
    }
}

/// Which backend an engine runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// The exact f32 reference.
    Cpu,
    /// CUDA device `device`, with base weights in `dtype` and adapter
    /// slots in `lora_dtype`; decode steps replay captured CUDA graphs
    /// unless `graphs` is false; kernels launch with programmatic
    /// dependent launch when `pdl` is true (compute 9.0 and newer).
    Cuda {
        device: usize,
        dtype: crate::backend::cuda::Dtype,
        lora_dtype: crate::backend::cuda::Dtype,
        graphs: bool,
        pdl: bool,
    },
}
