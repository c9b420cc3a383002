//! The runtime on the real model: batching, preemption and cancellation must
//! not change any greedy output, and nothing may leak.

use std::path::PathBuf;

use siliceo_core::{FinishReason, Priority, SamplingParams, TokenId};
use siliceo_engine::{GreedyTrace, Model, ModelOptions};
use siliceo_runtime::{
    Event, GenerateRequest, Input, KvBackend, Runtime, RuntimeConfig, RuntimeError,
};

mod constrained;
#[cfg(feature = "cuda-emu")]
mod emulated;
mod prompt_logprobs;
mod synthetic;

/// This package's folder in the checkout the tests run in: cargo sets it when
/// it runs a test. A test binary built in another checkout that shares the
/// target directory must not read that checkout's models.
pub fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

fn model_path() -> PathBuf {
    std::env::var_os("SILICEO_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest_dir().join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf"))
}

const PROMPTS: [&str; 8] = [
    "The three primary colours are",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The capital of Japan is",
    "Water boils at",
    "My favourite programming language is",
    "The quick brown fox",
    "In 1969, the first humans",
];

/// Greedy outputs must be identical up to near ties; see
/// [`GreedyTrace`] for why llama.cpp's cell order can flip a near tie and
/// how the check still catches serving bugs. Perturbing attention by one ulp
/// moves this model's logits by up to ~1 (docs/DESIGN facts).
const NEAR_TIE: f32 = 0.5;

fn alone(prompts: &[&str], max_tokens: u32) -> Vec<GreedyTrace> {
    alone_on(&model_path(), prompts, max_tokens)
}

fn alone_on(path: &std::path::Path, prompts: &[&str], max_tokens: u32) -> Vec<GreedyTrace> {
    let model = Model::load(path, &ModelOptions::default()).unwrap();
    prompts
        .iter()
        .map(|p| {
            let toks = model.tokenize(p, true).unwrap();
            GreedyTrace::run(&model, &toks, max_tokens, NEAR_TIE).unwrap()
        })
        .collect()
}

fn assert_same_or_near_tie(got: &[TokenId], want: &GreedyTrace, what: &str) {
    match want.check(got) {
        Ok(None) => {}
        Ok(Some(k)) => eprintln!(
            "{what}: near-tie flip at token {k} (margin {})",
            want.margins[k]
        ),
        Err(e) => panic!("{what}: {e}"),
    }
}

fn request(p: &str, max_tokens: u32, priority: Priority) -> GenerateRequest {
    GenerateRequest {
        sampling: SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..SamplingParams::greedy()
        },
        priority,
        ..GenerateRequest::new(Input::Prompt(p.to_string()))
    }
}

fn assert_clean(rt: &Runtime) {
    let s = rt.stats().unwrap();
    assert_eq!(
        (
            s.waiting,
            s.running,
            s.kv_used_blocks,
            s.seq_ids_in_use,
            s.llama_cells
        ),
        (0, 0, 0, 0, 0),
        "{s:?}"
    );
    rt.check_kv().unwrap();
}

/// `prompts` submitted at once, greedy, each output llama.cpp's up to a
/// near tie; their `Done` events.
fn together(rt: &Runtime, prompts: &[&str], n: u32, expected: &[GreedyTrace]) -> Vec<Event> {
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| rt.submit(request(p, n, Priority::Normal)).unwrap())
        .collect();
    streams
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let (_, tokens, done) = s.blocking_collect();
            assert_same_or_near_tie(&tokens, &expected[i], &format!("together, {i}"));
            done
        })
        .collect()
}

#[test]
fn eight_concurrent_requests_equal_their_solo_runs() {
    let n = 24;
    let expected = alone(&PROMPTS, n);
    let rt = Runtime::start(RuntimeConfig::new(model_path())).unwrap();
    for done in together(&rt, &PROMPTS, n, &expected) {
        let Event::Done {
            finish_reason,
            usage,
            ..
        } = done
        else {
            unreachable!()
        };
        assert_eq!(finish_reason, FinishReason::Length);
        assert_eq!(usage.completion_tokens, n);
    }
    assert_clean(&rt);
}

#[test]
fn preempted_and_resumed_requests_keep_their_output() {
    let n = 40;
    let expected = alone(&PROMPTS, n);
    for recompute_below in [0usize, usize::MAX] {
        let mut cfg = RuntimeConfig::new(model_path());
        // A tiny cache: 8 sequences of ~50 tokens cannot all fit in 256 cells.
        cfg.context.n_ctx = 256;
        cfg.block_size = 16;
        cfg.scheduler.recompute_below_tokens = recompute_below;
        let rt = Runtime::start(cfg).unwrap();
        let streams: Vec<_> = PROMPTS
            .iter()
            .enumerate()
            .map(|(i, p)| {
                rt.submit(request(
                    p,
                    n,
                    if i % 2 == 0 {
                        Priority::Batch
                    } else {
                        Priority::Interactive
                    },
                ))
                .unwrap()
            })
            .collect();
        for (i, s) in streams.into_iter().enumerate() {
            let (_, tokens, _) = s.blocking_collect();
            assert_same_or_near_tie(
                &tokens,
                &expected[i],
                &format!("prompt {i}, recompute_below {recompute_below}"),
            );
        }
        assert!(
            rt.stats().unwrap().preemptions > 0,
            "the test must actually preempt"
        );
        assert_clean(&rt);
    }
}

