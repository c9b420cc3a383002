//! `siliceo-bench`: benchmarks on the real model. Run through `cargo xtask bench`.
//!
//! `siliceo-bench engine [--model PATH] [--reps N] [--json]` measures raw
//! llama.cpp throughput through our engine: prompt processing, single-sequence
//! decode, and batched decode of B sequences in one `decode` per step.
//! `siliceo-bench serve` measures the serving loop (`siliceo-runtime`) against
//! that raw batched decode, side by side in one process. `siliceo-bench
//! prefix` measures prefix caching (cold vs warm TTFT, a shared prefix sent
//! by 16 requests at once), with the cache on and off. Every figure is the
//! median of `--reps` runs made in this one process. `siliceo-bench
//! constrain` measures what a JSON-schema constraint costs per decode step,
//! `siliceo-bench think` what a thinking budget does.
//! `siliceo-bench grpc` (alias `protocols`) serves one runtime directly, over
//! gRPC and over the OpenAI HTTP API, in turn; `siliceo-bench peer` compares
//! our HTTP API with llama-server's through the same OpenAI client.

mod constrain;
mod graft;
mod openai_client;
mod peer;
mod score;
mod think;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use siliceo_core::{SeqId, TokenId, sampler::argmax};
use siliceo_engine::{Batch, Context, ContextOptions, Model, ModelOptions};

const PROMPTS: [&str; 4] = [
    "The history of the printing press begins in",
    "fn parse_header(bytes: &[u8]) -> Result<Header, Error> {",
    "Photosynthesis is the process by which plants",
    "Dear team, following our meeting yesterday I would like to",
];

/// A serving bench on one model: its file, the medians' runs, llama.cpp's
/// threads (`siliceo-bench constrain`, `think`).
pub(crate) struct ServeBench {
    pub(crate) model: PathBuf,
    pub(crate) reps: usize,
    pub(crate) threads: u32,
}

impl ServeBench {
    /// A runtime configuration of the model with the bench's threads.
    fn config(&self) -> siliceo_runtime::RuntimeConfig {
        let mut cfg = siliceo_runtime::RuntimeConfig::new(&self.model);
        cfg.context.n_threads = Some(self.threads);
        cfg.context.n_threads_batch = Some(self.threads);
        cfg
    }

    /// The table's header line: the model, `what`, the threads, the reps.
    fn header(&self, what: &str) -> String {
        format!(
            "{} · {what} · {} threads · median of {}",
            self.model.file_name().unwrap_or_default().to_string_lossy(),
            self.threads,
            self.reps
        )
    }
}

/// Submits `requests` at once to `rt`; each must generate exactly `tokens`
/// tokens. Returns the tokens generated per second and each output's text.
fn run_exact(
    rt: &siliceo_runtime::Runtime,
    requests: Vec<siliceo_runtime::GenerateRequest>,
    tokens: u32,
) -> Result<(f64, Vec<String>)> {
    use siliceo_runtime::Event;
    let t0 = Instant::now();
    let handles: Vec<_> = requests
        .into_iter()
        .map(|r| rt.submit(r))
        .collect::<Result<_, _>>()?;
    let mut total = 0u64;
    let mut texts = Vec::with_capacity(handles.len());
    for mut h in handles {
        let mut text = String::new();
        while let Some(e) = h.blocking_next() {
            match e {
                Event::Text { text: t, .. } => text.push_str(&t),
                Event::Done { usage, error, .. } => {
                    if let Some(e) = error {
                        bail!("request failed: {e}");
                    }
                    if usage.completion_tokens != tokens {
                        bail!(
                            "a request generated {} tokens, not {tokens}",
                            usage.completion_tokens
                        );
                    }
                    total += u64::from(usage.completion_tokens);
                }
                _ => {}
            }
        }
        texts.push(text);
    }
    Ok((total as f64 / t0.elapsed().as_secs_f64(), texts))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn prompt_tokens(model: &Model, i: usize, len: usize) -> Result<Vec<TokenId>> {
    let base = model.tokenize(PROMPTS[i % PROMPTS.len()], true)?;
    let filler = model.tokenize(" and then the story went on, as stories do,", false)?;
    let mut t = base;
    while t.len() < len {
        t.extend(&filler);
    }
    t.truncate(len);
    Ok(t)
}

/// Decodes `steps` tokens for each of `b` sequences, one batch per step;
/// returns aggregate generated tokens per second.
fn batched_decode(
    ctx: &mut Context<'_>,
    model: &Model,
    b: usize,
    prompt_len: usize,
    steps: usize,
) -> Result<f64> {
    ctx.clear();
    let mut batch = Batch::new();
    let mut last = Vec::new();
    let mut pos = Vec::new();
    for s in 0..b {
        let p = prompt_tokens(model, s, prompt_len)?;
        // prefill splits prompts longer than n_batch.
        let logits = ctx.prefill(SeqId(s as u32), &p, 0)?;
        last.push(argmax(&logits));
        pos.push(p.len() as u32);
    }
    let t0 = Instant::now();
    let mut idx = vec![0; b];
    for _ in 0..steps {
        batch.clear();
        for s in 0..b {
            idx[s] = batch.push(last[s], pos[s], SeqId(s as u32), true);
            pos[s] += 1;
        }
        ctx.decode(&batch)?;
        for s in 0..b {
            last[s] = argmax(ctx.logits(idx[s])?);
        }
    }
    Ok((b * steps) as f64 / t0.elapsed().as_secs_f64())
}

fn engine(model_path: PathBuf, reps: usize, json: bool) -> Result<()> {
    let model = Model::load(&model_path, &ModelOptions::default())?;
    let mut ctx = Context::new(
        &model,
        ContextOptions {
            n_ctx: 8192,
            n_batch: 512,
            n_seq_max: 16,
            ..ContextOptions::default()
        },
    )?;
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    // Warm-up: page the weights in, let llama.cpp size its buffers.
    batched_decode(&mut ctx, &model, 1, 32, 8)?;

    let mut prefill = Vec::new();
    for _ in 0..reps {
        ctx.clear();
        let p = prompt_tokens(&model, 0, 512)?;
        let t0 = Instant::now();
        ctx.prefill(SeqId(0), &p, 0)?;
        prefill.push(p.len() as f64 / t0.elapsed().as_secs_f64());
    }
    let prefill = median(prefill);

    let mut rows = Vec::new();
    for b in [1usize, 4, 8, 16] {
        let runs: Result<Vec<f64>> = (0..reps)
            .map(|_| batched_decode(&mut ctx, &model, b, 128, 64))
            .collect();
        rows.push((b, median(runs?)));
    }
    // Per-token decode latency as the context grows (one sequence).
    let mut latency = Vec::new();
    for ctx_len in [256usize, 1800] {
        let runs: Result<Vec<f64>> = (0..reps)
            .map(|_| batched_decode(&mut ctx, &model, 1, ctx_len, 32).map(|tps| 1000.0 / tps))
            .collect();
        latency.push((ctx_len, median(runs?)));
    }
    let single = rows[0].1;
    if json {
        let decode: Vec<_> = rows
            .iter()
            .map(|(b, t)| serde_json::json!({"streams": b, "tokens_per_s": t, "vs_single": t / single}))
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "model": model.name(),
                "threads": threads,
                "reps": reps,
                "prefill_512_tokens_per_s": prefill,
                "decode": decode,
                "decode_ms_per_token_by_context": latency.iter().map(|(c, ms)| serde_json::json!({"context": c, "ms": ms})).collect::<Vec<_>>(),
            })
        );
    } else {
        println!(
            "model: {} · {} threads · median of {} runs",
            model.name(),
            threads,
            reps
        );
        println!();
        println!("| measurement | tokens/s | vs 1 stream |");
        println!("|---|---:|---:|");
        println!("| prefill, 512-token prompt | {prefill:.0} | |");
        for (b, t) in &rows {
            println!(
                "| decode, {b} stream(s) in one batch, 128-token context | {t:.1} | {:.2}× |",
                t / single
            );
        }
        println!();
        println!("| context | decode ms per token (1 stream) |");
        println!("|---:|---:|");
        for (c, ms) in &latency {
            println!("| {c} | {ms:.2} |");
        }
        println!();
        println!(
            "growth from 256 to 1800 tokens of context: {:.2}×",
            latency[1].1 / latency[0].1
        );
    }
    Ok(())
}

