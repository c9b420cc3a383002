//! Matchers over a small synthetic vocabulary: every byte, a few words, and
//! two special tokens (an end-of-generation one and a chat marker).

use super::*;
use siliceo_core::sampler::Rng;

const EOS: TokenId = TokenId(258);
const IM_START: TokenId = TokenId(259);

fn vocab() -> Vocabulary {
    let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    tokens.push(b"\"name\"".to_vec()); // 256
    tokens.push(b"true".to_vec()); // 257
    tokens.push(b"<|im_end|>".to_vec()); // 258 (EOS)
    tokens.push(b"<|im_start|>".to_vec()); // 259
    tokens.push(b", ".to_vec()); // 260
    let mut special = vec![false; tokens.len()];
    special[EOS.0 as usize] = true;
    special[IM_START.0 as usize] = true;
    Vocabulary {
        tokens,
        special,
        end_of_generation: vec![EOS],
    }
}

fn grammars() -> Grammars {
    Grammars::new(vocab())
}

fn text(tokens: &[TokenId]) -> String {
    let v = vocab();
    let bytes: Vec<u8> = tokens
        .iter()
        .flat_map(|t| v.tokens[t.0 as usize].clone())
        .collect();
    String::from_utf8(bytes).unwrap()
}

/// Samples uniformly among the allowed tokens (end-of-generation taken as
/// soon as it is allowed, with probability `p_end`) until the matcher ends.
fn walk(m: &mut Matcher, rng: &mut Rng, p_end: f64, limit: usize) -> Vec<TokenId> {
    let mut out = Vec::new();
    for _ in 0..limit {
        let mask = m.mask().unwrap();
        let allowed: Vec<TokenId> = (0..vocab().tokens.len() as u32)
            .map(TokenId)
            .filter(|&t| mask.allows(t))
            .collect();
        assert!(
            !allowed.contains(&IM_START),
            "a control token is never text"
        );
        let tok = if mask.allows(EOS) && (allowed.len() == 1 || rng.next_f64() < p_end) {
            EOS
        } else {
            let text_only: Vec<TokenId> = allowed.into_iter().filter(|&t| t != EOS).collect();
            text_only[(rng.next_u64() % text_only.len() as u64) as usize]
        };
        m.accept(tok).unwrap();
        if tok == EOS {
            assert!(m.is_finished());
            return out;
        }
        out.push(tok);
    }
    panic!("no end within {limit} tokens: {:?}", text(&out));
}

#[test]
fn a_regex_constraint_only_lets_matching_text_through() {
    let g = grammars();
    let mut rng = Rng::new(7);
    for _ in 0..20 {
        let mut m = g
            .compile(&Constraint::Regex(
                r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]".into(),
            ))
            .unwrap();
        let out = text(&walk(&mut m, &mut rng, 1.0, 50));
        let b = out.as_bytes();
        assert_eq!(b.len(), 10, "{out}");
        assert!(out.starts_with("19") || out.starts_with("20"), "{out}");
        assert_eq!((b[4], b[7]), (b'-', b'-'), "{out}");
        assert!(
            out[5..7]
                .parse::<u32>()
                .is_ok_and(|m| (1..=12).contains(&m))
        );
    }
}

#[test]
fn a_json_schema_walk_always_parses_and_validates() {
    let schema = r#"{
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
            "ok": {"type": "boolean"}
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": false
    }"#;
    let g = grammars();
    let c = Constraint::JsonSchema {
        schema: schema.into(),
        strict: true,
    };
    let mut rng = Rng::new(11);
    for _ in 0..30 {
        let mut m = g.compile(&c).unwrap();
        let out = text(&walk(&mut m, &mut rng, 0.5, 400));
        let v: serde_json::Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out}: {e}"));
        let o = v.as_object().unwrap();
        assert!(
            o.keys()
                .all(|k| ["name", "age", "tags", "ok"].contains(&k.as_str())),
            "{out}"
        );
        assert!(o["name"].as_str().unwrap().chars().count() <= 6, "{out}");
        assert!((0..=120).contains(&o["age"].as_i64().unwrap()), "{out}");
        let tags = o["tags"].as_array().unwrap();
        assert!((1..=3).contains(&tags.len()), "{out}");
        assert!(tags.iter().all(|t| t == "a" || t == "b"), "{out}");
        // The layout the server promises: ", " and ": ", no free whitespace.
        assert!(!out.contains("  ") && !out.contains('\n'), "{out}");
    }
}

