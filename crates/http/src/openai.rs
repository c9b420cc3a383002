//! OpenAI's request shapes and their translation into runtime requests.
//!
//! Fields are read leniently where OpenAI's clients send them (`stop` as a
//! string or a list, `content` as a string or text parts), and every value
//! is checked here or by the runtime, which names the field it refuses.
//! Fields this server does not implement yet are refused with 400 naming
//! them, never silently ignored, when they ask for something.

use std::collections::HashMap;

use serde::Deserialize;
use siliceo_core::{Constraint, Priority, SamplingParams, TokenId};
use siliceo_runtime::{
    ChatEnd, GenerateRequest, Input, MAX_TOP_LOGPROBS, Message as ChatMessage, Tool, ToolCall,
    ToolChoice,
};

use crate::error::ApiError;

/// Most choices one request may ask for.
pub const MAX_N: u32 = 16;

/// Most prompts one `/v1/completions` request may batch.
pub const MAX_PROMPTS: usize = 64;

/// A string or a list of strings (`stop`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// One.
    One(String),
    /// Many.
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// `prompt` of `/v1/completions`: text, or token ids (one prompt only).
#[derive(Debug, Clone, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, an array of token ids, or an array holding one of these"
)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// A batch of texts: each is its own request, its choices in turn.
    Texts(Vec<String>),
    /// A batch of token lists, likewise.
    TokenLists(Vec<Vec<u32>>),
}

/// A field that may also be `null`, which means its default (OpenAI's API
/// takes `null` for every optional field, and clients send it).
pub(crate) fn or_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Option::unwrap_or_default)
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage.
    #[serde(default, deserialize_with = "or_default")]
    pub include_usage: bool,
    /// vLLM's: every chunk also carries its choice's usage so far.
    #[serde(default, deserialize_with = "or_default")]
    pub continuous_usage_stats: bool,
}

/// `priority` (an extension): a name or a number (lower is more urgent, as
/// vLLM reads it).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PriorityArg {
    /// `interactive`, `normal` or `batch`.
    Name(String),
    /// < 0 interactive, 0 normal, > 0 batch.
    Number(i64),
}

/// What both endpoints share: sampling, stopping and the extensions.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    /// The model; must be the one served (or absent).
    pub model: Option<String>,
    /// Most tokens to generate.
    pub max_tokens: Option<u32>,
    /// OpenAI's newer name for `max_tokens` (chat).
    pub max_completion_tokens: Option<u32>,
    /// Sampling temperature (OpenAI's default: 1).
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    pub top_p: Option<f32>,
    /// Choices to generate.
    pub n: Option<u32>,
    /// Server-sent events.
    #[serde(default, deserialize_with = "or_default")]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Stop strings.
    pub stop: Option<OneOrMany>,
    /// Sampling seed.
    pub seed: Option<u64>,
    /// OpenAI's presence penalty.
    pub presence_penalty: Option<f32>,
    /// OpenAI's frequency penalty.
    pub frequency_penalty: Option<f32>,
    /// Token id → bias in [−100, 100], added to its logit.
    pub logit_bias: Option<HashMap<String, f32>>,
    /// Extension: top-k.
    pub top_k: Option<i64>,
    /// Extension: min-p.
    pub min_p: Option<f32>,
    /// Extension: repetition penalty.
    pub repetition_penalty: Option<f32>,
    /// Extension: scheduling class.
    pub priority: Option<PriorityArg>,
    /// Extension: keep generating past end-of-sequence.
    #[serde(default, deserialize_with = "or_default")]
    pub ignore_eos: bool,
    /// Extension: the prefix-cache partition (per tenant).
    pub cache_salt: Option<String>,
    /// `text`, `json_object` or `json_schema` (both endpoints).
    pub response_format: Option<serde_json::Value>,
    /// Extension: the output matches this regex (Rust syntax, anchored).
    pub regex: Option<String>,
    /// Extension: the output is derived by this Lark grammar (llguidance's
    /// dialect, `start` the root rule).
    pub grammar: Option<String>,
    /// Extension (vLLM's): generation also stops at these tokens, whose
    /// text is returned (a control token has none).
    pub stop_token_ids: Option<Vec<u32>>,
    /// vLLM's guided decoding, older names: a JSON schema (an object, or
    /// its text).
    pub guided_json: Option<serde_json::Value>,
    /// vLLM's: the output matches this regex.
    pub guided_regex: Option<String>,
    /// vLLM's: the output is one of these texts.
    pub guided_choice: Option<Vec<String>>,
    /// vLLM's: a grammar (Lark, llguidance's dialect, here).
    pub guided_grammar: Option<String>,
    /// vLLM's guided decoding, newer shape: `json`, `regex`, `choice`,
    /// `grammar` or `json_object`.
    pub structured_outputs: Option<StructuredOutputs>,
    /// vLLM's: generate at least this many tokens.
    pub min_tokens: Option<u32>,
    /// vLLM's: the stop string that ended the output is returned with it.
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM's; refused when true (not served).
    pub use_beam_search: Option<bool>,
    /// Extension (vLLM's): each prompt token's log-probability with this
    /// many alternatives, in `prompt_logprobs` (a completion's choice, or a
    /// chat completion's top level).
    pub prompt_logprobs: Option<i64>,
    /// Extension (vLLM's, llama-server's): more variables for the chat
    /// template, such as Qwen3's `enable_thinking`.
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// Refused (deprecated; `tools` serves functions).
    pub functions: Option<serde_json::Value>,
    /// Refused (deprecated; `tool_choice`).
    pub function_call: Option<serde_json::Value>,
    /// `none` switches a reasoning model's thinking off; another level
    /// caps it at that level's thinking budget (`--reasoning-budgets`).
    pub reasoning_effort: Option<String>,
    /// vLLM's: think for at most this many tokens (a reasoning model's
    /// `<think>` block is then closed for it).
    pub thinking_token_budget: Option<u32>,
    /// Only `text` is served.
    pub modalities: Option<Vec<String>>,
    /// Refused: audio output.
    pub audio: Option<serde_json::Value>,
    /// Refused: web search.
    pub web_search_options: Option<serde_json::Value>,
    /// Refused unless `medium`.
    pub verbosity: Option<String>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: Prompt,
    /// Log-probabilities of the tokens and of this many alternatives.
    pub logprobs: Option<u32>,
    /// Echo the prompt back before the completion (with its tokens'
    /// log-probabilities when `logprobs` is set; `max_tokens` 0 then scores
    /// the prompt alone).
    #[serde(default, deserialize_with = "or_default")]
    pub echo: bool,
    /// Text after the completion: the model fills in the middle (a model with
    /// FIM tokens).
    pub suffix: Option<String>,
    /// Choices to generate per prompt, of which the `n` likeliest are
    /// returned (not streamed).
    pub best_of: Option<u32>,
}

