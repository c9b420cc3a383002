//! The loop: commands from the API between steps, panics caught at the
//! step boundary, statistics.

use std::time::Instant;

use crossbeam_channel::Receiver;
use siliceo_core::{FinishReason, RequestId, SeqId};
use siliceo_scheduler::Scheduler;

use super::Engine;
use super::output::done;
use crate::{Command, RuntimeError, RuntimeStats, Usage};

impl Engine<'_> {
    pub(super) fn serve(&mut self, rx: &Receiver<Command>) {
        loop {
            // Wait when idle; otherwise take what has arrived and step.
            let first = if self.sched.is_idle() {
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return self.shutdown(),
                }
            } else {
                None
            };
            for cmd in first.into_iter().chain(rx.try_iter()) {
                match cmd {
                    Command::Submit(sub) => {
                        // A panic while admitting fails that request only.
                        let etx = sub.tx.clone();
                        let id = sub.id.clone();
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            self.submit(*sub)
                        }));
                        if r.is_err() {
                            tracing::error!(request = %id, "panic while admitting a request");
                            self.live.remove(&id);
                            self.sched.cancel(&id);
                            done(
                                &etx,
                                FinishReason::Error,
                                Usage::default(),
                                Some(RuntimeError::Engine(
                                    "internal error while admitting the request".into(),
                                )),
                                None,
                            );
                        }
                    }
                    Command::Cancel(id, reply) => {
                        let known = self.live.contains_key(&id);
                        self.end(&id, FinishReason::Cancelled, None);
                        if let Some(r) = reply {
                            let _ = r.send(known);
                        }
                    }
                    Command::Stats(tx) => {
                        let _ = tx.send(self.stats());
                    }
                    Command::CheckKv(tx) => {
                        let _ = tx.send(self.check_kv());
                    }
                    Command::CancelAll => self.shutdown(),
                    Command::Shutdown => return self.shutdown(),
                }
            }
            if !self.sched.is_idle() {
                let t = Instant::now();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.step()));
                if r.is_err() {
                    self.recover_from_panic();
                } else {
                    // The blocks the step read and sealed or copied away go
                    // now, not at the next step: an engine left idle (its last
                    // request cancelled) must hold no block.
                    self.sched.step_done();
                }
                self.steps += 1;
                self.step_us += t.elapsed().as_micros() as u64;
            }
            // What the step (or an admission's eviction) cached and evicted.
            self.kv_events.publish(self.sched.take_kv_events());
        }
    }

    /// After a panic inside a step nothing about its half-done state can be
    /// trusted: every request in flight ends with an error, the KV cache is
    /// cleared and the scheduler starts afresh. The engine keeps serving.
    pub(super) fn recover_from_panic(&mut self) {
        self.panics += 1;
        tracing::error!(
            in_flight = self.live.len(),
            "a step panicked; failing the requests in flight and resetting the KV cache"
        );
        let err = RuntimeError::Engine("internal error; the request was aborted".into());
        for (_, mut live) in self.live.drain() {
            live.seq = None;
            done(
                &live.tx,
                FinishReason::Error,
                live.usage(),
                Some(err.clone()),
                None,
            );
        }
        self.clear_kv();
        if let Some(d) = self.draft.as_mut() {
            d.ctx.clear();
        }
        self.sched = Scheduler::new(*self.sched.config(), self.sched.kv().config());
        self.kv_events.clear();
        self.free_seqs = (0..self.max_running).rev().map(SeqId).collect();
        self.batch.clear();
    }

    /// Ends every request in flight as cancelled.
    pub(super) fn shutdown(&mut self) {
        let ids: Vec<RequestId> = self.live.keys().cloned().collect();
        for id in ids {
            self.end(&id, FinishReason::Cancelled, None);
        }
    }

    pub(super) fn stats(&self) -> RuntimeStats {
        let s = self.sched.stats();
        let kv = self.sched.kv().stats();
        let llama_cells = self.llama_cells();
        let kv_used_bytes = match &self.kv {
            super::kv::Kv::Graft(g) => {
                let ((sealed_b, open_b), (w_sealed_b, w_open_b)) = g.block_bytes();
                let open_used = (kv.used_blocks - kv.used_sealed_blocks) as u64;
                let w_open_used = (kv.windowed_used_blocks - kv.windowed_used_sealed_blocks) as u64;
                open_used * open_b
                    + kv.used_sealed_blocks as u64 * sealed_b
                    + w_open_used * w_open_b
                    + kv.windowed_used_sealed_blocks as u64 * w_sealed_b
            }
            super::kv::Kv::Llama(_) => 0,
        };
        RuntimeStats {
            kv_used_bytes,
            kv_shared_blocks: kv.shared_blocks,
            kv_used_sealed_blocks: kv.used_sealed_blocks,
            kv_windowed_used_blocks: kv.windowed_used_blocks,
            kv_windowed_free_blocks: kv.windowed_free_blocks,
            waiting: s.waiting,
            running: s.running,
            kv_used_blocks: kv.used_blocks,
            kv_free_blocks: kv.free_blocks,
            kv_cached_blocks: kv.cached_unreferenced_blocks,
            kv_cached_contents: self.sched.kv().cached_contents(),
            prefix_hit_tokens: kv.hit_tokens,
            prefix_miss_tokens: kv.miss_tokens,
            prefix_evictions: kv.evictions,
            seq_ids_in_use: self.max_running as usize - self.free_seqs.len(),
            held_blocks: self.held_blocks(),
            llama_cells,
            preemptions: s.preemptions,
            steps: self.steps,
            step_us: self.step_us,
            decode_us: self.decode_us,
            panics: self.panics,
            tree_verifications: self.tree_verifications,
            tree_later_branches_kept: self.tree_later_branches_kept,
            spec_cost_pauses: self.spec_cost_pauses,
            constraint_masks: self.mask_stats.masks,
            constraint_mask_us: self.mask_stats.us,
            constraint_masks_overlapped: self.mask_stats.overlapped,
        }
    }
}