#[test]
fn dropping_a_stream_cancels_and_frees_at_once() {
    let rt = Runtime::start(RuntimeConfig::new(model_path())).unwrap();
    let keep = rt
        .submit(request(PROMPTS[0], 30, Priority::Normal))
        .unwrap();
    let mut gone = rt
        .submit(request(PROMPTS[1], 10_000, Priority::Normal))
        .unwrap();
    // Wait until it produces something, then drop it mid-stream.
    assert!(matches!(gone.blocking_next(), Some(Event::Text { .. })));
    drop(gone);
    let (_, tokens, _) = keep.blocking_collect();
    assert_same_or_near_tie(&tokens, &alone(&PROMPTS[..1], 30)[0], "kept request");
    assert_clean(&rt);
    // Both counted: the one that ended and the one whose client left.
    let text = rt.prometheus();
    for reason in ["length", "cancelled"] {
        let line = format!("siliceo_requests_finished_total{{reason=\"{reason}\"}} 1\n");
        assert!(text.contains(&line), "no `{line}` in\n{text}");
    }
}

#[test]
fn bad_requests_get_typed_errors_and_the_runtime_keeps_serving() {
    let rt = Runtime::start(RuntimeConfig::new(model_path())).unwrap();
    // The request layer refuses these on the submitting thread.
    let err_of = |req: GenerateRequest| match rt.submit(req) {
        Err(e) => e,
        Ok(s) => panic!("expected an error, got {:?}", s.blocking_collect().2),
    };
    let field = |e: RuntimeError| match e {
        RuntimeError::InvalidRequest { field, .. } => field,
        other => panic!("expected InvalidRequest, got {other:?}"),
    };
    assert_eq!(
        field(err_of(GenerateRequest::new(Input::Prompt(String::new())))),
        "prompt"
    );
    assert_eq!(
        field(err_of(GenerateRequest::new(Input::Tokens(vec![TokenId(
            999_999
        )])))),
        "tokens"
    );
    assert_eq!(
        field(err_of(GenerateRequest::new(Input::Prompt(
            "word ".repeat(5000)
        )))),
        "prompt"
    );
    let mut bad = request("hi", 5, Priority::Normal);
    bad.sampling.top_p = 0.0;
    assert_eq!(field(err_of(bad)), "top_p");
    // A max_tokens the client set must fit beside the prompt; a default is
    // cut to what the context leaves.
    let n_ctx = rt.n_ctx();
    let mut long = request("hi", n_ctx, Priority::Normal);
    long.max_tokens_field = Some("max_completion_tokens");
    match err_of(long) {
        RuntimeError::ContextLengthExceeded {
            field,
            max_tokens,
            n_ctx: n,
            ..
        } => assert_eq!(
            (field, max_tokens, n),
            ("max_completion_tokens", n_ctx, n_ctx)
        ),
        other => panic!("expected ContextLengthExceeded, got {other:?}"),
    }
    let mut fits = request("hi", 3, Priority::Normal);
    fits.max_tokens_field = Some("max_tokens");
    let (_, tokens, _) = rt.submit(fits).unwrap().blocking_collect();
    assert_eq!(tokens.len(), 3);
    // Still serving.
    let (text, _, _) = rt
        .submit(request("The capital of France is", 8, Priority::Normal))
        .unwrap()
        .blocking_collect();
    assert!(!text.is_empty());
    assert_clean(&rt);
}

#[test]
fn stop_strings_and_eos_end_with_stop() {
    let rt = Runtime::start(RuntimeConfig::new(model_path())).unwrap();
    let mut req = request("1, 2, 3, 4, 5,", 30, Priority::Normal);
    req.sampling.stop = vec!["never".into(), "8".into()];
    let (text, _, done) = rt.submit(req).unwrap().blocking_collect();
    assert!(text.contains('7') && !text.contains('8'), "{text}");
    // The stop string that ended it is reported.
    assert!(
        matches!(
            &done,
            Event::Done {
                finish_reason: FinishReason::Stop,
                stop: Some(s),
                ..
            } if s == "8"
        ),
        "{done:?}"
    );
    // Ended by a length limit: none.
    let mut req = request("1, 2, 3, 4, 5,", 3, Priority::Normal);
    req.sampling.stop = vec!["never".into()];
    let (_, _, done) = rt.submit(req).unwrap().blocking_collect();
    assert!(
        matches!(
            done,
            Event::Done {
                finish_reason: FinishReason::Length,
                stop: None,
                ..
            }
        ),
        "{done:?}"
    );
    assert_clean(&rt);
}

#[test]
fn thirty_two_mixed_requests_on_a_small_cache_complete_without_leaks() {
    let mut cfg = RuntimeConfig::new(model_path());
    cfg.context.n_ctx = 512;
    cfg.block_size = 16;
    cfg.scheduler.max_running_seqs = 6;
    cfg.scheduler.max_batch_tokens = 64;
    let rt = Runtime::start(cfg).unwrap();
    let classes = [Priority::Interactive, Priority::Normal, Priority::Batch];
    let streams: Vec<_> = (0..32)
        .map(|i| {
            let p = PROMPTS[i % PROMPTS.len()].repeat(1 + i % 4);
            let mut r = request(&p, 8 + (i as u32 * 7) % 40, classes[i % 3]);
            r.sampling.ignore_eos = i % 2 == 0;
            rt.submit(r).unwrap()
        })
        .collect();
    for s in streams {
        let (_, tokens, done) = s.blocking_collect();
        let Event::Done {
            finish_reason,
            usage,
            error,
            ..
        } = done
        else {
            unreachable!()
        };
        assert!(error.is_none(), "{error:?}");
        assert!(matches!(
            finish_reason,
            FinishReason::Length | FinishReason::Stop
        ));
        assert_eq!(usage.completion_tokens as usize, tokens.len());
        assert!(usage.ttft_ms >= usage.queue_ms);
    }
    assert_clean(&rt);
}

