//! `siliceo-bench score`: what scoring a prompt (`prompt_logprobs`, an
//! `echo` with `logprobs`) costs against computing the same prompt to
//! generate one token, side by side in one process per model.
//!
//! Scoring reads every position's logits (a log-softmax over the vocabulary
//! each) and computes the prompt in chunks of 64 tokens instead of the
//! step's 512; prefill reads one row. Neither reuses the prefix cache: each
//! run's prompt is new, and the cache is off.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use siliceo_core::TokenId;
use siliceo_runtime::{Event, GenerateRequest, Input, Runtime, RuntimeConfig};

pub struct ScoreBench {
    pub models: Vec<PathBuf>,
    pub reps: usize,
    pub threads: u32,
    /// Prompt lengths in tokens.
    pub lengths: Vec<usize>,
}

/// Runs a request to its end; its wall time in ms.
fn run(rt: &Runtime, req: GenerateRequest) -> Result<f64> {
    let t0 = Instant::now();
    let mut s = rt.submit(req)?;
    while let Some(e) = s.blocking_next() {
        if let Event::Done { error, .. } = e {
            if let Some(e) = error {
                bail!("request failed: {e}");
            }
            return Ok(t0.elapsed().as_secs_f64() * 1000.0);
        }
    }
    bail!("stream ended without Done")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn score(b: &ScoreBench) -> Result<()> {
    println!(
        "| model | prompt tokens | prefill + 1 token, ms | tok/s | score, top 0, ms | tok/s | score, top 5, ms | tok/s | score ÷ prefill (top 0) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for path in &b.models {
        let mut cfg = RuntimeConfig::new(path);
        cfg.context.n_ctx = 4096;
        cfg.context.n_threads = Some(b.threads);
        cfg.context.n_threads_batch = Some(b.threads);
        cfg.prefix_caching = false;
        let rt = Runtime::start(cfg)?;
        let name = path
            .file_stem()
            .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
        let filler = rt.tokenize(
            " The committee reviewed the quarterly figures, the hiring plan and the travel budget.",
            false,
        )?;
        let mut tag = 0;
        let mut prompt = |len: usize| -> Result<Vec<TokenId>> {
            tag += 1;
            let mut t = rt.tokenize(&format!("Minutes of meeting number {tag}."), true)?;
            while t.len() < len {
                t.extend(&filler);
            }
            t.truncate(len);
            Ok(t)
        };
        for &len in &b.lengths {
            // One untimed run of each warms the caches and llama.cpp's buffers.
            let (mut prefill, mut score0, mut score5) = (Vec::new(), Vec::new(), Vec::new());
            for rep in 0..=b.reps {
                let mut p = GenerateRequest::new(Input::Tokens(prompt(len)?));
                p.sampling.max_tokens = 1;
                let ms = run(&rt, p)?;
                let mut s = GenerateRequest::new(Input::Tokens(prompt(len)?));
                s.sampling.max_tokens = 0;
                s.prompt_logprobs = Some(0);
                let ms0 = run(&rt, s.clone())?;
                s.input = Input::Tokens(prompt(len)?);
                s.prompt_logprobs = Some(5);
                let ms5 = run(&rt, s)?;
                if rep > 0 {
                    prefill.push(ms);
                    score0.push(ms0);
                    score5.push(ms5);
                }
            }
            let (p, s0, s5) = (median(prefill), median(score0), median(score5));
            let tps = |ms: f64| len as f64 / ms * 1000.0;
            println!(
                "| {name} | {len} | {p:.0} | {:.0} | {s0:.0} | {:.0} | {s5:.0} | {:.0} | {:.2}× |",
                tps(p),
                tps(s0),
                tps(s5),
                s0 / p
            );
        }
    }
    Ok(())
}
