//! Where KV lives, and what the scheduler's block decisions mean for it.
//!
//! - **Ours** (grafted attention, the default): siliceo's paged store holds
//!   every token's K/V in the chosen format, one pool of blocks per class
//!   whose ids are kv-paging's. A retired or evicted block needs nothing (its
//!   bytes are simply reused), a prefix hit needs nothing (the table names
//!   the cached blocks), a swap copies the sequence's blocks to host memory
//!   and back. llama.cpp's own cache holds one step at most.
//! - **llama.cpp's cells** (`--kv-backend llama`, for comparison): blocks are
//!   bookkeeping over a unified llama.cpp cache; cached blocks outlive their
//!   requests in holder sequences (`holders`), prefix hits tag cells into the
//!   new sequence, swaps save llama.cpp's per-sequence state.

use siliceo_core::SeqId;
use siliceo_engine::{Context, GraftedContext, SavedBlocks, SeqSnapshot, StoreBlock};
use siliceo_kv_paging::planner::StorePlan;
use siliceo_kv_paging::{BlockId, BlockOp, KvConfig, SeqHandle};
use siliceo_scheduler::{Preempted, StepItem};

use super::Engine;
use super::holders::Holders;
use crate::RuntimeError;

/// llama.cpp's unified cache and its holder sequences.
pub(crate) struct LlamaKv<'m> {
    pub(crate) ctx: Context<'m>,
    pub(crate) holders: Holders,
}

/// Our store through grafted attention.
pub(crate) struct GraftKv<'m> {
    pub(crate) ctx: GraftedContext<'m>,
    /// kv-paging's open ids are the tail pool's first blocks; its sealed ids
    /// start here and index the sealed pool from 0.
    pub(crate) sealed_base: u32,
    /// The tail pool's blocks for token-tree branches (after kv-paging's
    /// open ones), handed out per step from the first: `branches.start..
    /// branch_next` are this step's.
    pub(crate) branches: std::ops::Range<u32>,
    pub(crate) branch_next: u32,
    /// The scratch blocks (after those; one set for all layers).
    pub(crate) scratch: std::ops::Range<u32>,
    pub(crate) block_size: usize,
    pub(crate) config: KvConfig,
    /// The windowed layers' own pools, where they keep them: their sealed
    /// ids' base and their scratch blocks (after their open ones).
    pub(crate) windowed: Option<(u32, std::ops::Range<u32>)>,
}

impl<'m> GraftKv<'m> {
    pub(crate) fn new(ctx: GraftedContext<'m>, plan: StorePlan, config: &KvConfig) -> Self {
        let branches = plan.open_blocks..plan.open_blocks + plan.branch_blocks;
        GraftKv {
            ctx,
            sealed_base: plan.open_blocks,
            branch_next: branches.start,
            scratch: branches.end..branches.end + plan.scratch_blocks,
            branches,
            block_size: config.block_size as usize,
            config: *config,
            windowed: config.windowed.map(|w| {
                (
                    w.num_blocks,
                    w.num_blocks..w.num_blocks + plan.scratch_blocks,
                )
            }),
        }
    }

    /// Bytes of one (sealed, open) block over the global group's layers,
    /// and over the windowed group's (0 without one).
    pub(crate) fn block_bytes(&self) -> ((u64, u64), (u64, u64)) {
        let ((s, o), (ws, wo)) = self.ctx.block_bytes_by_group();
        ((s as u64, o as u64), (ws as u64, wo as u64))
    }

    /// The store block behind a kv-paging block id of the global group.
    pub(crate) fn store_block(&self, b: BlockId) -> StoreBlock {
        self.store_block_in(b, false)
    }

    /// The store block behind a kv-paging block id of the global group or
    /// (`windowed`) the windowed one.
    pub(crate) fn store_block_in(&self, b: BlockId, windowed: bool) -> StoreBlock {
        let base = match (windowed, &self.windowed) {
            (true, Some((base, _))) => *base,
            _ => self.sealed_base,
        };
        if self.config.sealing.is_some() && b.0 >= base {
            StoreBlock::Sealed(b.0 - base)
        } else {
            StoreBlock::Tail(b.0)
        }
    }

    /// A group's scratch blocks.
    pub(crate) fn scratch_of(&self, windowed: bool) -> std::ops::Range<u32> {
        match (windowed, &self.windowed) {
            (true, Some((_, scratch))) => scratch.clone(),
            _ => self.scratch.clone(),
        }
    }
}

