//! PEFT adapters as files: the projections they may target, why one is
//! refused, and `adapter_config.json` with the engine's rules. The engine
//! turns a checked adapter into its host-tier form; the gateway's admin
//! plane checks one at registration with the same rules.

pub mod config;
pub mod saved;
pub mod selection;
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

    /// The projection's rows in the checkpoint of a model of `c`'s
    /// architecture: the tensor's module path under a decoder layer, and
    /// the first row of the projection in it (q, k and v share Phi-3's
    /// `qkv_proj`, gate and up its `gate_up_proj`).
    pub fn stored_in(self, c: &ModelConfig) -> (&'static str, usize) {
        if c.architecture.fused_projections() {
            match self {
                Projection::Q => return ("self_attn.qkv_proj", 0),
                Projection::K => return ("self_attn.qkv_proj", c.q_dim()),
                Projection::V => return ("self_attn.qkv_proj", c.q_dim() + c.kv_dim()),
                Projection::Gate => return ("mlp.gate_up_proj", 0),
                Projection::Up => return ("mlp.gate_up_proj", c.intermediate_size),
                Projection::O | Projection::Down => {}
            }
        }
        match self {
            Projection::Q => ("self_attn.q_proj", 0),
            Projection::K => ("self_attn.k_proj", 0),
            Projection::V => ("self_attn.v_proj", 0),
            Projection::O => ("self_attn.o_proj", 0),
            Projection::Gate => ("mlp.gate_proj", 0),
            Projection::Up => ("mlp.up_proj", 0),
            Projection::Down => ("mlp.down_proj", 0),
        }
    }
}

/// A module an adapter stores one LoRA pair for: one projection, or the
/// projections a checkpoint fuses into one module (Phi-3's `qkv_proj` and
/// `gate_up_proj`), whose B stacks the parts' rows in order and whose A
/// they share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// The module path under a decoder layer, e.g. `self_attn.qkv_proj`.
    pub path: &'static str,
    pub parts: &'static [Projection],
}

impl Target {
    pub const QKV: Target = Target {
        path: "self_attn.qkv_proj",
        parts: &[Projection::Q, Projection::K, Projection::V],
    };
    pub const GATE_UP: Target = Target {
        path: "mlp.gate_up_proj",
        parts: &[Projection::Gate, Projection::Up],
    };

    /// The module's own name, the last part of its path.
    pub fn module_name(self) -> &'static str {
        self.path.rsplit('.').next().unwrap_or(self.path)
    }

    /// The fused module a `target_modules` name stands for.
    pub fn fused_from_name(name: &str) -> Option<Target> {
        [Target::QKV, Target::GATE_UP]
            .into_iter()
            .find(|t| t.module_name() == name)
    }

    /// One projection as its own module.
    pub fn single(p: Projection) -> Target {
        const SINGLE: [&[Projection]; 7] = [
            &[Projection::Q],
            &[Projection::K],
            &[Projection::V],
            &[Projection::O],
            &[Projection::Gate],
            &[Projection::Up],
            &[Projection::Down],
        ];
        const PATHS: [&str; 7] = [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ];
        Target {
            path: PATHS[p.index()],
            parts: SINGLE[p.index()],
        }
    }
}

/// The checkpoint tensors that hold `parts` (projections stacked by rows,
/// in order) of one decoder layer, each as its module path and its row
/// count: one per projection, or one fused tensor for parts a checkpoint
/// fuses. Parts that share a fused tensor must all be asked for together.
pub fn stored_tensors(c: &ModelConfig, parts: &[Projection]) -> Vec<(&'static str, usize)> {
    let mut out: Vec<(&'static str, usize)> = Vec::new();
    for &p in parts {
        let (path, _) = p.stored_in(c);
        let rows = p.shape(c).1;
        match out.last_mut() {
            Some((last, n)) if *last == path => *n += rows,
            _ => out.push((path, rows)),
        }
    }
    out
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
