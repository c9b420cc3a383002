//! A step of the scheduler as work for the grafted context: where each
//! token's K/V go, which blocks are copied and sealed, and which blocks each
//! run of queries sees.
//!
//! A query at position `p` sees the store as it is once `p + 1` tokens are
//! in — blocks `KvConfig::sealed_at(p + 1)` sealed, the rest open — whatever
//! else the step holds. So an item's tokens are cut into runs where a seal
//! takes effect (the token whose append reaches the seal's length starts a
//! new run), and each run's view names open blocks the step seals (their
//! sources, kept alive by kv-paging until the step ends) before it and sealed
//! ones from it. A block filled and sealed within the step never had an open
//! block: its rows go to a scratch block for the step (one set for all
//! layers, lent to the layer being computed: the rows live only while it is).
//!
//! A token tree's first branch is the item's drafted chain; each later
//! branch is a run of its own at the same positions (`pos + 1..`, after the
//! decode token at `pos`) whose K/V go to branch blocks of the tail pool,
//! private to the step: the first takes the rows of the request's partial
//! block up to the decode token (a copy after the step's writes), and the
//! branch's view is the request's blocks before it, then its own. The
//! verified branch's kept rows are copied into the request's blocks after
//! the decode ([`GraftKv::keep_branch`]). Drafts never reach a seal (the
//! scheduler caps them), so neither does a branch.

use std::ops::Range;

use siliceo_engine::{GraftQuery, GraftStep, RowCopy, SeqKv, StoreBlock};
use siliceo_kv_paging::{BlockId, BlockOp, BlockSeal, KvCacheManager, KvGroups};
use siliceo_scheduler::StepItem;

use super::kv::GraftKv;
use crate::RuntimeError;

/// An item's tokens in the batch: its computed tokens, then drafted ones
/// (a chain, or a token tree's first branch), then a tree's later branches.
#[derive(Debug, Clone)]
pub(super) struct Run {
    /// Index into the step's items.
    pub(super) item: usize,
    /// Batch indices of the computed tokens and the chain.
    pub(super) batch: Range<usize>,
    /// A token tree's second and later branches.
    pub(super) branches: Vec<Branch>,
}

/// A token tree's branch after the first, on our store.
#[derive(Debug, Clone)]
pub(super) struct Branch {
    /// Batch indices (positions `pos + 1..` after the decode token's `pos`).
    pub(super) batch: Range<usize>,
    /// Branch blocks (consecutive) for its block indices from
    /// `(pos + 1) / block_size`.
    pub(super) blocks: Range<u32>,
}

