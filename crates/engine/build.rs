//! With the `cuda` feature and `SILICEO_CUDA_LIB` set (by `cargo xtask build
//! --cuda`, whose toolkit comes from PyPI's CUDA wheels): cuBLAS is linked
//! dynamically from that folder. llama-cpp-sys-2 links cuBLAS statically,
//! and the wheels carry only the shared libraries (xtask gives the static
//! names empty archives so that link line still resolves).

fn main() {
    println!("cargo:rerun-if-env-changed=SILICEO_CUDA_LIB");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    if let Some(dir) = std::env::var_os("SILICEO_CUDA_LIB") {
        let dir = std::path::PathBuf::from(dir);
        println!("cargo:rustc-link-search=native={}", dir.display());
        println!("cargo:rustc-link-lib=dylib=cublas");
        println!("cargo:rustc-link-lib=dylib=cublasLt");
    }
}
