//! Tool-call syntaxes: how a model family writes calls, parsed back into
//! calls, and the grammar that forces one.

use serde_json::Value;
use serde_json::value::RawValue;
use siliceo_core::Constraint;

use crate::Tool;
use crate::calls::{CallParser, CallPiece, GLM_XML, QWEN_XML, XmlTags};
use crate::{gemma4, pythonic};

/// How a model family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ToolSyntax {
    /// `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, one
    /// block per call (Qwen2.5, Hermes, and the templates that copied them).
    Hermes,
    /// `[TOOL_CALLS] [{"name": …, "arguments": {…}}, …]` (Mistral).
    Mistral,
    /// `[TOOL_CALLS]NAME[ARGS]{…}`, once per call (Mistral's newer models:
    /// Mistral Small 3.2, Devstral, Magistral, Ministral 3).
    MistralArgs,
    /// `{"name": …, "parameters": {…}}` as the whole answer, with no marker
    /// (Llama 3.1–3.3, whose templates write calls so); several are
    /// separated by `;`. Only an answer that opens with it is a call.
    Llama3Json,
    /// `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n…
    /// </function>\n</tool_call>` (Qwen3-Coder, Qwen3.5): each argument in
    /// its own tag, its value as text, typed by the tool's schema.
    QwenXml,
    /// `<|tool_call|>[{"name": …, "arguments": {…}}, …]` (IBM's Granite 3):
    /// Mistral's list after another marker.
    Granite,
    /// `<TOOLCALL>[{"name": …, "arguments": {…}}, …]</TOOLCALL>` (NVIDIA's
    /// Nemotron Nano 2).
    Nemotron,
    /// OpenAI's harmony format (gpt-oss): a message to a recipient,
    /// `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}`,
    /// one call per turn; read with its thinking by [`crate::HarmonyReader`].
    Harmony,
    /// `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>…
    /// <｜tool▁calls▁end｜>` (DeepSeek-V3.1 and later).
    DeepSeek,
    /// `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{…}\n```
    /// <｜tool▁call▁end｜>…<｜tool▁calls▁end｜>` (DeepSeek-R1-0528 and its
    /// distills, DeepSeek-V3).
    DeepSeekR1,
    /// `<|START_ACTION|>[{"tool_call_id": "0", "tool_name": …, "parameters":
    /// {…}}, …]<|END_ACTION|>` (Cohere's Command R7B and Command A).
    CommandR,
    /// `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>` (Google's
    /// Gemma 4): arguments in a notation of its own, read as JSON.
    Gemma4,
    /// `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n…
    /// </tool_call>` (Z.ai's GLM-4.5 and GLM-4.6): XML arguments, each
    /// value text typed by the tool's schema, as Qwen3-Coder's.
    Glm45,
    /// GLM's calls without the newlines, `<tool_call>NAME<arg_key>KEY
    /// </arg_key><arg_value>VALUE</arg_value></tool_call>` (GLM-4.7 and
    /// GLM-4.7-Flash). Read alike; a forced call is laid out so.
    Glm47,
    /// `<|tool_call_start|>[get_weather(city="Paris"), now()]<|tool_call_end|>`
    /// (Liquid AI's LFM2 and LFM2.5): calls written as Python, their
    /// keyword arguments read as JSON.
    Lfm2,
}

/// Which tools the model may or must call (OpenAI's `tool_choice`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides.
    Auto,
    /// No calls: the tools are not offered.
    None,
    /// At least one call, to any of the tools.
    Required,
    /// A call to this function.
    Function(String),
}

/// Generated text split into prose and calls.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParsedOutput {
    /// Text outside the calls (trimmed).
    pub content: String,
    /// `(name, arguments as JSON text)` per call, in order.
    pub calls: Vec<(String, String)>,
    /// The text ended inside the last call's arguments.
    pub cut_short: bool,
}

impl ParsedOutput {
    /// A whole output's pieces as [`CallParser`] read them: the text
    /// (trimmed) and each call with its arguments joined; `cut_short` as
    /// the reader said.
    pub fn from_pieces(pieces: impl IntoIterator<Item = CallPiece>, cut_short: bool) -> Self {
        let mut out = ParsedOutput {
            cut_short,
            ..ParsedOutput::default()
        };
        for piece in pieces {
            match piece {
                CallPiece::Text(t) => out.content.push_str(&t),
                CallPiece::Call(name) => out.calls.push((name, String::new())),
                CallPiece::Args(a) => {
                    if let Some((_, args)) = out.calls.last_mut() {
                        args.push_str(&a);
                    }
                }
            }
        }
        out.content = out.content.trim().to_string();
        out
    }
}

