//! The engine thread: one step loop over the model, in modules named for
//! their concerns:
//!
//! - `startup`: loading the model(s), building the KV store or context and
//!   the scheduler, the `ready` answer;
//! - `commands`: the loop — commands from the API between steps, panics
//!   caught at the step boundary, statistics;
//! - `admission`: validating, tokenizing and queueing a request;
//! - `kv`: where KV lives — siliceo's paged store through grafted attention
//!   (`graft`), or llama.cpp's cells kept alive by holder sequences
//!   (`holders`) — and what retiring, evicting, swapping and checking mean
//!   for each;
//! - `step`: one engine step — the scheduler's plan turned into a batch,
//!   one decode, and what a failure ends;
//! - `speculative`: drafting (n-gram, draft model, token trees) and
//!   verifying drafted tokens;
//! - `constrained`: token masks of constrained requests, computed beside
//!   decode;
//! - `output`: sampling, streaming, and ending requests.

mod admission;
mod commands;
mod constrained;
mod graft;
mod holders;
mod kv;
mod output;
mod speculative;
mod startup;
mod step;

use std::collections::HashMap;
use std::time::Instant;

use siliceo_core::{RequestId, Sampler, SeqId, TokenId};
use siliceo_engine::{Batch, Model, TokenText};
use siliceo_kv_paging::CacheKeys;
use siliceo_scheduler::Scheduler;
use tokio::sync::mpsc::UnboundedSender;

use crate::{Event, Usage};

pub(crate) use startup::{Started, run};
pub use startup::{WindowedPools, plan_windowed_store, store_plan, store_split, windowed_pools};

use constrained::{Constrained, MaskStats};
use kv::{Kv, Saved};
use speculative::{DraftModel, Spec};

/// Logits a step wants read back for one request: the decode (or last
/// prefill) token's, then one per drafted token.
struct Want {
    id: RequestId,
    idx: Vec<usize>,
    drafts: Vec<TokenId>,
    /// Position of the token whose logits come first.
    pos: usize,
    /// Drafted branches verified as a token tree (`drafts` is then their
    /// concatenation and `idx[1..]` their nodes' logits, in the same order).
    tree: Option<TreeWant>,
}

/// A token tree in the batch: branch 0 runs in the request's own sequence;
/// on llama.cpp's cells branch b > 0 in a temporary sequence id holding a
/// copy of its context, on our store in this step's branch blocks
/// (`graft[b - 1]`). A draft model's second branch is in a temporary
/// sequence of its context (`temps[0]`) on either.
struct TreeWant {
    branches: Vec<Vec<TokenId>>,
    temps: Vec<SeqId>,
    graft: Vec<graft::Branch>,
}

/// A running or waiting request, as the engine thread keeps it.
struct Live<'m> {
    tx: UnboundedSender<Event>,
    spec: Option<Spec>,
    draft_tokens: u32,
    accepted_draft_tokens: u32,
    speculative_steps: u32,
    sampler: Sampler,
    /// Its constraint's matcher (`None`: unconstrained; taken out while its
    /// next mask is computed beside a decode).
    constraint: Option<Constrained>,
    /// Top alternatives to report with each token's log-probability.
    logprobs: Option<u32>,
    /// The prompt's log-probabilities being gathered (requests with
    /// `prompt_logprobs`).
    prompt_lp: Option<PromptLogprobs>,
    text: TokenText<'m>,
    /// Send the stop string that ended it, as text, before `Done`.
    include_stop: bool,
    /// `min_tokens`: until it has generated so many, these tokens (its
    /// end-of-generation and stop tokens) are banned.
    min_tokens: u32,
    banned: Vec<TokenId>,
    /// The logits with `banned` masked.
    ban_buf: Vec<f32>,
    /// Its thinking budget while it has work (dropped once the block
    /// closed or the answer began).
    think: Option<crate::think_budget::ThinkBudget>,
    /// Its sequence id while it runs (the draft model's cells, a grafted
    /// step's sequence, llama.cpp's cells).
    seq: Option<SeqId>,
    /// Its KV while swapped out.
    snapshot: Option<Saved>,
    prompt_tokens: u32,
    cached_prompt_tokens: u32,
    completion_tokens: u32,
    submitted: Instant,
    first_scheduled: Option<Instant>,
    first_token: Option<Instant>,
}

/// A request's prompt log-probabilities, gathered chunk by chunk as its
/// prompt is computed.
struct PromptLogprobs {
    /// Alternatives per token.
    top: u32,
    /// The prompt.
    tokens: Vec<TokenId>,
    /// `got[i]`: the log-probability of `tokens[i + 1]`.
    got: Vec<crate::TokenLogprob>,
    /// The event went out.
    sent: bool,
    /// Nothing is generated after it (`max_tokens` 0).
    only: bool,
}

impl Live<'_> {
    fn usage(&self) -> Usage {
        let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_millis() as u64;
        let now = Instant::now();
        Usage {
            prompt_tokens: self.prompt_tokens,
            cached_prompt_tokens: self.cached_prompt_tokens,
            completion_tokens: self.completion_tokens,
            queue_ms: self.first_scheduled.map_or(0, |t| ms(self.submitted, t)),
            ttft_ms: self.first_token.map_or(0, |t| ms(self.submitted, t)),
            decode_ms: self.first_token.map_or(0, |t| ms(t, now)),
            draft_tokens: self.draft_tokens,
            accepted_draft_tokens: self.accepted_draft_tokens,
            speculative_steps: self.speculative_steps,
        }
    }
}

struct Engine<'m> {
    model: &'m Model,
    kv: Kv<'m>,
    sched: Scheduler,
    keys: CacheKeys,
    live: HashMap<RequestId, Live<'m>>,
    /// Request sequence ids not in use (`0..max_running`).
    free_seqs: Vec<SeqId>,
    max_running: u32,
    /// Longest prompt plus generation, in tokens.
    max_seq_len: usize,
    block_size: u32,
    speculative: Option<crate::SpeculativeConfig>,
    draft: Option<DraftModel<'m>>,
    epoch: Instant,
    batch: Batch,
    steps: u64,
    step_us: u64,
    decode_us: u64,
    panics: u64,
    tree_verifications: u64,
    tree_later_branches_kept: u64,
    spec_cost_pauses: u64,
    /// Compute constrained requests' masks beside `decode` (else after it).
    constraint_overlap: bool,
    mask_stats: MaskStats,
    /// Whether earlier requests found the draft model losing (draft model only).
    draft_memory: siliceo_speculative::DraftCostMemory,
    /// Where the prefix cache's changes are published after every step.
    kv_events: std::sync::Arc<crate::kv_events::KvEventHub>,
}

impl Engine<'_> {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}