impl GraftKv<'_> {
    fn tail(&self, b: BlockId) -> Result<u32, RuntimeError> {
        self.tail_in(b, false)
    }

    /// The tail block behind `b` of a group.
    fn tail_in(&self, b: BlockId, windowed: bool) -> Result<u32, RuntimeError> {
        match self.store_block_in(b, windowed) {
            StoreBlock::Tail(i) => Ok(i),
            StoreBlock::Sealed(_) => Err(RuntimeError::Engine(format!(
                "block {} is sealed where an open block was expected",
                b.0
            ))),
        }
    }

    /// The sealed block behind `b` of a group.
    fn sealed_in(&self, b: BlockId, windowed: bool) -> Result<u32, RuntimeError> {
        match self.store_block_in(b, windowed) {
            StoreBlock::Sealed(i) => Ok(i),
            StoreBlock::Tail(_) => Err(RuntimeError::Engine(format!(
                "block {} is open where a sealed block was expected",
                b.0
            ))),
        }
    }

    /// Block indices a branch of `len` tokens after position `pos` spans.
    fn branch_span(&self, pos: usize, len: usize) -> Range<usize> {
        (pos + 1) / self.block_size..(pos + len) / self.block_size + 1
    }

    /// Branch blocks for branches of these lengths after position `pos`, if
    /// this step has them left (none taken otherwise).
    pub(super) fn take_branch_blocks(
        &mut self,
        pos: usize,
        lens: &[usize],
    ) -> Option<Vec<Range<u32>>> {
        let need: usize = lens.iter().map(|&n| self.branch_span(pos, n).len()).sum();
        if need > (self.branches.end - self.branch_next) as usize {
            return None;
        }
        Some(
            lens.iter()
                .map(|&n| {
                    let k = self.branch_span(pos, n).len() as u32;
                    self.branch_next += k;
                    self.branch_next - k..self.branch_next
                })
                .collect(),
        )
    }

    /// A new step: every branch block is free.
    pub(super) fn reset_branch_blocks(&mut self) {
        self.branch_next = self.branches.start;
    }

    /// After verification: the kept tokens of a branch (`kept` of them, at
    /// positions `pos + 1..`) go from its branch blocks into the request's
    /// own blocks (`table`, its lookahead slots), every layer.
    pub(super) fn keep_branch(
        &mut self,
        table: &[BlockId],
        pos: usize,
        branch: &Branch,
        kept: usize,
    ) -> Result<(), RuntimeError> {
        if kept == 0 {
            return Ok(());
        }
        let t = self.block_size;
        let span = self.branch_span(pos, kept);
        let mut copies = Vec::with_capacity(span.len());
        for i in span.clone() {
            let lo = (pos + 1).max(i * t);
            let hi = (pos + 1 + kept).min((i + 1) * t);
            let dst = table.get(i).ok_or_else(|| {
                RuntimeError::Engine(format!("a kept branch reaches block {i}, beyond its table"))
            })?;
            copies.push(RowCopy {
                src: branch.blocks.start + (i - span.start) as u32,
                dst: self.tail(*dst)?,
                rows: lo - i * t..hi - i * t,
            });
        }
        self.ctx
            .copy_rows(&copies)
            .map_err(|e| RuntimeError::Engine(e.to_string()))
    }

    /// Fills `g` for the runs of a step: the global group's part, and the
    /// windowed group's where there is one.
    pub(super) fn build_step(
        &self,
        kv: &KvGroups,
        items: &[StepItem],
        runs: &[Run],
        g: &mut GraftStep,
    ) -> Result<(), RuntimeError> {
        let mut windowed = g.windowed.take();
        g.clear();
        self.build_part(kv.global(), false, items, runs, g)?;
        if let Some(w) = kv.windowed() {
            let part = windowed.get_or_insert_default();
            part.clear();
            self.build_part(w, true, items, runs, part)?;
            g.windowed = windowed;
        }
        Ok(())
    }

    /// One group's part of a step, from its manager `kv` (`windowed`: the
    /// windowed group's, whose views name [`GraftStep::RELEASED`] for the
    /// blocks its window released).
    fn build_part(
        &self,
        kv: &KvCacheManager,
        windowed: bool,
        items: &[StepItem],
        runs: &[Run],
        g: &mut GraftStep,
    ) -> Result<(), RuntimeError> {
        let t = self.block_size;
        let cfg = kv.config();
        let mut scratch = self.scratch_of(windowed);
        let tail_of = |b: BlockId| self.tail_in(b, windowed);
        let sealed_of = |b: BlockId| self.sealed_in(b, windowed);
        for run in runs {
            let item = &items[run.item];
            let table = kv.block_table(item.handle);
            let seals: Vec<BlockSeal> = item
                .ops
                .iter()
                .filter_map(|op| match op {
                    BlockOp::Seal(s) if s.windowed == windowed => Some(*s),
                    _ => None,
                })
                .collect();
            for op in &item.ops {
                if let BlockOp::Copy(c) = op
                    && c.windowed == windowed
                {
                    g.copies.push(RowCopy {
                        src: tail_of(c.src)?,
                        dst: tail_of(c.dst)?,
                        rows: 0..c.tokens,
                    });
                }
            }
            // The open form of each block this step seals.
            let mut open_of: Vec<(usize, u32)> = Vec::with_capacity(seals.len());
            for s in &seals {
                let tail = match s.src {
                    Some(b) => tail_of(b)?,
                    None => scratch.next().ok_or_else(|| {
                        RuntimeError::Engine("the step's scratch blocks ran out".into())
                    })?,
                };
                open_of.push((s.index, tail));
                if s.encode {
                    g.seals.push((tail, sealed_of(s.dst)?));
                }
            }
            let open = |i: usize| -> Result<u32, RuntimeError> {
                match open_of.iter().find(|(j, _)| *j == i) {
                    Some(&(_, b)) => Ok(b),
                    None if table[i] == BlockId::NONE => Ok(GraftStep::RELEASED),
                    None => tail_of(table[i]),
                }
            };
            let start = item.start_pos;
            let end = start + run.batch.len();
            for p in start..end {
                g.writes.push((open(p / t)?, (p % t) as u16));
            }
            // Runs of queries between the seals that take effect inside.
            let mut cuts: Vec<usize> = seals
                .iter()
                .map(|s| s.at_len - 1)
                .filter(|&c| c > start && c < end)
                .collect();
            cuts.sort_unstable();
            cuts.push(end);
            let mut a = start;
            for b in cuts {
                let sealed_n = cfg.sealed_at(b);
                let mut kv_view = SeqKv {
                    sealed: Vec::with_capacity(sealed_n),
                    tail: Vec::new(),
                    len: b,
                };
                for (i, &block) in table.iter().enumerate().take(b.div_ceil(t)) {
                    if block == BlockId::NONE && i < sealed_n {
                        kv_view.sealed.push(GraftStep::RELEASED);
                    } else if i < sealed_n {
                        kv_view.sealed.push(sealed_of(block)?);
                    } else {
                        kv_view.tail.push(open(i)?);
                    }
                }
                // Test-only: a view one token longer than its blocks, which
                // the kernel refuses in the middle of the forward pass.
                #[cfg(feature = "fault-injection")]
                if item.id.0.starts_with("siliceo-fault-attention") {
                    kv_view.len += t;
                }
                let first = run.batch.start + (a - start);
                g.queries.push(GraftQuery {
                    tokens: first..first + (b - a),
                    kv: kv_view,
                });
                a = b;
            }
            // A token tree's later branches, after the decode token (never
            // with a windowed group: start-up turns trees off then).
            if windowed && !run.branches.is_empty() {
                return Err(RuntimeError::Engine(
                    "token-tree branches with a windowed group of blocks".into(),
                ));
            }
            let pos = (start + item.tokens.len()).saturating_sub(1);
            for br in &run.branches {
                let span = self.branch_span(pos, br.batch.len());
                if span.len() != br.blocks.len() {
                    return Err(RuntimeError::Engine(format!(
                        "a branch spans {} blocks and has {}",
                        span.len(),
                        br.blocks.len()
                    )));
                }
                if span.start == pos / t {
                    // Its first block starts as the request's partial block.
                    g.copies.push(RowCopy {
                        src: open(span.start)?,
                        dst: br.blocks.start,
                        rows: 0..pos % t + 1,
                    });
                }
                let end = pos + 1 + br.batch.len();
                for p in pos + 1..end {
                    g.writes.push((
                        br.blocks.start + (p / t - span.start) as u32,
                        (p % t) as u16,
                    ));
                }
                let sealed_n = cfg.sealed_at(end);
                if sealed_n > span.start {
                    return Err(RuntimeError::Engine(
                        "a token-tree branch reaches a seal".into(),
                    ));
                }
                let mut kv_view = SeqKv {
                    sealed: Vec::with_capacity(sealed_n),
                    tail: Vec::new(),
                    len: end,
                };
                for (i, &block) in table.iter().enumerate().take(span.start) {
                    if i < sealed_n {
                        kv_view.sealed.push(sealed_of(block)?);
                    } else {
                        kv_view.tail.push(open(i)?);
                    }
                }
                kv_view.tail.extend(br.blocks.clone());
                g.queries.push(GraftQuery {
                    tokens: br.batch.clone(),
                    kv: kv_view,
                });
            }
        }
        Ok(())
    }
}
