use std::collections::HashMap;

use siliceo_core::{Priority, RequestId, TokenId};
use siliceo_kv_paging::{BlockCount, BlockId, BlockOp, CacheKeys, KvConfig, KvGroups, SeqHandle};

/// Limits and policy knobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most tokens computed in one step (decodes plus prefill chunks).
    pub max_batch_tokens: usize,
    /// Most sequences running at once (≤ the engine's free sequence ids).
    pub max_running_seqs: usize,
    /// Most requests waiting; beyond it [`Scheduler::add`] refuses.
    pub max_waiting: usize,
    /// Longest sequence (prompt plus generation) in tokens.
    pub max_seq_len: usize,
    /// A waiting request rises one priority class per this many ms.
    pub aging_ms: u64,
    /// Sequences with fewer computed tokens than this are recomputed rather
    /// than swapped when preempted (re-prefilling them is cheap).
    pub recompute_below_tokens: usize,
    /// Tokens that may sit swapped out in host memory at once.
    pub swap_budget_tokens: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_batch_tokens: 512,
            max_running_seqs: 16,
            max_waiting: 1024,
            max_seq_len: 8192,
            aging_ms: 10_000,
            recompute_below_tokens: 256,
            swap_budget_tokens: 65_536,
        }
    }
}

/// A request as the scheduler sees it.
#[derive(Debug, Clone)]
pub struct Request {
    /// Its id.
    pub id: RequestId,
    /// Prompt tokens.
    pub prompt: Vec<TokenId>,
    /// Most tokens to generate.
    pub max_new_tokens: u32,
    /// Prefix-cache keys (model, KV format, tenant salt).
    pub keys: CacheKeys,
    /// Scheduling class.
    pub priority: Priority,
    /// When it arrived (ms, the caller's clock).
    pub arrival_ms: u64,
    /// When it must be done by (ms), if ever.
    pub deadline_ms: Option<u64>,
    /// Whether its prompt may start from cached blocks (the default). A
    /// request that reads every prompt position's logits (prompt
    /// log-probabilities) computes its whole prompt.
    pub reuse_prefix: bool,
    /// Most tokens of it one step computes (`usize::MAX`: the step's budget
    /// is the only limit). Bounds the logits a step reads back for a request
    /// that wants every position's.
    pub max_chunk: usize,
}

impl Request {
    /// A request without a deadline.
    pub fn new(
        id: RequestId,
        prompt: Vec<TokenId>,
        max_new_tokens: u32,
        keys: CacheKeys,
        priority: Priority,
        arrival_ms: u64,
    ) -> Self {
        Request {
            id,
            prompt,
            max_new_tokens,
            keys,
            priority,
            arrival_ms,
            deadline_ms: None,
            reuse_prefix: true,
            max_chunk: usize::MAX,
        }
    }

    /// The same request computing every prompt token itself, in steps of at
    /// most `max_chunk` tokens: no cached prefix is reused (its blocks are
    /// still offered to the cache for later requests).
    pub fn computing_whole_prompt(mut self, max_chunk: usize) -> Self {
        self.reuse_prefix = false;
        self.max_chunk = max_chunk.max(1);
        self
    }

    /// The same request with a deadline.
    pub fn with_deadline(mut self, deadline_ms: u64) -> Self {
        self.deadline_ms = Some(deadline_ms);
        self
    }
}

/// Why [`Scheduler::add`] refused a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Rejected {
    /// The prompt is empty.
    #[error("request {0}: the prompt is empty")]
    EmptyPrompt(RequestId),
    /// A request with this id is already in the scheduler.
    #[error("request {0}: a request with this id is already queued or running")]
    DuplicateId(RequestId),
    /// The prompt is longer than a sequence may be.
    #[error(
        "request {id}: prompt of {tokens} tokens does not fit a sequence of at most {max_seq_len} tokens"
    )]
    PromptTooLong {
        /// The request.
        id: RequestId,
        /// Prompt length.
        tokens: usize,
        /// The limit.
        max_seq_len: usize,
    },
    /// The prompt needs more KV blocks than the whole cache has.
    #[error("request {id}: the prompt needs {needed} KV blocks, the cache has {total}")]
    TooLargeForCache {
        /// The request.
        id: RequestId,
        /// Blocks needed.
        needed: usize,
        /// Blocks in the cache.
        total: usize,
    },
    /// The waiting queue is full.
    #[error("request {0}: the queue is full")]
    QueueFull(RequestId),
}

