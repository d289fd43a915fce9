//! Compiles the `.proto` files with protox (pure Rust), so no system `protoc` is needed.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("proto");
    println!("cargo:rerun-if-changed={}", root.display());

    let worker = root.join("lorafleet/worker/v1/worker.proto");
    let fds = protox::compile([&worker], [&root])?;

    // The encoded descriptor set is kept so that tests can enumerate every
    // message and servers can offer reflection.
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let fds_bytes = prost::Message::encode_to_vec(&fds);
    std::fs::write(out.join("lorafleet_worker_v1_descriptor.bin"), fds_bytes)?;

    // Type names let code name a message (for example in error details)
    // without repeating the package string.
    let mut config = prost_build::Config::new();
    config.enable_type_names();
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds_with_config(fds, config)?;
    Ok(())
}
