//! The kernel benchmark and tuning tool (`cargo xtask bench kernels`).
//!
//! For each KV format, context length, mode (decode: one query token; prefill:
//! a chunk of query tokens at the end of the context) and each combination of
//! the swept parameters (threads, partition size, block size) it times the
//! CPU kernel and the naive reference, and reports the bytes of KV the kernel
//! reads per second against the machine's read bandwidth measured in the
//! same run. With `--gpu` (feature `cuda`) it runs the CUDA kernels instead:
//! decode as above, and prefill as one layer's attention for a chunk of
//! `--chunk` tokens after each context, on the decode kernel a token at a
//! time against the prefill kernel.
//!
//! ```text
//! cargo run --release -p siliceo-kernels-turing --example bench -- \
//!     [--ctx 256,1024,4096,32768] [--formats f16,kv8,k5v4] [--mode decode,prefill]
//!     [--threads 1,2] [--partition 0,32] [--block-size 64] [--sub-tile 64] [--heads 32] [--kv-heads 8]
//!     [--head-dim 128] [--chunk 64] [--reps 5] [--naive-max-ctx 4096] [--gpu [--batch 1,8] [--loads 0,1,2,4,8]]
//!     [--prefetch 0,1,2] [--paired]
//! ```
//!
//! `--paired` (decode only; first partition and sub-tile values) is for a
//! noisy shared machine: every format's KV is filled first, then each rep
//! measures the read bandwidth (256 MiB) and right after it runs every format
//! once, in an order that rotates per rep. Each format's "% of bandwidth" is
//! the median over reps of its rate against *that rep's* bandwidth, and the
//! table says in how many reps each format beat half the bandwidth and F16.
//!
//! `--prefetch` sweeps `AttnParams::prefetch_ahead`: how many KV-head
//! segments ahead the kernel prefetches into L2 (0 = leave it to the hardware).

use std::time::Instant;

use siliceo_kernels_turing::membw::read_bandwidth;
use siliceo_kernels_turing::{
    AttnParams, KvLayout, KvStore, SeqKv, SeqQuery, naive_attention, paged_attention,
};

struct Opts {
    ctx: Vec<usize>,
    formats: Vec<String>,
    modes: Vec<String>,
    threads: Vec<usize>,
    partition: Vec<usize>,
    block: Vec<usize>,
    sub: Vec<usize>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    chunk: usize,
    reps: usize,
    naive_max_ctx: usize,
    gpu: bool,
    batch: Vec<usize>,
    loads: Vec<usize>,
    paired: bool,
    prefetch: Vec<usize>,
}

fn list<T: std::str::FromStr>(s: &str, what: &str) -> Vec<T> {
    s.split(',')
        .map(|x| {
            x.trim()
                .parse()
                .unwrap_or_else(|_| die(&format!("bad {what} `{x}`")))
        })
        .collect()
}

fn die(msg: &str) -> ! {
    eprintln!("bench: {msg}");
    std::process::exit(2)
}

fn parse() -> Opts {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut o = Opts {
        ctx: vec![256, 1024, 4096, 16384, 32768],
        formats: vec!["f16".into(), "kv8".into(), "k5v4".into()],
        modes: vec!["decode".into(), "prefill".into()],
        threads: vec![cpus],
        partition: vec![32],
        block: vec![64],
        sub: vec![64],
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        chunk: 64,
        reps: 5,
        naive_max_ctx: 4096,
        gpu: false,
        batch: vec![1],
        loads: vec![0],
        paired: false,
        prefetch: vec![AttnParams::default().prefetch_ahead],
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .cloned()
                .unwrap_or_else(|| die(&format!("{a} needs a value")))
        };
        match a.as_str() {
            "--ctx" => o.ctx = list(&val(), "context"),
            "--formats" => o.formats = val().split(',').map(str::to_string).collect(),
            "--mode" => o.modes = val().split(',').map(str::to_string).collect(),
            "--threads" => o.threads = list(&val(), "thread count"),
            "--partition" => o.partition = list(&val(), "partition size"),
            "--block-size" => o.block = list(&val(), "block size"),
            "--sub-tile" => o.sub = list(&val(), "sub-tile"),
            "--heads" => o.heads = list(&val(), "heads")[0],
            "--kv-heads" => o.kv_heads = list(&val(), "KV heads")[0],
            "--head-dim" => o.head_dim = list(&val(), "head dimension")[0],
            "--chunk" => o.chunk = list(&val(), "chunk")[0],
            "--reps" => o.reps = list(&val(), "reps")[0],
            "--naive-max-ctx" => o.naive_max_ctx = list(&val(), "context")[0],
            "--gpu" => o.gpu = true,
            "--batch" => o.batch = list(&val(), "batch"),
            "--loads" => o.loads = list(&val(), "loads in flight"),
            "--paired" => o.paired = true,
            "--prefetch" => o.prefetch = list(&val(), "prefetch distance"),
            other => die(&format!("unknown argument `{other}` (see the file's docs)")),
        }
    }
    if o.modes.iter().any(|m| m != "decode" && m != "prefill") {
        die("--mode takes decode and/or prefill");
    }
    o
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Deterministic pseudo-random values in −1..1 (with a few larger channels in K).
fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let x = (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            if i % 29 == 3 { 8.0 + 4.0 * x } else { x }
        })
        .collect()
}

