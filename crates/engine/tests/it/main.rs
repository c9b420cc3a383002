//! Engine tests on the real model (SmolLM2-135M-Instruct through llama.cpp).
//! `cargo xtask fetch-model` puts it under `models/`; `SILICEO_MODEL` overrides.

mod bad_input;
mod decode;
mod draft;
mod embed;
mod eval;
mod graft;
mod swa;
mod text;

use std::path::PathBuf;
use std::sync::OnceLock;

use siliceo_core::{Sampler, SamplingParams, SeqId, TokenId};
use siliceo_engine::{Batch, Context, ContextOptions, Model, ModelOptions};

/// This package's folder in the checkout the tests run in: cargo sets it when
/// it runs a test. A test binary built in another checkout that shares the
/// target directory must not read that checkout's models.
pub fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

pub fn model_path() -> PathBuf {
    std::env::var_os("SILICEO_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest_dir().join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf"))
}

pub fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = model_path();
        Model::load(&path, &ModelOptions::default()).unwrap_or_else(|e| {
            panic!(
                "cannot load {} ({e}); run `cargo xtask fetch-model` first",
                path.display()
            )
        })
    })
}

pub fn context(n_ctx: u32, n_seq_max: u32) -> Context<'static> {
    Context::new(
        model(),
        ContextOptions {
            n_ctx,
            n_seq_max,
            n_threads: Some(2),
            ..ContextOptions::default()
        },
    )
    .expect("context")
}

pub fn tokens(text: &str) -> Vec<TokenId> {
    model().tokenize(text, true).expect("tokenize")
}

/// Greedy decoding of several sequences stepped together: all prompts in one
/// batch, then one token of every sequence per `decode`.
pub fn greedy_together(
    ctx: &mut Context<'_>,
    seqs: &[(SeqId, Vec<TokenId>)],
    n: usize,
) -> Vec<Vec<TokenId>> {
    let mut batch = Batch::new();
    let mut idx = Vec::new();
    let mut pos = Vec::new();
    for (seq, prompt) in seqs {
        let start = ctx.seq_len(*seq).unwrap();
        idx.push(batch.push_run(prompt, start, *seq).unwrap());
        pos.push(start + prompt.len() as u32);
    }
    ctx.decode(&batch).unwrap();
    let mut samplers: Vec<Sampler> = seqs
        .iter()
        .map(|_| Sampler::new(&SamplingParams::greedy()))
        .collect();
    let mut out = vec![Vec::new(); seqs.len()];
    for step in 0..n {
        let next: Vec<TokenId> = (0..seqs.len())
            .map(|i| samplers[i].sample(ctx.logits(idx[i]).unwrap()))
            .collect();
        for (o, t) in out.iter_mut().zip(&next) {
            o.push(*t);
        }
        if step + 1 == n {
            break;
        }
        batch.clear();
        for (i, (seq, _)) in seqs.iter().enumerate() {
            idx[i] = batch.push(next[i], pos[i], *seq, true);
            pos[i] += 1;
        }
        ctx.decode(&batch).unwrap();
    }
    out
}
