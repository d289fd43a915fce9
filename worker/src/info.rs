//! What a worker says about itself: its base model and its sizes, as
//! watch reports and `Info` describe them.

use lorafleet_engine::model::ModelConfig;

/// The served base model, as reports and `Info` describe it.
#[derive(Debug, Clone)]
pub struct BaseModel {
    pub name: String,
    pub base_hash: lorafleet_domain::digest::BaseHash,
    pub architecture: String,
    pub max_model_len: u32,
    pub vocab_size: u32,
    /// `Quantization::label`, or empty for a dense checkpoint.
    pub quantization: String,
    /// Bytes the weights take in the backend's memory.
    pub weights_bytes: u64,
}

/// This worker's sizes, as reports and `Info` describe them.
#[derive(Debug, Clone, Copy)]
pub struct Capacity {
    pub max_loras: u32,
    pub max_lora_rank: u32,
    pub device_slots: u32,
    pub host_slots: u32,
    pub kv_blocks_total: u32,
    pub kv_block_size: u32,
    pub max_waiting: u32,
}

/// Everything the service needs besides the engine.
#[derive(Debug)]
pub struct WorkerInfo {
    pub worker_id: String,
    pub instance_id: String,
    pub base_model: BaseModel,
    pub capacity: Capacity,
    pub backend: String,
    pub device_name: String,
    /// How the backend divided device memory; None on the CPU backend.
    pub memory_plan: Option<lorafleet_engine::backend::cuda::plan::MemoryPlan>,
    pub model_config: ModelConfig,
}

impl WorkerInfo {
    /// What a worker serving `engine` under `worker_id` reports about itself.
    pub fn describe(
        engine: &lorafleet_engine::Engine,
        worker_id: &str,
        model_name: String,
        settings: &lorafleet_engine::EngineSettings,
    ) -> WorkerInfo {
        let config = engine.config().clone();
        WorkerInfo {
            worker_id: worker_id.to_owned(),
            instance_id: format!("{worker_id}-{}", std::process::id()),
            base_model: BaseModel {
                name: model_name,
                base_hash: engine.base_hash().clone(),
                architecture: config.architecture.model_type().into(),
                max_model_len: engine.max_model_len() as u32,
                vocab_size: config.vocab_size as u32,
                quantization: config
                    .quantization
                    .as_ref()
                    .map(|q| q.label())
                    .unwrap_or_default(),
                weights_bytes: engine.weight_bytes(),
            },
            capacity: Capacity {
                max_loras: settings.max_loras as u32,
                max_lora_rank: settings.max_lora_rank as u32,
                device_slots: settings.max_loras as u32,
                host_slots: settings.max_cpu_loras as u32,
                kv_blocks_total: settings.kv_blocks as u32,
                kv_block_size: settings.block_size as u32,
                max_waiting: settings.max_waiting as u32,
            },
            backend: engine.backend_name().into(),
            device_name: engine.device_name(),
            memory_plan: engine.memory_plan(),
            model_config: config,
        }
    }
}
