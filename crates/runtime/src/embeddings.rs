//! The embedding service: an embedding model on its own thread, next to the
//! generation engine (embedding traffic never waits behind generation steps,
//! and generation never waits behind it, apart from sharing the CPU).
//!
//! Requests queue on a bounded channel. The thread takes one, then every other
//! request already waiting (up to the batch limits), and runs all their inputs
//! through llama.cpp together: many clients sending one text each are batched
//! like one client sending many. A request whose caller has gone (cancelled,
//! disconnected) is dropped before it runs. A panic while embedding fails the
//! requests of that batch and the thread goes on.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam_channel::{Receiver, Sender, TrySendError};
use siliceo_core::TokenId;
use siliceo_engine::{
    Embedder, EmbedderOptions, EngineError, Model, ModelOptions, Pooling, cosine,
};
use tokio::sync::oneshot;

use crate::RuntimeError;

/// Configuration of the embedding service.
#[derive(Debug, Clone)]
pub struct EmbeddingConfig {
    /// The embedding (or cross-encoder reranker) GGUF.
    pub model: PathBuf,
    /// Tokens per llama.cpp batch (default 2048).
    pub batch_tokens: u32,
    /// Inputs per llama.cpp batch (default 64).
    pub max_batch_inputs: u32,
    /// Inputs one request may carry (default 1024).
    pub max_request_inputs: usize,
    /// Requests waiting at most; more get `queue_full` (default 256).
    pub max_queue: usize,
    /// Threads (default: all cores).
    pub threads: Option<u32>,
}

impl EmbeddingConfig {
    /// Defaults for `model`.
    pub fn new(model: impl Into<PathBuf>) -> Self {
        EmbeddingConfig {
            model: model.into(),
            batch_tokens: 2048,
            max_batch_inputs: 64,
            max_request_inputs: 1024,
            max_queue: 256,
            threads: None,
        }
    }
}

/// Vectors for an [`EmbeddingService::embed`] call.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbedResult {
    /// One vector per input, in order.
    pub vectors: Vec<Vec<f32>>,
    /// Tokens of all inputs (special tokens included, after truncation).
    pub prompt_tokens: u32,
}

/// How a reranking was scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RerankMethod {
    /// The model's classification head over (query, document) pairs.
    CrossEncoder,
    /// Cosine similarity of the query's and each document's embeddings.
    Cosine,
}

impl RerankMethod {
    /// `cross-encoder` or `cosine`.
    pub fn as_str(self) -> &'static str {
        match self {
            RerankMethod::CrossEncoder => "cross-encoder",
            RerankMethod::Cosine => "cosine",
        }
    }
}

/// Scores of an [`EmbeddingService::rerank`] call.
#[derive(Debug, Clone, PartialEq)]
pub struct RerankResult {
    /// (document index, score), best first.
    pub ranked: Vec<(usize, f32)>,
    /// How the scores were computed.
    pub method: RerankMethod,
    /// Tokens run through the model.
    pub prompt_tokens: u32,
}

/// What the embedding model is.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingInfo {
    /// The model's name.
    pub model_name: String,
    /// Its file.
    pub path: PathBuf,
    /// Output width (1 for a cross-encoder).
    pub dim: usize,
    /// Tokens one input may have.
    pub max_tokens: u32,
    /// Mean, CLS, last or rank pooling.
    pub pooling: Pooling,
}

/// Counters of the embedding service.
#[derive(Debug, Default)]
pub struct EmbeddingStats {
    /// Requests answered (embed and rerank).
    pub requests: AtomicU64,
    /// Inputs run through the model.
    pub inputs: AtomicU64,
    /// llama.cpp batches run.
    pub batches: AtomicU64,
    /// Requests dropped because their caller had gone.
    pub abandoned: AtomicU64,
    /// Panics caught.
    pub panics: AtomicU64,
}

/// One input to embed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EmbedInput {
    /// Text, tokenized with the model's special tokens (`[CLS] … [SEP]`).
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<TokenId>),
}

enum Outcome {
    Embed(EmbedResult),
    Rerank(RerankResult),
}

enum Job {
    Embed {
        inputs: Vec<EmbedInput>,
        normalize: bool,
        truncate: bool,
        reply: oneshot::Sender<Result<EmbedResult, RuntimeError>>,
    },
    Rerank {
        query: String,
        documents: Vec<String>,
        top_n: usize,
        truncate: bool,
        reply: oneshot::Sender<Result<RerankResult, RuntimeError>>,
    },
}

