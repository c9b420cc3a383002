//! Scheduler tests against a fake engine: fast, deterministic, and strict about
//! what a real engine would need (positions, swaps, restores).

mod fake;

use proptest::prelude::*;
use siliceo_core::{Priority, RequestId, TokenId};
use siliceo_kv_paging::{BlockOp, CacheKeys, KvConfig, Sealing, Window, WindowedGroup};
use siliceo_scheduler::{
    FinishCause, ItemKind, PreemptMode, Rejected, Request, Scheduler, SchedulerConfig,
};

use fake::{FakeEngine, prompt, solo};

fn keys() -> CacheKeys {
    CacheKeys::new("fake", "f16")
}

fn req(id: &str, len: usize, n_gen: u32, p: Priority, at: u64) -> Request {
    Request::new(RequestId::from(id), prompt(id, len), n_gen, keys(), p, at)
}

fn sched(cfg: SchedulerConfig, blocks: u32) -> Scheduler {
    Scheduler::new(
        cfg,
        KvConfig {
            num_blocks: blocks,
            block_size: 16,
            ..KvConfig::default()
        },
    )
}

#[test]
fn concurrent_outputs_equal_solo_outputs() {
    let mut s = sched(
        SchedulerConfig {
            max_batch_tokens: 64,
            ..SchedulerConfig::default()
        },
        256,
    );
    let mut e = FakeEngine::default();
    let reqs: Vec<Request> = (0..8)
        .map(|i| {
            req(
                &format!("r{i}"),
                20 + i * 13,
                10 + i as u32,
                Priority::Normal,
                0,
            )
        })
        .collect();
    for r in &reqs {
        s.add(r.clone()).unwrap();
    }
    e.run(&mut s, 0, 10_000);
    for r in &reqs {
        assert_eq!(e.output(&r.id), solo(r), "{}", r.id);
    }
    assert!(s.is_idle());
    assert_eq!(s.kv().pool().num_used(), 0);
}

#[test]
fn budget_and_running_caps_hold_every_step() {
    let cfg = SchedulerConfig {
        max_batch_tokens: 48,
        max_running_seqs: 3,
        ..SchedulerConfig::default()
    };
    let mut s = sched(cfg, 256);
    let mut e = FakeEngine::default();
    for i in 0..10 {
        s.add(req(&format!("r{i}"), 30 + i * 7, 5, Priority::Normal, 0))
            .unwrap();
    }
    let mut steps = 0;
    while !s.is_idle() {
        let step = s.schedule(0);
        assert!(step.num_tokens() <= 48, "{}", step.num_tokens());
        assert!(s.stats().running <= 3);
        e.apply(&mut s, &step);
        s.check().unwrap();
        steps += 1;
        assert!(steps < 1000);
    }
}

#[test]
fn chunked_prefill_never_stalls_a_decode() {
    let mut s = sched(
        SchedulerConfig {
            max_batch_tokens: 32,
            ..SchedulerConfig::default()
        },
        512,
    );
    let mut e = FakeEngine::default();
    s.add(req("short", 8, 50, Priority::Normal, 0)).unwrap();
    // Let the short one start decoding.
    for _ in 0..2 {
        let step = s.schedule(0);
        e.apply(&mut s, &step);
    }
    s.add(req("long", 1000, 1, Priority::Normal, 0)).unwrap();
    let mut chunks = 0;
    while s.contains(&RequestId::from("long")) {
        let step = s.schedule(0);
        let has_decode = step
            .items
            .iter()
            .any(|i| i.id.0 == "short" && i.kind == ItemKind::Decode);
        if s.contains(&RequestId::from("short")) {
            assert!(has_decode, "the decode was stalled by the long prefill");
        }
        chunks += step.items.iter().filter(|i| i.id.0 == "long").count();
        e.apply(&mut s, &step);
    }
    assert!(
        chunks >= 1000 / 32,
        "the long prompt ran in {chunks} chunks"
    );
}

