//! The lorafleet worker: the engine behind an async handle, and the gRPC
//! service over it. The binary (`src/bin/lorafleet-worker/`) holds what
//! only a process needs: its flags, `serve` (listeners, TLS, signals,
//! drain) and the offline `generate` command.

pub mod convert;
pub mod info;
pub mod refusal;
pub mod runtime;
pub mod service;
pub mod telemetry;
