//! OpenAI's Responses API: `POST /v1/responses` (whole, or streamed as
//! typed server-sent events, or in the `background`), and the responses
//! this server keeps: `GET`/`DELETE /v1/responses/{id}`,
//! `POST /v1/responses/input_tokens` (a request's prompt tokens, counted),
//! `GET /v1/responses/{id}/input_items`, `POST /v1/responses/{id}/cancel`.
//!
//! A response runs as a chat: `instructions` become a system message, then
//! the conversation of `previous_response_id` (kept in memory, oldest
//! dropped first past a byte budget), then `input`'s items: messages,
//! `function_call`s and their `function_call_output`s. Its output is a
//! `message` item (after a `reasoning` item, for a model that thinks) and,
//! when the model calls tools, `function_call` items. The text, the tool
//! calls and the streamed events come from one state machine, [`Builder`],
//! for the whole, the streamed and the background answer. A background
//! response is kept as it starts; a task runs it and keeps its final
//! version; cancelling aborts the task, which drops the request. A
//! background response created with `stream: true` also keeps its events
//! ([`EventLog`]): its creator reads them as they come, and a client that
//! left resumes with `GET /v1/responses/{id}?stream=true&starting_after=N`.
//!
//! Everything a chat completion serves is served here under the Responses
//! API's names (`max_output_tokens`, `text.format`, flat `tools`,
//! `include: ["message.output_text.logprobs"]` with `top_logprobs`), and the
//! chat's extensions (`seed`, `top_k`, `stop`, `priority`, …) are taken as
//! they are. What this server cannot do (built-in tools, images and files,
//! reasoning summaries) is a 400 naming the field.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::Uri;
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use siliceo_core::FinishReason;
use siliceo_runtime::{
    CallPiece, Event, Input, Message as ChatMessage, RuntimeError, TokenLogprob, ToolCall, Usage,
};

use crate::error::ApiError;
use crate::openai::{self, Common, Plan};
use crate::stream::{EventMachine, Kind, Parsing, TypedEvents, logprobs_json};
use crate::{AppState, body_json, field_of, now_s, start, uuid_like};

/// The `include` value that asks for the output's log-probabilities.
const INCLUDE_LOGPROBS: &str = "message.output_text.logprobs";

/// `POST /v1/responses`: what is read beside [`Common`] (sampling, the
/// chat's extensions).
#[derive(Debug, Deserialize)]
pub(crate) struct ResponsesRequest {
    input: Option<WireInput>,
    instructions: Option<String>,
    max_output_tokens: Option<u32>,
    tools: Option<Vec<WireTool>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    text: Option<TextConfig>,
    previous_response_id: Option<String>,
    store: Option<bool>,
    metadata: Option<HashMap<String, String>>,
    top_logprobs: Option<u32>,
    include: Option<Vec<String>>,
    reasoning: Option<ReasoningConfig>,
    truncation: Option<String>,
    #[serde(default, deserialize_with = "openai::or_default")]
    background: bool,
    conversation: Option<Value>,
    prompt: Option<Value>,
}

/// `input`: a user's text, or a list of items.
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or an array of input items")]
enum WireInput {
    Text(String),
    Items(Vec<Value>),
}

