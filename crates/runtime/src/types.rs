use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Sender;
use siliceo_chat::{ChatEnd, Message, Tool};
use siliceo_core::{FinishReason, Priority, RequestId, SamplingParams, TokenId};
use siliceo_engine::{ContextOptions, KvFormat, ModelOptions};
use siliceo_kv_paging::planner::{StorePlan, StoreSize, StoreSplit};
use siliceo_scheduler::{Rejected, SchedulerConfig};

use crate::Command;
use crate::metrics::Metrics;

/// How to run the engine.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// GGUF model.
    pub model_path: PathBuf,
    /// Model loading options.
    pub model: ModelOptions,
    /// A Jinja chat template to use instead of the one the GGUF carries
    /// (`None`: the GGUF's). One that does not compile fails start-up.
    pub chat_template: Option<String>,
    /// Where KV lives: siliceo's store in one of its formats (the default),
    /// or llama.cpp's own cache.
    pub kv: KvBackend,
    /// Context options: `n_batch` and threads for both backends; `n_ctx`
    /// (the KV tokens when no store size is given) and, for llama.cpp's own
    /// cache, its K/V types. `n_seq_max` is set from the scheduler's
    /// `max_running_seqs`.
    pub context: ContextOptions,
    /// Scheduling limits; `max_batch_tokens` is clamped to the context's `n_batch`.
    pub scheduler: SchedulerConfig,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Reuse the KV of prompt prefixes computed before (automatic prefix
    /// caching over full blocks, LRU eviction).
    pub prefix_caching: bool,
    /// Speculative decoding for requests that ask for it (`None`: off).
    pub speculative: Option<SpeculativeConfig>,
    /// Compute constrained requests' token masks on a helper thread while
    /// llama.cpp decodes the step (default); `false` computes them after the
    /// decode, spread over the machine's cores.
    pub constraint_overlap: bool,
    /// With llama.cpp's own cache: sequence ids set aside to keep cached
    /// blocks alive after the requests that computed them end. Each holds at most one cached block per
    /// block position, so this bounds how many different cached prefixes can
    /// share a position; a block that finds no holder is dropped from the cache.
    pub prefix_holders: u32,
    /// Where our store's offloaded layers run their attention (`None`: what
    /// the build and the model give, `DeviceAttention::for_model`). Tests
    /// name `DeviceAttention::Emulated` (feature `cuda-emu`) to serve some
    /// layers' store and attention on the CUDA emulator.
    pub device_attention: Option<siliceo_engine::DeviceAttention>,
    /// Keep every block of the layers with a sliding window, as the global
    /// layers do (llama.cpp's `--swa-full`). Off by default: with our store,
    /// where the layers are alike in shape, the store is on the host and no
    /// token trees are drafted, the windowed layers keep pools of their own
    /// holding a window's worth per running sequence (and as much again for
    /// cached prefixes), and release the blocks their window has passed.
    pub swa_full: bool,
}

/// Where a runtime keeps KV.
#[derive(Debug, Clone, PartialEq)]
pub enum KvBackend {
    /// Siliceo's paged store and attention kernel (grafted attention): KV in
    /// `format`, one pool of blocks for all requests, sized by `size`
    /// (`None`: the context's `n_ctx` tokens).
    Ours {
        /// The KV format.
        format: KvFormat,
        /// The store's size.
        size: Option<StoreSize>,
        /// The attention kernel's threads (`None`: llama.cpp's count).
        kernel_threads: Option<usize>,
    },
    /// llama.cpp's own unified KV cache (the context's `type_k`/`type_v`),
    /// for comparison.
    Llama,
}

impl Default for KvBackend {
    fn default() -> Self {
        KvBackend::Ours {
            format: KvFormat::default(),
            size: None,
            kernel_threads: None,
        }
    }
}

