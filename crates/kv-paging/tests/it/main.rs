//! Property and table tests of the block pool and the cache manager.

use std::collections::HashMap;

use proptest::prelude::*;
use siliceo_core::TokenId;
use siliceo_kv_paging::{
    BlockCount, BlockHash, BlockId, BlockOp, CacheKeys, KvCacheManager, KvConfig, KvEvent,
    KvGroups, NotEnoughBlocks, Sealing, SeqHandle, Window, WindowedGroup,
};

/// What a subscriber to the cache's events knows: content → (parent, tokens).
type Announced = HashMap<BlockHash, (Option<BlockHash>, Vec<TokenId>)>;

/// Applies `kv`'s new events to `seen` and checks them against the cache:
/// no content announced twice or removed unannounced, one announced content
/// per distinct cached content, and (without sealing) every announced prefix
/// whose chain is whole is served by the cache. With sealing a content held
/// only in its sealed form is announced too, though a prompt that ends
/// within the open tail after it cannot use it there.
fn follow_events(
    kv: &mut KvGroups,
    seen: &mut Announced,
    roots: &[BlockHash],
) -> Result<(), TestCaseError> {
    for e in kv.take_kv_events() {
        match e {
            KvEvent::Stored {
                hash,
                parent,
                tokens,
            } => {
                prop_assert_eq!(tokens.len(), kv.config().block_size as usize);
                prop_assert!(seen.insert(hash, (parent, tokens)).is_none());
            }
            KvEvent::Removed { hash } => prop_assert!(seen.remove(&hash).is_some()),
        }
    }
    prop_assert_eq!(seen.len(), kv.cached_contents());
    prop_assert!(kv.pool().num_cached_full() >= seen.len());
    if kv.config().sealing.is_none() {
        // One form per content: every cached full block is announced.
        prop_assert_eq!(kv.pool().num_cached_full(), seen.len());
    }
    // Nor with a windowed group: events follow the global group, and a
    // prefix whose windowed blocks were evicted is announced but not served.
    if kv.config().sealing.is_some() || kv.windowed().is_some() {
        return Ok(());
    }
    for h in seen.keys() {
        let mut prefix = Vec::new();
        let mut at = Some(*h);
        while let Some(b) = at {
            let Some((parent, tokens)) = seen.get(&b) else {
                break;
            };
            prefix.splice(0..0, tokens.iter().copied());
            at = *parent;
            if at.is_none() {
                // A whole chain: the cache serves it (one more token, so the
                // last one need not be recomputed).
                prefix.push(TokenId(u32::MAX));
                let served = roots
                    .iter()
                    .map(|r| kv.peek_prefix(*r, &prefix))
                    .max()
                    .unwrap_or(0);
                prop_assert!(served >= prefix.len() - 1, "{served} of {}", prefix.len());
            }
        }
    }
    Ok(())
}

#[derive(Debug, Clone)]
enum Op {
    /// Start a sequence with a prompt drawn from a small alphabet (so prefixes repeat).
    Start {
        prompt: Vec<u32>,
        salt: bool,
        chunked: bool,
    },
    Extend {
        seq: usize,
        n: usize,
    },
    Fork {
        seq: usize,
    },
    Reserve {
        seq: usize,
        n: usize,
    },
    Truncate {
        seq: usize,
        keep: usize,
    },
    Free {
        seq: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (prop::collection::vec(0u32..3, 1..40), any::<bool>(), any::<bool>()).prop_map(|(p, salt, chunked)| Op::Start { prompt: p, salt, chunked }),
        3 => (any::<usize>(), 1usize..12).prop_map(|(seq, n)| Op::Extend { seq, n }),
        1 => any::<usize>().prop_map(|seq| Op::Fork { seq }),
        1 => (any::<usize>(), 1usize..10).prop_map(|(seq, n)| Op::Reserve { seq, n }),
        1 => (any::<usize>(), 0usize..40).prop_map(|(seq, keep)| Op::Truncate { seq, keep }),
        2 => any::<usize>().prop_map(|seq| Op::Free { seq }),
    ]
}

/// Sizes of a property run: open blocks, block size, and with sealing the
/// sealed blocks and tail.
#[derive(Debug, Clone, Copy)]
struct Shape {
    open: u32,
    bs: u32,
    sealing: Option<Sealing>,
    partial: bool,
    window: Option<Window>,
    windowed: Option<WindowedGroup>,
}

/// Checks what a window promises of `h` after its tokens are committed, in
/// each group: the blocks it has passed are released, and it holds no more
/// than a window's worth (plus its margin, a step's appends and its
/// lookahead slots).
fn check_windows(kv: &KvGroups, h: SeqHandle) -> Result<(), TestCaseError> {
    check_window(kv.global(), h)?;
    if let Some(w) = kv.windowed() {
        prop_assert!(w.config().window.is_some());
        check_window(w, h)?;
    }
    Ok(())
}

fn check_window(kv: &KvCacheManager, h: SeqHandle) -> Result<(), TestCaseError> {
    let cfg = kv.config();
    let Some(w) = cfg.window else {
        prop_assert_eq!(kv.released_blocks(h), 0);
        return Ok(());
    };
    let len = kv.num_tokens(h);
    let released = kv.released_blocks(h);
    // At least what the length releases (more after a truncation; how far
    // back a query still reads is `check`'s to verify).
    prop_assert!(
        released >= cfg.released_at(len),
        "{released} released at {len}"
    );
    let table = kv.block_table(h);
    prop_assert!(table[..released].iter().all(|&b| b == BlockId::NONE));
    let held = table.len() - released;
    let bound = (w.tokens + w.margin + w.max_append) as usize / cfg.block_size as usize + 2;
    prop_assert!(held <= bound, "{held} blocks held, at most {bound}");
    Ok(())
}

