//! Embeddings and reranking through llama.cpp: an embedding context (embeddings
//! on, the model's pooling — mean for sentence embedders, rank for
//! cross-encoders) that embeds many inputs in one batch, one sequence id each,
//! and splits what does not fit into several batches.

use std::num::NonZeroU32;

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::token::LlamaToken;
use siliceo_core::TokenId;

use crate::{EngineError, Model};

/// How the model pools token states into one output per input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// Mean of the token states (sentence embedders such as all-MiniLM).
    Mean,
    /// The first token's state.
    Cls,
    /// The last token's state.
    Last,
    /// A classification head over the first token: one relevance score per
    /// (query, document) pair (cross-encoder rerankers).
    Rank,
}

/// Options of an [`Embedder`].
#[derive(Debug, Clone)]
pub struct EmbedderOptions {
    /// Tokens per llama.cpp batch (several inputs share one); at least the
    /// model's context. Attention in an encoder batch spans the whole batch
    /// (masked per input), so memory grows with its square: 1024–2048 is sane.
    pub batch_tokens: u32,
    /// Inputs per batch at most (sequence ids).
    pub max_inputs: u32,
    /// Threads (default: all cores).
    pub n_threads: Option<u32>,
}

impl Default for EmbedderOptions {
    fn default() -> Self {
        EmbedderOptions {
            batch_tokens: 2048,
            max_inputs: 64,
            n_threads: None,
        }
    }
}

/// What [`Embedder::embed`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct Embeddings {
    /// One vector per input, in order (one score each for [`Pooling::Rank`]).
    pub vectors: Vec<Vec<f32>>,
    /// Tokens per input after truncation (special tokens included).
    pub tokens: Vec<u32>,
    /// Inputs that were cut to fit the model's context.
    pub truncated: Vec<usize>,
}

/// An embedding context over a model.
pub struct Embedder<'m> {
    model: &'m Model,
    ctx: LlamaContext<'m>,
    opts: EmbedderOptions,
    pooling: Pooling,
    max_tokens: u32,
    sep: Option<TokenId>,
}

