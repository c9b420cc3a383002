use std::io::Write;
use std::ops::ControlFlow;

use siliceo_core::{SamplingParams, SeqId, TokenId};
use siliceo_engine::{Batch, Context, ContextOptions, EngineError, Model, ModelOptions, generate};

use crate::{context, model, model_path, tokens};

fn temp_file(name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("siliceo-engine-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::File::create(&path)
        .unwrap()
        .write_all(bytes)
        .unwrap();
    path
}

#[test]
fn missing_model_file() {
    let err = Model::load("/nonexistent/model.gguf", &ModelOptions::default()).unwrap_err();
    assert!(matches!(err, EngineError::ModelNotFound { .. }), "{err:?}");
    assert_eq!(err.error_kind(), "model_not_found");
}

#[test]
fn not_a_gguf_file() {
    let path = temp_file("text.gguf", b"this is not a model at all");
    let err = Model::load(&path, &ModelOptions::default()).unwrap_err();
    assert!(matches!(err, EngineError::NotGguf { .. }), "{err:?}");
    let path = temp_file("short.gguf", b"GG");
    assert!(matches!(
        Model::load(&path, &ModelOptions::default()),
        Err(EngineError::NotGguf { .. })
    ));
}

#[test]
fn corrupt_and_truncated_models_are_refused() {
    // Right magic, garbage after it.
    let mut bytes = b"GGUF\x03\x00\x00\x00".to_vec();
    bytes.extend((0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8));
    let path = temp_file("garbage.gguf", &bytes);
    let err = Model::load(&path, &ModelOptions::default()).unwrap_err();
    assert!(matches!(err, EngineError::ModelLoad { .. }), "{err:?}");
    // A real model cut short: header fine, tensor data missing.
    let real = std::fs::read(model_path()).unwrap();
    let path = temp_file("truncated.gguf", &real[..real.len() / 3]);
    let err = Model::load(&path, &ModelOptions::default()).unwrap_err();
    assert!(matches!(err, EngineError::ModelLoad { .. }), "{err:?}");
}

#[test]
fn empty_prompt() {
    let mut ctx = context(256, 1);
    let err = generate(
        &mut ctx,
        SeqId(0),
        &[],
        &SamplingParams::greedy(),
        |_, _| ControlFlow::Continue(()),
    )
    .map(|_| ())
    .unwrap_err();
    assert!(matches!(err, EngineError::EmptyPrompt), "{err:?}");
    assert!(matches!(
        ctx.prefill(SeqId(0), &[], 0).map(|_| ()),
        Err(EngineError::EmptyPrompt)
    ));
}

#[test]
fn prompt_longer_than_context() {
    let mut ctx = context(256, 1);
    let n_ctx = ctx.n_ctx();
    let n = n_ctx as usize + 10;
    let long: Vec<_> = tokens("one two three four five six seven eight nine ten ")
        .into_iter()
        .cycle()
        .take(n)
        .collect();
    let err = generate(
        &mut ctx,
        SeqId(0),
        &long,
        &SamplingParams::greedy(),
        |_, _| ControlFlow::Continue(()),
    )
    .map(|_| ())
    .unwrap_err();
    assert!(
        matches!(err, EngineError::PromptTooLong { tokens, n_ctx: c } if tokens == n && c == n_ctx),
        "{err:?}"
    );
    assert!(matches!(
        ctx.prefill(SeqId(0), &long, 0).map(|_| ()),
        Err(EngineError::PromptTooLong { .. })
    ));
    // Nothing was decoded.
    assert_eq!(ctx.seq_len(SeqId(0)).unwrap(), 0);
}

#[test]
fn bad_tokens_sequences_and_options() {
    let mut ctx = context(256, 2);
    let bad = TokenId(model().geometry().n_vocab);
    let err = generate(
        &mut ctx,
        SeqId(0),
        &[bad],
        &SamplingParams::greedy(),
        |_, _| ControlFlow::Continue(()),
    )
    .map(|_| ())
    .unwrap_err();
    assert!(matches!(err, EngineError::InvalidToken { .. }), "{err:?}");
    let mut batch = Batch::new();
    batch.push(TokenId(1), 0, SeqId(2), true);
    assert!(matches!(
        ctx.decode(&batch),
        Err(EngineError::InvalidSeq {
            seq: 2,
            n_seq_max: 2
        })
    ));
    assert!(matches!(
        ctx.logits(0),
        Err(EngineError::NoLogits { index: 0 })
    ));
    let err = generate(
        &mut ctx,
        SeqId(0),
        &tokens("hi"),
        &SamplingParams {
            top_p: 2.0,
            ..SamplingParams::greedy()
        },
        |_, _| ControlFlow::Continue(()),
    )
    .map(|_| ())
    .unwrap_err();
    assert_eq!(err.to_string(), "invalid `top_p`: must be in (0, 1], got 2");
    let err = Context::new(
        model(),
        ContextOptions {
            n_seq_max: 300,
            ..ContextOptions::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::InvalidOption {
                field: "n_seq_max",
                ..
            }
        ),
        "{err:?}"
    );
}
