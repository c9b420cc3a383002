//! The CPU paged-attention kernel: decode (one query token per sequence) and
//! prefill chunks (several query tokens, causal) over a store ([`KvPages`]) in any
//! layout, grouped-query heads, online (streaming) softmax, multi-threaded,
//! with an optional split of long contexts into partitions that are reduced
//! at the end (the same plan as the CUDA kernels).
//!
//! Per (sequence, KV head, partition) the kernel walks each block's K and V
//! segment in sub-tiles and serves every query token and every query head of
//! the group from each load: the bytes of KV read from memory are the
//! format's bytes, once per call (once per share where a prefill chunk's query
//! tokens are split over threads, see [`paged_attention`]). F16, KV8, K5 keys and V4 values are read in
//! place (converted in the inner loops, see the `simd` module); other codecs
//! are decoded into an f32 tile that stays in L1.
//!
//! Accuracy: against attention over the stored (decoded) values the kernel
//! differs by float rounding, except where it computes with 16-bit integers
//! (x86): K5 keys of heads of 128 or 256 and KV8 keys in groups of 32, whose
//! scores are exact integer sums over the query rounded to 16 bits per row —
//! a K5 score is off by at most `max_c |q_c·scale_c| / 65534 · Σ_c code_c` —
//! and V4 values read in place,
//! whose weights × token scales are rounded to 16 bits per row and group (see
//! the `simd` module for the bounds). The tests hold the outputs to 2·10⁻³
//! relative; the formats' own rounding moves them a hundred times more.

use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::KernelError;
use crate::codec::Codec;
use crate::hadamard::hadamard;
use crate::simd::{self, Rows};
use crate::store::{KvLayout, KvPages, SeqKv};

/// Tuning knobs of the CPU kernel.
#[derive(Debug, Clone, Copy)]
pub struct AttnParams {
    /// Threads, the caller's included (1 = run on the caller's thread only).
    /// The others come from a pool started on first use and kept between
    /// calls; a call with little work takes fewer (one per 2²¹ query–key
    /// products × channels).
    pub threads: usize,
    /// Blocks per partition of a long context (0 = no split).
    pub partition_blocks: usize,
    /// Tokens served at a time (a sub-tile of a block; 0 = the whole block).
    /// Default 64: measured best for every format (all read in place; 32 and
    /// 16 are slower).
    pub sub_tile: usize,
    /// While one KV head of a block is served, the K and V segments this many
    /// heads further on (crossing into the next block) are prefetched into
    /// L2, a few cache lines per token inside the loops (0 = leave it to the
    /// hardware). Default 2; measured at 32k: F16 decode with one thread
    /// 14.2 → 10.9 ms, two threads 42 → 67 % of the read bandwidth
    /// (docs/BENCHMARKS.md, session 15).
    pub prefetch_ahead: usize,
    /// Who runs the work on `threads` threads: `None` = the kernel's own
    /// worker pool. A caller inside a program with a thread team of its own
    /// (llama.cpp's OpenMP threads, idle between the graph splits our
    /// attention runs in) passes a runner that uses that team, so the kernel
    /// and the program share the cores instead of fighting over them.
    pub runner: Option<Runner>,
    /// Query–key products × channels below which a call takes one thread
    /// more (see [`MIN_WORK_PER_THREAD`], the default for the kernel's own
    /// pool; a runner whose threads are already awake can take less).
    pub min_work_per_thread: usize,
}

/// Runs `job(0)`, `job(1)`, … `job(threads − 1)`, each at most once and
/// `job(0)` on the calling thread, and returns when all have returned. The
/// job shares its work out itself, so an index that never runs loses
/// nothing. A job that panics on any thread must panic the caller.
pub type Runner = fn(threads: usize, job: &(dyn Fn(usize) + Sync));

impl Default for AttnParams {
    fn default() -> Self {
        AttnParams {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            partition_blocks: 32,
            sub_tile: 64,
            prefetch_ahead: 2,
            runner: None,
            min_work_per_thread: MIN_WORK_PER_THREAD,
        }
    }
}

