//! The OpenAI-compatible HTTP API of siliceo-infer, on axum.
//!
//! - `POST /v1/chat/completions`, `POST /v1/completions`: streamed as
//!   server-sent events (`data: [DONE]` last) or whole; `n` choices; usage
//!   with `prompt_tokens_details.cached_tokens` from prefix caching.
//! - `POST /v1/responses` (OpenAI's Responses API, with the responses it
//!   keeps) and `POST /v1/messages` (Anthropic's Messages API).
//! - `POST /v1/embeddings`, `POST /v1/rerank` from the embedding model.
//! - `GET /v1/models`, `GET /v1/models/{id}`, `GET /health`,
//!   `GET /metrics` (Prometheus; every protocol's requests, by endpoint and
//!   status, and the runtime's occupancy) and `GET /v1/loads` (the load
//!   report gateways such as SMG poll).
//!
//! Errors use OpenAI's shape (`{"error": {"message", "type", "param",
//! "code"}}`) and status: 400 naming the field, 401, 404, 413, 429 with
//! `Retry-After`, 500, 503. A client that goes away cancels its request: the
//! response (and with it each choice's [`siliceo_runtime::RequestStream`]) is
//! dropped, which frees the request's KV at once.
//!
//! This crate knows the runtime, never the gRPC server; the binary serves
//! both on one runtime.
#![deny(missing_docs)]

mod anthropic;
mod effort;
mod error;
mod openai;
mod responses;
mod stream;
mod tls;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
pub use siliceo_core::ApiKeys;
use siliceo_core::{FinishReason, TlsIdentity, TokenId};
use siliceo_runtime::{
    EmbedInput, EmbeddingService, Event, Input, RequestStream, Runtime, RuntimeError, TokenLogprob,
    Usage,
};
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

pub use effort::ReasoningBudgets;
pub use error::ApiError;
pub use openai::MAX_N;

use stream::{ChoiceStream, Kind, StreamHead};

/// How the HTTP API is served.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Require `Authorization: Bearer <key>` with one of these on `/v1/*`
    /// (`/health` is open); none: open.
    pub api_keys: ApiKeys,
    /// Largest request body in bytes; larger ones get 413.
    pub max_request_bytes: usize,
    /// The model ids requests may name (the first is the one `/v1/models`
    /// lists); none: the model's file stem and its metadata name.
    pub model_ids: Vec<String>,
    /// Serves `/v1/embeddings` and `/v1/rerank`.
    pub embeddings: Option<Arc<EmbeddingService>>,
    /// Serve HTTPS with this certificate chain and key (gRPC's, in `serve`).
    pub tls: Option<TlsIdentity>,
    /// Origins whose pages a browser lets call the API (CORS).
    pub allow_origins: AllowOrigins,
    /// Memory for the Responses API's kept responses (`store`, which
    /// `previous_response_id` continues); the oldest go first. 0: none kept.
    pub responses_store_bytes: usize,
    /// Thinking budgets of the effort levels requests may name.
    pub reasoning_budgets: ReasoningBudgets,
}

/// The origins whose pages may call the API from a browser (CORS); none by
/// default, so a web page the user opens cannot drive a local server.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum AllowOrigins {
    /// No cross-origin calls (no CORS headers).
    #[default]
    None,
    /// Any origin (`*`).
    Any,
    /// These origins, exactly as browsers send them (`http://localhost:3000`).
    List(Vec<HeaderValue>),
}

impl AllowOrigins {
    /// `--allow-origin` values: `*`, or origins like `https://app.example`
    /// (a scheme and a host, an optional port, nothing after it).
    pub fn parse(origins: &[String]) -> Result<Self, String> {
        if origins.is_empty() {
            return Ok(AllowOrigins::None);
        }
        if origins.iter().any(|o| o == "*") {
            return Ok(AllowOrigins::Any);
        }
        let mut list = Vec::with_capacity(origins.len());
        for o in origins {
            let host = o
                .strip_prefix("http://")
                .or_else(|| o.strip_prefix("https://"))
                .unwrap_or_default();
            let value = HeaderValue::from_str(o).ok();
            match value {
                Some(v) if !host.is_empty() && !host.contains('/') => list.push(v),
                _ => {
                    return Err(format!(
                        "`{o}` is not an origin: a scheme and a host with an optional port, \
                         like http://localhost:3000 (no path, no trailing /), or *"
                    ));
                }
            }
        }
        Ok(AllowOrigins::List(list))
    }

