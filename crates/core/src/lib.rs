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

/// The API keys a server accepts, any one of them (`Authorization: Bearer
/// <key>` on both protocols); none: no key is asked for. Its `Debug` shows
/// how many, never the keys.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ApiKeys(Vec<String>);

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.0.len())
    }
}

impl ApiKeys {
    /// These keys (empty ones dropped, repeats once).
    pub fn new(keys: impl IntoIterator<Item = String>) -> Self {
        let mut v: Vec<String> = Vec::new();
        for k in keys {
            if !k.is_empty() && !v.contains(&k) {
                v.push(k);
            }
        }
        ApiKeys(v)
    }

    /// The keys of a key file: one per line, surrounding whitespace
    /// trimmed; blank lines and lines starting with `#` are skipped.
    pub fn parse_file(text: &str) -> Vec<String> {
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(str::to_string)
            .collect()
    }

    /// No key is asked for.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// How many keys.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether `given` is one of the keys. Every key is compared, each in
    /// time that depends only on the lengths.
    pub fn accepts(&self, given: &str) -> bool {
        self.0.iter().fold(false, |ok, k| {
            ok | constant_time_eq(given.as_bytes(), k.as_bytes())
        })
    }
}

/// Seconds since the Unix epoch, now (0 on a clock set before 1970): the
/// timestamps both protocols and the KV events carry.
pub fn unix_time_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `secs` since the Unix epoch as an RFC 3339 time in UTC, to the second
/// (`2026-12-06T21:03:58Z`): SMG's load reports and Anthropic's model dates.
pub fn rfc3339(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm:
    // eras of 400 years from 0000-03-01).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3_600,
        rem % 3_600 / 60,
        rem % 60
    )
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
pub use geometry::{
    LayerKv, ModelGeometry, kv_elems_per_token, layer_kv, layers_alike, offloaded_layers,
    shared_kv_layers, windowed_by_period,
};
pub use ids::{RequestId, SeqId, TokenId};
pub use kv_type::KvType;
pub use sampler::Sampler;
pub use sampling::{
    FinishReason, MAX_LOGIT_BIAS, MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS, Priority, SamplingParams,
};
pub use stop::{StopMatcher, StopOutcome, held_prefix_len};

#[cfg(test)]
mod rfc3339_tests {
    #[test]
    fn times_are_rfc_3339_in_utc() {
        use super::rfc3339;
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_590_238), "2026-12-06T20:50:38Z");
        assert_eq!(rfc3339(4_107_542_399), "2100-02-28T23:59:59Z");
        assert_eq!(rfc3339(4_107_542_400), "2100-03-01T00:00:00Z");
    }
}

#[cfg(test)]
mod api_key_tests {
    use super::ApiKeys;

    #[test]
    fn any_key_opens_and_debug_hides_them() {
        let file = ApiKeys::parse_file("# team keys\n  alpha  \n\nbeta\n#gamma\n");
        assert_eq!(file, ["alpha", "beta"]);
        let keys = ApiKeys::new(file.into_iter().chain(["alpha".into(), String::new()]));
        assert_eq!(keys.len(), 2);
        assert!(keys.accepts("alpha") && keys.accepts("beta"));
        assert!(!keys.accepts("gamma") && !keys.accepts("alph") && !keys.accepts(""));
        assert_eq!(format!("{keys:?}"), "ApiKeys(2 keys)");
        assert!(ApiKeys::default().is_empty());
    }
}
