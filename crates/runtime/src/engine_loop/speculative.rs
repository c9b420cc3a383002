//! Speculative decoding: drafting (n-gram chains and trees, a draft model's
//! chains and top-2 trees), verifying a token tree, and what each step cost
//! a speculating request. Drafts never reach a seal (the scheduler caps
//! them). A token tree's first branch rides in the request's own rows, as a
//! chain does; each later branch, at the same positions, runs in a
//! temporary sequence id over shared cells on llama.cpp's KV, and in the
//! step's branch blocks on our store (`graft`), whose kept rows are copied
//! into the request's blocks after verification.

use std::time::Instant;

use siliceo_core::{FinishReason, SeqId, TokenId};
use siliceo_engine::{Batch, Context};
use siliceo_scheduler::{ItemKind, Step, StepItem};
use siliceo_speculative::{AdaptiveDraftLength, Drafter, NgramDrafter};

use super::graft::Branch;
use super::kv::Kv;
use super::{Engine, TreeWant, Want};
use crate::RuntimeError;

/// A request's speculative state.
pub(super) struct Spec {
    pub(super) drafter: NgramDrafter,
    pub(super) len: AdaptiveDraftLength,
    /// Prompt and generated tokens (what the drafter looks in).
    pub(super) history: Vec<TokenId>,
    /// Leading tokens of `history` whose KV the draft model's context holds
    /// for this request (its sequence has the same id as in the target).
    pub(super) draft_len: usize,
    /// The last step's outcome for this request: (drafted, tokens produced).
    pub(super) last: Option<(bool, usize)>,
}

/// The draft model's context, on the engine thread.
pub(super) struct DraftModel<'m> {
    pub(super) ctx: Context<'m>,
}

