//! Constrained decoding on the real model: every output follows its
//! constraint, speculation does not change constrained greedy output, and
//! bad constraints are refused before they are queued.

use siliceo_core::{Constraint, FinishReason, SamplingParams, TokenId};
use siliceo_runtime::Message as ChatMessage;
use siliceo_runtime::{
    Event, GenerateRequest, Input, Runtime, RuntimeConfig, RuntimeError, SpeculativeConfig,
};

use super::{assert_clean, model_path, usage_of};

const PERSON: &str = r#"{
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": false
        }
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": false
}"#;

fn chat(text: &str) -> Input {
    Input::Chat(vec![ChatMessage::new("user", text)])
}

fn constrained(input: Input, c: Constraint, sampling: SamplingParams) -> GenerateRequest {
    GenerateRequest {
        sampling,
        constraint: Some(c),
        ..GenerateRequest::new(input)
    }
}

fn person() -> Constraint {
    Constraint::JsonSchema {
        schema: PERSON.into(),
        strict: true,
    }
}

fn text_and_tokens(rt: &Runtime, req: GenerateRequest) -> (String, Vec<TokenId>, FinishReason) {
    let (text, tokens, done) = rt.submit(req).unwrap().blocking_collect();
    let Event::Done { finish_reason, .. } = done else {
        panic!("no Done event")
    };
    (text, tokens, finish_reason)
}

fn check_person(out: &str) {
    let v: serde_json::Value =
        serde_json::from_str(out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"));
    let o = v.as_object().unwrap();
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["address", "age", "name", "role", "tags"], "{out}");
    assert!((0..=120).contains(&o["age"].as_i64().unwrap()), "{out}");
    assert!(
        ["admin", "user", "guest"].contains(&o["role"].as_str().unwrap()),
        "{out}"
    );
    assert!(
        (1..=3).contains(&o["tags"].as_array().unwrap().len()),
        "{out}"
    );
    let zip = o["address"]["zip"].as_str().unwrap();
    assert!(
        zip.len() == 5 && zip.bytes().all(|b| b.is_ascii_digit()),
        "{out}"
    );
}

#[test]
fn sampled_outputs_follow_a_json_schema_a_regex_and_a_grammar() {
    let rt = Runtime::start(RuntimeConfig::new(model_path())).unwrap();
    let prompt = "Describe a made-up user of a web shop as JSON.";
    let streams: Vec<_> = (0..6)
        .map(|i| {
            let s = SamplingParams {
                temperature: 0.9,
                seed: Some(100 + i),
                max_tokens: 200,
                ..SamplingParams::greedy()
            };
            rt.submit(constrained(chat(prompt), person(), s)).unwrap()
        })
        .collect();
    for s in streams {
        let (text, _, done) = s.blocking_collect();
        let Event::Done { finish_reason, .. } = done else {
            panic!()
        };
        assert_eq!(finish_reason, FinishReason::Stop, "{text}");
        check_person(&text);
    }
    let date = Constraint::Regex("(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])".into());
    let s = SamplingParams {
        temperature: 1.0,
        seed: Some(5),
        max_tokens: 30,
        ..SamplingParams::greedy()
    };
    let (text, _, reason) = text_and_tokens(
        &rt,
        constrained(
            chat("When did the Apollo 11 landing happen?"),
            date,
            s.clone(),
        ),
    );
    assert_eq!(reason, FinishReason::Stop);
    let b = text.as_bytes();
    assert!(b.len() == 10 && b[4] == b'-' && b[7] == b'-', "{text}");
    let lark = r#"start: answer " because " reason
answer: "yes" | "no"
reason: /[a-z ]{1,40}/"#;
    let (text, _, reason) = text_and_tokens(
        &rt,
        constrained(chat("Is the sky blue?"), Constraint::Lark(lark.into()), s),
    );
    assert_eq!(reason, FinishReason::Stop);
    let (answer, why) = text
        .split_once(" because ")
        .unwrap_or_else(|| panic!("{text}"));
    assert!(answer == "yes" || answer == "no", "{text}");
    assert!(!why.is_empty() && why.len() <= 40, "{text}");
    assert!(
        why.bytes().all(|b| b == b' ' || b.is_ascii_lowercase()),
        "{text}"
    );
    let st = rt.stats().unwrap();
    assert!(
        st.constraint_masks > 0 && st.constraint_masks_overlapped > 0,
        "{st:?}"
    );
    assert_clean(&rt);
}