/// The group whose blocks an op names (a lone windowed manager is the
/// global group).
fn group(kv: &KvGroups, windowed: bool) -> &KvCacheManager {
    match (windowed, kv.windowed()) {
        (true, Some(w)) => w,
        _ => kv.global(),
    }
}

fn run(ops: Vec<Op>, shape: Shape) -> Result<(), TestCaseError> {
    let cfg = KvConfig {
        num_blocks: shape.open,
        block_size: shape.bs,
        prefix_caching: true,
        sealing: shape.sealing,
        cache_partial: shape.partial,
        window: shape.window,
        windowed: shape.windowed,
    };
    let total = shape.open as usize + shape.sealing.map_or(0, |s| s.blocks as usize);
    let windowed_total = shape.windowed.map_or(0, |g| {
        g.num_blocks as usize + shape.sealing.map_or(0, |_| g.sealed_blocks as usize)
    });
    let bs = shape.bs as usize;
    let mut kv = KvGroups::new(cfg);

    kv.set_kv_events(true);
    let mut announced = Announced::new();
    let keys = CacheKeys::new("m", "f16");
    let salted = keys.clone().with_salt("tenant");
    let roots = [keys.root_hash(), salted.root_hash()];
    let mut live: Vec<SeqHandle> = Vec::new();
    let mut counter = 0u32;
    for op in ops {
        match op {
            Op::Start {
                prompt,
                salt,
                chunked,
            } => {
                let prompt: Vec<TokenId> = prompt.into_iter().map(TokenId).collect();
                let k = if salt { &salted } else { &keys };
                let need = kv.blocks_needed_for_prompt(k, &prompt, 0);
                // Admission's count is an upper bound: what fits, runs.
                let fits = need.fits(kv.free_blocks());
                let peek = kv.peek_prefix(k.root_hash(), &prompt);
                let h = kv.new_sequence(k);
                let (cached, ops) = kv.match_prefix(h, &prompt);
                prop_assert!(cached < prompt.len());
                prop_assert!(cached <= peek);
                if !shape.partial {
                    prop_assert!(cached.is_multiple_of(bs));
                }
                // Seals at admission are of blocks the prefix's length seals.
                for op in &ops {
                    let BlockOp::Seal(seal) = op else {
                        prop_assert!(false, "a prefix match copies nothing");
                        continue;
                    };
                    prop_assert!(seal.at_len <= cached && seal.encode && seal.src.is_some());
                }
                // Half the time as a scheduler does it: room for the whole
                // prompt set aside, then steps of at most 8 tokens, each of
                // which the reservation must cover.
                if chunked {
                    if kv.reserve(h, prompt.len() - cached).is_err() {
                        prop_assert!(!fits, "{need:?} fitted, yet the reservation failed");
                        kv.free(h);
                    } else {
                        let mut short = false;
                        for chunk in prompt[cached..].chunks(8) {
                            let r = kv.append(h, chunk);
                            // With sealing a chunk can need an open block the
                            // reservation did not count: one a single append
                            // would have filled and sealed at once; a window
                            // sets nothing aside (its pool is sized for its
                            // running sequences). The scheduler preempts then.
                            prop_assert!(
                                r.is_ok()
                                    || shape.sealing.is_some()
                                    || shape.window.is_some()
                                    || shape.windowed.is_some(),
                                "a reserved prompt ran short: {r:?}"
                            );
                            kv.finish_step();
                            kv.check().map_err(TestCaseError::fail)?;
                            if r.is_err() {
                                short = true;
                                break;
                            }
                        }
                        if short {
                            kv.free(h);
                        } else {
                            kv.release_spare(h);
                            prop_assert_eq!(kv.tokens(h), &prompt[..]);
                            check_windows(&kv, h)?;
                            live.push(h);
                        }
                    }
                } else {
                    match kv.append(h, &prompt[cached..]) {
                        Ok(_) => {
                            prop_assert_eq!(kv.tokens(h), &prompt[..]);
                            check_windows(&kv, h)?;
                            live.push(h);
                        }
                        Err(NotEnoughBlocks { needed, free }) => {
                            prop_assert!(!fits, "{need:?} fitted, yet the append ran short");
                            prop_assert!(needed > 0 && free <= total.max(windowed_total));
                            kv.free(h);
                        }
                    }
                }
            }
            Op::Extend { seq, n } if !live.is_empty() => {
                let h = live[seq % live.len()];
                let before = kv.num_tokens(h);
                let new: Vec<TokenId> = (0..n).map(|i| TokenId(100 + counter + i as u32)).collect();
                counter += n as u32;
                let free_before = kv.pool().num_free();
                let sealed_before = kv.sealed_blocks(h);
                // Per group (global, windowed): released entries and table length.
                let before_of = |kv: &KvGroups, w: bool| {
                    let m = group(kv, w);
                    (m.released_blocks(h), m.block_table(h).len())
                };
                let groups_before = [before_of(&kv, false), before_of(&kv, true)];
                match kv.append(h, &new) {
                    Ok(ops) => {
                        prop_assert_eq!(kv.num_tokens(h), before + n);
                        let mut seals = [0, 0];
                        for op in &ops {
                            match *op {
                                BlockOp::Copy(c) => {
                                    // The copy is in the table, or sealed away by this append.
                                    let sealed_away = ops.iter().any(
                                        |o| matches!(o, BlockOp::Seal(s) if s.src == Some(c.dst) && s.windowed == c.windowed),
                                    );
                                    let m = group(&kv, c.windowed);
                                    prop_assert!(m.block_table(h).contains(&c.dst) || sealed_away);
                                    prop_assert!(c.tokens > 0 && c.tokens < bs);
                                }
                                BlockOp::Seal(s) => {
                                    let g = usize::from(s.windowed && kv.windowed().is_some());
                                    let (released_before, table_before) = groups_before[g];
                                    let m = group(&kv, s.windowed);
                                    // Entries the window released before their
                                    // seal are passed over.
                                    let first_seal = sealed_before.max(released_before);
                                    prop_assert_eq!(s.index, first_seal + seals[g]);
                                    // Sealed, or released by the commit after it.
                                    let now = m.block_table(h)[s.index];
                                    prop_assert!(
                                        now == s.dst
                                            || (now == BlockId::NONE
                                                && s.index < m.released_blocks(h))
                                    );
                                    prop_assert!(s.at_len > before && s.at_len <= before + n);
                                    // A block new to the table has no open source.
                                    let filled_here = s.index >= table_before;
                                    prop_assert_eq!(s.src.is_none(), filled_here);
                                    seals[g] += 1;
                                }
                            }
                        }
                        prop_assert_eq!(kv.sealed_blocks(h), cfg.sealed_at(before + n));
                        for g in 0..2 {
                            let first_seal = sealed_before.max(groups_before[g].0);
                            if g == 1 && kv.windowed().is_none() {
                                prop_assert_eq!(seals[1], 0);
                                continue;
                            }
                            prop_assert_eq!(
                                kv.sealed_blocks(h).saturating_sub(first_seal),
                                seals[g]
                            );
                        }
                        check_windows(&kv, h)?;
                    }
                    Err(e) => {
                        prop_assert_eq!(kv.num_tokens(h), before);
                        prop_assert_eq!(kv.pool().num_free(), free_before);
                        prop_assert!(e.needed > 0);
                    }
                }
            }
            Op::Fork { seq } if !live.is_empty() => {
                let h = live[seq % live.len()];
                let f = kv.fork(h);
                prop_assert_eq!(kv.tokens(f), kv.tokens(h));
                live.push(f);
            }
            Op::Reserve { seq, n } if !live.is_empty() => {
                let h = live[seq % live.len()];
                let n = n.min(kv.tokens_until_seal(h));
                let _ = kv.reserve_lookahead(h, n);
            }
            Op::Truncate { seq, keep } if !live.is_empty() => {
                let h = live[seq % live.len()];
                // Never below the last seal.
                let sealed = kv.sealed_blocks(h);
                let floor = if sealed == 0 {
                    0
                } else {
                    cfg.seal_len(sealed - 1)
                };
                // Nor into the blocks a window released.
                let mut floor = floor;
                for m in [Some(kv.global()), kv.windowed()].into_iter().flatten() {
                    if let Some(w) = m.config().window
                        && m.released_blocks(h) > 0
                    {
                        floor = floor.max(m.released_blocks(h) * bs + w.tokens as usize);
                    }
                }
                let want = keep.max(floor).min(kv.num_tokens(h));
                kv.truncate(h, want);
                prop_assert_eq!(kv.num_tokens(h), want);
            }
            Op::Free { seq } if !live.is_empty() => {
                let h = live.swap_remove(seq % live.len());
                kv.free(h);
            }
            _ => {}
        }
        kv.check().map_err(TestCaseError::fail)?;
        // A step has run: the open sources of its seals go.
        kv.finish_step();
        kv.check().map_err(TestCaseError::fail)?;
        follow_events(&mut kv, &mut announced, &roots)?;
        let s = kv.stats();
        prop_assert_eq!(s.free_blocks + s.used_blocks, total);
        prop_assert_eq!(
            s.windowed_free_blocks + s.windowed_used_blocks,
            windowed_total
        );
    }
    for h in live.drain(..) {
        kv.free(h);
    }
    kv.check().map_err(TestCaseError::fail)?;
    // Everything is free again; cached blocks may remain, unreferenced.
    prop_assert_eq!(kv.pool().num_free(), total);
    prop_assert_eq!(kv.pool().num_used(), 0);
    if let Some(w) = kv.windowed() {
        prop_assert_eq!(w.pool().num_free(), windowed_total);
        prop_assert_eq!(w.pool().num_used(), 0);
    }
    Ok(())
}

