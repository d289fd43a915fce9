//! A setting the gateway cannot start with: the flag, and why (the type
//! both processes share).

pub use lorafleet_domain::flag::{FlagError, ensure};
