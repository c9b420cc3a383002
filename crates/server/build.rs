//! Compiles `proto/siliceo/v1/inference.proto` (server and client code, plus
//! the encoded descriptor set the reflection service serves) and
//! `proto/vllm/engine.proto` (SMG's engine protocol, server side). Needs `protoc`
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
        .compile_protos(&[proto], std::slice::from_ref(&root))?;
    let vllm = root.join("vllm/engine.proto");
    println!("cargo:rerun-if-changed={}", vllm.display());
    tonic_prost_build::configure()
        .build_client(false)
        .file_descriptor_set_path(out.join("vllm_engine_descriptor.bin"))
        .compile_protos(&[vllm], &[root])?;
    Ok(())
}
