//! Batch invariance on K-quant models: Qwen2.5-Coder-1.5B (Q4_K_M), and
//! Gemma-3-270M (Q4_K_M, sliding windows; and Gemma 4's architecture at
//! test size, `synth-model --like gemma4-mini`, through the same paths), with
//! `ModelOptions::deterministic` (no repacked weights, no tiled K-quant
//! products). Its own test binary: llama.cpp reads the tiled switch once per
//! process, at its first matrix product.

use std::path::PathBuf;

use siliceo_core::{Priority, SamplingParams, TokenId};
use siliceo_runtime::{Event, GenerateRequest, Input, Runtime, RuntimeConfig, SpeculativeConfig};

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
    config_for(qwen())
}

fn config_for(model: PathBuf) -> RuntimeConfig {
    let mut cfg = RuntimeConfig::new(model);
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
    let rt = Runtime::start(chunked(config())).unwrap();
    let batched = together(&rt, prompts.iter().map(|p| greedy(p, n)));
    for (i, tokens) in batched.iter().enumerate() {
        assert_eq!(tokens, &alone[i], "prompt {i}: batched output differs");
    }
    for (i, p) in prompts.iter().enumerate() {
        let (_, tokens, done) = rt.submit(greedy(p, n)).unwrap().blocking_collect();
        let usage = usage_of(&done);
        assert_eq!(usage.cached_prompt_tokens, usage.prompt_tokens - 1);
        assert_eq!(
            tokens, alone[i],
            "prompt {i}: output after a prefix hit differs"
        );
    }
    assert_clean(&rt);
}

/// `cfg` stepping 96 tokens at a time: prompts are cut at other places
/// than in a step of their own.
fn chunked(mut cfg: RuntimeConfig) -> RuntimeConfig {
    cfg.scheduler.max_batch_tokens = 96;
    cfg.context.n_batch = 96;
    cfg
}

/// Submits every request at once; each one's tokens, in order.
fn together(
    rt: &Runtime,
    requests: impl IntoIterator<Item = GenerateRequest>,
) -> Vec<Vec<TokenId>> {
    let streams: Vec<_> = requests
        .into_iter()
        .map(|r| rt.submit(r).unwrap())
        .collect();
    streams
        .into_iter()
        .map(|s| s.blocking_collect().1)
        .collect()
}

fn usage_of(done: &Event) -> siliceo_runtime::Usage {
    match done {
        Event::Done { usage, error, .. } => {
            assert!(error.is_none(), "{error:?}");
            *usage
        }
        other => panic!("not a Done event: {other:?}"),
    }
}

/// Nothing running, no block held (in either group), and the store's books
/// agree.
fn assert_clean(rt: &Runtime) {
    let s = rt.stats().unwrap();
    assert_eq!(
        (
            s.running,
            s.kv_used_blocks,
            s.kv_windowed_used_blocks,
            s.seq_ids_in_use
        ),
        (0, 0, 0, 0),
        "{s:?}"
    );
    rt.check_kv().unwrap();
}

/// A request's tokens, their log-probabilities and its usage.
fn with_logprobs(
    stream: siliceo_runtime::RequestStream,
) -> (
    Vec<TokenId>,
    Vec<siliceo_runtime::TokenLogprob>,
    siliceo_runtime::Usage,
) {
    let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
    let mut stream = stream;
    while let Some(e) = stream.blocking_next() {
        match e {
            Event::Text {
                tokens: t,
                logprobs: l,
                ..
            } => {
                tokens.extend(t);
                logprobs.extend(l);
            }
            Event::Prompt { .. } => {}
            done @ Event::Done { .. } => return (tokens, logprobs, usage_of(&done)),
        }
    }
    panic!("a stream without Done");
}