impl ToolSyntax {
    /// The syntax a chat template teaches, if any.
    pub fn detect(template: &str) -> Option<ToolSyntax> {
        if crate::harmony::is_harmony(template) {
            Some(ToolSyntax::Harmony)
        } else if template.contains(gemma4::CALL) && template.contains(gemma4::CALL_HEAD) {
            Some(ToolSyntax::Gemma4)
        } else if template.contains(pythonic::CALL)
            || template.contains("<|tool_list_start|>")
            || template.contains("List of tools: [")
        {
            // LFM2's template names its list of tools; LFM2.5's says it so.
            Some(ToolSyntax::Lfm2)
        } else if template.contains(DEEPSEEK_CALL) && template.contains("```json") {
            Some(ToolSyntax::DeepSeekR1)
        } else if template.contains(DEEPSEEK_CALL) {
            Some(ToolSyntax::DeepSeek)
        } else if template.contains(COMMAND_R_CALL) {
            Some(ToolSyntax::CommandR)
        } else if template.contains(GRANITE_CALL) {
            Some(ToolSyntax::Granite)
        } else if template.contains(NEMOTRON_CALL) {
            Some(ToolSyntax::Nemotron)
        } else if template.contains("<tool_call>") && template.contains(GLM_XML.key) {
            // 4.7's template writes a key right after the name.
            let compact = ["</arg_key><arg_value>", "tc.name }}<arg_key>"]
                .iter()
                .any(|t| template.contains(t));
            Some(if compact {
                ToolSyntax::Glm47
            } else {
                ToolSyntax::Glm45
            })
        } else if template.contains("<tool_call>") && template.contains("<function=") {
            Some(ToolSyntax::QwenXml)
        } else if template.contains("<tool_call>") {
            Some(ToolSyntax::Hermes)
        } else if template.contains("[TOOL_CALLS]") && template.contains("[ARGS]") {
            Some(ToolSyntax::MistralArgs)
        } else if template.contains("[TOOL_CALLS]") {
            Some(ToolSyntax::Mistral)
        } else {
            None
        }
    }

    /// The syntax a template writes an assistant's call in, seen in its
    /// rendering of a chat whose assistant called `name` with
    /// `{"arg": 1}` (for templates that name no marker, [`detect`]
    /// finding none).
    ///
    /// [`detect`]: ToolSyntax::detect
    pub fn of_rendered_call(rendered: &str, name: &str) -> Option<ToolSyntax> {
        let head = format!(r#"{{"name": "{name}", "parameters": "#);
        rendered.contains(&head).then_some(ToolSyntax::Llama3Json)
    }

    /// A short name (`hermes`, `mistral`, `mistral_args`, `llama3_json`,
    /// `qwen3_coder`, `granite`, `nemotron`, `harmony`, `deepseek_v3_1`,
    /// `deepseek_r1`, `command_r`, `gemma4`, `glm45`, `glm47`, `lfm2`).
    pub fn name(self) -> &'static str {
        match self {
            ToolSyntax::Hermes => "hermes",
            ToolSyntax::Mistral => "mistral",
            ToolSyntax::MistralArgs => "mistral_args",
            ToolSyntax::Llama3Json => "llama3_json",
            ToolSyntax::QwenXml => "qwen3_coder",
            ToolSyntax::Granite => "granite",
            ToolSyntax::Nemotron => "nemotron",
            ToolSyntax::Harmony => "harmony",
            ToolSyntax::DeepSeek => "deepseek_v3_1",
            ToolSyntax::DeepSeekR1 => "deepseek_r1",
            ToolSyntax::CommandR => "command_r",
            ToolSyntax::Gemma4 => "gemma4",
            ToolSyntax::Glm45 => "glm45",
            ToolSyntax::Glm47 => "glm47",
            ToolSyntax::Lfm2 => "lfm2",
        }
    }

