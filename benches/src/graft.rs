//! `siliceo-bench graft`: decode speed of the serving runtime with KV in
//! llama.cpp's own cache (f16, q8_0, q5_1/q4_0) and in our store through
//! grafted attention (f16, kv8, k5v4+tail64), at 1, 8 and 16 streams over a
//! shared context of 512, 4k and 16k tokens, and how many 2k-token
//! sequences a fixed KV budget holds.
//!
//! Each configuration gets a fresh runtime; the context is a prefix computed
//! once (its prefill speed is reported) and cached, then each stream adds 8
//! tokens of its own and generates 32. Figures are medians of `--reps` runs.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Result, bail};
use siliceo_core::{KvType, SamplingParams, TokenId};
use siliceo_engine::{KvFormat, Model, ModelOptions};
use siliceo_runtime::{
    Event, GenerateRequest, Input, KvBackend, Runtime, RuntimeConfig, StoreSize,
};

use crate::median;

/// One KV configuration of a run.
#[derive(Debug, Clone)]
struct Kv {
    label: String,
    backend: KvBackend,
    k: KvType,
    v: KvType,
}

fn llama(k: KvType, v: KvType) -> Kv {
    Kv {
        label: format!("llama.cpp {k}/{v}"),
        backend: KvBackend::Llama,
        k,
        v,
    }
}

fn ours(format: &str, kernel_threads: Option<usize>) -> Kv {
    let f = KvFormat::parse(format).expect("a valid format");
    Kv {
        label: match kernel_threads {
            Some(t) => format!("ours {} (kernel threads {t})", f.name()),
            None => format!("ours {}", f.name()),
        },
        backend: KvBackend::Ours {
            format: f,
            size: None,
            kernel_threads,
        },
        k: KvType::F16,
        v: KvType::F16,
    }
}

const SUFFIX: usize = 8;
const GEN: u32 = 32;

fn greedy(tokens: Vec<TokenId>, n: u32) -> GenerateRequest {
    GenerateRequest {
        sampling: SamplingParams {
            max_tokens: n,
            ignore_eos: true,
            ..SamplingParams::greedy()
        },
        ..GenerateRequest::new(Input::Tokens(tokens))
    }
}

/// A context of `len` tokens of ordinary prose, and per stream a suffix.
fn context_tokens(model: &Model, len: usize) -> Result<Vec<TokenId>> {
    let text = " The committee met again on Thursday to review the harbour accounts, \
        the repairs to the north pier, the new timetable for the ferries and the letters \
        the town had received about the market square.";
    let piece = model.tokenize(text, false)?;
    let mut t = model.tokenize("Minutes of the harbour committee.", true)?;
    while t.len() < len {
        t.extend(&piece);
    }
    t.truncate(len);
    Ok(t)
}

struct Row {
    prefill_tps: f64,
    decode: Vec<f64>,
}