/// A shared prefix of more than three 64-token blocks.
const SYSTEM: &str = "You are a careful assistant for a small hardware shop. The shop sells \
    screws, nails, hinges, brackets, hand tools, paint, brushes, garden hoses and seeds. \
    Opening hours are nine to six on weekdays and ten to four on Saturdays; the shop is \
    closed on Sundays and public holidays. Deliveries within the town are free above \
    fifty euros. Returns are accepted within thirty days with a receipt. Answer in one \
    or two short sentences, politely, and never invent products the shop does not sell. \
    If a customer asks about something outside the shop, suggest they ask at the town \
    hall information desk instead. The shop was founded in 1962 by two brothers who \
    repaired bicycles; today it is run by their granddaughter, who also teaches a free \
    workshop on simple home repairs every first Saturday of the month. Gift vouchers \
    are available in any amount. Payment by card, cash or bank transfer is accepted, \
    but not by cheque.";

fn usage_of(done: &Event) -> siliceo_runtime::Usage {
    match done {
        Event::Done { usage, error, .. } => {
            assert!(error.is_none(), "{error:?}");
            *usage
        }
        other => panic!("not a Done event: {other:?}"),
    }
}

#[test]
fn prefix_cache_hits_keep_greedy_outputs() {
    prefix_cache_hits(KvBackend::default());
}

#[test]
fn prefix_cache_hits_keep_greedy_outputs_on_llama_cpp_cells() {
    prefix_cache_hits(KvBackend::Llama);
}

fn prefix_cache_hits(backend: KvBackend) {
    let ours = backend != KvBackend::Llama;
    let n = 16;
    let questions = [
        " Question: do you sell paint?",
        " Question: are you open on Sunday?",
        " Question: can I return a hammer?",
        " Question: do you deliver?",
    ];
    let prompts: Vec<String> = questions.iter().map(|q| format!("{SYSTEM}{q}")).collect();
    let refs: Vec<&str> = prompts.iter().map(String::as_str).collect();
    let expected = alone(&refs, n);
    let mut cfg = RuntimeConfig::new(model_path());
    cfg.kv = backend;
    let rt = Runtime::start(cfg).unwrap();
    let prompt_len = rt
        .submit(request(&prompts[0], n, Priority::Normal))
        .unwrap()
        .blocking_collect();
    let cold = usage_of(&prompt_len.2);
    assert_eq!(cold.cached_prompt_tokens, 0, "nothing cached yet");
    assert!(
        cold.prompt_tokens > 200,
        "the prefix must span blocks: {cold:?}"
    );
    assert_same_or_near_tie(&prompt_len.1, &expected[0], "cold");
    rt.check_kv().unwrap();
    let s = rt.stats().unwrap();
    if ours {
        assert!(s.kv_cached_blocks > 0, "its blocks outlive it: {s:?}");
    } else {
        assert!(s.held_blocks > 0, "its blocks outlive it: {s:?}");
    }

    // The same prompt again, alone: served from the cache — on our store all
    // of it but the last token (the partial last block is cached too), and
    // the same output bit for bit.
    let (_, tokens, done) = rt
        .submit(request(&prompts[0], n, Priority::Normal))
        .unwrap()
        .blocking_collect();
    let warm = usage_of(&done);
    if ours {
        assert_eq!(warm.cached_prompt_tokens, cold.prompt_tokens - 1);
        assert_eq!(tokens, prompt_len.1, "a warm prefix changed the output");
    } else {
        let full_blocks = (cold.prompt_tokens - 1) / 64 * 64;
        assert_eq!(warm.cached_prompt_tokens, full_blocks);
    }
    assert_same_or_near_tie(&tokens, &expected[0], "warm, same prompt");

    // All four at once: each reuses the shared blocks.
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| rt.submit(request(p, n, Priority::Normal)).unwrap())
        .collect();
    for (i, s) in streams.into_iter().enumerate() {
        let (_, tokens, done) = s.blocking_collect();
        let u = usage_of(&done);
        assert!(
            u.cached_prompt_tokens >= 192,
            "question {i} reused only {} tokens",
            u.cached_prompt_tokens
        );
        assert_same_or_near_tie(&tokens, &expected[i], &format!("warm, question {i}"));
    }
    let s = rt.stats().unwrap();
    assert!(s.prefix_hit_tokens >= 5 * 192, "{s:?}");
    assert_clean(&rt);
}

#[test]
fn cached_blocks_give_way_and_llama_has_the_cells_the_blocks_promise() {
    // 512 cells in 16-token blocks: 31 blocks for requests and cache.
    let mut cfg = RuntimeConfig::new(model_path());
    cfg.kv = KvBackend::Llama;
    cfg.context.n_ctx = 512;
    cfg.block_size = 16;
    let rt = Runtime::start(cfg).unwrap();
    // Fill the cache with the prefixes of finished requests.
    for p in PROMPTS {
        let (_, _, done) = rt
            .submit(request(&p.repeat(6), 8, Priority::Normal))
            .unwrap()
            .blocking_collect();
        usage_of(&done);
        rt.check_kv().unwrap();
    }
    let before = rt.stats().unwrap();
    assert!(before.kv_cached_blocks > 10, "{before:?}");
    assert_eq!(before.kv_cached_blocks, before.held_blocks);
    // A request that needs nearly every block: kv-paging evicts cached ones,
    // and llama.cpp must really have the cells for it (a mismatch would fail
    // the decode with a full KV cache).
    let long = "Counting sheep, one after another, slowly. ".repeat(45);
    let (_, tokens, done) = rt
        .submit(request(&long, 40, Priority::Normal))
        .unwrap()
        .blocking_collect();
    let u = usage_of(&done);
    assert!(u.prompt_tokens > 400, "{u:?}");
    assert_eq!(tokens.len(), 40);
    let after = rt.stats().unwrap();
    assert!(
        after.prefix_evictions > before.prefix_evictions,
        "{after:?}"
    );
    assert_clean(&rt);
}

