//! Anthropic's Messages API: `POST /v1/messages` (whole, or streamed as its
//! typed events) and `POST /v1/messages/count_tokens`, for clients written
//! against it (the `anthropic` SDKs, and the tools built on them).
//!
//! A request runs as a chat: `system`, then `messages`, whose content blocks
//! become chat messages (`tool_use` blocks an assistant's tool calls,
//! `tool_result` blocks tool messages). The answer is content blocks: a
//! reasoning model's `thinking`, the `text`, and `tool_use` calls. Errors
//! come in Anthropic's shape (`{"type": "error", "error": {"type",
//! "message"}}`), with the statuses of the OpenAI endpoints. What cannot be
//! served (images and documents, server tools, MCP servers, containers) is
//! a 400 naming it.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use siliceo_core::FinishReason;
use siliceo_runtime::{
    CallPiece, ChatEnd, Event, GenerateRequest, Input, Message as ChatMessage, RuntimeError, Tool,
    ToolCall, ToolChoice, Usage,
};

use crate::error::ApiError;
use crate::openai::{self, Common, Plan};
use crate::stream::{EventMachine, Parsing, TypedEvents};
use crate::{AppState, body_json, field_of, uuid_like};

/// An error in Anthropic's shape.
pub(crate) struct AnthropicError(ApiError);

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        AnthropicError(e)
    }
}

impl AnthropicError {
    /// Anthropic's error type for a status.
    fn kind(&self) -> &'static str {
        match self.0.status {
            StatusCode::BAD_REQUEST => "invalid_request_error",
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            _ => "api_error",
        }
    }

    fn body(&self) -> Value {
        json!({"type": "error", "error": {"type": self.kind(), "message": self.0.message}})
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        let body = self.body();
        let mut r = (self.0.status, Json(body)).into_response();
        if let Some(s) = self.0.retry_after_s {
            r.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, s.into());
        }
        r
    }
}

/// `POST /v1/messages`: what is read beside the model and sampling.
#[derive(Debug, Deserialize)]
struct MessagesRequest {
    model: Option<String>,
    max_tokens: Option<u32>,
    messages: Option<Vec<Value>>,
    system: Option<Value>,
    stop_sequences: Option<Vec<String>>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u32>,
    #[serde(default, deserialize_with = "openai::or_default")]
    stream: bool,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    thinking: Option<Value>,
    container: Option<Value>,
    mcp_servers: Option<Value>,
    /// Structured output: `{"format": {"type": "json_schema", "schema":
    /// {…}}}`; its `effort` is refused.
    output_config: Option<Value>,
    /// The older place of `output_config.format`.
    output_format: Option<Value>,
    /// Extension: a sampling seed.
    seed: Option<u64>,
    /// Extension: `interactive`, `normal`, `batch` or a number.
    priority: Option<openai::PriorityArg>,
    /// Extension: keep generating past end-of-sequence.
    #[serde(default, deserialize_with = "openai::or_default")]
    ignore_eos: bool,
    /// Extension: the output matches this regex.
    regex: Option<String>,
    /// Extension: the output is derived by this Lark grammar.
    grammar: Option<String>,
    /// Extension: more variables for the chat template.
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

/// The text of `system` or of a `tool_result`'s content: a string or text
/// blocks.
fn text_of(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        text.push_str(b.get("text").and_then(Value::as_str).ok_or_else(|| {
                            ApiError::invalid(format!("{at}[{j}].text"), "must be a string")
                        })?)
                    }
                    Some(other) => {
                        return Err(ApiError::unsupported(
                            &format!("{at}[{j}].type"),
                            &format!("`{other}` blocks here"),
                        ));
                    }
                    None => return Err(ApiError::invalid(format!("{at}[{j}].type"), "required")),
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::invalid(
            at,
            "must be a string or a list of text blocks",
        )),
    }
}

fn str_of<'a>(b: &'a Value, at: &str, key: &str) -> Result<&'a str, ApiError> {
    b.get(key)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| ApiError::invalid(format!("{at}.{key}"), "required, a non-empty string"))
}

