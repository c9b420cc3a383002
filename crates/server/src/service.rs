//! The `siliceo.v1.Inference` service over a [`Runtime`].

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use prost::Message;
use siliceo_core::{Constraint, FinishReason, Priority, RequestId, SamplingParams, TokenId};
use siliceo_runtime::Message as ChatMessage;
use siliceo_runtime::{
    CallPiece, ChatEnd, EmbeddingService, Event, GenerateRequest, Input, OutputRouter,
    RequestStream, Routed, Runtime, RuntimeError, ToolCall, ToolChoice, Usage,
};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::pb;
use crate::status_of;

/// The service. Cheap to clone (a shared runtime).
#[derive(Debug, Clone)]
pub struct InferenceService {
    rt: Arc<Runtime>,
    max_request_bytes: usize,
    embeddings: Option<Arc<EmbeddingService>>,
}

impl InferenceService {
    /// `Generate`'s work: the request checked and submitted (the runtime's
    /// request layer runs on tokio's blocking pool).
    async fn start_generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<GenerateStream>, Status> {
        self.check_size(request.get_ref())?;
        let (mut req, read) = to_runtime(request.into_inner())
            .inspect_err(|_| self.rt.metrics().error("invalid_request"))?;
        let syntax = self
            .rt
            .offer_tools(&mut req, &read.choice, read.parallel)
            .map_err(|e| status_of(&e))?;
        let think = read.reasoning.then(|| self.rt.thinking(&req)).flatten();
        let schemas = req.tools.clone();
        let inner = self.rt.submit_async(req).await.map_err(|e| status_of(&e))?;
        Ok(Response::new(GenerateStream {
            inner,
            sent_id: false,
            trailer: None,
            ended: false,
            router: (syntax.is_some() || think.is_some()).then(|| {
                let r = OutputRouter::new(syntax, think)
                    .with_tools(&schemas)
                    .with_think_tags(self.rt.think_tags());
                if read.parallel { r } else { r.single_call() }
            }),
            calls: 0,
        }))
    }

    /// A service over `rt`; requests larger than `max_request_bytes` are refused
    /// with `INVALID_ARGUMENT`.
    pub fn new(rt: Arc<Runtime>, max_request_bytes: usize) -> Self {
        InferenceService {
            rt,
            max_request_bytes,
            embeddings: None,
        }
    }

    /// Serves `Embed` and `Rerank` with this embedding model.
    pub fn with_embeddings(mut self, embeddings: Option<Arc<EmbeddingService>>) -> Self {
        self.embeddings = embeddings;
        self
    }

    fn embedder(&self, rpc: &str) -> Result<&EmbeddingService, Status> {
        self.embeddings.as_deref().ok_or_else(|| {
            Status::unimplemented(format!(
                "{rpc} needs an embedding model; start the server with --embedding-model PATH \
                 (`cargo xtask fetch-model --embed` fetches all-MiniLM-L6-v2)"
            ))
        })
    }

    fn check_size<M: Message>(&self, m: &M) -> Result<(), Status> {
        crate::check_size(m, self.max_request_bytes)
    }

    /// Runs a blocking runtime call off the async workers.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Runtime) -> Result<T, RuntimeError> + Send + 'static,
    ) -> Result<T, Status> {
        crate::blocking(&self.rt, f).await
    }
}

fn invalid(field: &str, reason: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {reason}"))
}

/// How a request's output is to be read.
struct Reading {
    /// `tool_choice`.
    choice: ToolChoice,
    /// `parallel_tool_calls`.
    parallel: bool,
    /// `split_reasoning`.
    reasoning: bool,
}