    /// The layer that answers preflights and marks responses; none for
    /// [`AllowOrigins::None`].
    fn layer(&self) -> Option<CorsLayer> {
        let origin = match self {
            AllowOrigins::None => return None,
            AllowOrigins::Any => AllowOrigin::any(),
            AllowOrigins::List(l) => AllowOrigin::list(l.iter().cloned()),
        };
        Some(
            CorsLayer::new()
                .allow_origin(origin)
                .allow_methods([Method::GET, Method::POST])
                // Whatever the page asks for: `authorization`, `content-type`,
                // and the `x-stainless-*` headers OpenAI's JS client sends.
                // (A `*` would not cover `authorization`.)
                .allow_headers(AllowHeaders::mirror_request())
                .max_age(Duration::from_secs(600)),
        )
    }
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            api_keys: ApiKeys::default(),
            max_request_bytes: 4 << 20,
            model_ids: Vec::new(),
            embeddings: None,
            tls: None,
            allow_origins: AllowOrigins::None,
            responses_store_bytes: DEFAULT_RESPONSES_STORE_BYTES,
            reasoning_budgets: ReasoningBudgets::default(),
        }
    }
}

/// The Responses API's default memory for kept responses: 64 MiB.
pub const DEFAULT_RESPONSES_STORE_BYTES: usize = 64 << 20;

#[derive(Debug)]
struct AppState {
    rt: Arc<Runtime>,
    api_keys: ApiKeys,
    model_ids: Vec<String>,
    max_request_bytes: usize,
    embeddings: Option<Arc<EmbeddingService>>,
    created: u64,
    /// The Responses API's kept responses.
    responses: Arc<responses::ResponseStore>,
    /// Thinking budgets of effort levels.
    reasoning_budgets: ReasoningBudgets,
}

fn now_s() -> u64 {
    siliceo_core::unix_time_s() as u64
}

/// The model ids a runtime answers to: its file's stem, then its name.
pub fn default_model_ids(rt: &Runtime) -> Vec<String> {
    rt.model_ids()
}

/// The API's routes over `rt`.
pub fn router(rt: Arc<Runtime>, cfg: &HttpConfig) -> Router {
    let model_ids = if cfg.model_ids.is_empty() {
        default_model_ids(&rt)
    } else {
        cfg.model_ids.clone()
    };
    let state = Arc::new(AppState {
        rt,
        api_keys: cfg.api_keys.clone(),
        model_ids,
        max_request_bytes: cfg.max_request_bytes,
        embeddings: cfg.embeddings.clone(),
        created: now_s(),
        responses: Arc::new(responses::ResponseStore::new(cfg.responses_store_bytes)),
        reasoning_budgets: cfg.reasoning_budgets.clone(),
    });
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/input_tokens", post(responses::input_tokens))
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route(
            "/v1/responses/{id}/input_items",
            get(responses::input_items),
        )
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/rerank", post(rerank))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_key,
        ));
    let app = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/loads", get(loads))
        .merge(v1)
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            count_request,
        ))
        .method_not_allowed_fallback(|req: Request| async move {
            ApiError::wrong_method(req.method(), req.uri().path())
        })
        .fallback(|req: Request| async move { ApiError::no_route(req.uri().path()) })
        .layer(DefaultBodyLimit::max(cfg.max_request_bytes));
    // Outermost: a preflight is answered before the key is asked for, and
    // every answer (errors too) carries the headers a browser checks.
    let app = match cfg.allow_origins.layer() {
        Some(cors) => app.layer(cors),
        None => app,
    };
    app.with_state(state)
}