/// `messages` as chat messages: each user turn's `tool_result` blocks as
/// tool messages (before its text), each assistant turn's `tool_use` blocks
/// as its tool calls.
fn read_messages(messages: &[Value]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "at least one message is required",
        ));
    }
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = str_field(m, &at, "role")?;
        if role != "user" && role != "assistant" {
            return Err(ApiError::invalid(
                format!("{at}.role"),
                "must be `user` or `assistant` (the system prompt is `system`)",
            ));
        }
        let blocks = match m.get("content") {
            Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
            Some(Value::Array(b)) => b.clone(),
            _ => {
                return Err(ApiError::invalid(
                    format!("{at}.content"),
                    "must be a string or a list of content blocks",
                ));
            }
        };
        let mut text = String::new();
        let mut calls = Vec::new();
        let mut thought = String::new();
        for (j, b) in blocks.iter().enumerate() {
            let bat = format!("{at}.content[{j}]");
            match b.get("type").and_then(Value::as_str) {
                Some("text") => text.push_str(str_or_empty(b, &bat, "text")?),
                Some("tool_use") if role == "assistant" => calls.push(ToolCall {
                    id: str_of(b, &bat, "id")?.to_string(),
                    name: str_of(b, &bat, "name")?.to_string(),
                    arguments: match b.get("input") {
                        Some(v @ Value::Object(_)) => v.to_string(),
                        _ => {
                            return Err(ApiError::invalid(
                                format!("{bat}.input"),
                                "must be an object",
                            ));
                        }
                    },
                }),
                Some("tool_result") if role == "user" => {
                    let id = str_of(b, &bat, "tool_use_id")?.to_string();
                    let content = match b.get("content") {
                        None | Some(Value::Null) => String::new(),
                        Some(c) => text_of(c, &format!("{bat}.content"))?,
                    };
                    let name = openai::called(&out, &id).ok_or_else(|| {
                        ApiError::invalid(
                            format!("{bat}.tool_use_id"),
                            format!("no tool_use with id `{id}` before it"),
                        )
                    })?;
                    let is_error = b.get("is_error").and_then(Value::as_bool) == Some(true);
                    out.push(ChatMessage {
                        role: "tool".into(),
                        content: Some(if is_error {
                            format!("Error: {content}")
                        } else {
                            content
                        }),
                        tool_call_id: Some(id),
                        name: Some(name),
                        ..ChatMessage::default()
                    });
                }
                // Given to the template, which decides whether to show it
                // again (most drop it from earlier turns).
                Some("thinking") if role == "assistant" => {
                    thought.push_str(str_or_empty(b, &bat, "thinking")?);
                }
                Some("redacted_thinking") if role == "assistant" => {}
                Some(other) => {
                    return Err(ApiError::unsupported(
                        &format!("{bat}.type"),
                        &format!("`{other}` blocks in a {role} message"),
                    ));
                }
                None => return Err(ApiError::invalid(format!("{bat}.type"), "required")),
            }
        }
        if text.is_empty() && calls.is_empty() {
            // A user turn of tool results only.
            if role == "user" && blocks.iter().any(|b| b["type"] == "tool_result") {
                continue;
            }
        }
        let msg = ChatMessage {
            role: role.to_string(),
            content: (!text.is_empty() || calls.is_empty()).then_some(text),
            tool_calls: calls,
            reasoning: (!thought.is_empty()).then_some(thought),
            ..ChatMessage::default()
        };
        out.push(
            msg.checked()
                .map_err(|(f, why)| ApiError::invalid(format!("{at}.{f}"), why))?,
        );
    }
    Ok(out)
}

fn str_field<'a>(m: &'a Value, at: &str, key: &str) -> Result<&'a str, ApiError> {
    m.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid(format!("{at}.{key}"), "required, a string"))
}

fn str_or_empty<'a>(b: &'a Value, at: &str, key: &str) -> Result<&'a str, ApiError> {
    b.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid(format!("{at}.{key}"), "must be a string"))
}

