//! The base model: its configuration, weights, tokenizer and chat template.
//! The configuration and the weight files are read by `lorafleet-artifact`,
//! which the gateway shares.

pub mod harmony;
pub mod norms;
mod template_json;
pub mod tokenizer;

pub use lorafleet_artifact::layers;
pub use lorafleet_artifact::model_config as config;
pub use lorafleet_artifact::quantization;
pub use lorafleet_artifact::rope;
pub use lorafleet_artifact::weights;

pub use config::{Architecture, ModelConfig};
pub use weights::{WeightFiles, base_hash};
