//! Rollouts gated on quality: a candidate adapter version is scored on the
//! route's own evaluation set, beside the stable version, before it takes
//! any traffic.
//!
//! - [`set`]: an evaluation set's file, read into typed items or refused
//!   by line and field;
//! - [`score`]: an item scored from what the model answered, as
//!   lm-evaluation-harness scores it, and the gate the candidate's score
//!   must pass;
//!
//! Pure: it depends on no other gateway module. The admin plane stores
//! sets and concludes with [`score`]; the evaluator (`evaluator.rs`) sends the items
//! through the fleet.

pub mod score;
pub mod set;