const PLAIN: Shape = Shape {
    open: 24,
    bs: 4,
    sealing: None,
    partial: false,
    window: None,
    windowed: None,
};

/// A window of 9 positions (two blocks and a bit) with a margin of 3, the
/// harness's appends at most 40 tokens at once.
const WINDOW: Window = Window {
    tokens: 9,
    margin: 3,
    max_append: 40,
};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn no_block_lost_or_double_owned(ops in prop::collection::vec(op(), 1..80)) {
        run(ops, PLAIN)?;
    }

    #[test]
    fn tight_pool(ops in prop::collection::vec(op(), 1..60)) {
        run(ops, Shape { open: 6, ..PLAIN })?;
    }

    #[test]
    fn partial_blocks_shared_and_copied(ops in prop::collection::vec(op(), 1..80)) {
        run(ops, Shape { partial: true, ..PLAIN })?;
    }

    #[test]
    fn sealed_at_once(ops in prop::collection::vec(op(), 1..80)) {
        run(ops, Shape { open: 8, sealing: Some(Sealing { blocks: 20, tail_tokens: 0 }), partial: true, ..PLAIN })?;
    }

    #[test]
    fn sealed_behind_a_tail(ops in prop::collection::vec(op(), 1..80)) {
        run(ops, Shape { open: 12, sealing: Some(Sealing { blocks: 16, tail_tokens: 6 }), partial: true, ..PLAIN })?;
    }

    #[test]
    fn sealed_tight(ops in prop::collection::vec(op(), 1..60)) {
        run(ops, Shape { open: 4, sealing: Some(Sealing { blocks: 5, tail_tokens: 3 }), partial: true, ..PLAIN })?;
    }

    #[test]
    fn windowed(ops in prop::collection::vec(op(), 1..80)) {
        run(ops, Shape { window: Some(WINDOW), ..PLAIN })?;
    }

    #[test]
    fn windowed_tight_with_partial_blocks(ops in prop::collection::vec(op(), 1..60)) {
        run(ops, Shape { open: 8, partial: true, window: Some(WINDOW), ..PLAIN })?;
    }

    #[test]
    fn windowed_and_sealed(ops in prop::collection::vec(op(), 1..80)) {
        run(ops, Shape { open: 12, sealing: Some(Sealing { blocks: 16, tail_tokens: 6 }), partial: true, window: Some(WINDOW), ..PLAIN })?;
    }

    #[test]
    fn two_groups(ops in prop::collection::vec(op(), 1..80)) {
        run(ops, Shape { windowed: Some(WindowedGroup { num_blocks: 10, sealed_blocks: 0, window: WINDOW }), ..PLAIN })?;
    }

    #[test]
    fn two_groups_tight_with_partial_blocks(ops in prop::collection::vec(op(), 1..60)) {
        run(ops, Shape { open: 10, partial: true, windowed: Some(WindowedGroup { num_blocks: 6, sealed_blocks: 0, window: WINDOW }), ..PLAIN })?;
    }

    #[test]
    fn two_groups_sealed(ops in prop::collection::vec(op(), 1..80)) {
        run(ops, Shape { open: 12, sealing: Some(Sealing { blocks: 16, tail_tokens: 6 }), partial: true, windowed: Some(WindowedGroup { num_blocks: 8, sealed_blocks: 4, window: WINDOW }), ..PLAIN })?;
    }

    #[test]
    fn two_groups_sealed_tight(ops in prop::collection::vec(op(), 1..60)) {
        run(ops, Shape { open: 5, sealing: Some(Sealing { blocks: 6, tail_tokens: 3 }), partial: true, windowed: Some(WindowedGroup { num_blocks: 4, sealed_blocks: 2, window: WINDOW }), ..PLAIN })?;
    }

    #[test]
    fn windowed_behind_a_longer_tail(ops in prop::collection::vec(op(), 1..80)) {
        // Blocks leave the window before their seal: passed over, never sealed.
        run(ops, Shape { open: 12, sealing: Some(Sealing { blocks: 8, tail_tokens: 17 }), partial: true, window: Some(WINDOW), ..PLAIN })?;
    }
}