#[test]
fn json_object_a_lark_grammar_and_valid_prefixes() {
    let g = grammars();
    let mut m = g.compile(&Constraint::JsonObject).unwrap();
    let first = m.mask().unwrap();
    assert!(first.allows(TokenId(b'{' as u32)));
    assert!(!first.allows(TokenId(b'[' as u32)) && !first.allows(EOS));

    let lark = r#"start: "yes" | "no" | "maybe " NUM
NUM: /[0-9]+/"#;
    let mut m = g.compile(&Constraint::Lark(lark.into())).unwrap();
    let toks: Vec<TokenId> = b"maybe 42".iter().map(|&b| TokenId(b as u32)).collect();
    assert_eq!(m.valid_prefix(&toks), toks.len());
    let bad: Vec<TokenId> = b"mayhem".iter().map(|&b| TokenId(b as u32)).collect();
    assert_eq!(m.valid_prefix(&bad), 3, "`may` is a prefix, `h` is not");
    for &t in &toks {
        m.accept(t).unwrap();
    }
    assert!(m.mask().unwrap().allows(EOS), "a complete sentence may end");
    assert!(m.accept(TokenId(b'x' as u32)).is_err());
}

#[test]
fn bad_schemas_regexes_and_grammars_are_invalid() {
    let g = grammars();
    let invalid = |c: Constraint| match g.compile(&c) {
        Err(ConstraintError::Invalid(msg)) => msg,
        other => panic!("{c:?} compiled: {other:?}"),
    };
    let schema = |s: &str, strict| Constraint::JsonSchema {
        schema: s.into(),
        strict,
    };
    assert!(invalid(schema("{not json", true)).contains("not JSON"));
    assert!(invalid(schema("[1, 2]", true)).contains("object"));
    invalid(schema(r#"{"type": "wat"}"#, true));
    // An unsupported keyword is refused under strict, ignored otherwise.
    let unsupported = r#"{"type": "array", "uniqueItems": true}"#;
    invalid(schema(unsupported, true));
    assert!(g.compile(&schema(unsupported, false)).is_ok());
    invalid(schema(r#"{"x-guidance": {}}"#, false));
    invalid(Constraint::Regex("(unclosed".into()));
    invalid(Constraint::Lark("start: undefined_rule".into()));
}

#[test]
fn a_mask_sets_disallowed_logits_to_minus_infinity() {
    let g = grammars();
    let mut m = g.compile(&Constraint::Regex("ab?".into())).unwrap();
    let mask = m.mask().unwrap();
    assert_eq!(mask.count(), 1);
    let mut logits = vec![1.0f32; g.vocab_size() + 3];
    mask.apply(&mut logits);
    let finite: Vec<usize> = (0..logits.len())
        .filter(|&i| logits[i].is_finite())
        .collect();
    assert_eq!(finite, vec![b'a' as usize]);
}

#[test]
fn a_cached_constraint_gives_independent_matchers() {
    let g = grammars();
    let c = Constraint::Regex("(ab|cd)e".into());
    let mut first = g.compile(&c).unwrap();
    first.accept(TokenId(b'a' as u32)).unwrap();
    // The second comes from the cache, at the start, whatever the first did.
    let mut second = g.compile(&c).unwrap();
    let m = second.mask().unwrap();
    assert!(m.allows(TokenId(b'c' as u32)) && m.allows(TokenId(b'a' as u32)));
    assert!(!m.allows(TokenId(b'b' as u32)));
    second.accept(TokenId(b'c' as u32)).unwrap();
    let m = first.mask().unwrap();
    assert!(m.allows(TokenId(b'b' as u32)) && !m.allows(TokenId(b'd' as u32)));
    assert_eq!((first.accepted(), second.accepted()), (1, 1));
}
