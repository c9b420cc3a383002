//! The block pool: owns every block, counts references, keeps unreferenced
//! blocks in an O(1) LRU free queue, and maps content hashes to cached blocks.

use std::collections::HashMap;

use siliceo_core::TokenId;

use crate::block::{BlockHash, BlockId};

/// Per-block state. The free queue is index-linked through `prev`/`next`, with
/// one sentinel slot at index `num_blocks`: no heap node per entry.
#[derive(Debug, Clone)]
struct Slot {
    ref_count: u32,
    /// Set while the block is a full, registered prefix block.
    hash: Option<BlockHash>,
    parent: BlockHash,
    prev: u32,
    next: u32,
    in_queue: bool,
}

/// Every block, its references, the LRU free queue and the prefix-hash map.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    slots: Vec<Slot>,
    /// Tokens of registered blocks (`block_size` per block), to confirm a hash hit.
    tokens: Vec<TokenId>,
    free_len: usize,
    cached: HashMap<BlockHash, BlockId>,
    cached_unreferenced: usize,
    evictions: u64,
    /// Blocks evicted since the last [`BlockPool::take_evicted`], when logging is on.
    evicted: Option<Vec<BlockId>>,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` tokens.
    pub fn new(num_blocks: u32, block_size: u32) -> Self {
        assert!(
            num_blocks < u32::MAX,
            "num_blocks must leave room for the sentinel"
        );
        assert!(block_size > 0, "block_size must be at least 1");
        let n = num_blocks as usize;
        let sentinel = num_blocks;
        let slots = (0..=n)
            .map(|i| Slot {
                ref_count: 0,
                hash: None,
                parent: BlockHash(0),
                // Free queue initially 0, 1, …, n-1 in order.
                prev: if i == 0 { sentinel } else { i as u32 - 1 },
                next: if i + 1 >= n { sentinel } else { i as u32 + 1 },
                in_queue: i < n,
            })
            .collect::<Vec<_>>();
        let mut pool = BlockPool {
            block_size: block_size as usize,
            slots,
            tokens: vec![TokenId(0); n * block_size as usize],
            free_len: n,
            cached: HashMap::new(),
            cached_unreferenced: 0,
            evictions: 0,
            evicted: None,
        };
        let s = sentinel as usize;
        pool.slots[s].next = if n == 0 { sentinel } else { 0 };
        pool.slots[s].prev = if n == 0 { sentinel } else { n as u32 - 1 };
        pool.slots[s].in_queue = false;
        pool
    }

    fn sentinel(&self) -> u32 {
        (self.slots.len() - 1) as u32
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.slots.len() - 1
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks nobody references (free or cached-but-unreferenced): what an
    /// allocation can take right now.
    pub fn num_free(&self) -> usize {
        self.free_len
    }

    /// Blocks referenced by at least one sequence.
    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.free_len
    }

    /// Unreferenced blocks that still hold a cached prefix (reusable until evicted).
    pub fn num_cached_unreferenced(&self) -> usize {
        self.cached_unreferenced
    }

    /// Blocks holding a registered prefix, referenced or not.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// Cached blocks evicted to make room so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// References to `id`.
    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.slots[id.0 as usize].ref_count
    }

    /// Whether `id` is a registered prefix block.
    pub fn is_cached(&self, id: BlockId) -> bool {
        self.slots[id.0 as usize].hash.is_some()
    }

    fn unlink(&mut self, i: u32) {
        let (p, n) = (self.slots[i as usize].prev, self.slots[i as usize].next);
        self.slots[p as usize].next = n;
        self.slots[n as usize].prev = p;
        self.slots[i as usize].in_queue = false;
        self.free_len -= 1;
        if self.slots[i as usize].hash.is_some() {
            self.cached_unreferenced -= 1;
        }
    }

    fn push_back(&mut self, i: u32) {
        let s = self.sentinel();
        let last = self.slots[s as usize].prev;
        self.slots[i as usize].prev = last;
        self.slots[i as usize].next = s;
        self.slots[last as usize].next = i;
        self.slots[s as usize].prev = i;
        self.slots[i as usize].in_queue = true;
        self.free_len += 1;
        if self.slots[i as usize].hash.is_some() {
            self.cached_unreferenced += 1;
        }
    }

    /// Takes the least recently freed block, evicting its cached prefix if it
    /// had one. `None` when every block is referenced.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let s = self.sentinel();
        let head = self.slots[s as usize].next;
        if head == s {
            return None;
        }
        self.unlink(head);
        let slot = &mut self.slots[head as usize];
        if let Some(h) = slot.hash.take() {
            self.cached.remove(&h);
            self.evictions += 1;
            if let Some(log) = &mut self.evicted {
                log.push(BlockId(head));
            }
        }
        slot.ref_count = 1;
        Some(BlockId(head))
    }

    /// Starts (or stops) recording which cached blocks allocations evict, for
    /// a caller that keeps something per cached block (e.g. the engine cells
    /// holding it) and must drop it when the block is reused.
    pub fn set_eviction_log(&mut self, on: bool) {
        self.evicted = on.then(Vec::new);
    }

    /// Cached blocks evicted since the last call, in eviction order (empty
    /// when the log is off).
    pub fn take_evicted(&mut self) -> Vec<BlockId> {
        self.evicted
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Forgets the cached prefix of block `id` (nothing will match it again);
    /// its references are unchanged. Returns false when it was not cached.
    pub fn uncache(&mut self, id: BlockId) -> bool {
        let slot = &mut self.slots[id.0 as usize];
        let Some(h) = slot.hash.take() else {
            return false;
        };
        self.cached.remove(&h);
        if slot.in_queue {
            self.cached_unreferenced -= 1;
        }
        true
    }

    /// Takes `n` blocks, or none at all when fewer are free.
    pub fn allocate_n(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free_len {
            return None;
        }
        Some(
            (0..n)
                .map(|_| self.allocate().expect("counted free"))
                .collect(),
        )
    }

    /// Adds a reference (pulling an unreferenced cached block out of the free queue).
    pub fn retain(&mut self, id: BlockId) {
        let i = id.0;
        if self.slots[i as usize].ref_count == 0 {
            debug_assert!(self.slots[i as usize].in_queue);
            self.unlink(i);
        }
        self.slots[i as usize].ref_count += 1;
    }

    /// Drops a reference; the last one puts the block at the most-recently-used
    /// end of the free queue (a cached block stays findable until evicted).
    pub fn release(&mut self, id: BlockId) {
        let slot = &mut self.slots[id.0 as usize];
        assert!(slot.ref_count > 0, "release of unreferenced block {}", id.0);
        slot.ref_count -= 1;
        if slot.ref_count == 0 {
            self.push_back(id.0);
        }
    }

    /// Releases a chain of blocks tail first, so the tail of a prefix is
    /// evicted before its head (a head without its tail is still useful).
    pub fn release_chain(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            self.release(id);
        }
    }

    /// Registers the full block `id` as caching `tokens` after `parent`.
    /// Returns false (and registers nothing) when that hash is already cached
    /// by another block.
    pub fn register(
        &mut self,
        id: BlockId,
        parent: BlockHash,
        hash: BlockHash,
        tokens: &[TokenId],
    ) -> bool {
        debug_assert_eq!(tokens.len(), self.block_size);
        if self.cached.contains_key(&hash) || self.slots[id.0 as usize].hash.is_some() {
            return false;
        }
        self.cached.insert(hash, id);
        let slot = &mut self.slots[id.0 as usize];
        slot.hash = Some(hash);
        slot.parent = parent;
        let at = id.0 as usize * self.block_size;
        self.tokens[at..at + self.block_size].copy_from_slice(tokens);
        true
    }

    /// The cached block for `hash`, confirmed by its parent and tokens.
    pub fn lookup(
        &self,
        parent: BlockHash,
        hash: BlockHash,
        tokens: &[TokenId],
    ) -> Option<BlockId> {
        let id = *self.cached.get(&hash)?;
        let at = id.0 as usize * self.block_size;
        let slot = &self.slots[id.0 as usize];
        (slot.parent == parent && self.tokens[at..at + self.block_size] == *tokens).then_some(id)
    }

    /// The free queue from least to most recently freed (for tests and debugging).
    pub fn free_queue(&self) -> Vec<BlockId> {
        let s = self.sentinel();
        let mut out = Vec::with_capacity(self.free_len);
        let mut i = self.slots[s as usize].next;
        while i != s {
            out.push(BlockId(i));
            i = self.slots[i as usize].next;
        }
        out
    }

    /// Checks the pool's internal consistency; returns what is wrong.
    pub fn check(&self) -> Result<(), String> {
        let queue = self.free_queue();
        if queue.len() != self.free_len {
            return Err(format!(
                "free queue holds {} blocks, counter says {}",
                queue.len(),
                self.free_len
            ));
        }
        let mut seen = vec![false; self.num_blocks()];
        for b in &queue {
            let slot = &self.slots[b.0 as usize];
            if seen[b.0 as usize] {
                return Err(format!("block {} twice in the free queue", b.0));
            }
            seen[b.0 as usize] = true;
            if slot.ref_count != 0 || !slot.in_queue {
                return Err(format!(
                    "block {} in the free queue with {} references",
                    b.0, slot.ref_count
                ));
            }
        }
        for (i, slot) in self.slots[..self.num_blocks()].iter().enumerate() {
            if slot.ref_count == 0 && !seen[i] {
                return Err(format!(
                    "unreferenced block {i} is not in the free queue (leaked)"
                ));
            }
            if let Some(h) = slot.hash
                && self.cached.get(&h) != Some(&BlockId(i as u32))
            {
                return Err(format!(
                    "block {i} has a hash the map does not point back from"
                ));
            }
        }
        let unref_cached = queue
            .iter()
            .filter(|b| self.slots[b.0 as usize].hash.is_some())
            .count();
        if unref_cached != self.cached_unreferenced {
            return Err(format!(
                "{unref_cached} cached blocks are free, counter says {}",
                self.cached_unreferenced
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_until_empty_then_release_in_lru_order() {
        let mut p = BlockPool::new(4, 2);
        let all = p.allocate_n(4).unwrap();
        assert_eq!(all, vec![BlockId(0), BlockId(1), BlockId(2), BlockId(3)]);
        assert!(p.allocate().is_none());
        assert!(p.allocate_n(1).is_none());
        p.release_chain(&[BlockId(2), BlockId(0)]);
        // Tail first: 0 was released last, so it is the most recently used.
        assert_eq!(p.free_queue(), vec![BlockId(0), BlockId(2)]);
        p.check().unwrap();
        // Over-asking takes nothing.
        assert!(p.allocate_n(3).is_none());
        assert_eq!(p.num_free(), 2);
    }

    #[test]
    fn cached_blocks_survive_until_evicted() {
        let mut p = BlockPool::new(2, 2);
        let b = p.allocate().unwrap();
        let root = BlockHash(7);
        let toks = [TokenId(1), TokenId(2)];
        let h = crate::block::hash_block(root, &toks);
        assert!(p.register(b, root, h, &toks));
        p.release(b);
        assert_eq!((p.num_free(), p.num_cached_unreferenced()), (2, 1));
        // A lookup finds it; wrong tokens under the same hash do not.
        assert_eq!(p.lookup(root, h, &toks), Some(b));
        assert_eq!(p.lookup(root, h, &[TokenId(9), TokenId(2)]), None);
        p.retain(b);
        assert_eq!((p.num_free(), p.num_cached_unreferenced()), (1, 0));
        p.release(b);
        // Allocating both blocks evicts the cached one (LRU: the other goes first).
        let first = p.allocate().unwrap();
        assert_ne!(first, b);
        assert_eq!(p.evictions(), 0);
        let second = p.allocate().unwrap();
        assert_eq!(second, b);
        assert_eq!(p.evictions(), 1);
        assert_eq!(p.lookup(root, h, &toks), None);
        p.check().unwrap();
    }
}
