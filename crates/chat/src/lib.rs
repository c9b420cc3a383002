//! Chat for siliceo-infer: messages and tools rendered through the model's
//! own chat template, and the tool calls models write parsed back.
//!
//! A GGUF carries its chat template as Jinja (`tokenizer.chat_template`,
//! written for Hugging Face's `transformers`). [`ChatTemplate`] renders it
//! with minijinja in that dialect: blocks trimmed and left-stripped,
//! Python's string and dict methods (`.strip()`, `.items()`), `tojson`
//! written as Python's `json.dumps` writes it, `raise_exception`, and the
//! variables `messages`, `tools`, `add_generation_prompt`, `bos_token`,
//! `eos_token`.
//!
//! [`ToolSyntax`] knows how a model family writes tool calls (detected from
//! the template): it parses them out of generated text and builds the
//! [`Constraint`] that forces a call whose arguments follow the tool's JSON
//! schema (`tool_choice: required` or a named function).
//!
//! ```
//! use siliceo_chat::{ChatTemplate, Message};
//!
//! let source = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}\
//!               {% if add_generation_prompt %}<|assistant|>{% endif %}";
//! let t = ChatTemplate::new(source, "<s>", "</s>")?;
//! let text = t.render(&[Message::new("user", "Hi")], &[], true)?;
//! assert_eq!(text, "<|user|>Hi\n<|assistant|>");
//! # Ok::<(), siliceo_chat::ChatError>(())
//! ```
//!
//! **Architecture invariant:** knows nothing of llama.cpp or any protocol.
#![deny(missing_docs)]

mod calls;
mod fit;
mod gemma4;
mod harmony;
mod json;
mod pythonic;
mod reasoning;
mod router;
#[cfg(test)]
mod testing;
mod tools;

use std::fmt;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};
pub use siliceo_core::Constraint;

pub use calls::{CallParser, CallPiece};
pub use harmony::HarmonyReader;
pub use reasoning::{Split, THINK_CLOSE, THINK_OPEN, ThinkSplitter, ThinkTags};
pub use router::{OutputRouter, Routed};
pub use tools::{ParsedOutput, ToolChoice, ToolSyntax};

/// Why a template could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChatError {
    /// The template does not compile.
    #[error("the model's chat template does not compile: {0}")]
    Template(String),
    /// Rendering failed (the template raised, or a message is not what it
    /// accepts, e.g. roles that do not alternate).
    #[error("the model's chat template refused the conversation: {0}")]
    Render(String),
    /// Tools were given to a template that has no tool syntax.
    #[error("the model's chat template has no tool-call syntax siliceo knows")]
    NoToolSyntax,
    /// [`ChatEnd::Continue`] on a conversation whose final message cannot
    /// be continued.
    #[error("the final message cannot be continued: {0}")]
    Continue(String),
}

/// How a rendered conversation ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChatEnd {
    /// The assistant's turn opened (`add_generation_prompt`): the model
    /// answers the conversation.
    #[default]
    Answer,
    /// The final message, an assistant's, left open: the model continues
    /// its text (vLLM's `continue_final_message`, Anthropic's prefill).
    Continue,
    /// As the template ends the last message, no turn opened.
    Closed,
}

/// A tool call an assistant message made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Its id (`call_…`), echoed by the tool's answer.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// Its arguments as JSON text.
    pub arguments: String,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Its text (absent in an assistant message that only calls tools).
    pub content: Option<String>,
    /// Tool calls (assistant messages).
    pub tool_calls: Vec<ToolCall>,
    /// The call this message answers (tool messages).
    pub tool_call_id: Option<String>,
    /// The tool's name (tool messages, optional).
    pub name: Option<String>,
    /// An assistant's thinking before this message, given back (templates
    /// see it as `reasoning_content`, as Qwen3's reads it, and as
    /// `thinking`, as gpt-oss's does; each decides when to render it).
    #[serde(default)]
    pub reasoning: Option<String>,
}

