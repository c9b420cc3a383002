//! Codecs, the paged store and the CPU kernel against the naive reference.

use siliceo_kernels_turing::{
    AttnParams, Codec, KernelError, KvLayout, KvStore, LayerAttn, SeqKv, SeqQuery,
    naive_attention_layer, paged_attention, paged_attention_layer,
};

/// xorshift64* with Box–Muller normals: deterministic test data.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        let (a, b) = (self.next(), self.next());
        (-2.0 * a.ln()).sqrt() * (std::f32::consts::TAU * b).cos()
    }
}

/// Model-like K: most channels ~N(0,1), a few outlier channels with large
/// offsets and spread (as real keys have); V: plain normals.
fn kv_data(rng: &mut Rng, tokens: usize, heads: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
    let mut k = vec![0f32; tokens * heads * d];
    let mut v = vec![0f32; tokens * heads * d];
    for t in 0..tokens {
        for h in 0..heads {
            for c in 0..d {
                let i = (t * heads + h) * d + c;
                let outlier = c % 29 == 3;
                k[i] = if outlier {
                    12.0 + 4.0 * rng.normal()
                } else {
                    rng.normal()
                };
                v[i] = rng.normal();
            }
        }
    }
    (k, v)
}

const FORMATS: [(Codec, Codec); 5] = [
    (Codec::F16, Codec::F16),
    (Codec::KV8, Codec::KV8),
    (Codec::K5, Codec::V4),
    (Codec::K5, Codec::KV8),
    (Codec::Kv8 { group: 64 }, Codec::V4 { group: 16 }),
];

#[test]
fn codecs_round_trip_within_their_bounds() {
    let mut rng = Rng(7);
    let (t, d) = (64, 64);
    for codec in [
        Codec::F16,
        Codec::KV8,
        Codec::Kv8 { group: 64 },
        Codec::K5,
        Codec::V4,
        Codec::V4 { group: 16 },
    ] {
        codec.check(t, d).unwrap();
        let (x, _) = kv_data(&mut rng, t, 1, d);
        let mut bytes = vec![0u8; codec.segment_bytes(t, d)];
        codec.encode(&x, t, d, &mut bytes);
        let mut y = vec![0f32; t * d];
        codec.decode(&bytes, t, d, &mut y);
        let mut worst = 0f32;
        for r in 0..t {
            for c in 0..d {
                // The group an element was quantized with.
                let grp: Vec<f32> = match codec {
                    Codec::F16 => vec![x[r * d + c]],
                    Codec::Kv8 { group } | Codec::V4 { group } => {
                        let g = group as usize;
                        x[r * d + c / g * g..r * d + (c / g + 1) * g].to_vec()
                    }
                    Codec::K5 => (0..t).map(|rr| x[rr * d + c]).collect(),
                };
                let err = (x[r * d + c] - y[r * d + c]).abs();
                let bound = codec.error_bound(&grp);
                assert!(
                    err <= bound,
                    "{codec:?} [{r}][{c}]: |{} - {}| = {err} > {bound}",
                    x[r * d + c],
                    y[r * d + c]
                );
                worst = worst.max(err / bound.max(1e-12));
            }
        }
        // The bound is tight enough to mean something: some element comes close.
        if codec != Codec::F16 {
            assert!(
                worst > 0.5,
                "{codec:?}: worst error only {worst} of the bound"
            );
        }
    }
    assert_eq!(Codec::F16.bits_per_element(64, 128), 16.0);
    assert_eq!(Codec::KV8.bits_per_element(64, 128), 8.5);
    assert_eq!(Codec::K5.bits_per_element(64, 128), 5.5);
    assert_eq!(Codec::V4.bits_per_element(64, 128), 5.0);
}

#[test]
fn kv8_groups_of_32_beat_one_scale_per_head_on_outlier_keys() {
    let mut rng = Rng(11);
    let (t, d) = (64, 128);
    let (x, _) = kv_data(&mut rng, t, 1, d);
    let mse = |codec: Codec| {
        let mut bytes = vec![0u8; codec.segment_bytes(t, d)];
        codec.encode(&x, t, d, &mut bytes);
        let mut y = vec![0f32; t * d];
        codec.decode(&bytes, t, d, &mut y);
        x.iter()
            .zip(&y)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f32>()
            / x.len() as f32
    };
    let (g32, head) = (mse(Codec::KV8), mse(Codec::Kv8 { group: 128 }));
    assert!(g32 < head * 0.8, "group 32 MSE {g32} vs per head {head}");
}

