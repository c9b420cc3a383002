//! Server-sent events for streamed completions: the choices' runtime events
//! as OpenAI's chunks, then an optional usage chunk, then `[DONE]`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::response::sse::Event as SseEvent;
use serde_json::{Value, json};
use siliceo_core::TokenId;
use siliceo_runtime::{
    CallPiece, Event, OutputRouter, ParsedOutput, RequestStream, TokenLogprob, ToolSyntax, Usage,
};
use tokio_stream::Stream;

use crate::error::ApiError;
use crate::{finish_name, usage_json};

/// How a chat's output is read: tool calls in the model's syntax (when
/// tools are offered), and a reasoning model's thinking (`Some(open)`: split
/// off, `open` when the prompt opened the block).
#[derive(Debug, Clone, Default)]
pub(crate) struct Parsing {
    pub(crate) tools: Option<ToolSyntax>,
    /// The tools offered, whose schemas type XML calls' values.
    pub(crate) schemas: std::sync::Arc<[siliceo_runtime::Tool]>,
    pub(crate) think: Option<bool>,
    /// The tags of the model's thinking.
    pub(crate) think_tags: siliceo_runtime::ThinkTags,
    /// Only the first call is taken (`parallel_tool_calls: false`).
    pub(crate) one_call: bool,
}

impl Parsing {
    /// The reader of an output parsed so.
    pub(crate) fn router(&self) -> OutputRouter {
        let r = OutputRouter::new(self.tools, self.think)
            .with_tools(&self.schemas)
            .with_think_tags(self.think_tags);
        if self.one_call { r.single_call() } else { r }
    }
}

/// Which endpoint a response belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