fn toks(r: std::ops::Range<u32>) -> Vec<TokenId> {
    r.map(TokenId).collect()
}

fn manager(num_blocks: u32, block_size: u32) -> KvCacheManager {
    KvCacheManager::new(KvConfig {
        num_blocks,
        block_size,
        ..KvConfig::default()
    })
}

#[test]
fn lru_evicts_least_recently_freed_and_chain_tails_first() {
    let mut kv = manager(4, 2);
    let keys = CacheKeys::new("m", "f16");
    // A: 4 tokens = 2 full blocks, freed tail first.
    let a = kv.new_sequence(&keys);
    kv.append(a, &toks(0..4)).unwrap();
    let a_blocks = kv.block_table(a).to_vec();
    kv.free(a);
    assert_eq!(kv.pool().num_cached_unreferenced(), 2);
    // The free queue ends with A's head (released last), its tail just before.
    let q = kv.pool().free_queue();
    assert_eq!(&q[q.len() - 2..], &[a_blocks[1], a_blocks[0]]);
    // B takes 3 blocks: the 2 never-used ones, then A's tail is evicted first.
    let b = kv.new_sequence(&keys);
    kv.append(b, &toks(100..106)).unwrap();
    assert_eq!(kv.stats().evictions, 1);
    assert!(kv.block_table(b).contains(&a_blocks[1]));
    // A's head is still cached: a new request with A's prompt gets 2 tokens.
    let c = kv.new_sequence(&keys);
    assert_eq!(kv.match_prefix(c, &toks(0..4)).0, 2);
    kv.check().unwrap();
}

#[test]
fn last_prompt_token_is_always_recomputed() {
    let mut kv = manager(8, 4);
    let keys = CacheKeys::new("m", "f16");
    let a = kv.new_sequence(&keys);
    kv.append(a, &toks(0..8)).unwrap();
    let b = kv.new_sequence(&keys);
    // The whole 8-token prompt is cached, but only 4 tokens are handed out.
    assert_eq!(kv.match_prefix(b, &toks(0..8)).0, 4);
    let c = kv.new_sequence(&keys);
    assert_eq!(kv.match_prefix(c, &toks(0..9)).0, 8);
}

#[test]
fn salts_and_models_never_share() {
    let mut kv = manager(8, 4);
    let a = kv.new_sequence(&CacheKeys::new("m", "f16").with_salt("alice"));
    kv.append(a, &toks(0..9)).unwrap();
    for keys in [
        CacheKeys::new("m", "f16").with_salt("bob"),
        CacheKeys::new("m", "f16"),
        CacheKeys::new("other", "f16").with_salt("alice"),
        CacheKeys::new("m", "q8_0").with_salt("alice"),
    ] {
        let h = kv.new_sequence(&keys);
        assert_eq!(kv.match_prefix(h, &toks(0..9)).0, 0, "{keys:?}");
        kv.free(h);
    }
    let h = kv.new_sequence(&CacheKeys::new("m", "f16").with_salt("alice"));
    assert_eq!(kv.match_prefix(h, &toks(0..9)).0, 8);
}