fn run_config(
    b: &GraftBench,
    model_path: &Path,
    model: &Model,
    kv: &Kv,
    ctx_len: usize,
    streams: &[usize],
    deterministic: bool,
) -> Result<Row> {
    let (reps, threads) = (b.reps, b.threads);
    let max_streams = streams.iter().copied().max().unwrap_or(1);
    let mut cfg = RuntimeConfig::new(model_path);
    cfg.kv = kv.backend.clone();
    cfg.model.deterministic = deterministic;
    cfg.model.gpu_layers = b.gpu_layers;
    let tokens = ctx_len + max_streams * (SUFFIX + GEN as usize + 64) + 256;
    cfg.context.n_ctx = tokens.next_multiple_of(256) as u32;
    cfg.context.type_k = kv.k;
    cfg.context.type_v = kv.v;
    cfg.context.n_threads = Some(threads);
    cfg.context.n_threads_batch = Some(threads);
    cfg.context.n_batch = 512;
    cfg.context.n_ubatch = 512;
    cfg.scheduler.max_batch_tokens = 512;
    cfg.scheduler.max_running_seqs = max_streams;
    cfg.scheduler.max_seq_len = usize::MAX;
    cfg.prefix_holders = 32;
    if let KvBackend::Ours { size, .. } = &mut cfg.kv {
        *size = Some(StoreSize::Tokens(tokens as u64));
    }
    let rt = Runtime::start(cfg)?;
    let prefix = context_tokens(model, ctx_len)?;
    // The shared context, computed once (and cached).
    let t = Instant::now();
    let (_, _, done) = rt.submit(greedy(prefix.clone(), 1))?.blocking_collect();
    check(&done)?;
    let prefill_tps = ctx_len as f64 / t.elapsed().as_secs_f64();
    let mut decode = Vec::new();
    for (si, &n) in streams.iter().enumerate() {
        let mut rates = Vec::new();
        for rep in 0..reps {
            let subs = (0..n)
                .map(|i| {
                    let mut p = prefix.clone();
                    // A suffix of its own per stream, run and rep.
                    let salt = (si * 1000 + rep * 100 + i) as u32;
                    p.extend((0..SUFFIX as u32).map(|k| TokenId(1000 + (salt * 7 + k) % 20_000)));
                    Ok(rt.submit(greedy(p, GEN))?)
                })
                .collect::<Result<Vec<_>>>()?;
            let mut generated = 0u64;
            let mut window_ms = 0u64;
            for s in subs {
                let (_, _, done) = s.blocking_collect();
                let u = check(&done)?;
                generated += u64::from(u.completion_tokens.saturating_sub(1));
                window_ms = window_ms.max(u.decode_ms);
            }
            rates.push(generated as f64 * 1000.0 / window_ms.max(1) as f64);
        }
        decode.push(median(rates));
    }
    Ok(Row {
        prefill_tps,
        decode,
    })
}

fn check(done: &Event) -> Result<siliceo_runtime::Usage> {
    match done {
        Event::Done {
            usage, error: None, ..
        } => Ok(*usage),
        Event::Done { error: Some(e), .. } => bail!("request failed: {e}"),
        _ => bail!("no Done event"),
    }
}

/// Options of `siliceo-bench graft`.
#[derive(Debug, Clone)]
pub struct GraftBench {
    /// Models: the default (SmolLM2) and, if present, Qwen2.5-Coder-1.5B.
    pub models: Vec<PathBuf>,
    /// Median of this many runs.
    pub reps: usize,
    /// Threads for llama.cpp (2: the CI machine's cores).
    pub threads: u32,
    /// Fewer contexts and configurations.
    pub quick: bool,
    /// Only these contexts (all when empty).
    pub contexts: Vec<usize>,
    /// Only the configurations whose label contains one of these (all when
    /// empty), to finish a partial run.
    pub only: Vec<String>,
    /// Layers offloaded to the GPU (a CUDA build); 0: all on the CPU.
    pub gpu_layers: u32,
    /// Streams per decode figure (default 1, 8, 16).
    pub streams: Vec<usize>,
}

