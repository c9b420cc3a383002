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
mod types;

pub use types::{
    Event, GenerateRequest, Input, KvBackend, MAX_TOP_LOGPROBS, RequestStream, RuntimeConfig,
    RuntimeError, RuntimeInfo, RuntimeStats, SpeculativeConfig, TokenLogprob, Usage,
};

pub use engine_loop::store_plan;
pub use siliceo_chat::{Message, Tool, ToolCall, ToolChoice, ToolSyntax};
pub use siliceo_kv_paging::planner::{StorePlan, StoreSize};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

use crossbeam_channel::Sender;
use siliceo_chat::{ChatError, ChatTemplate};
use siliceo_constrain::Grammars;
use siliceo_core::{ModelGeometry, RequestId, TokenId};

pub use embeddings::{
    EmbedResult, EmbeddingConfig, EmbeddingInfo, EmbeddingService, RerankMethod, RerankResult,
};
pub use siliceo_engine::Pooling;
pub use siliceo_scheduler::Scheduler;

/// Hears whether a submitted request was queued (its prompt's token count)
/// or refused.
pub(crate) type Accepted = tokio::sync::oneshot::Sender<Result<u32, RuntimeError>>;

/// A request on its way to the engine thread, its constraint compiled.
pub(crate) struct Submission {
    pub(crate) req: GenerateRequest,
    pub(crate) id: RequestId,
    pub(crate) tx: tokio::sync::mpsc::UnboundedSender<Event>,
    pub(crate) accepted: Option<Accepted>,
    pub(crate) matcher: Option<siliceo_constrain::Matcher>,
}

pub(crate) enum Command {
    Submit(Box<Submission>),
    Cancel(RequestId, Option<crossbeam_channel::Sender<bool>>),
    Tokenize(
        String,
        bool,
        crossbeam_channel::Sender<Result<Vec<siliceo_core::TokenId>, RuntimeError>>,
    ),
    Detokenize(
        Vec<siliceo_core::TokenId>,
        crossbeam_channel::Sender<Result<String, RuntimeError>>,
    ),
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
    grammars: Arc<Grammars>,
    chat: Option<Chat>,
    next_id: AtomicU64,
}