#[test]
fn fork_shares_then_copies_the_partial_block_on_write() {
    let mut kv = manager(8, 4);
    let a = kv.new_sequence(&CacheKeys::new("m", "f16"));
    kv.append(a, &toks(0..6)).unwrap();
    let b = kv.fork(a);
    assert_eq!(kv.block_table(a), kv.block_table(b));
    assert_eq!(kv.stats().used_blocks, 2);
    let shared_partial = kv.block_table(a)[1];
    let ops = kv.append(b, &toks(50..51)).unwrap();
    let [BlockOp::Copy(copy)] = ops[..] else {
        panic!("one copy expected, got {ops:?}")
    };
    assert_eq!((copy.src, copy.tokens), (shared_partial, 2));
    assert_ne!(kv.block_table(b)[1], shared_partial);
    // The full first block stays shared.
    assert_eq!(kv.block_table(a)[0], kv.block_table(b)[0]);
    assert_eq!(kv.pool().ref_count(kv.block_table(a)[0]), 2);
    // After the step that copied it, the original owns its partial block
    // alone and writes in place.
    kv.finish_step();
    assert!(kv.append(a, &toks(60..61)).unwrap().is_empty());
    kv.check().unwrap();
}

#[test]
fn lookahead_is_reserved_but_never_cached() {
    let mut kv = manager(8, 4);
    let keys = CacheKeys::new("m", "f16");
    let a = kv.new_sequence(&keys);
    kv.append(a, &toks(0..3)).unwrap();
    kv.reserve_lookahead(a, 6).unwrap();
    assert_eq!(kv.block_table(a).len(), 3);
    // Drafted tokens are not in the table; rejection gives the slots back.
    kv.truncate(a, 3);
    assert_eq!(kv.block_table(a).len(), 1);
    assert_eq!(kv.pool().num_cached(), 0);
    // Verified tokens go in through append and then are cached.
    kv.append(a, &toks(3..5)).unwrap();
    assert_eq!(kv.pool().num_cached(), 1);
    // A reservation that cannot fit takes nothing.
    let free = kv.pool().num_free();
    assert!(kv.reserve_lookahead(a, 100).is_err());
    assert_eq!(kv.pool().num_free(), free);
    kv.check().unwrap();
}

#[test]
fn admission_counts_cached_blocks_without_taking_them() {
    let mut kv = manager(4, 4);
    let keys = CacheKeys::new("m", "f16");
    let a = kv.new_sequence(&keys);
    kv.append(a, &toks(0..12)).unwrap();
    // While A holds its blocks, a request sharing 8 tokens needs only 1 more block.
    let open = |n| BlockCount {
        open: n,
        ..BlockCount::default()
    };
    assert_eq!(kv.blocks_needed_for_prompt(&keys, &toks(0..12), 0), open(1));
    assert_eq!(
        kv.blocks_needed_for_prompt(&keys, &toks(50..62), 0),
        open(3)
    );
    kv.free(a);
    // Freed but cached: taking them still costs free blocks.
    assert_eq!(kv.blocks_needed_for_prompt(&keys, &toks(0..12), 0), open(3));
    kv.check().unwrap();
}

#[test]
fn pending_blocks_are_not_matched_until_committed() {
    let mut kv = manager(8, 4);
    let keys = CacheKeys::new("m", "f16");
    let prompt = toks(0..9);
    let a = kv.new_sequence(&keys);
    kv.append_pending(a, &prompt).unwrap();
    assert_eq!(
        kv.peek_prefix(keys.root_hash(), &prompt),
        0,
        "planned tokens must not be matched before their KV exists"
    );
    // Commit only what was computed: the first block.
    kv.commit(a, 5);
    assert_eq!(kv.peek_prefix(keys.root_hash(), &prompt), 4);
    kv.commit(a, 9);
    assert_eq!(kv.peek_prefix(keys.root_hash(), &prompt), 8);
    kv.check().unwrap();
}

#[test]
fn eviction_log_names_reused_cached_blocks_and_uncache_forgets() {
    let mut kv = manager(4, 2);
    kv.set_eviction_log(true);
    let keys = CacheKeys::new("m", "f16");
    let a = kv.new_sequence(&keys);
    kv.append(a, &toks(0..4)).unwrap();
    let table = kv.block_table(a).to_vec();
    kv.free(a);
    assert_eq!(kv.stats().cached_unreferenced_blocks, 2);
    assert!(kv.take_evicted().is_empty());
    // Uncaching one leaves the other findable.
    assert!(kv.uncache(table[1]));
    assert!(!kv.uncache(table[1]));
    assert_eq!(kv.stats().cached_unreferenced_blocks, 1);
    assert_eq!(kv.peek_prefix(keys.root_hash(), &toks(0..5)), 2);
    // Taking all four blocks evicts the one still cached, and the log says so.
    let b = kv.new_sequence(&keys);
    kv.append(b, &toks(100..108)).unwrap();
    assert_eq!(kv.take_evicted(), vec![table[0]]);
    assert!(kv.take_evicted().is_empty());
    kv.check().unwrap();
}