impl Kind {
    pub(crate) fn id_prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        }
    }

    pub(crate) fn object(self) -> &'static str {
        match self {
            Kind::Chat => "chat.completion",
            Kind::Completion => "text_completion",
        }
    }

    fn chunk_object(self) -> &'static str {
        match self {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        }
    }

    /// A whole (non-streamed) choice; a chat's thinking goes to
    /// `reasoning_content` and, with tools, calls in the answer become
    /// `tool_calls`; with `echo` (completions), the prompt's text and, when
    /// log-probabilities were asked for, its tokens' come first.
    pub(crate) fn choice(
        self,
        index: usize,
        text: &str,
        finish: siliceo_core::FinishReason,
        parsing: &Parsing,
        lps: Option<&[TokenLogprob]>,
        echo: Option<Echoed<'_>>,
    ) -> Value {
        let head = echo.as_ref().map_or("", |e| e.text);
        // Offsets into the text returned, echoed prompt included.
        let mut logprobs = lps.map_or(Value::Null, |l| logprobs_json(self, l, &mut head.len()));
        if let Some((scores, top)) = echo.and_then(|e| e.scores).filter(|_| !logprobs.is_null()) {
            logprobs = joined(prompt_logprobs_json(scores, top), logprobs);
        }
        match self {
            Kind::Chat => {
                // Read as a stream is: the same router, all at once.
                let r = parsing.router().push(text, true);
                let mut c = json!({
                    "index": index,
                    "message": {"role": "assistant", "content": r.answer},
                    "logprobs": logprobs,
                    "finish_reason": finish_name(finish),
                });
                if !r.calls.is_empty() {
                    let parsed = ParsedOutput::from_pieces(r.calls, r.cut);
                    let calls: Vec<Value> = parsed
                        .calls
                        .iter()
                        .map(|(name, args)| tool_call_json(None, name, args))
                        .collect();
                    let content = r.answer.trim();
                    c["message"]["content"] = json!((!content.is_empty()).then_some(content));
                    c["message"]["tool_calls"] = json!(calls);
                    if !parsed.cut_short {
                        c["finish_reason"] = json!("tool_calls");
                    }
                }
                if parsing.think.is_some() {
                    let reasoning = (!r.reasoning.is_empty()).then_some(r.reasoning);
                    c["message"]["reasoning_content"] = json!(reasoning);
                }
                c
            }
            Kind::Completion => json!({
                "index": index,
                "text": format!("{head}{text}"),
                "logprobs": logprobs,
                "finish_reason": finish_name(finish),
            }),
        }
    }

    /// A streamed choice: new text, or the end (`finish`).
    fn delta(
        self,
        index: usize,
        text: Option<&str>,
        role: bool,
        finish: Option<&str>,
        logprobs: Value,
    ) -> Value {
        match self {
            Kind::Chat => {
                let mut delta = json!({});
                if role {
                    delta["role"] = json!("assistant");
                }
                if let Some(t) = text {
                    delta["content"] = json!(t);
                }
                json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Completion => json!({
                "index": index,
                "text": text.unwrap_or(""),
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
        }
    }
}

/// OpenAI's `logprobs` of a run of tokens: chat's `{"content": […]}`, or
/// completions' parallel lists (`offset`: the text offset of the first
/// token, advanced past them).
pub(crate) fn logprobs_json(kind: Kind, lps: &[TokenLogprob], offset: &mut usize) -> Value {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    match kind {
        Kind::Chat => {
            let content: Vec<Value> = lps
                .iter()
                .map(|l| {
                    let top: Vec<Value> = l
                        .top
                        .iter()
                        .map(|(_, b, lp)| json!({"token": text(b), "logprob": lp, "bytes": b}))
                        .collect();
                    json!({
                        "token": text(&l.bytes),
                        "logprob": l.logprob,
                        "bytes": l.bytes,
                        "top_logprobs": top,
                    })
                })
                .collect();
            json!({"content": content})
        }
        Kind::Completion => {
            let mut offsets = Vec::with_capacity(lps.len());
            for l in lps {
                offsets.push(*offset);
                *offset += text(&l.bytes).len();
            }
            let top: Vec<Value> = lps
                .iter()
                .map(|l| {
                    let m: serde_json::Map<String, Value> = l
                        .top
                        .iter()
                        .map(|(_, b, lp)| (text(b), json!(lp)))
                        .collect();
                    Value::Object(m)
                })
                .collect();
            json!({
                "tokens": lps.iter().map(|l| text(&l.bytes)).collect::<Vec<_>>(),
                "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                "top_logprobs": top,
                "text_offset": offsets,
            })
        }
    }
}

/// A prompt's log-probabilities as [`Event::Prompt`] brings them: its first
/// token (and bytes), then every later token's.
pub(crate) type PromptScores = ((TokenId, Vec<u8>), Vec<TokenLogprob>);

/// What a completion echoes: the prompt's text, and its scores with the
/// alternatives to show when log-probabilities were asked for.
pub(crate) struct Echoed<'a> {
    pub(crate) text: &'a str,
    pub(crate) scores: Option<(&'a PromptScores, usize)>,
}

/// The scores with at most `top` alternatives each (one scoring serves an
/// echo's `logprobs` and `prompt_logprobs`, which may ask for different
/// counts).
fn with_top(rest: &[TokenLogprob], top: usize) -> Vec<TokenLogprob> {
    rest.iter()
        .map(|l| TokenLogprob {
            top: l.top.iter().take(top).cloned().collect(),
            ..l.clone()
        })
        .collect()
}

/// Completions' parallel lists for an echoed prompt (`top` alternatives per
/// token): its first token has no log-probability and no alternatives
/// (`null`), as on OpenAI's API.
pub(crate) fn prompt_logprobs_json(((_, first), rest): &PromptScores, top: usize) -> Value {
    let mut offset = String::from_utf8_lossy(first).len();
    let rest = with_top(rest, top);
    let Value::Object(mut lists) = logprobs_json(Kind::Completion, &rest, &mut offset) else {
        unreachable!("completions' logprobs are an object")
    };
    let head = [
        ("tokens", json!(String::from_utf8_lossy(first))),
        ("token_logprobs", Value::Null),
        ("top_logprobs", Value::Null),
        ("text_offset", json!(0)),
    ];
    for (k, v) in head {
        if let Some(Value::Array(a)) = lists.get_mut(k) {
            a.insert(0, v);
        }
    }
    Value::Object(lists)
}

/// vLLM's `prompt_logprobs`: `null` for the first prompt token, then for
/// each later one an object keyed by token id holding the token's own entry
/// and its `top` most likely alternatives', each `{logprob, rank,
/// decoded_token}`.
pub(crate) fn vllm_prompt_logprobs((_, rest): &PromptScores, top: usize) -> Value {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let mut out = Vec::with_capacity(rest.len() + 1);
    out.push(Value::Null);
    for l in rest {
        let mut m = serde_json::Map::new();
        let alts = &l.top[..l.top.len().min(top)];
        for (i, (t, b, lp)) in alts.iter().enumerate() {
            // Alternatives come most likely first: those before it that are
            // strictly more likely are all the vocabulary's.
            let rank = 1 + alts[..i].iter().filter(|a| a.2 > *lp).count();
            m.insert(
                t.0.to_string(),
                json!({"logprob": lp, "rank": rank, "decoded_token": text(b)}),
            );
        }
        m.insert(
            l.token.0.to_string(),
            json!({"logprob": l.logprob, "rank": l.rank, "decoded_token": text(&l.bytes)}),
        );
        out.push(Value::Object(m));
    }
    Value::Array(out)
}

/// Completions' lists `a` followed by `b`'s.
fn joined(mut a: Value, b: Value) -> Value {
    if let (Value::Object(a), Value::Object(b)) = (&mut a, b) {
        for (k, v) in b {
            if let (Some(Value::Array(x)), Value::Array(y)) = (a.get_mut(&k), v) {
                x.extend(y);
            }
        }
    }
    a
}

/// OpenAI's `tool_calls[i]` (with `index` when streamed).
fn tool_call_json(index: Option<usize>, name: &str, args: &str) -> Value {
    let mut v = json!({
        "id": format!("call_{}", crate::uuid_like()),
        "type": "function",
        "function": {"name": name, "arguments": args},
    });
    if let Some(i) = index {
        v["index"] = json!(i);
    }
    v
}

/// A request's answer as a protocol's typed events (JSON objects with a
/// `type`): the Responses API's and Anthropic's.
pub(crate) trait EventMachine {
    /// The events for the runtime's next event.
    fn on_event(&mut self, ev: Event) -> Vec<Value>;
    /// Ends the answer with an error.
    fn fail(&mut self, e: ApiError) -> Vec<Value>;
    /// The last event went out.
    fn ended(&self) -> bool;
}

/// A typed event as SSE: named by its `type`.
fn typed_sse(v: &Value) -> SseEvent {
    let kind = v["type"].as_str().unwrap_or("error");
    SseEvent::default().event(kind).data(v.to_string())
}

/// The SSE body of a typed-event protocol: each event named by its `type`.
/// Dropping it (the client went away) drops the request's stream, which
/// cancels it.
pub(crate) struct TypedEvents<M> {
    stream: RequestStream,
    machine: M,
    out: VecDeque<Value>,
}

impl<M: EventMachine> TypedEvents<M> {
    /// `first`: the events that open the answer.
    pub(crate) fn new(stream: RequestStream, machine: M, first: Vec<Value>) -> Self {
        TypedEvents {
            stream,
            machine,
            out: first.into(),
        }
    }
}

impl<M: EventMachine + Unpin> Stream for TypedEvents<M> {
    type Item = Result<SseEvent, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if let Some(v) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(typed_sse(&v))));
            }
            if this.machine.ended() {
                return Poll::Ready(None);
            }
            let evs = match this.stream.poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(ev)) => this.machine.on_event(ev),
                // The engine went away without a last event.
                Poll::Ready(None) => this.machine.fail(ApiError::from_runtime(
                    &siliceo_runtime::RuntimeError::Stopped,
                )),
            };
            this.out.extend(evs);
        }
    }
}

