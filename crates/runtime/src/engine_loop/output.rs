//! Sampling, streaming and ending requests.

use std::time::Instant;

use siliceo_core::{FinishReason, RequestId, TokenId};
use siliceo_speculative::verify_sampled;
use tokio::sync::mpsc::UnboundedSender;

use super::kv::Kv;
use super::{Engine, Want};
use crate::{Event, RuntimeError, TokenLogprob, Usage};

/// `token`'s log-softmax in the raw logits `row`, and the `k` most likely
/// tokens'.
fn logprob_of(model: &siliceo_engine::Model, row: &[f32], token: TokenId, k: u32) -> TokenLogprob {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lse = max + sum.ln() as f32;
    let lp = |t: u32| row.get(t as usize).map_or(f32::NEG_INFINITY, |&l| l - lse);
    let own = row
        .get(token.0 as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY);
    let rank = 1 + row.iter().filter(|&&l| l > own).count() as u32;
    let mut top: Vec<u32> = Vec::new();
    if k > 0 {
        let mut ids: Vec<u32> = (0..row.len() as u32).collect();
        let k = (k as usize).min(ids.len());
        let by_logit =
            |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
        ids.select_nth_unstable_by(k - 1, by_logit);
        ids.truncate(k);
        ids.sort_unstable_by(by_logit);
        top = ids;
    }
    TokenLogprob {
        token,
        bytes: model.token_bytes(token, false),
        logprob: lp(token.0),
        rank,
        top: top
            .into_iter()
            .map(|t| (TokenId(t), model.token_bytes(TokenId(t), false), lp(t)))
            .collect(),
    }
}

/// A constrained request's matcher failed mid-generation.
fn constraint_failed(e: siliceo_constrain::ConstraintError) -> RuntimeError {
    RuntimeError::Engine(format!("constraint: {e}"))
}

pub(super) fn done(
    tx: &UnboundedSender<Event>,
    finish_reason: FinishReason,
    usage: Usage,
    error: Option<RuntimeError>,
    stop: Option<String>,
) {
    let _ = tx.send(Event::Done {
        finish_reason,
        usage,
        error,
        stop,
    });
}

/// Logits of batch index `ix` (borrowing only the KV, not the whole engine).
fn kv_logits<'a>(kv: &'a Kv<'_>, ix: usize) -> Result<&'a [f32], siliceo_engine::EngineError> {
    match kv {
        Kv::Llama(l) => l.ctx.logits(ix),
        Kv::Graft(g) => g.ctx.logits(ix),
    }
}

