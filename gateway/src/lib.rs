//! The lorafleet gateway: the tenants' OpenAI-compatible front door, the
//! registry snapshot, adapter-affinity routing to workers, and the admin plane.
//!
//! What only a process needs (flags, listeners, signals, drain) lives with
//! its binary in `src/bin/`; everything it serves lives here.

pub mod admin;
pub mod api;
pub mod audit;
pub mod auth;
pub mod console;
pub mod db;
pub mod flag_error;
#[doc(hidden)]
pub mod fuzzing;
pub mod listener;
pub mod ratelimit;
pub mod registry;
pub mod rollout;
pub mod router;
pub mod upstream;
