use std::path::PathBuf;

/// Everything the engine can fail at. Running out of KV space is reported as
/// [`EngineError::KvCacheFull`] so a caller can evict or preempt and retry.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A draft model whose tokens do not mean what the target's tokens mean.
    #[error("the draft model's vocabulary does not match the target's: {0}")]
    IncompatibleVocab(String),
    /// llama.cpp's backend could not be initialised.
    #[error("llama.cpp backend failed to initialise: {0}")]
    Backend(String),
    /// The model file does not exist.
    #[error("model file not found: {}", path.display())]
    ModelNotFound {
        /// The path asked for.
        path: PathBuf,
    },
    /// The file exists but is not a GGUF model (wrong magic, truncated header).
    #[error("{} is not a GGUF model: {reason}", path.display())]
    NotGguf {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// An I/O error while inspecting the model file.
    #[error("cannot read {}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// llama.cpp refused to load the model (corrupt tensors, unknown architecture, …).
    #[error("llama.cpp failed to load {} (corrupt or unsupported model; see the log for details)", path.display())]
    ModelLoad {
        /// The file.
        path: PathBuf,
        /// llama.cpp's error.
        #[source]
        source: llama_cpp_2::LlamaModelLoadError,
    },
    /// llama.cpp could not create an inference context.
    #[error("llama.cpp failed to create a context (n_ctx={n_ctx}, K={type_k}, V={type_v})")]
    ContextCreate {
        /// Requested context length.
        n_ctx: u32,
        /// K cache type.
        type_k: siliceo_core::KvType,
        /// V cache type.
        type_v: siliceo_core::KvType,
        /// llama.cpp's error.
        #[source]
        source: llama_cpp_2::LlamaContextLoadError,
    },
    /// A context option is out of range.
    #[error("invalid context option `{field}`: {reason}")]
    InvalidOption {
        /// The option.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The prompt does not fit the context.
    #[error("prompt of {tokens} tokens does not fit the context of {n_ctx} tokens")]
    PromptTooLong {
        /// Prompt length in tokens.
        tokens: usize,
        /// Context length.
        n_ctx: u32,
    },
    /// A token id outside the vocabulary.
    #[error("token id {token} is outside the vocabulary of {n_vocab} tokens")]
    InvalidToken {
        /// The token.
        token: u32,
        /// Vocabulary size.
        n_vocab: u32,
    },
    /// A sequence id outside `0..n_seq_max`.
    #[error("sequence id {seq} is outside 0..{n_seq_max}")]
    InvalidSeq {
        /// The sequence id.
        seq: u32,
        /// The context's sequence limit.
        n_seq_max: u32,
    },
    /// A batch holds more tokens than the context's `n_batch`.
    #[error("batch of {tokens} tokens exceeds n_batch={n_batch}")]
    BatchTooLarge {
        /// Tokens in the batch.
        tokens: usize,
        /// The context's limit.
        n_batch: u32,
    },
    /// Logits were asked for a batch position that did not request them.
    #[error("no logits at batch index {index}")]
    NoLogits {
        /// The batch index.
        index: usize,
    },
    /// No free KV cells for the batch: evict, preempt or wait.
    #[error("the KV cache has no room for this batch")]
    KvCacheFull,
    /// llama.cpp's decode failed for another reason.
    #[error("llama.cpp decode failed")]
    Decode(#[source] llama_cpp_2::DecodeError),
    /// A KV-cache operation was refused (e.g. removing part of a sequence the cache cannot split).
    #[error("KV cache operation `{op}` failed on sequence {seq}")]
    KvOp {
        /// The operation.
        op: &'static str,
        /// The sequence.
        seq: u32,
    },
    /// Saving or restoring a sequence's state failed.
    #[error("sequence state {op} failed for sequence {seq}")]
    State {
        /// `save` or `restore`.
        op: &'static str,
        /// The sequence.
        seq: u32,
        /// llama.cpp's error.
        #[source]
        source: llama_cpp_2::StateSeqError,
    },
    /// The model has no chat template.
    #[error(
        "the model has no chat template: send a plain prompt, or give the server one \
         (`siliceo serve --chat-template-file`)"
    )]
    NoChatTemplate,
    /// Applying the chat template failed.
    #[error("applying the chat template failed: {0}")]
    ChatTemplate(String),
    /// Tokenization failed.
    #[error("tokenization failed: {0}")]
    Tokenize(String),
    /// llama.cpp could not compute embeddings.
    #[error("embedding failed: {0}")]
    Embed(String),
    /// Shadow attention (our KV formats inside llama.cpp's forward pass) failed.
    #[error("shadow attention: {0}")]
    Shadow(String),
    /// Grafted attention (our store and kernel in llama.cpp's forward pass,
    /// serving) failed in a step.
    #[error("grafted attention: {0}")]
    Graft(String),
    /// The model's attention is of a kind grafted serving does not compute.
    #[error(
        "{model}: grafted attention does not support {reason}; serve it with --kv-backend llama"
    )]
    Unsupported {
        /// The model's name.
        model: String,
        /// What it has.
        reason: String,
    },
    /// A sampling parameter is invalid.
    #[error(transparent)]
    Params(#[from] siliceo_core::Error),
}

impl EngineError {
    /// A stable, short label for metrics (`error=<kind>`).
    pub fn error_kind(&self) -> &'static str {
        match self {
            EngineError::Backend(_) => "backend",
            EngineError::ModelNotFound { .. } => "model_not_found",
            EngineError::NotGguf { .. } => "not_gguf",
            EngineError::Io { .. } => "io",
            EngineError::ModelLoad { .. } => "model_load",
            EngineError::ContextCreate { .. } => "context_create",
            EngineError::InvalidOption { .. } => "invalid_option",
            EngineError::EmptyPrompt => "empty_prompt",
            EngineError::PromptTooLong { .. } => "prompt_too_long",
            EngineError::InvalidToken { .. } => "invalid_token",
            EngineError::InvalidSeq { .. } => "invalid_seq",
            EngineError::BatchTooLarge { .. } => "batch_too_large",
            EngineError::NoLogits { .. } => "no_logits",
            EngineError::KvCacheFull => "kv_cache_full",
            EngineError::Decode(_) => "decode",
            EngineError::KvOp { .. } => "kv_op",
            EngineError::State { .. } => "state",
            EngineError::NoChatTemplate => "no_chat_template",
            EngineError::ChatTemplate(_) => "chat_template",
            EngineError::Tokenize(_) => "tokenize",
            EngineError::Embed(_) => "embed",
            EngineError::Shadow(_) => "shadow",
            EngineError::Graft(_) => "graft",
            EngineError::Unsupported { .. } => "unsupported_model",
            EngineError::Params(e) => e.error_kind(),
            EngineError::IncompatibleVocab(_) => "incompatible_vocab",
        }
    }
}
