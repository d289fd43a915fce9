//! Choosing a worker for a request: the routing policy (`policy.rs`: ring,
//! bounded load, residency affinity, hot replicas; pure and simulated by
//! `benches/routing_sim.rs`) and the fleet it chooses among (`fleet.rs`:
//! discovery, one Watch task per worker, the routable view, in-flight
//! counts).

pub mod fleet;
pub mod policy;

#[cfg(test)]
mod policy_props;

pub use fleet::{Discovery, Fleet, InFlight, Route, Worker, WorkerState};
pub use policy::{Decision, Policy, Reason, Router, Tier, WorkerView};