impl Rejected {
    /// A stable, short label for metrics.
    pub fn error_kind(&self) -> &'static str {
        match self {
            Rejected::EmptyPrompt(_) => "empty_prompt",
            Rejected::DuplicateId(_) => "duplicate_id",
            Rejected::PromptTooLong { .. } => "prompt_too_long",
            Rejected::TooLargeForCache { .. } => "too_large_for_cache",
            Rejected::QueueFull(_) => "queue_full",
        }
    }
}

/// How a preempted sequence will come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptMode {
    /// Save its KV to host memory now; restore it on resumption.
    Swap,
    /// Drop its KV; recompute prompt and generated tokens on resumption.
    Recompute,
}

/// A sequence preempted in this step: the runtime saves its KV (swap) or just
/// drops it (recompute), then frees its engine sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preempted {
    /// The request.
    pub id: RequestId,
    /// How it comes back.
    pub mode: PreemptMode,
    /// Tokens of KV it held (what a swap saves).
    pub tokens: usize,
    /// Its block table when it was preempted (now released). Blocks that are
    /// still cached hold KV other requests may reuse: a runtime keeps their
    /// cells before dropping the sequence.
    pub blocks: Vec<BlockId>,
    /// The block work of its share of this step, undone: the table already
    /// has its seals, so a block sealed there is still read (and saved) from
    /// the seal's source at `tokens`.
    pub ops: Vec<BlockOp>,
}

/// Why the scheduler ended a request on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishCause {
    /// `max_new_tokens` generated or `max_seq_len` reached.
    Length,
    /// Its deadline passed.
    Deadline,
}

/// A request the scheduler ended on its own while planning a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    /// The request.
    pub id: RequestId,
    /// Why.
    pub cause: FinishCause,
    /// Its block table when it ended (now released); see [`Preempted::blocks`].
    pub blocks: Vec<BlockId>,
}

/// What an item of a step asks the engine to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ItemKind {
    /// Compute prompt (or recomputed) tokens; `cached_tokens` were served from
    /// the prefix cache (reported on the first chunk only).
    Prefill {
        /// Prompt tokens found in the prefix cache.
        cached_tokens: usize,
    },
    /// Compute the last sampled token.
    Decode,
    /// Restore a swapped-out sequence's KV (no tokens computed).
    ResumeSwap,
}

/// One sequence's share of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepItem {
    /// The request.
    pub id: RequestId,
    /// Its block table handle in [`Scheduler::kv`].
    pub handle: SeqHandle,
    /// What to do.
    pub kind: ItemKind,
    /// Position of the first token in `tokens`.
    pub start_pos: usize,
    /// Tokens to compute, in order.
    pub tokens: Vec<TokenId>,
    /// Whether the last token's logits are needed (a token will be sampled and
    /// reported back with [`Scheduler::on_token`]).
    pub wants_logits: bool,
    /// Slots reserved after a decode token for drafted (speculative) tokens,
    /// counted in this step's token budget and blocks; see
    /// [`Scheduler::set_draft_len`] and [`Scheduler::on_tokens`]. They never
    /// reach a seal ([`KvGroups::tokens_until_seal`]).
    pub draft_slots: usize,
    /// Block work this item's table changes imply, in order: copies of shared
    /// partial blocks and seals ([`BlockOp`]), to do before its tokens are
    /// computed (seals at the lengths they name). Not for `ResumeSwap` items,
    /// whose bytes are restored.
    pub ops: Vec<BlockOp>,
}