/// `tools[i]`: the Responses API's flat function tool.
#[derive(Debug, Deserialize)]
struct WireTool {
    #[serde(rename = "type")]
    kind: String,
    name: Option<String>,
    description: Option<String>,
    parameters: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct TextConfig {
    format: Option<Value>,
    verbosity: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ReasoningConfig {
    effort: Option<String>,
    summary: Option<String>,
}

/// A request read and checked: what to run, and what the response repeats
/// and keeps.
pub(crate) struct Prepared {
    pub(crate) plan: Plan,
    head: Head,
    /// `input`'s items as `input_items` lists them (with ids).
    input_items: Vec<Value>,
    /// The conversation so far without `instructions` (a later response
    /// sets its own): the previous response's, then `input`'s messages.
    conversation: Vec<ChatMessage>,
    /// Output tokens' log-probabilities go in the output text.
    logprobs: bool,
    /// `truncation: auto`: the oldest turns go when the conversation is
    /// over the context ([`truncate_to_fit`]).
    truncate: bool,
}

/// What every response object of one request repeats.
struct Head {
    id: String,
    created_at: u64,
    model: String,
    /// The request's settings, echoed in the response object.
    echo: Map<String, Value>,
    store: bool,
    /// Runs on after the request returns; polled with `GET`.
    background: bool,
}

/// A response this server keeps for `previous_response_id` and `GET`.
#[derive(Debug)]
pub(crate) struct Stored {
    response: Value,
    input_items: Vec<Value>,
    /// The conversation with this response's answer last.
    conversation: Vec<ChatMessage>,
    bytes: usize,
}

/// The responses kept in memory, within a byte budget; the oldest go first.
#[derive(Debug)]
pub(crate) struct ResponseStore {
    max_bytes: usize,
    inner: Mutex<StoreInner>,
}

#[derive(Debug, Default)]
struct StoreInner {
    map: HashMap<String, Arc<Stored>>,
    order: VecDeque<String>,
    bytes: usize,
    /// Background responses still running: their tasks.
    running: HashMap<String, tokio::task::AbortHandle>,
    /// The events of background responses created with `stream: true`.
    logs: HashMap<String, Arc<EventLog>>,
}

impl StoreInner {
    /// Keeps `stored` as `id` (in place of an earlier version), dropping the
    /// oldest others while over `max` bytes.
    fn insert(&mut self, id: String, stored: Stored, max: usize) {
        if let Some(o) = self.map.remove(&id) {
            self.bytes -= o.bytes;
            self.order.retain(|k| *k != id);
        }
        while self.bytes + stored.bytes > max {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some(o) = self.map.remove(&old) {
                self.bytes -= o.bytes;
            }
            self.logs.remove(&old);
        }
        self.bytes += stored.bytes;
        self.order.push_back(id.clone());
        self.map.insert(id, Arc::new(stored));
    }
}

/// The stream events of a background response created with `stream: true`,
/// kept for its creator and for clients that resume it
/// (`GET /v1/responses/{id}?stream=true&starting_after=N`). Each event's
/// `sequence_number` is its place in the log.
#[derive(Debug)]
pub(crate) struct EventLog {
    inner: Mutex<LogInner>,
    /// Bumped at each change (new events, the end).
    changed: tokio::sync::watch::Sender<()>,
}

#[derive(Debug, Default)]
struct LogInner {
    /// Each event's name (its `type`) and its JSON text, serialized once
    /// for every reader.
    events: Vec<Arc<(String, String)>>,
    bytes: usize,
    ended: bool,
}

impl EventLog {
    fn new() -> Self {
        EventLog {
            inner: Mutex::new(LogInner::default()),
            changed: tokio::sync::watch::Sender::new(()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LogInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn extend(&self, events: Vec<Value>) {
        if events.is_empty() {
            return;
        }
        {
            let mut l = self.lock();
            for e in events {
                let kind = e["type"].as_str().unwrap_or("error").to_string();
                let data = e.to_string();
                l.bytes += data.len();
                l.events.push(Arc::new((kind, data)));
            }
        }
        self.changed.send_replace(());
    }

    /// No more events will come.
    fn end(&self) {
        self.lock().ended = true;
        self.changed.send_replace(());
    }

    fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// The events from `from` on, as they come, until the log ends.
    fn read_from(self: Arc<Self>, from: usize) -> LogReader {
        let changes = tokio_stream::wrappers::WatchStream::new(self.changed.subscribe());
        LogReader {
            log: self,
            next: from,
            changes,
        }
    }
}

/// A reader of an [`EventLog`], as SSE. Dropping it (its client left)
/// changes nothing for the response, which runs on.
pub(crate) struct LogReader {
    log: Arc<EventLog>,
    next: usize,
    changes: tokio_stream::wrappers::WatchStream<()>,
}

impl tokio_stream::Stream for LogReader {
    type Item = Result<axum::response::sse::Event, std::convert::Infallible>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let this = &mut *self;
        loop {
            let (event, ended) = {
                let l = this.log.lock();
                (l.events.get(this.next).cloned(), l.ended)
            };
            if let Some(e) = event {
                this.next += 1;
                let (kind, data) = &*e;
                let sse = axum::response::sse::Event::default().event(kind).data(data);
                return Poll::Ready(Some(Ok(sse)));
            }
            if ended {
                return Poll::Ready(None);
            }
            // Woken by the next change (one made since the check above
            // counts: the watch remembers what this reader has seen).
            match std::pin::Pin::new(&mut this.changes).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Ready(Some(())) => {}
            }
        }
    }
}

/// Ends a background response's run however its task stops (at the end,
/// or aborted): its event log ends and the store learns it ran.
struct RunGuard {
    store: Arc<ResponseStore>,
    id: String,
    log: Option<Arc<EventLog>>,
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        if let Some(log) = &self.log {
            log.end();
        }
        self.store.ran(&self.id);
    }
}

/// The status a kept response object shows.
fn status_of(response: &Value) -> &str {
    response["status"].as_str().unwrap_or_default()
}

impl ResponseStore {
    /// A store of at most `max_bytes` (0: nothing is kept).
    pub(crate) fn new(max_bytes: usize) -> Self {
        ResponseStore {
            max_bytes,
            inner: Mutex::new(StoreInner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StoreInner> {
        // A panic elsewhere cannot leave the maps inconsistent: every
        // change below completes under the lock.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps a response (a new version of it replaces the old; a response
    /// cancelled meanwhile stays cancelled).
    fn put(
        &self,
        id: String,
        response: Value,
        input_items: Vec<Value>,
        conversation: Vec<ChatMessage>,
    ) {
        let bytes = response.to_string().len()
            + input_items
                .iter()
                .map(|i| i.to_string().len())
                .sum::<usize>()
            + serde_json::to_vec(&conversation).map_or(0, |v| v.len());
        if bytes > self.max_bytes {
            return;
        }
        let mut s = self.lock();
        if s.map
            .get(&id)
            .is_some_and(|o| status_of(&o.response) == "cancelled")
        {
            return;
        }
        let stored = Stored {
            response,
            input_items,
            conversation,
            bytes,
        };
        s.insert(id, stored, self.max_bytes);
    }

    /// A background response's task, to abort when it is cancelled.
    fn running(&self, id: String, task: tokio::task::AbortHandle) {
        let mut s = self.lock();
        // Finished already (its final version is kept): nothing to abort.
        let done = s
            .map
            .get(&id)
            .is_some_and(|o| !matches!(status_of(&o.response), "queued" | "in_progress"));
        if !done {
            s.running.insert(id, task);
        }
    }

    /// A background response's task ended (or was aborted). Its event log,
    /// if any, now counts in the budget; when it does not fit, the response
    /// is kept without it.
    fn ran(&self, id: &str) {
        let mut s = self.lock();
        s.running.remove(id);
        let Some(log) = s.logs.get(id).cloned() else {
            return;
        };
        let Some(old) = s.map.get(id).cloned() else {
            s.logs.remove(id);
            return;
        };
        let bytes = old.bytes + log.bytes();
        if bytes > self.max_bytes {
            s.logs.remove(id);
            return;
        }
        let stored = Stored {
            response: old.response.clone(),
            input_items: old.input_items.clone(),
            conversation: old.conversation.clone(),
            bytes,
        };
        s.insert(id.to_string(), stored, self.max_bytes);
    }

    /// Cancels a background response in progress: its task is aborted,
    /// which drops its request (and frees its KV), and it is kept as
    /// `cancelled`. `None`: not running.
    fn cancel(&self, id: &str) -> Option<Value> {
        let (task, response) = {
            let mut s = self.lock();
            let task = s.running.remove(id)?;
            let Some(old) = s.map.get(id).cloned() else {
                drop(s);
                task.abort();
                return None;
            };
            let mut response = old.response.clone();
            if matches!(status_of(&old.response), "queued" | "in_progress") {
                response["status"] = json!("cancelled");
                let stored = Stored {
                    response: response.clone(),
                    input_items: old.input_items.clone(),
                    conversation: old.conversation.clone(),
                    bytes: old.bytes,
                };
                s.insert(id.to_string(), stored, self.max_bytes);
            }
            (task, response)
        };
        // Outside the lock: the task's end takes it.
        task.abort();
        Some(response)
    }

    /// A background response's event log.
    fn log(&self, id: &str) -> Option<Arc<EventLog>> {
        self.lock().logs.get(id).cloned()
    }

    fn get(&self, id: &str) -> Option<Arc<Stored>> {
        self.lock().map.get(id).cloned()
    }

    fn remove(&self, id: &str) -> bool {
        let (task, found) = {
            let mut s = self.lock();
            s.logs.remove(id);
            let task = s.running.remove(id);
            let found = match s.map.remove(id) {
                Some(o) => {
                    s.bytes -= o.bytes;
                    s.order.retain(|k| k != id);
                    true
                }
                None => false,
            };
            (task, found)
        };
        // Outside the lock: the task's end takes it.
        if let Some(task) = task {
            task.abort();
        }
        found
    }

    /// Responses kept and their bytes.
    #[cfg(test)]
    fn usage(&self) -> (usize, usize) {
        let s = self.lock();
        (s.map.len(), s.bytes)
    }
}

/// `e` in the Responses API's terms: a field named by the chat code it went
/// through (`messages`, `max_tokens`, `response_format.json_schema.schema`)
/// is renamed, in its `param` and its message.
fn renamed(mut e: ApiError) -> ApiError {
    const NAMES: [(&str, &str); 6] = [
        ("response_format.json_schema", "text.format"),
        ("response_format", "text.format"),
        ("max_tokens", "max_output_tokens"),
        ("max_completion_tokens", "max_output_tokens"),
        ("messages", "input"),
        ("prompt", "input"),
    ];
    let Some(param) = e.param.clone() else {
        return e;
    };
    if param.starts_with("tools[") {
        return openai::flat_tool_error(e, "parameters");
    }
    let to = NAMES.iter().find_map(|(from, to)| {
        let rest = param.strip_prefix(from)?;
        (rest.is_empty() || rest.starts_with(['.', '['])).then(|| format!("{to}{rest}"))
    });
    if let Some(to) = to {
        if let Some(rest) = e.message.strip_prefix(param.as_str()) {
            e.message = format!("{to}{rest}");
        }
        e.param = Some(to);
    }
    e
}

/// The text of a message's `content` or a call's `output`: a string or
/// text parts (`input_text`, `output_text`, `refusal`).
fn text_of(v: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match v {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or_default();
                let key = match kind {
                    "input_text" | "output_text" | "text" => "text",
                    "refusal" => "refusal",
                    "" => return Err(ApiError::invalid(format!("{at}[{j}].type"), "required")),
                    other => {
                        return Err(ApiError::unsupported(
                            &format!("{at}[{j}].type"),
                            &format!("content of type `{other}`"),
                        ));
                    }
                };
                let t = p.get(key).and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid(format!("{at}[{j}].{key}"), "must be a string")
                })?;
                text.push_str(t);
            }
            Ok(text)
        }
        _ => Err(ApiError::invalid(
            at,
            "must be a string or a list of content parts",
        )),
    }
}

/// A reasoning item's text: its `reasoning_text` parts, else its summary's.
fn reasoning_text(item: &Map<String, Value>) -> Option<String> {
    ["content", "summary"].into_iter().find_map(|key| {
        let parts = item.get(key)?.as_array()?;
        let text: String = parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect();
        (!text.is_empty()).then_some(text)
    })
}

fn str_field<'a>(item: &'a Map<String, Value>, at: &str, key: &str) -> Result<&'a str, ApiError> {
    item.get(key)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| ApiError::invalid(format!("{at}.{key}"), "required, a non-empty string"))
}

/// `input` as chat messages (after `prior`, the conversation so far) and
/// as `input_items` lists it (each item with an id).
fn read_input(
    input: WireInput,
    prior: &[ChatMessage],
) -> Result<(Vec<ChatMessage>, Vec<Value>), ApiError> {
    let items = match input {
        WireInput::Text(t) => {
            let item = json!({"type": "message", "role": "user", "content": t});
            return read_input(WireInput::Items(vec![item]), prior).map_err(|mut e| {
                // One text has one name.
                e.param = Some("input".into());
                e
            });
        }
        WireInput::Items(v) if v.is_empty() => {
            return Err(ApiError::invalid("input", "at least one item is required"));
        }
        WireInput::Items(v) => v,
    };
    let mut msgs: Vec<ChatMessage> = Vec::with_capacity(items.len());
    let mut listed = Vec::with_capacity(items.len());
    // A reasoning item's text, for the assistant turn right after it.
    let mut thought: Option<String> = None;
    for (i, item) in items.into_iter().enumerate() {
        let at = format!("input[{i}]");
        let Value::Object(mut obj) = item else {
            return Err(ApiError::invalid(
                at,
                "must be an object: a message or an item",
            ));
        };
        let kind = match obj.get("type") {
            None | Some(Value::Null) if obj.contains_key("role") => "message".to_string(),
            Some(Value::String(t)) => t.clone(),
            _ => return Err(ApiError::invalid(format!("{at}.type"), "required")),
        };
        let prefix = match kind.as_str() {
            "message" => {
                let role = str_field(&obj, &at, "role")?.to_string();
                let content = text_of(obj.get("content"), &format!("{at}.content"))?;
                let msg = ChatMessage {
                    role: role.clone(),
                    content: Some(content.clone()),
                    reasoning: thought.take().filter(|_| role == "assistant"),
                    ..ChatMessage::default()
                };
                msgs.push(
                    msg.checked()
                        .map_err(|(f, why)| ApiError::invalid(format!("{at}.{f}"), why))?,
                );
                if obj.get("content").is_some_and(Value::is_string) {
                    let part = if role == "assistant" {
                        "output_text"
                    } else {
                        "input_text"
                    };
                    obj.insert("content".into(), json!([{"type": part, "text": content}]));
                }
                obj.insert("type".into(), json!("message"));
                "msg"
            }
            "function_call" => {
                let call = ToolCall {
                    id: str_field(&obj, &at, "call_id")?.to_string(),
                    name: str_field(&obj, &at, "name")?.to_string(),
                    arguments: obj
                        .get("arguments")
                        .and_then(Value::as_str)
                        .filter(|a| serde_json::from_str::<Value>(a).is_ok())
                        .ok_or_else(|| {
                            ApiError::invalid(format!("{at}.arguments"), "must be JSON text")
                        })?
                        .to_string(),
                };
                // Calls after an assistant's text, or after each other, are
                // that one turn's.
                match msgs.last_mut() {
                    Some(m) if m.role == "assistant" && thought.is_none() => {
                        m.tool_calls.push(call);
                    }
                    _ => msgs.push(ChatMessage {
                        role: "assistant".into(),
                        tool_calls: vec![call],
                        reasoning: thought.take(),
                        ..ChatMessage::default()
                    }),
                }
                "fc"
            }
            "function_call_output" => {
                let call_id = str_field(&obj, &at, "call_id")?.to_string();
                let output = text_of(obj.get("output"), &format!("{at}.output"))?;
                let name =
                    openai::called(prior.iter().chain(&msgs), &call_id).ok_or_else(|| {
                        ApiError::invalid(
                            format!("{at}.call_id"),
                            format!("no function_call with call_id `{call_id}` before it"),
                        )
                    })?;
                msgs.push(ChatMessage {
                    role: "tool".into(),
                    content: Some(output),
                    tool_call_id: Some(call_id),
                    name: Some(name),
                    ..ChatMessage::default()
                });
                "fco"
            }
            // Its text goes with the assistant turn after it (templates
            // decide whether to show it again); the item is listed.
            "reasoning" => {
                thought = reasoning_text(&obj).filter(|t| !t.is_empty());
                "rs"
            }
            other => {
                return Err(ApiError::unsupported(
                    &format!("{at}.type"),
                    &format!("input items of type `{other}`"),
                ));
            }
        };
        if !obj.contains_key("id") {
            obj.insert("id".into(), json!(format!("{prefix}_{}", uuid_like())));
        }
        if !obj.contains_key("status") && kind != "reasoning" {
            obj.insert("status".into(), json!("completed"));
        }
        listed.push(Value::Object(obj));
    }
    Ok((msgs, listed))
}