/// Runs the comparison and prints markdown tables.
pub fn graft(b: &GraftBench) -> Result<()> {
    let streams = if b.streams.is_empty() {
        vec![1usize, 8, 16]
    } else {
        b.streams.clone()
    };
    for path in &b.models {
        let model = Model::load(
            path,
            &ModelOptions {
                gpu_layers: b.gpu_layers,
                ..ModelOptions::default()
            },
        )?;
        let small = model.geometry().n_embd < 1024;
        let mut contexts: Vec<usize> = match (b.quick, small) {
            (true, _) => vec![512, 4096],
            (false, true) => vec![512, 4096, 16384],
            (false, false) => vec![512, 4096],
        };
        if !b.contexts.is_empty() {
            contexts.clone_from(&b.contexts);
        }
        let mut configs = vec![
            llama(KvType::F16, KvType::F16),
            llama(KvType::Q8_0, KvType::Q8_0),
            llama(KvType::Q5_1, KvType::Q4_0),
            ours("f16", None),
            ours("kv8", None),
            ours("k5v4+tail64", None),
        ];
        if !b.quick {
            configs.push(ours("kv8", Some(1)));
        }
        if !b.only.is_empty() {
            configs.retain(|kv| b.only.iter().any(|o| kv.label.contains(o.as_str())));
        }
        // K-quant models: batch-invariant products cost speed; measured too.
        let k_quant = !small;
        println!();
        println!(
            "### {} · {} threads{} · median of {} · {SUFFIX}-token suffixes, {GEN} generated per stream",
            model.name(),
            b.threads,
            // What llama.cpp really offloads: none without a GPU backend.
            match (b.gpu_layers, model.offloaded_layers().len()) {
                (0, _) => String::new(),
                (asked, 0) =>
                    format!(" · --gpu-layers {asked}, but no GPU: every layer on the CPU"),
                (_, n) => format!(" · {n} of {} layers on the GPU", model.geometry().n_layer),
            },
            b.reps
        );
        println!();
        let cols: Vec<String> = streams
            .iter()
            .map(|n| format!("{n} stream{}", if *n == 1 { "" } else { "s" }))
            .collect();
        println!(
            "| context | KV | prefill tok/s | decode tok/s, {} |",
            cols.join(" | ")
        );
        println!("|---:|---|---:|{}", "---:|".repeat(streams.len()));
        let print = |ctx: usize, label: &str, row: Result<Row>| match row {
            Ok(row) => {
                let d: Vec<String> = row.decode.iter().map(|r| format!("{r:.1}")).collect();
                println!(
                    "| {ctx} | {label} | {:.0} | {} |",
                    row.prefill_tps,
                    d.join(" | ")
                );
            }
            // A configuration this build cannot serve (our store with
            // offloaded layers) is a row that says so, not the end of the run.
            Err(e) => println!(
                "| {ctx} | {label} | refused: {e} |{}",
                " |".repeat(streams.len())
            ),
        };
        for &ctx in &contexts {
            for kv in &configs {
                print(
                    ctx,
                    &kv.label,
                    run_config(b, path, &model, kv, ctx, &streams, false),
                );
            }
            if k_quant && ctx == contexts[0] && b.only.is_empty() {
                let kv = ours("kv8", None);
                let row = run_config(b, path, &model, &kv, ctx, &streams, true);
                print(ctx, &format!("{} --deterministic", kv.label), row);
            }
        }
        if b.gpu_layers > 0 {
            // The capacity table is the planner's, for the CPU store.
            continue;
        }
        capacity(path, &model)?;
    }
    Ok(())
}

