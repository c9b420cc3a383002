//! Per-sequence policy over the pool: block tables, prefix matching, appends
//! with copy-on-write, forks, lookahead reservations, truncation and freeing.

use std::collections::HashMap;

use siliceo_core::TokenId;

use crate::block::{BlockHash, BlockId, CacheKeys, hash_block};
use crate::pool::BlockPool;

/// Sizes of a [`KvCacheManager`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvConfig {
    /// Blocks in the pool.
    pub num_blocks: u32,
    /// Tokens per block (64 by default).
    pub block_size: u32,
    /// Whether full blocks are registered and reused across sequences.
    pub prefix_caching: bool,
}

impl Default for KvConfig {
    fn default() -> Self {
        KvConfig {
            num_blocks: 1024,
            block_size: 64,
            prefix_caching: true,
        }
    }
}

/// An opaque handle to one sequence's block table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqHandle(u64);

/// Not enough free blocks right now: capacity is not an error, the caller
/// waits, evicts or preempts. Nothing was changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotEnoughBlocks {
    /// Blocks the operation needs.
    pub needed: usize,
    /// Blocks that are free (including cached-but-unreferenced ones).
    pub free: usize,
}

/// The caller must copy the first `tokens` token slots of block `src` into
/// block `dst` (copy-on-write of a shared partial block, or a truncation into a
/// cached block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    /// Block to copy from.
    pub src: BlockId,
    /// Block to copy to (now owned by the sequence).
    pub dst: BlockId,
    /// Token slots to copy.
    pub tokens: usize,
}

/// Counters for metrics. Hits and misses count prompt tokens looked up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Prompt tokens served from cached blocks.
    pub hit_tokens: u64,
    /// Prompt tokens looked up and not found (or not cacheable).
    pub miss_tokens: u64,
    /// Cached blocks evicted to make room.
    pub evictions: u64,
    /// Blocks free right now (including cached-but-unreferenced).
    pub free_blocks: usize,
    /// Blocks referenced right now.
    pub used_blocks: usize,
    /// Unreferenced blocks still holding a cached prefix.
    pub cached_unreferenced_blocks: usize,
}

#[derive(Debug, Clone)]
struct SeqState {
    root: BlockHash,
    blocks: Vec<BlockId>,
    tokens: Vec<TokenId>,
    /// Hashes of the leading full blocks that are committed (a prefix of `blocks`).
    hashes: Vec<BlockHash>,
    /// Slots reserved past `tokens` for speculative lookahead.
    reserved: usize,
}

/// Block tables of all sequences over one [`BlockPool`].
#[derive(Debug, Clone)]
pub struct KvCacheManager {
    config: KvConfig,
    pool: BlockPool,
    seqs: HashMap<SeqHandle, SeqState>,
    next_handle: u64,
    hit_tokens: u64,
    miss_tokens: u64,
}

impl KvCacheManager {
    /// A manager over a fresh pool.
    pub fn new(config: KvConfig) -> Self {
        KvCacheManager {
            config,
            pool: BlockPool::new(config.num_blocks, config.block_size),
            seqs: HashMap::new(),
            next_handle: 0,
            hit_tokens: 0,
            miss_tokens: 0,
        }
    }

    /// The configuration.
    pub fn config(&self) -> KvConfig {
        self.config
    }