/// Translates a wire request into a runtime request (wire-level checks only;
/// the runtime validates the rest and names the field), and how its output
/// is to be read.
fn to_runtime(r: pb::GenerateRequest) -> Result<(GenerateRequest, Reading), Status> {
    let input = match r.input {
        None => {
            return Err(invalid(
                "input",
                "one of prompt, chat or tokens is required",
            ));
        }
        Some(pb::generate_request::Input::Prompt(p)) => Input::Prompt(p),
        Some(pb::generate_request::Input::Tokens(t)) => {
            Input::Tokens(t.ids.into_iter().map(TokenId).collect())
        }
        Some(pb::generate_request::Input::Infill(f)) => Input::Infill {
            prefix: f.prefix,
            suffix: f.suffix,
        },
        Some(pb::generate_request::Input::Chat(c)) => {
            let mut msgs = Vec::with_capacity(c.messages.len());
            for (i, m) in c.messages.into_iter().enumerate() {
                msgs.push(chat_message(i, m)?);
            }
            Input::Chat(msgs)
        }
    };
    let mut wire = Vec::with_capacity(r.tools.len());
    for (i, t) in r.tools.into_iter().enumerate() {
        let parameters = match t.parameters.as_str() {
            "" => None,
            p => Some(serde_json::from_str(p).map_err(|e| {
                invalid(&format!("tools[{i}].parameters"), format!("not JSON: {e}"))
            })?),
        };
        let description = (!t.description.is_empty()).then_some(t.description);
        wire.push((t.name, description, parameters));
    }
    let mut tools = siliceo_runtime::checked_tools(wire)
        .map_err(|(i, field, why)| invalid(&format!("tools[{i}].{field}"), why))?;
    let choice = match r.tool_choice.as_str() {
        "" | "auto" if tools.is_empty() => ToolChoice::None,
        "" | "auto" => ToolChoice::Auto,
        "none" => ToolChoice::None,
        "required" => ToolChoice::Required,
        name => ToolChoice::Function(name.to_string()),
    };
    choice
        .check(&tools)
        .map_err(|why| invalid("tool_choice", why))?;
    if choice == ToolChoice::None {
        // Not offered.
        tools.clear();
    }
    let parallel = r.parallel_tool_calls.unwrap_or(true);
    let s = r.sampling.unwrap_or_default();
    let d = SamplingParams::greedy();
    let sampling = SamplingParams {
        temperature: s.temperature.unwrap_or(d.temperature),
        top_k: s.top_k.unwrap_or(d.top_k),
        top_p: s.top_p.unwrap_or(d.top_p),
        min_p: s.min_p.unwrap_or(d.min_p),
        seed: s.seed,
        repetition_penalty: s.repetition_penalty.unwrap_or(d.repetition_penalty),
        presence_penalty: s.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: s.frequency_penalty.unwrap_or(d.frequency_penalty),
        penalty_last_n: s.penalty_last_n.unwrap_or(d.penalty_last_n),
        max_tokens: match (r.score_only, r.max_tokens) {
            (true, 0) => 0,
            (true, _) => {
                return Err(invalid(
                    "max_tokens",
                    "must be 0 with score_only (nothing is generated)",
                ));
            }
            (false, 0) => d.max_tokens,
            (false, m) => m,
        },
        stop: r.stop,
        stop_token_ids: Vec::new(),
        ignore_eos: r.ignore_eos,
        // A map: each token once, so the order of the sums does not matter.
        logit_bias: s
            .logit_bias
            .into_iter()
            .map(|(t, v)| (TokenId(t), v))
            .collect(),
    };
    let priority = match pb::Priority::try_from(r.priority) {
        Ok(pb::Priority::Interactive) => Priority::Interactive,
        Ok(pb::Priority::Batch) => Priority::Batch,
        Ok(pb::Priority::Normal | pb::Priority::Unspecified) => Priority::Normal,
        Err(_) => return Err(invalid("priority", format!("unknown value {}", r.priority))),
    };
    let req = GenerateRequest {
        id: (!r.request_id.is_empty()).then_some(RequestId(r.request_id)),
        input,
        sampling,
        priority,
        deadline: (r.deadline_ms > 0).then(|| Duration::from_millis(u64::from(r.deadline_ms))),
        speculative: r.speculative,
        cache_salt: (!r.cache_salt.is_empty()).then_some(r.cache_salt),
        constraint_field: constraint_field(r.constraint.as_ref()),
        constraint: constraint_of(r.constraint)?,
        tools,
        logprobs: match (r.logprobs, r.top_logprobs) {
            (true, k) => Some(k),
            (false, 0) => None,
            (false, _) => return Err(invalid("top_logprobs", "needs `logprobs: true`")),
        },
        prompt_logprobs: match (r.prompt_logprobs, r.score_only) {
            (None, true) => return Err(invalid("score_only", "needs `prompt_logprobs`")),
            (k, _) => k,
        },
        // A max_tokens the client set must fit beside the prompt (0: the
        // default, cut to what the context leaves).
        max_tokens_field: (r.max_tokens != 0).then_some("max_tokens"),
        chat_template_kwargs: if r.chat_template_kwargs.is_empty() {
            serde_json::Map::new()
        } else {
            serde_json::from_str(&r.chat_template_kwargs)
                .map_err(|e| invalid("chat_template_kwargs", format!("not a JSON object: {e}")))?
        },
        chat_end: if r.continue_final_message {
            ChatEnd::Continue
        } else {
            ChatEnd::Answer
        },
        include_stop_str: r.include_stop_str_in_output,
        min_tokens: r.min_tokens,
        thinking_budget: r.thinking_budget,
    };
    let read = Reading {
        choice,
        parallel,
        reasoning: r.split_reasoning,
    };
    Ok((req, read))
}