impl RuntimeConfig {
    /// Defaults for `model_path`: our store in the default format (KV8),
    /// 4096 tokens of KV, 8 running sequences, 256-token steps, 64-token
    /// blocks, prefix caching.
    pub fn new(model_path: impl Into<PathBuf>) -> Self {
        RuntimeConfig {
            model_path: model_path.into(),
            model: ModelOptions::default(),
            chat_template: None,
            kv: KvBackend::default(),
            context: ContextOptions {
                n_ctx: 4096,
                n_batch: 256,
                n_ubatch: 256,
                ..ContextOptions::default()
            },
            scheduler: SchedulerConfig {
                max_batch_tokens: 256,
                max_running_seqs: 8,
                ..SchedulerConfig::default()
            },
            block_size: 64,
            prefix_caching: true,
            prefix_holders: 16,
            speculative: None,
            constraint_overlap: true,
            device_attention: None,
            swa_full: false,
        }
    }
}

/// Speculative decoding: a draft model (its own llama.cpp context on the
/// engine thread, kept in step with each request) or, without one, the n-gram
/// prompt-lookup drafter. Drafted tokens are verified in the same batch as
/// everything else; greedy output is unchanged and sampled output keeps its
/// distribution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpeculativeConfig {
    /// Draft model (same vocabulary as the target, checked at start-up);
    /// `None`: the n-gram drafter.
    pub draft_model: Option<PathBuf>,
    /// Most tokens drafted per step (the length adapts to the acceptance rate).
    pub max_draft: usize,
    /// No drafting while this many sequences or more are running (a large
    /// batch already keeps the machine busy; verifying drafts would cost more
    /// than it saves).
    pub max_batch: usize,
    /// With the n-gram drafter, draft up to this many branches (distinct
    /// continuations found in the history) and verify them as a token tree in
    /// one batch, one sequence id per branch; 1: chains only. Greedy requests
    /// without penalties only.
    pub tree_width: usize,
    /// Draft exactly `max_draft` tokens every step instead of adapting the
    /// length to the acceptance rate (for measurements).
    pub fixed_draft: bool,
    /// Pause drafting for a request while its drafting steps cost more wall
    /// time per produced token than its plain steps (measured as it runs;
    /// each request's first decode steps are plain, for the baseline). On by
    /// default: speculation that does not pay switches itself off.
    pub cost_switch_off: bool,
}

impl SpeculativeConfig {
    /// Open blocks our store sets aside for token trees: each request that
    /// may draft (fewer than `max_batch` running) writes each branch after
    /// the first into blocks of its own for the step — up to `max_draft`
    /// tokens, which may straddle a block boundary. 0 without trees.
    pub fn tree_branch_blocks(&self, block_size: u32, max_running: u32) -> u32 {
        if self.tree_width <= 1 {
            return 0;
        }
        let requests = (self.max_batch as u32).clamp(1, max_running.max(1));
        let per_branch = (self.max_draft.max(1) as u32 - 1) / block_size.max(1) + 2;
        requests * (self.tree_width as u32 - 1) * per_branch
    }
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        SpeculativeConfig {
            draft_model: None,
            max_draft: 8,
            max_batch: 4,
            tree_width: 1,
            fixed_draft: false,
            cost_switch_off: true,
        }
    }
}

