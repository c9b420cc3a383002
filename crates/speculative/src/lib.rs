//! Speculative decoding for siliceo-infer.
//!
//! **Status: the crate exists so the layering holds; its contents land with the
//! speculative-decoding issue.** It will hold the `Drafter` abstraction (draft
//! model, token trees, n-gram prompt lookup), verification of drafted tokens in
//! one target batch, exact greedy acceptance and rejection sampling that keeps
//! the target distribution, and adaptive draft length.
//!
//! **Architecture invariant:** knows nothing of llama.cpp; models are reached
//! through traits the runtime implements over the engine.
#![deny(missing_docs)]
