//! The engine thread: one step loop over one llama.cpp context.

use std::collections::HashMap;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use siliceo_core::{FinishReason, RequestId, Sampler, SeqId, TokenId};
use siliceo_engine::{Batch, Context, Model, SeqSnapshot, TokenText};
use siliceo_kv_paging::{BlockId, CacheKeys, KvConfig, SeqHandle};
use siliceo_scheduler::{FinishCause, ItemKind, PreemptMode, Request, Scheduler};

use siliceo_speculative::{
    AdaptiveDraftLength, DraftCostMemory, Drafter, NgramDrafter, verify_sampled,
};

use crate::holders::Holders;
use tokio::sync::mpsc::UnboundedSender;

use crate::{
    Command, Event, GenerateRequest, Input, RuntimeConfig, RuntimeError, RuntimeInfo, RuntimeStats,
    Usage,
};

/// A request's speculative state.
struct Spec {
    drafter: NgramDrafter,
    len: AdaptiveDraftLength,
    /// Prompt and generated tokens (what the drafter looks in).
    history: Vec<TokenId>,
    /// Leading tokens of `history` whose KV the draft model's context holds
    /// for this request (its sequence has the same id as in the target).
    draft_len: usize,
    /// The last step's outcome for this request: (drafted, tokens produced).
    last: Option<(bool, usize)>,
}

/// The draft model's context, on the engine thread.
struct DraftModel<'m> {
    ctx: Context<'m>,
}

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

/// A token tree in the batch: branch 0 runs in the request's own sequence,
/// branch b > 0 in a temporary sequence id holding a copy of its context.
struct TreeWant {
    branches: Vec<Vec<TokenId>>,
    temps: Vec<SeqId>,
}

struct Live<'m> {
    tx: UnboundedSender<Event>,
    spec: Option<Spec>,
    draft_tokens: u32,
    accepted_draft_tokens: u32,
    speculative_steps: u32,
    sampler: Sampler,
    text: TokenText<'m>,
    seq: Option<SeqId>,
    snapshot: Option<SeqSnapshot>,
    prompt_tokens: u32,
    cached_prompt_tokens: u32,
    completion_tokens: u32,
    submitted: Instant,
    first_scheduled: Option<Instant>,
    first_token: Option<Instant>,
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
    ctx: Context<'m>,
    sched: Scheduler,
    keys: CacheKeys,
    live: HashMap<RequestId, Live<'m>>,
    /// Request sequence ids not in use (`0..max_running`).
    free_seqs: Vec<SeqId>,
    max_running: u32,
    holders: Holders,
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
    spec_cost_pauses: u64,
    /// Whether earlier requests found the draft model losing (draft model only).
    draft_memory: DraftCostMemory,
}

fn done(
    tx: &UnboundedSender<Event>,
    finish_reason: FinishReason,
    usage: Usage,
    error: Option<RuntimeError>,
) {
    let _ = tx.send(Event::Done {
        finish_reason,
        usage,
        error,
    });
}

pub(crate) fn run(
    cfg: RuntimeConfig,
    rx: Receiver<Command>,
    ready: Sender<Result<RuntimeInfo, RuntimeError>>,
) {
    let model = match Model::load(&cfg.model_path, &cfg.model) {
        Ok(m) => m,
        Err(e) => {
            let _ = ready.send(Err(RuntimeError::Start(e.to_string())));
            return;
        }
    };
    let mut opts = cfg.context.clone();
    // llama.cpp allows 256 sequence ids: requests first, then holders.
    let max_running = cfg.scheduler.max_running_seqs.clamp(1, 256) as u32;
    let n_holders = if cfg.prefix_caching {
        cfg.prefix_holders.min(256 - max_running)
    } else {
        0
    };
    opts.n_seq_max = max_running + n_holders;
    let ctx = match Context::new(&model, opts) {
        Ok(c) => c,
        Err(e) => {
            let _ = ready.send(Err(RuntimeError::Start(e.to_string())));
            return;
        }
    };
    let n_ctx = ctx.n_ctx();
    // The draft model, when configured: same vocabulary, its own context with
    // a sequence per running request.
    let draft_model = match cfg
        .speculative
        .as_ref()
        .and_then(|c| c.draft_model.as_ref())
    {
        None => None,
        Some(path) => {
            let loaded = Model::load(path, &cfg.model).and_then(|d| {
                model.check_draft_compatible(&d)?;
                Ok(d)
            });
            match loaded {
                Ok(d) => Some(d),
                Err(e) => {
                    let _ = ready.send(Err(RuntimeError::Start(format!(
                        "draft model {}: {e}",
                        path.display()
                    ))));
                    return;
                }
            }
        }
    };
    let draft = match &draft_model {
        None => None,
        Some(d) => {
            let mut dopts = cfg.context.clone();
            dopts.n_ctx = n_ctx;
            dopts.n_seq_max = max_running;
            match Context::new(d, dopts) {
                Ok(ctx) => Some(DraftModel { ctx }),
                Err(e) => {
                    let _ = ready.send(Err(RuntimeError::Start(format!("draft context: {e}"))));
                    return;
                }
            }
        }
    };
    let mut sched_cfg = cfg.scheduler;
    sched_cfg.max_batch_tokens = sched_cfg.max_batch_tokens.min(ctx.n_batch() as usize);
    sched_cfg.max_seq_len = sched_cfg.max_seq_len.min(n_ctx as usize);
    sched_cfg.max_running_seqs = max_running as usize;
    let bs = cfg.block_size.max(1);
    // Blocks cover the context's cells, less one block of slack for where
    // llama.cpp places a batch.
    let num_blocks = (n_ctx / bs).saturating_sub(1).max(1);
    let sched = Scheduler::new(
        sched_cfg,
        KvConfig {
            num_blocks,
            block_size: bs,
            prefix_caching: n_holders > 0,
            sealing: None,
            cache_partial: false,
        },
    );
    let kv_format = format!("{}/{}", cfg.context.type_k, cfg.context.type_v);
    let info = RuntimeInfo {
        model_name: model.name().to_string(),
        architecture: model.architecture().to_string(),
        geometry: model.geometry(),
        n_ctx,
        type_k: cfg.context.type_k,
        type_v: cfg.context.type_v,
        block_size: bs,
        kv_blocks: num_blocks,
        max_running_seqs: max_running,
        prefix_caching: n_holders > 0,
        speculative: cfg.speculative.clone(),
    };
    let mut engine = Engine {
        model: &model,
        free_seqs: (0..max_running).rev().map(SeqId).collect(),
        max_running,
        holders: Holders::new(max_running, n_holders),
        block_size: bs,
        speculative: cfg.speculative.clone(),
        draft,
        ctx,
        sched,
        keys: CacheKeys::new(model.path().display().to_string(), kv_format),
        live: HashMap::new(),
        epoch: Instant::now(),
        batch: Batch::new(),
        steps: 0,
        step_us: 0,
        decode_us: 0,
        panics: 0,
        tree_verifications: 0,
        spec_cost_pauses: 0,
        draft_memory: DraftCostMemory::default(),
    };
    let _ = ready.send(Ok(info));
    tracing::info!(
        n_ctx,
        num_blocks,
        block_size = bs,
        prefix_holders = n_holders,
        "engine ready"
    );
    engine.serve(&rx);
}