    /// The pool (read-only: counts, free queue, reference counts).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    fn bs(&self) -> usize {
        self.config.block_size as usize
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.bs())
    }

    fn seq(&self, h: SeqHandle) -> &SeqState {
        self.seqs.get(&h).expect("unknown sequence handle")
    }

    /// Starts an empty sequence whose cached blocks are keyed by `keys`.
    pub fn new_sequence(&mut self, keys: &CacheKeys) -> SeqHandle {
        let h = SeqHandle(self.next_handle);
        self.next_handle += 1;
        self.seqs.insert(
            h,
            SeqState {
                root: keys.root_hash(),
                blocks: Vec::new(),
                tokens: Vec::new(),
                hashes: Vec::new(),
                reserved: 0,
            },
        );
        h
    }

    /// Sequences alive.
    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// The longest run of cached full blocks that starts `prompt`, capped so
    /// the last prompt token is always left to recompute (its logits are
    /// needed). Looks only; takes no references.
    pub fn peek_prefix(&self, keys_root: BlockHash, prompt: &[TokenId]) -> Vec<BlockId> {
        if !self.config.prefix_caching || prompt.is_empty() {
            return Vec::new();
        }
        let max_blocks = (prompt.len() - 1) / self.bs();
        let mut parent = keys_root;
        let mut out = Vec::new();
        for chunk in prompt.chunks(self.bs()).take(max_blocks) {
            let h = hash_block(parent, chunk);
            match self.pool.lookup(parent, h, chunk) {
                Some(b) => out.push(b),
                None => break,
            }
            parent = h;
        }
        out
    }

    /// Blocks an empty sequence would need to hold `prompt` plus `lookahead`
    /// slots, given what the cache already has. For admission decisions.
    pub fn blocks_needed_for_prompt(
        &self,
        keys: &CacheKeys,
        prompt: &[TokenId],
        lookahead: usize,
    ) -> usize {
        let hit = self.peek_prefix(keys.root_hash(), prompt);
        // Cached blocks sitting in the free queue are counted as free: taking
        // them costs a free block too.
        let hit_free = hit.iter().filter(|b| self.pool.ref_count(**b) == 0).count();
        self.blocks_for(prompt.len() + lookahead) - hit.len() + hit_free
    }

    /// Gives an empty sequence the cached blocks that start `prompt`; returns
    /// how many prompt tokens are now in place (a multiple of the block size,
    /// less than `prompt.len()`). The caller computes the rest and
    /// [`append`](Self::append)s it.
    pub fn match_prefix(&mut self, h: SeqHandle, prompt: &[TokenId]) -> usize {
        let root = self.seq(h).root;
        assert!(
            self.seq(h).tokens.is_empty(),
            "match_prefix on a non-empty sequence"
        );
        let hit = self.peek_prefix(root, prompt);
        let n = hit.len() * self.bs();
        self.hit_tokens += n as u64;
        self.miss_tokens += (prompt.len() - n) as u64;
        let mut parent = root;
        let mut hashes = Vec::with_capacity(hit.len());
        for (b, chunk) in hit.iter().zip(prompt.chunks(self.bs())) {
            self.pool.retain(*b);
            parent = hash_block(parent, chunk);
            hashes.push(parent);
        }
        let s = self.seqs.get_mut(&h).expect("unknown sequence handle");
        s.blocks = hit;
        s.hashes = hashes;
        s.tokens.extend_from_slice(&prompt[..n]);
        n
    }

    /// Blocks that appending `n` tokens to `h` would take from the pool.
    pub fn blocks_needed_to_append(&self, h: SeqHandle, n: usize) -> usize {
        let s = self.seq(h);
        let have = s.blocks.len();
        let want = self.blocks_for(s.tokens.len() + n.max(s.reserved));
        let mut need = want.saturating_sub(have);
        // A shared partial last block that will be written needs a private copy.
        if n > 0 && !s.tokens.len().is_multiple_of(self.bs()) {
            let last = s.blocks[s.tokens.len() / self.bs()];
            if self.pool.ref_count(last) > 1 {
                need += 1;
            }
        }
        need
    }

    /// Appends computed (verified) tokens to `h`, allocating blocks as needed.
    /// Every block that becomes full is registered in the prefix cache. Returns
    /// the copies the caller must make (copy-on-write); on shortage nothing changes.
    pub fn append(
        &mut self,
        h: SeqHandle,
        new: &[TokenId],
    ) -> Result<Vec<BlockCopy>, NotEnoughBlocks> {
        let copies = self.append_pending(h, new)?;
        let n = self.num_tokens(h);
        self.commit(h, n);
        Ok(copies)
    }

    /// Like [`append`](Self::append) but registers nothing: for tokens
    /// planned and not yet computed. [`commit`](Self::commit) registers their
    /// full blocks once their KV exists, so no other sequence can match a
    /// block whose content is still being computed.
    pub fn append_pending(
        &mut self,
        h: SeqHandle,
        new: &[TokenId],
    ) -> Result<Vec<BlockCopy>, NotEnoughBlocks> {
        let needed = self.blocks_needed_to_append(h, new.len());
        if needed > self.pool.num_free() {
            return Err(NotEnoughBlocks {
                needed,
                free: self.pool.num_free(),
            });
        }
        let bs = self.bs();
        let s = self.seqs.get_mut(&h).expect("unknown sequence handle");
        let mut copies = Vec::new();
        if !new.is_empty() && !s.tokens.len().is_multiple_of(bs) {
            let idx = s.tokens.len() / bs;
            let last = s.blocks[idx];
            if self.pool.ref_count(last) > 1 {
                let fresh = self.pool.allocate().expect("counted");
                copies.push(BlockCopy {
                    src: last,
                    dst: fresh,
                    tokens: s.tokens.len() % bs,
                });
                self.pool.release(last);
                s.blocks[idx] = fresh;
            }
        }
        s.tokens.extend_from_slice(new);
        s.reserved = s.reserved.saturating_sub(new.len());
        while s.blocks.len() < (s.tokens.len() + s.reserved).div_ceil(bs) {
            s.blocks.push(self.pool.allocate().expect("counted"));
        }
        Ok(copies)
    }

    /// Registers in the prefix cache every full block of `h` within its first
    /// `upto` tokens that is not registered yet (a no-op with prefix caching
    /// off). A block whose hash another block already caches stays private;
    /// the chain of hashes still continues past it.
    pub fn commit(&mut self, h: SeqHandle, upto: usize) {
        if !self.config.prefix_caching {
            return;
        }
        let bs = self.bs();
        let s = self.seqs.get_mut(&h).expect("unknown sequence handle");
        let full = upto.min(s.tokens.len()) / bs;
        while s.hashes.len() < full {
            let i = s.hashes.len();
            let parent = if i == 0 { s.root } else { s.hashes[i - 1] };
            let chunk = &s.tokens[i * bs..(i + 1) * bs];
            let hash = hash_block(parent, chunk);
            self.pool.register(s.blocks[i], parent, hash, chunk);
            s.hashes.push(hash);
        }
    }

    /// Makes room for `n` speculative tokens past the sequence's end without
    /// caching anything; a later [`append`](Self::append) of verified tokens
    /// uses these slots, and [`truncate`](Self::truncate) gives back the rest.
    pub fn reserve_lookahead(&mut self, h: SeqHandle, n: usize) -> Result<(), NotEnoughBlocks> {
        let s = self.seq(h);
        let want = self.blocks_for(s.tokens.len() + n);
        let need = want.saturating_sub(s.blocks.len());
        if need > self.pool.num_free() {
            return Err(NotEnoughBlocks {
                needed: need,
                free: self.pool.num_free(),
            });
        }
        let s = self.seqs.get_mut(&h).expect("unknown sequence handle");
        s.reserved = s.reserved.max(n);
        while s.blocks.len() < want {
            s.blocks.push(self.pool.allocate().expect("counted"));
        }
        Ok(())
    }

    /// Shortens `h` to its first `len` tokens and drops any lookahead
    /// reservation (rejected speculative tokens, or a rewind). Blocks past the
    /// end are released; a cached block cut into is replaced by a private copy.
    pub fn truncate(
        &mut self,
        h: SeqHandle,
        len: usize,
    ) -> Result<Vec<BlockCopy>, NotEnoughBlocks> {
        let bs = self.bs();
        let s = self.seq(h);
        let len = len.min(s.tokens.len());
        let keep_blocks = len.div_ceil(bs);
        let cut_block = (!len.is_multiple_of(bs)).then(|| s.blocks[len / bs]);
        let needs_copy =
            cut_block.is_some_and(|b| self.pool.is_cached(b) || self.pool.ref_count(b) > 1);
        if needs_copy && self.pool.num_free() == 0 {
            // The blocks we are about to release may cover it.
            let releasable = s.blocks[keep_blocks..]
                .iter()
                .filter(|b| self.pool.ref_count(**b) == 1)
                .count();
            if releasable == 0 {
                return Err(NotEnoughBlocks { needed: 1, free: 0 });
            }
        }
        let s = self.seqs.get_mut(&h).expect("unknown sequence handle");
        let tail: Vec<BlockId> = s.blocks.drain(keep_blocks..).collect();
        self.pool.release_chain(&tail);
        s.tokens.truncate(len);
        s.reserved = 0;
        s.hashes.truncate(len / bs);
        let mut copies = Vec::new();
        if needs_copy {
            let idx = len / bs;
            let old = s.blocks[idx];
            let fresh = self.pool.allocate().expect("checked above");
            copies.push(BlockCopy {
                src: old,
                dst: fresh,
                tokens: len % bs,
            });
            self.pool.release(old);
            s.blocks[idx] = fresh;
        }
        Ok(copies)
    }

    /// A new sequence sharing every block of `h` (reference counts, no copy).
    /// The shared partial last block is copied on the first write by either.
    pub fn fork(&mut self, h: SeqHandle) -> SeqHandle {
        let mut state = self.seq(h).clone();
        state.reserved = 0;
        let used = self.blocks_for(state.tokens.len());
        state.blocks.truncate(used);
        for &b in &state.blocks {
            self.pool.retain(b);
        }
        let nh = SeqHandle(self.next_handle);
        self.next_handle += 1;
        self.seqs.insert(nh, state);
        nh
    }

    /// Ends a sequence: its blocks go back tail first; its registered blocks
    /// stay cached until evicted.
    pub fn free(&mut self, h: SeqHandle) {
        if let Some(s) = self.seqs.remove(&h) {
            self.pool.release_chain(&s.blocks);
        }
    }

    /// Records (or stops recording) evicted blocks; see
    /// [`BlockPool::set_eviction_log`].
    pub fn set_eviction_log(&mut self, on: bool) {
        self.pool.set_eviction_log(on);
    }

    /// Cached blocks evicted since the last call (with the log on).
    pub fn take_evicted(&mut self) -> Vec<BlockId> {
        self.pool.take_evicted()
    }

    /// Forgets the cached prefix held by block `id`; see [`BlockPool::uncache`].
    pub fn uncache(&mut self, id: BlockId) -> bool {
        self.pool.uncache(id)
    }

    /// The block table of `h`, in token order.
    pub fn block_table(&self, h: SeqHandle) -> &[BlockId] {
        &self.seq(h).blocks
    }

    /// Tokens held by `h`.
    pub fn num_tokens(&self, h: SeqHandle) -> usize {
        self.seq(h).tokens.len()
    }

    /// The tokens held by `h`.
    pub fn tokens(&self, h: SeqHandle) -> &[TokenId] {
        &self.seq(h).tokens
    }

    /// Counters and current occupancy.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hit_tokens: self.hit_tokens,
            miss_tokens: self.miss_tokens,
            evictions: self.pool.evictions(),
            free_blocks: self.pool.num_free(),
            used_blocks: self.pool.num_used(),
            cached_unreferenced_blocks: self.pool.num_cached_unreferenced(),
        }
    }

    /// Checks that reference counts equal the number of table entries naming
    /// each block, that no block is lost, and the pool's own invariants.
    pub fn check(&self) -> Result<(), String> {
        self.pool.check()?;
        let mut refs = vec![0u32; self.pool.num_blocks()];
        for (h, s) in &self.seqs {
            if s.blocks.len() != (s.tokens.len() + s.reserved).div_ceil(self.bs()) {
                return Err(format!(
                    "{h:?}: {} blocks for {} tokens + {} reserved",
                    s.blocks.len(),
                    s.tokens.len(),
                    s.reserved
                ));
            }
            for b in &s.blocks {
                refs[b.0 as usize] += 1;
            }
        }
        for (i, &r) in refs.iter().enumerate() {
            let rc = self.pool.ref_count(BlockId(i as u32));
            if rc != r {
                return Err(format!("block {i}: ref count {rc}, tables hold {r}"));
            }
        }
        Ok(())
    }
}