/// Query–key products × channels below which a call takes one thread more
/// (2²¹: decode over 512 tokens with 32 heads of 128). Measured with two
/// threads: F16 decode at 256 tokens ran 0.064 ms on one thread and 0.071
/// on two; at 1k two were 1.5× faster (docs/BENCHMARKS.md, session 16).
pub const MIN_WORK_PER_THREAD: usize = 1 << 21;

/// One sequence's queries: the last `n_q` tokens of `kv` (already appended).
#[derive(Debug, Clone, Copy)]
pub struct SeqQuery<'a> {
    /// The sequence's KV blocks.
    pub kv: &'a SeqKv,
    /// Queries, `n_q × n_heads × head_dim` (token-major, then head).
    pub q: &'a [f32],
    /// Query tokens (1 for decode); query `i` sits at position `kv.len - n_q + i`
    /// and attends to positions `0..=kv.len - n_q + i`.
    pub n_q: usize,
}

/// What one layer's attention computes beyond plain causal softmax
/// attention: the scale of Q·K, a sliding window and attention sinks.
#[derive(Debug, Clone, Copy)]
pub struct LayerAttn<'a> {
    /// Multiplies Q·K (usually `1/sqrt(head_dim)`).
    pub scale: f32,
    /// Sliding window: a query at position `p` sees positions
    /// `p + 1 − window ..= p` (llama.cpp's standard SWA: a key is masked
    /// where `p − j ≥ window`); 0 = the whole context.
    pub window: usize,
    /// Attention sinks: one logit per query head that joins each row's
    /// softmax denominator and weighs no value (gpt-oss).
    pub sinks: Option<&'a [f32]>,
}

impl LayerAttn<'_> {
    /// Causal attention over the whole context, scaled by `scale`.
    pub fn causal(scale: f32) -> LayerAttn<'static> {
        LayerAttn {
            scale,
            window: 0,
            sinks: None,
        }
    }

    /// The first position a query at `pos` sees.
    #[inline]
    pub fn first_seen(&self, pos: usize) -> usize {
        if self.window == 0 {
            0
        } else {
            (pos + 1).saturating_sub(self.window)
        }
    }
}

/// Running softmax state of one work item for its query rows (its query
/// tokens × the query heads of its KV heads).
#[derive(Debug, Clone)]
struct Partial {
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
}

/// A run of blocks `b0..b1` of one sequence, a range of its KV heads (all of
/// them on one thread: a block's heads are contiguous in memory, so a worker
/// reads one long stream) and a range of its query tokens (all of them but
/// where a prefill chunk is split over threads).
#[derive(Debug, Clone)]
struct Item {
    seq: usize,
    heads: std::ops::Range<usize>,
    queries: std::ops::Range<usize>,
    b0: usize,
    b1: usize,
}

