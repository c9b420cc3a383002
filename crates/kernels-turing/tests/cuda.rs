//! The CUDA kernels against exact attention over the stored KV and the CPU
//! codecs: on a GPU (feature `cuda`) and in
//! the CPU emulator (feature `cuda-emu`, which runs the same `.cu` source and
//! the same host code). On a machine with no GPU the device tests say so and
//! pass, unless `SILICEO_REQUIRE_GPU` is set (`cargo xtask test-gpu` sets
//! it), where they fail; the emulated tests run everywhere.
#![cfg(any(feature = "cuda", feature = "cuda-emu"))]

use siliceo_kernels_turing::device::{Backend, Kernels, max_abs_diff, max_partition_tokens};
use siliceo_kernels_turing::{
    Codec, KernelError, KvLayout, KvStore, LayerAttn, SeqKv, naive_attention, naive_attention_layer,
};

fn data(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((((i + seed * 7919) * 2_654_435_761) % 4001) as f32 / 2000.0 - 1.0)
                * if i % 29 == 3 { 8.0 } else { 1.0 }
        })
        .collect()
}

/// One decode case: a layout, query heads, sequence lengths, partition size.
#[derive(Clone, Copy)]
struct Case {
    fmt: &'static str,
    kv_heads: usize,
    heads: usize,
    d: usize,
    rotate_k: bool,
    tail_tokens: usize,
    lens: &'static [usize],
    partition: usize,
}

/// Runs `case` on the device; returns its largest difference from exact
/// attention over the stored K/V.
fn decode_difference<B: Backend>(k: &Kernels<B>, c: &Case) -> f32 {
    let mut layout = KvLayout::preset(c.fmt, c.kv_heads, c.d).unwrap();
    layout.rotate_k = c.rotate_k;
    layout.tail_tokens = c.tail_tokens;
    let sealed: usize = c.lens.iter().map(|l| l.div_ceil(64)).sum();
    let mut store = KvStore::new(
        layout,
        sealed,
        c.lens.len() * KvStore::tail_blocks_per_seq(&layout),
    )
    .unwrap();
    let row = c.kv_heads * c.d;
    // Appended round-robin, 37 tokens at a time, so every sequence's blocks
    // are scattered over the pools and only the block tables find them.
    let mut seqs = vec![SeqKv::default(); c.lens.len()];
    let kvs: Vec<(Vec<f32>, Vec<f32>)> = c
        .lens
        .iter()
        .enumerate()
        .map(|(i, &len)| (data(len * row, i), data(len * row, i + 50)))
        .collect();
    let mut at = vec![0usize; c.lens.len()];
    while at.iter().zip(c.lens).any(|(a, l)| a < l) {
        for (i, s) in seqs.iter_mut().enumerate() {
            let n = (c.lens[i] - at[i]).min(37);
            if n > 0 {
                let span = at[i] * row..(at[i] + n) * row;
                store
                    .append(s, &kvs[i].0[span.clone()], &kvs[i].1[span])
                    .unwrap();
                at[i] += n;
            }
        }
    }
    let q = data(c.lens.len() * c.heads * c.d, 99);
    let scale = 1.0 / (c.d as f32).sqrt();
    // The reference: exact (f64) attention over the values the store holds
    // (K un-rotated), as the CPU kernel's own tests use — not the CPU kernel,
    // whose integer score paths round the query (within their documented
    // bounds, up to 5e-3 here at heads of 256), while the GPU computes in f32.
    let mut want = Vec::new();
    for (i, s) in seqs.iter().enumerate() {
        let (rk, rv) = store.read(s);
        let qi = &q[i * c.heads * c.d..(i + 1) * c.heads * c.d];
        want.extend(naive_attention(
            qi, 1, c.heads, &rk, &rv, c.kv_heads, c.d, scale,
        ));
    }
    let dev = k.upload(&store).unwrap();
    let refs: Vec<&SeqKv> = seqs.iter().collect();
    let got = k
        .decode(&dev, &refs, &q, c.heads, scale, c.partition)
        .unwrap();
    assert_eq!(got.len(), want.len());
    max_abs_diff(&got, &want)
}

/// Every format, head size 64, 128, 256 and 512, rotation and a tail, the default
/// partition size (0), the longest partition shared memory allows, or several,
/// sequences of 1 token to several partitions.
fn decode_matches_exact_attention<B: Backend>(k: &Kernels<B>, lens: &'static [usize]) {
    for fmt in ["f16", "kv8", "k5v4"] {
        for d in [64, 128, 256, 512] {
            for (rotate_k, tail_tokens, partition) in [
                (false, 0, 0),
                (true, 100, 256),
                (false, 0, 64),
                (false, 0, max_partition_tokens(4, d)),
            ] {
                let c = Case {
                    fmt,
                    kv_heads: 2,
                    heads: 8,
                    d,
                    rotate_k,
                    tail_tokens,
                    lens,
                    partition,
                };
                let worst = decode_difference(k, &c);
                assert!(
                    worst < 2e-3,
                    "{fmt} d={d} rotate={rotate_k} tail={tail_tokens} partition={partition}: device and exact attention differ by {worst}"
                );
            }
        }
    }
}

