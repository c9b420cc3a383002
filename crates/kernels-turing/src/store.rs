//! A paged KV store for one layer in siliceo's formats.
//!
//! **Block layout** (the one the CUDA kernels and the native path use): a block
//! holds `block_tokens` tokens of every KV head. Its bytes are, for each KV head
//! `h` in order, the K segment then the V segment of that head
//! (see [`crate::codec`] for a segment's layout). Block `b` of a pool starts at
//! `b · block_bytes`.
//!
//! **Two pools**: *sealed* blocks in the layout's K/V codecs, and *tail* blocks
//! in F16 holding the most recent tokens. A sequence's tokens are its sealed
//! blocks (all full) followed by its tail blocks (all full but the last). When
//! the tail holds at least `tail_tokens + block_tokens` tokens, its oldest
//! block is quantized into a sealed block: the most recent `tail_tokens`
//! tokens (and the current partial block) stay full-precision. Per-channel
//! codecs (K5) need a full block anyway, so every format goes through the tail.
//!
//! With `rotate_k`, K is stored Hadamard-rotated per head (tail included) and
//! the kernels rotate Q the same way.

use half::f16;

use crate::KernelError;
use crate::codec::{Codec, MAX_HEAD_DIM};
use crate::hadamard::hadamard;

/// The shape and formats of one layer's KV store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Tokens per block (64 in serving; even).
    pub block_tokens: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Codec of sealed K.
    pub k: Codec,
    /// Codec of sealed V.
    pub v: Codec,
    /// Hadamard-rotate K per head (and Q at attention time).
    pub rotate_k: bool,
    /// Most recent tokens kept in F16 beyond the current partial block.
    pub tail_tokens: usize,
}

impl KvLayout {
    /// A layout with 64-token blocks, no rotation and no extra tail.
    pub fn new(kv_heads: usize, head_dim: usize, k: Codec, v: Codec) -> KvLayout {
        KvLayout {
            block_tokens: 64,
            kv_heads,
            head_dim,
            k,
            v,
            rotate_k: false,
            tail_tokens: 0,
        }
    }

    /// The named presets: `f16` (F16/F16), `kv8` (KV8/KV8), `k5v4` (K5/V4).
    pub fn preset(name: &str, kv_heads: usize, head_dim: usize) -> Result<KvLayout, KernelError> {
        let (k, v) = match name {
            "f16" => (Codec::F16, Codec::F16),
            "kv8" => (Codec::KV8, Codec::KV8),
            "k5v4" => (Codec::K5, Codec::V4),
            other => {
                let (k, v) = other.split_once(':').ok_or_else(|| {
                    KernelError::Layout(format!(
                        "unknown format `{other}` (f16, kv8, k5v4 or K:V codecs)"
                    ))
                })?;
                (Codec::parse(k, head_dim)?, Codec::parse(v, head_dim)?)
            }
        };
        Ok(KvLayout::new(kv_heads, head_dim, k, v))
    }

    /// Checks the layout is one the codecs and kernels accept.
    pub fn check(&self) -> Result<(), KernelError> {
        if self.kv_heads == 0 {
            return Err(KernelError::Layout("at least one KV head".into()));
        }
        if self.head_dim > MAX_HEAD_DIM {
            return Err(KernelError::Layout(format!(
                "head dimension {} over the maximum {MAX_HEAD_DIM}",
                self.head_dim
            )));
        }
        if self.block_tokens < 2 || !self.block_tokens.is_multiple_of(2) {
            return Err(KernelError::Layout(format!(
                "block size {} must be even and at least 2",
                self.block_tokens
            )));
        }
        if self.rotate_k && !self.head_dim.is_power_of_two() {
            return Err(KernelError::Layout(format!(
                "Hadamard rotation needs a power-of-two head dimension, not {}",
                self.head_dim
            )));
        }
        self.k.check(self.block_tokens, self.head_dim)?;
        self.v.check(self.block_tokens, self.head_dim)
    }

