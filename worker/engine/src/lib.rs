//! The lorafleet multi-LoRA inference engine.
//!
//! It loads one base model, keeps a paged pool of LoRA adapters, and runs
//! mixed-adapter continuous batching behind a backend trait (CPU reference,
//! CUDA). It does no network I/O: the worker crate owns every socket, and
//! the engine sees only requests, tokens and files.

pub mod backend;
pub mod error;
pub mod lora;
pub mod model;

pub use error::{EngineError, Result};