impl<'m> Engine<'m> {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn serve(&mut self, rx: &Receiver<Command>) {
        loop {
            // Wait when idle; otherwise take what has arrived and step.
            let first = if self.sched.is_idle() {
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return self.shutdown(),
                }
            } else {
                None
            };
            for cmd in first.into_iter().chain(rx.try_iter()) {
                match cmd {
                    Command::Submit(req, id, tx) => {
                        // A panic while admitting fails that request only.
                        let etx = tx.clone();
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            self.submit(*req, id.clone(), tx)
                        }));
                        if r.is_err() {
                            tracing::error!(request = %id, "panic while admitting a request");
                            self.live.remove(&id);
                            self.sched.cancel(&id);
                            done(
                                &etx,
                                FinishReason::Error,
                                Usage::default(),
                                Some(RuntimeError::Engine(
                                    "internal error while admitting the request".into(),
                                )),
                            );
                        }
                    }
                    Command::Cancel(id, reply) => {
                        let known = self.live.contains_key(&id);
                        self.end(&id, FinishReason::Cancelled, None);
                        if let Some(r) = reply {
                            let _ = r.send(known);
                        }
                    }
                    Command::Tokenize(text, special, tx) => {
                        let r = self.model.tokenize(&text, special).map_err(|e| {
                            RuntimeError::InvalidRequest {
                                field: "text",
                                reason: e.to_string(),
                            }
                        });
                        let _ = tx.send(r);
                    }
                    Command::Detokenize(tokens, tx) => {
                        let r = match tokens.iter().find(|t| !self.model.is_valid_token(**t)) {
                            Some(bad) => Err(RuntimeError::InvalidRequest {
                                field: "ids",
                                reason: format!(
                                    "token id {bad} is outside the vocabulary of {}",
                                    self.model.geometry().n_vocab
                                ),
                            }),
                            None => Ok(self.model.detokenize(&tokens, false)),
                        };
                        let _ = tx.send(r);
                    }
                    Command::Stats(tx) => {
                        let _ = tx.send(self.stats());
                    }
                    Command::CheckKv(tx) => {
                        let _ = tx.send(self.check_kv());
                    }
                    Command::CancelAll => self.shutdown(),
                    Command::Shutdown => return self.shutdown(),
                }
            }
            if !self.sched.is_idle() {
                let t = Instant::now();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.step()));
                if r.is_err() {
                    self.recover_from_panic();
                }
                self.steps += 1;
                self.step_us += t.elapsed().as_micros() as u64;
            }
        }
    }

    /// After a panic inside a step nothing about its half-done state can be
    /// trusted: every request in flight ends with an error, the KV cache is
    /// cleared and the scheduler starts afresh. The engine keeps serving.
    fn recover_from_panic(&mut self) {
        self.panics += 1;
        tracing::error!(
            in_flight = self.live.len(),
            "a step panicked; failing the requests in flight and resetting the KV cache"
        );
        let err = RuntimeError::Engine("internal error; the request was aborted".into());
        for (_, mut live) in self.live.drain() {
            live.seq = None;
            done(
                &live.tx,
                FinishReason::Error,
                live.usage(),
                Some(err.clone()),
            );
        }
        self.ctx.clear();
        if let Some(d) = self.draft.as_mut() {
            d.ctx.clear();
        }
        self.sched = Scheduler::new(*self.sched.config(), self.sched.kv().config());
        self.free_seqs = (0..self.max_running).rev().map(SeqId).collect();
        self.holders = Holders::new(self.max_running, self.holders.count());
        self.batch.clear();
    }

    /// Ends every request in flight as cancelled.
    fn shutdown(&mut self) {
        let ids: Vec<RequestId> = self.live.keys().cloned().collect();
        for id in ids {
            self.end(&id, FinishReason::Cancelled, None);
        }
    }

    fn stats(&self) -> RuntimeStats {
        let s = self.sched.stats();
        let kv = self.sched.kv().stats();
        let llama_cells = (0..self.max_running)
            .map(|i| u64::from(self.ctx.seq_len(SeqId(i)).unwrap_or(0)))
            .sum();
        RuntimeStats {
            waiting: s.waiting,
            running: s.running,
            kv_used_blocks: kv.used_blocks,
            kv_free_blocks: kv.free_blocks,
            kv_cached_blocks: kv.cached_unreferenced_blocks,
            prefix_hit_tokens: kv.hit_tokens,
            prefix_miss_tokens: kv.miss_tokens,
            prefix_evictions: kv.evictions,
            seq_ids_in_use: self.max_running as usize - self.free_seqs.len(),
            held_blocks: self.holders.len(),
            llama_cells,
            preemptions: s.preemptions,
            steps: self.steps,
            step_us: self.step_us,
            decode_us: self.decode_us,
            panics: self.panics,
            tree_verifications: self.tree_verifications,
            spec_cost_pauses: self.spec_cost_pauses,
        }
    }

    fn tokens_of(&self, input: Input) -> Result<Vec<TokenId>, RuntimeError> {
        let invalid = |field, reason: String| RuntimeError::InvalidRequest { field, reason };
        let tokens = match input {
            Input::Prompt(p) => {
                if p.is_empty() {
                    return Err(invalid("prompt", "the prompt is empty".into()));
                }
                self.model
                    .tokenize(&p, true)
                    .map_err(|e| invalid("prompt", e.to_string()))?
            }
            Input::Chat(msgs) => {
                if msgs.is_empty() {
                    return Err(invalid("chat", "no messages".into()));
                }
                let text = self
                    .model
                    .apply_chat_template(&msgs, true)
                    .map_err(|e| invalid("chat", e.to_string()))?;
                self.model
                    .tokenize(&text, true)
                    .map_err(|e| invalid("chat", e.to_string()))?
            }
            Input::Tokens(t) => {
                if let Some(bad) = t.iter().find(|t| !self.model.is_valid_token(**t)) {
                    return Err(invalid(
                        "tokens",
                        format!(
                            "token id {bad} is outside the vocabulary of {}",
                            self.model.geometry().n_vocab
                        ),
                    ));
                }
                t
            }
        };
        if tokens.is_empty() {
            return Err(invalid("prompt", "the prompt is empty".into()));
        }
        let n_ctx = self.ctx.n_ctx() as usize;
        if tokens.len() >= n_ctx {
            return Err(invalid(
                "prompt",
                format!(
                    "prompt of {} tokens does not fit the context of {n_ctx} tokens",
                    tokens.len()
                ),
            ));
        }
        Ok(tokens)
    }

    fn submit(&mut self, req: GenerateRequest, id: RequestId, tx: UnboundedSender<Event>) {
        let submitted = Instant::now();
        let fail = |e: RuntimeError| done(&tx, FinishReason::Error, Usage::default(), Some(e));
        if let Err(siliceo_core::Error::InvalidParameter { field, reason }) =
            req.sampling.validate()
        {
            return fail(RuntimeError::InvalidRequest { field, reason });
        }
        if self.live.contains_key(&id) {
            return fail(RuntimeError::Rejected {
                kind: "duplicate_id",
                reason: format!("request {id} is already running"),
            });
        }
        let tokens = match self.tokens_of(req.input) {
            Ok(t) => t,
            Err(e) => return fail(e),
        };
        let now = self.now_ms();
        let keys = match &req.cache_salt {
            Some(salt) if !salt.is_empty() => self.keys.clone().with_salt(salt.clone()),
            _ => self.keys.clone(),
        };
        let mut sreq = Request::new(
            id.clone(),
            tokens.clone(),
            req.sampling.max_tokens,
            keys,
            req.priority,
            now,
        );
        if let Some(d) = req.deadline {
            sreq = sreq.with_deadline(now + d.as_millis() as u64);
        }
        if let Err(r) = self.sched.add(sreq) {
            return fail(RuntimeError::Rejected {
                kind: r.error_kind(),
                reason: r.to_string(),
            });
        }
        let mut sampler = Sampler::new(&req.sampling);
        for &t in &tokens {
            sampler.accept(t);
        }
        let spec = match (&self.speculative, req.speculative) {
            (Some(c), true) => Some(Spec {
                drafter: NgramDrafter::default(),
                len: match (c.fixed_draft, c.cost_switch_off) {
                    (true, _) => AdaptiveDraftLength::fixed(c.max_draft, c.max_batch),
                    (false, true) => {
                        let len = AdaptiveDraftLength::new(
                            1,
                            c.max_draft,
                            c.max_draft.min(4),
                            c.max_batch,
                        );
                        // A draft model that lost for earlier requests starts paused.
                        if self.draft.is_some() {
                            self.draft_memory.start(len)
                        } else {
                            len
                        }
                    }
                    (false, false) => {
                        AdaptiveDraftLength::new(1, c.max_draft, c.max_draft.min(4), c.max_batch)
                            .without_cost()
                    }
                },
                history: tokens.clone(),
                draft_len: 0,
                last: None,
            }),
            _ => None,
        };
        self.live.insert(
            id,
            Live {
                tx,
                spec,
                draft_tokens: 0,
                accepted_draft_tokens: 0,
                speculative_steps: 0,
                sampler,
                text: TokenText::new(self.model, &req.sampling),
                seq: None,
                snapshot: None,
                prompt_tokens: tokens.len() as u32,
                cached_prompt_tokens: 0,
                completion_tokens: 0,
                submitted,
                first_scheduled: None,
                first_token: None,
            },
        );
    }

    /// Gives up a request's engine sequence: every block of `blocks` that
    /// the prefix cache still holds and no running request references is
    /// tagged into a holder sequence first (or dropped from the cache when no
    /// holder has room at its position); then the sequence's cells are
    /// removed and its id is free again.
    fn retire(&mut self, seq: SeqId, blocks: &[BlockId]) {
        let bs = self.block_size;
        for (i, &b) in blocks.iter().enumerate() {
            let pool = self.sched.kv().pool();
            if !pool.is_cached(b) || pool.ref_count(b) > 0 || self.holders.get(b).is_some() {
                continue;
            }
            let i = i as u32;
            let kept = match self.holders.place(b, i) {
                Some(h) => match self.ctx.seq_cp(seq, h, Some(i * bs), Some((i + 1) * bs)) {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!(error = %e, "could not keep a cached block");
                        self.holders.remove(b);
                        false
                    }
                },
                None => false,
            };
            if !kept {
                self.sched.uncache(b);
            }
        }
        if let Err(e) = self.ctx.seq_rm(seq, None, None) {
            tracing::error!(error = %e, seq = seq.0, "could not free a sequence's cells");
        }
        if let Some(d) = self.draft.as_mut() {
            let _ = d.ctx.seq_rm(seq, None, None);
        }
        self.free_seqs.push(seq);
    }

    /// Drops the cells of cached blocks the scheduler just evicted.
    fn evict(&mut self, blocks: &[BlockId]) {
        let bs = self.block_size;
        for &b in blocks {
            if let Some((h, i)) = self.holders.remove(b)
                && let Err(e) = self.ctx.seq_rm(h, Some(i * bs), Some((i + 1) * bs))
            {
                tracing::error!(error = %e, "could not drop an evicted block's cells");
            }
        }
    }

    /// Tags the cells of the cached blocks that start `handle`'s table (its
    /// first `n_tokens` tokens, a prefix-cache hit) into `seq`. A block's cells
    /// come from its holder or from any sequence (running, or retiring in this
    /// step) whose table has it at the same position.
    fn copy_prefix(
        &mut self,
        id: &RequestId,
        handle: SeqHandle,
        seq: SeqId,
        n_tokens: usize,
        retiring: &[(SeqId, Vec<BlockId>)],
    ) -> Result<(), RuntimeError> {
        let bs = self.block_size as usize;
        let kv = self.sched.kv();
        let table = kv.block_table(handle);
        let mut holding: Vec<(SeqId, &[BlockId])> = self
            .live
            .iter()
            .filter(|(other, _)| *other != id)
            .filter_map(|(other, l)| Some((l.seq?, kv.block_table(self.sched.handle(other)?))))
            .collect();
        holding.extend(retiring.iter().map(|(s, b)| (*s, b.as_slice())));
        let mut sources = Vec::with_capacity(n_tokens / bs);
        for (i, &b) in table.iter().enumerate().take(n_tokens / bs) {
            let src = self.holders.get(b).or_else(|| {
                holding
                    .iter()
                    .find(|(_, t)| t.get(i) == Some(&b))
                    .map(|(s, _)| *s)
            });
            sources.push(src.ok_or_else(|| {
                RuntimeError::Engine(format!(
                    "prefix cache: no KV found for cached block {} at position {}",
                    b.0,
                    i * bs
                ))
            })?);
        }
        // One seq_cp per run of blocks with the same source.
        let mut i = 0;
        while i < sources.len() {
            let j = (i..sources.len())
                .find(|&j| sources[j] != sources[i])
                .unwrap_or(sources.len());
            self.ctx
                .seq_cp(
                    sources[i],
                    seq,
                    Some((i * bs) as u32),
                    Some((j * bs) as u32),
                )
                .map_err(|e| RuntimeError::Engine(e.to_string()))?;
            i = j;
        }
        Ok(())
    }

    /// Ends a request: frees its blocks, cells and id, sends `Done`.
    fn end(&mut self, id: &RequestId, reason: FinishReason, error: Option<RuntimeError>) {
        self.close(id, reason, error, false);
    }

    /// [`end`](Self::end); with `abort`, the blocks of the step that failed are
    /// not offered to the prefix cache.
    fn close(
        &mut self,
        id: &RequestId,
        reason: FinishReason,
        error: Option<RuntimeError>,
        abort: bool,
    ) {
        let blocks = self
            .sched
            .handle(id)
            .map(|h| self.sched.kv().block_table(h).to_vec())
            .unwrap_or_default();
        if abort {
            self.sched.abort(id);
        } else {
            self.sched.finish(id);
        }
        if let Some(seq) = self.live.get_mut(id).and_then(|l| l.seq.take()) {
            self.retire(seq, &blocks);
        }
        if let Some(mut live) = self.live.remove(id) {
            if let (Some(spec), Some(_)) = (&live.spec, &self.draft) {
                self.draft_memory.finish(&spec.len);
            }
            if reason != FinishReason::Stop && reason != FinishReason::Error {
                // Release text held back for a possible stop string or a split character.
                let tail = live.text.finish();
                if !tail.is_empty() {
                    let _ = live.tx.send(Event::Text {
                        text: tail,
                        token: None,
                    });
                }
            }
            done(&live.tx, reason, live.usage(), error);
        }
    }

    fn step(&mut self) {
        let now = self.now_ms();
        // Draft lengths for speculating requests, from their acceptance rates
        // and the batch size.
        if self.speculative.is_some() {
            let running = self.sched.stats().running;
            for (id, live) in &mut self.live {
                if let Some(spec) = &mut live.spec {
                    self.sched.set_draft_len(id, spec.len.next_k(running));
                }
            }
        }
        let step = self.sched.schedule(now);
        #[cfg(feature = "fault-injection")]
        if step
            .items
            .iter()
            .any(|i| i.id.0.starts_with("siliceo-fault-panic"))
        {
            panic!("injected fault (feature fault-injection)");
        }
        debug_assert!(
            step.items.iter().all(|i| i.ops.is_empty()),
            "block work arises only from forks, sealing and partial blocks, which llama.cpp's cells do not use"
        );
        // Evicted blocks' cells go first: the step's new blocks need the room.
        self.evict(&step.evicted);
        // Sequences leaving this step keep their cells until the batch is
        // built: a request admitted now may reuse their cached blocks.
        let mut retiring: Vec<(SeqId, Vec<BlockId>)> = Vec::new();
        for f in &step.finished {
            if let Some(seq) = self.live.get_mut(&f.id).and_then(|l| l.seq.take()) {
                retiring.push((seq, f.blocks.clone()));
            }
            let reason = match f.cause {
                FinishCause::Length => FinishReason::Length,
                FinishCause::Deadline => FinishReason::Cancelled,
            };
            self.end(&f.id, reason, None);
        }
        let mut failed = Vec::new();
        for p in &step.preempted {
            let Some(live) = self.live.get_mut(&p.id) else {
                continue;
            };
            let Some(seq) = live.seq.take() else {
                continue;
            };
            if p.mode == PreemptMode::Swap {
                match self.ctx.save_seq(seq) {
                    Ok(snap) => live.snapshot = Some(snap),
                    Err(e) => failed.push((p.id.clone(), RuntimeError::Engine(e.to_string()))),
                }
            }
            retiring.push((seq, p.blocks.clone()));
        }
        self.batch.clear();
        let mut want: Vec<Want> = Vec::new();
        let started = Instant::now();
        for item in &step.items {
            let Some(live) = self.live.get_mut(&item.id) else {
                continue;
            };
            live.first_scheduled.get_or_insert(started);
            if let ItemKind::Prefill { cached_tokens } = item.kind
                && cached_tokens > 0
            {
                live.cached_prompt_tokens = cached_tokens as u32;
            }
            let fresh = live.seq.is_none();
            if fresh && let Some(spec) = live.spec.as_mut() {
                // A new sequence id: its draft KV starts empty.
                spec.draft_len = 0;
            }
            let seq = match live.seq {
                Some(s) => s,
                None => {
                    let s = self
                        .free_seqs
                        .pop()
                        .expect("scheduler runs at most max_running sequences");
                    live.seq = Some(s);
                    s
                }
            };
            if item.kind == ItemKind::ResumeSwap {
                let snap = live
                    .snapshot
                    .take()
                    .expect("swapped sequence has a snapshot");
                if let Err(e) = self.ctx.restore_seq(&snap, seq) {
                    let err = RuntimeError::Engine(e.to_string());
                    self.end(&item.id.clone(), FinishReason::Error, Some(err));
                }
                continue;
            }
            if fresh
                && item.start_pos > 0
                && let Err(e) =
                    self.copy_prefix(&item.id, item.handle, seq, item.start_pos, &retiring)
            {
                tracing::error!(error = %e, "prefix reuse failed");
                self.end(&item.id.clone(), FinishReason::Error, Some(e));
                continue;
            }
            let n = item.tokens.len();
            for (i, &t) in item.tokens.iter().enumerate() {
                let logits = item.wants_logits && i + 1 == n;
                let idx = self.batch.push(t, (item.start_pos + i) as u32, seq, logits);
                if logits {
                    want.push(Want {
                        id: item.id.clone(),
                        idx: vec![idx],
                        drafts: Vec::new(),
                        pos: item.start_pos + i,
                        tree: None,
                    });
                }
            }
            // Drafted tokens ride in the same batch, each with its logits.
            if item.draft_slots > 0
                && let Some(w) = want.last_mut().filter(|w| w.id == item.id)
                && self.live.get(&item.id).is_some_and(|l| l.spec.is_some())
            {
                // A token tree of n-gram branches, for greedy requests
                // without penalties, when sequence ids are free for branches.
                let width = self.speculative.as_ref().map_or(1, |c| c.tree_width);
                let params = self.live[&item.id].sampler.params();
                let plain_greedy = params.is_greedy() && !params.has_penalties();
                let spec = self
                    .live
                    .get_mut(&item.id)
                    .and_then(|l| l.spec.as_mut())
                    .expect("checked above");
                if let Some(d) = self.draft.as_mut()
                    && width > 1
                    && plain_greedy
                    && item.draft_slots >= 2
                    && let Some(temp) = self.free_seqs.pop()
                {
                    // The draft model's top 2 at the first position, a greedy
                    // chain after each (the second in a temporary sequence).
                    match d.propose_top2(seq, temp, spec, item.draft_slots) {
                        Ok(branches) => {
                            let decode_idx = w.idx[0];
                            let _ = self.ctx.seq_cp(seq, temp, None, None);
                            self.batch.share(decode_idx, temp);
                            for (b, branch) in branches.iter().enumerate() {
                                let bseq = if b == 0 { seq } else { temp };
                                for (k, &tok) in branch.iter().enumerate() {
                                    let p = (w.pos + 1 + k) as u32;
                                    w.idx.push(self.batch.push(tok, p, bseq, true));
                                }
                            }
                            w.drafts = branches.concat();
                            w.tree = Some(TreeWant {
                                branches,
                                temps: vec![temp],
                            });
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "draft model failed; no drafts this step");
                            let _ = d.ctx.seq_rm(seq, None, None);
                            let _ = d.ctx.seq_rm(temp, None, None);
                            spec.draft_len = 0;
                            self.free_seqs.push(temp);
                        }
                    }
                    continue;
                }
                if self.draft.is_none() && width > 1 && plain_greedy {
                    let branches =
                        spec.drafter
                            .propose_branches(&spec.history, item.draft_slots, width);
                    if branches.len() > 1 && self.free_seqs.len() >= branches.len() - 1 {
                        let temps: Vec<SeqId> = (1..branches.len())
                            .filter_map(|_| self.free_seqs.pop())
                            .collect();
                        let decode_idx = w.idx[0];
                        for &t in &temps {
                            // The context so far, then the decode token, in every branch.
                            let _ = self.ctx.seq_cp(seq, t, None, None);
                            self.batch.share(decode_idx, t);
                        }
                        for (b, branch) in branches.iter().enumerate() {
                            let bseq = if b == 0 { seq } else { temps[b - 1] };
                            for (k, &d) in branch.iter().enumerate() {
                                let p = (w.pos + 1 + k) as u32;
                                w.idx.push(self.batch.push(d, p, bseq, true));
                            }
                        }
                        w.drafts = branches.concat();
                        w.tree = Some(TreeWant { branches, temps });
                        continue;
                    }
                }
                w.drafts = match self.draft.as_mut() {
                    Some(d) => d.propose(seq, spec, item.draft_slots).unwrap_or_else(|e| {
                        // A draft failure costs speed, never output.
                        tracing::warn!(error = %e, "draft model failed; no drafts this step");
                        let _ = d.ctx.seq_rm(seq, None, None);
                        spec.draft_len = 0;
                        Vec::new()
                    }),
                    None => spec.drafter.propose(&spec.history, item.draft_slots),
                };
                for (k, &d) in w.drafts.iter().enumerate() {
                    let p = (w.pos + 1 + k) as u32;
                    w.idx.push(self.batch.push(d, p, seq, true));
                }
            }
        }
        for (seq, blocks) in retiring {
            self.retire(seq, &blocks);
        }
        for (id, err) in failed {
            self.end(&id, FinishReason::Error, Some(err));
        }
        if self.batch.is_empty() {
            return;
        }
        let t = Instant::now();
        let decoded = self.ctx.decode(&self.batch);
        self.decode_us += t.elapsed().as_micros() as u64;
        if let Err(e) = decoded {
            tracing::error!(error = %e, tokens = self.batch.len(), "decode failed; failing the step's requests");
            let err = RuntimeError::Engine(e.to_string());
            for w in &want {
                self.release_tree(w);
            }
            for item in &step.items {
                self.close(&item.id, FinishReason::Error, Some(err.clone()), true);
            }
            return;
        }
        for w in want {
            self.sample(&w);
        }
        if self.speculative.is_none() {
            return;
        }
        // What the step cost each speculating request per produced token:
        // drafting that costs more than it saves switches itself off.
        let us = started.elapsed().as_secs_f64() * 1e6;
        for id in step
            .items
            .iter()
            .filter(|i| i.kind == ItemKind::Decode)
            .map(|i| &i.id)
        {
            if let Some(spec) = self.live.get_mut(id).and_then(|l| l.spec.as_mut())
                && let Some((drafted, tokens)) = spec.last.take()
            {
                let before = spec.len.cost_pauses();
                spec.len.record_step(drafted, us, tokens);
                self.spec_cost_pauses += (spec.len.cost_pauses() - before) as u64;
            }
        }
    }

    /// Checks that llama.cpp's cells agree with the block accounting: every
    /// request sequence holds exactly positions `0..computed`, every holder
    /// exactly its blocks' positions, free ids nothing; every cached block
    /// nobody references is held and every held block is cached.
    fn check_kv(&self) -> Result<(), String> {
        self.sched.check()?;
        let bs = self.block_size;
        let range = |seq: SeqId| {
            self.ctx
                .seq_pos_range(seq)
                .map_err(|e| format!("seq {}: {e}", seq.0))
        };
        let mut in_use = std::collections::HashSet::new();
        for (id, live) in &self.live {
            let Some(seq) = live.seq else { continue };
            in_use.insert(seq);
            let Some(h) = self.sched.handle(id) else {
                return Err(format!("{id} holds seq {} but no blocks", seq.0));
            };
            let n = self.sched.kv().num_tokens(h) as u32;
            let want = (n > 0).then(|| (0, n - 1));
            let got = range(seq)?;
            if got != want {
                return Err(format!(
                    "{id} (seq {}): llama.cpp holds positions {got:?}, blocks say {want:?}",
                    seq.0
                ));
            }
        }
        if let Some(d) = &self.draft {
            for live in self.live.values() {
                let (Some(seq), Some(spec)) = (live.seq, &live.spec) else {
                    continue;
                };
                let want = (spec.draft_len > 0).then(|| (0, spec.draft_len as u32 - 1));
                let got = d.ctx.seq_pos_range(seq).map_err(|e| e.to_string())?;
                if got != want {
                    return Err(format!(
                        "draft seq {}: holds positions {got:?}, expected {want:?}",
                        seq.0
                    ));
                }
            }
            for &s in &self.free_seqs {
                if d.ctx.seq_pos_range(s).map_err(|e| e.to_string())?.is_some() {
                    return Err(format!("free draft seq {} still holds cells", s.0));
                }
            }
        }
        for s in (0..self.max_running).map(SeqId) {
            if !in_use.contains(&s) && !self.free_seqs.contains(&s) {
                return Err(format!("seq {} is neither used nor free (leaked)", s.0));
            }
            if self.free_seqs.contains(&s) && range(s)?.is_some() {
                return Err(format!("free seq {} still holds cells", s.0));
            }
        }
        for h in self.holders.seq_ids() {
            let idx = self.holders.indices(h);
            let want = idx
                .first()
                .zip(idx.last())
                .map(|(lo, hi)| (lo * bs, (hi + 1) * bs - 1));
            let got = range(h)?;
            if got != want {
                return Err(format!(
                    "holder {}: llama.cpp holds positions {got:?}, blocks at indices {idx:?}",
                    h.0
                ));
            }
        }
        let pool = self.sched.kv().pool();
        for b in self.holders.blocks() {
            if !pool.is_cached(b) {
                return Err(format!("held block {} is no longer cached", b.0));
            }
        }
        for b in (0..pool.num_blocks() as u32).map(BlockId) {
            if pool.is_cached(b) && pool.ref_count(b) == 0 && self.holders.get(b).is_none() {
                return Err(format!("cached block {} has no KV left", b.0));
            }
        }
        Ok(())
    }

    /// Samples the next token of a request (verifying its drafted tokens
    /// first, if any), streams what it produced, and reports it.
    fn sample(&mut self, w: &Want) {
        let id = &w.id;
        if w.tree.is_some() {
            return self.sample_tree(w);
        }
        let Some(live) = self.live.get_mut(id) else {
            return;
        };
        let greedy = live.sampler.params().is_greedy();
        let mut accepted: Vec<TokenId> = Vec::new();
        let mut next = None;
        for (i, &ix) in w.idx.iter().enumerate() {
            let Ok(logits) = self.ctx.logits(ix) else {
                let err = RuntimeError::Engine("missing logits".into());
                return self.end(id, FinishReason::Error, Some(err));
            };
            let Some(&d) = w.drafts.get(i) else {
                next = Some(live.sampler.sample(logits));
                break;
            };
            // Verify drafted token d against the target at this position.
            let p = live.sampler.distribution(logits);
            let v = if greedy {
                siliceo_speculative::verify_greedy(&[d], &[p[0].0, p[0].0])
            } else {
                let q = [(d, 1.0f32)];
                let sampler = &mut live.sampler;
                verify_sampled(&[d], &[&q], &[&p, &p], &mut || sampler.uniform())
            };
            if v.accepted == 1 {
                live.sampler.accept(d);
                accepted.push(d);
            } else {
                next = Some(v.next);
                break;
            }
        }
        let Some(next) = next else {
            return;
        };
        // Rejected drafts' cells go at once.
        if accepted.len() < w.drafts.len()
            && let Some(seq) = live.seq
        {
            let from = (w.pos + 1 + accepted.len()) as u32;
            if let Err(e) = self.ctx.seq_rm(seq, Some(from), None) {
                let err = RuntimeError::Engine(e.to_string());
                return self.end(id, FinishReason::Error, Some(err));
            }
        }
        self.emit(w, accepted, next);
    }

    /// Streams and reports what a step produced for one request: accepted
    /// drafted tokens (KV already fixed up, already given to the sampler) and
    /// the target's next token.
    fn emit(&mut self, w: &Want, accepted: Vec<TokenId>, next: TokenId) {
        let id = &w.id;
        let Some(live) = self.live.get_mut(id) else {
            return;
        };
        live.draft_tokens += w.drafts.len() as u32;
        live.speculative_steps += u32::from(!w.drafts.is_empty());
        live.accepted_draft_tokens += accepted.len() as u32;
        if let Some(spec) = live.spec.as_mut() {
            if !w.drafts.is_empty() {
                spec.len.update(w.drafts.len(), accepted.len());
            }
            spec.last = Some((!w.drafts.is_empty(), accepted.len() + 1));
            // The draft model's KV keeps the history and the accepted drafts.
            let keep = spec.history.len() + accepted.len();
            if spec.draft_len > keep {
                if let (Some(d), Some(seq)) = (self.draft.as_mut(), live.seq) {
                    let _ = d.ctx.seq_rm(seq, Some(keep as u32), None);
                }
                spec.draft_len = keep;
            }
            spec.history.extend_from_slice(&accepted);
            spec.history.push(next);
        }
        live.sampler.accept(next);
        live.first_token.get_or_insert_with(Instant::now);
        for &token in accepted.iter().chain(std::iter::once(&next)) {
            live.completion_tokens += 1;
            let (text, stopped) = live.text.push(token);
            let closed = live
                .tx
                .send(Event::Text {
                    text,
                    token: Some(token),
                })
                .is_err();
            if stopped {
                return self.end(id, FinishReason::Stop, None);
            }
            if closed {
                return self.end(id, FinishReason::Cancelled, None);
            }
        }
        if let Some(f) = self.sched.on_tokens(id, &accepted, next) {
            if let Some(seq) = self.live.get_mut(id).and_then(|l| l.seq.take()) {
                self.retire(seq, &f.blocks);
            }
            self.end(id, FinishReason::Length, None);
        }
    }
}

