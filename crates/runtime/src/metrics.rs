//! Prometheus metrics, one set for every protocol. Each [`RequestStream`]
//! counts its own tokens, latencies and ending as its events are read, so a
//! request counts the same through gRPC, HTTP or the Rust API; the protocol
//! edges add their requests by endpoint and status
//! ([`Metrics::api_request`]). The runtime's occupancy is read at scrape
//! time ([`Runtime::prometheus`]).
//!
//! [`RequestStream`]: crate::RequestStream

use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Runtime, Usage};

/// Bucket upper bounds in seconds, shared by both latency histograms.
const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A fixed-bucket histogram.
#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    /// Sum in microseconds.
    sum_us: AtomicU64,
}

impl Histogram {
    /// Records one observation of `secs` seconds.
    pub fn observe(&self, secs: f64) {
        if let Some(i) = BUCKETS.iter().position(|b| secs <= *b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add((secs * 1e6) as u64, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in BUCKETS.iter().zip(&self.counts) {
            cum += c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let n = self.count();
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {n}");
    }
}

/// Everything the runtime and its protocol edges count.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Requests finished, by finish reason (`stop`, `length`, `cancelled`, `error`).
    finished: Mutex<Vec<(String, u64)>>,
    /// Failed requests by error kind (`invalid_request`, `queue_full`, …).
    errors: Mutex<Vec<(String, u64)>>,
    /// Protocol requests by `protocol,endpoint,status`.
    api: Mutex<Vec<(String, u64)>>,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// Prompt tokens received.
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens served from the prefix cache.
    pub cached_prompt_tokens: AtomicU64,
    /// Speculative tokens drafted.
    pub draft_tokens: AtomicU64,
    /// Drafted tokens accepted.
    pub accepted_draft_tokens: AtomicU64,
    /// Time to first token.
    pub ttft: Histogram,
    /// Time between consecutive tokens of a stream.
    pub inter_token: Histogram,
}

/// Counts one more for the label set `labels` (`reason="stop"`).
fn bump(v: &Mutex<Vec<(String, u64)>>, labels: String) {
    let mut v = v.lock().unwrap_or_else(|p| p.into_inner());
    match v.iter_mut().find(|(l, _)| *l == labels) {
        Some((_, n)) => *n += 1,
        None => v.push((labels, 1)),
    }
}

/// One metric family in Prometheus' text format: `samples` are (label set,
/// value), the label set empty for an unlabelled sample.
fn family<L: AsRef<str>, V: std::fmt::Display>(
    out: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, V)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, v) in samples {
        let labels = labels.as_ref();
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {v}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {v}");
        }
    }
}

