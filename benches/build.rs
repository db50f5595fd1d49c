//! Compiles `proto/bench.proto` (the gRPC benchmark's service) with protox, a protobuf
//! compiler written in Rust, so that building needs no `protoc`: the generated server and
//! client code, and the serialized file descriptor set the idempotency layer is given.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/bench.proto");
    let descriptors = protox::compile(["proto/bench.proto"], ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("bench_descriptor.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