/// What to generate from.
#[derive(Debug, Clone)]
pub enum Input {
    /// Plain text, tokenized with the model's special tokens.
    Prompt(String),
    /// Chat messages, rendered with the model's own chat template (its
    /// Jinja, through minijinja, on the submitting thread) with the
    /// request's `tools`.
    Chat(Vec<Message>),
    /// Token ids as they are.
    Tokens(Vec<TokenId>),
    /// Fill in the middle: the model writes what goes between `prefix` and
    /// `suffix` (a model with FIM tokens, e.g. Qwen2.5-Coder).
    Infill {
        /// The text before the gap.
        prefix: String,
        /// The text after it.
        suffix: String,
    },
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Its id; the runtime assigns one when absent.
    pub id: Option<RequestId>,
    /// Input.
    pub input: Input,
    /// Sampling and stopping.
    pub sampling: SamplingParams,
    /// Scheduling class.
    pub priority: Priority,
    /// Give up after this long (queue time included).
    pub deadline: Option<std::time::Duration>,
    /// Use speculative decoding when the runtime has it configured.
    pub speculative: bool,
    /// Prefix-cache partition: only requests with the same salt share cached
    /// KV (per tenant, say). `None` shares with every other unsalted request.
    pub cache_salt: Option<String>,
    /// Output the decoder is held to (a JSON schema, a regex, a grammar).
    /// Compiled when submitted; an invalid one is refused naming
    /// `constraint_field`.
    pub constraint: Option<siliceo_core::Constraint>,
    /// The request field the constraint came from, for error messages
    /// (`response_format`, `constraint.regex`, …).
    pub constraint_field: &'static str,
    /// Tools offered to the model (chat input only), rendered by its chat
    /// template.
    pub tools: Vec<Tool>,
    /// Report each generated token's log-probability with this many most
    /// likely alternatives (`None`: off; at most [`MAX_TOP_LOGPROBS`]).
    pub logprobs: Option<u32>,
    /// Report each prompt token's log-probability given the tokens before it,
    /// with this many most likely alternatives (`None`: off; at most
    /// [`MAX_TOP_LOGPROBS`]), in one [`Event::Prompt`] before the first
    /// `Text`. The prompt is then computed whole (no prefix-cache reuse).
    /// With it, `sampling.max_tokens` may be 0: the prompt is scored and
    /// nothing generated.
    pub prompt_logprobs: Option<u32>,
    /// The request field `sampling.max_tokens` came from, when the client
    /// set it (`max_tokens`, `max_completion_tokens`): a prompt plus that
    /// many tokens over the context is then refused with
    /// [`RuntimeError::ContextLengthExceeded`] naming it, as OpenAI and vLLM
    /// do. `None`: `max_tokens` is a default, cut to what the context leaves.
    pub max_tokens_field: Option<&'static str>,
    /// More variables for the chat template (chat input only), such as
    /// Qwen3's `enable_thinking`; they cannot replace `messages`, `tools`,
    /// `add_generation_prompt`, `bos_token` or `eos_token`.
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// How a chat's rendering ends (chat input only): the assistant's turn
    /// opened (the default), the final assistant message continued, or
    /// closed.
    pub chat_end: ChatEnd,
    /// The stop string that ends the request is sent as its last text (it
    /// is not, by default), as vLLM's `include_stop_str_in_output` asks.
    pub include_stop_str: bool,
    /// Generate at least this many tokens (vLLM's `min_tokens`): until
    /// then end-of-generation and stop tokens are banned and stop strings
    /// do not stop. Such a request is not decoded speculatively.
    pub min_tokens: u32,
    /// Think for at most this many tokens (chat input, a model whose
    /// template knows `<think>` or `[THINK]` blocks): a block still open
    /// then is closed for the model with `"\n</think>\n\n"` (or
    /// `"\n[/THINK]\n\n"`), and it answers. Tokens count
    /// from the one that opens the block (the prompt's, or the model's own
    /// tag). Drafted tokens never run past it. A constraint that writes the
    /// thinking itself and refuses the close keeps its own course.
    pub thinking_budget: Option<u32>,
}

impl GenerateRequest {
    /// Greedy, 256 tokens, normal priority.
    pub fn new(input: Input) -> Self {
        GenerateRequest {
            id: None,
            input,
            sampling: SamplingParams::greedy(),
            priority: Priority::Normal,
            deadline: None,
            speculative: false,
            cache_salt: None,
            constraint: None,
            constraint_field: "constraint",
            tools: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            max_tokens_field: None,
            chat_template_kwargs: serde_json::Map::new(),
            chat_end: ChatEnd::Answer,
            include_stop_str: false,
            min_tokens: 0,
            thinking_budget: None,
        }
    }
}