#[test]
fn constrained_greedy_output_is_the_same_with_speculation_alone_and_together() {
    let mut cfg = RuntimeConfig::new(model_path());
    cfg.speculative = Some(SpeculativeConfig {
        cost_switch_off: false,
        ..Default::default()
    });
    let rt = Runtime::start(cfg).unwrap();
    // Repetitive JSON gives the n-gram drafter something to propose.
    let prompts = [
        "List three users of a web shop as JSON, one per line.",
        "Describe the admin user of a web shop as JSON.",
        "Describe a guest user as JSON. The guest user is called Guest.",
    ];
    let greedy = SamplingParams {
        max_tokens: 160,
        ..SamplingParams::greedy()
    };
    let req = |p: &str, speculative: bool| GenerateRequest {
        speculative,
        ..constrained(chat(p), person(), greedy.clone())
    };
    let plain: Vec<_> = prompts
        .iter()
        .map(|p| text_and_tokens(&rt, req(p, false)))
        .collect();
    let (mut drafted, mut accepted) = (0, 0);
    for (p, want) in prompts.iter().zip(&plain) {
        let (text, tokens, done) = rt.submit(req(p, true)).unwrap().blocking_collect();
        let u = usage_of(&done);
        drafted += u.draft_tokens;
        accepted += u.accepted_draft_tokens;
        assert_eq!(
            tokens, want.1,
            "speculation changed {text:?} (was {:?})",
            want.0
        );
        check_person(&text);
    }
    let together: Vec<_> = prompts
        .iter()
        .map(|p| rt.submit(req(p, true)).unwrap())
        .collect();
    for (s, want) in together.into_iter().zip(&plain) {
        let (text, tokens, _) = s.blocking_collect();
        assert_eq!(tokens, want.1, "batched speculation changed {text:?}");
    }
    eprintln!("constrained n-gram speculation: {accepted} of {drafted} drafted tokens accepted");
    assert!(drafted > 0, "the drafter proposed nothing to check");
    assert_clean(&rt);
}

#[test]
fn bad_constraints_are_refused_naming_their_field_and_nothing_leaks() {
    let rt = Runtime::start(RuntimeConfig::new(model_path())).unwrap();
    let cases = [
        (
            Constraint::JsonSchema {
                schema: "{\"type\": \"objekt\"}".into(),
                strict: true,
            },
            "response_format",
        ),
        (Constraint::Regex("([a-z]+".into()), "regex"),
        (Constraint::Lark("start: missing".into()), "grammar"),
    ];
    for (c, field) in cases {
        let mut r = constrained(chat("hi"), c.clone(), SamplingParams::greedy());
        r.constraint_field = field;
        match rt.submit(r) {
            Err(RuntimeError::InvalidRequest { field: f, reason }) => {
                assert_eq!(f, field, "{reason}");
                assert!(!reason.is_empty());
            }
            other => panic!("{c:?}: {other:?}"),
        }
    }
    // Still serving, constrained and not.
    let (text, _, _) = text_and_tokens(
        &rt,
        constrained(
            chat("Say yes or no."),
            Constraint::Regex("yes|no".into()),
            SamplingParams::greedy(),
        ),
    );
    assert!(text == "yes" || text == "no", "{text}");
    // A cancelled constrained request frees its KV.
    let s = rt
        .submit(constrained(
            chat("Describe a user as JSON."),
            person(),
            SamplingParams::greedy(),
        ))
        .unwrap();
    drop(s);
    let _ = rt.stats();
    assert_clean(&rt);
}