    /// Whether sealed blocks hold F16 K and V, the tail's own bytes: sealing
    /// would only copy, so a store of this layout need never seal.
    pub fn full_precision(&self) -> bool {
        self.k == Codec::F16 && self.v == Codec::F16
    }

    /// Bytes of one K segment (one head of one sealed block).
    pub fn k_segment_bytes(&self) -> usize {
        self.k.segment_bytes(self.block_tokens, self.head_dim)
    }

    /// Bytes of one V segment.
    pub fn v_segment_bytes(&self) -> usize {
        self.v.segment_bytes(self.block_tokens, self.head_dim)
    }

    /// Bytes of one sealed block (all heads, K and V).
    pub fn block_bytes(&self) -> usize {
        self.kv_heads * (self.k_segment_bytes() + self.v_segment_bytes())
    }

    /// Bytes of one tail block (F16).
    pub fn tail_block_bytes(&self) -> usize {
        self.kv_heads * 2 * Codec::F16.segment_bytes(self.block_tokens, self.head_dim)
    }

    /// How many tokens `k` and `v` hold (`n × kv_heads × head_dim` each,
    /// token-major, then head); a shape error when they disagree or are ragged.
    pub fn tokens_in(&self, k: &[f32], v: &[f32]) -> Result<usize, KernelError> {
        let row = self.kv_heads * self.head_dim;
        if k.len() != v.len() || !k.len().is_multiple_of(row) {
            return Err(KernelError::Shape(format!(
                "K ({}) and V ({}) must both be n × {} × {}",
                k.len(),
                v.len(),
                self.kv_heads,
                self.head_dim
            )));
        }
        Ok(k.len() / row)
    }

    /// KV bytes per token in sealed blocks (metadata included), all heads, K and V.
    pub fn bytes_per_token(&self) -> f64 {
        self.block_bytes() as f64 / self.block_tokens as f64
    }

    /// Average bits per K/V element in sealed blocks.
    pub fn bits_per_element(&self) -> f64 {
        self.bytes_per_token() * 8.0 / (2 * self.kv_heads * self.head_dim) as f64
    }

    /// A short name, e.g. `k5/v4/32+rot+tail128`.
    pub fn name(&self) -> String {
        let c = |c: Codec| match c {
            Codec::F16 => "f16".to_string(),
            Codec::Kv8 { group } => format!("kv8/{group}"),
            Codec::K5 => "k5".to_string(),
            Codec::V4 { group } => format!("v4/{group}"),
        };
        let mut s = format!("{}:{}", c(self.k), c(self.v));
        if self.rotate_k {
            s.push_str("+rot");
        }
        if self.tail_tokens > 0 {
            s.push_str(&format!("+tail{}", self.tail_tokens));
        }
        s
    }
}

/// The blocks of one sequence in a [`KvStore`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeqKv {
    /// Sealed blocks, oldest first (all full).
    pub sealed: Vec<u32>,
    /// Tail blocks (F16) after the sealed ones (all full but the last).
    pub tail: Vec<u32>,
    /// Tokens stored.
    pub len: usize,
}

impl SeqKv {
    /// Blocks in all (sealed, then tail).
    pub fn blocks(&self) -> usize {
        self.sealed.len() + self.tail.len()
    }

    /// The sequence's first `len` tokens, as a sequence of their own over
    /// the same blocks (blocks of `block_tokens`): what a query at position
    /// `len − 1` sees. `None` if the table holds fewer blocks than that.
    pub fn prefix(&self, len: usize, block_tokens: usize) -> Option<SeqKv> {
        let blocks = len.div_ceil(block_tokens.max(1));
        let sealed = blocks.min(self.sealed.len());
        Some(SeqKv {
            sealed: self.sealed[..sealed].to_vec(),
            tail: self.tail.get(..blocks - sealed)?.to_vec(),
            len,
        })
    }
}

/// Aligned byte storage (f16 views need 2-byte alignment; 64-byte chunks keep
/// blocks on cache lines when block sizes allow).
#[derive(Debug, Default)]
struct Bytes {
    words: Vec<[u64; 8]>,
    len: usize,
}

