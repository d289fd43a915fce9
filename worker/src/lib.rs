//! The lorafleet worker: the engine behind an async handle, and the offline
//! batch command. The binary in `main.rs` only parses flags and calls in.

pub mod convert;
pub mod flags;
pub mod generate;
pub mod runtime;
pub mod serve;
pub mod service;
pub mod telemetry;
