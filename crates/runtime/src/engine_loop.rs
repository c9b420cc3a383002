//! The engine thread: one step loop over one llama.cpp context.

use std::collections::HashMap;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use siliceo_core::{FinishReason, ModelGeometry, RequestId, Sampler, SeqId, TokenId};
use siliceo_engine::{Batch, Context, Model, SeqSnapshot, TokenText};
use siliceo_kv_paging::{CacheKeys, KvConfig};
use siliceo_scheduler::{FinishCause, ItemKind, PreemptMode, Request, Scheduler};
use tokio::sync::mpsc::UnboundedSender;

use crate::{
    Command, Event, GenerateRequest, Input, RuntimeConfig, RuntimeError, RuntimeStats, Usage,
};

struct Live<'m> {
    tx: UnboundedSender<Event>,
    sampler: Sampler,
    text: TokenText<'m>,
    seq: Option<SeqId>,
    snapshot: Option<SeqSnapshot>,
    prompt_tokens: u32,
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
            cached_prompt_tokens: 0,
            completion_tokens: self.completion_tokens,
            queue_ms: self.first_scheduled.map_or(0, |t| ms(self.submitted, t)),
            ttft_ms: self.first_token.map_or(0, |t| ms(self.submitted, t)),
            decode_ms: self.first_token.map_or(0, |t| ms(t, now)),
        }
    }
}