impl Bytes {
    fn zeroed(len: usize) -> Bytes {
        Bytes {
            words: vec![[0u64; 8]; len.div_ceil(64)],
            len,
        }
    }
    fn as_slice(&self) -> &[u8] {
        // SAFETY: the words are plain initialised integers; the byte length is within them.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` gives unique access.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }
}

/// What an append does, in order: new tokens written into rows of F16 tail
/// blocks, and full tail blocks sealed into the layout's codecs as they age
/// out. A sealed tail block is free at once, so a later write of the same
/// append may reuse it: the steps must run in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppendStep {
    /// Token `token` of the append goes to row `row` of tail block `block`.
    Write {
        /// Index of the token within the append.
        token: usize,
        /// Tail block.
        block: u32,
        /// Row (token slot) within the block.
        row: usize,
    },
    /// Tail block `src`, full, is quantized into sealed block `dst` and freed.
    Seal {
        /// Tail block.
        src: u32,
        /// Sealed block.
        dst: u32,
    },
}

/// The block bookkeeping of a store, apart from its bytes: the free lists of
/// both pools and what an append or a release does to them and to a
/// sequence's block table. [`KvStore`] keeps its bytes in host memory; the
/// device store (`device::DeviceKv`) keeps them on a GPU and runs the same
/// bookkeeping, so both place every token in the same block and row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockPools {
    block_tokens: usize,
    tail_tokens: usize,
    sealed_free: Vec<u32>,
    tail_free: Vec<u32>,
    sealed_blocks: usize,
    tail_blocks: usize,
}

impl BlockPools {
    /// Pools of `sealed_blocks` and `tail_blocks` blocks for `layout`, all free.
    pub fn new(
        layout: &KvLayout,
        sealed_blocks: usize,
        tail_blocks: usize,
    ) -> Result<BlockPools, KernelError> {
        layout.check()?;
        if sealed_blocks > u32::MAX as usize || tail_blocks > u32::MAX as usize {
            return Err(KernelError::Layout("too many blocks".into()));
        }
        Ok(BlockPools {
            block_tokens: layout.block_tokens,
            tail_tokens: layout.tail_tokens,
            sealed_free: (0..sealed_blocks as u32).rev().collect(),
            tail_free: (0..tail_blocks as u32).rev().collect(),
            sealed_blocks,
            tail_blocks,
        })
    }

    /// Free (sealed, tail) blocks.
    pub fn free_blocks(&self) -> (usize, usize) {
        (self.sealed_free.len(), self.tail_free.len())
    }

    /// Total (sealed, tail) blocks.
    pub fn capacity(&self) -> (usize, usize) {
        (self.sealed_blocks, self.tail_blocks)
    }

    /// Places `n` new tokens of `seq`: takes the blocks they need, updates
    /// `seq`'s block tables and length, and returns the steps that write them
    /// (and seal what ages out), in order. All or nothing: when the pools
    /// cannot hold them, nothing changes and the error says what was free.
    pub fn plan_append(
        &mut self,
        seq: &mut SeqKv,
        n: usize,
    ) -> Result<Vec<AppendStep>, KernelError> {
        let t = self.block_tokens;
        // Dry run over the counts: tail blocks to hold new tokens, sealed blocks
        // for what ages out (a sealed tail block is free again at once).
        let (mut tail_n, mut sealed_n, mut len) = (seq.tail.len(), seq.sealed.len(), seq.len);
        let (mut tail_free, mut sealed_free) = (self.tail_free.len(), self.sealed_free.len());
        for _ in 0..n {
            if (len - sealed_n * t) / t == tail_n {
                if tail_free == 0 {
                    return Err(self.out_of_blocks(n));
                }
                tail_free -= 1;
                tail_n += 1;
            }
            len += 1;
            if len - sealed_n * t >= self.tail_tokens + t {
                if sealed_free == 0 {
                    return Err(self.out_of_blocks(n));
                }
                sealed_free -= 1;
                sealed_n += 1;
                tail_n -= 1;
                tail_free += 1;
            }
        }
        let mut steps = Vec::with_capacity(n + n / t + 1);
        for token in 0..n {
            let pos = seq.len - seq.sealed.len() * t;
            let (bi, row) = (pos / t, pos % t);
            if bi == seq.tail.len() {
                seq.tail
                    .push(self.tail_free.pop().expect("checked by the dry run"));
            }
            steps.push(AppendStep::Write {
                token,
                block: seq.tail[bi],
                row,
            });
            seq.len += 1;
            if seq.len - seq.sealed.len() * t >= self.tail_tokens + t {
                let src = seq.tail.remove(0);
                let dst = self.sealed_free.pop().expect("checked by the dry run");
                steps.push(AppendStep::Seal { src, dst });
                seq.sealed.push(dst);
                self.tail_free.push(src);
            }
        }
        assert_eq!((seq.tail.len(), seq.sealed.len()), (tail_n, sealed_n));
        Ok(steps)
    }