/// One part of a message's content.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// `text` (the only kind served).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    pub text: Option<String>,
}

/// A message's content: a string, text parts, or absent.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Text.
    Text(String),
    /// Parts.
    Parts(Vec<ContentPart>),
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    /// `system` (or `developer`, its newer name), `user`, `assistant` or
    /// `tool`.
    pub role: String,
    /// Its content.
    pub content: Option<Content>,
    /// Calls an assistant message made.
    pub tool_calls: Option<Vec<WireToolCall>>,
    /// The call a tool message answers.
    pub tool_call_id: Option<String>,
    /// The tool's name (tool messages).
    pub name: Option<String>,
    /// An assistant's thinking, given back (vLLM's and DeepSeek's
    /// `reasoning_content`; `reasoning` is its newer name).
    #[serde(alias = "reasoning")]
    pub reasoning_content: Option<String>,
}

/// A function in a tool call or a tool definition.
#[derive(Debug, Clone, Deserialize)]
pub struct WireFunction {
    /// Its name.
    pub name: String,
    /// What it does (definitions).
    pub description: Option<String>,
    /// Its arguments' JSON schema (definitions).
    pub parameters: Option<serde_json::Value>,
    /// The arguments as JSON text (calls).
    pub arguments: Option<String>,
}

/// `tools[i]` and `messages[i].tool_calls[j]`.
#[derive(Debug, Clone, Deserialize)]
pub struct WireToolCall {
    /// The call's id (calls).
    pub id: Option<String>,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// The function.
    pub function: WireFunction,
}

/// Tools a chat offers, as the handler resolves them against the model's
/// tool syntax.
#[derive(Debug, Clone)]
pub struct ToolPlan {
    /// `tool_choice`.
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true).
    pub parallel: bool,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<Message>,
    /// Return each token's log-probability.
    #[serde(default, deserialize_with = "or_default")]
    pub logprobs: bool,
    /// And this many most likely alternatives per token.
    pub top_logprobs: Option<u32>,
    /// Functions the model may call.
    pub tools: Option<Vec<WireToolCall>>,
    /// `none`, `auto`, `required` or `{"type": "function", "function": {"name": …}}`.
    pub tool_choice: Option<serde_json::Value>,
    /// Several calls in one answer (default true).
    pub parallel_tool_calls: Option<bool>,
    /// vLLM's: end the chat with the assistant's turn opened [true]; false
    /// renders it closed.
    pub add_generation_prompt: Option<bool>,
    /// vLLM's: continue the final (assistant) message instead of answering
    /// it [false].
    pub continue_final_message: Option<bool>,
}

/// How a chat's rendering ends, from vLLM's two fields: continuing the final
/// message leaves no turn to open, so both true is a 400.
pub(crate) fn chat_end_of(
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
) -> Result<ChatEnd, ApiError> {
    match (add_generation_prompt, continue_final_message) {
        (Some(true), Some(true)) => Err(ApiError::invalid(
            "continue_final_message",
            "continues the final message, so no assistant turn is opened: \
             add_generation_prompt must not be true",
        )),
        (_, Some(true)) => Ok(ChatEnd::Continue),
        (Some(false), _) => Ok(ChatEnd::Closed),
        _ => Ok(ChatEnd::Answer),
    }
}

/// A request translated: what to submit, how many times, and how to answer.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The runtime request (choice 0; further choices change the seed).
    pub request: GenerateRequest,
    /// Choices.
    pub n: u32,
    /// Stream as server-sent events.
    pub stream: bool,
    /// Send a usage chunk last.
    pub include_usage: bool,
    /// vLLM's `continuous_usage_stats`: usage in every chunk.
    pub continuous_usage: bool,
    /// Tools offered (chat; `None` when absent or `tool_choice` is `none`).
    pub tools: Option<ToolPlan>,
    /// Completions' `echo`: each prompt goes back before its choices' text
    /// (one per prompt when set).
    pub echo: Vec<Echo>,
    /// A batch's prompts after the first, which `request` holds
    /// (completions). Choice `i` answers prompt `i / n`.
    pub batch: Vec<Input>,
    /// vLLM's `prompt_logprobs`: alternatives per prompt token to report.
    pub prompt_logprobs: Option<u32>,
    /// Completions' `best_of`: of the `n` choices generated per prompt, the
    /// likeliest are returned.
    pub best_of: Option<BestOf>,
    /// Thinking asked on or off (`reasoning_effort: none`, Anthropic's
    /// `thinking.type`): the template's own switch is set, where it has one.
    pub thinking: Option<bool>,
    /// An effort level other than `none`, and the field it came from: a
    /// thinking budget ([`crate::apply_thinking`]).
    pub effort: Option<(&'static str, String)>,
}

/// What completions' `best_of` returns of the choices it generated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BestOf {
    /// Choices returned per prompt (the request's `n`).
    pub keep: u32,
    /// The client asked for log-probabilities (they are on to rank by).
    pub logprobs: bool,
}

/// The prompt a completion echoes.
#[derive(Debug, Clone, PartialEq)]
pub enum Echo {
    /// A text prompt, echoed as it came.
    Text(String),
    /// Token ids, echoed as their text.
    Tokens(Vec<TokenId>),
}

impl Plan {
    /// The request for choice `i` (of prompt `i / n`): with a seed, a
    /// prompt's choice `j` samples with `seed + j`, so its choices differ
    /// yet repeat.
    pub fn choice(&self, i: u32) -> GenerateRequest {
        let mut r = self.request.clone();
        let (p, j) = ((i / self.n) as usize, i % self.n);
        if p > 0 {
            r.input = self.batch[p - 1].clone();
        }
        if let Some(s) = r.sampling.seed {
            r.sampling.seed = Some(s.wrapping_add(u64::from(j)));
        }
        r
    }