/// A wire chat message as the runtime takes it: an assistant's tool calls
/// (their arguments JSON text), a tool message's call id and name.
fn chat_message(i: usize, m: pb::ChatMessage) -> Result<ChatMessage, Status> {
    let mut calls = Vec::with_capacity(m.tool_calls.len());
    for (j, c) in m.tool_calls.into_iter().enumerate() {
        if serde_json::from_str::<serde_json::Value>(&c.arguments).is_err() {
            return Err(invalid(
                &format!("chat.messages[{i}].tool_calls[{j}].arguments"),
                "must be JSON text",
            ));
        }
        calls.push(ToolCall {
            id: if c.id.is_empty() {
                format!("call_{i}_{j}")
            } else {
                c.id
            },
            name: c.name,
            arguments: c.arguments,
        });
    }
    let msg = ChatMessage {
        role: m.role,
        // An assistant message that only calls tools has no text.
        content: (!m.content.is_empty() || calls.is_empty()).then_some(m.content),
        tool_calls: calls,
        tool_call_id: (!m.tool_call_id.is_empty()).then_some(m.tool_call_id),
        name: (!m.name.is_empty()).then_some(m.name),
        reasoning: (!m.reasoning.is_empty()).then_some(m.reasoning),
    };
    msg.checked()
        .map_err(|(field, why)| invalid(&format!("chat.messages[{i}].{field}"), why))
}

/// A token's log-probability on the wire.
fn token_logprob_pb(l: siliceo_runtime::TokenLogprob) -> pb::TokenLogprob {
    pb::TokenLogprob {
        token_id: l.token.0,
        bytes: l.bytes,
        logprob: l.logprob,
        rank: l.rank,
        top: l
            .top
            .into_iter()
            .map(|(t, bytes, logprob)| pb::TopLogprob {
                token_id: t.0,
                bytes,
                logprob,
            })
            .collect(),
    }
}

/// The field a constraint came from, as INVALID_ARGUMENT names it.
fn constraint_field(c: Option<&pb::Constraint>) -> &'static str {
    use pb::constraint::Kind;
    match c.and_then(|c| c.kind.as_ref()) {
        Some(Kind::JsonSchema(_)) => "constraint.json_schema",
        Some(Kind::Regex(_)) => "constraint.regex",
        Some(Kind::Lark(_)) => "constraint.lark",
        Some(Kind::JsonObject(_)) => "constraint.json_object",
        None => "constraint",
    }
}

fn constraint_of(c: Option<pb::Constraint>) -> Result<Option<Constraint>, Status> {
    use pb::constraint::Kind;
    let Some(c) = c else {
        return Ok(None);
    };
    Ok(Some(match c.kind {
        None => {
            return Err(invalid(
                "constraint",
                "one of json_schema, regex, lark or json_object is required",
            ));
        }
        Some(Kind::JsonSchema(s)) => Constraint::JsonSchema {
            schema: s.schema,
            strict: s.strict,
        },
        Some(Kind::Regex(r)) => Constraint::Regex(r),
        Some(Kind::Lark(g)) => Constraint::Lark(g),
        Some(Kind::JsonObject(true)) => Constraint::JsonObject,
        Some(Kind::JsonObject(false)) => return Ok(None),
    }))
}

