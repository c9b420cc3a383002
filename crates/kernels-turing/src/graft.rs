//! Grafted serving on the device: one layer's step of a batch — its K/V
//! rows written into tail blocks, row copies, seals, then attention for every
//! batch token — run by the kernels straight on the tensors llama.cpp
//! computed on the same device (Q, and K/V in its f16 cache), with the output
//! written into llama.cpp's attention output. Nothing goes through the host
//! but the step's small tables, uploaded once per decode ([`DeviceStep`]) and
//! used by every layer.
//!
//! The decode kernel serves each batch token as a sequence of its own: token
//! `j` of a query run of `n` tokens over a sequence of `len` tokens sees the
//! first `len - n + 1 + j` tokens (causal), through the first blocks of the
//! run's block table. One launch covers a whole prefill chunk.
//!
//! The layout and codecs are the CPU store's ([`crate::KvPages`]): a block
//! written and sealed here holds the bytes the CPU store would hold for the
//! same K/V (the write kernel rotates and rounds as the CPU does).

use std::ops::Range;

use crate::KernelError;
use crate::device::{Arg, Backend, DecodeRun, DeviceKv, Kernels, Launch, le_bytes};
use crate::store::{KvLayout, SeqKv};

/// A `[head_dim, tokens, heads]` tensor in device memory, as llama.cpp lays
/// it out: its address, element type (f16 or f32), byte strides of the three
/// dimensions, and the bytes from `addr` that belong to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRows {
    /// Device address of element (0, 0, 0).
    pub addr: u64,
    /// f16 elements (else f32).
    pub f16: bool,
    /// Byte strides of channel, token and head.
    pub nb: [usize; 3],
    /// Bytes from `addr` the tensor owns (what the kernels may read).
    pub bytes: usize,
}

impl DeviceRows {
    /// A shape error unless `tokens` tokens of `heads` heads of `d` channels
    /// lie within the tensor and its strides fit the kernels' 32-bit ones.
    fn check(&self, what: &str, d: usize, tokens: usize, heads: usize) -> Result<(), KernelError> {
        let elem = if self.f16 { 2 } else { 4 };
        let [n0, n1, n2] = self.nb;
        let span = (d - 1) * n0 + tokens.saturating_sub(1) * n1 + (heads - 1) * n2 + elem;
        if self.addr == 0 || span > self.bytes {
            return Err(KernelError::Shape(format!(
                "{what}: {tokens} tokens of {heads} heads of {d} span {span} bytes of a tensor of {}",
                self.bytes
            )));
        }
        if self.nb.iter().any(|&b| b > u32::MAX as usize)
            || !(self.addr as usize).is_multiple_of(elem)
        {
            return Err(KernelError::Shape(format!(
                "{what}: strides {:?} or address {:#x} the kernels cannot take",
                self.nb, self.addr
            )));
        }
        Ok(())
    }
}

/// Contiguous bytes in device memory the backend did not allocate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSpan {
    /// Device address.
    pub addr: u64,
    /// Bytes.
    pub bytes: usize,
}

/// One query run of a grafted step: `tokens` consecutive batch tokens of one
/// sequence, the last of them at position `kv.len - 1`, each seeing `kv`'s
/// blocks up to itself.
#[derive(Debug, Clone, Copy)]
pub struct QueryRun<'a> {
    /// Batch tokens in the run.
    pub tokens: usize,
    /// The sequence's blocks and length after the run's last token.
    pub kv: &'a SeqKv,
}

/// A grafted step's tables on the device, for every layer of one decode:
/// where each batch token's K/V go, and the block table of every batch
/// token's attention.
#[derive(Debug)]
pub struct DeviceStep<B: Backend> {
    tokens: usize,
    heads: usize,
    write_blocks: B::Buf,
    write_rows: B::Buf,
    /// Row copies (src, dst, rows), after the writes, in order.
    copies: Vec<(u32, u32, Range<usize>)>,
    /// Seals (tail, sealed), after the copies.
    seals: Vec<(u32, u32)>,
    decode: DecodeRun<B>,
}

impl<B: Backend> DeviceStep<B> {
    /// Batch tokens of the step.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
}

