//! `siliceo eval-kv`: what each KV-cache format costs in quality on real text.

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use clap::Args;
use siliceo_engine::eval::{EvalFormat, EvalOptions, EvalReport, Reference, eval_kv};
use siliceo_engine::{Model, ModelOptions};

#[derive(Args, Debug)]
pub struct EvalKvArgs {
    /// GGUF model (default: $SILICEO_MODEL, else the default model).
    #[arg(long, short = 'm')]
    model: Option<PathBuf>,
    /// UTF-8 text to measure on.
    #[arg(long)]
    text: PathBuf,
    /// Tokens per window (the second half of each is scored).
    #[arg(long, default_value_t = 512)]
    window: usize,
    /// Tokens between window starts [default: the window: disjoint windows].
    #[arg(long)]
    stride: Option<usize>,
    /// At most this many windows (0 = all).
    #[arg(long, default_value_t = 0)]
    max_windows: usize,
    /// Comma-separated K/V formats: llama.cpp types `K/V` (e.g. q8_0/q4_0), one
    /// type for both, or presets `kv8` (q8_0/q8_0), `k5v4` (q5_1/q4_1); or
    /// siliceo's own formats through shadow attention: `ours:f16`, `ours:kv8`,
    /// `ours:k5v4`, `ours:K:V` (codecs f16, kv8[/G|/head], k5, v4[/G]) with
    /// `+rot` (Hadamard-rotated K) and `+tailN` (N recent tokens in F16), e.g.
    /// `ours:k5v4+rot+tail128`; or the same formats through the serving path
    /// (grafted attention): `serve:kv8`, `serve:k5v4+tail64`, …
    /// The llama.cpp f16 reference always runs.
    #[arg(long, default_value = "q8_0/q8_0,k5v4,q5_0/q5_0,q4_0/q4_0")]
    configs: String,
    /// What KL and top-1 agreement compare against: `exact` (f32 K/V, llama.cpp's
    /// f32 attention) or `f16` (f16 K/V with flash attention, whose CPU kernel
    /// accumulates V in f16).
    #[arg(long, default_value = "exact")]
    reference: String,
    /// Our formats: query tokens per attention call. 1 = every position sees
    /// the store as decoding would (the newest partial block still F16); 0 =
    /// one block, as a chunked prefill (its own block already quantized, like
    /// llama.cpp's caches, which quantize on write).
    #[arg(long, default_value_t = 1)]
    shadow_chunk: usize,
    /// Threads [default: $SILICEO_THREADS, else all cores].
    #[arg(long)]
    threads: Option<u32>,
    /// Print JSON instead of a markdown table.
    #[arg(long)]
    json: bool,
}

pub fn cmd_eval_kv(a: EvalKvArgs) -> Result<()> {
    let path = a.model.clone().unwrap_or_else(crate::default_model);
    let text =
        std::fs::read_to_string(&a.text).with_context(|| format!("--text {}", a.text.display()))?;
    let configs = a
        .configs
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(EvalFormat::parse)
        .collect::<Result<Vec<_>, _>>()?;
    if configs.is_empty() {
        bail!("--configs: name at least one K/V format");
    }
    let reference = Reference::parse(&a.reference)?;
    eprintln!("eval-kv: loading {}", path.display());
    let model = Model::load(&path, &ModelOptions::default())?;
    let tokens = model.tokenize(&text, true)?;
    let opts = EvalOptions {
        window: a.window,
        stride: a.stride.unwrap_or(a.window),
        max_windows: a.max_windows,
        configs,
        reference,
        shadow_chunk: a.shadow_chunk,
        n_threads: a.threads,
    };
    let t0 = Instant::now();
    let report = eval_kv(&model, &tokens, &opts, |done, total| {
        let el = t0.elapsed().as_secs_f64();
        let eta = el / done as f64 * (total - done) as f64;
        let bar = 30 * done / total;
        eprint!(
            "\reval-kv: [{}{}] {done}/{total} windows · {el:.0} s · ETA {eta:.0} s ",
            "#".repeat(bar),
            " ".repeat(30 - bar)
        );
        let _ = std::io::stderr().flush();
    })?;
    eprintln!();
    let name = model.name().to_string();
    let file = a.text.display().to_string();
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json(&report, &name, &file, &opts))?
        );
    } else {
        print!("{}", markdown(&report, &name, &file, &opts));
    }
    Ok(())
}

fn json(r: &EvalReport, model: &str, text: &str, o: &EvalOptions) -> serde_json::Value {
    serde_json::json!({
        "model": model,
        "text": text,
        "text_tokens": r.text_tokens,
        "reference": o.reference.label(),
        "shadow_chunk": o.shadow_chunk,
        "window": o.window,
        "stride": o.stride,
        "windows": r.windows,
        "scored_positions": r.scored,
        "configs": r.rows.iter().enumerate().map(|(i, row)| {
            let (k, v, rotate_k, tail_tokens, shadow) = match &row.config {
                EvalFormat::Llama(c) => (c.k.name().to_string(), c.v.name().to_string(), false, 0, false),
                EvalFormat::Ours(f) | EvalFormat::Served(f) => (f.k.clone(), f.v.clone(), f.rotate_k, f.tail_tokens, true),
                EvalFormat::Floor => (String::new(), String::new(), false, 0, false),
            };
            serde_json::json!({
            "name": if i == 0 { o.reference.label().to_string() } else { row.config.name() },
            "k": k,
            "v": v,
            "ours": shadow,
            "rotate_k": rotate_k,
            "tail_tokens": tail_tokens,
            "bits_per_element": row.bits_per_element,
            "kv_bytes_per_token": row.kv_bytes_per_token,
            "perplexity": row.perplexity,
            "kl_mean": row.kl_mean,
            "kl_p99": row.kl_p99,
            "top1_agreement": row.top1_agreement,
            "attn_rel_err_mean": row.attn_error.map(|e| e.0),
            "attn_rel_err_max": row.attn_error.map(|e| e.1),
        })}).collect::<Vec<_>>(),
    })
}

fn markdown(r: &EvalReport, model: &str, text: &str, o: &EvalOptions) -> String {
    let mut s = format!(
        "{model} · {text} ({} tokens) · windows of {} every {} ({} windows, {} positions scored)\n\n",
        r.text_tokens, o.window, o.stride, r.windows, r.scored
    );
    s.push_str("| K/V | bits/elem | KV bytes/token | perplexity | Δ ppl | mean KL | p99 KL | top-1 agree | attn err |\n");
    s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    let base = r.rows[0].perplexity;
    for (i, row) in r.rows.iter().enumerate() {
        let name = if i == 0 {
            o.reference.label().to_string()
        } else {
            row.config.name()
        };
        s.push_str(&format!(
            "| {} | {:.2} | {} | {:.4} | {:+.2} % | {:.5} | {:.5} | {:.2} % | {} |\n",
            name,
            row.bits_per_element,
            row.kv_bytes_per_token,
            row.perplexity,
            100.0 * (row.perplexity / base - 1.0),
            row.kl_mean,
            row.kl_p99,
            100.0 * row.top1_agreement,
            row.attn_error
                .map_or("".to_string(), |e| format!("{:.1e}", e.0))
        ));
    }
    s
}
