//! Per-sequence policy over the pool: block tables, prefix matching, appends
//! with copy-on-write and sealing, forks, lookahead reservations, truncation
//! and freeing.
//!
//! **Sealing** (optional, [`KvConfig::sealing`]): a store that keeps KV in a
//! quantized format writes each token into an *open* (full-precision) block
//! and quantizes a full block into a *sealed* block once it is older than the
//! full-precision tail. A sequence's table is its sealed blocks, then its
//! open ones; [`KvConfig::sealed_at`] says how many blocks are sealed at a
//! length, a function of the length alone, so a query at position `p` sees
//! the same bytes however the tokens before it were batched, chunked or found
//! in the prefix cache. Appends report each seal ([`BlockSeal`]) with the
//! length from which it holds; a block filled and sealed within one append
//! never gets an open block (its rows live in the caller's scratch for that
//! step), and a sealed block's open source is released only at
//! [`KvCacheManager::finish_step`], after the step that read it.
//!
//! **Sliding window** (optional, [`KvConfig::window`]): for layers whose
//! queries see only their last [`Window::tokens`] positions, a sequence's
//! table releases the blocks its window has passed as its tokens are
//! committed; their entries become [`BlockId::NONE`] (always a leading run of
//! the table). A released block that is registered stays cached until
//! allocation needs it, so a prefix is matched when the blocks its window
//! covers are cached, whether or not the blocks before them still are.

use std::collections::HashMap;

use siliceo_core::TokenId;

use crate::block::{BlockHash, BlockId, CacheKeys, hash_block, sealed_form};
use crate::pool::{BlockPool, Journal};

const OPEN: usize = 0;
const SEALED: usize = 1;

/// Sealed blocks: full blocks older than the tail are quantized into a second
/// class of (smaller) blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sealing {
    /// Sealed blocks in the pool.
    pub blocks: u32,
    /// Most recent tokens kept open (full precision) beyond the current
    /// partial block.
    pub tail_tokens: u32,
}

/// The sliding window of a [`KvCacheManager`] that serves windowed layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Positions a query sees, its own included (llama.cpp's `n_swa`: a
    /// query at `p` reads keys at `p - tokens + 1 ..= p`).
    pub tokens: u32,
    /// Tokens kept past the window: a truncation by up to this many tokens
    /// never reaches a released block.
    pub margin: u32,
    /// The most tokens one sequence appends before its blocks are committed
    /// (a prefill chunk plus a speculative draft): what bounds a sequence's
    /// blocks in [`KvCacheManager::blocks_for_sequence`].
    pub max_append: u32,
}

/// The windowed group of a [`crate::KvGroups`]: the blocks of the layers
/// with a sliding window, apart from the global layers' blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowedGroup {
    /// Open blocks.
    pub num_blocks: u32,
    /// Sealed blocks (with [`KvConfig::sealing`]; its tail applies).
    pub sealed_blocks: u32,
    /// The window.
    pub window: Window,
}

impl WindowedGroup {
    /// Pools in which `running` sequences never run short (each holding
    /// what its window reaches across a step, the step's
    /// [`Window::max_append`] tokens shared among them), plus `cached`
    /// windows' worth for cached prefixes. `tail_tokens`: the sealing
    /// tail, `None` without sealing (no sealed blocks).
    pub fn for_running(
        window: Window,
        running: u32,
        block_size: u32,
        tail_tokens: Option<u32>,
        cached: u32,
    ) -> WindowedGroup {
        let blocks = |tokens: u32| tokens.div_ceil(block_size);
        let reach = window.tokens + window.margin;
        let step = blocks(window.max_append);
        let (open, sealed) = match tail_tokens {
            // Across a step: the blocks its window reaches and the partial
            // one, a new partial block, and a copy on write.
            None => (
                running * (blocks(reach) + 3) + step + cached * blocks(reach),
                0,
            ),
            // Open: the tail (or the window, if shorter), the partial
            // block, its seal sources held to the step's end, a new partial
            // block and a copy. Sealed: the window past the tail.
            Some(tail) => (
                running * (blocks(tail.min(reach)) + 4) + step + cached * blocks(tail.min(reach)),
                running * (blocks(reach.saturating_sub(tail)) + 2)
                    + step
                    + cached * blocks(reach.saturating_sub(tail)),
            ),
        };
        WindowedGroup {
            num_blocks: open,
            sealed_blocks: sealed,
            window,
        }
    }
}

/// Sizes of a [`KvCacheManager`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvConfig {
    /// Open blocks in the pool (every block when nothing is sealed).
    pub num_blocks: u32,
    /// Tokens per block (64 by default).
    pub block_size: u32,
    /// Whether blocks are registered and reused across sequences.
    pub prefix_caching: bool,
    /// Quantized blocks for what leaves the full-precision tail, if any.
    pub sealing: Option<Sealing>,
    /// Whether a sequence's partial last block is cached too (its caller can
    /// share a block's first rows and copy them on write).
    pub cache_partial: bool,
    /// A sliding window whose passed blocks are released, if any.
    pub window: Option<Window>,
    /// A second group of blocks for windowed layers, kept by
    /// [`crate::KvGroups`] (a [`KvCacheManager`] is one group and ignores it).
    pub windowed: Option<WindowedGroup>,
}

impl Default for KvConfig {
    fn default() -> Self {
        KvConfig {
            num_blocks: 1024,
            block_size: 64,
            prefix_caching: true,
            sealing: None,
            cache_partial: false,
            window: None,
            windowed: None,
        }
    }
}

impl KvConfig {
    /// Blocks a sequence of `len` tokens holds sealed: every full block that
    /// ends at least `tail_tokens` before the end (0 without sealing).
    pub fn sealed_at(&self, len: usize) -> usize {
        match self.sealing {
            None => 0,
            Some(s) => len.saturating_sub(s.tail_tokens as usize) / self.block_size as usize,
        }
    }

    /// Leading blocks a sequence of `len` committed tokens has released: every
    /// block that ends at least `window + margin` tokens before the end (0
    /// without a window).
    pub fn released_at(&self, len: usize) -> usize {
        match self.window {
            None => 0,
            Some(w) => {
                len.saturating_sub((w.tokens + w.margin) as usize) / self.block_size as usize
            }
        }
    }

    /// The length at which block `index` is sealed.
    pub fn seal_len(&self, index: usize) -> usize {
        let tail = self.sealing.map_or(0, |s| s.tail_tokens as usize);
        (index + 1) * self.block_size as usize + tail
    }
}