/// Serves the API on `listener` (HTTPS when `cfg.tls` is set) until
/// `shutdown` resolves; streams in flight are then cut (the runtime cancels
/// their requests). A certificate or key that does not load is an
/// `InvalidInput` error before anything is served.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    rt: Arc<Runtime>,
    cfg: HttpConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(rt, &cfg);
    match &cfg.tls {
        None => {
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
        }
        Some(id) => {
            let listener = tls::TlsListener::new(listener, tls::acceptor(id)?)?;
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
        }
    }
}

/// Checks that `tls` loads (certificate chain and key), so a bad one fails
/// at start-up with a clear message rather than when serving.
pub fn check_tls(tls: &TlsIdentity) -> std::io::Result<()> {
    tls::acceptor(tls).map(drop)
}

/// Counts each request in the runtime's metrics by route and status.
async fn count_request(
    State(s): State<Arc<AppState>>,
    path: MatchedPath,
    req: Request,
    next: Next,
) -> Response {
    let resp = next.run(req).await;
    s.rt.metrics()
        .api_request("http", path.as_str(), resp.status().as_str());
    resp
}

/// The load report SMG (and SGLang's router) poll: one scheduler's
/// figures in SGLang's `SchedulerLoad` shape, from the runtime's state now.
/// Open, like `/health`.
async fn loads(State(s): State<Arc<AppState>>) -> Response {
    let rt = s.rt.clone();
    let l = match tokio::task::spawn_blocking(move || rt.load()).await {
        Ok(Ok(l)) => l,
        Ok(Err(e)) => return ApiError::from_runtime(&e).into_response(),
        Err(e) => return ApiError::internal(e.to_string()).into_response(),
    };
    Json(json!({
        "timestamp": now_s().to_string(),
        "dp_rank_count": 1,
        "loads": [{
            "dp_rank": 0,
            "num_running_reqs": l.num_running_reqs,
            "num_waiting_reqs": l.num_waiting_reqs,
            "num_total_reqs": l.num_total_reqs,
            "num_used_tokens": l.num_used_tokens,
            "max_total_num_tokens": l.max_total_num_tokens,
            "token_usage": l.token_usage,
            "gen_throughput": l.gen_throughput,
            "cache_hit_rate": l.cache_hit_rate,
            "utilization": l.utilization,
            "max_running_requests": l.max_running_requests,
        }],
    }))
    .into_response()
}

/// Prometheus' exposition (the same as on `--metrics-listen`): every
/// protocol's requests and the runtime's occupancy. Open, as `/health` is.
async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let rt = s.rt.clone();
    match tokio::task::spawn_blocking(move || rt.prometheus()).await {
        Ok(body) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response(),
        Err(e) => ApiError::internal(e.to_string()).into_response(),
    }
}

async fn require_key(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if !s.api_keys.is_empty() {
        // OpenAI's clients send a bearer token, Anthropic's `x-api-key`.
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok()));
        match given {
            None => {
                return ApiError::unauthorized("missing `Authorization: Bearer <key>`")
                    .into_response();
            }
            Some(g) if !s.api_keys.accepts(g) => {
                return ApiError::unauthorized("wrong API key").into_response();
            }
            Some(_) => {}
        }
    }
    next.run(req).await
}

/// Reads a JSON body: 413 over the limit, 400 when it is not JSON.
fn body_json(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Value, ApiError> {
    let body = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(limit)
        } else {
            ApiError::invalid("body", e.body_text())
        }
    })?;
    serde_json::from_slice(&body)
        .map_err(|e| ApiError::invalid("body", format!("not valid JSON: {e}")))
}

/// Reads `T` out of a JSON body, naming the field a bad one got wrong.
fn field_of<T: DeserializeOwned>(v: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || path.is_empty() {
            ApiError::invalid("body", format!("not a valid request: {inner}"))
        } else {
            ApiError::invalid(path, inner)
        }
    })
}

/// Parses a JSON body into `T`.
fn parse<T: DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
    limit: usize,
) -> Result<T, ApiError> {
    field_of(&body_json(body, limit)?)
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    match s.rt.stats() {
        Ok(_) => Json(json!({"status": "ok"})).into_response(),
        Err(e) => ApiError::from_runtime(&e).into_response(),
    }
}