/// Per-request figures, reported with [`Event::Done`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// From submission to the first scheduled step.
    pub queue_ms: u64,
    /// From submission to the first generated token.
    pub ttft_ms: u64,
    /// From the first generated token to the end.
    pub decode_ms: u64,
    /// Speculative tokens drafted.
    pub draft_tokens: u32,
    /// Drafted tokens the target kept.
    pub accepted_draft_tokens: u32,
    /// Steps that verified drafted tokens (accepted ÷ this = mean accepted
    /// length per step).
    pub speculative_steps: u32,
}

/// What a request's stream carries.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The prompt's log-probabilities, once, before any `Text` (requests
    /// with `prompt_logprobs`).
    Prompt {
        /// The prompt's first token and its bytes: nothing before it
        /// predicts it.
        first: (TokenId, Vec<u8>),
        /// Every later prompt token's log-probability given the tokens
        /// before it, in order.
        logprobs: Vec<TokenLogprob>,
    },
    /// What one engine step produced for the request: its new text
    /// (possibly empty while a character or stop string is pending) and the
    /// tokens behind it, one or, with speculative decoding, several.
    Text {
        /// The text.
        text: String,
        /// The tokens; empty for text held back earlier (a possible stop
        /// string, a split character) and released at the end.
        tokens: Vec<TokenId>,
        /// Each token's log-probability, when the request asked for them
        /// (one per token; empty otherwise).
        logprobs: Vec<TokenLogprob>,
    },
    /// The last event.
    Done {
        /// Why it ended.
        finish_reason: FinishReason,
        /// Figures.
        usage: Usage,
        /// What went wrong, when `finish_reason` is `Error`.
        error: Option<RuntimeError>,
        /// The stop string that ended it, when one did (`finish_reason`
        /// `Stop`; not an end-of-generation or stop token).
        stop: Option<String>,
    },
}

/// Most alternatives per token a request may ask log-probabilities for
/// (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// A generated token's log-probability under the model: the log-softmax of
/// its logits as the model produced them (before penalties, temperature,
/// filters or a constraint's mask), with the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token.
    pub token: TokenId,
    /// Its bytes (a piece of a character for byte tokens).
    pub bytes: Vec<u8>,
    /// Its natural-log probability.
    pub logprob: f32,
    /// Its rank in the vocabulary: 1 + how many tokens are more likely.
    pub rank: u32,
    /// The `top_logprobs` most likely tokens, most likely first:
    /// `(token, bytes, logprob)`.
    pub top: Vec<(TokenId, Vec<u8>, f32)>,
}

/// Runtime failures. Request-level ones arrive inside [`Event::Done`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// The engine thread could not start (model load, context creation, …).
    #[error("the engine could not start: {0}")]
    Start(String),
    /// The engine thread has stopped.
    #[error("the engine has stopped")]
    Stopped,
    /// The request is invalid; `field` names what is wrong.
    #[error("invalid `{field}`: {reason}")]
    InvalidRequest {
        /// The offending field.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// A prompt plus the `max_tokens` the client asked for exceeds the
    /// context (the message leaves out `field`, which the edges name).
    #[error(
        "the prompt's {prompt_tokens} tokens plus {max_tokens} to generate exceed the context of {n_ctx} tokens"
    )]
    ContextLengthExceeded {
        /// The field `max_tokens` came from.
        field: &'static str,
        /// The prompt's length.
        prompt_tokens: u32,
        /// Tokens asked for.
        max_tokens: u32,
        /// The longest sequence.
        n_ctx: u32,
    },
    /// The engine's state refuses it: the queue is full, it needs more KV
    /// than the whole cache, its id is in use.
    #[error(transparent)]
    Rejected(#[from] Rejected),
    /// The engine failed while running it.
    #[error("engine failure: {0}")]
    Engine(String),
}

