//! Feature `cuda-emu` only: compiles the CUDA kernels' source as C++ with the
//! CPU emulation in `kernels/emu` (see `src/emu.rs`). Nothing is probed: with
//! the feature off this does nothing.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "cuda-emu")]
    emu();
}

#[cfg(feature = "cuda-emu")]
fn emu() {
    use std::path::PathBuf;
    // The workspace's kernels/ (or, for this crate used on its own, wherever
    // SILICEO_KERNELS_SRC points: a copy of that folder).
    println!("cargo:rerun-if-env-changed=SILICEO_KERNELS_SRC");
    let root = std::env::var_os("SILICEO_KERNELS_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"))
                .join("../../kernels")
        });
    if !root.join("paged_attention.cu").exists() || !root.join("emu/emu.cpp").exists() {
        panic!(
            "feature cuda-emu: no kernels/paged_attention.cu and kernels/emu/ in {} \
             (set SILICEO_KERNELS_SRC to the siliceo-infer repository's kernels/ folder)",
            root.display()
        );
    }
    for f in ["paged_attention.cu", "emu/emu.cpp", "emu/cuda_fp16.h"] {
        println!("cargo:rerun-if-changed={}", root.join(f).display());
    }
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        // The emulation is slow enough at -O0 to matter in debug test runs.
        .opt_level(2)
        .include(root.join("emu"))
        .include(&root)
        .flag_if_supported("-Wno-unknown-pragmas")
        // CUDA code reads vector loads through other types (a uint4 as
        // four half2), which nvcc allows and C++'s aliasing rules do not.
        .flag("-fno-strict-aliasing")
        // Each multiply and add rounded on its own, as Rust does (the
        // kernels fuse where they want with explicit intrinsics).
        .flag("-ffp-contract=off")
        .file(root.join("emu/emu.cpp"))
        .compile("siliceo_cuda_emu");
}
