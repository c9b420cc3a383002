//! The serving loop of siliceo-infer.
//!
//! [`Runtime::start`] spawns one engine thread that owns the model, its one
//! llama.cpp context (unified KV cache) and the [`Scheduler`]. Requests arrive
//! through a channel ([`Runtime::submit`]); each gets a [`RequestStream`] of
//! [`Event`]s: text pieces as tokens are sampled (valid UTF-8, stop strings held
//! back), then one [`Event::Done`] with the finish reason and [`Usage`]. Every
//! engine step runs the decode tokens of all running sequences and chunks of
//! pending prompts in one `decode` call, as the scheduler plans.
//!
//! Dropping a stream cancels its request; its KV is freed in the same step.
//! Preempted sequences are swapped to host memory (llama.cpp's per-sequence
//! state) or recomputed, and continue with the same sampler, so their output
//! does not change.
//!
//! Prompt prefixes are cached in full blocks and reused across requests: the
//! cells of a cached block stay tagged by a request's sequence while it runs
//! and by a *holder* sequence after it ends; a hit tags them into the new
//! request's sequence (`seq_cp`), an eviction untags them (`seq_rm`). See
//! `holders.rs` and [`Runtime::check_kv`].
//!
//! ```no_run
//! use siliceo_runtime::{Event, GenerateRequest, Input, Runtime, RuntimeConfig};
//!
//! let rt = Runtime::start(RuntimeConfig::new("models/SmolLM2-135M-Instruct.Q4_1.gguf"))?;
//! let mut stream = rt.submit(GenerateRequest::new(Input::Prompt("The sky is".into())))?;
//! while let Some(event) = stream.blocking_next() {
//!     match event {
//!         Event::Text { text, .. } => print!("{text}"),
//!         Event::Done { finish_reason, usage, .. } => println!("\n[{finish_reason}, {} tokens]", usage.completion_tokens),
//!         // Only with `GenerateRequest::prompt_logprobs`.
//!         Event::Prompt { .. } => {}
//!     }
//! }
//! # Ok::<(), siliceo_runtime::RuntimeError>(())
//! ```
//!
//! **Architecture invariant:** knows nothing of gRPC; the server crate adapts
//! it to the wire.
#![deny(missing_docs)]

pub mod embeddings;
mod engine_loop;
mod front;
pub mod hf_tokenizer;
pub mod kv_events;
pub mod metrics;
pub mod synth;
mod think_budget;
mod types;

pub use types::{
    Event, GenerateRequest, Input, KvBackend, MAX_TOP_LOGPROBS, RequestStream, RuntimeConfig,
    RuntimeError, RuntimeInfo, RuntimeStats, SchedulerLoad, SpeculativeConfig, TokenLogprob, Usage,
};

pub use engine_loop::{
    WindowedPools, plan_windowed_store, store_plan, store_split, windowed_pools,
};
pub use siliceo_chat::{
    CallParser, CallPiece, ChatEnd, ChatTemplate, HarmonyReader, Message, OutputRouter,
    ParsedOutput, Routed, Split, THINK_CLOSE, THINK_OPEN, ThinkSplitter, ThinkTags, Tool, ToolCall,
    ToolChoice, ToolSyntax, checked_tools,
};
pub use siliceo_kv_paging::planner::{StorePlan, StoreSize, StoreSplit};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

use crossbeam_channel::Sender;
use front::Front;
use metrics::Metrics;
use siliceo_core::{ModelGeometry, RequestId, TokenId};

pub use embeddings::{
    EmbedInput, EmbedResult, EmbeddingConfig, EmbeddingInfo, EmbeddingService, RerankMethod,
    RerankResult,
};
pub use siliceo_engine::Pooling;
pub use siliceo_scheduler::{Rejected, Scheduler};

/// Hears whether a submitted request was queued (its prompt's token count)
/// or refused.
pub(crate) type Accepted = tokio::sync::oneshot::Sender<Result<u32, RuntimeError>>;

