//! Embeddings on all-MiniLM-L6-v2 converted to GGUF by `cargo xtask
//! fetch-model --embed`, against a reference forward pass on the original F32
//! weights (scripts/minilm_reference.py, output recorded in
//! tests/fixtures/minilm_reference.json).

use std::path::PathBuf;
use std::sync::OnceLock;

use siliceo_core::TokenId;
use siliceo_engine::{
    Embedder, EmbedderOptions, EngineError, Model, ModelOptions, Pooling, cosine,
};

pub fn embed_model_path() -> PathBuf {
    std::env::var_os("SILICEO_EMBED_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::manifest_dir().join("../../models/all-MiniLM-L6-v2.f16.gguf"))
}

fn embed_model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = embed_model_path();
        Model::load(&path, &ModelOptions::default()).unwrap_or_else(|e| {
            panic!(
                "cannot load {} ({e}); run `cargo xtask fetch-model --embed`",
                path.display()
            )
        })
    })
}

fn embedder() -> Embedder<'static> {
    Embedder::new(embed_model(), EmbedderOptions::default()).unwrap()
}

struct Reference {
    text: String,
    tokens: Vec<u32>,
    embedding: Vec<f32>,
}

fn reference() -> Vec<Reference> {
    let raw = include_str!("../fixtures/minilm_reference.json");
    let v: serde_json::Value = serde_json::from_str(raw).unwrap();
    v["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| Reference {
            text: i["text"].as_str().unwrap().to_string(),
            tokens: i["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect(),
            embedding: i["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect(),
        })
        .collect()
}

#[test]
fn the_converted_model_matches_the_reference_forward_pass() {
    let mut e = embedder();
    assert_eq!(e.pooling(), Pooling::Mean);
    assert_eq!(e.dim(), 384);
    assert_eq!(e.max_tokens(), 512);
    let refs = reference();
    assert!(refs.len() >= 5);
    let texts: Vec<&str> = refs.iter().map(|r| r.text.as_str()).collect();
    let out = e.embed(&texts, false, false).unwrap();
    for (r, (v, n)) in refs.iter().zip(out.vectors.iter().zip(&out.tokens)) {
        let (toks, _) = e.tokens(&r.text, false).unwrap();
        let toks: Vec<u32> = toks.iter().map(|t| t.0).collect();
        assert_eq!(toks, r.tokens, "tokens of {:?}", r.text);
        assert_eq!(*n as usize, r.tokens.len());
        let c = cosine(v, &r.embedding);
        eprintln!("{:<60} cosine {c:.6}", format!("{:?}", r.text));
        assert!(c >= 0.999, "{:?}: cosine {c} against the reference", r.text);
    }
}

#[test]
fn a_batch_gives_what_one_by_one_gives_and_normalises() {
    let mut e = embedder();
    let refs = reference();
    let texts: Vec<&str> = refs.iter().map(|r| r.text.as_str()).collect();
    let batch = e.embed(&texts, true, false).unwrap();
    for (i, t) in texts.iter().enumerate() {
        let one = e.embed(&[t], true, false).unwrap();
        let c = cosine(&one.vectors[0], &batch.vectors[i]);
        let max = one.vectors[0]
            .iter()
            .zip(&batch.vectors[i])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            c > 0.99999 && max < 1e-3,
            "{t:?}: batch vs alone cosine {c}, max diff {max}"
        );
        let norm: f32 = batch.vectors[i].iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{t:?}: norm {norm}");
    }
    // Without normalisation the norm is whatever the pooling gives.
    let raw = e.embed(&[texts[0]], false, false).unwrap();
    let norm: f32 = raw.vectors[0].iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() > 0.01, "unnormalised norm {norm}");
}

#[test]
fn paraphrases_score_higher_than_unrelated_sentences() {
    let mut e = embedder();
    let v = e
        .embed(
            &[
                "A man is playing a guitar.",
                "Someone is strumming a guitar.",
                "The stock market fell sharply today.",
                "How do I bake bread at home?",
                "What is a simple recipe for homemade bread?",
            ],
            true,
            false,
        )
        .unwrap()
        .vectors;
    let s = |a: usize, b: usize| cosine(&v[a], &v[b]);
    assert!(
        s(0, 1) > s(0, 2) + 0.3,
        "guitar pair {} vs unrelated {}",
        s(0, 1),
        s(0, 2)
    );
    assert!(
        s(3, 4) > s(3, 2) + 0.3,
        "bread pair {} vs unrelated {}",
        s(3, 4),
        s(3, 2)
    );
    assert!(s(3, 4) > s(3, 0));
}