/// A model as both OpenAI's and Anthropic's clients read one (`object`,
/// `created`, `owned_by`; `type`, `display_name`, `created_at`,
/// `max_input_tokens`) with vLLM's `max_model_len`.
fn card(s: &AppState, id: &str, max_len: u32) -> Value {
    json!({
        "id": id,
        "object": "model",
        "created": s.created,
        "owned_by": "siliceo",
        "max_model_len": max_len,
        "type": "model",
        "display_name": id,
        "created_at": siliceo_core::rfc3339(s.created),
        "max_input_tokens": max_len,
    })
}

fn model_card(s: &AppState, id: &str) -> Value {
    card(s, id, s.rt.info().n_ctx)
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    let mut data = vec![model_card(&s, &s.model_ids[0])];
    if let Some(e) = &s.embeddings {
        data.push(card(&s, &e.info().model_name, e.info().max_tokens));
    }
    // Anthropic's page fields beside OpenAI's list.
    let first = data.first().map(|m| m["id"].clone());
    let last = data.last().map(|m| m["id"].clone());
    Json(json!({
        "object": "list", "data": data, "has_more": false, "first_id": first, "last_id": last,
    }))
}

async fn model(State(s): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if s.model_ids.contains(&id) {
        Json(model_card(&s, &id)).into_response()
    } else {
        ApiError::model_not_found(&id, &s.model_ids[0]).into_response()
    }
}

/// The prompt tokens `req` runs on (its chat rendered), counted off the
/// async threads: a template may take a while.
pub(crate) async fn prompt_tokens(
    s: &AppState,
    req: siliceo_runtime::GenerateRequest,
) -> Result<Vec<siliceo_core::TokenId>, ApiError> {
    let rt = s.rt.clone();
    tokio::task::spawn_blocking(move || rt.request_tokens(req))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|e| ApiError::from_runtime(&e))
}

