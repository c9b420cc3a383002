//! Grafted serving on the device: one layer's step of a batch — its K/V
//! rows written into tail blocks, row copies, seals, then attention for every
//! batch token — run by the kernels straight on the tensors llama.cpp
//! computed on the same device (Q, and K/V in its f16 cache), with the output
//! written into llama.cpp's attention output. Nothing goes through the host
//! but the step's small tables, uploaded once per decode ([`DeviceStep`]) and
//! used by every layer.
//!
//! Token `j` of a query run of `n` tokens over a sequence of `len` tokens
//! sees the first `len - n + 1 + j` tokens (causal). A run of at least
//! [`StepTuning::prefill_min_tokens`] tokens (a prefill chunk) goes to the
//! prefill kernel: tiles of the run's (token, query head) rows, each reading
//! the context's K and V once for all its rows. Shorter runs (decode steps,
//! short speculative runs) go to the decode kernel, each token as a sequence
//! of its own over the first blocks of the run's block table. Both write
//! their tokens' rows of the same output, in one launch each per layer.
//!
//! The layout and codecs are the CPU store's ([`crate::KvPages`]): a block
//! written and sealed here holds the bytes the CPU store would hold for the
//! same K/V (the write kernel rotates and rounds as the CPU does).

use std::ops::Range;

use crate::KernelError;
use crate::device::{
    Arg, Backend, BlockTables, DecodeRun, DeviceKv, Kernels, Launch, auto_partition_tokens,
    le_bytes, upload_i32,
};
use crate::store::{KvLayout, SeqKv};

/// Runs of this many tokens or more go to the prefill kernel by default.
pub const PREFILL_MIN_TOKENS: usize = 8;

/// How a grafted step splits its query runs between the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepTuning {
    /// Runs of at least this many tokens go to the prefill kernel; shorter
    /// ones to the decode kernel, a token at a time. `usize::MAX`: the
    /// decode kernel only.
    pub prefill_min_tokens: usize,
    /// The prefill kernel's partition of the context, in tokens (0: enough
    /// partitions to give the GPU [`crate::device::TARGET_CTAS`] CTAs).
    pub prefill_partition_tokens: usize,
}

impl Default for StepTuning {
    fn default() -> Self {
        StepTuning {
            prefill_min_tokens: PREFILL_MIN_TOKENS,
            prefill_partition_tokens: 0,
        }
    }
}

impl StepTuning {
    /// The default, with `SILICEO_DEVICE_PREFILL_MIN_TOKENS` where it is set
    /// ([`StepTuning::with_prefill_min_tokens`]).
    pub fn from_env() -> Result<StepTuning, KernelError> {
        match std::env::var("SILICEO_DEVICE_PREFILL_MIN_TOKENS") {
            Ok(v) => StepTuning::default().with_prefill_min_tokens(&v),
            Err(_) => Ok(StepTuning::default()),
        }
    }

    /// `self` with [`StepTuning::prefill_min_tokens`] from `v`: a count of
    /// tokens (≥ 1), or `off` for the decode kernel only.
    pub fn with_prefill_min_tokens(mut self, v: &str) -> Result<StepTuning, KernelError> {
        self.prefill_min_tokens = match v.trim() {
            "off" => usize::MAX,
            n => n.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
                KernelError::Shape(format!(
                    "SILICEO_DEVICE_PREFILL_MIN_TOKENS={v}: a count of tokens (≥ 1) or `off`"
                ))
            })?,
        };
        Ok(self)
    }
}

/// Query rows per prefill CTA and keys per tile, for heads of `d` (the
/// kernel's `PrefillTile<D>`).
fn prefill_tile(d: usize) -> (usize, usize) {
    (if d <= 128 { 32 } else { 16 }, 4096 / d)
}

/// The prefill kernel's dynamic shared memory for heads of `d`:
/// `qs[R][D + 4] | kvs[KT][D + 4] | ps[R][KT]`, f32.
fn prefill_shared_bytes(d: usize) -> usize {
    let (rows, keys) = prefill_tile(d);
    (rows + keys) * (d + 4) * 4 + rows * keys * 4
}

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