    fn out_of_blocks(&self, tokens: usize) -> KernelError {
        KernelError::OutOfBlocks {
            tokens,
            sealed_free: self.sealed_free.len(),
            tail_free: self.tail_free.len(),
        }
    }

    /// Frees a sequence's blocks and empties it.
    pub fn release(&mut self, seq: &mut SeqKv) {
        self.sealed_free.append(&mut seq.sealed);
        self.tail_free.append(&mut seq.tail);
        seq.len = 0;
    }
}

/// One layer's KV bytes in siliceo's formats: a pool of sealed blocks and a
/// pool of F16 tail blocks, addressed by block index, and what can be done to
/// them — write a token's row, seal a full tail block, copy rows, read and
/// restore a block's bytes, decode a sequence. Which block a token goes to is
/// the caller's business: [`KvStore`] adds its own bookkeeping
/// ([`BlockPools`]); a server keeps its own allocator (one for all layers) and
/// drives the same operations.
#[derive(Debug)]
pub struct KvPages {
    layout: KvLayout,
    sealed: Bytes,
    tail: Bytes,
    sealed_blocks: usize,
    tail_blocks: usize,
    /// Tail blocks lent by a [`SharedTail`] (ids from `tail_blocks`).
    shared: SharedTail,
}

/// Tail blocks that several [`KvPages`] (the layers of a model) take turns
/// to hold, for rows that live only while one layer is computed — a step's
/// scratch for blocks filled and sealed within it. Lent with
/// [`KvPages::swap_shared`]: while lent, tail ids `tail_blocks..tail_blocks
/// + blocks` of those pages address it.
#[derive(Debug, Default)]
pub struct SharedTail {
    bytes: Bytes,
    blocks: usize,
}

impl SharedTail {
    /// `blocks` tail blocks of `layout`, zeroed.
    pub fn new(layout: &KvLayout, blocks: usize) -> SharedTail {
        SharedTail {
            bytes: Bytes::zeroed(blocks * layout.tail_block_bytes()),
            blocks,
        }
    }

    /// Blocks it holds (0 once lent: the pages hold them).
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Bytes it holds.
    pub fn byte_len(&self) -> usize {
        self.bytes.len
    }
}

impl KvPages {
    /// `sealed_blocks` sealed and `tail_blocks` tail blocks, zeroed.
    pub fn new(
        layout: KvLayout,
        sealed_blocks: usize,
        tail_blocks: usize,
    ) -> Result<KvPages, KernelError> {
        layout.check()?;
        if sealed_blocks > u32::MAX as usize || tail_blocks > u32::MAX as usize {
            return Err(KernelError::Layout("too many blocks".into()));
        }
        Ok(KvPages {
            layout,
            sealed: Bytes::zeroed(sealed_blocks * layout.block_bytes()),
            tail: Bytes::zeroed(tail_blocks * layout.tail_block_bytes()),
            sealed_blocks,
            tail_blocks,
            shared: SharedTail::default(),
        })
    }

