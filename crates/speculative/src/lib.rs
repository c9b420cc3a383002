//! Speculative decoding for siliceo-infer: the parts that need no model.
//!
//! - [`Drafter`]: anything that proposes the next tokens of a sequence;
//!   [`NgramDrafter`] proposes continuations found earlier in the prompt or
//!   output (prompt lookup: no model, no KV). A draft-model drafter needs
//!   llama.cpp and lives above this crate (runtime).
//! - [`verify_greedy`]: accept the longest drafted prefix the target agrees
//!   with, plus the target's own next token — the output is exactly what greedy
//!   decoding of the target alone gives.
//! - [`verify_sampled`]: rejection sampling (Leviathan et al., 2023): a drafted
//!   token `x` is kept with probability `min(1, p(x)/q(x))`; on rejection the
//!   token is drawn from the residual `max(0, p − q)`, normalised; if every
//!   drafted token is kept, a bonus token is drawn from the target. The output
//!   follows the target distribution `p` exactly (tested with a chi-square test).
//! - [`DraftTree`] and [`verify_tree_greedy`]: a small tree of drafts (e.g. the
//!   top 2 at the first positions) verified in one target batch; the accepted
//!   branch is the longest path the target agrees with.
//! - [`AdaptiveDraftLength`]: draft length from the running acceptance rate,
//!   and speculation off when the batch is large enough that it no longer pays.
//!
//! ```
//! use siliceo_core::TokenId;
//! use siliceo_speculative::{Drafter, NgramDrafter, verify_greedy};
//!
//! let t = |v: &[u32]| v.iter().map(|&x| TokenId(x)).collect::<Vec<_>>();
//! // "a b c d … a b" → the drafter proposes "c d".
//! let history = t(&[1, 2, 3, 4, 9, 1, 2]);
//! let draft = NgramDrafter::new(1, 3).propose(&history, 2);
//! assert_eq!(draft, t(&[3, 4]));
//! // The target's argmax after each prefix of the draft (k + 1 of them):
//! let v = verify_greedy(&draft, &t(&[3, 5, 7]));
//! assert_eq!((v.accepted, v.next), (1, TokenId(5)));
//! ```
//!
//! **Architecture invariant:** knows nothing of llama.cpp; models are reached
//! through traits the runtime implements over the engine.
#![deny(missing_docs)]

mod adaptive;
mod ngram;
mod tree;
mod verify;

pub use adaptive::{AdaptiveDraftLength, DraftCostMemory};
pub use ngram::NgramDrafter;
pub use tree::{DraftTree, verify_tree_greedy};
pub use verify::{Distribution, Verdict, verify_greedy, verify_sampled};

use siliceo_core::TokenId;

/// Proposes up to `k` tokens that may follow `history` (prompt and output so
/// far). Proposals are only guesses: verification decides what is kept.
pub trait Drafter {
    /// Up to `k` proposed tokens (possibly none).
    fn propose(&mut self, history: &[TokenId], k: usize) -> Vec<TokenId>;
    /// A short name for metrics (`ngram`, `draft-model`, …).
    fn name(&self) -> &'static str;
}