/// The device address of a layer's attention sinks (0 = none), checked to
/// hold one f32 per query head.
fn sinks_addr(sinks: Option<DeviceSpan>, heads: usize) -> Result<u64, KernelError> {
    match sinks {
        None => Ok(0),
        Some(s) if s.addr != 0 && s.bytes >= heads * 4 => Ok(s.addr),
        Some(s) => Err(KernelError::Shape(format!(
            "attention sinks of {} bytes for {heads} heads",
            s.bytes
        ))),
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
    /// The batch's queries (`tokens × heads × head_dim` f32, pre-scaled and
    /// rotated), gathered from llama.cpp's Q in each layer.
    q: B::Buf,
    /// The tokens of short runs, a sequence each.
    decode: Option<DecodeRun<B>>,
    /// The runs of the prefill kernel.
    prefill: Option<PrefillRun<B>>,
}

impl<B: Backend> DeviceStep<B> {
    /// Batch tokens of the step.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Batch tokens the decode and the prefill kernel serve.
    pub fn split(&self) -> (usize, usize) {
        let pre = self.prefill.as_ref().map_or(0, |p| p.tokens);
        (self.tokens - pre, pre)
    }
}

/// The prefill kernel's launch over a step's long runs: its tiles of query
/// rows, the runs' block tables, and the partial rows when the context is
/// split into several partitions.
#[derive(Debug)]
struct PrefillRun<B: Backend> {
    kernel: String,
    tables: BlockTables<B>,
    /// Five i32 per tile: run, first row, rows, first batch token, len0.
    tiles: B::Buf,
    n_tiles: usize,
    /// Batch tokens served (the reduction's rows).
    tokens: usize,
    token_map: B::Buf,
    /// Partial max, sum and acc rows (`batch tokens × heads × P` (× D)).
    partials: Option<[B::Buf; 3]>,
    heads: i32,
    kv_heads: i32,
    block_tokens: i32,
    k_group: i32,
    v_group: i32,
    partition_tokens: i32,
    partitions: i32,
    d: usize,
}

impl<B: Backend> PrefillRun<B> {
    /// The runs `(run, first batch token)` of a step of `batch` tokens.
    fn new(
        k: &Kernels<B>,
        kv: &DeviceKv<B>,
        n_heads: usize,
        runs: &[(QueryRun<'_>, usize)],
        batch: usize,
        tuning: &StepTuning,
    ) -> Result<PrefillRun<B>, KernelError> {
        let l = kv.layout;
        let d = l.head_dim;
        let (name, kg, vg) = k.check_attention(&l, n_heads)?;
        let g = n_heads / l.kv_heads;
        let seqs: Vec<&SeqKv> = runs.iter().map(|(r, _)| r.kv).collect();
        let tables = BlockTables::new(k, kv, &seqs)?;
        let (rows_per_tile, _) = prefill_tile(d);
        let mut tiles = Vec::new();
        let mut token_map = Vec::new();
        for (i, (r, at)) in runs.iter().enumerate() {
            let rows = r.tokens * g;
            for row0 in (0..rows).step_by(rows_per_tile) {
                tiles.extend([
                    i as i32,
                    row0 as i32,
                    rows_per_tile.min(rows - row0) as i32,
                    *at as i32,
                    (r.kv.len - r.tokens + 1) as i32,
                ]);
            }
            token_map.extend((*at..at + r.tokens).map(|t| t as i32));
        }
        let n_tiles = tiles.len() / 5;
        let max_len = seqs.iter().map(|s| s.len).max().unwrap_or(0);
        let part = match tuning.prefill_partition_tokens {
            0 => auto_partition_tokens(max_len, l.kv_heads, n_tiles, usize::MAX),
            p => p,
        }
        .min(max_len)
        .max(1);
        let p = max_len.div_ceil(part);
        let b = k.backend();
        let rows = batch * n_heads;
        let partials = if p > 1 {
            Some([
                b.zeros(rows * p * 4)?,
                b.zeros(rows * p * 4)?,
                b.zeros(rows * p * d * 4)?,
            ])
        } else {
            None
        };
        Ok(PrefillRun {
            kernel: format!("siliceo_attn_prefill_{name}_d{d}"),
            tables,
            tiles: upload_i32(b, &tiles)?,
            n_tiles,
            tokens: token_map.len(),
            token_map: upload_i32(b, &token_map)?,
            partials,
            heads: n_heads as i32,
            kv_heads: l.kv_heads as i32,
            block_tokens: l.block_tokens as i32,
            k_group: kg,
            v_group: vg,
            partition_tokens: part as i32,
            partitions: p as i32,
            d,
        })
    }

    /// Queues the prefill kernel (and the reduction of its partitions),
    /// reading the queries from `q` and writing the runs' rows of `out`.
    ///
    /// # Safety
    /// `q` and `out` hold `batch × heads × head_dim` f32 (the batch the run
    /// was made for); `kv` is the store its tables were checked against.
    unsafe fn enqueue(
        &self,
        k: &Kernels<B>,
        kv: &DeviceKv<B>,
        q: &B::Buf,
        out: Arg<'_, B::Buf>,
        window: usize,
        sinks: u64,
    ) -> Result<(), KernelError> {
        let window = crate::device::window_arg(window)?;
        let d = self.d;
        let launch = Launch {
            grid: (
                self.kv_heads as u32,
                self.n_tiles as u32,
                self.partitions as u32,
            ),
            block: 128,
            shared_bytes: prefill_shared_bytes(d) as u32,
        };
        let (pm, pl, pa) = match &self.partials {
            Some([m, l, a]) => (Arg::Buf(m), Arg::Buf(l), Arg::Buf(a)),
            None => (Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0)),
        };
        let [sealed, tail, st, tt, lens, ns, ms, mt] = self.tables.args(kv);
        let args = [
            out,
            pm,
            pl,
            pa,
            Arg::Buf(q),
            sealed,
            tail,
            st,
            tt,
            lens,
            ns,
            ms,
            mt,
            Arg::Buf(&self.tiles),
            Arg::I32(self.heads),
            Arg::I32(self.kv_heads),
            Arg::I32(self.block_tokens),
            Arg::I32(self.k_group),
            Arg::I32(self.v_group),
            Arg::I32(self.partition_tokens),
            Arg::I32(self.partitions),
            Arg::I32(window),
            Arg::Ptr(sinks),
        ];
        // SAFETY: the arguments match `siliceo_attn_prefill_*`; the tables
        // were checked against the store's pools, every tile's rows lie in
        // its run and every run's tokens in the batch (`graft_step_with`).
        unsafe { k.backend().launch(&self.kernel, launch, &args) }?;
        if let Some([m, l, a]) = &self.partials {
            // SAFETY: the kernel wrote every partition's partial row of the
            // runs' tokens, which the map names.
            unsafe {
                k.reduce(
                    out,
                    [m, l, a],
                    (self.heads, d, self.partitions),
                    self.tokens,
                    Arg::Buf(&self.token_map),
                    sinks,
                )
            }?;
        }
        Ok(())
    }
}

impl<B: Backend> Kernels<B> {
    /// Uploads a step's tables: `writes[i]` is batch token `i`'s (tail block,
    /// row); `copies` (src, dst, rows) and `seals` (tail, sealed) follow the
    /// writes in every layer, in order; `runs` cover the batch in order.
    /// `kv` is any layer's store (they share layout and size). Runs are
    /// split between the kernels as [`StepTuning::default`] says.
    pub fn graft_step(
        &self,
        kv: &DeviceKv<B>,
        n_heads: usize,
        writes: &[(u32, u16)],
        copies: Vec<(u32, u32, Range<usize>)>,
        seals: Vec<(u32, u32)>,
        runs: &[QueryRun<'_>],
    ) -> Result<DeviceStep<B>, KernelError> {
        let tuning = StepTuning::default();
        self.graft_step_with(kv, n_heads, writes, copies, seals, runs, &tuning)
    }

    /// [`Kernels::graft_step`] with the runs split as `tuning` says.
    #[allow(clippy::too_many_arguments)]
    pub fn graft_step_with(
        &self,
        kv: &DeviceKv<B>,
        n_heads: usize,
        writes: &[(u32, u16)],
        copies: Vec<(u32, u32, Range<usize>)>,
        seals: Vec<(u32, u32)>,
        runs: &[QueryRun<'_>],
        tuning: &StepTuning,
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
        // Long runs to the prefill kernel; each token of the others as a
        // sequence of its own over the run's first blocks.
        let mut seqs = Vec::with_capacity(n);
        let mut seq_tokens = Vec::with_capacity(n);
        let mut long = Vec::new();
        let mut at = 0;
        for r in runs {
            if r.kv.len < r.tokens {
                return Err(KernelError::Shape(format!(
                    "a run of {} tokens over a sequence of {}",
                    r.tokens, r.kv.len
                )));
            }
            if r.tokens >= tuning.prefill_min_tokens {
                long.push((*r, at));
            } else {
                for j in 0..r.tokens {
                    let len = r.kv.len - r.tokens + 1 + j;
                    let seq = r.kv.prefix(len, l.block_tokens).ok_or_else(|| {
                        KernelError::Shape(format!(
                            "a block table of {} blocks for {len} tokens",
                            r.kv.blocks()
                        ))
                    })?;
                    seqs.push(seq);
                    seq_tokens.push((at + j) as i32);
                }
            }
            at += r.tokens;
        }
        let decode = if seqs.is_empty() {
            None
        } else {
            let refs: Vec<&SeqKv> = seqs.iter().collect();
            // Every token a sequence in batch order: no map.
            let map = (seqs.len() < n).then_some((&seq_tokens[..], n));
            Some(self.decode_run(kv, &refs, n_heads, 0, None, map)?)
        };
        let prefill = if long.is_empty() {
            None
        } else {
            Some(PrefillRun::new(self, kv, n_heads, &long, n, tuning)?)
        };
        let (blocks, rows): (Vec<u32>, Vec<i32>) =
            writes.iter().map(|&(b, r)| (b, i32::from(r))).unzip();
        let b = self.backend();
        Ok(DeviceStep {
            tokens: n,
            heads: n_heads,
            write_blocks: b.upload(&le_bytes(&blocks, |x| x.to_le_bytes()))?,
            write_rows: upload_i32(b, &rows)?,
            copies,
            seals,
            q: b.zeros(n * n_heads * l.head_dim * 4)?,
            decode,
            prefill,
        })
    }

    /// One layer of a grafted step, in this order: the batch's K and V (`k`,
    /// `v`: `[head_dim, ≥ tokens, kv_heads]`) into their tail rows, the step's
    /// copies and seals, then attention of every batch token (`q`:
    /// `[head_dim, ≥ tokens, heads]`, × `scale`; each query seeing its last
    /// `window` positions, 0 = all; with `sinks`, one f32 logit per query
    /// head in device memory, joining each softmax's denominator) into
    /// `out`, contiguous
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
        window: usize,
        sinks: Option<DeviceSpan>,
        out: DeviceSpan,
    ) -> Result<(), KernelError> {
        let l = kv.layout;
        let (d, kvh, n, h) = (l.head_dim, l.kv_heads, step.tokens, step.heads);
        sinks_addr(sinks, h)?;
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
            Arg::Buf(&step.q),
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
        self.attend(kv, step, out, window, sinks)?;
        b.synchronize()
    }

    /// Queues the step's attention over the queries its last layer gathered
    /// (decode and prefill kernels) into `out`, without waiting: what
    /// [`Kernels::graft_layer`] runs after the writes (and what a benchmark
    /// times).
    pub fn attend(
        &self,
        kv: &DeviceKv<B>,
        step: &DeviceStep<B>,
        out: DeviceSpan,
        window: usize,
        sinks: Option<DeviceSpan>,
    ) -> Result<(), KernelError> {
        let (n, h, d) = (step.tokens, step.heads, kv.layout.head_dim);
        let sinks = sinks_addr(sinks, h)?;
        if out.addr == 0 || out.bytes < n * h * d * 4 || B::buf_len(&step.q) != n * h * d * 4 {
            return Err(KernelError::Shape(format!(
                "an attention output of {} bytes for {n} tokens",
                out.bytes
            )));
        }
        if let Some(dec) = &step.decode {
            // SAFETY: `out` and the step's queries hold n × h × d f32
            // (checked above), the batch the run was made for.
            unsafe {
                dec.enqueue_into(
                    self,
                    kv,
                    Arg::Ptr(out.addr),
                    Arg::Buf(&step.q),
                    window,
                    sinks,
                )
            }?;
        }
        if let Some(pre) = &step.prefill {
            // SAFETY: as above.
            unsafe { pre.enqueue(self, kv, &step.q, Arg::Ptr(out.addr), window, sinks) }?;
        }
        Ok(())
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

/// One row of [`bench_prefill`].
#[derive(Debug, Clone)]
pub struct PrefillBench {
    /// Layout preset.
    pub format: String,
    /// Tokens before the chunk.
    pub ctx: usize,
    /// Tokens in the chunk (one query run).
    pub chunk: usize,
    /// Median seconds of the chunk's attention on the decode kernel, a
    /// token at a time.
    pub decode_seconds: f64,
    /// The same on the prefill kernel.
    pub prefill_seconds: f64,
    /// The prefill kernel's partition (tokens) and partitions.
    pub partition: (usize, usize),
    /// Largest difference between the two kernels' outputs.
    pub max_diff: f32,
}

/// Times one layer's attention for a prefill chunk of `chunk` tokens after
/// `ctx` tokens, for every format and context of `shape` (one sequence; its
/// geometry and reps), on the decode kernel a token at a time and on the
/// prefill kernel; `row` gets each result as it is measured. The queries are
/// the same random rows for both (what the timing does not depend on).
pub fn bench_prefill<B: Backend>(
    k: &Kernels<B>,
    shape: &crate::device::BenchShape<'_>,
    chunk: usize,
    mut row: impl FnMut(&PrefillBench),
) -> Result<(), KernelError> {
    use std::time::Instant;
    let (heads, d) = (shape.heads, shape.head_dim);
    for fmt in shape.formats {
        let mut layout = KvLayout::preset(fmt, shape.kv_heads, d)?;
        layout.block_tokens = shape.block_tokens;
        for &ctx in shape.ctxs {
            let total = ctx + chunk;
            let mut store = crate::KvStore::new(
                layout,
                total.div_ceil(layout.block_tokens),
                crate::KvStore::tail_blocks_per_seq(&layout),
            )?;
            let width = shape.kv_heads * d;
            let mut seq = SeqKv::default();
            let mut at = 0;
            while at < total {
                let n = (total - at).min(4096);
                let kv: Vec<f32> = (0..n * width)
                    .map(|i| (((i + at * width) * 2_654_435_761) % 2001) as f32 / 1000.0 - 1.0)
                    .collect();
                store.append(&mut seq, &kv, &kv)?;
                at += n;
            }
            let dev = k.upload(&store)?;
            let run = [QueryRun {
                tokens: chunk,
                kv: &seq,
            }];
            // The step's writes are not run (only its attention is timed).
            let writes = vec![(0u32, 0u16); chunk];
            let q: Vec<f32> = (0..chunk * heads * d)
                .map(|i| ((i * 40_503) % 997) as f32 / 500.0 - 1.0)
                .collect();
            let b = k.backend();
            let out = b.zeros(chunk * heads * d * 4)?;
            let span = DeviceSpan {
                addr: b.addr(&out),
                bytes: B::buf_len(&out),
            };
            let mut results = Vec::new();
            for min_tokens in [usize::MAX, 1] {
                let tuning = StepTuning {
                    prefill_min_tokens: min_tokens,
                    prefill_partition_tokens: 0,
                };
                let mut step =
                    k.graft_step_with(&dev, heads, &writes, Vec::new(), Vec::new(), &run, &tuning)?;
                step.q = b.upload(&le_bytes(&q, |x| x.to_le_bytes()))?;
                k.attend(&dev, &step, span, 0, None)?;
                b.synchronize()?;
                let got = crate::device::bytes_f32(&b.download(&out)?);
                let mut times = Vec::new();
                for _ in 0..shape.reps.max(1) {
                    let t0 = Instant::now();
                    k.attend(&dev, &step, span, 0, None)?;
                    b.synchronize()?;
                    times.push(t0.elapsed().as_secs_f64());
                }
                times.sort_by(f64::total_cmp);
                let part = step.prefill.as_ref().map_or((0, 0), |p| {
                    (p.partition_tokens as usize, p.partitions as usize)
                });
                results.push((times[times.len() / 2], got, part));
            }
            row(&PrefillBench {
                format: fmt.clone(),
                ctx,
                chunk,
                decode_seconds: results[0].0,
                prefill_seconds: results[1].0,
                partition: results[1].2,
                max_diff: crate::device::max_abs_diff(&results[1].1, &results[0].1),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_threshold_is_a_count_or_off() {
        let t = StepTuning::default();
        assert_eq!(t.prefill_min_tokens, PREFILL_MIN_TOKENS);
        assert_eq!(
            t.with_prefill_min_tokens(" 16 ")
                .unwrap()
                .prefill_min_tokens,
            16
        );
        assert_eq!(
            t.with_prefill_min_tokens("off").unwrap().prefill_min_tokens,
            usize::MAX
        );
        for bad in ["0", "-1", "eight", ""] {
            let e = t.with_prefill_min_tokens(bad).unwrap_err();
            assert!(
                e.to_string().contains("SILICEO_DEVICE_PREFILL_MIN_TOKENS"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn prefill_tiles_fit_sm75_shared_memory() {
        // The kernel's PrefillTile<D>: rows × keys split over 16 row groups
        // and 8 key lanes, rows over the V mapping's row groups, and the
        // shared memory launch() asks for within sm_75's default 48 KiB,
        // but for heads of 512 (50,048 B: launch() raises the kernel's
        // limit, up to sm_75's 64 KiB).
        for d in [64, 128, 256, 512] {
            let (rows, keys) = prefill_tile(d);
            assert_eq!(rows % 16, 0, "{d}");
            assert_eq!(keys % 8, 0, "{d}");
            assert_eq!(rows % (128 / (d / 8)), 0, "{d}");
            let bytes = prefill_shared_bytes(d);
            let limit = if d <= 256 {
                48 * 1024
            } else {
                crate::device::SHARED_BYTES_LIMIT
            };
            assert!(bytes <= limit, "{d}: {bytes}");
        }
    }
}
