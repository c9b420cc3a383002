//! Property and table tests of the block pool and the cache manager.

use proptest::prelude::*;
use siliceo_core::TokenId;
use siliceo_kv_paging::{CacheKeys, KvCacheManager, KvConfig, NotEnoughBlocks, SeqHandle};

#[derive(Debug, Clone)]
enum Op {
    /// Start a sequence with a prompt drawn from a small alphabet (so prefixes repeat).
    Start {
        prompt: Vec<u32>,
        salt: bool,
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
        3 => (prop::collection::vec(0u32..3, 1..40), any::<bool>()).prop_map(|(p, salt)| Op::Start { prompt: p, salt }),
        3 => (any::<usize>(), 1usize..12).prop_map(|(seq, n)| Op::Extend { seq, n }),
        1 => any::<usize>().prop_map(|seq| Op::Fork { seq }),
        1 => (any::<usize>(), 1usize..10).prop_map(|(seq, n)| Op::Reserve { seq, n }),
        1 => (any::<usize>(), 0usize..40).prop_map(|(seq, keep)| Op::Truncate { seq, keep }),
        2 => any::<usize>().prop_map(|seq| Op::Free { seq }),
    ]
}

fn run(ops: Vec<Op>, num_blocks: u32, block_size: u32) -> Result<(), TestCaseError> {
    let mut kv = KvCacheManager::new(KvConfig {
        num_blocks,
        block_size,
        prefix_caching: true,
    });
    let keys = CacheKeys::new("m", "f16");
    let salted = keys.clone().with_salt("tenant");
    let mut live: Vec<SeqHandle> = Vec::new();
    let mut counter = 0u32;
    for op in ops {
        match op {
            Op::Start { prompt, salt } => {
                let prompt: Vec<TokenId> = prompt.into_iter().map(TokenId).collect();
                let k = if salt { &salted } else { &keys };
                let need = kv.blocks_needed_for_prompt(k, &prompt, 0);
                let h = kv.new_sequence(k);
                let cached = kv.match_prefix(h, &prompt);
                prop_assert!(cached < prompt.len() && cached.is_multiple_of(block_size as usize));
                match kv.append(h, &prompt[cached..]) {
                    Ok(_) => {
                        prop_assert!(need <= num_blocks as usize);
                        prop_assert_eq!(kv.tokens(h), &prompt[..]);
                        live.push(h);
                    }
                    Err(NotEnoughBlocks { needed, free }) => {
                        prop_assert!(needed > free);
                        kv.free(h);
                    }
                }
            }
            Op::Extend { seq, n } if !live.is_empty() => {
                let h = live[seq % live.len()];
                let before = kv.num_tokens(h);
                let new: Vec<TokenId> = (0..n).map(|i| TokenId(100 + counter + i as u32)).collect();
                counter += n as u32;
                let free_before = kv.pool().num_free();
                match kv.append(h, &new) {
                    Ok(copies) => {
                        prop_assert_eq!(kv.num_tokens(h), before + n);
                        for c in copies {
                            prop_assert!(kv.block_table(h).contains(&c.dst));
                            prop_assert!(c.tokens > 0 && c.tokens < block_size as usize);
                        }
                    }
                    Err(e) => {
                        prop_assert_eq!(kv.num_tokens(h), before);
                        prop_assert_eq!(kv.pool().num_free(), free_before);
                        prop_assert!(e.needed > e.free);
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
                let _ = kv.reserve_lookahead(h, n);
            }
            Op::Truncate { seq, keep } if !live.is_empty() => {
                let h = live[seq % live.len()];
                let want = keep.min(kv.num_tokens(h));
                if kv.truncate(h, keep).is_ok() {
                    prop_assert_eq!(kv.num_tokens(h), want);
                }
            }
            Op::Free { seq } if !live.is_empty() => {
                let h = live.swap_remove(seq % live.len());
                kv.free(h);
            }
            _ => {}
        }
        kv.check().map_err(TestCaseError::fail)?;
        let s = kv.stats();
        prop_assert_eq!(s.free_blocks + s.used_blocks, num_blocks as usize);
    }
    for h in live.drain(..) {
        kv.free(h);
    }
    kv.check().map_err(TestCaseError::fail)?;
    // Everything is free again; cached blocks may remain, unreferenced.
    prop_assert_eq!(kv.pool().num_free(), num_blocks as usize);
    prop_assert_eq!(kv.pool().num_used(), 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn no_block_lost_or_double_owned(ops in prop::collection::vec(op(), 1..80)) {
        run(ops, 24, 4)?;
    }

    #[test]
    fn tight_pool(ops in prop::collection::vec(op(), 1..60)) {
        run(ops, 6, 4)?;
    }
}

fn toks(r: std::ops::Range<u32>) -> Vec<TokenId> {
    r.map(TokenId).collect()
}

fn manager(num_blocks: u32, block_size: u32) -> KvCacheManager {
    KvCacheManager::new(KvConfig {
        num_blocks,
        block_size,
        prefix_caching: true,
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
    assert_eq!(kv.match_prefix(c, &toks(0..4)), 2);
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
    assert_eq!(kv.match_prefix(b, &toks(0..8)), 4);
    let c = kv.new_sequence(&keys);
    assert_eq!(kv.match_prefix(c, &toks(0..9)), 8);
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
        assert_eq!(kv.match_prefix(h, &toks(0..9)), 0, "{keys:?}");
        kv.free(h);
    }
    let h = kv.new_sequence(&CacheKeys::new("m", "f16").with_salt("alice"));
    assert_eq!(kv.match_prefix(h, &toks(0..9)), 8);
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
    let copies = kv.append(b, &toks(50..51)).unwrap();
    assert_eq!(copies.len(), 1);
    assert_eq!((copies[0].src, copies[0].tokens), (shared_partial, 2));
    assert_ne!(kv.block_table(b)[1], shared_partial);
    // The full first block stays shared.
    assert_eq!(kv.block_table(a)[0], kv.block_table(b)[0]);
    assert_eq!(kv.pool().ref_count(kv.block_table(a)[0]), 2);
    // The original writes in place now that it owns its partial block alone.
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
    kv.truncate(a, 3).unwrap();
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
    assert_eq!(kv.blocks_needed_for_prompt(&keys, &toks(0..12), 0), 1);
    assert_eq!(kv.blocks_needed_for_prompt(&keys, &toks(50..62), 0), 3);
    kv.free(a);
    // Freed but cached: taking them still costs free blocks.
    assert_eq!(kv.blocks_needed_for_prompt(&keys, &toks(0..12), 0), 3);
    kv.check().unwrap();
}

#[test]
fn pending_blocks_are_not_matched_until_committed() {
    let mut kv = KvCacheManager::new(KvConfig {
        num_blocks: 8,
        block_size: 4,
        prefix_caching: true,
    });
    let keys = CacheKeys::new("m", "f16");
    let prompt = toks(0..9);
    let a = kv.new_sequence(&keys);
    kv.append_pending(a, &prompt).unwrap();
    assert!(
        kv.peek_prefix(keys.root_hash(), &prompt).is_empty(),
        "planned tokens must not be matched before their KV exists"
    );
    // Commit only what was computed: the first block.
    kv.commit(a, 5);
    assert_eq!(kv.peek_prefix(keys.root_hash(), &prompt).len(), 1);
    kv.commit(a, 9);
    assert_eq!(kv.peek_prefix(keys.root_hash(), &prompt).len(), 2);
    kv.check().unwrap();
}

#[test]
fn eviction_log_names_reused_cached_blocks_and_uncache_forgets() {
    let mut kv = KvCacheManager::new(KvConfig {
        num_blocks: 4,
        block_size: 2,
        prefix_caching: true,
    });
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
    assert_eq!(
        kv.peek_prefix(keys.root_hash(), &toks(0..5)),
        vec![table[0]]
    );
    // Taking all four blocks evicts the one still cached, and the log says so.
    let b = kv.new_sequence(&keys);
    kv.append(b, &toks(100..108)).unwrap();
    assert_eq!(kv.take_evicted(), vec![table[0]]);
    assert!(kv.take_evicted().is_empty());
    kv.check().unwrap();
}