/// Where KV lives.
pub(crate) enum Kv<'m> {
    Llama(LlamaKv<'m>),
    Graft(GraftKv<'m>),
}

/// A swapped-out sequence's KV in host memory.
pub(crate) enum Saved {
    Llama(SeqSnapshot),
    Graft(SavedBlocks),
}

impl Engine<'_> {
    /// Gives up a request's sequence id. On llama.cpp's cells, every block of
    /// `blocks` the prefix cache still holds and no running request references
    /// is tagged into a holder sequence first (or dropped from the cache when
    /// no holder has room at its position), then the sequence's cells go.
    pub(super) fn retire(&mut self, seq: SeqId, blocks: &[BlockId]) {
        if let Kv::Llama(l) = &mut self.kv {
            let bs = self.block_size;
            for (i, &b) in blocks.iter().enumerate() {
                let pool = self.sched.kv().pool();
                if !pool.is_cached(b) || pool.ref_count(b) > 0 || l.holders.get(b).is_some() {
                    continue;
                }
                let i = i as u32;
                let kept = match l.holders.place(b, i) {
                    Some(h) => match l.ctx.seq_cp(seq, h, Some(i * bs), Some((i + 1) * bs)) {
                        Ok(()) => true,
                        Err(e) => {
                            tracing::warn!(error = %e, "could not keep a cached block");
                            l.holders.remove(b);
                            false
                        }
                    },
                    None => false,
                };
                if !kept {
                    self.sched.uncache(b);
                }
            }
            if let Err(e) = l.ctx.seq_rm(seq, None, None) {
                tracing::error!(error = %e, seq = seq.0, "could not free a sequence's cells");
            }
        }
        if let Some(d) = self.draft.as_mut() {
            let _ = d.ctx.seq_rm(seq, None, None);
        }
        self.free_seqs.push(seq);
    }

    /// Drops what held the cached blocks the scheduler just evicted (holder
    /// cells; our store's bytes are simply reused).
    pub(super) fn evict(&mut self, blocks: &[BlockId]) {
        let Kv::Llama(l) = &mut self.kv else { return };
        let bs = self.block_size;
        for &b in blocks {
            if let Some((h, i)) = l.holders.remove(b)
                && let Err(e) = l.ctx.seq_rm(h, Some(i * bs), Some((i + 1) * bs))
            {
                tracing::error!(error = %e, "could not drop an evicted block's cells");
            }
        }
    }

    /// On llama.cpp's cells, tags the cells of the cached blocks that start
    /// `handle`'s table (its first `n_tokens` tokens, a prefix-cache hit) into
    /// `seq`. A block's cells come from its holder or from any sequence
    /// (running, or retiring in this step) whose table has it at the same
    /// position. Our store needs nothing: the table names the blocks.
    pub(super) fn copy_prefix(
        &mut self,
        id: &siliceo_core::RequestId,
        handle: SeqHandle,
        seq: SeqId,
        n_tokens: usize,
        retiring: &[(SeqId, Vec<BlockId>)],
    ) -> Result<(), RuntimeError> {
        let Kv::Llama(l) = &mut self.kv else {
            return Ok(());
        };
        let bs = self.block_size as usize;
        let kv = self.sched.kv();
        let table = kv.block_table(handle);
        let mut holding: Vec<(SeqId, &[BlockId])> = self
            .live
            .iter()
            .filter(|(other, _)| *other != id)
            .filter_map(|(other, live)| {
                Some((live.seq?, kv.block_table(self.sched.handle(other)?)))
            })
            .collect();
        holding.extend(retiring.iter().map(|(s, b)| (*s, b.as_slice())));
        let mut sources = Vec::with_capacity(n_tokens / bs);
        for (i, &b) in table.iter().enumerate().take(n_tokens / bs) {
            let src = l.holders.get(b).or_else(|| {
                holding
                    .iter()
                    .find(|(_, t)| t.get(i) == Some(&b))
                    .map(|(s, _)| *s)
            });
            sources.push(src.ok_or_else(|| {
                RuntimeError::Engine(format!(
                    "prefix cache: no KV found for cached block {} at position {}",
                    b.0,
                    i * bs
                ))
            })?);
        }
        // One seq_cp per run of blocks with the same source.
        let mut i = 0;
        while i < sources.len() {
            let j = (i..sources.len())
                .find(|&j| sources[j] != sources[i])
                .unwrap_or(sources.len());
            l.ctx
                .seq_cp(
                    sources[i],
                    seq,
                    Some((i * bs) as u32),
                    Some((j * bs) as u32),
                )
                .map_err(|e| RuntimeError::Engine(e.to_string()))?;
            i = j;
        }
        Ok(())
    }

    /// Saves a preempted sequence's KV to host memory (before this step's
    /// decode can overwrite its released blocks).
    pub(super) fn save(&mut self, seq: SeqId, p: &Preempted) -> Result<Saved, RuntimeError> {
        match &self.kv {
            Kv::Llama(l) => l
                .ctx
                .save_seq(seq)
                .map(Saved::Llama)
                .map_err(|e| RuntimeError::Engine(e.to_string())),
            Kv::Graft(g) => {
                // The table at its `tokens` tokens: its undone share of this
                // step sealed or copied blocks that step never wrote, so
                // those are read from the seal's or the copy's source.
                let n = p.tokens.div_ceil(g.block_size);
                let blocks: Vec<StoreBlock> = (0..n)
                    .map(|i| {
                        let mut b = p.blocks[i];
                        for op in &p.ops {
                            if let BlockOp::Seal(s) = op
                                && s.index == i
                                && s.at_len > p.tokens
                                && let Some(src) = s.src
                            {
                                b = src;
                            }
                        }
                        for op in &p.ops {
                            if let BlockOp::Copy(c) = op
                                && c.dst == b
                            {
                                b = c.src;
                            }
                        }
                        g.store_block(b)
                    })
                    .collect();
                g.ctx
                    .save_blocks(&blocks)
                    .map(Saved::Graft)
                    .map_err(|e| RuntimeError::Engine(e.to_string()))
            }
        }
    }

    /// Restores a swapped-out sequence into `seq` (llama.cpp) or into the
    /// blocks its table now names (ours).
    pub(super) fn restore(
        &mut self,
        saved: &Saved,
        seq: SeqId,
        item: &StepItem,
    ) -> Result<(), RuntimeError> {
        let engine = |e: siliceo_engine::EngineError| RuntimeError::Engine(e.to_string());
        match (&mut self.kv, saved) {
            (Kv::Llama(l), Saved::Llama(snap)) => l.ctx.restore_seq(snap, seq).map_err(engine),
            (Kv::Graft(g), Saved::Graft(blocks)) => {
                let table = self.sched.kv().block_table(item.handle);
                let blocks_now: Vec<StoreBlock> = table.iter().map(|&b| g.store_block(b)).collect();
                g.ctx.restore_blocks(blocks, &blocks_now).map_err(engine)
            }
            _ => Err(RuntimeError::Engine(
                "a swapped sequence's KV is of the other backend".into(),
            )),
        }
    }

    /// Drops the KV of rejected drafted tokens at positions `from..` of `seq`
    /// (llama.cpp's cells; our store's table was truncated by the scheduler).
    pub(super) fn drop_after(&mut self, seq: SeqId, from: u32) -> Result<(), RuntimeError> {
        match &mut self.kv {
            Kv::Llama(l) => l
                .ctx
                .seq_rm(seq, Some(from), None)
                .map_err(|e| RuntimeError::Engine(e.to_string())),
            Kv::Graft(_) => Ok(()),
        }
    }

    /// Logits of batch index `i` of the last decode.
    pub(super) fn logits(&self, i: usize) -> Result<&[f32], siliceo_engine::EngineError> {
        match &self.kv {
            Kv::Llama(l) => l.ctx.logits(i),
            Kv::Graft(g) => g.ctx.logits(i),
        }
    }

    /// Forgets all KV (after a panic: the scheduler starts afresh too).
    pub(super) fn clear_kv(&mut self) {
        if let Kv::Llama(l) = &mut self.kv {
            l.ctx.clear();
            l.holders = Holders::new(self.max_running, l.holders.count());
        }
    }

    /// KV positions llama.cpp holds over all sequence ids (ours: the cells of
    /// its one-step cache, 0 between steps).
    pub(super) fn llama_cells(&self) -> u64 {
        match &self.kv {
            Kv::Llama(l) => (0..self.max_running)
                .map(|i| u64::from(l.ctx.seq_len(SeqId(i)).unwrap_or(0)))
                .sum(),
            Kv::Graft(g) => u64::from(g.ctx.llama_cells()),
        }
    }

    /// Cached blocks kept alive by holder sequences (llama.cpp's cells).
    pub(super) fn held_blocks(&self) -> usize {
        match &self.kv {
            Kv::Llama(l) => l.holders.len(),
            Kv::Graft(_) => 0,
        }
    }

    /// Checks, between steps, that the KV agrees with the block accounting.
    /// llama.cpp's cells: every request sequence holds exactly positions
    /// `0..computed`, every holder exactly its blocks' positions, free ids
    /// nothing; every cached block nobody references is held and every held
    /// block is cached. Ours: llama.cpp's cache is empty.
    pub(super) fn check_kv(&self) -> Result<(), String> {
        self.sched.check()?;
        let mut in_use = std::collections::HashSet::new();
        for live in self.live.values() {
            if let Some(seq) = live.seq {
                in_use.insert(seq);
            }
        }
        for s in (0..self.max_running).map(SeqId) {
            if !in_use.contains(&s) && !self.free_seqs.contains(&s) {
                return Err(format!("seq {} is neither used nor free (leaked)", s.0));
            }
        }
        if let Some(d) = &self.draft {
            for live in self.live.values() {
                let (Some(seq), Some(spec)) = (live.seq, &live.spec) else {
                    continue;
                };
                let want = (spec.draft_len > 0).then(|| (0, spec.draft_len as u32 - 1));
                let got = d.ctx.seq_pos_range(seq).map_err(|e| e.to_string())?;
                if got != want {
                    return Err(format!(
                        "draft seq {}: holds positions {got:?}, expected {want:?}",
                        seq.0
                    ));
                }
            }
            for &s in &self.free_seqs {
                if d.ctx.seq_pos_range(s).map_err(|e| e.to_string())?.is_some() {
                    return Err(format!("free draft seq {} still holds cells", s.0));
                }
            }
        }
        match &self.kv {
            Kv::Graft(g) => {
                let cells = g.ctx.llama_cells();
                if cells != 0 {
                    return Err(format!("llama.cpp holds {cells} cells between steps"));
                }
                Ok(())
            }
            Kv::Llama(l) => self.check_cells(l),
        }
    }

    fn check_cells(&self, l: &LlamaKv<'_>) -> Result<(), String> {
        let bs = self.block_size;
        let range = |seq: SeqId| {
            l.ctx
                .seq_pos_range(seq)
                .map_err(|e| format!("seq {}: {e}", seq.0))
        };
        for (id, live) in &self.live {
            let Some(seq) = live.seq else { continue };
            let Some(h) = self.sched.handle(id) else {
                return Err(format!("{id} holds seq {} but no blocks", seq.0));
            };
            let n = self.sched.kv().num_tokens(h) as u32;
            let want = (n > 0).then(|| (0, n - 1));
            let got = range(seq)?;
            if got != want {
                return Err(format!(
                    "{id} (seq {}): llama.cpp holds positions {got:?}, blocks say {want:?}",
                    seq.0
                ));
            }
        }
        for &s in &self.free_seqs {
            if range(s)?.is_some() {
                return Err(format!("free seq {} still holds cells", s.0));
            }
        }
        for h in l.holders.seq_ids() {
            let idx = l.holders.indices(h);
            let want = idx
                .first()
                .zip(idx.last())
                .map(|(lo, hi)| (lo * bs, (hi + 1) * bs - 1));
            let got = range(h)?;
            if got != want {
                return Err(format!(
                    "holder {}: llama.cpp holds positions {got:?}, blocks at indices {idx:?}",
                    h.0
                ));
            }
        }
        let pool = self.sched.kv().pool();
        for b in l.holders.blocks() {
            if !pool.is_cached(b) {
                return Err(format!("held block {} is no longer cached", b.0));
            }
        }
        for b in (0..pool.num_blocks() as u32).map(BlockId) {
            if pool.is_cached(b) && pool.ref_count(b) == 0 && l.holders.get(b).is_none() {
                return Err(format!("cached block {} has no KV left", b.0));
            }
        }
        Ok(())
    }
}