impl Job {
    fn abandoned(&self) -> bool {
        match self {
            Job::Embed { reply, .. } => reply.is_closed(),
            Job::Rerank { reply, .. } => reply.is_closed(),
        }
    }
    fn fail(self, e: RuntimeError) {
        match self {
            Job::Embed { reply, .. } => drop(reply.send(Err(e))),
            Job::Rerank { reply, .. } => drop(reply.send(Err(e))),
        }
    }
    fn answer(self, out: Result<Outcome, RuntimeError>) {
        match (self, out) {
            (Job::Embed { reply, .. }, Ok(Outcome::Embed(r))) => drop(reply.send(Ok(r))),
            (Job::Rerank { reply, .. }, Ok(Outcome::Rerank(r))) => drop(reply.send(Ok(r))),
            (job, Err(e)) => job.fail(e),
            (job, Ok(_)) => job.fail(RuntimeError::Engine(
                "internal: mismatched embedding outcome".into(),
            )),
        }
    }
    fn inputs(&self) -> usize {
        match self {
            Job::Embed { inputs, .. } => inputs.len(),
            Job::Rerank { documents, .. } => documents.len() + 1,
        }
    }
}

/// The embedding model on its own thread.
#[derive(Debug)]
pub struct EmbeddingService {
    tx: Sender<Job>,
    info: EmbeddingInfo,
    cfg: EmbeddingConfig,
    stats: Arc<EmbeddingStats>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl EmbeddingService {
    /// Loads the model on a new thread; returns once it is ready (or failed).
    pub fn start(cfg: EmbeddingConfig) -> Result<EmbeddingService, RuntimeError> {
        let (tx, rx) = crossbeam_channel::bounded::<Job>(cfg.max_queue.max(1));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let stats = Arc::new(EmbeddingStats::default());
        let (c, s) = (cfg.clone(), stats.clone());
        let thread = std::thread::Builder::new()
            .name("siliceo-embed".into())
            .spawn(move || worker(c, rx, s, ready_tx))
            .map_err(|e| RuntimeError::Start(format!("cannot spawn the embedding thread: {e}")))?;
        let info = ready_rx
            .recv()
            .map_err(|_| RuntimeError::Start("the embedding thread died while loading".into()))??;
        Ok(EmbeddingService {
            tx,
            info,
            cfg,
            stats,
            thread: Some(thread),
        })
    }

    /// What the model is.
    pub fn info(&self) -> &EmbeddingInfo {
        &self.info
    }

    /// Counters.
    pub fn stats(&self) -> &EmbeddingStats {
        &self.stats
    }

    fn check_texts<'a>(
        &self,
        field: &'static str,
        texts: impl Iterator<Item = &'a String>,
    ) -> Result<(), RuntimeError> {
        for (i, t) in texts.enumerate() {
            if t.contains('\0') {
                return Err(RuntimeError::InvalidRequest {
                    field,
                    reason: format!("input {i} contains a NUL byte"),
                });
            }
        }
        Ok(())
    }

    fn submit(&self, job: Job) -> Result<(), RuntimeError> {
        self.tx.try_send(job).map_err(|e| match e {
            // Its queue holds `max_queue` jobs.
            TrySendError::Full(_) => RuntimeError::Rejected(
                siliceo_scheduler::Rejected::QueueFull(siliceo_core::RequestId("embedding".into())),
            ),
            TrySendError::Disconnected(_) => RuntimeError::Stopped,
        })
    }

    /// Embeds `texts`; L2-normalised when `normalize`. Inputs over the model's
    /// context are cut when `truncate`, else refused (`InvalidRequest`).
    pub async fn embed(
        &self,
        texts: Vec<String>,
        normalize: bool,
        truncate: bool,
    ) -> Result<EmbedResult, RuntimeError> {
        let inputs = texts.into_iter().map(EmbedInput::Text).collect();
        self.embed_inputs(inputs, normalize, truncate).await
    }

    /// [`embed`](Self::embed) for inputs given as text or as token ids.
    pub async fn embed_inputs(
        &self,
        inputs: Vec<EmbedInput>,
        normalize: bool,
        truncate: bool,
    ) -> Result<EmbedResult, RuntimeError> {
        if inputs.is_empty() {
            return Err(RuntimeError::InvalidRequest {
                field: "inputs",
                reason: "at least one input".into(),
            });
        }
        if inputs.len() > self.cfg.max_request_inputs {
            return Err(RuntimeError::InvalidRequest {
                field: "inputs",
                reason: format!(
                    "{} inputs; at most {} per request",
                    inputs.len(),
                    self.cfg.max_request_inputs
                ),
            });
        }
        self.check_texts(
            "inputs",
            inputs.iter().filter_map(|i| match i {
                EmbedInput::Text(t) => Some(t),
                EmbedInput::Tokens(_) => None,
            }),
        )?;
        let (reply, rx) = oneshot::channel();
        self.submit(Job::Embed {
            inputs,
            normalize,
            truncate,
            reply,
        })?;
        rx.await.map_err(|_| RuntimeError::Stopped)?
    }

