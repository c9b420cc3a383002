//! The gRPC server of siliceo-infer.
//!
//! **Status: the crate exists so the layering holds; its contents land with the
//! server issue.** It will serve `proto/siliceo/v1/inference.proto` with tonic
//! (streaming generation, embeddings, rerank, tokenize, model info, cancel),
//! the standard health and reflection services, and Prometheus metrics.
//!
//! **Architecture invariant:** the only crate that knows the proto; mapping
//! errors to `tonic::Status` happens here and nowhere else.
#![deny(missing_docs)]
