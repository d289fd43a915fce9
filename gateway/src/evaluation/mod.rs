//! Rollouts gated on quality: a candidate adapter version is scored on the
//! route's own evaluation set, beside the stable version, before it takes
//! any traffic.
//!
//! - [`set`]: an evaluation set's file, read into typed items or refused
//!   by line and field;
//! - [`score`]: an item scored from what the model answered, as
//!   lm-evaluation-harness scores it, and the gate the candidate's score
//!   must pass;
//! - [`runner`]: the evaluator. Every gateway replica with an admin plane
//!   runs it; it works only while its replica holds the rollout
//!   controller's lease, sends each item through the fleet as the gateway's
//!   own low-priority traffic ([`crate::api::internal`]), records each
//!   outcome as it goes (a replica that takes over goes on where the last
//!   stopped), and has the admin plane conclude: the first step, or
//!   `rejected`.

pub mod runner;
pub mod score;
pub mod set;