/// `text.format` as chat's `response_format`.
fn response_format_of(format: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let Some(f) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut spec = Map::new();
            for key in ["name", "schema", "strict"] {
                if let Some(v) = f.get(key) {
                    spec.insert(key.into(), v.clone());
                }
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": spec})))
        }
        _ => Err(ApiError::invalid(
            "text.format.type",
            "must be `text`, `json_object` or `json_schema`",
        )),
    }
}

/// Reads a request (`v`, its body, for the settings the response echoes)
/// on top of `prior`, the previous response's conversation.
pub(crate) fn prepare(
    v: &Value,
    r: ResponsesRequest,
    mut common: Common,
    prior: Option<&Stored>,
    (model, can_store): (String, bool),
) -> Result<Prepared, ApiError> {
    // Chat completions' names for what the Responses API names otherwise.
    if common.n.is_some_and(|n| n != 1) {
        return Err(ApiError::unsupported(
            "n",
            "more than one response per request",
        ));
    }
    for (field, set) in [
        ("max_tokens", common.max_tokens.is_some()),
        (
            "max_completion_tokens",
            common.max_completion_tokens.is_some(),
        ),
    ] {
        if set {
            return Err(ApiError::invalid(
                field,
                "the Responses API's limit is `max_output_tokens`",
            ));
        }
    }
    if common.response_format.is_some() {
        return Err(ApiError::invalid(
            "response_format",
            "the Responses API takes `text.format`",
        ));
    }
    if common.prompt_logprobs.is_some() {
        return Err(ApiError::unsupported(
            "prompt_logprobs",
            "prompt_logprobs on /v1/responses",
        ));
    }
    // What cannot be served here is named, never ignored.
    let store = can_store && r.store.unwrap_or(true);
    if r.background && !store {
        return Err(ApiError::invalid(
            "background",
            "a background response is kept to be polled: it needs `store` (and a server \
             that keeps responses, --responses-store-mb above 0)",
        ));
    }
    if r.conversation.as_ref().is_some_and(|c| !c.is_null()) {
        return Err(ApiError::unsupported(
            "conversation",
            "conversations (previous_response_id chains responses)",
        ));
    }
    if r.prompt.as_ref().is_some_and(|p| !p.is_null()) {
        return Err(ApiError::unsupported("prompt", "prompt templates"));
    }
    let truncate = match r.truncation.as_deref() {
        None | Some("disabled") => false,
        Some("auto") => true,
        Some(_) => {
            return Err(ApiError::invalid(
                "truncation",
                "must be `disabled` or `auto`",
            ));
        }
    };
    if r.reasoning
        .as_ref()
        .and_then(|x| x.summary.as_ref())
        .is_some()
    {
        return Err(ApiError::unsupported(
            "reasoning.summary",
            "reasoning summaries (thinking comes whole, as a `reasoning` item)",
        ));
    }
    if let Some(vb) = r.text.as_ref().and_then(|t| t.verbosity.as_deref())
        && vb != "medium"
    {
        return Err(ApiError::unsupported(
            "text.verbosity",
            &format!("verbosity `{vb}`"),
        ));
    }
    if let Some(m) = &r.metadata {
        if m.len() > 16 {
            return Err(ApiError::invalid("metadata", "at most 16 pairs"));
        }
        if let Some(k) = m.keys().find(|k| k.chars().count() > 64) {
            return Err(ApiError::invalid(
                "metadata",
                format!("key `{k}` is longer than 64 characters"),
            ));
        }
        if m.values().any(|v| v.chars().count() > 512) {
            return Err(ApiError::invalid(
                "metadata",
                "values are at most 512 characters",
            ));
        }
    }
    let mut logprobs = false;
    for (i, what) in r.include.iter().flatten().enumerate() {
        match what.as_str() {
            INCLUDE_LOGPROBS => logprobs = true,
            // Nothing encrypted: thinking comes as plain text.
            "reasoning.encrypted_content" => {}
            other => {
                return Err(ApiError::unsupported(
                    &format!("include[{i}]"),
                    &format!("including `{other}`"),
                ));
            }
        }
    }
    let top = r
        .top_logprobs
        .map(|k| openai::check_top(k, "top_logprobs"))
        .transpose()?;
    let logprobs = (logprobs || top.is_some_and(|k| k > 0)).then_some(top.unwrap_or(0));

    // The conversation: instructions, the previous response's, the input.
    let input = r
        .input
        .ok_or_else(|| ApiError::invalid("input", "required"))?;
    let prior_msgs = prior.map_or(&[][..], |p| p.conversation.as_slice());
    let (new_msgs, input_items) = read_input(input, prior_msgs)?;
    let mut conversation = prior_msgs.to_vec();
    conversation.extend(new_msgs);
    let mut msgs = Vec::with_capacity(conversation.len() + 1);
    if let Some(i) = r.instructions.as_ref().filter(|i| !i.is_empty()) {
        msgs.push(ChatMessage {
            role: "system".into(),
            content: Some(i.clone()),
            ..ChatMessage::default()
        });
    }
    msgs.extend(conversation.iter().cloned());

    // Tools, flat in this API, as chat completions nest them.
    let mut wire = Vec::new();
    for (i, t) in r.tools.into_iter().flatten().enumerate() {
        if t.kind != "function" {
            return Err(ApiError::unsupported(
                &format!("tools[{i}].type"),
                &format!("`{}` tools (only `function` tools are served)", t.kind),
            ));
        }
        let name = t
            .name
            .ok_or_else(|| ApiError::invalid(format!("tools[{i}].name"), "required"))?;
        wire.push(openai::nested_tool(name, t.description, t.parameters));
    }
    let tools = openai::tools_of(wire).map_err(renamed)?;
    let choice = match &r.tool_choice {
        Some(Value::Object(o)) => match o.get("type").and_then(Value::as_str) {
            Some("function") => {
                let name = o.get("name").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid("tool_choice.name", "required with type `function`")
                })?;
                Some(json!({"type": "function", "function": {"name": name}}))
            }
            Some(other) => {
                return Err(ApiError::unsupported(
                    "tool_choice.type",
                    &format!("tool_choice of type `{other}`"),
                ));
            }
            None => return Err(ApiError::invalid("tool_choice.type", "required")),
        },
        other => other.clone(),
    };
    let choice = openai::tool_choice_of(choice.as_ref(), &tools)?;
    let parallel = r.parallel_tool_calls.unwrap_or(true);

    let format = r.text.as_ref().and_then(|t| t.format.as_ref());
    common.response_format = response_format_of(format)?;
    common.max_tokens = r.max_output_tokens;
    common.stream_options = None;
    let mut plan = openai::conversation_plan(msgs, (tools, choice, parallel), logprobs, common)
        .map_err(renamed)?;
    plan.request.max_tokens_field = r.max_output_tokens.map(|_| "max_output_tokens");
    match r.reasoning.as_ref().and_then(|x| x.effort.as_deref()) {
        Some("none") => plan.thinking = Some(false),
        Some(e) => plan.effort = Some(("reasoning.effort", e.to_string())),
        None => {}
    }

    // What the response object repeats of the request.
    let mut echo = Map::new();
    let given = |k: &str, default: Value| match v.get(k) {
        None | Some(Value::Null) => default,
        Some(x) => x.clone(),
    };
    for (k, default) in [
        ("instructions", Value::Null),
        ("max_output_tokens", Value::Null),
        ("max_tool_calls", Value::Null),
        ("metadata", json!({})),
        ("parallel_tool_calls", json!(true)),
        ("previous_response_id", Value::Null),
        ("prompt_cache_key", Value::Null),
        ("safety_identifier", Value::Null),
        ("temperature", json!(1.0)),
        ("tool_choice", json!("auto")),
        ("tools", json!([])),
        ("top_logprobs", json!(0)),
        ("top_p", json!(1.0)),
        ("truncation", json!("disabled")),
        ("user", Value::Null),
    ] {
        echo.insert(k.into(), given(k, default));
    }
    echo.insert(
        "text".into(),
        json!({"format": format.filter(|f| !f.is_null()).cloned().unwrap_or(json!({"type": "text"}))}),
    );
    let effort = r.reasoning.as_ref().and_then(|x| x.effort.as_deref());
    echo.insert(
        "reasoning".into(),
        json!({"effort": effort, "summary": null}),
    );
    echo.insert("service_tier".into(), json!("default"));
    echo.insert("background".into(), json!(r.background));
    echo.insert("store".into(), json!(store));
    Ok(Prepared {
        plan,
        head: Head {
            id: format!("resp_{}", uuid_like()),
            created_at: now_s(),
            model,
            echo,
            store,
            background: r.background,
        },
        input_items,
        truncate,
        conversation,
        logprobs: logprobs.is_some(),
    })
}

