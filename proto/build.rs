//! Compiles `proto/vlm/v1/*.proto` with protox (pure Rust, no system `protoc`) and writes the
//! file descriptor set used by gRPC reflection.
use prost::Message;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/vlm/v1/common.proto",
        "proto/vlm/v1/vision.proto",
        "proto/vlm/v1/lm.proto",
        "proto/vlm/v1/gateway.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("vlm_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // Undecodable messages are INVALID_ARGUMENT (src/codec.rs).
        .codec_path("crate::codec::ProstCodec")
        .compile_fds(fds)?;
    Ok(())
}
