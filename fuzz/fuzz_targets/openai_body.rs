#![no_main]
//! See `lorafleet_gateway::fuzzing::openai_body`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    lorafleet_gateway::fuzzing::openai_body(data);
});
