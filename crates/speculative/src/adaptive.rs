//! Draft length from the running acceptance rate.

/// Chooses how many tokens to draft. Keeps an exponentially weighted rate of
/// drafted tokens accepted; drafts more when most are kept and fewer when most
/// are thrown away, within `[k_min, k_max]`. When the rate falls below
/// [`AdaptiveDraftLength::PAUSE_BELOW`], drafting pauses for
/// [`AdaptiveDraftLength::PAUSE_STEPS`] steps, then probes again at `k_min`:
/// a rejected draft costs target compute, so a drafter that keeps missing
/// would make generation slower than none (measured: 0.74–0.80× with ~30 %
/// acceptance on a 2-core CPU). Drafting is also off when the batch is large:
/// with many sequences per step verifying drafts costs more than it saves.
///
/// **Cost switch-off**: a high acceptance rate is not enough where a drafted
/// token costs nearly as much as a target token (a CPU, a draft model not
/// much smaller than the target: measured 0.4–0.65× with 80–90 % acceptance).
/// The caller reports each decode step's wall time and the tokens it produced
/// ([`AdaptiveDraftLength::record_step`]); once a few drafting steps cost more
/// per produced token than plain steps do, drafting pauses for
/// [`AdaptiveDraftLength::COST_PAUSE_STEPS`] steps (plain steps keep their
/// estimate fresh), then probes again from a fresh estimate. A single drafting
/// step that costs more than [`AdaptiveDraftLength::CLEAR_LOSS`] times a plain
/// step per produced token pauses at once: a probe of a pair that clearly
/// loses costs one step, not four.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveDraftLength {
    k_min: usize,
    k_max: usize,
    k: usize,
    rate: f64,
    pause: usize,
    fixed: bool,
    /// Running sequences at or above which no drafts are made.
    pub max_batch: usize,
    /// Wall time per produced token, µs (moving averages): plain steps, and
    /// drafting steps since the last probe began.
    cost_plain: Option<f64>,
    cost_spec: Option<f64>,
    plain_samples: usize,
    spec_samples: usize,
    /// Pauses started by cost.
    cost_pauses: usize,
    /// Whether cost may switch drafting off (and plain steps come first).
    cost_aware: bool,
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
            pause: 0,
            fixed: false,
            max_batch,
            cost_plain: None,
            cost_spec: None,
            plain_samples: 0,
            spec_samples: 0,
            cost_pauses: 0,
            cost_aware: true,
        }
    }

    /// Never switched off by cost (the acceptance rate alone decides): for
    /// tests that must exercise drafting throughout.
    pub fn without_cost(self) -> Self {
        AdaptiveDraftLength {
            cost_aware: false,
            ..self
        }
    }

    /// Starts in a cost pause ([`Self::COST_PAUSE_STEPS`] plain steps, which
    /// still measure the baseline), then probes as usual: for a request that
    /// begins after earlier ones found drafting losing (see [`DraftCostMemory`]).
    /// A fixed or cost-blind length is returned unchanged.
    pub fn paused_for_cost(self) -> Self {
        if self.fixed || !self.cost_aware {
            return self;
        }
        AdaptiveDraftLength {
            pause: Self::COST_PAUSE_STEPS,
            ..self
        }
    }

    /// Always `k` drafted tokens (below `max_batch` running), whatever the
    /// acceptance rate: for measuring a fixed draft length.
    pub fn fixed(k: usize, max_batch: usize) -> Self {
        AdaptiveDraftLength {
            fixed: true,
            ..AdaptiveDraftLength::new(k, k, k, max_batch)
        }
    }

    /// Acceptance rate under which drafting pauses.
    pub const PAUSE_BELOW: f64 = 0.35;
    /// Steps a pause lasts.
    pub const PAUSE_STEPS: usize = 16;

    /// Steps a pause started by cost lasts.
    pub const COST_PAUSE_STEPS: usize = 64;
    /// Plain steps measured before the first draft (the cost baseline).
    pub const PLAIN_PROBE_STEPS: usize = 2;
    /// Drafting steps measured before their cost is judged.
    pub const SPEC_PROBE_STEPS: usize = 4;
    /// A drafting step whose cost per produced token is this many times the
    /// plain steps' pauses drafting without waiting for the other probe steps
    /// (on 2 cores the 0.5B draft with the 1.5B target costs about 1.8× per
    /// produced token at k = 4, the length a request starts with; at k = 1
    /// about 1.2×, which the 4-step average judges).
    pub const CLEAR_LOSS: f64 = 1.5;

    /// Tokens to draft with `running` sequences in the batch (0: don't),
    /// without advancing a pause.
    pub fn k(&self, running: usize) -> usize {
        if running >= self.max_batch
            || self.pause > 0
            || (self.cost_aware && !self.fixed && self.plain_samples < Self::PLAIN_PROBE_STEPS)
        {
            0
        } else {
            self.k
        }
    }

    /// Records one decode step: its wall time (drafting, the batch, sampling)
    /// and the tokens it produced for this request (accepted drafts + 1).
    pub fn record_step(&mut self, drafted: bool, micros: f64, tokens: usize) {
        if tokens == 0 || !micros.is_finite() || micros < 0.0 {
            return;
        }
        let per = micros / tokens as f64;
        let ewma = |old: Option<f64>| Some(old.map_or(per, |o| 0.7 * o + 0.3 * per));
        if !drafted {
            self.cost_plain = ewma(self.cost_plain);
            self.plain_samples += 1;
            return;
        }
        self.cost_spec = ewma(self.cost_spec);
        self.spec_samples += 1;
        if self.fixed || !self.cost_aware {
            return;
        }
        let Some(plain) = self.cost_plain else {
            return;
        };
        let clear_loss = per > Self::CLEAR_LOSS * plain;
        if clear_loss
            || (self.spec_samples >= Self::SPEC_PROBE_STEPS
                && self.cost_spec.is_some_and(|spec| spec > plain))
        {
            self.pause = Self::COST_PAUSE_STEPS;
            self.k = self.k_min;
            self.cost_spec = None;
            self.spec_samples = 0;
            self.cost_pauses += 1;
        }
    }

    /// Measured µs per produced token: (plain, drafting) where known.
    pub fn costs(&self) -> (Option<f64>, Option<f64>) {
        (self.cost_plain, self.cost_spec)
    }

    /// Pauses started because drafting cost more than it saved.
    pub fn cost_pauses(&self) -> usize {
        self.cost_pauses
    }

    /// Tokens to draft for the next step; counts down a pause.
    pub fn next_k(&mut self, running: usize) -> usize {
        if self.pause > 0 {
            self.pause -= 1;
            return 0;
        }
        self.k(running)
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
        if self.fixed {
            return;
        }
        if self.rate > 0.75 && self.k < self.k_max {
            self.k += 1;
        } else if self.rate < Self::PAUSE_BELOW {
            // Pause, then probe at k_min from a neutral rate.
            self.pause = Self::PAUSE_STEPS;
            self.k = self.k_min;
            self.rate = 0.5;
        } else if self.rate < 0.5 && self.k > self.k_min {
            self.k -= 1;
        }
    }
}