/// Blocks of each class, in the global group and (with
/// [`KvConfig::windowed`]) the windowed one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockCount {
    /// Open (full-precision) blocks.
    pub open: usize,
    /// Sealed blocks.
    pub sealed: usize,
    /// Open blocks of the windowed group ([`crate::KvGroups`]).
    pub windowed_open: usize,
    /// Sealed blocks of the windowed group.
    pub windowed_sealed: usize,
}

impl BlockCount {
    /// Whether every class of `self` fits in `free`.
    pub fn fits(&self, free: BlockCount) -> bool {
        self.open <= free.open
            && self.sealed <= free.sealed
            && self.windowed_open <= free.windowed_open
            && self.windowed_sealed <= free.windowed_sealed
    }

    /// Every class together.
    pub fn total(&self) -> usize {
        self.open + self.sealed + self.windowed_open + self.windowed_sealed
    }

    /// Class by class, what `self` lacks of `want` (0 where it has enough).
    pub fn short_of(self, want: BlockCount) -> BlockCount {
        BlockCount {
            open: want.open.saturating_sub(self.open),
            sealed: want.sealed.saturating_sub(self.sealed),
            windowed_open: want.windowed_open.saturating_sub(self.windowed_open),
            windowed_sealed: want.windowed_sealed.saturating_sub(self.windowed_sealed),
        }
    }

    /// A windowed group's count (kept by its manager as open and sealed) in
    /// the windowed fields.
    pub fn as_windowed(self) -> BlockCount {
        BlockCount {
            open: 0,
            sealed: 0,
            windowed_open: self.open,
            windowed_sealed: self.sealed,
        }
    }
}

impl std::ops::Add for BlockCount {
    type Output = BlockCount;

    /// Class by class, the sum.
    fn add(self, o: BlockCount) -> BlockCount {
        BlockCount {
            open: self.open + o.open,
            sealed: self.sealed + o.sealed,
            windowed_open: self.windowed_open + o.windowed_open,
            windowed_sealed: self.windowed_sealed + o.windowed_sealed,
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
    /// Whether the blocks are the windowed group's ([`crate::KvGroups`]).
    pub windowed: bool,
}

/// Block `index` of a sequence is sealed: from length `at_len` on it is read
/// from sealed block `dst`, before that from its open form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSeal {
    /// Index of the block in the sequence's table.
    pub index: usize,
    /// The open block holding its rows, or `None` when the block was filled
    /// and sealed by the same append (its rows are the caller's scratch).
    pub src: Option<BlockId>,
    /// The sealed block now in the table.
    pub dst: BlockId,
    /// The sequence length from which queries see `dst`.
    pub at_len: usize,
    /// Whether the caller must quantize the rows into `dst`; false when `dst`
    /// is a cached block already holding them.
    pub encode: bool,
    /// Whether the blocks are the windowed group's ([`crate::KvGroups`]).
    pub windowed: bool,
}

/// Work for the block store that a table change implies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockOp {
    /// Copy rows of an open block.
    Copy(BlockCopy),
    /// Seal an open block.
    Seal(BlockSeal),
}

/// A change to the full blocks the prefix cache holds, by content (a block
/// cached in both its open and sealed forms counts once): what a gateway that
/// routes on cached prefixes (SMG's cache_aware policy) indexes. See
/// [`KvCacheManager::take_kv_events`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// A block's content became cached.
    Stored {
        /// Its content hash (chained on its prefix).
        hash: BlockHash,
        /// The content hash of the block before it; `None` for a first block.
        parent: Option<BlockHash>,
        /// Its tokens (`block_size` of them).
        tokens: Vec<TokenId>,
    },
    /// No block holds this content any more.
    Removed {
        /// The content hash a `Stored` event announced.
        hash: BlockHash,
    },
}

/// Registered full-block forms per content, while events are on: what turns
/// the pool's journal into [`KvEvent`]s.
type EventState = HashMap<BlockHash, u32>;

/// Counters for metrics. Hits and misses count prompt tokens looked up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Prompt tokens served from cached blocks.
    pub hit_tokens: u64,
    /// Prompt tokens looked up and not found (or not cacheable).
    pub miss_tokens: u64,
    /// Cached blocks evicted to make room.
    pub evictions: u64,
    /// Blocks free right now (including cached-but-unreferenced), all classes.
    pub free_blocks: usize,
    /// Blocks referenced right now, all classes.
    pub used_blocks: usize,
    /// Unreferenced blocks still holding a cached prefix.
    pub cached_unreferenced_blocks: usize,
    /// Referenced blocks that more than one sequence references (prefix hits,
    /// forks).
    pub shared_blocks: usize,
    /// Referenced sealed blocks (a subset of `used_blocks`).
    pub used_sealed_blocks: usize,
    /// The windowed group's free blocks ([`crate::KvGroups`]; 0 without one).
    pub windowed_free_blocks: usize,
    /// The windowed group's referenced blocks.
    pub windowed_used_blocks: usize,
    /// The windowed group's referenced sealed blocks.
    pub windowed_used_sealed_blocks: usize,
}

#[derive(Debug, Clone)]
struct SeqState {
    root: BlockHash,
    /// Sealed blocks first, then open ones; covers tokens plus `reserved`.
    blocks: Vec<BlockId>,
    /// Leading sealed entries of `blocks` (released ones included).
    sealed: usize,
    /// Leading entries released by the window ([`BlockId::NONE`]).
    released: usize,
    tokens: Vec<TokenId>,
    /// Content hashes of the leading full blocks that are committed.
    hashes: Vec<BlockHash>,
    /// Leading blocks whose current form has been offered to the cache (a
    /// seal sets it back: the sealed form is offered at the next commit).
    offered: usize,
    /// Slots reserved past `tokens` for speculative lookahead.
    reserved: usize,
    /// Blocks held for this sequence's coming appends ([`KvCacheManager::reserve`]).
    spare: Vec<BlockId>,
}

/// Block tables of all sequences over one [`BlockPool`].
///
/// Blocks a step reads as a source — the open block a seal quantizes, the
/// shared block a copy-on-write copies — stay referenced until
/// [`finish_step`](KvCacheManager::finish_step), so nothing planned in the
/// same step can be given them and overwrite them first.
#[derive(Debug, Clone)]
pub struct KvCacheManager {
    config: KvConfig,
    pool: BlockPool,
    seqs: HashMap<SeqHandle, SeqState>,
    next_handle: u64,
    hit_tokens: u64,
    miss_tokens: u64,
    /// Open blocks sealed away during the current step, released at
    /// [`KvCacheManager::finish_step`].
    deferred: Vec<BlockId>,
    /// Set while cache events are recorded.
    events: Option<EventState>,
}