impl RuntimeError {
    /// A stable, short label for metrics.
    pub fn error_kind(&self) -> &'static str {
        match self {
            RuntimeError::Start(_) => "start",
            RuntimeError::Stopped => "stopped",
            RuntimeError::InvalidRequest { .. } => "invalid_request",
            RuntimeError::ContextLengthExceeded { .. } => "context_length_exceeded",
            RuntimeError::Rejected(r) => r.error_kind(),
            RuntimeError::Engine(_) => "engine",
        }
    }
}

/// What the engine runs: fixed once it has started.
#[derive(Debug, Clone, PartialEq)]
pub struct RuntimeInfo {
    /// The model's name from its metadata.
    pub model_name: String,
    /// The model's file.
    pub model_path: PathBuf,
    /// Its architecture (`llama`, `qwen2`, …).
    pub architecture: String,
    /// Its geometry.
    pub geometry: siliceo_core::ModelGeometry,
    /// Repeating layers llama.cpp runs on the GPU (0 without a GPU backend,
    /// whatever `--gpu-layers` asked).
    pub gpu_layers: u32,
    /// The longest sequence (prompt plus generation) in tokens.
    pub n_ctx: u32,
    /// llama.cpp's K cache type (with our store: its one-step f16 cache).
    pub type_k: siliceo_core::KvType,
    /// llama.cpp's V cache type.
    pub type_v: siliceo_core::KvType,
    /// `ours` (siliceo's store, grafted attention) or `llama` (llama.cpp's cache).
    pub kv_backend: &'static str,
    /// The KV format: ours (`kv8:kv8`, `k5:v4+tail64`, …) or llama.cpp's
    /// `K/V` types.
    pub kv_format: String,
    /// Our store's pools and bytes (`None` on llama.cpp's cache).
    pub store: Option<StorePlan>,
    /// Where our store's bytes live: the layers whose store is in device
    /// memory, and the bytes in each memory (`None` on llama.cpp's cache).
    pub store_split: Option<StoreSplit>,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks the scheduler manages (open and sealed; with windowed
    /// pools, the global layers', which hold the whole context).
    pub kv_blocks: u32,
    /// Most requests running at once.
    pub max_running_seqs: u32,
    /// Whether prompt prefixes are cached.
    pub prefix_caching: bool,
    /// Speculative decoding configured (`None`: off).
    pub speculative: Option<SpeculativeConfig>,
    /// Each layer's sliding attention window in tokens (0 = the whole
    /// context; empty where the build does not know the model's windows).
    pub attention_windows: Vec<usize>,
    /// The windowed layers' own pools, where they keep them
    /// ([`RuntimeConfig::swa_full`] off).
    pub windowed_pools: Option<crate::WindowedPools>,
}

impl RuntimeInfo {
    /// The sliding window and how many layers attend through it, where the
    /// model has one.
    pub fn sliding_window(&self) -> Option<(usize, usize)> {
        let w = self
            .attention_windows
            .iter()
            .copied()
            .max()
            .filter(|&w| w > 0)?;
        Some((w, self.attention_windows.iter().filter(|&&x| x > 0).count()))
    }
}

/// Occupancy, for metrics and leak checks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RuntimeStats {
    /// Requests waiting (new or preempted).
    pub waiting: usize,
    /// Requests running.
    pub running: usize,
    /// KV blocks referenced.
    pub kv_used_blocks: usize,
    /// KV blocks free (cached-but-unreferenced ones included: taking them
    /// evicts their prefix).
    pub kv_free_blocks: usize,
    /// Unreferenced blocks still holding a cached prefix.
    pub kv_cached_blocks: usize,
    /// Distinct full-block contents the prefix cache holds (referenced or
    /// not; a block cached in two forms counts once): what its published
    /// events announce.
    pub kv_cached_contents: usize,
    /// Bytes of our store's blocks referenced now (0 on llama.cpp's cache).
    pub kv_used_bytes: u64,
    /// Referenced blocks that several requests share (prefix hits, forks).
    pub kv_shared_blocks: usize,
    /// Referenced sealed (quantized) blocks, a part of `kv_used_blocks`.
    pub kv_used_sealed_blocks: usize,
    /// The windowed layers' own blocks referenced ([`RuntimeInfo::windowed_pools`];
    /// not in `kv_used_blocks`).
    pub kv_windowed_used_blocks: usize,
    /// The windowed layers' own blocks free (cached ones included).
    pub kv_windowed_free_blocks: usize,
    /// Prompt tokens served from the prefix cache so far.
    pub prefix_hit_tokens: u64,
    /// Prompt tokens computed because the cache did not have them.
    pub prefix_miss_tokens: u64,
    /// Cached blocks evicted so far.
    pub prefix_evictions: u64,
    /// llama.cpp sequence ids in use by requests (holders not counted).
    pub seq_ids_in_use: usize,
    /// Cached blocks kept alive by holder sequence ids.
    pub held_blocks: usize,
    /// KV positions llama.cpp holds over all sequence ids.
    pub llama_cells: u64,
    /// Preemptions so far.
    pub preemptions: u64,
    /// Engine steps run so far.
    pub steps: u64,
    /// Time spent in steps, in µs (scheduling, `decode`, sampling, streaming).
    pub step_us: u64,
    /// Time of that spent inside llama.cpp's `decode`, in µs; the rest is
    /// host-side serving overhead.
    pub decode_us: u64,
    /// Engine steps that panicked (each failed its requests and reset the KV
    /// cache; the engine kept serving).
    pub panics: u64,
    /// Speculative verifications done as a token tree (several branches).
    pub tree_verifications: u64,
    /// Of those, the ones whose kept path ran in a branch after the first
    /// (on our store its rows were copied into the request's blocks).
    pub tree_later_branches_kept: u64,
    /// Times a request's drafting paused because its drafting steps cost more
    /// per produced token than its plain steps (see `cost_switch_off`).
    pub spec_cost_pauses: u64,
    /// Constraint masks computed so far (one per constrained token position).
    pub constraint_masks: u64,
    /// Time spent computing them, in µs (summed over threads: masks computed
    /// beside `decode` overlap it).
    pub constraint_mask_us: u64,
    /// Of those, masks computed on a helper thread while `decode` ran.
    pub constraint_masks_overlapped: u64,
}