/// `POST /tokenize`: the tokens a prompt or a chat gives, as a request would
/// run on them (vLLM's answer: `tokens`, `count`, `max_model_len`).
async fn tokenize(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let r: openai::TokenizeRequest = parse(body, s.max_request_bytes)?;
    openai::check_model(r.model.as_deref(), &s.model_ids)?;
    let strs = r.return_token_strs;
    let (req, special) = openai::tokenize_input(r)?;
    let tokens = match &req.input {
        Input::Prompt(p) if !special => s.rt.tokenize(p, false).map_err(|e| named(e, "prompt")),
        _ => prompt_tokens(&s, req).await,
    }?;
    let mut out = json!({
        "count": tokens.len(),
        "max_model_len": s.rt.info().n_ctx,
        "tokens": tokens.iter().map(|t| t.0).collect::<Vec<_>>(),
    });
    if strs {
        let pieces = tokens
            .iter()
            .map(|t| s.rt.detokenize(std::slice::from_ref(t)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ApiError::from_runtime(&e))?;
        out["token_strs"] = json!(pieces);
    }
    Ok(Json(out))
}

/// `POST /detokenize`: `{"tokens": [...]}` to text, answered as `prompt`
/// (vLLM) and `content` (llama-server).
async fn detokenize(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    #[derive(serde::Deserialize)]
    struct DetokenizeRequest {
        model: Option<String>,
        tokens: Vec<u32>,
    }
    let r: DetokenizeRequest = parse(body, s.max_request_bytes)?;
    openai::check_model(r.model.as_deref(), &s.model_ids)?;
    let ids: Vec<TokenId> = r.tokens.into_iter().map(TokenId).collect();
    let text = s.rt.detokenize(&ids).map_err(|e| named(e, "tokens"))?;
    Ok(Json(json!({"prompt": text, "content": text})))
}

async fn chat_completions(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    generate(&s, body, Kind::Chat).await
}

async fn completions(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    generate(&s, body, Kind::Completion).await
}

/// Submits choice `i` and waits until the engine has queued it, so a
/// request it refuses is answered with an error status, not a 200 stream.
async fn start(
    s: &AppState,
    req: siliceo_runtime::GenerateRequest,
) -> Result<RequestStream, ApiError> {
    Ok(start_counted(s, req).await?.0)
}

/// [`start`], with the prompt's tokens counted.
async fn start_counted(
    s: &AppState,
    req: siliceo_runtime::GenerateRequest,
) -> Result<(RequestStream, u32), ApiError> {
    s.rt.submit_accepted(req)
        .await
        .map_err(|e| ApiError::from_runtime(&e))
}

/// How a plan's output is read, for every chat endpoint: tool calls in
/// the model's syntax (and a required or named call forced by a grammar
/// with the tools' schemas), then a reasoning model's thinking.
fn parsing(s: &AppState, plan: &mut openai::Plan) -> Result<stream::Parsing, ApiError> {
    let tools = resolve_tools(s, plan)?;
    apply_thinking(s, plan)?;
    let think = match plan.request.input {
        Input::Chat(_) => s.rt.thinking(&plan.request),
        _ => None,
    };
    let one_call = plan.tools.as_ref().is_some_and(|t| !t.parallel);
    Ok(stream::Parsing {
        tools,
        schemas: plan.request.tools.clone().into(),
        think_tags: s.rt.think_tags(),
        think,
        one_call,
    })
}

/// Thinking as the request asks, before its prompt is rendered or counted:
/// an effort level becomes a thinking budget (an explicit budget wins) and
/// turns thinking on; on or off sets the template's own switch, where it
/// has one. An unknown level is a 400, and so is an effort or budget for a
/// model that does not think.
pub(crate) fn apply_thinking(s: &AppState, plan: &mut openai::Plan) -> Result<(), ApiError> {
    let template = s.rt.chat_template();
    let reasons = template.is_some_and(|t| t.reasons());
    let takes_effort = template.is_some_and(|t| t.takes_effort());
    if let Some((field, level)) = &plan.effort {
        let budget = s.reasoning_budgets.get(level).ok_or_else(|| {
            ApiError::invalid(
                *field,
                format!("must be one of {}", s.reasoning_budgets.names()),
            )
        })?;
        if !reasons {
            return Err(ApiError::unsupported(
                field,
                &format!("reasoning effort `{level}` (the model served does not think)"),
            ));
        }
        plan.thinking.get_or_insert(true);
        if plan.request.thinking_budget.is_none() {
            plan.request.thinking_budget = budget;
        }
        // A model trained on effort levels (gpt-oss) is told the level too.
        if let Some(named) = effort::template_level(level).filter(|_| takes_effort) {
            plan.request
                .chat_template_kwargs
                .entry(siliceo_runtime::ChatTemplate::EFFORT)
                .or_insert(named.into());
        }
    }
    if plan.request.thinking_budget.is_some() && !reasons {
        return Err(ApiError::unsupported(
            "thinking_token_budget",
            "a thinking budget (the model served does not think)",
        ));
    }
    if let Some(on) = plan.thinking {
        s.rt.switch_thinking(&mut plan.request, on);
    }
    Ok(())
}

/// The model's tool syntax, when the plan offers tools (a required or named
/// call forced by a grammar).
fn resolve_tools(
    s: &AppState,
    plan: &mut openai::Plan,
) -> Result<Option<siliceo_runtime::ToolSyntax>, ApiError> {
    let Some(tp) = &plan.tools else {
        return Ok(None);
    };
    s.rt.offer_tools(&mut plan.request, &tp.choice, tp.parallel)
        .map_err(|e| ApiError::from_runtime(&e))
}

/// Serves a chat or text completion request.
async fn generate(
    s: &AppState,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
) -> Result<Response, ApiError> {
    let v = body_json(body, s.max_request_bytes)?;
    let common: openai::Common = field_of(&v)?;
    openai::check_model(common.model.as_deref(), &s.model_ids)?;
    let mut plan = match kind {
        Kind::Chat => openai::chat_plan(field_of(&v)?, common)?,
        Kind::Completion => openai::completion_plan(field_of(&v)?, common)?,
    };
    let parsing = parsing(s, &mut plan)?;
    // The text each prompt's echo returns: a text prompt as it came, token
    // ids as text.
    let echoes: Vec<String> = plan
        .echo
        .iter()
        .map(|e| match e {
            openai::Echo::Text(t) => Ok(t.clone()),
            openai::Echo::Tokens(ids) => s.rt.detokenize(ids).map_err(|e| named(e, "prompt")),
        })
        .collect::<Result<_, _>>()?;
    let id = format!("{}-{}", kind.id_prefix(), uuid_like());
    let created = now_s();
    let model = s.model_ids[0].clone();
    let n = plan.n;
    // Each prompt's choice 0 first: a refused request fails before any
    // other choice is queued (those queued are dropped, which cancels them).
    let mut firsts = Vec::with_capacity(plan.prompts() as usize);
    // Each prompt's tokens (vLLM's continuous usage reports them).
    let mut prompt_tokens = Vec::with_capacity(plan.prompts() as usize);
    for p in 0..plan.prompts() {
        let (first, count) = start_counted(s, plan.choice(p * n)).await?;
        firsts.push(first);
        prompt_tokens.push(count);
    }
    let mut started = Vec::with_capacity(plan.choices() as usize);
    for (p, mut first) in (0u32..).zip(firsts) {
        if n == 1 {
            started.push((first, None));
            continue;
        }
        // The other choices start once choice 0 has its first token: its
        // prompt's KV is then in the prefix cache, so the prompt is computed
        // once and the others share its blocks.
        let ev = first.next().await;
        // A scored prompt is scored once: choice 0's scores (its first
        // event) go to every choice, and the others reuse the cache. A
        // request that only scores generates nothing to share.
        let scores = match &ev {
            Some(p @ Event::Prompt { .. }) if plan.request.sampling.max_tokens > 0 => {
                Some(p.clone())
            }
            _ => None,
        };
        started.push((first, ev));
        for j in 1..n {
            let mut req = plan.choice(p * n + j);
            if scores.is_some() {
                req.prompt_logprobs = None;
            }
            started.push((start(s, req).await?, scores.clone()));
        }
    }
    if plan.stream {
        let head = StreamHead {
            kind,
            id,
            created,
            model,
            include_usage: plan.include_usage,
            continuous_usage: plan.continuous_usage.then_some(prompt_tokens),
            parsing,
            echoes,
            n,
            logprobs: plan.request.logprobs,
            prompt_logprobs: plan.prompt_logprobs,
        };
        let events = ChoiceStream::new(head, started);
        return Ok(Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let mut choices = Vec::with_capacity(started.len());
    // Each choice's mean log-probability per token (`best_of` ranks by it).
    let mut scores = Vec::with_capacity(started.len());
    let mut usage_all = Usage::default();
    // vLLM's `prompt_logprobs`: per choice on completions, once on chat.
    let mut chat_prompt_logprobs = Value::Null;
    for (i, st) in started.into_iter().enumerate() {
        let Collected {
            text,
            finish,
            usage,
            lps,
            prompt,
            stop,
        } = collect(st).await?;
        // A prompt's choices share it: counted once, for each prompt.
        if i.is_multiple_of(n as usize) {
            usage_all.prompt_tokens += usage.prompt_tokens;
            usage_all.cached_prompt_tokens += usage.cached_prompt_tokens;
        }
        usage_all.completion_tokens += usage.completion_tokens;
        scores.push(match lps.len() {
            0 => f64::NEG_INFINITY,
            len => lps.iter().map(|l| f64::from(l.logprob)).sum::<f64>() / len as f64,
        });
        let lps = plan.request.logprobs.map(|_| lps.as_slice());
        let echoed = echoes.get(i / n as usize).map(|text| stream::Echoed {
            text,
            scores: prompt
                .as_ref()
                .zip(plan.request.logprobs.map(|k| k as usize)),
        });
        let mut c = kind.choice(i, &text, finish, &parsing, lps, echoed);
        // vLLM's: the stop string that ended the choice.
        c["stop_reason"] = json!(stop);
        if let (Some(k), Some(p)) = (plan.prompt_logprobs, &prompt) {
            let v = stream::vllm_prompt_logprobs(p, k as usize);
            match kind {
                Kind::Completion => c["prompt_logprobs"] = v,
                Kind::Chat if i == 0 => chat_prompt_logprobs = v,
                Kind::Chat => {}
            }
        }
        choices.push(c);
    }
    if let Some(b) = plan.best_of {
        choices = openai::keep_best(choices, &scores, n as usize, b);
    }
    let mut body = json!({
        "id": id,
        "object": kind.object(),
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_json(&usage_all),
    });
    if !chat_prompt_logprobs.is_null() {
        body["prompt_logprobs"] = chat_prompt_logprobs;
    }
    Ok(Json(body).into_response())
}

/// A choice read to its end.
struct Collected {
    text: String,
    finish: FinishReason,
    usage: Usage,
    /// Its tokens' log-probabilities (when asked for).
    lps: Vec<TokenLogprob>,
    /// Its prompt's scores (when asked for).
    prompt: Option<stream::PromptScores>,
    /// The stop string that ended it.
    stop: Option<String>,
}

/// Reads a choice to its end.
async fn collect(
    (mut stream, first): (RequestStream, Option<Event>),
) -> Result<Collected, ApiError> {
    let mut text = String::new();
    let mut lps = Vec::new();
    let mut prompt = None;
    let mut next = first;
    if next.is_none() {
        next = stream.next().await;
    }
    while let Some(e) = next {
        match e {
            Event::Text {
                text: t, logprobs, ..
            } => {
                text.push_str(&t);
                lps.extend(logprobs);
            }
            Event::Prompt { first, logprobs } => prompt = Some((first, logprobs)),
            Event::Done {
                finish_reason,
                usage,
                error,
                stop,
            } => {
                if let Some(e) = error {
                    return Err(ApiError::from_runtime(&e));
                }
                return Ok(Collected {
                    text,
                    finish: finish_reason,
                    usage,
                    lps,
                    prompt,
                    stop,
                });
            }
        }
        next = stream.next().await;
    }
    Err(ApiError::from_runtime(
        &siliceo_runtime::RuntimeError::Stopped,
    ))
}

/// OpenAI's `usage` object.
pub(crate) fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    })
}

