//! Thinking budgets: a reasoning model's `<think>` block closed for it once
//! it has thought for so many tokens (Anthropic's `thinking.budget_tokens`,
//! vLLM's `thinking_token_budget`, OpenAI's effort levels mapped to
//! budgets by the HTTP layer).
//!
//! The engine asks [`ThinkBudget::forced`] before it samples a request's
//! token: once the budget is spent (and the last character is whole), the
//! tokens of `"\n</think>\n\n"` (the model's own closing tag) are forced one
//! per step instead of sampled,
//! and the model answers from there. Tokens count while the block is open,
//! from the one that completes an opening tag the model writes; the forced
//! close does not count. A block the model closes itself ends the budget's work.

use std::sync::Arc;

use siliceo_chat::{ThinkSplitter, ThinkTags};
use siliceo_core::TokenId;
use siliceo_engine::Utf8Stream;

/// One request's thinking budget, as its tokens come.
#[derive(Debug, Clone)]
pub(crate) struct ThinkBudget {
    split: ThinkSplitter,
    /// Thinking tokens still allowed.
    left: u32,
    /// The tokens of the tags' [`ThinkTags::forced_close`].
    close: Arc<[TokenId]>,
    /// How many of `close` were forced.
    forced: usize,
    /// The text so far, a character split across tokens held back.
    utf8: Utf8Stream,
}

impl ThinkBudget {
    /// A budget of `budget` thinking tokens for an output that starts inside
    /// the block (`open`: the prompt opened it) or may open one, in `tags`.
    pub(crate) fn new(tags: ThinkTags, open: bool, budget: u32, close: Arc<[TokenId]>) -> Self {
        ThinkBudget {
            split: ThinkSplitter::new(open).with_tags(tags),
            left: budget,
            close,
            forced: 0,
            utf8: Utf8Stream::new(),
        }
    }

    /// The token the request must take next, instead of sampling one.
    pub(crate) fn forced(&self) -> Option<TokenId> {
        let whole = self.utf8.pending_len() == 0;
        let due = self.forced > 0 || (self.left == 0 && whole && self.split.thinking());
        if due {
            self.close.get(self.forced).copied()
        } else {
            None
        }
    }

    /// Drafted tokens the request may verify in one step: never past its
    /// budget (the step's own token included), none while it is forced.
    pub(crate) fn max_drafts(&self) -> usize {
        if self.forced > 0 || self.left == 0 {
            0
        } else {
            self.left as usize - 1
        }
    }