impl DraftModel<'_> {
    /// Two branches: the draft's best and second-best first tokens, each
    /// followed greedily (about `k / 2` tokens each); the first in `seq`, the
    /// second in `temp` (a copy of `seq`'s context). As in
    /// [`DraftModel::propose`], a branch's last token is not computed.
    fn propose_top2(
        &mut self,
        seq: SeqId,
        temp: SeqId,
        spec: &mut Spec,
        k: usize,
    ) -> Result<Vec<Vec<TokenId>>, siliceo_engine::EngineError> {
        let h = &spec.history;
        let logits = if spec.draft_len < h.len() {
            self.ctx
                .prefill(seq, &h[spec.draft_len..], spec.draft_len as u32)?
        } else {
            return Ok(Vec::new());
        };
        spec.draft_len = h.len();
        let p = h.len() as u32;
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.select_nth_unstable_by(1, |a, b| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b)));
        let (first, second) = if logits[idx[0]] >= logits[idx[1]] {
            (idx[0], idx[1])
        } else {
            (idx[1], idx[0])
        };
        self.ctx.seq_cp(seq, temp, None, None)?;
        let lens = [k.div_ceil(2), (k / 2).max(1)];
        let mut out = Vec::with_capacity(2);
        let mut batch = Batch::new();
        for (b, (start, bseq)) in [(first, seq), (second, temp)].into_iter().enumerate() {
            let mut branch = vec![TokenId(start as u32)];
            while branch.len() < lens[b] {
                batch.clear();
                let pos = p + branch.len() as u32 - 1;
                let last = *branch.last().expect("non-empty");
                let i = batch.push(last, pos, bseq, true);
                self.ctx.decode(&batch)?;
                if b == 0 {
                    spec.draft_len += 1;
                }
                branch.push(siliceo_core::sampler::argmax(self.ctx.logits(i)?));
            }
            out.push(branch);
        }
        Ok(out)
    }

    /// Drafts up to `k` tokens greedily after `spec.history` in sequence
    /// `seq`: first computes the history tokens the draft context lacks, then
    /// one token at a time. The last drafted token is not computed (it is
    /// computed next time if the target keeps it).
    fn propose(
        &mut self,
        seq: SeqId,
        spec: &mut Spec,
        k: usize,
    ) -> Result<Vec<TokenId>, siliceo_engine::EngineError> {
        let h = &spec.history;
        if spec.draft_len >= h.len() {
            return Ok(Vec::new());
        }
        let mut logits = self
            .ctx
            .prefill(seq, &h[spec.draft_len..], spec.draft_len as u32)?;
        spec.draft_len = h.len();
        let mut out = Vec::with_capacity(k);
        let mut batch = Batch::new();
        loop {
            let d = siliceo_core::sampler::argmax(&logits);
            out.push(d);
            if out.len() == k {
                return Ok(out);
            }
            batch.clear();
            let i = batch.push(d, spec.draft_len as u32, seq, true);
            self.ctx.decode(&batch)?;
            spec.draft_len += 1;
            logits = self.ctx.logits(i)?.to_vec();
        }
    }
}

