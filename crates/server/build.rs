//! Compiles `proto/siliceo/v1/inference.proto` (server and client code, plus
//! the encoded descriptor set the reflection service serves). Needs `protoc`
//! on PATH or in `PROTOC` (`cargo xtask` installs `protobuf-compiler`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read at run time, not baked in with env!(): a target directory shared by
    // two checkouts (CI's persistent cache) may reuse this compiled script.
    let manifest = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let root = manifest.join("../../proto");
    let proto = root.join("siliceo/v1/inference.proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("siliceo_v1_descriptor.bin"))
        .compile_protos(&[proto], &[root])?;
    Ok(())
}
