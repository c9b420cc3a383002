//! Templates rendered as `transformers` renders them (Qwen2.5's tool
//! instructions really do show `{{"name": …}}` with doubled braces: they are
//! inside a string literal). The expected strings
//! follow the Qwen2.5 template's text by hand (its source is in
//! `testdata_qwen25.jinja`, as its GGUF carries it).

use super::*;

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
    );
    assert_eq!(out.content, "Let me check.");
    assert_eq!(
        out.calls,
        vec![
            ("get_weather".into(), r#"{"city":"Paris"}"#.into()),
            ("get_weather".into(), r#"{"city":"Rome"}"#.into())
        ]
    );
    // Not JSON: prose, no call.
    let out = s.parse("<tool_call>\nnot json\n</tool_call>");
    assert!(out.calls.is_empty() && out.content.contains("not json"));
    assert_eq!(s.parse("Paris is sunny.").content, "Paris is sunny.");
    // An unclosed last block still counts (generation stopped at EOS).
    let out = s.parse("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}");
    assert_eq!(out.calls, vec![("f".into(), "{}".into())]);
}

#[test]
fn mistral_calls_parse() {
    let out = ToolSyntax::Mistral.parse(
        "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}, {\"name\": \"now\", \"arguments\": {}}]",
    );
    assert_eq!(out.content, "");
    assert_eq!(out.calls.len(), 2);
    assert_eq!(
        out.calls[0],
        ("get_weather".into(), r#"{"city":"Oslo"}"#.into())
    );
    assert_eq!(
        ToolSyntax::detect("{{ '[TOOL_CALLS]' }}"),
        Some(ToolSyntax::Mistral)
    );
    assert_eq!(ToolSyntax::detect("{{ m.content }}"), None);
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
    let out =
        s.parse("```json\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n```");
    assert_eq!(
        out.calls,
        vec![("get_weather".into(), r#"{"city":"Paris"}"#.into())]
    );
    let data = "```json\n{\"name\": \"Bob\", \"age\": 3}\n```";
    assert_eq!(s.parse(data).calls, vec![]);
    assert_eq!(s.parse(data).content, data);
    // Prose between two blocks: not a call sequence.
    let mixed = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\nand then\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>";
    assert!(s.parse(mixed).calls.is_empty());
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