/// What finished requests learned about a draft model's cost, for the next
/// ones. A draft model's cost per produced token against the target's is a
/// property of the pair and the machine more than of the prompt (on 2 cores
/// the 0.5B draft for the 1.5B target costs ~1.8× per produced token whatever
/// it drafts), so once a request's drafting paused for cost, the next
/// [`DraftCostMemory::SKIP_AFTER_LOSS`] requests start paused (they skip the
/// probe and the draft model's prefill of their prompt) and the one after
/// probes again; a request whose drafting paid clears the memory. Not for the
/// n-gram drafter, whose worth depends on the prompt.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DraftCostMemory {
    skip: u32,
}

impl DraftCostMemory {
    /// Requests that start paused after one found drafting losing.
    pub const SKIP_AFTER_LOSS: u32 = 7;

    /// The draft length a new request starts with: `len`, paused for cost
    /// while the memory says drafting loses (counting the request).
    pub fn start(&mut self, len: AdaptiveDraftLength) -> AdaptiveDraftLength {
        if self.skip > 0 {
            self.skip -= 1;
            len.paused_for_cost()
        } else {
            len
        }
    }

    /// Records how a finished request's drafting went.
    pub fn finish(&mut self, len: &AdaptiveDraftLength) {
        if len.cost_pauses() > 0 {
            self.skip = Self::SKIP_AFTER_LOSS;
        } else if let (Some(plain), Some(spec)) = len.costs()
            && spec <= plain
        {
            self.skip = 0;
        }
    }