/// The plan of one engine step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Step {
    /// Sequences to run, highest priority first.
    pub items: Vec<StepItem>,
    /// Sequences preempted; handle these before running `items`.
    pub preempted: Vec<Preempted>,
    /// Requests the scheduler ended (deadlines), already freed.
    pub finished: Vec<Finished>,
    /// Cached blocks evicted while planning this step (their old content is
    /// gone; drop whatever held it before running `items`).
    pub evicted: Vec<BlockId>,
}

impl Step {
    /// Tokens computed by this step.
    pub fn num_tokens(&self) -> usize {
        self.items.iter().map(|i| i.tokens.len()).sum()
    }
}

/// Counts for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Requests waiting (new or preempted).
    pub waiting: usize,
    /// Requests running.
    pub running: usize,
    /// Tokens of swapped-out KV held in host memory.
    pub swapped_tokens: usize,
    /// Preemptions so far.
    pub preemptions: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    Running,
    Swapped,
}

#[derive(Debug)]
struct Entry {
    req: Request,
    /// Prompt and generated tokens.
    tokens: Vec<TokenId>,
    generated: u32,
    /// Tokens whose KV is computed or scheduled in the current step.
    computed: usize,
    handle: Option<SeqHandle>,
    state: State,
    /// Admission order, for "most recently started".
    started: u64,
    /// Insertion order, for a stable FCFS tie-break.
    order: u64,
    admitted_once: bool,
    awaiting_token: bool,
    /// Admitted in the step being planned (never preempted by that step's admissions).
    admitted_now: bool,
    /// Drafted tokens wanted after the next decode token.
    draft_len: usize,
    /// Draft slots planned in the current step.
    draft_planned: usize,
    /// Tokens computed before the current step (committed to the cache).
    computed_before: usize,
}

/// The scheduler. See the crate docs.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvGroups,
    entries: HashMap<RequestId, Entry>,
    running: Vec<RequestId>,
    counter: u64,
    swapped_tokens: usize,
    preemptions: u64,
}

fn class(p: Priority) -> u64 {
    match p {
        Priority::Interactive => 0,
        Priority::Normal => 1,
        Priority::Batch => 2,
    }
}

impl Scheduler {
    /// A scheduler over a fresh KV cache.
    pub fn new(cfg: SchedulerConfig, kv: KvConfig) -> Self {
        let mut manager = KvGroups::new(kv);
        manager.set_eviction_log(kv.prefix_caching);
        manager.set_kv_events(kv.prefix_caching);
        Scheduler {
            cfg,
            kv: manager,
            entries: HashMap::new(),
            running: Vec::new(),
            counter: 0,
            swapped_tokens: 0,
            preemptions: 0,
        }
    }

    /// The KV bookkeeping (block tables, cache counters).
    pub fn kv(&self) -> &KvGroups {
        &self.kv
    }

    /// The prefix cache's changes since the last call (see
    /// [`KvGroups::take_kv_events`]); on whenever prefix caching is.
    /// The caller drains them after every step.
    pub fn take_kv_events(&mut self) -> Vec<siliceo_kv_paging::KvEvent> {
        self.kv.take_kv_events()
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Queues a request, or refuses it with a reason.
    pub fn add(&mut self, req: Request) -> Result<(), Rejected> {
        let id = req.id.clone();
        if req.prompt.is_empty() {
            return Err(Rejected::EmptyPrompt(id));
        }
        if self.entries.contains_key(&id) {
            return Err(Rejected::DuplicateId(id));
        }
        if req.prompt.len() >= self.cfg.max_seq_len {
            return Err(Rejected::PromptTooLong {
                id,
                tokens: req.prompt.len(),
                max_seq_len: self.cfg.max_seq_len,
            });
        }
        let needed = self.kv.blocks_for_sequence(req.prompt.len() + 1);
        let total = self.kv.capacity();
        if !needed.fits(total) {
            return Err(Rejected::TooLargeForCache {
                id,
                needed: needed.total(),
                total: total.total(),
            });
        }
        let waiting = self.entries.len() - self.running.len();
        if waiting >= self.cfg.max_waiting {
            return Err(Rejected::QueueFull(id));
        }
        self.counter += 1;
        self.entries.insert(
            id,
            Entry {
                tokens: req.prompt.clone(),
                req,
                generated: 0,
                computed: 0,
                handle: None,
                state: State::Waiting,
                started: 0,
                order: self.counter,
                admitted_once: false,
                awaiting_token: false,
                admitted_now: false,
                draft_len: 0,
                draft_planned: 0,
                computed_before: 0,
            },
        );
        Ok(())
    }

    /// Whether a request is known (waiting or running).
    pub fn contains(&self, id: &RequestId) -> bool {
        self.entries.contains_key(id)
    }

    /// Whether nothing is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.entries.is_empty()
    }