impl RuntimeStats {
    /// The share of KV blocks referenced, 0 to 1 (cached-but-unreferenced
    /// blocks count as free: taking them evicts their prefix).
    pub fn kv_usage(&self) -> f64 {
        share(
            self.kv_used_blocks as u64,
            (self.kv_used_blocks + self.kv_free_blocks) as u64,
        )
    }

    /// Prompt tokens served from the prefix cache over those looked up.
    pub fn prefix_hit_rate(&self) -> f64 {
        share(
            self.prefix_hit_tokens,
            self.prefix_hit_tokens + self.prefix_miss_tokens,
        )
    }
}

/// One scheduler's load in the shape gateways poll (SGLang's and SMG's
/// `SchedulerLoad`): served as JSON by the HTTP API's `/v1/loads` and as
/// protobuf by gRPC `GetLoads`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SchedulerLoad {
    /// Requests running.
    pub num_running_reqs: u32,
    /// Requests waiting.
    pub num_waiting_reqs: u32,
    /// Running plus waiting.
    pub num_total_reqs: u32,
    /// Tokens' worth of KV blocks referenced.
    pub num_used_tokens: u64,
    /// Tokens' worth of all KV blocks.
    pub max_total_num_tokens: u64,
    /// Referenced blocks over all blocks, in [0, 1].
    pub token_usage: f64,
    /// Tokens generated per second lately.
    pub gen_throughput: f64,
    /// Prompt tokens served from the prefix cache over those looked up.
    pub cache_hit_rate: f64,
    /// Running over the most that may run.
    pub utilization: f64,
    /// The most requests that run at once.
    pub max_running_requests: u32,
}