/// Computes attention for every query of `seqs` into `out` (the queries'
/// shape, concatenated in order). Work items are (sequence, partition of
/// blocks, range of KV heads, range of query tokens); heads and then query
/// tokens are split only while there are fewer than four items per thread,
/// and the results do not depend on the split. `scale` multiplies Q·K (usually
/// `1/sqrt(head_dim)`).
pub fn paged_attention(
    store: &KvPages,
    n_heads: usize,
    scale: f32,
    seqs: &[SeqQuery<'_>],
    out: &mut [f32],
    params: &AttnParams,
) -> Result<(), KernelError> {
    paged_attention_layer(store, n_heads, &LayerAttn::causal(scale), seqs, out, params)
}

/// [`paged_attention`] for a layer with a sliding window or attention sinks
/// ([`LayerAttn`]). Blocks wholly before every query's window are not read;
/// a query's result does not depend on the other queries of the call (the
/// same bits alone, batched or in a prefill chunk).
pub fn paged_attention_layer(
    store: &KvPages,
    n_heads: usize,
    attn: &LayerAttn<'_>,
    seqs: &[SeqQuery<'_>],
    out: &mut [f32],
    params: &AttnParams,
) -> Result<(), KernelError> {
    let l = store.layout();
    let d = l.head_dim;
    if n_heads == 0 || !n_heads.is_multiple_of(l.kv_heads) {
        return Err(KernelError::Shape(format!(
            "{n_heads} query heads are not a multiple of {} KV heads",
            l.kv_heads
        )));
    }
    if let Some(sinks) = attn.sinks
        && sinks.len() != n_heads
    {
        return Err(KernelError::Shape(format!(
            "{} attention sinks for {n_heads} query heads",
            sinks.len()
        )));
    }
    let mut total = 0;
    for (i, s) in seqs.iter().enumerate() {
        if s.n_q == 0 || s.n_q > s.kv.len {
            return Err(KernelError::Shape(format!(
                "sequence {i}: {} queries over {} stored tokens",
                s.n_q, s.kv.len
            )));
        }
        if s.kv.blocks() != s.kv.len.div_ceil(l.block_tokens) {
            return Err(KernelError::Shape(format!(
                "sequence {i}: block table does not match its length"
            )));
        }
        if s.q.len() != s.n_q * n_heads * d {
            return Err(KernelError::Shape(format!(
                "sequence {i}: q has {} values, expected {} × {n_heads} × {d}",
                s.q.len(),
                s.n_q
            )));
        }
        total += s.q.len();
    }
    if out.len() != total {
        return Err(KernelError::Shape(format!(
            "out has {} values, expected {total}",
            out.len()
        )));
    }

    let part = if params.partition_blocks == 0 {
        usize::MAX
    } else {
        params.partition_blocks
    };
    // No more threads than there is work for: waking a worker and sharing
    // out items costs about what a few hundred tokens of decode do.
    let work: usize = seqs
        .iter()
        .map(|s| s.n_q * (s.kv.len - attn.first_seen(s.kv.len - s.n_q)) * n_heads * d)
        .sum();
    let threads = params
        .threads
        .clamp(1, work.div_ceil(params.min_work_per_thread.max(1)).max(1));
    let spans: usize = seqs
        .iter()
        .map(|s| s.kv.blocks().div_ceil(part))
        .sum::<usize>()
        .max(1);
    // KV heads per item: all of them on one thread (a block's heads are one
    // stream); with several threads, split so that there are about four
    // items per thread (a short context is one span, and its prefill chunk
    // would otherwise run on one thread). Where that is not enough (few KV
    // heads), a prefill chunk's query tokens are split too.
    let want = 4 * threads;
    let splits = if threads == 1 {
        1
    } else {
        want.div_ceil(spans).clamp(1, l.kv_heads)
    };
    let q_splits = if threads == 1 {
        1
    } else {
        want.div_ceil(spans * splits)
    };
    let mut items = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        let qs = q_splits.min(s.n_q);
        for sp in 0..splits {
            let heads = sp * l.kv_heads / splits..(sp + 1) * l.kv_heads / splits;
            for qp in 0..qs {
                let queries = qp * s.n_q / qs..(qp + 1) * s.n_q / qs;
                let nb = s.kv.blocks();
                // Partitions stay where they are without a window (their
                // bounds fix the order of the reduction); those wholly
                // before the first query's window are left out.
                let seen = attn.first_seen(s.kv.len - s.n_q + queries.start) / l.block_tokens;
                let mut b0 = 0;
                while b0 < nb {
                    let b1 = nb.min(b0.saturating_add(part));
                    if b1 > seen {
                        items.push(Item {
                            seq: si,
                            heads: heads.clone(),
                            queries: queries.clone(),
                            b0,
                            b1,
                        });
                    }
                    b0 = b1;
                }
            }
        }
    }
    let threads = threads.min(items.len());
    let sub = if params.sub_tile == 0 {
        l.block_tokens
    } else {
        params.sub_tile.min(l.block_tokens)
    };
    let knobs = Knobs {
        sub,
        prefetch_ahead: params.prefetch_ahead,
    };
    let max_q = seqs.iter().map(|s| s.n_q).max().unwrap_or(0);
    let slots: Vec<OnceLock<Partial>> = items.iter().map(|_| OnceLock::new()).collect();
    let next = AtomicUsize::new(0);
    let run = params.runner.unwrap_or(crate::pool::run);
    run(threads, &|_| {
        SCRATCH.with(|cell| {
            let mut scratch = cell.take();
            scratch.fit(l, n_heads, max_q, sub);
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                let p = run_item(store, seqs, n_heads, attn, item, knobs, &mut scratch);
                let _ = slots[i].set(p);
            }
            cell.set(scratch);
        })
    });
    let mut partials: Vec<Option<Partial>> = slots.into_iter().map(OnceLock::into_inner).collect();

    // Reduce partitions in order and normalise.
    let mut offsets = Vec::with_capacity(seqs.len());
    let mut off = 0;
    for s in seqs {
        offsets.push(off);
        off += s.q.len();
    }
    let group = n_heads / l.kv_heads;
    let mut i = 0;
    while i < items.len() {
        let Item {
            seq: si,
            ref heads,
            ref queries,
            ..
        } = items[i];
        let mut acc = partials[i].take().expect("every item ran");
        i += 1;
        while i < items.len()
            && items[i].seq == si
            && items[i].heads == *heads
            && items[i].queries == *queries
        {
            merge(&mut acc, partials[i].take().expect("every item ran"), d);
            i += 1;
        }
        // The item's rows are (its heads, its query tokens, the group's query
        // heads); `out` has every token and head.
        let per_head = queries.len() * group;
        let dst = &mut out[offsets[si]..offsets[si] + seqs[si].q.len()];
        for (r, a) in acc.acc.chunks_exact(d).enumerate() {
            let (kh, rem) = (heads.start + r / per_head, r % per_head);
            let (qi, h) = (queries.start + rem / group, kh * group + rem % group);
            let o = &mut dst[(qi * n_heads + h) * d..(qi * n_heads + h + 1) * d];
            let inv = match attn.sinks {
                None => 1.0 / acc.l[r],
                // The sink joins the denominator: Σ e^(s − m) + e^(sink − m),
                // both scaled by e^(m − m′) with m′ the larger of the two.
                Some(sinks) => {
                    let (m, sink) = (acc.m[r], sinks[h]);
                    let top = m.max(sink);
                    let c = fast_exp(m - top);
                    c / (acc.l[r] * c + fast_exp(sink - top))
                }
            };
            for (o, a) in o.iter_mut().zip(a) {
                *o = a * inv;
            }
        }
    }
    Ok(())
}

