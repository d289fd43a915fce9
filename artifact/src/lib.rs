//! The files lorafleet reads from outside, and the rules both the gateway's
//! admin plane and the worker apply to them, in one small crate with no
//! compute or network code:
//!
//! - [`roots`]: adapter artifact URIs resolved inside the artifact roots,
//!   and the artifact digest the registry records and workers verify;
//! - [`adapter`]: `adapter_config.json` with the engine's rules, the
//!   projections an adapter may target, and why one is refused;
//! - [`model_config`]: a base model's `config.json`;
//! - [`rope`]: its rotary embedding and how the frequencies are scaled;
//! - [`layers`]: which layers slide, the MLP's activation, Gemma's norms;
//! - [`weights`]: safetensors files (one or sharded) and the base hash;
//! - [`quantization`]: a quantized base's `quantization_config` and how its
//!   weights dequantize;
//! - [`safetensors_header`]: a safetensors header read without mapping the
//!   data, for checks at registration.

pub mod adapter;
pub mod error;
pub mod json;
pub mod model_config;
pub use model_config::layers;
pub mod quantization;
pub mod roots;
pub mod rope;
pub mod safetensors_header;
pub mod weights;

pub use error::FileError;