impl<B: Backend> Kernels<B> {
    /// Uploads a step's tables: `writes[i]` is batch token `i`'s (tail block,
    /// row); `copies` (src, dst, rows) and `seals` (tail, sealed) follow the
    /// writes in every layer, in order; `runs` cover the batch in order.
    /// `kv` is any layer's store (they share layout and size).
    pub fn graft_step(
        &self,
        kv: &DeviceKv<B>,
        n_heads: usize,
        writes: &[(u32, u16)],
        copies: Vec<(u32, u32, Range<usize>)>,
        seals: Vec<(u32, u32)>,
        runs: &[QueryRun<'_>],
    ) -> Result<DeviceStep<B>, KernelError> {
        let l = kv.layout;
        let n = writes.len();
        let (sealed, tail) = kv.pools.capacity();
        if copies
            .iter()
            .any(|&(s, d, _)| s as usize >= tail || d as usize >= tail)
            || seals
                .iter()
                .any(|&(s, d)| s as usize >= tail || d as usize >= sealed)
        {
            return Err(KernelError::Shape(
                "a copy or seal names a block outside the pools".into(),
            ));
        }
        if let Some(&(b, r)) = writes
            .iter()
            .find(|&&(b, r)| b as usize >= tail || usize::from(r) >= l.block_tokens)
        {
            return Err(KernelError::Shape(format!(
                "a write to row {r} of tail block {b}, outside the pool"
            )));
        }
        if runs.iter().map(|r| r.tokens).sum::<usize>() != n || runs.iter().any(|r| r.tokens == 0) {
            return Err(KernelError::Shape(format!(
                "query runs of {:?} tokens for a step of {n}",
                runs.iter().map(|r| r.tokens).collect::<Vec<_>>()
            )));
        }
        // Each batch token as a sequence of its own: the run's first blocks.
        let mut seqs = Vec::with_capacity(n);
        for r in runs {
            if r.kv.len < r.tokens {
                return Err(KernelError::Shape(format!(
                    "a run of {} tokens over a sequence of {}",
                    r.tokens, r.kv.len
                )));
            }
            for j in 0..r.tokens {
                let len = r.kv.len - r.tokens + 1 + j;
                let seq = r.kv.prefix(len, l.block_tokens).ok_or_else(|| {
                    KernelError::Shape(format!(
                        "a block table of {} blocks for {len} tokens",
                        r.kv.blocks()
                    ))
                })?;
                seqs.push(seq);
            }
        }
        let refs: Vec<&SeqKv> = seqs.iter().collect();
        let decode = self.decode_run(kv, &refs, n_heads, 0, None)?;
        let (blocks, rows): (Vec<u32>, Vec<i32>) =
            writes.iter().map(|&(b, r)| (b, i32::from(r))).unzip();
        let b = self.backend();
        Ok(DeviceStep {
            tokens: n,
            heads: n_heads,
            write_blocks: b.upload(&le_bytes(&blocks, |x| x.to_le_bytes()))?,
            write_rows: b.upload(&le_bytes(&rows, |x| x.to_le_bytes()))?,
            copies,
            seals,
            decode,
        })
    }

    /// One layer of a grafted step, in this order: the batch's K and V (`k`,
    /// `v`: `[head_dim, ≥ tokens, kv_heads]`) into their tail rows, the step's
    /// copies and seals, then attention of every batch token (`q`:
    /// `[head_dim, ≥ tokens, heads]`, × `scale`) into `out`, contiguous
    /// `tokens × heads × head_dim` f32. Waits for the kernels before it
    /// returns. A failure can leave rows written: the caller frees the blocks
    /// the step wrote.
    #[allow(clippy::too_many_arguments)]
    pub fn graft_layer(
        &self,
        kv: &mut DeviceKv<B>,
        step: &DeviceStep<B>,
        q: DeviceRows,
        k: DeviceRows,
        v: DeviceRows,
        scale: f32,
        out: DeviceSpan,
    ) -> Result<(), KernelError> {
        let l = kv.layout;
        let (d, kvh, n, h) = (l.head_dim, l.kv_heads, step.tokens, step.heads);
        k.check("K", d, n, kvh)?;
        v.check("V", d, n, kvh)?;
        q.check("Q", d, n, h)?;
        if out.addr == 0 || out.bytes < n * h * d * 4 {
            return Err(KernelError::Shape(format!(
                "an attention output of {} bytes for {n} tokens",
                out.bytes
            )));
        }
        let b = self.backend();
        let norm = 1.0 / (d as f32).sqrt();
        let rows = Launch {
            grid: (kvh as u32, n as u32, 1),
            block: d as u32,
            shared_bytes: (d * 4) as u32,
        };
        let args = [
            Arg::Buf(&kv.tail),
            Arg::Ptr(k.addr),
            Arg::Ptr(v.addr),
            Arg::I32(i32::from(k.f16)),
            Arg::I32(i32::from(v.f16)),
            Arg::U32(k.nb[0] as u32),
            Arg::U32(k.nb[1] as u32),
            Arg::U32(k.nb[2] as u32),
            Arg::U32(v.nb[0] as u32),
            Arg::U32(v.nb[1] as u32),
            Arg::U32(v.nb[2] as u32),
            Arg::Buf(&step.write_blocks),
            Arg::Buf(&step.write_rows),
            Arg::I32(kvh as i32),
            Arg::I32(d as i32),
            Arg::I32(l.block_tokens as i32),
            Arg::I32(i32::from(l.rotate_k)),
            Arg::F32(norm),
        ];
        // The writes come first: copies and seals may read the rows they write.
        // SAFETY: the arguments match `siliceo_kv_write_strided`; K and V hold
        // n tokens of kvh heads of d at their strides (checked), and every
        // (block, row) lies in the tail pool (checked by `graft_step`).
        if n > 0 {
            unsafe { b.launch("siliceo_kv_write_strided", rows, &args) }?;
        }
        for (src, dst, rows) in &step.copies {
            self.enqueue_copy_rows(kv, *src, *dst, rows.clone())?;
        }
        for &(src, dst) in &step.seals {
            self.enqueue_seal(kv, src, dst)?;
        }
        let gather = Launch {
            grid: (h as u32, n as u32, 1),
            block: d as u32,
            shared_bytes: (d * 4) as u32,
        };
        let args = [
            Arg::Buf(step.decode.query_buf()),
            Arg::Ptr(q.addr),
            Arg::I32(i32::from(q.f16)),
            Arg::U32(q.nb[0] as u32),
            Arg::U32(q.nb[1] as u32),
            Arg::U32(q.nb[2] as u32),
            Arg::I32(h as i32),
            Arg::I32(d as i32),
            Arg::F32(scale),
            Arg::I32(i32::from(l.rotate_k)),
            Arg::F32(norm),
        ];
        // SAFETY: the arguments match `siliceo_gather_q`; Q holds n tokens of
        // h heads (checked) and the query buffer n × h × d f32.
        unsafe { b.launch("siliceo_gather_q", gather, &args) }?;
        // SAFETY: `out` holds n × h × d f32 (checked above).
        unsafe { step.decode.enqueue_into(self, kv, Arg::Ptr(out.addr)) }?;
        b.synchronize()
    }

    /// Copies token rows `rows` of tail block `src` into tail block `dst`
    /// (both layers' K and V, every head) and waits.
    pub fn copy_rows(
        &self,
        kv: &mut DeviceKv<B>,
        src: u32,
        dst: u32,
        rows: Range<usize>,
    ) -> Result<(), KernelError> {
        self.enqueue_copy_rows(kv, src, dst, rows)?;
        self.backend().synchronize()
    }

    fn enqueue_copy_rows(
        &self,
        kv: &mut DeviceKv<B>,
        src: u32,
        dst: u32,
        rows: Range<usize>,
    ) -> Result<(), KernelError> {
        let l = kv.layout;
        let (_, tail) = kv.pools.capacity();
        let rows = rows.start.min(l.block_tokens)..rows.end.min(l.block_tokens);
        if src as usize >= tail || dst as usize >= tail {
            return Err(KernelError::Shape(format!(
                "a copy from tail block {src} to {dst}, outside the pool of {tail}"
            )));
        }
        if rows.is_empty() || src == dst {
            return Ok(());
        }
        let count = rows.len() * l.head_dim;
        let launch = Launch {
            grid: (count.div_ceil(256) as u32, l.kv_heads as u32, 2),
            block: 256,
            shared_bytes: 0,
        };
        let args = [
            Arg::Buf(&kv.tail),
            Arg::U32(src),
            Arg::U32(dst),
            Arg::I32(rows.start as i32),
            Arg::I32(rows.len() as i32),
            Arg::I32(l.kv_heads as i32),
            Arg::I32(l.head_dim as i32),
            Arg::I32(l.block_tokens as i32),
        ];
        // SAFETY: the arguments match `siliceo_kv_copy_rows`; both blocks and
        // the rows lie in the tail pool (checked above).
        unsafe { self.backend().launch("siliceo_kv_copy_rows", launch, &args) }
    }

    /// The bytes of one block (`sealed` pool or tail), e.g. to swap it out.
    pub fn read_block(
        &self,
        kv: &DeviceKv<B>,
        sealed: bool,
        block: u32,
    ) -> Result<Vec<u8>, KernelError> {
        let (buf, size) = block_range(kv, sealed, block)?;
        self.backend()
            .read_at(if sealed { &kv.sealed } else { &kv.tail }, buf, size)
    }

    /// Writes one block's bytes back (`bytes` as [`Kernels::read_block`] gave).
    pub fn write_block(
        &self,
        kv: &mut DeviceKv<B>,
        sealed: bool,
        block: u32,
        bytes: &[u8],
    ) -> Result<(), KernelError> {
        let (at, size) = block_range(kv, sealed, block)?;
        if bytes.len() != size {
            return Err(KernelError::Shape(format!(
                "{} bytes for a block of {size}",
                bytes.len()
            )));
        }
        let buf = if sealed { &mut kv.sealed } else { &mut kv.tail };
        self.backend().write_at(buf, at, bytes)
    }
}

/// Offset and size of a block in its pool.
fn block_range<B: Backend>(
    kv: &DeviceKv<B>,
    sealed: bool,
    block: u32,
) -> Result<(usize, usize), KernelError> {
    let l: KvLayout = kv.layout;
    let (n_sealed, n_tail) = kv.pools.capacity();
    let (count, size) = if sealed {
        (n_sealed, l.block_bytes())
    } else {
        (n_tail, l.tail_block_bytes())
    };
    if block as usize >= count {
        return Err(KernelError::Shape(format!(
            "block {block} outside a pool of {count}"
        )));
    }
    Ok((block as usize * size, size))
}