/// The serving loop at 1, 4, 8, 16 concurrent streams vs raw batched decode of
/// the same number of sequences, plus time to first token.
fn serve(model_path: PathBuf, reps: usize, quiet: bool, threads: Option<u32>) -> Result<()> {
    use siliceo_runtime::{Event, Input, Runtime, RuntimeConfig};
    const GEN: u32 = 64;
    const PROMPT: usize = 32;
    let streams = [1usize, 4, 8, 16, 64];
    // Raw batched decode first, on a thread of its own that ends before the
    // runtime starts: llama.cpp's OpenMP pool belongs to the calling thread, and
    // a second, idle pool left on another thread halves the engine thread's
    // decode speed on two cores (measured; see docs/BENCHMARKS.md).
    let mp = model_path.clone();
    let raw: Vec<f64> = std::thread::spawn(move || -> Result<Vec<f64>> {
        let model = Model::load(&mp, &ModelOptions::default())?;
        let mut ctx = Context::new(
            &model,
            ContextOptions {
                n_ctx: 8192,
                n_batch: 512,
                n_seq_max: 64,
                ..ContextOptions::default()
            },
        )?;
        batched_decode(&mut ctx, &model, 1, 32, 8)?;
        streams
            .iter()
            .map(|&b| {
                let runs: Result<Vec<f64>> = (0..reps)
                    .map(|_| batched_decode(&mut ctx, &model, b, PROMPT, GEN as usize))
                    .collect();
                Ok(median(runs?))
            })
            .collect()
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the raw-decode thread panicked"))??;
    let mut cfg = RuntimeConfig::new(&model_path);
    cfg.context.n_ctx = 8192;
    cfg.block_size = 16;
    cfg.context.n_batch = 512;
    cfg.context.n_ubatch = 512;
    cfg.scheduler.max_running_seqs = 64;
    cfg.scheduler.max_batch_tokens = 512;
    cfg.context.n_threads = threads;
    cfg.context.n_threads_batch = threads;
    let rt = Runtime::start(cfg)?;
    let tokenizer = Model::load(&model_path, &ModelOptions::default())?;
    println!(
        "model: {} · median of {reps} runs · prompts of {PROMPT} tokens, {GEN} generated tokens per stream",
        tokenizer.name()
    );
    println!();
    println!(
        "| streams | serving decode tok/s | raw batched decode tok/s | serving / raw | TTFT p50 ms | TTFT p95 ms | host overhead per step |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for (si, &n) in streams.iter().enumerate() {
        let mut rates = Vec::new();
        let mut ttfts = Vec::new();
        let before = rt.stats()?;
        for _ in 0..reps {
            let subs: Vec<_> = (0..n)
                .map(|i| {
                    let input = Input::Tokens(prompt_tokens(&tokenizer, i, PROMPT)?);
                    Ok(rt.submit(greedy_request(input, GEN))?)
                })
                .collect::<Result<_>>()?;
            if quiet {
                // Leave the engine alone until everything is done: no consumer
                // thread wakes up per token (see docs/BENCHMARKS.md).
                loop {
                    std::thread::sleep(std::time::Duration::from_millis(100));
                    let st = rt.stats()?;
                    if st.running == 0 && st.waiting == 0 {
                        break;
                    }
                }
            }
            let mut decoded = 0u64;
            let mut window_ms = 0u64;
            for s in subs {
                let (_, _, done) = s.blocking_collect();
                let Event::Done { usage, error, .. } = done else {
                    unreachable!("collect ends with Done")
                };
                if let Some(e) = error {
                    bail!("serving run failed: {e}");
                }
                decoded += u64::from(usage.completion_tokens.saturating_sub(1));
                window_ms = window_ms.max(usage.decode_ms);
                ttfts.push(usage.ttft_ms as f64);
            }
            rates.push(decoded as f64 * 1000.0 / window_ms.max(1) as f64);
        }
        let rate = median(rates);
        let after = rt.stats()?;
        let step_us = (after.step_us - before.step_us) as f64;
        let overhead = (step_us - (after.decode_us - before.decode_us) as f64) / step_us.max(1.0);
        ttfts.sort_by(f64::total_cmp);
        let pct = |q: f64| ttfts[((ttfts.len() - 1) as f64 * q).round() as usize];
        println!(
            "| {n} | {rate:.1} | {:.1} | {:.0} % | {:.0} | {:.0} | {:.2} % |",
            raw[si],
            rate * 100.0 / raw[si],
            pct(0.5),
            pct(0.95),
            overhead * 100.0
        );
    }
    Ok(())
}

/// Time to first token and prompt tokens computed by one request, measured
/// by the client: from `submit` to the first text event.
fn timed_request(
    rt: &siliceo_runtime::Runtime,
    tokens: Vec<TokenId>,
) -> Result<(siliceo_runtime::RequestStream, Instant)> {
    let req = greedy_request(siliceo_runtime::Input::Tokens(tokens), 8);
    let t = Instant::now();
    Ok((rt.submit(req)?, t))
}

/// Waits for a request's first token (returns TTFT in ms) and its end.
fn ttft_ms(mut s: siliceo_runtime::RequestStream, t0: Instant) -> Result<(f64, u32)> {
    use siliceo_runtime::Event;
    let mut first = None;
    while let Some(e) = s.blocking_next() {
        match e {
            Event::Text { .. } => {
                first.get_or_insert_with(|| t0.elapsed().as_secs_f64() * 1000.0);
            }
            Event::Prompt { .. } => {}
            Event::Done { usage, error, .. } => {
                if let Some(e) = error {
                    bail!("request failed: {e}");
                }
                return Ok((first.unwrap_or(f64::NAN), usage.cached_prompt_tokens));
            }
        }
    }
    bail!("stream ended without Done")
}

/// Prefix caching: 16 requests sharing a 1,500-token prefix with distinct
/// 20-token suffixes, sent one after another and then all at once, with the
/// cache on and off, side by side in one process.
fn prefix(model_path: PathBuf, reps: usize) -> Result<()> {
    use siliceo_runtime::{Runtime, RuntimeConfig};
    const PREFIX: usize = 1500;
    const SUFFIX: usize = 20;
    const N: usize = 16;
    let tokenizer = Model::load(&model_path, &ModelOptions::default())?;
    let filler = tokenizer.tokenize(
        " The committee reviewed the quarterly figures, the hiring plan and the travel budget.",
        false,
    )?;
    // A different prefix per run and scenario, so every cold run is cold.
    let prefix_for = |tag: usize| -> Result<Vec<TokenId>> {
        let mut t = tokenizer.tokenize(&format!("Minutes of meeting number {tag}."), true)?;
        while t.len() < PREFIX {
            t.extend(&filler);
        }
        t.truncate(PREFIX);
        Ok(t)
    };
    let with_suffix = |prefix: &[TokenId], i: usize| -> Result<Vec<TokenId>> {
        let mut t = prefix.to_vec();
        let mut q = tokenizer.tokenize(
            &format!(" Question {i}: who proposed item {i}, and was it approved in the end?"),
            false,
        )?;
        while q.len() < SUFFIX {
            q.extend(&filler);
        }
        q.truncate(SUFFIX);
        t.extend(q);
        Ok(t)
    };
    let start = |caching: bool| -> Result<Runtime> {
        let mut cfg = RuntimeConfig::new(&model_path);
        cfg.context.n_ctx = 8192;
        cfg.context.n_batch = 512;
        cfg.context.n_ubatch = 512;
        cfg.scheduler.max_batch_tokens = 512;
        cfg.scheduler.max_running_seqs = N;
        cfg.prefix_caching = caching;
        Ok(Runtime::start(cfg)?)
    };
    println!(
        "model: {} · {N} requests · {PREFIX}-token shared prefix + {SUFFIX}-token suffixes · 8 generated tokens each · {reps} runs",
        tokenizer.name()
    );
    println!();
    println!("| scenario | prompt tokens computed per run (median) | TTFT p50 ms | TTFT p95 ms |");
    println!("|---|---:|---:|---:|");
    let pct = |v: &mut Vec<f64>, q: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * q).round() as usize]
    };
    let mut tag = 0;
    let mut rows: Vec<(String, Vec<f64>, Vec<f64>)> = Vec::new();
    for caching in [true, false] {
        let rt = start(caching)?;
        let on = if caching { "cache on" } else { "cache off" };
        let (mut cold, mut warm, mut together) = (Vec::new(), Vec::new(), Vec::new());
        let (mut cold_n, mut warm_n, mut together_n) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..reps {
            // Sequential: the first is cold, the other 15 find the prefix.
            tag += 1;
            let p = prefix_for(tag)?;
            for i in 0..N {
                let (s, t0) = timed_request(&rt, with_suffix(&p, i)?)?;
                let (ms, cached) = ttft_ms(s, t0)?;
                let computed = (PREFIX + SUFFIX) as f64 - f64::from(cached);
                if i == 0 {
                    cold.push(ms);
                    cold_n.push(computed);
                } else {
                    warm.push(ms);
                    warm_n.push(computed);
                }
            }
            // All at once, on a prefix nobody has seen.
            tag += 1;
            let p = prefix_for(tag)?;
            let subs: Vec<_> = (0..N)
                .map(|i| timed_request(&rt, with_suffix(&p, i)?))
                .collect::<Result<_>>()?;
            let mut computed = 0.0;
            for (s, t0) in subs {
                let (ms, cached) = ttft_ms(s, t0)?;
                together.push(ms);
                computed += (PREFIX + SUFFIX) as f64 - f64::from(cached);
            }
            together_n.push(computed);
        }
        let warm_per_run: Vec<f64> = warm_n.chunks(N - 1).map(|c| c.iter().sum()).collect();
        rows.push((format!("sequential, first (cold), {on}"), cold_n, cold));
        rows.push((
            format!("sequential, other 15 (warm), {on}"),
            warm_per_run,
            warm,
        ));
        rows.push((format!("{N} at once, {on}"), together_n, together));
        drop(rt);
    }
    for (name, computed, mut ttft) in rows {
        println!(
            "| {name} | {:.0} | {:.1} | {:.1} |",
            median(computed),
            pct(&mut ttft, 0.5),
            pct(&mut ttft, 0.95)
        );
    }
    Ok(())
}