#[test]
fn cached_blocks_give_way_on_our_store_and_its_bytes_are_reused() {
    // 512 tokens of sealed 16-token blocks: 32 for requests and cache.
    let mut cfg = RuntimeConfig::new(model_path());
    cfg.context.n_ctx = 512;
    cfg.block_size = 16;
    let rt = Runtime::start(cfg).unwrap();
    let info = rt.info().clone();
    let store = info.store.expect("our store");
    assert_eq!(store.sealed_blocks, 32);
    for p in PROMPTS {
        let (_, _, done) = rt
            .submit(request(&p.repeat(6), 8, Priority::Normal))
            .unwrap()
            .blocking_collect();
        usage_of(&done);
        rt.check_kv().unwrap();
    }
    let before = rt.stats().unwrap();
    assert!(before.kv_cached_blocks > 10, "{before:?}");
    assert_eq!(before.kv_used_bytes, 0, "{before:?}");
    // A request that needs nearly every sealed block evicts cached ones; its
    // output is the same as on a fresh runtime.
    let long = "Counting sheep, one after another, slowly. ".repeat(45);
    let (_, tokens, done) = rt
        .submit(request(&long, 40, Priority::Normal))
        .unwrap()
        .blocking_collect();
    let u = usage_of(&done);
    assert!(u.prompt_tokens > 400, "{u:?}");
    let after = rt.stats().unwrap();
    assert!(
        after.prefix_evictions > before.prefix_evictions,
        "{after:?}"
    );
    assert_clean(&rt);
    drop(rt);
    let mut cfg = RuntimeConfig::new(model_path());
    cfg.context.n_ctx = 512;
    cfg.block_size = 16;
    let fresh = Runtime::start(cfg).unwrap();
    let (_, alone, _) = fresh
        .submit(request(&long, 40, Priority::Normal))
        .unwrap()
        .blocking_collect();
    assert_eq!(
        tokens, alone,
        "evicted blocks' old bytes leaked into a request"
    );
}

/// Our kernel fails in the middle of llama.cpp's forward pass (a fault
/// injected into one request's view of its blocks): the step's requests end
/// with an error, their blocks are freed, nothing computed in that step is
/// cached, and the engine keeps serving correctly.
#[test]
fn attention_failing_inside_a_decode_frees_the_step_and_keeps_serving() {
    let rt = Runtime::start(RuntimeConfig::new(model_path())).unwrap();
    let want = alone(&PROMPTS[2..3], 12);
    let mut bad = request(&format!("{SYSTEM}{}", PROMPTS[1]), 8, Priority::Normal);
    bad.id = Some(siliceo_core::RequestId::from("siliceo-fault-attention-1"));
    let (_, _, done) = rt.submit(bad).unwrap().blocking_collect();
    match &done {
        Event::Done {
            finish_reason: FinishReason::Error,
            error: Some(RuntimeError::Engine(m)),
            ..
        } => assert!(m.contains("grafted attention"), "{m}"),
        other => panic!("{other:?}"),
    }
    let s = rt.stats().unwrap();
    assert_eq!(
        (s.kv_used_blocks, s.kv_cached_blocks, s.llama_cells),
        (0, 0, 0),
        "{s:?}"
    );
    let (_, tokens, _) = rt
        .submit(request(PROMPTS[2], 12, Priority::Normal))
        .unwrap()
        .blocking_collect();
    assert_same_or_near_tie(&tokens, &want[0], "after the failure");
    assert_clean(&rt);
}

#[test]
fn a_panicking_step_fails_its_requests_and_the_engine_keeps_serving() {
    let rt = Runtime::start(RuntimeConfig::new(model_path())).unwrap();
    let bystander = rt
        .submit(request(PROMPTS[0], 10_000, Priority::Normal))
        .unwrap();
    let mut bad = request(PROMPTS[1], 8, Priority::Normal);
    bad.id = Some(siliceo_core::RequestId::from("siliceo-fault-panic-1"));
    let (_, _, done) = rt.submit(bad).unwrap().blocking_collect();
    assert!(
        matches!(
            done,
            Event::Done {
                finish_reason: FinishReason::Error,
                error: Some(RuntimeError::Engine(_)),
                ..
            }
        ),
        "{done:?}"
    );
    // Everything in flight in that step failed too, with a clear error.
    let (_, _, done) = bystander.blocking_collect();
    assert!(
        matches!(
            done,
            Event::Done {
                finish_reason: FinishReason::Error,
                ..
            }
        ),
        "{done:?}"
    );
    assert_eq!(rt.stats().unwrap().panics, 1);
    // Still serving, correctly, and nothing leaked.
    let (_, tokens, _) = rt
        .submit(request(PROMPTS[3], 12, Priority::Normal))
        .unwrap()
        .blocking_collect();
    assert_same_or_near_tie(&tokens, &alone(&PROMPTS[3..4], 12)[0], "after the panic");
    assert_clean(&rt);
}