    /// Swaps the shared tail blocks these pages hold with `other`: lends
    /// `other`'s to them, or (called again) takes them back.
    pub fn swap_shared(&mut self, other: &mut SharedTail) {
        std::mem::swap(&mut self.shared, other);
    }

    /// Shared tail blocks these pages hold now.
    pub fn shared_blocks(&self) -> usize {
        self.shared.blocks
    }

    /// Which buffer tail block `b` is in (`true`: the shared one) and its
    /// offset there.
    fn tail_loc(&self, b: u32) -> (bool, usize) {
        let n = self.layout.tail_block_bytes();
        let b = b as usize;
        if b < self.tail_blocks {
            (false, b * n)
        } else {
            (true, (b - self.tail_blocks) * n)
        }
    }

    fn tail_buf(&self, shared: bool) -> &[u8] {
        if shared {
            self.shared.bytes.as_slice()
        } else {
            self.tail.as_slice()
        }
    }

    fn tail_buf_mut(&mut self, shared: bool) -> &mut [u8] {
        if shared {
            self.shared.bytes.as_mut_slice()
        } else {
            self.tail.as_mut_slice()
        }
    }

    /// The layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Blocks in the (sealed, tail) pools.
    pub fn capacity(&self) -> (usize, usize) {
        (self.sealed_blocks, self.tail_blocks)
    }

    /// Bytes held by both pools (shared tail blocks not counted).
    pub fn byte_len(&self) -> usize {
        self.sealed.len + self.tail.len
    }

    /// The bytes of sealed block `b`.
    pub fn sealed_block(&self, b: u32) -> &[u8] {
        let n = self.layout.block_bytes();
        &self.sealed.as_slice()[b as usize * n..(b as usize + 1) * n]
    }

    /// The bytes of tail block `b` (a shared one only while lent).
    pub fn tail_block(&self, b: u32) -> &[u8] {
        let n = self.layout.tail_block_bytes();
        let (shared, off) = self.tail_loc(b);
        &self.tail_buf(shared)[off..off + n]
    }

    /// Sealed block `b`'s bytes, to restore a saved block.
    pub fn sealed_block_mut(&mut self, b: u32) -> &mut [u8] {
        let n = self.layout.block_bytes();
        &mut self.sealed.as_mut_slice()[b as usize * n..(b as usize + 1) * n]
    }

    /// Tail block `b`'s bytes, to restore a saved block.
    pub fn tail_block_mut(&mut self, b: u32) -> &mut [u8] {
        let n = self.layout.tail_block_bytes();
        let (shared, off) = self.tail_loc(b);
        &mut self.tail_buf_mut(shared)[off..off + n]
    }

    /// All sealed-pool bytes (for copying to a device).
    pub fn sealed_bytes(&self) -> &[u8] {
        self.sealed.as_slice()
    }

    /// All tail-pool bytes (for copying to a device).
    pub fn tail_bytes(&self) -> &[u8] {
        self.tail.as_slice()
    }

    /// Writes one token's K and V (`kv_heads × head_dim` each, head-major) into
    /// row `row` of tail block `block` (K rotated first with `rotate_k`).
    ///
    /// # Panics
    /// When the block or row is outside the pool or the rows are not one
    /// token long.
    pub fn write_token(&mut self, block: u32, row: usize, k: &[f32], v: &[f32]) {
        let l = self.layout;
        assert!(row < l.block_tokens, "row {row} outside a block");
        assert_eq!(k.len(), l.kv_heads * l.head_dim, "K row length");
        assert_eq!(v.len(), l.kv_heads * l.head_dim, "V row length");
        let seg = Codec::F16.segment_bytes(l.block_tokens, l.head_dim);
        let (shared, base) = self.tail_loc(block);
        let tail = self.tail_buf_mut(shared);
        let mut krow = [0f32; MAX_HEAD_DIM];
        for h in 0..l.kv_heads {
            let src = h * l.head_dim;
            let kdst = base + h * 2 * seg + row * l.head_dim * 2;
            let vdst = kdst + seg;
            let kr = &mut krow[..l.head_dim];
            kr.copy_from_slice(&k[src..src + l.head_dim]);
            if l.rotate_k {
                hadamard(kr);
            }
            write_f16(&mut tail[kdst..kdst + l.head_dim * 2], kr);
            write_f16(
                &mut tail[vdst..vdst + l.head_dim * 2],
                &v[src..src + l.head_dim],
            );
        }
    }

