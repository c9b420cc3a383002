//! Constrained requests: the token mask applied before sampling, and the
//! masks of a step computed beside llama.cpp's decode rather than after it.
//!
//! A request's next mask depends only on the tokens it has accepted, which
//! are known before its step's decode starts. So the engine takes the
//! matchers of the step's constrained requests out, computes their masks
//! on a helper thread while `decode` runs on this one, and puts them back
//! (`overlap`). Without overlap the masks are computed after decode,
//! spread over scoped threads (`parallel`). Masks for drafted positions
//! depend on the verification's outcome and are computed inline.

use std::time::Instant;

use siliceo_constrain::{ConstraintError, Mask, Matcher};
use siliceo_core::{RequestId, TokenId};

use super::{Engine, Want};

/// A request's matcher and the mask computed ahead for its next position.
pub(super) struct Constrained {
    pub(super) matcher: Matcher,
    ahead: Option<Result<Mask, ConstraintError>>,
    scratch: Vec<f32>,
}

/// Counters the engine reports in its statistics.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct MaskStats {
    pub(super) masks: u64,
    pub(super) us: u64,
    pub(super) overlapped: u64,
}

impl Constrained {
    pub(super) fn new(matcher: Matcher) -> Self {
        Constrained {
            matcher,
            ahead: None,
            scratch: Vec::new(),
        }
    }

    /// Computes the next position's mask now (on whatever thread holds it).
    fn compute_ahead(&mut self) -> u64 {
        let t = Instant::now();
        self.ahead = Some(self.matcher.mask());
        t.elapsed().as_micros() as u64
    }

    /// The mask for the next position: the one computed ahead, or a new one.
    pub(super) fn next_mask(&mut self, stats: &mut MaskStats) -> Result<Mask, ConstraintError> {
        if let Some(m) = self.ahead.take() {
            return m;
        }
        let t = Instant::now();
        let m = self.matcher.mask();
        stats.masks += 1;
        stats.us += t.elapsed().as_micros() as u64;
        m
    }

    /// `logits` with every token `mask` does not allow at −∞.
    pub(super) fn masked(&mut self, logits: &[f32], mask: &Mask) -> &[f32] {
        self.scratch.clear();
        self.scratch.extend_from_slice(logits);
        mask.apply(&mut self.scratch);
        &self.scratch
    }

    /// Advances the matcher past a token sampled under its mask.
    pub(super) fn accept(&mut self, token: TokenId) -> Result<(), ConstraintError> {
        self.ahead = None;
        self.matcher.accept(token)
    }
}

/// Computes the masks of `pending` (each one's next position) over up to
/// `threads` scoped threads; returns the µs spent, summed over threads.
fn compute_all(pending: &mut [(RequestId, Constrained)], threads: usize) -> u64 {
    if threads <= 1 || pending.len() <= 1 {
        return pending.iter_mut().map(|(_, c)| c.compute_ahead()).sum();
    }
    let per = pending.len().div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = pending
            .chunks_mut(per)
            .map(|chunk| s.spawn(move || chunk.iter_mut().map(|(_, c)| c.compute_ahead()).sum()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0u64)).sum()
    })
}

impl Engine<'_> {
    /// Takes out the matchers of the step's constrained requests (their
    /// masks computed ahead are consumed by the last step's sampling).
    pub(super) fn take_matchers(&mut self, want: &[Want]) -> Vec<(RequestId, Constrained)> {
        want.iter()
            .filter_map(|w| Some((w.id.clone(), self.live.get_mut(&w.id)?.constraint.take()?)))
            .collect()
    }

    /// Runs `decode` with the masks of `pending` computed beside it (or,
    /// without overlap, after it over several threads), then puts the
    /// matchers back.
    pub(super) fn decode_with_masks<T>(
        &mut self,
        mut pending: Vec<(RequestId, Constrained)>,
        decode: impl FnOnce(&mut Self) -> T,
    ) -> T {
        if pending.is_empty() {
            return decode(self);
        }
        let (out, us, overlapped) = if self.constraint_overlap {
            std::thread::scope(|s| {
                let helper = s.spawn(|| compute_all(&mut pending, 1));
                let out = decode(self);
                // A panic in llguidance fails those masks only: they are
                // computed again on the engine thread and fail there.
                let us = helper.join().unwrap_or(0);
                (out, us, true)
            })
        } else {
            let out = decode(self);
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            (out, compute_all(&mut pending, threads), false)
        };
        let n = pending.len() as u64;
        self.mask_stats.masks += n;
        self.mask_stats.us += us;
        if overlapped {
            self.mask_stats.overlapped += n;
        }
        for (id, c) in pending {
            if let Some(live) = self.live.get_mut(&id) {
                live.constraint = Some(c);
            }
        }
        out
    }
}