    /// The tags of an XML syntax's arguments (Qwen3-Coder's, GLM's).
    pub(crate) fn xml_tags(self) -> Option<&'static XmlTags> {
        match self {
            ToolSyntax::QwenXml => Some(&QWEN_XML),
            ToolSyntax::Glm45 | ToolSyntax::Glm47 => Some(&GLM_XML),
            _ => None,
        }
    }

    /// GLM's syntax, in either layout.
    pub(crate) fn is_glm(self) -> bool {
        matches!(self, ToolSyntax::Glm45 | ToolSyntax::Glm47)
    }

    /// For syntaxes that name a call before a separator and write its
    /// arguments bare after it: the text that opens each call (skipped
    /// where the block's marker was the list's opening; empty when the
    /// marker is each call's) and the separator.
    pub(crate) fn named_call(self) -> Option<(&'static str, &'static str)> {
        match self {
            ToolSyntax::MistralArgs => Some(("", "[ARGS]")),
            ToolSyntax::DeepSeek => Some((DEEPSEEK_CALL, DEEPSEEK_SEP)),
            ToolSyntax::DeepSeekR1 => Some((DEEPSEEK_R1_CALL, "```json")),
            _ => None,
        }
    }

    /// The key a call's arguments go under.
    fn arguments_key(self) -> &'static str {
        match self {
            ToolSyntax::Llama3Json | ToolSyntax::CommandR => "parameters",
            _ => "arguments",
        }
    }

    /// The key a call's function name goes under.
    fn name_key(self) -> &'static str {
        match self {
            ToolSyntax::CommandR => "tool_name",
            _ => "name",
        }
    }

    /// The texts that may open a call. Hermes models also write a call as a
    /// fenced JSON block (Qwen2.5-Coder does, unforced).
    pub fn start_markers(self) -> &'static [&'static str] {
        match self {
            ToolSyntax::Hermes => &["<tool_call>", "```json"],
            ToolSyntax::Mistral | ToolSyntax::MistralArgs => &["[TOOL_CALLS]"],
            ToolSyntax::Granite => &[GRANITE_CALL],
            ToolSyntax::Nemotron => &[NEMOTRON_CALL],
            ToolSyntax::CommandR => &[COMMAND_R_CALL],
            ToolSyntax::Gemma4 => &[gemma4::CALL],
            ToolSyntax::Glm45 | ToolSyntax::Glm47 => &["<tool_call>"],
            ToolSyntax::Lfm2 => &[pythonic::CALL],
            // The call is the answer's opening `{` (see CallParser).
            ToolSyntax::Llama3Json => &[],
            // Its models now and then leave out the outer tag.
            ToolSyntax::QwenXml => &["<tool_call>", "<function="],
            // A call is a message's header ([`crate::HarmonyReader`]).
            ToolSyntax::Harmony => &[crate::harmony::CHANNEL],
            // The list's opening, then each call's own (read as the start of
            // the first call's head: see CallParser).
            ToolSyntax::DeepSeek => &[DEEPSEEK_CALLS, DEEPSEEK_CALL],
            ToolSyntax::DeepSeekR1 => &[DEEPSEEK_CALLS, DEEPSEEK_R1_CALL],
        }
    }

    /// The texts of its markup that a vocabulary may hold as control
    /// tokens (Mistral's `[TOOL_CALLS]` is one): those must be rendered as
    /// text for the calls to be read. (Llama 3's `<|python_tag|>` before a
    /// JSON call is left out: the call is read without it.)
    pub fn markup(self) -> &'static [&'static str] {
        match self {
            ToolSyntax::Hermes | ToolSyntax::QwenXml => &["<tool_call>", "</tool_call>"],
            ToolSyntax::Glm45 | ToolSyntax::Glm47 => &GLM_MARKUP,
            ToolSyntax::Lfm2 => &pythonic::MARKUP,
            ToolSyntax::Mistral => &["[TOOL_CALLS]"],
            ToolSyntax::Granite => &[GRANITE_CALL],
            ToolSyntax::Nemotron => &[NEMOTRON_CALL, "</TOOLCALL>"],
            ToolSyntax::CommandR => &[COMMAND_R_CALL, COMMAND_R_END],
            ToolSyntax::MistralArgs => &["[TOOL_CALLS]", "[ARGS]"],
            ToolSyntax::Llama3Json => &[],
            // llama.cpp renders these for gpt-oss already; a GGUF converted
            // otherwise would hide them, and with them where messages end.
            ToolSyntax::Harmony => &crate::harmony::MARKUP,
            ToolSyntax::DeepSeek | ToolSyntax::DeepSeekR1 => &DEEPSEEK_MARKUP,
            // Its thinking channel's tokens too: its thinking tags are
            // each a token and a word.
            ToolSyntax::Gemma4 => &gemma4::MARKUP,
        }
    }

    /// Splits a whole generated text into prose and calls, as
    /// [`CallParser`] reads them while streaming: the prose is the text
    /// before the first call (trimmed); a block that is not a call is prose.
    pub fn parse(self, text: &str, tools: &[Tool]) -> ParsedOutput {
        Self::parse_with(CallParser::new(self).with_tools(tools), text)
    }

    /// [`ToolSyntax::parse`], taking only the first call.
    pub fn parse_single(self, text: &str, tools: &[Tool]) -> ParsedOutput {
        Self::parse_with(CallParser::new(self).with_tools(tools).single(), text)
    }

    fn parse_with(mut p: CallParser, text: &str) -> ParsedOutput {
        // (A harmony text's thinking is left out.)
        let mut pieces = p.push(text);
        pieces.extend(p.finish());
        ParsedOutput::from_pieces(pieces, p.cut_short())
    }

    /// The constraint that forces a call (to any of `tools` for
    /// [`ToolChoice::Required`], to the named one for
    /// [`ToolChoice::Function`]) whose arguments follow the tool's schema;
    /// several calls when `parallel`. `None` for `auto` and `none`, and when
    /// the named function is not among `tools`.
    pub fn constraint(
        self,
        tools: &[Tool],
        choice: &ToolChoice,
        parallel: bool,
    ) -> Option<Constraint> {
        let chosen: Vec<&Tool> = match choice {
            ToolChoice::Auto | ToolChoice::None => return None,
            ToolChoice::Required => tools.iter().collect(),
            ToolChoice::Function(name) => tools.iter().filter(|t| &t.name == name).collect(),
        };
        if chosen.is_empty() {
            return None;
        }
        // One call: `{"name": <the tool>, "arguments": <its schema>}` (in
        // the syntax's keys; Command R's lead with a call id), for any of
        // the chosen tools, laid out as the JSON constraints are
        // (siliceo-constrain): `", "`, `": "`, no free whitespace.
        let (name, args) = (self.name_key(), self.arguments_key());
        let one_call = serde_json::json!({
            "anyOf": chosen
                .iter()
                .map(|t| {
                    let mut props = serde_json::Map::new();
                    let mut required = Vec::new();
                    if self == ToolSyntax::CommandR {
                        props.insert(
                            "tool_call_id".into(),
                            serde_json::json!({"type": "string", "pattern": "^[0-9]{1,3}$"}),
                        );
                        required.push("tool_call_id");
                    }
                    props.insert(name.into(), serde_json::json!({"const": t.name}));
                    props.insert(args.into(), t.parameters_value());
                    required.extend([name, args]);
                    serde_json::json!({
                        "type": "object",
                        "properties": props,
                        "required": required,
                        "additionalProperties": false,
                    })
                })
                .collect::<Vec<_>>(),
        });
        let layout = json_layout();
        let grammar = match self {
            ToolSyntax::Hermes => {
                let mut body = one_call;
                body["x-guidance"] = layout;
                let repeat = if parallel { " (\"\\n\" call)*" } else { "" };
                format!(
                    "start: call{repeat}\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {body}\n"
                )
            }
            ToolSyntax::Mistral
            | ToolSyntax::Granite
            | ToolSyntax::Nemotron
            | ToolSyntax::CommandR => {
                let mut list = serde_json::json!({
                    "type": "array",
                    "items": one_call,
                    "minItems": 1,
                    "x-guidance": layout,
                });
                if !parallel {
                    list["maxItems"] = 1.into();
                }
                let (head, tail) = match self {
                    ToolSyntax::Mistral => ("\"[TOOL_CALLS] \"", ""),
                    ToolSyntax::Granite => ("\"<|tool_call|>\"", ""),
                    ToolSyntax::CommandR => ("\"<|START_ACTION|>\"", " \"<|END_ACTION|>\""),
                    _ => ("\"<TOOLCALL>\"", " \"</TOOLCALL>\""),
                };
                format!("start: {head} body{tail}\nbody: %json {list}\n")
            }
            ToolSyntax::Llama3Json => {
                let mut body = one_call;
                body["x-guidance"] = layout;
                let repeat = if parallel { " (\"; \" call)*" } else { "" };
                format!("start: call{repeat}\ncall: %json {body}\n")
            }
            ToolSyntax::QwenXml => xml_grammar(&chosen, parallel),
            ToolSyntax::Glm45 | ToolSyntax::Glm47 => {
                glm_grammar(&chosen, parallel, self == ToolSyntax::Glm47)
            }
            ToolSyntax::Gemma4 => gemma4::grammar(&chosen, parallel),
            ToolSyntax::Lfm2 => pythonic::grammar(&chosen, parallel),
            ToolSyntax::Harmony => harmony_grammar(&chosen),
            ToolSyntax::MistralArgs => {
                // `[TOOL_CALLS]NAME[ARGS]` then the arguments by the tool's schema.
                let repeat = if parallel { "+" } else { "" };
                let mut g = format!("start: call{repeat}\ncall: \"[TOOL_CALLS]\" ");
                named_calls(&mut g, &chosen, |name| format!("{name}[ARGS]"));
                g
            }
            ToolSyntax::DeepSeek | ToolSyntax::DeepSeekR1 => {
                let repeat = if parallel { "+" } else { "" };
                let r1 = self == ToolSyntax::DeepSeekR1;
                let (open, close) = if r1 {
                    (DEEPSEEK_R1_CALL, format!("\n```{DEEPSEEK_CALL_END}"))
                } else {
                    (DEEPSEEK_CALL, DEEPSEEK_CALL_END.to_string())
                };
                let mut g = format!(
                    "start: {} call{repeat} {}\ncall: {} fx {}\nfx: ",
                    lark_literal(DEEPSEEK_CALLS),
                    lark_literal(DEEPSEEK_CALLS_END),
                    lark_literal(open),
                    lark_literal(&close),
                );
                named_calls(&mut g, &chosen, |name| {
                    if r1 {
                        format!("{name}\n```json\n")
                    } else {
                        format!("{name}{DEEPSEEK_SEP}")
                    }
                });
                g
            }
        };
        Some(Constraint::Lark(grammar))
    }
}