/// Gemma 3's windowed layers keep pools of their own (the default): a
/// sequence of over three windows, in pools of 20 sealed blocks that
/// cannot hold its 30, releases the blocks its window passed, and its log-probabilities are bit
/// for bit those of the store keeping every block (`swa_full`, llama.cpp's
/// `--swa-full`); the same prompt again is served from the cache (the
/// global layers' blocks and the windowed layers' last window), exactly.
#[test]
fn gemma3_windowed_pools_release_blocks_and_keep_logprobs_exact() {
    let long = ledgers().join("\n");
    let request = || GenerateRequest {
        logprobs: Some(4),
        ..greedy(&long, 24)
    };
    let start = |swa_full: bool| {
        let mut cfg = chunked(config_for(gemma()));
        cfg.context.n_ctx = 4096;
        cfg.scheduler.max_running_seqs = 1;
        cfg.swa_full = swa_full;
        Runtime::start(cfg).unwrap()
    };
    let full = start(true);
    assert_eq!(full.info().windowed_pools, None);
    let (want, want_lp, u) = with_logprobs(full.submit(request()).unwrap());
    assert!(u.prompt_tokens > 3 * 512, "{u:?}");
    assert_eq!(want_lp.len(), want.len());
    drop(full);

    let rt = start(false);
    let pools = rt.info().windowed_pools.expect("windowed pools");
    assert_eq!(pools.layers, (3, 15));
    // The blocks a gateway counts (`SchedulerLoad`) are the global layers',
    // which hold the whole context: the store plan's.
    let plan = rt.info().store.unwrap();
    assert_eq!(rt.info().kv_blocks, plan.open_blocks + plan.sealed_blocks);
    assert_eq!(pools.group.window.tokens, 512);
    // In KV8 (sealed as soon as full): open, 4 for the sequence and a
    // step's 2; sealed, its window's 8 + 2, a step's 2 and a cached
    // window's 8 (`WindowedGroup::for_running`).
    assert_eq!((pools.group.num_blocks, pools.group.sealed_blocks), (6, 20));
    let (tokens, lp, u) = with_logprobs(rt.submit(request()).unwrap());
    assert_eq!(tokens, want, "windowed pools: other tokens");
    assert_eq!(lp, want_lp, "windowed pools: other log-probabilities");
    assert_eq!(u.cached_prompt_tokens, 0);
    assert_clean(&rt);
    // Again: all but the prompt's last token from the cache.
    let (tokens, lp, u) = with_logprobs(rt.submit(request()).unwrap());
    assert_eq!(u.cached_prompt_tokens, u.prompt_tokens - 1, "{u:?}");
    assert_eq!(tokens, want, "after a prefix hit: other tokens");
    assert_eq!(lp, want_lp, "after a prefix hit: other log-probabilities");
    assert_clean(&rt);
    drop(rt);

    // With n-gram drafts (chains: lookahead slots in both groups, rejected
    // ones given back): the same tokens.
    let mut cfg = chunked(config_for(gemma()));
    cfg.context.n_ctx = 4096;
    cfg.scheduler.max_running_seqs = 1;
    cfg.speculative = Some(SpeculativeConfig {
        cost_switch_off: false,
        ..Default::default()
    });
    let rt = Runtime::start(cfg).unwrap();
    assert!(rt.info().windowed_pools.is_some());
    let (_, tokens, done) = rt
        .submit(GenerateRequest {
            speculative: true,
            ..greedy(&long, 24)
        })
        .unwrap()
        .blocking_collect();
    let u = usage_of(&done);
    assert!(u.draft_tokens > 0, "{u:?}");
    assert_eq!(tokens, want, "speculated: other tokens");
    assert_clean(&rt);

    // Cancelled in the middle of its prefill (the stream dropped), another
    // prompt sharing its start: nothing held once idle, in either group.
    let other = format!("{}\nEntry 0:", ledgers()[1]);
    let stream = rt.submit(greedy(&long, 24)).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while rt.stats().unwrap().kv_windowed_used_blocks == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    drop(stream);
    let (_, tokens, done) = rt.submit(greedy(&other, 4)).unwrap().blocking_collect();
    usage_of(&done);
    assert_eq!(tokens.len(), 4);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while rt.stats().unwrap().running > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_clean(&rt);
}

fn gemma() -> PathBuf {
    let p = manifest_dir().join("../../models/gemma-3-270m-q4_k_m.gguf");
    assert!(
        p.is_file(),
        "{} is missing: run `cargo xtask fetch-model --gemma`",
        p.display()
    );
    p
}