/// How many sequences of 2,048 and of 16,384 tokens a 256 MiB KV budget
/// holds: llama.cpp's cache (its bytes per token) against our store (its
/// planner, which is what it allocates), checked by running that many of
/// 2,048 at once on our store. For a model with sliding windows, our store
/// both keeping every block (`--swa-full`) and with the windowed layers in
/// pools of their own (the default, where it holds more), and llama.cpp's
/// windowed cache as llama-server sizes it by default (an estimate).
fn capacity(path: &Path, model: &Model) -> Result<()> {
    const BUDGET: u64 = 256 << 20;
    let g = model.geometry();
    let layers = g.alike_layers();
    let windows = model.attention_windows().unwrap_or_default();
    let n_windowed = windows.iter().filter(|&&w| w > 0).count() as u64;
    let window = windows.iter().copied().max().unwrap_or(0) as u64;
    for seq in [2048u64, 16384] {
        println!();
        println!("KV budget of 256 MiB, sequences of {seq} tokens:");
        println!();
        println!("| KV | bytes per token | sequences |");
        println!("|---|---:|---:|");
        for (k, v) in [
            (KvType::F16, KvType::F16),
            (KvType::Q8_0, KvType::Q8_0),
            (KvType::Q5_1, KvType::Q4_0),
        ] {
            let per = g.kv_bytes_per_token(k, v);
            println!(
                "| llama.cpp {k}/{v} | {per} | {} |",
                BUDGET / per.max(1) / seq
            );
            if n_windowed > 0 {
                // llama-server's default (`--swa-full` off): a windowed
                // layer keeps the window per sequence plus one batch of
                // 512 cells (llama.cpp's `n_swa * n_seq_max + n_ubatch`).
                let layer = per / u64::from(g.n_layer);
                let n_global = u64::from(g.n_layer) - n_windowed;
                let shared = n_windowed * 512 * layer;
                let each = layer * (n_global * seq + n_windowed * window.min(seq));
                println!(
                    "| llama.cpp {k}/{v}, --swa-full off (estimate, not run) | | {} |",
                    BUDGET.saturating_sub(shared) / each.max(1)
                );
            }
        }
        let mut checked = None;
        for f in ["f16", "kv8", "k5v4", "k5v4+tail64"] {
            let format = KvFormat::parse(f)?;
            for swa_full in [true, false] {
                if !swa_full && n_windowed == 0 {
                    continue;
                }
                // Sized for as many running sequences as the budget then holds.
                let mut running = 1u32;
                let mut best = None;
                loop {
                    match siliceo_runtime::plan_windowed_store(
                        &layers,
                        &windows,
                        &format,
                        StoreSize::Budget(BUDGET),
                        64,
                        running,
                        512,
                        0,
                        true,
                        swa_full,
                    ) {
                        Ok((_, p, w)) if p.tokens / seq >= u64::from(running) => {
                            best = Some((p, w));
                            running += 1;
                        }
                        _ => break,
                    }
                }
                let label = match (n_windowed, swa_full) {
                    (0, _) => format.name(),
                    (_, true) => format!("{} (every block: --swa-full)", format.name()),
                    (_, false) => {
                        format!("{} (windowed pools where they hold more)", format.name())
                    }
                };
                let Some((p, w)) = best else {
                    println!("| ours {label} | | 0 |");
                    continue;
                };
                let seqs = running - 1;
                let pools = match w {
                    Some(w) => format!(
                        " [{} layers of {} in pools of {}+{} blocks]",
                        w.layers.1,
                        w.group.window.tokens,
                        w.group.num_blocks,
                        w.group.sealed_blocks
                    ),
                    None => String::new(),
                };
                println!(
                    "| ours {label}{pools} | {:.0} | {seqs} |",
                    p.bytes_per_token(64)
                );
                if f == "kv8" && seq == 2048 && swa_full != (n_windowed > 0) {
                    checked = Some(verify_capacity(path, &format, seqs)?);
                }
            }
        }
        if let Some(line) = checked {
            println!("\n{line}");
        }
    }
    if n_windowed > 0 {
        println!(
            "\n({n_windowed} of {} layers have a sliding window of {window}. The llama.cpp \
             rows without a note keep every cell there, as its library default (the timings \
             above) does; bytes per token of our windowed rows are the global layers'.)",
            g.n_layer
        );
    }
    Ok(())
}

/// Runs `n` distinct 2,048-token sequences at once in a 256 MiB store of
/// `format`: all of them must run together (no preemption). Each generates
/// long enough (`CAP_GEN` tokens) to still run when the last one's prompt
/// is in: a step prefills at most 512 prompt tokens, so with short answers
/// the first would end before the last starts, whatever the memory.
fn verify_capacity(path: &Path, format: &KvFormat, n: u32) -> Result<String> {
    const CAP_GEN: u32 = 64;
    let model = Model::load(path, &ModelOptions::default())?;
    let mut cfg = RuntimeConfig::new(path);
    cfg.kv = KvBackend::Ours {
        format: format.clone(),
        size: Some(StoreSize::Budget(256 << 20)),
        kernel_threads: None,
    };
    cfg.scheduler.max_running_seqs = n as usize;
    cfg.scheduler.max_seq_len = usize::MAX;
    cfg.context.n_batch = 512;
    cfg.scheduler.max_batch_tokens = 512;
    cfg.prefix_caching = false;
    let rt = Runtime::start(cfg)?;
    let subs = (0..n)
        .map(|i| {
            let mut p = model.tokenize(&format!("Report {i}."), true)?;
            p.extend(context_tokens(&model, 2048 - CAP_GEN as usize - p.len())?);
            Ok(rt.submit(greedy(p, CAP_GEN))?)
        })
        .collect::<Result<Vec<_>>>()?;
    let mut peak = 0;
    loop {
        let s = rt.stats()?;
        peak = peak.max(s.running);
        if s.running == 0 && s.waiting == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    for s in subs {
        check(&s.blocking_collect().2)?;
    }
    let s = rt.stats()?;
    if peak < n as usize || s.preemptions > 0 {
        bail!("the store's plan says {n} sequences fit; {peak} ran at once");
    }
    Ok(format!(
        "(checked: {n} sequences of 2,048 tokens in ours {}: {peak} ran at once, {} preemptions)",
        format.name(),
        s.preemptions
    ))
}
