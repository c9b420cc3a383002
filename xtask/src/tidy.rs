//! Tidy checks, run by `cargo xtask tidy` and as ordinary tests so `cargo test`
//! enforces them: crate docs present, the layer rules hold.

use std::path::Path;

use anyhow::Result;

/// Every problem found, as a readable line.
pub fn run(root: &Path) -> Result<Vec<String>> {
    let mut problems = crate_docs(root)?;
    problems.extend(crate::layers::violations(&crate::layers::metadata(root)?));
    Ok(problems)
}

/// Each crate's root file opens with `//!` docs; libraries deny missing docs.
fn crate_docs(root: &Path) -> Result<Vec<String>> {
    let mut problems = Vec::new();
    let mut dirs: Vec<_> = std::fs::read_dir(root.join("crates"))?
        .flatten()
        .map(|e| e.path())
        .collect();
    dirs.extend(["benches", "xtask"].map(|d| root.join(d)));
    for dir in dirs {
        for (file, is_lib) in [("src/lib.rs", true), ("src/main.rs", false)] {
            let path = dir.join(file);
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            let shown = path
                .strip_prefix(root)
                .unwrap_or(&path)
                .display()
                .to_string();
            let first = text
                .lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or_default();
            if !first.starts_with("//!") {
                problems.push(format!("{shown}: must open with `//!` crate docs"));
            }
            let in_crates = dir.parent().is_some_and(|p| p.ends_with("crates"));
            if is_lib && in_crates && !text.contains("#![deny(missing_docs)]") {
                problems.push(format!(
                    "{shown}: library crates must `#![deny(missing_docs)]`"
                ));
            }
        }
    }
    Ok(problems)
}

#[cfg(test)]
mod tests {
    #[test]
    fn crate_docs_and_layer_rules_hold() {
        let problems = super::run(&crate::workspace_root()).unwrap();
        assert!(problems.is_empty(), "tidy:\n  {}", problems.join("\n  "));
    }
}