fn usage_pb(u: &Usage) -> pb::Usage {
    pb::Usage {
        prompt_tokens: u.prompt_tokens,
        cached_prompt_tokens: u.cached_prompt_tokens,
        completion_tokens: u.completion_tokens,
        queue_ms: u.queue_ms,
        ttft_ms: u.ttft_ms,
        decode_ms: u.decode_ms,
        draft_tokens: u.draft_tokens,
        accepted_draft_tokens: u.accepted_draft_tokens,
    }
}

fn finish_pb(r: FinishReason) -> pb::FinishReason {
    match r {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Cancelled => pb::FinishReason::Cancelled,
        FinishReason::Error => pb::FinishReason::Error,
    }
}

/// The response stream of one `Generate`: runtime events as wire messages.
/// Dropping it (the client went away) drops the [`RequestStream`], which
/// cancels the request and frees its KV.
pub struct GenerateStream {
    inner: RequestStream,
    sent_id: bool,
    /// A status to send after the final message (engine failures).
    trailer: Option<Status>,
    ended: bool,
    /// With tools: the calls read out of the text.
    router: Option<OutputRouter>,
    /// Tool calls begun.
    calls: u32,
}

impl GenerateStream {
    /// With tools or thinking to read, `text` as the router splits it
    /// (`end`: all held back goes out), its calls' pieces as wire deltas;
    /// without, the text as it is.
    fn route(&mut self, text: String, end: bool) -> (Routed, Vec<pb::ToolCallDelta>) {
        let Some(router) = self.router.as_mut() else {
            let r = Routed {
                answer: text,
                ..Routed::default()
            };
            return (r, Vec::new());
        };
        let mut r = router.push(&text, end);
        let mut deltas = Vec::new();
        for piece in std::mem::take(&mut r.calls) {
            match piece {
                CallPiece::Call(name) => {
                    deltas.push(pb::ToolCallDelta {
                        index: self.calls,
                        id: format!("call_{}_{}", self.inner.id().0, self.calls),
                        name,
                        arguments: String::new(),
                    });
                    self.calls += 1;
                }
                CallPiece::Args(arguments) if self.calls > 0 => {
                    deltas.push(pb::ToolCallDelta {
                        index: self.calls - 1,
                        arguments,
                        ..Default::default()
                    });
                }
                _ => {}
            }
        }
        (r, deltas)
    }
}

impl std::fmt::Debug for GenerateStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenerateStream")
            .field("id", self.inner.id())
            .finish()
    }
}

impl Stream for GenerateStream {
    type Item = Result<pb::GenerateResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if let Some(s) = this.trailer.take() {
            this.ended = true;
            return Poll::Ready(Some(Err(s)));
        }
        if this.ended {
            return Poll::Ready(None);
        }
        let event = match this.inner.poll_next(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(e) => e,
        };
        let request_id = |sent: &mut bool, id: &RequestId| {
            if std::mem::replace(sent, true) {
                String::new()
            } else {
                id.0.clone()
            }
        };
        match event {
            Some(Event::Text {
                text,
                tokens,
                logprobs,
            }) => {
                let id = request_id(&mut this.sent_id, this.inner.id());
                let (out, tool_calls) = this.route(text, false);
                Poll::Ready(Some(Ok(pb::GenerateResponse {
                    text: out.answer,
                    reasoning: out.reasoning,
                    tool_calls,
                    token_ids: tokens.into_iter().map(|t| t.0).collect(),
                    finish_reason: pb::FinishReason::Unspecified as i32,
                    usage: None,
                    request_id: id,
                    logprobs: logprobs.into_iter().map(token_logprob_pb).collect(),
                    prompt_logprobs: Vec::new(),
                    stop_sequence: String::new(),
                })))
            }
            Some(Event::Prompt { first, logprobs }) => {
                let id = request_id(&mut this.sent_id, this.inner.id());
                // The first token: no log-probability, no alternatives.
                let first = pb::TokenLogprob {
                    token_id: first.0.0,
                    bytes: first.1,
                    logprob: 0.0,
                    top: Vec::new(),
                    rank: 0,
                };
                let prompt_logprobs = std::iter::once(first)
                    .chain(logprobs.into_iter().map(token_logprob_pb))
                    .collect();
                Poll::Ready(Some(Ok(pb::GenerateResponse {
                    finish_reason: pb::FinishReason::Unspecified as i32,
                    request_id: id,
                    prompt_logprobs,
                    ..Default::default()
                })))
            }
            Some(Event::Done {
                finish_reason,
                usage,
                error,
                stop,
            }) => {
                this.ended = true;
                if let Some(e) = error {
                    let status = status_of(&e);
                    if matches!(e, RuntimeError::Engine(_)) && this.sent_id {
                        // Tokens were streamed: close with the figures, then the status.
                        this.ended = false;
                        this.trailer = Some(status);
                    } else {
                        return Poll::Ready(Some(Err(status)));
                    }
                }
                let (out, tool_calls) = this.route(String::new(), true);
                let finish = match finish_pb(finish_reason) {
                    pb::FinishReason::Stop | pb::FinishReason::Length
                        if this.calls > 0 && !out.cut =>
                    {
                        pb::FinishReason::ToolCalls
                    }
                    f => f,
                };
                Poll::Ready(Some(Ok(pb::GenerateResponse {
                    text: out.answer,
                    reasoning: out.reasoning,
                    tool_calls,
                    token_ids: Vec::new(),
                    finish_reason: finish as i32,
                    usage: Some(usage_pb(&usage)),
                    request_id: this.inner.id().0.clone(),
                    logprobs: Vec::new(),
                    prompt_logprobs: Vec::new(),
                    stop_sequence: stop.unwrap_or_default(),
                })))
            }
            None => {
                this.ended = true;
                Poll::Ready(Some(Err(Status::unavailable("the engine has stopped"))))
            }
        }
    }
}