thread_local! {
    /// Each thread's working memory, kept between calls.
    static SCRATCH: Cell<Scratch> = Cell::new(Scratch::default());
}

/// The tuning knobs a work item runs with.
#[derive(Debug, Clone, Copy)]
struct Knobs {
    sub: usize,
    prefetch_ahead: usize,
}

/// Query tokens that see a whole sub-tile served by one kernel call (their
/// rows × the sub-tile's scores stay in L1).
const TOKENS_PER_CALL: usize = 8;

/// Per-thread working memory (kept between calls, grown as needed).
#[derive(Default)]
struct Scratch {
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
    s: Vec<f32>,
    corr: Vec<f32>,
    k_scales: Vec<f32>,
    v_scales: Vec<f32>,
}

impl Scratch {
    /// Room for `max_q` query tokens of `n_heads` heads and sub-tiles of
    /// `sub` tokens.
    fn fit(&mut self, l: &KvLayout, n_heads: usize, max_q: usize, sub: usize) {
        let (d, group) = (l.head_dim, n_heads / l.kv_heads);
        let grow = |v: &mut Vec<f32>, n: usize| {
            if v.len() < n {
                v.resize(n, 0.0);
            }
        };
        grow(&mut self.k, sub * d);
        grow(&mut self.v, sub * d);
        grow(&mut self.q, max_q * n_heads * d);
        grow(&mut self.s, sub * group * TOKENS_PER_CALL);
        grow(&mut self.corr, group * TOKENS_PER_CALL);
        // KV8 scales (sub·d/g), K5 scale and minimum (2·d), V4's
        // (4·sub·d/g with its working half).
        grow(&mut self.k_scales, 2 * (sub + 1) * d);
        grow(&mut self.v_scales, 2 * (sub + 1) * d);
    }
}