/// OpenAI's name for a finish reason. A cancelled request (its deadline
/// passed) ends as `length` would: cut short, not stopped by the model.
pub(crate) fn finish_name(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length | FinishReason::Cancelled => "length",
        FinishReason::Error => "error",
    }
}

/// A request id unique within this process and across restarts.
pub(crate) fn uuid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!("{t:x}{n:04x}")
}

/// `input` of `/v1/embeddings`: one text or several, or token ids (one
/// input or several), as OpenAI's API takes them.
#[derive(Debug, serde::Deserialize)]
#[serde(
    untagged,
    expecting = "a string, an array of strings, an array of token ids, or an array of arrays of token ids"
)]
enum WireEmbedInput {
    One(String),
    Many(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, serde::Deserialize)]
struct EmbedRequest {
    input: WireEmbedInput,
    model: Option<String>,
    encoding_format: Option<String>,
    dimensions: Option<u32>,
    /// Extension: cut inputs longer than the model's context instead of 400.
    #[serde(default, deserialize_with = "openai::or_default")]
    truncate: bool,
}

fn embedder(s: &AppState) -> Result<&EmbeddingService, ApiError> {
    s.embeddings.as_deref().ok_or_else(|| {
        ApiError::invalid(
            "model",
            "this server has no embedding model; start it with --embedding-model PATH \
             (`cargo xtask fetch-model --embed` fetches all-MiniLM-L6-v2)",
        )
    })
}