/// What the cache holds of a prompt's start: per full block its open and
/// sealed forms, then a shared run of a partial block.
#[derive(Debug, Default)]
struct PrefixPlan {
    /// Leading full blocks behind the window: none taken, their hashes in
    /// `hashes`.
    released: usize,
    /// Content hashes of every matched full block, released ones included.
    hashes: Vec<BlockHash>,
    /// Per matched full block after the released ones: the block to take,
    /// whether it must be sealed (only its open form is cached).
    full: Vec<(BlockId, bool)>,
    /// A block whose first rows continue the prompt, and how many.
    partial: Option<(BlockId, usize)>,
}

impl PrefixPlan {
    fn tokens(&self, bs: usize) -> usize {
        self.hashes.len() * bs + self.partial.map_or(0, |p| p.1)
    }
}

impl KvCacheManager {
    /// A manager over a fresh pool.
    pub fn new(config: KvConfig) -> Self {
        let mut classes = vec![config.num_blocks];
        if let Some(s) = config.sealing {
            classes.push(s.blocks);
        }
        KvCacheManager {
            config,
            pool: BlockPool::with_classes(&classes, config.block_size),
            seqs: HashMap::new(),
            next_handle: 0,
            hit_tokens: 0,
            miss_tokens: 0,
            deferred: Vec::new(),
            events: None,
        }
    }

    /// Starts (or stops) recording which full blocks the prefix cache gains
    /// and loses; [`take_kv_events`](Self::take_kv_events) hands them out.
    /// Turn it on before the first request: blocks cached earlier are not
    /// announced.
    pub fn set_kv_events(&mut self, on: bool) {
        self.pool.set_journal(on);
        self.events = on.then(EventState::default);
    }