/// A request on its way to the engine thread: rendered, tokenized, checked
/// and its constraint compiled by the request layer ([`front`]).
pub(crate) struct Submission {
    pub(crate) req: GenerateRequest,
    /// The prompt's token ids (`req.input` is spent).
    pub(crate) tokens: Vec<TokenId>,
    pub(crate) id: RequestId,
    pub(crate) tx: tokio::sync::mpsc::UnboundedSender<Event>,
    pub(crate) accepted: Option<Accepted>,
    pub(crate) matcher: Option<siliceo_constrain::Matcher>,
    /// What `min_tokens` bans until then.
    pub(crate) banned: Vec<TokenId>,
    /// Its thinking budget, where one applies.
    pub(crate) think: Option<think_budget::ThinkBudget>,
    /// Control tokens its output renders as text.
    pub(crate) preserved: Arc<[TokenId]>,
    /// When the caller submitted it (queue time and TTFT count from here).
    pub(crate) submitted: std::time::Instant,
}

pub(crate) enum Command {
    Submit(Box<Submission>),
    Cancel(RequestId, Option<crossbeam_channel::Sender<bool>>),
    Stats(crossbeam_channel::Sender<RuntimeStats>),
    CheckKv(crossbeam_channel::Sender<Result<(), String>>),
    CancelAll,
    Shutdown,
}

/// A running engine thread. Dropping it shuts the thread down (in-flight
/// requests end as cancelled).
#[derive(Debug)]
pub struct Runtime {
    tx: Sender<Command>,
    thread: Option<JoinHandle<()>>,
    info: RuntimeInfo,
    front: Arc<Front>,
    next_id: AtomicU64,
    metrics: Arc<Metrics>,
    kv_events: Arc<kv_events::KvEventHub>,
    /// When the generation rate was last sampled, the tokens generated by
    /// then, and the rate measured.
    rate: std::sync::Mutex<(std::time::Instant, u64, f64)>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Submit(s) => write!(f, "Submit({})", s.id),
            Command::Cancel(id, _) => write!(f, "Cancel({id})"),
            Command::Stats(_) => f.write_str("Stats"),
            Command::CheckKv(_) => f.write_str("CheckKv"),
            Command::CancelAll => f.write_str("CancelAll"),
            Command::Shutdown => f.write_str("Shutdown"),
        }
    }
}

impl Runtime {
    /// Loads the model on a new engine thread and waits until it is ready.
    pub fn start(cfg: RuntimeConfig) -> Result<Runtime, RuntimeError> {
        // A template given in place of the GGUF's must compile, before the
        // model loads.
        let chat_template = cfg.chat_template.clone();
        if let Some(src) = &chat_template {
            ChatTemplate::new(src, "", "")
                .map_err(|e| RuntimeError::Start(format!("the chat template given: {e}")))?;
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
        let thread = std::thread::Builder::new()
            .name("siliceo-engine".into())
            .spawn(move || engine_loop::run(cfg, rx, ready_tx))
            .map_err(|e| RuntimeError::Start(e.to_string()))?;
        match ready_rx.recv() {
            Ok(Ok(engine_loop::Started {
                info,
                model,
                kv_events,
            })) => {
                let front = Arc::new(Front::new(model, info.n_ctx, chat_template));
                Ok(Runtime {
                    tx,
                    thread: Some(thread),
                    info,
                    front,
                    next_id: AtomicU64::new(1),
                    metrics: Arc::new(Metrics::default()),
                    kv_events,
                    rate: std::sync::Mutex::new((std::time::Instant::now(), 0, 0.0)),
                })
            }
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(RuntimeError::Start(
                    "the engine thread exited during start-up".into(),
                ))
            }
        }
    }

    /// The model's geometry.
    pub fn geometry(&self) -> ModelGeometry {
        self.info.geometry
    }

    /// KV cells of the context (the longest sequence).
    pub fn n_ctx(&self) -> u32 {
        self.info.n_ctx
    }

    /// The names the model answers to: its file's stem, then the name in its
    /// metadata (never empty).
    pub fn model_ids(&self) -> Vec<String> {
        let info = &self.info;
        let mut ids = Vec::new();
        if let Some(stem) = info.model_path.file_stem() {
            ids.push(stem.to_string_lossy().into_owned());
        }
        if !info.model_name.is_empty() && !ids.contains(&info.model_name) {
            ids.push(info.model_name.clone());
        }
        if ids.is_empty() {
            ids.push("siliceo".into());
        }
        ids
    }

    /// The model, context and KV layout the engine runs.
    pub fn info(&self) -> &RuntimeInfo {
        &self.info
    }