fn check_embed_model(e: &EmbeddingService, asked: Option<&str>) -> Result<(), ApiError> {
    let mut served = vec![e.info().model_name.clone()];
    served.extend(
        e.info()
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned()),
    );
    openai::check_model(asked, &served)
}

async fn embeddings(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let r: EmbedRequest = parse(body, s.max_request_bytes)?;
    let e = embedder(&s)?;
    check_embed_model(e, r.model.as_deref())?;
    let base64 = match r.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("`{other}` is not `float` or `base64`"),
            ));
        }
    };
    if r.dimensions.is_some_and(|d| d as usize != e.info().dim) {
        return Err(ApiError::invalid(
            "dimensions",
            format!("this model gives {} dimensions", e.info().dim),
        ));
    }
    let ids = |v: Vec<u32>| EmbedInput::Tokens(v.into_iter().map(TokenId).collect());
    let inputs: Vec<EmbedInput> = match r.input {
        WireEmbedInput::One(t) => vec![EmbedInput::Text(t)],
        WireEmbedInput::Many(v) => v.into_iter().map(EmbedInput::Text).collect(),
        WireEmbedInput::Tokens(v) => vec![ids(v)],
        WireEmbedInput::TokenLists(v) => v.into_iter().map(ids).collect(),
    };
    let out = e
        .embed_inputs(inputs, true, r.truncate)
        .await
        .map_err(|e| named(e, "input"))?;
    let data: Vec<Value> = out
        .vectors
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = if base64 {
                // Little-endian f32s, as OpenAI sends them.
                use base64::Engine as _;
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": e.info().model_name,
        "usage": {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens},
    })))
}

