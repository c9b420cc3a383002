//! Paged-attention kernels over siliceo's KV formats.
//!
//! **Status: the crate exists so the layering holds; its contents land with the
//! kernels issue.** It will hold the KV codecs (F16, KV8, K5/V4 with an F16
//! tail, optional Hadamard rotation) with documented bit layouts, a
//! multi-threaded CPU paged-attention kernel in Rust (decode and prefill), and
//! CUDA kernels for Turing (sm_75) under the `cuda` feature, loaded through
//! cudarc, compared against the CPU kernel.
//!
//! **Architecture invariant:** the only crate that touches cudarc; builds and
//! tests with no CUDA toolkit and no GPU.
#![deny(missing_docs)]