fn run_item(
    store: &KvPages,
    seqs: &[SeqQuery<'_>],
    n_heads: usize,
    attn: &LayerAttn<'_>,
    item: &Item,
    knobs: Knobs,
    sc: &mut Scratch,
) -> Partial {
    let Knobs {
        sub,
        prefetch_ahead,
    } = knobs;
    let l = store.layout();
    let (t, d) = (l.block_tokens, l.head_dim);
    let group = n_heads / l.kv_heads;
    let sq = &seqs[item.seq];
    let (n_q, len) = (sq.n_q, sq.kv.len);
    // The item's query tokens and heads; row r = (kh − kh0) · nq · group +
    // (qi − q0) · group + g here (query head h = kh · group + g), in the
    // scaled queries and in the partial: a KV head's rows of consecutive
    // query tokens are consecutive, so one kernel call serves them all.
    let (kh0, kh1) = (item.heads.start, item.heads.end);
    let (q0, q1) = (item.queries.start, item.queries.end);
    let nq = q1 - q0;
    let rows = nq * (kh1 - kh0) * group;
    for (r, dst) in sc.q[..rows * d].chunks_exact_mut(d).enumerate() {
        let (kh, rem) = (kh0 + r / (nq * group), r % (nq * group));
        let (qi, h) = (q0 + rem / group, kh * group + rem % group);
        let src = &sq.q[(qi * n_heads + h) * d..(qi * n_heads + h + 1) * d];
        for (o, x) in dst.iter_mut().zip(src) {
            *o = x * attn.scale;
        }
        if l.rotate_k {
            hadamard(dst);
        }
    }
    let mut p = Partial {
        m: vec![f32::NEG_INFINITY; rows],
        l: vec![0.0; rows],
        acc: vec![0.0; rows * d],
    };
    let first_pos = len - n_q;
    // Segments in the order they are served: by block, then KV head.
    let kn = kh1 - kh0;
    let segment_at = |i: usize| (item.b0 + i / kn, kh0 + i % kn);
    let segments = (item.b1 - item.b0) * kn;
    // Positions before `seen` are outside every query's window (the item's
    // first query's is the earliest).
    let seen = attn.first_seen(first_pos + q0);
    for i in 0..segments {
        let (b, kh) = segment_at(i);
        let start = b * t;
        if start + t <= seen {
            continue;
        }
        let n_t = t.min(len - start);
        let (kc, kseg): (Codec, &[u8]) = store.segment(sq.kv, b, kh, false);
        let (vc, vseg) = store.segment(sq.kv, b, kh, true);
        // The segments `prefetch_ahead` further on, fetched over this one's loops.
        let later = i + prefetch_ahead;
        let (ahead_k, ahead_v): (&[u8], &[u8]) = if prefetch_ahead > 0 && later < segments {
            let (nb, nh) = segment_at(later);
            (
                store.segment(sq.kv, nb, nh, false).1,
                store.segment(sq.kv, nb, nh, true).1,
            )
        } else {
            (&[], &[])
        };
        // Sub-tiles of `sub` tokens keep the decoded K and V in L1 while every
        // query row of the group reads them.
        for r0 in (0..n_t).step_by(sub) {
            let r1 = n_t.min(r0 + sub);
            if start + r1 <= seen {
                continue;
            }
            // The first of the item's queries that sees this sub-tile.
            let first_q = (start + r0).saturating_sub(first_pos).max(q0);
            if first_q >= q1 {
                break;
            }
            // With a window: the queries from `last_q` on see none of it,
            // those from `cut_q` on only its later rows.
            let (last_q, cut_q) = if attn.window == 0 {
                (q1, q1)
            } else {
                let w = attn.window;
                (
                    (start + r1 + w - 1).saturating_sub(first_pos).min(q1),
                    (start + r0 + w).saturating_sub(first_pos).clamp(q0, q1),
                )
            };
            let k_rows = rows_of(kc, kseg, t, d, r0..r1, false, &mut sc.k, &mut sc.k_scales);
            let v_rows = rows_of(vc, vseg, t, d, r0..r1, true, &mut sc.v, &mut sc.v_scales);
            // This sub-tile's share of the later segments (asked for once,
            // with the first query token).
            let (mut pk, mut pv) = (
                &ahead_k[ahead_k.len() * r0 / t..ahead_k.len() * r1 / t],
                &ahead_v[ahead_v.len() * r0 / t..ahead_v.len() * r1 / t],
            );
            // Queries before `full` see part of the sub-tile (the causal
            // diagonal), one token at a time; the rest see all of it, and
            // are served `TOKENS_PER_CALL` tokens at a time. Every row gets
            // the same operations in the same order either way.
            let full = (start + r1)
                .saturating_sub(first_pos + 1)
                .clamp(first_q, q1);
            let mut qa = first_q;
            while qa < last_q {
                let qb = if qa < full || qa >= cut_q {
                    qa + 1
                } else {
                    last_q.min(cut_q).min(qa + TOKENS_PER_CALL)
                };
                let valid = r1.min(first_pos + qa + 1 - start) - r0;
                // Rows before `hidden` are outside this query's window
                // (only where it is served alone).
                let hidden = attn
                    .first_seen(first_pos + qa)
                    .saturating_sub(start + r0)
                    .min(valid);
                let base = (kh - kh0) * nq * group + (qa - q0) * group;
                let n_rows = (qb - qa) * group;
                let s = &mut sc.s[..n_rows * valid];
                simd::group_scores(
                    &sc.q[base * d..(base + n_rows) * d],
                    n_rows,
                    k_rows,
                    valid,
                    d,
                    s,
                    pk,
                );
                for (g, row) in s.chunks_exact_mut(valid).enumerate() {
                    let r = base + g;
                    let (out_of_window, row) = row.split_at_mut(hidden);
                    out_of_window.fill(0.0);
                    let m_new = p.m[r].max(simd::max(row));
                    sc.corr[g] = if p.m[r] == f32::NEG_INFINITY {
                        0.0
                    } else {
                        fast_exp(p.m[r] - m_new)
                    };
                    p.l[r] = p.l[r] * sc.corr[g] + simd::exp_sum(row, m_new);
                    p.m[r] = m_new;
                }
                simd::group_accumulate(
                    &mut p.acc[base * d..(base + n_rows) * d],
                    &sc.corr[..n_rows],
                    s,
                    v_rows,
                    valid,
                    d,
                    pv,
                );
                (pk, pv) = (&[], &[]);
                qa = qb;
            }
        }
    }
    p
}

/// Rows `rows` of a segment as the group kernels read them: F16 and KV8
/// (power-of-two groups) straight from the segment, converted in the loops;
/// K5 keys and V4 values likewise where [`simd::k5_in_place`] /
/// [`simd::v4_in_place`] say so; anything else decoded into `tile` first.
#[allow(clippy::too_many_arguments)]
fn rows_of<'a>(
    codec: Codec,
    seg: &'a [u8],
    t: usize,
    d: usize,
    rows: std::ops::Range<usize>,
    value: bool,
    tile: &'a mut [f32],
    scales: &'a mut [f32],
) -> Rows<'a> {
    if codec == Codec::F16 {
        return Rows::F16(&seg[rows.start * d * 2..rows.end * d * 2]);
    }
    let n = rows.len();
    match codec {
        Codec::K5 if !value && simd::k5_in_place(d) => {
            if let Some((nib, high)) = codec.k5_rows(seg, t, d, rows.clone(), scales) {
                let (scale, min) = scales[..2 * d].split_at(d);
                return Rows::K5 {
                    nib,
                    high,
                    scale,
                    min,
                };
            }
        }
        Codec::V4 { group } if value && simd::v4_in_place(d, group as usize, n) => {
            if let Some((codes, group)) = codec.v4_rows(seg, t, d, rows.clone(), scales) {
                let per = n * (d / group);
                let (scale, min) = scales[..2 * per].split_at(per);
                return Rows::V4 {
                    codes,
                    scale,
                    min,
                    group,
                };
            }
        }
        _ => {}
    }
    if let Some((codes, shift)) = codec.kv8_rows(seg, t, d, rows.clone(), scales) {
        return Rows::Kv8 {
            codes,
            scales: &scales[..rows.len() * (d >> shift)],
            shift,
        };
    }
    codec.decode_rows(seg, t, d, rows, tile);
    Rows::F32(&tile[..n * d])
}

