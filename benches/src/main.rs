//! `siliceo-bench`: benchmarks on the real model. Run through `cargo xtask bench`.
//!
//! `siliceo-bench engine [--model PATH] [--reps N] [--json]` measures raw
//! llama.cpp throughput through our engine: prompt processing, single-sequence
//! decode, and batched decode of B sequences in one `decode` per step. Every
//! figure is the median of `--reps` runs made in this one process.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use siliceo_core::{SeqId, TokenId, sampler::argmax};
use siliceo_engine::{Batch, Context, ContextOptions, Model, ModelOptions};

const PROMPTS: [&str; 4] = [
    "The history of the printing press begins in",
    "fn parse_header(bytes: &[u8]) -> Result<Header, Error> {",
    "Photosynthesis is the process by which plants",
    "Dear team, following our meeting yesterday I would like to",
];

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
        batch.clear();
        let idx = batch
            .push_run(&p, 0, SeqId(s as u32))
            .expect("non-empty prompt");
        ctx.decode(&batch)?;
        last.push(argmax(ctx.logits(idx)?));
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
    }
    Ok(())
}

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
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--model" => model = it.next().map(PathBuf::from).unwrap_or(model),
            "--reps" => reps = it.next().and_then(|r| r.parse().ok()).unwrap_or(reps),
            "--json" => json = true,
            "engine" => {}
            other => bail!(
                "unknown argument `{other}`; usage: siliceo-bench engine [--model PATH] [--reps N] [--json]"
            ),
        }
    }
    engine(model, reps.max(1), json)
}
