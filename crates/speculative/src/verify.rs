//! Verification of drafted tokens against the target model.

use siliceo_core::TokenId;

/// A sparse probability distribution: `(token, probability)` pairs summing to
/// 1 (what `siliceo_core::Sampler::distribution` returns). Tokens not listed
/// have probability 0.
pub type Distribution = [(TokenId, f32)];

/// The outcome of verifying `k` drafted tokens: the first `accepted` drafted
/// tokens are kept, then `next` (the target's correction, or a bonus token when
/// all `k` were kept). Generation advances by `accepted + 1` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Drafted tokens kept (a prefix of the draft).
    pub accepted: usize,
    /// The token after them, chosen by the target.
    pub next: TokenId,
}

/// Greedy verification. `target_argmax[i]` is the target's argmax after the
/// context plus `draft[..i]`; it has `draft.len() + 1` entries.
///
/// # Panics
/// When `target_argmax` does not have `draft.len() + 1` entries.
pub fn verify_greedy(draft: &[TokenId], target_argmax: &[TokenId]) -> Verdict {
    assert_eq!(
        target_argmax.len(),
        draft.len() + 1,
        "one target prediction per drafted token, plus one"
    );
    let accepted = draft
        .iter()
        .zip(target_argmax)
        .take_while(|(d, t)| d == t)
        .count();
    Verdict {
        accepted,
        next: target_argmax[accepted],
    }
}

fn prob(d: &Distribution, t: TokenId) -> f32 {
    d.iter().find(|(x, _)| *x == t).map_or(0.0, |(_, p)| *p)
}

/// Draws from `d` (weights need not sum exactly to 1) with a uniform `u` in [0, 1).
fn draw(d: &[(TokenId, f32)], u: f64) -> TokenId {
    let total: f64 = d.iter().map(|(_, p)| f64::from(*p)).sum();
    let target = u * total;
    let mut acc = 0.0;
    for &(t, p) in d {
        acc += f64::from(p);
        if target < acc {
            return t;
        }
    }
    // Rounding: the last token with weight takes the rest.
    d.iter()
        .rev()
        .find(|(_, p)| *p > 0.0)
        .map_or(TokenId(0), |(t, _)| *t)
}

/// Rejection-sampling verification (speculative sampling). `q[i]` is the
/// draft distribution `draft[i]` was drawn from; `p[i]` is the target's
/// distribution after the context plus `draft[..i]` (so `p` has one entry more
/// than the draft: the last is for the bonus token). `uniform` yields draws in
/// [0, 1) — the request's own random stream, so a seed reproduces the output.
///
/// # Panics
/// When the lengths do not fit (`q.len() == draft.len()`, `p.len() == draft.len() + 1`).
pub fn verify_sampled(
    draft: &[TokenId],
    q: &[&Distribution],
    p: &[&Distribution],
    uniform: &mut impl FnMut() -> f64,
) -> Verdict {
    assert_eq!(
        q.len(),
        draft.len(),
        "one draft distribution per drafted token"
    );
    assert_eq!(
        p.len(),
        draft.len() + 1,
        "one target distribution per drafted token, plus one"
    );
    for (i, &x) in draft.iter().enumerate() {
        let (px, qx) = (prob(p[i], x), prob(q[i], x));
        // Keep x with probability min(1, p(x)/q(x)).
        let keep = qx > 0.0 && (px >= qx || uniform() < f64::from(px / qx));
        if keep {
            continue;
        }
        // Rejected: draw from the residual max(0, p - q), normalised.
        let residual: Vec<(TokenId, f32)> = p[i]
            .iter()
            .map(|&(t, pt)| (t, (pt - prob(q[i], t)).max(0.0)))
            .filter(|(_, w)| *w > 0.0)
            .collect();
        let next = if residual.is_empty() {
            // p ≤ q everywhere means p == q: rejection had probability 0.
            draw(p[i], uniform())
        } else {
            draw(&residual, uniform())
        };
        return Verdict { accepted: i, next };
    }
    Verdict {
        accepted: draft.len(),
        next: draw(p[draft.len()], uniform()),
    }
}
