//! The serving loop of siliceo-infer.
//!
//! **Status: the crate exists so the layering holds; its contents land with the
//! runtime issue.** It will own the engine and its context on one engine
//! thread, drive the scheduler, kv-paging and speculative decoding every step,
//! and stream tokens to callers through channels. Until then
//! `siliceo_engine::generate` serves one sequence at a time.
//!
//! **Architecture invariant:** knows nothing of gRPC; the server crate adapts
//! it to the wire.
#![deny(missing_docs)]