    /// Tokenizes `text` with the model's tokenizer, on the caller's thread.
    pub fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<TokenId>, RuntimeError> {
        self.front.tokenize(text, add_special)
    }

    /// The prompt tokens `req` would run on, without running anything: a
    /// chat rendered with the model's template (its tools and template
    /// arguments), text tokenized with its special tokens, ids checked. Bad
    /// input is an `InvalidRequest` as [`submit`](Self::submit) gives it.
    pub fn request_tokens(&self, req: GenerateRequest) -> Result<Vec<TokenId>, RuntimeError> {
        self.front.request_tokens(req)
    }

    /// Turns token ids into text; ids outside the vocabulary are an
    /// `InvalidRequest` naming `ids`.
    pub fn detokenize(&self, tokens: &[TokenId]) -> Result<String, RuntimeError> {
        self.front.detokenize(tokens)
    }

    /// The request's id, or a new one.
    fn id_of(&self, req: &GenerateRequest) -> RequestId {
        req.id.clone().unwrap_or_else(|| {
            RequestId(format!(
                "req-{}",
                self.next_id.fetch_add(1, Ordering::Relaxed)
            ))
        })
    }

    /// Queues a request. The request layer runs here, on the caller's
    /// thread: the chat is rendered, the prompt tokenized, every limit
    /// checked and the constraint compiled, so an invalid request is an
    /// error at once (`InvalidRequest` naming the field,
    /// `ContextLengthExceeded`). What depends on the engine's state (a full
    /// queue, a duplicate id) arrives as the stream's `Done` event with an
    /// error, never as a panic.
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestStream, RuntimeError> {
        self.send(req, None)
    }

    /// Queues a request and waits until the engine has queued it (between
    /// two steps, not until it runs): a refused request is an error here,
    /// not a stream. Returns the stream and the prompt's length in tokens.
    /// Call it inside a tokio runtime: the request layer runs on its
    /// blocking pool, as in [`submit_async`](Self::submit_async).
    pub async fn submit_accepted(
        &self,
        req: GenerateRequest,
    ) -> Result<(RequestStream, u32), RuntimeError> {
        let (atx, arx) = tokio::sync::oneshot::channel();
        // Made now, so a caller dropped while waiting cancels the request.
        let stream = self.submit_from_async(req, Some(atx)).await?;
        match arx.await {
            Ok(Ok(prompt_tokens)) => Ok((stream, prompt_tokens)),
            Ok(Err(e)) => Err(e),
            // Dropped unanswered: admitting it panicked, or the engine stopped.
            Err(_) => Err(RuntimeError::Engine(
                "internal error while admitting the request".into(),
            )),
        }
    }

    /// [`submit`](Self::submit) for async callers (inside a tokio runtime):
    /// the request layer's work (templating, tokenizing a long prompt,
    /// compiling a grammar) runs on tokio's blocking pool, not on the
    /// caller's worker thread.
    pub async fn submit_async(&self, req: GenerateRequest) -> Result<RequestStream, RuntimeError> {
        self.submit_from_async(req, None).await
    }

    async fn submit_from_async(
        &self,
        req: GenerateRequest,
        accepted: Option<Accepted>,
    ) -> Result<RequestStream, RuntimeError> {
        let submitted = std::time::Instant::now();
        let id = self.id_of(&req);
        let front = self.front.clone();
        let prepared = tokio::task::spawn_blocking(move || front.prepare(req))
            .await
            .unwrap_or_else(|_| {
                Err(RuntimeError::Engine(
                    "internal error while preparing the request".into(),
                ))
            });
        self.hand_over(id, submitted, prepared, accepted)
    }

    /// Both sync submits: the request layer on this thread, then the engine
    /// thread.
    fn send(
        &self,
        req: GenerateRequest,
        accepted: Option<Accepted>,
    ) -> Result<RequestStream, RuntimeError> {
        let submitted = std::time::Instant::now();
        let id = self.id_of(&req);
        let prepared = self.front.prepare(req);
        self.hand_over(id, submitted, prepared, accepted)
    }