/// DeepSeek's list of calls opens with this, then each call with
/// [`DEEPSEEK_CALL`]; a call's name and arguments are split by
/// [`DEEPSEEK_SEP`].
pub(crate) const DEEPSEEK_CALLS: &str = "<｜tool▁calls▁begin｜>";
pub(crate) const DEEPSEEK_CALL: &str = "<｜tool▁call▁begin｜>";
pub(crate) const DEEPSEEK_SEP: &str = "<｜tool▁sep｜>";
const DEEPSEEK_CALL_END: &str = "<｜tool▁call▁end｜>";
const DEEPSEEK_CALLS_END: &str = "<｜tool▁calls▁end｜>";
/// An R1-style call's opening, up to its name (its type is always
/// `function`).
pub(crate) const DEEPSEEK_R1_CALL: &str = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>";
/// DeepSeek's tool-call tokens.
const DEEPSEEK_MARKUP: [&str; 5] = [
    DEEPSEEK_CALLS,
    DEEPSEEK_CALL,
    DEEPSEEK_SEP,
    DEEPSEEK_CALL_END,
    DEEPSEEK_CALLS_END,
];

/// GLM's call tags (control tokens in its vocabulary).
const GLM_MARKUP: [&str; 6] = [
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
];

/// The tags around Command R's list of calls.
pub(crate) const COMMAND_R_CALL: &str = "<|START_ACTION|>";
pub(crate) const COMMAND_R_END: &str = "<|END_ACTION|>";

