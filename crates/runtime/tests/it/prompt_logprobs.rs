//! Prompt log-probabilities (`GenerateRequest::prompt_logprobs`): every
//! prompt position's logits, read while the prompt is computed in chunks.

use siliceo_core::{FinishReason, Priority, TokenId};
use siliceo_runtime::{
    Event, GenerateRequest, Input, KvBackend, Runtime, RuntimeConfig, RuntimeError, TokenLogprob,
};

use super::{assert_clean, model_path, request, usage_of};

/// What [`Event::Prompt`] brings: the first token, the later ones' scores.
type Scores = ((TokenId, Vec<u8>), Vec<TokenLogprob>);

/// Reads a stream to its end: the prompt event (if any), the generated
/// tokens with their log-probabilities, and `Done`; and checks that the
/// prompt event came first.
fn read(
    rt: &Runtime,
    req: GenerateRequest,
) -> (Option<Scores>, Vec<TokenId>, Vec<TokenLogprob>, Event) {
    let mut s = rt.submit(req).unwrap();
    let (mut prompt, mut tokens, mut lps) = (None, Vec::new(), Vec::new());
    while let Some(e) = s.blocking_next() {
        match e {
            Event::Prompt { first, logprobs } => {
                assert!(prompt.is_none(), "a second prompt event");
                assert!(tokens.is_empty(), "the prompt event after a token");
                prompt = Some((first, logprobs));
            }
            Event::Text {
                tokens: t,
                logprobs: l,
                ..
            } => {
                tokens.extend(t);
                lps.extend(l);
            }
            done @ Event::Done { .. } => return (prompt, tokens, lps, done),
        }
    }
    panic!("the stream ended without Done");
}

fn scoring(tokens: Vec<TokenId>, top: u32, max_tokens: u32) -> GenerateRequest {
    let mut r = GenerateRequest::new(Input::Tokens(tokens));
    r.sampling.max_tokens = max_tokens;
    r.sampling.ignore_eos = true;
    r.prompt_logprobs = Some(top);
    r
}

/// Scoring a prompt and its greedy continuation gives each continuation
/// token the log-probability decoding gave it, bit for bit: the same logits
/// computed in a 64-token chunk instead of one token per step (our store's
/// kernels and the Q4_1 product do not depend on the batch). The prompt is
/// computed whole each time, though it is cached.
#[test]
fn prompt_logprobs_equal_the_decoding_ones_and_skip_the_cache() {
    let rt = Runtime::start(RuntimeConfig::new(model_path())).unwrap();
    // Long enough for several chunks of 64.
    let p = "The three primary colours are red, yellow and blue. Mixing two primary colours \
             gives a secondary colour: red and yellow make orange, yellow and blue make \
             green, and blue and red make purple. Painters learn these rules first, then \
             learn that real pigments are not so simple: a warm red and a cool blue give a \
             muddy purple, while a cool red and a warm blue give a bright one. Printers use \
             a different set, cyan, magenta and yellow, because inks subtract light instead \
             of adding it. Screens add light, so their primaries are red, green and blue. \
             So, to sum up, mixing red and yellow paint gives";
    let n = 12;
    let mut plain = request(p, n, Priority::Normal);
    plain.logprobs = Some(3);
    let (prompt, generated, decoded, done) = read(&rt, plain);
    assert!(prompt.is_none(), "no prompt event unless asked");
    assert_eq!(usage_of(&done).completion_tokens, n);
    assert_eq!(decoded.len(), generated.len());

    let mut all = rt.tokenize(p, true).unwrap();
    assert!(all.len() > 130, "{} prompt tokens", all.len());
    all.extend_from_slice(&generated);
    let runs: Vec<_> = (0..2)
        .map(|_| read(&rt, scoring(all.clone(), 3, 0)))
        .collect();
    for (k, (prompt, tokens, lps, done)) in runs.iter().enumerate() {
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
        assert_eq!(*finish_reason, FinishReason::Length);
        assert_eq!(
            (usage.prompt_tokens, usage.cached_prompt_tokens),
            (all.len() as u32, 0),
            "run {k}: the prompt is computed whole"
        );
        assert_eq!(usage.completion_tokens, 0);
        assert!(tokens.is_empty() && lps.is_empty(), "run {k} generated");
        let (first, scored) = prompt.as_ref().expect("a prompt event");
        assert_eq!(first.0, all[0]);
        assert_eq!(scored.len(), all.len() - 1);
        for (i, l) in scored.iter().enumerate() {
            assert_eq!(l.token, all[i + 1], "position {i}");
            assert!(l.logprob <= 0.0 && l.logprob.is_finite(), "{l:?}");
            assert_eq!(l.top.len(), 3);
            assert!(l.top.windows(2).all(|w| w[0].2 >= w[1].2), "{l:?}");
            // The token's own value and rank where it is among the
            // alternatives (which come in rank order).
            if let Some(at) = l.top.iter().position(|t| t.0 == l.token) {
                assert_eq!(l.top[at].2, l.logprob);
                let ahead = l.top[..at].iter().filter(|t| t.2 > l.logprob).count();
                assert_eq!(l.rank as usize, ahead + 1, "{l:?}");
            } else {
                assert!(l.rank as usize > l.top.len(), "{l:?}");
            }
        }
        let tail = &scored[scored.len() - generated.len()..];
        assert_eq!(tail, &decoded[..], "run {k}: the continuation's scores");
    }
    assert_eq!(runs[0].0, runs[1].0, "scoring twice differs");
    assert_clean(&rt);
}

