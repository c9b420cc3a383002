//! System packages the build needs: cmake (llama.cpp), libclang (bindgen) and
//! protoc (the gRPC server's .proto).

use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};

fn have(cmd: &str) -> bool {
    // `openssl` answers `version`, not `--version`; the rest take `--version`.
    let arg = if cmd == "openssl" {
        "version"
    } else {
        "--version"
    };
    Command::new(cmd)
        .arg(arg)
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn have_libclang() -> bool {
    if let Ok(p) = std::env::var("LIBCLANG_PATH")
        && Path::new(&p).exists()
    {
        return true;
    }
    ["/usr/lib", "/usr/lib64", "/usr/local/lib"]
        .iter()
        .chain(&["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu"])
        .any(|d| dir_has_libclang(Path::new(d)))
        || std::fs::read_dir("/usr/lib")
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with("llvm-"))
                    .any(|e| dir_has_libclang(&e.path().join("lib")))
            })
            .unwrap_or(false)
}

fn dir_has_libclang(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten().any(|e| {
                let n = e.file_name();
                let n = n.to_string_lossy();
                n.starts_with("libclang") && n.contains(".so") && !n.starts_with("libclang-cpp")
            })
        })
        .unwrap_or(false)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Installs `cmake`, `libclang-dev` and `g++` (required) and `ccache` (optional: it
/// lets the several builds of llama.cpp that different feature sets cause —
/// tests, `check-layers`' per-crate builds, release — share compiled objects)
/// with apt-get when run as root and they are missing; otherwise says exactly
/// what to run. Turns ccache on for llama.cpp's CMake build when present.
pub fn ensure_build_deps() -> Result<()> {
    let mut missing = Vec::new();
    if !have("cmake") {
        missing.push("cmake");
    }
    if !have_libclang() {
        missing.push("libclang-dev");
    }
    // llama.cpp, nvcc's host side and the CUDA kernels' CPU emulator
    // (kernels-turing's `cuda-emu` feature) compile C++.
    if !have("g++") {
        missing.push("g++");
    }
    // The server's build script compiles the .proto with protoc.
    if !have("protoc") && std::env::var_os("PROTOC").is_none() {
        missing.push("protobuf-compiler");
    }
    // The server's TLS test makes its certificates with the openssl CLI.
    if !have("openssl") {
        missing.push("openssl");
    }
    if !have("ccache") && is_root() {
        missing.push("ccache");
    }
    if !missing.is_empty() {
        install(&missing)?;
    }
    enable_ccache();
    Ok(())
}

/// Routes llama.cpp's C/C++ compiles through ccache when it is installed.
/// Different feature sets of our crates (the test build, each crate built alone
/// by `check-layers`, release builds) each rebuild llama.cpp in a new `OUT_DIR`;
/// with ccache the later ones are cache hits. llama-cpp-sys-2 forwards `CMAKE_*`
/// variables to CMake; paths are made relative to the target directory and the
/// working directory is left out of the hash so the differing `OUT_DIR`s match.
pub fn enable_ccache() {
    if !have("ccache") {
        return;
    }
    let target = crate::pytests::target_dir();
    // SAFETY: xtask is single-threaded; the variables are read by child processes.
    unsafe {
        std::env::set_var("CMAKE_C_COMPILER_LAUNCHER", "ccache");
        std::env::set_var("CMAKE_CXX_COMPILER_LAUNCHER", "ccache");
        std::env::set_var("CCACHE_BASEDIR", &target);
        std::env::set_var("CCACHE_NOHASHDIR", "1");
    }
}

fn install(missing: &[&str]) -> Result<()> {
    let list = missing.join(" ");
    if !is_root() {
        bail!(
            "missing system packages: {list}\nrun: sudo apt-get update && sudo apt-get install -y {list}"
        );
    }
    eprintln!("xtask: installing {list} with apt-get");
    crate::run(Command::new("apt-get").args(["update", "-q"]))?;
    crate::run(
        Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "-q"])
            .args(missing),
    )?;
    Ok(())
}