/// `tools` (client tools: a name, a description, an `input_schema`) and
/// `tool_choice`.
fn read_tools(
    tools: Option<&[Value]>,
    choice: Option<&Value>,
) -> Result<(Vec<Tool>, ToolChoice, bool), ApiError> {
    let mut wire = Vec::new();
    for (i, t) in tools.unwrap_or_default().iter().enumerate() {
        if let Some(kind) = t.get("type").and_then(Value::as_str)
            && kind != "custom"
        {
            return Err(ApiError::unsupported(
                &format!("tools[{i}].type"),
                &format!("server tools (`{kind}`): only client tools are served"),
            ));
        }
        let name = str_of(t, &format!("tools[{i}]"), "name")?.to_string();
        let description = t.get("description").and_then(Value::as_str);
        let schema = t.get("input_schema").cloned();
        wire.push(openai::nested_tool(
            name,
            description.map(str::to_string),
            schema,
        ));
    }
    let tools = openai::tools_of(wire).map_err(|e| openai::flat_tool_error(e, "input_schema"))?;
    let mut parallel = true;
    let choice = match choice {
        None | Some(Value::Null) => None,
        Some(c) => {
            parallel = c.get("disable_parallel_tool_use").and_then(Value::as_bool) != Some(true);
            match c.get("type").and_then(Value::as_str) {
                Some("auto") => Some(json!("auto")),
                Some("any") => Some(json!("required")),
                Some("none") => Some(json!("none")),
                Some("tool") => {
                    let name = str_of(c, "tool_choice", "name")?;
                    Some(json!({"type": "function", "function": {"name": name}}))
                }
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice.type",
                        "must be `auto`, `any`, `tool` or `none`",
                    ));
                }
            }
        }
    };
    let choice = openai::tool_choice_of(choice.as_ref(), &tools)?;
    Ok((tools, choice, parallel))
}

/// What a request asks, checked: the plan and what the answer reports.
struct Prepared {
    plan: Plan,
    /// The model a client named (echoed), else the one served.
    model: String,
}

fn prepare(r: MessagesRequest, served: &str) -> Result<Prepared, ApiError> {
    for (field, set) in [
        (
            "container",
            r.container.as_ref().is_some_and(|v| !v.is_null()),
        ),
        (
            "mcp_servers",
            r.mcp_servers.as_ref().is_some_and(|v| !v.is_null()),
        ),
    ] {
        if set {
            return Err(ApiError::unsupported(field, field));
        }
    }
    let max_tokens = r
        .max_tokens
        .ok_or_else(|| ApiError::invalid("max_tokens", "required"))?;
    if let Some(t) = r.temperature
        && !(0.0..=1.0).contains(&t)
    {
        return Err(ApiError::invalid(
            "temperature",
            format!("must be in [0, 1], got {t}"),
        ));
    }
    let mut budget = None;
    if let Some(th) = &r.thinking {
        match th.get("type").and_then(Value::as_str) {
            Some("enabled") => {
                // As Anthropic's API: a budget, below `max_tokens`.
                let b = th.get("budget_tokens").ok_or_else(|| {
                    ApiError::invalid(
                        "thinking.budget_tokens",
                        "required when thinking is enabled",
                    )
                })?;
                let b = b
                    .as_u64()
                    .and_then(|b| u32::try_from(b).ok())
                    .ok_or_else(|| {
                        ApiError::invalid("thinking.budget_tokens", "must be a token count")
                    })?;
                if r.max_tokens.is_some_and(|m| b >= m) {
                    return Err(ApiError::invalid(
                        "thinking.budget_tokens",
                        format!("must be less than `max_tokens`, got {b}"),
                    ));
                }
                budget = Some(b);
            }
            Some("disabled" | "adaptive") => {}
            _ => {
                return Err(ApiError::invalid(
                    "thinking.type",
                    "must be `enabled`, `disabled` or `adaptive`",
                ));
            }
        }
    }
    let mut msgs = Vec::new();
    if let Some(s) = &r.system {
        let text = text_of(s, "system")?;
        if !text.is_empty() {
            msgs.push(ChatMessage {
                role: "system".into(),
                content: Some(text),
                ..ChatMessage::default()
            });
        }
    }
    let messages = r
        .messages
        .ok_or_else(|| ApiError::invalid("messages", "required"))?;
    msgs.extend(read_messages(&messages)?);
    let tools = read_tools(r.tools.as_deref(), r.tool_choice.as_ref())?;
    let config = r.output_config.as_ref().filter(|c| !c.is_null());
    let effort = match config.and_then(|c| c.get("effort")) {
        None | Some(Value::Null) => None,
        Some(Value::String(e)) => Some(e.clone()),
        Some(_) => {
            return Err(ApiError::invalid(
                "output_config.effort",
                "must be a string",
            ));
        }
    };
    let (format, field) = match config
        .and_then(|c| c.get("format"))
        .filter(|f| !f.is_null())
    {
        Some(f) => (Some(f), "output_config.format"),
        None => (
            r.output_format.as_ref().filter(|f| !f.is_null()),
            "output_format",
        ),
    };
    let response_format = match format {
        None => None,
        Some(f) => match f.get("type").and_then(Value::as_str) {
            Some("json_schema") => Some(json!({
                "type": "json_schema",
                "json_schema": {"name": "output", "strict": true, "schema": f.get("schema")},
            })),
            _ => {
                return Err(ApiError::invalid(
                    format!("{field}.type"),
                    "must be `json_schema`",
                ));
            }
        },
    };
    let common = Common {
        model: r.model.clone(),
        response_format,
        regex: r.regex,
        grammar: r.grammar,
        ignore_eos: r.ignore_eos,
        chat_template_kwargs: r.chat_template_kwargs,
        max_tokens: Some(max_tokens),
        temperature: r.temperature,
        top_p: r.top_p,
        top_k: r.top_k.map(i64::from),
        stream: r.stream,
        stop: r.stop_sequences.map(openai::OneOrMany::Many),
        seed: r.seed,
        priority: r.priority,
        ..Common::default()
    };
    let mut plan = openai::conversation_plan(msgs, tools, None, common).map_err(|mut e| {
        // Chat's name for the schema, in this API's terms.
        if let Some(p) = e.param.as_deref()
            && p.starts_with("response_format")
        {
            let to = format!("{field}.schema");
            e.message = e.message.replacen(p, &to, 1);
            e.param = Some(to);
        }
        e
    })?;
    plan.request.max_tokens_field = Some("max_tokens");
    plan.request.thinking_budget = budget;
    plan.effort = effort.map(|e| ("output_config.effort", e));
    // Thinking on or off: the template's own switch, where it has one.
    plan.thinking = match r
        .thinking
        .as_ref()
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str)
    {
        Some("disabled") => Some(false),
        Some("enabled" | "adaptive") => Some(true),
        _ => None,
    };
    // A final assistant message is a prefill: the answer continues its text.
    if let Input::Chat(m) = &plan.request.input
        && let Some(last) = m.last().filter(|l| l.role == "assistant")
    {
        let text = last.content.as_deref().unwrap_or_default();
        if text != text.trim_end() {
            return Err(ApiError::invalid(
                format!("messages[{}].content", messages.len() - 1),
                "a final assistant message (a prefill) cannot end with whitespace",
            ));
        }
        plan.request.chat_end = ChatEnd::Continue;
    }
    Ok(Prepared {
        plan,
        model: r
            .model
            .filter(|m| !m.is_empty())
            .unwrap_or_else(|| served.to_string()),
    })
}