    /// The cache's changes since the last call, in order: a content is
    /// `Stored` when its first form is registered and `Removed` when its last
    /// one is evicted or uncached. Empty while events are off.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        let Some(forms) = &mut self.events else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for j in self.pool.take_journal() {
            match j {
                Journal::Stored {
                    content,
                    parent,
                    tokens,
                } => {
                    let n = forms.entry(content).or_insert(0);
                    *n += 1;
                    if *n == 1 {
                        out.push(KvEvent::Stored {
                            hash: content,
                            parent,
                            tokens,
                        });
                    }
                }
                Journal::Forgotten { content } => {
                    let Some(n) = forms.get_mut(&content) else {
                        // Registered before events were on.
                        continue;
                    };
                    *n -= 1;
                    if *n == 0 {
                        forms.remove(&content);
                        out.push(KvEvent::Removed { hash: content });
                    }
                }
            }
        }
        out
    }

    /// Distinct full-block contents the cache holds, as the events announced
    /// them (0 while events are off). Call after
    /// [`take_kv_events`](Self::take_kv_events).
    pub fn cached_contents(&self) -> usize {
        self.events.as_ref().map_or(0, HashMap::len)
    }

    /// The configuration.
    pub fn config(&self) -> KvConfig {
        self.config
    }

    /// The pool (read-only: counts, free queue, reference counts).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Unreferenced blocks of each class (cached ones included).
    pub fn free_blocks(&self) -> BlockCount {
        BlockCount {
            open: self.pool.num_free_in(OPEN),
            sealed: if self.config.sealing.is_some() {
                self.pool.num_free_in(SEALED)
            } else {
                0
            },
            ..BlockCount::default()
        }
    }

    /// Blocks of each class in the pool.
    pub fn capacity(&self) -> BlockCount {
        BlockCount {
            open: self.config.num_blocks as usize,
            sealed: self.config.sealing.map_or(0, |s| s.blocks as usize),
            ..BlockCount::default()
        }
    }

    /// Whether `id` is a sealed block (else open, or [`BlockId::NONE`]).
    pub fn is_sealed_block(&self, id: BlockId) -> bool {
        self.config.sealing.is_some() && id != BlockId::NONE && self.pool.class_of(id) == SEALED
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

    fn class_count(&self, id: BlockId) -> BlockCount {
        if self.is_sealed_block(id) {
            BlockCount {
                sealed: 1,
                ..BlockCount::default()
            }
        } else {
            BlockCount {
                open: 1,
                ..BlockCount::default()
            }
        }
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
                sealed: 0,
                released: 0,
                tokens: Vec::new(),
                hashes: Vec::new(),
                offered: 0,
                reserved: 0,
                spare: Vec::new(),
            },
        );
        h
    }

    /// Sequences alive.
    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// The handles of the sequences alive.
    pub(crate) fn handles(&self) -> impl Iterator<Item = SeqHandle> + '_ {
        self.seqs.keys().copied()
    }

    /// Whether `h` is alive.
    pub(crate) fn has(&self, h: SeqHandle) -> bool {
        self.seqs.contains_key(&h)
    }

    /// The hash `h`'s first block chains on.
    pub(crate) fn root_of(&self, h: SeqHandle) -> BlockHash {
        self.seq(h).root
    }

    /// What the cache holds of `prompt`'s start (at most all but its last
    /// token, whose logits are needed), such that a query after it sees the
    /// bytes it would have seen had the prefix been computed here: blocks the
    /// prefix's length seals come sealed (sealed now when only their open form
    /// is cached); blocks in its open tail must have their open form cached.
    /// With a window, only the blocks a sequence of the prefix's length still
    /// holds ([`KvConfig::released_at`]) must be cached.
    fn plan_prefix(&self, root: BlockHash, prompt: &[TokenId]) -> PrefixPlan {
        let mut plan = PrefixPlan::default();
        if !self.config.prefix_caching || prompt.len() < 2 {
            return plan;
        }
        let bs = self.bs();
        let max = prompt.len() - 1;
        let sealing = self.config.sealing.is_some();
        let windowed = self.config.window.is_some();
        // Per full block: (open form, sealed form, hash). Without a window the
        // first block cached in neither form ends the search; with one, a
        // later window may still be whole.
        let mut found: Vec<(Option<BlockId>, Option<BlockId>, BlockHash)> = Vec::new();
        let mut parent = root;
        for chunk in prompt[..max].chunks_exact(bs) {
            let h = hash_block(parent, chunk);
            let open = self.pool.lookup(parent, h, chunk);
            let sealed = sealing
                .then(|| self.pool.lookup(parent, sealed_form(h), chunk))
                .flatten();
            if open.is_none() && sealed.is_none() && !windowed {
                break;
            }
            found.push((open, sealed, h));
            parent = h;
        }
        let mut n_full = found.len();
        let mut partial = None;
        if self.config.cache_partial {
            let rest = &prompt[n_full * bs..max.min((n_full + 1) * bs)];
            partial = self.pool.longest_shared(parent, rest);
        }
        // A block the prefix's sequence holds must be cached, in its open form
        // when it lies in the open tail; where one is not the prefix ends there
        // (a shorter prefix seals and releases fewer blocks, so look again).
        loop {
            let len = n_full * bs + partial.map_or(0, |p: (BlockId, usize)| p.1);
            let s = self.config.sealed_at(len);
            let r = self.config.released_at(len).min(n_full);
            let missing = |k: usize| {
                let (open, sealed, _) = found[k];
                open.is_none() && (k >= s || sealed.is_none())
            };
            match (r..n_full).find(|&k| missing(k)) {
                Some(k) => {
                    n_full = k;
                    partial = None;
                }
                None => {
                    plan.released = r;
                    plan.hashes = found[..n_full].iter().map(|e| e.2).collect();
                    for (k, &(open, sealed, _)) in found.iter().enumerate().take(n_full).skip(r) {
                        let entry = if k < s {
                            match sealed {
                                Some(b) => (b, false),
                                None => (open.expect("one form is cached"), true),
                            }
                        } else {
                            (open.expect("checked above"), false)
                        };
                        plan.full.push(entry);
                    }
                    plan.partial = partial;
                    return plan;
                }
            }
        }
    }

    /// Prompt tokens the prefix cache would serve for `prompt` (see
    /// [`match_prefix`](Self::match_prefix)). Looks only; takes no references.
    pub fn peek_prefix(&self, keys_root: BlockHash, prompt: &[TokenId]) -> usize {
        self.plan_prefix(keys_root, prompt).tokens(self.bs())
    }

    /// Blocks of each class an append of `n` tokens to a sequence of `len`
    /// tokens, `blocks_now` table entries, `sealed_now` sealed ones and
    /// `released` released ones takes, plus one open block when its partial
    /// last block must be copied first.
    fn append_need(
        &self,
        len: usize,
        blocks_now: usize,
        sealed_now: usize,
        released: usize,
        copy: bool,
        n: usize,
    ) -> BlockCount {
        if n == 0 {
            return BlockCount::default();
        }
        let new_len = len + n;
        let new_sealed = self.config.sealed_at(new_len);
        let new_blocks = blocks_now.max(self.blocks_for(new_len));
        BlockCount {
            // Blocks sealed by this very append never get an open block.
            open: new_blocks.saturating_sub(blocks_now.max(new_sealed)) + usize::from(copy),
            // A released entry is passed over by its seal.
            sealed: new_sealed.saturating_sub(sealed_now.max(released)),
            ..BlockCount::default()
        }
    }

    /// Whether writing past `len` tokens into `h`'s partial last block needs a
    /// private copy first: it is shared, or registered with rows past `len`.
    fn partial_needs_copy(&self, s: &SeqState) -> bool {
        let bs = self.bs();
        let len = s.tokens.len();
        if len.is_multiple_of(bs) {
            return false;
        }
        let last = s.blocks[len / bs];
        self.pool.ref_count(last) > 1 || self.pool.registered_len(last) > len % bs
    }

    /// Blocks of each class an empty sequence would take to hold `prompt`
    /// plus `lookahead` slots, given what the cache already has (an upper
    /// bound). For admission decisions.
    pub fn blocks_needed_for_prompt(
        &self,
        keys: &CacheKeys,
        prompt: &[TokenId],
        lookahead: usize,
    ) -> BlockCount {
        self.blocks_needed_within(keys, prompt, lookahead, prompt.len())
    }

    /// [`blocks_needed_for_prompt`](Self::blocks_needed_for_prompt) with the
    /// cached prefix looked up within the first `limit` prompt tokens (all
    /// but the last of them served at most).
    pub(crate) fn blocks_needed_within(
        &self,
        keys: &CacheKeys,
        prompt: &[TokenId],
        lookahead: usize,
        limit: usize,
    ) -> BlockCount {
        let bs = self.bs();
        let plan = self.plan_prefix(keys.root_hash(), &prompt[..limit.min(prompt.len())]);
        let c = plan.tokens(bs);
        let mut need = BlockCount::default();
        for &(b, seal) in &plan.full {
            // Taking a cached block nobody references costs a free block.
            if self.pool.ref_count(b) == 0 {
                need = need + self.class_count(b);
            }
            if seal {
                need.sealed += 1;
            }
        }
        if let Some((b, _)) = plan.partial
            && self.pool.ref_count(b) == 0
        {
            need.open += 1;
        }
        let blocks_now = self.blocks_for(c);
        let copy = plan.partial.is_some();
        // With a window, what its first append takes (nothing is set aside
        // for the rest: see `reserve`).
        let rest = prompt.len() + lookahead - c;
        let rest = match self.config.window {
            Some(w) => rest.min(w.max_append as usize),
            None => rest,
        };
        need + self.append_need(
            c,
            blocks_now,
            self.config.sealed_at(c),
            plan.released,
            copy,
            rest,
        )
    }

    /// Blocks of each class a sequence takes on its way to `tokens` tokens,
    /// appended in one go at its last step (the most of each class, which
    /// need not be at the end: a seal trades an open block for a sealed one).
    /// With a window, appended at most [`Window::max_append`] tokens at a
    /// time: a step holds the blocks from the window before its first token
    /// to its last, however long the sequence.
    pub fn blocks_for_sequence(&self, tokens: usize) -> BlockCount {
        let last = self.append_need(0, 0, 0, 0, false, tokens);
        let before = self.append_need(0, 0, 0, 0, false, tokens.saturating_sub(1));
        let mut need = BlockCount {
            open: last.open.max(before.open),
            sealed: last.sealed.max(before.sealed),
            ..BlockCount::default()
        };
        if let Some(w) = self.config.window {
            need.open = need.open.min(self.window_blocks(w));
            // Sealed entries held: those older than the tail, not yet
            // released.
            let tail = self.config.sealing.map_or(0, |s| s.tail_tokens);
            let sealed =
                (w.tokens + w.margin + w.max_append).saturating_sub(tail) as usize / self.bs() + 2;
            need.sealed = need.sealed.min(sealed);
        }
        need
    }

    /// The most entries a windowed sequence holds at once: from the block the
    /// window (and margin) before a step's first token falls in to the one
    /// its last appended token does.
    fn window_blocks(&self, w: Window) -> usize {
        (w.tokens + w.margin + w.max_append) as usize / self.bs() + 2
    }

    /// Gives an empty sequence the cached blocks that start `prompt`; returns
    /// how many prompt tokens are now in place (less than `prompt.len()`),
    /// and the seals to make before its first step (blocks whose sealed form
    /// was not cached). The caller computes the rest and appends it.
    pub fn match_prefix(&mut self, h: SeqHandle, prompt: &[TokenId]) -> (usize, Vec<BlockOp>) {
        let (n, ops) = self.match_uncounted(h, prompt);
        self.count_lookup(n, prompt.len() - n);
        (n, ops)
    }

    /// Counts prompt tokens served from the cache and not.
    pub(crate) fn count_lookup(&mut self, hit: usize, miss: usize) {
        self.hit_tokens += hit as u64;
        self.miss_tokens += miss as u64;
    }

    /// [`match_prefix`](Self::match_prefix) without the hit and miss counts.
    pub(crate) fn match_uncounted(
        &mut self,
        h: SeqHandle,
        prompt: &[TokenId],
    ) -> (usize, Vec<BlockOp>) {
        let root = self.seq(h).root;
        assert!(
            self.seq(h).tokens.is_empty(),
            "match_prefix on a non-empty sequence"
        );
        let bs = self.bs();
        let mut plan = self.plan_prefix(root, prompt);
        // Take every block first, so sealing cannot evict one of them.
        for &(b, _) in &plan.full {
            self.pool.retain(b);
        }
        if let Some((b, _)) = plan.partial {
            self.pool.retain(b);
        }
        let mut ops = Vec::new();
        let mut blocks = vec![BlockId::NONE; plan.released];
        for (j, &(b, seal)) in plan.full.iter().enumerate() {
            let k = plan.released + j;
            if !seal {
                blocks.push(b);
                continue;
            }
            let Some(dst) = self.pool.allocate_in(SEALED) else {
                // Admission counted these; should the pool still be short, the
                // prefix ends before this block (and no block is released:
                // the shorter prefix's window may reach further back).
                for &(b, _) in &plan.full {
                    self.pool.release(b);
                }
                if let Some((b, _)) = plan.partial.take() {
                    self.pool.release(b);
                }
                for op in ops.drain(..) {
                    if let BlockOp::Seal(seal) = op {
                        self.pool.release(seal.dst);
                        self.deferred.pop();
                    }
                }
                return self.match_uncounted(h, &prompt[..k * bs + 1]);
            };
            ops.push(BlockOp::Seal(BlockSeal {
                index: k,
                src: Some(b),
                dst,
                at_len: self.config.seal_len(k),
                encode: true,
                windowed: self.config.window.is_some(),
            }));
            // The open source is read while sealing, in the coming step.
            self.deferred.push(b);
            blocks.push(dst);
        }
        if let Some((b, _)) = plan.partial {
            blocks.push(b);
        }
        let n = plan.tokens(bs);
        let sealed = self.config.sealed_at(n);
        let s = self.seqs.get_mut(&h).expect("unknown sequence handle");
        s.blocks = blocks;
        s.sealed = sealed;
        s.released = plan.released;
        s.hashes = plan.hashes;
        // Blocks taken from the cache are registered; fresh seals are not yet.
        s.offered = ops
            .iter()
            .map(|op| match op {
                BlockOp::Seal(seal) => seal.index,
                BlockOp::Copy(_) => usize::MAX,
            })
            .min()
            .unwrap_or(s.hashes.len())
            .min(s.hashes.len());
        s.tokens.extend_from_slice(&prompt[..n]);
        (n, ops)
    }

    /// Blocks of each class that appending `n` tokens to `h` would take from
    /// the pool (its spare blocks not counted against it).
    pub fn blocks_needed_to_append(&self, h: SeqHandle, n: usize) -> BlockCount {
        let s = self.seq(h);
        let copy = n > 0 && self.partial_needs_copy(s);
        self.append_need(
            s.tokens.len(),
            s.blocks.len(),
            s.sealed,
            s.released,
            copy,
            n,
        )
    }

    fn spare_of(&self, s: &SeqState) -> BlockCount {
        s.spare
            .iter()
            .fold(BlockCount::default(), |c, &b| c + self.class_count(b))
    }

    /// Takes a block of `class` from `h`'s spares, else from the pool.
    fn take(&mut self, h: SeqHandle, class: usize) -> Option<BlockId> {
        let sealing = self.config.sealing.is_some();
        let pool = &self.pool;
        let s = self.seqs.get_mut(&h).expect("unknown sequence handle");
        let at = s
            .spare
            .iter()
            .position(|&b| (sealing && pool.class_of(b) == SEALED) == (class == SEALED));
        match at {
            Some(i) => Some(s.spare.swap_remove(i)),
            None => self.pool.allocate_in(class),
        }
    }

    /// Sets aside the blocks that appending `n` more tokens to `h` will take,
    /// so later planning cannot take them (an admitted prompt's reservation).
    /// Spares left when the sequence ends are released.
    ///
    /// With a window nothing is set aside: the blocks a windowed sequence
    /// holds come and go with its window, and a pool sized for its running
    /// sequences (each a window's worth, and one step's appends among them
    /// all) never runs short; a smaller one makes an append wait or preempt.
    pub fn reserve(&mut self, h: SeqHandle, n: usize) -> Result<(), NotEnoughBlocks> {
        if let Some(e) = self.reserve_shortage(h, n) {
            return Err(e);
        }
        let want = self.spare_of(self.seq(h)).short_of(self.reserve_need(h, n));
        let mut got = Vec::with_capacity(want.total());
        got.extend((0..want.open).map(|_| self.pool.allocate_in(OPEN).expect("counted")));
        got.extend((0..want.sealed).map(|_| self.pool.allocate_in(SEALED).expect("counted")));
        self.seqs
            .get_mut(&h)
            .expect("unknown sequence handle")
            .spare
            .extend(got);
        Ok(())
    }

    /// Blocks of each class a reservation for `n` more tokens of `h` holds:
    /// what appending them takes (nothing with a window).
    fn reserve_need(&self, h: SeqHandle, n: usize) -> BlockCount {
        if self.config.window.is_some() {
            return BlockCount::default();
        }
        self.blocks_needed_to_append(h, n)
    }

    /// What [`reserve`](Self::reserve) of `n` tokens lacks, if anything.
    pub(crate) fn reserve_shortage(&self, h: SeqHandle, n: usize) -> Option<NotEnoughBlocks> {
        self.short(h, self.reserve_need(h, n))
    }

    /// What appending `n` tokens to `h` lacks, if anything: the check
    /// [`append_pending`](Self::append_pending) makes before changing
    /// anything.
    pub(crate) fn append_shortage(&self, h: SeqHandle, n: usize) -> Option<NotEnoughBlocks> {
        self.short(h, self.blocks_needed_to_append(h, n))
    }

    /// What `need` lacks beyond `h`'s spares and the free blocks.
    fn short(&self, h: SeqHandle, need: BlockCount) -> Option<NotEnoughBlocks> {
        let short = self.spare_of(self.seq(h)).short_of(need);
        let free = self.free_blocks();
        (!short.fits(free)).then_some(NotEnoughBlocks {
            needed: short.total(),
            free: free.total(),
        })
    }

    /// What [`reserve_lookahead`](Self::reserve_lookahead) of `n` slots lacks.
    pub(crate) fn lookahead_shortage(&self, h: SeqHandle, n: usize) -> Option<NotEnoughBlocks> {
        let s = self.seq(h);
        let need = self
            .blocks_for(s.tokens.len() + n)
            .saturating_sub(s.blocks.len());
        let free = self.pool.num_free_in(OPEN);
        (need > free).then_some(NotEnoughBlocks { needed: need, free })
    }

    /// Empties `h` (a match undone): its blocks go back, its tokens are gone.
    pub(crate) fn clear(&mut self, h: SeqHandle) {
        let s = self.seqs.get_mut(&h).expect("unknown sequence handle");
        let blocks = std::mem::take(&mut s.blocks);
        let released = std::mem::take(&mut s.released);
        s.sealed = 0;
        s.tokens.clear();
        s.hashes.clear();
        s.offered = 0;
        s.reserved = 0;
        self.release_table(&blocks[released..]);
    }

    /// Blocks of each class only `h` references (what freeing it gives back).
    pub fn exclusive_blocks(&self, h: SeqHandle) -> BlockCount {
        let s = self.seq(h);
        s.blocks[s.released..]
            .iter()
            .filter(|&&b| self.pool.ref_count(b) == 1)
            .fold(BlockCount::default(), |c, &b| c + self.class_count(b))
    }

    /// Gives `h`'s spare blocks back.
    pub fn release_spare(&mut self, h: SeqHandle) {
        let s = self.seqs.get_mut(&h).expect("unknown sequence");
        let spare = std::mem::take(&mut s.spare);
        for b in spare {
            self.pool.release(b);
        }
    }

    /// Appends computed (verified) tokens to `h`, allocating blocks as needed.
    /// Every block that becomes full is registered in the prefix cache. Returns
    /// the block work the caller must do; on shortage nothing changes.
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

    /// Like [`append`](Self::append) but registers nothing: for tokens
    /// planned and not yet computed. [`commit`](Self::commit) registers their
    /// blocks once their KV exists, so no other sequence can match a block
    /// whose content is still being computed.
    pub fn append_pending(
        &mut self,
        h: SeqHandle,
        new: &[TokenId],
    ) -> Result<Vec<BlockOp>, NotEnoughBlocks> {
        if let Some(e) = self.append_shortage(h, new.len()) {
            return Err(e);
        }
        if new.is_empty() {
            return Ok(Vec::new());
        }
        let bs = self.bs();
        let mut ops = Vec::new();
        if self.partial_needs_copy(self.seq(h)) {
            let fresh = self.take(h, OPEN).expect("counted");
            let s = self.seqs.get_mut(&h).expect("unknown sequence handle");
            let idx = s.tokens.len() / bs;
            let last = s.blocks[idx];
            ops.push(BlockOp::Copy(BlockCopy {
                src: last,
                dst: fresh,
                tokens: s.tokens.len() % bs,
                windowed: self.config.window.is_some(),
            }));
            s.blocks[idx] = fresh;
            // Its rows are read by the coming step: released after it.
            self.deferred.push(last);
        }
        let s = self.seqs.get_mut(&h).expect("unknown sequence handle");
        let blocks_before = s.blocks.len();
        s.tokens.extend_from_slice(new);
        s.reserved = s.reserved.saturating_sub(new.len());
        let want = (s.tokens.len() + s.reserved).div_ceil(bs);
        let new_sealed = self.config.sealed_at(s.tokens.len());
        for i in blocks_before..want {
            let b = if i < new_sealed {
                // Filled and sealed by this append: the seal below sets it.
                BlockId::NONE
            } else {
                self.take(h, OPEN).expect("counted")
            };
            self.seqs.get_mut(&h).expect("seq").blocks.push(b);
        }
        let first = self.seq(h).sealed;
        let hashes = if first < new_sealed && self.config.prefix_caching {
            self.content_hashes(h, new_sealed)
        } else {
            Vec::new()
        };
        for i in first..new_sealed {
            let s = self.seq(h);
            if i < s.released {
                // Released before its seal (a tail longer than the window).
                self.seqs.get_mut(&h).expect("seq").sealed = i + 1;
                continue;
            }
            let cached = if hashes.is_empty() {
                None
            } else {
                let chunk = &s.tokens[i * bs..(i + 1) * bs];
                let parent = if i == 0 { s.root } else { hashes[i - 1] };
                self.pool.lookup(parent, sealed_form(hashes[i]), chunk)
            };
            let src = (i < blocks_before).then(|| s.blocks[i]);
            let (dst, encode) = match cached {
                Some(b) => {
                    self.pool.retain(b);
                    (b, false)
                }
                None => (self.take(h, SEALED).expect("counted"), true),
            };
            if let Some(src) = src {
                self.deferred.push(src);
            }
            ops.push(BlockOp::Seal(BlockSeal {
                index: i,
                src,
                dst,
                at_len: self.config.seal_len(i),
                encode,
                windowed: self.config.window.is_some(),
            }));
            let s = self.seqs.get_mut(&h).expect("seq");
            s.blocks[i] = dst;
            s.sealed = i + 1;
            if encode {
                s.offered = s.offered.min(i);
            }
        }
        Ok(ops)
    }

    /// Content hashes of `h`'s first `n` full blocks (committed ones as
    /// recorded, the rest computed from the tokens).
    fn content_hashes(&self, h: SeqHandle, n: usize) -> Vec<BlockHash> {
        let s = self.seq(h);
        let bs = self.bs();
        let mut out: Vec<BlockHash> = s.hashes.iter().copied().take(n).collect();
        while out.len() < n {
            let i = out.len();
            let parent = if i == 0 { s.root } else { out[i - 1] };
            out.push(hash_block(parent, &s.tokens[i * bs..(i + 1) * bs]));
        }
        out
    }

    /// Registers in the prefix cache every full block of `h` within its first
    /// `upto` tokens that is not registered yet — an open block under its
    /// content hash, a sealed one under [`sealed_form`] of it — and, with
    /// [`KvConfig::cache_partial`], the partial block that ends at `upto`
    /// (a no-op with prefix caching off). A block whose hash another block
    /// already caches stays private; the chain of hashes still continues past
    /// it.
    ///
    /// With a window, then releases the blocks the window has passed at
    /// `upto` tokens ([`KvConfig::released_at`]): the step that computed them
    /// has run, and no later query reads them.
    pub fn commit(&mut self, h: SeqHandle, upto: usize) {
        if self.config.prefix_caching {
            self.offer(h, upto);
        }
        if self.config.window.is_some() {
            self.slide(h, upto);
        }
    }

    /// Releases `h`'s blocks behind the window at `upto` tokens.
    fn slide(&mut self, h: SeqHandle, upto: usize) {
        let s = self.seqs.get_mut(&h).expect("unknown sequence handle");
        let upto = upto.min(s.tokens.len());
        let mut to = self.config.released_at(upto).min(s.blocks.len());
        // A seal planned by tokens past `upto` has yet to write its block.
        let sealed = self.config.sealed_at(upto);
        if s.sealed > sealed {
            to = to.min(sealed);
        }
        if to <= s.released {
            return;
        }
        let gone: Vec<BlockId> = s.blocks[s.released..to]
            .iter_mut()
            .map(|b| std::mem::replace(b, BlockId::NONE))
            .collect();
        s.released = to;
        self.release_table(&gone);
    }

    /// Releases a run of table entries in the order their cached prefixes
    /// should be evicted: without a window tail first (a prefix's head is
    /// of use without its tail), with one head first (a prefix is matched by
    /// the blocks at its end, the window before it).
    fn release_table(&mut self, ids: &[BlockId]) {
        if self.config.window.is_some() {
            for &b in ids {
                self.pool.release(b);
            }
        } else {
            self.pool.release_chain(ids);
        }
    }

    /// [`commit`](Self::commit)'s registration.
    fn offer(&mut self, h: SeqHandle, upto: usize) {
        let bs = self.bs();
        let sealing = self.config.sealing.is_some();
        let s = self.seqs.get_mut(&h).expect("unknown sequence handle");
        let upto = upto.min(s.tokens.len());
        let full = upto / bs;
        while s.hashes.len() < full {
            let i = s.hashes.len();
            let parent = if i == 0 { s.root } else { s.hashes[i - 1] };
            let hash = hash_block(parent, &s.tokens[i * bs..(i + 1) * bs]);
            s.hashes.push(hash);
        }
        while s.offered < full {
            let i = s.offered;
            if i < s.released {
                // Released before it was offered: nothing to register.
                s.offered += 1;
                continue;
            }
            // A block sealed by tokens past `upto` (planned, not computed) is
            // not quantized yet: neither form may be offered.
            if i < s.sealed && self.config.seal_len(i) > upto {
                break;
            }
            let parent = if i == 0 { s.root } else { s.hashes[i - 1] };
            let chunk = &s.tokens[i * bs..(i + 1) * bs];
            let b = s.blocks[i];
            let key = if sealing && self.pool.class_of(b) == SEALED {
                sealed_form(s.hashes[i])
            } else {
                s.hashes[i]
            };
            if self.pool.registered_len(b) < bs {
                // A partial registration of this block grows into the full one.
                self.pool.uncache(b);
                if self.pool.register(b, parent, key, chunk) {
                    self.pool
                        .journal_stored(b, s.hashes[i], (i > 0).then_some(parent));
                }
            }
            s.offered += 1;
        }
        let k = upto % bs;
        if self.config.cache_partial && k > 0 && upto / bs < s.blocks.len() {
            let b = s.blocks[full];
            if b != BlockId::NONE && self.pool.registered_len(b) < k {
                let parent = if full == 0 {
                    s.root
                } else {
                    s.hashes[full - 1]
                };
                let chunk = &s.tokens[full * bs..upto];
                self.pool.uncache(b);
                self.pool
                    .register(b, parent, hash_block(parent, chunk), chunk);
            }
        }
    }

    /// Releases the blocks sealed or copied away during the step just run
    /// (their rows were read by it). Call once the step's work is done.
    pub fn finish_step(&mut self) {
        for b in std::mem::take(&mut self.deferred) {
            self.pool.release(b);
        }
    }

    /// Tokens that can follow `h`'s current length before the next seal (how
    /// far a speculative draft may reach without crossing one).
    pub fn tokens_until_seal(&self, h: SeqHandle) -> usize {
        if self.config.sealing.is_none() {
            return usize::MAX;
        }
        let s = self.seq(h);
        self.config.seal_len(s.sealed) - 1 - s.tokens.len()
    }

    /// Makes room for `n` speculative tokens past the sequence's end without
    /// caching anything; a later [`append`](Self::append) of verified tokens
    /// uses these slots, and [`truncate`](Self::truncate) gives back the rest.
    /// The slots must not reach a seal ([`tokens_until_seal`](Self::tokens_until_seal)).
    pub fn reserve_lookahead(&mut self, h: SeqHandle, n: usize) -> Result<(), NotEnoughBlocks> {
        debug_assert!(n <= self.tokens_until_seal(h));
        if let Some(e) = self.lookahead_shortage(h, n) {
            return Err(e);
        }
        let s = self.seq(h);
        let need = self
            .blocks_for(s.tokens.len() + n)
            .saturating_sub(s.blocks.len());
        for _ in 0..need {
            let b = self.take(h, OPEN).expect("counted");
            self.seqs.get_mut(&h).expect("seq").blocks.push(b);
        }
        let s = self.seqs.get_mut(&h).expect("unknown sequence handle");
        s.reserved = s.reserved.max(n);
        Ok(())
    }

    /// Appends speculative tokens verified after a step that wrote their rows
    /// into `h`'s lookahead slots: no block is taken, copied or sealed (the
    /// slots were in the table when the step ran). The rest of the slots
    /// stay reserved until [`truncate`](Self::truncate).
    ///
    /// # Panics
    /// With more tokens than slots reserved.
    pub fn accept_lookahead(&mut self, h: SeqHandle, new: &[TokenId]) {
        let s = self.seqs.get_mut(&h).expect("unknown sequence handle");
        assert!(
            new.len() <= s.reserved,
            "{} tokens accepted into {} reserved slots",
            new.len(),
            s.reserved
        );
        s.tokens.extend_from_slice(new);
        s.reserved -= new.len();
        debug_assert_eq!(self.config.sealed_at(s.tokens.len()), s.sealed);
    }

    /// Shortens `h` to its first `len` tokens and drops any lookahead
    /// reservation (rejected speculative tokens, or a rewind). Blocks past the
    /// end are released. A block cut into keeps its rows: the next append
    /// copies it first if it is shared or cached past `len`. `len` must not
    /// unseal a block.
    pub fn truncate(&mut self, h: SeqHandle, len: usize) {
        let bs = self.bs();
        let s = self.seq(h);
        let len = len.min(s.tokens.len());
        debug_assert_eq!(
            self.config.sealed_at(len),
            s.sealed,
            "truncation below a seal"
        );
        debug_assert!(
            s.released == 0 || self.window_reach(len) >= s.released,
            "truncation into released blocks"
        );
        let keep_blocks = len.div_ceil(bs);
        let s = self.seqs.get_mut(&h).expect("unknown sequence handle");
        let tail: Vec<BlockId> = s.blocks.drain(keep_blocks..).collect();
        s.tokens.truncate(len);
        s.reserved = 0;
        s.hashes.truncate(len / bs);
        s.offered = s.offered.min(len / bs);
        self.pool.release_chain(&tail);
    }

    /// A new sequence sharing every block of `h` (reference counts, no copy).
    /// The shared partial last block is copied on the first write by either.
    pub fn fork(&mut self, h: SeqHandle) -> SeqHandle {
        let mut state = self.seq(h).clone();
        state.reserved = 0;
        state.spare.clear();
        let used = self.blocks_for(state.tokens.len());
        state.blocks.truncate(used);
        for &b in &state.blocks[state.released..] {
            self.pool.retain(b);
        }
        let nh = SeqHandle(self.next_handle);
        self.next_handle += 1;
        self.seqs.insert(nh, state);
        nh
    }

    /// Ends a sequence: its blocks go back tail first (head first with a
    /// window); its registered blocks stay cached until evicted.
    pub fn free(&mut self, h: SeqHandle) {
        if let Some(s) = self.seqs.remove(&h) {
            self.release_table(&s.blocks[s.released..]);
            for b in s.spare {
                self.pool.release(b);
            }
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

    /// The block table of `h`, in token order (sealed blocks first).
    pub fn block_table(&self, h: SeqHandle) -> &[BlockId] {
        &self.seq(h).blocks
    }

    /// Leading entries of `h`'s table its window has released
    /// ([`BlockId::NONE`]); 0 without a window.
    pub fn released_blocks(&self, h: SeqHandle) -> usize {
        self.seq(h).released
    }

    /// The first block a query at position `len` or later still reads: the
    /// block holding position `len - window` (0 without a window).
    fn window_reach(&self, len: usize) -> usize {
        self.config
            .window
            .map_or(0, |w| len.saturating_sub(w.tokens as usize) / self.bs())
    }

    /// Leading sealed blocks of `h`'s table (released ones included).
    pub fn sealed_blocks(&self, h: SeqHandle) -> usize {
        self.seq(h).sealed
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
        let mut shared = 0;
        let mut used_sealed = 0;
        for i in 0..self.pool.num_blocks() as u32 {
            let b = BlockId(i);
            let rc = self.pool.ref_count(b);
            if rc > 1 {
                shared += 1;
            }
            if rc > 0 && self.is_sealed_block(b) {
                used_sealed += 1;
            }
        }
        CacheStats {
            hit_tokens: self.hit_tokens,
            miss_tokens: self.miss_tokens,
            evictions: self.pool.evictions(),
            free_blocks: self.pool.num_free(),
            used_blocks: self.pool.num_used(),
            cached_unreferenced_blocks: self.pool.num_cached_unreferenced(),
            shared_blocks: shared,
            used_sealed_blocks: used_sealed,
            windowed_free_blocks: 0,
            windowed_used_blocks: 0,
            windowed_used_sealed_blocks: 0,
        }
    }

    /// Checks that reference counts equal the number of table entries,
    /// spares and step-deferred releases naming each block, that tables are
    /// sealed blocks then open ones as their lengths say, that no block is
    /// lost, and the pool's own invariants.
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
            if s.sealed != self.config.sealed_at(s.tokens.len()) {
                return Err(format!(
                    "{h:?}: {} sealed blocks at {} tokens, expected {}",
                    s.sealed,
                    s.tokens.len(),
                    self.config.sealed_at(s.tokens.len())
                ));
            }
            if s.released > 0 && self.window_reach(s.tokens.len()) < s.released {
                return Err(format!(
                    "{h:?}: {} blocks released at {} tokens, which read from block {}",
                    s.released,
                    s.tokens.len(),
                    self.window_reach(s.tokens.len())
                ));
            }
            for (i, b) in s.blocks.iter().enumerate() {
                if (*b == BlockId::NONE) != (i < s.released) {
                    return Err(format!(
                        "{h:?}: entry {i} is {}released, {} leading entries are",
                        if *b == BlockId::NONE { "" } else { "not " },
                        s.released
                    ));
                }
                if *b != BlockId::NONE && self.is_sealed_block(*b) != (i < s.sealed) {
                    return Err(format!("{h:?}: block {i} ({}) of the wrong class", b.0));
                }
            }
            for b in s.blocks[s.released..].iter().chain(&s.spare) {
                refs[b.0 as usize] += 1;
            }
        }
        for b in &self.deferred {
            refs[b.0 as usize] += 1;
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