/// The roles a client may give a message. `developer` is OpenAI's newer name
/// for `system` and reaches the template as `system`.
pub const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

impl Message {
    /// A client's message, checked before it reaches a template: its role is
    /// one of [`ROLES`] (`developer` becomes `system`), and it has content
    /// unless it is an assistant message that calls tools (OpenAI's rule; a
    /// template would otherwise fail on the missing text, or drop the turn).
    /// The error names the field (`role` or `content`) and says why.
    pub fn checked(mut self) -> Result<Message, (&'static str, String)> {
        let role = self.role.as_str();
        if !ROLES.contains(&role) {
            return Err((
                "role",
                format!("`{role}` is not one of {}", ROLES.join(", ")),
            ));
        }
        if self.content.is_none() {
            match role {
                "assistant" if !self.tool_calls.is_empty() => {}
                "assistant" => {
                    return Err((
                        "content",
                        "an assistant message needs content or tool_calls".into(),
                    ));
                }
                r => return Err(("content", format!("a `{r}` message needs content"))),
            }
        }
        if role == "developer" {
            self.role = "system".into();
        }
        Ok(self)
    }

    /// A plain message.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: Some(content.into()),
            ..Message::default()
        }
    }

    /// The message as the template sees it (OpenAI's shape, arguments
    /// parsed to objects as `transformers` passes them), adapted as `fit`
    /// says.
    fn to_value(&self, fit: &fit::Fit) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        m.insert("role".into(), self.role.clone().into());
        let content = match &self.content {
            Some(c) => c.clone().into(),
            None if fit.empty_text => "".into(),
            None => serde_json::Value::Null,
        };
        m.insert("content".into(), content);
        if let Some(r) = &self.reasoning {
            m.insert("reasoning_content".into(), r.clone().into());
            m.insert("thinking".into(), r.clone().into());
        }
        if !self.tool_calls.is_empty() {
            let calls: Vec<serde_json::Value> = self
                .tool_calls
                .iter()
                .map(|c| {
                    let args = match serde_json::from_str(&c.arguments) {
                        Ok(v) if !fit.text_args => v,
                        _ => serde_json::Value::String(c.arguments.clone()),
                    };
                    serde_json::json!({
                        "id": fit.id(&c.id),
                        "type": "function",
                        "function": {"name": c.name, "arguments": args},
                    })
                })
                .collect();
            m.insert("tool_calls".into(), calls.into());
        }
        if let Some(id) = &self.tool_call_id {
            m.insert("tool_call_id".into(), fit.id(id).into());
        }
        if let Some(n) = &self.name {
            m.insert("name".into(), n.clone().into());
        }
        m.into()
    }
}

/// A function the model may call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tool {
    /// Its name.
    pub name: String,
    /// What it does.
    pub description: Option<String>,
    /// Its arguments' JSON schema (an object schema), as JSON text.
    pub parameters: String,
}

/// Client tools, checked: each name 1 to 64 letters, digits, `_` or `-`,
/// and given once; each schema (absent: no arguments) a JSON object. The
/// error gives the tool's index, the field (`name`, `parameters`) and why.
pub fn checked_tools(
    tools: impl IntoIterator<Item = (String, Option<String>, Option<serde_json::Value>)>,
) -> Result<Vec<Tool>, (usize, &'static str, String)> {
    let mut out: Vec<Tool> = Vec::new();
    for (i, (name, description, parameters)) in tools.into_iter().enumerate() {
        let ok_name = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !ok_name {
            return Err((i, "name", "1 to 64 letters, digits, `_` or `-`".into()));
        }
        if out.iter().any(|o| o.name == name) {
            return Err((i, "name", format!("`{name}` is defined twice")));
        }
        let parameters =
            parameters.unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}}));
        if !parameters.is_object() {
            return Err((i, "parameters", "must be a JSON schema object".into()));
        }
        out.push(Tool {
            name,
            description,
            parameters: parameters.to_string(),
        });
    }
    Ok(out)
}