#[test]
fn codec_parse_and_layout_errors_are_typed() {
    assert_eq!(Codec::parse("kv8", 64).unwrap(), Codec::KV8);
    assert_eq!(
        Codec::parse("kv8/head", 64).unwrap(),
        Codec::Kv8 { group: 64 }
    );
    assert_eq!(Codec::parse("v4/16", 64).unwrap(), Codec::V4 { group: 16 });
    assert!(matches!(
        Codec::parse("q3", 64),
        Err(KernelError::Layout(_))
    ));
    assert!(matches!(
        Codec::Kv8 { group: 48 }.check(64, 64),
        Err(KernelError::Layout(_))
    ));
    let mut l = KvLayout::new(2, 96, Codec::F16, Codec::F16);
    l.check().unwrap();
    l.rotate_k = true;
    assert!(
        matches!(l.check(), Err(KernelError::Layout(_))),
        "rotation needs a power of two"
    );
    assert!(matches!(
        KvStore::new(KvLayout::new(2, 12, Codec::F16, Codec::F16), 1, 1),
        Err(KernelError::Layout(_))
    ));
    let l = KvLayout::preset("k5v4", 8, 128).unwrap();
    assert_eq!(l.bits_per_element(), 5.25);
    assert_eq!(l.bytes_per_token(), 8.0 * 2.0 * 128.0 * 5.25 / 8.0);
}

#[test]
fn the_store_seals_aged_blocks_keeps_a_tail_and_frees_everything() {
    let mut rng = Rng(3);
    let (heads, d) = (2, 64);
    let mut layout = KvLayout::preset("k5v4", heads, d).unwrap();
    layout.tail_tokens = 100;
    let tail_cap = KvStore::tail_blocks_per_seq(&layout);
    assert_eq!(tail_cap, 3);
    let mut store = KvStore::new(layout, 10, tail_cap).unwrap();
    let mut seq = SeqKv::default();
    let (k, v) = kv_data(&mut rng, 400, heads, d);
    // Appending in uneven chunks.
    let row = heads * d;
    let mut at = 0;
    for n in [1, 63, 100, 7, 129, 100] {
        store
            .append(
                &mut seq,
                &k[at * row..(at + n) * row],
                &v[at * row..(at + n) * row],
            )
            .unwrap();
        at += n;
        let tail_tokens = seq.len - seq.sealed.len() * 64;
        assert!(
            tail_tokens >= layout.tail_tokens.min(seq.len) && tail_tokens < layout.tail_tokens + 64,
            "{tail_tokens}"
        );
        assert_eq!(seq.blocks(), seq.len.div_ceil(64));
    }
    assert_eq!(seq.len, 400);
    assert_eq!(seq.sealed.len(), 4); // 400 - 4·64 = 144 in the tail (≥ 100, < 164)
    // The tail reads back as f16; sealed blocks within the codec's bounds.
    let (rk, rv) = store.read(&seq);
    for i in 256 * row..400 * row {
        assert_eq!(rk[i], half::f16::from_f32(k[i]).to_f32());
        assert_eq!(rv[i], half::f16::from_f32(v[i]).to_f32());
    }
    let max_err = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    assert!(
        max_err(&k[..256 * row], &rk[..256 * row]) < 0.6,
        "K5 error on ±20 keys"
    );
    assert!(
        max_err(&v[..256 * row], &rv[..256 * row]) < 0.5,
        "V4 error on normals"
    );
    // Full: nothing is written, the sequence is unchanged.
    let before = seq.clone();
    let (k2, v2) = kv_data(&mut rng, 7 * 64, heads, d);
    let err = store.append(&mut seq, &k2, &v2).unwrap_err();
    assert!(matches!(err, KernelError::OutOfBlocks { .. }), "{err}");
    assert_eq!(seq, before);
    assert!(matches!(
        store.append(&mut seq, &k2[..5], &v2[..5]),
        Err(KernelError::Shape(_))
    ));
    store.release(&mut seq);
    assert_eq!(store.free_blocks(), store.capacity());
    assert_eq!(seq, SeqKv::default());
}

fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "{what}: [{i}] {x} vs {y}"
        );
    }
}

/// Random queries: `n_qs[i]` tokens of `row` values for sequence i.
fn random_queries(rng: &mut Rng, n_qs: &[usize], row: usize) -> Vec<Vec<f32>> {
    n_qs.iter()
        .map(|&n| (0..n * row).map(|_| rng.normal()).collect())
        .collect()
}

/// The kernel's view of each sequence with its queries.
fn seq_queries<'a>(seqs: &'a [SeqKv], qs: &'a [Vec<f32>], n_qs: &[usize]) -> Vec<SeqQuery<'a>> {
    seqs.iter()
        .zip(qs)
        .zip(n_qs)
        .map(|((kv, q), &n_q)| SeqQuery { kv, q, n_q })
        .collect()
}

/// Runs the kernel for several sequences (decode and prefill chunks) under
/// several thread/partition settings; checks it against the naive attention
/// over what the store holds (so only the kernel's arithmetic is tested), and
/// returns the relative RMS error against attention over the original values.
fn check_layout(layout: KvLayout, seed: u64) -> f32 {
    check_layout_masked(layout, seed, 0, false)
}

/// [`check_layout`] for a layer with a sliding `window` (0 = none) and,
/// with `sinks`, an attention sink per query head.
fn check_layout_masked(layout: KvLayout, seed: u64, window: usize, sinks: bool) -> f32 {
    let mut rng = Rng(seed);
    let (heads, d) = (layout.kv_heads, layout.head_dim);
    let n_heads = heads * 3;
    let sink_logits: Vec<f32> = (0..n_heads).map(|h| h as f32 - 1.5).collect();
    let attn = LayerAttn {
        scale: 1.0 / (d as f32).sqrt(),
        window,
        sinks: sinks.then_some(&sink_logits[..]),
    };
    let lens = [1usize, 64, 65, 300, 777];
    let n_qs = [1usize, 1, 5, 1, 70];
    let tail = KvStore::tail_blocks_per_seq(&layout);
    let sealed: usize = lens.iter().map(|l| l.div_ceil(layout.block_tokens)).sum();
    let mut store = KvStore::new(layout, sealed, tail * lens.len()).unwrap();
    let originals: Vec<(Vec<f32>, Vec<f32>)> = lens
        .iter()
        .map(|&len| kv_data(&mut rng, len, heads, d))
        .collect();
    // Appended round-robin, 37 tokens at a time: every sequence's blocks are
    // scattered over the pools, so only its block table finds them.
    let mut seqs = vec![SeqKv::default(); lens.len()];
    let row = heads * d;
    for start in (0..*lens.iter().max().unwrap()).step_by(37) {
        for ((s, (k, v)), &len) in seqs.iter_mut().zip(&originals).zip(&lens) {
            if start < len {
                let span = start * row..(start + 37).min(len) * row;
                store.append(s, &k[span.clone()], &v[span]).unwrap();
            }
        }
    }
    let qs = random_queries(&mut rng, &n_qs, n_heads * d);
    let queries = seq_queries(&seqs, &qs, &n_qs);
    let mut want_stored = Vec::new();
    let mut want_orig = Vec::new();
    for ((s, q), ((k, v), &n_q)) in seqs.iter().zip(&qs).zip(originals.iter().zip(&n_qs)) {
        let (rk, rv) = store.read(s);
        want_stored.extend(naive_attention_layer(
            q, n_q, n_heads, &rk, &rv, heads, d, &attn,
        ));
        want_orig.extend(naive_attention_layer(
            q, n_q, n_heads, k, v, heads, d, &attn,
        ));
    }
    let mut first: Option<Vec<f32>> = None;
    for (threads, partition_blocks, sub_tile) in [(1, 0, 0), (3, 0, 16), (2, 1, 5), (4, 3, 64)] {
        let mut out = vec![0f32; want_stored.len()];
        paged_attention_layer(
            &store,
            n_heads,
            &attn,
            &queries,
            &mut out,
            &AttnParams {
                threads,
                partition_blocks,
                sub_tile,
                prefetch_ahead: [0, 1, 3][threads % 3],
                ..AttnParams::default()
            },
        )
        .unwrap();
        // Rotation goes through f32 Hadamard transforms on both sides, so it may
        // differ from the reference by a little more rounding.
        // K5 keys of heads of 128 or 256 go through 16-bit integer dot
        // products (the query times the channel scales rounded to 2⁻¹⁶ of
        // its row's largest element; see `simd`), a little more again.
        // V4 values read in place go through 16-bit integer dot products too
        // (each sub-tile's weights times the token scales rounded to 2⁻¹⁶ of
        // their largest), so sub-tiles and partitions round differently.
        let v4_words = matches!(layout.v, Codec::V4 { group } if group % 16 == 0);
        // KV8 keys in groups of 32 take 16-bit integer products too (x86):
        // over a short window few scores average their rounding out.
        let masked_words = (window > 0 || sinks) && layout.k != Codec::F16;
        let tol = if (layout.k == Codec::K5 && d.is_multiple_of(128)) || v4_words || masked_words {
            2e-3
        } else if layout.rotate_k {
            2e-4
        } else {
            5e-5
        };
        close(
            &out,
            &want_stored,
            tol,
            &format!(
                "{} window={window} sinks={sinks} threads={threads} part={partition_blocks} \
                 sub={sub_tile}",
                layout.name()
            ),
        );
        match &first {
            None => first = Some(out),
            Some(f) => close(
                &out,
                f,
                if v4_words { tol } else { 1e-5 },
                "thread/partition settings agree",
            ),
        }
    }
    let out = first.unwrap();
    let num: f32 = out
        .iter()
        .zip(&want_orig)
        .map(|(a, b)| (a - b) * (a - b))
        .sum();
    let den: f32 = want_orig.iter().map(|b| b * b).sum();
    for mut s in seqs {
        store.release(&mut s);
    }
    assert_eq!(store.free_blocks(), store.capacity());
    (num / den).sqrt()
}