fn main() {
    let o = parse();
    if o.gpu {
        gpu(&o);
        return;
    }
    if o.paired {
        paired(&o);
        return;
    }
    println!(
        "heads {} / KV heads {} / head dim {}; prefill chunk {} tokens; {} reps (median)",
        o.heads, o.kv_heads, o.head_dim, o.chunk, o.reps
    );
    let mut bw = Vec::new();
    for &t in &o.threads {
        eprintln!("measuring memory read bandwidth with {t} thread(s)…");
        let b = read_bandwidth(1 << 30, t, 5);
        println!("memory read bandwidth, {t} thread(s): {:.1} GB/s", b / 1e9);
        bw.push((t, b));
    }
    println!();
    println!(
        "| format | bits/elem | mode | context | threads | partition | sub-tile | prefetch | block | kernel ms | KV read GB/s | % of bandwidth | naive ms | speed-up |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let scale = 1.0 / (o.head_dim as f32).sqrt();
    for fmt in &o.formats {
        for &block in &o.block {
            for &ctx in &o.ctx {
                let (mut layout, name) = layout_of(fmt, &o);
                layout.block_tokens = block;
                if let Err(e) = layout.check() {
                    die(&format!("{fmt}: {e}"));
                }
                eprintln!("{name}: filling {ctx} tokens (block {block})…");
                let (mut store, mut seq, kv_bytes) = fill(layout, ctx, &o);
                for mode in &o.modes {
                    let n_q = if mode == "decode" {
                        1
                    } else {
                        o.chunk.min(ctx)
                    };
                    let q = data(n_q * o.heads * o.head_dim, 99);
                    let mut out = vec![0f32; q.len()];
                    let naive = (ctx <= o.naive_max_ctx).then(|| {
                        let (k, v) = store.read(&seq);
                        let t0 = Instant::now();
                        let r = naive_attention(
                            &q, n_q, o.heads, &k, &v, o.kv_heads, o.head_dim, scale,
                        );
                        let dt = t0.elapsed().as_secs_f64();
                        (dt, r)
                    });
                    for &threads in &o.threads {
                        for (&partition_blocks, &sub_tile, &prefetch_ahead) in
                            o.partition.iter().flat_map(|p| {
                                let pf = &o.prefetch;
                                o.sub
                                    .iter()
                                    .flat_map(move |s| pf.iter().map(move |f| (p, s, f)))
                            })
                        {
                            let p = AttnParams {
                                threads,
                                partition_blocks,
                                sub_tile,
                                prefetch_ahead,
                                ..AttnParams::default()
                            };
                            let qs = [SeqQuery {
                                kv: &seq,
                                q: &q,
                                n_q,
                            }];
                            paged_attention(&store, o.heads, scale, &qs, &mut out, &p).unwrap();
                            if let Some((_, want)) = &naive {
                                let worst = out
                                    .iter()
                                    .zip(want)
                                    .map(|(a, b)| (a - b).abs())
                                    .fold(0f32, f32::max);
                                assert!(
                                    worst < 1e-3,
                                    "{name}: kernel and reference differ by {worst}"
                                );
                            }
                            let times: Vec<f64> = (0..o.reps.max(1))
                                .map(|_| {
                                    let t0 = Instant::now();
                                    paged_attention(&store, o.heads, scale, &qs, &mut out, &p)
                                        .unwrap();
                                    t0.elapsed().as_secs_f64()
                                })
                                .collect();
                            let dt = median(times);
                            let rate = kv_bytes as f64 / dt;
                            let peak = bw
                                .iter()
                                .find(|(t, _)| *t == threads)
                                .map(|b| b.1)
                                .unwrap_or(f64::NAN);
                            let (naive_ms, speedup) = match &naive {
                                Some((n, _)) => {
                                    (format!("{:.2}", n * 1e3), format!("{:.0}×", n / dt))
                                }
                                None => ("—".into(), "—".into()),
                            };
                            println!(
                                "| {name} | {:.2} | {mode} | {ctx} | {threads} | {partition_blocks} | {sub_tile} | {prefetch_ahead} | {block} | {:.3} | {:.2} | {:.0}% | {naive_ms} | {speedup} |",
                                layout.bits_per_element(),
                                dt * 1e3,
                                rate / 1e9,
                                100.0 * rate / peak,
                            );
                        }
                    }
                }
                store.release(&mut seq);
            }
        }
    }
}

/// A store holding one sequence of `ctx` tokens in `layout`, and the bytes
/// of KV it holds (sealed blocks and the F16 tail).
fn fill(layout: KvLayout, ctx: usize, o: &Opts) -> (KvStore, SeqKv, usize) {
    let sealed = ctx.div_ceil(layout.block_tokens);
    let mut store = KvStore::new(layout, sealed, KvStore::tail_blocks_per_seq(&layout))
        .unwrap_or_else(|e| die(&e.to_string()));
    let mut seq = SeqKv::default();
    let row = o.kv_heads * o.head_dim;
    // Fill in chunks so the f32 staging stays small.
    let mut at = 0;
    while at < ctx {
        let n = (ctx - at).min(4096);
        let k = data(n * row, at as u64 + 1);
        let v = data(n * row, at as u64 + 7);
        store
            .append(&mut seq, &k, &v)
            .unwrap_or_else(|e| die(&e.to_string()));
        at += n;
    }
    let kv_bytes =
        seq.sealed.len() * layout.block_bytes() + seq.tail.len() * layout.tail_block_bytes();
    (store, seq, kv_bytes)
}

/// `--paired`: every format timed next to a bandwidth measurement, rep by rep.
fn paired(o: &Opts) {
    let scale = 1.0 / (o.head_dim as f32).sqrt();
    println!(
        "paired decode: heads {} / KV heads {} / head dim {}; {} reps; bandwidth of 256 MiB measured before each rep",
        o.heads, o.kv_heads, o.head_dim, o.reps
    );
    println!();
    println!(
        "| format | bits/elem | context | threads | prefetch | kernel ms (median) | KV read GB/s | % of the rep's bandwidth (median) | min–max % | reps ≥ 50 % | reps faster than F16 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for &ctx in &o.ctx {
        let mut runs = Vec::new();
        for fmt in &o.formats {
            let (mut layout, name) = layout_of(fmt, o);
            layout.block_tokens = o.block[0];
            if let Err(e) = layout.check() {
                die(&format!("{fmt}: {e}"));
            }
            eprintln!("{name}: filling {ctx} tokens…");
            let (store, seq, bytes) = fill(layout, ctx, o);
            runs.push((name, layout, store, seq, bytes));
        }
        let q = data(o.heads * o.head_dim, 99);
        let mut out = vec![0f32; q.len()];
        // (format, prefetch) pairs, each timed once per rep.
        let variants: Vec<(usize, usize)> = (0..runs.len())
            .flat_map(|f| o.prefetch.iter().map(move |p| (f, *p)))
            .collect();
        for &threads in &o.threads {
            // times[v][rep] and the rep's bandwidth.
            let mut times = vec![Vec::new(); variants.len()];
            let mut bws = Vec::new();
            for rep in 0..o.reps.max(1) {
                bws.push(read_bandwidth(256 << 20, threads, 1));
                for i in 0..variants.len() {
                    let v = (i + rep) % variants.len();
                    let (f, prefetch_ahead) = variants[v];
                    let (_, _, store, seq, _) = &runs[f];
                    let p = AttnParams {
                        threads,
                        partition_blocks: o.partition[0],
                        sub_tile: o.sub[0],
                        prefetch_ahead,
                        ..AttnParams::default()
                    };
                    let qs = [SeqQuery {
                        kv: seq,
                        q: &q,
                        n_q: 1,
                    }];
                    let t0 = Instant::now();
                    paged_attention(store, o.heads, scale, &qs, &mut out, &p)
                        .unwrap_or_else(|e| die(&e.to_string()));
                    times[v].push(t0.elapsed().as_secs_f64());
                }
            }
            for (v, &(run, prefetch_ahead)) in variants.iter().enumerate() {
                let (name, layout, _, _, bytes) = &runs[run];
                let f16 = variants
                    .iter()
                    .position(|&(g, pb)| runs[g].0 == "f16" && pb == prefetch_ahead);
                let pct: Vec<f64> = times[v]
                    .iter()
                    .zip(&bws)
                    .map(|(t, b)| 100.0 * *bytes as f64 / t / b)
                    .collect();
                let half = pct.iter().filter(|x| **x >= 50.0).count();
                let faster = match f16 {
                    Some(g) if g != v => format!(
                        "{} / {}",
                        times[v]
                            .iter()
                            .zip(&times[g])
                            .filter(|(a, b)| a < b)
                            .count(),
                        times[v].len()
                    ),
                    _ => "—".into(),
                };
                let (lo, hi) = pct
                    .iter()
                    .fold((f64::INFINITY, 0f64), |(a, b), x| (a.min(*x), b.max(*x)));
                let dt = median(times[v].clone());
                println!(
                    "| {name} | {:.2} | {ctx} | {threads} | {prefetch_ahead} | {:.3} | {:.2} | {:.0}% | {lo:.0}–{hi:.0}% | {half} / {} | {faster} |",
                    layout.bits_per_element(),
                    dt * 1e3,
                    *bytes as f64 / dt / 1e9,
                    median(pct.clone()),
                    pct.len(),
                );
            }
        }
        for (_, _, mut store, mut seq, _) in runs {
            store.release(&mut seq);
        }
    }
}

/// A format name from the command line: a preset (`f16`, `kv8`, `k5v4`), or
/// `K:V` codecs, with optional `+rot` and `+tailN`.
fn layout_of(fmt: &str, o: &Opts) -> (KvLayout, String) {
    let mut parts = fmt.split('+');
    let base = parts.next().unwrap_or("f16");
    let mut l =
        KvLayout::preset(base, o.kv_heads, o.head_dim).unwrap_or_else(|e| die(&e.to_string()));
    for p in parts {
        if p == "rot" {
            l.rotate_k = true;
        } else if let Some(n) = p.strip_prefix("tail") {
            l.tail_tokens = n
                .parse()
                .unwrap_or_else(|_| die(&format!("bad tail `{p}`")));
        } else {
            die(&format!("unknown modifier `+{p}`"));
        }
    }
    (l, fmt.to_string())
}

#[cfg(not(feature = "cuda"))]
fn gpu(_: &Opts) {
    die("--gpu needs the `cuda` feature: cargo xtask bench kernels --gpu");
}

#[cfg(feature = "cuda")]
fn gpu(o: &Opts) {
    if o.modes.iter().any(|m| m == "prefill") {
        // A chunk's attention on the decode kernel against the prefill
        // kernel (one sequence; partitions are the kernels' own choice).
        for &block in &o.block {
            let shape = siliceo_kernels_turing::device::BenchShape {
                ctxs: &o.ctx,
                formats: &o.formats,
                heads: o.heads,
                kv_heads: o.kv_heads,
                head_dim: o.head_dim,
                reps: o.reps,
                partitions: &[0],
                batch: 1,
                block_tokens: block,
                loads: &[0],
                launches: siliceo_kernels_turing::device::LAUNCHES_PER_REP,
            };
            siliceo_kernels_turing::cuda::bench::run_prefill(&shape, o.chunk)
                .unwrap_or_else(|e| die(&e.to_string()));
        }
    }
    if o.modes.iter().any(|m| m == "decode") {
        gpu_decode(o);
    }
}

#[cfg(feature = "cuda")]
fn gpu_decode(o: &Opts) {
    // Partition sizes are in tokens on the GPU: blocks × block size, at most
    // what the decode kernel's shared memory holds (its scores live there);
    // 0 leaves it to the kernels (device::auto_partition_tokens).
    let group = (o.heads / o.kv_heads.max(1)).next_power_of_two();
    let most = siliceo_kernels_turing::device::max_partition_tokens(group, o.head_dim);
    for &block in &o.block {
        let partitions: Vec<usize> = o
            .partition
            .iter()
            .map(|&p| p.min(most / block) * block)
            .collect();
        for &batch in &o.batch {
            let shape = siliceo_kernels_turing::device::BenchShape {
                ctxs: &o.ctx,
                formats: &o.formats,
                heads: o.heads,
                kv_heads: o.kv_heads,
                head_dim: o.head_dim,
                reps: o.reps,
                partitions: &partitions,
                batch,
                block_tokens: block,
                loads: &o.loads,
                launches: siliceo_kernels_turing::device::LAUNCHES_PER_REP,
            };
            siliceo_kernels_turing::cuda::bench::run(&shape)
                .unwrap_or_else(|e| die(&e.to_string()));
        }
    }
}