    /// Prompts in the request (a batch's, or one).
    pub fn prompts(&self) -> u32 {
        1 + self.batch.len() as u32
    }

    /// Choices in all: `n` per prompt.
    pub fn choices(&self) -> u32 {
        self.n * self.prompts()
    }
}

/// Checks the model name: absent, or one of `served`.
pub fn check_model(asked: Option<&str>, served: &[String]) -> Result<(), ApiError> {
    match asked {
        None | Some("") => Ok(()),
        Some(m) if served.iter().any(|s| s == m) => Ok(()),
        Some(m) => Err(ApiError::model_not_found(m, &served[0])),
    }
}

/// `scores`: the request may score its prompt without generating
/// (completions' `echo`; `prompt_logprobs` may on either endpoint).
fn plan(common: Common, input: Input, scores: bool) -> Result<Plan, ApiError> {
    refuse_unserved(&common)?;
    let mut logit_bias = Vec::new();
    for (k, &b) in common.logit_bias.iter().flatten() {
        let id: u32 = k
            .parse()
            .map_err(|_| ApiError::invalid("logit_bias", format!("`{k}` is not a token id")))?;
        logit_bias.push((TokenId(id), b));
    }
    let n = common.n.unwrap_or(1);
    if n == 0 || n > MAX_N {
        return Err(ApiError::invalid("n", format!("must be in 1..={MAX_N}")));
    }
    let constraint = constraint_of(&common)?;
    let prompt_logprobs = match common.prompt_logprobs {
        None => None,
        Some(k) => Some(check_top(
            u32::try_from(k).map_err(|_| {
                ApiError::invalid(
                    "prompt_logprobs",
                    "must be 0 or more (all alternatives, -1, is not supported)",
                )
            })?,
            "prompt_logprobs",
        )?),
    };
    let d = SamplingParams::greedy();
    // Without max_tokens, generate until the model stops or the context
    // ends, as OpenAI and vLLM do (the runtime cuts it to what is left).
    // The field the client set, if any, names the refusals.
    let (max_tokens, max_tokens_field) = match (common.max_completion_tokens, common.max_tokens) {
        (Some(m), _) => (m, Some("max_completion_tokens")),
        (None, Some(m)) => (m, Some("max_tokens")),
        (None, None) => (u32::MAX, None),
    };
    if let (0, Some(field)) = (max_tokens, max_tokens_field)
        && !scores
        && prompt_logprobs.is_none()
    {
        return Err(ApiError::invalid(
            field,
            "must be at least 1 (0 only with `echo` or `prompt_logprobs`, which then score \
             the prompt alone)",
        ));
    }
    let top_k = match common.top_k {
        None | Some(-1) => d.top_k,
        Some(k) => u32::try_from(k)
            .map_err(|_| ApiError::invalid("top_k", "must be -1 (off), 0 (off) or positive"))?,
    };
    let priority = match common.priority {
        None => Priority::Normal,
        Some(PriorityArg::Number(p)) => match p {
            ..0 => Priority::Interactive,
            0 => Priority::Normal,
            _ => Priority::Batch,
        },
        Some(PriorityArg::Name(name)) => Priority::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| {
                ApiError::invalid("priority", "must be interactive, normal, batch or a number")
            })?,
    };
    // OpenAI's range (the runtime allows more).
    if let Some(t) = common.temperature
        && !(0.0..=2.0).contains(&t)
    {
        return Err(ApiError::invalid(
            "temperature",
            format!("must be in [0, 2], got {t}"),
        ));
    }
    let sampling = SamplingParams {
        // OpenAI samples at temperature 1 unless told otherwise.
        temperature: common.temperature.unwrap_or(1.0),
        top_k,
        top_p: common.top_p.unwrap_or(1.0),
        min_p: common.min_p.unwrap_or(d.min_p),
        seed: common.seed,
        repetition_penalty: common.repetition_penalty.unwrap_or(d.repetition_penalty),
        presence_penalty: common.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: common.frequency_penalty.unwrap_or(d.frequency_penalty),
        penalty_last_n: d.penalty_last_n,
        max_tokens,
        stop: common.stop.map(OneOrMany::into_vec).unwrap_or_default(),
        stop_token_ids: common
            .stop_token_ids
            .iter()
            .flatten()
            .map(|&t| TokenId(t))
            .collect(),
        ignore_eos: common.ignore_eos,
        logit_bias,
    };
    let mut request = GenerateRequest::new(input);
    if let Some((field, c)) = constraint {
        request.constraint = Some(c);
        request.constraint_field = field;
    }
    request.sampling = sampling;
    // A max_tokens the client set must fit beside the prompt.
    request.max_tokens_field = max_tokens_field;
    request.priority = priority;
    request.cache_salt = common.cache_salt.filter(|s| !s.is_empty());
    request.prompt_logprobs = prompt_logprobs;
    request.chat_template_kwargs = common.chat_template_kwargs.unwrap_or_default();
    request.include_stop_str = common.include_stop_str_in_output == Some(true);
    request.min_tokens = common.min_tokens.unwrap_or(0);
    request.thinking_budget = common.thinking_token_budget;
    let effort = common.reasoning_effort.as_deref();
    Ok(Plan {
        request,
        n,
        stream: common.stream,
        include_usage: common
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
        continuous_usage: common
            .stream_options
            .as_ref()
            .is_some_and(|o| o.continuous_usage_stats),
        tools: None,
        echo: Vec::new(),
        batch: Vec::new(),
        prompt_logprobs,
        best_of: None,
        thinking: (effort == Some("none")).then_some(false),
        effort: effort
            .filter(|e| *e != "none")
            .map(|e| ("reasoning_effort", e.to_string())),
    })
}

