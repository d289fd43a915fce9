#![no_main]
//! See `lorafleet_gateway::fuzzing::eval_set`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    lorafleet_gateway::fuzzing::eval_set(data);
});
