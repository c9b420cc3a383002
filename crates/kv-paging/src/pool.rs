//! The block pool: owns every block, counts references, keeps unreferenced
//! blocks in O(1) LRU free queues (one per block class), and maps content
//! hashes to cached blocks.
//!
//! **Classes.** A pool may hold blocks of several sizes — a server keeping
//! KV in its own formats has *open* blocks (full precision, where tokens are
//! written) and *sealed* blocks (quantized once full). Each class is a range
//! of block ids with its own free queue; one hash map serves both, so a
//! block's content is found whichever form holds it (the caller keys the
//! forms apart, see [`crate::block::sealed_form`]).

use std::collections::HashMap;

use siliceo_core::TokenId;

use crate::block::{BlockHash, BlockId};

/// Per-block state. The free queues are index-linked through `prev`/`next`,
/// with one sentinel slot per class after the blocks: no heap node per entry.
#[derive(Debug, Clone)]
struct Slot {
    ref_count: u32,
    /// Set while the block is a registered prefix block.
    hash: Option<BlockHash>,
    /// The content a journaled full registration announced (`hash` itself,
    /// or the content a sealed form holds).
    content: BlockHash,
    parent: BlockHash,
    /// Tokens registered (`block_size` for a full block, fewer for a
    /// partial one); 0 while unregistered.
    len: u32,
    prev: u32,
    next: u32,
    in_queue: bool,
}

#[derive(Debug, Clone, Copy)]
struct Class {
    start: u32,
    end: u32,
    free_len: usize,
    cached_unreferenced: usize,
}

/// Every block, its references, the LRU free queues and the prefix-hash map.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    classes: Vec<Class>,
    slots: Vec<Slot>,
    /// Tokens of registered blocks (`block_size` slots per block), to confirm a hash hit.
    tokens: Vec<TokenId>,
    cached: HashMap<BlockHash, BlockId>,
    /// Registered class-0 blocks by parent hash: where a prompt that diverges
    /// inside a block (or ends in one) finds the longest shared run of tokens.
    children: HashMap<BlockHash, Vec<BlockId>>,
    evictions: u64,
    /// Blocks evicted since the last [`BlockPool::take_evicted`], when logging is on.
    evicted: Option<Vec<BlockId>>,
    /// Full blocks registered and forgotten, in order, when journaling is on
    /// (see [`crate::KvCacheManager::take_kv_events`]).
    journal: Option<Vec<Journal>>,
}

