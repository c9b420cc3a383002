//! Admission: a request validated, tokenized and queued.

use std::time::Instant;

use siliceo_core::{FinishReason, RequestId, Sampler, TokenId};
use siliceo_engine::TokenText;
use siliceo_scheduler::Request;
use siliceo_speculative::{AdaptiveDraftLength, NgramDrafter};
use tokio::sync::mpsc::UnboundedSender;

use super::output::done;
use super::speculative::Spec;
use super::{Constrained, Engine, Live};
use crate::{Event, GenerateRequest, Input, RuntimeError, Submission, Usage};

impl Engine<'_> {
    pub(super) fn tokens_of(&self, input: Input) -> Result<Vec<TokenId>, RuntimeError> {
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
                // Only without a usable Jinja template (the runtime renders
                // chats before they get here): llama.cpp's built-in guess.
                let msgs: Vec<siliceo_engine::ChatMessage> = msgs
                    .into_iter()
                    .map(|m| {
                        siliceo_engine::ChatMessage::new(m.role, m.content.unwrap_or_default())
                    })
                    .collect();
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
        let n_ctx = self.max_seq_len;
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

    /// Admits a request: validated, tokenized and queued, or refused with its
    /// stream's `Done` event. `accepted` (when given) hears which, at once:
    /// the prompt's token count, or the error.
    pub(super) fn submit(&mut self, sub: Submission) {
        let Submission {
            req,
            id,
            tx,
            accepted,
            matcher,
        } = sub;
        let mut accepted = accepted;
        let fail = |e: RuntimeError| {
            if let Some(a) = accepted.take() {
                let _ = a.send(Err(e.clone()));
            }
            done(&tx, FinishReason::Error, Usage::default(), Some(e));
        };
        let Some(prompt_tokens) = self.admit(req, id, matcher, &tx, fail) else {
            return;
        };
        if let Some(a) = accepted {
            let _ = a.send(Ok(prompt_tokens));
        }
    }

    /// [`submit`](Self::submit)'s work; `None` after calling `fail`.
    fn admit(
        &mut self,
        req: GenerateRequest,
        id: RequestId,
        matcher: Option<siliceo_constrain::Matcher>,
        tx: &UnboundedSender<Event>,
        fail: impl FnOnce(RuntimeError),
    ) -> Option<u32> {
        let submitted = Instant::now();
        if let Err(siliceo_core::Error::InvalidParameter { field, reason }) =
            req.sampling.validate()
        {
            fail(RuntimeError::InvalidRequest { field, reason });
            return None;
        }
        if let Some(k) = req.logprobs
            && k > crate::MAX_TOP_LOGPROBS
        {
            fail(RuntimeError::InvalidRequest {
                field: "top_logprobs",
                reason: format!("at most {} alternatives per token", crate::MAX_TOP_LOGPROBS),
            });
            return None;
        }
        let n_vocab = self.model.geometry().n_vocab;
        if let Some((t, _)) = req.sampling.logit_bias.iter().find(|(t, _)| t.0 >= n_vocab) {
            fail(RuntimeError::InvalidRequest {
                field: "logit_bias",
                reason: format!("token id {} is outside the vocabulary of {n_vocab}", t.0),
            });
            return None;
        }
        if self.live.contains_key(&id) {
            fail(RuntimeError::Rejected {
                kind: "duplicate_id",
                reason: format!("request {id} is already running"),
            });
            return None;
        }
        let tokens = match self.tokens_of(req.input) {
            Ok(t) => t,
            Err(e) => {
                fail(e);
                return None;
            }
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
            fail(RuntimeError::Rejected {
                kind: r.error_kind(),
                reason: r.to_string(),
            });
            return None;
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
                tx: tx.clone(),
                spec,
                draft_tokens: 0,
                accepted_draft_tokens: 0,
                speculative_steps: 0,
                sampler,
                constraint: matcher.map(Constrained::new),
                logprobs: req.logprobs,
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
        Some(tokens.len() as u32)
    }
}
