#![no_main]
//! See `lorafleet_gateway::fuzzing::authorization`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    lorafleet_gateway::fuzzing::authorization(data);
});