    /// Copies token rows `rows` of tail block `src` into the same rows of
    /// tail block `dst` (copy-on-write of a shared partial block, a token
    /// tree's branch). Rows past the block are ignored.
    pub fn copy_tail_rows(&mut self, src: u32, dst: u32, rows: std::ops::Range<usize>) {
        let l = self.layout;
        let seg = Codec::F16.segment_bytes(l.block_tokens, l.head_dim);
        let row = l.head_dim * 2;
        let (lo, hi) = (rows.start.min(l.block_tokens), rows.end.min(l.block_tokens));
        if lo >= hi || src == dst {
            return;
        }
        let ((ss, sb), (ds, db)) = (self.tail_loc(src), self.tail_loc(dst));
        let n = (hi - lo) * row;
        for s in 0..2 * l.kv_heads {
            let (from, to) = (sb + s * seg + lo * row, db + s * seg + lo * row);
            if ss == ds {
                self.tail_buf_mut(ss).copy_within(from..from + n, to);
            } else {
                let (own, shared) = (self.tail.as_mut_slice(), self.shared.bytes.as_mut_slice());
                let (from_buf, to_buf) = if ss { (shared, own) } else { (own, shared) };
                to_buf[to..to + n].copy_from_slice(&from_buf[from..from + n]);
            }
        }
    }

    /// Quantizes tail block `src` (full) into sealed block `dst`.
    pub fn seal(&mut self, src: u32, dst: u32) {
        let l = self.layout;
        let (t, d) = (l.block_tokens, l.head_dim);
        let f16_seg = Codec::F16.segment_bytes(t, d);
        let (ks, vs) = (l.k_segment_bytes(), l.v_segment_bytes());
        let mut tile = vec![0f32; t * d];
        let (shared, src_base) = self.tail_loc(src);
        let dst_base = dst as usize * l.block_bytes();
        for h in 0..l.kv_heads {
            for (which, codec, dst_off, dst_len) in [
                (0, l.k, h * (ks + vs), ks),
                (1, l.v, h * (ks + vs) + ks, vs),
            ] {
                let s = src_base + (h * 2 + which) * f16_seg;
                Codec::F16.decode(&self.tail_buf(shared)[s..s + f16_seg], t, d, &mut tile);
                let dst = &mut self.sealed.as_mut_slice()
                    [dst_base + dst_off..dst_base + dst_off + dst_len];
                codec.encode(&tile, t, d, dst);
            }
        }
    }

    /// Decodes a sequence back to f32 K and V (`len × kv_heads × head_dim`), K
    /// un-rotated: what the kernel sees, for references and quality checks.
    pub fn read(&self, seq: &SeqKv) -> (Vec<f32>, Vec<f32>) {
        let l = self.layout;
        let (t, d, hn) = (l.block_tokens, l.head_dim, l.kv_heads);
        let mut k = vec![0f32; seq.len * hn * d];
        let mut v = vec![0f32; seq.len * hn * d];
        let mut tile = vec![0f32; t * d];
        for b in 0..seq.blocks() {
            let tokens = (seq.len - b * t).min(t);
            for h in 0..hn {
                for (which, out) in [(0, &mut k), (1, &mut v)] {
                    let (codec, seg) = self.segment(seq, b, h, which == 1);
                    codec.decode(seg, t, d, &mut tile);
                    for r in 0..tokens {
                        let dst = ((b * t + r) * hn + h) * d;
                        out[dst..dst + d].copy_from_slice(&tile[r * d..(r + 1) * d]);
                        if which == 0 && l.rotate_k {
                            hadamard(&mut out[dst..dst + d]);
                        }
                    }
                }
            }
        }
        (k, v)
    }

