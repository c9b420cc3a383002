//! The layer rules: which of our crates may depend on which, and which outside
//! crates are confined to one of ours. Read from `cargo metadata`.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// Our packages, lowest layer first. A package may depend only on packages of
/// a strictly lower rank.
pub const LAYERS: &[(&str, u32)] = &[
    ("siliceo-core", 0),
    ("siliceo-kernels-turing", 1),
    ("siliceo-kv-paging", 2),
    ("siliceo-scheduler", 3),
    ("siliceo-speculative", 4),
    ("siliceo-constrain", 4),
    ("siliceo-chat", 4),
    ("siliceo-engine", 5),
    ("siliceo-runtime", 6),
    ("siliceo-server", 7),
    ("siliceo-http", 7),
    ("siliceo", 8),
    // The benchmark package sits on top of everything.
    ("siliceo-benches", 9),
];

/// Outside crates that only one of our library crates may name (the top-rank
/// benchmark package excepted).
pub const CONFINED: &[(&str, &str)] = &[
    ("llama-cpp-2", "siliceo-engine"),
    ("llama-cpp-sys-2", "siliceo-engine"),
    ("tonic", "siliceo-server"),
    ("tonic-build", "siliceo-server"),
    ("tonic-prost", "siliceo-server"),
    ("tonic-prost-build", "siliceo-server"),
    ("tonic-health", "siliceo-server"),
    ("tonic-reflection", "siliceo-server"),
    ("prost", "siliceo-server"),
    ("prost-types", "siliceo-server"),
    ("cudarc", "siliceo-kernels-turing"),
    ("axum", "siliceo-http"),
    ("llguidance", "siliceo-constrain"),
    ("toktrie", "siliceo-constrain"),
    ("minijinja", "siliceo-chat"),
    ("minijinja-contrib", "siliceo-chat"),
];

/// Pure-logic crates: no async runtime, no I/O frameworks, no llama.cpp.
pub const PURE: &[&str] = &["siliceo-core", "siliceo-kv-paging", "siliceo-scheduler"];
const NOT_IN_PURE: &[&str] = &[
    "tokio",
    "async-std",
    "futures",
    "llama-cpp-2",
    "llama-cpp-sys-2",
    "tonic",
    "cudarc",
];

/// `cargo metadata --no-deps` for the workspace.
pub fn metadata(root: &Path) -> Result<Value> {
    let out = crate::cargo()
        .current_dir(root)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .output()
        .context("cannot run cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Every broken rule, as a readable line.
pub fn violations(meta: &Value) -> Vec<String> {
    let rank: HashMap<&str, u32> = LAYERS.iter().copied().collect();
    let mut problems = Vec::new();
    let packages = meta["packages"].as_array().cloned().unwrap_or_default();
    for pkg in &packages {
        let name = pkg["name"].as_str().unwrap_or_default();
        if name == "xtask" {
            continue;
        }
        let Some(&my_rank) = rank.get(name) else {
            problems.push(format!(
                "package `{name}` has no layer: add it to xtask/src/layers.rs LAYERS"
            ));
            continue;
        };
        for dep in pkg["dependencies"].as_array().into_iter().flatten() {
            let dep_name = dep["name"].as_str().unwrap_or_default();
            let kind = dep["kind"].as_str().unwrap_or("normal");
            // A crate may dev-depend on itself to turn on a test-only feature.
            let self_for_tests = dep_name == name && kind == "dev";
            if let Some(&dep_rank) = rank.get(dep_name)
                && dep_rank >= my_rank
                && !self_for_tests
            {
                problems.push(format!(
                    "`{name}` (layer {my_rank}) depends on `{dep_name}` (layer {dep_rank}) [{kind}]: dependencies must point down"
                ));
            }
            if my_rank < 9
                && let Some((_, owner)) = CONFINED.iter().find(|(c, _)| *c == dep_name)
                && *owner != name
            {
                problems.push(format!(
                    "`{name}` depends on `{dep_name}`, which only `{owner}` may use"
                ));
            }
            if PURE.contains(&name) && NOT_IN_PURE.contains(&dep_name) && kind != "dev" {
                problems.push(format!(
                    "`{name}` is pure logic and must not depend on `{dep_name}`"
                ));
            }
        }
    }
    problems
}

/// `cargo xtask check-layers`: the rules above, then `cargo check -p` of each
/// crate on its own (so no crate builds only thanks to features another crate
/// turned on). `check` rather than `build`: each crate alone unifies its
/// dependencies' features differently from the test build, so dependencies are
/// compiled again per crate, and `check` skips their code generation. Build
/// scripts (llama.cpp's CMake build among them) run as in a build.
pub fn check_layers(root: &Path) -> Result<()> {
    let meta = metadata(root)?;
    let problems = violations(&meta);
    if !problems.is_empty() {
        bail!("layer rules broken:\n  {}", problems.join("\n  "));
    }
    eprintln!("check-layers: dependency directions ok");
    for (name, rank) in LAYERS.iter().filter(|(_, r)| *r < 9) {
        eprintln!("check-layers: layer {rank}: cargo check -p {name}");
        crate::run(
            crate::cargo()
                .current_dir(root)
                .args(["check", "--quiet", "-p", name]),
        )
        .with_context(|| format!("`{name}` does not build on its own"))?;
    }
    eprintln!("check-layers: every crate builds on its own");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pkg(name: &str, deps: &[(&str, &str)]) -> Value {
        json!({
            "name": name,
            "dependencies": deps.iter().map(|(d, k)| json!({"name": d, "kind": if *k == "normal" { Value::Null } else { json!(k) }})).collect::<Vec<_>>(),
        })
    }

    #[test]
    fn rules_catch_upward_and_confined_dependencies() {
        let meta = json!({"packages": [
            pkg("siliceo-core", &[("thiserror", "normal")]),
            pkg("siliceo-kv-paging", &[("siliceo-core", "normal"), ("siliceo-engine", "dev")]),
            pkg("siliceo-scheduler", &[("tokio", "normal")]),
            pkg("siliceo-runtime", &[("llama-cpp-2", "normal")]),
            pkg("siliceo-mystery", &[]),
            pkg("siliceo-benches", &[("tonic", "dev"), ("siliceo-server", "normal")]),
        ]});
        let v = violations(&meta);
        assert_eq!(v.len(), 4, "{v:#?}");
        assert!(v[0].contains("`siliceo-kv-paging` (layer 2) depends on `siliceo-engine`"));
        assert!(v[1].contains("pure logic") && v[1].contains("tokio"));
        assert!(v[2].contains("only `siliceo-engine` may use"));
        assert!(v[3].contains("`siliceo-mystery` has no layer"));
    }
}
