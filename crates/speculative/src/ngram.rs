//! Prompt lookup: propose what followed the latest earlier occurrence of the
//! sequence's last n tokens.

use siliceo_core::TokenId;

use crate::Drafter;

/// Proposes continuations of the last `n` tokens (longest `n` first, from
/// `n_max` down to `n_min`) found earlier in the history. Works well on
/// outputs that quote their input (code edits, extraction, summaries).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramDrafter {
    n_min: usize,
    n_max: usize,
}

impl NgramDrafter {
    /// A drafter matching suffixes of `n_min..=n_max` tokens (clamped to ≥ 1).
    pub fn new(n_min: usize, n_max: usize) -> Self {
        let n_min = n_min.max(1);
        NgramDrafter {
            n_min,
            n_max: n_max.max(n_min),
        }
    }
}

impl NgramDrafter {
    /// Up to `width` drafted branches with distinct first tokens, at most
    /// `k` tokens in all: continuations of the latest earlier occurrences of
    /// the history's last n tokens (longest n first). The first branch is
    /// what [`Drafter::propose`] would give, shortened to its share.
    pub fn propose_branches(
        &self,
        history: &[TokenId],
        k: usize,
        width: usize,
    ) -> Vec<Vec<TokenId>> {
        let width = width.max(1);
        let share = (k / width).max(1);
        let len = history.len();
        let mut out: Vec<Vec<TokenId>> = Vec::new();
        for n in (self.n_min..=self.n_max.min(len.saturating_sub(1))).rev() {
            let suffix = &history[len - n..];
            for j in (0..len - n).rev() {
                if out.len() == width || out.iter().map(Vec::len).sum::<usize>() + 1 > k {
                    return out;
                }
                if &history[j..j + n] != suffix {
                    continue;
                }
                let start = j + n;
                let end = (start + share).min(len);
                let cont = &history[start..end];
                if !cont.is_empty() && out.iter().all(|b| b[0] != cont[0]) {
                    let room = k - out.iter().map(Vec::len).sum::<usize>();
                    out.push(cont[..cont.len().min(room)].to_vec());
                }
            }
        }
        out
    }
}

impl Default for NgramDrafter {
    /// Suffixes of 3 to 4 tokens. Shorter ones match by chance (a newline,
    /// `def`, a space) and their drafts are mostly rejected: measured on 2
    /// cores with suffixes of 1 to 3, the 1.5B Qwen target drafted 4 tokens
    /// per answer and kept 0–1 (its first miss paused drafting for cost);
    /// with 3 to 4 it kept 8 / 14, 4 / 4, 15 / 17 on three of five prompts,
    /// 0.90–1.04× → 1.09–1.26× (docs/BENCHMARKS.md, session 16).
    fn default() -> Self {
        NgramDrafter::new(3, 4)
    }
}

impl Drafter for NgramDrafter {
    fn propose(&mut self, history: &[TokenId], k: usize) -> Vec<TokenId> {
        if k == 0 {
            return Vec::new();
        }
        let len = history.len();
        for n in (self.n_min..=self.n_max.min(len.saturating_sub(1))).rev() {
            let suffix = &history[len - n..];
            // The most recent earlier occurrence that has a continuation.
            let found = (0..len - n).rev().find(|&j| &history[j..j + n] == suffix);
            if let Some(j) = found {
                let start = j + n;
                let end = (start + k).min(len);
                return history[start..end].to_vec();
            }
        }
        Vec::new()
    }

    fn name(&self) -> &'static str {
        "ngram"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[u32]) -> Vec<TokenId> {
        v.iter().map(|&x| TokenId(x)).collect()
    }

    #[test]
    fn longest_suffix_wins_and_latest_occurrence_is_used() {
        let mut d = NgramDrafter::new(1, 3);
        // "5 6" occurs twice; the later occurrence continues with 8.
        let h = t(&[5, 6, 7, 1, 5, 6, 8, 2, 5, 6]);
        assert_eq!(d.propose(&h, 2), t(&[8, 2]));
        // The 3-token suffix "1 2 3" matches at the start.
        let h = t(&[1, 2, 3, 9, 9, 1, 2, 3]);
        assert_eq!(d.propose(&h, 3), t(&[9, 9, 1]));
    }

    #[test]
    fn branches_have_distinct_first_tokens_and_fit_the_budget() {
        let d = NgramDrafter::new(1, 2);
        // "7" was followed by 1 2, then by 3 4, then by 1 5.
        let h = t(&[7, 1, 2, 9, 7, 3, 4, 9, 7, 1, 5, 9, 7]);
        let b = d.propose_branches(&h, 4, 2);
        assert_eq!(b, vec![t(&[1, 5]), t(&[3, 4])]);
        // One branch when width is 1; the budget caps the total.
        assert_eq!(d.propose_branches(&h, 4, 1), vec![t(&[1, 5, 9, 7])]);
        let b = d.propose_branches(&h, 3, 3);
        assert!(b.iter().map(Vec::len).sum::<usize>() <= 3, "{b:?}");
        assert_eq!(
            b.len(),
            2,
            "only two distinct continuations of 7 exist: {b:?}"
        );
    }

    #[test]
    fn the_default_needs_three_matching_tokens() {
        let mut d = NgramDrafter::default();
        // Only "4 5" (two tokens) recurs: no draft.
        assert!(d.propose(&t(&[1, 4, 5, 6, 7, 2, 4, 5]), 3).is_empty());
        // "3 4 5" recurs: its continuation is drafted.
        assert_eq!(d.propose(&t(&[3, 4, 5, 6, 7, 2, 3, 4, 5]), 2), t(&[6, 7]));
    }

    #[test]
    fn nothing_to_propose() {
        let mut d = NgramDrafter::default();
        assert!(d.propose(&t(&[1, 2, 3]), 4).is_empty());
        assert!(d.propose(&t(&[]), 4).is_empty());
        assert!(d.propose(&t(&[1, 1]), 0).is_empty());
        // The continuation is cut at the end of the history.
        let mut one = NgramDrafter::new(1, 3);
        assert_eq!(one.propose(&t(&[4, 7, 4]), 5), t(&[7, 4]));
        assert_eq!(d.propose(&t(&[4, 7, 4, 7, 4]), 5), t(&[7, 4]));
    }
}
