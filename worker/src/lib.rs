//! The lorafleet worker: the engine behind an async handle, the gRPC
//! service over it, and `server`, the process as a library (flags checked
//! into a config, listeners, TLS, start, drain). The binary
//! (`src/bin/lorafleet-worker/`) parses flags, waits for a signal, and runs
//! the offline `generate` command.

pub mod convert;
pub mod info;
pub mod refusal;
pub mod runtime;
pub mod server;
pub mod service;
pub mod telemetry;