impl std::fmt::Debug for Embedder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedder")
            .field("model", &self.model)
            .field("pooling", &self.pooling)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl<'m> Embedder<'m> {
    /// An embedding context for `model`, which must pool (an embedding model
    /// with `pooling_type` mean, cls, last or rank in its GGUF).
    pub fn new(model: &'m Model, opts: EmbedderOptions) -> Result<Embedder<'m>, EngineError> {
        let arch = model.architecture();
        let pooling = match model
            .llama()
            .meta_val_str(&format!("{arch}.pooling_type"))
            .ok()
            .as_deref()
        {
            Some("1") => Pooling::Mean,
            Some("2") => Pooling::Cls,
            Some("3") => Pooling::Last,
            Some("4") => Pooling::Rank,
            other => {
                return Err(EngineError::InvalidOption {
                    field: "embedding model",
                    reason: format!(
                        "{} is not an embedding model ({arch}.pooling_type is {})",
                        model.path().display(),
                        other.unwrap_or("absent")
                    ),
                });
            }
        };
        let max_tokens = model.llama().n_ctx_train().max(1);
        if opts.batch_tokens < max_tokens || opts.max_inputs == 0 || opts.max_inputs > 256 {
            return Err(EngineError::InvalidOption {
                field: "batch_tokens/max_inputs",
                reason: format!(
                    "a batch must hold one whole input ({max_tokens} tokens, got {}) and 1..=256 inputs (got {})",
                    opts.batch_tokens, opts.max_inputs
                ),
            });
        }
        let threads = opts
            .n_threads
            .unwrap_or_else(crate::context::default_threads) as i32;
        let params = LlamaContextParams::default()
            .with_n_ctx(NonZeroU32::new(opts.batch_tokens))
            .with_n_batch(opts.batch_tokens)
            .with_n_ubatch(opts.batch_tokens)
            .with_n_seq_max(opts.max_inputs)
            .with_n_threads(threads)
            .with_n_threads_batch(threads)
            .with_embeddings(true)
            .with_kv_unified(true);
        let ctx = model
            .llama()
            .new_context(crate::backend()?, params)
            .map_err(|source| EngineError::ContextCreate {
                n_ctx: opts.batch_tokens,
                type_k: siliceo_core::KvType::F16,
                type_v: siliceo_core::KvType::F16,
                source,
            })?;
        // The separator ends every input: a truncated input keeps it.
        let sep = model
            .tokenize("", true)?
            .last()
            .copied()
            .filter(|_| pooling != Pooling::Last);
        Ok(Embedder {
            model,
            ctx,
            opts,
            pooling,
            max_tokens,
            sep,
        })
    }

    /// The options it was made with.
    pub fn options(&self) -> &EmbedderOptions {
        &self.opts
    }

    /// The model's pooling.
    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    /// Tokens one input may have (the model's training context).
    pub fn max_tokens(&self) -> u32 {
        self.max_tokens
    }

    /// Output width: the embedding size, or 1 score for [`Pooling::Rank`].
    pub fn dim(&self) -> usize {
        if self.pooling == Pooling::Rank {
            1
        } else {
            self.model.llama().n_embd() as usize
        }
    }

    /// Tokens for one input: `[CLS] text [SEP]` as the model adds them, cut to
    /// [`max_tokens`](Self::max_tokens) (keeping the separator) when `truncate`,
    /// else refused with [`EngineError::PromptTooLong`].
    pub fn tokens(&self, text: &str, truncate: bool) -> Result<(Vec<TokenId>, bool), EngineError> {
        self.fit(self.model.tokenize(text, true)?, truncate)
    }

    /// An input given as token ids, used as they are (no `[CLS]`/`[SEP]`
    /// added): every id inside the vocabulary ([`EngineError::InvalidToken`]),
    /// at least one, cut or refused past [`max_tokens`](Self::max_tokens) as
    /// [`tokens`](Self::tokens) does.
    pub fn given_tokens(
        &self,
        ids: &[TokenId],
        truncate: bool,
    ) -> Result<(Vec<TokenId>, bool), EngineError> {
        if ids.is_empty() {
            return Err(EngineError::Tokenize("an input has no tokens".into()));
        }
        if let Some(bad) = ids.iter().find(|t| !self.model.is_valid_token(**t)) {
            return Err(EngineError::InvalidToken {
                token: bad.0,
                n_vocab: self.model.geometry().n_vocab,
            });
        }
        self.fit(ids.to_vec(), truncate)
    }

    /// Tokens for a (query, document) pair of a cross-encoder:
    /// `[CLS] query [SEP] document [SEP]`.
    pub fn pair_tokens(
        &self,
        query: &str,
        document: &str,
        truncate: bool,
    ) -> Result<(Vec<TokenId>, bool), EngineError> {
        let mut t = self.model.tokenize(query, true)?;
        t.extend(self.model.tokenize(document, false)?);
        t.extend(self.sep);
        self.fit(t, truncate)
    }

    fn fit(
        &self,
        mut t: Vec<TokenId>,
        truncate: bool,
    ) -> Result<(Vec<TokenId>, bool), EngineError> {
        let max = self.max_tokens as usize;
        if t.len() <= max {
            return Ok((t, false));
        }
        if !truncate {
            return Err(EngineError::PromptTooLong {
                tokens: t.len(),
                n_ctx: self.max_tokens,
            });
        }
        t.truncate(max);
        if let Some(sep) = self.sep {
            t[max - 1] = sep;
        }
        Ok((t, true))
    }

    /// Embeds `texts` (see [`tokens`](Self::tokens) for `truncate`); L2
    /// normalises each vector when `normalize`.
    pub fn embed(
        &mut self,
        texts: &[&str],
        normalize: bool,
        truncate: bool,
    ) -> Result<Embeddings, EngineError> {
        let mut inputs = Vec::with_capacity(texts.len());
        let mut truncated = Vec::new();
        for (i, text) in texts.iter().enumerate() {
            let (t, cut) = self.tokens(text, truncate)?;
            if cut {
                truncated.push(i);
            }
            inputs.push(t);
        }
        let vectors = self.run(&inputs, normalize)?;
        Ok(Embeddings {
            vectors,
            tokens: inputs.iter().map(|t| t.len() as u32).collect(),
            truncated,
        })
    }

    /// Runs token inputs through the model, as many per batch as fit.
    pub fn run(
        &mut self,
        inputs: &[Vec<TokenId>],
        normalize: bool,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let mut out = Vec::with_capacity(inputs.len());
        let mut start = 0;
        while start < inputs.len() {
            let mut end = start;
            let mut tokens = 0usize;
            while end < inputs.len()
                && end - start < self.opts.max_inputs as usize
                && tokens + inputs[end].len() <= self.opts.batch_tokens as usize
            {
                tokens += inputs[end].len();
                end += 1;
            }
            if end == start {
                // Longer than a batch: only possible past max_tokens, refused earlier.
                return Err(EngineError::BatchTooLarge {
                    tokens: inputs[start].len(),
                    n_batch: self.opts.batch_tokens,
                });
            }
            self.run_batch(&inputs[start..end], normalize, &mut out)?;
            start = end;
        }
        Ok(out)
    }

    fn run_batch(
        &mut self,
        inputs: &[Vec<TokenId>],
        normalize: bool,
        out: &mut Vec<Vec<f32>>,
    ) -> Result<(), EngineError> {
        let n: usize = inputs.iter().map(Vec::len).sum();
        let mut batch = LlamaBatch::new(n.max(1), inputs.len() as i32);
        for (seq, t) in inputs.iter().enumerate() {
            if t.is_empty() {
                return Err(EngineError::EmptyPrompt);
            }
            for (pos, tok) in t.iter().enumerate() {
                batch
                    .add(LlamaToken(tok.0 as i32), pos as i32, &[seq as i32], true)
                    .map_err(|_| EngineError::BatchTooLarge {
                        tokens: n,
                        n_batch: self.opts.batch_tokens,
                    })?;
            }
        }
        self.ctx
            .encode(&mut batch)
            .map_err(|e| EngineError::Embed(format!("llama.cpp encode failed: {e}")))?;
        for seq in 0..inputs.len() {
            let v = self.ctx.embeddings_seq_ith(seq as i32).map_err(|_| {
                EngineError::Embed(format!(
                    "llama.cpp returned no pooled output for input {seq}"
                ))
            })?;
            let mut v = v.to_vec();
            if normalize && self.pooling != Pooling::Rank {
                l2_normalize(&mut v);
            }
            out.push(v);
        }
        Ok(())
    }
}

/// Scales `v` to unit length (a zero vector stays zero).
pub fn l2_normalize(v: &mut [f32]) {
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if n > 0.0 {
        for x in v.iter_mut() {
            *x /= n;
        }
    }
}

/// Cosine similarity of two vectors (0 when either is zero).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        ab += (*x as f64) * (*y as f64);
        aa += (*x as f64) * (*x as f64);
        bb += (*y as f64) * (*y as f64);
    }
    if aa == 0.0 || bb == 0.0 {
        0.0
    } else {
        (ab / (aa.sqrt() * bb.sqrt())) as f32
    }
}
