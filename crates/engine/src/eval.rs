//! What a KV-cache format costs in quality, measured on real text through
//! llama.cpp: perplexity, and the KL divergence of every scored position's
//! next-token distribution against the same model with an f16 KV cache.
//!
//! The text is cut into windows of `window` tokens every `stride` tokens; each
//! window is decoded from an empty cache, and the positions of its second half
//! are scored (the first half is context, as llama.cpp's `llama-perplexity`
//! does). Every configuration sees exactly the same windows; flash attention is
//! on for all of them (llama.cpp needs it for a quantized V), so the f16
//! reference differs from the others only in the KV format.

use siliceo_core::{KvType, SeqId, TokenId};

use crate::{Batch, Context, ContextOptions, EngineError, FlashAttention, Model};

/// One K/V format pair to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvConfig {
    /// K cache type.
    pub k: KvType,
    /// V cache type.
    pub v: KvType,
}

impl KvConfig {
    /// Parses `f16`, `kv8` (q8_0/q8_0), `k5v4` (q5_1/q4_1 — llama.cpp's
    /// 5-bit and 4-bit types with a minimum), or `K/V` (`q8_0/q4_0`), or one
    /// type for both.
    pub fn parse(s: &str) -> Result<KvConfig, EngineError> {
        let bad = |reason: String| EngineError::InvalidOption {
            field: "configs",
            reason,
        };
        let t = |x: &str| x.parse::<KvType>().map_err(|e| bad(e.to_string()));
        Ok(match s.trim() {
            "kv8" => KvConfig {
                k: KvType::Q8_0,
                v: KvType::Q8_0,
            },
            "k5v4" => KvConfig {
                k: KvType::Q5_1,
                v: KvType::Q4_1,
            },
            other => match other.split_once('/') {
                Some((k, v)) => KvConfig { k: t(k)?, v: t(v)? },
                None => {
                    let x = t(other)?;
                    KvConfig { k: x, v: x }
                }
            },
        })
    }

    /// `k/v` names.
    pub fn name(&self) -> String {
        format!("{}/{}", self.k, self.v)
    }
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct EvalOptions {
    /// Tokens per window.
    pub window: usize,
    /// Tokens between window starts (= `window` for disjoint windows).
    pub stride: usize,
    /// At most this many windows (0 = all).
    pub max_windows: usize,
    /// The configurations; the f16 reference is always run first.
    pub configs: Vec<KvConfig>,
    /// Threads (default: all cores).
    pub n_threads: Option<u32>,
}

/// The result for one configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalRow {
    /// The K/V formats.
    pub config: KvConfig,
    /// exp(mean negative log-likelihood of the next token).
    pub perplexity: f64,
    /// Mean KL(f16 ‖ this) over the scored positions, in nats.
    pub kl_mean: f64,
    /// 99th percentile of the per-position KL.
    pub kl_p99: f64,
    /// Share of positions whose most likely token equals the f16 run's.
    pub top1_agreement: f64,
    /// Average bits per K/V element.
    pub bits_per_element: f64,
    /// KV bytes per token for this model (all layers, K and V).
    pub kv_bytes_per_token: u64,
}

/// The whole measurement.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalReport {
    /// Tokens of the text.
    pub text_tokens: usize,
    /// Windows measured.
    pub windows: usize,
    /// Positions scored per configuration.
    pub scored: usize,
    /// One row per configuration, the f16 reference first.
    pub rows: Vec<EvalRow>,
}

/// Log-softmax of `logits` into `out` (exponentials in f32 after subtracting
/// the maximum, their sum in f64).
fn log_softmax(logits: &[f32], out: &mut Vec<f32>) {
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let sum: f64 = logits.iter().map(|&x| f64::from((x - m).exp())).sum();
    let lse = m + sum.ln() as f32;
    out.clear();
    out.extend(logits.iter().map(|&x| x - lse));
}

fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// Measures `opts.configs` on `tokens`. `progress(done, total)` is called
/// after every window.
pub fn eval_kv(
    model: &Model,
    tokens: &[TokenId],
    opts: &EvalOptions,
    mut progress: impl FnMut(usize, usize),
) -> Result<EvalReport, EngineError> {
    let bad = |field, reason: String| Err(EngineError::InvalidOption { field, reason });
    if opts.window < 4 {
        return bad(
            "window",
            format!("{} tokens is too short (at least 4)", opts.window),
        );
    }
    if opts.stride == 0 {
        return bad("stride", "must be positive".into());
    }
    if tokens.len() < opts.window {
        return bad(
            "text",
            format!(
                "{} tokens, shorter than one window of {}",
                tokens.len(),
                opts.window
            ),
        );
    }
    let mut starts: Vec<usize> = (0..=tokens.len() - opts.window)
        .step_by(opts.stride)
        .collect();
    if opts.max_windows > 0 {
        starts.truncate(opts.max_windows);
    }
    let reference = KvConfig {
        k: KvType::F16,
        v: KvType::F16,
    };
    let mut configs = vec![reference];
    configs.extend(opts.configs.iter().copied());
    let geometry = model.geometry();
    let window = opts.window as u32;
    let mut contexts = Vec::with_capacity(configs.len());
    for c in &configs {
        // llama.cpp rounds n_ctx up to a multiple of 256.
        let n_ctx = window.next_multiple_of(256);
        contexts.push(Context::new(
            model,
            ContextOptions {
                n_ctx,
                n_batch: window.min(512),
                n_ubatch: window.min(512),
                n_seq_max: 1,
                n_threads: opts.n_threads,
                n_threads_batch: opts.n_threads,
                type_k: c.k,
                type_v: c.v,
                flash_attention: FlashAttention::On,
            },
        )?);
    }
    let first_scored = opts.window / 2;
    let n_scored = opts.window - 1 - first_scored;
    let vocab = geometry.n_vocab as usize;
    let mut nll = vec![0f64; configs.len()];
    let mut kls: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    let mut agree = vec![0usize; configs.len()];
    // The reference's log-probabilities and probabilities per scored position.
    let mut ref_lp: Vec<Vec<f32>> = vec![Vec::new(); n_scored];
    let mut ref_p: Vec<Vec<f32>> = vec![Vec::new(); n_scored];
    let mut lp = Vec::with_capacity(vocab);
    let seq = SeqId(0);
    let mut batch = Batch::new();
    for (wi, &start) in starts.iter().enumerate() {
        let win = &tokens[start..start + opts.window];
        for (ci, ctx) in contexts.iter_mut().enumerate() {
            ctx.clear();
            let chunk = ctx.n_batch() as usize;
            for (c, part) in win.chunks(chunk).enumerate() {
                batch.clear();
                for (i, &t) in part.iter().enumerate() {
                    let pos = c * chunk + i;
                    batch.push(
                        t,
                        pos as u32,
                        seq,
                        pos >= first_scored && pos + 1 < opts.window,
                    );
                }
                ctx.decode(&batch)?;
                for (i, _) in part.iter().enumerate() {
                    let pos = c * chunk + i;
                    if pos < first_scored || pos + 1 >= opts.window {
                        continue;
                    }
                    log_softmax(ctx.logits(i)?, &mut lp);
                    let next = win[pos + 1].0 as usize;
                    nll[ci] -= lp[next] as f64;
                    let slot = pos - first_scored;
                    if ci == 0 {
                        ref_lp[slot].clone_from(&lp);
                        ref_p[slot].clear();
                        ref_p[slot].extend(lp.iter().map(|&a| a.exp()));
                        kls[0].push(0.0);
                        agree[0] += 1;
                    } else {
                        let r = &ref_lp[slot];
                        // Σ p·(log p − log q): f32 lanes of 1024, summed in f64.
                        let kl: f64 = r
                            .chunks(1024)
                            .zip(ref_p[slot].chunks(1024))
                            .zip(lp.chunks(1024))
                            .map(|((a, p), b)| {
                                f64::from(
                                    a.iter()
                                        .zip(p)
                                        .zip(b)
                                        .map(|((&a, &p), &b)| p * (a - b))
                                        .sum::<f32>(),
                                )
                            })
                            .sum();
                        kls[ci].push(kl.max(0.0));
                        if argmax(r) == argmax(&lp) {
                            agree[ci] += 1;
                        }
                    }
                }
            }
        }
        progress(wi + 1, starts.len());
    }
    let total = starts.len() * n_scored;
    let rows = configs
        .iter()
        .enumerate()
        .map(|(ci, c)| {
            let mut k = std::mem::take(&mut kls[ci]);
            k.sort_by(f64::total_cmp);
            let p99 = k
                .get(((k.len() as f64 * 0.99).ceil() as usize).saturating_sub(1))
                .copied()
                .unwrap_or(0.0);
            EvalRow {
                config: *c,
                perplexity: (nll[ci] / total as f64).exp(),
                kl_mean: k.iter().sum::<f64>() / total as f64,
                kl_p99: p99,
                top1_agreement: agree[ci] as f64 / total as f64,
                bits_per_element: (c.k.bits_per_element() + c.v.bits_per_element()) / 2.0,
                kv_bytes_per_token: geometry.kv_bytes_per_token(c.k, c.v),
            }
        })
        .collect();
    Ok(EvalReport {
        text_tokens: tokens.len(),
        windows: starts.len(),
        scored: total,
        rows,
    })
}
