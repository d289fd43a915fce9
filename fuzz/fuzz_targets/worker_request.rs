#![no_main]
//! A worker's generate request as it arrives over gRPC: any bytes decoded
//! as the protobuf message, then converted into the engine's request and
//! fairness share, as the worker does before anything reaches the engine.
//! A refusal is an answer; a panic is a bug.

use lorafleet_proto::worker::v1 as pb;
use prost::Message;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(request) = pb::GenerateRequest::decode(data) else {
        return;
    };
    let _ = lorafleet_worker::convert::generate_request(&request);
    let _ = lorafleet_worker::convert::fairness(&request);
    if let Some(d) = &request.adapter {
        let _ = lorafleet_worker::convert::descriptor(d, "adapter");
    }
});