/// OpenAI's fields that ask for what this server cannot do: a 400 naming
/// each, never silently ignored. (`store`, `metadata`, `user`,
/// `service_tier` and `prediction` change nothing in an answer and are
/// accepted.)
fn refuse_unserved(c: &Common) -> Result<(), ApiError> {
    if c.functions.is_some() {
        return Err(ApiError::unsupported(
            "functions",
            "the deprecated `functions` (send them as `tools`)",
        ));
    }
    if c.function_call.is_some() {
        return Err(ApiError::unsupported(
            "function_call",
            "the deprecated `function_call` (use `tool_choice`)",
        ));
    }
    if let Some(m) = c.modalities.iter().flatten().find(|m| *m != "text") {
        return Err(ApiError::unsupported(
            "modalities",
            &format!("the `{m}` modality (text only)"),
        ));
    }
    if c.audio.is_some() {
        return Err(ApiError::unsupported("audio", "audio output"));
    }
    if c.web_search_options.is_some() {
        return Err(ApiError::unsupported("web_search_options", "web search"));
    }
    if let Some(v) = c.verbosity.as_deref().filter(|v| *v != "medium") {
        return Err(ApiError::unsupported(
            "verbosity",
            &format!("verbosity `{v}`"),
        ));
    }
    // vLLM's sampling extensions that are not served.
    if c.use_beam_search == Some(true) {
        return Err(ApiError::unsupported("use_beam_search", "beam search"));
    }
    Ok(())
}

/// vLLM's `structured_outputs` (one of its fields).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StructuredOutputs {
    /// A JSON schema (an object, or its text).
    pub json: Option<serde_json::Value>,
    /// A regex the output matches.
    pub regex: Option<String>,
    /// Texts the output is one of.
    pub choice: Option<Vec<String>>,
    /// A grammar (Lark, llguidance's dialect).
    pub grammar: Option<String>,
    /// Any JSON object.
    #[serde(default, deserialize_with = "or_default")]
    pub json_object: bool,
}

/// A JSON schema given as an object or as its text (vLLM takes both).
fn schema_of(field: &'static str, v: &serde_json::Value) -> Result<Constraint, ApiError> {
    let schema = match v {
        serde_json::Value::String(text) => text.clone(),
        serde_json::Value::Object(_) | serde_json::Value::Bool(_) => v.to_string(),
        _ => return Err(ApiError::invalid(field, "must be a JSON schema")),
    };
    Ok(Constraint::JsonSchema {
        schema,
        strict: false,
    })
}

/// A grammar whose language is exactly `choices` (vLLM's `guided_choice`).
fn choice_of(field: &'static str, choices: &[String]) -> Result<Constraint, ApiError> {
    if choices.is_empty() {
        return Err(ApiError::invalid(field, "at least one choice is required"));
    }
    // Lark string literals take JSON's escapes.
    let alts: Vec<String> = choices
        .iter()
        .map(|c| serde_json::Value::String(c.clone()).to_string())
        .collect();
    Ok(Constraint::Lark(format!("start: {}\n", alts.join(" | "))))
}

impl Common {
    /// Whether any of the fields that constrain the output is set
    /// (`response_format`, `regex`, `grammar`, vLLM's guided decoding).
    fn asks_constraint(&self) -> bool {
        self.response_format.is_some()
            || self.regex.is_some()
            || self.grammar.is_some()
            || self.guided_json.is_some()
            || self.guided_regex.is_some()
            || self.guided_choice.is_some()
            || self.guided_grammar.is_some()
            || self.structured_outputs.is_some()
    }
}

/// vLLM's guided-decoding fields as constraints, each with its field.
fn guided_of(common: &Common) -> Result<Vec<(&'static str, Constraint)>, ApiError> {
    let mut found = Vec::new();
    if let Some(v) = &common.guided_json {
        found.push(("guided_json", schema_of("guided_json", v)?));
    }
    if let Some(rx) = &common.guided_regex {
        found.push(("guided_regex", Constraint::Regex(rx.clone())));
    }
    if let Some(c) = &common.guided_choice {
        found.push(("guided_choice", choice_of("guided_choice", c)?));
    }
    if let Some(g) = &common.guided_grammar {
        found.push(("guided_grammar", Constraint::Lark(g.clone())));
    }
    if let Some(so) = &common.structured_outputs {
        if let Some(v) = &so.json {
            let field = "structured_outputs.json";
            found.push((field, schema_of(field, v)?));
        }
        if let Some(rx) = &so.regex {
            found.push(("structured_outputs.regex", Constraint::Regex(rx.clone())));
        }
        if let Some(c) = &so.choice {
            let field = "structured_outputs.choice";
            found.push((field, choice_of(field, c)?));
        }
        if let Some(g) = &so.grammar {
            found.push(("structured_outputs.grammar", Constraint::Lark(g.clone())));
        }
        if so.json_object {
            found.push(("structured_outputs.json_object", Constraint::JsonObject));
        }
    }
    Ok(found)
}

/// The constraint a request asks for (`response_format`, the `regex` and
/// `grammar` extensions, or vLLM's guided decoding; at most one) and the
/// field it came from.
fn constraint_of(common: &Common) -> Result<Option<(&'static str, Constraint)>, ApiError> {
    let mut found: Vec<(&'static str, Constraint)> = guided_of(common)?;
    if let Some(f) = &common.response_format {
        let kind = f.get("type").and_then(|t| t.as_str());
        match kind {
            Some("text") => {}
            Some("json_object") => found.push(("response_format", Constraint::JsonObject)),
            Some("json_schema") => {
                let spec = f.get("json_schema").ok_or_else(|| {
                    ApiError::invalid(
                        "response_format.json_schema",
                        "required when type is `json_schema`",
                    )
                })?;
                let schema = spec.get("schema").ok_or_else(|| {
                    ApiError::invalid(
                        "response_format.json_schema.schema",
                        "the JSON schema is required",
                    )
                })?;
                let strict = match spec.get("strict") {
                    None | Some(serde_json::Value::Null) => false,
                    Some(serde_json::Value::Bool(b)) => *b,
                    Some(_) => {
                        return Err(ApiError::invalid(
                            "response_format.json_schema.strict",
                            "must be a boolean",
                        ));
                    }
                };
                found.push((
                    "response_format.json_schema.schema",
                    Constraint::JsonSchema {
                        schema: schema.to_string(),
                        strict,
                    },
                ));
            }
            _ => {
                return Err(ApiError::invalid(
                    "response_format.type",
                    "must be `text`, `json_object` or `json_schema`",
                ));
            }
        }
    }
    if let Some(rx) = &common.regex {
        found.push(("regex", Constraint::Regex(rx.clone())));
    }
    if let Some(g) = &common.grammar {
        found.push(("grammar", Constraint::Lark(g.clone())));
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(f, _)| *f).collect();
        return Err(ApiError::invalid(
            found[1].0,
            format!(
                "only one constraint per request (got {})",
                names.join(" and ")
            ),
        ));
    }
    Ok(found.pop())
}

