//! The shared vocabulary of siliceo-infer.
//!
//! Every other crate speaks in these types: ids ([`SeqId`], [`RequestId`],
//! [`TokenId`]), what a request asks for ([`SamplingParams`], [`Priority`]), how
//! it ended ([`FinishReason`]), the shape of a model ([`ModelGeometry`]) and the
//! KV-cache element formats llama.cpp knows ([`KvType`]).
//!
//! This crate does no I/O and knows nothing of llama.cpp, gRPC or CUDA, so the
//! pure-logic crates (kv-paging, scheduler) can depend on it freely.
//!
//! ```
//! use siliceo_core::{KvType, ModelGeometry, SamplingParams};
//!
//! let params = SamplingParams { temperature: 0.7, top_p: 0.9, ..SamplingParams::greedy() };
//! params.validate().unwrap();
//!
//! // SmolLM2-135M: 30 layers, 3 KV heads of dimension 64.
//! let geometry = ModelGeometry {
//!     n_layer: 30, n_head: 9, n_head_kv: 3, head_dim_k: 64, head_dim_v: 64,
//!     n_embd: 576, n_vocab: 49152, n_ctx_train: 8192,
//! };
//! assert_eq!(geometry.kv_bytes_per_token(KvType::F16, KvType::F16), 23_040);
//! ```
#![deny(missing_docs)]

mod constraint;
mod error;
mod geometry;
mod ids;
mod kv_type;
pub mod sampler;
mod sampling;
mod stop;

pub use constraint::{Constraint, MAX_CONSTRAINT_BYTES};
pub use error::Error;

/// Byte strings equal, in time that depends only on their lengths (API keys,
/// checked by both protocol crates).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Seconds since the Unix epoch, now (0 on a clock set before 1970): the
/// timestamps both protocols and the KV events carry.
pub fn unix_time_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A PEM certificate chain and its PEM private key: what both protocol
/// crates serve TLS with (`--tls-cert`, `--tls-key`).
#[derive(Clone)]
pub struct TlsIdentity {
    /// Certificate chain, PEM.
    pub cert_pem: Vec<u8>,
    /// Private key, PEM.
    pub key_pem: Vec<u8>,
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("TlsIdentity")
            .field("cert_pem", &format!("{} bytes", self.cert_pem.len()))
            .finish_non_exhaustive()
    }
}
pub use geometry::{ModelGeometry, offloaded_layers};
pub use ids::{RequestId, SeqId, TokenId};
pub use kv_type::KvType;
pub use sampler::Sampler;
pub use sampling::{
    FinishReason, MAX_LOGIT_BIAS, MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS, Priority, SamplingParams,
};
pub use stop::{StopMatcher, StopOutcome};