    /// Takes the request's next token and its bytes. Returns whether the
    /// budget still has work: false once the block closed (forced or by
    /// the model) or the answer began without one.
    pub(crate) fn push(&mut self, token: TokenId, bytes: &[u8]) -> bool {
        if let Some(f) = self.forced() {
            debug_assert_eq!(token, f, "a forced token was not taken");
            self.forced += 1;
            return token == f && self.forced < self.close.len();
        }
        let text = self.utf8.push(bytes);
        self.split.push(&text);
        if self.split.settled() {
            return false;
        }
        if self.split.thinking() {
            self.left = self.left.saturating_sub(1);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLOSE: [TokenId; 3] = [TokenId(90), TokenId(91), TokenId(92)];

    fn budget(open: bool, n: u32) -> ThinkBudget {
        ThinkBudget::new(ThinkTags::ANGLE, open, n, Arc::from(&CLOSE[..]))
    }

    /// Feeds `texts` as tokens 1, 2, …, taking forced tokens where due;
    /// returns the tokens taken, and whether the budget still had work.
    fn run(b: &mut ThinkBudget, texts: &[&str]) -> (Vec<TokenId>, bool) {
        let mut taken = Vec::new();
        let mut texts = texts.iter().enumerate();
        loop {
            let (t, bytes) = match b.forced() {
                Some(f) => (f, "".as_bytes()),
                None => match texts.next() {
                    Some((i, s)) => (TokenId(i as u32 + 1), s.as_bytes()),
                    None => return (taken, true),
                },
            };
            taken.push(t);
            if !b.push(t, bytes) {
                return (taken, false);
            }
        }
    }

    fn ids(v: &[u32]) -> Vec<TokenId> {
        v.iter().copied().map(TokenId).collect()
    }

    #[test]
    fn an_open_block_is_closed_after_its_budget() {
        let mut b = budget(true, 3);
        let (taken, more) = run(&mut b, &["a", " b", " c", " d", " e"]);
        assert_eq!(taken, ids(&[1, 2, 3, 90, 91, 92]));
        assert!(!more);
        // A budget of none closes at once.
        let (taken, _) = run(&mut budget(true, 0), &["a"]);
        assert_eq!(taken, ids(&[90, 91, 92]));
    }

    #[test]
    fn the_model_opening_the_block_starts_the_count() {
        // Whitespace, then an opening tag in two tokens: the second counts.
        let mut b = budget(false, 3);
        let (taken, _) = run(&mut b, &[" ", "<thi", "nk>", "x", "y", "z"]);
        assert_eq!(taken, ids(&[1, 2, 3, 4, 5, 90, 91, 92]));
    }

    #[test]
    fn a_block_the_model_closes_or_never_opens_is_left_alone() {
        let (taken, more) = run(&mut budget(true, 3), &["a", "</think>", "b", "c"]);
        assert_eq!((taken, more), (ids(&[1, 2]), false));
        // The close in pieces, the last arriving with the budget spent.
        let (taken, more) = run(&mut budget(true, 2), &["</th", "ink>", "x"]);
        assert_eq!((taken, more), (ids(&[1, 2]), false));
        let (taken, more) = run(&mut budget(false, 1), &["Paris", "x"]);
        assert_eq!((taken, more), (ids(&[1]), false));
    }

    #[test]
    fn a_character_split_across_tokens_is_finished_first() {
        // "é" is C3 A9, here in two tokens; the budget runs out on the first.
        let mut b = budget(true, 1);
        let mut taken = Vec::new();
        for (t, bytes) in [(1, &[0xC3u8][..]), (2, &[0xA9])] {
            assert_eq!(b.forced(), None, "forced inside a character");
            taken.push(TokenId(t));
            assert!(b.push(TokenId(t), bytes));
        }
        assert_eq!(b.forced(), Some(TokenId(90)));
    }

    #[test]
    fn square_tags_are_counted_alike() {
        let mut b = ThinkBudget::new(ThinkTags::SQUARE, false, 2, Arc::from(&CLOSE[..]));
        let (taken, _) = run(&mut b, &["[THINK]", "a", "b", "c"]);
        assert_eq!(taken, ids(&[1, 2, 90, 91, 92]));
        assert_eq!(ThinkTags::SQUARE.forced_close(), "\n[/THINK]\n\n");
    }

    #[test]
    fn harmony_analysis_is_counted_and_closed_into_the_final_message() {
        let mut b = ThinkBudget::new(ThinkTags::HARMONY, false, 2, Arc::from(&CLOSE[..]));
        let (taken, _) = run(
            &mut b,
            &["<|channel|>", "analysis", "<|message|>", "a", "b", "c"],
        );
        assert_eq!(taken, ids(&[1, 2, 3, 4, 90, 91, 92]));
        assert_eq!(
            ThinkTags::HARMONY.forced_close(),
            "<|end|><|start|>assistant<|channel|>final<|message|>"
        );
        // A model that goes straight to its answer is left alone.
        let mut b = ThinkBudget::new(ThinkTags::HARMONY, false, 0, Arc::from(&CLOSE[..]));
        let (taken, more) = run(&mut b, &["<|channel|>final<|message|>", "a", "b"]);
        assert_eq!((taken, more), (ids(&[1]), false));
    }

    #[test]
    fn drafts_never_run_past_the_budget() {
        let mut b = budget(true, 3);
        assert_eq!(b.max_drafts(), 2);
        b.push(TokenId(1), b"a");
        b.push(TokenId(2), b"b");
        assert_eq!(b.max_drafts(), 0);
        b.push(TokenId(3), b"c");
        assert_eq!(b.max_drafts(), 0);
        assert_eq!(b.forced(), Some(TokenId(90)));
    }
}