/// A store filled on the device through `Kernels::append` — three sequences
/// appended to round-robin in uneven steps (single tokens, partial and whole
/// blocks), one released and its blocks reused — holds the same block tables,
/// free lists and pool bytes as a `KvStore` given the same appends on the
/// host, for every format, with and without K rotation and an F16 tail; its
/// decode matches exact attention; a full store refuses an append and
/// changes nothing; a block table from a larger store is refused.
fn device_store_matches_the_cpu_store<B: Backend>(k: &Kernels<B>) {
    let (kv_heads, heads, d) = (2, 4, 64);
    let row = kv_heads * d;
    for fmt in ["f16", "kv8", "k5v4"] {
        for (rotate_k, tail_tokens) in [(false, 0), (true, 70)] {
            let what = format!("{fmt} rotate={rotate_k} tail={tail_tokens}");
            let mut layout = KvLayout::preset(fmt, kv_heads, d).unwrap();
            layout.rotate_k = rotate_k;
            layout.tail_tokens = tail_tokens;
            let (sealed_blocks, tail_blocks) = (12, 3 * KvStore::tail_blocks_per_seq(&layout));
            let mut host = KvStore::new(layout, sealed_blocks, tail_blocks).unwrap();
            let mut dev = k.alloc(layout, sealed_blocks, tail_blocks).unwrap();
            let mut hs = vec![SeqKv::default(); 3];
            let mut ds = vec![SeqKv::default(); 3];
            let steps = [1, 37, 64, 5, 1, 100, 3, 64, 1, 29];
            let mut seed = 0;
            for (round, n) in steps.iter().enumerate() {
                for i in 0..3 {
                    let n = n + i;
                    seed += 1;
                    let (kx, vx) = (data(n * row, seed), data(n * row, seed + 1000));
                    host.append(&mut hs[i], &kx, &vx).unwrap();
                    k.append(&mut dev, &mut ds[i], &kx, &vx).unwrap();
                    assert_eq!(hs[i], ds[i], "{what}: block tables after round {round}");
                }
                if round == 5 {
                    // Free a sequence mid-way: later appends reuse its blocks.
                    host.release(&mut hs[1]);
                    dev.release(&mut ds[1]);
                }
                assert_eq!(
                    host.pools(),
                    dev.pools(),
                    "{what}: pools after round {round}"
                );
            }
            assert!(
                hs[0].sealed.len() >= 2 && hs[2].sealed.len() >= 2,
                "{what}: too little sealed"
            );
            let (sealed, tail) = k.download(&dev).unwrap();
            for (name, a, b) in [
                ("sealed", host.sealed_bytes(), &sealed[..]),
                ("tail", host.tail_bytes(), &tail[..]),
            ] {
                let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
                assert_eq!(
                    differ, 0,
                    "{what}: {differ} bytes of the {name} pool differ"
                );
            }
            // Decode over the device store against exact attention over the
            // host store (the same values, block for block).
            let q = data(3 * heads * d, 77);
            let scale = 0.125;
            let mut want = Vec::new();
            for (i, s) in hs.iter().enumerate() {
                let (rk, rv) = host.read(s);
                let qi = &q[i * heads * d..(i + 1) * heads * d];
                want.extend(naive_attention(qi, 1, heads, &rk, &rv, kv_heads, d, scale));
            }
            let refs: Vec<&SeqKv> = ds.iter().collect();
            let got = k.decode(&dev, &refs, &q, heads, scale, 0).unwrap();
            let worst = max_abs_diff(&got, &want);
            assert!(worst < 2e-3, "{what}: decode differs by {worst}");
            // K and V of different lengths, or a ragged row: a shape error.
            for (kl, vl) in [(row, 2 * row), (row + 1, row + 1)] {
                let e = k
                    .append(&mut dev, &mut ds[0], &q[..kl], &q[..vl])
                    .unwrap_err();
                assert!(matches!(e, KernelError::Shape(_)), "{what}: {e}");
            }
            // Full: the next append fails whole, and nothing changes.
            let before = (ds[0].clone(), dev.pools().clone());
            let big = data(sealed_blocks * 64 * row, 5);
            let e = k.append(&mut dev, &mut ds[0], &big, &big).unwrap_err();
            assert!(matches!(e, KernelError::OutOfBlocks { .. }), "{what}: {e}");
            assert_eq!((ds[0].clone(), dev.pools().clone()), before, "{what}");
            // A table naming blocks past this store's pools is refused.
            let mut other = KvStore::new(layout, 40, 40).unwrap();
            let mut far = SeqKv::default();
            let many = data(30 * 64 * row, 6);
            other.append(&mut far, &many, &many).unwrap();
            let e = k
                .decode(&dev, &[&far], &q[..heads * d], heads, scale, 0)
                .unwrap_err();
            assert!(
                matches!(&e, KernelError::Shape(m) if m.contains("outside the pools")),
                "{what}: {e}"
            );
            let e = k
                .append(&mut dev, &mut far, &q[..row], &q[..row])
                .unwrap_err();
            assert!(
                matches!(&e, KernelError::Shape(m) if m.contains("outside the pools")),
                "{what}: {e}"
            );
            for s in &mut ds {
                dev.release(s);
            }
            assert_eq!(
                dev.free_blocks(),
                (sealed_blocks, tail_blocks),
                "{what}: blocks leaked"
            );
        }
    }
}

