#![no_main]
//! See `lorafleet_gateway::fuzzing::audit_cursor`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    lorafleet_gateway::fuzzing::audit_cursor(data);
});