#[test]
fn higher_class_first_fcfs_within_a_class() {
    let cfg = SchedulerConfig {
        max_running_seqs: 1,
        ..SchedulerConfig::default()
    };
    let mut s = sched(cfg, 256);
    s.add(req("batch", 10, 1, Priority::Batch, 0)).unwrap();
    s.add(req("normal-1", 10, 1, Priority::Normal, 1)).unwrap();
    s.add(req("normal-2", 10, 1, Priority::Normal, 2)).unwrap();
    s.add(req("interactive", 10, 1, Priority::Interactive, 3))
        .unwrap();
    let mut e = FakeEngine::default();
    let mut order = Vec::new();
    while !s.is_idle() {
        let step = s.schedule(10);
        for i in &step.items {
            if !order.contains(&i.id.0) {
                order.push(i.id.0.clone());
            }
        }
        e.apply(&mut s, &step);
    }
    assert_eq!(order, ["interactive", "normal-1", "normal-2", "batch"]);
}

#[test]
fn aging_lifts_a_starved_batch_request() {
    let cfg = SchedulerConfig {
        max_running_seqs: 1,
        aging_ms: 100,
        ..SchedulerConfig::default()
    };
    let mut s = sched(cfg, 256);
    s.add(req("old-batch", 10, 1, Priority::Batch, 0)).unwrap();
    s.add(req("new-interactive", 10, 1, Priority::Interactive, 250))
        .unwrap();
    // At 150 ms the batch request has aged one class (to normal): interactive wins.
    let step = s.schedule(150);
    assert_eq!(step.items[0].id.0, "new-interactive");
    let mut e = FakeEngine::default();
    e.apply(&mut s, &step);
    assert!(!s.contains(&RequestId::from("new-interactive")));
    // A fresh interactive request arrives; by 300 ms the batch one has aged two
    // classes and, having waited longer, goes first.
    s.add(req("newer-interactive", 10, 1, Priority::Interactive, 290))
        .unwrap();
    let step = s.schedule(300);
    assert_eq!(step.items[0].id.0, "old-batch");
}

#[test]
fn preemption_by_swap_and_recompute_keeps_outputs() {
    for (recompute_below, mode) in [(0, PreemptMode::Swap), (usize::MAX, PreemptMode::Recompute)] {
        let cfg = SchedulerConfig {
            max_batch_tokens: 64,
            recompute_below_tokens: recompute_below,
            ..SchedulerConfig::default()
        };
        // 12 blocks of 16 tokens: two 60-token batch requests growing to 120 fill it.
        let mut s = sched(cfg, 12);
        let mut e = FakeEngine::default();
        let a = req("batch-a", 60, 60, Priority::Batch, 0);
        let b = req("batch-b", 60, 60, Priority::Batch, 0);
        s.add(a.clone()).unwrap();
        s.add(b.clone()).unwrap();
        for _ in 0..20 {
            let step = s.schedule(0);
            e.apply(&mut s, &step);
        }
        let hi = req("interactive", 50, 20, Priority::Interactive, 1);
        s.add(hi.clone()).unwrap();
        e.run(&mut s, 1, 10_000);
        assert!(
            e.preemptions.iter().any(|p| p.mode == mode),
            "{mode:?}: {:?}",
            e.preemptions
        );
        for r in [&a, &b, &hi] {
            assert_eq!(e.output(&r.id), solo(r), "{mode:?} {}", r.id);
        }
        assert_eq!(s.kv().pool().num_used(), 0);
        assert_eq!(s.stats().swapped_tokens, 0);
    }
}

#[test]
fn cancellation_frees_blocks_at_once_and_others_continue() {
    let mut s = sched(SchedulerConfig::default(), 64);
    let mut e = FakeEngine::default();
    let keep = req("keep", 40, 30, Priority::Normal, 0);
    s.add(keep.clone()).unwrap();
    s.add(req("drop", 100, 30, Priority::Normal, 0)).unwrap();
    for _ in 0..3 {
        let step = s.schedule(0);
        e.apply(&mut s, &step);
    }
    let used_before = s.kv().pool().num_used();
    let drop_blocks = s
        .kv()
        .block_table(s.handle(&RequestId::from("drop")).unwrap())
        .len();
    assert!(s.cancel(&RequestId::from("drop")));
    e.forget(&RequestId::from("drop"));
    assert_eq!(s.kv().pool().num_used(), used_before - drop_blocks);
    assert!(
        !s.cancel(&RequestId::from("drop")),
        "second cancel finds nothing"
    );
    e.run(&mut s, 0, 10_000);
    assert_eq!(e.output(&keep.id), solo(&keep));
    assert_eq!(s.kv().pool().num_used(), 0);
}