const REPETITIVE: [&str; 3] = [
    "Repeat the line five times.\nThe cat sat on the mat.\nThe cat sat on the mat.\nThe cat sat on the mat.\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
];

fn speculative_request(p: &str, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        speculative: true,
        ..request(p, max_tokens, Priority::Normal)
    }
}

/// Runs `prompts` with speculation one at a time (checking KV after each),
/// then all together; every greedy output must match its solo reference.
/// Returns (drafted, accepted) over the one-at-a-time runs.
fn speculate_alone_and_together(
    rt: &Runtime,
    prompts: &[&str],
    expected: &[GreedyTrace],
    n: u32,
    what: &str,
) -> (u32, u32) {
    let usages = speculate_and_check(rt, prompts, n, what, |i, tokens, what| {
        assert_same_or_near_tie(tokens, &expected[i], what)
    });
    let drafted = usages.iter().map(|u| u.draft_tokens).sum::<u32>();
    let accepted = usages.iter().map(|u| u.accepted_draft_tokens).sum::<u32>();
    eprintln!("{what}: {accepted} of {drafted} drafted tokens accepted");
    (drafted, accepted)
}

/// Runs `prompts` with speculation one at a time (checking KV after each),
/// then all together, each output through `check(prompt index, tokens,
/// label)`. Returns the one-at-a-time runs' usage.
fn speculate_and_check(
    rt: &Runtime,
    prompts: &[&str],
    n: u32,
    what: &str,
    check: impl Fn(usize, &[TokenId], &str),
) -> Vec<siliceo_runtime::Usage> {
    let mut usages = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let (_, tokens, done) = rt
            .submit(speculative_request(p, n))
            .unwrap()
            .blocking_collect();
        let u = usage_of(&done);
        assert_eq!(u.completion_tokens, n);
        check(i, &tokens, &format!("{what}, alone, {i}"));
        // Rollback leaves no stray cells in the target's (or draft's) KV.
        rt.check_kv().unwrap();
        usages.push(u);
    }
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| rt.submit(speculative_request(p, n)).unwrap())
        .collect();
    for (i, s) in streams.into_iter().enumerate() {
        let (_, tokens, done) = s.blocking_collect();
        usage_of(&done);
        check(i, &tokens, &format!("{what}, together, {i}"));
    }
    usages
}

#[test]
fn ngram_speculation_keeps_greedy_outputs_and_leaves_no_stray_cells() {
    let n = 32;
    let expected = alone(&REPETITIVE, n);
    let mut cfg = RuntimeConfig::new(model_path());
    cfg.speculative = Some(siliceo_runtime::SpeculativeConfig {
        // Draft every step this test runs, whatever it costs on this machine.
        cost_switch_off: false,
        ..Default::default()
    });
    let rt = Runtime::start(cfg).unwrap();
    // 3 requests together stay below the default max_batch of 4.
    let (drafted, accepted) =
        speculate_alone_and_together(&rt, &REPETITIVE, &expected, n, "n-gram");
    assert!(
        drafted > 0 && accepted > 0,
        "drafted {drafted}, accepted {accepted}"
    );
    // Sampling with speculation runs to the end with drafts verified by
    // rejection sampling (its distribution is tested in the speculative crate).
    let mut sampled = speculative_request(REPETITIVE[1], n);
    sampled.sampling.temperature = 0.8;
    sampled.sampling.seed = Some(3);
    let (_, tokens, done) = rt.submit(sampled).unwrap().blocking_collect();
    assert_eq!(tokens.len(), n as usize);
    assert!(usage_of(&done).draft_tokens > 0);
    assert_clean(&rt);
}

#[test]
fn draft_model_speculation_keeps_greedy_outputs_of_the_target_in_both_models_kv() {
    let prompts = [
        "def fibonacci(n):\n",
        "# Print the numbers from 1 to 10 in Python\n",
    ];
    let n = 24;
    let (rt, expected) = qwen_pair(&prompts, n, 1);
    let (drafted, accepted) =
        speculate_alone_and_together(&rt, &prompts, &expected, n, "draft model");
    assert!(
        drafted > 0 && accepted > 0,
        "drafted {drafted}, accepted {accepted}"
    );
    assert_clean(&rt);
}

#[test]
fn cost_aware_speculation_keeps_greedy_outputs() {
    // The default: plain steps first (the cost baseline), drafting that costs
    // more per token than it saves pauses itself. Whatever this machine's
    // timings decide, outputs stay the target's and the KV stays clean; the
    // decision itself is tested with synthetic timings in the speculative crate.
    let n = 40;
    let expected = alone(&REPETITIVE, n);
    let mut cfg = RuntimeConfig::new(model_path());
    cfg.speculative = Some(siliceo_runtime::SpeculativeConfig::default());
    let rt = Runtime::start(cfg).unwrap();
    let (drafted, _) = speculate_alone_and_together(&rt, &REPETITIVE, &expected, n, "cost-aware");
    assert!(
        drafted > 0,
        "it must probe drafting after the plain baseline"
    );
    let s = rt.stats().unwrap();
    eprintln!("cost pauses: {}", s.spec_cost_pauses);
    assert_clean(&rt);
}

