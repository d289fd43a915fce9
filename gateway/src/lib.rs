//! The lorafleet gateway: the tenants' OpenAI-compatible front door, the
//! registry snapshot, adapter-affinity routing to workers, and the admin plane.
//!
//! `server` checks a process's flags, starts everything it serves and
//! drains it; the binaries in `src/bin/` only parse flags, wait for a
//! signal and call it.

pub mod admin;
pub mod api;
pub mod audit;
pub mod auth;
pub mod concurrency;
pub mod console;
pub mod db;
pub mod evaluation;
pub mod evaluator;
pub mod flag_error;
#[doc(hidden)]
pub mod fuzzing;
pub mod ids;
pub mod listener;
pub mod ratelimit;
pub mod registry;
pub mod rollout;
pub mod router;
pub mod server;
pub mod sources;
pub mod upstream;
pub mod usage;