/// One greedy request of `max_tokens` tokens alone: its decode tokens/s (after the
/// first token) and usage.
fn greedy_decode_rate(
    rt: &siliceo_runtime::Runtime,
    prompt: &str,
    max_tokens: u32,
    speculative: bool,
) -> Result<(f64, siliceo_runtime::Usage)> {
    use siliceo_runtime::{Event, Input};
    let req = siliceo_runtime::GenerateRequest {
        speculative,
        ..greedy_request(Input::Prompt(prompt.to_string()), max_tokens)
    };
    let (_, _, done) = rt.submit(req)?.blocking_collect();
    let Event::Done { usage, error, .. } = done else {
        unreachable!("collect ends with Done")
    };
    if let Some(e) = error {
        bail!("run failed: {e}");
    }
    let rate = f64::from(usage.completion_tokens - 1) * 1000.0 / usage.decode_ms.max(1) as f64;
    Ok((rate, usage))
}

/// Decode tok/s of each prompt under several runtime configurations: `runs`
/// is a list of (speculative configuration, [(column, request speculative?)]);
/// returns rates[prompt][column] (medians over `reps`) and the last run's
/// (drafted, accepted, verification steps) per prompt and column.
type Columns<'a> = &'a [(
    Option<siliceo_runtime::SpeculativeConfig>,
    &'a [(usize, bool)],
)];

