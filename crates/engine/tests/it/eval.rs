//! The KV quality harness on the real model and real text.

use siliceo_core::KvType;
use siliceo_engine::EngineError;
use siliceo_engine::eval::{EvalFormat, EvalOptions, KvConfig, Reference, eval_kv};

const TEXT: &str = "The history of computing is a story of memory as much as of arithmetic. \
Early machines stored a few thousand words in delay lines or magnetic drums, and programmers \
spent as much effort fitting data into memory as they spent on the algorithms themselves. \
When core memory arrived it was faster and more reliable, but it remained expensive, so \
every byte still mattered. Later, semiconductor memory made large stores cheap, and caches \
appeared between the processor and main memory to hide its latency. Today the same tension \
returns in language models: the keys and values of every token must be kept while a text is \
generated, and on a small graphics card that cache, not the weights, decides how long a \
conversation can be. Compressing it is tempting, but every bit removed changes what the \
model predicts, and the only honest way to know by how much is to measure it on real text.";

fn opts(configs: &[&str]) -> EvalOptions {
    EvalOptions {
        window: 64,
        stride: 48,
        max_windows: 3,
        configs: configs
            .iter()
            .map(|c| EvalFormat::parse(c).unwrap())
            .collect(),
        n_threads: None,
        reference: Reference::F16Flash,
        shadow_chunk: 0,
    }
}

#[test]
fn repeated_runs_agree_and_f16_against_f16_has_zero_divergence() {
    let model = crate::model();
    let tokens = model.tokenize(TEXT, true).unwrap();
    let o = opts(&["f16", "q8_0/q8_0", "q4_0/q4_0"]);
    let mut calls = 0;
    let a = eval_kv(model, &tokens, &o, |_, _| calls += 1).unwrap();
    let b = eval_kv(model, &tokens, &o, |_, _| {}).unwrap();
    assert_eq!(
        a, b,
        "the harness must give identical numbers on repeated runs"
    );
    assert_eq!(calls, a.windows);
    assert_eq!(a.windows, 3);
    assert_eq!(a.scored, 3 * (64 - 1 - 32));
    let (reference, f16, q8, q4) = (&a.rows[0], &a.rows[1], &a.rows[2], &a.rows[3]);
    assert_eq!(
        f16.config,
        EvalFormat::Llama(KvConfig {
            k: KvType::F16,
            v: KvType::F16
        })
    );
    assert_eq!(f16.kl_mean, 0.0);
    assert_eq!(f16.kl_p99, 0.0);
    assert_eq!(f16.top1_agreement, 1.0);
    assert_eq!(f16.perplexity, reference.perplexity);
    assert!(
        reference.perplexity > 1.0 && reference.perplexity < 200.0,
        "{}",
        reference.perplexity
    );
    // Fewer bits, more divergence — on this text, by a wide margin.
    assert!(
        q8.kl_mean > 0.0 && q8.kl_mean < q4.kl_mean,
        "q8 {} vs q4 {}",
        q8.kl_mean,
        q4.kl_mean
    );
    assert!(q8.top1_agreement >= q4.top1_agreement);
    assert!(
        q4.kv_bytes_per_token < q8.kv_bytes_per_token
            && q8.kv_bytes_per_token < f16.kv_bytes_per_token
    );
    assert_eq!(q8.bits_per_element, 8.5);
}

#[test]
fn presets_and_bad_options_are_typed() {
    assert_eq!(
        KvConfig::parse("kv8").unwrap(),
        KvConfig {
            k: KvType::Q8_0,
            v: KvType::Q8_0
        }
    );
    assert_eq!(
        KvConfig::parse("k5v4").unwrap(),
        KvConfig {
            k: KvType::Q5_1,
            v: KvType::Q4_1
        }
    );
    assert_eq!(
        KvConfig::parse("q8_0/q4_0").unwrap(),
        KvConfig {
            k: KvType::Q8_0,
            v: KvType::Q4_0
        }
    );
    assert!(matches!(
        KvConfig::parse("q3_k"),
        Err(EngineError::InvalidOption { .. })
    ));
    let model = crate::model();
    let tokens = model.tokenize(TEXT, true).unwrap();
    let mut o = opts(&["kv8"]);
    o.window = 2;
    assert!(matches!(
        eval_kv(model, &tokens, &o, |_, _| {}),
        Err(EngineError::InvalidOption {
            field: "window",
            ..
        })
    ));
    o.window = 4096;
    assert!(matches!(
        eval_kv(model, &tokens, &o, |_, _| {}),
        Err(EngineError::InvalidOption { field: "text", .. })
    ));
}

