//! Two groups of blocks, for models whose layers do not all read the whole
//! context: the global layers' blocks, and the windowed layers' blocks
//! (Gemma 2-4: most layers see their last 512 or 1,024 positions; gpt-oss:
//! every other layer sees 128).
//!
//! Each group is a [`KvCacheManager`] over its own pool; a sequence has a
//! table in each, indexed alike (entry `i` holds tokens `64·i ..` in both),
//! and every operation acts on both or on neither. The windowed group
//! releases the blocks its window has passed ([`KvConfig::window`]), so a
//! long sequence holds `⌈n/64⌉` global blocks but only a window's worth of
//! windowed ones. A prefix is served when both groups hold what a sequence
//! of its length reads: every global block before it, and the windowed
//! blocks its window covers.
//!
//! Without [`KvConfig::windowed`] a [`KvGroups`] is its global manager.

use siliceo_core::TokenId;

use crate::block::{BlockHash, BlockId, CacheKeys};
use crate::manager::{
    BlockCount, BlockOp, CacheStats, KvCacheManager, KvConfig, KvEvent, NotEnoughBlocks, Sealing,
    SeqHandle,
};
use crate::pool::BlockPool;

/// The block tables of all sequences over a global group and, optionally, a
/// windowed one. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct KvGroups {
    global: KvCacheManager,
    windowed: Option<KvCacheManager>,
}

impl KvGroups {
    /// Groups over fresh pools: `config` sizes the global group, and its
    /// [`KvConfig::windowed`] the windowed one (same block size, prefix
    /// caching and sealing tail).
    ///
    /// # Panics
    /// When `config` has both a window of its own and a windowed group.
    pub fn new(config: KvConfig) -> Self {
        assert!(
            config.window.is_none() || config.windowed.is_none(),
            "the global group has no window"
        );
        let windowed = config.windowed.map(|g| {
            KvCacheManager::new(KvConfig {
                num_blocks: g.num_blocks,
                sealing: config.sealing.map(|s| Sealing {
                    blocks: g.sealed_blocks,
                    ..s
                }),
                window: Some(g.window),
                windowed: None,
                ..config
            })
        });
        KvGroups {
            global: KvCacheManager::new(config),
            windowed,
        }
    }

    /// The global group.
    pub fn global(&self) -> &KvCacheManager {
        &self.global
    }

    /// The windowed group, if there is one.
    pub fn windowed(&self) -> Option<&KvCacheManager> {
        self.windowed.as_ref()
    }

    /// The configuration.
    pub fn config(&self) -> KvConfig {
        self.global.config()
    }

    /// Starts (or stops) recording the global group's cache changes
    /// ([`KvCacheManager::set_kv_events`]): a gateway routes on whole
    /// prefixes, which the global group holds. A prefix whose windowed
    /// blocks were evicted is still announced; it costs a recompute of at
    /// most a window per windowed layer, not a wrong answer.
    pub fn set_kv_events(&mut self, on: bool) {
        self.global.set_kv_events(on);
    }