/// The model's chat template, compiled for rendering on submitting threads.
#[derive(Debug)]
struct Chat {
    template: ChatTemplate,
    /// Tokenizing adds a BOS: a BOS the template prints is dropped.
    adds_bos: bool,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Submit(s) => write!(f, "Submit({})", s.id),
            Command::Cancel(id, _) => write!(f, "Cancel({id})"),
            Command::Tokenize(..) => f.write_str("Tokenize"),
            Command::Detokenize(..) => f.write_str("Detokenize"),
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
        let (tx, rx) = crossbeam_channel::unbounded();
        let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
        let thread = std::thread::Builder::new()
            .name("siliceo-engine".into())
            .spawn(move || engine_loop::run(cfg, rx, ready_tx))
            .map_err(|e| RuntimeError::Start(e.to_string()))?;
        match ready_rx.recv() {
            Ok(Ok(engine_loop::Started {
                info,
                grammars,
                chat,
            })) => {
                let chat = chat.and_then(|c| {
                    match ChatTemplate::new(&c.source, &c.bos, &c.eos) {
                        Ok(template) => Some(Chat {
                            template,
                            adds_bos: c.adds_bos,
                        }),
                        Err(e) => {
                            // llama.cpp's built-in templates still serve plain chats.
                            tracing::warn!(error = %e, "chat template not usable: chats fall back to llama.cpp's template guess, without tools");
                            None
                        }
                    }
                });
                Ok(Runtime {
                    tx,
                    thread: Some(thread),
                    info,
                    grammars,
                    chat,
                    next_id: AtomicU64::new(1),
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

    /// The model, context and KV layout the engine runs.
    pub fn info(&self) -> &RuntimeInfo {
        &self.info
    }

    /// Tokenizes `text` with the model's tokenizer (on the engine thread,
    /// between steps).
    pub fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<TokenId>, RuntimeError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.tx
            .send(Command::Tokenize(text.to_string(), add_special, tx))
            .map_err(|_| RuntimeError::Stopped)?;
        rx.recv().map_err(|_| RuntimeError::Stopped)?
    }

    /// Turns token ids into text; ids outside the vocabulary are an
    /// `InvalidRequest` naming `ids`.
    pub fn detokenize(&self, tokens: &[TokenId]) -> Result<String, RuntimeError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.tx
            .send(Command::Detokenize(tokens.to_vec(), tx))
            .map_err(|_| RuntimeError::Stopped)?;
        rx.recv().map_err(|_| RuntimeError::Stopped)?
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

    /// Queues a request. Its chat is rendered and its constraint compiled
    /// here, on the caller's thread: a chat the template refuses or an
    /// invalid constraint is an `InvalidRequest` error at once. The engine
    /// thread's validation errors (empty prompt, too long, bad sampling
    /// values, unknown tokens, full queue) arrive as the stream's `Done`
    /// event with an error, never as a panic.
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestStream, RuntimeError> {
        self.send(req, None)
    }

    /// Queues a request and waits until the engine has validated, tokenized
    /// and queued it (between two steps, not until it runs): a refused
    /// request is an error here, not a stream. Returns the stream and the
    /// prompt's length in tokens.
    pub async fn submit_accepted(
        &self,
        req: GenerateRequest,
    ) -> Result<(RequestStream, u32), RuntimeError> {
        let (atx, arx) = tokio::sync::oneshot::channel();
        // Made now, so a caller dropped while waiting cancels the request.
        let stream = self.send(req, Some(atx))?;
        match arx.await {
            Ok(Ok(prompt_tokens)) => Ok((stream, prompt_tokens)),
            Ok(Err(e)) => Err(e),
            // Dropped unanswered: admitting it panicked, or the engine stopped.
            Err(_) => Err(RuntimeError::Engine(
                "internal error while admitting the request".into(),
            )),
        }
    }

    /// Both submits: renders the chat and compiles the constraint here, then
    /// hands the request to the engine thread.
    fn send(
        &self,
        req: GenerateRequest,
        accepted: Option<Accepted>,
    ) -> Result<RequestStream, RuntimeError> {
        let id = self.id_of(&req);
        let req = self.render(req)?;
        let matcher = self.compile(&req)?;
        let (etx, erx) = tokio::sync::mpsc::unbounded_channel();
        self.tx
            .send(Command::Submit(Box::new(Submission {
                req,
                id: id.clone(),
                tx: etx,
                accepted,
                matcher,
            })))
            .map_err(|_| RuntimeError::Stopped)?;
        Ok(RequestStream::new(id, erx, self.tx.clone()))
    }

    /// The model's chat template (`None` when it has none minijinja can
    /// render: chats then use llama.cpp's built-in guess, without tools).
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat.as_ref().map(|c| &c.template)
    }

    /// Renders a chat request's messages and tools with the model's
    /// template, on the caller's thread; the engine thread only tokenizes.
    fn render(&self, mut req: GenerateRequest) -> Result<GenerateRequest, RuntimeError> {
        let invalid = |field, reason: String| RuntimeError::InvalidRequest { field, reason };
        let Input::Chat(msgs) = &req.input else {
            if !req.tools.is_empty() {
                return Err(invalid("tools", "tools need chat messages".into()));
            }
            return Ok(req);
        };
        if msgs.is_empty() {
            return Err(invalid("chat", "no messages".into()));
        }
        let Some(chat) = &self.chat else {
            let tool_turns = msgs
                .iter()
                .any(|m| !m.tool_calls.is_empty() || m.role == "tool");
            if !req.tools.is_empty() || tool_turns {
                return Err(invalid(
                    "tools",
                    "the model has no chat template siliceo can render with tools".into(),
                ));
            }
            return Ok(req);
        };
        let text = chat
            .template
            .render(msgs, &req.tools, true)
            .map_err(|e| match e {
                ChatError::NoToolSyntax => invalid("tools", e.to_string()),
                other => invalid("chat", other.to_string()),
            })?;
        // Tokenizing puts the BOS back where the model wants one.
        let bos = chat.template.bos();
        let text = match text.strip_prefix(bos) {
            Some(rest) if chat.adds_bos && !bos.is_empty() => rest.to_string(),
            _ => text,
        };
        if text.is_empty() {
            return Err(invalid("chat", "the chat template rendered nothing".into()));
        }
        req.input = Input::Prompt(text);
        Ok(req)
    }

    /// Compiles a request's constraint on the caller's thread (the engine
    /// thread only follows it). An invalid one names the request's
    /// `constraint_field`.
    fn compile(
        &self,
        req: &GenerateRequest,
    ) -> Result<Option<siliceo_constrain::Matcher>, RuntimeError> {
        let Some(c) = &req.constraint else {
            return Ok(None);
        };
        let field = req.constraint_field;
        let invalid = |reason: String| RuntimeError::InvalidRequest { field, reason };
        c.validate(field).map_err(|e| match e {
            siliceo_core::Error::InvalidParameter { reason, .. } => invalid(reason),
            other => invalid(other.to_string()),
        })?;
        match self.grammars.compile(c) {
            Ok(m) => Ok(Some(m)),
            Err(siliceo_constrain::ConstraintError::Invalid(reason)) => Err(invalid(reason)),
            Err(e) => Err(RuntimeError::Engine(e.to_string())),
        }
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

impl Drop for Runtime {
    fn drop(&mut self) {
        self.stop();
    }
}