#[test]
fn the_kernel_matches_naive_attention_in_every_format() {
    let mut errors = std::collections::HashMap::new();
    for (i, (k, v)) in FORMATS.into_iter().enumerate() {
        for (rotate_k, tail_tokens) in [(false, 0), (true, 0), (false, 128)] {
            let mut layout = KvLayout::new(2, 64, k, v);
            layout.rotate_k = rotate_k;
            layout.tail_tokens = tail_tokens;
            let err = check_layout(layout, 100 + i as u64);
            eprintln!(
                "{}: relative RMS error of the output {err:.5}",
                layout.name()
            );
            // Documented output error against attention over the original
            // values (model-like keys with outlier channels).
            let bound = match (k, v) {
                (Codec::F16, Codec::F16) => 2e-3,
                (Codec::Kv8 { .. }, Codec::Kv8 { .. }) => 3e-2,
                _ => 0.1,
            };
            assert!(
                err < bound,
                "{}: relative RMS error {err} >= {bound}",
                layout.name()
            );
            errors.insert(layout.name(), err);
        }
    }
    // Rotation spreads the outlier channels: KV8's error on model-like keys drops.
    assert!(
        errors["kv8/32:kv8/32+rot"] < 0.75 * errors["kv8/32:kv8/32"],
        "{errors:?}"
    );
    // The F16 tail holds the recent tokens at full precision: less error.
    assert!(
        errors["k5:v4/32+tail128"] < errors["k5:v4/32"],
        "{errors:?}"
    );
}

/// Runs `test` of this binary again in a child process with `env` set (the
/// kernels choose their code paths once per process) and checks it passed.
fn run_again_with(env: &str, test: &str) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--test-threads=1", "--nocapture"])
        .env(env, "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "the check did not run: {text}");
}

/// The same check with the explicit x86 loops switched off: the portable
/// loops (what other architectures run) read every format too.
#[test]
fn the_portable_loops_match_naive_attention_too() {
    if std::env::var_os("SILICEO_KERNELS_PORTABLE").is_some() {
        return;
    }
    run_again_with(
        "SILICEO_KERNELS_PORTABLE",
        "the_kernel_matches_naive_attention_in_every_format",
    );
}