#[tonic::async_trait]
impl pb::inference_server::Inference for InferenceService {
    type GenerateStream = GenerateStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let r = self.start_generate(request).await;
        let status = match &r {
            Ok(_) => "OK".to_string(),
            Err(s) => format!("{:?}", s.code()),
        };
        self.rt.metrics().api_request("grpc", "Generate", &status);
        r
    }

    async fn embed(
        &self,
        request: Request<pb::EmbedRequest>,
    ) -> Result<Response<pb::EmbedResponse>, Status> {
        let r = request.into_inner();
        self.check_size(&r)?;
        let e = self.embedder("Embed")?;
        let t0 = Instant::now();
        let out = e
            .embed(r.inputs, r.normalize, r.truncate)
            .await
            .map_err(|e| status_of(&e))?;
        tracing::debug!(
            inputs = out.vectors.len(),
            ms = t0.elapsed().as_millis() as u64,
            "embed"
        );
        Ok(Response::new(pb::EmbedResponse {
            embeddings: out
                .vectors
                .into_iter()
                .map(|values| pb::Embedding { values })
                .collect(),
            prompt_tokens: out.prompt_tokens,
        }))
    }

    async fn rerank(
        &self,
        request: Request<pb::RerankRequest>,
    ) -> Result<Response<pb::RerankResponse>, Status> {
        let r = request.into_inner();
        self.check_size(&r)?;
        let e = self.embedder("Rerank")?;
        if r.query.trim().is_empty() {
            return Err(invalid("query", "must not be empty"));
        }
        let out = e
            .rerank(r.query, r.documents, r.top_n as usize, r.truncate)
            .await
            .map_err(|e| status_of(&e))?;
        Ok(Response::new(pb::RerankResponse {
            results: out
                .ranked
                .into_iter()
                .map(|(index, score)| pb::RerankResult {
                    index: index as u32,
                    score,
                })
                .collect(),
            method: out.method.as_str().to_string(),
        }))
    }

    async fn tokenize(
        &self,
        request: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        self.check_size(request.get_ref())?;
        let r = request.into_inner();
        let ids = self
            .blocking(move |rt| rt.tokenize(&r.text, r.add_special))
            .await?;
        Ok(Response::new(pb::TokenizeResponse {
            ids: ids.into_iter().map(|t| t.0).collect(),
        }))
    }

    async fn detokenize(
        &self,
        request: Request<pb::DetokenizeRequest>,
    ) -> Result<Response<pb::DetokenizeResponse>, Status> {
        self.check_size(request.get_ref())?;
        let ids: Vec<TokenId> = request.into_inner().ids.into_iter().map(TokenId).collect();
        let text = self.blocking(move |rt| rt.detokenize(&ids)).await?;
        Ok(Response::new(pb::DetokenizeResponse { text }))
    }

    async fn get_model_info(
        &self,
        _request: Request<pb::GetModelInfoRequest>,
    ) -> Result<Response<pb::ModelInfo>, Status> {
        let s = self.blocking(|rt| rt.stats()).await?;
        let i = self.rt.info();
        let g = i.geometry;
        let emb = self.embeddings.as_deref().map(EmbeddingService::info);
        // Our codecs ("kv8:kv8+tail64" → kv8, kv8) or llama.cpp's types.
        let (kv_k, kv_v, kv_bytes_per_token) = match &i.store {
            Some(store) => {
                let codecs = i.kv_format.split('+').next().unwrap_or_default();
                let (k, v) = codecs.split_once(':').unwrap_or((codecs, codecs));
                let per_token = store.bytes_per_token(i.block_size).round() as u64;
                (k.to_string(), v.to_string(), per_token)
            }
            None => (
                i.type_k.to_string(),
                i.type_v.to_string(),
                g.kv_bytes_per_token(i.type_k, i.type_v),
            ),
        };
        Ok(Response::new(pb::ModelInfo {
            embedding_model: emb.map(|e| e.model_name.clone()).unwrap_or_default(),
            embedding_dim: emb.map_or(0, |e| e.dim as u32),
            embedding_max_tokens: emb.map_or(0, |e| e.max_tokens),
            name: i.model_name.clone(),
            architecture: i.architecture.clone(),
            n_layer: g.n_layer,
            n_head: g.n_head,
            n_head_kv: g.n_head_kv,
            n_embd: g.n_embd,
            n_vocab: g.n_vocab,
            context_tokens: i.n_ctx,
            train_context: g.n_ctx_train,
            kv_type_k: kv_k,
            kv_type_v: kv_v,
            block_size: i.block_size,
            kv_blocks: u64::from(i.kv_blocks),
            kv_bytes_per_token,
            kv_backend: i.kv_backend.to_string(),
            kv_format: i.kv_format.clone(),
            gpu_layers: i.gpu_layers,
            kv_store_bytes: i.store.map_or(0, |s| s.bytes),
            kv_device_layers: i.store_split.map_or(0, |s| s.device_layers),
            kv_device_bytes: i.store_split.map_or(0, |s| s.device_bytes),
            max_running_seqs: i.max_running_seqs,
            prefix_caching: i.prefix_caching,
            speculative: i
                .speculative
                .as_ref()
                .map(|c| {
                    let drafter = match &c.draft_model {
                        Some(p) => format!(
                            "draft model {}",
                            p.file_name().unwrap_or_default().to_string_lossy()
                        ),
                        None => "ngram".to_string(),
                    };
                    format!(
                        "{drafter} (up to {} drafted tokens, below {} running)",
                        c.max_draft, c.max_batch
                    )
                })
                .unwrap_or_default(),
            kv: Some(pb::KvStats {
                used_blocks: s.kv_used_blocks as u64,
                free_blocks: s.kv_free_blocks as u64,
                cached_blocks: s.kv_cached_blocks as u64,
                prefix_hit_tokens: s.prefix_hit_tokens,
                prefix_miss_tokens: s.prefix_miss_tokens,
                running: s.running as u64,
                waiting: s.waiting as u64,
                seq_ids_in_use: s.seq_ids_in_use as u64,
                used_bytes: s.kv_used_bytes,
                shared_blocks: s.kv_shared_blocks as u64,
            }),
        }))
    }

    async fn cancel(
        &self,
        request: Request<pb::CancelRequest>,
    ) -> Result<Response<pb::CancelResponse>, Status> {
        let id = request.into_inner().request_id;
        if id.is_empty() {
            return Err(invalid("request_id", "is empty"));
        }
        let rid = RequestId(id.clone());
        if self.blocking(move |rt| rt.cancel(&rid)).await? {
            Ok(Response::new(pb::CancelResponse {}))
        } else {
            Err(Status::not_found(format!(
                "no request `{id}` is queued or running"
            )))
        }
    }
}