struct Engine<'m> {
    model: &'m Model,
    ctx: Context<'m>,
    sched: Scheduler,
    keys: CacheKeys,
    live: HashMap<RequestId, Live<'m>>,
    free_seqs: Vec<SeqId>,
    epoch: Instant,
    batch: Batch,
    steps: u64,
    step_us: u64,
    decode_us: u64,
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
    ready: Sender<Result<(ModelGeometry, u32), RuntimeError>>,
) {
    let model = match Model::load(&cfg.model_path, &cfg.model) {
        Ok(m) => m,
        Err(e) => {
            let _ = ready.send(Err(RuntimeError::Start(e.to_string())));
            return;
        }
    };
    let mut opts = cfg.context.clone();
    opts.n_seq_max = cfg.scheduler.max_running_seqs.clamp(1, 256) as u32;
    let ctx = match Context::new(&model, opts) {
        Ok(c) => c,
        Err(e) => {
            let _ = ready.send(Err(RuntimeError::Start(e.to_string())));
            return;
        }
    };
    let n_ctx = ctx.n_ctx();
    let mut sched_cfg = cfg.scheduler;
    sched_cfg.max_batch_tokens = sched_cfg.max_batch_tokens.min(ctx.n_batch() as usize);
    sched_cfg.max_seq_len = sched_cfg.max_seq_len.min(n_ctx as usize);
    sched_cfg.max_running_seqs = ctx.n_seq_max() as usize;
    let bs = cfg.block_size.max(1);
    // Blocks cover the context's cells, less one block of slack for where
    // llama.cpp places a batch.
    let num_blocks = (n_ctx / bs).saturating_sub(1).max(1);
    let sched = Scheduler::new(
        sched_cfg,
        KvConfig {
            num_blocks,
            block_size: bs,
            prefix_caching: false,
        },
    );
    let kv_format = format!("{}/{}", cfg.context.type_k, cfg.context.type_v);
    let mut engine = Engine {
        model: &model,
        free_seqs: (0..ctx.n_seq_max()).rev().map(SeqId).collect(),
        ctx,
        sched,
        keys: CacheKeys::new(model.path().display().to_string(), kv_format),
        live: HashMap::new(),
        epoch: Instant::now(),
        batch: Batch::new(),
        steps: 0,
        step_us: 0,
        decode_us: 0,
    };
    let _ = ready.send(Ok((model.geometry(), n_ctx)));
    tracing::info!(n_ctx, num_blocks, block_size = bs, "engine ready");
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
                    Command::Submit(req, id, tx) => self.submit(*req, id, tx),
                    Command::Cancel(id) => self.end(&id, FinishReason::Cancelled, None),
                    Command::Stats(tx) => {
                        let _ = tx.send(self.stats());
                    }
                    Command::Shutdown => return self.shutdown(),
                }
            }
            if !self.sched.is_idle() {
                let t = Instant::now();
                self.step();
                self.steps += 1;
                self.step_us += t.elapsed().as_micros() as u64;
            }
        }
    }

    fn shutdown(&mut self) {
        let ids: Vec<RequestId> = self.live.keys().cloned().collect();
        for id in ids {
            self.end(&id, FinishReason::Cancelled, None);
        }
    }

    fn stats(&self) -> RuntimeStats {
        let s = self.sched.stats();
        let kv = self.sched.kv().stats();
        let llama_cells = (0..self.ctx.n_seq_max())
            .map(|i| u64::from(self.ctx.seq_len(SeqId(i)).unwrap_or(0)))
            .sum();
        RuntimeStats {
            waiting: s.waiting,
            running: s.running,
            kv_used_blocks: kv.used_blocks,
            kv_free_blocks: kv.free_blocks,
            seq_ids_in_use: self.ctx.n_seq_max() as usize - self.free_seqs.len(),
            llama_cells,
            preemptions: s.preemptions,
            steps: self.steps,
            step_us: self.step_us,
            decode_us: self.decode_us,
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
        let mut sreq = Request::new(
            id.clone(),
            tokens.clone(),
            req.sampling.max_tokens,
            self.keys.clone(),
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
        self.live.insert(
            id,
            Live {
                tx,
                sampler,
                text: TokenText::new(self.model, &req.sampling),
                seq: None,
                snapshot: None,
                prompt_tokens: tokens.len() as u32,
                completion_tokens: 0,
                submitted,
                first_scheduled: None,
                first_token: None,
            },
        );
    }

    /// Releases a request's engine sequence (its KV cells) and id.
    fn drop_seq(&mut self, id: &RequestId) {
        if let Some(live) = self.live.get_mut(id)
            && let Some(seq) = live.seq.take()
        {
            let _ = self.ctx.seq_rm(seq, None, None);
            self.free_seqs.push(seq);
        }
    }

    /// Ends a request: frees its blocks, cells and id, sends `Done`.
    fn end(&mut self, id: &RequestId, reason: FinishReason, error: Option<RuntimeError>) {
        self.sched.finish(id);
        self.drop_seq(id);
        if let Some(mut live) = self.live.remove(id) {
            if reason != FinishReason::Stop && reason != FinishReason::Error {
                // Release text held back for a possible stop string or a split character.
                let tail = live.text.finish();
                if !tail.is_empty() {
                    let _ = live.tx.send(Event::Text {
                        text: tail,
                        token: TokenId(0),
                    });
                }
            }
            done(&live.tx, reason, live.usage(), error);
        }
    }

    fn step(&mut self) {
        let now = self.now_ms();
        let step = self.sched.schedule(now);
        for (id, cause) in &step.finished {
            let reason = match cause {
                FinishCause::Length => FinishReason::Length,
                FinishCause::Deadline => FinishReason::Cancelled,
            };
            self.end(id, reason, None);
        }
        for p in &step.preempted {
            let Some(live) = self.live.get_mut(&p.id) else {
                continue;
            };
            if p.mode == PreemptMode::Swap
                && let Some(seq) = live.seq
            {
                match self.ctx.save_seq(seq) {
                    Ok(snap) => live.snapshot = Some(snap),
                    Err(e) => {
                        let err = RuntimeError::Engine(e.to_string());
                        self.end(&p.id.clone(), FinishReason::Error, Some(err));
                        continue;
                    }
                }
            }
            self.drop_seq(&p.id);
        }
        self.batch.clear();
        let mut want: Vec<(RequestId, usize)> = Vec::new();
        let started = Instant::now();
        for item in &step.items {
            let Some(live) = self.live.get_mut(&item.id) else {
                continue;
            };
            live.first_scheduled.get_or_insert(started);
            let seq = match live.seq {
                Some(s) => s,
                None => {
                    let s = self
                        .free_seqs
                        .pop()
                        .expect("scheduler runs at most n_seq_max sequences");
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
            let n = item.tokens.len();
            for (i, &t) in item.tokens.iter().enumerate() {
                let logits = item.wants_logits && i + 1 == n;
                let idx = self.batch.push(t, (item.start_pos + i) as u32, seq, logits);
                if logits {
                    want.push((item.id.clone(), idx));
                }
            }
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
            for item in &step.items {
                self.end(&item.id, FinishReason::Error, Some(err.clone()));
            }
            return;
        }
        for (id, idx) in want {
            self.sample(&id, idx);
        }
    }

    /// Samples the next token of `id` from batch index `idx` and streams it.
    fn sample(&mut self, id: &RequestId, idx: usize) {
        let Ok(logits) = self.ctx.logits(idx) else {
            return self.end(
                id,
                FinishReason::Error,
                Some(RuntimeError::Engine("missing logits".into())),
            );
        };
        let Some(live) = self.live.get_mut(id) else {
            return;
        };
        let token = live.sampler.sample(logits);
        live.sampler.accept(token);
        live.completion_tokens += 1;
        live.first_token.get_or_insert_with(Instant::now);
        let (text, stopped) = live.text.push(token);
        let closed = live.tx.send(Event::Text { text, token }).is_err();
        if stopped {
            return self.end(id, FinishReason::Stop, None);
        }
        if closed {
            return self.end(id, FinishReason::Cancelled, None);
        }
        if self.sched.on_token(id, token) == Some(FinishCause::Length) {
            self.end(id, FinishReason::Length, None);
        }
    }
}