/// The Responses API's `usage`.
fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// Where a response stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    InProgress,
    Completed,
    /// Cut short (`max_output_tokens`, or its deadline).
    Incomplete,
    Failed,
}

impl Status {
    fn name(self) -> &'static str {
        match self {
            Status::InProgress => "in_progress",
            Status::Completed => "completed",
            Status::Incomplete => "incomplete",
            Status::Failed => "failed",
        }
    }
}

/// A `function_call` output item being written.
struct OpenCall {
    id: String,
    call_id: String,
    name: String,
    arguments: String,
    /// Its place in `output`.
    index: usize,
}

impl OpenCall {
    fn item(&self, status: &str) -> Value {
        json!({
            "type": "function_call", "id": self.id, "call_id": self.call_id,
            "name": self.name, "arguments": self.arguments, "status": status,
        })
    }
}

/// One response's state machine: the runtime's events in, the Responses
/// API's stream events out (each with its `type` and `sequence_number`),
/// and at the end the response object, kept when asked.
pub(crate) struct Builder {
    head: Head,
    logprobs: bool,
    seq: u64,
    /// Thinking split off, tool calls held back.
    router: siliceo_runtime::OutputRouter,
    rs_id: String,
    /// The reasoning item was announced, and ended.
    rs_opened: bool,
    rs_closed: bool,
    rs_text: String,
    msg_id: String,
    /// The message item was announced (`output_item.added`).
    opened: bool,
    text: String,
    /// The output text's log-probability entries so far.
    lps: Vec<Value>,
    /// Log-probabilities of tokens whose text has not gone out yet.
    pending: Vec<TokenLogprob>,
    /// The message item ended.
    msg_closed: bool,
    /// Finished output items.
    output: Vec<Value>,
    /// The function call being written.
    call: Option<OpenCall>,
    /// Finished function calls.
    calls: Vec<ToolCall>,
    status: Status,
    /// When it ended (seconds since the epoch).
    completed_at: Option<u64>,
    usage: Option<Usage>,
    failed: Option<ApiError>,
    /// Where the finished response is kept, with its input and conversation.
    keep: Option<(Arc<ResponseStore>, Vec<Value>, Vec<ChatMessage>)>,
}

impl Builder {
    /// A builder for `p`'s response, its output read as `parsing` says,
    /// kept in `store` when it asked for it.
    pub(crate) fn new(p: Prepared, parsing: Parsing, store: &Arc<ResponseStore>) -> (Self, Plan) {
        let keep = p
            .head
            .store
            .then(|| (store.clone(), p.input_items, p.conversation));
        let b = Builder {
            head: p.head,
            logprobs: p.logprobs,
            seq: 0,
            router: parsing.router(),
            rs_id: format!("rs_{}", uuid_like()),
            rs_opened: false,
            rs_closed: false,
            rs_text: String::new(),
            msg_id: format!("msg_{}", uuid_like()),
            opened: false,
            text: String::new(),
            lps: Vec::new(),
            pending: Vec::new(),
            msg_closed: false,
            output: Vec::new(),
            call: None,
            calls: Vec::new(),
            status: Status::InProgress,
            completed_at: None,
            usage: None,
            failed: None,
            keep,
        };
        (b, p.plan)
    }

    /// The response object as it stands.
    pub(crate) fn response(&self) -> Value {
        let mut v = json!({
            "id": self.head.id,
            "object": "response",
            "created_at": self.head.created_at,
            "status": self.status.name(),
            "error": self.failed.as_ref().map(|e| json!({
                "code": e.code.unwrap_or("server_error"),
                "message": e.message,
            })),
            "incomplete_details": (self.status == Status::Incomplete)
                .then(|| json!({"reason": "max_output_tokens"})),
            "model": self.head.model,
            "output": self.output,
            "usage": self.usage.as_ref().map(usage_json),
        });
        if let Some(t) = self.completed_at {
            v["completed_at"] = json!(t);
        }
        if let Value::Object(o) = &mut v {
            o.extend(self.head.echo.clone());
        }
        v
    }

    fn event(&mut self, kind: &str, mut v: Value) -> Value {
        v["type"] = json!(kind);
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        v
    }

    /// `response.created` and `response.in_progress`.
    pub(crate) fn start(&mut self) -> Vec<Value> {
        let r = self.response();
        vec![
            self.event("response.created", json!({"response": r})),
            self.event("response.in_progress", json!({"response": r})),
        ]
    }

    /// The message item's place in `output`: after the reasoning item, when
    /// there is one (thinking ends before the answer starts).
    fn msg_index(&self) -> usize {
        usize::from(self.rs_opened)
    }

    fn open(&mut self, out: &mut Vec<Value>) {
        if self.opened {
            return;
        }
        self.close_reasoning("completed", out);
        self.opened = true;
        let item = json!({
            "type": "message", "id": self.msg_id, "status": "in_progress",
            "role": "assistant", "content": [],
        });
        let e = self.event(
            "response.output_item.added",
            json!({"output_index": self.msg_index(), "item": item}),
        );
        out.push(e);
        let part = json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
        let e = self.event(
            "response.content_part.added",
            json!({
                "item_id": self.msg_id, "output_index": self.msg_index(), "content_index": 0,
                "part": part,
            }),
        );
        out.push(e);
    }

    /// Thinking, in a `reasoning` item before the answer.
    fn push_reasoning(&mut self, text: &str, out: &mut Vec<Value>) {
        if text.is_empty() {
            return;
        }
        if !self.rs_opened {
            self.rs_opened = true;
            let item = json!({
                "type": "reasoning", "id": self.rs_id, "summary": [], "content": [],
                "status": "in_progress",
            });
            let e = self.event(
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            );
            out.push(e);
        }
        self.rs_text.push_str(text);
        let e = self.event(
            "response.reasoning_text.delta",
            json!({"item_id": self.rs_id, "output_index": 0, "content_index": 0, "delta": text}),
        );
        out.push(e);
    }

    /// Ends the reasoning item (once the answer starts, or the output ends).
    fn close_reasoning(&mut self, status: &str, out: &mut Vec<Value>) {
        if !self.rs_opened || self.rs_closed {
            return;
        }
        self.rs_closed = true;
        let e = self.event(
            "response.reasoning_text.done",
            json!({"item_id": self.rs_id, "output_index": 0, "content_index": 0, "text": self.rs_text}),
        );
        out.push(e);
        let item = json!({
            "type": "reasoning", "id": self.rs_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": self.rs_text}], "status": status,
        });
        let e = self.event(
            "response.output_item.done",
            json!({"output_index": 0, "item": item}),
        );
        out.push(e);
        self.output.push(item);
    }

    /// The model's text: thinking to the reasoning item, the answer to the
    /// message, calls to `function_call` items as they are written; `end`:
    /// and all held back. Returns whether the output ended inside a call's
    /// arguments.
    fn route(&mut self, text: &str, end: bool, out: &mut Vec<Value>) -> bool {
        let r = self.router.push(text, end);
        self.push_reasoning(&r.reasoning, out);
        self.push_text(&r.answer, out);
        for piece in r.calls {
            match piece {
                CallPiece::Call(name) => self.open_call(name, out),
                CallPiece::Args(args) => self.push_args(&args, out),
                CallPiece::Text(_) => {}
            }
        }
        r.cut
    }

    /// A function call begins: the items before it end.
    fn open_call(&mut self, name: String, out: &mut Vec<Value>) {
        self.close_reasoning("completed", out);
        self.close_message("completed", out);
        self.close_call("completed", out);
        let call = OpenCall {
            id: format!("fc_{}", uuid_like()),
            call_id: format!("call_{}", uuid_like()),
            name,
            arguments: String::new(),
            index: self.output.len(),
        };
        let item = call.item("in_progress");
        let e = self.event(
            "response.output_item.added",
            json!({"output_index": call.index, "item": item}),
        );
        out.push(e);
        self.call = Some(call);
    }