/// Appends two blocks' worth of tokens to two F16 tail blocks, interleaved
/// (token i to tail block i % 2, row i / 2), seals tail block 0 into sealed
/// block 1 and tail block 1 into sealed block 0, and checks every sealed
/// segment holds the bytes the CPU codec writes for the same values (so
/// GPU- and CPU-sealed blocks are interchangeable), and decodes within the
/// codec's bound of what was appended.
fn append_and_seal_quantize_within_the_codec_bounds<B: Backend>(k: &Kernels<B>) {
    for fmt in ["f16", "kv8", "k5v4"] {
        for d in [64, 128, 512] {
            let (heads, t) = (2, 64);
            let layout = KvLayout::preset(fmt, heads, d).unwrap();
            let mut dev = k.alloc(layout, 2, 2).unwrap();
            let kx = data(2 * t * heads * d, 1);
            let vx = data(2 * t * heads * d, 2);
            let blocks: Vec<u32> = (0..2 * t as u32).map(|i| i % 2).collect();
            let rows: Vec<i32> = (0..2 * t as i32).map(|i| i / 2).collect();
            k.write_rows(&mut dev, &kx, &vx, &blocks, &rows).unwrap();
            k.seal(&mut dev, 0, 1).unwrap();
            k.seal(&mut dev, 1, 0).unwrap();
            let (sealed, _) = k.download(&dev).unwrap();
            let (ks, vs) = (layout.k_segment_bytes(), layout.v_segment_bytes());
            for (sealed_block, tail_block) in [(1, 0), (0, 1)] {
                let block = &sealed[sealed_block * layout.block_bytes()
                    ..(sealed_block + 1) * layout.block_bytes()];
                for h in 0..heads {
                    for (codec, seg, x) in [
                        (layout.k, &block[h * (ks + vs)..h * (ks + vs) + ks], &kx),
                        (
                            layout.v,
                            &block[h * (ks + vs) + ks..(h + 1) * (ks + vs)],
                            &vx,
                        ),
                    ] {
                        // What the tail held: f16 of tokens 2r + tail_block, head h.
                        let src: Vec<f32> = (0..t)
                            .flat_map(|r| (0..d).map(move |c| (r, c)))
                            .map(|(r, c)| {
                                let i = 2 * r + tail_block;
                                half::f16::from_f32(x[(i * heads + h) * d + c]).to_f32()
                            })
                            .collect();
                        let mut cpu = vec![0u8; seg.len()];
                        codec.encode(&src, t, d, &mut cpu);
                        let differ = cpu.iter().zip(seg).filter(|(a, b)| a != b).count();
                        assert_eq!(
                            differ, 0,
                            "{fmt} d={d} {codec:?} sealed block {sealed_block} head {h}: {differ} bytes differ from the CPU codec's"
                        );
                        let mut got = vec![0f32; t * d];
                        codec.decode(seg, t, d, &mut got);
                        for r in 0..t {
                            for c in 0..d {
                                let grp: Vec<f32> = match codec {
                                    Codec::F16 => vec![src[r * d + c]],
                                    Codec::Kv8 { group } | Codec::V4 { group } => {
                                        let g = group as usize;
                                        src[r * d + c / g * g..r * d + (c / g + 1) * g].to_vec()
                                    }
                                    Codec::K5 => (0..t).map(|rr| src[rr * d + c]).collect(),
                                };
                                let err = (got[r * d + c] - src[r * d + c]).abs();
                                assert!(
                                    err <= codec.error_bound(&grp),
                                    "{fmt} d={d} {codec:?} sealed block {sealed_block} head {h} [{r}][{c}]: error {err}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// llama.cpp's tensors of one layer, as the grafted path finds them, in
/// device memory: Q f32 `[d, n, heads]` with tokens outermost (llama.cpp's
/// permuted view), K f16 cache rows (a token's heads side by side, in a
/// cache of more cells than the step has) and V f32 with heads outermost.
struct LayerTensors<B: Backend> {
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    qv: Vec<f32>,
    kv: (Vec<f32>, Vec<f32>),
}

fn layer_tensors<B: Backend>(
    k: &Kernels<B>,
    n: usize,
    (heads, kv_heads, d): (usize, usize, usize),
    seed: usize,
) -> LayerTensors<B> {
    let q = data(n * heads * d, seed);
    // K through f16 (what llama.cpp's cache holds), so the host gets the
    // same values.
    let kx: Vec<f32> = data(n * kv_heads * d, seed + 1)
        .iter()
        .map(|&x| half::f16::from_f32(x).to_f32())
        .collect();
    let vx = data(n * kv_heads * d, seed + 2);
    let cells = n + 5;
    let mut kb = vec![0u8; cells * kv_heads * d * 2];
    for (i, x) in kx.iter().enumerate() {
        kb[2 * i..2 * i + 2].copy_from_slice(&half::f16::from_f32(*x).to_le_bytes());
    }
    // V heads-outermost: element (c, i, h) at ((h · n + i) · d + c) · 4.
    let mut vb = vec![0u8; n * kv_heads * d * 4];
    for i in 0..n {
        for h in 0..kv_heads {
            for c in 0..d {
                let x = vx[(i * kv_heads + h) * d + c];
                let at = ((h * n + i) * d + c) * 4;
                vb[at..at + 4].copy_from_slice(&x.to_le_bytes());
            }
        }
    }
    let b = k.backend();
    LayerTensors {
        q: b.upload(&q.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>())
            .unwrap(),
        k: b.upload(&kb).unwrap(),
        v: b.upload(&vb).unwrap(),
        qv: q,
        kv: (kx, vx),
    }
}

/// A grafted layer step on the device — K/V written straight from strided
/// f16 and f32 tensors, a copy-on-write row copy, a seal, then causal
/// attention for every batch token over query runs of three sequences —
/// leaves exactly the bytes the CPU store (`KvPages`) holds after the same
/// writes, copies and seals, for every format, with and without K rotation;
/// each token's attention matches exact attention over the first tokens it
/// may see. Two steps: a prefill of two sequences (one crossing a block and
/// sealing it mid-step), then a mixed step with a sequence forked from a
/// copied block. Out-of-pool writes and short tensors are shape errors.
fn graft_layer_matches_the_cpu_pages<B: Backend>(k: &Kernels<B>) {
    use siliceo_kernels_turing::KvPages;
    use siliceo_kernels_turing::graft::{DeviceRows, DeviceSpan, QueryRun, StepTuning};
    let (heads, kv_heads, d) = (6, 2, 64);
    let row = kv_heads * d;
    let b = k.backend();
    for fmt in ["f16", "kv8", "k5v4"] {
        for rotate_k in [false, true] {
            let what = format!("{fmt} rotate={rotate_k}");
            let mut layout = KvLayout::preset(fmt, kv_heads, d).unwrap();
            layout.rotate_k = rotate_k;
            let mut host = KvPages::new(layout, 8, 8).unwrap();
            let mut dev = k.alloc(layout, 8, 8).unwrap();
            let seq = |sealed: &[u32], tail: &[u32], len| SeqKv {
                sealed: sealed.to_vec(),
                tail: tail.to_vec(),
                len,
            };
            // Step 1: A = batch 0..70 (positions 0..70, tail blocks 0 and 1;
            // block 0 sealed into sealed block 5 this step: the first 40
            // queries see it open, the rest sealed), B = batch 70..100
            // (positions 0..30 in tail block 2), then B's first 10 rows are
            // copied into tail block 3 (a fork, used in step 2).
            let mut writes: Vec<(u32, u16)> = (0..70)
                .map(|p| ((p / 64) as u32, (p % 64) as u16))
                .collect();
            writes.extend((0..30).map(|p| (2u32, p as u16)));
            let (a_open, a_sealed, b1) =
                (seq(&[], &[0], 40), seq(&[5], &[1], 70), seq(&[], &[2], 30));
            let runs1 = [(40, &a_open), (30, &a_sealed), (30, &b1)];
            let step1 = (writes, vec![(2u32, 3u32, 0..10)], vec![(0u32, 5u32)]);
            // Step 2: A decodes position 70 (tail 1 row 6), B positions 30..33,
            // C (the fork: B's first 10 tokens in tail block 3) position 10.
            let (a2, b2, c2) = (seq(&[5], &[1], 71), seq(&[], &[2], 33), seq(&[], &[3], 11));
            let mut writes2 = vec![(1u32, 6u16)];
            writes2.extend((30..33).map(|p| (2u32, p as u16)));
            writes2.push((3, 10));
            let runs2 = [(1, &a2), (3, &b2), (1, &c2)];
            let step2 = (writes2, vec![], vec![]);
            for (si, ((writes, copies, seals), runs)) in [(step1, &runs1[..]), (step2, &runs2[..])]
                .into_iter()
                .enumerate()
            {
                let n = writes.len();
                let t = layer_tensors(k, n, (heads, kv_heads, d), 10 * si + 1);
                let qr: Vec<QueryRun<'_>> = runs
                    .iter()
                    .map(|&(tokens, kv)| QueryRun { tokens, kv })
                    .collect();
                let out = b.zeros(n * heads * d * 4).unwrap();
                let rows = |buf: &B::Buf, f16: bool, nb: [usize; 3]| DeviceRows {
                    addr: b.addr(buf),
                    f16,
                    nb,
                    bytes: B::buf_len(buf),
                };
                let scale = 0.125;
                let (qt, kt, vt) = (
                    rows(&t.q, false, [4, heads * d * 4, d * 4]),
                    rows(&t.k, true, [2, row * 2, d * 2]),
                    rows(&t.v, false, [4, d * 4, n * d * 4]),
                );
                let span = DeviceSpan {
                    addr: b.addr(&out),
                    bytes: B::buf_len(&out),
                };
                // A sink logit per query head, some above the scores, some below.
                let sink_logits: Vec<f32> = (0..heads).map(|h| h as f32 - 2.5).collect();
                let sinks_buf = b
                    .upload(
                        &sink_logits
                            .iter()
                            .flat_map(|x| x.to_le_bytes())
                            .collect::<Vec<_>>(),
                    )
                    .unwrap();
                let sinks_span = DeviceSpan {
                    addr: b.addr(&sinks_buf),
                    bytes: B::buf_len(&sinks_buf),
                };
                // A K tensor one token short is refused before anything runs.
                let short = DeviceRows {
                    bytes: kt.bytes - (5 + 1) * row * 2,
                    ..kt
                };
                // Step 1's runs (40, 30, 30 tokens) go to the prefill kernel
                // by default; step 2's (1, 3, 1) to the decode kernel. With
                // runs of 2 tokens or more on the prefill kernel and
                // partitions of 32 tokens, step 1 is reduced from 3
                // partitions and step 2 splits its runs between the kernels.
                // Each step runs under both (same writes, copies and seals:
                // the same bytes).
                let mixed = StepTuning {
                    prefill_min_tokens: 2,
                    prefill_partition_tokens: 32,
                };
                let tunings = [
                    (StepTuning::default(), [(0, n), (n, 0)][si]),
                    (mixed, [(0, n), (2, 3)][si]),
                ];
                let mut gots = Vec::new();
                for (tuning, split) in tunings {
                    let step = k
                        .graft_step_with(
                            &dev,
                            heads,
                            &writes,
                            copies.clone(),
                            seals.clone(),
                            &qr,
                            &tuning,
                        )
                        .unwrap();
                    assert_eq!(step.split(), split, "{what} step {si}: {tuning:?}");
                    let e = k
                        .graft_layer(&mut dev, &step, qt, short, vt, scale, 0, None, span)
                        .unwrap_err();
                    assert!(matches!(e, KernelError::Shape(_)), "{what}: {e}");
                    // Sinks for one head fewer than there are: refused.
                    let few = DeviceSpan {
                        bytes: (heads - 1) * 4,
                        ..sinks_span
                    };
                    let e = k
                        .graft_layer(&mut dev, &step, qt, kt, vt, scale, 0, Some(few), span)
                        .unwrap_err();
                    assert!(matches!(e, KernelError::Shape(_)), "{what}: {e}");
                    // The whole context, a sliding window of 25, and the
                    // window with sinks (the same writes, copies and seals
                    // again: the same bytes).
                    for (window, sinks) in [(0, false), (25, false), (25, true)] {
                        let s = sinks.then_some(sinks_span);
                        k.graft_layer(&mut dev, &step, qt, kt, vt, scale, window, s, span)
                            .unwrap();
                        let got = bytes_f32(&b.download(&out).unwrap());
                        gots.push((tuning, window, sinks, got));
                    }
                }
                // The same step on the host store.
                for (i, &(blk, r)) in writes.iter().enumerate() {
                    host.write_token(
                        blk,
                        usize::from(r),
                        &t.kv.0[i * row..(i + 1) * row],
                        &t.kv.1[i * row..(i + 1) * row],
                    );
                }
                for (src, dst, r) in &copies {
                    host.copy_tail_rows(*src, *dst, r.clone());
                }
                for &(src, dst) in &seals {
                    host.seal(src, dst);
                }
                let (sealed, tail) = k.download(&dev).unwrap();
                for (name, a, bytes) in [
                    ("sealed", host.sealed_bytes(), &sealed[..]),
                    ("tail", host.tail_bytes(), &tail[..]),
                ] {
                    let differ = a.iter().zip(bytes).filter(|(x, y)| x != y).count();
                    assert_eq!(
                        differ, 0,
                        "{what} step {si}: {differ} bytes of the {name} pool differ"
                    );
                }
                // Each token against exact attention over what it may see.
                let want = |window, sinks: bool| {
                    let attn = LayerAttn {
                        scale,
                        window,
                        sinks: sinks.then_some(&sink_logits[..]),
                    };
                    let mut want = Vec::new();
                    let mut at = 0;
                    for &(tokens, kv) in runs {
                        let (rk, rv) = host.read(kv);
                        for j in 0..tokens {
                            let len = kv.len - tokens + 1 + j;
                            let qi = &t.qv[(at + j) * heads * d..(at + j + 1) * heads * d];
                            want.extend(naive_attention_layer(
                                qi,
                                1,
                                heads,
                                &rk[..len * row],
                                &rv[..len * row],
                                kv_heads,
                                d,
                                &attn,
                            ));
                        }
                        at += tokens;
                    }
                    want
                };
                let wants = [want(0, false), want(25, false), want(25, true)];
                assert!(
                    max_abs_diff(&wants[0], &wants[1]) > 0.05,
                    "the window hides nothing"
                );
                assert!(
                    max_abs_diff(&wants[1], &wants[2]) > 0.05,
                    "the sinks weigh nothing"
                );
                for (tuning, window, sinks, got) in &gots {
                    let want = &wants[usize::from(*window > 0) + usize::from(*sinks)];
                    let worst = max_abs_diff(got, want);
                    assert!(
                        worst < 2e-3,
                        "{what} step {si} {tuning:?} window {window} sinks {sinks}: attention \
                         differs by {worst}"
                    );
                }
            }
            // A write outside the tail pool is refused.
            let one = seq(&[], &[0], 1);
            let e = k.graft_step(
                &dev,
                heads,
                &[(8, 0)],
                Vec::new(),
                Vec::new(),
                &[QueryRun {
                    tokens: 1,
                    kv: &one,
                }],
            );
            assert!(
                matches!(e, Err(KernelError::Shape(_))),
                "{what}: a write outside the pool"
            );
            // Blocks read back and written elsewhere (a swap-out and in).
            let block = k.read_block(&dev, true, 5).unwrap();
            assert_eq!(
                block,
                host.sealed_block(5),
                "{what}: sealed block read back"
            );
            k.write_block(&mut dev, true, 6, &block).unwrap();
            let (sealed, _) = k.download(&dev).unwrap();
            let size = layout.block_bytes();
            assert_eq!(
                &sealed[6 * size..7 * size],
                &block[..],
                "{what}: block written back"
            );
        }
    }
}

/// The prefill kernel against the decode kernel and exact attention: a
/// context of `ctx` tokens (full blocks sealed), then a chunk of `chunk`
/// tokens as one query run, served by the decode kernel a token at a time,
/// by the prefill kernel in one partition, and by it in partitions of 48
/// tokens (not a multiple of its key tiles; the reduction merges them).
/// Every format, heads of 64, 128, 256 and 512, one to eight query heads per KV
/// head (7: tiles end mid-token), K rotated or not. The two kernels agree to
/// 2e-5 (4e-5 with heads of 512) and each is within 2e-3 of exact attention
/// over the stored K/V.
fn prefill_matches_decode_and_exact_attention<B: Backend>(k: &Kernels<B>) {
    use siliceo_kernels_turing::KvPages;
    use siliceo_kernels_turing::graft::{DeviceRows, DeviceSpan, QueryRun, StepTuning};
    let b = k.backend();
    let cases: [(&str, usize, usize, usize, bool, usize, usize); 8] = [
        ("f16", 64, 2, 6, false, 130, 24),
        ("kv8", 128, 2, 14, true, 70, 13),
        ("k5v4", 128, 1, 8, false, 70, 12),
        ("kv8", 256, 1, 2, false, 64, 9),
        ("k5v4", 64, 4, 4, true, 100, 40),
        // Heads of 512 (Gemma 4's global layers): up to four per KV head.
        ("f16", 512, 2, 8, false, 100, 20),
        ("kv8", 512, 1, 3, true, 70, 12),
        ("k5v4", 512, 2, 4, false, 64, 9),
    ];
    for (fmt, d, kv_heads, heads, rotate_k, ctx, chunk) in cases {
        let what = format!("{fmt} d={d} {heads}/{kv_heads} heads rotate={rotate_k}");
        let mut layout = KvLayout::preset(fmt, kv_heads, d).unwrap();
        layout.rotate_k = rotate_k;
        let total = ctx + chunk;
        let blocks = total.div_ceil(64);
        let mut host = KvPages::new(layout, blocks, blocks).unwrap();
        let mut dev = k.alloc(layout, blocks, blocks).unwrap();
        let row = kv_heads * d;
        // Token p in row p % 64 of tail block p / 64; the context's full
        // blocks sealed into sealed blocks of the same index.
        let full = ctx / 64;
        let view = |len: usize| SeqKv {
            sealed: (0..full as u32).collect(),
            tail: (full as u32..len.div_ceil(64) as u32).collect(),
            len,
        };
        let mut outputs = Vec::new();
        for (si, (from, to)) in [(0, ctx), (ctx, total)].into_iter().enumerate() {
            let n = to - from;
            let t = layer_tensors(k, n, (heads, kv_heads, d), 100 * si + d);
            let writes: Vec<(u32, u16)> = (from..to)
                .map(|p| ((p / 64) as u32, (p % 64) as u16))
                .collect();
            let seals: Vec<(u32, u32)> = if si == 0 {
                (0..full as u32).map(|i| (i, i)).collect()
            } else {
                Vec::new()
            };
            let kv = if si == 0 {
                SeqKv {
                    sealed: Vec::new(),
                    tail: (0..ctx.div_ceil(64) as u32).collect(),
                    len: ctx,
                }
            } else {
                view(total)
            };
            let run = [QueryRun { tokens: n, kv: &kv }];
            let rows = |buf: &B::Buf, f16: bool, nb: [usize; 3]| DeviceRows {
                addr: b.addr(buf),
                f16,
                nb,
                bytes: B::buf_len(buf),
            };
            let (qt, kt, vt) = (
                rows(&t.q, false, [4, heads * d * 4, d * 4]),
                rows(&t.k, true, [2, row * 2, d * 2]),
                rows(&t.v, false, [4, d * 4, n * d * 4]),
            );
            let scale = 1.0 / (d as f32).sqrt();
            let tunings: &[(StepTuning, (usize, usize))] = if si == 0 {
                &[(StepTuning::default(), (0, n))]
            } else {
                &[
                    (
                        StepTuning {
                            prefill_min_tokens: usize::MAX,
                            prefill_partition_tokens: 0,
                        },
                        (n, 0),
                    ),
                    (
                        StepTuning {
                            prefill_min_tokens: 1,
                            prefill_partition_tokens: 1 << 20,
                        },
                        (0, n),
                    ),
                    (
                        StepTuning {
                            prefill_min_tokens: 2,
                            prefill_partition_tokens: 48,
                        },
                        (0, n),
                    ),
                ]
            };
            for (tuning, split) in tunings {
                // The writes and seals are the same each time: the store's
                // bytes do not change after the first.
                let step = k
                    .graft_step_with(
                        &dev,
                        heads,
                        &writes,
                        Vec::new(),
                        seals.clone(),
                        &run,
                        tuning,
                    )
                    .unwrap();
                assert_eq!(step.split(), *split, "{what}: {tuning:?}");
                let out = b.zeros(n * heads * d * 4).unwrap();
                let span = DeviceSpan {
                    addr: b.addr(&out),
                    bytes: B::buf_len(&out),
                };
                k.graft_layer(&mut dev, &step, qt, kt, vt, scale, 0, None, span)
                    .unwrap();
                if si == 1 {
                    outputs.push((*tuning, bytes_f32(&b.download(&out).unwrap())));
                }
            }
            for (i, p) in (from..to).enumerate() {
                host.write_token(
                    (p / 64) as u32,
                    p % 64,
                    &t.kv.0[i * row..(i + 1) * row],
                    &t.kv.1[i * row..(i + 1) * row],
                );
            }
            for &(src, dst) in &seals {
                host.seal(src, dst);
            }
            if si == 1 {
                let (rk, rv) = host.read(&view(total));
                let mut want = Vec::new();
                for j in 0..n {
                    let len = ctx + 1 + j;
                    want.extend(naive_attention(
                        &t.qv[j * heads * d..(j + 1) * heads * d],
                        1,
                        heads,
                        &rk[..len * row],
                        &rv[..len * row],
                        kv_heads,
                        d,
                        scale,
                    ));
                }
                for (tuning, got) in &outputs {
                    let worst = max_abs_diff(got, &want);
                    assert!(worst < 2e-3, "{what} {tuning:?}: {worst} from exact");
                    // f32 sums in other orders: their rounding grows with
                    // the dot products' length (2.7e-5 apart at heads of 512).
                    let apart = max_abs_diff(got, &outputs[0].1);
                    let bound = 2e-5 * (d as f32 / 256.0).max(1.0);
                    assert!(
                        apart < bound,
                        "{what} {tuning:?}: {apart} from the decode kernel"
                    );
                }
            }
        }
        let (sealed, tail) = k.download(&dev).unwrap();
        assert!(
            sealed == host.sealed_bytes() && tail == host.tail_bytes(),
            "{what}: the device store's bytes differ from the CPU pages'"
        );
    }
}

fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::path::Path;

    use siliceo_kernels_turing::KernelError;
    use siliceo_kernels_turing::cuda::CudaKernels;

    fn device() -> Option<CudaKernels> {
        match CudaKernels::new(0) {
            Ok(k) => Some(k),
            Err(e) if std::env::var_os("SILICEO_REQUIRE_GPU").is_some() => {
                panic!("a GPU is required here: {e}")
            }
            Err(e) => {
                eprintln!("no GPU here, device test skipped: {e}");
                None
            }
        }
    }

    #[test]
    fn no_driver_or_no_kernels_is_a_typed_error_not_a_panic() {
        let e = CudaKernels::with_dir(0, Path::new("/nonexistent/siliceo-kernels")).unwrap_err();
        assert!(matches!(e, KernelError::Cuda(_)), "{e}");
        eprintln!("{e}");
    }

    #[test]
    fn gpu_decode_matches_exact_attention() {
        let Some(k) = device() else { return };
        eprintln!(
            "device: {} {:?}, kernels {}",
            k.device_name(),
            k.compute_capability(),
            k.image().display()
        );
        super::decode_matches_exact_attention(&k, &[1, 100, 1000, 64]);
    }

    #[test]
    fn gpu_store_matches_the_cpu_store() {
        let Some(k) = device() else { return };
        super::device_store_matches_the_cpu_store(&k);
    }

    #[test]
    fn gpu_prefill_matches_decode_and_exact_attention() {
        let Some(k) = device() else { return };
        super::prefill_matches_decode_and_exact_attention(&k);
    }

    #[test]
    fn gpu_graft_layer_matches_the_cpu_pages() {
        let Some(k) = device() else { return };
        super::graft_layer_matches_the_cpu_pages(&k);
    }

    #[test]
    fn gpu_append_and_seal_quantize_within_the_codec_bounds() {
        let Some(k) = device() else { return };
        super::append_and_seal_quantize_within_the_codec_bounds(&k);
    }
}

#[cfg(feature = "cuda-emu")]
mod emulated {
    use siliceo_kernels_turing::device::{
        Arg, Backend, BenchShape, Launch, auto_partition_tokens, bench_decode, max_partition_tokens,
    };
    use siliceo_kernels_turing::emu::EmuKernels;
    use siliceo_kernels_turing::graft::bench_prefill;
    use siliceo_kernels_turing::{KernelError, KvLayout, KvStore, SeqKv};

    use super::Case;

    #[test]
    fn emulated_decode_matches_exact_attention() {
        super::decode_matches_exact_attention(&EmuKernels::emulated(), &[1, 100, 300, 64]);
    }

    #[test]
    fn emulated_decode_covers_every_group_size() {
        // One query head per KV head (MHA) up to the kernels' most (8), group
        // sizes that are not a power of two (run by the next larger kernel),
        // and a sequence over a partition boundary that is not a block
        // boundary.
        let k = EmuKernels::emulated();
        for (kv_heads, heads) in [(4, 4), (2, 4), (3, 9), (1, 8), (2, 12)] {
            let c = Case {
                fmt: "k5v4",
                kv_heads,
                heads,
                d: 64,
                rotate_k: false,
                tail_tokens: 0,
                lens: &[200, 7],
                partition: 96,
            };
            let worst = super::decode_difference(&k, &c);
            assert!(worst < 2e-3, "{heads}/{kv_heads} heads: {worst}");
        }
    }

    #[test]
    fn emulated_graft_layer_matches_the_cpu_pages() {
        super::graft_layer_matches_the_cpu_pages(&EmuKernels::emulated());
    }

    #[test]
    fn emulated_prefill_matches_decode_and_exact_attention() {
        super::prefill_matches_decode_and_exact_attention(&EmuKernels::emulated());
    }

    #[test]
    fn emulated_store_matches_the_cpu_store() {
        super::device_store_matches_the_cpu_store(&EmuKernels::emulated());
    }

    #[test]
    fn emulated_decode_reads_every_group_size() {
        // Groups of 8 channels (V4 keeps such a group's nibbles in 4 bytes,
        // read whole), 16, and a whole head, for V4 and KV8.
        let k = EmuKernels::emulated();
        for fmt in [
            "k5:v4/8",
            "k5:v4/16",
            "k5:v4/64",
            "kv8/8:kv8/8",
            "kv8/64:kv8/16",
        ] {
            let c = Case {
                fmt,
                kv_heads: 2,
                heads: 4,
                d: 64,
                rotate_k: false,
                tail_tokens: 0,
                lens: &[150, 64],
                partition: 0,
            };
            let worst = super::decode_difference(&k, &c);
            assert!(worst < 2e-3, "{fmt}: {worst}");
        }
    }

    #[test]
    fn emulated_append_and_seal_quantize_within_the_codec_bounds() {
        super::append_and_seal_quantize_within_the_codec_bounds(&EmuKernels::emulated());
    }

    #[test]
    fn the_loads_in_flight_variants_agree_with_the_cpu_kernel() {
        // F16 heads of 128 come in 1, 2, 4 and 8 loads in flight for tuning
        // on a GPU; every one must compute the same attention.
        let formats = ["f16".to_string(), "kv8".to_string()];
        let shape = BenchShape {
            ctxs: &[90],
            formats: &formats,
            heads: 8,
            kv_heads: 2,
            head_dim: 128,
            reps: 1,
            partitions: &[64],
            batch: 1,
            block_tokens: 64,
            loads: &[1, 2, 4, 8],
            launches: 1,
        };
        let mut rows = Vec::new();
        bench_decode(&EmuKernels::emulated(), &shape, |r| rows.push(r.clone())).unwrap();
        // KV8 has no variants: its rows are left out.
        assert_eq!(rows.len(), 4);
        for r in &rows {
            assert_eq!(r.format, "f16");
            assert!(r.max_diff < 2e-3, "{r:?}");
        }
    }

    /// What the decode kernels' K/V loads would cost a GPU, counted by the
    /// emulator: every byte of the context is read (the distinct sectors
    /// touched are exactly the K/V bytes a decode needs), and F16 and KV8
    /// loads are coalesced. Printed per format and head size
    /// (`--nocapture`): warp-wide loads per token and KV head, bytes per
    /// load, sector efficiency.
    #[test]
    fn the_decode_kernels_read_every_kv_byte_once_in_coalesced_loads() {
        let k = EmuKernels::emulated();
        let (kv_heads, heads, len) = (2, 8, 1000);
        for fmt in ["f16", "kv8", "k5v4"] {
            for d in [64, 128, 256, 512] {
                let layout = KvLayout::preset(fmt, kv_heads, d).unwrap();
                let mut store = KvStore::new(layout, 16, 1).unwrap();
                let mut seq = SeqKv::default();
                let kv = super::data(len * kv_heads * d, d);
                store.append(&mut seq, &kv, &kv).unwrap();
                let dev = k.upload(&store).unwrap();
                let q = super::data(heads * d, 3);
                let run = k.prepare_decode(&dev, &[&seq], &q, heads, 0.1, 0).unwrap();
                let (r, t) = k.backend().trace(|| run.launch(&k, &dev));
                r.unwrap();
                let tail = len - seq.sealed.len() * 64;
                let needed = seq.sealed.len() * layout.block_bytes() + tail * kv_heads * 2 * d * 2;
                let per_token = t.warp_loads as f64 / (len * kv_heads) as f64;
                println!(
                    "{fmt:>5} d={d:<3} warp loads per token and KV head {per_token:6.3}, {:5.1} bytes per load, sector efficiency {:.3}, distinct sectors {} × 32 B for {needed} B of K/V",
                    t.bytes_per_load(),
                    t.efficiency(),
                    t.distinct_sectors
                );
                assert_eq!(
                    t.distinct_sectors as usize * 32,
                    needed,
                    "{fmt} d={d}: {t:?}"
                );
                // F16 rows are whole sectors; KV8's group scales (16 bytes
                // per load at heads of 64) and K5/V4's parameters fill a
                // little less. Byte-sized gathers (K5/V4 read one element at
                // a time: 0.15–0.17) fail here.
                if fmt == "f16" {
                    assert_eq!(t.efficiency(), 1.0, "{fmt} d={d}: {t:?}");
                } else {
                    assert!(t.efficiency() > 0.9, "{fmt} d={d}: {t:?}");
                }
            }
        }
    }

    #[test]
    fn the_default_partition_fills_the_gpu() {
        let most = max_partition_tokens(8, 128);
        // 32k tokens, 8 KV heads, one sequence: 64 partitions of 512 (512 CTAs).
        assert_eq!(auto_partition_tokens(32768, 8, 1, most), 512);
        // MQA: 128-token partitions, the floor (256 CTAs).
        assert_eq!(auto_partition_tokens(32768, 1, 1, most), 128);
        // Eight long sequences already fill it: the longest partition.
        assert_eq!(auto_partition_tokens(32768, 8, 8, most), most);
        // A short context: one partition's worth, in 64-token steps, ≥ 128.
        assert_eq!(auto_partition_tokens(100, 8, 1, most), 128);
        // 4k tokens over 2 KV heads would want 256 partitions of 16: the floor.
        assert_eq!(auto_partition_tokens(4096, 2, 1, most), 128);
        // 16k over 2 KV heads: 256 partitions of 64, rounded up to the floor.
        assert_eq!(auto_partition_tokens(16384, 2, 1, most), 128);
        // 4k over 8 KV heads, 2 sequences: 32 partitions of 128.
        assert_eq!(auto_partition_tokens(4096, 8, 2, most), 128);
        // 32k over 4 KV heads, 2 sequences: 64 partitions of 512.
        assert_eq!(auto_partition_tokens(32768, 4, 2, most), 512);
        // Never past what shared memory holds.
        assert_eq!(auto_partition_tokens(1 << 20, 8, 8, 704), 704);
    }

    #[test]
    fn partitions_are_capped_by_shared_memory() {
        assert_eq!(max_partition_tokens(8, 128), 1024);
        assert_eq!(max_partition_tokens(1, 256), 1024);
        // 8 heads of 256: 8 · (5 · 256 + 704) floats + 16 = 63,552 bytes ≤ 64 KiB.
        assert_eq!(max_partition_tokens(8, 256), 704);
        let k = EmuKernels::emulated();
        let c = Case {
            fmt: "f16",
            kv_heads: 1,
            heads: 8,
            d: 256,
            rotate_k: false,
            tail_tokens: 0,
            lens: &[800],
            partition: 768,
        };
        let layout = KvLayout::preset("f16", 1, 256).unwrap();
        let mut store = KvStore::new(layout, 13, 2).unwrap();
        let mut s = SeqKv::default();
        let kv = vec![0.5f32; 800 * 256];
        store.append(&mut s, &kv, &kv).unwrap();
        let dev = k.upload(&store).unwrap();
        let e = k
            .decode(&dev, &[&s], &vec![0.1; 8 * 256], 8, 0.0625, c.partition)
            .unwrap_err();
        assert!(
            matches!(&e, KernelError::Shape(m) if m.contains("≤ 704")),
            "{e}"
        );
        // The default fits, and so does the largest allowed.
        for partition in [0, 704] {
            let c = Case { partition, ..c };
            assert!(super::decode_difference(&k, &c) < 2e-3);
        }
    }

    #[test]
    fn the_gpu_benchmark_runs_in_the_emulator() {
        // The code `cargo xtask bench kernels --gpu` runs on a GPU, on a small
        // shape: every row is produced, agrees with the CPU kernel and counts
        // every block it reads.
        let formats = ["f16".to_string(), "k5v4".to_string()];
        let shape = BenchShape {
            ctxs: &[70, 130],
            formats: &formats,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            reps: 1,
            partitions: &[64, 0],
            batch: 2,
            block_tokens: 32,
            loads: &[0],
            launches: 1,
        };
        let mut rows = Vec::new();
        bench_decode(&EmuKernels::emulated(), &shape, |r| rows.push(r.clone())).unwrap();
        assert_eq!(rows.len(), 2 * 2 * 2);
        for r in &rows {
            // 0 asked runs the default partition, capped at the context.
            let auto = auto_partition_tokens(r.ctx, 2, 2, max_partition_tokens(2, 64)).min(r.ctx);
            assert!(
                r.partition_tokens == 64 || r.partition_tokens == auto,
                "{r:?}"
            );
            assert!(r.max_diff < 2e-3, "{r:?}");
            assert!(r.seconds > 0.0, "{r:?}");
            let mut layout = KvLayout::preset(&r.format, 2, 64).unwrap();
            layout.block_tokens = r.block_tokens;
            let blocks = r.ctx.div_ceil(32);
            let min = r.batch * blocks * layout.block_bytes().min(layout.tail_block_bytes());
            let max = r.batch * blocks * layout.block_bytes().max(layout.tail_block_bytes());
            assert!(r.kv_bytes >= min && r.kv_bytes <= max, "{r:?}");
        }
        // Its prefill rows (`--gpu --mode prefill`): a chunk of 20 tokens
        // after 70, the two kernels on the same queries.
        let mut rows = Vec::new();
        let shape = BenchShape {
            ctxs: &[70],
            ..shape
        };
        bench_prefill(&EmuKernels::emulated(), &shape, 20, |r| {
            rows.push(r.clone())
        })
        .unwrap();
        assert_eq!(rows.len(), 2);
        for r in &rows {
            assert!(r.max_diff < 2e-5, "{r:?}");
            assert!(r.decode_seconds > 0.0 && r.prefill_seconds > 0.0, "{r:?}");
            assert_eq!(r.partition.1, (r.ctx + 20).div_ceil(r.partition.0), "{r:?}");
        }
    }

    #[test]
    fn the_emulator_runs_every_thread_and_reports_a_deadlock() {
        let k = EmuKernels::emulated();
        let b = k.backend();
        let out = b.zeros(4 * 64).unwrap();
        let launch = Launch {
            grid: (3, 1, 1),
            block: 64,
            shared_bytes: 0,
        };
        // SAFETY: one int per CTA, 3 CTAs, in a buffer of 64.
        unsafe { b.launch("siliceo_emu_test_sum", launch, &[Arg::Buf(&out)]) }.unwrap();
        let sums: Vec<i32> = b
            .download(&out)
            .unwrap()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(
            &sums[..3],
            &[2016, 2016, 2016],
            "0 + 1 + … + 63 in each CTA"
        );
        let one = Launch {
            grid: (1, 1, 1),
            ..launch
        };
        // SAFETY: writes out[t] for t < 64 at most.
        let e =
            unsafe { b.launch("siliceo_emu_test_deadlock", one, &[Arg::Buf(&out)]) }.unwrap_err();
        assert!(
            matches!(&e, KernelError::Cuda(m) if m.contains("deadlock")),
            "{e}"
        );
    }

    #[test]
    fn the_emulator_refuses_what_a_gpu_would_refuse() {
        let k = EmuKernels::emulated();
        let b = k.backend();
        let buf = b.zeros(64).unwrap();
        let launch = Launch {
            grid: (1, 1, 1),
            block: 32,
            shared_bytes: 0,
        };
        // Arguments that do not match the kernel's parameters.
        let args = [Arg::Buf(&buf), Arg::I32(1)];
        // SAFETY: the emulator checks the argument kinds before running anything.
        let e = unsafe { b.launch("siliceo_attn_reduce", launch, &args) }.unwrap_err();
        assert!(
            matches!(&e, KernelError::Cuda(m) if m.contains("do not match")),
            "{e}"
        );
        // A kernel that does not exist.
        // SAFETY: refused before running.
        let e = unsafe { b.launch("siliceo_no_such_kernel", launch, &[]) }.unwrap_err();
        assert!(
            matches!(&e, KernelError::Cuda(m) if m.contains("no kernel")),
            "{e}"
        );
        // More dynamic shared memory than sm_75 gives a CTA.
        let big = Launch {
            shared_bytes: 65 * 1024,
            ..launch
        };
        let args = [
            Arg::Buf(&buf),
            Arg::Buf(&buf),
            Arg::Buf(&buf),
            Arg::Buf(&buf),
            Arg::I32(1),
            Arg::I32(4),
            Arg::I32(1),
            Arg::Ptr(0),
            Arg::Ptr(0),
        ];
        // SAFETY: refused before running.
        let e = unsafe { b.launch("siliceo_attn_reduce", big, &args) }.unwrap_err();
        assert!(
            matches!(&e, KernelError::Cuda(m) if m.contains("64 KiB")),
            "{e}"
        );
    }
}