/// Three ledgers of 600–700 tokens whose lines repeat a pattern (so the
/// n-gram drafter finds continuations) with other numbers each.
fn ledgers() -> Vec<String> {
    let names = ["Ada", "Bruno", "Chiara", "Dmitri", "Elif"];
    (0..3)
        .map(|k| {
            let lines: Vec<String> = (0..34 + 3 * k)
                .map(|i| {
                    format!(
                        "Entry {i}: {} paid {} coins for {} lamps.",
                        names[(i + k) % names.len()],
                        (i * 37 + k * 11) % 101,
                        i % 9 + 1
                    )
                })
                .collect();
            format!("{}\nEntry {}:", lines.join("\n"), 34 + 3 * k)
        })
        .collect()
}

/// Gemma 3's sliding windows (15 of 18 layers see the last 512 tokens)
/// through the whole runtime on our store, with prompts longer than the
/// window, so that every path below cuts the windows somewhere new: the
/// same greedy request gives exactly the same tokens alone, chunked
/// otherwise beside others, after a prefix hit, preempted (swapped out or
/// computed again) and with n-gram token trees verified in one batch.
#[test]
fn gemma3_greedy_output_is_exact_through_batching_prefix_hits_preemption_and_trees() {
    exact_through_batching_prefix_hits_preemption_and_trees(gemma(), (15, 512), Drafts::Trees);
}

/// The same for Gemma 4's architecture at test size (`gemma4-mini`:
/// windows of 32 in 4 of 6 layers, heads of two shapes, the last two
/// layers reading earlier layers' KV; random weights), so that swapping,
/// recomputing, copies and token trees all meet layers without KV of their
/// own and pools of two shapes.
#[test]
fn gemma4_greedy_output_is_exact_through_batching_prefix_hits_preemption_and_trees() {
    synthetic_exact(
        siliceo_runtime::synth::Like::Gemma4Mini,
        4,
        Drafts::Accepted,
    );
}

/// The same with every layer of one shape (`gemma4-alike`): one scratch
/// set for all layers, so a block filled and sealed within a step has the
/// rows of the layers between a sharing layer and its source in the
/// scratch when the sharing layer runs (it must write its source's again).
#[test]
fn gemma4_with_layers_of_one_shape_is_exact_through_the_same() {
    synthetic_exact(
        siliceo_runtime::synth::Like::Gemma4Alike,
        4,
        Drafts::Accepted,
    );
}

/// The same for Gemma 3n's architecture at test size (`gemma3n-mini`: 17
/// of 22 layers windowed, the last two reading layers 18 and 19's KV, one
/// scratch set for all; AltUp, per-layer inputs and LAuReL around the
/// attention). Its noise repeats no three tokens of the prompt, so the
/// n-gram drafter drafts nothing (measured) and speculation adds nothing
/// here.
#[test]
fn gemma3n_greedy_output_is_exact_through_the_same() {
    synthetic_exact(siliceo_runtime::synth::Like::Gemma3nMini, 17, Drafts::Any);
}

/// What the n-gram drafter must achieve on a model's text (noise finds
/// fewer continuations than a real model's).
#[derive(Clone, Copy, PartialEq)]
enum Drafts {
    /// Nothing asserted.
    Any,
    /// Some drafted tokens are accepted.
    Accepted,
    /// And some steps verify token trees.
    Trees,
}