/// Folds partition `b` (later positions) into `a`.
fn merge(a: &mut Partial, b: Partial, d: usize) {
    for r in 0..a.m.len() {
        if b.m[r] == f32::NEG_INFINITY {
            continue;
        }
        let m = a.m[r].max(b.m[r]);
        let ca = if a.m[r] == f32::NEG_INFINITY {
            0.0
        } else {
            fast_exp(a.m[r] - m)
        };
        let cb = fast_exp(b.m[r] - m);
        a.l[r] = a.l[r] * ca + b.l[r] * cb;
        a.m[r] = m;
        for (x, y) in a.acc[r * d..(r + 1) * d]
            .iter_mut()
            .zip(&b.acc[r * d..(r + 1) * d])
        {
            *x = *x * ca + y * cb;
        }
    }
}

/// `e^x` to about 2 ulp for x ≤ 0 (the only inputs softmax gives it), branch
/// free so loops over it vectorise; inputs below −87 give ~0.
#[inline]
pub(crate) fn fast_exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    // Cody–Waite: r = x − n·ln 2 in two parts, so large |x| keeps its precision.
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
    // e^r on [−ln2/2, ln2/2]: Taylor series to degree 7.
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    f32::from_bits(((n as i32 + 127) as u32) << 23) * p
}

