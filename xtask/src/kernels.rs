//! `cargo xtask kernels`: every `kernels/*.cu` to PTX (compute_75, JIT-able on
//! Turing, Ampere, Hopper) and cubins (sm_75, sm_80, sm_90), into
//! `kernels/build/` where the `cuda` feature's loader finds them.
//!
//! nvcc comes from `$NVCC`, `PATH`, `/usr/local/cuda/bin`, or — where none is
//! found — from PyPI into `~/.cache/siliceo/cuda-<version>` (the CUDA 13.0
//! wheels: nvcc, nvvm's cicc, the runtime headers with `cuda_fp16.h`, the crt
//! headers and cccl's `nv/target`). gcc must be on PATH (nvcc's host compiler).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The CUDA toolkit wheels (one release, so PTX is ISA 9.0 and loads on any
/// CUDA 13 driver, R580 and newer).
const CUDA_WHEELS: [(&str, &str); 5] = [
    ("nvidia-cuda-nvcc", "13.0.88"),
    ("nvidia-nvvm", "13.0.88"),
    ("nvidia-cuda-runtime", "13.0.96"),
    ("nvidia-cuda-crt", "13.0.88"),
    // `nv/target`, which cuda_fp16.h includes.
    ("nvidia-cuda-cccl", "13.0.85"),
];

/// Architectures: PTX for compute_75 (JIT on newer GPUs) and these cubins.
const CUBINS: [&str; 3] = ["sm_75", "sm_80", "sm_90"];

pub fn kernels_dir() -> PathBuf {
    crate::workspace_root().join("kernels")
}

pub fn build_dir() -> PathBuf {
    kernels_dir().join("build")
}

fn works(nvcc: &Path) -> bool {
    Command::new(nvcc)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Finds nvcc, installing it from PyPI into the cache when there is none.
pub fn nvcc() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("NVCC") {
        let p = PathBuf::from(p);
        if works(&p) {
            return Ok(p);
        }
        bail!("NVCC={} does not run", p.display());
    }
    for p in [
        PathBuf::from("nvcc"),
        PathBuf::from("/usr/local/cuda/bin/nvcc"),
    ] {
        if works(&p) {
            return Ok(p);
        }
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    let root = home
        .join(".cache/siliceo")
        .join(format!("cuda-{}", CUDA_WHEELS[0].1));
    let nvcc = root.join("nvidia/cu13/bin/nvcc");
    // The marker lists the wheels unpacked: a changed list reinstalls.
    let marker = root.join("wheels.txt");
    let want: String = CUDA_WHEELS
        .iter()
        .map(|(p, v)| format!("{p}=={v}\n"))
        .collect();
    if works(&nvcc) && std::fs::read_to_string(&marker).ok().as_deref() == Some(want.as_str()) {
        return Ok(nvcc);
    }
    eprintln!(
        "kernels: no nvcc found; installing CUDA {} from PyPI into {}",
        CUDA_WHEELS[0].1,
        root.display()
    );
    let downloads = root.join("wheels");
    std::fs::create_dir_all(&downloads)?;
    for (package, version) in CUDA_WHEELS {
        let wheel = crate::models::pip_download_wheel(&downloads, package, version)?;
        let file = std::fs::File::open(&wheel)?;
        let mut zip = zip::ZipArchive::new(file)
            .with_context(|| format!("{} is not a wheel", wheel.display()))?;
        zip.extract(&root)
            .with_context(|| format!("cannot unpack {}", wheel.display()))?;
    }
    for dir in ["nvidia/cu13/bin", "nvidia/cu13/nvvm/bin"] {
        for e in std::fs::read_dir(root.join(dir))
            .with_context(|| format!("{dir} missing from the wheels"))?
        {
            let p = e?.path();
            if p.is_file() {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))?;
            }
        }
    }
    std::fs::remove_dir_all(&downloads).ok();
    if !works(&nvcc) {
        bail!(
            "the nvcc installed from PyPI does not run ({})",
            nvcc.display()
        );
    }
    std::fs::write(&marker, want)?;
    Ok(nvcc)
}

/// Compiles every `kernels/*.cu`; returns the files written.
pub fn build() -> Result<Vec<PathBuf>> {
    if !Command::new("gcc")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
    {
        bail!("nvcc needs gcc on PATH as its host compiler (apt-get install -y gcc g++)");
    }
    let nvcc = nvcc()?;
    let out = build_dir();
    std::fs::create_dir_all(&out)?;
    let mut sources: Vec<PathBuf> = std::fs::read_dir(kernels_dir())?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();
    if sources.is_empty() {
        bail!("no .cu files in {}", kernels_dir().display());
    }
    let mut written = Vec::new();
    for src in &sources {
        let stem = src
            .file_stem()
            .expect("a .cu file has a stem")
            .to_string_lossy()
            .to_string();
        let mut jobs: Vec<(String, PathBuf, String)> = vec![(
            "-ptx".into(),
            out.join(format!("{stem}.compute_75.ptx")),
            "compute_75".into(),
        )];
        for sm in CUBINS {
            jobs.push((
                "-cubin".into(),
                out.join(format!("{stem}.{sm}.cubin")),
                sm.to_string(),
            ));
        }
        // One nvcc per target, as many at once as there are cores (each is
        // single-threaded; the decode kernels take most of a minute per target).
        let width = std::thread::available_parallelism().map_or(1, |n| n.get());
        for batch in jobs.chunks(width) {
            let results: Vec<Result<()>> = std::thread::scope(|scope| {
                let handles: Vec<_> = batch
                    .iter()
                    .map(|(kind, dst, arch)| {
                        let nvcc = &nvcc;
                        scope.spawn(move || {
                            eprintln!("kernels: {} → {}", src.display(), dst.display());
                            crate::run(
                                Command::new(nvcc)
                                    .args([
                                        kind.as_str(),
                                        &format!("-arch={arch}"),
                                        "-O3",
                                        "-std=c++17",
                                        "-Werror",
                                        "all-warnings",
                                    ])
                                    .arg(src)
                                    .arg("-o")
                                    .arg(dst),
                            )
                            .with_context(|| {
                                format!("{} does not compile for {arch}", src.display())
                            })
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| bail!("an nvcc thread panicked"))
                    })
                    .collect()
            });
            for r in results {
                r?;
            }
        }
        written.extend(jobs.into_iter().map(|(_, dst, _)| dst));
    }
    Ok(written)
}