struct Choice {
    stream: RequestStream,
    /// An event read before the response started.
    first: Option<Event>,
    /// The role went out (chat's first chunk carries it).
    announced: bool,
    done: bool,
    /// A chat's thinking split off, tool calls read.
    router: OutputRouter,
    /// Tool calls begun.
    calls: usize,
    /// Tokens generated so far.
    completion_tokens: u32,
    /// Log-probabilities of tokens whose text has not gone out yet.
    pending_lp: Vec<TokenLogprob>,
    /// Text offset of the next token (completions' logprobs).
    offset: usize,
    /// The prompt's text, still to echo before anything else (completions'
    /// `echo`).
    echo: Option<String>,
}

/// The SSE body of a streamed request. Dropping it (the client went away)
/// drops every choice's [`RequestStream`], which cancels them.
pub(crate) struct ChoiceStream {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    choices: Vec<Choice>,
    include_usage: bool,
    /// vLLM's `continuous_usage_stats`: each prompt's tokens.
    continuous_usage: Option<Vec<u32>>,
    /// Choices per prompt.
    n: usize,
    usage: Usage,
    out: VecDeque<SseEvent>,
    /// `[DONE]` (or an error) went out.
    finished: bool,
    /// Round-robin start, so one busy choice cannot starve the others.
    next: usize,
    /// Alternatives per token, when log-probabilities were asked for.
    logprobs: Option<u32>,
    /// vLLM's `prompt_logprobs`: alternatives per prompt token.
    prompt_logprobs: Option<u32>,
}