#[test]
fn deadlines_end_requests_in_the_step() {
    let mut s = sched(SchedulerConfig::default(), 64);
    s.add(req("late", 10, 1000, Priority::Normal, 0).with_deadline(50))
        .unwrap();
    let mut e = FakeEngine::default();
    let step = s.schedule(10);
    e.apply(&mut s, &step);
    let step = s.schedule(50);
    let ended: Vec<_> = step
        .finished
        .iter()
        .map(|f| (f.id.clone(), f.cause))
        .collect();
    assert_eq!(
        ended,
        vec![(RequestId::from("late"), FinishCause::Deadline)]
    );
    assert_eq!(
        step.finished[0].blocks.len(),
        1,
        "10 tokens in one 16-token block"
    );
    assert!(step.items.is_empty());
    assert_eq!(s.kv().pool().num_used(), 0);
}

#[test]
fn rejections_say_why() {
    let mut s = sched(
        SchedulerConfig {
            max_seq_len: 100,
            max_waiting: 2,
            ..SchedulerConfig::default()
        },
        4,
    );
    let check = |r: Result<(), Rejected>, kind: &str| assert_eq!(r.unwrap_err().error_kind(), kind);
    check(
        s.add(req("empty", 0, 1, Priority::Normal, 0)),
        "empty_prompt",
    );
    check(
        s.add(req("long", 100, 1, Priority::Normal, 0)),
        "prompt_too_long",
    );
    check(
        s.add(req("big", 64, 1, Priority::Normal, 0)),
        "too_large_for_cache",
    );
    s.add(req("a", 10, 1, Priority::Normal, 0)).unwrap();
    check(s.add(req("a", 10, 1, Priority::Normal, 0)), "duplicate_id");
    s.add(req("b", 10, 1, Priority::Normal, 0)).unwrap();
    let err = s.add(req("c", 10, 1, Priority::Normal, 0)).unwrap_err();
    assert_eq!(err.to_string(), "request c: the queue is full");
}

#[test]
fn shared_prefix_is_computed_once() {
    let mut s = sched(
        SchedulerConfig {
            max_batch_tokens: 4096,
            ..SchedulerConfig::default()
        },
        512,
    );
    let mut e = FakeEngine::default();
    let shared = prompt("system", 320);
    let mk = |i: u32| {
        let mut p = shared.clone();
        p.extend((0..8).map(|k| TokenId(9000 + i * 10 + k)));
        Request::new(
            RequestId::from(format!("q{i}").as_str()),
            p,
            4,
            keys(),
            Priority::Normal,
            0,
        )
    };
    s.add(mk(0)).unwrap();
    e.run(&mut s, 0, 1000);
    for i in 1..6 {
        s.add(mk(i)).unwrap();
    }
    let step = s.schedule(0);
    for item in &step.items {
        assert_eq!(
            item.kind,
            ItemKind::Prefill { cached_tokens: 320 },
            "{}",
            item.id
        );
        assert_eq!(item.tokens.len(), 8);
    }
    e.apply(&mut s, &step);
    e.run(&mut s, 0, 1000);
    assert_eq!(s.kv().stats().hit_tokens, 5 * 320);
}