/// Reads a request and resolves it against the server: 400/404 before
/// anything runs.
fn read(s: &AppState, body: Result<Bytes, BytesRejection>) -> Result<(Prepared, bool), ApiError> {
    let v = body_json(body, s.max_request_bytes)?;
    let r: MessagesRequest = field_of(&v)?;
    openai::check_model(r.model.as_deref(), &s.model_ids)?;
    let stream = r.stream;
    let thinking_on = r
        .thinking
        .as_ref()
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str)
        == Some("enabled");
    let reasons = s.rt.chat_template().is_some_and(|t| t.reasons());
    if thinking_on && !reasons {
        return Err(ApiError::unsupported(
            "thinking",
            "thinking (the model served does not think)",
        ));
    }
    let p = prepare(r, &s.model_ids[0])?;
    Ok((p, stream))
}

/// Anthropic's `usage`.
fn usage_json(u: &Usage, input: u32) -> Value {
    json!({
        "input_tokens": input,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_prompt_tokens,
        "cache_creation_input_tokens": 0,
    })
}

/// The content block being written.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Open {
    None,
    Thinking,
    Text,
    /// A `tool_use` block: its id and tool's name (its input's JSON text
    /// grows in `buf`).
    Tool(String, String),
}

/// One message's state machine: the runtime's events in, Anthropic's
/// stream events out, and the message at the end.
struct Reply {
    id: String,
    model: String,
    input_tokens: u32,
    /// Thinking split off, tool calls read.
    router: siliceo_runtime::OutputRouter,
    /// Tool calls begun.
    calls: usize,
    /// Finished content blocks.
    blocks: Vec<Value>,
    open: Open,
    /// The open block's text.
    buf: String,
    stop_reason: Option<&'static str>,
    stop_sequence: Option<String>,
    usage: Usage,
    failed: Option<ApiError>,
}

impl Reply {
    fn new(model: String, input_tokens: u32, parsing: Parsing) -> Self {
        Reply {
            id: format!("msg_{}", uuid_like()),
            model,
            input_tokens,
            router: parsing.router(),
            calls: 0,
            blocks: Vec::new(),
            open: Open::None,
            buf: String::new(),
            stop_reason: None,
            stop_sequence: None,
            usage: Usage::default(),
            failed: None,
        }
    }

