#![no_main]
//! A safetensors header as the admin plane reads it at registration.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = lorafleet_artifact::safetensors_header::parse(&mut &data[..]);
});
