//! The lorafleet gateway: the tenants' OpenAI-compatible front door, the
//! registry snapshot, adapter-affinity routing to workers, and the admin plane.
//!
//! Binaries stay thin: they parse flags and call into this library.

pub mod admin;
pub mod api;
pub mod audit;
pub mod auth;
pub mod db;
#[doc(hidden)]
pub mod fuzzing;
pub mod listener;
pub mod ratelimit;
pub mod registry;
pub mod router;
pub mod serve;
pub mod upstream;