#[test]
fn a_warm_prefix_sees_the_forms_a_cold_one_did() {
    // Blocks of 4, a tail of 3: at length L, (L − 3) / 4 blocks are sealed.
    let cfg = KvConfig {
        num_blocks: 8,
        block_size: 4,
        prefix_caching: true,
        sealing: Some(Sealing {
            blocks: 8,
            tail_tokens: 3,
        }),
        cache_partial: true,
        window: None,
        windowed: None,
    };
    let mut kv = KvCacheManager::new(cfg);
    let keys = CacheKeys::new("m", "k5v4+tail3");
    let a = kv.new_sequence(&keys);
    // 10 tokens: block 0 is filled and sealed by the same append (no open
    // source), block 1 stays open, block 2 holds 2 tokens.
    let ops = kv.append(a, &toks(0..10)).unwrap();
    let [BlockOp::Seal(seal)] = ops[..] else {
        panic!("one seal expected, got {ops:?}")
    };
    assert_eq!(
        (seal.index, seal.src, seal.at_len, seal.encode),
        (0, None, 7, true)
    );
    kv.finish_step();
    let table_a = kv.block_table(a).to_vec();
    assert_eq!(kv.sealed_blocks(a), 1);
    assert!(kv.is_sealed_block(table_a[0]) && !kv.is_sealed_block(table_a[1]));

    // B shares all 10 (its 11th token is recomputed): block 0 sealed, block 1
    // open, and two rows of A's partial block — as a cold B would have them.
    let prompt: Vec<TokenId> = toks(0..10).into_iter().chain(toks(50..52)).collect();
    let b = kv.new_sequence(&keys);
    let (cached, ops) = kv.match_prefix(b, &prompt);
    assert_eq!(cached, 10);
    assert!(ops.is_empty());
    assert_eq!(kv.block_table(b), &table_a[..]);
    // Appending 2 tokens seals block 1 (length 11 = 2·4 + 3) from A's open
    // block, and copies the shared partial block before writing it.
    let ops = kv.append(b, &prompt[10..]).unwrap();
    let [BlockOp::Copy(copy), BlockOp::Seal(seal)] = ops[..] else {
        panic!("a copy and a seal expected, got {ops:?}")
    };
    assert_eq!((copy.src, copy.tokens), (table_a[2], 2));
    assert_eq!(
        (seal.index, seal.src, seal.at_len),
        (1, Some(table_a[1]), 11)
    );
    assert!(seal.encode);
    // A's open block 1 stays referenced by B's step until it ends.
    assert_eq!(kv.pool().ref_count(table_a[1]), 2);
    kv.check().unwrap();
    kv.finish_step();
    assert_eq!(kv.pool().ref_count(table_a[1]), 1);
    kv.check().unwrap();

    // A third request whose prefix ends where block 1 is sealed finds B's
    // sealed form; one whose prefix keeps block 1 open finds A's open one.
    let c = kv.new_sequence(&keys);
    let long: Vec<TokenId> = prompt.iter().copied().chain(toks(90..91)).collect();
    assert_eq!(kv.match_prefix(c, &long).0, 12);
    assert_eq!(kv.block_table(c)[1], seal.dst);
    let d = kv.new_sequence(&keys);
    assert_eq!(kv.match_prefix(d, &toks(0..9)).0, 8);
    assert_eq!(kv.block_table(d)[1], table_a[1]);
    kv.check().unwrap();
}

#[test]
fn a_prefix_without_its_open_tail_ends_before_it() {
    let cfg = KvConfig {
        num_blocks: 8,
        block_size: 4,
        prefix_caching: true,
        sealing: Some(Sealing {
            blocks: 8,
            tail_tokens: 4,
        }),
        cache_partial: false,
        window: None,
        windowed: None,
    };
    let mut kv = KvCacheManager::new(cfg);
    let keys = CacheKeys::new("m", "f");
    let a = kv.new_sequence(&keys);
    // 16 tokens in one append: blocks 0..=2 are filled and sealed at once, so
    // only their sealed forms are cached.
    kv.append(a, &toks(0..16)).unwrap();
    kv.finish_step();
    assert_eq!(kv.sealed_blocks(a), 3);
    // A prompt of 13 tokens shares 12 tokens of blocks, but at length 12
    // block 2 is in the open tail and only its sealed form exists; at 8
    // block 1 would need its open form, at 4 block 0: nothing is reusable.
    let b = kv.new_sequence(&keys);
    assert_eq!(kv.match_prefix(b, &toks(0..13)).0, 0);
    kv.free(b);
    kv.free(a);
    // Built 4 tokens at a time, each block is committed open before it is
    // sealed, so both forms are cached and the whole prefix is reusable.
    let a = kv.new_sequence(&CacheKeys::new("m", "g"));
    for i in 0..4 {
        kv.append(a, &toks(i * 4..i * 4 + 4)).unwrap();
        kv.finish_step();
    }
    let table_a = kv.block_table(a).to_vec();
    let b = kv.new_sequence(&CacheKeys::new("m", "g"));
    assert_eq!(kv.match_prefix(b, &toks(0..13)).0, 12);
    assert_eq!(kv.sealed_blocks(b), 2);
    assert_eq!(&kv.block_table(b)[..2], &table_a[..2]);
    assert!(!kv.is_sealed_block(kv.block_table(b)[2]));
    kv.check().unwrap();
}

fn windowed_manager(num_blocks: u32, window: u32, max_append: u32) -> KvCacheManager {
    KvCacheManager::new(KvConfig {
        num_blocks,
        block_size: 4,
        window: Some(Window {
            tokens: window,
            margin: 0,
            max_append,
        }),
        ..KvConfig::default()
    })
}