impl Engine<'_> {
    /// Puts drafted tokens for `item` (a decode with draft slots) into the
    /// batch after its decode token, and records them in `w`.
    pub(super) fn plan_drafts(&mut self, item: &StepItem, seq: SeqId, w: &mut Want) {
        let Some(live) = self.live.get(&item.id) else {
            return;
        };
        if live.spec.is_none() {
            return;
        }
        // A token tree of branches, for greedy requests without penalties.
        // Constrained requests draft chains only (not plain greedy), cut
        // where the constraint would refuse them.
        let constrained = live.constraint.is_some();
        let width = self.speculative.as_ref().map_or(1, |c| c.tree_width);
        let params = live.sampler.params();
        let plain_greedy =
            params.is_greedy() && params.is_plain() && !constrained && live.logprobs.is_none();
        let spec = self
            .live
            .get_mut(&item.id)
            .and_then(|l| l.spec.as_mut())
            .expect("checked above");
        if width > 1
            && plain_greedy
            && item.draft_slots >= 2
            && let Some(d) = self.draft.as_mut()
            && let Some(temp) = self.free_seqs.pop()
        {
            // The draft model's top 2 at the first position, a greedy chain
            // after each (the second in a temporary sequence of its context).
            let proposed = d.propose_top2(seq, temp, spec, item.draft_slots);
            if let Err(e) = &proposed {
                tracing::warn!(error = %e, "draft model failed; no drafts this step");
                let _ = d.ctx.seq_rm(seq, None, None);
                spec.draft_len = 0;
            }
            let rest = match proposed {
                Ok(branches) if branches.len() == 2 => {
                    match self.push_tree(seq, w, branches, vec![temp]) {
                        Ok(()) => return,
                        // No branch blocks left this step: the first branch
                        // as a chain (its draft KV is in `seq`).
                        Err(branches) => branches.into_iter().next(),
                    }
                }
                _ => None,
            };
            if let Some(d) = self.draft.as_mut() {
                let _ = d.ctx.seq_rm(temp, None, None);
            }
            self.free_seqs.push(temp);
            if let Some(chain) = rest {
                w.drafts = chain;
                self.push_chain(seq, w);
            }
            return;
        }
        if self.draft.is_none() && width > 1 && plain_greedy {
            let branches = spec
                .drafter
                .propose_branches(&spec.history, item.draft_slots, width);
            // On llama.cpp's cells, a sequence id per later branch.
            let ids = match self.kv {
                Kv::Llama(_) => branches.len().saturating_sub(1),
                Kv::Graft(_) => 0,
            };
            if branches.len() > 1 && self.free_seqs.len() >= ids {
                let at = self.free_seqs.len() - ids;
                let temps = self.free_seqs.split_off(at);
                // Our store's branch blocks may be spent: then a chain.
                if self.push_tree(seq, w, branches, temps).is_ok() {
                    return;
                }
            }
        }
        let spec = self
            .live
            .get_mut(&item.id)
            .and_then(|l| l.spec.as_mut())
            .expect("checked above");
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
        if let Some(c) = self
            .live
            .get_mut(&item.id)
            .and_then(|l| l.constraint.as_mut())
        {
            let keep = c.matcher.valid_prefix(&w.drafts);
            w.drafts.truncate(keep);
        }
        self.push_chain(seq, w);
    }

    /// Puts `w.drafts` into the batch after the decode token, in `seq`.
    fn push_chain(&mut self, seq: SeqId, w: &mut Want) {
        for (k, &d) in w.drafts.iter().enumerate() {
            let p = (w.pos + 1 + k) as u32;
            w.idx.push(self.batch.push(d, p, seq, true));
        }
    }

    /// Puts a token tree's branches into the batch after the decode token,
    /// each at positions `w.pos + 1..`, and records the tree in `w`. On
    /// llama.cpp's cells branch b > 0 runs in `temps[b - 1]`, given a copy of
    /// `seq`'s cells and the decode token; on our store every branch is in
    /// `seq` (the grafted step gives each run its own llama.cpp id) and
    /// branch b > 0 writes into this step's branch blocks — without enough
    /// of them left, nothing is pushed and the branches come back. (`temps`
    /// there are the draft model's, if any.)
    fn push_tree(
        &mut self,
        seq: SeqId,
        w: &mut Want,
        branches: Vec<Vec<TokenId>>,
        temps: Vec<SeqId>,
    ) -> Result<(), Vec<Vec<TokenId>>> {
        let decode_idx = w.idx[0];
        let blocks = match &mut self.kv {
            Kv::Llama(l) => {
                for &t in &temps {
                    let _ = l.ctx.seq_cp(seq, t, None, None);
                    self.batch.share(decode_idx, t);
                }
                Vec::new()
            }
            Kv::Graft(g) => {
                let lens: Vec<usize> = branches[1..].iter().map(Vec::len).collect();
                match g.take_branch_blocks(w.pos, &lens) {
                    Some(b) => b,
                    None => return Err(branches),
                }
            }
        };
        let on_llama = matches!(self.kv, Kv::Llama(_));
        let mut graft = Vec::with_capacity(blocks.len());
        let mut own = blocks.into_iter();
        for (b, branch) in branches.iter().enumerate() {
            let bseq = if b > 0 && on_llama { temps[b - 1] } else { seq };
            let first = self.batch.len();
            for (k, &tok) in branch.iter().enumerate() {
                let p = (w.pos + 1 + k) as u32;
                w.idx.push(self.batch.push(tok, p, bseq, true));
            }
            if b > 0
                && let Some(blocks) = own.next()
            {
                graft.push(Branch {
                    batch: first..self.batch.len(),
                    blocks,
                });
            }
        }
        w.drafts = branches.concat();
        w.tree = Some(TreeWant {
            branches,
            temps,
            graft,
        });
        Ok(())
    }

    /// What the step cost each speculating request per produced token:
    /// drafting that costs more than it saves switches itself off.
    pub(super) fn record_speculation(&mut self, step: &Step, started: Instant) {
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

    /// Gives back a token tree's temporary sequence ids and their cells.
    pub(super) fn release_tree(&mut self, w: &Want) {
        if let Some(t) = &w.tree {
            for &s in &t.temps {
                if let Kv::Llama(l) = &mut self.kv {
                    let _ = l.ctx.seq_rm(s, None, None);
                }
                if let Some(d) = self.draft.as_mut() {
                    let _ = d.ctx.seq_rm(s, None, None);
                }
                self.free_seqs.push(s);
            }
        }
    }

    /// Verifies a token tree greedily: the branch the target follows is kept
    /// (on llama.cpp's cells, its cells tagged into the request's own
    /// sequence; on our store, its rows copied into the request's blocks),
    /// every other node's cells and the temporary sequence ids go.
    pub(super) fn sample_tree(&mut self, w: &Want) {
        let id = &w.id;
        let t = w.tree.as_ref().expect("a tree");
        let seq = self.live.get(id).and_then(|l| l.seq);
        let argmax_at = |e: &Self, ix: usize| e.logits(ix).map(siliceo_core::sampler::argmax);
        let verdict = (|| {
            let root = argmax_at(self, w.idx[0])?;
            let nodes = w.idx[1..]
                .iter()
                .map(|&ix| argmax_at(self, ix))
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
        self.tree_later_branches_kept += u64::from(b > 0);
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
        let engine = |e: siliceo_engine::EngineError| RuntimeError::Engine(e.to_string());
        let fixed = match &mut self.kv {
            Kv::Llama(l) if b == 0 => l.ctx.seq_rm(seq, Some(first + a), None).map_err(engine),
            Kv::Llama(l) => l
                .ctx
                .seq_rm(seq, Some(first), None)
                .and_then(|()| {
                    l.ctx
                        .seq_cp(t.temps[b - 1], seq, Some(first), Some(first + a))
                })
                .map_err(engine),
            // Branch 0 wrote into the request's own rows; a later branch's
            // kept rows move there from its branch blocks.
            Kv::Graft(_) if b == 0 => Ok(()),
            Kv::Graft(g) => match self.sched.handle(id) {
                Some(h) => g.keep_branch(
                    self.sched.kv().block_table(h),
                    w.pos,
                    &t.graft[b - 1],
                    a as usize,
                ),
                None => Err(RuntimeError::Engine("a kept branch without blocks".into())),
            },
        };
        self.release_tree(w);
        if let Err(e) = fixed {
            return self.end(id, FinishReason::Error, Some(e));
        }
        if let Some(live) = self.live.get_mut(id) {
            for &tok in &accepted {
                live.sampler.accept(tok);
            }
        }
        self.emit(w, accepted, next, Vec::new());
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
