//! The lorafleet worker wire contract: package `lorafleet.worker.v1`.
//!
//! Only this crate knows the wire format. The worker and the gateway convert
//! between these generated types and their own domain types at their gRPC
//! boundary, in one place each.

/// `lorafleet.worker.v1`: the `Worker` service and its messages.
pub mod worker {
    /// Version 1 of the worker contract.
    pub mod v1 {
        #![allow(missing_debug_implementations, clippy::all)]
        tonic::include_proto!("lorafleet.worker.v1");
    }
}

/// The standard `grpc.health.v1` service that every worker also serves.
pub mod health {
    pub use tonic_health::ServingStatus;
    pub use tonic_health::pb::*;
    pub use tonic_health::server::{HealthReporter, health_reporter};
}

/// The stable reason codes of worker refusals.
pub mod refusal;

/// gRPC's richer error model (`google.rpc.ErrorInfo`, `BadRequest`): a
/// worker refusal carries its reason code and the field at fault there,
/// so the gateway reads them instead of parsing the message.
pub use tonic_types;

/// The fully qualified gRPC service name of the worker, as used by
/// `grpc.health.v1` to report its status.
pub const WORKER_SERVICE_NAME: &str = "lorafleet.worker.v1.Worker";

/// The encoded `google.protobuf.FileDescriptorSet` of every `.proto` file in
/// this crate, including imports: the source of truth for reflection and for
/// the round-trip tests.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(
    env!("OUT_DIR"),
    "/lorafleet_worker_v1_descriptor.bin"
));

/// A message's size on the wire, in bytes: for the benchmarks and metrics
/// of crates that do not speak protobuf themselves.
pub fn encoded_len(message: &impl prost::Message) -> usize {
    message.encoded_len()
}