/// A request that reads every prompt position's logits computes its whole
/// prompt, in chunks of at most its `max_chunk`, though the prompt is
/// cached; its output and the cache are as for any other request.
#[test]
fn a_request_computing_its_whole_prompt_skips_the_cache_in_small_chunks() {
    let mut s = sched(
        SchedulerConfig {
            max_batch_tokens: 4096,
            ..SchedulerConfig::default()
        },
        512,
    );
    let mut e = FakeEngine::default();
    let p = prompt("doc", 200);
    let mk = |id: &str| {
        Request::new(
            RequestId::from(id),
            p.clone(),
            3,
            keys(),
            Priority::Normal,
            0,
        )
    };
    s.add(mk("first")).unwrap();
    e.run(&mut s, 0, 1000);
    let hits = s.kv().stats().hit_tokens;
    let scorer = mk("scorer").computing_whole_prompt(48);
    let want = solo(&scorer);
    s.add(scorer).unwrap();
    // Nothing waits for blocks in flight either: a second plain request
    // admitted beside it still reuses the cache.
    s.add(mk("plain")).unwrap();
    let mut starts = Vec::new();
    for _ in 0..100 {
        let step = s.schedule(0);
        for item in step.items.iter().filter(|i| i.id.0 == "scorer") {
            if let ItemKind::Prefill { cached_tokens } = item.kind {
                assert_eq!(cached_tokens, 0);
                assert!(item.tokens.len() <= 48, "a chunk of {}", item.tokens.len());
                starts.push((item.start_pos, item.tokens.len()));
            }
        }
        e.apply(&mut s, &step);
        s.check().unwrap();
        if s.is_idle() {
            break;
        }
    }
    assert!(s.is_idle());
    // Contiguous chunks from position 0 to the end of the prompt.
    let mut next = 0;
    for &(start, n) in &starts {
        assert_eq!(start, next, "chunks {starts:?}");
        next += n;
    }
    assert_eq!(next, p.len(), "chunks {starts:?}");
    assert_eq!(e.output(&RequestId::from("scorer")), want);
    // Only the plain request's prefix came from the cache.
    assert_eq!(s.kv().stats().hit_tokens - hits, 192);
    s.step_done();
    assert_eq!(s.kv().stats().used_blocks, 0);
}

#[derive(Debug, Clone)]
struct Arrival {
    len: usize,
    n_gen: u32,
    class: u8,
    at_step: u16,
    cancel_after: Option<u16>,
}

fn arrival() -> impl Strategy<Value = Arrival> {
    (
        1usize..90,
        1u32..40,
        0u8..3,
        0u16..30,
        prop::option::weighted(0.2, 0u16..20),
    )
        .prop_map(|(len, n_gen, class, at_step, cancel_after)| Arrival {
            len,
            n_gen,
            class,
            at_step,
            cancel_after,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(120))]

    /// Random mixed workloads on a small cache: every request completes with its
    /// solo output (or is cancelled), caps hold, and nothing leaks.
    #[test]
    fn random_workloads_complete_without_leaks(arrivals in prop::collection::vec(arrival(), 1..24), recompute_below in prop::sample::select(vec![0usize, 32, usize::MAX])) {
        let cfg = SchedulerConfig { max_batch_tokens: 48, max_running_seqs: 6, aging_ms: 20, recompute_below_tokens: recompute_below, ..SchedulerConfig::default() };
        let mut s = sched(cfg, 10);
        let mut e = FakeEngine::default();
        let classes = [Priority::Interactive, Priority::Normal, Priority::Batch];
        let reqs: Vec<Request> = arrivals.iter().enumerate().map(|(i, a)| req(&format!("r{i}"), a.len, a.n_gen, classes[a.class as usize], u64::from(a.at_step))).collect();
        let mut cancelled = Vec::new();
        let mut step_no = 0u64;
        loop {
            for (r, a) in reqs.iter().zip(&arrivals) {
                if u64::from(a.at_step) == step_no {
                    prop_assert!(s.add(r.clone()).is_ok());
                }
                if let Some(c) = a.cancel_after
                    && u64::from(a.at_step) + u64::from(c) == step_no
                    && s.cancel(&r.id)
                {
                    e.forget(&r.id);
                    cancelled.push(r.id.clone());
                }
            }
            let step = s.schedule(step_no);
            prop_assert!(step.num_tokens() <= 48);
            prop_assert!(s.stats().running <= 6);
            e.apply(&mut s, &step);
            s.check().map_err(TestCaseError::fail)?;
            step_no += 1;
            if step_no > 30 && s.is_idle() {
                break;
            }
            prop_assert!(step_no < 5000, "no progress");
        }
        for r in &reqs {
            if !cancelled.contains(&r.id) {
                prop_assert_eq!(e.output(&r.id), solo(r));
            }
        }
        prop_assert_eq!(s.kv().pool().num_used(), 0);
        prop_assert_eq!(s.kv().num_sequences(), 0);
        prop_assert_eq!(s.stats().swapped_tokens, 0);
    }
}

/// The windowed layers' window in [`kv_shapes`]: 24 positions, a step's
/// appends at most the workload's 40-token budget plus 3 drafts.
const WINDOW: Window = Window {
    tokens: 24,
    margin: 4,
    max_append: 43,
};