/// Translates `/v1/completions` (`common`: the same body's shared fields).
pub fn completion_plan(r: CompletionRequest, common: Common) -> Result<Plan, ApiError> {
    let logprobs = r.logprobs.map(|k| check_top(k, "logprobs")).transpose()?;
    let inputs: Vec<Input> = match r.prompt {
        Prompt::Text(t) => vec![Input::Prompt(t)],
        Prompt::Tokens(ids) => vec![Input::Tokens(ids.into_iter().map(TokenId).collect())],
        Prompt::Texts(v) => v.into_iter().map(Input::Prompt).collect(),
        Prompt::TokenLists(v) => v
            .into_iter()
            .map(|ids| Input::Tokens(ids.into_iter().map(TokenId).collect()))
            .collect(),
    };
    if inputs.is_empty() || inputs.len() > MAX_PROMPTS {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "a batch of {} prompts; give 1 to {MAX_PROMPTS}",
                inputs.len()
            ),
        ));
    }
    let suffix = r.suffix.filter(|s| !s.is_empty());
    if r.echo && suffix.is_some() {
        return Err(ApiError::invalid(
            "echo",
            "cannot be combined with `suffix` (fill in the middle)",
        ));
    }
    if inputs.len() > 1 && suffix.is_some() {
        return Err(ApiError::invalid(
            "suffix",
            "fills in the middle of one prompt, not a batch",
        ));
    }
    let echo: Vec<Echo> = if r.echo {
        inputs
            .iter()
            .map(|input| match input {
                Input::Tokens(ids) => Echo::Tokens(ids.clone()),
                Input::Prompt(t) => Echo::Text(t.clone()),
                _ => unreachable!("a completion prompt is text or tokens"),
            })
            .collect()
    } else {
        Vec::new()
    };
    let mut inputs = inputs.into_iter();
    let input = inputs.next().expect("a batch holds a prompt");
    let rest: Vec<Input> = inputs.collect();
    // Fill in the middle: the model writes what goes between the two.
    let input = match (input, suffix) {
        (input, None) => input,
        (Input::Prompt(prefix), Some(suffix)) => Input::Infill { prefix, suffix },
        (_, Some(_)) => return Err(ApiError::invalid("suffix", "needs a text prompt")),
    };
    let mut plan = plan(common, input, !echo.is_empty())?;
    plan.batch = rest;
    plan.request.logprobs = logprobs;
    if !echo.is_empty() {
        // The echoed prompt's tokens carry log-probabilities too; a request
        // that generates nothing is scored to have something to answer.
        let scores_only = plan.request.sampling.max_tokens == 0;
        let echoed = logprobs.or(scores_only.then_some(0));
        // Both views come from one scoring, with the more alternatives.
        plan.request.prompt_logprobs = plan.request.prompt_logprobs.max(echoed);
    }
    plan.echo = echo;
    if let Some(b) = r.best_of.filter(|&b| b > 1) {
        if b < plan.n || b > MAX_N {
            return Err(ApiError::invalid(
                "best_of",
                format!("must be in n..={MAX_N} (n is {})", plan.n),
            ));
        }
        if plan.stream {
            return Err(ApiError::invalid(
                "best_of",
                "the best of several choices is known at their end: it cannot be streamed",
            ));
        }
        plan.best_of = Some(BestOf {
            keep: plan.n,
            logprobs: plan.request.logprobs.is_some(),
        });
        plan.n = b;
        // Ranked by their tokens' log-probabilities.
        plan.request.logprobs.get_or_insert(0);
    }
    Ok(plan)
}

/// Completions' `best_of`: each prompt's `keep` likeliest choices of the `n`
/// generated (the highest mean log-probability per token, the earlier
/// first on ties), numbered anew; their log-probabilities dropped unless
/// asked for. `scores[i]`: choice `i`'s mean log-probability.
pub(crate) fn keep_best(
    choices: Vec<serde_json::Value>,
    scores: &[f64],
    n: usize,
    b: BestOf,
) -> Vec<serde_json::Value> {
    let keep = b.keep as usize;
    let mut out = Vec::with_capacity(choices.len() / n.max(1) * keep);
    for (p, group) in choices.chunks(n.max(1)).enumerate() {
        let score = |j: usize| scores[p * n + j];
        let mut order: Vec<usize> = (0..group.len()).collect();
        order.sort_by(|&a, &c| score(c).total_cmp(&score(a)).then(a.cmp(&c)));
        for (j, &k) in order.iter().take(keep).enumerate() {
            let mut c = group[k].clone();
            c["index"] = serde_json::json!(p * keep + j);
            if !b.logprobs {
                c["logprobs"] = serde_json::Value::Null;
            }
            out.push(c);
        }
    }
    out
}

/// Alternatives per token: at most [`MAX_TOP_LOGPROBS`].
pub(crate) fn check_top(k: u32, field: &'static str) -> Result<u32, ApiError> {
    if k > MAX_TOP_LOGPROBS {
        return Err(ApiError::invalid(
            field,
            format!("at most {MAX_TOP_LOGPROBS} alternatives per token"),
        ));
    }
    Ok(k)
}

/// Translates `/v1/chat/completions` (`common`: the same body's shared fields).
pub fn chat_plan(r: ChatRequest, common: Common) -> Result<Plan, ApiError> {
    let logprobs = match (r.logprobs, r.top_logprobs) {
        (false, Some(k)) if k > 0 => {
            return Err(ApiError::invalid("top_logprobs", "needs `logprobs: true`"));
        }
        (false, _) => None,
        (true, k) => Some(check_top(k.unwrap_or(0), "top_logprobs")?),
    };
    if r.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "at least one message is required",
        ));
    }
    let tools = tools_of(r.tools.unwrap_or_default())?;
    let choice = tool_choice_of(r.tool_choice.as_ref(), &tools)?;
    let msgs = messages_of(r.messages)?;
    let parallel = r.parallel_tool_calls.unwrap_or(true);
    let end = chat_end_of(r.add_generation_prompt, r.continue_final_message)?;
    let mut plan = conversation_plan(msgs, (tools, choice, parallel), logprobs, common)?;
    plan.request.chat_end = end;
    Ok(plan)
}

