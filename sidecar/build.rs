//! Generates the gRPC client and server from ../proto, the same contract the worker is built from.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A vendored protoc, so building needs nothing beyond cargo.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    // Read at run time: a build script compiled for one checkout may be reused by another that
    // shares the target directory.
    let proto_root = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../proto");
    let proto = proto_root.join("cyllm/inference/v1/inference.proto");
    let descriptor = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("cyllm_descriptor.bin");
    tonic_prost_build::configure()
        .file_descriptor_set_path(&descriptor)
        .compile_protos(&[&proto], &[&proto_root])?;
    println!("cargo:rerun-if-changed={}", proto.display());
    Ok(())
}