#[allow(clippy::type_complexity)]
fn measure_columns(
    model: &std::path::Path,
    n_ctx: u32,
    prompts: &[(&str, &str)],
    max_tokens: u32,
    runs: Columns<'_>,
    n_columns: usize,
    reps: usize,
) -> Result<(Vec<Vec<f64>>, Vec<Vec<(u32, u32, u32)>>)> {
    use siliceo_runtime::{Runtime, RuntimeConfig};
    let mut rates = vec![vec![Vec::new(); n_columns]; prompts.len()];
    let mut counts = vec![vec![(0u32, 0u32, 0u32); n_columns]; prompts.len()];
    for (spec, columns) in runs {
        let mut cfg = RuntimeConfig::new(model);
        cfg.context.n_ctx = n_ctx;
        cfg.speculative = spec.clone();
        let rt = Runtime::start(cfg)?;
        for _ in 0..reps {
            for (pi, (_, p)) in prompts.iter().enumerate() {
                for &(col, speculative) in *columns {
                    let (rate, usage) = greedy_decode_rate(&rt, p, max_tokens, speculative)?;
                    rates[pi][col].push(rate);
                    counts[pi][col] = (
                        usage.draft_tokens,
                        usage.accepted_draft_tokens,
                        usage.speculative_steps,
                    );
                }
            }
        }
    }
    let medians = rates
        .into_iter()
        .map(|cols| cols.into_iter().map(median).collect())
        .collect();
    Ok((medians, counts))
}

