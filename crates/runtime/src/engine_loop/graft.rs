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
//! block: its rows go to a scratch block of the tail pool for the step.

use std::ops::Range;

use siliceo_engine::{GraftQuery, GraftStep, RowCopy, SeqKv, StoreBlock};
use siliceo_kv_paging::{BlockId, BlockOp, BlockSeal, KvCacheManager};
use siliceo_scheduler::StepItem;

use super::kv::GraftKv;
use crate::RuntimeError;

/// An item's tokens in the batch: its computed tokens, then drafted ones.
#[derive(Debug, Clone)]
pub(super) struct Run {
    /// Index into the step's items.
    pub(super) item: usize,
    /// Batch indices.
    pub(super) batch: Range<usize>,
}

impl GraftKv<'_> {
    fn tail(&self, b: BlockId) -> Result<u32, RuntimeError> {
        match self.store_block(b) {
            StoreBlock::Tail(i) => Ok(i),
            StoreBlock::Sealed(_) => Err(RuntimeError::Engine(format!(
                "block {} is sealed where an open block was expected",
                b.0
            ))),
        }
    }

    fn sealed(&self, b: BlockId) -> Result<u32, RuntimeError> {
        match self.store_block(b) {
            StoreBlock::Sealed(i) => Ok(i),
            StoreBlock::Tail(_) => Err(RuntimeError::Engine(format!(
                "block {} is open where a sealed block was expected",
                b.0
            ))),
        }
    }

    /// Fills `g` for the runs of a step.
    pub(super) fn build_step(
        &self,
        kv: &KvCacheManager,
        items: &[StepItem],
        runs: &[Run],
        g: &mut GraftStep,
    ) -> Result<(), RuntimeError> {
        g.clear();
        let t = self.block_size;
        let cfg = kv.config();
        let mut scratch = self.scratch.clone();
        for run in runs {
            let item = &items[run.item];
            let table = kv.block_table(item.handle);
            let seals: Vec<BlockSeal> = item
                .ops
                .iter()
                .filter_map(|op| match op {
                    BlockOp::Seal(s) => Some(*s),
                    BlockOp::Copy(_) => None,
                })
                .collect();
            for op in &item.ops {
                if let BlockOp::Copy(c) = op {
                    g.copies.push(RowCopy {
                        src: self.tail(c.src)?,
                        dst: self.tail(c.dst)?,
                        rows: c.tokens,
                    });
                }
            }
            // The open form of each block this step seals.
            let mut open_of: Vec<(usize, u32)> = Vec::with_capacity(seals.len());
            for s in &seals {
                let tail = match s.src {
                    Some(b) => self.tail(b)?,
                    None => scratch.next().ok_or_else(|| {
                        RuntimeError::Engine("the step's scratch blocks ran out".into())
                    })?,
                };
                open_of.push((s.index, tail));
                if s.encode {
                    g.seals.push((tail, self.sealed(s.dst)?));
                }
            }
            let open = |i: usize| -> Result<u32, RuntimeError> {
                match open_of.iter().find(|(j, _)| *j == i) {
                    Some(&(_, b)) => Ok(b),
                    None => self.tail(table[i]),
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
                    if i < sealed_n {
                        kv_view.sealed.push(self.sealed(block)?);
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
        }
        Ok(())
    }
}