/// The marker before Granite's list of calls.
const GRANITE_CALL: &str = "<|tool_call|>";
/// The tag around Nemotron's list of calls.
const NEMOTRON_CALL: &str = "<TOOLCALL>";

/// `s` as a Lark string literal (a JSON string is one).
pub(crate) fn lark_literal(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// The names a tool's schema requires.
pub(crate) fn required_of(schema: &Value) -> Vec<&str> {
    schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// A notation of keyword arguments of a model's own (Gemma 4's
/// `key:value`, Python's `key=value`): how a forcing grammar writes each.
pub(crate) trait Keywords {
    /// Between arguments.
    const SEP: &'static str;
    /// Keys sorted (as Gemma 4's template writes them), else in the
    /// schema's order.
    const SORTED: bool;
    /// The text before a value: the key and its separator.
    fn key(&self, key: &str) -> String;
    /// One of a string `enum`'s texts, as a value.
    fn text(&self, text: &str) -> String;
    /// A string of `min` to `max` characters (rules it needs go to `g`,
    /// named from `rule`); any string when neither bound is given.
    fn string(&self, g: &mut String, rule: &str, min: Option<u64>, max: Option<u64>) -> String;
    /// The rule for an integer, a number and a boolean.
    fn scalar(&self, ty: &str) -> Option<&'static str>;
    /// Any other value, by its schema.
    fn other(&self, g: &mut String, rule: &str, schema: &Value) -> String;
}

/// What goes between tool `i`'s call brackets in notation `n`: a rule per
/// argument (`f{i}_{j}`, its key and a value its schema types) and the chain
/// that keeps them in order, the required ones always.
pub(crate) fn keyword_args<K: Keywords>(g: &mut String, i: usize, tool: &Tool, n: &K) -> String {
    let schema = tool.parameters_value();
    let required = required_of(&schema);
    let mut props: Vec<(&String, &Value)> = schema
        .get("properties")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .collect();
    if K::SORTED {
        props.sort_by(|a, b| a.0.cmp(b.0));
    }
    for (j, (key, sub)) in props.iter().enumerate() {
        let rule = format!("f{i}_{j}");
        let texts = sub.get("enum").and_then(Value::as_array);
        let value = match (param_type(sub), texts) {
            ("string", Some(texts)) if !texts.is_empty() => {
                let alts: Vec<String> = texts
                    .iter()
                    .filter_map(Value::as_str)
                    .map(|t| lark_literal(&n.text(t)))
                    .collect();
                format!("({})", alts.join(" | "))
            }
            ("string", _) => {
                let bound = |k: &str| sub.get(k).and_then(Value::as_u64);
                n.string(g, &rule, bound("minLength"), bound("maxLength"))
            }
            (ty, _) => match n.scalar(ty) {
                Some(r) => r.to_string(),
                None => n.other(g, &rule, sub),
            },
        };
        g.push_str(&format!("{rule}: {} {value}\n", lark_literal(&n.key(key))));
    }
    let flags: Vec<bool> = props
        .iter()
        .map(|(k, _)| required.contains(&k.as_str()))
        .collect();
    ordered_items(g, &format!("f{i}"), &flags, &lark_literal(K::SEP))
}

/// Rules for a call's arguments in a fixed order, some optional, the items
/// being rules `{rule}_{j}`: `{rule}_a{k}` derives the items from `k` on,
/// the first of them present, each later one after `sep` (a Lark
/// literal). Returns what goes between the call's brackets: nothing for
/// no items, optional when every item is.
pub(crate) fn ordered_items(g: &mut String, rule: &str, required: &[bool], sep: &str) -> String {
    let n = required.len();
    let tail = |from: usize| -> String {
        (from..n)
            .map(|j| {
                if required[j] {
                    format!(" {sep} {rule}_{j}")
                } else {
                    format!(" ({sep} {rule}_{j})?")
                }
            })
            .collect()
    };
    for (k, &req) in required.iter().enumerate() {
        let here = format!("{rule}_{k}{}", tail(k + 1));
        if req || k + 1 == n {
            g.push_str(&format!("{rule}_a{k}: {here}\n"));
        } else {
            g.push_str(&format!("{rule}_a{k}: {here} | {rule}_a{}\n", k + 1));
        }
    }
    match (n, required.iter().all(|r| !r)) {
        (0, _) => String::new(),
        (_, true) => format!(" {rule}_a0?"),
        _ => format!(" {rule}_a0"),
    }
}

/// `s` as a Lark literal in a sequence: nothing when it is empty.
fn seq_literal(s: &str) -> String {
    if s.is_empty() {
        String::new()
    } else {
        lark_literal(s)
    }
}

/// The JSON layout forced calls are written in, in llguidance's
/// `x-guidance` terms (as `siliceo-constrain` lays out JSON schemas): `", "`,
/// `": "`, no free whitespace.
fn json_layout() -> Value {
    serde_json::json!({
        "item_separator": ", ",
        "key_separator": ": ",
        "whitespace_flexible": false,
    })
}

/// How a forced XML call is laid out (the text around its parts).
struct XmlLayout {
    /// Before the function's name.
    open: &'static str,
    /// After it.
    name_end: &'static str,
    /// After the parameters.
    close: &'static str,
    /// Between calls.
    between: &'static str,
    /// A parameter's key before it, and after it to the value.
    key: (&'static str, &'static str),
    /// What a value written by the layout (not the model) ends with before
    /// the value's closing tag (Qwen3-Coder's newline).
    value_nl: &'static str,
    /// The closing tag, and the layout after it.
    value_end: &'static str,
}

/// Qwen3-Coder's layout: `<tool_call>\n<function=NAME>\n<parameter=KEY>\n
/// VALUE\n</parameter>\n…</function>\n</tool_call>`.
const QWEN_LAYOUT: XmlLayout = XmlLayout {
    open: "<tool_call>\n<function=",
    name_end: ">\n",
    close: "</function>\n</tool_call>",
    between: "\n",
    key: ("<parameter=", ">\n"),
    value_nl: "\n",
    value_end: "</parameter>\n",
};

/// GLM-4.5's: `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE
/// </arg_value>\n…</tool_call>`.
const GLM45_LAYOUT: XmlLayout = XmlLayout {
    open: "<tool_call>",
    name_end: "\n",
    close: "</tool_call>",
    between: "\n",
    key: ("<arg_key>", "</arg_key>\n<arg_value>"),
    value_nl: "",
    value_end: "</arg_value>\n",
};

/// GLM-4.7's: the same without the newlines.
const GLM47_LAYOUT: XmlLayout = XmlLayout {
    open: "<tool_call>",
    name_end: "",
    close: "</tool_call>",
    between: "",
    key: ("<arg_key>", "</arg_key><arg_value>"),
    value_nl: "",
    value_end: "</arg_value>",
};

/// A forced call in [`ToolSyntax::QwenXml`]'s shape to one of `tools`.
fn xml_grammar(tools: &[&Tool], parallel: bool) -> String {
    xml_calls(tools, parallel, &QWEN_LAYOUT)
}

/// A forced call in GLM's shape to one of `tools` (`compact`: GLM-4.7's).
fn glm_grammar(tools: &[&Tool], parallel: bool, compact: bool) -> String {
    xml_calls(
        tools,
        parallel,
        if compact {
            &GLM47_LAYOUT
        } else {
            &GLM45_LAYOUT
        },
    )
}

/// A forced XML call laid out as `layout` says to one of `tools`: its
/// parameters in the schema's order, the required ones always, each value
/// text up to its closing tag when the schema says `string` (or says
/// nothing), else JSON following the parameter's schema.
fn xml_calls(tools: &[&Tool], parallel: bool, layout: &XmlLayout) -> String {
    let lit = |s: &str| lark_literal(s);
    let repeat = if parallel {
        format!(" ({} call)*", seq_literal(layout.between))
    } else {
        String::new()
    };
    let mut g = format!(
        "start: call{repeat}\ncall: {} func {}\n",
        lit(layout.open),
        lit(layout.close)
    );
    let fns: Vec<String> = (0..tools.len()).map(|i| format!("f{i}")).collect();
    g.push_str(&format!("func: {}\n", fns.join(" | ")));
    let end = lit(layout.value_end);
    // Text to the first closing tag (with the layout's newline before the
    // tag, which the reader drops, optional as there).
    g.push_str(&format!("text[lazy]: /(.|\\n)*/ {end}\n"));
    for (i, t) in tools.iter().enumerate() {
        let schema = t.parameters_value();
        let required = required_of(&schema);
        let mut seq = vec![lit(&format!("{}{}", t.name, layout.name_end))];
        let props = schema.get("properties").and_then(Value::as_object);
        for (j, (key, sub)) in props.into_iter().flatten().enumerate() {
            let rule = format!("f{i}_{j}");
            let value = if param_type(sub) == "string" {
                string_value(&mut g, &rule, sub, layout)
            } else {
                let mut sub = sub.clone();
                if let Some(o) = sub.as_object_mut() {
                    o.insert("x-guidance".into(), json_layout());
                }
                g.push_str(&format!("{rule}_v: %json {sub}\n"));
                format!("{rule}_v {} {end}", seq_literal(layout.value_nl))
            };
            let head = lit(&format!("{}{key}{}", layout.key.0, layout.key.1));
            g.push_str(&format!("{rule}: {head} {value}\n"));
            let optional = if required.contains(&key.as_str()) {
                ""
            } else {
                "?"
            };
            seq.push(format!("{rule}{optional}"));
        }
        g.push_str(&format!("f{i}: {}\n", seq.join(" ")));
    }
    g
}

/// A forced call in [`ToolSyntax::Harmony`]'s shape to one of `tools`
/// (one per turn: the call ends the generation), after an analysis
/// message if the model thinks first.
fn harmony_grammar(tools: &[&Tool]) -> String {
    let mut g = String::from(
        "start: analysis? call\n\
         analysis: \"<|channel|>analysis<|message|>\" thought \"<|start|>assistant\"\n\
         thought[lazy]: /(.|\\n)*/ \"<|end|>\"\n\
         call: \"<|channel|>commentary to=functions.\" ",
    );
    named_calls(&mut g, tools, |name| {
        format!("{name} <|constrain|>json<|message|>")
    });
    g
}

/// Ends a rule with one alternative per tool, `(f0 | f1 | …)`, and adds
/// the rules: `fI` is `head(name)` then the arguments by the tool's schema.
fn named_calls(g: &mut String, tools: &[&Tool], head: impl Fn(&str) -> String) {
    let alts: Vec<String> = (0..tools.len()).map(|i| format!("f{i}")).collect();
    g.push_str(&format!("({})\n", alts.join(" | ")));
    for (i, t) in tools.iter().enumerate() {
        let mut args = t.parameters_value();
        if let Some(o) = args.as_object_mut() {
            o.insert("x-guidance".into(), json_layout());
        }
        let head = lark_literal(&head(&t.name));
        g.push_str(&format!(
            "f{i}: {head} f{i}_args\nf{i}_args: %json {args}\n"
        ));
    }
}

/// An XML string value up to its closing tag, as `schema` bounds it: one
/// of its `enum` texts, or `minLength` to `maxLength` characters (rule
/// `{rule}_v`), or any text (`text`).
fn string_value(g: &mut String, rule: &str, schema: &Value, layout: &XmlLayout) -> String {
    let (nl, end) = (seq_literal(layout.value_nl), lark_literal(layout.value_end));
    if let Some(texts) = schema.get("enum").and_then(Value::as_array) {
        let lits: Vec<String> = texts
            .iter()
            .filter_map(Value::as_str)
            .map(lark_literal)
            .collect();
        if !lits.is_empty() {
            return format!("({}) {nl} {end}", lits.join(" | "));
        }
    }
    let bound = |k: &str| schema.get(k).and_then(Value::as_u64);
    match (bound("minLength"), bound("maxLength")) {
        (None, None) => "text".to_string(),
        (min, max) => {
            let (min, max) = (
                min.unwrap_or(0),
                max.map_or(String::new(), |m| m.to_string()),
            );
            let nl = if layout.value_nl.is_empty() {
                ""
            } else {
                "\\n?"
            };
            g.push_str(&format!(
                "{rule}_v[lazy]: /(.|\\n){{{min},{max}}}{nl}/ {end}\n"
            ));
            format!("{rule}_v")
        }
    }
}

/// The type a parameter's schema gives its values (`string` when it gives
/// none, or only `null` beside it).
pub(crate) fn param_type(schema: &Value) -> &str {
    match schema.get("type") {
        Some(Value::String(t)) => t,
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .unwrap_or("string"),
        _ => "string",
    }
}

/// The longest tail of `text` that may begin one of `markers` (what a
/// streaming reader holds back).
pub(crate) fn held_tail_len(text: &str, markers: &[&str]) -> usize {
    markers
        .iter()
        .map(|m| siliceo_core::held_prefix_len(text, m))
        .max()
        .unwrap_or(0)
}

/// The earliest of `markers` in `text`.
pub(crate) fn find_first<'a>(text: &str, markers: &[&'a str]) -> Option<(usize, &'a str)> {
    markers
        .iter()
        .filter_map(|m| text.find(m).map(|at| (at, *m)))
        .min_by_key(|(at, _)| *at)
}