/// `part / whole`, 0 when `whole` is.
fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// The events of one request. Dropping it cancels the request. Reading it
/// counts the request in the runtime's [`Metrics`]: tokens, time to the
/// first token and between tokens, how it ended.
#[derive(Debug)]
pub struct RequestStream {
    id: RequestId,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    tx: Sender<Command>,
    done: bool,
    metrics: Arc<Metrics>,
    submitted: Instant,
    last_token: Option<Instant>,
}

impl RequestStream {
    pub(crate) fn new(
        id: RequestId,
        rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
        tx: Sender<Command>,
        metrics: Arc<Metrics>,
        submitted: Instant,
    ) -> Self {
        RequestStream {
            id,
            rx,
            tx,
            done: false,
            metrics,
            submitted,
            last_token: None,
        }
    }

    /// The request's id.
    pub fn id(&self) -> &RequestId {
        &self.id
    }

    /// Notes an event read (or the channel's end).
    fn seen(&mut self, e: Option<&Event>) {
        let m = &self.metrics;
        match e {
            Some(Event::Text { tokens, .. }) if !tokens.is_empty() => {
                let now = Instant::now();
                m.generated_tokens
                    .fetch_add(tokens.len() as u64, std::sync::atomic::Ordering::Relaxed);
                match self.last_token {
                    None => m.ttft.observe((now - self.submitted).as_secs_f64()),
                    Some(t) => m.inter_token.observe((now - t).as_secs_f64()),
                }
                self.last_token = Some(now);
            }
            Some(Event::Text { .. } | Event::Prompt { .. }) => {}
            Some(Event::Done {
                finish_reason,
                usage,
                error,
                ..
            }) => {
                self.done = true;
                m.usage(usage);
                m.finished(&finish_reason.to_string());
                if let Some(e) = error {
                    m.error(e.error_kind());
                }
            }
            None => self.done = true,
        }
    }

    /// The next event, waiting for it (async).
    pub async fn next(&mut self) -> Option<Event> {
        let e = self.rx.recv().await;
        self.seen(e.as_ref());
        e
    }

    /// Polls for the next event (for a `Stream` adapter).
    pub fn poll_next(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<Event>> {
        let p = self.rx.poll_recv(cx);
        if let std::task::Poll::Ready(e) = &p {
            self.seen(e.as_ref());
        }
        p
    }

    /// The next event, blocking the thread (not for async contexts).
    pub fn blocking_next(&mut self) -> Option<Event> {
        let e = self.rx.blocking_recv();
        self.seen(e.as_ref());
        e
    }

    /// Collects the whole generation: its text, tokens and final event.
    pub fn blocking_collect(mut self) -> (String, Vec<TokenId>, Event) {
        let mut text = String::new();
        let mut tokens = Vec::new();
        while let Some(e) = self.blocking_next() {
            match e {
                Event::Text {
                    text: t,
                    tokens: ts,
                    ..
                } => {
                    text.push_str(&t);
                    tokens.extend(ts);
                }
                Event::Prompt { .. } => {}
                done @ Event::Done { .. } => return (text, tokens, done),
            }
        }
        (
            text,
            tokens,
            Event::Done {
                finish_reason: FinishReason::Error,
                usage: Usage::default(),
                error: Some(RuntimeError::Stopped),
                stop: None,
            },
        )
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            // A client gone before the end: cancelled, counted here since
            // its `Done` will find no reader.
            self.metrics.finished("cancelled");
            let _ = self.tx.send(Command::Cancel(self.id.clone(), None));
        }
    }
}
