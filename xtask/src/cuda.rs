//! `cargo xtask build --cuda [--arch 75,86]`: the `siliceo` and
//! `siliceo-bench` binaries with llama.cpp's CUDA backend, built against CUDA 13 from
//! PyPI's wheels (nvcc, the runtime, cuBLAS, CCCL) on a machine with no
//! toolkit and no GPU.
//!
//! The wheels are not laid out as a toolkit, so this makes them one (under
//! `nvidia/cu13`): `lib64` → `lib`, the unversioned `.so` names CMake's
//! FindCUDAToolkit looks for, and empty archives for the static cuBLAS and
//! culibos names llama-cpp-sys-2's build script links (the wheels have only
//! the shared cuBLAS, which siliceo-engine's build script links instead).
//! The build is portable x86-64 unless `--native` (it is carried to the GPU
//! machine). It uses `cuda-no-vmm` (no driver library at link time: the wheels
//! have no `libcuda` stub). CUDA's runtime is linked statically; cuBLAS is
//! dynamic (`libcublas.so.13`, `libcublasLt.so.13`): the GPU machine's CUDA
//! 13 provides them.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// cuBLAS for CUDA 13.0 (the shared libraries and headers; ~420 MB).
const CUBLAS: (&str, &str) = ("nvidia-cublas", "13.0.2.14");

/// Consumer Turing and Ampere cards, plus PTX that newer GPUs JIT.
pub const DEFAULT_ARCHS: &str = "75,86";

/// `--arch 75,86,89,90` as CMake's CUDA_ARCHITECTURES: each a real cubin, and
/// PTX of the newest for GPUs not named.
pub fn cmake_archs(list: &str) -> Result<String> {
    let mut archs: Vec<u32> = Vec::new();
    for a in list.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        let n: u32 = a
            .trim_start_matches("sm_")
            .parse()
            .with_context(|| format!("--arch: `{a}` is not an architecture like 75 or sm_86"))?;
        if n < 75 {
            bail!("--arch {n}: siliceo's kernels need sm_75 (Turing) or newer");
        }
        archs.push(n);
    }
    archs.sort_unstable();
    archs.dedup();
    let Some(&newest) = archs.last() else {
        bail!("--arch needs at least one architecture");
    };
    let mut out: Vec<String> = archs.iter().map(|a| format!("{a}-real")).collect();
    out.push(format!("{newest}-virtual"));
    Ok(out.join(";"))
}

/// The toolkit folder (`…/nvidia/cu13`), installed and laid out.
pub fn toolkit() -> Result<PathBuf> {
    let root = crate::kernels::install_wheels(&crate::kernels::CUDA_WHEELS, &[CUBLAS])?;
    let cu = root.join("nvidia/cu13");
    let lib = cu.join("lib");
    let link = |target: &str, at: &Path| -> Result<()> {
        if at.symlink_metadata().is_err() {
            std::os::unix::fs::symlink(target, at)
                .with_context(|| format!("cannot link {}", at.display()))?;
        }
        Ok(())
    };
    link("lib", &cu.join("lib64"))?;
    for so in ["cudart", "cublas", "cublasLt"] {
        let versioned = format!("lib{so}.so.13");
        if !lib.join(&versioned).is_file() {
            bail!(
                "{} is missing from the CUDA wheels",
                lib.join(versioned).display()
            );
        }
        link(&versioned, &lib.join(format!("lib{so}.so")))?;
    }
    for name in ["cublas_static", "cublasLt_static", "culibos"] {
        let a = lib.join(format!("lib{name}.a"));
        if !a.is_file() {
            // An empty ar archive is just its magic.
            std::fs::write(&a, b"!<arch>\n")?;
        }
    }
    Ok(cu)
}

/// Builds `siliceo` with CUDA; returns the binary's path.
pub fn build(args: &[String]) -> Result<PathBuf> {
    let mut archs = DEFAULT_ARCHS.to_string();
    let mut native = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--cuda" => {}
            "--native" => native = true,
            "--arch" => {
                archs = it
                    .next()
                    .context("--arch needs a list, e.g. 75,86,89")?
                    .clone()
            }
            other => bail!(
                "build: unknown argument `{other}` (build --cuda [--arch 75,86,89,90] [--native])"
            ),
        }
    }
    if !args.iter().any(|a| a == "--cuda") {
        bail!(
            "build: only `build --cuda` is a task (a CPU build is plain `cargo build --release`)"
        );
    }
    let cmake = cmake_archs(&archs)?;
    crate::deps::ensure_build_deps()?;
    crate::deps::enable_ccache();
    let cu = toolkit()?;
    // Its own target directory: the CPU build beside it stays as it is.
    let target = crate::pytests::target_dir().join(if native { "cuda-native" } else { "cuda" });
    eprintln!(
        "build: siliceo with llama.cpp's CUDA backend for {cmake}, CUDA 13 from {} into {}.\n\
         build: nvcc compiles about 150 files per architecture: on 2 cores that is about 25 \
         minutes for one, more for each added (cargo's progress below).",
        cu.display(),
        target.display()
    );
    let mut cmd = crate::cargo();
    if !native {
        // Portable x86-64 (llama.cpp's GGML_NATIVE=OFF: AVX2): the binary
        // is carried to a GPU machine whose CPU is not this one. (Native
        // would also make ggml-cuda ask for the architecture of a GPU here.)
        cmd.env("CARGO_ENCODED_RUSTFLAGS", "");
    }
    crate::run(
        cmd
            // The server and the benchmark binary, on one llama.cpp build.
            .args([
                "build",
                "--release",
                "-p",
                "siliceo",
                "-p",
                "siliceo-benches",
                "--features",
                "siliceo-engine/cuda-no-vmm",
            ])
            .env("CARGO_TARGET_DIR", &target)
            .env("CUDAToolkit_ROOT", &cu)
            .env("CMAKE_CUDA_COMPILER", cu.join("bin/nvcc"))
            .env("CMAKE_CUDA_ARCHITECTURES", &cmake)
            .env("CUDA_LIBRARY_PATH", &cu)
            .env("SILICEO_CUDA_LIB", cu.join("lib")),
    )?;
    let bin = target.join("release/siliceo");
    println!("build: {}", bin.display());
    println!("build: {}", target.join("release/siliceo-bench").display());
    // What it needs at run time: the GPU machine's CUDA 13 has cuBLAS.
    let out = std::process::Command::new("readelf")
        .args(["-d"])
        .arg(&bin)
        .output()
        .context("cannot run readelf")?;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if line.contains("(NEEDED)") {
            println!(
                "build: links {}",
                line.split('[').nth(1).unwrap_or(line).trim_end_matches(']')
            );
        }
    }
    Ok(bin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures_become_cubins_plus_ptx_of_the_newest() {
        assert_eq!(cmake_archs("75,86").unwrap(), "75-real;86-real;86-virtual");
        assert_eq!(
            cmake_archs("sm_90, 75,90").unwrap(),
            "75-real;90-real;90-virtual"
        );
        assert!(cmake_archs("61").is_err());
        assert!(cmake_archs("").is_err());
        assert!(cmake_archs("ampere").is_err());
    }
}