    /// The block table handle of a running request.
    pub fn handle(&self, id: &RequestId) -> Option<SeqHandle> {
        self.entries.get(id).and_then(|e| e.handle)
    }

    /// Counts for metrics.
    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            waiting: self.entries.len() - self.running.len(),
            running: self.running.len(),
            swapped_tokens: self.swapped_tokens,
            preemptions: self.preemptions,
        }
    }

    /// Removes a request; its computed full blocks are committed to the
    /// prefix cache first unless `commit` is false (their KV is not trusted).
    fn release(&mut self, id: &RequestId, commit: bool) -> Option<Entry> {
        let e = self.entries.remove(id)?;
        if let Some(h) = e.handle {
            if commit {
                self.kv.commit(h, e.computed);
            }
            self.kv.free(h);
        }
        if e.state == State::Swapped {
            self.swapped_tokens -= e.computed;
        }
        self.running.retain(|r| r != id);
        Some(e)
    }

    /// Cancels a request wherever it is; its blocks are free when this returns.
    /// Returns false for an unknown id.
    pub fn cancel(&mut self, id: &RequestId) -> bool {
        self.release(id, true).is_some()
    }

    /// Ends a request whose last step failed in the engine: frees its blocks
    /// without committing the failed step's blocks to the prefix cache.
    pub fn abort(&mut self, id: &RequestId) -> bool {
        self.release(id, false).is_some()
    }

    /// Forgets the cached prefix of block `b` (e.g. when the engine cannot keep
    /// its KV). Returns false when it was not cached.
    pub fn uncache(&mut self, b: BlockId) -> bool {
        self.kv.uncache(b)
    }

    /// Ends a running request (end-of-sequence, stop string, error) and frees
    /// its blocks. Same as [`Scheduler::cancel`]; named for intent.
    pub fn finish(&mut self, id: &RequestId) -> bool {
        self.release(id, true).is_some()
    }

    /// Asks for up to `k` drafted tokens after each decode token of `id`
    /// (0: no speculation). The scheduler plans fewer when the request is near
    /// its length limit, or none when blocks are short.
    pub fn set_draft_len(&mut self, id: &RequestId, k: usize) {
        if let Some(e) = self.entries.get_mut(id) {
            e.draft_len = k;
        }
    }

    /// Reports the token sampled for an item that wanted logits. Returns the
    /// request, now finished and freed, when it reached `max_new_tokens` or
    /// `max_seq_len` (cause `Length`).
    pub fn on_token(&mut self, id: &RequestId, token: TokenId) -> Option<Finished> {
        self.on_tokens(id, &[], token)
    }

    /// Reports a verified speculative step: `accepted` drafted tokens (at most
    /// the item's `draft_slots`; their KV was computed in the step and is kept)
    /// and the target's `next` token. Unused draft slots are released. Returns
    /// the request, finished and freed, when it reached its length limit.
    ///
    /// # Panics
    /// When more tokens are accepted than slots were planned.
    pub fn on_tokens(
        &mut self,
        id: &RequestId,
        accepted: &[TokenId],
        next: TokenId,
    ) -> Option<Finished> {
        let max_seq_len = self.cfg.max_seq_len;
        let e = self.entries.get_mut(id)?;
        debug_assert!(
            e.awaiting_token,
            "{id}: token reported without a request for logits"
        );
        assert!(
            accepted.len() <= e.draft_planned,
            "{id}: {} drafted tokens accepted, {} slots planned",
            accepted.len(),
            e.draft_planned
        );
        e.awaiting_token = false;
        if e.draft_planned > 0 {
            if let Some(h) = e.handle {
                // Their rows were written into the reserved slots by the step.
                self.kv.accept_lookahead(h, accepted);
                // Give back the slots of rejected drafts.
                let n = self.kv.num_tokens(h);
                self.kv.truncate(h, n);
            }
            e.draft_planned = 0;
        }
        e.tokens.extend_from_slice(accepted);
        e.computed += accepted.len();
        e.generated += accepted.len() as u32;
        e.tokens.push(next);
        e.generated += 1;
        if e.generated >= e.req.max_new_tokens || e.tokens.len() >= max_seq_len {
            let blocks = e
                .handle
                .map(|h| self.kv.block_table(h).to_vec())
                .unwrap_or_default();
            self.release(id, true);
            return Some(Finished {
                id: id.clone(),
                cause: FinishCause::Length,
                blocks,
            });
        }
        None
    }

    /// Class a waiting request competes with: its own, raised one class per
    /// `aging_ms` waited.
    fn effective_class(&self, e: &Entry, now_ms: u64) -> u64 {
        let waited = now_ms.saturating_sub(e.req.arrival_ms);
        class(e.req.priority).saturating_sub(waited / self.cfg.aging_ms.max(1))
    }

    /// The running request to preempt first: lowest class, most recently started.
    /// Requests admitted in the step being planned are not candidates: they
    /// hold no engine state yet, and evicting them would only churn.
    fn victim(&self) -> Option<RequestId> {
        self.running
            .iter()
            .filter(|id| !self.entries[*id].admitted_now)
            .max_by_key(|id| {
                let e = &self.entries[*id];
                (class(e.req.priority), e.started)
            })
            .cloned()
    }

    /// Blocks that preempting every running request of a class below `class_`
    /// would free (blocks shared with other sequences stay taken).
    fn reclaimable_below(&self, class_: u64) -> BlockCount {
        self.running
            .iter()
            .map(|id| &self.entries[id])
            .filter(|e| !e.admitted_now && class(e.req.priority) > class_)
            .filter_map(|e| e.handle)
            .fold(BlockCount::default(), |n, h| {
                n + self.kv.exclusive_blocks(h)
            })
    }

    fn preempt(&mut self, id: &RequestId, step: &mut Step, budget: &mut usize) {
        // Undo its share of this step, if it had one.
        let mut ops = Vec::new();
        if let Some(pos) = step.items.iter().position(|i| &i.id == id) {
            let item = step.items.remove(pos);
            ops = item.ops;
            *budget += item.tokens.len() + item.draft_slots;
            let e = self.entries.get_mut(id).expect("running entry");
            e.computed -= item.tokens.len();
            e.awaiting_token = false;
            e.draft_planned = 0;
        }
        let e = self.entries.get_mut(id).expect("running entry");
        let held = e.computed;
        // A windowed group's sequence is recomputed: restoring saved KV
        // would append all of it in one go, more than a window's worth.
        let swap = self.kv.windowed().is_none()
            && held >= self.cfg.recompute_below_tokens
            && self.swapped_tokens + held <= self.cfg.swap_budget_tokens;
        let mode = if swap {
            PreemptMode::Swap
        } else {
            PreemptMode::Recompute
        };
        let mut blocks = Vec::new();
        if let Some(h) = e.handle.take() {
            self.kv.commit(h, held);
            blocks = self.kv.block_table(h).to_vec();
            self.kv.free(h);
        }
        if swap {
            e.state = State::Swapped;
            self.swapped_tokens += held;
        } else {
            e.state = State::Waiting;
            e.computed = 0;
        }
        self.running.retain(|r| r != id);
        self.preemptions += 1;
        step.preempted.push(Preempted {
            id: id.clone(),
            mode,
            tokens: held,
            blocks,
            ops,
        });
    }

    /// Schedules `id`'s next chunk (at most `budget` tokens), preempting others
    /// (or itself) when blocks run short. `ops` are block work already owed
    /// (a prefix match's seals), put in the item. Returns false if it was
    /// preempted.
    fn schedule_chunk(
        &mut self,
        id: &RequestId,
        step: &mut Step,
        budget: &mut usize,
        kind: ItemKind,
        mut ops: Vec<BlockOp>,
    ) -> bool {
        loop {
            let e = &self.entries[id];
            let n = (e.tokens.len() - e.computed)
                .min(*budget)
                .min(e.req.max_chunk);
            if n == 0 {
                return true;
            }
            let handle = e.handle.expect("running entry has blocks");
            let chunk = e.tokens[e.computed..e.computed + n].to_vec();
            match self.kv.append_pending(handle, &chunk) {
                Ok(more) => {
                    ops.extend(more);
                    if kind == ItemKind::Decode {
                        // The prompt's reservation is used up.
                        self.kv.release_spare(handle);
                    }
                    // Draft slots after a decode token: within the budget, the
                    // length limits, the next seal, and blocks that are free
                    // now (no preemption for drafts).
                    let e = &self.entries[id];
                    let mut drafts = 0;
                    if kind == ItemKind::Decode && e.draft_len > 0 {
                        let left_new = (e.req.max_new_tokens - e.generated) as usize;
                        let left_len = self.cfg.max_seq_len.saturating_sub(e.tokens.len());
                        let k = e
                            .draft_len
                            .min(*budget - n)
                            .min(left_new.saturating_sub(1))
                            .min(left_len.saturating_sub(1))
                            .min(self.kv.tokens_until_seal(handle));
                        if k > 0 && self.kv.reserve_lookahead(handle, k).is_ok() {
                            drafts = k;
                        }
                    }
                    let e = self.entries.get_mut(id).expect("entry");
                    let start = e.computed;
                    e.computed += n;
                    let wants_logits = e.computed == e.tokens.len();
                    e.awaiting_token = wants_logits;
                    e.draft_planned = drafts;
                    *budget -= n + drafts;
                    step.items.push(StepItem {
                        id: id.clone(),
                        handle,
                        kind,
                        start_pos: start,
                        tokens: chunk,
                        wants_logits,
                        draft_slots: drafts,
                        ops,
                    });
                    return true;
                }
                Err(_) => {
                    // Admissions hold their blocks in advance, so only a
                    // sequence that ran before this step can run short here
                    // (or, with a windowed group, which sets nothing aside,
                    // any sequence where its pool is smaller than its
                    // running sequences need).
                    let victim = self.victim().expect("at least this request runs");
                    self.preempt(&victim, step, budget);
                    if &victim == id {
                        return false;
                    }
                }
            }
        }
    }

    /// The step last planned has run: releases the blocks it read and sealed
    /// or copied away. [`schedule`](Self::schedule) does it too; call this
    /// after each step so an idle engine holds none.
    pub fn step_done(&mut self) {
        self.kv.finish_step();
    }

    /// Plans the next engine step at time `now_ms`.
    pub fn schedule(&mut self, now_ms: u64) -> Step {
        let mut step = Step::default();
        // The last step has run: the open blocks it sealed away can go.
        self.kv.finish_step();
        for e in self.entries.values_mut() {
            e.admitted_now = false;
            // What the last step planned has been computed: its full blocks
            // may now be matched by others.
            if let Some(h) = e.handle {
                self.kv.commit(h, e.computed);
            }
            e.computed_before = e.computed;
        }
        // Deadlines first: whatever expired is freed now.
        let mut expired: Vec<RequestId> = self
            .entries
            .iter()
            .filter(|(_, e)| e.req.deadline_ms.is_some_and(|d| d <= now_ms))
            .map(|(id, _)| id.clone())
            .collect();
        expired.sort();
        for id in expired {
            let blocks = self
                .entries
                .get(&id)
                .and_then(|e| e.handle)
                .map(|h| self.kv.block_table(h).to_vec())
                .unwrap_or_default();
            self.release(&id, true);
            step.finished.push(Finished {
                id,
                cause: FinishCause::Deadline,
                blocks,
            });
        }

        let mut budget = self.cfg.max_batch_tokens;
        // Running sequences, highest priority and earliest started first.
        let mut order = self.running.clone();
        order.sort_by_key(|id| {
            let e = &self.entries[id];
            (class(e.req.priority), e.started)
        });
        // Decodes before prefill chunks, so a long prompt never stalls them.
        let (decodes, prefills): (Vec<_>, Vec<_>) = order.into_iter().partition(|id| {
            let e = &self.entries[id];
            e.computed + 1 == e.tokens.len() && e.admitted_once && e.generated > 0
        });
        let planned = decodes.iter().map(|id| (id, ItemKind::Decode)).chain(
            prefills
                .iter()
                .map(|id| (id, ItemKind::Prefill { cached_tokens: 0 })),
        );
        for (id, kind) in planned {
            if budget == 0 {
                break;
            }
            // Preempted earlier in this step, or the runtime still owes a token.
            let gone = self
                .entries
                .get(id)
                .is_none_or(|e| e.state != State::Running || e.awaiting_token);
            if gone {
                continue;
            }
            self.schedule_chunk(id, &mut step, &mut budget, kind, Vec::new());
        }

        // Admissions, best effective class first, FCFS inside a class.
        let mut deferred: Vec<RequestId> = Vec::new();
        while budget > 0 && self.running.len() < self.cfg.max_running_seqs {
            let Some(id) = self.best_waiting(now_ms, &step, &deferred) else {
                break;
            };
            // A request whose next uncached block a running request is
            // computing right now waits: in a step or two it finds that block
            // in the cache instead of computing it a second time.
            if self.prefix_in_flight(&id) {
                deferred.push(id);
                continue;
            }
            if !self.admit(&id, &mut step, &mut budget) {
                break;
            }
        }
        step.evicted = self.kv.take_evicted();
        step
    }

    /// Whether a running request is computing (not yet committed) the block
    /// that follows the cached prefix of waiting request `id`'s prompt.
    fn prefix_in_flight(&self, id: &RequestId) -> bool {
        let e = &self.entries[id];
        if e.state != State::Waiting || !self.kv.config().prefix_caching || !e.req.reuse_prefix {
            return false;
        }
        let bs = self.kv.config().block_size as usize;
        let root = e.req.keys.root_hash();
        let hit = self.kv.peek_prefix(root, &e.tokens);
        let end = (hit / bs + 1) * bs;
        // Only a full block before the prompt's last token can be reused.
        if end >= e.tokens.len() {
            return false;
        }
        // Running requests that had not computed that block before this step
        // (a block computed earlier but not cached — a duplicate — never will
        // be, so nobody waits for it).
        self.running.iter().any(|r| {
            let o = &self.entries[r];
            o.req.keys.root_hash() == root
                && o.computed_before < end
                && o.tokens.len() >= end
                && o.tokens[..end] == e.tokens[..end]
        })
    }

    fn best_waiting(&self, now_ms: u64, step: &Step, deferred: &[RequestId]) -> Option<RequestId> {
        self.entries
            .iter()
            .filter(|(id, e)| {
                e.state != State::Running
                    && !step.preempted.iter().any(|p| &p.id == *id)
                    && !deferred.contains(id)
            })
            .min_by_key(|(_, e)| (self.effective_class(e, now_ms), e.req.arrival_ms, e.order))
            .map(|(id, _)| id.clone())
    }

    /// Tries to admit `id`, preempting strictly lower-class running requests if
    /// needed. Returns false when it cannot be admitted now.
    fn admit(&mut self, id: &RequestId, step: &mut Step, budget: &mut usize) -> bool {
        loop {
            let e = &self.entries[id];
            let needed = match e.state {
                State::Swapped => self.kv.blocks_for_sequence(e.computed + 1),
                _ if !e.req.reuse_prefix => self.kv.blocks_for_sequence(e.tokens.len() + 1),
                _ => self.kv.blocks_needed_for_prompt(&e.req.keys, &e.tokens, 1),
            };
            let free = self.kv.free_blocks();
            if needed.fits(free) {
                break;
            }
            // Only a strictly higher *base* class may preempt: aging orders
            // admissions but grants no preemption rights, so preemption runs one
            // way and two requests can never take turns evicting each other.
            // And only when preempting would make it fit: evicting sequences
            // for an admission that still fails would just throw work away.
            let my_class = class(e.req.priority);
            let r = self.reclaimable_below(my_class);
            let could = free + r;
            if !needed.fits(could) {
                return false;
            }
            match self.victim() {
                Some(v) if class(self.entries[&v].req.priority) > my_class => {
                    self.preempt(&v, step, budget)
                }
                _ => return false,
            }
        }
        self.counter += 1;
        let started = self.counter;
        let e = self.entries.get_mut(id).expect("entry");
        let handle = self.kv.new_sequence(&e.req.keys);
        e.handle = Some(handle);
        e.started = started;
        e.admitted_now = true;
        self.running.push(id.clone());
        if e.state == State::Swapped {
            // The runtime restores the saved KV; blocks are accounted for it now.
            let held = e.computed;
            e.state = State::Running;
            self.swapped_tokens -= held;
            let tokens = e.tokens[..held].to_vec();
            // The runtime restores the bytes; the ops only say where they go.
            let ops = self
                .kv
                .append_pending(handle, &tokens)
                .expect("blocks checked above");
            step.items.push(StepItem {
                id: id.clone(),
                handle,
                kind: ItemKind::ResumeSwap,
                start_pos: 0,
                tokens: Vec::new(),
                wants_logits: false,
                draft_slots: 0,
                ops,
            });
            return true;
        }
        e.state = State::Running;
        let (cached, ops) = if e.req.reuse_prefix {
            self.kv.match_prefix(handle, &e.tokens)
        } else {
            (0, Vec::new())
        };
        e.computed = cached;
        e.computed_before = cached;
        // Hold the blocks for the whole prompt (and the first generated token)
        // now, so chunks admitted later in this step cannot take them (in
        // the global group: a windowed group's are sized per running
        // sequence instead).
        let rest = e.tokens.len() - cached + 1;
        self.kv.reserve(handle, rest).expect("blocks checked above");
        let first = !e.admitted_once;
        e.admitted_once = true;
        let reported = if first { cached } else { 0 };
        self.schedule_chunk(
            id,
            step,
            budget,
            ItemKind::Prefill {
                cached_tokens: reported,
            },
            ops,
        )
    }

    /// Checks internal consistency (for tests): block tables match running
    /// requests, the KV cache's own invariants hold.
    pub fn check(&self) -> Result<(), String> {
        self.kv.check()?;
        if self.kv.num_sequences() != self.running.len() {
            return Err(format!(
                "{} block tables for {} running requests",
                self.kv.num_sequences(),
                self.running.len()
            ));
        }
        let mut swapped = 0;
        for (id, e) in &self.entries {
            let running = self.running.contains(id);
            if running != (e.state == State::Running) || running != e.handle.is_some() {
                return Err(format!(
                    "{id}: state {:?} disagrees with the running list",
                    e.state
                ));
            }
            if e.state == State::Swapped {
                swapped += e.computed;
            }
            if let Some(h) = e.handle
                && self.kv.num_tokens(h) != e.computed
            {
                return Err(format!(
                    "{id}: {} tokens in blocks, {} computed",
                    self.kv.num_tokens(h),
                    e.computed
                ));
            }
        }
        if swapped != self.swapped_tokens {
            return Err(format!(
                "swapped tokens {} vs counter {}",
                swapped, self.swapped_tokens
            ));
        }
        Ok(())
    }
}