impl Engine<'_> {
    /// Ends a request: frees its blocks, cells and id, sends `Done`.
    pub(super) fn end(
        &mut self,
        id: &RequestId,
        reason: FinishReason,
        error: Option<RuntimeError>,
    ) {
        self.close(id, reason, error, false);
    }

    /// [`end`](Self::end); with `abort`, the blocks of the step that failed are
    /// not offered to the prefix cache.
    pub(super) fn close(
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
                        tokens: Vec::new(),
                        logprobs: Vec::new(),
                    });
                }
            }
            let stop = live.text.stop_string().map(str::to_string);
            if let Some(s) = stop.as_ref().filter(|_| live.include_stop) {
                let _ = live.tx.send(Event::Text {
                    text: s.clone(),
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                });
            }
            done(&live.tx, reason, live.usage(), error, stop);
        }
    }

    /// Reads the log-probability of the prompt token after position `pos`
    /// from the logits at batch index `ix`.
    pub(super) fn score_prompt(&mut self, id: &RequestId, ix: usize, pos: usize) {
        let Some(p) = self.live.get_mut(id).and_then(|l| l.prompt_lp.as_mut()) else {
            return;
        };
        // Positions arrive in order; one computed again (after a preemption)
        // was read the first time.
        if p.sent || pos != p.got.len() {
            return;
        }
        match kv_logits(&self.kv, ix) {
            Ok(raw) => p
                .got
                .push(logprob_of(self.model, raw, p.tokens[pos + 1], p.top)),
            Err(_) => {
                let err = RuntimeError::Engine("missing prompt logits".into());
                self.end(id, FinishReason::Error, Some(err));
            }
        }
    }

    /// Sends a request's prompt log-probabilities once its whole prompt is
    /// computed (before its first token). Returns false when the request
    /// ended: it only scored its prompt, or a position was missed.
    fn send_prompt_logprobs(&mut self, id: &RequestId) -> bool {
        let Some(live) = self.live.get_mut(id) else {
            return false;
        };
        let Some(p) = live.prompt_lp.as_mut().filter(|p| !p.sent) else {
            return true;
        };
        p.sent = true;
        if p.got.len() + 1 != p.tokens.len() {
            let err = RuntimeError::Engine(format!(
                "prompt log-probabilities for {} of {} positions",
                p.got.len(),
                p.tokens.len() - 1
            ));
            self.end(id, FinishReason::Error, Some(err));
            return false;
        }
        let first = p.tokens[0];
        let _ = live.tx.send(Event::Prompt {
            first: (first, self.model.token_bytes(first, false)),
            logprobs: std::mem::take(&mut p.got),
        });
        if p.only {
            self.end(id, FinishReason::Length, None);
            return false;
        }
        true
    }

    /// Samples the next token of a request (verifying its drafted tokens
    /// first, if any), streams what it produced, and reports it.
    pub(super) fn sample(&mut self, w: &Want) {
        let id = &w.id;
        if !self.send_prompt_logprobs(id) {
            return;
        }
        if w.tree.is_some() {
            return self.sample_tree(w);
        }
        let Some(live) = self.live.get_mut(id) else {
            return;
        };
        let greedy = live.sampler.params().is_greedy();
        let mut accepted: Vec<TokenId> = Vec::new();
        let mut next = None;
        let mut lps: Vec<TokenLogprob> = Vec::new();
        for (i, &ix) in w.idx.iter().enumerate() {
            let Ok(raw) = kv_logits(&self.kv, ix) else {
                let err = RuntimeError::Engine("missing logits".into());
                return self.end(id, FinishReason::Error, Some(err));
            };
            // The row sampled from: `raw`, or a masked copy of it.
            let mut logits: &[f32] = raw;
            // A constrained request samples from its masked logits.
            if let Some(c) = live.constraint.as_mut() {
                match c.next_mask(&mut self.mask_stats) {
                    Ok(mask) => logits = c.masked(logits, &mask),
                    Err(e) => return self.end(id, FinishReason::Error, Some(constraint_failed(e))),
                }
            }
            // `min_tokens`: nothing that would end it yet, unless nothing
            // else is left (a constraint that must end).
            if live.completion_tokens < live.min_tokens && !live.banned.is_empty() {
                live.ban_buf.clear();
                live.ban_buf.extend_from_slice(logits);
                for t in &live.banned {
                    if let Some(l) = live.ban_buf.get_mut(t.0 as usize) {
                        *l = f32::NEG_INFINITY;
                    }
                }
                if live.ban_buf.iter().any(|l| l.is_finite()) {
                    logits = &live.ban_buf;
                }
            }
            let Some(&d) = w.drafts.get(i) else {
                // A thinking budget spent closes the block: its tokens are
                // taken, not sampled. A constraint that refuses one keeps
                // its own course, and the budget ends.
                let forced = match live.think.as_ref().and_then(|t| t.forced()) {
                    Some(f) if logits.get(f.0 as usize).is_some_and(|l| l.is_finite()) => Some(f),
                    Some(_) => {
                        live.think = None;
                        None
                    }
                    None => None,
                };
                let t = forced.unwrap_or_else(|| live.sampler.sample(logits));
                if let Some(k) = live.logprobs {
                    lps.push(logprob_of(self.model, raw, t, k));
                }
                next = Some(t);
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
                if let Some(c) = live.constraint.as_mut()
                    && let Err(e) = c.accept(d)
                {
                    return self.end(id, FinishReason::Error, Some(constraint_failed(e)));
                }
                live.sampler.accept(d);
                accepted.push(d);
                if let Some(k) = live.logprobs {
                    lps.push(logprob_of(self.model, raw, d, k));
                }
            } else {
                if let Some(k) = live.logprobs {
                    lps.push(logprob_of(self.model, raw, v.next, k));
                }
                next = Some(v.next);
                break;
            }
        }
        let Some(next) = next else {
            return;
        };
        if let Some(c) = live.constraint.as_mut()
            && let Err(e) = c.accept(next)
        {
            return self.end(id, FinishReason::Error, Some(constraint_failed(e)));
        }
        // Rejected drafts' cells go at once.
        if accepted.len() < w.drafts.len()
            && let Some(seq) = live.seq
        {
            let from = (w.pos + 1 + accepted.len()) as u32;
            if let Err(err) = self.drop_after(seq, from) {
                return self.end(id, FinishReason::Error, Some(err));
            }
        }
        self.emit(w, accepted, next, lps);
    }

    /// Streams and reports what a step produced for one request: accepted
    /// drafted tokens (KV already fixed up, already given to the sampler) and
    /// the target's next token.
    pub(super) fn emit(
        &mut self,
        w: &Want,
        accepted: Vec<TokenId>,
        next: TokenId,
        mut logprobs: Vec<TokenLogprob>,
    ) {
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
        // One event for the step: the text of every token up to a stop.
        let mut text = String::new();
        let mut tokens = Vec::with_capacity(accepted.len() + 1);
        let mut stopped = false;
        for &token in accepted.iter().chain(std::iter::once(&next)) {
            live.completion_tokens += 1;
            if let Some(t) = live.think.as_mut()
                && !t.push(token, &live.text.bytes_of(token))
            {
                live.think = None;
            }
            let (piece, stop) = live.text.push(token);
            text.push_str(&piece);
            tokens.push(token);
            if stop {
                stopped = true;
                break;
            }
        }
        logprobs.truncate(tokens.len());
        let closed = live
            .tx
            .send(Event::Text {
                text,
                tokens,
                logprobs,
            })
            .is_err();
        if stopped {
            return self.end(id, FinishReason::Stop, None);
        }
        if closed {
            return self.end(id, FinishReason::Cancelled, None);
        }
        // A complete constrained output ends here even when its
        // end-of-generation token is ignored.
        if live
            .constraint
            .as_ref()
            .is_some_and(|c| c.matcher.is_finished())
        {
            return self.end(id, FinishReason::Stop, None);
        }
        if let Some(f) = self.sched.on_tokens(id, &accepted, next) {
            if let Some(seq) = self.live.get_mut(id).and_then(|l| l.seq.take()) {
                self.retire(seq, &f.blocks);
            }
            self.end(id, FinishReason::Length, None);
        }
    }
}