/// Heads of 128 with AVX-512 switched off: the AVX2 K5 kernel (what
/// machines without AVX-512 VNNI run) is checked even where AVX-512 exists.
#[test]
fn the_avx2_loops_match_naive_attention_too() {
    if std::env::var_os("SILICEO_KERNELS_NO_AVX512").is_some() {
        return;
    }
    run_again_with(
        "SILICEO_KERNELS_NO_AVX512",
        "wide_heads_match_naive_attention",
    );
}

/// Heads of 128 (most models), 256 and 512 (Gemma 4's global layers): K5
/// keys take the integer path, V4 values are read in place; the output
/// error against the original values stays that of the format.
#[test]
fn wide_heads_match_naive_attention() {
    for d in [128, 256, 512] {
        for (name, bound) in [("k5v4", 0.1), ("f16", 2e-3), ("kv8", 3e-2)] {
            let layout = KvLayout::preset(name, 2, d).unwrap();
            let err = check_layout(layout, 7);
            eprintln!("{name} d={d}: relative RMS error of the output {err:.5}");
            assert!(err < bound, "{name} d={d}: {err}");
        }
    }
}

/// Sliding windows (inside a sub-tile, a block, several blocks, wider than
/// the context) and attention sinks: every format, decode and prefill
/// chunks, against the naive reference over what the store holds.
#[test]
fn windows_and_sinks_match_naive_attention() {
    for (i, (name, tail_tokens)) in [("f16", 0), ("kv8", 0), ("k5v4", 64)]
        .into_iter()
        .enumerate()
    {
        for d in [64, 128] {
            let mut layout = KvLayout::preset(name, 2, d).unwrap();
            layout.tail_tokens = tail_tokens;
            for (window, sinks) in [
                (1, false),
                (5, true),
                (64, false),
                (100, true),
                (1000, false),
            ] {
                let err = check_layout_masked(layout, 50 + i as u64, window, sinks);
                let bound = if name == "f16" { 2e-3 } else { 0.1 };
                assert!(err < bound, "{name} d={d} window={window}: {err}");
            }
            check_layout_masked(layout, 60 + i as u64, 0, true);
        }
    }
}

#[test]
fn block_size_is_a_parameter() {
    for t in [16, 32, 128] {
        let mut layout = KvLayout::preset("k5v4", 1, 32).unwrap();
        layout.block_tokens = t;
        check_layout(layout, t as u64);
    }
}

#[test]
fn bad_shapes_are_typed_errors() {
    let layout = KvLayout::preset("f16", 2, 64).unwrap();
    let mut store = KvStore::new(layout, 4, 4).unwrap();
    let mut s = SeqKv::default();
    store
        .append(&mut s, &[0.5; 3 * 128], &[0.5; 3 * 128])
        .unwrap();
    let q = vec![0.0; 4 * 64];
    let mut out = vec![0.0; 4 * 64];
    let p = AttnParams::default();
    // No sequences: nothing to do, with any number of threads.
    for threads in [1, 4] {
        let p = AttnParams { threads, ..p };
        assert_eq!(paged_attention(&store, 4, 1.0, &[], &mut [], &p), Ok(()));
    }
    let run = |n_heads, n_q, q: &[f32], out: &mut [f32]| {
        paged_attention(
            &store,
            n_heads,
            1.0,
            &[SeqQuery { kv: &s, q, n_q }],
            out,
            &p,
        )
    };
    assert!(matches!(
        run(3, 1, &q[..3 * 64], &mut out[..3 * 64]),
        Err(KernelError::Shape(_))
    ));
    assert!(
        matches!(run(4, 4, &q, &mut out), Err(KernelError::Shape(_))),
        "more queries than tokens"
    );
    assert!(matches!(
        run(4, 1, &q[..64], &mut out),
        Err(KernelError::Shape(_))
    ));
    assert!(matches!(
        run(4, 1, &q, &mut out[..64]),
        Err(KernelError::Shape(_))
    ));
    run(4, 1, &q, &mut out).unwrap();
    // Uniform V ⇒ output 0.5 whatever the weights.
    assert!(out.iter().all(|x| (x - 0.5).abs() < 1e-6));
}