    fn push_args(&mut self, args: &str, out: &mut Vec<Value>) {
        let Some(call) = self.call.as_mut() else {
            return;
        };
        call.arguments.push_str(args);
        let v = json!({"item_id": call.id, "output_index": call.index, "delta": args});
        let e = self.event("response.function_call_arguments.delta", v);
        out.push(e);
    }

    /// Ends the function call being written, if any.
    fn close_call(&mut self, status: &str, out: &mut Vec<Value>) {
        let Some(call) = self.call.take() else {
            return;
        };
        let v = json!({
            "item_id": call.id, "output_index": call.index, "name": call.name,
            "arguments": call.arguments,
        });
        let e = self.event("response.function_call_arguments.done", v);
        out.push(e);
        let item = call.item(status);
        let e = self.event(
            "response.output_item.done",
            json!({"output_index": call.index, "item": item}),
        );
        out.push(e);
        self.output.push(item);
        self.calls.push(ToolCall {
            id: call.call_id,
            name: call.name,
            arguments: call.arguments,
        });
    }

    /// Ends the message item, if it was opened.
    fn close_message(&mut self, status: &str, out: &mut Vec<Value>) {
        if !self.opened || self.msg_closed {
            return;
        }
        self.msg_closed = true;
        let tail = self.take_logprobs();
        self.lps.extend(tail);
        let part = json!({
            "type": "output_text", "text": self.text, "annotations": [], "logprobs": self.lps,
        });
        let id = self.msg_id.clone();
        let index = self.msg_index();
        let e = self.event(
            "response.output_text.done",
            json!({
                "item_id": id, "output_index": index, "content_index": 0,
                "text": self.text, "logprobs": self.lps,
            }),
        );
        out.push(e);
        let e = self.event(
            "response.content_part.done",
            json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
        );
        out.push(e);
        let item = json!({
            "type": "message", "id": id, "status": status,
            "role": "assistant", "content": [part],
        });
        let e = self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        out.push(e);
        self.output.push(item);
    }

    /// The pending log-probabilities as output text entries.
    fn take_logprobs(&mut self) -> Vec<Value> {
        if self.pending.is_empty() {
            return Vec::new();
        }
        let lps = std::mem::take(&mut self.pending);
        match logprobs_json(Kind::Chat, &lps, &mut 0) {
            Value::Object(mut o) => match o.remove("content") {
                Some(Value::Array(a)) => a,
                _ => Vec::new(),
            },
            _ => Vec::new(),
        }
    }

    fn push_text(&mut self, text: &str, out: &mut Vec<Value>) {
        if text.is_empty() {
            return;
        }
        self.open(out);
        let lps = self.take_logprobs();
        self.text.push_str(text);
        self.lps.extend(lps.iter().cloned());
        let e = self.event(
            "response.output_text.delta",
            json!({
                "item_id": self.msg_id, "output_index": self.msg_index(), "content_index": 0,
                "delta": text, "logprobs": lps,
            }),
        );
        out.push(e);
    }

    /// The stream events for the runtime's next event.
    fn events_of(&mut self, ev: Event) -> Vec<Value> {
        let mut out = Vec::new();
        match ev {
            // Not asked for on this endpoint.
            Event::Prompt { .. } => {}
            Event::Text { text, logprobs, .. } => {
                if self.logprobs {
                    self.pending.extend(logprobs);
                }
                self.route(&text, false, &mut out);
            }
            Event::Done {
                finish_reason,
                usage,
                error,
                ..
            } => match error {
                Some(e) => self.fail_into(ApiError::from_runtime(&e), &mut out),
                None => self.finish(finish_reason, usage, &mut out),
            },
        }
        out
    }

    /// Ends the response as failed (`response.failed`).
    fn fail_into(&mut self, e: ApiError, out: &mut Vec<Value>) {
        self.failed = Some(e);
        self.status = Status::Failed;
        let r = self.response();
        out.push(self.event("response.failed", json!({"response": r.clone()})));
        // A background response's poller learns of the failure from it.
        if self.head.background
            && let Some((store, items, conversation)) = self.keep.take()
        {
            store.put(self.head.id.clone(), r, items, conversation);
        }
    }

    /// Keeps the response as it stands (a background response, before it
    /// runs).
    fn keep_now(&self) {
        if let Some((store, items, conversation)) = &self.keep {
            store.put(
                self.head.id.clone(),
                self.response(),
                items.clone(),
                conversation.clone(),
            );
        }
    }

    fn finish(&mut self, finish: FinishReason, usage: Usage, out: &mut Vec<Value>) {
        let cut = self.route("", true, out);
        let called = self.call.is_some() || !self.calls.is_empty();
        self.status = match finish {
            FinishReason::Stop => Status::Completed,
            _ if called && !cut => Status::Completed,
            _ => Status::Incomplete,
        };
        let status = if self.status == Status::Incomplete {
            "incomplete"
        } else {
            "completed"
        };
        self.close_reasoning(status, out);
        self.close_call(if cut { "incomplete" } else { "completed" }, out);
        // A response always says something: an empty message if nothing.
        if !called {
            self.open(out);
        }
        self.close_message(status, out);
        self.usage = Some(usage);
        self.completed_at = Some(now_s());
        let r = self.response();
        let kind = if self.status == Status::Completed {
            "response.completed"
        } else {
            "response.incomplete"
        };
        out.push(self.event(kind, json!({"response": r})));
        if let Some((store, items, mut conversation)) = self.keep.take() {
            // The answer as the next turn's template will see it.
            let content =
                (!self.text.is_empty() || self.calls.is_empty()).then(|| self.text.clone());
            conversation.push(ChatMessage {
                role: "assistant".into(),
                content,
                tool_calls: self.calls.clone(),
                reasoning: (!self.rs_text.is_empty()).then(|| self.rs_text.clone()),
                ..ChatMessage::default()
            });
            store.put(self.head.id.clone(), r, items, conversation);
        }
    }
}

impl EventMachine for Builder {
    fn on_event(&mut self, ev: Event) -> Vec<Value> {
        self.events_of(ev)
    }

    fn fail(&mut self, e: ApiError) -> Vec<Value> {
        let mut out = Vec::new();
        self.fail_into(e, &mut out);
        out
    }

    fn ended(&self) -> bool {
        self.status != Status::InProgress
    }
}

