//! The `siliceo` binary end to end, on the real default model.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The checkout the tests run in (cargo sets `CARGO_MANIFEST_DIR` when it runs
/// a test), where the binary finds `models/`: a test binary built in another
/// checkout sharing the target directory must not use that one's models.
fn workspace_root() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .join("../..")
}

/// The `siliceo` binary, run from the workspace root.
fn siliceo_cmd() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_siliceo"));
    cmd.current_dir(workspace_root()).env_remove("RUST_LOG");
    cmd
}

fn siliceo(args: &[&str]) -> Output {
    siliceo_cmd().args(args).output().expect("run siliceo")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs `siliceo args` (with `env` set) and checks it fails with `needle` on stderr.
fn check(args: &[&str], env: Option<(&str, &str)>, needle: &str) {
    let mut cmd = siliceo_cmd();
    cmd.args(args);
    if let Some((k, v)) = env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    assert!(!out.status.success(), "{args:?} succeeded");
    let err = text(&out.stderr);
    assert!(
        err.contains(needle),
        "{args:?}: expected `{needle}` in:\n{err}"
    );
}

#[test]
fn generate_streams_text_and_reports_speed() {
    let out = siliceo(&[
        "generate",
        "--chat",
        // SmolLM2-135M's own template adds a default system prompt it then
        // answers this question badly under; a plain one keeps it on topic.
        "--system",
        "You are a helpful assistant.",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "40",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("Paris"), "{}", text(&out.stdout));
    let err = text(&out.stderr);
    assert!(
        err.contains("tok/s") && err.contains("finish: stop"),
        "{err}"
    );
    // No llama.cpp chatter on stderr at the default log level.
    assert!(!err.contains("llama_model_loader"), "{err}");
    // With the kv8 preset (q8_0 K and V) the answer is the same.
    let out = siliceo(&[
        "generate",
        "--chat",
        "--system",
        "You are a helpful assistant.",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "40",
        "--kv",
        "kv8",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("Paris"), "{}", text(&out.stdout));
}

#[test]
fn greedy_is_repeatable_and_seeded_sampling_too() {
    let args = [
        "generate",
        "--prompt",
        "Rust is a language that",
        "--max-tokens",
        "24",
    ];
    assert_eq!(siliceo(&args).stdout, siliceo(&args).stdout);
    let mut sampled = args.to_vec();
    sampled.extend(["--temperature", "0.9", "--top-p", "0.95", "--seed", "11"]);
    let a = siliceo(&sampled);
    assert!(a.status.success(), "{}", text(&a.stderr));
    assert_eq!(a.stdout, siliceo(&sampled).stdout);
}

#[test]
fn stop_string_and_max_tokens() {
    let out = siliceo(&[
        "generate",
        "--prompt",
        "1, 2, 3, 4, 5,",
        "--max-tokens",
        "30",
        "--stop",
        "8",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    assert!(!s.contains('8'), "{s}");
    assert!(s.contains('7'), "{s}");
    assert!(text(&out.stderr).contains("finish: stop"));
    let out = siliceo(&[
        "generate",
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "5",
    ]);
    let err = text(&out.stderr);
    assert!(
        err.contains("5 generated") && err.contains("finish: length"),
        "{err}"
    );
}

#[test]
fn model_info_json() {
    let out = siliceo(&["model-info", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["geometry"]["n_layer"], 30);
    assert_eq!(v["geometry"]["n_head_kv"], 3);
    let kv = v["kv"].as_array().unwrap();
    let f16 = kv.iter().find(|r| r["type"] == "f16").unwrap();
    // 30 layers × 3 KV heads × 64 dims × 2 bytes.
    assert_eq!(f16["k_bytes_per_token"], 11_520);
    let q8 = kv.iter().find(|r| r["type"] == "q8_0").unwrap();
    assert_eq!(q8["v_bytes_per_token"], 30 * 6 * 34);
}

#[test]
fn model_info_table() {
    let out = siliceo(&["model-info"]);
    assert!(out.status.success());
    let s = text(&out.stdout);
    assert!(s.contains("layers        30") && s.contains("q5_1"), "{s}");
}

#[test]
fn errors_are_clear_and_exit_nonzero() {
    check(
        &["generate", "--prompt", "hi", "--model", "/nonexistent.gguf"],
        None,
        "no such file: /nonexistent.gguf",
    );
    check(
        &["generate", "--prompt", "hi"],
        Some(("SILICEO_MODEL", "/nonexistent.gguf")),
        "cargo xtask fetch-model",
    );
    check(&["generate", "--prompt", ""], None, "the prompt is empty");
    check(
        &["generate", "--prompt", "hi", "--top-p", "0"],
        None,
        "invalid `top_p`",
    );
    check(
        &[
            "generate",
            "--prompt",
            "hi",
            "--kv-backend",
            "llama",
            "--kv-k",
            "q3",
        ],
        None,
        "unknown KV cache type",
    );
    check(
        &["generate", "--prompt", "hi", "--kv-k", "q8_0"],
        None,
        "use them with --kv-backend llama",
    );
    check(
        &["generate", "--prompt", "hi", "--kv", "k5v4+tail"],
        None,
        "+tailN",
    );
    check(
        &["generate", "--prompt", "hi", "--kv", "kv9"],
        None,
        "--kv kv9",
    );
    let long = "word ".repeat(400);
    check(
        &["generate", "--prompt", &long, "--ctx", "256"],
        None,
        "does not fit the context",
    );
    let manifest = workspace_root().join("crates/siliceo/Cargo.toml");
    check(
        &["model-info", "--model", manifest.to_str().unwrap()],
        None,
        "is not a GGUF model",
    );
}

#[test]
fn plan_reads_the_gguf_like_llama_cpp_does() {
    // Geometry and weight bytes from our own GGUF reader must match what
    // llama.cpp reports for the same file.
    let info: serde_json::Value =
        serde_json::from_slice(&siliceo(&["model-info", "--json"]).stdout).unwrap();
    let out = siliceo(&["plan", "--budget", "8GiB", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(plan["geometry"], info["geometry"]);
    assert_eq!(plan["weight_bytes"], info["weight_bytes"]);
    // f16: 23040 B per token, 64-token blocks.
    assert_eq!(
        plan["k_bytes_per_token"].as_f64().unwrap() + plan["v_bytes_per_token"].as_f64().unwrap(),
        23_040.0
    );
    assert_eq!(plan["k_bytes_per_block"], 11_520.0 * 64.0);
}

#[test]
fn plan_table_and_refusal() {
    let out = siliceo(&[
        "plan",
        "--geometry",
        "layers=32,kv_heads=8,head_dim=128,weights=4.9GiB",
        "--budget",
        "8GiB",
        "--kv-k",
        "q5_1",
        "--kv-v",
        "q4_0",
        "--tail",
        "1024",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    // q5_1 rows of 128: 4 × 24 B = 96 B; q4_0: 4 × 18 = 72 B; × 32 layers × 8 heads.
    assert!(s.contains("K 24576 B + V 18432 B = 43008 B"), "{s}");
    assert!(s.contains("f16 tail           1024 tokens"), "{s}");
    let out = siliceo(&[
        "plan",
        "--geometry",
        "layers=62,kv_heads=16,head_dim=128,weights=16.5GB",
        "--budget",
        "16GB",
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("the weights do not fit"),
        "{}",
        text(&out.stderr)
    );
    let out = siliceo(&["plan", "--geometry", "layers=32", "--budget", "8GiB"]);
    assert!(
        text(&out.stderr).contains("--geometry needs at least"),
        "{}",
        text(&out.stderr)
    );
    let out = siliceo(&["plan", "--budget", "8 apples"]);
    assert!(
        text(&out.stderr).contains("is not a size"),
        "{}",
        text(&out.stderr)
    );
}

/// Starts `siliceo serve` with `args`, waits for its ready line and returns
/// the child and the address it serves on.
fn start_server(args: &[&str]) -> (std::process::Child, String, String) {
    use std::io::BufRead;
    let mut child = siliceo_cmd()
        .arg("serve")
        .args(args)
        .args(["--http-listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run siliceo serve");
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = lines
        .next()
        .expect("a ready line")
        .expect("readable stdout");
    let addr = ready
        .strip_prefix("siliceo: ready on ")
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("not a ready line: {ready}"))
        .to_string();
    (child, addr, ready)
}

#[test]
fn serve_answers_grpc_and_exits_cleanly_on_sigterm() {
    let dir = std::env::temp_dir().join(format!("siliceo-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("serve.toml");
    // The file sets the context; the flag sets the address (flags win).
    std::fs::write(
        &cfg,
        "context = 1024\nlisten = \"127.0.0.1:1\"\nmax_running = 4\nkv = \"k5v4\"\nkv_backend = \"llama\"\n\
         gpu_layers = 4\n",
    )
    .unwrap();
    // The preset comes from the file; --kv-v overrides its V half.
    let (mut child, addr, ready) = start_server(&[
        "--config",
        cfg.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--kv-v",
        "q8_0",
    ]);
    assert!(ready.contains("context 1024"), "{ready}");
    assert!(ready.contains("KV llama.cpp q5_1/q8_0"), "{ready}");
    // `gpu_layers` is taken, and this build (no GPU backend) says truly
    // that no layer runs on a GPU.
    assert!(!ready.contains("on the GPU"), "{ready}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let text = rt.block_on(async {
        use siliceo_server::pb;
        let mut c = pb::inference_client::InferenceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let info = c
            .get_model_info(pb::GetModelInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.context_tokens, 1024);
        assert_eq!(info.max_running_seqs, 4);
        assert_eq!(info.gpu_layers, 0, "no GPU backend in this build");
        let mut s = c
            .generate(pb::GenerateRequest {
                input: Some(pb::generate_request::Input::Prompt(
                    "The capital of France is".into(),
                )),
                max_tokens: 6,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let mut text = String::new();
        while let Some(m) = s.message().await.unwrap() {
            text.push_str(&m.text);
        }
        text
    });
    assert!(text.contains("Paris"), "{text}");
    // Close the client's connection (its runtime), then stop the server.
    drop(rt);
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = child.wait().unwrap();
    assert!(status.success(), "exit after SIGTERM: {status}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `synth-model --like gemma4-mini` in a folder of its own (`tag`): the
/// folder (to remove) and the model's path.
fn gemma4_mini(tag: &str) -> (std::path::PathBuf, String) {
    let dir = std::env::temp_dir().join(format!("siliceo-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("gemma4-mini.gguf").to_str().unwrap().to_string();
    let out = siliceo(&[
        "synth-model",
        "--like",
        "gemma4-mini",
        "--quant",
        "q8_0",
        "--out",
        &path,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    (dir, path)
}

#[test]
fn the_store_serve_allocates_is_what_plan_says() {
    // Gemma 4's layers (two shapes, two layers without KV), from the header
    // for the plan and from llama.cpp's loaded model for serve.
    let (dir, gemma4) = gemma4_mini("plan");
    let gemma4 = gemma4.as_str();
    // Flags for both, then serve's own (token trees need a drafter).
    let none: &[&str] = &[];
    for (flags, serve_only) in [
        (
            &["-m", gemma4, "--kv", "k5v4", "--context", "4096"][..],
            none,
        ),
        (
            &["--kv", "kv8", "--context", "4096", "--max-running", "4"][..],
            none,
        ),
        (
            &[
                "--kv",
                "k5v4+tail64",
                "--kv-budget",
                "160MiB",
                "--batch-tokens",
                "256",
            ][..],
            none,
        ),
        (&["--kv", "f16", "--context", "2048"][..], none),
        (
            &[
                "--kv",
                "kv8",
                "--kv-budget",
                "192MiB",
                "--spec-tree-width",
                "3",
            ][..],
            &["--spec-ngram"][..],
        ),
    ] {
        let mut plan_args = vec!["plan", "--json"];
        plan_args.extend_from_slice(flags);
        let out = siliceo(&plan_args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let bytes = plan["bytes"].as_u64().unwrap();
        if flags.contains(&"--spec-tree-width") {
            assert!(plan["branch_blocks"].as_u64().unwrap() > 0, "{plan}");
        }
        if flags.contains(&gemma4) {
            let sources: Vec<u64> = plan["layers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|l| l["source"].as_u64().unwrap())
                .collect();
            assert_eq!(sources, [0, 1, 2, 3, 2, 3], "{plan}");
        }
        let mut serve_args = vec!["--listen", "127.0.0.1:0"];
        serve_args.extend_from_slice(flags);
        serve_args.extend_from_slice(serve_only);
        let (mut child, addr, ready) = start_server(&serve_args);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let info = rt.block_on(async {
            use siliceo_server::pb;
            let mut c = pb::inference_client::InferenceClient::connect(format!("http://{addr}"))
                .await
                .unwrap();
            c.get_model_info(pb::GetModelInfoRequest {})
                .await
                .unwrap()
                .into_inner()
        });
        assert_eq!(info.kv_backend, "ours", "{ready}");
        assert_eq!(info.kv_store_bytes, bytes, "{flags:?}: {ready}");
        // No GPU here: every layer's store is in host memory.
        assert_eq!((info.kv_device_layers, info.kv_device_bytes), (0, 0));
        assert_eq!(
            u64::from(info.context_tokens),
            plan["tokens"].as_u64().unwrap()
        );
        assert_eq!(info.kv_format, plan["format"].as_str().unwrap());
        drop(rt);
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `plan --kv … --gpu-layers N`: the offloaded layers (llama.cpp's last
/// ones; 1 is only the output layer) hold their pools and a scratch each in
/// device memory, the rest and one scratch stay on the host.
#[test]
fn plan_splits_the_store_between_host_and_gpu_layers() {
    let plan = |extra: &[&str]| {
        let mut args = vec!["plan", "--json", "--kv", "kv8", "--context", "4096"];
        args.extend_from_slice(extra);
        let out = siliceo(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let base = plan(&[]);
    assert!(base.get("split").is_none(), "{base}");
    let (bytes, scratch) = (
        base["bytes"].as_u64().unwrap(),
        base["scratch_bytes"].as_u64().unwrap(),
    );
    assert!(scratch > 0, "{base}");
    // SmolLM2: 30 layers.
    let per_layer = (bytes - scratch) / 30;
    assert_eq!(per_layer * 30 + scratch, bytes);
    for (gpu_layers, on_device) in [(0u64, 0u64), (1, 0), (11, 10), (31, 30), (99, 30)] {
        let p = plan(&["--gpu-layers", &gpu_layers.to_string()]);
        assert_eq!(p["bytes"], base["bytes"], "the plan itself does not change");
        let s = &p["split"];
        assert_eq!(s["device_layers"].as_u64().unwrap(), on_device, "{p}");
        assert_eq!(
            s["device_bytes"].as_u64().unwrap(),
            on_device * (per_layer + scratch),
            "{p}"
        );
        assert_eq!(
            s["host_bytes"].as_u64().unwrap(),
            (30 - on_device) * per_layer + scratch,
            "{p}"
        );
    }
    let out = siliceo(&["plan", "--kv", "kv8", "--gpu-layers", "11"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert!(
        table.contains("layers 20..30 (10 of 30; the store of 10)"),
        "{table}"
    );
    let out = siliceo(&["plan", "--gpu-layers", "11", "--budget", "8GiB"]);
    assert!(!out.status.success(), "--gpu-layers needs --kv");
    // Gemma 4's layers: the offloaded ones keeping KV hold their store on
    // the device (layers 4 and 5 read layers 2 and 3's).
    let (dir, gemma4) = gemma4_mini("split");
    let gemma4 = gemma4.as_str();
    for (gpu_layers, owners) in [(3u64, 0u64), (4, 1), (7, 4)] {
        let out = siliceo(&[
            "plan",
            "--json",
            "-m",
            gemma4,
            "--kv",
            "kv8",
            "--gpu-layers",
            &gpu_layers.to_string(),
        ]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let p: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let s = &p["split"];
        assert_eq!(s["device_layers"].as_u64().unwrap(), owners, "{p}");
        // Each device layer's own scratch comes on top of the plan.
        let total = s["device_bytes"].as_u64().unwrap() + s["host_bytes"].as_u64().unwrap();
        assert_eq!(total > p["bytes"].as_u64().unwrap(), owners > 0, "{p}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn serve_refuses_what_it_cannot_do_with_a_clear_error() {
    let listen = ["--listen", "127.0.0.1:0"];
    for (flags, needle) in [
        (&["--draft-model", "x.gguf"][..], "--draft-model"),
        (&["--kv-backend", "llama", "--kv-k", "q9_9"][..], "--kv-k"),
        (&["--kv-k", "q8_0"][..], "--kv-backend llama"),
        (&["--kv-backend", "cells"][..], "expected ours or llama"),
        (
            &["--kv-budget", "1KiB"][..],
            "raise the budget or lower the running",
        ),
        (&["--kv", "kv9"][..], "--kv kv9"),
    ] {
        let args: Vec<&str> = std::iter::once("serve")
            .chain(flags.iter().copied())
            .chain(listen)
            .collect();
        check(&args, None, needle);
    }
    check(
        &["serve", "--model", "/nonexistent.gguf"],
        None,
        "no such file",
    );
}

#[test]
fn a_closed_pipe_ends_output_quietly() {
    // `siliceo plan | true`: the reader is gone before anything is written
    // (it closes at once; `plan` first reads the model's GGUF header). The
    // writer must end by SIGPIPE like any Unix tool, not panic.
    use std::os::unix::process::ExitStatusExt;
    let mut child = siliceo_cmd()
        .args(["plan", "--budget", "8GiB"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.signal(), Some(13), "{:?}: {err}", out.status);
}

/// `synth-model`: a two-layer model of Qwen2.5-1.5B's geometry with the
/// Qwen tokenizer: its tensor table is the real model's (the same names and
/// shapes, blocks 0 and 1), llama.cpp loads it and generates (noise), on
/// llama.cpp's KV and through our store. A vocab-only file made from it is a
/// tokenizer source as good as the model it came from.
#[test]
fn synth_model_has_the_real_tensor_table_and_llama_cpp_runs_it() {
    use siliceo_kv_paging::gguf::GgufHeader;
    let root = workspace_root();
    let real = root.join("models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    let tok = root.join("models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert!(
        real.is_file() && tok.is_file(),
        "run `cargo xtask fetch-model --spec` first"
    );
    let dir = std::env::temp_dir().join(format!("siliceo-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let vocab = dir.join("vocab.gguf");
    let out = siliceo(&[
        "synth-model",
        "--vocab-only",
        "--tokenizer",
        tok.to_str().unwrap(),
        "--out",
        vocab.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let model = dir.join("synth.gguf");
    let out = siliceo(&[
        "synth-model",
        "--like",
        "qwen2.5-1.5b",
        "--layers",
        "2",
        "--tokenizer",
        vocab.to_str().unwrap(),
        "--out",
        model.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let read = |p: &std::path::Path| siliceo_runtime::read_gguf_header(p).unwrap();
    let (ours, theirs) = (read(&model), read(&real));
    let table = |h: &GgufHeader| {
        let mut t: Vec<(String, Vec<u64>)> = h
            .tensors
            .iter()
            .filter(|t| {
                !t.name.starts_with("blk.")
                    || t.name.starts_with("blk.0.")
                    || t.name.starts_with("blk.1.")
            })
            .map(|t| (t.name.clone(), t.dims.clone()))
            .collect();
        t.sort();
        t
    };
    assert_eq!(table(&ours), table(&theirs));
    // The file is its header plus every tensor's data, padded.
    let data: u64 = ours.weight_bytes().unwrap();
    let len = std::fs::metadata(&model).unwrap().len();
    assert!(
        len >= data && len - data < 16 << 20,
        "{len} bytes for {data} of data"
    );
    // The real tokenizer, padded to the model's vocabulary.
    assert_eq!(
        ours.str("tokenizer.ggml.model"),
        theirs.str("tokenizer.ggml.model")
    );
    assert_eq!(ours.strs("tokenizer.ggml.tokens").unwrap().len(), 151_936);
    for kv in [&["--kv-backend", "llama"][..], &["--kv", "kv8"][..]] {
        let mut args = vec![
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "def fib(n):",
            "--max-tokens",
            "6",
            "--ctx",
            "256",
        ];
        args.extend_from_slice(kv);
        let out = siliceo(&args);
        assert!(out.status.success(), "{kv:?}: {}", text(&out.stderr));
        // Noise, but decoded: the speed line reports what was generated.
        assert!(
            text(&out.stderr).contains(" generated at "),
            "{}",
            text(&out.stderr)
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