/// The runtime names gRPC's fields (`inputs`); OpenAI's is `input`.
/// A runtime's complaint about a request, in the terms of this endpoint's
/// body: the runtime's field (`inputs`, `ids`, `text`) becomes `to`.
fn named(e: RuntimeError, to: &'static str) -> ApiError {
    ApiError::from_runtime(&match e {
        RuntimeError::InvalidRequest { reason, .. } => {
            RuntimeError::InvalidRequest { field: to, reason }
        }
        other => other,
    })
}

#[derive(Debug, serde::Deserialize)]
struct RerankRequest {
    query: String,
    documents: Vec<String>,
    model: Option<String>,
    top_n: Option<usize>,
    #[serde(default, deserialize_with = "openai::or_default")]
    return_documents: bool,
    #[serde(default, deserialize_with = "openai::or_default")]
    truncate: bool,
}

async fn rerank(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let r: RerankRequest = parse(body, s.max_request_bytes)?;
    let e = embedder(&s)?;
    check_embed_model(e, r.model.as_deref())?;
    if r.query.trim().is_empty() {
        return Err(ApiError::invalid("query", "must not be empty"));
    }
    let docs = r.return_documents.then(|| r.documents.clone());
    let out = e
        .rerank(r.query, r.documents, r.top_n.unwrap_or(0), r.truncate)
        .await
        .map_err(|e| ApiError::from_runtime(&e))?;
    let results: Vec<Value> = out
        .ranked
        .into_iter()
        .map(|(index, score)| {
            let mut v = json!({"index": index, "relevance_score": score});
            if let Some(d) = &docs {
                v["document"] = json!({"text": d[index]});
            }
            v
        })
        .collect();
    Ok(Json(json!({
        "id": format!("rerank-{}", uuid_like()),
        "model": e.info().model_name,
        "results": results,
        "usage": {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens},
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowed_origins_are_origins_or_star() {
        let list =
            |v: &[&str]| AllowOrigins::parse(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(list(&[]), Ok(AllowOrigins::None));
        assert_eq!(list(&["http://a.example", "*"]), Ok(AllowOrigins::Any));
        assert_eq!(
            list(&["http://localhost:3000", "https://app.example"]),
            Ok(AllowOrigins::List(vec![
                HeaderValue::from_static("http://localhost:3000"),
                HeaderValue::from_static("https://app.example"),
            ]))
        );
        for bad in [
            "http://localhost:3000/",
            "localhost:3000",
            "https://",
            "http://a b\n",
            "ftp://x",
        ] {
            let e = list(&[bad]).unwrap_err();
            assert!(e.contains("is not an origin"), "{bad}: {e}");
        }
        assert!(AllowOrigins::None.layer().is_none());
        assert!(AllowOrigins::Any.layer().is_some());
    }
}