/// Speculative decoding with the n-gram drafter at batch size 1: decode
/// tokens/s with and without it (chains, and trees of up to 3 branches), on
/// prompts whose continuations repeat what came before (where prompt lookup
/// can help) and on one where they do not.
fn spec(model_path: PathBuf, reps: usize) -> Result<()> {
    use siliceo_runtime::SpeculativeConfig;
    const GEN: u32 = 128;
    let prompts: [(&str, &str); 5] = [
        (
            "repeat a line",
            "Repeat the line five times.\nThe cat sat on the mat.\nThe cat sat on the mat.\n",
        ),
        ("count", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"),
        (
            "code",
            "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
        ),
        (
            "alternating",
            "the cat sat. the dog ran. the cat ran. the dog sat. the cat sat. the dog ran. the",
        ),
        (
            "free prose",
            "Write a short story about a lighthouse keeper.",
        ),
    ];
    let chain = SpeculativeConfig::default();
    let tree = SpeculativeConfig {
        tree_width: 3,
        ..SpeculativeConfig::default()
    };
    let no_cost = SpeculativeConfig {
        cost_switch_off: false,
        ..SpeculativeConfig::default()
    };
    let runs: Columns<'_> = &[
        (Some(chain), &[(0, false), (1, true)]),
        (Some(tree), &[(2, true)]),
        (Some(no_cost), &[(3, true)]),
    ];
    let (r, c) = measure_columns(&model_path, 4096, &prompts, GEN, runs, 4, reps)?;
    let name = Model::load(&model_path, &ModelOptions::default())?
        .name()
        .to_string();
    println!(
        "model: {name} · greedy · {GEN} tokens · batch size 1 · median of {reps} runs · n-gram drafter, up to 8 tokens"
    );
    println!();
    println!(
        "| prompt | off tok/s | n-gram chain tok/s | speed-up | accepted / drafted | n-gram tree (3) tok/s | speed-up | accepted / drafted | chain, no cost switch-off | speed-up | accepted / drafted |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (pi, (label, _)) in prompts.iter().enumerate() {
        let (off, ch, tr, nc) = (r[pi][0], r[pi][1], r[pi][2], r[pi][3]);
        println!(
            "| {label} | {off:.1} | {ch:.1} | {:.2}× | {} / {} | {tr:.1} | {:.2}× | {} / {} | {nc:.1} | {:.2}× | {} / {} |",
            ch / off,
            c[pi][1].1,
            c[pi][1].0,
            tr / off,
            c[pi][2].1,
            c[pi][2].0,
            nc / off,
            c[pi][3].1,
            c[pi][3].0
        );
    }
    spec_pair(&model_path, reps)
}

/// The pair: Qwen2.5-Coder-1.5B alone, with the 0.5B draft model
/// (adaptive length, fixed 4, fixed 8), and with the n-gram drafter, at batch
/// size 1.
fn spec_pair(default_model: &std::path::Path, reps: usize) -> Result<()> {
    use siliceo_runtime::SpeculativeConfig;
    const GEN: u32 = 64;
    let dir = default_model
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default();
    let target = dir.join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    let draft = dir.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    if !target.is_file() || !draft.is_file() {
        println!(
            "\n(the Qwen2.5-Coder pair is not in {}: `cargo xtask fetch-model --spec` to measure it)",
            dir.display()
        );
        return Ok(());
    }
    let prompts: [(&str, &str); 5] = [
        ("quicksort", "def quicksort(xs):\n"),
        (
            "is_prime",
            "# A Python function that checks whether a number is prime\ndef is_prime(n):\n",
        ),
        ("class Stack", "class Stack:\n    def __init__(self):\n"),
        ("prose", "Write a short poem about autumn leaves."),
        (
            "quotes its input",
            "Add type hints to this function and return it unchanged otherwise:\n\ndef area(width, height):\n    if width < 0 or height < 0:\n        raise ValueError(\"negative size\")\n    return width * height\n\n",
        ),
    ];
    let with_draft = |max_draft: usize, fixed_draft: bool| SpeculativeConfig {
        draft_model: Some(draft.clone()),
        max_draft,
        fixed_draft,
        ..SpeculativeConfig::default()
    };
    // Columns: 0 target alone, 1 draft adaptive (≤ 8, switched off by its
    // cost: the default), 2 the same without the cost switch-off, 3 draft
    // k = 4, 4 draft tree (top 2 at the first position, k = 4), 5 n-gram.
    let tree = SpeculativeConfig {
        tree_width: 2,
        ..with_draft(4, true)
    };
    let no_cost = SpeculativeConfig {
        cost_switch_off: false,
        ..with_draft(8, false)
    };
    let runs: Columns<'_> = &[
        (Some(with_draft(8, false)), &[(0, false), (1, true)]),
        (Some(no_cost), &[(2, true)]),
        (Some(with_draft(4, true)), &[(3, true)]),
        (Some(tree), &[(4, true)]),
        (Some(SpeculativeConfig::default()), &[(5, true)]),
    ];
    let (r, c) = measure_columns(&target, 2048, &prompts, GEN, runs, 6, reps)?;
    println!();
    println!(
        "Qwen2.5-Coder-1.5B-Instruct Q4_K_M target · 0.5B draft · greedy · {GEN} tokens · batch size 1 · median of {reps} runs · tok/s (speed-up; accepted / drafted; mean accepted per step)"
    );
    println!();
    println!(
        "| prompt | target alone | + draft, adaptive ≤ 8 (default) | + draft, adaptive, no cost switch-off | + draft, k = 4 | + draft tree (top 2, k = 4) | + n-gram |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (pi, (label, _)) in prompts.iter().enumerate() {
        let alone = r[pi][0];
        let cell = |k: usize| {
            format!(
                "{:.1} ({:.2}×; {} / {}; {:.1})",
                r[pi][k],
                r[pi][k] / alone,
                c[pi][k].1,
                c[pi][k].0,
                f64::from(c[pi][k].1) / f64::from(c[pi][k].2.max(1))
            )
        };
        println!(
            "| {label} | {alone:.1} | {} | {} | {} | {} | {} |",
            cell(1),
            cell(2),
            cell(3),
            cell(4),
            cell(5)
        );
    }
    Ok(())
}