/// A change to the set of cached full blocks, by content (one entry per
/// registered form).
#[derive(Debug, Clone)]
pub(crate) enum Journal {
    /// A full block holding `content` was registered.
    Stored {
        content: BlockHash,
        /// The content hash of the block before it; `None` for a first block.
        parent: Option<BlockHash>,
        tokens: Vec<TokenId>,
    },
    /// A full block holding `content` was forgotten (evicted, uncached).
    Forgotten { content: BlockHash },
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` tokens, one class.
    pub fn new(num_blocks: u32, block_size: u32) -> Self {
        BlockPool::with_classes(&[num_blocks], block_size)
    }

    /// A pool with one class of blocks per entry of `sizes` (class `c` owns
    /// the next `sizes[c]` ids), all free.
    ///
    /// # Panics
    /// With no class, a zero block size, or more blocks than ids.
    pub fn with_classes(sizes: &[u32], block_size: u32) -> Self {
        assert!(!sizes.is_empty(), "a pool needs at least one class");
        assert!(block_size > 0, "block_size must be at least 1");
        let total: u64 = sizes.iter().map(|&n| u64::from(n)).sum();
        assert!(
            total + sizes.len() as u64 <= u64::from(u32::MAX),
            "too many blocks for 32-bit ids and their sentinels"
        );
        let n = total as usize;
        let mut classes = Vec::with_capacity(sizes.len());
        let mut start = 0u32;
        for &size in sizes {
            classes.push(Class {
                start,
                end: start + size,
                free_len: size as usize,
                cached_unreferenced: 0,
            });
            start += size;
        }
        let mut slots = vec![
            Slot {
                ref_count: 0,
                hash: None,
                content: BlockHash(0),
                parent: BlockHash(0),
                len: 0,
                prev: 0,
                next: 0,
                in_queue: false,
            };
            n + sizes.len()
        ];
        for (c, class) in classes.iter().enumerate() {
            // Free queue initially start, start+1, …, end-1 in order.
            let sentinel = (n + c) as u32;
            let ids: Vec<u32> = (class.start..class.end).collect();
            let mut prev = sentinel;
            for &i in &ids {
                slots[i as usize].prev = prev;
                slots[i as usize].in_queue = true;
                slots[prev as usize].next = i;
                prev = i;
            }
            slots[prev as usize].next = sentinel;
            slots[sentinel as usize].prev = prev;
        }
        BlockPool {
            block_size: block_size as usize,
            classes,
            slots,
            tokens: vec![TokenId(0); n * block_size as usize],
            cached: HashMap::new(),
            children: HashMap::new(),
            evictions: 0,
            evicted: None,
            journal: None,
        }
    }

    fn sentinel(&self, class: usize) -> u32 {
        (self.num_blocks() + class) as u32
    }

    /// Blocks in the pool (all classes).
    pub fn num_blocks(&self) -> usize {
        self.classes.last().map_or(0, |c| c.end as usize)
    }

    /// Block classes.
    pub fn num_classes(&self) -> usize {
        self.classes.len()
    }

    /// Blocks of class `class`.
    pub fn class_size(&self, class: usize) -> usize {
        let c = self.classes[class];
        (c.end - c.start) as usize
    }

    /// The class block `id` belongs to.
    pub fn class_of(&self, id: BlockId) -> usize {
        self.classes
            .iter()
            .position(|c| id.0 < c.end)
            .expect("block id within the pool")
    }

    /// The first id of class `class` (a class's blocks are `start..start + size`).
    pub fn class_start(&self, class: usize) -> u32 {
        self.classes[class].start
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks nobody references (free or cached-but-unreferenced), all
    /// classes: what allocations can take right now.
    pub fn num_free(&self) -> usize {
        self.classes.iter().map(|c| c.free_len).sum()
    }

    /// Unreferenced blocks of class `class`.
    pub fn num_free_in(&self, class: usize) -> usize {
        self.classes[class].free_len
    }

    /// Blocks referenced by at least one sequence.
    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    /// Unreferenced blocks that still hold a cached prefix (reusable until evicted).
    pub fn num_cached_unreferenced(&self) -> usize {
        self.classes.iter().map(|c| c.cached_unreferenced).sum()
    }

    /// Blocks holding a registered prefix, referenced or not.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// Blocks registered with a full block of tokens (every form counted).
    pub fn num_cached_full(&self) -> usize {
        self.slots[..self.num_blocks()]
            .iter()
            .filter(|s| s.hash.is_some() && s.len as usize == self.block_size)
            .count()
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

    /// Tokens registered for `id` (0 when it is not registered).
    pub fn registered_len(&self, id: BlockId) -> usize {
        self.slots[id.0 as usize].len as usize
    }

    fn unlink(&mut self, i: u32) {
        let (p, n) = (self.slots[i as usize].prev, self.slots[i as usize].next);
        self.slots[p as usize].next = n;
        self.slots[n as usize].prev = p;
        self.slots[i as usize].in_queue = false;
        let c = self.class_of(BlockId(i));
        self.classes[c].free_len -= 1;
        if self.slots[i as usize].hash.is_some() {
            self.classes[c].cached_unreferenced -= 1;
        }
    }

    fn push_back(&mut self, i: u32) {
        let c = self.class_of(BlockId(i));
        let s = self.sentinel(c);
        let last = self.slots[s as usize].prev;
        self.slots[i as usize].prev = last;
        self.slots[i as usize].next = s;
        self.slots[last as usize].next = i;
        self.slots[s as usize].prev = i;
        self.slots[i as usize].in_queue = true;
        self.classes[c].free_len += 1;
        if self.slots[i as usize].hash.is_some() {
            self.classes[c].cached_unreferenced += 1;
        }
    }

    /// Takes the least recently freed block of class 0, evicting its cached
    /// prefix if it had one. `None` when every such block is referenced.
    pub fn allocate(&mut self) -> Option<BlockId> {
        self.allocate_in(0)
    }

    /// Takes the least recently freed block of class `class`.
    pub fn allocate_in(&mut self, class: usize) -> Option<BlockId> {
        let s = self.sentinel(class);
        let head = self.slots[s as usize].next;
        if head == s {
            return None;
        }
        self.unlink(head);
        if self.forget(head) {
            self.evictions += 1;
            if let Some(log) = &mut self.evicted {
                log.push(BlockId(head));
            }
        }
        self.slots[head as usize].ref_count = 1;
        Some(BlockId(head))
    }

    /// Drops block `i`'s registration from the maps; true when it had one.
    fn forget(&mut self, i: u32) -> bool {
        let slot = &mut self.slots[i as usize];
        let Some(h) = slot.hash.take() else {
            return false;
        };
        let full = slot.len as usize == self.block_size;
        slot.len = 0;
        let content = slot.content;
        if let (Some(j), true) = (&mut self.journal, full) {
            j.push(Journal::Forgotten { content });
        }
        let parent = slot.parent;
        self.cached.remove(&h);
        if let Some(kids) = self.children.get_mut(&parent) {
            kids.retain(|b| b.0 != i);
            if kids.is_empty() {
                self.children.remove(&parent);
            }
        }
        true
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

    /// Starts (or stops) journaling registered and forgotten full blocks.
    pub(crate) fn set_journal(&mut self, on: bool) {
        self.journal = on.then(Vec::new);
    }

    /// Records that the full block `id`, just registered, holds `content`
    /// after `parent` (the caller knows both; the pool only the key it was
    /// registered under). A no-op with journaling off.
    pub(crate) fn journal_stored(
        &mut self,
        id: BlockId,
        content: BlockHash,
        parent: Option<BlockHash>,
    ) {
        let Some(j) = &mut self.journal else {
            return;
        };
        self.slots[id.0 as usize].content = content;
        let at = id.0 as usize * self.block_size;
        j.push(Journal::Stored {
            content,
            parent,
            tokens: self.tokens[at..at + self.block_size].to_vec(),
        });
    }

    /// The journal since the last call.
    pub(crate) fn take_journal(&mut self) -> Vec<Journal> {
        self.journal
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Forgets the cached prefix of block `id` (nothing will match it again);
    /// its references are unchanged. Returns false when it was not cached.
    pub fn uncache(&mut self, id: BlockId) -> bool {
        let in_queue = self.slots[id.0 as usize].in_queue;
        if !self.forget(id.0) {
            return false;
        }
        if in_queue {
            let c = self.class_of(id);
            self.classes[c].cached_unreferenced -= 1;
        }
        true
    }

    /// Takes `n` blocks of class 0, or none at all when fewer are free.
    pub fn allocate_n(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free_in(0) {
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
    /// end of its free queue (a cached block stays findable until evicted).
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

    /// Registers block `id` as caching `tokens` after `parent` (a full block,
    /// or a partial one with fewer than `block_size` tokens). Returns false
    /// (and registers nothing) when that hash is already cached by another
    /// block or `id` is registered already.
    pub fn register(
        &mut self,
        id: BlockId,
        parent: BlockHash,
        hash: BlockHash,
        tokens: &[TokenId],
    ) -> bool {
        debug_assert!(!tokens.is_empty() && tokens.len() <= self.block_size);
        if self.cached.contains_key(&hash) || self.slots[id.0 as usize].hash.is_some() {
            return false;
        }
        self.cached.insert(hash, id);
        if self.class_of(id) == 0 {
            self.children.entry(parent).or_default().push(id);
        }
        let slot = &mut self.slots[id.0 as usize];
        slot.hash = Some(hash);
        slot.parent = parent;
        slot.len = tokens.len() as u32;
        if slot.in_queue {
            let c = self.class_of(id);
            self.classes[c].cached_unreferenced += 1;
        }
        let at = id.0 as usize * self.block_size;
        self.tokens[at..at + tokens.len()].copy_from_slice(tokens);
        true
    }

    /// The cached block for `hash`, confirmed by its parent and tokens (all of
    /// them: a block registered with more or fewer tokens does not match).
    pub fn lookup(
        &self,
        parent: BlockHash,
        hash: BlockHash,
        tokens: &[TokenId],
    ) -> Option<BlockId> {
        let id = *self.cached.get(&hash)?;
        let at = id.0 as usize * self.block_size;
        let slot = &self.slots[id.0 as usize];
        (slot.parent == parent
            && slot.len as usize == tokens.len()
            && self.tokens[at..at + tokens.len()] == *tokens)
            .then_some(id)
    }

    /// Among the class-0 blocks registered after `parent`, the one whose
    /// tokens share the longest run with the start of `tokens`, and that
    /// run's length (at least one token).
    pub fn longest_shared(
        &self,
        parent: BlockHash,
        tokens: &[TokenId],
    ) -> Option<(BlockId, usize)> {
        let kids = self.children.get(&parent)?;
        let mut best: Option<(BlockId, usize)> = None;
        for &id in kids {
            let len = self.slots[id.0 as usize].len as usize;
            let at = id.0 as usize * self.block_size;
            let shared = self.tokens[at..at + len]
                .iter()
                .zip(tokens)
                .take_while(|(a, b)| a == b)
                .count();
            if shared > best.map_or(0, |b| b.1) {
                best = Some((id, shared));
            }
        }
        best
    }

    /// The free queue of class 0 from least to most recently freed (for tests
    /// and debugging).
    pub fn free_queue(&self) -> Vec<BlockId> {
        self.free_queue_of(0)
    }

    /// The free queue of class `class`, least recently freed first.
    pub fn free_queue_of(&self, class: usize) -> Vec<BlockId> {
        let s = self.sentinel(class);
        let mut out = Vec::with_capacity(self.classes[class].free_len);
        let mut i = self.slots[s as usize].next;
        while i != s {
            out.push(BlockId(i));
            i = self.slots[i as usize].next;
        }
        out
    }

    /// Checks the pool's internal consistency; returns what is wrong.
    pub fn check(&self) -> Result<(), String> {
        let mut seen = vec![false; self.num_blocks()];
        for (c, class) in self.classes.iter().enumerate() {
            let queue = self.free_queue_of(c);
            if queue.len() != class.free_len {
                return Err(format!(
                    "class {c}: free queue holds {} blocks, counter says {}",
                    queue.len(),
                    class.free_len
                ));
            }
            for b in &queue {
                let slot = &self.slots[b.0 as usize];
                if !(class.start..class.end).contains(&b.0) {
                    return Err(format!("block {} in class {c}'s free queue", b.0));
                }
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
            let unref_cached = queue
                .iter()
                .filter(|b| self.slots[b.0 as usize].hash.is_some())
                .count();
            if unref_cached != class.cached_unreferenced {
                return Err(format!(
                    "class {c}: {unref_cached} cached blocks are free, counter says {}",
                    class.cached_unreferenced
                ));
            }
        }
        for (i, slot) in self.slots[..self.num_blocks()].iter().enumerate() {
            if slot.ref_count == 0 && !seen[i] {
                return Err(format!(
                    "unreferenced block {i} is not in the free queue (leaked)"
                ));
            }
            if let Some(h) = slot.hash {
                if self.cached.get(&h) != Some(&BlockId(i as u32)) {
                    return Err(format!(
                        "block {i} has a hash the map does not point back from"
                    ));
                }
                let listed = self
                    .children
                    .get(&slot.parent)
                    .is_some_and(|k| k.contains(&BlockId(i as u32)));
                if listed != (self.class_of(BlockId(i as u32)) == 0) {
                    return Err(format!("block {i}: children index disagrees"));
                }
            }
        }
        let indexed: usize = self.children.values().map(Vec::len).sum();
        let registered0 = self.slots[..self.num_blocks()]
            .iter()
            .enumerate()
            .filter(|(i, s)| s.hash.is_some() && self.class_of(BlockId(*i as u32)) == 0)
            .count();
        if indexed != registered0 {
            return Err(format!(
                "children index lists {indexed} blocks, {registered0} are registered"
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

    #[test]
    fn classes_have_their_own_ids_and_queues() {
        let mut p = BlockPool::with_classes(&[2, 3], 4);
        assert_eq!(
            (p.num_blocks(), p.num_free_in(0), p.num_free_in(1)),
            (5, 2, 3)
        );
        assert_eq!(p.allocate_in(1), Some(BlockId(2)));
        assert_eq!(p.class_of(BlockId(2)), 1);
        assert_eq!(p.allocate(), Some(BlockId(0)));
        assert_eq!(p.allocate(), Some(BlockId(1)));
        assert_eq!(p.allocate(), None);
        assert_eq!(p.num_free_in(1), 2);
        p.release(BlockId(0));
        assert_eq!(p.free_queue_of(1), vec![BlockId(3), BlockId(4)]);
        assert_eq!(p.free_queue_of(0), vec![BlockId(0)]);
        p.check().unwrap();
    }

    #[test]
    fn partial_blocks_match_by_their_longest_shared_run() {
        let mut p = BlockPool::with_classes(&[3, 1], 4);
        let root = BlockHash(1);
        let t = |v: &[u32]| v.iter().map(|&x| TokenId(x)).collect::<Vec<_>>();
        let (a, b, s) = (
            p.allocate().unwrap(),
            p.allocate().unwrap(),
            p.allocate_in(1).unwrap(),
        );
        let full = t(&[1, 2, 3, 4]);
        assert!(p.register(a, root, crate::block::hash_block(root, &full), &full));
        let part = t(&[1, 2, 9]);
        assert!(p.register(b, root, crate::block::hash_block(root, &part), &part));
        // Sealed blocks are never partially reused: not indexed.
        assert!(p.register(s, root, BlockHash(99), &full));
        assert_eq!(p.longest_shared(root, &t(&[1, 2, 3, 7])), Some((a, 3)));
        assert_eq!(p.longest_shared(root, &t(&[1, 2, 9, 9])), Some((b, 3)));
        assert_eq!(p.longest_shared(root, &t(&[5])), None);
        assert_eq!(p.registered_len(b), 3);
        // A lookup needs the registered length exactly.
        assert_eq!(
            p.lookup(root, crate::block::hash_block(root, &part), &part),
            Some(b)
        );
        assert!(p.uncache(b));
        assert_eq!(p.longest_shared(root, &t(&[1, 2, 9])), Some((a, 2)));
        p.check().unwrap();
    }
}
