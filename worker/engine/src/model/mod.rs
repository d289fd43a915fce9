//! The base model: its configuration, weights, tokenizer and chat template.

pub mod config;
pub mod tokenizer;
pub mod weights;

pub use config::{Architecture, ModelConfig};
pub use weights::{WeightFiles, base_hash};