/// One call or a list of calls, each call's arguments as written.
pub(crate) fn calls_of(body: &str) -> Option<Vec<(String, String)>> {
    let text = body.trim_start();
    if text.starts_with('[') {
        let items: Vec<&RawValue> = serde_json::from_str(text).ok()?;
        if items.is_empty() {
            return None;
        }
        items.iter().map(|i| call_of_text(i.get())).collect()
    } else {
        Some(vec![call_of_text(text)?])
    }
}

/// `{"name": …, "arguments": {…}}` (or `parameters`, as some models
/// write; Command R's `tool_name`), its arguments' JSON text as written;
/// `None` when `item` is no such object.
pub(crate) fn call_of_text(item: &str) -> Option<(String, String)> {
    let fields: std::collections::HashMap<String, &RawValue> = serde_json::from_str(item).ok()?;
    let name = fields.get("name").or_else(|| fields.get("tool_name"))?;
    let name: String = serde_json::from_str(name.get()).ok()?;
    // `arguments` is required: `{"name": "Bob"}` in an answer is data.
    let args = fields
        .get("arguments")
        .or_else(|| fields.get("parameters"))?;
    let args = match serde_json::from_str::<Value>(args.get()).ok()? {
        // Some models write the arguments as a JSON string already.
        Value::String(s) if serde_json::from_str::<Value>(&s).is_ok() => s,
        _ => args.get().to_string(),
    };
    Some((name, args))
}