    /// Requests still to start paused.
    pub fn skipping(&self) -> u32 {
        self.skip
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs one request of `steps` decode steps at batch size 1 with plain
    /// steps of 100 µs and drafting steps of `spec_us` producing 2 tokens;
    /// returns how many steps drafted.
    fn run(len: &mut AdaptiveDraftLength, steps: usize, spec_us: f64) -> usize {
        let mut drafted = 0;
        for _ in 0..steps {
            let k = len.next_k(1);
            if k > 0 {
                drafted += 1;
                len.record_step(true, spec_us, 2);
            } else {
                len.record_step(false, 100.0, 1);
            }
        }
        drafted
    }

    #[test]
    fn a_losing_draft_model_is_remembered_for_the_next_requests() {
        let fresh = || AdaptiveDraftLength::new(1, 8, 4, 4);
        let mut memory = DraftCostMemory::default();
        // Drafting steps of 400 µs for 2 tokens: 2× a plain token, a clear loss.
        let mut first = memory.start(fresh());
        assert_eq!(run(&mut first, 40, 400.0), 1, "one probe step, then paused");
        memory.finish(&first);
        assert_eq!(memory.skipping(), DraftCostMemory::SKIP_AFTER_LOSS);
        for _ in 0..DraftCostMemory::SKIP_AFTER_LOSS {
            let mut len = memory.start(fresh());
            assert_eq!(run(&mut len, 40, 400.0), 0, "starts paused: no probe");
            memory.finish(&len);
        }
        // The next request probes again; a long one probes after the pause too.
        let mut probe = memory.start(fresh());
        assert_eq!(run(&mut probe, 40, 400.0), 1);
        let mut long = fresh().paused_for_cost();
        assert_eq!(
            run(&mut long, AdaptiveDraftLength::COST_PAUSE_STEPS, 400.0),
            0
        );
        assert_eq!(
            run(&mut long, 10, 400.0),
            1,
            "probes once the pause is over"
        );
    }

    #[test]
    fn a_paying_draft_model_clears_the_memory() {
        let mut memory = DraftCostMemory::default();
        let mut lost = memory.start(AdaptiveDraftLength::new(1, 8, 4, 4));
        run(&mut lost, 20, 400.0);
        memory.finish(&lost);
        assert!(memory.skipping() > 0);
        // 120 µs for 2 tokens: 0.6× a plain token, drafting pays.
        let mut won = AdaptiveDraftLength::new(1, 8, 4, 4);
        assert!(run(&mut won, 20, 120.0) > 10);
        memory.finish(&won);
        assert_eq!(memory.skipping(), 0);
        // Fixed and cost-blind lengths never start paused.
        let mut memory = DraftCostMemory { skip: 3 };
        let mut fixed = memory.start(AdaptiveDraftLength::fixed(4, 4));
        assert_eq!(run(&mut fixed, 5, 400.0), 5);
        let mut blind = memory.start(AdaptiveDraftLength::new(1, 8, 4, 4).without_cost());
        assert_eq!(run(&mut blind, 5, 400.0), 5);
    }

    #[test]
    fn grows_on_acceptance_shrinks_on_rejection_and_stops_for_big_batches() {
        let mut a = AdaptiveDraftLength::new(1, 8, 4, 8);
        assert_eq!(a.next_k(1), 0, "plain steps first: the cost baseline");
        for _ in 0..AdaptiveDraftLength::PLAIN_PROBE_STEPS {
            a.record_step(false, 1000.0, 1);
        }
        for _ in 0..20 {
            a.update(a.k(1), a.k(1));
        }
        assert_eq!(a.k(1), 8, "all accepted: up to k_max");
        // Nothing accepted: the rate falls, drafting pauses, then probes at k_min.
        let mut paused_at = None;
        for step in 0..10 {
            let k = a.next_k(1);
            if k == 0 {
                paused_at = Some(step);
                break;
            }
            a.update(k, 0);
        }
        assert!(
            paused_at.is_some(),
            "drafting must pause when nothing is accepted"
        );
        let zeros = (0..AdaptiveDraftLength::PAUSE_STEPS - 1)
            .map(|_| a.next_k(1))
            .filter(|k| *k == 0)
            .count();
        assert_eq!(zeros, AdaptiveDraftLength::PAUSE_STEPS - 1);
        assert_eq!(a.next_k(1), 1, "after the pause: a probe at k_min");
        assert_eq!(a.k(8), 0, "batch of 8: off");
        a.update(0, 0);
        assert_eq!(a.k(1), 1);
        // A fixed length ignores the rate.
        let mut f = AdaptiveDraftLength::fixed(4, 8);
        for _ in 0..30 {
            let k = f.next_k(1);
            f.update(k, 0);
        }
        assert_eq!(f.next_k(1), 4);
    }

    /// Drives `a` for `steps` decode steps where a plain step costs `plain` µs
    /// and a drafting step `base + per_draft·k` µs with every draft accepted;
    /// returns the steps that drafted.
    fn drive(
        a: &mut AdaptiveDraftLength,
        steps: usize,
        plain: f64,
        base: f64,
        per_draft: f64,
    ) -> usize {
        let mut drafted = 0;
        for _ in 0..steps {
            let k = a.next_k(1);
            if k == 0 {
                a.record_step(false, plain, 1);
            } else {
                drafted += 1;
                a.update(k, k);
                a.record_step(true, base + per_draft * k as f64, k + 1);
            }
        }
        drafted
    }

    #[test]
    fn drafting_that_costs_more_than_it_saves_pauses_and_probes_again() {
        // A CPU-like pair: every draft accepted, but a step of k drafts costs
        // (k + 1) target steps plus the drafting: always a loss.
        let mut a = AdaptiveDraftLength::new(1, 8, 4, 8);
        let drafted = drive(&mut a, 400, 30_000.0, 30_000.0, 50_000.0);
        assert!(a.cost_pauses() >= 2, "{} pauses", a.cost_pauses());
        // Each probe is SPEC_PROBE_STEPS drafting steps per COST_PAUSE_STEPS plain ones.
        assert!(
            drafted
                <= 400 * 2 * AdaptiveDraftLength::SPEC_PROBE_STEPS
                    / AdaptiveDraftLength::COST_PAUSE_STEPS
                    + 4,
            "{drafted}"
        );
        assert!(drafted > 0, "it must probe again after a pause");
        // A pair that loses clearly (a drafting step costs ≥ 1.8× plain per
        // token at any k): every probe is a single step.
        let mut c = AdaptiveDraftLength::new(1, 8, 4, 8);
        let drafted = drive(&mut c, 400, 30_000.0, 30_000.0, 80_000.0);
        assert!(c.cost_pauses() >= 5, "{} pauses", c.cost_pauses());
        assert_eq!(drafted, c.cost_pauses(), "one step per probe");
        // A marginal loser (1.1× plain per token) is judged on the average of
        // SPEC_PROBE_STEPS steps.
        let mut m = AdaptiveDraftLength::new(1, 1, 1, 8);
        let drafted = drive(
            &mut m,
            2 + AdaptiveDraftLength::SPEC_PROBE_STEPS,
            30_000.0,
            36_000.0,
            30_000.0,
        );
        assert_eq!(drafted, AdaptiveDraftLength::SPEC_PROBE_STEPS);
        assert_eq!(m.cost_pauses(), 1);
        // A GPU-like pair: verifying k drafts costs little more than one step.
        let mut b = AdaptiveDraftLength::new(1, 8, 4, 8);
        let drafted = drive(&mut b, 400, 30_000.0, 30_000.0, 1_000.0);
        assert_eq!(b.cost_pauses(), 0);
        assert!(drafted > 390, "{drafted}");
        let (plain, spec) = b.costs();
        assert!(spec.unwrap() < plain.unwrap());
        // A fixed length is for measuring: cost never switches it off.
        let mut f = AdaptiveDraftLength::fixed(4, 8);
        assert_eq!(drive(&mut f, 100, 30_000.0, 30_000.0, 50_000.0), 100);
        // Without cost awareness only the acceptance rate decides.
        let mut w = AdaptiveDraftLength::new(1, 8, 4, 8).without_cost();
        assert_eq!(drive(&mut w, 100, 30_000.0, 30_000.0, 50_000.0), 100);
        assert_eq!(w.cost_pauses(), 0);
        // Garbage timings are ignored.
        b.record_step(true, f64::NAN, 3);
        b.record_step(true, 10.0, 0);
        assert_eq!(b.costs(), (plain, spec));
    }
}