/// A chat's plan once its messages and tools are read (chat completions and
/// the Responses API): `tools` with their choice and whether calls may be
/// parallel.
pub(crate) fn conversation_plan(
    msgs: Vec<ChatMessage>,
    (tools, choice, parallel): (Vec<Tool>, ToolChoice, bool),
    logprobs: Option<u32>,
    common: Common,
) -> Result<Plan, ApiError> {
    let forced = matches!(choice, ToolChoice::Required | ToolChoice::Function(_));
    if forced && common.asks_constraint() {
        return Err(ApiError::invalid(
            "tool_choice",
            "a forced tool call cannot be combined with response_format, regex or grammar",
        ));
    }
    let mut plan = plan(common, Input::Chat(msgs), false)?;
    plan.request.logprobs = logprobs;
    if !tools.is_empty() && choice != ToolChoice::None {
        plan.request.tools = tools;
        plan.tools = Some(ToolPlan { choice, parallel });
    }
    Ok(plan)
}

/// `POST /tokenize`: vLLM's shape (`prompt` or `messages`), with
/// llama-server's `content` taken for `prompt`.
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    /// The model (checked like a completion's).
    pub model: Option<String>,
    /// Text to tokenize.
    #[serde(alias = "content")]
    pub prompt: Option<String>,
    /// A chat, rendered as a chat completion renders it.
    pub messages: Option<Vec<Message>>,
    /// Tools, rendered into the chat.
    pub tools: Option<Vec<WireToolCall>>,
    /// Add the model's special tokens (BOS) to `prompt` [true].
    pub add_special_tokens: Option<bool>,
    /// End the chat with the assistant's turn opened [true].
    pub add_generation_prompt: Option<bool>,
    /// Continue the final (assistant) message [false].
    pub continue_final_message: Option<bool>,
    /// Also return each token's text.
    #[serde(default, deserialize_with = "or_default")]
    pub return_token_strs: bool,
    /// More variables for the chat template, as a chat completion takes them.
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
}

/// What `/tokenize` asks the runtime: the request whose prompt tokens it
/// answers (a chat with its tools and template arguments), and whether a
/// prompt gets special tokens.
pub fn tokenize_input(r: TokenizeRequest) -> Result<(GenerateRequest, bool), ApiError> {
    let end = chat_end_of(r.add_generation_prompt, r.continue_final_message)?;
    let tools = tools_of(r.tools.unwrap_or_default())?;
    let kwargs = r.chat_template_kwargs.unwrap_or_default();
    let (input, special) = match (r.prompt, r.messages) {
        (Some(p), None) => {
            if !tools.is_empty() {
                return Err(ApiError::invalid("tools", "tools need messages"));
            }
            if !kwargs.is_empty() {
                return Err(ApiError::invalid(
                    "chat_template_kwargs",
                    "template arguments apply to messages",
                ));
            }
            (Input::Prompt(p), r.add_special_tokens.unwrap_or(true))
        }
        (None, Some(m)) => {
            if r.add_special_tokens.is_some() {
                return Err(ApiError::invalid(
                    "add_special_tokens",
                    "applies to a prompt; a chat's template places its special tokens",
                ));
            }
            if m.is_empty() {
                return Err(ApiError::invalid(
                    "messages",
                    "at least one message is required",
                ));
            }
            (Input::Chat(messages_of(m)?), true)
        }
        _ => {
            return Err(ApiError::invalid(
                "prompt",
                "give either `prompt` or `messages`",
            ));
        }
    };
    if end != ChatEnd::Answer && !matches!(input, Input::Chat(_)) {
        return Err(ApiError::invalid(
            "add_generation_prompt",
            "add_generation_prompt and continue_final_message apply to messages",
        ));
    }
    let mut req = GenerateRequest::new(input);
    req.tools = tools;
    req.chat_template_kwargs = kwargs;
    req.chat_end = end;
    Ok((req, special))
}

/// `messages` as the runtime takes them: text parts joined, tool calls'
/// arguments checked, each message [`checked`](ChatMessage::checked).
fn messages_of(messages: Vec<Message>) -> Result<Vec<ChatMessage>, ApiError> {
    let mut msgs = Vec::with_capacity(messages.len());
    for (i, m) in messages.into_iter().enumerate() {
        let content = match m.content {
            None => None,
            Some(Content::Text(t)) => Some(t),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for (j, p) in parts.into_iter().enumerate() {
                    if p.kind != "text" {
                        return Err(ApiError::unsupported(
                            &format!("messages[{i}].content[{j}].type"),
                            &format!("content of type `{}`", p.kind),
                        ));
                    }
                    text.push_str(p.text.as_deref().unwrap_or_default());
                }
                Some(text)
            }
        };
        let mut calls = Vec::new();
        for (j, c) in m.tool_calls.unwrap_or_default().into_iter().enumerate() {
            let args = c.function.arguments.unwrap_or_else(|| "{}".into());
            if serde_json::from_str::<serde_json::Value>(&args).is_err() {
                return Err(ApiError::invalid(
                    format!("messages[{i}].tool_calls[{j}].function.arguments"),
                    "must be JSON text",
                ));
            }
            calls.push(ToolCall {
                id: c.id.unwrap_or_else(|| format!("call_{i}_{j}")),
                name: c.function.name,
                arguments: args,
            });
        }
        let msg = ChatMessage {
            role: m.role,
            content,
            tool_calls: calls,
            tool_call_id: m.tool_call_id,
            name: m.name,
            reasoning: m.reasoning_content.filter(|r| !r.is_empty()),
        };
        msgs.push(
            msg.checked()
                .map_err(|(field, why)| ApiError::invalid(format!("messages[{i}].{field}"), why))?,
        );
    }
    Ok(msgs)
}

/// A flat tool (`{name, description, <schema>}`, as the Responses and
/// Messages APIs give one) in chat completions' nested shape, for
/// [`tools_of`].
pub(crate) fn nested_tool(
    name: String,
    description: Option<String>,
    parameters: Option<serde_json::Value>,
) -> WireToolCall {
    WireToolCall {
        id: None,
        kind: Some("function".into()),
        function: WireFunction {
            name,
            description,
            parameters,
            arguments: None,
        },
    }
}