    /// The message as it stands.
    fn message(&self) -> Value {
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.blocks,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": usage_json(&self.usage, self.input_tokens),
        })
    }

    fn start(&self) -> Vec<Value> {
        let mut m = self.message();
        m["usage"]["output_tokens"] = json!(0);
        vec![
            json!({"type": "message_start", "message": m}),
            json!({"type": "ping"}),
        ]
    }

    fn close(&mut self, out: &mut Vec<Value>) {
        let block = match std::mem::replace(&mut self.open, Open::None) {
            Open::None => return,
            Open::Thinking => json!({
                "type": "thinking", "thinking": std::mem::take(&mut self.buf), "signature": "",
            }),
            Open::Text => json!({"type": "text", "text": std::mem::take(&mut self.buf)}),
            Open::Tool(id, name) => {
                // Arguments cut short are no object: the input is empty.
                let input: Value = serde_json::from_str(&std::mem::take(&mut self.buf))
                    .ok()
                    .filter(Value::is_object)
                    .unwrap_or_else(|| json!({}));
                json!({"type": "tool_use", "id": id, "name": name, "input": input})
            }
        };
        out.push(json!({"type": "content_block_stop", "index": self.blocks.len()}));
        self.blocks.push(block);
    }

    /// Opens a block of `kind` (closing another first).
    fn open_block(&mut self, kind: Open, out: &mut Vec<Value>) {
        self.close(out);
        let block = match &kind {
            Open::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
            Open::Tool(id, name) => {
                json!({"type": "tool_use", "id": id, "name": name, "input": {}})
            }
            _ => json!({"type": "text", "text": ""}),
        };
        out.push(json!({
            "type": "content_block_start", "index": self.blocks.len(), "content_block": block,
        }));
        self.open = kind;
    }

    /// Appends to a block of `kind`, opening it (and closing another) first.
    fn append(&mut self, kind: Open, text: &str, out: &mut Vec<Value>) {
        if text.is_empty() {
            return;
        }
        if self.open != kind {
            self.open_block(kind, out);
        }
        self.push_delta(text, out);
    }

    /// More of the open block: its text, thinking, or tool input.
    fn push_delta(&mut self, text: &str, out: &mut Vec<Value>) {
        let delta = match self.open {
            Open::Thinking => json!({"type": "thinking_delta", "thinking": text}),
            Open::Tool(..) => json!({"type": "input_json_delta", "partial_json": text}),
            _ => json!({"type": "text_delta", "text": text}),
        };
        self.buf.push_str(text);
        out.push(
            json!({"type": "content_block_delta", "index": self.blocks.len(), "delta": delta}),
        );
    }

    /// The model's text: thinking, then the answer, then its calls as
    /// `tool_use` blocks as they are written; `end`: and all held back.
    /// Returns whether the output ended inside a call's arguments.
    fn route(&mut self, text: &str, end: bool, out: &mut Vec<Value>) -> bool {
        let r = self.router.push(text, end);
        self.append(Open::Thinking, &r.reasoning, out);
        self.append(Open::Text, &r.answer, out);
        for piece in r.calls {
            match piece {
                CallPiece::Call(name) => {
                    self.calls += 1;
                    let id = format!("toolu_{}", uuid_like());
                    self.open_block(Open::Tool(id, name), out);
                }
                CallPiece::Args(args) if matches!(self.open, Open::Tool(..)) => {
                    self.push_delta(&args, out);
                }
                _ => {}
            }
        }
        r.cut
    }

    fn events_of(&mut self, ev: Event) -> Vec<Value> {
        let mut out = Vec::new();
        match ev {
            Event::Prompt { .. } => {}
            Event::Text { text, .. } => {
                self.route(&text, false, &mut out);
            }
            Event::Done { error: Some(e), .. } => return self.fail(ApiError::from_runtime(&e)),
            Event::Done {
                finish_reason,
                usage,
                stop,
                ..
            } => {
                let cut = self.route("", true, &mut out);
                self.close(&mut out);
                let has_calls = self.calls > 0 && !cut;
                self.usage = usage;
                self.stop_reason = Some(match (has_calls, finish_reason, &stop) {
                    (true, _, _) => "tool_use",
                    (false, FinishReason::Stop, Some(_)) => "stop_sequence",
                    (false, FinishReason::Stop, None) => "end_turn",
                    _ => "max_tokens",
                });
                if self.stop_reason == Some("stop_sequence") {
                    self.stop_sequence = stop;
                }
                out.push(json!({
                    "type": "message_delta",
                    "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                    "usage": usage_json(&self.usage, self.input_tokens),
                }));
                out.push(json!({"type": "message_stop"}));
            }
        }
        out
    }
}