    /// The global group's cache changes since the last call.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.global.take_kv_events()
    }

    /// Distinct full-block contents the global group caches (with events on).
    pub fn cached_contents(&self) -> usize {
        self.global.cached_contents()
    }

    /// The global group's pool.
    pub fn pool(&self) -> &BlockPool {
        self.global.pool()
    }

    fn both(&self, f: impl Fn(&KvCacheManager) -> BlockCount) -> BlockCount {
        let c = f(&self.global);
        match &self.windowed {
            Some(w) => c + f(w).as_windowed(),
            None => c,
        }
    }

    /// Does `f` in the global group, then in the windowed one.
    fn each(&mut self, mut f: impl FnMut(&mut KvCacheManager)) {
        f(&mut self.global);
        if let Some(w) = &mut self.windowed {
            f(w);
        }
    }

    /// Unreferenced blocks of each class and group (cached ones included).
    pub fn free_blocks(&self) -> BlockCount {
        self.both(KvCacheManager::free_blocks)
    }

    /// Blocks of each class and group.
    pub fn capacity(&self) -> BlockCount {
        self.both(KvCacheManager::capacity)
    }

    /// Whether `id` is a sealed block of the global group.
    pub fn is_sealed_block(&self, id: BlockId) -> bool {
        self.global.is_sealed_block(id)
    }

    /// Starts an empty sequence whose cached blocks are keyed by `keys`.
    pub fn new_sequence(&mut self, keys: &CacheKeys) -> SeqHandle {
        let h = self.global.new_sequence(keys);
        if let Some(w) = &mut self.windowed {
            let hw = w.new_sequence(keys);
            debug_assert_eq!(h, hw, "the groups' handles diverged");
        }
        h
    }

    /// Sequences alive.
    pub fn num_sequences(&self) -> usize {
        self.global.num_sequences()
    }

    /// The longest prefix of `prompt` both groups serve: each group's
    /// longest within the other's, until they agree (each group serves every
    /// shorter prefix of what it served that it would serve on its own, so
    /// this only shrinks).
    fn common_prefix(&self, root: BlockHash, prompt: &[TokenId]) -> usize {
        let mut c = self.global.peek_prefix(root, prompt);
        let Some(w) = &self.windowed else {
            return c;
        };
        loop {
            let cw = w.peek_prefix(root, &prompt[..(c + 1).min(prompt.len())]);
            if cw == c {
                return c;
            }
            let cg = self
                .global
                .peek_prefix(root, &prompt[..(cw + 1).min(prompt.len())]);
            if cg == cw {
                return cw;
            }
            c = cg;
        }
    }

    /// Prompt tokens the cache would serve for `prompt` (see
    /// [`match_prefix`](Self::match_prefix)). Looks only.
    pub fn peek_prefix(&self, keys_root: BlockHash, prompt: &[TokenId]) -> usize {
        self.common_prefix(keys_root, prompt)
    }

    /// Blocks of each class and group an empty sequence would take to hold
    /// `prompt` plus `lookahead` slots, given what the cache holds (an upper
    /// bound). For admission decisions.
    pub fn blocks_needed_for_prompt(
        &self,
        keys: &CacheKeys,
        prompt: &[TokenId],
        lookahead: usize,
    ) -> BlockCount {
        let Some(w) = &self.windowed else {
            return self
                .global
                .blocks_needed_for_prompt(keys, prompt, lookahead);
        };
        let limit = self.common_prefix(keys.root_hash(), prompt) + 1;
        self.global
            .blocks_needed_within(keys, prompt, lookahead, limit)
            + w.blocks_needed_within(keys, prompt, lookahead, limit)
                .as_windowed()
    }

    /// Blocks of each class and group a sequence takes on its way to `tokens`
    /// tokens ([`KvCacheManager::blocks_for_sequence`]).
    pub fn blocks_for_sequence(&self, tokens: usize) -> BlockCount {
        self.both(|m| m.blocks_for_sequence(tokens))
    }

    /// Gives an empty sequence the cached blocks of both groups that start
    /// `prompt`; returns how many prompt tokens are now in place and the
    /// seals to make first ([`KvCacheManager::match_prefix`]).
    pub fn match_prefix(&mut self, h: SeqHandle, prompt: &[TokenId]) -> (usize, Vec<BlockOp>) {
        if self.windowed.is_none() {
            return self.global.match_prefix(h, prompt);
        }
        let mut c = self.common_prefix(self.global.root_of(h), prompt);
        let w = self.windowed.as_mut().expect("checked above");
        loop {
            let cut = &prompt[..(c + 1).min(prompt.len())];
            let (n, mut ops) = self.global.match_uncounted(h, cut);
            let (nw, wops) = w.match_uncounted(h, cut);
            if n == nw {
                ops.extend(wops);
                self.global.count_lookup(n, prompt.len() - n);
                return (n, ops);
            }
            // A group ran short of sealed blocks for the seals a match makes
            // (admission counts them, so this is rare): undo both, try the
            // shorter prefix.
            self.global.clear(h);
            w.clear(h);
            c = n.min(nw);
        }
    }

    /// Blocks of each class and group that appending `n` tokens to `h` would
    /// take from the pools (its spare blocks not counted against it).
    pub fn blocks_needed_to_append(&self, h: SeqHandle, n: usize) -> BlockCount {
        self.both(|m| m.blocks_needed_to_append(h, n))
    }

    /// The first shortage among the groups.
    fn shortage(
        &self,
        f: impl Fn(&KvCacheManager) -> Option<NotEnoughBlocks>,
    ) -> Result<(), NotEnoughBlocks> {
        match f(&self.global).or_else(|| self.windowed.as_ref().and_then(&f)) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Sets aside in both groups the blocks that appending `n` more tokens
    /// to `h` will take ([`KvCacheManager::reserve`]; the windowed group a
    /// window's worth at a time); on shortage nothing changes.
    pub fn reserve(&mut self, h: SeqHandle, n: usize) -> Result<(), NotEnoughBlocks> {
        self.shortage(|m| m.reserve_shortage(h, n))?;
        self.each(|m| m.reserve(h, n).expect("checked"));
        Ok(())
    }

    /// Gives `h`'s spare blocks back.
    pub fn release_spare(&mut self, h: SeqHandle) {
        self.each(|m| m.release_spare(h));
    }

    /// Appends computed tokens to `h` and commits them
    /// ([`KvCacheManager::append`]).
    pub fn append(
        &mut self,
        h: SeqHandle,
        new: &[TokenId],
    ) -> Result<Vec<BlockOp>, NotEnoughBlocks> {
        let ops = self.append_pending(h, new)?;
        let n = self.num_tokens(h);
        self.commit(h, n);
        Ok(ops)
    }

    /// Appends planned tokens to `h` in both groups
    /// ([`KvCacheManager::append_pending`]); the windowed group's ops are
    /// marked `windowed`. On shortage in either group nothing changes.
    pub fn append_pending(
        &mut self,
        h: SeqHandle,
        new: &[TokenId],
    ) -> Result<Vec<BlockOp>, NotEnoughBlocks> {
        self.shortage(|m| m.append_shortage(h, new.len()))?;
        let mut ops = Vec::new();
        self.each(|m| ops.extend(m.append_pending(h, new).expect("checked")));
        Ok(ops)
    }

    /// Registers `h`'s computed blocks in both groups, and releases the
    /// windowed blocks its window has passed ([`KvCacheManager::commit`]).
    pub fn commit(&mut self, h: SeqHandle, upto: usize) {
        self.each(|m| m.commit(h, upto));
    }

    /// Releases the blocks the step just run read and sealed or copied away.
    pub fn finish_step(&mut self) {
        self.each(|m| m.finish_step());
    }

    /// Tokens that can follow `h`'s length before the next seal (the groups
    /// share the sealing tail).
    pub fn tokens_until_seal(&self, h: SeqHandle) -> usize {
        self.global.tokens_until_seal(h)
    }

    /// Makes room for `n` speculative tokens in both groups
    /// ([`KvCacheManager::reserve_lookahead`]); on shortage nothing changes.
    pub fn reserve_lookahead(&mut self, h: SeqHandle, n: usize) -> Result<(), NotEnoughBlocks> {
        self.shortage(|m| m.lookahead_shortage(h, n))?;
        self.each(|m| m.reserve_lookahead(h, n).expect("checked"));
        Ok(())
    }

    /// Appends verified speculative tokens into `h`'s lookahead slots
    /// ([`KvCacheManager::accept_lookahead`]).
    pub fn accept_lookahead(&mut self, h: SeqHandle, new: &[TokenId]) {
        self.each(|m| m.accept_lookahead(h, new));
    }

    /// Shortens `h` in both groups ([`KvCacheManager::truncate`]); with a
    /// window, not into the blocks it released.
    pub fn truncate(&mut self, h: SeqHandle, len: usize) {
        self.each(|m| m.truncate(h, len));
    }

    /// A new sequence sharing every block of `h` in both groups.
    pub fn fork(&mut self, h: SeqHandle) -> SeqHandle {
        let f = self.global.fork(h);
        if let Some(w) = &mut self.windowed {
            let fw = w.fork(h);
            debug_assert_eq!(f, fw, "the groups' handles diverged");
        }
        f
    }

    /// Ends a sequence in both groups.
    pub fn free(&mut self, h: SeqHandle) {
        self.each(|m| m.free(h));
    }

    /// Records (or stops recording) the global group's evicted blocks (for
    /// the llama.cpp-backed store, which has no windowed group).
    pub fn set_eviction_log(&mut self, on: bool) {
        self.global.set_eviction_log(on);
    }

    /// The global group's blocks evicted since the last call.
    pub fn take_evicted(&mut self) -> Vec<BlockId> {
        self.global.take_evicted()
    }

    /// Forgets the cached prefix held by the global group's block `id`.
    pub fn uncache(&mut self, id: BlockId) -> bool {
        self.global.uncache(id)
    }

    /// `h`'s table in the global group.
    pub fn block_table(&self, h: SeqHandle) -> &[BlockId] {
        self.global.block_table(h)
    }

    /// `h`'s table in the windowed group (leading entries the window
    /// released are [`BlockId::NONE`]), if there is one.
    pub fn window_table(&self, h: SeqHandle) -> Option<&[BlockId]> {
        self.windowed.as_ref().map(|w| w.block_table(h))
    }

    /// Leading entries of `h`'s windowed table its window released.
    pub fn released_blocks(&self, h: SeqHandle) -> usize {
        self.windowed.as_ref().map_or(0, |w| w.released_blocks(h))
    }

    /// Leading sealed blocks of `h`'s tables (alike in both groups, released
    /// entries counted).
    pub fn sealed_blocks(&self, h: SeqHandle) -> usize {
        self.global.sealed_blocks(h)
    }

    /// Tokens held by `h`.
    pub fn num_tokens(&self, h: SeqHandle) -> usize {
        self.global.num_tokens(h)
    }

    /// The tokens held by `h`.
    pub fn tokens(&self, h: SeqHandle) -> &[TokenId] {
        self.global.tokens(h)
    }

    /// Blocks of each class and group only `h` references.
    pub fn exclusive_blocks(&self, h: SeqHandle) -> BlockCount {
        self.both(|m| m.exclusive_blocks(h))
    }

    /// The global group's counters and occupancy, with the windowed group's
    /// free and used blocks.
    pub fn stats(&self) -> CacheStats {
        let mut s = self.global.stats();
        if let Some(w) = &self.windowed {
            let ws = w.stats();
            s.windowed_free_blocks = ws.free_blocks;
            s.windowed_used_blocks = ws.used_blocks;
            s.windowed_used_sealed_blocks = ws.used_sealed_blocks;
        }
        s
    }

    /// Each group's invariants ([`KvCacheManager::check`]), and that both
    /// hold the same sequences with the same tokens and sealed blocks.
    pub fn check(&self) -> Result<(), String> {
        self.global.check()?;
        let Some(w) = &self.windowed else {
            return Ok(());
        };
        w.check().map_err(|e| format!("windowed group: {e}"))?;
        if w.num_sequences() != self.global.num_sequences() {
            return Err(format!(
                "{} sequences in the global group, {} in the windowed one",
                self.global.num_sequences(),
                w.num_sequences()
            ));
        }
        for h in self.global.handles() {
            if !w.has(h) || w.tokens(h) != self.global.tokens(h) {
                return Err(format!("{h:?}: the groups hold different tokens"));
            }
            if w.sealed_blocks(h) != self.global.sealed_blocks(h) {
                return Err(format!("{h:?}: the groups sealed differently"));
            }
        }
        Ok(())
    }
}
