//! Templates rendered as `transformers` renders them (Qwen2.5's tool
//! instructions really do show `{{"name": …}}` with doubled braces: they are
//! inside a string literal). The expected strings
//! follow the Qwen2.5 template's text by hand (its source is in
//! `testdata_qwen25.jinja`, as its GGUF carries it).

use super::*;
use crate::testing::{Xorshift, read_alike_at_every_cut, read_alike_cut_at_random};

const QWEN: &str = include_str!("testdata_qwen25.jinja");

fn qwen() -> ChatTemplate {
    ChatTemplate::new(QWEN, "<|endoftext|>", "<|im_end|>").unwrap()
}

fn weather() -> Tool {
    Tool {
        name: "get_weather".into(),
        description: Some("Current weather in a city".into()),
        parameters: r#"{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}"#.into(),
    }
}

#[test]
fn qwen_renders_a_plain_chat() {
    let text = qwen()
        .render(&[Message::new("user", "Hi")], &[], true)
        .unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn qwen_renders_tools_calls_and_answers() {
    let t = qwen();
    assert_eq!(t.tool_syntax(), Some(ToolSyntax::Hermes));
    let call = ToolCall {
        id: "call_1".into(),
        name: "get_weather".into(),
        arguments: r#"{"city":"Paris"}"#.into(),
    };
    let msgs = [
        Message::new("system", "Be brief."),
        Message::new("user", "Weather in Paris?"),
        Message {
            role: "assistant".into(),
            tool_calls: vec![call],
            ..Message::default()
        },
        Message {
            role: "tool".into(),
            content: Some("18C, sunny".into()),
            tool_call_id: Some("call_1".into()),
            ..Message::default()
        },
    ];
    let text = t.render(&msgs, &[weather()], true).unwrap();
    let tool_json = r#"{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}"#;
    let want = format!(
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tool_json}\n</tools>\n\n\
         For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n\
         <tool_call>\n{{{{\"name\": <function-name>, \"arguments\": <args-json-object>}}}}\n</tool_call><|im_end|>\n\
         <|im_start|>user\nWeather in Paris?<|im_end|>\n\
         <|im_start|>assistant\n<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Paris\"}}}}\n</tool_call><|im_end|>\n\
         <|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(text, want);
}

#[test]
fn errors_are_typed() {
    assert!(matches!(
        ChatTemplate::new("{% for %}", "", ""),
        Err(ChatError::Template(_))
    ));
    let strict = ChatTemplate::new(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be the user') }}{% endif %}ok",
        "",
        "",
    )
    .unwrap();
    match strict.render(&[Message::new("assistant", "x")], &[], true) {
        Err(ChatError::Render(m)) => assert!(m.contains("first message must be the user"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        strict.render(&[Message::new("user", "x")], &[weather()], true),
        Err(ChatError::NoToolSyntax)
    );
    // Python's string methods work (pycompat).
    let py = ChatTemplate::new("{{ messages[0].content.strip().upper() }}", "", "").unwrap();
    assert_eq!(
        py.render(&[Message::new("user", "  hi ")], &[], false)
            .unwrap(),
        "HI"
    );
}

#[test]
fn hermes_calls_parse_and_prose_stays() {
    let s = ToolSyntax::Hermes;
    let out = s.parse(
        "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
         <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>",
        &[],
    );
    assert_eq!(out.content, "Let me check.");
    assert_eq!(
        out.calls,
        vec![
            ("get_weather".into(), r#"{"city": "Paris"}"#.into()),
            ("get_weather".into(), r#"{"city": "Rome"}"#.into())
        ]
    );
    // Not JSON: prose, no call.
    let out = s.parse("<tool_call>\nnot json\n</tool_call>", &[]);
    assert!(out.calls.is_empty() && out.content.contains("not json"));
    assert_eq!(s.parse("Paris is sunny.", &[]).content, "Paris is sunny.");
    // An unclosed last block still counts (generation stopped at EOS).
    let out = s.parse("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}", &[]);
    assert_eq!(out.calls, vec![("f".into(), "{}".into())]);
}

/// Granite 3's calls: a JSON list after `<|tool_call|>`, in either key
/// order; its template (as the model ships it) is recognised, and gets a
/// call's arguments as text.
#[test]
fn granite_calls_parse() {
    let n = CALL_TEXTS.len();
    let out = ToolSyntax::Granite.parse(CALL_TEXTS[n - 3].1, &[]);
    assert_eq!(
        out.calls,
        [
            // Read whole (another key order), its arguments as written.
            ("get_weather".into(), r#"{"city": "Boston"}"#.into()),
            ("now".into(), "{}".into())
        ]
    );
    let cut = ToolSyntax::Granite.parse(CALL_TEXTS[n - 2].1, &[]);
    assert!(
        cut.cut_short && cut.calls[0].1 == r#"{"city": "Bos"#,
        "{cut:?}"
    );
    let t = ChatTemplate::new(include_str!("testdata_granite33.jinja"), "", "").unwrap();
    assert_eq!(t.tool_syntax(), Some(ToolSyntax::Granite));
    assert_eq!(t.thinking_switch(), Some("thinking"));
    assert!(!t.thinking_on(&serde_json::Map::new()));
    let text = t
        .render(&[Message::new("user", "Weather?")], &[weather()], true)
        .unwrap();
    assert!(
        text.contains("<|tool_call|>") && text.contains("\"get_weather\""),
        "{text}"
    );
}

/// Nemotron Nano 2's calls: a JSON list in `<TOOLCALL>` tags; its
/// template (as the model ships it) is recognised, and a call it renders
/// reads back as the call.
#[test]
fn nemotron_calls_parse() {
    let out = ToolSyntax::Nemotron.parse(CALL_TEXTS[CALL_TEXTS.len() - 1].1, &[]);
    assert_eq!(out.content, "Let me look.");
    assert_eq!(
        out.calls,
        [("get_weather".into(), r#"{"city": "Oslo"}"#.into())]
    );
    let t = ChatTemplate::new(include_str!("testdata_nemotron_nano2.jinja"), "", "").unwrap();
    assert_eq!(t.tool_syntax(), Some(ToolSyntax::Nemotron));
    let [call, result] = long_id_call();
    let chat = [Message::new("user", "Weather?"), call, result];
    let text = t.render(&chat, &[weather()], true).unwrap();
    let at = text.rfind("<TOOLCALL>").expect("the call is rendered");
    let read = ToolSyntax::Nemotron.parse(&text[at..], &[]);
    assert_eq!(read.calls[0].0, "get_weather");
    let args: serde_json::Value = serde_json::from_str(&read.calls[0].1).unwrap();
    assert_eq!(args, serde_json::json!({"city": "Paris"}));
}

#[test]
fn mistral_calls_parse() {
    let out = ToolSyntax::Mistral.parse(
        "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}, {\"name\": \"now\", \"arguments\": {}}]",
        &[],
    );
    assert_eq!(out.content, "");
    assert_eq!(out.calls.len(), 2);
    assert_eq!(
        out.calls[0],
        ("get_weather".into(), r#"{"city": "Oslo"}"#.into())
    );
    assert_eq!(
        ToolSyntax::detect("{{ '[TOOL_CALLS]' }}"),
        Some(ToolSyntax::Mistral)
    );
    assert_eq!(
        ToolSyntax::detect("{{ '[TOOL_CALLS]' + c.name + '[ARGS]' + c.arguments }}"),
        Some(ToolSyntax::MistralArgs)
    );
    assert_eq!(
        ToolSyntax::detect("{{ '<tool_call>\n<function=' + c.name + '>' }}"),
        Some(ToolSyntax::QwenXml)
    );
    assert_eq!(ToolSyntax::detect("{{ m.content }}"), None);
}

/// DeepSeek's calls: V3.1's `NAME<｜tool▁sep｜>{…}` and R1's
/// `function<｜tool▁sep｜>NAME` with the arguments in a JSON fence, each
/// after the list's opening or a call's; text before the list is the
/// answer, and the syntax is read from the template.
#[test]
fn deepseek_calls_parse() {
    let at = |syntax| CALL_TEXTS.iter().position(|&(s, _)| s == syntax).unwrap();
    let v31 = ToolSyntax::DeepSeek.parse(CALL_TEXTS[at(ToolSyntax::DeepSeek)].1, &[]);
    assert_eq!(v31.content, "Checking.");
    assert_eq!(
        v31.calls,
        [
            ("get_weather".into(), r#"{"city": "Pa}ris"}"#.into()),
            ("now".into(), "{}".into())
        ]
    );
    assert!(!v31.cut_short);
    let cut = ToolSyntax::DeepSeek.parse(CALL_TEXTS[at(ToolSyntax::DeepSeek) + 1].1, &[]);
    assert!(cut.cut_short && cut.calls.len() == 1, "{cut:?}");
    let text = CALL_TEXTS[at(ToolSyntax::DeepSeek) + 2].1;
    assert_eq!(ToolSyntax::DeepSeek.parse(text, &[]).content, text);
    let r1 = ToolSyntax::DeepSeekR1.parse(CALL_TEXTS[at(ToolSyntax::DeepSeekR1)].1, &[]);
    assert_eq!(r1.content, "");
    assert_eq!(
        r1.calls,
        [
            ("get_weather".into(), r#"{"city": "Oslo"}"#.into()),
            ("now".into(), "{}".into())
        ]
    );
    // Only the first call when parallel calls are off.
    let one = ToolSyntax::DeepSeekR1.parse_single(CALL_TEXTS[at(ToolSyntax::DeepSeekR1)].1, &[]);
    assert_eq!(one.calls.len(), 1);
    let t = ChatTemplate::new(include_str!("testdata_deepseek_v31.jinja"), "<s>", "</s>").unwrap();
    assert_eq!(t.tool_syntax(), Some(ToolSyntax::DeepSeek));
    assert_eq!(
        ToolSyntax::detect(
            "{{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] \
             + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```'}}"
        ),
        Some(ToolSyntax::DeepSeekR1)
    );
    // What V3.1's template writes for an assistant's call reads back.
    let [call, result] = long_id_call();
    let text = t
        .render(
            &[Message::new("user", "Weather?"), call, result],
            &[],
            false,
        )
        .unwrap();
    let written = &text[text.find("<｜tool▁calls▁begin｜>").unwrap()..];
    let read = ToolSyntax::DeepSeek.parse(written, &[]);
    assert_eq!(read.calls.len(), 1, "{written}");
    assert_eq!(read.calls[0].0, "get_weather");
    let args: serde_json::Value = serde_json::from_str(&read.calls[0].1).unwrap();
    assert_eq!(args, serde_json::json!({"city": "Paris"}));
}

/// Command R's calls: a JSON list in `<|START_ACTION|>` tags, each item
/// led by its id and naming its function `tool_name`; streamed as written.
#[test]
fn command_r_calls_parse() {
    let text = CALL_TEXTS
        .iter()
        .find(|&&(s, _)| s == ToolSyntax::CommandR)
        .unwrap()
        .1;
    let out = ToolSyntax::CommandR.parse(text, &[]);
    assert_eq!(
        out.calls,
        [
            ("get_weather".into(), r#"{"city": "Lima"}"#.into()),
            ("now".into(), "{}".into())
        ]
    );
    // The name goes out before the arguments are written.
    let (pieces, _) = streamed(ToolSyntax::CommandR, &[&text[..text.find("Lima").unwrap()]]);
    assert_eq!(pieces[0], CallPiece::Call("get_weather".into()));
    assert_eq!(
        ToolSyntax::detect("{{ '<|START_ACTION|>' + calls | tojson + '<|END_ACTION|>' }}"),
        Some(ToolSyntax::CommandR)
    );
    assert_eq!(
        ThinkTags::of_template("{{ '<|START_THINKING|>' + m.thinking + '<|END_THINKING|>' }}"),
        Some(ThinkTags::COHERE)
    );
}

/// Gemma 4's calls: its notation read as JSON (bare keys quoted, its
/// quoted strings escaped, nested values kept), streamed as written; its
/// template detected, with its thinking channel; a call it writes for an
/// assistant reads back as the arguments given.
#[test]
fn gemma4_calls_parse_as_json() {
    let at = CALL_TEXTS
        .iter()
        .position(|&(s, _)| s == ToolSyntax::Gemma4)
        .unwrap();
    let json = |s: &str| serde_json::from_str::<serde_json::Value>(s).expect(s);
    let two = ToolSyntax::Gemma4.parse(CALL_TEXTS[at].1, &[]);
    assert_eq!(two.content, "Checking.");
    assert_eq!(two.calls.len(), 2);
    assert_eq!(two.calls[0].0, "get_weather");
    assert_eq!(
        json(&two.calls[0].1),
        serde_json::json!({"city": "Pa}ris \"x\"", "days": 3})
    );
    assert_eq!(two.calls[1], ("now".into(), "{}".into()));
    assert!(!two.cut_short);
    let nested = ToolSyntax::Gemma4.parse(CALL_TEXTS[at + 1].1, &[]);
    assert_eq!(
        json(&nested.calls[0].1),
        serde_json::json!({
            "flag": true,
            "n": "many",
            "opts": {"a": [1, "x", -2500.0], "b c": null, "j": "q\""},
            "text": "line\n\"two\" \\",
        })
    );
    // Cut inside a string: what was written of it.
    let cut = ToolSyntax::Gemma4.parse(CALL_TEXTS[at + 2].1, &[]);
    assert!(cut.cut_short);
    assert_eq!(cut.calls[0].1, r#"{"text":"half a li"#);
    // A marker that opens no call is text.
    let text = CALL_TEXTS[at + 3].1;
    assert_eq!(ToolSyntax::Gemma4.parse(text, &[]).content, text);
    // The call's end inside its arguments closes them.
    let early = ToolSyntax::Gemma4.parse(CALL_TEXTS[at + 4].1, &[]);
    assert_eq!(
        json(&early.calls[0].1),
        serde_json::json!({"a": 1, "b": {"c": null}})
    );
    // The name goes out before the arguments are written.
    let t0 = CALL_TEXTS[at].1;
    let (pieces, _) = streamed(ToolSyntax::Gemma4, &[&t0[..t0.find("city").unwrap()]]);
    assert_eq!(pieces[1], CallPiece::Call("get_weather".into()));

    let t = ChatTemplate::new(include_str!("testdata_gemma4.jinja"), "<bos>", "<eos>").unwrap();
    assert_eq!(t.tool_syntax(), Some(ToolSyntax::Gemma4));
    assert_eq!(t.think_tags(), Some(ThinkTags::GEMMA4));
    assert_eq!(t.thinking_switch(), Some(ChatTemplate::THINKING_SWITCH));
    // Off unless asked for: its prompt then closes an empty thought.
    assert!(!t.thinking_on(&serde_json::Map::new()));
    let hi = t.render(&[Message::new("user", "Hi")], &[], true).unwrap();
    assert!(
        hi.ends_with("<|turn>model\n<|channel>thought\n<channel|>"),
        "{hi}"
    );
    // A call with nested and quoted arguments, and its result.
    let args = serde_json::json!({
        "city": "São \"Paulo\"",
        "days": 3,
        "opts": {"metric": true, "hours": [6, 12]},
    });
    let call = Message {
        role: "assistant".into(),
        tool_calls: vec![ToolCall {
            id: "call_0".into(),
            name: "get_weather".into(),
            arguments: args.to_string(),
        }],
        ..Message::default()
    };
    let result = Message {
        role: "tool".into(),
        content: Some("{\"temp\": 21}".into()),
        tool_call_id: Some("call_0".into()),
        ..Message::default()
    };
    let text = t
        .render(
            &[Message::new("user", "Weather?"), call, result],
            &[weather()],
            true,
        )
        .unwrap();
    let written = &text[text.find("<|tool_call>").unwrap()..];
    assert!(
        written.contains("<|tool_response>response:get_weather{"),
        "{text}"
    );
    let read = ToolSyntax::Gemma4.parse(written, &[]);
    assert_eq!(read.calls.len(), 1, "{written}");
    assert_eq!(read.calls[0].0, "get_weather");
    assert_eq!(json(&read.calls[0].1), args, "{written}");
}

/// Calls written as Python (LFM2's): keyword arguments read as JSON,
/// strings in either quote with their escapes, Python's constants and
/// numbers, tuples as lists; several calls in one list; streamed as
/// written; LFM2's and LFM2.5's templates known.
#[test]
fn python_calls_parse_as_json() {
    let at = CALL_TEXTS
        .iter()
        .position(|&(s, _)| s == ToolSyntax::Lfm2)
        .unwrap();
    let json = |s: &str| serde_json::from_str::<serde_json::Value>(s).expect(s);
    let two = ToolSyntax::Lfm2.parse(CALL_TEXTS[at].1, &[]);
    assert_eq!(two.content, "Let me check.");
    assert_eq!(
        two.calls,
        [
            (
                "get_weather".into(),
                r#"{"city": "Paris", "days": 3}"#.into()
            ),
            ("now".into(), "{}".into())
        ]
    );
    let typed = ToolSyntax::Lfm2.parse(CALL_TEXTS[at + 1].1, &[]);
    assert_eq!(
        json(&typed.calls[0].1),
        serde_json::json!({"text": "it's \"x\"\n\u{e9}\\q", "flag": true,
            "opts": {"a": [1, [2, 3]], "b": null}, "n": 1000, "ratio": 0.5, "word": "many"})
    );
    let cut = ToolSyntax::Lfm2.parse(CALL_TEXTS[at + 2].1, &[]);
    assert!(cut.cut_short);
    assert_eq!(cut.calls[0].1, r#"{"text": "half a li"#);
    let text = CALL_TEXTS[at + 3].1;
    assert_eq!(ToolSyntax::Lfm2.parse(text, &[]).content, text);
    let loose = ToolSyntax::Lfm2.parse(CALL_TEXTS[at + 4].1, &[]);
    assert_eq!(
        json(&loose.calls[0].1),
        serde_json::json!({"0": 1, "1": "two", "x": true, "y": null, "z": null})
    );
    // The name goes out before the arguments are written.
    let t0 = CALL_TEXTS[at].1;
    let (pieces, _) = streamed(ToolSyntax::Lfm2, &[&t0[..t0.find("Paris").unwrap()]]);
    assert_eq!(pieces[1], CallPiece::Call("get_weather".into()));
    for template in [
        "{{ '<|tool_list_start|>' + tools | tojson + '<|tool_list_end|>' }}",
        "{{ 'List of tools: [' + tools | map('tojson') | join(', ') + ']' }}",
    ] {
        assert_eq!(ToolSyntax::detect(template), Some(ToolSyntax::Lfm2));
    }
}

/// A template that writes calls as GLM's do, in GLM-4.5's layout (or,
/// `compact`, GLM-4.7's): `<|user|>` and `<|assistant|>` turns, results
/// in `<|observation|>` ones.
fn glm_template(compact: bool) -> String {
    let nl = if compact { "" } else { "{{ '\\n' }}" };
    format!(
        "{{%- for m in messages -%}}\
         {{%- if m.role == 'user' -%}}<|user|>\n{{{{ m.content }}}}\
         {{%- elif m.role == 'assistant' -%}}<|assistant|>\n{{{{ m.content or '' }}}}\
         {{%- for tc in m.tool_calls or [] -%}}{{{{ '<tool_call>' + tc.function.name }}}}\
         {{%- for k, v in tc.function.arguments.items() -%}}{nl}<arg_key>{{{{ k }}}}</arg_key>{nl}\
         <arg_value>{{{{ v | tojson if v is not string else v }}}}</arg_value>\
         {{%- endfor -%}}{nl}</tool_call>{{%- endfor -%}}\
         {{%- elif m.role == 'tool' -%}}<|observation|>\n<tool_response>\n{{{{ m.content }}}}\n</tool_response>\
         {{%- endif -%}}{{%- endfor -%}}\
         {{%- if add_generation_prompt -%}}<|assistant|>\n{{%- endif -%}}"
    )
}

/// GLM's calls: each value text typed by the tool's schema, a string's
/// streamed as written, both layouts read alike; the layout is told from
/// the template, and a call it writes reads back.
#[test]
fn glm_calls_parse_as_typed_json() {
    let at = CALL_TEXTS
        .iter()
        .position(|&(s, _)| s == ToolSyntax::Glm45)
        .unwrap();
    let json = |s: &str| serde_json::from_str::<serde_json::Value>(s).expect(s);
    let tools = xml_tools();
    let two = ToolSyntax::Glm45.parse(CALL_TEXTS[at].1, &tools);
    assert_eq!(two.content, "Sure.");
    assert_eq!(
        two.calls,
        [
            (
                "get_weather".into(),
                r#"{"city": "Paris", "days": 3}"#.into()
            ),
            ("now".into(), "{}".into())
        ]
    );
    let typed = ToolSyntax::Glm47.parse(CALL_TEXTS[at + 1].1, &tools);
    assert_eq!(
        json(&typed.calls[0].1),
        serde_json::json!({"text": "line \"one\"\n<b>two</b>", "flag": true,
            "opts": {"a": [1]}, "n": "many"})
    );
    let cut = ToolSyntax::Glm47.parse(CALL_TEXTS[at + 2].1, &tools);
    assert!(cut.cut_short);
    assert_eq!(cut.calls[0].1, r#"{"text": "half a li"#);
    let text = CALL_TEXTS[at + 3].1;
    assert_eq!(ToolSyntax::Glm45.parse(text, &tools).content, text);
    // A JSON call in the tags (as Hermes writes one) is read too.
    let hermes = r#"<tool_call>{"name": "now", "arguments": {}}</tool_call>"#;
    assert_eq!(ToolSyntax::Glm45.parse(hermes, &tools).calls.len(), 1);
    for (compact, syntax) in [(false, ToolSyntax::Glm45), (true, ToolSyntax::Glm47)] {
        let t = ChatTemplate::new(&glm_template(compact), "", "").unwrap();
        assert_eq!(t.tool_syntax(), Some(syntax));
        let [call, result] = long_id_call();
        let rendered = t
            .render(
                &[Message::new("user", "Weather?"), call, result],
                &[],
                false,
            )
            .unwrap();
        let written = &rendered[rendered.find("<tool_call>").unwrap()..];
        let read = syntax.parse(written, &[weather()]);
        assert_eq!(read.calls.len(), 1, "{written}");
        assert_eq!(json(&read.calls[0].1), serde_json::json!({"city": "Paris"}));
    }
}

#[test]
fn forced_calls_are_lark_grammars_with_the_tools_schemas() {
    let tools = [
        weather(),
        Tool {
            name: "now".into(),
            description: None,
            parameters: r#"{"type": "object", "properties": {}}"#.into(),
        },
    ];
    let s = ToolSyntax::Hermes;
    assert_eq!(s.constraint(&tools, &ToolChoice::Auto, true), None);
    assert_eq!(
        s.constraint(&tools, &ToolChoice::Function("nope".into()), true),
        None
    );
    let Some(Constraint::Lark(g)) =
        s.constraint(&tools, &ToolChoice::Function("now".into()), false)
    else {
        panic!()
    };
    assert!(g.starts_with("start: call\n"), "{g}");
    assert!(
        g.contains(r#""const":"now""#) && !g.contains("get_weather"),
        "{g}"
    );
    let Some(Constraint::Lark(g)) = s.constraint(&tools, &ToolChoice::Required, true) else {
        panic!()
    };
    assert!(
        g.contains("(\"\\n\" call)*") && g.contains("get_weather") && g.contains("\"now\""),
        "{g}"
    );
}

#[test]
fn hermes_accepts_fenced_json_calls_but_not_plain_json_data() {
    let s = ToolSyntax::Hermes;
    let out = s.parse(
        "```json\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n```",
        &[],
    );
    assert_eq!(
        out.calls,
        vec![("get_weather".into(), r#"{"city": "Paris"}"#.into())]
    );
    let data = "```json\n{\"name\": \"Bob\", \"age\": 3}\n```";
    assert_eq!(s.parse(data, &[]).calls, vec![]);
    assert_eq!(s.parse(data, &[]).content, data);
    // From the first call on, the output is calls: prose between blocks
    // is dropped (a stream has sent the first call before it is written).
    let mixed = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\nand then\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>";
    let out = s.parse(mixed, &[]);
    assert_eq!(out.content, "");
    assert_eq!(
        out.calls,
        vec![("f".into(), "{}".into()), ("g".into(), "{}".into())]
    );
}

/// Texts with calls in every shape the reader knows.
const CALL_TEXTS: &[(ToolSyntax, &str)] = &[
    (
        ToolSyntax::Hermes,
        "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Ro}]me\\\"\"}}\n</tool_call>",
    ),
    (
        ToolSyntax::Hermes,
        "Voilà — <tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": \"héllo <tool_call>\", \"n\": [1, {\"a\": null}]}, \"id\": \"x}\"}\n</tool_call> trailing",
    ),
    (
        ToolSyntax::Hermes,
        "<tool_call>\nnot json\n</tool_call> and more",
    ),
    (
        ToolSyntax::Hermes,
        "```json\n{\"name\": \"Bob\", \"age\": 3}\n```",
    ),
    (
        ToolSyntax::Hermes,
        "<tool_call>\n{\"arguments\": {\"a\": 1}, \"name\": \"f\"}\n</tool_call>",
    ),
    (
        ToolSyntax::Hermes,
        "<tool_call>\n{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}\n</tool_call>",
    ),
    (
        ToolSyntax::Hermes,
        "<tool_call>\n[{\"name\": \"f\", \"arguments\": {}}, {\"name\": \"g\", \"arguments\": 7}]\n</tool_call>",
    ),
    (
        ToolSyntax::Hermes,
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"city\": \"Par",
    ),
    (ToolSyntax::Hermes, "No call here, just <tool_ca"),
    (
        ToolSyntax::Mistral,
        "[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {\"x\": [1, 2]}}, {\"name\": \"b\", \"parameters\": {}}]",
    ),
    (
        ToolSyntax::Llama3Json,
        "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
    ),
    (
        ToolSyntax::Llama3Json,
        " {\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": 1}} and text",
    ),
    (ToolSyntax::Llama3Json, "{\"answer\": 42}"),
    (
        ToolSyntax::Llama3Json,
        "It is {\"name\": \"f\", \"parameters\": {}}",
    ),
    (ToolSyntax::Llama3Json, "{\"name\": \"f\", \"param"),
    (
        ToolSyntax::QwenXml,
        "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>",
    ),
    (
        ToolSyntax::QwenXml,
        "<function=write>\n<parameter=text>\nline \"one\"\n<b>two</b>\n\n</parameter>\n<parameter=flag>\nTrue\n</parameter>\n<parameter=opts>\n{\"a\": [1]}\n</parameter>\n<parameter=n>\nmany\n</parameter>\n</function>",
    ),
    (
        ToolSyntax::QwenXml,
        "<tool_call>\n<function=write>\n<parameter=text>\nhalf a li",
    ),
    (ToolSyntax::QwenXml, "<tool_call>\n<function=wri"),
    (
        ToolSyntax::Hermes,
        "<tool_call>\n[{\"name\": \"f\", \"arguments\": {}}, {\"arguments\": {\"b\": \"}\"}, \"name\": \"g\"}, 3, {\"name\": \"h\", \"arguments\": {}}]\n</tool_call>",
    ),
    (
        ToolSyntax::Llama3Json,
        "{\"name\": \"a\", \"parameters\": {}}; {\"parameters\": {\"x\": 1}, \"name\": \"b\"}",
    ),
    (
        ToolSyntax::MistralArgs,
        "Sure.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Pa}ris\"} [TOOL_CALLS]now[ARGS]{}",
    ),
    (
        ToolSyntax::MistralArgs,
        "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Par",
    ),
    (ToolSyntax::MistralArgs, "[TOOL_CALLS] hello there"),
    (
        ToolSyntax::MistralArgs,
        "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}}]",
    ),
    (
        ToolSyntax::DeepSeek,
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Pa}ris\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    ),
    (
        ToolSyntax::DeepSeek,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Par",
    ),
    (
        ToolSyntax::DeepSeek,
        "<｜tool▁calls▁begin｜> is how a list opens",
    ),
    (
        ToolSyntax::DeepSeekR1,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Oslo\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    ),
    (
        ToolSyntax::CommandR,
        "<|START_ACTION|>[\n    {\"tool_call_id\": \"0\", \"tool_name\": \"get_weather\", \"parameters\": {\"city\": \"Lima\"}},\n    {\"tool_call_id\": \"1\", \"tool_name\": \"now\", \"parameters\": {}}\n]<|END_ACTION|>",
    ),
    // Calls written as Python (LFM2).
    (
        ToolSyntax::Lfm2,
        r#"Let me check.<|tool_call_start|>[get_weather(city="Paris", days=3), now()]<|tool_call_end|>"#,
    ),
    (
        ToolSyntax::Lfm2,
        r#"<|tool_call_start|>[write(text='it\'s "x"\n\u00e9\q', flag=True, opts={'a': [1, (2, 3)], 'b': None}, n=1_000, ratio=.5, word=many)]<|tool_call_end|>"#,
    ),
    (
        ToolSyntax::Lfm2,
        r#"<|tool_call_start|>[write(text="half a li"#,
    ),
    (ToolSyntax::Lfm2, "<|tool_call_start|> is how calls open"),
    (
        ToolSyntax::Lfm2,
        "<|tool_call_start|>[f(1, 'two', x=true, y=null, z)]<|tool_call_end|> then text",
    ),
    // GLM's XML arguments, with and without newlines.
    (
        ToolSyntax::Glm45,
        "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>now\n</tool_call>",
    ),
    (
        ToolSyntax::Glm47,
        "<tool_call>write<arg_key>text</arg_key><arg_value>line \"one\"\n<b>two</b></arg_value><arg_key>flag</arg_key><arg_value>True</arg_value><arg_key>opts</arg_key><arg_value>{\"a\": [1]}</arg_value><arg_key>n</arg_key><arg_value>many</arg_value></tool_call>",
    ),
    (
        ToolSyntax::Glm47,
        "<tool_call>write<arg_key>text</arg_key><arg_value>half a li",
    ),
    (ToolSyntax::Glm45, "<tool_call> is how a call opens"),
    // Gemma 4's notation: bare keys, strings between quote tokens.
    (
        ToolSyntax::Gemma4,
        "Checking.<|tool_call>call:get_weather{city:<|\"|>Pa}ris \"x\"<|\"|>,days:3}<tool_call|><|tool_call>call:now{}<tool_call|>",
    ),
    (
        ToolSyntax::Gemma4,
        "<|tool_call>call:write{flag:true,n:many,opts:{a:[1,<|\"|>x<|\"|>,-2.5e3],<|\"|>b c<|\"|>:null,j:\"q\\\"\"},text:<|\"|>line\n\"two\" \\<|\"|>}<tool_call|>",
    ),
    (
        ToolSyntax::Gemma4,
        "<|tool_call>call:write{text:<|\"|>half a li",
    ),
    (ToolSyntax::Gemma4, "<|tool_call> is how a call opens"),
    (
        ToolSyntax::Gemma4,
        "<|tool_call>call:f{a:1,b:{c:<tool_call|> then text",
    ),
    // Granite writes its arguments first: each item is read whole.
    (
        ToolSyntax::Granite,
        "<|tool_call|>[{\"arguments\": {\"city\": \"Boston\"}, \"name\": \"get_weather\"}, {\"name\": \"now\", \"arguments\": {}}]",
    ),
    (
        ToolSyntax::Granite,
        "<|tool_call|>[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Bos",
    ),
    (
        ToolSyntax::Nemotron,
        "Let me look.<TOOLCALL>[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}]</TOOLCALL>",
    ),
];

/// Tools whose schemas type the XML calls' values in [`CALL_TEXTS`].
fn xml_tools() -> Vec<Tool> {
    let tool = |name: &str, props: &str| Tool {
        name: name.into(),
        description: None,
        parameters: format!(r#"{{"type": "object", "properties": {props}}}"#),
    };
    vec![
        tool(
            "get_weather",
            r#"{"city": {"type": "string"}, "days": {"type": ["integer", "null"]}}"#,
        ),
        tool(
            "write",
            r#"{"text": {"type": "string"}, "flag": {"type": "boolean"}, "opts": {"type": "object"}, "n": {"type": "integer"}}"#,
        ),
        tool("now", "{}"),
    ]
}

/// The pieces of `text` fed in `parts`, with neighbours of a kind merged.
fn streamed(syntax: ToolSyntax, parts: &[&str]) -> (Vec<CallPiece>, bool) {
    let mut p = CallParser::new(syntax).with_tools(&xml_tools());
    let mut all: Vec<CallPiece> = Vec::new();
    let pieces = parts.iter().flat_map(|t| p.push(t)).collect::<Vec<_>>();
    for piece in pieces.into_iter().chain(p.finish()) {
        match (all.last_mut(), piece) {
            (Some(CallPiece::Text(a)), CallPiece::Text(b))
            | (Some(CallPiece::Args(a)), CallPiece::Args(b)) => a.push_str(&b),
            (_, piece) => all.push(piece),
        }
    }
    (all, p.cut_short())
}

#[test]
fn calls_read_while_streaming_equal_the_whole_text_read_at_every_cut() {
    for &(syntax, text) in CALL_TEXTS {
        read_alike_at_every_cut(text, |parts| streamed(syntax, parts));
    }
}

#[test]
fn calls_stream_their_arguments_as_written() {
    let whole = |i: usize| streamed(CALL_TEXTS[i].0, &[CALL_TEXTS[i].1]);
    let (pieces, cut) = whole(0);
    assert!(!cut);
    assert_eq!(
        pieces,
        vec![
            CallPiece::Text("Let me check.\n".into()),
            CallPiece::Call("get_weather".into()),
            CallPiece::Args(r#"{"city": "Paris"}"#.into()),
            CallPiece::Call("get_weather".into()),
            CallPiece::Args(r#"{"city": "Ro}]me\""}"#.into()),
        ]
    );
    // Extra keys after the arguments and text after the block are dropped;
    // a marker inside a string is data.
    assert_eq!(
        whole(1).0,
        vec![
            CallPiece::Text("Voilà — ".into()),
            CallPiece::Call("f".into()),
            CallPiece::Args(r#"{"q": "héllo <tool_call>", "n": [1, {"a": null}]}"#.into()),
        ]
    );
    // Not calls: text, as written.
    for i in [2, 3, 8] {
        assert_eq!(whole(i).0, vec![CallPiece::Text(CALL_TEXTS[i].1.into())]);
    }
    // Another key order: read whole, its arguments as written.
    assert_eq!(whole(4).0[1], CallPiece::Args(r#"{"a": 1}"#.into()));
    // Arguments written as a JSON string: the JSON inside.
    assert_eq!(whole(5).0[1], CallPiece::Args(r#"{"a": 1}"#.into()));
    // A list in a block; a scalar argument kept as written.
    assert_eq!(
        whole(6).0,
        vec![
            CallPiece::Call("f".into()),
            CallPiece::Args("{}".into()),
            CallPiece::Call("g".into()),
            CallPiece::Args("7".into()),
        ]
    );
    // Cut short inside the arguments: the call, its arguments so far.
    assert_eq!(
        whole(7),
        (
            vec![
                CallPiece::Call("f".into()),
                CallPiece::Args(r#"{"city": "Par"#.into())
            ],
            true
        )
    );
    assert!(ToolSyntax::Hermes.parse(CALL_TEXTS[7].1, &[]).cut_short);
    assert_eq!(whole(9).0.len(), 4);

    // The name goes out once written, the arguments as they grow.
    let text = CALL_TEXTS[0].1;
    let mut p = CallParser::new(ToolSyntax::Hermes);
    let at = text.find("\"Paris").unwrap();
    let first = p.push(&text[..at]);
    assert_eq!(
        first,
        vec![
            CallPiece::Text("Let me check.\n".into()),
            CallPiece::Call("get_weather".into()),
            CallPiece::Args(r#"{"city": "#.into()),
        ]
    );
}

/// Qwen3-Coder's XML calls: one tag per argument, each value typed by the
/// tool's schema (text that is no value of its type stays a string), a
/// string streamed as written, the outer tag optional.
#[test]
fn xml_calls_read_as_json_arguments() {
    let whole = |i: usize| streamed(CALL_TEXTS[i].0, &[CALL_TEXTS[i].1]);
    assert_eq!(
        whole(15),
        (
            vec![
                CallPiece::Text("I'll check.\n".into()),
                CallPiece::Call("get_weather".into()),
                CallPiece::Args(r#"{"city": "Paris", "days": 3}"#.into()),
                CallPiece::Call("now".into()),
                CallPiece::Args("{}".into()),
            ],
            false
        )
    );
    let (pieces, cut) = whole(16);
    assert!(!cut);
    let CallPiece::Args(args) = &pieces[1] else {
        panic!("{pieces:?}")
    };
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(args).unwrap(),
        serde_json::json!({"text": "line \"one\"\n<b>two</b>\n", "flag": true,
                           "opts": {"a": [1]}, "n": "many"})
    );
    // Cut short inside a string: what was written of it.
    assert_eq!(
        whole(17),
        (
            vec![
                CallPiece::Call("write".into()),
                CallPiece::Args(r#"{"text": "half a li"#.into()),
            ],
            true
        )
    );
    // Later list items in another key order are read whole (serde_json's
    // layout); one that is not an object ends the list.
    assert_eq!(
        whole(19).0,
        vec![
            CallPiece::Call("f".into()),
            CallPiece::Args("{}".into()),
            CallPiece::Call("g".into()),
            CallPiece::Args(r#"{"b": "}"}"#.into()),
        ]
    );
    assert_eq!(
        whole(20).0,
        vec![
            CallPiece::Call("a".into()),
            CallPiece::Args("{}".into()),
            CallPiece::Call("b".into()),
            CallPiece::Args(r#"{"x": 1}"#.into()),
        ]
    );
    // Mistral's newer calls, `[TOOL_CALLS]NAME[ARGS]{…}` each; cut short
    // in the arguments; a marker that no name follows is text; the older
    // list after the marker is still read.
    assert_eq!(
        whole(21).0,
        vec![
            CallPiece::Text("Sure.".into()),
            CallPiece::Call("get_weather".into()),
            CallPiece::Args(r#"{"city": "Pa}ris"}"#.into()),
            CallPiece::Call("now".into()),
            CallPiece::Args("{}".into()),
        ]
    );
    assert_eq!(
        whole(22),
        (
            vec![
                CallPiece::Call("get_weather".into()),
                CallPiece::Args(r#"{"city": "Par"#.into()),
            ],
            true
        )
    );
    assert_eq!(whole(23).0, vec![CallPiece::Text(CALL_TEXTS[23].1.into())]);
    assert_eq!(
        whole(24).0,
        vec![
            CallPiece::Call("f".into()),
            CallPiece::Args(r#"{"a": 1}"#.into()),
        ]
    );
    // Cut short in the name: text, as written.
    assert_eq!(whole(18).0, vec![CallPiece::Text(CALL_TEXTS[18].1.into())]);
    // A string's text goes out before its closing tag is written.
    let mut p = CallParser::new(ToolSyntax::QwenXml).with_tools(&xml_tools());
    p.push("<tool_call>\n<function=write>\n<parameter=text>\nab");
    assert_eq!(
        p.push("c\nd\n</para"),
        vec![CallPiece::Args(r"c\nd".into())]
    );
    // Without the tools' schemas every value is a string.
    assert_eq!(
        ToolSyntax::QwenXml.parse(CALL_TEXTS[15].1, &[]).calls[0].1,
        r#"{"city": "Paris", "days": "3"}"#
    );
}

/// Qwen3-Coder's own template (as its model card's `chat_template.jinja`
/// ships it): its syntax is known, and a call it renders reads back as the
/// call (the runtime's tests check that the forcing grammar takes it).
#[test]
fn qwen3_coder_calls_render_and_read_back() {
    let t =
        ChatTemplate::new(include_str!("testdata_qwen3_coder.jinja"), "", "<|im_end|>").unwrap();
    assert_eq!(t.tool_syntax(), Some(ToolSyntax::QwenXml));
    let tools = xml_tools();
    let call = Message {
        role: "assistant".into(),
        tool_calls: vec![ToolCall {
            id: "call_0".into(),
            name: "get_weather".into(),
            arguments: r#"{"city": "Paris", "days": 3}"#.into(),
        }],
        ..Message::default()
    };
    let chat = [Message::new("user", "Weather?"), call];
    // Without tools (`none`, which it tests `is iterable` as jinja2 does).
    let plain = t.render(&chat, &[], false).unwrap();
    assert!(!plain.contains("<tools>"), "{plain}");
    let text = t.render(&chat, &tools, false).unwrap();
    let written = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n\
                   <parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
    assert!(text.contains(written), "{text}");
    assert!(text.contains("<name>get_weather</name>"), "{text}");
    let read = ToolSyntax::QwenXml.parse(written, &tools);
    assert_eq!(
        read.calls,
        vec![(
            "get_weather".into(),
            r#"{"city": "Paris", "days": 3}"#.into()
        )]
    );
}

#[test]
fn smollm2_renders_as_jinja2_does() {
    // Rendered by Python's jinja2 3.1.6 (ImmutableSandboxedEnvironment,
    // trim_blocks, lstrip_blocks), as transformers renders it.
    let t = ChatTemplate::new(
        include_str!("testdata_smollm2.jinja"),
        "<|im_start|>",
        "<|im_end|>",
    )
    .unwrap();
    // It writes no tool calls: no syntax, by marker or by probe.
    assert_eq!(t.tool_syntax(), None);
    let text = t
        .render(
            &[Message::new("user", "What is the capital of France?")],
            &[],
            true,
        )
        .unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn client_messages_are_checked_and_developer_is_system() {
    let dev = Message::new("developer", "Be brief.").checked().unwrap();
    assert_eq!(dev, Message::new("system", "Be brief."));
    assert_eq!(
        Message::new("wizard", "x").checked().unwrap_err(),
        (
            "role",
            "`wizard` is not one of system, developer, user, assistant, tool".into()
        )
    );
    for role in ["system", "developer", "user", "tool"] {
        let m = Message {
            role: role.into(),
            ..Message::default()
        };
        assert_eq!(
            m.checked().unwrap_err(),
            ("content", format!("a `{role}` message needs content"))
        );
    }
    let silent = Message {
        role: "assistant".into(),
        ..Message::default()
    };
    assert_eq!(silent.clone().checked().unwrap_err().0, "content");
    let calls = Message {
        tool_calls: vec![ToolCall {
            id: "call_0".into(),
            name: "get_weather".into(),
            arguments: r#"{"city": "Paris"}"#.into(),
        }],
        ..silent
    };
    assert_eq!(calls.clone().checked().unwrap(), calls);
    // An empty text is content.
    Message::new("user", "").checked().unwrap();
}

/// Template arguments reach the template beside the messages (a switch as
/// Qwen3's `enable_thinking`), and cannot replace what the server sets.
/// `is iterable` as Python's jinja2 answers it: not for `none` or a
/// number, yes for an undefined value, a string, a list and a mapping.
#[test]
fn the_iterable_test_is_pythons() {
    let t = ChatTemplate::new(
        "{{ [tools is iterable, nothing is iterable, 3 is iterable, 'ab' is iterable, \
         messages is iterable, messages[0] is iterable] }}",
        "",
        "",
    )
    .unwrap();
    let text = t.render(&[Message::new("user", "Hi")], &[], false).unwrap();
    assert_eq!(text, "[False, True, False, True, True, True]");
}

#[test]
fn template_arguments_reach_the_template() {
    let t = ChatTemplate::new(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}\
         {% if add_generation_prompt %}assistant:{% if enable_thinking is defined and not enable_thinking %} <think></think>{% endif %}{% endif %}",
        "",
        "",
    )
    .unwrap();
    let msgs = [Message::new("user", "Hi")];
    assert_eq!(t.render(&msgs, &[], true).unwrap(), "user: Hi\nassistant:");
    let off: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(r#"{"enable_thinking": false}"#).unwrap();
    assert_eq!(
        t.render_with(&msgs, &[], true, &off).unwrap(),
        "user: Hi\nassistant: <think></think>"
    );
    for k in ChatTemplate::RESERVED {
        let mut bad = serde_json::Map::new();
        bad.insert(k.into(), serde_json::json!([]));
        match t.render_with(&msgs, &[], true, &bad) {
            Err(ChatError::Render(why)) => assert!(why.contains(k), "{why}"),
            other => panic!("{k}: {other:?}"),
        }
    }
}

/// A template that knows `<think>` reasons; whether its prompt leaves the
/// block open depends on the template and its arguments.
#[test]
fn thinking_templates_are_known_and_may_open_the_block() {
    let qwen3_like = ChatTemplate::new(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}\
         {% if add_generation_prompt %}assistant:\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}",
        "",
        "",
    )
    .unwrap();
    let r1_like = ChatTemplate::new(
        "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}<think>\n{% endif %}",
        "",
        "",
    )
    .unwrap();
    let off: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(r#"{"enable_thinking": false}"#).unwrap();
    let none = serde_json::Map::new();
    assert!(qwen3_like.reasons() && r1_like.reasons());
    assert!(!qwen3_like.opens_thinking(&none));
    assert!(!qwen3_like.opens_thinking(&off));
    assert!(r1_like.opens_thinking(&none));
    assert!(!qwen().reasons() && !qwen().opens_thinking(&none));
}

#[test]
fn a_final_assistant_message_is_continued_or_the_chat_closed() {
    let t = qwen();
    let mut msgs = vec![
        Message::new("user", "Capital of France?"),
        Message::new("assistant", "The capital is "),
    ];
    let cont = t
        .render_ending(&msgs, &[], ChatEnd::Continue, &Default::default())
        .unwrap();
    let closed = t
        .render_ending(&msgs, &[], ChatEnd::Closed, &Default::default())
        .unwrap();
    // Qwen's template writes the text as given: the cut keeps its space.
    assert!(
        cont.ends_with("<|im_start|>assistant\nThe capital is "),
        "{cont:?}"
    );
    assert!(closed.starts_with(&cont), "{closed:?}");
    assert!(
        closed.ends_with("The capital is <|im_end|>\n"),
        "{closed:?}"
    );
    let answer = t
        .render_ending(&msgs, &[], ChatEnd::Answer, &Default::default())
        .unwrap();
    assert_eq!(answer, format!("{closed}<|im_start|>assistant\n"));

    // A template that trims the text: the trimmed text is found.
    let trims = ChatTemplate::new(
        "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}",
        "",
        "",
    )
    .unwrap();
    let cont = trims
        .render_ending(&msgs, &[], ChatEnd::Continue, &Default::default())
        .unwrap();
    assert!(cont.ends_with("<assistant>The capital is"), "{cont:?}");

    let refused = |msgs: &[Message], t: &ChatTemplate| {
        t.render_ending(msgs, &[], ChatEnd::Continue, &Default::default())
            .unwrap_err()
    };
    assert!(matches!(refused(&msgs[..1], &t), ChatError::Continue(m) if m.contains("`user`")));
    msgs[1].content = Some("  ".into());
    assert!(matches!(refused(&msgs, &t), ChatError::Continue(m) if m.contains("no text")));
    msgs[1] = Message {
        role: "assistant".into(),
        content: Some("Let me look.".into()),
        tool_calls: vec![ToolCall {
            id: "c".into(),
            name: "f".into(),
            arguments: "{}".into(),
        }],
        ..Message::default()
    };
    assert!(matches!(refused(&msgs, &t), ChatError::Continue(m) if m.contains("tools")));
    let drops =
        ChatTemplate::new("{% for m in messages %}<{{ m.role }}>{% endfor %}", "", "").unwrap();
    msgs[1].tool_calls.clear();
    assert!(matches!(refused(&msgs, &drops), ChatError::Continue(m) if m.contains("as given")));
}

/// Llama 3's calls, `{"name": …, "parameters": …}` with no marker: known by
/// how a template writes an assistant's call; read only where the answer
/// opens with one; forced by a grammar with the `parameters` key.
#[test]
fn llama3_calls_are_the_answers_opening_json() {
    let t = ChatTemplate::new(
        "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n\
         {% if m.tool_calls %}{% set c = m.tool_calls[0].function %}\
         {{ '{\"name\": \"' + c.name + '\", \"parameters\": ' + c.arguments | tojson + '}' }}\
         {% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}",
        "",
        "",
    )
    .unwrap();
    assert_eq!(t.tool_syntax(), Some(ToolSyntax::Llama3Json));
    assert_eq!(qwen().tool_syntax(), Some(ToolSyntax::Hermes));

    let whole = |i: usize| streamed(CALL_TEXTS[i].0, &[CALL_TEXTS[i].1]).0;
    assert_eq!(
        whole(10),
        vec![
            CallPiece::Call("get_weather".into()),
            CallPiece::Args(r#"{"city": "Paris"}"#.into()),
        ]
    );
    // Several, separated by `;`; what follows the calls is dropped.
    assert_eq!(
        whole(11),
        vec![
            CallPiece::Call("a".into()),
            CallPiece::Args("{}".into()),
            CallPiece::Call("b".into()),
            CallPiece::Args(r#"{"x": 1}"#.into()),
        ]
    );
    // JSON that is no call, a call after text, a head cut short: text.
    for i in [12, 13, 14] {
        assert_eq!(whole(i), vec![CallPiece::Text(CALL_TEXTS[i].1.into())]);
    }
    // A JSON answer goes out as soon as it cannot be a call.
    let mut p = CallParser::new(ToolSyntax::Llama3Json);
    assert_eq!(p.push("{\"ans"), vec![CallPiece::Text("{\"ans".into())]);

    let Some(Constraint::Lark(g)) =
        ToolSyntax::Llama3Json.constraint(&[weather()], &ToolChoice::Required, true)
    else {
        panic!()
    };
    assert!(
        g.starts_with("start: call (\"; \" call)*\ncall: %json "),
        "{g}"
    );
    assert!(g.contains(r#""required":["name","parameters"]"#), "{g}");
}

/// Random texts built from the pieces calls are made of: read whole, in
/// random cuts and a character at a time, the reader gives the same pieces,
/// never panics, and a text with no call comes back exactly as text.
#[test]
fn random_texts_read_alike_however_cut() {
    const PARTS: &[&str] = &[
        "<tool_call>",
        "</tool_call>",
        "```json",
        "```",
        "[TOOL_CALLS]",
        "{",
        "}",
        "[",
        "]",
        "\"name\"",
        "\"arguments\"",
        "\"parameters\"",
        ": ",
        ", ",
        ";",
        "\"f\"",
        "\"é\\\"}\"",
        "\\",
        "\"",
        " ",
        "\n",
        "1",
        "null",
        "text",
        "🦀",
        "{\"name\": \"g\", \"arguments\": ",
        "{\"name\": \"h\", \"parameters\": {\"a\": [1, \"x\"]}}",
        "<function=",
        "write>",
        "<parameter=",
        "n>",
        "text>",
        "</parameter>",
        "</function>",
        "<",
        ">",
        "[ARGS]",
        "g",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "function<｜tool▁sep｜>",
        "```json\n",
        "<｜tool▁call▁end｜>",
        "<|START_ACTION|>",
        "<|END_ACTION|>",
        "\"tool_call_id\": \"0\", ",
        "\"tool_name\"",
        "<|tool_call|>",
        "<TOOLCALL>",
        "</TOOLCALL>",
        "<|channel|>",
        "analysis",
        "final",
        "commentary",
        "<|message|>",
        "<|end|>",
        "<|start|>assistant",
        " to=functions.f",
        "<|constrain|>json",
        "<|call|>",
        "<|tool_call>",
        "<tool_call|>",
        "<|\"|>",
        "call:",
        "k:",
        "true",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "<|tool_call_start|>",
        "<|tool_call_end|>",
        "(",
        ")",
        "x=",
        "'",
        "True",
        "\\u00e",
    ];
    // A fixed stream: the same texts every run.
    let mut rng = Xorshift(0x9E37_79B9_7F4A_7C15);
    let syntaxes = [
        ToolSyntax::Hermes,
        ToolSyntax::Mistral,
        ToolSyntax::Llama3Json,
        ToolSyntax::QwenXml,
        ToolSyntax::MistralArgs,
        ToolSyntax::Harmony,
        ToolSyntax::Granite,
        ToolSyntax::Nemotron,
        ToolSyntax::DeepSeek,
        ToolSyntax::DeepSeekR1,
        ToolSyntax::CommandR,
        ToolSyntax::Gemma4,
        ToolSyntax::Glm45,
        ToolSyntax::Glm47,
        ToolSyntax::Lfm2,
    ];
    // How many texts held calls, and how many ended inside arguments: the
    // texts must reach the reader's paths, not only its prose.
    let (mut with_calls, mut cut_short) = (0, 0);
    for round in 0..5000 {
        let len = rng.below(24);
        let syntax = syntaxes[round % syntaxes.len()];
        // Half open as a call in the syntax would, to reach its paths.
        let opener = match syntax {
            _ if rng.below(2) == 0 => "",
            ToolSyntax::Hermes => "<tool_call>\n{\"name\": \"f\", \"arguments\": ",
            ToolSyntax::Mistral => "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": ",
            ToolSyntax::QwenXml => "<tool_call>\n<function=write>\n<parameter=text>\n",
            ToolSyntax::MistralArgs => "[TOOL_CALLS]f[ARGS]",
            ToolSyntax::Harmony => "<|channel|>commentary to=functions.f<|message|>",
            ToolSyntax::Granite => "<|tool_call|>[{\"name\": \"f\", \"arguments\": ",
            ToolSyntax::Nemotron => "<TOOLCALL>[{\"name\": \"f\", \"arguments\": ",
            ToolSyntax::DeepSeek => "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>",
            ToolSyntax::DeepSeekR1 => {
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n"
            }
            ToolSyntax::CommandR => {
                "<|START_ACTION|>[{\"tool_call_id\": \"0\", \"tool_name\": \"f\", \"parameters\": "
            }
            ToolSyntax::Gemma4 => "<|tool_call>call:f{",
            ToolSyntax::Glm45 | ToolSyntax::Glm47 => {
                "<tool_call>write\n<arg_key>text</arg_key>\n<arg_value>"
            }
            ToolSyntax::Lfm2 => "<|tool_call_start|>[f(",
            _ => "{\"name\": \"f\", \"parameters\": ",
        };
        let text: String = std::iter::once(opener)
            .chain((0..len).map(|_| PARTS[rng.below(PARTS.len())]))
            .collect();
        let whole = read_alike_cut_at_random(&text, &mut rng, |parts| streamed(syntax, parts));
        with_calls += usize::from(whole.0.iter().any(|p| matches!(p, CallPiece::Call(_))));
        cut_short += usize::from(whole.1);
        // (Harmony's headers are markup, and its thinking is not text.)
        let no_call = !whole.0.iter().any(|p| matches!(p, CallPiece::Call(_)));
        if no_call && syntax != ToolSyntax::Harmony {
            let said: String = whole
                .0
                .iter()
                .map(|p| match p {
                    CallPiece::Text(t) => t.as_str(),
                    _ => "",
                })
                .collect();
            assert_eq!(said, text, "{syntax:?}: no call, so all of it is text");
        }
    }
    assert!(
        with_calls > 1000 && cut_short > 150,
        "{with_calls} {cut_short}"
    );
}

/// `parallel_tool_calls: false`: the first call is taken, later ones are
/// dropped, however the text is cut, in every syntax.
#[test]
fn a_single_call_reader_drops_later_calls() {
    for &(syntax, i) in &[
        (ToolSyntax::Hermes, 0),
        (ToolSyntax::Hermes, 6),
        (ToolSyntax::Mistral, 9),
        (ToolSyntax::Llama3Json, 11),
        (ToolSyntax::Granite, CALL_TEXTS.len() - 3),
        (ToolSyntax::Gemma4, CALL_TEXTS.len() - 8),
    ] {
        let text = CALL_TEXTS[i].1;
        let read = |parts: &[&str]| {
            let mut p = CallParser::new(syntax).single();
            let mut all: Vec<CallPiece> = parts.iter().flat_map(|t| p.push(t)).collect();
            all.extend(p.finish());
            let calls: Vec<String> = all
                .iter()
                .filter_map(|c| match c {
                    CallPiece::Call(n) => Some(n.clone()),
                    _ => None,
                })
                .collect();
            let args: String = all
                .iter()
                .filter_map(|c| match c {
                    CallPiece::Args(a) => Some(a.as_str()),
                    _ => None,
                })
                .collect();
            (calls, args)
        };
        let whole = read(&[text]);
        let all = syntax.parse(text, &[]);
        assert!(all.calls.len() > 1, "{text:?}");
        assert_eq!(
            whole,
            (vec![all.calls[0].0.clone()], all.calls[0].1.clone())
        );
        let single = syntax.parse_single(text, &[]);
        assert_eq!(single.calls, all.calls[..1].to_vec());
        for at in (1..text.len()).filter(|&a| text.is_char_boundary(a)) {
            assert_eq!(read(&[&text[..at], &text[at..]]), whole, "{text:?} at {at}");
        }
    }
}

/// gpt-oss's own template (OpenAI's harmony format, as llama.cpp's
/// `models/templates/openai-gpt-oss-120b.jinja` copies the model's): its
/// syntax and thinking are known; effort, tools, a call with the thinking
/// before it and the call's result render as harmony; and what the model
/// wrote for that turn reads back as the same thinking and call.
#[test]
fn gpt_oss_renders_harmony_and_its_call_reads_back() {
    let t = ChatTemplate::new(
        include_str!("testdata_gpt_oss.jinja"),
        "<|startoftext|>",
        "<|return|>",
    )
    .unwrap();
    assert_eq!(t.tool_syntax(), Some(ToolSyntax::Harmony));
    assert_eq!(t.think_tags(), Some(ThinkTags::HARMONY));
    assert!(t.reasons() && t.takes_effort() && !t.has_thinking_switch());
    assert!(!t.opens_thinking(&serde_json::Map::new()));
    let args = r#"{"city": "Paris"}"#;
    let [call, result] = call_and_result("call_0", Some("Need the weather."));
    let chat = [Message::new("user", "Weather in Paris?"), call, result];
    let mut kwargs = serde_json::Map::new();
    kwargs.insert(ChatTemplate::EFFORT.into(), "high".into());
    let text = t.render_with(&chat, &[weather()], true, &kwargs).unwrap();
    assert!(text.contains("Reasoning: high\n"), "{text}");
    assert!(
        text.contains(
            "// Current weather in a city\ntype get_weather = (_: {\ncity: string,\n}) => any;"
        ),
        "{text}"
    );
    let turn = "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>\
                <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>\
                {\"city\": \"Paris\"}<|call|>";
    assert!(text.contains(turn), "{text}");
    assert!(
        text.ends_with(
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\
             \"18 C\"<|end|><|start|>assistant"
        ),
        "{text}"
    );
    // The model's text for that turn: what follows the generation prompt.
    let written = &turn["<|start|>assistant".len()..];
    let mut r = OutputRouter::new(Some(ToolSyntax::Harmony), Some(false));
    let got = r.push(written, true);
    assert_eq!(got.reasoning, "Need the weather.");
    let read = ParsedOutput::from_pieces(got.calls, got.cut);
    assert_eq!(read.calls, [("get_weather".to_string(), args.to_string())]);
    assert!(!read.cut_short);
    assert_eq!(ToolSyntax::Harmony.parse(written, &[]), read);
    // Without tools, thinking split off by the tags alone.
    let mut r = OutputRouter::new(None, Some(false)).with_think_tags(ThinkTags::HARMONY);
    let got = r.push(
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4",
        true,
    );
    assert_eq!(
        (got.reasoning.as_str(), got.answer.as_str()),
        ("Easy.", "4")
    );
    // What the template needs: empty text for no text, an empty
    // description, a call's text joined to its thinking (it refuses both).
    assert_eq!(t.adaptations(), ["empty_text", "described", "join_thought"]);
    let mut said = chat.clone();
    said[1].content = Some("Let me look.".into());
    let text = t.render_with(&said, &[weather()], true, &kwargs).unwrap();
    assert!(
        text.contains("<|channel|>analysis<|message|>Need the weather.\n\nLet me look.<|end|>"),
        "{text}"
    );
    let plain = t.render(&chat[..2], &[], false).unwrap();
    assert!(plain.contains("to=functions.get_weather"), "{plain}");
    // A tool without a description: an empty one (the template joins it
    // to text).
    let bare = Tool {
        description: None,
        ..weather()
    };
    let text = t.render(&chat[..1], &[bare], true).unwrap();
    assert!(text.contains("// \ntype get_weather"), "{text}");
}

/// Qwen3's template reads an earlier turn's thinking as
/// `reasoning_content`; gpt-oss's as `thinking`: both are given.
#[test]
fn reasoning_given_back_reaches_the_template() {
    let source = "{% for m in messages %}[{{ m.reasoning_content }}|{{ m.thinking }}|{{ m.content }}]{% endfor %}";
    let t = ChatTemplate::new(source, "", "").unwrap();
    let m = Message {
        reasoning: Some("hm".into()),
        ..Message::new("assistant", "ok")
    };
    assert_eq!(t.render(&[m], &[], false).unwrap(), "[hm|hm|ok]");
    let plain = Message::new("assistant", "ok");
    assert_eq!(t.render(&[plain], &[], false).unwrap(), "[||ok]");
}

/// Qwen3's own template (as its model card ships it; llama.cpp keeps a
/// copy): it reads an assistant's tool-calling message's `content` as text,
/// so a message without text is given as empty text; the thinking before a
/// call is shown in the turns after the last user message; its
/// `enable_thinking: false` closes an empty block.
#[test]
fn qwen3_renders_tool_turns_with_their_thinking() {
    let t = ChatTemplate::new(include_str!("testdata_qwen3.jinja"), "", "<|im_end|>").unwrap();
    assert_eq!(t.tool_syntax(), Some(ToolSyntax::Hermes));
    assert_eq!(t.think_tags(), Some(ThinkTags::ANGLE));
    assert!(t.has_thinking_switch() && !t.opens_thinking(&serde_json::Map::new()));
    let [call, result] = call_and_result("call_0", Some("Need the weather."));
    let chat = [Message::new("user", "Weather?"), call, result];
    let text = t.render(&chat, &[weather()], true).unwrap();
    let turn = "<|im_start|>assistant\n<think>\nNeed the weather.\n</think>\n\n<tool_call>\n\
                {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n\
                <|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n";
    assert!(text.ends_with(turn), "{text}");
    // Without the thinking: no block (it is not the last message).
    let mut plain = chat.clone();
    plain[1].reasoning = None;
    let text = t.render(&plain, &[weather()], true).unwrap();
    assert!(
        text.contains("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\""),
        "{text}"
    );
    let mut off = serde_json::Map::new();
    off.insert(ChatTemplate::THINKING_SWITCH.into(), false.into());
    assert!(t.thinking_on(&serde_json::Map::new()) && !t.thinking_on(&off));
    let text = t.render_with(&chat[..1], &[], true, &off).unwrap();
    assert!(
        text.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "{text}"
    );
}

/// A template that tests for `none` still sees `none` for no text.
#[test]
fn no_text_stays_none_where_the_template_handles_it() {
    let source =
        "{% for m in messages %}[{{ 'none' if m.content is none else m.content }}]{% endfor %}";
    let t = ChatTemplate::new(source, "", "").unwrap();
    let call = Message {
        role: "assistant".into(),
        tool_calls: vec![ToolCall {
            id: "c".into(),
            name: "f".into(),
            arguments: "{}".into(),
        }],
        ..Message::default()
    };
    assert_eq!(t.render(&[call], &[], false).unwrap(), "[none]");
}

/// An assistant's call to `get_weather` for Paris with id `id` (and the
/// thinking before it), and the tool's result, `18 C`.
fn call_and_result(id: &str, thought: Option<&str>) -> [Message; 2] {
    let call = Message {
        role: "assistant".into(),
        tool_calls: vec![ToolCall {
            id: id.into(),
            name: "get_weather".into(),
            arguments: r#"{"city": "Paris"}"#.into(),
        }],
        reasoning: thought.map(Into::into),
        ..Message::default()
    };
    let result = Message {
        role: "tool".into(),
        content: Some("18 C".into()),
        tool_call_id: Some(id.into()),
        ..Message::default()
    };
    [call, result]
}

/// A call with a long id (as the server makes them), and its result.
fn long_id_call() -> [Message; 2] {
    call_and_result("call_18eedc3dd3393c090001", None)
}

/// Real templates (as their models ship them; llama.cpp keeps copies)
/// that fail on what OpenAI's clients send, each adapted as it needs and
/// no more: DeepSeek-V3.1's joins a call's arguments to text (given as
/// JSON text), Mistral-Nemo's insists on 9-character call ids (a long id
/// maps to one, the same for the call and its result), Gemma 2's refuses
/// the system role (folded into the first user message); Qwen2.5's needs
/// nothing.
#[test]
fn templates_get_what_they_accept() {
    let [call, result] = long_id_call();
    let chat = [Message::new("user", "Weather?"), call, result];
    let t = ChatTemplate::new(include_str!("testdata_deepseek_v31.jinja"), "<s>", "</s>").unwrap();
    assert_eq!(t.adaptations(), ["text_args"]);
    // Its thinking switch is `thinking` (off unless set), found by rendering.
    assert_eq!(t.thinking_switch(), Some("thinking"));
    let mut on = serde_json::Map::new();
    on.insert("thinking".into(), true.into());
    assert!(t.opens_thinking(&on) && !t.opens_thinking(&serde_json::Map::new()));
    // Off unless set.
    assert!(t.thinking_on(&on) && !t.thinking_on(&serde_json::Map::new()));
    let text = t.render(&chat, &[], true).unwrap();
    assert!(
        text.contains("get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜>"),
        "{text}"
    );
    let t = ChatTemplate::new(include_str!("testdata_mistral_nemo.jinja"), "<s>", "</s>").unwrap();
    assert_eq!(t.adaptations(), ["short_ids"]);
    let text = t.render(&chat, &[], true).unwrap();
    let id = fit::short_id("call_18eedc3dd3393c090001");
    assert!(text.contains(&format!("\"id\": \"{id}\"}}]")), "{text}");
    assert!(text.contains(&format!("\"call_id\": \"{id}\"}}")), "{text}");
    let t = ChatTemplate::new(include_str!("testdata_gemma2.jinja"), "<bos>", "<eos>").unwrap();
    assert_eq!(t.adaptations(), ["fold_system"]);
    let asked = [
        Message::new("system", "Be brief."),
        Message::new("user", "Hi"),
    ];
    assert_eq!(
        t.render(&asked, &[], true).unwrap(),
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    );
    assert!(qwen().adaptations().is_empty());
    assert_eq!(qwen().thinking_switch(), None);
    let t = ChatTemplate::new(include_str!("testdata_qwen3.jinja"), "", "").unwrap();
    assert_eq!(t.adaptations(), ["empty_text"]);
}

/// An adaptation that only sends the template down a branch that drops the
/// call does not count (DeepSeek-R1's templates render a call only when
/// `content` is none, and join its arguments to text there).
#[test]
fn an_adaptation_must_keep_the_call() {
    let source = "{% for m in messages %}{% if m.content is none %}\
                  {{ '<call>' + m.tool_calls[0].function.name + m.tool_calls[0].function.arguments }}\
                  {% else %}{{ m.content.strip() }}{% endif %}{% endfor %}";
    let t = ChatTemplate::new(source, "", "").unwrap();
    assert_eq!(t.adaptations(), ["text_args"]);
    let [call, result] = long_id_call();
    let text = t.render(&[call, result], &[], true).unwrap();
    assert_eq!(text, "<call>get_weather{\"city\": \"Paris\"}18 C");
}