    /// The codec and bytes of K (`value == false`) or V of head `h` in block `b`
    /// (0-based over the sequence's sealed then tail blocks).
    pub fn segment<'a>(
        &'a self,
        seq: &SeqKv,
        b: usize,
        h: usize,
        value: bool,
    ) -> (Codec, &'a [u8]) {
        let l = &self.layout;
        if b < seq.sealed.len() {
            let (ks, vs) = (l.k_segment_bytes(), l.v_segment_bytes());
            let block = self.sealed_block(seq.sealed[b]);
            let off = h * (ks + vs);
            if value {
                (l.v, &block[off + ks..off + ks + vs])
            } else {
                (l.k, &block[off..off + ks])
            }
        } else {
            let seg = Codec::F16.segment_bytes(l.block_tokens, l.head_dim);
            let block = self.tail_block(seq.tail[b - seq.sealed.len()]);
            let off = (h * 2 + usize::from(value)) * seg;
            (Codec::F16, &block[off..off + seg])
        }
    }
}

/// One layer's KV in siliceo's formats with its own block bookkeeping: the
/// bytes ([`KvPages`], which it dereferences to) and [`BlockPools`] that
/// place each appended token and seal what ages out of the tail.
#[derive(Debug)]
pub struct KvStore {
    pages: KvPages,
    pools: BlockPools,
}

impl std::ops::Deref for KvStore {
    type Target = KvPages;
    fn deref(&self) -> &KvPages {
        &self.pages
    }
}

impl KvStore {
    /// A store with `sealed_blocks` sealed blocks and `tail_blocks` tail blocks.
    pub fn new(
        layout: KvLayout,
        sealed_blocks: usize,
        tail_blocks: usize,
    ) -> Result<KvStore, KernelError> {
        Ok(KvStore {
            pools: BlockPools::new(&layout, sealed_blocks, tail_blocks)?,
            pages: KvPages::new(layout, sealed_blocks, tail_blocks)?,
        })
    }

    /// Tail blocks a sequence holds at most: `tail_tokens` plus a full block
    /// (the moment before the oldest is sealed).
    pub fn tail_blocks_per_seq(layout: &KvLayout) -> usize {
        (layout.tail_tokens + layout.block_tokens).div_ceil(layout.block_tokens)
    }

    /// Free (sealed, tail) blocks.
    pub fn free_blocks(&self) -> (usize, usize) {
        self.pools.free_blocks()
    }

    /// The block bookkeeping (which blocks are free).
    pub fn pools(&self) -> &BlockPools {
        &self.pools
    }

    /// Appends `n` tokens: `k` and `v` are `n × kv_heads × head_dim` (token-major,
    /// then head). Either every token is stored or, when blocks run out, none is
    /// and the sequence is unchanged.
    pub fn append(&mut self, seq: &mut SeqKv, k: &[f32], v: &[f32]) -> Result<(), KernelError> {
        let l = self.pages.layout;
        let n = l.tokens_in(k, v)?;
        let row = l.kv_heads * l.head_dim;
        for step in self.pools.plan_append(seq, n)? {
            match step {
                AppendStep::Write {
                    token,
                    block,
                    row: slot,
                } => self.pages.write_token(
                    block,
                    slot,
                    &k[token * row..(token + 1) * row],
                    &v[token * row..(token + 1) * row],
                ),
                AppendStep::Seal { src, dst } => self.pages.seal(src, dst),
            }
        }
        Ok(())
    }

    /// Returns the sequence's blocks to the pools and empties it.
    pub fn release(&mut self, seq: &mut SeqKv) {
        self.pools.release(seq);
    }
}

fn write_f16(dst: &mut [u8], src: &[f32]) {
    for (o, v) in dst.chunks_exact_mut(2).zip(src) {
        o.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
    }
}
