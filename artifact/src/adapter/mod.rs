//! PEFT adapters as files: the projections they may target, why one is
//! refused, and `adapter_config.json` with the engine's rules. The engine
//! turns a checked adapter into its host-tier form; the gateway's admin
//! plane checks one at registration with the same rules.

pub mod config;
pub mod tensors;

pub use config::{AdapterConfig, ExpertTarget};

use crate::model_config::ModelConfig;

/// The projections an adapter may target, in a fixed order used for slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Projection {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Projection {
    pub const ALL: [Projection; 7] = [
        Projection::Q,
        Projection::K,
        Projection::V,
        Projection::O,
        Projection::Gate,
        Projection::Up,
        Projection::Down,
    ];

    /// The module's name in Hugging Face checkpoints.
    pub fn module_name(self) -> &'static str {
        match self {
            Projection::Q => "q_proj",
            Projection::K => "k_proj",
            Projection::V => "v_proj",
            Projection::O => "o_proj",
            Projection::Gate => "gate_proj",
            Projection::Up => "up_proj",
            Projection::Down => "down_proj",
        }
    }

    /// The parent module in a decoder layer.
    pub fn parent(self) -> &'static str {
        match self {
            Projection::Q | Projection::K | Projection::V | Projection::O => "self_attn",
            Projection::Gate | Projection::Up | Projection::Down => "mlp",
        }
    }

    pub fn from_module_name(name: &str) -> Option<Projection> {
        Projection::ALL
            .into_iter()
            .find(|p| p.module_name() == name)
    }

    /// (in_features, out_features) of this projection in the base model.
    pub fn shape(self, c: &ModelConfig) -> (usize, usize) {
        match self {
            Projection::Q => (c.hidden_size, c.q_dim()),
            Projection::K | Projection::V => (c.hidden_size, c.kv_dim()),
            Projection::O => (c.q_dim(), c.hidden_size),
            Projection::Gate | Projection::Up => (c.hidden_size, c.intermediate_size),
            Projection::Down => (c.intermediate_size, c.hidden_size),
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// Why an adapter was refused. The variants map to distinct gRPC statuses
/// in the worker, so callers can tell a bad request from a bad file.
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    /// The adapter's rank exceeds what the engine was sized for.
    #[error("adapter {adapter}: `{field}`: rank {rank} is above max_lora_rank {max}")]
    RankTooLarge {
        adapter: String,
        field: String,
        rank: usize,
        max: usize,
    },
    /// The adapter was made for another base model.
    #[error(
        "adapter {adapter}: base hash {declared} does not match the served base model {actual}"
    )]
    BaseHashMismatch {
        adapter: String,
        declared: String,
        actual: String,
    },
    /// A feature PEFT supports that would change the math and the engine does not implement.
    #[error("adapter {adapter}: `{field}`: {reason}")]
    Unsupported {
        adapter: String,
        field: String,
        reason: String,
    },
    /// The files are malformed or do not fit the base model.
    #[error("adapter {adapter}: `{field}`: {reason}")]
    Invalid {
        adapter: String,
        field: String,
        reason: String,
    },
    /// A tensor of the weight file is unexpected, malformed or missing.
    #[error("adapter {adapter}: `{tensor}`: {reason}")]
    InvalidTensor {
        adapter: String,
        tensor: String,
        reason: String,
    },
    /// A file could not be read.
    #[error("adapter {adapter}: {path}: {source}")]
    Io {
        adapter: String,
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl AdapterError {
    /// A copy for each request that waited on the same failed load.
    pub fn duplicate(&self) -> AdapterError {
        match self {
            AdapterError::RankTooLarge {
                adapter,
                field,
                rank,
                max,
            } => AdapterError::RankTooLarge {
                adapter: adapter.clone(),
                field: field.clone(),
                rank: *rank,
                max: *max,
            },
            AdapterError::BaseHashMismatch {
                adapter,
                declared,
                actual,
            } => AdapterError::BaseHashMismatch {
                adapter: adapter.clone(),
                declared: declared.clone(),
                actual: actual.clone(),
            },
            AdapterError::Unsupported {
                adapter,
                field,
                reason,
            } => AdapterError::Unsupported {
                adapter: adapter.clone(),
                field: field.clone(),
                reason: reason.clone(),
            },
            AdapterError::Invalid {
                adapter,
                field,
                reason,
            } => AdapterError::Invalid {
                adapter: adapter.clone(),
                field: field.clone(),
                reason: reason.clone(),
            },
            AdapterError::InvalidTensor {
                adapter,
                tensor,
                reason,
            } => AdapterError::InvalidTensor {
                adapter: adapter.clone(),
                tensor: tensor.clone(),
                reason: reason.clone(),
            },
            AdapterError::Io {
                adapter,
                path,
                source,
            } => AdapterError::Io {
                adapter: adapter.clone(),
                path: path.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
        }
    }
}