#[test]
fn oversized_input_is_truncated_or_refused_as_asked_and_batches_split() {
    let mut e = embedder();
    let long = "word ".repeat(700);
    match e.embed(&[&long], true, false) {
        Err(EngineError::PromptTooLong { tokens, n_ctx }) => {
            assert!(tokens > 512 && n_ctx == 512, "{tokens} {n_ctx}")
        }
        other => panic!("expected PromptTooLong, got {other:?}"),
    }
    let out = e.embed(&["short", &long], true, true).unwrap();
    assert_eq!(out.truncated, vec![1]);
    assert_eq!(out.tokens[1], 512);
    let (toks, cut) = e.tokens(&long, true).unwrap();
    assert!(cut);
    let sep = e.tokens("", false).unwrap().0[1];
    assert_eq!(
        toks.last(),
        Some(&sep),
        "a truncated input keeps its separator"
    );
    // 100 inputs of ~100 tokens: more than one batch (2048 tokens, 64 inputs).
    let text = "the cat sat on the mat and looked out of the window ".repeat(8);
    let many: Vec<&str> = std::iter::repeat_n(text.as_str(), 100).collect();
    let out = e.embed(&many, true, false).unwrap();
    assert_eq!(out.vectors.len(), 100);
    assert!(
        out.vectors
            .iter()
            .all(|v| cosine(v, &out.vectors[0]) > 0.99999)
    );
    // Tokens the model does not know are refused by llama.cpp's tokenizer only
    // through the text path; raw ids go through `run`.
    assert!(e.run(&[vec![TokenId(101), TokenId(102)]], true).is_ok());
}

#[test]
fn a_generation_model_is_not_an_embedding_model() {
    match Embedder::new(crate::model(), EmbedderOptions::default()) {
        Err(EngineError::InvalidOption { reason, .. }) => {
            assert!(reason.contains("not an embedding model"), "{reason}")
        }
        other => panic!("expected InvalidOption, got {other:?}"),
    }
}

fn variant(file: &str) -> Model {
    let path = crate::manifest_dir().join("../../models").join(file);
    Model::load(&path, &ModelOptions::default()).unwrap_or_else(|e| {
        panic!(
            "cannot load {} ({e}); run `cargo xtask fetch-model --embed`",
            path.display()
        )
    })
}

/// The rank-pooling (cross-encoder) path, on the only head we can build here:
/// a made-up linear head `w · h_CLS + b` (xtask's `test_head`). What this
/// verifies: pair formatting `[CLS] q [SEP] d [SEP]`, that llama.cpp applies
/// the head to the [CLS] state and returns one score per pair, batching of
/// pairs. What it does not: that any score is a good relevance judgement
/// (that needs a trained cross-encoder, which cannot be fetched here).
#[test]
fn rank_pooling_applies_the_classification_head_to_the_cls_state() {
    let rank_model = variant("all-MiniLM-L6-v2.rank-head.test.gguf");
    let cls_model = variant("all-MiniLM-L6-v2.cls-pool.test.gguf");
    let mut rank = Embedder::new(&rank_model, EmbedderOptions::default()).unwrap();
    let mut cls = Embedder::new(&cls_model, EmbedderOptions::default()).unwrap();
    assert_eq!(rank.pooling(), Pooling::Rank);
    assert_eq!(rank.dim(), 1);
    assert_eq!(cls.pooling(), Pooling::Cls);
    let query = "how do I bake bread";
    let docs = [
        "Mix flour, water and yeast, then bake.",
        "The stock market fell.",
        "",
    ];
    let pairs: Vec<Vec<TokenId>> = docs
        .iter()
        .map(|d| rank.pair_tokens(query, d, false).unwrap().0)
        .collect();
    // [CLS] query [SEP] doc [SEP]
    let q = rank.tokens(query, false).unwrap().0;
    assert_eq!(&pairs[0][..q.len()], &q[..]);
    assert_eq!(pairs[0].last(), q.last());
    let scores = rank.run(&pairs, true).unwrap();
    let states = cls.run(&pairs, false).unwrap();
    let n = 384;
    let w: Vec<f32> = (0..n)
        .map(|i| ((i + 1) as f32).sin() / (n as f32).sqrt())
        .collect();
    for (i, (s, h)) in scores.iter().zip(&states).enumerate() {
        assert_eq!(s.len(), 1, "one score per pair");
        let want = w.iter().zip(h).map(|(a, b)| a * b).sum::<f32>() + 0.25;
        assert!(
            (s[0] - want).abs() < 1e-3 * (1.0 + want.abs()),
            "pair {i}: score {} vs w·h_CLS + b = {want}",
            s[0]
        );
    }
    // Normalisation never touches scores.
    assert_eq!(rank.run(&pairs, false).unwrap(), scores);
}