/// KV configurations a workload must not care about: plain blocks, partial
/// blocks cached, blocks sealed when full, sealed behind a 20-token tail, and
/// the same with a group of blocks for windowed layers.
fn kv_shapes() -> impl Strategy<Value = KvConfig> {
    let base = KvConfig {
        num_blocks: 10,
        block_size: 16,
        prefix_caching: true,
        sealing: None,
        cache_partial: false,
        window: None,
        windowed: None,
    };
    let partial = KvConfig {
        cache_partial: true,
        ..base
    };
    let behind_a_tail = KvConfig {
        num_blocks: 12,
        sealing: Some(Sealing {
            blocks: 6,
            tail_tokens: 20,
        }),
        ..partial
    };
    // Windowed layers seeing 24 positions, in a group of their own smaller
    // than the global one.
    let windowed = |num_blocks, sealed_blocks| {
        Some(WindowedGroup {
            num_blocks,
            sealed_blocks,
            window: WINDOW,
        })
    };
    prop::sample::select(vec![
        base,
        partial,
        KvConfig {
            num_blocks: 8,
            sealing: Some(Sealing {
                blocks: 8,
                tail_tokens: 0,
            }),
            ..partial
        },
        behind_a_tail,
        KvConfig {
            windowed: windowed(8, 0),
            ..partial
        },
        KvConfig {
            windowed: windowed(7, 5),
            ..behind_a_tail
        },
    ])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(150))]

    /// Random workloads whose prompts share prefixes of random lengths, on
    /// every KV shape: outputs are the solo outputs, cached and sealed blocks
    /// hold what they claim (the fake engine checks every hit and every
    /// cached seal), and nothing leaks.
    #[test]
    fn shared_prefixes_on_every_kv_shape(
        arrivals in prop::collection::vec(arrival(), 1..20),
        shared in prop::collection::vec(0usize..90, 20),
        kv in kv_shapes(),
        drafts in 0usize..4,
    ) {
        let cfg = SchedulerConfig { max_batch_tokens: 40, max_running_seqs: 5, aging_ms: 20, recompute_below_tokens: 32, ..SchedulerConfig::default() };
        let mut s = Scheduler::new(cfg, kv);
        let mut e = FakeEngine::default();
        let base = prompt("base", 120);
        let reqs: Vec<Request> = arrivals.iter().enumerate().map(|(i, a)| {
            let own = prompt(&format!("r{i}"), a.len);
            let n = shared[i].min(a.len);
            let p: Vec<TokenId> = base[..n].iter().chain(&own[n..]).copied().collect();
            Request::new(RequestId::from(format!("r{i}").as_str()), p, a.n_gen, keys(), Priority::Normal, u64::from(a.at_step))
        }).collect();
        let mut step_no = 0u64;
        loop {
            for (r, a) in reqs.iter().zip(&arrivals) {
                if u64::from(a.at_step) == step_no {
                    prop_assert!(s.add(r.clone()).is_ok());
                    s.set_draft_len(&r.id, drafts);
                }
            }
            let step = s.schedule(step_no);
            for item in &step.items {
                prop_assert!(item.draft_slots <= drafts);
            }
            e.apply(&mut s, &step);
            s.check().map_err(TestCaseError::fail)?;
            step_no += 1;
            if step_no > 30 && s.is_idle() {
                break;
            }
            prop_assert!(step_no < 5000, "no progress");
        }
        for r in &reqs {
            prop_assert_eq!(e.output(&r.id), solo(r));
        }
        let _ = s.schedule(step_no);
        prop_assert_eq!(s.kv().pool().num_used(), 0);
        prop_assert_eq!(s.kv().num_sequences(), 0);
    }
}