/// What every chunk of a streamed response repeats, and what it reports.
pub(crate) struct StreamHead {
    pub(crate) kind: Kind,
    pub(crate) id: String,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) include_usage: bool,
    /// vLLM's `continuous_usage_stats`: each prompt's tokens, and usage in
    /// every chunk.
    pub(crate) continuous_usage: Option<Vec<u32>>,
    /// How a chat's output is read.
    pub(crate) parsing: Parsing,
    /// Each prompt's text to echo first (completions' `echo`): choice `i`
    /// echoes prompt `i / n`'s.
    pub(crate) echoes: Vec<String>,
    /// Choices per prompt.
    pub(crate) n: u32,
    /// Alternatives per token when log-probabilities were asked for (the
    /// echoed prompt's go with them).
    pub(crate) logprobs: Option<u32>,
    /// vLLM's `prompt_logprobs`: alternatives per prompt token.
    pub(crate) prompt_logprobs: Option<u32>,
}

impl ChoiceStream {
    pub(crate) fn new(head: StreamHead, choices: Vec<(RequestStream, Option<Event>)>) -> Self {
        let StreamHead {
            kind,
            id,
            created,
            model,
            include_usage,
            continuous_usage,
            parsing,
            echoes,
            n,
            logprobs,
            prompt_logprobs,
        } = head;
        let n = n.max(1) as usize;
        ChoiceStream {
            kind,
            id,
            created,
            model,
            choices: choices
                .into_iter()
                .enumerate()
                .map(|(i, (stream, first))| Choice {
                    stream,
                    first,
                    announced: false,
                    done: false,
                    router: parsing.router(),
                    calls: 0,
                    completion_tokens: 0,
                    pending_lp: Vec::new(),
                    offset: 0,
                    echo: echoes.get(i / n).cloned(),
                })
                .collect(),
            include_usage,
            continuous_usage,
            n,
            usage: Usage::default(),
            out: VecDeque::new(),
            finished: false,
            next: 0,
            logprobs,
            prompt_logprobs,
        }
    }

    fn chunk(&self, choices: Vec<Value>, usage: Option<Value>) -> SseEvent {
        SseEvent::default().data(self.chunk_value(choices, usage).to_string())
    }

