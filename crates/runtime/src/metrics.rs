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

fn bump(v: &Mutex<Vec<(String, u64)>>, label: &str) {
    let mut v = v.lock().unwrap_or_else(|p| p.into_inner());
    match v.iter_mut().find(|(l, _)| l == label) {
        Some((_, n)) => *n += 1,
        None => v.push((label.to_string(), 1)),
    }
}

impl Metrics {
    /// Counts a finished request.
    pub fn finished(&self, reason: &str) {
        bump(&self.finished, reason);
    }

    /// Counts a failed request by error kind.
    pub fn error(&self, kind: &str) {
        bump(&self.errors, kind);
    }

    /// Counts a protocol request: `protocol` (`http`, `grpc`), its endpoint
    /// (`/v1/chat/completions`, `Generate`) and the status it got (`200`,
    /// `INVALID_ARGUMENT`).
    pub fn api_request(&self, protocol: &str, endpoint: &str, status: &str) {
        let label = format!(
            "protocol=\"{protocol}\",endpoint=\"{}\",status=\"{status}\"",
            endpoint.replace(['"', '\\', '\n'], "_")
        );
        bump(&self.api, &label);
    }

    /// Protocol requests counted so far for `protocol` and `endpoint`, over
    /// all statuses.
    pub fn api_requests_of(&self, protocol: &str, endpoint: &str) -> u64 {
        let prefix = format!("protocol=\"{protocol}\",endpoint=\"{endpoint}\",");
        let v = self.api.lock().unwrap_or_else(|p| p.into_inner());
        v.iter()
            .filter(|(l, _)| l.starts_with(&prefix))
            .map(|(_, n)| n)
            .sum()
    }

    /// A request's final figures.
    pub(crate) fn usage(&self, usage: &Usage) {
        let add = |c: &AtomicU64, v: u32| c.fetch_add(u64::from(v), Ordering::Relaxed);
        add(&self.prompt_tokens, usage.prompt_tokens);
        add(&self.cached_prompt_tokens, usage.cached_prompt_tokens);
        add(&self.draft_tokens, usage.draft_tokens);
        add(&self.accepted_draft_tokens, usage.accepted_draft_tokens);
    }

    /// Requests that failed with `kind` so far.
    pub fn errors_of(&self, kind: &str) -> u64 {
        let v = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        v.iter().find(|(l, _)| l == kind).map_or(0, |(_, n)| *n)
    }