/// `POST /v1/responses`.
pub(crate) async fn create(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let v = body_json(body, s.max_request_bytes)?;
    let r: ResponsesRequest = field_of(&v)?;
    let common: Common = field_of(&v)?;
    openai::check_model(common.model.as_deref(), &s.model_ids)?;
    let stream = common.stream;
    let prior = prior_of(&s, &r)?;
    let model = s.model_ids[0].clone();
    let can_store = s.responses.max_bytes > 0;
    let mut p = prepare(&v, r, common, prior.as_deref(), (model, can_store))?;
    let parsing = crate::parsing(&s, &mut p.plan).map_err(renamed)?;
    let truncate = p.truncate;
    let (mut b, mut plan) = Builder::new(p, parsing, &s.responses);
    if truncate {
        truncate_to_fit(&s, &mut plan).await?;
    }
    let mut rs = start(&s, plan.choice(0)).await.map_err(renamed)?;
    if b.head.background {
        // Kept as it starts; a task runs it to the end, which keeps the
        // final version. Cancelling aborts the task, dropping the request.
        // Streamed, its events are logged for its creator and for clients
        // that resume it.
        let log = stream.then(|| Arc::new(EventLog::new()));
        let first = b.start();
        b.keep_now();
        let created = b.response();
        let id = b.head.id.clone();
        if let Some(l) = &log {
            l.extend(first);
            s.responses.lock().logs.insert(id.clone(), l.clone());
        }
        let guard = RunGuard {
            store: s.responses.clone(),
            id: id.clone(),
            log: log.clone(),
        };
        let task = tokio::spawn(async move {
            let guard = guard;
            while !b.ended() {
                let evs = match rs.next().await {
                    Some(ev) => b.on_event(ev),
                    None => b.fail(ApiError::from_runtime(&RuntimeError::Stopped)),
                };
                if let Some(l) = &guard.log {
                    l.extend(evs);
                }
            }
        });
        s.responses.running(id, task.abort_handle());
        return Ok(match log {
            Some(l) => Sse::new(l.read_from(0))
                .keep_alive(KeepAlive::default())
                .into_response(),
            None => Json(created).into_response(),
        });
    }
    if stream {
        let first = b.start();
        return Ok(Sse::new(TypedEvents::new(rs, b, first))
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    b.start();
    while !b.ended() {
        match rs.next().await {
            Some(ev) => {
                b.on_event(ev);
            }
            None => return Err(ApiError::from_runtime(&RuntimeError::Stopped)),
        }
    }
    if let Some(e) = b.failed.take() {
        return Err(e);
    }
    Ok(Json(b.response()).into_response())
}

/// `truncation: auto`: a conversation over the context loses its oldest
/// turns, whole (it is cut before a user message; the instructions and
/// system messages at its head stay), until it fits beside
/// `max_output_tokens` (one token when unset). The fewest turns go; the
/// kept conversation (what `previous_response_id` continues) stays whole.
/// One that does not fit even with its last turn alone is left for the
/// runtime to refuse.
async fn truncate_to_fit(s: &AppState, plan: &mut Plan) -> Result<(), ApiError> {
    let Input::Chat(msgs) = &plan.request.input else {
        return Ok(());
    };
    let n_ctx = s.rt.info().n_ctx as usize;
    let room = match plan.request.max_tokens_field {
        Some(_) => plan.request.sampling.max_tokens as usize,
        None => 1,
    };
    let head = msgs.iter().take_while(|m| m.role == "system").count();
    // Where it may be cut, from none (`head`) to the last turn alone.
    let mut cuts = vec![head];
    cuts.extend((head + 1..msgs.len()).filter(|&i| msgs[i].role == "user"));
    let cut_at = |cut: usize| {
        let mut r = plan.request.clone();
        r.input = Input::Chat(msgs[..head].iter().chain(&msgs[cut..]).cloned().collect());
        r
    };
    // The first cut that fits (each cut holds fewer tokens than the last).
    let (mut lo, mut hi) = (0, cuts.len());
    while lo < hi {
        let mid = (lo + hi) / 2;
        let tokens = crate::prompt_tokens(s, cut_at(cuts[mid]))
            .await
            .map_err(renamed)?;
        if tokens.len() + room <= n_ctx {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    if lo > 0 && lo < cuts.len() {
        plan.request = cut_at(cuts[lo]);
    }
    Ok(())
}

/// The kept response `previous_response_id` names, which must have ended.
fn prior_of(s: &AppState, r: &ResponsesRequest) -> Result<Option<Arc<Stored>>, ApiError> {
    let Some(id) = r.previous_response_id.as_deref().filter(|i| !i.is_empty()) else {
        return Ok(None);
    };
    let p = s.responses.get(id).ok_or_else(|| {
        ApiError::not_found(
            Some("previous_response_id"),
            format!(
                "previous response with id `{id}` not found (never kept, deleted, or dropped \
                 for space)"
            ),
        )
    })?;
    if !matches!(status_of(&p.response), "completed" | "incomplete") {
        return Err(ApiError::invalid(
            "previous_response_id",
            format!(
                "the previous response is {}; only a finished one can be continued",
                status_of(&p.response)
            ),
        ));
    }
    Ok(Some(p))
}

/// `POST /v1/responses/input_tokens`: the prompt tokens a response request
/// with the same input (`instructions`, `previous_response_id`, `input`,
/// `tools`) runs on.
pub(crate) async fn input_tokens(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let v = body_json(body, s.max_request_bytes)?;
    let r: ResponsesRequest = field_of(&v)?;
    let common: Common = field_of(&v)?;
    openai::check_model(common.model.as_deref(), &s.model_ids)?;
    let prior = prior_of(&s, &r)?;
    // Counting keeps nothing.
    let model = s.model_ids[0].clone();
    let mut p = prepare(&v, r, common, prior.as_deref(), (model, false))?;
    crate::apply_thinking(&s, &mut p.plan).map_err(renamed)?;
    if p.truncate {
        truncate_to_fit(&s, &mut p.plan).await?;
    }
    let tokens = crate::prompt_tokens(&s, p.plan.request)
        .await
        .map_err(renamed)?;
    Ok(Json(
        json!({"object": "response.input_tokens", "input_tokens": tokens.len()}),
    ))
}

fn not_kept(id: &str) -> ApiError {
    ApiError::not_found(None, format!("response with id `{id}` not found"))
}

/// `GET /v1/responses/{id}`.
/// With `stream=true`, a background response created with `stream: true`
/// is streamed (again) from the event after `starting_after`, or from its
/// first: the events already sent, then the rest as they come.
pub(crate) async fn retrieve(
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    uri: Uri,
) -> Result<Response, ApiError> {
    let q = query(&uri)?;
    let r = s.responses.get(&id).ok_or_else(|| not_kept(&id))?;
    if q.get("stream").is_none_or(|v| v != "true") {
        return Ok(Json(r.response.clone()).into_response());
    }
    let from = match q.get("starting_after") {
        None => 0,
        Some(n) => n.parse::<usize>().map(|n| n + 1).map_err(|_| {
            ApiError::invalid("starting_after", "must be an event's sequence number")
        })?,
    };
    let log = s.responses.log(&id).ok_or_else(|| {
        ApiError::invalid(
            "stream",
            "only a background response created with `stream: true` can be streamed again \
             (its events are not kept otherwise, or were dropped for space)",
        )
    })?;
    Ok(Sse::new(log.read_from(from))
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// `DELETE /v1/responses/{id}`.
pub(crate) async fn delete(
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if !s.responses.remove(&id) {
        return Err(not_kept(&id));
    }
    Ok(Json(
        json!({"id": id, "object": "response", "deleted": true}),
    ))
}

/// `POST /v1/responses/{id}/cancel`: a background response in progress is
/// stopped and kept as `cancelled`; a finished one is returned as it is.
pub(crate) async fn cancel(
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if let Some(r) = s.responses.cancel(&id) {
        return Ok(Json(r));
    }
    let r = s.responses.get(&id).ok_or_else(|| not_kept(&id))?;
    if r.response["background"] != json!(true) {
        return Err(ApiError::invalid(
            "response_id",
            "only background responses can be cancelled",
        ));
    }
    Ok(Json(r.response.clone()))
}

/// A query string's pairs, percent-decoded.
fn query(uri: &Uri) -> Result<HashMap<String, String>, ApiError> {
    let mut out = HashMap::new();
    for pair in uri
        .query()
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(&s.replace('+', " "))
                .decode_utf8()
                .map(|c| c.into_owned())
                .map_err(|_| ApiError::invalid("query", "not UTF-8"))
        };
        out.insert(decode(k)?, decode(v)?);
    }
    Ok(out)
}

/// `GET /v1/responses/{id}/input_items`: the items `input` gave, `desc`
/// (newest first) unless `order=asc`, `limit` (1–100, default 20) after
/// the item `after`.
pub(crate) async fn input_items(
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    uri: Uri,
) -> Result<Json<Value>, ApiError> {
    let q = query(&uri)?;
    let r = s.responses.get(&id).ok_or_else(|| not_kept(&id))?;
    let limit = match q.get("limit") {
        None => 20,
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|l| (1..=100).contains(l))
            .ok_or_else(|| ApiError::invalid("limit", "must be 1 to 100"))?,
    };
    let mut items: Vec<&Value> = r.input_items.iter().collect();
    match q.get("order").map(String::as_str) {
        None | Some("desc") => items.reverse(),
        Some("asc") => {}
        Some(_) => return Err(ApiError::invalid("order", "must be `asc` or `desc`")),
    }
    let from = match q.get("after") {
        None => 0,
        Some(after) => {
            1 + items
                .iter()
                .position(|i| i["id"].as_str() == Some(after))
                .ok_or_else(|| ApiError::invalid("after", "no input item has this id"))?
        }
    };
    let page: Vec<Value> = items
        .iter()
        .skip(from)
        .take(limit)
        .map(|&i| i.clone())
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": page,
        "first_id": page.first().map(|i| i["id"].clone()),
        "last_id": page.last().map(|i| i["id"].clone()),
        "has_more": from + page.len() < items.len(),
    })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn prep(body: Value) -> Result<Prepared, ApiError> {
        prep_after(body, None)
    }

    fn prep_after(body: Value, prior: Option<&Stored>) -> Result<Prepared, ApiError> {
        let r: ResponsesRequest = field_of(&body)?;
        let c: Common = field_of(&body)?;
        prepare(&body, r, c, prior, ("m".into(), true))
    }

    fn chat_of(p: &Prepared) -> &[ChatMessage] {
        match &p.plan.request.input {
            siliceo_runtime::Input::Chat(m) => m,
            other => panic!("not a chat: {other:?}"),
        }
    }

    fn param(body: Value) -> String {
        match prep(body) {
            Ok(_) => panic!("accepted"),
            Err(e) => {
                assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{e}");
                e.param.unwrap_or_default()
            }
        }
    }

    #[test]
    fn a_text_input_is_a_user_message_after_the_instructions() {
        let p = prep(json!({
            "input": "hi", "instructions": "Be brief.", "max_output_tokens": 9,
            "temperature": 0, "seed": 3, "top_k": 4,
        }))
        .unwrap();
        let m = chat_of(&p);
        assert_eq!(m.len(), 2);
        assert_eq!(
            (m[0].role.as_str(), m[0].content.as_deref()),
            ("system", Some("Be brief."))
        );
        assert_eq!(
            (m[1].role.as_str(), m[1].content.as_deref()),
            ("user", Some("hi"))
        );
        let s = &p.plan.request.sampling;
        assert_eq!(
            (s.max_tokens, s.temperature, s.seed, s.top_k),
            (9, 0.0, Some(3), 4)
        );
        assert_eq!(p.plan.request.max_tokens_field, Some("max_output_tokens"));
        // The instructions are this response's alone.
        assert_eq!(p.conversation.len(), 1);
        assert_eq!(p.input_items.len(), 1);
        assert_eq!(
            p.input_items[0]["content"],
            json!([{"type": "input_text", "text": "hi"}])
        );
        assert_eq!(p.head.echo["instructions"], "Be brief.");
        assert_eq!(p.head.echo["store"], true);
    }

    #[test]
    fn items_become_a_chat_with_calls_and_their_outputs() {
        let p = prep(json!({"input": [
            {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
            {"type": "message", "role": "user", "content": "Weather in Paris and Rome?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{\"city\":\"Rome\"}"},
            {"type": "function_call_output", "call_id": "c2", "output": "20C"},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "18C"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
        ]}))
        .unwrap();
        let m = chat_of(&p);
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "tool"]);
        assert_eq!(m[2].content.as_deref(), Some("Looking."));
        let ids: Vec<&str> = m[2].tool_calls.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["c1", "c2"]);
        assert_eq!(m[3].tool_call_id.as_deref(), Some("c2"));
        assert_eq!(m[3].name.as_deref(), Some("weather"));
        assert_eq!(m[4].content.as_deref(), Some("18C"));
        assert_eq!(p.input_items.len(), 8);
        assert!(p.input_items.iter().all(|i| i["id"].is_string()));
    }

    /// A reasoning item's text goes with the assistant turn after it (a
    /// message, or calls), never with a user's.
    #[test]
    fn reasoning_items_go_with_the_next_assistant_turn() {
        let thought = |t: &str| {
            json!({"type": "reasoning", "id": "rs_1", "summary": [],
            "content": [{"type": "reasoning_text", "text": t}]})
        };
        let p = prep(json!({"input": [
            {"role": "user", "content": "Weather?"},
            thought("Need a call."),
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "18C"},
            {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Got it."}]},
            {"type": "message", "role": "assistant", "content": "Sunny."},
            thought("Ignored."),
            {"role": "user", "content": "Thanks."},
        ]}))
        .unwrap();
        let m = chat_of(&p);
        let got: Vec<(&str, Option<&str>)> = m
            .iter()
            .map(|m| (m.role.as_str(), m.reasoning.as_deref()))
            .collect();
        assert_eq!(
            got,
            [
                ("user", None),
                ("assistant", Some("Need a call.")),
                ("tool", None),
                ("assistant", Some("Got it.")),
                ("user", None),
            ]
        );
    }

    #[test]
    fn a_previous_response_continues_without_its_instructions() {
        let prior = Stored {
            response: json!({}),
            input_items: Vec::new(),
            conversation: vec![
                ChatMessage {
                    role: "user".into(),
                    content: Some("Call it.".into()),
                    ..ChatMessage::default()
                },
                ChatMessage {
                    role: "assistant".into(),
                    tool_calls: vec![ToolCall {
                        id: "call_9".into(),
                        name: "f".into(),
                        arguments: "{}".into(),
                    }],
                    ..ChatMessage::default()
                },
            ],
            bytes: 0,
        };
        let p = prep_after(
            json!({
                "instructions": "New rules.",
                "input": [{"type": "function_call_output", "call_id": "call_9", "output": "done"}],
            }),
            Some(&prior),
        )
        .unwrap();
        let roles: Vec<&str> = chat_of(&p).iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool"]);
        assert_eq!(chat_of(&p)[3].name.as_deref(), Some("f"));
        assert_eq!(p.conversation.len(), 3);
    }

    #[test]
    fn text_format_tools_and_logprobs_take_the_chats_path() {
        let p = prep(json!({
            "input": "x",
            "text": {"format": {"type": "json_schema", "name": "p", "strict": true,
                     "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
            "include": ["message.output_text.logprobs"], "top_logprobs": 3,
        }))
        .unwrap();
        assert!(matches!(
            p.plan.request.constraint,
            Some(siliceo_core::Constraint::JsonSchema { strict: true, .. })
        ));
        assert_eq!(p.plan.request.logprobs, Some(3));
        assert!(p.logprobs);
        let p = prep(json!({"input": "x", "text": {"format": {"type": "json_object"}}})).unwrap();
        assert_eq!(
            p.plan.request.constraint,
            Some(siliceo_core::Constraint::JsonObject)
        );
        assert_eq!(p.plan.request.logprobs, None);
        let p = prep(json!({
            "input": "x",
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": false,
        }))
        .unwrap();
        let tp = p.plan.tools.as_ref().unwrap();
        assert_eq!(tp.choice, siliceo_runtime::ToolChoice::Function("f".into()));
        assert!(!tp.parallel);
        assert_eq!(p.plan.request.tools[0].name, "f");
        assert_eq!(p.plan.request.logprobs, None);
    }

    #[test]
    fn what_cannot_be_served_is_named() {
        let cases = [
            (json!({}), "input"),
            (json!({"input": []}), "input"),
            (json!({"input": 5}), "input"),
            (json!({"input": "x", "max_tokens": 5}), "max_tokens"),
            (
                json!({"input": "x", "max_output_tokens": 0}),
                "max_output_tokens",
            ),
            (json!({"input": "x", "n": 2}), "n"),
            (
                json!({"input": "x", "response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (
                json!({"input": "x", "background": true, "store": false}),
                "background",
            ),
            (
                json!({"input": "x", "truncation": "sometimes"}),
                "truncation",
            ),
            (
                json!({"input": "x", "include": ["file_search_call.results"]}),
                "include[0]",
            ),
            (json!({"input": "x", "top_logprobs": 21}), "top_logprobs"),
            (
                json!({"input": "x", "tools": [{"type": "web_search"}]}),
                "tools[0].type",
            ),
            (
                json!({"input": "x", "tools": [{"type": "function", "name": "a b"}]}),
                "tools[0].name",
            ),
            (
                json!({"input": "x", "tool_choice": "required"}),
                "tool_choice",
            ),
            (
                json!({"input": "x", "text": {"format": {"type": "yaml"}}}),
                "text.format.type",
            ),
            (
                json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}),
                "text.format.schema",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
                "input[0].content[0].type",
            ),
            (
                json!({"input": [{"role": "wizard", "content": "x"}]}),
                "input[0].role",
            ),
            (
                json!({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}),
                "input[0].arguments",
            ),
            (
                json!({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}),
                "input[0].call_id",
            ),
            (
                json!({"input": [{"type": "item_reference", "id": "x"}]}),
                "input[0].type",
            ),
            (json!({"input": ["x"]}), "input[0]"),
        ];
        for (body, want) in cases {
            assert_eq!(param(body.clone()), want, "{body}");
        }
    }

    fn done(finish: FinishReason) -> Event {
        Event::Done {
            finish_reason: finish,
            usage: Usage {
                prompt_tokens: 5,
                completion_tokens: 2,
                ..Usage::default()
            },
            error: None,
            stop: None,
        }
    }

    fn text(t: &str) -> Event {
        Event::Text {
            text: t.into(),
            tokens: vec![siliceo_core::TokenId(1)],
            logprobs: Vec::new(),
        }
    }

    /// The events a client's accumulator needs, in order, and the same
    /// output in the last event as in the response object.
    #[test]
    fn events_build_the_response_they_end_with() {
        let store = Arc::new(ResponseStore::new(1 << 20));
        let p = prep(json!({"input": "hi", "metadata": {"k": "v"}})).unwrap();
        let (mut b, _) = Builder::new(p, Parsing::default(), &store);
        let mut evs = b.start();
        evs.extend(b.on_event(text("Hello")));
        evs.extend(b.on_event(text(", you")));
        evs.extend(b.on_event(done(FinishReason::Length)));
        let kinds: Vec<&str> = evs.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.incomplete",
            ]
        );
        let seqs: Vec<u64> = evs
            .iter()
            .map(|e| e["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(seqs, (0..10).collect::<Vec<_>>());
        let r = b.response();
        assert_eq!(evs[9]["response"]["output"], r["output"]);
        assert_eq!(r["status"], "incomplete");
        assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(r["output"][0]["content"][0]["text"], "Hello, you");
        assert_eq!(r["output"][0]["status"], "incomplete");
        assert_eq!(r["usage"]["total_tokens"], 7);
        assert_eq!(r["metadata"], json!({"k": "v"}));
        // Kept, with the answer last in its conversation.
        let kept = store.get(r["id"].as_str().unwrap()).unwrap();
        assert_eq!(kept.response, r);
        let last = kept.conversation.last().unwrap();
        assert_eq!(
            (last.role.as_str(), last.content.as_deref()),
            ("assistant", Some("Hello, you"))
        );
    }

    /// A reasoning model's thinking is a `reasoning` item before the
    /// message, its text streamed as `reasoning_text` deltas.
    #[test]
    fn thinking_comes_first_as_a_reasoning_item() {
        let store = Arc::new(ResponseStore::new(1 << 20));
        let p = prep(json!({"input": "hi"})).unwrap();
        let (mut b, _) = Builder::new(
            p,
            Parsing {
                tools: None,
                think: Some(false),
                one_call: false,
                ..Parsing::default()
            },
            &store,
        );
        let mut evs = b.start();
        for t in ["<think>Hm", "m.</th", "ink>\n\nHel", "lo"] {
            evs.extend(b.on_event(text(t)));
        }
        evs.extend(b.on_event(done(FinishReason::Stop)));
        let kinds: Vec<(&str, Option<u64>)> = evs
            .iter()
            .map(|e| (e["type"].as_str().unwrap(), e["output_index"].as_u64()))
            .collect();
        assert_eq!(
            kinds,
            [
                ("response.created", None),
                ("response.in_progress", None),
                ("response.output_item.added", Some(0)),
                ("response.reasoning_text.delta", Some(0)),
                ("response.reasoning_text.delta", Some(0)),
                ("response.reasoning_text.done", Some(0)),
                ("response.output_item.done", Some(0)),
                ("response.output_item.added", Some(1)),
                ("response.content_part.added", Some(1)),
                ("response.output_text.delta", Some(1)),
                ("response.output_text.delta", Some(1)),
                ("response.output_text.done", Some(1)),
                ("response.content_part.done", Some(1)),
                ("response.output_item.done", Some(1)),
                ("response.completed", None),
            ]
        );
        let r = b.response();
        assert_eq!(r["output"][0]["type"], "reasoning");
        assert_eq!(r["output"][0]["content"][0]["text"], "Hmm.");
        assert_eq!(r["output"][1]["content"][0]["text"], "Hello");
        // The next turn sees the answer, not the thinking.
        let kept = store.get(r["id"].as_str().unwrap()).unwrap();
        assert_eq!(
            kept.conversation.last().unwrap().content.as_deref(),
            Some("Hello")
        );
    }

    /// Text, then a call streamed as written: the message ends when the
    /// call begins, the call's item opens once its name is written, its
    /// argument deltas add up to its arguments; cut short, it is incomplete.
    #[test]
    fn function_calls_stream_as_they_are_written() {
        let store = Arc::new(ResponseStore::new(1 << 20));
        let parsing = Parsing {
            tools: Some(siliceo_runtime::ToolSyntax::Hermes),
            think: None,
            one_call: false,
            ..Parsing::default()
        };
        let out =
            "Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, 2]}}\n</tool_call>";
        let p = prep(json!({"input": "hi"})).unwrap();
        let (mut b, _) = Builder::new(p, parsing.clone(), &store);
        let mut evs = b.start();
        for ch in out.chars() {
            evs.extend(b.on_event(text(&ch.to_string())));
        }
        evs.extend(b.on_event(done(FinishReason::Stop)));
        let kinds: Vec<&str> = evs.iter().map(|e| e["type"].as_str().unwrap()).collect();
        let at = |k: &str| kinds.iter().position(|x| *x == k).unwrap();
        let deltas: Vec<&str> = evs
            .iter()
            .filter(|e| e["type"] == "response.function_call_arguments.delta")
            .map(|e| e["delta"].as_str().unwrap())
            .collect();
        assert!(deltas.len() > 5, "{deltas:?}");
        assert_eq!(deltas.concat(), r#"{"a": [1, 2]}"#);
        let added = evs
            .iter()
            .rposition(|e| e["type"] == "response.output_item.added")
            .unwrap();
        assert_eq!(evs[added]["item"]["type"], "function_call");
        assert_eq!(evs[added]["output_index"], 1);
        assert!(at("response.output_text.done") < added);
        assert!(added < at("response.function_call_arguments.delta"));
        let r = b.response();
        assert_eq!(r["status"], "completed");
        assert_eq!(r["output"][0]["content"][0]["text"], "Sure.\n");
        assert_eq!(r["output"][1]["name"], "f");
        assert_eq!(r["output"][1]["arguments"], r#"{"a": [1, 2]}"#);
        assert_eq!(r, evs.last().unwrap()["response"]);

        let p = prep(json!({"input": "hi"})).unwrap();
        let (mut b, _) = Builder::new(p, parsing, &store);
        b.start();
        b.on_event(text(&out[..out.find("2]").unwrap()]));
        b.on_event(done(FinishReason::Length));
        let r = b.response();
        assert_eq!(r["status"], "incomplete");
        assert_eq!(r["output"][1]["status"], "incomplete");
        assert_eq!(r["output"][1]["arguments"], r#"{"a": [1, "#);
    }

    #[test]
    fn an_empty_answer_is_an_empty_message_and_a_failure_is_failed() {
        let store = Arc::new(ResponseStore::new(1 << 20));
        let p = prep(json!({"input": "hi", "store": false})).unwrap();
        let (mut b, _) = Builder::new(p, Parsing::default(), &store);
        b.start();
        b.on_event(done(FinishReason::Stop));
        let r = b.response();
        assert_eq!(r["status"], "completed");
        assert_eq!(r["output"][0]["content"][0]["text"], "");
        assert_eq!(store.usage().0, 0, "store: false keeps nothing");

        let p = prep(json!({"input": "hi"})).unwrap();
        let (mut b, _) = Builder::new(p, Parsing::default(), &store);
        b.start();
        b.on_event(text("a"));
        let evs = b.on_event(Event::Done {
            finish_reason: FinishReason::Error,
            usage: Usage::default(),
            error: Some(RuntimeError::Engine("boom".into())),
            stop: None,
        });
        assert_eq!(evs.last().unwrap()["type"], "response.failed");
        assert_eq!(
            evs.last().unwrap()["response"]["error"]["code"],
            "server_error"
        );
        assert!(b.ended());
        assert_eq!(store.usage().0, 0, "a failed response is not kept");
    }

    #[test]
    fn the_store_drops_the_oldest_past_its_budget() {
        let store = ResponseStore::new(1000);
        let big = json!({"t": "x".repeat(300)});
        for i in 0..5 {
            store.put(format!("r{i}"), big.clone(), Vec::new(), Vec::new());
        }
        let (n, bytes) = store.usage();
        assert_eq!(n, 3);
        assert!(bytes <= 1000);
        assert!(store.get("r0").is_none() && store.get("r1").is_none());
        assert!(store.get("r4").is_some());
        assert!(store.remove("r3"));
        assert!(!store.remove("r3"));
        assert_eq!(store.usage().0, 2);
        // Too big to keep at all: nothing else is dropped for it.
        store.put(
            "huge".into(),
            json!({"t": "x".repeat(2000)}),
            Vec::new(),
            Vec::new(),
        );
        assert!(store.get("huge").is_none());
        assert_eq!(store.usage().0, 2);
        let off = ResponseStore::new(0);
        off.put("a".into(), json!({}), Vec::new(), Vec::new());
        assert!(off.get("a").is_none());
    }

    /// A background response cancelled stays cancelled, whatever its task
    /// still writes; one that finished first is not cancelled; replacing a
    /// version keeps the byte count.
    #[tokio::test]
    async fn a_cancelled_background_response_stays_cancelled() {
        let store = ResponseStore::new(1 << 20);
        let running = json!({"status": "in_progress", "background": true});
        store.put("r".into(), running, Vec::new(), Vec::new());
        let task = tokio::spawn(std::future::pending::<()>());
        store.running("r".into(), task.abort_handle());
        assert_eq!(store.cancel("r").unwrap()["status"], "cancelled");
        assert!(task.await.unwrap_err().is_cancelled());
        let late = json!({"status": "completed"});
        store.put("r".into(), late, Vec::new(), Vec::new());
        assert_eq!(store.get("r").unwrap().response["status"], "cancelled");
        assert!(store.cancel("r").is_none());

        let done = json!({"status": "completed"});
        store.put("d".into(), done.clone(), Vec::new(), Vec::new());
        let finished = tokio::spawn(async {});
        store.running("d".into(), finished.abort_handle());
        assert!(store.cancel("d").is_none());
        let before = store.usage();
        store.put("d".into(), done, Vec::new(), Vec::new());
        assert_eq!(store.usage(), before);
    }

    /// A log's readers get the events from where they start, wait for more,
    /// and end with the log; a reader that leaves changes nothing.
    #[tokio::test]
    async fn event_logs_replay_and_follow() {
        use tokio_stream::StreamExt;
        let log = Arc::new(EventLog::new());
        let ev = |n: u64| json!({"type": "t", "sequence_number": n});
        log.extend(vec![ev(0), ev(1)]);
        let mut from_start = log.clone().read_from(0);
        let mut resumed = log.clone().read_from(2);
        let early = log.clone().read_from(0);
        drop(early);
        let seq = |e: axum::response::sse::Event| format!("{e:?}");
        let first = seq(from_start.next().await.unwrap().unwrap());
        assert!(first.contains(r#"sequence_number\":0"#), "{first}");
        let second = seq(from_start.next().await.unwrap().unwrap());
        assert!(second.contains(r#"sequence_number\":1"#), "{second}");
        // Nothing new yet: both wait.
        let waiting = tokio::time::timeout(Duration::from_millis(50), resumed.next()).await;
        assert!(waiting.is_err());
        let writer = {
            let log = log.clone();
            tokio::spawn(async move {
                log.extend(vec![ev(2)]);
                log.end();
            })
        };
        let got = seq(resumed.next().await.unwrap().unwrap());
        assert!(got.contains(r#"sequence_number\":2"#), "{got}");
        assert!(resumed.next().await.is_none());
        writer.await.unwrap();
        let third = seq(from_start.next().await.unwrap().unwrap());
        assert!(third.contains(r#"sequence_number\":2"#), "{third}");
        assert!(from_start.next().await.is_none());
        assert_eq!(log.bytes(), 3 * ev(0).to_string().len());
    }

    #[test]
    fn errors_are_renamed_to_this_apis_fields() {
        let e = renamed(ApiError::invalid("messages", "roles must alternate"));
        assert_eq!(e.param.as_deref(), Some("input"));
        assert_eq!(e.message, "input: roles must alternate");
        let e = renamed(ApiError::invalid("tools[1].function.parameters", "bad"));
        assert_eq!(e.param.as_deref(), Some("tools[1].parameters"));
        let e = renamed(ApiError::invalid("max_tokens_x", "bad"));
        assert_eq!(e.param.as_deref(), Some("max_tokens_x"));
    }
}
