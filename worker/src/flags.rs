//! The engine's sizing flags, shared by `serve` and `generate`, and their
//! validation into errors that name the flag.

use lorafleet_engine::EngineSettings;

/// Engine sizes and limits; each flag has an environment fallback.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineFlags {
    /// Device slots: the most distinct adapters in one step.
    #[arg(long, env = "LORAFLEET_MAX_LORAS", default_value_t = 4)]
    max_loras: usize,
    /// The largest adapter rank accepted.
    #[arg(long, env = "LORAFLEET_MAX_LORA_RANK", default_value_t = 16)]
    max_lora_rank: usize,
    /// Adapters kept in the host tier.
    #[arg(long, env = "LORAFLEET_MAX_CPU_LORAS", default_value_t = 32)]
    max_cpu_loras: usize,
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
}

impl EngineFlags {
    /// The checked settings; an error names the flag, as `--max-loras: …`.
    pub fn settings(&self) -> anyhow::Result<EngineSettings> {
        let settings = EngineSettings {
            max_loras: self.max_loras,
            max_lora_rank: self.max_lora_rank,
            max_cpu_loras: self.max_cpu_loras,
            kv_blocks: self.kv_blocks,
            block_size: self.block_size,
            max_num_seqs: self.max_num_seqs,
            max_batched_tokens: self.max_batched_tokens,
            max_waiting: self.max_waiting,
        };
        settings
            .validate()
            .map_err(|e| anyhow::anyhow!("--{}", e.to_string().replace('_', "-")))?;
        Ok(settings)
    }
}
