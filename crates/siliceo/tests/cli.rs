//! The `siliceo` binary end to end, on the real default model.

use std::process::{Command, Output};

fn siliceo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_siliceo"))
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run siliceo")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn generate_streams_text_and_reports_speed() {
    let out = siliceo(&[
        "generate",
        "--chat",
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
    let check = |args: &[&str], env: Option<(&str, &str)>, needle: &str| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_siliceo"));
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
    };
    check(
        &["generate", "--prompt", "hi", "--model", "/nonexistent.gguf"],
        None,
        "model file not found",
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
        &["generate", "--prompt", "hi", "--kv-k", "q3"],
        None,
        "unknown KV cache type",
    );
    let long = "word ".repeat(400);
    check(
        &["generate", "--prompt", &long, "--ctx", "256"],
        None,
        "does not fit the context",
    );
    let readme = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    check(
        &["model-info", "--model", readme],
        None,
        "is not a GGUF model",
    );
}