impl EventMachine for Reply {
    fn on_event(&mut self, ev: Event) -> Vec<Value> {
        self.events_of(ev)
    }

    fn fail(&mut self, e: ApiError) -> Vec<Value> {
        let body = AnthropicError(e.clone()).body();
        self.failed = Some(e);
        vec![body]
    }

    fn ended(&self) -> bool {
        self.stop_reason.is_some() || self.failed.is_some()
    }
}

/// `POST /v1/messages`.
pub(crate) async fn messages(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, AnthropicError> {
    let (mut p, stream) = read(&s, body)?;
    let parsing = crate::parsing(&s, &mut p.plan)?;
    let (mut rs, input_tokens) =
        s.rt.submit_accepted(p.plan.choice(0))
            .await
            .map_err(|e| ApiError::from_runtime(&e))?;
    let mut reply = Reply::new(p.model, input_tokens, parsing);
    if stream {
        let first = reply.start();
        return Ok(Sse::new(TypedEvents::new(rs, reply, first))
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    while !reply.ended() {
        match rs.next().await {
            Some(ev) => {
                reply.on_event(ev);
            }
            None => return Err(ApiError::from_runtime(&RuntimeError::Stopped).into()),
        }
    }
    if let Some(e) = reply.failed.take() {
        return Err(e.into());
    }
    Ok(Json(reply.message()).into_response())
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens, as a message
/// request with the same `system`, `messages` and `tools` runs on.
pub(crate) async fn count_tokens(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, AnthropicError> {
    let mut v = body_json(body, s.max_request_bytes)?;
    // Counting needs no limit.
    if let Value::Object(o) = &mut v {
        o.entry("max_tokens").or_insert(json!(1));
    }
    let r: MessagesRequest = field_of(&v)?;
    openai::check_model(r.model.as_deref(), &s.model_ids)?;
    let mut p = prepare(r, &s.model_ids[0])?;
    crate::apply_thinking(&s, &mut p.plan)?;
    let req: GenerateRequest = p.plan.request;
    if !matches!(req.input, Input::Chat(_)) {
        return Err(ApiError::internal("a message request is a chat").into());
    }
    let tokens = crate::prompt_tokens(&s, req).await?;
    Ok(Json(json!({"input_tokens": tokens.len()})))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prep(body: Value) -> Result<Prepared, ApiError> {
        prepare(serde_json::from_value(body).unwrap(), "served")
    }

    fn chat_of(p: &Prepared) -> &[ChatMessage] {
        match &p.plan.request.input {
            Input::Chat(m) => m,
            other => panic!("not a chat: {other:?}"),
        }
    }

    #[test]
    fn blocks_become_a_chat_with_calls_and_results() {
        let p = prep(json!({
            "max_tokens": 50, "system": [{"type": "text", "text": "Be brief."}],
            "temperature": 0.5, "top_k": 3, "stop_sequences": ["END"],
            "tools": [{"name": "weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "messages": [
                {"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "tu1", "name": "weather", "input": {"city": "Paris"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "tu1", "content": [{"type": "text", "text": "18C"}]},
                    {"type": "text", "text": "And tomorrow?"},
                ]},
            ],
        }))
        .unwrap();
        let m = chat_of(&p);
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(m[2].content.as_deref(), Some("Checking."));
        assert_eq!(m[2].reasoning.as_deref(), Some("hm"));
        assert_eq!(m[2].tool_calls[0].arguments, r#"{"city":"Paris"}"#);
        assert_eq!(
            (m[3].name.as_deref(), m[3].content.as_deref()),
            (Some("weather"), Some("18C"))
        );
        let s = &p.plan.request.sampling;
        assert_eq!((s.max_tokens, s.temperature, s.top_k), (50, 0.5, 3));
        assert_eq!(s.stop, ["END"]);
        let tp = p.plan.tools.as_ref().unwrap();
        assert_eq!(
            (tp.choice.clone(), tp.parallel),
            (ToolChoice::Required, false)
        );
        assert_eq!(p.model, "served");
        let p = prep(json!({
            "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}],
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
        }))
        .unwrap();
        assert!(matches!(
            p.plan.request.constraint,
            Some(siliceo_core::Constraint::JsonSchema { strict: true, .. })
        ));
    }

    #[test]
    fn what_cannot_be_served_is_named() {
        let ok = json!([{"role": "user", "content": "hi"}]);
        for (body, want) in [
            (json!({"messages": ok}), "max_tokens"),
            (json!({"max_tokens": 5}), "messages"),
            (json!({"max_tokens": 5, "messages": []}), "messages"),
            (
                json!({"max_tokens": 5, "messages": ok, "temperature": 1.5}),
                "temperature",
            ),
            (
                json!({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}]}),
                "messages[0].content[0].tool_use_id",
            ),
            (
                json!({"max_tokens": 5, "messages": ok, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
                "tools[0].type",
            ),
            (
                json!({"max_tokens": 5, "messages": ok, "tools": [{"name": "f", "input_schema": 3}]}),
                "tools[0].input_schema",
            ),
            (
                json!({"max_tokens": 5, "messages": ok, "tool_choice": {"type": "tool", "name": "f"}}),
                "tool_choice",
            ),
            (
                json!({"max_tokens": 5, "messages": ok, "mcp_servers": []}),
                "mcp_servers",
            ),
            (
                json!({"max_tokens": 5, "messages": ok, "thinking": {"type": "sometimes"}}),
                "thinking.type",
            ),
            (json!({"max_tokens": 0, "messages": ok}), "max_tokens"),
            (
                json!({"max_tokens": 5, "messages": ok, "output_config": {"effort": 3}}),
                "output_config.effort",
            ),
            (
                json!({"max_tokens": 5, "messages": ok, "thinking": {"type": "enabled"}}),
                "thinking.budget_tokens",
            ),
            (
                json!({"max_tokens": 5, "messages": ok,
                       "thinking": {"type": "enabled", "budget_tokens": 5}}),
                "thinking.budget_tokens",
            ),
            (
                json!({"max_tokens": 5, "messages": ok,
                       "thinking": {"type": "enabled", "budget_tokens": -1}}),
                "thinking.budget_tokens",
            ),
            (
                json!({"max_tokens": 5, "messages": ok, "output_config": {"format": {"type": "yaml"}}}),
                "output_config.format.type",
            ),
        ] {
            let e = prep(body.clone())
                .err()
                .unwrap_or_else(|| panic!("accepted {body}"));
            assert_eq!(e.param.as_deref(), Some(want), "{body}: {e}");
        }
    }

    fn text(t: &str) -> Event {
        Event::Text {
            text: t.into(),
            tokens: vec![siliceo_core::TokenId(1)],
            logprobs: Vec::new(),
        }
    }

    fn done(finish: FinishReason, stop: Option<&str>) -> Event {
        Event::Done {
            finish_reason: finish,
            usage: Usage {
                prompt_tokens: 7,
                completion_tokens: 3,
                ..Usage::default()
            },
            error: None,
            stop: stop.map(str::to_string),
        }
    }

    /// Thinking, text and a tool call as blocks, indexed in order, with the
    /// events a client accumulates them from.
    #[test]
    fn events_build_the_blocks_they_describe() {
        let tools = Some(siliceo_runtime::ToolSyntax::Hermes);
        let mut r = Reply::new(
            "m".into(),
            7,
            Parsing {
                tools,
                think: Some(false),
                one_call: false,
                ..Parsing::default()
            },
        );
        let mut evs = r.start();
        for t in [
            "<think>Call it.</think>\n",
            "Sure. ",
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>",
        ] {
            evs.extend(r.on_event(text(t)));
        }
        evs.extend(r.on_event(done(FinishReason::Stop, None)));
        let kinds: Vec<String> = evs
            .iter()
            .map(|e| {
                let k = e["type"].as_str().unwrap().to_string();
                match e.get("index") {
                    Some(i) => format!("{k}@{i}"),
                    None => k,
                }
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "message_start",
                "ping",
                "content_block_start@0",
                "content_block_delta@0",
                "content_block_stop@0",
                "content_block_start@1",
                "content_block_delta@1",
                "content_block_stop@1",
                "content_block_start@2",
                "content_block_delta@2",
                "content_block_stop@2",
                "message_delta",
                "message_stop",
            ]
        );
        let m = r.message();
        assert_eq!(
            m["content"][0],
            json!({"type": "thinking", "thinking": "Call it.", "signature": ""})
        );
        assert_eq!(m["content"][1], json!({"type": "text", "text": "Sure. "}));
        assert_eq!(m["content"][2]["input"], json!({"a": 1}));
        assert_eq!(m["stop_reason"], "tool_use");
        assert_eq!(m["usage"]["input_tokens"], 7);

        let mut r = Reply::new("m".into(), 7, Parsing::default());
        r.on_event(text("a b"));
        r.on_event(done(FinishReason::Stop, Some("END")));
        let m = r.message();
        assert_eq!(
            (m["stop_reason"].as_str(), m["stop_sequence"].as_str()),
            (Some("stop_sequence"), Some("END"))
        );
        let mut r = Reply::new("m".into(), 7, Parsing::default());
        r.on_event(done(FinishReason::Length, None));
        assert_eq!(r.message()["stop_reason"], "max_tokens");
        assert_eq!(r.message()["content"], json!([]));
    }

    /// A final assistant message is a prefill, continued; one ending in
    /// whitespace is refused, naming it.
    #[test]
    fn a_final_assistant_message_is_a_prefill() {
        let body = |last: &str| {
            json!({"max_tokens": 5, "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": last},
            ]})
        };
        let p = prep(body("Hello,")).unwrap();
        assert_eq!(p.plan.request.chat_end, ChatEnd::Continue);
        let p = prep(json!({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}));
        assert_eq!(p.unwrap().plan.request.chat_end, ChatEnd::Answer);
        let e = prep(body("Hello, ")).err().unwrap();
        assert_eq!(e.param.as_deref(), Some("messages[1].content"));
    }

    #[test]
    fn thinking_budgets_and_effort_reach_the_plan() {
        let hi = json!([{"role": "user", "content": "Hi"}]);
        let p = prep(json!({"max_tokens": 9, "messages": hi,
                            "thinking": {"type": "enabled", "budget_tokens": 4}}))
        .unwrap();
        assert_eq!(p.plan.request.thinking_budget, Some(4));
        assert_eq!((p.plan.thinking, p.plan.effort), (Some(true), None));
        let p = prep(json!({"max_tokens": 9, "messages": hi,
                            "output_config": {"effort": "low"}}))
        .unwrap();
        assert_eq!(p.plan.request.thinking_budget, None);
        assert_eq!(p.plan.effort, Some(("output_config.effort", "low".into())));
    }

    /// A call's `tool_use` block opens once its name is written; its input
    /// streams as the model writes it. Cut short, the input is empty and the
    /// stop reason is the token limit.
    #[test]
    fn tool_use_blocks_stream_their_input() {
        let call =
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let parsing = Parsing {
            tools: Some(siliceo_runtime::ToolSyntax::Hermes),
            think: None,
            one_call: false,
            ..Parsing::default()
        };
        let mut r = Reply::new("m".into(), 7, parsing.clone());
        let mut seen = Vec::new();
        let mut started_at = None;
        for (i, ch) in call.chars().enumerate() {
            for e in r.on_event(text(&ch.to_string())) {
                if e["type"] == "content_block_start" {
                    started_at.get_or_insert(i);
                }
                if e["delta"]["type"] == "input_json_delta" {
                    seen.push(e["delta"]["partial_json"].as_str().unwrap().to_string());
                }
            }
        }
        r.on_event(done(FinishReason::Stop, None));
        let started_at = started_at.expect("a tool_use block");
        assert!(started_at < call.find("Paris").unwrap(), "{started_at}");
        assert!(seen.len() > 5, "{seen:?}");
        assert_eq!(seen.concat(), r#"{"city": "Paris"}"#);
        let m = r.message();
        assert_eq!(m["content"][0]["input"], json!({"city": "Paris"}));
        assert_eq!(m["stop_reason"], "tool_use");

        let mut r = Reply::new("m".into(), 7, parsing);
        r.on_event(text(&call[..call.find("Paris").unwrap()]));
        r.on_event(done(FinishReason::Length, None));
        let m = r.message();
        assert_eq!(m["content"][0]["input"], json!({}));
        assert_eq!(m["stop_reason"], "max_tokens");
    }

    #[test]
    fn errors_take_anthropics_shape() {
        let e = AnthropicError(ApiError::invalid("max_tokens", "required"));
        assert_eq!(
            e.body(),
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: required"}})
        );
        let e = AnthropicError(ApiError::from_runtime(&RuntimeError::Stopped));
        assert_eq!(e.body()["error"]["type"], "overloaded_error");
    }
}