#[test]
fn cost_aware_draft_model_keeps_greedy_outputs_across_requests() {
    // The default with a draft model: drafting that costs more than it saves
    // pauses, and later requests remember it (they start paused; see
    // `DraftCostMemory`, tested with synthetic timings in the speculative
    // crate). Whatever this machine's timings decide, every request's output
    // stays the target's and both models' KV stay clean.
    let prompts = [
        "def fibonacci(n):\n",
        "# Print the numbers from 1 to 10 in Python\n",
        "class Stack:\n",
    ];
    let n = 24;
    let target = qwen("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    let expected = alone_on(&target, &prompts, n);
    let mut cfg = RuntimeConfig::new(&target);
    cfg.context.n_ctx = 1024;
    cfg.speculative = Some(siliceo_runtime::SpeculativeConfig {
        draft_model: Some(qwen("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")),
        ..Default::default()
    });
    let rt = Runtime::start(cfg).unwrap();
    speculate_alone_and_together(&rt, &prompts, &expected, n, "cost-aware draft model");
    eprintln!("cost pauses: {}", rt.stats().unwrap().spec_cost_pauses);
    assert_clean(&rt);
}

#[test]
fn an_incompatible_draft_model_is_refused_at_start() {
    let mut cfg = RuntimeConfig::new(model_path());
    cfg.speculative = Some(siliceo_runtime::SpeculativeConfig {
        draft_model: Some(qwen("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")),
        ..Default::default()
    });
    match Runtime::start(cfg) {
        Err(RuntimeError::Start(m)) => assert!(m.contains("vocabulary"), "{m}"),
        other => panic!("expected a start error, got {other:?}"),
    }
}

#[test]
fn ngram_token_trees_keep_greedy_outputs_and_free_their_branch_sequences() {
    // Continuations of "the" differ earlier in the prompt: the drafter
    // proposes several branches, verified as a tree in one batch.
    let prompts = [
        "the cat sat. the dog ran. the cat ran. the dog sat. the cat sat. the dog ran. the",
        "a = 1\nb = 2\na = 3\nb = 4\na = 1\nb = 2\na =",
    ];
    let n = 24;
    let expected = alone(&prompts, n);
    // On llama.cpp's cells: a temporary sequence id per later branch.
    let mut cfg = RuntimeConfig::new(model_path());
    cfg.kv = KvBackend::Llama;
    cfg.speculative = Some(siliceo_runtime::SpeculativeConfig {
        tree_width: 3,
        cost_switch_off: false,
        ..Default::default()
    });
    let rt = Runtime::start(cfg).unwrap();
    let (drafted, _) = speculate_alone_and_together(&rt, &prompts, &expected, n, "n-gram tree");
    let trees = rt.stats().unwrap().tree_verifications;
    assert!(
        drafted > 0 && trees > 0,
        "the drafter must have proposed several branches"
    );
    assert_clean(&rt);
}

/// On our store a greedy request's tokens do not depend on what else a step
/// computes, so token trees must give exactly the tokens of plain decoding:
/// a later branch sees the request's rows up to its decode token (copied
/// into its branch block) and, when kept, its rows are copied back into the
/// request's blocks — any row out of place changes what follows.
#[test]
fn ngram_token_trees_on_our_store_give_exactly_the_plain_tokens() {
    let prompts = [
        "the cat sat. the dog ran. the cat ran. the dog sat. the cat sat. the dog ran. the",
        "a = 1\nb = 2\na = 3\nb = 4\na = 1\nb = 2\na =",
    ];
    // Past the first block boundary (prompts of 30–40 tokens): branches
    // straddle it and start after it.
    let n = 64;
    let plain_rt = Runtime::start(RuntimeConfig::new(model_path())).unwrap();
    let plain: Vec<Vec<TokenId>> = prompts
        .iter()
        .map(|p| {
            let (_, tokens, _) = plain_rt
                .submit(request(p, n, Priority::Normal))
                .unwrap()
                .blocking_collect();
            tokens
        })
        .collect();
    drop(plain_rt);
    let mut cfg = RuntimeConfig::new(model_path());
    cfg.speculative = Some(siliceo_runtime::SpeculativeConfig {
        tree_width: 3,
        cost_switch_off: false,
        ..Default::default()
    });
    let rt = Runtime::start(cfg).unwrap();
    let usages = speculate_and_check(&rt, &prompts, n, "tree", |i, tokens, what| {
        assert_eq!(tokens, plain[i], "{what}")
    });
    assert!(usages.iter().all(|u| u.accepted_draft_tokens > 0));
    let s = rt.stats().unwrap();
    eprintln!(
        "trees: {} verified, {} kept a later branch",
        s.tree_verifications, s.tree_later_branches_kept
    );
    assert!(s.tree_verifications > 0, "no token tree was verified");
    assert!(
        s.tree_later_branches_kept > 0,
        "no later branch was kept: its rows never moved into a request's blocks"
    );
    assert_eq!(s.llama_cells, 0);
    assert_clean(&rt);
}

/// On our store (the default), the draft model's top-2 trees: its second
/// branch is in a temporary sequence of the draft's context only.
#[test]
fn draft_model_token_trees_keep_greedy_outputs_in_both_models_kv() {
    let prompts = ["def is_even(n):\n", "Write a haiku about the sea.\n"];
    let n = 20;
    let (rt, expected) = qwen_pair(&prompts, n, 2);
    speculate_alone_and_together(&rt, &prompts, &expected, n, "draft tree");
    let trees = rt.stats().unwrap().tree_verifications;
    assert!(
        trees > 0,
        "the draft model's top-2 trees must have been verified"
    );
    assert_clean(&rt);
}

/// The Qwen2.5-Coder 1.5B target with the 0.5B draft (trees of `tree_width`
/// branches; drafting every step, not switched off by its cost on this CPU),
/// and the target's solo greedy references for `prompts`.
fn qwen_pair(prompts: &[&str], n: u32, tree_width: usize) -> (Runtime, Vec<GreedyTrace>) {
    let target = qwen("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    let expected = alone_on(&target, prompts, n);
    let mut cfg = RuntimeConfig::new(&target);
    cfg.context.n_ctx = 1024;
    cfg.speculative = Some(siliceo_runtime::SpeculativeConfig {
        draft_model: Some(qwen("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")),
        tree_width,
        cost_switch_off: false,
        ..Default::default()
    });
    (Runtime::start(cfg).unwrap(), expected)
}

fn qwen(file: &str) -> PathBuf {
    let p = manifest_dir().join("../../models").join(file);
    assert!(
        p.is_file(),
        "{} is missing: run `cargo xtask fetch-model --spec`",
        p.display()
    );
    p
}

/// Prompts of 80–200 tokens: their blocks are sealed (KV8 seals a block as
/// soon as it is full) and their last blocks are partial.
fn long_prompts() -> Vec<String> {
    PROMPTS
        .iter()
        .enumerate()
        .map(|(i, p)| format!("{p} {SYSTEM}").chars().take(400 + 60 * i).collect())
        .collect()
}

/// The same greedy request gives identical tokens — no near-tie allowance —
/// alone, in a batch of eight distinct requests, and again once its prefix
/// is cached: a query's attention on our store does not depend on what else
/// a step holds, how the prompt was chunked, or where its prefix came from.
#[test]
fn greedy_output_is_batch_invariant_on_our_store() {
    let n = 48;
    let prompts = long_prompts();
    let alone: Vec<Vec<TokenId>> = prompts
        .iter()
        .map(|p| {
            // A fresh runtime per prompt: nothing cached, nothing beside it.
            let rt = Runtime::start(RuntimeConfig::new(model_path())).unwrap();
            let (_, tokens, done) = rt
                .submit(request(p, n, Priority::Normal))
                .unwrap()
                .blocking_collect();
            assert_eq!(usage_of(&done).cached_prompt_tokens, 0);
            tokens
        })
        .collect();
    // Prompts are chunked differently in a batch: a small step budget cuts
    // them at other places than alone.
    let mut cfg = RuntimeConfig::new(model_path());
    cfg.scheduler.max_batch_tokens = 96;
    cfg.context.n_batch = 96;
    let rt = Runtime::start(cfg).unwrap();
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| rt.submit(request(p, n, Priority::Normal)).unwrap())
        .collect();
    for (i, s) in streams.into_iter().enumerate() {
        let (_, tokens, _) = s.blocking_collect();
        assert_eq!(tokens, alone[i], "prompt {i}: batched output differs");
    }
    // Again, one at a time: each prompt's full blocks are in the cache (its
    // partial last block too, unless other requests' open blocks evicted it).
    for (i, p) in prompts.iter().enumerate() {
        let (_, tokens, done) = rt
            .submit(request(p, n, Priority::Normal))
            .unwrap()
            .blocking_collect();
        let u = usage_of(&done);
        assert!(
            u.cached_prompt_tokens >= (u.prompt_tokens - 1) / 64 * 64,
            "prompt {i}: {u:?}"
        );
        assert_eq!(
            tokens, alone[i],
            "prompt {i}: output after a prefix hit differs"
        );
    }
    assert_clean(&rt);
}

/// Our f16 store against llama.cpp's own f16 cache: the same greedy tokens,
/// alone and sixteen at once, up to a near tie (llama.cpp's flash attention
/// rounds V in f16; ours sums in f32).
#[test]
fn ours_f16_serves_what_llama_cpp_serves() {
    let n = 24;
    let expected = alone(&PROMPTS, n);
    let mut cfg = RuntimeConfig::new(model_path());
    cfg.kv = KvBackend::Ours {
        format: siliceo_engine::KvFormat::parse("f16").unwrap(),
        size: None,
        kernel_threads: None,
    };
    cfg.scheduler.max_running_seqs = 16;
    let rt = Runtime::start(cfg).unwrap();
    assert_eq!(rt.info().kv_format, "f16:f16");
    let streams: Vec<_> = PROMPTS
        .iter()
        .chain(PROMPTS.iter())
        .map(|p| rt.submit(request(p, n, Priority::Normal)).unwrap())
        .collect();
    for (i, s) in streams.into_iter().enumerate() {
        let (_, tokens, _) = s.blocking_collect();
        assert_same_or_near_tie(&tokens, &expected[i % 8], &format!("request {i}"));
    }
    assert_clean(&rt);
}

/// Requests sharing a prefix hold its blocks once: while four of them run,
/// the store's referenced bytes are the prefix's blocks once plus each
/// request's own, and the shared blocks are counted; cancelling them frees
/// everything.
#[test]
fn a_shared_prefix_is_held_once_in_the_store() {
    let rt = Runtime::start(RuntimeConfig::new(model_path())).unwrap();
    let info = rt.info().clone();
    let store = info.store.unwrap();
    let prefix = format!("{SYSTEM}{SYSTEM}");
    // Warm the cache with the prefix alone.
    let (_, _, done) = rt
        .submit(request(&prefix, 1, Priority::Normal))
        .unwrap()
        .blocking_collect();
    let prefix_tokens = usage_of(&done).prompt_tokens as u64;
    let prefix_blocks = prefix_tokens / 64;
    assert!(prefix_blocks >= 6, "{prefix_tokens}");
    let mut streams: Vec<_> = (0..4)
        .map(|i| {
            let p = format!("{prefix} Question {i}: what time do you open?");
            rt.submit(request(&p, 10_000, Priority::Normal)).unwrap()
        })
        .collect();
    // Wait until all four generate.
    for s in &mut streams {
        assert!(matches!(s.blocking_next(), Some(Event::Text { .. })));
    }
    let st = rt.stats().unwrap();
    assert_eq!(st.running, 4);
    assert!(
        st.kv_shared_blocks as u64 >= prefix_blocks,
        "{prefix_blocks} prefix blocks, {} shared: {st:?}",
        st.kv_shared_blocks
    );
    // Each request's own blocks: at most two sealed (its suffix crosses one
    // block boundary) and two open (its partial block, a copy).
    let once = prefix_blocks * store.sealed_block_bytes;
    let own = 4 * (2 * store.sealed_block_bytes + 2 * store.open_block_bytes);
    assert!(
        st.kv_used_bytes <= once + own,
        "{} bytes used, the prefix once is {once}: {st:?}",
        st.kv_used_bytes
    );
    assert!(st.kv_used_bytes >= once, "{st:?}");
    drop(streams);
    // Dropped streams cancel; their blocks are free at once.
    let st = rt.stats().unwrap();
    assert_eq!(
        (st.running, st.kv_used_blocks, st.kv_used_bytes),
        (0, 0, 0),
        "{st:?}"
    );
    assert_clean(&rt);
}

/// Qwen2.5's large K biases defeat llama.cpp's quantized K (q5_1/q4_0:
/// perplexity ×200, docs/KV_QUALITY.md); in our K5/V4 with an F16 tail the
/// 1.5B coder writes the code its f16 cache writes.
#[test]
fn qwen_serves_coherent_code_from_k5v4_with_a_tail() {
    let prompts = [
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "# Python: read a CSV file and print the sum of its second column\nimport csv\n\n",
    ];
    let n = 32;
    let target = qwen("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    let expected = alone_on(&target, &prompts, n);
    let mut cfg = RuntimeConfig::new(&target);
    cfg.context.n_ctx = 1024;
    cfg.kv = KvBackend::Ours {
        format: siliceo_engine::KvFormat::parse("k5v4+tail64").unwrap(),
        size: None,
        kernel_threads: None,
    };
    let rt = Runtime::start(cfg).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let (text, tokens, done) = rt
            .submit(request(p, n, Priority::Normal))
            .unwrap()
            .blocking_collect();
        usage_of(&done);
        eprintln!("k5v4+tail64, prompt {i}:\n{p}{text}");
        // Where ours parts from llama.cpp's f16 cache, it is at a near tie.
        assert_same_or_near_tie(&tokens, &expected[i], &format!("prompt {i}"));
        let want: &[&str] = [&["if n", "return"][..], &["open(", "csv.reader"][..]][i];
        for w in want {
            assert!(text.contains(w), "prompt {i}: no `{w}` in\n{text}");
        }
    }
    assert_clean(&rt);
}

/// ChatML whose generation prompt opens a thinking block, as DeepSeek-R1's
/// does (SmolLM2's vocabulary has ChatML's markers).
const OPENS_THINKING: &str = "{%- for m in messages -%}\
    {{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}\
    {%- endfor -%}\
    {%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif -%}";

/// A thinking budget closes the block after exactly that many tokens with
/// the close's tokens (`"\n</think>\n\n"`), and the model goes on from
/// them. Under n-gram speculation, token trees included, the output is the
/// same token for token: drafts never run past the budget.
#[test]
fn a_thinking_budget_closes_the_block_with_and_without_drafts() {
    let chat = |budget: Option<u32>| GenerateRequest {
        sampling: SamplingParams {
            max_tokens: 48,
            ignore_eos: true,
            ..SamplingParams::greedy()
        },
        speculative: true,
        thinking_budget: budget,
        ..GenerateRequest::new(Input::Chat(vec![siliceo_runtime::Message::new(
            "user",
            REPETITIVE[0],
        )]))
    };
    let run = |rt: &Runtime, budget| {
        let (_, tokens, done) = rt.submit(chat(budget)).unwrap().blocking_collect();
        (tokens, usage_of(&done))
    };
    let mut cfg = RuntimeConfig::new(model_path());
    cfg.chat_template = Some(OPENS_THINKING.to_string());
    let plain = Runtime::start(cfg.clone()).unwrap();
    let close = plain.tokenize("\n</think>\n\n", false).unwrap();
    // Inside the repetition, where n-gram drafts are accepted.
    let budget = 20;
    let (free, _) = run(&plain, None);
    let (capped, _) = run(&plain, Some(budget as u32));
    let text = plain.detokenize(&free).unwrap();
    assert!(!text.contains("</think>"), "the model closed it: {text:?}");
    assert_eq!(capped[..budget], free[..budget]);
    assert_eq!(capped[budget..budget + close.len()], close[..]);
    assert_eq!(capped.len(), 48);
    drop(plain);
    for tree_width in [1, 3] {
        let mut cfg = cfg.clone();
        cfg.speculative = Some(siliceo_runtime::SpeculativeConfig {
            tree_width,
            cost_switch_off: false,
            ..Default::default()
        });
        let rt = Runtime::start(cfg).unwrap();
        let (got, usage) = run(&rt, Some(budget as u32));
        assert_eq!(got, capped, "tree width {tree_width}");
        assert!(usage.accepted_draft_tokens > 0, "{usage:?}");
        assert_eq!(run(&rt, None).0, free, "tree width {tree_width}");
        assert_clean(&rt);
    }
}