/// Plain causal attention in f64 over f32 K/V (`len × kv_heads × head_dim`):
/// the reference the kernels are tested and benchmarked against.
#[allow(clippy::too_many_arguments)]
pub fn naive_attention(
    q: &[f32],
    n_q: usize,
    n_heads: usize,
    k: &[f32],
    v: &[f32],
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
) -> Vec<f32> {
    naive_attention_layer(
        q,
        n_q,
        n_heads,
        k,
        v,
        kv_heads,
        head_dim,
        &LayerAttn::causal(scale),
    )
}

/// [`naive_attention`] with a layer's window and sinks ([`LayerAttn`]).
#[allow(clippy::too_many_arguments)]
pub fn naive_attention_layer(
    q: &[f32],
    n_q: usize,
    n_heads: usize,
    k: &[f32],
    v: &[f32],
    kv_heads: usize,
    head_dim: usize,
    attn: &LayerAttn<'_>,
) -> Vec<f32> {
    let scale = attn.scale;
    let d = head_dim;
    let len = k.len() / (kv_heads * d);
    let group = n_heads / kv_heads;
    let mut out = vec![0f32; n_q * n_heads * d];
    let mut w = vec![0f64; len];
    for qi in 0..n_q {
        let pos = len - n_q + qi;
        for h in 0..n_heads {
            let kh = h / group;
            let qv = &q[(qi * n_heads + h) * d..(qi * n_heads + h + 1) * d];
            let lo = attn.first_seen(pos);
            let sink = attn.sinks.map(|s| s[h] as f64);
            let mut m = sink.unwrap_or(f64::NEG_INFINITY);
            for (j, w) in w.iter_mut().enumerate().take(pos + 1).skip(lo) {
                let kv = &k[(j * kv_heads + kh) * d..(j * kv_heads + kh + 1) * d];
                *w = qv
                    .iter()
                    .zip(kv)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    * scale as f64;
                m = m.max(*w);
            }
            let mut sum = sink.map_or(0.0, |s| (s - m).exp());
            for w in w.iter_mut().take(pos + 1).skip(lo) {
                *w = (*w - m).exp();
                sum += *w;
            }
            let o = &mut out[(qi * n_heads + h) * d..(qi * n_heads + h + 1) * d];
            for c in 0..d {
                let mut a = 0.0;
                for (j, w) in w.iter().enumerate().take(pos + 1).skip(lo) {
                    a += w * v[(j * kv_heads + kh) * d + c] as f64;
                }
                o[c] = (a / sum) as f32;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_std() {
        let mut worst = 0f32;
        for i in 0..=20_000 {
            let x = -80.0 + i as f32 * 0.004;
            let (a, b) = (fast_exp(x), x.exp());
            worst = worst.max(((a - b) / b).abs());
        }
        assert!(worst < 5e-7, "relative error {worst}");
        assert!(fast_exp(-1000.0) < 1e-37);
        assert_eq!(fast_exp(0.0), 1.0);
    }
}