/// End-to-end generation over gRPC against the same requests submitted to the
/// runtime directly, in one process and one runtime: what the wire, tonic and
/// the stream adapter cost. Aggregate tok/s = generated tokens / (first submit
/// → last end); TTFT from submit to the first text.
fn grpc(model_path: PathBuf, reps: usize) -> Result<()> {
    use siliceo_runtime::{Event, Input, Runtime, RuntimeConfig};
    use siliceo_server::pb::{self, inference_client::InferenceClient};
    const GEN: u32 = 64;
    let streams = [1usize, 8, 16];
    let mut cfg = RuntimeConfig::new(&model_path);
    cfg.context.n_ctx = 8192;
    cfg.context.n_batch = 512;
    cfg.context.n_ubatch = 512;
    cfg.scheduler.max_batch_tokens = 512;
    cfg.scheduler.max_running_seqs = 16;
    cfg.block_size = 16;
    let rt = std::sync::Arc::new(Runtime::start(cfg)?);
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let listener = tokio.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?;
    tokio.spawn(siliceo_server::serve_on(
        listener,
        rt.clone(),
        siliceo_server::ServerConfig::default(),
        std::future::pending(),
    ));
    let http_addr = openai_client::serve_http(&tokio, rt.clone())?;
    let prompt = |i: usize| format!("{} (stream {i})", PROMPTS[i % PROMPTS.len()]);
    let over_http = |n: usize| -> Result<(f64, Vec<f64>)> {
        let prompts = (0..n)
            .map(|i| rt.tokenize(&prompt(i), true))
            .collect::<Result<Vec<_>, _>>()?;
        let t0 = Instant::now();
        let t = openai_client::completions(http_addr, prompts, GEN)?;
        let tokens: u32 = t.iter().map(|x| x.tokens).sum();
        Ok((
            f64::from(tokens) / t0.elapsed().as_secs_f64(),
            t.iter().map(|x| x.ttft_ms).collect(),
        ))
    };
    let direct = |n: usize| -> Result<(f64, Vec<f64>)> {
        let t0 = Instant::now();
        let subs: Vec<_> = (0..n)
            .map(|i| rt.submit(greedy_request(Input::Prompt(prompt(i)), GEN)))
            .collect::<Result<_, _>>()?;
        let mut tokens = 0u64;
        let mut ttft = Vec::new();
        // Streams are read one after another here, so TTFT is the runtime's
        // own figure (submit to first token), not when this loop saw it.
        for s in subs {
            let (_, _, done) = s.blocking_collect();
            let Event::Done { usage, error, .. } = done else {
                unreachable!("collect ends with Done")
            };
            if let Some(e) = error {
                bail!("direct run failed: {e}");
            }
            tokens += u64::from(usage.completion_tokens);
            ttft.push(usage.ttft_ms as f64);
        }
        Ok((tokens as f64 / t0.elapsed().as_secs_f64(), ttft))
    };
    let over_grpc = |n: usize| -> Result<(f64, Vec<f64>)> {
        tokio.block_on(async {
            let t0 = Instant::now();
            let tasks: Vec<_> = (0..n)
                .map(|i| {
                    let p = prompt(i);
                    tokio::spawn(async move {
                        let mut c = InferenceClient::connect(format!("http://{addr}")).await?;
                        let req = pb::GenerateRequest {
                            input: Some(pb::generate_request::Input::Prompt(p)),
                            max_tokens: GEN,
                            ignore_eos: true,
                            ..Default::default()
                        };
                        let mut s = c.generate(req).await?.into_inner();
                        let mut first = None;
                        let mut tokens = 0u64;
                        while let Some(m) = s.message().await? {
                            if !m.token_ids.is_empty() {
                                first.get_or_insert_with(|| t0.elapsed().as_secs_f64() * 1000.0);
                            }
                            if let Some(u) = m.usage {
                                tokens = u64::from(u.completion_tokens);
                            }
                        }
                        Ok::<_, anyhow::Error>((tokens, first.unwrap_or(f64::NAN)))
                    })
                })
                .collect();
            let mut tokens = 0;
            let mut ttft = Vec::new();
            for t in tasks {
                let (k, f) = t.await??;
                tokens += k;
                ttft.push(f);
            }
            Ok((tokens as f64 / t0.elapsed().as_secs_f64(), ttft))
        })
    };
    let name = Model::load(&model_path, &ModelOptions::default())?
        .name()
        .to_string();
    println!(
        "model: {name} · {GEN} greedy tokens per stream · median of {reps} runs · one runtime: direct, over gRPC and over HTTP (streamed /v1/completions) on 127.0.0.1, in turn"
    );
    println!();
    println!(
        "| streams | direct tok/s | gRPC tok/s | HTTP tok/s | gRPC / direct | HTTP / direct | TTFT p50 direct ms | gRPC ms | HTTP ms |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for n in streams {
        let (mut d_rate, mut g_rate, mut h_rate) = (Vec::new(), Vec::new(), Vec::new());
        let (mut d_ttft, mut g_ttft, mut h_ttft) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..reps {
            let (r, t) = direct(n)?;
            d_rate.push(r);
            d_ttft.extend(t);
            let (r, t) = over_grpc(n)?;
            g_rate.push(r);
            g_ttft.extend(t);
            let (r, t) = over_http(n)?;
            h_rate.push(r);
            h_ttft.extend(t);
        }
        let (d, g, h) = (median(d_rate), median(g_rate), median(h_rate));
        println!(
            "| {n} | {d:.1} | {g:.1} | {h:.1} | {:.0} % | {:.0} % | {:.0} | {:.0} | {:.0} |",
            g * 100.0 / d,
            h * 100.0 / d,
            median(d_ttft),
            median(g_ttft),
            median(h_ttft)
        );
    }
    Ok(())
}