/// With several threads a short context's KV heads (and, where there are few,
/// a prefill chunk's query tokens) are split over work items, so a prefill
/// chunk over one partition still uses every thread; without partitions that
/// only changes who computes which rows, never a value.
#[test]
fn splitting_work_over_threads_changes_no_value() {
    let mut rng = Rng(29);
    for (name, kv_heads, n_heads) in [
        ("f16", 8, 32),
        ("kv8", 8, 32),
        ("k5v4", 8, 32),
        ("k5v4", 2, 12),
        ("f16", 1, 8),
    ] {
        let layout = KvLayout::preset(name, kv_heads, 128).unwrap();
        let lens = [40usize, 200, 130];
        let n_qs = [40usize, 1, 17];
        let tail = KvStore::tail_blocks_per_seq(&layout);
        let sealed: usize = lens.iter().map(|l| l.div_ceil(64)).sum();
        let mut store = KvStore::new(layout, sealed, tail * lens.len()).unwrap();
        let mut seqs = Vec::new();
        for &len in &lens {
            let (k, v) = kv_data(&mut rng, len, kv_heads, 128);
            let mut s = SeqKv::default();
            store.append(&mut s, &k, &v).unwrap();
            seqs.push(s);
        }
        let qs = random_queries(&mut rng, &n_qs, n_heads * 128);
        let queries = seq_queries(&seqs, &qs, &n_qs);
        let total: usize = qs.iter().map(Vec::len).sum();
        let run = |threads| {
            let mut out = vec![0f32; total];
            let params = AttnParams {
                threads,
                partition_blocks: 0,
                ..AttnParams::default()
            };
            paged_attention(&store, n_heads, 0.09, &queries, &mut out, &params).unwrap();
            out
        };
        let one = run(1);
        assert!(one.iter().all(|x| x.is_finite()) && one.iter().any(|x| *x != 0.0));
        for threads in [2, 3, 5, 16] {
            assert!(
                run(threads) == one,
                "{name} {kv_heads}/{n_heads} heads: {threads} threads"
            );
        }
        for mut s in seqs {
            store.release(&mut s);
        }
    }
}

/// The design's batch invariance, in the kernel: a query's output is the
/// same bit for bit whether it runs alone (decode over what it sees), in a
/// decode batch of many sequences, or as one token of a prefill chunk (served
/// several query tokens per kernel call), with any thread count.
#[test]
fn a_query_gives_the_same_bits_alone_in_a_batch_and_in_a_chunk() {
    same_bits_alone_batched_and_chunked(0, false);
}

/// The same with sliding windows (one that cuts sub-tiles and the causal
/// diagonal, one of a block and a half) and attention sinks.
#[test]
fn a_windowed_query_gives_the_same_bits_alone_in_a_batch_and_in_a_chunk() {
    same_bits_alone_batched_and_chunked(7, true);
    same_bits_alone_batched_and_chunked(96, false);
}