/// A prompt scored on the way to generating: the prompt event comes before
/// the first token, and the tokens are those of an unscored request; on our
/// store and on llama.cpp's cells.
#[test]
fn prompt_logprobs_come_before_the_generated_tokens() {
    let ours = RuntimeConfig::new(model_path());
    let mut llama = ours.clone();
    llama.kv = KvBackend::Llama;
    for cfg in [ours, llama] {
        scored_then_generated(&Runtime::start(cfg).unwrap());
    }
}

fn scored_then_generated(rt: &Runtime) {
    let p = "def fibonacci(n):";
    let (_, plain, _, _) = read(rt, request(p, 8, Priority::Normal));
    let ids = rt.tokenize(p, true).unwrap();
    let (prompt, tokens, _, done) = read(rt, scoring(ids.clone(), 0, 8));
    usage_of(&done);
    let (first, scored) = prompt.expect("a prompt event");
    assert_eq!(first.0, ids[0]);
    let got: Vec<TokenId> = scored.iter().map(|l| l.token).collect();
    assert_eq!(got, ids[1..]);
    assert!(scored.iter().all(|l| l.top.is_empty()));
    assert_eq!(tokens, plain);
    // A one-token prompt has nothing to score but its first token.
    let (prompt, _, _, done) = read(rt, scoring(ids[..1].to_vec(), 2, 0));
    usage_of(&done);
    let (first, scored) = prompt.expect("a prompt event");
    assert_eq!((first.0, scored.len()), (ids[0], 0));
    assert_clean(rt);
}

/// `max_tokens` 0 scores only with `prompt_logprobs`; more than 20
/// alternatives are refused, naming the field.
#[test]
fn prompt_logprobs_requests_are_checked() {
    let rt = Runtime::start(RuntimeConfig::new(model_path())).unwrap();
    let ids = rt.tokenize("Hello there", true).unwrap();
    let mut no_scores = scoring(ids.clone(), 0, 0);
    no_scores.prompt_logprobs = None;
    let too_many = scoring(ids, 21, 0);
    for (req, field) in [(no_scores, "max_tokens"), (too_many, "prompt_logprobs")] {
        match rt.submit(req) {
            Err(RuntimeError::InvalidRequest { field: f, .. }) => assert_eq!(f, field),
            Err(e) => panic!("{field}: {e:?}"),
            Ok(s) => panic!("{field}: served, {:?}", s.blocking_collect().2),
        }
    }
    assert_clean(&rt);
}

/// Scoring requests preempted (by recompute and by swap) on a cache too
/// small for everything: their prompt scores and tokens equal a solo run's,
/// bit for bit, and nothing leaks.
#[test]
fn preempted_scoring_requests_keep_their_scores() {
    let doc = "The three primary colours are red, yellow and blue. Mixing two primary \
               colours gives a secondary colour: red and yellow make orange, yellow and \
               blue make green, and blue and red make purple. Painters learn these rules \
               first, then learn that real pigments are not so simple.";
    // 256 cells (32 blocks of 16 in kv8): too few for the scorers and the
    // interactive requests at once. (The block size is the solo run's too:
    // attention sums block by block.)
    let small = |recompute_below: usize| {
        let mut cfg = RuntimeConfig::new(model_path());
        cfg.context.n_ctx = 256;
        cfg.block_size = 16;
        cfg.scheduler.recompute_below_tokens = recompute_below;
        cfg
    };
    let solo = {
        let rt = Runtime::start(small(0)).unwrap();
        let ids = rt.tokenize(doc, true).unwrap();
        read(&rt, scoring(ids, 2, 24))
    };
    let (Some(want_scores), want_tokens) = (solo.0, solo.1) else {
        panic!("no prompt event")
    };
    for recompute_below in [usize::MAX, 0] {
        let rt = Runtime::start(small(recompute_below)).unwrap();
        let ids = rt.tokenize(doc, true).unwrap();
        let scorers: Vec<_> = (0..2)
            .map(|_| {
                let mut r = scoring(ids.clone(), 2, 24);
                r.priority = Priority::Batch;
                rt.submit(r).unwrap()
            })
            .collect();
        let others: Vec<_> = (0..6)
            .map(|i| {
                rt.submit(request(
                    &format!("Story {i}: once upon a time"),
                    80,
                    Priority::Interactive,
                ))
                .unwrap()
            })
            .collect();
        for s in scorers {
            let mut s = s;
            let (mut scores, mut tokens) = (None, Vec::new());
            while let Some(e) = s.blocking_next() {
                match e {
                    Event::Prompt { first, logprobs } => scores = Some((first, logprobs)),
                    Event::Text { tokens: t, .. } => tokens.extend(t),
                    done @ Event::Done { .. } => {
                        usage_of(&done);
                    }
                }
            }
            let what = format!("recompute_below {recompute_below}");
            assert_eq!(scores.as_ref(), Some(&want_scores), "{what}: scores");
            assert_eq!(tokens, want_tokens, "{what}: tokens");
        }
        for s in others {
            usage_of(&s.blocking_collect().2);
        }
        let stats = rt.stats().unwrap();
        assert!(stats.preemptions > 0, "the test must preempt: {stats:?}");
        assert_clean(&rt);
    }
}
