//! Paged KV-cache bookkeeping for siliceo-infer — pure logic, reusable alone.
//!
//! **Status: the crate exists so the layering holds; its contents land with the
//! kv-paging issue.** It will hold:
//!
//! - a block pool of fixed-size blocks (64 tokens by default) with reference
//!   counts and an O(1) index-linked LRU free queue;
//! - per-sequence block tables with copy-on-write of a shared partial block;
//! - automatic prefix caching: full blocks addressed by a hash chained on the
//!   parent block's hash plus extra keys (model, KV format, cache salt);
//! - the memory planner: blocks, context and concurrency that fit a VRAM budget.
//!
//! **Architecture invariant:** no I/O, no async, nothing of llama.cpp. A block
//! is an index; who stores its bytes is the caller's business.
#![deny(missing_docs)]