/// [`exact_through_batching_prefix_hits_preemption_and_trees`] and
/// [`scores_equal_decoding`] on `synth-model --like like`, whose
/// `windowed` layers have a window of 32.
fn synthetic_exact(like: siliceo_runtime::synth::Like, windowed: usize, drafts: Drafts) {
    let dir = std::env::temp_dir().join(format!(
        "siliceo-det-{}-{}",
        like.geometry().name,
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("model.gguf");
    siliceo_runtime::synth::synth_model(&siliceo_runtime::synth::SynthOptions {
        like: Some(like),
        quant: siliceo_runtime::synth::Quant::Q8_0,
        tokenizer: manifest_dir().join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        out: model.clone(),
        layers: None,
        seed: 7,
        vocab_only: false,
    })
    .unwrap();
    // (Its text is noise: the n-gram drafter finds fewer chains in it, and
    // not several continuations of one n-gram, so no tree is asserted.)
    exact_through_batching_prefix_hits_preemption_and_trees(model.clone(), (windowed, 32), drafts);
    scores_equal_decoding(model);
    std::fs::remove_dir_all(&dir).ok();
}

/// A greedy continuation's log-probabilities, decoded a token per step,
/// equal those of the prompt and continuation scored in 512-token steps,
/// bit for bit. In those steps whole blocks are filled and sealed, so their
/// queries before the seal read rows of the step's scratch: in a model whose
/// last layers read others' KV (and keep none), only tokens whose logits
/// are read (scored ones) see what those layers attend over there.
/// (Measured: with the sharing layers' rewrite of the scratch rows left out,
/// `gemma4-alike`'s first score moves from -9.5743 to -9.6348;
/// `gemma4-mini`'s, a scratch set per shape, does not move.)
fn scores_equal_decoding(model: PathBuf) {
    let mut cfg = config_for(model);
    cfg.scheduler.max_batch_tokens = 512;
    cfg.context.n_batch = 512;
    let rt = Runtime::start(cfg).unwrap();
    let prompt = rt.tokenize(&ledgers()[0], true).unwrap();
    let mut req = greedy("", 48);
    req.input = Input::Tokens(prompt.clone());
    req.logprobs = Some(0);
    let (mut generated, mut decoded) = (Vec::new(), Vec::new());
    let mut s = rt.submit(req).unwrap();
    while let Some(e) = s.blocking_next() {
        if let Event::Text {
            tokens, logprobs, ..
        } = e
        {
            generated.extend(tokens);
            decoded.extend(logprobs);
        }
    }
    assert_eq!((generated.len(), decoded.len()), (48, 48));
    let mut all = prompt.clone();
    all.extend_from_slice(&generated);
    // The continuation's first scores are read at positions of block 9
    // (576-639), which the second step fills and seals.
    assert!(
        (577..=600).contains(&prompt.len()),
        "{} tokens",
        prompt.len()
    );
    let mut score = greedy("", 0);
    score.input = Input::Tokens(all.clone());
    score.prompt_logprobs = Some(0);
    let mut scored = None;
    let mut s = rt.submit(score).unwrap();
    while let Some(e) = s.blocking_next() {
        if let Event::Prompt { logprobs, .. } = e {
            scored = Some(logprobs);
        }
    }
    let scored = scored.expect("a prompt event");
    assert_eq!(scored.len(), all.len() - 1);
    let tail = &scored[scored.len() - generated.len()..];
    for (i, (a, b)) in tail.iter().zip(&decoded).enumerate() {
        assert_eq!(
            (a.token, a.logprob),
            (b.token, b.logprob),
            "continuation token {i}: scored and decoded differ"
        );
    }
    assert_clean(&rt);
}

/// The body of the tests above: `model`'s windows are `windowed.0`
/// layers of `windowed.1` tokens; `drafts`: what its drafter must achieve.
fn exact_through_batching_prefix_hits_preemption_and_trees(
    model: PathBuf,
    windowed: (usize, usize),
    drafts: Drafts,
) {
    let gemma = || model.clone();
    let n = 48;
    let prompts = ledgers();
    // Alone: a fresh runtime per prompt, nothing cached, nothing beside it,
    // every block of every layer kept (`swa_full`). The runs after it keep
    // the windowed layers' blocks in pools of their own where the model's
    // layers are alike (Gemma 3), and must not differ.
    let full = || RuntimeConfig {
        swa_full: true,
        ..config_for(gemma())
    };
    let alone: Vec<Vec<TokenId>> = prompts
        .iter()
        .map(|p| {
            let rt = Runtime::start(full()).unwrap();
            let windows = &rt.info().attention_windows;
            assert_eq!(
                windows.iter().filter(|&&w| w == windowed.1).count(),
                windowed.0
            );
            let (_, tokens, done) = rt.submit(greedy(p, n)).unwrap().blocking_collect();
            let u = usage_of(&done);
            assert!(
                u.prompt_tokens > 560,
                "{u:?}: the prompt crosses the windows"
            );
            assert_eq!(u.cached_prompt_tokens, 0);
            tokens
        })
        .collect();

    // Together, chunked at other places (96-token steps), then again one at
    // a time after their prefixes are cached.
    // (Three running in 8,192 tokens: windowed pools take less than every
    // block in each windowed layer would.)
    let mut cfg = chunked(config_for(gemma()));
    cfg.context.n_ctx = 8192;
    cfg.scheduler.max_running_seqs = 3;
    let rt = Runtime::start(cfg).unwrap();
    assert_eq!(
        rt.info().windowed_pools.is_some(),
        windowed.0 == 15,
        "windowed pools for Gemma 3 (layers alike), none for the others"
    );
    let batched = together(&rt, prompts.iter().map(|p| greedy(p, n)));
    for (i, tokens) in batched.iter().enumerate() {
        assert_eq!(tokens, &alone[i], "prompt {i}: batched output differs");
    }
    for (i, p) in prompts.iter().enumerate() {
        let (_, tokens, done) = rt.submit(greedy(p, n)).unwrap().blocking_collect();
        let u = usage_of(&done);
        assert!(u.cached_prompt_tokens >= 512, "prompt {i}: {u:?}");
        assert_eq!(tokens, alone[i], "prompt {i}: output after a prefix hit");
    }
    assert_clean(&rt);
    drop(rt);

    // A store of 1,536 tokens cannot hold the three at once: the third,
    // more urgent, comes once the first two hold the store, and one of them
    // is preempted and resumed, by swapping its blocks out and back
    // (recompute_below 0, every block kept: windowed pools are recomputed)
    // or by computing it again (usize::MAX).
    let with_priority = |p: &str, priority| GenerateRequest {
        priority,
        ..greedy(p, n)
    };
    for recompute_below in [0usize, usize::MAX] {
        let mut cfg = if recompute_below == 0 {
            full()
        } else {
            config_for(gemma())
        };
        cfg.context.n_ctx = 1536;
        cfg.prefix_caching = false;
        cfg.scheduler.recompute_below_tokens = recompute_below;
        let rt = Runtime::start(cfg).unwrap();
        let mut streams = vec![
            rt.submit(with_priority(&prompts[0], Priority::Batch))
                .unwrap(),
            rt.submit(with_priority(&prompts[1], Priority::Normal))
                .unwrap(),
        ];
        // (Submitted together, the urgent one would be admitted first and
        // nothing preempted.)
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while rt.stats().unwrap().running < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        streams.push(
            rt.submit(with_priority(&prompts[2], Priority::Interactive))
                .unwrap(),
        );
        let preempted: Vec<Vec<TokenId>> = streams
            .into_iter()
            .map(|s| s.blocking_collect().1)
            .collect();
        for (i, tokens) in preempted.iter().enumerate() {
            assert_eq!(
                tokens, &alone[i],
                "prompt {i}, recompute_below {recompute_below}: preempted output differs"
            );
        }
        assert!(
            rt.stats().unwrap().preemptions > 0,
            "recompute_below {recompute_below}: the test must actually preempt"
        );
        assert_clean(&rt);
    }

    // N-gram token trees: drafts verified several tokens to a batch, later
    // branches in branch blocks, windows cutting through them; one at a
    // time, then all three together.
    let mut cfg = config_for(gemma());
    cfg.speculative = Some(SpeculativeConfig {
        tree_width: 3,
        cost_switch_off: false,
        ..Default::default()
    });
    let rt = Runtime::start(cfg).unwrap();
    let speculative = |p: &str| GenerateRequest {
        speculative: true,
        ..greedy(p, n)
    };
    let (mut drafted, mut accepted) = (0, 0);
    for (i, p) in prompts.iter().enumerate() {
        let (_, tokens, done) = rt.submit(speculative(p)).unwrap().blocking_collect();
        drafted += usage_of(&done).draft_tokens;
        accepted += usage_of(&done).accepted_draft_tokens;
        assert_eq!(tokens, alone[i], "prompt {i}: speculated alone");
        rt.check_kv().unwrap();
    }
    let speculated = together(&rt, prompts.iter().map(|p| speculative(p)));
    for (i, tokens) in speculated.iter().enumerate() {
        assert_eq!(tokens, &alone[i], "prompt {i}: speculated together");
    }
    assert!(
        drafts == Drafts::Any || (drafted > 0 && accepted > 0),
        "{accepted} of {drafted} drafted tokens accepted"
    );
    assert!(
        drafts != Drafts::Trees || rt.stats().unwrap().tree_verifications > 0,
        "no token tree"
    );
    assert_clean(&rt);
}
