//! Continuous batching with a priority scheduler — pure logic.
//!
//! **Status: the crate exists so the layering holds; its contents land with the
//! scheduler issue.** It will decide, every engine step, which tokens run: the
//! decode token of every running sequence plus chunks of pending prefills under
//! a token budget, priority classes with aging, admission through kv-paging,
//! and preemption (swap or recompute) of the lowest priority under pressure.
//!
//! **Architecture invariant:** no I/O, no async, nothing of llama.cpp; it talks
//! to the engine through a trait the runtime implements.
#![deny(missing_docs)]
