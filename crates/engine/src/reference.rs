//! A greedy reference run for checking batched serving against a sequence
//! decoded alone.
//!
//! llama.cpp sums attention over KV cells in cell-index order, so the same
//! sequence placed in different cells (other sequences around it, holes,
//! a swap-in, a prefix copied from the cache) rounds differently, and small
//! models amplify rounding: greedy outputs can flip where the best two logits
//! nearly tie. [`GreedyTrace::check`] accepts a flip only at the first
//! divergence and only to a token whose logit was within `near_tie` of the
//! best one — a serving bug (wrong position, lost or repeated token, another
//! request's KV) still fails it.

use siliceo_core::{SeqId, TokenId};

use crate::{Batch, Context, ContextOptions, EngineError, Model};

/// Greedy tokens of one prompt decoded alone, with the near ties at each step.
#[derive(Debug, Clone, PartialEq)]
pub struct GreedyTrace {
    /// The greedy tokens.
    pub tokens: Vec<TokenId>,
    /// Gap between the best and second-best logit at each step.
    pub margins: Vec<f32>,
    /// Other tokens whose logit was within `near_tie` of the best, per step.
    pub near: Vec<Vec<TokenId>>,
}

impl GreedyTrace {
    /// Decodes `prompt` alone in a fresh single-sequence context for `n`
    /// greedy tokens (end-of-generation tokens do not stop it).
    pub fn run(
        model: &Model,
        prompt: &[TokenId],
        n: u32,
        near_tie: f32,
    ) -> Result<GreedyTrace, EngineError> {
        let n_ctx = (prompt.len() as u32 + n + 64).next_multiple_of(256);
        let mut ctx = Context::new(
            model,
            ContextOptions {
                n_ctx,
                n_seq_max: 1,
                ..ContextOptions::default()
            },
        )?;
        let mut logits = ctx.prefill(SeqId(0), prompt, 0)?;
        let mut t = GreedyTrace {
            tokens: Vec::new(),
            margins: Vec::new(),
            near: Vec::new(),
        };
        for pos in (prompt.len() as u32..).take(n as usize) {
            let mut idx: Vec<usize> = (0..logits.len()).collect();
            idx.sort_unstable_by(|a, b| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b)));
            let best = idx[0];
            t.tokens.push(TokenId(best as u32));
            t.margins.push(logits[best] - logits[idx[1]]);
            t.near.push(
                idx[1..]
                    .iter()
                    .take_while(|i| logits[best] - logits[**i] < near_tie)
                    .map(|i| TokenId(*i as u32))
                    .collect(),
            );
            let mut b = Batch::new();
            let i = b.push(TokenId(best as u32), pos, SeqId(0), true);
            ctx.decode(&b)?;
            logits = ctx.logits(i)?.to_vec();
        }
        Ok(t)
    }

    /// `Ok(None)` when `got` equals the reference, `Ok(Some(k))` when it
    /// flipped at token `k` to a near tie, `Err` when it differs otherwise.
    pub fn check(&self, got: &[TokenId]) -> Result<Option<usize>, String> {
        if got.len() != self.tokens.len() {
            return Err(format!(
                "{} tokens, the reference has {}",
                got.len(),
                self.tokens.len()
            ));
        }
        match got.iter().zip(&self.tokens).position(|(a, b)| a != b) {
            None => Ok(None),
            Some(k) if self.near[k].contains(&got[k]) => Ok(Some(k)),
            Some(k) => Err(format!(
                "diverged at token {k}: got {}, want {} (margin {}, near ties {:?})",
                got[k], self.tokens[k], self.margins[k], self.near[k]
            )),
        }
    }
}