    /// Scores `documents` against `query`, best first (the `top_n` best; 0 = all).
    pub async fn rerank(
        &self,
        query: String,
        documents: Vec<String>,
        top_n: usize,
        truncate: bool,
    ) -> Result<RerankResult, RuntimeError> {
        if documents.is_empty() {
            return Err(RuntimeError::InvalidRequest {
                field: "documents",
                reason: "at least one document".into(),
            });
        }
        if documents.len() >= self.cfg.max_request_inputs {
            return Err(RuntimeError::InvalidRequest {
                field: "documents",
                reason: format!(
                    "{} documents; at most {} per request",
                    documents.len(),
                    self.cfg.max_request_inputs - 1
                ),
            });
        }
        self.check_texts("query", std::iter::once(&query))?;
        self.check_texts("documents", documents.iter())?;
        let (reply, rx) = oneshot::channel();
        self.submit(Job::Rerank {
            query,
            documents,
            top_n,
            truncate,
            reply,
        })?;
        rx.await.map_err(|_| RuntimeError::Stopped)?
    }
}

impl Drop for EmbeddingService {
    fn drop(&mut self) {
        // Closing the channel ends the worker once the queue is drained.
        let (tx, _) = crossbeam_channel::bounded(1);
        drop(std::mem::replace(&mut self.tx, tx));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn engine_err(e: EngineError) -> RuntimeError {
    match e {
        EngineError::PromptTooLong { tokens, n_ctx } => RuntimeError::InvalidRequest {
            field: "inputs",
            reason: format!(
                "an input has {tokens} tokens; the model takes {n_ctx} (set truncate to cut it)"
            ),
        },
        EngineError::Tokenize(m) => RuntimeError::InvalidRequest {
            field: "inputs",
            reason: m,
        },
        e @ EngineError::InvalidToken { .. } => RuntimeError::InvalidRequest {
            field: "inputs",
            reason: e.to_string(),
        },
        other => RuntimeError::Engine(other.to_string()),
    }
}

fn worker(
    cfg: EmbeddingConfig,
    rx: Receiver<Job>,
    stats: Arc<EmbeddingStats>,
    ready: std::sync::mpsc::Sender<Result<EmbeddingInfo, RuntimeError>>,
) {
    let model = match Model::load(&cfg.model, &ModelOptions::default()) {
        Ok(m) => m,
        Err(e) => {
            let _ = ready.send(Err(RuntimeError::Start(format!("embedding model: {e}"))));
            return;
        }
    };
    let opts = EmbedderOptions {
        batch_tokens: cfg.batch_tokens,
        max_inputs: cfg.max_batch_inputs,
        n_threads: cfg.threads,
    };
    let mut emb = match Embedder::new(&model, opts) {
        Ok(e) => e,
        Err(e) => {
            let _ = ready.send(Err(RuntimeError::Start(format!("embedding model: {e}"))));
            return;
        }
    };
    let info = EmbeddingInfo {
        model_name: model.name().to_string(),
        path: cfg.model.clone(),
        dim: emb.dim(),
        max_tokens: emb.max_tokens(),
        pooling: emb.pooling(),
    };
    if ready.send(Ok(info)).is_err() {
        return;
    }
    let budget = (cfg.max_batch_inputs as usize).max(1);
    while let Ok(first) = rx.recv() {
        // Everything already waiting joins this round, up to a batch's inputs.
        let mut jobs = vec![first];
        let mut inputs = jobs[0].inputs();
        while inputs < budget {
            match rx.try_recv() {
                Ok(j) => {
                    inputs += j.inputs();
                    jobs.push(j);
                }
                Err(_) => break,
            }
        }
        let (live, gone): (Vec<Job>, Vec<Job>) = jobs.into_iter().partition(|j| !j.abandoned());
        stats
            .abandoned
            .fetch_add(gone.len() as u64, Ordering::Relaxed);
        if live.is_empty() {
            continue;
        }
        let round = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            compute(&mut emb, &live, &stats)
        }));
        match round {
            Ok(outs) => {
                for (job, out) in live.into_iter().zip(outs) {
                    job.answer(out);
                }
            }
            Err(payload) => {
                stats.panics.fetch_add(1, Ordering::Relaxed);
                let msg = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                tracing::error!(requests = live.len(), "embedding round panicked: {msg}");
                for job in live {
                    job.fail(RuntimeError::Engine(format!(
                        "the embedding model panicked ({msg}); the service goes on"
                    )));
                }
            }
        }
    }
}

