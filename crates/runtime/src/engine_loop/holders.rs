//! Holder sequence ids: how cached prefix blocks outlive their requests in
//! one llama.cpp context.
//!
//! In a unified KV cache a cell lives while at least one sequence id tags it.
//! A running request's sequence tags the cells of its blocks; when it ends,
//! every block of it that kv-paging still caches (and no other running
//! sequence references) is tagged into a holder sequence (`seq_cp` over the
//! block's positions) before the request's own sequence is removed. A prefix
//! hit tags the cells into the new request's sequence the same way; an
//! eviction removes the holder's tag (`seq_rm` over the block's positions).
//!
//! A holder's cells at one position must be one block only (a later
//! `seq_cp` copies whatever the holder has in that range), so each holder
//! keeps at most one block per block index.

use std::collections::{HashMap, HashSet};

use siliceo_core::SeqId;
use siliceo_kv_paging::BlockId;

/// Which holder keeps which cached block, at which block index.
#[derive(Debug)]
pub(crate) struct Holders {
    first: u32,
    count: u32,
    of: HashMap<BlockId, (u32, u32)>,
    taken: HashSet<(u32, u32)>,
}

impl Holders {
    /// `count` holders with sequence ids `first..first + count`.
    pub(crate) fn new(first: u32, count: u32) -> Self {
        Holders {
            first,
            count,
            of: HashMap::new(),
            taken: HashSet::new(),
        }
    }

    /// The holder sequence ids.
    pub(crate) fn seq_ids(&self) -> impl Iterator<Item = SeqId> {
        (self.first..self.first + self.count).map(SeqId)
    }

    /// Holder sequence ids.
    pub(crate) fn count(&self) -> u32 {
        self.count
    }

    /// Blocks held.
    pub(crate) fn len(&self) -> usize {
        self.of.len()
    }

    /// The holder of `b`, if one keeps it.
    pub(crate) fn get(&self, b: BlockId) -> Option<SeqId> {
        self.of.get(&b).map(|&(h, _)| SeqId(self.first + h))
    }

    /// Reserves a holder for block `b` at block index `index`; `None` when
    /// every holder already keeps a block there.
    pub(crate) fn place(&mut self, b: BlockId, index: u32) -> Option<SeqId> {
        debug_assert!(!self.of.contains_key(&b), "block {b:?} held twice");
        let h = (0..self.count).find(|h| !self.taken.contains(&(*h, index)))?;
        self.taken.insert((h, index));
        self.of.insert(b, (h, index));
        Some(SeqId(self.first + h))
    }

    /// Stops holding `b`: its holder and block index, for `seq_rm`.
    pub(crate) fn remove(&mut self, b: BlockId) -> Option<(SeqId, u32)> {
        let (h, index) = self.of.remove(&b)?;
        self.taken.remove(&(h, index));
        Some((SeqId(self.first + h), index))
    }

    /// The block indices each holder keeps, for checks.
    pub(crate) fn indices(&self, holder: SeqId) -> Vec<u32> {
        let h = holder.0 - self.first;
        let mut v: Vec<u32> = self
            .taken
            .iter()
            .filter(|(x, _)| *x == h)
            .map(|(_, i)| *i)
            .collect();
        v.sort_unstable();
        v
    }

    /// Every held block.
    pub(crate) fn blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.of.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_block_per_index_per_holder() {
        let mut h = Holders::new(8, 2);
        assert_eq!(h.place(BlockId(1), 0), Some(SeqId(8)));
        assert_eq!(h.place(BlockId(2), 0), Some(SeqId(9)));
        assert_eq!(h.place(BlockId(3), 0), None, "both holders keep index 0");
        assert_eq!(h.place(BlockId(4), 1), Some(SeqId(8)));
        assert_eq!(h.indices(SeqId(8)), vec![0, 1]);
        assert_eq!(h.remove(BlockId(1)), Some((SeqId(8), 0)));
        assert_eq!(h.remove(BlockId(1)), None);
        assert_eq!(h.place(BlockId(3), 0), Some(SeqId(8)));
        assert_eq!(h.len(), 3);
        assert_eq!(h.get(BlockId(2)), Some(SeqId(9)));
    }
}