    /// Hands a prepared request to the engine thread (or counts the
    /// request layer's refusal).
    fn hand_over(
        &self,
        id: RequestId,
        submitted: std::time::Instant,
        prepared: Result<front::Prepared, RuntimeError>,
        accepted: Option<Accepted>,
    ) -> Result<RequestStream, RuntimeError> {
        let front::Prepared {
            req,
            tokens,
            matcher,
            banned,
            think,
            preserved,
        } = prepared.inspect_err(|e| {
            self.metrics.error(e.error_kind());
            self.metrics.finished("error");
        })?;
        let (etx, erx) = tokio::sync::mpsc::unbounded_channel();
        self.tx
            .send(Command::Submit(Box::new(Submission {
                req,
                tokens,
                id: id.clone(),
                tx: etx,
                accepted,
                matcher,
                banned,
                think,
                preserved,
                submitted,
            })))
            .map_err(|_| RuntimeError::Stopped)?;
        Ok(RequestStream::new(
            id,
            erx,
            self.tx.clone(),
            self.metrics.clone(),
            submitted,
        ))
    }

    /// What the runtime and its protocol edges count (the edges add their
    /// requests by endpoint and status).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The Prometheus text exposition: [`Metrics`] and the runtime's
    /// occupancy, asked of the engine thread.
    pub fn prometheus(&self) -> String {
        self.metrics.render(self)
    }

