//! Every way the worker refuses a call, as one enum. `convert` maps each
//! variant to its gRPC code, reason code and field, in one exhaustive match;
//! nothing else in the worker builds a refusal status.

use std::time::Duration;

use lorafleet_domain::digest::BaseHash;
use lorafleet_engine::artifact::ArtifactError;
use lorafleet_engine::{AdapterId, EngineError, Field, Invalid, Residency};

/// Why the worker refused a call.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// A field of a generation request is invalid.
    #[error(transparent)]
    Request(#[from] Invalid),
    /// A field of another call is invalid, by its name in that call.
    #[error("{field}: {why}")]
    InvalidField { field: &'static str, why: String },
    /// A field of an adapter descriptor is invalid.
    #[error("{field}: {why}")]
    InvalidDescriptor { field: String, why: String },
    /// The worker is draining.
    #[error("the worker is draining")]
    Draining,
    /// The adapter id is loaded already from an artifact with another digest.
    #[error("adapter.lora_int_id: {id} is already loaded from an artifact with another digest")]
    AdapterIdReused { id: AdapterId },
    /// The descriptor names another base model than this worker's.
    #[error("adapter.base_hash: {asked} does not match this worker's base model {served}")]
    BaseHashMismatch { asked: BaseHash, served: BaseHash },
    /// The descriptor's rank is above this worker's maximum.
    #[error("adapter.rank: {rank} is above max_lora_rank {max}")]
    RankTooLarge { rank: usize, max: usize },
    /// The artifact's rank is above the descriptor's.
    #[error("adapter.rank: the descriptor says {declared} but the artifact has rank {actual}")]
    RankMismatch { declared: usize, actual: usize },
    /// LoadAdapter gave up waiting for the tier.
    #[error(
        "adapter {id} did not reach {target:?} within {waited:?}; every slot may be leased or pinned"
    )]
    LoadTimeout {
        id: AdapterId,
        target: Residency,
        waited: Duration,
    },
    /// The artifact could not be used.
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    /// The engine refused or failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A task of the worker's own failed (a panic or a cancelled blocking
    /// task).
    #[error("{what} failed")]
    TaskFailed { what: &'static str },
}

impl Refusal {
    /// A refusal of a generation request's field.
    pub fn field(field: Field, why: impl std::fmt::Display) -> Refusal {
        Refusal::Request(Invalid::new(field, why.to_string()))
    }

    /// A refusal of another call's field.
    pub fn call_field(field: &'static str, why: impl std::fmt::Display) -> Refusal {
        Refusal::InvalidField {
            field,
            why: why.to_string(),
        }
    }

    /// A refusal of a descriptor field.
    pub fn descriptor(field: impl Into<String>, why: impl std::fmt::Display) -> Refusal {
        Refusal::InvalidDescriptor {
            field: field.into(),
            why: why.to_string(),
        }
    }
}
