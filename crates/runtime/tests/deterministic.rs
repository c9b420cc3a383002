//! Batch invariance on a K-quant model: Qwen2.5-Coder-1.5B (Q4_K_M) with
//! `ModelOptions::deterministic` (no repacked weights, no tiled K-quant
//! products). Its own test binary: llama.cpp reads the tiled switch once per
//! process, at its first matrix product.

use std::path::PathBuf;

use siliceo_core::{Priority, SamplingParams, TokenId};
use siliceo_runtime::{Event, GenerateRequest, Input, Runtime, RuntimeConfig};

/// This package's folder in the checkout the tests run in: cargo sets it when
/// it runs a test. A test binary built in another checkout that shares the
/// target directory must not read that checkout's models.
pub fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

fn qwen() -> PathBuf {
    let p = manifest_dir().join("../../models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    assert!(
        p.is_file(),
        "{} is missing: run `cargo xtask fetch-model --spec`",
        p.display()
    );
    p
}

fn config() -> RuntimeConfig {
    let mut cfg = RuntimeConfig::new(qwen());
    cfg.model.deterministic = true;
    cfg.context.n_ctx = 2048;
    // The binary's one test runs alone: every core, whatever
    // `SILICEO_THREADS` (`cargo xtask test` sets 1 for tests run side by side).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    cfg.context.n_threads = Some(cores);
    cfg.context.n_threads_batch = Some(cores);
    cfg
}

fn greedy(p: &str, n: u32) -> GenerateRequest {
    GenerateRequest {
        sampling: SamplingParams {
            max_tokens: n,
            ignore_eos: true,
            ..SamplingParams::greedy()
        },
        priority: Priority::Normal,
        ..GenerateRequest::new(Input::Prompt(p.to_string()))
    }
}

const CODE: &str = "import heapq\nfrom dataclasses import dataclass, field\n\n\
@dataclass(order=True)\nclass Job:\n    priority: int\n    name: str = field(compare=False)\n\n\
class Scheduler:\n    \"\"\"Runs the most urgent job first.\"\"\"\n\n    def __init__(self):\n        \
self.queue = []\n\n    def add(self, job: Job) -> None:\n        heapq.heappush(self.queue, job)\n\n";

#[test]
fn greedy_output_is_batch_invariant_on_a_k_quant_model() {
    let n = 20;
    let prompts: Vec<String> = [
        "    def pop(self) -> Job:\n",
        "    def __len__(self) -> int:\n",
        "    def peek(self) -> Job:\n",
        "def fibonacci(n: int) -> int:\n",
    ]
    .iter()
    .map(|tail| format!("{CODE}{tail}"))
    .collect();
    let alone: Vec<Vec<TokenId>> = prompts
        .iter()
        .map(|p| {
            let rt = Runtime::start(config()).unwrap();
            rt.submit(greedy(p, n)).unwrap().blocking_collect().1
        })
        .collect();
    let mut cfg = config();
    cfg.scheduler.max_batch_tokens = 96;
    cfg.context.n_batch = 96;
    let rt = Runtime::start(cfg).unwrap();
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| rt.submit(greedy(p, n)).unwrap())
        .collect();
    for (i, s) in streams.into_iter().enumerate() {
        let (_, tokens, _) = s.blocking_collect();
        assert_eq!(tokens, alone[i], "prompt {i}: batched output differs");
    }
    for (i, p) in prompts.iter().enumerate() {
        let (_, tokens, done) = rt.submit(greedy(p, n)).unwrap().blocking_collect();
        let Event::Done { usage, .. } = done else {
            panic!("no Done")
        };
        assert_eq!(usage.cached_prompt_tokens, usage.prompt_tokens - 1);
        assert_eq!(
            tokens, alone[i],
            "prompt {i}: output after a prefix hit differs"
        );
    }
    let s = rt.stats().unwrap();
    assert_eq!((s.running, s.kv_used_blocks), (0, 0), "{s:?}");
    rt.check_kv().unwrap();
}
