//! Draft length from the running acceptance rate.

/// Chooses how many tokens to draft. Keeps an exponentially weighted rate of
/// drafted tokens accepted; drafts more when most are kept and fewer when most
/// are thrown away, within `[k_min, k_max]`. Drafting is switched off when the
/// batch is large: with many sequences per step the target's decode is already
/// compute-bound and verifying drafts costs more than it saves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveDraftLength {
    k_min: usize,
    k_max: usize,
    k: usize,
    rate: f64,
    /// Running sequences at or above which no drafts are made.
    pub max_batch: usize,
}

impl AdaptiveDraftLength {
    /// Starts at `k_start` (clamped), with an optimistic rate of 0.7.
    pub fn new(k_min: usize, k_max: usize, k_start: usize, max_batch: usize) -> Self {
        let k_min = k_min.max(1);
        let k_max = k_max.max(k_min);
        AdaptiveDraftLength {
            k_min,
            k_max,
            k: k_start.clamp(k_min, k_max),
            rate: 0.7,
            max_batch,
        }
    }

    /// Tokens to draft now with `running` sequences in the batch (0: don't).
    pub fn k(&self, running: usize) -> usize {
        if running >= self.max_batch { 0 } else { self.k }
    }

    /// The running acceptance rate.
    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// Records that `accepted` of `proposed` drafted tokens were kept.
    pub fn update(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        let r = accepted.min(proposed) as f64 / proposed as f64;
        self.rate = 0.8 * self.rate + 0.2 * r;
        if self.rate > 0.75 && self.k < self.k_max {
            self.k += 1;
        } else if self.rate < 0.4 && self.k > self.k_min {
            self.k -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_on_acceptance_shrinks_on_rejection_and_stops_for_big_batches() {
        let mut a = AdaptiveDraftLength::new(1, 8, 4, 8);
        for _ in 0..20 {
            a.update(a.k(1), a.k(1));
        }
        assert_eq!(a.k(1), 8, "all accepted: up to k_max");
        for _ in 0..30 {
            a.update(a.k(1), 0);
        }
        assert_eq!(a.k(1), 1, "nothing accepted: down to k_min");
        assert!(a.rate() < 0.1);
        assert_eq!(a.k(8), 0, "batch of 8: off");
        a.update(0, 0);
        assert_eq!(a.k(1), 1);
    }
}