    fn chunk_value(&self, choices: Vec<Value>, usage: Option<Value>) -> Value {
        // vLLM's continuous usage: a choice's chunk carries its usage so far.
        let usage = usage.or_else(|| {
            let prompts = self.continuous_usage.as_ref()?;
            let [c] = choices.as_slice() else {
                return None;
            };
            let i = usize::try_from(c["index"].as_u64()?).ok()?;
            let (p, done) = (prompts[i / self.n], self.choices[i].completion_tokens);
            Some(json!({"prompt_tokens": p, "completion_tokens": done, "total_tokens": p + done}))
        });
        let mut v = json!({
            "id": self.id,
            "object": self.kind.chunk_object(),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }

    /// Turns choice `i`'s event into chunks. Returns false when the stream
    /// must end (an engine error went out).
    fn on_event(&mut self, i: usize, ev: Event) -> bool {
        let chat = self.kind == Kind::Chat;
        let announce = chat && !self.choices[i].announced;
        // The echoed prompt goes out first, in a chunk of its own.
        let failed = matches!(ev, Event::Done { error: Some(_), .. });
        let (ev, scores) = match ev {
            Event::Prompt { first, logprobs } => (None, Some((first, logprobs))),
            other => (Some(other), None),
        };
        // vLLM's `prompt_logprobs` ride in the choice's first chunk (chat:
        // the chunk's top level, beside the role).
        let vllm = scores
            .as_ref()
            .zip(self.prompt_logprobs)
            .map(|(p, k)| vllm_prompt_logprobs(p, k as usize));
        let echo = self.choices[i].echo.take().filter(|_| !failed);
        if echo.is_some() || vllm.is_some() {
            let lp = match (&scores, self.logprobs) {
                (Some(p), Some(k)) if echo.is_some() => prompt_logprobs_json(p, k as usize),
                _ => Value::Null,
            };
            let head = echo.unwrap_or_default();
            self.choices[i].offset = head.len();
            let mut c = self.kind.delta(i, Some(&head), announce, None, lp);
            self.choices[i].announced = true;
            let mut e = self.chunk_value(vec![], None);
            if let Some(v) = vllm {
                match self.kind {
                    Kind::Chat => e["prompt_logprobs"] = v,
                    Kind::Completion => c["prompt_logprobs"] = v,
                }
            }
            e["choices"] = json!([c]);
            self.out.push_back(SseEvent::default().data(e.to_string()));
        }
        let Some(ev) = ev else {
            return true;
        };
        match ev {
            Event::Prompt { .. } => true,
            Event::Text {
                text,
                logprobs,
                tokens,
            } => {
                self.choices[i].completion_tokens += tokens.len() as u32;
                self.choices[i].pending_lp.extend(logprobs);
                let r = self.choices[i].router.push(&text, false);
                self.send_reasoning(i, r.reasoning);
                let announce = chat && !self.choices[i].announced;
                if !r.answer.is_empty() || (announce && r.calls.is_empty()) {
                    self.choices[i].announced = true;
                    let lp = self.take_logprobs(i);
                    let c = self.kind.delta(i, Some(&r.answer), announce, None, lp);
                    let e = self.chunk(vec![c], None);
                    self.out.push_back(e);
                }
                self.send_calls(i, r.calls);
                true
            }
            Event::Done {
                finish_reason,
                usage,
                error,
                stop,
            } => {
                self.choices[i].done = true;
                if let Some(err) = error {
                    let body = ApiError::from_runtime(&err).body();
                    self.out
                        .push_back(SseEvent::default().data(body.to_string()));
                    return false;
                }
                // A prompt's choices share it: counted once per prompt.
                if i.is_multiple_of(self.n) {
                    self.usage.prompt_tokens += usage.prompt_tokens;
                    self.usage.cached_prompt_tokens += usage.cached_prompt_tokens;
                }
                self.usage.completion_tokens += usage.completion_tokens;
                let mut finish = finish_name(finish_reason);
                let r = self.choices[i].router.push("", true);
                self.send_reasoning(i, r.reasoning);
                if !r.answer.is_empty() {
                    let announce = chat && !self.choices[i].announced;
                    self.choices[i].announced = true;
                    let c = self
                        .kind
                        .delta(i, Some(&r.answer), announce, None, Value::Null);
                    let e = self.chunk(vec![c], None);
                    self.out.push_back(e);
                }
                self.send_calls(i, r.calls);
                if self.choices[i].calls > 0 && !r.cut {
                    finish = "tool_calls";
                }
                let announce = chat && !self.choices[i].announced;
                self.choices[i].announced = true;
                let lp = self.take_logprobs(i);
                let mut c = self.kind.delta(i, None, announce, Some(finish), lp);
                // vLLM's: the stop string that ended the choice.
                c["stop_reason"] = json!(stop);
                let e = self.chunk(vec![c], None);
                self.out.push_back(e);
                true
            }
        }
    }

    /// Sends choice `i`'s tool calls as OpenAI streams them: a call's
    /// first delta has its id and name, later ones more of its arguments.
    fn send_calls(&mut self, i: usize, calls: Vec<CallPiece>) {
        for piece in calls {
            let k = self.choices[i].calls;
            let call = match piece {
                CallPiece::Call(name) => {
                    self.choices[i].calls += 1;
                    tool_call_json(Some(k), &name, "")
                }
                CallPiece::Args(args) if k > 0 => {
                    json!({"index": k - 1, "function": {"arguments": args}})
                }
                _ => continue,
            };
            let announce = !self.choices[i].announced;
            self.choices[i].announced = true;
            let lp = self.take_logprobs(i);
            let mut c = self.kind.delta(i, None, announce, None, lp);
            c["delta"]["tool_calls"] = json!([call]);
            let e = self.chunk(vec![c], None);
            self.out.push_back(e);
        }
    }

    /// Sends choice `i`'s thinking (a reasoning model's chat) as a
    /// `reasoning_content` delta.
    fn send_reasoning(&mut self, i: usize, reasoning: String) {
        if reasoning.is_empty() {
            return;
        }
        let announce = !self.choices[i].announced;
        self.choices[i].announced = true;
        let lp = self.take_logprobs(i);
        let mut c = self.kind.delta(i, None, announce, None, lp);
        c["delta"]["reasoning_content"] = json!(reasoning);
        let e = self.chunk(vec![c], None);
        self.out.push_back(e);
    }

    /// The pending log-probabilities of choice `i` as the next chunk's
    /// `logprobs` (`null` when none are pending: events only carry them when
    /// the request asked).
    fn take_logprobs(&mut self, i: usize) -> Value {
        let c = &mut self.choices[i];
        if c.pending_lp.is_empty() {
            return Value::Null;
        }
        let lps = std::mem::take(&mut c.pending_lp);
        logprobs_json(self.kind, &lps, &mut c.offset)
    }

    fn finish(&mut self) {
        if self.include_usage {
            let e = self.chunk(Vec::new(), Some(usage_json(&self.usage)));
            self.out.push_back(e);
        }
        self.out.push_back(SseEvent::default().data("[DONE]"));
        self.finished = true;
    }
}

impl Stream for ChoiceStream {
    type Item = Result<SseEvent, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if let Some(e) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(e)));
            }
            if this.finished {
                return Poll::Ready(None);
            }
            if this.choices.iter().all(|c| c.done) {
                this.finish();
                continue;
            }
            let n = this.choices.len();
            let mut progressed = false;
            for k in 0..n {
                let i = (this.next + k) % n;
                if this.choices[i].done {
                    continue;
                }
                let ev = match this.choices[i].first.take() {
                    Some(e) => Some(e),
                    None => match this.choices[i].stream.poll_next(cx) {
                        Poll::Ready(e) => e,
                        Poll::Pending => continue,
                    },
                };
                progressed = true;
                this.next = (i + 1) % n;
                let go_on = match ev {
                    Some(ev) => this.on_event(i, ev),
                    None => {
                        // The engine went away without a last event.
                        let body =
                            ApiError::from_runtime(&siliceo_runtime::RuntimeError::Stopped).body();
                        this.out
                            .push_back(SseEvent::default().data(body.to_string()));
                        false
                    }
                };
                if !go_on {
                    this.finished = true;
                }
                break;
            }
            if !progressed {
                return Poll::Pending;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lp(token: u32, text: &str, logprob: f32) -> TokenLogprob {
        TokenLogprob {
            token: TokenId(token),
            bytes: text.as_bytes().to_vec(),
            logprob,
            rank: 1,
            top: vec![(TokenId(token), text.as_bytes().to_vec(), logprob)],
        }
    }

    /// vLLM's shape: `null` first, then the token's own entry and its
    /// alternatives' by id, with ranks (equal values share one).
    #[test]
    fn vllm_prompt_logprobs_key_entries_by_token_id() {
        let mut second = lp(7, " sky", -2.0);
        second.rank = 3;
        second.top = vec![
            (TokenId(8), b" sea".to_vec(), -0.5),
            (TokenId(9), b" sun".to_vec(), -0.5),
            (TokenId(7), b" sky".to_vec(), -2.0),
        ];
        let scores = ((TokenId(1), b"The".to_vec()), vec![second]);
        assert_eq!(
            vllm_prompt_logprobs(&scores, 2),
            json!([null, {
                "8": {"logprob": -0.5, "rank": 1, "decoded_token": " sea"},
                "9": {"logprob": -0.5, "rank": 1, "decoded_token": " sun"},
                "7": {"logprob": -2.0, "rank": 3, "decoded_token": " sky"},
            }])
        );
        // The echo's view of the same scores keeps its own count.
        let lists = prompt_logprobs_json(&scores, 1);
        assert_eq!(lists["top_logprobs"], json!([null, {" sea": -0.5}]));
    }

    /// A reasoning model's chat answer: its thinking in
    /// `reasoning_content`, tool calls read from the answer alone (a call
    /// the model only thought about is not made).
    #[test]
    fn thinking_is_split_off_before_tool_calls_are_read() {
        let parsing = Parsing {
            tools: Some(ToolSyntax::Hermes),
            one_call: false,
            think: Some(false),
            ..Parsing::default()
        };
        let call = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        let c = Kind::Chat.choice(
            0,
            &format!("<think>Maybe {call}</think>\n\nNo call needed."),
            siliceo_core::FinishReason::Stop,
            &parsing,
            None,
            None,
        );
        assert_eq!(c["message"]["reasoning_content"], format!("Maybe {call}"));
        assert_eq!(c["message"]["content"], "No call needed.");
        assert!(c["message"].get("tool_calls").is_none());
        let c = Kind::Chat.choice(
            0,
            &format!("<think>Call f.</think>\n{call}"),
            siliceo_core::FinishReason::Stop,
            &parsing,
            None,
            None,
        );
        assert_eq!(c["message"]["reasoning_content"], "Call f.");
        assert_eq!(c["message"]["tool_calls"][0]["function"]["name"], "f");
        assert_eq!(c["finish_reason"], "tool_calls");
        // Not a reasoning model: no field.
        let c = Kind::Chat.choice(
            0,
            "hi",
            siliceo_core::FinishReason::Stop,
            &Parsing::default(),
            None,
            None,
        );
        assert!(c["message"].get("reasoning_content").is_none());
    }

    /// An echoed prompt's lists come first: its first token with `null`s,
    /// offsets running on through the completion's tokens.
    #[test]
    fn an_echoed_prompt_leads_the_completions_lists() {
        let first = (TokenId(1), b"The".to_vec());
        let prompt = vec![lp(2, " sky", -2.0)];
        let generated = [lp(3, " is", -0.5)];
        let c = Kind::Completion.choice(
            0,
            " is",
            siliceo_core::FinishReason::Length,
            &Parsing::default(),
            Some(&generated),
            Some(Echoed {
                text: "The sky",
                scores: Some((&(first, prompt), 1)),
            }),
        );
        assert_eq!(c["text"], "The sky is");
        assert_eq!(
            c["logprobs"],
            json!({
                "tokens": ["The", " sky", " is"],
                "token_logprobs": [null, -2.0, -0.5],
                "top_logprobs": [null, {" sky": -2.0}, {" is": -0.5}],
                "text_offset": [0, 3, 7],
            })
        );
    }
}