impl ToolChoice {
    /// Whether this choice can be met with `tools`: a required call needs
    /// tools, a named one a tool of that name.
    pub fn check(&self, tools: &[Tool]) -> Result<(), String> {
        match self {
            ToolChoice::Required | ToolChoice::Function(_) if tools.is_empty() => {
                Err("a tool call was required but no tools were given".into())
            }
            ToolChoice::Function(name) if !tools.iter().any(|t| &t.name == name) => {
                Err(format!("no tool named `{name}` in tools"))
            }
            _ => Ok(()),
        }
    }
}

impl Tool {
    fn parameters_value(&self) -> serde_json::Value {
        serde_json::from_str(&self.parameters)
            .unwrap_or_else(|_| serde_json::json!({"type": "object"}))
    }

    /// OpenAI's shape, as templates expect it; a tool without a
    /// description gets an empty one where the template needs one.
    fn to_value(&self, fit: &fit::Fit) -> serde_json::Value {
        let mut f = serde_json::Map::new();
        f.insert("name".into(), self.name.clone().into());
        match &self.description {
            Some(d) => {
                f.insert("description".into(), d.clone().into());
            }
            None if fit.described => {
                f.insert("description".into(), "".into());
            }
            None => {}
        }
        f.insert("parameters".into(), self.parameters_value());
        serde_json::json!({"type": "function", "function": f})
    }
}