/// [`tools_of`]'s complaint about a [`nested_tool`], in the flat shape's
/// terms: `tools[i].function.parameters` becomes `tools[i].<schema>`, any
/// other `tools[i].function.x` becomes `tools[i].x`.
pub(crate) fn flat_tool_error(mut e: ApiError, schema: &str) -> ApiError {
    let Some(p) = e.param.clone().filter(|p| p.starts_with("tools[")) else {
        return e;
    };
    let to = p
        .replacen("].function.parameters", &format!("].{schema}"), 1)
        .replacen("].function.", "].", 1);
    e.message = e.message.replacen(&p, &to, 1);
    e.param = Some(to);
    e
}

/// The name of the function the call `id` (made earlier in `history`)
/// called: a tool's answer names it for the template.
pub(crate) fn called<'a>(
    history: impl IntoIterator<Item = &'a ChatMessage>,
    id: &str,
) -> Option<String> {
    history
        .into_iter()
        .flat_map(|m| &m.tool_calls)
        .find(|c| c.id == id)
        .map(|c| c.name.clone())
}

/// `tools`: functions with a name and an object schema.
pub(crate) fn tools_of(wire: Vec<WireToolCall>) -> Result<Vec<Tool>, ApiError> {
    if let Some(i) = wire
        .iter()
        .position(|t| t.kind.as_deref().is_some_and(|k| k != "function"))
    {
        return Err(ApiError::invalid(
            format!("tools[{i}].type"),
            "only `function` tools are served",
        ));
    }
    let tools = wire.into_iter().map(|t| {
        (
            t.function.name,
            t.function.description,
            t.function.parameters,
        )
    });
    siliceo_runtime::checked_tools(tools)
        .map_err(|(i, field, why)| ApiError::invalid(format!("tools[{i}].function.{field}"), why))
}