#[test]
fn shadow_attention_reproduces_llama_cpp_and_measures_our_formats() {
    let model = crate::model();
    let tokens = model.tokenize(TEXT, true).unwrap();
    let mut o = opts(&[
        "floor",
        "ours:f16",
        "ours:kv8",
        "ours:k5v4",
        "ours:k5v4+tail32",
    ]);
    o.reference = Reference::Exact;
    o.shadow_chunk = 1;
    let a = eval_kv(model, &tokens, &o, |_, _| {}).unwrap();
    let b = eval_kv(model, &tokens, &o, |_, _| {}).unwrap();
    assert_eq!(a, b, "the shadow path must be deterministic");
    let [reference, floor, f16, kv8, k5v4, tail] = &a.rows[..] else {
        panic!("{} rows", a.rows.len())
    };
    assert_eq!(reference.bits_per_element, 32.0);
    assert_eq!(reference.kl_mean, 0.0);
    assert!(reference.attn_error.is_none() && floor.attn_error.is_none());
    // The sanity check: with F16 blocks our kernel's attention output equals
    // llama.cpp's (f16 K/V, flash attention) on the same inputs, every layer.
    let (mean, max) = f16.attn_error.unwrap();
    assert!(
        max < 1e-5,
        "ours:f16 differs from llama.cpp by {mean:e} (max {max:e})"
    );
    // Quantized formats really change attention, more with fewer bits, less
    // with the most recent tokens in F16.
    let err = |r: &siliceo_engine::eval::EvalRow| r.attn_error.unwrap().0;
    assert!(
        1e-4 < err(kv8) && err(kv8) < err(k5v4),
        "kv8 {:e} k5v4 {:e}",
        err(kv8),
        err(k5v4)
    );
    assert!(
        err(tail) < err(k5v4),
        "tail {:e} vs {:e}",
        err(tail),
        err(k5v4)
    );
    assert_eq!(f16.bits_per_element, 16.0);
    assert_eq!(kv8.bits_per_element, 8.5);
    assert_eq!(k5v4.bits_per_element, 5.25);
    assert!(k5v4.kv_bytes_per_token < kv8.kv_bytes_per_token);
    // As a chunked prefill (each block sealed before its own queries attend)
    // K5/V4 errs more than as decoding sees it (newest partial block in F16).
    o.configs = vec![EvalFormat::parse("ours:k5v4").unwrap()];
    o.shadow_chunk = 0;
    let prefill = eval_kv(model, &tokens, &o, |_, _| {}).unwrap();
    assert!(
        err(&prefill.rows[1]) > err(k5v4),
        "prefill chunks {:e} vs decode {:e}",
        err(&prefill.rows[1]),
        err(k5v4)
    );
    // A harmless change of the computation already costs some KL (llama.cpp's
    // 8-bit activation rounding re-rolls); K5/V4 blocks cost more than that.
    assert!(
        floor.kl_mean > 0.0 && floor.kl_mean < prefill.rows[1].kl_mean,
        "floor {} vs k5v4 {}",
        floor.kl_mean,
        prefill.rows[1].kl_mean
    );
    assert!(matches!(
        EvalFormat::parse("ours:k4v4"),
        Err(EngineError::InvalidOption { .. })
    ));
}

#[test]
fn the_serving_path_scores_what_shadow_attention_scores() {
    // Windows of 160 tokens seal blocks (64-token blocks, tails of 0 and 32)
    // and are prefilled in one step: the serving path cuts its queries where
    // seals take effect, shadow attention decodes-as-it-goes (chunk 1). The
    // two compute the same attention on the same bytes.
    let model = crate::model();
    let tokens = model.tokenize(&TEXT.repeat(3), true).unwrap();
    let mut o = opts(&[
        "ours:kv8",
        "serve:kv8",
        "ours:k5v4+tail32",
        "serve:k5v4+tail32",
        "ours:f16",
        "serve:f16",
    ]);
    o.window = 160;
    o.stride = 160;
    o.max_windows = 2;
    o.shadow_chunk = 1;
    let r = eval_kv(model, &tokens, &o, |_, _| {}).unwrap();
    for pair in r.rows[1..].chunks(2) {
        let (shadow, served) = (&pair[0], &pair[1]);
        assert_eq!(
            served.config.name().strip_prefix("serve:"),
            shadow.config.name().strip_prefix("ours:")
        );
        assert_eq!(
            (served.perplexity, served.kl_mean, served.top1_agreement),
            (shadow.perplexity, shadow.kl_mean, shadow.top1_agreement),
            "{}",
            served.config.name()
        );
    }
}
