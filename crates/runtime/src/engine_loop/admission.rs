//! Admission: a prepared request (see `front.rs`) queued.

use siliceo_core::{FinishReason, Sampler};
use siliceo_engine::TokenText;
use siliceo_scheduler::{Rejected, Request};
use siliceo_speculative::{AdaptiveDraftLength, NgramDrafter};

use super::output::done;
use super::speculative::Spec;
use super::{Constrained, Engine, Live, PromptLogprobs};
use crate::{RuntimeError, Submission, Usage};

/// Most prompt tokens a step computes for a request that reads every
/// position's logits: llama.cpp keeps room for the logits of a step's
/// tokens (here 64 rows of the vocabulary, about 39 MB at Qwen2.5's 152k),
/// and never shrinks it.
const PROMPT_LOGPROBS_CHUNK: usize = 64;

impl Engine<'_> {
    /// Admits a request: queued, or refused with its stream's `Done` event.
    /// `accepted` (when given) hears which, at once: the prompt's token
    /// count, or the error.
    pub(super) fn submit(&mut self, mut sub: Submission) {
        let mut accepted = sub.accepted.take();
        let tx = sub.tx.clone();
        let fail = |e: RuntimeError| {
            if let Some(a) = accepted.take() {
                let _ = a.send(Err(e.clone()));
            }
            done(&tx, FinishReason::Error, Usage::default(), Some(e), None);
        };
        let Some(prompt_tokens) = self.admit(sub, fail) else {
            return;
        };
        if let Some(a) = accepted {
            let _ = a.send(Ok(prompt_tokens));
        }
    }

    /// [`submit`](Self::submit)'s work; `None` after calling `fail`.
    fn admit(&mut self, sub: Submission, fail: impl FnOnce(RuntimeError)) -> Option<u32> {
        let Submission {
            req,
            tokens,
            id,
            tx,
            matcher,
            banned,
            think,
            preserved,
            submitted,
            ..
        } = sub;
        if self.live.contains_key(&id) {
            fail(RuntimeError::Rejected(Rejected::DuplicateId(id)));
            return None;
        }
        let now = self.now_ms();
        let keys = match &req.cache_salt {
            Some(salt) if !salt.is_empty() => self.keys.clone().with_salt(salt.clone()),
            _ => self.keys.clone(),
        };
        // A request that only scores its prompt still holds the slot of a
        // first token, which it never samples.
        let mut sreq = Request::new(
            id.clone(),
            tokens.clone(),
            req.sampling.max_tokens.max(1),
            keys,
            req.priority,
            now,
        );
        if req.prompt_logprobs.is_some() {
            sreq = sreq.computing_whole_prompt(PROMPT_LOGPROBS_CHUNK);
        }
        if let Some(d) = req.deadline {
            sreq = sreq.with_deadline(now + d.as_millis() as u64);
        }
        if let Err(r) = self.sched.add(sreq) {
            fail(RuntimeError::Rejected(r));
            return None;
        }
        let mut sampler = Sampler::new(&req.sampling);
        for &t in &tokens {
            sampler.accept(t);
        }
        // `min_tokens` bans what would end the request: not with drafts.
        let spec = match (&self.speculative, req.speculative && req.min_tokens == 0) {
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
                constraint: matcher.map(Constrained::new),
                logprobs: req.logprobs,
                prompt_lp: req.prompt_logprobs.map(|top| PromptLogprobs {
                    top,
                    tokens: tokens.clone(),
                    got: Vec::with_capacity(tokens.len().saturating_sub(1)),
                    sent: false,
                    only: req.sampling.max_tokens == 0,
                }),
                text: TokenText::new(self.model, &req.sampling)
                    .with_min_tokens(req.min_tokens)
                    .with_preserved(preserved),
                include_stop: req.include_stop_str,
                min_tokens: req.min_tokens,
                banned,
                ban_buf: Vec::new(),
                think,
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
        Some(tokens.len() as u32)
    }
}