#[test]
fn a_window_releases_its_passed_blocks_head_first_and_matches_without_them() {
    // Blocks of 4, a window of 8: at 24 tokens blocks 0-3 are behind it.
    let mut kv = windowed_manager(8, 8, 24);
    let keys = CacheKeys::new("m", "f16");
    let a = kv.new_sequence(&keys);
    kv.append(a, &toks(0..24)).unwrap();
    let table = kv.block_table(a).to_vec();
    assert_eq!(kv.released_blocks(a), 4);
    assert_eq!(&table[..4], &[BlockId::NONE; 4]);
    assert_eq!(kv.pool().num_used(), 2);
    kv.check().unwrap();
    // Released blocks stay cached, oldest first in line for eviction.
    assert_eq!(kv.pool().num_cached_unreferenced(), 4);
    kv.free(a);
    assert_eq!(kv.pool().num_cached_unreferenced(), 6);
    // B takes 4 blocks: the 2 never used, then A's blocks 0 and 1.
    kv.set_eviction_log(true);
    let b = kv.new_sequence(&keys);
    kv.append_pending(b, &toks(100..116)).unwrap();
    assert_eq!(kv.take_evicted().len(), 2);
    // A's prompt and one more token: its window (blocks 4 and 5) is cached,
    // so all 24 tokens are served although its head is gone.
    let mut prompt = toks(0..24);
    prompt.push(TokenId(7));
    let c = kv.new_sequence(&keys);
    assert_eq!(kv.peek_prefix(keys.root_hash(), &prompt), 24);
    let (n, ops) = kv.match_prefix(c, &prompt);
    assert_eq!((n, ops.len()), (24, 0));
    assert_eq!(kv.released_blocks(c), 4);
    assert_eq!(&kv.block_table(c)[..4], &[BlockId::NONE; 4]);
    assert_eq!(&kv.block_table(c)[4..], &table[4..]);
    kv.check().unwrap();
    // The same pool without a window evicts A's tail first and serves its
    // head: 16 tokens.
    let mut plain = manager(8, 4);
    let a = plain.new_sequence(&keys);
    plain.append(a, &toks(0..24)).unwrap();
    plain.free(a);
    let b = plain.new_sequence(&keys);
    plain.append_pending(b, &toks(100..116)).unwrap();
    assert_eq!(plain.peek_prefix(keys.root_hash(), &prompt), 16);
}

#[test]
fn a_window_whose_end_was_evicted_matches_the_longest_whole_window() {
    let mut kv = windowed_manager(8, 8, 24);
    let keys = CacheKeys::new("m", "f16");
    let a = kv.new_sequence(&keys);
    kv.append_pending(a, &toks(0..24)).unwrap();
    let table = kv.block_table(a).to_vec();
    kv.commit(a, 24);
    assert_eq!(kv.released_blocks(a), 4);
    kv.free(a);
    let mut prompt = toks(0..24);
    prompt.push(TokenId(7));
    // Without the last block: at 20 tokens the window needs blocks 3 and 4,
    // both cached (block 3 released by A, not evicted).
    assert!(kv.uncache(table[5]));
    let c = kv.new_sequence(&keys);
    assert_eq!(kv.match_prefix(c, &prompt).0, 20);
    assert_eq!(
        kv.block_table(c),
        &[
            BlockId::NONE,
            BlockId::NONE,
            BlockId::NONE,
            table[3],
            table[4]
        ]
    );
    kv.check().unwrap();
    kv.free(c);
    // Without block 3 too: 20 and 16 lack it; at 12 the window is blocks 1
    // and 2.
    assert!(kv.uncache(table[3]));
    let d = kv.new_sequence(&keys);
    assert_eq!(kv.match_prefix(d, &prompt).0, 12);
    assert_eq!(kv.block_table(d), &[BlockId::NONE, table[1], table[2]]);
    kv.check().unwrap();
}

#[test]
fn a_windowed_sequence_longer_than_the_pool_runs_in_its_window() {
    // 6 blocks of 4 tokens (24 tokens) hold a sequence of 200 appended 8 at a
    // time: a window of 8 plus a step's 8 needs at most 6 blocks.
    let mut kv = windowed_manager(6, 8, 8);
    let keys = CacheKeys::new("m", "f16");
    let need = kv.blocks_for_sequence(200);
    assert_eq!(need.open, 6);
    assert!(need.fits(kv.capacity()));
    let a = kv.new_sequence(&keys);
    // A reservation for all 200 sets nothing aside: the window's blocks
    // come and go.
    kv.reserve(a, 200).unwrap();
    assert_eq!(kv.pool().num_used(), 0);
    for at in (0..200).step_by(8) {
        kv.append(a, &toks(at..at + 8)).unwrap();
        kv.finish_step();
        kv.check().unwrap();
        assert!(kv.pool().num_used() <= 6);
    }
    kv.release_spare(a);
    assert_eq!(kv.num_tokens(a), 200);
    assert_eq!(kv.released_blocks(a), 48);
    assert_eq!(kv.block_table(a).len(), 50);
    // Without a window the same pool stops at 24 tokens.
    let mut plain = manager(6, 4);
    let b = plain.new_sequence(&keys);
    plain.append(b, &toks(0..24)).unwrap();
    assert!(plain.append(b, &toks(24..32)).is_err());
    assert!(!plain.blocks_for_sequence(200).fits(plain.capacity()));
}

