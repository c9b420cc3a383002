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
pub const CUDA_WHEELS: [(&str, &str); 5] = [
    ("nvidia-cuda-nvcc", "13.0.88"),
    ("nvidia-nvvm", "13.0.88"),
    ("nvidia-cuda-runtime", "13.0.96"),
    ("nvidia-cuda-crt", "13.0.88"),
    // `nv/target`, which cuda_fp16.h includes.
    ("nvidia-cuda-cccl", "13.0.85"),
];

/// Architectures: PTX for compute_75 (JIT on newer GPUs) and these cubins.
const CUBINS: [&str; 3] = ["sm_75", "sm_80", "sm_90"];

/// The most local memory (stack frame, spill stores) a kernel may use on any
/// target. ptxas spills a word or two now and then to reach an occupancy step
/// (4 bytes in a few decode kernels at 64 registers); an array indexed at run
/// time lands in local memory at 128 bytes and more (the first decode
/// kernel's `acc[G][D/32]`: 128–192 bytes per thread), and every access to it
/// goes through L1 — that is what this catches, on machines with no GPU.
const LOCAL_BYTES_BUDGET: u32 = 16;

/// What ptxas reports for one function (`-Xptxas -v`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Resources {
    pub function: String,
    pub registers: u32,
    pub stack_bytes: u32,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
}

/// Reads ptxas's `-v` report: a "Function properties for NAME" line, then
/// "N bytes stack frame, N bytes spill stores, N bytes spill loads", then
/// (for entry functions) "Used N registers, …".
pub fn parse_ptxas(report: &str) -> Vec<Resources> {
    let number_before = |line: &str, what: &str| -> Option<u32> {
        let at = line.find(what)?;
        line[..at]
            .split([' ', ','])
            .rev()
            .find(|w| !w.is_empty())?
            .parse()
            .ok()
    };
    let mut out: Vec<Resources> = Vec::new();
    for line in report.lines() {
        if let Some(name) = line.split("Function properties for ").nth(1) {
            out.push(Resources {
                function: name.trim().to_string(),
                ..Resources::default()
            });
        } else if let Some(r) = out.last_mut() {
            if line.contains("bytes stack frame") {
                r.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
                r.spill_store_bytes = number_before(line, "bytes spill stores").unwrap_or(0);
                r.spill_load_bytes = number_before(line, "bytes spill loads").unwrap_or(0);
            } else if line.contains("Used ") && r.registers == 0 {
                r.registers = number_before(line, "registers").unwrap_or(0);
            }
        }
    }
    out
}

/// CTAs of `threads` that fit on one SM by registers alone (65,536 per SM on
/// every target; allocated per warp in units of 256).
pub fn ctas_by_registers(registers: u32, threads: u32) -> u32 {
    let per_warp = (registers.max(1) * 32).div_ceil(256) * 256;
    let warps = 65_536 / per_warp;
    warps / threads.div_ceil(32)
}

/// The functions over [`LOCAL_BYTES_BUDGET`] of local memory.
pub fn over_budget(resources: &[Resources]) -> Vec<&Resources> {
    resources
        .iter()
        .filter(|r| r.stack_bytes.max(r.spill_store_bytes) > LOCAL_BYTES_BUDGET)
        .collect()
}

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
    let root = install_wheels(&CUDA_WHEELS, &[])?;
    let nvcc = root.join("nvidia/cu13/bin/nvcc");
    if !works(&nvcc) {
        bail!(
            "the nvcc installed from PyPI does not run ({})",
            nvcc.display()
        );
    }
    Ok(nvcc)
}

/// Unpacks the CUDA wheels `base` and `extra` (e.g. cuBLAS) from PyPI into
/// `~/.cache/siliceo/cuda-<nvcc version>` unless already there; returns that
/// folder (the toolkit is under `nvidia/cu13`).
pub fn install_wheels(base: &[(&str, &str)], extra: &[(&str, &str)]) -> Result<PathBuf> {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    let root = home
        .join(".cache/siliceo")
        .join(format!("cuda-{}", base[0].1));
    let wheels: Vec<&(&str, &str)> = base.iter().chain(extra).collect();
    let installed = std::fs::read_dir(&root)
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    e.file_name()
                        .to_str()?
                        .strip_suffix(".installed")
                        .map(String::from)
                })
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    for (package, version) in wheels {
        // A marker per wheel: adding cuBLAS later does not reinstall the rest.
        let marker = format!("{package}=={version}");
        if installed.contains(&marker) {
            continue;
        }
        eprintln!(
            "cuda: installing {marker} from PyPI into {}",
            root.display()
        );
        let downloads = root.join("wheels");
        std::fs::create_dir_all(&downloads)?;
        let wheel = crate::models::pip_download_wheel(&downloads, package, version)?;
        let file = std::fs::File::open(&wheel)?;
        let mut zip = zip::ZipArchive::new(file)
            .with_context(|| format!("{} is not a wheel", wheel.display()))?;
        zip.extract(&root)
            .with_context(|| format!("cannot unpack {}", wheel.display()))?;
        std::fs::remove_dir_all(&downloads).ok();
        for dir in ["nvidia/cu13/bin", "nvidia/cu13/nvvm/bin"] {
            for e in std::fs::read_dir(root.join(dir)).into_iter().flatten() {
                let p = e?.path();
                if p.is_file() {
                    use std::os::unix::fs::PermissionsExt;
                    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))?;
                }
            }
        }
        std::fs::write(root.join(format!("{marker}.installed")), "")?;
    }
    Ok(root)
}

