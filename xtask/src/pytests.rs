//! The Python tests: the clients users have (`openai`, `grpcio`) against the
//! real server, from a venv this task creates and fills from PyPI.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Where cargo puts its builds (the venv lives beside them, outside the
/// clone, so CI's persistent target directory keeps it too).
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::workspace_root().join("target"))
}

/// The venv's python, created and filled from `tests/python/requirements.txt`
/// when missing or when the requirements changed.
pub fn venv_python() -> Result<PathBuf> {
    let root = crate::workspace_root();
    let reqs = root.join("tests/python/requirements.txt");
    let wanted = std::fs::read_to_string(&reqs)
        .with_context(|| format!("cannot read {}", reqs.display()))?;
    let venv = target_dir().join("pyenv");
    let python = venv.join("bin/python");
    let marker = venv.join("requirements.txt");
    if python.is_file() && std::fs::read_to_string(&marker).ok().as_deref() == Some(&wanted) {
        return Ok(python);
    }
    eprintln!("xtask: creating the test venv {} from PyPI", venv.display());
    let _ = std::fs::remove_dir_all(&venv);
    let host = ["python3", "python"]
        .into_iter()
        .find(|p| {
            Command::new(p)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .context("no python3 on PATH (apt-get install -y python3 python3-venv)")?;
    let made = Command::new(host)
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .with_context(|| format!("cannot run {host} -m venv"))?;
    if !made.success() {
        bail!("{host} -m venv failed (Debian: apt-get install -y python3-venv)");
    }
    crate::run(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "-q",
                "-r",
            ])
            .arg(&reqs),
    )?;
    std::fs::write(&marker, wanted)?;
    Ok(python)
}

/// Runs `tests/python` with pytest against the debug `siliceo` binary that
/// `cargo test --workspace` built.
pub fn run() -> Result<()> {
    let python = venv_python()?;
    let bin = target_dir().join("debug/siliceo");
    if !bin.is_file() {
        bail!(
            "{} is missing: `cargo build -p siliceo` first",
            bin.display()
        );
    }
    crate::run(
        Command::new(python)
            .current_dir(crate::workspace_root())
            .args([
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                // Where the phase's minutes go, in every run's log.
                "--durations=12",
                "tests/python",
            ])
            .env("SILICEO_BIN", bin),
    )
}