#[test]
fn blocks_still_being_computed_are_not_matched_and_their_readers_wait() {
    // `a` prefills 330 tokens in chunks of 200; `b` (same prompt) arrives after
    // the first step, while `a` is still computing its blocks: `b` must neither
    // match blocks still being computed nor compute them a second time — it
    // waits until `a`'s prompt is in the cache, then reuses all of it.
    let mut s = sched(
        SchedulerConfig {
            max_batch_tokens: 200,
            ..SchedulerConfig::default()
        },
        64,
    );
    let mut e = FakeEngine::default();
    let p = prompt("shared", 330);
    let mk = |id: &str| {
        Request::new(
            RequestId::from(id),
            p.clone(),
            3,
            keys(),
            Priority::Normal,
            0,
        )
    };
    s.add(mk("a")).unwrap();
    let step = s.schedule(0);
    assert_eq!(step.num_tokens(), 200);
    e.apply(&mut s, &step);
    s.add(mk("b")).unwrap();
    let step = s.schedule(0);
    assert!(
        step.items.iter().all(|i| i.id.0 != "b"),
        "b waits while a computes the blocks it needs"
    );
    e.apply(&mut s, &step);
    let mut cached = None;
    for _ in 0..100 {
        if s.is_idle() {
            break;
        }
        let step = s.schedule(0);
        for i in &step.items {
            if let (true, ItemKind::Prefill { cached_tokens }) = (i.id.0 == "b", &i.kind) {
                cached.get_or_insert(*cached_tokens);
            }
        }
        e.apply(&mut s, &step);
        s.check().unwrap();
    }
    assert_eq!(cached, Some(320), "b reuses every full block of a's prompt");
    assert_eq!(e.output(&RequestId::from("a")), solo(&mk("a")));
    assert_eq!(e.output(&RequestId::from("b")), solo(&mk("b")));
    s.check().unwrap();
}

#[test]
fn speculative_steps_keep_outputs_and_release_rejected_slots() {
    let mut s = sched(
        SchedulerConfig {
            max_batch_tokens: 64,
            ..SchedulerConfig::default()
        },
        40,
    );
    let mut e = FakeEngine::default();
    let reqs: Vec<Request> = (0..4)
        .map(|i| {
            req(
                &format!("s{i}"),
                20 + i * 7,
                30 + i as u32,
                Priority::Normal,
                0,
            )
        })
        .collect();
    for r in &reqs {
        s.add(r.clone()).unwrap();
    }
    for _ in 0..1000 {
        if s.is_idle() {
            break;
        }
        for r in &reqs {
            s.set_draft_len(&r.id, 4);
        }
        let step = s.schedule(0);
        e.apply(&mut s, &step);
        s.check().unwrap();
    }
    assert!(s.is_idle());
    for r in &reqs {
        assert_eq!(e.output(&r.id), solo(r), "{}", r.id);
    }
    assert!(
        e.accepted > 0 && e.accepted < e.drafted,
        "{} of {}",
        e.accepted,
        e.drafted
    );
    assert_eq!(s.kv().pool().num_used(), 0, "no reserved slot leaked");
}

#[test]
fn an_idle_scheduler_holds_no_block_once_its_last_step_is_done() {
    // A request whose prompt ends in another's cached partial block copies
    // it on write; the copied-from block is read by that step and released
    // when the step is done, even when nothing is scheduled after it (the
    // request was cancelled and the engine went idle).
    let mut s = Scheduler::new(
        SchedulerConfig::default(),
        KvConfig {
            num_blocks: 16,
            block_size: 16,
            sealing: Some(Sealing {
                blocks: 16,
                tail_tokens: 0,
            }),
            cache_partial: true,
            ..KvConfig::default()
        },
    );
    let mut e = FakeEngine::default();
    // Its cached partial block holds the prompt's last 8 tokens and 4
    // generated ones; the next request shares only the prompt's.
    let first = req("first", 40, 5, Priority::Normal, 0);
    s.add(first.clone()).unwrap();
    e.run(&mut s, 0, 10_000);
    assert_eq!(s.kv().pool().num_used(), 0);
    let mut again = first.clone();
    again.id = RequestId::from("again");
    again.prompt.extend(prompt("more", 4));
    s.add(again).unwrap();
    let step = s.schedule(0);
    let copied = step
        .items
        .iter()
        .any(|i| i.ops.iter().any(|op| matches!(op, BlockOp::Copy(_))));
    assert!(
        copied,
        "the cached partial block is copied on write: {step:?}"
    );
    e.apply(&mut s, &step);
    assert!(s.cancel(&RequestId::from("again")));
    e.forget(&RequestId::from("again"));
    assert!(s.is_idle());
    assert_eq!(
        s.kv().pool().num_used(),
        1,
        "the block the step copied from is held until the step is done"
    );
    s.step_done();
    assert_eq!(s.kv().pool().num_used(), 0);
    s.check().unwrap();
}
