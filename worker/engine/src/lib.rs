//! The lorafleet multi-LoRA inference engine.
//!
//! It loads one base model, keeps a paged pool of LoRA adapters, and runs
//! mixed-adapter continuous batching behind a backend trait (CPU reference,
//! CUDA). It does no network I/O: the worker crate owns every socket, and
//! the engine sees only requests, tokens and files.

pub use lorafleet_artifact::roots as artifact;
pub mod backend;
pub mod budget;
pub mod constraint;
pub mod engine;
pub mod error;
pub mod eviction;
pub mod kv;
pub mod logprobs;
pub mod lora;
mod masks;
pub mod model;
pub mod penalties;
pub mod pool;
pub mod prompter;
pub mod request;
pub mod sampling;
mod scheduler;
pub mod sequence;
pub mod settings;
mod stop;

pub use engine::{
    Accepted, BackendChoice, Completion, Engine, EngineSettings, EngineStats, Event, FairShare,
    Fairness, Prompt, Request, RunCounters, StepStats,
};
pub use error::{EngineError, Result, context_field};
pub use lorafleet_domain::generation::{
    ChatMessage, ChatPrompt, Choices, Constraint, ConstraintKind, Field, GenerationSpec, Invalid,
    MessagePart, Role, Sampling, ToolCall, ToolFunction, Valid,
};
pub use pool::{AdapterId, AdapterSource, Residency};
pub use prompter::Prompter;
pub use sequence::{Finish, FinishReason, StopReason};
