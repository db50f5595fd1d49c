//! Compiles `proto/orders.proto` for the `grpc-orders` example and its tests with protox,
//! a protobuf compiler written in Rust, so that building needs no `protoc` installed.
//! Writes the generated code (server and client) and the serialized file descriptor set,
//! which tells the idempotency layer which methods stream. The README and the gRPC module
//! docs show these lines as the build script to copy (a test keeps them in step).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/orders.proto");
    let descriptors = protox::compile(["proto/orders.proto"], ["proto"])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let set = prost::Message::encode_to_vec(&descriptors);
    std::fs::write(out.join("orders_descriptor.bin"), set)?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
