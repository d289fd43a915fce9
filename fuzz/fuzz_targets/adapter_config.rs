#![no_main]
//! `adapter_config.json` as both the admin plane and the worker check it.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = lorafleet_artifact::adapter::AdapterConfig::from_text("fuzz", text, None);
    }
});