/// GPUs without a cubin of their own load the compute_75 PTX, which the driver
/// compiles with its ptxas: Ampere (sm_86: RTX 30), Ada (sm_89: RTX 40),
/// Hopper (sm_90, also has a cubin) and consumer Blackwell (sm_120: RTX 50).
/// `cargo xtask kernels` runs that ptxas step on the PTX for each, so a PTX
/// that would not load there fails here, and their resources are checked too.
const JIT_TARGETS: [&str; 4] = ["sm_86", "sm_89", "sm_90", "sm_120"];

/// ptxas beside `nvcc` (the toolkit's own), else the one on PATH.
fn ptxas(nvcc: &Path) -> PathBuf {
    nvcc.parent()
        .map(|d| d.join("ptxas"))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("ptxas"))
}

/// Runs `jobs` (a label and a command each), as many at once as there are
/// cores (nvcc and ptxas are single-threaded; the decode kernels take most of
/// a minute per target). Returns each job's label and stderr (ptxas's report).
fn run_parallel(jobs: Vec<(String, Command)>) -> Result<Vec<(String, String)>> {
    let width = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut done = Vec::new();
    let mut jobs = jobs.into_iter().peekable();
    while jobs.peek().is_some() {
        let batch: Vec<(String, Command)> = jobs.by_ref().take(width).collect();
        let results: Vec<Result<(String, String)>> = std::thread::scope(|scope| {
            let handles: Vec<_> = batch
                .into_iter()
                .map(|(label, mut cmd)| {
                    scope.spawn(move || -> Result<(String, String)> {
                        let shown = format!("{cmd:?}");
                        let o = cmd
                            .output()
                            .with_context(|| format!("cannot start {shown}"))?;
                        let report = String::from_utf8_lossy(&o.stderr).to_string();
                        if !o.status.success() {
                            eprint!("{report}");
                            bail!("{label} failed: {shown}");
                        }
                        Ok((label, report))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| bail!("a compiler thread panicked"))
                })
                .collect()
        });
        for r in results {
            done.push(r?);
        }
    }
    Ok(done)
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
    let ptxas = ptxas(&nvcc);
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
        let ptx = out.join(format!("{stem}.compute_75.ptx"));
        let mut targets = vec![("-ptx", ptx.clone(), "compute_75".to_string())];
        for sm in CUBINS {
            targets.push(("-cubin", out.join(format!("{stem}.{sm}.cubin")), sm.into()));
        }
        let jobs = targets
            .iter()
            .map(|(kind, dst, arch)| {
                eprintln!("kernels: {} → {}", src.display(), dst.display());
                let mut cmd = Command::new(&nvcc);
                cmd.args([
                    kind,
                    format!("-arch={arch}").as_str(),
                    "-O3",
                    "-std=c++17",
                    "-Werror",
                    "all-warnings",
                ]);
                if *kind == "-cubin" {
                    cmd.args(["-Xptxas", "-v"]);
                }
                cmd.arg(src).arg("-o").arg(dst);
                (arch.clone(), cmd)
            })
            .collect();
        let mut reports = run_parallel(jobs)?;
        // What a driver does with the PTX on GPUs without a cubin of their own.
        let jit_dir = out.join("jit");
        std::fs::create_dir_all(&jit_dir)?;
        let jit = JIT_TARGETS
            .iter()
            .map(|sm| {
                let mut cmd = Command::new(&ptxas);
                cmd.args([&format!("-arch={sm}") as &str, "-O3", "-v"])
                    .arg(&ptx)
                    .arg("-o")
                    .arg(jit_dir.join(format!("{stem}.{sm}.cubin")));
                (format!("jit {sm}"), cmd)
            })
            .collect();
        eprintln!(
            "kernels: the compute_75 PTX through ptxas for {} (what the driver's JIT does)",
            JIT_TARGETS.join(", ")
        );
        reports.extend(run_parallel(jit)?);
        std::fs::remove_dir_all(&jit_dir).ok();
        let mut table = String::from(
            "# ptxas -v per target (jit: the compute_75 PTX compiled for a GPU with no cubin):\n\
             # registers, stack frame and spill bytes per thread, CTAs of 128 threads per SM\n\
             # by registers (cargo xtask kernels)\n\
             target\tfunction\tregisters\tstack\tspill_st\tspill_ld\tctas_per_sm\n",
        );
        let mut over = Vec::new();
        for (target, report) in reports {
            let res = parse_ptxas(&report);
            if res.is_empty() {
                continue; // the PTX job: no ptxas
            }
            let regs = res.iter().map(|r| r.registers);
            let (lo, hi) = (regs.clone().min().unwrap_or(0), regs.max().unwrap_or(0));
            let local = res.iter().map(|r| r.stack_bytes).max().unwrap_or(0);
            let spilling = res.iter().filter(|r| r.spill_store_bytes > 0).count();
            eprintln!(
                "kernels: {target}: {} functions, {lo}–{hi} registers, stack frames ≤ {local} bytes, {spilling} spilling",
                res.len()
            );
            for r in &res {
                table.push_str(&format!(
                    "{target}\t{}\t{}\t{}\t{}\t{}\t{}\n",
                    r.function,
                    r.registers,
                    r.stack_bytes,
                    r.spill_store_bytes,
                    r.spill_load_bytes,
                    ctas_by_registers(r.registers, 128)
                ));
            }
            over.extend(over_budget(&res).into_iter().map(|r| {
                format!(
                    "{target} {}: {} bytes stack frame, {} bytes spilled",
                    r.function, r.stack_bytes, r.spill_store_bytes
                )
            }));
        }
        let resources = out.join(format!("{stem}.resources.tsv"));
        std::fs::write(&resources, &table)?;
        if !over.is_empty() {
            bail!(
                "{}: {} kernel(s) use more than {LOCAL_BYTES_BUDGET} bytes of local memory per thread (an array indexed at run time, or registers spilled; see {}):\n  {}",
                src.display(),
                over.len(),
                resources.display(),
                over.join("\n  ")
            );
        }
        written.extend(targets.into_iter().map(|(_, dst, _)| dst));
        written.push(resources);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPORT: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'siliceo_kv_seal_k5_v4' for 'sm_75'
ptxas info    : Function properties for siliceo_kv_seal_k5_v4
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 39 registers, used 1 barriers, 396 bytes cmem[0]
ptxas info    : Compile time = 116.317 ms
ptxas info    : Compiling entry function 'siliceo_attn_decode_f16_f16_d128_g2' for 'sm_75'
ptxas info    : Function properties for siliceo_attn_decode_f16_f16_d128_g2
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 8 bytes cumulative stack size, 16 bytes smem, 476 bytes cmem[0]
ptxas info    : Compiling entry function 'old_decode' for 'sm_75'
ptxas info    : Function properties for old_decode
    192 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 192 bytes cumulative stack size, 476 bytes cmem[0]
";

    #[test]
    fn reads_what_ptxas_reports_per_function() {
        let r = parse_ptxas(REPORT);
        let got: Vec<(&str, u32, u32, u32, u32)> = r
            .iter()
            .map(|r| {
                (
                    r.function.as_str(),
                    r.registers,
                    r.stack_bytes,
                    r.spill_store_bytes,
                    r.spill_load_bytes,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("siliceo_kv_seal_k5_v4", 39, 0, 0, 0),
                ("siliceo_attn_decode_f16_f16_d128_g2", 64, 8, 4, 4),
                ("old_decode", 128, 192, 0, 0),
            ]
        );
        // A word spilled for occupancy passes; a local array does not.
        let over: Vec<&str> = over_budget(&r)
            .iter()
            .map(|r| r.function.as_str())
            .collect();
        assert_eq!(over, ["old_decode"]);
    }

    #[test]
    fn counts_ctas_per_sm_by_registers() {
        // 64 registers × 128 threads: 8 CTAs in 65,536 registers.
        assert_eq!(ctas_by_registers(64, 128), 8);
        // 65 rounds up to 72 per thread (2,304 per warp): 28 warps, 7 CTAs.
        assert_eq!(ctas_by_registers(65, 128), 7);
        assert_eq!(ctas_by_registers(128, 128), 4);
        assert_eq!(ctas_by_registers(255, 128), 2);
    }
}
