use std::ops::ControlFlow;

use siliceo_core::{SamplingParams, SeqId};
use siliceo_engine::{EngineError, generate};

use crate::{context, greedy_together, model, tokens};

const A: &str = "The three primary colours are";
const B: &str = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n";
const C: &str = "Once upon a time, in a small village by the sea, there lived";

#[test]
fn batched_greedy_equals_alone() {
    let n = 32;
    let alone = {
        let mut ctx = context(1024, 1);
        greedy_together(&mut ctx, &[(SeqId(0), tokens(A))], n).remove(0)
    };
    let mut ctx = context(1024, 4);
    let together = greedy_together(
        &mut ctx,
        &[
            (SeqId(2), tokens(B)),
            (SeqId(0), tokens(A)),
            (SeqId(3), tokens(C)),
        ],
        n,
    );
    assert_eq!(together[1], alone, "A alone vs A among B and C");
    // The neighbours produced their own, different text.
    assert_ne!(together[0], together[1]);
    assert_ne!(together[2], together[1]);
}

#[test]
fn greedy_generate_matches_manual_loop() {
    let mut ctx = context(1024, 1);
    let manual = greedy_together(&mut ctx, &[(SeqId(0), tokens(C))], 24).remove(0);
    let mut ctx = context(1024, 1);
    let params = SamplingParams {
        max_tokens: 24,
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let out = generate(&mut ctx, SeqId(0), &tokens(C), &params, |_, _| {
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(out.tokens, manual);
    assert_eq!(out.tokens.len(), 24);
    assert_eq!(out.finish_reason, siliceo_core::FinishReason::Length);
}

#[test]
fn copied_prefix_continues_like_recomputing() {
    let prefix = tokens(&format!("{C} a fisherman named Tom. Every morning"));
    let suffix = model()
        .tokenize(" he went down to the harbour and", false)
        .unwrap();
    let n = 24;
    let recomputed = {
        let mut ctx = context(1024, 2);
        let mut all = prefix.clone();
        all.extend(&suffix);
        greedy_together(&mut ctx, &[(SeqId(0), all)], n).remove(0)
    };
    let mut ctx = context(1024, 4);
    ctx.prefill(SeqId(0), &prefix, 0).unwrap();
    ctx.seq_cp(SeqId(0), SeqId(1), None, None).unwrap();
    assert_eq!(ctx.seq_len(SeqId(1)).unwrap(), prefix.len() as u32);
    let shared = greedy_together(&mut ctx, &[(SeqId(1), suffix.clone())], n).remove(0);
    assert_eq!(shared, recomputed);
    // The holder of the prefix is untouched by the continuation.
    assert_eq!(ctx.seq_len(SeqId(0)).unwrap(), prefix.len() as u32);
}

#[test]
fn saved_state_restores_into_another_sequence() {
    let prompt = tokens(B);
    let n = 24;
    let mut ctx = context(1024, 4);
    ctx.prefill(SeqId(0), &prompt[..prompt.len() - 1], 0)
        .unwrap();
    let snap = ctx.save_seq(SeqId(0)).unwrap();
    assert_eq!(snap.n_pos(), prompt.len() as u32 - 1);
    assert!(snap.byte_len() > 0);
    // Free the original, then continue from the snapshot in another slot.
    ctx.seq_rm(SeqId(0), None, None).unwrap();
    assert_eq!(ctx.seq_len(SeqId(0)).unwrap(), 0);
    ctx.restore_seq(&snap, SeqId(3)).unwrap();
    assert_eq!(ctx.seq_len(SeqId(3)).unwrap(), prompt.len() as u32 - 1);
    let last = vec![*prompt.last().unwrap()];
    let restored = greedy_together(&mut ctx, &[(SeqId(3), last)], n).remove(0);
    let fresh = {
        let mut ctx = context(1024, 1);
        greedy_together(&mut ctx, &[(SeqId(0), prompt)], n).remove(0)
    };
    assert_eq!(restored, fresh);
}

#[test]
fn same_seed_same_text_other_seed_other_text() {
    let run = |seed| {
        let mut ctx = context(512, 1);
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 0.95,
            seed: Some(seed),
            max_tokens: 40,
            ignore_eos: true,
            ..SamplingParams::greedy()
        };
        generate(&mut ctx, SeqId(0), &tokens(C), &params, |_, _| {
            ControlFlow::Continue(())
        })
        .unwrap()
        .tokens
    };
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
}

#[test]
fn full_cache_is_a_typed_error_and_recoverable() {
    let mut ctx = context(256, 2);
    // llama.cpp may round the cell count up; fill well past half of what it has.
    let n = (ctx.n_ctx() * 5 / 8) as usize;
    let long: Vec<_> = tokens(C).into_iter().cycle().take(n).collect();
    ctx.prefill(SeqId(0), &long, 0).unwrap();
    let err = ctx.prefill(SeqId(1), &long, 0).map(|_| ()).unwrap_err();
    assert!(matches!(err, EngineError::KvCacheFull), "{err:?}");
    // Freeing the first sequence makes room again.
    ctx.seq_rm(SeqId(0), None, None).unwrap();
    ctx.seq_rm(SeqId(1), None, None).unwrap();
    ctx.prefill(SeqId(1), &long, 0).unwrap();
    assert_eq!(ctx.seq_len(SeqId(1)).unwrap(), n as u32);
}

#[test]
fn shifted_positions_and_partial_removal() {
    let mut ctx = context(256, 2);
    let p = tokens(A);
    ctx.prefill(SeqId(0), &p, 0).unwrap();
    let n = p.len() as u32;
    ctx.seq_rm(SeqId(0), Some(n - 2), None).unwrap();
    assert_eq!(ctx.seq_len(SeqId(0)).unwrap(), n - 2);
    ctx.seq_shift(SeqId(0), None, None, 10).unwrap();
    assert_eq!(ctx.seq_len(SeqId(0)).unwrap(), n - 2 + 10);
}
