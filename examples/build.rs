//! Compiles `proto/orders.proto` for the `grpc-orders` example and its tests with protox,
//! a protobuf compiler written in Rust, so that building needs no `protoc` installed.
//! Writes the generated code (server and client) and the serialized file descriptor set,
//! which tells the idempotency layer which methods stream.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/orders.proto");
    let descriptors = protox::compile(["proto/orders.proto"], ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("orders_descriptor.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