/// `tool_choice` (default `auto` with tools, `none` without).
pub(crate) fn tool_choice_of(
    v: Option<&serde_json::Value>,
    tools: &[Tool],
) -> Result<ToolChoice, ApiError> {
    let bad = || {
        ApiError::invalid(
            "tool_choice",
            "must be `none`, `auto`, `required` or {\"type\": \"function\", \"function\": {\"name\": …}}",
        )
    };
    let choice = match v {
        None | Some(serde_json::Value::Null) => {
            if tools.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            }
        }
        Some(serde_json::Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => return Err(bad()),
        },
        Some(o) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(|n| n.as_str())
                .ok_or_else(bad)?;
            ToolChoice::Function(name.to_string())
        }
    };
    choice
        .check(tools)
        .map_err(|why| ApiError::invalid("tool_choice", why))?;
    Ok(choice)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(json: serde_json::Value) -> Result<Plan, ApiError> {
        chat_plan(
            serde_json::from_value(json.clone()).unwrap(),
            serde_json::from_value(json).unwrap(),
        )
    }

    #[test]
    fn openai_defaults_and_aliases() {
        let p = chat(serde_json::json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 7, "stop": "\n", "stream": true,
            "stream_options": {"include_usage": true}, "seed": 5, "n": 2
        }))
        .unwrap();
        assert_eq!(p.request.sampling.max_tokens, 7);
        assert_eq!(p.request.sampling.temperature, 1.0);
        assert_eq!(p.request.sampling.stop, vec!["\n".to_string()]);
        assert!(p.stream && p.include_usage);
        assert_eq!(p.choice(1).sampling.seed, Some(6));
    }

    #[test]
    fn null_is_the_default_of_every_optional_field() {
        let mut body = serde_json::json!({"messages": [{"role": "user", "content": "hi"}]});
        let nulls = [
            "model",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "n",
            "stop",
            "seed",
            "stream",
            "stream_options",
            "logprobs",
            "top_logprobs",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "user",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "response_format",
            "ignore_eos",
            "top_k",
            "min_p",
            "priority",
            "prompt_logprobs",
        ];
        for k in nulls {
            body[k] = serde_json::Value::Null;
        }
        let p = chat(body).unwrap();
        assert!(!p.stream && !p.include_usage);
        assert_eq!(p.request.sampling.temperature, 1.0);
        let body = serde_json::json!({"prompt": "a", "stream": true,
            "stream_options": {"include_usage": null}, "echo": null, "logprobs": null});
        let p = completion_plan(
            serde_json::from_value(body.clone()).unwrap(),
            serde_json::from_value(body).unwrap(),
        )
        .unwrap();
        assert!(p.stream && !p.include_usage);
    }

    #[test]
    fn developer_is_system_and_content_is_required() {
        let p = chat(serde_json::json!({"messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ]},
        ]}))
        .unwrap();
        let Input::Chat(msgs) = &p.request.input else {
            panic!("not a chat: {:?}", p.request.input)
        };
        let roles: Vec<&str> = msgs.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant"]);
        assert_eq!(msgs[1].content.as_deref(), Some("hi"));
        let e = chat(serde_json::json!({"messages": [{"role": "user", "content": null}]}));
        assert_eq!(e.unwrap_err().param.as_deref(), Some("messages[0].content"));
        let e = chat(serde_json::json!({"messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": null}
        ]}));
        assert_eq!(e.unwrap_err().param.as_deref(), Some("messages[1].content"));
    }

    fn completion(body: serde_json::Value) -> Result<Plan, ApiError> {
        completion_plan(
            serde_json::from_value(body.clone()).unwrap(),
            serde_json::from_value(body).unwrap(),
        )
    }

    /// A batch's prompt `p` answers choices `p * n .. (p + 1) * n`, each
    /// prompt's choices seeded `seed + j`.
    #[test]
    fn a_batch_of_prompts_is_n_choices_per_prompt() {
        let p = completion(serde_json::json!({
            "prompt": [[1, 2], [3], [4, 5, 6]], "n": 2, "seed": 10, "echo": true,
        }))
        .unwrap();
        assert_eq!(p.choices(), 6);
        let ids = |i| match p.choice(i).input {
            Input::Tokens(t) => t.iter().map(|t| t.0).collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            (0..6).map(ids).collect::<Vec<_>>(),
            [
                vec![1, 2],
                vec![1, 2],
                vec![3],
                vec![3],
                vec![4, 5, 6],
                vec![4, 5, 6]
            ]
        );
        let seeds: Vec<_> = (0..6).map(|i| p.choice(i).sampling.seed.unwrap()).collect();
        assert_eq!(seeds, [10, 11, 10, 11, 10, 11]);
        assert_eq!(p.echo.len(), 3);
        assert_eq!(
            p.echo[2],
            Echo::Tokens(vec![TokenId(4), TokenId(5), TokenId(6)])
        );
        let one = completion(serde_json::json!({"prompt": ["only"]})).unwrap();
        assert_eq!(one.choices(), 1);
        assert!(matches!(one.request.input, Input::Prompt(ref t) if t == "only"));
    }

    #[test]
    fn echo_scores_the_prompt_when_its_logprobs_or_nothing_else_is_wanted() {
        // lm-eval's loglikelihood request: token ids, one token, logprobs 1.
        let p = completion(serde_json::json!({
            "prompt": [[5, 6, 7]], "echo": true, "max_tokens": 1, "logprobs": 1
        }))
        .unwrap();
        assert_eq!(
            p.echo,
            [Echo::Tokens(vec![TokenId(5), TokenId(6), TokenId(7)])]
        );
        assert_eq!(
            (p.request.logprobs, p.request.prompt_logprobs),
            (Some(1), Some(1))
        );
        // Scored alone: nothing generated, the scores only carry the echo.
        let p = completion(serde_json::json!({"prompt": "a b", "echo": true, "max_tokens": 0}))
            .unwrap();
        assert_eq!(p.echo, [Echo::Text("a b".into())]);
        assert_eq!(p.request.sampling.max_tokens, 0);
        assert_eq!(
            (p.request.logprobs, p.request.prompt_logprobs),
            (None, Some(0))
        );
        // An echo without log-probabilities keeps the prefix cache.
        let p =
            completion(serde_json::json!({"prompt": "a", "echo": true, "max_tokens": 2})).unwrap();
        assert_eq!(p.request.prompt_logprobs, None);
        let p = completion(serde_json::json!({"prompt": "a", "max_tokens": 2})).unwrap();
        assert_eq!((p.echo, p.request.prompt_logprobs), (vec![], None));
        // Generating nothing needs an echo; an echo cannot fill a middle.
        let e = completion(serde_json::json!({"prompt": "a", "max_tokens": 0})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = completion(serde_json::json!({"prompt": "a", "suffix": "b", "echo": true}))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("echo"));
        // vLLM's prompt_logprobs, alone (it may score without generating)
        // and beside an echo: one scoring with the larger count.
        let p =
            completion(serde_json::json!({"prompt": "a", "max_tokens": 0, "prompt_logprobs": 2}))
                .unwrap();
        assert_eq!(
            (p.prompt_logprobs, p.request.prompt_logprobs),
            (Some(2), Some(2))
        );
        let p = completion(serde_json::json!({
            "prompt": "a", "echo": true, "logprobs": 5, "prompt_logprobs": 1
        }))
        .unwrap();
        assert_eq!(
            (p.prompt_logprobs, p.request.prompt_logprobs),
            (Some(1), Some(5))
        );
        let p = chat(serde_json::json!({
            "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0
        }))
        .unwrap();
        assert_eq!(p.request.prompt_logprobs, Some(0));
        for k in [-1, 21] {
            let e =
                completion(serde_json::json!({"prompt": "a", "prompt_logprobs": k})).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("prompt_logprobs"));
        }
    }

    #[test]
    fn unsupported_and_bad_fields_are_named() {
        let e = chat(serde_json::json!({
            "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3
        }))
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        let e = chat(serde_json::json!({
            "messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21
        }))
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        let e = chat(serde_json::json!({
            "messages": [{"role": "robot", "content": "hi"}]
        }))
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = chat(serde_json::json!({
            "messages": [{"role": "user", "content": "hi"}], "n": 0
        }))
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
        // Over the batch limit. (`[]` is one prompt of no tokens, which the
        // runtime refuses.)
        let body = serde_json::json!({"prompt": vec!["a"; MAX_PROMPTS + 1]});
        let e = completion_plan(
            serde_json::from_value(body.clone()).unwrap(),
            serde_json::from_value(body).unwrap(),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let body = serde_json::json!({"prompt": ["a", "b"], "suffix": "c"});
        let e = completion_plan(
            serde_json::from_value(body.clone()).unwrap(),
            serde_json::from_value(body).unwrap(),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("suffix"));
        // Fields asking for what cannot be served are named.
        for (field, value) in [
            ("functions", serde_json::json!([{"name": "f"}])),
            ("function_call", serde_json::json!("auto")),
            ("modalities", serde_json::json!(["text", "audio"])),
            ("audio", serde_json::json!({"voice": "alloy"})),
            ("web_search_options", serde_json::json!({})),
            ("verbosity", serde_json::json!("low")),
        ] {
            let mut body = serde_json::json!({"messages": [{"role": "user", "content": "hi"}]});
            body[field] = value;
            let e = chat(body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field));
            assert_eq!(e.code, Some("unsupported_parameter"));
        }
        // Their harmless settings, and what changes nothing, are taken.
        chat(serde_json::json!({
            "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "none",
            "modalities": ["text"], "verbosity": "medium", "functions": null, "store": true,
            "metadata": {"a": "b"}, "user": "u", "service_tier": "auto",
            "prediction": {"type": "content", "content": "x"},
        }))
        .unwrap();
        // An effort level is left for the server's budgets; `none` is off.
        let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
        let p = chat(serde_json::json!({"messages": msgs, "reasoning_effort": "high"})).unwrap();
        assert_eq!(p.effort, Some(("reasoning_effort", "high".to_string())));
        assert_eq!(p.thinking, None);
        let p = chat(
            serde_json::json!({"messages": msgs, "reasoning_effort": "none",
                                        "thinking_token_budget": 9}),
        )
        .unwrap();
        assert_eq!((p.effort, p.thinking), (None, Some(false)));
        assert_eq!(p.request.thinking_budget, Some(9));
        // A prompt of no known shape says which shapes there are.
        let e = serde_json::from_value::<Prompt>(serde_json::json!([-1])).unwrap_err();
        assert!(e.to_string().contains("an array of token ids"), "{e}");
        assert!(check_model(Some("other"), &["m".into()]).is_err());
        assert!(check_model(None, &["m".into()]).is_ok());
    }
}
