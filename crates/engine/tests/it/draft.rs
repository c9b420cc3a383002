//! Draft/target vocabulary compatibility, on the real speculative pair
//! (Qwen2.5-Coder 0.5B and 1.5B; `cargo xtask fetch-model --spec`).

use siliceo_engine::{EngineError, Model, ModelOptions};

fn spec_model(file: &str) -> Model {
    let path = crate::manifest_dir().join("../../models").join(file);
    Model::load(&path, &ModelOptions::default()).unwrap_or_else(|e| {
        panic!(
            "cannot load {} ({e}); run `cargo xtask fetch-model --spec` first",
            path.display()
        )
    })
}

#[test]
fn the_qwen_pair_is_compatible_and_a_foreign_draft_is_refused() {
    let draft = spec_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let target = spec_model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    target.check_draft_compatible(&draft).unwrap();
    // SmolLM2 (49,152 tokens) cannot draft for Qwen (151,936), nor the reverse.
    let smol = super::model();
    for (t, d) in [(&target, smol), (smol, &draft)] {
        match t.check_draft_compatible(d) {
            Err(e @ EngineError::IncompatibleVocab(_)) => {
                assert_eq!(e.error_kind(), "incompatible_vocab");
                assert!(e.to_string().contains("vocabulary"), "{e}");
            }
            other => panic!("expected IncompatibleVocab, got {other:?}"),
        }
    }
}