/// A model's chat template, compiled once.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    tools: Option<ToolSyntax>,
    /// The tags of the thinking blocks the template knows (the model
    /// reasons), if any.
    think: Option<ThinkTags>,
    /// The template argument that switches its thinking on and off, if
    /// any (found by rendering with it on and off).
    switch: Option<&'static str>,
    /// Its thinking is on when the switch is not set (Qwen3's is;
    /// DeepSeek-V3.1's and Granite's are off).
    on_by_default: bool,
    /// Its prompt, without template arguments, leaves a block open.
    opens: bool,
    /// What it needs beyond what `transformers` passes (found by
    /// rendering probes; see the `fit` module).
    fit: fit::Fit,
    /// It takes an effort level, `reasoning_effort` (gpt-oss's does).
    effort: bool,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("tools", &self.tools)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source` (Jinja); `bos` and `eos` are the text of the
    /// model's BOS and EOS tokens. Probe conversations are rendered once
    /// to find what the template needs beyond what `transformers` passes
    /// ([`ChatTemplate::adaptations`]): a template that fails on a shape
    /// OpenAI's clients send and renders once it is adapted gets it adapted.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ChatError::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        // As Python's jinja2: `none` (what `tools` is without tools) is not
        // iterable, an undefined value is (it iterates as empty); minijinja's
        // own test says both are.
        env.add_test("iterable", |v: &Value| {
            use minijinja::value::ValueKind as K;
            match v.kind() {
                K::Undefined | K::String | K::Bytes | K::Seq | K::Map | K::Iterable => true,
                K::Plain => v.try_iter().is_ok(),
                _ => false,
            }
        });
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |_fmt: String| {
            // Templates print today's date in their system prompt; a fixed
            // date keeps prompts (and prefix-cache hits) stable.
            "01 Jan 2026".to_string()
        });
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ChatError::Template(describe(&e)))?;
        let mut t = ChatTemplate {
            env,
            bos: bos.to_string(),
            eos: eos.to_string(),
            tools: ToolSyntax::detect(source),
            think: ThinkTags::of_template(source),
            switch: None,
            on_by_default: true,
            opens: false,
            fit: fit::Fit::default(),
            effort: source.contains(Self::EFFORT),
        };
        // Most requests set no template argument: probed once, here.
        t.opens = t.probe_opens(&serde_json::Map::new());
        t.switch = Self::THINKING_SWITCHES
            .into_iter()
            .find(|name| source.contains(name) && t.switched_by(name));
        if let Some(name) = t.switch {
            let hi = [Message::new("user", "Hi")];
            let mut on = serde_json::Map::new();
            on.insert(name.into(), true.into());
            let none = serde_json::Map::new();
            t.on_by_default = t.render_with(&hi, &[], true, &none).ok()
                == t.render_with(&hi, &[], true, &on).ok();
        }
        t.probe_fit();
        if t.tools.is_none() {
            t.tools = t.probe_tool_syntax();
        }
        Ok(t)
    }

    /// Finds what the template needs (see the `fit` module): the fewest
    /// call adaptations that let a call and its result render, a
    /// description for a tool without one, system messages folded.
    fn probe_fit(&mut self) {
        let none = serde_json::Map::new();
        let result = Message {
            role: "tool".into(),
            content: Some("1".into()),
            tool_call_id: Some("call_0".into()),
            name: Some(Self::PROBE.into()),
            ..Message::default()
        };
        let call = [Message::new("user", "Hi"), Self::probe_call(), result];
        // The fewest adaptations under which the call renders (its name is
        // in the text: an adaptation that only sends the template down a
        // branch that drops the call does not count), else under which the
        // chat renders at all (a template that writes no calls).
        let shows = |t: &Self, whole: bool| {
            t.render_with(&call, &[], true, &none)
                .is_ok_and(|text| !whole || text.contains(Self::PROBE))
        };
        self.fit = [true, false]
            .into_iter()
            .find_map(|whole| {
                fit::Fit::for_calls().find(|&fit| {
                    self.fit = fit;
                    shows(self, whole)
                })
            })
            .unwrap_or_default();
        let renders = |t: &Self, chat: &[Message], tools: &[Tool]| {
            t.render_with(chat, tools, true, &none).is_ok()
        };
        if self.tools.is_some() {
            let bare = Tool {
                name: Self::PROBE.into(),
                description: None,
                parameters: r#"{"type": "object", "properties": {}}"#.into(),
            };
            let hi = [Message::new("user", "Hi")];
            self.adapt(
                |f| &mut f.described,
                |t| renders(t, &hi, std::slice::from_ref(&bare)),
            );
        }
        let system = [
            Message::new("system", "Be brief."),
            Message::new("user", "Hi"),
        ];
        self.adapt(|f| &mut f.fold_system, |t| renders(t, &system, &[]));
        // A call with text and thinking both (gpt-oss's refuses them).
        let mut both = call.clone();
        both[1].content = Some("Let me look.".into());
        both[1].reasoning = Some("Hm.".into());
        self.adapt(|f| &mut f.join_thought, |t| renders(t, &both, &[]));
    }

    /// Turns the adaptation `flag` on when the template fails the probe
    /// `renders` without it and passes with it.
    fn adapt(&mut self, flag: fn(&mut fit::Fit) -> &mut bool, renders: impl Fn(&Self) -> bool) {
        if !renders(self) {
            *flag(&mut self.fit) = true;
            let ok = renders(self);
            *flag(&mut self.fit) = ok;
        }
    }

    /// What the template is given beyond what `transformers` passes (see
    /// [`ChatTemplate::new`]): `empty_text` (a message without text is
    /// empty text), `text_args` (a call's arguments are JSON text),
    /// `short_ids` (call ids are 9 letters and digits), `described` (a tool
    /// without a description has an empty one), `fold_system` (system
    /// messages join the first user message), `join_thought` (a call's
    /// text joins its thinking). Empty for most templates.
    pub fn adaptations(&self) -> Vec<&'static str> {
        self.fit.names()
    }

    /// The name the probes give a function.
    const PROBE: &'static str = "siliceo_probe";

    /// An assistant's message that calls [`ChatTemplate::PROBE`], with no
    /// text.
    fn probe_call() -> Message {
        Message {
            role: "assistant".into(),
            tool_calls: vec![ToolCall {
                id: "call_0".into(),
                name: Self::PROBE.into(),
                arguments: r#"{"arg": 1}"#.into(),
            }],
            ..Message::default()
        }
    }

    /// The tool syntax a template that names no marker writes calls in:
    /// seen in how it renders an assistant's call.
    fn probe_tool_syntax(&self) -> Option<ToolSyntax> {
        let chat = [Message::new("user", "Hi"), Self::probe_call()];
        let text = self
            .render_with(&chat, &[], false, &serde_json::Map::new())
            .ok()?;
        ToolSyntax::of_rendered_call(&text, Self::PROBE)
    }

    /// Whether the model thinks in `<think>` (or `[THINK]`) blocks before
    /// it answers (its template knows them).
    pub fn reasons(&self) -> bool {
        self.think.is_some()
    }

    /// The tags the model thinks in, when it does.
    pub fn think_tags(&self) -> Option<ThinkTags> {
        self.think
    }

    /// The template argument that turns thinking on or off (Qwen3's).
    pub const THINKING_SWITCH: &'static str = "enable_thinking";

    /// The names templates give their thinking switch: Qwen3's (and
    /// Nemotron's, Apertus's), then DeepSeek-V3.1's and Granite 3.3's.
    pub const THINKING_SWITCHES: [&'static str; 2] = [Self::THINKING_SWITCH, "thinking"];

    /// Whether a one-message chat's prompt differs with `name` on and off.
    fn switched_by(&self, name: &str) -> bool {
        let hi = [Message::new("user", "Hi")];
        let with = |on: bool| {
            let mut kw = serde_json::Map::new();
            kw.insert(name.into(), on.into());
            self.render_with(&hi, &[], true, &kw).ok()
        };
        let (on, off) = (with(true), with(false));
        on.is_some() && off.is_some() && on != off
    }

    /// The template argument that sets how hard the model thinks
    /// (gpt-oss's: `low`, `medium`, `high`).
    pub const EFFORT: &'static str = "reasoning_effort";

    /// Whether the template takes [`ChatTemplate::EFFORT`].
    pub fn takes_effort(&self) -> bool {
        self.effort
    }

    /// Whether the template has a thinking switch.
    pub fn has_thinking_switch(&self) -> bool {
        self.switch.is_some()
    }

    /// The template argument that switches its thinking on and off (one of
    /// [`ChatTemplate::THINKING_SWITCHES`]), if it has one.
    pub fn thinking_switch(&self) -> Option<&'static str> {
        self.switch
    }

    /// Whether a chat rendered with `kwargs` lets the model think: its
    /// switch on (set so, or on by default), or no switch (the model
    /// decides). False for a template that knows no thinking.
    pub fn thinking_on(&self, kwargs: &serde_json::Map<String, serde_json::Value>) -> bool {
        if self.think.is_none() {
            return false;
        }
        match self.switch.and_then(|name| kwargs.get(name)) {
            Some(v) => v.as_bool().unwrap_or(!v.is_null()),
            None => self.switch.is_none() || self.on_by_default,
        }
    }

    /// Whether a chat's prompt, rendered with `kwargs`, leaves a thinking
    /// block open (DeepSeek-R1's template does; Qwen3's lets the model open
    /// it, or closes an empty one when `enable_thinking` is false).
    pub fn opens_thinking(&self, kwargs: &serde_json::Map<String, serde_json::Value>) -> bool {
        if kwargs.is_empty() {
            self.opens
        } else {
            self.probe_opens(kwargs)
        }
    }

    /// Renders a one-message chat with `kwargs` to see whether its prompt
    /// ends inside a thinking block.
    fn probe_opens(&self, kwargs: &serde_json::Map<String, serde_json::Value>) -> bool {
        self.think.is_some_and(|tags| {
            self.render_with(&[Message::new("user", "x")], &[], true, kwargs)
                .is_ok_and(|t| t.trim_end().ends_with(tags.open))
        })
    }

    /// How the model writes tool calls (`None`: the template knows no tools).
    pub fn tool_syntax(&self) -> Option<ToolSyntax> {
        self.tools
    }

    /// The text of the model's BOS token.
    pub fn bos(&self) -> &str {
        &self.bos
    }

    /// Renders a conversation, with `tools` offered (empty: none), ending
    /// with the assistant's turn opened when `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[Message],
        tools: &[Tool],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        self.render_with(
            messages,
            tools,
            add_generation_prompt,
            &serde_json::Map::new(),
        )
    }

    /// The variables a template always gets; [`ChatTemplate::render_with`]'s
    /// `kwargs` may not set them.
    pub const RESERVED: [&'static str; 5] = [
        "messages",
        "tools",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
    ];

    /// [`ChatTemplate::render_with`], ending as `end` says. To continue
    /// the final message, the conversation is rendered closed and cut right
    /// after that message's text (or its trimmed text, for templates that
    /// trim), as `transformers` does for `continue_final_message`. That
    /// message must be an assistant's, with text and no tool calls.
    pub fn render_ending(
        &self,
        messages: &[Message],
        tools: &[Tool],
        end: ChatEnd,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ChatError> {
        if end != ChatEnd::Continue {
            return self.render_with(messages, tools, end == ChatEnd::Answer, kwargs);
        }
        let last = messages
            .last()
            .ok_or_else(|| ChatError::Continue("there are no messages".into()))?;
        if last.role != "assistant" {
            return Err(ChatError::Continue(format!(
                "it is a `{}` message, not an assistant's",
                last.role
            )));
        }
        if !last.tool_calls.is_empty() {
            return Err(ChatError::Continue("it calls tools".into()));
        }
        let content = last.content.as_deref().unwrap_or_default();
        if content.trim().is_empty() {
            return Err(ChatError::Continue("it has no text".into()));
        }
        let text = self.render_with(messages, tools, false, kwargs)?;
        [content, content.trim()]
            .into_iter()
            .find_map(|c| text.rfind(c).map(|at| text[..at + c.len()].to_string()))
            .ok_or_else(|| {
                ChatError::Continue("the chat template does not write its text as given".into())
            })
    }

    /// Why `kwargs` cannot go to a template: the first name in
    /// [`ChatTemplate::RESERVED`] among them.
    pub fn refused_kwarg(kwargs: &serde_json::Map<String, serde_json::Value>) -> Option<String> {
        kwargs
            .keys()
            .find(|k| Self::RESERVED.contains(&k.as_str()))
            .map(|k| format!("`{k}` is set by the server, not by template arguments"))
    }

    /// [`ChatTemplate::render`] with more variables for the template
    /// (`chat_template_kwargs`, such as Qwen3's `enable_thinking`). A name in
    /// [`ChatTemplate::RESERVED`] is an error.
    pub fn render_with(
        &self,
        messages: &[Message],
        tools: &[Tool],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ChatError> {
        if let Some(why) = Self::refused_kwarg(kwargs) {
            return Err(ChatError::Render(why));
        }
        if !tools.is_empty() && self.tools.is_none() {
            return Err(ChatError::NoToolSyntax);
        }
        let msgs: Vec<serde_json::Value> = self
            .fit
            .messages(messages)
            .iter()
            .map(|m| m.to_value(&self.fit))
            .collect();
        let tools_v: Option<Vec<serde_json::Value>> =
            (!tools.is_empty()).then(|| tools.iter().map(|t| t.to_value(&self.fit)).collect());
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ChatError::Template(describe(&e)))?;
        let ctx = minijinja::context! {
            messages => Value::from(minijinja::value::Serde(&msgs)),
            tools => Value::from(minijinja::value::Serde(&tools_v)),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.clone(),
            eos_token => self.eos.clone(),
            ..Value::from(minijinja::value::Serde(kwargs))
        };
        tmpl.render(ctx)
            .map_err(|e| ChatError::Render(describe(&e)))
    }
}

/// minijinja's message with its cause chain, on one line.
fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(cause) = src {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        src = cause.source();
    }
    s
}

/// `tojson` as `transformers` defines it: Python's `json.dumps` with
/// `ensure_ascii=False` (no HTML escaping), `indent` and `sort_keys` honoured.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let v = serde_json::to_value(value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from_safe_string(json::python_dumps(
        &v,
        indent,
        sort_keys.unwrap_or(false),
    )))
}

#[cfg(test)]
mod tests;