/// Tokenizes every job (bad input fails that job alone), runs all remaining
/// inputs through the model together and computes each job's answer.
fn compute(
    emb: &mut Embedder<'_>,
    jobs: &[Job],
    stats: &EmbeddingStats,
) -> Vec<Result<Outcome, RuntimeError>> {
    #[cfg(feature = "fault-injection")]
    for j in jobs {
        if let Job::Embed { inputs, .. } = j
            && inputs
                .iter()
                .any(|i| matches!(i, EmbedInput::Text(t) if t.starts_with("siliceo-fault-panic")))
        {
            panic!("fault injection: embedding panic");
        }
    }
    let cross = emb.pooling() == Pooling::Rank;
    let mut inputs: Vec<Vec<TokenId>> = Vec::new();
    // Per job: how many inputs it has and their tokens, or its error.
    let mut spans: Vec<Result<(usize, u32), RuntimeError>> = Vec::with_capacity(jobs.len());
    for job in jobs {
        let toks: Result<Vec<Vec<TokenId>>, EngineError> = match job {
            Job::Embed {
                inputs, truncate, ..
            } => inputs
                .iter()
                .map(|i| match i {
                    EmbedInput::Text(t) => emb.tokens(t, *truncate).map(|x| x.0),
                    EmbedInput::Tokens(ids) => emb.given_tokens(ids, *truncate).map(|x| x.0),
                })
                .collect(),
            Job::Rerank {
                query,
                documents,
                truncate,
                ..
            } if cross => documents
                .iter()
                .map(|d| emb.pair_tokens(query, d, *truncate).map(|x| x.0))
                .collect(),
            Job::Rerank {
                query,
                documents,
                truncate,
                ..
            } => std::iter::once(query)
                .chain(documents)
                .map(|t| emb.tokens(t, *truncate).map(|x| x.0))
                .collect(),
        };
        spans.push(match toks {
            Ok(t) => {
                let tokens = t.iter().map(|x| x.len() as u32).sum();
                let span = (t.len(), tokens);
                inputs.extend(t);
                Ok(span)
            }
            Err(e) => Err(engine_err(e)),
        });
    }
    let vectors = if inputs.is_empty() {
        Vec::new()
    } else {
        // Normalised per request below (rerank by cosine needs none).
        match emb.run(&inputs, false) {
            Ok(v) => v,
            Err(e) => {
                let e = engine_err(e);
                return jobs.iter().map(|_| Err(e.clone())).collect();
            }
        }
    };
    let total: usize = inputs.iter().map(Vec::len).sum();
    stats.batches.fetch_add(
        total.div_ceil(emb.options().batch_tokens as usize) as u64,
        Ordering::Relaxed,
    );
    stats
        .inputs
        .fetch_add(inputs.len() as u64, Ordering::Relaxed);
    // Spans are in input order: each job takes its vectors off the front.
    let mut vectors = vectors.into_iter();
    jobs.iter()
        .zip(spans)
        .map(|(job, span)| {
            let (count, tokens) = span?;
            stats.requests.fetch_add(1, Ordering::Relaxed);
            let mut vs: Vec<Vec<f32>> = vectors.by_ref().take(count).collect();
            Ok(match job {
                Job::Embed { normalize, .. } => {
                    if *normalize {
                        vs.iter_mut().for_each(|v| siliceo_engine::l2_normalize(v));
                    }
                    Outcome::Embed(EmbedResult {
                        vectors: vs,
                        prompt_tokens: tokens,
                    })
                }
                Job::Rerank { top_n, .. } => {
                    let (mut ranked, method): (Vec<(usize, f32)>, _) = if cross {
                        (
                            vs.iter().enumerate().map(|(i, v)| (i, v[0])).collect(),
                            RerankMethod::CrossEncoder,
                        )
                    } else {
                        let q = &vs[0];
                        (
                            vs[1..]
                                .iter()
                                .enumerate()
                                .map(|(i, d)| (i, cosine(q, d)))
                                .collect(),
                            RerankMethod::Cosine,
                        )
                    };
                    ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                    if *top_n > 0 {
                        ranked.truncate(*top_n);
                    }
                    Outcome::Rerank(RerankResult {
                        ranked,
                        method,
                        prompt_tokens: tokens,
                    })
                }
            })
        })
        .collect()
}