/// A greedy request of exactly `max_tokens` tokens (end-of-generation tokens
/// do not stop it), as every serving benchmark sends.
fn greedy_request(
    input: siliceo_runtime::Input,
    max_tokens: u32,
) -> siliceo_runtime::GenerateRequest {
    siliceo_runtime::GenerateRequest {
        sampling: siliceo_core::SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..siliceo_core::SamplingParams::greedy()
        },
        ..siliceo_runtime::GenerateRequest::new(input)
    }
}

/// `embed`: texts/s of all-MiniLM-L6-v2 over gRPC, requests of 1, 8, 32 and
/// 64 texts sent one after another, against one request per text with many
/// in flight at once (the service batches waiting requests together).
fn embed(model_path: PathBuf, reps: usize) -> Result<()> {
    use siliceo_runtime::{EmbeddingConfig, EmbeddingService, Runtime, RuntimeConfig};
    use siliceo_server::pb::{self, inference_client::InferenceClient};
    let emb_path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/all-MiniLM-L6-v2.f16.gguf");
    if !emb_path.is_file() {
        bail!(
            "{} missing: run `cargo xtask fetch-model --embed`",
            emb_path.display()
        );
    }
    let mut cfg = RuntimeConfig::new(&model_path);
    cfg.context.n_ctx = 1024;
    let rt = std::sync::Arc::new(Runtime::start(cfg)?);
    let svc = std::sync::Arc::new(EmbeddingService::start(EmbeddingConfig::new(&emb_path))?);
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let listener = tokio.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?;
    let sc = siliceo_server::ServerConfig {
        embeddings: Some(svc.clone()),
        ..Default::default()
    };
    tokio.spawn(siliceo_server::serve_on(
        listener,
        rt,
        sc,
        std::future::pending(),
    ));
    // 256 sentences of 8–20 words (12–30 tokens), all different.
    const WORDS: [&str; 24] = [
        "the", "model", "serves", "requests", "quickly", "while", "a", "small", "cache", "keeps",
        "recent", "blocks", "of", "memory", "close", "to", "each", "running", "sequence", "and",
        "every", "client", "waits", "less",
    ];
    let texts: Vec<String> = (0..256)
        .map(|i| {
            let n = 8 + i % 13;
            (0..n)
                .map(|j| WORDS[(i * 7 + j * 5 + j * j) % WORDS.len()])
                .collect::<Vec<_>>()
                .join(" ")
                + &format!(" {i}.")
        })
        .collect();
    let texts = std::sync::Arc::new(texts);
    let url = format!("http://{addr}");
    let run = |batch: usize, concurrent: bool| -> Result<f64> {
        let texts = texts.clone();
        let url = url.clone();
        tokio.block_on(async move {
            let c = InferenceClient::connect(url).await?;
            let t0 = Instant::now();
            if concurrent {
                let mut set = tokio::task::JoinSet::new();
                for t in texts.iter().cloned() {
                    let mut c = c.clone();
                    set.spawn(async move {
                        c.embed(pb::EmbedRequest {
                            inputs: vec![t],
                            normalize: true,
                            truncate: false,
                        })
                        .await
                        .map(|_| ())
                    });
                }
                while let Some(r) = set.join_next().await {
                    r??;
                }
            } else {
                let mut c = c.clone();
                for chunk in texts.chunks(batch) {
                    c.embed(pb::EmbedRequest {
                        inputs: chunk.to_vec(),
                        normalize: true,
                        truncate: false,
                    })
                    .await?;
                }
            }
            Ok::<f64, anyhow::Error>(texts.len() as f64 / t0.elapsed().as_secs_f64())
        })
    };
    run(8, false)?; // warm-up
    println!(
        "all-MiniLM-L6-v2 (F16 GGUF) over gRPC on 127.0.0.1 · {} texts of 12–30 tokens · median of {reps} · {} threads",
        texts.len(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!();
    println!("| requests | texts/s | vs batches of 64 |");
    println!("|---|---:|---:|");
    let mut rows = Vec::new();
    for (name, batch, conc) in [
        ("1 text per request, one at a time", 1, false),
        ("8 texts per request", 8, false),
        ("32 texts per request", 32, false),
        ("64 texts per request", 64, false),
        ("1 text per request, all 256 at once", 1, true),
    ] {
        let v: Vec<f64> = (0..reps).map(|_| run(batch, conc)).collect::<Result<_>>()?;
        rows.push((name, median(v)));
    }
    let base = rows[3].1;
    for (name, r) in rows {
        println!("| {name} | {r:.0} | {:.2}× |", r / base);
    }
    let st = svc.stats();
    use std::sync::atomic::Ordering::Relaxed;
    println!();
    println!(
        "service: {} requests, {} inputs in {} llama.cpp batches",
        st.requests.load(Relaxed),
        st.inputs.load(Relaxed),
        st.batches.load(Relaxed)
    );
    Ok(())
}

/// `siliceo-bench synth-model --like L [--quant Q] --tokenizer GGUF --out F
/// [--layers N] [--seed S] [--vocab-only]`: the same random-weight model `siliceo synth-model` makes,
/// so that a GPU machine can be given this one binary (each CUDA build of a
/// binary is ~75 MB).
fn synth(args: &[String]) -> Result<()> {
    use siliceo_runtime::synth::{Quant, SynthOptions, synth_model};
    let mut o = SynthOptions {
        like: None,
        quant: Quant::Q4KM,
        tokenizer: PathBuf::new(),
        out: PathBuf::new(),
        layers: None,
        seed: 1,
        vocab_only: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().context("a flag without its value");
        match a.as_str() {
            "--like" => o.like = Some(value()?.parse().map_err(anyhow::Error::msg)?),
            "--quant" => o.quant = value()?.parse().map_err(anyhow::Error::msg)?,
            "--tokenizer" => o.tokenizer = PathBuf::from(value()?),
            "--out" => o.out = PathBuf::from(value()?),
            "--layers" => o.layers = Some(value()?.parse()?),
            "--seed" => o.seed = value()?.parse()?,
            "--vocab-only" => o.vocab_only = true,
            other => bail!("synth-model: unknown argument `{other}`"),
        }
    }
    if o.tokenizer.as_os_str().is_empty() || o.out.as_os_str().is_empty() {
        bail!("synth-model needs --tokenizer GGUF and --out FILE");
    }
    Ok(synth_model(&o)?)
}

const USAGE: &str = "usage: siliceo-bench synth-model ARGS | engine|serve|prefix|spec|grpc|protocols|embed|graft|peer|constrain|think|score [--model PATH] [--reps N] [--json] [--threads N] [--quiet-consumer] [--quick] [--no-qwen] [--llama-server PATH] [--contexts 512,4096] [--only LABEL] [--gpu-layers N] [--streams 1,8,32]";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut model = std::env::var_os("SILICEO_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    let mut reps = 5;
    let mut json = false;
    let mut quiet = false;
    let mut threads = None;
    let mut what = "engine";
    let mut quick = false;
    let mut llama_server: Option<PathBuf> = None;
    let mut qwen = true;
    let mut contexts: Vec<usize> = Vec::new();
    let mut only: Vec<String> = Vec::new();
    let mut gpu_layers = 0u32;
    let mut streams: Vec<usize> = Vec::new();
    if args.first().map(String::as_str) == Some("synth-model") {
        return synth(&args[1..]);
    }
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--model" => model = it.next().map(PathBuf::from).unwrap_or(model),
            "--reps" => reps = it.next().and_then(|r| r.parse().ok()).unwrap_or(reps),
            "--json" => json = true,
            "--quiet-consumer" => quiet = true,
            "--threads" => threads = it.next().and_then(|r| r.parse().ok()),
            "engine" => what = "engine",
            "serve" => what = "serve",
            "prefix" => what = "prefix",
            "spec" => what = "spec",
            "grpc" => what = "grpc",
            "embed" => what = "embed",
            "graft" => what = "graft",
            "peer" => what = "peer",
            "protocols" => what = "grpc",
            "constrain" => what = "constrain",
            "think" => what = "think",
            "score" => what = "score",
            "--llama-server" => llama_server = it.next().map(PathBuf::from),
            "--quick" => quick = true,
            "--no-qwen" => qwen = false,
            "--contexts" => {
                let list = it.next().map(String::as_str).unwrap_or_default();
                contexts = list
                    .split(',')
                    .map(|c| c.trim().parse())
                    .collect::<Result<_, _>>()
                    .with_context(|| {
                        format!("--contexts `{list}`: a comma-separated list of token counts")
                    })?;
            }
            "--only" => only.extend(it.next().cloned()),
            "--gpu-layers" => {
                gpu_layers = it
                    .next()
                    .and_then(|n| n.parse().ok())
                    .context("--gpu-layers needs a number")?;
            }
            "--streams" => {
                let list = it.next().map(String::as_str).unwrap_or_default();
                streams = list
                    .split(',')
                    .map(|c| c.trim().parse())
                    .collect::<Result<_, _>>()
                    .with_context(|| format!("--streams `{list}`: a comma-separated list"))?;
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown argument `{other}`; {USAGE}"),
        }
    }
    if what == "peer" {
        let Some(bin) = llama_server else {
            bail!("peer needs --llama-server PATH (cargo xtask bench peer builds one)");
        };
        return peer::peer(&peer::PeerBench {
            model,
            llama_server: bin,
            reps: reps.max(1),
            threads: threads.unwrap_or(2),
        });
    }
    if what == "constrain" || what == "think" {
        let b = ServeBench {
            model,
            reps: reps.max(1),
            threads: threads.unwrap_or(2),
        };
        return if what == "think" {
            think::think(&b)
        } else {
            constrain::constrain(&b)
        };
    }
    if what == "score" {
        let mut models = vec![model.clone()];
        let qwen_path = model.with_file_name("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
        if qwen_path.is_file() && qwen && !quick {
            models.push(qwen_path);
        }
        return score::score(&score::ScoreBench {
            models,
            reps: reps.max(1),
            threads: threads.unwrap_or(2),
            lengths: if contexts.is_empty() {
                vec![512, 2048]
            } else {
                contexts
            },
        });
    }
    if what == "graft" {
        let mut models = vec![model.clone()];
        let qwen_path = model.with_file_name("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
        if qwen_path.is_file() && qwen && !quick {
            models.push(qwen_path);
        }
        return graft::graft(&graft::GraftBench {
            models,
            reps: reps.max(1),
            threads: threads.unwrap_or(2),
            quick,
            contexts,
            only,
            gpu_layers,
            streams,
        });
    }
    if what == "serve" {
        serve(model, reps.max(1), quiet, threads)
    } else if what == "prefix" {
        prefix(model, reps.max(1))
    } else if what == "spec" {
        spec(model, reps.max(1))
    } else if what == "embed" {
        embed(model, reps.max(1))
    } else if what == "grpc" {
        grpc(model, reps.max(1))
    } else {
        engine(model, reps.max(1), json)
    }
}
