//! Choosing a token from a row of logits.
//!
//! The sampler lives here rather than in the engine because speculative
//! decoding's rejection sampling needs the very same processed distribution
//! ([`Sampler::distribution`]) and sits below the engine in the layering.
//!
//! Order of operations: penalties over the last `penalty_last_n` tokens and
//! the logit bias, then
//! temperature, top-k, softmax, top-p, min-p, and a draw from what remains.
//! Temperature is applied before the filters (as vLLM and HF do; llama.cpp's
//! default chain applies it after), so `top_p` is a share of the distribution
//! the token is actually drawn from.

use std::collections::{HashMap, VecDeque};

use crate::{SamplingParams, TokenId};

/// How many top candidates are sorted before falling back to sorting the whole
/// vocabulary for top-p.
const PARTIAL_SORT: usize = 512;

/// A small, fast, seedable generator (xoshiro256++ seeded through SplitMix64):
/// the same seed gives the same stream on every platform.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator whose whole stream is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    /// A generator seeded from the clock and a process-wide counter.
    pub fn from_entropy() -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        Rng::new(nanos ^ COUNTER.fetch_add(1, Ordering::Relaxed).rotate_left(32))
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)`, 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Turns logits into tokens under one request's [`SamplingParams`].
///
/// Feed every token the sequence holds (prompt and generated) through
/// [`Sampler::accept`] so the penalties see them.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    recent: VecDeque<TokenId>,
    counts: HashMap<TokenId, u32>,
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler for `params`; its random stream is fixed by `params.seed`
    /// when one is given.
    pub fn new(params: &SamplingParams) -> Self {
        let rng = params.seed.map_or_else(Rng::from_entropy, Rng::new);
        Sampler {
            params: params.clone(),
            rng,
            recent: VecDeque::new(),
            counts: HashMap::new(),
            candidates: Vec::new(),
        }
    }

    /// The parameters this sampler follows.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a token of the sequence (prompt or generated) for the penalties.
    pub fn accept(&mut self, token: TokenId) {
        let window = self.params.penalty_last_n as usize;
        if window == 0 || !self.params.has_penalties() {
            return;
        }
        self.recent.push_back(token);
        *self.counts.entry(token).or_insert(0) += 1;
        if self.recent.len() > window
            && let Some(old) = self.recent.pop_front()
            && let Some(c) = self.counts.get_mut(&old)
        {
            *c -= 1;
            if *c == 0 {
                self.counts.remove(&old);
            }
        }
    }

    /// Picks the next token from `logits` (one row, one entry per vocabulary token).
    pub fn sample(&mut self, logits: &[f32]) -> TokenId {
        if self.params.is_greedy() {
            return if self.params.is_plain() {
                argmax(logits)
            } else {
                let mut row = logits.to_vec();
                self.apply_penalties(&mut row);
                argmax(&row)
            };
        }
        self.fill_distribution(logits);
        let u = self.rng.next_f64() as f32;
        let mut acc = 0.0f32;
        for &(id, p) in &self.candidates {
            acc += p;
            if u < acc {
                return TokenId(id);
            }
        }
        // Rounding left `acc` a hair under 1: the last candidate takes the rest.
        TokenId(self.candidates.last().map_or(0, |c| c.0))
    }

    /// The distribution [`Sampler::sample`] draws from: `(token, probability)`
    /// pairs summing to 1, the likeliest first: the first 512 in order of
    /// probability (all of them under top-p), the rest in no particular
    /// order. Greedy parameters give the argmax with probability 1.
    pub fn distribution(&mut self, logits: &[f32]) -> Vec<(TokenId, f32)> {
        if self.params.is_greedy() {
            let mut row = logits.to_vec();
            self.apply_penalties(&mut row);
            return vec![(argmax(&row), 1.0)];
        }
        self.fill_distribution(logits);
        self.candidates
            .iter()
            .map(|&(id, p)| (TokenId(id), p))
            .collect()
    }

    /// A uniform draw from this sampler's random stream (for acceptance tests
    /// that must stay on the request's seed).
    pub fn uniform(&mut self) -> f64 {
        self.rng.next_f64()
    }

    /// Penalties, then the logit bias.
    fn apply_penalties(&self, row: &mut [f32]) {
        let p = &self.params;
        if p.has_penalties() {
            for (&tok, &n) in &self.counts {
                if let Some(l) = row.get_mut(tok.0 as usize) {
                    *l = penalise(p, *l, n);
                }
            }
        }
        for &(tok, b) in &p.logit_bias {
            if let Some(l) = row.get_mut(tok.0 as usize) {
                *l += b;
            }
        }
    }

    /// Leaves the surviving candidates in `self.candidates`, with normalised
    /// probabilities, ordered as [`Sampler::distribution`] says.
    fn fill_distribution(&mut self, logits: &[f32]) {
        let p = self.params.clone();
        let inv_t = 1.0 / p.temperature;
        let mut cands = std::mem::take(&mut self.candidates);
        cands.clear();
        cands.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        if p.has_penalties() {
            for (&tok, &n) in &self.counts {
                if let Some(c) = cands.get_mut(tok.0 as usize) {
                    c.1 = penalise(&p, c.1, n);
                }
            }
        }
        for &(tok, b) in &p.logit_bias {
            if let Some(c) = cands.get_mut(tok.0 as usize) {
                c.1 += b;
            }
        }
        for c in cands.iter_mut() {
            c.1 *= inv_t;
        }
        let by_logit_desc =
            |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && (p.top_k as usize) < cands.len() {
            let k = p.top_k as usize;
            cands.select_nth_unstable_by(k - 1, by_logit_desc);
            cands.truncate(k);
        }
        // Softmax over what is left; the maximum keeps exp() in range.
        let max = cands.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f64;
        for c in cands.iter_mut() {
            c.1 = (c.1 - max).exp();
            sum += f64::from(c.1);
        }
        let inv_sum = (1.0 / sum) as f32;
        for c in cands.iter_mut() {
            c.1 *= inv_sum;
        }
        // Most likely first, as far as anything reads the order: the
        // PARTIAL_SORT likeliest candidates are sorted, and the rest are left
        // in selection order (a deterministic order: same logits, same seed,
        // same token) unless top_p reaches past the head. Sorting the whole
        // vocabulary (49k–152k tokens) for every sampled token cost more
        // than the step's output head on the test models.
        let head = PARTIAL_SORT.min(cands.len());
        if head < cands.len() {
            cands.select_nth_unstable_by(head - 1, by_prob_desc);
        }
        cands[..head].sort_unstable_by(by_prob_desc);
        if p.top_p < 1.0
            && head < cands.len()
            && cands[..head].iter().map(|c| c.1).sum::<f32>() < p.top_p
        {
            cands.sort_unstable_by(by_prob_desc);
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0f32;
            let mut keep = cands.len();
            for (i, c) in cands.iter().enumerate() {
                acc += c.1;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cands.truncate(keep.max(1));
        }
        if p.min_p > 0.0 && !cands.is_empty() {
            // cands[0] is the likeliest; the unsorted rest is filtered in place.
            let first = cands[0];
            let floor = first.1 * p.min_p;
            cands.retain(|c| c.1 >= floor);
            if cands.is_empty() {
                cands.push(first);
            }
        }
        let total: f32 = cands.iter().map(|c| c.1).sum();
        for c in cands.iter_mut() {
            c.1 /= total;
        }
        self.candidates = cands;
    }
}

/// One token's logit after repetition (llama.cpp / CTRL style), presence and
/// frequency penalties for `n` recent occurrences.
fn penalise(p: &SamplingParams, logit: f32, n: u32) -> f32 {
    let l = if logit > 0.0 {
        logit / p.repetition_penalty
    } else {
        logit * p.repetition_penalty
    };
    l - p.presence_penalty - p.frequency_penalty * n as f32
}

fn by_prob_desc(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Index of the largest logit; the lowest index wins a tie.
pub fn argmax(logits: &[f32]) -> TokenId {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    TokenId(best as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SamplingParams {
        SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..SamplingParams::greedy()
        }
    }

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(&SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 3.0]), TokenId(1));
    }

    #[test]
    fn logit_bias_bans_and_forces_tokens() {
        let logits = [0.1, 3.0, -1.0, 2.9];
        let biased = |bias: Vec<(TokenId, f32)>, temperature: f32| SamplingParams {
            temperature,
            seed: Some(1),
            logit_bias: bias,
            ..SamplingParams::greedy()
        };
        // −100 on the argmax: the runner-up wins.
        let mut s = Sampler::new(&biased(vec![(TokenId(1), -100.0)], 0.0));
        assert_eq!(s.sample(&logits), TokenId(3));
        assert_eq!(s.distribution(&logits), vec![(TokenId(3), 1.0)]);
        // +100 on a poor token: sampled every time.
        let mut s = Sampler::new(&biased(vec![(TokenId(2), 100.0)], 1.0));
        assert!((0..50).all(|_| s.sample(&logits) == TokenId(2)));
        // A banned token is never drawn.
        let mut s = Sampler::new(&biased(
            vec![(TokenId(1), -100.0), (TokenId(3), -100.0)],
            1.0,
        ));
        assert!((0..200).all(|_| ![TokenId(1), TokenId(3)].contains(&s.sample(&logits))));
        assert!(biased(vec![(TokenId(0), 101.0)], 1.0).validate().is_err());
    }

    #[test]
    fn same_seed_same_stream() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 / 20.0).collect();
        let draw = |seed| {
            let mut s = Sampler::new(&SamplingParams {
                seed: Some(seed),
                ..params()
            });
            (0..50).map(|_| s.sample(&logits).0).collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1));
        assert_ne!(draw(1), draw(2));
    }

    #[test]
    fn top_k_and_top_p_and_min_p_cut() {
        let logits = [4.0f32, 3.0, 2.0, 1.0, 0.0];
        let dist = |p: SamplingParams| Sampler::new(&p).distribution(&logits);
        assert_eq!(
            dist(SamplingParams {
                top_k: 2,
                ..params()
            })
            .len(),
            2
        );
        // p ≈ [0.636, 0.234, 0.086, 0.032, 0.012]
        assert_eq!(
            dist(SamplingParams {
                top_p: 0.8,
                ..params()
            })
            .len(),
            2
        );
        assert_eq!(
            dist(SamplingParams {
                top_p: 0.5,
                ..params()
            })
            .len(),
            1
        );
        assert_eq!(
            dist(SamplingParams {
                min_p: 0.1,
                ..params()
            })
            .len(),
            3
        );
        let full = dist(params());
        assert_eq!(full.len(), 5);
        let sum: f32 = full.iter().map(|c| c.1).sum();
        assert!((sum - 1.0).abs() < 1e-5);
        assert!((full[0].1 - 0.636).abs() < 1e-3);
    }

    /// Every token's probability at temperature `t`, in f64, most likely
    /// first (ties by token id, as the sampler orders them).
    fn exact_distribution(logits: &[f32], t: f32) -> Vec<(u32, f64)> {
        let x: Vec<f64> = logits.iter().map(|&l| f64::from(l / t)).collect();
        let max = x.iter().copied().fold(f64::MIN, f64::max);
        let sum: f64 = x.iter().map(|x| (x - max).exp()).sum();
        let mut probs: Vec<(u32, f64)> = x
            .iter()
            .enumerate()
            .map(|(i, x)| (i as u32, (x - max).exp() / sum))
            .collect();
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        probs
    }

    /// 5,000 distinct logits in scrambled token order, 0 to about 16.7: a
    /// distribution with a long tail past the sorted head.
    fn spread_logits() -> Vec<f32> {
        (0..5000)
            .map(|i| ((i * 7919) % 5003) as f32 / 300.0)
            .collect()
    }

    #[test]
    fn partial_sort_matches_full_sort_for_top_p() {
        let logits = spread_logits();
        let p = SamplingParams {
            top_p: 0.9,
            temperature: 0.7,
            ..params()
        };
        let got = Sampler::new(&p).distribution(&logits);
        // Reference: everything sorted, cut at 0.9.
        let probs = exact_distribution(&logits, 0.7);
        let mut acc = 0.0;
        let keep = probs
            .iter()
            .take_while(|c| {
                let before = acc;
                acc += c.1;
                before < 0.9
            })
            .count();
        assert_eq!(got.len(), keep);
        assert_eq!(got[0].0, TokenId(probs[0].0));
    }

    #[test]
    fn without_top_p_the_head_is_sorted_and_the_tail_complete() {
        let logits = spread_logits();
        let p = SamplingParams {
            temperature: 0.7,
            min_p: 0.01,
            ..params()
        };
        let got = Sampler::new(&p).distribution(&logits);
        // Reference: every token's probability, sorted, min-p applied.
        let mut want = exact_distribution(&logits, 0.7);
        let floor = 0.01 * want[0].1;
        want.retain(|c| c.1 >= floor);
        assert!(
            want.len() > PARTIAL_SORT,
            "the case must reach past the head"
        );
        assert_eq!(got.len(), want.len());
        // The head in order, token for token.
        let head: Vec<u32> = got[..PARTIAL_SORT].iter().map(|c| c.0.0).collect();
        let want_head: Vec<u32> = want[..PARTIAL_SORT].iter().map(|c| c.0).collect();
        assert_eq!(head, want_head);
        // The tail: the same tokens, each with its probability (renormalised
        // over what min-p kept).
        let kept: f64 = want.iter().map(|c| c.1).sum();
        let mut tail: Vec<(u32, f32)> = got[PARTIAL_SORT..].iter().map(|c| (c.0.0, c.1)).collect();
        tail.sort_by_key(|c| c.0);
        let mut want_tail: Vec<(u32, f64)> = want[PARTIAL_SORT..].to_vec();
        want_tail.sort_by_key(|c| c.0);
        for (g, w) in tail.iter().zip(&want_tail) {
            assert_eq!(g.0, w.0);
            // f32 logits near 24 carry ~1e-6 of rounding into exp().
            assert!(
                (f64::from(g.1) / (w.1 / kept) - 1.0).abs() < 1e-5,
                "{g:?} {w:?}"
            );
        }
        let total: f32 = got.iter().map(|c| c.1).sum();
        assert!((total - 1.0).abs() < 1e-4, "{total}");
    }

    #[test]
    fn penalties_push_seen_tokens_down() {
        let logits = [2.0f32, 1.9, -1.0];
        let mut s = Sampler::new(&SamplingParams {
            repetition_penalty: 1.5,
            ..SamplingParams::greedy()
        });
        assert_eq!(s.sample(&logits), TokenId(0));
        s.accept(TokenId(0));
        assert_eq!(s.sample(&logits), TokenId(1), "2.0/1.5 < 1.9");
        let mut s = Sampler::new(&SamplingParams {
            frequency_penalty: 0.06,
            ..SamplingParams::greedy()
        });
        s.accept(TokenId(0));
        assert_eq!(s.sample(&logits), TokenId(0), "one occurrence: 1.94 > 1.9");
        s.accept(TokenId(0));
        assert_eq!(s.sample(&logits), TokenId(1), "two occurrences: 1.88 < 1.9");
    }

    #[test]
    fn penalty_window_forgets() {
        let logits = [2.0f32, 1.9];
        let mut s = Sampler::new(&SamplingParams {
            presence_penalty: 0.5,
            penalty_last_n: 2,
            ..SamplingParams::greedy()
        });
        s.accept(TokenId(0));
        assert_eq!(s.sample(&logits), TokenId(1));
        s.accept(TokenId(1));
        s.accept(TokenId(1));
        // Token 0 fell out of the 2-token window; token 1 is penalised.
        assert_eq!(s.sample(&logits), TokenId(0));
    }

    #[test]
    fn sampling_frequencies_follow_the_distribution() {
        let logits = [1.0f32, 0.0, -1.0];
        let mut s = Sampler::new(&params());
        let mut hist = [0u32; 3];
        let n = 20_000;
        for _ in 0..n {
            hist[s.sample(&logits).0 as usize] += 1;
        }
        let expected = [0.665, 0.245, 0.090];
        for (h, e) in hist.iter().zip(expected) {
            let f = f64::from(*h) / f64::from(n);
            assert!((f - e).abs() < 0.015, "{hist:?}");
        }
    }
}
