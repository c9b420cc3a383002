use siliceo_engine::{ChatMessage, Detokenizer, TokenText};

use crate::model;

#[test]
fn geometry_is_smollm2() {
    let g = model().geometry();
    assert_eq!(
        (g.n_layer, g.n_head, g.n_head_kv, g.head_dim_k),
        (30, 9, 3, 64)
    );
    assert_eq!(g.n_vocab, 49152);
    assert_eq!(model().architecture(), "llama");
}

#[test]
fn tokenize_detokenize_round_trip() {
    for text in [
        "Hello, world!",
        "naïve café — 世界 🦀",
        "fn main() {\n    println!(\"hi\");\n}",
    ] {
        let toks = model().tokenize(text, false).unwrap();
        assert!(!toks.is_empty());
        assert_eq!(model().detokenize(&toks, false), text);
    }
}

#[test]
fn incremental_detokenizer_never_splits_characters() {
    let text = "emoji 🦀🦀 and 世界 and ü";
    let toks = model().tokenize(text, false).unwrap();
    let mut d = Detokenizer::new(model());
    let mut out = String::new();
    for &t in &toks {
        // Every piece is a &str, so valid UTF-8 by construction; the test is
        // that no replacement character shows up and nothing is lost.
        out += &d.push(t);
    }
    out += &d.finish();
    assert_eq!(out, text);
    assert!(!out.contains('\u{FFFD}'));
}

#[test]
fn chat_template_renders_roles() {
    assert!(model().chat_template().is_some());
    let rendered = model()
        .apply_chat_template(
            &[
                ChatMessage::new("system", "Be brief."),
                ChatMessage::new("user", "Hi!"),
            ],
            true,
        )
        .unwrap();
    assert!(
        rendered.contains("<|im_start|>system\nBe brief.<|im_end|>"),
        "{rendered}"
    );
    assert!(rendered.ends_with("<|im_start|>assistant\n"), "{rendered}");
    // Special tokens in the rendered text are parsed as single tokens.
    let toks = model().tokenize(&rendered, true).unwrap();
    assert!(
        toks.iter().any(|&t| model().is_eog(t)),
        "<|im_end|> is an end-of-generation token"
    );
}

/// A control token is no text, unless the text preserves it (markup such as
/// Mistral's `[TOOL_CALLS]`, which a reader of the output must see).
#[test]
fn preserved_control_tokens_render_as_their_text() {
    let m = model();
    let ids = m.tokenize("<|im_start|>user", false).unwrap();
    assert!(m.is_control(ids[0]), "{ids:?}");
    let params = siliceo_core::SamplingParams::greedy();
    let render = |text: TokenText<'_>| {
        let mut text = text;
        let mut out: String = ids.iter().map(|&t| text.push(t).0).collect();
        out.push_str(&text.finish());
        out
    };
    assert_eq!(render(TokenText::new(m, &params)), "user");
    let kept = TokenText::new(m, &params).with_preserved(std::sync::Arc::from([ids[0]]));
    assert_eq!(kept.bytes_of(ids[0]), b"<|im_start|>");
    assert_eq!(render(kept), "<|im_start|>user");
}