    /// The model's chat template (`None` when it has none minijinja can
    /// render: chats then use llama.cpp's built-in guess, without tools).
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.front.chat_template()
    }

    /// Offers `req.tools` (when there are any) in the model's tool syntax,
    /// which it returns, to read the calls back with; `choice` `required`
    /// or a named function forces a call (several when `parallel`) with a
    /// grammar of the tools' schemas, set as the request's constraint.
    /// `None` without tools; an error naming `tools` when the model's
    /// template has no tool syntax siliceo knows.
    pub fn offer_tools(
        &self,
        req: &mut GenerateRequest,
        choice: &ToolChoice,
        parallel: bool,
    ) -> Result<Option<ToolSyntax>, RuntimeError> {
        if req.tools.is_empty() {
            return Ok(None);
        }
        let syntax = self
            .chat_template()
            .and_then(|t| t.tool_syntax())
            .ok_or_else(|| RuntimeError::InvalidRequest {
                field: "tools",
                reason: "the model's chat template has no tool-call syntax siliceo knows \
                         (`<tool_call>` as Qwen2.5 and Hermes write it, Qwen3-Coder's \
                         `<function=…>` XML, Mistral's `[TOOL_CALLS]`, or Llama 3's \
                         `{\"name\": …, \"parameters\": …}`)"
                    .into(),
            })?;
        if let Some(c) = syntax.constraint(&req.tools, choice, parallel) {
            req.constraint = Some(c);
            req.constraint_field = "tools";
        }
        Ok(Some(syntax))
    }

    /// Turns the template's own thinking switch (Qwen3's `enable_thinking`,
    /// DeepSeek-V3.1's `thinking`) `on` or off for `req`, when the template
    /// has one and the request's template arguments leave it unset. Returns
    /// whether it had one.
    pub fn switch_thinking(&self, req: &mut GenerateRequest, on: bool) -> bool {
        let switch = self.chat_template().and_then(ChatTemplate::thinking_switch);
        if let Some(name) = switch {
            req.chat_template_kwargs.entry(name).or_insert(on.into());
        }
        switch.is_some()
    }

    /// Whether a chat's output holds a reasoning model's thinking to split
    /// off (`Some(open)`, `open` when the prompt opened the block). Not when
    /// the prompt opened the block and a constraint that writes the
    /// thinking itself holds the output from its first token (other
    /// constraints follow the thinking).
    pub fn thinking(&self, req: &GenerateRequest) -> Option<bool> {
        self.front.thinking(req)
    }

    /// The tags the model thinks in (`<think>`, or `[THINK]` for Mistral's
    /// reasoning models), for splitting its output.
    pub fn think_tags(&self) -> ThinkTags {
        self.front.think_tags()
    }

    /// Cancels a request by id; its KV is free when this returns. Returns
    /// false when no such request is queued or running.
    pub fn cancel(&self, id: &RequestId) -> Result<bool, RuntimeError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.tx
            .send(Command::Cancel(id.clone(), Some(tx)))
            .map_err(|_| RuntimeError::Stopped)?;
        rx.recv().map_err(|_| RuntimeError::Stopped)
    }

    /// Cancels every queued and running request (their streams end with
    /// `Cancelled`); the engine keeps serving new ones.
    pub fn cancel_all(&self) {
        let _ = self.tx.send(Command::CancelAll);
    }

    /// Queue, running and KV occupancy, asked of the engine thread.
    pub fn stats(&self) -> Result<RuntimeStats, RuntimeError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.tx
            .send(Command::Stats(tx))
            .map_err(|_| RuntimeError::Stopped)?;
        rx.recv().map_err(|_| RuntimeError::Stopped)
    }

    /// The load a gateway polls (`/v1/loads`, gRPC `GetLoads`), asked of
    /// the engine thread. The generation rate is measured over the time
    /// since the rate was last measured, at least a second.
    pub fn load(&self) -> Result<SchedulerLoad, RuntimeError> {
        let s = self.stats()?;
        let generated = self.metrics.generated_tokens.load(Ordering::Relaxed);
        let gen_throughput = {
            let mut r = self.rate.lock().unwrap_or_else(|p| p.into_inner());
            let secs = r.0.elapsed().as_secs_f64();
            if secs >= 1.0 {
                *r = (
                    std::time::Instant::now(),
                    generated,
                    generated.saturating_sub(r.1) as f64 / secs,
                );
            }
            r.2
        };
        let block = u64::from(self.info.block_size);
        let max_running = self.info.max_running_seqs.max(1);
        Ok(SchedulerLoad {
            num_running_reqs: s.running as u32,
            num_waiting_reqs: s.waiting as u32,
            num_total_reqs: (s.running + s.waiting) as u32,
            num_used_tokens: s.kv_used_blocks as u64 * block,
            max_total_num_tokens: u64::from(self.info.kv_blocks) * block,
            token_usage: s.kv_usage(),
            gen_throughput,
            cache_hit_rate: s.prefix_hit_rate(),
            utilization: s.running as f64 / f64::from(max_running),
            max_running_requests: max_running,
        })
    }

    /// The prefix cache's published events (see [`kv_events`]).
    pub fn kv_events(&self) -> &Arc<kv_events::KvEventHub> {
        &self.kv_events
    }

    /// The model's tokenizer as Hugging Face files, made from the GGUF's
    /// vocabulary (see [`hf_tokenizer`]); reads the file's header.
    pub fn tokenizer_files(&self) -> Result<hf_tokenizer::TokenizerExport, RuntimeError> {
        let fail = |e: String| RuntimeError::Engine(format!("tokenizer export: {e}"));
        let header = read_gguf_header(&self.info.model_path).map_err(fail)?;
        hf_tokenizer::hf_tokenizer_files(&header, self.info.n_ctx).map_err(fail)
    }

    /// Checks, between steps, that llama.cpp's KV cells agree with the block
    /// accounting (request and holder sequences, cached blocks); returns what
    /// disagrees. For tests and debugging.
    pub fn check_kv(&self) -> Result<(), String> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.tx
            .send(Command::CheckKv(tx))
            .map_err(|_| RuntimeError::Stopped.to_string())?;
        rx.recv().map_err(|_| RuntimeError::Stopped.to_string())?
    }

    /// Stops the engine thread after cancelling what is in flight.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.tx.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads a GGUF file's header (metadata and tensor table), reading more of
/// the file until it is whole.
pub fn read_gguf_header(
    path: &std::path::Path,
) -> Result<siliceo_kv_paging::gguf::GgufHeader, String> {
    read_gguf_header_bytes(path).map(|(h, _)| h)
}

/// [`read_gguf_header`], with the file's first bytes that hold the header
/// (to copy entries from it whole).
pub fn read_gguf_header_bytes(
    path: &std::path::Path,
) -> Result<(siliceo_kv_paging::gguf::GgufHeader, Vec<u8>), String> {
    use siliceo_kv_paging::gguf::{GgufError, GgufHeader};
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut buf = Vec::new();
    let mut want = 8 << 20;
    loop {
        let have = buf.len();
        (&mut file)
            .take((want - have) as u64)
            .read_to_end(&mut buf)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        match GgufHeader::parse(&buf) {
            Err(GgufError::Truncated { needed }) if buf.len() > have => want = needed.max(want * 2),
            r => {
                return r
                    .map(|h| (h, buf))
                    .map_err(|e| format!("{}: {e}", path.display()));
            }
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.stop();
    }
}