impl Engine<'_> {
    /// Gives back a token tree's temporary sequence ids and their cells.
    fn release_tree(&mut self, w: &Want) {
        if let Some(t) = &w.tree {
            for &s in &t.temps {
                let _ = self.ctx.seq_rm(s, None, None);
                if let Some(d) = self.draft.as_mut() {
                    let _ = d.ctx.seq_rm(s, None, None);
                }
                self.free_seqs.push(s);
            }
        }
    }

    /// Verifies a token tree greedily: the branch the target follows is kept
    /// (its cells tagged into the request's own sequence), every other node's
    /// cells and the temporary sequence ids go.
    fn sample_tree(&mut self, w: &Want) {
        let id = &w.id;
        let t = w.tree.as_ref().expect("a tree");
        let seq = self.live.get(id).and_then(|l| l.seq);
        let argmax_at =
            |ctx: &Context<'_>, ix: usize| ctx.logits(ix).map(siliceo_core::sampler::argmax);
        let verdict = (|| {
            let root = argmax_at(&self.ctx, w.idx[0])?;
            let nodes = w.idx[1..]
                .iter()
                .map(|&ix| argmax_at(&self.ctx, ix))
                .collect::<Result<Vec<_>, _>>()?;
            Ok::<_, siliceo_engine::EngineError>((root, nodes))
        })();
        let (root, node_argmax) = match (verdict, seq) {
            (Ok(v), Some(_)) => v,
            (Err(e), _) => {
                self.release_tree(w);
                return self.end(
                    id,
                    FinishReason::Error,
                    Some(RuntimeError::Engine(e.to_string())),
                );
            }
            (_, None) => return self.release_tree(w),
        };
        let seq = seq.expect("checked");
        self.tree_verifications += 1;
        let tree = siliceo_speculative::DraftTree::from_branches(&t.branches);
        let (path, next) = siliceo_speculative::verify_tree_greedy(&tree, root, &node_argmax);
        let accepted: Vec<TokenId> = path.iter().map(|&n| tree.token(n)).collect();
        let a = accepted.len() as u32;
        let first = (w.pos + 1) as u32;
        // Which branch the kept path runs in (first tokens are distinct).
        let b = accepted
            .first()
            .and_then(|f| t.branches.iter().position(|br| br[0] == *f))
            .unwrap_or(0);
        // The draft model's cells: with branch b > 0 kept, the request's draft
        // sequence takes that branch's computed cells (all but its last token).
        if b > 0
            && let (Some(d), Some(spec)) = (
                self.draft.as_mut(),
                self.live.get_mut(id).and_then(|l| l.spec.as_mut()),
            )
        {
            let p = spec.history.len() as u32;
            let have = (t.branches[b].len() as u32 - 1).min(a);
            let moved = d
                .ctx
                .seq_rm(seq, Some(p), None)
                .and_then(|()| d.ctx.seq_cp(t.temps[b - 1], seq, Some(p), Some(p + have)));
            spec.draft_len = if moved.is_ok() {
                (p + have) as usize
            } else {
                0
            };
            if moved.is_err() {
                let _ = d.ctx.seq_rm(seq, None, None);
            }
        }
        let fixed = if b == 0 {
            self.ctx.seq_rm(seq, Some(first + a), None)
        } else {
            self.ctx.seq_rm(seq, Some(first), None).and_then(|()| {
                self.ctx
                    .seq_cp(t.temps[b - 1], seq, Some(first), Some(first + a))
            })
        };
        self.release_tree(w);
        if let Err(e) = fixed {
            return self.end(
                id,
                FinishReason::Error,
                Some(RuntimeError::Engine(e.to_string())),
            );
        }
        if let Some(live) = self.live.get_mut(id) {
            for &tok in &accepted {
                live.sampler.accept(tok);
            }
        }
        self.emit(w, accepted, next);
    }
}
