#![no_main]
//! A safetensors header as the admin plane reads it at registration: the
//! JSON object, then its typed form.

use lorafleet_artifact::safetensors_header::{Header, parse};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(map) = parse(&mut &data[..]) {
        let _ = Header::from_json(&map);
    }
});