fn same_bits_alone_batched_and_chunked(window: usize, sinks: bool) {
    let mut rng = Rng(41);
    for (name, kv_heads, n_heads, d) in [
        ("f16", 3, 9, 64),
        ("kv8", 3, 9, 64),
        ("k5v4", 3, 9, 64),
        ("kv8", 2, 12, 128),
        ("k5v4", 2, 14, 128),
        ("f16", 8, 32, 128),
        ("kv8/64:v4/16", 1, 5, 64),
    ] {
        let layout = KvLayout::preset(name, kv_heads, d).unwrap();
        // 230 tokens, the last 100 a chunk: its queries cross a block
        // boundary and the sub-tiles' causal diagonals.
        let (len, n_q) = (230usize, 100);
        let tail = KvStore::tail_blocks_per_seq(&layout);
        let mut store = KvStore::new(layout, len.div_ceil(64), tail).unwrap();
        let (k, v) = kv_data(&mut rng, len, kv_heads, d);
        let mut seq = SeqKv::default();
        store.append(&mut seq, &k, &v).unwrap();
        let row = n_heads * d;
        let q: Vec<f32> = (0..n_q * row).map(|_| rng.normal()).collect();
        let params = |threads| AttnParams {
            threads,
            // Partitions of 2 blocks: a window leaves the early ones out.
            partition_blocks: 2,
            ..AttnParams::default()
        };
        let sink_logits: Vec<f32> = (0..n_heads).map(|h| 0.5 * h as f32 - 2.0).collect();
        let attn = LayerAttn {
            scale: 0.11,
            window,
            sinks: sinks.then_some(&sink_logits[..]),
        };
        let attention = |queries: &[SeqQuery<'_>], out: &mut [f32], threads| {
            paged_attention_layer(&store, n_heads, &attn, queries, out, &params(threads)).unwrap()
        };
        let mut chunk = vec![0f32; n_q * row];
        let one = [SeqQuery {
            kv: &seq,
            q: &q,
            n_q,
        }];
        attention(&one, &mut chunk, 1);
        assert!(chunk.iter().all(|x| x.is_finite()) && chunk.iter().any(|x| *x != 0.0));
        let mut two = vec![0f32; n_q * row];
        attention(&one, &mut two, 2);
        assert!(two == chunk, "{name}: a chunk on 2 threads");
        let views: Vec<SeqKv> = (0..n_q)
            .map(|i| seq.prefix(len - n_q + i + 1, 64).unwrap())
            .collect();
        let decodes: Vec<SeqQuery<'_>> = views
            .iter()
            .zip(q.chunks_exact(row))
            .map(|(kv, q)| SeqQuery { kv, q, n_q: 1 })
            .collect();
        for (i, query) in decodes.iter().enumerate() {
            let mut alone = vec![0f32; row];
            attention(&[*query], &mut alone, 1);
            assert!(
                alone[..] == chunk[i * row..(i + 1) * row],
                "{name} {kv_heads}/{n_heads}×{d}: query {i} alone"
            );
        }
        let mut batch = vec![0f32; n_q * row];
        attention(&decodes, &mut batch, 2);
        assert!(batch == chunk, "{name}: a decode batch");
        store.release(&mut seq);
    }
}

/// A shared tail block behaves as an own one while lent: the same writes,
/// seal and row copies give the same bytes, and attention over it reads
/// it; taken back, the pages hold none.
#[test]
fn shared_tail_blocks_act_as_the_pages_own_while_lent() {
    use siliceo_kernels_turing::{KvPages, SharedTail};
    let layout = KvLayout::new(2, 64, Codec::KV8, Codec::KV8);
    let (t, row) = (layout.block_tokens, 2 * 64);
    let mut rng = Rng(7);
    let (k, v) = kv_data(&mut rng, t, 2, 64);
    // Own: tail blocks 0..3; shared: one block, id 3 while lent.
    let mut a = KvPages::new(layout, 2, 4).unwrap();
    let mut b = KvPages::new(layout, 2, 3).unwrap();
    let mut shared = SharedTail::new(&layout, 1);
    assert_eq!(shared.blocks(), 1);
    b.swap_shared(&mut shared);
    assert_eq!((b.shared_blocks(), shared.blocks()), (1, 0));
    for pages in [&mut a, &mut b] {
        for r in 0..t {
            pages.write_token(3, r, &k[r * row..(r + 1) * row], &v[r * row..(r + 1) * row]);
        }
        // Rows across the own/shared boundary, both ways.
        pages.copy_tail_rows(3, 1, 5..17);
        pages.copy_tail_rows(1, 3, 5..9);
        pages.seal(3, 0);
    }
    assert_eq!(a.tail_block(3), b.tail_block(3));
    assert_eq!(a.tail_block(1), b.tail_block(1));
    assert_eq!(a.sealed_block(0), b.sealed_block(0));
    let seq = SeqKv {
        sealed: Vec::new(),
        tail: vec![3],
        len: t,
    };
    let q: Vec<f32> = (0..4 * 64).map(|_| rng.normal()).collect();
    let query = [SeqQuery {
        kv: &seq,
        q: &q,
        n_q: 1,
    }];
    let (mut oa, mut ob) = (vec![0f32; 4 * 64], vec![0f32; 4 * 64]);
    let p = AttnParams::default();
    paged_attention(&a, 4, 0.125, &query, &mut oa, &p).unwrap();
    paged_attention(&b, 4, 0.125, &query, &mut ob, &p).unwrap();
    assert_eq!(oa, ob);
    b.swap_shared(&mut shared);
    assert_eq!((b.shared_blocks(), shared.blocks()), (0, 1));
    assert_eq!(b.byte_len() + shared.byte_len(), a.byte_len());
}
