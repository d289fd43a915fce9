#![no_main]
//! `model.safetensors.index.json`: the shards a sharded model names.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(root) = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(data)
        && let Ok((shards, _)) = lorafleet_artifact::weights::index_shards(
            std::path::Path::new("model.safetensors.index.json"),
            &root,
        )
    {
        // Every shard is a plain file name: nothing escapes the directory.
        for s in shards {
            assert!(!s.is_empty() && !s.contains(['/', '\\']) && s != "." && s != "..");
        }
    }
});
