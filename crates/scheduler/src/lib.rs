//! Continuous batching with a priority scheduler — pure logic.
//!
//! Every engine step, [`Scheduler::schedule`] decides which tokens run: the
//! decode token of every running sequence first, then chunks of pending
//! prefills, then new admissions, all under one token budget
//! (`max_batch_tokens`) and a cap on running sequences. There are no separate
//! prefill and decode phases: a sequence is always "tokens computed so far
//! catching up with tokens known", one chunk per step (chunked prefill), so a
//! long prompt never stalls running decodes for more than one chunk.
//!
//! - **Priorities**: [`Priority`] classes, first come first served inside a
//!   class; a waiting request rises one class per `aging_ms` of waiting, so a
//!   low class is never starved forever.
//! - **Admission through kv-paging**: a request is admitted when the blocks for
//!   its whole prompt (less what the prefix cache already holds) are free.
//!   Unreferenced cached blocks count as free — allocation evicts them, least
//!   recently used first.
//! - **Preemption**: when a running sequence cannot grow, or a waiting request
//!   of a strictly higher class cannot be admitted, the lowest-priority, most
//!   recently started sequence is preempted (aging orders admissions but gives
//!   no right to preempt, so preemption runs one way and cannot ping-pong): by **swap** (the runtime saves its
//!   KV to host memory) when its KV is long enough that recomputing costs more
//!   and the host swap budget has room, by **recompute** otherwise. It is resumed
//!   later and, with the runtime keeping its sampler, produces the same tokens.
//! - **Cancellation and deadlines** free a request's blocks in the same step.
//!
//! The scheduler owns a [`KvGroups`] (one [`KvCacheManager`], or two when the
//! windowed layers keep blocks of their own); the runtime maps its block
//! decisions onto real KV memory (our paged store, or llama.cpp's cells). Time is passed in
//! (`now_ms`), so the scheduler does no I/O and is deterministic under test.
//!
//! ```
//! use siliceo_core::{Priority, RequestId, TokenId};
//! use siliceo_kv_paging::{CacheKeys, KvConfig};
//! use siliceo_scheduler::{Request, Scheduler, SchedulerConfig};
//!
//! let mut s = Scheduler::new(
//!     SchedulerConfig { max_batch_tokens: 64, ..SchedulerConfig::default() },
//!     KvConfig { num_blocks: 64, block_size: 16, ..KvConfig::default() },
//! );
//! let prompt: Vec<TokenId> = (0..100).map(TokenId).collect();
//! s.add(Request::new(RequestId::from("a"), prompt, 4, CacheKeys::new("m", "f16"), Priority::Normal, 0)).unwrap();
//! let step = s.schedule(0);
//! // The 100-token prompt runs in chunks of the 64-token budget.
//! assert_eq!(step.items[0].tokens.len(), 64);
//! assert!(!step.items[0].wants_logits);
//! ```
#![deny(missing_docs)]

mod scheduler;

pub use scheduler::{
    FinishCause, Finished, ItemKind, PreemptMode, Preempted, Rejected, Request, Scheduler,
    SchedulerConfig, SchedulerStats, Step, StepItem,
};
pub use siliceo_core::Priority;
pub use siliceo_kv_paging::{KvCacheManager, KvGroups};
