//! One engine step: the scheduler's plan becomes one batch and one decode.

use std::time::Instant;

use siliceo_core::{FinishReason, SeqId};
use siliceo_engine::GraftStep;
use siliceo_kv_paging::BlockId;
use siliceo_scheduler::{FinishCause, ItemKind, PreemptMode};

use super::graft::Run;
use super::kv::Kv;
use super::{Engine, Want};
use crate::RuntimeError;

impl Engine<'_> {
    pub(super) fn step(&mut self) {
        let now = self.now_ms();
        // Draft lengths for speculating requests, from their acceptance rates
        // and the batch size.
        if self.speculative.is_some() {
            let running = self.sched.stats().running;
            for (id, live) in &mut self.live {
                if let Some(spec) = &mut live.spec {
                    let k = spec.len.next_k(running);
                    let cap = live.think.as_ref().map_or(k, |t| t.max_drafts());
                    self.sched.set_draft_len(id, k.min(cap));
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
            let Some(seq) = self.live.get_mut(&p.id).and_then(|l| l.seq.take()) else {
                continue;
            };
            if p.mode == PreemptMode::Swap {
                // Before this step's decode reuses its blocks.
                match self.save(seq, p) {
                    Ok(snap) => {
                        if let Some(live) = self.live.get_mut(&p.id) {
                            live.snapshot = Some(snap);
                        }
                    }
                    Err(e) => failed.push((p.id.clone(), e)),
                }
            }
            retiring.push((seq, p.blocks.clone()));
        }
        self.batch.clear();
        if let Kv::Graft(g) = &mut self.kv {
            g.reset_branch_blocks();
        }
        let mut want: Vec<Want> = Vec::new();
        // Prompt positions scored in this step: (request, batch index, position).
        let mut scores: Vec<(siliceo_core::RequestId, usize, usize)> = Vec::new();
        let mut runs: Vec<Run> = Vec::new();
        let started = Instant::now();
        for (ix, item) in step.items.iter().enumerate() {
            let Some(live) = self.live.get_mut(&item.id) else {
                continue;
            };
            live.first_scheduled.get_or_insert(started);
            if let ItemKind::Prefill { cached_tokens } = item.kind
                && cached_tokens > 0
            {
                live.cached_prompt_tokens = cached_tokens as u32;
            }
            // Prompt positions whose logits the request's prompt
            // log-probabilities still need: from `got` to the one before last.
            let scored = live
                .prompt_lp
                .as_ref()
                .filter(|p| !p.sent)
                .map(|p| p.got.len()..p.tokens.len() - 1);
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
                if let Err(e) = self.restore(&snap, seq, item) {
                    self.end(&item.id.clone(), FinishReason::Error, Some(e));
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
            let first = self.batch.len();
            let n = item.tokens.len();
            for (i, &t) in item.tokens.iter().enumerate() {
                let pos = item.start_pos + i;
                let last = item.wants_logits && i + 1 == n;
                let score = scored.as_ref().is_some_and(|r| r.contains(&pos));
                let idx = self.batch.push(t, pos as u32, seq, last || score);
                if score {
                    scores.push((item.id.clone(), idx, pos));
                }
                if last {
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
            {
                self.plan_drafts(item, seq, w);
            }
            // A token tree's later branches are runs of their own.
            let branches = want
                .last()
                .filter(|w| w.id == item.id)
                .and_then(|w| w.tree.as_ref())
                .map(|t| t.graft.clone())
                .unwrap_or_default();
            let end = branches.first().map_or(self.batch.len(), |b| b.batch.start);
            runs.push(Run {
                item: ix,
                batch: first..end,
                branches,
            });
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
        // Constrained requests' next masks are computed beside the decode.
        let pending = self.take_matchers(&want);
        let decoded = self.decode_with_masks(pending, |e| {
            let t = Instant::now();
            let decoded = e.decode(&step.items, &runs);
            e.decode_us += t.elapsed().as_micros() as u64;
            decoded
        });
        if let Err(e) = decoded {
            tracing::error!(error = %e, tokens = self.batch.len(), "decode failed; failing the step's requests");
            for w in &want {
                self.release_tree(w);
            }
            for item in &step.items {
                self.close(&item.id, FinishReason::Error, Some(e.clone()), true);
            }
            return;
        }
        for (id, ix, pos) in scores {
            self.score_prompt(&id, ix, pos);
        }
        for w in want {
            self.sample(&w);
        }
        if self.speculative.is_some() {
            self.record_speculation(&step, started);
        }
    }

    /// Runs the batch: on llama.cpp's cells as it is; on our store with the
    /// step's block work (a run per item).
    fn decode(
        &mut self,
        items: &[siliceo_scheduler::StepItem],
        runs: &[Run],
    ) -> Result<(), RuntimeError> {
        let engine = |e: siliceo_engine::EngineError| RuntimeError::Engine(e.to_string());
        match &mut self.kv {
            Kv::Llama(l) => l.ctx.decode(&self.batch).map_err(engine),
            Kv::Graft(g) => {
                let mut work = GraftStep::default();
                g.build_step(self.sched.kv(), items, runs, &mut work)?;
                g.ctx.decode(&self.batch, work).map_err(engine)
            }
        }
    }
}