#[test]
fn two_groups_serve_a_prefix_only_while_both_hold_what_it_reads() {
    // Blocks of 4; the windowed layers see 8 positions. The global group
    // has room for everything here, the windowed one for 6 blocks.
    let mut kv = KvGroups::new(KvConfig {
        num_blocks: 20,
        block_size: 4,
        windowed: Some(WindowedGroup {
            num_blocks: 6,
            sealed_blocks: 0,
            window: Window {
                tokens: 8,
                margin: 0,
                max_append: 16,
            },
        }),
        ..KvConfig::default()
    });
    let keys = CacheKeys::new("m", "f16");
    let a = kv.new_sequence(&keys);
    kv.append(a, &toks(0..24)).unwrap();
    let global_a = kv.block_table(a).to_vec();
    let window_a = kv.window_table(a).unwrap().to_vec();
    assert_eq!(global_a.len(), 6);
    assert_eq!(&window_a[..4], &[BlockId::NONE; 4]);
    assert_eq!(kv.released_blocks(a), 4);
    kv.free(a);
    // B's 16 tokens take 4 windowed blocks at once: A's oldest four go.
    let b = kv.new_sequence(&keys);
    kv.append(b, &toks(100..116)).unwrap();
    kv.check().unwrap();
    let mut prompt = toks(0..24);
    prompt.push(TokenId(7));
    // Taking A's cached blocks costs free ones: 6 global and 2 windowed, and
    // the last token a block in each.
    let need = kv.blocks_needed_for_prompt(&keys, &prompt, 0);
    assert_eq!(
        need,
        BlockCount {
            open: 7,
            windowed_open: 3,
            ..BlockCount::default()
        }
    );
    let c = kv.new_sequence(&keys);
    assert_eq!(kv.match_prefix(c, &prompt), (24, Vec::new()));
    assert_eq!(kv.block_table(c), &global_a[..]);
    assert_eq!(kv.window_table(c).unwrap(), &window_a[..]);
    kv.check().unwrap();
    kv.free(c);
    kv.free(b);
    // D takes 4 more: the least recently released are B's first two and
    // then A's window. The global group still holds all of A, the windowed
    // group none of the blocks any prefix of it reads.
    let d = kv.new_sequence(&keys);
    kv.append(d, &toks(200..216)).unwrap();
    assert_eq!(kv.global().peek_prefix(keys.root_hash(), &prompt), 24);
    assert_eq!(kv.peek_prefix(keys.root_hash(), &prompt), 0);
    let e = kv.new_sequence(&keys);
    assert_eq!(kv.match_prefix(e, &prompt).0, 0);
    // Recomputed in steps of at most 16 tokens, it fits again.
    kv.free(d);
    assert!(kv.append(e, &prompt).is_err());
    kv.append(e, &prompt[..16]).unwrap();
    kv.append(e, &prompt[16..]).unwrap();
    assert_eq!(kv.window_table(e).unwrap().len(), 7);
    assert_eq!(kv.released_blocks(e), 4);
    kv.check().unwrap();
    let s = kv.stats();
    assert_eq!(s.windowed_free_blocks + s.windowed_used_blocks, 6);
}

/// A scheduler's steps over one windowed manager: up to `running`
/// sequences, each step's `budget` tokens shared among them in chunks,
/// commits before the next step's appends, prompts sharing prefixes.
#[derive(Debug, Clone)]
struct Workload {
    /// Per step and slot: a prompt length to start when the slot is free
    /// (0: none), and the slot's wish for this step's budget.
    steps: Vec<Vec<(usize, usize)>>,
}

fn workload(running: usize) -> impl Strategy<Value = Workload> {
    prop::collection::vec(
        prop::collection::vec(
            (prop_oneof![1 => Just(0usize), 3 => 10usize..80], 0usize..13),
            running,
        ),
        1..80,
    )
    .prop_map(|steps| Workload { steps })
}

/// Runs `w` on a windowed manager sized by [`WindowedGroup::for_running`]
/// (less `short` blocks; no cached windows): no append may run short.
fn sized_pools_never_run_short(
    w: Workload,
    tail: Option<u32>,
    short: u32,
) -> Result<(), TestCaseError> {
    let (running, budget, bs) = (3u32, 12u32, 4u32);
    let window = Window {
        tokens: 9,
        margin: 0,
        max_append: budget,
    };
    let g = WindowedGroup::for_running(window, running, bs, tail, 0);
    let mut kv = KvCacheManager::new(KvConfig {
        num_blocks: g.num_blocks - short,
        block_size: bs,
        prefix_caching: true,
        sealing: tail.map(|t| Sealing {
            blocks: g.sealed_blocks,
            tail_tokens: t,
        }),
        cache_partial: true,
        window: Some(window),
        windowed: None,
    });
    let keys = CacheKeys::new("m", "f16");
    // (handle, its whole prompt, tokens in)
    let mut slots: Vec<Option<(SeqHandle, Vec<TokenId>, usize)>> = vec![None; running as usize];
    let mut counter = 0u32;
    for step in w.steps {
        // The last step has run: commit, then its sources go.
        for (h, _, _) in slots.iter().flatten() {
            let n = kv.num_tokens(*h);
            kv.commit(*h, n);
        }
        kv.finish_step();
        let mut left = budget as usize;
        for (slot, &(start, wish)) in slots.iter_mut().zip(&step) {
            if let Some((h, p, at)) = slot.as_ref()
                && *at == p.len()
            {
                kv.free(*h);
                *slot = None;
            }
            if slot.is_none() && start > 0 {
                // Prompts over a small alphabet share prefixes.
                let p: Vec<TokenId> = (0..start)
                    .map(|i| {
                        TokenId(if i % 7 == 6 {
                            100 + counter
                        } else {
                            (i % 3) as u32
                        })
                    })
                    .collect();
                counter += 1;
                let h = kv.new_sequence(&keys);
                let (cached, _) = kv.match_prefix(h, &p);
                *slot = Some((h, p, cached));
            }
            let Some((h, p, at)) = slot.as_mut() else {
                continue;
            };
            let n = wish.min(left).min(p.len() - *at);
            if n == 0 {
                continue;
            }
            let r = kv.append_pending(*h, &p[*at..*at + n]);
            prop_assert!(r.is_ok(), "a sized pool ran short: {r:?} ({g:?})");
            *at += n;
            left -= n;
        }
        kv.check().map_err(TestCaseError::fail)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn windowed_pools_sized_for_their_sequences_never_run_short(w in workload(3)) {
        sized_pools_never_run_short(w, None, 0)?;
    }

    #[test]
    fn windowed_sealed_pools_sized_for_their_sequences_never_run_short(
        w in workload(3),
        tail in prop_oneof![Just(0u32), Just(3), Just(6), Just(17)],
    ) {
        sized_pools_never_run_short(w, Some(tail), 0)?;
    }
}