/// The samples of a labelled counter.
fn samples(v: &Mutex<Vec<(String, u64)>>) -> Vec<(String, u64)> {
    v.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

impl Metrics {
    /// Counts a finished request.
    pub fn finished(&self, reason: &str) {
        bump(&self.finished, format!("reason=\"{reason}\""));
    }

    /// Counts a failed request by error kind.
    pub fn error(&self, kind: &str) {
        bump(&self.errors, format!("kind=\"{kind}\""));
    }

    /// Counts a protocol request: `protocol` (`http`, `grpc`), its endpoint
    /// (`/v1/chat/completions`, `Generate`) and the status it got (`200`,
    /// `INVALID_ARGUMENT`).
    pub fn api_request(&self, protocol: &str, endpoint: &str, status: &str) {
        let labels = format!(
            "protocol=\"{protocol}\",endpoint=\"{}\",status=\"{status}\"",
            endpoint.replace(['"', '\\', '\n'], "_")
        );
        bump(&self.api, labels);
    }

    /// A request's final figures.
    pub(crate) fn usage(&self, usage: &Usage) {
        let add = |c: &AtomicU64, v: u32| c.fetch_add(u64::from(v), Ordering::Relaxed);
        add(&self.prompt_tokens, usage.prompt_tokens);
        add(&self.cached_prompt_tokens, usage.cached_prompt_tokens);
        add(&self.draft_tokens, usage.draft_tokens);
        add(&self.accepted_draft_tokens, usage.accepted_draft_tokens);
    }

    /// The Prometheus text exposition, with the runtime's occupancy.
    pub(crate) fn render(&self, rt: &Runtime) -> String {
        let mut out = String::new();
        let out = &mut out;
        for (name, help, v) in [
            (
                "siliceo_requests_finished_total",
                "Requests finished, by finish reason.",
                &self.finished,
            ),
            (
                "siliceo_request_errors_total",
                "Requests failed, by error kind.",
                &self.errors,
            ),
            (
                "siliceo_api_requests_total",
                "Protocol requests, by protocol, endpoint and status.",
                &self.api,
            ),
        ] {
            family(out, name, "counter", help, samples(v));
        }
        for (name, help, c) in [
            (
                "siliceo_generated_tokens_total",
                "Tokens generated.",
                &self.generated_tokens,
            ),
            (
                "siliceo_prompt_tokens_total",
                "Prompt tokens received.",
                &self.prompt_tokens,
            ),
            (
                "siliceo_cached_prompt_tokens_total",
                "Prompt tokens served from the prefix cache.",
                &self.cached_prompt_tokens,
            ),
            (
                "siliceo_draft_tokens_total",
                "Speculative tokens proposed.",
                &self.draft_tokens,
            ),
            (
                "siliceo_accepted_draft_tokens_total",
                "Speculative tokens accepted.",
                &self.accepted_draft_tokens,
            ),
        ] {
            family(
                out,
                name,
                "counter",
                help,
                [("", c.load(Ordering::Relaxed))],
            );
        }
        self.ttft.render(
            out,
            "siliceo_time_to_first_token_seconds",
            "Arrival to first generated token.",
        );
        self.inter_token.render(
            out,
            "siliceo_inter_token_latency_seconds",
            "Time between consecutive tokens of a stream.",
        );
        let Ok(s) = rt.stats() else {
            return std::mem::take(out);
        };
        let info = rt.info();
        let usage = s.kv_usage();
        // The vllm: names are what the Kubernetes Gateway API Inference
        // Extension's model-server protocol recommends, with its semantics,
        // so llm-d's endpoint picker can read us too.
        for (name, kind, help, v) in [
            (
                "siliceo_queue_length",
                "gauge",
                "Requests waiting.",
                s.waiting as f64,
            ),
            (
                "siliceo_running_sequences",
                "gauge",
                "Requests running.",
                s.running as f64,
            ),
            (
                "siliceo_kv_blocks_used",
                "gauge",
                "KV blocks referenced.",
                s.kv_used_blocks as f64,
            ),
            (
                "siliceo_kv_blocks_free",
                "gauge",
                "KV blocks free (cached ones included).",
                s.kv_free_blocks as f64,
            ),
            (
                "siliceo_kv_windowed_blocks_used",
                "gauge",
                "The windowed layers' own KV blocks referenced (0 without windowed pools).",
                s.kv_windowed_used_blocks as f64,
            ),
            (
                "siliceo_kv_windowed_blocks_free",
                "gauge",
                "The windowed layers' own KV blocks free (cached ones included).",
                s.kv_windowed_free_blocks as f64,
            ),
            (
                "siliceo_kv_blocks_cached",
                "gauge",
                "Unreferenced KV blocks holding a cached prefix.",
                s.kv_cached_blocks as f64,
            ),
            (
                "siliceo_kv_cached_contents",
                "gauge",
                "Distinct full blocks the prefix cache holds (referenced or not): what its \
                 published KV events announce.",
                s.kv_cached_contents as f64,
            ),
            (
                "siliceo_kv_blocks_shared",
                "gauge",
                "KV blocks several requests reference (prefix hits share them).",
                s.kv_shared_blocks as f64,
            ),
            (
                "vllm:num_requests_waiting",
                "gauge",
                "Requests waiting (TotalQueuedRequests).",
                s.waiting as f64,
            ),
            (
                "vllm:num_requests_running",
                "gauge",
                "Requests running (TotalRunningRequests).",
                s.running as f64,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "gauge",
                "KV-cache utilisation, 1 = full (KVCacheUtilization).",
                usage,
            ),
            (
                "vllm:gpu_cache_usage_perc",
                "gauge",
                "The same, by its older name.",
                usage,
            ),
            (
                "siliceo_prefix_cache_hit_rate",
                "gauge",
                "Prompt tokens served from the cache / prompt tokens looked up.",
                s.prefix_hit_rate(),
            ),
            (
                "siliceo_prefix_cache_evictions_total",
                "counter",
                "Cached blocks evicted.",
                s.prefix_evictions as f64,
            ),
            (
                "siliceo_preemptions_total",
                "counter",
                "Sequences preempted.",
                s.preemptions as f64,
            ),
            (
                "siliceo_engine_panics_total",
                "counter",
                "Engine steps that panicked and were recovered.",
                s.panics as f64,
            ),
        ] {
            family(out, name, kind, help, [("", v)]);
        }
        family(
            out,
            "vllm:cache_config_info",
            "gauge",
            "KV-cache layout (BlockSize, NumGPUBlocks).",
            [(
                format!(
                    "block_size=\"{}\",num_gpu_blocks=\"{}\"",
                    info.block_size, info.kv_blocks
                ),
                1,
            )],
        );
        family(
            out,
            "siliceo_kv_bytes_used",
            "gauge",
            "Bytes of KV blocks referenced, by backend and format (our store only; 0 on llama.cpp's cache).",
            [(
                format!(
                    "backend=\"{}\",format=\"{}\"",
                    info.kv_backend, info.kv_format
                ),
                s.kv_used_bytes,
            )],
        );
        if let Some(store) = &info.store {
            family(
                out,
                "siliceo_kv_bytes_total",
                "gauge",
                "Bytes of our KV store, by format.",
                [(format!("format=\"{}\"", info.kv_format), store.bytes)],
            );
        }
        std::mem::take(out)
    }
}