    /// The Prometheus text exposition, with the runtime's occupancy.
    pub(crate) fn render(&self, rt: &Runtime) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let labelled = |out: &mut String,
                        name: &str,
                        help: &str,
                        label: &str,
                        v: &Mutex<Vec<(String, u64)>>| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            let v = v.lock().unwrap_or_else(|p| p.into_inner());
            for (l, n) in v.iter() {
                let _ = writeln!(out, "{name}{{{label}=\"{l}\"}} {n}");
            }
        };
        labelled(
            &mut out,
            "siliceo_requests_finished_total",
            "Requests finished, by finish reason.",
            "reason",
            &self.finished,
        );
        labelled(
            &mut out,
            "siliceo_request_errors_total",
            "Requests failed, by error kind.",
            "kind",
            &self.errors,
        );
        {
            let name = "siliceo_api_requests_total";
            let _ = writeln!(
                out,
                "# HELP {name} Protocol requests, by protocol, endpoint and status.\n# TYPE {name} counter"
            );
            let v = self.api.lock().unwrap_or_else(|p| p.into_inner());
            for (l, n) in v.iter() {
                let _ = writeln!(out, "{name}{{{l}}} {n}");
            }
        }
        counter(
            &mut out,
            "siliceo_generated_tokens_total",
            "Tokens generated.",
            self.generated_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "siliceo_prompt_tokens_total",
            "Prompt tokens received.",
            self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "siliceo_cached_prompt_tokens_total",
            "Prompt tokens served from the prefix cache.",
            self.cached_prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "siliceo_draft_tokens_total",
            "Speculative tokens proposed.",
            self.draft_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "siliceo_accepted_draft_tokens_total",
            "Speculative tokens accepted.",
            self.accepted_draft_tokens.load(Ordering::Relaxed),
        );
        self.ttft.render(
            &mut out,
            "siliceo_time_to_first_token_seconds",
            "Arrival to first generated token.",
        );
        self.inter_token.render(
            &mut out,
            "siliceo_inter_token_latency_seconds",
            "Time between consecutive tokens of a stream.",
        );
        if let Ok(s) = rt.stats() {
            gauge(
                &mut out,
                "siliceo_queue_length",
                "Requests waiting.",
                s.waiting as u64,
            );
            gauge(
                &mut out,
                "siliceo_running_sequences",
                "Requests running.",
                s.running as u64,
            );
            gauge(
                &mut out,
                "siliceo_kv_blocks_used",
                "KV blocks referenced.",
                s.kv_used_blocks as u64,
            );
            gauge(
                &mut out,
                "siliceo_kv_blocks_free",
                "KV blocks free (cached ones included).",
                s.kv_free_blocks as u64,
            );
            gauge(
                &mut out,
                "siliceo_kv_blocks_cached",
                "Unreferenced KV blocks holding a cached prefix.",
                s.kv_cached_blocks as u64,
            );
            gauge(
                &mut out,
                "siliceo_kv_blocks_shared",
                "KV blocks several requests reference (prefix hits share them).",
                s.kv_shared_blocks as u64,
            );
            let info = rt.info();
            // The names the Kubernetes Gateway API Inference Extension's
            // model-server protocol recommends (vLLM's), with its
            // semantics, so llm-d's endpoint picker can read us too.
            let usage = s.kv_usage();
            let _ = writeln!(
                out,
                "# HELP vllm:num_requests_waiting Requests waiting (TotalQueuedRequests).\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting {}\n\
                 # HELP vllm:num_requests_running Requests running (TotalRunningRequests).\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {}\n\
                 # HELP vllm:kv_cache_usage_perc KV-cache utilisation, 1 = full (KVCacheUtilization).\n# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc {usage}\n\
                 # HELP vllm:gpu_cache_usage_perc The same, by its older name.\n# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc {usage}\n\
                 # HELP vllm:cache_config_info KV-cache layout (BlockSize, NumGPUBlocks).\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{}\",num_gpu_blocks=\"{}\"}} 1",
                s.waiting, s.running, info.block_size, info.kv_blocks
            );
            let _ = writeln!(
                out,
                "# HELP siliceo_kv_bytes_used Bytes of KV blocks referenced, by backend and format (our store only; 0 on llama.cpp's cache).\n# TYPE siliceo_kv_bytes_used gauge\nsiliceo_kv_bytes_used{{backend=\"{}\",format=\"{}\"}} {}",
                info.kv_backend, info.kv_format, s.kv_used_bytes
            );
            if let Some(store) = &info.store {
                let _ = writeln!(
                    out,
                    "# HELP siliceo_kv_bytes_total Bytes of our KV store, by format.\n# TYPE siliceo_kv_bytes_total gauge\nsiliceo_kv_bytes_total{{format=\"{}\"}} {}",
                    info.kv_format, store.bytes
                );
            }
            let rate = s.prefix_hit_rate();
            let _ = writeln!(
                out,
                "# HELP siliceo_prefix_cache_hit_rate Prompt tokens served from the cache / prompt tokens looked up.\n# TYPE siliceo_prefix_cache_hit_rate gauge\nsiliceo_prefix_cache_hit_rate {rate}"
            );
            counter(
                &mut out,
                "siliceo_prefix_cache_evictions_total",
                "Cached blocks evicted.",
                s.prefix_evictions,
            );
            counter(
                &mut out,
                "siliceo_preemptions_total",
                "Sequences preempted.",
                s.preemptions,
            );
            counter(
                &mut out,
                "siliceo_engine_panics_total",
                "Engine steps that panicked and were recovered.",
                s.panics,
            );
        }
        out
    }
}
